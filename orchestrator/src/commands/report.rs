//! `dflash-orch report`: one self-contained HTML page about a run.

use std::path::PathBuf;

use clap::Args;

use crate::cli::CliError;

#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,

    /// The HTML file to write.
    #[arg(long, value_name = "FILE", default_value = "report.html")]
    pub output: PathBuf,
}

pub fn run(_args: ReportArgs) -> Result<(), CliError> {
    Err(CliError::Invalid("report is not built yet".into()))
}
