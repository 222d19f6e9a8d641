//! The torch engine end to end: the Rust worker keeps the loop and the rings, a Python child
//! (`python -m dflash_orch.serve`, on the test environment's torch and transformers) computes the
//! target and the drafter. Its features equal `transformers`' own hidden states on several
//! architectures; its drafter, and the torch target feeding the candle drafter, train as the
//! candle-only run does; killed torch workers lose nothing; a Python that cannot serve is refused
//! before anything starts.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use dflash_e2e::planted::Planted;
use dflash_e2e::{
    assert_clean, assert_refused, assert_sampled_like_the_target, bin, children, demo_report,
    final_checkpoint, finish, flags_without, journal_events, launch_with, orch, script, signal,
    stdout_ok, test_python, tiny_target, wait_until, worker_pid, workspace_root,
};
use serde_json::Value;

/// Where the runs' workers are: two targets and a drafter on CPUs.
const CPU_WORKERS: [&str; 4] = ["--gpus", "cpu:3", "--topology", "2:1"];

/// The run: enough optimiser steps (one batch each) to compare 50 of them.
const RUN_FLAGS: [&str; 26] = [
    "--stage",
    "dflash",
    "--synthetic",
    "240",
    "--epochs",
    "2",
    "--max-len",
    "64",
    "--token-budget",
    "512",
    "--buckets",
    "auto:2",
    "--accum",
    "1",
    "--draft-layers",
    "1",
    "--num-anchors",
    "24",
    "--save-every",
    "10",
    "--keep-checkpoints",
    "2",
    "--heartbeat-timeout",
    "10",
    "--max-restarts",
    "5",
];

const MIXED: &str = "target=torch,drafter=candle";

/// A launch of [`RUN_FLAGS`] on `engine`; `extra` adds options or changes those of RUN_FLAGS.
fn launch(run_dir: &Path, target: &Path, engine: &str, extra: &[&str]) -> Command {
    let mut args = CPU_WORKERS.to_vec();
    args.extend(["--engine", engine]);
    args.extend_from_slice(extra);
    launch_with(run_dir, target, &RUN_FLAGS, &args)
}

/// `(step, loss)` of every optimiser step, in order.
fn losses(run_dir: &Path) -> Vec<(u64, f64)> {
    fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "train")
        .map(|l| (l["step"].as_u64().unwrap(), l["loss"].as_f64().unwrap()))
        .collect()
}

fn final_weights(run_dir: &Path) -> Vec<u8> {
    let root = run_dir.join("checkpoints");
    let latest = fs::read_to_string(root.join("latest")).unwrap();
    fs::read(root.join(latest.trim()).join("model.safetensors")).unwrap()
}

/// Per-step losses agree within `tol`, relative, over at least `steps` steps.
fn assert_losses_agree(a: &[(u64, f64)], b: &[(u64, f64)], steps: usize, tol: f64) {
    assert!(a.len() >= steps, "{} steps", a.len());
    assert_eq!(a.len(), b.len(), "the same steps");
    let mut worst: f64 = 0.0;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0);
        let rel = (x.1 - y.1).abs() / y.1.abs().max(1e-12);
        worst = worst.max(rel);
        assert!(
            rel <= tol,
            "step {}: loss {} against {} ({rel:.2e} relative)",
            x.0,
            x.1,
            y.1
        );
    }
    eprintln!(
        "{} steps, worst relative loss difference {worst:.2e}",
        a.len()
    );
}

/// DFlash2 against the official package's `DFlash2DraftModel` on random weights (every tensor,
/// the convolutions' and the selector's included), with full and with sliding-window layers:
/// the final hidden states and the logits within 1e-5 (relative to the largest value), the
/// selector's greedy path and top-K candidates equal; the blocks of several anchors computed
/// together (as training does) equal the official model run once per anchor. Perturbing the
/// dynamic kernels, or dropping the window, moves the states: the check can fail.
#[test]
fn the_dflash2_drafter_computes_what_the_official_model_computes() {
    let rows = python_check("check_dflash2.py", &["--tol", "1e-5"], &[]);
    assert_eq!(rows.len(), 6, "{rows:?}");
    assert!(rows.iter().any(|r| r["window"].is_null()));
    assert!(rows.iter().any(|r| r["window"] == 3));
    for r in &rows {
        assert_eq!(r["ok"], true, "{r}");
        for key in ["hidden", "logits", "batched"] {
            assert!(
                r[format!("max_rel_diff_{key}")].as_f64().unwrap() <= 1e-5,
                "{r}"
            );
        }
        assert_eq!(r["paths_equal"], true, "{r}");
        assert_eq!(r["candidates_equal"], true, "{r}");
        assert!(r["perturbed_diff"].as_f64().unwrap() > 1e-3, "{r}");
    }
}

/// Runs `python/tests/NAME` with `args` (and `env`), which must exit 0; its output.
fn python_check_output(name: &str, args: &[&str], env: &[(&str, PathBuf)]) -> String {
    let out = Command::new(test_python())
        .arg(workspace_root().join("python/tests").join(name))
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} {args:?} {env:?}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{stdout}");
    stdout
}

/// [`python_check_output`]'s JSON lines.
fn python_check(name: &str, args: &[&str], env: &[(&str, PathBuf)]) -> Vec<Value> {
    let stdout = python_check_output(name, args, env);
    stdout
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: {e} in {l:?}: {stdout}"))
        })
        .collect()
}

/// The batched drafter step's pieces on CPU (python/tests/check_blocks.py), on random anchors,
/// sequence lengths and sliding windows: the mask the plan's two key intervals per query give
/// equals the per-sequence definition at every (query, key), with and without anchor chunks;
/// the tiles a flex `BlockMask` lists are exactly those holding an attending pair (full ones
/// only attending pairs); flex attention under the `BlockMask` equals SDPA under the dense mask
/// (f64, 1e-10); the linear cross-entropy's loss and gradient equal autograd's, with D-PACE too.
#[test]
fn the_block_mask_from_anchors_equals_the_dense_mask_and_flex_equals_sdpa() {
    for seed in ["11", "12"] {
        let stdout = python_check_output("check_blocks.py", &[], &[("CHECK_SEED", seed.into())]);
        assert!(stdout.contains("ok: masks, tiles, flex"), "{stdout}");
    }
}

/// `--drafter-compile` on CPU (python/tests/check_compile.py): the drafter with its elementwise
/// chains compiled by `torch.compile` trains three micro-batches as the eager one does (losses,
/// accepted counts, gradient norms within 1e-5 relative; the first micro-batch's gradients
/// too), with and without D-PACE; the compile really happened (no silent fall-back to eager);
/// and a perturbed drafter differs, so the comparison can fail.
#[test]
fn the_compiled_drafter_trains_as_the_eager_one() {
    // The compiler's caches in a private directory of the test's own.
    let cache = tempfile::tempdir().unwrap();
    let rows = python_check(
        "check_compile.py",
        &["--tol", "1e-5", "--steps", "3"],
        &[
            ("TORCHINDUCTOR_CACHE_DIR", cache.path().join("inductor")),
            ("TRITON_CACHE_DIR", cache.path().join("triton")),
        ],
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r["ok"], true, "{r}");
        assert!(
            r["kernels"].as_str().unwrap().starts_with("compiled"),
            "{r}"
        );
        assert!(r["worst"]["grads"].as_f64().unwrap() <= 1e-5, "{r}");
    }
    assert!(rows[1]["dpace"].as_f64().is_some(), "{rows:?}");
}

/// The torch target's features equal `transformers`' `hidden_states[k + 1]` (f32, 1e-5) on a
/// packed batch of uneven lengths, for Qwen3, Llama with llama3 rope scaling, Qwen3-MoE,
/// Gemma-3 (sliding-window layers), gpt-oss (attention sinks; eager attention on CPU),
/// Qwen3.5 (gated delta-net layers, whose state would carry from one packed sequence into the
/// next: packing refused, for right-padded rows), gpt-neox (layers and final norm named
/// otherwise) and DeepSeek-V3 (latent attention: values narrower than queries and keys, padded
/// for the kernel); each also as right-padded rows of near lengths without a mask (what a
/// refused packing runs); and the same tokens run as one row (sequences attending across)
/// differ, so the check can fail. Last, the packing probe: with the structural refusal switched off, Qwen3.5's
/// packed row is refused by the target's own comparison with rows of one length, its features
/// stay right, and without the probe they would not.
#[test]
fn the_torch_targets_features_equal_transformers_on_packed_batches() {
    let rows = python_check("check_target.py", &["--tol", "1e-5"], &[]);
    let (probe, rows) = rows.split_last().unwrap();
    // Each architecture four ways: rows of one length, packed rows on the CPU (each sequence's
    // own attention), packed rows through the variable-length kernel's contract, and padded
    // rows. Qwen3.5's packing is refused, for padded rows.
    let seen: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| {
            let packing = r["packing"].as_str().unwrap();
            (
                r["arch"].as_str().unwrap(),
                packing.split([',', '(']).next().unwrap().trim(),
            )
        })
        .collect();
    let mut expected = Vec::new();
    for arch in [
        "qwen3",
        "llama",
        "qwen3_moe",
        "gemma3_text",
        "gpt_oss",
        "qwen3_5_text",
        "gpt_neox",
        "deepseek_v3",
    ] {
        let packed = if arch == "qwen3_5_text" {
            "padded rows"
        } else {
            "packed"
        };
        expected.extend([
            (arch, "rows of one length"),
            (arch, packed),
            (arch, packed),
            (arch, "padded rows"),
        ]);
    }
    assert_eq!(seen, expected);
    let kernels: Vec<&str> = rows
        .iter()
        .filter_map(|r| r["packing"].as_str().unwrap().strip_prefix("packed, "))
        .collect();
    assert_eq!(
        kernels,
        [
            "each sequence's own attention",
            "one variable-length kernel"
        ]
        .repeat(7)
    );
    for r in &rows[21..23] {
        assert_eq!(
            r["packing"],
            "padded rows (packing refused: layer types linear_attention are not attention)",
            "{r}"
        );
    }
    for r in rows {
        assert_eq!(r["ok"], true, "{r}");
        assert!(r["max_abs_diff"].as_f64().unwrap() <= 1e-5, "{r}");
        assert!(r["cross_sequence_diff"].as_f64().unwrap() > 1e-3, "{r}");
    }
    assert_eq!(probe["check"], "probe", "{probe}");
    assert_eq!(probe["ok"], true, "{probe}");
    assert!(
        probe["packing"]
            .as_str()
            .unwrap()
            .contains("differs from rows of one length"),
        "{probe}"
    );
    assert!(probe["max_abs_diff"].as_f64().unwrap() <= 1e-5, "{probe}");
    assert!(probe["unprobed_diff"].as_f64().unwrap() > 1e-3, "{probe}");
}

/// `generate --engine torch` decodes a batch of prompts together (python/tests/check_generate.py),
/// left-padded and masked: on Qwen3, Llama, Qwen3-MoE, Gemma-3, gpt-oss (sliding windows
/// shorter than the prompts), Qwen3.5 (gated delta-net layers) and DeepSeek-V3 (latent
/// attention), each greedy token is the
/// argmax of the model run alone on its prompt and the tokens before it, a stop token ends its
/// row only, and a sampled row draws what it draws decoded alone; the same batch with its
/// padding attended is not greedy, so the check can fail. And `eval`'s greedy speculative
/// decoding, with drafts accepted whole, in part and not at all, gives the greedy tokens on each:
/// on Qwen3.5 its cache is copied before each verify step and put back after a rejection, since
/// cropping a KV cache (what the official package does) leaves the rejected tokens in the
/// carried state, which this check shows changes the tokens.
#[test]
fn the_torch_generate_decodes_a_batch_as_each_prompt_alone() {
    let rows = python_check("check_generate.py", &["--tol", "1e-5"], &[]);
    let archs: Vec<&str> = rows.iter().map(|r| r["arch"].as_str().unwrap()).collect();
    assert_eq!(
        archs,
        [
            "qwen3",
            "llama",
            "qwen3_moe",
            "gemma3_text",
            "gpt_oss",
            "qwen3_5_text",
            "deepseek_v3"
        ]
    );
    for r in &rows {
        assert_eq!(r["ok"], true, "{r}");
        assert!(r["worst_greedy_margin"].as_f64().unwrap() <= 1e-5, "{r}");
        assert_eq!(r["stop_ok"], true, "{r}");
        assert_eq!(r["sampled_equal_alone"], true, "{r}");
        assert!(r["mask_dropped_margin"].as_f64().unwrap() > 1e-3, "{r}");
        assert!(r["speculative_margin"].as_f64().unwrap() <= 1e-5, "{r}");
        assert_eq!(
            r["accepted_lengths"],
            serde_json::json!([1, 2, 3, 4]),
            "{r}"
        );
        let carried = r["arch"] == "qwen3_5_text";
        assert_eq!(r["carried_state"].is_string(), carried, "{r}");
        if carried {
            assert!(r["cropped_margin"].as_f64().unwrap() > 1e-3, "{r}");
        }
    }
}

/// The engines train alike, from the same plan and initial weights: the torch drafter's per-step
/// losses (torch target too) and a mixed run's (torch target, candle drafter) equal the
/// candle-only run's within 1e-4 relative over 60 steps (the torch drafter with its chains
/// compiled, the torch targets packed); so do the torch drafter's with distillation mixed in,
/// gamma, two drafter layers, accumulation and anchor chunks, its loss in checkpointed pieces of
/// rows; with D-PACE; and with distillation weighed by D-PACE. Anchors, loss weights and layer
/// ids are decided in Rust for both engines, and every step the drafter worker checks the torch
/// engine's loss weight against its own, so a drift in the block mask or gamma fails a run; a
/// drift in the attention's mask or the model fails these comparisons.
#[test]
fn the_engines_train_alike_from_the_same_plan() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let candle = dir.path().join("candle");
    let mixed = dir.path().join("mixed");
    let torch = dir.path().join("torch");
    finish(launch(&candle, &target, "candle", &[]).spawn().unwrap());
    // The torch targets run packed rows (each sequence's own attention on a CPU), and the torch
    // drafter its compiled chains; the later variants run rows of one length and eager chains,
    // the CPU's defaults.
    let packed = ["--target-packing", "on"];
    finish(launch(&mixed, &target, MIXED, &packed).spawn().unwrap());
    // The torch run's directory is given relative to where the launch runs: its Python sides
    // run elsewhere (a directory of their own) and still find their checkpoints.
    let compiled = ["--target-packing", "on", "--drafter-compile", "on"];
    finish(
        launch(Path::new("torch"), &target, "torch", &compiled)
            .current_dir(dir.path())
            .spawn()
            .unwrap(),
    );
    assert_losses_agree(&losses(&mixed), &losses(&candle), 50, 1e-4);
    assert_losses_agree(&losses(&torch), &losses(&candle), 50, 1e-4);
    let run = &journal_events(&mixed, "run")[0];
    assert_eq!(run["config"]["dflash"]["engines"], MIXED, "{run}");
    assert_eq!(run["config"]["dflash"]["target_packing"], true, "{run}");
    let run = &journal_events(&torch, "run")[0];
    assert_eq!(run["config"]["dflash"]["drafter_compile"], true, "{run}");
    // The compiler's caches are the run's own.
    assert!(torch.join(".torch-compile/inductor").is_dir());
    assert_eq!(
        run["config"]["dflash"]["torch"]["python"],
        test_python().to_str().unwrap()
    );
    // The engines are part of each checkpoint's fingerprint; the torch drafter's checkpoint
    // holds what the candle drafter's does.
    let latest = |run_dir: &Path| -> PathBuf {
        let root = run_dir.join("checkpoints");
        root.join(fs::read_to_string(root.join("latest")).unwrap().trim())
    };
    let state = |run_dir: &Path| -> Value {
        serde_json::from_slice(&fs::read(latest(run_dir).join("state.json")).unwrap()).unwrap()
    };
    let (a, b, c) = (state(&mixed), state(&candle), state(&torch));
    assert_ne!(a["fingerprint"]["engine"], b["fingerprint"]["engine"]);
    assert_eq!(a["fingerprint"]["data"], b["fingerprint"]["data"]);
    assert_ne!(c["fingerprint"]["engine"], a["fingerprint"]["engine"]);
    assert_ne!(c["fingerprint"]["engine"], b["fingerprint"]["engine"]);
    assert_eq!(
        (c["step"].clone(), c["adam_t"].clone()),
        (b["step"].clone(), b["adam_t"].clone())
    );
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let names = |run_dir: &Path| -> Vec<String> {
            let bytes = fs::read(latest(run_dir).join(file)).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Map<String, Value> =
                serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let mut names: Vec<String> = header
                .iter()
                .map(|(k, v)| format!("{k} {} {}", v["dtype"], v["shape"]))
                .collect();
            names.sort();
            names
        };
        assert_eq!(names(&torch), names(&candle), "{file}");
    }
    assert_eq!(
        fs::read(latest(&torch).join("config.json")).unwrap(),
        fs::read(latest(&candle).join("config.json")).unwrap()
    );
    assert_clean(&mixed);
    assert_clean(&torch);
    // The monitor counts a torch worker with its Python side: the child is named and its memory
    // (torch imported: hundreds of MB) is in the worker's peak. The newest such line: a first
    // sample may come while the child is still starting, before it imported anything.
    let metrics = fs::read_to_string(torch.join("metrics.jsonl")).unwrap();
    let process = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "process" && l["role"] == "drafter")
        .rfind(|l| l["children"].as_array().is_some_and(|c| !c.is_empty()))
        .unwrap_or_else(|| panic!("no drafter process line names its Python side"));
    assert!(
        process["peak_rss_bytes"].as_u64().unwrap() > 300 << 20,
        "{process}"
    );

    // Distillation mixed in, gamma, two layers, accumulation (30 steps of two batches),
    // anchor chunks.
    let variant = [
        "--loss",
        "mix",
        "--gamma",
        "4",
        "--draft-layers",
        "2",
        "--accum",
        "2",
        "--anchor-chunk",
        "5",
    ];
    // On torch with the loss in pieces of 7 block positions, each checkpointed (its logits
    // recomputed in the backward pass), as a large vocabulary's is: the same losses. (The loss
    // in one piece runs above, and for D-PACE below.)
    let candle = dir.path().join("candle-mix");
    finish(
        launch(&candle, &target, "candle", &variant)
            .spawn()
            .unwrap(),
    );
    let pieces = dir.path().join("torch-mix-pieces");
    finish(
        launch(&pieces, &target, "torch", &variant)
            .env("DFLASH_LOSS_ROWS", "7")
            .spawn()
            .unwrap(),
    );
    assert_losses_agree(&losses(&pieces), &losses(&candle), 30, 1e-4);

    // D-PACE, with anchor chunks, the loss in one piece: one epoch, 30 steps.
    let dpace = [
        "--epochs",
        "1",
        "--loss",
        "dpace",
        "--dpace-alpha",
        "0.3",
        "--anchor-chunk",
        "5",
    ];
    let candle_dpace = dir.path().join("candle-dpace");
    let torch_dpace = dir.path().join("torch-dpace");
    finish(
        launch(&candle_dpace, &target, "candle", &dpace)
            .spawn()
            .unwrap(),
    );
    finish(
        launch(&torch_dpace, &target, "torch", &dpace)
            .spawn()
            .unwrap(),
    );
    let (d, plain) = (losses(&candle_dpace), losses(&dir.path().join("candle")));
    assert_losses_agree(&losses(&torch_dpace), &d, 30, 1e-4);
    // The same first step as the decay's run, weighed otherwise.
    assert!(
        (d[0].1 - plain[0].1).abs() > 0.01 * plain[0].1,
        "D-PACE's first loss {} is the decay's {}",
        d[0].1,
        plain[0].1
    );

    // Distillation weighed by D-PACE (the weights from the drafter's probabilities of the
    // data's tokens), on both engines, on torch with the loss in checkpointed pieces of rows that
    // cut through blocks (the weights are made per whole block): the same losses, and not
    // dpace's.
    let kd_dpace = [
        "--epochs",
        "1",
        "--loss",
        "kd-dpace",
        "--dpace-alpha",
        "0.3",
        "--anchor-chunk",
        "5",
    ];
    let candle_kd = dir.path().join("candle-kd-dpace");
    let torch_kd = dir.path().join("torch-kd-dpace");
    finish(
        launch(&candle_kd, &target, "candle", &kd_dpace)
            .spawn()
            .unwrap(),
    );
    finish(
        launch(&torch_kd, &target, "torch", &kd_dpace)
            .env("DFLASH_LOSS_ROWS", "7")
            .spawn()
            .unwrap(),
    );
    let k = losses(&candle_kd);
    assert_losses_agree(&losses(&torch_kd), &k, 30, 1e-4);
    assert!(
        (k[0].1 - d[0].1).abs() > 0.01 * d[0].1,
        "kd-dpace's first loss {} is dpace's {}",
        k[0].1,
        d[0].1
    );
}

/// `launch --dry-run` plans each worker on its own engine: a torch target holds the whole model
/// (its weight files' bytes, in f32 on CPU workers) and its Python side; a mixed run plans the
/// candle drafter as candle's; a target of another architecture than Qwen3 is planned on torch
/// and refused on candle.
#[test]
fn the_dry_run_plans_the_torch_workers() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    // Run from a directory where another user planted modules (see `torch_demo_with`): the dry
    // run's pre-flight imports none of them.
    let planted = Planted::new(dir.path());
    let plan = |engine: &str| -> Value {
        let mut c = launch(
            &dir.path().join("run"),
            &target,
            engine,
            &["--dry-run", "--json"],
        );
        let out = planted
            .run_from(&mut c)
            .stdout(Stdio::piped())
            .output()
            .unwrap();
        planted.assert_none_ran("launch --dry-run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let torch = plan("torch");
    // With no --python, python3 is looked up in PATH's absolute folders only: the one planted in
    // the working directory, which PATH names first, never runs.
    let python_dir = test_python().parent().unwrap().to_path_buf();
    let path = std::env::join_paths([Path::new("."), Path::new(""), &python_dir]).unwrap();
    let mut c = Command::new(bin("dflash-orch"));
    let out = planted
        .run_from(&mut c)
        .args(["launch", "--dry-run", "--json", "--engine", "torch"])
        .args(RUN_FLAGS)
        .args(CPU_WORKERS)
        .arg("--target-model")
        .arg(&target)
        .arg("--run-dir")
        .arg(dir.path().join("run"))
        .env("PATH", path)
        .env_remove("DFLASH_PYTHON")
        .output()
        .unwrap();
    planted.assert_none_ran("launch --dry-run with PATH naming the working directory");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p = &torch["plan"];
    assert_eq!(
        (&p["target"]["engine"], &p["drafter"]["engine"]),
        (&"torch".into(), &"torch".into())
    );
    let bytes = fs::read(target.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    assert_eq!(
        p["target"]["weights"].as_u64().unwrap(),
        bytes.len() as u64 - 8 - header,
        "the whole f32 model"
    );
    let host = p["target_host"].as_u64().unwrap() - p["target"]["total"].as_u64().unwrap();
    assert!(host > 600 << 20, "the Python side counts: {host}");
    let mixed = plan(MIXED);
    let candle = plan("candle");
    assert_eq!(mixed["plan"]["target"], p["target"]);
    assert_eq!(mixed["plan"]["drafter"], candle["plan"]["drafter"]);
    assert_eq!(candle["plan"]["target"]["engine"], "candle");
    // On GPUs a torch worker's binary needs no CUDA (its Python side does the GPU's work); a
    // candle one does.
    let on_gpus = |engine: &str| -> String {
        let out = Command::new(bin("dflash-orch"))
            .args([
                "launch",
                "--dry-run",
                "--json",
                "--gpus",
                "0,1",
                "--gpu-memory",
                "80",
            ])
            .args(RUN_FLAGS)
            .args(["--engine", engine, "--python"])
            .arg(test_python())
            .arg("--target-model")
            .arg(&target)
            .arg("--run-dir")
            .arg(dir.path().join("run"))
            .output()
            .unwrap();
        let plan: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
        plan["refusals"].to_string()
    };
    assert!(on_gpus("candle").contains("without CUDA"));
    let torch_refusals = on_gpus("torch");
    assert!(!torch_refusals.contains("without CUDA"), "{torch_refusals}");
    // A target of another architecture (Qwen3.5: no q_norm, gated delta-net layers) is planned
    // on torch as a launch takes it, its tensors `transformers`' business; candle refuses it,
    // naming the engine that runs it.
    let other = dir.path().join("other");
    fs::create_dir(&other).unwrap();
    let qwen3_5 = arch_target(&other, "qwen3_5_text");
    let dry = |engine: &str| {
        launch(
            &dir.path().join("run"),
            &qwen3_5,
            engine,
            &["--dry-run", "--json"],
        )
        .stdout(Stdio::piped())
        .output()
        .unwrap()
    };
    let out = dry("torch");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["refusals"], serde_json::json!([]), "{plan}");
    let refused = dry("candle");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--engine torch"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(
        !dir.path().join("run").exists(),
        "a dry run creates nothing"
    );
}

/// The GPU check's launcher (`scripts/gpu-check --cpu`, the steps that run Python children: the
/// drafter step, with the candle bench and `dflash_orch.bench_step` eager and compiled, the
/// compiled step twice in two processes with the same losses, and the target step), run from a
/// directory where another user planted modules that `PYTHONPATH` names too: the check passes
/// and none of them runs, in the check's own Python or in its children. (The candle launch and
/// the copy bench, which start no Python, are skipped: `gpu-check --cpu` runs them for a person.)
#[test]
fn the_gpu_checks_pythons_import_nothing_planted() {
    let dir = tempfile::tempdir().unwrap();
    let planted = Planted::new(dir.path());
    let mut command = Command::new(script("gpu-check"));
    planted.run_from(&mut command);
    let out = command
        .env("PYTHON", test_python())
        .args(["--cpu", "--work"])
        .arg(dir.path().join("work"))
        .args(["--seeds-steps", "1"])
        .args(
            [
                "environment",
                "copy",
                "nvml",
                "dflash",
                "serve",
                "crash_resume",
                "pytorch",
                "torch_dflash",
                "torch_crash_resume",
            ]
            .iter()
            .flat_map(|s| ["--skip", s]),
        )
        .stdin(Stdio::null())
        .output()
        .unwrap();
    planted.assert_none_ran("scripts/gpu-check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["steps"]["drafter_step"]["ok"], true, "{summary}");
    assert_eq!(summary["steps"]["target_step"]["ok"], true, "{summary}");
    // The compiled drafter step, run again in another process (on CPUs from the first one's
    // caches, as a restarted drafter loads them), computes the same losses to the bit.
    assert_eq!(
        summary["steps"]["drafter_step"]["compiled_replays_to_the_bit"], true,
        "{summary}"
    );
    assert_eq!(
        summary["steps"]["drafter_step"]["compiled_again_caches"], "the first's",
        "{summary}"
    );
    assert!(
        stderr.contains("PYTHONPATH entry") && stderr.contains("left out"),
        "the unsafe entries are named: {stderr}"
    );
}

/// The drafter-step bench the GPU check runs at the seeds' shape answers on both engines for one
/// request (`dflash-worker --drafter-bench`, `python -m dflash_orch.bench_step`): the same
/// workload, timed steps, finite losses; a bad request is refused by both, naming the field.
#[test]
fn both_engines_answer_the_drafter_step_bench() {
    let request = serde_json::json!({
        "target": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 8, "rms_norm_eps": 1e-6},
        "draft_layers": 1, "target_layer_ids": [0, 2], "block_size": 4, "num_anchors": 6,
        "anchor_chunk": 4, "sequences": 2, "seq_len": 40, "prompt": 4, "dtype": "f32",
        "gamma": 7.0, "warmup": 1, "steps": 3
    });
    let run = |engine: &str, request: &Value| -> Output {
        let mut c = if engine == "candle" {
            let mut c = Command::new(bin("dflash-worker"));
            c.args(["--drafter-bench", "-"]);
            c
        } else {
            let mut c = Command::new(test_python());
            c.args(["-m", "dflash_orch.bench_step", "-"])
                .env("PYTHONPATH", workspace_root().join("python"));
            c
        };
        let mut child = c
            .env("CUDA_VISIBLE_DEVICES", "")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(request.to_string().as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    for engine in ["candle", "torch"] {
        let out = run(engine, &request);
        let report: Value = serde_json::from_str(&stdout_ok(&out)).unwrap();
        assert_eq!(report["engine"], engine);
        assert_eq!(report["tokens"], 80);
        assert_eq!(report["step_s"].as_array().unwrap().len(), 3, "{report}");
        assert!(report["tokens_per_s"].as_f64().unwrap() > 0.0);
        let losses = report["losses"].as_array().unwrap();
        assert_eq!(losses.len(), 4);
        assert!(
            losses
                .iter()
                .all(|l| l.as_f64().is_some_and(f64::is_finite)),
            "{report}"
        );
        let mut bad = request.clone();
        bad["sequences"] = 0.into();
        let out = run(engine, &bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{engine}: {stderr}");
        assert!(stderr.contains("sequences"), "{engine}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Traceback"),
            "{stderr}"
        );
    }
}

/// The drafters' store across nodes (`python/dflash_orch/authstore.py`): two ranks form a gloo
/// group through it and sum a tensor while it is attacked: a peer with another key, junk bytes, a
/// hundred silent connections, a replayed authentic frame, a repeated one and a truncated one are
/// each refused and dropped, and the ranks carry on.
#[test]
fn the_drafters_store_across_nodes_serves_only_holders_of_the_key() {
    let out = Command::new(test_python())
        .arg(workspace_root().join("python/tests/check_authstore.py"))
        .env("PYTHONPATH", workspace_root().join("python"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let findings: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(
        findings["sums"],
        serde_json::json!([3.0, 3.0]),
        "{findings}"
    );
    for attack in ["another key", "junk", "replayed frame", "repeated frame"] {
        assert!(
            findings[attack].as_str().unwrap().starts_with("refused"),
            "{attack}: {findings}"
        );
    }
}

/// Data-parallel torch drafters (`python/dflash_orch/parallel.py`): two and three ranks of a gloo
/// process group each train their micro-batches of a step's group and sum their gradients in rank
/// order; after two steps every rank holds the same weights to the bit, a second run gives the
/// same bits, and one drafter training all the micro-batches ends within 1e-5 relative.
#[test]
fn data_parallel_torch_drafters_sum_their_gradients_in_rank_order() {
    let dir = tempfile::tempdir().unwrap();
    let script = workspace_root().join("python/tests/check_parallel.py");
    let check = |args: &[&str]| -> Output {
        Command::new(test_python())
            .arg(&script)
            .args(args)
            .output()
            .unwrap()
    };
    let group = |world: usize, name: &str| -> Vec<PathBuf> {
        let store = dir.path().join(format!("{name}.store"));
        let outs: Vec<PathBuf> = (0..world)
            .map(|r| dir.path().join(format!("{name}-{r}.safetensors")))
            .collect();
        let children: Vec<_> = (0..world)
            .map(|r| {
                Command::new(test_python())
                    .arg(&script)
                    .args([
                        "rank",
                        "--world",
                        &world.to_string(),
                        "--rank",
                        &r.to_string(),
                    ])
                    .arg("--store")
                    .arg(&store)
                    .arg("--out")
                    .arg(&outs[r])
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for child in children {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        outs
    };
    let compare = |a: &Path, b: &Path| -> Value {
        serde_json::from_str(&stdout_ok(&check(&[
            "compare",
            a.to_str().unwrap(),
            b.to_str().unwrap(),
        ])))
        .unwrap()
    };
    for world in [2usize, 3] {
        let first = group(world, &format!("w{world}"));
        let again = group(world, &format!("w{world}-again"));
        let reference = dir.path().join(format!("reference-{world}.safetensors"));
        stdout_ok(&check(&[
            "reference",
            "--world",
            &world.to_string(),
            "--out",
            reference.to_str().unwrap(),
        ]));
        for rank in 1..world {
            assert_eq!(
                compare(&first[rank], &first[0])["identical"],
                true,
                "rank {rank}"
            );
        }
        assert_eq!(
            compare(&again[0], &first[0])["identical"],
            true,
            "a second run"
        );
        let against = compare(&first[0], &reference);
        let rel = against["max_rel"].as_f64().unwrap();
        assert!(rel < 1e-5, "{world} ranks against one drafter: {against}");
    }
}

/// Exact replay on the torch engine (target and drafter): SIGKILL of a target worker's Python
/// child mid-run (the worker goes with it and is restarted), then SIGKILL of the drafter worker
/// (its Python child goes with it; the restarted drafter resumes from its last checkpoint): the
/// run ends with the undisturbed run's weights, byte for byte. A run whose orchestrator is
/// SIGKILLed resumes on its own engine to the same weights, and refuses another engine, naming
/// both.
#[test]
fn killed_torch_workers_lose_nothing_and_a_resume_keeps_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let reference = dir.path().join("reference");
    finish(launch(&reference, &target, "torch", &[]).spawn().unwrap());
    let run_dir = dir.path().join("run");
    let child = launch(&run_dir, &target, "torch", &[]).spawn().unwrap();
    wait_until("a few steps", Duration::from_secs(300), || {
        journal_events(&run_dir, "commit").len() >= 8
    });
    let (_, worker) = worker_pid(&run_dir, "target");
    let python = children(worker as u32);
    assert_eq!(python.len(), 1, "one Python child: {python:?}");
    signal(python[0] as i32, "KILL");
    wait_until("a checkpoint and more", Duration::from_secs(300), || {
        journal_events(&run_dir, "commit").len() >= 24
    });
    let (_, drafter) = worker_pid(&run_dir, "drafter");
    assert_eq!(
        children(drafter as u32).len(),
        1,
        "the drafter's Python child"
    );
    signal(drafter, "KILL");
    finish(child);
    let exits = journal_events(&run_dir, "worker_exit");
    for pid in [worker, drafter] {
        assert!(
            exits.iter().any(|e| e["pid"].as_u64() == Some(pid as u64)),
            "worker {pid} exited: {exits:?}"
        );
    }
    let starts = journal_events(&run_dir, "worker_start");
    assert!(starts.len() >= 5, "and both were restarted: {starts:?}");
    assert!(
        final_weights(&run_dir) == final_weights(&reference),
        "final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
    assert!(
        fs::read_dir(run_dir.join("checkpoints"))
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with(".engine")),
        "no exchange directory is left behind"
    );

    // The orchestrator SIGKILLed mid-run: a resume on another engine is refused naming both;
    // the resume on the run's own ends with the undisturbed run's weights.
    let run_dir = dir.path().join("killed");
    let mut child = launch(&run_dir, &target, "torch", &[]).spawn().unwrap();
    wait_until("a checkpoint", Duration::from_secs(300), || {
        journal_events(&run_dir, "commit").len() >= 15
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let resume = |extra: &[&str]| {
        let mut c = Command::new(bin("dflash-orch"));
        c.args(["launch", "--resume", "--run-dir"])
            .arg(&run_dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    };
    let out = resume(&["--engine", MIXED]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("--engine {MIXED} (the run has torch)")),
        "{stderr}"
    );
    finish(resume(&[]).spawn().unwrap());
    assert_eq!(journal_events(&run_dir, "resume").len(), 1);
    assert!(
        final_weights(&run_dir) == final_weights(&reference),
        "the resumed run's final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
}

/// A DFlash2 drafter with sliding-window layers, its worker SIGKILLed mid-run: the run ends with
/// the undisturbed run's `model.safetensors`, byte for byte (exact replay holds for the
/// convolutions, the selector and its loss as for DFlash). Its metrics carry the selector's loss
/// and right picks.
#[test]
fn a_dflash2_drafter_killed_mid_run_ends_with_identical_weights() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let arch = [
        "--drafter-arch",
        "dflash2",
        "--selector-top-k",
        "8",
        "--selector-rank",
        "32",
        "--sliding-window",
        "24",
        "--block-size",
        "8",
    ];
    let reference = dir.path().join("reference");
    finish(launch(&reference, &target, "torch", &arch).spawn().unwrap());
    let run_dir = dir.path().join("run");
    let child = launch(&run_dir, &target, "torch", &arch).spawn().unwrap();
    wait_until("a checkpoint and more", Duration::from_secs(300), || {
        journal_events(&run_dir, "commit").len() >= 24
    });
    let (_, drafter) = worker_pid(&run_dir, "drafter");
    signal(drafter, "KILL");
    finish(child);
    let exits = journal_events(&run_dir, "worker_exit");
    assert!(
        exits
            .iter()
            .any(|e| e["pid"].as_u64() == Some(drafter as u64)),
        "the drafter {drafter} exited: {exits:?}"
    );
    assert!(
        final_weights(&run_dir) == final_weights(&reference),
        "final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
    let config: Value = serde_json::from_slice(
        &fs::read(
            final_checkpoint(&run_dir)
                .parent()
                .unwrap()
                .join("config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(config["architectures"][0], "DFlash2DraftModel");
    assert_eq!(config["sliding_window"], 24);
    assert_eq!(config["is_causal"], false);
    let trains: Vec<Value> = fs::read_to_string(reference.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "train")
        .collect();
    let last = trains.last().unwrap();
    assert!(last["selector_loss"].as_f64().unwrap() > 0.0, "{last}");
    assert!(last["selector_accuracy"].as_f64().is_some(), "{last}");
}

/// A launch with `extra` on `python`, refused with exit 2 and an error line naming `needle`,
/// before creating anything; its dry run refuses the same way (exit 1).
fn refused(extra: &[&str], python: &Path, needle: &str) -> Output {
    let dir = tempfile::tempdir().unwrap();
    refused_on(&tiny_target(dir.path()), extra, python, needle)
}

/// [`refused`] with the target in `target`.
fn refused_on(target: &Path, extra: &[&str], python: &Path, needle: &str) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut c = Command::new(bin("dflash-orch"));
    c.arg("launch")
        .args(RUN_FLAGS)
        .arg("--python")
        .arg(python)
        .args(extra)
        .arg("--target-model")
        .arg(target)
        .arg("--run-dir")
        .arg(&run_dir);
    let out = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line: {stderr}"));
    assert!(line.contains(needle), "{needle:?} not in {line:?}");
    assert!(!run_dir.exists(), "nothing created");
    // The dry run refuses the same way.
    let dry = c.arg("--dry-run").output().unwrap();
    let dry_err = String::from_utf8_lossy(&dry.stderr);
    assert_eq!(dry.status.code(), Some(1), "{dry_err}");
    assert!(dry_err.contains(needle), "{dry_err}");
    out
}

/// A Python that cannot serve the torch engine is refused before anything starts, in one line
/// naming what is missing and how to install it: no Python at all; a Python without torch; a
/// torch without CUDA when --gpus names a GPU; the torch drafter (not built).
#[test]
fn a_python_that_cannot_serve_the_engine_is_refused_up_front() {
    let mixed_on_cpus = [CPU_WORKERS.as_slice(), &["--engine", MIXED]].concat();
    refused(
        &mixed_on_cpus,
        Path::new("/nonexistent/bin/python3"),
        "/nonexistent/bin/python3 was not found",
    );
    // A Python of its own, without torch.
    let venv = tempfile::tempdir().unwrap();
    let made = Command::new("python3")
        .args(["-m", "venv", "--without-pip"])
        .arg(venv.path())
        .status()
        .unwrap();
    assert!(made.success());
    let bare = venv.path().join("bin/python");
    let out = refused(
        &mixed_on_cpus,
        &bare,
        "the torch engine needs torch >= 2.11",
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("-m pip install 'torch>=2.11'"),
        "names the command that installs it"
    );
    // The test environment's torch sees no CUDA device here (a machine without a GPU).
    let no_gpu = test_python();
    let probe = Command::new(&no_gpu)
        .args(["-c", "import torch; print(torch.cuda.is_available())"])
        .output()
        .unwrap();
    if String::from_utf8_lossy(&probe.stdout).trim() == "False" {
        refused(
            &["--engine", MIXED, "--gpus", "0,1", "--topology", "1:1"],
            &no_gpu,
            "sees no CUDA device",
        );
    }
}

/// A NaN in the torch target's features (the poisoned token's first feature, as the candle
/// target's fault hook does it) is found by the torch target and named with its layer: the run
/// stops; resumed with `--on-nonfinite skip`, it skips those steps and completes.
#[test]
fn a_nan_in_the_torch_targets_features_stops_the_run_or_skips_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let run_dir = dir.path().join("run");
    let mut c = launch(&run_dir, &target, MIXED, &["--target-layer-ids", "1,2"]);
    c.env("DFLASH_WORKER_POISON_TOKEN", "517");
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("NaN or infinity in the hidden states of target layer 1")
            && err.contains("--on-nonfinite skip"),
        "{err}"
    );
    assert_clean(&run_dir);

    let mut c = Command::new(bin("dflash-orch"));
    c.args(["launch", "--resume", "--on-nonfinite", "skip", "--run-dir"])
        .arg(&run_dir)
        .env("DFLASH_WORKER_POISON_TOKEN", "517")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    finish(c.spawn().unwrap());
    let skipped = journal_events(&run_dir, "skipped_step");
    assert!(!skipped.is_empty(), "no step was skipped");
    assert!(
        skipped
            .iter()
            .all(|s| s["reason"].as_str().unwrap().contains("target layer 1")),
        "{skipped:?}"
    );
    assert!(losses(&run_dir).iter().all(|(_, l)| l.is_finite()));
    assert_eq!(journal_events(&run_dir, "end")[0]["status"], "completed");
}

/// A tiny random model of `arch` made by `transformers` from a config (python/tests/
/// make_target.py), with init-tiny's tokenizer, in `dir`.
fn arch_target(dir: &Path, arch: &str) -> PathBuf {
    let like = tiny_target(dir);
    let out = dir.join(format!("target-{arch}"));
    let made = Command::new(test_python())
        .arg(workspace_root().join("python/tests/make_target.py"))
        .args(["--arch", arch, "--like"])
        .arg(&like)
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "make_target {arch}: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    out
}

/// `demo --engine torch` on `target`: generate (the target's replies), prepare, launch, eval
/// before and after training. Lossless both times; τ after training at least `gain` times τ
/// before. With `--no-baseline` in `extra` (the untrained drafter's eval skipped: the qwen3
/// test keeps it) the summary has no `before`, and `gain` is over 1.0, the τ of a drafter that
/// never agrees (every verify step gains at least its one token).
///
/// It runs from a directory where another user planted modules named as what the engine imports
/// (`torch`, `transformers`, our `dflash_orch`, ...), which `PYTHONPATH` names too: none of them
/// runs, in the pre-flight, the workers' engine, `generate` or `eval`.
///
/// `extra`: more `demo` options, or others than its 200 conversations (10 held out) and 10
/// epochs.
fn torch_demo_with(dir: &Path, target: &Path, gain: f64, extra: &[&str]) -> Value {
    let run = dir.join("demo");
    let planted = Planted::new(dir);
    let mut command = Command::new(bin("dflash-orch"));
    planted.run_from(&mut command);
    let python = test_python();
    let base = [
        "--run-dir",
        run.to_str().unwrap(),
        "--samples",
        "200",
        "--epochs",
        "10",
        "--engine",
        "torch",
        "--python",
        python.to_str().unwrap(),
        "--target-model",
        target.to_str().unwrap(),
    ];
    command
        .arg("demo")
        .args(flags_without(&base, extra))
        .args(extra)
        .arg("--json");
    let out = command.output().unwrap();
    planted.assert_none_ran("demo --engine torch");
    let demo: Value = serde_json::from_str(&stdout_ok(&out)).unwrap();
    let served = &demo["served"];
    let before = if extra.contains(&"--no-baseline") {
        assert_eq!(served["before"], Value::Null, "{served}");
        assert_eq!(served["reports"]["before"], Value::Null, "{served}");
        assert!(!run.join("eval-before.json").exists());
        1.0
    } else {
        assert_eq!(served["before"]["lossless"], true, "{served}");
        served["before"]["tau"].as_f64().unwrap()
    };
    let after = served["after"]["tau"].as_f64().unwrap();
    eprintln!("{}: served τ {before:.3} -> {after:.3}", target.display());
    assert_eq!(served["after"]["lossless"], true, "{served}");
    assert!(after >= gain * before, "τ {before} -> {after}");
    demo
}

/// Prompts decoded sampled by both sides in [`official_agrees`].
const SAMPLED_PROMPTS: usize = 4;

/// The official package loads the torch engine's checkpoint strictly and decodes the held-out
/// prompts with the same target: its τ is ours within 2%, and its outputs are greedy decoding;
/// sampled, it draws what our decode draws.
fn official_agrees(dir: &Path, target: &Path, demo: &Value) {
    let checkpoint = demo["checkpoint"].as_str().unwrap();
    let after = demo["served"]["after"]["tau"].as_f64().unwrap();
    // The demo's own eval of the held-out prompts, its whole report.
    let ours = demo_report(demo, "after");
    assert_eq!(
        ours["tau"].as_f64().unwrap(),
        after,
        "the report is the demo's"
    );
    let prompts = dir.join("prompts.jsonl");
    let rows: Vec<String> = ours["per_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| serde_json::json!({"input_ids": p["prompt_ids"]}).to_string())
        .collect();
    fs::write(&prompts, rows.join("\n") + "\n").unwrap();
    let official = Command::new(test_python())
        .arg(script("official_dflash.py"))
        .arg("--target-model")
        .arg(target)
        .args(["--drafter", checkpoint])
        .arg("--prompts")
        .arg(&prompts)
        .args(["--max-new-tokens", "64", "--stop-token-ids", "2"])
        .output()
        .unwrap();
    let theirs: Value = serde_json::from_slice(&official.stdout).unwrap_or_else(|e| {
        panic!(
            "official_dflash.py: {e}\n{}",
            String::from_utf8_lossy(&official.stderr)
        )
    });
    assert!(official.status.success(), "{theirs}");
    assert_eq!(theirs["lossless"], true);
    let their_tau = theirs["tau"].as_f64().unwrap();
    eprintln!("official τ {their_tau:.3}, ours {after:.3}");
    assert!(
        (their_tau - after).abs() <= 0.02 * after,
        "official τ {their_tau}, ours {after}"
    );

    // Sampled: with the same seed our decode draws what the official `dflash_generate` draws
    // (its `_rejection_sample`), token for token, on the first prompts (each prompt draws from
    // its own stream, so they are drawn as in a decode of them all; at temperature 1 a step
    // gains little, and every prompt is tens of verify steps).
    let sample = ["--temperature", "1", "--top-k", "50", "--seed", "5"];
    let prompts = dir.join("sampled-prompts.jsonl");
    fs::write(&prompts, rows[..SAMPLED_PROMPTS].join("\n") + "\n").unwrap();
    let ours: Value = serde_json::from_str(&stdout_ok(&orch(
        &[
            &[
                "eval",
                "--target-model",
                target.to_str().unwrap(),
                "--drafter",
                checkpoint,
                "--prompts",
                prompts.to_str().unwrap(),
                "--max-new-tokens",
                "64",
                "--engine",
                "torch",
                "--python",
                test_python().to_str().unwrap(),
                "--json",
            ][..],
            &sample,
        ]
        .concat(),
    )))
    .unwrap();
    let official = Command::new(test_python())
        .arg(script("official_dflash.py"))
        .arg("--target-model")
        .arg(target)
        .args(["--drafter", checkpoint])
        .arg("--prompts")
        .arg(&prompts)
        .args(["--max-new-tokens", "64", "--stop-token-ids", "2"])
        .args(sample)
        .output()
        .unwrap();
    assert!(
        official.status.success(),
        "{}",
        String::from_utf8_lossy(&official.stderr)
    );
    let theirs: Value = serde_json::from_slice(&official.stdout).unwrap();
    assert_eq!(ours["tau"], theirs["tau"], "sampled τ");
    let (ours, theirs) = (
        ours["per_prompt"].as_array().unwrap(),
        theirs["prompts"].as_array().unwrap(),
    );
    assert_eq!(
        (ours.len(), theirs.len()),
        (SAMPLED_PROMPTS, SAMPLED_PROMPTS)
    );
    for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(
            o["output_ids"], t["output_ids"],
            "prompt {i}: sampled outputs differ"
        );
        assert_eq!(
            o["steps"].as_u64().unwrap() as usize,
            t["acceptance_lengths"].as_array().unwrap().len(),
            "prompt {i}: sampled verify steps"
        );
    }
}

/// Qwen3 end to end on the torch engine (five epochs), checked by the official package.
#[test]
fn qwen3_end_to_end_on_torch_and_the_official_package_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let target = arch_target(dir.path(), "qwen3");
    let demo = torch_demo_with(dir.path(), &target, 1.5, &["--epochs", "5"]);
    official_agrees(dir.path(), &target, &demo);
}

/// The DFlash2 demos: 100 conversations (5 held out), five epochs, without the untrained
/// drafter's eval. A DFlash2 drafter trains several times slower than a DFlash one on a CPU; so
/// trained it reaches τ 13.4 on the Qwen3 target and 7.0 on the Llama one (ten epochs: 11.0
/// and 8.2).
const DFLASH2: [&str; 7] = [
    "--drafter-arch",
    "dflash2",
    "--samples",
    "100",
    "--epochs",
    "5",
    "--no-baseline",
];

/// A DFlash2 drafter (`--drafter-arch dflash2`) trained on a Qwen3 target: its checkpoint names
/// `DFlash2DraftModel`, holds the convolutions and the selector, loads strictly in the official
/// package, whose decoding gives our eval's τ (within 2%) and outputs, lossless.
#[test]
fn qwen3_dflash2_end_to_end_on_torch_and_the_official_package_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let target = arch_target(dir.path(), "qwen3");
    let demo = torch_demo_with(dir.path(), &target, 1.5, &DFLASH2);
    dflash2_checkpoint(&demo);
    official_agrees(dir.path(), &target, &demo);
    // The selector's sampled walk, verified by rejection sampling over its candidates, is
    // distributed as the target's own sampling. (This target's distribution is nearly flat at
    // temperature 1, too spread for 500 draws to test; at 0.1 it is not.)
    let prompts: Value = serde_json::from_str(
        fs::read_to_string(dir.path().join("prompts.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let python = test_python();
    assert_sampled_like_the_target(
        dir.path(),
        &target,
        demo["checkpoint"].as_str().unwrap(),
        &prompts["input_ids"],
        &[
            "--engine",
            "torch",
            "--python",
            python.to_str().unwrap(),
            "--temperature",
            "0.1",
            "--seed",
            "3",
        ],
    );
    // The candle engine does not decode it, and says which does; a checkpoint without a
    // selector tensor is refused naming it.
    let eval = |drafter: &str, engine: &str| {
        orch(&[
            "eval",
            "--target-model",
            target.to_str().unwrap(),
            "--drafter",
            drafter,
            "--prompts",
            dir.path().join("demo/eval-prompts.jsonl").to_str().unwrap(),
            "--max-new-tokens",
            "8",
            "--engine",
            engine,
            "--python",
            test_python().to_str().unwrap(),
        ])
    };
    let checkpoint = demo["checkpoint"].as_str().unwrap();
    assert_refused(
        &eval(checkpoint, "candle"),
        1,
        "a DFlash2 or sliding-window drafter is decoded by the torch engine only: pass --engine torch",
    );
    let bad = dir.path().join("no-successor");
    fs::create_dir(&bad).unwrap();
    fs::copy(
        Path::new(checkpoint).join("config.json"),
        bad.join("config.json"),
    )
    .unwrap();
    let bytes = fs::read(Path::new(checkpoint).join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "candidate_selector.successor_codebook")
        .collect();
    safetensors::serialize_to_file(kept, None, &bad.join("model.safetensors")).unwrap();
    assert_refused(
        &eval(bad.to_str().unwrap(), "torch"),
        1,
        "lacks ['candidate_selector.successor_codebook']",
    );
}

/// The same on a Llama target with llama3 RoPE scaling: the official package agrees on a target
/// other than Qwen3. (The DFlash drafter is checked by it on Qwen3; the drafters differ in their
/// layers, not in what they take from the target: its features, embedding, head and RoPE base.)
#[test]
fn llama_dflash2_end_to_end_on_torch_and_the_official_package_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let target = arch_target(dir.path(), "llama");
    let demo = torch_demo_with(dir.path(), &target, 1.5, &DFLASH2);
    dflash2_checkpoint(&demo);
    official_agrees(dir.path(), &target, &demo);
}

/// The demo's checkpoint is a DFlash2 one: the class, its sizes, its tensors (the codebooks
/// without `.weight`, as the published checkpoints store them) trained away from their start.
fn dflash2_checkpoint(demo: &Value) {
    let dir = PathBuf::from(demo["checkpoint"].as_str().unwrap());
    let config: Value =
        serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "DFlash2DraftModel", "{config}");
    for key in [
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    ] {
        assert!(config["dflash_config"][key].is_u64(), "{key}: {config}");
    }
    let bytes = fs::read(dir.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = tensors.names().into_iter().map(str::to_owned).collect();
    for name in [
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.0.attention_conv.base_kernel",
        "layers.0.mlp_conv.kernel_projection.weight",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} missing: {names:?}");
    }
    // The successor codebook and the kernel projections start at zero: training moved them.
    for name in [
        "candidate_selector.successor_codebook",
        "layers.0.attention_conv.kernel_projection.weight",
    ] {
        let t = tensors.tensor(name).unwrap();
        assert!(t.data().iter().any(|&b| b != 0), "{name} never trained");
    }
}

/// Qwen3-MoE end to end on the torch engine (five epochs).
#[test]
fn qwen3_moe_end_to_end_on_torch() {
    let dir = tempfile::tempdir().unwrap();
    let target = arch_target(dir.path(), "qwen3_moe");
    torch_demo_with(
        dir.path(),
        &target,
        1.5,
        &["--no-baseline", "--epochs", "5"],
    );
}

/// gpt-oss (MoE with its router, attention sinks, sliding-window layers) end to end on the torch
/// engine: lossless before and after training, and τ at least 1.3x (every token through all
/// four experts: see make_target.py). This tiny random target's replies are the least
/// predictable of the five (the drafter's training accuracy ends near 0.35, against 0.5 and
/// more for the others), so its τ is the lowest: 1.44 at the same 200 conversations, where an
/// untrained drafter gives 1.00.
#[test]
fn gpt_oss_end_to_end_on_torch() {
    let dir = tempfile::tempdir().unwrap();
    let target = arch_target(dir.path(), "gpt_oss");
    torch_demo_with(dir.path(), &target, 1.3, &["--no-baseline"]);
}

/// Qwen3.5 (gated delta-net layers between attention ones: a state carried from token to token)
/// end to end on the torch engine, from a checkpoint `transformers` wrote for it: the features
/// from rows of one length (its packing would be refused), and `eval` lossless after a short
/// training (60 conversations, one epoch: 3 held-out prompts), where nearly every draft of this
/// tiny random target is rejected (τ near 1.0: its
/// replies are too erratic to learn in a test's minutes, at any of the weight scales tried), so
/// nearly every verify step puts the target's copied cache back and runs the kept token again.
/// Cropping that cache instead (what the official package does) is not lossless: see
/// `the_torch_generate_decodes_a_batch_as_each_prompt_alone`.
#[test]
fn qwen3_5_end_to_end_on_torch_is_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let target = arch_target(dir.path(), "qwen3_5_text");
    let config: Value =
        serde_json::from_slice(&fs::read(target.join("config.json")).unwrap()).unwrap();
    assert!(
        config["layer_types"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("linear_attention")),
        "{config}"
    );
    let demo = torch_demo_with(
        dir.path(),
        &target,
        1.0,
        &["--samples", "60", "--epochs", "1", "--no-baseline"],
    );
    let after = demo_report(&demo, "after");
    let steps: u64 = after["per_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["steps"].as_u64().unwrap())
        .sum();
    // The share of verify steps that kept the whole block (the histogram's last entry): every
    // other step took back a rejected draft.
    let whole = after["histogram"].as_array().unwrap().last().unwrap();
    let rolled_back = steps as f64 * (1.0 - whole.as_f64().unwrap());
    assert!(rolled_back >= 50.0, "{steps} steps, {whole} whole: {after}");
}

/// A target the torch engine cannot serve is refused before anything starts: an architecture
/// transformers does not know (launch and eval, exit 2, naming it), a `--target-layer-ids`
/// entry past the target's layers, and weights without the input embedding the drafter reads.
#[test]
fn a_target_the_torch_engine_cannot_serve_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = tiny_target(dir.path());
    let unknown = dir.path().join("unknown");
    fs::create_dir(&unknown).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        fs::copy(tiny.join(f), unknown.join(f)).unwrap();
    }
    let mut config: Value =
        serde_json::from_slice(&fs::read(tiny.join("config.json")).unwrap()).unwrap();
    config["architectures"] = serde_json::json!(["FooForCausalLM"]);
    config["model_type"] = serde_json::json!("foo_lm");
    fs::write(unknown.join("config.json"), config.to_string()).unwrap();
    let torch_on_cpus = [CPU_WORKERS.as_slice(), &["--engine", "torch"]].concat();
    refused_on(&unknown, &torch_on_cpus, &test_python(), "cannot load");
    // candle names the engine that would run it.
    refused_on(
        &unknown,
        &[CPU_WORKERS.as_slice(), &["--engine", "candle"]].concat(),
        &test_python(),
        "--engine torch",
    );
    // eval refuses the same target the same way, before starting a worker: its stderr.
    let eval_refused = |target: &Path| -> String {
        let out = orch(&[
            "eval",
            "--target-model",
            target.to_str().unwrap(),
            "--drafter",
            target.to_str().unwrap(),
            "--prompts",
            tiny.join("config.json").to_str().unwrap(),
            "--engine",
            "torch",
            "--python",
            test_python().to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    };
    eval_refused(&unknown);
    // A layer id past the target's four layers.
    refused(
        &[torch_on_cpus.as_slice(), &["--target-layer-ids", "0,9"]].concat(),
        &test_python(),
        "layer 9 is beyond the target's 4 layers",
    );
    // An architecture transformers runs, whose input embedding the drafter would not find
    // (gpt-neox names it embed_in): refused by launch, its dry run and eval, naming the tensor.
    let other = dir.path().join("other");
    fs::create_dir(&other).unwrap();
    let neox = arch_target(&other, "gpt_neox");
    let needle = "its one *embed_tokens.weight tensor, and the weights have none";
    refused_on(&neox, &torch_on_cpus, &test_python(), needle);
    let stderr = eval_refused(&neox);
    assert!(stderr.contains(needle), "{stderr}");
}
