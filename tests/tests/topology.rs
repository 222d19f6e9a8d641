//! `--topology auto` on the synthetic stage, where each role's cost is set by hand
//! (`--synthetic-us-per-token` for targets, `--synthetic-drafter-us-per-token` for drafters):
//! each case picks the split that balances the roles, `launch --dry-run` prints it, a launch
//! journals it and runs it, and a resume journals its own choice.

use std::path::Path;

use dflash_e2e::{assert_refused, journal_events, orch, stdout_ok};
use serde_json::Value;

fn dry_run(run_dir: &Path, gpus: &str, target_us: &str, drafter_us: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "launch",
        "--dry-run",
        "--json",
        "--gpus",
        gpus,
        "--synthetic",
        "2000",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--synthetic-us-per-token",
        target_us,
        "--synthetic-drafter-us-per-token",
        drafter_us,
    ];
    args.extend_from_slice(extra);
    serde_json::from_str(&stdout_ok(&orch(&args))).unwrap()
}

#[test]
fn auto_picks_the_split_that_balances_the_roles_and_the_dry_run_prints_it() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    // (workers, target µs a token, drafter µs a token) -> (targets, drafters)
    let cases = [
        ("cpu:8", "10", "30", (2, 6)),
        ("cpu:8", "30", "10", (6, 2)),
        ("cpu:8", "10", "10", (4, 4)),
        ("cpu:8", "70", "10", (7, 1)),
        ("cpu:8", "10", "0", (7, 1)),
        ("cpu:8", "0", "0", (7, 1)),
        ("cpu:8", "0", "5", (1, 7)),
        ("cpu:3", "10", "10", (2, 1)),
        ("cpu:5", "1", "3", (2, 3)),
        ("cpu:2", "1", "100", (1, 1)),
    ];
    for (gpus, t_us, d_us, (t, d)) in cases {
        let plan = dry_run(&run_dir, gpus, t_us, d_us, &["--topology", "auto"]);
        let topology = &plan["topology"];
        let what = format!("{gpus} {t_us}/{d_us}: {topology}");
        assert_eq!(topology["how"], "auto", "{what}");
        assert_eq!(
            (topology["targets"].as_u64(), topology["drafters"].as_u64()),
            (Some(t), Some(d)),
            "{what}"
        );
        let workers: Vec<&str> = plan["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w.as_str().unwrap())
            .collect();
        let targets = workers.iter().filter(|w| w.starts_with("target")).count();
        assert_eq!(
            (targets, workers.len() - targets),
            (t as usize, d as usize),
            "{what}"
        );
        if t_us != "0" && d_us != "0" {
            // The predicted rates: micro-batches a second, this split against all but one.
            let (rate, base) = (
                topology["rate"].as_f64().unwrap(),
                topology["rate_all_but_one"].as_f64().unwrap(),
            );
            assert!(rate >= base * (1.0 - 1e-9), "{what}");
        }
    }
    // Without --topology the synthetic stage keeps all but one as targets, and says so.
    let plan = dry_run(&run_dir, "cpu:8", "10", "30", &[]);
    assert_eq!(plan["topology"]["how"], "default");
    assert_eq!(plan["topology"]["drafters"], 1);
    // Given, it is taken as it is.
    let plan = dry_run(&run_dir, "cpu:8", "10", "30", &["--topology", "5:3"]);
    assert_eq!(
        (&plan["topology"]["how"], &plan["topology"]["drafters"]),
        (&Value::from("given"), &Value::from(3))
    );
    // The text names the choice and its reason.
    let out = orch(&[
        "launch",
        "--dry-run",
        "--gpus",
        "cpu:8",
        "--synthetic",
        "2000",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--synthetic-us-per-token",
        "10",
        "--synthetic-drafter-us-per-token",
        "30",
        "--topology",
        "auto",
    ]);
    let text = stdout_ok(&out);
    assert!(
        text.contains("topology 2:6 (auto: a micro-batch costs a target"),
        "{text}"
    );
    assert!(!run_dir.exists(), "a dry run touches nothing");
    // Bad values are refused naming them.
    // A value the parser refuses exits 2; one the launch checks refuse exits 1 on a dry run.
    for (flag, value, code) in [
        ("--topology", "auto:1", 1),
        ("--topology", "automatic", 1),
        ("--topology", "0:4", 1),
        ("--synthetic-drafter-us-per-token", "nan", 2),
        ("--synthetic-drafter-us-per-token", "2e6", 2),
    ] {
        let out = orch(&[
            "launch",
            "--dry-run",
            "--gpus",
            "cpu:4",
            "--synthetic",
            "100",
            "--run-dir",
            run_dir.to_str().unwrap(),
            flag,
            value,
        ]);
        assert_refused(&out, code, value);
    }
}

#[test]
fn an_auto_topology_is_journaled_and_runs_with_its_split() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let launch = |gpus: &str, extra: &[&str]| {
        let mut args = vec![
            "launch",
            "--gpus",
            gpus,
            "--synthetic",
            "300",
            "--epochs",
            "1",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--topology",
            "auto",
            "--synthetic-us-per-token",
            "1",
            "--synthetic-drafter-us-per-token",
            "3",
        ];
        args.extend_from_slice(extra);
        orch(&args)
    };
    let out = launch("cpu:4", &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = &journal_events(&run_dir, "run")[0];
    assert_eq!(run["config"]["topology"], "auto");
    let chosen = &run["topology"];
    assert_eq!(
        (&chosen["how"], &chosen["targets"], &chosen["drafters"]),
        (&Value::from("auto"), &Value::from(1), &Value::from(3)),
        "{chosen}"
    );
    assert!(
        chosen["reason"].as_str().unwrap().contains("a drafter"),
        "{chosen}"
    );
    let roles = |role: &str| {
        journal_events(&run_dir, "worker_start")
            .iter()
            .filter(|w| w["role"] == role)
            .map(|w| w["worker"].as_u64().unwrap())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    assert_eq!((roles("target"), roles("drafter")), (1, 3));
    let commits = journal_events(&run_dir, "commit").len();
    assert!(commits > 0);
    let end = &journal_events(&run_dir, "end")[0];
    assert_eq!(end["status"], "completed", "{end}");
}
