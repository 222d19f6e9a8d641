//! `dflash-orch plan` end to end: the real binary, real files, real exit codes.

use std::collections::BTreeSet;
use std::fs;

use dflash_e2e::{assert_refused, bin, orch, stdout_ok};
use serde_json::Value;

const SEED_BUCKETS: &str = "0,770,1216,1728,2432,3296,8192";

fn json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = stdout_ok(&orch(&all));
    assert_eq!(out.lines().count(), 1, "one JSON object on one line");
    serde_json::from_str(&out).expect("valid JSON")
}

#[test]
fn json_has_every_documented_key() {
    let v = json(&["plan", "--synthetic", "20000"]);
    for key in [
        "mode",
        "interleave",
        "epoch",
        "seed",
        "samples",
        "dropped",
        "truncated",
        "batches",
        "real_tokens",
        "padded_tokens",
        "padding_efficiency",
        "buckets",
        "max_same_bucket_run",
        "windows_3plus_same_bucket",
        "plan_ms",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    assert_eq!(v["mode"], "bucketed");
    assert_eq!(v["interleave"], "spread");
    assert_eq!(v["samples"], 20000);
    let buckets = v["buckets"].as_array().unwrap();
    assert_eq!(buckets.len(), 8, "auto:8 by default");
    let per_bucket: u64 = buckets.iter().map(|b| b["samples"].as_u64().unwrap()).sum();
    assert_eq!(per_bucket, 20000);
    let share: f64 = buckets
        .iter()
        .map(|b| b["batch_share"].as_f64().unwrap())
        .sum();
    assert!((share - 1.0).abs() < 1e-9);
    for b in buckets {
        for key in ["lo", "hi", "samples", "batches", "batch_share"] {
            assert!(b.get(key).is_some(), "bucket missing {key}");
        }
    }
}

#[test]
fn packed_counts_capacity_and_has_one_bucket() {
    let v = json(&["plan", "--synthetic", "20000", "--mode", "packed"]);
    let batches = v["batches"].as_u64().unwrap();
    assert_eq!(v["padded_tokens"].as_u64().unwrap(), batches * 49152);
    assert_eq!(v["buckets"].as_array().unwrap().len(), 1);
}

/// Reads a dump and checks it against the plan: every sample once, budget held, figures true.
fn check_dump(path: &std::path::Path, lengths: &[u64], budget: u64, packed: bool) -> Vec<Value> {
    let text = fs::read_to_string(path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("dump line is JSON"))
        .collect();
    let mut seen = vec![0u32; lengths.len()];
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["step"].as_u64().unwrap(), i as u64);
        let samples: Vec<u64> = line["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap())
            .collect();
        let max = samples.iter().map(|&s| lengths[s as usize]).max().unwrap();
        let real: u64 = samples.iter().map(|&s| lengths[s as usize]).sum();
        assert_eq!(line["max_len"].as_u64().unwrap(), max);
        assert_eq!(line["real_tokens"].as_u64().unwrap(), real);
        let padded = line["padded_tokens"].as_u64().unwrap();
        if packed {
            assert!(real <= budget);
            assert_eq!(padded, budget);
        } else {
            assert_eq!(padded, samples.len() as u64 * max);
            assert!(padded <= budget, "step {i}: {padded} > {budget}");
        }
        assert!(line.get("bucket").is_some());
        for s in samples {
            seen[s as usize] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n == 1), "every sample exactly once");
    lines
}

#[test]
fn dump_from_a_lengths_file_covers_every_sample_within_budget() {
    let dir = tempfile::tempdir().unwrap();
    let lengths: Vec<u64> = (0..3000u64).map(|i| 1 + (i * 7919) % 4000).collect();
    let file = dir.path().join("lengths.txt");
    let text: String = lengths.iter().map(|l| format!("{l}\n")).collect();
    fs::write(&file, text).unwrap();
    let f = file.to_str().unwrap();
    for (mode, packed) in [
        ("sorted", false),
        ("shuffle", false),
        ("bucketed", false),
        ("packed", true),
    ] {
        let dump = dir.path().join(format!("{mode}.jsonl"));
        let args = [
            "plan",
            "--lengths",
            f,
            "--mode",
            mode,
            "--token-budget",
            "16384",
            "--max-len",
            "4096",
            "--dump",
            dump.to_str().unwrap(),
            "--json",
        ];
        let v: Value = serde_json::from_str(&stdout_ok(&orch(&args))).unwrap();
        let lines = check_dump(&dump, &lengths, 16384, packed);
        assert_eq!(lines.len() as u64, v["batches"].as_u64().unwrap(), "{mode}");
    }
}

#[test]
fn same_seed_same_dump_other_epoch_other_batches() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, epoch: &str| {
        let path = dir.path().join(name);
        let args = [
            "plan",
            "--synthetic",
            "30000",
            "--buckets",
            SEED_BUCKETS,
            "--epoch",
            epoch,
            "--seed",
            "42",
            "--dump",
            path.to_str().unwrap(),
            "--json",
        ];
        stdout_ok(&orch(&args));
        fs::read_to_string(path).unwrap()
    };
    let a = run("a.jsonl", "3");
    let b = run("b.jsonl", "3");
    let c = run("c.jsonl", "4");
    assert_eq!(a, b, "same seed and epoch, same plan, across processes");
    let batches = |text: &str| -> BTreeSet<String> {
        text.lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                let mut s: Vec<u64> = v["samples"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect();
                s.sort_unstable();
                format!("{s:?}")
            })
            .collect()
    };
    let (ba, bc) = (batches(&a), batches(&c));
    assert!(
        ba.intersection(&bc).count() * 50 < ba.len(),
        "composition re-drawn"
    );
}

#[test]
fn report_is_a_self_contained_svg() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("plan.svg");
    let args = [
        "plan",
        "--synthetic",
        "20000",
        "--report",
        svg.to_str().unwrap(),
    ];
    let summary = stdout_ok(&orch(&args));
    assert!(summary.contains("padding efficiency"));
    let text = fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..60.min(text.len())]);
    assert!(text.contains("Bucket mix across the epoch"));
    assert!(text.contains("Padding efficiency per bucket"));
    assert!(text.matches("<rect").count() > 100);
    assert!(!text.contains("http://") || text.contains("xmlns=\"http://www.w3.org/2000/svg\""));
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary files left"
    );
}

#[test]
fn human_summary_lists_buckets_and_run_statistics() {
    let out = stdout_ok(&orch(&[
        "plan",
        "--synthetic",
        "20000",
        "--buckets",
        SEED_BUCKETS,
    ]));
    assert!(out.contains("bucket"));
    assert!(out.contains("3296"));
    assert!(out.contains("same-bucket runs"));
    assert!(out.contains("planned in"));
}

/// The acceptance figures on the seed-shaped workload (behaviour, not speed).
#[test]
fn synthetic_902k_meets_the_planner_targets() {
    let spread = json(&[
        "plan",
        "--synthetic",
        "902000",
        "--buckets",
        SEED_BUCKETS,
        "--interleave",
        "spread",
    ]);
    assert!(
        spread["max_same_bucket_run"].as_u64().unwrap() <= 3,
        "{spread}"
    );
    assert!(
        spread["windows_3plus_same_bucket"].as_f64().unwrap() <= 0.22,
        "{spread}"
    );
    assert!(
        spread["tail_same_bucket_run"].as_u64().unwrap() <= 3,
        "{spread}"
    );

    let auto = json(&["plan", "--synthetic", "902000", "--buckets", "auto:8"]);
    assert!(
        auto["padding_efficiency"].as_f64().unwrap() >= 0.86,
        "{auto}"
    );

    let packed = json(&["plan", "--synthetic", "902000", "--mode", "packed"]);
    assert!(
        packed["padding_efficiency"].as_f64().unwrap() >= 0.995,
        "{packed}"
    );
    assert!(
        packed["adjacent_mean_len_corr"].as_f64().unwrap().abs() <= 0.1,
        "{packed}"
    );
    assert!(
        packed["position_mean_len_corr"].as_f64().unwrap().abs() <= 0.1,
        "{packed}"
    );

    // The original interleave keeps its tail: thousands of batches of one bucket at the end.
    let diverse = json(&[
        "plan",
        "--synthetic",
        "902000",
        "--buckets",
        SEED_BUCKETS,
        "--interleave",
        "diverse",
    ]);
    assert!(
        diverse["tail_same_bucket_run"].as_u64().unwrap() > 1000,
        "{diverse}"
    );
}

mod bad_input {
    use super::*;

    fn lengths_file(content: &[u8]) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lengths.txt");
        fs::write(&path, content).unwrap();
        let p = path.to_str().unwrap().to_owned();
        (dir, p)
    }

    #[test]
    fn negative_length_names_the_line() {
        let (_d, p) = lengths_file(b"100\n200\n-3\n400\n");
        assert_refused(&orch(&["plan", "--lengths", &p]), 2, "line 3");
        let (_d, p) = lengths_file(b"100\n200\n-3\n400\n");
        let out = orch(&["plan", "--lengths", &p]);
        assert!(String::from_utf8_lossy(&out.stderr).contains("negative"));
    }

    #[test]
    fn non_integer_names_the_line() {
        let (_d, p) = lengths_file(b"100\n\n12.5\n");
        assert_refused(&orch(&["plan", "--lengths", &p]), 2, "line 3");
        let (_d, p) = lengths_file(b"100\nabc\n");
        assert_refused(&orch(&["plan", "--lengths", &p, "--json"]), 2, "line 2");
    }

    #[test]
    fn empty_input() {
        let (_d, p) = lengths_file(b"");
        assert_refused(&orch(&["plan", "--lengths", &p]), 2, "no samples");
        let (_d, p) = lengths_file(b"\n\n  \n");
        assert_refused(&orch(&["plan", "--lengths", &p]), 2, "no samples");
        // Refused when parsed: the option and its range are named.
        assert_refused(
            &orch(&["plan", "--synthetic", "0"]),
            2,
            "--synthetic <N>': 0 is not in 1..=",
        );
    }

    #[test]
    fn all_samples_dropped() {
        let (_d, p) = lengths_file(b"0\n9000\n");
        let args = ["plan", "--lengths", &p, "--on-overlong", "drop"];
        assert_refused(&orch(&args), 2, "dropped");
    }

    #[test]
    fn missing_file_is_named() {
        assert_refused(
            &orch(&["plan", "--lengths", "/nonexistent/lengths.txt"]),
            1,
            "/nonexistent/lengths.txt",
        );
    }

    #[test]
    fn budget_smaller_than_max_len() {
        let args = [
            "plan",
            "--synthetic",
            "100",
            "--token-budget",
            "4096",
            "--max-len",
            "8192",
        ];
        assert_refused(
            &orch(&args),
            2,
            "--token-budget 4096 is smaller than --max-len 8192",
        );
    }

    #[test]
    fn bucket_boundaries_not_increasing() {
        let args = ["plan", "--synthetic", "100", "--buckets", "0,770,500,8192"];
        assert_refused(&orch(&args), 2, "strictly increasing");
        let args = ["plan", "--synthetic", "100", "--buckets", "0,770,770,8192"];
        assert_refused(&orch(&args), 2, "strictly increasing");
    }

    #[test]
    fn bucket_boundaries_not_covering_max_len() {
        let args = ["plan", "--synthetic", "100", "--buckets", "0,770,4096"];
        assert_refused(&orch(&args), 2, "does not cover --max-len 8192");
    }

    #[test]
    fn bucket_list_not_numbers() {
        let args = ["plan", "--synthetic", "100", "--buckets", "0,big,8192"];
        assert_refused(&orch(&args), 2, "\"big\"");
    }

    #[test]
    fn auto_zero() {
        assert_refused(
            &orch(&["plan", "--synthetic", "100", "--buckets", "auto:0"]),
            2,
            "auto:0",
        );
    }

    #[test]
    fn unknown_mode_and_interleave() {
        assert_refused(
            &orch(&["plan", "--synthetic", "100", "--mode", "zigzag"]),
            2,
            "unknown mode \"zigzag\"",
        );
        assert_refused(
            &orch(&["plan", "--synthetic", "100", "--interleave", "zigzag"]),
            2,
            "unknown interleave",
        );
        assert_refused(
            &orch(&["plan", "--synthetic", "100", "--on-overlong", "cut"]),
            2,
            "unknown overlong policy",
        );
    }

    #[test]
    fn bucket_options_need_bucketed_mode() {
        let args = [
            "plan",
            "--synthetic",
            "100",
            "--mode",
            "packed",
            "--buckets",
            "auto:4",
        ];
        assert_refused(&orch(&args), 2, "--buckets applies only to --mode bucketed");
    }

    #[test]
    fn no_input_given() {
        let out = orch(&["plan"]);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("--lengths"));
    }

    #[test]
    fn unwritable_dump_fails_cleanly() {
        let args = [
            "plan",
            "--synthetic",
            "100",
            "--dump",
            "/nonexistent-dir/plan.jsonl",
        ];
        assert_refused(&orch(&args), 1, "/nonexistent-dir/plan.jsonl");
    }
}

#[test]
fn worker_binary_explains_itself() {
    let out = std::process::Command::new(bin("dflash-worker"))
        .arg("--help")
        .output()
        .unwrap();
    let help = stdout_ok(&out);
    assert!(help.contains("dflash-orch launch"));
    let out = std::process::Command::new(bin("dflash-worker"))
        .output()
        .unwrap();
    assert_refused(&out, 2, "no orchestrator");
}

#[test]
fn help_documents_exit_codes() {
    let help = stdout_ok(&orch(&["--help"]));
    assert!(help.contains("Exit codes"));
    let help = stdout_ok(&orch(&["plan", "--help"]));
    for flag in [
        "--lengths",
        "--synthetic",
        "--mode",
        "--buckets",
        "--interleave",
        "--dump",
        "--report",
    ] {
        assert!(help.contains(flag), "{flag}");
    }
}
