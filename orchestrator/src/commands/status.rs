//! `dflash-orch status`: what the live run is doing, worker by worker.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde_json::Value;

use crate::error::CliError;
use crate::runtime::control::{self, ClientError, Request};

#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// The run directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub run_dir: PathBuf,

    /// Print one JSON object: {"run": {...}, "workers": [...]}.
    #[arg(long)]
    pub json: bool,

    /// Refresh every SECS seconds until interrupted (0.05 to 3600).
    #[arg(long, value_name = "SECS", value_parser = crate::options::interval())]
    pub watch: Option<f64>,
}

pub fn client_error(e: ClientError) -> CliError {
    match e {
        ClientError::NotRunning(_) | ClientError::Io(_) => CliError::Failed(e.to_string()),
        ClientError::Refused(_) => CliError::Invalid(e.to_string()),
    }
}

pub fn run(args: StatusArgs) -> Result<(), CliError> {
    loop {
        let value = control::request(&args.run_dir, &Request::Status).map_err(client_error)?;
        crate::commands::print_result(args.json, &value, || text(&value))?;
        match args.watch {
            Some(secs) if secs > 0.0 => std::thread::sleep(Duration::from_secs_f64(secs)),
            _ => return Ok(()),
        }
    }
}

fn text(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let r = &v["run"];
    let _ = writeln!(
        o,
        "run {} ({}): epoch {}/{}, batch {}/{}, {} steps committed, {:.0} tokens/s, up {:.0} s",
        r["run_dir"].as_str().unwrap_or(""),
        r["state"].as_str().unwrap_or(""),
        r["epoch"],
        r["epochs"],
        r["batch"],
        r["batches"],
        r["committed_steps"],
        r["tokens_per_s"].as_f64().unwrap_or(0.0),
        r["uptime_s"].as_f64().unwrap_or(0.0)
    );
    if let Some(progress) = r["progress"].as_str() {
        let _ = writeln!(o, "{progress}");
    }
    if let (Some(node), Some(count)) = (r["node"].as_u64(), r["node_count"].as_u64()) {
        let others = if node == 0 {
            "every node's workers below"
        } else {
            "node 0's status shows every node"
        };
        let _ = writeln!(o, "node {node} of {count} ({others})");
    }
    if let Some(addr) = r["metrics_addr"].as_str() {
        let _ = writeln!(o, "metrics: http://{addr}/metrics");
    }
    // A run of several nodes: the others as node 0 last heard of them.
    for n in v["nodes"].as_array().into_iter().flatten().skip(1) {
        let nr = &n["run"];
        let _ = writeln!(
            o,
            "node {} ({}, heard {:.1} s ago): epoch {}/{}, batch {}/{}, {} steps committed, {:.0} tokens/s",
            n["node"],
            nr["state"].as_str().unwrap_or("?"),
            n["age_s"].as_f64().unwrap_or(0.0),
            nr["epoch"],
            nr["epochs"],
            nr["batch"],
            nr["batches"],
            nr["committed_steps"],
            nr["tokens_per_s"].as_f64().unwrap_or(0.0),
        );
    }
    let node_column = v["nodes"].is_array();
    let header = [
        "id",
        "role",
        "device",
        "pid",
        "state",
        "cpus",
        "batches",
        "restarts",
        "heartbeat",
    ];
    if node_column {
        o.push_str("node ");
    }
    let _ = writeln!(
        o,
        "{:>3} {:<8} {:<7} {:>8} {:<10} {:<8} {:>8} {:>8} {:>9}  gpu / last exit",
        header[0],
        header[1],
        header[2],
        header[3],
        header[4],
        header[5],
        header[6],
        header[7],
        header[8]
    );
    for w in v["workers"].as_array().into_iter().flatten() {
        let cpus: Vec<String> = w["cpus"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| c.to_string())
            .collect();
        let process = match (w["cpu_pct"].as_f64(), w["rss_bytes"].as_u64()) {
            (Some(c), Some(m)) => format!("cpu {c:.0}%, {}; ", crate::format::bytes(m)),
            _ => String::new(),
        };
        let gpu = match w["gpu_power_w"].as_f64() {
            Some(p) => format!(
                "{process}{p:.0} W, {}% util, {} MB, {} C",
                w["gpu_utilization_pct"], w["gpu_memory_used_mb"], w["gpu_temperature_c"]
            ),
            None => format!(
                "{process}gpu: {}",
                w["gpu_unavailable"].as_str().unwrap_or("n/a")
            ),
        };
        let last = w["last_exit"]
            .as_str()
            .map(|e| format!("; last exit: {e}"))
            .unwrap_or_default();
        if node_column {
            let node = w["node"].as_u64().map_or("-".to_owned(), |n| n.to_string());
            let _ = write!(o, "{node:>4} ");
        }
        let _ = writeln!(
            o,
            "{:>3} {:<8} {:<7} {:>8} {:<10} {:<8} {:>8} {:>8} {:>8}s  {gpu}{last}",
            w["id"],
            w["role"].as_str().unwrap_or(""),
            w["device"].as_str().unwrap_or(""),
            w["pid"].as_u64().map_or("-".into(), |p| p.to_string()),
            w["state"].as_str().unwrap_or(""),
            cpus.join(","),
            w["batches_done"],
            w["restarts"],
            w["heartbeat_age_s"]
                .as_f64()
                .map_or("-".into(), |a| format!("{a:.1}")),
        );
    }
    o
}
