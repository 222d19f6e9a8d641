#!/usr/bin/env python3
"""CPU throughput of the DFlash stages: dflash-orch (Rust, candle) against PyTorch, side by side.

Run by scripts/bench-dflash, which builds examples/dflash_step_bench, writes a tiny target with
`dflash-orch init-tiny`, and starts this script pinned to the CPUs both sides share (the Rust
example is started from here and inherits the affinity and the thread settings).

Two measurements, each a median over timed iterations after untimed warm-up ones:

- target forward: a padded batch through the frozen Qwen3 target, the hidden states of
  target_layer_ids concatenated per real token and copied to host memory. Rust: Qwen3::hidden_states
  (as TargetStage does); PyTorch: transformers' Qwen3Model (float32, no_grad,
  output_hidden_states=True; --torch-attn sdpa or eager).
- drafter training step: one micro-batch per optimiser step, as DrafterStage::train: per sequence,
  anchors from the loss mask, the drafter's loss parts, summed and divided by the total weight;
  backward; clipping to the global norm; AdamW. The PyTorch drafter below is a hand port of
  worker/src/model/drafter.rs (same shapes, same per-sequence loop, same attention layout), started
  from the Rust drafter's initial weights (--dump-init) on the same tokens, loss masks and anchors
  (taken from the Rust run), so both compute the same losses; the table reports how far apart
  they are.

tokens/s = real tokens of the batch / median seconds per iteration; ratio = Rust / PyTorch.
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def cpu_busy_s(cpus):
    """Seconds the given CPUs have spent busy since boot (all processes), from /proc/stat."""
    hz = os.sysconf("SC_CLK_TCK")
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    v = [int(x) for x in fields[:8]]
                    busy += sum(v) - v[3] - v[4]
    except (OSError, ValueError):
        return None
    return busy / hz


def own_cpu_s():
    """CPU seconds of this process and its finished children (the Rust side)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_rust(args, dump_init):
    cmd = [
        args.example, "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
        "--prompt", str(args.prompt), "--target-layer-ids", args.target_layer_ids,
        "--draft-layers", str(args.draft_layers), "--block-size", str(args.block_size),
        "--num-anchors", str(args.num_anchors), "--lr", repr(args.lr),
        "--weight-decay", repr(args.weight_decay), "--clip", repr(args.clip), "--seed", str(args.seed),
        "--warmup", str(args.warmup), "--target-iters", str(args.target_iters),
        "--train-iters", str(args.train_iters), "--dump-init", dump_init,
    ]
    if args.gamma is not None:
        cmd += ["--gamma", repr(args.gamma)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE)
    return json.loads(proc.stdout), time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# The target.


def load_target(model_dir, attn):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"bench-dflash: transformers did not load {model_dir} cleanly: {bad}")
    model.eval()
    return model


def target_features(model, indices, lengths, tokens):
    """[tokens, n*hidden] features of the real tokens of a padded batch, in sample order."""
    import torch

    rows, width = len(lengths), max(lengths)
    ids = torch.zeros((rows, width), dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    at = 0
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.tensor(tokens[at:at + n], dtype=torch.long)
        attention[i, :n] = 1
        at += n
    with torch.no_grad():
        out = model.model(input_ids=ids, attention_mask=attention, output_hidden_states=True, use_cache=False)
        allf = torch.cat([out.hidden_states[k] for k in indices], dim=2)
        features = torch.cat([allf[i, :n] for i, n in enumerate(lengths)], dim=0)
        host = features.numpy().copy()
    return features, host


# ---------------------------------------------------------------------------------------------
# The drafter: a port of worker/src/model/drafter.rs.


def param_names(layers):
    names = ["fc.weight", "hidden_norm.weight"]
    for i in range(layers):
        p = f"layers.{i}"
        names += [f"{p}.{n}" for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight")]
    names.append("norm.weight")
    return names


def rope_tables(positions, head_dim, theta):
    import torch

    inv = torch.tensor([1.0 / theta ** (2.0 * i / head_dim) for i in range(head_dim // 2)],
                       dtype=torch.float64).to(torch.float32)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def loss_parts(P, c, features, tokens, loss_mask, anchors, embedding, lm_head, gamma, attn):
    """Weighted sum of cross-entropies, sum of weights, per-position (correct, counted)."""
    import torch
    import torch.nn.functional as F

    s, a, b = len(tokens), len(anchors), c["block_size"]
    h, d, eps = c["hidden"], c["head_dim"], c["rms_eps"]
    heads, kv = c["heads"], c["kv_heads"]
    group = heads // kv
    ctx = F.rms_norm(F.linear(features, P["fc.weight"]), (h,), P["hidden_norm.weight"], eps)
    block_ids, block_pos = [], []
    for anchor in anchors:
        block_ids += [tokens[anchor]] + [c["mask_token_id"]] * (b - 1)
        block_pos += list(range(anchor, anchor + b))
    x = embedding[torch.tensor(block_ids, dtype=torch.long)].reshape(a, b, h)
    cos_c, sin_c = rope_tables(torch.arange(s), d, c["rope_theta"])
    cos_b, sin_b = rope_tables(torch.tensor(block_pos).reshape(a, b), d, c["rope_theta"])
    cos_b, sin_b = cos_b.unsqueeze(1), sin_b.unsqueeze(1)
    anchors_t = torch.tensor(anchors)
    ctx_mask = torch.where(torch.arange(s).unsqueeze(0) < anchors_t.unsqueeze(1), 0.0, float("-inf"))
    ctx_mask = ctx_mask.reshape(a, 1, 1, s)
    if attn == "sdpa":
        full_mask = torch.cat([ctx_mask.expand(a, 1, b, s), torch.zeros(a, 1, b, b)], dim=-1)
    for i in range(c["layers"]):
        w = lambda n: P[f"layers.{i}.{n}"]  # noqa: E731
        hn = F.rms_norm(x, (h,), w("input_layernorm.weight"), eps)
        q = F.linear(hn, w("self_attn.q_proj.weight")).reshape(a, b, heads, d)
        q = F.rms_norm(q, (d,), w("self_attn.q_norm.weight"), eps).transpose(1, 2)
        q = q * cos_b + rotate_half(q) * sin_b
        kb = F.linear(hn, w("self_attn.k_proj.weight")).reshape(a, b, kv, d)
        kb = F.rms_norm(kb, (d,), w("self_attn.k_norm.weight"), eps).transpose(1, 2)
        kb = kb * cos_b + rotate_half(kb) * sin_b
        vb = F.linear(hn, w("self_attn.v_proj.weight")).reshape(a, b, kv, d).transpose(1, 2)
        kc = F.linear(ctx, w("self_attn.k_proj.weight")).reshape(s, kv, d)
        kc = F.rms_norm(kc, (d,), w("self_attn.k_norm.weight"), eps).transpose(0, 1)
        kc = kc * cos_c + rotate_half(kc) * sin_c
        vc = F.linear(ctx, w("self_attn.v_proj.weight")).reshape(s, kv, d).transpose(0, 1)
        # Grouped-query attention: key/value head j serves query heads j*group .. (j+1)*group.
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
        kc = kc.repeat_interleave(group, dim=0).unsqueeze(0).expand(a, heads, s, d)
        vc = vc.repeat_interleave(group, dim=0).unsqueeze(0).expand(a, heads, s, d)
        keys, values = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)
        if attn == "sdpa":
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=full_mask)
        else:
            scores = q @ keys.transpose(-1, -2) / math.sqrt(d)
            scores = torch.cat([scores[..., :s] + ctx_mask, scores[..., s:]], dim=-1)
            out = torch.softmax(scores, dim=-1) @ values
        out = out.transpose(1, 2).reshape(a, b, heads * d)
        x = x + F.linear(out, w("self_attn.o_proj.weight"))
        n = F.rms_norm(x, (h,), w("post_attention_layernorm.weight"), eps)
        act = F.silu(F.linear(n, w("mlp.gate_proj.weight"))) * F.linear(n, w("mlp.up_proj.weight"))
        x = x + F.linear(act, w("mlp.down_proj.weight"))
    x = F.rms_norm(x, (h,), P["norm.weight"], eps)
    logits = F.linear(x.reshape(a * b, h), lm_head)
    targets, weights = [], []
    for anchor in anchors:
        for k in range(b):
            t = anchor + k
            counted = k >= 1 and t < s and loss_mask[t] != 0
            targets.append(tokens[t] if t < s else 0)
            decay = 1.0 if gamma is None else math.exp(-(k - 1.0) / gamma)
            weights.append(decay if counted else 0.0)
    targets_t = torch.tensor(targets, dtype=torch.long)
    w_t = torch.tensor(weights, dtype=torch.float32)
    total = float(w_t.sum())
    ce = F.cross_entropy(logits, targets_t, reduction="none")
    loss_sum = (ce * w_t).sum()
    predicted = logits.argmax(dim=-1)
    hit = ((predicted == targets_t) & (w_t > 0)).reshape(a, b).sum(0).tolist()
    cnt = (w_t > 0).reshape(a, b).sum(0).tolist()
    return loss_sum, total, list(zip(hit, cnt))


def schedule_lr(peak, warmup, total, step):
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    done = min(step - warmup, span) / span
    return peak * 0.5 * (1.0 + math.cos(math.pi * done))


def train_steps(args, rust, init_path, features, embedding, lm_head, cfg):
    import torch
    from safetensors.torch import load_file

    init = load_file(init_path)
    names = param_names(cfg["layers"])
    missing = set(names) ^ set(init)
    if missing:
        raise SystemExit(f"bench-dflash: drafter parameters differ from the Rust dump: {sorted(missing)}")
    P = {n: torch.nn.Parameter(init[n].clone()) for n in names}
    params = [P[n] for n in names]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    tokens, masks, lengths = rust["tokens"], rust["loss_mask"], rust["lengths"]
    anchors_all = rust["drafter"]["anchors"]
    steps = args.warmup + args.train_iters
    warmup = round(0.04 * steps)
    times, losses, norms = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        loss_sum, weight, offset = None, 0.0, 0
        for i, n in enumerate(lengths):
            lo, hi = offset, offset + n
            offset = hi
            anchors = anchors_all[step][i]
            if not anchors:
                continue
            part, w, _acc = loss_parts(P, cfg, features[lo:hi], tokens[lo:hi], masks[lo:hi], anchors,
                                       embedding, lm_head, args.gamma, args.torch_attn)
            weight += w
            loss_sum = part if loss_sum is None else loss_sum + part
        loss, norm = float("nan"), 0.0
        if loss_sum is not None and weight > 0:
            mean = loss_sum / weight
            loss = mean.item()
            opt.zero_grad(set_to_none=True)
            mean.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(params, args.clip))
            for g in opt.param_groups:
                g["lr"] = schedule_lr(args.lr, warmup, steps, step)
            opt.step()
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(elapsed)
        losses.append(loss)
        norms.append(norm)
    return times, losses, norms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--example", required=True, help="target/release/examples/dflash_step_bench")
    ap.add_argument("--model", required=True, help="the tiny target's directory")
    ap.add_argument("--work", required=True, help="a scratch directory")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--cpus", default="", help="the CPU list both sides run on (for the report)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--target-layer-ids", default="0,3")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-anchors", type=int, default=32)
    ap.add_argument("--gamma", type=float, default=None)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--target-iters", type=int, default=40)
    ap.add_argument("--train-iters", type=int, default=20)
    ap.add_argument("--torch-attn", choices=["sdpa", "eager"], default="sdpa",
                    help="attention of the PyTorch target (transformers) and drafter")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    affinity = sorted(os.sched_getaffinity(0))
    marks = [(cpu_busy_s(affinity), own_cpu_s(), time.monotonic())]

    log(f"bench-dflash: Rust side ({args.example})")
    init_path = os.path.join(args.work, "drafter-init.safetensors")
    rust, rust_wall = run_rust(args, init_path)
    marks.append((cpu_busy_s(affinity), own_cpu_s(), time.monotonic()))
    wl = rust["workload"]
    indices = [int(x) + 1 for x in args.target_layer_ids.split(",")]

    log("bench-dflash: PyTorch side")
    model = load_target(args.model, args.torch_attn)
    tc = model.config
    lengths, tokens = rust["lengths"], rust["tokens"]
    t_times, features = [], None
    for i in range(args.warmup + args.target_iters):
        t0 = time.perf_counter()
        features, _host = target_features(model, indices, lengths, tokens)
        if i >= args.warmup:
            t_times.append(time.perf_counter() - t0)
    # The torch engine's own target (python/dflash_orch/target.py, what a torch target worker
    # runs): each sequence as its own row, hooks on the layers needed, into a host buffer as into
    # the mapped feature slot.
    engine = engine_target(args.model, indices)
    total = sum(lengths)
    slot = torch.empty(total, len(indices) * engine.hidden)
    e_times = []
    for i in range(args.warmup + args.target_iters):
        t0 = time.perf_counter()
        engine.features_into(tokens, lengths, slot, token_budget=total)
        if i >= args.warmup:
            e_times.append(time.perf_counter() - t0)
    engine_diff = (slot - features).abs().max().item()
    sd = model.state_dict()
    embedding = sd["model.embed_tokens.weight"].detach()
    lm_head = (sd["lm_head.weight"] if "lm_head.weight" in sd else embedding).detach()
    cfg = {
        "hidden": tc.hidden_size, "intermediate": tc.intermediate_size, "layers": args.draft_layers,
        "heads": tc.num_attention_heads, "kv_heads": tc.num_key_value_heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        "rms_eps": tc.rms_norm_eps, "rope_theta": wl_rope_theta(args.model),
        "block_size": args.block_size, "mask_token_id": wl["mask_token_id"],
    }
    d_times, losses, norms = train_steps(args, rust, init_path, features.detach(), embedding, lm_head, cfg)

    torch_t = statistics.median(t_times)
    torch_d = statistics.median(d_times)
    rust_t = rust["target"]["median_s"]
    rust_d = rust["drafter"]["timing"]["median_s"]
    engine_t = statistics.median(e_times)
    rows = [
        {"measurement": "target forward, torch engine (dflash_orch)", "tokens": total,
         "rust_ms": 1e3 * rust_t, "torch_ms": 1e3 * engine_t,
         "rust_tokens_per_s": total / rust_t, "torch_tokens_per_s": total / engine_t,
         "ratio": engine_t / rust_t},
        {"measurement": "target forward, transformers padded batch", "tokens": total,
         "rust_ms": 1e3 * rust_t, "torch_ms": 1e3 * torch_t,
         "rust_tokens_per_s": total / rust_t, "torch_tokens_per_s": total / torch_t,
         "ratio": torch_t / rust_t},
        {"measurement": "drafter training step", "tokens": total,
         "rust_ms": 1e3 * rust_d, "torch_ms": 1e3 * torch_d,
         "rust_tokens_per_s": total / rust_d, "torch_tokens_per_s": total / torch_d,
         "ratio": torch_d / rust_d},
    ]
    marks.append((cpu_busy_s(affinity), own_cpu_s(), time.monotonic()))
    # Time the pinned CPUs spent on other processes while each side ran, as a share of their time.
    other = {}
    for side, (a, b) in zip(("rust", "torch"), zip(marks, marks[1:])):
        if a[0] is not None and b[0] is not None:
            other[side] = max(0.0, (b[0] - a[0]) - (b[1] - a[1])) / ((b[2] - a[2]) * len(affinity))
    r_losses = rust["drafter"]["losses"]
    loss_diff = max(abs(x - y) for x, y in zip(r_losses, losses))
    r_norms = rust["drafter"]["grad_norms"]
    norm_rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(r_norms, norms))

    gamma = "none" if args.gamma is None else f"{args.gamma:g}"
    print(f"dflash-orch (candle {rust['candle']}, {rust['threads']} threads) vs PyTorch {torch.__version__} "
          f"({torch.get_num_threads()} threads, transformers {transformers.__version__}, "
          f"attention {args.torch_attn}); CPUs {args.cpus or ','.join(map(str, affinity))} "
          f"({platform.processor() or platform.machine()})")
    print(f"target: Qwen3 hidden {wl['hidden']}, {wl['target_layers']} layers ({wl['target_layers_run']} run), "
          f"vocab {wl['vocab']}; batch {wl['batch']} x {wl['seq']} tokens (padded, prompt {wl['prompt']} "
          f"without loss); features of layers {args.target_layer_ids}")
    print(f"drafter: {wl['draft_layers']} layer(s), block {wl['block_size']}, {wl['num_anchors']} anchors per "
          f"sequence, gamma {gamma}, AdamW lr {args.lr:g} wd {args.weight_decay:g}, clip {args.clip:g}; "
          f"one micro-batch per optimiser step")
    print(f"medians of {args.target_iters} forward passes and {args.train_iters} training steps after "
          f"{args.warmup} warm-up iterations each\n")
    print("| measurement | tokens/iter | dflash-orch ms | PyTorch ms | dflash-orch tokens/s | PyTorch tokens/s "
          "| ratio (Rust / PyTorch) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['measurement']} | {r['tokens']} | {r['rust_ms']:.1f} | {r['torch_ms']:.1f} | "
              f"{r['rust_tokens_per_s']:,.0f} | {r['torch_tokens_per_s']:,.0f} | {r['ratio']:.2f}x |")
    print(f"\ntorch engine features against transformers' hidden states: max |diff| {engine_diff:.2e}")
    print(f"drafter loss, step 0: dflash-orch {r_losses[0]:.6f}, PyTorch {losses[0]:.6f}; "
          f"max |diff| over {len(losses)} steps {loss_diff:.2e}; grad norm max relative diff {norm_rel:.2e}")
    if other:
        print(f"other processes' share of CPUs {','.join(map(str, affinity))}: "
              + ", ".join(f"{100 * v:.1f}% while the {'dflash-orch' if k == 'rust' else 'PyTorch'} side ran"
                          for k, v in other.items()))
        if max(other.values()) > 0.05:
            print("warning: other work shared these CPUs; with spinning worker threads both sides slow down "
                  "by far more than that share, unevenly: rerun on an idle machine")

    result = {
        "rust": {"threads": rust["threads"], "candle": rust["candle"],
                 "target_times_s": rust["target"]["times_s"],
                 "train_times_s": rust["drafter"]["timing"]["times_s"],
                 "losses": r_losses, "grad_norms": r_norms, "wall_s": rust_wall},
        "torch": {"version": torch.__version__, "transformers": transformers.__version__,
                  "threads": torch.get_num_threads(), "attention": args.torch_attn,
                  "target_times_s": t_times, "train_times_s": d_times, "losses": losses, "grad_norms": norms,
                  "engine_target_times_s": e_times, "engine_features_max_abs_diff": engine_diff},
        "cpus": affinity,
        "other_processes_cpu_share": other,
        "workload": {k: v for k, v in wl.items() if k != "model"},
        "iterations": {"warmup": args.warmup, "target": args.target_iters, "train": args.train_iters},
        "rows": rows,
        "loss_max_abs_diff": loss_diff,
        "grad_norm_max_rel_diff": norm_rel,
    }
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.json)
    return 0


def engine_target(model_dir, indices):
    """The torch engine's target, from the tree's python/ (beside scripts/, or beside this file in
    a packaged GPU check)."""
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.path.join(here, "python"), os.path.join(here, "..", "python")):
        if os.path.isfile(os.path.join(root, "dflash_orch", "target.py")):
            sys.path.insert(0, root)
            break
    from dflash_orch.target import TorchTarget

    return TorchTarget(model_dir, indices, torch.float32, torch.device("cpu"))


def wl_rope_theta(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return float(config.get("rope_theta", 10000.0))


if __name__ == "__main__":
    sys.exit(main())
