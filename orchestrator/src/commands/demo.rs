//! `dflash-orch demo`: the whole job on this machine, no GPU and no downloads. It writes a tiny
//! target and conversation prompts, has the target write the replies (`generate`: training data
//! written by the model the drafter will serve), prepares them through the real `prepare`, trains
//! with `launch --stage dflash` on three CPU workers, and measures served acceptance with `eval`
//! on prompts held out of training: τ and speedup of the untrained drafter (the run's starting
//! weights) and of the trained one, by real speculative decoding, with the lossless check. Every
//! step is the real subcommand, run as a child process, and printed so it can be run by hand.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;
use serde_json::{Value, json};

use crate::error::CliError;
use crate::planner::rng::{PlanRng, Purpose};
use crate::runtime::metrics;

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Where the demo writes everything (target/, conversations.jsonl, store/, run/). It may be
    /// absent, empty, or an earlier demo's (see --force); the demo marks it with a .dflash-demo
    /// file.
    #[arg(long, value_name = "DIR", default_value = "dflash-demo")]
    pub run_dir: PathBuf,

    /// Conversations to generate (at least 50).
    #[arg(long, value_name = "N", default_value_t = 2000,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(50..=1_000_000))]
    pub samples: usize,

    /// Epochs to train (at least 1).
    #[arg(long, value_name = "N", default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub epochs: u32,

    /// The drafter's loss: ce, kd (distillation of the target's distribution), mix, dpace or
    /// kd-dpace (see `launch --help`).
    #[arg(long, value_name = "ce|kd|mix|dpace|kd-dpace", default_value = "ce")]
    pub loss: dflash_common::dflash::LossKind,

    /// The drafter's architecture: dflash, or dflash2 (with --engine torch; see `launch
    /// --help`).
    #[arg(long, value_name = "dflash|dflash2", default_value = "dflash")]
    pub drafter_arch: dflash_common::dflash::DrafterArch,

    /// Temperature of the target's distribution that kd and mix teach (launch's default when
    /// not given; see `launch --help`).
    #[arg(long, value_name = "T", value_parser = crate::options::positive(100.0, ""))]
    pub kd_temperature: Option<f64>,

    /// Seed of the data, the target, the plans and the drafter.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Replace DIR if an earlier demo made it (it holds .dflash-demo). Any other non-empty DIR is
    /// refused, with or without --force, and nothing is deleted. Every argument is checked before
    /// DIR is touched.
    #[arg(long)]
    pub force: bool,

    /// Print the final figures as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,

    /// Skip step 6, the untrained drafter's eval: it agrees with almost nothing, so it decodes
    /// about one token per verify step (τ near 1.00) and is the slower of the two evals. The
    /// summary's served.before is then null.
    #[arg(long)]
    pub no_baseline: bool,

    /// The target: a Hugging Face directory with config.json, safetensors and a tokenizer.json
    /// whose vocabulary renders the demo's conversations with the chatml template [default: a
    /// tiny random Qwen3 that `init-tiny` writes into DIR/target]. Any causal LM that
    /// transformers loads with --engine torch; a Qwen3 with candle.
    #[arg(long, value_name = "DIR")]
    pub target_model: Option<PathBuf>,

    /// The engine of every step (generate, launch, eval): candle (embedded, no Python) or torch
    /// (see `launch --help`; needs --python or $DFLASH_PYTHON with torch and transformers).
    #[arg(long, value_name = "candle|torch", default_value = "candle")]
    pub engine: dflash_common::dflash::Engine,

    /// The Python of the torch engine [default: $DFLASH_PYTHON, else python3 on PATH].
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
}

/// The file the demo writes into the run dir it uses. `--force` removes only a directory holding
/// it, so a mistyped `--run-dir` can never delete anyone's files.
pub const MARKER: &str = ".dflash-demo";

/// How the marker begins; a file of that name saying anything else is someone else's.
const MARKER_LINE: &str = "made by dflash-orch demo";

/// What is at `--run-dir` before the demo starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunDirFound {
    Nothing,
    NotADirectory,
    EmptyDirectory,
    /// A directory holding the marker: an earlier demo's.
    DemoDirectory,
    /// A directory holding other things and no marker.
    OtherDirectory,
}

/// What the demo does with `--run-dir` before writing into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunDirAction {
    Create,
    UseEmpty,
    /// Remove an earlier demo's directory and create it afresh.
    Replace,
}

/// Looks at `--run-dir` without changing anything.
fn observe_run_dir(dir: &Path) -> Result<RunDirFound, CliError> {
    let inspect = |e| CliError::io(format!("cannot inspect {}", dir.display()), e);
    let meta = match std::fs::metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(RunDirFound::Nothing),
        Err(e) => return Err(inspect(e)),
    };
    if !meta.is_dir() {
        return Ok(RunDirFound::NotADirectory);
    }
    if std::fs::read_dir(dir).map_err(inspect)?.next().is_none() {
        return Ok(RunDirFound::EmptyDirectory);
    }
    Ok(if holds_marker(dir) {
        RunDirFound::DemoDirectory
    } else {
        RunDirFound::OtherDirectory
    })
}

/// Whether `dir` holds a marker written by the demo: a plain file (not a link) that begins with
/// [`MARKER_LINE`].
fn holds_marker(dir: &Path) -> bool {
    let path = dir.join(MARKER);
    if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file()) {
        return false;
    }
    let mut head = Vec::new();
    std::fs::File::open(&path)
        .and_then(|f| f.take(MARKER_LINE.len() as u64).read_to_end(&mut head))
        .is_ok_and(|_| head == MARKER_LINE.as_bytes())
}

/// Decides, from what is at `dir`, whether the demo may use it; the refusal says why.
fn run_dir_action(dir: &Path, found: RunDirFound, force: bool) -> Result<RunDirAction, String> {
    let dir = dir.display();
    match (found, force) {
        (RunDirFound::Nothing, _) => Ok(RunDirAction::Create),
        (RunDirFound::EmptyDirectory, _) => Ok(RunDirAction::UseEmpty),
        (RunDirFound::DemoDirectory, true) => Ok(RunDirAction::Replace),
        (RunDirFound::DemoDirectory, false) => Err(format!(
            "{dir} holds an earlier demo (pass --force to replace it, or choose another --run-dir)"
        )),
        (RunDirFound::NotADirectory, _) => Err(format!(
            "{dir} exists and is not a directory; choose another --run-dir"
        )),
        (RunDirFound::OtherDirectory, false) => Err(format!(
            "{dir} is not empty and was not made by the demo (it has no {MARKER} file); \
             choose another --run-dir"
        )),
        (RunDirFound::OtherDirectory, true) => Err(format!(
            "refusing to replace {dir}: it is not empty and was not made by the demo (it has no \
             {MARKER} file), and --force replaces only a demo's directory; nothing was deleted: \
             choose another --run-dir"
        )),
    }
}

/// Refuses arguments the demo cannot run with, before anything on disk is touched.
pub fn check_args(args: &DemoArgs) -> Result<(), CliError> {
    if args.samples < 50 || args.epochs == 0 {
        return Err(CliError::Invalid(
            "--samples must be at least 50 and --epochs at least 1".into(),
        ));
    }
    if args.drafter_arch == dflash_common::dflash::DrafterArch::Dflash2
        && args.engine != dflash_common::dflash::Engine::Torch
    {
        return Err(CliError::Invalid(
            "--drafter-arch dflash2 is trained by the torch engine only: pass --engine torch"
                .into(),
        ));
    }
    // Every step gets its paths as UTF-8 arguments; a path that is not would reach them mangled.
    for path in [
        Some(&args.run_dir),
        args.target_model.as_ref(),
        args.python.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        if path.to_str().is_none() {
            return Err(CliError::Invalid(format!(
                "{} is not valid UTF-8; choose another path",
                path.display()
            )));
        }
    }
    if let Some(dir) = &args.target_model
        && !dir.join("config.json").is_file()
    {
        return Err(CliError::Invalid(format!(
            "--target-model {}: no config.json",
            dir.display()
        )));
    }
    if args.run_dir.to_str().is_none() {
        return Err(CliError::Invalid(format!(
            "--run-dir {} is not valid UTF-8; choose another --run-dir",
            args.run_dir.display()
        )));
    }
    Ok(())
}

/// What the demo writes into [`MARKER`]: what made the directory, and that `--force` may replace it.
pub fn marker_text() -> String {
    format!(
        "{MARKER_LINE} {}; `dflash-orch demo --force` may replace this directory\n",
        env!("CARGO_PKG_VERSION")
    )
}

/// Makes `dir` ready for the demo as `action` says and marks it as the demo's.
fn set_up_run_dir(dir: &Path, action: RunDirAction) -> Result<(), CliError> {
    if action == RunDirAction::Replace {
        std::fs::remove_dir_all(dir)
            .map_err(|e| CliError::io(format!("cannot remove {}", dir.display()), e))?;
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::io(format!("cannot create {}", dir.display()), e))?;
    let marker = dir.join(MARKER);
    std::fs::write(&marker, marker_text())
        .map_err(|e| CliError::io(format!("cannot write {}", marker.display()), e))
}

const WORDS: [&str; 24] = [
    "red", "green", "blue", "river", "stone", "cloud", "apple", "tiger", "paper", "light", "north",
    "south", "quick", "slow", "happy", "music", "water", "fire", "train", "model", "token",
    "draft", "block", "layer",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// One conversation whose answer follows from its question by a rule: counting, cycles of days
/// and months, spelling, repetition.
fn conversation(rng: &mut PlanRng) -> Value {
    let pick = |rng: &mut PlanRng, n: usize| rng.below(n as u64) as usize;
    let (question, answer) = match pick(rng, 5) {
        0 => {
            let from = pick(rng, 80);
            let to = from + 8 + pick(rng, 16);
            let numbers: Vec<String> = (from..=to).map(|n| n.to_string()).collect();
            (
                format!("Count from {from} to {to}."),
                format!("{}.", numbers.join(", ")),
            )
        }
        1 => {
            let start = pick(rng, 7);
            let n = 5 + pick(rng, 10);
            let days: Vec<&str> = (0..n).map(|i| DAYS[(start + i) % 7]).collect();
            (
                format!("List {n} days starting on {}.", DAYS[start]),
                format!("{}.", days.join(", ")),
            )
        }
        2 => {
            let start = pick(rng, 12);
            let n = 4 + pick(rng, 9);
            let months: Vec<&str> = (0..n).map(|i| MONTHS[(start + i) % 12]).collect();
            (
                format!("Name {n} months from {}.", MONTHS[start]),
                format!("{}.", months.join(", ")),
            )
        }
        3 => {
            let words: Vec<&str> = (0..2 + pick(rng, 2))
                .map(|_| WORDS[pick(rng, 24)])
                .collect();
            let spelled: Vec<String> = words
                .iter()
                .map(|w| {
                    w.chars()
                        .map(|c| c.to_ascii_uppercase().to_string())
                        .collect::<Vec<_>>()
                        .join("-")
                })
                .collect();
            (
                format!("Spell {}.", words.join(" and ")),
                format!("{}.", spelled.join(", then ")),
            )
        }
        _ => {
            let words: Vec<&str> = (0..4 + pick(rng, 4))
                .map(|_| WORDS[pick(rng, 24)])
                .collect();
            let line = words.join(" ");
            (
                format!("Repeat three times: {line}"),
                format!("{line}; {line}; {line}."),
            )
        }
    };
    json!({"messages": [
        {"role": "system", "content": "You answer exactly."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ]})
}

/// Runs one subcommand of this binary, showing it; fails with its exit status.
fn step(label: &str, args: &[String], quiet: bool) -> Result<(), CliError> {
    let exe = std::env::current_exe()
        .map_err(|e| CliError::io("cannot find the dflash-orch binary".to_owned(), e))?;
    eprintln!("{label:<10} dflash-orch {}", args.join(" "));
    let mut command = Command::new(&exe);
    command.args(args);
    if quiet {
        command.stdout(std::process::Stdio::null());
    }
    let status = command
        .status()
        .map_err(|e| CliError::io(format!("cannot run {}", exe.display()), e))?;
    exit_status(status, args)
}

/// A step's exit status as the demo's outcome.
fn exit_status(status: std::process::ExitStatus, args: &[String]) -> Result<(), CliError> {
    if status.success() {
        Ok(())
    } else if status.code() == Some(i32::from(dflash_common::exit_code::INTERRUPTED)) {
        Err(CliError::Interrupted("demo stopped".into()))
    } else {
        Err(CliError::Failed(format!(
            "`dflash-orch {}` failed ({status})",
            args.first().map_or("", String::as_str)
        )))
    }
}

/// New tokens per reply, in `generate` and `eval`.
const REPLY_TOKENS: usize = 64;

/// Conversations held out of training for `eval`.
fn held_out(samples: usize) -> usize {
    (samples / 20).clamp(4, 32)
}

/// The figures of an `eval --json` summary the demo reports.
fn served_figures(v: &Value) -> Value {
    json!({
        "tau": v["tau"],
        "pooled_tau": v["pooled_tau"],
        "speedup": v["speedup"],
        "lossless": v["lossless"],
        "histogram": v["histogram"],
    })
}

/// Runs one subcommand of this binary, showing it, and returns its stdout.
fn step_output(label: &str, args: &[String]) -> Result<Vec<u8>, CliError> {
    let exe = std::env::current_exe()
        .map_err(|e| CliError::io("cannot find the dflash-orch binary".to_owned(), e))?;
    eprintln!("{label:<10} dflash-orch {}", args.join(" "));
    let out = Command::new(&exe)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| CliError::io(format!("cannot run {}", exe.display()), e))?;
    exit_status(out.status, args)?;
    Ok(out.stdout)
}

/// Mean of a field over a slice of metric lines.
fn mean(lines: &[Value], field: &str) -> f64 {
    let values: Vec<f64> = lines.iter().filter_map(|l| l[field].as_f64()).collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

fn path_arg(p: &Path) -> String {
    p.display().to_string()
}

pub fn run(args: DemoArgs) -> Result<(), CliError> {
    check_args(&args)?;
    let dir = &args.run_dir;
    let action =
        run_dir_action(dir, observe_run_dir(dir)?, args.force).map_err(CliError::Invalid)?;
    set_up_run_dir(dir, action)?;
    let dir = dir
        .canonicalize()
        .map_err(|e| CliError::io(format!("cannot resolve {}", dir.display()), e))?;
    let (target, data, store, run_dir) = (
        dir.join("target"),
        dir.join("conversations.jsonl"),
        dir.join("store"),
        dir.join("run"),
    );
    let (train_prompts, eval_prompts, generated) = (
        dir.join("train-prompts.jsonl"),
        dir.join("eval-prompts.jsonl"),
        dir.join("generated.jsonl"),
    );
    eprintln!(
        "dflash-orch demo: a DFlash drafter trained end to end on this machine's CPUs (no GPU, no downloads), in {}",
        dir.display()
    );
    let target = match &args.target_model {
        Some(given) => {
            eprintln!("[1/7]      the target: {}", given.display());
            given.clone()
        }
        None => {
            step(
                "[1/7]",
                &[
                    "init-tiny".into(),
                    "--output".into(),
                    path_arg(&target),
                    "--seed".into(),
                    args.seed.to_string(),
                ],
                true,
            )?;
            target
        }
    };
    // The engine's options, for every step that computes.
    let engine: Vec<String> = ["--engine".to_owned(), args.engine.name().to_owned()]
        .into_iter()
        .chain(
            args.python
                .iter()
                .flat_map(|p| ["--python".to_owned(), path_arg(p)]),
        )
        .collect();

    let mut rng = PlanRng::stream(args.seed, 1, Purpose::Synthetic);
    let conversations: Vec<Vec<u8>> = (0..args.samples)
        .map(|_| serde_json::to_vec(&conversation(&mut rng)).expect("JSON to memory"))
        .collect();
    let held = held_out(args.samples);
    let write_lines = |path: &Path, rows: &[Vec<u8>]| -> Result<(), CliError> {
        let mut text = Vec::new();
        for row in rows {
            text.extend_from_slice(row);
            text.push(b'\n');
        }
        std::fs::write(path, text)
            .map_err(|e| CliError::io(format!("cannot write {}", path.display()), e))
    };
    write_lines(&data, &conversations)?;
    let (train, test) = conversations.split_at(args.samples - held);
    write_lines(&train_prompts, train)?;
    write_lines(&eval_prompts, test)?;
    eprintln!(
        "[2/7]      {} conversations (counting, days, months, spelling, repetition) in {}: {} to train on, {held} held out for eval",
        args.samples,
        data.display(),
        train.len()
    );
    step(
        "[3/7]",
        &[
            "generate".into(),
            "--target-model".into(),
            path_arg(&target),
            "--input".into(),
            path_arg(&train_prompts),
            "--output".into(),
            path_arg(&generated),
            "--max-new-tokens".into(),
            REPLY_TOKENS.to_string(),
            "--gpus".into(),
            "cpu:2".into(),
            "--batch-size".into(),
            "32".into(),
        ]
        .into_iter()
        .chain(engine.iter().cloned())
        .collect::<Vec<String>>(),
        true,
    )?;
    step(
        "[4/7]",
        &[
            "prepare".into(),
            "--input".into(),
            path_arg(&generated),
            "--max-len".into(),
            "256".into(),
            "--min-loss-tokens".into(),
            "8".into(),
            "--output".into(),
            path_arg(&store),
        ],
        true,
    )?;
    eprintln!(
        "           while it trains, in another terminal: dflash-orch status --run-dir {}",
        run_dir.display()
    );
    let launch: Vec<String> = [
        "launch",
        "--gpus",
        "cpu:3",
        "--topology",
        "2:1",
        "--stage",
        "dflash",
        "--target-model",
        &path_arg(&target),
        "--data",
        &path_arg(&store),
        "--run-dir",
        &path_arg(&run_dir),
        "--epochs",
        &args.epochs.to_string(),
        "--seed",
        &args.seed.to_string(),
        "--token-budget",
        "2048",
        "--max-len",
        "256",
        "--buckets",
        "auto:4",
        "--accum",
        "2",
        "--draft-layers",
        "1",
        "--target-layer-ids",
        "1,3",
        "--num-anchors",
        "16",
        "--lr",
        "3e-3",
        "--save-every",
        "25",
        "--loss",
        args.loss.name(),
        "--drafter-arch",
        args.drafter_arch.name(),
        "--eval-every",
        "100",
        "--eval-prompts",
        &path_arg(&eval_prompts),
        "--eval-max-new-tokens",
        &REPLY_TOKENS.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(
        args.kd_temperature
            .into_iter()
            .flat_map(|t| ["--kd-temperature".to_owned(), t.to_string()]),
    )
    .chain(engine.iter().cloned())
    .collect();
    step("[5/7]", &launch, false)?;
    let checkpoint = std::fs::read_to_string(run_dir.join("checkpoints").join("latest"))
        .map(|name| run_dir.join("checkpoints").join(name.trim()))
        .unwrap_or_else(|_| run_dir.join("checkpoints"));
    // Each eval's whole `--json` report (every prompt's ids, outputs and verify steps) is kept
    // beside the summary, for a closer look or another decoder to compare with.
    let served = |label: &str, report: &Path, init: Option<u64>| -> Result<Value, CliError> {
        let mut eval: Vec<String> = [
            "eval",
            "--target-model",
            &path_arg(&target),
            "--drafter",
            &path_arg(&checkpoint),
            "--prompts",
            &path_arg(&eval_prompts),
            "--max-new-tokens",
            &REPLY_TOKENS.to_string(),
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(seed) = init {
            eval.extend(["--init-seed".into(), seed.to_string()]);
        }
        eval.extend(engine.iter().cloned());
        let out = step_output(label, &eval)?;
        let summary = serde_json::from_slice(&out)
            .map_err(|e| CliError::Failed(format!("eval printed no summary: {e}")))?;
        crate::fsutil::write_atomically(report, |f| f.write_all(&out))
            .map_err(|e| CliError::io(format!("cannot write {}", report.display()), e))?;
        Ok(summary)
    };
    let reports = (dir.join("eval-before.json"), dir.join("eval-after.json"));
    let before = if args.no_baseline {
        eprintln!("[6/7]      the untrained drafter's eval skipped (--no-baseline)");
        None
    } else {
        Some(served("[6/7]", &reports.0, Some(args.seed))?)
    };
    let after = served("[7/7]", &reports.1, None)?;
    let lines = crate::observe::history::train_steps(&run_dir)?;
    if lines.is_empty() {
        return Err(CliError::Failed(format!(
            "the run recorded no optimiser step in {}/metrics.jsonl",
            run_dir.display()
        )));
    }
    if lines.len() < 10 {
        // A small demo still shows its figures: the tenths are then single steps.
        eprintln!(
            "note       only {} optimiser steps (--samples {} --epochs {}): the first and last tenth below are single steps, so the training figures are noisy; a demo of --samples 500 or more gives a steadier picture",
            lines.len(),
            args.samples,
            args.epochs
        );
    }
    let tenth = (lines.len() / 10).max(1);
    let (first, last) = (&lines[..tenth], &lines[lines.len() - tenth..]);
    let curves = run_dir.join("training.svg");
    let points: Vec<(f64, f64, f64)> = lines
        .iter()
        .map(|l| {
            (
                l["step"].as_f64().unwrap_or(0.0),
                l["loss"].as_f64().unwrap_or(f64::NAN),
                l["accuracy"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    let svg = crate::charts::training_curves_svg(&points, "dflash-orch demo")
        .map_err(|e| CliError::Failed(e.to_string()))?;
    std::fs::write(&curves, svg)
        .map_err(|e| CliError::io(format!("cannot write {}", curves.display()), e))?;
    let summary = json!({
        "steps": lines.len(),
        "first_tenth": {
            "loss": mean(first, "loss"),
            "accuracy": mean(first, "accuracy"),
            "acceptance_length": mean(first, "acceptance_length"),
        },
        "last_tenth": {
            "loss": mean(last, "loss"),
            "accuracy": mean(last, "accuracy"),
            "acceptance_length": mean(last, "acceptance_length"),
        },
        "served": {
            "prompts": after["prompts"],
            "before": before.as_ref().map(served_figures),
            "after": served_figures(&after),
            "reports": {"before": before.as_ref().map(|_| &reports.0), "after": reports.1},
        },
        "checkpoint": checkpoint,
        "curves": curves,
        "run_dir": run_dir,
    });
    eprintln!(
        "result     over {} optimiser steps, first tenth -> last tenth: loss {:.3} -> {:.3}, accuracy {:.3} -> {:.3}, acceptance length {:.2} -> {:.2}",
        lines.len(),
        mean(first, "loss"),
        mean(last, "loss"),
        mean(first, "accuracy"),
        mean(last, "accuracy"),
        mean(first, "acceptance_length"),
        mean(last, "acceptance_length"),
    );
    let line = |v: &Value| {
        format!(
            "τ {:.2}, speedup {:.2}×, lossless {}",
            v["tau"].as_f64().unwrap_or(f64::NAN),
            v["speedup"].as_f64().unwrap_or(f64::NAN),
            if v["lossless"] == true { "yes" } else { "NO" }
        )
    };
    eprintln!(
        "served     speculative decoding of {} held-out prompts ({REPLY_TOKENS} new tokens, block {}): untrained drafter {} -> trained {}",
        after["prompts"],
        after["block_size"],
        before
            .as_ref()
            .map_or_else(|| "not evaluated (--no-baseline)".to_owned(), line),
        line(&after),
    );
    eprintln!(
        "           τ = mean over prompts of the tokens one verify step gains (accepted draft tokens + 1); a drafter that never agrees gives 1.0"
    );
    eprintln!(
        "checkpoint {} (model.safetensors and config.json in the Hugging Face DFlash layout)",
        checkpoint.display()
    );
    eprintln!(
        "curves     {}; per-step metrics in {}",
        curves.display(),
        run_dir.join(metrics::FILE).display()
    );
    if args.json {
        println!("{summary}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_are_deterministic_and_answer_by_rule() {
        let make = |seed| {
            let mut rng = PlanRng::stream(seed, 1, Purpose::Synthetic);
            (0..50).map(|_| conversation(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(make(3), make(3));
        assert_ne!(make(3), make(4));
        for c in make(5) {
            let m = c["messages"].as_array().unwrap();
            assert_eq!(m[2]["role"], "assistant");
            let q = m[1]["content"].as_str().unwrap();
            let a = m[2]["content"].as_str().unwrap();
            if let Some(rest) = q.strip_prefix("Count from ") {
                let from: usize = rest.split(' ').next().unwrap().parse().unwrap();
                assert!(a.starts_with(&format!("{from}, {}", from + 1)), "{q} {a}");
            }
        }
    }

    #[test]
    fn force_replaces_only_a_demo_directory() {
        use RunDirAction::{Create, Replace, UseEmpty};
        use RunDirFound::*;
        let dir = Path::new("precious");
        for force in [false, true] {
            assert_eq!(run_dir_action(dir, Nothing, force), Ok(Create));
            assert_eq!(run_dir_action(dir, EmptyDirectory, force), Ok(UseEmpty));
            for found in [NotADirectory, OtherDirectory] {
                let refusal = run_dir_action(dir, found, force).unwrap_err();
                assert!(refusal.contains("precious"), "{refusal}");
            }
        }
        assert_eq!(run_dir_action(dir, DemoDirectory, true), Ok(Replace));
        let refusal = run_dir_action(dir, DemoDirectory, false).unwrap_err();
        assert!(refusal.contains("--force"), "{refusal}");
        let refusal = run_dir_action(dir, OtherDirectory, true).unwrap_err();
        assert!(
            refusal.contains(MARKER) && refusal.contains("nothing was deleted"),
            "{refusal}"
        );
    }

    #[test]
    fn the_marker_the_demo_writes_is_the_one_it_recognises() {
        let root = std::env::temp_dir().join(format!("dflash-demo-marker-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("run");
        assert_eq!(observe_run_dir(&dir).unwrap(), RunDirFound::Nothing);
        set_up_run_dir(&dir, RunDirAction::Create).unwrap();
        assert_eq!(observe_run_dir(&dir).unwrap(), RunDirFound::DemoDirectory);
        std::fs::write(dir.join("model.bin"), b"weights").unwrap();
        set_up_run_dir(&dir, RunDirAction::Replace).unwrap();
        assert!(!dir.join("model.bin").exists());
        assert_eq!(observe_run_dir(&dir).unwrap(), RunDirFound::DemoDirectory);

        // A file of the marker's name that the demo did not write does not count.
        let other = root.join("other");
        std::fs::create_dir_all(&other).unwrap();
        assert_eq!(
            observe_run_dir(&other).unwrap(),
            RunDirFound::EmptyDirectory
        );
        std::fs::write(other.join(MARKER), b"user settings\n").unwrap();
        assert_eq!(
            observe_run_dir(&other).unwrap(),
            RunDirFound::OtherDirectory
        );
        assert_eq!(
            observe_run_dir(&other.join(MARKER)).unwrap(),
            RunDirFound::NotADirectory
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
