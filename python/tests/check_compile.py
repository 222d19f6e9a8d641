"""The torch drafter with its elementwise chains compiled (`--drafter-compile`) against eager.

    python tests/check_compile.py [--tol 1e-5] [--steps 3]

Two tiny f32 drafters with the same weights train the same micro-batches on the CPU (anchors,
lengths and loss masks from one seed), one with `torch.compile`'s chains (`fused.compiled`), one
eager, for each loss: plain cross-entropy with the position decay, and D-PACE. After each
micro-batch the losses, the accepted-token counts and the gradient norms must agree within
`--tol` relative, and so must the first micro-batch's gradients (each relative to its tensor's
largest entry). The compiled drafter must really be compiled: a compiler failure falls back to
eager, which would make the check vacuous, so here it fails the check. Also checks that the
comparison can fail: the compiled chains on a drafter whose RMSNorm epsilon differs give other
losses. Prints one JSON line per case; exits 0 when all hold.
"""

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dflash_orch import fused  # noqa: E402
from dflash_orch.drafter import TorchDrafter  # noqa: E402

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, HEAD_DIM = 97, 32, 64, 2, 4, 2, 8
BLOCK, STATES = 4, 2


def drafter(compile_, dpace, eps=1e-6):
    g = torch.Generator().manual_seed(5)
    heads = (0.5 * torch.randn(VOCAB, HIDDEN, generator=g),
             0.5 * torch.randn(VOCAB, HIDDEN, generator=g))
    d = TorchDrafter({
        "dtype": "f32", "feature_dtype": "f32", "model": None,
        "shape": {"hidden": HIDDEN, "intermediate": INTER, "layers": LAYERS, "heads": HEADS,
                  "kv_heads": KV, "head_dim": HEAD_DIM, "rms_eps": eps, "rope_theta": 10000.0,
                  "vocab": VOCAB},
        "block_size": BLOCK, "mask_token_id": VOCAB - 1, "states": STATES, "weight_decay": 0.01,
        "gamma": 4.0, "dpace_alpha": dpace, "compile": compile_,
    }, heads=heads)
    d.initialise(7)
    return d


def batches(seed, steps):
    """Per step: features, tokens, loss mask and (start, length, anchors) of 2–3 sequences."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sequences, tokens, mask, at = [], [], [], 0
        for _ in range(rng.randint(2, 3)):
            length = rng.randint(12, 40)
            prompt = rng.randint(1, length // 3)
            anchors = sorted(rng.sample(range(prompt, length - 1), rng.randint(1, 5)))
            sequences.append((at, length, anchors))
            tokens += [rng.randrange(VOCAB - 1) for _ in range(length)]
            mask += [0] * prompt + [1] * (length - prompt)
            at += length
        features = torch.randn(at, STATES * HIDDEN, generator=g)
        out.append((features, tokens, mask, sequences))
    return out


def train(d, data):
    figures = []
    for features, tokens, mask, sequences in data:
        out = d.micro_batch(features, tokens, mask, sequences, 1)
        grads = {n: d.P[n].grad.detach().clone() for n in d.names}
        step = d.step(3e-3, 1.0, False)
        figures.append((out["loss"], out["correct"], step["grad_norm"], grads))
    return figures


def relative(a, b):
    return abs(a - b) / max(1.0, abs(b))


def check(dpace, steps, tol):
    data = batches(31 if dpace is None else 32, steps)
    eager, comp = drafter(False, dpace), drafter(True, dpace)
    if eager.k is not fused.EAGER:
        return {"ok": False, "why": "the eager drafter is not eager"}
    if not comp.k.fused_ce:
        return {"ok": False, "why": f"not compiled: {comp.k.label}"}
    want, got = train(eager, data), train(comp, data)
    worst = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0}
    correct_equal = True
    for (l0, c0, n0, _), (l1, c1, n1, _) in zip(want, got):
        worst["loss"] = max(worst["loss"], relative(l1, l0))
        worst["grad_norm"] = max(worst["grad_norm"], relative(n1, n0))
        correct_equal &= c0 == c1
    # The first micro-batch's gradients, each relative to its tensor's largest entry. (Later ones
    # start from weights AdamW has moved by about lr * sign(gradient) per entry, so an entry's
    # gradient of 1e-12 either side of zero moves it by 2 lr whatever computed it; the losses
    # and norms after it are the measure there.)
    for n, b in want[0][3].items():
        scale = float(b.abs().max()) or 1.0
        worst["grads"] = max(worst["grads"], float((got[0][3][n] - b).abs().max()) / scale)
    # The comparison can fail: another epsilon moves the losses.
    other = train(drafter(True, dpace, eps=0.5), data)
    moved = max(relative(o[0], w[0]) for o, w in zip(other, want))
    ok = (all(v <= tol for v in worst.values()) and correct_equal and moved > 1e-3)
    return {"ok": ok, "dpace": dpace, "steps": steps, "worst": worst,
            "correct_equal": correct_equal, "perturbed_diff": moved, "kernels": comp.k.label}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    ok = True
    for dpace in (None, 0.5):
        r = check(dpace, a.steps, a.tol)
        print(json.dumps(r), flush=True)
        ok &= r["ok"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
