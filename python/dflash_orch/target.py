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

import inspect
import os
import re
import sys

import torch

POISON_TOKEN_ENV = "DFLASH_WORKER_POISON_TOKEN"

PACKED_ATTENTION = "dflash_packed"


class _Unpackable(Exception):
    """The packed kernel cannot run a layer as it is asked (an option it lacks): the target goes
    back to rows by length, saying why."""


# Devices whose packed rows go through one variable-length kernel, and the dtypes it takes (the
# test of the kernel's wrapping widens both, with a reference kernel on the CPU).
VARLEN_DEVICES = {"cuda", "meta"}
VARLEN_DTYPES = {torch.float16, torch.bfloat16}


class _Layout:
    """The sequences of the packed row the current forward runs: `bounds` (start of each, then
    the end), on the host and on the device, and the longest. Set around one forward only."""

    bounds = None
    device_bounds = None
    longest = 0
    base = "sdpa"


def _sequence_mask(length, window, additive_dtype):
    """The causal (and sliding-window: keys less than `window` positions back, as
    `transformers` defines it) mask of one sequence, `[1, 1, s, s]`: boolean (True attends), or
    additive in `additive_dtype` (0 or the dtype's minimum) for the eager implementations."""
    q = torch.arange(length).unsqueeze(1)
    k = torch.arange(length).unsqueeze(0)
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    allowed = allowed.view(1, 1, length, length)
    if additive_dtype is None:
        return allowed
    zero = torch.zeros((), dtype=additive_dtype)
    return torch.where(allowed, zero, torch.finfo(additive_dtype).min)


def _base_function(module, base):
    """The attention function the model was loaded with: `transformers`' registered one, or the
    eager function of the module's own modeling file (what its eager path calls)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base != "eager" and base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    return sys.modules[type(module).__module__].eager_attention_forward


def _per_sequence(module, query, key, value, dropout, scaling, sliding_window, kwargs):
    """Each sequence of the row through the model's own attention, alone: the same kernels and
    masks as the sequence run as its own row (what the CPU runs; exact to rows by length)."""
    base = _Layout.base if _Layout.base in ("sdpa", "eager") else "eager"
    function = _base_function(module, base)
    bounds = _Layout.bounds
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        n = b - a
        if base == "sdpa" and (sliding_window is None or n <= sliding_window):
            mask = None  # the causal kernel, as transformers runs a single unmasked row
        else:
            mask = _sequence_mask(n, sliding_window,
                                  None if base == "sdpa" else query.dtype).to(query.device)
        out, _ = function(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], mask,
                          dropout=dropout, scaling=scaling, sliding_window=sliding_window,
                          **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1)


def _varlen_parameters():
    from torch.nn.attention import varlen

    return inspect.signature(varlen.varlen_attn).parameters


def _varlen(module, query, key, value, dropout, scaling, sliding_window, kwargs):
    """The whole row through PyTorch's variable-length flash attention
    (`torch.nn.attention.varlen`): each sequence causal within itself, no mask tensor. Attention
    sinks (gpt-oss) are applied from the kernel's log-sum-exp: a sink `s` of a head scales its
    output by `sigmoid(lse - s)`, which is the softmax with the sink's logit in the denominator."""
    try:
        from torch.nn.attention import varlen
    except ImportError as e:
        raise _Unpackable(f"torch {torch.__version__} has no torch.nn.attention.varlen") from e
    parameters = _varlen_parameters()
    if dropout:
        raise _Unpackable("attention dropout")
    if kwargs.get("softcap") is not None:
        raise _Unpackable("attention logit soft-capping")
    if query.dtype not in VARLEN_DTYPES:
        raise _Unpackable(f"flash attention needs bf16 or f16, the target runs {query.dtype}")
    # Queries and keys of one head dim, values of another (multi-head latent attention): the
    # kernel takes one, so the narrower side is padded with zeros (which add nothing to a score
    # nor to an output kept) and the output cut back to the values' dim.
    dim, value_dim = query.shape[-1], value.shape[-1]
    width = max(dim, value_dim)
    if width > 256:
        raise _Unpackable(f"head dim {width} is past flash attention's 256")
    options = {"scale": scaling if scaling is not None else dim ** -0.5}
    if "window_size" in parameters:
        options["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    elif sliding_window is None and "is_causal" in parameters:
        options["is_causal"] = True
    else:
        raise _Unpackable(f"torch {torch.__version__}'s varlen_attn has no sliding window")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:
        if "return_aux" not in parameters:
            raise _Unpackable("varlen_attn returns no log-sum-exp for attention sinks")
        options["return_aux"] = varlen.AuxRequest(lse=True)
    heads, kv_heads = query.shape[1], key.shape[1]
    q = query[0].transpose(0, 1)  # [tokens, heads, dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if kv_heads != heads:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    if dim < width:
        q = torch.nn.functional.pad(q, (0, width - dim))
        k = torch.nn.functional.pad(k, (0, width - dim))
    if value_dim < width:
        v = torch.nn.functional.pad(v, (0, width - value_dim))
    bounds = _Layout.device_bounds
    out = varlen.varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), bounds, bounds,
                             _Layout.longest, _Layout.longest, **options)
    if sinks is not None:
        out, lse = out
        tokens = q.shape[0]
        if tuple(lse.shape) == (heads, tokens):
            lse = lse.transpose(0, 1)
        elif tuple(lse.shape) != (tokens, heads):
            raise _Unpackable(f"varlen_attn's log-sum-exp is {tuple(lse.shape)}")
        scale = torch.sigmoid(lse.float() - sinks.float().view(1, heads))
        out = (out.float() * scale.unsqueeze(-1)).to(out.dtype)
    if value_dim < width:
        out = out[..., :value_dim]
    return out.unsqueeze(0)  # [1, tokens, heads, dim], as transformers' functions answer


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, **kwargs):
    """The attention of a packed row (`[1, heads, tokens, dim]`, sequences back to back, each
    from position 0): no sequence sees another. On a GPU (and `meta`, where the accounting
    counts it) one variable-length flash kernel; elsewhere each sequence through the model's own
    attention."""
    if _Layout.bounds is None:
        raise RuntimeError("the packed attention ran outside a packed forward")
    if query.device.type in VARLEN_DEVICES:
        out = _varlen(module, query, key, value, dropout, scaling, sliding_window, kwargs)
    else:
        out = _per_sequence(module, query, key, value, dropout, scaling, sliding_window, kwargs)
    return out, None


# Layer types (`config.layer_types`) whose token mixing is attention the packed kernel reproduces.
PACKABLE_LAYER_TYPES = {"full_attention", "sliding_attention"}

# Modules that mix tokens outside the attention function (state-space and linear-attention
# mixers, recurrences, short convolutions): run over a packed row, a sequence's state would
# carry into the next one.
_SEQUENCE_MIXER = re.compile(
    r"Mamba|SSM|Ssm[A-Z]|DeltaNet|LinearAtt|Lightning|Recurrent|RgLru|RGLRU|ShortConv|Rwkv|RWKV|"
    r"Retention|Hyena|LSTM|Lstm")


def state_carrying(model):
    """Why `model` carries a state from token to token outside its attention's keys and values,
    or None: a layer type other than (sliding or chunked) attention, or a module that mixes
    tokens otherwise (state-space, linear attention, short convolutions). Such a state is not
    cut by a mask (a packed row) nor cropped with a KV cache (a rejected draft)."""
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or []
    other = sorted({str(t) for t in types} - PACKABLE_LAYER_TYPES - {"chunked_attention"})
    if other:
        return f"layer types {', '.join(other)} are not attention"
    try:  # the decoder's layers: a vision or audio tower's convolutions mix no text tokens
        _, layers = decoder_stack(model)
        modules = [(f"layers.{i}.{name}".rstrip("."), module) for i, layer in enumerate(layers)
                   for name, module in layer.named_modules()]
    except ValueError:
        modules = list(model.named_modules())
    for name, module in modules:
        kind = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or _SEQUENCE_MIXER.search(kind):
            return f"{name} ({kind}) mixes tokens outside attention"
    return None


def packing_refusal(model):
    """Why a packed row cannot stand for rows of one length on `model`, or None: a state carried
    from token to token ([`state_carrying`]), or attention the packed kernel does not
    reproduce (chunked)."""
    carried = state_carrying(model)
    if carried is not None:
        return carried
    text = model.config.get_text_config()
    if "chunked_attention" in (getattr(text, "layer_types", None) or []) or getattr(
            text, "attention_chunk_size", None):
        return "chunked attention"
    return None


def decoder_stack(model):
    """The module that runs the decoder layers (what `forward` is called on) and the layers,
    `[num_hidden_layers]`: `get_decoder().layers`, else the one module list of that length."""
    count = int(model.config.get_text_config().num_hidden_layers)
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == count:
        return decoder, list(layers)
    found = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == count:
                found.append((name, child_name, module, child))
    if len(found) != 1:
        where = ", ".join(f"{a}.{b}" if a else b for a, b, _, _ in found) or "none"
        raise ValueError(f"{type(model).__name__}: cannot tell its {count} decoder layers "
                         f"(module lists of that length: {where})")
    _, _, parent, child = found[0]
    return parent, list(child)


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

    def __init__(self, model_dir, indices, dtype, device, feature_dtype=None, model=None,
                 packing="off"):
        """The target of `model_dir` (or the loaded `model`, for the accounting benchmark).
        `packing`: `on` runs each micro-batch as packed rows (sequences back to back, positions
        restarting, [`packed_attention`]), `off` as rows of one length, `auto` packs on a GPU,
        `padded` as right-padded rows of sequences of near lengths (what a refused packing runs
        instead: [`_padded_into`])."""
        if packing not in ("on", "off", "auto", "padded"):
            raise ValueError(f"target packing {packing!r} (expected on, off, auto or padded)")
        self.device = device
        self.dtype = dtype
        self.feature_dtype = feature_dtype or dtype
        self.model = model if model is not None else load_causal_lm(model_dir, dtype, device)
        self.decoder, self.layers = decoder_stack(self.model)
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
        # Index L (after the final norm) is the decoder's own output; the others are hooked.
        for i in sorted(set(self.indices) - {self.num_layers}):
            self.layers[i - 1].register_forward_hook(self._hook(i, stop=(i == last)))
        poison = os.environ.get(POISON_TOKEN_ENV, "").strip()
        self.poison = int(poison) if poison.isdigit() else None
        self.packed = packing == "on" or (packing == "auto" and device.type == "cuda")
        self.padded = packing == "padded"
        self.packing = ("packed, " + ("one variable-length kernel" if device.type in VARLEN_DEVICES
                                      else "each sequence's own attention")
                        if self.packed else "padded rows" if self.padded else "rows of one length")
        if self.packed:
            from transformers import AttentionInterface

            AttentionInterface.register(PACKED_ATTENTION, packed_attention)
            refusal = packing_refusal(self.model)
            if refusal is None and device.type != "meta":
                refusal = self._packing_disagrees()
            if refusal is not None:
                self._unpack(refusal)

    def _unpack(self, reason):
        """Padded rows from now on, saying why packing was refused."""
        self.packed = False
        self.padded = True
        self.packing = f"padded rows (packing refused: {reason})"
        print(f"dflash_orch: the target runs padded rows, not packed ones: {reason}",
              file=sys.stderr, flush=True)

    # Largest relative difference, per token, between a packed row and rows of one length that
    # still counts as the same features: rounding (half precision: two attention kernels, in
    # another order) against a sequence that sees another, which changes its features outright.
    PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
    PROBE_HALF_TOLERANCE = 5e-2

    @torch.inference_mode()
    def _packing_disagrees(self):
        """Runs two short sequences packed and as rows of one length: why packing would change
        the features (what a structural check cannot see: a sequence's state carried into the
        next), or None when they agree."""
        lengths = [13, 9]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (sum(lengths),), generator=gen).to(self.device)
        try:
            packed = self._packed_row(ids, lengths).float()
        except _Unpackable as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 (rows of one length are the reference path)
            return f"the packed forward failed: {type(e).__name__}: {str(e)[:200]}"
        rows = torch.cat([self._rows(ids[a:a + n].unsqueeze(0))[0]
                          for a, n in zip((0, lengths[0]), lengths)]).float()
        n = len(self.indices)
        packed = packed.view(-1, n, self.hidden)
        rows = rows.view(-1, n, self.hidden)
        norm = rows.norm(dim=2).clamp_min(torch.finfo(torch.float32).tiny)
        worst = ((packed - rows).norm(dim=2) / norm).nan_to_num(nan=float("inf"))
        tol = self.PROBE_TOLERANCE.get(self.dtype, self.PROBE_HALF_TOLERANCE)
        value = float(worst.max())
        if value <= tol:
            return None
        token, layer = divmod(int(worst.argmax()), n)
        return (f"a packed row differs from rows of one length by {value:.3g} (relative, more "
                f"than {tol:g}) at token {token} of two sequences, layer id "
                f"{self.indices[layer] - 1}: sequences would see each other")

    def _configs(self):
        seen = {}
        for module in self.model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                seen[id(config)] = config
        return list(seen.values())

    def _hook(self, index, stop):
        def hook(_module, _inputs, output):
            self._captured[index] = _tensor_of(output)
            if stop:
                raise _Stop()

        return hook

    def _forward(self, ids, positions):
        """Hidden states `[rows, len, n * hidden]` of `ids` at `positions` (both `[rows, len]`),
        up to the last layer needed."""
        self._captured = {}
        try:
            out = self.decoder(input_ids=ids, position_ids=positions, use_cache=False)
            last = getattr(out, "last_hidden_state", None)
            self._captured[self.num_layers] = last if last is not None else _tensor_of(out)
        except _Stop:
            pass
        states = [self._captured[i] for i in self.indices]
        self._captured = {}
        return torch.cat(states, dim=-1)

    def _rows(self, ids):
        """Hidden states `[rows, len, n * hidden]` of rows of equal length, from position 0."""
        rows, length = ids.shape
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand(rows, length)
        return self._forward(ids, positions)

    def _packed_row(self, ids, lengths):
        """Hidden states `[tokens, n * hidden]` of the sequences of `lengths` packed back to
        back in `ids` (`[tokens]`), each from position 0, none seeing another."""
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        configs = self._configs()
        base = [c._attn_implementation for c in configs]
        _Layout.bounds = bounds
        _Layout.device_bounds = torch.tensor(bounds, dtype=torch.int32).to(self.device)
        _Layout.longest = max(lengths)
        _Layout.base = self.attention
        for c in configs:
            c._attn_implementation = PACKED_ATTENTION
        try:
            return self._forward(ids.unsqueeze(0), positions.unsqueeze(0))[0]
        finally:
            for c, name in zip(configs, base):
                c._attn_implementation = name
            _Layout.bounds = _Layout.device_bounds = None

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
        budget = max(token_budget or n, 1)
        finite = torch.ones(len(self.indices), dtype=torch.bool, device=self.device)
        if self.packed:
            try:
                return self._packed_into(all_ids, starts, lengths, out, budget, finite)
            except _Unpackable as e:
                self._unpack(str(e))
                finite.fill_(True)
        if self.padded:
            return self._padded_into(all_ids, starts, lengths, out, budget, finite)
        # Rows of one length together, at most a budget's worth of tokens at a time.
        by_length = {}
        for s, length in enumerate(lengths):
            if length > 0:
                by_length.setdefault(length, []).append(s)
        for length, seqs in sorted(by_length.items()):
            per = max(budget // length, 1)
            for k in range(0, len(seqs), per):
                group = seqs[k:k + per]
                ids = torch.stack([all_ids[starts[s]:starts[s] + length] for s in group])
                ids = ids.to(self.device)
                values = self._checked(self._rows(ids), ids, finite)
                # Into the ring: page-locked on a GPU (see serve.pin_mapping), so the copies
                # run without staging and queue behind the forward; `tolist` below waits for
                # them before the worker is answered.
                for r, s in enumerate(group):
                    out[starts[s]:starts[s] + length].copy_(values[r], non_blocking=True)
        return self._first_nonfinite(finite)

    def _padded_into(self, all_ids, starts, lengths, out, budget, finite):
        """[`features_into`] by right-padded rows: the sequences shortest first, as many a row
        group as fit the budget at the group's longest length, each padded at its end to that
        length and run from position 0 with no mask. A causal model's token sees only the tokens
        before it, so the padding after a sequence changes none of its features, whatever its
        layers carry from token to token (what packing cannot promise); the padding's own are
        dropped."""
        order = sorted((s for s, n in enumerate(lengths) if n > 0), key=lambda s: lengths[s])
        groups, group = [], []
        for s in order:
            if group and (len(group) + 1) * lengths[s] > budget:
                groups.append(group)
                group = []
            group.append(s)
        if group:
            groups.append(group)
        for group in groups:
            longest = lengths[group[-1]]
            ids = torch.zeros((len(group), longest), dtype=torch.long)
            for r, s in enumerate(group):
                ids[r, :lengths[s]] = all_ids[starts[s]:starts[s] + lengths[s]]
            ids = ids.to(self.device)
            rows = self._rows(ids)
            real = torch.cat([rows[r, :lengths[s]] for r, s in enumerate(group)])
            real_ids = torch.cat([ids[r, :lengths[s]] for r, s in enumerate(group)])
            values = self._checked(real, real_ids, finite)
            at = 0
            for s in group:
                n = lengths[s]
                out[starts[s]:starts[s] + n].copy_(values[at:at + n], non_blocking=True)
                at += n
        return self._first_nonfinite(finite)

    def _checked(self, values, ids, finite):
        """`values` (the features of the tokens `ids`, any leading shape) in the feature dtype,
        with `finite` (one flag per layer) cleared for each layer holding a NaN or an infinity;
        the poison token (a test's) makes its first feature NaN."""
        values = values.to(self.feature_dtype)
        if self.poison is not None:
            hit = ids == self.poison
            if bool(hit.any()):
                values[..., 0] = torch.where(hit, torch.nan, values[..., 0])
        finite &= torch.isfinite(
            values.reshape(-1, len(self.indices), self.hidden)).all(dim=2).all(dim=0)
        return values

    @staticmethod
    def _first_nonfinite(finite):
        flags = finite.tolist()
        return next((j for j, ok in enumerate(flags) if not ok), None)

    def _packed_into(self, all_ids, starts, lengths, out, budget, finite):
        """[`features_into`] by packed rows: consecutive sequences, at most `budget` tokens a
        row (a longer sequence alone), each row one forward and one copy into the ring."""
        chunks, chunk, size = [], [], 0
        for s, length in enumerate(lengths):
            if length == 0:
                continue
            if chunk and size + length > budget:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(s)
            size += length
        if chunk:
            chunks.append(chunk)
        for chunk in chunks:
            a = starts[chunk[0]]
            b = starts[chunk[-1]] + lengths[chunk[-1]]
            ids = all_ids[a:b].to(self.device)
            values = self._checked(self._packed_row(ids, [lengths[s] for s in chunk]), ids,
                                   finite)
            out[a:b].copy_(values, non_blocking=True)
        return self._first_nonfinite(finite)
