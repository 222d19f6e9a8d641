"""`python -m dflash_orch.bench_step REQUEST`: timed training steps of the torch drafter on this
process's device at any shape, without a target model: the request `dflash-worker
--drafter-bench` reads (the target's widths, drafter layers, anchors, sequences), so both engines
are timed on one workload. The GPU check runs it at the seeds' shape.

A step is what a torch drafter worker does with one micro-batch per optimiser step:
`TorchDrafter.micro_batch` (anchor chunks, the loss in pieces) and `TorchDrafter.step` (clipping,
AdamW). Prints one JSON object: per-step seconds, the median, tokens/s, the losses, the peak
device memory; on a GPU also the features' copy from a shared mapping to the GPU (`ring_copy`),
pageable and once registered as the engine registers its ring (`serve.pin_mapping`), in GB/s,
which the accounting's roofline takes as 25 and 50.
"""

import json
import math
import os
import random
import statistics
import sys
import time

FIELDS = {"target", "draft_layers", "target_layer_ids", "block_size", "num_anchors",
          "anchor_chunk", "sequences", "seq_len", "prompt", "dtype", "gamma", "warmup", "steps",
          "seed", "compile"}


class BadRequest(ValueError):
    pass


def json_object(text, what):
    """`text` as a JSON object, else `BadRequest` saying it is not `what`."""
    try:
        req = json.loads(text)
    except ValueError as e:
        raise BadRequest(f"not a {what}: {e}") from None
    if not isinstance(req, dict):
        raise BadRequest(f"not a {what}: not a JSON object")
    return req


def parse(text):
    """The request, checked field by field (a bad one is named before anything is allocated)."""
    req = json_object(text, "drafter-bench request")
    unknown = sorted(set(req) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}")
    t = req.get("target")
    if not isinstance(t, dict):
        raise BadRequest("target must be an object of the target's config.json fields")

    def count(where, name, lo=1):
        v = where.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise BadRequest(f"{name} must be an integer of at least {lo}, got {v!r}")
        return v

    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads"):
        count(t, name)
    for name in ("draft_layers", "block_size", "num_anchors", "sequences", "seq_len", "steps"):
        count(req, name)
    count(req, "warmup", 0)
    count(req, "prompt", 0)
    if req["prompt"] + 2 > req["seq_len"]:
        raise BadRequest(f"prompt ({req['prompt']}) leaves no token with loss in sequences of "
                         f"{req['seq_len']}")
    ids = req.get("target_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("target_layer_ids must be a non-empty list")
    if req.get("anchor_chunk") is not None:
        count(req, "anchor_chunk")
    if not isinstance(req.get("compile", False), bool):
        raise BadRequest(f"compile must be true or false, got {req.get('compile')!r}")
    if req.get("dtype") not in ("f32", "bf16"):
        raise BadRequest(f"dtype must be f32 or bf16, got {req.get('dtype')!r}")
    if t["num_attention_heads"] % t["num_key_value_heads"]:
        raise BadRequest("target.num_attention_heads is not a multiple of num_key_value_heads")
    return req


def filler(rows, cols, k, scale, dtype, device):
    """sin(i * phi * k) * scale: deterministic values of no pattern a drafter can exploit, made on
    the device (as `dflash-worker --drafter-bench` makes them)."""
    import torch

    i = torch.arange(rows * cols, device=device, dtype=torch.float32)
    return (torch.sin(i * (0.6180339887 * k)) * scale).view(rows, cols).to(dtype)


def drafter_for(target, draft_layers, block_size, states, dtype, device, heads=None, gamma=None,
                anchor_chunk=None, weight_decay=0.01, rope_theta=None, mask_token_id=None, seed=0,
                compile_=False):
    """A torch drafter for a target of `config.json` fields `target`, with fresh weights from
    `seed` (no checkpoint) and the target's embedding and lm_head `heads` (the fillers of
    `dflash-worker --drafter-bench` when not given)."""
    from .drafter import TorchDrafter
    from .target import dtype_of

    hidden, n_heads, vocab = target["hidden_size"], target["num_attention_heads"], target["vocab_size"]
    spec = {
        "shape": {"hidden": hidden, "intermediate": target["intermediate_size"], "layers": draft_layers,
                  "heads": n_heads, "kv_heads": target["num_key_value_heads"],
                  "head_dim": target.get("head_dim") or hidden // n_heads,
                  "rms_eps": target.get("rms_norm_eps", 1e-6),
                  "rope_theta": rope_theta or target.get("rope_theta", 1e4), "vocab": vocab},
        "block_size": block_size, "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
        "states": states, "gamma": gamma, "distill": None, "anchor_chunk": anchor_chunk,
        "weight_decay": weight_decay, "dtype": dtype, "feature_dtype": dtype, "compile": compile_,
    }
    if heads is None:
        compute = dtype_of(dtype)
        heads = (filler(vocab, hidden, 1.0, 0.02, compute, device),
                 filler(vocab, hidden, 1.7, 0.02, compute, device))
    drafter = TorchDrafter(spec, heads=heads)
    drafter.initialise(seed)
    return drafter


def run(req):
    import torch

    from .target import device_for, dtype_of

    device = device_for(os.environ.get("CUDA_VISIBLE_DEVICES"))
    t = req["target"]
    hidden = t["hidden_size"]
    compute = dtype_of(req["dtype"])
    drafter = drafter_for(t, req["draft_layers"], req["block_size"], len(req["target_layer_ids"]),
                          req["dtype"], device, gamma=req.get("gamma"),
                          anchor_chunk=req.get("anchor_chunk"), seed=req.get("seed", 0),
                          compile_=req.get("compile", False))
    n, length, prompt = req["sequences"], req["seq_len"], req["prompt"]
    tokens_n = n * length
    width = len(req["target_layer_ids"]) * hidden
    features = filler(tokens_n, width, 2.3, 1.0, compute, device)
    rng = random.Random(req.get("seed", 0))
    tokens = [rng.randrange(t["vocab_size"] - 1) for _ in range(tokens_n)]
    mask = [1 if i % length >= prompt else 0 for i in range(tokens_n)]
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times, losses = [], []
    for step in range(req["warmup"] + req["steps"]):
        positions = range(prompt, length - 1)
        sequences = [(i * length, length,
                      sorted(rng.sample(positions, min(req["num_anchors"], len(positions)))))
                     for i in range(n)]
        sync()
        started = time.perf_counter()
        out = drafter.micro_batch(features, tokens, mask, sequences, 1)
        drafter.step(6e-4, 1.0, False)
        sync()
        if step >= req["warmup"]:
            times.append(time.perf_counter() - started)
        losses.append(out["loss"])
    median = statistics.median(times)
    ring_copy = copy_rates(features, device) if cuda else None
    return {
        "engine": "torch", "torch": torch.__version__, "device": str(device),
        "dtype": req["dtype"], "attention": drafter.attention, "path": drafter.path,
        "kernels": drafter.k.label, "compile_s": drafter.k.compile_s,
        "tokens": tokens_n,
        "step_s": times, "median_s": median, "tokens_per_s": tokens_n / median,
        "losses": losses,
        "ring_copy": ring_copy,
        "peak_gpu_memory_mib": round(torch.cuda.max_memory_allocated(device) / 2**20)
        if cuda else None,
    }


def copy_rates(features, device, repeat=3):
    """GB/s of copying `features`' bytes (at most 1 GiB) from a shared mapping, as the ring is,
    to `device`: pageable, then registered page-locked; and how the registration went."""
    import mmap

    import torch

    from .serve import pin_mapping

    size = min(features.numel() * features.element_size(), 1 << 30)
    ring = mmap.mmap(-1, size)
    host = torch.frombuffer(ring, dtype=torch.uint8, count=size)
    host.fill_(1)
    on_device = torch.empty(size, dtype=torch.uint8, device=device)

    def rate():
        best = math.inf
        for _ in range(repeat):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            on_device.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
        return round(size / best / 1e9, 2)

    pageable = rate()
    how = pin_mapping(ring, device)
    return {"bytes": size, "pageable_gbps": pageable, "ring": how,
            "registered_gbps": rate() if how == "page-locked" else None}


def main(argv):
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        text = sys.stdin.read() if argv[0] == "-" else open(argv[0]).read()
        req = parse(text)
    except (OSError, BadRequest) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        report = run(req)
    except Exception as e:  # noqa: BLE001 - one line for the caller, not a traceback
        kind = "out of memory" if "out of memory" in str(e).lower() else type(e).__name__
        print(f"error: {kind}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0 if all(math.isfinite(x) for x in report["losses"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
