"""The torch engine's batched `generate` against each prompt decoded alone.

    python tests/check_generate.py [--arch qwen3,llama,qwen3_moe,gemma3_text,gpt_oss,qwen3_5_text,...]

For each architecture a tiny random model is made from a config (no download; Gemma 3 and
gpt-oss with sliding windows shorter than the prompts) and saved; `Decoder.sample_batch`, the
path of `dflash-orch generate --engine torch`, decodes prompts of uneven lengths together
(left-padded, masked, positions per prompt). Checks:

- greedy: every token the batch chose is the argmax, within `--tol` of the largest logit, of
  the model run alone on that prompt and the tokens before it (no padding, no batch);
- a stop token ends its row (kept as its last token), the other rows go on;
- sampled: a row's tokens are the same in the batch and decoded alone from the same generator;
- power: the same batch decoded with the padding attended (its mask dropped) is not greedy for
  the padded rows, so the check can fail;
- speculative: `Decoder.generate` (the path of `dflash-orch eval`), greedy, with drafts that are
  accepted whole, in part and not at all, gives the greedy tokens. Qwen3.5's gated delta-net
  layers carry a state a KV cache's crop does not take back: its cache is copied before each
  verify step and put back after a rejection; power: decoded with the crop alone (the official
  package's way), its tokens are not greedy.

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
        self.config = model.config

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


class Proposer:
    """A drafter that proposes the target's own greedy continuation `truth` (prompt and output),
    with the proposals at some positions wrong: verify steps accept all, some or none of a
    block, so the target's cache is rolled back by every amount."""

    target_layer_ids = [0]
    mask_token = 0

    def __init__(self, truth, vocab, block):
        self.truth, self.vocab, self.block = truth, vocab, block

    def context(self, feats, positions):
        return [(positions.unsqueeze(1).float(), positions.unsqueeze(1).float())]

    def draft(self, context, token, start, verify):
        out = []
        for pos in range(start + 1, start + verify):
            t = self.truth[pos] if pos < len(self.truth) else 0
            out.append((t + 1) % self.vocab if pos % 7 in (0, 3) else t)
        return out


def check_speculative(decoder, prompts, truths):
    """Greedy speculative decoding (`Decoder.generate`, the path of `dflash-orch eval`) with
    [`Proposer`] drafts of the greedy `truths`, and the baseline's plain decoding: the worst
    margin of their tokens against the target's greedy ones, and the acceptance lengths seen
    (blocks accepted whole, in part and not at all)."""
    alone = decoder.model
    margin, seen = 0.0, set()
    for prompt, truth in zip(prompts, truths):
        decoder.drafter = Proposer(truth, COMMON["vocab_size"], 4)
        decoder.block = 4
        try:
            out, acceptance, _ = decoder.generate(prompt, NEW, set(), True)
        finally:
            decoder.drafter, decoder.block = None, 1
        margin = max(margin, worst_margin(alone, prompt, out))
        seen.update(acceptance)
        # The baseline `eval` decodes beside: one token per step, nothing to take back.
        out, _, _ = decoder.generate(prompt, NEW, set(), False)
        margin = max(margin, worst_margin(alone, prompt, out))
    return margin, sorted(seen)


def cropped_margin(decoder, prompts, truths):
    """[`check_speculative`]'s margin with the cache the official package decodes with (the
    config's layer kinds, recording its past, cropped after each verify step) and no copy: what
    a crop alone takes back of a carried state. A refusal is a string."""
    from transformers import DynamicCache

    def recording():
        cache = DynamicCache(config=decoder.model.config)
        cache.activate_past_recording()
        return cache

    carried, decoder.carried, decoder._cache = decoder.carried, None, recording
    try:
        return check_speculative(decoder, prompts, truths)[0]
    except (RuntimeError, ValueError) as e:
        return f"refused: {str(e)[:120]}"
    finally:
        decoder.carried = carried
        del decoder._cache


def check(arch, tol, work):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = make_target.config_for(arch, COMMON, window=6, original_max=64)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a carried state that weighs on the logits (the crop's power)
        for name, p in model.named_parameters():
            if "linear_attn" in name and p.dim() >= 2:
                p.normal_(0.0, 0.2)
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

    truths = [p + o for p, o in zip(prompts, greedy)]
    spec_margin, accepted = check_speculative(decoder, prompts, truths)
    row = {"arch": arch, "worst_greedy_margin": margin, "tol": tol, "stop_ok": stop_ok,
           "sampled_equal_alone": sampled_ok, "mask_dropped_margin": unmasked_margin,
           "speculative_margin": spec_margin, "accepted_lengths": accepted,
           "carried_state": decoder.carried, "attention": alone.config._attn_implementation}
    ok = (lengths_ok and margin <= tol and stop_ok and sampled_ok and unmasked_margin > 100 * tol
          and spec_margin <= tol and accepted == [1, 2, 3, 4])
    if decoder.carried is not None:
        # Power: a crop alone does not take a carried state back.
        row["cropped_margin"] = cropped_margin(decoder, prompts, truths)
        ok = ok and not (isinstance(row["cropped_margin"], float)
                         and row["cropped_margin"] <= 100 * tol)
    row["ok"] = ok
    return ok, row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--arch",
                   default="qwen3,llama,qwen3_moe,gemma3_text,gpt_oss,qwen3_5_text,deepseek_v3")
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
