//! What the monitor costs: CPU time of one tick reading 8 GPUs (a recorded fake device with the
//! same parsing and warning logic as NVML's) and the worker processes, written to every sink
//! (metrics.jsonl, TensorBoard, Prometheus gauges), and the share of one core that is at one tick
//! per second.
//!
//! cargo run --release --example monitor_cost -p dflash-orch [-- TICKS]

use std::time::Duration;

use dflash_orch::observe::gpu::{FakeSource, FakeTick, GpuOwner, GpuSample, XidEvent};
use dflash_orch::observe::monitor::Monitor;
use dflash_orch::observe::prom::{Prom, parse_addr};
use dflash_orch::runtime::metrics::Metrics;

fn cpu_seconds() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .expect("getrusage");
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(usage.user_time()) + t(usage.system_time())
}

fn main() {
    let ticks: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    // A recording of 8 busy GPUs, one of them throttling now and then, with an XID now and then.
    let recording: Vec<FakeTick> = (0..100u32)
        .map(|t| FakeTick {
            samples: (0..8u32)
                .map(|gpu| GpuSample {
                    gpu,
                    power_w: Some(600.0 + f64::from((t * 7 + gpu) % 90)),
                    power_limit_w: Some(700.0),
                    energy_j: Some(1e6 + f64::from(t) * 650.0),
                    utilization_pct: Some(90 + (t + gpu) % 10),
                    memory_utilization_pct: Some(40),
                    memory_used_bytes: Some(120_000_000_000),
                    memory_total_bytes: Some(143_771_000_000),
                    temperature_c: Some(70 + (t + gpu) % 15),
                    sm_clock_mhz: Some(1980),
                    throttle: if gpu == 3 && t % 20 < 12 {
                        vec!["sw_thermal".into()]
                    } else {
                        Vec::new()
                    },
                })
                .collect(),
            xids: if t % 50 == 49 {
                vec![XidEvent {
                    gpu: 5,
                    xid: Some(79),
                }]
            } else {
                Vec::new()
            },
        })
        .collect();
    let fake = FakeSource {
        ticks: recording.iter().cycle().take(ticks).cloned().collect(),
        at: 0,
    };
    let dir = std::env::temp_dir().join(format!("dflash-monitor-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let prom = Prom::serve(parse_addr("0").expect("addr"), true).expect("prometheus");
    let mut metrics = Metrics::open(&dir, Some(prom)).expect("metrics");
    let mut monitor = Monitor::new(Ok(Box::new(fake)), Duration::from_millis(10));
    let gpus: Vec<(u32, GpuOwner)> = (0..8)
        .map(|g| {
            (
                g,
                GpuOwner {
                    worker: g,
                    role: if g < 7 { "target" } else { "drafter" },
                },
            )
        })
        .collect();
    let me = std::process::id();
    let workers: Vec<(u32, &'static str, u32)> = (0..8)
        .map(|w| (w, if w < 7 { "target" } else { "drafter" }, me))
        .collect();
    let started = cpu_seconds();
    let mut warnings = 0;
    for _ in 0..ticks {
        let tick = monitor.tick(&gpus, &workers);
        warnings += tick.warnings.len();
        metrics
            .monitor(&tick.gpus, &tick.processes)
            .expect("metrics");
    }
    let per_tick = (cpu_seconds() - started) / ticks as f64;
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{ticks} ticks of 8 GPUs and 8 worker processes: {:.1} µs of CPU per tick = {:.3}% of one core at one tick per second ({warnings} warnings)",
        per_tick * 1e6,
        per_tick * 100.0
    );
}
