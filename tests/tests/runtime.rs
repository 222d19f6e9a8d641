//! The runtime end to end: real orchestrator and worker processes on `cpu:3`, real signals.
//! Every faulty run must commit exactly what an undisturbed run of the same plan commits: one
//! commit per planned batch of every epoch, in plan order, with the same checksums.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use dflash_e2e::{
    SYNTHETIC_PLAN, alive, assert_clean, assert_refused, bin, finish, journal_events, orch, signal,
    status, stdout_ok, wait_until, worker_pid,
};
use serde_json::Value;

/// The workload of every run here, and of the plans they are checked against (with
/// `SYNTHETIC_PLAN`).
const SAMPLES: [&str; 2] = ["--synthetic", "1000"];

fn launch_command(run_dir: &Path, us_per_token: &str, extra: &[&str]) -> Command {
    // `--crash-loop` is ours: a small restart budget.
    let crash_loop = extra.contains(&"--crash-loop");
    let mut c = Command::new(bin("dflash-orch"));
    c.args(["launch", "--gpus", "cpu:3", "--run-dir"])
        .arg(run_dir)
        .args(SAMPLES)
        .args(SYNTHETIC_PLAN)
        .args(["--epochs", "2"])
        .args(["--max-restarts", if crash_loop { "2" } else { "10" }])
        .args([
            "--heartbeat-timeout",
            "1.5",
            "--synthetic-us-per-token",
            us_per_token,
        ])
        .args(extra.iter().filter(|a| **a != "--crash-loop"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// A slow run in the background (so faults land mid-run).
fn start(run_dir: &Path) -> Child {
    launch_command(run_dir, "1.5", &[]).spawn().unwrap()
}

/// `(epoch, batch, step, samples, checksum)` of every commit.
fn commits(run_dir: &Path) -> Vec<(u64, u64, u64, u64, u64)> {
    let text = fs::read_to_string(run_dir.join("journal.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "commit")
        .map(|v| {
            let n = |k: &str| v[k].as_u64().unwrap();
            (
                n("epoch"),
                n("batch"),
                n("step"),
                n("samples"),
                n("checksum"),
            )
        })
        .collect()
}

/// What an undisturbed, fast run of the same plan commits; also checks it against the plan.
fn reference() -> Vec<(u64, u64, u64, u64, u64)> {
    let dir = tempfile::tempdir().unwrap();
    let out = launch_command(dir.path(), "0", &[]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = commits(dir.path());
    let mut step = 0;
    for epoch in 0..2u64 {
        let epoch_text = epoch.to_string();
        let mut args = vec!["plan"];
        args.extend(SAMPLES);
        args.extend(SYNTHETIC_PLAN);
        args.extend(["--epoch", &epoch_text, "--json"]);
        let plan: Value = serde_json::from_str(&stdout_ok(&orch(&args))).unwrap();
        let batches = plan["batches"].as_u64().unwrap();
        let mine: Vec<_> = c.iter().filter(|x| x.0 == epoch).collect();
        assert_eq!(mine.len() as u64, batches, "one commit per planned batch");
        for (i, x) in mine.iter().enumerate() {
            assert_eq!((x.1, x.2), (i as u64, step), "plan order");
            step += 1;
        }
    }
    c
}

/// Sends `sig` to a worker of `role` mid-run; the run must commit what an undisturbed one does, and
/// the journal must record the worker's exit with `reason` and its restart.
fn fault_mid_run(role: &str, sig: &str, reason: &str) {
    let want = reference();
    let dir = tempfile::tempdir().unwrap();
    let child = start(dir.path());
    wait_until("20 commits", Duration::from_secs(60), || {
        commits(dir.path()).len() >= 20
    });
    let (id, pid) = worker_pid(dir.path(), role);
    signal(pid, sig);
    finish(child);
    assert_eq!(commits(dir.path()), want);
    let exits = journal_events(dir.path(), "worker_exit");
    assert!(
        exits
            .iter()
            .any(|e| e["worker"] == id && e["reason"].as_str().unwrap().contains(reason)),
        "{exits:?}"
    );
    assert!(
        journal_events(dir.path(), "worker_start")
            .iter()
            .filter(|e| e["worker"] == id)
            .count()
            >= 2
    );
    assert_clean(dir.path());
}

#[test]
fn sigkill_a_target_mid_run() {
    fault_mid_run("target", "KILL", "killed by SIGKILL");
}

#[test]
fn sigkill_the_drafter_mid_run() {
    fault_mid_run("drafter", "KILL", "killed by SIGKILL");
}

#[test]
fn sigstop_past_the_heartbeat_timeout() {
    fault_mid_run("target", "STOP", "missed heartbeats");
}

#[test]
fn sigkill_the_orchestrator_then_resume() {
    let want = reference();
    let dir = tempfile::tempdir().unwrap();
    let mut child = start(dir.path());
    wait_until("30 commits", Duration::from_secs(60), || {
        commits(dir.path()).len() >= 30
    });
    child.kill().unwrap();
    child.wait().unwrap();
    // Workers die with their orchestrator.
    for w in journal_events(dir.path(), "worker_start") {
        let pid = w["pid"].as_u64().unwrap();
        wait_until(
            "workers to die with the orchestrator",
            Duration::from_secs(10),
            || !alive(pid),
        );
    }
    let before = commits(dir.path()).len();
    assert!(before < want.len());
    // As if the crash had cut the last write short.
    let journal = dir.path().join("journal.jsonl");
    let mut text = fs::read(&journal).unwrap();
    text.extend_from_slice(b"{\"event\":\"commit\",\"epo");
    fs::write(&journal, text).unwrap();
    let resumed = launch_command(dir.path(), "0", &["--resume"])
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert_eq!(commits(dir.path()), want);
    assert_clean(dir.path());
}

#[test]
fn restart_a_healthy_worker_on_demand() {
    let want = reference();
    let dir = tempfile::tempdir().unwrap();
    let child = start(dir.path());
    wait_until("10 commits", Duration::from_secs(60), || {
        commits(dir.path()).len() >= 10
    });
    let out = orch(&[
        "restart",
        "--run-dir",
        dir.path().to_str().unwrap(),
        "--gpu",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("worker 1 to restart", Duration::from_secs(30), || {
        journal_events(dir.path(), "worker_start")
            .iter()
            .filter(|e| e["worker"] == 1)
            .count()
            >= 2
    });
    finish(child);
    assert_eq!(commits(dir.path()), want);
    assert_clean(dir.path());
}

#[test]
fn status_reports_every_worker_and_refuses_strangers() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = start(dir.path());
    wait_until("5 commits", Duration::from_secs(60), || {
        commits(dir.path()).len() >= 5
    });
    let s = status(dir.path());
    for key in [
        "run_dir",
        "state",
        "epoch",
        "epochs",
        "batch",
        "batches",
        "committed_steps",
        "tokens_per_s",
    ] {
        assert!(s["run"].get(key).is_some(), "run.{key} missing: {s}");
    }
    let workers = s["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3);
    for w in workers {
        for key in [
            "id",
            "role",
            "device",
            "gpu",
            "pid",
            "state",
            "cpus",
            "batches_done",
            "restarts",
            "last_exit",
            "heartbeat_age_s",
            "gpu_power_w",
            "gpu_utilization_pct",
            "gpu_memory_used_mb",
            "gpu_temperature_c",
        ] {
            assert!(w.get(key).is_some(), "worker.{key} missing: {w}");
        }
        assert!(w["gpu_power_w"].is_null());
        assert_eq!(w["gpu_unavailable"], "CPU worker");
        // Pinned as reported.
        let cpus: Vec<u64> = w["cpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap())
            .collect();
        assert!(!cpus.is_empty());
        let proc_status = fs::read_to_string(format!("/proc/{}/status", w["pid"])).unwrap();
        let allowed = proc_status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_owned();
        let listed: Vec<u64> = allowed
            .split(',')
            .flat_map(|part| match part.split_once('-') {
                Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<u64>>(),
                None => vec![part.parse().unwrap()],
            })
            .collect();
        assert_eq!(listed, cpus, "worker {} pinned to {allowed}", w["id"]);
    }
    assert_eq!(workers.iter().filter(|w| w["role"] == "drafter").count(), 1);
    let text = stdout_ok(&orch(&[
        "status",
        "--run-dir",
        dir.path().to_str().unwrap(),
    ]));
    assert!(
        text.contains("drafter") && text.contains("target"),
        "{text}"
    );

    // A socket others could use is refused by the client.
    let sock = dir.path().join("control.sock");
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&sock, fs::Permissions::from_mode(0o666)).unwrap();
    assert_refused(
        &orch(&["status", "--run-dir", dir.path().to_str().unwrap()]),
        2,
        "not owner-only",
    );
    // Another uid's `status` is refused: here by the socket's permissions, before the server sees
    // it (tests/control_peer.rs reaches the server's own peer-credential check).
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let stranger = Command::new(bin("dflash-orch"))
        .args([
            "status",
            "--run-dir",
            dir.path().to_str().unwrap(),
            "--json",
        ])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert!(!stranger.status.success());
    let err = String::from_utf8_lossy(&stranger.stderr);
    assert!(err.contains("refus") || err.contains("ermission"), "{err}");
    assert!(stranger.stdout.is_empty());
    fs::set_permissions(&sock, fs::Permissions::from_mode(0o600)).unwrap();
    status(dir.path());
    // Oversized and malformed requests get an error answer; the run goes on.
    let ask = |request: &[u8]| -> Value {
        use std::io::{BufRead, Write};
        let mut stream = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let _ = stream.write_all(request);
        let mut line = String::new();
        std::io::BufReader::new(stream)
            .read_line(&mut line)
            .unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let mut huge = vec![b' '; 70 * 1024];
    huge.push(b'\n');
    let answer = ask(&huge);
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("larger than 65536 bytes"),
        "{answer}"
    );
    for bad in [&b"{\"restart\": 7}\n"[..], b"\xff\xfe\n", b"\"shutdown\"\n"] {
        let answer = ask(bad);
        assert!(
            answer["error"].as_str().unwrap().starts_with("bad request"),
            "{answer}"
        );
    }
    status(dir.path());

    let out = orch(&["stop", "--run-dir", dir.path().to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(child.wait().unwrap().success());
    assert_eq!(
        journal_events(dir.path(), "end").last().unwrap()["status"],
        "stopped"
    );
    assert_clean(dir.path());
}

mod bad_input {
    use super::*;

    fn launch(dir: &Path, args: &[&str]) -> Output {
        let mut all = vec![
            "launch",
            "--run-dir",
            dir.to_str().unwrap(),
            "--synthetic",
            "100",
        ];
        all.extend_from_slice(args);
        orch(&all)
    }

    #[test]
    fn gpu_ids_without_gpus_point_to_cpu_workers() {
        let dir = tempfile::tempdir().unwrap();
        assert_refused(&launch(dir.path(), &["--gpus", "0-1"]), 2, "cpu:N");
        assert_refused(
            &launch(dir.path(), &["--gpus", "zero"]),
            2,
            "invalid --gpus",
        );
        assert_refused(
            &launch(dir.path(), &["--gpus", "cpu:1"]),
            2,
            "at least 2 workers",
        );
    }

    #[test]
    fn topology_must_match_the_workers() {
        let dir = tempfile::tempdir().unwrap();
        assert_refused(
            &launch(dir.path(), &["--gpus", "cpu:3", "--topology", "5:1"]),
            2,
            "needs 6 workers",
        );
        assert_refused(
            &launch(dir.path(), &["--gpus", "cpu:3", "--topology", "3"]),
            2,
            "invalid --topology",
        );
    }

    #[test]
    fn a_run_dir_with_a_live_run_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = start(dir.path());
        wait_until("the run to start", Duration::from_secs(30), || {
            !commits(dir.path()).is_empty()
        });
        assert_refused(
            &launch(dir.path(), &["--gpus", "cpu:2", "--resume"]),
            2,
            "holds a live run",
        );
        assert_refused(
            &orch(&["clean", "--run-dir", dir.path().to_str().unwrap()]),
            2,
            "holds a live run",
        );
        child.kill().unwrap();
        child.wait().unwrap();
        // Dead now: clean removes what it left in /dev/shm.
        stdout_ok(&orch(&["clean", "--run-dir", dir.path().to_str().unwrap()]));
        assert_clean(dir.path());
        // A finished or crashed run's dir is not reused by a fresh launch.
        assert_refused(&launch(dir.path(), &["--gpus", "cpu:2"]), 2, "--resume");
    }

    #[test]
    fn a_corrupt_journal_line_is_named_on_resume() {
        let dir = tempfile::tempdir().unwrap();
        let out = launch_command(dir.path(), "0", &[]).output().unwrap();
        assert!(out.status.success());
        let path = dir.path().join("journal.jsonl");
        let text = fs::read_to_string(&path).unwrap();
        let mut lines: Vec<&str> = text.lines().collect();
        lines[3] = "{\"event\": garbage";
        fs::write(&path, lines.join("\n") + "\n").unwrap();
        assert_refused(
            &launch(dir.path(), &["--resume"]),
            2,
            "journal.jsonl:4: corrupt journal line",
        );
    }
}

#[test]
fn a_crash_loop_stops_the_run_with_the_last_exit_reason() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("crashing-worker");
    fs::write(&fake, "#!/bin/sh\nexit 3\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let run = dir.path().join("run");
    let out = launch_command(&run, "0", &["--crash-loop"])
        .env("DFLASH_WORKER_BIN", &fake)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exceeded --max-restarts 2"), "{err}");
    assert!(err.contains("last exit: exited with code 3"), "{err}");
    assert_clean(&run);
}

#[test]
fn status_without_a_live_run_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = orch(&["status", "--run-dir", dir.path().to_str().unwrap()]);
    assert_refused(&out, 1, "no live run");
}

/// `/dev/shm` too small for the rings (as in a container's default 64 MB, here 1 MB in a mount
/// namespace of our own): a clear error at start naming the size needed, nothing left behind.
#[test]
fn dev_shm_too_small_is_an_error_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let script = format!(
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {} launch --gpus cpu:3 --run-dir {} --synthetic 100",
        bin("dflash-orch").display(),
        run.display()
    );
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("/dev/shm has 1 MB free, the rings need"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"));
}

/// A launch killed before its journal's first line leaves an empty journal: a new launch of the
/// same run directory starts afresh instead of refusing it.
#[test]
fn an_empty_journal_does_not_block_a_fresh_launch() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("journal.jsonl"), "").unwrap();
    let out = launch_command(dir.path(), "0", &[]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(commits(dir.path()), reference());
}

/// Sends `sig` to the orchestrator `count` times, 50 ms apart, once the run is committing.
fn interrupt_mid_run(sig: &str, count: usize) -> (tempfile::TempDir, Output) {
    let dir = tempfile::tempdir().unwrap();
    let child = start(dir.path());
    wait_until("10 commits", Duration::from_secs(60), || {
        commits(dir.path()).len() >= 10
    });
    for _ in 0..count {
        signal(child.id() as i32, sig);
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (dir, out)
}

/// SIGTERM stops the run cleanly: exit 130, the journal closed as interrupted, no worker and no
/// shared memory left; `--resume` then commits exactly what an undisturbed run does.
#[test]
fn sigterm_stops_cleanly_and_the_run_resumes() {
    let want = reference();
    let (dir, out) = interrupt_mid_run("TERM", 1);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("launch --resume"), "{stderr}");
    assert_eq!(
        journal_events(dir.path(), "end").last().unwrap()["status"],
        "interrupted"
    );
    assert_clean(dir.path());
    let resumed = launch_command(dir.path(), "0", &["--resume"])
        .output()
        .unwrap();
    assert!(resumed.status.success());
    assert_eq!(commits(dir.path()), want);
    assert_clean(dir.path());
}

/// A second SIGINT stops at once, and still leaves no worker and no shared memory behind.
#[test]
fn a_second_sigint_stops_at_once_and_leaves_nothing() {
    let (dir, out) = interrupt_mid_run("INT", 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("interrupt again to stop at once"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_clean(dir.path());
}

/// A worker binary that is not executable is refused at launch, before anything starts.
#[test]
fn a_worker_binary_that_cannot_run_is_refused_at_launch() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("dflash-worker");
    fs::write(&fake, "#!/bin/sh\nexit 0\n").unwrap();
    let run = dir.path().join("run");
    let out = launch_command(&run, "0", &[])
        .env("DFLASH_WORKER_BIN", &fake)
        .output()
        .unwrap();
    assert_refused(&out, 2, "is not executable");
    let out = launch_command(&run, "0", &[])
        .env("DFLASH_WORKER_BIN", dir.path().join("missing"))
        .output()
        .unwrap();
    assert_refused(&out, 2, "not found");
    assert!(!run.join("journal.jsonl").exists());
}

/// A run directory on a read-only file system (a tmpfs remounted read-only in a mount namespace of
/// our own): a clear error naming the directory, nothing started, no shared memory left.
#[test]
fn a_read_only_run_dir_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("ro");
    fs::create_dir(&mnt).unwrap();
    let script = format!(
        "mount -t tmpfs -o size=4m tmpfs {m} && mkdir {m}/run && mount -o remount,ro {m} && exec {} launch --gpus cpu:3 --run-dir {m}/run --synthetic 100",
        bin("dflash-orch").display(),
        m = mnt.display(),
    );
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .unwrap();
    assert_refused(&out, 2, "Read-only file system");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/ro/run"), "{stderr}");
}

/// Exit reasons stay the worker's own: after a hung worker is killed, its replacement's SIGKILL is
/// journaled as just that; and a handled signal (one SIGSEGV, which the runtime's stack-overflow
/// handler takes) does not read as a lost orchestrator.
#[test]
fn exit_reasons_are_per_process_and_a_handled_signal_is_not_a_lost_orchestrator() {
    let dir = tempfile::tempdir().unwrap();
    let child = launch_command(dir.path(), "20", &[]).spawn().unwrap();
    wait_until("5 commits", Duration::from_secs(60), || {
        commits(dir.path()).len() >= 5
    });
    let exits = |worker: u64| -> Vec<String> {
        journal_events(dir.path(), "worker_exit")
            .into_iter()
            .filter(|e| e["worker"] == worker)
            .map(|e| e["reason"].as_str().unwrap().to_owned())
            .collect()
    };
    let (id, pid) = worker_pid(dir.path(), "target");
    signal(pid, "STOP");
    wait_until("the hang to be noticed", Duration::from_secs(30), || {
        !exits(id).is_empty()
    });
    assert!(
        exits(id)[0].starts_with("missed heartbeats"),
        "{:?}",
        exits(id)
    );
    let replacement = || {
        status(dir.path())["workers"][id as usize]["pid"]
            .as_i64()
            .filter(|&p| p != i64::from(pid))
    };
    wait_until("the replacement", Duration::from_secs(30), || {
        replacement().is_some()
    });
    signal(replacement().unwrap() as i32, "KILL");
    wait_until("the second exit", Duration::from_secs(30), || {
        exits(id).len() >= 2
    });
    assert_eq!(exits(id)[1], "killed by SIGKILL");
    // One SIGSEGV to the drafter.
    let (drafter, dpid) = worker_pid(dir.path(), "drafter");
    signal(dpid, "SEGV");
    std::thread::sleep(Duration::from_millis(500));
    // It survives it, or dies of it; it never exits as if it had lost the orchestrator.
    assert!(
        exits(drafter).iter().all(|r| r.contains("SIGSEGV")),
        "{:?}",
        exits(drafter)
    );
    stdout_ok(&orch(&["stop", "--run-dir", dir.path().to_str().unwrap()]));
    finish(child);
    assert_clean(dir.path());
}
