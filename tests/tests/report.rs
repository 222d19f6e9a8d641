//! `dflash-orch report` end to end: a run directory written by hand, the real binary, the page.

use std::fs;
use std::path::{Path, PathBuf};

use dflash_e2e::{assert_refused, orch, stdout_ok};
use serde_json::{Value, json};

const T0: f64 = 1_700_000_000.0;

fn lines(values: &[Value]) -> String {
    values.iter().map(|v| format!("{v}\n")).collect()
}

/// A run of 12 batches over 60 s on three workers (two targets, one drafter); workers 1 and 2
/// exit once each. `gpu`: NVML readings, else process readings; `train`: a DFlash run with
/// train lines, else a synthetic-stage run.
fn write_run(dir: &Path, gpu: bool, train: bool) {
    let config = json!({
        "gpus": if gpu { "0,1,2" } else { "cpu:3" },
        "topology": "2:1",
        "data": null,
        "synthetic": 4000,
        "synthetic_seed": 0,
        "stage": if train { "dflash" } else { "synthetic" },
        "synthetic_us_per_token": 0.0,
        "epochs": 1,
        "planner": {"mode": "bucketed", "interleave": "spread", "buckets": "auto:3",
                    "token_budget": 4096, "max_len": 1024, "on_overlong": "truncate",
                    "accum": 2, "seed": 0},
        "max_restarts": 5, "restart_window_s": 600.0, "heartbeat_timeout_s": 30.0,
        "heartbeat_ms": 500,
    });
    let mut journal = vec![
        json!({"event": "run", "version": 1, "config": config}),
        json!({"event": "epoch", "epoch": 0, "batches": 12}),
    ];
    for (worker, role) in [(0, "target"), (1, "target"), (2, "drafter")] {
        journal.push(
            json!({"event": "worker_start", "worker": worker, "role": role, "pid": 100 + worker}),
        );
    }
    for batch in 0..12 {
        journal.push(
            json!({"event": "commit", "epoch": 0, "step": batch, "batch": batch,
                            "samples": 4, "checksum": 7}),
        );
    }
    journal.push(
        json!({"event": "worker_exit", "worker": 1, "pid": 101, "reason": "killed by SIGKILL"}),
    );
    journal.push(json!({"event": "worker_start", "worker": 1, "role": "target", "pid": 104}));
    journal.push(json!({"event": "end", "status": "completed", "reason": null}));
    fs::write(dir.join("journal.jsonl"), lines(&journal)).unwrap();

    let mut m = Vec::new();
    for (worker, role) in [(0, "target"), (1, "target"), (2, "drafter")] {
        m.push(
            json!({"kind": "event", "time": T0, "event": "worker_start", "worker": worker,
                      "role": role, "message": "started"}),
        );
    }
    for step in 0..12u64 {
        let t = T0 + 5.0 * step as f64 + 1.0;
        let batch = json!({"kind": "batch", "time": t, "epoch": 0, "batch": step, "step": step,
            "bucket": step % 3, "samples": 4, "real_tokens": 3000 + 50 * step,
            "padded_tokens": 4096, "mean_len": 750.0, "max_len": 1024, "wait_s": 0.01,
            "compute_s": 0.2, "tokens_per_s": 20000.0 + 500.0 * step as f64,
            "padded_tokens_per_s": 26000.0 + 400.0 * step as f64, "padding_efficiency": 0.75,
            "input_ring_occupancy": 0.5, "feature_ring_occupancy": 0.25, "restarts": 0,
            "bucket_batches": [1, 1, 1]});
        m.push(batch.clone());
        if step == 6 {
            // A replay after the drafter's restart writes the batch again.
            let mut again = batch;
            again["time"] = json!(t + 0.5);
            m.push(again);
        }
        if train && step % 2 == 1 {
            let opt = step / 2 + 1;
            let line = |loss: f64| {
                json!({"kind": "train", "time": t, "epoch": 0, "step": opt, "plan_step": step,
                    "loss": loss, "accuracy": 0.05 * opt as f64,
                    "accuracy_by_position": [0.1, 0.05], "acceptance_length": 0.2,
                    "lr": 0.0006, "grad_norm": 1.5, "tokens": 6000, "anchors": 64,
                    "compute_s": 0.4, "checkpoint": false})
            };
            if opt == 6 {
                m.push(line(99.0)); // replaced by the replay's line below
            }
            m.push(line(10.0 - opt as f64));
        }
    }
    for tick in 0..5u64 {
        let t = T0 + 15.0 * tick as f64;
        for (worker, role) in [(0u64, "target"), (1, "target"), (2, "drafter")] {
            m.push(if gpu {
                json!({"kind": "gpu", "time": t, "gpu": worker, "worker": worker, "role": role,
                    "power_w": 300.0 + 10.0 * (tick + worker) as f64, "power_limit_w": 700.0,
                    "energy_j": 1e6, "utilization_pct": if tick == 2 { Value::Null } else { json!(90) },
                    "memory_utilization_pct": 40, "memory_used_bytes": 1u64 << 34,
                    "memory_total_bytes": 1u64 << 37, "temperature_c": 60, "sm_clock_mhz": 1980,
                    "throttle": []})
            } else {
                json!({"kind": "process", "time": t, "worker": worker, "role": role,
                    "pid": 100 + worker, "cpu_pct": 95.0 + tick as f64,
                    "rss_bytes": (200 + 10 * tick) << 20})
            });
        }
    }
    m.push(
        json!({"kind": "event", "time": T0 + 20.0, "event": "worker_exit", "worker": 1,
                  "role": "target", "message": "killed by SIGKILL"}),
    );
    m.push(
        json!({"kind": "event", "time": T0 + 33.0, "event": "worker_exit", "worker": 2,
                  "role": "drafter",
                  "message": "missed heartbeats for 1.5 s (hung); killed by SIGKILL"}),
    );
    for (worker, role, t) in [(1, "target", 20.2), (2, "drafter", 33.2)] {
        m.push(
            json!({"kind": "event", "time": T0 + t, "event": "worker_start",
                      "worker": worker, "role": role, "message": "restarted"}),
        );
    }
    // The run stops: every worker exits normally and is not started again.
    for (worker, role) in [(0, "target"), (1, "target"), (2, "drafter")] {
        m.push(
            json!({"kind": "event", "time": T0 + 60.0, "event": "worker_exit",
                      "worker": worker, "role": role, "message": "exited normally"}),
        );
    }
    m.push(
        json!({"kind": "event", "time": T0 + 50.0, "event": "warning", "worker": null,
                  "role": null, "message": "GPU 1 (worker 1): thermal throttle for 10 s"}),
    );
    m.push(
        json!({"kind": "event", "time": T0 + 34.0, "event": "rewind", "worker": 2,
                  "role": "drafter", "message": "drafter resumed at plan step 5"}),
    );
    m.push(json!({"kind": "future_kind", "time": T0 + 35.0}));
    m.sort_by(|a, b| {
        a["time"]
            .as_f64()
            .unwrap()
            .total_cmp(&b["time"].as_f64().unwrap())
    });
    fs::write(dir.join("metrics.jsonl"), lines(&m)).unwrap();
}

fn report(run_dir: &Path) -> (String, PathBuf) {
    let output = run_dir.join("report.html");
    let out = orch(&[
        "report",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    let stdout = stdout_ok(&out);
    assert!(stdout.is_empty(), "nothing on stdout: {stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(output.to_str().unwrap()),
        "the output path on stderr: {stderr}"
    );
    (fs::read_to_string(&output).expect("report written"), output)
}

/// Each `<svg>...</svg>` element of the page with the text of its first `<text>`: the title.
fn charts(html: &str) -> Vec<(String, &str)> {
    let mut out = Vec::new();
    let mut rest = html;
    while let Some(start) = rest.find("<svg") {
        let end = rest[start..].find("</svg>").expect("closed svg") + start + "</svg>".len();
        let svg = &rest[start..end];
        let text = svg.find("<text").expect("svg has a title");
        let open = svg[text..].find('>').unwrap() + text + 1;
        let close = svg[open..].find("</text>").unwrap() + open;
        out.push((svg[open..close].trim().to_string(), svg));
        rest = &rest[end..];
    }
    out
}

/// (text-anchor, text) of each `<text>` element of an SVG.
fn texts(svg: &str) -> Vec<(String, String)> {
    svg.split("<text")
        .skip(1)
        .map(|t| {
            let anchor = t
                .split("text-anchor=\"")
                .nth(1)
                .and_then(|a| a.split('"').next())
                .unwrap_or("start");
            let open = t.find('>').unwrap() + 1;
            let close = t.find("</text>").unwrap();
            (anchor.to_string(), t[open..close].trim().to_string())
        })
        .collect()
}

fn assert_self_contained(html: &str) {
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.trim_end().ends_with("</html>"));
    for banned in [
        "<script",
        "src=\"http",
        "<link",
        "@import",
        "url(",
        "href=\"http",
        "<img",
    ] {
        assert!(!html.contains(banned), "{banned} in the page");
    }
}

const THROUGHPUT: &str = "Throughput (tokens/s over the last 10 s)";

#[test]
fn report_of_a_gpu_run_has_every_chart_and_the_restarts() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), true, true);
    let (html, _) = report(dir.path());
    assert_self_contained(&html);

    let charts = charts(&html);
    let titles: Vec<&str> = charts.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(
        titles,
        [
            "Training loss",
            "Draft accuracy",
            THROUGHPUT,
            "Batches per bucket",
            "GPU power",
            "GPU utilization"
        ]
    );
    // Worker exits marked and labelled on every time axis.
    for (title, svg) in &charts[2..] {
        if title == "Batches per bucket" {
            continue;
        }
        assert!(svg.contains("#1 w1"), "exit of worker 1 on {title}");
        assert!(svg.contains("#2 w2"), "exit of worker 2 on {title}");
    }
    assert!(!charts[0].1.contains("#1 w1"), "no exits on the step axis");
    assert!(
        !html.contains("#3 w"),
        "normal exits at the end are not marked"
    );
    // The bucket chart: 12 batches (one written twice) over three buckets, 4 each.
    let centred: Vec<String> = texts(charts[3].1)
        .into_iter()
        .filter(|(anchor, _)| anchor == "middle")
        .map(|(_, text)| text)
        .collect();
    assert_eq!(
        centred.iter().filter(|t| *t == "4").count(),
        3,
        "a count of 4 above each bar: {centred:?}"
    );
    assert!(html.contains("12 batches; 1 batch lines written again"));

    // Header and summary.
    for fact in [
        "dflash",
        "--gpus 0,1,2, topology 2:1 (1 drafter, 2 targets)",
        "12 of 12 planned",
        "completed",
        "1 min 00 s",
        "2023-11-14 22:13:20 UTC",
        "Optimiser steps",
        "GPU 0 (target)",
        "GPU 2 (drafter)",
    ] {
        assert!(html.contains(fact), "missing {fact:?}");
    }
    let real: u64 = (0..12).map(|s| 3000 + 50 * s).sum();
    assert_eq!(real, 39_300);
    assert!(html.contains("39,300 real"), "total tokens");
    // Six optimiser steps: first tenth = step 1 (loss 9), last tenth = step 6 (loss 4, its
    // earlier line with loss 99 replaced).
    assert!(
        html.contains("first tenth (step 1) → the last tenth (step 6): loss 9.000 → 4.000, accuracy 0.050 → 0.300"),
        "summary line"
    );

    // The restarts table.
    assert!(html.contains("<td class=\"msg\">killed by SIGKILL</td>"));
    assert!(html.contains("missed heartbeats for 1.5 s (hung); killed by SIGKILL"));
    assert!(html.contains("<td>drafter</td><td>yes</td>"));
    assert!(!html.contains("<td class=\"msg\">exited normally</td>"));
    assert!(html.contains("2 restarted, 3 normal exits when the run stopped"));
    assert!(html.contains("3 workers exited normally when the run stopped"));
    assert!(html.contains("1 rewind, 1 warning, 5 worker_start"));
    // Warnings get a table of their own.
    assert!(html.contains("<h2>Warnings</h2>"));
    assert!(html.contains("GPU 1 (worker 1): thermal throttle for 10 s"));
}

#[test]
fn report_without_gpu_or_train_lines_shows_the_workers_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), false, false);
    let (html, _) = report(dir.path());
    assert_self_contained(&html);
    let charts = charts(&html);
    let titles: Vec<&str> = charts.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(
        titles,
        [
            THROUGHPUT,
            "Batches per bucket",
            "Worker CPU",
            "Worker memory (RSS)"
        ]
    );
    assert!(html.contains("No GPU telemetry was available"));
    assert!(html.contains("No train lines in metrics.jsonl"));
    assert!(html.contains("worker 2 (drafter)"));
    assert!(charts[2].1.contains("#2 w2") && charts[3].1.contains("#1 w1"));
    assert!(html.contains("synthetic"));
}

#[test]
fn a_malformed_metrics_line_is_skipped_naming_its_line_and_the_rest_reported() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), true, true);
    let path = dir.path().join("metrics.jsonl");
    let text = fs::read_to_string(&path).unwrap();
    let output = dir.path().join("report.html");
    let out_arg = output.to_str().unwrap();
    let run_dir = dir.path().to_str().unwrap();
    for (bad, line) in [
        ("{\"kind\":\"batch\",\"time\":", 4),
        ("{\"kind\":\"gpu\",\"time\":\"soon\"}", 2),
        ("[1,2,3]", 7),
        ("{\"kind\":\"batch\",\"step\":3}", 5),
    ] {
        let mut lines: Vec<&str> = text.lines().collect();
        lines.insert(line - 1, bad);
        fs::write(&path, lines.join("\n") + "\n").unwrap();
        let out = orch(&["report", "--run-dir", run_dir, "--output", out_arg]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains(&format!("metrics.jsonl:{line}: malformed line skipped")),
            "{err}"
        );
        let html = fs::read_to_string(&output).unwrap();
        assert!(html.contains("1 malformed line skipped"), "{bad}");
        // The good lines around it are all there: the same charts as without it.
        assert!(html.contains("<svg"), "{bad}");
        fs::remove_file(&output).unwrap();
    }
    // A last line cut short by a crash (no newline) is not an error.
    fs::write(&path, format!("{text}{{\"kind\":\"batch\",\"ti")).unwrap();
    let (html, _) = report(dir.path());
    assert!(html.contains("a last line cut short was ignored"));
}

#[test]
fn a_missing_run_dir_or_metrics_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-run");
    let out = orch(&["report", "--run-dir", missing.to_str().unwrap()]);
    assert_refused(&out, 2, "no-such-run");

    let out = orch(&[
        "report",
        "--run-dir",
        dir.path().to_str().unwrap(),
        "--output",
        dir.path().join("r.html").to_str().unwrap(),
    ]);
    assert_refused(&out, 2, "metrics.jsonl");
    assert!(!dir.path().join("r.html").exists());
}
