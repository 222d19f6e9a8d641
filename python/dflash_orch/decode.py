"""Decoding on the torch engine, for `dflash-orch eval` and `dflash-orch generate`:
`python -m dflash_orch.decode eval|generate`, started by `dflash-worker` in place of its candle
decoder, with the same request on stdin and the same answers on stdout.

- eval: one request line (`EvalRequest`); prints one `PromptResult` line per prompt. Greedy (or,
  with `sampling`, sampled and verified by rejection sampling, see `Decoder.generate`)
  speculative decoding with the `transformers` target (its KV cache) and our torch drafter, as
  the candle decoder runs it: the drafter fills `[last token, MASK x (B - 1)]` in one pass, seeing
  the target's hidden states at `target_layer_ids` of every position before the block; one target
  pass verifies the block; the longest prefix of drafted tokens equal to the target's own greedy
  choices is accepted, plus the target's next token. With `baseline`, plain greedy decoding too.
- generate: one request line (`GenerateRequest`), then one job line (`GenerateJob`) per batch of
  prompts, each answered by a `GenerateDone` line. A batch's prompts are decoded together, one
  forward per step (`Decoder.sample_batch`). Greedy, or sampling at a temperature, each row
  from a generator seeded by (seed, row): a row's draws do not depend on its batch. (Its logits
  can differ from a decode alone in the last bits, as batched kernels round; a batch is the same
  rows whenever it is decoded, a resumed one included. The engines' random streams differ:
  sampled data from the two engines is not the same tokens.)

Whatever fails ends this process with exit 1, its reason the last line of stderr (`error: TYPE:
MESSAGE`), which the worker quotes in its error.
"""

import copy
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


class Sampling:
    """`eval --temperature`: the distribution a row of logits gives, as the official package
    defines it: scores = logits / T in f32; over the `top_k` largest only (0, or the whole
    vocabulary: all); softmax; then the tokens in falling order while the mass before each is
    below `top_p`, renormalised."""

    def __init__(self, spec):
        self.temperature = float(spec["temperature"])
        self.top_p = float(spec["top_p"])
        self.top_k = int(spec["top_k"])
        self.seed = int(spec["seed"])
        if not 0 < self.temperature <= 100 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"sampling {spec}: temperature must be in (0, 100], top_p in (0, 1], "
                             f"top_k 0 or more")

    def stream(self, index):
        """The seed of prompt `index`'s draws (`dflash_common::eval::Sampling::stream`)."""
        return (self.seed * 0x9E3779B97F4A7C15 + index) % 2**63

    def probs(self, logits):
        scores = logits.float() / self.temperature
        vocab = scores.shape[-1]
        kept = None
        if 0 < self.top_k < vocab:
            scores, kept = torch.topk(scores, self.top_k, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            ranked, order = probs.sort(dim=-1, descending=True)
            ranked = ranked * ((ranked.cumsum(dim=-1) - ranked) < self.top_p)
            probs = torch.zeros_like(probs).scatter(-1, order, ranked)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if kept is not None:
            probs = torch.zeros(logits.shape, dtype=probs.dtype,
                                device=probs.device).scatter(-1, kept, probs)
        return probs


def verify_drafts(proposal, target, generator):
    """Rejection sampling of one block: `proposal` is (drafted tokens `[g]`, their distributions
    `[g, V]`, or `[g, K]` over candidate ids `[g, K]`, those ids or None), or None when nothing
    was drafted; `target` the target's distributions `[g + 1, V]`. Each drafted token `x` is kept
    while a uniform u has u·q(x) < p(x); at the first rejection the next token is drawn from
    max(p − q, 0) renormalised (p itself where that is all zero), else from the last row. Returns
    (tokens accepted, the next token)."""
    if proposal is None:
        return 0, int(torch.multinomial(target[-1:], 1, generator=generator)[0, 0])
    drafted, q, indices = proposal
    g = drafted.shape[0]
    p = target[:g].gather(-1, drafted[:, None])[:, 0]
    if indices is None:
        qx = q.gather(-1, drafted[:, None])[:, 0]
    else:
        qx = (q * (indices == drafted[:, None])).sum(-1)
    u = torch.rand(qx.shape, dtype=qx.dtype, device=qx.device, generator=generator)
    accepted = int((u * qx < p).to(torch.int32).cumprod(-1).sum())
    if accepted == g:
        return g, int(torch.multinomial(target[-1:], 1, generator=generator)[0, 0])
    residual = target[accepted].clone()
    if indices is None:
        residual.sub_(q[accepted])
    else:
        residual.scatter_add_(0, indices[accepted], -q[accepted])
    residual.clamp_min_(0)
    total = residual.sum()
    if total > 0:
        residual = residual / total
    else:
        residual = target[accepted]
    return accepted, int(torch.multinomial(residual[None], 1, generator=generator)[0, 0])


class Decoder:
    """The target with its KV cache, and optionally the drafter."""

    def __init__(self, target_dir, precision, drafter=None, block_size=None):
        from .target import device_for, dtype_of, load_causal_lm, state_carrying

        self.device = device_for(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.model = load_causal_lm(target_dir, dtype_of(precision), self.device)
        self.layers = int(self.model.config.get_text_config().num_hidden_layers)
        self.drafter = drafter
        self.block = block_size or (drafter.block if drafter else 1)
        # A state carried from token to token (linear attention, state-space layers) cannot be
        # cropped back past a rejected draft: such a target's cache is copied before each
        # verify step and, when a draft is rejected, put back and run on the kept tokens.
        self.carried = state_carrying(self.model)

    def _cache(self):
        """A KV cache for one decode: full-length layers that crop exactly (sliding windows are
        the attention mask's, from positions), or, for a target that carries a state, the
        layer kinds of its config (its linear attention's states), never cropped."""
        from transformers import DynamicCache

        if self.carried is None:
            return DynamicCache()
        try:
            return DynamicCache(config=self.model.config)
        except TypeError as e:
            raise RuntimeError(f"this transformers' cache takes no config, and the target "
                               f"carries a state ({self.carried})") from e

    @staticmethod
    def _crop_to(cache, length):
        """Keeps the first `length` positions of `cache`: a crop by the count to remove (a
        negative one), which every transformers since the cache API takes, where 5.18 drops the
        positive one (a length to keep)."""
        cache.crop(-max(cache.get_seq_length() - length, 0))

    def _run(self, tokens, cache, start, features):
        """Runs `tokens` at positions `start..` after what `cache` holds: the logits after each
        `[n, vocab]`, and the drafter's features `[n, width]` when asked."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache,
                         use_cache=True, output_hidden_states=features)
        next_ids = out.logits[0]
        feats = None
        if features:
            feats = torch.cat([out.hidden_states[k + 1][0] for k in self.drafter.target_layer_ids],
                              dim=-1)
        return next_ids, feats, out.past_key_values

    @torch.inference_mode()
    def generate(self, prompt, max_new_tokens, stop, speculative, sampling=None, generator=None):
        """Decoding of `prompt`, greedy, or with `sampling` (a `Sampling`) drawing from
        `generator` (drafts verified by rejection sampling): (new tokens, tokens gained per verify
        step, seconds after the prefill). The draws are made in the official package's order
        (the prefill's token; per step the draft, then the acceptance uniforms and one more
        token), so the same seed gives its tokens."""
        if not prompt:
            raise ValueError("an empty prompt")
        n = len(prompt)
        max_length = n + max_new_tokens
        draft = self.drafter if speculative else None
        block = self.block if draft else 1
        mask = draft.mask_token if draft else 0
        cache = self._cache()
        logits, feats, cache = self._run(prompt, cache, 0, draft is not None)
        if sampling is None:
            first = int(logits[-1].float().argmax())
        else:
            first = int(torch.multinomial(sampling.probs(logits[-1:]), 1, generator=generator)[0, 0])
        out = list(prompt) + [first]
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
            proposal = None
            if verify > 1 and draft is not None:
                if sampling is None:
                    tokens += draft.draft(context, out[start], start, verify)[:verify - 1]
                else:
                    drafted, q, indices = draft.draft_sampled(context, out[start], start, verify,
                                                              sampling, generator)
                    tokens += drafted.tolist()
                    proposal = (drafted, q, indices)
            tokens += [mask] * (verify - len(tokens))
            saved = copy.deepcopy(cache) if self.carried is not None and verify > 1 else None
            logits, feats, cache = self._run(tokens, cache, start, verify > 1 and draft is not None)
            if sampling is None:
                posterior = logits.float().argmax(-1).tolist()
                accepted = 0
                while accepted < verify - 1 and tokens[1 + accepted] == posterior[accepted]:
                    accepted += 1
                nxt = posterior[accepted]
            else:
                accepted, nxt = verify_drafts(proposal, sampling.probs(logits), generator)
            gained = tokens[1:1 + accepted] + [nxt]
            gained = gained[:max_length - start - 1]
            for i, t in enumerate(gained):
                if t in stop:
                    gained = gained[:i + 1]
                    stopped = True
                    break
            produced = len(gained)
            out = out[:start + 1] + gained
            # Keep the verified positions only: the block's first `produced` tokens.
            if self.carried is None:
                self._crop_to(cache, start + produced)
            elif produced < len(tokens):
                cache = saved
                _, _, cache = self._run(tokens[:produced], cache, start, False)
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
    def sample_batch(self, prompts, max_new_tokens, stop, temperature, generators):
        """Plain decoding of `prompts` together, one forward per step for the whole batch: the
        prompts left-padded to the longest (masked out, positions counted from each prompt's
        first token), each row greedy or at `temperature` drawing from its own generator, so a
        row's draws do not depend on the other rows. A row ends after `max_new_tokens` tokens or
        its first token of `stop` (kept); the batch steps on while any row runs (a row that has
        ended feeds padding that nothing reads)."""
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("an empty prompt")
        rows = len(prompts)
        outputs = [[] for _ in prompts]
        if max_new_tokens <= 0:
            return outputs
        longest = max(len(p) for p in prompts)
        ids = torch.zeros((rows, longest), dtype=torch.long)
        mask = torch.zeros((rows, longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, longest - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        running = [True] * rows
        cache = self._cache()
        while any(running):
            res = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            logits = res.logits[:, -1].float()
            if temperature <= 0:
                chosen = logits.argmax(-1).tolist()
            else:
                probs = torch.softmax(logits / temperature, dim=-1).cpu()
                chosen = [int(torch.multinomial(probs[i], 1, generator=generators[i]))
                          if running[i] else 0 for i in range(rows)]
            for i in range(rows):
                if not running[i]:
                    continue
                token = int(chosen[i])
                outputs[i].append(token)
                if token in stop or len(outputs[i]) >= max_new_tokens:
                    running[i] = False
            ids = torch.tensor([[int(t)] for t in chosen], dtype=torch.long, device=self.device)
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            positions = positions[:, -1:] + 1
        return outputs


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
    sampling = Sampling(req["sampling"]) if req.get("sampling") else None
    max_new = int(req["max_new_tokens"])
    for i, prompt in enumerate(req["prompts"]):
        spec_rng = base_rng = None
        if sampling is not None:
            # Prompt i's own streams (the baseline's apart): the same seed, the same tokens.
            spec_rng = torch.Generator(device=decoder.device).manual_seed(sampling.stream(i))
            base_rng = torch.Generator(device=decoder.device).manual_seed(
                sampling.stream(i) ^ (2**63 - 1))
        ids, acceptance, seconds = decoder.generate(prompt, max_new, stop, True, sampling, spec_rng)
        result = {"prompt": i, "output_ids": ids, "acceptance": acceptance,
                  "speculative_seconds": seconds, "baseline_ids": None, "baseline_seconds": None}
        if req.get("baseline"):
            base, _, base_s = decoder.generate(prompt, max_new, stop, False, sampling, base_rng)
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
        rows = [int(row) for row, _ in job["prompts"]]
        generators = [torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + row) % 2**63)
                      for row in rows]
        outputs = decoder.sample_batch([prompt for _, prompt in job["prompts"]],
                                       int(req["max_new_tokens"]), stop, temperature, generators)
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
