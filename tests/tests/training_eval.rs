//! Served acceptance during training (`launch --eval-every`): the held-out samples never reach a
//! plan, τ of the checkpoint of every N-th step and of the last one lands in metrics.jsonl (and
//! `status`) while training goes on, and a run that cannot be evaluated is refused at launch.

use std::fs;
use std::path::Path;
use std::time::Duration;

use dflash_e2e::{
    alive, assert_clean, assert_refused, bin, child_with, journal_events, orch, signal, status,
    stdout_ok, wait_until,
};
use serde_json::Value;

/// A store of `rows` samples: a prompt of 6 to 11 tokens, then a reply with loss.
fn store(dir: &Path, rows: usize) -> std::path::PathBuf {
    let data = dir.join("data.jsonl");
    let mut text = String::new();
    for r in 0..rows {
        let prompt = 6 + r % 6;
        let ids: Vec<u32> = (0..prompt + 40)
            .map(|i| ((r * 13 + i * 7) % 580 + 5) as u32)
            .collect();
        let mask: Vec<u8> = (0..ids.len()).map(|i| u8::from(i >= prompt)).collect();
        text.push_str(&serde_json::json!({"input_ids": ids, "loss_mask": mask}).to_string());
        text.push('\n');
    }
    fs::write(&data, text).unwrap();
    let store = dir.join("store");
    stdout_ok(&orch(&[
        "prepare",
        "--input",
        data.to_str().unwrap(),
        "--output",
        store.to_str().unwrap(),
        "--min-loss-tokens",
        "1",
    ]));
    store
}

/// The arguments of a small DFlash launch of `epochs` epochs on `data`, then `extra`.
fn launch_args<'a>(
    target: &'a Path,
    run_dir: &'a Path,
    epochs: &'a str,
    data: &[&'a str],
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "launch",
        "--gpus",
        "cpu:3",
        "--topology",
        "2:1",
        "--stage",
        "dflash",
        "--target-model",
        target.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--epochs",
        epochs,
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
        "8",
        "--save-every",
        "1000",
    ];
    args.extend_from_slice(data);
    args.extend_from_slice(extra);
    args
}

fn launch(target: &Path, run_dir: &Path, data: &[&str], extra: &[&str]) -> std::process::Output {
    orch(&launch_args(target, run_dir, "2", data, extra))
}

#[test]
fn a_run_measures_served_acceptance_on_samples_it_never_trains_on() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny");
    stdout_ok(&orch(&["init-tiny", "--output", target.to_str().unwrap()]));
    let store = store(dir.path(), 120);
    let run_dir = dir.path().join("run");
    let out = launch(
        &target,
        &run_dir,
        &["--data", store.to_str().unwrap()],
        &[
            "--eval-every",
            "5",
            "--eval-holdout",
            "10",
            "--eval-max-new-tokens",
            "12",
        ],
    );
    stdout_ok(&out);
    // 10 of the 120 samples are held out of both epochs' plans.
    let trained: u64 = journal_events(&run_dir, "commit")
        .iter()
        .map(|c| c["samples"].as_u64().unwrap())
        .sum();
    assert_eq!(trained, 2 * 110);
    let prompts = fs::read_to_string(run_dir.join("eval/prompts.jsonl")).unwrap();
    assert_eq!(prompts.lines().count(), 10);
    for line in prompts.lines() {
        let ids = serde_json::from_str::<Value>(line).unwrap()["input_ids"]
            .as_array()
            .unwrap()
            .len();
        assert!(
            (6..=11).contains(&ids),
            "a prompt is the tokens before the loss: {ids}"
        );
    }
    let lines: Vec<Value> = fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let last_step = lines
        .iter()
        .filter(|l| l["kind"] == "train")
        .filter_map(|l| l["step"].as_u64())
        .max()
        .unwrap();
    let evals: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "eval").collect();
    let steps: Vec<u64> = evals.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(steps.first(), Some(&5), "{steps:?}");
    assert!(
        steps.iter().all(|s| s % 5 == 0 || *s == last_step),
        "{steps:?}"
    );
    assert_eq!(
        steps.last(),
        Some(&last_step),
        "the final checkpoint is evaluated"
    );
    for e in &evals {
        let tau = e["tau"].as_f64().unwrap();
        assert!((1.0..=16.0).contains(&tau), "{e}");
        assert_eq!(e["prompts"], 10);
        let hist: f64 = e["histogram"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_f64().unwrap())
            .sum();
        assert!((hist - 1.0).abs() < 1e-9);
    }
    // The report shows served τ beside the training proxy.
    let report = dir.path().join("report.html");
    stdout_ok(&orch(&[
        "report",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--output",
        report.to_str().unwrap(),
    ]));
    let html = fs::read_to_string(&report).unwrap();
    assert!(
        html.contains("Served acceptance τ"),
        "no served τ in the report"
    );
    assert!(html.contains("Served acceptance and the training proxy"));
    // The linked checkpoints are gone once decoded.
    assert_eq!(
        fs::read_dir(run_dir.join("eval")).unwrap().count(),
        1,
        "only prompts.jsonl stays"
    );
}

#[test]
fn a_run_that_cannot_be_evaluated_is_refused_at_launch() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny");
    stdout_ok(&orch(&["init-tiny", "--output", target.to_str().unwrap()]));
    let run_dir = dir.path().join("run");
    assert_refused(
        &launch(
            &target,
            &run_dir,
            &["--synthetic", "50"],
            &["--eval-every", "5"],
        ),
        2,
        "--eval-prompts",
    );
    let prompts = dir.path().join("prompts.jsonl");
    fs::write(&prompts, "{\"input_ids\": [3, 4, 900]}\n").unwrap();
    assert_refused(
        &launch(
            &target,
            &run_dir,
            &["--synthetic", "50"],
            &[
                "--eval-every",
                "5",
                "--eval-prompts",
                prompts.to_str().unwrap(),
            ],
        ),
        2,
        "token id 900",
    );
    assert!(!run_dir.exists(), "nothing is left behind");
}

/// The launch of [`launch`] (four epochs) as a child process, its output piped.
fn spawn_launch(
    target: &Path,
    run_dir: &Path,
    store: &Path,
    extra: &[&str],
) -> std::process::Child {
    let data = ["--data", store.to_str().unwrap()];
    std::process::Command::new(bin("dflash-orch"))
        .args(launch_args(target, run_dir, "4", &data, extra))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// An eval worker that stops (SIGSTOP) during `--eval-every` never stalls the run: the control
/// socket keeps answering, the worker is killed at its deadline and the evaluation reported as
/// failed while training goes on; and a stop signal during a stopped evaluation ends the run at
/// once, cleanly (an `end` line, no rings, no socket).
#[test]
fn a_stopped_eval_worker_never_stalls_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny");
    stdout_ok(&orch(&["init-tiny", "--output", target.to_str().unwrap()]));
    let store = store(dir.path(), 120);
    let eval = [
        "--eval-every",
        "2",
        "--eval-holdout",
        "4",
        "--eval-max-new-tokens",
        "400",
    ];

    // 1. Stopped, then killed at the deadline; the run completes.
    let run_dir = dir.path().join("deadline");
    let mut flags = eval.to_vec();
    flags.extend(["--job-timeout", "3"]);
    let child = spawn_launch(&target, &run_dir, &store, &flags);
    let worker = child_with(child.id(), "--eval", Duration::from_secs(120));
    signal(worker as i32, "STOP");
    // The control socket answers while the evaluation hangs.
    let s = status(&run_dir);
    assert!(s["run"].is_object(), "{s}");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!alive(u64::from(worker)), "the stopped worker was killed");
    let metrics = fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let failed: Vec<Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "event" && l["event"] == "eval_failed")
        .collect();
    assert!(
        failed
            .iter()
            .any(|f| f.to_string().contains("--job-timeout")),
        "{failed:?}"
    );
    assert_eq!(journal_events(&run_dir, "end")[0]["status"], "completed");

    // 2. Stopped, then the run is interrupted (SIGINT, then SIGTERM): it ends at once.
    for sig in ["INT", "TERM"] {
        let run_dir = dir.path().join(format!("interrupted-{sig}"));
        let child = spawn_launch(&target, &run_dir, &store, &eval);
        let worker = child_with(child.id(), "--eval", Duration::from_secs(120));
        signal(worker as i32, "STOP");
        signal(child.id() as i32, sig);
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(130),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        wait_until(
            "the stopped worker to be gone",
            Duration::from_secs(10),
            || !alive(u64::from(worker)),
        );
        assert_eq!(journal_events(&run_dir, "end")[0]["status"], "interrupted");
        assert_clean(&run_dir);
        assert!(!dflash_common::run_dir::control_socket(&run_dir).exists());
    }
}

/// A holdout that leaves nothing to train on is refused before anything starts, saying the
/// samples were held out (not "dropped"); one that leaves something runs.
#[test]
fn a_holdout_of_the_whole_store_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny");
    stdout_ok(&orch(&["init-tiny", "--output", target.to_str().unwrap()]));
    let store = store(dir.path(), 40);
    let run_dir = dir.path().join("run");
    for holdout in ["40", "41", "1000"] {
        let out = launch(
            &target,
            &run_dir,
            &["--data", store.to_str().unwrap()],
            &["--eval-every", "5", "--eval-holdout", holdout],
        );
        assert_refused(
            &out,
            2,
            &format!("--eval-holdout {holdout}: the store has 40 samples to train on"),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("leaves none") && !err.contains("dropped"),
            "{err}"
        );
        assert!(!run_dir.exists());
    }
}
