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
            eta_text((left as f64 / rate).min(1e12) as u64)
        } else {
            "-".into()
        };
        let mut line = format!(
            "epoch {}/{} · batch {}/{} · {:.1} Ktok/s",
            (self.epoch + 1).min(self.config.epochs),
            self.config.epochs,
            self.committed_total,
            total,
            self.tokens_committed as f64 / elapsed / 1000.0
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

    /// Shows progress on stderr: redrawn in place on a terminal, a line every 10 s otherwise.
    pub(super) fn progress(&mut self, last: bool) {
        use std::io::IsTerminal;
        let tty = std::io::stderr().is_terminal();
        let every = if tty {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(10)
        };
        if !last && self.last_progress.elapsed() < every {
            return;
        }
        self.last_progress = Instant::now();
        let line = self.progress_line();
        if tty {
            eprint!("\r\x1b[2K{line}{}", if last { "\n" } else { "" });
        } else {
            eprintln!("{line}");
        }
    }
}

/// A time to go, in days and hours for multi-day runs: `2d07h`, `5h12m`, `3m05s`.
pub fn eta_text(seconds: u64) -> String {
    let (d, h, m, s) = (
        seconds / 86_400,
        seconds / 3600 % 24,
        seconds / 60 % 60,
        seconds % 60,
    );
    if d > 0 {
        format!("{d}d{h:02}h")
    } else if h > 0 {
        format!("{h}h{m:02}m")
    } else {
        format!("{m}m{s:02}s")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn eta_reads_in_days_and_hours_for_long_runs() {
        assert_eq!(super::eta_text(185), "3m05s");
        assert_eq!(super::eta_text(5 * 3600 + 12 * 60 + 59), "5h12m");
        assert_eq!(super::eta_text(2 * 86_400 + 7 * 3600 + 1), "2d07h");
    }
}
