//! `dflash-orch top`: a live terminal view of the run's workers.
//!
//! Polls the orchestrator over its control socket (the same `status` request as `dflash-orch
//! status`) every `--interval` seconds on a thread of its own, so the screen keeps answering keys
//! while the run is slow to reply. What is drawn is a pure function of [`View`], which the tests
//! render into ratatui's `TestBackend`.
//!
//! This module is the terminal plumbing (raw mode, the poller and restart threads, keys);
//! [`view`] holds the state and what keys do to it, `draw` turns it into widgets.

mod draw;
#[cfg(test)]
mod tests;
mod view;

pub use view::{Action, View};

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use clap::Args;
use ratatui::crossterm::event::{self, Event};
use serde_json::Value;

use super::status::client_error;
use crate::error::CliError;
use crate::runtime::control::{self, ClientError, Request};
use view::restart_when;

#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,

    /// Refresh every SECS seconds, 0.05 to 3600.
    #[arg(long, value_name = "SECS", default_value_t = 1.0, value_parser = crate::options::interval())]
    pub interval: f64,
}

pub fn run(args: TopArgs) -> Result<(), CliError> {
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
