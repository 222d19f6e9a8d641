//! Launch-time side of `--stage dflash`: every check that can fail is made here, before any worker
//! starts, and the settings every worker reads are written to the run directory.

use std::path::{Path, PathBuf};

use dflash_common::dflash::{self, DflashSettings, Engine, Engines, Qwen3Config};

use super::spec::Device;
use super::{RunError, Tokens};
use crate::planner::Planner;

/// The file in the run directory that the DFlash workers read.
pub const SETTINGS_FILE: &str = "dflash.json";

/// Checks the target model, the settings, the dataset's vocabulary and, for candle workers on
/// GPUs, that the worker binary was built with CUDA. Returns the target's configuration.
pub(super) fn check(
    settings: &DflashSettings,
    tokens: &mut Tokens,
    devices: &[Device],
    worker: &Path,
) -> Result<Qwen3Config, RunError> {
    let invalid = |e: String| RunError::Invalid(e);
    let dir = &settings.target_model;
    let target = dflash::read_config_for(dir, settings.engines.target)
        .map_err(|e| invalid(format!("--target-model {e}")))?;
    if settings.engines.target == Engine::Candle {
        crate::model_dir::check_weights(
            dir,
            &target,
            settings.target_layers_needed(target.num_hidden_layers),
        )
        .map_err(|e| invalid(format!("--target-model {e}")))?;
    } else {
        // transformers judges the architecture's tensors; the drafter needs the two heads.
        crate::model_dir::check_torch_heads(dir)
            .map_err(|e| invalid(format!("--target-model {e}")))?;
    }
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
    if needs_cuda_worker(settings, devices) && !worker_has_cuda(worker)? {
        return Err(invalid(format!(
            "--gpus names GPUs, but {} was built without CUDA: rebuild with `cargo build --release --features cuda` (the target and drafter would otherwise run on the CPU), or use --gpus cpu:N",
            worker.display()
        )));
    }
    Ok(target)
}

/// Whether the worker binary itself must have CUDA: a candle role on a GPU. A torch worker only
/// hosts the loop; its Python side does the GPU's work.
pub(super) fn needs_cuda_worker(settings: &DflashSettings, devices: &[Device]) -> bool {
    settings.engines.uses(Engine::Candle) && devices.iter().any(|d| matches!(d, Device::Gpu(_)))
}

/// Checks the engines: the torch engine's pre-flight (Python, torch, transformers, our package,
/// CUDA with the `gpus` named) when a role uses it. Returns its report (None without torch).
pub(super) fn check_engines(
    settings: &mut DflashSettings,
    gpus: &[u32],
) -> Result<Option<super::torch_engine::Preflight>, RunError> {
    let mut checked = None;
    if settings.engine_auto {
        (settings.engines, checked) = auto_engines(settings, gpus);
        settings.engine_auto = false;
        if settings.engines.drafter == Engine::Candle {
            for (given, what) in [
                (settings.dflash2().is_some(), "--drafter-arch dflash2"),
                (settings.sliding_window.is_some(), "--sliding-window"),
            ] {
                if given {
                    return Err(RunError::Invalid(format!(
                        "{what} is trained by the torch engine only, and --engine auto chose candle: pass --engine torch"
                    )));
                }
            }
        }
    }
    if !settings.engines.uses(Engine::Torch) {
        settings.torch = None;
        return Ok(None);
    }
    let runtime = settings
        .torch
        .get_or_insert_with(|| super::torch_engine::runtime(None));
    if checked.is_none() {
        let report = super::torch_engine::check(runtime, gpus, Some(&settings.target_model))
            .map_err(RunError::Invalid)?;
        tracing::info!("torch engine: {}", report.describe());
        checked = Some(report);
    }
    Ok(checked)
}

/// `--engine auto` on GPU workers: torch when the pre-flight passes with CUDA, candle otherwise;
/// says which and why. Returns the pre-flight's report when it chose torch.
fn auto_engines(
    settings: &DflashSettings,
    gpus: &[u32],
) -> (Engines, Option<super::torch_engine::Preflight>) {
    let runtime = settings
        .torch
        .clone()
        .unwrap_or_else(|| super::torch_engine::runtime(None));
    let gpus = if gpus.is_empty() { &[0][..] } else { gpus };
    match super::torch_engine::check(&runtime, gpus, Some(&settings.target_model)) {
        Ok(report) => {
            tracing::info!("--engine auto: torch ({})", report.describe());
            (Engines::both(Engine::Torch), Some(report))
        }
        Err(why) => {
            tracing::info!("--engine auto: candle ({why})");
            (Engines::both(Engine::Candle), None)
        }
    }
}

/// Whether the worker binary reports a CUDA build.
pub(super) fn worker_has_cuda(worker: &Path) -> Result<bool, RunError> {
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

/// FNV-1a over `parts`, as 16 hex digits: an identity, not a defence against forgery.
pub(crate) fn digest<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        // The length first, so the parts' boundaries count.
        for b in (part.len() as u64).to_le_bytes().iter().chain(part) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// The target's identity: its config.json and the header (names, dtypes, shapes, offsets) of
/// each of its weight files, not the gigabytes of weights.
pub(crate) fn target_identity(dir: &Path) -> Result<String, String> {
    let config = dir.join("config.json");
    let mut parts = vec![std::fs::read(&config).map_err(|e| format!("{}: {e}", config.display()))?];
    for file in dflash::weight_files(dir).map_err(|e| e.to_string())? {
        let header = crate::model_dir::header_bytes(&file).map_err(|e| e.to_string())?;
        parts.push(
            file.file_name()
                .unwrap_or_default()
                .as_encoded_bytes()
                .to_vec(),
        );
        // The JSON table alone, as the identity has always been taken.
        parts.push(header[8..].to_vec());
    }
    Ok(digest(parts.iter().map(Vec::as_slice)))
}

/// A sample of the target's weights themselves: 16 slices of 4 KiB spread over each weight
/// file's tensor data, and its length. Two models of one shape (re-initialised with another
/// seed, fine-tuned, converted) differ here although their headers are the same; reading it
/// costs a few hundred kilobytes, not the gigabytes.
pub(crate) fn weights_sample(dir: &Path) -> Result<String, String> {
    use std::io::{Read, Seek, SeekFrom};
    const SLICES: u64 = 16;
    const SLICE: u64 = 4096;
    let mut parts: Vec<Vec<u8>> = Vec::new();
    for file in dflash::weight_files(dir).map_err(|e| e.to_string())? {
        let at = |e: std::io::Error| format!("{}: {e}", file.display());
        let header = crate::model_dir::header_bytes(&file).map_err(|e| e.to_string())?;
        let mut f = std::fs::File::open(&file).map_err(at)?;
        let len = f.metadata().map_err(at)?.len();
        let start = (header.len() as u64).min(len);
        let span = len - start;
        parts.push(len.to_le_bytes().to_vec());
        for k in 0..SLICES {
            let offset = start + span.saturating_sub(SLICE) * k / (SLICES - 1);
            f.seek(SeekFrom::Start(offset)).map_err(at)?;
            let mut buf = Vec::with_capacity(SLICE as usize);
            (&mut f).take(SLICE).read_to_end(&mut buf).map_err(at)?;
            parts.push(buf);
        }
    }
    Ok(digest(parts.iter().map(Vec::as_slice)))
}

/// The run fingerprint: a hash of each thing that decides the trained weights (the dtypes and
/// the anchor chunk too: they change the float results).
pub(super) fn fingerprint(
    settings: &DflashSettings,
    data: &Option<PathBuf>,
    synthetic: Option<(usize, u64)>,
    planner: &super::PlannerSettings,
    epochs: u32,
) -> Result<std::collections::BTreeMap<String, String>, String> {
    let json = |v: serde_json::Value| v.to_string().into_bytes();
    let data_identity = match (data, synthetic) {
        (Some(dir), _) => {
            let meta = dir.join("meta.json");
            std::fs::read(&meta).map_err(|e| format!("{}: {e}", meta.display()))?
        }
        (None, Some((n, seed))) => format!("synthetic {n} {seed}").into_bytes(),
        (None, None) => Vec::new(),
    };
    let fields = [
        ("target", target_identity(&settings.target_model)?),
        // Added later (`FINGERPRINT_ADDED_LATER`): the headers alone do not tell two models of
        // one shape apart, a re-initialised or fine-tuned target among them.
        ("target_weights", weights_sample(&settings.target_model)?),
        ("data", digest([data_identity.as_slice()])),
        (
            "planner",
            digest([json(serde_json::to_value(planner).unwrap_or_default()).as_slice()]),
        ),
        ("seed", digest([settings.seed.to_le_bytes().as_slice()])),
        (
            "optimiser",
            digest([json(serde_json::json!({
                "lr": settings.lr, "warmup_ratio": settings.warmup_ratio, "clip": settings.clip,
                "weight_decay": settings.weight_decay, "total_steps": settings.total_steps,
            }))
            .as_slice()]),
        ),
        (
            "drafter",
            // DFlash runs with full attention keep the fingerprint they had before DFlash2.
            digest([json({
                let mut drafter = serde_json::json!({
                    "draft_layers": settings.draft_layers, "block_size": settings.block_size,
                    "num_anchors": settings.num_anchors, "mask_token_id": settings.mask_token_id,
                    "target_layer_ids": settings.target_layer_ids,
                });
                if let Some(d) = settings.dflash2() {
                    drafter["dflash2"] = serde_json::to_value(d).unwrap_or_default();
                }
                if let Some(w) = settings.sliding_window {
                    drafter["sliding_window"] = w.into();
                }
                drafter
            })
            .as_slice()]),
        ),
        (
            "loss",
            // Runs from before the loss could distil keep their fingerprint.
            digest([json(match (settings.distill(), settings.dpace()) {
                (None, None) => serde_json::json!({ "gamma": settings.gamma }),
                (None, Some(alpha)) => serde_json::json!({
                    "gamma": settings.gamma, "loss": settings.loss, "dpace_alpha": alpha,
                }),
                (Some(_), Some(alpha)) => serde_json::json!({
                    "gamma": settings.gamma, "loss": settings.loss,
                    "kd_temperature": settings.kd_temperature, "dpace_alpha": alpha,
                }),
                (Some(_), None) => serde_json::json!({
                    "gamma": settings.gamma, "loss": settings.loss,
                    "kd_temperature": settings.kd_temperature, "kd_weight": settings.kd_weight,
                }),
            })
            .as_slice()]),
        ),
        (
            "precision",
            digest([json({
                let mut p = serde_json::json!({
                    "dtype": settings.dtype, "feature_dtype": settings.feature_dtype,
                    "anchor_chunk": settings.anchor_chunk,
                });
                // Added later, each only when on (runs without stay as they were): packed rows
                // round the features otherwise, compiled chains the drafter's arithmetic.
                if settings.target_packing {
                    p["target_packing"] = true.into();
                }
                if settings.drafter_compile {
                    p["drafter_compile"] = true.into();
                }
                p
            })
            .as_slice()]),
        ),
        // Added later: the engines' float results differ (within the parity tests' tolerance).
        (
            "engine",
            digest([json(serde_json::to_value(settings.engines).unwrap_or_default()).as_slice()]),
        ),
        ("epochs", digest([epochs.to_le_bytes().as_slice()])),
    ];
    Ok(fields
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect())
}
