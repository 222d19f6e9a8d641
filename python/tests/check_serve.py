"""The pipe protocol of `dflash_orch.serve`, checked without a model: every answer names the id of
the request it answers (refusals and failures too), the protocol is refused by number, and a
request that cannot be read ends the server (exit 2) without an answer. Also the ring's
registration with CUDA (`pin_mapping`): nothing on a CPU, and where CUDA cannot register it
(no GPU here) the ring stays pageable, says why, and stays usable.

  check_serve.py
      Runs the checks; prints one JSON line per check and exits 1 at the first that fails.
"""

import json
import os
import subprocess
import sys

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, PYTHON_DIR)

from dflash_orch import PROTOCOL  # noqa: E402
from dflash_orch.serve import Server, answer, pin_mapping  # noqa: E402


def check(name, ok, detail):
    print(json.dumps({"check": name, "ok": bool(ok), "detail": detail}), flush=True)
    if not ok:
        sys.exit(1)


def in_process():
    server = Server()
    cases = [
        ({"op": "forward", "id": 7}, False, "forward before init"),
        ({"op": "train", "id": 8}, False, "train before init"),
        ({"op": "nonsense", "id": 9}, False, "unknown op 'nonsense'"),
        ({"op": "init", "id": 10, "protocol": PROTOCOL - 1, "role": "target"}, False,
         f"speaks protocol {PROTOCOL - 1}"),
        ({"op": "init", "id": 11, "protocol": PROTOCOL, "role": "judge"}, False, "role 'judge'"),
        ({"op": "step"}, False, "step before init"),
    ]
    for req, ok, says in cases:
        reply = answer(server, req)
        check(f"answer to {req['op']} names its id", reply.get("id") == req.get("id")
              and "id" in reply, reply)
        check(f"answer to {req['op']} says why", reply["ok"] is ok and says in reply.get("error", ""),
              reply)


def over_the_pipe():
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, PYTHONUNBUFFERED="1")
    requests = [
        {"op": "forward", "id": 1},
        {"op": "step", "id": 2, "lr": 0.1, "clip": 1.0, "skip": False},
        {"op": "nonsense", "id": 3},
    ]
    lines = "".join(json.dumps(r) + "\n" for r in requests) + "\n"
    done = subprocess.run([sys.executable, "-m", "dflash_orch.serve"], input=lines.encode(),
                          capture_output=True, env=env, cwd=PYTHON_DIR, timeout=120)
    answers = [json.loads(line) for line in done.stdout.decode().splitlines()]
    check("one answer per request, in order, each naming its request",
          [a.get("id") for a in answers] == [1, 2, 3] and all(a["ok"] is False for a in answers),
          answers)
    check("end of input ends it (exit 0)", done.returncode == 0, done.returncode)
    for bad in [b"not json\n", b"[1, 2]\n", b'{"id": 4}\n', b"\xff\xfe\n"]:
        done = subprocess.run([sys.executable, "-m", "dflash_orch.serve"],
                              input=json.dumps(requests[0]).encode() + b"\n" + bad,
                              capture_output=True, env=env, cwd=PYTHON_DIR, timeout=120)
        answers = done.stdout.decode().splitlines()
        check(f"an unreadable request ({bad[:10]!r}) ends it with exit 2 and no answer",
              done.returncode == 2 and len(answers) == 1
              and b"unreadable request" in done.stderr, [done.returncode, answers])


def ring_registration():
    import mmap

    import torch

    ring = mmap.mmap(-1, 1 << 16)
    check("a CPU's ring is the host's", pin_mapping(ring, torch.device("cpu")) == "host", None)
    if torch.cuda.is_available():
        how = pin_mapping(ring, torch.device("cuda"))
        check("a GPU registers the ring", how == "page-locked", how)
        return
    how = pin_mapping(ring, torch.device("cuda"))
    check("without a GPU the ring stays pageable and says why",
          how.startswith("pageable: ") and len(how) > len("pageable: "), how)
    view = torch.frombuffer(ring, dtype=torch.uint8, count=8)
    view.fill_(7)
    check("and stays usable", ring[:8] == b"\x07" * 8, list(ring[:8]))


if __name__ == "__main__":
    in_process()
    over_the_pipe()
    ring_registration()
