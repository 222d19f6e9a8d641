//! Served acceptance, checked by the official DFlash code: a small `demo` (the target writes the
//! training replies, the drafter trains, `eval` measures τ before and after on held-out
//! prompts), then the PyPI package `dflash` loads the trained checkpoint strictly (no missing or
//! unexpected tensor, every weight from the file) and decodes the same prompts with our target:
//! its outputs, its acceptance at every verify step and its τ equal ours, and both equal plain
//! greedy decoding. The official venv comes from `scripts/setup-test-env`.
//!
//! Then sampling (`eval --temperature`): on both engines, one prompt decoded 500 times gives
//! first three tokens distributed as the target's own sampling (a chi-square test against the
//! exact distribution, `python/tests/check_sampling.py`, at significance 0.001, with the power to
//! reject the distribution of another temperature); and the torch engine's sampled decode equals
//! the official package's `dflash_generate` (its `_rejection_sample`) token for token when both
//! draw from the same seed.
//!
//! Distillation earns its place as an option on the same demo: trained with `--loss kd` (the
//! target's next-token distribution at the default temperature) instead of cross-entropy (the
//! same prompts, the target's replies, plan, steps and held-out prompts), the drafter accepts at
//! least as many tokens per verify step when served, and decodes losslessly. Alignment or
//! temperature mistakes in the distillation target show here as a lower τ. The kd demo runs
//! beside the checks above, in its own directory; the cross-entropy side is the demo they check.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use dflash_e2e::{
    assert_sampled_like_the_target, bin, demo_report, orch, script, stdout_ok, workspace_root,
};
use serde_json::Value;

fn official_python() -> PathBuf {
    let python = std::env::var_os("DFLASH_OFFICIAL_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    assert!(
        python.exists(),
        "{} not found: run scripts/setup-test-env first (README's test command does)",
        python.display()
    );
    python
}

/// The 1,000-prompt demo in `run`, trained with `loss`, started; its progress goes to
/// `run.log` (a pipe nobody reads while the demo runs would stall it once full).
fn spawn_demo(run: &Path, loss: &str) -> Started {
    let log = std::fs::File::create(run.with_extension("log")).unwrap();
    let child = Command::new(bin("dflash-orch"))
        .args(["demo", "--run-dir"])
        .arg(run)
        .args(["--samples", "1000", "--epochs", "6"])
        .args(["--loss", loss, "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    Started(Some(child))
}

/// A started demo, killed if the test ends before it has waited for it.
struct Started(Option<Child>);

impl Drop for Started {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `--json` summary of the demo started in `run`, once it has finished.
fn demo_summary(mut started: Started, run: &Path, loss: &str) -> Value {
    let out = started.0.take().unwrap().wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "demo --loss {loss}: {}",
        std::fs::read_to_string(run.with_extension("log")).unwrap_or_default()
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Held-out prompts decoded sampled by both sides.
const SAMPLED_PROMPTS: usize = 4;

#[test]
fn the_official_package_loads_our_checkpoint_and_decodes_as_eval_does() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("demo");
    let kd_run = dir.path().join("demo-kd");
    let kd = spawn_demo(&kd_run, "kd");
    let demo = demo_summary(spawn_demo(&run, "ce"), &run, "ce");
    let (before, after) = (
        demo["served"]["before"]["tau"].as_f64().unwrap(),
        demo["served"]["after"]["tau"].as_f64().unwrap(),
    );
    // An untrained drafter agrees with nothing; the trained one must gain at least 1.5x that.
    assert!(before < 1.05, "untrained τ {before}");
    assert!(after >= 1.5 * before, "τ {before} -> {after}");
    assert_eq!(demo["served"]["after"]["lossless"], true);

    // The demo's eval of the held-out prompts (its report), with their token ids for the
    // official decoder.
    let checkpoint = demo["checkpoint"].as_str().unwrap();
    let target = run.join("target");
    let ours = demo_report(&demo, "after");
    assert_eq!(ours["tau"].as_f64().unwrap(), after);
    let prompts = dir.path().join("prompts.jsonl");
    let per = ours["per_prompt"].as_array().unwrap();
    let rows: Vec<String> = per
        .iter()
        .map(|p| serde_json::json!({"input_ids": p["prompt_ids"]}).to_string())
        .collect();
    std::fs::write(&prompts, rows.join("\n") + "\n").unwrap();

    let official = Command::new(official_python())
        .arg(script("official_dflash.py"))
        .args(["--target-model", target.to_str().unwrap()])
        .args(["--drafter", checkpoint])
        .args(["--prompts", prompts.to_str().unwrap()])
        .args(["--max-new-tokens", "64", "--stop-token-ids", "2"])
        .output()
        .unwrap();
    let theirs: Value = serde_json::from_slice(&official.stdout).unwrap_or_else(|e| {
        panic!(
            "official_dflash.py: {e}\n{}",
            String::from_utf8_lossy(&official.stderr)
        )
    });
    assert!(official.status.success(), "{theirs}");
    assert_eq!(theirs["lossless"], true);
    let their_tau = theirs["tau"].as_f64().unwrap();
    assert!(
        (their_tau - after).abs() <= 0.02 * after,
        "official τ {their_tau}, ours {after}"
    );
    for (i, (o, t)) in per
        .iter()
        .zip(theirs["prompts"].as_array().unwrap())
        .enumerate()
    {
        assert_eq!(
            o["output_ids"], t["output_ids"],
            "prompt {i}: outputs differ"
        );
        assert_eq!(o["output_ids"], t["baseline_ids"], "prompt {i}: not greedy");
        let steps = t["acceptance_lengths"].as_array().unwrap().len();
        assert_eq!(o["steps"].as_u64().unwrap() as usize, steps, "prompt {i}");
    }

    // Sampling. The torch engine draws in the official package's order: with the same seed its
    // sampled decode is the official one, token for token, and so is τ. On the first prompts
    // (each draws from its own stream, as in a decode of them all): at temperature 1 every
    // prompt is tens of verify steps.
    let prompts = dir.path().join("sampled-prompts.jsonl");
    std::fs::write(&prompts, rows[..SAMPLED_PROMPTS].join("\n") + "\n").unwrap();
    let python = official_python();
    let torch = ["--engine", "torch", "--python", python.to_str().unwrap()];
    let sample = ["--temperature", "1", "--top-p", "0.95", "--seed", "7"];
    let ours: Value = serde_json::from_str(&stdout_ok(&orch(
        &[
            &[
                "eval",
                "--target-model",
                target.to_str().unwrap(),
                "--drafter",
                checkpoint,
                "--prompts",
                prompts.to_str().unwrap(),
                "--max-new-tokens",
                "64",
                "--json",
            ][..],
            &torch,
            &sample,
        ]
        .concat(),
    )))
    .unwrap();
    assert_eq!(ours["lossless"], Value::Null, "{ours}");
    assert_eq!(ours["sampling"]["temperature"], 1.0);
    let official = Command::new(&python)
        .arg(script("official_dflash.py"))
        .args(["--target-model", target.to_str().unwrap()])
        .args(["--drafter", checkpoint])
        .args(["--prompts", prompts.to_str().unwrap()])
        .args(["--max-new-tokens", "64", "--stop-token-ids", "2"])
        .args(sample)
        .output()
        .unwrap();
    assert!(
        official.status.success(),
        "{}",
        String::from_utf8_lossy(&official.stderr)
    );
    let theirs: Value = serde_json::from_slice(&official.stdout).unwrap();
    let (sampled, their_sampled) = (
        ours["per_prompt"].as_array().unwrap(),
        theirs["prompts"].as_array().unwrap(),
    );
    assert_eq!(
        (sampled.len(), their_sampled.len()),
        (SAMPLED_PROMPTS, SAMPLED_PROMPTS)
    );
    for (i, (o, t)) in sampled.iter().zip(their_sampled).enumerate() {
        assert_eq!(
            o["output_ids"], t["output_ids"],
            "prompt {i}: sampled outputs differ"
        );
    }
    let (tau, their_tau) = (
        ours["tau"].as_f64().unwrap(),
        theirs["tau"].as_f64().unwrap(),
    );
    assert!(
        (tau - their_tau).abs() <= 0.02 * their_tau,
        "τ {tau}, official {their_tau}"
    );
    // Some drafted token was kept somewhere (τ counts the gained token of every step).
    assert!(tau > 1.0, "sampled τ {tau}");

    // Lossless in distribution: the first prompt 500 times, three new tokens each.
    let samplings: [&[&str]; 3] = [
        &["--temperature", "1", "--seed", "11"],
        &[
            "--temperature",
            "0.8",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
            "--seed",
            "12",
        ],
        &[&torch[..], &["--temperature", "1", "--seed", "13"]].concat(),
    ];
    for extra in samplings {
        let verdict = assert_sampled_like_the_target(
            dir.path(),
            &target,
            checkpoint,
            &per[0]["prompt_ids"],
            extra,
        );
        eprintln!("{extra:?}: {verdict}");
    }

    // Distillation: the kd demo against this one.
    let (ce, kd) = (&demo["served"], &demo_summary(kd, &kd_run, "kd")["served"]);
    assert_eq!(kd["after"]["lossless"], true, "kd: {kd}");
    // The same untrained drafter and prompts for both.
    assert_eq!(kd["before"]["tau"], ce["before"]["tau"], "kd");
    let kd_tau = kd["after"]["tau"].as_f64().unwrap();
    eprintln!("served τ after training: ce {after:.3}, kd {kd_tau:.3}");
    assert!(kd_tau >= after, "kd τ {kd_tau} < ce τ {after}");
}
