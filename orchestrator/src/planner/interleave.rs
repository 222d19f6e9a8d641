//! Orders the buckets' batches across an epoch.
//!
//! Each interleave turns per-bucket batch counts into a sequence of bucket ids; the planner then
//! takes each bucket's batches in their (random) packing order. Policies:
//! - `random`: a uniform random permutation.
//! - `diverse`: the original pipeline's "diversity-first" choice, kept exactly for comparison: each
//!   step picks a bucket other than the last one, weighted by remaining batches, and falls back to
//!   any bucket when only the last one is left. Small buckets run dry first, so the epoch ends in a
//!   long homogeneous tail of the largest bucket.
//! - `spread`: every bucket's batches spread evenly over the whole epoch. A credit scheduler: each
//!   step every bucket earns its share of the remaining batches and the bucket with most credit
//!   (plus random jitter, minus a penalty if it already repeats in the current accumulation window)
//!   goes next, with runs of one bucket capped; shares are re-taken from the remaining counts, so
//!   all buckets run out together and there is no tail.
//! - `stratified`: works window by window (`accum` batches, one optimizer step): each window gets
//!   the whole batches its buckets are owed and fills the rest with distinct buckets, so a window
//!   repeats a bucket only as often as the counts force; windows are ordered to avoid adjacent
//!   repeats.

use super::PlanError;
use super::rng::PlanRng;

/// Random jitter added to `spread`'s credits, in batches: how far the order may stray from the
/// perfectly even one.
const SPREAD_JITTER: f64 = 1.0;
/// Credit `spread` takes off a bucket for each time beyond the first that it already appears in
/// the current accumulation window, so windows repeat a bucket only when its share forces it.
const WINDOW_REPEAT_PENALTY: f64 = 1.0;
/// Random jitter on the fractional debts that decide `stratified`'s last slots of a window.
const STRATIFIED_JITTER: f64 = 0.6;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interleave {
    Random,
    Diverse,
    Spread,
    Stratified,
}

impl Interleave {
    pub const ALL: [Interleave; 4] = [
        Interleave::Random,
        Interleave::Diverse,
        Interleave::Spread,
        Interleave::Stratified,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Interleave::Random => "random",
            Interleave::Diverse => "diverse",
            Interleave::Spread => "spread",
            Interleave::Stratified => "stratified",
        }
    }

    /// The bucket id of every step, given each bucket's batch count.
    pub fn sequence(self, counts: &[u32], accum: u32, rng: &mut PlanRng) -> Vec<u16> {
        match self {
            Interleave::Random => random(counts, rng),
            Interleave::Diverse => diverse(counts, rng),
            Interleave::Spread => spread(counts, accum as usize, rng),
            Interleave::Stratified => stratified(counts, accum as usize, rng),
        }
    }
}

impl std::fmt::Display for Interleave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Interleave {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Interleave::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| PlanError::UnknownName {
                what: "interleave",
                value: s.to_owned(),
                expected: "random, diverse, spread, stratified",
            })
    }
}

fn random(counts: &[u32], rng: &mut PlanRng) -> Vec<u16> {
    let mut seq: Vec<u16> = counts
        .iter()
        .enumerate()
        .flat_map(|(b, &n)| std::iter::repeat_n(b as u16, n as usize))
        .collect();
    rng.shuffle(&mut seq);
    seq
}

fn diverse(counts: &[u32], rng: &mut PlanRng) -> Vec<u16> {
    let mut remaining: Vec<u64> = counts.iter().map(|&n| u64::from(n)).collect();
    let total: u64 = remaining.iter().sum();
    let mut seq = Vec::with_capacity(total as usize);
    let mut last: Option<usize> = None;
    for _ in 0..total {
        let others: u64 = remaining
            .iter()
            .enumerate()
            .filter(|&(b, _)| Some(b) != last)
            .map(|(_, &n)| n)
            .sum();
        // Candidates: every bucket with batches left except the last one; all of them if none.
        let exclude = if others > 0 { last } else { None };
        let weight = if others > 0 {
            others
        } else {
            remaining.iter().sum()
        };
        let mut r = rng.below(weight);
        let mut pick = 0;
        for (b, &n) in remaining.iter().enumerate() {
            if Some(b) == exclude || n == 0 {
                continue;
            }
            if r < n {
                pick = b;
                break;
            }
            r -= n;
        }
        remaining[pick] -= 1;
        seq.push(pick as u16);
        last = Some(pick);
    }
    seq
}

/// The longest run of one bucket `spread` allows: one more than the shortest run the largest
/// bucket's share makes unavoidable, so the cap never starves the largest bucket into a tail.
fn run_cap(counts: &[u32]) -> u32 {
    let total: u64 = counts.iter().map(|&n| u64::from(n)).sum();
    let largest = u64::from(counts.iter().copied().max().unwrap_or(0));
    let others = total - largest;
    // `largest` batches separated by `others` batches form at least others + 1 runs.
    let forced = largest.div_ceil(others + 1).max(1);
    (forced + 1).min(u64::from(u32::MAX)) as u32
}

fn spread(counts: &[u32], accum: usize, rng: &mut PlanRng) -> Vec<u16> {
    let mut remaining: Vec<u64> = counts.iter().map(|&n| u64::from(n)).collect();
    let total: u64 = remaining.iter().sum();
    let cap = run_cap(counts);
    // A random phase per bucket, so which bucket leads is not fixed.
    let mut credit: Vec<f64> = counts.iter().map(|_| rng.unit_f64()).collect();
    let mut seq = Vec::with_capacity(total as usize);
    let (mut run_bucket, mut run_len) = (usize::MAX, 0u32);
    let mut left = total;
    let mut in_window = vec![0u32; remaining.len()];
    let mut step = 0usize;
    while left > 0 {
        if step.is_multiple_of(accum) {
            in_window.fill(0);
        }
        step += 1;
        let active = remaining.iter().filter(|&&n| n > 0).count();
        let mut pick = usize::MAX;
        let mut best = f64::NEG_INFINITY;
        for b in 0..remaining.len() {
            if remaining[b] == 0 {
                continue;
            }
            credit[b] += remaining[b] as f64 / left as f64;
            if b == run_bucket && run_len >= cap && active > 1 {
                continue;
            }
            let score = credit[b] + SPREAD_JITTER * rng.unit_f64()
                - WINDOW_REPEAT_PENALTY * f64::from(in_window[b].saturating_sub(1));
            if score > best {
                best = score;
                pick = b;
            }
        }
        credit[pick] -= 1.0;
        in_window[pick] += 1;
        remaining[pick] -= 1;
        left -= 1;
        if pick == run_bucket {
            run_len += 1;
        } else {
            (run_bucket, run_len) = (pick, 1);
        }
        seq.push(pick as u16);
    }
    seq
}

fn stratified(counts: &[u32], accum: usize, rng: &mut PlanRng) -> Vec<u16> {
    let mut remaining: Vec<u64> = counts.iter().map(|&n| u64::from(n)).collect();
    let total: u64 = remaining.iter().sum();
    let k = remaining.len();
    let mut credit = vec![0.0f64; k];
    let mut seq: Vec<u16> = Vec::with_capacity(total as usize);
    let mut left = total;
    let mut alloc = vec![0u64; k];
    let mut window: Vec<u16> = Vec::with_capacity(accum);
    while left > 0 {
        let size = (accum as u64).min(left);
        for b in 0..k {
            if remaining[b] > 0 {
                credit[b] += size as f64 * remaining[b] as f64 / left as f64;
            }
        }
        alloc.fill(0);
        // Whole batches owed first, largest debt first.
        let mut filled = 0;
        let mut by_credit: Vec<usize> = (0..k).filter(|&b| remaining[b] > 0).collect();
        by_credit.sort_by(|&a, &b| credit[b].total_cmp(&credit[a]).then(a.cmp(&b)));
        for &b in &by_credit {
            let owed = credit[b].floor().max(0.0) as u64;
            let give = owed.min(remaining[b]).min(size - filled);
            alloc[b] = give;
            filled += give;
        }
        // The rest to distinct buckets not yet in the window (then any), by fractional debt.
        while filled < size {
            let mut pick = usize::MAX;
            let mut best = (false, f64::NEG_INFINITY);
            for b in 0..k {
                if remaining[b] <= alloc[b] {
                    continue;
                }
                let fresh = alloc[b] == 0;
                let score = credit[b] - alloc[b] as f64 + STRATIFIED_JITTER * rng.unit_f64();
                if (fresh, score) > best {
                    best = (fresh, score);
                    pick = b;
                }
            }
            alloc[pick] += 1;
            filled += 1;
        }
        for b in 0..k {
            credit[b] -= alloc[b] as f64;
            remaining[b] -= alloc[b];
        }
        left -= size;
        // Order the window: most-allocated bucket first, never the previous step's bucket when
        // another is available, ties broken at random.
        window.clear();
        let mut prev = seq.last().copied();
        for _ in 0..size {
            let mut pick = usize::MAX;
            let mut best = (false, 0u64, 0u64);
            for (b, &n) in alloc.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let key = (Some(b as u16) != prev, n, rng.next_u64());
                if key > best {
                    best = key;
                    pick = b;
                }
            }
            alloc[pick] -= 1;
            window.push(pick as u16);
            prev = Some(pick as u16);
        }
        seq.extend_from_slice(&window);
    }
    seq
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_counts(seq: &[u16], counts: &[u32]) {
        let mut got = vec![0u32; counts.len()];
        for &b in seq {
            got[b as usize] += 1;
        }
        assert_eq!(got, counts);
    }

    fn max_run(seq: &[u16]) -> usize {
        seq.chunk_by(|a, b| a == b)
            .map(<[u16]>::len)
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn every_policy_keeps_counts() {
        let counts = [0, 13, 1, 200, 7, 55];
        for p in Interleave::ALL {
            for accum in [1, 3, 4] {
                let mut rng = PlanRng::from_seed(5);
                check_counts(&p.sequence(&counts, accum, &mut rng), &counts);
            }
        }
    }

    #[test]
    fn spread_caps_runs_of_a_majority_bucket() {
        // The seeds' shape: one bucket with 52% of the batches.
        let counts = [2400, 2300, 2200, 2100, 2000, 11800];
        let mut rng = PlanRng::from_seed(1);
        let seq = spread(&counts, 4, &mut rng);
        assert!(max_run(&seq) <= 3, "{}", max_run(&seq));
        // No homogeneous tail: the last 100 steps still mix buckets.
        let tail: std::collections::BTreeSet<u16> =
            seq[seq.len() - 100..].iter().copied().collect();
        assert!(tail.len() >= 4, "{tail:?}");
    }

    #[test]
    fn run_cap_follows_the_largest_share() {
        assert_eq!(run_cap(&[10, 10]), 2);
        assert_eq!(run_cap(&[52, 48]), 3);
        assert_eq!(run_cap(&[90, 10]), 10);
        assert_eq!(run_cap(&[5]), 6);
    }
}
