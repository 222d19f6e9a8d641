//! `dflash-orch init-tiny`'s shape options through the real binary: presets, explicit sizes, the
//! weights' dtype, what config.json and the safetensors header say, and clean refusals.

use std::collections::BTreeMap;
use std::path::Path;

use dflash_e2e::{assert_refused, orch, stdout_ok};
use serde_json::Value;

/// `name -> (dtype, shape)` from a safetensors file's header, and its `__metadata__`.
fn header(path: &Path) -> (BTreeMap<String, (String, Vec<u64>)>, Value) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let table: BTreeMap<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut tensors = BTreeMap::new();
    let mut metadata = Value::Null;
    let mut end = 0;
    for (name, v) in table {
        if name == "__metadata__" {
            metadata = v;
            continue;
        }
        let shape: Vec<u64> = serde_json::from_value(v["shape"].clone()).unwrap();
        end = end.max(v["data_offsets"][1].as_u64().unwrap());
        tensors.insert(name, (v["dtype"].as_str().unwrap().to_owned(), shape));
    }
    assert_eq!(
        8 + n as u64 + end,
        bytes.len() as u64,
        "data fills the file"
    );
    (tensors, metadata)
}

fn config(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn explicit_shape_options_reach_config_json_and_the_safetensors_header() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("scale");
    stdout_ok(&orch(&[
        "init-tiny",
        "--output",
        out.to_str().unwrap(),
        "--hidden-size",
        "96",
        "--layers",
        "3",
        "--heads",
        "6",
        "--kv-heads",
        "2",
        "--head-dim",
        "24",
        "--intermediate",
        "200",
        "--vocab",
        "1000",
    ]));
    let c = config(&out);
    for (field, want) in [
        ("hidden_size", 96),
        ("num_hidden_layers", 3),
        ("num_attention_heads", 6),
        ("num_key_value_heads", 2),
        ("head_dim", 24),
        ("intermediate_size", 200),
        ("vocab_size", 1000),
    ] {
        assert_eq!(c[field], want, "{field}");
    }
    assert_eq!(c["torch_dtype"], "float32");
    assert_eq!(c["tie_word_embeddings"], false);
    let (tensors, metadata) = header(&out.join("model.safetensors"));
    assert_eq!(metadata["format"], "pt");
    let shape = |name: &str| tensors[name].1.clone();
    assert_eq!(shape("model.embed_tokens.weight"), [1000, 96]);
    assert_eq!(shape("lm_head.weight"), [1000, 96]);
    assert_eq!(shape("model.layers.2.self_attn.q_proj.weight"), [144, 96]);
    assert_eq!(shape("model.layers.2.self_attn.k_proj.weight"), [48, 96]);
    assert_eq!(shape("model.layers.2.self_attn.o_proj.weight"), [96, 144]);
    assert_eq!(shape("model.layers.2.self_attn.q_norm.weight"), [24]);
    assert_eq!(shape("model.layers.2.mlp.down_proj.weight"), [96, 200]);
    assert!(!tensors.contains_key("model.layers.3.input_layernorm.weight"));
    assert_eq!(tensors.len(), 2 + 3 * 11 + 1);
    assert!(tensors.values().all(|(dtype, _)| dtype == "F32"));
}

/// The real Qwen3-0.6B shape, cut to two layers, a smaller hidden size and vocabulary, in bf16:
/// the preset's heads and config fields stay, and the tied embedding has no lm_head tensor.
#[test]
fn the_qwen3_preset_with_overrides_in_bf16_keeps_the_rest_of_its_shape() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q");
    stdout_ok(&orch(&[
        "init-tiny",
        "--output",
        out.to_str().unwrap(),
        "--preset",
        "qwen3-0.6b",
        "--layers",
        "2",
        "--vocab",
        "4096",
        "--hidden-size",
        "128",
        "--intermediate",
        "256",
        "--dtype",
        "bf16",
    ]));
    let c = config(&out);
    assert_eq!(c["num_attention_heads"], 16);
    assert_eq!(c["num_key_value_heads"], 8);
    assert_eq!(c["head_dim"], 128);
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["max_position_embeddings"], 40960);
    assert_eq!(c["rope_theta"], 1_000_000.0);
    assert_eq!(c["rms_norm_eps"], 1e-6);
    assert_eq!(c["torch_dtype"], "bfloat16");
    let (tensors, _) = header(&out.join("model.safetensors"));
    assert!(!tensors.contains_key("lm_head.weight"));
    assert_eq!(tensors["model.embed_tokens.weight"].1, [4096, 128]);
    assert_eq!(
        tensors["model.layers.1.self_attn.q_proj.weight"].1,
        [2048, 128]
    );
    assert!(tensors.values().all(|(dtype, _)| dtype == "BF16"));
}

#[test]
fn the_tiny_preset_is_the_default_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    stdout_ok(&orch(&["init-tiny", "--output", a.to_str().unwrap()]));
    stdout_ok(&orch(&[
        "init-tiny",
        "--output",
        b.to_str().unwrap(),
        "--preset",
        "tiny",
        "--dtype",
        "f32",
    ]));
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(
            std::fs::read(a.join(file)).unwrap() == std::fs::read(b.join(file)).unwrap(),
            "{file} differs"
        );
    }
}

#[test]
fn bad_shapes_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never");
    let path = out.to_str().unwrap();
    for (extra, needle) in [
        (&["--heads", "0"][..], "--heads"),
        (&["--kv-heads", "nine"][..], "--kv-heads"),
        (&["--head-dim", "5000"][..], "--head-dim"),
        (&["--intermediate", "0"][..], "--intermediate"),
        (&["--vocab", "99999999"][..], "--vocab"),
        (&["--preset", "llama"][..], "--preset"),
        (&["--dtype", "fp8"][..], "--dtype"),
        (
            &["--heads", "6", "--kv-heads", "4"][..],
            "not a multiple of --kv-heads",
        ),
        (&["--head-dim", "7"][..], "odd"),
        (
            &["--vocab", "100"][..],
            "smaller than the bundled tokenizer",
        ),
    ] {
        let mut args = vec!["init-tiny", "--output", path];
        args.extend(extra);
        assert_refused(&orch(&args), 2, needle);
        assert!(!out.exists(), "{extra:?} wrote {}", out.display());
    }
    // Nothing half-made is left beside it either.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
