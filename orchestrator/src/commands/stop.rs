//! `dflash-orch stop`: stop the live run cleanly (continue later with `launch --resume`).

use std::path::PathBuf;

use clap::Args;

use super::status::client_error;
use crate::error::CliError;
use crate::runtime::control::{self, Request};

#[derive(Debug, Clone, Args)]
pub struct StopArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,
}

pub fn run(args: StopArgs) -> Result<(), CliError> {
    control::request(&args.run_dir, &Request::Stop).map_err(client_error)?;
    eprintln!("stopping the run in {}", args.run_dir.display());
    Ok(())
}
