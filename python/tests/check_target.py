"""The torch target's features against `transformers`' own hidden states.

    python tests/check_target.py [--tol 1e-5] [--arch qwen3,llama,qwen3_moe,gemma3_text,gpt_oss]

For each architecture a tiny random model is made from a config (no download) and saved; the
engine's `TorchTarget` loads it like any model directory and fills a packed batch of uneven
lengths; the reference is `output_hidden_states=True` of each sequence run alone, entry `k + 1`
for layer id `k` (the last entry after the final norm). Also checks that the comparison can fail:
the same tokens run as one row (sequences attending across each other) differ from the reference.
Prints one JSON line per architecture; exits 0 when every difference is within --tol (f32).
"""

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dflash_orch.target import TorchTarget  # noqa: E402

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


def check(arch, tol, work):
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
    layers = model.config.num_hidden_layers
    indices = [1, 3, layers]  # layer ids 0, 2 and the last (after the final norm)
    target = TorchTarget(path, indices, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    lengths = [17, 5, 40, 17, 1, 23]
    tokens = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=gen).tolist()
    out = torch.zeros(sum(lengths), len(indices) * target.hidden)
    nonfinite = target.features_into(tokens, lengths, out, token_budget=48)
    ref = reference(target.model, tokens, lengths, indices)
    diff = (out - ref).abs().max().item()
    # The comparison's power: one row of all sequences lets later ones attend to earlier ones.
    crossed = target.model.get_decoder()(input_ids=torch.tensor([tokens]),
                                         output_hidden_states=True).hidden_states
    crossed = torch.cat([crossed[i][0] for i in indices], dim=-1)
    cross_diff = (crossed[lengths[0]:] - ref[lengths[0]:]).abs().max().item()
    ok = diff <= tol and nonfinite is None and cross_diff > 100 * tol
    return ok, {"arch": arch, "max_abs_diff": diff, "tol": tol, "attention": target.attention,
                "cross_sequence_diff": cross_diff, "nonfinite": nonfinite,
                "scale": ref.abs().max().item()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--arch", default="qwen3,llama,qwen3_moe,gemma3_text,gpt_oss")
    args = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    failed = False
    with tempfile.TemporaryDirectory() as work:
        for arch in args.arch.split(","):
            ok, row = check(arch, args.tol, work)
            row["ok"] = ok
            print(json.dumps(row), flush=True)
            failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
