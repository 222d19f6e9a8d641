"""The pieces of the drafter's batched step (`TorchDrafter.micro_batch`): one plan per
micro-batch made on the host, the block mask as two key intervals per query, the mask built from
them (dense for SDPA on CPU, a flex `BlockMask` on GPU, never the dense `[queries, keys]` mask
there), and the chunked linear cross-entropy.

The queries are the block positions of every anchor of the micro-batch, `anchors x block` rows
in the order the sequences give them. A chunk of anchors sees one key layout: the context keys
of the micro-batch's tokens `[lo, hi)` (the span its anchors' sequences reach), padded to `pad`,
followed by its blocks' own keys (`block` per anchor). Query row `r` (anchor `a`, offset `k`)
attends where

    ctx_lo[r] <= key < ctx_hi[r]      the context before its anchor, in its own sequence
    blk_lo[r] <= key < blk_hi[r]      its own block (offsets within the sliding window)

which is the whole mask: no `[queries, keys]` tensor needs to exist to know it.
"""

import math

import torch
import torch.nn.functional as F

# Flex attention's tile (queries and keys): a `BlockMask` lists, per query tile, the key tiles it
# touches, fully (every pair attends) or partly (the mask is evaluated inside the tile).
TILE = 128


class Plan:
    """A micro-batch's indices and weights, computed once on the host from its sequences
    (`(start, length, anchors)`), the tokens and the loss mask: per anchor its global position,
    per block row (`anchors x block`, row-major) its label, its predecessor, its teacher row,
    its loss weight and its two key intervals in global token coordinates."""

    def __init__(self, tokens, loss_mask, sequences, block, gamma, window):
        self.block = b = block
        self.tokens_n = n_tok = len(tokens)
        tok = torch.as_tensor(tokens, dtype=torch.long)
        lm = torch.as_tensor(loss_mask).reshape(-1) != 0
        starts, lengths, anchors, counts = [], [], [], []
        self.positions = torch.zeros(n_tok, dtype=torch.long)
        for start, length, seq_anchors in sequences:
            self.positions[start:start + length] = torch.arange(length)
            starts.append(start)
            lengths.append(length)
            counts.append(len(seq_anchors))
            anchors.extend(seq_anchors)
        self.counts = counts
        count = torch.tensor(counts, dtype=torch.long)
        a_start = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long), count)
        a_len = torch.repeat_interleave(torch.tensor(lengths, dtype=torch.long), count)
        local = torch.tensor(anchors, dtype=torch.long)
        self.anchors_n = a = len(anchors)
        k = torch.arange(b)
        pos = local.unsqueeze(1) + k  # [a, b]: positions in the sequence
        inside = pos < a_len.unsqueeze(1)
        glob = a_start.unsqueeze(1) + torch.minimum(pos, (a_len - 1).clamp(min=0).unsqueeze(1))
        self.anchor_global = a_start + local
        self.anchor_tokens = tok[self.anchor_global] if a else torch.zeros(0, dtype=torch.long)
        self.block_positions = pos
        self.targets = torch.where(inside, tok[glob], 0).reshape(-1)
        before = a_start.unsqueeze(1) + (pos - 1).clamp(min=0).minimum(
            (a_len - 1).clamp(min=0).unsqueeze(1))
        # The data's token before each position (the anchor's own at position 1): DFlash2's
        # predecessor, and the teacher's row (the target's state that predicts the position).
        self.previous = tok[before].reshape(-1)
        self.teacher_rows = before.reshape(-1)
        decay = torch.tensor(
            [1.0 if gamma is None else math.exp(-(i - 1.0) / gamma) for i in range(b)],
            dtype=torch.float64).to(torch.float32)
        counted = inside & (k >= 1) & lm[glob]
        self.counted = counted.reshape(-1)
        self.weights = torch.where(counted, decay, torch.zeros(())).reshape(-1)
        # The weights' sum per sequence in f64, as the stage sums them (an f32 sum of 8,192
        # weights drifts by 1e-5), then over the sequences.
        per_seq = torch.split(self.weights.view(a, b), counts) if a else []
        self.weight_sum = sum(float(w.double().sum()) for w in per_seq)
        # Key intervals, global coordinates: the context before the anchor in its sequence (from
        # the window's start on sliding layers); the block's own keys as offsets in the block.
        ctx_hi = self.anchor_global.unsqueeze(1).expand(a, b)
        ctx_lo = a_start.unsqueeze(1).expand(a, b)
        blk_lo = torch.zeros(a, b, dtype=torch.long)
        blk_hi = torch.full((a, b), b, dtype=torch.long)
        if window is not None:
            ctx_lo = a_start.unsqueeze(1) + (pos - window + 1).clamp(min=0)
            blk_lo = (k - window + 1).clamp(min=0).expand(a, b)
            blk_hi = (k + window).clamp(max=b).expand(a, b)
        self.ctx_lo = torch.minimum(ctx_lo, ctx_hi).reshape(-1)
        self.ctx_hi = ctx_hi.reshape(-1)
        self.blk_lo = blk_lo.reshape(-1)
        self.blk_hi = blk_hi.reshape(-1)

    def chunks(self, size):
        """Consecutive anchor ranges of at most `size` anchors: whole sequences together while
        they fit, a sequence of more than `size` anchors in pieces of `size` on its own (so that
        a chunk's keys span the fewest sequences). Without a size, as many as the sequence with
        the most has: what the launch's memory plan allows at once (one sequence's anchors,
        `--anchor-chunk` where fewer fit)."""
        if not size:
            size = max(self.counts, default=1)
        if size >= self.anchors_n:
            return [range(0, self.anchors_n)] if self.anchors_n else []
        out, at, open_at = [], 0, 0
        for count in self.counts:
            if at + count - open_at > size and at > open_at:
                out.append(range(open_at, at))
                open_at = at
            if count > size:
                for i in range(at, at + count, size):
                    out.append(range(i, min(i + size, at + count)))
                open_at = at + count
            at += count
        if at > open_at:
            out.append(range(open_at, at))
        return out

    def key_span(self, anchors):
        """The context tokens `[lo, hi)` the chunk's anchors see (host values, no device sync);
        an empty span is widened to one token, masked for every query."""
        rows = slice(anchors.start * self.block, anchors.stop * self.block)
        lo = int(self.ctx_lo[rows].min())
        hi = int(self.ctx_hi[rows].max())
        if hi <= lo:
            lo, hi = min(lo, max(self.tokens_n - 1, 0)), min(lo, max(self.tokens_n - 1, 0)) + 1
        return lo, hi

    def intervals(self, anchors, lo, pad):
        """The chunk's query rows' two key intervals in its key layout (context `[lo, ...)`
        padded to `pad` keys, then the blocks): `[4, rows]` int64, ctx_lo, ctx_hi, blk_lo,
        blk_hi."""
        b = self.block
        rows = slice(anchors.start * b, anchors.stop * b)
        base = pad + torch.arange(len(anchors)).repeat_interleave(b) * b
        return torch.stack([self.ctx_lo[rows] - lo, self.ctx_hi[rows] - lo,
                            base + self.blk_lo[rows], base + self.blk_hi[rows]])


def dense_mask(iv, keys):
    """The boolean `[rows, keys]` mask of the intervals `iv` (`Plan.intervals`)."""
    kv = torch.arange(keys, device=iv.device).unsqueeze(0)
    c_lo, c_hi, b_lo, b_hi = (t.unsqueeze(1) for t in iv)
    return ((kv >= c_lo) & (kv < c_hi)) | ((kv >= b_lo) & (kv < b_hi))


def tile_states(iv, rows, keys, tile=TILE):
    """Per (query tile, key tile) of the layout: 0 no pair attends, 1 some do, 2 all do; from
    the intervals alone (`[query tiles, key tiles]`, tile-level, never the element-level mask).
    Padding rows past `rows` in the last query tile are ignored."""
    q_tiles, k_tiles = -(-rows // tile), -(-keys // tile)
    fill = q_tiles * tile - rows
    # Padding rows: an empty interval never touches a tile, and counts as covering it.
    ivp = torch.cat([iv, torch.zeros(4, fill, dtype=iv.dtype, device=iv.device)], dim=1)
    ivp = ivp.view(4, q_tiles, tile, 1)
    real = torch.cat([torch.ones(rows, dtype=torch.bool, device=iv.device),
                      torch.zeros(fill, dtype=torch.bool, device=iv.device)]).view(q_tiles, tile, 1)
    k0 = (torch.arange(k_tiles, device=iv.device) * tile).view(1, 1, k_tiles)
    k1 = torch.clamp(k0 + tile, max=keys)
    c_lo, c_hi, b_lo, b_hi = ivp
    touch = ((torch.maximum(c_lo, k0) < torch.minimum(c_hi, k1))
             | (torch.maximum(b_lo, k0) < torch.minimum(b_hi, k1))) & real
    # The two intervals touch where the context runs up to the block (no padding between).
    joined = (c_hi == b_lo) & (c_lo <= k0) & (k1 <= b_hi)
    cover = ((c_lo <= k0) & (k1 <= c_hi)) | ((b_lo <= k0) & (k1 <= b_hi)) | joined | ~real
    some = touch.any(1)
    full = cover.all(1) & some
    return some.to(torch.int8) + full.to(torch.int8)


def block_mask(iv, rows, keys, tile=TILE):
    """The flex `BlockMask` of the intervals: full tiles run without the mask, partial tiles
    evaluate it per pair, other tiles are skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    states = tile_states(iv, rows, keys, tile)
    c_lo, c_hi, b_lo, b_hi = iv

    def mask_mod(b, h, q, kv):
        return ((kv >= c_lo[q]) & (kv < c_hi[q])) | ((kv >= b_lo[q]) & (kv < b_hi[q]))

    def ordered(on):
        on = on.to(torch.int32)
        count = on.sum(-1, dtype=torch.int32)
        index = torch.argsort(on, dim=-1, descending=True, stable=True).to(torch.int32)
        return count[None, None], index[None, None]

    partial_n, partial_i = ordered(states == 1)
    full_n, full_i = ordered(states == 2)
    return BlockMask.from_kv_blocks(partial_n, partial_i, full_n, full_i,
                                    BLOCK_SIZE=(tile, tile), mask_mod=mask_mod,
                                    seq_lengths=(rows, keys))


def attended_pairs(iv):
    """(query, key) pairs the intervals let attend: the useful work of the attention."""
    return int(((iv[1] - iv[0]).clamp(min=0) + (iv[3] - iv[2]).clamp(min=0)).sum())


def dpace_weights(q, counted, block, alpha):
    """D-PACE's weights of rows of `block` positions (`q`: the drafter's probability of each
    position's label, `counted`: whether it counts), as `dflash_common::dflash::dpace_weights`
    computes them: per block, the smoothed (1 - alpha) * q + alpha of the counted positions (1
    elsewhere) make inclusive prefix products C_k, and a counted position weighs the sum of C_m
    over the counted m >= k; uncounted positions weigh 0. In f64, without gradient."""
    with torch.no_grad():
        q = q.detach().to(torch.float64).view(-1, block)
        on = counted.view(-1, block)
        smoothed = torch.where(on, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.cumprod(smoothed, dim=1) * on
        suffix = torch.flip(torch.cumsum(torch.flip(prefix, [1]), dim=1), [1])
        return (suffix * on).view(-1)


class LinearCE(torch.autograd.Function):
    """The weighted cross-entropy sum of `x @ head.T` against `targets`, by pieces of `rows`
    rows (whole blocks): each piece's logits exist once, in the compute dtype, with the softmax
    and the sum in f32; its gradient with respect to `x` is made in the same pass, so the
    backward is one multiply and no logits are recomputed or kept. With D-PACE (`alpha`), the
    weights are multiplied by D-PACE's of the piece's detached label probabilities.

    The gradient is scaled by `scale` in f32 before its one rounding to the compute dtype (the
    order autograd would scale in): the first output is `total * scale`, the one to call
    `backward` on; the second the total itself, detached.

    With `kernels` fusing the loss (`fused.Kernels.fused_ce`, `--drafter-compile`), a piece's
    cross-entropy and gradient come from two compiled kernels that read its logits once each
    (the same values up to float rounding); otherwise operation by operation.

    Returns (scaled total `[]`, total `[]` f32, greedy hits `[n]` bool, per-row cross-entropy
    `[n]` f32).
    """

    @staticmethod
    def forward(ctx, x, head, targets, weights, counted, block, rows, alpha, scale, kernels=None):
        n = x.shape[0]
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        dx = torch.empty_like(x)
        total = torch.zeros((), dtype=acc, device=x.device)
        hits = torch.empty(n, dtype=torch.bool, device=x.device)
        gold = torch.empty(n, dtype=acc, device=x.device)
        fused = kernels is not None and kernels.fused_ce
        for i in range(0, n, rows):
            j = min(i + rows, n)
            logits = x[i:j] @ head.t()
            t = targets[i:j]
            if fused:
                lse, ce, hit = kernels.ce_rows(logits, t, acc)
            else:
                log_p = torch.log_softmax(logits, dim=-1, dtype=acc)
                ce = -log_p.gather(1, t.unsqueeze(1)).squeeze(1)
                hit = logits.argmax(-1) == t
            w = weights[i:j]
            if alpha is not None:
                w = (dpace_weights(torch.exp(-ce), counted[i:j], block, alpha)
                     * w.to(torch.float64)).to(torch.float32)
            w = w.to(acc)
            total += (ce * w).sum()
            hits[i:j] = hit
            gold[i:j] = ce
            # d(sum w * ce) / d logits = w * (softmax - onehot).
            if fused:
                grad = kernels.ce_grad(logits, t, lse, w * scale, x.dtype)
            else:
                grad = log_p.exp_()
                grad.scatter_add_(1, t.unsqueeze(1), torch.full_like(ce, -1.0).unsqueeze(1))
                grad = grad.mul_((w * scale).unsqueeze(1)).to(x.dtype)
            dx[i:j] = grad @ head
        ctx.save_for_backward(dx)
        ctx.mark_non_differentiable(total, hits, gold)
        return total * scale, total, hits, gold

    @staticmethod
    def backward(ctx, grad_scaled, _total, _hits, _gold):
        (dx,) = ctx.saved_tensors
        return (dx * grad_scaled.to(dx.dtype), None, None, None, None, None, None, None, None,
                None)


def flex_available(device):
    """Flex attention runs compiled on a CUDA device; elsewhere the dense SDPA path runs."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_COMPILED_FLEX = None


def flex(q, k, v, mask, gqa, compile_it=True):
    """Flex attention `[1, heads, rows, d]` of the `BlockMask`, compiled once per process
    (eager when `compile_it` is off: correct, dense-speed; the CPU tests run it so)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if compile_it:
        if _COMPILED_FLEX is None:
            # Deterministic where this torch's Inductor can be (the same kernel configs in
            # every process, for exact replay after a restart), as before where it cannot.
            from .fused import deterministic_compile

            try:
                _COMPILED_FLEX = deterministic_compile(flex_attention)
            except RuntimeError:
                _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
        fn = _COMPILED_FLEX
    return fn(q, k, v, block_mask=mask, enable_gqa=gqa)


def sdpa(q, k, v, mask, gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
