//! Distillation earns its place as an option: on the same small `demo` (the same prompts, the
//! target's replies, plan, steps and held-out prompts), a drafter trained with `--loss kd` (the
//! target's next-token distribution at the default temperature) accepts at least as many tokens
//! per verify step when served as one trained with cross-entropy, and both decode losslessly.
//! Alignment or temperature mistakes in the distillation target show here as a lower τ.

use std::process::{Command, Stdio};

use dflash_e2e::bin;
use serde_json::Value;

/// A 1,000-prompt demo trained with `loss`, started.
fn spawn_demo(dir: &std::path::Path, loss: &str) -> std::process::Child {
    Command::new(bin("dflash-orch"))
        .args(["demo", "--run-dir"])
        .arg(dir.join(loss))
        .args(["--samples", "1000", "--epochs", "6"])
        .args(["--loss", loss, "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Its `served` figures (`before` and `after` training), once it has finished.
fn served(child: std::process::Child, loss: &str) -> Value {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "demo --loss {loss}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let demo: Value = serde_json::from_slice(&out.stdout).unwrap();
    demo["served"].clone()
}

#[test]
fn distillation_serves_at_least_as_well_as_cross_entropy() {
    let dir = tempfile::tempdir().unwrap();
    // Both demos at once: they share nothing but the machine.
    let (ce, kd) = (spawn_demo(dir.path(), "ce"), spawn_demo(dir.path(), "kd"));
    let (ce, kd) = (served(ce, "ce"), served(kd, "kd"));
    for (loss, s) in [("ce", &ce), ("kd", &kd)] {
        assert_eq!(s["after"]["lossless"], true, "{loss}: {s}");
        // The same untrained drafter and prompts for both.
        assert_eq!(s["before"]["tau"], ce["before"]["tau"], "{loss}");
    }
    let (ce_tau, kd_tau) = (
        ce["after"]["tau"].as_f64().unwrap(),
        kd["after"]["tau"].as_f64().unwrap(),
    );
    eprintln!("served τ after training: ce {ce_tau:.3}, kd {kd_tau:.3}");
    // Training must have taught something for the comparison to mean anything.
    assert!(ce_tau >= 1.5, "ce τ {ce_tau}");
    assert!(kd_tau >= ce_tau, "kd τ {kd_tau} < ce τ {ce_tau}");
}
