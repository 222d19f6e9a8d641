//! What the monitor costs: CPU time (and wall time) of one `Monitor::tick` and its writes to every
//! sink (metrics.jsonl, TensorBoard, Prometheus gauges), and the share of one core that is at one
//! tick per second.
//!
//! Two measurements, each over 8 worker processes (8 `sleep` children standing in for workers, so
//! that the CPU and memory of 8 real processes are read through sysinfo/`/proc` every tick):
//!   1. 8 GPUs from a recorded fake device (`FakeSource`): the monitor's own work on 8 GPUs'
//!      readings (throttle and XID warning logic, sinks), without any NVML call. Runs everywhere.
//!   2. The machine's real GPUs (up to 8) through NVML (`NvmlSource`, as a run reads them): the
//!      same, plus the NVML calls of every reading (power, limit, energy, utilization, memory,
//!      temperature, SM clock, throttle reasons, XID events). Only where NVML loads and sees a GPU;
//!      elsewhere the output says that this figure was not measured and what the first one leaves
//!      out.
//!
//! cargo run --release --example monitor_cost -p dflash-orch [-- TICKS]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dflash_orch::observe::gpu::{
    FakeSource, FakeTick, GpuOwner, GpuSample, GpuSource, NvmlSource, XidEvent,
};
use dflash_orch::observe::monitor::Monitor;
use dflash_orch::observe::prom::{Prom, parse_addr};
use dflash_orch::runtime::metrics::Metrics;
use dflash_orch::runtime::{gpu_count, init_nvml};

/// The worker stand-ins; killed however the example ends.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn cpu_seconds() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .expect("getrusage");
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(usage.user_time()) + t(usage.system_time())
}

/// A recording of 8 busy GPUs, one of them throttling now and then, with an XID now and then.
fn recording(ticks: usize) -> FakeSource {
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
    FakeSource {
        ticks: recording.iter().cycle().take(ticks).cloned().collect(),
        at: 0,
    }
}

/// Per-tick cost of `ticks` ticks over `gpus` and `workers`, all sinks written.
struct Cost {
    cpu_s: f64,
    wall_s: f64,
    warnings: usize,
    gpu_readings: usize,
}

fn measure(
    source: Box<dyn GpuSource>,
    gpus: &[u32],
    workers: &[(u32, &'static str, u32)],
    ticks: usize,
    label: &str,
) -> Cost {
    let dir = std::env::temp_dir().join(format!(
        "dflash-monitor-cost-{}-{label}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let prom = Prom::serve(parse_addr("0").expect("addr"), true).expect("prometheus");
    let mut metrics = Metrics::open(&dir, Some(prom)).expect("metrics");
    let mut monitor = Monitor::new(Ok(source), Duration::from_millis(10));
    let owners: Vec<(u32, GpuOwner)> = gpus
        .iter()
        .enumerate()
        .map(|(i, &g)| {
            (
                g,
                GpuOwner {
                    worker: i as u32,
                    role: if i + 1 < gpus.len() {
                        "target"
                    } else {
                        "drafter"
                    },
                },
            )
        })
        .collect();
    let (mut warnings, mut gpu_readings) = (0, 0);
    let (cpu, wall) = (cpu_seconds(), Instant::now());
    for _ in 0..ticks {
        let tick = monitor.tick(&owners, workers);
        warnings += tick.warnings.len();
        gpu_readings += tick.gpus.len();
        metrics
            .monitor(&tick.gpus, &tick.processes)
            .expect("metrics");
    }
    let cost = Cost {
        cpu_s: (cpu_seconds() - cpu) / ticks as f64,
        wall_s: wall.elapsed().as_secs_f64() / ticks as f64,
        warnings,
        gpu_readings,
    };
    drop(metrics);
    let _ = std::fs::remove_dir_all(&dir);
    cost
}

fn report(what: &str, ticks: usize, cost: &Cost) {
    println!(
        "{what}: {ticks} ticks, {:.1} µs of CPU per tick = {:.3}% of one core at one tick per \
         second ({:.1} µs wall per tick; {} GPU readings, {} warnings)",
        cost.cpu_s * 1e6,
        cost.cpu_s * 100.0,
        cost.wall_s * 1e6,
        cost.gpu_readings,
        cost.warnings
    );
}

fn main() {
    let ticks: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000)
        .max(1);
    let stand_ins = Workers(
        (0..8)
            .map(|_| {
                Command::new("sleep")
                    .arg("3600")
                    .stdin(Stdio::null())
                    .spawn()
                    .expect("start a worker stand-in (sleep)")
            })
            .collect(),
    );
    let workers: Vec<(u32, &'static str, u32)> = stand_ins
        .0
        .iter()
        .enumerate()
        .map(|(w, c)| (w as u32, if w < 7 { "target" } else { "drafter" }, c.id()))
        .collect();

    let fake = measure(
        Box::new(recording(ticks)),
        &(0..8).collect::<Vec<u32>>(),
        &workers,
        ticks,
        "fake",
    );
    report(
        "8 GPUs from a recorded fake device (no NVML calls) and 8 worker processes",
        ticks,
        &fake,
    );

    let nvml = init_nvml();
    match gpu_count(&nvml) {
        Ok(n) if n > 0 => {
            let nvml = nvml.expect("gpu_count succeeded");
            let gpus: Vec<u32> = (0..n.min(8)).collect();
            let source = NvmlSource::new(nvml, &gpus);
            let real = measure(Box::new(source), &gpus, &workers, ticks, "nvml");
            report(
                &format!(
                    "{} real GPU(s) through NVML (every NVML call of a run's tick) and 8 worker \
                     processes",
                    gpus.len()
                ),
                ticks,
                &real,
            );
            if real.gpu_readings < ticks * gpus.len() {
                println!(
                    "  ({} of {} GPU readings failed: their NVML calls are in the figure, their \
                     sinks are not)",
                    ticks * gpus.len() - real.gpu_readings,
                    ticks * gpus.len()
                );
            }
        }
        found => {
            let why = match found {
                Ok(_) => "NVML sees no GPU".to_owned(),
                Err(e) => e,
            };
            println!(
                "NVML not measured here ({why}): the figure above does NOT include any NVML \
                 call. It includes the monitor's work on 8 GPUs' readings (the throttle and XID \
                 warning logic), the CPU and memory of 8 worker processes read through sysinfo, \
                 and the writes to metrics.jsonl, TensorBoard and the Prometheus gauges. Run this \
                 on a machine with GPUs and a driver for the figure with NVML."
            );
        }
    }
}
