//! dflash-worker: one process per GPU (or CPU slot), spawned and supervised by `dflash-orch`.
//!
//! A worker attaches to the run's shared-memory rings, runs its stage (target forward, drafter
//! training, or the synthetic stage used by tests) on the batches the orchestrator hands it, and
//! acknowledges each one. It is never started by hand: `dflash-orch launch` starts one per GPU.

use std::process::ExitCode;

use clap::Parser;
use dflash_common::exit_code;

const AFTER_HELP: &str = "\
dflash-worker is started by `dflash-orch launch`, one per GPU; run `dflash-orch launch --help` to start a run.

Exit codes:
  0  stopped on request
  1  failed while working
  2  invalid arguments";

/// One worker process of a dflash-orch run.
#[derive(Debug, Parser)]
#[command(name = "dflash-worker", version, after_help = AFTER_HELP)]
pub struct WorkerArgs {}

/// Why a worker stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("no orchestrator to serve: dflash-worker is started by `dflash-orch launch`")]
    NoOrchestrator,
}

impl WorkerError {
    pub fn exit_code(&self) -> u8 {
        match self {
            WorkerError::NoOrchestrator => exit_code::INVALID,
        }
    }
}

/// Serves the orchestrator that started this process. Without one (started by hand) there is
/// nothing to serve.
pub fn run(_args: WorkerArgs) -> Result<(), WorkerError> {
    Err(WorkerError::NoOrchestrator)
}

/// The binary's `main`.
pub fn main() -> ExitCode {
    let args = WorkerArgs::parse();
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
