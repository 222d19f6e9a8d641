//! Length buckets: explicit boundaries or `auto:K`, chosen to minimise the padding that the real
//! packing produces.
//!
//! A bucket holds the samples with `lo < length <= hi`; boundaries `0, b1, ..., max_len` give one
//! bucket per consecutive pair.

use super::pack::PaddedPacker;
use super::rng::{PlanRng, Purpose};
use super::{PlanConfig, PlanError};

/// Largest K accepted by `auto:K`.
pub const AUTO_MAX_BUCKETS: u32 = 64;
/// Most buckets an explicit list may define.
pub const MAX_BUCKETS: usize = 1024;
/// Samples the `auto:K` search packs (a uniform random subsample of the kept samples).
const AUTO_SUBSAMPLE: usize = 32_768;
/// Candidate boundaries the `auto:K` search considers (length quantiles).
const AUTO_CANDIDATES: usize = 64;

/// How bucket boundaries are given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BucketSpec {
    /// Strictly increasing, starting at 0, last >= `max_len`.
    Boundaries(Vec<u32>),
    /// K buckets chosen by the planner.
    Auto(u32),
}

impl std::str::FromStr for BucketSpec {
    type Err = PlanError;

    /// Parses `auto:K` or a comma-separated list such as `0,770,1216,8192`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some(k) = s.strip_prefix("auto:") {
            let k: u32 = k.trim().parse().map_err(|_| {
                PlanError::Invalid(format!(
                    "invalid --buckets {s:?}: `auto:K` needs a whole number of buckets K"
                ))
            })?;
            return Ok(BucketSpec::Auto(k));
        }
        let mut bounds = Vec::new();
        for (i, part) in s.split(',').enumerate() {
            let part = part.trim();
            let value: u32 = part.parse().map_err(|_| {
                PlanError::Invalid(format!(
                    "invalid --buckets {s:?}: boundary {} is {part:?}, not a non-negative integer \
                     (expected a list like 0,770,1216,8192 or auto:K)",
                    i + 1
                ))
            })?;
            bounds.push(value);
        }
        Ok(BucketSpec::Boundaries(bounds))
    }
}

impl std::fmt::Display for BucketSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BucketSpec::Auto(k) => write!(f, "auto:{k}"),
            BucketSpec::Boundaries(b) => {
                let parts: Vec<String> = b.iter().map(u32::to_string).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

impl BucketSpec {
    pub fn validate(&self, max_len: u32) -> Result<(), PlanError> {
        match self {
            BucketSpec::Auto(0) => Err(PlanError::Invalid(
                "invalid --buckets auto:0: at least one bucket is needed".into(),
            )),
            BucketSpec::Auto(k) if *k > AUTO_MAX_BUCKETS => Err(PlanError::Invalid(format!(
                "invalid --buckets auto:{k}: at most {AUTO_MAX_BUCKETS} buckets"
            ))),
            BucketSpec::Auto(_) => Ok(()),
            BucketSpec::Boundaries(b) => {
                if b.len() < 2 {
                    return Err(PlanError::Invalid(format!(
                        "invalid --buckets {self}: need at least two boundaries (e.g. 0,{max_len})"
                    )));
                }
                if b.len() > MAX_BUCKETS + 1 {
                    return Err(PlanError::Invalid(format!(
                        "invalid --buckets: {} boundaries define more than {MAX_BUCKETS} buckets",
                        b.len()
                    )));
                }
                if b[0] != 0 {
                    return Err(PlanError::Invalid(format!(
                        "invalid --buckets {self}: the first boundary must be 0, got {}",
                        b[0]
                    )));
                }
                if let Some(w) = b.windows(2).find(|w| w[1] <= w[0]) {
                    return Err(PlanError::Invalid(format!(
                        "invalid --buckets {self}: boundaries must be strictly increasing, but {} \
                         is followed by {}",
                        w[0], w[1]
                    )));
                }
                let last = b[b.len() - 1];
                if last < max_len {
                    return Err(PlanError::Invalid(format!(
                        "invalid --buckets {self}: the last boundary {last} does not cover \
                         --max-len {max_len}"
                    )));
                }
                Ok(())
            }
        }
    }

    /// The boundaries to use for these (effective) lengths; `auto:K` searches, lists are returned
    /// as given.
    pub(super) fn resolve(&self, lengths: &[u32], kept: usize, config: &PlanConfig) -> Vec<u32> {
        match self {
            BucketSpec::Boundaries(b) => b.clone(),
            BucketSpec::Auto(k) => auto_boundaries(lengths, kept, *k as usize, config),
        }
    }
}

/// The bucket of every length `0..=longest`: the first boundary >= the length closes it.
pub(super) fn bucket_of_length(boundaries: &[u32], longest: u32) -> Vec<u16> {
    (0..=longest)
        .map(|len| boundaries.partition_point(|&x| x < len).saturating_sub(1) as u16)
        .collect()
}

/// Chooses `k` buckets minimising the padded tokens of the real greedy packing.
///
/// Packing cost is measured, not modelled: a fixed random subsample of the samples (drawn with
/// replacement, so it is in random order) is packed for every candidate bucket `(c_i, c_j]` over
/// length quantiles `c`; a dynamic programme then picks the `k` consecutive buckets of least total
/// padding. The subsample depends on the seed only, so boundaries stay fixed across epochs.
fn auto_boundaries(lengths: &[u32], kept: usize, k: usize, config: &PlanConfig) -> Vec<u32> {
    let mut rng = PlanRng::stream(config.seed, 0, Purpose::AutoBuckets);
    // Draw from the input, skipping dropped samples, while at least half are kept.
    let compacted: Vec<u32>;
    let pool = if kept * 2 >= lengths.len() {
        lengths
    } else {
        compacted = lengths.iter().copied().filter(|&l| l > 0).collect();
        &compacted
    };
    let sample: Vec<u32> = (0..kept.min(AUTO_SUBSAMPLE))
        .map(|_| {
            loop {
                let len = pool[rng.below(pool.len() as u64) as usize];
                if len > 0 {
                    break len;
                }
            }
        })
        .collect();

    let mut sorted = sample.clone();
    sorted.sort_unstable();
    let mut cands = vec![0u32];
    for q in 1..=AUTO_CANDIDATES {
        let v = sorted[(q * sorted.len()).div_ceil(AUTO_CANDIDATES) - 1];
        if v > *cands.last().expect("non-empty") {
            cands.push(v);
        }
    }
    // The last boundary covers every allowed length.
    *cands.last_mut().expect("non-empty") = config.max_len;
    let m = cands.len() - 1;
    let k = k.min(m);

    // Interval index (1..=m) of every subsampled sample, in random order.
    let interval: Vec<usize> = sample
        .iter()
        .map(|&len| cands.partition_point(|&c| c < len))
        .collect();
    // cost[i][j]: padded tokens of bucket (c_i, c_j]. For each lower cut i, one pass over the
    // subsample feeds every bucket (c_i, c_j] that holds the sample, each packing independently.
    let mut cost = vec![vec![0u64; m + 1]; m + 1];
    let mut packers = vec![PaddedPacker::new(config.token_budget); m + 1];
    for (i, row) in cost.iter_mut().enumerate().take(m) {
        let mut padded = vec![0u64; m + 1];
        packers.fill(PaddedPacker::new(config.token_budget));
        for (&len, &t) in sample.iter().zip(&interval) {
            if t <= i {
                continue;
            }
            for (packer, pad) in packers[t..].iter_mut().zip(&mut padded[t..]) {
                if let Some((count, max_len)) = packer.push(len) {
                    *pad += u64::from(count) * u64::from(max_len);
                }
            }
        }
        for ((cell, packer), pad) in row.iter_mut().zip(&packers).zip(&padded).skip(i + 1) {
            let (count, max_len) = packer.open();
            *cell = pad + u64::from(count) * u64::from(max_len);
        }
    }
    // best[t][j]: least cost of covering (0, c_j] with t buckets; from[t][j]: the previous cut.
    let mut best = vec![vec![u64::MAX; m + 1]; k + 1];
    let mut from = vec![vec![0usize; m + 1]; k + 1];
    best[0][0] = 0;
    for t in 1..=k {
        for j in t..=m {
            for i in t - 1..j {
                if best[t - 1][i] == u64::MAX {
                    continue;
                }
                let c = best[t - 1][i] + cost[i][j];
                if c < best[t][j] {
                    best[t][j] = c;
                    from[t][j] = i;
                }
            }
        }
    }
    let mut bounds = vec![config.max_len];
    let mut j = m;
    for t in (1..=k).rev() {
        j = from[t][j];
        bounds.push(cands[j]);
    }
    bounds.reverse();
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lists_and_auto() {
        assert_eq!(
            "0,770,8192".parse::<BucketSpec>().unwrap(),
            BucketSpec::Boundaries(vec![0, 770, 8192])
        );
        assert_eq!("auto:8".parse::<BucketSpec>().unwrap(), BucketSpec::Auto(8));
        assert!("auto:x".parse::<BucketSpec>().is_err());
        assert!("0,-5,10".parse::<BucketSpec>().is_err());
        assert!("0,,10".parse::<BucketSpec>().is_err());
    }

    #[test]
    fn rejects_bad_boundaries() {
        let bad = |s: &str| s.parse::<BucketSpec>().unwrap().validate(8192).unwrap_err();
        assert!(
            bad("0,100,100,8192")
                .to_string()
                .contains("strictly increasing")
        );
        assert!(
            bad("0,500,100,8192")
                .to_string()
                .contains("strictly increasing")
        );
        assert!(bad("0,100,4096").to_string().contains("does not cover"));
        assert!(bad("10,100,8192").to_string().contains("must be 0"));
        assert!(bad("auto:0").to_string().contains("auto:0"));
        assert!(bad("8192").to_string().contains("two boundaries"));
    }

    #[test]
    fn assigns_upper_inclusive() {
        let of = bucket_of_length(&[0, 770, 8192], 8192);
        assert_eq!((of[1], of[770], of[771], of[8192]), (0, 0, 1, 1));
    }

    #[test]
    fn auto_separates_two_clusters() {
        // Half the samples near 100, half near 4000: two buckets must split between them.
        let lengths: Vec<u32> = (0..4000)
            .map(|i| {
                if i % 2 == 0 {
                    90 + i % 20
                } else {
                    3990 + i % 20
                }
            })
            .collect();
        let cfg = PlanConfig::default();
        let b = auto_boundaries(&lengths, 4000, 2, &cfg);
        assert_eq!(b.len(), 3);
        assert!((108..3990).contains(&b[1]), "{b:?}");
        assert_eq!(b[2], cfg.max_len);
    }
}
