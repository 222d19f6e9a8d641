//! `dflash-orch top`: a live terminal view of the run's workers.

use std::path::PathBuf;

use clap::Args;

use crate::cli::CliError;

#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,
}

pub fn run(_args: TopArgs) -> Result<(), CliError> {
    Err(CliError::Invalid("top is not built yet".into()))
}
