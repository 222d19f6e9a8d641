//! The DFlash stage's settings (chosen at launch, kept in the journal, handed to every worker),
//! and what both sides read of a target model directory: its `config.json` and where its weights
//! are. The deeper checks of the weights, made before a run starts, are the orchestrator's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Everything the DFlash workers need to know about the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DflashSettings {
    /// The target's Hugging Face directory.
    pub target_model: PathBuf,
    /// Target layers whose outputs feed the drafter (layer id k is hidden state k + 1).
    pub target_layer_ids: Vec<usize>,
    pub draft_layers: usize,
    pub block_size: usize,
    /// Blocks per sequence (fewer where the sequence has fewer loss positions).
    pub num_anchors: usize,
    pub mask_token_id: u32,
    pub lr: f64,
    pub warmup_ratio: f64,
    pub clip: f64,
    /// Loss decay over block positions, `exp(-(k - 1) / gamma)`; none: uniform.
    pub gamma: Option<f64>,
    /// The training loss: cross-entropy on the data's next tokens, distillation of the target's
    /// next-token distribution at each block position, or a mix of both.
    #[serde(default)]
    pub loss: LossKind,
    /// Softmax temperature of the distillation (both distributions).
    #[serde(default = "default_kd_temperature")]
    pub kd_temperature: f64,
    /// Share of distillation in the `mix` loss (the rest is cross-entropy).
    #[serde(default = "default_kd_weight")]
    pub kd_weight: f64,
    /// The `dpace` loss's smoothing α of the drafter's probabilities, `(1 - α)·q + α`.
    #[serde(default = "default_dpace_alpha")]
    pub dpace_alpha: f64,
    /// The drafter's architecture: DFlash, or DFlash2 (convolutions around every sublayer and a
    /// candidate selector), whose sizes and selector training are `dflash2`.
    #[serde(default)]
    pub drafter_arch: DrafterArch,
    /// DFlash2's sizes and its selector's training; read only with `drafter_arch: dflash2`.
    #[serde(default)]
    pub dflash2: Dflash2Settings,
    /// Every drafter layer attends within this window (`sliding_attention` layers): a block
    /// position sees the context and block keys less than this many positions from it. None:
    /// full attention.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    pub weight_decay: f64,
    /// Seed of the drafter's initial weights and of every step's anchors.
    pub seed: u64,
    /// Checkpoint every this many optimiser steps (and at the end).
    pub save_every: u64,
    pub keep_checkpoints: usize,
    /// Optimiser steps of the whole run (the schedule's length), computed from the plans.
    pub total_steps: u64,
    /// The largest batch in tokens (sizes the feature slots).
    pub token_budget: u64,
    pub checkpoint_dir: PathBuf,
    /// The target's weights and activations (and the drafter's compute; its master weights and
    /// AdamW moments stay f32).
    #[serde(default)]
    pub dtype: Precision,
    /// The features' element type in the feature ring.
    #[serde(default)]
    pub feature_dtype: Precision,
    /// Anchors of a sequence whose blocks are computed (and back-propagated) together; the
    /// gradients of the chunks are summed. None: all anchors at once.
    #[serde(default)]
    pub anchor_chunk: Option<usize>,
    /// The torch target runs each micro-batch as packed rows (sequences back to back, positions
    /// restarting, one variable-length attention kernel on a GPU) instead of rows of one length.
    /// Off in runs from before it existed.
    #[serde(default)]
    pub target_packing: bool,
    /// The torch drafter compiles its elementwise chains (RMSNorm, rotary embedding, SiLU
    /// gating, the loss's softmax gradient) with `torch.compile`. Off in runs from before it
    /// existed.
    #[serde(default)]
    pub drafter_compile: bool,
    /// What a NaN or infinity in the features, the loss or the gradients does: stop the run
    /// (naming where it appeared), or skip that optimiser step (journalled and counted).
    #[serde(default)]
    pub on_nonfinite: NonFinite,
    /// The drafter also checkpoints every this many steps, for the run's served-acceptance
    /// evaluations (`--eval-every`).
    #[serde(default)]
    pub eval_every: Option<u64>,
    /// The run fingerprint: for each thing that decides the trained weights (`target`,
    /// `target_weights`, `data`, `planner`, `seed`, `optimiser`, `drafter`, `loss`, `precision`,
    /// `engine`, `epochs`), a hex hash of it. Written into every checkpoint's `state.json`; a
    /// drafter refuses a checkpoint whose fingerprint differs, naming the fields that differ.
    #[serde(default)]
    pub fingerprint: BTreeMap<String, String>,
    /// The engine of each role (runs from before engines existed: candle for both).
    #[serde(default)]
    pub engines: Engines,
    /// How the torch engine's compute child is started, when a role uses it.
    #[serde(default)]
    pub torch: Option<TorchRuntime>,
    /// `--engine auto` on GPU workers, not decided yet: the launch's checks decide (they probe
    /// the Python) before anything is written. Never written itself.
    #[serde(skip)]
    pub engine_auto: bool,
    /// `--anchor-chunk auto`: `anchor_chunk` was sized for the engines known then, and is sized
    /// again if `--engine auto` chooses another drafter engine. Never written itself.
    #[serde(skip)]
    pub anchor_chunk_auto: bool,
}

/// What computes a stage: candle (Rust, embedded) or torch (PyTorch and `transformers`, in a
/// Python child of the worker).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    #[default]
    Candle,
    Torch,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Candle => "candle",
            Engine::Torch => "torch",
        }
    }
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "candle" => Ok(Engine::Candle),
            "torch" => Ok(Engine::Torch),
            other => Err(format!(
                "{other:?} is not an engine (expected candle or torch)"
            )),
        }
    }
}

/// The engine of each role of a run. Written as `--engine` takes it: `candle`, `torch`, or
/// `target=E,drafter=E`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Engines {
    pub target: Engine,
    pub drafter: Engine,
}

impl Engines {
    pub fn both(engine: Engine) -> Self {
        Self {
            target: engine,
            drafter: engine,
        }
    }

    pub fn uses(self, engine: Engine) -> bool {
        self.target == engine || self.drafter == engine
    }
}

impl std::fmt::Display for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.target == self.drafter {
            f.write_str(self.target.name())
        } else {
            write!(
                f,
                "target={},drafter={}",
                self.target.name(),
                self.drafter.name()
            )
        }
    }
}

impl From<Engines> for String {
    fn from(e: Engines) -> String {
        e.to_string()
    }
}

impl TryFrom<String> for Engines {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl std::str::FromStr for Engines {
    type Err = String;

    /// `candle`, `torch`, or `target=E,drafter=E` (either order, both named).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if !s.contains('=') {
            return s.parse::<Engine>().map(Engines::both);
        }
        let (mut target, mut drafter) = (None, None);
        for part in s.split(',') {
            let (role, engine) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not ROLE=ENGINE (e.g. target=torch)"))?;
            let slot = match role.trim() {
                "target" => &mut target,
                "drafter" => &mut drafter,
                other => {
                    return Err(format!(
                        "{other:?} is not a role (expected target or drafter)"
                    ));
                }
            };
            if slot.is_some() {
                return Err(format!("{:?} is named twice", role.trim()));
            }
            *slot = Some(engine.parse::<Engine>()?);
        }
        match (target, drafter) {
            (Some(target), Some(drafter)) => Ok(Engines { target, drafter }),
            _ => Err(format!(
                "{s:?} names one role: give both, e.g. target=torch,drafter=candle"
            )),
        }
    }
}

/// The Python the torch engine's children run in (`dflash_orch.serve` under a worker,
/// `dflash_orch.decode` under `eval` and `generate`, the pre-flight), and where our package is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchRuntime {
    /// The interpreter.
    pub python: PathBuf,
    /// A directory put first on `PYTHONPATH` (the tree's `python/`), when the package is not
    /// installed in the interpreter.
    #[serde(default)]
    pub package_dir: Option<PathBuf>,
}

impl TorchRuntime {
    /// A command running `python -c BOOTSTRAP module` in `cwd`: imports only from the
    /// interpreter's paths, the package directory and the caller's `PYTHONPATH` entries that no
    /// other user can write (see [`crate::python`]); what was left out comes back to be said.
    pub fn module_command(
        &self,
        module: &str,
        cwd: &Path,
    ) -> (std::process::Command, Vec<crate::python::Dropped>) {
        crate::python::module_command(&self.python, self.package_dir.as_deref(), module, cwd)
    }
}

fn default_kd_temperature() -> f64 {
    0.1
}

fn default_kd_weight() -> f64 {
    0.5
}

fn default_dpace_alpha() -> f64 {
    0.5
}

/// `--loss`: what the drafter learns from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    /// Cross-entropy against the data's next tokens.
    #[default]
    Ce,
    /// Distillation: cross-entropy against the target's next-token distribution.
    Kd,
    /// `kd_weight` of distillation, the rest cross-entropy.
    Mix,
    /// Cross-entropy on the data's next tokens, each block position weighted by the detached
    /// probability that the drafter's block survives up to it and past it (D-PACE): see
    /// [`dpace_weights`].
    Dpace,
    /// Distillation (as `kd`), each block position weighted by D-PACE: the weights come from
    /// the drafter's detached probabilities of the data's tokens, as in `dpace`, and weigh the
    /// distillation's cross-entropy against the target's distribution.
    #[serde(rename = "kd-dpace")]
    KdDpace,
}

impl LossKind {
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Ce => "ce",
            LossKind::Kd => "kd",
            LossKind::Mix => "mix",
            LossKind::Dpace => "dpace",
            LossKind::KdDpace => "kd-dpace",
        }
    }
}

impl std::str::FromStr for LossKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "ce" => Ok(LossKind::Ce),
            "kd" => Ok(LossKind::Kd),
            "mix" => Ok(LossKind::Mix),
            "dpace" => Ok(LossKind::Dpace),
            "kd-dpace" => Ok(LossKind::KdDpace),
            other => Err(format!("{other:?} is not ce, kd, mix, dpace or kd-dpace")),
        }
    }
}

/// `--drafter-arch`: what the drafter is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DrafterArch {
    /// DFlash: Qwen3 decoder layers over the target's features, the target's head.
    #[default]
    Dflash,
    /// DFlash2: DFlash with a grouped dynamic causal convolution before and after each
    /// attention and MLP sublayer, and a candidate selector that rescores the head's top-K
    /// tokens at each block position against the token before it (the official package's
    /// `DFlash2DraftModel`).
    Dflash2,
}

impl DrafterArch {
    pub fn name(self) -> &'static str {
        match self {
            DrafterArch::Dflash => "dflash",
            DrafterArch::Dflash2 => "dflash2",
        }
    }
}

impl std::str::FromStr for DrafterArch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "dflash" => Ok(DrafterArch::Dflash),
            "dflash2" => Ok(DrafterArch::Dflash2),
            other => Err(format!("{other:?} is not dflash or dflash2")),
        }
    }
}

/// DFlash2's sizes (the checkpoint's `dflash_config` names) and how its selector trains.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dflash2Settings {
    /// Taps of each convolution (the current position and the ones before it in the block).
    pub conv_kernel_size: usize,
    /// Channels sharing one dynamic kernel tap; divides the hidden size.
    pub conv_group_size: usize,
    /// Candidates the selector rescores at each block position: the head's top K.
    pub selector_top_k: usize,
    /// Width of the selector's codebooks and hidden projection.
    pub selector_rank: usize,
    /// Weight of the selector's loss beside the drafter's own, per block position.
    pub selector_loss_weight: f64,
    /// The selector's loss trains the selector's weights only (the head's logits and the final
    /// hidden states it reads are detached); otherwise it trains the whole drafter.
    pub selector_stop_gradient: bool,
}

impl Default for Dflash2Settings {
    /// The published DFlash2 drafters' sizes; the selector's loss at weight 1 into the whole
    /// drafter.
    fn default() -> Self {
        Self {
            conv_kernel_size: 2,
            conv_group_size: 16,
            selector_top_k: 16,
            selector_rank: 256,
            selector_loss_weight: 1.0,
            selector_stop_gradient: false,
        }
    }
}

/// D-PACE's weights of `blocks` blocks of `block` positions (row-major, as the loss lays them
/// out): `q` is the drafter's probability of each position's label and `counted` whether the
/// position counts in the loss. Per block, the smoothed `q̃ = (1 - α)·q + α` of the counted
/// positions (1 elsewhere, so an uncounted position does not break the chain) make the prefix
/// products `C_k = q̃_1 ⋯ q̃_k`, and a counted position weighs the suffix sum `C_k + … + C_last`
/// over the counted positions from it on: the expected number of drafted tokens its being right
/// keeps alive. Uncounted positions weigh 0. The weights are constants of the step (no gradient
/// flows through them). Computed in f64.
pub fn dpace_weights(q: &[f64], counted: &[bool], block: usize, alpha: f64) -> Vec<f64> {
    let mut out = vec![0.0; q.len()];
    if block == 0 {
        return out;
    }
    for (b, (qs, cs)) in q.chunks(block).zip(counted.chunks(block)).enumerate() {
        let mut prefix = Vec::with_capacity(qs.len());
        let mut c = 1.0;
        for (&qk, &on) in qs.iter().zip(cs) {
            if on {
                c *= (1.0 - alpha) * qk + alpha;
            }
            prefix.push(c);
        }
        let mut suffix = 0.0;
        for k in (0..qs.len()).rev() {
            if cs[k] {
                suffix += prefix[k];
                out[b * block + k] = suffix;
            }
        }
    }
    out
}

/// The published DFlash recipe's loss decay for a block size: γ = 7 for blocks of 16, 4 for
/// blocks of 8; other sizes, half the block.
pub fn default_gamma(block_size: usize) -> f64 {
    match block_size {
        16 => 7.0,
        8 => 4.0,
        b => (b as f64 / 2.0).max(1.0),
    }
}

/// `--on-nonfinite`: what a NaN or infinity does to the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NonFinite {
    /// The run stops with where the value appeared.
    #[default]
    Stop,
    /// The optimiser step it would have poisoned is skipped (journalled and counted).
    Skip,
}

impl NonFinite {
    pub fn name(self) -> &'static str {
        match self {
            NonFinite::Stop => "stop",
            NonFinite::Skip => "skip",
        }
    }
}

impl std::str::FromStr for NonFinite {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "stop" => Ok(NonFinite::Stop),
            "skip" => Ok(NonFinite::Skip),
            other => Err(format!("{other:?} is not stop or skip")),
        }
    }
}

/// An element type of weights, activations or features.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

impl Precision {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(format!("{s:?} is not a dtype (expected f32 or bf16)")),
        }
    }
}

/// Where a drafter worker stands among the run's data-parallel drafters, from the environment
/// the orchestrator gives it ([`DrafterRank::ENV`]); one drafter when none is set.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterRank {
    pub rank: u32,
    pub ranks: u32,
    /// The process group's rendezvous, with more than one rank: `file:PATH`, a FileStore of
    /// one node's run, or `HOST:PORT` of node 0 with several nodes.
    pub rendezvous: Option<String>,
    /// How long forming the group and each collective may take, in seconds.
    pub timeout_s: f64,
    /// This rank writes its node's checkpoints: the first rank of each node (every rank holds
    /// the same weights), so that every node's run directory can resume on its own.
    pub writes_checkpoints: bool,
    /// The checkpoint step to start from, agreed by every node of a run of several (0: fresh
    /// weights); `None`: the latest checkpoint.
    pub resume_step: Option<u64>,
}

impl DrafterRank {
    /// The variables: rank, ranks, rendezvous, timeout.
    pub const ENV: [&'static str; 4] = [
        "DFLASH_DRAFTER_RANK",
        "DFLASH_DRAFTER_RANKS",
        "DFLASH_DRAFTER_RENDEZVOUS",
        "DFLASH_DRAFTER_TIMEOUT_S",
    ];
    /// With several nodes: the rank's place on its node (the first writes its checkpoints) and
    /// the checkpoint step every node starts from.
    pub const NODE_ENV: [&'static str; 2] =
        ["DFLASH_DRAFTER_LOCAL_RANK", "DFLASH_DRAFTER_RESUME_STEP"];
    /// The timeout when none is given.
    pub const DEFAULT_TIMEOUT_S: f64 = 120.0;

    pub fn single() -> Self {
        Self {
            rank: 0,
            ranks: 1,
            rendezvous: None,
            timeout_s: Self::DEFAULT_TIMEOUT_S,
            writes_checkpoints: true,
            resume_step: None,
        }
    }

    /// Reads the variables through `get`; a malformed or inconsistent value is an error naming it.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let [rank_var, ranks_var, rendezvous_var, timeout_var] = Self::ENV;
        let number = |name: &str| -> Result<Option<u32>, String> {
            get(name)
                .map(|v| {
                    v.trim()
                        .parse::<u32>()
                        .map_err(|_| format!("{name}={v:?} is not a whole number"))
                })
                .transpose()
        };
        let (Some(rank), Some(ranks)) = (number(rank_var)?, number(ranks_var)?) else {
            if get(rank_var).is_some() || get(ranks_var).is_some() {
                return Err(format!("{rank_var} and {ranks_var} go together"));
            }
            return Ok(Self::single());
        };
        if ranks == 0 || rank >= ranks {
            return Err(format!(
                "{rank_var}={rank} is not a rank of {ranks_var}={ranks} drafters"
            ));
        }
        let rendezvous = get(rendezvous_var);
        if let Some(r) = &rendezvous {
            let ok = match r.strip_prefix("file:") {
                Some(path) => Path::new(path).is_absolute(),
                None => r
                    .rsplit_once(':')
                    .and_then(|(host, port)| {
                        (!host.is_empty()).then_some(())?;
                        port.parse::<u16>().ok().filter(|&p| p > 0)
                    })
                    .is_some(),
            };
            if !ok {
                return Err(format!(
                    "{rendezvous_var}={:?} is not HOST:PORT or file:ABSOLUTE-PATH",
                    crate::python::clip(r, 200)
                ));
            }
        } else if ranks > 1 {
            return Err(format!(
                "{ranks_var}={ranks} drafters need {rendezvous_var} (HOST:PORT or file:PATH)"
            ));
        }
        let timeout_s = match get(timeout_var) {
            None => Self::DEFAULT_TIMEOUT_S,
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|t| t.is_finite() && *t > 0.0)
                .ok_or_else(|| {
                    format!("{timeout_var}={v:?} is not a positive number of seconds")
                })?,
        };
        let [local_var, resume_var] = Self::NODE_ENV;
        let local = number(local_var)?;
        if local.is_some_and(|l| l > rank) {
            return Err(format!(
                "{local_var}={} is past {rank_var}={rank} (a rank's place on its node)",
                local.unwrap_or_default()
            ));
        }
        let resume_step = get(resume_var)
            .map(|v| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| format!("{resume_var}={v:?} is not a whole number"))
            })
            .transpose()?;
        Ok(Self {
            rank,
            ranks,
            rendezvous,
            timeout_s,
            writes_checkpoints: local.unwrap_or(rank) == 0,
            resume_step,
        })
    }
}

/// Fingerprint fields added after checkpoints first carried a fingerprint, each with what it
/// covers. A checkpoint written before a field existed lacks it: that field cannot be checked
/// against it, and only that absence is forgiven (a field the checkpoint has must still match).
pub const FINGERPRINT_ADDED_LATER: &[(&str, &str)] = &[
    (
        "target_weights",
        "a sample of the target's weights themselves",
    ),
    ("engine", "the engines that computed it"),
];

/// How two run fingerprints compare.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FingerprintComparison {
    /// Fields that differ (missing on either side counts as different), in name order.
    pub differ: Vec<String>,
    /// Fields of [`FINGERPRINT_ADDED_LATER`] that `ours` has and an older `theirs` lacks.
    pub unchecked: Vec<String>,
}

/// Compares this run's fingerprint `ours` with a checkpoint's `theirs`.
pub fn compare_fingerprints(
    ours: &BTreeMap<String, String>,
    theirs: &BTreeMap<String, String>,
) -> FingerprintComparison {
    let mut names: Vec<&String> = ours.keys().chain(theirs.keys()).collect();
    names.sort();
    names.dedup();
    let mut out = FingerprintComparison::default();
    for name in names {
        let later = FINGERPRINT_ADDED_LATER.iter().any(|(n, _)| n == name);
        match (ours.get(name), theirs.get(name)) {
            (a, b) if a == b => {}
            (Some(_), None) if later => out.unchecked.push(name.clone()),
            _ => out.differ.push(name.clone()),
        }
    }
    out
}

/// `config.json` fields of a Qwen3 target.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Qwen3Config {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The longest sequence the model was made for (prompt and generated tokens together).
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
}

fn default_rope_theta() -> f64 {
    10_000.0
}

impl Qwen3Config {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The shape this config describes.
    pub fn shape(&self) -> Qwen3Shape {
        Qwen3Shape {
            vocab: self.vocab_size,
            hidden: self.hidden_size,
            intermediate: self.intermediate_size,
            layers: self.num_hidden_layers,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim(),
            rms_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
        }
    }
}

/// The shape of a stack of Qwen3 decoder layers: a target's (from its config.json), the tiny
/// target `init-tiny` writes, or a drafter's (the target's sizes, its own layer count).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Shape {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
}

impl Qwen3Shape {
    /// `(name, shape, is_norm)` of every tensor of a Qwen3 model of this shape with its first
    /// `layers` decoder layers, in a fixed order: the embedding, the layers, the final norm and
    /// the output head.
    pub fn tensors(&self, layers: usize) -> Vec<(String, Vec<usize>, bool)> {
        let mut t = vec![(
            "model.embed_tokens.weight".to_owned(),
            vec![self.vocab, self.hidden],
            false,
        )];
        for l in 0..layers.min(self.layers) {
            t.extend(
                self.layer_tensors()
                    .into_iter()
                    .map(|(name, shape, norm)| (format!("model.layers.{l}.{name}"), shape, norm)),
            );
        }
        let h = self.hidden;
        t.push(("model.norm.weight".to_owned(), vec![h], true));
        t.push(("lm_head.weight".to_owned(), vec![self.vocab, h], false));
        t
    }

    /// `(name within the layer, shape, is_norm)` of each tensor of one decoder layer, in a fixed
    /// order: a target's layers and a drafter's are made of the same tensors.
    pub fn layer_tensors(&self) -> [(&'static str, Vec<usize>, bool); 11] {
        let (h, hd, i) = (self.hidden, self.head_dim, self.intermediate);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        [
            ("input_layernorm.weight", vec![h], true),
            ("self_attn.q_proj.weight", vec![q, h], false),
            ("self_attn.k_proj.weight", vec![kv, h], false),
            ("self_attn.v_proj.weight", vec![kv, h], false),
            ("self_attn.o_proj.weight", vec![h, q], false),
            ("self_attn.q_norm.weight", vec![hd], true),
            ("self_attn.k_norm.weight", vec![hd], true),
            ("post_attention_layernorm.weight", vec![h], true),
            ("mlp.gate_proj.weight", vec![i, h], false),
            ("mlp.up_proj.weight", vec![i, h], false),
            ("mlp.down_proj.weight", vec![h, i], false),
        ]
    }
}

/// A model directory that cannot be used, with the file at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct ModelDirError {
    pub path: PathBuf,
    pub reason: String,
}

impl ModelDirError {
    pub fn new(path: &Path, reason: impl Into<String>) -> Self {
        ModelDirError {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

/// Reads and checks `config.json` of a Qwen3 model directory (what the candle engine runs).
pub fn read_config(dir: &Path) -> Result<Qwen3Config, ModelDirError> {
    read_config_for(dir, Engine::Candle)
}

/// Reads and checks `config.json` of a target for `engine`: a Qwen3 with plain RoPE for candle;
/// for torch any causal LM with the usual fields (`transformers` itself judges whether it loads
/// the architecture), its text config for a multimodal one, RoPE's base whatever its scaling
/// (the drafter computes plain RoPE of that base, as its own positions).
pub fn read_config_for(dir: &Path, engine: Engine) -> Result<Qwen3Config, ModelDirError> {
    let path = dir.join("config.json");
    let text =
        std::fs::read(&path).map_err(|e| ModelDirError::new(&path, format!("cannot read: {e}")))?;
    let mut raw: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| ModelDirError::new(&path, format!("not a model config: {e}")))?;
    let any = engine == Engine::Torch;
    if any
        && let Some(text) = raw.get("text_config").filter(|t| t.is_object()).cloned()
        && raw.get("hidden_size").is_none()
    {
        let architectures = raw.get("architectures").cloned();
        raw = text;
        if let Some(a) = architectures {
            raw["architectures"] = a;
        }
    }
    // Architectures without grouped-query attention leave num_key_value_heads out of their
    // config; transformers reads it as num_attention_heads, and so does the torch engine here.
    if any
        && raw.get("num_key_value_heads").is_none()
        && let Some(heads) = raw.get("num_attention_heads").cloned()
    {
        raw["num_key_value_heads"] = heads;
    }
    // The drafter's norms take the target's epsilon: a LayerNorm architecture names it
    // otherwise, and one that names none has transformers' usual 1e-6.
    if any && raw.is_object() && raw.get("rms_norm_eps").is_none() {
        let eps = [
            "layer_norm_eps",
            "layer_norm_epsilon",
            "norm_eps",
            "norm_epsilon",
        ]
        .iter()
        .find_map(|k| raw.get(*k).filter(|v| v.is_number()).cloned())
        .unwrap_or(serde_json::json!(1e-6));
        raw["rms_norm_eps"] = eps;
    }
    let what = if any { "a causal LM" } else { "a Qwen3" };
    let mut config: Qwen3Config = serde_json::from_value(raw.clone())
        .map_err(|e| ModelDirError::new(&path, format!("not {what} config: {e}")))?;
    config.rope_theta = if any {
        base_rope_theta(&raw)
    } else {
        rope_theta(&raw)
    }
    .map_err(|e| ModelDirError::new(&path, e))?;
    if !any && !config.architectures.iter().any(|a| a == "Qwen3ForCausalLM") {
        return Err(ModelDirError::new(
            &path,
            format!(
                "unsupported architecture {:?} (the candle engine runs Qwen3ForCausalLM; the torch engine runs what transformers loads: --engine torch)",
                config.architectures
            ),
        ));
    }
    if config.num_attention_heads == 0
        || config.num_key_value_heads == 0
        || !config
            .num_attention_heads
            .is_multiple_of(config.num_key_value_heads)
    {
        return Err(ModelDirError::new(
            &path,
            "attention heads must be a multiple of key/value heads",
        ));
    }
    if config.vocab_size == 0
        || config.hidden_size == 0
        || config.num_hidden_layers == 0
        || config.intermediate_size == 0
        || !config.head_dim().is_multiple_of(2)
        || config.head_dim() == 0
    {
        return Err(ModelDirError::new(
            &path,
            "vocab_size, hidden_size, intermediate_size and num_hidden_layers must be positive and head_dim even",
        ));
    }
    if config
        .num_attention_heads
        .checked_mul(config.head_dim())
        .is_none()
    {
        return Err(ModelDirError::new(
            &path,
            "num_attention_heads × head_dim is too large",
        ));
    }
    Ok(config)
}

/// RoPE's base of a config: the top-level `rope_theta` (as transformers 4 writes it), else
/// `rope_parameters.rope_theta` (transformers 5), else 10,000. Scaled RoPE (`rope_type` other than
/// `default`, in `rope_parameters` or `rope_scaling`) is refused: the candle target computes plain
/// RoPE, and a scaled one would give other hidden states without an error.
pub fn rope_theta(raw: &serde_json::Value) -> Result<f64, String> {
    for key in ["rope_parameters", "rope_scaling"] {
        let Some(p) = raw.get(key).filter(|p| !p.is_null()) else {
            continue;
        };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("default");
        if kind != "default" {
            return Err(format!(
                "{key} has RoPE scaling {kind:?}, which the candle engine does not compute (the torch engine does: --engine target=torch,drafter=candle)"
            ));
        }
    }
    let theta = raw
        .get("rope_theta")
        .or_else(|| raw.get("rope_parameters").and_then(|p| p.get("rope_theta")));
    match theta {
        None | Some(serde_json::Value::Null) => Ok(default_rope_theta()),
        Some(v) => v
            .as_f64()
            .filter(|t| t.is_finite() && *t > 0.0)
            .ok_or_else(|| format!("rope_theta {v} is not a positive number")),
    }
}

/// RoPE's base of a config whatever its scaling: the top-level `rope_theta`, else
/// `rope_parameters.rope_theta`, else that of `rope_parameters.full_attention` (per-layer-type
/// parameters, as Gemma 3 has them), else 10,000.
pub fn base_rope_theta(raw: &serde_json::Value) -> Result<f64, String> {
    let params = raw.get("rope_parameters");
    let theta = raw
        .get("rope_theta")
        .or_else(|| params.and_then(|p| p.get("rope_theta")))
        .or_else(|| params.and_then(|p| p.get("full_attention")?.get("rope_theta")));
    match theta {
        None | Some(serde_json::Value::Null) => Ok(default_rope_theta()),
        Some(v) => v
            .as_f64()
            .filter(|t| t.is_finite() && *t > 0.0)
            .ok_or_else(|| format!("rope_theta {v} is not a positive number")),
    }
}

/// The safetensors files of a model directory.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelDirError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read(&index).map_err(|_| {
        ModelDirError::new(
            dir,
            "has neither model.safetensors nor model.safetensors.index.json",
        )
    })?;
    #[derive(Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let index_data: Index = serde_json::from_slice(&text)
        .map_err(|e| ModelDirError::new(&index, format!("bad index: {e}")))?;
    let mut files: Vec<String> = index_data.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    files
        .into_iter()
        .map(|f| {
            let p = dir.join(&f);
            if Path::new(&f).components().count() != 1 || !p.is_file() {
                Err(ModelDirError::new(
                    &index,
                    format!("shard {f:?} is missing"),
                ))
            } else {
                Ok(p)
            }
        })
        .collect()
}

/// The default `target_layer_ids` for `draft_layers` drafter layers on a target of
/// `target_layers`: one layer id per drafter layer, spread evenly from layer 1 to layer L - 3 (the
/// published DFlash drafters' choice), the middle layer for one; on targets too small for that,
/// spread evenly over all layers.
pub fn default_target_layer_ids(target_layers: usize, draft_layers: usize) -> Vec<usize> {
    let n = draft_layers.clamp(1, target_layers.max(1));
    let spread = |start: usize, end: usize| -> Vec<usize> {
        if n == 1 {
            return vec![(start + end).div_ceil(2)];
        }
        (0..n)
            .map(|i| (start as f64 + (i * (end - start)) as f64 / (n - 1) as f64).round() as usize)
            .collect()
    };
    if draft_layers <= 1 {
        return vec![target_layers / 2];
    }
    let ids = if target_layers >= 4 {
        spread(1, target_layers - 3)
    } else {
        Vec::new()
    };
    if !ids.is_empty() && ids.windows(2).all(|w| w[0] < w[1]) {
        return ids;
    }
    spread(0, target_layers.saturating_sub(1))
}

impl DflashSettings {
    /// Checks the settings against the target's configuration.
    pub fn check(&self, target: &Qwen3Config) -> Result<(), String> {
        let layers = target.num_hidden_layers;
        if self.target_layer_ids.is_empty() {
            return Err("--target-layer-ids needs at least one layer".into());
        }
        if let Some(&bad) = self.target_layer_ids.iter().find(|&&l| l >= layers) {
            return Err(format!(
                "--target-layer-ids: layer {bad} is beyond the target's {layers} layers (0..={})",
                layers - 1
            ));
        }
        let mut sorted = self.target_layer_ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != self.target_layer_ids.len() {
            return Err(format!(
                "--target-layer-ids {:?} names a layer twice",
                self.target_layer_ids
            ));
        }
        if self.mask_token_id as usize >= target.vocab_size {
            return Err(format!(
                "--mask-token-id {} is outside the target's vocabulary (0..{})",
                self.mask_token_id, target.vocab_size
            ));
        }
        if self.block_size < 2 {
            return Err("--block-size must be at least 2".into());
        }
        if self.draft_layers == 0 {
            return Err("--draft-layers must be at least 1".into());
        }
        if self.num_anchors == 0 {
            return Err("--num-anchors must be at least 1".into());
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err("--lr must be positive".into());
        }
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            return Err("--warmup-ratio must be in [0, 1)".into());
        }
        if !(self.clip > 0.0 && self.clip.is_finite()) {
            return Err("--clip must be positive".into());
        }
        if self.gamma.is_some_and(|g| !(g > 0.0 && g.is_finite())) {
            return Err("--gamma must be positive".into());
        }
        if !(self.kd_temperature > 0.0 && self.kd_temperature.is_finite()) {
            return Err("--kd-temperature must be positive".into());
        }
        if !(0.0..=1.0).contains(&self.kd_weight) {
            return Err("--kd-weight must be in [0, 1]".into());
        }
        if !(0.0..=1.0).contains(&self.dpace_alpha) {
            return Err("--dpace-alpha must be in [0, 1]".into());
        }
        if self.dpace().is_some() && self.gamma.is_some() {
            return Err(format!(
                "--loss {} weighs the block positions itself: --gamma must be auto or none",
                self.loss.name()
            ));
        }
        if self.anchor_chunk == Some(0) {
            return Err("--anchor-chunk must be at least 1".into());
        }
        if self.sliding_window == Some(0) {
            return Err("--sliding-window must be at least 1".into());
        }
        if let Some(d) = self.dflash2() {
            let hidden = target.hidden_size;
            if d.conv_kernel_size == 0 || d.conv_kernel_size > self.block_size {
                return Err(format!(
                    "--conv-kernel-size {} must be from 1 to the block size {}",
                    d.conv_kernel_size, self.block_size
                ));
            }
            if d.conv_group_size == 0 || !hidden.is_multiple_of(d.conv_group_size) {
                return Err(format!(
                    "--conv-group-size {} does not divide the hidden size {hidden}",
                    d.conv_group_size
                ));
            }
            if d.selector_top_k == 0 || d.selector_top_k > target.vocab_size {
                return Err(format!(
                    "--selector-top-k {} must be from 1 to the vocabulary's {} tokens",
                    d.selector_top_k, target.vocab_size
                ));
            }
            if d.selector_rank == 0 || d.selector_rank > 65_536 {
                return Err(format!(
                    "--selector-rank {} must be from 1 to 65536",
                    d.selector_rank
                ));
            }
            if !(0.0..=100.0).contains(&d.selector_loss_weight) {
                return Err("--selector-loss-weight must be in [0, 100]".into());
            }
        }
        // `auto` on GPU workers is decided later, and checked again then.
        if !self.engine_auto && self.engines.drafter == Engine::Candle {
            if self.drafter_arch == DrafterArch::Dflash2 {
                return Err(
                    "--drafter-arch dflash2 is trained by the torch engine only: pass --engine torch"
                        .into(),
                );
            }
            if self.sliding_window.is_some() {
                return Err(
                    "--sliding-window is trained by the torch engine only: pass --engine torch"
                        .into(),
                );
            }
        }
        if self.save_every == 0 || self.keep_checkpoints == 0 {
            return Err("--save-every and --keep-checkpoints must be at least 1".into());
        }
        Ok(())
    }

    /// The distillation's share of the loss and its temperature, when the loss distils.
    pub fn distill(&self) -> Option<(f64, f64)> {
        match self.loss {
            LossKind::Ce | LossKind::Dpace => None,
            LossKind::Kd | LossKind::KdDpace => Some((1.0, self.kd_temperature)),
            LossKind::Mix => Some((self.kd_weight, self.kd_temperature)),
        }
    }

    /// DFlash2's settings, when the drafter is a DFlash2.
    pub fn dflash2(&self) -> Option<&Dflash2Settings> {
        (self.drafter_arch == DrafterArch::Dflash2).then_some(&self.dflash2)
    }

    /// D-PACE's α, when the loss weighs its block positions by D-PACE (`dpace`, `kd-dpace`).
    pub fn dpace(&self) -> Option<f64> {
        matches!(self.loss, LossKind::Dpace | LossKind::KdDpace).then_some(self.dpace_alpha)
    }

    /// Width of a token's features: the hidden states of every target layer id, concatenated,
    /// then (when the loss distils) the target's last hidden state after its final norm, from
    /// which the drafter computes the target's next-token distribution with the frozen lm_head.
    pub fn feature_width(&self, target: &Qwen3Config) -> u64 {
        let states = self.target_layer_ids.len() + usize::from(self.distill().is_some());
        (states as u64).saturating_mul(target.hidden_size as u64)
    }

    /// Bytes of a token's features in the feature ring.
    pub fn feature_bytes_per_token(&self, target: &Qwen3Config) -> u64 {
        self.feature_width(target)
            .saturating_mul(self.feature_dtype.bytes())
    }

    /// Decoder layers a target worker runs, of the target's `target_layers`: up to the last
    /// requested one, or all of them when the loss distils.
    pub fn target_layers_needed(&self, target_layers: usize) -> usize {
        if self.distill().is_some() {
            return target_layers;
        }
        self.target_layer_ids.iter().max().map_or(0, |&l| l + 1)
    }

    /// Warmup steps of the schedule.
    pub fn warmup_steps(&self) -> u64 {
        (self.warmup_ratio * self.total_steps as f64).round() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The torch engine reads any causal LM's config as `transformers` does: a multimodal one's
    /// `text_config` (its architectures kept), `num_key_value_heads` as `num_attention_heads`
    /// where the architecture has no grouped-query attention, and the norms' epsilon where a
    /// LayerNorm architecture names it; candle reads none of these.
    #[test]
    fn the_torch_engine_reads_configs_as_transformers_does() {
        let dir = tempfile::tempdir().unwrap();
        let write = |text: &str| std::fs::write(dir.path().join("config.json"), text).unwrap();
        let widths = r#""vocab_size": 600, "hidden_size": 48, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4"#;
        write(&format!(
            r#"{{"architectures": ["GPTNeoXForCausalLM"], {widths}, "layer_norm_eps": 1e-5}}"#
        ));
        let c = read_config_for(dir.path(), Engine::Torch).unwrap();
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (4, 4));
        assert_eq!(c.rms_norm_eps, 1e-5);
        let e = read_config_for(dir.path(), Engine::Candle).unwrap_err();
        assert!(e.to_string().contains("missing field"), "{e}");
        write(&format!(
            r#"{{"architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": {{{widths}, "num_key_value_heads": 2}}, "vision_config": {{}}}}"#
        ));
        let c = read_config_for(dir.path(), Engine::Torch).unwrap();
        assert_eq!((c.hidden_size, c.num_key_value_heads), (48, 2));
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.architectures, ["Qwen3_5ForConditionalGeneration"]);
        // Not an object, or heads of another type: refused, never a panic.
        for bad in ["[]", "7", r#"{"num_attention_heads": "four"}"#] {
            write(bad);
            assert!(read_config_for(dir.path(), Engine::Torch).is_err(), "{bad}");
        }
    }

    #[test]
    fn rope_theta_is_read_where_either_transformers_writes_it_and_scaling_refused() {
        use serde_json::json;
        assert_eq!(rope_theta(&json!({"rope_theta": 1e6})), Ok(1e6));
        assert_eq!(
            rope_theta(&json!({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})),
            Ok(5e5)
        );
        assert_eq!(rope_theta(&json!({})), Ok(10_000.0));
        assert_eq!(
            rope_theta(&json!({"rope_theta": 1e6, "rope_scaling": null})),
            Ok(1e6)
        );
        for (bad, says) in [
            (
                json!({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}),
                "rope_parameters has RoPE scaling \"llama3\"",
            ),
            (
                json!({"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}}),
                "rope_scaling has RoPE scaling \"yarn\"",
            ),
            (json!({"rope_theta": "big"}), "is not a positive number"),
            (
                json!({"rope_parameters": {"rope_theta": -1.0}}),
                "is not a positive number",
            ),
        ] {
            let e = rope_theta(&bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_package_directory_goes_first_on_the_python_path() {
        let runtime = TorchRuntime {
            python: "python3".into(),
            package_dir: Some("/t/python".into()),
        };
        let (command, _) = runtime.module_command("dflash_orch.serve", Path::new("/"));
        let path = command
            .get_envs()
            .find(|(k, _)| *k == "PYTHONPATH")
            .and_then(|(_, v)| v)
            .unwrap();
        assert!(path.to_string_lossy().starts_with("/t/python"), "{path:?}");
    }

    #[test]
    fn engines_are_written_as_the_option_takes_them() {
        let mixed = Engines {
            target: Engine::Torch,
            drafter: Engine::Candle,
        };
        assert_eq!(
            serde_json::to_value(mixed).unwrap(),
            serde_json::json!("target=torch,drafter=candle")
        );
        assert_eq!(
            serde_json::to_value(Engines::both(Engine::Torch)).unwrap(),
            serde_json::json!("torch")
        );
        for e in [
            mixed,
            Engines::both(Engine::Candle),
            Engines::both(Engine::Torch),
        ] {
            let back: Engines = serde_json::from_value(serde_json::to_value(e).unwrap()).unwrap();
            assert_eq!(back, e);
        }
        // A journal with a bad engine is refused, naming it.
        let e = serde_json::from_value::<Engines>(serde_json::json!("tensorflow")).unwrap_err();
        assert!(
            e.to_string().contains("\"tensorflow\" is not an engine"),
            "{e}"
        );
        assert!(serde_json::from_value::<Engines>(serde_json::json!(3)).is_err());
    }

    #[test]
    fn dpace_weights_follow_the_definition() {
        // The definition, written out: w_k = sum over counted m >= k of the product over
        // counted i <= m of (1 - α)·q_i + α, for counted k; 0 otherwise.
        fn reference(q: &[f64], counted: &[bool], alpha: f64) -> Vec<f64> {
            let n = q.len();
            (0..n)
                .map(|k| {
                    if !counted[k] {
                        return 0.0;
                    }
                    (k..n)
                        .filter(|&m| counted[m])
                        .map(|m| {
                            (0..=m)
                                .filter(|&i| counted[i])
                                .map(|i| (1.0 - alpha) * q[i] + alpha)
                                .product::<f64>()
                        })
                        .sum()
                })
                .collect()
        }
        let block = 5;
        // Position 0 of each block (the anchor) never counts.
        let all = [false, true, true, true, true];
        let cases: Vec<(Vec<f64>, [bool; 5])> = vec![
            (vec![0.3, 1.0, 1.0, 1.0, 1.0], all),
            (vec![0.9, 0.0, 0.0, 0.0, 0.0], all),
            (vec![0.5, 0.8, 0.0, 0.6, 0.4], all),
            (
                vec![0.5, 0.8, 0.1, 0.6, 0.4],
                [false, true, false, true, false],
            ),
            (vec![0.2, 0.7, 0.3, 0.9, 0.5], [false; 5]),
        ];
        for alpha in [0.0, 0.5, 0.25, 1.0] {
            let (mut q, mut counted) = (vec![], vec![]);
            for (qs, cs) in &cases {
                q.extend_from_slice(qs);
                counted.extend_from_slice(cs);
            }
            let got = dpace_weights(&q, &counted, block, alpha);
            for (b, (qs, cs)) in cases.iter().enumerate() {
                let want = reference(qs, cs, alpha);
                for k in 0..block {
                    let g = got[b * block + k];
                    assert!(
                        (g - want[k]).abs() < 1e-12,
                        "α {alpha} block {b} k {k}: {g} vs {}",
                        want[k]
                    );
                }
            }
        }
        // By hand: all ones, α 0.5: C = 1 everywhere, w = 4, 3, 2, 1.
        assert_eq!(
            dpace_weights(&[1.0; 5], &all, 5, 0.5),
            vec![0.0, 4.0, 3.0, 2.0, 1.0]
        );
        // All zero, α 0.5: C = 0.5, 0.25, 0.125, 0.0625.
        assert_eq!(
            dpace_weights(&[0.0; 5], &all, 5, 0.5),
            vec![0.0, 0.9375, 0.4375, 0.1875, 0.0625]
        );
        // A zero in the middle with α 0: nothing after it weighs anything.
        assert_eq!(
            dpace_weights(&[1.0, 1.0, 0.0, 1.0, 1.0], &all, 5, 0.0),
            vec![0.0, 1.0, 0.0, 0.0, 0.0]
        );
        // A masked position in the middle neither weighs nor breaks the chain.
        assert_eq!(
            dpace_weights(
                &[1.0, 0.5, 0.0, 0.5, 1.0],
                &[false, true, false, true, true],
                5,
                0.0
            ),
            vec![0.0, 1.0, 0.0, 0.5, 0.25]
        );
    }

    #[test]
    fn loss_kinds_and_the_recipe_gammas() {
        assert_eq!("kd".parse::<LossKind>(), Ok(LossKind::Kd));
        assert_eq!(" mix".parse::<LossKind>(), Ok(LossKind::Mix));
        assert!(
            "KD".parse::<LossKind>()
                .unwrap_err()
                .contains("ce, kd, mix, dpace or kd-dpace")
        );
        assert_eq!("dpace".parse::<LossKind>(), Ok(LossKind::Dpace));
        assert_eq!((default_gamma(16), default_gamma(8)), (7.0, 4.0));
        assert_eq!((default_gamma(4), default_gamma(2)), (2.0, 1.0));
    }

    #[test]
    fn on_nonfinite_reads_stop_or_skip_only() {
        assert_eq!("stop".parse::<NonFinite>(), Ok(NonFinite::Stop));
        assert_eq!(" skip ".parse::<NonFinite>(), Ok(NonFinite::Skip));
        for bad in ["", "Skip", "ignore", "stop,skip"] {
            let err = bad.parse::<NonFinite>().unwrap_err();
            assert!(err.contains("stop or skip"), "{bad}: {err}");
        }
    }

    #[test]
    fn default_layer_ids_are_spread_and_distinct() {
        // 36-layer target, 5 drafter layers: 1 to 33.
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(36, 1), vec![18]);
        assert_eq!(default_target_layer_ids(4, 2), vec![0, 3]);
        assert_eq!(default_target_layer_ids(4, 3), vec![0, 2, 3]);
        assert_eq!(default_target_layer_ids(2, 5), vec![0, 1]);
        for l in 1..40 {
            for d in 1..8 {
                let ids = default_target_layer_ids(l, d);
                assert!(
                    !ids.is_empty() && ids.iter().all(|&i| i < l),
                    "{l} {d} {ids:?}"
                );
                assert!(ids.windows(2).all(|w| w[0] < w[1]), "{l} {d} {ids:?}");
            }
        }
    }

    #[test]
    fn config_with_overflowing_projection_is_refused() {
        let dir = std::env::temp_dir().join(format!("dflash-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = |heads: u64, head_dim: u64| {
            format!(
                r#"{{"architectures":["Qwen3ForCausalLM"],"vocab_size":4,"hidden_size":2,
                "intermediate_size":2,"num_hidden_layers":1,"num_attention_heads":{heads},
                "num_key_value_heads":1,"head_dim":{head_dim},"rms_norm_eps":1e-6}}"#
            )
        };
        std::fs::write(dir.join("config.json"), config(4, 2)).unwrap();
        assert_eq!(read_config(&dir).unwrap().head_dim(), 2);
        std::fs::write(dir.join("config.json"), config(1 << 32, 1 << 32)).unwrap();
        let e = read_config(&dir).unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_drafter_rank_is_read_from_the_environment_and_bad_values_are_named() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        assert_eq!(
            DrafterRank::from_env(env(&[])).unwrap(),
            DrafterRank::single()
        );
        let r = DrafterRank::from_env(env(&[
            ("DFLASH_DRAFTER_RANK", "1"),
            ("DFLASH_DRAFTER_RANKS", "2"),
            ("DFLASH_DRAFTER_RENDEZVOUS", "127.0.0.1:29500"),
            ("DFLASH_DRAFTER_TIMEOUT_S", "30"),
        ]))
        .unwrap();
        assert_eq!((r.rank, r.ranks, r.timeout_s), (1, 2, 30.0));
        assert_eq!(r.rendezvous.as_deref(), Some("127.0.0.1:29500"));
        assert!(!r.writes_checkpoints && r.resume_step.is_none());
        // The first drafter of the second node writes that node's checkpoints.
        let r = DrafterRank::from_env(env(&[
            ("DFLASH_DRAFTER_RANK", "2"),
            ("DFLASH_DRAFTER_RANKS", "4"),
            ("DFLASH_DRAFTER_RENDEZVOUS", "node0:29400"),
            ("DFLASH_DRAFTER_LOCAL_RANK", "0"),
            ("DFLASH_DRAFTER_RESUME_STEP", "50"),
        ]))
        .unwrap();
        assert!(r.writes_checkpoints);
        assert_eq!(r.resume_step, Some(50));
        let two = [
            ("DFLASH_DRAFTER_RANK", "1"),
            ("DFLASH_DRAFTER_RANKS", "2"),
            ("DFLASH_DRAFTER_RENDEZVOUS", "h:1"),
        ];
        for (extra, says) in [
            (
                ("DFLASH_DRAFTER_LOCAL_RANK", "2"),
                "is past DFLASH_DRAFTER_RANK=1",
            ),
            (("DFLASH_DRAFTER_LOCAL_RANK", "-1"), "is not a whole number"),
            (
                ("DFLASH_DRAFTER_RESUME_STEP", "1e3"),
                "is not a whole number",
            ),
        ] {
            let e = DrafterRank::from_env(|name: &str| {
                two.iter()
                    .chain([&extra])
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            })
            .unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        for (bad, says) in [
            (&[("DFLASH_DRAFTER_RANK", "1")][..], "go together"),
            (
                &[("DFLASH_DRAFTER_RANK", "x"), ("DFLASH_DRAFTER_RANKS", "2")][..],
                "\"x\" is not a whole number",
            ),
            (
                &[("DFLASH_DRAFTER_RANK", "2"), ("DFLASH_DRAFTER_RANKS", "2")][..],
                "not a rank of",
            ),
            (
                &[("DFLASH_DRAFTER_RANK", "0"), ("DFLASH_DRAFTER_RANKS", "2")][..],
                "need DFLASH_DRAFTER_RENDEZVOUS",
            ),
            (
                &[
                    ("DFLASH_DRAFTER_RANK", "0"),
                    ("DFLASH_DRAFTER_RANKS", "2"),
                    ("DFLASH_DRAFTER_RENDEZVOUS", "nohost"),
                ][..],
                "not HOST:PORT",
            ),
            (
                &[
                    ("DFLASH_DRAFTER_RANK", "0"),
                    ("DFLASH_DRAFTER_RANKS", "2"),
                    ("DFLASH_DRAFTER_RENDEZVOUS", ":80"),
                ][..],
                "not HOST:PORT",
            ),
            (
                &[
                    ("DFLASH_DRAFTER_RANK", "0"),
                    ("DFLASH_DRAFTER_RANKS", "2"),
                    ("DFLASH_DRAFTER_RENDEZVOUS", "h:1"),
                    ("DFLASH_DRAFTER_TIMEOUT_S", "-3"),
                ][..],
                "positive number of seconds",
            ),
        ] {
            let pairs: &'static [(&'static str, &'static str)] =
                Box::leak(bad.to_vec().into_boxed_slice());
            let e = DrafterRank::from_env(env(pairs)).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }
}
