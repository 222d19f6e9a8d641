//! Served acceptance during training (`--eval-every N`): every N optimiser steps, and at the end,
//! τ of the checkpoint just written, measured by greedy speculative decoding on held-out prompts
//! by a `dflash-worker --eval` process of its own (the eval command's worker), so training goes
//! on meanwhile.
//!
//! The prompts are a file the user gives (`--eval-prompts`) or samples of the store held out of
//! every plan (`--eval-holdout`, chosen from the seed): their tokens before the first loss token.
//! They are checked at launch and written to `RUN_DIR/eval/prompts.jsonl`. Each evaluated
//! checkpoint is hard-linked into `RUN_DIR/eval/step-N/` first, so rotation cannot remove it
//! under the decoder.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use dflash_common::dflash::{DflashSettings, Precision};
use dflash_common::eval::{EVAL_VERSION, EvalRequest};
use serde::{Deserialize, Serialize};

use crate::planner::rng::{PlanRng, Purpose};

/// `--eval-*`: what the run evaluates and how often.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalConfig {
    /// Optimiser steps between evaluations (and one at the end).
    pub every: u64,
    /// The user's prompts file; `None`: samples held out of the store.
    pub prompts: Option<PathBuf>,
    /// Samples of the store held out of training (and evaluated on) when `prompts` is `None`.
    pub holdout: u32,
    pub max_new_tokens: u32,
}

/// The held-out samples of a dataset of `len` samples: `n` distinct indices drawn from `seed`,
/// sorted.
pub fn held_out(len: usize, n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    PlanRng::stream(seed, 0, Purpose::HeldOut).shuffle(&mut order);
    order.truncate(n);
    order.sort_unstable();
    order
}

/// A sample's prompt: its tokens before the first loss token (`None` when that is nothing).
pub fn prompt_of(tokens: &[u32], loss_mask: &[u8]) -> Option<Vec<u32>> {
    let cut = loss_mask
        .iter()
        .position(|&m| m != 0)
        .unwrap_or(tokens.len());
    (cut > 0).then(|| tokens[..cut].to_vec())
}

/// Where the run keeps what its evaluations read.
pub fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join("eval")
}

/// Writes the prompts (one `{"input_ids": [...]}` line each) for the evaluations.
pub fn write_prompts(run_dir: &Path, prompts: &[Vec<u32>]) -> std::io::Result<PathBuf> {
    let dir = dir(run_dir);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("prompts.jsonl");
    crate::fsutil::write_atomically(&path, |out| {
        use std::io::Write;
        for p in prompts {
            writeln!(out, "{}", serde_json::json!({ "input_ids": p }))?;
        }
        Ok(())
    })?;
    Ok(path)
}

/// What one evaluation measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub step: u64,
    pub tau: f64,
    pub pooled_tau: f64,
    pub histogram: Vec<f64>,
    pub prompts: usize,
    pub tokens: usize,
    pub seconds: f64,
}

/// The evaluation running on its thread.
struct InFlight {
    step: u64,
    result: mpsc::Receiver<Result<Outcome, String>>,
    /// Kills its worker and ends it.
    stop: Arc<AtomicBool>,
}

/// Evaluations of the run's checkpoints, one at a time, on threads of their own. Nothing here
/// blocks the run's loop: it keeps answering the control socket and signals while one runs, and
/// a worker that stops answering is killed at its deadline.
pub struct Evaluator {
    pub config: EvalConfig,
    prompts: Vec<Vec<u32>>,
    run_dir: PathBuf,
    target_model: PathBuf,
    block_size: usize,
    stop_token_ids: Vec<u32>,
    dtype: Precision,
    gpu: Option<u32>,
    /// The torch engine's Python when the run's drafter is on torch (its evaluations decode
    /// there too); none: candle.
    torch: Option<dflash_common::dflash::TorchRuntime>,
    in_flight: Option<InFlight>,
    /// `--job-timeout` (seconds per prompt); `None`: auto, the larger of 120 s and ten times the
    /// slowest prompt of the evaluations so far.
    job_timeout_s: Option<f64>,
    /// Seconds per prompt of the slowest evaluation so far.
    slowest_prompt_s: f64,
    /// Set once the run is interrupted: the evaluation in flight is killed, no other starts.
    cancelled: bool,
    /// The newest step evaluated or being evaluated.
    pub last_step: Option<u64>,
    /// The newest result.
    pub last: Option<Outcome>,
}

impl Evaluator {
    pub fn new(
        config: EvalConfig,
        prompts: Vec<Vec<u32>>,
        run_dir: &Path,
        settings: &DflashSettings,
        gpu: Option<u32>,
        job_timeout_s: Option<f64>,
    ) -> Result<Self, String> {
        Ok(Self {
            config,
            prompts,
            run_dir: run_dir.to_path_buf(),
            target_model: settings.target_model.clone(),
            block_size: settings.block_size,
            stop_token_ids: crate::commands::eval::eos_tokens(&settings.target_model)?,
            dtype: settings.dtype,
            gpu,
            torch: settings
                .torch
                .clone()
                .filter(|_| settings.engines.uses(dflash_common::dflash::Engine::Torch)),
            in_flight: None,
            job_timeout_s,
            slowest_prompt_s: 0.0,
            cancelled: false,
            last_step: None,
            last: None,
        })
    }

    /// Whether step `step`'s checkpoint is one to evaluate.
    pub fn due(&self, step: u64) -> bool {
        step > 0 && step.is_multiple_of(self.config.every.max(1))
    }

    /// Starts evaluating the checkpoint of `step` (written or being written under
    /// `checkpoints`); one evaluation at a time: a step due while one runs is skipped.
    pub fn start(&mut self, step: u64, checkpoints: &Path) -> bool {
        if self.cancelled || self.in_flight.is_some() || self.last_step.is_some_and(|s| s >= step) {
            return false;
        }
        let (tx, rx) = mpsc::channel();
        let request = EvalRequest {
            version: EVAL_VERSION,
            target_model: self.target_model.clone(),
            drafter: dir(&self.run_dir).join(format!("step-{step}")),
            block_size: self.block_size,
            prompts: self.prompts.clone(),
            max_new_tokens: self.config.max_new_tokens as usize,
            stop_token_ids: self.stop_token_ids.clone(),
            dtype: self.dtype,
            baseline: false,
            init_seed: None,
            torch: self.torch.clone(),
            // The in-training τ is greedy: comparable from step to step, free of draws.
            sampling: None,
        };
        let source = checkpoints.join(format!("step-{step}"));
        let gpu = self.gpu;
        let deadline = Duration::from_secs_f64(
            self.job_timeout_s
                .unwrap_or_else(|| (10.0 * self.slowest_prompt_s).max(120.0)),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let stop_here = Arc::clone(&stop);
        let spawned = std::thread::Builder::new()
            .name(format!("eval-step-{step}"))
            .spawn(move || {
                let watch = crate::commands::eval::Watch {
                    deadline,
                    stop: &stop_here,
                };
                let _ = tx.send(evaluate(step, &source, &request, gpu, &watch));
            });
        if spawned.is_err() {
            return false;
        }
        self.in_flight = Some(InFlight {
            step,
            result: rx,
            stop,
        });
        self.last_step = Some(step);
        true
    }

    /// Whether an evaluation is running.
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Kills the evaluation in flight (it ends as failed, "interrupted") and starts no other.
    pub fn cancel(&mut self) {
        self.cancelled = true;
        if let Some(f) = &self.in_flight {
            f.stop.store(true, Ordering::SeqCst);
        }
    }

    /// Whether [`Evaluator::cancel`] was called.
    pub fn cancelled(&self) -> bool {
        self.cancelled
    }

    /// The evaluation that finished since the last call, if one did.
    pub fn poll(&mut self) -> Option<(u64, Result<Outcome, String>)> {
        let f = self.in_flight.as_ref()?;
        let step = f.step;
        let result = match f.result.try_recv() {
            Ok(r) => r,
            Err(mpsc::TryRecvError::Empty) => return None,
            Err(mpsc::TryRecvError::Disconnected) => Err("the evaluation thread died".into()),
        };
        self.in_flight = None;
        if let Ok(o) = &result {
            self.slowest_prompt_s = self
                .slowest_prompt_s
                .max(o.seconds / o.prompts.max(1) as f64);
            self.last = Some(o.clone());
        }
        Some((step, result))
    }
}

/// Waits for the checkpoint directory `source` (renamed into place when complete), links its
/// files into the request's drafter directory, and decodes.
fn evaluate(
    step: u64,
    source: &Path,
    request: &EvalRequest,
    gpu: Option<u32>,
    watch: &crate::commands::eval::Watch<'_>,
) -> Result<Outcome, String> {
    let started = Instant::now();
    let files = ["config.json", "model.safetensors"];
    while !files.iter().all(|f| source.join(f).is_file()) {
        if watch.stop.load(Ordering::SeqCst) {
            return Err("interrupted before the checkpoint was written".into());
        }
        if started.elapsed() > watch.deadline {
            return Err(format!(
                "{} did not appear within {} s (--job-timeout)",
                source.display(),
                watch.deadline.as_secs_f64()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let target = &request.drafter;
    std::fs::create_dir_all(target).map_err(|e| format!("{}: {e}", target.display()))?;
    for f in files {
        let to = target.join(f);
        let _ = std::fs::remove_file(&to);
        std::fs::hard_link(source.join(f), &to)
            .or_else(|_| std::fs::copy(source.join(f), &to).map(|_| ()))
            .map_err(|e| format!("cannot keep {} for evaluation: {e}", source.display()))?;
    }
    // On CPUs, one thread: training keeps the rest.
    let threads = gpu.is_none().then_some(1);
    let results = crate::commands::eval::run_worker(request, gpu, threads, watch, |_| {});
    // The links keep the checkpoint's space in use: gone once decoded.
    let _ = std::fs::remove_dir_all(target);
    let results = results.map_err(|e| e.to_string())?;
    let lines: Vec<usize> = (1..=results.len()).collect();
    let device = gpu.map_or_else(|| "cpu".to_owned(), |g| format!("gpu:{g}"));
    let s = crate::commands::eval::summarize(&results, &lines, request, device);
    Ok(Outcome {
        step,
        tau: s.tau,
        pooled_tau: s.pooled_tau,
        histogram: s.histogram,
        prompts: s.prompts,
        tokens: s.tokens,
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_out_samples_are_distinct_sorted_and_follow_the_seed() {
        let a = held_out(1000, 32, 7);
        assert_eq!(a.len(), 32);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(a, held_out(1000, 32, 7));
        assert_ne!(a, held_out(1000, 32, 8));
        assert_eq!(held_out(5, 32, 1), vec![0, 1, 2, 3, 4]);
        assert!(held_out(0, 32, 1).is_empty());
    }

    #[test]
    fn a_prompt_ends_before_the_first_loss_token() {
        assert_eq!(prompt_of(&[1, 2, 3, 4], &[0, 0, 1, 1]), Some(vec![1, 2]));
        assert_eq!(prompt_of(&[1, 2], &[0, 0]), Some(vec![1, 2]));
        assert_eq!(prompt_of(&[1, 2], &[1, 1]), None);
    }
}
