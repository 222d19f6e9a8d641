//! The memory plan of a DFlash run: each worker's peak memory by arithmetic from the target's
//! shape, the drafter, the token budget, the dtypes and the longest sequence, what `launch
//! --dry-run` prints and what a real launch checks against the GPUs' memory.
//!
//! The figures follow what the worker's code keeps alive at its worst moment (see
//! `worker/src/model/qwen3.rs` and `drafter.rs`): a target worker's peak is inside one decoder
//! layer (the MLP's four `[tokens, intermediate]` tensors) plus the hidden states it keeps for the
//! features; a drafter's is one chunk of anchors' blocks, whose attention scores
//! (`anchors × block × heads × context` f32, kept for the backward pass) and logits dominate.
//! Every term is linear in the batch's tokens; none is `tokens²`.

use crate::format::gib;
use serde::Serialize;

use dflash_common::dflash::{DflashSettings, DrafterArch, Engine, Engines, Qwen3Config};

/// The bytes of one chunk's activations that `--anchor-chunk auto` aims at, on a GPU whose
/// memory is not known (and for candle's drafter on any GPU).
pub const GPU_CHUNK_BYTES: u64 = 12 << 30;
/// The share of a GPU's memory the torch drafter's whole plan may fill when `--anchor-chunk
/// auto` sizes its chunk from that memory: the rest is headroom for the allocator's
/// fragmentation and what the plan's constants miss.
pub const GPU_FILL: f64 = 0.9;
/// The same on a CPU worker.
pub const CPU_CHUNK_BYTES: u64 = 1 << 30;

/// f32 copies of a block's attention scores alive at once in the drafter, forward and backward
/// (the scores, scaled, masked, concatenated with the block's own, the softmax's shifted,
/// exponentiated and normalised forms, the context part made contiguous, and their gradients).
/// Calibrated on `scripts/bench-scale`'s measured peaks (see docs/memory.md).
const SCORE_COPIES: f64 = 16.0;
/// f32 copies of a block's logits alive at once (logits, log-softmax's intermediates, its
/// gradient).
const LOGIT_COPIES: f64 = 7.0;
/// `[tokens, hidden]`-sized activations a drafter layer keeps per block token for backward
/// (norms, projections, rotary, residuals, MLP in and out).
const DRAFTER_HIDDEN_COPIES: f64 = 24.0;
/// `[tokens, intermediate]`-sized ones (gate, its sigmoid and product, up, their product).
const DRAFTER_MLP_COPIES: f64 = 6.0;
/// `[tokens, hidden]`-sized tensors alive throughout a target layer (the residual and the normed
/// input).
const TARGET_HIDDEN_COPIES: f64 = 2.0;
/// `[tokens, intermediate]`-sized ones at the MLP (gate, its SiLU, up, their product).
const TARGET_MLP_COPIES: f64 = 4.0;
/// `[tokens, heads × head_dim]`-sized ones at attention (the queries, the output pieces, their
/// concatenation and stack, the merged heads), besides the keys and values.
const TARGET_QUERY_COPIES: f64 = 5.0;
/// f32 `[heads, tile, tile]` tensors alive in one tile step (scores, masked, shifted, exp).
const TILE_COPIES: f64 = 4.0;
/// A worker process's own resident baseline (code, allocator, threads).
const BASELINE: u64 = 16 << 20;

// The torch engine's workers (`python/dflash_orch/target.py`, `drafter.py`). Calibrated on
// `scripts/bench-scale --engine torch`'s measured peaks (see docs/memory.md).

/// The Python side's own resident memory: the interpreter with torch and transformers imported.
pub const TORCH_RUNTIME: u64 = 700 << 20;
/// `[tokens, hidden]`-sized tensors alive in a `transformers` decoder layer (the residual, the
/// normed input and its f32 intermediates, the layer's output).
const TORCH_TARGET_HIDDEN_COPIES: f64 = 4.0;
/// `[tokens, intermediate]`-sized ones at its MLP (the gate's activation, up, their product:
/// the gate itself is freed once activated, as inference keeps no graph).
const TORCH_TARGET_MLP_COPIES: f64 = 3.0;
/// `[tokens, heads × head_dim]`-sized ones at attention (queries, their norm and rotary forms,
/// keys and values repeated to the query heads, the output and its projection).
const TORCH_TARGET_QUERY_COPIES: f64 = 8.0;
/// `[tokens, hidden]`-sized tensors of the micro-batch's context the torch drafter keeps for the
/// backward pass through it (the features in the compute dtype, `fc`'s output, its norm and the
/// norm's f32 intermediates), and `[tokens, kv_heads × head_dim]`-sized ones per drafter layer
/// (keys through their norm and rotary, values, and the chunks' summed gradients of both).
const TORCH_CONTEXT_HIDDEN_COPIES: f64 = 6.0;
const TORCH_CONTEXT_KV_COPIES: f64 = 12.0;
/// `[tokens, hidden]`- and `[tokens, intermediate]`-sized tensors a torch drafter layer keeps
/// per block token for backward, and f32 copies of a piece of the loss's logits (the logits,
/// the log-softmax, its gradient and the softmax's).
const TORCH_DRAFTER_HIDDEN_COPIES: f64 = 24.0;
const TORCH_DRAFTER_MLP_COPIES: f64 = 6.0;
const TORCH_LOGIT_COPIES: f64 = 4.0;
/// Block positions whose full-vocabulary logits exist at once in the torch drafter's loss
/// (`drafter.py`'s `DEFAULT_LOSS_ROWS`).
pub const TORCH_LOSS_ROWS: f64 = 4096.0;

/// `[tokens, hidden]`-sized tensors a DFlash2 drafter layer keeps per block token for backward
/// besides a DFlash layer's: per convolution (two per layer) the input shifted by each tap and
/// weighted, and the sum.
const DFLASH2_CONV_HIDDEN_COPIES: f64 = 8.0;
/// Copies of a DFlash2 convolution's dynamic kernels (`[tokens, 2 × taps × groups]`: the
/// projection's output and its split halves) kept per block token, per convolution.
const DFLASH2_KERNEL_COPIES: f64 = 3.0;
/// f32 copies of the selector's `[rows, top_k, rank]` gathered successor codes alive at once in
/// the loss (the gather, the product with the predecessor's code, its gradient).
const DFLASH2_SELECTOR_COPIES: f64 = 3.0;

/// A DFlash2 drafter's elements besides a DFlash one's: (the convolutions', cast to the compute
/// dtype with the layers; the selector's, used in f32: its two `[vocab, rank]` codebooks and
/// the hidden projection). Zero for DFlash.
fn dflash2_params(target: &Qwen3Config, s: &DflashSettings) -> (f64, f64) {
    if s.drafter_arch != DrafterArch::Dflash2 {
        return (0.0, 0.0);
    }
    let d = &s.dflash2;
    let (h, taps) = (target.hidden_size as f64, d.conv_kernel_size as f64);
    let groups = h / d.conv_group_size.max(1) as f64;
    // Per convolution a base kernel [2, taps, hidden] and a kernel projection
    // [2 · taps · groups, hidden]; two per layer.
    let conv = s.draft_layers as f64 * 2.0 * (2.0 * taps * h + 2.0 * taps * groups * h);
    let rank = d.selector_rank as f64;
    let selector = 2.0 * target.vocab_size as f64 * rank + rank * h;
    (conv, selector)
}

/// One worker's memory at its peak, by what holds it, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WorkerPlan {
    pub role: &'static str,
    /// The engine whose code the figures follow: `candle` or `torch`.
    pub engine: &'static str,
    /// Model weights on the worker's device (the target's layers it runs; the drafter's f32
    /// masters, their compute-dtype copies and the target's embedding and lm_head).
    pub weights: u64,
    /// Activations at the worst moment of a batch (a target layer; a drafter chunk).
    pub activations: u64,
    /// Attention's working set: score tiles (target) or a chunk's scores (drafter).
    pub attention: u64,
    /// Features: the target's kept hidden states and their copy out; the drafter's batch in.
    pub features: u64,
    /// Gradients and AdamW's two moments (drafter).
    pub optimiser: u64,
    /// The sum: the worker's peak on its device.
    pub total: u64,
}

impl WorkerPlan {
    fn sum(mut self) -> Self {
        self.total = [
            self.activations,
            self.attention,
            self.features,
            self.optimiser,
        ]
        .into_iter()
        .fold(self.weights, u64::saturating_add);
        self
    }
}

/// Shapes the plan needs, as f64: the arithmetic of a plan never overflows whatever a
/// `config.json` says (a product past f64's range is infinite and saturates to `u64::MAX` bytes),
/// and it is exact below 2^53 bytes.
struct Shape {
    hidden: f64,
    inter: f64,
    heads: f64,
    kv_heads: f64,
    head_dim: f64,
    vocab: f64,
}

impl Shape {
    fn of(t: &Qwen3Config) -> Self {
        Self {
            hidden: t.hidden_size as f64,
            inter: t.intermediate_size as f64,
            heads: t.num_attention_heads as f64,
            kv_heads: t.num_key_value_heads as f64,
            head_dim: t.head_dim() as f64,
            vocab: t.vocab_size as f64,
        }
    }

    /// Elements of one decoder layer's weights.
    fn layer_params(&self) -> f64 {
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        h * q + 2.0 * h * kv + q * h + 3.0 * h * self.inter + 2.0 * h + 2.0 * self.head_dim
    }
}

/// Bytes from an f64 count (saturating).
fn bytes(x: f64) -> u64 {
    x as u64
}

/// A target worker at `budget` tokens per batch, sequences of at most `max_len`.
pub fn target_worker(
    target: &Qwen3Config,
    s: &DflashSettings,
    budget: u64,
    max_len: u64,
) -> WorkerPlan {
    let sh = Shape::of(target);
    let e = s.dtype.bytes() as f64;
    let (budget, max_len) = (budget as f64, max_len as f64);
    let layers = s.target_layers_needed(target.num_hidden_layers) as f64;
    let kept = (s.feature_width(target) / target.hidden_size.max(1) as u64) as f64;
    let tile = 512.0;
    let (q, kv) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    // A layer's peak is at its MLP or at its attention, whichever holds more.
    let per_token = TARGET_HIDDEN_COPIES * sh.hidden
        + (TARGET_MLP_COPIES * sh.inter).max(TARGET_QUERY_COPIES * q + 2.0 * kv);
    // The features: the hidden states kept, their concatenation, and its copy in the features'
    // dtype when that differs.
    let conversion = if s.feature_dtype == s.dtype {
        0.0
    } else {
        s.feature_dtype.bytes() as f64
    };
    WorkerPlan {
        role: "target",
        engine: Engine::Candle.name(),
        weights: bytes((sh.vocab * sh.hidden + layers * sh.layer_params() + sh.hidden) * e),
        activations: bytes(budget * per_token * e),
        // The score tiles, and one sequence's queries, keys, values and output in f32.
        attention: bytes(
            TILE_COPIES * sh.heads * tile * tile * 4.0 + max_len * (2.0 * q + 2.0 * kv) * 4.0,
        ),
        features: bytes(budget * kept * sh.hidden * (2.0 * e + conversion)),
        optimiser: 0,
        total: 0,
    }
    .sum()
}

/// Bytes of one chunk of `chunk` anchors' activations in the drafter, with `context` positions
/// seen (the worst case: the sequence's full length): (attention scores, the rest).
pub fn drafter_chunk_bytes(
    target: &Qwen3Config,
    s: &DflashSettings,
    chunk: u64,
    context: u64,
) -> (u64, u64) {
    let (scores, other) = chunk_bytes(target, s, chunk as f64, context as f64);
    (bytes(scores), bytes(other))
}

fn chunk_bytes(target: &Qwen3Config, s: &DflashSettings, chunk: f64, context: f64) -> (f64, f64) {
    let sh = Shape::of(target);
    let e = s.dtype.bytes() as f64;
    let block = s.block_size as f64;
    let tokens = chunk * block;
    let layers = s.draft_layers as f64;
    let scores = layers * SCORE_COPIES * tokens * sh.heads * (context + block) * 4.0;
    let other = layers
        * tokens
        * (DRAFTER_HIDDEN_COPIES * sh.hidden * e + DRAFTER_MLP_COPIES * sh.inter * e)
        + logit_copies(s) * tokens * sh.vocab * 4.0;
    (scores, other)
}

/// Copies of a chunk's `[tokens, vocab]` f32 logits: the drafter's and, when the loss distils,
/// the target's distribution (its logits and their softmax).
fn logit_copies(s: &DflashSettings) -> f64 {
    LOGIT_COPIES + if s.distill().is_some() { 2.0 } else { 0.0 }
}

/// Where a drafter computes, as `--anchor-chunk auto` sizes its chunk.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ChunkDevice {
    Cpu,
    /// A GPU, with its memory in bytes where NVML or `--gpu-memory` tells it.
    Gpu(Option<u64>),
}

/// The anchor chunk `--anchor-chunk auto` picks for micro-batches of at most `budget` tokens in
/// sequences of at most `max_len`:
/// - the torch drafter on a GPU of known memory: the most anchors whose whole plan
///   ([`torch_drafter_worker`], its CUDA context included) fills at most [`GPU_FILL`] of it, so
///   chunks come only where memory demands them (at the seeds' settings an H200 runs an
///   8,192-token micro-batch's 3,072 anchors in one pass); a chunk may hold several sequences;
/// - otherwise as many anchors as keep one chunk's activations within [`GPU_CHUNK_BYTES`] (or
///   [`CPU_CHUNK_BYTES`]): on a GPU a chunk may pack sequences, on a CPU (and for candle) it
///   stays within one.
///
/// `None` when every sequence's anchors fit at once (candle, and torch on a CPU).
pub fn auto_anchor_chunk(
    target: &Qwen3Config,
    s: &DflashSettings,
    max_len: u32,
    budget: u64,
    device: ChunkDevice,
) -> Option<usize> {
    let limit = match device {
        ChunkDevice::Gpu(_) => GPU_CHUNK_BYTES,
        ChunkDevice::Cpu => CPU_CHUNK_BYTES,
    } as f64;
    match s.engines.drafter {
        Engine::Candle => {
            let (scores, other) = chunk_bytes(target, s, 1.0, f64::from(max_len));
            let chunk = (limit / (scores + other).max(1.0)).max(1.0) as usize;
            (chunk < s.num_anchors).then_some(chunk)
        }
        // Not linear in the chunk (its keys span the sequences it holds, its loss's logits are
        // capped at TORCH_LOSS_ROWS): the most anchors that fit, by bisection. On a CPU SDPA
        // computes every (query, key) of its dense mask, masked or not: a chunk of several
        // sequences would attend across all of them, so it stays within one sequence (`None`:
        // a sequence's anchors at once).
        Engine::Torch if device == ChunkDevice::Cpu => {
            let mut within = |n: usize| {
                let (a, b) = torch_chunk_bytes(target, s, n as f64, f64::from(max_len), false);
                a + b <= limit
            };
            let chunk = most_that(s.num_anchors.max(1), &mut within);
            (chunk < s.num_anchors).then_some(chunk)
        }
        // Flex, on a GPU, skips the masked tiles: a chunk may pack sequences, up to one anchor
        // per token of the micro-batch.
        Engine::Torch => {
            let most = usize::try_from(budget)
                .unwrap_or(usize::MAX)
                .max(s.num_anchors)
                .max(1);
            if let ChunkDevice::Gpu(Some(memory)) = device {
                let mut sized = s.clone();
                let mut fills = |n: usize| {
                    sized.anchor_chunk = Some(n);
                    let plan =
                        torch_drafter_worker(target, &sized, budget, u64::from(max_len), true);
                    plan.total.saturating_add(TORCH_CUDA_CONTEXT) as f64 <= memory as f64 * GPU_FILL
                };
                // Where not even one anchor fits, the launch refuses the run, naming the GPU.
                if fills(1) {
                    return Some(most_that(most, &mut fills));
                }
            }
            let mut within = |n: usize| {
                let context = chunk_context(s, n as f64, budget as f64, f64::from(max_len));
                let (a, b) = torch_chunk_bytes(target, s, n as f64, context, true);
                a + b <= limit
            };
            Some(most_that(most, &mut within))
        }
    }
}

/// The context positions a torch chunk of `chunk` anchors sees: the sequences it holds (whole
/// ones, `--num-anchors` anchors each at most), at most the micro-batch's `budget`.
fn chunk_context(s: &DflashSettings, chunk: f64, budget: f64, max_len: f64) -> f64 {
    let sequences = (chunk / s.num_anchors.max(1) as f64).ceil().max(1.0);
    (sequences * max_len).min(budget.max(max_len))
}

/// The largest `n` in `1..=most` for which `fits(n)` holds, `fits` being monotone (1 when none).
fn most_that(most: usize, fits: &mut impl FnMut(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (1usize, most.max(1));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// The drafter worker, with batches of at most `budget` tokens and sequences of at most
/// `max_len`.
pub fn drafter_worker(
    target: &Qwen3Config,
    s: &DflashSettings,
    budget: u64,
    max_len: u64,
) -> WorkerPlan {
    let sh = Shape::of(target);
    let e = s.dtype.bytes() as f64;
    let fe = s.feature_dtype.bytes() as f64;
    let (budget, max_len) = (budget as f64, max_len as f64);
    let n = s.target_layer_ids.len() as f64;
    let width = s.feature_width(target) as f64;
    let layers = s.draft_layers as f64;
    let params = sh.hidden * n * sh.hidden + sh.hidden * 2.0 + layers * sh.layer_params();
    let heads_matrices = if target.tie_word_embeddings { 1.0 } else { 2.0 };
    let compute_copy = if s.dtype.bytes() == 4 {
        0.0
    } else {
        params * e
    };
    let chunk = s.anchor_chunk.unwrap_or(s.num_anchors).min(s.num_anchors) as f64;
    let (scores, other) = chunk_bytes(target, s, chunk, max_len);
    // The sequence's context: fc's output and its norm, and per layer its keys and values.
    let context = max_len * (6.0 * sh.hidden * e + layers * 8.0 * sh.kv_heads * sh.head_dim * e);
    WorkerPlan {
        role: "drafter",
        engine: Engine::Candle.name(),
        weights: bytes(params * 4.0 + compute_copy + heads_matrices * sh.vocab * sh.hidden * e),
        activations: bytes(other + context),
        attention: bytes(scores),
        // The batch's features out of the ring, and one sequence's in the compute dtype.
        features: bytes(budget * width * fe + max_len * width * e),
        // Accumulated gradients, one chunk's gradients, AdamW's two moments.
        optimiser: bytes(4.0 * params * 4.0),
        total: 0,
    }
    .sum()
}

/// A torch target worker's Python side at `budget` tokens per batch: the whole model as
/// `transformers` loads it (`params` elements, from the weight files' headers; by arithmetic of a
/// dense model when they could not be read), one decoder layer's activations for a budget's rows
/// (rows of one length run together, at most a budget of tokens at a time), and the kept hidden
/// states with their concatenation. SDPA's fused kernels keep no `[s, s]` scores; the attention
/// column is its keys and values as the kernel reads them.
pub fn torch_target_worker(
    target: &Qwen3Config,
    s: &DflashSettings,
    budget: u64,
    params: Option<u64>,
) -> WorkerPlan {
    let sh = Shape::of(target);
    let e = s.dtype.bytes() as f64;
    let budget = budget as f64;
    let kept = (s.feature_width(target) / target.hidden_size.max(1) as u64) as f64;
    let heads = if target.tie_word_embeddings { 1.0 } else { 2.0 };
    let params = params.map_or_else(
        || {
            target.num_hidden_layers as f64 * sh.layer_params()
                + heads * sh.vocab * sh.hidden
                + sh.hidden
        },
        |p| p as f64,
    );
    let q = sh.heads * sh.head_dim;
    let per_token = TORCH_TARGET_HIDDEN_COPIES * sh.hidden
        + (TORCH_TARGET_MLP_COPIES * sh.inter).max(TORCH_TARGET_QUERY_COPIES * q);
    let conversion = if s.feature_dtype == s.dtype {
        0.0
    } else {
        s.feature_dtype.bytes() as f64
    };
    WorkerPlan {
        role: "target",
        engine: Engine::Torch.name(),
        weights: bytes(params * e),
        activations: bytes(budget * per_token * e),
        attention: bytes(budget * 2.0 * q * e),
        features: bytes(budget * kept * sh.hidden * (2.0 * e + conversion)),
        optimiser: 0,
        total: 0,
    }
    .sum()
}

/// A torch drafter worker's Python side, with micro-batches of at most `budget` tokens and
/// sequences of at most `max_len`: the f32 masters, the target's embedding and `lm_head`, the
/// gradients and AdamW's moments; the micro-batch's context kept for its one backward pass; one
/// anchor chunk's blocks, their block mask and keys (SDPA's fused kernel keeps no scores), and
/// one piece of the loss's logits.
pub fn torch_drafter_worker(
    target: &Qwen3Config,
    s: &DflashSettings,
    budget: u64,
    max_len: u64,
    flex: bool,
) -> WorkerPlan {
    let sh = Shape::of(target);
    let e = s.dtype.bytes() as f64;
    let fe = s.feature_dtype.bytes() as f64;
    let (budget, max_len) = (budget as f64, max_len as f64);
    let n = s.target_layer_ids.len() as f64;
    let width = s.feature_width(target) as f64;
    let layers = s.draft_layers as f64;
    let kv = sh.kv_heads * sh.head_dim;
    let (conv, selector) = dflash2_params(target, s);
    let params = sh.hidden * n * sh.hidden + sh.hidden * 2.0 + layers * sh.layer_params() + conv;
    let heads_matrices = if target.tie_word_embeddings { 1.0 } else { 2.0 };
    // The compute-dtype working copies of the weights, made once per optimiser step, and their
    // gradients until they are added into the f32 masters' at the micro-batch's end.
    let compute_copy = if s.dtype.bytes() == 4 {
        0.0
    } else {
        2.0 * params * e
    };
    // A chunk of more anchors than one sequence has holds several sequences, whose contexts
    // its blocks' keys span (at most the micro-batch's tokens).
    let chunk = s.anchor_chunk.unwrap_or(s.num_anchors) as f64;
    let (attention, blocks) = torch_chunk_bytes(
        target,
        s,
        chunk,
        chunk_context(s, chunk, budget, max_len),
        flex,
    );
    let conversion = if s.feature_dtype == s.dtype { 0.0 } else { e };
    let context = budget
        * (width * conversion
            + e * (TORCH_CONTEXT_HIDDEN_COPIES * sh.hidden)
            + layers * TORCH_CONTEXT_KV_COPIES * kv * e);
    WorkerPlan {
        role: "drafter",
        engine: Engine::Torch.name(),
        weights: bytes(
            (params + selector) * 4.0 + compute_copy + heads_matrices * sh.vocab * sh.hidden * e,
        ),
        activations: bytes(context + blocks),
        attention: bytes(attention),
        // The micro-batch's features on the device (on a CPU, a view of the mapped ring).
        features: bytes(budget * width * fe),
        // Gradients and AdamW's two moments.
        optimiser: bytes(3.0 * (params + selector) * 4.0),
        total: 0,
    }
    .sum()
}

/// Bytes of one chunk of `chunk` anchors in the torch drafter, with `context` positions seen:
/// (attention: the block mask, and per layer the keys and values the blocks attend to; the rest:
/// the blocks' activations and one piece of the loss's logits). With `flex` (a GPU) the mask is
/// a `BlockMask`, four int32 tables of 128 x 128 tiles; elsewhere SDPA's dense mask, bool and
/// as the kernel's bias in the compute dtype.
fn torch_chunk_bytes(
    target: &Qwen3Config,
    s: &DflashSettings,
    chunk: f64,
    context: f64,
    flex: bool,
) -> (f64, f64) {
    let sh = Shape::of(target);
    let e = s.dtype.bytes() as f64;
    let layers = s.draft_layers as f64;
    let tokens = chunk * s.block_size as f64;
    let keys = context + tokens;
    let kv = sh.kv_heads * sh.head_dim;
    let mask = if flex {
        4.0 * 4.0 * (tokens / 128.0).ceil() * (keys / 128.0).ceil()
    } else {
        tokens * keys * (1.0 + e)
    };
    let attention = mask + layers * 2.0 * keys * kv * e;
    let rows = tokens.min(TORCH_LOSS_ROWS);
    let mut blocks = layers
        * tokens
        * (TORCH_DRAFTER_HIDDEN_COPIES * sh.hidden * e + TORCH_DRAFTER_MLP_COPIES * sh.inter * e)
        + TORCH_LOGIT_COPIES * rows * sh.vocab * 4.0;
    if s.drafter_arch == DrafterArch::Dflash2 {
        let d = &s.dflash2;
        let kernels = 2.0 * d.conv_kernel_size as f64 * sh.hidden / d.conv_group_size.max(1) as f64;
        // Two convolutions per layer, and the selector over one piece of the loss's rows.
        blocks += layers
            * tokens
            * 2.0
            * (DFLASH2_CONV_HIDDEN_COPIES * sh.hidden + DFLASH2_KERNEL_COPIES * kernels)
            * e
            + DFLASH2_SELECTOR_COPIES
                * rows
                * d.selector_top_k as f64
                * d.selector_rank as f64
                * 4.0;
    }
    (attention, blocks)
}

/// The process of `--eval-every` (as `eval` runs it), decoding prompts of up to `context` tokens
/// with their new ones: every layer of the target and its embedding and output head, the
/// drafter (f32 masters), the KV caches of both, and a prefill's activations at `context`
/// tokens; on `engine` (the target's), whose torch side loads `target_params` elements.
pub fn eval_worker(
    target: &Qwen3Config,
    s: &DflashSettings,
    context: u64,
    engine: Engine,
    target_params: Option<u64>,
) -> WorkerPlan {
    let sh = Shape::of(target);
    let e = s.dtype.bytes() as f64;
    let layers = target.num_hidden_layers as f64;
    let n = s.target_layer_ids.len() as f64;
    let (conv, selector) = dflash2_params(target, s);
    let draft_params = sh.hidden * n * sh.hidden
        + sh.hidden * 2.0
        + s.draft_layers as f64 * sh.layer_params()
        + conv
        + selector;
    let (target_params, prefill) = match engine {
        Engine::Candle => (
            layers * sh.layer_params() + sh.vocab * sh.hidden + sh.hidden,
            target_worker(target, s, context, context),
        ),
        Engine::Torch => {
            let t = torch_target_worker(target, s, context, target_params);
            (t.weights as f64 / s.dtype.bytes() as f64, t)
        }
    };
    // The model's embedding, then the embedding and output head the drafter borrows.
    let heads = 2.0 * sh.vocab * sh.hidden;
    let kv = sh.kv_heads * sh.head_dim;
    let context_f = context as f64;
    WorkerPlan {
        role: "eval",
        engine: engine.name(),
        weights: bytes((target_params + heads) * e + draft_params * 4.0),
        activations: prefill.activations,
        attention: prefill.attention,
        // The KV caches: the target's every layer, the drafter's context per layer.
        features: bytes(context_f * 2.0 * kv * e * (layers + s.draft_layers as f64)),
        optimiser: 0,
        total: 0,
    }
    .sum()
}

/// The plan of a run: every worker, the rings, and what does not fit.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryPlan {
    pub target: WorkerPlan,
    pub drafter: WorkerPlan,
    /// The `--eval-every` process, on the first GPU (or the CPU) beside the workers.
    pub eval: Option<WorkerPlan>,
    /// The same figures as a CPU worker's peak resident memory: the device figures plus the
    /// process's baseline and the shared ring pages the worker touches.
    pub target_host: u64,
    pub drafter_host: u64,
    /// Bytes of `/dev/shm` for the rings.
    pub shm_bytes: u64,
    pub anchor_chunk: Option<usize>,
}

/// The plan, with rings of `shm_bytes` in all, `feature_ring` of them the feature ring and
/// `input_ring` the input ring, for workers on `engines`; `target_params`: the elements of the
/// target's weight files (what a torch target loads), where they could be read; `gpu`: the
/// drafter computes on a GPU (flex attention for the torch drafter).
#[allow(clippy::too_many_arguments)]
pub fn plan(
    target: &Qwen3Config,
    s: &DflashSettings,
    engines: Engines,
    gpu: bool,
    target_params: Option<u64>,
    budget: u64,
    max_len: u64,
    shm_bytes: u64,
    feature_ring: u64,
    input_ring: u64,
) -> MemoryPlan {
    let t = match engines.target {
        Engine::Candle => target_worker(target, s, budget, max_len),
        Engine::Torch => torch_target_worker(target, s, budget, target_params),
    };
    let d = match engines.drafter {
        Engine::Candle => drafter_worker(target, s, budget, max_len),
        Engine::Torch => torch_drafter_worker(target, s, budget, max_len, gpu),
    };
    // On a CPU the ring pages a worker writes or reads count in its resident memory: over a run
    // a target writes into any of the feature slots, the drafter reads them all, and a target
    // reads its input slots. A torch worker adds its Python side's own (the monitor counts a
    // worker with its children).
    let runtime = |w: &WorkerPlan| {
        if w.engine == Engine::Torch.name() {
            TORCH_RUNTIME
        } else {
            0
        }
    };
    MemoryPlan {
        target_host: [BASELINE, runtime(&t), feature_ring, input_ring]
            .into_iter()
            .fold(t.total, u64::saturating_add),
        drafter_host: [BASELINE, runtime(&d), feature_ring]
            .into_iter()
            .fold(d.total, u64::saturating_add),
        target: t,
        drafter: d,
        eval: None,
        shm_bytes,
        anchor_chunk: s.anchor_chunk,
    }
}

/// The elements of every tensor in the weight files of `dir` (any dtype; a packed type counts
/// its stored elements), from the files' headers; `None` when a file cannot be read.
pub fn weight_elements(dir: &std::path::Path) -> Option<u64> {
    let mut total = 0u64;
    for file in dflash_common::dflash::weight_files(dir).ok()? {
        let header = crate::model_dir::header_bytes(&file).ok()?;
        let table: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&header[8..]).ok()?;
        for (name, entry) in &table {
            if name == "__metadata__" {
                continue;
            }
            let shape = entry.get("shape")?.as_array()?;
            let n = shape
                .iter()
                .try_fold(1u64, |n, d| n.checked_mul(d.as_u64()?))?;
            total = total.checked_add(n)?;
        }
    }
    Some(total)
}

/// What a GPU worker's CUDA context and allocator keep besides its tensors.
pub const CUDA_CONTEXT: u64 = 768 << 20;
/// The same for a torch worker: its CUDA context, cuBLAS's workspace and the caching
/// allocator's unused blocks.
pub const TORCH_CUDA_CONTEXT: u64 = 1536 << 20;

/// What a GPU worker on `engine` keeps besides the tensors of its plan.
fn cuda_context(engine: &str) -> u64 {
    if engine == Engine::Torch.name() {
        TORCH_CUDA_CONTEXT
    } else {
        CUDA_CONTEXT
    }
}

/// One GPU's share of the run: its workers and their summed peaks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuUse {
    pub gpu: u32,
    /// `target` or `drafter`, one per worker on this GPU.
    pub workers: Vec<&'static str>,
    /// The workers' peaks plus a CUDA context each.
    pub need: u64,
    /// The GPU's memory (NVML, or `--gpu-memory`); `None`: unknown.
    pub total: Option<u64>,
}

/// Per GPU of `devices` (workers `0..targets` are targets, the rest drafters): the memory its
/// workers need and what it has (`total_of`).
pub fn gpu_uses(
    plan: &MemoryPlan,
    devices: &[super::spec::Device],
    targets: u32,
    total_of: impl Fn(u32) -> Option<u64>,
) -> Vec<GpuUse> {
    let mut uses: Vec<GpuUse> = Vec::new();
    for (i, device) in devices.iter().enumerate() {
        let super::spec::Device::Gpu(gpu) = *device else {
            continue;
        };
        let worker = if (i as u32) < targets {
            &plan.target
        } else {
            &plan.drafter
        };
        let (role, need) = (worker.role, worker.total);
        let at = match uses.iter().position(|u| u.gpu == gpu) {
            Some(at) => at,
            None => {
                uses.push(GpuUse {
                    gpu,
                    workers: Vec::new(),
                    need: 0,
                    total: total_of(gpu),
                });
                uses.len() - 1
            }
        };
        uses[at].workers.push(role);
        uses[at].need = uses[at]
            .need
            .saturating_add(need.saturating_add(cuda_context(worker.engine)));
    }
    // The evaluations run on the first GPU, beside its workers.
    if let (Some(e), Some(first)) = (&plan.eval, uses.first_mut()) {
        first.workers.push("eval");
        first.need = first
            .need
            .saturating_add(e.total.saturating_add(cuda_context(e.engine)));
    }
    uses
}

/// Why the GPUs cannot hold the run, naming the options that would make it fit; `None` when
/// every GPU whose memory is known holds its workers.
pub fn refusal(uses: &[GpuUse]) -> Option<String> {
    let over: Vec<String> = uses
        .iter()
        .filter_map(|u| {
            let total = u.total?;
            (u.need > total).then(|| {
                format!(
                    "GPU {} ({}) needs {} of its {}",
                    u.gpu,
                    u.workers.join(" + "),
                    gib(u.need),
                    gib(total)
                )
            })
        })
        .collect();
    if over.is_empty() {
        return None;
    }
    let drafter = uses
        .iter()
        .any(|u| u.total.is_some_and(|t| u.need > t) && u.workers.contains(&"drafter"));
    let target = uses
        .iter()
        .any(|u| u.total.is_some_and(|t| u.need > t) && u.workers.contains(&"target"));
    let mut options = Vec::new();
    if target {
        options.push("a lower --token-budget");
    }
    if drafter {
        options.push("a lower --anchor-chunk or --num-anchors");
    }
    options.push("--dtype bf16 --feature-dtype bf16");
    if uses.iter().any(|u| u.workers.len() > 1) {
        options.push("one GPU per worker in --gpus");
    }
    Some(format!(
        "the run does not fit the GPUs' memory: {} (see `launch --dry-run`; try {})",
        over.join("; "),
        options.join(", or ")
    ))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn qwen3_8b() -> Qwen3Config {
        serde_json::from_value(serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": false
        }))
        .unwrap()
    }

    pub(crate) fn settings(budget: u64) -> DflashSettings {
        serde_json::from_value(serde_json::json!({
            "target_model": "/m", "target_layer_ids": [1, 9, 17, 25, 33], "draft_layers": 5,
            "block_size": 16, "num_anchors": 512, "mask_token_id": 151669, "lr": 6e-4,
            "warmup_ratio": 0.04, "clip": 1.0, "gamma": 7.0, "weight_decay": 0.01, "seed": 0,
            "save_every": 100, "keep_checkpoints": 3, "total_steps": 10, "token_budget": budget,
            "checkpoint_dir": "/c", "dtype": "bf16", "feature_dtype": "bf16"
        }))
        .unwrap()
    }

    /// Doubling the budget never more than doubles a worker's batch-dependent memory: every
    /// term is linear in tokens.
    #[test]
    fn memory_is_linear_in_the_tokens_of_a_batch() {
        let t = qwen3_8b();
        let s = settings(49_152);
        for budget in [8_192u64, 16_384, 32_768] {
            let one = target_worker(&t, &s, budget, 8_192);
            let two = target_worker(&t, &s, 2 * budget, 8_192);
            let grow = |a: &WorkerPlan, b: &WorkerPlan| {
                (b.total - b.weights - b.attention) as f64
                    / (a.total - a.weights - a.attention) as f64
            };
            assert!((grow(&one, &two) - 2.0).abs() < 1e-9);
            let d1 = drafter_worker(&t, &s, budget, 8_192);
            let d2 = drafter_worker(&t, &s, 2 * budget, 8_192);
            assert!(d2.features > d1.features && d2.total - d1.total == d2.features - d1.features);
        }
    }

    /// The published model at the seeds' settings fits an 80 GB GPU per worker in bf16 with
    /// the automatic chunk, and the chunk bounds the drafter's scores.
    #[test]
    fn the_seeds_settings_fit_with_the_automatic_chunk() {
        let t = qwen3_8b();
        let mut s = settings(49_152);
        s.anchor_chunk = auto_anchor_chunk(&t, &s, 8_192, 49_152, ChunkDevice::Gpu(None));
        let chunk = s
            .anchor_chunk
            .expect("512 anchors of 8,192 tokens need chunks");
        assert!((1..512).contains(&chunk), "{chunk}");
        let (scores, other) = drafter_chunk_bytes(&t, &s, chunk as u64, 8_192);
        assert!(scores + other <= GPU_CHUNK_BYTES);
        // A config.json with absurd sizes plans without overflowing.
        let mut huge = t.clone();
        huge.hidden_size = usize::MAX / 2;
        huge.vocab_size = usize::MAX / 3;
        huge.intermediate_size = usize::MAX;
        assert_eq!(target_worker(&huge, &s, u64::MAX, u64::MAX).total, u64::MAX);
        assert_eq!(
            drafter_worker(&huge, &s, u64::MAX, u64::MAX).total,
            u64::MAX
        );
        assert_eq!(
            auto_anchor_chunk(&huge, &s, u32::MAX, 49_152, ChunkDevice::Gpu(None)),
            Some(1)
        );
        let d = drafter_worker(&t, &s, 49_152, 8_192);
        let tw = target_worker(&t, &s, 49_152, 8_192);
        assert!(tw.total < 80 << 30, "{}", gib(tw.total));
        assert!(d.total < 80 << 30, "{}", gib(d.total));
        // Unchunked, the drafter would not fit.
        s.anchor_chunk = None;
        assert!(drafter_worker(&t, &s, 49_152, 8_192).total > 141 << 30);
    }

    /// A DFlash2 drafter at Qwen3-8B's shape and the published sizes (kernel 2, group 16, top-K
    /// 16, rank 256): its codebooks (2 × 151,936 × 256) and hidden projection (256 × 4,096), and
    /// per layer two convolutions of a base kernel (2 × 2 × 4,096) and a kernel projection
    /// (2 × 2 × 256 × 4,096), as f32 masters, gradients and moments, the convolutions also as
    /// bf16 working copies with their gradients; its chunk holds the convolutions' activations and the selector's gathered codes, so
    /// `auto` picks a chunk no larger; and it still fits an H200.
    #[test]
    fn a_dflash2_drafter_plans_its_convolutions_and_selector() {
        let t = qwen3_8b();
        let mut s = settings(49_152);
        s.engines = Engines::both(Engine::Torch);
        let mut two = s.clone();
        two.drafter_arch = DrafterArch::Dflash2;
        let selector = 2.0 * 151_936.0 * 256.0 + 256.0 * 4_096.0;
        let conv = s.draft_layers as f64 * 2.0 * (2.0 * 2.0 * 4_096.0 + 4.0 * 256.0 * 4_096.0);
        let (d1, d2) = (
            torch_drafter_worker(&t, &s, 49_152, 8_192, true),
            torch_drafter_worker(&t, &two, 49_152, 8_192, true),
        );
        // f32 masters, and the bf16 working copies and their gradients.
        assert_eq!(
            d2.weights - d1.weights,
            ((conv + selector) * 4.0 + conv * 2.0 * 2.0) as u64
        );
        assert_eq!(
            d2.optimiser - d1.optimiser,
            (12.0 * (conv + selector)) as u64
        );
        let chunk = 64.0;
        let ((a1, b1), (a2, b2)) = (
            torch_chunk_bytes(&t, &s, chunk, 8_192.0, true),
            torch_chunk_bytes(&t, &two, chunk, 8_192.0, true),
        );
        assert_eq!(a1, a2, "the attention is a DFlash layer's");
        let tokens = chunk * 16.0;
        let want = s.draft_layers as f64 * tokens * 2.0 * (8.0 * 4_096.0 + 3.0 * 4.0 * 256.0) * 2.0
            + 3.0 * tokens * 16.0 * 256.0 * 4.0;
        assert!((b2 - b1 - want).abs() < 1.0, "{} vs {want}", b2 - b1);
        let (c1, c2) = (
            auto_anchor_chunk(&t, &s, 8_192, 49_152, ChunkDevice::Gpu(None)).unwrap(),
            auto_anchor_chunk(&t, &two, 8_192, 49_152, ChunkDevice::Gpu(None)).unwrap(),
        );
        assert!(c2 <= c1, "{c2} > {c1}");
        two.anchor_chunk = Some(c2);
        let p = plan(&t, &two, two.engines, true, None, 49_152, 8_192, 0, 0, 0);
        assert!(
            p.drafter.total + TORCH_CUDA_CONTEXT < 141 << 30,
            "{}",
            gib(p.drafter.total)
        );
        // The eval process holds the selector and convolutions too.
        let (e1, e2) = (
            eval_worker(&t, &s, 4_096, Engine::Torch, None),
            eval_worker(&t, &two, 4_096, Engine::Torch, None),
        );
        assert_eq!(e2.weights - e1.weights, ((conv + selector) * 4.0) as u64);
    }

    /// The torch workers' plans: linear in a batch's tokens; at the seeds' settings on Qwen3-8B
    /// each fits an H200 with the chunk `auto` picks for the torch drafter; the torch target
    /// holds the whole model (its weight files' elements when known).
    #[test]
    fn the_torch_plans_are_linear_and_fit_at_the_seeds_settings() {
        let t = qwen3_8b();
        let mut s = settings(49_152);
        s.engines = Engines::both(Engine::Torch);
        for budget in [8_192u64, 16_384, 32_768] {
            let one = torch_target_worker(&t, &s, budget, None);
            let two = torch_target_worker(&t, &s, 2 * budget, None);
            assert_eq!(one.weights, two.weights);
            let grow = (two.total - two.weights) as f64 / (one.total - one.weights) as f64;
            assert!((grow - 2.0).abs() < 1e-9, "{grow}");
            let d1 = torch_drafter_worker(&t, &s, budget, 8_192, true);
            let d2 = torch_drafter_worker(&t, &s, 2 * budget, 8_192, true);
            // Only the micro-batch's context and features grow with the budget.
            let per_token = (d2.total - d1.total) as f64 / budget as f64;
            let d4 = torch_drafter_worker(&t, &s, 4 * budget, 8_192, true);
            assert!(((d4.total - d2.total) as f64 / (2 * budget) as f64 - per_token).abs() < 1.0);
        }
        let chunk = auto_anchor_chunk(&t, &s, 8_192, 49_152, ChunkDevice::Gpu(None))
            .expect("512 anchors need chunks");
        // Torch keeps no scores: its chunk is larger than candle's.
        let mut candle = s.clone();
        candle.engines = Engines::both(Engine::Candle);
        assert!(
            chunk > auto_anchor_chunk(&t, &candle, 8_192, 49_152, ChunkDevice::Gpu(None)).unwrap()
        );
        let (a, b) = torch_chunk_bytes(&t, &s, chunk as f64, 8_192.0, true);
        assert!(a + b <= GPU_CHUNK_BYTES as f64);
        let (a, b) = torch_chunk_bytes(&t, &s, chunk as f64 + 1.0, 8_192.0, true);
        assert!(a + b > GPU_CHUNK_BYTES as f64);
        s.anchor_chunk = Some(chunk);
        let p = plan(&t, &s, s.engines, true, None, 49_152, 8_192, 0, 0, 0);
        assert_eq!((p.target.engine, p.drafter.engine), ("torch", "torch"));
        // Qwen3-8B is 8.19 G parameters, bf16: the whole model on the target's GPU.
        let gib8 = p.target.weights as f64 / f64::from(1u32 << 30);
        assert!((15.0..15.5).contains(&gib8), "{gib8}");
        for w in [&p.target, &p.drafter] {
            assert!(w.total + TORCH_CUDA_CONTEXT < 141 << 30, "{}", gib(w.total));
        }
        // The weight files' own count wins over the arithmetic (an MoE's experts).
        let moe = plan(
            &t,
            &s,
            s.engines,
            true,
            Some(30_000_000_000),
            49_152,
            8_192,
            0,
            0,
            0,
        );
        assert_eq!(moe.target.weights, 60_000_000_000);
        // A CPU worker's resident figure adds the Python side.
        assert_eq!(p.target_host, p.target.total + BASELINE + TORCH_RUNTIME);
        // A mixed run plans each worker on its own engine.
        let mixed = Engines {
            target: Engine::Torch,
            drafter: Engine::Candle,
        };
        let m = plan(&t, &s, mixed, true, None, 49_152, 8_192, 0, 0, 0);
        assert_eq!((m.target.engine, m.drafter.engine), ("torch", "candle"));
        assert_eq!(m.drafter, drafter_worker(&t, &s, 49_152, 8_192));
    }

    /// On a GPU of known memory `auto` sizes the torch drafter's chunk from it: the most anchors
    /// whose whole plan fills at most GPU_FILL of the GPU. At the seeds' settings an H200 (141
    /// GiB) runs an 8,192-token micro-batch's 6 x 512 anchors in one pass, an 80 GiB GPU fewer
    /// at once; one anchor more would not fit. Flex keeps no dense mask: the plan on a GPU is
    /// smaller than SDPA's on a CPU. Where not even one anchor fits, a chunk aims at 12 GiB (the
    /// launch then refuses the run, naming the GPU).
    #[test]
    fn on_a_gpu_of_known_memory_the_torch_chunk_fills_it() {
        let t = qwen3_8b();
        let mut s = settings(49_152);
        s.engines = Engines::both(Engine::Torch);
        let fill = |chunk: usize, memory: u64| {
            let mut c = s.clone();
            c.anchor_chunk = Some(chunk);
            torch_drafter_worker(&t, &c, 49_152, 8_192, true).total + TORCH_CUDA_CONTEXT
                <= (memory as f64 * GPU_FILL) as u64
        };
        let mut chunks = Vec::new();
        for memory in [141u64 << 30, 80 << 30] {
            let chunk =
                auto_anchor_chunk(&t, &s, 8_192, 49_152, ChunkDevice::Gpu(Some(memory))).unwrap();
            assert!(fill(chunk, memory), "{chunk}");
            assert!(!fill(chunk + 1, memory), "{chunk}");
            chunks.push(chunk);
        }
        assert!(chunks[0] >= 6 * 512, "{chunks:?}");
        assert!((512..6 * 512).contains(&chunks[1]), "{chunks:?}");
        let unknown = auto_anchor_chunk(&t, &s, 8_192, 49_152, ChunkDevice::Gpu(None)).unwrap();
        assert!(unknown < chunks[1], "{unknown}");
        assert_eq!(
            auto_anchor_chunk(&t, &s, 8_192, 49_152, ChunkDevice::Gpu(Some(1 << 30))),
            Some(unknown)
        );
        // On a CPU (SDPA's dense mask) a chunk stays within one sequence; a small model's
        // sequence fits at once.
        let cpu = auto_anchor_chunk(&t, &s, 8_192, 49_152, ChunkDevice::Cpu).unwrap();
        assert!(cpu < 512, "{cpu}");
        let mut small = t.clone();
        (small.hidden_size, small.intermediate_size, small.vocab_size) = (64, 128, 600);
        (
            small.num_attention_heads,
            small.num_key_value_heads,
            small.head_dim,
        ) = (4, 2, Some(16));
        assert_eq!(
            auto_anchor_chunk(&small, &s, 256, 2_048, ChunkDevice::Cpu),
            None
        );
        let (flex, _) = torch_chunk_bytes(&t, &s, 1_000.0, 8_192.0, true);
        let (dense, _) = torch_chunk_bytes(&t, &s, 1_000.0, 8_192.0, false);
        // The dense mask, bool and bf16, against the BlockMask's tables (under a megabyte).
        let mask = 16_000.0 * 24_192.0 * 3.0;
        assert!((dense - flex - mask).abs() < 1e6, "{dense} {flex}");
    }

    /// The elements of a model's weight files come from their headers; a damaged file gives none.
    #[test]
    fn weight_elements_reads_the_headers_and_refuses_a_damaged_file() {
        let dir = tempfile::tempdir().unwrap();
        let header = br#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"U8","shape":[5],"data_offsets":[24,29]},"__metadata__":{"format":"pt"}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0u8; 29]);
        std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
        assert_eq!(weight_elements(dir.path()), Some(11));
        for bad in [
            &br#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#[..],
            br#"{"a":{"dtype":"F32"}}"#,
            br#"[1, 2]"#,
            br#"{"a":{"shape":[18446744073709551615,18446744073709551615]}}"#,
        ] {
            let mut bytes = (bad.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(bad);
            std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
            assert_eq!(
                weight_elements(dir.path()),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        std::fs::write(dir.path().join("model.safetensors"), b"short").unwrap();
        assert_eq!(weight_elements(dir.path()), None);
        assert_eq!(weight_elements(&dir.path().join("missing")), None);
    }
}
