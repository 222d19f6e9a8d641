//! Decoding by the workers: the drafter checkpoint's `config.json` as serving stacks read it;
//! what `dflash-orch eval` hands a worker (`dflash-worker --eval REQUEST.json`) and reads back
//! (one JSON line per prompt on the worker's stdout); and what `dflash-orch generate` hands a
//! worker (`dflash-worker --generate REQUEST.json`, then one batch of prompts per stdin line,
//! answered by one stdout line).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dflash::{
    Dflash2Settings, ModelDirError, Precision, Qwen3Config, Qwen3Shape, TorchRuntime,
};

/// Version of [`EvalRequest`] and [`PromptResult`]; a worker refuses another.
pub const EVAL_VERSION: u32 = 1;

/// The largest `block_size` a drafter may have (and `eval --block-size` may ask for).
pub const MAX_BLOCK_SIZE: usize = 1024;

/// The fields of a DFlash drafter's `config.json` that decide how it runs, read the way the
/// official `DFlashDraftModel` reads them: `block_size`, `mask_token_id` and `target_layer_ids`
/// from `dflash_config`, else from the top level.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftConfig {
    /// The drafter's layers: the target's widths and heads, its own layer count.
    pub shape: Qwen3Shape,
    pub block_size: usize,
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    /// The target's layer count the drafter was trained against, when the file says.
    pub num_target_layers: Option<usize>,
    /// The target's hidden size, when the file says (it differs from `hidden_size` only for
    /// drafters narrower than their target, which this build does not train).
    pub target_hidden_size: Option<usize>,
    /// A `DFlash2DraftModel`'s sizes (its selector's training fields at their defaults).
    pub dflash2: Option<Dflash2Settings>,
    /// The layers' attention window, when every layer is a `sliding_attention` one.
    pub sliding_window: Option<usize>,
}

#[derive(Deserialize)]
struct RawDraftConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    #[serde(default)]
    head_dim: Option<usize>,
    rms_norm_eps: f64,
    #[serde(default)]
    rope_theta: Option<f64>,
    vocab_size: usize,
    /// The DFlash fields where older files keep them: at the top level.
    #[serde(flatten)]
    top: RawDflashFields,
    #[serde(default)]
    num_target_layers: Option<usize>,
    #[serde(default)]
    target_hidden_size: Option<usize>,
    #[serde(default)]
    dflash_config: Option<RawDflashFields>,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    is_causal: Option<bool>,
}

#[derive(Deserialize, Default)]
struct RawDflashFields {
    #[serde(default)]
    block_size: Option<usize>,
    #[serde(default)]
    mask_token_id: Option<u32>,
    #[serde(default)]
    target_layer_ids: Option<Vec<usize>>,
    #[serde(default)]
    conv_kernel_size: Option<usize>,
    #[serde(default)]
    conv_group_size: Option<usize>,
    #[serde(default)]
    selector_rank: Option<usize>,
    #[serde(default)]
    selector_top_k: Option<usize>,
    /// Decode-time transforms the official package applies when a file sets them: the noise
    /// embeddings' scale, the logits' multiplier and their soft-capping. This build decodes
    /// drafters without them (1, 1, none) and refuses others by name.
    #[serde(default)]
    input_embedding_scale: Option<f64>,
    #[serde(default)]
    output_multiplier: Option<f64>,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
}

impl DraftConfig {
    /// Reads `config.json` of the drafter checkpoint in `dir`.
    pub fn read(dir: &Path) -> Result<Self, ModelDirError> {
        let path = dir.join("config.json");
        let text = std::fs::read(&path)
            .map_err(|e| ModelDirError::new(&path, format!("cannot read: {e}")))?;
        Self::parse(&text).map_err(|reason| ModelDirError::new(&path, reason))
    }

    /// Parses a drafter `config.json`.
    pub fn parse(text: &[u8]) -> Result<Self, String> {
        let raw: RawDraftConfig = serde_json::from_slice(text)
            .map_err(|e| format!("not a DFlash drafter config: {e}"))?;
        let dflash2 = raw.architectures.iter().any(|a| a == "DFlash2DraftModel");
        if !dflash2 && !raw.architectures.iter().any(|a| a == "DFlashDraftModel") {
            return Err(format!(
                "architectures {:?} names neither DFlashDraftModel nor DFlash2DraftModel",
                raw.architectures
            ));
        }
        let fields = raw.dflash_config.unwrap_or_default();
        let dflash2 = if dflash2 {
            let need = |name: &str, value: Option<usize>, hi: usize| {
                let v = value.ok_or(format!(
                    "a DFlash2DraftModel config needs dflash_config.{name}"
                ))?;
                if (1..=hi).contains(&v) {
                    Ok(v)
                } else {
                    Err(format!(
                        "dflash_config.{name} {v} is out of range (1 to {hi})"
                    ))
                }
            };
            let d = Dflash2Settings {
                conv_kernel_size: need(
                    "conv_kernel_size",
                    fields.conv_kernel_size,
                    MAX_BLOCK_SIZE,
                )?,
                conv_group_size: need("conv_group_size", fields.conv_group_size, 1 << 16)?,
                selector_rank: need("selector_rank", fields.selector_rank, 65_536)?,
                selector_top_k: need("selector_top_k", fields.selector_top_k, 1 << 24)?,
                ..Dflash2Settings::default()
            };
            if !raw.hidden_size.is_multiple_of(d.conv_group_size) {
                return Err(format!(
                    "dflash_config.conv_group_size {} does not divide hidden_size {}",
                    d.conv_group_size, raw.hidden_size
                ));
            }
            if d.selector_top_k > raw.vocab_size {
                return Err(format!(
                    "dflash_config.selector_top_k {} exceeds vocab_size {}",
                    d.selector_top_k, raw.vocab_size
                ));
            }
            Some(d)
        } else {
            None
        };
        // Layer types as the official package reads them: a sliding layer is causal unless
        // `is_causal` says otherwise. Every layer of one kind, and blocks that see themselves
        // whole, are what this build decodes.
        let types = raw.layer_types.clone().unwrap_or_default();
        let sliding = types.iter().filter(|t| *t == "sliding_attention").count();
        if let Some(other) = types
            .iter()
            .find(|t| *t != "sliding_attention" && *t != "full_attention")
        {
            return Err(format!(
                "layer_types names {other:?}, not full_attention or sliding_attention"
            ));
        }
        if !types.is_empty() && types.len() != raw.num_hidden_layers {
            return Err(format!(
                "layer_types has {} entries for {} layers",
                types.len(),
                raw.num_hidden_layers
            ));
        }
        if sliding != 0 && sliding != types.len() {
            return Err("layer_types mixes full_attention and sliding_attention layers, which this build does not decode".into());
        }
        let sliding_window = if sliding > 0 {
            let w = raw
                .sliding_window
                .ok_or("sliding_attention layers need sliding_window")?;
            if !(1..=1 << 24).contains(&w) {
                return Err(format!(
                    "sliding_window {w} is out of range (1 to 16777216)"
                ));
            }
            Some(w)
        } else {
            None
        };
        if raw.is_causal.unwrap_or(sliding > 0) {
            return Err("the drafter's attention is causal within its block (is_causal, or sliding layers without is_causal: false), which this build does not decode".into());
        }
        let top = raw.top;
        // Each read as the official package reads it: dflash_config first, then the top level.
        let transforms = [
            (
                "input_embedding_scale",
                fields.input_embedding_scale.or(top.input_embedding_scale),
                1.0,
                "its noise embeddings scaled",
            ),
            (
                "output_multiplier",
                fields.output_multiplier.or(top.output_multiplier),
                1.0,
                "its logits multiplied",
            ),
        ];
        for (name, value, none, what) in transforms {
            if let Some(v) = value.filter(|&v| v != none) {
                return Err(format!(
                    "{name} {v}: the drafter decodes with {what}, which this build does not do (it decodes drafters with {name} {none})"
                ));
            }
        }
        if let Some(v) = fields
            .final_logit_softcapping
            .or(top.final_logit_softcapping)
            .filter(|&v| v > 0.0)
        {
            return Err(format!(
                "final_logit_softcapping {v}: the drafter decodes with its logits soft-capped, which this build does not do"
            ));
        }
        let block_size = fields.block_size.or(top.block_size).unwrap_or(16);
        let mask_token_id = fields
            .mask_token_id
            .or(top.mask_token_id)
            .ok_or("no mask_token_id (in dflash_config or at the top level)")?;
        let target_layer_ids = fields
            .target_layer_ids
            .or(top.target_layer_ids)
            .ok_or("no target_layer_ids (in dflash_config or at the top level)")?;
        let heads = raw.num_attention_heads;
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / heads.max(1));
        if heads == 0
            || raw.num_key_value_heads == 0
            || !heads.is_multiple_of(raw.num_key_value_heads)
        {
            return Err(
                "num_attention_heads must be a positive multiple of num_key_value_heads".into(),
            );
        }
        if raw.hidden_size == 0
            || raw.intermediate_size == 0
            || raw.num_hidden_layers == 0
            || raw.vocab_size == 0
            || head_dim == 0
            || !head_dim.is_multiple_of(2)
        {
            return Err(
                "hidden_size, intermediate_size, num_hidden_layers and vocab_size must be positive and head_dim even"
                    .into(),
            );
        }
        // Every number has a range: a config changed by hand (or by an attacker) is refused
        // here, not met as a giant allocation or a meaningless result in the decoder.
        // Optional fields are checked when given (1 stands in for "absent").
        let ranges: [(&str, usize, usize, usize); 10] = [
            ("block_size", block_size, 2, MAX_BLOCK_SIZE),
            ("hidden_size", raw.hidden_size, 1, 1 << 16),
            ("intermediate_size", raw.intermediate_size, 1, 1 << 20),
            ("num_hidden_layers", raw.num_hidden_layers, 1, 1024),
            ("num_attention_heads", heads, 1, 1024),
            ("num_key_value_heads", raw.num_key_value_heads, 1, 1024),
            ("head_dim", head_dim, 2, 1024),
            ("vocab_size", raw.vocab_size, 1, 1 << 24),
            (
                "num_target_layers",
                raw.num_target_layers.unwrap_or(1),
                1,
                1024,
            ),
            (
                "target_hidden_size",
                raw.target_hidden_size.unwrap_or(1),
                1,
                1 << 16,
            ),
        ];
        for (name, value, lo, hi) in ranges {
            if !(lo..=hi).contains(&value) {
                return Err(format!("{name} {value} is out of range ({lo} to {hi})"));
            }
        }
        if target_layer_ids.len() > 1024 {
            return Err(format!(
                "target_layer_ids names {} layers (at most 1024)",
                target_layer_ids.len()
            ));
        }
        let rope_theta = raw.rope_theta.unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && (1.0..=1e12).contains(&rope_theta)) {
            return Err(format!(
                "rope_theta {rope_theta} is out of range (1 to 1e12)"
            ));
        }
        if raw.rms_norm_eps > 1.0 {
            return Err(format!(
                "rms_norm_eps {} is out of range (above 0, at most 1)",
                raw.rms_norm_eps
            ));
        }
        if target_layer_ids.is_empty() {
            return Err("target_layer_ids is empty".into());
        }
        if !(raw.rms_norm_eps > 0.0 && raw.rms_norm_eps.is_finite()) {
            return Err("rms_norm_eps must be positive".into());
        }
        Ok(Self {
            shape: Qwen3Shape {
                vocab: raw.vocab_size,
                hidden: raw.hidden_size,
                intermediate: raw.intermediate_size,
                layers: raw.num_hidden_layers,
                heads,
                kv_heads: raw.num_key_value_heads,
                head_dim,
                rms_eps: raw.rms_norm_eps,
                rope_theta,
            },
            block_size,
            mask_token_id,
            target_layer_ids,
            num_target_layers: raw.num_target_layers,
            target_hidden_size: raw.target_hidden_size,
            dflash2,
            sliding_window,
        })
    }

    /// Checks that this drafter was made for `target`: its layer ids exist there, its hidden size
    /// and vocabulary are the target's, its mask token is a row of the target's embedding.
    pub fn check_target(&self, target: &Qwen3Config) -> Result<(), String> {
        let layers = target.num_hidden_layers;
        if let Some(n) = self.num_target_layers
            && n != layers
        {
            return Err(format!(
                "the drafter was trained on a target of {n} layers (num_target_layers), this target has {layers}"
            ));
        }
        if let Some(&bad) = self.target_layer_ids.iter().find(|&&l| l >= layers) {
            return Err(format!(
                "target_layer_ids {:?} names layer {bad}, beyond the target's {layers} layers",
                self.target_layer_ids
            ));
        }
        let width = self.target_hidden_size.unwrap_or(self.shape.hidden);
        if width != target.hidden_size || self.shape.hidden != target.hidden_size {
            return Err(format!(
                "the drafter's hidden size is {width}, the target's {}",
                target.hidden_size
            ));
        }
        if self.shape.vocab != target.vocab_size {
            return Err(format!(
                "the drafter's vocabulary has {} tokens, the target's {}",
                self.shape.vocab, target.vocab_size
            ));
        }
        if self.mask_token_id as usize >= target.vocab_size {
            return Err(format!(
                "mask_token_id {} is outside the target's embedding (0..{})",
                self.mask_token_id, target.vocab_size
            ));
        }
        Ok(())
    }
}

/// How `eval` samples: at `temperature` (> 0) over the `top_k` most likely tokens (0: all), then
/// the head of mass `top_p`, as the official DFlash package defines them; drafts are verified by
/// rejection sampling. Prompt i draws from a stream of its own, [`Sampling::stream`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: u32,
    pub seed: u64,
}

/// The highest temperature `eval` takes (past it the distribution is flat to many digits).
pub const MAX_TEMPERATURE: f64 = 100.0;

impl Sampling {
    /// Refuses what no decoder can sample from: a temperature outside `(0, MAX_TEMPERATURE]`, a
    /// top-p outside `(0, 1]`, values that are not finite.
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature > 0.0 && self.temperature <= MAX_TEMPERATURE) {
            return Err(format!(
                "temperature {} is outside (0, {MAX_TEMPERATURE}] (0 is greedy decoding)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p {} is outside (0, 1]", self.top_p));
        }
        Ok(())
    }

    /// The seed of prompt `index`'s random stream (the torch decoder seeds its generator with it;
    /// the official package's `torch.manual_seed` with the same value draws the same numbers).
    pub fn stream(&self, index: u64) -> u64 {
        self.seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(index)
            % (1u64 << 63)
    }
}

/// What a worker evaluates: decoding of each prompt by the target alone and with the drafter
/// (speculative), greedy or sampled, on this worker's device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRequest {
    pub version: u32,
    pub target_model: PathBuf,
    /// The drafter checkpoint directory (`config.json` and `model.safetensors`).
    pub drafter: PathBuf,
    /// Tokens drafted and verified per step (the drafter's `block_size` unless overridden).
    pub block_size: usize,
    pub prompts: Vec<Vec<u32>>,
    /// New tokens per prompt at most, the first one (from the prefill) included.
    pub max_new_tokens: usize,
    /// Generation stops after any of these tokens.
    pub stop_token_ids: Vec<u32>,
    pub dtype: Precision,
    /// Also decode with the target alone (for the speedup and the lossless check).
    pub baseline: bool,
    /// Evaluate the untrained drafter of the checkpoint's shape, initialised from this seed as a
    /// run of that seed starts, instead of the checkpoint's weights.
    #[serde(default)]
    pub init_seed: Option<u64>,
    /// Decode on the torch engine with this Python (`python -m dflash_orch.decode`); none: candle.
    #[serde(default)]
    pub torch: Option<TorchRuntime>,
    /// Sample at a temperature, verifying drafts by rejection sampling; none: greedy.
    #[serde(default)]
    pub sampling: Option<Sampling>,
}

/// One prompt's outcome, as the worker prints it (one JSON line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptResult {
    /// Index in [`EvalRequest::prompts`].
    pub prompt: usize,
    /// The tokens generated by speculative decoding (the prompt not included).
    pub output_ids: Vec<u32>,
    /// Tokens gained per verify step (accepted draft tokens + 1, capped at the end).
    pub acceptance: Vec<u32>,
    /// Seconds of speculative decoding after the prefill.
    pub speculative_seconds: f64,
    /// The tokens of plain greedy decoding by the target, when asked for.
    pub baseline_ids: Option<Vec<u32>>,
    /// Seconds of plain decoding after the prefill.
    pub baseline_seconds: Option<f64>,
}

/// What a generating worker loads and how it decodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub version: u32,
    pub target_model: PathBuf,
    pub dtype: Precision,
    /// New tokens per prompt at most.
    pub max_new_tokens: usize,
    /// Generation stops after any of these tokens (kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// 0: greedy; otherwise softmax sampling at this temperature.
    pub temperature: f64,
    /// Sampling seed: row r draws from a stream of (seed, r), whatever batch it lands in.
    pub seed: u64,
    /// Generate on the torch engine with this Python (`python -m dflash_orch.decode`); none:
    /// candle.
    #[serde(default)]
    pub torch: Option<TorchRuntime>,
}

/// One batch of prompts (a stdin line of a generating worker).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateJob {
    pub batch: u64,
    /// (row of the input, prompt tokens).
    pub prompts: Vec<(u64, Vec<u32>)>,
}

/// A batch done (a stdout line of a generating worker): per prompt, in the job's order, the
/// tokens generated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateDone {
    pub batch: u64,
    pub outputs: Vec<Vec<u32>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 512{extra}}}"#
        )
    }

    #[test]
    fn fields_come_from_dflash_config_then_the_top_level() {
        let c = DraftConfig::parse(
            config(
                r#", "block_size": 8, "mask_token_id": 3, "target_layer_ids": [0],
                "dflash_config": {"block_size": 16, "target_layer_ids": [1, 2]}"#,
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(c.block_size, 16);
        assert_eq!(c.mask_token_id, 3);
        assert_eq!(c.target_layer_ids, vec![1, 2]);
        assert_eq!(c.shape.head_dim, 16);
        // The decode-time transforms at their identities (or soft-capping off) are accepted.
        let identity = r#", "mask_token_id": 3, "target_layer_ids": [0], "output_multiplier": 2.0,
            "final_logit_softcapping": null,
            "dflash_config": {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                              "final_logit_softcapping": 0.0}"#;
        DraftConfig::parse(config(identity).as_bytes()).unwrap();
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        for (extra, want) in [
            (r#", "target_layer_ids": [1]"#, "mask_token_id"),
            (r#", "mask_token_id": 1"#, "target_layer_ids"),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [], "block_size": 4"#,
                "empty",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "block_size": 1"#,
                "block_size 1 is out of range (2 to 1024)",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "block_size": 1000000000"#,
                "block_size 1000000000 is out of range",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "rope_theta": 0"#,
                "rope_theta 0 is out of range",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "rope_theta": -5.5"#,
                "rope_theta -5.5 is out of range",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "num_target_layers": 0"#,
                "num_target_layers 0 is out of range",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "head_dim": 4096"#,
                "head_dim 4096 is out of range",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1],
                "dflash_config": {"input_embedding_scale": 8.0}"#,
                "input_embedding_scale 8: the drafter decodes with its noise embeddings scaled",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "output_multiplier": 0.5"#,
                "output_multiplier 0.5",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "final_logit_softcapping": 30.0"#,
                "final_logit_softcapping 30",
            ),
            // dflash_config's value is the one read, as the official package reads it.
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "output_multiplier": 1.0,
                "dflash_config": {"output_multiplier": 2.0}"#,
                "output_multiplier 2",
            ),
        ] {
            let err = DraftConfig::parse(config(extra).as_bytes()).unwrap_err();
            assert!(err.contains(want), "{extra}: {err}");
        }
        for text in ["", "{", "[]", r#"{"architectures": ["Qwen3ForCausalLM"]}"#] {
            assert!(DraftConfig::parse(text.as_bytes()).is_err(), "{text}");
        }
        let wrong_arch = config(r#", "mask_token_id": 1, "target_layer_ids": [1]"#)
            .replace("DFlashDraftModel", "LlamaForCausalLM");
        assert!(
            DraftConfig::parse(wrong_arch.as_bytes())
                .unwrap_err()
                .contains("DFlashDraftModel")
        );
    }

    #[test]
    fn a_drafter_for_another_target_is_refused() {
        let target: Qwen3Config = serde_json::from_str(
            r#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6}"#,
        )
        .unwrap();
        let ok = r#", "mask_token_id": 1, "dflash_config": {"target_layer_ids": [1, 2]}"#;
        let parse = |s: &str| DraftConfig::parse(config(s).as_bytes()).unwrap();
        parse(ok).check_target(&target).unwrap();
        for (extra, want) in [
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1, 4]"#,
                "layer 4",
            ),
            (
                r#", "mask_token_id": 512, "target_layer_ids": [1]"#,
                "outside the target's embedding",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "num_target_layers": 36"#,
                "36 layers",
            ),
            (
                r#", "mask_token_id": 1, "target_layer_ids": [1], "target_hidden_size": 4096"#,
                "hidden size",
            ),
        ] {
            let err = parse(extra).check_target(&target).unwrap_err();
            assert!(err.contains(want), "{extra}: {err}");
        }
        let mut wide = parse(ok);
        wide.shape.vocab = 600;
        assert!(
            wide.check_target(&target)
                .unwrap_err()
                .contains("vocabulary")
        );
        wide.shape.vocab = 512;
        wide.shape.hidden = 32;
        assert!(
            wide.check_target(&target)
                .unwrap_err()
                .contains("hidden size")
        );
    }
}
