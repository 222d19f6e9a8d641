//! The torch engine's faults end with their reason, at once, and leave nothing behind. A fake
//! interpreter (a script written here, passed as `--python`) answers the pre-flight as a good
//! Python would, then misbehaves as `dflash_orch.serve` or `dflash_orch.decode`: a line that
//! is not UTF-8, an output closed while it lives on, an endless line, an answer to another
//! request, an exit without the answers it owed, a decoder that hangs. The real Python (the
//! test environment's) fails on damaged checkpoints, and its reason reaches the user.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use candle_core::Device;
use dflash_e2e::{
    alive, assert_clean, bin, child_with, orch, signal, stdout_ok, test_python, tiny_target,
    wait_until, workspace_root,
};
use dflash_worker::checkpoint;
use dflash_worker::model::drafter::{Drafter, DrafterConfig};
use dflash_worker::model::qwen3::read_config;
use serde_json::Value;

/// The fake interpreter: stdlib Python run by the test environment's interpreter. It finds its
/// role in its arguments whatever the flags around it (`-m dflash_orch.serve`, or a bootstrap
/// given the module's name), answers the pre-flight, and plays `serve` or `decode` as `MODE`
/// says; anything else runs in the real interpreter. It records what it saw in `MARKS`.
const FAKE: &str = r#"
import json, os, sys, time

def role():
    for a in sys.argv[1:]:
        base = a.rsplit("/", 1)[-1]
        for name in ("preflight", "serve", "decode"):
            if base in ("dflash_orch." + name, name + ".py"):
                return name
    return None

def mark(name, value):
    with open(os.path.join(MARKS, f"{name}-{os.getpid()}"), "w") as f:
        f.write(json.dumps(value))

def hang():
    while True:
        time.sleep(60)

def send(raw):
    os.write(1, raw)

def answer(value):
    send((json.dumps(value) + "\n").encode())

r = role()
if r is None:
    os.execv(sys.executable, [sys.executable] + sys.argv[1:])
if r == "preflight":
    print(json.dumps({
        "python": "3.12.3", "executable": sys.executable, "package": "0.1.0",
        "package_path": __file__, "protocol": PROTOCOL, "torch": "2.11.0",
        "transformers": "5.17.0", "safetensors": "0.6.0", "cuda_available": False,
        "cuda_devices": 0, "cuda_version": None, "model_error": None,
    }))
    sys.exit(0)
mark(r, {"args": sys.argv[1:], "tmpdir": os.environ.get("TMPDIR")})

if r == "serve":
    for line in sys.stdin:
        req = json.loads(line)
        i = req.get("id")
        if req["op"] == "init":
            with open(os.path.join(req["model"], "config.json")) as f:
                c = json.load(f)
            init = {"ok": True, "id": i, "protocol": PROTOCOL, "vocab": c["vocab_size"],
                    "layers": c["num_hidden_layers"], "hidden": c["hidden_size"],
                    "attention": "sdpa", "device": "cpu", "torch": "2.11.0",
                    "transformers": "5.17.0"}
            if MODE == "stale":
                # A package of protocol 1: no ids, and it refuses the worker's protocol.
                answer({"ok": False, "error": f"dflash-worker speaks protocol {req['protocol']}, "
                        "this dflash_orch package 1 (/old/site-packages/dflash_orch/serve.py): "
                        "install the package of the same tree"})
                continue
            answer(init)
            if MODE == "duplicate":
                answer(init)
            continue
        # The first job: the fault.
        if MODE == "not_utf8":
            send(b'{"ok": true, "id": ' + str(i).encode() + b', "x": "\xff\xfe"}\n')
        elif MODE == "closed":
            os.close(1)
        elif MODE == "exit":
            sys.exit(3)
        elif MODE == "endless":
            block = b"a" * 65536
            while True:
                send(block)
        elif MODE == "long_json":
            send(b'{"ok": true, "id": ' + str(i).encode() + b', "pad": "'
                 + b"a" * (5 << 20) + b'"}\n')
        elif MODE == "other_id":
            answer({"ok": True, "id": i + 1, "nonfinite": None})
        elif MODE == "duplicate":
            pass  # its answer was sent already, to init
        hang()
    sys.exit(0)

# decode: the request, then as MODE says.
req = json.loads(sys.stdin.readline())
mark("request", {"drafter": req.get("drafter")})
if "eval" in sys.argv[1:]:
    d = req["drafter"]
    mark("drafter", {"dir": d, "mode": os.stat(d).st_mode & 0o7777,
                     "parent_mode": os.stat(os.path.dirname(d)).st_mode & 0o7777,
                     "files": sorted(os.listdir(d))})
if MODE == "exit0":
    print("loaded; nothing to say", file=sys.stderr)
    sys.exit(0)
if MODE == "hang":
    hang()
# generate: every job answered, or the first only and then a hang.
for n, line in enumerate(sys.stdin):
    if not line.strip():
        continue
    if MODE == "first_batch" and n > 0:
        hang()
    job = json.loads(line)
    answer({"batch": job["batch"], "outputs": [[7, 8] for _ in job["prompts"]]})
"#;

/// A fake interpreter in `dir` playing `mode`, recording in `dir/marks`.
fn fake_python(dir: &Path, mode: &str) -> PathBuf {
    let marks = dir.join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    let path = dir.join(format!("python-{mode}"));
    let text = format!(
        "#!{}\nMODE = {mode:?}\nMARKS = {:?}\nPROTOCOL = {}\n{FAKE}",
        test_python().display(),
        marks.display().to_string(),
        dflash_worker::torch::PROTOCOL
    );
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// What the fake recorded: `(name-pid, value)` of each mark.
fn marks(dir: &Path) -> Vec<(String, Value)> {
    let Ok(entries) = std::fs::read_dir(dir.join("marks")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let text = std::fs::read_to_string(e.path()).ok()?;
            Some((
                e.file_name().to_string_lossy().into_owned(),
                serde_json::from_str(&text).ok()?,
            ))
        })
        .collect()
}

/// The pids of the fake's `role` processes.
fn fake_pids(dir: &Path, role: &str) -> Vec<u64> {
    marks(dir)
        .into_iter()
        .filter_map(|(name, _)| name.strip_prefix(&format!("{role}-"))?.parse().ok())
        .collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A short run with the torch target (the fake's `serve`) feeding the candle drafter. The job
/// deadline is long: a fault that only the deadline ended would run past the test's timeout.
fn launch_on(dir: &Path, target: &Path, python: &Path) -> (PathBuf, Output) {
    let run_dir = dir.join(format!(
        "run-{}",
        python.file_name().unwrap().to_string_lossy()
    ));
    let out = Command::new(bin("dflash-orch"))
        .args([
            "launch",
            "--stage",
            "dflash",
            "--synthetic",
            "64",
            "--epochs",
            "1",
            "--max-len",
            "64",
            "--token-budget",
            "512",
            "--buckets",
            "auto:2",
            "--draft-layers",
            "1",
            "--num-anchors",
            "8",
            "--gpus",
            "cpu:2",
            "--topology",
            "1:1",
            "--engine",
            "target=torch,drafter=candle",
            "--job-timeout",
            "900",
            "--heartbeat-timeout",
            "900",
            "--max-restarts",
            "0",
        ])
        .arg("--python")
        .arg(python)
        .arg("--target-model")
        .arg(target)
        .arg("--run-dir")
        .arg(&run_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (run_dir, out)
}

/// The run failed (exit 1), not at its job deadline, with `reason` in its error (a fault that
/// fails the run) or in the target worker's log (a fault that ends the worker as a crash); the
/// fake's serve processes are gone and the run left nothing behind.
fn assert_ended_by(dir: &Path, run_dir: &Path, out: &Output, reason: &str, in_error: bool) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        !err.contains("deadline") && !err.contains("timeout"),
        "ended by a deadline: {err}"
    );
    let log = std::fs::read_to_string(run_dir.join("logs/worker-0.log")).unwrap_or_default();
    let error_line = err.lines().find(|l| l.starts_with("error:")).unwrap_or("");
    if in_error {
        assert!(error_line.contains(reason), "{reason:?} not in {err}");
    } else {
        assert!(
            error_line.contains("exceeded --max-restarts 0"),
            "not a crash: {err}"
        );
    }
    assert!(
        log.contains(reason),
        "{reason:?} not in the worker's log: {log}"
    );
    let serves = fake_pids(dir, "serve");
    assert!(!serves.is_empty(), "the fake served");
    for pid in serves {
        wait_until(
            "the fake's serve to be gone",
            Duration::from_secs(10),
            || !alive(pid),
        );
    }
    assert_clean(run_dir);
}

/// A torch child that breaks the pipe ends its worker at once with the reason, killed before it
/// is reaped: an answer line that is not UTF-8 fails the run naming it; a child that closes its
/// output but lives on, or exits without answering, ends the worker as a crash (the
/// orchestrator restarts it; here `--max-restarts 0` ends the run), the reason and the child's
/// exit status in the worker's log. Neither waits for the job deadline.
#[test]
fn a_torch_child_that_breaks_the_pipe_ends_its_worker_at_once_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let cases = [
        (
            "not_utf8",
            "the torch child sent a line that is not UTF-8; it was still running and was killed",
            true,
        ),
        (
            "closed",
            "the torch child closed its output; it was still running and was killed",
            false,
        ),
        (
            "exit",
            "the torch child closed its output; it exited (exit status: 3)",
            false,
        ),
    ];
    for (mode, reason, in_error) in cases {
        let here = dir.path().join(mode);
        let python = fake_python(&here, mode);
        let (run_dir, out) = launch_on(&here, &target, &python);
        assert_ended_by(&here, &run_dir, &out, reason, in_error);
    }
}

/// An answer line is read up to 4 MiB: an endless line, or a 5 MiB answer that is otherwise
/// right, fails the run naming the limit, the child killed, the worker's memory never holding
/// more than the limit.
#[test]
fn an_answer_line_over_four_mebibytes_fails_the_run_without_being_read_whole() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    for mode in ["endless", "long_json"] {
        let here = dir.path().join(mode);
        let python = fake_python(&here, mode);
        let (run_dir, out) = launch_on(&here, &target, &python);
        assert_ended_by(
            &here,
            &run_dir,
            &out,
            "the torch child sent an answer line longer than 4 MiB; it was still running and was killed",
            true,
        );
    }
}

/// Every request carries an id and its answer must name it: a duplicated answer (the second
/// answer to init, read as the first job's) and an answer naming another request fail the run
/// naming both ids; a package of the old protocol, which answers no id, is refused with its own
/// words about the protocol.
#[test]
fn an_answer_to_another_request_fails_the_run_naming_both_ids() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let cases = [
        (
            "duplicate",
            "the torch child answered request 1 where 2 was due",
        ),
        (
            "other_id",
            "the torch child answered request 3 where 2 was due",
        ),
        (
            "stale",
            "answered without a request id (a dflash_orch package older than protocol",
        ),
    ];
    for (mode, reason) in cases {
        let here = dir.path().join(mode);
        let python = fake_python(&here, mode);
        let (run_dir, out) = launch_on(&here, &target, &python);
        assert_ended_by(&here, &run_dir, &out, reason, true);
        if mode == "stale" {
            let err = stderr(&out);
            assert!(
                err.contains("this dflash_orch package 1") && err.contains("same tree"),
                "{err}"
            );
        }
    }
}

/// The id echo of `dflash_orch.serve` itself (python/tests/check_serve.py): every answer names
/// its request's id, refusals and failures included; an unreadable request ends it (exit 2).
/// And the ring's registration with CUDA: nothing on a CPU; without a GPU the ring stays
/// pageable, says why and stays usable.
#[test]
fn the_python_server_names_the_request_of_every_answer() {
    let out = Command::new(test_python())
        .arg(workspace_root().join("python/tests/check_serve.py"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
}

struct Drafters {
    _dir: tempfile::TempDir,
    target: PathBuf,
    drafter: PathBuf,
    prompts: PathBuf,
}

/// The tiny target, a random drafter checkpoint for it, two prompts.
fn drafters() -> Drafters {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let c = read_config(&target).unwrap();
    let drafter = Drafter::new(
        DrafterConfig::for_target(&c, 1, 8, 5, vec![1, 2]),
        3,
        &Device::Cpu,
    )
    .unwrap();
    let saved = checkpoint::save(
        &dir.path().join("checkpoints"),
        &checkpoint::Snapshot {
            state: checkpoint::TrainingState::default(),
            weights: checkpoint::weights(&drafter).unwrap(),
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
        "{\"input_ids\": [3, 40, 41, 42]}\n{\"input_ids\": [3, 100, 7]}\n",
    )
    .unwrap();
    Drafters {
        _dir: dir,
        target,
        drafter: saved,
        prompts,
    }
}

/// A copy of the checkpoint with its `model.safetensors` edited by `edit`.
fn damaged(d: &Drafters, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let dir = d.drafter.parent().unwrap().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(d.drafter.join("config.json"), dir.join("config.json")).unwrap();
    let mut bytes = std::fs::read(d.drafter.join("model.safetensors")).unwrap();
    edit(&mut bytes);
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    dir
}

fn eval_command(d: &Drafters, drafter: &Path, python: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("dflash-orch"));
    c.args(["eval", "--engine", "torch", "--max-new-tokens", "4"])
        .arg("--python")
        .arg(python)
        .arg("--target-model")
        .arg(&d.target)
        .arg("--drafter")
        .arg(drafter)
        .arg("--prompts")
        .arg(&d.prompts)
        .args(extra)
        .stdin(Stdio::null());
    c
}

/// The first `error:` line, and the whole of stderr.
fn error_of(out: &Output) -> (String, String) {
    let err = stderr(out);
    let line = err
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line: {err}"))
        .to_owned();
    (line, err)
}

/// `eval` and `generate` on torch end with the Python side's own reason in their error line and
/// its last lines below it, where they used to say "its log is above" and print none: a NaN
/// drafter checkpoint for eval and a truncated target `model.safetensors` for generate (the real
/// Python); a decoder that exits normally without its answers, for both. A generate whose worker
/// fails before any batch fails once, not after three restarts.
#[test]
fn the_python_sides_reason_reaches_the_user_of_eval_and_generate() {
    let d = drafters();
    let python = test_python();
    // A NaN in a drafter tensor: the header is intact, so eval gets as far as the decoder.
    let nan = damaged(&d, "nan", |bytes| {
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let at = header["fc.weight"]["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let out = eval_command(&d, &nan, &python, &[]).output().unwrap();
    let (line, err) = error_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        line.contains("the torch engine's decoder failed")
            && line.contains("tensor fc.weight holds non-finite values"),
        "{err}"
    );
    assert!(!err.contains("its log is above"), "{err}");
    // The child's own error line is the reason: not quoted twice.
    assert_eq!(err.matches("holds non-finite values").count(), 1, "{err}");

    // A decoder that exits normally without a result.
    let fakes = tempfile::tempdir().unwrap();
    let exit0 = fake_python(fakes.path(), "exit0");
    let out = eval_command(&d, &d.drafter, &exit0, &[]).output().unwrap();
    let (line, err) = error_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        line.contains("exited normally after 0 of 2 prompts, without the results it owed"),
        "{err}"
    );
    assert!(err.contains("loaded; nothing to say"), "{err}");

    // generate: the same decoder, owing the batches it was sent; then the real Python on a
    // target whose weights are cut short: once each, with the reason.
    let input = fakes.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"input_ids\": [3, 40, 41]}\n{\"input_ids\": [3, 9]}\n",
    )
    .unwrap();
    let generate = |target: &Path, python: &Path, output: &str| {
        Command::new(bin("dflash-orch"))
            .args(["generate", "--engine", "torch", "--max-new-tokens", "4"])
            .arg("--python")
            .arg(python)
            .arg("--target-model")
            .arg(target)
            .arg("--input")
            .arg(&input)
            .arg("--output")
            .arg(fakes.path().join(output))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = generate(&d.target, &exit0, "exit0.jsonl");
    let (line, err) = error_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        line.contains("before any batch was done (not restarted")
            && line.contains("exited normally before its input ended, without the answers it owed"),
        "{err}"
    );
    assert!(!err.contains("restarting it"), "{err}");
    assert_eq!(
        fake_pids(fakes.path(), "decode").len(),
        2,
        "one eval, one generate"
    );

    let cut_target = fakes.path().join("cut-target");
    std::fs::create_dir(&cut_target).unwrap();
    for f in std::fs::read_dir(&d.target).unwrap().flatten() {
        std::fs::copy(f.path(), cut_target.join(f.file_name())).unwrap();
    }
    let weights = cut_target.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 4096]).unwrap();
    let out = generate(&cut_target, &python, "cut.jsonl");
    let (line, err) = error_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("restarting it"), "retried: {err}");
    assert!(
        line.contains("generate worker 0") && line.contains("before any batch was done"),
        "{err}"
    );
    assert!(
        line.contains("the torch engine's decoder failed (exit status: 1): "),
        "{err}"
    );
    assert!(err.contains("its last lines before that:"), "{err}");
}

/// `eval --engine torch --init-seed 0` writes the untrained weights into a fresh private
/// directory (0700, under a private directory of the command's own, neither at a name another
/// user could guess), and removes it however it ends: at its job deadline, on SIGINT or SIGTERM
/// to the command, and on SIGINT or SIGTERM to its worker.
#[test]
fn the_untrained_drafters_weights_are_private_and_removed_on_every_exit() {
    let d = drafters();
    let cases = [
        ("deadline", None),
        ("INT", Some(false)),
        ("TERM", Some(false)),
        ("INT", Some(true)),
        ("TERM", Some(true)),
    ];
    for (n, (how, to_worker)) in cases.into_iter().enumerate() {
        let here = tempfile::tempdir().unwrap();
        let tmp = here.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        let python = fake_python(here.path(), "hang");
        let timeout = if how == "deadline" { "3" } else { "900" };
        let child = eval_command(&d, &d.drafter, &python, &["--init-seed", "0"])
            .args(["--job-timeout", timeout])
            .env("TMPDIR", &tmp)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let eval_pid = child.id();
        let worker = child_with(eval_pid, "--eval", Duration::from_secs(60));
        wait_until(
            "the decoder to see the weights",
            Duration::from_secs(60),
            || {
                marks(here.path())
                    .iter()
                    .any(|(k, _)| k.starts_with("drafter-"))
            },
        );
        let (_, seen) = marks(here.path())
            .into_iter()
            .find(|(k, _)| k.starts_with("drafter-"))
            .unwrap();
        let dir = PathBuf::from(seen["dir"].as_str().unwrap());
        assert!(dir.starts_with(&tmp), "case {n}: {dir:?}");
        assert_eq!(seen["mode"], 0o700, "case {n}: {seen}");
        assert_eq!(seen["parent_mode"], 0o700, "case {n}: {seen}");
        assert!(
            seen["files"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f == "model.safetensors"),
            "case {n}: {seen}"
        );
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !name.contains(&worker.to_string()) && !name.contains(&eval_pid.to_string()),
            "a name made of a pid: {name}"
        );
        match (how, to_worker) {
            ("deadline", _) => {}
            (sig, Some(true)) => signal(worker as i32, sig),
            (sig, _) => signal(eval_pid as i32, sig),
        }
        let out = child.wait_with_output().unwrap();
        let err = stderr(&out);
        match (how, to_worker) {
            ("deadline", _) => {
                assert_eq!(out.status.code(), Some(1), "{err}");
                assert!(err.contains("--job-timeout"), "{err}");
            }
            (_, Some(false)) => assert_eq!(out.status.code(), Some(130), "{err}"),
            (sig, _) => {
                assert_eq!(out.status.code(), Some(1), "{err}");
                assert!(err.contains(&format!("stopped by SIG{sig}")), "{err}");
            }
        }
        for pid in fake_pids(here.path(), "decode") {
            wait_until("the decoder to be gone", Duration::from_secs(10), || {
                !alive(pid)
            });
        }
        wait_until("the worker to be gone", Duration::from_secs(10), || {
            !alive(u64::from(worker))
        });
        let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().flatten().collect();
        assert!(left.is_empty(), "case {n} ({how}) left {left:?}");
    }
}

/// The rows of an output begun on one engine are never continued on the other: a `--resume` of
/// a torch output (sampled at 0.8, or greedy) on candle is refused naming both engines and
/// writes nothing; resumed on torch it completes, and its metadata names the engine.
#[test]
fn a_resume_on_another_engine_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let input = dir.path().join("in.jsonl");
    let rows: String = (0..6)
        .map(|r| format!("{{\"input_ids\": [3, {}, 41]}}\n", 40 + r))
        .collect();
    std::fs::write(&input, rows).unwrap();
    let first = fake_python(dir.path(), "first_batch");
    let all = fake_python(dir.path(), "all");
    for temperature in ["0.8", "0"] {
        let output = dir.path().join(format!("out-{temperature}.jsonl"));
        let command = |engine: &str, python: &Path, resume: bool| {
            let mut c = Command::new(bin("dflash-orch"));
            c.args(["generate", "--max-new-tokens", "4", "--batch-size", "2"])
                .args(["--temperature", temperature, "--engine", engine])
                .arg("--python")
                .arg(python)
                .arg("--target-model")
                .arg(&target)
                .arg("--input")
                .arg(&input)
                .arg("--output")
                .arg(&output)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            if resume {
                c.arg("--resume");
            }
            c
        };
        let record = PathBuf::from(format!("{}.partial.json", output.display()));
        let child = command("torch", &first, false).spawn().unwrap();
        wait_until("the first batch", Duration::from_secs(60), || {
            std::fs::read(&record)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .is_some_and(|r| r["rows"] == 2)
        });
        signal(child.id() as i32, "INT");
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
        let before = std::fs::read(&record).unwrap();

        let out = command("candle", &all, true).output().unwrap();
        let (line, err) = error_of(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            line.contains("generated on the torch engine, and --engine candle would continue them")
                && line.contains("resume with --engine torch"),
            "{err}"
        );
        assert!(
            line.contains(if temperature == "0" {
                "even greedy rows are not provably the same"
            } else {
                "sampled rows depend on the engine"
            }),
            "{err}"
        );
        assert_eq!(
            std::fs::read(&record).unwrap(),
            before,
            "the record changed"
        );

        let out = command("torch", &all, true).output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        let rows = std::fs::read_to_string(&output).unwrap();
        assert_eq!(rows.lines().count(), 6);
        let meta: Value = serde_json::from_slice(
            &std::fs::read(format!("{}.meta.json", output.display())).unwrap(),
        )
        .unwrap();
        assert_eq!(meta["settings"]["engine"], "torch", "{meta}");
    }
    assert!(stdout_ok(&orch(&["--version"])).contains("dflash-orch"));
}
