//! Planner invariants (property tests) and regression tests for the original pipeline's bugs.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::workload::synthetic_lengths;

const SEED_BOUNDARIES: [u32; 7] = [0, 770, 1216, 1728, 2432, 3296, 8192];

fn config(mode: Mode, interleave: Interleave, buckets: BucketSpec) -> PlanConfig {
    PlanConfig {
        mode,
        interleave,
        buckets,
        ..PlanConfig::default()
    }
}

/// Every kept sample exactly once, no dropped sample, every batch within budget and its recorded
/// figures true.
fn check_plan(planner: &Planner, input: &[u32], plan: &EpochPlan) -> Result<(), TestCaseError> {
    let lengths: Vec<u32> = input.iter().map(|&l| planner.effective_len(l)).collect();
    prop_assert_eq!(&lengths[..], planner.lengths());
    let mut seen = vec![0u8; lengths.len()];
    let budget = planner.config().token_budget;
    for b in &plan.batches {
        let members = plan.batch_samples(b);
        prop_assert!(!members.is_empty());
        let mut max = 0;
        let mut real = 0u64;
        for &s in members {
            seen[s as usize] += 1;
            max = max.max(lengths[s as usize]);
            real += u64::from(lengths[s as usize]);
        }
        prop_assert_eq!(b.max_len, max);
        prop_assert_eq!(b.real_tokens, real);
        match plan.layout {
            Layout::Padded => prop_assert!(u64::from(b.count) * u64::from(max) <= budget),
            Layout::Packed => prop_assert!(real <= budget),
        }
        let bucket = &planner.buckets()[usize::from(b.bucket)];
        for &s in members {
            let len = lengths[s as usize];
            prop_assert!(bucket.lo < len && len <= bucket.hi);
        }
    }
    let mut dropped = 0;
    for (i, &len) in lengths.iter().enumerate() {
        if len == 0 {
            dropped += 1;
            prop_assert_eq!(seen[i], 0, "dropped sample {} was planned", i);
        } else {
            prop_assert_eq!(seen[i], 1, "sample {} planned {} times", i, seen[i]);
        }
    }
    prop_assert_eq!(dropped, planner.dropped());
    Ok(())
}

/// The batches of a plan as a set of sample sets: what "composition" means, order aside.
fn composition(plan: &EpochPlan) -> BTreeSet<Vec<u32>> {
    plan.batches
        .iter()
        .map(|b| {
            let mut v = plan.batch_samples(b).to_vec();
            v.sort_unstable();
            v
        })
        .collect()
}

fn mode_strategy() -> impl Strategy<Value = Mode> {
    prop::sample::select(Mode::ALL.to_vec())
}

fn interleave_strategy() -> impl Strategy<Value = Interleave> {
    prop::sample::select(Interleave::ALL.to_vec())
}

/// Bucket specs valid for `max_len`: auto:K or increasing cut points below it.
fn buckets_strategy(max_len: u32) -> impl Strategy<Value = BucketSpec> {
    prop_oneof![
        (1u32..6).prop_map(BucketSpec::Auto),
        prop::collection::btree_set(1..max_len, 0..6).prop_map(move |cuts| {
            let mut b = vec![0];
            b.extend(cuts);
            b.push(max_len);
            BucketSpec::Boundaries(b)
        }),
    ]
}

fn case() -> impl Strategy<Value = (Vec<u32>, PlanConfig)> {
    (20u32..400, 1u64..10).prop_flat_map(|(max_len, budget_factor)| {
        (
            prop::collection::vec(0u32..(max_len * 3 / 2), 1..300),
            mode_strategy(),
            interleave_strategy(),
            buckets_strategy(max_len),
            prop::bool::ANY,
            1u32..6,
            any::<u64>(),
            0u64..max_len as u64,
        )
            .prop_map(
                move |(lengths, mode, interleave, buckets, drop, accum, seed, extra)| {
                    let cfg = PlanConfig {
                        mode,
                        interleave,
                        buckets,
                        token_budget: u64::from(max_len) * budget_factor + extra,
                        max_len,
                        on_overlong: if drop {
                            OverlongPolicy::Drop
                        } else {
                            OverlongPolicy::Truncate
                        },
                        accum,
                        seed,
                    };
                    (lengths, cfg)
                },
            )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn every_sample_once_and_budget_respected((lengths, cfg) in case(), epoch in 0u64..4) {
        match Planner::new(lengths.clone(), cfg.clone()) {
            Ok(planner) => {
                let plan = planner.plan_epoch(epoch);
                check_plan(&planner, &lengths, &plan)?;
                let stats = planner.stats(&plan);
                prop_assert_eq!(stats.batches as usize, plan.batches.len());
                prop_assert_eq!(stats.dropped as usize, planner.dropped());
                let per_bucket: u64 = stats.buckets.iter().map(|b| b.samples).sum();
                prop_assert_eq!(per_bucket + stats.dropped, lengths.len() as u64);
                let overlong = lengths.iter().filter(|&&l| l > cfg.max_len).count() as u64;
                match cfg.on_overlong {
                    OverlongPolicy::Truncate => prop_assert_eq!(stats.truncated, overlong),
                    OverlongPolicy::Drop => prop_assert_eq!(stats.dropped_overlong, overlong),
                }
            }
            Err(PlanError::AllDropped { .. }) => {
                prop_assert!(lengths.iter().all(|&l| l == 0
                    || (l > cfg.max_len && cfg.on_overlong == OverlongPolicy::Drop)));
            }
            Err(e) => prop_assert!(false, "unexpected error {}", e),
        }
    }

    #[test]
    fn same_seed_and_epoch_same_plan((lengths, cfg) in case(), epoch in 0u64..4) {
        if let Ok(a) = Planner::new(lengths.clone(), cfg.clone()) {
            let b = Planner::new(lengths.clone(), cfg).unwrap();
            prop_assert_eq!(a.plan_epoch(epoch), b.plan_epoch(epoch));
        }
    }

    /// Enough samples and room for several per batch: epochs must differ in composition, not
    /// only in order (all modes but `sorted`, which reproduces the frozen original on purpose).
    #[test]
    fn epochs_differ_in_composition(
        lengths in prop::collection::vec(1u32..=256, 200..600),
        mode in prop::sample::select(vec![Mode::Shuffle, Mode::Bucketed, Mode::Packed]),
        interleave in interleave_strategy(),
        buckets in buckets_strategy(256),
        seed in any::<u64>(),
        epoch in 0u64..100,
    ) {
        let cfg = PlanConfig {
            mode, interleave, buckets, token_budget: 256 * 8, max_len: 256, seed,
            ..PlanConfig::default()
        };
        let planner = Planner::new(lengths.clone(), cfg).unwrap();
        let a = planner.plan_epoch(epoch);
        let b = planner.plan_epoch(epoch + 1);
        prop_assert_ne!(composition(&a), composition(&b));
    }
}

#[test]
fn sorted_mode_reproduces_the_frozen_composition_bug() {
    let lengths = synthetic_lengths(20_000, 3);
    let cfg = config(Mode::Sorted, Interleave::Random, BucketSpec::Auto(1));
    let planner = Planner::new(lengths.clone(), cfg).unwrap();
    let (a, b) = (planner.plan_epoch(0), planner.plan_epoch(1));
    // Same batches, different order: exactly what froze the original pipeline.
    assert_eq!(composition(&a), composition(&b));
    assert_ne!(a.batches, b.batches);
}

#[test]
fn every_other_mode_redraws_composition_each_epoch() {
    let lengths = synthetic_lengths(20_000, 3);
    let bounds = BucketSpec::Boundaries(SEED_BOUNDARIES.to_vec());
    for mode in [Mode::Shuffle, Mode::Bucketed, Mode::Packed] {
        let planner = Planner::new(
            lengths.clone(),
            config(mode, Interleave::Spread, bounds.clone()),
        )
        .unwrap();
        let (a, b) = (
            composition(&planner.plan_epoch(0)),
            composition(&planner.plan_epoch(1)),
        );
        let shared = a.intersection(&b).count();
        // Almost no batch survives into the next epoch unchanged.
        assert!(
            shared * 50 < a.len(),
            "{mode}: {shared} of {} batches repeated",
            a.len()
        );
    }
}

/// The seeds kept `diverse` knowing that small buckets run dry first: the epoch ends with a long
/// run of the largest bucket. Kept as they had it; `spread` and `stratified` have no such tail.
#[test]
fn diverse_keeps_its_homogeneous_tail_and_spread_has_none() {
    let lengths = synthetic_lengths(100_000, 0);
    let bounds = BucketSpec::Boundaries(SEED_BOUNDARIES.to_vec());
    let stats_for = |interleave| {
        let planner = Planner::new(
            lengths.clone(),
            config(Mode::Bucketed, interleave, bounds.clone()),
        )
        .unwrap();
        planner.stats(&planner.plan_epoch(0))
    };
    let diverse = stats_for(Interleave::Diverse);
    let largest = diverse.buckets.iter().map(|b| b.batches).max().unwrap();
    assert!(
        diverse.tail_same_bucket_run * 20 > diverse.batches,
        "diverse tail {} of {} batches",
        diverse.tail_same_bucket_run,
        diverse.batches
    );
    assert!(diverse.tail_same_bucket_run < largest);
    for interleave in [Interleave::Spread, Interleave::Stratified] {
        let s = stats_for(interleave);
        assert!(
            s.tail_same_bucket_run <= 3,
            "{interleave}: tail {}",
            s.tail_same_bucket_run
        );
    }
    let spread = stats_for(Interleave::Spread);
    assert!(
        spread.max_same_bucket_run <= 3,
        "{}",
        spread.max_same_bucket_run
    );
    assert!(spread.windows_3plus_same_bucket <= 0.22);
}

#[test]
fn bucketed_packing_stays_inside_each_bucket() {
    let lengths = synthetic_lengths(10_000, 9);
    let cfg = config(
        Mode::Bucketed,
        Interleave::Random,
        BucketSpec::Boundaries(SEED_BOUNDARIES.to_vec()),
    );
    let planner = Planner::new(lengths.clone(), cfg).unwrap();
    let plan = planner.plan_epoch(0);
    check_plan(&planner, &lengths, &plan).unwrap();
    assert_eq!(planner.buckets().len(), 6);
}

#[test]
fn rejects_invalid_configurations() {
    let l = [10, 20, 30];
    let bad = |cfg: PlanConfig| Planner::new(l.to_vec(), cfg).unwrap_err().to_string();
    let d = PlanConfig::default();
    assert!(
        bad(PlanConfig {
            token_budget: 100,
            max_len: 200,
            ..d.clone()
        })
        .contains("smaller than --max-len")
    );
    assert!(
        bad(PlanConfig {
            buckets: BucketSpec::Auto(0),
            ..d.clone()
        })
        .contains("auto:0")
    );
    assert!(
        bad(PlanConfig {
            buckets: BucketSpec::Boundaries(vec![0, 50, 40, 8192]),
            ..d.clone()
        })
        .contains("strictly increasing")
    );
    assert!(
        bad(PlanConfig {
            accum: 0,
            ..d.clone()
        })
        .contains("--accum")
    );
    assert_eq!(
        Planner::new(vec![], d.clone()).unwrap_err(),
        PlanError::EmptyInput
    );
    assert!(matches!(
        Planner::new(vec![0, 0], d.clone()),
        Err(PlanError::AllDropped { .. })
    ));
    let drop = PlanConfig {
        max_len: 5,
        token_budget: 5,
        on_overlong: OverlongPolicy::Drop,
        ..d
    };
    assert!(bad(drop).contains("longer than --max-len 5"));
    assert!(
        "sideways"
            .parse::<Mode>()
            .unwrap_err()
            .to_string()
            .contains("unknown mode")
    );
    assert!("zigzag".parse::<Interleave>().is_err());
    assert!("cut".parse::<OverlongPolicy>().is_err());
}
