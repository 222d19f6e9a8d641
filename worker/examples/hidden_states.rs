//! Prints the hidden states of a Qwen3 target for given tokens, as JSON: what
//! `scripts/target-parity` compares against `transformers`.
//!
//! ```sh
//! cargo run --release -p dflash-worker --example hidden_states -- MODEL_DIR 1,2,3,4 0,2,4
//! ```
//! prints `{"indices": [...], "hidden_states": [[[f32; hidden]; tokens]; indices]}`.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use dflash_worker::model::qwen3::Qwen3;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, dir, tokens, indices] = args.as_slice() else {
        return Err("usage: hidden_states MODEL_DIR TOKENS(1,2,3) INDICES(0,2)".into());
    };
    let parse = |s: &str| -> Result<Vec<u32>, std::num::ParseIntError> {
        s.split(',').map(|x| x.trim().parse()).collect()
    };
    let tokens = parse(tokens)?;
    let indices: Vec<usize> = parse(indices)?.into_iter().map(|i| i as usize).collect();
    let device = Device::Cpu;
    let model = Qwen3::load(&PathBuf::from(dir), None, &device, DType::F32)?;
    let n = tokens.len();
    let ids = Tensor::from_vec(tokens, (1, n), &device)?;
    let positions = Tensor::arange(0u32, n as u32, &device)?.reshape((1, n))?;
    let segments = Tensor::zeros((1, n), DType::U32, &device)?;
    let states = model.hidden_states(&ids, &positions, &segments, &indices)?;
    let values: Vec<Vec<Vec<f32>>> = states
        .iter()
        .map(|t| t.squeeze(0)?.to_vec2::<f32>())
        .collect::<Result<_, _>>()?;
    println!(
        "{}",
        serde_json::json!({ "indices": indices, "hidden_states": values })
    );
    Ok(())
}
