//! The Qwen3 target on the tiny model `dflash-orch init-tiny` writes: shapes, causality, and that a
//! packed batch (sequences concatenated, attention confined to each) gives exactly the hidden
//! states of the sequences run alone.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_e2e::{assert_refused, hidden_states_alone, orch, stdout_ok};
use dflash_worker::model::max_abs_diff;
use dflash_worker::model::qwen3::{AttentionMode, KvCache, Qwen3, read_config};

fn tiny(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("tiny");
    let o = orch(&["init-tiny", "--output", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// Hidden states `indices` of one sequence run alone: `[index][position][hidden]`.
fn alone(model: &Qwen3, tokens: &[u32], indices: &[usize]) -> Vec<Vec<Vec<f32>>> {
    hidden_states_alone(model, tokens, indices)
        .iter()
        .map(|t| t.to_vec2::<f32>().unwrap())
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
    let model = Qwen3::load(&tiny(dir.path()), None, &Device::Cpu, DType::F32).unwrap();
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
    let two = Qwen3::load(&dir.path().join("tiny"), Some(2), &Device::Cpu, DType::F32).unwrap();
    let h2 = alone(&two, &a, &[0, 1, 2]);
    for k in 0..=2 {
        assert!(max_diff(&h2[k], &ha[k]) < 1e-6);
    }
}

/// Hidden states of a batch (`[rows, width]` of tokens, positions and segments) in `mode`:
/// `[index][row][position][hidden]`.
fn states_in(
    model: &mut Qwen3,
    mode: AttentionMode,
    rows: &[Vec<(u32, u32, u32)>],
    indices: &[usize],
) -> Vec<Tensor> {
    model.set_attention(mode);
    let d = Device::Cpu;
    let (b, s) = (rows.len(), rows[0].len());
    let column = |f: fn(&(u32, u32, u32)) -> u32| {
        let v: Vec<u32> = rows.iter().flat_map(|r| r.iter().map(f)).collect();
        Tensor::from_vec(v, (b, s), &d).unwrap()
    };
    model
        .hidden_states(
            &column(|t| t.0),
            &column(|t| t.1),
            &column(|t| t.2),
            indices,
        )
        .unwrap()
}

/// The tiled attention (tiles of 4, so segments of 1, 3, 4, 5, 11 and 23 tokens cross tile
/// edges and end mid-tile) gives the dense attention's hidden states within 1e-5 through the
/// whole model (grouped-query heads), packed and padded, padding included.
#[test]
fn tiled_attention_matches_dense_through_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = Qwen3::load(&tiny(dir.path()), None, &Device::Cpu, DType::F32).unwrap();
    let c = &model.config;
    assert!(
        c.num_attention_heads > c.num_key_value_heads,
        "grouped-query heads"
    );
    let indices: Vec<usize> = (0..=c.num_hidden_layers).collect();
    let lengths = [5usize, 1, 23, 4, 3, 11];
    let token = |i: usize, p: usize| ((i * 97 + p * 31 + 7) % 599) as u32;
    // Packed: one row, positions restarting per segment.
    let packed = vec![
        lengths
            .iter()
            .enumerate()
            .flat_map(|(i, &n)| (0..n).map(move |p| (token(i, p), p as u32, i as u32)))
            .collect::<Vec<_>>(),
    ];
    // Padded: one row per sequence, padding in a segment of its own.
    let width = *lengths.iter().max().unwrap();
    let padded: Vec<Vec<(u32, u32, u32)>> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..width)
                .map(|p| {
                    if p < n {
                        (token(i, p), p as u32, i as u32)
                    } else {
                        (0, 0, u32::MAX)
                    }
                })
                .collect()
        })
        .collect();
    for (what, rows) in [("packed", &packed), ("padded", &padded)] {
        let dense = states_in(&mut model, AttentionMode::Dense, rows, &indices);
        for tile in [4, 7, 64] {
            let tiled = states_in(&mut model, AttentionMode::Tiled(tile), rows, &indices);
            for (k, (a, b)) in dense.iter().zip(&tiled).enumerate() {
                let diff = max_abs_diff(a, b).unwrap();
                assert!(diff < 1e-5, "{what}, tile {tile}, index {k}: {diff}");
            }
        }
    }
}

/// A bf16 checkpoint loads as bf16 (the weights are not widened) and its hidden states follow
/// the f32 model's within bf16's precision.
#[test]
fn a_bf16_checkpoint_runs_in_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let f32_dir = tiny(dir.path());
    let bf16_dir = dir.path().join("bf16");
    stdout_ok(&orch(&[
        "init-tiny",
        "--output",
        bf16_dir.to_str().unwrap(),
        "--dtype",
        "bf16",
    ]));
    let text = std::fs::read(bf16_dir.join("model.safetensors")).unwrap();
    let len = u64::from_le_bytes(text[..8].try_into().unwrap()) as usize;
    let meta: serde_json::Value = serde_json::from_slice(&text[8..8 + len]).unwrap();
    assert_eq!(meta["model.embed_tokens.weight"]["dtype"], "BF16");
    let full = Qwen3::load(&f32_dir, None, &Device::Cpu, DType::F32).unwrap();
    let half = Qwen3::load(&bf16_dir, None, &Device::Cpu, DType::BF16).unwrap();
    assert_eq!(half.dtype(), DType::BF16);
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 600).collect();
    let d = Device::Cpu;
    let ids = Tensor::from_vec(tokens, (1, 40), &d).unwrap();
    let pos = Tensor::arange(0u32, 40, &d)
        .unwrap()
        .reshape((1, 40))
        .unwrap();
    let seg = Tensor::zeros((1, 40), DType::U32, &d).unwrap();
    let last = full.config.num_hidden_layers;
    let a = &full.hidden_states(&ids, &pos, &seg, &[last]).unwrap()[0];
    let b = &half.hidden_states(&ids, &pos, &seg, &[last]).unwrap()[0];
    assert_eq!(b.dtype(), DType::BF16);
    let scale = max_abs_diff(a, &a.zeros_like().unwrap()).unwrap();
    let diff = max_abs_diff(a, b).unwrap();
    assert!(
        diff < 0.05 * scale,
        "bf16 differs by {diff} (scale {scale})"
    );
}

/// Decoding with a KV cache (a prefill, then one token at a time, then blocks) gives the hidden
/// states of running each whole sequence at once, within 1e-5 in f32: alone and with two
/// sequences packed in one call, with tiles of 4 so that cached prefixes end mid-tile.
#[test]
fn kv_cache_decoding_equals_full_recomputation() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = Qwen3::load(&tiny(dir.path()), None, &Device::Cpu, DType::F32).unwrap();
    model.set_attention(AttentionMode::Tiled(4));
    let layers = model.config.num_hidden_layers;
    let indices: Vec<usize> = (0..=layers).collect();
    let a: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 600).collect();
    let b: Vec<u32> = (0..13).map(|i| (i * 53 + 11) % 600).collect();
    let (ha, hb) = (alone(&model, &a, &indices), alone(&model, &b, &indices));
    let check = |got: &[Tensor], want: &[Vec<Vec<f32>>], from: usize, what: &str| {
        for (k, state) in got.iter().enumerate() {
            let rows = state.to_vec2::<f32>().unwrap();
            let diff = max_diff(&rows, &want[k][from..from + rows.len()]);
            assert!(diff < 1e-5, "{what}, index {k}, from {from}: {diff}");
        }
    };
    // Alone: prefill 5, then single tokens to 12, then blocks of 4 (the last one shorter).
    let mut cache = KvCache::default();
    let mut at = 0;
    for step in [5, 1, 1, 1, 1, 1, 1, 1, 4, 4, 3] {
        let got = model
            .extend(
                std::slice::from_mut(&mut cache),
                &[&a[at..at + step]],
                &indices,
            )
            .unwrap();
        check(&got[0], &ha, at, "alone");
        at += step;
        assert_eq!(cache.len(), at);
    }
    // Packed: both sequences in each call, with steps of different sizes.
    let mut caches = vec![KvCache::default(), KvCache::default()];
    let (mut at_a, mut at_b) = (0, 0);
    for (sa, sb) in [(7, 3), (1, 1), (4, 2), (1, 5), (10, 2)] {
        let got = model
            .extend(
                &mut caches,
                &[&a[at_a..at_a + sa], &b[at_b..at_b + sb]],
                &indices,
            )
            .unwrap();
        check(&got[0], &ha, at_a, "packed a");
        check(&got[1], &hb, at_b, "packed b");
        at_a += sa;
        at_b += sb;
    }
    assert_eq!((at_a, at_b), (23, 13));
    // Bad calls are errors, not panics.
    assert!(model.extend(&mut caches, &[&a[..1]], &indices).is_err());
    assert!(model.extend(&mut caches[..1], &[&[]], &indices).is_err());
    assert!(model.extend(&mut caches[..1], &[&[600]], &indices).is_err());
    assert!(
        model
            .extend(&mut caches[..1], &[&[1]], &[layers + 1])
            .is_err()
    );
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
        Qwen3::load(p, None, &Device::Cpu, DType::F32)
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
