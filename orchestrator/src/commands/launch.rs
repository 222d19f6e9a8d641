//! `dflash-orch launch`: start (or resume) a run and drive it to its end.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;

use super::plan::{PlannerFlags, config_from_args as plan_config_from_args};
use crate::error::CliError;
use crate::options;
use crate::runtime::memory::ChunkDevice;
use crate::runtime::torch_engine;
use crate::runtime::{self, Outcome, PlannerSettings, RunConfig, RunError};
use dflash_common::dflash::{DflashSettings, Engine, Engines};

#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Workers: GPU ids (0-7, 0,2,5, all) or cpu:N for N CPU workers.
    #[arg(long, value_name = "SPEC")]
    pub gpus: Option<String>,

    /// The run directory: journal, control socket, worker logs.
    #[arg(long, value_name = "DIR")]
    pub run_dir: PathBuf,

    /// A dataset store made by `dflash-orch prepare`.
    #[arg(long, value_name = "STORE")]
    pub data: Option<PathBuf>,

    /// Train on N synthetic samples (seed-shaped lengths, synthetic token ids).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub synthetic: Option<u64>,

    /// Seed of the synthetic workload.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub synthetic_seed: u64,

    /// What the workers compute: dflash (targets run --target-model, the drafter trains on their
    /// hidden states), or synthetic (for tests and benchmarks: moves every token through both
    /// rings and verifies it; no model).
    #[arg(long, value_name = "STAGE", default_value = "synthetic")]
    pub stage: String,

    /// Synthetic stage: microseconds a target spends per token.
    #[arg(long, value_name = "US", default_value_t = 0.0, value_parser = options::real(0.0, 1e6, " microseconds"))]
    pub synthetic_us_per_token: f64,

    /// Synthetic stage: microseconds a drafter spends per token it trains.
    #[arg(long, value_name = "US", default_value_t = 0.0, value_parser = options::real(0.0, 1e6, " microseconds"))]
    pub synthetic_drafter_us_per_token: f64,

    /// T:D, T target workers and D drafter workers, or auto [default: auto with --stage dflash,
    /// all but one as targets on the synthetic stage]. D > 1 with --stage dflash trains the
    /// drafter data-parallel on the torch engine (--engine torch): the D drafters form one
    /// torch.distributed group and split each accumulation group. auto balances the roles on
    /// what a micro-batch costs each on the run's own plan (a FLOP model of the target's
    /// forward and the drafter's step on GPUs; the --synthetic-*us-per-token costs on the
    /// synthetic stage), within --accum and the engine (the candle drafter trains alone); CPU
    /// workers share the machine's cores, so on them auto keeps all but one as targets. A
    /// resume keeps the run's drafters. `launch --dry-run` prints the choice and why; the
    /// journal records it.
    #[arg(long, value_name = "T:D|auto")]
    pub topology: Option<String>,

    /// Epochs to train (1 to 1000).
    #[arg(long, value_name = "N", default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub epochs: u32,

    #[command(flatten)]
    pub planner: PlannerFlags,

    #[command(flatten)]
    pub dflash: DflashFlags,

    /// Restarts a worker may need within --restart-window before the run fails.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub max_restarts: u32,

    /// The window of --max-restarts, in seconds (up to 30 days).
    #[arg(long, value_name = "SECS", default_value_t = 600.0, value_parser = options::positive(2_592_000.0, " seconds"))]
    pub restart_window: f64,

    /// A worker silent for this long is killed and restarted (hung, e.g. SIGSTOP); 0.1 to 86400.
    #[arg(long, value_name = "SECS", default_value_t = 30.0, value_parser = options::real(0.1, 86_400.0, " seconds"))]
    pub heartbeat_timeout: f64,

    /// A job running longer than this is taken for a hang inside the job (a wedged kernel, a
    /// driver call, a deadlock: heartbeats come from their own thread and stay fresh): the worker
    /// is killed and restarted and its batch handed out again. auto: the larger of 120 s and ten
    /// times the role's moving p95 job time. 1 to 604800 seconds, or auto.
    #[arg(long, value_name = "SECS|auto", default_value = "auto", value_parser = options::seconds_or_auto(options::JOB_TIMEOUT_S.0, options::JOB_TIMEOUT_S.1))]
    pub job_timeout: options::JobTimeout,

    /// How long stopping workers may take (the drafter writes its final checkpoint: allow for its
    /// size on slow disks) before they are killed; 1 to 86400 seconds.
    #[arg(long, value_name = "SECS", default_value_t = 300.0, value_parser = options::real(1.0, 86_400.0, " seconds"))]
    pub stop_grace: f64,

    /// Seconds between monitor readings: GPU power, utilization, memory, temperature, clocks and
    /// throttling through NVML, and every worker's CPU and memory; 0.05 to 3600.
    #[arg(long, value_name = "SECS", default_value_t = 1.0, value_parser = options::interval())]
    pub monitor_interval: f64,

    /// Serve Prometheus metrics on GET /metrics at PORT (on 127.0.0.1) or HOST:PORT (port 0
    /// picks a free one; `status` shows it).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,

    /// Nodes of the run: one orchestrator per node (this command on each, with its own
    /// --node-rank), each with its own targets feeding its own drafters, every node's drafters in
    /// one torch.distributed group (only gradients cross nodes). 1 to 4096; more than one needs
    /// --stage dflash --engine torch, the same store (by content) and options on every node, its
    /// own --run-dir per node, and --accum at least the drafters of all nodes. Filled in from
    /// Slurm (SLURM_NNODES, SLURM_NODEID, the first host of SLURM_JOB_NODELIST) or torchrun
    /// (WORLD_SIZE / LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR:MASTER_PORT) when not given;
    /// --nodes 1 trains on this node alone whatever they say. A lost node stops the others at
    /// their last checkpoint: relaunch every node with --resume. See docs/multi-node.md.
    #[arg(long, value_name = "N", help_heading = "Several nodes", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub nodes: Option<u32>,

    /// This node's rank, 0 to --nodes - 1; node 0 listens at --rendezvous and checks the others.
    #[arg(long, value_name = "R", help_heading = "Several nodes", value_parser = clap::value_parser!(u32).range(0..4096))]
    pub node_rank: Option<u32>,

    /// Node 0's HOST:PORT, reachable from every node: node 0 listens on PORT (refused when it
    /// is taken), and the drafters' group meets on another port of HOST that node 0 picks.
    /// [default with Slurm: the first host of the job, port 29400]
    #[arg(long, value_name = "HOST:PORT", help_heading = "Several nodes")]
    pub rendezvous: Option<String>,

    /// How long the nodes may take to join (node 0 waits for every other; the others retry
    /// until node 0 answers), in seconds: 1 to 86400.
    #[arg(long, value_name = "SECS", default_value_t = 300.0, help_heading = "Several nodes", value_parser = options::real(1.0, 86_400.0, " seconds"))]
    pub rendezvous_timeout: f64,

    /// The run's secret, which authenticates every message between the nodes (each end proves
    /// it to the other; nothing unproven is obeyed): a file of at least 32 bytes that every node
    /// reads, the same on each, this user's own and owner-only (mode 0600), not a symbolic link.
    /// Make one with `umask 077; head -c 32 /dev/urandom > FILE`. Needed with more than one
    /// node, on every launch and resume. [default: $DFLASH_RENDEZVOUS_SECRET_FILE, which srun
    /// and torchrun pass on to every node]
    #[arg(long, value_name = "FILE", help_heading = "Several nodes")]
    pub rendezvous_secret_file: Option<PathBuf>,

    /// Continue the run in --run-dir from its journal. Its options come from the journal: an
    /// option given again must have the journal's value, except those that may change on resume:
    /// --gpus and --topology (the number of target workers, not of drafters), --metrics-addr,
    /// --job-timeout, --stop-grace, --heartbeat-timeout, --monitor-interval, --max-restarts,
    /// --restart-window, --synthetic-us-per-token, --synthetic-drafter-us-per-token,
    /// --on-nonfinite, --eval-every, --eval-max-new-tokens, --eval-prompts (another file, not
    /// in place of held-out samples) and --python (the engines stay). The journal's resume line
    /// records every change.
    #[arg(long)]
    pub resume: bool,

    /// Check everything and print the memory plan (each worker's peak: weights, activations,
    /// attention, features, optimiser; the GPUs' and /dev/shm's fit) without starting anything.
    /// Exits 1 when a launch would be refused.
    #[arg(long)]
    pub dry_run: bool,

    /// With --dry-run: the plan as JSON.
    #[arg(long, requires = "dry_run")]
    pub json: bool,

    /// With --dry-run: the memory of each GPU in GiB, where NVML cannot tell it (planning on a
    /// machine without the GPUs) or to plan for other GPUs.
    #[arg(long, value_name = "GIB", requires = "dry_run", value_parser = options::positive(1e6, " GiB"))]
    pub gpu_memory: Option<f64>,

    /// The options given on the command line (long names), for --resume to compare.
    #[arg(skip)]
    pub given: Vec<String>,
}

/// The DFlash stage's options (`--stage dflash`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "DFlash stage (--stage dflash)")]
pub struct DflashFlags {
    /// The target model: a Hugging Face directory of a Qwen3 model (config.json and
    /// model.safetensors or a sharded index).
    #[arg(long, value_name = "DIR")]
    pub target_model: Option<PathBuf>,

    /// Target layers whose hidden states feed the drafter, e.g. 1,9,17,25,33 [default: one per
    /// drafter layer, spread evenly from layer 1 to L-3].
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub target_layer_ids: Option<Vec<usize>>,

    /// Decoder layers of the drafter (1 to 64).
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub draft_layers: u16,

    /// Tokens per draft block (the anchor and block-1 mask tokens); 2 to 256.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u16).range(2..=256))]
    pub block_size: u16,

    /// Blocks sampled per sequence at each step (1 to 65536).
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub num_anchors: u32,

    /// The mask token of the blocks [default: the last id of the target's vocabulary].
    #[arg(long, value_name = "ID")]
    pub mask_token_id: Option<u32>,

    /// Peak learning rate (above 0, at most 1).
    #[arg(long, value_name = "LR", default_value_t = 6e-4, value_parser = options::positive(1.0, ""))]
    pub lr: f64,

    /// Fraction of the optimiser steps spent warming up (then cosine decay); 0 to 1.
    #[arg(long, value_name = "R", default_value_t = 0.04, value_parser = options::real(0.0, 1.0, ""))]
    pub warmup_ratio: f64,

    /// Gradient clipping: maximum global norm (above 0, at most 1e6).
    #[arg(long, value_name = "NORM", default_value_t = 1.0, value_parser = options::positive(1e6, ""))]
    pub clip: f64,

    /// Loss decay over block positions, exp(-(k-1)/GAMMA): auto (the published recipe: 7 for
    /// blocks of 16, 4 for blocks of 8, half the block otherwise), none (uniform), or GAMMA above 0
    /// and at most 1e6.
    #[arg(long, value_name = "auto|none|GAMMA", default_value = "auto", value_parser = options::gamma_choice())]
    pub gamma: options::GammaChoice,

    /// The loss: ce (cross-entropy on the data's next tokens), kd (distillation of the target's
    /// next-token distribution at each block position: the target workers also hand over their
    /// last hidden state, and the drafter applies the frozen lm_head), mix (--kd-weight of kd,
    /// the rest ce), or dpace (D-PACE: ce with each block position weighted by the detached
    /// probability that the drafter's block survives to it and past it, smoothed by
    /// --dpace-alpha; it replaces the --gamma decay, which must stay auto or none), or kd-dpace
    /// (kd, each block position weighted as dpace weighs it, from the drafter's probabilities of
    /// the data's tokens).
    #[arg(long, value_name = "ce|kd|mix|dpace|kd-dpace", default_value = "ce")]
    pub loss: dflash_common::dflash::LossKind,

    /// Temperature of the target's distribution that kd teaches (above 0, at most 100). Only the
    /// target's side is tempered, since the drafter is served untempered: match the serving
    /// mode. Greedy serving accepts the target's argmax, so the default 0.1 puts nearly all weight
    /// on it while keeping near-ties; for sampled serving give the sampling temperature.
    #[arg(long, value_name = "T", default_value_t = 0.1, value_parser = options::positive(100.0, ""))]
    pub kd_temperature: f64,

    /// Share of distillation in --loss mix; 0 to 1.
    #[arg(long, value_name = "W", default_value_t = 0.5, value_parser = options::real(0.0, 1.0, ""))]
    pub kd_weight: f64,

    /// D-PACE's smoothing of the drafter's probabilities, (1 - ALPHA)·q + ALPHA, in --loss
    /// dpace; 0 to 1 (1 makes every weight the count of the positions from it to the block's
    /// end).
    #[arg(long, value_name = "ALPHA", default_value_t = 0.5, value_parser = options::real(0.0, 1.0, ""))]
    pub dpace_alpha: f64,

    /// The drafter's architecture: dflash, or dflash2 (the official package's DFlash2DraftModel:
    /// a grouped dynamic causal convolution before and after each attention and MLP sublayer,
    /// and a candidate selector that rescores the head's top --selector-top-k tokens at each
    /// block position against the token before it). dflash2 trains on the torch engine.
    #[arg(
        long,
        value_name = "dflash|dflash2",
        default_value = "dflash",
        help_heading = "DFlash2"
    )]
    pub drafter_arch: dflash_common::dflash::DrafterArch,

    /// DFlash2: taps of each convolution (the position and those before it in its block); 1 to
    /// the block size.
    #[arg(long, value_name = "N", default_value_t = 2, help_heading = "DFlash2", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub conv_kernel_size: u16,

    /// DFlash2: channels that share one dynamic kernel tap; must divide the hidden size.
    #[arg(long, value_name = "N", default_value_t = 16, help_heading = "DFlash2", value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub conv_group_size: u32,

    /// DFlash2: candidates the selector rescores at each block position (the head's top K); 1 to
    /// the vocabulary's size.
    #[arg(long, value_name = "K", default_value_t = 16, help_heading = "DFlash2", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub selector_top_k: u32,

    /// DFlash2: width of the selector's codebooks and hidden projection; 1 to 65536.
    #[arg(long, value_name = "R", default_value_t = 256, help_heading = "DFlash2", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub selector_rank: u32,

    /// DFlash2: weight of the selector's loss (cross-entropy over the top-K candidates, the
    /// data's token put in the last candidate's place when the head misses it) beside the
    /// drafter's own, at each block position; 0 to 100.
    #[arg(long, value_name = "W", default_value_t = 1.0, help_heading = "DFlash2", value_parser = options::real(0.0, 100.0, ""))]
    pub selector_loss_weight: f64,

    /// DFlash2: the selector's loss trains the selector's weights only (the head's logits and
    /// the hidden states it reads are detached); without it, it trains the whole drafter.
    #[arg(long, help_heading = "DFlash2")]
    pub selector_stop_gradient: bool,

    /// Every drafter layer attends within a window of N positions (sliding_attention layers, as
    /// the published DFlash2 drafters use with N = 2048); default: full attention. Torch engine.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub sliding_window: Option<u32>,

    /// AdamW weight decay; 0 to 1.
    #[arg(long, value_name = "WD", default_value_t = 0.01, value_parser = options::real(0.0, 1.0, ""))]
    pub weight_decay: f64,

    /// Write a checkpoint every N optimiser steps (and at the end); 1 to 1e9.
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub save_every: u64,

    /// Checkpoints to keep (1 to 1000).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub keep_checkpoints: u16,

    /// The target's weights and activations, and the drafter's compute (its master weights and
    /// AdamW moments stay f32): f32, bf16, or auto (bf16 on GPUs, f32 on CPUs). A checkpoint
    /// stored in this dtype is loaded without conversion.
    #[arg(long, value_name = "auto|f32|bf16", default_value = "auto", value_parser = options::dtype_choice())]
    pub dtype: options::DtypeChoice,

    /// The features' element type in the feature ring (/dev/shm): f32, bf16, or auto (bf16 on
    /// GPUs, f32 on CPUs). bf16 halves the ring.
    #[arg(long, value_name = "auto|f32|bf16", default_value = "auto", value_parser = options::dtype_choice())]
    pub feature_dtype: options::DtypeChoice,

    /// Measure served acceptance every N optimiser steps and at the end: τ of the checkpoint
    /// written at that step, by greedy speculative decoding with the target on held-out
    /// prompts, in a process of its own while training goes on (the drafter checkpoints at
    /// those steps too). May change on --resume.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub eval_every: Option<u64>,

    /// The prompts of --eval-every (JSON lines as `eval --prompts` reads them) [default:
    /// --eval-holdout samples of the store, held out of training].
    #[arg(long, value_name = "FILE", requires = "eval_every")]
    pub eval_prompts: Option<PathBuf>,

    /// Samples of the store held out of every plan (chosen from the seed, never trained on)
    /// whose prompts --eval-every decodes, when --eval-prompts is not given; 1 to 100000.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub eval_holdout: u32,

    /// New tokens per prompt in --eval-every's decoding (1 to 1048576). May change on --resume.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub eval_max_new_tokens: u32,

    /// What a NaN or infinity in the features, the loss or the gradients does: stop (the run
    /// ends, naming the batch, the worker and the layer) or skip (that optimiser step is skipped,
    /// journalled and counted in metrics). May change on --resume.
    #[arg(long, value_name = "stop|skip", default_value = "stop")]
    pub on_nonfinite: dflash_common::dflash::NonFinite,

    /// What computes the stages: candle (Rust, embedded, no Python), torch (PyTorch and
    /// transformers in a Python child of each worker; the target may be any causal LM
    /// transformers loads), target=E,drafter=E for one engine per role, or auto (torch for the
    /// targets when the run is on GPUs and a usable PyTorch is found, candle otherwise; the
    /// choice and why are said at start). Kept by --resume.
    #[arg(long, value_name = "ENGINE", default_value = "auto", value_parser = options::engine_choice())]
    pub engine: options::EngineChoice,

    /// The Python of the torch engine [default: $DFLASH_PYTHON, else python3 on PATH]. May
    /// change on --resume.
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,

    /// Anchors computed and back-propagated together (gradients of the chunks are summed): 1 to
    /// 65536, or auto (as many as fit the drafter's activation budget at --max-len; see `launch
    /// --dry-run`). Candle chunks a sequence's anchors; the torch drafter packs whole sequences
    /// into a chunk, so a count past one sequence's anchors runs several sequences in one pass.
    #[arg(long, value_name = "N|auto", default_value = "auto", value_parser = options::count_or_auto(1, 65_536))]
    pub anchor_chunk: options::CountOrAuto,

    /// How the torch target runs a micro-batch: on packs its sequences into rows of up to the
    /// budget (back to back, positions restarting; on a GPU one variable-length flash-attention
    /// kernel per layer, on a CPU each sequence's own attention), off runs rows of one length
    /// together (one forward per length on real data), auto is on for GPU workers. The features
    /// are the same up to float rounding; a target the kernel cannot run (an option it lacks)
    /// goes back to rows, saying why. Kept by --resume.
    #[arg(long, value_name = "auto|on|off", default_value = "auto", value_parser = options::switch())]
    pub target_packing: options::Switch,

    /// Whether the torch drafter compiles its elementwise chains with torch.compile (RMSNorm,
    /// rotary embedding, SiLU gating, the loss's softmax gradient: one fused kernel each instead
    /// of one per operation): auto is on for GPU workers. The same values up to float rounding;
    /// compiling costs seconds at the drafter's start (its log says how many), and a compiler
    /// that fails leaves the eager chains, saying why. The candle drafter has none. Kept by
    /// --resume.
    #[arg(long, value_name = "auto|on|off", default_value = "auto", value_parser = options::switch())]
    pub drafter_compile: options::Switch,
}

impl DflashFlags {
    /// `--eval-*`: the run's served-acceptance evaluations, when asked for.
    pub fn eval(&self) -> Option<crate::runtime::eval::EvalConfig> {
        Some(crate::runtime::eval::EvalConfig {
            every: self.eval_every?,
            prompts: self
                .eval_prompts
                .as_ref()
                .map(|p| p.canonicalize().unwrap_or_else(|_| p.clone())),
            holdout: if self.eval_prompts.is_some() {
                0
            } else {
                self.eval_holdout
            },
            max_new_tokens: self.eval_max_new_tokens,
        })
    }

    /// The settings, with defaults that depend on the target filled in from its config.json and
    /// on the workers' devices (`device`: CPUs, or GPUs with the smallest one's memory), the
    /// longest sequence (`max_len`) and the micro-batch's tokens (`budget`).
    pub fn settings(
        &self,
        seed: u64,
        device: ChunkDevice,
        max_len: u32,
        budget: u64,
    ) -> Result<DflashSettings, CliError> {
        let gpu = device != ChunkDevice::Cpu;
        let dir = self
            .target_model
            .clone()
            .ok_or_else(|| CliError::Invalid("--stage dflash needs --target-model DIR".into()))?;
        // Defaults only: the target is checked for its engine once the engine is known.
        let target =
            dflash_common::dflash::read_config_for(&dir, dflash_common::dflash::Engine::Torch)
                .map_err(|e| CliError::Invalid(format!("--target-model {e}")))?;
        Ok(DflashSettings {
            target_model: dir.canonicalize().unwrap_or(dir),
            target_layer_ids: self.target_layer_ids.clone().unwrap_or_else(|| {
                dflash_common::dflash::default_target_layer_ids(
                    target.num_hidden_layers,
                    usize::from(self.draft_layers),
                )
            }),
            draft_layers: usize::from(self.draft_layers),
            block_size: usize::from(self.block_size),
            num_anchors: self.num_anchors as usize,
            mask_token_id: self
                .mask_token_id
                .unwrap_or(target.vocab_size.saturating_sub(1) as u32),
            lr: self.lr,
            warmup_ratio: self.warmup_ratio,
            clip: self.clip,
            // D-PACE replaces the decay: `auto` is none there (a value is refused).
            gamma: match (self.loss, self.gamma) {
                (
                    dflash_common::dflash::LossKind::Dpace
                    | dflash_common::dflash::LossKind::KdDpace,
                    options::GammaChoice::Auto,
                ) => None,
                (_, gamma) => gamma.resolve(usize::from(self.block_size)),
            },
            loss: self.loss,
            kd_temperature: self.kd_temperature,
            kd_weight: self.kd_weight,
            dpace_alpha: self.dpace_alpha,
            drafter_arch: self.drafter_arch,
            dflash2: dflash_common::dflash::Dflash2Settings {
                conv_kernel_size: usize::from(self.conv_kernel_size),
                conv_group_size: self.conv_group_size as usize,
                selector_top_k: self.selector_top_k as usize,
                selector_rank: self.selector_rank as usize,
                selector_loss_weight: self.selector_loss_weight,
                selector_stop_gradient: self.selector_stop_gradient,
            },
            sliding_window: self.sliding_window.map(|w| w as usize),
            weight_decay: self.weight_decay,
            seed,
            save_every: self.save_every,
            keep_checkpoints: usize::from(self.keep_checkpoints),
            total_steps: 0,
            token_budget: 0,
            checkpoint_dir: PathBuf::new(),
            dtype: self.dtype.resolve(gpu),
            feature_dtype: self.feature_dtype.resolve(gpu),
            anchor_chunk: None,
            target_packing: self.target_packing.resolve(gpu),
            drafter_compile: self.drafter_compile.resolve(gpu),
            on_nonfinite: self.on_nonfinite,
            eval_every: self.eval_every,
            fingerprint: Default::default(),
            // `auto` on GPU workers is decided by the launch's checks (`check_engines`), which
            // probe the Python; on CPU workers it is candle.
            engines: match self.engine {
                options::EngineChoice::Is(engines) => engines,
                options::EngineChoice::Auto => Engines::both(Engine::Candle),
            },
            torch: None,
            engine_auto: gpu && self.engine == options::EngineChoice::Auto,
            anchor_chunk_auto: self.anchor_chunk == options::CountOrAuto::Auto,
        })
        .map(|mut settings| {
            settings.torch = (settings.engine_auto || settings.engines.uses(Engine::Torch))
                .then(|| torch_engine::runtime(self.python.as_deref()));
            settings.anchor_chunk = match self.anchor_chunk {
                // The torch drafter packs whole sequences into a chunk, so a count past one
                // sequence's anchors runs several sequences in one pass; candle's chunks are
                // within a sequence.
                options::CountOrAuto::Count(n) if settings.engines.drafter == Engine::Torch => {
                    Some(n as usize)
                }
                options::CountOrAuto::Count(n) => {
                    Some(n as usize).filter(|&n| n < settings.num_anchors)
                }
                options::CountOrAuto::Auto => crate::runtime::memory::auto_anchor_chunk(
                    &target, &settings, max_len, budget, device,
                ),
            };
            settings
        })
    }
}

/// The run's options as a fresh launch takes them; on resume, options not given come from the
/// journal's `stored` ones (so that the given ones can be compared with it).
pub fn config_from_args(
    args: &LaunchArgs,
    stored: Option<&RunConfig>,
) -> Result<RunConfig, CliError> {
    let gpus = args
        .gpus
        .clone()
        .or_else(|| stored.map(|s| s.gpus.clone()))
        .ok_or_else(|| CliError::Invalid("--gpus is required (e.g. --gpus 0-7 or cpu:3)".into()))?;
    if let Some(addr) = &args.metrics_addr {
        crate::observe::prom::parse_addr(addr).map_err(CliError::Invalid)?;
    }
    if matches!(
        args.dflash.loss,
        dflash_common::dflash::LossKind::Dpace | dflash_common::dflash::LossKind::KdDpace
    ) && matches!(args.dflash.gamma, options::GammaChoice::Is(_))
    {
        return Err(CliError::Invalid(format!(
            "--loss {} weighs the block positions itself: --gamma must be auto or none",
            args.dflash.loss.name()
        )));
    }
    let (data, synthetic) = match (&args.data, args.synthetic, stored) {
        (None, None, Some(s)) => (s.data.clone(), s.synthetic),
        (Some(_), Some(_), _) | (None, None, None) => {
            return Err(CliError::Invalid(
                "pass exactly one of --data STORE and --synthetic N".into(),
            ));
        }
        (data, synthetic, _) => (
            data.as_ref()
                .map(|d| d.canonicalize().unwrap_or_else(|_| d.clone())),
            synthetic.map(|n| n as usize),
        ),
    };
    let given = |flag: &str| args.given.iter().any(|g| g == flag);
    let stage = match stored {
        Some(s) if !given("stage") => s.stage.clone(),
        _ => args.stage.clone(),
    };
    let plan = plan_config_from_args(&args.planner)?;
    let dflash = match stage.as_str() {
        "dflash" => {
            let mut flags = args.dflash.clone();
            if flags.target_model.is_none() {
                flags.target_model = stored
                    .and_then(|s| s.dflash.as_ref())
                    .map(|d| d.target_model.clone());
            }
            let device = if gpus.trim().starts_with("cpu:") {
                ChunkDevice::Cpu
            } else {
                let given = args.gpu_memory.map(|g| (g * f64::from(1u32 << 30)) as u64);
                ChunkDevice::Gpu(crate::runtime::dry_run::smallest_gpu_memory(&gpus, given))
            };
            let mut settings =
                flags.settings(plan.seed, device, plan.max_len, plan.token_budget)?;
            // On resume, auto means the run's own engines.
            if let (options::EngineChoice::Auto, Some(run)) =
                (flags.engine, stored.and_then(|s| s.dflash.as_ref()))
            {
                settings.engines = run.engines;
                settings.engine_auto = false;
            }
            Some(settings)
        }
        _ if args.dflash.target_model.is_some() => {
            return Err(CliError::Invalid(
                "--target-model goes with --stage dflash".into(),
            ));
        }
        _ => None,
    };
    Ok(RunConfig {
        gpus,
        topology: args.topology.clone(),
        data,
        synthetic,
        synthetic_seed: args.synthetic_seed,
        stage,
        synthetic_us_per_token: args.synthetic_us_per_token,
        synthetic_drafter_us_per_token: args.synthetic_drafter_us_per_token,
        epochs: args.epochs,
        planner: PlannerSettings::from_config(&plan),
        max_restarts: args.max_restarts,
        restart_window_s: args.restart_window,
        heartbeat_timeout_s: args.heartbeat_timeout,
        heartbeat_ms: ((args.heartbeat_timeout * 1000.0 / 10.0) as u64).clamp(20, 1000),
        monitor_interval_s: args.monitor_interval,
        metrics_addr: args.metrics_addr.clone(),
        eval: dflash.as_ref().and(args.dflash.eval()),
        dflash,
        job_timeout_s: args.job_timeout.seconds(),
        stop_grace_s: args.stop_grace,
        nodes: node_config(args, stored)?,
    })
}

/// This node's place among the run's nodes: from the options, else (on resume) the journal's.
fn node_config(
    args: &LaunchArgs,
    stored: Option<&RunConfig>,
) -> Result<Option<runtime::nodes::NodeConfig>, CliError> {
    let before = stored.and_then(|s| s.nodes.as_ref());
    let nodes = args.nodes.or(before.map(|n| n.nodes)).unwrap_or(1);
    if nodes == 1 {
        if args.node_rank.is_some_and(|r| r > 0) {
            return Err(CliError::Invalid(format!(
                "--node-rank {} is not a node of a run of one node (pass --nodes N)",
                args.node_rank.unwrap_or_default()
            )));
        }
        return Ok(None);
    }
    let rank = args
        .node_rank
        .or(before.map(|n| n.rank))
        .ok_or_else(|| CliError::Invalid(format!("--nodes {nodes} needs --node-rank R")))?;
    let rendezvous = args
        .rendezvous
        .clone()
        .or(before.map(|n| n.rendezvous.clone()))
        .ok_or_else(|| {
            CliError::Invalid(format!(
                "--nodes {nodes} needs --rendezvous HOST:PORT (node 0's)"
            ))
        })?;
    let mut config = runtime::nodes::NodeConfig {
        nodes,
        rank,
        rendezvous,
        timeout_s: args.rendezvous_timeout,
        secret: None,
    };
    config.check().map_err(CliError::Invalid)?;
    let file = args.rendezvous_secret_file.as_ref().ok_or_else(|| {
        CliError::Invalid(format!(
            "--nodes {nodes} needs --rendezvous-secret-file FILE (or {SECRET_VARIABLE}): the run's secret, which authenticates the link between the nodes; {}",
            runtime::nodes::MAKE_SECRET
        ))
    })?;
    config.secret = Some(
        runtime::nodes::Secret::read(file)
            .map_err(|e| CliError::Invalid(format!("--rendezvous-secret-file {e}")))?,
    );
    Ok(Some(config))
}

/// The variable naming the secret file where `--rendezvous-secret-file` is not given.
pub const SECRET_VARIABLE: &str = "DFLASH_RENDEZVOUS_SECRET_FILE";

/// `--nodes`, `--node-rank` and `--rendezvous` from Slurm's or torchrun's environment (read
/// through `get`) where not given; each filled option counts as given. `--rendezvous-secret-file`
/// from [`SECRET_VARIABLE`] where not given. A variable read that is not UTF-8 text, or not of
/// its form, is refused, naming it (its value clipped).
pub fn nodes_from_env(
    args: &mut LaunchArgs,
    get: impl Fn(&str) -> Option<OsString>,
) -> Result<(), CliError> {
    use crate::format::clip;
    if args.rendezvous_secret_file.is_none() {
        args.rendezvous_secret_file = get(SECRET_VARIABLE)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
    }
    let text = |name: &str| -> Result<Option<String>, CliError> {
        get(name)
            .map(|v| {
                v.into_string().map_err(|v| {
                    CliError::Invalid(format!(
                        "{name}={:?} is not UTF-8 text",
                        clip(&v.to_string_lossy(), 80)
                    ))
                })
            })
            .transpose()
    };
    let number = |name: &str| -> Result<Option<u32>, CliError> {
        text(name)?
            .map(|v| {
                v.trim().parse::<u32>().map_err(|_| {
                    CliError::Invalid(format!("{name}={:?} is not a whole number", clip(&v, 80)))
                })
            })
            .transpose()
    };
    let (nodes, rank, rendezvous) = if let Some(n) = number("SLURM_NNODES")? {
        let host = text("SLURM_JOB_NODELIST")?
            .map(|list| {
                runtime::nodes::first_slurm_host(&list).ok_or_else(|| {
                    CliError::Invalid(format!(
                        "SLURM_JOB_NODELIST={:?} names no host",
                        clip(&list, 80)
                    ))
                })
            })
            .transpose()?;
        (
            Some(n),
            number("SLURM_NODEID")?,
            host.map(|h| (format!("{h}:29400"), "SLURM_JOB_NODELIST")),
        )
    } else if let (Some(world), Some(local)) = (number("WORLD_SIZE")?, number("LOCAL_WORLD_SIZE")?)
    {
        if local == 0 || world % local != 0 {
            return Err(CliError::Invalid(format!(
                "WORLD_SIZE={world} is not a whole number of LOCAL_WORLD_SIZE={local} nodes"
            )));
        }
        if let Some(local_rank) = number("LOCAL_RANK")?.filter(|&r| r > 0) {
            return Err(CliError::Invalid(format!(
                "LOCAL_RANK={local_rank}: torchrun started {local} processes on this node, and dflash-orch runs once per node (it starts a worker per GPU itself): pass --nproc-per-node 1"
            )));
        }
        let addr = match (text("MASTER_ADDR")?, text("MASTER_PORT")?) {
            (Some(a), Some(p)) => Some((format!("{a}:{p}"), "MASTER_ADDR:MASTER_PORT")),
            _ => None,
        };
        (Some(world / local), number("GROUP_RANK")?, addr)
    } else {
        return Ok(());
    };
    if args.nodes.is_none() && nodes.is_some_and(|n| n > 1) {
        args.nodes = nodes;
        args.given.push("nodes".into());
    }
    if args.node_rank.is_none() && args.nodes.is_some() && rank.is_some() {
        args.node_rank = rank;
        args.given.push("node-rank".into());
    }
    if let Some((rendezvous, from)) = rendezvous
        && args.rendezvous.is_none()
        && args.nodes.is_some()
    {
        runtime::nodes::parse_rendezvous(&rendezvous)
            .map_err(|e| CliError::Invalid(format!("the rendezvous from {from}: {e}")))?;
        args.rendezvous = Some(rendezvous);
        args.given.push("rendezvous".into());
    }
    Ok(())
}

pub fn run(mut args: LaunchArgs) -> Result<(), CliError> {
    nodes_from_env(&mut args, |name| std::env::var_os(name))?;
    // The workers' Python sides run in directories of their own, never the caller's: paths
    // under the run directory reach them whole.
    args.run_dir = std::path::absolute(&args.run_dir)
        .map_err(|e| CliError::Invalid(format!("--run-dir {}: {e}", args.run_dir.display())))?;
    if args.dry_run {
        return dry_run(&args);
    }
    let (config, changes) = session_config(&args)?;
    launch_with(config, changes, &args)
}

/// The run's options for this session, as a launch and its dry run both take them: from the
/// arguments, or on resume from the journal with the options that may change applied.
fn session_config(
    args: &LaunchArgs,
) -> Result<(RunConfig, serde_json::Map<String, serde_json::Value>), CliError> {
    Ok(if args.resume {
        runtime::run_lock::check_not_live(&args.run_dir).map_err(run_error)?;
        let stored = runtime::resume::stored_config(&args.run_dir).map_err(run_error)?;
        let session = config_from_args(args, Some(&stored))?;
        let given = runtime::resume::given_values(&args.given, &session);
        let (mut config, changes) =
            runtime::resume::merge(stored, &given, &session).map_err(CliError::Invalid)?;
        // The secret is never journaled: this session's.
        if let (Some(run), Some(now)) = (config.nodes.as_mut(), session.nodes.as_ref()) {
            run.secret.clone_from(&now.secret);
        }
        if args.given.iter().any(|g| g == "eval-every") && config.eval.is_none() {
            return Err(CliError::Invalid(
                "--eval-every on --resume of a run planned without it needs --eval-prompts FILE \
                 (holding samples of the store out would change the run's plans)"
                    .into(),
            ));
        }
        (config, changes.into_iter().collect())
    } else {
        (config_from_args(args, None)?, Default::default())
    })
}

fn launch_with(
    config: RunConfig,
    changes: serde_json::Map<String, serde_json::Value>,
    args: &LaunchArgs,
) -> Result<(), CliError> {
    let line = |what: &str, s: &runtime::Summary| {
        eprintln!(
            "run {what}: {} steps committed in total, {} tokens this session in {:.1} s ({:.0} tokens/s), {} worker restarts; journal {}",
            s.steps,
            s.tokens,
            s.seconds,
            s.tokens as f64 / s.seconds.max(1e-9),
            s.restarts,
            dflash_common::run_dir::journal(&args.run_dir).display()
        )
    };
    match runtime::launch(config, &args.run_dir, args.resume, changes) {
        Ok((Outcome::Completed, s)) => {
            line("completed", &s);
            Ok(())
        }
        Ok((Outcome::Stopped, s)) => {
            line("stopped (continue with --resume)", &s);
            Ok(())
        }
        Ok((Outcome::Interrupted, _)) => Err(CliError::Interrupted(format!(
            "run stopped; continue with `dflash-orch launch --resume --run-dir {}`",
            args.run_dir.display()
        ))),
        Err(e) => Err(run_error(e)),
    }
}

fn run_error(e: RunError) -> CliError {
    match e {
        RunError::Invalid(e) => CliError::Invalid(e),
        RunError::Failed(e) => CliError::Failed(format!("run failed: {e}")),
    }
}

fn dry_run(args: &LaunchArgs) -> Result<(), CliError> {
    // The same options and the same checks as a launch: what it would refuse, this refuses
    // with the same message.
    let refused = |e: CliError| {
        CliError::Failed(format!(
            "a launch would be refused: {}",
            e.to_string().trim_start_matches("run failed: ")
        ))
    };
    let (config, _) = session_config(args).map_err(refused)?;
    let gpu_memory = args.gpu_memory.map(|g| (g * f64::from(1u32 << 30)) as u64);
    let checked = runtime::dry_run::validate(&config, &args.run_dir, args.resume, gpu_memory)
        .err()
        .map(|e| run_error(e).to_string());
    let mut found = match runtime::dry_run::dry_run(&config, gpu_memory) {
        Ok(found) => found,
        Err(e) => {
            return Err(refused(
                checked.map_or_else(|| run_error(e), CliError::Invalid),
            ));
        }
    };
    if let Some(why) = checked
        && !found.refusals.contains(&why)
    {
        found.refusals.insert(0, why);
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&found).map_err(|e| CliError::Failed(e.to_string()))?
        );
    } else {
        print!("{}", dry_run_text(&found));
    }
    match found.refusals.is_empty() {
        true => Ok(()),
        false => Err(CliError::Failed(format!(
            "a launch would be refused: {}",
            found.refusals.join("; ")
        ))),
    }
}

/// The dry run as a table.
fn dry_run_text(d: &runtime::dry_run::DryRun) -> String {
    use crate::format::gib;
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "workers: {}\ntopology {}\nbatches of at most {} tokens, sequences of at most {}",
        d.workers.join(", "),
        d.topology.describe(),
        d.token_budget,
        d.max_len
    );
    if let Some(p) = &d.plan {
        let _ = writeln!(
            out,
            "dtype {}, features {}, anchor chunk {}, torch target {}, torch drafter {}\n",
            d.dtype.as_deref().unwrap_or("-"),
            d.feature_dtype.as_deref().unwrap_or("-"),
            p.anchor_chunk
                .map_or_else(|| "none (all anchors at once)".into(), |c| c.to_string()),
            if d.target_packing == Some(true) {
                "in packed rows"
            } else {
                "in rows of one length"
            },
            if d.drafter_compile == Some(true) {
                "compiled"
            } else {
                "eager"
            }
        );
        // CPU workers: their resident memory also holds the ring pages they touch.
        let cpu = d.workers.iter().any(|w| w.contains("cpu:"));
        let _ = writeln!(
            out,
            "{:<16} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}{}",
            "worker",
            "weights",
            "activations",
            "attention",
            "features",
            "optimiser",
            "peak",
            if cpu { "  resident (CPU)" } else { "" }
        );
        let eval = p
            .eval
            .as_ref()
            .map(|e| (e, e.total.saturating_add(16 << 20)));
        for (w, host) in [(&p.target, p.target_host), (&p.drafter, p.drafter_host)]
            .into_iter()
            .chain(eval)
        {
            let _ = writeln!(
                out,
                "{:<16} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}{}",
                format!("{} ({})", w.role, w.engine),
                gib(w.weights),
                gib(w.activations),
                gib(w.attention),
                gib(w.features),
                gib(w.optimiser),
                gib(w.total),
                if cpu {
                    format!("  {:>14}", gib(host))
                } else {
                    String::new()
                }
            );
        }
        out.push('\n');
    }
    for u in &d.gpus {
        let _ = writeln!(
            out,
            "GPU {}: {} need {} of {}",
            u.gpu,
            u.workers.join(" + "),
            gib(u.need),
            u.total.map_or_else(|| "unknown".into(), gib)
        );
    }
    let _ = writeln!(
        out,
        "/dev/shm: the rings need {} ({} free)",
        gib(d.shm_bytes),
        d.shm_free.map_or_else(|| "unknown".into(), gib)
    );
    for n in &d.notes {
        let _ = writeln!(out, "note: {n}");
    }
    if d.refusals.is_empty() {
        let _ = writeln!(out, "a launch would start");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> LaunchArgs {
        let line = [&["dflash-orch", "launch", "--run-dir", "r"][..], extra].concat();
        match crate::cli::parse(line).unwrap().command {
            crate::cli::Command::Launch(a) => *a,
            _ => unreachable!("a launch line"),
        }
    }

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(*v))
        }
    }

    /// Slurm's and torchrun's variables fill in what the command line leaves out (and count as
    /// given); the command line wins; bad values are refused naming the variable.
    #[test]
    fn the_nodes_come_from_slurm_or_torchrun_when_not_given() {
        let mut a = args(&[]);
        let slurm = [
            ("SLURM_NNODES", "4"),
            ("SLURM_NODEID", "2"),
            ("SLURM_JOB_NODELIST", "gpu[07-10]"),
        ];
        nodes_from_env(&mut a, env(&slurm)).unwrap();
        assert_eq!((a.nodes, a.node_rank), (Some(4), Some(2)));
        assert_eq!(a.rendezvous.as_deref(), Some("gpu07:29400"));
        assert!(a.given.iter().any(|g| g == "rendezvous"));

        let mut a = args(&["--node-rank", "1", "--rendezvous", "h:5"]);
        nodes_from_env(&mut a, env(&slurm)).unwrap();
        assert_eq!(
            (a.node_rank, a.rendezvous.as_deref()),
            (Some(1), Some("h:5"))
        );

        let mut a = args(&[]);
        let torchrun = [
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        nodes_from_env(&mut a, env(&torchrun)).unwrap();
        assert_eq!((a.nodes, a.node_rank), (Some(2), Some(1)));
        assert_eq!(a.rendezvous.as_deref(), Some("10.0.0.1:29500"));

        // One node under Slurm is a run of one node.
        let mut a = args(&[]);
        nodes_from_env(&mut a, env(&[("SLURM_NNODES", "1"), ("SLURM_NODEID", "0")])).unwrap();
        assert_eq!(a.nodes, None);

        for (bad, says) in [
            (
                &[("SLURM_NNODES", "two")][..],
                "SLURM_NNODES=\"two\" is not a whole number",
            ),
            (
                &[("SLURM_NNODES", "2"), ("SLURM_JOB_NODELIST", "n[")][..],
                "names no host",
            ),
            (
                &[("WORLD_SIZE", "6"), ("LOCAL_WORLD_SIZE", "4")][..],
                "not a whole number of LOCAL_WORLD_SIZE",
            ),
            (
                &[
                    ("WORLD_SIZE", "8"),
                    ("LOCAL_WORLD_SIZE", "4"),
                    ("LOCAL_RANK", "3"),
                ][..],
                "LOCAL_RANK=3: torchrun started 4 processes on this node",
            ),
            (
                &[
                    ("WORLD_SIZE", "8"),
                    ("LOCAL_WORLD_SIZE", "4"),
                    ("MASTER_ADDR", "a b"),
                    ("MASTER_PORT", "1"),
                ][..],
                "the rendezvous from MASTER_ADDR:MASTER_PORT: \"a b:1\" is not HOST:PORT",
            ),
        ] {
            let mut a = args(&[]);
            let e = nodes_from_env(&mut a, env(bad)).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }

        // A 10 KB junk node list is refused in a short line, naming it.
        let junk = format!("n[{}", "x".repeat(10_000));
        let mut a = args(&[]);
        let e = nodes_from_env(
            &mut a,
            env(&[("SLURM_NNODES", "2"), ("SLURM_JOB_NODELIST", &junk)]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("SLURM_JOB_NODELIST=") && e.len() < 200, "{e}");

        // The secret file comes from its variable; the command line wins.
        let mut a = args(&[]);
        nodes_from_env(&mut a, env(&[("DFLASH_RENDEZVOUS_SECRET_FILE", "/s")])).unwrap();
        assert_eq!(
            a.rendezvous_secret_file.as_deref(),
            Some(std::path::Path::new("/s"))
        );
        let mut a = args(&["--rendezvous-secret-file", "/mine"]);
        nodes_from_env(&mut a, env(&[("DFLASH_RENDEZVOUS_SECRET_FILE", "/s")])).unwrap();
        assert_eq!(
            a.rendezvous_secret_file.as_deref(),
            Some(std::path::Path::new("/mine"))
        );
    }

    /// A variable of Slurm's or torchrun's that is not UTF-8 is refused, naming it, not taken
    /// for absent (which would train on one node).
    #[test]
    fn non_utf8_node_variables_are_refused() {
        use std::os::unix::ffi::OsStringExt;
        for (name, with) in [
            ("SLURM_NNODES", &[][..]),
            ("SLURM_NODEID", &[("SLURM_NNODES", "2")][..]),
            ("SLURM_JOB_NODELIST", &[("SLURM_NNODES", "2")][..]),
            ("WORLD_SIZE", &[("LOCAL_WORLD_SIZE", "1")][..]),
            (
                "MASTER_ADDR",
                &[
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_WORLD_SIZE", "1"),
                    ("MASTER_PORT", "1"),
                ][..],
            ),
        ] {
            let get = |n: &str| {
                if n == name {
                    Some(OsString::from_vec(b"2\xff".to_vec()))
                } else {
                    env(with)(n)
                }
            };
            let mut a = args(&[]);
            let e = nodes_from_env(&mut a, get).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{name}=\"2\u{fffd}\" is not UTF-8 text")),
                "{e}"
            );
        }
    }

    /// Several nodes need the run's secret: without one the launch is refused naming the option
    /// (before anything is read or created); a bad secret file is refused naming it and why.
    #[test]
    fn several_nodes_need_a_secret() {
        use std::os::unix::fs::PermissionsExt;
        let nodes = [
            "--gpus",
            "cpu:2",
            "--synthetic",
            "10",
            "--nodes",
            "2",
            "--node-rank",
            "1",
            "--rendezvous",
            "h:1",
        ];
        let e = config_from_args(&args(&nodes), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "--nodes 2 needs --rendezvous-secret-file FILE (or DFLASH_RENDEZVOUS_SECRET_FILE)"
            ) && e.contains("head -c 32 /dev/urandom"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, [1u8; 32]).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let with = |f: &std::path::Path| {
            let mut a = args(&nodes);
            a.rendezvous_secret_file = Some(f.to_path_buf());
            config_from_args(&a, None)
        };
        let e = with(&file).unwrap_err().to_string();
        assert!(
            e.starts_with("--rendezvous-secret-file ") && e.contains("has mode 0644"),
            "{e}"
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let config = with(&file).unwrap();
        let n = config.nodes.unwrap();
        assert!(n.secret.is_some());
        // Never journaled.
        let journaled = serde_json::to_string(&n).unwrap();
        assert!(!journaled.contains("secret"), "{journaled}");
    }

    /// `--node-rank` past `--nodes`, and a run of several nodes without its rendezvous, are
    /// refused naming the option.
    #[test]
    fn bad_node_options_are_refused_naming_them() {
        let base = ["--gpus", "cpu:2", "--synthetic", "10"];
        for (extra, says) in [
            (
                &["--nodes", "2", "--node-rank", "2", "--rendezvous", "h:1"][..],
                "--node-rank 2 is not a node of --nodes 2",
            ),
            (
                &["--nodes", "2", "--node-rank", "0"][..],
                "needs --rendezvous",
            ),
            (
                &["--nodes", "2", "--rendezvous", "h:1"][..],
                "needs --node-rank",
            ),
            (&["--node-rank", "1"][..], "a run of one node"),
            (
                &["--nodes", "2", "--node-rank", "0", "--rendezvous", "h"][..],
                "--rendezvous \"h\" is not HOST:PORT",
            ),
        ] {
            let a = args(&[&base[..], extra].concat());
            let e = config_from_args(&a, None).unwrap_err().to_string();
            assert!(e.contains(says), "{extra:?}: {e}");
        }
    }
}
