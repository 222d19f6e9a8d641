"""Compares the hidden states of the Rust Qwen3 target with Hugging Face `transformers`; run by
scripts/target-parity.

    target_parity.py --orch BIN --example BIN --work DIR [--seed S] [--tokens 32,200]
                     [--shape 64x4,128x2] [--perturb] [--tol 1e-4]

For every shape (hidden size x decoder layers) a tiny random-weight model is written with
`dflash-orch init-tiny --seed S`; for every token count N, N token ids are drawn from
random.Random(S * 1000003 + N) in [0, vocab). The Rust side is `examples/hidden_states MODEL_DIR TOKENS
0,1,...,L` (all hidden states, batch of one, positions 0..N-1, one segment). The reference is
`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")`
run on the same tokens with `output_hidden_states=True`. Prints, per configuration and hidden-state
index, the max abs difference and the largest magnitude of the reference; exits 0 when every
difference is below --tol, 1 otherwise.

init-tiny writes every RMSNorm weight as 1 and every matrix with std 0.02, so a norm weight applied
in the wrong place (q_norm for k_norm, the final norm's weight, ...) does not show. --perturb adds,
for each shape, a copy of the model whose norm weights are drawn from 1 + 0.5 * N(0, 1) and whose
matrices are scaled to std 1 / sqrt(fan_in); since its activations are larger, that configuration is
judged on the difference relative to the reference's largest magnitude (--tol as a relative bound).
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_list(text, conv, what):
    try:
        values = [conv(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"target-parity: bad {what} '{text}'")
    if not values:
        raise SystemExit(f"target-parity: empty {what}")
    return values


def parse_shape(text):
    try:
        hidden, layers = text.lower().split("x")
        return int(hidden), int(layers)
    except ValueError:
        raise ValueError(text)


def init_tiny(orch, out_dir, seed, hidden, layers):
    subprocess.run(
        [orch, "init-tiny", "--output", out_dir, "--seed", str(seed), "--hidden-size", str(hidden),
         "--layers", str(layers), "--force"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def perturb(src_dir, dst_dir, seed):
    """Copies the model in src_dir to dst_dir with random norm weights and 1/sqrt(fan_in) matrices."""
    import torch
    from safetensors.torch import load_file, save_file

    if os.path.exists(dst_dir):
        shutil.rmtree(dst_dir)
    shutil.copytree(src_dir, dst_dir)
    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name in sorted(tensors):
        t = tensors[name]
        if t.dim() == 1:
            out[name] = 1.0 + 0.5 * torch.randn(t.shape, generator=gen, dtype=torch.float32)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        else:
            out[name] = torch.randn(t.shape, generator=gen, dtype=torch.float32) / t.shape[1] ** 0.5
    save_file(out, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})


def rust_hidden_states(example, model_dir, tokens, indices):
    t0 = time.monotonic()
    proc = subprocess.run(
        [example, model_dir, ",".join(map(str, tokens)), ",".join(map(str, indices))],
        check=True,
        stdout=subprocess.PIPE,
    )
    data = json.loads(proc.stdout)
    if data["indices"] != indices:
        raise SystemExit(f"target-parity: the example answered indices {data['indices']}, asked {indices}")
    return data["hidden_states"], time.monotonic() - t0


def reference_hidden_states(model_dir, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,  # transformers >= 5 name of torch_dtype
        attn_implementation="eager",
        output_loading_info=True,
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"target-parity: transformers did not load {model_dir} cleanly: {bad}")
    model.eval()
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], time.monotonic() - t0


def describe(index, layers):
    if index == 0:
        return "embedding"
    if index == layers:
        return f"layer {index - 1} + final norm"
    return f"layer {index - 1}"


def compare(name, model_dir, example, tokens, tol, relative):
    import torch

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    indices = list(range(layers + 1))
    rust, rust_s = rust_hidden_states(example, model_dir, tokens, indices)
    ref, ref_s = reference_hidden_states(model_dir, tokens)
    if len(ref) != layers + 1:
        raise SystemExit(f"target-parity: transformers returned {len(ref)} hidden states, expected {layers + 1}")
    rows = []
    for k in indices:
        r = torch.tensor(rust[k], dtype=torch.float64)
        t = ref[k].to(torch.float64)
        if r.shape != t.shape:
            raise SystemExit(f"target-parity: hidden state {k}: Rust shape {tuple(r.shape)}, transformers {tuple(t.shape)}")
        diff = (r - t).abs()
        worst = int(diff.max(dim=1).values.argmax())
        rows.append({
            "index": k,
            "what": describe(k, layers),
            "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "worst_token": worst,
            "ref_max_abs": float(t.abs().max()),
        })
    overall = max(r["max_abs_diff"] for r in rows)
    scale = max(r["ref_max_abs"] for r in rows)
    measure = overall / scale if relative else overall
    print(f"\n== {name}: hidden {config['hidden_size']}, {layers} layers, "
          f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} kv heads, "
          f"head_dim {config['head_dim']}, vocab {config['vocab_size']}, {len(tokens)} tokens "
          f"(Rust {rust_s:.2f} s, transformers {ref_s:.2f} s)")
    print(f"   tokens: {tokens[:12]}{' ...' if len(tokens) > 12 else ''}")
    print(f"   {'index':>5}  {'hidden state':<24} {'max |diff|':>11} {'mean |diff|':>11} "
          f"{'worst tok':>9} {'max |ref|':>10}")
    for r in rows:
        print(f"   {r['index']:>5}  {r['what']:<24} {r['max_abs_diff']:>11.3e} {r['mean_abs_diff']:>11.3e} "
              f"{r['worst_token']:>9} {r['ref_max_abs']:>10.3e}")
    verdict = "ok" if measure < tol else "MISMATCH"
    kind = "relative (max |diff| / max |ref|)" if relative else "max abs diff"
    print(f"   overall max abs diff {overall:.3e}; {kind} {measure:.3e} vs tol {tol:g}: {verdict}")
    return {"name": name, "overall_max_abs_diff": overall, "measure": measure, "relative": relative,
            "ok": measure < tol, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--orch", required=True)
    ap.add_argument("--example", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", default="32,200")
    ap.add_argument("--shape", default="64x4,128x2")
    ap.add_argument("--perturb", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    counts = parse_list(args.tokens, int, "--tokens")
    shapes = parse_list(args.shape, parse_shape, "--shape")
    if any(n < 1 for n in counts):
        raise SystemExit("target-parity: --tokens must be positive")

    import safetensors
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"safetensors {safetensors.__version__}; seed {args.seed}, tol {args.tol:g}")

    results = []
    for hidden, layers in shapes:
        model_dir = os.path.join(args.work, f"tiny-h{hidden}-l{layers}-s{args.seed}")
        init_tiny(args.orch, model_dir, args.seed, hidden, layers)
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        variants = [(model_dir, False, "")]
        if args.perturb:
            pdir = model_dir + "-perturbed"
            perturb(model_dir, pdir, args.seed)
            variants.append((pdir, True, ", perturbed weights"))
        for n in counts:
            rng = random.Random(args.seed * 1_000_003 + n)
            tokens = [rng.randrange(vocab) for _ in range(n)]
            for d, relative, label in variants:
                name = f"{hidden}x{layers}, {n} tokens{label}"
                results.append(compare(name, d, args.example, tokens, args.tol, relative))

    print("\n== summary")
    for r in results:
        kind = "rel" if r["relative"] else "abs"
        print(f"   {r['name']:<40} max abs diff {r['overall_max_abs_diff']:.3e}"
              f"  ({kind} {r['measure']:.3e})  {'ok' if r['ok'] else 'MISMATCH'}")
    failed = [r for r in results if not r["ok"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if failed:
        print(f"\ntarget-parity: {len(failed)} of {len(results)} configurations above tol {args.tol:g}")
        return 1
    print(f"\ntarget-parity: all {len(results)} configurations within tol {args.tol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
