use std::path::Path;

use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use serde_json::{Value, json};

use super::view::*;
use crate::runtime::control::ClientError;

fn screen(view: &View, width: u16, height: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
    terminal.draw(|f| view.draw(f)).unwrap();
    let buffer = terminal.backend().buffer();
    let mut out = String::new();
    for y in 0..buffer.area.height {
        for x in 0..buffer.area.width {
            out.push_str(buffer[(x, y)].symbol());
        }
        out.push('\n');
    }
    out
}

fn row<'a>(screen: &'a str, needle: &str) -> &'a str {
    screen
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?} in\n{screen}"))
}

fn run_json() -> Value {
    json!({
        "run_dir": "/runs/a",
        "state": "running",
        "epoch": 0,
        "epochs": 2,
        "batch": 17,
        "batches": 80,
        "committed_steps": 17,
        "uptime_s": 3725.0,
        "tokens_per_s": 123456.0,
        "stage": "synthetic",
        "progress": "epoch 1/2 · batch 17/160 · 123.5 Ktok/s · ETA 0m12s",
    })
}

fn cpu_status() -> Value {
    let worker = |id: u32, role: &str, pid: u32, cpu: Value| {
        json!({
            "id": id, "role": role, "device": format!("cpu:{id}"), "gpu": null,
            "pid": pid, "state": "busy", "cpus": [id], "batches_done": 10 + id,
            "restarts": id, "last_exit": if id == 1 { json!("killed by SIGKILL") } else { json!(null) },
            "heartbeat_age_s": 0.25, "gpu_power_w": null, "gpu_utilization_pct": null,
            "gpu_memory_used_mb": null, "gpu_memory_total_mb": null, "gpu_temperature_c": null,
            "gpu_unavailable": "CPU worker", "cpu_pct": cpu, "rss_bytes": 52_428_800,
        })
    };
    json!({
        "run": run_json(),
        "workers": [
            worker(0, "target", 4101, json!(97.5)),
            worker(1, "target", 4102, json!(null)),
            worker(2, "drafter", 4103, json!(180.0)),
        ],
    })
}

fn gpu_status(power: f64) -> Value {
    let worker = |id: u32, role: &str| {
        json!({
            "id": id, "role": role, "device": format!("gpu:{id}"), "gpu": id,
            "pid": 5000 + id, "state": "ready", "cpus": [0, 1], "batches_done": 3,
            "restarts": 0, "last_exit": null, "heartbeat_age_s": 1.5,
            "gpu_power_w": power + f64::from(id), "gpu_utilization_pct": 87,
            "gpu_memory_used_mb": 71_234, "gpu_memory_total_mb": 143_771,
            "gpu_temperature_c": 64, "gpu_unavailable": null,
        })
    };
    json!({"run": run_json(), "workers": [worker(0, "target"), worker(1, "drafter")]})
}

#[test]
fn cpu_workers_show_rows_dashes_and_the_reason_once() {
    let mut view = View::new(Path::new("/runs/a"), 1.0);
    view.update(cpu_status());
    let s = screen(&view, 200, 40);
    let r0 = row(&s, "4101");
    assert!(r0.contains("target") && r0.contains("cpu:0") && r0.contains("busy"));
    assert!(r0.contains("98") && r0.contains("50.00 MiB"), "{r0}");
    assert!(r0.contains(" - "), "GPU columns are dashes: {r0}");
    let r1 = row(&s, "4102");
    assert!(r1.contains("killed by SIGKILL"), "{r1}");
    assert!(row(&s, "4103").contains("drafter"));
    assert!(
        s.contains("epoch 1/2 · batch 17/160"),
        "progress line:\n{s}"
    );
    assert!(s.contains("committed steps 17"));
    assert!(s.contains("up 1h02m"), "{s}");
    assert!(s.contains("average 123.5 Ktok/s"), "{s}");
    assert_eq!(
        s.matches("GPU telemetry unavailable: CPU worker").count(),
        1
    );
    assert!(s.contains("CPU: 98%"), "CPU sparkline of worker 0:\n{s}");
    assert!(s.contains("run throughput"));
    assert!(!s.contains("run not running"));
    // Selection is drawn on the first worker.
    assert!(row(&s, "4101").contains("> "));
}

#[test]
fn gpu_workers_show_power_utilization_memory_and_temperature() {
    let mut view = View::new(Path::new("/runs/a"), 1.0);
    for p in 0..80 {
        view.update(gpu_status(200.0 + f64::from(p)));
    }
    assert_eq!(view.history[&0].power.len(), HISTORY);
    assert_eq!(view.throughput.len(), HISTORY);
    let s = screen(&view, 200, 40);
    let r = row(&s, "5001");
    assert!(r.contains("drafter") && r.contains("gpu:1"), "{r}");
    assert!(r.contains("280 W") && r.contains("87%"), "{r}");
    assert!(r.contains("71.2/143.8 GB") && r.contains("64 C"), "{r}");
    assert!(!s.contains("GPU telemetry unavailable"));
    assert!(!s.contains("CPU%"), "no CPU column without cpu_pct:\n{s}");
    assert!(s.contains("GPU power: 279 W"), "{s}");
    assert!(s.contains("GPU utilization: 87%"), "{s}");
}

#[test]
fn keys_select_and_ask_for_restarts() {
    let mut view = View::new(Path::new("/runs/a"), 1.0);
    view.update(cpu_status());
    let press = |c| KeyEvent::new(c, KeyModifiers::NONE);
    assert_eq!(view.key(press(KeyCode::Down)), Action::None);
    assert_eq!(view.selected_worker(), Some(1));
    assert_eq!(
        view.key(KeyEvent::new(KeyCode::Char('R'), KeyModifiers::SHIFT)),
        Action::Restart {
            worker: 1,
            force: true
        }
    );
    view.key(press(KeyCode::Char('j')));
    view.key(press(KeyCode::Char('j')));
    assert_eq!(view.selected_worker(), Some(2));
    assert_eq!(
        view.key(press(KeyCode::Char('r'))),
        Action::Restart {
            worker: 2,
            force: false
        }
    );
    view.key(press(KeyCode::Char('k')));
    view.key(press(KeyCode::Up));
    view.key(press(KeyCode::Up));
    assert_eq!(view.selected_worker(), Some(0));
    for quit in [
        press(KeyCode::Char('q')),
        press(KeyCode::Esc),
        KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL),
    ] {
        assert_eq!(view.key(quit), Action::Quit);
    }
    view.restart_answer(1, true, &Ok(json!({"ok": true, "worker": 1})));
    assert!(screen(&view, 200, 40).contains("restart worker 1 at once: ok"));
}

#[test]
fn a_lost_run_keeps_the_last_screen_and_refuses_restarts() {
    let mut view = View::new(Path::new("/runs/a"), 1.0);
    view.update(cpu_status());
    view.lost(&ClientError::NotRunning("/runs/a".into()));
    let s = screen(&view, 200, 40);
    assert!(s.contains("run not running"), "{s}");
    assert!(s.contains("4101") && s.contains("4103"));
    assert_eq!(view.key(KeyEvent::from(KeyCode::Char('R'))), Action::None);
    assert!(screen(&view, 200, 40).contains("nothing to restart"));
    // It answers again: live again.
    view.update(cpu_status());
    assert!(!screen(&view, 200, 40).contains("run not running"));
}

#[test]
fn missing_or_odd_fields_do_not_panic() {
    let odd = [
        json!(null),
        json!({}),
        json!({"run": 5, "workers": {}}),
        json!({"run": {"epoch": "x", "uptime_s": -5.0, "tokens_per_s": "fast"}}),
        json!({"workers": [{}, 3, null, {"id": "x", "restarts": null}]}),
        json!({"workers": [{"id": 7, "gpu_power_w": -1.0, "cpu_pct": 1e300, "rss_bytes": -4}]}),
        json!({"workers": [{"id": 18_446_744_073_709_551_615u64, "gpu_memory_used_mb": 5}]}),
    ];
    for status in odd {
        let mut view = View::new(Path::new("/x"), 0.5);
        view.update(status.clone());
        for key in [
            KeyCode::Down,
            KeyCode::Down,
            KeyCode::End,
            KeyCode::Char('R'),
        ] {
            let _ = view.key(KeyEvent::from(key));
        }
        for (w, h) in [(200, 50), (80, 24), (20, 5), (1, 1), (0, 0)] {
            let _ = screen(&view, w, h);
        }
        view.update(json!({}));
        let _ = screen(&view, 80, 24);
    }
    // Nothing received yet.
    let _ = screen(&View::new(Path::new("/x"), 1.0), 80, 24);
}

#[test]
fn throughput_and_batches_are_rates_between_answers() {
    let mut view = View::new(Path::new("/runs/a"), 1.0);
    let at = |uptime: f64, tps: f64, done: u64| {
        let mut s = cpu_status();
        s["run"]["uptime_s"] = json!(uptime);
        s["run"]["tokens_per_s"] = json!(tps);
        s["workers"][0]["batches_done"] = json!(done);
        s
    };
    view.update(at(10.0, 100.0, 4));
    assert_eq!(view.throughput.back(), Some(&Some(100)));
    view.update(at(20.0, 150.0, 9));
    // 1000 tokens at 10 s, 3000 at 20 s.
    assert_eq!(view.throughput.back(), Some(&Some(200)));
    assert_eq!(view.history[&0].batches.back(), Some(&Some(5)));
    // A resumed run starts its uptime again: its average stands in.
    view.update(at(2.0, 50.0, 9));
    assert_eq!(view.throughput.back(), Some(&Some(50)));
    let s = screen(&view, 200, 40);
    assert!(
        row(&s, "CPU: 98%").contains("run throughput: 50 tok/s"),
        "{s}"
    );
    let per_worker = row(&s, "  1 target   batches");
    assert!(per_worker.contains('│'), "{per_worker}");
    let bars = |l: &str| l.chars().any(|c| ('▁'..='█').contains(&c));
    assert!(bars(row(&s, "  0 target   cpu")), "{s}");
}

#[test]
fn a_narrow_terminal_hides_the_least_needed_columns() {
    let mut view = View::new(Path::new("/runs/a"), 1.0);
    view.update(cpu_status());
    let wide = screen(&view, 200, 40);
    assert!(!wide.contains("hidden"), "{wide}");
    let s = screen(&view, 80, 24);
    assert!(s.contains("columns hidden"), "{s}");
    for (role, needles) in [
        ("target", ["0", "cpu:0", "busy"]),
        ("drafter", ["2", "cpu:2", "busy"]),
    ] {
        let r = row(&s, role);
        assert!(needles.iter().all(|n| r.contains(n)), "{r}");
    }
    assert!(!s.contains("TEMP") && s.contains("RESTARTS"), "{s}");
}
