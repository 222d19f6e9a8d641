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

use candle_core::{DType, Device, Module, Tensor};
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

/// A Qwen3 target model (weights memory-mapped).
pub struct Qwen3 {
    pub config: Qwen3Config,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    inv_freq: Tensor,
    device: Device,
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
    /// Loads the model in `dir`, running at most `layers` decoder layers (`None`: all).
    pub fn load(dir: &Path, layers: Option<usize>, device: &Device) -> Result<Self, ModelError> {
        let config = read_config(dir)?;
        let files = weight_files(dir)?;
        // SAFETY: the weight files are read-only inputs, not modified while the model lives.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, device) }
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
        })
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
        let last = indices.iter().copied().max().unwrap_or(0);
        let full = self.config.num_hidden_layers;
        if last > full
            || last > self.layers.len() && last != full
            || last == full && self.layers.len() < full
        {
            return Err(ModelError::Invalid {
                path: PathBuf::new(),
                reason: format!(
                    "hidden state {last} needs more layers than the {} loaded",
                    self.layers.len()
                ),
            });
        }
        let (b, s) = tokens.dims2()?;
        // Rotary tables per token: [b, s, head_dim / 2] angles.
        let angles = positions
            .to_dtype(DType::F32)?
            .unsqueeze(2)?
            .broadcast_mul(&self.inv_freq.reshape((1, 1, ()))?)?;
        let cos = Tensor::cat(&[&angles.cos()?, &angles.cos()?], 2)?.unsqueeze(1)?;
        let sin = Tensor::cat(&[&angles.sin()?, &angles.sin()?], 2)?.unsqueeze(1)?;
        // Mask [b, 1, s, s]: 0 where allowed, -inf elsewhere.
        let seg_q = segments.unsqueeze(2)?;
        let seg_k = segments.unsqueeze(1)?;
        let same = seg_q.broadcast_eq(&seg_k)?;
        let idx = Tensor::arange(0u32, s as u32, &self.device)?;
        let causal = idx.unsqueeze(1)?.broadcast_ge(&idx.unsqueeze(0)?)?;
        let allowed = same.broadcast_mul(&causal.unsqueeze(0)?)?;
        let zeros = Tensor::zeros((b, s, s), DType::F32, &self.device)?;
        let neg = Tensor::full(f32::NEG_INFINITY, (b, s, s), &self.device)?;
        let mask = allowed.where_cond(&zeros, &neg)?.unsqueeze(1)?;

        let mut x = self.embed.forward(tokens)?;
        let mut out = Vec::with_capacity(indices.len());
        let mut states = vec![None; last + 1];
        states[0] = Some(x.clone());
        for (i, layer) in self.layers.iter().enumerate().take(last.min(full)) {
            x = layer.forward(&x, &cos, &sin, &mask)?;
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

impl Layer {
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let h = self
            .attention
            .forward(&self.input_norm.forward(x)?, cos, sin, mask)?;
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
        mask: &Tensor,
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
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let attn = probs.matmul(&v.contiguous()?)?;
        let merged = attn.transpose(1, 2)?.reshape((b, s, self.heads * d))?;
        self.o.forward(&merged)
    }
}

/// The target's frozen embedding and output head (`[vocab, hidden]` each; the embedding twice
/// when the model ties them), for the drafter.
pub fn load_heads(dir: &Path, device: &Device) -> Result<(Tensor, Tensor), ModelError> {
    let config = read_config(dir)?;
    let files = weight_files(dir)?;
    // SAFETY: the weight files are read-only inputs, not modified while the tensors live.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, device) }
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
