//! `dflash-orch launch`: start (or resume) a run and drive it to its end.

use std::path::PathBuf;

use clap::Args;

use super::plan::{PlannerFlags, config_from_args};
use crate::cli::CliError;
use crate::runtime::{self, Outcome, PlannerSettings, RunConfig, RunError};

#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Workers: GPU ids (0-7, 0,2,5, all) or cpu:N for N CPU workers.
    #[arg(long, value_name = "SPEC")]
    pub gpus: Option<String>,

    /// The run directory: journal, control socket, worker logs.
    #[arg(long, value_name = "DIR")]
    pub run_dir: PathBuf,

    /// A dataset store made by `dflash-orch prepare`.
    #[arg(long, value_name = "STORE")]
    pub data: Option<PathBuf>,

    /// Train on N synthetic samples (seed-shaped lengths, synthetic token ids).
    #[arg(long, value_name = "N")]
    pub synthetic: Option<usize>,

    /// Seed of the synthetic workload.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub synthetic_seed: u64,

    /// What the workers compute: synthetic (for tests and benchmarks: moves every token through
    /// both rings and verifies it; no model).
    #[arg(long, value_name = "STAGE", default_value = "synthetic")]
    pub stage: String,

    /// Synthetic stage: microseconds a target spends per token.
    #[arg(long, value_name = "US", default_value_t = 0.0)]
    pub synthetic_us_per_token: f64,

    /// T:D, T target workers and D drafter workers [default: all but one are targets].
    #[arg(long, value_name = "T:D")]
    pub topology: Option<String>,

    /// Epochs to train.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub epochs: u32,

    #[command(flatten)]
    pub planner: PlannerFlags,

    /// Restarts a worker may need within --restart-window before the run fails.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub max_restarts: u32,

    /// The window of --max-restarts, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub restart_window: f64,

    /// A worker silent for this long is killed and restarted (hung, e.g. SIGSTOP).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub heartbeat_timeout: f64,

    /// Continue the run in --run-dir from its journal (its options come from the journal).
    #[arg(long)]
    pub resume: bool,
}

pub fn run(args: LaunchArgs) -> Result<(), CliError> {
    if !(args.heartbeat_timeout > 0.0 && args.heartbeat_timeout.is_finite()) {
        return Err(CliError::Invalid(
            "--heartbeat-timeout must be positive".into(),
        ));
    }
    let config = if args.resume {
        // Taken from the journal.
        RunConfig {
            gpus: String::new(),
            topology: None,
            data: None,
            synthetic: None,
            synthetic_seed: 0,
            stage: String::new(),
            synthetic_us_per_token: 0.0,
            epochs: 0,
            planner: PlannerSettings::from_config(&Default::default()),
            max_restarts: 0,
            restart_window_s: 0.0,
            heartbeat_timeout_s: 0.0,
            heartbeat_ms: 0,
        }
    } else {
        let gpus = args.gpus.clone().ok_or_else(|| {
            CliError::Invalid("--gpus is required (e.g. --gpus 0-7 or cpu:3)".into())
        })?;
        if args.data.is_some() == args.synthetic.is_some() {
            return Err(CliError::Invalid(
                "pass exactly one of --data STORE and --synthetic N".into(),
            ));
        }
        let plan = config_from_args(&args.planner)?;
        RunConfig {
            gpus,
            topology: args.topology.clone(),
            data: args
                .data
                .as_ref()
                .map(|d| d.canonicalize().unwrap_or_else(|_| d.clone())),
            synthetic: args.synthetic,
            synthetic_seed: args.synthetic_seed,
            stage: args.stage.clone(),
            synthetic_us_per_token: args.synthetic_us_per_token.max(0.0),
            epochs: args.epochs,
            planner: PlannerSettings::from_config(&plan),
            max_restarts: args.max_restarts,
            restart_window_s: args.restart_window,
            heartbeat_timeout_s: args.heartbeat_timeout,
            heartbeat_ms: ((args.heartbeat_timeout * 1000.0 / 10.0) as u64).clamp(20, 1000),
        }
    };
    let line = |what: &str, s: &runtime::Summary| {
        eprintln!(
            "run {what}: {} steps committed in total, {} tokens this session in {:.1} s ({:.0} tokens/s), {} worker restarts; journal {}",
            s.steps,
            s.tokens,
            s.seconds,
            s.tokens as f64 / s.seconds.max(1e-9),
            s.restarts,
            dflash_common::run_dir::journal(&args.run_dir).display()
        )
    };
    match runtime::launch(config, &args.run_dir, args.resume) {
        Ok((Outcome::Completed, s)) => {
            line("completed", &s);
            Ok(())
        }
        Ok((Outcome::Stopped, s)) => {
            line("stopped (continue with --resume)", &s);
            Ok(())
        }
        Ok((Outcome::Interrupted, _)) => Err(CliError::Interrupted(format!(
            "run stopped; continue with `dflash-orch launch --resume --run-dir {}`",
            args.run_dir.display()
        ))),
        Err(RunError::Invalid(e)) => Err(CliError::Invalid(e)),
        Err(RunError::Failed(e)) => Err(CliError::Failed(format!("run failed: {e}"))),
    }
}
