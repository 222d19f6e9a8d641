//! Generation by the target: a batch of prompts decoded together (packed into one row per step,
//! each with its own KV cache), greedily or by sampling at a temperature, each prompt's random
//! draws from a stream of its own (seed, row), so the output of a row does not depend on the
//! batch it was decoded in. `dflash-worker --generate` serves batches read from stdin.

use std::io::{BufRead, Write};
use std::path::Path;

use candle_core::{DType, Tensor};
use dflash_common::eval::{GenerateDone, GenerateJob, GenerateRequest};

use crate::model::qwen3::{KvCache, Qwen3};
use crate::rng::SplitMix64;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: the argmax.
    pub temperature: f64,
    pub seed: u64,
}

/// The token `logits` (f32, one row) give: the argmax, or a draw from softmax(logits / T).
fn choose(logits: &[f32], temperature: f64, rng: &mut SplitMix64) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &l)| {
                if l > best.1 { (i, l) } else { best }
            })
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| (f64::from(l - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    if !(total.is_finite() && total > 0.0) {
        return argmax();
    }
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    argmax()
}

/// Decodes `prompts` (row, tokens) together: per prompt, up to `max_new_tokens` new tokens,
/// ending after the first of `stop`.
pub fn generate_batch(
    model: &Qwen3,
    lm_head: &Tensor,
    prompts: &[(u64, Vec<u32>)],
    max_new_tokens: usize,
    stop: &[u32],
    sampling: Sampling,
) -> Result<Vec<Vec<u32>>, String> {
    if let Some((row, _)) = prompts.iter().find(|(_, p)| p.is_empty()) {
        return Err(format!("row {row}: an empty prompt"));
    }
    let full = model.config.num_hidden_layers;
    let head = lm_head.t().map_err(err)?;
    let mut caches = vec![KvCache::default(); prompts.len()];
    let mut rngs: Vec<SplitMix64> = prompts
        .iter()
        .map(|(row, _)| {
            let mut mix = SplitMix64(sampling.seed ^ row.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            SplitMix64(mix.next_u64())
        })
        .collect();
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    // Sequences still decoding, and the tokens each runs next.
    let mut active: Vec<usize> = if max_new_tokens == 0 {
        Vec::new()
    } else {
        (0..prompts.len()).collect()
    };
    let mut next: Vec<Vec<u32>> = prompts.iter().map(|(_, p)| p.clone()).collect();
    while !active.is_empty() {
        let mut step_caches: Vec<KvCache> = active
            .iter()
            .map(|&i| std::mem::take(&mut caches[i]))
            .collect();
        let tokens: Vec<&[u32]> = active.iter().map(|&i| next[i].as_slice()).collect();
        let states = model
            .extend(&mut step_caches, &tokens, &[full])
            .map_err(err)?;
        for (&i, cache) in active.iter().zip(step_caches) {
            caches[i] = cache;
        }
        // The last position of each sequence, all in one matmul.
        let last: Vec<Tensor> = states
            .iter()
            .map(|s| {
                let n = s[0].dim(0)?;
                s[0].narrow(0, n - 1, 1)
            })
            .collect::<candle_core::Result<_>>()
            .map_err(err)?;
        let logits = Tensor::cat(&last, 0)
            .and_then(|x| x.matmul(&head))
            .and_then(|l| l.to_dtype(DType::F32))
            .and_then(|l| l.to_vec2::<f32>())
            .map_err(err)?;
        let mut still = Vec::with_capacity(active.len());
        for (&i, row_logits) in active.iter().zip(&logits) {
            let token = choose(row_logits, sampling.temperature, &mut rngs[i]);
            outputs[i].push(token);
            next[i] = vec![token];
            if outputs[i].len() < max_new_tokens && !stop.contains(&token) {
                still.push(i);
            } else {
                caches[i] = KvCache::default();
            }
        }
        active = still;
    }
    Ok(outputs)
}

/// `dflash-worker --generate REQUEST.json`: loads the target, then answers each batch read from
/// stdin (a [`GenerateJob`] line) with a [`GenerateDone`] line on stdout, until stdin closes.
pub fn run_generate(request: &Path) -> Result<(), String> {
    let req: GenerateRequest =
        crate::speculative::read_request(request, |r: &GenerateRequest| r.version)?;
    if let Some(runtime) = &req.torch {
        let req = GenerateRequest {
            target_model: crate::speculative::absolute(&req.target_model)?,
            ..req.clone()
        };
        return crate::torch::decode("generate", &req, runtime);
    }
    let (_, model, _, lm_head) = crate::speculative::load_target(&req.target_model, req.dtype)?;
    let sampling = Sampling {
        temperature: req.temperature,
        seed: req.seed,
    };
    let mut stdout = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("cannot read a job: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let job: GenerateJob =
            serde_json::from_str(&line).map_err(|e| format!("a bad job line: {e}"))?;
        let outputs = generate_batch(
            &model,
            &lm_head,
            &job.prompts,
            req.max_new_tokens,
            &req.stop_token_ids,
            sampling,
        )?;
        let done = GenerateDone {
            batch: job.batch,
            outputs,
        };
        let line = serde_json::to_string(&done).map_err(err)?;
        writeln!(stdout, "{line}")
            .and_then(|()| stdout.flush())
            .map_err(|e| format!("cannot write a result: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_follows_the_temperature() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let mut rng = SplitMix64(1);
        assert_eq!(choose(&logits, 0.0, &mut rng), 1);
        // Near-zero temperature: the argmax; high temperature: every token, in proportion.
        assert!((0..200).all(|_| choose(&logits, 1e-3, &mut rng) == 1));
        let mut counts = [0u32; 4];
        for _ in 0..20_000 {
            counts[choose(&logits, 1.0, &mut rng) as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for (i, &l) in logits.iter().enumerate() {
            let want = f64::from(l).exp() / z;
            let got = f64::from(counts[i]) / 20_000.0;
            assert!((got - want).abs() < 0.02, "token {i}: {got} vs {want}");
        }
    }
}
