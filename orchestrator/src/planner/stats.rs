//! What a plan looks like in numbers: the figures `plan` prints and the tests hold plans to.

use serde::Serialize;

use super::{EpochPlan, Layout, Mode, Planner};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BucketStats {
    pub lo: u32,
    pub hi: u32,
    pub samples: u64,
    pub batches: u64,
    /// Share of the epoch's batches that come from this bucket.
    pub batch_share: f64,
    pub sample_share: f64,
    pub real_tokens: u64,
    pub padded_tokens: u64,
    pub padding_efficiency: f64,
    pub mean_batch_size: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PlanStats {
    pub mode: String,
    /// The interleave of bucketed plans; `random` for sorted (its batch order is shuffled) and
    /// `none` where the packing order is the plan order.
    pub interleave: String,
    pub epoch: u64,
    pub seed: u64,
    pub token_budget: u64,
    pub max_len: u32,
    pub accum: u32,
    /// Input samples, dropped ones included.
    pub samples: u64,
    pub dropped: u64,
    pub dropped_empty: u64,
    pub dropped_overlong: u64,
    pub truncated: u64,
    pub batches: u64,
    pub real_tokens: u64,
    /// Tokens the batches occupy: Σ count × max_len padded, batches × budget packed.
    pub padded_tokens: u64,
    pub padding_efficiency: f64,
    pub mean_batch_size: f64,
    pub buckets: Vec<BucketStats>,
    /// Longest run of consecutive batches from one bucket.
    pub max_same_bucket_run: u64,
    /// Fraction of consecutive non-overlapping windows of `accum` batches in which at least three
    /// batches share a bucket.
    pub windows_3plus_same_bucket: f64,
    /// Length of the run of one bucket that ends the epoch (the `diverse` tail).
    pub tail_same_bucket_run: u64,
    /// Pearson correlation of adjacent batches' mean sample lengths.
    pub adjacent_mean_len_corr: f64,
    /// Pearson correlation of a batch's position in the epoch with its mean sample length.
    pub position_mean_len_corr: f64,
    /// Wall time to build the planner and plan the epoch (`setup_ms + epoch_ms`), filled in by
    /// the caller.
    pub plan_ms: f64,
    /// Of which: building the planner (overlong policy, buckets, `auto:K` search), once per run.
    pub setup_ms: f64,
    /// Of which: planning this epoch.
    pub epoch_ms: f64,
}

pub(super) fn compute(planner: &Planner, plan: &EpochPlan) -> PlanStats {
    let cfg = planner.config();
    let mut buckets: Vec<BucketStats> = planner
        .buckets()
        .iter()
        .map(|b| BucketStats {
            lo: b.lo,
            hi: b.hi,
            samples: b.samples as u64,
            batches: 0,
            batch_share: 0.0,
            sample_share: 0.0,
            real_tokens: 0,
            padded_tokens: 0,
            padding_efficiency: 0.0,
            mean_batch_size: 0.0,
        })
        .collect();
    for batch in &plan.batches {
        let b = &mut buckets[usize::from(batch.bucket)];
        b.batches += 1;
        b.real_tokens += batch.real_tokens;
        b.padded_tokens += plan.padded_tokens(batch);
    }
    let n_batches = plan.batches.len() as u64;
    let kept: u64 = buckets.iter().map(|b| b.samples).sum();
    for b in &mut buckets {
        b.batch_share = ratio(b.batches, n_batches);
        b.sample_share = ratio(b.samples, kept);
        b.padding_efficiency = ratio(b.real_tokens, b.padded_tokens);
        b.mean_batch_size = ratio(b.samples, b.batches);
    }
    let real_tokens: u64 = buckets.iter().map(|b| b.real_tokens).sum();
    let padded_tokens: u64 = buckets.iter().map(|b| b.padded_tokens).sum();

    let seq: Vec<u16> = plan.batches.iter().map(|b| b.bucket).collect();
    let runs: Vec<usize> = seq.chunk_by(|a, b| a == b).map(<[u16]>::len).collect();
    let accum = cfg.accum as usize;
    let windows = seq.len() / accum;
    let mut tally = vec![0u32; buckets.len()];
    let heavy = seq
        .chunks_exact(accum)
        .filter(|w| max_multiplicity(w, &mut tally) >= 3)
        .count();
    let means: Vec<f64> = plan
        .batches
        .iter()
        .map(|b| b.real_tokens as f64 / f64::from(b.count))
        .collect();
    let positions: Vec<f64> = (0..means.len()).map(|i| i as f64).collect();
    let adjacent = if means.len() > 2 {
        pearson(&means[..means.len() - 1], &means[1..])
    } else {
        0.0
    };

    let interleave = match (cfg.mode, plan.layout) {
        (Mode::Bucketed, _) => cfg.interleave.name(),
        (Mode::Sorted, _) => "random",
        (_, Layout::Padded | Layout::Packed) => "none",
    };
    PlanStats {
        mode: cfg.mode.name().to_owned(),
        interleave: interleave.to_owned(),
        epoch: plan.epoch,
        seed: cfg.seed,
        token_budget: cfg.token_budget,
        max_len: cfg.max_len,
        accum: cfg.accum,
        samples: planner.input_samples() as u64,
        dropped: planner.dropped() as u64,
        dropped_empty: planner.dropped_empty() as u64,
        dropped_overlong: planner.dropped_overlong() as u64,
        truncated: planner.truncated() as u64,
        batches: n_batches,
        real_tokens,
        padded_tokens,
        padding_efficiency: ratio(real_tokens, padded_tokens),
        mean_batch_size: ratio(kept, n_batches),
        buckets,
        max_same_bucket_run: runs.iter().copied().max().unwrap_or(0) as u64,
        windows_3plus_same_bucket: ratio(heavy as u64, windows as u64),
        tail_same_bucket_run: runs.last().copied().unwrap_or(0) as u64,
        adjacent_mean_len_corr: adjacent,
        position_mean_len_corr: pearson(&positions, &means),
        plan_ms: 0.0,
        setup_ms: 0.0,
        epoch_ms: 0.0,
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Largest number of batches of one bucket in a window; `tally` is zeroed scratch space with one
/// entry per bucket, left zeroed.
fn max_multiplicity(w: &[u16], tally: &mut [u32]) -> u32 {
    let mut most = 0;
    for &b in w {
        tally[usize::from(b)] += 1;
        most = most.max(tally[usize::from(b)]);
    }
    for &b in w {
        tally[usize::from(b)] = 0;
    }
    most
}

/// Pearson correlation; 0 where either side is constant.
fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len().min(y.len());
    if n < 2 {
        return 0.0;
    }
    let mx = x[..n].iter().sum::<f64>() / n as f64;
    let my = y[..n].iter().sum::<f64>() / n as f64;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for i in 0..n {
        let (dx, dy) = (x[i] - mx, y[i] - my);
        sxy += dx * dy;
        sxx += dx * dx;
        syy += dy * dy;
    }
    if sxx == 0.0 || syy == 0.0 {
        0.0
    } else {
        sxy / (sxx * syy).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pearson_of_known_series() {
        assert!((pearson(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0]) - 1.0).abs() < 1e-12);
        assert!((pearson(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        assert_eq!(pearson(&[1.0, 1.0], &[1.0, 2.0]), 0.0);
    }

    #[test]
    fn multiplicity() {
        let mut tally = vec![0; 5];
        assert_eq!(max_multiplicity(&[1, 2, 1, 1], &mut tally), 3);
        assert_eq!(max_multiplicity(&[1, 2, 3, 4], &mut tally), 1);
        assert!(tally.iter().all(|&t| t == 0));
    }
}
