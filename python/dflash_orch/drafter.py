"""The DFlash drafter on PyTorch: the same model, loss and optimiser as the candle drafter
(worker/src/model/drafter.rs and worker/src/train.rs), so that the two engines train the same
weights from the same batches.

What the worker decides and sends (one owner, in Rust): the drafter's shape and weight names, the
initial weights (drawn from the run's seed) or a checkpoint's, every micro-batch's anchors, the
learning rate of every step. This side computes: the context (`fc`, `hidden_norm`, the layers'
keys and values of every token), the blocks of each anchor chunk against it, the loss, the
gradients and AdamW.

The block mask without per-anchor copies: the queries of a chunk's blocks (`anchors x block`
positions) attend, in one SDPA call, to the keys of the sequence's context before the chunk's
last anchor followed by the chunk's own block keys, under a boolean mask (context position < the
block's anchor; block key in the same block). Scores exist for one chunk at a time (and not at all
where SDPA's fused kernels take a mask), and so do the chunk's logits: memory is linear in the
micro-batch's tokens with `--anchor-chunk`; a chunk's full-vocabulary logits exist for 4,096
block positions at a time (pieces past that are checkpointed and recomputed in backward). Each
chunk is back-propagated into a detached copy of the context, whose summed gradient goes through
the context once at the end, as in candle. The target's embedding and `lm_head` are plain
tensors: no gradient, no backward work for them.
"""

import json
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import blocks, fused
from .blocks import dpace_weights  # noqa: F401 - the drafter's D-PACE, imported from here too
from .target import device_for, dtype_of

# Block positions of the loss computed at once: 4,096 x a 151,936-token vocabulary is 2.5 GB of
# f32 logits. `DFLASH_LOSS_ROWS` overrides it (tests make it small to exercise the pieces).
DEFAULT_LOSS_ROWS = 4096
LOSS_ROWS_ENV = "DFLASH_LOSS_ROWS"
# The step's code path: `batched` (the default: every anchor of a micro-batch in one pass, one
# host sync, the linear cross-entropy, foreach/fused AdamW) or `legacy` (per sequence and anchor
# chunk), kept selectable while the accounting benchmark compares them.
PATH_ENV = "DFLASH_DRAFTER_PATH"
PATHS = ("batched", "legacy")
# `0` runs flex attention eagerly on a GPU instead of compiled (a debugging aid: dense speed).
COMPILE_ENV = "DFLASH_COMPILE"


def step_path():
    """The step path `DFLASH_DRAFTER_PATH` names (default `batched`); another value is refused."""
    value = os.environ.get(PATH_ENV, "").strip() or "batched"
    if value not in PATHS:
        raise ValueError(f"{PATH_ENV}={value!r}: expected one of {', '.join(PATHS)}")
    return value


def compile_flag():
    value = os.environ.get(COMPILE_ENV, "").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{COMPILE_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def rope_tables(positions, head_dim, theta):
    """cos and sin `[..., head_dim]` for positions of any shape, as the candle drafter computes
    them (inverse frequencies in f64, rounded to f32; angles in f32)."""
    inv = torch.tensor(
        [1.0 / theta ** (2.0 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64
    ).to(torch.float32).to(positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def block_weights(loss_mask, anchors, block, gamma):
    """Per block position, its loss weight: position k of the block at `anchor` counts when
    k >= 1 and `anchor + k` is inside the sequence with its loss mask set, weighted
    exp(-(k - 1) / gamma) (1 without gamma). Rounded to f32, as the candle drafter keeps them."""
    decay = [1.0 if gamma is None else math.exp(-(k - 1.0) / gamma) for k in range(block)]
    n = len(loss_mask)
    out = []
    for anchor in anchors:
        for k in range(block):
            t = anchor + k
            out.append(decay[k] if k >= 1 and t < n and loss_mask[t] != 0 else 0.0)
    return torch.tensor(out, dtype=torch.float32)


def param_names(layers, dflash2=False):
    """The drafter's weight names in the candle drafter's order (`DrafterConfig::tensors`),
    DFlash2's own after them (`dflash2_tensors`)."""
    names = ["fc.weight", "hidden_norm.weight"]
    for i in range(layers):
        names += [f"layers.{i}.{n}" for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight")]
    names.append("norm.weight")
    if dflash2:
        for i in range(layers):
            for conv in ("attention_conv", "mlp_conv"):
                names += [f"layers.{i}.{conv}.base_kernel",
                          f"layers.{i}.{conv}.kernel_projection.weight"]
        names += [SELECTOR + "hidden_projection.weight", SELECTOR + "predecessor_codebook",
                  SELECTOR + "successor_codebook"]
    return names


SELECTOR = "candidate_selector."


def backward_context(context, leaves):
    """Through the context once: the chunks' summed gradients of its keys and values (`leaves`,
    the detached copies each chunk back-propagated into)."""
    tensors, grads = [], []
    for (k, v), (lk, lv) in zip(context, leaves):
        for t, leaf in ((k, lk), (v, lv)):
            if leaf.grad is not None:
                tensors.append(t)
                grads.append(leaf.grad)
    if tensors:
        torch.autograd.backward(tensors, grads)


def grouped_conv(x, dynamic, base, group):
    """DFlash2's grouped dynamic causal convolution of blocks `x` `[a, b, hidden]` along their
    `b` positions, each block starting from zeros: output position t sums, over the taps j,
    `(base[j] + dynamic[t, j, g]) * x[t - j]` (`dynamic`: `[a, b, taps, groups]`, one value per
    channel group of `group` channels; `base`: `[taps, hidden]`)."""
    a, b, h = x.shape
    taps = base.shape[0]
    groups = h // group
    xs = x.view(a, b, groups, group)
    out = torch.zeros_like(xs)
    for j in range(min(taps, b)):
        shifted = xs if j == 0 else F.pad(xs[:, :-j], (0, 0, 0, 0, j, 0))
        out = out + base[j].view(1, 1, groups, group).to(x.dtype) * shifted
        out = torch.addcmul(out, dynamic[:, :, j].unsqueeze(-1), shifted)
    return out.view(a, b, h)


def tied_embeddings(model_dir):
    """Whether the target's config ties its output head to its embedding: `tie_word_embeddings`
    as `config.json` states it (at the top or in `text_config`); where it states neither, as
    `transformers` reads it (the architecture's default), which is the only reason a drafter
    process would import `transformers` (seconds of start-up each time)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict):
        stated = [raw.get("tie_word_embeddings")]
        if isinstance(raw.get("text_config"), dict):
            stated.append(raw["text_config"].get("tie_word_embeddings"))
        if all(isinstance(v, bool) for v in stated):
            return any(stated)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return bool(getattr(config, "tie_word_embeddings", False)) or bool(
        getattr(config.get_text_config(), "tie_word_embeddings", False))


def load_heads(model_dir, dtype, device):
    """The target's embedding and output head, `[vocab, hidden]` each, read from its safetensors
    files without building the model: `*embed_tokens.weight` (exactly one) and `lm_head.weight`,
    or the embedding again when the config ties them."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        single = os.path.join(model_dir, "model.safetensors")
        if not os.path.isfile(single):
            raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        with safe_open(single, "pt") as f:
            where = {k: "model.safetensors" for k in f.keys()}
    embeds = sorted(k for k in where if k.endswith("embed_tokens.weight"))
    if len(embeds) != 1:
        raise ValueError(f"{model_dir}: expected one *embed_tokens.weight among the weights, "
                         f"found {embeds or 'none'}")
    tied = tied_embeddings(model_dir)
    head = "lm_head.weight" if "lm_head.weight" in where else None
    if head is None and not tied:
        raise ValueError(f"{model_dir}: no lm_head.weight, and the config does not tie it to the "
                         "embedding")

    def read(name):
        with safe_open(os.path.join(model_dir, where[name]), "pt") as f:
            return f.get_tensor(name).to(device=device, dtype=dtype)

    embedding = read(embeds[0])
    lm_head = embedding if head is None or tied else read(head)
    return embedding, lm_head


class TorchDrafter:
    """The drafter's weights (f32 masters), AdamW's moments, and the training step."""

    def __init__(self, req, heads=None):
        """The drafter `req` describes; the target's embedding and `lm_head` from `req["model"]`,
        or `heads` (a pair of `[vocab, hidden]` tensors on the device) where given."""
        device = device_for(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.device = device
        self.compute = dtype_of(req["dtype"])
        self.feature_dtype = dtype_of(req["feature_dtype"])
        shape = req["shape"]
        self.hidden = int(shape["hidden"])
        self.intermediate = int(shape["intermediate"])
        self.layers = int(shape["layers"])
        self.heads = int(shape["heads"])
        self.kv_heads = int(shape["kv_heads"])
        self.head_dim = int(shape["head_dim"])
        self.eps = float(shape["rms_eps"])
        self.theta = float(shape["rope_theta"])
        self.vocab = int(shape["vocab"])
        self.block = int(req["block_size"])
        self.mask_token = int(req["mask_token_id"])
        self.states = int(req["states"])
        self.gamma = req.get("gamma")
        dpace = req.get("dpace_alpha")
        self.dpace = None if dpace is None else float(dpace)
        distill = req.get("distill")
        self.distill = (float(distill[0]), float(distill[1])) if distill else None
        d2 = req.get("dflash2")
        self.dflash2 = None
        if d2:
            self.dflash2 = {
                "taps": int(d2["conv_kernel_size"]), "group": int(d2["conv_group_size"]),
                "top_k": int(d2["selector_top_k"]), "rank": int(d2["selector_rank"]),
                "weight": float(d2.get("selector_loss_weight", 1.0)),
                "detach": bool(d2.get("selector_stop_gradient", False)),
            }
            if self.hidden % self.dflash2["group"] or not 0 < self.dflash2["top_k"] <= self.vocab:
                raise ValueError(f"DFlash2 sizes {d2} do not fit hidden {self.hidden}, "
                                 f"vocabulary {self.vocab}")
        window = req.get("sliding_window")
        self.window = None if window is None else int(window)
        self.chunk = req.get("anchor_chunk") or None
        # Block positions whose full-vocabulary logits exist at once in the loss.
        self.loss_rows = max(1, int(os.environ.get(LOSS_ROWS_ENV, "") or DEFAULT_LOSS_ROWS))
        self.weight_decay = float(req["weight_decay"])
        self.names = list(req.get("names") or param_names(self.layers, self.dflash2 is not None))
        self.embedding, self.lm_head = heads or load_heads(req["model"], self.compute, device)
        if tuple(self.embedding.shape) != (self.vocab, self.hidden):
            raise ValueError(f"the target's embedding is {tuple(self.embedding.shape)}, the "
                             f"drafter expects {(self.vocab, self.hidden)}")
        if req.get("weights"):
            self.load(req["weights"], int(req.get("adam_t") or 0))
        self.path = step_path()
        self.flex = blocks.flex_available(device)
        self.compile = compile_flag()
        # The elementwise chains (`--drafter-compile`): compiled on the batched path when the
        # request asks, else eager (the drafter's arithmetic as it always was).
        self.k = fused.EAGER
        want = req.get("compile", False)
        if not isinstance(want, bool):
            raise ValueError(f"compile {want!r}: expected true or false")
        if want and self.path == "batched":
            self.k = fused.compiled(device, self.compute)
        self.fused_adam = device.type == "cuda"
        self.attention = "flex" if self.flex and self.path == "batched" else "sdpa"
        # bf16 working copies of the weights, made once per optimiser step (batched path).
        self._work = None
        self._batched = False
        self._steps = None
        self._inv_freq = None
        # The data-parallel drafters' process group (parallel.Group), when there is one.
        self.group = None

    @classmethod
    def from_checkpoint(cls, directory, model_dir, dtype):
        """A drafter checkpoint (`config.json` in the DFlash draft layout, `model.safetensors`)
        for decoding: every weight present with its shape, none unknown, all finite."""
        from safetensors.torch import load_file

        with open(os.path.join(directory, "config.json")) as f:
            c = json.load(f)
        fields = c.get("dflash_config") or {}
        heads = int(c["num_attention_heads"])
        dflash2 = None
        if "DFlash2DraftModel" in (c.get("architectures") or []):
            dflash2 = {k: fields[k] for k in ("conv_kernel_size", "conv_group_size",
                                              "selector_top_k", "selector_rank")}
        types = c.get("layer_types") or []
        window = c.get("sliding_window") if "sliding_attention" in types else None
        drafter = cls({
            "dflash2": dflash2, "sliding_window": window,
            "dtype": dtype, "feature_dtype": dtype, "model": model_dir,
            "shape": {"hidden": c["hidden_size"], "intermediate": c["intermediate_size"],
                      "layers": c["num_hidden_layers"], "heads": heads,
                      "kv_heads": c["num_key_value_heads"],
                      "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
                      "rms_eps": c["rms_norm_eps"], "rope_theta": c.get("rope_theta", 10000.0),
                      "vocab": c["vocab_size"]},
            "block_size": fields.get("block_size", c.get("block_size", 16)),
            "mask_token_id": fields.get("mask_token_id", c.get("mask_token_id")),
            "states": len(fields.get("target_layer_ids", c.get("target_layer_ids")) or []),
            "weight_decay": 0.0,
        })
        drafter.target_layer_ids = list(fields.get("target_layer_ids", c.get("target_layer_ids")))
        path = os.path.join(directory, "model.safetensors")
        weights = load_file(path)
        unknown = sorted(set(weights) - set(drafter.names))
        missing = [n for n in drafter.names if n not in weights]
        if missing or unknown:
            raise ValueError(f"{path}: lacks {missing[:3]}, has unknown {unknown[:3]}")
        try:
            drafter.check_shapes(weights)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        drafter.P = {}
        for n in drafter.names:
            t = weights[n].to(drafter.device, torch.float32)
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{path}: tensor {n} holds non-finite values")
            drafter.P[n] = t.requires_grad_(False)
        return drafter

    def check_shapes(self, tensors):
        """Raises when a weight of `tensors` does not have the shape this drafter's config gives."""
        expected = self.shapes()
        for n, t in tensors.items():
            if tuple(t.shape) != expected[n]:
                raise ValueError(f"{n} has shape {tuple(t.shape)}, the config makes it {expected[n]}")

    def shapes(self):
        h, hd, i = self.hidden, self.head_dim, int(self.intermediate)
        q, kv = self.heads * hd, self.kv_heads * hd
        layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
                 "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                 "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (hd,),
                 "self_attn.k_norm.weight": (hd,), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
                 "mlp.down_proj.weight": (h, i)}
        out = {"fc.weight": (h, h * self.states), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        for li in range(self.layers):
            out.update({f"layers.{li}.{k}": v for k, v in layer.items()})
        d2 = self.dflash2
        if d2:
            taps, groups, rank = d2["taps"], h // d2["group"], d2["rank"]
            for li in range(self.layers):
                for conv in ("attention_conv", "mlp_conv"):
                    out[f"layers.{li}.{conv}.base_kernel"] = (2, taps, h)
                    out[f"layers.{li}.{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
            out[SELECTOR + "hidden_projection.weight"] = (rank, h)
            out[SELECTOR + "predecessor_codebook"] = (self.vocab, rank)
            out[SELECTOR + "successor_codebook"] = (self.vocab, rank)
        return out

    def draft(self, context, token, position, b):
        """The `b - 1` tokens after `token` at `position` (greedy), the block seeing `context`
        (per layer keys and values of positions `0..position`)."""
        if b < 2:
            return []
        x = self.block_states(context, [token], [position], b)
        logits = F.linear(x[1:b], self.lm_head).float()
        if self.dflash2:
            path, _, _ = self.select(x[1:b], logits, token)
            return path.tolist()
        return logits.argmax(-1).tolist()

    def draft_sampled(self, context, token, position, b, sampling, generator):
        """`draft` drawing the tokens instead, the way the official package proposes them:
        DFlash draws every position at once from `sampling.probs(logits)` (one multinomial call
        over the rows); DFlash2 walks the positions, drawing each from softmax(scores / T) over
        its top-K candidates. Returns (tokens `[b - 1]`, their distributions, and for DFlash2
        the candidate ids those distributions are over `[b - 1, K]`, else None)."""
        x = self.block_states(context, [token], [position], b)
        logits = F.linear(x[1:b], self.lm_head).float()
        if self.dflash2:
            return self.select_sampled(x[1:b], logits, token, sampling.temperature, generator)
        q = sampling.probs(logits)
        return torch.multinomial(q, 1, generator=generator)[:, 0], q, None

    def select_sampled(self, x, logits, previous, temperature, generator):
        """`select` drawing each position's candidate from softmax(scores / temperature)."""
        k = self.dflash2["top_k"]
        # Unsorted, as the official selector takes them: a draw's index names the same token.
        unary, candidates = torch.topk(logits, k, dim=-1, sorted=False)
        hidden = F.linear(x.float(), self.P[SELECTOR + "hidden_projection.weight"])
        before = self.P[SELECTOR + "predecessor_codebook"]
        after = self.P[SELECTOR + "successor_codebook"]
        prev = torch.tensor(int(previous), device=x.device)
        path, rows = [], []
        for t in range(x.shape[0]):
            score = unary[t] + (after[candidates[t]] * (before[prev] * hidden[t])).sum(-1)
            q = torch.softmax(score.float()[None] / temperature, dim=-1)
            index = torch.multinomial(q, 1, generator=generator)[0, 0]
            prev = candidates[t, index]
            path.append(prev)
            rows.append(q[0])
        return torch.stack(path), torch.stack(rows), candidates

    def select(self, x, logits, previous):
        """DFlash2's greedy walk over one block's positions (`x`: their final hidden states,
        `logits`: the head's): at each, the head's top-K candidates `c` are scored
        `logits[c] + <A[prev] * (W x), B[c]>` against the token chosen before (`previous` first),
        and the best is chosen. Returns the path, the candidates `[positions, K]` and the
        scores."""
        k = self.dflash2["top_k"]
        unary, candidates = torch.topk(logits, k, dim=-1)
        hidden = F.linear(x.float(), self.P[SELECTOR + "hidden_projection.weight"])
        before = self.P[SELECTOR + "predecessor_codebook"]
        after = self.P[SELECTOR + "successor_codebook"]
        prev = torch.tensor(int(previous), device=x.device)
        path, scores = [], []
        for t in range(x.shape[0]):
            score = unary[t] + (after[candidates[t]] * (before[prev] * hidden[t])).sum(-1)
            prev = candidates[t, score.argmax()]
            path.append(prev)
            scores.append(score)
        return torch.stack(path), candidates, torch.stack(scores)

    # -- state ----------------------------------------------------------------------------

    def initialise(self, seed):
        """Fresh weights without a checkpoint (the drafter-step bench): norms at one, matrices
        N(0, 0.02) from `seed`; zero moments."""
        g = torch.Generator().manual_seed(seed)
        self.P, self.m, self.v = {}, {}, {}
        for n, shape in self.shapes().items():
            w = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
            if n.endswith(".base_kernel"):
                w = torch.zeros(shape)
                w[:, 0] = 1.0
            elif n.endswith((".kernel_projection.weight", "successor_codebook")):
                w = torch.zeros(shape)
            self.P[n] = torch.nn.Parameter(w.to(self.device))
            self.m[n] = torch.zeros(shape, device=self.device)
            self.v[n] = torch.zeros(shape, device=self.device)
        self.t = 0
        self._steps = None
        self._work = None

    def load(self, directory, adam_t):
        """Weights from `directory/model.safetensors`, moments from `optimizer.safetensors`."""
        from safetensors.torch import load_file

        weights = load_file(os.path.join(directory, "model.safetensors"))
        moments = load_file(os.path.join(directory, "optimizer.safetensors"))
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise ValueError(f"the drafter's weights lack {missing[:5]}")
        self.P = {}
        self.m, self.v = {}, {}
        for n in self.names:
            self.P[n] = torch.nn.Parameter(weights[n].to(self.device, torch.float32).contiguous())
            self.m[n] = moments[f"m.{n}"].to(self.device, torch.float32).contiguous()
            self.v[n] = moments[f"v.{n}"].to(self.device, torch.float32).contiguous()
        self.t = adam_t
        self._steps = None
        self._work = None

    @torch.no_grad()
    def nonfinite(self):
        """The first weight or moment holding a NaN or an infinity (its name), or None: one
        host read for them all."""
        tensors = [(n, self.P[n]) for n in self.names]
        tensors += [(f"m.{n}", self.m[n]) for n in self.names]
        tensors += [(f"v.{n}", self.v[n]) for n in self.names]
        flags = torch.stack([torch.isfinite(t).all() for _, t in tensors]).tolist()
        return next((n for (n, _), ok in zip(tensors, flags) if not ok), None)

    def save(self, directory):
        """Writes the weights and the moments as a checkpoint's two tensor files."""
        from safetensors.torch import save_file

        meta = {"format": "pt"}
        cpu = lambda t: t.detach().to("cpu", torch.float32).contiguous()  # noqa: E731
        save_file({n: cpu(self.P[n]) for n in self.names},
                  os.path.join(directory, "model.safetensors"), metadata=meta)
        moments = {}
        for n in self.names:
            moments[f"m.{n}"] = cpu(self.m[n])
            moments[f"v.{n}"] = cpu(self.v[n])
        save_file(moments, os.path.join(directory, "optimizer.safetensors"), metadata=meta)
        return self.t

    # -- the model ------------------------------------------------------------------------

    def w(self, name):
        """A weight in the compute dtype: the f32 master itself, or its bf16 working copy (made
        once per optimiser step on the batched path, a leaf whose gradient `_fold_work` adds to
        the master's once per micro-batch; a cast per use on the legacy path)."""
        p = self.P[name]
        if self.compute == torch.float32:
            return p
        if self._work is None:
            return p.to(self.compute)
        t = self._work.get(name)
        if t is None:
            with torch.no_grad():
                t = p.to(self.compute)
            self._work[name] = t.requires_grad_(p.requires_grad)
        return t

    def _fold_work(self):
        """The working copies' gradients into the f32 masters' (one accumulation each: a cast
        where the master has none yet, else one foreach add of them all)."""
        into, add = [], []
        for n, t in (self._work or {}).items():
            if t.grad is not None:
                p = self.P[n]
                if p.grad is None:
                    p.grad = t.grad.to(torch.float32)
                else:
                    into.append(p.grad)
                    add.append(t.grad)
                t.grad = None
        if into:
            torch._foreach_add_(into, add)

    def context(self, features, positions):
        """Per layer, keys (rotary applied) and values `[tokens, kv_heads, head_dim]` of the
        context of every token (`positions`: each token's position in its sequence)."""
        s, d = features.shape[0], self.head_dim
        ctx = F.linear(features.to(self.compute), self.w("fc.weight"))
        ctx = self.k.rms_norm(ctx, self.P["hidden_norm.weight"], self.eps)
        cos, sin = rope_tables(positions, d, self.theta)
        cos, sin = cos.to(self.compute).unsqueeze(1), sin.to(self.compute).unsqueeze(1)
        out = []
        for i in range(self.layers):
            p = f"layers.{i}.self_attn."
            k = F.linear(ctx, self.w(p + "k_proj.weight")).view(s, self.kv_heads, d)
            k = self.k.norm_rope(k, self.P[p + "k_norm.weight"], self.eps, cos, sin)
            v = F.linear(ctx, self.w(p + "v_proj.weight")).view(s, self.kv_heads, d)
            out.append((k, v))
        return out

    def block_states(self, context, anchor_tokens, anchors, b=None):
        """The final hidden states `[a * b, hidden]` (normed) of one block per anchor against one
        sequence's `context` (per layer `[seq, kv, d]` keys and values); blocks of `b` (the
        drafter's block size unless given)."""
        b = b or self.block
        a, d = len(anchors), self.head_dim
        dev = self.device
        seen = max(1, min(context[0][0].shape[0], max(anchors)))
        ids = torch.full((a, b), self.mask_token, dtype=torch.long)
        ids[:, 0] = torch.tensor(anchor_tokens, dtype=torch.long)
        x = self.embedding[ids.to(dev)].to(self.compute)  # [a, b, h]
        anchors_t = torch.tensor(anchors, dtype=torch.long, device=dev)
        pos = anchors_t.unsqueeze(1) + torch.arange(b, device=dev).unsqueeze(0)  # [a, b]
        cos, sin = rope_tables(pos, d, self.theta)
        cos, sin = cos.to(self.compute).unsqueeze(2), sin.to(self.compute).unsqueeze(2)
        # The mask [a*b, seen + a*b]: the context before the block's anchor, and its own block.
        q_anchor = anchors_t.repeat_interleave(b)
        ctx_ok = torch.arange(seen, device=dev).unsqueeze(0) < q_anchor.unsqueeze(1)
        q_block = torch.arange(a, device=dev).repeat_interleave(b)
        blk_ok = q_block.unsqueeze(1) == q_block.unsqueeze(0)
        if self.window is not None:
            # Sliding layers: keys less than the window from the query, both ways in the block.
            q_pos = pos.reshape(-1)
            ctx_ok = ctx_ok & (q_pos.unsqueeze(1) - torch.arange(seen, device=dev).unsqueeze(0)
                               < self.window)
            k_off = torch.arange(b, device=dev).repeat(a)
            blk_ok = blk_ok & ((k_off.unsqueeze(1) - k_off.unsqueeze(0)).abs() < self.window)
        mask = torch.cat([ctx_ok, blk_ok], dim=1)
        gqa = self.heads != self.kv_heads

        def attend(kc, vc, q, kb, vb):
            # One query sequence of all the blocks; keys: the context seen, then the blocks.
            keys = torch.cat([kc[:seen], kb.reshape(a * b, self.kv_heads, d)], dim=0)
            values = torch.cat([vc[:seen], vb.reshape(a * b, self.kv_heads, d)], dim=0)
            q = q.reshape(a * b, self.heads, d).transpose(0, 1).unsqueeze(0)
            return F.scaled_dot_product_attention(
                q, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, enable_gqa=gqa).squeeze(0).transpose(0, 1)

        return self._layers(x, context, cos, sin, attend)

    def _layers(self, x, context, cos, sin, attend):
        """The drafter's layers over blocks `x` `[n, b, hidden]` and the final norm, as
        `[n * b, hidden]`: `attend(kc, vc, q, kb, vb)` gives a layer's attention `[n * b, heads,
        head_dim]` of the blocks' queries `q` `[n, b, heads, d]` (rotary applied) to the
        context's keys and values `kc`, `vc` (that layer's of `context`) and the blocks' own
        `kb`, `vb` `[n, b, kv_heads, d]`."""
        n, b, h = x.shape
        d = self.head_dim
        d2 = self.dflash2
        k = self.k
        # Each residual sum is normed in the same chain: by the next layer's input norm, the
        # last by the final norm.
        norms = [f"layers.{i}.input_layernorm.weight" for i in range(len(context))]
        norms.append("norm.weight")
        hn = k.rms_norm(x, self.P[norms[0]], self.eps)
        for i, (kc, vc) in enumerate(context):
            p = f"layers.{i}."
            if d2:
                hn, after = self._conv_prepare(hn, p + "attention_conv.")
            q = F.linear(hn, self.w(p + "self_attn.q_proj.weight")).view(n, b, self.heads, d)
            q = k.norm_rope(q, self.P[p + "self_attn.q_norm.weight"], self.eps, cos, sin)
            kb = F.linear(hn, self.w(p + "self_attn.k_proj.weight")).view(n, b, self.kv_heads, d)
            kb = k.norm_rope(kb, self.P[p + "self_attn.k_norm.weight"], self.eps, cos, sin)
            vb = F.linear(hn, self.w(p + "self_attn.v_proj.weight")).view(n, b, self.kv_heads, d)
            out = attend(kc, vc, q, kb, vb).reshape(n, b, self.heads * d)
            out = F.linear(out, self.w(p + "self_attn.o_proj.weight"))
            if d2:
                out = after(out)
            x, hn = k.add_norm(x, out, self.P[p + "post_attention_layernorm.weight"], self.eps)
            if d2:
                hn, after = self._conv_prepare(hn, p + "mlp_conv.")
            act = k.swiglu(F.linear(hn, self.w(p + "mlp.gate_proj.weight")),
                           F.linear(hn, self.w(p + "mlp.up_proj.weight")))
            out = F.linear(act, self.w(p + "mlp.down_proj.weight"))
            if d2:
                out = after(out)
            x, hn = k.add_norm(x, out, self.P[norms[i + 1]], self.eps)
        return hn.reshape(n * b, h)

    def _conv_prepare(self, hn, prefix):
        """DFlash2's convolution before a sublayer (of its normed input `hn` `[a, b, hidden]`),
        and the one to apply to the sublayer's output: both sides' dynamic kernels come from
        `hn`, through the one projection."""
        a, b, _ = hn.shape
        taps, groups = self.dflash2["taps"], self.hidden // self.dflash2["group"]
        group = self.dflash2["group"]
        base = self.w(prefix + "base_kernel")
        dynamic = F.linear(hn, self.w(prefix + "kernel_projection.weight")).view(
            a, b, 2, taps, groups)
        return (grouped_conv(hn, dynamic[:, :, 0], base[0], group),
                lambda out: grouped_conv(out, dynamic[:, :, 1], base[1], group))

    def chunk_loss(self, context, teacher, tokens, loss_mask, anchors):
        """Weighted loss sum of one chunk's blocks, its weights' sum, per block position
        (correct, counted), and DFlash2's selector figures (its weighted cross-entropy sum and
        per position its correct picks; None for DFlash). The full-vocabulary logits exist for
        `loss_rows` block positions at a time: past that many, each piece of rows is
        checkpointed (its logits are recomputed in the backward pass instead of kept)."""
        a, b, n = len(anchors), self.block, len(tokens)
        x = self.block_states(context, [tokens[p] for p in anchors], anchors)
        targets = torch.tensor(
            [tokens[p + k] if p + k < n else 0 for p in anchors for k in range(b)],
            dtype=torch.long, device=self.device)
        # DFlash2's selector learns with the data's token before each position as its
        # predecessor (the anchor's own token at position 1), as it is walked at serving time.
        prev = None
        if self.dflash2:
            prev = torch.tensor(
                [tokens[min(max(p + k - 1, 0), n - 1)] for p in anchors for k in range(b)],
                dtype=torch.long, device=self.device)
        weights = block_weights(loss_mask, anchors, b, self.gamma).to(self.device)
        taught = None
        if self.distill is not None and teacher is not None:
            last = teacher.shape[0] - 1
            rows = torch.tensor([min(max(p + k - 1, 0), last) for p in anchors for k in range(b)],
                                dtype=torch.long, device=self.device)
            taught = teacher[rows].to(self.compute)
        total, hit, counted, selector, _ = self._weighted_loss(x, targets, prev, taught, weights)
        if selector is not None:
            selector = (float(selector[0].detach()), selector[1])
        return (total, float(weights.double().sum()), hit.sum(0), counted.sum(0), selector)

    def _weighted_loss(self, x, targets, prev, taught, weights, counted=None, scale=1.0):
        """The weighted loss sum of block rows `x` `[a * b, hidden]`, per row whether the greedy
        prediction is a counted hit `[a, b]`, the counted rows `[a, b]`, and DFlash2's selector
        (its weighted cross-entropy sum, its right picks per block position; None for DFlash),
        and the loss times `scale` (the one to call `backward` on). Plain cross-entropy (and D-PACE) goes through `blocks.LinearCE` on the batched path;
        distillation, DFlash2 and the legacy path compute the logits in pieces under autograd."""
        b = self.block
        a = x.shape[0] // b
        if counted is None:
            counted = weights > 0
        if self._batched and taught is None and self.dflash2 is None:
            rows = max(b, self.loss_rows // b * b)
            scaled, total, hits, _ = blocks.LinearCE.apply(
                x, self.lm_head, targets, weights, counted, b, rows, self.dpace, scale, self.k)
            on = counted.view(a, b)
            return total, hits.view(a, b) & on, on, None, scaled
        step = self.loss_rows
        per, hard, predicted, sel, sel_hit = [], [], [], [], []
        for i in range(0, a * b, step):
            piece = slice(i, i + step)
            args = (x[piece], targets[piece], None if taught is None else taught[piece],
                    None if prev is None else prev[piece])
            if a * b > step:
                ce, gold, argmax, s_ce, s_hit = checkpoint(self._rows_ce, *args,
                                                           use_reentrant=False)
            else:
                ce, gold, argmax, s_ce, s_hit = self._rows_ce(*args)
            per.append(ce)
            hard.append(gold)
            predicted.append(argmax)
            sel.append(s_ce)
            sel_hit.append(s_hit)
        per = torch.cat(per)
        if self.dpace is not None:
            # D-PACE's weights of the drafter's detached probabilities of the labels, times
            # the positions' own (1 or 0) weights, rounded to f32 as the candle drafter weighs.
            # (Of the data's tokens: with kd-dpace the loss distils, the weights still read them.)
            gold = torch.cat(hard).to(torch.float64)
            d = dpace_weights(torch.exp(-gold), counted, b, self.dpace)
            w = (d * weights.to(torch.float64)).to(torch.float32)
        else:
            w = weights
        total = (per * w).sum()
        selector = None
        if self.dflash2:
            sel = torch.cat(sel)
            sel_total = (sel * w).sum()
            total = total + self.dflash2["weight"] * sel_total
            with torch.no_grad():
                picks = (torch.cat(sel_hit).view(a, b) & counted.view(a, b)).sum(0)
            selector = (sel_total.detach(), picks)
        with torch.no_grad():
            hit = ((torch.cat(predicted) == targets).view(a, b) & counted.view(a, b))
        return total, hit, counted.view(a, b), selector, total * scale

    def _rows_ce(self, x, targets, taught, prev):
        """Of some block positions (`x`: their final hidden states): each one's loss before
        weighting (cross-entropy on `targets`, or its mix with distillation of the target's
        states `taught`), the cross-entropy on `targets` detached, the greedy predictions, and
        for DFlash2 the selector's cross-entropy and whether its pick (with the data's
        predecessor `prev`) is the label."""
        logits = F.linear(x, self.lm_head).float()
        log_probs = F.log_softmax(logits, dim=-1)
        per = -log_probs.gather(1, targets.unsqueeze(1)).squeeze(1)
        gold = per.detach()
        if taught is not None:
            share, temperature = self.distill
            with torch.no_grad():
                target_probs = torch.softmax(
                    F.linear(taught, self.lm_head).float() / temperature, dim=-1)
            kd = -(target_probs * log_probs).sum(-1)
            per = per * (1.0 - share) + kd * share
        argmax = logits.detach().argmax(-1)
        if prev is None:
            return per, gold, argmax, None, None
        sel, picked = self._selector_ce(x, logits, targets, prev)
        return per, gold, argmax, sel, picked

    def _selector_ce(self, x, logits, targets, prev):
        """DFlash2's selector loss at some block positions: cross-entropy over the scores of the
        head's top-K candidates, `logits[c] + <A[prev] * (W x), B[c]>`, with the label put in
        the last (K-th) candidate's place where the top K miss it (so that every position
        teaches the selector). Whether the pick is right counts the top K as they are: a
        missed label is a wrong pick. With the stop-gradient, the logits and `x` are read
        detached: the selector's loss trains its own weights only."""
        if self.dflash2["detach"]:
            x, logits = x.detach(), logits.detach()
        k = self.dflash2["top_k"]
        with torch.no_grad():
            _, candidates = torch.topk(logits, k, dim=-1)
            label_at = candidates == targets.unsqueeze(1)
            missed = ~label_at.any(-1)
            last = torch.zeros_like(label_at)
            last[:, -1] = True
            candidates = torch.where(missed.unsqueeze(1) & last, targets.unsqueeze(1),
                                     candidates)
            label = (candidates == targets.unsqueeze(1)).to(torch.int64).argmax(-1)
        unary = logits.gather(1, candidates)
        hidden = F.linear(x.float(), self.P[SELECTOR + "hidden_projection.weight"])
        before = F.embedding(prev, self.P[SELECTOR + "predecessor_codebook"])
        after = F.embedding(candidates, self.P[SELECTOR + "successor_codebook"])
        scores = unary + torch.einsum("nr,nkr->nk", before * hidden, after)
        ce = -F.log_softmax(scores, dim=-1).gather(1, label.unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            picked = (scores.argmax(-1) == label) & ~missed
        return ce, picked

    # -- the training step ----------------------------------------------------------------

    def micro_batch(self, features, tokens, loss_mask, sequences, accum):
        """Forward and backward of one micro-batch (`sequences`: (start, length, anchors)); the
        gradients, scaled by 1 / (weight * accum), are added to the parameters' `.grad`."""
        if self.path == "legacy":
            return self._micro_batch_legacy(features, tokens, loss_mask, sequences, accum)
        self._batched = True
        try:
            return self._micro_batch_batched(features, tokens, loss_mask, sequences, accum)
        finally:
            self._batched = False

    def _micro_batch_batched(self, features, tokens, loss_mask, sequences, accum):
        """Every anchor of the micro-batch in one pass (anchor chunks only with
        `--anchor-chunk`): the plan made once on the host and copied in three transfers, the
        context once, the blocks of all sequences against it under one mask, one backward, the
        metrics kept on the device and read in one transfer at the end."""
        b = self.block
        plan = blocks.Plan(tokens, loss_mask, sequences, b, self.gamma, self.window)
        weight = plan.weight_sum
        out = {"loss": 0.0, "weight": weight, "anchors": 0,
               "correct": [0] * b, "counted": [0] * b}
        if weight <= 0:
            return out
        out["anchors"] = plan.anchors_n
        scale = 1.0 / (weight * max(accum, 1))
        dev = self.device
        width = self.states * self.hidden
        features = features.to(dev, non_blocking=True)
        ints = torch.stack([plan.targets, plan.previous, plan.teacher_rows,
                            plan.counted.to(torch.long), plan.ctx_lo, plan.ctx_hi, plan.blk_lo,
                            plan.blk_hi, plan.block_positions.reshape(-1),
                            plan.anchor_tokens.repeat_interleave(b)]).to(dev, non_blocking=True)
        rows = {"targets": ints[0], "previous": ints[1], "teacher": ints[2],
                "counted": ints[3].to(torch.bool), "iv": ints[4:8], "pos": ints[8],
                "anchor_tokens": ints[9], "weights": plan.weights.to(dev, non_blocking=True)}
        positions = plan.positions.to(dev, non_blocking=True)
        if self._work is None and self.compute != torch.float32:
            self._work = {}
        context = self.context(features[:, :width], positions)
        teacher = features[:, width:width + self.hidden] if self.distill else None
        chunks = plan.chunks(self.chunk)
        leaves = context
        if len(chunks) > 1:
            leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_())
                      for k, v in context]
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        selector_sum = torch.zeros((), dtype=torch.float64, device=dev)
        correct = torch.zeros(b, dtype=torch.long, device=dev)
        counted = torch.zeros(b, dtype=torch.long, device=dev)
        picks = torch.zeros(b, dtype=torch.long, device=dev)
        for anchors in chunks:
            r = slice(anchors.start * b, anchors.stop * b)
            x = self._batched_blocks(leaves, plan, anchors, rows)
            taught = None
            if teacher is not None:
                taught = teacher[rows["teacher"][r]].to(self.compute)
            total, hit, on, selector, scaled = self._weighted_loss(
                x, rows["targets"][r], rows["previous"][r] if self.dflash2 else None, taught,
                rows["weights"][r], rows["counted"][r], scale)
            scaled.backward()
            loss_sum += total.detach().to(torch.float64)
            correct += hit.sum(0)
            counted += on.sum(0)
            if selector is not None:
                selector_sum += selector[0].to(torch.float64)
                picks += selector[1]
        if len(chunks) > 1:
            backward_context(context, leaves)
        self._fold_work()
        # The one host sync of the micro-batch: every figure in one transfer.
        figures = torch.cat([loss_sum.view(1), selector_sum.view(1), correct.double(),
                             counted.double(), picks.double()]).tolist()
        out["loss"] = figures[0] / weight
        out["correct"] = [int(v) for v in figures[2:2 + b]]
        out["counted"] = [int(v) for v in figures[2 + b:2 + 2 * b]]
        if self.dflash2:
            out["selector_loss"] = figures[1] / weight
            out["selector_correct"] = [int(v) for v in figures[2 + 2 * b:]]
        return out

    def _rope(self, positions):
        """cos and sin `[..., head_dim]` in the compute dtype, the inverse frequencies made once
        (as `rope_tables` makes them)."""
        if self._inv_freq is None:
            d = self.head_dim
            self._inv_freq = torch.tensor(
                [1.0 / self.theta ** (2.0 * i / d) for i in range(d // 2)],
                dtype=torch.float64).to(torch.float32).to(self.device)
        angles = positions.to(torch.float32).unsqueeze(-1) * self._inv_freq
        cos, sin = angles.cos(), angles.sin()
        return (torch.cat([cos, cos], dim=-1).to(self.compute),
                torch.cat([sin, sin], dim=-1).to(self.compute))

    def _batched_blocks(self, context, plan, anchors, rows):
        """The final hidden states `[n * b, hidden]` of the blocks of `anchors` (a range of the
        plan's) against the context keys and values of the whole micro-batch: the keys are the
        context span the anchors reach (padded to flex's tile) and then the blocks' own, under
        the plan's intervals (a flex `BlockMask` on GPU, a dense mask for SDPA elsewhere)."""
        b, d = self.block, self.head_dim
        n = len(anchors)
        r = slice(anchors.start * b, anchors.stop * b)
        q_rows = n * b
        lo, hi = plan.key_span(anchors)
        span = hi - lo
        pad = -(-span // blocks.TILE) * blocks.TILE if self.flex else span
        keys = pad + q_rows
        base = pad + torch.arange(n, device=self.device).repeat_interleave(b) * b
        iv = rows["iv"][:, r]
        iv = torch.stack([iv[0] - lo, iv[1] - lo, base + iv[2], base + iv[3]])
        if self.flex:
            mask = blocks.block_mask(iv, q_rows, keys)
        else:
            mask = blocks.dense_mask(iv, keys)
        ids = rows["anchor_tokens"][r].view(n, b).clone()
        ids[:, 1:] = self.mask_token
        x = self.embedding[ids].to(self.compute)  # [n, b, h]
        cos, sin = self._rope(rows["pos"][r].view(n, b))
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        gqa = self.heads != self.kv_heads

        def attend(kc, vc, q, kb, vb):
            kc, vc = kc[lo:hi], vc[lo:hi]
            if pad > span:
                fill = (0, 0, 0, 0, 0, pad - span)
                kc, vc = F.pad(kc, fill), F.pad(vc, fill)
            keys_t = torch.cat([kc, kb.reshape(q_rows, self.kv_heads, d)]).transpose(0, 1)
            values = torch.cat([vc, vb.reshape(q_rows, self.kv_heads, d)]).transpose(0, 1)
            q = q.reshape(q_rows, self.heads, d).transpose(0, 1)
            if self.flex:
                att = blocks.flex(q.unsqueeze(0), keys_t.unsqueeze(0), values.unsqueeze(0), mask,
                                  gqa, self.compile)
            else:
                att = blocks.sdpa(q.unsqueeze(0), keys_t.unsqueeze(0), values.unsqueeze(0), mask,
                                  gqa)
            return att.squeeze(0).transpose(0, 1)

        return self._layers(x, context, cos, sin, attend)

    def _micro_batch_legacy(self, features, tokens, loss_mask, sequences, accum):
        """The step per sequence and anchor chunk (the path before the batched one)."""
        weight = 0.0
        for start, length, anchors in sequences:
            w = block_weights(loss_mask[start:start + length], anchors, self.block, self.gamma)
            # In f64, as the stage sums them: an f32 sum of 8,192 weights drifts by 1e-5.
            weight += float(w.double().sum())
        out = {"loss": 0.0, "weight": weight, "anchors": 0,
               "correct": [0] * self.block, "counted": [0] * self.block}
        if weight <= 0:
            return out
        out["anchors"] = sum(len(anchors) for _, _, anchors in sequences)
        scale = 1.0 / (weight * max(accum, 1))
        width = self.states * self.hidden
        features = features.to(self.device)
        ctx_features = features[:, :width]
        teacher = features[:, width:width + self.hidden] if self.distill else None
        positions = torch.zeros(features.shape[0], dtype=torch.long)
        for start, length, _ in sequences:
            positions[start:start + length] = torch.arange(length)
        context = self.context(ctx_features, positions.to(self.device))
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in context]
        loss_sum = 0.0
        selector_sum = 0.0
        correct = torch.zeros(self.block, dtype=torch.long, device=self.device)
        counted = torch.zeros(self.block, dtype=torch.long, device=self.device)
        picks = torch.zeros(self.block, dtype=torch.long, device=self.device)
        for start, length, anchors in sequences:
            seq_ctx = [(k[start:start + length], v[start:start + length]) for k, v in leaves]
            seq_teacher = teacher[start:start + length] if teacher is not None else None
            seq_tokens = tokens[start:start + length]
            seq_mask = loss_mask[start:start + length]
            step = self.chunk or len(anchors)
            for c in range(0, len(anchors), step):
                total, _, hit, cnt, selector = self.chunk_loss(
                    seq_ctx, seq_teacher, seq_tokens, seq_mask, anchors[c:c + step])
                (total * scale).backward()
                loss_sum += float(total.detach())
                correct += hit
                counted += cnt
                if selector is not None:
                    selector_sum += selector[0]
                    picks += selector[1]
        backward_context(context, leaves)
        out["loss"] = loss_sum / weight
        out["correct"] = correct.tolist()
        out["counted"] = counted.tolist()
        if self.dflash2:
            # The selector's own weighted cross-entropy (inside `loss` at its weight) and its
            # right picks per block position.
            out["selector_loss"] = selector_sum / weight
            out["selector_correct"] = picks.tolist()
        return out

    @torch.no_grad()
    def check_replicas(self):
        """Data-parallel drafters (a collective call): raises when some rank's weights differ
        from rank 0's, naming the first tensor that does and the rank."""
        sums = self.group.checksums([self.P[n].detach() for n in self.names])
        for rank, theirs in enumerate(sums[1:], start=1):
            for name, a, b in zip(self.names, sums[0], theirs):
                if a != b:
                    raise ValueError(
                        f"drafter rank {rank}'s {name} differs from rank 0's (checksums {b} and "
                        f"{a}): the replicas drifted apart")

    @torch.no_grad()
    def step(self, lr, clip, skip):
        """Ends a group: drops the gradients with `skip`; else clips them to the norm `clip`
        and, when that norm is finite, steps AdamW (the candle drafter's formula). With a
        process group, every rank's gradients are summed first (in rank order: the same bits
        on every rank) and the ranks agree on `skip`."""
        reduce_s = 0.0
        if self.group is not None:
            import time

            from .parallel import sum_gradients

            started = time.perf_counter()
            skip, _ = sum_gradients(self.group, self.P, self.names, skip)
            reduce_s = time.perf_counter() - started
        answer = self._step(lr, clip, skip)
        answer["reduce_s"] = reduce_s
        return answer

    def _step(self, lr, clip, skip):
        if self.path == "legacy":
            return self._step_legacy(lr, clip, skip)
        grads = [(n, self.P[n].grad) for n in self.names]
        if skip or all(g is None for _, g in grads):
            self.zero_grad()
            return {"grad_norm": None}
        present = [(n, g) for n, g in grads if g is not None]
        gs = [g for _, g in present]
        # The one host sync of the step: the global norm, from per-tensor norms on the device.
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)).double()))
        if not math.isfinite(norm):
            bad = next((n for n, g in present if not bool(torch.isfinite(g).all())),
                       "an unknown parameter")
            self.zero_grad()
            return {"nonfinite": bad}
        if norm > clip and norm > 0:
            torch._foreach_mul_(gs, clip / norm)
        self.t += 1
        names = [n for n, _ in present]
        if self._steps is None:
            self._steps = {}
        steps = []
        for n in names:
            # AdamW's functional form counts a tensor's steps itself (it adds one first); every
            # tensor's bias correction reads the drafter's step count, as on the legacy path.
            held = self._steps.get(n)
            if held is None:
                held = self._steps[n] = [torch.tensor(float(self.t - 1), device=self.device),
                                         self.t - 1]
            elif held[1] != self.t - 1:
                held[0].fill_(float(self.t - 1))
            held[1] = self.t
            steps.append(held[0])
        from torch.optim.adamw import adamw

        fused = self.fused_adam
        adamw([self.P[n] for n in names], gs, [self.m[n] for n in names],
              [self.v[n] for n in names], [], steps, foreach=not fused, fused=fused,
              amsgrad=False, beta1=0.9, beta2=0.999, lr=lr, weight_decay=self.weight_decay,
              eps=1e-8, maximize=False)
        self.zero_grad()
        return {"grad_norm": norm}

    def _step_legacy(self, lr, clip, skip):
        grads = [(n, self.P[n].grad) for n in self.names]
        if skip or all(g is None for _, g in grads):
            self.zero_grad()
            return {"grad_norm": None}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for _, g in grads if g is not None))
        if not math.isfinite(norm):
            bad = next((n for n, g in grads if g is not None and not bool(torch.isfinite(g).all())),
                       "an unknown parameter")
            self.zero_grad()
            return {"nonfinite": bad}
        if norm > clip and norm > 0:
            for _, g in grads:
                if g is not None:
                    g.mul_(clip / norm)
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        bias1, bias2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        for n, g in grads:
            if g is None:
                continue
            m, v, p = self.m[n], self.v[n], self.P[n]
            m.mul_(b1).add_(g * (1.0 - b1))
            v.mul_(b2).add_(g.pow(2) * (1.0 - b2))
            update = (m / bias1) / ((v / bias2).sqrt() + eps)
            p.mul_(1.0 - lr * self.weight_decay).sub_(update * lr)
        self.zero_grad()
        return {"grad_norm": norm}

    def zero_grad(self):
        for p in self.P.values():
            p.grad = None
        # The masters may change: working copies are made again at the next micro-batch.
        self._work = None
