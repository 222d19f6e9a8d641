//! Stages: what a worker computes. The synthetic stage stands in for the models in tests and
//! benchmarks: it touches every token, moves data through both rings, and proves end to end that
//! nothing was lost, mixed up or corrupted.

use std::time::{Duration, Instant};

use dflash_common::ring::{
    Layout, Ring, SlotMeta, read_lengths, read_masks, read_tokens, token_checksum, write_batch,
};
use dflash_common::wire::{BatchId, Group, SlotRef, TrainMetrics, Update};

/// What a worker computes: the synthetic stage, or the DFlash target and drafter.
pub trait Stage {
    /// Reads the batch in `input`, writes its features into `feature`; says where the features
    /// hold a NaN or an infinity, if they do.
    fn forward(
        &mut self,
        input: &Ring,
        at: SlotRef,
        features: &mut Ring,
        out: SlotRef,
    ) -> Result<Option<String>, String>;

    /// Trains on the features in `at`, which must hold tokens with `checksum`; returns the
    /// checksum found and what the step measured. `nonfinite`: where the target worker found a
    /// NaN or infinity in them. A target stage trains nothing.
    fn train(
        &mut self,
        _features: &Ring,
        _at: SlotRef,
        _id: BatchId,
        _checksum: u32,
        _group: Group,
        _nonfinite: Option<&str>,
    ) -> Result<(u32, Option<TrainMetrics>), String> {
        Err("a target worker got a training job".into())
    }

    /// Data-parallel drafters: takes part in the optimiser step of the group ending with `id`,
    /// which holds no batch for this rank.
    fn step_only(&mut self, _id: BatchId, _group: Group) -> Result<Update, String> {
        Err("a worker that trains no drafter got a step job".into())
    }

    /// Where a stateful drafter resumes: (plan cursor, optimiser step).
    fn resumed(&self) -> Option<(u64, u64)> {
        None
    }

    /// Finishes before the process exits (a drafter writes its final checkpoint).
    fn stop(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// Checks a forward job's slots: input slot `at` holds the batch of the expected generation, and
/// feature slot `out` is still assigned to this job. Returns the batch's shape.
pub fn claim(input: &Ring, at: SlotRef, features: &Ring, out: SlotRef) -> Result<SlotMeta, String> {
    let meta = input
        .check(at.slot, at.generation)
        .map_err(|e| e.to_string())?;
    if features.generation(out.slot) != out.generation {
        return Err(format!(
            "feature slot {} was reassigned (generation {}, expected {})",
            out.slot,
            features.generation(out.slot),
            out.generation
        ));
    }
    Ok(meta)
}

/// A forward job's batch as a target reads it from its input slot.
pub struct TargetBatch {
    pub meta: SlotMeta,
    pub lengths: Vec<u32>,
    /// The real tokens, in sample order.
    pub tokens: Vec<u32>,
    pub masks: Vec<u8>,
}

/// Claims a forward job's slots (see [`claim`]) and reads its batch, every token inside a
/// vocabulary of `vocab`.
pub fn read_target_batch(
    input: &Ring,
    at: SlotRef,
    features: &Ring,
    out: SlotRef,
    vocab: u32,
) -> Result<TargetBatch, String> {
    let meta = claim(input, at, features, out)?;
    let data = input.data(at.slot);
    let lengths = read_lengths(data, &meta)?;
    let mut tokens = Vec::with_capacity(meta.tokens as usize);
    read_tokens(data, &meta, &mut tokens)?;
    let masks = read_masks(data, &meta)?.to_vec();
    if let Some(bad) = tokens.iter().find(|&&t| t >= vocab) {
        return Err(format!(
            "token id {bad} is outside the target's vocabulary ({vocab})"
        ));
    }
    Ok(TargetBatch {
        meta,
        lengths,
        tokens,
        masks,
    })
}

/// Publishes a target's features for `batch` in feature slot `out` (the features already in
/// place from [`dflash_common::ring::features_offset`] of `budget`): the batch packed before them, then the slot
/// marked written.
pub fn publish_features(features: &mut Ring, out: SlotRef, batch: &TargetBatch, budget: u64) {
    let written = write_batch(
        features.data_mut(out.slot),
        Layout::Packed,
        &batch.lengths,
        &batch.tokens,
        &batch.masks,
        batch.meta.max_len,
        budget,
    );
    // SYNC POINT: `mark_written`'s Release store publishes the features and the batch written
    // before it to the drafter's Acquire load of `written`.
    features.mark_written(out.slot, out.generation, written);
}

/// Checks that feature slot `at` holds finished features of the expected generation.
pub fn check_written(features: &Ring, at: SlotRef) -> Result<SlotMeta, String> {
    let meta = features
        .check(at.slot, at.generation)
        .map_err(|e| e.to_string())?;
    let written = features.written(at.slot);
    if written != at.generation {
        return Err(format!(
            "feature slot {} holds generation {written}, expected {}",
            at.slot, at.generation
        ));
    }
    Ok(meta)
}

/// The synthetic stage. A target maps each token to `token ^ mix(position)` in its feature slot;
/// the drafter maps the features back and checks the tokens' checksum against the orchestrator's.
/// Each spends at least `us_per_token` microseconds a token of the batch (the worker's
/// `--synthetic-us-per-token`: the launch's target or drafter cost, by role).
pub struct Synthetic {
    us_per_token: f64,
}

/// Position mixing of the synthetic features (invertible by XOR).
fn mix(position: u32) -> u32 {
    position.wrapping_mul(0x9E37_79B1).rotate_left(7)
}

impl Synthetic {
    pub fn new(us_per_token: f64) -> Self {
        Self { us_per_token }
    }
}

impl Stage for Synthetic {
    fn forward(
        &mut self,
        input: &Ring,
        at: SlotRef,
        features: &mut Ring,
        out: SlotRef,
    ) -> Result<Option<String>, String> {
        let started = Instant::now();
        let meta = claim(input, at, features, out)?;
        let mut tokens = Vec::with_capacity(meta.tokens as usize);
        read_tokens(input.data(at.slot), &meta, &mut tokens)?;
        let data = features.data_mut(out.slot);
        if tokens.len() * 4 > data.len() {
            return Err(format!(
                "{} features do not fit the feature slot ({} bytes)",
                tokens.len(),
                data.len()
            ));
        }
        for (p, (t, chunk)) in tokens.iter().zip(data.chunks_exact_mut(4)).enumerate() {
            chunk.copy_from_slice(&(t ^ mix(p as u32)).to_le_bytes());
        }
        let spend = Duration::from_secs_f64(self.us_per_token * tokens.len() as f64 / 1e6);
        if let Some(rest) = spend.checked_sub(started.elapsed()) {
            std::thread::sleep(rest);
        }
        features.mark_written(
            out.slot,
            out.generation,
            SlotMeta {
                tokens: tokens.len() as u32,
                ..meta
            },
        );
        Ok(None)
    }

    /// Checks the features in `feature` against the orchestrator's checksum.
    fn train(
        &mut self,
        features: &Ring,
        at: SlotRef,
        _id: BatchId,
        checksum: u32,
        _group: Group,
        _nonfinite: Option<&str>,
    ) -> Result<(u32, Option<TrainMetrics>), String> {
        let started = Instant::now();
        let meta = check_written(features, at)?;
        let data = features.data(at.slot);
        let n = meta.tokens as usize;
        if n * 4 > data.len() {
            return Err(format!("feature slot {} claims {n} tokens", at.slot));
        }
        let tokens: Vec<u32> = data[..n * 4]
            .chunks_exact(4)
            .enumerate()
            .map(|(p, c)| u32::from_le_bytes(c.try_into().expect("4 bytes")) ^ mix(p as u32))
            .collect();
        let found = token_checksum(&tokens);
        if found != checksum {
            return Err(format!(
                "corrupt batch: features give checksum {found:08x}, the orchestrator wrote {checksum:08x}"
            ));
        }
        let spend = Duration::from_secs_f64(self.us_per_token * n as f64 / 1e6);
        if let Some(rest) = spend.checked_sub(started.elapsed()) {
            std::thread::sleep(rest);
        }
        Ok((found, None))
    }
}
