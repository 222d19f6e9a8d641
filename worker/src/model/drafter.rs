//! The DFlash drafter and its training loss.
//!
//! `fc` (Linear n·H -> H) and an RMSNorm turn the target's hidden states at `target_layer_ids`
//! into context features. Each training block is an anchor token followed by `block_size - 1` mask
//! tokens at positions `anchor..anchor + block_size`, embedded with the target's frozen embedding.
//! The drafter's Qwen3-style layers take queries from the block and keys/values from
//! `[context ; block]`: a block sees the context strictly before its anchor, sees itself
//! bidirectionally, and never sees other blocks. A final RMSNorm and the target's frozen lm_head
//! give logits; block position `k >= 1` predicts token `anchor + k`, cross-entropy weighted
//! `exp(-(k - 1) / gamma)` (or 1 without gamma) over positions whose loss mask is set.
//!
//! Everything here is built from candle ops that carry gradients (the fused norm, rope and softmax
//! kernels of candle-nn do not), and the weights are initialised from our own seeded generator.

use candle_core::{D, DType, Device, Tensor, Var};

use super::rotate_half;
use crate::rng::SplitMix64;

/// The drafter's shape and training constants.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub block_size: usize,
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    pub vocab: usize,
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

/// A trainable tensor with its checkpoint name.
pub struct Param {
    pub name: String,
    pub var: Var,
}

/// The drafter's weights.
pub struct Drafter {
    pub config: DrafterConfig,
    pub params: Vec<Param>,
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let mean = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(mean + eps)?.sqrt()?)?
        .broadcast_mul(weight)
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
    /// Fresh weights: matrices N(0, 0.02), norms 1, from `seed`.
    pub fn new(config: DrafterConfig, seed: u64, device: &Device) -> candle_core::Result<Self> {
        let c = &config;
        let (h, d) = (c.hidden, c.head_dim);
        let mut shapes: Vec<(String, Vec<usize>, bool)> = vec![
            (
                "fc.weight".into(),
                vec![h, h * c.target_layer_ids.len()],
                false,
            ),
            ("hidden_norm.weight".into(), vec![h], true),
        ];
        for i in 0..c.layers {
            let p = format!("layers.{i}");
            shapes.extend([
                (format!("{p}.input_layernorm.weight"), vec![h], true),
                (
                    format!("{p}.self_attn.q_proj.weight"),
                    vec![c.heads * d, h],
                    false,
                ),
                (
                    format!("{p}.self_attn.k_proj.weight"),
                    vec![c.kv_heads * d, h],
                    false,
                ),
                (
                    format!("{p}.self_attn.v_proj.weight"),
                    vec![c.kv_heads * d, h],
                    false,
                ),
                (
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![h, c.heads * d],
                    false,
                ),
                (format!("{p}.self_attn.q_norm.weight"), vec![d], true),
                (format!("{p}.self_attn.k_norm.weight"), vec![d], true),
                (
                    format!("{p}.post_attention_layernorm.weight"),
                    vec![h],
                    true,
                ),
                (
                    format!("{p}.mlp.gate_proj.weight"),
                    vec![c.intermediate, h],
                    false,
                ),
                (
                    format!("{p}.mlp.up_proj.weight"),
                    vec![c.intermediate, h],
                    false,
                ),
                (
                    format!("{p}.mlp.down_proj.weight"),
                    vec![h, c.intermediate],
                    false,
                ),
            ]);
        }
        shapes.push(("norm.weight".into(), vec![h], true));
        let mut rng = SplitMix64(seed);
        let params = shapes
            .into_iter()
            .map(|(name, shape, is_norm)| {
                let n: usize = shape.iter().product();
                let values: Vec<f32> = if is_norm {
                    vec![1.0; n]
                } else {
                    (0..n).map(|_| (0.02 * rng.normal()) as f32).collect()
                };
                let var = Var::from_tensor(&Tensor::from_vec(values, shape, device)?)?;
                Ok(Param { name, var })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { config, params })
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
    #[expect(
        clippy::too_many_arguments,
        reason = "one sequence's inputs, each a different thing"
    )]
    pub fn loss(
        &self,
        features: &Tensor,
        tokens: &[u32],
        loss_mask: &[u8],
        anchors: &[usize],
        embedding: &Tensor,
        lm_head: &Tensor,
        gamma: Option<f64>,
    ) -> candle_core::Result<(Tensor, Vec<(u32, u32)>)> {
        let parts = self.loss_parts(
            features, tokens, loss_mask, anchors, embedding, lm_head, gamma,
        )?;
        Ok(((parts.sum / parts.weight.max(1e-9))?, parts.accuracy))
    }

    /// The parts of one sequence's loss, so that a batch can average over all its positions.
    ///
    /// - `features`: `[seq, n·hidden]`, the target's hidden states at `target_layer_ids`,
    ///   concatenated in that order;
    /// - `tokens`, `loss_mask`: the sequence (`loss_mask` 0/1);
    /// - `anchors`: block starts (each with `loss_mask` set);
    /// - `embedding`, `lm_head`: the target's frozen `[vocab, hidden]` matrices.
    ///
    /// Returns the weighted sum of cross-entropies, the sum of the weights, and per block
    /// position (correct, counted) predictions.
    #[expect(
        clippy::too_many_arguments,
        reason = "one sequence's inputs, each a different thing"
    )]
    pub fn loss_parts(
        &self,
        features: &Tensor,
        tokens: &[u32],
        loss_mask: &[u8],
        anchors: &[usize],
        embedding: &Tensor,
        lm_head: &Tensor,
        gamma: Option<f64>,
    ) -> candle_core::Result<LossParts> {
        let c = &self.config;
        let dev = features.device();
        let (s, a, b) = (tokens.len(), anchors.len(), c.block_size);
        let (h, d) = (c.hidden, c.head_dim);
        let eps = c.rms_eps;
        // Context features [s, h].
        let ctx = features.matmul(&self.get("fc.weight").t()?)?;
        let ctx = rms_norm(&ctx, self.get("hidden_norm.weight"), eps)?;
        // Blocks: anchor token then mask tokens, [a, b].
        let mut block_ids = Vec::with_capacity(a * b);
        let mut block_pos = Vec::with_capacity(a * b);
        for &anchor in anchors {
            block_ids.push(tokens[anchor]);
            block_ids.extend(std::iter::repeat_n(c.mask_token_id, b - 1));
            block_pos.extend((anchor..anchor + b).map(|p| p as u32));
        }
        let ids = Tensor::from_vec(block_ids, a * b, dev)?;
        let mut x = embedding.index_select(&ids, 0)?.reshape((a, b, h))?;
        // Rotary tables: context [s, d], blocks [a, b, d].
        let (cos_c, sin_c) = rope_tables(&Tensor::arange(0u32, s as u32, dev)?, d, c.rope_theta)?;
        let (cos_b, sin_b) =
            rope_tables(&Tensor::from_vec(block_pos, (a, b), dev)?, d, c.rope_theta)?;
        // Context visibility [a, 1, 1, s]: position j < anchor.
        let visible: Vec<f32> = anchors
            .iter()
            .flat_map(|&anchor| {
                (0..s).map(move |j| if j < anchor { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let ctx_mask = Tensor::from_vec(visible, (a, 1, 1, s), dev)?;
        // `[a, b, in] x W[out, in]^T` as one flat matmul (no per-anchor copies of the weights).
        let linear = |t: &Tensor, w: &Tensor| -> candle_core::Result<Tensor> {
            let (a, b, inp) = t.dims3()?;
            t.reshape((a * b, inp))?
                .matmul(&w.t()?)?
                .reshape((a, b, w.dim(0)?))
        };
        let group = c.heads / c.kv_heads;
        // Repeats key/value heads for grouped-query attention: [kv, n, d] -> [heads, n, d].
        let repeat = |t: Tensor, n: usize| -> candle_core::Result<Tensor> {
            if group == 1 {
                return Ok(t);
            }
            t.unsqueeze(1)?
                .broadcast_as((c.kv_heads, group, n, d))?
                .reshape((c.heads, n, d))
        };
        let scale = (d as f64).sqrt();
        for i in 0..c.layers {
            let p = |n: &str| format!("layers.{i}.{n}");
            let w = |n: &str| self.get(&p(n));
            let hn = rms_norm(&x, w("input_layernorm.weight"), eps)?;
            // Queries from the block [a, heads, b, d].
            let q = linear(&hn, w("self_attn.q_proj.weight"))?.reshape((a, b, c.heads, d))?;
            let q = rms_norm(&q, w("self_attn.q_norm.weight"), eps)?.transpose(1, 2)?;
            let q = (q.broadcast_mul(&cos_b.unsqueeze(1)?)?
                + rotate_half(&q)?.broadcast_mul(&sin_b.unsqueeze(1)?)?)?;
            // Keys and values of the block [a, heads, b, d].
            let kb = linear(&hn, w("self_attn.k_proj.weight"))?.reshape((a, b, c.kv_heads, d))?;
            let kb = rms_norm(&kb, w("self_attn.k_norm.weight"), eps)?.transpose(1, 2)?;
            let kb = (kb.broadcast_mul(&cos_b.unsqueeze(1)?)?
                + rotate_half(&kb)?.broadcast_mul(&sin_b.unsqueeze(1)?)?)?;
            let vb = linear(&hn, w("self_attn.v_proj.weight"))?
                .reshape((a, b, c.kv_heads, d))?
                .transpose(1, 2)?;
            let rep_b = |t: Tensor| -> candle_core::Result<Tensor> {
                if group == 1 {
                    return t.contiguous();
                }
                t.unsqueeze(2)?
                    .broadcast_as((a, c.kv_heads, group, b, d))?
                    .reshape((a, c.heads, b, d))
            };
            let (kb, vb) = (rep_b(kb)?, rep_b(vb)?);
            // Keys and values of the context [heads, s, d], shared by every block.
            let kc = ctx.matmul(&w("self_attn.k_proj.weight").t()?)?;
            let vc = ctx.matmul(&w("self_attn.v_proj.weight").t()?)?;
            let kc = rms_norm(
                &kc.reshape((s, c.kv_heads, d))?,
                w("self_attn.k_norm.weight"),
                eps,
            )?
            .transpose(0, 1)?;
            let kc = (kc.broadcast_mul(&cos_c.unsqueeze(0)?)?
                + rotate_half(&kc)?.broadcast_mul(&sin_c.unsqueeze(0)?)?)?;
            let vc = vc.reshape((s, c.kv_heads, d))?.transpose(0, 1)?;
            let (kc, vc) = (repeat(kc, s)?.contiguous()?, repeat(vc, s)?.contiguous()?);
            // Scores against the context, all blocks in one matmul per head: [a, heads, b, s].
            let q = q.contiguous()?;
            let q_flat = q
                .transpose(0, 1)?
                .contiguous()?
                .reshape((c.heads, a * b, d))?;
            let s_ctx = (q_flat.matmul(&kc.t()?)? / scale)?
                .reshape((c.heads, a, b, s))?
                .transpose(0, 1)?
                .broadcast_add(&ctx_mask)?;
            let s_blk = (q.matmul(&kb.t()?)? / scale)?;
            let probs =
                candle_nn::ops::softmax(&Tensor::cat(&[&s_ctx, &s_blk], D::Minus1)?, D::Minus1)?;
            let p_ctx = probs
                .narrow(D::Minus1, 0, s)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((c.heads, a * b, s))?;
            let attn_ctx = p_ctx
                .matmul(&vc)?
                .reshape((c.heads, a, b, d))?
                .transpose(0, 1)?;
            let attn_blk = probs.narrow(D::Minus1, s, b)?.contiguous()?.matmul(&vb)?;
            let attn = (attn_ctx + attn_blk)?
                .transpose(1, 2)?
                .reshape((a, b, c.heads * d))?;
            x = (x + linear(&attn, w("self_attn.o_proj.weight"))?)?;
            let n = rms_norm(&x, w("post_attention_layernorm.weight"), eps)?;
            let gate = linear(&n, w("mlp.gate_proj.weight"))?;
            let up = linear(&n, w("mlp.up_proj.weight"))?;
            let act = (gate.clone() * candle_nn::ops::sigmoid(&gate)?)?;
            x = (x + linear(&(act * up)?, w("mlp.down_proj.weight"))?)?;
        }
        let x = rms_norm(&x, self.get("norm.weight"), eps)?;
        let logits = x.reshape((a * b, h))?.matmul(&lm_head.t()?)?;
        // Targets and weights: position k of block i predicts tokens[anchor + k].
        let mut targets = Vec::with_capacity(a * b);
        let mut weights = Vec::with_capacity(a * b);
        for &anchor in anchors {
            for k in 0..b {
                let t = anchor + k;
                let counted = k >= 1 && t < s && loss_mask[t] != 0;
                targets.push(if t < s { tokens[t] } else { 0 });
                let decay = gamma.map_or(1.0, |g| (-((k as f64) - 1.0) / g).exp());
                weights.push(if counted { decay as f32 } else { 0.0 });
            }
        }
        let targets_t = Tensor::from_vec(targets.clone(), a * b, dev)?;
        let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = log_probs.gather(&targets_t.unsqueeze(1)?, 1)?.squeeze(1)?;
        let total: f32 = weights.iter().sum();
        let w_t = Tensor::from_vec(weights.clone(), a * b, dev)?;
        let sum = picked.mul(&w_t)?.sum_all()?.neg()?;
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
            weight: f64::from(total),
            accuracy: acc,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Drafter, Tensor, Tensor, Tensor, Vec<u32>, Vec<u8>) {
        let dev = Device::Cpu;
        let config = DrafterConfig {
            hidden: 32,
            intermediate: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            rms_eps: 1e-6,
            rope_theta: 10_000.0,
            block_size: 4,
            mask_token_id: 5,
            target_layer_ids: vec![0, 2],
            vocab: 50,
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
                &tokens,
                &mask,
                &[2, 5, 9],
                &embedding,
                &lm_head,
                Some(7.0),
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

    /// A block sees only the context before its anchor: changing later context leaves its loss
    /// unchanged, changing earlier context changes it.
    #[test]
    fn blocks_see_only_the_context_before_their_anchor() {
        let (drafter, features, embedding, lm_head, tokens, mask) = setup();
        let loss_of = |f: &Tensor| {
            drafter
                .loss(f, &tokens, &mask, &[5], &embedding, &lm_head, None)
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
                        &tokens,
                        &mask,
                        &anchors,
                        &embedding,
                        &lm_head,
                        Some(7.0),
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
