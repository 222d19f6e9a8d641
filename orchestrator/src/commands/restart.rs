//! `dflash-orch restart`: restart one worker while the others keep working.

use std::path::PathBuf;

use clap::{ArgGroup, Args};

use super::status::client_error;
use crate::error::CliError;
use crate::runtime::control::{self, Request};

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("which").required(true).args(["gpu", "worker"])))]
pub struct RestartArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,

    /// The worker of this GPU (or of this CPU slot, for cpu:N runs).
    #[arg(long, value_name = "N")]
    pub gpu: Option<u32>,

    /// The worker with this id (see `status`).
    #[arg(long, value_name = "ID")]
    pub worker: Option<u32>,

    /// Kill it now (its batch goes back to the queue) instead of after its current job.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: RestartArgs) -> Result<(), CliError> {
    let request = Request::Restart {
        worker: args.worker,
        gpu: args.gpu,
        force: args.force,
    };
    let answer = control::request(&args.run_dir, &request).map_err(client_error)?;
    let Some(worker) = answer["worker"].as_u64() else {
        return Err(CliError::Failed(format!(
            "{} answered the restart without naming a worker: {}",
            dflash_common::run_dir::control_socket(&args.run_dir).display(),
            crate::format::clip(&answer.to_string(), 200)
        )));
    };
    eprintln!("restarting worker {worker}");
    Ok(())
}
