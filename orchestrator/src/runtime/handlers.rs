//! The control requests of a live run (`status`, `stop`, `restart`), one handler each, mirroring
//! the commands that send them.

use std::time::Instant;

use serde_json::{Value, json};

use super::spec::Device;
use super::{Outcome, Run, WorkerState, control};
use dflash_common::wire::Job;

impl Run {
    pub(super) fn control(&mut self, request: control::Request) -> Value {
        match request {
            control::Request::Status => self.status(),
            control::Request::Stop => {
                if self.stopping.is_none() {
                    self.stopping = Some(Outcome::Stopped);
                }
                json!({"ok": true, "stopping": true})
            }
            control::Request::Restart { worker, gpu, force } => {
                let found = self.workers.iter().position(|w| match (worker, gpu) {
                    (Some(id), _) => w.id == id,
                    (None, Some(g)) => w.device == Device::Gpu(g) || w.device == Device::Cpu(g),
                    (None, None) => false,
                });
                let Some(i) = found else {
                    return json!({"error": "no such worker (see `dflash-orch status`)"});
                };
                let w = &mut self.workers[i];
                if w.process.is_none() {
                    return json!({"error": format!("worker {} is not running ({})", w.id, w.state.name())});
                }
                if force || w.state == WorkerState::Starting {
                    w.exit_requested = true;
                    w.last_exit = Some("restart requested".into());
                    if let Some(p) = &w.process {
                        p.kill();
                    }
                } else if w.state == WorkerState::Ready {
                    w.exit_requested = true;
                    if let Some(jobs) = &w.jobs {
                        let _ = jobs.send(Job::Stop);
                    }
                } else {
                    w.restart_when_idle = true;
                }
                json!({"ok": true, "worker": w.id, "force": force})
            }
        }
    }

    pub(super) fn status(&self) -> Value {
        let now = Instant::now();
        let uptime = now.duration_since(self.started).as_secs_f64();
        let workers: Vec<Value> = self
            .workers
            .iter()
            .map(|w| {
                let mut v = json!({
                    "id": w.id,
                    "role": w.role.name(),
                    "device": w.device.to_string(),
                    "gpu": match w.device { Device::Gpu(g) => json!(g), Device::Cpu(_) => Value::Null },
                    "pid": w.process.as_ref().map(|p| p.pid),
                    "state": w.state.name(),
                    "cpus": w.cpus,
                    "batches_done": w.batches_done,
                    "restarts": w.restarts,
                    "last_exit": w.last_exit,
                    "heartbeat_age_s": w.process.as_ref().map(|_| now.duration_since(w.last_seen).as_secs_f64()),
                    "cpu_pct": self.monitor.processes.get(&w.id).filter(|_| w.process.is_some()).map(|p| p.cpu_pct),
                    "rss_bytes": self.monitor.processes.get(&w.id).filter(|_| w.process.is_some()).map(|p| p.rss_bytes),
                    "peak_rss_bytes": self.monitor.processes.get(&w.id).filter(|_| w.process.is_some()).and_then(|p| p.peak_rss_bytes),
                });
                let gpu = self.gpu_telemetry(w.device);
                if let (Value::Object(m), Value::Object(g)) = (&mut v, gpu) {
                    m.extend(g);
                }
                v
            })
            .collect();
        let (workers, nodes) = self.with_other_nodes(workers, now);
        json!({
            "nodes": nodes,
            "run": {
                "run_dir": self.run_dir.display().to_string(),
                "run_id": self.run_id,
                "pid": std::process::id(),
                "state": match self.stopping { None => "running", Some(_) => "stopping" },
                "epoch": self.epoch,
                "epochs": self.config.epochs,
                "batch": self.dispatch.next_commit(),
                "batches": self.plan.batches.len(),
                "committed_steps": self.committed_total,
                "uptime_s": uptime,
                "tokens_per_s": self.tokens_committed as f64 / uptime.max(1e-9),
                "stage": self.config.stage,
                "progress": self.progress_line(),
                "metrics_addr": self.metrics.prom.as_ref().map(|p| p.addr.to_string()),
                "gpu_unavailable": self.monitor.unavailable,
                "training": self.metrics.last,
                "eval": self.metrics.last_eval,
                "node": self.link.as_ref().map(|l| l.rank),
                "node_count": self.link.as_ref().map(|l| l.nodes),
            },
            "workers": workers,
        })
    }

    /// With several nodes: every worker marked with its node, and on node 0 the other nodes'
    /// workers and runs from their newest status (`nodes`, with its age).
    fn with_other_nodes(&self, mut workers: Vec<Value>, now: Instant) -> (Vec<Value>, Value) {
        let Some(link) = &self.link else {
            return (workers, Value::Null);
        };
        for w in &mut workers {
            w["node"] = json!(link.rank);
        }
        let mut nodes = vec![json!({"node": link.rank, "age_s": 0.0})];
        for (node, (at, status)) in &link.status {
            nodes.push(json!({
                "node": node,
                "age_s": now.duration_since(*at).as_secs_f64(),
                "run": status["run"],
            }));
            workers.extend(status["workers"].as_array().into_iter().flatten().cloned());
        }
        (workers, json!(nodes))
    }

    pub(super) fn gpu_telemetry(&self, device: Device) -> Value {
        let null = |reason: String| {
            json!({
                "gpu_power_w": null, "gpu_utilization_pct": null, "gpu_memory_used_mb": null,
                "gpu_memory_total_mb": null, "gpu_temperature_c": null, "gpu_unavailable": reason,
            })
        };
        let Device::Gpu(index) = device else {
            return null("CPU worker".into());
        };
        if let Some(why) = &self.monitor.unavailable {
            return null(why.clone());
        }
        let Some(s) = self.monitor.gpus.get(&index) else {
            return null("no reading yet".into());
        };
        json!({
            "gpu_power_w": s.power_w,
            "gpu_power_limit_w": s.power_limit_w,
            "gpu_utilization_pct": s.utilization_pct,
            "gpu_memory_used_mb": s.memory_used_bytes.map(|b| b / 1_000_000),
            "gpu_memory_total_mb": s.memory_total_bytes.map(|b| b / 1_000_000),
            "gpu_temperature_c": s.temperature_c,
            "gpu_sm_clock_mhz": s.sm_clock_mhz,
            "gpu_throttle": s.throttle,
            "gpu_unavailable": null,
        })
    }
}
