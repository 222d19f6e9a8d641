"""The frozen target on PyTorch: any causal LM that `transformers` loads.

Features are the target's hidden states `hidden_states[k + 1]` for each layer id `k` of the run
(index `L`, the last, is after the final norm, as in `transformers`' own `output_hidden_states`),
concatenated per token, in the batch's sample order: `[tokens, n * hidden]`. It is the layout the
candle target writes, so that the engines mix.

Sequences never see each other: each runs as its own row from position 0 (rows of one length go
through together, so no padding and no attention mask is built), through SDPA with its causal
kernel; no `[s, s]` mask exists. The hidden states are taken by forward hooks on the decoder layers
(and the final norm, for index `L`), and the forward stops after the last layer needed, so memory
is the model's activations for one group of rows plus the features themselves: linear in tokens.
"""

import os
import sys

import torch

POISON_TOKEN_ENV = "DFLASH_WORKER_POISON_TOKEN"


class _Stop(Exception):
    """Raised by the hook of the last layer needed: the rest of the forward is not run."""


def _tensor_of(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def dtype_of(name):
    try:
        return {"f32": torch.float32, "bf16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a dtype (expected f32 or bf16)") from None


def device_for(visible):
    """The device the orchestrator gave: the GPU of CUDA_VISIBLE_DEVICES when it names one (never
    the CPU instead), else the CPU."""
    if visible is None or not visible.strip():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"this worker was given GPU {visible.strip()}, but torch {torch.__version__} sees no "
            "CUDA device (a CPU-only torch, or no driver): install a CUDA build of torch, or run "
            "on CPU workers with --gpus cpu:N"
        )
    return torch.device("cuda", 0)


def num_layers(model_dir):
    """Decoder layers of the model in `model_dir`, from its config (text config of a multimodal
    one)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).get_text_config().num_hidden_layers)


def attention_choices(device):
    """Attention implementations to try, best first: SDPA (fused kernels, causal without a mask
    tensor), then flex attention on a GPU (what architectures with attention sinks, gpt-oss, run
    there), then eager, which materialises `[s, s]` scores and is only a last resort."""
    return ["sdpa"] + (["flex_attention"] if device.type == "cuda" else []) + ["eager"]


def load_causal_lm(model_dir, dtype, device):
    """`AutoModelForCausalLM` in eval mode without gradients, with the first attention of
    [`attention_choices`] the architecture supports (`model.config._attn_implementation` says
    which)."""
    from transformers import AutoModelForCausalLM

    refusals = []
    for attention in attention_choices(device):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation=attention
            )
            break
        except ValueError as e:
            # transformers refuses an implementation an architecture lacks with a ValueError.
            if "attention" not in str(e).lower() and "attn" not in str(e).lower():
                raise
            refusals.append(f"{attention}: {str(e).splitlines()[0][:160]}")
    else:
        raise ValueError(f"{model_dir}: no attention implementation loads: {'; '.join(refusals)}")
    if attention == "eager":
        print(f"dflash_orch: {model_dir} runs with eager attention ({'; '.join(refusals)}): "
              "its scores take [s, s] memory per head", file=sys.stderr, flush=True)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


class TorchTarget:
    """The frozen target: hidden states of `indices` (hidden-state indices, layer id + 1) for a
    batch of sequences."""

    def __init__(self, model_dir, indices, dtype, device, feature_dtype=None, model=None):
        """The target of `model_dir` (or the loaded `model`, for the accounting benchmark)."""
        self.device = device
        self.dtype = dtype
        self.feature_dtype = feature_dtype or dtype
        self.model = model if model is not None else load_causal_lm(model_dir, dtype, device)
        decoder = self.model.get_decoder()
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        config = self.model.config
        self.vocab_size = int(config.get_text_config().vocab_size)
        self.num_layers = len(self.layers)
        self.attention = getattr(config, "_attn_implementation", None) or "unknown"
        if not indices:
            raise ValueError("no target layers to take features from")
        for i in indices:
            if not 1 <= i <= self.num_layers:
                raise ValueError(
                    f"target layer id {i - 1} is past the target's {self.num_layers} layers "
                    f"(ids 0 to {self.num_layers - 1})"
                )
        self.indices = list(indices)
        self.hidden = int(config.get_text_config().hidden_size)
        self._captured = {}
        last = max(self.indices)
        for i in sorted(set(self.indices)):
            module = self.norm if i == self.num_layers else self.layers[i - 1]
            module.register_forward_hook(self._hook(i, stop=(i == last and i < self.num_layers)))
        poison = os.environ.get(POISON_TOKEN_ENV, "").strip()
        self.poison = int(poison) if poison.isdigit() else None

    def _hook(self, index, stop):
        def hook(_module, _inputs, output):
            self._captured[index] = _tensor_of(output)
            if stop:
                raise _Stop()

        return hook

    def _rows(self, ids):
        """Hidden states `[rows, len, n * hidden]` of rows of equal length, from position 0."""
        rows, length = ids.shape
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand(rows, length)
        self._captured = {}
        try:
            self.model.get_decoder()(input_ids=ids, position_ids=positions, use_cache=False)
        except _Stop:
            pass
        states = [self._captured[i] for i in self.indices]
        self._captured = {}
        return torch.cat(states, dim=-1)

    @torch.inference_mode()
    def features_into(self, tokens, lengths, out, token_budget=None):
        """Writes the features of the sequences (`tokens` back to back, `lengths` each) into
        `out`, a `[sum(lengths), n * hidden]` tensor of the feature dtype (the mapped slot).
        Returns the position in `indices` of the first layer whose features hold a NaN or an
        infinity, or None."""
        n = len(tokens)
        if sum(lengths) != n:
            raise ValueError(f"lengths add up to {sum(lengths)}, the batch has {n} tokens")
        if out.shape != (n, len(self.indices) * self.hidden):
            raise ValueError(f"the output is {tuple(out.shape)}, the features are "
                             f"{(n, len(self.indices) * self.hidden)}")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the target's vocabulary ({self.vocab_size})")
        all_ids = torch.tensor(tokens, dtype=torch.long)
        starts = []
        at = 0
        for length in lengths:
            starts.append(at)
            at += length
        # Rows of one length together, at most a budget's worth of tokens at a time.
        by_length = {}
        for s, length in enumerate(lengths):
            if length > 0:
                by_length.setdefault(length, []).append(s)
        budget = max(token_budget or n, 1)
        finite = torch.ones(len(self.indices), dtype=torch.bool, device=self.device)
        for length, seqs in sorted(by_length.items()):
            per = max(budget // length, 1)
            for k in range(0, len(seqs), per):
                group = seqs[k:k + per]
                ids = torch.stack([all_ids[starts[s]:starts[s] + length] for s in group])
                ids = ids.to(self.device)
                values = self._rows(ids).to(self.feature_dtype)
                if self.poison is not None:
                    hit = ids == self.poison
                    if bool(hit.any()):
                        values[..., 0] = torch.where(hit, torch.nan, values[..., 0])
                finite &= torch.isfinite(
                    values.view(len(group), length, len(self.indices), self.hidden)
                ).all(dim=3).all(dim=1).all(dim=0)
                # Into the ring: page-locked on a GPU (see serve.pin_mapping), so the copies
                # run without staging and queue behind the forward; `tolist` below waits for
                # them before the worker is answered.
                for r, s in enumerate(group):
                    out[starts[s]:starts[s] + length].copy_(values[r], non_blocking=True)
        flags = finite.tolist()
        return next((j for j, ok in enumerate(flags) if not ok), None)
