//! `dflash-orch report`: one self-contained HTML page about a run.
//!
//! Reads `RUN_DIR/metrics.jsonl` (format in docs/metrics.md) and `RUN_DIR/journal.jsonl`, and
//! writes an HTML page whose charts are inline SVG: no script, no stylesheet, font or image from
//! elsewhere. Charts: loss and accuracy over optimiser steps, throughput over time, batches per
//! bucket, GPU power and utilization per GPU (or, without GPU telemetry, worker CPU and memory),
//! with worker exits marked on every time axis and listed in a table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};

use clap::Args;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use serde_json::Value;

use crate::charts::bucket_color;
use crate::cli::CliError;
use crate::fsutil::write_atomically;
use crate::runtime::{journal, metrics};

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
// Reading metrics.jsonl

/// The fields of a metrics line the report uses; the others are skipped.
#[derive(Debug, Default, Deserialize)]
struct Line {
    kind: Option<String>,
    time: Option<f64>,
    step: Option<u64>,
    loss: Option<f64>,
    accuracy: Option<f64>,
    acceptance_length: Option<f64>,
    tau: Option<f64>,
    tokens: Option<f64>,
    bucket: Option<Value>,
    real_tokens: Option<f64>,
    padded_tokens: Option<f64>,
    tokens_per_s: Option<f64>,
    padded_tokens_per_s: Option<f64>,
    gpu: Option<Value>,
    worker: Option<Value>,
    role: Option<String>,
    power_w: Option<f64>,
    utilization_pct: Option<f64>,
    cpu_pct: Option<f64>,
    rss_bytes: Option<f64>,
    event: Option<String>,
    message: Option<String>,
}

/// A label that sorts numbers numerically and before text (GPU 2 before GPU 10).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    num: u64,
    text: String,
}

impl Key {
    fn of(v: Option<&Value>) -> Key {
        match v {
            Some(Value::Number(n)) => Key {
                num: n.as_u64().unwrap_or(u64::MAX),
                text: n.to_string(),
            },
            Some(Value::String(s)) => Key {
                num: s.parse().unwrap_or(u64::MAX),
                text: s.clone(),
            },
            None | Some(Value::Null) => Key {
                num: u64::MAX,
                text: "?".into(),
            },
            Some(other) => Key {
                num: u64::MAX,
                text: other.to_string(),
            },
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct TrainPoint {
    loss: Option<f64>,
    accuracy: Option<f64>,
    acceptance: Option<f64>,
    tokens: Option<f64>,
}

#[derive(Debug, Clone)]
struct BatchFacts {
    bucket: Key,
    real: f64,
    padded: f64,
}

/// (Unix time, first value, second value): a batch line's tokens/s and padded tokens/s, a GPU's
/// power and utilization, a worker's CPU and RSS.
type Reading = (f64, Option<f64>, Option<f64>);

/// One GPU's or worker's readings.
#[derive(Debug, Default)]
struct Telemetry {
    role: Option<String>,
    points: Vec<Reading>,
}

/// How a worker's exit is reported when the worker ended normally.
const NORMAL_EXIT: &str = "exited normally";

/// A worker exit or a warning.
#[derive(Debug, Clone)]
struct Incident {
    /// Unix seconds; `None` for exits known only from the journal (which has no times).
    time: Option<f64>,
    worker: Key,
    role: Option<String>,
    message: String,
    /// An exit after which the worker was started again.
    restarted: bool,
}

/// What metrics.jsonl says.
#[derive(Debug)]
struct Run {
    /// Train lines by optimiser step, the last line of a step kept.
    train: BTreeMap<u64, TrainPoint>,
    /// Served acceptance (`eval` lines): τ by the step of the checkpoint evaluated.
    served: BTreeMap<u64, f64>,
    /// Every batch line: (time, tokens/s, padded tokens/s).
    throughput: Vec<Reading>,
    /// Batch lines by plan step, the last line of a step kept (a replay writes its steps again).
    batches: BTreeMap<u64, BatchFacts>,
    /// Batch lines without a step.
    unstepped: Vec<BatchFacts>,
    batch_lines: usize,
    gpu: BTreeMap<Key, Telemetry>,
    process: BTreeMap<Key, Telemetry>,
    exits: Vec<Incident>,
    /// `worker_start` events: (time, worker).
    starts: Vec<(f64, Key)>,
    warnings: Vec<Incident>,
    events: BTreeMap<String, usize>,
    first: f64,
    last: f64,
    lines: usize,
    torn_tail: bool,
}

impl Run {
    fn new() -> Run {
        Run {
            train: BTreeMap::new(),
            served: BTreeMap::new(),
            throughput: Vec::new(),
            batches: BTreeMap::new(),
            unstepped: Vec::new(),
            batch_lines: 0,
            gpu: BTreeMap::new(),
            process: BTreeMap::new(),
            exits: Vec::new(),
            starts: Vec::new(),
            warnings: Vec::new(),
            events: BTreeMap::new(),
            first: f64::INFINITY,
            last: f64::NEG_INFINITY,
            lines: 0,
            torn_tail: false,
        }
    }

    fn has_times(&self) -> bool {
        self.first <= self.last
    }

    fn duration(&self) -> f64 {
        if self.has_times() {
            self.last - self.first
        } else {
            0.0
        }
    }

    /// Adds one parsed line; `Err` says what is wrong with it.
    fn add(&mut self, line: Line) -> Result<(), String> {
        // Lines written before `kind` existed are train lines.
        let kind = match line.kind.as_deref() {
            Some(k) => k,
            None if line.loss.is_some() && line.step.is_some() => "train",
            None => return Err("no `kind`".into()),
        };
        if let Some(t) = line.time {
            if !t.is_finite() || t < 0.0 {
                return Err(format!("`time` {t} is not a Unix time"));
            }
            self.first = self.first.min(t);
            self.last = self.last.max(t);
        }
        let time = || {
            line.time
                .ok_or_else(|| format!("a `{kind}` line without `time`"))
        };
        self.lines += 1;
        match kind {
            "train" => {
                let step = line.step.ok_or("a `train` line without `step`")?;
                self.train.insert(
                    step,
                    TrainPoint {
                        loss: line.loss.filter(|v| v.is_finite()),
                        accuracy: line.accuracy.filter(|v| v.is_finite()),
                        acceptance: line.acceptance_length.filter(|v| v.is_finite()),
                        tokens: line.tokens,
                    },
                );
            }
            "eval" => {
                let step = line.step.ok_or("an `eval` line without `step`")?;
                if let Some(tau) = line.tau.filter(|v| v.is_finite()) {
                    self.served.insert(step, tau);
                }
            }
            "batch" => {
                let t = time()?;
                self.batch_lines += 1;
                self.throughput
                    .push((t, line.tokens_per_s, line.padded_tokens_per_s));
                let facts = BatchFacts {
                    bucket: Key::of(line.bucket.as_ref()),
                    real: line.real_tokens.unwrap_or(0.0),
                    padded: line.padded_tokens.unwrap_or(0.0),
                };
                match line.step {
                    Some(step) => {
                        self.batches.insert(step, facts);
                    }
                    None => self.unstepped.push(facts),
                }
            }
            "gpu" => {
                let t = time()?;
                let series = self.gpu.entry(Key::of(line.gpu.as_ref())).or_default();
                if line.role.is_some() {
                    series.role = line.role;
                }
                series.points.push((t, line.power_w, line.utilization_pct));
            }
            "process" => {
                let t = time()?;
                let series = self
                    .process
                    .entry(Key::of(line.worker.as_ref()))
                    .or_default();
                if line.role.is_some() {
                    series.role = line.role;
                }
                series.points.push((t, line.cpu_pct, line.rss_bytes));
            }
            "event" => {
                let t = time()?;
                let event = line.event.ok_or("an `event` line without `event`")?;
                let incident = Incident {
                    time: Some(t),
                    worker: Key::of(line.worker.as_ref()),
                    role: line.role,
                    message: line.message.unwrap_or_default(),
                    restarted: false,
                };
                match event.as_str() {
                    "worker_exit" => self.exits.push(incident),
                    "worker_start" => self.starts.push((t, incident.worker)),
                    "warning" if self.warnings.len() < MAX_WARNINGS => {
                        self.warnings.push(incident);
                    }
                    _ => {}
                }
                *self.events.entry(event).or_default() += 1;
            }
            // Kinds added later are skipped.
            _ => self.lines -= 1,
        }
        Ok(())
    }
}

/// Reads metrics.jsonl line by line. A malformed line is an error naming the file and the line;
/// a last line cut short (no newline: the run is live or crashed mid-write) is ignored.
fn read_metrics(path: &Path) -> Result<Run, CliError> {
    let file = File::open(path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            CliError::Invalid(format!(
                "{}: no such file (the run has written no metrics)",
                path.display()
            ))
        } else {
            CliError::io(format!("failed to read {}", path.display()), e)
        }
    })?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut run = Run::new();
    let mut buf = Vec::new();
    let mut number = 0usize;
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| CliError::io(format!("failed to read {}", path.display()), e))?;
        if n == 0 {
            break;
        }
        number += 1;
        let complete = buf.last() == Some(&b'\n');
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let bad = |why: String| {
            CliError::Invalid(format!(
                "{}:{number}: malformed metrics line: {why}",
                path.display()
            ))
        };
        let line: Line = match serde_json::from_slice(&buf) {
            Ok(line) => line,
            Err(_) if !complete => {
                run.torn_tail = true;
                break;
            }
            Err(e) => return Err(bad(e.to_string())),
        };
        run.add(line).map_err(bad)?;
    }
    Ok(run)
}

// ---------------------------------------------------------------------------------------------
// Reading journal.jsonl

#[derive(Debug, Default)]
struct Journal {
    /// `None` when the run directory has no journal.
    history: Option<journal::History>,
    /// Role of each worker, from `worker_start`.
    roles: BTreeMap<Key, String>,
    exits: Vec<Incident>,
}

fn read_journal(path: &Path) -> Result<Journal, CliError> {
    let history = match journal::read(path) {
        Ok(h) => h,
        Err(journal::JournalError::Io { source, .. })
            if source.kind() == io::ErrorKind::NotFound =>
        {
            return Ok(Journal::default());
        }
        Err(journal::JournalError::Io { path, source }) => {
            return Err(CliError::io(
                format!("failed to read {}", path.display()),
                source,
            ));
        }
        Err(e) => return Err(CliError::Invalid(e.to_string())),
    };
    let text = std::fs::read(path)
        .map_err(|e| CliError::io(format!("failed to read {}", path.display()), e))?;
    let mut out = Journal::default();
    // (line, worker) of each start, to tell which exits were followed by a restart.
    let mut starts = Vec::new();
    let mut exits = Vec::new();
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        match serde_json::from_slice::<journal::Entry>(raw) {
            Ok(journal::Entry::WorkerStart { worker, role, .. }) => {
                let worker = Key::of(Some(&Value::from(worker)));
                starts.push((i, worker.clone()));
                out.roles.insert(worker, role);
            }
            Ok(journal::Entry::WorkerExit { worker, reason, .. }) => {
                let incident = Incident {
                    time: None,
                    worker: Key::of(Some(&Value::from(worker))),
                    role: None,
                    message: reason,
                    restarted: false,
                };
                exits.push((i, incident));
            }
            _ => {}
        }
    }
    for (i, mut exit) in exits {
        exit.restarted = starts.iter().any(|(j, w)| *j > i && *w == exit.worker);
        out.exits.push(exit);
    }
    out.history = Some(history);
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The page

const FONT: &str = "sans-serif";
/// Points drawn per series at most; longer series are averaged over runs of neighbours.
const MAX_POINTS: usize = 1500;
/// Line colours (no red: red marks worker exits).
const SERIES_COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(57, 59, 121),
];
const EXIT_COLOR: RGBColor = RGBColor(214, 39, 40);
/// Warnings listed at most.
const MAX_WARNINGS: usize = 200;
/// Worker exits labelled on the charts at most; beyond that only the lines (the table has all).
const MAX_MARKER_LABELS: usize = 24;
const FULL: (u32, u32) = (1200, 380);
const HALF: (u32, u32) = (595, 360);

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
        facts.push(("Started", utc(run.first)));
        facts.push(("Duration", duration(run.duration())));
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
            format!("{} real{efficiency}", group_digits(real)),
        ));
    } else {
        let trained: f64 = run.train.values().filter_map(|p| p.tokens).sum();
        if trained > 0.0 {
            facts.push(("Total tokens", format!("{} trained", group_digits(trained))));
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

type TrainField = fn(&TrainPoint) -> Option<f64>;

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

fn train_section(h: &mut String, run: &Run) -> Result<(), CliError> {
    if run.train.is_empty() {
        h.push_str(
            "<p class=\"note\">No train lines in metrics.jsonl (a synthetic-stage run trains \
             nothing): no loss or accuracy to show.</p>\n",
        );
        return Ok(());
    }
    let pick = |f: TrainField| -> Vec<(f64, f64)> {
        run.train
            .iter()
            .filter_map(|(&s, p)| f(p).map(|v| (s as f64, v)))
            .collect()
    };
    let loss = pick(|p| p.loss);
    let accuracy = pick(|p| p.accuracy);
    let first = *run.train.keys().next().unwrap_or(&0) as f64;
    let last = *run.train.keys().next_back().unwrap_or(&1) as f64;
    let x_range = Some((first.min(last - 1.0).max(0.0), last));
    let raw_and_mean = |points: &[(f64, f64)]| {
        vec![
            Series {
                name: "per step".into(),
                color: SERIES_COLORS[0],
                points: thin(points),
                faint: true,
            },
            Series {
                name: "moving average".into(),
                color: SERIES_COLORS[1],
                points: thin(&moving_average(points)),
                faint: false,
            },
        ]
    };
    let loss_chart = LineChart {
        title: "Training loss",
        x_desc: "optimiser step".into(),
        y_desc: "cross-entropy",
        size: HALF,
        x_range,
        y_from_zero: false,
        y_at_least: None,
        y_fmt: fmt_num,
        series: raw_and_mean(&loss),
        markers: None,
    };
    let accuracy_chart = LineChart {
        title: "Draft accuracy",
        x_desc: "optimiser step".into(),
        y_desc: "fraction of draft tokens correct",
        size: HALF,
        x_range,
        y_from_zero: true,
        y_at_least: None,
        y_fmt: fmt_num,
        series: raw_and_mean(&accuracy),
        markers: None,
    };
    h.push_str("<div class=\"row\">\n");
    h.push_str(&draw_lines(&loss_chart)?);
    h.push_str(&draw_lines(&accuracy_chart)?);
    h.push_str("</div>\n");
    legend(h, &loss_chart.series);
    if !run.served.is_empty() {
        // Served τ beside the training proxy on the same scale: tokens per verify step are the
        // accepted draft tokens plus the target's own, so the proxy plus one.
        let served: Vec<(f64, f64)> = run.served.iter().map(|(&s, &t)| (s as f64, t)).collect();
        let proxy: Vec<(f64, f64)> = pick(|p| p.acceptance)
            .into_iter()
            .map(|(s, a)| (s, a + 1.0))
            .collect();
        let chart = LineChart {
            title: "Served acceptance and the training proxy",
            x_desc: "optimiser step".into(),
            y_desc: "tokens per verify step",
            size: HALF,
            x_range,
            y_from_zero: true,
            y_at_least: Some(1.0),
            y_fmt: fmt_num,
            series: vec![
                Series {
                    name: "training proxy + 1 (moving average)".into(),
                    color: SERIES_COLORS[1],
                    points: thin(&moving_average(&proxy)),
                    faint: true,
                },
                Series {
                    name: "served τ (speculative decoding, held-out prompts)".into(),
                    color: SERIES_COLORS[2],
                    points: served,
                    faint: false,
                },
            ],
            markers: None,
        };
        h.push_str("<div class=\"row\">\n");
        h.push_str(&draw_lines(&chart)?);
        h.push_str("</div>\n");
        legend(h, &chart.series);
    }
    Ok(())
}

fn throughput_section(
    h: &mut String,
    run: &Run,
    axis: &TimeAxis,
    markers: &Markers,
) -> Result<(), CliError> {
    if run.throughput.is_empty() {
        h.push_str(
            "<p class=\"note\">No batch lines in metrics.jsonl: no throughput to show.</p>\n",
        );
        return Ok(());
    }
    let mut lines = run.throughput.clone();
    lines.sort_by(|a, b| a.0.total_cmp(&b.0));
    let series = |i: usize, name: &str, f: fn(&Reading) -> Option<f64>| Series {
        name: name.into(),
        color: SERIES_COLORS[i],
        points: thin(
            &lines
                .iter()
                .filter_map(|l| f(l).map(|v| (axis.x(l.0 - run.first), v)))
                .collect::<Vec<_>>(),
        ),
        faint: false,
    };
    let chart = LineChart {
        title: "Throughput (tokens/s over the last 10 s)",
        x_desc: axis.desc(),
        y_desc: "tokens / s",
        size: FULL,
        x_range: Some((0.0, axis.x(run.duration()))),
        y_from_zero: true,
        y_at_least: None,
        y_fmt: fmt_num,
        series: vec![
            series(0, "real tokens/s", |l| l.1),
            series(1, "padded tokens/s", |l| l.2),
        ],
        markers: Some(markers),
    };
    h.push_str(&draw_lines(&chart)?);
    legend(h, &chart.series);
    Ok(())
}

fn bucket_section(h: &mut String, run: &Run) -> Result<(), CliError> {
    let mut counts: BTreeMap<&Key, usize> = BTreeMap::new();
    for b in run.batches.values().chain(&run.unstepped) {
        *counts.entry(&b.bucket).or_default() += 1;
    }
    if counts.is_empty() {
        h.push_str("<p class=\"note\">No batch lines in metrics.jsonl: no buckets to show.</p>\n");
        return Ok(());
    }
    let bars: Vec<(String, f64, RGBColor)> = counts
        .iter()
        .enumerate()
        .map(|(i, (k, &n))| {
            let color = bucket_color(usize::try_from(k.num).unwrap_or(i));
            (k.text.clone(), n as f64, color)
        })
        .collect();
    h.push_str(&draw_bars(
        "Batches per bucket",
        "bucket",
        "batches",
        &bars,
        (1200, 320),
    )?);
    let committed = run.batches.len() + run.unstepped.len();
    let replayed = run.batch_lines - committed;
    let mut note = format!("{committed} batches");
    if replayed > 0 {
        let _ = write!(
            note,
            "; {replayed} batch lines written again by replays after a restart are counted once"
        );
    }
    let _ = writeln!(h, "<p class=\"note\">{}.</p>", esc(&note));
    Ok(())
}

fn telemetry_section(
    h: &mut String,
    run: &Run,
    axis: &TimeAxis,
    markers: &Markers,
) -> Result<(), CliError> {
    let x_range = Some((0.0, axis.x(run.duration())));
    let series = |map: &BTreeMap<Key, Telemetry>,
                  name: &dyn Fn(&Key, &Telemetry) -> String,
                  value: fn(&Reading) -> Option<f64>,
                  scale: f64| {
        map.iter()
            .enumerate()
            .map(|(i, (key, t))| {
                let mut points: Vec<(f64, f64)> = t
                    .points
                    .iter()
                    .filter_map(|p| {
                        value(p)
                            .filter(|v| v.is_finite())
                            .map(|v| (axis.x(p.0 - run.first), v / scale))
                    })
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    name: name(key, t),
                    color: SERIES_COLORS[i % SERIES_COLORS.len()],
                    points: thin(&points),
                    faint: false,
                }
            })
            .collect::<Vec<_>>()
    };
    let with_role = |prefix: &str, key: &Key, t: &Telemetry| match &t.role {
        Some(role) => format!("{prefix} {} ({role})", key.text),
        None => format!("{prefix} {}", key.text),
    };
    if !run.gpu.is_empty() {
        let name = |k: &Key, t: &Telemetry| with_role("GPU", k, t);
        let power = LineChart {
            title: "GPU power",
            x_desc: axis.desc(),
            y_desc: "W",
            size: HALF,
            x_range,
            y_from_zero: true,
            y_at_least: None,
            y_fmt: fmt_num,
            series: series(&run.gpu, &name, |p| p.1, 1.0),
            markers: Some(markers),
        };
        let utilization = LineChart {
            title: "GPU utilization",
            x_desc: axis.desc(),
            y_desc: "%",
            size: HALF,
            x_range,
            y_from_zero: true,
            y_at_least: Some(100.0),
            y_fmt: fmt_num,
            series: series(&run.gpu, &name, |p| p.2, 1.0),
            markers: Some(markers),
        };
        h.push_str("<div class=\"row\">\n");
        h.push_str(&draw_lines(&power)?);
        h.push_str(&draw_lines(&utilization)?);
        h.push_str("</div>\n");
        legend(h, &power.series);
        return Ok(());
    }
    if run.process.is_empty() {
        h.push_str(
            "<p class=\"note\">No GPU telemetry was available and no worker process readings \
             either (no gpu or process lines in metrics.jsonl).</p>\n",
        );
        return Ok(());
    }
    h.push_str(
        "<p class=\"note\">No GPU telemetry was available (no gpu lines: NVML or a GPU was \
         missing): the workers' CPU and memory instead.</p>\n",
    );
    let max_rss = run
        .process
        .values()
        .flat_map(|t| t.points.iter().filter_map(|p| p.2))
        .fold(0.0, f64::max);
    let (scale, unit) = if max_rss >= 2.0 * GIB {
        (GIB, "GiB")
    } else {
        (MIB, "MiB")
    };
    let name = |k: &Key, t: &Telemetry| with_role("worker", k, t);
    let cpu = LineChart {
        title: "Worker CPU",
        x_desc: axis.desc(),
        y_desc: "% of one core",
        size: HALF,
        x_range,
        y_from_zero: true,
        y_at_least: None,
        y_fmt: fmt_num,
        series: series(&run.process, &name, |p| p.1, 1.0),
        markers: Some(markers),
    };
    let rss = LineChart {
        title: "Worker memory (RSS)",
        x_desc: axis.desc(),
        y_desc: unit,
        size: HALF,
        x_range,
        y_from_zero: true,
        y_at_least: None,
        y_fmt: fmt_num,
        series: series(&run.process, &name, |p| p.2, scale),
        markers: Some(markers),
    };
    h.push_str("<div class=\"row\">\n");
    h.push_str(&draw_lines(&cpu)?);
    h.push_str(&draw_lines(&rss)?);
    h.push_str("</div>\n");
    legend(h, &cpu.series);
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

fn exits_section(h: &mut String, run: &Run, exits: &[Incident], normal: usize, markers: &Markers) {
    let stopped = if normal > 0 {
        format!(" {normal} workers exited normally when the run stopped (not listed).")
    } else {
        String::new()
    };
    if exits.is_empty() {
        let _ = writeln!(
            h,
            "<p class=\"note\">No worker exited during the run.{stopped}</p>"
        );
        return;
    }
    let timed = exits.iter().any(|e| e.time.is_some());
    if timed {
        let labels = if markers.labelled {
            " labelled #N wW (exit N, worker W)"
        } else {
            ""
        };
        let _ = writeln!(
            h,
            "<p class=\"note\">Dashed red lines on the time axes mark worker exits{labels}.\
             {stopped}</p>"
        );
    } else {
        h.push_str(
            "<p class=\"note\">The exits below come from journal.jsonl, which has no times: they \
             are not marked on the time axes.</p>\n",
        );
        if normal > 0 {
            let _ = writeln!(h, "<p class=\"note\">{}</p>", stopped.trim());
        }
    }
    h.push_str(
        "<table class=\"exits\">\n<tr><th>#</th><th>time</th><th>since start</th><th>worker</th><th>role</th><th>restarted</th><th>message</th></tr>\n",
    );
    for (i, e) in exits.iter().enumerate() {
        let (clock, since) = match e.time {
            Some(t) => (utc(t), duration(t - run.first)),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"msg\">{}</td></tr>",
            i + 1,
            esc(&clock),
            esc(&since),
            esc(&e.worker.text),
            esc(e.role.as_deref().unwrap_or("-")),
            if e.restarted { "yes" } else { "no" },
            esc(&e.message)
        );
    }
    h.push_str("</table>\n");
    let others: Vec<String> = run
        .events
        .iter()
        .filter(|(name, _)| name.as_str() != "worker_exit")
        .map(|(name, n)| format!("{n} {name}"))
        .collect();
    if !others.is_empty() {
        let _ = writeln!(
            h,
            "<p class=\"note\">Other events in metrics.jsonl: {}.</p>",
            esc(&others.join(", "))
        );
    }
}

fn warnings_section(h: &mut String, run: &Run) {
    if run.warnings.is_empty() {
        return;
    }
    h.push_str("<h2>Warnings</h2>\n");
    let total = run.events.get("warning").copied().unwrap_or(0);
    if total > run.warnings.len() {
        let _ = writeln!(
            h,
            "<p class=\"note\">The first {} of {total} warnings.</p>",
            run.warnings.len()
        );
    }
    h.push_str(
        "<table class=\"exits\">\n<tr><th>time</th><th>since start</th><th>worker</th><th>message</th></tr>\n",
    );
    for w in &run.warnings {
        let t = w.time.unwrap_or(run.first);
        let worker = if w.worker.text == "?" {
            "-"
        } else {
            &w.worker.text
        };
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"msg\">{}</td></tr>",
            esc(&utc(t)),
            esc(&duration(t - run.first)),
            esc(worker),
            esc(&w.message)
        );
    }
    h.push_str("</table>\n");
}

fn legend(h: &mut String, series: &[Series]) {
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
// Charts

struct Series {
    name: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    /// Drawn thin and light (raw values under a moving average).
    faint: bool,
}

struct Marker {
    x: f64,
    label: String,
}

struct Markers {
    list: Vec<Marker>,
    labelled: bool,
}

struct LineChart<'a> {
    title: &'a str,
    x_desc: String,
    y_desc: &'a str,
    size: (u32, u32),
    x_range: Option<(f64, f64)>,
    /// The y axis starts at 0 when every value is positive.
    y_from_zero: bool,
    /// The y axis reaches at least this value (100 for a percentage).
    y_at_least: Option<f64>,
    y_fmt: fn(f64) -> String,
    series: Vec<Series>,
    markers: Option<&'a Markers>,
}

fn chart_err<E: std::fmt::Debug>(e: E) -> CliError {
    CliError::Failed(format!("failed to draw a chart: {e:?}"))
}

fn draw_lines(c: &LineChart<'_>) -> Result<String, CliError> {
    let points = || c.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1) = c.x_range.unwrap_or_else(|| {
        points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
            (lo.min(p.0), hi.max(p.0))
        })
    });
    if !x0.is_finite() || !x1.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let (mut lo, mut hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    if !lo.is_finite() || !hi.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    if c.y_from_zero && lo >= 0.0 {
        lo = 0.0;
    }
    if let Some(m) = c.y_at_least {
        hi = hi.max(m);
    }
    let pad = if hi > lo {
        0.06 * (hi - lo)
    } else {
        (0.1 * hi.abs()).max(1.0)
    };
    let y0 = if c.y_from_zero && lo >= 0.0 {
        0.0
    } else {
        lo - pad
    };
    let mut y1 = if c.y_at_least.is_some_and(|m| hi <= m) {
        hi
    } else {
        hi + pad
    };
    if !(y1 - y0).is_finite() || !(x1 - x0).is_finite() {
        return Err(CliError::Invalid(format!(
            "{}: values out of range to draw ({y0:e}..{y1:e} over {x0:e}..{x1:e})",
            c.title
        )));
    }
    let markers = c.markers.map_or(&[][..], |m| &m.list[..]);
    let labelled = c.markers.is_some_and(|m| m.labelled) && !markers.is_empty();
    if labelled {
        // Headroom above the data for the exit labels.
        y1 += 0.14 * (y1 - y0);
    }

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, c.size).into_drawing_area();
        root.fill(&WHITE).map_err(chart_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(c.title, (FONT, 20))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(62)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(chart_err)?;
        let y_fmt = c.y_fmt;
        chart
            .configure_mesh()
            .light_line_style(RGBColor(244, 244, 244))
            .bold_line_style(RGBColor(222, 222, 222))
            .x_labels(8)
            .y_labels(7)
            .x_label_formatter(&|v| fmt_num(*v))
            .y_label_formatter(&|v| y_fmt(*v))
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .x_desc(c.x_desc.as_str())
            .y_desc(c.y_desc)
            .draw()
            .map_err(chart_err)?;
        for s in &c.series {
            let style = if s.faint {
                s.color.mix(0.35).stroke_width(1)
            } else {
                s.color.stroke_width(2)
            };
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(chart_err)?;
        }
        for m in markers {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(m.x, y0), (m.x, y1)],
                    5,
                    4,
                    EXIT_COLOR.stroke_width(1),
                ))
                .map_err(chart_err)?;
        }
        if labelled {
            let (xs, _) = chart.plotting_area().get_pixel_range();
            // Up to three rows of labels; a label goes to the first row with room for it.
            let mut row_end = [i32::MIN; 3];
            let style = TextStyle::from((FONT, 14).into_font()).color(&EXIT_COLOR);
            for m in markers {
                let (px, top) = chart.backend_coord(&(m.x, y1));
                let width = 7 * m.label.chars().count() as i32 + 2;
                let left = if px + 3 + width <= xs.end {
                    px + 3
                } else {
                    px - 3 - width
                };
                if let Some(row) = row_end.iter().position(|&end| end + 4 <= left) {
                    row_end[row] = left + width;
                    let y = top + 3 + 14 * row as i32;
                    // A light backing keeps the label readable over a neighbouring exit's line.
                    root.draw(&Rectangle::new(
                        [(left - 2, y - 1), (left + width - 2, y + 12)],
                        WHITE.mix(0.85).filled(),
                    ))
                    .map_err(chart_err)?;
                    root.draw(&Text::new(m.label.clone(), (left, y), style.clone()))
                        .map_err(chart_err)?;
                }
            }
        }
        root.present().map_err(chart_err)?;
    }
    Ok(svg)
}

/// A bar chart: one bar per (label, value, colour), the value written above the bar.
fn draw_bars(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    bars: &[(String, f64, RGBColor)],
    size: (u32, u32),
) -> Result<String, CliError> {
    let top = bars.iter().map(|b| b.1).fold(1.0, f64::max) * 1.12;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(chart_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, 20))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(62)
            // Integer ranges are inclusive here: 0..k-1 makes k segments.
            .build_cartesian_2d(
                (0..bars.len().saturating_sub(1)).into_segmented(),
                0f64..top,
            )
            .map_err(chart_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(RGBColor(244, 244, 244))
            .bold_line_style(RGBColor(222, 222, 222))
            .x_labels(bars.len().min(40))
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => bars.get(*i).map(|b| b.0.clone()).unwrap_or_default(),
                _ => String::new(),
            })
            // Counts: whole numbers only.
            .y_labels((top as usize + 1).clamp(2, 8))
            .y_label_formatter(&|v| {
                if v.fract() == 0.0 {
                    fmt_num(*v)
                } else {
                    String::new()
                }
            })
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(chart_err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, v, color))| {
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), 0.0),
                        (SegmentValue::Exact(i + 1), *v),
                    ],
                    color.filled(),
                );
                bar.set_margin(0, 0, 6, 6);
                bar
            }))
            .map_err(chart_err)?;
        if bars.len() <= 40 {
            let style =
                TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
            chart
                .draw_series(bars.iter().enumerate().map(|(i, (_, v, _))| {
                    Text::new(
                        group_digits(*v),
                        (SegmentValue::CenterOf(i), *v + top * 0.01),
                        style.clone(),
                    )
                }))
                .map_err(chart_err)?;
        }
        root.present().map_err(chart_err)?;
    }
    Ok(svg)
}

/// Averages runs of neighbours so that a series has at most `MAX_POINTS` points.
fn thin(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points.to_vec();
    }
    let per = points.len().div_ceil(MAX_POINTS);
    points
        .chunks(per)
        .map(|c| {
            let n = c.len() as f64;
            (
                c.iter().map(|p| p.0).sum::<f64>() / n,
                c.iter().map(|p| p.1).sum::<f64>() / n,
            )
        })
        .collect()
}

/// Trailing moving average over a twentieth of the series.
fn moving_average(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let window = (points.len() / 20).max(1);
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            (x, sum / (i + 1).min(window) as f64)
        })
        .collect()
}

/// The unit of the time axes, picked from the run's length.
struct TimeAxis {
    seconds: f64,
    unit: &'static str,
}

impl TimeAxis {
    fn for_duration(d: f64) -> TimeAxis {
        let (seconds, unit) = if d <= 600.0 {
            (1.0, "s")
        } else if d <= 10.0 * 3600.0 {
            (60.0, "min")
        } else {
            (3600.0, "h")
        };
        TimeAxis { seconds, unit }
    }

    fn x(&self, since_start: f64) -> f64 {
        since_start / self.seconds
    }

    fn desc(&self) -> String {
        format!("time since the run's first metrics line ({})", self.unit)
    }
}

// ---------------------------------------------------------------------------------------------
// Text

fn esc(s: &str) -> String {
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

/// An axis label: 1.5k, 2M, 0.25, 12.
fn fmt_num(v: f64) -> String {
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let text = if scaled == scaled.round() || scaled.abs() >= 100.0 {
        format!("{scaled:.0}")
    } else if scaled.abs() >= 10.0 {
        format!("{scaled:.1}")
    } else if scaled.abs() >= 0.1 {
        format!("{scaled:.2}")
    } else {
        format!("{scaled:.3}")
    };
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    };
    format!("{text}{suffix}")
}

/// 12345678 as "12,345,678".
fn group_digits(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn duration(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".into();
    }
    if seconds < 60.0 {
        return format!("{seconds:.1} s");
    }
    let s = seconds.round() as u64;
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    if h > 0 {
        format!("{h} h {m:02} min {s:02} s")
    } else {
        format!("{m} min {s:02} s")
    }
}

/// Unix seconds as "2025-01-31 12:00:05 UTC".
fn utc(t: f64) -> String {
    if !t.is_finite() || !(0.0..1e11).contains(&t) {
        return "-".into();
    }
    let secs = t.floor() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(utc(0.0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_700_000_000.5), "2023-11-14 22:13:20 UTC");
        assert_eq!(utc(951_782_400.0), "2000-02-29 00:00:00 UTC");
        assert_eq!(fmt_num(250_000.0), "250k");
        assert_eq!(fmt_num(1_500_000.0), "1.5M");
        assert_eq!(fmt_num(0.25), "0.25");
        assert_eq!(fmt_num(12.0), "12");
        assert_eq!(group_digits(12_345_678.0), "12,345,678");
        assert_eq!(duration(3723.0), "1 h 02 min 03 s");
        assert_eq!(esc("<a&\"b\">"), "&lt;a&amp;&quot;b&quot;&gt;");
    }

    #[test]
    fn thin_and_average_keep_the_shape() {
        let points: Vec<(f64, f64)> = (0..10_000).map(|i| (i as f64, 1.0)).collect();
        let thinned = thin(&points);
        assert!(thinned.len() <= MAX_POINTS);
        assert!(thinned.iter().all(|p| (p.1 - 1.0).abs() < 1e-12));
        let avg = moving_average(&[(0.0, 0.0), (1.0, 2.0), (2.0, 4.0)]);
        assert_eq!(avg, vec![(0.0, 0.0), (1.0, 2.0), (2.0, 4.0)]);
    }

    #[test]
    fn a_line_of_wrong_shape_is_an_error_not_a_panic() {
        for text in [
            "[1,2]",
            "{\"kind\":\"batch\"}",
            "{\"kind\":\"train\",\"time\":1}",
            "{\"kind\":\"gpu\",\"time\":\"x\"}",
            "{\"time\":1}",
        ] {
            let line: Result<Line, _> = serde_json::from_str(text);
            let outcome = line
                .map_err(|e| e.to_string())
                .and_then(|l| Run::new().add(l));
            assert!(outcome.is_err(), "{text}");
        }
    }
}
