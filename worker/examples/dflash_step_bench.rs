//! Times the two DFlash stages on the CPU: the target forward pass over a padded batch (hidden
//! states of `target_layer_ids`, concatenated per real token, copied to host memory, as
//! `TargetStage` does) and one drafter training step on those features (per sequence: anchors
//! from the loss mask, `loss_parts`; the batch's weighted mean; backward; clipping; AdamW, as
//! `DrafterStage::train` does with one micro-batch per optimiser step). Prints one JSON object on
//! stdout: the workload, the per-iteration times, tokens/s (medians), and what the other side of
//! `scripts/bench-dflash` needs to compute the same thing (tokens, loss masks, anchors of every
//! step, losses, gradient norms; with `--dump-init`, the drafter's initial weights).
//!
//! ```sh
//! cargo build --release --example dflash_step_bench -p dflash-worker
//! ./target/release/examples/dflash_step_bench --model MODEL_DIR --batch 8 --seq 128
//! ```
//!
//! Threads: candle's CPU kernels use `RAYON_NUM_THREADS` (or `CANDLE_NUM_THREADS`) threads.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use clap::Parser;
use dflash_worker::bench::{median, train_step};
use dflash_worker::dflash::sample_anchors;
use dflash_worker::model::drafter::{Drafter, DrafterConfig, Heads, MicroBatch, Objective};
use dflash_worker::model::qwen3::{self, Qwen3};
use dflash_worker::rng::SplitMix64;
use dflash_worker::train::{Accumulator, AdamW, AdamWConfig, Schedule};
use serde_json::json;

/// Target forward and drafter training step throughput on the CPU.
#[derive(Debug, Parser)]
struct Args {
    /// The target: a Qwen3 model directory (e.g. from `dflash-orch init-tiny`).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Leading tokens of every sequence with loss mask 0.
    #[arg(long, default_value_t = 16)]
    prompt: usize,
    /// Target layers whose hidden states feed the drafter (hidden state k + 1).
    #[arg(long, value_delimiter = ',', default_value = "0,3")]
    target_layer_ids: Vec<usize>,
    /// Decoder layers of the drafter.
    #[arg(long, default_value_t = 1)]
    draft_layers: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Anchors per sequence.
    #[arg(long, default_value_t = 32)]
    num_anchors: usize,
    /// Anchors computed and back-propagated together (default: all at once).
    #[arg(long)]
    anchor_chunk: Option<usize>,
    /// Loss decay over block positions [default: none, uniform].
    #[arg(long)]
    gamma: Option<f64>,
    /// Peak learning rate (warmup over 4% of the steps, then cosine decay).
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Seed of the tokens, the drafter's weights and the anchors.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Untimed iterations of each measurement first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed target forward passes.
    #[arg(long, default_value_t = 40)]
    target_iters: usize,
    /// Timed training steps.
    #[arg(long, default_value_t = 20)]
    train_iters: usize,
    /// Also write the drafter's initial weights here (safetensors, its parameter names).
    #[arg(long, value_name = "PATH")]
    dump_init: Option<PathBuf>,
}

fn summary(times: &[f64], tokens: usize) -> serde_json::Value {
    let m = median(times);
    json!({
        "times_s": times,
        "median_s": m,
        "tokens": tokens,
        "tokens_per_s": tokens as f64 / m,
    })
}

/// Features `[tokens, n·hidden]` of the real tokens of a padded batch, in sample order, on the
/// host: what a target worker writes into its feature slot.
fn target_features(
    model: &Qwen3,
    indices: &[usize],
    lengths: &[usize],
    tokens: &[u32],
    device: &Device,
) -> candle_core::Result<(Vec<f32>, usize)> {
    let (rows, width) = (lengths.len(), lengths.iter().copied().max().unwrap_or(0));
    let mut ids = vec![0u32; rows * width];
    let mut positions = vec![0u32; rows * width];
    let mut segments = vec![u32::MAX; rows * width];
    let mut at = 0;
    for (i, &len) in lengths.iter().enumerate() {
        for p in 0..len {
            let k = i * width + p;
            ids[k] = tokens[at + p];
            positions[k] = p as u32;
            segments[k] = i as u32;
        }
        at += len;
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (rows, width), device);
    let states = model
        .hidden_states(&t(ids)?, &t(positions)?, &t(segments)?, indices)
        .map_err(candle_core::Error::wrap)?;
    let all = Tensor::cat(&states, 2)?;
    let pieces = lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| all.get(i)?.narrow(0, 0, len))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let features = Tensor::cat(&pieces, 0)?;
    let columns = features.dim(1)?;
    Ok((features.flatten_all()?.to_vec1::<f32>()?, columns))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let device = Device::Cpu;
    if args.target_layer_ids.is_empty() || args.prompt >= args.seq || args.batch == 0 {
        return Err("need target layer ids, --prompt < --seq and --batch > 0".into());
    }
    let target = qwen3::read_config(&args.model)?;
    let needed = args.target_layer_ids.iter().max().map_or(0, |&l| l + 1);
    let model = Qwen3::load(&args.model, Some(needed), &device, DType::F32)?;
    let (embedding, lm_head) = qwen3::load_heads(&args.model, &device, DType::F32)?;
    let indices: Vec<usize> = args.target_layer_ids.iter().map(|l| l + 1).collect();

    // The batch: random token ids below the mask token, a prompt without loss, then loss.
    let vocab = target.vocab_size as u64;
    let mut mix = SplitMix64(args.seed ^ 0x5EED_7070_4B3E_0001);
    let lengths = vec![args.seq; args.batch];
    let total: usize = lengths.iter().sum();
    let tokens: Vec<u32> = (0..total)
        .map(|_| (mix.next_u64() % (vocab - 1)) as u32)
        .collect();
    let masks: Vec<u8> = (0..total)
        .map(|i| u8::from(i % args.seq >= args.prompt))
        .collect();

    // Target forward.
    let mut target_times = Vec::with_capacity(args.target_iters);
    let mut features = (Vec::new(), 0);
    for i in 0..args.warmup + args.target_iters {
        let started = Instant::now();
        features = target_features(&model, &indices, &lengths, &tokens, &device)?;
        let elapsed = started.elapsed().as_secs_f64();
        if i >= args.warmup {
            target_times.push(elapsed);
        }
    }
    let (values, width) = features;
    let all = Tensor::from_vec(values, (total, width), &device)?;

    // Drafter training: one micro-batch per optimiser step.
    let config = DrafterConfig::for_target(
        &target,
        args.draft_layers,
        args.block_size,
        (target.vocab_size - 1) as u32,
        args.target_layer_ids.clone(),
    );
    let drafter = Drafter::new(config.clone(), args.seed, &device)?;
    if let Some(path) = &args.dump_init {
        let map: HashMap<String, Tensor> = drafter
            .params
            .iter()
            .map(|p| (p.name.clone(), p.var.as_tensor().clone()))
            .collect();
        candle_core::safetensors::save(&map, path)?;
    }
    let vars: Vec<_> = drafter.params.iter().map(|p| p.var.clone()).collect();
    let mut opt = AdamW::new(
        vars.clone(),
        AdamWConfig {
            weight_decay: args.weight_decay,
            ..AdamWConfig::default()
        },
    )?;
    let steps = args.warmup + args.train_iters;
    let schedule = Schedule {
        peak: args.lr,
        warmup: (0.04 * steps as f64).round() as u64,
        total: steps as u64,
    };
    let mut accum = Accumulator::default();
    let (mut train_times, mut losses, mut grad_norms, mut lrs, mut all_anchors) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for step in 0..steps {
        let started = Instant::now();
        let mut step_anchors = Vec::with_capacity(args.batch);
        let mut sequences = Vec::with_capacity(args.batch);
        let mut offset = 0;
        for (i, &len) in lengths.iter().enumerate() {
            let range = offset..offset + len;
            offset += len;
            let picked = sample_anchors(
                &masks[range.clone()],
                args.num_anchors,
                args.seed,
                step as u64,
                i as u64,
            );
            if !picked.is_empty() {
                sequences.push((range, picked.clone()));
            }
            step_anchors.push(picked);
        }
        // The drafter stage's own training step (worker/src/dflash.rs).
        let lr = schedule.lr(step as u64);
        let (loss, norm) = train_step(
            &drafter,
            &mut opt,
            &mut accum,
            MicroBatch {
                features: &all,
                tokens: &tokens,
                loss_mask: &masks,
                sequences: &sequences,
            },
            Heads {
                embedding: &embedding,
                lm_head: &lm_head,
            },
            Objective {
                gamma: args.gamma,
                distill: None,
                dpace: None,
            },
            args.anchor_chunk,
            (args.clip, lr),
        )?;
        let elapsed = started.elapsed().as_secs_f64();
        if step >= args.warmup {
            train_times.push(elapsed);
        }
        losses.push(loss);
        grad_norms.push(norm);
        lrs.push(lr);
        all_anchors.push(step_anchors);
    }

    let out = json!({
        "threads": candle_core::utils::get_num_threads(),
        "candle": "0.11",
        "workload": {
            "model": args.model,
            "vocab": target.vocab_size,
            "hidden": target.hidden_size,
            "target_layers": target.num_hidden_layers,
            "target_layers_run": needed,
            "batch": args.batch,
            "seq": args.seq,
            "prompt": args.prompt,
            "target_layer_ids": args.target_layer_ids,
            "draft_layers": args.draft_layers,
            "block_size": args.block_size,
            "num_anchors": args.num_anchors,
            "mask_token_id": config.mask_token_id,
            "gamma": args.gamma,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "clip": args.clip,
            "seed": args.seed,
            "warmup": args.warmup,
        },
        "tokens": tokens,
        "loss_mask": masks,
        "lengths": lengths,
        "target": summary(&target_times, total),
        "drafter": {
            "timing": summary(&train_times, total),
            "losses": losses,
            "grad_norms": grad_norms,
            "lrs": lrs,
            "anchors": all_anchors,
        },
    });
    println!("{out}");
    Ok(())
}
