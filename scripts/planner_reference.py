#!/usr/bin/env python3
"""A plain Python/numpy implementation of the batch planner, for comparison with `dflash-orch plan`.

It implements the same algorithms as orchestrator/src/planner (greedy padded packing with a
running maximum, the four modes, the four bucket interleaves, `auto:K` bucket boundaries and the
varlen packer with a 512-sample look-ahead) the way one would write them in Python: numpy for
shuffles, sorting and bucket assignment, Python loops for the sequential greedy parts. Random
numbers come from numpy, so plans are statistically equivalent to dflash-orch's, not identical.

    python scripts/planner_reference.py --lengths lengths.txt --mode bucketed \\
        --buckets 0,770,1216,1728,2432,3296,8192 --interleave spread --json

`plan_ms` is the time to turn the lengths into an ordered list of batches (like dflash-orch's: it
excludes reading the file and computing the statistics).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
import time

import numpy as np

MODES = ("sorted", "shuffle", "bucketed", "packed")
INTERLEAVES = ("random", "diverse", "spread", "stratified")

# The planner's constants; keep them equal to those in orchestrator/src/planner/.
PACK_LOOKAHEAD = 512  # samples the varlen packer may choose from to fill a batch's last gap
AUTO_SUBSAMPLE = 32_768  # samples packed by the auto:K search
AUTO_CANDIDATES = 64  # candidate boundaries (length quantiles) of the auto:K search
SPREAD_JITTER = 1.0
WINDOW_REPEAT_PENALTY = 1.0
STRATIFIED_JITTER = 0.6

# A batch: (bucket, start, count, max_len, real_tokens); its samples are samples[start:start+count].


# --- packing -------------------------------------------------------------------------------------


def greedy_padded(lens, budget):
    """Greedy padded packing of `lens` in order. A sample joins the open batch while
    (count + 1) * max(running_max, len) <= budget, else it opens the next batch.

    Yields (first position, count, max_len, real_tokens) for every batch.
    """
    first = count = batch_max = real = 0
    for pos, n in enumerate(lens):
        new_max = max(batch_max, n)
        if count > 0 and (count + 1) * new_max > budget:
            yield first, count, batch_max, real
            first, count, batch_max, real = pos, 1, n, n
        else:
            count += 1
            batch_max = new_max
            real += n
    if count > 0:
        yield first, count, batch_max, real


def pack_padded(order, lengths, budget, bucket, offset):
    """Batches of the samples `order` (which become samples[offset:offset + len(order)])."""
    lens = lengths[order].tolist()
    return [
        (bucket, offset + first, count, max_len, real)
        for first, count, max_len, real in greedy_padded(lens, budget)
    ]


def pack_varlen(order, lengths, budget):
    """Variable-length batches holding at most `budget` real tokens each.

    Samples enter a look-ahead window of PACK_LOOKAHEAD in `order`. Each batch takes the oldest
    pending sample while it fits, otherwise the largest pending sample that fits the remaining gap
    (the most recently admitted one among equal lengths), until nothing fits.
    """
    ids = order.tolist()
    lens = lengths[order].tolist()
    n = len(lens)
    window = []  # pending (length, position), sorted
    taken = bytearray(n)
    admitted = head = 0
    samples, batches = [], []
    while True:
        start = len(samples)
        count = batch_max = real = 0
        while True:
            while len(window) < PACK_LOOKAHEAD and admitted < n:
                bisect.insort(window, (lens[admitted], admitted))
                admitted += 1
            while head < admitted and taken[head]:
                head += 1
            if head == admitted:
                break
            gap = budget - real
            if lens[head] <= gap:
                pos = head
                del window[bisect.bisect_left(window, (lens[head], head))]
            else:
                i = bisect.bisect_right(window, (gap, n)) - 1
                if i < 0:
                    break
                _, pos = window.pop(i)
            taken[pos] = 1
            count += 1
            batch_max = max(batch_max, lens[pos])
            real += lens[pos]
            samples.append(ids[pos])
        if count == 0:
            break
        batches.append((0, start, count, batch_max, real))
    return batches, np.array(samples, dtype=np.int64)


# --- buckets -------------------------------------------------------------------------------------


def parse_buckets(spec):
    """`auto:K` -> K, a list `0,770,...,8192` -> the boundaries."""
    if spec.startswith("auto:"):
        return int(spec[len("auto:"):])
    return [int(x) for x in spec.split(",")]


def auto_boundaries(kept_lengths, k, budget, max_len, rng):
    """K buckets minimising the padded tokens that greedy packing of a random subsample produces.

    Candidate boundaries are AUTO_CANDIDATES length quantiles of the subsample; cost[i][j] is the
    padding of packing the subsample's samples in (c_i, c_j] (in the subsample's random order); a
    dynamic programme picks the K consecutive buckets of least total cost.
    """
    sample = rng.permutation(kept_lengths)[:AUTO_SUBSAMPLE]
    srt = np.sort(sample)
    cands = [0]
    for q in range(1, AUTO_CANDIDATES + 1):
        v = int(srt[math.ceil(q * len(srt) / AUTO_CANDIDATES) - 1])
        if v > cands[-1]:
            cands.append(v)
    cands[-1] = max_len
    m = len(cands) - 1
    k = min(k, m)

    interval = np.searchsorted(cands, sample, side="left")  # candidate interval 1..m of each sample
    cost = [[0] * (m + 1) for _ in range(m + 1)]
    for i in range(m):
        for j in range(i + 1, m + 1):
            members = sample[(interval > i) & (interval <= j)].tolist()
            cost[i][j] = sum(c * mx for _, c, mx, _ in greedy_padded(members, budget))

    inf = float("inf")
    best = [[inf] * (m + 1) for _ in range(k + 1)]
    prev = [[0] * (m + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for t in range(1, k + 1):
        for j in range(t, m + 1):
            for i in range(t - 1, j):
                c = best[t - 1][i] + cost[i][j]
                if c < best[t][j]:
                    best[t][j] = c
                    prev[t][j] = i
    bounds = [max_len]
    j = m
    for t in range(k, 0, -1):
        j = prev[t][j]
        bounds.append(cands[j])
    return bounds[::-1]


# --- interleaves: the bucket id of every step, given each bucket's batch count -------------------


def interleave_random(counts, rng):
    seq = np.repeat(np.arange(len(counts)), counts)
    rng.shuffle(seq)
    return seq.tolist()


def interleave_diverse(counts, rng):
    """Each step: a bucket other than the last one, weighted by remaining batches (any bucket
    when only the last one has batches left)."""
    remaining = list(counts)
    seq = []
    last = None
    for _ in range(sum(counts)):
        others = sum(n for b, n in enumerate(remaining) if b != last)
        exclude = last if others > 0 else None
        r = int(rng.integers(others if others > 0 else sum(remaining)))
        for b, n in enumerate(remaining):
            if b == exclude or n == 0:
                continue
            if r < n:
                pick = b
                break
            r -= n
        remaining[pick] -= 1
        seq.append(pick)
        last = pick
    return seq


def run_cap(counts):
    """Longest run of one bucket `spread` allows: one more than the largest bucket forces."""
    largest = max(counts)
    others = sum(counts) - largest
    return max(math.ceil(largest / (others + 1)), 1) + 1


def interleave_spread(counts, accum, rng):
    """Credit scheduler: every step each bucket earns its share of the remaining batches; the one
    with most credit (plus jitter, minus a penalty for repeats within the accumulation window)
    goes next, with runs of one bucket capped."""
    k = len(counts)
    remaining = list(counts)
    left = sum(counts)
    cap = run_cap(counts)
    credit = rng.random(k).tolist()  # random phase
    run_bucket, run_len = None, 0
    in_window = [0] * k
    seq = []
    step = 0
    while left > 0:
        if step % accum == 0:
            in_window = [0] * k
        step += 1
        active = sum(1 for n in remaining if n > 0)
        jitter = rng.random(k).tolist()
        pick, best = None, -math.inf
        for b in range(k):
            if remaining[b] == 0:
                continue
            credit[b] += remaining[b] / left
            if b == run_bucket and run_len >= cap and active > 1:
                continue
            score = (
                credit[b]
                + SPREAD_JITTER * jitter[b]
                - WINDOW_REPEAT_PENALTY * max(in_window[b] - 1, 0)
            )
            if score > best:
                pick, best = b, score
        credit[pick] -= 1.0
        in_window[pick] += 1
        remaining[pick] -= 1
        left -= 1
        if pick == run_bucket:
            run_len += 1
        else:
            run_bucket, run_len = pick, 1
        seq.append(pick)
    return seq


def interleave_stratified(counts, accum, rng):
    """Window by window (`accum` batches): each window gets the whole batches its buckets are
    owed, the rest goes to distinct buckets by fractional debt; windows are ordered to avoid
    adjacent repeats."""
    k = len(counts)
    remaining = list(counts)
    left = sum(counts)
    credit = [0.0] * k
    seq = []
    while left > 0:
        size = min(accum, left)
        for b in range(k):
            if remaining[b] > 0:
                credit[b] += size * remaining[b] / left
        alloc = [0] * k
        filled = 0
        # Whole batches owed first, largest debt first.
        for b in sorted((b for b in range(k) if remaining[b] > 0), key=lambda b: (-credit[b], b)):
            give = min(max(math.floor(credit[b]), 0), remaining[b], size - filled)
            alloc[b] = give
            filled += give
        # The rest to buckets not yet in the window (then any), by fractional debt plus jitter.
        while filled < size:
            pick, best = None, None
            for b in range(k):
                if remaining[b] <= alloc[b]:
                    continue
                key = (alloc[b] == 0, credit[b] - alloc[b] + STRATIFIED_JITTER * rng.random())
                if best is None or key > best:
                    pick, best = b, key
            alloc[pick] += 1
            filled += 1
        for b in range(k):
            credit[b] -= alloc[b]
            remaining[b] -= alloc[b]
        left -= size
        # Order the window: most-allocated bucket first, not the previous step's bucket when
        # another is available, ties broken at random.
        prev = seq[-1] if seq else None
        for _ in range(size):
            pick, best = None, None
            for b in range(k):
                if alloc[b] == 0:
                    continue
                key = (b != prev, alloc[b], rng.random())
                if best is None or key > best:
                    pick, best = b, key
            alloc[pick] -= 1
            seq.append(pick)
            prev = pick
    return seq


INTERLEAVE_FNS = {
    "random": lambda counts, accum, rng: interleave_random(counts, rng),
    "diverse": lambda counts, accum, rng: interleave_diverse(counts, rng),
    "spread": interleave_spread,
    "stratified": interleave_stratified,
}


# --- the planner ---------------------------------------------------------------------------------


def plan(raw_lengths, mode, buckets, interleave, budget, max_len, accum, seed):
    """Plans one epoch. Returns (batches in plan order, samples, bucket boundaries)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(raw_lengths, max_len)  # truncate overlong samples
    kept = np.flatnonzero(lengths > 0)  # empty samples are dropped

    if mode == "sorted":
        order = kept[np.argsort(lengths[kept], kind="stable")]  # by (length, index)
        batches = pack_padded(order, lengths, budget, 0, 0)
        batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches, order, [0, max_len]

    if mode == "shuffle":
        order = rng.permutation(kept)
        return pack_padded(order, lengths, budget, 0, 0), order, [0, max_len]

    if mode == "packed":
        order = rng.permutation(kept)
        batches, samples = pack_varlen(order, lengths, budget)
        return batches, samples, [0, max_len]

    # bucketed
    if isinstance(buckets, int):
        boundaries = auto_boundaries(lengths[kept], buckets, budget, max_len, rng)
    else:
        boundaries = buckets
    # A bucket holds lo < length <= hi: the first boundary >= length closes it.
    bucket_of = np.searchsorted(boundaries, lengths[kept], side="left") - 1
    per_bucket, orders = [], []
    offset = 0
    for b in range(len(boundaries) - 1):
        order = rng.permutation(kept[bucket_of == b])
        per_bucket.append(pack_padded(order, lengths, budget, b, offset))
        orders.append(order)
        offset += len(order)
    counts = [len(v) for v in per_bucket]
    sequence = INTERLEAVE_FNS[interleave](counts, accum, rng)
    next_batch = [0] * len(per_bucket)
    batches = []
    for b in sequence:
        batches.append(per_bucket[b][next_batch[b]])
        next_batch[b] += 1
    return batches, np.concatenate(orders), boundaries


# --- statistics ----------------------------------------------------------------------------------


def stats(batches, samples, lengths, mode, budget, accum):
    arr = np.array(batches, dtype=np.int64).reshape(-1, 5)
    bucket, count, batch_max, real = arr[:, 0], arr[:, 2], arr[:, 3], arr[:, 4]
    n_batches = len(arr)
    real_tokens = int(real.sum())
    if mode == "packed":
        padded_tokens = n_batches * budget
    else:
        padded_tokens = int((count * batch_max).sum())

    # Runs of one bucket in plan order.
    change = np.flatnonzero(np.diff(bucket)) + 1
    run_lengths = np.diff(np.concatenate(([0], change, [n_batches])))
    # Windows of `accum` batches in which 3+ batches share a bucket: after sorting each window,
    # that is some position i with w[i] == w[i + 2].
    n_windows = n_batches // accum
    windows = np.sort(bucket[: n_windows * accum].reshape(n_windows, accum), axis=1)
    heavy = int((windows[:, 2:] == windows[:, :-2]).any(axis=1).sum()) if accum >= 3 else 0

    # Every kept sample exactly once, every batch within budget.
    kept = int((lengths > 0).sum())
    planned_ok = len(samples) == kept and len(np.unique(samples)) == kept
    if mode == "packed":
        within_budget = bool((real <= budget).all())
    else:
        within_budget = bool((count * batch_max <= budget).all())

    return {
        "batches": n_batches,
        "real_tokens": real_tokens,
        "padded_tokens": padded_tokens,
        "padding_efficiency": real_tokens / padded_tokens if padded_tokens else 0.0,
        "mean_batch_size": len(samples) / n_batches if n_batches else 0.0,
        "max_same_bucket_run": int(run_lengths.max()) if n_batches else 0,
        "windows_3plus_same_bucket": heavy / n_windows if n_windows else 0.0,
        "tail_same_bucket_run": int(run_lengths[-1]) if n_batches else 0,
        "bucket_batches": np.bincount(bucket).tolist(),
        "valid": planned_ok and within_budget,
    }


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", required=True, help="sample lengths, one integer per line")
    p.add_argument("--mode", choices=MODES, default="bucketed")
    p.add_argument("--buckets", default=None, help="0,770,...,8192 or auto:K (default auto:8)")
    p.add_argument("--interleave", choices=INTERLEAVES, default=None, help="default spread")
    p.add_argument("--token-budget", type=int, default=49_152)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.mode != "bucketed" and (args.buckets or args.interleave):
        p.error("--buckets and --interleave apply only to --mode bucketed")
    buckets = parse_buckets(args.buckets or "auto:8")
    interleave = args.interleave or "spread"

    with open(args.lengths) as f:
        raw = np.array(f.read().split(), dtype=np.int64)

    started = time.perf_counter()
    batches, samples, boundaries = plan(
        raw, args.mode, buckets, interleave, args.token_budget, args.max_len, args.accum, args.seed
    )
    plan_ms = (time.perf_counter() - started) * 1e3

    lengths = np.minimum(raw, args.max_len)
    out = {
        "mode": args.mode,
        "interleave": interleave if args.mode == "bucketed" else "none",
        "samples": len(raw),
        "boundaries": [int(b) for b in boundaries],
        **stats(batches, samples, lengths, args.mode, args.token_budget, args.accum),
        "plan_ms": plan_ms,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:28} {value}")
    return 0 if out["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
