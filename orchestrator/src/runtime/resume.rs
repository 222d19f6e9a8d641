//! Resuming a run: where its journal says it stands, and which options may change on the way.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::journal::{self, History};
use super::{RunConfig, RunError};
use dflash_common::run_dir;

/// Where a (resumed) run starts.
#[derive(Debug, Clone, Default)]
pub(super) struct Start {
    pub epoch: u32,
    pub batch: usize,
    pub step_base: u64,
    /// Batches of each epoch journaled so far.
    pub epoch_sizes: Vec<u64>,
}

/// What the journal of the run in a directory says: its options and where it stands.
pub(super) struct Journaled {
    pub config: RunConfig,
    pub start: Start,
    /// The last line was cut short by a crash (dropped before anything is appended).
    pub torn_tail: bool,
}

/// Reads the journal of the run in `run_dir` (no side effect).
pub(super) fn read(run_dir_path: &Path) -> Result<Journaled, RunError> {
    let journal_path = run_dir::journal(run_dir_path);
    if !journal_path.exists() {
        return Err(RunError::Invalid(format!(
            "--resume: {} holds no run (no {}); start one without --resume",
            run_dir_path.display(),
            run_dir::JOURNAL
        )));
    }
    let history = journal::read(&journal_path).map_err(|e| RunError::Invalid(e.to_string()))?;
    if history.ended.as_deref() == Some("completed") {
        return Err(RunError::Invalid(format!(
            "the run in {} already completed",
            run_dir_path.display()
        )));
    }
    let config: RunConfig =
        serde_json::from_value(history.config.clone().unwrap_or(Value::Null))
            .map_err(|e| RunError::Invalid(format!("{}: run line: {e}", journal_path.display())))?;
    Ok(Journaled {
        config,
        start: start_of(&history),
        torn_tail: history.torn_tail,
    })
}

/// The run's options as its journal recorded them (for `launch --resume` to compare flags with).
pub fn stored_config(run_dir_path: &Path) -> Result<RunConfig, RunError> {
    read(run_dir_path).map(|j| j.config)
}

fn start_of(history: &History) -> Start {
    let mut epoch = history.committed.len().saturating_sub(1) as u32;
    let mut batch = history.committed.last().copied().unwrap_or(0) as usize;
    if let Some(&batches) = history.epoch_batches.last()
        && batch as u64 == batches
    {
        epoch += 1;
        batch = 0;
    }
    let step_base = history
        .epoch_batches
        .iter()
        .take(epoch as usize)
        .sum::<u64>();
    Start {
        epoch,
        batch,
        step_base,
        epoch_sizes: history.epoch_batches.clone(),
    }
}

/// The options a resume may change: none of them decides the trained weights or the plans.
/// `--gpus` and `--topology` may change the number of target workers (plans and the drafter's
/// result do not depend on it), not the number of drafters; `--synthetic-us-per-token` is the
/// synthetic stage's speed.
pub const CHANGEABLE_ON_RESUME: &[&str] = &[
    "gpus",
    "topology",
    "metrics-addr",
    "job-timeout",
    "stop-grace",
    "heartbeat-timeout",
    "monitor-interval",
    "max-restarts",
    "restart-window",
    "synthetic-us-per-token",
];

/// Compares the run options given with `--resume` against the journal's. `given` holds, for each
/// option given on the command line (long name without dashes), its value as the journal records
/// it (`None` where the option has no journal form). Options that may change are taken; any other
/// one that differs is refused, naming it. Returns the options of this session and the changes.
pub fn merge(
    stored: RunConfig,
    given: &BTreeMap<String, Value>,
    session: &RunConfig,
) -> Result<(RunConfig, BTreeMap<String, Value>), String> {
    let stored_value = serde_json::to_value(&stored).map_err(|e| e.to_string())?;
    let mut differ = Vec::new();
    for (flag, value) in given {
        if CHANGEABLE_ON_RESUME.contains(&flag.as_str()) {
            continue;
        }
        let recorded = journal_path(flag).and_then(|path| pointer(&stored_value, path));
        if recorded.is_some_and(|r| r != value) {
            differ.push(format!(
                "--{flag} {} (the run has {})",
                compact(value),
                compact(recorded.unwrap_or(&Value::Null))
            ));
        }
    }
    if !differ.is_empty() {
        return Err(format!(
            "--resume continues the run with its own options; these differ from its journal: {}. Options that may change on resume: --{}",
            differ.join(", "),
            CHANGEABLE_ON_RESUME.join(", --")
        ));
    }
    let mut merged = stored;
    let mut changes = BTreeMap::new();
    let mut take = |flag: &str, changed: bool, value: Value| {
        if given.contains_key(flag) && changed {
            changes.insert(flag.to_string(), value);
            true
        } else {
            false
        }
    };
    if take(
        "gpus",
        merged.gpus != session.gpus,
        Value::from(session.gpus.clone()),
    ) {
        merged.gpus = session.gpus.clone();
        merged.topology = session.topology.clone();
    }
    if take(
        "topology",
        merged.topology != session.topology,
        serde_json::to_value(&session.topology).unwrap_or_default(),
    ) {
        merged.topology = session.topology.clone();
    }
    if take(
        "metrics-addr",
        merged.metrics_addr != session.metrics_addr,
        serde_json::to_value(&session.metrics_addr).unwrap_or_default(),
    ) {
        merged.metrics_addr = session.metrics_addr.clone();
    }
    if take(
        "job-timeout",
        merged.job_timeout_s != session.job_timeout_s,
        serde_json::to_value(session.job_timeout_s).unwrap_or_default(),
    ) {
        merged.job_timeout_s = session.job_timeout_s;
    }
    if take(
        "stop-grace",
        merged.stop_grace_s != session.stop_grace_s,
        Value::from(session.stop_grace_s),
    ) {
        merged.stop_grace_s = session.stop_grace_s;
    }
    if take(
        "heartbeat-timeout",
        merged.heartbeat_timeout_s != session.heartbeat_timeout_s,
        Value::from(session.heartbeat_timeout_s),
    ) {
        merged.heartbeat_timeout_s = session.heartbeat_timeout_s;
        merged.heartbeat_ms = session.heartbeat_ms;
    }
    if take(
        "monitor-interval",
        merged.monitor_interval_s != session.monitor_interval_s,
        Value::from(session.monitor_interval_s),
    ) {
        merged.monitor_interval_s = session.monitor_interval_s;
    }
    if take(
        "max-restarts",
        merged.max_restarts != session.max_restarts,
        Value::from(session.max_restarts),
    ) {
        merged.max_restarts = session.max_restarts;
    }
    if take(
        "synthetic-us-per-token",
        merged.synthetic_us_per_token != session.synthetic_us_per_token,
        Value::from(session.synthetic_us_per_token),
    ) {
        merged.synthetic_us_per_token = session.synthetic_us_per_token;
    }
    if take(
        "restart-window",
        merged.restart_window_s != session.restart_window_s,
        Value::from(session.restart_window_s),
    ) {
        merged.restart_window_s = session.restart_window_s;
    }
    Ok((merged, changes))
}

/// Where the journal's run line records an option.
fn journal_path(flag: &str) -> Option<&'static [&'static str]> {
    Some(match flag {
        "data" => &["data"],
        "synthetic" => &["synthetic"],
        "synthetic-seed" => &["synthetic_seed"],
        "stage" => &["stage"],
        "synthetic-us-per-token" => &["synthetic_us_per_token"],
        "epochs" => &["epochs"],
        "mode" => &["planner", "mode"],
        "interleave" => &["planner", "interleave"],
        "buckets" => &["planner", "buckets"],
        "token-budget" => &["planner", "token_budget"],
        "max-len" => &["planner", "max_len"],
        "on-overlong" => &["planner", "on_overlong"],
        "accum" => &["planner", "accum"],
        "seed" => &["planner", "seed"],
        "target-model" => &["dflash", "target_model"],
        "target-layer-ids" => &["dflash", "target_layer_ids"],
        "draft-layers" => &["dflash", "draft_layers"],
        "block-size" => &["dflash", "block_size"],
        "num-anchors" => &["dflash", "num_anchors"],
        "mask-token-id" => &["dflash", "mask_token_id"],
        "lr" => &["dflash", "lr"],
        "warmup-ratio" => &["dflash", "warmup_ratio"],
        "clip" => &["dflash", "clip"],
        "gamma" => &["dflash", "gamma"],
        "weight-decay" => &["dflash", "weight_decay"],
        "save-every" => &["dflash", "save_every"],
        "keep-checkpoints" => &["dflash", "keep_checkpoints"],
        _ => return None,
    })
}

fn pointer<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(key))
}

fn compact(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Each option of `launch` that was given on the command line, with its value in the journal's
/// form, from the options of this session (`session`, built as a fresh launch would).
pub fn given_values(given: &[String], session: &RunConfig) -> BTreeMap<String, Value> {
    let value = serde_json::to_value(session).unwrap_or_default();
    given
        .iter()
        .map(|flag| {
            let v = journal_path(flag)
                .and_then(|p| pointer(&value, p))
                .cloned()
                .unwrap_or(Value::Null);
            (flag.clone(), v)
        })
        .collect()
}
