//! dflash-worker: one process per GPU (or CPU slot), spawned and supervised by `dflash-orch`.
//!
//! A worker connects to the orchestrator over ipc-channel, maps the run's shared-memory rings,
//! and runs its stage on the batches the orchestrator hands it, one job at a time, answering each.
//! A heartbeat thread tells the orchestrator it is alive; when the orchestrator goes away the
//! worker exits (and the kernel kills it if the orchestrator dies: PR_SET_PDEATHSIG).
//!
//! Test and fault-injection hooks (see [`faults`]), off unless set:
//! - `DFLASH_WORKER_FAULTS=1`: SIGUSR1 makes the next Forward or Train job hang forever while
//!   heartbeats continue (without it, SIGUSR1 keeps its default action);
//! - `DFLASH_WORKER_HANG_EVERY_JOB=1`: every Forward and Train job hangs that way.

pub mod bench;
pub mod checkpoint;
pub mod dflash;
pub mod faults;
pub mod generate;
pub mod model;
pub mod rng;
pub mod sampling;
pub mod speculative;
pub mod stage;
pub mod torch;
pub mod train;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use dflash_common::dflash::Engine;
use dflash_common::exit_code;
use dflash_common::ring::Ring;
use dflash_common::wire::{Event, Hello, Job, PROTOCOL, Role};
use ipc_channel::ipc::{self, IpcSender};

const AFTER_HELP: &str = "\
dflash-worker is started by `dflash-orch launch`, one per GPU, with these options filled in; run
`dflash-orch launch --help` to start a run.

Exit codes:
  0  stopped on request
  1  failed while working (lost the orchestrator, bad ring, stage error)
  2  invalid arguments";

/// One worker process of a dflash-orch run.
#[derive(Debug, Parser)]
#[command(name = "dflash-worker", version, after_help = AFTER_HELP)]
pub struct WorkerArgs {
    /// Name of the orchestrator's one-shot IPC server.
    #[arg(long, value_name = "NAME")]
    pub ipc: Option<String>,

    /// This worker's id within the run.
    #[arg(long, value_name = "ID", default_value_t = 0)]
    pub worker: u32,

    /// target | drafter.
    #[arg(long, value_name = "ROLE", default_value = "target")]
    pub role: String,

    /// The stage to run: dflash (the target model forward, or DFlash drafter training, as
    /// --dflash-config says), or synthetic (tests and benchmarks: derives features from tokens and
    /// checks them; no model).
    #[arg(long, value_name = "STAGE", default_value = "synthetic")]
    pub stage: String,

    /// The run's DFlash settings (JSON, written by the orchestrator), for --stage dflash.
    #[arg(long, value_name = "PATH")]
    pub dflash_config: Option<PathBuf>,

    /// Print what this build can do (protocol, stages, CUDA) as JSON and exit.
    #[arg(long)]
    pub capabilities: bool,

    /// Time the features' copies on this worker's device (the GPU of CUDA_VISIBLE_DEVICES, else
    /// the CPU): a batch of MIB mebibytes written into a host buffer as a target worker writes
    /// its feature slot, and read back as the drafter reads it; prints GB/s per dtype as JSON.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub copy_bench: Option<u32>,

    /// Time training steps of the candle drafter on this worker's device (the GPU of
    /// CUDA_VISIBLE_DEVICES, else the CPU) at the shape REQUEST gives (a JSON file, `-` for
    /// stdin: the target's widths, drafter layers, anchors, sequences; no model is read); prints
    /// the timings as JSON. The GPU check runs it at the seeds' shape.
    #[arg(long, value_name = "REQUEST", conflicts_with_all = ["eval", "generate", "copy_bench"])]
    pub drafter_bench: Option<PathBuf>,

    /// Evaluate a drafter by speculative decoding (written by `dflash-orch eval`): decode the
    /// request's prompts on this worker's device and print one JSON line per prompt. `-`
    /// reads the request as one JSON line on stdin.
    #[arg(long, value_name = "REQUEST")]
    pub eval: Option<PathBuf>,

    /// Generate with the target (for `dflash-orch generate`): load the request's model, then
    /// answer each batch of prompts read from stdin with one JSON line on stdout. `-` reads the
    /// request as the first line on stdin.
    #[arg(long, value_name = "REQUEST", conflicts_with = "eval")]
    pub generate: Option<PathBuf>,

    /// Synthetic stage: microseconds spent per token of this worker's work (a target's forward,
    /// a drafter's training).
    #[arg(long, value_name = "US", default_value_t = 0.0, value_parser = microseconds)]
    pub synthetic_us_per_token: f64,

    /// The input ring (shared memory).
    #[arg(long, value_name = "PATH")]
    pub input_ring: Option<PathBuf>,

    /// The feature ring (shared memory).
    #[arg(long, value_name = "PATH")]
    pub feature_ring: Option<PathBuf>,

    /// Interval between heartbeats.
    #[arg(long, value_name = "MS", default_value_t = 200)]
    pub heartbeat_ms: u64,
}

/// Why a worker stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("no orchestrator to serve: dflash-worker is started by `dflash-orch launch`")]
    NoOrchestrator,
    #[error("{0}")]
    Invalid(String),
    #[error("lost the orchestrator: {0}")]
    Disconnected(String),
    #[error(transparent)]
    Ring(#[from] dflash_common::ring::RingError),
    #[error("{0}")]
    Stage(String),
}

impl WorkerError {
    pub fn exit_code(&self) -> u8 {
        match self {
            WorkerError::NoOrchestrator | WorkerError::Invalid(_) => exit_code::INVALID,
            WorkerError::Disconnected(_) | WorkerError::Ring(_) | WorkerError::Stage(_) => {
                exit_code::FAILURE
            }
        }
    }
}

fn open_ring(path: &Option<PathBuf>, what: &str) -> Result<Ring, WorkerError> {
    let path = path
        .as_ref()
        .ok_or_else(|| WorkerError::Invalid(format!("--{what}-ring is required")))?;
    Ok(Ring::open(path)?)
}

/// A synthetic cost: finite microseconds, 0 to 1,000,000.
fn microseconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1e6).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of microseconds from 0 to 1000000"
        )),
    }
}

/// Loads the stage this worker runs.
fn load_stage(args: &WorkerArgs, role: Role) -> Result<Box<dyn stage::Stage>, String> {
    if args.stage == "synthetic" {
        return Ok(Box::new(stage::Synthetic::new(args.synthetic_us_per_token)));
    }
    let path = args
        .dflash_config
        .as_ref()
        .ok_or("--stage dflash needs --dflash-config")?;
    let settings = dflash::read_settings(path)?;
    let feature_ring = args
        .feature_ring
        .as_ref()
        .ok_or("--feature-ring is required")?;
    Ok(match (role, settings.engines.target) {
        (Role::Target, Engine::Torch) => {
            Box::new(torch::TargetStage::new(&settings, feature_ring)?)
        }
        (Role::Target, Engine::Candle) => {
            Box::new(dflash::TargetStage::new(&settings, &dflash::device()?)?)
        }
        (Role::Drafter, _) => Box::new(dflash::DrafterStage::new(&settings, feature_ring)?),
    })
}

/// What this build can do, for `--capabilities`.
pub fn capabilities() -> serde_json::Value {
    serde_json::json!({
        "protocol": PROTOCOL,
        "stages": ["dflash", "synthetic"],
        "cuda": candle_core::utils::cuda_is_available(),
    })
}

/// Serves the orchestrator that started this process until told to stop.
pub fn run(args: WorkerArgs) -> Result<(), WorkerError> {
    if args.capabilities {
        println!("{}", capabilities());
        return Ok(());
    }
    if let Some(mib) = args.copy_bench {
        let device = dflash::device().map_err(WorkerError::Invalid)?;
        let report =
            dflash::copy_bench(&device, u64::from(mib) << 20).map_err(WorkerError::Invalid)?;
        println!("{report}");
        return Ok(());
    }
    if let Some(request) = &args.drafter_bench {
        let text = if request.as_os_str() == "-" {
            std::io::read_to_string(std::io::stdin())
        } else {
            std::fs::read_to_string(request)
        }
        .map_err(|e| WorkerError::Invalid(format!("{}: {e}", request.display())))?;
        let bench = bench::DrafterBench::parse(&text).map_err(WorkerError::Invalid)?;
        let device = dflash::device().map_err(WorkerError::Invalid)?;
        let report = bench::drafter_bench(&bench, &device).map_err(WorkerError::Stage)?;
        println!("{report}");
        return Ok(());
    }
    if let Some(request) = &args.eval {
        return speculative::run_eval(request).map_err(WorkerError::Stage);
    }
    if let Some(request) = &args.generate {
        return generate::run_generate(request).map_err(WorkerError::Stage);
    }
    let name = args.ipc.clone().ok_or(WorkerError::NoOrchestrator)?;
    let role = match args.role.as_str() {
        "target" => Role::Target,
        "drafter" => Role::Drafter,
        other => return Err(WorkerError::Invalid(format!("unknown role {other:?}"))),
    };
    if args.stage != "synthetic" && args.stage != "dflash" {
        return Err(WorkerError::Invalid(format!(
            "unknown stage {:?} (this build has: dflash, synthetic)",
            args.stage
        )));
    }
    // Before connecting: once the orchestrator knows us, a SIGUSR1 must find the hook.
    let faults = faults::Faults::from_env()
        .map_err(|e| WorkerError::Invalid(format!("cannot install the SIGUSR1 hook: {e}")))?;
    let lost = |e: &dyn std::fmt::Display| WorkerError::Disconnected(e.to_string());
    let bootstrap = IpcSender::<Hello>::connect(name).map_err(|e| lost(&e))?;
    let (jobs_tx, jobs) = ipc::channel::<Job>().map_err(|e| lost(&e))?;
    let (events, events_rx) = ipc::channel::<Event>().map_err(|e| lost(&e))?;
    bootstrap
        .send(Hello {
            protocol: PROTOCOL,
            worker: args.worker,
            pid: std::process::id(),
            jobs: jobs_tx,
            events: events_rx,
        })
        .map_err(|e| lost(&e))?;

    let heartbeat = events.clone();
    let every = Duration::from_millis(args.heartbeat_ms.max(1));
    std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || {
            while heartbeat.send(Event::Heartbeat).is_ok() {
                std::thread::sleep(every);
            }
            // The orchestrator is gone: nobody will read our results.
            std::process::exit(i32::from(exit_code::FAILURE));
        })
        .map_err(|e| lost(&e))?;

    let mut feature_ring = open_ring(&args.feature_ring, "feature")?;
    let input_ring = match role {
        Role::Target => Some(open_ring(&args.input_ring, "input")?),
        Role::Drafter => None,
    };
    let mut stage: Box<dyn stage::Stage> = match load_stage(&args, role) {
        Ok(stage) => stage,
        Err(reason) if reason.contains(torch::RENDEZVOUS_FAILED) => {
            // Not the run's fault (a port taken meanwhile, a peer gone): exit as a crash, so
            // that the orchestrator restarts the drafter group on a fresh port.
            return Err(WorkerError::Stage(reason));
        }
        Err(reason) => {
            // The orchestrator fails the run with this reason rather than restarting us in a loop.
            let _ = events.send(Event::Failed {
                id: None,
                reason: reason.clone(),
            });
            return Err(WorkerError::Stage(reason));
        }
    };
    if let Some((cursor, step)) = stage.resumed() {
        events
            .send(Event::Resumed { cursor, step })
            .map_err(|e| lost(&e))?;
    }
    events.send(Event::Ready).map_err(|e| lost(&e))?;
    loop {
        let job = dflash_common::wire::recv(&jobs).map_err(|e| lost(&e))?;
        if !matches!(job, Job::Stop) && faults.hang_now() {
            faults::hang(&format!("{job:?}"));
        }
        let reply = match job {
            Job::Stop => {
                return stage.stop().map_err(|reason| {
                    // The run fails with this reason (a lost final checkpoint), not a bare exit code.
                    let _ = events.send(Event::Failed {
                        id: None,
                        reason: reason.clone(),
                    });
                    WorkerError::Stage(reason)
                });
            }
            Job::Forward { id, input, feature } => {
                let ring = input_ring
                    .as_ref()
                    .ok_or_else(|| WorkerError::Invalid("a drafter got a forward job".into()))?;
                match stage.forward(ring, input, &mut feature_ring, feature) {
                    Ok(nonfinite) => Event::Forwarded { id, nonfinite },
                    Err(reason) => Event::Failed {
                        id: Some(id),
                        reason,
                    },
                }
            }
            Job::Train {
                id,
                feature,
                checksum,
                group,
                nonfinite,
            } => match stage.train(
                &feature_ring,
                feature,
                id,
                checksum,
                group,
                nonfinite.as_deref(),
            ) {
                Ok((found, metrics)) => Event::Trained {
                    id,
                    checksum: found,
                    metrics,
                },
                Err(reason) => Event::Failed {
                    id: Some(id),
                    reason,
                },
            },
            Job::Step { id, group } => match stage.step_only(id, group) {
                Ok(update) => Event::Stepped { id, update },
                Err(reason) => Event::Failed {
                    id: Some(id),
                    reason,
                },
            },
        };
        events.send(reply).map_err(|e| lost(&e))?;
        events.send(Event::Ready).map_err(|e| lost(&e))?;
    }
}

/// The binary's `main`.
pub fn main() -> ExitCode {
    let args = WorkerArgs::parse();
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
