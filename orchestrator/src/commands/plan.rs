//! `dflash-orch plan`: plan one epoch and show it (summary, JSON, per-batch dump, SVG report).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{ArgGroup, Args};
use serde::Serialize;

use crate::charts;
use crate::error::CliError;
use crate::fsutil::write_atomically;
use crate::planner::{
    BucketSpec, EpochPlan, Interleave, Mode, OverlongPolicy, PlanConfig, PlanStats, Planner,
};
use crate::workload::{parse_lengths, synthetic_lengths};

/// Largest synthetic workload (400 MB of lengths).
const MAX_SYNTHETIC: usize = 100_000_000;

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("input").required(true).args(["lengths", "synthetic", "data"])))]
pub struct PlanArgs {
    /// A dataset store made by `dflash-orch prepare`.
    #[arg(long, value_name = "STORE")]
    pub data: Option<PathBuf>,

    /// With --data: verify the store's checksums before planning (reads the whole store).
    #[arg(long, requires = "data")]
    pub verify: bool,

    /// Sample lengths, one non-negative integer per line.
    #[arg(long, value_name = "FILE")]
    pub lengths: Option<PathBuf>,

    /// Plan a synthetic workload of N samples shaped like the original 902K-sample dataset
    /// (log-normal, median 1500, sigma 0.944, clipped to [16, 8192]).
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_SYNTHETIC as u64))]
    pub synthetic: Option<usize>,

    /// Seed of the synthetic workload.
    #[arg(long, value_name = "S", default_value_t = 0, requires = "synthetic")]
    pub synthetic_seed: u64,

    #[command(flatten)]
    pub planner: PlannerFlags,

    /// Epoch to plan (composition is re-drawn every epoch).
    #[arg(long, default_value_t = 0)]
    pub epoch: u64,

    /// Print one JSON object on stdout instead of the summary.
    #[arg(long)]
    pub json: bool,

    /// Write the plan, one JSON line per batch in plan order.
    #[arg(long, value_name = "FILE")]
    pub dump: Option<PathBuf>,

    /// Draw the plan as an SVG chart (bucket of each step, shares, padding per bucket).
    #[arg(long, value_name = "FILE.svg")]
    pub report: Option<PathBuf>,
}

/// The planner's options, shared by `plan` and `launch`.
#[derive(Debug, Clone, Args)]
pub struct PlannerFlags {
    /// Tokens per batch: samples × longest sample for padded modes, real tokens for `packed`.
    #[arg(long, value_name = "TOKENS", default_value_t = 49_152,
          value_parser = clap::value_parser!(u64).range(1..=dflash_common::ring::MAX_TOKEN_BUDGET))]
    pub token_budget: u64,

    /// Longest sample; longer ones are handled by --on-overlong.
    #[arg(long, value_name = "TOKENS", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_len: u32,

    /// What to do with samples longer than --max-len: truncate | drop.
    #[arg(long, value_name = "POLICY", default_value = "truncate")]
    pub on_overlong: OverlongPolicy,

    /// sorted (original, frozen composition) | shuffle | bucketed | packed (varlen, no padding).
    #[arg(long, default_value = "bucketed")]
    pub mode: Mode,

    /// Bucket boundaries for --mode bucketed: a list `0,770,...,8192` (first 0, last >= --max-len)
    /// or `auto:K` to choose K buckets that minimise padding. [default: auto:8]
    #[arg(long, value_name = "SPEC")]
    pub buckets: Option<BucketSpec>,

    /// Batch order for --mode bucketed: random | diverse (the original's) | spread | stratified.
    /// [default: spread]
    #[arg(long, value_name = "POLICY")]
    pub interleave: Option<Interleave>,

    /// Gradient accumulation steps: micro-batches per optimizer step in total, whatever the
    /// number of drafters (with D data-parallel drafters, each trains every D-th micro-batch of
    /// a group; --accum must be at least D).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub accum: u32,

    /// Seed of the plan: with the epoch, it fixes every batch.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Turns raw arguments into a checked planner configuration; fails before any input is read.
pub fn config_from_args(args: &PlannerFlags) -> Result<PlanConfig, CliError> {
    if args.mode != Mode::Bucketed {
        if args.buckets.is_some() {
            return Err(CliError::Invalid(format!(
                "--buckets applies only to --mode bucketed (got --mode {})",
                args.mode
            )));
        }
        if args.interleave.is_some() {
            return Err(CliError::Invalid(format!(
                "--interleave applies only to --mode bucketed (got --mode {})",
                args.mode
            )));
        }
    }
    let config = PlanConfig {
        mode: args.mode,
        interleave: args.interleave.unwrap_or(Interleave::Spread),
        buckets: args.buckets.clone().unwrap_or(BucketSpec::Auto(8)),
        token_budget: args.token_budget,
        max_len: args.max_len,
        on_overlong: args.on_overlong,
        accum: args.accum,
        seed: args.seed,
    };
    config.validate()?;
    Ok(config)
}

fn load_lengths(args: &PlanArgs) -> Result<(Vec<u32>, String), CliError> {
    if let Some(n) = args.synthetic {
        if n == 0 {
            return Err(CliError::Invalid(
                "--synthetic 0: no samples to plan".into(),
            ));
        }
        if n > MAX_SYNTHETIC {
            return Err(CliError::Invalid(format!(
                "--synthetic {n}: at most {MAX_SYNTHETIC} samples"
            )));
        }
        return Ok((
            synthetic_lengths(n, args.synthetic_seed),
            format!("synthetic:{n} (seed {})", args.synthetic_seed),
        ));
    }
    if let Some(dir) = &args.data {
        let store = crate::store::Store::open(dir).map_err(store_error)?;
        if args.verify {
            store.verify().map_err(store_error)?;
        }
        return Ok((store.lengths(), dir.display().to_string()));
    }
    let path = args.lengths.as_ref().expect("clap requires one input");
    let bytes = std::fs::read(path)
        .map_err(|e| CliError::io(format!("failed to read {}", path.display()), e))?;
    let lengths =
        parse_lengths(&bytes).map_err(|e| CliError::Invalid(format!("{}: {e}", path.display())))?;
    if lengths.is_empty() {
        return Err(CliError::Invalid(format!(
            "{}: no samples to plan: the file has no lengths",
            path.display()
        )));
    }
    Ok((lengths, path.display().to_string()))
}

pub fn run(args: PlanArgs) -> Result<(), CliError> {
    let config = config_from_args(&args.planner)?;
    let (lengths, source) = load_lengths(&args)?;
    tracing::info!(samples = lengths.len(), %source, "planning");

    let started = Instant::now();
    let planner = Planner::new(lengths, config)?;
    let setup = started.elapsed();
    let plan = planner.plan_epoch(args.epoch);
    let total = started.elapsed();
    let mut stats = planner.stats(&plan);
    stats.setup_ms = setup.as_secs_f64() * 1e3;
    stats.epoch_ms = (total - setup).as_secs_f64() * 1e3;
    stats.plan_ms = total.as_secs_f64() * 1e3;

    if let Some(path) = &args.dump {
        write_dump(path, &plan)?;
    }
    if let Some(path) = &args.report {
        let svg = charts::plan_report_svg(&plan, &stats, &source)
            .map_err(|e| CliError::Invalid(e.to_string()))?;
        write_atomically(path, |w| w.write_all(svg.as_bytes()))
            .map_err(|e| CliError::io(format!("failed to write {}", path.display()), e))?;
    }

    crate::commands::print_result(args.json, &stats, || summary(&stats, &source))
}

#[derive(Serialize)]
struct DumpLine<'a> {
    step: usize,
    bucket: u16,
    samples: &'a [u32],
    max_len: u32,
    padded_tokens: u64,
    real_tokens: u64,
}

fn write_dump(path: &Path, plan: &EpochPlan) -> Result<(), CliError> {
    write_atomically(path, |w| {
        for (step, b) in plan.batches.iter().enumerate() {
            let line = DumpLine {
                step,
                bucket: b.bucket,
                samples: plan.batch_samples(b),
                max_len: b.max_len,
                padded_tokens: plan.padded_tokens(b),
                real_tokens: b.real_tokens,
            };
            serde_json::to_writer(&mut *w, &line)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    })
    .map_err(|e| CliError::io(format!("failed to write {}", path.display()), e))
}

/// The human-readable summary printed without --json.
pub fn summary(s: &PlanStats, source: &str) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let _ = writeln!(
        o,
        "plan: mode {}, interleave {}, epoch {}, seed {}",
        s.mode, s.interleave, s.epoch, s.seed
    );
    let _ = writeln!(
        o,
        "input: {} samples from {source}; dropped {} ({} empty, {} overlong), truncated {}",
        s.samples, s.dropped, s.dropped_empty, s.dropped_overlong, s.truncated
    );
    let _ = writeln!(
        o,
        "budget {} tokens per batch, max len {}, accum {}\n",
        s.token_budget, s.max_len, s.accum
    );
    let _ = writeln!(
        o,
        "{:>6} {:>6} {:>6} {:>9} {:>7} {:>8} {:>7} {:>6} {:>10}",
        "bucket", "lo", "hi", "samples", "share", "batches", "share", "size", "efficiency"
    );
    for (i, b) in s.buckets.iter().enumerate() {
        let _ = writeln!(
            o,
            "{:>6} {:>6} {:>6} {:>9} {:>7} {:>8} {:>7} {:>6.1} {:>10}",
            i,
            b.lo,
            b.hi,
            b.samples,
            pct(b.sample_share),
            b.batches,
            pct(b.batch_share),
            b.mean_batch_size,
            pct(b.padding_efficiency)
        );
    }
    let _ = writeln!(
        o,
        "{:>6} {:>6} {:>6} {:>9} {:>7} {:>8} {:>7} {:>6.1} {:>10}\n",
        "all",
        "",
        "",
        s.samples - s.dropped,
        "",
        s.batches,
        "",
        s.mean_batch_size,
        pct(s.padding_efficiency)
    );
    let _ = writeln!(
        o,
        "padding efficiency  {:.4} ({} real / {} padded tokens)",
        s.padding_efficiency, s.real_tokens, s.padded_tokens
    );
    let _ = writeln!(
        o,
        "same-bucket runs    longest {}, windows of {} with 3+ same bucket {}, final run {}",
        s.max_same_bucket_run,
        s.accum,
        pct(s.windows_3plus_same_bucket),
        s.tail_same_bucket_run
    );
    let _ = writeln!(
        o,
        "length drift        adjacent batches r = {:+.3}, position in epoch r = {:+.3}",
        s.adjacent_mean_len_corr, s.position_mean_len_corr
    );
    let _ = writeln!(
        o,
        "planned in          {:.1} ms ({:.1} ms setup, once per run; {:.1} ms this epoch)",
        s.plan_ms, s.setup_ms, s.epoch_ms
    );
    o
}

/// A store that cannot be used: I/O trouble is a failure, anything about its content is invalid
/// input.
pub fn store_error(e: crate::store::StoreError) -> CliError {
    match e {
        crate::store::StoreError::Io { .. } => CliError::Failed(e.to_string()),
        other => CliError::Invalid(other.to_string()),
    }
}
