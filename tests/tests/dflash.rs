//! `--stage dflash` end to end on `cpu:3` (two target workers, one drafter) with the tiny target:
//! a run whose drafter is SIGKILLed, and one whose orchestrator is SIGKILLed and resumed, end with
//! a `model.safetensors` byte-identical to an undisturbed run's, and commit exactly what it commits;
//! the checkpoint loads with the Python `safetensors` package; bad targets and settings are refused
//! at launch, before any worker starts.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dflash_e2e::{
    assert_clean, assert_refused, bin, finish, journal_events, orch, signal, stdout_ok,
    test_python, tiny_target, wait_until, worker_pid, workspace_root,
};
use serde_json::Value;

/// The run: small batches so that it has enough steps to be interrupted between checkpoints.
/// The run of these tests; its drafter computes the 24 anchors of a sequence in chunks of 5, so
/// exact replay is checked on the chunked path.
const RUN_FLAGS: [&str; 32] = [
    "--gpus",
    "cpu:3",
    "--topology",
    "2:1",
    "--stage",
    "dflash",
    "--synthetic",
    "240",
    "--epochs",
    "2",
    "--max-len",
    "64",
    "--token-budget",
    "512",
    "--buckets",
    "auto:2",
    "--accum",
    "2",
    "--draft-layers",
    "1",
    "--num-anchors",
    "24",
    "--anchor-chunk",
    "5",
    "--save-every",
    "4",
    "--keep-checkpoints",
    "2",
    "--heartbeat-timeout",
    "10",
    "--max-restarts",
    "5",
];
/// Batches between checkpoints: --save-every × --accum.
const CHECKPOINT_BATCHES: u64 = 8;

fn launch(run_dir: &Path, target: &Path) -> Command {
    launch_with(run_dir, target, &[])
}

fn launch_with(run_dir: &Path, target: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("dflash-orch"));
    c.arg("launch")
        .args(RUN_FLAGS)
        .args(extra)
        .arg("--target-model")
        .arg(target)
        .arg("--run-dir")
        .arg(run_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// `(step, epoch, batch, checksum)` of the commits in force: those a rewind voided are dropped.
fn effective_commits(run_dir: &Path) -> Vec<(u64, u64, u64, u64)> {
    let text = fs::read_to_string(run_dir.join("journal.jsonl")).unwrap_or_default();
    let mut commits = Vec::new();
    for v in text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        let n = |k: &str| v[k].as_u64().unwrap();
        if v["event"] == "commit" {
            commits.push((n("step"), n("epoch"), n("batch"), n("checksum")));
        } else if v["event"] == "rewind" {
            let to = n("to_step");
            commits.retain(|c| c.0 < to);
        }
    }
    commits
}

/// The `train` lines of a run's metrics.jsonl.
fn train_lines(run_dir: &Path) -> Vec<Value> {
    fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "train")
        .collect()
}

/// `state.json` of the checkpoint `latest` names.
fn latest_state(run_dir: &Path) -> Value {
    let root = run_dir.join("checkpoints");
    let latest = fs::read_to_string(root.join("latest")).unwrap();
    serde_json::from_slice(&fs::read(root.join(latest.trim()).join("state.json")).unwrap()).unwrap()
}

/// The final drafter weights: `model.safetensors` of the checkpoint `latest` names.
fn final_weights(run_dir: &Path) -> Vec<u8> {
    let root = run_dir.join("checkpoints");
    let latest = fs::read_to_string(root.join("latest")).unwrap();
    fs::read(root.join(latest.trim()).join("model.safetensors")).unwrap()
}

struct Reference {
    commits: Vec<(u64, u64, u64, u64)>,
    weights: Vec<u8>,
    _dir: tempfile::TempDir,
    run_dir: PathBuf,
}

/// An undisturbed run: one commit per planned batch in plan order, a final checkpoint.
fn reference(target: &Path) -> Reference {
    reference_with(target, &[])
}

fn reference_with(target: &Path, extra: &[&str]) -> Reference {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    finish(launch_with(&run_dir, target, extra).spawn().unwrap());
    let commits = effective_commits(&run_dir);
    assert!(commits.len() >= 50, "{} commits", commits.len());
    for (i, c) in commits.iter().enumerate() {
        assert_eq!(c.0, i as u64, "plan order");
    }
    assert!(journal_events(&run_dir, "rewind").is_empty());
    let state = latest_state(&run_dir);
    assert_eq!(state["plan_cursor"].as_u64(), Some(commits.len() as u64));
    Reference {
        commits,
        weights: final_weights(&run_dir),
        _dir: dir,
        run_dir,
    }
}

/// Waits until the run has committed past a checkpoint and is mid-way to the next one, so that
/// the drafter holds trained batches no checkpoint has: a restart must rewind and replay them.
fn wait_between_checkpoints(run_dir: &Path) {
    wait_until(
        "a point between checkpoints",
        Duration::from_secs(120),
        || {
            let n = effective_commits(run_dir).len() as u64;
            n >= 2 * CHECKPOINT_BATCHES && (3..=6).contains(&(n % CHECKPOINT_BATCHES))
        },
    );
}

/// `launch --resume` of the run in `run_dir` with `extra` options, in the background.
fn resume(run_dir: &Path, extra: &[&str]) -> Child {
    Command::new(bin("dflash-orch"))
        .args(["launch", "--resume", "--run-dir"])
        .arg(run_dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn kill_and_wait(child: &mut Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn drafter_sigkill_mid_run_ends_with_identical_weights() {
    drafter_sigkill_mid_run(&[]);
}

/// The same in bf16 (target and drafter compute, features in the ring): exact replay holds in
/// any dtype, and the bf16 run learns.
#[test]
fn in_bf16_a_drafter_sigkill_mid_run_ends_with_identical_weights() {
    let (_dir, run_dir) = drafter_sigkill_mid_run(&["--dtype", "bf16", "--feature-dtype", "bf16"]);
    let settings: Value =
        serde_json::from_slice(&fs::read(run_dir.join("dflash.json")).unwrap()).unwrap();
    assert_eq!(settings["dtype"], "bf16");
    assert_eq!(settings["feature_dtype"], "bf16");
    let losses: Vec<f64> = fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "train")
        .filter_map(|v| v["loss"].as_f64())
        .collect();
    let tenth = (losses.len() / 10).max(1);
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let (first, last) = (
        mean(&losses[..tenth]),
        mean(&losses[losses.len() - tenth..]),
    );
    assert!(
        losses.iter().all(|l| l.is_finite()) && last < first,
        "bf16 loss {first} -> {last}"
    );
}

/// Kills the drafter mid-run; the run ends with the weights of an undisturbed one. Returns the
/// killed run's directory (and its parent, removed when dropped).
fn drafter_sigkill_mid_run(extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let want = reference_with(&target, extra);
    let run_dir = dir.path().join("run");
    let child = launch_with(&run_dir, &target, extra).spawn().unwrap();
    wait_until("the drafter", Duration::from_secs(60), || {
        run_dir.join("control.sock").exists()
    });
    wait_between_checkpoints(&run_dir);
    let (_, pid) = worker_pid(&run_dir, "drafter");
    signal(pid, "KILL");
    finish(child);
    let rewinds = journal_events(&run_dir, "rewind");
    assert!(!rewinds.is_empty(), "the drafter's restart replays batches");
    assert!(
        journal_events(&run_dir, "worker_exit")
            .iter()
            .any(|e| e["reason"].as_str().unwrap_or("").contains("SIGKILL")),
        "the kill is journaled"
    );
    assert_eq!(effective_commits(&run_dir), want.commits);
    assert!(
        final_weights(&run_dir) == want.weights,
        "final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
    (dir, run_dir)
}

#[test]
fn orchestrator_sigkill_then_resume_ends_with_identical_weights() {
    let (_dir, target, run_dir) = killed_between_checkpoints();
    let want = reference(&target);
    finish(resume(&run_dir, &[]));
    assert_eq!(journal_events(&run_dir, "resume").len(), 1);
    assert!(
        !journal_events(&run_dir, "rewind").is_empty(),
        "the resumed drafter starts from its checkpoint, before the journal's last commit"
    );
    assert_eq!(effective_commits(&run_dir), want.commits);
    assert!(
        final_weights(&run_dir) == want.weights,
        "final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            fs::copy(entry.path(), dest).unwrap();
        }
    }
}

/// A copy of a finished run as an orchestrator crash would have left it: the journal without its
/// end and its last `drop_commits` commits, and, with `older_checkpoint`, `latest` naming the
/// previous checkpoint. `launch --resume` must end with the undisturbed run's commits and weights.
fn resume_an_edited_copy(drop_commits: usize, older_checkpoint: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let target = tiny_target(dir);
    let want = reference(&target);
    let run_dir = dir.join("run");
    copy_dir(&want.run_dir, &run_dir);
    let journal = run_dir.join("journal.jsonl");
    let text = fs::read_to_string(&journal).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    assert!(lines.pop().unwrap().contains(r#""event":"end""#));
    for _ in 0..drop_commits {
        // Worker exits at the end come after the last commit.
        let last_commit = lines
            .iter()
            .rposition(|l| l.contains(r#""event":"commit""#))
            .unwrap();
        lines.truncate(last_commit);
    }
    fs::write(&journal, lines.join("\n") + "\n").unwrap();
    if older_checkpoint {
        let checkpoints = run_dir.join("checkpoints");
        let mut steps: Vec<u64> = fs::read_dir(&checkpoints)
            .unwrap()
            .filter_map(|e| {
                e.ok()?
                    .file_name()
                    .to_str()?
                    .strip_prefix("step-")?
                    .parse()
                    .ok()
            })
            .collect();
        steps.sort_unstable();
        fs::write(checkpoints.join("latest"), format!("step-{}", steps[0])).unwrap();
        fs::remove_dir_all(checkpoints.join(format!("step-{}", steps[1]))).unwrap();
    }
    let out = finish(resume(&run_dir, &[]));
    assert_eq!(
        journal_events(&run_dir, "end").last().unwrap()["status"],
        "completed"
    );
    // Committing from the checkpoint is said aloud: a WARN line and a journal event of its own.
    let forward = journal_events(&run_dir, "committed_from_checkpoint");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if drop_commits > 0 && !older_checkpoint {
        assert_eq!(forward.len(), 1, "{forward:?}");
        assert_eq!(
            forward[0]["to_step"].as_u64().unwrap() - forward[0]["from_step"].as_u64().unwrap(),
            drop_commits as u64
        );
        assert!(
            stderr.contains("WARN") && stderr.contains("ahead of the journal"),
            "{stderr}"
        );
    } else {
        assert!(forward.is_empty(), "{forward:?}");
    }
    assert_eq!(effective_commits(&run_dir), want.commits);
    assert!(
        final_weights(&run_dir) == want.weights,
        "final model.safetensors differs from the undisturbed run's"
    );
    // Behind the journal, the resume replays (a rewind); ahead of it, it commits forward.
    assert_eq!(
        journal_events(&run_dir, "rewind").len(),
        usize::from(older_checkpoint)
    );
    assert_clean(&run_dir);
}

/// The orchestrator died after the last commit, before the drafter's final checkpoint: the resume
/// replays from the previous checkpoint.
#[test]
fn resume_after_the_last_commit_replays_from_the_checkpoint() {
    resume_an_edited_copy(0, true);
}

/// The orchestrator died after the drafter checkpointed batches whose commits never reached the
/// journal: the resume commits them from the plan instead of training them twice.
#[test]
fn resume_with_a_checkpoint_ahead_of_the_journal_commits_forward() {
    resume_an_edited_copy(3, false);
}

#[test]
fn checkpoints_load_with_python_safetensors_and_metrics_are_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let run = reference(&target);
    let root = workspace_root();
    let checkpoints = run.run_dir.join("checkpoints");
    let mut names: Vec<String> = fs::read_dir(&checkpoints)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 2, "--keep-checkpoints 2: {names:?}");
    let last = fs::read_to_string(checkpoints.join("latest")).unwrap();
    let out = Command::new(test_python())
        .arg(root.join("scripts/check_checkpoint.py"))
        .arg(checkpoints.join(last.trim()))
        .output()
        .unwrap();
    let summary: Value = serde_json::from_str(&stdout_ok(&out)).unwrap();
    assert_eq!(summary["problems"], serde_json::json!([]));
    assert_eq!(summary["tensors"], 14, "fc, two norms and 11 per layer");
    let config: Value = serde_json::from_slice(
        &fs::read(checkpoints.join(last.trim()).join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        config["architectures"],
        serde_json::json!(["DFlashDraftModel"])
    );
    assert_eq!(config["block_size"], 16);
    assert_eq!(config["dflash_config"]["mask_token_id"], 599);
    assert_eq!(
        config["dflash_config"]["target_layer_ids"],
        serde_json::json!([2])
    );
    // One training line per optimiser step, the last step at the end of the schedule.
    let lines: Vec<Value> = fs::read_to_string(run.run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l["kind"] == "train")
        .collect();
    assert!(!lines.is_empty());
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=lines.len() as u64).collect::<Vec<_>>());
    assert!(lines.iter().all(|l| l["loss"].as_f64().unwrap().is_finite()
        && l["accuracy_by_position"].as_array().unwrap().len() == 15
        && l["grad_norm"].as_f64().unwrap() > 0.0));
    assert!(lines.last().unwrap()["lr"].as_f64().unwrap() < 1e-4);
}

/// A launch that must be refused before any worker starts.
fn refused(target: &Path, extra: &[&str], needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut c = launch(&run_dir, target);
    c.args(extra).stderr(Stdio::piped());
    let out = c.output().unwrap();
    assert_refused(&out, 2, needle);
    assert!(
        !run_dir.join("logs").exists() && !run_dir.join("journal.jsonl").exists(),
        "nothing started"
    );
}

#[test]
fn bad_targets_and_settings_are_refused_at_launch() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    // Settings against the target (4 layers, vocabulary 600).
    refused(&target, &["--target-layer-ids", "1,4"], "layer 4 is beyond");
    refused(
        &target,
        &["--mask-token-id", "600"],
        "outside the target's vocabulary",
    );
    // A model directory missing its weights.
    let no_weights = dir.path().join("no-weights");
    fs::create_dir(&no_weights).unwrap();
    fs::copy(target.join("config.json"), no_weights.join("config.json")).unwrap();
    let out = Command::new(bin("dflash-orch"))
        .arg("launch")
        .args(RUN_FLAGS)
        .arg("--target-model")
        .arg(&no_weights)
        .arg("--run-dir")
        .arg(dir.path().join("r1"))
        .output()
        .unwrap();
    assert_refused(&out, 2, "has neither model.safetensors");
    // Without config.json.
    let empty = dir.path().join("empty");
    fs::create_dir(&empty).unwrap();
    refused(&empty, &[], "config.json: cannot read");
    // Another architecture.
    let llama = dir.path().join("llama");
    fs::create_dir(&llama).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        fs::copy(target.join(f), llama.join(f)).unwrap();
    }
    let mut config: Value =
        serde_json::from_slice(&fs::read(target.join("config.json")).unwrap()).unwrap();
    config["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    fs::write(llama.join("config.json"), config.to_string()).unwrap();
    refused(&llama, &[], "unsupported architecture");
    // Weights that stop short of what config.json promises.
    let short = dir.path().join("short");
    fs::create_dir(&short).unwrap();
    fs::copy(target.join("config.json"), short.join("config.json")).unwrap();
    let weights = fs::read(target.join("model.safetensors")).unwrap();
    fs::write(
        short.join("model.safetensors"),
        &weights[..weights.len() - 1000],
    )
    .unwrap();
    refused(&short, &[], "file truncated");
}

#[test]
fn a_dataset_beyond_the_target_vocabulary_is_refused_at_launch() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let jsonl = dir.path().join("data.jsonl");
    let ids: Vec<String> = (0..40).map(|i| (i * 20).to_string()).collect();
    fs::write(
        &jsonl,
        format!("{{\"input_ids\": [{}]}}\n", ids.join(",")).repeat(4),
    )
    .unwrap();
    let store = dir.path().join("store");
    stdout_ok(&orch(&[
        "prepare",
        "--input",
        jsonl.to_str().unwrap(),
        "--output",
        store.to_str().unwrap(),
    ]));
    let run_dir = dir.path().join("run");
    let out = Command::new(bin("dflash-orch"))
        .args([
            "launch",
            "--gpus",
            "cpu:2",
            "--stage",
            "dflash",
            "--max-len",
            "64",
            "--token-budget",
            "512",
            "--buckets",
            "auto:1",
        ])
        .arg("--target-model")
        .arg(&target)
        .arg("--data")
        .arg(&store)
        .arg("--run-dir")
        .arg(&run_dir)
        .output()
        .unwrap();
    assert_refused(&out, 2, "token id 600 in sample 0");
    assert!(!run_dir.join("logs").exists(), "no worker started");
}

/// SIGINT mid-run: the drafter writes a final checkpoint where it stands, the run exits 130 with
/// nothing left behind, and `--resume` ends with the undisturbed run's weights.
#[test]
fn sigint_checkpoints_where_the_drafter_stands_and_the_resume_matches() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let want = reference(&target);
    let run_dir = dir.path().join("run");
    let child = launch(&run_dir, &target).spawn().unwrap();
    wait_between_checkpoints(&run_dir);
    dflash_e2e::signal(child.id() as i32, "INT");
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_clean(&run_dir);
    // The final checkpoint is past the last periodic one.
    let root = run_dir.join("checkpoints");
    let latest = fs::read_to_string(root.join("latest")).unwrap();
    let step: u64 = latest
        .trim()
        .strip_prefix("step-")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        !step.is_multiple_of(4) || effective_commits(&run_dir).len() as u64 == 2 * step,
        "step {step}"
    );
    finish(resume(&run_dir, &[]));
    assert_eq!(effective_commits(&run_dir), want.commits);
    assert!(
        final_weights(&run_dir) == want.weights,
        "final model.safetensors differs from the undisturbed run's"
    );
}

/// The run directory fills up while a checkpoint is written (a 1.2 MB tmpfs in a mount namespace
/// of our own, room for one checkpoint): the run stops with the reason, the previous checkpoint
/// stays whole and `latest` names it, and no half-written checkpoint is left.
#[test]
fn a_full_disk_while_checkpointing_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let mnt = dir.path().join("small");
    let out_dir = dir.path().join("after");
    fs::create_dir(&mnt).unwrap();
    let flags: Vec<String> = RUN_FLAGS.iter().map(|f| f.to_string()).collect();
    let script = format!(
        "mount -t tmpfs -o size=1200k tmpfs {m} && {bin} launch {flags} --target-model {t} --run-dir {m}/run; echo \"rc=$?\"; cp -r {m}/run {o}",
        bin = bin("dflash-orch").display(),
        flags = flags.join(" "),
        t = target.display(),
        m = mnt.display(),
        o = out_dir.display(),
    );
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("rc=1"), "{stdout}\n{stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let root = out_dir.join("checkpoints");
    let latest = fs::read_to_string(root.join("latest")).unwrap();
    let whole = root.join(latest.trim());
    let names: Vec<String> = fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| !n.contains(".tmp")),
        "no half-written checkpoint: {names:?}"
    );
    let tensors =
        candle_core::safetensors::load(whole.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    assert!(tensors.contains_key("fc.weight"));
    let state: Value =
        serde_json::from_slice(&fs::read(whole.join("state.json")).unwrap()).unwrap();
    assert!(state["step"].as_u64().unwrap() >= 4);
}

/// A GPU that died does not hold the run hostage: a run on three workers (two targets), killed
/// between checkpoints, resumed on two (one target), ends with the undisturbed run's weights.
#[test]
fn a_resume_on_fewer_targets_ends_with_identical_weights() {
    let (_dir, target, run_dir) = killed_between_checkpoints();
    let want = reference(&target);
    finish(resume(&run_dir, &["--gpus", "cpu:2"]));
    let resumed = journal_events(&run_dir, "resume");
    assert_eq!(resumed[0]["changes"]["gpus"], "cpu:2", "{resumed:?}");
    // One target and the drafter this time.
    let starts = journal_events(&run_dir, "worker_start");
    assert!(
        starts
            .iter()
            .any(|s| s["role"] == "target" && s["worker"] == 1)
    );
    assert_eq!(effective_commits(&run_dir), want.commits);
    assert!(
        final_weights(&run_dir) == want.weights,
        "final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
}

/// A run of the tiny target SIGKILLed (the orchestrator) between checkpoints: the temporary
/// directory, the target and the run directory.
fn killed_between_checkpoints() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let run_dir = dir.path().join("run");
    let mut child = launch(&run_dir, &target).spawn().unwrap();
    wait_between_checkpoints(&run_dir);
    kill_and_wait(&mut child);
    (dir, target, run_dir)
}

/// A checkpoint of another run (same drafter shape, other seed and learning rate) is refused by
/// the drafter, naming what differs, instead of being trained on as if it were this run's.
#[test]
fn a_checkpoint_of_another_run_is_refused_naming_what_differs() {
    let (_dir, _target, run_dir) = killed_between_checkpoints();
    // The same directory, as if its journal had been written by a run with other settings.
    let journal = run_dir.join("journal.jsonl");
    let text = fs::read_to_string(&journal).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let mut run: Value = serde_json::from_str(&lines[0]).unwrap();
    run["config"]["planner"]["seed"] = 7.into();
    run["config"]["dflash"]["seed"] = 7.into();
    run["config"]["dflash"]["lr"] = 1e-3.into();
    lines[0] = run.to_string();
    fs::write(&journal, lines.join("\n") + "\n").unwrap();
    let weights_before = final_weights(&run_dir);
    let out = resume(&run_dir, &[]).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("belongs to another run"), "{stderr}");
    assert!(
        stderr.contains("optimiser, planner, seed"),
        "names exactly the fields that differ: {stderr}"
    );
    assert!(
        final_weights(&run_dir) == weights_before,
        "the checkpoint is untouched"
    );
    assert_clean(&run_dir);
}

/// A target re-initialised at the same path (the same config and weight headers, other weights)
/// is another run's target: the resume is refused naming `target_weights`, for another seed and
/// for a copy whose weights differ in one value. A checkpoint written before the fingerprint had
/// that field resumes on the original target, saying it went unchecked, and ends with the
/// undisturbed run's weights.
#[test]
fn a_resume_against_a_reinitialised_target_is_refused() {
    let (_dir, target, run_dir) = killed_between_checkpoints();
    let want = reference(&target);
    let original = fs::read(target.join("model.safetensors")).unwrap();
    let weights_before = final_weights(&run_dir);
    let reinit = |seed: &str| {
        stdout_ok(&orch(&[
            "init-tiny",
            "--seed",
            seed,
            "--force",
            "--output",
            target.to_str().unwrap(),
        ]));
    };
    let refused_for_weights = || {
        let out = resume(&run_dir, &[]).wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("belongs to another run: it differs in target_weights ("),
            "names exactly the target's weights: {stderr}"
        );
        assert!(
            final_weights(&run_dir) == weights_before,
            "checkpoint untouched"
        );
        assert_clean(&run_dir);
    };
    reinit("7");
    let reinitialised = fs::read(target.join("model.safetensors")).unwrap();
    assert_eq!(reinitialised.len(), original.len(), "the same shape");
    refused_for_weights();
    // The original file with one byte of the last tensor's data changed: headers equal.
    let mut edited = original.clone();
    // The low byte of the last value (f32 or bf16): a mantissa bit, so the weight stays finite.
    let last = edited.len() - 4;
    edited[last] ^= 0x40;
    fs::write(target.join("model.safetensors"), &edited).unwrap();
    refused_for_weights();
    // Back to the original target, and the checkpoints as written before the field existed.
    fs::write(target.join("model.safetensors"), &original).unwrap();
    for entry in fs::read_dir(run_dir.join("checkpoints")).unwrap().flatten() {
        let state = entry.path().join("state.json");
        if !state.is_file() {
            continue;
        }
        let mut json: Value = serde_json::from_slice(&fs::read(&state).unwrap()).unwrap();
        let removed = json["fingerprint"]
            .as_object_mut()
            .unwrap()
            .remove("target_weights");
        assert!(removed.is_some(), "{} had the field", state.display());
        fs::write(&state, serde_json::to_vec(&json).unwrap()).unwrap();
    }
    finish(resume(&run_dir, &[]));
    let log: String = fs::read_dir(run_dir.join("logs"))
        .unwrap()
        .flatten()
        .map(|e| fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    assert!(
        log.contains("predates the fingerprint's target_weights"),
        "the unchecked field is said: {log}"
    );
    assert_eq!(effective_commits(&run_dir), want.commits);
    assert!(
        final_weights(&run_dir) == want.weights,
        "final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
}

/// A fresh launch into a directory holding an earlier run's checkpoints (its journal gone) is
/// refused, and creates nothing there.
#[test]
fn a_fresh_launch_never_adopts_an_earlier_runs_checkpoint() {
    let (_dir, target, run_dir) = killed_between_checkpoints();
    for name in ["journal.jsonl", "metrics.jsonl"] {
        let _ = fs::remove_file(run_dir.join(name));
    }
    let before: Vec<_> = fs::read_dir(&run_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let out = launch(&run_dir, &target).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("holds an earlier run (checkpoints"),
        "{stderr}"
    );
    assert!(stderr.contains("--resume"), "{stderr}");
    let after: Vec<_> = fs::read_dir(&run_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(before, after, "nothing created or removed");
    // The killed run's rings: `clean` removes them.
    assert!(
        orch(&["clean", "--run-dir", run_dir.to_str().unwrap()])
            .status
            .success()
    );
    assert_clean(&run_dir);
}

/// A NaN in the features (a target worker poisons every position of one token id): the run
/// stops at once, naming the batch, the target worker and the layer, and leaves nothing behind;
/// resumed with `--on-nonfinite skip`, every step it would have poisoned is skipped, journalled
/// and counted in metrics, and the run completes with finite weights.
#[test]
fn a_nan_in_the_features_stops_the_run_or_skips_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let run_dir = dir.path().join("run");
    let poison = |c: &mut Command| {
        c.env("DFLASH_WORKER_POISON_TOKEN", "517");
    };
    let mut c = launch_with(&run_dir, &target, &["--target-layer-ids", "1,2"]);
    poison(&mut c);
    let out = c.output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("NaN or infinity in the hidden states of target layer 1")
            && err.contains("from target worker")
            && err.contains("--on-nonfinite skip"),
        "{err}"
    );
    assert_clean(&run_dir);

    let mut c = launch_with(
        &run_dir,
        &target,
        &[
            "--target-layer-ids",
            "1,2",
            "--resume",
            "--on-nonfinite",
            "skip",
        ],
    );
    poison(&mut c);
    finish(c.spawn().unwrap());
    let skipped = journal_events(&run_dir, "skipped_step");
    assert!(!skipped.is_empty(), "no step was skipped");
    assert!(
        skipped
            .iter()
            .all(|s| s["reason"].as_str().unwrap().contains("target layer 1")),
        "{skipped:?}"
    );
    let lines = train_lines(&run_dir);
    let marked = lines.iter().filter(|l| !l["skipped"].is_null()).count();
    assert_eq!(marked, skipped.len());
    assert_eq!(
        lines.last().unwrap()["skipped_steps"].as_u64().unwrap() as usize,
        skipped.len()
    );
    assert!(
        lines
            .iter()
            .all(|l| l["loss"].as_f64().unwrap().is_finite())
    );
    assert_eq!(journal_events(&run_dir, "end")[0]["status"], "completed");
}

/// `--loss kd` end to end: the target workers hand over their last hidden state too, the drafter
/// distils the target's distribution through the frozen lm_head, and the loss falls; the run's
/// fingerprint names the loss, so a checkpoint of a cross-entropy run is not resumed into it.
#[test]
fn a_distillation_run_trains_and_its_loss_is_in_the_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let run_dir = dir.path().join("run");
    let flags = [
        "--loss",
        "kd",
        "--kd-temperature",
        "2",
        "--target-layer-ids",
        "1,2",
    ];
    finish(launch_with(&run_dir, &target, &flags).spawn().unwrap());
    let lines = train_lines(&run_dir);
    let loss = |l: &Value| l["loss"].as_f64().unwrap();
    let tenth = lines.len() / 5;
    let early: f64 = lines[..tenth].iter().map(loss).sum::<f64>() / tenth as f64;
    let late: f64 = lines[lines.len() - tenth..].iter().map(loss).sum::<f64>() / tenth as f64;
    assert!(late < early, "loss {early} -> {late}");
    let state = latest_state(&run_dir);
    let reference = reference_with(&target, &["--target-layer-ids", "1,2"]);
    let ce_state = latest_state(&reference.run_dir);
    assert_ne!(
        state["fingerprint"]["loss"],
        ce_state["fingerprint"]["loss"]
    );
    assert_eq!(
        state["fingerprint"]["data"],
        ce_state["fingerprint"]["data"]
    );
}
