//! `scripts/bench-step-account` (a benchmark, run by hand): its counts at the seeds' shape show
//! what the batched drafter step is for (it executes what it needs and syncs the host at most
//! twice; the legacy path recomputes logits, attends to masked keys and reads every gradient's
//! norm apart), and it refuses bad options with exit 2 naming them.

use std::process::Command;

use dflash_e2e::{script, test_python};
use serde_json::Value;

fn account(args: &[&str]) -> std::process::Output {
    Command::new(script("bench-step-account"))
        .arg("--python")
        .arg(test_python())
        .args(args)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap()
}

/// In one pass (`--anchor-chunk 3072`: the six sequences' 512 anchors together), where the
/// legacy path's recomputed logits and dense masks show most.
#[test]
fn the_batched_step_executes_what_it_needs_with_two_host_syncs() {
    let out = account(&["--seq-lens", "8192", "--anchor-chunk", "3072", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let legacy = &report["drafter"]["legacy 8192"];
    let batched = &report["drafter"]["batched 8192"];
    for r in [legacy, batched] {
        assert_eq!(r["tokens"], 49152, "{r}");
        // The useful work is the same step's: both paths count it alike.
        assert_eq!(r["flops_useful"], legacy["flops_useful"]);
    }
    let ratio = |r: &Value| r["executed_over_useful"].as_f64().unwrap();
    // The legacy path recomputes the head's logits and attends to every masked key.
    assert!(ratio(legacy) > 1.2, "{legacy}");
    assert!((0.99..=1.1).contains(&ratio(batched)), "{batched}");
    // One read per gradient tensor for the clip norm (57 tensors at 5 layers), and more.
    assert!(legacy["host_syncs"].as_u64().unwrap() > 57, "{legacy}");
    assert!(batched["host_syncs"].as_u64().unwrap() <= 2, "{batched}");
    let ops = |r: &Value| r["aten_ops"].as_f64().unwrap();
    assert!(ops(legacy) > 4.0 * ops(batched), "{legacy}\n{batched}");
    // The features cross to the device once: 49,152 tokens x 5 states x 4,096 x 2 bytes.
    for r in [legacy, batched] {
        assert!(
            r["h2d_bytes"].as_u64().unwrap() >= 49152 * 5 * 4096 * 2,
            "{r}"
        );
    }
}

#[test]
fn bad_options_are_refused_with_exit_2_naming_them() {
    for (args, needle) in [
        (&["--anchor-chunk", "0"][..], "--anchor-chunk '0': 0 is not"),
        (&["--anchor-chunk", "batched=x"][..], "'x' is not a count"),
        (
            &["--anchor-chunk", "fast=3"][..],
            "'fast' is not a step path",
        ),
        (
            &["--anchor-chunk", "legacy=188"][..],
            "no chunk for batched",
        ),
        (
            &["--anchor-chunk", "batched=1,batched=2"][..],
            "batched is given twice",
        ),
        (&["--seq-lens", "12"][..], "--seq-lens: 12"),
        (&["--seq-lens", "eight"][..], "--seq-lens 'eight'"),
        (&["--seq-lens", "99999"][..], "--seq-lens: 99999"),
        (&["--paths", "fast"][..], "--paths: 'fast'"),
        (&["--python"][..], "--python needs a path"),
        (&["--no-such-option"][..], "--no-such-option"),
    ] {
        let out = account(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("Traceback"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
