//! `dflash-worker --drafter-bench REQUEST`: timed training steps of the candle drafter on this
//! worker's device at any shape, without a target model (random features and heads of the
//! target's widths), as the GPU check runs it at the seeds' shape. The torch engine answers the
//! same request (`python -m dflash_orch.bench_step`), so both engines are timed on one workload.
//!
//! A step is what `DrafterStage` does with one micro-batch per optimiser step: per sequence,
//! anchors from the loss mask; the drafter's loss and gradients in anchor chunks; clipping to the
//! global norm; AdamW.

use std::time::Instant;

use candle_core::{Device, Tensor};
use dflash_common::dflash::{Precision, Qwen3Config};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::dflash::{dtype, sample_anchors};
use crate::model::drafter::{Drafter, DrafterConfig, Heads, MicroBatch, Objective};
use crate::train::{Accumulator, AdamW, AdamWConfig, clip_grad_norm};

/// The workload of `--drafter-bench`, one JSON object.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterBench {
    /// The target's `config.json` fields that shape the drafter (widths, heads, vocabulary).
    pub target: Qwen3Config,
    pub draft_layers: usize,
    pub target_layer_ids: Vec<usize>,
    pub block_size: usize,
    pub num_anchors: usize,
    /// Anchors per chunk (none: all at once).
    #[serde(default)]
    pub anchor_chunk: Option<usize>,
    /// Sequences per step, each `seq_len` tokens, the first `prompt` without loss.
    pub sequences: usize,
    pub seq_len: usize,
    pub prompt: usize,
    pub dtype: Precision,
    #[serde(default)]
    pub gamma: Option<f64>,
    /// Untimed steps, then timed ones.
    pub warmup: usize,
    pub steps: usize,
    #[serde(default)]
    pub seed: u64,
}

impl DrafterBench {
    /// Reads and checks a request: every size positive and consistent, so a bad one is refused
    /// with the field's name before anything is allocated.
    pub fn parse(text: &str) -> Result<Self, String> {
        let b: Self =
            serde_json::from_str(text).map_err(|e| format!("not a drafter-bench request: {e}"))?;
        let t = &b.target;
        let sizes = [
            ("target.vocab_size", t.vocab_size),
            ("target.hidden_size", t.hidden_size),
            ("target.intermediate_size", t.intermediate_size),
            ("target.num_attention_heads", t.num_attention_heads),
            ("target.num_key_value_heads", t.num_key_value_heads),
            ("draft_layers", b.draft_layers),
            ("block_size", b.block_size),
            ("num_anchors", b.num_anchors),
            ("sequences", b.sequences),
            ("seq_len", b.seq_len),
            ("steps", b.steps),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be at least 1"));
        }
        if !t.num_attention_heads.is_multiple_of(t.num_key_value_heads) {
            return Err(format!(
                "target.num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                t.num_attention_heads, t.num_key_value_heads
            ));
        }
        if b.prompt + 2 > b.seq_len {
            return Err(format!(
                "prompt ({}) leaves no token with loss in sequences of {}",
                b.prompt, b.seq_len
            ));
        }
        if b.target_layer_ids.is_empty() {
            return Err("target_layer_ids is empty".into());
        }
        if b.anchor_chunk == Some(0) {
            return Err("anchor_chunk must be at least 1".into());
        }
        // The features (tokens × layers × hidden) and each head (vocab × hidden) are made in one
        // piece each: at most 2^32 elements, far past what the seeds' shape needs.
        let features = (b.sequences as u128)
            * (b.seq_len as u128)
            * (b.target_layer_ids.len() as u128)
            * (t.hidden_size as u128);
        let head = (t.vocab_size as u128) * (t.hidden_size as u128);
        if features.max(head) > u128::from(u32::MAX) {
            return Err(format!(
                "{} elements in one tensor (features {features}, a head {head}): at most 2^32 - 1, no device holds more",
                features.max(head)
            ));
        }
        Ok(b)
    }
}

/// The median of `values` (NaN for none).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// One optimiser step of the drafter stage with one micro-batch per step (as `DrafterStage`
/// trains with `--accum 1`): the loss and gradients, clipping to `clip`, AdamW at `lr`. Returns
/// the loss (NaN when the batch had nothing to learn from) and the gradients' norm.
#[allow(clippy::too_many_arguments)]
pub fn train_step(
    drafter: &Drafter,
    opt: &mut AdamW,
    accum: &mut Accumulator,
    batch: MicroBatch<'_>,
    heads: Heads<'_>,
    objective: Objective,
    anchor_chunk: Option<usize>,
    (clip, lr): (f64, f64),
) -> candle_core::Result<(f64, f64)> {
    let (grads, parts) = drafter.micro_batch(batch, heads, objective, anchor_chunk, 1)?;
    let Some(grads) = grads else {
        return Ok((f64::NAN, 0.0));
    };
    accum.sum(grads)?;
    accum.micro += 1;
    let mut norm = 0.0;
    if let Some(mut grads) = accum.take() {
        norm = clip_grad_norm(&mut grads, clip)?;
        opt.step(&grads, lr)?;
    }
    Ok((parts.loss, norm))
}

/// Runs the bench on `device`; the answer is one JSON object (per-step seconds, the median,
/// tokens/s, the losses).
pub fn drafter_bench(b: &DrafterBench, device: &Device) -> Result<Value, String> {
    let err = |e: candle_core::Error| e.to_string();
    let t = &b.target;
    let compute = dtype(b.dtype);
    let config = DrafterConfig::for_target(
        t,
        b.draft_layers,
        b.block_size,
        (t.vocab_size - 1) as u32,
        b.target_layer_ids.clone(),
    );
    let drafter = Drafter::new(config, b.seed, device)
        .map_err(err)?
        .with_compute(compute);
    // Deterministic values of no pattern a drafter can exploit, made on the device (no host copy
    // of a 151,936-row head): sin(i · φ · k) · scale.
    let filler = |rows: usize, cols: usize, k: f64, scale: f64| -> Result<Tensor, String> {
        Tensor::arange(0u32, (rows * cols) as u32, device)
            .and_then(|i| i.to_dtype(candle_core::DType::F32))
            .and_then(|i| (i * (0.618_033_988_7 * k))?.sin())
            .and_then(|x| x * scale)
            .and_then(|x| x.reshape((rows, cols)))
            .and_then(|x| x.to_dtype(compute))
            .map_err(err)
    };
    let (embedding, lm_head) = (
        filler(t.vocab_size, t.hidden_size, 1.0, 0.02)?,
        filler(t.vocab_size, t.hidden_size, 1.7, 0.02)?,
    );
    let tokens_n = b.sequences * b.seq_len;
    let width = b.target_layer_ids.len() * t.hidden_size;
    let features = filler(tokens_n, width, 2.3, 1.0)?;
    let mut mix = crate::rng::SplitMix64(b.seed ^ 0x5EED_7070_4B3E_0001);
    let tokens: Vec<u32> = (0..tokens_n)
        .map(|_| (mix.next_u64() % (t.vocab_size as u64 - 1).max(1)) as u32)
        .collect();
    let masks: Vec<u8> = (0..tokens_n)
        .map(|i| u8::from(i % b.seq_len >= b.prompt))
        .collect();
    let vars = drafter.params.iter().map(|p| p.var.clone()).collect();
    let mut opt = AdamW::new(vars, AdamWConfig::default()).map_err(err)?;
    let mut accum = Accumulator::default();
    let (mut times, mut losses) = (Vec::new(), Vec::new());
    for step in 0..b.warmup + b.steps {
        device.synchronize().map_err(err)?;
        let started = Instant::now();
        let sequences: Vec<_> = (0..b.sequences)
            .filter_map(|i| {
                let range = i * b.seq_len..(i + 1) * b.seq_len;
                let picked = sample_anchors(
                    &masks[range.clone()],
                    b.num_anchors,
                    b.seed,
                    step as u64,
                    i as u64,
                );
                (!picked.is_empty()).then_some((range, picked))
            })
            .collect();
        let (loss, _) = train_step(
            &drafter,
            &mut opt,
            &mut accum,
            MicroBatch {
                features: &features,
                tokens: &tokens,
                loss_mask: &masks,
                sequences: &sequences,
            },
            Heads {
                embedding: &embedding,
                lm_head: &lm_head,
            },
            Objective {
                gamma: b.gamma,
                distill: None,
                dpace: None,
            },
            b.anchor_chunk,
            (1.0, 6e-4),
        )
        .map_err(err)?;
        device.synchronize().map_err(err)?;
        if step >= b.warmup {
            times.push(started.elapsed().as_secs_f64());
        }
        losses.push(loss);
    }
    let m = median(&times);
    Ok(json!({
        "engine": "candle",
        "device": if device.is_cuda() { "cuda" } else { "cpu" },
        "dtype": b.dtype.name(),
        "tokens": tokens_n,
        "step_s": times,
        "median_s": m,
        "tokens_per_s": tokens_n as f64 / m,
        "losses": losses,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(extra: Value) -> String {
        let mut r = json!({
            "target": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6},
            "draft_layers": 1, "target_layer_ids": [0, 2], "block_size": 4, "num_anchors": 6,
            "sequences": 2, "seq_len": 40, "prompt": 4, "dtype": "f32", "warmup": 1, "steps": 2
        });
        for (k, v) in extra.as_object().unwrap() {
            r[k] = v.clone();
        }
        r.to_string()
    }

    /// The bench trains: the loss of a small drafter falls over its steps, and each step is timed.
    #[test]
    fn the_drafter_bench_times_real_training_steps() {
        let b = DrafterBench::parse(&request(json!({"steps": 6, "anchor_chunk": 4}))).unwrap();
        let out = drafter_bench(&b, &Device::Cpu).unwrap();
        assert_eq!(out["step_s"].as_array().unwrap().len(), 6);
        assert_eq!(out["tokens"], 80);
        let losses: Vec<f64> = out["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
        assert!(losses[6] < losses[0], "{losses:?}");
    }

    /// A bad request is refused naming the field, before anything is allocated.
    #[test]
    fn a_bad_drafter_bench_request_is_refused() {
        for (bad, needle) in [
            (json!({"sequences": 0}), "sequences"),
            (json!({"prompt": 39}), "prompt"),
            (json!({"target_layer_ids": []}), "target_layer_ids"),
            (json!({"anchor_chunk": 0}), "anchor_chunk"),
            (json!({"dtype": "f8"}), "drafter-bench"),
            (
                json!({"seq_len": 1_000_000_000, "sequences": 1_000_000}),
                "no device",
            ),
            (json!({"unknown": 1}), "unknown"),
        ] {
            let e = DrafterBench::parse(&request(bad.clone())).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
        let mut heads = serde_json::from_str::<Value>(&request(json!({}))).unwrap();
        heads["target"]["num_key_value_heads"] = json!(3);
        assert!(
            DrafterBench::parse(&heads.to_string())
                .unwrap_err()
                .contains("multiple")
        );
        assert!(DrafterBench::parse("{").is_err());
    }
}
