//! `dflash-orch init-tiny`: a small random-weight target of the Qwen3 architecture, for tests and
//! the demo (no downloads).

use std::collections::HashMap;
use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use crate::cli::CliError;
use crate::planner::rng::{PlanRng, Purpose};

/// The byte-level BPE tokenizer of the tiny target (chatml and llama3 special tokens included).
const TOKENIZER: &str = include_str!("../../assets/tiny-tokenizer.json");

#[derive(Debug, Clone, Args)]
pub struct InitTinyArgs {
    /// The model directory to write (config.json, model.safetensors, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    pub output: PathBuf,

    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Hidden size.
    #[arg(long, default_value_t = 64,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(16..=8192))]
    pub hidden_size: usize,

    /// Decoder layers.
    #[arg(long, default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub layers: usize,

    /// Replace DIR if it exists.
    #[arg(long)]
    pub force: bool,
}

/// The shape of the tiny model.
pub struct TinyShape {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `(name, shape, is_norm)` of every tensor of a Qwen3 model, in a fixed order.
pub fn tensor_layout(s: &TinyShape) -> Vec<(String, Vec<usize>, bool)> {
    let mut t = vec![(
        "model.embed_tokens.weight".to_owned(),
        vec![s.vocab, s.hidden],
        false,
    )];
    for i in 0..s.layers {
        let p = format!("model.layers.{i}");
        let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        t.push((format!("{p}.input_layernorm.weight"), vec![s.hidden], true));
        t.push((
            format!("{p}.self_attn.q_proj.weight"),
            vec![q, s.hidden],
            false,
        ));
        t.push((
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv, s.hidden],
            false,
        ));
        t.push((
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv, s.hidden],
            false,
        ));
        t.push((
            format!("{p}.self_attn.o_proj.weight"),
            vec![s.hidden, q],
            false,
        ));
        t.push((
            format!("{p}.self_attn.q_norm.weight"),
            vec![s.head_dim],
            true,
        ));
        t.push((
            format!("{p}.self_attn.k_norm.weight"),
            vec![s.head_dim],
            true,
        ));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![s.hidden],
            true,
        ));
        t.push((
            format!("{p}.mlp.gate_proj.weight"),
            vec![s.intermediate, s.hidden],
            false,
        ));
        t.push((
            format!("{p}.mlp.up_proj.weight"),
            vec![s.intermediate, s.hidden],
            false,
        ));
        t.push((
            format!("{p}.mlp.down_proj.weight"),
            vec![s.hidden, s.intermediate],
            false,
        ));
    }
    t.push(("model.norm.weight".to_owned(), vec![s.hidden], true));
    t.push(("lm_head.weight".to_owned(), vec![s.vocab, s.hidden], false));
    t
}

pub fn run(args: InitTinyArgs) -> Result<(), CliError> {
    if args.hidden_size < 16
        || !args.hidden_size.is_multiple_of(16)
        || args.layers == 0
        || args.layers > 64
    {
        return Err(CliError::Invalid(
            "--hidden-size must be a multiple of 16 (>= 16) and --layers 1..=64".into(),
        ));
    }
    if args.output.exists() && !args.force {
        return Err(CliError::Invalid(format!(
            "{} already exists (pass --force to replace it)",
            args.output.display()
        )));
    }
    let tokenizer: serde_json::Value = serde_json::from_str(TOKENIZER).expect("embedded tokenizer");
    let vocab = tokenizer["model"]["vocab"]
        .as_object()
        .map_or(0, |v| v.len())
        + tokenizer["added_tokens"].as_array().map_or(0, |a| {
            a.iter()
                .filter(|t| {
                    let id = t["id"].as_u64().unwrap_or(0) as usize;
                    id >= tokenizer["model"]["vocab"]
                        .as_object()
                        .map_or(0, |v| v.len())
                })
                .count()
        });
    let heads = 4;
    let shape = TinyShape {
        vocab,
        hidden: args.hidden_size,
        intermediate: 2 * args.hidden_size,
        layers: args.layers,
        heads,
        kv_heads: 2,
        head_dim: args.hidden_size / heads,
    };
    let mut rng = PlanRng::stream(args.seed, 0, Purpose::Synthetic);
    let layout = tensor_layout(&shape);
    let data: Vec<Vec<u8>> = layout
        .iter()
        .map(|(name, dims, is_norm)| {
            let n: usize = dims.iter().product();
            // The embedding and output head are drawn at the scale of a trained model's (logits
            // of a few units), so that a drafter trained through them can express confident
            // predictions; the decoder matrices at the usual 0.02.
            let std = if name.contains("embed_tokens") || name.starts_with("lm_head") {
                4.0 / (shape.hidden as f64).sqrt()
            } else {
                0.02
            };
            let values: Vec<f32> = if *is_norm {
                vec![1.0; n]
            } else {
                (0..n)
                    .map(|_| (std * rng.standard_normal()) as f32)
                    .collect()
            };
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = layout
        .iter()
        .zip(&data)
        .map(|((name, dims, _), bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, dims.clone(), bytes)
                    .expect("sizes match");
            (name.clone(), view)
        })
        .collect();
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "torch_dtype": "float32",
        "bos_token_id": 3,
        "eos_token_id": 2,
    });
    let io =
        |e: std::io::Error| CliError::io(format!("failed to write {}", args.output.display()), e);
    let parent = args
        .output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(parent).map_err(io)?;
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
    let written = (|| -> std::io::Result<()> {
        let metadata: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
        safetensors::serialize_to_file(views, Some(metadata), &temp.join("model.safetensors"))
            .map_err(std::io::Error::other)?;
        std::fs::write(
            temp.join("config.json"),
            serde_json::to_vec_pretty(&config)?,
        )?;
        std::fs::write(temp.join("tokenizer.json"), TOKENIZER)?;
        if args.output.exists() {
            std::fs::remove_dir_all(&args.output)?;
        }
        std::fs::rename(&temp, &args.output)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&temp);
        return Err(io(e));
    }
    eprintln!(
        "wrote a tiny Qwen3 target to {} ({} layers, hidden {}, vocab {}, seed {})",
        args.output.display(),
        shape.layers,
        shape.hidden,
        shape.vocab,
        args.seed
    );
    Ok(())
}
