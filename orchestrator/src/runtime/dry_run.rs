//! What a launch needs before it touches anything: the sizes of its rings, the memory plan of
//! its workers, and `launch --dry-run`, which reports them with what a launch would refuse.

use dflash_common::dflash::DflashSettings;
use dflash_common::ring::{MAX_TOKEN_BUDGET, feature_data_bytes, input_data_bytes};
use dflash_common::run_dir;

use super::launch_plan::check_options;
use super::run_lock::shm_free;
use super::spec;
use super::{RunConfig, RunError, dflash_stage, gpu_count, init_nvml, workers};
use crate::store::Store;

/// Bytes of `/dev/shm` the rings of a run need: `targets` target workers, batches of at most
/// `budget` tokens, `feature_bytes` bytes of features per token (`None`: the synthetic stage).
pub fn ring_bytes(targets: u32, budget: u64, feature_bytes: Option<u64>) -> Result<u64, RunError> {
    RingPlan::new(targets, 1, budget, feature_bytes).map(|r| r.total)
}

/// Sizes of the two rings.
#[derive(Debug, Clone, Copy)]
pub(super) struct RingPlan {
    pub(super) input_slots: u32,
    pub(super) input_bytes: u64,
    pub(super) feature_slots: u32,
    pub(super) feature_bytes: u64,
    pub(super) total: u64,
}

impl RingPlan {
    /// The rings of `targets` target workers and `drafters` drafters: two input slots per target
    /// and one more; two feature slots per target, and one per drafter (data-parallel drafters
    /// each hold their group's last batch until the group's step, which they take together).
    pub(super) fn new(
        targets: u32,
        drafters: u32,
        budget: u64,
        feature_bytes: Option<u64>,
    ) -> Result<Self, RunError> {
        let too_big = || {
            RunError::Invalid(format!(
                "--token-budget {budget}: the rings' sizes overflow (at most {MAX_TOKEN_BUDGET} tokens)"
            ))
        };
        if budget > MAX_TOKEN_BUDGET {
            return Err(too_big());
        }
        let input_slots = 2 * targets + 1;
        let feature_slots = 2 * targets + 1 + drafters.max(1);
        // Within MAX_TOKEN_BUDGET the input slot cannot overflow; the features' width can.
        let input_bytes = 64 + input_data_bytes(budget);
        let feature_bytes = match feature_bytes {
            Some(per_token) => budget
                .checked_mul(per_token)
                .map(|_| feature_data_bytes(budget, per_token)),
            None => budget.checked_mul(4),
        }
        .and_then(|b| b.checked_add(64))
        .ok_or_else(too_big)?;
        let total = u64::from(input_slots)
            .checked_mul(input_bytes)
            .and_then(|i| {
                u64::from(feature_slots)
                    .checked_mul(feature_bytes)
                    .and_then(|f| f.checked_add(i))
            })
            .and_then(|t| t.checked_add(128))
            .ok_or_else(too_big)?;
        Ok(Self {
            input_slots,
            input_bytes,
            feature_slots,
            feature_bytes,
            total,
        })
    }
}

/// The memory of the smallest GPU `gpus` (`--gpus` as written) names: `given` (`--gpu-memory`,
/// which stands for every GPU's) where given, else NVML's; `None` for CPU workers, or where
/// neither can tell.
pub fn smallest_gpu_memory(gpus: &str, given: Option<u64>) -> Option<u64> {
    let ids = match gpus.parse::<spec::GpuSpec>().ok()? {
        spec::GpuSpec::Cpu(_) => return None,
        _ if given.is_some() => return given,
        spec::GpuSpec::Ids(ids) => ids,
        spec::GpuSpec::All => {
            let nvml = init_nvml();
            (0..gpu_count(&nvml).ok()?).collect()
        }
    };
    let nvml = init_nvml();
    ids.iter()
        .map(|&g| gpu_total(&nvml, g))
        .collect::<Option<Vec<u64>>>()?
        .into_iter()
        .min()
}

/// A GPU's memory, from NVML.
pub(super) fn gpu_total(
    nvml: &Result<&'static nvml_wrapper::Nvml, String>,
    gpu: u32,
) -> Option<u64> {
    let nvml = nvml.as_ref().ok()?;
    Some(nvml.device_by_index(gpu).ok()?.memory_info().ok()?.total)
}

/// The memory plan of a DFlash run with these rings.
pub(super) fn memory_plan(
    config: &RunConfig,
    settings: &DflashSettings,
    target: &dflash_common::dflash::Qwen3Config,
    rings: &RingPlan,
) -> super::memory::MemoryPlan {
    let planner = &config.planner;
    // What a torch target loads: every tensor of its weight files.
    let params = (settings.engines.target == dflash_common::dflash::Engine::Torch)
        .then(|| super::memory::weight_elements(&settings.target_model))
        .flatten();
    let gpu = !config.gpus.trim().starts_with("cpu:");
    let mut plan = super::memory::plan(
        target,
        settings,
        settings.engines,
        gpu,
        params,
        planner.token_budget,
        u64::from(planner.max_len),
        rings.total,
        u64::from(rings.feature_slots) * rings.feature_bytes,
        u64::from(rings.input_slots) * rings.input_bytes,
    );
    // Prompts as long as the longest sequence, plus the new tokens.
    plan.eval = config.eval.as_ref().map(|e| {
        let context = u64::from(planner.max_len) + u64::from(e.max_new_tokens);
        super::memory::eval_worker(target, settings, context, settings.engines.target, params)
    });
    plan
}

/// What `launch --dry-run` found: the workers, the memory plan, and what a launch would refuse.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DryRun {
    /// Per worker, `role device` (e.g. `target gpu:0`).
    pub workers: Vec<String>,
    /// The topology and how it was decided.
    pub topology: super::topology::Choice,
    pub token_budget: u64,
    pub max_len: u32,
    /// The DFlash stage's plan (`None`: the synthetic stage).
    pub plan: Option<super::memory::MemoryPlan>,
    pub dtype: Option<String>,
    pub feature_dtype: Option<String>,
    /// The torch target runs packed rows (`--target-packing`).
    pub target_packing: Option<bool>,
    /// The torch drafter compiles its elementwise chains (`--drafter-compile`).
    pub drafter_compile: Option<bool>,
    /// Bytes of `/dev/shm` the rings need, and what it has free.
    pub shm_bytes: u64,
    pub shm_free: Option<u64>,
    pub gpus: Vec<super::memory::GpuUse>,
    /// What was not checked, and why.
    pub notes: Vec<String>,
    /// What a real launch would refuse; empty when it would start.
    pub refusals: Vec<String>,
}

/// Runs every check of a launch ([`super::launch_plan::prepare`], the one validation path)
/// without touching anything. GPUs planned for with `gpu_memory` on a machine that has none are
/// checked as CPU workers of the same count; everything else is checked as the launch would.
pub fn validate(
    config: &RunConfig,
    run_dir: &std::path::Path,
    resume: bool,
    gpu_memory: Option<u64>,
) -> Result<(), RunError> {
    let mut config = config.clone();
    if gpu_memory.is_some()
        && gpu_count(&init_nvml()).is_err()
        && let Ok(spec::GpuSpec::Ids(ids)) = config.gpus.parse::<spec::GpuSpec>()
    {
        config.gpus = format!("cpu:{}", ids.len());
    }
    super::launch_plan::prepare(config, run_dir, resume).map(|_| ())
}

/// Checks a launch and plans its memory without touching anything: no run directory, no
/// segment, no worker. `gpu_memory` stands for the GPUs' memory where NVML cannot tell it (or
/// to plan for other GPUs); with it, GPU ids are taken as given when this machine has no GPU.
pub fn dry_run(config: &RunConfig, gpu_memory: Option<u64>) -> Result<DryRun, RunError> {
    let nvml = init_nvml();
    let mut notes = Vec::new();
    let mut refusals = Vec::new();
    let count = match (gpu_count(&nvml), gpu_memory) {
        (Err(why), Some(_)) => {
            let named = match config.gpus.parse::<spec::GpuSpec>() {
                Ok(spec::GpuSpec::Ids(ids)) => ids.iter().max().map_or(0, |m| m + 1),
                _ => 0,
            };
            notes.push(format!(
                "GPUs not checked ({why}): planned for the GPU ids given, each with --gpu-memory"
            ));
            Ok(named)
        }
        (count, _) => count,
    };
    let options = check_options(config, count)?;
    let devices = options.devices.clone();
    let lengths = match (&config.data, config.synthetic) {
        (Some(dir), _) => Store::open(dir)
            .map_err(|e| RunError::Invalid(e.to_string()))?
            .lengths(),
        (None, Some(n)) if n > 0 => crate::workload::synthetic_lengths(n, config.synthetic_seed),
        _ => {
            return Err(RunError::Invalid(
                "pass --data STORE or --synthetic N".into(),
            ));
        }
    };
    let planner = crate::planner::Planner::new(lengths, options.plan.clone())
        .map_err(|e| RunError::Invalid(e.to_string()))?;
    let budget = config.planner.token_budget;
    let mut plan = None;
    let mut feature_bytes = None;
    let mut target = None;
    if let Some(settings) = &config.dflash {
        let dir = &settings.target_model;
        let checked = dflash_common::dflash::read_config_for(dir, settings.engines.target)
            .map_err(|e| RunError::Invalid(format!("--target-model {e}")))?;
        match dflash_common::dflash::weight_files(dir) {
            // The candle target's tensors are Qwen3's; the torch engine's are what
            // `transformers` makes of the architecture (as a launch checks them).
            Ok(_) if settings.engines.target == dflash_common::dflash::Engine::Candle => {
                crate::model_dir::check_weights(
                    dir,
                    &checked,
                    settings.target_layers_needed(checked.num_hidden_layers),
                )
                .map_err(|e| RunError::Invalid(format!("--target-model {e}")))?
            }
            Ok(_) => crate::model_dir::check_torch_heads(dir)
                .map_err(|e| RunError::Invalid(format!("--target-model {e}")))?,
            Err(e) => notes.push(format!(
                "the target's weights were not checked ({e}): a launch needs them"
            )),
        }
        settings.check(&checked).map_err(RunError::Invalid)?;
        if dflash_stage::needs_cuda_worker(settings, &devices) {
            let binary = workers::worker_binary();
            match dflash_stage::worker_has_cuda(&binary) {
                Ok(true) => {}
                Ok(false) => refusals.push(format!(
                    "{} was built without CUDA: GPU workers need `cargo build --release --features cuda`",
                    binary.display()
                )),
                Err(e) => notes.push(format!("the worker binary was not checked: {e}")),
            }
        }
        feature_bytes = Some(settings.feature_bytes_per_token(&checked));
        target = Some(checked);
    }
    let choice =
        super::launch_plan::decide_topology(config, &options, &planner, target.as_ref(), None)?;
    let topology = choice.topology();
    if let Err(why) = super::launch_plan::check_drafters(config, topology) {
        refusals.push(why);
    }
    let workers: Vec<String> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let role = if (i as u32) < topology.targets {
                "target"
            } else {
                "drafter"
            };
            format!("{role} {d}")
        })
        .collect();
    let rings = RingPlan::new(topology.targets, topology.drafters, budget, feature_bytes)?;
    let free = shm_free();
    if let Some(free) = free
        && free < rings.total
    {
        refusals.push(format!(
            "{} has {} free, the rings need {} (lower --token-budget{}, or in a container raise --shm-size)",
            run_dir::SHM_DIR,
            crate::format::gib(free),
            crate::format::gib(rings.total),
            match config.dflash.as_ref().map(|d| d.feature_dtype) {
                Some(dflash_common::dflash::Precision::F32) => ", use --feature-dtype bf16",
                _ => "",
            }
        ));
    }
    let mut gpus = Vec::new();
    if let (Some(settings), Some(target)) = (&config.dflash, &target) {
        let p = memory_plan(config, settings, target, &rings);
        gpus = super::memory::gpu_uses(&p, &devices, topology.targets, |g| {
            gpu_total(&nvml, g).or(gpu_memory)
        });
        if gpus.iter().any(|u| u.total.is_none()) {
            notes.push(
                "GPU memory unknown (no NVML): pass --gpu-memory GIB to check the fit".into(),
            );
        }
        refusals.extend(super::memory::refusal(&gpus));
        plan = Some(p);
    }
    Ok(DryRun {
        workers,
        topology: choice,
        token_budget: budget,
        max_len: config.planner.max_len,
        dtype: config.dflash.as_ref().map(|d| d.dtype.to_string()),
        feature_dtype: config.dflash.as_ref().map(|d| d.feature_dtype.to_string()),
        target_packing: config.dflash.as_ref().map(|d| d.target_packing),
        drafter_compile: config.dflash.as_ref().map(|d| d.drafter_compile),
        plan,
        shm_bytes: rings.total,
        shm_free: free,
        gpus,
        notes,
        refusals,
    })
}
