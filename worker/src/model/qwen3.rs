//! The target: a Qwen3 causal language model loaded from a Hugging Face directory
//! (`config.json`, `model.safetensors` or a sharded `model.safetensors.index.json`), run forward
//! only, returning the hidden states of chosen layers.
//!
//! Hidden-state index `k` follows `transformers`' `output_hidden_states`: 0 is the embedding output,
//! `k` in `1..L` the output of layer `k - 1`, and `L` the last layer's output after the final norm.
//! Only the layers up to the last index asked for are run. Sequences are described by a segment id
//! and a position per token, so one call serves padded batches (one row per sequence) and packed
//! ones (sequences concatenated, attention confined to each).

use std::path::{Path, PathBuf};

use candle_core::{D, DType, Device, IndexOp, Module, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};

use super::rotate_half;

pub use dflash_common::dflash::Qwen3Config;

/// A model directory that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

fn invalid(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

impl From<dflash_common::dflash::ModelDirError> for ModelError {
    fn from(e: dflash_common::dflash::ModelDirError) -> Self {
        ModelError::Invalid {
            path: e.path,
            reason: e.reason,
        }
    }
}

/// Reads and checks `config.json` of a Qwen3 model directory.
pub fn read_config(dir: &Path) -> Result<Qwen3Config, ModelError> {
    Ok(dflash_common::dflash::read_config(dir)?)
}

/// The safetensors files of a model directory.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    Ok(dflash_common::dflash::weight_files(dir)?)
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

struct Layer {
    input_norm: RmsNorm,
    attention: Attention,
    post_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// How a Qwen3 computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionMode {
    /// Dense scores for small batches, tiles otherwise (see [`DENSE_MAX_SCORES`]).
    Auto,
    /// `[rows, heads, s, s]` scores and masks at once: only for short inputs.
    Dense,
    /// Tiles of `n` queries against tiles of `n` keys, online softmax, per segment.
    Tiled(usize),
}

/// Query and key tile length of the tiled attention.
pub const ATTENTION_TILE: usize = 512;

/// Largest `rows × heads × s × s` that [`AttentionMode::Auto`] computes densely (64 MiB of f32
/// scores); above it attention runs in tiles, so memory stays linear in the tokens of a batch.
pub const DENSE_MAX_SCORES: usize = 16 << 20;

/// A Qwen3 target model.
pub struct Qwen3 {
    pub config: Qwen3Config,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    inv_freq: Tensor,
    device: Device,
    dtype: DType,
    attention: AttentionMode,
}

fn linear(vb: &VarBuilder, out: usize, inp: usize, name: &str) -> candle_core::Result<Linear> {
    Ok(Linear::new(
        vb.get((out, inp), &format!("{name}.weight"))?,
        None,
    ))
}

fn norm(vb: &VarBuilder, size: usize, name: &str, eps: f64) -> candle_core::Result<RmsNorm> {
    Ok(RmsNorm::new(vb.get(size, &format!("{name}.weight"))?, eps))
}

impl Qwen3 {
    /// Loads the model in `dir`, running at most `layers` decoder layers (`None`: all), with its
    /// weights and activations in `dtype` (a checkpoint stored in that dtype is not converted;
    /// attention scores and softmax are computed in f32 whatever the dtype).
    pub fn load(
        dir: &Path,
        layers: Option<usize>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let config = read_config(dir)?;
        let files = weight_files(dir)?;
        // SAFETY: the weight files are read-only inputs, not modified while the model lives.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device) }
            .map_err(|e| invalid(dir, format!("cannot map the weights: {e}")))?;
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim());
        let missing =
            |e: candle_core::Error| invalid(dir, format!("weights do not match config.json: {e}"));
        let embed = Embedding::new(
            vb.get((c.vocab_size, h), "model.embed_tokens.weight")
                .map_err(missing)?,
            h,
        );
        let run = layers
            .unwrap_or(c.num_hidden_layers)
            .min(c.num_hidden_layers);
        let mut decoder = Vec::with_capacity(run);
        for i in 0..run {
            let p = vb.pp(format!("model.layers.{i}"));
            let a = p.pp("self_attn");
            let m = p.pp("mlp");
            let layer = (|| -> candle_core::Result<Layer> {
                Ok(Layer {
                    input_norm: norm(&p, h, "input_layernorm", c.rms_norm_eps)?,
                    attention: Attention {
                        q: linear(&a, c.num_attention_heads * hd, h, "q_proj")?,
                        k: linear(&a, c.num_key_value_heads * hd, h, "k_proj")?,
                        v: linear(&a, c.num_key_value_heads * hd, h, "v_proj")?,
                        o: linear(&a, h, c.num_attention_heads * hd, "o_proj")?,
                        q_norm: norm(&a, hd, "q_norm", c.rms_norm_eps)?,
                        k_norm: norm(&a, hd, "k_norm", c.rms_norm_eps)?,
                        heads: c.num_attention_heads,
                        kv_heads: c.num_key_value_heads,
                        head_dim: hd,
                    },
                    post_norm: norm(&p, h, "post_attention_layernorm", c.rms_norm_eps)?,
                    gate: linear(&m, c.intermediate_size, h, "gate_proj")?,
                    up: linear(&m, c.intermediate_size, h, "up_proj")?,
                    down: linear(&m, h, c.intermediate_size, "down_proj")?,
                })
            })()
            .map_err(missing)?;
            decoder.push(layer);
        }
        let final_norm = norm(&vb, h, "model.norm", c.rms_norm_eps).map_err(missing)?;
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / c.rope_theta.powf(2.0 * i as f64 / hd as f64) as f32)
            .collect();
        let inv_freq = Tensor::from_vec(inv, hd / 2, device)?;
        Ok(Self {
            config,
            embed,
            layers: decoder,
            norm: final_norm,
            inv_freq,
            device: device.clone(),
            dtype,
            attention: AttentionMode::Auto,
        })
    }

    /// The largest of the hidden-state `indices`, when the loaded layers can give them all.
    fn check_indices(&self, indices: &[usize]) -> Result<usize, ModelError> {
        let last = indices.iter().copied().max().unwrap_or(0);
        let (full, loaded) = (self.config.num_hidden_layers, self.layers.len());
        if last > full || last > loaded && last != full || last == full && loaded < full {
            return Err(ModelError::Invalid {
                path: PathBuf::new(),
                reason: format!("hidden state {last} needs more layers than the {loaded} loaded"),
            });
        }
        Ok(last)
    }

    /// Rotary tables of `positions` (`[b, s]`): cos and sin `[b, 1, s, head_dim]` in the model's
    /// dtype.
    fn rotary(&self, positions: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let angles = positions
            .to_dtype(DType::F32)?
            .unsqueeze(2)?
            .broadcast_mul(&self.inv_freq.reshape((1, 1, ()))?)?;
        let table = |t: Tensor| -> candle_core::Result<Tensor> {
            Tensor::cat(&[&t, &t], 2)?
                .unsqueeze(1)?
                .to_dtype(self.dtype)
        };
        Ok((table(angles.cos()?)?, table(angles.sin()?)?))
    }

    /// Chooses how attention is computed (tests compare the modes).
    pub fn set_attention(&mut self, mode: AttentionMode) {
        self.attention = mode;
    }

    /// The dtype of the weights and activations.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Hidden states `indices` (each in `0..=num_hidden_layers`, within the loaded layers) of a
    /// batch: `tokens`, `positions` and `segments` are `[batch, seq]`; a token attends to the tokens
    /// of its own segment at or before it. Returns one `[batch, seq, hidden]` tensor per index.
    pub fn hidden_states(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        segments: &Tensor,
        indices: &[usize],
    ) -> Result<Vec<Tensor>, ModelError> {
        let last = self.check_indices(indices)?;
        let full = self.config.num_hidden_layers;
        let (b, s) = tokens.dims2()?;
        let (cos, sin) = self.rotary(positions)?;
        let heads = self.config.num_attention_heads;
        let dense = match self.attention {
            AttentionMode::Dense => true,
            AttentionMode::Tiled(_) => false,
            AttentionMode::Auto => b
                .saturating_mul(heads)
                .saturating_mul(s)
                .saturating_mul(s)
                .le(&DENSE_MAX_SCORES),
        };
        let limits = if dense {
            // Mask [b, 1, s, s]: 0 where allowed, -inf elsewhere.
            let seg_q = segments.unsqueeze(2)?;
            let seg_k = segments.unsqueeze(1)?;
            let same = seg_q.broadcast_eq(&seg_k)?;
            let idx = Tensor::arange(0u32, s as u32, &self.device)?;
            let causal = idx.unsqueeze(1)?.broadcast_ge(&idx.unsqueeze(0)?)?;
            let allowed = same.broadcast_mul(&causal.unsqueeze(0)?)?;
            let zeros = Tensor::zeros((b, s, s), DType::F32, &self.device)?;
            let neg = Tensor::full(f32::NEG_INFINITY, (b, s, s), &self.device)?;
            Limits::Mask(allowed.where_cond(&zeros, &neg)?.unsqueeze(1)?)
        } else {
            let tile = match self.attention {
                AttentionMode::Tiled(n) => n.max(1),
                _ => ATTENTION_TILE,
            };
            Limits::Runs {
                runs: segment_runs(&segments.to_device(&Device::Cpu)?.to_vec2::<u32>()?),
                mask: causal_mask(tile, &self.device)?,
            }
        };
        let mut x = self.embed.forward(tokens)?;
        let mut out = Vec::with_capacity(indices.len());
        let mut states = vec![None; last + 1];
        states[0] = Some(x.clone());
        for (i, layer) in self.layers.iter().enumerate().take(last.min(full)) {
            x = layer.forward(&x, &cos, &sin, &limits, None)?;
            let k = i + 1;
            if k <= last {
                states[k] = Some(if k == full {
                    self.norm.forward(&x)?
                } else {
                    x.clone()
                });
            }
        }
        for &i in indices {
            out.push(states[i].clone().expect("computed above"));
        }
        Ok(out)
    }
}

/// The keys and values a sequence has seen, per decoder layer, for decoding step by step.
#[derive(Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on (the rejected tail of a speculative block).
    pub fn truncate(&mut self, len: usize) -> candle_core::Result<()> {
        if len >= self.len {
            return Ok(());
        }
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.narrow(1, 0, len)?;
            *v = v.narrow(1, 0, len)?;
        }
        self.len = len;
        Ok(())
    }
}

impl Qwen3 {
    /// Runs the next tokens of several sequences at once, each after what its cache holds (an
    /// empty cache: a prefill), packed in one row with attention confined to each sequence and
    /// computed by the same tiles as [`Qwen3::hidden_states`]; the caches take the new keys and
    /// values. Returns per sequence the hidden states `indices` of its new tokens, `[new, hidden]`
    /// each. Equal to running each whole sequence at once (the tests check 1e-5 in f32).
    pub fn extend(
        &self,
        caches: &mut [KvCache],
        tokens: &[&[u32]],
        indices: &[usize],
    ) -> Result<Vec<Vec<Tensor>>, ModelError> {
        let invalid = |reason: String| ModelError::Invalid {
            path: PathBuf::new(),
            reason,
        };
        if caches.len() != tokens.len() || tokens.iter().any(|t| t.is_empty()) {
            return Err(invalid(format!(
                "{} caches for {} sequences (each needs at least one new token)",
                caches.len(),
                tokens.len()
            )));
        }
        let last = self.check_indices(indices)?;
        let full = self.config.num_hidden_layers;
        let vocab = self.config.vocab_size as u32;
        if let Some(bad) = tokens.iter().flat_map(|t| t.iter()).find(|&&t| t >= vocab) {
            return Err(invalid(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let total: usize = tokens.iter().map(|t| t.len()).sum();
        let mut ids = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut runs = Vec::with_capacity(tokens.len());
        for (cache, new) in caches.iter().zip(tokens) {
            runs.push((ids.len(), new.len()));
            ids.extend_from_slice(new);
            positions.extend((cache.len..cache.len + new.len()).map(|p| p as u32));
        }
        let dev = &self.device;
        let ids = Tensor::from_vec(ids, (1, total), dev)?;
        let (cos, sin) = self.rotary(&Tensor::from_vec(positions, (1, total), dev)?)?;
        let tile = match self.attention {
            AttentionMode::Tiled(n) => n.max(1),
            _ => ATTENTION_TILE,
        };
        let limits = Limits::Runs {
            runs: vec![runs.clone()],
            mask: causal_mask(tile, dev)?,
        };
        // Every loaded layer runs, so that each cache holds all of them whatever `indices` asks.
        for cache in caches.iter_mut() {
            cache.layers.resize(self.layers.len(), None);
        }
        let mut x = self.embed.forward(&ids)?;
        let mut states = vec![None; last.max(self.layers.len()) + 1];
        states[0] = Some(x.clone());
        let mut layer_caches: Vec<Option<(Tensor, Tensor)>> = Vec::with_capacity(caches.len());
        for (i, layer) in self.layers.iter().enumerate() {
            layer_caches.clear();
            layer_caches.extend(caches.iter_mut().map(|c| c.layers[i].take()));
            x = layer.forward(&x, &cos, &sin, &limits, Some(&mut layer_caches))?;
            for (c, kv) in caches.iter_mut().zip(layer_caches.drain(..)) {
                c.layers[i] = kv;
            }
            let k = i + 1;
            states[k] = Some(if k == full {
                self.norm.forward(&x)?
            } else {
                x.clone()
            });
        }
        for (cache, new) in caches.iter_mut().zip(tokens) {
            cache.len += new.len();
        }
        let mut out = Vec::with_capacity(tokens.len());
        for &(start, len) in &runs {
            out.push(
                indices
                    .iter()
                    .map(|&i| {
                        states[i]
                            .as_ref()
                            .expect("computed above")
                            .i((0, start..start + len))
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?,
            );
        }
        Ok(out)
    }
}

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        limits: &Limits,
        cache: Option<&mut [Option<(Tensor, Tensor)>]>,
    ) -> candle_core::Result<Tensor> {
        let h = self
            .attention
            .forward(&self.input_norm.forward(x)?, cos, sin, limits, cache)?;
        let x = (x + h)?;
        let n = self.post_norm.forward(&x)?;
        let mlp = self
            .down
            .forward(&(candle_nn::ops::silu(&self.gate.forward(&n)?)? * self.up.forward(&n)?)?)?;
        x + mlp
    }
}

impl Attention {
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        limits: &Limits,
        mut cache: Option<&mut [Option<(Tensor, Tensor)>]>,
    ) -> candle_core::Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let d = self.head_dim;
        let split = |t: Tensor, heads: usize| -> candle_core::Result<Tensor> {
            t.reshape((b, s, heads, d))?.transpose(1, 2)?.contiguous()
        };
        let q = self
            .q_norm
            .forward(&split(self.q.forward(x)?, self.heads)?)?;
        let k = self
            .k_norm
            .forward(&split(self.k.forward(x)?, self.kv_heads)?)?;
        let v = split(self.v.forward(x)?, self.kv_heads)?;
        let rope = |t: &Tensor| -> candle_core::Result<Tensor> {
            t.broadcast_mul(cos)? + rotate_half(t)?.broadcast_mul(sin)?
        };
        let (q, k) = (rope(&q)?, rope(&k)?);
        let group = self.heads / self.kv_heads;
        let repeat = |t: Tensor| -> candle_core::Result<Tensor> {
            if group == 1 {
                return Ok(t);
            }
            t.unsqueeze(2)?
                .broadcast_as((b, self.kv_heads, group, s, d))?
                .reshape((b, self.heads, s, d))
        };
        let attn = match limits {
            Limits::Mask(mask) => {
                let (k, v) = (repeat(k)?, repeat(v)?);
                let f32 = |t: &Tensor| t.to_dtype(DType::F32);
                let scores =
                    (f32(&q)?.matmul(&f32(&k)?.t()?)? / (d as f64).sqrt())?.broadcast_add(mask)?;
                let probs = candle_nn::ops::softmax_last_dim(&scores)?;
                probs.matmul(&f32(&v)?.contiguous()?)?.to_dtype(q.dtype())?
            }
            Limits::Runs { runs, mask } => {
                let mut rows = Vec::with_capacity(b);
                for (r, row_runs) in runs.iter().enumerate() {
                    let (qr, kr, vr) = (q.get(r)?, k.get(r)?, v.get(r)?);
                    let mut pieces = Vec::with_capacity(row_runs.len());
                    for (j, &(start, len)) in row_runs.iter().enumerate() {
                        let (qj, kj, vj) = (
                            qr.narrow(1, start, len)?,
                            kr.narrow(1, start, len)?,
                            vr.narrow(1, start, len)?,
                        );
                        // With a KV cache (one row, one entry per run): the run's queries see
                        // the cached keys and values before their own, which join the cache.
                        let Some(entry) = cache.as_deref_mut().and_then(|c| c.get_mut(j)) else {
                            pieces.push(tiled_causal(&qj, &kj, &vj, mask)?);
                            continue;
                        };
                        let (k_all, v_all, offset) = match entry.take() {
                            None => (kj.contiguous()?, vj.contiguous()?, 0),
                            Some((kc, vc)) => {
                                let offset = kc.dim(1)?;
                                (
                                    Tensor::cat(&[&kc, &kj], 1)?,
                                    Tensor::cat(&[&vc, &vj], 1)?,
                                    offset,
                                )
                            }
                        };
                        pieces.push(tiled_causal_after(&qj, &k_all, &v_all, mask, offset)?);
                        *entry = Some((k_all, v_all));
                    }
                    rows.push(Tensor::cat(&pieces, 1)?);
                }
                Tensor::stack(&rows, 0)?
            }
        };
        let merged = attn.transpose(1, 2)?.reshape((b, s, self.heads * d))?;
        self.o.forward(&merged)
    }
}

/// Where each token may look: a dense additive mask `[b, 1, s, s]`, or per row the runs of equal
/// segment id (`(start, len)`, covering the row) for the tiled attention, with its diagonal
/// tile's causal mask.
enum Limits {
    Mask(Tensor),
    Runs {
        runs: Vec<Vec<(usize, usize)>>,
        mask: Tensor,
    },
}

/// The additive causal mask of a diagonal tile, `[tile, tile]` f32: query a sees key c when
/// c <= a. Its top-left corner serves a shorter last tile.
fn causal_mask(tile: usize, device: &Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..tile)
        .flat_map(|a| (0..tile).map(move |c| if c <= a { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (tile, tile), device)
}

/// Per row, the maximal runs of equal segment id as `(start, len)`. A segment must be one
/// contiguous run of its row (as packed and padded batches lay them out).
fn segment_runs(segments: &[Vec<u32>]) -> Vec<Vec<(usize, usize)>> {
    segments
        .iter()
        .map(|row| {
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (i, &id) in row.iter().enumerate() {
                match runs.last_mut() {
                    Some((start, len)) if row[*start] == id => *len += 1,
                    _ => runs.push((i, 1)),
                }
            }
            runs
        })
        .collect()
}

/// Causal attention of one sequence in tiles, flash-attention style: `q` is `[heads, n, d]`,
/// `k` and `v` are `[kv_heads, n, d]` (grouped-query attention without copying them per head).
/// Each tile of `tile` queries meets the key tiles up to its own, with a running maximum and sum
/// (online softmax), so no `[n, n]` score or mask is ever built: memory is `heads × tile²`
/// scores whatever `n`. The tile is `mask`'s size (from [`causal_mask`]). Computed in f32;
/// returns `[heads, n, d]` in `q`'s dtype.
fn tiled_causal(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    tiled_causal_after(q, k, v, mask, 0)
}

/// [`tiled_causal`] for queries that follow `offset` earlier positions (a KV cache): `q` holds
/// positions `offset..offset + nq`, `k` and `v` positions `0..offset + nq`. Query tiles are
/// aligned to the key tiles, so the tile that holds a query's own position is masked by a corner
/// of the same causal mask.
fn tiled_causal_after(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    offset: usize,
) -> candle_core::Result<Tensor> {
    let tile = mask.dim(0)?;
    let (heads, n, d) = q.dims3()?;
    let (kv, keys) = (k.dim(0)?, k.dim(1)?);
    if keys != offset + n {
        candle_core::bail!("{keys} keys for {n} queries after {offset} positions");
    }
    let group = heads / kv;
    let dtype = q.dtype();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let scale = 1.0 / (d as f64).sqrt();
    // [kv, group, n, d]: the queries of a key/value head side by side.
    let q = f32(q)?.reshape((kv, group, n, d))?;
    let (k, v) = (f32(k)?, f32(v)?);
    let mut out = Vec::with_capacity(n.div_ceil(tile) + 1);
    // Absolute query positions, in tiles aligned to multiples of `tile`.
    let mut qa = offset;
    while qa < offset + n {
        let diagonal = qa / tile * tile;
        let tq = (diagonal + tile).min(offset + n) - qa;
        let qt = (q.narrow(2, qa - offset, tq)?.reshape((kv, group * tq, d))? * scale)?;
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for kj in (0..=diagonal).step_by(tile) {
            let tk = tile.min(keys - kj);
            let kt = k.narrow(1, kj, tk)?;
            let mut scores = qt.matmul(&kt.t()?)?;
            if kj == diagonal {
                // Query qa + a sees key kj + c when c <= qa - kj + a: rows from qa - kj.
                let corner = mask.narrow(0, qa - kj, tq)?.narrow(1, 0, tk)?;
                scores = scores
                    .reshape((kv, group, tq, tk))?
                    .broadcast_add(&corner)?
                    .reshape((kv, group * tq, tk))?;
            }
            let tile_max = scores.max_keepdim(D::Minus1)?;
            let vt = v.narrow(1, kj, tk)?;
            state = Some(match state {
                None => {
                    let p = scores.broadcast_sub(&tile_max)?.exp()?;
                    let sum = p.sum_keepdim(D::Minus1)?;
                    (tile_max, sum, p.matmul(&vt)?)
                }
                Some((max, sum, acc)) => {
                    let new_max = max.maximum(&tile_max)?;
                    let p = scores.broadcast_sub(&new_max)?.exp()?;
                    let fix = (max - &new_max)?.exp()?;
                    let sum = ((sum * &fix)? + p.sum_keepdim(D::Minus1)?)?;
                    let acc = (acc.broadcast_mul(&fix)? + p.matmul(&vt)?)?;
                    (new_max, sum, acc)
                }
            });
        }
        let (_, sum, acc) = state.expect("the diagonal tile is always visited");
        out.push(
            acc.broadcast_div(&sum)?
                .reshape((kv, group, tq, d))?
                .reshape((heads, tq, d))?,
        );
        qa += tq;
    }
    Tensor::cat(&out, 1)?.to_dtype(dtype)
}

/// The target's frozen embedding and output head (`[vocab, hidden]` each, in `dtype`; the
/// embedding twice when the model ties them), for the drafter.
pub fn load_heads(
    dir: &Path,
    device: &Device,
    dtype: DType,
) -> Result<(Tensor, Tensor), ModelError> {
    // The heads of any target (a torch target's feeds the candle drafter too).
    let config = dflash_common::dflash::read_config_for(dir, dflash_common::dflash::Engine::Torch)?;
    let files = weight_files(dir)?;
    // SAFETY: the weight files are read-only inputs, not modified while the tensors live.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device) }
        .map_err(|e| invalid(dir, format!("cannot map the weights: {e}")))?;
    let shape = (config.vocab_size, config.hidden_size);
    let missing =
        |e: candle_core::Error| invalid(dir, format!("weights do not match config.json: {e}"));
    let embedding = vb
        .get(shape, "model.embed_tokens.weight")
        .map_err(missing)?;
    let lm_head = if config.tie_word_embeddings {
        embedding.clone()
    } else {
        vb.get(shape, "lm_head.weight").map_err(missing)?
    };
    Ok((embedding, lm_head))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn randn(shape: (usize, usize, usize), seed: u64) -> Tensor {
        let mut rng = SplitMix64(seed);
        let n = shape.0 * shape.1 * shape.2;
        let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Causal attention of one sequence with dense scores: the reference.
    fn dense(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let (heads, n, d) = q.dims3().unwrap();
        let kv = k.dim(0).unwrap();
        let group = heads / kv;
        let repeat = |t: &Tensor| {
            t.unsqueeze(1)
                .unwrap()
                .broadcast_as((kv, group, n, d))
                .unwrap()
                .reshape((heads, n, d))
                .unwrap()
        };
        let mask: Vec<f32> = (0..n)
            .flat_map(|i| (0..n).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, n, n), &Device::Cpu).unwrap();
        let scores = (q.matmul(&repeat(k).t().unwrap()).unwrap() / (d as f64).sqrt())
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        candle_nn::ops::softmax_last_dim(&scores)
            .unwrap()
            .matmul(&repeat(v))
            .unwrap()
    }

    /// Tiles equal dense attention within 1e-5: lengths below, at, just above and far above the
    /// tile (the last tile partial), a single token, grouped-query and plain heads.
    #[test]
    fn tiled_attention_equals_dense() {
        for (heads, kv) in [(4, 2), (4, 4), (6, 1)] {
            for (n, tile) in [(1, 4), (3, 4), (4, 4), (5, 4), (37, 8), (64, 16), (50, 7)] {
                let seed = (heads * 1000 + kv * 100 + n * 10 + tile) as u64;
                let q = randn((heads, n, 8), seed);
                let k = randn((kv, n, 8), seed + 1);
                let v = randn((kv, n, 8), seed + 2);
                let want = dense(&q, &k, &v);
                let got =
                    tiled_causal(&q, &k, &v, &causal_mask(tile, &Device::Cpu).unwrap()).unwrap();
                let diff = super::super::max_abs_diff(&want, &got).unwrap();
                assert!(
                    diff < 1e-5,
                    "heads {heads}/{kv}, n {n}, tile {tile}: {diff}"
                );
            }
        }
    }

    #[test]
    fn segment_runs_cover_each_row() {
        let rows = vec![vec![0, 0, 1, 1, 1, 7], vec![u32::MAX; 3], vec![2]];
        assert_eq!(
            segment_runs(&rows),
            vec![vec![(0, 2), (2, 3), (5, 1)], vec![(0, 3)], vec![(0, 1)]]
        );
    }
}
