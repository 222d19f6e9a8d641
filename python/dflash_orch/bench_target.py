"""One target micro-batch on this process's device, rows of one length against packed rows.

    python -m dflash_orch.bench_target - < request.json

The request (JSON on stdin): `target` (a Qwen3 `config.json`'s widths), `target_layer_ids`,
`seq_lens` (one micro-batch each: sequences of about that length filling `budget` tokens, of
distinct lengths as real data has them), `budget`, `dtype` (`f32` or `bf16`), `warmup`, `iters`,
and `check` (architectures of a tiny random model whose packed features are compared with rows
of one length on this device: `qwen3`, `gpt_oss`, the latter with attention sinks and sliding
windows). The model has random weights and only the layers up to the last feature layer (the
forward stops there). Prints one JSON object: per length and packing the median seconds, tokens/s
and model FLOP/s, and the packed features' largest difference from the rows', relative to their
largest magnitude; per checked architecture the same difference and which kernel packed it.
"""

import json
import os
import statistics
import sys
import time

import torch

from .account import target_lengths, useful_target_flops
from .bench_step import BadRequest, json_object
from .target import TorchTarget, device_for, dtype_of


def parse(text):
    req = json_object(text, "target-bench request")
    t = req.get("target")
    if not isinstance(t, dict):
        raise BadRequest("target must be an object of a Qwen3 config.json's fields")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "vocab_size"):
        if not isinstance(t.get(name), int) or not 1 <= t[name] <= 1 << 20:
            raise BadRequest(f"target.{name} must be an integer from 1 to 1048576")
    ids = req.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and 0 <= i < 512 for i in ids):
        raise BadRequest("target_layer_ids must be a non-empty list of layer ids (0 to 511)")
    lens = req.get("seq_lens")
    budget = req.get("budget")
    if not isinstance(budget, int) or not 1 <= budget <= 1 << 22:
        raise BadRequest("budget must be an integer from 1 to 4194304")
    if not isinstance(lens, list) or not all(
            isinstance(n, int) and 1 <= n <= budget for n in lens):
        raise BadRequest("seq_lens must be a list of lengths from 1 to the budget")
    for name in ("warmup", "iters"):
        if not isinstance(req.get(name, 1), int) or not 0 <= req.get(name, 1) <= 100:
            raise BadRequest(f"{name} must be an integer from 0 to 100")
    dtype_of(req.get("dtype", "bf16"))
    if not set(req.get("check", [])) <= {"qwen3", "gpt_oss"}:
        raise BadRequest("check names architectures among qwen3 and gpt_oss")
    return req


def _model(config, dtype, device, attention):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attention)
    model.eval()
    model.requires_grad_(False)
    return model


def _timed(target, tokens, lengths, out, budget, warmup, iters, device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(warmup + iters):
        sync()
        start = time.perf_counter()
        target.features_into(tokens, lengths, out, budget)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _relative(a, b):
    scale = b.float().abs().max().item() or 1.0
    return (a.float() - b.float()).abs().max().item() / scale


def _check(arch, dtype, device):
    """A tiny random model of `arch` on this device: packed rows against rows of one length."""
    from transformers import AutoConfig

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=4096)
    if arch == "gpt_oss":
        config = AutoConfig.for_model("gpt_oss", **common, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=64,
                                      layer_types=["sliding_attention", "full_attention"] * 2)
        attention = "eager"  # the rows' reference: sinks and windows as transformers writes them
    else:
        config = AutoConfig.for_model("qwen3", **common)
        attention = "sdpa"
    torch.manual_seed(0)
    model = _model(config, dtype, device, attention)
    indices = [1, 3, 4]
    target = TorchTarget(None, indices, dtype, device, dtype, model=model, packing="on")
    lengths = [300, 7, 129, 1, 64, 500]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (sum(lengths),), generator=gen).tolist()
    width = len(indices) * target.hidden
    packed = torch.zeros(sum(lengths), width, dtype=dtype)
    target.features_into(tokens, lengths, packed, 600)
    kernel = target.packing
    target.packed = False
    rows = torch.zeros_like(packed)
    target.features_into(tokens, lengths, rows, 600)
    return {"packing": kernel, "relative_max_diff": _relative(packed, rows)}


def run(req):
    from transformers import AutoConfig

    device = device_for(os.environ.get("CUDA_VISIBLE_DEVICES"))
    dtype = dtype_of(req.get("dtype", "bf16"))
    t = req["target"]
    ids = req["target_layer_ids"]
    config = AutoConfig.for_model(
        "qwen3", vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"], num_hidden_layers=max(ids) + 1,
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=t.get("rope_theta", 1e6),
        max_position_embeddings=max(req["seq_lens"]) + 1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = _model(config, dtype, device, "sdpa")
    indices = [k + 1 for k in ids]
    target = TorchTarget(None, indices, dtype, device, dtype, model=model, packing="on")
    budget = req["budget"]
    res = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
           "torch": torch.__version__, "lengths": {}}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    for seq in req["seq_lens"]:
        lengths = [n for n in target_lengths(seq) if n > 0][: max(budget // seq, 1)]
        gen = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, t["vocab_size"], (sum(lengths),), generator=gen).tolist()
        width = len(indices) * target.hidden
        pin = device.type == "cuda"
        outs, one = {}, {}
        for packed in (False, True):
            target.packed = packed
            out = torch.zeros(sum(lengths), width, dtype=dtype, pin_memory=pin)
            s = _timed(target, tokens, lengths, out, budget, req.get("warmup", 1),
                       max(req.get("iters", 3), 1), device)
            name = "packed" if packed else "rows"
            useful = useful_target_flops(lengths, config.to_dict(), ids)
            one[name] = {"median_s": s, "tokens_per_s": sum(lengths) / s,
                         "model_flops_per_s": (useful["gemm"] + useful["attention"]) / s,
                         "kernel": target.packing if packed else "rows of one length"}
            outs[name] = out
        one["sequences"] = len(lengths)
        one["tokens"] = sum(lengths)
        one["packed_over_rows"] = one["rows"]["median_s"] / one["packed"]["median_s"]
        one["relative_max_diff"] = _relative(outs["packed"], outs["rows"])
        res["lengths"][str(seq)] = one
    del model, target
    res["check"] = {arch: _check(arch, dtype, device) for arch in req.get("check", [])}
    return res


def main(argv):
    if argv != ["-"]:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        req = parse(sys.stdin.read())
    except BadRequest as e:
        print(f"bench_target: {e}", file=sys.stderr)
        return 2
    print(json.dumps(run(req)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
