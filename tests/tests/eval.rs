//! `dflash-orch eval` end to end: a drafter checkpoint, the tiny target and a prompts file give
//! τ, the histogram, the speedup and a passed lossless check; a drafter made for another target
//! and prompts the target cannot take are refused before any worker starts, naming the fault.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use candle_core::Device;
use dflash_e2e::{alive, assert_refused, bin, child_with, orch, signal, stdout_ok, wait_until};
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
            config: checkpoint::hf_config(&drafter.config, &c),
            written: None,
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

/// `eval` of `drafter` on the setup's target and prompts, then `extra`.
fn eval_args<'a>(s: &'a Setup, drafter: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
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
    args
}

fn eval(s: &Setup, drafter: &Path, extra: &[&str]) -> std::process::Output {
    orch(&eval_args(s, drafter, extra))
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

/// Sampling values no decoder can use are refused before a worker starts, naming the option.
#[test]
fn sampling_values_out_of_range_are_refused() {
    let s = setup();
    let cases: [(&[&str], &str); 9] = [
        (
            &["--temperature=-1"],
            "-1 is out of range: must be 0 to 100",
        ),
        (
            &["--temperature", "101"],
            "101 is out of range: must be 0 to 100",
        ),
        (
            &["--temperature", "nan"],
            "'--temperature <T>': nan is out of range",
        ),
        (
            &["--temperature", "inf"],
            "'--temperature <T>': inf is out of range",
        ),
        (
            &["--temperature", "1", "--top-p", "0"],
            "'--top-p <P>': must be above 0",
        ),
        (
            &["--temperature", "1", "--top-p", "1.5"],
            "1.5 is out of range: must be 0 to 1",
        ),
        (
            &["--temperature", "1", "--top-k", "601"],
            "--top-k 601 is larger than the target's vocabulary (600 tokens)",
        ),
        (
            &["--top-p", "0.9"],
            "--top-p acts only when sampling: give --temperature above 0",
        ),
        (
            &["--top-k", "5", "--seed", "1"],
            "--top-k, --seed act only when sampling",
        ),
    ];
    for (extra, want) in cases {
        assert_refused(&eval(&s, &s.drafter, extra), 2, want);
    }
}

/// Sampled eval replays from its seed, each prompt from a stream of its own (its output does not
/// depend on the prompts before it), and reports τ with no token-for-token claim.
#[test]
fn sampled_eval_replays_from_its_seed() {
    let s = setup();
    let sampled = |extra: &[&str]| -> Value {
        let mut args = vec!["--max-new-tokens", "12", "--ignore-eos", "--json"];
        args.extend_from_slice(extra);
        serde_json::from_str(&stdout_ok(&orch(&eval_args(&s, &s.drafter, &args)))).unwrap()
    };
    let outputs = |v: &Value| -> Vec<Value> {
        v["per_prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["output_ids"].clone())
            .collect()
    };
    let a = sampled(&["--temperature", "1", "--seed", "4"]);
    let b = sampled(&["--temperature", "1", "--seed", "4"]);
    assert_eq!(outputs(&a), outputs(&b));
    assert_eq!(a["lossless"], Value::Null, "{a}");
    assert_eq!(a["sampling"]["seed"], 4);
    assert!(a["tau"].as_f64().unwrap() >= 1.0);
    // The first prompt alone (--limit 1) draws what it drew beside the others.
    let first = sampled(&["--temperature", "1", "--seed", "4", "--limit", "1"]);
    assert_eq!(outputs(&first)[0], outputs(&a)[0]);
    // Another seed draws other tokens; greedy decoding is one output, lossless.
    let c = sampled(&["--temperature", "1", "--seed", "5"]);
    assert_ne!(outputs(&a), outputs(&c));
    let greedy = sampled(&[]);
    assert_eq!(greedy["lossless"], true);
    assert_eq!(greedy["sampling"], Value::Null);
}

/// A copy of the checkpoint whose model.safetensors has its header (the JSON table) and data
/// edited by `edit`, as a damaged or tampered file would be.
fn tampered(s: &Setup, name: &str, edit: impl FnOnce(&mut Value, &mut [u8])) -> PathBuf {
    let dir = s.root.parent().unwrap().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(s.drafter.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(s.drafter.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    edit(&mut header, &mut data);
    let mut text = header.to_string().into_bytes();
    // The data starts 8-byte aligned, as the format asks.
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

/// Fills tensor `name`'s data with the f32 `value`.
fn fill(header: &Value, data: &mut [u8], name: &str, value: f32) {
    let offsets = &header[name]["data_offsets"];
    let (a, b) = (
        offsets[0].as_u64().unwrap() as usize,
        offsets[1].as_u64().unwrap() as usize,
    );
    for chunk in data[a..b].chunks_exact_mut(4) {
        chunk.copy_from_slice(&value.to_le_bytes());
    }
}

#[test]
fn a_damaged_checkpoint_is_refused_naming_the_fault_not_reported_as_lossless() {
    let s = setup();
    // A tensor relabelled I32 (the same bytes): refused before a worker starts.
    let dir = tampered(&s, "i32", |h, _| h["fc.weight"]["dtype"] = "I32".into());
    assert_refused(
        &eval(&s, &dir, &["--max-new-tokens", "4"]),
        2,
        "tensor fc.weight has dtype I32",
    );
    let dir = tampered(&s, "u8", |h, _| {
        h["norm.weight"]["dtype"] = "U8".into();
        let offsets = h["norm.weight"]["data_offsets"].clone();
        let a = offsets[0].as_u64().unwrap();
        let shape = h["norm.weight"]["shape"].clone();
        // Four times the elements in one byte each: the table still fits the data.
        let n: u64 = shape
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        h["norm.weight"]["shape"] = serde_json::json!([n * 4]);
        h["norm.weight"]["data_offsets"] = serde_json::json!([a, a + n * 4]);
    });
    assert_refused(
        &eval(&s, &dir, &["--max-new-tokens", "4"]),
        2,
        "tensor norm.weight has dtype U8",
    );
    // Non-finite weights: the worker refuses them, naming the tensor.
    for (name, tensor, value) in [
        ("nan", "fc.weight", f32::NAN),
        ("inf", "norm.weight", f32::INFINITY),
        (
            "neg-inf",
            "layers.0.self_attn.q_proj.weight",
            f32::NEG_INFINITY,
        ),
    ] {
        let dir = tampered(&s, name, |h, d| fill(h, d, tensor, value));
        let out = eval(&s, &dir, &["--max-new-tokens", "4"]);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("tensor {tensor} holds non-finite values")),
            "{name}: {err}"
        );
        assert!(!String::from_utf8_lossy(&out.stdout).contains("lossless"));
    }
    // Config numbers out of range.
    for (name, edit, want) in [
        (
            "rope",
            Box::new(|c: &mut Value| c["rope_theta"] = 0.into()) as Box<dyn FnOnce(&mut Value)>,
            "rope_theta 0 is out of range",
        ),
        (
            "block",
            Box::new(|c: &mut Value| {
                c["block_size"] = 1_000_000_000u64.into();
                c["dflash_config"]["block_size"] = 1_000_000_000u64.into();
            }),
            "block_size 1000000000 is out of range",
        ),
        (
            "eps",
            Box::new(|c: &mut Value| c["rms_norm_eps"] = 5.into()),
            "rms_norm_eps 5 is out of range",
        ),
        (
            "heads",
            Box::new(|c: &mut Value| {
                c["num_attention_heads"] = 4096.into();
                c["num_key_value_heads"] = 4096.into();
            }),
            "num_attention_heads 4096 is out of range",
        ),
    ] {
        let dir = edited(&s, name, edit);
        assert_refused(&eval(&s, &dir, &["--max-new-tokens", "4"]), 2, want);
    }
    assert_refused(
        &eval(&s, &s.drafter, &["--stop-token-ids", "4294967295"]),
        2,
        "--stop-token-ids: 4294967295 is outside the target's vocabulary",
    );
}

fn eval_child(s: &Setup, tmp: &Path, extra: &[&str]) -> std::process::Child {
    eval_command(s, &s.drafter, tmp, extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// `eval` as a command, with `TMPDIR` set to `tmp`.
fn eval_command(s: &Setup, drafter: &Path, tmp: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("dflash-orch"));
    c.args(eval_args(s, drafter, extra)).env("TMPDIR", tmp);
    c
}

/// The eval worker of the `dflash-orch eval` process `parent`, once it runs.
fn eval_worker(parent: u32) -> u32 {
    child_with(parent, "--eval", Duration::from_secs(30))
}

#[test]
fn a_stopped_eval_worker_is_killed_at_its_deadline_and_a_signal_ends_eval_at_once() {
    let s = setup();
    let tmp = tempfile::tempdir().unwrap();
    // SIGSTOP: the worker is alive, silent and holds its pipes open.
    let child = eval_child(
        &s,
        tmp.path(),
        &[
            "--max-new-tokens",
            "2000",
            "--ignore-eos",
            "--job-timeout",
            "2",
        ],
    );
    let worker = eval_worker(child.id());
    signal(worker as i32, "STOP");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gave no result for 2 s (--job-timeout)") && err.contains("killed"),
        "{err}"
    );
    wait_until(
        "the stopped worker to be gone",
        Duration::from_secs(10),
        || !alive(u64::from(worker)),
    );

    // The same, stopped, but interrupted: SIGINT and SIGTERM end eval at once (130), the worker
    // killed, nothing left behind.
    for sig in ["INT", "TERM"] {
        let child = eval_child(
            &s,
            tmp.path(),
            &["--max-new-tokens", "2000", "--ignore-eos"],
        );
        let worker = eval_worker(child.id());
        signal(worker as i32, "STOP");
        signal(child.id() as i32, sig);
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(130), "{sig}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("interrupted"),
            "{sig}"
        );
        wait_until("the worker to be gone", Duration::from_secs(10), || {
            !alive(u64::from(worker))
        });
    }
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "eval left files in its temporary directory"
    );
}

#[test]
fn eval_writes_no_request_file_and_follows_no_link_another_user_planted() {
    let s = setup();
    // A shared, sticky temporary directory where another user (nobody, uid 65534) plants links
    // at every name an eval request had, pointing at a file only root may write.
    let tmp = tempfile::tempdir().unwrap();
    let shared = tmp.path().join("tmp");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "root's file\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let root = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
    };
    let last_pid: u32 = std::fs::read_to_string("/proc/sys/kernel/ns_last_pid")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    if root {
        // One `ln` per name, run as uid 65534, for the pids the next processes will take.
        let mut script = String::new();
        for pid in last_pid..last_pid + 400 {
            for n in 0..2 {
                script.push_str(&format!(
                    "ln -s {} {}/dflash-eval-{pid}-{n}.json\n",
                    victim.display(),
                    shared.display()
                ));
            }
        }
        let planted = Command::new("sh")
            .args(["-c", &script])
            .uid(65534)
            .gid(65534)
            .status()
            .unwrap();
        assert!(planted.success());
    } else {
        eprintln!("not root: no other user can plant links here; checking no file is made");
    }
    let before: Vec<_> = std::fs::read_dir(&shared)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let out = eval_child(&s, &shared, &["--max-new-tokens", "6"])
        .wait_with_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A failed eval too (the worker refuses non-finite weights).
    let nan = tampered(&s, "nan-planted", |h, d| fill(h, d, "fc.weight", f32::NAN));
    let out = orch_in(&shared, &s, &nan);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's file\n");
    let after: Vec<_> = std::fs::read_dir(&shared)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(before.len(), after.len(), "eval created files in TMPDIR");
}

fn orch_in(tmp: &Path, s: &Setup, drafter: &Path) -> std::process::Output {
    eval_command(s, drafter, tmp, &["--max-new-tokens", "4"])
        .output()
        .unwrap()
}
