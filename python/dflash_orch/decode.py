"""Decoding on the torch engine, for `dflash-orch eval` and `dflash-orch generate`:
`python -m dflash_orch.decode eval|generate`, started by `dflash-worker` in place of its candle
decoder, with the same request on stdin and the same answers on stdout.

- eval: one request line (`EvalRequest`); prints one `PromptResult` line per prompt. Greedy
  speculative decoding with the `transformers` target (its KV cache) and our torch drafter, as
  the candle decoder runs it: the drafter fills `[last token, MASK x (B - 1)]` in one pass, seeing
  the target's hidden states at `target_layer_ids` of every position before the block; one target
  pass verifies the block; the longest prefix of drafted tokens equal to the target's own greedy
  choices is accepted, plus the target's next token. With `baseline`, plain greedy decoding too.
- generate: one request line (`GenerateRequest`), then one job line (`GenerateJob`) per batch of
  prompts, each answered by a `GenerateDone` line. Greedy, or sampling at a temperature, each row
  from a generator seeded by (seed, row): a row's output does not depend on its batch. (The
  engines' random streams differ: sampled data from the two engines is not the same tokens.)

Whatever fails ends this process with exit 1, its reason the last line of stderr (`error: TYPE:
MESSAGE`), which the worker quotes in its error.
"""

import json
import os
import sys
import time
import traceback

import torch

EVAL_VERSION = 1


def _read_request(stream):
    line = stream.readline()
    if not line.strip():
        raise SystemExit("dflash_orch.decode: no request on stdin")
    req = json.loads(line)
    if req.get("version") != EVAL_VERSION:
        raise SystemExit(f"dflash_orch.decode: request version {req.get('version')}, this package "
                         f"speaks {EVAL_VERSION}")
    return req


def _dtype_name(precision):
    return {"f32": "f32", "bf16": "bf16"}[precision]


class Decoder:
    """The target with its KV cache, and optionally the drafter."""

    def __init__(self, target_dir, precision, drafter=None, block_size=None):
        from .target import device_for, dtype_of, load_causal_lm

        self.device = device_for(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.model = load_causal_lm(target_dir, dtype_of(precision), self.device)
        self.layers = int(self.model.config.get_text_config().num_hidden_layers)
        self.drafter = drafter
        self.block = block_size or (drafter.block if drafter else 1)

    def _run(self, tokens, cache, start, features):
        """Runs `tokens` at positions `start..` after what `cache` holds: the greedy next token
        after each, and the drafter's features `[n, width]` when asked."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache,
                         use_cache=True, output_hidden_states=features)
        next_ids = out.logits[0].float().argmax(-1).tolist()
        feats = None
        if features:
            feats = torch.cat([out.hidden_states[k + 1][0] for k in self.drafter.target_layer_ids],
                              dim=-1)
        return next_ids, feats, out.past_key_values

    @torch.inference_mode()
    def generate(self, prompt, max_new_tokens, stop, speculative):
        """Greedy decoding of `prompt`: (new tokens, tokens gained per verify step, seconds after
        the prefill)."""
        from transformers import DynamicCache

        if not prompt:
            raise ValueError("an empty prompt")
        n = len(prompt)
        max_length = n + max_new_tokens
        draft = self.drafter if speculative else None
        block = self.block if draft else 1
        mask = draft.mask_token if draft else 0
        cache = DynamicCache()
        next_ids, feats, cache = self._run(prompt, cache, 0, draft is not None)
        out = list(prompt) + [next_ids[-1]]
        if max_new_tokens == 0:
            out = out[:n]
        context = None
        if draft is not None:
            context = self._context(feats, 0)
        started = time.perf_counter()
        acceptance = []
        start = n
        stopped = len(out) > n and out[n] in stop
        while start + 1 < max_length and not stopped:
            verify = min(block, max_length - start)
            tokens = [out[start]]
            if verify > 1 and draft is not None:
                tokens += draft.draft(context, out[start], start, verify)[:verify - 1]
            tokens += [mask] * (verify - len(tokens))
            posterior, feats, cache = self._run(tokens, cache, start, verify > 1 and draft is not None)
            accepted = 0
            while accepted < verify - 1 and tokens[1 + accepted] == posterior[accepted]:
                accepted += 1
            gained = tokens[1:1 + accepted] + [posterior[accepted]]
            gained = gained[:max_length - start - 1]
            for i, t in enumerate(gained):
                if t in stop:
                    gained = gained[:i + 1]
                    stopped = True
                    break
            produced = len(gained)
            out = out[:start + 1] + gained
            # Keep the verified positions only: the block's first `produced` tokens.
            cache.crop(start + produced)
            if draft is not None and feats is not None:
                more = self._context(feats[:produced], start)
                context = [(torch.cat([k, k2]), torch.cat([v, v2]))
                           for (k, v), (k2, v2) in zip(context, more)]
            start += produced
            acceptance.append(produced)
        out = out[:min(start + 1, max_length)]
        return out[n:], acceptance, time.perf_counter() - started

    def _context(self, feats, offset):
        positions = torch.arange(offset, offset + feats.shape[0], device=self.device)
        return self.drafter.context(feats, positions)

    @torch.inference_mode()
    def sample(self, prompt, max_new_tokens, stop, temperature, generator):
        """Plain decoding of `prompt`, greedy or at `temperature` drawing from `generator`."""
        from transformers import DynamicCache

        cache = DynamicCache()
        out = []
        tokens, start = list(prompt), 0
        while len(out) < max_new_tokens:
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            positions = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
            res = self.model(input_ids=ids, position_ids=positions, past_key_values=cache,
                             use_cache=True)
            cache = res.past_key_values
            logits = res.logits[0, -1].float()
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1).cpu()
                token = int(torch.multinomial(probs, 1, generator=generator))
            out.append(token)
            if token in stop:
                break
            start += len(tokens)
            tokens = [token]
        return out


def run_eval(stream, answers):
    from .drafter import TorchDrafter

    req = _read_request(stream)
    precision = _dtype_name(req["dtype"])
    drafter = TorchDrafter.from_checkpoint(req["drafter"], req["target_model"], precision)
    decoder = Decoder(req["target_model"], precision, drafter, int(req["block_size"]))
    if decoder.layers <= max(drafter.target_layer_ids):
        raise SystemExit(f"{req['drafter']}: target_layer_ids {drafter.target_layer_ids} names a "
                         f"layer beyond the target's {decoder.layers}")
    stop = set(req["stop_token_ids"])
    for i, prompt in enumerate(req["prompts"]):
        ids, acceptance, seconds = decoder.generate(prompt, int(req["max_new_tokens"]), stop, True)
        result = {"prompt": i, "output_ids": ids, "acceptance": acceptance,
                  "speculative_seconds": seconds, "baseline_ids": None, "baseline_seconds": None}
        if req.get("baseline"):
            base, _, base_s = decoder.generate(prompt, int(req["max_new_tokens"]), stop, False)
            result["baseline_ids"], result["baseline_seconds"] = base, base_s
        answers.write(json.dumps(result) + "\n")
        answers.flush()


def run_generate(stream, answers):
    req = _read_request(stream)
    decoder = Decoder(req["target_model"], _dtype_name(req["dtype"]))
    stop = set(req["stop_token_ids"])
    temperature = float(req["temperature"])
    seed = int(req["seed"])
    for line in stream:
        if not line.strip():
            continue
        job = json.loads(line)
        outputs = []
        for row, prompt in job["prompts"]:
            generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + int(row)) % 2**63)
            outputs.append(decoder.sample(prompt, int(req["max_new_tokens"]), stop, temperature,
                                          generator))
        answers.write(json.dumps({"batch": job["batch"], "outputs": outputs}) + "\n")
        answers.flush()


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in ("eval", "generate"):
        raise SystemExit("usage: python -m dflash_orch.decode eval|generate (request on stdin)")
    # Answers go to the real stdout; a library's print goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    try:
        (run_eval if sys.argv[1] == "eval" else run_generate)(sys.stdin, answers)
    except (ValueError, OSError, KeyError) as e:
        # A bad input (a checkpoint, a request): the reason alone, the last line of the log,
        # which the worker's error quotes.
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # the library's own errors (torch, safetensors) come in many types
        traceback.print_exc(file=sys.stderr)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
