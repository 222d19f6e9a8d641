//! Reading what a run wrote: `metrics.jsonl` (format in docs/metrics.md) and `journal.jsonl`,
//! for `report` and `demo`. A malformed line is skipped with a warning naming the file and the
//! line (one bad record never hides the rest of a run); a last line cut short (the run is live,
//! or crashed mid-write) is ignored.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::Path;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::CliError;
use crate::runtime::{journal, metrics};

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
pub struct Key {
    pub num: u64,
    pub text: String,
}

impl Key {
    pub fn of(v: Option<&Value>) -> Key {
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
pub struct TrainPoint {
    pub loss: Option<f64>,
    pub accuracy: Option<f64>,
    pub acceptance: Option<f64>,
    pub tokens: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct BatchFacts {
    pub bucket: Key,
    pub real: f64,
    pub padded: f64,
}

/// (Unix time, first value, second value): a batch line's tokens/s and padded tokens/s, a GPU's
/// power and utilization, a worker's CPU and RSS.
pub type Reading = (f64, Option<f64>, Option<f64>);

/// One GPU's or worker's readings.
#[derive(Debug, Default)]
pub struct Telemetry {
    pub role: Option<String>,
    pub points: Vec<Reading>,
}

/// How a worker's exit is reported when the worker ended normally.
/// Warnings kept at most.
pub const MAX_WARNINGS: usize = 200;

pub const NORMAL_EXIT: &str = "exited normally";

/// A worker exit or a warning.
#[derive(Debug, Clone)]
pub struct Incident {
    /// Unix seconds; `None` for exits known only from the journal (which has no times).
    pub time: Option<f64>,
    pub worker: Key,
    pub role: Option<String>,
    pub message: String,
    /// An exit after which the worker was started again.
    pub restarted: bool,
}

/// What metrics.jsonl says.
#[derive(Debug)]
pub struct Run {
    /// Train lines by optimiser step, the last line of a step kept.
    pub train: BTreeMap<u64, TrainPoint>,
    /// Served acceptance (`eval` lines): τ by the step of the checkpoint evaluated.
    pub served: BTreeMap<u64, f64>,
    /// Every batch line: (time, tokens/s, padded tokens/s).
    pub throughput: Vec<Reading>,
    /// Batch lines by plan step, the last line of a step kept (a replay writes its steps again).
    pub batches: BTreeMap<u64, BatchFacts>,
    /// Batch lines without a step.
    pub unstepped: Vec<BatchFacts>,
    pub batch_lines: usize,
    pub gpu: BTreeMap<Key, Telemetry>,
    pub process: BTreeMap<Key, Telemetry>,
    pub exits: Vec<Incident>,
    /// `worker_start` events: (time, worker).
    pub starts: Vec<(f64, Key)>,
    pub warnings: Vec<Incident>,
    pub events: BTreeMap<String, usize>,
    pub first: f64,
    pub last: f64,
    pub lines: usize,
    pub torn_tail: bool,
    /// The malformed lines skipped, each as `file:line: why`.
    pub skipped: Vec<String>,
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
            skipped: Vec::new(),
        }
    }

    pub fn has_times(&self) -> bool {
        self.first <= self.last
    }

    pub fn duration(&self) -> f64 {
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

/// Reads a run's `metrics.jsonl` into the report's view of it.
pub fn read_metrics(path: &Path) -> Result<Run, CliError> {
    let mut run = Run::new();
    let read = read_lines(path, |line: Line| run.add(line))?;
    run.torn_tail = read.torn_tail;
    run.skipped = read.skipped;
    Ok(run)
}

/// The training step lines of `RUN_DIR/metrics.jsonl`, the last one of each step kept (a
/// resumed run repeats steps), in step order.
pub fn train_steps(run_dir: &Path) -> Result<Vec<Value>, CliError> {
    let mut steps = BTreeMap::new();
    read_lines(&run_dir.join(metrics::FILE), |v: Value| {
        if v["kind"] == "train"
            && let Some(step) = v["step"].as_u64()
        {
            steps.insert(step, v);
        }
        Ok(())
    })?;
    Ok(steps.into_values().collect())
}

/// What [`read_lines`] met besides the lines it gave on.
#[derive(Debug, Default)]
struct LinesRead {
    /// The last line was cut short.
    torn_tail: bool,
    /// The malformed lines skipped, each as `file:line: why`.
    skipped: Vec<String>,
}

/// Reads a JSON-lines file a run writes, giving each line to `each`. A malformed line (or one
/// `each` refuses) is skipped with a warning naming the file and the line; a last line cut
/// short (no newline: the run is live or crashed mid-write) ends the reading, and the result
/// says so.
fn read_lines<T: DeserializeOwned>(
    path: &Path,
    mut each: impl FnMut(T) -> Result<(), String>,
) -> Result<LinesRead, CliError> {
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
    let mut buf = Vec::new();
    let mut number = 0usize;
    let mut read = LinesRead::default();
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| CliError::io(format!("failed to read {}", path.display()), e))?;
        if n == 0 {
            return Ok(read);
        }
        number += 1;
        let complete = buf.last() == Some(&b'\n');
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let why = match serde_json::from_slice(&buf) {
            Ok(line) => match each(line) {
                Ok(()) => continue,
                Err(why) => why,
            },
            Err(_) if !complete => {
                read.torn_tail = true;
                return Ok(read);
            }
            Err(e) => e.to_string(),
        };
        let skipped = format!("{}:{number}: malformed line skipped: {why}", path.display());
        tracing::warn!("{skipped}");
        read.skipped.push(skipped);
    }
}

// ---------------------------------------------------------------------------------------------
// Reading journal.jsonl

#[derive(Debug, Default)]
pub struct Journal {
    /// `None` when the run directory has no journal.
    pub history: Option<journal::History>,
    /// Role of each worker, from `worker_start`.
    pub roles: BTreeMap<Key, String>,
    pub exits: Vec<Incident>,
}

pub fn read_journal(path: &Path) -> Result<Journal, CliError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn train_steps_keep_the_last_line_of_each_step_and_skip_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"kind":"train","step":2,"loss":2.0}"#,
            r#"{"kind":"train","step":1,"loss":1.0}"#,
            r#"{"kind":"gpu","time":1}"#,
            r#"{"kind":"train","step":2,"loss":3.0}"#,
            r#"{"kind":"train","st"#,
        ];
        std::fs::write(dir.path().join(metrics::FILE), lines.join("\n")).unwrap();
        let steps = train_steps(dir.path()).unwrap();
        let losses: Vec<f64> = steps.iter().map(|v| v["loss"].as_f64().unwrap()).collect();
        assert_eq!(losses, [1.0, 3.0]);
        // Malformed lines (two records fused by an append to a cut line, a line of garbage) are
        // skipped, and the lines around them kept.
        std::fs::write(
            dir.path().join(metrics::FILE),
            "{\"kind\":\"train\",\"step\":1,\"loss\":1.0}\n{\"kind\":\"train\",\"st{\"kind\":\"gpu\"}\n\u{1}\u{2}garbage\n{\"kind\":\"train\",\"step\":2,\"loss\":2.0}\n",
        )
        .unwrap();
        let steps = train_steps(dir.path()).unwrap();
        assert_eq!(steps.len(), 2);
        let run = read_metrics(&dir.path().join(metrics::FILE)).unwrap();
        assert_eq!(run.skipped.len(), 2, "{:?}", run.skipped);
        assert!(run.skipped[0].contains("metrics.jsonl:2: malformed line skipped"));
        assert!(run.skipped[1].contains("metrics.jsonl:3:"));
        assert_eq!(run.train.len(), 2);
    }
}
