//! The monitor the orchestrator runs every `--monitor-interval`: a reading of every GPU of the run
//! (when NVML is there), the CPU and memory (resident, and its peak from /proc) of every worker
//! process, and the warnings they call for. It lives in the orchestrator, so it outlives any worker.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::gpu::{GpuOwner, GpuSample, GpuSource, Watch};

/// A worker process's CPU and memory, its engine's child processes included (a torch worker's
/// Python side): a worker is what it and its children use.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ProcessSample {
    pub worker: u32,
    pub role: &'static str,
    pub pid: u32,
    /// Percent of one core over the last interval.
    pub cpu_pct: f64,
    pub rss_bytes: u64,
    /// The process's peak resident memory so far (the kernel's `VmHWM`), plus each live child's;
    /// absent where it could not be read (the process just ended, or no /proc).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// The child processes counted in (the engine's), by pid.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<u32>,
}

/// The parent pid in a `/proc/<pid>/stat` text (the field after the state, which follows the
/// command name in parentheses; the name may itself hold parentheses and spaces).
pub fn parse_parent(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    fields.next()?;
    fields.next()?.parse().ok()
}

/// The processes whose parent is one of `parents`, by parent, from a scan of /proc (the kernel's
/// per-task `children` lists are not everywhere).
pub fn children_of(parents: &[u32]) -> BTreeMap<u32, Vec<u32>> {
    let mut found: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    if parents.is_empty() {
        return found;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some(parent) = parse_parent(&stat).filter(|p| parents.contains(p)) {
            found.entry(parent).or_default().push(pid);
        }
    }
    for pids in found.values_mut() {
        pids.sort_unstable();
    }
    found
}

/// The peak resident memory (`VmHWM`) in a `/proc/<pid>/status` text, in bytes.
pub fn parse_peak_rss(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    let mut fields = line.split_whitespace();
    let kib: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => kib.checked_mul(1024),
        _ => None,
    }
}

/// The peak resident memory of process `pid`, from the kernel's own high-water mark.
pub fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_peak_rss(&status)
}

/// What one tick found.
#[derive(Debug, Default)]
pub struct Tick {
    pub gpus: Vec<(GpuSample, GpuOwner)>,
    pub processes: Vec<ProcessSample>,
    pub warnings: Vec<String>,
}

pub struct Monitor {
    source: Option<Box<dyn GpuSource>>,
    /// Why there is no GPU telemetry.
    pub unavailable: Option<String>,
    watch: Watch,
    system: Option<sysinfo::System>,
    interval: Duration,
    failing: BTreeMap<u32, String>,
    /// CPU time (ms) of each worker process at the previous tick.
    cpu_before: BTreeMap<u32, (Instant, u64)>,
    /// The latest reading of each GPU.
    pub gpus: BTreeMap<u32, GpuSample>,
    /// The latest sample of each worker.
    pub processes: BTreeMap<u32, ProcessSample>,
}

/// A throttle lasting this long is a warning.
const SUSTAINED: Duration = Duration::from_secs(10);

impl Monitor {
    /// A monitor reading `source`, or, where it is an error, only the worker processes (said once).
    pub fn new(source: Result<Box<dyn GpuSource>, String>, interval: Duration) -> Self {
        let interval = interval.max(Duration::from_millis(10));
        let (source, unavailable) = match source {
            Ok(s) => (Some(s), None),
            Err(why) => (None, Some(why)),
        };
        Self {
            source,
            unavailable,
            watch: Watch::new(
                SUSTAINED
                    .as_secs_f64()
                    .div_euclid(interval.as_secs_f64())
                    .max(1.0) as u32,
            ),
            system: sysinfo::System::new().ok(),
            interval,
            failing: BTreeMap::new(),
            cpu_before: BTreeMap::new(),
            gpus: BTreeMap::new(),
            processes: BTreeMap::new(),
        }
    }

    /// Reads the GPUs `gpus` (index and the worker it serves) and the worker processes `workers`
    /// (worker id, role, pid).
    pub fn tick(&mut self, gpus: &[(u32, GpuOwner)], workers: &[(u32, &'static str, u32)]) -> Tick {
        let mut tick = Tick::default();
        if let Some(source) = self.source.as_mut() {
            for (gpu, owner) in gpus {
                match source.sample(*gpu) {
                    Ok(s) => {
                        self.failing.remove(gpu);
                        self.gpus.insert(*gpu, s.clone());
                        tick.gpus.push((s, owner.clone()));
                    }
                    Err(e) => {
                        if self.failing.insert(*gpu, e.clone()).as_ref() != Some(&e) {
                            tick.warnings.push(format!(
                                "GPU {gpu} (worker {}, {}): cannot be read: {e}",
                                owner.worker, owner.role
                            ));
                        }
                        self.gpus.remove(gpu);
                    }
                }
            }
            let xids = source.xid_events();
            let samples: Vec<GpuSample> = tick.gpus.iter().map(|(s, _)| s.clone()).collect();
            let owner = |g: u32| gpus.iter().find(|(i, _)| *i == g).map(|(_, o)| o.clone());
            tick.warnings
                .extend(self.watch.update(&samples, &xids, owner));
        }
        if let Some(system) = self.system.as_mut() {
            let parents: Vec<u32> = workers.iter().map(|&(_, _, pid)| pid).collect();
            let children = children_of(&parents);
            let pids: Vec<sysinfo::Pid> = parents
                .iter()
                .chain(children.values().flatten())
                .map(|&pid| sysinfo::Pid::from_u32(pid))
                .collect();
            system.refresh_processes_specifics(
                sysinfo::ProcessesToUpdate::Some(&pids),
                true,
                sysinfo::ProcessRefreshKind::nothing()
                    .with_cpu()
                    .with_memory(),
            );
            self.processes.clear();
            let now = Instant::now();
            let mut cpu_now = BTreeMap::new();
            for &(worker, role, pid) in workers {
                if system.process(sysinfo::Pid::from_u32(pid)).is_none() {
                    continue;
                }
                let kids = children.get(&pid).cloned().unwrap_or_default();
                let mut sample = ProcessSample {
                    worker,
                    role,
                    pid,
                    cpu_pct: 0.0,
                    rss_bytes: 0,
                    peak_rss_bytes: Some(0),
                    children: Vec::new(),
                };
                for &one in std::iter::once(&pid).chain(&kids) {
                    let Some(p) = system.process(sysinfo::Pid::from_u32(one)) else {
                        continue;
                    };
                    // CPU time over wall time since the last tick (since the start at first).
                    let cpu_ms = p.accumulated_cpu_time();
                    cpu_now.insert(one, (now, cpu_ms));
                    let (wall_ms, used_ms) = match self.cpu_before.get(&one) {
                        Some(&(then, before)) => (
                            now.duration_since(then).as_secs_f64() * 1000.0,
                            cpu_ms.saturating_sub(before) as f64,
                        ),
                        None => (p.run_time() as f64 * 1000.0, cpu_ms as f64),
                    };
                    if wall_ms > 0.0 {
                        sample.cpu_pct += 100.0 * used_ms / wall_ms;
                    }
                    sample.rss_bytes += p.memory();
                    // A child that has just ended leaves its parent's figure as it was.
                    let peak = peak_rss(one);
                    if one == pid {
                        sample.peak_rss_bytes = peak;
                    } else if let Some(peak) = peak {
                        sample.peak_rss_bytes = sample.peak_rss_bytes.map(|p| p + peak);
                        sample.children.push(one);
                    }
                }
                self.processes.insert(worker, sample.clone());
                tick.processes.push(sample);
            }
            self.cpu_before = cpu_now;
        }
        tick
    }
}

/// The monitor on a thread of its own: NVML calls (which a wedged GPU or driver can stall) never
/// block the dispatcher's loop. The loop asks for a reading when one is due and picks it up when
/// it is ready; the latest readings stay here for `status`.
pub struct Background {
    requests: std::sync::mpsc::Sender<Request>,
    readings: std::sync::mpsc::Receiver<Reading>,
    in_flight: bool,
    interval: Duration,
    next: Instant,
    /// Why there is no GPU telemetry.
    pub unavailable: Option<String>,
    /// The latest reading of each GPU.
    pub gpus: BTreeMap<u32, GpuSample>,
    /// The latest sample of each worker.
    pub processes: BTreeMap<u32, ProcessSample>,
}

struct Request {
    gpus: Vec<(u32, GpuOwner)>,
    workers: Vec<(u32, &'static str, u32)>,
}

struct Reading {
    tick: Tick,
    gpus: BTreeMap<u32, GpuSample>,
    processes: BTreeMap<u32, ProcessSample>,
}

impl Background {
    pub fn spawn(mut monitor: Monitor) -> Self {
        let (requests, incoming) = std::sync::mpsc::channel::<Request>();
        let (done, readings) = std::sync::mpsc::channel();
        let unavailable = monitor.unavailable.clone();
        let interval = monitor.interval;
        let _ = std::thread::Builder::new()
            .name("monitor".into())
            .spawn(move || {
                for request in incoming {
                    let tick = monitor.tick(&request.gpus, &request.workers);
                    let reading = Reading {
                        tick,
                        gpus: monitor.gpus.clone(),
                        processes: monitor.processes.clone(),
                    };
                    if done.send(reading).is_err() {
                        return;
                    }
                }
            });
        Self {
            requests,
            readings,
            in_flight: false,
            interval,
            next: Instant::now(),
            unavailable,
            gpus: BTreeMap::new(),
            processes: BTreeMap::new(),
        }
    }

    /// A reading is due and none is under way.
    pub fn due(&self) -> bool {
        !self.in_flight && Instant::now() >= self.next
    }

    /// Asks for a reading of `gpus` (index and the worker it serves) and the worker processes
    /// `workers` (worker id, role, pid).
    pub fn request(&mut self, gpus: Vec<(u32, GpuOwner)>, workers: Vec<(u32, &'static str, u32)>) {
        self.next = Instant::now() + self.interval;
        self.in_flight = self.requests.send(Request { gpus, workers }).is_ok();
    }

    /// The reading asked for, once it is there (never blocks).
    pub fn poll(&mut self) -> Option<Tick> {
        let reading = self.readings.try_recv().ok()?;
        self.in_flight = false;
        self.gpus = reading.gpus;
        self.processes = reading.processes;
        Some(reading.tick)
    }
}

#[cfg(test)]
mod tests {
    use super::super::gpu::FakeSource;
    use super::*;

    #[test]
    fn a_tick_reads_gpus_and_worker_processes_and_names_unreadable_gpus_once() {
        let fake = FakeSource::parse(
            r#"{"ticks": [{"samples": [{"gpu": 0, "power_w": 100.0, "throttle": []}]}]}"#,
        )
        .unwrap();
        let mut m = Monitor::new(Ok(Box::new(fake)), Duration::from_millis(10));
        let owner = |w| GpuOwner {
            worker: w,
            role: "target",
        };
        let me = std::process::id();
        for round in 0..2 {
            let t = m.tick(&[(0, owner(0)), (1, owner(1))], &[(0, "target", me)]);
            assert_eq!(t.gpus.len(), 1);
            assert_eq!(t.gpus[0].0.power_w, Some(100.0));
            assert_eq!(t.processes.len(), 1);
            assert!(t.processes[0].rss_bytes > 0);
            let peak = t.processes[0].peak_rss_bytes.expect("this process's VmHWM");
            assert!(peak >= t.processes[0].rss_bytes / 2, "{:?}", t.processes[0]);
            // The missing GPU 1 is warned about once.
            assert_eq!(
                t.warnings.len(),
                if round == 0 { 1 } else { 0 },
                "{:?}",
                t.warnings
            );
        }
        assert_eq!(m.gpus.len(), 1);
        // A busy process shows its CPU use.
        let spin = std::time::Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(400) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let t = m.tick(&[], &[(0, "target", me)]);
        assert!(t.processes[0].cpu_pct > 5.0, "{:?}", t.processes);
        let none = Monitor::new(Err("NVML not available".into()), Duration::from_secs(1));
        assert_eq!(none.unavailable.as_deref(), Some("NVML not available"));
    }

    #[test]
    fn the_peak_rss_is_read_from_vmhwm_and_a_bad_status_gives_none() {
        let status =
            "Name:\tdflash-worker\nVmPeak:\t  900 kB\nVmHWM:\t    2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(parse_peak_rss(status), Some(2048 * 1024));
        for bad in [
            "",
            "Name:\tx\nVmRSS:\t1024 kB\n",
            "VmHWM:\n",
            "VmHWM:\t  -4 kB\n",
            "VmHWM:\t  12x kB\n",
            "VmHWM:\t  12 MB\n",
            "VmHWM:\t  12\n",
            "VmHWM:\t99999999999999999999 kB\n",
            "VmHWM:\t18446744073709551615 kB\n",
        ] {
            assert_eq!(parse_peak_rss(bad), None, "{bad:?}");
        }
        // A process that is gone has no status: nothing, and no panic.
        assert_eq!(peak_rss(u32::MAX), None);
        // It serializes only when known.
        let mut sample = ProcessSample {
            worker: 1,
            role: "drafter",
            pid: 1,
            cpu_pct: 0.0,
            rss_bytes: 5,
            peak_rss_bytes: None,
            children: Vec::new(),
        };
        let line = serde_json::to_value(&sample).unwrap();
        assert!(line.get("peak_rss_bytes").is_none(), "{line}");
        sample.peak_rss_bytes = Some(7);
        assert_eq!(serde_json::to_value(&sample).unwrap()["peak_rss_bytes"], 7);
    }

    /// A worker's figures include its children (a torch worker's Python side): a live child is
    /// named, its memory counted in; a stat line names its parent however odd the command name.
    #[test]
    fn a_worker_counts_its_child_processes() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let me = std::process::id();
        // Until the child has exec'd it may still be the fork of this process; wait for `sleep`.
        let comm = format!("/proc/{}/comm", child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
            assert!(Instant::now() < deadline, "the child never became `sleep`");
            std::thread::sleep(Duration::from_millis(5));
        }
        // The peak only grows, so this process's peak before the tick bounds the one it reads.
        let own = peak_rss(me).unwrap();
        let mut m = Monitor::new(Err("no GPUs".into()), Duration::from_millis(10));
        let t = m.tick(&[], &[(0, "drafter", me)]);
        let _ = child.kill();
        let _ = child.wait();
        let sample = &t.processes[0];
        assert!(sample.children.contains(&child.id()), "{sample:?}");
        assert!(sample.peak_rss_bytes.unwrap() > own, "{sample:?} vs {own}");
        assert!(
            children_of(&[me])
                .get(&me)
                .is_none_or(|c| !c.contains(&child.id()))
        );
        assert!(children_of(&[]).is_empty());
        assert_eq!(parse_parent("12 (a) b) c) S 34 12 12 0"), Some(34));
        assert_eq!(parse_parent("12 (python3) R 1 2 3"), Some(1));
        for bad in [
            "",
            "12 python3 S 1",
            "12 (x) S",
            "12 (x) S -1",
            "12 (x) S 1x",
            "12 (x",
        ] {
            assert_eq!(parse_parent(bad), None, "{bad:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_status_text_gives_an_answer_not_a_panic(
            text in "(VmHWM:[ \t]{0,3}[0-9a-z -]{0,24}\n)?[ -~\t\n]{0,120}",
        ) {
            if let Some(bytes) = parse_peak_rss(&text) {
                proptest::prop_assert!(bytes.is_multiple_of(1024));
            }
        }
    }

    /// A GPU that answers only after a while (a wedged driver call).
    struct Wedged(std::sync::mpsc::Receiver<()>);

    impl GpuSource for Wedged {
        fn sample(&mut self, gpu: u32) -> Result<GpuSample, String> {
            let _ = self.0.recv();
            Ok(GpuSample {
                gpu,
                ..Default::default()
            })
        }

        fn xid_events(&mut self) -> Vec<super::super::gpu::XidEvent> {
            Vec::new()
        }
    }

    #[test]
    fn a_wedged_gpu_never_blocks_the_caller() {
        let (release, wedge) = std::sync::mpsc::channel();
        let monitor = Monitor::new(Ok(Box::new(Wedged(wedge))), Duration::from_millis(10));
        let mut background = Background::spawn(monitor);
        assert!(background.due());
        let owner = GpuOwner {
            worker: 0,
            role: "target",
        };
        background.request(vec![(0, owner)], Vec::new());
        // The reading is stuck in the driver: the loop goes on, and asks for no second one.
        for _ in 0..20 {
            assert!(background.poll().is_none());
            assert!(!background.due());
            std::thread::sleep(Duration::from_millis(5));
        }
        release.send(()).unwrap();
        let tick = loop {
            if let Some(tick) = background.poll() {
                break tick;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(tick.gpus.len(), 1);
        assert!(background.gpus.contains_key(&0));
    }
}
