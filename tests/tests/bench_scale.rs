//! `scripts/bench-scale` (a benchmark, run by hand) refuses bad options before it builds or runs
//! anything: exit 2 naming the option.

use std::process::Command;

use dflash_e2e::{script, test_python, workspace_root};

fn bench_scale(args: &[&str]) -> std::process::Output {
    Command::new(test_python())
        .arg(script("bench_scale.py"))
        .arg("--root")
        .arg(workspace_root())
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn bad_options_are_refused_with_exit_2_naming_them() {
    for (args, needle) in [
        (&["--batches", "0"][..], "--batches"),
        (&["--budgets", "16384,8192"][..], "--budgets"),
        (&["--budgets", "8192,lots"][..], "--budgets"),
        (&["--budgets", "4096"][..], "--max-len"),
        (&["--max-len", "-1"][..], "--max-len"),
        (&["--vocab", "100"][..], "--vocab"),
        (&["--anchor-chunk", "0"][..], "--anchor-chunk"),
        (&["--dtype", "b f16"][..], "--dtype"),
        (&["--feature-dtype", ""][..], "--feature-dtype"),
        (&["--launch-timeout", "nan"][..], "--launch-timeout"),
        (&["--time-limit", "0"][..], "--time-limit"),
        (&["--mem-cap", "-2"][..], "--mem-cap"),
        (&["--goal-ratio", "inf"][..], "--goal-ratio"),
        (&["--gpus", "0,1"][..], "--gpus"),
        (&["--seed", "x"][..], "--seed"),
        (&["--no-such-option"][..], "--no-such-option"),
    ] {
        let out = bench_scale(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("Traceback"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn help_describes_the_measurements() {
    let out = Command::new("bash")
        .arg(script("bench-scale"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--budgets",
        "--anchor-chunk",
        "--mem-cap",
        "peak RSS",
        "Exit status",
    ] {
        assert!(text.contains(needle), "{needle}");
    }
}
