//! Starting a run: every check is made before the first side effect, and a guard undoes what a
//! launch created (files and directories in the run directory, shared-memory segments) when a
//! later step fails, so a failed launch leaves nothing behind and a plain relaunch works.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dflash_common::dflash::DflashSettings;
use dflash_common::ring::Ring;
use dflash_common::run_dir;
use dflash_common::wire::Role;

use super::dry_run::{RingPlan, gpu_total, memory_plan};
use super::journal::{self, Entry, JournalWriter};
use super::resume::{self, Start};
use super::run_lock::{
    Guard, check_run_dir_trust, earlier_run, lock_run_dir, remove_recorded_segments, shm_free,
    stillborn_journal,
};
use super::spec::{self, Device, Topology};
use super::{
    Dispatch, Outcome, RunConfig, RunError, SYNTHETIC_VOCAB, Summary, Tokens, Worker, WorkerState,
    control, dflash_stage, gpu_count, init_nvml, nodes, workers,
};
use crate::planner::Planner;
use crate::store::Store;

/// The options of a run, checked without touching anything: planner, workers, stage, topology.
pub struct CheckedOptions {
    pub plan: crate::planner::PlanConfig,
    pub devices: Vec<Device>,
    pub topology: Topology,
    /// `--topology auto` (or the DFlash stage without `--topology`): `topology` is all but one
    /// until [`decide_topology`] balances it.
    pub auto: bool,
}

/// Checks a run's options alone (no files, no processes); `gpus` is how many GPUs the machine has
/// (or why none).
pub fn check_options(
    config: &RunConfig,
    gpus: Result<u32, String>,
) -> Result<CheckedOptions, RunError> {
    // Checks that need nothing of the run directory.
    let plan_config = config.planner.to_config().map_err(RunError::Invalid)?;
    let gpu_spec: spec::GpuSpec = config.gpus.parse().map_err(RunError::Invalid)?;
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
    let devices = gpu_spec.devices(gpus).map_err(RunError::Invalid)?;
    let (given, auto) = topology_option(config).map_err(RunError::Invalid)?;
    // Auto is decided once the plan is made (`decide_topology`); until then, all but one.
    let topology = Topology::resolve(given, devices.len() as u32).map_err(RunError::Invalid)?;
    check_drafters(config, topology).map_err(RunError::Invalid)?;
    Ok(CheckedOptions {
        plan: plan_config,
        devices,
        topology,
        auto,
    })
}

/// What the drafters of `topology` need: data-parallel drafters train on the torch engine, and
/// every drafter of every node needs a micro-batch of each accumulation group.
pub(super) fn check_drafters(config: &RunConfig, topology: Topology) -> Result<(), String> {
    if let Some(settings) = &config.dflash
        && topology.drafters > 1
    {
        let (t, d) = (topology.targets, topology.drafters);
        if settings.engines.drafter != dflash_common::dflash::Engine::Torch {
            return Err(format!(
                "--topology {t}:{d}: data-parallel drafters train on the torch engine (--engine torch); the candle drafter trains alone (use {}:1)",
                t + d - 1
            ));
        }
        if config.planner.accum < d {
            return Err(format!(
                "--topology {t}:{d} with --accum {}: each of the {d} drafters needs a micro-batch of every accumulation group; pass --accum {d} or more (--accum counts micro-batches per step in total)",
                config.planner.accum
            ));
        }
    }
    if let Some(n) = &config.nodes {
        n.check()?;
        let torch = config
            .dflash
            .as_ref()
            .is_some_and(|s| s.engines.drafter == dflash_common::dflash::Engine::Torch);
        if !torch {
            return Err(format!(
                "--nodes {}: the drafters of several nodes train together on the torch engine (--stage dflash --engine torch)",
                n.nodes
            ));
        }
        let world = n.nodes * topology.drafters;
        if config.planner.accum < world {
            return Err(format!(
                "--nodes {} with {} drafters each and --accum {}: each of the {world} drafters needs a micro-batch of every accumulation group; pass --accum {world} or more (--accum counts micro-batches per step in total, over every node)",
                n.nodes, topology.drafters, config.planner.accum
            ));
        }
    }
    Ok(())
}

/// `--topology` as given: (`T:D`, auto). Without it the DFlash stage balances its roles (auto)
/// and the synthetic stage has all but one as targets.
pub fn topology_option(config: &RunConfig) -> Result<(Option<Topology>, bool), String> {
    match config.topology.as_deref().map(str::trim) {
        Some("auto") => Ok((None, true)),
        Some(t) => t.parse().map(|t| (Some(t), false)),
        None => Ok((None, config.dflash.is_some())),
    }
}

/// The run's topology: as given, or balanced on what a micro-batch costs each role on the
/// run's own plan (see [`super::topology`]). `resumed`: the drafters the run trains, on a
/// resume.
pub fn decide_topology(
    config: &RunConfig,
    options: &CheckedOptions,
    planner: &Planner,
    target: Option<&dflash_common::dflash::Qwen3Config>,
    resumed: Option<u32>,
) -> Result<super::topology::Choice, RunError> {
    use super::topology::{Basis, choose, drafter_limit};
    let (given, _) = topology_option(config).map_err(RunError::Invalid)?;
    let given = given.map(|_| options.topology);
    let workers = options.devices.len() as u32;
    let basis = match (&config.dflash, target) {
        (Some(settings), Some(target)) => Basis::Dflash { target, settings },
        _ => Basis::Synthetic {
            target_us: config.synthetic_us_per_token,
            drafter_us: config.synthetic_drafter_us_per_token,
        },
    };
    let nodes = config.nodes.as_ref().map_or(1, |n| n.nodes);
    let limit = drafter_limit(
        workers,
        config.dflash.as_ref(),
        config.planner.accum,
        nodes,
        resumed,
    );
    choose(&options.devices, given, options.auto, basis, planner, limit).map_err(RunError::Invalid)
}

/// Joins the run's other nodes (see [`nodes`]): checks that they train the same run and agrees
/// where it resumes. Nothing is created here: a refusal leaves nothing behind.
fn join_nodes(
    n: &nodes::NodeConfig,
    config: &RunConfig,
    (drafters, resume): (u32, bool),
    code: BTreeMap<String, String>,
    listener: Option<std::net::TcpListener>,
) -> Result<nodes::Joined, RunError> {
    let Some(settings) = &config.dflash else {
        return Err(RunError::Invalid("--nodes needs --stage dflash".into()));
    };
    let mut run = settings.fingerprint.clone();
    // The code that computes, which the checkpoint's fingerprint leaves out: a node running
    // other code would train other weights.
    run.extend(code);
    // Held-out samples leave the plans.
    let holdout = config.eval.as_ref().map_or(0, |e| e.holdout);
    run.insert("eval_holdout".into(), holdout.to_string());
    let checkpoints = if resume {
        run_dir::checkpoint_steps(&settings.checkpoint_dir)
    } else {
        Vec::new()
    };
    let hello = nodes::Hello {
        version: nodes::VERSION,
        node: n.rank,
        nodes: n.nodes,
        drafters,
        run,
        checkpoints,
        resume,
    };
    let waits = if n.rank == 0 {
        format!(
            "waiting at {} for the other {} nodes",
            n.rendezvous,
            n.nodes - 1
        )
    } else {
        format!("joining node 0 at {}", n.rendezvous)
    };
    tracing::info!(
        "node {} of {}: {waits} (up to {} s, --rendezvous-timeout)",
        n.rank,
        n.nodes,
        n.timeout_s
    );
    let joined = nodes::join(n, hello, listener).map_err(RunError::Invalid)?;
    tracing::info!(
        "node {} of {}: every node joined; the drafters start from {}",
        n.rank,
        n.nodes,
        match joined.resume_step {
            0 => "fresh weights".to_owned(),
            s => format!("the checkpoint of step {s}"),
        }
    );
    Ok(joined)
}

/// Everything a launch checks and computes before its first side effect: the options, the
/// worker binary, the run directory (trust, an earlier run, the journal of a resume), the data,
/// the evaluations' prompts, the plans, the stage's checks, the rings' and GPUs' fit, the metrics
/// port. `launch --dry-run` runs exactly this, so that its "a launch would start" is a promise.
pub struct Prepared {
    config: RunConfig,
    nvml: Result<&'static nvml_wrapper::Nvml, String>,
    devices: Vec<Device>,
    topology: Topology,
    /// How the topology was decided (journaled with the session's first line).
    choice: super::topology::Choice,
    binary: std::path::PathBuf,
    existed: bool,
    start: Start,
    torn_tail: bool,
    tokens: Tokens,
    eval_prompts: Option<Vec<Vec<u32>>>,
    evaluator: Option<super::eval::Evaluator>,
    planner: Planner,
    rings: RingPlan,
    prom: Option<crate::observe::prom::Prom>,
    /// Several nodes: node 0's listener at the rendezvous, and the code's identity.
    rendezvous: Option<std::net::TcpListener>,
    code: BTreeMap<String, String>,
}

/// Checks the launch of `config` into `run_dir_path` without touching anything (see
/// [`Prepared`]).
pub fn prepare(config: RunConfig, run_dir_path: &Path, resume: bool) -> Result<Prepared, RunError> {
    let mut config = config;
    let nvml = init_nvml();
    let mut preflight = None;
    // The engine before the hardware: a torch that cannot serve the GPUs named is said as such,
    // even on a machine where no GPU is found.
    if let Some(settings) = config.dflash.as_mut() {
        let gpus: Vec<u32> = match config.gpus.parse::<spec::GpuSpec>() {
            Ok(spec::GpuSpec::Ids(ids)) => ids,
            Ok(spec::GpuSpec::All) => (0..gpu_count(&nvml).unwrap_or(1).max(1)).collect(),
            _ => Vec::new(),
        };
        let drafter = settings.engines.drafter;
        preflight = dflash_stage::check_engines(settings, &gpus)?;
        if settings.anchor_chunk_auto && settings.engines.drafter != drafter {
            // `--engine auto` chose the drafter's engine: the chunk is sized for it, from the
            // GPUs' own memory.
            let target = dflash_common::dflash::read_config_for(
                &settings.target_model,
                settings.engines.target,
            )
            .map_err(|e| RunError::Invalid(format!("--target-model {e}")))?;
            let memory = super::dry_run::smallest_gpu_memory(&config.gpus, None);
            settings.anchor_chunk = super::memory::auto_anchor_chunk(
                &target,
                settings,
                config.planner.max_len,
                config.planner.token_budget,
                super::memory::ChunkDevice::Gpu(memory),
            );
            tracing::info!(
                "--anchor-chunk auto: {} for the {} drafter",
                settings
                    .anchor_chunk
                    .map_or_else(|| "every anchor of a sequence".into(), |n| n.to_string()),
                settings.engines.drafter.name()
            );
        }
    }
    let options = check_options(&config, gpu_count(&nvml))?;
    let (plan_config, devices) = (options.plan.clone(), options.devices.clone());
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
    control::check_socket_dir(run_dir_path).map_err(RunError::Invalid)?;
    let existed = check_run_dir_trust(run_dir_path)?;
    if existed {
        super::run_lock::check_own_files(run_dir_path)?;
    }
    if !resume && existed {
        let found = earlier_run(run_dir_path);
        if !found.is_empty() {
            return Err(RunError::Invalid(format!(
                "{} holds an earlier run ({}): pass --resume to continue it, or use another --run-dir",
                run_dir_path.display(),
                found.join(", ")
            )));
        }
    }

    let (start, torn_tail, resumed_drafters) = if resume {
        let journaled = resume::read(run_dir_path)?;
        let fixed = journaled.config.weight_settings_differ(&config);
        if !fixed.is_empty() {
            return Err(RunError::Invalid(format!(
                "--resume: the run's {} differ from its journal",
                fixed.join(", ")
            )));
        }
        // The drafters the run trains: as its journal recorded them, or (a journal from before
        // topologies were recorded) as its options resolve.
        let before = journaled.drafters.unwrap_or_else(|| {
            check_options(&journaled.config, gpu_count(&nvml))
                .map_or(options.topology.drafters, |o| o.topology.drafters)
        });
        (
            journaled.start,
            journaled.torn_tail,
            config.dflash.is_some().then_some(before),
        )
    } else {
        (Start::default(), false, None)
    };

    let (mut lengths, mut tokens) = match (&config.data, config.synthetic) {
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
    let eval_prompts = match (&config.eval, &config.dflash) {
        (Some(eval), Some(settings)) => Some(eval_prompts(
            eval,
            settings,
            &tokens,
            &mut lengths,
            config.planner.seed,
        )?),
        _ => None,
    };
    let planner =
        Planner::new(lengths, plan_config).map_err(|e| RunError::Invalid(e.to_string()))?;
    let mut feature_bytes = None;
    let mut target_config = None;
    if let Some(settings) = config.dflash.as_mut() {
        let checked = dflash_stage::check(settings, &mut tokens, &devices, &binary)?;
        if settings.total_steps == 0 {
            settings.total_steps =
                dflash_stage::total_steps(&planner, config.epochs, config.planner.accum);
        }
        settings.token_budget = config.planner.token_budget;
        settings.checkpoint_dir = run_dir_path
            .canonicalize()
            .unwrap_or_else(|_| run_dir_path.to_path_buf())
            .join("checkpoints");
        feature_bytes = Some(settings.feature_bytes_per_token(&checked));
        target_config = Some(checked.clone());
        settings.fingerprint = dflash_stage::fingerprint(
            settings,
            &config.data,
            config.synthetic.map(|n| (n, config.synthetic_seed)),
            &config.planner,
            config.epochs,
        )
        .map_err(RunError::Invalid)?;
    }
    let choice = decide_topology(
        &config,
        &options,
        &planner,
        target_config.as_ref(),
        resumed_drafters,
    )?;
    let topology = choice.topology();
    if let Some(before) = resumed_drafters
        && before != topology.drafters
    {
        return Err(RunError::Invalid(format!(
            "--resume with {} drafters: the run trains {before} (--topology {}:{before} with these --gpus keeps them, as does --topology auto). The number of data-parallel drafters decides the order the gradients are summed in, so another number would end with weights an undisturbed run would not have (within float rounding, not the same bits); start a new run to change it",
            topology.drafters,
            (topology.targets + topology.drafters).saturating_sub(before),
        )));
    }
    check_drafters(&config, topology).map_err(RunError::Invalid)?;
    let rings = RingPlan::new(
        topology.targets,
        topology.drafters,
        config.planner.token_budget,
        feature_bytes,
    )?;
    if let Some(free) = shm_free()
        && free < rings.total
    {
        return Err(RunError::Invalid(format!(
            "{} has {} MB free, the rings need {} MB (lower --token-budget, or in a container raise --shm-size)",
            run_dir::SHM_DIR,
            free / 1_000_000,
            rings.total.div_ceil(1_000_000)
        )));
    }
    // GPU workers: the memory plan against each GPU's memory.
    if let (Some(settings), Some(target)) = (config.dflash.as_ref(), target_config.as_ref())
        && devices.iter().any(|d| matches!(d, Device::Gpu(_)))
    {
        let plan = memory_plan(&config, settings, target, &rings);
        let uses =
            super::memory::gpu_uses(&plan, &devices, topology.targets, |g| gpu_total(&nvml, g));
        if let Some(why) = super::memory::refusal(&uses) {
            return Err(RunError::Invalid(why));
        }
    }
    // The Prometheus port is bound now: a busy port fails the launch before anything is written.
    let prom = config
        .metrics_addr
        .as_deref()
        .map(|a| {
            crate::observe::prom::parse_addr(a)
                .and_then(|addr| crate::observe::prom::Prom::serve(addr, config.dflash.is_some()))
        })
        .transpose()
        .map_err(|e| RunError::Invalid(format!("--metrics-addr: {e}")))?;
    // Several nodes: node 0 binds the rendezvous now, as the Prometheus port (the dry run binds
    // and releases it); every node hashes the code that computes, for the link's check.
    let (rendezvous, code) = match &config.nodes {
        Some(n) => (
            (n.rank == 0)
                .then(|| nodes::bind(n))
                .transpose()
                .map_err(RunError::Invalid)?,
            code_identity(preflight.as_ref(), &binary).map_err(RunError::Invalid)?,
        ),
        None => (None, BTreeMap::new()),
    };

    // With several nodes, node 0 evaluates (every node holds the same weights).
    let evaluates = config.nodes.as_ref().is_none_or(|n| n.rank == 0);
    let evaluator = match (&config.eval, &config.dflash, &eval_prompts) {
        (Some(eval), Some(settings), Some(prompts)) if evaluates => {
            // On a GPU run, the evaluations share the first GPU.
            let gpu = devices.iter().find_map(|d| match d {
                Device::Gpu(g) => Some(*g),
                Device::Cpu(_) => None,
            });
            Some(
                super::eval::Evaluator::new(
                    eval.clone(),
                    prompts.clone(),
                    run_dir_path,
                    settings,
                    gpu,
                    config.job_timeout_s,
                )
                .map_err(RunError::Invalid)?,
            )
        }
        _ => None,
    };
    Ok(Prepared {
        config,
        nvml,
        devices,
        topology,
        choice,
        binary,
        existed,
        start,
        torn_tail,
        tokens,
        eval_prompts,
        evaluator,
        planner,
        rings,
        prom,
        rendezvous,
        code,
    })
}

/// The identity of the code that computes on this node, for the nodes' link: the Python files
/// of the engine's package where the pre-flight found it, the worker binary, and torch's and
/// transformers' versions.
fn code_identity(
    preflight: Option<&super::torch_engine::Preflight>,
    worker: &Path,
) -> Result<BTreeMap<String, String>, String> {
    use sha2::{Digest, Sha256};
    let short = |h: Sha256| -> String {
        h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let mut code = BTreeMap::new();
    let mut h = Sha256::new();
    let mut binary =
        std::fs::File::open(worker).map_err(|e| format!("{}: {e}", worker.display()))?;
    std::io::copy(&mut binary, &mut h).map_err(|e| format!("{}: {e}", worker.display()))?;
    code.insert("worker_binary".to_owned(), short(h));
    if let Some(report) = preflight {
        let init = Path::new(&report.package_path);
        let package = init.parent().filter(|_| init.is_file()).ok_or_else(|| {
            format!(
                "the torch engine's package dflash_orch: the pre-flight found it at {:?}, which is not a file",
                crate::format::clip(&report.package_path, 200)
            )
        })?;
        let mut h = Sha256::new();
        for (name, bytes) in package_files(package)? {
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(&bytes);
        }
        code.insert("engine_code".to_owned(), short(h));
        for (name, version) in [
            ("torch", &report.torch),
            ("transformers", &report.transformers),
        ] {
            code.insert(name.to_owned(), version.clone().unwrap_or_default());
        }
    }
    Ok(code)
}

/// The `.py` files under `package` (its subpackages too, not `__pycache__`), by their path
/// inside it, in order.
fn package_files(package: &Path) -> Result<Vec<(String, Vec<u8>)>, String> {
    const MOST: usize = 10_000;
    let mut files = Vec::new();
    let mut dirs = vec![package.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let at = |e: std::io::Error| format!("the torch engine's package {}: {e}", dir.display());
        for entry in std::fs::read_dir(&dir).map_err(at)? {
            let entry = entry.map_err(at)?;
            let path = entry.path();
            let kind = entry.file_type().map_err(at)?;
            if kind.is_dir() && entry.file_name() != "__pycache__" {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "py") && !kind.is_dir() {
                let name = path
                    .strip_prefix(package)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .into_owned();
                files.push((name, std::fs::read(&path).map_err(at)?));
            }
            if files.len() + dirs.len() > MOST {
                return Err(format!(
                    "the torch engine's package {} holds more than {MOST} files",
                    package.display()
                ));
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Starts (or resumes) the run in `run_dir` with `config` and drives it to its end. On resume,
/// `config` holds the journal's options with those that may change on resume applied, and
/// `changes` names them (journaled with the resume).
pub fn launch(
    config: RunConfig,
    run_dir_path: &Path,
    resume: bool,
    changes: serde_json::Map<String, serde_json::Value>,
) -> Result<(Outcome, Summary), RunError> {
    let Prepared {
        config,
        nvml,
        devices,
        topology,
        choice,
        binary,
        existed,
        start,
        torn_tail,
        tokens,
        eval_prompts,
        evaluator,
        planner,
        rings,
        prom,
        rendezvous,
        code,
    } = prepare(config, run_dir_path, resume)?;
    let joined = config
        .nodes
        .as_ref()
        .map(|n| join_nodes(n, &config, (topology.drafters, resume), code, rendezvous))
        .transpose()?;
    let journal_path = run_dir::journal(run_dir_path);
    // From here on, the guard undoes what is created.
    let mut guard = Guard::new(run_dir_path, existed)?;
    let _lock = lock_run_dir(run_dir_path)?;
    // Side effects, in an order that a failure at any step undoes.
    if !resume && stillborn_journal(&journal_path) {
        let _ = std::fs::remove_file(&journal_path);
    }
    if torn_tail {
        // The last write was cut short by a crash: drop it, so the next entry starts a line.
        journal::drop_torn_tail(&journal_path)
            .map_err(|e| RunError::Invalid(format!("{}: {e}", journal_path.display())))?;
        tracing::warn!("dropped a journal line cut short by a crash");
    }
    for stale in remove_recorded_segments(run_dir_path) {
        tracing::info!(path = %stale.display(), "removed a stale segment of an earlier launch");
    }
    let dflash_file = match &config.dflash {
        Some(settings) => Some(dflash_stage::write_settings(run_dir_path, settings)?),
        None => None,
    };
    if let Some(prompts) = &eval_prompts {
        super::eval::write_prompts(run_dir_path, prompts)
            .map_err(|e| RunError::Invalid(format!("eval prompts: {e}")))?;
    }
    let run_id = run_dir::run_id(run_dir_path);
    let nonce = {
        use std::hash::{BuildHasher, Hasher};
        // Randomly keyed per process: names nobody can guess ahead of the launch.
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    let shm_error = |e: dflash_common::ring::RingError| {
        RunError::Invalid(format!(
            "cannot create the rings ({} MB in {}): {e}",
            rings.total.div_ceil(1_000_000),
            run_dir::SHM_DIR
        ))
    };
    let input_path = run_dir::segment(&run_id, nonce, "input");
    let feature_path = run_dir::segment(&run_id, nonce, "feature");
    guard.segment(&input_path);
    guard.segment(&feature_path);
    crate::fsutil::write_atomically(&run_dir::segments_record(run_dir_path), |out| {
        use std::io::Write;
        writeln!(out, "{}", input_path.display())?;
        writeln!(out, "{}", feature_path.display())
    })
    .map_err(|e| RunError::Invalid(format!("{}: {e}", run_dir::SEGMENTS)))?;
    let input =
        Ring::create(&input_path, rings.input_slots, rings.input_bytes).map_err(shm_error)?;
    let features =
        Ring::create(&feature_path, rings.feature_slots, rings.feature_bytes).map_err(shm_error)?;
    let log_dir = workers::log_dir(run_dir_path);
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| RunError::Invalid(format!("{}: {e}", log_dir.display())))?;
    let metrics = super::metrics::Metrics::open(run_dir_path, prom)
        .map_err(|e| RunError::Invalid(format!("metrics: {e}")))?;
    let (to_loop, inbox) = mpsc::channel();
    let listener = control::bind(run_dir_path)
        .map_err(|e| RunError::Invalid(format!("control socket: {e}")))?;
    let mut journal = JournalWriter::open(&journal_path)
        .map_err(|e| RunError::Invalid(format!("{}: {e}", journal_path.display())))?;
    let jerr = |e: std::io::Error| RunError::Invalid(format!("journal: {e}"));
    // The journal line is the launch's last step: the run exists once it is written.
    let recorded = serde_json::to_value(&choice).map_err(|e| RunError::Invalid(e.to_string()))?;
    if resume {
        journal
            .append(&Entry::Resume {
                committed: start.step_base + start.batch as u64,
                changes,
                topology: Some(recorded),
            })
            .map_err(jerr)?;
    } else {
        let value = serde_json::to_value(&config).map_err(|e| RunError::Invalid(e.to_string()))?;
        journal
            .append(&Entry::Run {
                version: journal::VERSION,
                config: value,
                topology: Some(recorded),
            })
            .map_err(jerr)?;
    }
    tracing::info!(
        targets = topology.targets,
        drafters = topology.drafters,
        "topology {}",
        choice.describe()
    );
    guard.commit();
    control::serve(listener, to_loop.clone());

    let gpu_ids: Vec<u32> = devices
        .iter()
        .filter_map(|d| match d {
            Device::Gpu(g) => Some(*g),
            Device::Cpu(_) => None,
        })
        .collect();
    let source: Result<Box<dyn crate::observe::gpu::GpuSource>, String> = match &nvml {
        Ok(n) if !gpu_ids.is_empty() => {
            // Workers sharing a GPU: it is watched once.
            let mut unique = gpu_ids.clone();
            unique.sort_unstable();
            unique.dedup();
            Ok(Box::new(crate::observe::gpu::NvmlSource::new(n, &unique)))
        }
        Ok(_) => Err("CPU workers: no GPU telemetry".into()),
        Err(why) => Err(why.clone()),
    };
    if let Err(why) = &source {
        tracing::info!("no GPU telemetry ({why}): the monitor reports the workers' CPU and memory");
    }
    let monitor =
        crate::observe::monitor::Background::spawn(crate::observe::monitor::Monitor::new(
            source,
            Duration::from_secs_f64(config.monitor_interval_s.max(0.01)),
        ));
    let workers_list = worker_list(&devices, topology, &nvml);
    let (link, share) = match joined {
        Some(joined) => {
            // A node silent for this long is lost.
            let silence = Duration::from_secs_f64(config.heartbeat_timeout_s.max(10.0));
            let (link, port, resume_step) =
                joined.listen(to_loop.clone(), super::Input::Node, silence);
            let share = workers::NodeShare {
                base: link.rank * topology.drafters,
                world: link.nodes * topology.drafters,
                resume_step,
            };
            (Some(link), Some((share, port)))
        }
        None => (None, None),
    };
    let launch = workers::Launch {
        binary,
        input_ring: input.path().to_path_buf(),
        feature_ring: features.path().to_path_buf(),
        stage: config.stage.clone(),
        synthetic_us_per_token: config.synthetic_us_per_token,
        synthetic_drafter_us_per_token: config.synthetic_drafter_us_per_token,
        heartbeat_ms: config.heartbeat_ms,
        log_dir,
        dflash_config: dflash_file,
        python: config
            .dflash
            .as_ref()
            .and_then(|d| d.torch.as_ref())
            .map(|t| t.python.clone()),
        drafters: (config.dflash.is_some() && (topology.drafters > 1 || share.is_some())).then(
            || workers::DrafterGroup {
                first: topology.targets,
                ranks: topology.drafters,
                host: config
                    .nodes
                    .as_ref()
                    .map_or_else(|| "127.0.0.1".into(), nodes::NodeConfig::host),
                port: share.map_or(0, |(_, port)| port),
                timeout_s: dflash_common::dflash::DrafterRank::DEFAULT_TIMEOUT_S,
                nodes: share.map(|(s, _)| s),
                store_dir: share
                    .is_none()
                    .then(|| workers::drafter_store_dir(run_dir_path)),
                starts: 0,
                key: share.and_then(|(_, port)| {
                    let secret = config.nodes.as_ref()?.secret.as_ref()?;
                    Some(secret.drafters_key(port))
                }),
            },
        ),
    };
    let plan = planner.plan_epoch(u64::from(start.epoch));
    let planned = plan.batches.len();
    let mut dispatch = Dispatch::new(
        rings.input_slots as usize,
        rings.feature_slots as usize,
        workers_list.len(),
    );
    if let Some(g) = &launch.drafters {
        let (base, world) = g.nodes.map_or((0, g.ranks), |n| (n.base, n.world));
        dispatch = dispatch.with_assignment(super::dispatch::Assignment::ByPosition {
            first: g.first as usize,
            drafters: g.ranks as usize,
            accum: config.planner.accum as usize,
            base: base as usize,
            world: world as usize,
        });
    }
    dispatch.enter(planned, start.batch);
    let mut run = super::Run {
        run_dir: run_dir_path.to_path_buf(),
        run_id,
        journal,
        tokens,
        epoch: start.epoch,
        step_base: start.step_base,
        checksums: vec![0; planned],
        nonfinite: vec![None; planned],
        dispatch,
        epoch_sizes: start.epoch_sizes,
        rewind_to: None,
        drafter_resumed: false,
        final_checkpoint_lost: None,
        metrics,
        session_start: start.step_base + start.batch as u64,
        last_progress: Instant::now(),
        bar: super::progress::bar(),
        committed_total: start.step_base + start.batch as u64,
        tokens_committed: 0,
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
        job_times: Default::default(),
        evaluator,
        link,
        node_failure: None,
        config,
    };
    if let Some(g) = &run.launch.drafters
        && let Some(share) = g.nodes
    {
        run.metrics.share(
            share.base,
            g.ranks,
            share.world,
            run.link.as_ref().map_or(0, |l| l.rank),
        );
    }
    let new_epoch = start.batch == 0 && start.epoch < run.config.epochs;
    let result = run.drive(&inbox, new_epoch);
    if let Some(link) = run.link.as_mut() {
        // The other nodes learn at once how this one ended.
        link.send_all(&match &result {
            Ok(Outcome::Completed) => nodes::Message::Done,
            Ok(_) => nodes::Message::Stop {
                why: format!("node {} stopped", link.rank),
            },
            Err(e) => nodes::Message::Failed { why: e.to_string() },
        });
    }
    run.shutdown();
    let summary = Summary {
        steps: run.committed_total,
        tokens: run.tokens_committed,
        seconds: run.started.elapsed().as_secs_f64(),
        restarts: run.workers.iter().map(|w| w.restarts).sum(),
    };
    let result = result.map(|outcome| (outcome, summary));
    let _ = std::fs::remove_file(run_dir::control_socket(&run.run_dir));
    remove_recorded_segments(&run.run_dir);
    result
}

/// The prompts of the run's evaluations, each checked against the target: the user's file, or
/// the prompts of the store's held-out samples, whose lengths become 0 so that no plan holds them.
fn eval_prompts(
    eval: &super::eval::EvalConfig,
    settings: &DflashSettings,
    tokens: &Tokens,
    lengths: &mut [u32],
    seed: u64,
) -> Result<Vec<Vec<u32>>, RunError> {
    let target =
        dflash_common::dflash::read_config_for(&settings.target_model, settings.engines.target)
            .map_err(|e| RunError::Invalid(format!("--target-model {e}")))?;
    let max_new = eval.max_new_tokens as usize;
    let named: Vec<(String, Vec<u32>)> = match (&eval.prompts, tokens) {
        (Some(file), _) => crate::commands::eval::read_prompts(
            file,
            crate::ingest::chat::Template::ChatMl,
            &settings.target_model.join("tokenizer.json"),
            None,
        )
        .map_err(|e| RunError::Invalid(format!("--eval-prompts {e}")))?
        .into_iter()
        .map(|(line, ids)| (format!("{}:{line}", file.display()), ids))
        .collect(),
        (None, Tokens::Store(store)) => {
            let trainable = lengths.iter().filter(|&&l| l > 0).count();
            if eval.holdout as usize >= trainable {
                return Err(RunError::Invalid(format!(
                    "--eval-holdout {}: the store has {trainable} samples to train on, and holding out {} leaves none; hold out fewer (the default is 32) or pass --eval-prompts FILE",
                    eval.holdout,
                    (eval.holdout as usize).min(store.len())
                )));
            }
            let held = super::eval::held_out(store.len(), eval.holdout as usize, seed);
            let mut prompts = Vec::with_capacity(held.len());
            for i in held {
                lengths[i] = 0;
                if let Some(p) = super::eval::prompt_of(store.tokens(i), store.loss_mask(i)) {
                    prompts.push((format!("held-out sample {i}"), p));
                }
            }
            prompts
        }
        (None, Tokens::Synthetic { .. }) => {
            return Err(RunError::Invalid(
                "--eval-every on --synthetic data needs --eval-prompts FILE (synthetic samples have no prompts)".into(),
            ));
        }
    };
    if named.is_empty() {
        return Err(RunError::Invalid(
            "--eval-every: none of the held-out samples has a prompt (tokens before its first loss token); pass --eval-prompts FILE".into(),
        ));
    }
    for (at, ids) in &named {
        crate::commands::eval::check_prompt(at, ids, &target, max_new)
            .map_err(|e| RunError::Invalid(format!("--eval-every: {e}")))?;
    }
    Ok(named.into_iter().map(|(_, ids)| ids).collect())
}

/// The workers of the run, pinned: NUMA-local CPUs for GPU workers where NVML reports them,
/// shared among the GPUs of a node; otherwise an equal share of all available CPUs.
fn worker_list(
    devices: &[Device],
    topology: Topology,
    nvml: &Result<&'static nvml_wrapper::Nvml, String>,
) -> Vec<Worker> {
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
    let pools: Vec<Vec<usize>> = devices
        .iter()
        .map(|&d| gpu_cpus(d).unwrap_or_else(|| available.clone()))
        .collect();
    devices
        .iter()
        .enumerate()
        .map(|(i, &device)| {
            let peers: Vec<usize> = (0..count).filter(|&j| pools[j] == pools[i]).collect();
            let rank = peers.iter().position(|&j| j == i).unwrap_or(0);
            Worker {
                id: i as u32,
                role: if (i as u32) < topology.targets {
                    Role::Target
                } else {
                    Role::Drafter
                },
                device,
                cpus: workers::cpus_for(rank, peers.len(), &pools[i]),
                incarnation: 0,
                process: None,
                jobs: None,
                state: WorkerState::Restarting,
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
                job: None,
                resumed: None,
                stopped_with_group: false,
            }
        })
        .collect()
}
