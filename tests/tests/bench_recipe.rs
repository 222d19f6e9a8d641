//! `scripts/bench-recipe` (a benchmark, run by hand) refuses bad options before it writes or runs
//! anything: exit 2 naming the option, and no --out directory left behind.

use std::process::Command;

use dflash_e2e::{bin, script, test_python};

fn bench_recipe(out_dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(test_python())
        .arg(script("bench_recipe.py"))
        .arg("--python")
        .arg(test_python())
        .arg("--orch")
        .arg(bin("dflash-orch"))
        .arg("--out")
        .arg(out_dir)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn bad_options_are_refused_with_exit_2_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("bench");
    for (args, needle) in [
        (&["--recipes", "dflash3:ce"][..], "'dflash3:ce'"),
        (&["--recipes", "dflash:hinge"][..], "'dflash:hinge'"),
        (
            &["--recipes", "dflash:ce:stopgrad"][..],
            "stopgrad: dflash2 only",
        ),
        (
            &["--recipes", "dflash2:ce:nograd"][..],
            "'dflash2:ce:nograd'",
        ),
        (
            &["--recipes", "dflash:ce,dflash:ce"][..],
            "dflash:ce given twice",
        ),
        (&["--recipes", ""][..], "--recipes"),
        (
            &["--steps", "10", "--epochs", "2"][..],
            "--steps and --epochs",
        ),
        (&["--epochs", "0"][..], "--epochs"),
        (&["--lr", "0"][..], "--lr"),
        (&["--lr", "nan"][..], "--lr"),
        (&["--sample-temperature", "0"][..], "--sample-temperature"),
        (&["--gen-temperature", "inf"][..], "--gen-temperature"),
        (&["--target-hidden", "100"][..], "--target-hidden"),
        (
            &["--target-heads", "3", "--target-kv-heads", "2"][..],
            "--target-hidden",
        ),
        (&["--target-layer-ids", "0,9"][..], "--target-layer-ids 0,9"),
        (&["--target-layer-ids", "1,1"][..], "--target-layer-ids 1,1"),
        (&["--target-layer-ids", "one"][..], "--target-layer-ids"),
        (&["--reply-tokens", "4000"][..], "--reply-tokens"),
        (&["--vocab", "10"][..], "--vocab"),
        (&["--seed", "-1"][..], "--seed"),
        (&["--no-such-option"][..], "--no-such-option"),
    ] {
        let out = bench_recipe(&out_dir, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("Traceback"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(!out_dir.exists(), "{args:?} wrote {}", out_dir.display());
    }
    // Another tool's directory is never written into.
    std::fs::create_dir(&out_dir).unwrap();
    std::fs::write(out_dir.join("notes.txt"), "mine").unwrap();
    let out = bench_recipe(&out_dir, &["--quick"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("was not made by bench-recipe"), "{stderr}");
    let names: Vec<_> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["notes.txt"]);
}

#[test]
fn help_describes_the_measurements() {
    let out = Command::new("bash")
        .arg(script("bench-recipe"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["--quick", "--out", "τ", "prompt-lookup", "Exit status"] {
        assert!(text.contains(needle), "{needle}");
    }
}
