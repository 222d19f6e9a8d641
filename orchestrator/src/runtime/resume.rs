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
    /// The drafters the run trains, as its last recorded topology says.
    pub drafters: Option<u32>,
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
        drafters: history.drafters,
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

/// How an option that may change on resume is applied: from this session's options to the run's.
type Apply = fn(&mut RunConfig, &RunConfig);

/// What `launch --resume` does with an option given again.
#[derive(Clone, Copy)]
pub enum OnResume {
    /// It decides the plans or the weights: it must have the journal's value.
    Compared,
    /// It may change (none of these decides the trained weights or the plans): taken from this
    /// session, and recorded in the journal's `resume` line.
    Changeable(Apply),
    /// It does not reach the run (how this command runs, not what the run does).
    NotRun,
}

use OnResume::{Changeable, Compared, NotRun};

/// Every option of `launch`: where the journal's run line records it, and what a resume does
/// with it. One table, so that no option reaching a worker can be forgotten (a test holds it
/// equal to `launch`'s options). `--gpus` and `--topology` may change the number of target
/// workers (plans and the drafter's result do not depend on it), not the number of drafters;
/// `--synthetic-us-per-token` is the synthetic stage's speed.
pub const OPTIONS: &[(&str, &[&str], OnResume)] = &[
    ("data", &["data"], Compared),
    ("synthetic", &["synthetic"], Compared),
    ("synthetic-seed", &["synthetic_seed"], Compared),
    ("stage", &["stage"], Compared),
    ("epochs", &["epochs"], Compared),
    ("mode", &["planner", "mode"], Compared),
    ("interleave", &["planner", "interleave"], Compared),
    ("buckets", &["planner", "buckets"], Compared),
    ("token-budget", &["planner", "token_budget"], Compared),
    ("max-len", &["planner", "max_len"], Compared),
    ("on-overlong", &["planner", "on_overlong"], Compared),
    ("accum", &["planner", "accum"], Compared),
    ("seed", &["planner", "seed"], Compared),
    ("target-model", &["dflash", "target_model"], Compared),
    (
        "target-layer-ids",
        &["dflash", "target_layer_ids"],
        Compared,
    ),
    ("draft-layers", &["dflash", "draft_layers"], Compared),
    ("block-size", &["dflash", "block_size"], Compared),
    ("num-anchors", &["dflash", "num_anchors"], Compared),
    ("mask-token-id", &["dflash", "mask_token_id"], Compared),
    ("lr", &["dflash", "lr"], Compared),
    ("warmup-ratio", &["dflash", "warmup_ratio"], Compared),
    ("clip", &["dflash", "clip"], Compared),
    ("gamma", &["dflash", "gamma"], Compared),
    ("loss", &["dflash", "loss"], Compared),
    ("kd-temperature", &["dflash", "kd_temperature"], Compared),
    ("kd-weight", &["dflash", "kd_weight"], Compared),
    ("dpace-alpha", &["dflash", "dpace_alpha"], Compared),
    ("drafter-arch", &["dflash", "drafter_arch"], Compared),
    (
        "conv-kernel-size",
        &["dflash", "dflash2", "conv_kernel_size"],
        Compared,
    ),
    (
        "conv-group-size",
        &["dflash", "dflash2", "conv_group_size"],
        Compared,
    ),
    (
        "selector-top-k",
        &["dflash", "dflash2", "selector_top_k"],
        Compared,
    ),
    (
        "selector-rank",
        &["dflash", "dflash2", "selector_rank"],
        Compared,
    ),
    (
        "selector-loss-weight",
        &["dflash", "dflash2", "selector_loss_weight"],
        Compared,
    ),
    (
        "selector-stop-gradient",
        &["dflash", "dflash2", "selector_stop_gradient"],
        Compared,
    ),
    ("sliding-window", &["dflash", "sliding_window"], Compared),
    ("weight-decay", &["dflash", "weight_decay"], Compared),
    ("save-every", &["dflash", "save_every"], Compared),
    (
        "keep-checkpoints",
        &["dflash", "keep_checkpoints"],
        Compared,
    ),
    ("dtype", &["dflash", "dtype"], Compared),
    ("feature-dtype", &["dflash", "feature_dtype"], Compared),
    ("anchor-chunk", &["dflash", "anchor_chunk"], Compared),
    ("target-packing", &["dflash", "target_packing"], Compared),
    ("drafter-compile", &["dflash", "drafter_compile"], Compared),
    ("engine", &["dflash", "engines"], Compared),
    // The held-out samples leave the plans: they may not change.
    ("eval-holdout", &["eval", "holdout"], Compared),
    (
        "gpus",
        &["gpus"],
        Changeable(|run, session| {
            // Other workers: the topology is the one given with them (or their default).
            if run.gpus != session.gpus {
                run.gpus.clone_from(&session.gpus);
                run.topology.clone_from(&session.topology);
            }
        }),
    ),
    (
        "python",
        &["dflash", "torch"],
        Changeable(|run, session| {
            // Another interpreter for the same engines (the pre-flight checks it).
            if let (Some(r), Some(s)) = (run.dflash.as_mut(), session.dflash.as_ref())
                && r.engines == s.engines
            {
                r.torch.clone_from(&s.torch);
            }
        }),
    ),
    (
        "topology",
        &["topology"],
        Changeable(|run, session| run.topology.clone_from(&session.topology)),
    ),
    (
        "metrics-addr",
        &["metrics_addr"],
        Changeable(|run, session| run.metrics_addr.clone_from(&session.metrics_addr)),
    ),
    (
        "job-timeout",
        &["job_timeout_s"],
        Changeable(|run, session| run.job_timeout_s = session.job_timeout_s),
    ),
    (
        "stop-grace",
        &["stop_grace_s"],
        Changeable(|run, session| run.stop_grace_s = session.stop_grace_s),
    ),
    (
        "heartbeat-timeout",
        &["heartbeat_timeout_s"],
        Changeable(|run, session| {
            run.heartbeat_timeout_s = session.heartbeat_timeout_s;
            run.heartbeat_ms = session.heartbeat_ms;
        }),
    ),
    (
        "monitor-interval",
        &["monitor_interval_s"],
        Changeable(|run, session| run.monitor_interval_s = session.monitor_interval_s),
    ),
    (
        "max-restarts",
        &["max_restarts"],
        Changeable(|run, session| run.max_restarts = session.max_restarts),
    ),
    (
        "restart-window",
        &["restart_window_s"],
        Changeable(|run, session| run.restart_window_s = session.restart_window_s),
    ),
    (
        "synthetic-us-per-token",
        &["synthetic_us_per_token"],
        Changeable(|run, session| run.synthetic_us_per_token = session.synthetic_us_per_token),
    ),
    (
        "synthetic-drafter-us-per-token",
        &["synthetic_drafter_us_per_token"],
        Changeable(|run, session| {
            run.synthetic_drafter_us_per_token = session.synthetic_drafter_us_per_token;
        }),
    ),
    (
        "eval-every",
        &["eval", "every"],
        Changeable(|run, session| match (&mut run.eval, &session.eval) {
            (Some(r), Some(s)) => {
                r.every = s.every;
                if let Some(d) = run.dflash.as_mut() {
                    d.eval_every = Some(s.every);
                }
            }
            // Prompts of the user's: the plans do not change.
            (None, Some(s)) if s.holdout == 0 => {
                run.eval = Some(s.clone());
                if let Some(d) = run.dflash.as_mut() {
                    d.eval_every = Some(s.every);
                }
            }
            _ => {}
        }),
    ),
    (
        "eval-prompts",
        &["eval", "prompts"],
        Changeable(|run, session| {
            // Another prompts file: what is measured changes, not what is trained. Never a
            // switch from held-out samples (the plans would change): `merge` refuses that.
            if let (Some(r), Some(s)) = (run.eval.as_mut(), session.eval.as_ref())
                && r.prompts.is_some()
                && s.prompts.is_some()
            {
                r.prompts.clone_from(&s.prompts);
            }
        }),
    ),
    (
        "eval-max-new-tokens",
        &["eval", "max_new_tokens"],
        Changeable(|run, session| {
            if let (Some(r), Some(s)) = (run.eval.as_mut(), session.eval.as_ref()) {
                r.max_new_tokens = s.max_new_tokens;
            }
        }),
    ),
    (
        "on-nonfinite",
        &["dflash", "on_nonfinite"],
        Changeable(|run, session| {
            if let (Some(r), Some(s)) = (run.dflash.as_mut(), session.dflash.as_ref()) {
                r.on_nonfinite = s.on_nonfinite;
            }
        }),
    ),
    // The number of nodes and a node's rank decide which drafter sums which gradient.
    ("nodes", &["nodes", "nodes"], Compared),
    ("node-rank", &["nodes", "rank"], Compared),
    (
        "rendezvous",
        &["nodes", "rendezvous"],
        Changeable(|run, session| {
            if let (Some(r), Some(s)) = (run.nodes.as_mut(), session.nodes.as_ref()) {
                r.rendezvous.clone_from(&s.rendezvous);
            }
        }),
    ),
    (
        "rendezvous-timeout",
        &["nodes", "timeout_s"],
        Changeable(|run, session| {
            if let (Some(r), Some(s)) = (run.nodes.as_mut(), session.nodes.as_ref()) {
                r.timeout_s = s.timeout_s;
            }
        }),
    ),
    // The secret is read anew by every launch and never journaled.
    ("rendezvous-secret-file", &[], NotRun),
    ("run-dir", &[], NotRun),
    ("resume", &[], NotRun),
    ("dry-run", &[], NotRun),
    ("json", &[], NotRun),
    ("gpu-memory", &[], NotRun),
];

/// The names of the options a resume may change.
pub fn changeable_on_resume() -> impl Iterator<Item = &'static str> {
    OPTIONS
        .iter()
        .filter(|(_, _, on)| matches!(on, Changeable(_)))
        .map(|(flag, _, _)| *flag)
}

/// Compares the run options given with `--resume` against the journal's. `given` holds, for each
/// option given on the command line (long name without dashes), its value as the journal records
/// it (`Null` where the option has no journal form). Options that may change are taken from
/// `session`; any other one that differs is refused, naming it. Returns the options of this
/// session and the changes made.
pub fn merge(
    stored: RunConfig,
    given: &BTreeMap<String, Value>,
    session: &RunConfig,
) -> Result<(RunConfig, BTreeMap<String, Value>), String> {
    let stored_value = serde_json::to_value(&stored).map_err(|e| e.to_string())?;
    let changeable: Vec<&str> = changeable_on_resume().collect();
    let mut differ = Vec::new();
    // Held-out samples and a prompts file are not interchangeable: one leaves the plans.
    if given.contains_key("eval-prompts")
        && let (Some(run), Some(s)) = (stored.eval.as_ref(), session.eval.as_ref())
        && run.prompts.is_none()
        && s.prompts.is_some()
    {
        differ.push(format!(
            "--eval-prompts {} (the run evaluates {} samples held out of its store)",
            s.prompts
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            run.holdout
        ));
    }
    for (flag, value) in given {
        if changeable.contains(&flag.as_str()) {
            continue;
        }
        let recorded = journal_path(flag).and_then(|path| pointer(&stored_value, path));
        if let Some(recorded) = recorded.filter(|r| *r != value) {
            differ.push(format!(
                "--{flag} {} (the run has {})",
                compact(value),
                compact(recorded)
            ));
        }
    }
    if !differ.is_empty() {
        return Err(format!(
            "--resume continues the run with its own options; these differ from its journal: {}. Options that may change on resume: --{}",
            differ.join(", "),
            changeable.join(", --")
        ));
    }
    let mut merged = stored;
    for (flag, _, on) in OPTIONS {
        if let Changeable(apply) = on
            && given.contains_key(*flag)
        {
            apply(&mut merged, session);
        }
    }
    // Every recorded option whose value the resume changed, whether given itself or brought
    // by another (`--eval-every` on a run without evaluations brings their prompts and length).
    let merged_value = serde_json::to_value(&merged).map_err(|e| e.to_string())?;
    let mut changes = BTreeMap::new();
    for (flag, path, _) in OPTIONS {
        if path.is_empty() {
            continue;
        }
        let now = pointer(&merged_value, path);
        if now != pointer(&stored_value, path) {
            changes.insert((*flag).to_string(), now.cloned().unwrap_or(Value::Null));
        }
    }
    Ok((merged, changes))
}

/// Where the journal's run line records an option.
fn journal_path(flag: &str) -> Option<&'static [&'static str]> {
    OPTIONS
        .iter()
        .find(|(f, path, _)| *f == flag && !path.is_empty())
        .map(|(_, path, _)| *path)
}

fn pointer<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(key))
}

fn compact(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "none".into(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::PlannerSettings;
    use std::path::PathBuf;

    fn config() -> RunConfig {
        RunConfig {
            gpus: "cpu:3".into(),
            topology: Some("2:1".into()),
            data: None,
            synthetic: Some(100),
            synthetic_seed: 0,
            stage: "synthetic".into(),
            synthetic_us_per_token: 0.0,
            synthetic_drafter_us_per_token: 0.0,
            epochs: 2,
            planner: PlannerSettings::from_config(&Default::default()),
            max_restarts: 5,
            restart_window_s: 600.0,
            heartbeat_timeout_s: 30.0,
            heartbeat_ms: 1000,
            monitor_interval_s: 1.0,
            metrics_addr: None,
            dflash: None,
            job_timeout_s: None,
            stop_grace_s: 300.0,
            eval: None,
            nodes: None,
        }
    }

    fn given(flags: &[&str], session: &RunConfig) -> BTreeMap<String, Value> {
        let flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
        given_values(&flags, session)
    }

    /// How often and how long the evaluations decode may change; what they hold out may not.
    #[test]
    fn evaluations_may_change_pace_not_their_held_out_samples() {
        use crate::runtime::eval::EvalConfig;
        let eval = |every, holdout, prompts: Option<&str>| EvalConfig {
            every,
            prompts: prompts.map(PathBuf::from),
            holdout,
            max_new_tokens: 128,
        };
        let mut stored = config();
        stored.eval = Some(eval(10, 32, None));
        let mut session = config();
        session.eval = Some(eval(50, 32, None));
        let (merged, changes) =
            merge(stored.clone(), &given(&["eval-every"], &session), &session).unwrap();
        assert_eq!(merged.eval.as_ref().unwrap().every, 50);
        assert!(changes.contains_key("eval-every"));
        session.eval = Some(eval(10, 8, None));
        let e = merge(
            stored.clone(),
            &given(&["eval-holdout"], &session),
            &session,
        )
        .unwrap_err();
        assert!(e.contains("--eval-holdout 8 (the run has 32)"), "{e}");
        // A run without evaluations takes them on with prompts of the user's, not held out.
        let plain = config();
        session.eval = Some(eval(5, 0, Some("p.jsonl")));
        let (merged, _) =
            merge(plain.clone(), &given(&["eval-every"], &session), &session).unwrap();
        assert_eq!(merged.eval, session.eval);
        session.eval = Some(eval(5, 32, None));
        let (merged, _) = merge(plain, &given(&["eval-every"], &session), &session).unwrap();
        assert_eq!(merged.eval, None);
        assert_eq!(
            stored.weight_settings_differ(&RunConfig {
                eval: Some(eval(10, 16, None)),
                ..stored.clone()
            }),
            vec!["held-out samples"]
        );
    }

    #[test]
    fn options_that_decide_the_run_may_not_change_on_resume() {
        let stored = config();
        let mut session = config();
        session.epochs = 3;
        session.planner.seed = 9;
        // Given with the run's own value: accepted.
        assert!(merge(stored.clone(), &given(&["synthetic"], &session), &session).is_ok());
        let e = merge(
            stored,
            &given(&["epochs", "seed", "synthetic"], &session),
            &session,
        )
        .unwrap_err();
        assert!(
            e.contains("--epochs 3 (the run has 2), --seed 9 (the run has 0)"),
            "{e}"
        );
        assert!(!e.contains("--synthetic 100"), "{e}");
    }

    /// A DFlash run resumed as DFlash2 (or the reverse, or with other DFlash2 sizes) is
    /// refused, naming the option, its value and the run's; a DFlash journal from before DFlash2
    /// existed reads as a DFlash run.
    #[test]
    fn the_drafters_architecture_may_not_change_on_resume() {
        use dflash_common::dflash::DrafterArch;
        let mut stored = config();
        stored.dflash = Some(crate::runtime::memory::tests::settings(4096));
        let mut session = stored.clone();
        session.dflash.as_mut().unwrap().drafter_arch = DrafterArch::Dflash2;
        let e = merge(
            stored.clone(),
            &given(&["drafter-arch"], &session),
            &session,
        )
        .unwrap_err();
        assert!(
            e.contains("--drafter-arch dflash2 (the run has dflash)"),
            "{e}"
        );
        let e = merge(session.clone(), &given(&["drafter-arch"], &stored), &stored).unwrap_err();
        assert!(
            e.contains("--drafter-arch dflash (the run has dflash2)"),
            "{e}"
        );
        let mut wider = session.clone();
        wider.dflash.as_mut().unwrap().dflash2.selector_top_k = 32;
        wider.dflash.as_mut().unwrap().sliding_window = Some(2048);
        let e = merge(
            session.clone(),
            &given(&["selector-top-k", "sliding-window"], &wider),
            &wider,
        )
        .unwrap_err();
        assert!(e.contains("--selector-top-k 32 (the run has 16)"), "{e}");
        assert!(
            e.contains("--sliding-window 2048 (the run has none)"),
            "{e}"
        );
        // Journals written before the option: their run line has no `drafter_arch`.
        let mut old = serde_json::to_value(&stored).unwrap();
        for key in ["drafter_arch", "dflash2", "sliding_window"] {
            old["dflash"].as_object_mut().unwrap().remove(key);
        }
        let old: RunConfig = serde_json::from_value(old).unwrap();
        assert!(merge(old, &given(&["drafter-arch"], &session), &session).is_err());
    }

    #[test]
    fn options_that_may_change_are_taken_and_recorded() {
        let stored = config();
        let mut session = config();
        session.gpus = "cpu:2".into();
        session.topology = None;
        session.max_restarts = 9;
        session.epochs = 3; // not given: the run's value stays
        let (merged, changes) = merge(
            stored,
            &given(&["gpus", "max-restarts", "job-timeout"], &session),
            &session,
        )
        .unwrap();
        assert_eq!(merged.gpus, "cpu:2");
        assert_eq!(
            merged.topology, None,
            "a new --gpus resolves its own topology"
        );
        assert_eq!(merged.max_restarts, 9);
        assert_eq!(merged.epochs, 2);
        assert_eq!(
            changes.keys().collect::<Vec<_>>(),
            ["gpus", "max-restarts", "topology"],
            "job-timeout was given with the run's value: no change; the topology came with --gpus"
        );
    }

    /// One table for every option of `launch`: each is compared, changeable or not part of the
    /// run, and each recorded one has a place in the journal's run line.
    #[test]
    fn every_launch_option_is_in_the_resume_table() {
        use clap::CommandFactory;
        let cli = crate::cli::Cli::command();
        let launch = cli.find_subcommand("launch").unwrap();
        let mut options: Vec<String> = launch
            .get_arguments()
            .filter_map(|a| a.get_long().map(str::to_owned))
            .filter(|l| l != "help" && l != "verbose")
            .collect();
        options.sort();
        let mut table: Vec<String> = OPTIONS.iter().map(|(f, _, _)| (*f).to_owned()).collect();
        table.sort();
        assert_eq!(
            options, table,
            "launch's options and the resume table differ"
        );
        let recorded = serde_json::to_value(config()).unwrap();
        let mut with_everything = config();
        with_everything.dflash = Some(crate::runtime::memory::tests::settings(512));
        with_everything.eval = Some(crate::runtime::eval::EvalConfig {
            every: 1,
            prompts: None,
            holdout: 1,
            max_new_tokens: 1,
        });
        with_everything.nodes = Some(crate::runtime::nodes::NodeConfig {
            nodes: 2,
            rank: 1,
            rendezvous: "node0:29400".into(),
            timeout_s: 300.0,
            secret: None,
        });
        let full = serde_json::to_value(&with_everything).unwrap();
        for (flag, path, on) in OPTIONS {
            match on {
                NotRun => assert!(path.is_empty(), "{flag}"),
                _ => {
                    let top = path.first().unwrap();
                    assert!(
                        recorded.get(top).is_some() || full.get(top).is_some(),
                        "--{flag}: the run line has no {path:?}"
                    );
                    if path.len() > 1 {
                        assert!(pointer(&full, path).is_some(), "--{flag}: no {path:?}");
                    }
                }
            }
        }
    }

    /// A resume that takes on evaluations records everything they bring, and never swaps
    /// held-out samples for a prompts file.
    #[test]
    fn a_resume_records_every_option_it_changes() {
        use crate::runtime::eval::EvalConfig;
        let eval = |every, holdout, prompts: Option<&str>, max_new| EvalConfig {
            every,
            prompts: prompts.map(PathBuf::from),
            holdout,
            max_new_tokens: max_new,
        };
        let mut session = config();
        session.eval = Some(eval(5, 0, Some("p.jsonl"), 40));
        let (_, changes) = merge(
            config(),
            &given(
                &["eval-every", "eval-prompts", "eval-max-new-tokens"],
                &session,
            ),
            &session,
        )
        .unwrap();
        assert_eq!(
            changes.keys().collect::<Vec<_>>(),
            [
                "eval-every",
                "eval-holdout",
                "eval-max-new-tokens",
                "eval-prompts"
            ],
            "the whole of the evaluations arrived (none held out)"
        );
        assert_eq!(changes["eval-prompts"], "p.jsonl");
        // Another prompts file for a run evaluating a file: taken and recorded.
        let mut stored = config();
        stored.eval = Some(eval(5, 0, Some("p.jsonl"), 40));
        session.eval = Some(eval(5, 0, Some("q.jsonl"), 40));
        let (merged, changes) =
            merge(stored, &given(&["eval-prompts"], &session), &session).unwrap();
        assert_eq!(merged.eval.unwrap().prompts, Some(PathBuf::from("q.jsonl")));
        assert_eq!(changes.keys().collect::<Vec<_>>(), ["eval-prompts"]);
        // A prompts file for a run evaluating held-out samples: refused.
        let mut stored = config();
        stored.eval = Some(eval(5, 32, None, 40));
        let e = merge(stored, &given(&["eval-prompts"], &session), &session).unwrap_err();
        assert!(
            e.contains("--eval-prompts q.jsonl (the run evaluates 32 samples held out"),
            "{e}"
        );
    }

    #[test]
    fn the_same_gpus_given_again_keep_the_runs_topology() {
        let stored = config();
        let mut session = config();
        session.topology = None;
        let (merged, changes) = merge(stored, &given(&["gpus"], &session), &session).unwrap();
        assert_eq!(merged.topology.as_deref(), Some("2:1"));
        assert!(changes.is_empty());
    }
}
