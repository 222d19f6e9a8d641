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
  backward; clipping to the global norm; AdamW. The PyTorch side is the torch engine's drafter
  (python/dflash_orch/drafter.py), started from the Rust drafter's initial weights (--dump-init)
  on the same tokens, loss masks and anchors (taken from the Rust run), so both compute the same
  losses; the table reports how far apart they are.

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
# The drafter: the torch engine's own (python/dflash_orch/drafter.py, what a `--engine torch`
# drafter worker runs).


def schedule_lr(peak, warmup, total, step):
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    done = min(step - warmup, span) / span
    return peak * 0.5 * (1.0 + math.cos(math.pi * done))


def train_steps(args, rust, init_path, features, cfg):
    """The torch engine's drafter from the Rust drafter's initial weights, on the Rust run's
    tokens, loss masks and anchors: per-step times, losses and gradient norms."""
    import torch
    from safetensors.torch import load_file, save_file

    engine_package()
    from dflash_orch.drafter import TorchDrafter, param_names

    init = load_file(init_path)
    names = param_names(cfg["layers"])
    missing = set(names) ^ set(init)
    if missing:
        raise SystemExit(f"bench-dflash: drafter parameters differ from the Rust dump: {sorted(missing)}")
    exchange = os.path.join(args.work, "engine-init")
    os.makedirs(exchange, exist_ok=True)
    save_file({n: init[n] for n in names}, os.path.join(exchange, "model.safetensors"))
    zeros = {}
    for n in names:
        zeros[f"m.{n}"] = torch.zeros_like(init[n])
        zeros[f"v.{n}"] = torch.zeros_like(init[n])
    save_file(zeros, os.path.join(exchange, "optimizer.safetensors"))
    drafter = TorchDrafter({
        "dtype": "f32", "feature_dtype": "f32", "model": args.model, "names": names,
        "shape": {"hidden": cfg["hidden"], "intermediate": cfg["intermediate"],
                  "layers": cfg["layers"], "heads": cfg["heads"], "kv_heads": cfg["kv_heads"],
                  "head_dim": cfg["head_dim"], "rms_eps": cfg["rms_eps"],
                  "rope_theta": cfg["rope_theta"], "vocab": cfg["vocab"]},
        "block_size": cfg["block_size"], "mask_token_id": cfg["mask_token_id"],
        "states": cfg["states"], "gamma": args.gamma, "distill": None, "anchor_chunk": None,
        "weight_decay": args.weight_decay, "weights": exchange, "adam_t": 0,
    })
    tokens, masks, lengths = rust["tokens"], rust["loss_mask"], rust["lengths"]
    anchors_all = rust["drafter"]["anchors"]
    steps = args.warmup + args.train_iters
    warmup = round(0.04 * steps)
    times, losses, norms = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        sequences, offset = [], 0
        for i, n in enumerate(lengths):
            if anchors_all[step][i]:
                sequences.append((offset, n, anchors_all[step][i]))
            offset += n
        out = drafter.micro_batch(features, tokens, masks, sequences, 1)
        stepped = drafter.step(schedule_lr(args.lr, warmup, steps, step), args.clip, False)
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(elapsed)
        losses.append(out["loss"] if out["weight"] > 0 else float("nan"))
        norms.append(stepped.get("grad_norm") or 0.0)
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
    cfg = {
        "hidden": tc.hidden_size, "intermediate": tc.intermediate_size, "layers": args.draft_layers,
        "heads": tc.num_attention_heads, "kv_heads": tc.num_key_value_heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        "rms_eps": tc.rms_norm_eps, "rope_theta": wl_rope_theta(args.model),
        "block_size": args.block_size, "mask_token_id": wl["mask_token_id"],
        "vocab": tc.vocab_size, "states": len(indices),
    }
    d_times, losses, norms = train_steps(args, rust, init_path, features.detach(), cfg)

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
        {"measurement": "drafter training step, torch engine (dflash_orch)", "tokens": total,
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


def engine_package():
    """Puts the tree's python/ (beside scripts/, or beside this file in a packaged GPU check) on
    the import path."""
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.path.join(here, "python"), os.path.join(here, "..", "python")):
        if os.path.isfile(os.path.join(root, "dflash_orch", "target.py")):
            if root not in sys.path:
                sys.path.insert(0, root)
            break


def engine_target(model_dir, indices):
    """The torch engine's target."""
    import torch

    engine_package()
    from dflash_orch.target import TorchTarget

    return TorchTarget(model_dir, indices, torch.float32, torch.device("cpu"))


def wl_rope_theta(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return float(config.get("rope_theta", 10000.0))


if __name__ == "__main__":
    sys.exit(main())
