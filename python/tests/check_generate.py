"""The torch engine's batched `generate` against each prompt decoded alone.

    python tests/check_generate.py [--arch qwen3,llama,qwen3_moe,gemma3_text,gpt_oss]

For each architecture a tiny random model is made from a config (no download; Gemma 3 and
gpt-oss with sliding windows shorter than the prompts) and saved; `Decoder.sample_batch`, the
path of `dflash-orch generate --engine torch`, decodes prompts of uneven lengths together
(left-padded, masked, positions per prompt). Checks:

- greedy: every token the batch chose is the argmax, within `--tol` of the largest logit, of
  the model run alone on that prompt and the tokens before it (no padding, no batch);
- a stop token ends its row (kept as its last token), the other rows go on;
- sampled: a row's tokens are the same in the batch and decoded alone from the same generator;
- power: the same batch decoded with the padding attended (its mask dropped) is not greedy for
  the padded rows, so the check can fail.

Prints one JSON line per architecture; exits 0 when every check holds (f32).
"""

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dflash_orch.decode import Decoder  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_target  # noqa: E402

COMMON = dict(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=512)
LENGTHS = [7, 1, 19, 12, 3]
NEW = 14


class MaskDropped:
    """The model with every padded position attended: what a decode that forgot the mask runs."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
        return self.model(**kwargs)


def worst_margin(model, prompt, output):
    """The largest gap between the top logit and the chosen token's, over the decode of `output`
    after `prompt`, the model run alone on the whole row (teacher-forced)."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()
    chosen = logits.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
    return (logits.max(-1).values - chosen).max().item()


def check(arch, tol, work):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = make_target.config_for(arch, COMMON, window=6, original_max=64)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = os.path.join(work, arch)
    model.save_pretrained(path)
    decoder = Decoder(path, "f32")
    alone = decoder.model
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist()
               for n in LENGTHS]

    greedy = decoder.sample_batch(prompts, NEW, set(), 0.0, [None] * len(prompts))
    lengths_ok = [len(o) for o in greedy] == [NEW] * len(prompts)
    margin = max(worst_margin(alone, p, o) for p, o in zip(prompts, greedy))

    # A stop token: the row that meets it ends there, keeping it.
    stop_token = greedy[2][4]
    stopped = decoder.sample_batch(prompts, NEW, {stop_token}, 0.0, [None] * len(prompts))
    stop_ok = all(
        s == (o[:o.index(stop_token) + 1] if stop_token in o else o)
        for s, o in zip(stopped, greedy))

    # Sampled: each row from its own generator, as alone.
    def generators(rows):
        return [torch.Generator().manual_seed(1000 + r) for r in rows]

    rows = list(range(len(prompts)))
    sampled = decoder.sample_batch(prompts, NEW, set(), 1.0, generators(rows))
    sampled_alone = [decoder.sample_batch([prompts[r]], NEW, set(), 1.0, generators([r]))[0]
                     for r in rows]
    sampled_ok = sampled == sampled_alone

    # Power: padding attended.
    decoder.model = MaskDropped(alone)
    unmasked = decoder.sample_batch(prompts, NEW, set(), 0.0, [None] * len(prompts))
    decoder.model = alone
    longest = max(LENGTHS)
    unmasked_margin = max(worst_margin(alone, p, o) for p, o in zip(prompts, unmasked)
                          if len(p) < longest)

    ok = lengths_ok and margin <= tol and stop_ok and sampled_ok and unmasked_margin > 100 * tol
    return ok, {"arch": arch, "ok": ok, "worst_greedy_margin": margin, "tol": tol,
                "stop_ok": stop_ok, "sampled_equal_alone": sampled_ok,
                "mask_dropped_margin": unmasked_margin,
                "attention": alone.config._attn_implementation}


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
            print(json.dumps(row), flush=True)
            failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
