//! `launch --dry-run`: the memory plan, printed and as JSON, without a side effect; the fit
//! against the GPUs' memory and what a launch would refuse; bad values refused.

use std::path::{Path, PathBuf};

use dflash_e2e::{assert_refused, orch, stdout_ok};
use serde_json::Value;

/// A Qwen3-8B-shaped target: its config.json alone (a dry run plans from the shape).
fn qwen3_8b(dir: &Path) -> PathBuf {
    let model = dir.join("qwen3-8b");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": false
        })
        .to_string(),
    )
    .unwrap();
    model
}

fn dry_run(target: &Path, run_dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "launch",
        "--dry-run",
        "--stage",
        "dflash",
        "--synthetic",
        "100",
        "--target-model",
        target.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    orch(&args)
}

/// The plan as JSON, whether a launch would start or not (this machine's worker binary has no
/// CUDA and its /dev/shm may be small: GPU plans list those refusals).
fn plan_json(target: &Path, run_dir: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    let out = dry_run(target, run_dir, &args);
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_dry_run_prints_the_plan_and_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny");
    stdout_ok(&orch(&["init-tiny", "--output", target.to_str().unwrap()]));
    let run_dir = dir.path().join("run");
    let flags = [
        "--gpus",
        "cpu:3",
        "--max-len",
        "64",
        "--token-budget",
        "512",
    ];
    let text = stdout_ok(&dry_run(&target, &run_dir, &flags));
    for needle in [
        "weights",
        "activations",
        "drafter",
        "/dev/shm",
        "a launch would start",
    ] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    let plan = plan_json(&target, &run_dir, &flags);
    assert!(plan["refusals"].as_array().unwrap().is_empty(), "{plan}");
    assert_eq!(
        plan["dtype"], "f32",
        "CPU workers compute in f32 by default"
    );
    assert!(plan["plan"]["target"]["total"].as_u64().unwrap() > 0);
    assert!(plan["plan"]["drafter"]["optimiser"].as_u64().unwrap() > 0);
    assert!(plan["shm_bytes"].as_u64().unwrap() > 0);
    // The torch target packs its rows by default on GPUs only, or as told.
    assert_eq!(plan["target_packing"], false, "{plan}");
    assert!(
        text.contains("torch target in rows of one length"),
        "{text}"
    );
    let packed = [&flags[..], &["--target-packing", "on"]].concat();
    assert_eq!(
        plan_json(&target, &run_dir, &packed)["target_packing"],
        true
    );
    assert!(
        stdout_ok(&dry_run(&target, &run_dir, &packed)).contains("torch target in packed rows")
    );
    let gpus = ["--gpus", "0-1", "--gpu-memory", "80", "--max-len", "64"];
    assert_eq!(plan_json(&target, &run_dir, &gpus)["target_packing"], true);
    let off = [&gpus[..], &["--target-packing", "off"]].concat();
    assert_eq!(plan_json(&target, &run_dir, &off)["target_packing"], false);
    // The torch drafter compiles its chains by default on GPUs only, or as told.
    assert_eq!(plan["drafter_compile"], false, "{plan}");
    assert!(text.contains("torch drafter eager"), "{text}");
    let compiled = [&flags[..], &["--drafter-compile", "on"]].concat();
    assert_eq!(
        plan_json(&target, &run_dir, &compiled)["drafter_compile"],
        true
    );
    assert!(stdout_ok(&dry_run(&target, &run_dir, &compiled)).contains("torch drafter compiled"));
    assert_eq!(plan_json(&target, &run_dir, &gpus)["drafter_compile"], true);
    let eager = [&gpus[..], &["--drafter-compile", "off"]].concat();
    assert_eq!(
        plan_json(&target, &run_dir, &eager)["drafter_compile"],
        false
    );
    let bad = dry_run(
        &target,
        &run_dir,
        &[&flags[..], &["--target-packing", "yes"]].concat(),
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("\"yes\" is not auto, on or off"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(!run_dir.exists(), "a dry run creates no run directory");
}

/// At the seeds' settings the batch-dependent memory grows linearly with the budget, bf16
/// halves the features, and the chunk is chosen automatically.
#[test]
fn the_plan_is_linear_in_the_budget_and_follows_the_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    let target = qwen3_8b(dir.path());
    let run_dir = dir.path().join("run");
    let at = |budget: &str, dtype: &str| {
        plan_json(
            &target,
            &run_dir,
            &[
                "--gpus",
                "0-7",
                "--gpu-memory",
                "141",
                "--token-budget",
                budget,
                "--max-len",
                "8192",
                "--feature-dtype",
                dtype,
                "--dtype",
                "bf16",
            ],
        )
    };
    let small = at("16384", "bf16");
    let large = at("32768", "bf16");
    let n = |v: &Value, w: &str, k: &str| v["plan"][w][k].as_u64().unwrap();
    for k in ["activations", "features"] {
        assert_eq!(2 * n(&small, "target", k), n(&large, "target", k), "{k}");
    }
    assert_eq!(
        n(&small, "target", "weights"),
        n(&large, "target", "weights")
    );
    let f32_features = at("16384", "f32");
    assert!(n(&f32_features, "drafter", "features") > n(&small, "drafter", "features"));
    // Distillation: the target's last hidden state joins the 5 layers' (6/5 of the features),
    // every layer of the target runs, and the teacher's logits join the drafter's.
    let distilled = plan_json(
        &target,
        &run_dir,
        &[
            "--gpus",
            "0-7",
            "--gpu-memory",
            "141",
            "--token-budget",
            "16384",
            "--max-len",
            "8192",
            "--feature-dtype",
            "bf16",
            "--dtype",
            "bf16",
            "--loss",
            "kd",
        ],
    );
    assert_eq!(
        5 * n(&distilled, "drafter", "features"),
        6 * n(&small, "drafter", "features")
    );
    assert!(n(&distilled, "target", "weights") > n(&small, "target", "weights"));
    assert!(distilled["shm_bytes"].as_u64() > small["shm_bytes"].as_u64());
    let chunk = small["plan"]["anchor_chunk"].as_u64().expect("a chunk");
    assert!((1..512).contains(&chunk), "{chunk}");
    assert_eq!(small["gpus"].as_array().unwrap().len(), 8);
}

/// `--anchor-chunk auto` for the torch drafter on GPUs of given memory, at the seeds' settings:
/// chunks only where memory demands them. An H200 (141 GiB) runs an 8,192-token micro-batch's
/// 6 x 512 anchors in one pass, an 80 GiB GPU fewer at once; each drafter fits its GPU, and an
/// explicit count is kept as given.
#[test]
fn the_torch_drafters_chunk_follows_the_gpus_memory() {
    let dir = tempfile::tempdir().unwrap();
    let target = qwen3_8b(dir.path());
    let run_dir = dir.path().join("run");
    let python = dflash_e2e::test_python();
    let at = |memory: &str, extra: &[&str]| {
        let mut args = vec![
            "--gpus",
            "0-7",
            "--gpu-memory",
            memory,
            "--token-budget",
            "49152",
            "--max-len",
            "8192",
            "--num-anchors",
            "512",
            "--draft-layers",
            "5",
            "--engine",
            "torch",
            "--python",
            python.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        plan_json(&target, &run_dir, &args)
    };
    let chunk = |v: &Value| v["plan"]["anchor_chunk"].as_u64().expect("a chunk");
    let (h200, h100) = (at("141", &[]), at("80", &[]));
    assert!(chunk(&h200) >= 6 * 512, "{}", h200["plan"]);
    assert!((512..6 * 512).contains(&chunk(&h100)), "{}", h100["plan"]);
    for (v, memory) in [(&h200, 141u64), (&h100, 80)] {
        for g in v["gpus"].as_array().unwrap() {
            assert!(g["need"].as_u64().unwrap() <= memory << 30, "{g}");
        }
        let refusals = v["refusals"].to_string();
        assert!(!refusals.contains("GPUs' memory"), "{refusals}");
    }
    assert_eq!(chunk(&at("141", &["--anchor-chunk", "188"])), 188);
}

/// Two workers on one small GPU: refused, naming the GPU and the options to change; a launch
/// with a CPU-only worker binary on GPUs is refused too.
#[test]
fn a_plan_that_does_not_fit_is_refused_naming_the_options() {
    let dir = tempfile::tempdir().unwrap();
    let target = qwen3_8b(dir.path());
    let run_dir = dir.path().join("run");
    let out = dry_run(
        &target,
        &run_dir,
        &[
            "--gpus",
            "0,0",
            "--gpu-memory",
            "40",
            "--token-budget",
            "49152",
            "--max-len",
            "8192",
        ],
    );
    // The plan on stdout, the refusal on stderr.
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("GPU 0: target + drafter"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("GPU 0 (target + drafter) needs"), "{err}");
    assert!(
        err.contains("--token-budget") && err.contains("--anchor-chunk"),
        "{err}"
    );
    assert!(!run_dir.exists());
}

#[test]
fn bad_dry_run_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = qwen3_8b(dir.path());
    let run_dir = dir.path().join("run");
    for (flags, needle) in [
        (vec!["--gpus", "0", "--gpu-memory=-1"], "--gpu-memory"),
        (vec!["--gpus", "0", "--gpu-memory", "0"], "--gpu-memory"),
        (vec!["--gpus", "0", "--gpu-memory", "nan"], "--gpu-memory"),
        (vec!["--gpus", "cpu:2", "--dtype", "f16"], "--dtype"),
        (
            vec!["--gpus", "cpu:2", "--feature-dtype", "fp8"],
            "--feature-dtype",
        ),
        (
            vec!["--gpus", "cpu:2", "--anchor-chunk", "0"],
            "--anchor-chunk",
        ),
        (
            vec!["--gpus", "cpu:2", "--anchor-chunk", "many"],
            "--anchor-chunk",
        ),
        (vec!["--gpus", "cpu:2", "--gamma", "0"], "--gamma"),
        (vec!["--gpus", "cpu:2", "--gamma", "uniform"], "--gamma"),
        (vec!["--gpus", "cpu:2", "--loss", "mse"], "--loss"),
        (vec!["--gpus", "cpu:2", "--kd-weight", "1.5"], "--kd-weight"),
        (
            vec!["--gpus", "cpu:2", "--loss", "dpace", "--dpace-alpha", "1.5"],
            "--dpace-alpha",
        ),
        (
            vec!["--gpus", "cpu:2", "--loss", "dpace", "--dpace-alpha", "nan"],
            "--dpace-alpha",
        ),
        (
            vec!["--gpus", "cpu:2", "--kd-temperature", "0"],
            "--kd-temperature",
        ),
        (
            vec!["--gpus", "cpu:2", "--on-nonfinite", "ignore"],
            "--on-nonfinite",
        ),
    ] {
        assert_refused(&dry_run(&target, &run_dir, &flags), 2, needle);
    }
    // A decay beside D-PACE, which weighs the positions itself: what a launch would refuse.
    assert_refused(
        &dry_run(
            &target,
            &run_dir,
            &["--gpus", "cpu:2", "--loss", "dpace", "--gamma", "4"],
        ),
        1,
        "--loss dpace weighs the block positions itself: --gamma must be auto or none",
    );
    // DFlash2's sizes against the target (the tiny one: hidden 64), and the candle engine, which trains
    // neither DFlash2 nor sliding windows: what a launch would refuse, naming the option.
    let tiny = dflash_e2e::tiny_target(dir.path());
    let python = dflash_e2e::test_python();
    let torch = [
        "--engine",
        "torch",
        "--python",
        python.to_str().unwrap(),
        "--drafter-arch",
        "dflash2",
    ];
    for (flags, needle) in [
        (
            vec!["--gpus", "cpu:2", "--drafter-arch", "dflash2"],
            "--drafter-arch dflash2 is trained by the torch engine only: pass --engine torch",
        ),
        (
            vec!["--gpus", "cpu:2", "--sliding-window", "2048"],
            "--sliding-window is trained by the torch engine only: pass --engine torch",
        ),
        (
            [&["--gpus", "cpu:2", "--conv-group-size", "24"][..], &torch].concat(),
            "--conv-group-size 24 does not divide the hidden size 64",
        ),
        (
            [&["--gpus", "cpu:2", "--conv-kernel-size", "17"][..], &torch].concat(),
            "--conv-kernel-size 17 must be from 1 to the block size 16",
        ),
    ] {
        assert_refused(&dry_run(&tiny, &run_dir, &flags), 1, needle);
    }
    for (flags, needle) in [
        (
            vec!["--gpus", "cpu:2", "--drafter-arch", "eagle"],
            "--drafter-arch",
        ),
        (
            vec!["--gpus", "cpu:2", "--selector-top-k", "0"],
            "--selector-top-k",
        ),
        (
            vec!["--gpus", "cpu:2", "--selector-rank", "0"],
            "--selector-rank",
        ),
        (
            vec!["--gpus", "cpu:2", "--selector-loss-weight=-1"],
            "--selector-loss-weight",
        ),
        (
            vec!["--gpus", "cpu:2", "--sliding-window", "0"],
            "--sliding-window",
        ),
    ] {
        assert_refused(&dry_run(&target, &run_dir, &flags), 2, needle);
    }
    // A top K beyond the vocabulary (the tiny target has 600 tokens).
    assert_refused(
        &dry_run(
            &tiny,
            &run_dir,
            &[&["--gpus", "cpu:2", "--selector-top-k", "601"][..], &torch].concat(),
        ),
        1,
        "--selector-top-k 601 must be from 1 to the vocabulary's 600 tokens",
    );
    // --json and --gpu-memory belong to --dry-run.
    assert_refused(
        &orch(&[
            "launch",
            "--json",
            "--gpus",
            "cpu:2",
            "--synthetic",
            "10",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ]),
        2,
        "required arguments",
    );
    assert!(!run_dir.exists());
}

/// `--eval-every` adds its process to the plan: on the first GPU, beside that GPU's worker, with
/// every target layer and KV caches that grow with --eval-max-new-tokens.
#[test]
fn the_evaluations_are_planned_on_the_first_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let target = qwen3_8b(dir.path());
    let run_dir = dir.path().join("run");
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts, "{\"input_ids\": [1, 2, 3]}\n").unwrap();
    let at = |new: &str| {
        plan_json(
            &target,
            &run_dir,
            &[
                "--gpus",
                "0-7",
                "--gpu-memory",
                "141",
                "--max-len",
                "8192",
                "--eval-every",
                "100",
                "--eval-prompts",
                prompts.to_str().unwrap(),
                "--eval-max-new-tokens",
                new,
            ],
        )
    };
    let (short, long) = (at("128"), at("8192"));
    let eval = |v: &Value, k: &str| v["plan"]["eval"][k].as_u64().unwrap();
    assert!(eval(&short, "weights") > short["plan"]["target"]["weights"].as_u64().unwrap());
    assert!(eval(&long, "features") > eval(&short, "features"));
    assert_eq!(eval(&long, "weights"), eval(&short, "weights"));
    let gpu0 = &short["gpus"][0];
    assert_eq!(gpu0["workers"], serde_json::json!(["target", "eval"]));
    assert_eq!(short["gpus"][1]["workers"], serde_json::json!(["target"]));
}
