"""Data-parallel torch drafters' step, checked on CPU (gloo).

  check_parallel.py rank --world W --rank R --port P --out FILE
      One of W ranks: the drafter from fixed initial weights trains its micro-batches of one
      accumulation group of W * 2 (plan positions R, R + W, ...), the ranks sum their gradients
      in rank order (parallel.sum_gradients) and step; writes the weights after two such steps
      (safetensors) to FILE.
  check_parallel.py reference --world W --out FILE
      One process trains the same W * 2 micro-batches one after the other into one gradient per
      step (what one drafter does with --accum W*2) and steps; writes its weights.
  check_parallel.py compare A B
      Prints {"identical": bool, "max_rel": float}: byte equality and the largest relative
      difference per weight (|a - b| / max(|b|, 1e-6) over each tensor's max |b|).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflash_orch.bench_step import drafter_for  # noqa: E402

VOCAB, HIDDEN, SEQ, SEQUENCES_PER_MICRO = 300, 32, 40, 2


def drafter():
    target = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6}
    return drafter_for(target, 1, 4, 2, "f32", torch.device("cpu"), gamma=7.0)


def micro_batch(step, position):
    """The micro-batch at `position` of step `step`'s group: its features, tokens, mask and
    sequences (the same on every rank that computes it)."""
    g = torch.Generator().manual_seed(1000 * step + position)
    n = SEQ * SEQUENCES_PER_MICRO
    features = torch.randn(n, 2 * HIDDEN, generator=g)
    tokens = torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
    mask = [1 if i % SEQ >= 4 else 0 for i in range(n)]
    sequences = [(s * SEQ, SEQ, sorted(torch.randperm(SEQ - 6, generator=g)[:6].add(4).tolist()))
                 for s in range(SEQUENCES_PER_MICRO)]
    return features, tokens, mask, sequences


def save(d, path):
    from safetensors.torch import save_file

    save_file({n: d.P[n].detach().contiguous() for n in d.names}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["rank", "reference", "compare"])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--store", help="the group's FileStore (a path every rank is given)")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.mode == "compare":
        from safetensors.torch import load_file

        x, y = load_file(a.files[0]), load_file(a.files[1])
        worst = max(float(((x[n] - y[n]).abs().max() / y[n].abs().max().clamp_min(1e-6))) for n in y)
        with open(a.files[0], "rb") as f, open(a.files[1], "rb") as g:
            identical = f.read() == g.read()
        print(json.dumps({"identical": identical, "max_rel": worst}))
        return 0
    accum = 2 * a.world
    d = drafter()
    if a.mode == "rank":
        from dflash_orch.parallel import Group

        d.group = Group(a.rank, a.world, torch.device("cpu"), timeout_s=60, store=a.store)
    for step in range(2):
        positions = range(a.rank, accum, a.world) if a.mode == "rank" else range(accum)
        for p in positions:
            features, tokens, mask, sequences = micro_batch(step, p)
            d.micro_batch(features, tokens, mask, sequences, accum)
        d.step(1e-3, 1.0, False)
    save(d, a.out)
    if d.group is not None:
        d.group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
