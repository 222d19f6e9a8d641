//! `dflash-orch inspect`: what a dataset store holds.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use crate::error::CliError;
use crate::store::{SkipExample, SourceMeta, Store};

#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// The store directory.
    #[arg(value_name = "STORE")]
    pub store: PathBuf,

    /// Also verify every file's checksum (reads the whole store).
    #[arg(long)]
    pub verify: bool,

    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Percentiles {
    min: u32,
    p1: u32,
    p5: u32,
    p25: u32,
    p50: u32,
    p75: u32,
    p95: u32,
    p99: u32,
    max: u32,
    mean: f64,
}

#[derive(Debug, Serialize)]
struct Bin {
    /// Lengths in `lo..=hi`.
    lo: u32,
    hi: u32,
    samples: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    store: String,
    version: u32,
    samples: u64,
    tokens: u64,
    loss_tokens: u64,
    vocab_size: Option<u32>,
    max_len: u32,
    on_overlong: String,
    min_loss_tokens: u32,
    lengths: Percentiles,
    histogram: Vec<Bin>,
    truncated: u64,
    skipped: BTreeMap<String, u64>,
    skipped_examples: Vec<SkipExample>,
    sources: Vec<SourceMeta>,
    /// `true` when --verify checked every checksum; `null` without --verify.
    verified: Option<bool>,
}

/// Bins of doubling width: 1, 2-3, 4-7, ... up to the longest sample.
fn histogram(sorted: &[u32]) -> Vec<Bin> {
    let max = *sorted.last().unwrap_or(&1);
    let mut bins = Vec::new();
    let mut lo = 1u32;
    loop {
        let hi = lo.saturating_mul(2) - 1;
        let count = sorted.partition_point(|&l| l <= hi) - sorted.partition_point(|&l| l < lo);
        bins.push(Bin {
            lo,
            hi,
            samples: count as u64,
        });
        if hi >= max {
            break;
        }
        lo = hi + 1;
    }
    // Leading empty bins say nothing.
    let first = bins.iter().position(|b| b.samples > 0).unwrap_or(0);
    bins.split_off(first)
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

pub fn run(args: InspectArgs) -> Result<(), CliError> {
    let open_error = super::plan::store_error;
    let store = Store::open(&args.store).map_err(open_error)?;
    let verified = if args.verify {
        store.verify().map_err(open_error)?;
        Some(true)
    } else {
        None
    };
    let meta = store.meta().clone();
    let mut sorted = store.lengths();
    sorted.sort_unstable();
    let mean = meta.tokens as f64 / meta.samples as f64;
    let report = Report {
        store: args.store.display().to_string(),
        version: meta.version,
        samples: meta.samples,
        tokens: meta.tokens,
        loss_tokens: meta.loss_tokens,
        vocab_size: meta.vocab_size,
        max_len: meta.max_len,
        on_overlong: meta.on_overlong,
        min_loss_tokens: meta.min_loss_tokens,
        lengths: Percentiles {
            min: sorted[0],
            p1: percentile(&sorted, 0.01),
            p5: percentile(&sorted, 0.05),
            p25: percentile(&sorted, 0.25),
            p50: percentile(&sorted, 0.5),
            p75: percentile(&sorted, 0.75),
            p95: percentile(&sorted, 0.95),
            p99: percentile(&sorted, 0.99),
            max: *sorted.last().expect("stores hold samples"),
            mean,
        },
        histogram: histogram(&sorted),
        truncated: meta.truncated,
        skipped: meta.skipped,
        skipped_examples: meta.skipped_examples,
        sources: meta.sources,
        verified,
    };
    crate::commands::print_result(args.json, &report, || text(&report))
}

fn text(r: &Report) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "store {} (format version {})", r.store, r.version);
    let _ = writeln!(
        o,
        "samples {}, tokens {}, loss tokens {} ({:.1}%), vocab size {}",
        r.samples,
        r.tokens,
        r.loss_tokens,
        100.0 * r.loss_tokens as f64 / r.tokens.max(1) as f64,
        r.vocab_size.map_or("unknown".into(), |v| v.to_string())
    );
    let _ = writeln!(
        o,
        "prepared with --max-len {} --on-overlong {} --min-loss-tokens {}",
        r.max_len, r.on_overlong, r.min_loss_tokens
    );
    let l = &r.lengths;
    let _ = writeln!(
        o,
        "lengths: min {} p1 {} p5 {} p25 {} median {} p75 {} p95 {} p99 {} max {}, mean {:.1}",
        l.min, l.p1, l.p5, l.p25, l.p50, l.p75, l.p95, l.p99, l.max, l.mean
    );
    let most = r
        .histogram
        .iter()
        .map(|b| b.samples)
        .max()
        .unwrap_or(1)
        .max(1);
    for b in &r.histogram {
        let bar = "#".repeat(((b.samples * 50).div_ceil(most)) as usize);
        let _ = writeln!(o, "  {:>7}..{:<7} {:>10}  {bar}", b.lo, b.hi, b.samples);
    }
    let total: u64 = r.skipped.values().sum();
    let _ = writeln!(o, "truncated {}, left out {total}", r.truncated);
    for (reason, n) in &r.skipped {
        let _ = writeln!(o, "  {reason}: {n}");
    }
    for e in &r.skipped_examples {
        let _ = writeln!(o, "    e.g. {}: {}", e.location, e.message);
    }
    let _ = writeln!(o, "sources:");
    for s in &r.sources {
        let _ = writeln!(
            o,
            "  {} ({}, {} bytes, crc32c {:08x}): {} samples, {} left out",
            s.path, s.format, s.bytes, s.crc32c, s.samples, s.skipped
        );
    }
    match r.verified {
        Some(true) => {
            let _ = writeln!(o, "checksums verified");
        }
        _ => {
            let _ = writeln!(o, "checksums not verified (pass --verify)");
        }
    }
    o
}
