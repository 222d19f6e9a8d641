"""The counting behind `scripts/bench-step-account` (its command line: `account_cli`):
what one drafter micro-batch and one target micro-batch of the torch engine execute, counted op
by op at Qwen3-8B widths, and projected onto an H200 by a stated roofline.

How it counts without a GPU: the engine's own code runs on PyTorch's `meta` device, where every
tensor has its shape and dtype and no data. Every aten op the step dispatches passes through a
recording dispatch mode: its FLOPs (`torch.utils.flop_counter`'s formulas, the ones
`FlopCounterMode` sums), the bytes of its operands and results, casts between dtypes, copies
between the host and the device, and host synchronisations (`.item()`, `float()`, `bool()` of a
device tensor, `.tolist()`). Values a sync would read are answered with zeros, which is what a
step of this shape reads anyway (no skipped group, no clipping decision that changes the work).
Attention runs as a stub recording what the kernel executes: every (query, key) pair of the dense
mask for SDPA (half the square for a causal kernel), every pair of each listed 128 x 128 tile for
flex. The host's time is 10 us per aten op dispatched (eager PyTorch from Python) plus the
engine's own host work per micro-batch (plans, index lists), timed on this machine.

The useful work is counted apart, from the shapes: the GEMMs the step needs forward and backward
(no gradient for the frozen embedding and head, none into the features) plus attention over the
(query, key) pairs the mask lets attend, nothing else.

The roofline (H200, bf16): a kernel takes max(FLOPs / (989 TFLOP/s x efficiency), bytes /
(4.8 TB/s x 0.85)), at least 3 us; GEMMs reach 80 % of peak, attention 60 %, f32 GEMMs run at
67 TFLOP/s. The device's time is their sum; the step takes the larger of it and the host's time,
plus 30 us per host sync (the queue drains and restarts), plus the host copies at 50 GB/s: the
engine registers the feature ring with CUDA as page-locked memory (`serve.pin_mapping`), from
which a PCIe 5.0 x16 link moves about 50 GB/s; pageable memory, which the driver stages through
its own buffers, was counted at 25 GB/s before the ring was registered. The copies are counted
on the step's path (no prefetch overlaps them). MFU is useful FLOPs / (step time x 989
TFLOP/s).
"""

import json
import math
import os
import random
import sys
import time
from collections import Counter

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import blocks
from .account_cli import ANCHORS, BUDGET

PEAK_BF16 = 989e12
PEAK_F32 = 67e12
HBM = 4.8e12
HBM_EFF = 0.85
GEMM_EFF = 0.80
ATTN_EFF = 0.60
KERNEL_FLOOR_S = 3e-6
SYNC_S = 30e-6
PINNED_BPS = 50e9
DISPATCH_S = 10e-6

# Qwen3-8B's widths; the drafter's shape at the seeds' settings.
QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "num_hidden_layers": 36, "rms_norm_eps": 1e-6, "rope_theta": 1e6}
DRAFT_LAYERS = 5
STATES = 5
BLOCK = 16

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_scaled_mm"}


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class Recorder(TorchDispatchMode):
    """Records each dispatched op (see the module's doc), answering what `meta` cannot (syncs,
    copies out of the device)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.device_ops = 0
        self.kernels = 0
        self.host_ops = 0
        self.syncs = 0
        self.flops = 0
        self.flops_by = Counter()
        self.device_s = 0.0
        self.device_s_by = Counter()
        self.cast_bytes = 0
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.h2d = 0
        self.d2h = 0

    def note_sync(self):
        self.syncs += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if (func in (aten._local_scalar_dense.default, aten.is_nonzero.default)
                and args[0].device.type == "meta"):
            # A value read on the host: conditions hold (all finite, no packed rows), numbers
            # are zero.
            self.syncs += 1
            self.d2h += 1
            t = args[0]
            if func is aten.is_nonzero.default or t.dtype == torch.bool:
                return True
            return 0.0 if t.dtype.is_floating_point else 0
        if (func is aten.copy_.default and args[1].device.type == "meta"
                and args[0].device.type != "meta"):
            self.d2h += 1
            self.d2h_bytes += args[1].numel() * args[1].element_size()
            return args[0]
        out = func(*args, **kwargs)
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        name = func._overloadpacket.__name__
        on_device = any(t.device.type == "meta" for t in ins + outs)
        if not on_device:
            self.host_ops += 1
            return out
        self.device_ops += 1
        self.ops[name] += 1
        if name in ("_to_copy", "copy_", "to") and outs:
            src = ins[-1] if name == "copy_" else ins[0]
            dst = ins[0] if name == "copy_" else outs[0]
            if dst is src:  # `.to` of what the tensor already is: nothing moves
                return out
            if src.device.type != "meta" and dst.device.type == "meta":
                self.h2d += 1
                self.h2d_bytes += src.numel() * src.element_size()
                return out
            if src.dtype != dst.dtype:
                self.cast_bytes += src.numel() * (src.element_size() + dst.element_size())
        if func.is_view or name in ("detach", "alias", "lift_fresh"):
            return out
        self.kernels += 1
        flops = 0
        formula = flop_counter.flop_registry.get(func._overloadpacket)
        if name == "linear":  # not decomposed under inference mode; flop_counter sees its mm
            flops = 2 * args[0].numel() * args[1].shape[0]
        elif formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
        if flops:
            self.flops += flops
            self.flops_by["gemm" if name in GEMMS else name] += flops
        seen, size = set(), 0
        for t in ins + outs:
            if t.device.type == "meta" and id(t) not in seen:
                seen.add(id(t))
                size += t.numel() * t.element_size()
        peak = PEAK_F32 if any(t.dtype == torch.float32 for t in ins[:2]) else PEAK_BF16
        took = max(flops / (peak * GEMM_EFF), size / (HBM * HBM_EFF), KERNEL_FLOOR_S)
        self.device_s += took
        self.device_s_by[name] += took
        return out

    def attention(self, pairs, heads, d, sizes, backward):
        """An attention kernel of `pairs` executed (query, key) pairs and operands of `sizes`
        bytes: forward 4 FLOPs per pair and head dimension, backward 8 (the counts
        `flop_counter` gives SDPA)."""
        flops = (8 if backward else 4) * pairs * heads * d
        self.flops += flops
        self.flops_by["attention"] += flops
        self.device_ops += 1
        self.kernels += 1
        self.ops["attention_backward" if backward else "attention"] += 1
        took = max(flops / (PEAK_BF16 * ATTN_EFF), sizes / (HBM * HBM_EFF), KERNEL_FLOOR_S)
        self.device_s += took
        self.device_s_by["attention"] += took


class _Attention(torch.autograd.Function):
    """Attention that records its kernels' work and returns no values (meta)."""

    @staticmethod
    def forward(ctx, q, k, v, recorder, pairs, extra_bytes):
        ctx.recorder, ctx.pairs = recorder, pairs
        ctx.sizes = sum(t.numel() * t.element_size() for t in (q, k, v)) * 2 + extra_bytes
        ctx.heads, ctx.d = q.shape[-3], q.shape[-1]
        recorder.attention(pairs, ctx.heads, ctx.d, ctx.sizes, False)
        ctx.shapes = (q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        ctx.recorder.attention(ctx.pairs, ctx.heads, ctx.d, ctx.sizes * 2, True)
        q, k, v = ctx.shapes
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None


def drafter_spec(target, dtype="bf16", anchor_chunk=None):
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    return {
        "shape": {"hidden": hidden, "intermediate": target["intermediate_size"],
                  "layers": DRAFT_LAYERS, "heads": heads,
                  "kv_heads": target["num_key_value_heads"],
                  "head_dim": target.get("head_dim") or hidden // heads,
                  "rms_eps": target["rms_norm_eps"], "rope_theta": target["rope_theta"],
                  "vocab": target["vocab_size"]},
        "block_size": BLOCK, "mask_token_id": target["vocab_size"] - 1, "states": STATES,
        "gamma": 7.0, "distill": None, "anchor_chunk": anchor_chunk, "weight_decay": 0.01,
        "dtype": dtype, "feature_dtype": dtype,
    }


def micro_batch(seq_len, seed=0):
    """The seeds' micro-batch: sequences of `seq_len` tokens filling the budget, 512 anchors
    each in the reply (after a 10 % prompt), every reply token with loss."""
    rng = random.Random(seed)
    n = BUDGET // seq_len
    tokens = [rng.randrange(QWEN3_8B["vocab_size"] - 1) for _ in range(n * seq_len)]
    prompt = seq_len // 10
    mask = [1 if i % seq_len >= prompt else 0 for i in range(n * seq_len)]
    sequences = [(i * seq_len, seq_len, sorted(rng.sample(range(prompt, seq_len - 1), ANCHORS)))
                 for i in range(n)]
    return tokens, mask, sequences


def useful_drafter_flops(spec, tokens, rows, pairs):
    """The GEMMs and attention one drafter micro-batch needs, forward and backward."""
    s = spec["shape"]
    h, i, v = s["hidden"], s["intermediate"], s["vocab"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layers = s["layers"]
    fc = 2 * tokens * STATES * h * h * 2  # forward, weight gradient (none into the features)
    ctx_kv = layers * 2 * tokens * h * 2 * kv * 3
    per_row = 2 * (h * q + 2 * h * kv + q * h + 3 * h * i)
    block = layers * rows * per_row * 3
    head = 2 * rows * v * h * 2  # forward, input gradient (the head is frozen)
    attention = layers * pairs * s["heads"] * s["head_dim"] * (4 + 8)
    return {"gemm": fc + ctx_kv + block + head, "attention": attention}


def _meta_drafter(path, spec):
    from .drafter import TorchDrafter

    os.environ["DFLASH_DRAFTER_PATH"] = path
    s = spec["shape"]
    meta = torch.device("meta")
    dtype = torch.bfloat16
    heads = (torch.empty(s["vocab"], s["hidden"], device=meta, dtype=dtype),
             torch.empty(s["vocab"], s["hidden"], device=meta, dtype=dtype))
    d = TorchDrafter(spec, heads=heads)
    d.device = meta
    # The GPU's kernels: flex attention, fused AdamW.
    d.flex = path == "batched"
    d.fused_adam = True
    d.P, d.m, d.v = {}, {}, {}
    for n, shape in d.shapes().items():
        d.P[n] = torch.nn.Parameter(torch.empty(shape, device=meta))
        d.m[n] = torch.empty(shape, device=meta)
        d.v[n] = torch.empty(shape, device=meta)
    d.t = 0
    return d


def replay_drafter(path, seq_len, anchor_chunk=None):
    """One micro-batch and one optimiser step of the drafter on `meta`: the recorder, the useful
    FLOPs and the tokens."""
    from . import drafter as drafter_module

    spec = drafter_spec(QWEN3_8B, anchor_chunk=anchor_chunk)
    d = _meta_drafter(path, spec)
    tokens, mask, sequences = micro_batch(seq_len)
    n_tok = len(tokens)
    width = STATES * spec["shape"]["hidden"]
    # The ring's slot: host memory (never touched: the copy to `meta` reads no bytes).
    features = torch.empty(n_tok, width, dtype=torch.bfloat16)
    rec = Recorder()
    plans = []
    real_plan = blocks.Plan

    def plan(*a, **k):
        plans.append(real_plan(*a, **k))
        return plans[-1]

    tiles = {}

    def flex_stub(q, k, v, mask, gqa, compile_it=True):
        # The tiles the `BlockMask` lists, from the plan's intervals on the host (the mask
        # itself was built on `meta`, by the engine's code, and has no values to read).
        # A chunk is known by its rows and keys (the chunks of one plan differ in them or
        # cost the same).
        p = plans[-1]
        key = (id(p), q.shape[-2], k.shape[-2])
        if key not in tiles:
            for anchors in p.chunks(anchor_chunk):
                lo, hi = p.key_span(anchors)
                pad = -(-(hi - lo) // blocks.TILE) * blocks.TILE
                rows, keys = len(anchors) * BLOCK, pad + len(anchors) * BLOCK
                if (rows, keys) == key[1:]:
                    states = blocks.tile_states(p.intervals(anchors, lo, pad), rows, keys)
                    tiles[key] = int((states > 0).sum()) * blocks.TILE * blocks.TILE
                    break
        return _Attention.apply(q, k, v, rec, tiles.get(key, 0), 0)

    def dense_stub(q, k, v, attn_mask=None, enable_gqa=False, **_):
        pairs = q.shape[-2] * k.shape[-2]
        extra = attn_mask.numel() if attn_mask is not None else 0
        return _Attention.apply(q, k, v, rec, pairs, extra)

    real_tolist = torch.Tensor.tolist

    def tolist(t):
        if t.device.type != "meta":
            return real_tolist(t)
        rec.note_sync()
        rec.d2h += 1
        return real_tolist(torch.zeros(t.shape, dtype=t.dtype))

    saved = (blocks.Plan, blocks.flex, blocks.sdpa, drafter_module.F.scaled_dot_product_attention)
    blocks.Plan, blocks.flex = plan, flex_stub
    blocks.sdpa = lambda q, k, v, mask, gqa: dense_stub(q, k, v, attn_mask=mask)
    drafter_module.F.scaled_dot_product_attention = dense_stub
    torch.Tensor.tolist = tolist
    try:
        with rec:
            d.micro_batch(features, tokens, mask, sequences, 1)
            d.step(6e-4, 1.0, False)
    finally:
        (blocks.Plan, blocks.flex, blocks.sdpa,
         drafter_module.F.scaled_dot_product_attention) = saved
        torch.Tensor.tolist = real_tolist
        os.environ.pop("DFLASH_DRAFTER_PATH", None)
    p = plans[-1] if plans else real_plan(tokens, mask, sequences, BLOCK, 7.0, None)
    pairs = blocks.attended_pairs(p.intervals(range(0, p.anchors_n), 0, 0))
    useful = useful_drafter_flops(spec, n_tok, p.anchors_n * BLOCK, pairs)
    return rec, useful, n_tok


TARGET_LAYER_IDS = [1, 9, 17, 25, 33]


def target_lengths(seq_len):
    """The seeds' target micro-batch: sequences of about `seq_len` tokens filling the budget,
    of distinct lengths as real data has them (`seq_len`, `seq_len - 1`, ...)."""
    n = BUDGET // seq_len
    return [seq_len - i for i in range(n)]


def useful_target_flops(lengths, t=QWEN3_8B, layer_ids=TARGET_LAYER_IDS):
    """The forward GEMMs and causal attention up to the last layer a feature is taken from, of
    a target of `config.json` fields `t`."""
    h, i = t["hidden_size"], t["intermediate_size"]
    q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    layers = max(layer_ids) + 1
    tokens = sum(lengths)
    gemm = layers * tokens * 2 * (h * q + 2 * h * kv + q * h + 3 * h * i)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return {"gemm": gemm, "attention": layers * pairs * 4 * q}


def replay_target(seq_len, packed=False):
    """One target micro-batch (`TorchTarget.features_into`) of a Qwen3-8B-shaped model built on
    `meta` by `transformers`, writing into a host slot: rows of one length, or `packed` rows
    through the variable-length kernel a GPU runs (`--target-packing`)."""
    import torch.nn.attention.varlen as varlen
    from transformers import AutoModelForCausalLM, Qwen3Config

    from . import target as target_module
    from .target import TorchTarget

    t = QWEN3_8B
    config = Qwen3Config(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
                         intermediate_size=t["intermediate_size"],
                         num_hidden_layers=t["num_hidden_layers"],
                         num_attention_heads=t["num_attention_heads"],
                         num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                         rms_norm_eps=t["rms_norm_eps"], rope_theta=t["rope_theta"],
                         max_position_embeddings=40960, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.eval()
    indices = [k + 1 for k in TARGET_LAYER_IDS]
    target = TorchTarget(None, indices, torch.bfloat16, torch.device("meta"), torch.bfloat16,
                         model=model, packing="on" if packed else "off")
    lengths = target_lengths(seq_len)
    rng = random.Random(0)
    tokens = [rng.randrange(t["vocab_size"]) for _ in range(sum(lengths))]
    out = torch.empty(sum(lengths), len(indices) * t["hidden_size"], dtype=torch.bfloat16)
    rec = Recorder()
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    real_tolist = torch.Tensor.tolist

    def sdpa_stub(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **_):
        rows, keys = q.shape[-2], k.shape[-2]
        batch = q.numel() // (q.shape[-3] * rows * q.shape[-1])
        # A causal kernel skips the tiles above the diagonal: about half the square.
        pairs = batch * (rows * (rows + 1) // 2 if is_causal and attn_mask is None
                         else rows * keys)
        extra = attn_mask.numel() if attn_mask is not None else 0
        return _Attention.apply(q, k, v, rec, pairs, extra)

    real_varlen = varlen.varlen_attn

    def varlen_stub(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        # Causal within each sequence of the packed row: the kernel skips the tiles above each
        # sequence's diagonal and every tile across sequences.
        bounds = target_module._Layout.bounds
        pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(bounds, bounds[1:]))
        out = _Attention.apply(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), rec,
                               pairs, 0)
        return out.transpose(0, 1)

    def tolist(x):
        if x.device.type != "meta":
            return real_tolist(x)
        rec.note_sync()
        rec.d2h += 1
        return real_tolist(torch.ones(x.shape, dtype=x.dtype))

    torch.nn.functional.scaled_dot_product_attention = sdpa_stub
    torch.Tensor.tolist = tolist
    varlen.varlen_attn = varlen_stub
    try:
        with rec:
            target.features_into(tokens, lengths, out, BUDGET)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real_sdpa
        torch.Tensor.tolist = real_tolist
        varlen.varlen_attn = real_varlen
    if packed and not target.packed:
        raise RuntimeError(f"the packed target was not counted: {target.packing}")
    return rec, useful_target_flops(lengths), sum(lengths)


def account_target(seq_len, packed=False):
    rec, useful, n_tok = replay_target(seq_len, packed)
    return summary(rec, useful, n_tok, rec.device_ops * DISPATCH_S + target_prep_s(seq_len))


def topology(target_s, drafter_s, gpus=8):
    """Micro-batches per second of each split T:D of `gpus` (targets and drafters each working
    in parallel, the slower side setting the pace), the best split and all-but-one-target."""
    rates = {f"{t}:{gpus - t}": min(t / target_s, (gpus - t) / drafter_s)
             for t in range(1, gpus)}
    best = max(rates, key=rates.get)
    return {"best": best, "best_tokens_per_s": rates[best] * BUDGET,
            "default": f"{gpus - 1}:1", "default_tokens_per_s": rates[f"{gpus - 1}:1"] * BUDGET}


def summary(rec, useful, n_tok, host_s):
    useful_total = useful["gemm"] + useful["attention"]
    copies_s = (rec.h2d_bytes + rec.d2h_bytes) / PINNED_BPS
    step_s = max(rec.device_s, host_s) + rec.syncs * SYNC_S + copies_s
    return {
        "tokens": n_tok,
        "flops_executed": rec.flops,
        "flops_useful": useful_total,
        "executed_over_useful": rec.flops / useful_total if useful_total else None,
        "flops_by": dict(rec.flops_by),
        "aten_ops": rec.device_ops,
        "kernels": rec.kernels,
        "host_ops": rec.host_ops,
        "host_syncs": rec.syncs,
        "cast_bytes": rec.cast_bytes,
        "h2d_bytes": rec.h2d_bytes,
        "h2d_copies": rec.h2d,
        "d2h_bytes": rec.d2h_bytes,
        "copies_s": copies_s,
        "device_s": rec.device_s,
        "host_s": host_s,
        "step_s": step_s,
        "tokens_per_s": n_tok / step_s,
        "mfu": useful_total / (step_s * PEAK_BF16),
        "top_ops": rec.ops.most_common(12),
        "device_s_by": {k: round(v, 4) for k, v in rec.device_s_by.most_common(12)},
    }


def _timed(fn, repeat=3):
    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def drafter_prep_s(path, seq_len):
    """The host's own work per micro-batch besides dispatching ops, timed here: the batched
    path's plan; the legacy path's loss weights (made once for the total, once per chunk) and
    its per-chunk index lists."""
    from .drafter import block_weights

    tokens, mask, sequences = micro_batch(seq_len)
    if path == "batched":
        return _timed(lambda: blocks.Plan(tokens, mask, sequences, BLOCK, 7.0, None))

    def legacy():
        for start, length, anchors in sequences:
            seq_tokens, seq_mask = tokens[start:start + length], mask[start:start + length]
            for _ in range(2):
                block_weights(seq_mask, anchors, BLOCK, 7.0)
            n = len(seq_tokens)
            torch.tensor([seq_tokens[p + k] if p + k < n else 0
                          for p in anchors for k in range(BLOCK)], dtype=torch.long)
            [seq_tokens[p] for p in anchors]

    return _timed(legacy)


def target_prep_s(seq_len):
    """The target's own host work per micro-batch: the vocabulary check and the ids tensor."""
    lengths = target_lengths(seq_len)
    tokens = [i % 1000 for i in range(sum(lengths))]

    def prep():
        next((t for t in tokens if not 0 <= t < QWEN3_8B["vocab_size"]), None)
        torch.tensor(tokens, dtype=torch.long)

    return _timed(prep)


def account_drafter(path, seq_len, anchor_chunk=None):
    rec, useful, n_tok = replay_drafter(path, seq_len, anchor_chunk)
    return summary(rec, useful, n_tok, rec.device_ops * DISPATCH_S + drafter_prep_s(path, seq_len))


def _fmt(x):
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def table(results, title):
    """A side-by-side table: one column per (path, sequence length)."""
    rows = [("tokens", "tokens"), ("executed / useful FLOPs", "executed_over_useful"),
            ("executed TFLOP", "flops_executed"), ("aten ops", "aten_ops"),
            ("kernels", "kernels"), ("host syncs", "host_syncs"),
            ("cast GB", "cast_bytes"), ("host->device GB", "h2d_bytes"),
            ("host->device copies", "h2d_copies"), ("device->host GB", "d2h_bytes"),
            ("host copies s", "copies_s"), ("device s (roofline)", "device_s"),
            ("host s", "host_s"), ("step s", "step_s"),
            ("tokens/s per GPU", "tokens_per_s"), ("MFU", "mfu")]
    heads = list(results)
    out = [f"| {title} | " + " | ".join(heads) + " |",
           "|---|" + "---:|" * len(heads)]
    for label, key in rows:
        cells = []
        for h in heads:
            v = results[h][key]
            if key in ("cast_bytes", "h2d_bytes", "d2h_bytes"):
                v = f"{v / 1e9:.2f}"
            elif key == "flops_executed":
                v = f"{v / 1e12:.1f}"
            elif key == "mfu":
                v = f"{v * 100:.0f} %"
            elif key == "tokens_per_s":
                v = f"{v:,.0f}"
            elif isinstance(v, float):
                v = f"{v:.3g}"
            cells.append(str(v))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def run(lens, paths, chunks, as_json):
    """Counts each path at each sequence length and prints the tables (or JSON); 0."""
    results, targets, topologies = {}, {}, {}
    for n in lens:
        for p in paths:
            print(f"bench-step-account: drafter, {p}, sequences of {n}", file=sys.stderr)
            results[f"{p} {n}"] = account_drafter(p, n, chunks[p])
        print(f"bench-step-account: target, sequences of about {n}", file=sys.stderr)
        targets[f"target {n}"] = account_target(n)
        print(f"bench-step-account: packed target, sequences of about {n}", file=sys.stderr)
        targets[f"packed target {n}"] = account_target(n, packed=True)
        # The split a GPU run makes: its target packs its rows (`--target-packing auto`).
        for p in paths:
            topologies[f"{p} {n}"] = topology(targets[f"packed target {n}"]["step_s"],
                                              results[f"{p} {n}"]["step_s"])
    if as_json:
        print(json.dumps({"drafter": results, "target": targets, "topology": topologies},
                         indent=1))
        return 0
    print(table(results, "drafter micro-batch"))
    print()
    print(table(targets, "target micro-batch"))
    print()
    print("| 8 GPUs, tokens/s | all-but-one targets (7:1) | balanced split | at it |")
    print("|---|---:|---:|---:|")
    for key, t in topologies.items():
        print(f"| {key} | {t['default_tokens_per_s']:,.0f} | {t['best']} | "
              f"{t['best_tokens_per_s']:,.0f} |")
    return 0
