//! `dflash-orch launch`: start (or resume) a run and drive it to its end.

use std::path::PathBuf;

use clap::Args;

use super::plan::{PlannerFlags, config_from_args};
use crate::cli::CliError;
use crate::runtime::{self, Outcome, PlannerSettings, RunConfig, RunError};
use dflash_common::dflash::DflashSettings;

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

    /// What the workers compute: dflash (targets run --target-model, the drafter trains on their
    /// hidden states), or synthetic (for tests and benchmarks: moves every token through both
    /// rings and verifies it; no model).
    #[arg(long, value_name = "STAGE", default_value = "synthetic")]
    pub stage: String,

    /// Synthetic stage: microseconds a target spends per token.
    #[arg(long, value_name = "US", default_value_t = 0.0)]
    pub synthetic_us_per_token: f64,

    /// T:D, T target workers and D drafter workers [default: all but one are targets].
    #[arg(long, value_name = "T:D")]
    pub topology: Option<String>,

    /// Epochs to train.
    #[arg(long, value_name = "N", default_value_t = 6)]
    pub epochs: u32,

    #[command(flatten)]
    pub planner: PlannerFlags,

    #[command(flatten)]
    pub dflash: DflashFlags,

    /// Restarts a worker may need within --restart-window before the run fails.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub max_restarts: u32,

    /// The window of --max-restarts, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub restart_window: f64,

    /// A worker silent for this long is killed and restarted (hung, e.g. SIGSTOP).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub heartbeat_timeout: f64,

    /// Seconds between monitor readings: GPU power, utilization, memory, temperature, clocks and
    /// throttling through NVML, and every worker's CPU and memory.
    #[arg(long, value_name = "SECS", default_value_t = 1.0)]
    pub monitor_interval: f64,

    /// Serve Prometheus metrics on GET /metrics at PORT (on 127.0.0.1) or HOST:PORT (port 0
    /// picks a free one; `status` shows it).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,

    /// Continue the run in --run-dir from its journal (its options come from the journal).
    #[arg(long)]
    pub resume: bool,
}

/// The DFlash stage's options (`--stage dflash`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "DFlash stage (--stage dflash)")]
pub struct DflashFlags {
    /// The target model: a Hugging Face directory of a Qwen3 model (config.json and
    /// model.safetensors or a sharded index).
    #[arg(long, value_name = "DIR")]
    pub target_model: Option<PathBuf>,

    /// Target layers whose hidden states feed the drafter, e.g. 1,9,17,25,33 [default: one per
    /// drafter layer, spread evenly from layer 1 to L-3].
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub target_layer_ids: Option<Vec<usize>>,

    /// Decoder layers of the drafter.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub draft_layers: usize,

    /// Tokens per draft block (the anchor and block-1 mask tokens).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub block_size: usize,

    /// Blocks sampled per sequence at each step.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub num_anchors: usize,

    /// The mask token of the blocks [default: the last id of the target's vocabulary].
    #[arg(long, value_name = "ID")]
    pub mask_token_id: Option<u32>,

    /// Peak learning rate.
    #[arg(long, value_name = "LR", default_value_t = 6e-4)]
    pub lr: f64,

    /// Fraction of the optimiser steps spent warming up (then cosine decay).
    #[arg(long, value_name = "R", default_value_t = 0.04)]
    pub warmup_ratio: f64,

    /// Gradient clipping: maximum global norm.
    #[arg(long, value_name = "NORM", default_value_t = 1.0)]
    pub clip: f64,

    /// Loss decay over block positions, exp(-(k-1)/GAMMA) [default: none, uniform].
    #[arg(long, value_name = "GAMMA")]
    pub gamma: Option<f64>,

    /// AdamW weight decay.
    #[arg(long, value_name = "WD", default_value_t = 0.01)]
    pub weight_decay: f64,

    /// Write a checkpoint every N optimiser steps (and at the end).
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub save_every: u64,

    /// Checkpoints to keep.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub keep_checkpoints: usize,
}

impl DflashFlags {
    /// The settings, with defaults that depend on the target filled in from its config.json.
    pub fn settings(&self, seed: u64) -> Result<DflashSettings, CliError> {
        let dir = self
            .target_model
            .clone()
            .ok_or_else(|| CliError::Invalid("--stage dflash needs --target-model DIR".into()))?;
        let target = dflash_common::dflash::read_config(&dir)
            .map_err(|e| CliError::Invalid(format!("--target-model {e}")))?;
        Ok(DflashSettings {
            target_model: dir.canonicalize().unwrap_or(dir),
            target_layer_ids: self.target_layer_ids.clone().unwrap_or_else(|| {
                dflash_common::dflash::default_target_layer_ids(
                    target.num_hidden_layers,
                    self.draft_layers,
                )
            }),
            draft_layers: self.draft_layers,
            block_size: self.block_size,
            num_anchors: self.num_anchors,
            mask_token_id: self
                .mask_token_id
                .unwrap_or(target.vocab_size.saturating_sub(1) as u32),
            lr: self.lr,
            warmup_ratio: self.warmup_ratio,
            clip: self.clip,
            gamma: self.gamma,
            weight_decay: self.weight_decay,
            seed,
            save_every: self.save_every,
            keep_checkpoints: self.keep_checkpoints,
            total_steps: 0,
            token_budget: 0,
            checkpoint_dir: PathBuf::new(),
        })
    }
}

pub fn run(args: LaunchArgs) -> Result<(), CliError> {
    if !(args.monitor_interval >= 0.05 && args.monitor_interval.is_finite()) {
        return Err(CliError::Invalid(
            "--monitor-interval must be at least 0.05 seconds".into(),
        ));
    }
    if let Some(addr) = &args.metrics_addr {
        crate::observe::prom::parse_addr(addr).map_err(CliError::Invalid)?;
    }
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
            monitor_interval_s: 1.0,
            metrics_addr: None,
            dflash: None,
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
        let dflash = match args.stage.as_str() {
            "dflash" => Some(args.dflash.settings(plan.seed)?),
            _ if args.dflash.target_model.is_some() => {
                return Err(CliError::Invalid(
                    "--target-model goes with --stage dflash".into(),
                ));
            }
            _ => None,
        };
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
            monitor_interval_s: args.monitor_interval,
            metrics_addr: args.metrics_addr.clone(),
            dflash,
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
