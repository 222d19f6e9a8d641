//! `dflash-orch demo --run-dir DIR [--force]` never deletes what it did not make: arguments are
//! checked before DIR is touched, and `--force` replaces only a directory holding the demo's
//! marker. Every case but the last is refused before any work starts; the last runs a small
//! demo. The decision itself is unit-tested in `commands::demo`.

use std::fs;
use std::path::Path;

use dflash_e2e::{assert_refused, orch, stdout_ok};
use dflash_orch::commands::demo::{MARKER, marker_text};

/// A directory holding a user's file, as a mistyped `--run-dir` might name.
fn precious(root: &Path) -> std::path::PathBuf {
    let dir = root.join("precious");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("thesis.tex"), "years of work").unwrap();
    dir
}

fn demo(dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["demo", "--run-dir", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    orch(&args)
}

fn assert_kept(dir: &Path) {
    assert_eq!(
        fs::read_to_string(dir.join("thesis.tex")).unwrap(),
        "years of work"
    );
    assert!(
        !dir.join(MARKER).exists(),
        "the demo marked a user's directory"
    );
}

#[test]
fn bad_arguments_are_refused_before_the_directory_is_touched() {
    let root = tempfile::tempdir().unwrap();
    let dir = precious(root.path());
    for bad in [
        ["--samples", "1"],
        ["--epochs", "0"],
        ["--kd-temperature", "0"],
        ["--loss", "kl"],
    ] {
        let mut args = vec!["--force"];
        args.extend_from_slice(&bad);
        let out = demo(&dir, &args);
        assert_refused(&out, 2, bad[0]);
        assert_kept(&dir);
    }
}

#[test]
fn force_refuses_a_directory_the_demo_did_not_make() {
    let root = tempfile::tempdir().unwrap();
    let dir = precious(root.path());
    let out = demo(&dir, &["--force", "--samples", "50", "--epochs", "1"]);
    assert_refused(&out, 2, "refusing to replace");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(dir.to_str().unwrap()) && stderr.contains(MARKER),
        "the refusal names the directory and why: {stderr}"
    );
    assert_kept(&dir);

    let out = demo(&dir, &[]);
    assert_refused(&out, 2, "not made by the demo");
    assert_kept(&dir);
}

#[test]
fn a_file_named_like_the_marker_but_not_written_by_the_demo_does_not_count() {
    let root = tempfile::tempdir().unwrap();
    let dir = precious(root.path());
    fs::write(dir.join(MARKER), "my settings").unwrap();
    let out = demo(&dir, &["--force"]);
    assert_refused(&out, 2, "refusing to replace");
    assert_eq!(
        fs::read_to_string(dir.join("thesis.tex")).unwrap(),
        "years of work"
    );
    assert_eq!(fs::read_to_string(dir.join(MARKER)).unwrap(), "my settings");
}

#[test]
fn a_file_is_never_a_run_dir() {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("notes.txt");
    fs::write(&file, "keep me").unwrap();
    for extra in [&[][..], &["--force"][..]] {
        let out = demo(&file, extra);
        assert_refused(&out, 2, "not a directory");
        assert_eq!(fs::read_to_string(&file).unwrap(), "keep me");
    }
}

#[test]
fn an_earlier_demo_needs_force_and_bad_arguments_still_keep_it() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("dflash-demo");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join(MARKER), marker_text()).unwrap();
    fs::write(dir.join("conversations.jsonl"), "{}\n").unwrap();

    let out = demo(&dir, &[]);
    assert_refused(&out, 2, "pass --force to replace it");
    assert!(dir.join("conversations.jsonl").exists());

    // Even a directory `--force` may replace stays until every argument has been checked.
    let out = demo(&dir, &["--force", "--samples", "1"]);
    assert_refused(&out, 2, "--samples");
    assert!(dir.join("conversations.jsonl").exists());
}

/// The one case that runs the demo, at the smallest size that completes (a few seconds).
#[test]
fn force_replaces_an_earlier_demo() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("dflash-demo");
    fs::create_dir_all(dir.join("run")).unwrap();
    fs::write(dir.join(MARKER), marker_text()).unwrap();
    fs::write(dir.join("run").join("stale.jsonl"), "{}\n").unwrap();

    let out = demo(
        &dir,
        &[
            "--force",
            "--samples",
            "50",
            "--epochs",
            "5",
            "--loss",
            "mix",
            "--kd-temperature",
            "0.5",
            "--json",
        ],
    );
    let summary: serde_json::Value = serde_json::from_str(&stdout_ok(&out)).unwrap();
    assert!(summary["steps"].as_u64().unwrap() >= 10, "{summary}");
    // The loss options reach the run.
    let journal = fs::read_to_string(dir.join("run").join("journal.jsonl")).unwrap();
    let run: serde_json::Value = serde_json::from_str(journal.lines().next().unwrap()).unwrap();
    let dflash = &run["config"]["dflash"];
    assert_eq!(
        (dflash["loss"].as_str(), dflash["kd_temperature"].as_f64()),
        (Some("mix"), Some(0.5))
    );
    assert!(
        !dir.join("run").join("stale.jsonl").exists(),
        "not replaced"
    );
    assert_eq!(fs::read_to_string(dir.join(MARKER)).unwrap(), marker_text());
    assert_eq!(
        fs::read_to_string(dir.join("conversations.jsonl"))
            .unwrap()
            .lines()
            .count(),
        50
    );
}

/// The smallest demo runs to its figures (its tenths are single steps, said so) instead of
/// failing after training.
#[test]
fn the_smallest_demo_shows_its_figures_with_a_note() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("small");
    let out = demo(&dir, &["--samples", "50", "--epochs", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("note       only"), "{err}");
    assert!(
        err.contains("optimiser steps (--samples 50 --epochs 1)"),
        "{err}"
    );
    assert!(err.contains("result     over"), "{err}");
}
