//! Fault injection for tests and the soak script: a worker that hangs inside a job while its
//! heartbeat thread keeps reporting it alive, the one failure that only the orchestrator's job
//! timeout can catch. Off unless the environment asks for it:
//!
//! - `DFLASH_WORKER_FAULTS=1`: SIGUSR1 arms a hang; the next Forward or Train job (or the one
//!   that arrives right after the signal) disarms it and never finishes. Without the variable
//!   SIGUSR1 keeps its default action (the process ends).
//! - `DFLASH_WORKER_HANG_EVERY_JOB=1`: every Forward and Train job hangs, so a run whose jobs
//!   always time out can be shown to end through its restart budget.
//! - `DFLASH_WORKER_POISON_TOKEN=ID`: a DFlash target worker writes NaN into the features of
//!   every position holding token ID (at its first target layer), as a diverging target would:
//!   what `--on-nonfinite` handles.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Arms a hang on SIGUSR1 when set to `1`.
pub const FAULTS_ENV: &str = "DFLASH_WORKER_FAULTS";
/// Hangs every job when set to `1`.
pub const HANG_EVERY_JOB_ENV: &str = "DFLASH_WORKER_HANG_EVERY_JOB";

/// Poisons the features of a token when set to its id.
pub const POISON_TOKEN_ENV: &str = "DFLASH_WORKER_POISON_TOKEN";

/// The token whose features a target worker poisons, when the environment names one.
pub fn poison_token() -> Option<u32> {
    std::env::var(POISON_TOKEN_ENV).ok()?.trim().parse().ok()
}

/// The faults this worker injects, as its environment asked.
#[derive(Debug, Default)]
pub struct Faults {
    /// Set by the SIGUSR1 handler; `None` when no handler is installed.
    hang_requested: Option<Arc<AtomicBool>>,
    hang_every_job: bool,
}

fn enabled(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| v == "1")
}

impl Faults {
    /// Reads the environment; installs the SIGUSR1 handler when `DFLASH_WORKER_FAULTS=1`.
    pub fn from_env() -> io::Result<Self> {
        Self::new(enabled(FAULTS_ENV), enabled(HANG_EVERY_JOB_ENV))
    }

    /// Installs the SIGUSR1 handler if `on_signal`; hangs every job if `every_job`.
    pub fn new(on_signal: bool, every_job: bool) -> io::Result<Self> {
        let mut faults = Self {
            hang_requested: None,
            hang_every_job: every_job,
        };
        if on_signal {
            let flag = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(signal_hook::consts::SIGUSR1, Arc::clone(&flag))?;
            faults.hang_requested = Some(flag);
        }
        Ok(faults)
    }

    /// Whether the job that just arrived is to hang; disarms a hang SIGUSR1 asked for.
    pub fn hang_now(&self) -> bool {
        // Relaxed: the flag publishes nothing else; the handler only sets it.
        let requested = self
            .hang_requested
            .as_ref()
            .is_some_and(|flag| flag.swap(false, Ordering::Relaxed));
        requested || self.hang_every_job
    }
}

/// Never returns: the job in progress hangs (the heartbeat thread carries on).
pub fn hang(job: &str) -> ! {
    tracing::warn!("fault injection: hanging inside {job}");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigusr1_arms_one_hang() {
        let faults = Faults::new(true, false).unwrap();
        assert!(!faults.hang_now());
        // A real signal to this process: the handler, not the default action, receives it.
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGUSR1).unwrap();
        assert!(faults.hang_now());
        assert!(!faults.hang_now(), "disarmed by the job that hung");
    }

    #[test]
    fn hang_every_job_hangs_every_job() {
        let every = Faults::new(false, true).unwrap();
        assert!(every.hang_now() && every.hang_now());
        assert!(!Faults::new(false, false).unwrap().hang_now());
    }
}
