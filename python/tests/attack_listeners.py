"""Another local user's attack on a run's rendezvous, for the end-to-end tests: until killed,
watch /proc/net/tcp{,6} for sockets that start listening after this script did, and hit each new
one as one would hit a `torch.distributed` TCPStore: junk keys in its wire format, random bytes,
oversized lengths, and connections held open in silence. Also try to read or write every file
of `--store-dir` (the drafters' FileStore directory).

Writes what it did to `--report` (JSON) whenever that changes, so the test can check the attack
took place. Run it with `python -I` as the attacking user.
"""

import argparse
import json
import os
import random
import socket
import struct
import time


def listening():
    """(address family, host, port) of every socket in the LISTEN state."""
    found = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 4 or fields[3] != "0A":
                continue
            port = int(fields[1].rsplit(":", 1)[1], 16)
            host = "127.0.0.1" if family == socket.AF_INET else "::1"
            found.add((family, host, port))
    return found


def junk_messages(rng):
    """TCPStore-shaped junk: a query type byte, then a length-prefixed key and value with
    lengths large enough to make a careless reader allocate without end; then noise."""
    key = f"junk/{rng.getrandbits(32)}".encode()
    yield struct.pack("<B", 0) + struct.pack("<Q", len(key)) + key + struct.pack("<Q", 1 << 40)
    yield struct.pack("<I", 0x3C85F7CE) + bytes(rng.getrandbits(8) for _ in range(4096))
    yield bytes(rng.getrandbits(8) for _ in range(65536))


def hit(target, rng, held):
    family, host, port = target
    try:
        for message in junk_messages(rng):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect((host, port))
                s.sendall(message)
        silent = socket.socket(family, socket.SOCK_STREAM)
        silent.settimeout(0.5)
        silent.connect((host, port))
        held.append(silent)
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--store-dir", required=True)
    a = ap.parse_args()
    rng = random.Random(7)
    before = listening()
    report = {"attacked": [], "store_files_touched": [], "store_dir_errors": []}
    attacked, held = set(), []

    def write():
        tmp = a.report + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, a.report)

    write()
    while True:
        for target in sorted(listening() - before - attacked):
            attacked.add(target)
            if hit(target, rng, held):
                report["attacked"].append(target[2])
                write()
        try:
            for name in os.listdir(a.store_dir):
                path = os.path.join(a.store_dir, name)
                with open(path, "ab") as f:
                    f.write(b"junk")
                report["store_files_touched"].append(name)
                write()
        except OSError as e:
            if str(e.errno) not in report["store_dir_errors"]:
                report["store_dir_errors"].append(str(e.errno))
                write()
        held = held[-200:]
        time.sleep(0.05)


if __name__ == "__main__":
    main()
