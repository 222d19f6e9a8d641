//! What `top` shows, as plain data: the run's last answer, a short history per worker, the
//! selection, and what a key does to them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::time::Instant;

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use serde_json::Value;

use super::draw::workers;
use crate::runtime::control::ClientError;

/// Samples kept per series (one per refresh).
pub const HISTORY: usize = 60;

/// What a key asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    None,
    Quit,
    Restart { worker: u32, force: bool },
}

/// The last answer of the run, a short history per worker, and what is selected.
pub struct View {
    pub(super) run_dir: String,
    pub(super) interval: f64,
    pub(super) last: Option<Value>,
    /// Why the run cannot be reached now (`None` while it answers).
    pub(super) lost: Option<String>,
    pub(super) last_seen: Option<Instant>,
    pub(super) selected: usize,
    /// Per worker id: GPU power (W), GPU utilization (%), CPU (%), batches per refresh.
    pub(super) history: BTreeMap<u64, Series>,
    /// Tokens per second between the last two answers (the run's average for the first one).
    pub(super) throughput: VecDeque<Option<u64>>,
    /// `(uptime_s, tokens committed)` of the last answer.
    pub(super) tokens_at: Option<(f64, f64)>,
    /// The status line: the answer to the last restart.
    pub message: Option<String>,
}

#[derive(Default)]
pub(super) struct Series {
    pub(super) power: VecDeque<Option<u64>>,
    pub(super) util: VecDeque<Option<u64>>,
    pub(super) cpu: VecDeque<Option<u64>>,
    pub(super) batches: VecDeque<Option<u64>>,
    pub(super) batches_done: Option<u64>,
}

fn push(series: &mut VecDeque<Option<u64>>, value: Option<f64>) {
    let sample = value
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v.round() as u64);
    series.push_back(sample);
    while series.len() > HISTORY {
        series.pop_front();
    }
}

impl View {
    pub fn new(run_dir: &Path, interval: f64) -> Self {
        View {
            run_dir: run_dir.display().to_string(),
            interval,
            last: None,
            lost: None,
            last_seen: None,
            selected: 0,
            history: BTreeMap::new(),
            throughput: VecDeque::new(),
            tokens_at: None,
            message: None,
        }
    }

    /// A fresh answer of the run: `{"run": {...}, "workers": [...]}` (anything else is shown as
    /// far as it goes).
    pub fn update(&mut self, status: Value) {
        let r = &status["run"];
        let average = r["tokens_per_s"].as_f64();
        let now = r["uptime_s"].as_f64().zip(average).map(|(u, a)| (u, u * a));
        let rate = match (self.tokens_at, now) {
            // The same orchestrator, later (a resumed run starts its uptime again).
            (Some((u0, t0)), Some((u1, t1))) if u1 > u0 && t1 >= t0 => Some((t1 - t0) / (u1 - u0)),
            _ => average,
        };
        self.tokens_at = now;
        push(&mut self.throughput, rate);
        let mut seen = BTreeSet::new();
        for w in workers(&status) {
            let Some(id) = w["id"].as_u64() else { continue };
            seen.insert(id);
            let s = self.history.entry(id).or_default();
            push(&mut s.power, w["gpu_power_w"].as_f64());
            push(&mut s.util, w["gpu_utilization_pct"].as_f64());
            push(&mut s.cpu, w["cpu_pct"].as_f64());
            let done = w["batches_done"].as_u64();
            let step = match (s.batches_done, done) {
                (Some(a), Some(b)) if b >= a => Some((b - a) as f64),
                _ => None,
            };
            push(&mut s.batches, step);
            s.batches_done = done;
        }
        self.history.retain(|id, _| seen.contains(id));
        self.selected = self.selected.min(workers(&status).len().saturating_sub(1));
        self.last = Some(status);
        self.lost = None;
        self.last_seen = Some(Instant::now());
    }

    /// The run did not answer: keep the last screen and say so.
    pub fn lost(&mut self, why: &ClientError) {
        self.lost = Some(why.to_string());
    }

    pub fn is_live(&self) -> bool {
        self.last.is_some() && self.lost.is_none()
    }

    pub fn restart_answer(
        &mut self,
        worker: u32,
        force: bool,
        answer: &Result<Value, ClientError>,
    ) {
        let when = restart_when(force);
        self.message = Some(match answer {
            Ok(_) => format!("restart worker {worker} {when}: ok"),
            Err(e) => format!("restart worker {worker} {when}: refused: {e}"),
        });
    }

    /// The id of the selected worker.
    pub fn selected_worker(&self) -> Option<u32> {
        let w = workers(self.last.as_ref()?).get(self.selected)?;
        w["id"].as_u64().and_then(|id| u32::try_from(id).ok())
    }

    /// Applies a key: selection moves here; quitting and restarting are for the caller.
    pub fn key(&mut self, key: KeyEvent) -> Action {
        if key.kind != KeyEventKind::Press {
            return Action::None;
        }
        let count = self.last.as_ref().map_or(0, |v| workers(v).len());
        match key.code {
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Action::Quit,
            KeyCode::Char('q') | KeyCode::Esc => Action::Quit,
            KeyCode::Up | KeyCode::Char('k') => {
                self.selected = self.selected.saturating_sub(1);
                Action::None
            }
            KeyCode::Down | KeyCode::Char('j') => {
                if self.selected + 1 < count {
                    self.selected += 1;
                }
                Action::None
            }
            KeyCode::Home => {
                self.selected = 0;
                Action::None
            }
            KeyCode::End => {
                self.selected = count.saturating_sub(1);
                Action::None
            }
            KeyCode::Char(c @ ('r' | 'R')) => {
                if !self.is_live() {
                    self.message = Some("nothing to restart: the run does not answer".into());
                    return Action::None;
                }
                match self.selected_worker() {
                    Some(worker) => Action::Restart {
                        worker,
                        force: c == 'R',
                    },
                    None => {
                        self.message = Some("no worker selected".into());
                        Action::None
                    }
                }
            }
            _ => Action::None,
        }
    }
}

/// How soon a restart takes effect, in words.
pub(super) fn restart_when(force: bool) -> &'static str {
    if force {
        "at once"
    } else {
        "after its current job"
    }
}
