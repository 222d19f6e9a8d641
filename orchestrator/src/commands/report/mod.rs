//! `dflash-orch report`: one self-contained HTML page about a run.
//!
//! Reads `RUN_DIR/metrics.jsonl` (format in docs/metrics.md) and `RUN_DIR/journal.jsonl`, and
//! writes an HTML page whose charts are inline SVG: no script, no stylesheet, font or image from
//! elsewhere. Charts: loss and accuracy over optimiser steps, throughput over time, batches per
//! bucket, GPU power and utilization per GPU (or, without GPU telemetry, worker CPU and memory),
//! with worker exits marked on every time axis and listed in a table.

mod sections;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;
use plotters::prelude::*;
use serde_json::Value;

use crate::charts::{Marker, Markers, Series, TimeAxis};
use crate::error::CliError;
use crate::format;
use crate::fsutil::write_atomically;
use crate::observe::history::{
    Incident, Journal, NORMAL_EXIT, Run, TrainPoint, read_journal, read_metrics,
};
use crate::runtime::metrics;
use sections::{
    bucket_section, exits_section, telemetry_section, throughput_section, train_section,
    warnings_section,
};

#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,

    /// The HTML file to write.
    #[arg(long, value_name = "FILE", default_value = "report.html")]
    pub output: PathBuf,

    /// The page's title (default: "Run report: " and the run directory's name).
    #[arg(long, value_name = "TEXT")]
    pub title: Option<String>,
}

pub fn run(args: ReportArgs) -> Result<(), CliError> {
    if !args.run_dir.is_dir() {
        return Err(CliError::Invalid(format!(
            "--run-dir {}: no such directory",
            args.run_dir.display()
        )));
    }
    let metrics_path = args.run_dir.join(metrics::FILE);
    let run = read_metrics(&metrics_path)?;
    let journal = read_journal(&dflash_common::run_dir::journal(&args.run_dir))?;
    let title = args.title.clone().unwrap_or_else(|| {
        let dir = args
            .run_dir
            .canonicalize()
            .unwrap_or_else(|_| args.run_dir.clone());
        let name = dir
            .file_name()
            .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into());
        format!("Run report: {name}")
    });
    let html = render(&args.run_dir, &title, &run, &journal)?;
    write_atomically(&args.output, |w| w.write_all(html.as_bytes()))
        .map_err(|e| CliError::io(format!("failed to write {}", args.output.display()), e))?;
    eprintln!("report written to {}", args.output.display());
    Ok(())
}
// ---------------------------------------------------------------------------------------------
// The page

/// Worker exits labelled on the charts at most; beyond that only the lines (the table has all).
const MAX_MARKER_LABELS: usize = 24;
pub(super) const FULL: (u32, u32) = (1200, 380);
pub(super) const HALF: (u32, u32) = (595, 360);

const STYLE: &str = "\
body{font-family:sans-serif;color:#222;max-width:1220px;margin:24px auto;padding:0 12px}\
h1{font-size:24px;margin:0 0 12px}h2{font-size:18px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}\
table{border-collapse:collapse;font-size:14px}td,th{padding:3px 12px 3px 0;text-align:left;vertical-align:top}\
table.facts th{color:#555;font-weight:normal}table.exits th{border-bottom:1px solid #ccc}\
table.exits td.msg{font-family:monospace;font-size:13px;word-break:break-all}\
.row{display:flex;flex-wrap:wrap;gap:10px}svg{max-width:100%;height:auto;display:block}\
.note{color:#666;font-style:italic;margin:6px 0}.summary{font-size:15px;margin:10px 0}\
.legend{font-size:13px;margin:4px 0 0 70px}.legend span.item{margin-right:16px;white-space:nowrap}\
.sw{display:inline-block;width:18px;height:4px;vertical-align:middle;margin-right:5px}";

fn render(run_dir: &Path, title: &str, run: &Run, journal: &Journal) -> Result<String, CliError> {
    let mut h = String::with_capacity(1 << 20);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{}</h1>\n",
        esc(title),
        esc(title)
    );
    header(&mut h, run_dir, run, journal);

    let (exits, normal) = exits(run, journal);
    let axis = TimeAxis::for_duration(run.duration());
    let markers: Vec<Marker> = exits
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            e.time.map(|t| Marker {
                x: axis.x(t - run.first),
                label: format!("#{} w{}", i + 1, e.worker.text),
            })
        })
        .collect();
    let markers = Markers {
        labelled: markers.len() <= MAX_MARKER_LABELS,
        list: markers,
    };

    h.push_str("<h2>Loss and accuracy</h2>\n");
    train_section(&mut h, run)?;

    h.push_str("<h2>Throughput</h2>\n");
    throughput_section(&mut h, run, &axis, &markers)?;

    h.push_str("<h2>Batches per bucket</h2>\n");
    bucket_section(&mut h, run)?;

    if run.gpu.is_empty() && !run.process.is_empty() {
        h.push_str("<h2>Workers: CPU and memory</h2>\n");
    } else {
        h.push_str("<h2>GPU power and utilization</h2>\n");
    }
    telemetry_section(&mut h, run, &axis, &markers)?;

    h.push_str("<h2>Restarts</h2>\n");
    exits_section(&mut h, run, &exits, normal, &markers);
    warnings_section(&mut h, run);

    h.push_str("</body>\n</html>\n");
    Ok(h)
}

/// Worker exits worth showing, with their times from metrics.jsonl (the journal's, which have no
/// times, when metrics has none), and how many workers exited normally without a restart (the
/// run stopping: not shown). Roles missing from an event come from the journal's
/// `worker_start`.
fn exits(run: &Run, journal: &Journal) -> (Vec<Incident>, usize) {
    let mut list = if run.exits.is_empty() {
        journal.exits.clone()
    } else {
        let mut list = run.exits.clone();
        for e in &mut list {
            let t = e.time.unwrap_or(f64::INFINITY);
            e.restarted = if run.starts.is_empty() {
                e.message != NORMAL_EXIT
            } else {
                run.starts.iter().any(|(s, w)| *s >= t && *w == e.worker)
            };
        }
        list
    };
    list.sort_by(|a, b| a.time.unwrap_or(0.0).total_cmp(&b.time.unwrap_or(0.0)));
    for e in &mut list {
        if e.role.is_none() {
            e.role = journal.roles.get(&e.worker).cloned();
        }
    }
    let total = list.len();
    list.retain(|e| e.restarted || e.message != NORMAL_EXIT);
    let normal = total - list.len();
    (list, normal)
}

fn header(h: &mut String, run_dir: &Path, run: &Run, journal: &Journal) {
    let dir = run_dir
        .canonicalize()
        .unwrap_or_else(|_| run_dir.to_path_buf());
    let mut facts: Vec<(&str, String)> = vec![("Run directory", dir.display().to_string())];
    let config = journal.history.as_ref().and_then(|h| h.config.as_ref());
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    if let Some(c) = config {
        facts.push(("Stage", text(&c["stage"])));
        let data = match (&c["data"], &c["synthetic"]) {
            (Value::String(store), _) => format!("store {store}"),
            (_, Value::Number(n)) => format!("synthetic, {n} samples"),
            _ => "-".into(),
        };
        facts.push(("Data", data));
        let mut roles: BTreeMap<&str, usize> = BTreeMap::new();
        for role in journal.roles.values() {
            *roles.entry(role.as_str()).or_default() += 1;
        }
        let started: Vec<String> = roles
            .iter()
            .map(|(role, n)| format!("{n} {role}{}", if *n == 1 { "" } else { "s" }))
            .collect();
        let topology = match &c["topology"] {
            Value::String(t) => format!(", topology {t}"),
            _ => String::new(),
        };
        let workers = if started.is_empty() {
            String::new()
        } else {
            format!(" ({})", started.join(", "))
        };
        facts.push((
            "Workers",
            format!("--gpus {}{topology}{workers}", text(&c["gpus"])),
        ));
        let planner = &c["planner"];
        if planner.is_object() {
            facts.push((
                "Planner",
                format!(
                    "{} / {}, buckets {}, token budget {}, accum {}",
                    text(&planner["mode"]),
                    text(&planner["interleave"]),
                    text(&planner["buckets"]),
                    text(&planner["token_budget"]),
                    text(&planner["accum"])
                ),
            ));
        }
    }
    if let Some(history) = &journal.history {
        let epochs = config.map_or_else(|| "-".into(), |c| text(&c["epochs"]));
        facts.push((
            "Epochs",
            format!("{epochs} (begun: {})", history.epoch_batches.len()),
        ));
        let planned: u64 = history.epoch_batches.iter().sum();
        facts.push((
            "Committed steps",
            format!(
                "{} of {planned} planned in the epochs begun",
                history.total_committed()
            ),
        ));
        facts.push((
            "Status",
            history
                .ended
                .clone()
                .unwrap_or_else(|| "no end line (running, or the orchestrator died)".into()),
        ));
    } else {
        facts.push(("Journal", "no journal.jsonl in the run directory".into()));
    }
    if let Some((&last, _)) = run.train.last_key_value() {
        facts.push(("Optimiser steps", last.to_string()));
    }
    if run.has_times() {
        facts.push(("Started", format::utc(run.first)));
        facts.push(("Duration", format::duration(run.duration())));
    }
    let all = run.batches.values().chain(&run.unstepped);
    let (real, padded) = all.fold((0.0, 0.0), |(r, p), b| (r + b.real, p + b.padded));
    if real > 0.0 {
        let efficiency = if padded > 0.0 {
            format!(" (padding efficiency {:.1}%)", 100.0 * real / padded)
        } else {
            String::new()
        };
        facts.push((
            "Total tokens",
            format!("{} real{efficiency}", format::grouped(real)),
        ));
    } else {
        let trained: f64 = run.train.values().filter_map(|p| p.tokens).sum();
        if trained > 0.0 {
            facts.push((
                "Total tokens",
                format!("{} trained", format::grouped(trained)),
            ));
        }
    }
    let (exits, normal) = exits(run, journal);
    let restarted = exits.iter().filter(|e| e.restarted).count();
    let mut counts = vec![format!("{restarted} restarted")];
    if exits.len() > restarted {
        counts.push(format!("{} not restarted", exits.len() - restarted));
    }
    if normal > 0 {
        counts.push(format!("{normal} normal exits when the run stopped"));
    }
    facts.push(("Worker exits", counts.join(", ")));
    let mut lines = format!("{}", run.lines);
    if run.torn_tail {
        lines.push_str(" (a last line cut short was ignored)");
    }
    if let Some(first) = run.skipped.first() {
        lines.push_str(&format!(
            " ({} malformed line{} skipped; the first: {})",
            run.skipped.len(),
            if run.skipped.len() == 1 { "" } else { "s" },
            first
        ));
    }
    facts.push(("Metrics lines", lines));

    h.push_str("<table class=\"facts\">\n");
    for (k, v) in facts {
        let _ = writeln!(h, "<tr><th>{k}</th><td>{}</td></tr>", esc(&v));
    }
    h.push_str("</table>\n");

    if let Some(line) = train_summary(run) {
        let _ = writeln!(h, "<p class=\"summary\">{}</p>", esc(&line));
    }
    if let (Some((a, ta)), Some((b, tb))) =
        (run.served.first_key_value(), run.served.last_key_value())
    {
        let _ = writeln!(
            h,
            "<p class=\"summary\">{}</p>",
            esc(&format!(
                "Served acceptance τ (speculative decoding of the held-out prompts, tokens per verify step): {ta:.2} at step {a} → {tb:.2} at step {b}."
            ))
        );
    }
}

pub(super) type TrainField = fn(&TrainPoint) -> Option<f64>;

/// First tenth of the optimiser steps against the last tenth.
fn train_summary(run: &Run) -> Option<String> {
    let points: Vec<(u64, TrainPoint)> = run.train.iter().map(|(&s, &p)| (s, p)).collect();
    if points.is_empty() {
        return None;
    }
    let k = (points.len() / 10).max(1);
    let (first, last) = (&points[..k], &points[points.len() - k..]);
    let mean = |part: &[(u64, TrainPoint)], f: TrainField| {
        let v: Vec<f64> = part.iter().filter_map(|(_, p)| f(p)).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let span = |part: &[(u64, TrainPoint)]| {
        let (a, b) = (part[0].0, part[part.len() - 1].0);
        if a == b {
            format!("step {a}")
        } else {
            format!("steps {a}-{b}")
        }
    };
    let mut parts = Vec::new();
    let fields: [(&str, TrainField, usize); 3] = [
        ("loss", |p| p.loss, 3),
        ("accuracy", |p| p.accuracy, 3),
        ("acceptance length", |p| p.acceptance, 2),
    ];
    for (name, f, digits) in fields {
        if let (Some(a), Some(b)) = (mean(first, f), mean(last, f)) {
            parts.push(format!("{name} {a:.digits$} → {b:.digits$}"));
        }
    }
    if parts.is_empty() {
        return None;
    }
    Some(format!(
        "Mean over the first tenth ({}) → the last tenth ({}): {}.",
        span(first),
        span(last),
        parts.join(", ")
    ))
}

pub(super) fn legend(h: &mut String, series: &[Series]) {
    h.push_str("<div class=\"legend\">");
    for s in series {
        let RGBColor(r, g, b) = s.color;
        let opacity = if s.faint { 0.35 } else { 1.0 };
        let _ = write!(
            h,
            "<span class=\"item\"><span class=\"sw\" style=\"background:rgb({r},{g},{b});opacity:{opacity}\"></span>{}</span>",
            esc(&s.name)
        );
    }
    h.push_str("</div>\n");
}

// ---------------------------------------------------------------------------------------------
// Text

pub(super) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::esc;

    #[test]
    fn text_is_escaped_for_html() {
        assert_eq!(esc("<a&\"b\">"), "&lt;a&amp;&quot;b&quot;&gt;");
        assert_eq!(esc("it's"), "it&#39;s");
    }
}
