//! The batch planner: which samples go into which batch, in which order, every epoch.
//!
//! Pure computation, no I/O. A [`Planner`] is built once from the sample lengths and a validated
//! [`PlanConfig`] (overlong policy applied, buckets resolved); [`Planner::plan_epoch`] is then a pure
//! function of `(seed, epoch)`. Composition is re-drawn every epoch in every mode except `sorted`,
//! which reproduces the original frozen-composition pipeline for comparison.

mod buckets;
mod epoch;
mod interleave;
mod pack;
pub mod rng;
mod stats;

use std::fmt;

pub use buckets::{AUTO_MAX_BUCKETS, BucketSpec};
pub use interleave::Interleave;
pub use stats::{BucketStats, PlanStats};

use rng::{PlanRng, Purpose};

/// How samples are grouped into batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Sort all samples by length once and pack: the original pipeline, composition frozen across
    /// epochs (only the batch order is re-shuffled). Kept for comparison.
    Sorted,
    /// Full shuffle every epoch, then greedy packing (running maximum): random, but much padding.
    Shuffle,
    /// Shuffle within length buckets every epoch, pack each bucket, interleave the buckets' batches.
    Bucketed,
    /// Variable-length batches: sequences concatenated with `cu_seqlens`, no padding. The budget
    /// counts real tokens.
    Packed,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Sorted, Mode::Shuffle, Mode::Bucketed, Mode::Packed];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Sorted => "sorted",
            Mode::Shuffle => "shuffle",
            Mode::Bucketed => "bucketed",
            Mode::Packed => "packed",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| PlanError::UnknownName {
                what: "mode",
                value: s.to_owned(),
                expected: "sorted, shuffle, bucketed, packed",
            })
    }
}

/// What happens to a sample longer than `max_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlongPolicy {
    Truncate,
    Drop,
}

impl OverlongPolicy {
    pub fn name(self) -> &'static str {
        match self {
            OverlongPolicy::Truncate => "truncate",
            OverlongPolicy::Drop => "drop",
        }
    }
}

impl std::str::FromStr for OverlongPolicy {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "truncate" => Ok(OverlongPolicy::Truncate),
            "drop" => Ok(OverlongPolicy::Drop),
            _ => Err(PlanError::UnknownName {
                what: "overlong policy",
                value: s.to_owned(),
                expected: "truncate, drop",
            }),
        }
    }
}

/// Longest `--max-len` accepted (1M tokens).
pub const MAX_SUPPORTED_LEN: u32 = 1 << 20;

/// Everything that determines a plan besides the lengths and the epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanConfig {
    pub mode: Mode,
    /// Only meaningful for `bucketed`; other modes have a fixed batch order.
    pub interleave: Interleave,
    /// Only meaningful for `bucketed`.
    pub buckets: BucketSpec,
    /// Padded tokens per batch (`samples × running max length`); real tokens for `packed`.
    pub token_budget: u64,
    pub max_len: u32,
    pub on_overlong: OverlongPolicy,
    /// Gradient accumulation: micro-batches per optimizer step (used by `stratified` and the
    /// window statistics).
    pub accum: u32,
    pub seed: u64,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Bucketed,
            interleave: Interleave::Spread,
            buckets: BucketSpec::Auto(8),
            token_budget: 49_152,
            max_len: 8192,
            on_overlong: OverlongPolicy::Truncate,
            accum: 4,
            seed: 0,
        }
    }
}

impl PlanConfig {
    /// Checks the options against each other; everything a plan can reject is rejected here.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.max_len == 0 {
            return Err(PlanError::Invalid("--max-len must be at least 1".into()));
        }
        if self.max_len > MAX_SUPPORTED_LEN {
            return Err(PlanError::Invalid(format!(
                "--max-len {} is above the supported {MAX_SUPPORTED_LEN}",
                self.max_len
            )));
        }
        if self.token_budget < u64::from(self.max_len) {
            return Err(PlanError::Invalid(format!(
                "--token-budget {} is smaller than --max-len {}: a sample of the maximum length \
                 would not fit in any batch",
                self.token_budget, self.max_len
            )));
        }
        if self.accum == 0 {
            return Err(PlanError::Invalid("--accum must be at least 1".into()));
        }
        self.buckets.validate(self.max_len)
    }
}

/// A reason the planner refuses its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Invalid(String),
    #[error("unknown {what} {value:?} (expected one of: {expected})")]
    UnknownName {
        what: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("no samples to plan: the input is empty")]
    EmptyInput,
    #[error("no samples to plan: all {dropped} samples were dropped ({reason})")]
    AllDropped { dropped: usize, reason: String },
    #[error("too many samples: {0} (the planner indexes samples with 32 bits)")]
    TooManySamples(usize),
}

/// How a batch is laid out in memory, which decides what its token budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[samples, max_len]`, right-padded: budget counts `samples × max_len`.
    Padded,
    /// Concatenated sequences with `cu_seqlens`: budget counts real tokens.
    Packed,
}

/// One batch of an epoch plan. Its samples are `EpochPlan::samples[start..start + count]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub bucket: u16,
    pub start: u32,
    pub count: u32,
    /// Longest (effective) sample in the batch.
    pub max_len: u32,
    /// Sum of the (effective) sample lengths.
    pub real_tokens: u64,
}

/// The ordered batches of one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    pub epoch: u64,
    pub layout: Layout,
    pub token_budget: u64,
    /// Batches in plan order: index = step within the epoch.
    pub batches: Vec<Batch>,
    /// Sample indices (into the planner's input), grouped by batch.
    pub samples: Vec<u32>,
}

impl EpochPlan {
    pub fn batch_samples(&self, batch: &Batch) -> &[u32] {
        &self.samples[batch.start as usize..(batch.start + batch.count) as usize]
    }

    /// Tokens the batch occupies: `count × max_len` padded, the full budget packed.
    pub fn padded_tokens(&self, batch: &Batch) -> u64 {
        match self.layout {
            Layout::Padded => u64::from(batch.count) * u64::from(batch.max_len),
            Layout::Packed => self.token_budget,
        }
    }
}

/// A kept sample as the packers see it, `[index, effective length]`: the length travels beside the
/// index, so packing a shuffled order reads memory sequentially instead of gathering lengths.
pub type Pair = [u32; 2];

/// One length bucket: samples with `lo < length <= hi`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub lo: u32,
    pub hi: u32,
    /// Kept samples in the bucket.
    pub samples: usize,
}

/// A planner for one dataset and configuration; plans any epoch.
#[derive(Debug, Clone)]
pub struct Planner {
    config: PlanConfig,
    /// Effective length of every input sample (after truncation); 0 where dropped.
    lengths: Vec<u32>,
    buckets: Vec<Bucket>,
    /// Bucket of every length up to the longest (all 0 outside `bucketed`).
    bucket_of: Vec<u16>,
    /// `sorted`: the plan made once, batches in packing order, whose composition every epoch reuses.
    frozen: Option<(Vec<Batch>, Vec<u32>)>,
    /// Longest effective sample.
    longest: u32,
    kept: usize,
    dropped_empty: usize,
    dropped_overlong: usize,
    truncated: usize,
}

impl Planner {
    /// Applies the overlong policy (in place: the planner keeps `lengths`) and resolves the
    /// buckets. Fails on an invalid configuration or when nothing is left to plan.
    pub fn new(mut lengths: Vec<u32>, config: PlanConfig) -> Result<Self, PlanError> {
        config.validate()?;
        if lengths.is_empty() {
            return Err(PlanError::EmptyInput);
        }
        if u32::try_from(lengths.len()).is_err() {
            return Err(PlanError::TooManySamples(lengths.len()));
        }
        let (mut dropped_empty, mut dropped_overlong, mut truncated) = (0, 0, 0);
        let mut longest = 0;
        for len in lengths.iter_mut() {
            if *len == 0 {
                dropped_empty += 1;
            } else if *len > config.max_len {
                match config.on_overlong {
                    OverlongPolicy::Truncate => {
                        truncated += 1;
                        *len = config.max_len;
                    }
                    OverlongPolicy::Drop => {
                        dropped_overlong += 1;
                        *len = 0;
                    }
                }
            }
            longest = longest.max(*len);
        }
        let kept = lengths.len() - dropped_empty - dropped_overlong;
        if kept == 0 {
            let mut reasons = Vec::new();
            if dropped_empty > 0 {
                reasons.push(format!("{dropped_empty} empty"));
            }
            if dropped_overlong > 0 {
                reasons.push(format!(
                    "{dropped_overlong} longer than --max-len {} with --on-overlong drop",
                    config.max_len
                ));
            }
            return Err(PlanError::AllDropped {
                dropped: lengths.len(),
                reason: reasons.join(", "),
            });
        }

        let whole = vec![Bucket {
            lo: 0,
            hi: config.max_len,
            samples: kept,
        }];
        let one_bucket = || vec![0u16; longest as usize + 1];
        let (buckets, bucket_of, frozen) = match config.mode {
            Mode::Shuffle | Mode::Packed => (whole, one_bucket(), None),
            Mode::Sorted => {
                let order = pack::length_order(&lengths, kept, longest);
                let mut buf = bytemuck::allocation::cast_vec::<Pair, u32>(order);
                let mut batches = Vec::new();
                let mut run = pack::PaddedRun::new(config.token_budget, 0, 0);
                run.feed(&mut buf, 0, kept, &mut batches);
                run.finish(&mut batches);
                buf.truncate(kept);
                buf.shrink_to_fit();
                (whole, one_bucket(), Some((batches, buf)))
            }
            Mode::Bucketed => {
                let boundaries = config.buckets.resolve(&lengths, kept, &config);
                let bucket_of = buckets::bucket_of_length(&boundaries, longest);
                let mut sizes = vec![0usize; boundaries.len() - 1];
                for &len in &lengths {
                    if len > 0 {
                        sizes[usize::from(bucket_of[len as usize])] += 1;
                    }
                }
                let buckets = boundaries
                    .windows(2)
                    .zip(sizes)
                    .map(|(w, samples)| Bucket {
                        lo: w[0],
                        hi: w[1],
                        samples,
                    })
                    .collect();
                (buckets, bucket_of, None)
            }
        };
        Ok(Self {
            config,
            lengths,
            buckets,
            bucket_of,
            frozen,
            longest,
            kept,
            dropped_empty,
            dropped_overlong,
            truncated,
        })
    }

    /// The length the planner uses for a sample of input length `len`; 0 where it is dropped.
    pub fn effective_len(&self, len: u32) -> u32 {
        match (len > self.config.max_len, self.config.on_overlong) {
            (false, _) => len,
            (true, OverlongPolicy::Truncate) => self.config.max_len,
            (true, OverlongPolicy::Drop) => 0,
        }
    }

    /// Effective length of every input sample (0 where dropped).
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }

    pub fn config(&self) -> &PlanConfig {
        &self.config
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    pub fn input_samples(&self) -> usize {
        self.lengths.len()
    }

    pub fn dropped(&self) -> usize {
        self.dropped_empty + self.dropped_overlong
    }

    pub fn dropped_empty(&self) -> usize {
        self.dropped_empty
    }

    pub fn dropped_overlong(&self) -> usize {
        self.dropped_overlong
    }

    pub fn truncated(&self) -> usize {
        self.truncated
    }

    /// The plan of one epoch: a pure function of the planner's input, its seed and `epoch`.
    pub fn plan_epoch(&self, epoch: u64) -> EpochPlan {
        let cfg = &self.config;
        let mut sample_rng = PlanRng::stream(cfg.seed, epoch, Purpose::SampleOrder);
        let mut order_rng = PlanRng::stream(cfg.seed, epoch, Purpose::BatchOrder);
        let layout = if cfg.mode == Mode::Packed {
            Layout::Packed
        } else {
            Layout::Padded
        };
        // Upper bound: untouched capacity costs address space, not memory, and no batch is ever
        // copied by a reallocation.
        let mut batches = Vec::with_capacity(self.kept);
        let samples = match cfg.mode {
            Mode::Sorted => {
                let (frozen, samples) = self.frozen.as_ref().expect("sorted plans are frozen");
                batches.extend_from_slice(frozen);
                order_rng.shuffle(&mut batches);
                samples.clone()
            }
            Mode::Packed => {
                let (mut buf, piles) = self.scatter(&mut sample_rng);
                let base = sample_rng.next_u64();
                epoch::shuffle_piles(bytemuck::cast_slice_mut(&mut buf), &piles, base);
                let mut samples = Vec::with_capacity(self.kept);
                pack::pack_varlen(
                    &buf,
                    cfg.token_budget,
                    self.longest,
                    &mut batches,
                    &mut samples,
                );
                samples
            }
            Mode::Shuffle => {
                let (pairs, piles) = self.scatter(&mut sample_rng);
                let mut buf = bytemuck::allocation::cast_vec::<Pair, u32>(pairs);
                let base = sample_rng.next_u64();
                let mut per_bucket =
                    epoch::shuffle_and_pack(&mut buf, &piles, 1, cfg.token_budget, base);
                batches = per_bucket.pop().expect("one bucket");
                buf.truncate(self.kept);
                buf.shrink_to_fit();
                buf
            }
            Mode::Bucketed => {
                let (pairs, piles) = self.scatter(&mut sample_rng);
                let mut buf = bytemuck::allocation::cast_vec::<Pair, u32>(pairs);
                let base = sample_rng.next_u64();
                let per_bucket = epoch::shuffle_and_pack(
                    &mut buf,
                    &piles,
                    self.buckets.len(),
                    cfg.token_budget,
                    base,
                );
                buf.truncate(self.kept);
                buf.shrink_to_fit();
                let counts: Vec<u32> = per_bucket.iter().map(|v| v.len() as u32).collect();
                let sequence = cfg.interleave.sequence(&counts, cfg.accum, &mut order_rng);
                let mut next = vec![0usize; per_bucket.len()];
                for b in sequence {
                    let b = usize::from(b);
                    batches.push(per_bucket[b][next[b]]);
                    next[b] += 1;
                }
                buf
            }
        };
        batches.shrink_to_fit();
        EpochPlan {
            epoch,
            layout,
            token_budget: cfg.token_budget,
            batches,
            samples,
        }
    }

    /// Every kept sample as `[index, length]`, each bucket in its own span of the buffer and
    /// grouped into random piles there (the first step of the shuffle), with the piles.
    fn scatter(&self, rng: &mut PlanRng) -> (Vec<Pair>, Vec<epoch::Pile>) {
        let sizes: Vec<usize> = self.buckets.iter().map(|b| b.samples).collect();
        epoch::scatter(&self.lengths, &self.bucket_of, &sizes, rng)
    }

    /// Statistics of a plan made by this planner.
    pub fn stats(&self, plan: &EpochPlan) -> PlanStats {
        stats::compute(self, plan)
    }
}

#[cfg(test)]
mod tests;
