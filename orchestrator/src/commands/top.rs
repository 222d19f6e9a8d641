//! `dflash-orch top`: a live terminal view of the run's workers.
//!
//! Polls the orchestrator over its control socket (the same `status` request as `dflash-orch
//! status`) every `--interval` seconds on a thread of its own, so the screen keeps answering keys
//! while the run is slow to reply. What is drawn is a pure function of [`View`], which the tests
//! render into ratatui's `TestBackend`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Args;
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Paragraph, Row, Sparkline, SparklineBar, Table, TableState};
use serde_json::Value;

use super::status::client_error;
use crate::cli::CliError;
use crate::runtime::control::{self, ClientError, Request};

/// Samples kept per series (one per refresh).
pub const HISTORY: usize = 60;

#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,

    /// Refresh every SECS seconds (at most 3600).
    #[arg(long, value_name = "SECS", default_value_t = 1.0, value_parser = crate::options::positive(3600.0, " seconds"))]
    pub interval: f64,
}

pub fn run(args: TopArgs) -> Result<(), CliError> {
    if !(args.interval > 0.0 && args.interval <= 3600.0) {
        return Err(CliError::Invalid(format!(
            "invalid --interval {}: expected seconds, more than 0 and at most 3600",
            args.interval
        )));
    }
    if !std::io::stdout().is_terminal() {
        return Err(CliError::Invalid(
            "top needs a terminal (stdout is not one); for plain text use \
             `dflash-orch status --watch 1` (or `status --json`)"
                .into(),
        ));
    }
    // Not a live run: the same error as `status`, before the screen is taken over.
    let first = control::request(&args.run_dir, &Request::Status).map_err(client_error)?;
    let mut view = View::new(&args.run_dir, args.interval);
    view.update(first);

    let quit = Arc::new(AtomicBool::new(false));
    for signal in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        let _ = signal_hook::flag::register(signal, Arc::clone(&quit));
    }

    let keys = Keys::open()?;
    let (tx, rx) = mpsc::channel();
    spawn_poller(
        args.run_dir.clone(),
        Duration::from_secs_f64(args.interval),
        tx.clone(),
    );

    let mut tui = Tui::start()?;
    let result = event_loop(&mut tui, &keys, &mut view, &args.run_dir, &quit, &tx, &rx);
    drop(tui);
    result
}

/// What the background threads tell the screen.
enum Msg {
    Status(Result<Value, ClientError>),
    Restarted {
        worker: u32,
        force: bool,
        answer: Result<Value, ClientError>,
    },
}

fn spawn_poller(run_dir: PathBuf, interval: Duration, tx: mpsc::Sender<Msg>) {
    let _ = std::thread::Builder::new()
        .name("top-poll".into())
        .spawn(move || {
            loop {
                std::thread::sleep(interval);
                let answer = control::request(&run_dir, &Request::Status);
                if tx.send(Msg::Status(answer)).is_err() {
                    return;
                }
            }
        });
}

fn spawn_restart(run_dir: PathBuf, worker: u32, force: bool, tx: mpsc::Sender<Msg>) {
    let _ = std::thread::Builder::new()
        .name("top-restart".into())
        .spawn(move || {
            let request = Request::Restart {
                worker: Some(worker),
                gpu: None,
                force,
            };
            let answer = control::request(&run_dir, &request);
            let _ = tx.send(Msg::Restarted {
                worker,
                force,
                answer,
            });
        });
}

/// The terminal in raw mode on the alternate screen; put back as it was when dropped (on return,
/// on error and while unwinding; ratatui's panic hook restores it before the panic message).
struct Tui {
    terminal: ratatui::DefaultTerminal,
}

impl Tui {
    fn start() -> Result<Self, CliError> {
        match ratatui::try_init() {
            Ok(terminal) => Ok(Tui { terminal }),
            Err(e) => {
                let _ = ratatui::try_restore();
                Err(CliError::io("cannot set up the terminal", e))
            }
        }
    }
}

impl Drop for Tui {
    fn drop(&mut self) {
        let _ = self.terminal.show_cursor();
        let _ = ratatui::try_restore();
    }
}

fn event_loop(
    tui: &mut Tui,
    keys: &Keys,
    view: &mut View,
    run_dir: &Path,
    quit: &AtomicBool,
    tx: &mpsc::Sender<Msg>,
    rx: &mpsc::Receiver<Msg>,
) -> Result<(), CliError> {
    let draw_error = |e: std::io::Error| CliError::io("cannot draw on the terminal", e);
    loop {
        if quit.load(Ordering::Relaxed) {
            return Ok(());
        }
        while let Ok(msg) = rx.try_recv() {
            match msg {
                Msg::Status(Ok(v)) => view.update(v),
                Msg::Status(Err(e)) => view.lost(&e),
                Msg::Restarted {
                    worker,
                    force,
                    answer,
                } => view.restart_answer(worker, force, &answer),
            }
        }
        tui.terminal
            .draw(|frame| view.draw(frame))
            .map_err(draw_error)?;
        match keys.wait(Duration::from_millis(100)) {
            Ok(Input::Timeout) => continue,
            // The terminal went away (its window closed): nothing left to show.
            Ok(Input::HungUp) => return Ok(()),
            Ok(Input::Ready) => {}
            Err(e) => return Err(CliError::io("cannot read the terminal", e)),
        }
        let read_error = |e: std::io::Error| CliError::io("cannot read the terminal", e);
        // Every event read from the terminal so far (a burst of keys comes in one read).
        while event::poll(Duration::ZERO).map_err(read_error)? {
            // Anything else (a resize) is drawn on the next pass.
            let Event::Key(key) = event::read().map_err(read_error)? else {
                continue;
            };
            match view.key(key) {
                Action::None => {}
                Action::Quit => return Ok(()),
                Action::Restart { worker, force } => {
                    view.message = Some(format!(
                        "restart worker {worker} {}: sent",
                        restart_when(force)
                    ));
                    spawn_restart(run_dir.to_path_buf(), worker, force, tx.clone());
                }
            }
        }
    }
}

/// The terminal the keys come from: stdin when it is one, else `/dev/tty` (as crossterm does).
///
/// crossterm is asked for events only once this says there is input: on a terminal that has hung
/// up, its read loop would spin forever on end-of-file.
struct Keys {
    tty: Option<std::fs::File>,
}

enum Input {
    Ready,
    Timeout,
    HungUp,
}

impl Keys {
    fn open() -> Result<Self, CliError> {
        if std::io::stdin().is_terminal() {
            return Ok(Keys { tty: None });
        }
        std::fs::File::open("/dev/tty")
            .map(|f| Keys { tty: Some(f) })
            .map_err(|e| {
                CliError::Invalid(format!(
                    "top needs a terminal to read keys from (stdin is not one, /dev/tty: {e})"
                ))
            })
    }

    fn wait(&self, timeout: Duration) -> std::io::Result<Input> {
        use std::os::fd::AsRawFd as _;
        let fd = self
            .tty
            .as_ref()
            .map_or(libc::STDIN_FILENO, |f| f.as_raw_fd());
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one pollfd that lives across the call, and its count.
        let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(Input::Timeout)
            } else {
                Err(e)
            };
        }
        Ok(
            if pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                Input::HungUp
            } else if pfd.revents & libc::POLLIN != 0 {
                Input::Ready
            } else {
                Input::Timeout
            },
        )
    }
}

fn restart_when(force: bool) -> &'static str {
    if force {
        "at once"
    } else {
        "after its current job"
    }
}

/// What a key asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    None,
    Quit,
    Restart { worker: u32, force: bool },
}

/// The last answer of the run, a short history per worker, and what is selected.
pub struct View {
    run_dir: String,
    interval: f64,
    last: Option<Value>,
    /// Why the run cannot be reached now (`None` while it answers).
    lost: Option<String>,
    last_seen: Option<Instant>,
    selected: usize,
    /// Per worker id: GPU power (W), GPU utilization (%), CPU (%), batches per refresh.
    history: BTreeMap<u64, Series>,
    /// Tokens per second between the last two answers (the run's average for the first one).
    throughput: VecDeque<Option<u64>>,
    /// `(uptime_s, tokens committed)` of the last answer.
    tokens_at: Option<(f64, f64)>,
    /// The status line: the answer to the last restart.
    pub message: Option<String>,
}

#[derive(Default)]
struct Series {
    power: VecDeque<Option<u64>>,
    util: VecDeque<Option<u64>>,
    cpu: VecDeque<Option<u64>>,
    batches: VecDeque<Option<u64>>,
    batches_done: Option<u64>,
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

    /// Draws the whole screen.
    pub fn draw(&self, frame: &mut Frame) {
        let area = frame.area();
        let count = workers(self.status()).len();
        let rows = u16::try_from(count).unwrap_or(u16::MAX).saturating_add(3);
        let [header, table, charts, per_worker, footer] = Layout::vertical([
            Constraint::Length(4),
            Constraint::Length(rows.max(4)),
            Constraint::Length(8),
            Constraint::Fill(1),
            Constraint::Length(3),
        ])
        .areas(area);
        self.draw_header(frame, header);
        self.draw_table(frame, table);
        self.draw_charts(frame, charts);
        self.draw_per_worker(frame, per_worker);
        self.draw_footer(frame, footer);
    }

    fn status(&self) -> &Value {
        self.last.as_ref().unwrap_or(&Value::Null)
    }

    fn draw_header(&self, frame: &mut Frame, area: Rect) {
        let r = &self.status()["run"];
        let (state, state_style) = match (&self.lost, r["state"].as_str()) {
            (Some(_), _) => (
                "run not running".to_owned(),
                Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
            ),
            (None, Some(s)) => (s.to_owned(), Style::new().fg(Color::Green)),
            (None, None) => ("?".to_owned(), Style::new()),
        };
        let title = Line::from(vec![
            Span::raw(" dflash-orch top · "),
            Span::raw(self.run_dir.clone()),
            Span::raw(" · "),
            Span::styled(state, state_style),
            Span::raw(" "),
        ]);
        let epochs = r["epochs"].as_u64();
        let epoch = match (r["epoch"].as_u64(), epochs) {
            (Some(e), Some(n)) => format!("{}/{n}", (e + 1).min(n)),
            (Some(e), None) => format!("{}/-", e + 1),
            _ => "-".into(),
        };
        let mut facts = vec![
            format!("epoch {epoch}"),
            format!("committed steps {}", num(&r["committed_steps"])),
            format!("stage {}", r["stage"].as_str().unwrap_or("-")),
            format!("up {}", r["uptime_s"].as_f64().map_or("-".into(), duration)),
            format!(
                "average {}",
                r["tokens_per_s"]
                    .as_f64()
                    .map_or("-".into(), |t| si_unit(t, "tok/s"))
            ),
        ];
        if let Some(seen) = self.last_seen {
            facts.push(format!(
                "updated {:.0} s ago (every {} s)",
                seen.elapsed().as_secs_f64(),
                self.interval
            ));
        }
        let lines = vec![
            Line::from(r["progress"].as_str().unwrap_or("-").to_owned()),
            Line::from(facts.join(" · ")),
        ];
        frame.render_widget(
            Paragraph::new(lines).block(Block::bordered().title(title)),
            area,
        );
    }

    fn draw_table(&self, frame: &mut Frame, area: Rect) {
        let list = workers(self.status());
        let has = |key: &str| list.iter().any(|w| !w[key].is_null());
        // What fits: the columns by priority, shown in this order.
        let inner = usize::from(area.width.saturating_sub(2 + 2));
        let mut candidates: Vec<&Column> = COLUMNS
            .iter()
            .filter(|c| match c.name {
                "CPU%" => has("cpu_pct"),
                "RSS" => has("rss_bytes"),
                _ => true,
            })
            .collect();
        let wanted = candidates.len();
        let mut by_priority = candidates.clone();
        by_priority.sort_by_key(|c| c.priority);
        let mut used = 0;
        let mut shown = Vec::new();
        for c in by_priority {
            let need = usize::from(c.width) + usize::from(used > 0);
            if c.priority == 0 || used + need <= inner {
                used += need;
                shown.push(c.name);
            }
        }
        candidates.retain(|c| shown.contains(&c.name));
        let header = Row::new(candidates.iter().map(|c| Cell::from(c.name)))
            .style(Style::new().add_modifier(Modifier::BOLD));
        let rows = list.iter().map(|w| {
            let style = match w["state"].as_str() {
                Some("failed") => Style::new().fg(Color::Red),
                Some("restarting" | "starting") => Style::new().fg(Color::Yellow),
                Some("stopped") => Style::new().fg(Color::DarkGray),
                _ => Style::new(),
            };
            Row::new(candidates.iter().map(|c| Cell::from((c.cell)(w)))).style(style)
        });
        let hidden = wanted - candidates.len();
        let title = if hidden > 0 {
            format!(
                " workers ({}) · {hidden} columns hidden: widen the terminal ",
                list.len()
            )
        } else {
            format!(" workers ({}) ", list.len())
        };
        let widths = candidates.iter().map(|c| {
            if c.name == "LAST EXIT" {
                Constraint::Fill(1)
            } else {
                Constraint::Length(c.width)
            }
        });
        let table = Table::new(rows, widths)
            .header(header)
            .block(Block::bordered().title(title))
            .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
            .highlight_symbol("> ");
        let mut state = TableState::default();
        if !list.is_empty() {
            state.select(Some(self.selected.min(list.len() - 1)));
        }
        frame.render_stateful_widget(table, area, &mut state);
    }

    fn draw_charts(&self, frame: &mut Frame, area: Rect) {
        let [left, middle, right] = Layout::horizontal([Constraint::Ratio(1, 3); 3]).areas(area);
        let list = workers(self.status());
        let selected = list.get(self.selected);
        let series = selected
            .and_then(|w| w["id"].as_u64())
            .and_then(|id| self.history.get(&id));
        let who = selected.map_or("no worker".into(), |w| {
            format!(
                "worker {} ({})",
                num(&w["id"]),
                w["role"].as_str().unwrap_or("?")
            )
        });
        let gpu = series.is_some_and(|s| s.power.iter().chain(&s.util).any(Option::is_some));
        let empty = VecDeque::new();
        if gpu {
            let s = series.expect("checked above");
            spark(
                frame,
                left,
                format!(" {who} · GPU power{} ", now(&s.power, " W")),
                &s.power,
                None,
                Color::Yellow,
            );
            spark(
                frame,
                middle,
                format!(" GPU utilization{} ", now(&s.util, "%")),
                &s.util,
                Some(100),
                Color::Green,
            );
        } else {
            let cpu = series.map_or(&empty, |s| &s.cpu);
            let title = if cpu.iter().any(Option::is_some) {
                format!(" {who} · CPU{} ", now(cpu, "%"))
            } else {
                format!(" {who} · no GPU or CPU samples ")
            };
            let both = Rect {
                width: left.width + middle.width,
                ..left
            };
            let peak = cpu.iter().flatten().copied().max().unwrap_or(0).max(100);
            spark(frame, both, title, cpu, Some(peak), Color::Green);
        }
        let tps = self.throughput.back().copied().flatten();
        spark(
            frame,
            right,
            format!(
                " run throughput{} ",
                tps.map_or(String::new(), |t| format!(
                    ": {}",
                    si_unit(t as f64, "tok/s")
                ))
            ),
            &self.throughput,
            None,
            Color::Cyan,
        );
    }

    /// One line per worker: its GPU utilization, else its CPU, else the batches it finished per
    /// refresh.
    fn draw_per_worker(&self, frame: &mut Frame, area: Rect) {
        let block = Block::bordered().title(
            " per worker: GPU utilization % (gpu), CPU % (cpu) or batches per refresh (batches) ",
        );
        let inner = block.inner(area);
        frame.render_widget(block, area);
        let list = workers(self.status());
        let label_width = 24.min(inner.width);
        for (i, w) in list.iter().enumerate() {
            let Ok(y) = u16::try_from(i) else { break };
            if y >= inner.height {
                break;
            }
            let series = w["id"].as_u64().and_then(|id| self.history.get(&id));
            let some = |d: &VecDeque<Option<u64>>| d.iter().any(Option::is_some);
            let (what, data, max) = match series {
                Some(s) if some(&s.util) => ("gpu", &s.util, Some(100)),
                Some(s) if some(&s.cpu) => (
                    "cpu",
                    &s.cpu,
                    Some(s.cpu.iter().flatten().copied().max().unwrap_or(0).max(100)),
                ),
                Some(s) => ("batches", &s.batches, None),
                None => continue,
            };
            let line = Rect {
                y: inner.y + y,
                height: 1,
                ..inner
            };
            let label = format!(
                "{:>3} {:<8} {:<8}",
                num(&w["id"]),
                w["role"].as_str().unwrap_or("?"),
                what
            );
            let selected = i == self.selected;
            let style = if selected {
                Style::new().add_modifier(Modifier::REVERSED)
            } else {
                Style::new()
            };
            frame.render_widget(
                Paragraph::new(label).style(style),
                Rect {
                    width: label_width,
                    ..line
                },
            );
            let bars = Rect {
                x: line.x + label_width,
                width: line.width - label_width,
                ..line
            };
            let skip = data.len().saturating_sub(usize::from(bars.width));
            let mut widget = Sparkline::default()
                .data(data.iter().skip(skip).map(SparklineBar::from))
                .style(Style::new().fg(Color::Green));
            if let Some(max) = max {
                widget = widget.max(max.max(1));
            }
            frame.render_widget(widget, bars);
        }
    }

    fn draw_footer(&self, frame: &mut Frame, area: Rect) {
        let mut lines = Vec::new();
        let mut status = Vec::new();
        if let Some(why) = &self.lost {
            status.push(Span::styled(
                format!("run not running ({why}); showing the last screen"),
                Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
            ));
        }
        if let Some(m) = &self.message {
            if !status.is_empty() {
                status.push(Span::raw(" · "));
            }
            status.push(Span::styled(
                m.clone(),
                Style::new().add_modifier(Modifier::BOLD),
            ));
        }
        lines.push(Line::from(status));
        let reasons: BTreeSet<&str> = workers(self.status())
            .iter()
            .filter(|w| w["gpu_power_w"].is_null())
            .filter_map(|w| w["gpu_unavailable"].as_str())
            .collect();
        if !reasons.is_empty() {
            lines.push(Line::from(format!(
                "GPU telemetry unavailable: {}",
                reasons.into_iter().collect::<Vec<_>>().join("; ")
            )));
        }
        lines.push(Line::styled(
            "↑/↓ k/j select · r restart after its current job · R restart at once · q quit",
            Style::new().fg(Color::DarkGray),
        ));
        // The key help stays on the last line however many lines come before it.
        let skip = lines.len().saturating_sub(usize::from(area.height));
        frame.render_widget(Paragraph::new(lines.split_off(skip)), area);
    }
}

/// A column of the worker table: the narrower the terminal, the fewer columns, highest
/// `priority` (least needed) first out.
struct Column {
    name: &'static str,
    width: u16,
    priority: u8,
    cell: fn(&Value) -> String,
}

const COLUMNS: [Column; 15] = [
    Column {
        name: "ID",
        width: 3,
        priority: 0,
        cell: |w| num(&w["id"]),
    },
    Column {
        name: "ROLE",
        width: 7,
        priority: 0,
        cell: |w| text(&w["role"]),
    },
    Column {
        name: "DEVICE",
        width: 6,
        priority: 0,
        cell: |w| text(&w["device"]),
    },
    Column {
        name: "PID",
        width: 7,
        priority: 5,
        cell: |w| num(&w["pid"]),
    },
    Column {
        name: "STATE",
        width: 10,
        priority: 0,
        cell: |w| text(&w["state"]),
    },
    Column {
        name: "BATCHES",
        width: 7,
        priority: 1,
        cell: |w| num(&w["batches_done"]),
    },
    Column {
        name: "RESTARTS",
        width: 8,
        priority: 1,
        cell: |w| num(&w["restarts"]),
    },
    Column {
        name: "HEARTBEAT",
        width: 9,
        priority: 3,
        cell: |w| {
            w["heartbeat_age_s"]
                .as_f64()
                .map_or("-".into(), |a| format!("{a:.1} s"))
        },
    },
    Column {
        name: "CPU%",
        width: 5,
        priority: 2,
        cell: |w| {
            w["cpu_pct"]
                .as_f64()
                .map_or("-".into(), |c| format!("{c:.0}"))
        },
    },
    Column {
        name: "RSS",
        width: 9,
        priority: 6,
        cell: |w| w["rss_bytes"].as_f64().map_or("-".into(), bytes),
    },
    Column {
        name: "POWER",
        width: 6,
        priority: 2,
        cell: |w| {
            w["gpu_power_w"]
                .as_f64()
                .map_or("-".into(), |p| format!("{p:.0} W"))
        },
    },
    Column {
        name: "UTIL",
        width: 4,
        priority: 2,
        cell: |w| {
            w["gpu_utilization_pct"]
                .as_f64()
                .map_or("-".into(), |u| format!("{u:.0}%"))
        },
    },
    Column {
        name: "GPU MEM",
        width: 13,
        priority: 6,
        cell: gpu_memory,
    },
    Column {
        name: "TEMP",
        width: 5,
        priority: 7,
        cell: |w| {
            w["gpu_temperature_c"]
                .as_f64()
                .map_or("-".into(), |t| format!("{t:.0} C"))
        },
    },
    Column {
        name: "LAST EXIT",
        width: 12,
        priority: 4,
        cell: |w| w["last_exit"].as_str().unwrap_or("-").to_owned(),
    },
];

fn workers(status: &Value) -> &[Value] {
    status["workers"].as_array().map_or(&[], Vec::as_slice)
}

fn spark(
    frame: &mut Frame,
    area: Rect,
    title: String,
    data: &VecDeque<Option<u64>>,
    max: Option<u64>,
    color: Color,
) {
    // Newest samples on the right; as many as fit.
    let width = usize::from(area.width.saturating_sub(2));
    let skip = data.len().saturating_sub(width);
    let bars: Vec<SparklineBar> = data.iter().skip(skip).map(SparklineBar::from).collect();
    let mut widget = Sparkline::default()
        .block(Block::bordered().title(title))
        .data(bars)
        .style(Style::new().fg(color));
    if let Some(max) = max {
        widget = widget.max(max.max(1));
    }
    frame.render_widget(widget, area);
}

fn now(series: &VecDeque<Option<u64>>, unit: &str) -> String {
    series
        .back()
        .copied()
        .flatten()
        .map_or(String::new(), |v| format!(": {v}{unit}"))
}

fn num(v: &Value) -> String {
    match v {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        _ => "-".into(),
    }
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or("-").to_owned()
}

fn gpu_memory(w: &Value) -> String {
    let gb = |mb: f64| mb / 1000.0;
    match (
        w["gpu_memory_used_mb"].as_f64(),
        w["gpu_memory_total_mb"].as_f64(),
    ) {
        (Some(u), Some(t)) => format!("{:.1}/{:.1} GB", gb(u), gb(t)),
        (Some(u), None) => format!("{:.1} GB", gb(u)),
        _ => "-".into(),
    }
}

/// `1.2 K`, `3.4 M`: a rate at a glance.
fn si(v: f64) -> String {
    match v.abs() {
        a if a >= 1e9 => format!("{:.1} G", v / 1e9),
        a if a >= 1e6 => format!("{:.1} M", v / 1e6),
        a if a >= 1e3 => format!("{:.1} K", v / 1e3),
        _ => format!("{v:.0}"),
    }
}

/// [`si`] followed by a unit: `1.2 Ktok/s`, `950 tok/s`.
fn si_unit(v: f64, unit: &str) -> String {
    let s = si(v);
    if s.ends_with(|c: char| c.is_ascii_digit()) {
        format!("{s} {unit}")
    } else {
        format!("{s}{unit}")
    }
}

fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b.max(0.0);
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn duration(s: f64) -> String {
    let s = if s.is_finite() { s.max(0.0) as u64 } else { 0 };
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    if h > 0 {
        format!("{h}h{m:02}m{s:02}s")
    } else {
        format!("{m}m{s:02}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;
    use serde_json::json;

    fn screen(view: &View, width: u16, height: u16) -> String {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
        terminal.draw(|f| view.draw(f)).unwrap();
        let buffer = terminal.backend().buffer();
        let mut out = String::new();
        for y in 0..buffer.area.height {
            for x in 0..buffer.area.width {
                out.push_str(buffer[(x, y)].symbol());
            }
            out.push('\n');
        }
        out
    }

    fn row<'a>(screen: &'a str, needle: &str) -> &'a str {
        screen
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in\n{screen}"))
    }

    fn run_json() -> Value {
        json!({
            "run_dir": "/runs/a",
            "state": "running",
            "epoch": 0,
            "epochs": 2,
            "batch": 17,
            "batches": 80,
            "committed_steps": 17,
            "uptime_s": 3725.0,
            "tokens_per_s": 123456.0,
            "stage": "synthetic",
            "progress": "epoch 1/2 · batch 17/160 · 123.5 Ktok/s · ETA 0m12s",
        })
    }

    fn cpu_status() -> Value {
        let worker = |id: u32, role: &str, pid: u32, cpu: Value| {
            json!({
                "id": id, "role": role, "device": format!("cpu:{id}"), "gpu": null,
                "pid": pid, "state": "busy", "cpus": [id], "batches_done": 10 + id,
                "restarts": id, "last_exit": if id == 1 { json!("killed by SIGKILL") } else { json!(null) },
                "heartbeat_age_s": 0.25, "gpu_power_w": null, "gpu_utilization_pct": null,
                "gpu_memory_used_mb": null, "gpu_memory_total_mb": null, "gpu_temperature_c": null,
                "gpu_unavailable": "CPU worker", "cpu_pct": cpu, "rss_bytes": 52_428_800,
            })
        };
        json!({
            "run": run_json(),
            "workers": [
                worker(0, "target", 4101, json!(97.5)),
                worker(1, "target", 4102, json!(null)),
                worker(2, "drafter", 4103, json!(180.0)),
            ],
        })
    }

    fn gpu_status(power: f64) -> Value {
        let worker = |id: u32, role: &str| {
            json!({
                "id": id, "role": role, "device": format!("gpu:{id}"), "gpu": id,
                "pid": 5000 + id, "state": "ready", "cpus": [0, 1], "batches_done": 3,
                "restarts": 0, "last_exit": null, "heartbeat_age_s": 1.5,
                "gpu_power_w": power + f64::from(id), "gpu_utilization_pct": 87,
                "gpu_memory_used_mb": 71_234, "gpu_memory_total_mb": 143_771,
                "gpu_temperature_c": 64, "gpu_unavailable": null,
            })
        };
        json!({"run": run_json(), "workers": [worker(0, "target"), worker(1, "drafter")]})
    }

    #[test]
    fn cpu_workers_show_rows_dashes_and_the_reason_once() {
        let mut view = View::new(Path::new("/runs/a"), 1.0);
        view.update(cpu_status());
        let s = screen(&view, 200, 40);
        let r0 = row(&s, "4101");
        assert!(r0.contains("target") && r0.contains("cpu:0") && r0.contains("busy"));
        assert!(r0.contains("98") && r0.contains("50.0 MiB"), "{r0}");
        assert!(r0.contains(" - "), "GPU columns are dashes: {r0}");
        let r1 = row(&s, "4102");
        assert!(r1.contains("killed by SIGKILL"), "{r1}");
        assert!(row(&s, "4103").contains("drafter"));
        assert!(
            s.contains("epoch 1/2 · batch 17/160"),
            "progress line:\n{s}"
        );
        assert!(s.contains("committed steps 17"));
        assert!(s.contains("up 1h02m05s"), "{s}");
        assert!(s.contains("average 123.5 Ktok/s"), "{s}");
        assert_eq!(
            s.matches("GPU telemetry unavailable: CPU worker").count(),
            1
        );
        assert!(s.contains("CPU: 98%"), "CPU sparkline of worker 0:\n{s}");
        assert!(s.contains("run throughput"));
        assert!(!s.contains("run not running"));
        // Selection is drawn on the first worker.
        assert!(row(&s, "4101").contains("> "));
    }

    #[test]
    fn gpu_workers_show_power_utilization_memory_and_temperature() {
        let mut view = View::new(Path::new("/runs/a"), 1.0);
        for p in 0..80 {
            view.update(gpu_status(200.0 + f64::from(p)));
        }
        assert_eq!(view.history[&0].power.len(), HISTORY);
        assert_eq!(view.throughput.len(), HISTORY);
        let s = screen(&view, 200, 40);
        let r = row(&s, "5001");
        assert!(r.contains("drafter") && r.contains("gpu:1"), "{r}");
        assert!(r.contains("280 W") && r.contains("87%"), "{r}");
        assert!(r.contains("71.2/143.8 GB") && r.contains("64 C"), "{r}");
        assert!(!s.contains("GPU telemetry unavailable"));
        assert!(!s.contains("CPU%"), "no CPU column without cpu_pct:\n{s}");
        assert!(s.contains("GPU power: 279 W"), "{s}");
        assert!(s.contains("GPU utilization: 87%"), "{s}");
    }

    #[test]
    fn keys_select_and_ask_for_restarts() {
        let mut view = View::new(Path::new("/runs/a"), 1.0);
        view.update(cpu_status());
        let press = |c| KeyEvent::new(c, KeyModifiers::NONE);
        assert_eq!(view.key(press(KeyCode::Down)), Action::None);
        assert_eq!(view.selected_worker(), Some(1));
        assert_eq!(
            view.key(KeyEvent::new(KeyCode::Char('R'), KeyModifiers::SHIFT)),
            Action::Restart {
                worker: 1,
                force: true
            }
        );
        view.key(press(KeyCode::Char('j')));
        view.key(press(KeyCode::Char('j')));
        assert_eq!(view.selected_worker(), Some(2));
        assert_eq!(
            view.key(press(KeyCode::Char('r'))),
            Action::Restart {
                worker: 2,
                force: false
            }
        );
        view.key(press(KeyCode::Char('k')));
        view.key(press(KeyCode::Up));
        view.key(press(KeyCode::Up));
        assert_eq!(view.selected_worker(), Some(0));
        for quit in [
            press(KeyCode::Char('q')),
            press(KeyCode::Esc),
            KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL),
        ] {
            assert_eq!(view.key(quit), Action::Quit);
        }
        view.restart_answer(1, true, &Ok(json!({"ok": true, "worker": 1})));
        assert!(screen(&view, 200, 40).contains("restart worker 1 at once: ok"));
    }

    #[test]
    fn a_lost_run_keeps_the_last_screen_and_refuses_restarts() {
        let mut view = View::new(Path::new("/runs/a"), 1.0);
        view.update(cpu_status());
        view.lost(&ClientError::NotRunning("/runs/a".into()));
        let s = screen(&view, 200, 40);
        assert!(s.contains("run not running"), "{s}");
        assert!(s.contains("4101") && s.contains("4103"));
        assert_eq!(view.key(KeyEvent::from(KeyCode::Char('R'))), Action::None);
        assert!(screen(&view, 200, 40).contains("nothing to restart"));
        // It answers again: live again.
        view.update(cpu_status());
        assert!(!screen(&view, 200, 40).contains("run not running"));
    }

    #[test]
    fn missing_or_odd_fields_do_not_panic() {
        let odd = [
            json!(null),
            json!({}),
            json!({"run": 5, "workers": {}}),
            json!({"run": {"epoch": "x", "uptime_s": -5.0, "tokens_per_s": "fast"}}),
            json!({"workers": [{}, 3, null, {"id": "x", "restarts": null}]}),
            json!({"workers": [{"id": 7, "gpu_power_w": -1.0, "cpu_pct": 1e300, "rss_bytes": -4}]}),
            json!({"workers": [{"id": 18_446_744_073_709_551_615u64, "gpu_memory_used_mb": 5}]}),
        ];
        for status in odd {
            let mut view = View::new(Path::new("/x"), 0.5);
            view.update(status.clone());
            for key in [
                KeyCode::Down,
                KeyCode::Down,
                KeyCode::End,
                KeyCode::Char('R'),
            ] {
                let _ = view.key(KeyEvent::from(key));
            }
            for (w, h) in [(200, 50), (80, 24), (20, 5), (1, 1), (0, 0)] {
                let _ = screen(&view, w, h);
            }
            view.update(json!({}));
            let _ = screen(&view, 80, 24);
        }
        // Nothing received yet.
        let _ = screen(&View::new(Path::new("/x"), 1.0), 80, 24);
    }

    #[test]
    fn throughput_and_batches_are_rates_between_answers() {
        let mut view = View::new(Path::new("/runs/a"), 1.0);
        let at = |uptime: f64, tps: f64, done: u64| {
            let mut s = cpu_status();
            s["run"]["uptime_s"] = json!(uptime);
            s["run"]["tokens_per_s"] = json!(tps);
            s["workers"][0]["batches_done"] = json!(done);
            s
        };
        view.update(at(10.0, 100.0, 4));
        assert_eq!(view.throughput.back(), Some(&Some(100)));
        view.update(at(20.0, 150.0, 9));
        // 1000 tokens at 10 s, 3000 at 20 s.
        assert_eq!(view.throughput.back(), Some(&Some(200)));
        assert_eq!(view.history[&0].batches.back(), Some(&Some(5)));
        // A resumed run starts its uptime again: its average stands in.
        view.update(at(2.0, 50.0, 9));
        assert_eq!(view.throughput.back(), Some(&Some(50)));
        let s = screen(&view, 200, 40);
        assert!(
            row(&s, "CPU: 98%").contains("run throughput: 50 tok/s"),
            "{s}"
        );
        let per_worker = row(&s, "  1 target   batches");
        assert!(per_worker.contains('│'), "{per_worker}");
        let bars = |l: &str| l.chars().any(|c| ('▁'..='█').contains(&c));
        assert!(bars(row(&s, "  0 target   cpu")), "{s}");
    }

    #[test]
    fn a_narrow_terminal_hides_the_least_needed_columns() {
        let mut view = View::new(Path::new("/runs/a"), 1.0);
        view.update(cpu_status());
        let wide = screen(&view, 200, 40);
        assert!(!wide.contains("hidden"), "{wide}");
        let s = screen(&view, 80, 24);
        assert!(s.contains("columns hidden"), "{s}");
        for (role, needles) in [
            ("target", ["0", "cpu:0", "busy"]),
            ("drafter", ["2", "cpu:2", "busy"]),
        ] {
            let r = row(&s, role);
            assert!(needles.iter().all(|n| r.contains(n)), "{r}");
        }
        assert!(!s.contains("TEMP") && s.contains("RESTARTS"), "{s}");
    }

    #[test]
    fn numbers_read_at_a_glance() {
        assert_eq!(si(950.0), "950");
        assert_eq!(si(123_456.0), "123.5 K");
        assert_eq!(si_unit(123_456.0, "tok/s"), "123.5 Ktok/s");
        assert_eq!(si_unit(950.0, "tok/s"), "950 tok/s");
        assert_eq!(bytes(52_428_800.0), "50.0 MiB");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(duration(59.9), "0m59s");
        assert_eq!(duration(3725.0), "1h02m05s");
        assert_eq!(duration(f64::NAN), "0m00s");
    }
}
