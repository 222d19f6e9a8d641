//! `dflash-orch init-tiny`: a random-weight target of the Qwen3 architecture, for tests, the demo
//! and scale rehearsals (no downloads): the tiny default, or any Qwen3 shape up to a real one
//! (`--preset qwen3-0.6b`), written as one safetensors file streamed to disk.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Args;
use clap::builder::RangedU64ValueParser;
use serde_json::json;

use dflash_common::dflash::Qwen3Shape;

use crate::error::CliError;
use crate::planner::rng::{PlanRng, Purpose};

/// The byte-level BPE tokenizer of the tiny target (chatml and llama3 special tokens included).
const TOKENIZER: &str = include_str!("../../../assets/tiny-tokenizer.json");

/// A named Qwen3 shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// Hidden 64, 4 layers, 4 heads / 2 key-value heads, head_dim hidden/4, intermediate
    /// 2 × hidden, the bundled tokenizer's vocabulary (600): the model of the tests and the demo.
    Tiny,
    /// Qwen3-0.6B's shape: hidden 1024, 28 layers, 16 heads / 8 key-value heads, head_dim 128,
    /// intermediate 3072, vocab 151936, tied embeddings (random weights, the bundled tokenizer).
    #[value(name = "qwen3-0.6b")]
    Qwen3_0_6b,
}

/// The element type of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    fn width(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }

    fn safetensors(self) -> safetensors::Dtype {
        match self {
            WeightDtype::F32 => safetensors::Dtype::F32,
            WeightDtype::Bf16 => safetensors::Dtype::BF16,
        }
    }

    fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }
}

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
The weights are random (seeded) and the tokenizer is always the bundled tiny one (600 tokens). \
A --vocab larger than that gives embedding rows no tokenizer text maps to: fine for synthetic and \
pre-tokenized runs whose token ids are below --vocab, and for a real shape's memory and speed; a \
--vocab below 600 is refused. Explicit shape options override the preset's values.")]
pub struct InitTinyArgs {
    /// The model directory to write (config.json, model.safetensors, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    pub output: PathBuf,

    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// The shape to start from: tiny (the tests' and the demo's model) or qwen3-0.6b (Qwen3-0.6B's
    /// real shape and config).
    #[arg(long, value_name = "NAME", value_enum, default_value_t = Preset::Tiny)]
    pub preset: Preset,

    /// Hidden size [default: the preset's: tiny 64, qwen3-0.6b 1024].
    #[arg(long, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(16..=32768))]
    pub hidden_size: Option<usize>,

    /// Decoder layers [default: the preset's: tiny 4, qwen3-0.6b 28].
    #[arg(long, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub layers: Option<usize>,

    /// Attention (query) heads; a multiple of --kv-heads [default: the preset's: tiny 4,
    /// qwen3-0.6b 16].
    #[arg(long, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub heads: Option<usize>,

    /// Key/value heads (grouped-query attention) [default: the preset's: tiny 2, qwen3-0.6b 8].
    #[arg(long, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub kv_heads: Option<usize>,

    /// Dimension of one head, even (RoPE rotates pairs) [default: the preset's: tiny
    /// hidden/heads, qwen3-0.6b 128].
    #[arg(long, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(2..=1024))]
    pub head_dim: Option<usize>,

    /// MLP intermediate size [default: the preset's: tiny 2 × hidden, qwen3-0.6b 3072].
    #[arg(long, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(1..=262144))]
    pub intermediate: Option<usize>,

    /// Vocabulary size (embedding rows), at least the bundled tokenizer's 600 [default: the
    /// preset's: tiny 600, qwen3-0.6b 151936].
    #[arg(long, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(1..=4_194_304))]
    pub vocab: Option<usize>,

    /// Element type of model.safetensors: f32, or bf16 (half the size).
    #[arg(long, value_name = "DTYPE", value_enum, default_value_t = WeightDtype::F32)]
    pub dtype: WeightDtype,

    /// Replace DIR if it exists.
    #[arg(long)]
    pub force: bool,
}

/// Everything the written model is made of, the preset's and the options' values resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub shape: Qwen3Shape,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub dtype: WeightDtype,
}

/// The tokenizer's vocabulary: its model's tokens and the added tokens beyond them.
fn tokenizer_vocab(tokenizer: &serde_json::Value) -> usize {
    let base = tokenizer["model"]["vocab"]
        .as_object()
        .map_or(0, |v| v.len());
    base + tokenizer["added_tokens"].as_array().map_or(0, |a| {
        a.iter()
            .filter(|t| t["id"].as_u64().unwrap_or(0) as usize >= base)
            .count()
    })
}

impl InitTinyArgs {
    /// The model to write, or why the options do not describe a usable Qwen3 shape.
    pub fn spec(&self, tokenizer_vocab: usize) -> Result<ModelSpec, String> {
        let (hidden, layers) = match self.preset {
            Preset::Tiny => (64, 4),
            Preset::Qwen3_0_6b => (1024, 28),
        };
        let hidden = self.hidden_size.unwrap_or(hidden);
        let layers = self.layers.unwrap_or(layers);
        // The tiny preset's other sizes follow the hidden size.
        let (heads, kv_heads, intermediate, vocab) = match self.preset {
            Preset::Tiny => (4, 2, 2 * hidden, tokenizer_vocab),
            Preset::Qwen3_0_6b => (16, 8, 3072, 151_936),
        };
        let heads = self.heads.unwrap_or(heads);
        let kv_heads = self.kv_heads.unwrap_or(kv_heads);
        let intermediate = self.intermediate.unwrap_or(intermediate);
        let vocab = self.vocab.unwrap_or(vocab);
        if !heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "--heads {heads} is not a multiple of --kv-heads {kv_heads} (each key/value head serves a whole group of query heads)"
            ));
        }
        let head_dim = match (self.head_dim, self.preset) {
            (Some(d), _) => d,
            (None, Preset::Qwen3_0_6b) => 128,
            (None, Preset::Tiny) => {
                if !hidden.is_multiple_of(heads) {
                    return Err(format!(
                        "--hidden-size {hidden} is not a multiple of --heads {heads}: pass --head-dim, or a hidden size that is"
                    ));
                }
                hidden / heads
            }
        };
        if !head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {head_dim} is odd (RoPE rotates pairs of dimensions): pass an even --head-dim{}",
                if self.head_dim.is_none() {
                    " or a --hidden-size whose share per head is even"
                } else {
                    ""
                }
            ));
        }
        if heads * head_dim > 65536 {
            return Err(format!(
                "--heads {heads} × head_dim {head_dim} = {} is too large (at most 65536)",
                heads * head_dim
            ));
        }
        if vocab < tokenizer_vocab {
            return Err(format!(
                "--vocab {vocab} is smaller than the bundled tokenizer's {tokenizer_vocab} tokens (its ids would fall outside the embedding)"
            ));
        }
        let (tie_word_embeddings, max_position_embeddings) = match self.preset {
            Preset::Tiny => (false, 8192),
            Preset::Qwen3_0_6b => (true, 40960),
        };
        Ok(ModelSpec {
            shape: Qwen3Shape {
                vocab,
                hidden,
                intermediate,
                layers,
                heads,
                kv_heads,
                head_dim,
                rms_eps: 1e-6,
                rope_theta: 1_000_000.0,
            },
            tie_word_embeddings,
            max_position_embeddings,
            dtype: self.dtype,
        })
    }
}

/// The tensors a model of `spec` stores, in drawing order: the layout, less the output head when
/// it is tied to the embedding (as Hugging Face checkpoints of tied models store it).
fn stored_tensors(spec: &ModelSpec) -> Vec<(String, Vec<usize>, bool)> {
    let mut layout = spec.shape.tensors(spec.shape.layers);
    if spec.tie_word_embeddings {
        layout.retain(|(name, ..)| name != "lm_head.weight");
    }
    layout
}

/// A standard normal deviate from two consecutive outputs of the generator, exactly as
/// `PlanRng::standard_normal` computes it from them (Box–Muller): drawing the raw numbers in
/// order and transforming them on several threads gives the sequential stream's values.
fn standard_normal(a: u64, b: u64) -> f64 {
    let unit = |x: u64| (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    let u1 = 1.0 - unit(a);
    let u2 = unit(b);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// bfloat16 bits of a finite `f32`, rounded to nearest, ties to even (what PyTorch's `.to(bfloat16)`
/// does).
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}

/// The start of a safetensors file, and where its data goes.
struct Header {
    /// The 8-byte length, then the JSON table padded to 8 bytes, as the `safetensors` crate writes
    /// it (tensors sorted by name).
    bytes: Vec<u8>,
    /// Each tensor's data offset after the header.
    offsets: HashMap<String, usize>,
    /// Bytes of data after the header.
    data_len: usize,
}

fn safetensors_header(
    tensors: &[(String, Vec<usize>, bool)],
    dtype: WeightDtype,
) -> Result<Header, String> {
    let mut sorted: Vec<&(String, Vec<usize>, bool)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut offset = 0usize;
    let mut offsets = HashMap::new();
    let mut infos = Vec::with_capacity(sorted.len());
    for (name, dims, _) in sorted {
        let bytes = dims
            .iter()
            .try_fold(dtype.width(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("{name} is too large"))?;
        let end = offset
            .checked_add(bytes)
            .ok_or_else(|| "the model is too large".to_owned())?;
        offsets.insert(name.clone(), offset);
        infos.push((
            name.clone(),
            safetensors::tensor::TensorInfo {
                dtype: dtype.safetensors(),
                shape: dims.clone(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }
    let metadata: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
    let table = safetensors::tensor::Metadata::new(Some(metadata), infos)
        .map_err(|e| format!("cannot describe the tensors: {e}"))?;
    let mut json = serde_json::to_string(&table)
        .map_err(|e| format!("cannot describe the tensors: {e}"))?
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    Ok(Header {
        bytes,
        offsets,
        data_len: offset,
    })
}

/// Elements drawn and written at a time: bounds the memory to a few tens of MB for any model.
const CHUNK: usize = 1 << 20;

/// Writes the random weights of `spec` to `path`: the header, then each tensor drawn in layout
/// order from one seeded stream and written at its place in the file, a chunk at a time (the
/// Box–Muller transforms of a chunk on every core). Stops with `Interrupted` when `stop` is set.
fn write_weights(
    path: &Path,
    spec: &ModelSpec,
    seed: u64,
    stop: &AtomicBool,
) -> Result<u64, WriteError> {
    let tensors = stored_tensors(spec);
    let header = safetensors_header(&tensors, spec.dtype).map_err(WriteError::Shape)?;
    let file = std::fs::File::create(path).map_err(WriteError::Io)?;
    let base = header.bytes.len() as u64;
    let total = base + header.data_len as u64;
    file.set_len(total).map_err(WriteError::Io)?;
    file.write_all_at(&header.bytes, 0)
        .map_err(WriteError::Io)?;
    let width = spec.dtype.width();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 16);
    let mut rng = PlanRng::stream(seed, 0, Purpose::Synthetic);
    let mut raw = vec![0u64; 2 * CHUNK];
    let mut out = vec![0u8; CHUNK * width];
    for (name, dims, is_norm) in &tensors {
        let n: usize = dims.iter().product();
        // The embedding and output head are drawn at the scale of a trained model's (logits of a
        // few units), so that a drafter trained through them can express confident predictions;
        // the decoder matrices at the usual 0.02.
        let std = if name.contains("embed_tokens") || name.starts_with("lm_head") {
            4.0 / (spec.shape.hidden as f64).sqrt()
        } else {
            0.02
        };
        let mut at = base + header.offsets[name] as u64;
        let mut left = n;
        while left > 0 {
            if stop.load(Ordering::Relaxed) {
                return Err(WriteError::Interrupted);
            }
            let len = left.min(CHUNK);
            let bytes = &mut out[..len * width];
            if *is_norm {
                let one: &[u8] = match spec.dtype {
                    WeightDtype::F32 => &1.0f32.to_le_bytes(),
                    WeightDtype::Bf16 => &bf16_bits(1.0).to_le_bytes(),
                };
                for b in bytes.chunks_exact_mut(width) {
                    b.copy_from_slice(one);
                }
            } else {
                let raw = &mut raw[..2 * len];
                for x in raw.iter_mut() {
                    *x = rng.next_u64();
                }
                let per = len.div_ceil(threads).max(4096);
                let fill = |raw: &[u64], bytes: &mut [u8]| {
                    for (pair, b) in raw.chunks_exact(2).zip(bytes.chunks_exact_mut(width)) {
                        let v = (std * standard_normal(pair[0], pair[1])) as f32;
                        match spec.dtype {
                            WeightDtype::F32 => b.copy_from_slice(&v.to_le_bytes()),
                            WeightDtype::Bf16 => b.copy_from_slice(&bf16_bits(v).to_le_bytes()),
                        }
                    }
                };
                std::thread::scope(|scope| {
                    let mut parts = raw.chunks(2 * per).zip(bytes.chunks_mut(per * width));
                    let first = parts.next();
                    for (r, b) in parts {
                        scope.spawn(move || fill(r, b));
                    }
                    if let Some((r, b)) = first {
                        fill(r, b);
                    }
                });
            }
            file.write_all_at(bytes, at).map_err(WriteError::Io)?;
            at += bytes.len() as u64;
            left -= len;
        }
    }
    Ok(total)
}

enum WriteError {
    Shape(String),
    Io(std::io::Error),
    Interrupted,
}

/// The config.json of `spec`.
fn config_json(spec: &ModelSpec) -> serde_json::Value {
    let s = &spec.shape;
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.shape.rms_eps,
        "rope_theta": spec.shape.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "torch_dtype": spec.dtype.torch_name(),
        // The bundled tokenizer's ids (<|begin_of_text|>, <|im_end|>), whatever the shape.
        "bos_token_id": 3,
        "eos_token_id": 2,
    })
}

/// Bytes free for an unprivileged user on the file system of `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some((s.blocks_available() as u64).saturating_mul(s.fragment_size() as u64))
}

pub fn run(args: InitTinyArgs) -> Result<(), CliError> {
    let tokenizer: serde_json::Value = serde_json::from_str(TOKENIZER).expect("embedded tokenizer");
    let spec = args
        .spec(tokenizer_vocab(&tokenizer))
        .map_err(CliError::Invalid)?;
    let tensors = stored_tensors(&spec);
    let header = safetensors_header(&tensors, spec.dtype).map_err(CliError::Invalid)?;
    let size = header.bytes.len() as u64 + header.data_len as u64;
    if args.output.exists() && !args.force {
        return Err(CliError::Invalid(format!(
            "{} already exists (pass --force to replace it)",
            args.output.display()
        )));
    }
    let io =
        |e: std::io::Error| CliError::io(format!("failed to write {}", args.output.display()), e);
    let parent = args
        .output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io)?;
    if let Some(free) = free_bytes(parent)
        && free < size + (1 << 20)
    {
        return Err(CliError::Invalid(format!(
            "the weights take {} and {} has {} free",
            crate::format::bytes(size),
            parent.display(),
            crate::format::bytes(free)
        )));
    }
    let temp = parent.join(format!(
        ".{}.tmp-{}",
        args.output
            .file_name()
            .unwrap_or_default()
            .to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&temp);
    std::fs::create_dir(&temp).map_err(io)?;
    let stop = crate::signals::watch_stop_signals();
    let started = std::time::Instant::now();
    let written = (|| -> Result<(), WriteError> {
        write_weights(&temp.join("model.safetensors"), &spec, args.seed, &stop)?;
        let config =
            serde_json::to_vec_pretty(&config_json(&spec)).map_err(|e| WriteError::Io(e.into()))?;
        std::fs::write(temp.join("config.json"), config).map_err(WriteError::Io)?;
        std::fs::write(temp.join("tokenizer.json"), TOKENIZER).map_err(WriteError::Io)?;
        if args.output.exists() {
            std::fs::remove_dir_all(&args.output).map_err(WriteError::Io)?;
        }
        std::fs::rename(&temp, &args.output).map_err(WriteError::Io)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&temp);
        return Err(match e {
            WriteError::Shape(why) => CliError::Invalid(why),
            WriteError::Io(e) => io(e),
            WriteError::Interrupted => {
                CliError::Interrupted(format!("{} was not written", args.output.display()))
            }
        });
    }
    let s = &spec.shape;
    eprintln!(
        "wrote a Qwen3 target to {} ({} layers, hidden {}, {} heads / {} kv heads of {}, intermediate {}, vocab {}{}; {} weights, {} in {:.1} s, seed {})",
        args.output.display(),
        s.layers,
        s.hidden,
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.intermediate,
        s.vocab,
        if spec.tie_word_embeddings {
            ", tied embeddings"
        } else {
            ""
        },
        spec.dtype.name(),
        crate::format::bytes(size),
        started.elapsed().as_secs_f64(),
        args.seed
    );
    Ok(())
}

#[cfg(test)]
mod tests;
