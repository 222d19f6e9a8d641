#!/usr/bin/env python3
"""Is `dflash-orch eval --temperature` distributed as the target's own sampling?

    check_sampling.py --target-model DIR --eval EVAL.json --temperature T [--top-p P]
                      [--top-k K] [--alpha A]

EVAL.json is `eval --json` run on one prompt repeated N times with --max-new-tokens 3 and
--ignore-eos: N independent draws of the first three generated tokens (the prefill's token, then
what speculative steps give: accepted drafts, residual draws, the token after accepted drafts).

The reference is exact: the target (loaded with `transformers`, f32) gives the probability of
every first token, of every second token after each first, and of every third after each likely
pair, each row made a distribution by the official package's `dflash.model._sampling_probs`
(temperature, top-k, top-p). The cells come from the reference alone, never from the draws: the
triples expected at least 5 times, then what is left of each pair, of each first token and of
everything, each a cell of its own where it is expected at least 5 times (see `reference`).
Pearson's chi-square statistic over them gives a p-value (survival function of the chi-square
distribution).

Prints one JSON object: n, cells, chi2, dof, p_value (the draws against the right distribution),
wrong_p_value (the same draws against the distribution at 1.5 times the temperature: a test that
cannot tell those apart has no power), accepted_share (prompts whose first speculative step kept
its first drafted token) and rejected_share. Exit 0 when p_value ≥ alpha and wrong_p_value <
alpha; 1 otherwise; 2 on bad input.
"""

import argparse
import json
import sys
from collections import Counter

import torch
from dflash.model import _sampling_probs
from transformers import AutoModelForCausalLM

MIN_EXPECTED = 5.0


def fail(msg: str) -> None:
    print(f"check_sampling: {msg}", file=sys.stderr)
    sys.exit(2)


def next_probs(model, rows: list[list[int]], temperature: float, top_p: float, top_k: int):
    """The sampling distribution (f64) of the token after each row (rows of equal length)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(rows), 256):
            ids = torch.tensor(rows[i:i + 256], dtype=torch.long)
            logits = model(input_ids=ids).logits[:, -1]
            out.append(_sampling_probs(logits, temperature, top_p, top_k).double())
    return torch.cat(out)


def reference(model, prompt: list[int], n: int, temperature: float, top_p: float, top_k: int):
    """The cells and their exact probabilities, from the reference alone: a triple
    (t1, t2, t3) whose expected count is at least 5 is a cell; what is left of a pair's mass
    (its other triples) is a cell ("pair", t1, t2) when that is expected 5 times, else it joins
    what is left of its first token, a cell ("first", t1) on the same rule, else the one cell
    "rest". Returns ({cell: p}, the function mapping a drawn triple to its cell)."""
    p1 = next_probs(model, [prompt], temperature, top_p, top_k)[0]
    firsts = [t for t in range(p1.shape[0]) if p1[t] > 0]
    p2 = next_probs(model, [prompt + [t] for t in firsts], temperature, top_p, top_k)
    pairs = {}
    for row, t1 in enumerate(firsts):
        for t2 in torch.nonzero(p2[row] > 0)[:, 0].tolist():
            pairs[(t1, t2)] = float(p1[t1] * p2[row, t2])
    # Only a pair likely enough to hold a cell of its own needs its third token's row.
    likely = [pair for pair, p in pairs.items() if p * n >= MIN_EXPECTED]
    cells = {}
    if likely:
        p3 = next_probs(model, [prompt + list(pair) for pair in likely], temperature, top_p, top_k)
        for row, pair in enumerate(likely):
            for t3 in torch.nonzero(p3[row] > 0)[:, 0].tolist():
                p = pairs[pair] * float(p3[row, t3])
                if p * n >= MIN_EXPECTED:
                    cells[pair + (t3,)] = p
    under_pair, under_first = {}, {}
    for cell, p in cells.items():
        under_pair[cell[:2]] = under_pair.get(cell[:2], 0.0) + p
    left_of_first = {t1: float(p1[t1]) for t1 in firsts}
    for pair, p in pairs.items():
        left = max(0.0, p - under_pair.get(pair, 0.0))
        if left * n >= MIN_EXPECTED:
            cells[("pair",) + pair] = left
            left_of_first[pair[0]] -= p
        else:
            left_of_first[pair[0]] -= p - left
    for t1, left in left_of_first.items():
        left = max(0.0, left)
        if left * n >= MIN_EXPECTED:
            cells[("first", t1)] = left
    cells["rest"] = max(0.0, 1.0 - sum(cells.values()))

    def cell_of(triple):
        for cell in (triple, ("pair",) + triple[:2], ("first", triple[0])):
            if cell in cells:
                return cell
        return "rest"

    return cells, cell_of


def chi_square(draws: list, n: int, cells: dict, cell_of):
    """Pearson's statistic, degrees of freedom and p-value of the draws against the cells (the
    rest cell merged into the smallest other when it is expected fewer than 5 times)."""
    counts = Counter(cell_of(t) for t in draws)
    expected, observed = dict(cells), {c: counts.get(c, 0) for c in cells}
    if expected["rest"] * n < MIN_EXPECTED and len(expected) > 1:
        rest_p, rest_o = expected.pop("rest"), observed.pop("rest")
        smallest = min(expected, key=expected.get)
        expected[smallest] += rest_p
        observed[smallest] += rest_o
    chi2 = sum((observed[c] - n * p) ** 2 / (n * p) for c, p in expected.items() if p > 0)
    dof = len(expected) - 1
    if dof < 1:
        fail(f"only {len(expected)} cell(s): the distribution is too concentrated to test")
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    return chi2, dof, p_value, len(expected)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-model", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--temperature", type=float, required=True)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=1e-3)
    args = ap.parse_args()
    if not args.temperature > 0:
        fail("--temperature must be above 0")

    with open(args.eval) as f:
        rows = json.load(f)["per_prompt"]
    prompts = {tuple(r["prompt_ids"]) for r in rows}
    if len(prompts) != 1:
        fail(f"{args.eval}: {len(prompts)} distinct prompts; the draws must share one")
    short = [r["line"] for r in rows if len(r["output_ids"]) < 3]
    if short:
        fail(f"{args.eval}: prompt lines {short[:5]} have fewer than 3 new tokens "
             "(run eval with --max-new-tokens 3 --ignore-eos)")
    n = len(rows)
    draws = [tuple(r["output_ids"][:3]) for r in rows]
    prompt = list(prompts.pop())

    model = AutoModelForCausalLM.from_pretrained(args.target_model, dtype=torch.float32).eval()
    cells, cell_of = reference(model, prompt, n, args.temperature, args.top_p, args.top_k)
    chi2, dof, p_value, used = chi_square(draws, n, cells, cell_of)
    wrong, wrong_of = reference(model, prompt, n, 1.5 * args.temperature, args.top_p, args.top_k)
    _, _, wrong_p, _ = chi_square(draws, n, wrong, wrong_of)
    # The first speculative step kept its first drafted token exactly when it gave two tokens
    # (the third then ends the output): one verify step in all.
    accepted = sum(1 for r in rows if r["steps"] == 1) / n
    result = {"n": n, "cells": used, "chi2": chi2, "dof": dof, "p_value": p_value,
              "wrong_p_value": wrong_p, "accepted_share": accepted, "rejected_share": 1 - accepted}
    print(json.dumps(result))
    sys.exit(0 if p_value >= args.alpha and wrong_p < args.alpha else 1)


if __name__ == "__main__":
    main()
