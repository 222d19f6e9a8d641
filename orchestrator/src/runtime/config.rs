//! What defines a run: its options as the journal's first line keeps them, read back by a
//! resume.

use std::path::PathBuf;

use dflash_common::dflash::DflashSettings;
use serde::{Deserialize, Serialize};

use dflash_common::dflash::NonFinite;

use super::{STOP_GRACE, eval};
use crate::planner::PlanConfig;

/// Everything that defines a run; written to the journal's first line and read back by a resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub gpus: String,
    pub topology: Option<String>,
    pub data: Option<PathBuf>,
    pub synthetic: Option<usize>,
    pub synthetic_seed: u64,
    pub stage: String,
    pub synthetic_us_per_token: f64,
    /// The synthetic stage's drafter: microseconds it spends per token trained.
    #[serde(default)]
    pub synthetic_drafter_us_per_token: f64,
    pub epochs: u32,
    pub planner: PlannerSettings,
    pub max_restarts: u32,
    pub restart_window_s: f64,
    pub heartbeat_timeout_s: f64,
    pub heartbeat_ms: u64,
    /// Seconds between monitor readings (GPUs, worker processes).
    #[serde(default = "default_monitor_interval")]
    pub monitor_interval_s: f64,
    /// The Prometheus endpoint's address (`--metrics-addr`).
    #[serde(default)]
    pub metrics_addr: Option<String>,
    /// The DFlash stage's settings (`--stage dflash`).
    #[serde(default)]
    pub dflash: Option<DflashSettings>,
    /// A job running longer than this is taken for a hang (`--job-timeout`); `None`: auto.
    #[serde(default)]
    pub job_timeout_s: Option<f64>,
    /// How long stopping workers may take (the drafter's final checkpoint) before they are
    /// killed (`--stop-grace`).
    #[serde(default = "default_stop_grace")]
    pub stop_grace_s: f64,
    /// Served-acceptance evaluations during training (`--eval-every`).
    #[serde(default)]
    pub eval: Option<eval::EvalConfig>,
    /// This node's place in a run of several (`--nodes`, `--node-rank`, `--rendezvous`).
    #[serde(default)]
    pub nodes: Option<super::nodes::NodeConfig>,
}

fn default_stop_grace() -> f64 {
    STOP_GRACE.as_secs_f64()
}

impl RunConfig {
    /// The settings that decide the trained weights and the plans, where `self` and `other`
    /// differ (what a resume may not change).
    pub fn weight_settings_differ(&self, other: &RunConfig) -> Vec<String> {
        let mut differ = Vec::new();
        let mut check = |name: &str, same: bool| {
            if !same {
                differ.push(name.to_string());
            }
        };
        check("data", self.data == other.data);
        check(
            "synthetic workload",
            (self.synthetic, self.synthetic_seed) == (other.synthetic, other.synthetic_seed),
        );
        check("stage", self.stage == other.stage);
        check("epochs", self.epochs == other.epochs);
        check("planner settings", self.planner == other.planner);
        let dflash = |c: &RunConfig| {
            c.dflash.as_ref().map(|d| {
                let mut d = d.clone();
                // Filled in at launch.
                d.fingerprint.clear();
                d.total_steps = 0;
                d.token_budget = 0;
                d.checkpoint_dir = PathBuf::new();
                // May change on resume.
                d.on_nonfinite = NonFinite::default();
                d.eval_every = None;
                d.torch = None;
                d
            })
        };
        check("DFlash settings", dflash(self) == dflash(other));
        // Held-out samples are left out of the plans.
        let holdout = |c: &RunConfig| c.eval.as_ref().map_or(0, |e| e.holdout);
        check("held-out samples", holdout(self) == holdout(other));
        // Every node's drafters sum their gradients in one order: the nodes and this node's
        // place among them stay.
        let place = |c: &RunConfig| c.nodes.as_ref().map(|n| (n.nodes, n.rank));
        check("nodes", place(self) == place(other));
        differ
    }
}

fn default_monitor_interval() -> f64 {
    1.0
}

/// The planner options, as text (how they are written on the command line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerSettings {
    pub mode: String,
    pub interleave: String,
    pub buckets: String,
    pub token_budget: u64,
    pub max_len: u32,
    pub on_overlong: String,
    pub accum: u32,
    pub seed: u64,
}

impl PlannerSettings {
    pub fn from_config(c: &PlanConfig) -> Self {
        Self {
            mode: c.mode.name().into(),
            interleave: c.interleave.name().into(),
            buckets: c.buckets.to_string(),
            token_budget: c.token_budget,
            max_len: c.max_len,
            on_overlong: c.on_overlong.name().into(),
            accum: c.accum,
            seed: c.seed,
        }
    }

    pub fn to_config(&self) -> Result<PlanConfig, String> {
        let e = |e: crate::planner::PlanError| e.to_string();
        let config = PlanConfig {
            mode: self.mode.parse().map_err(e)?,
            interleave: self.interleave.parse().map_err(e)?,
            buckets: self.buckets.parse().map_err(e)?,
            token_budget: self.token_budget,
            max_len: self.max_len,
            on_overlong: self.on_overlong.parse().map_err(e)?,
            accum: self.accum,
            seed: self.seed,
        };
        config.validate().map_err(e)?;
        Ok(config)
    }
}
