//! The DFlash stages. A target worker runs the frozen target over each batch and writes, per real
//! token, the hidden states of `target_layer_ids` (concatenated) into its feature slot, after the
//! batch's tokens and loss masks. The drafter worker trains the DFlash drafter on them, one
//! micro-batch per job in plan order, steps the optimiser at the end of each accumulation group,
//! and checkpoints in the background; it starts from the latest checkpoint of the run, if any,
//! and refuses one that another run wrote (its run fingerprint differs).
//!
//! Every random choice of a step (the anchors) is derived from (seed, step, sequence), and the
//! initial weights from the seed, so replaying the plan from a checkpoint gives the same weights.

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use dflash_common::dflash::{DflashSettings, DrafterRank, Engine, NonFinite, Precision};
use dflash_common::ring::{
    Layout, Ring, features_offset, read_lengths, read_masks, read_tokens, token_checksum,
};
use dflash_common::wire::{BatchId, Group, SlotRef, TrainMetrics, Update};

use crate::checkpoint::{self, TrainingState};
use crate::model::drafter::{
    Drafter, DrafterConfig, Heads, MicroBatch, MicroBatchLoss, Objective, block_weights, weight_sum,
};
use crate::model::qwen3::{self, Qwen3};
use crate::rng::SplitMix64;
use crate::stage::{Stage, check_written, publish_features, read_target_batch};
use crate::train::{Accumulator, AdamW, AdamWConfig, Schedule, clip_grad_norm};

/// Reads the run's DFlash settings (written by the orchestrator).
pub fn read_settings(path: &Path) -> Result<DflashSettings, String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The compute device: the GPU of `CUDA_VISIBLE_DEVICES` when the orchestrator gave one, else
/// the CPU. A GPU worker never falls back to the CPU silently.
pub fn device() -> Result<Device, String> {
    device_for(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())
}

/// The device for a `CUDA_VISIBLE_DEVICES` value.
pub fn device_for(visible: Option<&str>) -> Result<Device, String> {
    let gpu = visible.is_some_and(|v| !v.trim().is_empty());
    if !gpu {
        return Ok(Device::Cpu);
    }
    if !candle_core::utils::cuda_is_available() {
        return Err(
            "this worker was given a GPU, but dflash-worker was built without CUDA: rebuild with `cargo build --release --features cuda`, or run on CPU workers with --gpus cpu:N"
                .into(),
        );
    }
    // The CUDA driver library may be missing at run time; some of its loaders panic then.
    match std::panic::catch_unwind(|| Device::new_cuda(0)) {
        Ok(Ok(device)) => Ok(device),
        Ok(Err(e)) => Err(format!("cannot open the GPU: {e}")),
        Err(_) => Err("cannot open the GPU: the CUDA driver library failed to load".into()),
    }
}

/// `dflash-worker --copy-bench`: GB/s of the features' two copies on `device`, per dtype: the
/// target's [`write_elements`] into a host buffer (device to host) and the drafter's
/// `Tensor::from_raw_buffer` out of it (host to device), on `bytes` of features, best of 5.
pub fn copy_bench(device: &Device, bytes: u64) -> Result<serde_json::Value, String> {
    let mut rows = Vec::new();
    for dt in [DType::BF16, DType::F32] {
        let n = (bytes / dt.size_in_bytes() as u64) as usize;
        let width = 4096usize;
        let tokens = n.div_ceil(width);
        let features = Tensor::ones((tokens, width), dt, device).map_err(err)?;
        let mut host = vec![0u8; tokens * width * dt.size_in_bytes()];
        let (mut out_s, mut in_s) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            device.synchronize().map_err(err)?;
            let t = Instant::now();
            write_elements(&features, &mut host)?;
            out_s = out_s.min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let back = Tensor::from_raw_buffer(&host, dt, &[tokens, width], device).map_err(err)?;
            device.synchronize().map_err(err)?;
            in_s = in_s.min(t.elapsed().as_secs_f64());
            drop(back);
        }
        let gb = host.len() as f64 / 1e9;
        rows.push(serde_json::json!({
            "dtype": format!("{dt:?}").to_lowercase(),
            "bytes": host.len(),
            "device_to_host_gb_s": gb / out_s.max(1e-12),
            "host_to_device_gb_s": gb / in_s.max(1e-12),
        }));
    }
    Ok(serde_json::json!({
        "device": if device.is_cuda() { "cuda" } else { "cpu" },
        "copies": rows,
    }))
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// candle's dtype for a precision of the settings.
pub fn dtype(p: Precision) -> DType {
    match p {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
    }
}

/// Copies the elements of `t` (f32 or bf16, any device) into the start of `dst`, in one transfer:
/// straight from a CPU tensor's memory, or one device-to-host copy. Returns the bytes written.
pub fn write_elements(t: &Tensor, dst: &mut [u8]) -> Result<usize, String> {
    let t = t.flatten_all().and_then(|t| t.contiguous()).map_err(err)?;
    let mut put = |bytes: &[u8]| -> Result<usize, String> {
        let room = dst.len();
        dst.get_mut(..bytes.len())
            .ok_or_else(|| {
                format!(
                    "{} bytes of features do not fit the {room} bytes left in the slot",
                    bytes.len()
                )
            })?
            .copy_from_slice(bytes);
        Ok(bytes.len())
    };
    use half::slice::HalfFloatSliceExt;
    let (storage, layout) = t.storage_and_layout();
    if let (Storage::Cpu(cpu), Some((from, to))) = (&*storage, layout.contiguous_offsets()) {
        return match cpu {
            CpuStorage::F32(v) => put(bytemuck::cast_slice(&v[from..to])),
            CpuStorage::BF16(v) => put(bytemuck::cast_slice(v[from..to].reinterpret_cast())),
            _ => Err(format!("features of dtype {:?}", t.dtype())),
        };
    }
    drop(storage);
    match t.dtype() {
        DType::F32 => put(bytemuck::cast_slice(&t.to_vec1::<f32>().map_err(err)?)),
        DType::BF16 => put(bytemuck::cast_slice(
            t.to_vec1::<half::bf16>().map_err(err)?.reinterpret_cast(),
        )),
        other => Err(format!("features of dtype {other:?}")),
    }
}

/// The target stage: frozen forward pass, hidden states out.
pub struct TargetStage {
    model: Qwen3,
    /// Hidden-state indices (layer id + 1).
    indices: Vec<usize>,
    layer_ids: Vec<usize>,
    /// Fault injection: the token whose features are made NaN.
    poison: Option<u32>,
    budget: u64,
    feature_dtype: DType,
    device: Device,
}

impl TargetStage {
    pub fn new(settings: &DflashSettings, device: &Device) -> Result<Self, String> {
        let config = qwen3::read_config(&settings.target_model).map_err(err)?;
        let full = config.num_hidden_layers;
        let model = Qwen3::load(
            &settings.target_model,
            Some(settings.target_layers_needed(full)),
            device,
            dtype(settings.dtype),
        )
        .map_err(err)?;
        settings.check(&model.config)?;
        // Distillation: the last hidden state (after the final norm) goes along.
        let layer_ids = feature_layers(settings, full);
        let mut indices: Vec<usize> = settings.target_layer_ids.iter().map(|l| l + 1).collect();
        if settings.distill().is_some() {
            indices.push(full);
        }
        Ok(Self {
            model,
            indices,
            layer_ids,
            poison: crate::faults::poison_token(),
            budget: settings.token_budget,
            feature_dtype: dtype(settings.feature_dtype),
            device: device.clone(),
        })
    }

    /// Features `[tokens, n·hidden]` of the real tokens of a batch, in sample order. Padded
    /// batches run as rows; packed ones as one row with attention confined to each sequence.
    fn features(&self, layout: u32, lengths: &[u32], tokens: &[u32]) -> Result<Tensor, String> {
        let (rows, width) = if layout == Layout::Padded as u32 {
            (
                lengths.len(),
                lengths.iter().copied().max().unwrap_or(0) as usize,
            )
        } else {
            (1, tokens.len())
        };
        let mut ids = vec![0u32; rows * width];
        let mut positions = vec![0u32; rows * width];
        // Padding gets a segment of its own, so no real token sees it.
        let mut segments = vec![u32::MAX; rows * width];
        let mut at = 0;
        for (i, &len) in lengths.iter().enumerate() {
            let len = len as usize;
            let (row, col) = if rows == 1 { (0, at) } else { (i, 0) };
            for p in 0..len {
                let k = row * width + col + p;
                ids[k] = tokens[at + p];
                positions[k] = p as u32;
                segments[k] = i as u32;
            }
            at += len;
        }
        let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, width), &self.device).map_err(err);
        let states = self
            .model
            .hidden_states(&t(ids)?, &t(positions)?, &t(segments)?, &self.indices)
            .map_err(err)?;
        let all = Tensor::cat(&states, 2).map_err(err)?;
        if rows == 1 {
            return all.squeeze(0).map_err(err);
        }
        let pieces = lengths
            .iter()
            .enumerate()
            .map(|(i, &len)| all.get(i)?.narrow(0, 0, len as usize))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(err)?;
        Tensor::cat(&pieces, 0).map_err(err)
    }
}

impl Stage for TargetStage {
    fn forward(
        &mut self,
        input: &Ring,
        at: SlotRef,
        features: &mut Ring,
        out: SlotRef,
    ) -> Result<Option<String>, String> {
        let vocab = self.model.config.vocab_size as u32;
        let batch = read_target_batch(input, at, features, out, vocab)?;
        let (lengths, tokens) = (&batch.lengths, &batch.tokens);
        let mut values = self
            .features(batch.meta.layout, lengths, tokens)?
            .to_dtype(self.feature_dtype)
            .map_err(err)?;
        if let Some(poison) = self.poison
            && tokens.contains(&poison)
        {
            values = poisoned(&values, tokens, poison)?;
        }
        let nonfinite = nonfinite_layer(&values, &self.layer_ids)?.map(nonfinite_features);
        let slot = features.data_mut(out.slot);
        let from = features_offset(self.budget);
        let dst = slot
            .get_mut(from..)
            .ok_or("the feature slot is smaller than its header")?;
        write_elements(&values, dst)?;
        publish_features(features, out, &batch, self.budget);
        Ok(nonfinite)
    }
}

/// What a target worker reports when the features of target layer `layer` hold a NaN or an
/// infinity (whichever engine computed them).
pub(crate) fn nonfinite_features(layer: usize) -> String {
    format!("a NaN or infinity in the hidden states of target layer {layer}")
}

/// The name of the first drafter parameter whose gradient holds a NaN or an infinity.
fn first_nonfinite(grads: &[Option<Tensor>], drafter: &Drafter) -> Result<String, String> {
    for (g, p) in grads.iter().zip(&drafter.params) {
        if let Some(g) = g
            && !all_finite(g)?
        {
            return Ok(p.name.clone());
        }
    }
    Ok("an unknown parameter".into())
}

/// `values` with NaN in the first layer's features of every position holding `token`.
fn poisoned(values: &Tensor, tokens: &[u32], token: u32) -> Result<Tensor, String> {
    let (n, width) = values.dims2().map_err(err)?;
    let mask: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| (0..width).map(move |c| if t == token && c == 0 { f32::NAN } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, width), values.device())
        .and_then(|m| m.to_dtype(values.dtype()))
        .map_err(err)?;
    (values + mask).map_err(err)
}

/// The target layer of each hidden state in a token's features: `target_layer_ids`, then with
/// distillation the last hidden state, named as the last of the target's `target_layers`.
pub(crate) fn feature_layers(settings: &DflashSettings, target_layers: usize) -> Vec<usize> {
    let mut layers = settings.target_layer_ids.clone();
    if settings.distill().is_some() {
        layers.push(target_layers.saturating_sub(1));
    }
    layers
}

/// Whether every element of `t` is finite (one reduction: a NaN or infinity makes the sum of
/// magnitudes non-finite).
fn all_finite(t: &Tensor) -> Result<bool, String> {
    let total = t
        .to_dtype(DType::F32)
        .and_then(|t| t.abs())
        .and_then(|t| t.sum_all())
        .and_then(|t| t.to_scalar::<f32>())
        .map_err(err)?;
    Ok(total.is_finite())
}

/// The first of `layer_ids` whose slice of `features` (`[tokens, n·hidden]`, the layers' hidden
/// states side by side) holds a NaN or an infinity.
pub fn nonfinite_layer(features: &Tensor, layer_ids: &[usize]) -> Result<Option<usize>, String> {
    let width = features.dim(1).map_err(err)? / layer_ids.len().max(1);
    for (i, &layer) in layer_ids.iter().enumerate() {
        if !all_finite(&features.narrow(1, i * width, width).map_err(err)?)? {
            return Ok(Some(layer));
        }
    }
    Ok(None)
}

/// The generator of the anchors of one sequence of one step.
fn step_rng(seed: u64, step: u64, sequence: u64) -> SplitMix64 {
    let mut r = SplitMix64(seed ^ 0xD1F1_A5B0_0000_0000);
    for word in [step, sequence] {
        r.0 ^= word;
        r.0 = r.next_u64();
    }
    r
}

/// Up to `count` anchors of a sequence, sorted: distinct positions whose loss mask is set and
/// that have a next token to predict, drawn from (seed, step, sequence).
pub fn sample_anchors(
    mask: &[u8],
    count: usize,
    seed: u64,
    step: u64,
    sequence: u64,
) -> Vec<usize> {
    let mut eligible: Vec<usize> = (0..mask.len().saturating_sub(1))
        .filter(|&p| mask[p] != 0)
        .collect();
    let take = count.min(eligible.len());
    let mut rng = step_rng(seed, step, sequence);
    for i in 0..take {
        let j = i + rng.below((eligible.len() - i) as u64) as usize;
        eligible.swap(i, j);
    }
    eligible.truncate(take);
    eligible.sort_unstable();
    eligible
}

/// A micro-batch's features in its feature slot: the slot's bytes from the first feature on, and
/// where that first byte lies in the ring's file (the torch engine's child maps the file).
#[derive(Clone, Copy)]
pub struct SlotFeatures<'a> {
    pub bytes: &'a [u8],
    pub file_offset: u64,
    /// `[tokens, width]` features.
    pub tokens: usize,
    pub width: usize,
}

/// What became of a group's optimiser step.
#[derive(Debug, Clone, PartialEq)]
pub enum Stepped {
    /// Gradients clipped and AdamW stepped; their norm before clipping.
    Applied { grad_norm: f64 },
    /// The gradients hold a NaN or an infinity, first in this parameter: no step.
    NonFinite(String),
    /// Nothing to step on (no gradient, or the step was to be skipped).
    Nothing,
}

/// The drafter's compute on one engine: the forward and backward passes of micro-batches, the
/// optimiser, and their state for checkpoints. [`DrafterStage`] around it owns the rest (plan
/// order, anchors, loss weights, schedule, non-finite policy, checkpoint files), for both engines.
pub trait DrafterCompute {
    /// Forward and backward of one micro-batch: `sequences` are the ranges of its sequences in
    /// `tokens` (and the features' rows) with their anchors. Adds its gradients, scaled by
    /// `1 / (weight · accum)`, to the group's.
    fn micro_batch(
        &mut self,
        features: SlotFeatures,
        tokens: &[u32],
        loss_mask: &[u8],
        sequences: &[(Range<usize>, Vec<usize>)],
        accum: usize,
    ) -> Result<MicroBatchLoss, String>;

    /// Ends a group: with `skip` drops its gradients; else clips them to the norm `clip` and,
    /// when their norm is finite, steps AdamW at `lr`.
    fn step(&mut self, lr: f64, clip: f64, skip: bool) -> Result<Stepped, String>;

    /// Seconds the last [`DrafterCompute::step`] spent summing the ranks' gradients.
    fn reduce_seconds(&self) -> f64 {
        0.0
    }

    /// Data-parallel drafters: checks that every rank holds the same weights as rank 0 (a
    /// checksum per tensor, gathered from every rank; a collective call).
    fn check_replicas(&mut self) -> Result<(), String> {
        Ok(())
    }

    /// Copies the weights and the moments for a checkpoint holding `state` and `config`.
    fn snapshot(
        &mut self,
        state: TrainingState,
        config: serde_json::Value,
    ) -> Result<checkpoint::Snapshot, String>;
}

/// The drafter on candle, in this process.
pub struct CandleDrafter {
    drafter: Drafter,
    opt: AdamW,
    accum: Accumulator,
    embedding: Tensor,
    lm_head: Tensor,
    objective: Objective,
    chunk: Option<usize>,
    feature_dtype: DType,
    device: Device,
}

impl CandleDrafter {
    /// The drafter of `config` with the run's initial weights, or those of `resume`.
    pub fn new(
        settings: &DflashSettings,
        config: DrafterConfig,
        resume: Option<&checkpoint::Snapshot>,
    ) -> Result<Self, String> {
        let device = device()?;
        let compute = dtype(settings.dtype);
        let (embedding, lm_head) =
            qwen3::load_heads(&settings.target_model, &device, compute).map_err(err)?;
        let drafter = Drafter::new(config, settings.seed, &device)
            .map_err(err)?
            .with_compute(compute);
        let vars = drafter.params.iter().map(|p| p.var.clone()).collect();
        let mut opt = AdamW::new(
            vars,
            AdamWConfig {
                weight_decay: settings.weight_decay,
                ..AdamWConfig::default()
            },
        )
        .map_err(err)?;
        if let Some(snapshot) = resume {
            checkpoint::restore(snapshot, &drafter, &mut opt, &device)?;
        }
        Ok(Self {
            drafter,
            opt,
            accum: Accumulator::default(),
            embedding,
            lm_head,
            objective: objective(settings),
            chunk: settings.anchor_chunk,
            feature_dtype: dtype(settings.feature_dtype),
            device,
        })
    }
}

/// The loss of the run's settings.
fn objective(settings: &DflashSettings) -> Objective {
    Objective {
        gamma: settings.gamma,
        distill: settings.distill(),
        dpace: settings.dpace(),
    }
}

impl DrafterCompute for CandleDrafter {
    fn micro_batch(
        &mut self,
        features: SlotFeatures,
        tokens: &[u32],
        loss_mask: &[u8],
        sequences: &[(Range<usize>, Vec<usize>)],
        accum: usize,
    ) -> Result<MicroBatchLoss, String> {
        let n = features.tokens * features.width * self.feature_dtype.size_in_bytes();
        let bytes = features
            .bytes
            .get(..n)
            .ok_or_else(|| format!("the feature slot is short of {} tokens", features.tokens))?;
        // One copy out of the slot (host to device on a GPU), no per-element parsing.
        let all = Tensor::from_raw_buffer(
            bytes,
            self.feature_dtype,
            &[features.tokens, features.width],
            &self.device,
        )
        .map_err(err)?;
        let (grads, batch) = self
            .drafter
            .micro_batch(
                MicroBatch {
                    features: &all,
                    tokens,
                    loss_mask,
                    sequences,
                },
                Heads {
                    embedding: &self.embedding,
                    lm_head: &self.lm_head,
                },
                self.objective,
                self.chunk,
                accum,
            )
            .map_err(err)?;
        if let Some(grads) = grads {
            self.accum.sum(grads).map_err(err)?;
        }
        Ok(batch)
    }

    fn step(&mut self, lr: f64, clip: f64, skip: bool) -> Result<Stepped, String> {
        let Some(mut grads) = self.accum.take().filter(|_| !skip) else {
            return Ok(Stepped::Nothing);
        };
        let grad_norm = clip_grad_norm(&mut grads, clip).map_err(err)?;
        if !grad_norm.is_finite() {
            return Ok(Stepped::NonFinite(first_nonfinite(&grads, &self.drafter)?));
        }
        self.opt.step(&grads, lr).map_err(err)?;
        Ok(Stepped::Applied { grad_norm })
    }

    fn snapshot(
        &mut self,
        state: TrainingState,
        config: serde_json::Value,
    ) -> Result<checkpoint::Snapshot, String> {
        checkpoint::snapshot(&self.drafter, &self.opt, state, config).map_err(err)
    }
}

/// The drafter stage: trains on features in plan order and checkpoints.
pub struct DrafterStage {
    settings: DflashSettings,
    compute: Box<dyn DrafterCompute>,
    schedule: Schedule,
    writer: Option<checkpoint::Writer>,
    hf_config: serde_json::Value,
    width: usize,
    feature_bytes: usize,
    /// Optimiser steps taken.
    step: u64,
    /// Batches of the run in the weights (the plan position after the last update).
    cursor: u64,
    epoch: u32,
    saved_step: u64,
    resumed_step: u64,
    /// Micro-batches of the current group done (by this rank).
    micro: usize,
    /// This drafter's rank among the run's data-parallel drafters: it trains the batches at
    /// positions `rank`, `rank + ranks`, ... of each accumulation group, and only rank 0 writes
    /// checkpoints.
    rank: DrafterRank,
    group_loss: f64,
    /// Why the optimiser step of the current group is to be skipped (`--on-nonfinite skip`).
    skip: Option<String>,
}

impl DrafterStage {
    /// The drafter of the run's settings on the engine they name, from the run's latest
    /// checkpoint when there is one; `feature_ring` is the ring the torch engine's child maps.
    pub fn new(settings: &DflashSettings, feature_ring: &Path) -> Result<Self, String> {
        let target = dflash_common::dflash::read_config_for(&settings.target_model, Engine::Torch)
            .map_err(err)?;
        settings.check(&target)?;
        let config = DrafterConfig::for_target(
            &target,
            settings.draft_layers,
            settings.block_size,
            settings.mask_token_id,
            settings.target_layer_ids.clone(),
        )
        .with_arch(settings.dflash2().copied(), settings.sliding_window);
        let root = &settings.checkpoint_dir;
        let rank = DrafterRank::from_env(|name| std::env::var(name).ok())?;
        // Several nodes start from the step every node has a checkpoint of.
        let latest = match rank.resume_step {
            None => checkpoint::load_latest(root),
            Some(step) => checkpoint::load_step(root, step),
        }
        .map_err(|e| {
            format!(
                "cannot read the latest checkpoint in {}: {e}",
                root.display()
            )
        })?;
        if let Some((dir, snapshot)) = &latest {
            let unchecked = checkpoint::check_fingerprint(
                dir,
                &settings.fingerprint,
                &snapshot.state.fingerprint,
            )?;
            for field in unchecked {
                let what = dflash_common::dflash::FINGERPRINT_ADDED_LATER
                    .iter()
                    .find(|(name, _)| *name == field)
                    .map_or("", |(_, what)| *what);
                tracing::warn!(
                    "checkpoint {} predates the fingerprint's {field} ({what}): resuming without checking it",
                    dir.display()
                );
            }
        }
        let resume = latest.as_ref().map(|(_, snapshot)| snapshot);
        let misfit = |e: String| {
            format!(
                "the latest checkpoint in {} does not fit this drafter: {e}",
                root.display()
            )
        };
        if let Some(snapshot) = resume {
            checkpoint::fits(snapshot, &config).map_err(misfit)?;
        }
        let hf_config = checkpoint::hf_config(&config, &target);
        let compute: Box<dyn DrafterCompute> = match settings.engines.drafter {
            Engine::Candle if rank.ranks > 1 => {
                return Err(format!(
                    "{} data-parallel drafters need the torch engine (--engine torch); the candle drafter trains alone",
                    rank.ranks
                ));
            }
            Engine::Candle if config.dflash2.is_some() || config.sliding_window.is_some() => {
                return Err(
                    "DFlash2 and sliding-window drafters are trained by the torch engine only (--engine torch)"
                        .into(),
                );
            }
            Engine::Candle => Box::new(CandleDrafter::new(settings, config, resume)?),
            Engine::Torch => Box::new(crate::torch::DrafterEngine::new(
                settings,
                &config,
                resume,
                feature_ring,
                &rank,
            )?),
        };
        let (step, cursor, epoch) = resume.map_or((0, 0, 0), |s| {
            (s.state.step, s.state.plan_cursor, s.state.epoch)
        });
        drop(latest);
        // Rank 0 alone writes (and prunes) checkpoints; with several nodes, each node's first.
        let writer = if rank.writes_checkpoints {
            Some(
                checkpoint::Writer::start(root.clone(), settings.keep_checkpoints)
                    .map_err(|e| format!("cannot start the checkpoint writer: {e}"))?,
            )
        } else {
            None
        };
        let width = settings.feature_width(&target) as usize;
        Ok(Self {
            schedule: Schedule {
                peak: settings.lr,
                warmup: settings.warmup_steps(),
                total: settings.total_steps,
            },
            width,
            feature_bytes: width * dtype(settings.feature_dtype).size_in_bytes(),
            settings: settings.clone(),
            compute,
            writer,
            hf_config,
            step,
            cursor,
            epoch,
            saved_step: step,
            resumed_step: step,
            micro: 0,
            group_loss: 0.0,
            skip: None,
            rank,
        })
    }

    /// Checkpoints the weights of the current step: rank 0 writes them; with `check`, every rank
    /// first compares its weights with rank 0's (a collective call: every rank saves at the
    /// same steps).
    fn save(&mut self, check: bool) -> Result<(), String> {
        if self.rank.ranks > 1 && check {
            self.compute.check_replicas()?;
        }
        if !self.rank.writes_checkpoints {
            self.saved_step = self.step;
            return Ok(());
        }
        let snapshot = self.compute.snapshot(
            TrainingState {
                step: self.step,
                epoch: self.epoch,
                plan_cursor: self.cursor,
                adam_t: 0,
                fingerprint: self.settings.fingerprint.clone(),
            },
            self.hf_config.clone(),
        )?;
        if let Some(w) = &mut self.writer {
            // Waits while the writer is a checkpoint behind.
            w.submit(snapshot).map_err(err)?;
        }
        self.saved_step = self.step;
        Ok(())
    }

    /// Ends this rank's part of an accumulation group, which ends before plan position `end`:
    /// the optimiser step (collective with data-parallel drafters), the checkpoint when due.
    fn end_group(&mut self, end: u64, epoch: u32, at_batch: &str) -> Result<Update, String> {
        let lr = self.schedule.lr(self.step);
        let stepped = self
            .compute
            .step(lr, self.settings.clip, self.skip.is_some())?;
        let grad_norm = match stepped {
            Stepped::Applied { grad_norm } => grad_norm,
            Stepped::Nothing => 0.0,
            Stepped::NonFinite(name) => {
                self.nonfinite(format!(
                    "the gradient of {name} is not finite at step {} (the group ending with {at_batch})",
                    self.step + 1
                ))?;
                0.0
            }
        };
        let skipped = self.skip.take();
        let reduce_s = self.compute.reduce_seconds();
        self.micro = 0;
        self.step += 1;
        self.cursor = end;
        self.epoch = epoch;
        let checkpoint = self.step.is_multiple_of(self.settings.save_every)
            || self
                .settings
                .eval_every
                .is_some_and(|n| n > 0 && self.step.is_multiple_of(n));
        if checkpoint {
            self.save(true)?;
        }
        Ok(Update {
            step: self.step,
            lr,
            grad_norm,
            loss: std::mem::take(&mut self.group_loss),
            checkpoint,
            skipped,
            reduce_s,
        })
    }

    /// A NaN or infinity found, `what` and where: the run stops (an error naming it), or with
    /// `--on-nonfinite skip` the current group's optimiser step is marked to be skipped.
    fn nonfinite(&mut self, what: String) -> Result<(), String> {
        match self.settings.on_nonfinite {
            NonFinite::Stop => Err(format!(
                "{what} (--on-nonfinite stop; resume with --on-nonfinite skip to skip such steps)"
            )),
            NonFinite::Skip => {
                tracing::warn!("{what}: skipping this optimiser step");
                self.skip.get_or_insert(what);
                Ok(())
            }
        }
    }

    /// Fails on a checkpoint the writer could not write, and once the writer itself has died
    /// ("checkpoint writer failed: <its panic>").
    fn check_writer(&mut self) -> Result<(), String> {
        let Some(writer) = &mut self.writer else {
            return Ok(());
        };
        for done in writer.finished().map_err(err)? {
            done.map_err(|e| format!("checkpoint failed: {e}"))?;
        }
        Ok(())
    }
}

impl Stage for DrafterStage {
    fn forward(
        &mut self,
        _: &Ring,
        _: SlotRef,
        _: &mut Ring,
        _: SlotRef,
    ) -> Result<Option<String>, String> {
        Err("a drafter worker got a forward job".into())
    }

    fn resumed(&self) -> Option<(u64, u64)> {
        Some((self.cursor, self.resumed_step))
    }

    fn train(
        &mut self,
        features: &Ring,
        at: SlotRef,
        id: BatchId,
        checksum: u32,
        group: Group,
        nonfinite: Option<&str>,
    ) -> Result<(u32, Option<TrainMetrics>), String> {
        let started = Instant::now();
        self.check_writer()?;
        let (rank, ranks) = (self.rank.rank as usize, self.rank.ranks as usize);
        if group.index as usize != rank + self.micro * ranks
            || id.step != self.cursor + u64::from(group.index)
        {
            return Err(format!(
                "out of plan order: the drafter (rank {rank} of {ranks}) is at plan position {} (+{} micro-batches), the job is step {} (position {} of its group)",
                self.cursor, self.micro, id.step, group.index
            ));
        }
        let meta = check_written(features, at)?;
        let data = features.data(at.slot);
        let lengths = read_lengths(data, &meta)?;
        let mut tokens = Vec::with_capacity(meta.tokens as usize);
        read_tokens(data, &meta, &mut tokens)?;
        let found = token_checksum(&tokens);
        if found != checksum {
            return Err(format!(
                "corrupt batch: features carry tokens with checksum {found:08x}, the orchestrator wrote {checksum:08x}"
            ));
        }
        let masks = read_masks(data, &meta)?;
        let from = features_offset(self.settings.token_budget);
        let n = tokens.len() * self.feature_bytes;
        let bytes = data
            .get(from..from + n)
            .ok_or_else(|| format!("feature slot {} claims {} tokens", at.slot, tokens.len()))?;
        let slot_features = SlotFeatures {
            bytes,
            file_offset: features.data_file_offset(at.slot) + from as u64,
            tokens: tokens.len(),
            width: self.width,
        };
        let at_batch = format!(
            "batch {} of epoch {} (step {})",
            id.batch, id.epoch, id.step
        );
        // The target worker checked them (once, where they were made).
        let poisoned = nonfinite.is_some();
        if let Some(what) = nonfinite {
            self.nonfinite(format!("the features of {at_batch}: {what}"))?;
        }
        // Every sequence's anchors, drawn from (seed, step, sequence), and the loss weight they
        // carry: both decided here, for either engine.
        let mut offset = 0;
        let mut sequences = Vec::with_capacity(lengths.len());
        let mut weight = 0.0;
        for (i, &len) in lengths.iter().enumerate() {
            let range = offset..offset + len as usize;
            offset += len as usize;
            let picked = sample_anchors(
                &masks[range.clone()],
                self.settings.num_anchors,
                self.settings.seed,
                id.step,
                i as u64,
            );
            if !picked.is_empty() && !poisoned {
                let weights = block_weights(
                    &masks[range.clone()],
                    &picked,
                    self.settings.block_size,
                    self.settings.gamma,
                );
                weight += weight_sum(&weights);
                sequences.push((range, picked));
            }
        }
        let mut batch = self.compute.micro_batch(
            slot_features,
            &tokens,
            masks,
            &sequences,
            group.len as usize,
        )?;
        if (batch.weight - weight).abs() > 1e-5 * weight.max(1.0) {
            return Err(format!(
                "the drafter engine weighed {at_batch} {}, the stage {weight}: its loss weights (block mask, gamma) drifted from this build's",
                batch.weight
            ));
        }
        if !batch.loss.is_finite() {
            self.nonfinite(format!("the loss of {at_batch} is not finite"))?;
            batch.loss = 0.0;
        }
        // A micro-batch with nothing to learn from still takes its place in the group.
        self.micro += 1;
        let (loss, anchors, correct, counted, selector) = (
            batch.loss,
            batch.anchors,
            batch.correct,
            batch.counted,
            batch.selector,
        );
        self.group_loss += loss / f64::from(group.len);
        let mut update = None;
        if group.is_last_of_rank(self.rank.ranks) {
            let end = id.step - u64::from(group.index) + u64::from(group.len);
            update = Some(self.end_group(end, id.epoch, &at_batch)?);
        }
        Ok((
            found,
            Some(TrainMetrics {
                loss,
                correct,
                counted,
                anchors,
                compute_s: started.elapsed().as_secs_f64(),
                update,
                selector,
            }),
        ))
    }

    fn step_only(&mut self, id: BatchId, group: Group) -> Result<Update, String> {
        self.check_writer()?;
        let (rank, ranks) = (self.rank.rank, self.rank.ranks);
        let start = (id.step + 1).checked_sub(u64::from(group.len));
        if ranks < 2 || rank < group.len || self.micro != 0 || start != Some(self.cursor) {
            return Err(format!(
                "out of plan order: the drafter (rank {rank} of {ranks}) is at plan position {} (+{} micro-batches), the step job is for the group of {} batches ending at step {}",
                self.cursor, self.micro, group.len, id.step
            ));
        }
        let at_batch = format!(
            "batch {} of epoch {} (step {})",
            id.batch, id.epoch, id.step
        );
        self.end_group(id.step + 1, id.epoch, &at_batch)
    }

    fn stop(&mut self) -> Result<(), String> {
        if self.step > self.saved_step {
            // The ranks stop at one step boundary with the same weights (every step is
            // collective); no collective check here, where a rank may be gone already.
            self.save(false)?;
        }
        let Some(writer) = self.writer.take() else {
            return Ok(());
        };
        for done in writer.finish().map_err(err)? {
            done.map_err(|e| format!("checkpoint failed: {e}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_worker_without_cuda_refuses_instead_of_using_the_cpu() {
        assert!(device_for(None).unwrap().is_cpu());
        assert!(device_for(Some("")).unwrap().is_cpu());
        if !candle_core::utils::cuda_is_available() {
            let e = device_for(Some("3")).unwrap_err();
            assert!(e.contains("built without CUDA"), "{e}");
        }
    }

    /// Features go into a slot as whole slices and come back bit for bit, in both dtypes, from
    /// a contiguous tensor or a strided view; a slot too small is an error, not a panic.
    #[test]
    fn features_round_trip_through_a_slot_in_both_dtypes() {
        let dev = Device::Cpu;
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.37 - 3.0).collect();
        let base = Tensor::from_vec(values, (4, 6), &dev).unwrap();
        for dt in [DType::F32, DType::BF16] {
            for t in [
                base.to_dtype(dt).unwrap(),
                base.t().unwrap().to_dtype(dt).unwrap(),
            ] {
                let mut slot = vec![0xAAu8; 200];
                let n = write_elements(&t, &mut slot).unwrap();
                assert_eq!(n, 24 * dt.size_in_bytes());
                assert!(
                    slot[n..].iter().all(|&b| b == 0xAA),
                    "nothing past the features"
                );
                let back = Tensor::from_raw_buffer(&slot[..n], dt, t.dims(), &dev).unwrap();
                let flat = |x: &Tensor| {
                    x.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                assert_eq!(flat(&back), flat(&t));
            }
            let mut small = vec![0u8; 10];
            let e = write_elements(&base.to_dtype(dt).unwrap(), &mut small).unwrap_err();
            assert!(e.contains("do not fit"), "{e}");
        }
    }

    #[test]
    fn anchors_are_distinct_masked_and_reproducible() {
        let mask: Vec<u8> = (0..200).map(|i| u8::from(i % 3 != 0)).collect();
        let a = sample_anchors(&mask, 40, 7, 11, 2);
        assert_eq!(a.len(), 40);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert!(a.iter().all(|&p| mask[p] == 1 && p + 1 < mask.len()));
        assert_eq!(a, sample_anchors(&mask, 40, 7, 11, 2));
        assert_ne!(a, sample_anchors(&mask, 40, 7, 12, 2));
        assert_ne!(a, sample_anchors(&mask, 40, 7, 11, 3));
        // Fewer loss positions than anchors: all of them.
        let few = [0, 1, 1, 0, 1];
        assert_eq!(sample_anchors(&few, 512, 1, 1, 1), vec![1, 2]);
        assert!(sample_anchors(&[1], 4, 1, 1, 1).is_empty());
        assert!(sample_anchors(&[], 4, 1, 1, 1).is_empty());
    }
}
