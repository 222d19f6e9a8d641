"""The torch target's features against `transformers`' own hidden states.

    python tests/check_target.py [--tol 1e-5] [--arch qwen3,llama,qwen3_moe,gemma3_text,gpt_oss,...]
                                 [--packing off,on,varlen,padded] [--no-probe]

For each architecture a tiny random model is made from a config (no download) and saved; the
engine's `TorchTarget` loads it like any model directory and fills a batch of uneven lengths
(back to back in the ring's layout), once for each `--packing`: `off` runs rows of one length,
`on` packed rows (positions restarting per sequence, each sequence's attention its own), with
a budget that splits the batch over several rows, and `varlen` the packed rows as a GPU runs them,
through one variable-length kernel per layer, here a reference kernel that follows
`torch.nn.attention.varlen`'s documented contract (the GPU check runs the real one), and `padded`
right-padded rows of near lengths without a mask (what a refused packing runs). The reference is `output_hidden_states=True`
of each sequence run alone, entry `k + 1` for layer id `k` (the last entry after the final norm).
Also checks that the comparison can fail: the same tokens run as one row (sequences attending
across each other) differ from the reference. Qwen3.5's gated delta-net layers carry a state from
token to token, so its packing is refused (padded rows); gpt-neox names its layers' final
norm otherwise; DeepSeek-V3's latent attention has values narrower than its queries (padded for
the kernel). Last, the packing probe (`check_probe`): with the structural refusal switched off,
the target's own packed-against-rows probe refuses Qwen3.5, and without the probe its packed
features would differ. Prints one JSON line per architecture and packing;
exits 0 when every difference is within --tol (f32).
"""

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dflash_orch.target as target_module  # noqa: E402
import torch.nn.attention.varlen as varlen_module  # noqa: E402
from dflash_orch.target import TorchTarget  # noqa: E402

real_varlen = varlen_module.varlen_attn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_target  # noqa: E402

COMMON = dict(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=512)


def config_for(arch):
    return make_target.config_for(arch, COMMON, window=8, original_max=64)


def reference(model, tokens, lengths, indices):
    out, at = [], 0
    for n in lengths:
        ids = torch.tensor([tokens[at:at + n]])
        with torch.no_grad():
            hs = model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
        out.append(torch.cat([hs[i][0] for i in indices], dim=-1))
        at += n
    return torch.cat(out)


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False):
    """`torch.nn.attention.varlen.varlen_attn` as its documentation states it, on any device:
    `[tokens, heads, dim]` inputs, keys within `window_size` (left, right; -1 unbounded) of each
    query in its own sequence, the log-sum-exp `[heads, tokens]` when asked. Stands in for the
    GPU kernel so that the engine's wrapping of it (layout, windows, GQA, sinks) is checked here."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], "one head dim, as flash takes"
    heads = query.shape[1]
    if key.shape[1] != heads:
        assert enable_gqa
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    left, right = window_size
    out, lse = torch.empty_like(query), torch.empty(heads, query.shape[0], dtype=torch.float32)
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds, bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1).float() for t in (query, key, value))
        scores = q @ k.transpose(1, 2) * scale
        i = torch.arange(b - a).unsqueeze(1)
        j = torch.arange(b - a).unsqueeze(0)
        allowed = torch.ones(b - a, b - a, dtype=torch.bool)
        if right >= 0:
            allowed &= j <= i + right
        if left >= 0:
            allowed &= j >= i - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse[:, a:b] = torch.logsumexp(scores, dim=-1)
        out[a:b] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(out.dtype)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def make(arch, work):
    """The tiny random `arch`, saved under `work`: its directory and config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_for(arch), dtype=torch.float32)
    # Norm weights off 1, so that one applied in the wrong place shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = os.path.join(work, arch)
    model.save_pretrained(path)
    return path, model.config


LENGTHS = [17, 5, 40, 9, 1, 23]


def features(target, vocab):
    """The target's features of a batch of `LENGTHS` (a budget that splits it over rows): the
    tokens and the features."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (sum(LENGTHS),), generator=gen).tolist()
    out = torch.zeros(sum(LENGTHS), len(target.indices) * target.hidden)
    nonfinite = target.features_into(tokens, LENGTHS, out, token_budget=48)
    assert nonfinite is None, nonfinite
    return tokens, out


def check(arch, packing, tol, work):
    path, config = make(arch, work)
    layers = config.num_hidden_layers
    indices = [1, 3, layers]  # layer ids 0, 2 and the last (after the final norm)
    varlen = packing == "varlen"
    if varlen:  # the GPU's kernel path, through the reference kernel above
        target_module.VARLEN_DEVICES.add("cpu")
        target_module.VARLEN_DTYPES.add(torch.float32)
        varlen_module.varlen_attn = reference_varlen
    try:
        target = TorchTarget(path, indices, torch.float32, torch.device("cpu"),
                             packing="on" if varlen else packing)
        tokens, out = features(target, config.vocab_size)
    finally:
        target_module.VARLEN_DEVICES.discard("cpu")
        target_module.VARLEN_DTYPES.discard(torch.float32)
        varlen_module.varlen_attn = real_varlen
    ref = reference(target.model, tokens, LENGTHS, indices)
    diff = (out - ref).abs().max().item()
    # The comparison's power: one row of all sequences lets later ones attend to earlier ones.
    crossed = target.model(input_ids=torch.tensor([tokens]),
                           output_hidden_states=True).hidden_states
    crossed = torch.cat([crossed[i][0] for i in indices], dim=-1)
    cross_diff = (crossed[LENGTHS[0]:] - ref[LENGTHS[0]:]).abs().max().item()
    ok = diff <= tol and cross_diff > 100 * tol
    return ok, {"arch": arch, "packing": target.packing, "max_abs_diff": diff, "tol": tol,
                "attention": target.attention, "cross_sequence_diff": cross_diff,
                "scale": ref.abs().max().item()}


def check_probe(tol, work):
    """Packing on a model whose structure gives no reason to refuse it, though a sequence's
    state carries into the next (the gated delta-net layers of Qwen3.5 with the structural check
    switched off): the target's own probe refuses it and the features equal the reference; with
    the probe switched off too, packed features differ, so the probe is what kept them right."""
    path, config = make("qwen3_5_text", work)
    indices = [1, 3, config.num_hidden_layers]
    refusal = target_module.packing_refusal
    probe = TorchTarget._packing_disagrees
    target_module.packing_refusal = lambda model: None
    try:
        target = TorchTarget(path, indices, torch.float32, torch.device("cpu"), packing="on")
        tokens, out = features(target, config.vocab_size)
        TorchTarget._packing_disagrees = lambda self: None
        blind = TorchTarget(path, indices, torch.float32, torch.device("cpu"), packing="on")
        _, leaked = features(blind, config.vocab_size)
    finally:
        target_module.packing_refusal = refusal
        TorchTarget._packing_disagrees = probe
    ref = reference(target.model, tokens, LENGTHS, indices)
    diff = (out - ref).abs().max().item()
    leak = (leaked - ref).abs().max().item()
    ok = (diff <= tol and leak > 100 * tol and not target.packed and blind.packed
          and "differs from rows of one length" in target.packing)
    return ok, {"arch": "qwen3_5_text", "check": "probe", "packing": target.packing,
                "max_abs_diff": diff, "tol": tol, "unprobed_diff": leak,
                "unprobed_packing": blind.packing}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--arch",
                   default="qwen3,llama,qwen3_moe,gemma3_text,gpt_oss,qwen3_5_text,gpt_neox,"
                           "deepseek_v3")
    p.add_argument("--packing", default="off,on,varlen,padded")
    p.add_argument("--no-probe", action="store_true", help="skip the packing probe's check")
    args = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    failed = False
    with tempfile.TemporaryDirectory() as work:
        for arch in args.arch.split(","):
            for packing in args.packing.split(","):
                ok, row = check(arch, packing, args.tol, work)
                row["ok"] = ok
                print(json.dumps(row), flush=True)
                failed |= not ok
        if not args.no_probe:
            ok, row = check_probe(args.tol, work)
            row["ok"] = ok
            print(json.dumps(row), flush=True)
            failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
