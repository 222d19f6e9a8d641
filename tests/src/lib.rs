//! Helpers for end-to-end tests: find the real binaries and run them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod planted;

/// The planner's shape of the synthetic runtime tests (after `--synthetic N`): batches of up to
/// 16,384 tokens, samples of up to 4,096, four automatic buckets.
pub const SYNTHETIC_PLAN: [&str; 6] = [
    "--token-budget",
    "16384",
    "--max-len",
    "4096",
    "--buckets",
    "auto:4",
];

/// Path of a workspace binary built in the same profile as the running test
/// (`target/<profile>/<name>`). The binaries must be built first: `cargo build --release --bins`.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} not found: build the binaries first (cargo build --release --bins)",
        path.display()
    );
    path
}

/// Hidden states `indices` of one sequence run alone through `model` from position 0: one
/// `[tokens, hidden]` tensor per index (the reference the cached and packed paths are held to).
pub fn hidden_states_alone(
    model: &dflash_worker::model::qwen3::Qwen3,
    tokens: &[u32],
    indices: &[usize],
) -> Vec<candle_core::Tensor> {
    use candle_core::{DType, Device, Tensor};
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
        .into_iter()
        .map(|t| t.squeeze(0).unwrap())
        .collect()
}

/// Runs `dflash-orch` with arguments and returns its output.
pub fn orch(args: &[&str]) -> Output {
    Command::new(bin("dflash-orch"))
        .args(args)
        .output()
        .expect("run dflash-orch")
}

/// Stdout of a successful run, as text; panics with stderr otherwise.
pub fn stdout_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

/// Asserts a clean refusal: the given exit code, one `error:` line naming `needle`, no panic.
pub fn assert_refused(out: &Output, code: i32, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "panic:\n{stderr}");
    let first = stderr.lines().next().unwrap_or("");
    assert!(first.starts_with("error:"), "first line: {first:?}");
    assert!(
        first.contains(needle),
        "expected {needle:?} in the error line: {first:?}"
    );
    assert!(out.stdout.is_empty(), "stdout not empty on error");
}

/// Journal entries of one kind.
pub fn journal_events(run_dir: &Path, event: &str) -> Vec<Value> {
    fs::read_to_string(run_dir.join("journal.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

pub fn wait_until(what: &str, deadline: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn status(run_dir: &Path) -> Value {
    let out = orch(&["status", "--run-dir", run_dir.to_str().unwrap(), "--json"]);
    serde_json::from_str(&stdout_ok(&out)).unwrap()
}

pub fn worker_pid(run_dir: &Path, role: &str) -> (u64, i32) {
    let s = status(run_dir);
    let w = s["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["role"] == role && w["pid"].is_u64())
        .unwrap_or_else(|| panic!("no live {role} in {s}"));
    (w["id"].as_u64().unwrap(), w["pid"].as_u64().unwrap() as i32)
}

pub fn signal(pid: i32, sig: &str) {
    assert!(
        Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

pub fn alive(pid: u64) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// No worker of the run left, no segment of the run in /dev/shm.
pub fn assert_clean(run_dir: &Path) {
    for w in journal_events(run_dir, "worker_start") {
        let pid = w["pid"].as_u64().unwrap();
        wait_until("workers to exit", Duration::from_secs(10), || !alive(pid));
    }
    let run_id = run_id(run_dir);
    let left: Vec<_> = fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(&run_id))
        .collect();
    assert!(left.is_empty(), "segments left: {left:?}");
}

/// The run id of a run directory, what its shared-memory segments are named after: the
/// orchestrator's own function, so the two cannot drift apart.
pub use dflash_common::run_dir::run_id;

pub fn finish(child: Child) -> Output {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "launch failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The Python interpreter of the test venv (`scripts/setup-test-env`; `DFLASH_TEST_PYTHON`
/// overrides it), which holds the reference clients: safetensors, tensorboard, prometheus_client.
pub fn test_python() -> PathBuf {
    let python = std::env::var_os("DFLASH_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    assert!(
        python.exists(),
        "{} not found: run scripts/setup-test-env first (README's test command does)",
        python.display()
    );
    python
}

/// The workspace's root directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the workspace")
        .to_path_buf()
}

/// A file of `scripts/`.
pub fn script(name: &str) -> PathBuf {
    workspace_root().join("scripts").join(name)
}

/// The pids of `parent`'s child processes, whichever of its threads started them: from each
/// thread's `children` file, or, on a kernel without those files, from every process's parent.
pub fn children(parent: u32) -> Vec<u32> {
    if std::path::Path::new(&format!("/proc/{parent}/task/{parent}/children")).exists() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) else {
            return Vec::new();
        };
        return tasks
            .flatten()
            .flat_map(|task| {
                std::fs::read_to_string(task.path().join("children"))
                    .unwrap_or_default()
                    .split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
    }
    let Ok(all) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    all.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // The parent is the 4th field of `stat`, after the name in parentheses.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(parent)
            })
        })
        .collect()
}

/// The child of `parent` whose command line holds `flag` (e.g. a `dflash-worker --eval`), once
/// it runs.
pub fn child_with(parent: u32, flag: &str, deadline: Duration) -> u32 {
    let mut found = None;
    wait_until(&format!("a child with {flag}"), deadline, || {
        found = children(parent).into_iter().find(|&c| {
            std::fs::read(format!("/proc/{c}/cmdline"))
                .is_ok_and(|cmd| cmd.split(|&b| b == 0).any(|arg| arg == flag.as_bytes()))
        });
        found.is_some()
    });
    found.expect("waited for it")
}

/// A random-weight Qwen3 target from `dflash-orch init-tiny`, in `dir/target`.
pub fn tiny_target(dir: &Path) -> PathBuf {
    let target = dir.join("target");
    stdout_ok(&orch(&["init-tiny", "--output", target.to_str().unwrap()]));
    target
}

/// `base`'s `--flag value` pairs, less those `extra` gives again (the caller appends `extra`).
pub fn flags_without<'a>(base: &[&'a str], extra: &[&str]) -> Vec<&'a str> {
    base.chunks(2)
        .filter(|pair| !extra.contains(&pair[0]))
        .flatten()
        .copied()
        .collect()
}

/// The data-parallel runs (one node or several): 30 batches an epoch, groups of 4 (the last of
/// 2), an optimiser step per group, a checkpoint every 3 steps.
pub const DATA_PARALLEL_FLAGS: [&str; 24] = [
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
    "4",
    "--draft-layers",
    "1",
    "--num-anchors",
    "24",
    "--save-every",
    "3",
    "--heartbeat-timeout",
    "10",
    "--max-restarts",
    "5",
];

/// `dflash-orch launch` of `base`'s options with `extra` (which replaces the pairs of `base` it
/// repeats), the test venv's Python, `target` and `run_dir`; quiet but for its stderr.
pub fn launch_with(run_dir: &Path, target: &Path, base: &[&str], extra: &[&str]) -> Command {
    let mut c = Command::new(bin("dflash-orch"));
    c.arg("launch")
        .args(flags_without(base, extra))
        .arg("--python")
        .arg(test_python())
        .args(extra)
        .arg("--target-model")
        .arg(target)
        .arg("--run-dir")
        .arg(run_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// The newest checkpoint's `model.safetensors` of a DFlash run.
pub fn final_checkpoint(run_dir: &Path) -> PathBuf {
    let root = run_dir.join("checkpoints");
    let latest = fs::read_to_string(root.join("latest")).unwrap();
    root.join(latest.trim()).join("model.safetensors")
}

pub fn final_bytes(run_dir: &Path) -> Vec<u8> {
    fs::read(final_checkpoint(run_dir)).unwrap()
}

/// The uid and gid of `nobody`: another user of the machine, for the attacks.
pub const STRANGER: u32 = 65534;

/// A run's secret for `--rendezvous-secret-file`: 32 random bytes in `dir/name`, mode 0600.
pub fn secret_file(dir: &Path, name: &str) -> PathBuf {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let mut bytes = [0u8; 32];
    fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut bytes))
        .unwrap();
    let path = dir.join(name);
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(&bytes))
        .unwrap();
    path
}

/// `tests/src/bin/link-attacker` run as another user ([`STRANGER`], when the tests run as root):
/// its lines as they come. It ends when this is dropped (its stdin closes).
pub struct LinkAttacker {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    _copy: tempfile::TempDir,
}

impl LinkAttacker {
    pub fn start(args: &[&str]) -> Self {
        use std::io::BufRead;
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        use std::os::unix::process::CommandExt;
        // A copy where the other user may run it.
        let copy = tempfile::tempdir().unwrap();
        fs::set_permissions(copy.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let exe = copy.path().join("link-attacker");
        fs::copy(bin("link-attacker"), &exe).unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
        let mut command = Command::new(&exe);
        command
            .args(args)
            .env_clear()
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
            command.uid(STRANGER).gid(STRANGER);
        }
        let mut child = command.spawn().unwrap();
        if fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
            // Set before its exec: another user from its first instruction.
            let status = fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
            let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
            assert!(
                uid.contains(&STRANGER.to_string()),
                "the attacker runs as {uid}"
            );
        }
        let out = child.stdout.take().unwrap();
        let (to, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if to.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            lines,
            _copy: copy,
        }
    }

    /// Its next line (within two minutes).
    pub fn line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(120))
            .expect("a line of the attacker")
    }

    /// Its lines up to and without the one equal to `last`.
    pub fn lines_until(&self, last: &str) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            let line = self.line();
            if line == last {
                return lines;
            }
            lines.push(line);
        }
    }
}

impl Drop for LinkAttacker {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Draws of [`assert_sampled_like_the_target`]: enough for a chi-square test of tens of cells
/// that rejects another temperature's distribution at p below 1e-60 on the tests' targets.
const SAMPLING_DRAWS: usize = 500;

/// The whole `eval --json` report a `demo --json` summary names under `served.reports`
/// (`which`: "before" or "after").
pub fn demo_report(demo: &Value, which: &str) -> Value {
    let path = demo["served"]["reports"][which]
        .as_str()
        .unwrap_or_else(|| panic!("the demo names no {which} report: {demo}"));
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

/// `eval` with `extra` sampling options (`--temperature`, `--top-p`, `--top-k`, `--seed`, an
/// engine) of `prompt_ids` repeated [`SAMPLING_DRAWS`] times, three new tokens each, then
/// `python/tests/check_sampling.py`: the draws must pass the chi-square test against the target's
/// exact sampling distribution at significance 0.001 and reject the distribution of another
/// temperature; and the first speculative step must both keep (10 % or more) and reject (10 %
/// or more) its first drafted token. Returns the check's verdict.
pub fn assert_sampled_like_the_target(
    dir: &Path,
    target: &Path,
    drafter: &str,
    prompt_ids: &Value,
    extra: &[&str],
) -> Value {
    let repeated = dir.join("repeated.jsonl");
    let line = serde_json::json!({ "input_ids": prompt_ids }).to_string();
    fs::write(&repeated, format!("{line}\n").repeat(SAMPLING_DRAWS)).unwrap();
    let mut args = vec![
        "eval",
        "--target-model",
        target.to_str().unwrap(),
        "--drafter",
        drafter,
        "--prompts",
        repeated.to_str().unwrap(),
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let draws = dir.join("draws.json");
    fs::write(&draws, stdout_ok(&orch(&args))).unwrap();
    let value = |flag: &str, default: &'static str| {
        extra
            .iter()
            .position(|a| *a == flag)
            .map_or(default, |i| extra[i + 1])
    };
    let check = Command::new(test_python())
        .arg(workspace_root().join("python/tests/check_sampling.py"))
        .args(["--target-model", target.to_str().unwrap()])
        .args(["--eval", draws.to_str().unwrap()])
        .args(["--temperature", value("--temperature", "1")])
        .args(["--top-p", value("--top-p", "1")])
        .args(["--top-k", value("--top-k", "0")])
        .args(["--alpha", "0.001"])
        .output()
        .unwrap();
    let verdict: Value = serde_json::from_slice(&check.stdout).unwrap_or_else(|e| {
        panic!(
            "check_sampling.py: {e}\n{}",
            String::from_utf8_lossy(&check.stderr)
        )
    });
    assert!(check.status.success(), "{extra:?}: {verdict}");
    let kept = verdict["accepted_share"].as_f64().unwrap();
    assert!((0.1..=0.9).contains(&kept), "{extra:?}: {verdict}");
    verdict
}
