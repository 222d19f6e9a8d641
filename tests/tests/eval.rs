//! `dflash-orch eval` end to end: a drafter checkpoint, the tiny target and a prompts file give
//! τ, the histogram, the speedup and a passed lossless check; a drafter made for another target
//! and prompts the target cannot take are refused before any worker starts, naming the fault.

use std::path::{Path, PathBuf};

use candle_core::Device;
use dflash_e2e::{assert_refused, orch, stdout_ok};
use dflash_worker::checkpoint;
use dflash_worker::model::drafter::{Drafter, DrafterConfig};
use dflash_worker::model::qwen3::read_config;
use serde_json::Value;

struct Setup {
    _dir: tempfile::TempDir,
    target: PathBuf,
    drafter: PathBuf,
    prompts: PathBuf,
    root: PathBuf,
}

/// The tiny target, a random drafter saved as a training run saves it, and three prompts.
fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny");
    stdout_ok(&orch(&["init-tiny", "--output", target.to_str().unwrap()]));
    let c = read_config(&target).unwrap();
    let drafter = Drafter::new(
        DrafterConfig::for_target(&c, 1, 8, 5, vec![1, 2]),
        3,
        &Device::Cpu,
    )
    .unwrap();
    let weights = checkpoint::weights(&drafter).unwrap();
    let root = dir.path().join("run").join("checkpoints");
    let saved = checkpoint::save(
        &root,
        &checkpoint::Snapshot {
            state: checkpoint::TrainingState::default(),
            weights,
            moments: Vec::new(),
            config: checkpoint::hf_config(&drafter, &c),
        },
        1,
    )
    .unwrap();
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"input_ids\": [3, 40, 41, 42, 43]}\n\n{\"input_ids\": [3, 100, 7]}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"Spell river.\"}, {\"role\": \"assistant\", \"content\": \"R-I-V-E-R\"}]}\n",
    )
    .unwrap();
    Setup {
        _dir: dir,
        target,
        drafter: saved,
        prompts,
        root,
    }
}

fn eval(s: &Setup, drafter: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "eval",
        "--target-model",
        s.target.to_str().unwrap(),
        "--drafter",
        drafter.to_str().unwrap(),
        "--prompts",
        s.prompts.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    orch(&args)
}

#[test]
fn eval_reports_tau_speedup_and_a_lossless_output() {
    let s = setup();
    // The run directory names its latest checkpoint.
    let run = s.root.parent().unwrap();
    let out = eval(
        &s,
        run,
        &["--max-new-tokens", "24", "--ignore-eos", "--json"],
    );
    let v: Value = serde_json::from_str(&stdout_ok(&out)).unwrap();
    assert_eq!(v["prompts"], 3);
    assert_eq!(v["block_size"], 8);
    assert_eq!(v["lossless"], true, "{v}");
    let per = v["per_prompt"].as_array().unwrap();
    assert_eq!(
        per.iter()
            .map(|p| p["line"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![1, 3, 4]
    );
    for p in per {
        assert_eq!(p["output_ids"].as_array().unwrap().len(), 24, "{p}");
        // 23 tokens after the prefill's, at 1 to 8 a step.
        let (tau, steps) = (p["tau"].as_f64().unwrap(), p["steps"].as_f64().unwrap());
        assert!((tau * steps - 23.0).abs() < 1e-9, "{p}");
    }
    let tau = v["tau"].as_f64().unwrap();
    assert!((1.0..=8.0).contains(&tau), "{tau}");
    let hist: Vec<f64> = v["histogram"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_f64().unwrap())
        .collect();
    assert_eq!(hist.len(), 8);
    assert!((hist.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    assert!(v["speedup"].as_f64().unwrap() > 0.0);

    // The text report, with a block size of its own and the target's end-of-sequence token.
    let out = eval(
        &s,
        &s.drafter,
        &["--max-new-tokens", "8", "--block-size", "4"],
    );
    let text = stdout_ok(&out);
    assert!(text.contains("block 4"), "{text}");
    assert!(text.contains("τ"), "{text}");
    assert!(text.contains("lossless: yes"), "{text}");
}

/// Edits the checkpoint's config.json into a copy.
fn edited(s: &Setup, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let dir = s.root.parent().unwrap().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        s.drafter.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(s.drafter.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn a_drafter_for_another_target_is_refused() {
    let s = setup();
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "layers",
            Box::new(|c| c["dflash_config"]["target_layer_ids"] = serde_json::json!([1, 9])),
            "names layer 9",
        ),
        (
            "hidden",
            Box::new(|c| c["hidden_size"] = 128.into()),
            "hidden size is 128",
        ),
        (
            "vocab",
            Box::new(|c| c["vocab_size"] = 1000.into()),
            "vocabulary has 1000 tokens",
        ),
        (
            "mask",
            Box::new(|c| c["dflash_config"]["mask_token_id"] = 600.into()),
            "mask_token_id 600 is outside the target's embedding",
        ),
        (
            "depth",
            Box::new(|c| c["num_target_layers"] = 36.into()),
            "36 layers",
        ),
    ];
    for (name, edit, want) in cases {
        let dir = edited(&s, name, edit);
        assert_refused(&eval(&s, &dir, &["--max-new-tokens", "4"]), 2, want);
    }
    // Weights that do not fit their config.json: the worker names the tensor.
    let dir = edited(&s, "shape", |c| c["intermediate_size"] = 64.into());
    let out = eval(&s, &dir, &["--max-new-tokens", "4"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mlp.gate_proj.weight has shape"), "{err}");
    assert_refused(
        &eval(&s, &s.root.join("nothing"), &[]),
        2,
        "no checkpoint there",
    );
}

#[test]
fn prompts_the_target_cannot_take_are_refused() {
    let s = setup();
    let context = read_config(&s.target)
        .unwrap()
        .max_position_embeddings
        .unwrap();
    let max_new = (context - 4).to_string();
    assert_refused(
        &eval(&s, &s.drafter, &["--max-new-tokens", &max_new]),
        2,
        &format!(
            "prompts.jsonl:1: 5 prompt tokens plus --max-new-tokens {max_new} exceed the target's context of {context} tokens"
        ),
    );
    std::fs::write(
        &s.prompts,
        "{\"input_ids\": [3, 4]}\n{\"input_ids\": [3, 600]}\n",
    )
    .unwrap();
    assert_refused(
        &eval(&s, &s.drafter, &[]),
        2,
        "prompts.jsonl:2: token id 600 is outside the target's vocabulary",
    );
    std::fs::write(&s.prompts, "{\"input_ids\": [3, 4]}\n").unwrap();
    assert_refused(
        &eval(&s, &s.drafter, &["--stop-token-ids", "2,900"]),
        2,
        "--stop-token-ids: 900",
    );
}
