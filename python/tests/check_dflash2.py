"""The torch engine's DFlash2 drafter against the official package's `DFlash2DraftModel`.

    python tests/check_dflash2.py [--tol 1e-5] [--seeds 3]

For each case (full attention; every layer sliding with a window shorter than the block and the
context) and each seed, a tiny `DFlash2DraftModel` gets random weights (every tensor, the
convolutions' and the selector's included) and our `TorchDrafter` gets the same ones, by name
as the checkpoints store them. Both draft blocks after a random context:
- one block at a time, as decoding does: the final hidden states, the head's logits, and the
  selector's greedy path and top-K candidates (the official `propose`);
- all the blocks of several anchors in one call, as training computes them under its block mask,
  against the official model run once per anchor.
Differences are the largest absolute one over the reference's largest magnitude (at least 1).
Also checks that the comparison can fail: with the convolutions' dynamic kernels left out, or
(in the sliding case) with full attention, the hidden states differ. Prints one JSON line per
case and seed; exits 0 when all hold (f32).
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dflash_orch.drafter import SELECTOR, TorchDrafter  # noqa: E402

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, HEAD_DIM = 211, 48, 96, 2, 4, 2, 12
BLOCK, STATES, TARGET_LAYERS = 8, 2, 3
D2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 16, "selector_top_k": 6}


def official_model(window, seed):
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    fields = dict(block_size=BLOCK, mask_token_id=VOCAB - 1, target_layer_ids=[0, 1], **D2)
    extra = {}
    if window is not None:
        extra = dict(layer_types=["sliding_attention"] * LAYERS, use_sliding_window=True,
                     sliding_window=window, max_window_layers=LAYERS, is_causal=False)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=512, num_target_layers=TARGET_LAYERS,
        dflash_config=fields, tie_word_embeddings=False, **extra)
    config._attn_implementation = "sdpa"
    model = DFlash2DraftModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    if window is not None:
        assert model.layers[0].self_attn.sliding_window == window
        assert model.layers[0].self_attn.is_causal is False
    return model


def ours(model, window, embedding, lm_head):
    names = {}
    for name, p in model.named_parameters():
        if name.startswith(SELECTOR) and name.endswith("_codebook.weight"):
            name = name[: -len(".weight")]
        names[name] = p.detach().clone()
    drafter = TorchDrafter({
        "dtype": "f32", "feature_dtype": "f32", "model": None,
        "shape": {"hidden": HIDDEN, "intermediate": INTER, "layers": LAYERS, "heads": HEADS,
                  "kv_heads": KV, "head_dim": HEAD_DIM, "rms_eps": 1e-6, "rope_theta": 10000.0,
                  "vocab": VOCAB},
        "block_size": BLOCK, "mask_token_id": VOCAB - 1, "states": STATES, "weight_decay": 0.0,
        "dflash2": D2, "sliding_window": window,
    }, heads=(embedding, lm_head))
    missing = sorted(set(drafter.names) ^ set(names))
    assert not missing, f"the names differ: {missing}"
    drafter.check_shapes(names)
    drafter.P = {n: names[n] for n in drafter.names}
    return drafter


def official_block(model, features, embedding, head, start, token):
    """The official decoding step's draft of the block at `start` (its anchor `token`)."""
    ids = torch.full((1, BLOCK), VOCAB - 1, dtype=torch.long)
    ids[0, 0] = token
    with torch.no_grad():
        hidden = model(target_hidden=features[None, :start], noise_embedding=F.embedding(ids, embedding),
                       position_ids=torch.arange(start + BLOCK)[None])[0]
        path, candidates, _ = model.propose(hidden[None, 1:], ids[:, 0], head, 0.0)
        logits = model.compute_logits(hidden[1:], head)
    return hidden, logits, path[0], candidates[0]


def relative(ours, theirs):
    """The largest difference, relative to the reference's largest magnitude (at least 1)."""
    return float((ours - theirs).abs().max() / max(1.0, float(theirs.abs().max())))


def check(window, seed, tol):
    torch.manual_seed(1000 + seed)
    model = official_model(window, seed)
    embedding = 0.5 * torch.randn(VOCAB, HIDDEN)
    lm_head = 0.5 * torch.randn(VOCAB, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(lm_head)
    drafter = ours(model, window, embedding, lm_head)
    length = 24
    features = torch.randn(length, STATES * HIDDEN)
    tokens = torch.randint(0, VOCAB - 1, (length,)).tolist()
    with torch.no_grad():
        context = drafter.context(features, torch.arange(length))
    worst = {"hidden": 0.0, "logits": 0.0, "batched": 0.0}
    paths_equal, candidates_equal = True, True
    anchors = [3, 9, 16]
    batched = None
    with torch.no_grad():
        batched = drafter.block_states(context, [tokens[a] for a in anchors], anchors)
    for i, start in enumerate(anchors):
        hidden, logits, path, candidates = official_block(
            model, features, embedding, head, start, tokens[start])
        with torch.no_grad():
            mine = drafter.block_states(context, [tokens[start]], [start])
            my_logits = F.linear(mine[1:], lm_head)
            my_path, my_candidates, _ = drafter.select(mine[1:], my_logits, tokens[start])
        rows = batched[i * BLOCK:(i + 1) * BLOCK]
        for key, a, b in (("hidden", mine, hidden), ("logits", my_logits, logits),
                          ("batched", rows, hidden)):
            worst[key] = max(worst[key], relative(a, b))
        paths_equal &= my_path.tolist() == path.tolist()
        candidates_equal &= (my_candidates.sort(-1).values.tolist()
                             == candidates.sort(-1).values.tolist())
        # The drafted tokens decoding uses are the same path.
        assert drafter.draft(context, tokens[start], start, BLOCK) == path.tolist()
    # The check can fail: without the dynamic kernels the states move.
    saved = {n: t for n, t in drafter.P.items() if n.endswith("kernel_projection.weight")}
    for n in saved:
        drafter.P[n] = torch.zeros_like(saved[n])
    with torch.no_grad():
        plain = drafter.block_states(context, [tokens[anchors[0]]], [anchors[0]])
    drafter.P.update(saved)
    hidden, *_ = official_block(model, features, embedding, head, anchors[0], tokens[anchors[0]])
    sensitive = relative(plain, hidden)
    if window is not None:
        # And the window matters: full attention differs.
        drafter.window = None
        with torch.no_grad():
            full = drafter.block_states(context, [tokens[anchors[-1]]], [anchors[-1]])
        drafter.window = window
        hidden, *_ = official_block(model, features, embedding, head, anchors[-1],
                                    tokens[anchors[-1]])
        sensitive = min(sensitive, relative(full, hidden))
    ok = (max(worst.values()) <= tol and paths_equal and candidates_equal and sensitive > 1e-3)
    return {"window": window, "seed": seed, "ok": ok, **{f"max_rel_diff_{k}": v for k, v in
            worst.items()}, "paths_equal": paths_equal, "candidates_equal": candidates_equal,
            "perturbed_diff": sensitive}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tol", type=float, default=1e-5)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    ok = True
    for window in (None, 3):
        for seed in range(args.seeds):
            row = check(window, seed, args.tol)
            print(json.dumps(row), flush=True)
            ok &= row["ok"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
