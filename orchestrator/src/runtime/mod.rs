//! The runtime: one orchestrator feeding planned batches through shared-memory rings to pinned
//! worker processes, supervising them, and journaling every committed step.
//!
//! The main loop owns every piece of run state (slots, leases, workers, plan cursor); threads only
//! forward messages to it (worker IPC readers, the control socket). Workers pull: an idle target
//! gets the next batch in plan order, drafters get features in plan order, and the loop commits
//! steps strictly in plan order. A worker that dies or hangs has its leases reclaimed (its batch
//! goes back to the front of the queue) and is restarted with backoff.

pub mod control;
mod dflash_stage;
pub mod journal;
pub mod metrics;
pub mod spec;
pub mod workers;

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dflash_common::dflash::DflashSettings;
use dflash_common::ring::{Layout, Ring, SlotMeta, feature_data_bytes, input_data_bytes};
use dflash_common::run_dir;
use dflash_common::wire::{BatchId, Event, Group, Job, Role, SlotRef, TrainMetrics};
use ipc_channel::ipc::IpcSender;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::planner::{EpochPlan, Layout as PlanLayout, PlanConfig, Planner};
use crate::store::Store;
use journal::{Entry, JournalWriter};
use spec::{Device, Topology};

/// Everything that defines a run; written to the journal's first line and read back by a resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub gpus: String,
    pub topology: Option<String>,
    pub data: Option<PathBuf>,
    pub synthetic: Option<usize>,
    pub synthetic_seed: u64,
    pub stage: String,
    pub synthetic_us_per_token: f64,
    pub epochs: u32,
    pub planner: PlannerSettings,
    pub max_restarts: u32,
    pub restart_window_s: f64,
    pub heartbeat_timeout_s: f64,
    pub heartbeat_ms: u64,
    /// Seconds between monitor readings (GPUs, worker processes).
    #[serde(default = "default_monitor_interval")]
    pub monitor_interval_s: f64,
    /// The Prometheus endpoint's address (`--metrics-addr`).
    #[serde(default)]
    pub metrics_addr: Option<String>,
    /// The DFlash stage's settings (`--stage dflash`).
    #[serde(default)]
    pub dflash: Option<DflashSettings>,
}

fn default_monitor_interval() -> f64 {
    1.0
}

/// The planner options, as text (how they are written on the command line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerSettings {
    pub mode: String,
    pub interleave: String,
    pub buckets: String,
    pub token_budget: u64,
    pub max_len: u32,
    pub on_overlong: String,
    pub accum: u32,
    pub seed: u64,
}

impl PlannerSettings {
    pub fn from_config(c: &PlanConfig) -> Self {
        Self {
            mode: c.mode.name().into(),
            interleave: c.interleave.name().into(),
            buckets: c.buckets.to_string(),
            token_budget: c.token_budget,
            max_len: c.max_len,
            on_overlong: c.on_overlong.name().into(),
            accum: c.accum,
            seed: c.seed,
        }
    }

    pub fn to_config(&self) -> Result<PlanConfig, String> {
        let e = |e: crate::planner::PlanError| e.to_string();
        let config = PlanConfig {
            mode: self.mode.parse().map_err(e)?,
            interleave: self.interleave.parse().map_err(e)?,
            buckets: self.buckets.parse().map_err(e)?,
            token_budget: self.token_budget,
            max_len: self.max_len,
            on_overlong: self.on_overlong.parse().map_err(e)?,
            accum: self.accum,
            seed: self.seed,
        };
        config.validate().map_err(e)?;
        Ok(config)
    }
}

/// Why a run could not start or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Bad options or input, found before anything started.
    #[error("{0}")]
    Invalid(String),
    /// The run started and failed.
    #[error("{0}")]
    Failed(String),
}

/// What a run did, for the closing line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub steps: u64,
    pub tokens: u64,
    pub seconds: f64,
    pub restarts: u64,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// `stop` request.
    Stopped,
    /// SIGINT or SIGTERM.
    Interrupted,
}

/// Messages to the main loop.
pub enum Input {
    Worker {
        worker: u32,
        incarnation: u64,
        event: WorkerInput,
    },
    Control(control::Pending),
}

pub enum WorkerInput {
    Connected(IpcSender<Job>),
    Event(Event),
    Gone,
}

/// Where batch tokens come from.
enum Tokens {
    Store(Box<Store>),
    /// Synthetic token ids below `vocab`, a pure function of (seed, sample, position).
    Synthetic {
        seed: u64,
        vocab: u32,
    },
}

const SYNTHETIC_VOCAB: u32 = 151_936;

impl Tokens {
    /// Appends the first `len` tokens of sample `index` and their loss masks.
    fn sample(&self, index: u32, len: u32, out: &mut Vec<u32>, masks: &mut Vec<u8>) {
        match self {
            Tokens::Store(store) => {
                out.extend_from_slice(&store.tokens(index as usize)[..len as usize]);
                masks.extend_from_slice(&store.loss_mask(index as usize)[..len as usize]);
            }
            Tokens::Synthetic { seed, vocab } => {
                out.extend((0..len).map(|p| {
                    let mut x = seed ^ (u64::from(index) << 32 | u64::from(p));
                    x = (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
                    x = (x ^ (x >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
                    ((x ^ (x >> 33)) % u64::from(*vocab)) as u32
                }));
                masks.extend(std::iter::repeat_n(1u8, len as usize));
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InSlot {
    Free,
    /// Holds a batch not yet handed to a target.
    Filled(usize),
    Leased(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FeatSlot {
    Free,
    Forwarding(usize),
    Ready(usize),
    Training(usize),
    Trained(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lease {
    Forward {
        batch: usize,
        input: u32,
        feature: u32,
    },
    Train {
        batch: usize,
        feature: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WorkerState {
    Starting,
    Ready,
    Busy,
    Restarting,
    Failed,
    Stopped,
}

impl WorkerState {
    fn name(self) -> &'static str {
        match self {
            WorkerState::Starting => "starting",
            WorkerState::Ready => "ready",
            WorkerState::Busy => "busy",
            WorkerState::Restarting => "restarting",
            WorkerState::Failed => "failed",
            WorkerState::Stopped => "stopped",
        }
    }
}

struct Worker {
    id: u32,
    role: Role,
    device: Device,
    cpus: Vec<usize>,
    incarnation: u64,
    process: Option<workers::Process>,
    jobs: Option<IpcSender<Job>>,
    state: WorkerState,
    lease: Option<Lease>,
    last_seen: Instant,
    started: Instant,
    batches_done: u64,
    restarts: u64,
    /// Times of unrequested exits, for the restart budget.
    crashes: VecDeque<Instant>,
    last_exit: Option<String>,
    restart_at: Option<Instant>,
    /// Stop after the current job, then start again (a `restart` without --force).
    restart_when_idle: bool,
    /// The next exit was asked for: restart at once, without counting it.
    exit_requested: bool,
    /// Since when the worker has been ready and idle.
    ready_since: Instant,
    /// Why the worker is being killed as hung (prefixed to its exit reason).
    hung: Option<String>,
}

/// Resume point read from the journal.
struct Start {
    epoch: u32,
    batch: usize,
    step_base: u64,
    /// Batches of each epoch journaled so far.
    epoch_sizes: Vec<u64>,
}

struct Run {
    config: RunConfig,
    run_dir: PathBuf,
    run_id: String,
    journal: JournalWriter,
    planner: Planner,
    tokens: Tokens,
    epoch: u32,
    plan: EpochPlan,
    step_base: u64,
    next_feed: usize,
    queue: VecDeque<usize>,
    batch_input: Vec<u32>,
    checksums: Vec<u32>,
    to_train: BTreeSet<usize>,
    /// The next batch a drafter gets (plan order).
    next_train: usize,
    /// Batches of every epoch journaled so far.
    epoch_sizes: Vec<u64>,
    /// A drafter resumed at this plan position: the pipeline is drained, then repositioned.
    rewind_to: Option<u64>,
    /// The live drafter has reported where its weights stand.
    drafter_resumed: bool,
    /// Why the run cannot count as completed (the drafter died while stopping).
    final_checkpoint_lost: Option<String>,
    metrics: metrics::Metrics,
    /// Plan position where this session started (for its rate).
    session_start: u64,
    last_progress: Instant,
    next_commit: usize,
    committed_total: u64,
    tokens_committed: u64,
    input: Ring,
    input_slots: Vec<InSlot>,
    input_generation: Vec<u64>,
    features: Ring,
    feature_slots: Vec<FeatSlot>,
    feature_generation: Vec<u64>,
    workers: Vec<Worker>,
    launch: workers::Launch,
    to_loop: mpsc::Sender<Input>,
    started: Instant,
    stopping: Option<Outcome>,
    scratch: Vec<u32>,
    monitor: crate::observe::monitor::Monitor,
    /// Per batch of the epoch: the drafter's wait before it, when its job was sent, its compute.
    timing: Vec<(f64, Option<Instant>, f64)>,
    /// Commits of the last 10 s: (time, real tokens, padded tokens).
    window: VecDeque<(Instant, u64, u64)>,
    /// Real and padded tokens committed this session.
    session_tokens: (u64, u64),
    /// Batches dispatched per bucket this epoch.
    bucket_batches: Vec<u64>,
}

/// The run directory's lock, held while the orchestrator lives.
pub struct RunLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// Takes the run directory's lock: one live orchestrator per run directory.
pub fn lock_run_dir(dir: &Path) -> Result<RunLock, RunError> {
    use std::io::{Read, Seek, Write};
    let path = run_dir::lock(dir);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| RunError::Invalid(format!("{}: {e}", path.display())))?;
    let mut holder = String::new();
    let _ = file.read_to_string(&mut holder);
    let mut lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|_| {
            RunError::Invalid(format!(
                "run dir {} holds a live run (orchestrator pid {}); stop it first or use another --run-dir",
                dir.display(),
                holder.trim()
            ))
        })?;
    let _ = lock.set_len(0);
    let _ = lock.rewind();
    let _ = write!(lock, "{}", std::process::id());
    Ok(RunLock { _lock: lock })
}

/// Removes the run's segments from `/dev/shm`; returns the paths removed.
pub fn remove_segments(run_id: &str) -> Vec<PathBuf> {
    let prefix = run_dir::segment_prefix(run_id);
    let mut removed = Vec::new();
    if let Ok(entries) = std::fs::read_dir(run_dir::SHM_DIR) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix)
                && std::fs::remove_file(entry.path()).is_ok()
            {
                removed.push(entry.path());
            }
        }
    }
    removed
}

/// Bytes free in `/dev/shm`.
fn shm_free() -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(run_dir::SHM_DIR).ok()?;
    Some(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// How many GPUs NVML reports, or why none.
pub fn gpu_count(nvml: &Result<&'static nvml_wrapper::Nvml, String>) -> Result<u32, String> {
    match nvml {
        Ok(n) => n.device_count().map_err(|e| format!("NVML: {e}")),
        Err(why) => Err(why.clone()),
    }
}

/// NVML, loaded once per process (the monitor keeps using it for the run's life).
pub fn init_nvml() -> Result<&'static nvml_wrapper::Nvml, String> {
    static NVML: std::sync::OnceLock<Result<nvml_wrapper::Nvml, String>> =
        std::sync::OnceLock::new();
    NVML.get_or_init(|| nvml_wrapper::Nvml::init().map_err(|e| format!("NVML not available: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

/// Starts (or resumes) the run in `run_dir` and drives it to its end.
pub fn launch(
    config: RunConfig,
    run_dir_path: &Path,
    resume: bool,
) -> Result<(Outcome, Summary), RunError> {
    std::fs::create_dir_all(run_dir_path)
        .map_err(|e| RunError::Invalid(format!("{}: {e}", run_dir_path.display())))?;
    let _lock = lock_run_dir(run_dir_path)?;
    let journal_path = run_dir::journal(run_dir_path);
    let (config, start) = if resume {
        let history = journal::read(&journal_path).map_err(|e| RunError::Invalid(e.to_string()))?;
        if history.torn_tail {
            // The last write was cut short by a crash: drop it, so the next entry starts a line.
            journal::drop_torn_tail(&journal_path)
                .map_err(|e| RunError::Invalid(format!("{}: {e}", journal_path.display())))?;
            tracing::warn!("dropped a journal line cut short by a crash");
        }
        if history.ended.as_deref() == Some("completed") {
            return Err(RunError::Invalid(format!(
                "the run in {} already completed",
                run_dir_path.display()
            )));
        }
        let stored: RunConfig =
            serde_json::from_value(history.config.clone().unwrap_or(Value::Null)).map_err(|e| {
                RunError::Invalid(format!("{}: run line: {e}", journal_path.display()))
            })?;
        let mut epoch = history.committed.len().saturating_sub(1) as u32;
        let mut batch = history.committed.last().copied().unwrap_or(0) as usize;
        if let Some(&batches) = history.epoch_batches.last()
            && batch as u64 == batches
        {
            epoch += 1;
            batch = 0;
        }
        let step_base = history
            .epoch_batches
            .iter()
            .take(epoch as usize)
            .sum::<u64>();
        (
            stored,
            Start {
                epoch,
                batch,
                step_base,
                epoch_sizes: history.epoch_batches.clone(),
            },
        )
    } else {
        // A journal without its first line is a launch that died before starting: start afresh.
        let empty = std::fs::metadata(&journal_path).is_ok_and(|m| m.len() == 0)
            || journal::read(&journal_path).is_ok_and(|h| h.config.is_none());
        if empty {
            let _ = std::fs::remove_file(&journal_path);
        }
        if journal_path.exists() {
            return Err(RunError::Invalid(format!(
                "{} already holds a run (its journal exists): pass --resume to continue it, or use another --run-dir",
                run_dir_path.display()
            )));
        }
        (
            config,
            Start {
                epoch: 0,
                batch: 0,
                step_base: 0,
                epoch_sizes: Vec::new(),
            },
        )
    };

    // Everything below is checked before any process starts.
    let plan_config = config.planner.to_config().map_err(RunError::Invalid)?;
    let spec: spec::GpuSpec = config.gpus.parse().map_err(RunError::Invalid)?;
    let nvml = init_nvml();
    let devices = spec.devices(gpu_count(&nvml)).map_err(RunError::Invalid)?;
    let given = config
        .topology
        .as_deref()
        .map(str::parse::<Topology>)
        .transpose()
        .map_err(RunError::Invalid)?;
    let topology = Topology::resolve(given, devices.len() as u32).map_err(RunError::Invalid)?;
    if config.stage != "synthetic" && config.stage != "dflash" {
        return Err(RunError::Invalid(format!(
            "unknown --stage {:?} (this build has: dflash, synthetic)",
            config.stage
        )));
    }
    if (config.stage == "dflash") != config.dflash.is_some() {
        return Err(RunError::Invalid(
            "the DFlash settings go with --stage dflash (and it needs --target-model)".into(),
        ));
    }
    if config.epochs == 0 {
        return Err(RunError::Invalid("--epochs must be at least 1".into()));
    }
    let (lengths, mut tokens) = match (&config.data, config.synthetic) {
        (Some(dir), _) => {
            let store = Store::open(dir).map_err(|e| RunError::Invalid(e.to_string()))?;
            (store.lengths(), Tokens::Store(Box::new(store)))
        }
        (None, Some(n)) if n > 0 => (
            crate::workload::synthetic_lengths(n, config.synthetic_seed),
            Tokens::Synthetic {
                seed: config.synthetic_seed,
                vocab: SYNTHETIC_VOCAB,
            },
        ),
        _ => {
            return Err(RunError::Invalid(
                "pass --data STORE or --synthetic N".into(),
            ));
        }
    };
    let planner =
        Planner::new(lengths, plan_config).map_err(|e| RunError::Invalid(e.to_string()))?;
    let binary = workers::worker_binary();
    if !binary.is_file() {
        return Err(RunError::Invalid(format!(
            "worker binary {} not found (build it, or set DFLASH_WORKER_BIN)",
            binary.display()
        )));
    }
    if nix::unistd::access(&binary, nix::unistd::AccessFlags::X_OK).is_err() {
        return Err(RunError::Invalid(format!(
            "worker binary {} is not executable (chmod +x it, or set DFLASH_WORKER_BIN)",
            binary.display()
        )));
    }
    let mut config = config;
    let mut feature_width = 1;
    let mut dflash_file = None;
    if let Some(settings) = config.dflash.as_mut() {
        let target = dflash_stage::check(settings, &mut tokens, &devices, &binary)?;
        if settings.total_steps == 0 {
            settings.total_steps =
                dflash_stage::total_steps(&planner, config.epochs, config.planner.accum);
        }
        settings.token_budget = config.planner.token_budget;
        settings.checkpoint_dir = run_dir_path
            .canonicalize()
            .unwrap_or_else(|_| run_dir_path.to_path_buf())
            .join("checkpoints");
        feature_width = settings.feature_width(&target);
        dflash_file = Some(dflash_stage::write_settings(run_dir_path, settings)?);
    }

    let run_id = run_dir::run_id(run_dir_path);
    for stale in remove_segments(&run_id) {
        tracing::info!(path = %stale.display(), "removed a stale segment of an earlier run");
    }
    let targets = topology.targets;
    let input_slots = 2 * targets + 1;
    let feature_slots = 2 * targets + 2;
    let budget = config.planner.token_budget;
    let input_bytes = 64 + input_data_bytes(budget);
    let feature_bytes = if config.dflash.is_some() {
        64 + feature_data_bytes(budget, feature_width)
    } else {
        64 + 4 * budget
    };
    let needed =
        u64::from(input_slots) * input_bytes + u64::from(feature_slots) * feature_bytes + 128;
    if let Some(free) = shm_free()
        && free < needed
    {
        return Err(RunError::Invalid(format!(
            "{} has {} MB free, the rings need {} MB (in a container, raise --shm-size)",
            run_dir::SHM_DIR,
            free / 1_000_000,
            needed.div_ceil(1_000_000)
        )));
    }
    let shm_error = |e: dflash_common::ring::RingError| {
        RunError::Invalid(format!(
            "cannot create the rings ({} MB in {}): {e}",
            needed.div_ceil(1_000_000),
            run_dir::SHM_DIR
        ))
    };
    let input = Ring::create(
        &run_dir::segment(&run_id, "input"),
        input_slots,
        input_bytes,
    )
    .map_err(shm_error)?;
    let features = Ring::create(
        &run_dir::segment(&run_id, "feature"),
        feature_slots,
        feature_bytes,
    )
    .map_err(|e| {
        remove_segments(&run_id);
        shm_error(e)
    })?;

    let mut journal = JournalWriter::open(&journal_path)
        .map_err(|e| RunError::Invalid(format!("{}: {e}", journal_path.display())))?;
    let jerr = |e: std::io::Error| RunError::Failed(format!("journal: {e}"));
    if resume {
        journal
            .append(&Entry::Resume {
                committed: start.step_base + start.batch as u64,
            })
            .map_err(jerr)?;
    } else {
        let value = serde_json::to_value(&config).expect("config serializes");
        journal
            .append(&Entry::Run {
                version: journal::VERSION,
                config: value,
            })
            .map_err(jerr)?;
    }
    let log_dir = workers::log_dir(run_dir_path);
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| RunError::Invalid(format!("{}: {e}", log_dir.display())))?;

    let prom = config
        .metrics_addr
        .as_deref()
        .map(|a| {
            crate::observe::prom::parse_addr(a)
                .and_then(|addr| crate::observe::prom::Prom::serve(addr, config.dflash.is_some()))
        })
        .transpose()
        .map_err(RunError::Invalid)?;
    let gpu_ids: Vec<u32> = devices
        .iter()
        .filter_map(|d| match d {
            Device::Gpu(g) => Some(*g),
            Device::Cpu(_) => None,
        })
        .collect();
    let source: Result<Box<dyn crate::observe::gpu::GpuSource>, String> = match &nvml {
        Ok(n) if !gpu_ids.is_empty() => {
            Ok(Box::new(crate::observe::gpu::NvmlSource::new(n, &gpu_ids)))
        }
        Ok(_) => Err("CPU workers: no GPU telemetry".into()),
        Err(why) => Err(why.clone()),
    };
    if let Err(why) = &source {
        tracing::info!("no GPU telemetry ({why}): the monitor reports the workers' CPU and memory");
    }
    let monitor = crate::observe::monitor::Monitor::new(
        source,
        Duration::from_secs_f64(config.monitor_interval_s.max(0.01)),
    );
    let (to_loop, inbox) = mpsc::channel();
    let listener = control::bind(run_dir_path)
        .map_err(|e| RunError::Invalid(format!("control socket: {e}")))?;
    control::serve(listener, to_loop.clone());

    let available = workers::available_cpus();
    let count = devices.len();
    let gpu_cpus = |device: Device| -> Option<Vec<usize>> {
        let Device::Gpu(index) = device else {
            return None;
        };
        let nvml = nvml.as_ref().ok()?;
        let mask = nvml
            .device_by_index(index)
            .ok()?
            .cpu_affinity(available.iter().max().map_or(1, |m| m / 64 + 1))
            .ok()?;
        let local: Vec<usize> = available
            .iter()
            .copied()
            .filter(|&c| mask.get(c / 64).is_some_and(|w| w >> (c % 64) & 1 == 1))
            .collect();
        (!local.is_empty()).then_some(local)
    };
    // NUMA-local CPUs for GPU workers where NVML reports them, shared among the GPUs of a node;
    // otherwise an equal share of all available CPUs.
    let pools: Vec<Vec<usize>> = devices
        .iter()
        .map(|&d| gpu_cpus(d).unwrap_or_else(|| available.clone()))
        .collect();
    let pinned: Vec<Vec<usize>> = (0..count)
        .map(|i| {
            let peers: Vec<usize> = (0..count).filter(|&j| pools[j] == pools[i]).collect();
            let rank = peers.iter().position(|&j| j == i).unwrap_or(0);
            workers::cpus_for(rank, peers.len(), &pools[i])
        })
        .collect();
    let workers_list = devices
        .into_iter()
        .enumerate()
        .map(|(i, device)| Worker {
            id: i as u32,
            role: if (i as u32) < targets {
                Role::Target
            } else {
                Role::Drafter
            },
            device,
            cpus: pinned[i].clone(),
            incarnation: 0,
            process: None,
            jobs: None,
            state: WorkerState::Restarting,
            lease: None,
            last_seen: Instant::now(),
            started: Instant::now(),
            batches_done: 0,
            restarts: 0,
            crashes: VecDeque::new(),
            last_exit: None,
            restart_at: Some(Instant::now()),
            restart_when_idle: false,
            exit_requested: false,
            ready_since: Instant::now(),
            hung: None,
        })
        .collect();
    let launch = workers::Launch {
        binary,
        input_ring: input.path().to_path_buf(),
        feature_ring: features.path().to_path_buf(),
        stage: config.stage.clone(),
        synthetic_us_per_token: config.synthetic_us_per_token,
        heartbeat_ms: config.heartbeat_ms,
        log_dir,
        dflash_config: dflash_file,
    };
    let plan = planner.plan_epoch(u64::from(start.epoch));
    let planned = plan.batches.len();
    let mut run = Run {
        run_dir: run_dir_path.to_path_buf(),
        run_id,
        journal,
        tokens,
        epoch: start.epoch,
        step_base: start.step_base,
        next_feed: start.batch,
        queue: VecDeque::new(),
        batch_input: vec![u32::MAX; plan.batches.len()],
        checksums: vec![0; plan.batches.len()],
        to_train: BTreeSet::new(),
        next_train: start.batch,
        epoch_sizes: start.epoch_sizes,
        rewind_to: None,
        drafter_resumed: false,
        final_checkpoint_lost: None,
        metrics: metrics::Metrics::open(run_dir_path, prom)
            .map_err(|e| RunError::Invalid(format!("metrics: {e}")))?,
        session_start: start.step_base + start.batch as u64,
        last_progress: Instant::now(),
        next_commit: start.batch,
        committed_total: start.step_base + start.batch as u64,
        tokens_committed: 0,
        input_slots: vec![InSlot::Free; input_slots as usize],
        input_generation: vec![0; input_slots as usize],
        feature_slots: vec![FeatSlot::Free; feature_slots as usize],
        feature_generation: vec![0; feature_slots as usize],
        input,
        features,
        plan,
        planner,
        workers: workers_list,
        launch,
        to_loop,
        started: Instant::now(),
        stopping: None,
        scratch: Vec::new(),
        monitor,
        timing: vec![(0.0, None, 0.0); planned],
        window: VecDeque::new(),
        session_tokens: (0, 0),
        bucket_batches: Vec::new(),
        config,
    };
    let new_epoch = start.batch == 0 && start.epoch < run.config.epochs;
    let result = run.drive(&inbox, new_epoch);
    run.shutdown();
    let summary = Summary {
        steps: run.committed_total,
        tokens: run.tokens_committed,
        seconds: run.started.elapsed().as_secs_f64(),
        restarts: run.workers.iter().map(|w| w.restarts).sum(),
    };
    let result = result.map(|outcome| (outcome, summary));
    let _ = std::fs::remove_file(run_dir::control_socket(&run.run_dir));
    remove_segments(&run.run_id);
    result
}

const TICK: Duration = Duration::from_millis(20);
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long stopping workers may take (a drafter writes its final checkpoint) before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(60);

impl Run {
    fn drive(
        &mut self,
        inbox: &mpsc::Receiver<Input>,
        new_epoch: bool,
    ) -> Result<Outcome, RunError> {
        let signals = crate::cli::count_stop_signals();
        if new_epoch {
            self.journal_epoch()?;
        }
        let mut stop_deadline: Option<Instant> = None;
        loop {
            match inbox.recv_timeout(TICK) {
                Ok(input) => self.handle(input)?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(RunError::Failed("internal channel closed".into()));
                }
            }
            while let Ok(input) = inbox.try_recv() {
                self.handle(input)?;
            }
            let interrupts = signals.load(Ordering::SeqCst);
            if interrupts >= 1 && self.stopping.is_none() {
                tracing::warn!(
                    "interrupted: stopping the workers (a drafter writes its checkpoint); interrupt again to stop at once"
                );
                eprintln!(
                    "\ninterrupted: stopping the workers cleanly; interrupt again to stop at once"
                );
                self.stopping = Some(Outcome::Interrupted);
            }
            if interrupts >= 2 && stop_deadline.is_none_or(|d| d > Instant::now()) {
                // At once: the grace period is over.
                stop_deadline = Some(Instant::now());
            }
            self.supervise()?;
            if self.monitor.due() {
                self.monitor_tick();
            }
            if let Some(outcome) = self.stopping {
                let deadline = *stop_deadline.get_or_insert_with(|| Instant::now() + STOP_GRACE);
                self.wind_down(Instant::now() > deadline);
                if self.workers.iter().all(|w| w.process.is_none()) {
                    self.progress(true);
                    self.metrics.flush();
                    let mut outcome = outcome;
                    let reason = self.final_checkpoint_lost.take().inspect(|why| {
                        tracing::warn!("{why}");
                        if outcome == Outcome::Completed {
                            outcome = Outcome::Stopped;
                        }
                    });
                    let status = match outcome {
                        Outcome::Completed => "completed",
                        Outcome::Stopped => "stopped",
                        Outcome::Interrupted => "interrupted",
                    };
                    self.journal
                        .append(&Entry::End {
                            status: status.into(),
                            reason,
                        })
                        .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
                    return Ok(outcome);
                }
                continue;
            }
            self.reposition()?;
            if self.epoch >= self.config.epochs {
                // Every batch is committed (a resume after the last commit): done once the
                // drafter has said where its weights stand, or after replaying up to here.
                if self.rewind_to.is_none()
                    && (self.config.dflash.is_none() || self.drafter_resumed)
                {
                    self.stopping = Some(Outcome::Completed);
                }
                continue;
            }
            self.feed();
            self.dispatch();
            self.progress(false);
        }
    }

    fn journal_epoch(&mut self) -> Result<(), RunError> {
        let batches = self.plan.batches.len() as u64;
        let entry = Entry::Epoch {
            epoch: self.epoch,
            batches,
        };
        self.epoch_sizes.truncate(self.epoch as usize);
        self.epoch_sizes.push(batches);
        self.journal
            .append(&entry)
            .map_err(|e| RunError::Failed(format!("journal: {e}")))
    }

    fn handle(&mut self, input: Input) -> Result<(), RunError> {
        match input {
            Input::Control(pending) => {
                let answer = self.control(pending.request);
                let _ = pending.reply.send(answer);
                Ok(())
            }
            Input::Worker {
                worker,
                incarnation,
                event,
            } => {
                let Some(w) = self.workers.get_mut(worker as usize) else {
                    return Ok(());
                };
                if w.incarnation != incarnation || w.process.is_none() {
                    return Ok(()); // an earlier process of this worker
                }
                w.last_seen = Instant::now();
                match event {
                    WorkerInput::Connected(jobs) => {
                        w.jobs = Some(jobs);
                        if let Some(p) = w.process.as_mut() {
                            p.connected = true;
                        }
                        Ok(())
                    }
                    WorkerInput::Gone => {
                        // The process is reaped (and its leases reclaimed) by `supervise`.
                        w.jobs = None;
                        Ok(())
                    }
                    WorkerInput::Event(event) => self.worker_event(worker, event),
                }
            }
        }
    }

    fn worker_event(&mut self, id: u32, event: Event) -> Result<(), RunError> {
        let w = &mut self.workers[id as usize];
        match event {
            Event::Heartbeat => {}
            Event::Ready => {
                if w.state == WorkerState::Starting || w.state == WorkerState::Busy {
                    w.state = WorkerState::Ready;
                    w.ready_since = Instant::now();
                }
                if w.restart_when_idle || self.stopping.is_some() {
                    w.restart_when_idle = false;
                    w.exit_requested = true;
                    if let Some(jobs) = &w.jobs {
                        let _ = jobs.send(Job::Stop);
                    }
                    w.state = WorkerState::Stopped;
                }
            }
            Event::Resumed { cursor, step } => {
                if w.role != Role::Drafter {
                    return Err(RunError::Failed(format!(
                        "worker {id} ({}) reported a drafter resume",
                        w.role.name()
                    )));
                }
                tracing::info!(
                    worker = id,
                    cursor,
                    step,
                    "drafter starts at plan position {cursor} (optimiser step {step})"
                );
                self.metrics.reset_group();
                self.drafter_resumed = true;
                if cursor != self.committed_total || self.rewind_to.is_some() {
                    self.rewind_to = Some(cursor);
                }
            }
            Event::Forwarded { id: batch_id } => {
                let Some(Lease::Forward {
                    batch,
                    input,
                    feature,
                }) = w.lease.take()
                else {
                    return Err(RunError::Failed(format!(
                        "worker {id} reported a forward it was not given ({batch_id:?})"
                    )));
                };
                w.batches_done += 1;
                self.input_slots[input as usize] = InSlot::Free;
                self.feature_slots[feature as usize] = FeatSlot::Ready(batch);
                self.to_train.insert(batch);
            }
            Event::Trained {
                id: batch_id,
                checksum,
                metrics,
            } => {
                let Some(Lease::Train { batch, feature }) = w.lease.take() else {
                    return Err(RunError::Failed(format!(
                        "worker {id} reported training it was not given ({batch_id:?})"
                    )));
                };
                w.batches_done += 1;
                if checksum != self.checksums[batch] {
                    return Err(RunError::Failed(format!(
                        "corrupt batch {batch} of epoch {}: drafter saw checksum {checksum:08x}, the orchestrator wrote {:08x}",
                        self.epoch, self.checksums[batch]
                    )));
                }
                self.feature_slots[feature as usize] = FeatSlot::Trained(batch);
                if let Some(t) = self.timing.get_mut(batch) {
                    t.2 = t.1.map_or(0.0, |at| at.elapsed().as_secs_f64());
                }
                if let Some(m) = metrics {
                    self.record(batch_id, batch, &m)?;
                }
                self.commit_ready()?;
            }
            Event::Failed { id: batch, reason } => {
                return Err(RunError::Failed(format!(
                    "worker {id} failed{}: {reason}",
                    batch
                        .map(|b| format!(" on batch {} of epoch {}", b.batch, b.epoch))
                        .unwrap_or_default()
                )));
            }
        }
        Ok(())
    }

    /// Commits trained batches in plan order.
    fn commit_ready(&mut self) -> Result<(), RunError> {
        // Also while stopping: what the drafter trained is in its final checkpoint.
        while self.epoch < self.config.epochs {
            let b = self.next_commit;
            let Some(slot) = self
                .feature_slots
                .iter()
                .position(|s| *s == FeatSlot::Trained(b))
            else {
                return Ok(());
            };
            self.feature_slots[slot] = FeatSlot::Free;
            self.commit(self.checksums[b])?;
        }
        Ok(())
    }

    /// Journals the commit of the next batch; moves to the next epoch at the end of one.
    fn commit(&mut self, checksum: u32) -> Result<(), RunError> {
        let b = self.next_commit;
        let batch = &self.plan.batches[b];
        self.journal
            .append(&Entry::Commit {
                epoch: self.epoch,
                step: self.step_base + b as u64,
                batch: b as u64,
                samples: batch.count,
                checksum,
            })
            .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
        self.tokens_committed += batch.real_tokens;
        let record = self.batch_record(b);
        self.metrics
            .batch(&record)
            .map_err(|e| RunError::Failed(format!("{}: {e}", metrics::FILE)))?;
        self.next_commit += 1;
        self.committed_total += 1;
        if self.next_commit == self.plan.batches.len() {
            if self.epoch + 1 == self.config.epochs {
                self.epoch += 1;
                self.stopping.get_or_insert(Outcome::Completed);
                return Ok(());
            }
            let base = self.step_base + self.plan.batches.len() as u64;
            self.enter(self.epoch + 1, base, 0);
            self.journal_epoch()?;
        }
        Ok(())
    }

    /// Positions the run at `batch` of `epoch` (whose first step is `base`) with an empty
    /// pipeline: nothing fed, queued or leased.
    fn enter(&mut self, epoch: u32, base: u64, batch: usize) {
        if epoch != self.epoch || self.plan.batches.is_empty() {
            self.plan = self.planner.plan_epoch(u64::from(epoch));
        }
        self.epoch = epoch;
        self.step_base = base;
        let n = self.plan.batches.len();
        self.batch_input = vec![u32::MAX; n];
        self.checksums = vec![0; n];
        self.timing = vec![(0.0, None, 0.0); n];
        if batch == 0 {
            self.bucket_batches.clear();
        }
        self.next_feed = batch;
        self.next_train = batch;
        self.next_commit = batch;
        self.committed_total = base + batch as u64;
        self.queue.clear();
        self.to_train.clear();
        self.input_slots.fill(InSlot::Free);
        self.feature_slots.fill(FeatSlot::Free);
    }

    /// Moves the run to plan position `cursor`, where the drafter resumed, once no worker holds a
    /// lease. Backwards (the drafter restarted from a checkpoint): the later commits are void and
    /// the batches are replayed. Forwards (the orchestrator died after the drafter checkpointed
    /// batches it had not journaled yet): those batches are committed from the plan.
    fn reposition(&mut self) -> Result<(), RunError> {
        let Some(cursor) = self.rewind_to else {
            return Ok(());
        };
        if self.workers.iter().any(|w| w.lease.is_some()) {
            return Ok(());
        }
        self.rewind_to = None;
        if cursor >= self.committed_total {
            self.enter(self.epoch, self.step_base, self.next_commit);
            while self.committed_total < cursor && self.epoch < self.config.epochs {
                let checksum = self.batch_checksum(self.next_commit);
                self.commit(checksum)?;
            }
            if self.epoch < self.config.epochs {
                self.enter(self.epoch, self.step_base, self.next_commit);
            }
            tracing::info!(
                "moved forward to plan position {cursor}, committed from the checkpoint"
            );
            return Ok(());
        }
        let mut base = 0;
        let mut epoch = 0;
        for &size in &self.epoch_sizes {
            if cursor < base + size {
                break;
            }
            base += size;
            epoch += 1;
        }
        let batch = (cursor - base) as usize;
        let voided = self.committed_total - cursor;
        self.journal
            .append(&Entry::Rewind {
                to_step: cursor,
                epoch,
                batch: batch as u64,
                reason: format!("the drafter resumed from its checkpoint at step {cursor}"),
            })
            .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
        let message = format!(
            "drafter resumed at plan position {cursor}: replaying {voided} batches from epoch {epoch} batch {batch}"
        );
        tracing::warn!("{message}");
        let _ = self.metrics.event("rewind", None, &message);
        self.epoch_sizes.truncate(epoch as usize + 1);
        self.enter(epoch, base, batch);
        Ok(())
    }

    /// The `batch` metrics of batch `b`, committed now.
    fn batch_record(&mut self, b: usize) -> metrics::BatchRecord {
        let batch = self.plan.batches[b];
        // Padded: rows × longest row; packed: the batch's capacity (as the planner counts them).
        let padded_tokens = match self.plan.layout {
            PlanLayout::Padded => u64::from(batch.count) * u64::from(batch.max_len),
            PlanLayout::Packed => self.config.planner.token_budget,
        };
        let now = Instant::now();
        self.window
            .push_back((now, batch.real_tokens, padded_tokens));
        while self
            .window
            .front()
            .is_some_and(|(t, ..)| now.duration_since(*t) > Duration::from_secs(10))
        {
            self.window.pop_front();
        }
        let span = self
            .window
            .front()
            .map_or(0.0, |(t, ..)| now.duration_since(*t).as_secs_f64())
            .max(self.started.elapsed().as_secs_f64().min(10.0))
            .max(1e-3);
        let (real, padded) = self
            .window
            .iter()
            .fold((0, 0), |(r, p), (_, a, b)| (r + a, p + b));
        self.session_tokens.0 += batch.real_tokens;
        self.session_tokens.1 += padded_tokens;
        let occupancy = |busy: usize, all: usize| busy as f64 / all.max(1) as f64;
        let (wait_s, _, compute_s) = self.timing.get(b).copied().unwrap_or((0.0, None, 0.0));
        metrics::BatchRecord {
            epoch: self.epoch,
            batch: b as u64,
            step: self.step_base + b as u64,
            bucket: batch.bucket,
            samples: batch.count,
            real_tokens: batch.real_tokens,
            padded_tokens,
            mean_len: batch.real_tokens as f64 / f64::from(batch.count.max(1)),
            max_len: batch.max_len,
            wait_s,
            compute_s,
            tokens_per_s: real as f64 / span,
            padded_tokens_per_s: padded as f64 / span,
            padding_efficiency: self.session_tokens.0 as f64 / self.session_tokens.1.max(1) as f64,
            input_ring_occupancy: occupancy(
                self.input_slots
                    .iter()
                    .filter(|s| **s != InSlot::Free)
                    .count(),
                self.input_slots.len(),
            ),
            feature_ring_occupancy: occupancy(
                self.feature_slots
                    .iter()
                    .filter(|s| **s != FeatSlot::Free)
                    .count(),
                self.feature_slots.len(),
            ),
            restarts: self.workers.iter().map(|w| w.restarts).sum(),
            bucket_batches: self.bucket_batches.clone(),
        }
    }

    /// Reads the GPUs and the worker processes; writes the readings and any warning.
    fn monitor_tick(&mut self) {
        use crate::observe::gpu::GpuOwner;
        let gpus: Vec<(u32, GpuOwner)> = self
            .workers
            .iter()
            .filter_map(|w| match w.device {
                Device::Gpu(g) => Some((
                    g,
                    GpuOwner {
                        worker: w.id,
                        role: w.role.name(),
                    },
                )),
                Device::Cpu(_) => None,
            })
            .collect();
        let processes: Vec<(u32, &'static str, u32)> = self
            .workers
            .iter()
            .filter_map(|w| Some((w.id, w.role.name(), w.process.as_ref()?.pid)))
            .collect();
        let tick = self.monitor.tick(&gpus, &processes);
        for warning in &tick.warnings {
            tracing::warn!("{warning}");
            let _ = self.metrics.event("warning", None, warning);
        }
        if let Err(e) = self.metrics.monitor(&tick.gpus, &tick.processes) {
            tracing::warn!("{}: {e}", metrics::FILE);
        }
        if let Some(p) = &self.metrics.prom {
            for w in &self.workers {
                let labels = crate::observe::prom::WorkerLabels {
                    worker: w.id.to_string(),
                    role: w.role.name().into(),
                };
                p.worker_up
                    .get_or_create(&labels)
                    .set(if w.process.is_some() { 1.0 } else { 0.0 });
                p.worker_batches
                    .get_or_create(&labels)
                    .set(w.batches_done as f64);
                p.worker_restarts
                    .get_or_create(&labels)
                    .set(w.restarts as f64);
            }
        }
    }

    /// Records a drafter's report of a micro-batch.
    fn record(&mut self, id: BatchId, batch: usize, m: &TrainMetrics) -> Result<(), RunError> {
        let tokens = self.plan.batches[batch].real_tokens;
        self.metrics
            .add(id.epoch, id.step, tokens, m)
            .map_err(|e| RunError::Failed(format!("{}: {e}", metrics::FILE)))?;
        Ok(())
    }

    /// Batches of the whole run (epochs not planned yet are estimated from the current one).
    fn total_batches(&self) -> u64 {
        let done: u64 = self.epoch_sizes.iter().take(self.epoch as usize).sum();
        let left = u64::from(self.config.epochs.saturating_sub(self.epoch));
        done + left * self.plan.batches.len() as u64
    }

    /// The progress line: where the run is, how training goes, how fast, how long to go.
    pub fn progress_line(&self) -> String {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        let total = self.total_batches();
        let done_session = self.committed_total.saturating_sub(self.session_start);
        let rate = done_session as f64 / elapsed;
        let left = total.saturating_sub(self.committed_total);
        let eta = if rate > 0.0 {
            let s = (left as f64 / rate) as u64;
            format!("{}m{:02}s", s / 60, s % 60)
        } else {
            "-".into()
        };
        let mut line = format!(
            "epoch {}/{} · batch {}/{} · {:.1} Ktok/s",
            (self.epoch + 1).min(self.config.epochs),
            self.config.epochs,
            self.committed_total,
            total,
            self.tokens_committed as f64 / elapsed / 1000.0
        );
        if let Some(m) = &self.metrics.last {
            line.push_str(&format!(
                " · step {} · loss {:.3} · acc {:.3} · accept {:.2} · lr {:.2e}",
                m["step"],
                m["loss"].as_f64().unwrap_or(f64::NAN),
                m["accuracy"].as_f64().unwrap_or(f64::NAN),
                m["acceptance_length"].as_f64().unwrap_or(f64::NAN),
                m["lr"].as_f64().unwrap_or(f64::NAN),
            ));
        }
        line.push_str(&format!(" · ETA {eta}"));
        line
    }

    /// Shows progress on stderr: redrawn in place on a terminal, a line every 10 s otherwise.
    fn progress(&mut self, last: bool) {
        use std::io::IsTerminal;
        let tty = std::io::stderr().is_terminal();
        let every = if tty {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(10)
        };
        if !last && self.last_progress.elapsed() < every {
            return;
        }
        self.last_progress = Instant::now();
        let line = self.progress_line();
        if tty {
            eprint!("\r\x1b[2K{line}{}", if last { "\n" } else { "" });
        } else {
            eprintln!("{line}");
        }
    }

    /// Fills free input slots with the next batches of the plan.
    fn feed(&mut self) {
        while self.next_feed < self.plan.batches.len() {
            let Some(slot) = self.input_slots.iter().position(|s| *s == InSlot::Free) else {
                return;
            };
            let b = self.next_feed;
            self.write_batch(b, slot as u32);
            self.input_slots[slot] = InSlot::Filled(b);
            self.batch_input[b] = slot as u32;
            self.queue.push_back(b);
            self.next_feed += 1;
        }
    }

    /// The tokens, loss masks and sample lengths of batch `b` of the current epoch.
    fn gather(&self, b: usize, tokens: &mut Vec<u32>, masks: &mut Vec<u8>) -> Vec<u32> {
        let batch = self.plan.batches[b];
        tokens.clear();
        masks.clear();
        let mut lengths = Vec::with_capacity(batch.count as usize);
        for &s in self.plan.batch_samples(&batch) {
            let len = self.planner.lengths()[s as usize];
            self.tokens.sample(s, len, tokens, masks);
            lengths.push(len);
        }
        lengths
    }

    fn batch_checksum(&mut self, b: usize) -> u32 {
        let mut tokens = std::mem::take(&mut self.scratch);
        let lengths = self.gather(b, &mut tokens, &mut Vec::new());
        drop(lengths);
        let sum = dflash_common::ring::token_checksum(&tokens);
        self.scratch = tokens;
        sum
    }

    fn write_batch(&mut self, b: usize, slot: u32) {
        let batch = self.plan.batches[b];
        let mut tokens = std::mem::take(&mut self.scratch);
        let mut masks = Vec::with_capacity(tokens.capacity());
        let lengths = self.gather(b, &mut tokens, &mut masks);
        let layout = match self.plan.layout {
            PlanLayout::Packed => Layout::Packed,
            PlanLayout::Padded => Layout::Padded,
        };
        let meta = dflash_common::ring::write_batch(
            self.input.data_mut(slot),
            layout,
            &lengths,
            &tokens,
            &masks,
            batch.max_len,
            self.config.planner.token_budget,
        );
        self.input_generation[slot as usize] += 1;
        self.input
            .publish(slot, self.input_generation[slot as usize], meta);
        self.checksums[b] = meta.checksum;
        self.scratch = tokens;
    }

    fn batch_id(&self, batch: usize) -> BatchId {
        BatchId {
            epoch: self.epoch,
            batch: batch as u32,
            step: self.step_base + batch as u64,
        }
    }

    /// Hands work to idle workers: targets get queued batches in plan order, drafters get
    /// features in plan order.
    fn dispatch(&mut self) {
        if self.rewind_to.is_some() {
            return;
        }
        for i in 0..self.workers.len() {
            let w = &self.workers[i];
            if w.state != WorkerState::Ready || w.jobs.is_none() || w.restart_when_idle {
                continue;
            }
            let job = match w.role {
                Role::Target => {
                    let Some(&batch) = self.queue.front() else {
                        continue;
                    };
                    let Some(feature) =
                        self.feature_slots.iter().position(|s| *s == FeatSlot::Free)
                    else {
                        continue;
                    };
                    self.queue.pop_front();
                    let bucket = usize::from(self.plan.batches[batch].bucket);
                    if self.bucket_batches.len() <= bucket {
                        self.bucket_batches.resize(bucket + 1, 0);
                    }
                    self.bucket_batches[bucket] += 1;
                    let input = self.batch_input[batch];
                    self.input_slots[input as usize] = InSlot::Leased(batch);
                    self.feature_slots[feature] = FeatSlot::Forwarding(batch);
                    self.feature_generation[feature] += 1;
                    let generation = self.feature_generation[feature];
                    self.features
                        .publish(feature as u32, generation, SlotMeta::default());
                    self.workers[i].lease = Some(Lease::Forward {
                        batch,
                        input,
                        feature: feature as u32,
                    });
                    Job::Forward {
                        id: self.batch_id(batch),
                        input: SlotRef {
                            slot: input,
                            generation: self.input_generation[input as usize],
                        },
                        feature: SlotRef {
                            slot: feature as u32,
                            generation,
                        },
                    }
                }
                Role::Drafter => {
                    let Some(&batch) = self.to_train.first() else {
                        continue;
                    };
                    if batch != self.next_train {
                        continue; // strictly in plan order
                    }
                    self.next_train += 1;
                    let feature = self
                        .feature_slots
                        .iter()
                        .position(|s| *s == FeatSlot::Ready(batch))
                        .expect("a batch to train has its features ready");
                    self.to_train.remove(&batch);
                    if let Some(t) = self.timing.get_mut(batch) {
                        *t = (
                            self.workers[i].ready_since.elapsed().as_secs_f64(),
                            Some(Instant::now()),
                            0.0,
                        );
                    }
                    self.feature_slots[feature] = FeatSlot::Training(batch);
                    self.workers[i].lease = Some(Lease::Train {
                        batch,
                        feature: feature as u32,
                    });
                    Job::Train {
                        id: self.batch_id(batch),
                        feature: SlotRef {
                            slot: feature as u32,
                            generation: self.feature_generation[feature],
                        },
                        checksum: self.checksums[batch],
                        group: Group::of(
                            batch as u64,
                            self.plan.batches.len() as u64,
                            self.config.planner.accum,
                        ),
                    }
                }
            };
            let w = &mut self.workers[i];
            w.state = WorkerState::Busy;
            if let Some(jobs) = &w.jobs
                && jobs.send(job).is_err()
            {
                // Lost: `supervise` reaps it and reclaims the lease.
                w.jobs = None;
            }
        }
    }

    /// Puts a worker's leased work back for others.
    fn reclaim(&mut self, i: usize) {
        match self.workers[i].lease.take() {
            Some(Lease::Forward {
                batch,
                input,
                feature,
            }) => {
                self.input_slots[input as usize] = InSlot::Filled(batch);
                self.feature_slots[feature as usize] = FeatSlot::Free;
                // Back to the front: plan order is kept.
                let at = self.queue.partition_point(|&q| q < batch);
                self.queue.insert(at, batch);
            }
            Some(Lease::Train { batch, feature }) => {
                self.feature_slots[feature as usize] = FeatSlot::Ready(batch);
                self.to_train.insert(batch);
                self.next_train = self.next_train.min(batch);
            }
            None => {}
        }
    }

    /// Reaps exited workers, kills hung ones, restarts with backoff, enforces the budget.
    fn supervise(&mut self) -> Result<(), RunError> {
        let now = Instant::now();
        let timeout = Duration::from_secs_f64(self.config.heartbeat_timeout_s);
        for i in 0..self.workers.len() {
            // Hung: no word within the deadline.
            let w = &mut self.workers[i];
            if let Some(p) = &w.process {
                let limit = if p.connected {
                    timeout
                } else {
                    STARTUP_TIMEOUT.max(timeout)
                };
                if now.duration_since(w.last_seen) > limit {
                    tracing::warn!(
                        worker = w.id,
                        "no heartbeat for {:.1} s: killing it",
                        limit.as_secs_f64()
                    );
                    w.hung = Some(format!(
                        "missed heartbeats for {:.1} s (hung)",
                        limit.as_secs_f64()
                    ));
                    p.kill();
                    w.last_seen = now;
                }
            }
            // Exited.
            let exited = match w.process.as_mut().map(|p| p.child.try_wait()) {
                Some(Ok(Some(status))) => Some(status),
                _ => None,
            };
            if let Some(status) = exited {
                let process = self.workers[i].process.take().expect("checked above");
                process.abandon();
                let reason = workers::exit_reason(status);
                let w = &mut self.workers[i];
                let reason = match w.hung.take() {
                    Some(hung) => format!("{hung}; {reason}"),
                    None => reason,
                };
                w.jobs = None;
                w.last_exit = Some(reason.clone());
                let _ = self.journal.append(&Entry::WorkerExit {
                    worker: w.id,
                    pid: process.pid,
                    reason: reason.clone(),
                });
                self.reclaim(i);
                let w = &self.workers[i];
                let _ = self
                    .metrics
                    .event("worker_exit", Some((w.id, w.role.name())), &reason);
                let w = &mut self.workers[i];
                if w.role == Role::Drafter {
                    self.drafter_resumed = false;
                    if self.stopping.is_some() && self.config.dflash.is_some() && !status.success()
                    {
                        self.final_checkpoint_lost = Some(format!(
                            "the drafter ({reason}) may not have written its final checkpoint: `launch --resume` replays from its latest checkpoint and finishes"
                        ));
                    }
                }
                if self.stopping.is_some() {
                    w.state = WorkerState::Stopped;
                    continue;
                }
                if std::mem::take(&mut w.exit_requested) {
                    w.restart_at = Some(now);
                } else {
                    w.crashes.push_back(now);
                    let window = Duration::from_secs_f64(self.config.restart_window_s);
                    while w
                        .crashes
                        .front()
                        .is_some_and(|&t| now.duration_since(t) > window)
                    {
                        w.crashes.pop_front();
                    }
                    if w.crashes.len() as u32 > self.config.max_restarts {
                        w.state = WorkerState::Failed;
                        return Err(RunError::Failed(format!(
                            "worker {} ({}, {}) exceeded --max-restarts {} within {:.0} s; last exit: {reason}",
                            w.id,
                            w.role.name(),
                            w.device,
                            self.config.max_restarts,
                            self.config.restart_window_s
                        )));
                    }
                    let backoff = Duration::from_millis(100u64 << (w.crashes.len() - 1).min(6));
                    tracing::warn!(worker = w.id, %reason, "worker exited; restarting in {} ms", backoff.as_millis());
                    w.restart_at = Some(now + backoff);
                }
                w.state = WorkerState::Restarting;
            }
            // Due to (re)start.
            let w = &mut self.workers[i];
            if self.stopping.is_none()
                && w.process.is_none()
                && w.restart_at.is_some_and(|t| now >= t)
            {
                w.restart_at = None;
                w.incarnation += 1;
                if w.incarnation > 1 {
                    w.restarts += 1;
                }
                let process = workers::spawn(
                    w.id,
                    w.incarnation,
                    w.role,
                    w.device,
                    &w.cpus,
                    &self.launch,
                    &self.to_loop,
                )
                .map_err(|e| RunError::Failed(format!("cannot start worker {}: {e}", w.id)))?;
                let _ = self.journal.append(&Entry::WorkerStart {
                    worker: w.id,
                    role: w.role.name().into(),
                    pid: process.pid,
                });
                let _ = self.metrics.event(
                    "worker_start",
                    Some((w.id, w.role.name())),
                    &format!("pid {} on {}", process.pid, w.device),
                );
                w.process = Some(process);
                w.state = WorkerState::Starting;
                w.last_seen = now;
                w.started = now;
            }
        }
        Ok(())
    }

    /// While stopping: idle workers are told to stop; past the grace period, everyone is killed.
    fn wind_down(&mut self, force: bool) {
        for w in &mut self.workers {
            let Some(p) = &w.process else { continue };
            if force {
                p.kill();
            } else if w.state == WorkerState::Ready
                || w.state == WorkerState::Starting && w.jobs.is_some()
            {
                w.exit_requested = true;
                if let Some(jobs) = &w.jobs {
                    let _ = jobs.send(Job::Stop);
                }
                w.state = WorkerState::Stopped;
            } else if w.jobs.is_none() && p.connected {
                p.kill();
            }
        }
    }

    /// Kills whatever is left (on any way out of `drive`).
    fn shutdown(&mut self) {
        for w in &mut self.workers {
            if let Some(mut p) = w.process.take() {
                p.kill();
                let _ = p.child.wait();
                p.abandon();
            }
        }
    }

    fn control(&mut self, request: control::Request) -> Value {
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

    fn status(&self) -> Value {
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
                });
                let gpu = self.gpu_telemetry(w.device);
                if let (Value::Object(m), Value::Object(g)) = (&mut v, gpu) {
                    m.extend(g);
                }
                v
            })
            .collect();
        json!({
            "run": {
                "run_dir": self.run_dir.display().to_string(),
                "run_id": self.run_id,
                "pid": std::process::id(),
                "state": match self.stopping { None => "running", Some(_) => "stopping" },
                "epoch": self.epoch,
                "epochs": self.config.epochs,
                "batch": self.next_commit,
                "batches": self.plan.batches.len(),
                "committed_steps": self.committed_total,
                "uptime_s": uptime,
                "tokens_per_s": self.tokens_committed as f64 / uptime.max(1e-9),
                "stage": self.config.stage,
                "progress": self.progress_line(),
                "metrics_addr": self.metrics.prom.as_ref().map(|p| p.addr.to_string()),
                "gpu_unavailable": self.monitor.unavailable,
                "training": self.metrics.last,
            },
            "workers": workers,
        })
    }

    fn gpu_telemetry(&self, device: Device) -> Value {
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
