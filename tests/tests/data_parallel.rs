//! Data-parallel drafters on the torch engine: D drafter workers form one `torch.distributed`
//! group (gloo on CPU), each trains the batches its position in the accumulation group names, and
//! every rank takes the same summed step. Runs repeat to the bit, stay within float rounding of
//! one drafter, survive a killed rank (the group restarts from its checkpoint and replays), and
//! refuse what they cannot do before starting.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use dflash_e2e::{
    DATA_PARALLEL_FLAGS, assert_clean, assert_refused, bin, final_bytes, final_checkpoint, finish,
    journal_events, launch_with, orch, signal, status, stdout_ok, tiny_target, wait_until,
};
use serde_json::Value;

/// A torch launch of [`DATA_PARALLEL_FLAGS`] on `cpu:T+D` with `--topology T:D`; `extra` adds
/// options or changes those of DATA_PARALLEL_FLAGS.
fn launch(run_dir: &Path, target: &Path, topology: (u32, u32), extra: &[&str]) -> Command {
    let (t, d) = topology;
    let (gpus, topology) = (format!("cpu:{}", t + d), format!("{t}:{d}"));
    let mut args = vec!["--gpus", &gpus, "--topology", &topology];
    if !extra.contains(&"--engine") {
        args.extend(["--engine", "torch"]);
    }
    args.extend_from_slice(extra);
    launch_with(run_dir, target, &DATA_PARALLEL_FLAGS, &args)
}

/// The largest difference between two runs' final weights, per tensor relative to the tensor's
/// largest magnitude (a per-element ratio is dominated by weights near zero), and per element.
fn weight_difference(a: &Path, b: &Path) -> (f64, f64) {
    let load = |run: &Path| -> HashMap<String, Tensor> {
        candle_core::safetensors::load(final_checkpoint(run), &Device::Cpu).unwrap()
    };
    let (a, b) = (load(a), load(b));
    assert_eq!(a.len(), b.len(), "the same tensors");
    let (mut per_tensor, mut per_element) = (0f64, 0f64);
    for (name, x) in &a {
        let flat = |t: &Tensor| -> Vec<f64> {
            t.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (x, y) = (flat(x), flat(&b[name]));
        let scale = y.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
        for (p, q) in x.iter().zip(&y) {
            per_tensor = per_tensor.max((p - q).abs() / scale);
            per_element = per_element.max((p - q).abs() / q.abs().max(1e-30));
        }
    }
    (per_tensor, per_element)
}

/// `(step, plan_step, loss)` of every optimiser step's line, in order.
fn steps(run_dir: &Path) -> Vec<(u64, u64, f64)> {
    fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "train")
        .map(|l| {
            (
                l["step"].as_u64().unwrap(),
                l["plan_step"].as_u64().unwrap(),
                l["loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Two runs with two drafters end with the same bytes; two and three drafters (the third
/// without a batch in each epoch's short last group: it joins that group's step with nothing)
/// end within float rounding of one drafter with the same `--accum`, and report one line per
/// optimiser step with the same steps and, within rounding, the same losses.
#[test]
fn data_parallel_drafters_repeat_to_the_bit_and_agree_with_one_drafter() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let run = |name: &str, topology: (u32, u32)| {
        let run_dir = dir.path().join(name);
        finish(launch(&run_dir, &target, topology, &[]).spawn().unwrap());
        assert_clean(&run_dir);
        run_dir
    };
    let one = run("one", (2, 1));
    let two = run("two", (2, 2));
    // The second run of two drafters is attacked as another user would: every socket that
    // starts listening meanwhile (the collective backend's) gets junk keys in a TCPStore's
    // format, oversized lengths, noise and silent connections, and every file of the drafters'
    // store is opened for writing. The run goes on to the same bytes.
    let attack = Attack::start(dir.path(), &dir.path().join("again"));
    let again = run("again", (2, 2));
    let report = attack.stop();
    assert!(
        final_bytes(&two) == final_bytes(&again),
        "two runs with two drafters ended with different model.safetensors (one under attack: {report})"
    );
    assert!(
        !report["attacked"].as_array().unwrap().is_empty(),
        "the attack found no listener to hit: {report}"
    );
    assert_eq!(
        report["store_files_touched"],
        Value::Array(vec![]),
        "another user wrote to the drafters' store"
    );
    let three = run("three", (2, 3));
    let reference = steps(&one);
    assert_eq!(reference.len(), 16, "2 epochs of 8 groups: {reference:?}");
    for (run_dir, drafters) in [(&two, 2), (&three, 3)] {
        let (per_tensor, per_element) = weight_difference(run_dir, &one);
        eprintln!(
            "{drafters} drafters against 1: weights differ by {per_tensor:.2e} of each tensor's largest, {per_element:.2e} per element"
        );
        assert!(per_tensor > 0.0 || final_bytes(run_dir) == final_bytes(&one));
        assert!(
            per_tensor <= 1e-5,
            "{drafters} drafters: weights {per_tensor:.2e} from one drafter's"
        );
        let lines = steps(run_dir);
        assert_eq!(lines.len(), reference.len(), "one line per optimiser step");
        for (a, b) in lines.iter().zip(&reference) {
            assert_eq!((a.0, a.1), (b.0, b.1), "the same steps at the same places");
            let rel = (a.2 - b.2).abs() / b.2.abs().max(1e-12);
            assert!(rel <= 1e-5, "step {}: loss {} against {}", a.0, a.2, b.2);
        }
    }
}

/// DFlash2 drafters in data parallel: the convolutions' and the selector's gradients are summed
/// as the layers' are. Two runs with two drafters end with the same bytes, within float rounding
/// of one drafter, with the same steps and losses, and the selector's metrics on every step.
#[test]
fn dflash2_data_parallel_drafters_repeat_to_the_bit_and_agree_with_one_drafter() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let run = |name: &str, topology: (u32, u32)| {
        let run_dir = dir.path().join(name);
        let arch = ["--drafter-arch", "dflash2", "--selector-top-k", "8"];
        finish(launch(&run_dir, &target, topology, &arch).spawn().unwrap());
        assert_clean(&run_dir);
        run_dir
    };
    let one = run("one", (2, 1));
    let two = run("two", (2, 2));
    let again = run("again", (2, 2));
    assert!(
        final_bytes(&two) == final_bytes(&again),
        "two DFlash2 runs with two drafters ended with different model.safetensors"
    );
    let (per_tensor, _) = weight_difference(&two, &one);
    assert!(
        per_tensor <= 1e-5,
        "two drafters: weights {per_tensor:.2e} from one drafter's"
    );
    let names: Vec<String> = candle_core::safetensors::load(final_checkpoint(&two), &Device::Cpu)
        .unwrap()
        .into_keys()
        .collect();
    assert!(
        names
            .iter()
            .any(|n| n == "candidate_selector.successor_codebook")
            && names
                .iter()
                .any(|n| n.ends_with("attention_conv.kernel_projection.weight")),
        "{names:?}"
    );
    let (a, b) = (steps(&two), steps(&one));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.0, x.1), (y.0, y.1));
        assert!(
            (x.2 - y.2).abs() <= 1e-5 * y.2.abs().max(1e-12),
            "{x:?} against {y:?}"
        );
    }
    let selector: Vec<f64> = fs::read_to_string(two.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["kind"] == "train")
        .map(|l| {
            l["selector_loss"]
                .as_f64()
                .expect("selector_loss on every step")
        })
        .collect();
    assert_eq!(selector.len(), a.len());
    assert!(
        selector.iter().all(|l| l.is_finite() && *l > 0.0),
        "{selector:?}"
    );
}

/// SIGKILL drafter rank 1 mid-run: the journal names the rank, the other drafter is stopped,
/// the group restarts from its last checkpoint on a fresh rendezvous and replays, and the run
/// ends with the undisturbed run's bytes. A `stop` mid-run ends cleanly at a step boundary and
/// its resume ends with the same bytes. Then the orchestrator is SIGKILLed: a resume with
/// another number of drafters is refused naming why, and the plain resume ends with the same
/// bytes.
#[test]
fn a_killed_drafter_rank_restarts_the_group_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let longer = ["--epochs", "3"];
    let reference = dir.path().join("reference");
    finish(
        launch(&reference, &target, (2, 2), &longer)
            .spawn()
            .unwrap(),
    );

    let run_dir = dir.path().join("run");
    let child = launch(&run_dir, &target, (2, 2), &longer).spawn().unwrap();
    wait_until("a checkpoint and more", Duration::from_secs(300), || {
        journal_events(&run_dir, "commit").len() >= 30
    });
    let rank1 = status(&run_dir)["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == 3)
        .and_then(|w| w["pid"].as_i64())
        .expect("drafter rank 1 (worker 3) runs");
    signal(rank1 as i32, "KILL");
    finish(child);
    let restarts = journal_events(&run_dir, "drafter_group_restart");
    assert_eq!(restarts.len(), 1, "{restarts:?}");
    assert_eq!(
        (restarts[0]["worker"].as_u64(), restarts[0]["rank"].as_u64()),
        (Some(3), Some(1))
    );
    let exits = journal_events(&run_dir, "worker_exit");
    assert!(
        exits.iter().any(|e| e["worker"] == 2
            && e["reason"]
                .as_str()
                .is_some_and(|r| r.contains("stopped with the drafter group"))),
        "rank 0 was stopped with the group: {exits:?}"
    );
    assert!(
        !journal_events(&run_dir, "rewind").is_empty(),
        "the batches after the checkpoint were replayed"
    );
    assert!(
        final_bytes(&run_dir) == final_bytes(&reference),
        "final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);

    // `stop` mid-run: the drafters first finish the groups they started (together: a rank told
    // to stop alone would leave the other waiting in a collective), then stop cleanly; the
    // resume ends with the same bytes.
    let run_dir = dir.path().join("stopped");
    let child = launch(&run_dir, &target, (2, 2), &longer).spawn().unwrap();
    wait_until("a few groups", Duration::from_secs(300), || {
        journal_events(&run_dir, "commit").len() >= 30
    });
    stdout_ok(&orch(&["stop", "--run-dir", run_dir.to_str().unwrap()]));
    finish(child);
    let end = journal_events(&run_dir, "end");
    assert_eq!(end[0]["status"], "stopped", "{end:?}");
    assert!(end[0]["reason"].is_null(), "{end:?}");
    let last = journal_events(&run_dir, "commit").pop().unwrap();
    let batch = last["batch"].as_u64().unwrap();
    assert!(
        (batch + 1).is_multiple_of(4) || batch == 29,
        "the last commit (batch {batch}) ends an accumulation group"
    );
    for exit in journal_events(&run_dir, "worker_exit") {
        assert_eq!(exit["reason"], "exited normally", "{exit}");
    }
    assert!(journal_events(&run_dir, "drafter_group_restart").is_empty());
    let mut c = Command::new(bin("dflash-orch"));
    c.args(["launch", "--resume", "--run-dir"])
        .arg(&run_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    finish(c.spawn().unwrap());
    assert!(
        final_bytes(&run_dir) == final_bytes(&reference),
        "the stopped and resumed run's final model.safetensors differs from the undisturbed run's"
    );

    let run_dir = dir.path().join("killed");
    let mut child = launch(&run_dir, &target, (2, 2), &longer).spawn().unwrap();
    wait_until("a checkpoint", Duration::from_secs(300), || {
        journal_events(&run_dir, "commit").len() >= 30
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
    let out = resume(&["--gpus", "cpu:4", "--topology", "3:1"])
        .output()
        .unwrap();
    assert_refused(&out, 2, "--resume with 1 drafters: the run trains 2");
    finish(resume(&[]).spawn().unwrap());
    assert!(
        final_bytes(&run_dir) == final_bytes(&reference),
        "the resumed run's final model.safetensors differs from the undisturbed run's"
    );
    assert_clean(&run_dir);
}

/// Refused before anything is created: data-parallel drafters on the candle engine (naming
/// --engine torch), and fewer micro-batches per group than drafters (naming --accum).
#[test]
fn data_parallel_drafters_refuse_what_they_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    for (extra, needle) in [
        (
            &["--engine", "candle"][..],
            "data-parallel drafters train on the torch engine (--engine torch)",
        ),
        (&["--accum", "1"][..], "pass --accum 2 or more"),
    ] {
        let run_dir = dir.path().join("refused");
        let out = launch(&run_dir, &target, (2, 2), extra).output().unwrap();
        assert_refused(&out, 2, needle);
        assert!(!run_dir.exists(), "nothing is created");
    }
}

/// `python/tests/attack_listeners.py` run as another user (uid 65534, the system's Python)
/// against the run in `run_dir`, until stopped.
struct Attack {
    child: std::process::Child,
    report: std::path::PathBuf,
}

impl Attack {
    fn start(dir: &Path, run_dir: &Path) -> Self {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        let home = dir.join("attacker");
        fs::create_dir_all(&home).unwrap();
        fs::set_permissions(&home, fs::Permissions::from_mode(0o777)).unwrap();
        // Readable by the attacker: the script is copied out of the workspace.
        let script = home.join("attack.py");
        fs::copy(
            dflash_e2e::workspace_root().join("python/tests/attack_listeners.py"),
            &script,
        )
        .unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o644)).unwrap();
        let report = home.join("report.json");
        let python = Path::new("/usr/bin/python3");
        assert!(
            python.exists(),
            "the attack runs on the system's /usr/bin/python3"
        );
        let mut c = Command::new(python);
        c.arg("-I")
            .arg(&script)
            .arg("--report")
            .arg(&report)
            .arg("--store-dir")
            .arg(run_dir.join("drafters"))
            .current_dir(&home)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if dflash_e2e::planted::is_root() {
            c.uid(dflash_e2e::planted::ATTACKER)
                .gid(dflash_e2e::planted::ATTACKER);
        }
        let child = c.spawn().unwrap();
        wait_until("the attack to start", Duration::from_secs(30), || {
            report.exists()
        });
        Self { child, report }
    }

    fn stop(mut self) -> Value {
        let _ = self.child.kill();
        let _ = self.child.wait();
        serde_json::from_slice(&fs::read(&self.report).unwrap()).unwrap()
    }
}
