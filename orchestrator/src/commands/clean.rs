//! `dflash-orch clean`: remove a dead run's shared-memory segments.

use std::path::PathBuf;

use clap::Args;

use crate::error::CliError;
use crate::runtime;

#[derive(Debug, Clone, Args)]
pub struct CleanArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,
}

pub fn run(args: CleanArgs) -> Result<(), CliError> {
    // Refuses while the run is live (its orchestrator holds the lock).
    let _lock =
        runtime::lock_run_dir(&args.run_dir).map_err(|e| CliError::Invalid(e.to_string()))?;
    let removed = runtime::remove_recorded_segments(&args.run_dir);
    let _ = std::fs::remove_file(dflash_common::run_dir::control_socket(&args.run_dir));
    eprintln!(
        "removed {} shared-memory segment(s) of {}",
        removed.len(),
        args.run_dir.display()
    );
    Ok(())
}
