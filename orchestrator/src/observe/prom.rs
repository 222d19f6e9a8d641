//! The Prometheus endpoint (`launch --metrics-addr`): gauges set by the main loop, served as text
//! on `GET /metrics` by a thread of its own. GPU series follow the DCGM exporter's names with a
//! `dflash_` prefix and carry `gpu`, `worker` and `role` labels.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::gpu::GpuSample;

type G = Gauge<f64, AtomicU64>;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    pub gpu: String,
    pub worker: String,
    pub role: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker: String,
    pub role: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BucketLabels {
    pub bucket: String,
}

/// Every series the endpoint serves.
pub struct Prom {
    pub addr: SocketAddr,
    gpu: Vec<(&'static str, Family<GpuLabels, G>)>,
    pub worker_up: Family<WorkerLabels, G>,
    pub worker_batches: Family<WorkerLabels, G>,
    pub worker_restarts: Family<WorkerLabels, G>,
    pub worker_cpu: Family<WorkerLabels, G>,
    pub worker_rss: Family<WorkerLabels, G>,
    pub bucket_batches: Family<BucketLabels, G>,
    run: Vec<(&'static str, G)>,
}

/// `--metrics-addr`: `PORT` (on 127.0.0.1) or `HOST:PORT`.
pub fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    let bad = || {
        format!(
            "invalid --metrics-addr {text:?} (expected PORT or HOST:PORT, e.g. 9400 or 127.0.0.1:9400)"
        )
    };
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if !text.contains(':') {
        return Err(bad());
    }
    text.to_socket_addrs()
        .map_err(|_| bad())?
        .next()
        .ok_or_else(bad)
}

const GPU_SERIES: [(&str, &str); 9] = [
    ("dflash_gpu_power_watts", "Power draw (W)"),
    ("dflash_gpu_power_limit_watts", "Enforced power limit (W)"),
    (
        "dflash_gpu_energy_joules",
        "Energy consumed since the driver loaded (J)",
    ),
    ("dflash_gpu_utilization_ratio", "GPU utilization (0-1)"),
    (
        "dflash_gpu_memory_utilization_ratio",
        "Memory bandwidth utilization (0-1)",
    ),
    ("dflash_gpu_memory_used_bytes", "Framebuffer memory used"),
    ("dflash_gpu_memory_total_bytes", "Framebuffer memory total"),
    ("dflash_gpu_temperature_celsius", "GPU temperature"),
    ("dflash_gpu_sm_clock_hertz", "SM clock"),
];

const RUN_SERIES: [(&str, &str); 14] = [
    ("dflash_committed_steps", "Batches committed (plan steps)"),
    ("dflash_epoch", "Current epoch"),
    (
        "dflash_tokens_per_second",
        "Real tokens per second (last 10 s)",
    ),
    (
        "dflash_padded_tokens_per_second",
        "Padded tokens per second (last 10 s)",
    ),
    ("dflash_padding_efficiency_ratio", "Real / padded tokens"),
    ("dflash_input_ring_occupancy_ratio", "Input slots in use"),
    (
        "dflash_feature_ring_occupancy_ratio",
        "Feature slots in use",
    ),
    (
        "dflash_train_loss",
        "Drafter loss of the last optimiser step",
    ),
    ("dflash_train_accuracy", "Draft accuracy of the last step"),
    (
        "dflash_train_acceptance_length",
        "Simulated acceptance length of the last step",
    ),
    (
        "dflash_train_learning_rate",
        "Learning rate of the last step",
    ),
    (
        "dflash_train_grad_norm",
        "Gradient norm of the last step (before clipping)",
    ),
    (
        "dflash_eval_tau",
        "Served acceptance: mean tokens per verify step of speculative decoding on the held-out prompts, at the last evaluated checkpoint",
    ),
    (
        "dflash_train_skipped_steps",
        "Optimiser steps skipped for a NaN or infinity (--on-nonfinite skip) this session",
    ),
];

impl Prom {
    /// Binds `addr` and serves `/metrics` from a thread; the `dflash_train_*` series only when the
    /// run trains a drafter.
    pub fn serve(addr: SocketAddr, training: bool) -> Result<Self, String> {
        let server = tiny_http::Server::http(addr)
            .map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| format!("cannot listen on {addr} for metrics"))?;
        let mut registry = Registry::default();
        let gpu = GPU_SERIES
            .iter()
            .map(|&(name, help)| {
                let family = Family::<GpuLabels, G>::default();
                registry.register(name, help, family.clone());
                (name, family)
            })
            .collect();
        let run = RUN_SERIES
            .iter()
            .filter(|(name, _)| training || !name.starts_with("dflash_train_"))
            .map(|&(name, help)| {
                let gauge = G::default();
                registry.register(name, help, gauge.clone());
                (name, gauge)
            })
            .collect();
        let mut worker = |name: &str, help: &str| {
            let family = Family::<WorkerLabels, G>::default();
            registry.register(name, help, family.clone());
            family
        };
        let worker_up = worker("dflash_worker_up", "1 while the worker process runs");
        let worker_batches = worker("dflash_worker_batches", "Jobs the worker finished");
        let worker_restarts = worker("dflash_worker_restarts", "Restarts of the worker");
        let worker_cpu = worker(
            "dflash_worker_cpu_ratio",
            "CPU time of the worker process (cores)",
        );
        let worker_rss = worker(
            "dflash_worker_resident_memory_bytes",
            "Resident memory of the worker process",
        );
        let bucket_batches = Family::<BucketLabels, G>::default();
        registry.register(
            "dflash_bucket_batches",
            "Batches dispatched per bucket this epoch",
            bucket_batches.clone(),
        );
        let registry = Arc::new(registry);
        std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                for request in server.incoming_requests() {
                    let path = request.url().split('?').next().unwrap_or("");
                    let response =
                        if request.method() == &tiny_http::Method::Get && path == "/metrics" {
                            let mut body = String::new();
                            let _ = prometheus_client::encoding::text::encode(&mut body, &registry);
                            tiny_http::Response::from_string(body).with_header(
                                tiny_http::Header::from_bytes(
                                    "Content-Type",
                                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                                )
                                .expect("a valid header"),
                            )
                        } else {
                            tiny_http::Response::from_string("only GET /metrics is served\n")
                                .with_status_code(404)
                        };
                    let _ = request.respond(response);
                }
            })
            .map_err(|e| format!("cannot start the metrics thread: {e}"))?;
        Ok(Self {
            addr,
            gpu,
            worker_up,
            worker_batches,
            worker_restarts,
            worker_cpu,
            worker_rss,
            bucket_batches,
            run,
        })
    }

    /// Sets the run-level gauge `name` (one of the `dflash_*` run series).
    pub fn set(&self, name: &str, value: f64) {
        if let Some((_, g)) = self.run.iter().find(|(n, _)| *n == name) {
            g.set(value);
        }
    }

    /// Sets a GPU's series from a reading.
    pub fn gpu(&self, labels: &GpuLabels, s: &GpuSample) {
        let values = [
            s.power_w,
            s.power_limit_w,
            s.energy_j,
            s.utilization_pct.map(|u| f64::from(u) / 100.0),
            s.memory_utilization_pct.map(|u| f64::from(u) / 100.0),
            s.memory_used_bytes.map(|b| b as f64),
            s.memory_total_bytes.map(|b| b as f64),
            s.temperature_c.map(f64::from),
            s.sm_clock_mhz.map(|m| f64::from(m) * 1e6),
        ];
        for ((_, family), value) in self.gpu.iter().zip(values) {
            match value {
                Some(v) => {
                    family.get_or_create(labels).set(v);
                }
                None => {
                    family.remove(labels);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_default_to_loopback_and_bad_ones_are_named() {
        assert_eq!(parse_addr("9400").unwrap().to_string(), "127.0.0.1:9400");
        assert_eq!(
            parse_addr("0.0.0.0:9400").unwrap().to_string(),
            "0.0.0.0:9400"
        );
        for bad in ["", "x", "99999", "host", "1.2.3.4:x"] {
            assert!(
                parse_addr(bad)
                    .unwrap_err()
                    .contains("invalid --metrics-addr"),
                "{bad}"
            );
        }
    }

    #[test]
    fn serves_the_series_as_text() {
        let prom = Prom::serve(parse_addr("0").unwrap(), true).unwrap();
        let labels = GpuLabels {
            gpu: "0".into(),
            worker: "2".into(),
            role: "drafter".into(),
        };
        prom.gpu(
            &labels,
            &GpuSample {
                gpu: 0,
                power_w: Some(350.5),
                utilization_pct: Some(90),
                ..Default::default()
            },
        );
        prom.set("dflash_train_loss", 2.5);
        let mut stream = std::net::TcpStream::connect(prom.addr).unwrap();
        use std::io::{Read, Write};
        write!(stream, "GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).unwrap();
        assert!(
            text.contains(r#"dflash_gpu_power_watts{gpu="0",worker="2",role="drafter"} 350.5"#),
            "{text}"
        );
        assert!(
            text.contains(r#"dflash_gpu_utilization_ratio{gpu="0",worker="2",role="drafter"} 0.9"#)
        );
        assert!(text.contains("dflash_train_loss 2.5"));
        assert!(
            !text.contains("dflash_gpu_temperature_celsius{"),
            "missing readings are absent"
        );
    }
}
