"""Checks of `dflash_orch.authstore` (run by tests/tests/torch_engine.rs): two drafter ranks form a
gloo group through the authenticated store and sum a tensor, while the store is attacked: a peer
without the key, a peer with another key, junk bytes, a hundred silent connections, a replayed
authentic frame and a truncated one. The attackers are refused and dropped; the ranks carry on.
Prints one JSON line of findings; exits 1 on a failed check.

Usage: check_authstore.py            (the whole check: starts the two ranks itself)
       check_authstore.py rank R PORT KEYHEX
"""

import datetime
import json
import os
import socket
import struct
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from dflash_orch import authstore


def rank_main(rank, port, key):
    if rank == 0:
        server = authstore.StoreServer("127.0.0.1", port, key)
        with open(os.environ["CHECK_READY"], "w") as f:
            f.write(str(server.port))
    store = authstore.AuthStore("127.0.0.1", port, key, timeout_s=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    # Rank 0 waits for the attacks to end before leaving (its process serves the store).
    if rank == 0:
        store.wait(["attacks_done"], datetime.timedelta(seconds=60))
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "sum": float(t)}))
    return 0


class Tap:
    """A socket that keeps what was sent through it."""

    def __init__(self, sock):
        self.sock, self.sent = sock, []

    def sendall(self, data):
        self.sent.append(data)
        self.sock.sendall(data)

    def recv(self, n):
        return self.sock.recv(n)


def expect_refused(what, fn, findings):
    try:
        fn()
    except (PermissionError, ConnectionError, OSError, ValueError, TimeoutError) as e:
        findings[what] = f"refused: {type(e).__name__}"
        return
    findings[what] = "ACCEPTED"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        return rank_main(int(sys.argv[2]), int(sys.argv[3]), bytes.fromhex(sys.argv[4]))
    key = os.urandom(32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = f"/tmp/check-authstore-{os.getpid()}"
    env = dict(os.environ, CHECK_READY=ready)
    ranks = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(port), key.hex()],
                              stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.unlink(ready)
    findings = {}
    # A hundred silent connections, held through the whole check.
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    # No key, another key.
    expect_refused("another key", lambda: authstore.AuthStore("127.0.0.1", port, os.urandom(32), 2),
                   findings)

    def junk():
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.recv(64)
            s.sendall(b"\x00" * 8 + struct.pack("<Q", 1 << 40) + os.urandom(1024))
            if s.recv(64) == b"":
                raise ConnectionError("closed")
    expect_refused("junk", junk, findings)
    # A replayed authentic frame: record a real client's first request, then send it on a new
    # connection after a handshake of its own (a new session key: the MAC fails).
    real = authstore.AuthStore("127.0.0.1", port, key, 10)
    tap = Tap(real.channel.sock)
    real.channel.sock = tap
    real.set("probe", b"x")
    frame = tap.sent[0]
    real_send = tap.sock.sendall
    replay = authstore.AuthStore("127.0.0.1", port, key, 10)

    def replayed():
        replay.channel.sock.sendall(frame)
        if replay.channel.sock.recv(64) == b"":
            raise ConnectionError("closed")
    expect_refused("replayed frame", replayed, findings)
    # The same frame again on its own connection (its sequence number is spent).
    def again():
        real_send(frame)
        real.channel.receive()
    expect_refused("repeated frame", again, findings)
    # A truncated frame, then the connection closes.
    trunc = authstore.AuthStore("127.0.0.1", port, key, 10)
    trunc.channel.sock.sendall(frame[:10])
    trunc.channel.sock.close()
    # The store still serves the ranks: tell rank 0 the attacks are over.
    authstore.AuthStore("127.0.0.1", port, key, 10).set("attacks_done", b"1")
    outs = [json.loads(r.communicate(timeout=120)[0].strip().splitlines()[-1]) for r in ranks]
    for s in silent:
        s.close()
    findings["sums"] = [o["sum"] for o in outs]
    findings["exit_codes"] = [r.returncode for r in ranks]
    print(json.dumps(findings))
    ok = (findings["sums"] == [3.0, 3.0] and findings["exit_codes"] == [0, 0]
          and all(str(v).startswith("refused") for k, v in findings.items()
                  if k not in ("sums", "exit_codes")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
