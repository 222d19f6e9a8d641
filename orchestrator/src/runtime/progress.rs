//! Progress: where the run is, how fast it goes and how long it has to go, on stderr and in
//! `status`.

use std::time::{Duration, Instant};

use super::Run;

impl Run {
    /// Batches of the whole run (epochs not planned yet are estimated from the current one).
    pub(super) fn total_batches(&self) -> u64 {
        let done: u64 = self.epoch_sizes.iter().take(self.epoch as usize).sum();
        let left = u64::from(self.config.epochs.saturating_sub(self.epoch));
        done + left * self.plan.batches.len() as u64
    }

    /// The progress line: where the run is, how training goes, how fast, how long to go.
    pub fn progress_line(&self) -> String {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        let total = self.total_batches();
        let done_session = self.committed_total.saturating_sub(self.session_start);
        let rate = done_session as f64 / elapsed;
        let left = total.saturating_sub(self.committed_total);
        let eta = if rate > 0.0 {
            crate::format::clock(left as f64 / rate)
        } else {
            "-".into()
        };
        let mut line = format!(
            "epoch {}/{} · batch {}/{} · {}",
            (self.epoch + 1).min(self.config.epochs),
            self.config.epochs,
            self.committed_total,
            total,
            crate::format::rate(self.tokens_committed as f64 / elapsed, "tok/s")
        );
        if let Some(m) = &self.metrics.last {
            line.push_str(&format!(
                " · step {} · loss {:.3} · acc {:.3} · accept {:.2} · lr {:.2e}",
                m["step"],
                m["loss"].as_f64().unwrap_or(f64::NAN),
                m["accuracy"].as_f64().unwrap_or(f64::NAN),
                m["acceptance_length"].as_f64().unwrap_or(f64::NAN),
                m["lr"].as_f64().unwrap_or(f64::NAN),
            ));
        }
        if let Some(e) = &self.metrics.last_eval {
            line.push_str(&format!(
                " · τ {:.2} @{}",
                e["tau"].as_f64().unwrap_or(f64::NAN),
                e["step"]
            ));
        }
        line.push_str(&format!(" · ETA {eta}"));
        line
    }

    /// Shows progress on stderr: redrawn in place on a terminal (by `indicatif`), a line every
    /// 10 s otherwise, for logs.
    pub(super) fn progress(&mut self, last: bool) {
        let every = if self.bar.is_hidden() {
            Duration::from_secs(10)
        } else {
            Duration::from_millis(500)
        };
        if !last && self.last_progress.elapsed() < every {
            return;
        }
        self.last_progress = Instant::now();
        let line = self.progress_line();
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else if last {
            // The last line stays, on a line of its own, above what follows.
            self.bar.finish_and_clear();
            eprintln!("{line}");
        } else {
            self.bar.set_message(line);
        }
    }
}

/// The progress line's bar: the line itself as its message, drawn on stderr when it is a
/// terminal (hidden, and so silent, otherwise).
pub(super) fn bar() -> indicatif::ProgressBar {
    let bar =
        indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    bar.set_style(indicatif::ProgressStyle::with_template("{msg}").expect("valid template"));
    bar
}
