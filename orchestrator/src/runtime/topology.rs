//! `--topology auto`: how many of a run's workers are targets and how many are drafters, from
//! what one micro-batch costs each role on the run's own data.
//!
//! A target worker turns a micro-batch into features; a drafter trains on them. With `T`
//! targets at `Ct` seconds per micro-batch and `D` drafters at `Cd`, the run moves
//! `min(T / Ct, D / Cd)` micro-batches a second; auto picks the `T:D` of the workers given
//! that makes this largest (the fewest drafters among equals), within what the run allows:
//! the candle drafter trains alone, data-parallel drafters need `--accum` at least their number
//! (of every node), and a resume keeps the run's drafters (their number decides the order the
//! gradients are summed in).
//!
//! The costs per micro-batch, averaged over the first epoch's plan:
//! - the synthetic stage: `--synthetic-us-per-token` (targets) and
//!   `--synthetic-drafter-us-per-token` (drafters) times the batch's tokens;
//! - the DFlash stage on GPUs: the FLOPs of the target's forward (up to its last feature layer)
//!   and of the drafter's forward and backward (its anchors' blocks, the context's projection,
//!   the language-model head, attention over the pairs the mask lets attend), each at the
//!   efficiency `scripts/bench-step-account` projects for it on an H200;
//! - the DFlash stage on CPU workers: none. They share this machine's cores, so there is no
//!   per-device rate to balance; all but one are targets.

use serde::Serialize;

use super::spec::{Device, Topology};
use crate::planner::Planner;
use dflash_common::dflash::{DflashSettings, Engine, Qwen3Config};

/// The H200's dense bf16 peak, FLOP/s (the accounting's roofline).
pub const PEAK_FLOPS: f64 = 989e12;
/// The fraction of the peak a torch target's forward reaches: `scripts/bench-step-account`'s
/// projection of the packed target (59 % at 8,192 and 2,048 tokens).
pub const TARGET_EFFICIENCY: f64 = 0.59;
/// The same for the torch drafter's batched step (51 % at 8,192 and 53 % at 2,048 as shipped).
pub const DRAFTER_EFFICIENCY: f64 = 0.52;

/// What one micro-batch costs one worker of each role, in seconds, and where the figures come
/// from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Costs {
    pub target_s: f64,
    pub drafter_s: f64,
    pub basis: String,
}

/// A run's topology and how it was decided: what `launch --dry-run` prints and the journal keeps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Choice {
    pub targets: u32,
    pub drafters: u32,
    /// `given` (`--topology T:D`), `auto`, or `default` (all but one: a run without
    /// `--topology` on the synthetic stage).
    pub how: String,
    /// Why this topology, in words.
    pub reason: String,
    /// The costs it was balanced on, where there were any.
    pub costs: Option<Costs>,
    /// Predicted micro-batches a second with this topology and with all but one as targets.
    pub rate: Option<f64>,
    pub rate_all_but_one: Option<f64>,
}

impl Choice {
    pub fn topology(&self) -> Topology {
        Topology {
            targets: self.targets,
            drafters: self.drafters,
        }
    }

    /// One line for people: `2:6 (auto: ...)`.
    pub fn describe(&self) -> String {
        format!(
            "{}:{} ({}: {})",
            self.targets, self.drafters, self.how, self.reason
        )
    }

    /// A topology taken as it is (given, or the synthetic stage's default).
    pub fn fixed(t: Topology, how: &str, reason: &str) -> Choice {
        Choice {
            targets: t.targets,
            drafters: t.drafters,
            how: how.into(),
            reason: reason.into(),
            costs: None,
            rate: None,
            rate_all_but_one: None,
        }
    }
}

/// Micro-batches a second with `t` targets and `d` drafters.
pub fn rate(t: u32, d: u32, costs: &Costs) -> f64 {
    let side = |n: u32, c: f64| {
        if c > 0.0 {
            f64::from(n) / c
        } else {
            f64::INFINITY
        }
    };
    side(t, costs.target_s).min(side(d, costs.drafter_s))
}

/// The balancing topology of `workers` workers with at most `most_drafters` drafters (and at
/// least one of each role): the largest rate, the fewest drafters among equal rates. Costs of
/// zero on both sides keep all but one as targets.
pub fn balance(workers: u32, costs: &Costs, most_drafters: u32) -> Topology {
    let top = most_drafters.min(workers.saturating_sub(1)).max(1);
    let mut best = Topology {
        targets: workers.saturating_sub(1).max(1),
        drafters: 1,
    };
    let mut best_rate = rate(best.targets, 1, costs);
    for d in 2..=top {
        let r = rate(workers - d, d, costs);
        // Better by more than rounding: equals keep fewer drafters.
        if r > best_rate * (1.0 + 1e-9) {
            best = Topology {
                targets: workers - d,
                drafters: d,
            };
            best_rate = r;
        }
    }
    best
}

/// What bounds the drafters of an auto topology.
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    /// At most this many drafters.
    pub most: u32,
    /// Exactly `most`: a resume keeps the run's drafters.
    pub exact: bool,
    /// Why, where something other than the worker count bounds them.
    pub why: Option<String>,
}

/// What bounds the drafters of an auto topology of `workers` workers: the engine, `--accum`
/// over the nodes, or (`resumed`) the run's own drafters.
pub fn drafter_limit(
    workers: u32,
    settings: Option<&DflashSettings>,
    accum: u32,
    nodes: u32,
    resumed: Option<u32>,
) -> Limit {
    if let Some(d) = resumed {
        return Limit {
            most: d,
            exact: true,
            why: Some(format!(
                "a resume keeps the run's {d} drafter{} (their number decides the order the gradients are summed in)",
                if d == 1 { "" } else { "s" }
            )),
        };
    }
    let mut limit = Limit {
        most: workers.saturating_sub(1).max(1),
        exact: false,
        why: None,
    };
    if let Some(s) = settings {
        if s.engines.drafter != Engine::Torch {
            return Limit {
                most: 1,
                exact: false,
                why: Some("the candle drafter trains alone (--engine torch trains several)".into()),
            };
        }
        let cap = (accum / nodes.max(1)).max(1);
        if cap < limit.most {
            limit.most = cap;
            limit.why = Some(if nodes > 1 {
                format!("--accum {accum} over {nodes} nodes allows {cap} drafters a node")
            } else {
                format!("--accum {accum} allows {cap} drafters")
            });
        }
    }
    limit
}

/// The synthetic stage's costs: microseconds per token of each role, times the mean tokens of
/// the first epoch's micro-batches.
pub fn synthetic_costs(planner: &Planner, target_us: f64, drafter_us: f64) -> Costs {
    let tokens = mean_over_batches(planner, |lens| lens.iter().map(|&l| l as f64).sum());
    Costs {
        target_s: target_us * tokens / 1e6,
        drafter_s: drafter_us * tokens / 1e6,
        basis: format!(
            "synthetic stage: {target_us} µs a token on a target, {drafter_us} on a drafter, {tokens:.0} tokens a micro-batch"
        ),
    }
}

/// The mean over the first epoch's micro-batches of `f` of their (effective) sequence lengths.
fn mean_over_batches(planner: &Planner, f: impl Fn(&[u32]) -> f64) -> f64 {
    let plan = planner.plan_epoch(0);
    if plan.batches.is_empty() {
        return 0.0;
    }
    let lengths = planner.lengths();
    let mut lens = Vec::new();
    let mut total = 0.0;
    for b in &plan.batches {
        lens.clear();
        lens.extend(
            plan.batch_samples(b)
                .iter()
                .map(|&s| planner.effective_len(lengths[s as usize])),
        );
        total += f(&lens);
    }
    total / plan.batches.len() as f64
}

/// FLOPs of the target's forward over sequences of `lens` tokens: the decoder layers up to the
/// last feature layer (all of them, and the head, when the loss distils).
pub fn target_flops(target: &Qwen3Config, s: &DflashSettings, lens: &[u32]) -> f64 {
    let h = target.hidden_size as f64;
    let i = target.intermediate_size as f64;
    let q = (target.num_attention_heads * target.head_dim()) as f64;
    let kv = (target.num_key_value_heads * target.head_dim()) as f64;
    let layers = s.target_layers_needed(target.num_hidden_layers) as f64;
    let tokens: f64 = lens.iter().map(|&l| f64::from(l)).sum();
    let pairs: f64 = lens
        .iter()
        .map(|&l| f64::from(l) * (f64::from(l) + 1.0) / 2.0)
        .sum();
    let per_token = 2.0 * (h * q + 2.0 * h * kv + q * h + 3.0 * h * i);
    let head = if s.distill().is_some() {
        2.0 * tokens * h * target.vocab_size as f64
    } else {
        0.0
    };
    layers * (tokens * per_token + pairs * 4.0 * q) + head
}

/// FLOPs of the drafter's forward and backward over sequences of `lens` tokens: up to
/// `--num-anchors` anchors a sequence (one per token that has a next one, at most), each a block
/// of `--block-size` positions.
pub fn drafter_flops(target: &Qwen3Config, s: &DflashSettings, lens: &[u32]) -> f64 {
    let h = target.hidden_size as f64;
    let i = target.intermediate_size as f64;
    let heads = target.num_attention_heads as f64;
    let hd = target.head_dim() as f64;
    let (q, kv) = (heads * hd, target.num_key_value_heads as f64 * hd);
    let layers = s.draft_layers as f64;
    let block = s.block_size as f64;
    let states = s.target_layer_ids.len() as f64;
    let v = target.vocab_size as f64;
    let mut tokens = 0.0;
    let mut rows = 0.0;
    let mut pairs = 0.0;
    for &l in lens {
        let l = f64::from(l);
        let anchors = (s.num_anchors as f64).min((l - 1.0).max(0.0));
        tokens += l;
        rows += anchors * block;
        // Anchors spread over the sequence: on average half of it before each, within the
        // window where one applies; and the block's own keys.
        let context = s
            .sliding_window
            .map_or(l / 2.0, |w| (l / 2.0).min(w as f64));
        pairs += anchors * block * (context + block);
    }
    // Forward and the weight gradient of the context's projection (none into the features).
    let fc = 2.0 * tokens * states * h * h * 2.0;
    let context_kv = layers * 2.0 * tokens * h * 2.0 * kv * 3.0;
    let per_row = 2.0 * (h * q + 2.0 * h * kv + q * h + 3.0 * h * i);
    let blocks = layers * rows * per_row * 3.0;
    // The frozen head: forward and the input gradient.
    let head = 2.0 * rows * v * h * 2.0;
    let attention = layers * pairs * q * 12.0;
    fc + context_kv + blocks + head + attention
}

/// The DFlash stage's costs on GPUs, by the FLOP model (see the module's documentation).
pub fn dflash_costs(target: &Qwen3Config, s: &DflashSettings, planner: &Planner) -> Costs {
    let t = mean_over_batches(planner, |lens| target_flops(target, s, lens));
    let d = mean_over_batches(planner, |lens| drafter_flops(target, s, lens));
    Costs {
        target_s: t / (PEAK_FLOPS * TARGET_EFFICIENCY),
        drafter_s: d / (PEAK_FLOPS * DRAFTER_EFFICIENCY),
        basis: format!(
            "FLOP model of the first epoch's micro-batches: {:.3} PFLOP a target forward, {:.3} PFLOP a drafter step, on an H200 at {:.0} % and {:.0} % of its bf16 peak",
            t / 1e15,
            d / 1e15,
            TARGET_EFFICIENCY * 100.0,
            DRAFTER_EFFICIENCY * 100.0
        ),
    }
}

/// What the run's own figures are for an auto topology.
pub enum Basis<'a> {
    Synthetic {
        target_us: f64,
        drafter_us: f64,
    },
    Dflash {
        target: &'a Qwen3Config,
        settings: &'a DflashSettings,
    },
}

/// Decides the topology of a run on `devices`: as given, the default (all but one are targets),
/// or (auto) balanced on the costs of `basis` within `limit`. Errors where a resume's drafters
/// leave no worker for a target.
pub fn choose(
    devices: &[Device],
    given: Option<Topology>,
    auto: bool,
    basis: Basis<'_>,
    planner: &Planner,
    limit: Limit,
) -> Result<Choice, String> {
    let workers = devices.len() as u32;
    let all_but_one = Topology {
        targets: workers.saturating_sub(1).max(1),
        drafters: 1,
    };
    match (given, auto) {
        (Some(t), false) => return Ok(Choice::fixed(t, "given", "--topology")),
        (None, false) => {
            return Ok(Choice::fixed(
                all_but_one,
                "default",
                "all but one are targets (--topology auto balances the roles)",
            ));
        }
        _ => {}
    }
    if limit.exact && limit.most >= workers {
        return Err(format!(
            "--topology auto on --resume: the run trains {} drafters, which leaves no target among {workers} workers; give more --gpus",
            limit.most
        ));
    }
    let costs = match basis {
        Basis::Synthetic {
            target_us,
            drafter_us,
        } => Some(synthetic_costs(planner, target_us, drafter_us)),
        Basis::Dflash { .. } if devices.iter().any(|d| matches!(d, Device::Cpu(_))) => None,
        Basis::Dflash { target, settings } => Some(dflash_costs(target, settings, planner)),
    };
    let chosen = match (&costs, limit.exact) {
        (_, true) => Topology {
            targets: workers - limit.most,
            drafters: limit.most,
        },
        (Some(c), false) => balance(workers, c, limit.most),
        (None, false) => all_but_one,
    };
    let mut reason = match &costs {
        None => "CPU workers share this machine's cores, so there is no per-device rate to balance: all but one are targets".to_string(),
        Some(c) if c.target_s <= 0.0 && c.drafter_s <= 0.0 => {
            "no cost on either side: all but one are targets".to_string()
        }
        Some(c) => {
            let (r, r1) = (rate(chosen.targets, chosen.drafters, c), rate(all_but_one.targets, 1, c));
            format!(
                "a micro-batch costs a target {:.3} s and a drafter {:.3} s; {}:{} moves {:.2} micro-batches a second, all but one as targets {:.2} ({:.2}x)",
                c.target_s, c.drafter_s, chosen.targets, chosen.drafters, r, r1, r / r1
            )
        }
    };
    if let Some(why) = limit.why {
        reason.push_str(&format!("; {why}"));
    }
    let finite = |x: f64| x.is_finite().then_some(x);
    Ok(Choice {
        targets: chosen.targets,
        drafters: chosen.drafters,
        how: "auto".into(),
        reason,
        rate: costs
            .as_ref()
            .and_then(|c| finite(rate(chosen.targets, chosen.drafters, c))),
        rate_all_but_one: costs
            .as_ref()
            .and_then(|c| finite(rate(all_but_one.targets, 1, c))),
        costs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::PlanConfig;
    use crate::runtime::memory::tests::{qwen3_8b, settings};

    fn costs(target_s: f64, drafter_s: f64) -> Costs {
        Costs {
            target_s,
            drafter_s,
            basis: String::new(),
        }
    }

    fn t(targets: u32, drafters: u32) -> Topology {
        Topology { targets, drafters }
    }

    /// The seeds' data: sequences of `len` tokens filling batches of 49,152.
    fn seeds_planner(len: u32, accum: u32) -> Planner {
        let config = PlanConfig {
            token_budget: 49_152,
            max_len: 8_192,
            accum,
            ..PlanConfig::default()
        };
        Planner::new(vec![len; 49_152 / len as usize * 16], config).unwrap()
    }

    fn torch(mut s: DflashSettings) -> DflashSettings {
        s.engines.drafter = Engine::Torch;
        s.engines.target = Engine::Torch;
        s
    }

    #[test]
    fn the_balance_maximises_the_slower_side_and_prefers_fewer_drafters() {
        // (workers, target s, drafter s, most drafters) -> T:D
        let cases = [
            ((8, 1.22, 3.6, 8), t(2, 6)),
            ((8, 1.34, 1.06, 8), t(4, 4)),
            ((8, 3.0, 1.0, 8), t(6, 2)),
            ((8, 7.0, 1.0, 8), t(7, 1)),
            ((8, 1.0, 0.0, 8), t(7, 1)),
            ((8, 0.0, 0.0, 8), t(7, 1)),
            ((8, 0.0, 1.0, 8), t(1, 7)),
            ((8, 1.22, 3.6, 2), t(6, 2)),
            ((8, 1.22, 3.6, 1), t(7, 1)),
            // Equal rates: the fewer drafters.
            ((3, 1.0, 1.0, 3), t(2, 1)),
            ((4, 1.0, 1.0, 4), t(2, 2)),
            ((2, 5.0, 1.0, 8), t(1, 1)),
        ];
        for ((workers, ct, cd, most), want) in cases {
            let got = balance(workers, &costs(ct, cd), most);
            assert_eq!(
                got, want,
                "{workers} workers, {ct} s / {cd} s, at most {most}"
            );
            assert_eq!(got.targets + got.drafters, workers);
            // No other split within the limit is faster.
            let best = rate(got.targets, got.drafters, &costs(ct, cd));
            for d in 1..workers.min(most.max(1)) + 1 {
                if d < workers {
                    assert!(rate(workers - d, d, &costs(ct, cd)) <= best * (1.0 + 1e-9));
                }
            }
        }
    }

    #[test]
    fn the_flop_model_at_the_seeds_shape_matches_the_accounting() {
        let target = qwen3_8b();
        let s = torch(settings(49_152));
        // One 2,048-token micro-batch: 24 sequences, 512 anchors each.
        let lens = vec![2_048u32; 24];
        let (tf, df) = (
            target_flops(&target, &s, &lens),
            drafter_flops(&target, &s, &lens),
        );
        // `scripts/bench-step-account`: 1.15 s a packed target micro-batch, 3.29 s a drafter one.
        let (ts, ds) = (
            tf / (PEAK_FLOPS * TARGET_EFFICIENCY),
            df / (PEAK_FLOPS * DRAFTER_EFFICIENCY),
        );
        assert!((ts / 1.15 - 1.0).abs() < 0.1, "target {ts} s");
        assert!((ds / 3.29 - 1.0).abs() < 0.1, "drafter {ds} s");
        // At 8,192 tokens the drafter's work is per sequence: a quarter as many blocks.
        let long = vec![8_192u32; 6];
        let d8 = drafter_flops(&target, &s, &long);
        assert!(d8 < df / 3.0, "{d8} vs {df}");
    }

    #[test]
    fn auto_balances_the_seeds_within_accum_and_the_engine() {
        let target = qwen3_8b();
        let gpus: Vec<Device> = (0..8).map(Device::Gpu).collect();
        let s = torch(settings(49_152));
        let planner = seeds_planner(2_048, 8);
        let basis = || Basis::Dflash {
            target: &target,
            settings: &s,
        };
        let auto = |limit: Limit, s: &DflashSettings| {
            choose(
                &gpus,
                None,
                true,
                Basis::Dflash {
                    target: &target,
                    settings: s,
                },
                &planner,
                limit,
            )
            .unwrap()
        };
        let c = auto(drafter_limit(8, Some(&s), 8, 1, None), &s);
        assert_eq!(c.topology(), t(2, 6), "{}", c.describe());
        assert!(c.rate.unwrap() > 5.0 * c.rate_all_but_one.unwrap());
        // --accum 4 allows four drafters, and says so.
        let c = auto(drafter_limit(8, Some(&s), 4, 1, None), &s);
        assert_eq!(c.topology(), t(4, 4));
        assert!(
            c.reason.contains("--accum 4 allows 4 drafters"),
            "{}",
            c.reason
        );
        // Two nodes at --accum 8: four a node.
        let c = auto(drafter_limit(8, Some(&s), 8, 2, None), &s);
        assert_eq!(c.topology(), t(4, 4));
        // The candle drafter trains alone.
        let candle = settings(49_152);
        let c = auto(drafter_limit(8, Some(&candle), 8, 1, None), &candle);
        assert_eq!(c.topology(), t(7, 1));
        assert!(
            c.reason.contains("candle drafter trains alone"),
            "{}",
            c.reason
        );
        // A resume keeps the run's drafters on other GPUs.
        let six: Vec<Device> = (0..6).map(Device::Gpu).collect();
        let c = choose(
            &six,
            None,
            true,
            basis(),
            &planner,
            drafter_limit(6, Some(&s), 8, 1, Some(3)),
        )
        .unwrap();
        assert_eq!(c.topology(), t(3, 3));
        let e = choose(
            &six[..3],
            None,
            true,
            basis(),
            &planner,
            drafter_limit(3, Some(&s), 8, 1, Some(3)),
        )
        .unwrap_err();
        assert!(e.contains("leaves no target"), "{e}");
        // CPU workers keep all but one as targets.
        let cpus: Vec<Device> = (0..4).map(Device::Cpu).collect();
        let c = choose(
            &cpus,
            None,
            true,
            basis(),
            &planner,
            drafter_limit(4, Some(&s), 8, 1, None),
        )
        .unwrap();
        assert_eq!(c.topology(), t(3, 1));
        assert!(c.costs.is_none());
        // Given, and the default, are taken as they are.
        let c = choose(
            &gpus,
            Some(t(5, 3)),
            false,
            basis(),
            &planner,
            drafter_limit(8, Some(&s), 8, 1, None),
        )
        .unwrap();
        assert_eq!((c.topology(), c.how.as_str()), (t(5, 3), "given"));
        // Long sequences: the target is the slower side.
        let long = seeds_planner(8_192, 8);
        let c = choose(
            &gpus,
            None,
            true,
            basis(),
            &long,
            drafter_limit(8, Some(&s), 8, 1, None),
        )
        .unwrap();
        assert_eq!(c.topology(), t(5, 3), "{}", c.describe());
    }

    #[test]
    fn synthetic_costs_follow_the_plans_tokens() {
        let planner = seeds_planner(2_048, 1);
        let c = synthetic_costs(&planner, 10.0, 30.0);
        // Full batches of 49,152 tokens.
        assert!((c.target_s - 0.49152).abs() < 1e-9, "{c:?}");
        assert!((c.drafter_s - 1.47456).abs() < 1e-9, "{c:?}");
        assert_eq!(balance(8, &c, 8), t(2, 6));
    }
}
