//! The DFlash drafter and its training loss.
//!
//! `fc` (Linear n·H -> H) and an RMSNorm turn the target's hidden states at `target_layer_ids`
//! into context features. Each training block is an anchor token followed by `block_size - 1` mask
//! tokens at positions `anchor..anchor + block_size`, embedded with the target's frozen embedding.
//! The drafter's Qwen3-style layers take queries from the block and keys/values from
//! `[context ; block]`: a block sees the context strictly before its anchor, sees itself
//! bidirectionally, and never sees other blocks. A final RMSNorm and the target's frozen lm_head
//! give logits; block position `k >= 1` predicts token `anchor + k`, cross-entropy weighted
//! `exp(-(k - 1) / gamma)` (or 1 without gamma) over positions whose loss mask is set. With
//! distillation the target at position `anchor + k - 1` teaches position k instead (or as a
//! share): cross-entropy against the target's next-token distribution at a temperature T. Only
//! the target's side is tempered: the drafter is served untempered, so T says which
//! distribution it should match there (small for greedy serving, whose acceptance needs the
//! target's argmax; the sampling temperature for sampled serving). T -> 0 is cross-entropy
//! against the target's greedy token.
//!
//! Everything here is built from candle ops that carry gradients (the fused norm, rope and softmax
//! kernels of candle-nn do not), and the weights are initialised from our own seeded generator.

use candle_core::{D, DType, Device, Tensor, Var};
use dflash_common::dflash::{Dflash2Settings, Qwen3Shape};

use super::rotate_half;
use crate::rng::SplitMix64;
use crate::train::{Grads, add_grads, grads_of};

/// The drafter's shape (the target's widths and heads, its own layer count) and the DFlash
/// constants it is trained with.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterConfig {
    pub shape: Qwen3Shape,
    pub block_size: usize,
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    /// A DFlash2 drafter's sizes (its convolutions' and selector's tensors); none: DFlash.
    pub dflash2: Option<Dflash2Settings>,
    /// The layers' attention window (`sliding_attention`); none: full attention.
    pub sliding_window: Option<usize>,
}

impl DrafterConfig {
    /// A drafter of `layers` decoder layers for `target`: its widths, heads, norm epsilon and
    /// rotary base, reading `target_layer_ids` with blocks of `block_size`.
    pub fn for_target(
        target: &super::qwen3::Qwen3Config,
        layers: usize,
        block_size: usize,
        mask_token_id: u32,
        target_layer_ids: Vec<usize>,
    ) -> Self {
        Self {
            shape: Qwen3Shape {
                layers,
                ..target.shape()
            },
            block_size,
            mask_token_id,
            target_layer_ids,
            dflash2: None,
            sliding_window: None,
        }
    }

    /// This drafter as a run's settings make it: DFlash2's tensors, the attention window.
    pub fn with_arch(
        mut self,
        dflash2: Option<Dflash2Settings>,
        sliding_window: Option<usize>,
    ) -> Self {
        self.dflash2 = dflash2;
        self.sliding_window = sliding_window;
        self
    }
}

impl DrafterConfig {
    /// `(name, shape, is_norm)` of every weight, in a fixed order (the checkpoint's names): `fc`
    /// and `hidden_norm`, the layers, the final norm.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, bool)> {
        let h = self.shape.hidden;
        let mut shapes: Vec<(String, Vec<usize>, bool)> = vec![
            (
                "fc.weight".into(),
                vec![h, h * self.target_layer_ids.len()],
                false,
            ),
            ("hidden_norm.weight".into(), vec![h], true),
        ];
        for i in 0..self.shape.layers {
            shapes.extend(
                self.shape
                    .layer_tensors()
                    .into_iter()
                    .map(|(name, shape, norm)| (format!("layers.{i}.{name}"), shape, norm)),
            );
        }
        shapes.push(("norm.weight".into(), vec![h], true));
        if let Some(d) = &self.dflash2 {
            shapes.extend(dflash2_tensors(&self.shape, self.shape.layers, d));
        }
        shapes
    }

    /// The initial weights of a run with `seed`, whichever engine trains them: matrices
    /// N(0, 0.02), norms 1, drawn in [`DrafterConfig::tensors`]' order. DFlash2's convolutions
    /// start as the identity (base kernels: tap 0 is 1, the others 0; kernel projections 0) and
    /// its selector as the head alone (successor codebook 0), so that an untrained DFlash2
    /// computes what the DFlash of the same draws does; the predecessor codebook and the hidden
    /// projection are drawn like matrices.
    pub fn initial_weights(&self, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut rng = SplitMix64(seed);
        self.tensors()
            .into_iter()
            .map(|(name, shape, is_norm)| {
                let n: usize = shape.iter().product();
                let values: Vec<f32> = if name.ends_with(".base_kernel") {
                    // [2 sides, taps, hidden]: tap 0 of each side is 1.
                    let (taps, h) = (shape[1], shape[2]);
                    (0..n)
                        .map(|i| if (i / h) % taps == 0 { 1.0 } else { 0.0 })
                        .collect()
                } else if name.ends_with(".kernel_projection.weight")
                    || name.ends_with(".successor_codebook")
                {
                    vec![0.0; n]
                } else if is_norm {
                    vec![1.0; n]
                } else {
                    (0..n).map(|_| (0.02 * rng.normal()) as f32).collect()
                };
                (name, shape, values)
            })
            .collect()
    }
}

/// DFlash2's own tensors, named as the official `DFlash2DraftModel` checkpoints store them
/// (`is_norm` false): per layer, the attention's and the MLP's convolution (`base_kernel`
/// `[2, taps, hidden]`, the sides before and after the sublayer; `kernel_projection.weight`
/// `[2 · taps · hidden / group, hidden]`); then the selector's hidden projection `[rank, hidden]`
/// and its predecessor and successor codebooks `[vocab, rank]` (without `.weight`).
pub fn dflash2_tensors(
    shape: &Qwen3Shape,
    layers: usize,
    d: &Dflash2Settings,
) -> Vec<(String, Vec<usize>, bool)> {
    let (h, taps) = (shape.hidden, d.conv_kernel_size);
    let groups = h / d.conv_group_size.max(1);
    let mut out = Vec::new();
    for i in 0..layers {
        for conv in ["attention_conv", "mlp_conv"] {
            out.push((
                format!("layers.{i}.{conv}.base_kernel"),
                vec![2, taps, h],
                false,
            ));
            out.push((
                format!("layers.{i}.{conv}.kernel_projection.weight"),
                vec![2 * taps * groups, h],
                false,
            ));
        }
    }
    let (rank, vocab) = (d.selector_rank, shape.vocab);
    out.push((
        "candidate_selector.hidden_projection.weight".into(),
        vec![rank, h],
        false,
    ));
    out.push((
        "candidate_selector.predecessor_codebook".into(),
        vec![vocab, rank],
        false,
    ));
    out.push((
        "candidate_selector.successor_codebook".into(),
        vec![vocab, rank],
        false,
    ));
    out
}

/// One sequence's loss before averaging.
pub struct LossParts {
    /// Weighted sum of the cross-entropies (a scalar with gradients).
    pub sum: Tensor,
    /// Sum of the weights.
    pub weight: f64,
    /// Per block position: (correct, counted) predictions.
    pub accuracy: Vec<(u32, u32)>,
}

/// What the loss is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Objective {
    /// Decay over block positions, `exp(-(k - 1) / gamma)`; none: uniform.
    pub gamma: Option<f64>,
    /// Distillation: its share of the loss (the rest is cross-entropy on the tokens) and its
    /// temperature. The features then end with the target's last hidden state (after its final
    /// norm), `hidden` columns after the `n·hidden` of `target_layer_ids`.
    pub distill: Option<(f64, f64)>,
    /// D-PACE (`--loss dpace`) with this α: each counted position's cross-entropy is weighted by
    /// [`dflash_common::dflash::dpace_weights`] of the drafter's detached probabilities of the
    /// labels. The loss is still divided by the number of counted positions (the weights of
    /// `gamma: None`), which the stage knows before the forward pass.
    pub dpace: Option<f64>,
}

/// The target's frozen matrices the drafter shares: its embedding and its output head, each
/// `[vocab, hidden]`.
#[derive(Clone, Copy)]
pub struct Heads<'a> {
    pub embedding: &'a Tensor,
    pub lm_head: &'a Tensor,
}

/// One sequence to learn from: its tokens, its loss mask (0/1) and its block starts (`anchors`,
/// sorted, each with the loss mask set).
#[derive(Clone, Copy)]
pub struct Sequence<'a> {
    pub tokens: &'a [u32],
    pub loss_mask: &'a [u8],
    pub anchors: &'a [usize],
}

/// A trainable tensor with its checkpoint name.
pub struct Param {
    pub name: String,
    pub var: Var,
}

/// The drafter's weights (f32 masters) and the dtype its forward pass computes in.
pub struct Drafter {
    pub config: DrafterConfig,
    pub params: Vec<Param>,
    compute: DType,
}

/// RMSNorm in f32 whatever `x`'s dtype (returned in `x`'s dtype), `weight` an f32 master.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(mean + eps)?.sqrt()?)?
        .broadcast_mul(weight)?
        .to_dtype(dtype)
}

/// Softmax over the last axis. Its max is only a shift, which softmax does not depend on: taken
/// out of the graph, the gradient is the same and the backward pass skips the max's (a compare
/// and a scatter over the whole input).
fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let num = x.broadcast_sub(&max)?.exp()?;
    let den = num.sum_keepdim(D::Minus1)?;
    num.broadcast_div(&den)
}

/// Log-softmax over the last axis, its max out of the graph as in [`softmax_last`].
fn log_softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let diff = x.broadcast_sub(&max)?;
    let log_sum = diff.exp()?.sum_keepdim(D::Minus1)?.log()?;
    diff.broadcast_sub(&log_sum)
}

/// cos and sin tables for positions `[..]` (any shape), with a trailing `head_dim` axis.
fn rope_tables(
    positions: &Tensor,
    head_dim: usize,
    theta: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64) as f32)
        .collect();
    let inv = Tensor::from_vec(inv, head_dim / 2, positions.device())?;
    let angles = positions
        .to_dtype(DType::F32)?
        .unsqueeze(D::Minus1)?
        .broadcast_mul(&inv)?;
    let cos = Tensor::cat(&[&angles.cos()?, &angles.cos()?], D::Minus1)?;
    let sin = Tensor::cat(&[&angles.sin()?, &angles.sin()?], D::Minus1)?;
    Ok((cos, sin))
}

impl Drafter {
    /// Fresh weights: matrices N(0, 0.02), norms 1, from `seed` (see
    /// [`DrafterConfig::initial_weights`]).
    pub fn new(config: DrafterConfig, seed: u64, device: &Device) -> candle_core::Result<Self> {
        let params = config
            .initial_weights(seed)
            .into_iter()
            .map(|(name, shape, values)| {
                let var = Var::from_tensor(&Tensor::from_vec(values, shape, device)?)?;
                Ok(Param { name, var })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            config,
            params,
            compute: DType::F32,
        })
    }

    /// Computes the forward pass in `dtype` (bf16 on GPUs); weights stay f32 masters.
    pub fn with_compute(mut self, dtype: DType) -> Self {
        self.compute = dtype;
        self
    }

    fn get(&self, name: &str) -> &Tensor {
        self.params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("drafter parameter {name}"))
            .var
            .as_tensor()
    }

    /// The training loss of one sequence: the weighted mean cross-entropy and, per block
    /// position, (correct, counted) predictions. See [`Drafter::loss_parts`] for the arguments.
    pub fn loss(
        &self,
        features: &Tensor,
        sequence: Sequence,
        heads: Heads,
        objective: Objective,
    ) -> candle_core::Result<(Tensor, Vec<(u32, u32)>)> {
        let parts = self.loss_parts(features, sequence, heads, objective)?;
        Ok(((parts.sum / parts.weight.max(1e-9))?, parts.accuracy))
    }

    /// The parts of one sequence's loss, all anchors in one graph, so that a batch can average
    /// over all its positions.
    ///
    /// - `features`: `[seq, n·hidden]`, the target's hidden states at `target_layer_ids`,
    ///   concatenated in that order (any float dtype), then with distillation the target's last
    ///   hidden state;
    /// - `sequence`: its tokens, loss mask and anchors;
    /// - `heads`: the target's frozen matrices, in the compute dtype.
    ///
    /// Returns the weighted sum of cross-entropies, the sum of the weights, and per block
    /// position (correct, counted) predictions.
    pub fn loss_parts(
        &self,
        features: &Tensor,
        sequence: Sequence,
        heads: Heads,
        objective: Objective,
    ) -> candle_core::Result<LossParts> {
        let (features, teacher) = self.split(features, objective)?;
        let context = self.context(&features)?;
        self.blocks(&context, teacher.as_ref(), sequence, heads, objective)
    }

    /// A sequence's features for the context, and with distillation the target's last hidden
    /// states that follow them.
    fn split(
        &self,
        features: &Tensor,
        objective: Objective,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let width = self.config.target_layer_ids.len() * self.config.shape.hidden;
        if objective.distill.is_none() {
            return Ok((features.clone(), None));
        }
        Ok((
            features.narrow(1, 0, width)?.contiguous()?,
            Some(
                features
                    .narrow(1, width, self.config.shape.hidden)?
                    .contiguous()?,
            ),
        ))
    }

    /// The sum of the loss weights of one sequence's blocks (what [`LossParts::weight`] will be),
    /// computed on the host before any block, so that chunks can be scaled by the batch total.
    pub fn loss_weight(&self, sequence: Sequence, objective: Objective) -> f64 {
        let weights = block_weights(
            sequence.loss_mask,
            sequence.anchors,
            self.config.block_size,
            objective.gamma,
        );
        weight_sum(&weights)
    }

    /// A parameter in the compute dtype (a copy in bf16; the f32 master itself in f32).
    fn weight(&self, name: &str) -> candle_core::Result<Tensor> {
        self.get(name).to_dtype(self.compute)
    }

    /// The context of one sequence, per drafter layer: its keys (rotary applied) and values,
    /// `[kv_heads, seq, head_dim]` each, in the compute dtype. Computed once and shared by every
    /// block of the sequence.
    pub fn context(&self, features: &Tensor) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
        self.context_at(features, 0)
    }

    /// [`Drafter::context`] of features at positions `offset..`: each position's keys and values
    /// depend on its own features alone, so a decoder extends its context piece by piece.
    pub fn context_at(
        &self,
        features: &Tensor,
        offset: usize,
    ) -> candle_core::Result<Vec<(Tensor, Tensor)>> {
        let c = &self.config;
        let dev = features.device();
        let s = features.dim(0)?;
        let d = c.shape.head_dim;
        let ctx = features
            .to_dtype(self.compute)?
            .matmul(&self.weight("fc.weight")?.t()?)?;
        let ctx = rms_norm(&ctx, self.get("hidden_norm.weight"), c.shape.rms_eps)?;
        let positions = Tensor::arange(offset as u32, (offset + s) as u32, dev)?;
        let (cos, sin) = rope_tables(&positions, d, c.shape.rope_theta)?;
        let (cos, sin) = (
            cos.to_dtype(self.compute)?.unsqueeze(0)?,
            sin.to_dtype(self.compute)?.unsqueeze(0)?,
        );
        (0..c.shape.layers)
            .map(|i| {
                let w = |n: &str| format!("layers.{i}.self_attn.{n}");
                let k = ctx.matmul(&self.weight(&w("k_proj.weight"))?.t()?)?;
                let v = ctx.matmul(&self.weight(&w("v_proj.weight"))?.t()?)?;
                let k = rms_norm(
                    &k.reshape((s, c.shape.kv_heads, d))?,
                    self.get(&w("k_norm.weight")),
                    c.shape.rms_eps,
                )?
                .transpose(0, 1)?;
                let k = (k.broadcast_mul(&cos)? + rotate_half(&k)?.broadcast_mul(&sin)?)?;
                let v = v.reshape((s, c.shape.kv_heads, d))?.transpose(0, 1)?;
                Ok((k.contiguous()?, v.contiguous()?))
            })
            .collect()
    }

    /// The blocks of `anchors` (sorted) against a sequence's `context` (from
    /// [`Drafter::context`]): the parts of their loss. Only the context before the last anchor
    /// is read, so a chunk of early anchors costs less than a chunk of late ones.
    pub fn blocks(
        &self,
        context: &[(Tensor, Tensor)],
        teacher: Option<&Tensor>,
        sequence: Sequence,
        Heads { embedding, lm_head }: Heads,
        objective: Objective,
    ) -> candle_core::Result<LossParts> {
        let Sequence {
            tokens,
            loss_mask,
            anchors,
        } = sequence;
        let c = &self.config;
        let dev = embedding.device();
        let (a, b) = (anchors.len(), c.block_size);
        let h = c.shape.hidden;
        let cdt = self.compute;
        let anchor_tokens: Vec<u32> = anchors.iter().map(|&anchor| tokens[anchor]).collect();
        let x = self.block_states(context, &anchor_tokens, anchors, b, embedding)?;
        let logits = x
            .reshape((a * b, h))?
            .matmul(&lm_head.to_dtype(cdt)?.t()?)?
            .to_dtype(DType::F32)?;
        // Targets and weights: position k of block i predicts tokens[anchor + k].
        let (targets, weights) =
            targets_and_weights(tokens, loss_mask, anchors, b, objective.gamma);
        let targets_t = Tensor::from_vec(targets.clone(), a * b, dev)?;
        let log_probs = log_softmax_last(&logits)?;
        let mut per_position = log_probs
            .gather(&targets_t.unsqueeze(1)?, 1)?
            .squeeze(1)?
            .neg()?;
        // D-PACE reads the drafter's probabilities of the data's tokens, whatever it learns.
        let hard = per_position.detach();
        if let (Some((share, t)), Some(teacher)) = (objective.distill, teacher) {
            // Position k of the block at `anchor` is taught by the target at anchor + k - 1.
            let last = teacher.dim(0)?.saturating_sub(1);
            let rows: Vec<u32> = anchors
                .iter()
                .flat_map(|&anchor| {
                    (0..b).map(move |k| (anchor + k).saturating_sub(1).min(last) as u32)
                })
                .collect();
            let taught = teacher
                .index_select(&Tensor::from_vec(rows, a * b, dev)?, 0)?
                .to_dtype(cdt)?
                .matmul(&lm_head.to_dtype(cdt)?.t()?)?
                .to_dtype(DType::F32)?
                .detach();
            let target_probs = candle_nn::ops::softmax(&(taught / t)?, D::Minus1)?;
            let kd = (target_probs * &log_probs)?.sum(D::Minus1)?.neg()?;
            per_position = ((per_position * (1.0 - share))? + (kd * share)?)?;
        }
        let total = weight_sum(&weights);
        let scaled;
        let weights_of_loss = match objective.dpace {
            None => &weights,
            Some(alpha) => {
                // The drafter's probability of each label, detached: q = exp(-ce).
                let ce = hard.to_vec1::<f32>()?;
                let q: Vec<f64> = ce.iter().map(|&l| (-f64::from(l)).exp()).collect();
                let counted: Vec<bool> = weights.iter().map(|&w| w > 0.0).collect();
                let d = dflash_common::dflash::dpace_weights(&q, &counted, b, alpha);
                scaled = d
                    .iter()
                    .zip(&weights)
                    .map(|(&d, &w)| (d * f64::from(w)) as f32)
                    .collect::<Vec<f32>>();
                &scaled
            }
        };
        let w_t = Tensor::from_vec(weights_of_loss.clone(), a * b, dev)?;
        let sum = per_position.mul(&w_t)?.sum_all()?;
        // Accuracy per block position.
        let predicted = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let mut acc = vec![(0u32, 0u32); b];
        for (i, (&p, &t)) in predicted.iter().zip(&targets).enumerate() {
            if weights[i] > 0.0 {
                acc[i % b].1 += 1;
                acc[i % b].0 += u32::from(p == t);
            }
        }
        Ok(LossParts {
            sum,
            weight: total,
            accuracy: acc,
        })
    }

    /// The drafter's final hidden states `[a, b, hidden]` (normed, before the lm_head) of one
    /// block per anchor: the anchor's token then `b - 1` mask tokens at positions
    /// `anchor..anchor + b`, against a sequence's `context` (only the positions before each
    /// anchor are seen; only those before the last anchor are read).
    pub fn block_states(
        &self,
        context: &[(Tensor, Tensor)],
        anchor_tokens: &[u32],
        anchors: &[usize],
        b: usize,
        embedding: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let c = &self.config;
        let dev = embedding.device();
        let a = anchors.len();
        let (h, d) = (c.shape.hidden, c.shape.head_dim);
        let eps = c.shape.rms_eps;
        let cdt = self.compute;
        // The context positions any of these blocks sees: those before the last anchor.
        let seen = context
            .first()
            .map_or(1, |(k, _)| k.dim(1).unwrap_or(1))
            .min(anchors.iter().copied().max().unwrap_or(0).max(1));
        // Blocks: anchor token then mask tokens, [a, b].
        let mut block_ids = Vec::with_capacity(a * b);
        let mut block_pos = Vec::with_capacity(a * b);
        for (&anchor, &token) in anchors.iter().zip(anchor_tokens) {
            block_ids.push(token);
            block_ids.extend(std::iter::repeat_n(c.mask_token_id, b - 1));
            block_pos.extend((anchor..anchor + b).map(|p| p as u32));
        }
        let ids = Tensor::from_vec(block_ids, a * b, dev)?;
        let mut x = embedding
            .index_select(&ids, 0)?
            .to_dtype(cdt)?
            .reshape((a, b, h))?;
        // Rotary tables of the blocks [a, 1, b, d].
        let (cos_b, sin_b) = rope_tables(
            &Tensor::from_vec(block_pos, (a, b), dev)?,
            d,
            c.shape.rope_theta,
        )?;
        let (cos_b, sin_b) = (
            cos_b.to_dtype(cdt)?.unsqueeze(1)?,
            sin_b.to_dtype(cdt)?.unsqueeze(1)?,
        );
        // Context visibility [a, 1, 1, seen]: position j < anchor.
        let visible: Vec<f32> = anchors
            .iter()
            .flat_map(|&anchor| {
                (0..seen).map(move |j| if j < anchor { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let ctx_mask = Tensor::from_vec(visible, (a, 1, 1, seen), dev)?;
        // `[a, b, in] x W[out, in]^T` as one flat matmul (no per-anchor copies of the weights).
        let linear = |t: &Tensor, name: &str| -> candle_core::Result<Tensor> {
            let w = self.weight(name)?;
            let (a, b, inp) = t.dims3()?;
            t.reshape((a * b, inp))?
                .matmul(&w.t()?)?
                .reshape((a, b, w.dim(0)?))
        };
        let group = c.shape.heads / c.shape.kv_heads;
        // Repeats key/value heads for grouped-query attention: [kv, n, d] -> [heads, n, d].
        let repeat = |t: &Tensor, n: usize| -> candle_core::Result<Tensor> {
            if group == 1 {
                return t.contiguous();
            }
            t.unsqueeze(1)?
                .broadcast_as((c.shape.kv_heads, group, n, d))?
                .reshape((c.shape.heads, n, d))
        };
        let scale = (d as f64).sqrt();
        let rope = |t: &Tensor| -> candle_core::Result<Tensor> {
            t.broadcast_mul(&cos_b)? + rotate_half(t)?.broadcast_mul(&sin_b)?
        };
        for (i, (kc, vc)) in context.iter().enumerate().take(c.shape.layers) {
            let p = |n: &str| format!("layers.{i}.{n}");
            let hn = rms_norm(&x, self.get(&p("input_layernorm.weight")), eps)?;
            // Queries from the block [a, heads, b, d].
            let q =
                linear(&hn, &p("self_attn.q_proj.weight"))?.reshape((a, b, c.shape.heads, d))?;
            let q = rope(
                &rms_norm(&q, self.get(&p("self_attn.q_norm.weight")), eps)?.transpose(1, 2)?,
            )?;
            // Keys and values of the block [a, heads, b, d].
            let kb =
                linear(&hn, &p("self_attn.k_proj.weight"))?.reshape((a, b, c.shape.kv_heads, d))?;
            let kb = rope(
                &rms_norm(&kb, self.get(&p("self_attn.k_norm.weight")), eps)?.transpose(1, 2)?,
            )?;
            let vb = linear(&hn, &p("self_attn.v_proj.weight"))?
                .reshape((a, b, c.shape.kv_heads, d))?
                .transpose(1, 2)?;
            let rep_b = |t: Tensor| -> candle_core::Result<Tensor> {
                if group == 1 {
                    return t.contiguous();
                }
                t.unsqueeze(2)?
                    .broadcast_as((a, c.shape.kv_heads, group, b, d))?
                    .reshape((a, c.shape.heads, b, d))
            };
            let (kb, vb) = (rep_b(kb)?, rep_b(vb)?);
            // The context's keys and values [heads, seen, d], shared by every block.
            let kc = repeat(&kc.narrow(1, 0, seen)?, seen)?;
            let vc = repeat(&vc.narrow(1, 0, seen)?, seen)?;
            // Scores against the context, all blocks in one matmul per head: [a, heads, b, seen],
            // and against the block itself; the softmax in f32.
            let q = q.contiguous()?;
            let q_flat = q
                .transpose(0, 1)?
                .contiguous()?
                .reshape((c.shape.heads, a * b, d))?;
            let s_ctx = (q_flat.matmul(&kc.t()?)? / scale)?
                .to_dtype(DType::F32)?
                .reshape((c.shape.heads, a, b, seen))?
                .transpose(0, 1)?
                .broadcast_add(&ctx_mask)?;
            let s_blk = (q.matmul(&kb.t()?)? / scale)?.to_dtype(DType::F32)?;
            let probs = softmax_last(&Tensor::cat(&[&s_ctx, &s_blk], D::Minus1)?)?.to_dtype(cdt)?;
            let p_ctx = probs
                .narrow(D::Minus1, 0, seen)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((c.shape.heads, a * b, seen))?;
            let attn_ctx = p_ctx
                .matmul(&vc)?
                .reshape((c.shape.heads, a, b, d))?
                .transpose(0, 1)?;
            let attn_blk = probs
                .narrow(D::Minus1, seen, b)?
                .contiguous()?
                .matmul(&vb)?;
            let attn =
                (attn_ctx + attn_blk)?
                    .transpose(1, 2)?
                    .reshape((a, b, c.shape.heads * d))?;
            x = (x + linear(&attn, &p("self_attn.o_proj.weight"))?)?;
            let n = rms_norm(&x, self.get(&p("post_attention_layernorm.weight")), eps)?;
            let gate = linear(&n, &p("mlp.gate_proj.weight"))?;
            let up = linear(&n, &p("mlp.up_proj.weight"))?;
            let act = (gate.clone() * candle_nn::ops::sigmoid(&gate)?)?;
            x = (x + linear(&(act * up)?, &p("mlp.down_proj.weight"))?)?;
        }
        rms_norm(&x, self.get("norm.weight"), eps)
    }

    /// Drafts the `b - 1` tokens after `token` at position `position` (greedy), the block
    /// `[token, MASK × (b - 1)]` seeing `context` (positions `0..position`, from
    /// [`Drafter::context_at`]): one forward pass, as speculative decoding runs it.
    pub fn draft(
        &self,
        context: &[(Tensor, Tensor)],
        token: u32,
        position: usize,
        b: usize,
        Heads { embedding, lm_head }: Heads,
    ) -> candle_core::Result<Vec<u32>> {
        match self.draft_logits(context, token, position, b, Heads { embedding, lm_head })? {
            None => Ok(Vec::new()),
            Some(logits) => logits.argmax(D::Minus1)?.to_vec1::<u32>(),
        }
    }

    /// The logits (f32, `[b - 1, vocab]`) of the block [`Drafter::draft`] fills; none when
    /// `b < 2`.
    pub fn draft_logits(
        &self,
        context: &[(Tensor, Tensor)],
        token: u32,
        position: usize,
        b: usize,
        Heads { embedding, lm_head }: Heads,
    ) -> candle_core::Result<Option<Tensor>> {
        if b < 2 {
            return Ok(None);
        }
        let x = self.block_states(context, &[token], &[position], b, embedding)?;
        x.reshape((b, self.config.shape.hidden))?
            .narrow(0, 1, b - 1)?
            .matmul(&lm_head.to_dtype(self.compute)?.t()?)?
            .to_dtype(DType::F32)
            .map(Some)
    }

    /// The gradients (aligned with [`Drafter::params`]) of `scale ×` one sequence's weighted
    /// cross-entropy sum, and that sum's parts, with the blocks computed and back-propagated
    /// `chunk` anchors at a time (`None`: all at once), so memory holds one chunk's activations
    /// whatever the number of anchors.
    ///
    /// The context is computed once; each chunk back-propagates into a detached copy of it, the
    /// copies' gradients are summed, and one last backward pass carries them through the context
    /// into `fc`, the norms and the key/value projections: the gradient of the whole sequence,
    /// equal to the unchunked one up to the order of float sums.
    pub fn backward(
        &self,
        features: &Tensor,
        sequence: Sequence,
        heads: Heads,
        objective: Objective,
        scale: f64,
        chunk: Option<usize>,
    ) -> candle_core::Result<(Grads, SequenceLoss)> {
        let vars: Vec<Var> = self.params.iter().map(|p| p.var.clone()).collect();
        let (features, teacher) = self.split(features, objective)?;
        let context = self.context(&features)?;
        let mut total = SequenceLoss {
            sum: 0.0,
            weight: 0.0,
            accuracy: vec![(0, 0); self.config.block_size],
        };
        let mut add_parts = |parts: &LossParts| -> candle_core::Result<()> {
            total.sum += f64::from(parts.sum.to_dtype(DType::F32)?.to_scalar::<f32>()?);
            total.weight += parts.weight;
            for (t, p) in total.accuracy.iter_mut().zip(&parts.accuracy) {
                t.0 += p.0;
                t.1 += p.1;
            }
            Ok(())
        };
        let chunk = chunk.unwrap_or(usize::MAX).max(1);
        if sequence.anchors.len() <= chunk {
            let parts = self.blocks(&context, teacher.as_ref(), sequence, heads, objective)?;
            add_parts(&parts)?;
            let grads = grads_of(&(parts.sum * scale)?.backward()?, &vars);
            return Ok((grads, total));
        }
        let leaves = context
            .iter()
            .map(|(k, v)| {
                Ok((
                    Var::from_tensor(&k.detach())?,
                    Var::from_tensor(&v.detach())?,
                ))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let detached: Vec<(Tensor, Tensor)> = leaves
            .iter()
            .map(|(k, v)| (k.as_tensor().clone(), v.as_tensor().clone()))
            .collect();
        let mut grads = None;
        let mut context_grads: Vec<[Option<Tensor>; 2]> = vec![[None, None]; context.len()];
        for part in sequence.anchors.chunks(chunk) {
            let part = Sequence {
                anchors: part,
                ..sequence
            };
            let parts = self.blocks(&detached, teacher.as_ref(), part, heads, objective)?;
            add_parts(&parts)?;
            let store = (parts.sum * scale)?.backward()?;
            add_grads(&mut grads, grads_of(&store, &vars))?;
            for ((k, v), sums) in leaves.iter().zip(&mut context_grads) {
                for (leaf, sum) in [k, v].into_iter().zip(sums.iter_mut()) {
                    if let Some(g) = store.get(leaf.as_tensor()) {
                        *sum = Some(match sum.take() {
                            None => g.clone(),
                            Some(s) => (s + g)?,
                        });
                    }
                }
            }
        }
        // Through the context once: d/dθ Σ <context(θ), its summed gradient>.
        let mut surrogate: Option<Tensor> = None;
        for ((k, v), [gk, gv]) in context.iter().zip(&context_grads) {
            for (t, g) in [(k, gk), (v, gv)] {
                if let Some(g) = g {
                    let term = (t * g)?.to_dtype(DType::F32)?.sum_all()?;
                    surrogate = Some(match surrogate {
                        None => term,
                        Some(s) => (s + term)?,
                    });
                }
            }
        }
        if let Some(s) = surrogate {
            add_grads(&mut grads, grads_of(&s.backward()?, &vars))?;
        }
        Ok((grads.unwrap_or_else(|| vec![None; vars.len()]), total))
    }
}

/// One micro-batch's loss and predictions, after [`Drafter::micro_batch`].
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatchLoss {
    /// The weighted mean cross-entropy over the micro-batch's counted positions (0 when none).
    pub loss: f64,
    /// The sum of the weights (0: nothing to learn from; no gradient).
    pub weight: f64,
    /// Blocks trained.
    pub anchors: u32,
    /// Per block position: correct and counted predictions.
    pub correct: Vec<u32>,
    pub counted: Vec<u32>,
    /// DFlash2's selector's loss and right picks (the torch engine's DFlash2 drafter).
    pub selector: Option<dflash_common::wire::SelectorMetrics>,
}

/// One micro-batch: its sequences packed one after another in `features` (rows), `tokens` and
/// `loss_mask`, each sequence given by its range there and its anchors (relative to its start).
#[derive(Clone, Copy)]
pub struct MicroBatch<'a> {
    pub features: &'a Tensor,
    pub tokens: &'a [u32],
    pub loss_mask: &'a [u8],
    pub sequences: &'a [(std::ops::Range<usize>, Vec<usize>)],
}

impl<'a> MicroBatch<'a> {
    /// Sequence `i`.
    fn sequence(&self, i: usize) -> Sequence<'a> {
        let (range, anchors) = &self.sequences[i];
        Sequence {
            tokens: &self.tokens[range.clone()],
            loss_mask: &self.loss_mask[range.clone()],
            anchors,
        }
    }

    /// The features' rows of sequence `i`.
    fn features(&self, i: usize) -> candle_core::Result<Tensor> {
        let range = &self.sequences[i].0;
        self.features.narrow(0, range.start, range.len())
    }
}

impl Drafter {
    /// The training step's forward and backward passes over one micro-batch. The loss is the
    /// mean over all the micro-batch's weighted positions, so each sequence's gradient is scaled
    /// by the micro-batch's total weight (known before any block runs) and by `1 / accum`;
    /// sequences are back-propagated one at a time, `chunk` anchors at a time. Returns the
    /// summed gradients (`None` when nothing was counted) and the loss.
    pub fn micro_batch(
        &self,
        batch: MicroBatch,
        heads: Heads,
        objective: Objective,
        chunk: Option<usize>,
        accum: usize,
    ) -> candle_core::Result<(Option<Grads>, MicroBatchLoss)> {
        let block = self.config.block_size;
        let sequences = batch.sequences;
        let weight: f64 = (0..sequences.len())
            .map(|i| self.loss_weight(batch.sequence(i), objective))
            .sum();
        let mut out = MicroBatchLoss {
            loss: 0.0,
            weight,
            anchors: 0,
            correct: vec![0; block],
            counted: vec![0; block],
            selector: None,
        };
        if weight <= 0.0 {
            return Ok((None, out));
        }
        let scale = 1.0 / (weight * accum.max(1) as f64);
        let vars: Vec<Var> = self.params.iter().map(|p| p.var.clone()).collect();
        let unchunked = sequences
            .iter()
            .all(|(_, anchors)| anchors.len() <= chunk.unwrap_or(usize::MAX));
        if unchunked {
            // Every sequence's anchors in one chunk: one graph for the micro-batch and one
            // backward pass (fewer, larger kernels than one pass per sequence).
            let mut total: Option<Tensor> = None;
            for i in 0..sequences.len() {
                let sequence = batch.sequence(i);
                let parts = self.loss_parts(&batch.features(i)?, sequence, heads, objective)?;
                out.anchors += sequence.anchors.len() as u32;
                for (k, (c, n)) in parts.accuracy.into_iter().enumerate() {
                    out.correct[k] += c;
                    out.counted[k] += n;
                }
                total = Some(match total {
                    None => parts.sum,
                    Some(t) => (t + parts.sum)?,
                });
            }
            let Some(total) = total else {
                return Ok((None, out));
            };
            out.loss = f64::from(total.to_dtype(DType::F32)?.to_scalar::<f32>()?) / weight;
            let grads = grads_of(&(total * scale)?.backward()?, &vars);
            return Ok((Some(grads), out));
        }
        let mut grads = None;
        let mut sum = 0.0;
        for i in 0..sequences.len() {
            let sequence = batch.sequence(i);
            let features = batch.features(i)?;
            let (g, parts) = self.backward(&features, sequence, heads, objective, scale, chunk)?;
            add_grads(&mut grads, g)?;
            out.anchors += sequence.anchors.len() as u32;
            sum += parts.sum;
            for (k, (c, n)) in parts.accuracy.into_iter().enumerate() {
                out.correct[k] += c;
                out.counted[k] += n;
            }
        }
        out.loss = sum / weight;
        Ok((grads, out))
    }
}

/// One sequence's loss after [`Drafter::backward`]: the weighted cross-entropy sum (unscaled),
/// the sum of the weights, and per block position (correct, counted) predictions.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceLoss {
    pub sum: f64,
    pub weight: f64,
    pub accuracy: Vec<(u32, u32)>,
}

/// Per block position, the token it predicts and its loss weight (see [`block_weights`]):
/// position k of the block at `anchor` predicts `tokens[anchor + k]` (0 past the end).
fn targets_and_weights(
    tokens: &[u32],
    loss_mask: &[u8],
    anchors: &[usize],
    block: usize,
    gamma: Option<f64>,
) -> (Vec<u32>, Vec<f32>) {
    let targets = anchors
        .iter()
        .flat_map(|&anchor| (anchor..anchor + block).map(|t| tokens.get(t).copied().unwrap_or(0)))
        .collect();
    (targets, block_weights(loss_mask, anchors, block, gamma))
}

/// Per block position, its loss weight: position k of the block at `anchor` counts when k >= 1,
/// `anchor + k` is inside the sequence and masked in, weighted `exp(-(k - 1) / gamma)` (1
/// without gamma).
pub fn block_weights(
    loss_mask: &[u8],
    anchors: &[usize],
    block: usize,
    gamma: Option<f64>,
) -> Vec<f32> {
    anchors
        .iter()
        .flat_map(|&anchor| {
            (0..block).map(move |k| {
                let counted = k >= 1 && loss_mask.get(anchor + k).is_some_and(|&m| m != 0);
                let decay = gamma.map_or(1.0, |g| (-((k as f64) - 1.0) / g).exp());
                if counted { decay as f32 } else { 0.0 }
            })
        })
        .collect()
}

/// The sum of loss weights, in f64: exact enough (about 1e-13 relative for any count) that every
/// engine's sum agrees whatever its order of additions; an f32 sum of a long sequence's 8,192
/// weights drifts by 1e-5.
pub fn weight_sum(weights: &[f32]) -> f64 {
    weights.iter().map(|&w| f64::from(w)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loss weight of a long sequence is the same whatever order its weights are added in
    /// (the stage sums per sequence, an engine per chunk or in its own order): an f32 sum of
    /// 512 anchors' blocks differs by more than the stage's 1e-5 check.
    #[test]
    fn loss_weight_sums_do_not_depend_on_the_order() {
        let anchors: Vec<usize> = (0..512).map(|i| i * 16).collect();
        let weights = block_weights(&[1u8; 8192], &anchors, 16, Some(7.0));
        let whole = weight_sum(&weights);
        let reversed: f64 = weights.iter().rev().map(|&w| f64::from(w)).sum();
        let chunked: f64 = weights.chunks(80).map(weight_sum).sum();
        for other in [reversed, chunked] {
            assert!((whole - other).abs() <= 1e-12 * whole, "{whole} vs {other}");
        }
        let f32_sum: f32 = weights.iter().sum();
        let f32_chunked: f32 = weights.chunks(80).map(|c| c.iter().sum::<f32>()).sum();
        assert!(
            (f64::from(f32_sum) - f64::from(f32_chunked)).abs() > 1e-6 * whole,
            "f32 sums of this many weights depend on the order"
        );
    }

    const UNIFORM: Objective = Objective {
        gamma: None,
        distill: None,
        dpace: None,
    };
    const DECAY7: Objective = Objective {
        gamma: Some(7.0),
        distill: None,
        dpace: None,
    };
    use crate::train::grads_of;

    fn seq<'a>(tokens: &'a [u32], loss_mask: &'a [u8], anchors: &'a [usize]) -> Sequence<'a> {
        Sequence {
            tokens,
            loss_mask,
            anchors,
        }
    }

    fn heads<'a>(embedding: &'a Tensor, lm_head: &'a Tensor) -> Heads<'a> {
        Heads { embedding, lm_head }
    }

    fn setup() -> (Drafter, Tensor, Tensor, Tensor, Vec<u32>, Vec<u8>) {
        let dev = Device::Cpu;
        let config = DrafterConfig {
            shape: Qwen3Shape {
                hidden: 32,
                intermediate: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                head_dim: 8,
                rms_eps: 1e-6,
                rope_theta: 10_000.0,
                vocab: 50,
            },
            block_size: 4,
            mask_token_id: 5,
            target_layer_ids: vec![0, 2],
            dflash2: None,
            sliding_window: None,
        };
        let drafter = Drafter::new(config, 7, &dev).unwrap();
        let mut rng = SplitMix64(99);
        let mut randn = |shape: (usize, usize)| {
            let v: Vec<f32> = (0..shape.0 * shape.1)
                .map(|_| rng.normal() as f32)
                .collect();
            Tensor::from_vec(v, shape, &dev).unwrap()
        };
        let features = randn((12, 64));
        let embedding = randn((50, 32));
        let lm_head = randn((50, 32));
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 50).collect();
        let mask = vec![0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];
        (drafter, features, embedding, lm_head, tokens, mask)
    }

    /// Every trainable parameter receives a non-zero gradient (candle's fused kernels would drop
    /// them silently).
    #[test]
    fn every_parameter_gets_a_gradient() {
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        let (loss, acc) = drafter
            .loss(
                &features,
                seq(&tokens, &mask, &[2, 5, 9]),
                heads(&embedding, &lm_head),
                DECAY7,
            )
            .unwrap();
        let value = loss.to_scalar::<f32>().unwrap();
        assert!(value.is_finite() && value > 0.0, "{value}");
        // Position 0 never counts; the block at 9 runs past the end (positions 12, 13 not counted).
        assert_eq!(acc[0].1, 0);
        assert_eq!(acc.iter().map(|a| a.1).sum::<u32>(), 3 + 3 + 2);
        let grads = loss.backward().unwrap();
        for p in &drafter.params {
            let g = grads
                .get(p.var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {}", p.name));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 0.0, "zero gradient for {}", p.name);
        }
    }

    /// The context built piece by piece (as decoding extends it) equals the whole one, and a
    /// drafted block's tokens are the argmax of the training pass's logits at that anchor.
    #[test]
    fn context_in_pieces_equals_the_whole_and_drafts_match_the_training_pass() {
        let (drafter, features, embedding, lm_head, tokens, _) = setup();
        let whole = drafter.context(&features).unwrap();
        let mut pieces = drafter
            .context_at(&features.narrow(0, 0, 5).unwrap(), 0)
            .unwrap();
        for (from, len) in [(5, 1), (6, 4), (10, 2)] {
            let more = drafter
                .context_at(&features.narrow(0, from, len).unwrap(), from)
                .unwrap();
            for ((k, v), (k2, v2)) in pieces.iter_mut().zip(more) {
                *k = Tensor::cat(&[&*k, &k2], 1).unwrap();
                *v = Tensor::cat(&[&*v, &v2], 1).unwrap();
            }
        }
        for ((k, v), (k2, v2)) in whole.iter().zip(&pieces) {
            assert!(crate::model::max_abs_diff(k, k2).unwrap() < 1e-6);
            assert!(crate::model::max_abs_diff(v, v2).unwrap() < 1e-6);
        }
        let b = drafter.config.block_size;
        let anchor = 6;
        let drafted = drafter
            .draft(
                &pieces,
                tokens[anchor],
                anchor,
                b,
                heads(&embedding, &lm_head),
            )
            .unwrap();
        let states = drafter
            .block_states(&whole, &[tokens[anchor]], &[anchor], b, &embedding)
            .unwrap();
        let want = states
            .reshape((b, drafter.config.shape.hidden))
            .unwrap()
            .matmul(&lm_head.t().unwrap())
            .unwrap()
            .argmax(D::Minus1)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        assert_eq!(drafted, want[1..].to_vec());
        assert!(
            drafter
                .draft(&pieces, 1, 3, 1, heads(&embedding, &lm_head))
                .unwrap()
                .is_empty()
        );
    }

    /// The distillation loss: its gradient matches finite differences of the loss, a mix is the
    /// weighted sum of cross-entropy and distillation, and the taught distribution is the
    /// target's at the position before (a teacher that changes only past the last block's reach
    /// leaves the loss alone).
    #[test]
    fn distillation_gradients_match_finite_differences() {
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        let mut rng = SplitMix64(5);
        let teacher: Vec<f32> = (0..12 * 32).map(|_| rng.normal() as f32).collect();
        let teacher = Tensor::from_vec(teacher, (12, 32), &Device::Cpu).unwrap();
        let with_teacher = Tensor::cat(&[&features, &teacher], 1).unwrap();
        let anchors = [2usize, 5];
        let objective = |share: f64| Objective {
            gamma: Some(7.0),
            distill: Some((share, 2.0)),
            dpace: None,
        };
        let on = |toks: &[u32], f: &Tensor, o: Objective| {
            drafter
                .loss_parts(
                    f,
                    seq(toks, &mask, &anchors),
                    heads(&embedding, &lm_head),
                    o,
                )
                .unwrap()
                .sum
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let loss_of = |f: &Tensor, o: Objective| on(&tokens, f, o);
        let (ce, kd, mix) = (
            loss_of(&features, DECAY7),
            loss_of(&with_teacher, objective(1.0)),
            loss_of(&with_teacher, objective(0.3)),
        );
        assert!(kd.is_finite() && kd > 0.0 && (kd - ce).abs() > 1e-3);
        assert!((mix - (0.7 * ce + 0.3 * kd)).abs() < 1e-4 * ce.abs().max(1.0));
        // A target sure of each data token (its state at p points at token p + 1) teaches what
        // cross-entropy on the tokens does.
        let head = lm_head.to_vec2::<f32>().unwrap();
        let sure: Vec<Vec<f32>> = (0..12)
            .map(|p| {
                let next = tokens[(p + 1).min(11)] as usize;
                head[next].iter().map(|v| v * 60.0).collect()
            })
            .collect();
        let sure = Tensor::cat(&[&features, &Tensor::new(sure, &Device::Cpu).unwrap()], 1).unwrap();
        let one_t = |share| Objective {
            gamma: Some(7.0),
            distill: Some((share, 1.0)),
            dpace: None,
        };
        let taught = loss_of(&sure, one_t(1.0));
        assert!((taught - ce).abs() < 1e-3 * ce, "kd {taught} vs ce {ce}");
        // Only the target's side is tempered: as T falls, kd under any target becomes
        // cross-entropy against the target's greedy tokens (the drafter's logits stay as served).
        let greedy: Vec<u32> = std::iter::once(tokens[0])
            .chain(
                teacher
                    .matmul(&lm_head.t().unwrap())
                    .unwrap()
                    .argmax(D::Minus1)
                    .unwrap()
                    .to_vec1::<u32>()
                    .unwrap()
                    .into_iter()
                    .take(11),
            )
            .collect();
        let cold = Objective {
            gamma: Some(7.0),
            distill: Some((1.0, 1e-3)),
            dpace: None,
        };
        let (kd_cold, ce_greedy) = (
            on(&greedy, &with_teacher, cold),
            on(&greedy, &features, DECAY7),
        );
        assert!(
            (kd_cold - ce_greedy).abs() < 1e-3 * ce_greedy,
            "kd at T 0.001 {kd_cold} vs ce on the target's greedy tokens {ce_greedy}"
        );
        assert!((on(&greedy, &with_teacher, objective(1.0)) - ce_greedy).abs() > 1e-2);
        // The blocks at 2 and 5 (block 4) are taught by positions 2..=7; position 8 on is unseen.
        let mut later = teacher.to_vec2::<f32>().unwrap();
        for row in later.iter_mut().skip(8) {
            row.iter_mut().for_each(|v| *v += 3.0);
        }
        let later = Tensor::new(later, &Device::Cpu).unwrap();
        let changed = Tensor::cat(&[&features, &later], 1).unwrap();
        assert_eq!(loss_of(&changed, objective(1.0)), kd);

        let parts = drafter
            .loss_parts(
                &with_teacher,
                seq(&tokens, &mask, &anchors),
                heads(&embedding, &lm_head),
                objective(1.0),
            )
            .unwrap();
        let grads = parts.sum.backward().unwrap();
        for name in ["fc.weight", "layers.1.mlp.up_proj.weight", "norm.weight"] {
            let p = drafter.params.iter().find(|p| p.name == name).unwrap();
            let g = grads.get(p.var.as_tensor()).unwrap();
            let flat = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (at, &analytic) = flat
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            let original = p
                .var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let eps = 1e-2f32;
            let shifted = |delta: f32| {
                let mut v = original.clone();
                v[at] += delta;
                p.var
                    .set(&Tensor::from_vec(v, p.var.as_tensor().dims(), &Device::Cpu).unwrap())
                    .unwrap();
                loss_of(&with_teacher, objective(1.0))
            };
            let numeric = (shifted(eps) - shifted(-eps)) / (2.0 * f64::from(eps));
            shifted(0.0);
            let analytic = f64::from(analytic);
            assert!(
                (numeric - analytic).abs() <= 0.05 * analytic.abs() + 1e-3,
                "{name}[{at}]: analytic {analytic}, numeric {numeric}"
            );
        }
    }

    /// A block sees only the context before its anchor: changing later context leaves its loss
    /// unchanged, changing earlier context changes it.
    #[test]
    fn blocks_see_only_the_context_before_their_anchor() {
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        let loss_of = |f: &Tensor| {
            drafter
                .loss(
                    f,
                    seq(&tokens, &mask, &[5]),
                    heads(&embedding, &lm_head),
                    UNIFORM,
                )
                .unwrap()
                .0
                .to_scalar::<f32>()
                .unwrap()
        };
        let base = loss_of(&features);
        let bump = |row: usize| {
            let mut v = features.to_vec2::<f32>().unwrap();
            for x in &mut v[row] {
                *x += 1.0;
            }
            Tensor::new(v, &Device::Cpu).unwrap()
        };
        assert_eq!(
            loss_of(&bump(5)),
            base,
            "the anchor's own context row is hidden"
        );
        assert_eq!(loss_of(&bump(11)), base, "later context is hidden");
        assert_ne!(loss_of(&bump(4)), base, "earlier context is seen");
    }

    /// The training step (AdamW, accumulation of 2 micro-batches, clipping) on one batch drives
    /// the loss down: the step learns.
    #[test]
    fn training_steps_reduce_the_loss() {
        use crate::train::{Accumulator, AdamW, AdamWConfig, clip_grad_norm};
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        let vars: Vec<Var> = drafter.params.iter().map(|p| p.var.clone()).collect();
        let mut opt = AdamW::new(vars.clone(), AdamWConfig::default()).unwrap();
        let mut acc = Accumulator::default();
        let mut losses = Vec::new();
        for _ in 0..40 {
            for anchors in [[2usize, 5], [4, 8]] {
                let (loss, _) = drafter
                    .loss(
                        &features,
                        seq(&tokens, &mask, &anchors),
                        heads(&embedding, &lm_head),
                        DECAY7,
                    )
                    .unwrap();
                losses.push(loss.to_scalar::<f32>().unwrap());
                acc.add(&loss, &vars, 2).unwrap();
            }
            let mut grads = acc.take().unwrap();
            let norm = clip_grad_norm(&mut grads, 1.0).unwrap();
            assert!(norm.is_finite() && norm > 0.0);
            opt.step(&grads, 1e-2).unwrap();
        }
        let (first, last) = (losses[0] + losses[1], losses[78] + losses[79]);
        assert!(last < 0.5 * first, "loss {first} -> {last}");
    }

    fn grads_close(a: &Grads, b: &Grads, drafter: &Drafter, what: &str) {
        for ((x, y), p) in a.iter().zip(b).zip(&drafter.params) {
            let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
            let diff = super::super::max_abs_diff(x, y).unwrap();
            assert!(diff < 1e-5, "{what}: {} differs by {diff}", p.name);
        }
    }

    /// The anchors in chunks (any size, the last one partial, one anchor per chunk) give the
    /// gradient of all anchors at once, and of the one-graph loss: within 1e-5 in f32.
    #[test]
    fn chunked_gradients_equal_the_unchunked_ones() {
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        let anchors = [2usize, 3, 5, 7, 9, 10];
        let vars: Vec<Var> = drafter.params.iter().map(|p| p.var.clone()).collect();
        // The reference: one graph, the mean's gradient.
        let (loss, _) = drafter
            .loss(
                &features,
                seq(&tokens, &mask, &anchors),
                heads(&embedding, &lm_head),
                DECAY7,
            )
            .unwrap();
        let want = grads_of(&loss.backward().unwrap(), &vars);
        let weight = drafter.loss_weight(seq(&tokens, &mask, &anchors), DECAY7);
        for chunk in [None, Some(6), Some(4), Some(2), Some(1)] {
            let (got, parts) = drafter
                .backward(
                    &features,
                    seq(&tokens, &mask, &anchors),
                    heads(&embedding, &lm_head),
                    DECAY7,
                    1.0 / weight,
                    chunk,
                )
                .unwrap();
            assert!((parts.weight - weight).abs() < 1e-5 * weight);
            let mean = parts.sum / parts.weight;
            let expected = f64::from(loss.to_scalar::<f32>().unwrap());
            assert!(
                (mean - expected).abs() < 1e-5,
                "{chunk:?}: {mean} vs {expected}"
            );
            grads_close(&want, &got, &drafter, &format!("chunk {chunk:?}"));
        }
    }

    /// A micro-batch of several sequences, chunked, gives the gradient of the mean over all its
    /// weighted positions computed in one graph, scaled by 1 / accum.
    #[test]
    fn a_chunked_micro_batch_equals_the_one_graph_mean() {
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        // Two sequences of 6 tokens each in one micro-batch.
        let sequences = vec![(0..6, vec![2usize, 3, 4]), (6..12, vec![0usize, 1, 3])];
        let vars: Vec<Var> = drafter.params.iter().map(|p| p.var.clone()).collect();
        let (mut sum, mut weight) = (None::<Tensor>, 0.0);
        for (range, anchors) in &sequences {
            let parts = drafter
                .loss_parts(
                    &features.narrow(0, range.start, range.len()).unwrap(),
                    seq(&tokens[range.clone()], &mask[range.clone()], anchors),
                    heads(&embedding, &lm_head),
                    UNIFORM,
                )
                .unwrap();
            weight += parts.weight;
            sum = Some(match sum {
                None => parts.sum,
                Some(s) => (s + parts.sum).unwrap(),
            });
        }
        let mean = (sum.unwrap() / (weight * 2.0)).unwrap();
        let want = grads_of(&mean.backward().unwrap(), &vars);
        // One graph (each sequence's anchors fit a chunk), and chunks of 2.
        for chunk in [None, Some(2)] {
            let (got, batch) = drafter
                .micro_batch(
                    MicroBatch {
                        features: &features,
                        tokens: &tokens,
                        loss_mask: &mask,
                        sequences: &sequences,
                    },
                    heads(&embedding, &lm_head),
                    UNIFORM,
                    chunk,
                    2,
                )
                .unwrap();
            assert_eq!(batch.anchors, 6);
            assert!((batch.weight - weight).abs() < 1e-9);
            let expected = f64::from(mean.to_scalar::<f32>().unwrap()) * 2.0;
            assert!(
                (batch.loss - expected).abs() < 1e-5,
                "{chunk:?}: {} vs {expected}",
                batch.loss
            );
            grads_close(
                &want,
                &got.unwrap(),
                &drafter,
                &format!("micro-batch, chunk {chunk:?}"),
            );
        }
    }

    /// In bf16 the forward pass runs (f32 masters, bf16 compute) and its loss and gradients stay
    /// close to f32's.
    #[test]
    fn bf16_compute_keeps_f32_masters_and_tracks_f32() {
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        let anchors = [2usize, 5, 9];
        let (f32_loss, _) = drafter
            .loss(
                &features,
                seq(&tokens, &mask, &anchors),
                heads(&embedding, &lm_head),
                UNIFORM,
            )
            .unwrap();
        let bf = Drafter::new(drafter.config.clone(), 7, &Device::Cpu)
            .unwrap()
            .with_compute(DType::BF16);
        let to_bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let (bf_loss, _) = bf
            .loss(
                &to_bf(&features),
                seq(&tokens, &mask, &anchors),
                heads(&to_bf(&embedding), &to_bf(&lm_head)),
                UNIFORM,
            )
            .unwrap();
        let (a, b) = (
            f32_loss.to_scalar::<f32>().unwrap(),
            bf_loss
                .to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
        );
        assert!((a - b).abs() / a < 2e-2, "f32 {a} vs bf16 {b}");
        let grads = bf_loss.backward().unwrap();
        for p in &bf.params {
            assert_eq!(p.var.dtype(), DType::F32, "{} stays an f32 master", p.name);
            let g = grads.get(p.var.as_tensor()).expect("a gradient");
            assert_eq!(g.dtype(), DType::F32);
        }
    }

    #[test]
    fn initialisation_is_deterministic() {
        let (a, ..) = setup();
        let (b, ..) = setup();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in a.params.iter().zip(&b.params) {
            let (fx, fy) = (flat(x.var.as_tensor()), flat(y.var.as_tensor()));
            assert_eq!(fx, fy, "{}", x.name);
        }
    }
}
