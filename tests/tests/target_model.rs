//! The Qwen3 target on the tiny model `dflash-orch init-tiny` writes: shapes, causality, and that a
//! packed batch (sequences concatenated, attention confined to each) gives exactly the hidden
//! states of the sequences run alone.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_e2e::{assert_refused, orch, stdout_ok};
use dflash_worker::model::qwen3::{Qwen3, read_config};

fn tiny(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("tiny");
    let o = orch(&["init-tiny", "--output", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// Hidden states `indices` of one sequence run alone: `[index][position][hidden]`.
fn alone(model: &Qwen3, tokens: &[u32], indices: &[usize]) -> Vec<Vec<Vec<f32>>> {
    let d = Device::Cpu;
    let n = tokens.len();
    let ids = Tensor::from_vec(tokens.to_vec(), (1, n), &d).unwrap();
    let pos = Tensor::arange(0u32, n as u32, &d)
        .unwrap()
        .reshape((1, n))
        .unwrap();
    let seg = Tensor::zeros((1, n), DType::U32, &d).unwrap();
    model
        .hidden_states(&ids, &pos, &seg, indices)
        .unwrap()
        .iter()
        .map(|t| t.squeeze(0).unwrap().to_vec2::<f32>().unwrap())
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

#[test]
fn packed_batches_match_sequences_run_alone_and_attention_is_causal() {
    let dir = tempfile::tempdir().unwrap();
    let model = Qwen3::load(&tiny(dir.path()), None, &Device::Cpu).unwrap();
    let layers = model.config.num_hidden_layers;
    let indices: Vec<usize> = (0..=layers).collect();
    let a: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 600).collect();
    let b: Vec<u32> = (0..6).map(|i| (i * 53 + 11) % 600).collect();
    let ha = alone(&model, &a, &indices);
    let hb = alone(&model, &b, &indices);
    assert_eq!(ha.len(), layers + 1);
    assert_eq!((ha[0].len(), ha[0][0].len()), (9, model.config.hidden_size));

    // Packed: one row, segments 0 then 1, positions restarting.
    let d = Device::Cpu;
    let tokens: Vec<u32> = a.iter().chain(&b).copied().collect();
    let positions: Vec<u32> = (0..9).chain(0..6).collect();
    let segments: Vec<u32> = [vec![0; 9], vec![1; 6]].concat();
    let packed = model
        .hidden_states(
            &Tensor::from_vec(tokens, (1, 15), &d).unwrap(),
            &Tensor::from_vec(positions, (1, 15), &d).unwrap(),
            &Tensor::from_vec(segments, (1, 15), &d).unwrap(),
            &indices,
        )
        .unwrap();
    for (k, state) in packed.iter().enumerate() {
        let rows = state.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
        assert!(max_diff(&rows[..9], &ha[k]) < 1e-5, "index {k}, sequence a");
        assert!(max_diff(&rows[9..], &hb[k]) < 1e-5, "index {k}, sequence b");
    }

    // Causal: tokens appended later do not change earlier positions.
    let longer: Vec<u32> = a.iter().copied().chain([1, 2, 3]).collect();
    let hl = alone(&model, &longer, &indices);
    for k in 0..=layers {
        assert!(max_diff(&hl[k][..9], &ha[k]) < 1e-5, "index {k}");
        assert!(
            max_diff(&hl[k][9..], &ha[k][..3]) > 1e-4,
            "index {k} depends on the tokens"
        );
    }

    // Loading fewer layers gives the same early hidden states.
    let two = Qwen3::load(&dir.path().join("tiny"), Some(2), &Device::Cpu).unwrap();
    let h2 = alone(&two, &a, &[0, 1, 2]);
    for k in 0..=2 {
        assert!(max_diff(&h2[k], &ha[k]) < 1e-6);
    }
}

#[test]
fn init_tiny_is_deterministic_and_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let a = tiny(dir.path());
    let b = dir.path().join("again");
    stdout_ok(&orch(&["init-tiny", "--output", b.to_str().unwrap()]));
    assert_eq!(
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(b.join("model.safetensors")).unwrap()
    );
    let c = dir.path().join("other");
    stdout_ok(&orch(&[
        "init-tiny",
        "--output",
        c.to_str().unwrap(),
        "--seed",
        "1",
    ]));
    assert_ne!(
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(c.join("model.safetensors")).unwrap()
    );
    assert_refused(
        &orch(&["init-tiny", "--output", a.to_str().unwrap()]),
        2,
        "already exists",
    );
    let config = read_config(&a).unwrap();
    assert_eq!(config.vocab_size, 600);
}

#[test]
fn bad_model_directories_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let load = |p: &Path| {
        Qwen3::load(p, None, &Device::Cpu)
            .err()
            .expect("refused")
            .to_string()
    };
    let missing = dir.path().join("missing");
    assert!(load(&missing).contains("config.json"), "{}", load(&missing));
    // No weights.
    let no_weights = dir.path().join("no-weights");
    std::fs::create_dir(&no_weights).unwrap();
    std::fs::copy(model.join("config.json"), no_weights.join("config.json")).unwrap();
    assert!(load(&no_weights).contains("neither model.safetensors"));
    // Another architecture.
    let text = std::fs::read_to_string(model.join("config.json")).unwrap();
    std::fs::write(
        model.join("config.json"),
        text.replace("Qwen3ForCausalLM", "LlamaForCausalLM"),
    )
    .unwrap();
    assert!(load(&model).contains("unsupported architecture"));
    // Weights that do not match the config.
    std::fs::write(
        model.join("config.json"),
        text.replace("\"hidden_size\": 64", "\"hidden_size\": 96"),
    )
    .unwrap();
    assert!(
        load(&model).contains("do not match config.json"),
        "{}",
        load(&model)
    );
}
