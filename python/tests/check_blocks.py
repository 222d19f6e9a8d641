"""Checks of the batched drafter step's pieces on CPU (python/dflash_orch/blocks.py), on random
anchors, sequence lengths and sliding windows:

- the plan's intervals give, at every (query, key), the mask the per-sequence definition gives:
  the context before the block's anchor in its own sequence, and the block's own keys (both
  within the window on sliding layers);
- the tile states (what a flex `BlockMask` lists) are exact: a skipped tile holds no attending
  pair, a full tile only attending pairs, a partial tile some of each;
- flex attention (eager, on CPU) under the `BlockMask` built from the intervals computes what
  SDPA computes under the dense mask;
- the linear cross-entropy's loss and gradient equal autograd's through `log_softmax`, with and
  without D-PACE.

Exits 0 when every check holds, else prints the first failure and exits 1.
"""

import os
import random
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dflash_orch import blocks  # noqa: E402
from dflash_orch.drafter import dpace_weights  # noqa: E402


def reference_mask(sequences, block, window, lo, pad, anchors_range):
    """The mask of the chunk `anchors_range` written from the definition, pair by pair."""
    flat = [(start, length, p) for start, length, anchors in sequences for p in anchors]
    chosen = [flat[i] for i in anchors_range]
    rows = len(chosen) * block
    keys = pad + rows
    mask = torch.zeros(rows, keys, dtype=torch.bool)
    for a, (start, length, p) in enumerate(chosen):
        for k in range(block):
            r = a * block + k
            q_pos = p + k
            for j in range(p):  # context positions of the sequence before the anchor
                if window is None or q_pos - j < window:
                    mask[r, start + j - lo] = True
            for k2 in range(block):
                if window is None or abs(k - k2) < window:
                    mask[r, pad + a * block + k2] = True
    return mask


def check_masks(rng):
    for case in range(60):
        block = rng.choice([2, 4, 16])
        window = rng.choice([None, None, 1, 3, 7, 40])
        sequences, at = [], 0
        for _ in range(rng.randint(1, 4)):
            length = rng.randint(1, 90)
            anchors = sorted(rng.sample(range(length), rng.randint(1, min(length, 9))))
            sequences.append((at, length, anchors))
            at += length + rng.randint(0, 3)  # tokens between sequences belong to none
        tokens = [rng.randrange(50) for _ in range(at)]
        mask = [rng.random() < 0.7 for _ in range(at)]
        plan = blocks.Plan(tokens, mask, sequences, block, None, window)
        for size in (None, rng.randint(1, 5)):
            for anchors in plan.chunks(size):
                lo, hi = plan.key_span(anchors)
                for pad in (hi - lo, -(-(hi - lo) // 8) * 8):
                    iv = plan.intervals(anchors, lo, pad)
                    rows = len(anchors) * block
                    dense = blocks.dense_mask(iv, pad + rows)
                    want = reference_mask(sequences, block, window, lo, pad, anchors)
                    if not torch.equal(dense, want):
                        bad = (dense != want).nonzero()[0].tolist()
                        raise AssertionError(f"case {case}: the intervals' mask differs from the "
                                             f"definition at (query, key) {bad}")
                    check_tiles(case, iv, dense, rows, pad + rows, rng.choice([4, 8, 16]))


def check_tiles(case, iv, dense, rows, keys, tile):
    states = blocks.tile_states(iv, rows, keys, tile)
    for qt in range(states.shape[0]):
        for kt in range(states.shape[1]):
            part = dense[qt * tile:(qt + 1) * tile, kt * tile:(kt + 1) * tile]
            want = 0 if not part.any() else (2 if part.all() else 1)
            if int(states[qt, kt]) != want:
                raise AssertionError(f"case {case}: tile ({qt}, {kt}) of size {tile} is "
                                     f"{int(states[qt, kt])}, its pairs make it {want}")


def check_flex(rng):
    from torch.nn.attention.flex_attention import flex_attention

    for case in range(8):
        block = 4
        window = rng.choice([None, 3])
        sequences, at = [], 0
        for _ in range(rng.randint(1, 3)):
            length = rng.randint(20, 200)
            anchors = sorted(rng.sample(range(length), rng.randint(1, 12)))
            sequences.append((at, length, anchors))
            at += length
        plan = blocks.Plan([0] * at, [1] * at, sequences, block, None, window)
        anchors = range(0, plan.anchors_n)
        lo, hi = plan.key_span(anchors)
        tile = 16
        pad = -(-(hi - lo) // tile) * tile
        iv = plan.intervals(anchors, lo, pad)
        rows, keys = plan.anchors_n * block, pad + plan.anchors_n * block
        heads, kv_heads, d = 4, 2, 8
        g = torch.Generator().manual_seed(case)
        q = torch.randn(1, heads, rows, d, generator=g, dtype=torch.float64)
        k = torch.randn(1, kv_heads, keys, d, generator=g, dtype=torch.float64)
        v = torch.randn(1, kv_heads, keys, d, generator=g, dtype=torch.float64)
        mask = blocks.block_mask(iv, rows, keys, tile)
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=blocks.dense_mask(iv, keys),
                                              enable_gqa=True)
        err = float((out - want).abs().max())
        if err > 1e-10:
            raise AssertionError(f"flex case {case}: flex under the BlockMask differs from SDPA "
                                 f"under the dense mask by {err}")
        # Tiles the BlockMask lists are the tiles that hold an attending pair.
        listed = mask.to_dense()[0, 0].bool()
        states = blocks.tile_states(iv, rows, keys, tile)
        if not torch.equal(listed, states > 0):
            raise AssertionError(f"flex case {case}: the BlockMask lists other tiles than the "
                                 "intervals touch")


def check_linear_ce(rng):
    for alpha in (None, 0.3):
        block, n_blocks, hidden, vocab = 4, 6, 16, 37
        n = block * n_blocks
        g = torch.Generator().manual_seed(7)
        x = torch.randn(n, hidden, generator=g, dtype=torch.float64, requires_grad=True)
        head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
        targets = torch.randint(0, vocab, (n,), generator=g)
        counted = torch.rand(n, generator=g) < 0.7
        weights = torch.where(counted, torch.rand(n, generator=g, dtype=torch.float64), 0.0)
        scale = 0.37
        scaled, total, hits, gold = blocks.LinearCE.apply(x, head, targets, weights.float(),
                                                          counted, block, 8, alpha, scale)
        scaled.backward()
        got = x.grad.clone()
        x.grad = None
        log_p = F.log_softmax(x @ head.t(), dim=-1)
        ce = -log_p.gather(1, targets.unsqueeze(1)).squeeze(1)
        w = weights.float().double()
        if alpha is not None:
            w = (dpace_weights(torch.exp(-ce.detach()), counted, block, alpha)
                 * weights.float().double()).float().double()
        want_total = (ce * w).sum()
        (want_total * scale).backward()
        got_total, want = float(total.detach()), float(want_total.detach())
        if abs(got_total - want) > 1e-9 * max(1.0, abs(want)):
            raise AssertionError(f"linear CE (alpha {alpha}): total {got_total}, autograd {want}")
        err = float((got - x.grad).abs().max())
        if err > 1e-9:
            raise AssertionError(f"linear CE (alpha {alpha}): gradient differs by {err}")
        if not torch.equal(hits, (x @ head.t()).argmax(-1) == targets):
            raise AssertionError("linear CE: greedy hits differ")
        if float((gold - ce.detach()).abs().max()) > 1e-6:
            raise AssertionError("linear CE: per-row cross-entropy differs")


def main():
    # Eager flex attention on CPU is the reference use here; its advice to compile is not.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    rng = random.Random(int(os.environ.get("CHECK_SEED", "11")))
    try:
        check_masks(rng)
        check_flex(rng)
        check_linear_ce(rng)
    except AssertionError as e:
        print(f"FAIL: {e}")
        return 1
    print("ok: masks, tiles, flex against SDPA, linear cross-entropy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
