"""The compute child of a torch-engine worker: `python -m dflash_orch.serve`.

`dflash-worker` starts it, writes one JSON request per line on its stdin and reads one JSON answer
per line from its stdout; everything else this process or its libraries print goes to stderr (the
worker's log). The worker owns the rings: it tells this process which file to map and which byte
range of it to fill, and publishes the slot itself once the answer says the bytes are there.

Every request carries `"id": n` (a count from 1) and its answer carries the same `"id"` (null when
the request could not be read far enough to find one). The worker reads one answer per request,
in order, and treats anything else as a protocol fault: it kills this process and says why. An
answer line that is not UTF-8 JSON, is longer than 4 MiB, or names another id is one. Protocol
2 added the ids; a worker and a package of different protocols refuse each other at `init`.

Requests (the answers' `"ok": true` and `"id"` not repeated below):
- `{"op": "init", "protocol": 2, "role": "target", "model": DIR, "layer_ids": [k, ...],
  "final": bool, "dtype": "f32"|"bf16", "feature_dtype": "f32"|"bf16", "token_budget": N,
  "ring": PATH, "threads": N}` -> `{"ok": true, "protocol": 2, "vocab": V, "layers": L,
  "hidden": H, "attention": "sdpa", "device": "cpu"|"cuda:0", "ring": HOW, "torch": VERSION,
  "transformers": VERSION}`. `ring` says how the GPU reaches the ring: "page-locked" (the
  mapping registered with CUDA once, see `pin_mapping`), "pageable: WHY" (registration failed:
  copies go through CUDA's staging buffers), or "host" on a CPU. The features are the hidden states `k + 1` of `layer_ids`, then, with
  `final`, the last hidden state (after the final norm, index `L`) that distillation reads.
- `{"op": "forward", "tokens": [...], "lengths": [...], "offset": O, "bytes": B}` -> writes the
  features `[tokens, n * hidden]` into bytes `O .. O + B` of the ring and answers
  `{"ok": true, "nonfinite": null | j}` (j: the position in `indices` of the first layer whose
  features hold a NaN or an infinity).
- `{"op": "init", "role": "drafter", "model": DIR, "names": [...], "shape": {...},
  "block_size": B, "mask_token_id": M, "states": n, "gamma": g|null, "distill": [share, T]|null,
  "anchor_chunk": c|null, "weight_decay": wd, "dtype", "feature_dtype", "ring", "weights": DIR,
  "adam_t": t, "threads", "group": null|{"rank", "world", "timeout_s", "store": PATH |
  "address", "port"}}` ->
  loads the drafter (`dflash_orch.drafter`) with the weights and moments in `weights` (a
  checkpoint's `model.safetensors` and `optimizer.safetensors`); with `group`, joins the
  data-parallel drafters' process group (`dflash_orch.parallel`).
- `{"op": "train", "offset", "bytes", "tokens": [...], "loss_mask": [...], "width": W,
  "sequences": [[start, length, [anchor, ...]], ...], "accum": k}` -> forward and backward of one
  micro-batch, `{"loss", "weight", "anchors", "correct": [...], "counted": [...]}`.
- `{"op": "step", "lr", "clip", "skip"}` -> `{"grad_norm": g|null}` or `{"nonfinite": NAME}`.
- `{"op": "snapshot", "dir": DIR}` -> writes the weights and moments there (the checkpoint's own
  tensor files; refused when a value is not finite), `{"adam_t": t}`.
- `{"op": "check_replicas"}` -> data-parallel drafters (every rank at once): `{}` when every
  rank's weights have rank 0's checksums, else an error naming the first tensor that differs.

A request that cannot be done answers `{"ok": false, "error": "...", "id": n}` and the child goes
on; a request it cannot read ends it (exit 2). End of input ends it (exit 0).
"""

import json
import mmap
import os
import sys
import traceback

from . import PROTOCOL


# How a failed rendezvous of the data-parallel drafters starts its error: the worker exits as if
# crashed (the orchestrator restarts the group on another port) instead of failing the run.
RENDEZVOUS_FAILED = "the drafters' rendezvous failed"


class Refused(Exception):
    """A request that is wrong in itself: its message goes back to the worker."""


def pin_mapping(mapping, device):
    """Registers `mapping` (an mmap: the worker's feature ring) with CUDA as page-locked memory,
    once per process, so that copies between it and the GPU run at the link's full bandwidth and
    `non_blocking` ones are asynchronous. Returns how the ring is reached, for the init answer:
    "host" on a CPU, "page-locked", or "pageable: WHY" where CUDA refuses (the copies then work
    as before, through staging buffers)."""
    if device.type != "cuda":
        return "host"
    import ctypes

    import torch

    size = len(mapping)
    try:
        cudart = torch.cuda.cudart()
        # The buffer export keeps the mapping open for the process's life, as registered
        # memory must be.
        address = ctypes.addressof((ctypes.c_char * size).from_buffer(mapping))
        code = int(cudart.cudaHostRegister(address, size, 0))
    except Exception as e:  # a torch without the binding, a mapping of no size
        return f"pageable: {type(e).__name__}: {e}"
    if code != 0:
        # The failure is also CUDA's last error, which the next kernel launch's check would
        # report as its own: read it here.
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()
        return f"pageable: cudaHostRegister of {size} bytes failed (CUDA error {code})"
    return "page-locked"


def _answer_channel():
    """The protocol's stdout, kept private: fd 1 becomes stderr, so that a library's print can
    never be read as an answer."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    return os.fdopen(fd, "w", buffering=1)


class Server:
    def __init__(self):
        self.target = None
        self.drafter = None
        self.ring = None
        self.map = None

    def init(self, req):
        import torch

        from .target import TorchTarget, device_for, dtype_of, num_layers

        if req.get("protocol") != PROTOCOL:
            raise Refused(
                f"dflash-worker speaks protocol {req.get('protocol')}, this dflash_orch package "
                f"{PROTOCOL} ({__file__}): install the package of the same tree"
            )
        role = req.get("role")
        if role not in ("target", "drafter"):
            raise Refused(f"role {role!r}: this engine serves the target and drafter roles")
        threads = int(req.get("threads") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        self.map_ring(req["ring"])
        if role == "drafter":
            from .drafter import TorchDrafter

            self.drafter = TorchDrafter(req)
            ring = pin_mapping(self.map, self.drafter.device)
            group = req.get("group")
            if group:
                from .parallel import Group

                where = (group["store"] if group.get("store") is not None
                         else f"{group.get('address')}:{group.get('port')}")
                try:
                    from .authstore import key_from_env

                    self.drafter.group = Group(
                        int(group["rank"]), int(group["world"]), self.drafter.device,
                        float(group.get("timeout_s") or 120.0), store=group.get("store"),
                        address=group.get("address"), port=group.get("port"),
                        key=key_from_env())
                except Exception as e:  # a port taken meanwhile, a peer that never came
                    raise Refused(f"{RENDEZVOUS_FAILED} at {where} "
                                  f"(rank {group['rank']} of {group['world']}): "
                                  f"{type(e).__name__}: {e}") from e
            return {
                "protocol": PROTOCOL,
                "attention": self.drafter.attention,
                "compile": self.drafter.k.label,
                "device": str(self.drafter.device),
                "ring": ring,
                "torch": torch.__version__,
            }
        # The target's role alone needs `transformers` (a drafter starts seconds sooner).
        import transformers

        device = device_for(os.environ.get("CUDA_VISIBLE_DEVICES"))
        layers = num_layers(req["model"])
        indices = [int(k) + 1 for k in req["layer_ids"]] + ([layers] if req.get("final") else [])
        self.target = TorchTarget(
            req["model"],
            indices,
            dtype_of(req["dtype"]),
            device,
            dtype_of(req["feature_dtype"]),
            packing=req.get("packing") or "off",
        )
        self.token_budget = int(req["token_budget"])
        ring = pin_mapping(self.map, device)
        return {
            "protocol": PROTOCOL,
            "vocab": self.target.vocab_size,
            "layers": self.target.num_layers,
            "hidden": self.target.hidden,
            "attention": self.target.attention,
            "packing": self.target.packing,
            "device": str(device),
            "ring": ring,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }

    def map_ring(self, path):
        self.ring = open(path, "r+b")
        self.map = mmap.mmap(self.ring.fileno(), 0)

    def features(self, req, tokens, width, dtype):
        """The `[tokens, width]` features at the request's byte range of the ring (a view of
        the mapping, no copy)."""
        import torch

        offset, size = int(req["offset"]), int(req["bytes"])
        if offset < 0 or size < 0 or offset + size > len(self.map):
            raise Refused(f"bytes {offset}..{offset + size} are outside the ring "
                          f"({len(self.map)} bytes)")
        element = torch.empty((), dtype=dtype).element_size()
        need = tokens * width * element
        if need > size:
            raise Refused(f"{tokens} tokens of features need {need} bytes, the slot has {size}")
        raw = torch.frombuffer(self.map, dtype=torch.uint8, count=need, offset=offset)
        return raw.view(dtype).view(tokens, width)

    def forward(self, req):
        if self.target is None:
            raise Refused("forward before init")
        tokens = req["tokens"]
        lengths = req["lengths"]
        width = len(self.target.indices) * self.target.hidden
        out = self.features(req, len(tokens), width, self.target.feature_dtype)
        nonfinite = self.target.features_into(tokens, lengths, out, self.token_budget)
        # The bytes are in the shared mapping before the answer is written; the worker reads the
        # answer, then publishes the slot (its Release store orders our writes for the reader).
        return {"nonfinite": nonfinite}


    def train(self, req):
        if self.drafter is None:
            raise Refused("train before init")
        tokens = req["tokens"]
        mask = req["loss_mask"]
        if len(mask) != len(tokens):
            raise Refused(f"{len(tokens)} tokens, {len(mask)} loss-mask entries")
        width = int(req["width"])
        d = self.drafter
        if width != (d.states + (1 if d.distill else 0)) * d.hidden:
            raise Refused(f"features of width {width}; this drafter reads "
                          f"{(d.states + (1 if d.distill else 0)) * d.hidden}")
        features = self.features(req, len(tokens), width, d.feature_dtype)
        sequences = []
        for start, length, anchors in req["sequences"]:
            if start < 0 or length < 0 or start + length > len(tokens):
                raise Refused(f"sequence {start}+{length} is outside the batch's {len(tokens)} tokens")
            if any(not 0 <= p < length for p in anchors):
                raise Refused(f"an anchor of sequence {start}+{length} is outside it")
            sequences.append((int(start), int(length), [int(p) for p in anchors]))
        return d.micro_batch(features, tokens, mask, sequences, int(req["accum"]))

    def step(self, req):
        if self.drafter is None:
            raise Refused("step before init")
        return self.drafter.step(float(req["lr"]), float(req["clip"]), bool(req["skip"]))

    def snapshot(self, req):
        if self.drafter is None:
            raise Refused("snapshot before init")
        # The files are the checkpoint's own (the worker publishes them where they lie): a
        # non-finite value is refused before anything is written.
        bad = self.drafter.nonfinite()
        if bad is not None:
            raise Refused(f"tensor {bad} holds a non-finite value; no checkpoint is written")
        return {"adam_t": self.drafter.save(req["dir"])}

    def check_replicas(self, req):
        if self.drafter is None or self.drafter.group is None:
            raise Refused("check_replicas without a process group")
        self.drafter.check_replicas()
        return {}


def answer(server, req):
    """The answer to one request, naming its id: the op's fields with `"ok": true`, or
    `"ok": false` and the error."""
    try:
        op = req["op"]
        if op == "init":
            reply = server.init(req)
        elif op in ("forward", "train", "step", "snapshot", "check_replicas"):
            reply = getattr(server, op)(req)
        else:
            raise Refused(f"unknown op {op!r}")
        reply["ok"] = True
    except Refused as e:
        reply = {"ok": False, "error": str(e)}
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    reply["id"] = req.get("id")
    return reply


def main():
    answers = _answer_channel()
    server = Server()
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            req = json.loads(line.decode("utf-8"))
            if not isinstance(req, dict) or "op" not in req:
                raise ValueError("not an object with an op")
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            print(f"dflash_orch.serve: unreadable request ({e}): {line[:200]!r}", file=sys.stderr)
            sys.exit(2)
        answers.write(json.dumps(answer(server, req)) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
