//! What a run shows of itself, read by the tools users already have: `metrics.jsonl`, TensorBoard
//! event files read back with TensorBoard's own reader, and the Prometheus endpoint scraped during
//! a run and parsed with `prometheus_client`'s parser.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use dflash_e2e::{
    SYNTHETIC_PLAN, bin, finish, journal_events, orch, script, status, stdout_ok, test_python,
    wait_until,
};
use serde_json::Value;

fn launch(run_dir: &Path, us_per_token: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("dflash-orch"));
    c.args(["launch", "--gpus", "cpu:3", "--epochs", "2", "--run-dir"])
        .arg(run_dir)
        .args(["--synthetic", "600"])
        .args(SYNTHETIC_PLAN)
        .args(["--synthetic-us-per-token", us_per_token])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn lines(run_dir: &Path, kind: &str) -> Vec<Value> {
    fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == kind)
        .collect()
}

#[test]
fn a_run_writes_metrics_lines_and_tensorboard_events_tensorboard_reads() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    finish(
        launch(&run_dir, "0.5", &["--monitor-interval", "0.1"])
            .spawn()
            .unwrap(),
    );
    let commits = journal_events(&run_dir, "commit");
    let batches = lines(&run_dir, "batch");
    assert_eq!(batches.len(), commits.len(), "one batch line per commit");
    for (b, c) in batches.iter().zip(&commits) {
        assert_eq!(b["step"], c["step"]);
        assert_eq!(b["samples"], c["samples"]);
        for field in [
            "real_tokens",
            "padded_tokens",
            "mean_len",
            "max_len",
            "wait_s",
            "compute_s",
            "tokens_per_s",
            "padding_efficiency",
            "input_ring_occupancy",
            "feature_ring_occupancy",
            "restarts",
        ] {
            assert!(b[field].is_number(), "{field} in {b}");
        }
        assert!(b["real_tokens"].as_u64() <= b["padded_tokens"].as_u64());
    }
    // Per-bucket dispatch counts add up to the epoch's batches.
    let last_of_epoch0 = batches.iter().rfind(|b| b["epoch"] == 0).unwrap();
    let dispatched: u64 = last_of_epoch0["bucket_batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .sum();
    let epoch0 = batches.iter().filter(|b| b["epoch"] == 0).count() as u64;
    assert_eq!(dispatched, epoch0);
    let starts = lines(&run_dir, "event")
        .into_iter()
        .filter(|e| e["event"] == "worker_start")
        .count();
    assert_eq!(starts, 3);
    assert!(!lines(&run_dir, "process").is_empty());

    let out = Command::new(test_python())
        .arg(script("read_tensorboard.py"))
        .arg(run_dir.join("tb"))
        .output()
        .unwrap();
    let read: Value = serde_json::from_str(&stdout_ok(&out)).unwrap();
    let tags = read["tags"].as_object().unwrap();
    for tag in [
        "pipeline/tokens_per_s",
        "pipeline/padding_efficiency",
        "pipeline/batch_mean_len",
        "pipeline/wait_s",
        "pipeline/input_ring_occupancy",
        "pipeline/restarts",
        "pipeline/bucket_0_batches",
    ] {
        let points = tags
            .get(tag)
            .unwrap_or_else(|| panic!("no {tag} in {:?}", tags.keys()));
        let steps: Vec<u64> = points
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[0].as_u64().unwrap())
            .collect();
        if tag != "pipeline/bucket_0_batches" {
            assert_eq!(
                steps,
                (0..commits.len() as u64).collect::<Vec<_>>(),
                "{tag}"
            );
        }
    }
    let efficiency = tags["pipeline/padding_efficiency"].as_array().unwrap();
    let last = efficiency.last().unwrap()[1].as_f64().unwrap();
    let want = batches.last().unwrap()["padding_efficiency"]
        .as_f64()
        .unwrap();
    assert!((last - want).abs() < 1e-6, "{last} vs {want}");
    assert!(tags.contains_key("worker2/rss_bytes"));
}

fn get(addr: &str, path: &str) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_owned())
}

#[test]
fn prometheus_endpoint_serves_per_worker_series_during_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let child = launch(
        &run_dir,
        "1.5",
        &["--metrics-addr", "0", "--monitor-interval", "0.2"],
    )
    .spawn()
    .unwrap();
    wait_until("the run", Duration::from_secs(60), || {
        run_dir.join("control.sock").exists()
    });
    let addr = status(&run_dir)["run"]["metrics_addr"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    wait_until(
        "commits and a monitor tick",
        Duration::from_secs(60),
        || {
            journal_events(&run_dir, "commit").len() >= 5
                && get(&addr, "/metrics")
                    .1
                    .contains("dflash_worker_resident_memory_bytes{")
        },
    );
    let (code, text) = get(&addr, "/metrics");
    assert_eq!(code, 200);
    assert_eq!(get(&addr, "/elsewhere").0, 404);
    let mut parse = Command::new(test_python())
        .arg(script("parse_prometheus.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    parse
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let parsed: Value =
        serde_json::from_str(&stdout_ok(&parse.wait_with_output().unwrap())).unwrap();
    let families = parsed["families"].as_object().unwrap();
    let workers = |family: &str| -> BTreeMap<String, String> {
        families[family]["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s[1]["worker"].as_str().unwrap().to_owned(),
                    s[1]["role"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    let expected: BTreeMap<String, String> = [("0", "target"), ("1", "target"), ("2", "drafter")]
        .into_iter()
        .map(|(w, r)| (w.to_owned(), r.to_owned()))
        .collect();
    for family in [
        "dflash_worker_up",
        "dflash_worker_batches",
        "dflash_worker_restarts",
        "dflash_worker_resident_memory_bytes",
        "dflash_worker_cpu_ratio",
    ] {
        assert!(
            families.contains_key(family),
            "no {family}: {:?}",
            families.keys()
        );
        assert_eq!(workers(family), expected, "{family}");
    }
    let committed = families["dflash_committed_steps"]["samples"][0][2]
        .as_f64()
        .unwrap();
    assert!(committed >= 5.0, "{committed}");
    assert!(
        !families.keys().any(|k| k.starts_with("dflash_train_")),
        "no training series in a synthetic run"
    );
    stdout_ok(&orch(&["stop", "--run-dir", run_dir.to_str().unwrap()]));
    finish(child);
}

#[test]
fn bad_metrics_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, value, needle) in [
        ("--metrics-addr", "nowhere", "invalid --metrics-addr"),
        ("--metrics-addr", "70000", "invalid --metrics-addr"),
        ("--monitor-interval", "0", "--monitor-interval"),
    ] {
        let out = launch(&dir.path().join("run"), "0", &[flag, value])
            .output()
            .unwrap();
        dflash_e2e::assert_refused(&out, 2, needle);
    }
}
