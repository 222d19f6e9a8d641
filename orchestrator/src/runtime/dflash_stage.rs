//! Launch-time side of `--stage dflash`: every check that can fail is made here, before any worker
//! starts, and the settings every worker reads are written to the run directory.

use std::path::{Path, PathBuf};

use dflash_common::dflash::{self, DflashSettings, Qwen3Config};

use super::spec::Device;
use super::{RunError, Tokens};
use crate::planner::Planner;

/// The file in the run directory that the DFlash workers read.
pub const SETTINGS_FILE: &str = "dflash.json";

/// Checks the target model, the settings, the dataset's vocabulary and, for GPU workers, that the
/// worker binary was built with CUDA. Returns the target's configuration.
pub(super) fn check(
    settings: &DflashSettings,
    tokens: &mut Tokens,
    devices: &[Device],
    worker: &Path,
) -> Result<Qwen3Config, RunError> {
    let invalid = |e: String| RunError::Invalid(e);
    let dir = &settings.target_model;
    let target = dflash::read_config(dir).map_err(|e| invalid(format!("--target-model {e}")))?;
    dflash::check_weights(dir, &target, settings.target_layers_needed())
        .map_err(|e| invalid(format!("--target-model {e}")))?;
    settings.check(&target).map_err(invalid)?;
    let vocab = target.vocab_size as u64;
    match tokens {
        Tokens::Store(store) => {
            if let Some(v) = store.meta().vocab_size
                && u64::from(v) > vocab
            {
                return Err(invalid(format!(
                    "the dataset {} was prepared for a vocabulary of {v} tokens, the target {} has {vocab}",
                    store.path().display(),
                    dir.display()
                )));
            }
            for i in 0..store.len() {
                if let Some(&t) = store.tokens(i).iter().find(|&&t| u64::from(t) >= vocab) {
                    return Err(invalid(format!(
                        "the dataset {} has token id {t} in sample {i}, outside the target's vocabulary ({vocab} tokens in {})",
                        store.path().display(),
                        dir.display()
                    )));
                }
            }
        }
        Tokens::Synthetic { vocab: v, .. } => *v = (*v).min(vocab as u32),
    }
    if devices.iter().any(|d| matches!(d, Device::Gpu(_))) && !worker_has_cuda(worker)? {
        return Err(invalid(format!(
            "--gpus names GPUs, but {} was built without CUDA: rebuild with `cargo build --release --features cuda` (the target and drafter would otherwise run on the CPU), or use --gpus cpu:N",
            worker.display()
        )));
    }
    Ok(target)
}

/// Whether the worker binary reports a CUDA build.
fn worker_has_cuda(worker: &Path) -> Result<bool, RunError> {
    let out = std::process::Command::new(worker)
        .arg("--capabilities")
        .output()
        .map_err(|e| RunError::Invalid(format!("cannot run {}: {e}", worker.display())))?;
    let caps: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|_| {
        RunError::Invalid(format!(
            "{} --capabilities did not answer (a stale worker binary? rebuild both)",
            worker.display()
        ))
    })?;
    Ok(caps["cuda"].as_bool() == Some(true))
}

/// Optimiser steps of the whole run: each epoch's accumulation groups.
pub(super) fn total_steps(planner: &Planner, epochs: u32, accum: u32) -> u64 {
    (0..epochs)
        .map(|e| {
            (planner.plan_epoch(u64::from(e)).batches.len() as u64)
                .div_ceil(u64::from(accum.max(1)))
        })
        .sum()
}

/// Writes the settings for the workers; returns the file.
pub(super) fn write_settings(
    run_dir: &Path,
    settings: &DflashSettings,
) -> Result<PathBuf, RunError> {
    let path = run_dir.join(SETTINGS_FILE);
    crate::fsutil::write_atomically(&path, |out| {
        serde_json::to_writer_pretty(&mut *out, settings).map_err(std::io::Error::other)
    })
    .map_err(|e| RunError::Invalid(format!("{}: {e}", path.display())))?;
    Ok(path)
}
