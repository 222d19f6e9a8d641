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
    /// What a NaN or infinity in the features, the loss or the gradients does: stop the run
    /// (naming where it appeared), or skip that optimiser step (journalled and counted).
    #[serde(default)]
    pub on_nonfinite: NonFinite,
    /// The drafter also checkpoints every this many steps, for the run's served-acceptance
    /// evaluations (`--eval-every`).
    #[serde(default)]
    pub eval_every: Option<u64>,
    /// The run fingerprint: for each thing that decides the trained weights (`target`, `data`,
    /// `planner`, `seed`, `optimiser`, `drafter`, `loss`, `precision`, `epochs`), a hex hash of
    /// it. Written into every checkpoint's `state.json`; a drafter refuses a checkpoint whose
    /// fingerprint differs, naming the fields that differ.
    #[serde(default)]
    pub fingerprint: BTreeMap<String, String>,
}

fn default_kd_temperature() -> f64 {
    0.1
}

fn default_kd_weight() -> f64 {
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
}

impl LossKind {
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Ce => "ce",
            LossKind::Kd => "kd",
            LossKind::Mix => "mix",
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
            other => Err(format!("{other:?} is not ce, kd or mix")),
        }
    }
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

/// The fields of a run fingerprint that differ between `ours` and `theirs` (missing on either side
/// counts as different), in name order.
pub fn fingerprint_differences(
    ours: &BTreeMap<String, String>,
    theirs: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut names: Vec<&String> = ours.keys().chain(theirs.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|n| ours.get(*n) != theirs.get(*n))
        .cloned()
        .collect()
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

/// Reads and checks `config.json` of a Qwen3 model directory.
pub fn read_config(dir: &Path) -> Result<Qwen3Config, ModelDirError> {
    let path = dir.join("config.json");
    let text =
        std::fs::read(&path).map_err(|e| ModelDirError::new(&path, format!("cannot read: {e}")))?;
    let config: Qwen3Config = serde_json::from_slice(&text)
        .map_err(|e| ModelDirError::new(&path, format!("not a Qwen3 config: {e}")))?;
    if !config.architectures.iter().any(|a| a == "Qwen3ForCausalLM") {
        return Err(ModelDirError::new(
            &path,
            format!(
                "unsupported architecture {:?} (this build runs Qwen3ForCausalLM)",
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
        if self.anchor_chunk == Some(0) {
            return Err("--anchor-chunk must be at least 1".into());
        }
        if self.save_every == 0 || self.keep_checkpoints == 0 {
            return Err("--save-every and --keep-checkpoints must be at least 1".into());
        }
        Ok(())
    }

    /// The distillation's share of the loss and its temperature, when the loss distils.
    pub fn distill(&self) -> Option<(f64, f64)> {
        match self.loss {
            LossKind::Ce => None,
            LossKind::Kd => Some((1.0, self.kd_temperature)),
            LossKind::Mix => Some((self.kd_weight, self.kd_temperature)),
        }
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

    #[test]
    fn loss_kinds_and_the_recipe_gammas() {
        assert_eq!("kd".parse::<LossKind>(), Ok(LossKind::Kd));
        assert_eq!(" mix".parse::<LossKind>(), Ok(LossKind::Mix));
        assert!(
            "KD".parse::<LossKind>()
                .unwrap_err()
                .contains("ce, kd or mix")
        );
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
}
