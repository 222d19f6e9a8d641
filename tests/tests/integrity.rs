//! Run integrity end to end: a run that cannot be fooled, hung, crashed by an option or left
//! dirty. Each test feeds its bad case to the real binaries and checks the clear error, and that
//! nothing was left behind or lost.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use dflash_e2e::{
    SYNTHETIC_PLAN, assert_clean, bin, finish, journal_events, orch, run_id, signal, status,
    wait_until, worker_pid,
};

const RUN_FLAGS: [&str; 8] = [
    "--gpus",
    "cpu:3",
    "--synthetic",
    "600",
    "--epochs",
    "1",
    "--heartbeat-timeout",
    "1.5",
];

fn launch(run_dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("dflash-orch"));
    c.arg("launch")
        .args(RUN_FLAGS)
        .args(SYNTHETIC_PLAN)
        .arg("--run-dir")
        .arg(run_dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn commits(run_dir: &Path) -> Vec<(u64, u64)> {
    journal_events(run_dir, "commit")
        .iter()
        .map(|c| (c["step"].as_u64().unwrap(), c["checksum"].as_u64().unwrap()))
        .collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Segments in /dev/shm whose name carries `needle`.
fn shm_with(needle: &str) -> Vec<String> {
    fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(needle))
        .collect()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn a_job_hung_while_heartbeats_continue_is_killed_and_its_batch_handed_out_again() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference");
    finish(launch(&reference, &[]).spawn().unwrap());
    let want = commits(&reference);
    assert!(want.len() > 20);

    let run_dir = dir.path().join("run");
    let child = launch(
        &run_dir,
        &["--synthetic-us-per-token", "2", "--job-timeout", "1"],
    )
    .env("DFLASH_WORKER_FAULTS", "1")
    .spawn()
    .unwrap();
    wait_until("10 commits", Duration::from_secs(60), || {
        commits(&run_dir).len() >= 10
    });
    let (id, pid) = worker_pid(&run_dir, "target");
    signal(pid, "USR1");
    let out = finish(child);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        commits(&run_dir),
        want,
        "every batch committed once, in plan order"
    );
    let exits = journal_events(&run_dir, "worker_exit");
    let hung = exits
        .iter()
        .find(|e| e["worker"] == id && e["pid"] == pid)
        .unwrap_or_else(|| panic!("no exit of the hung worker: {exits:?}"));
    let reason = hung["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("job timeout after ") && reason.contains(" s (batch "),
        "{reason}"
    );
    assert_clean(&run_dir);
}

#[test]
fn jobs_that_always_hang_end_the_run_through_the_restart_budget() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let out = launch(&run_dir, &["--job-timeout", "1", "--max-restarts", "1"])
        .env("DFLASH_WORKER_HANG_EVERY_JOB", "1")
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("exceeded --max-restarts 1"), "{err}");
    assert!(err.contains("last exit: job timeout after "), "{err}");
    assert!(commits(&run_dir).is_empty());
    assert_clean(&run_dir);
}

#[test]
fn option_values_out_of_range_exit_2_naming_the_option_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    // This run's segments only: other tests create and remove theirs meanwhile.
    let run_id_prefix = format!("dflash-{}", run_id(&run_dir));
    let before = shm_with(&run_id_prefix);
    for (flag, value) in [
        ("--restart-window", "-1"),
        ("--heartbeat-timeout", "1e30"),
        ("--monitor-interval", "1e30"),
        ("--token-budget", "18446744073709551615"),
        ("--epochs", "4000000000"),
        ("--weight-decay", "-3"),
        ("--job-timeout", "soon"),
        ("--stop-grace", "inf"),
        ("--synthetic-us-per-token", "nan"),
    ] {
        let out = launch(&run_dir, &[&format!("{flag}={value}")])
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!run_dir.exists(), "{flag} {value}: the run dir was created");
    }
    let out = orch(&[
        "status",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--watch",
        "1e30",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--watch"));
    assert_eq!(shm_with(&run_id_prefix), before, "no segment was created");
}

#[test]
fn a_busy_metrics_port_fails_before_anything_is_written_and_a_relaunch_works() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    fs::create_dir(&run_dir).unwrap();
    fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o700)).unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let out = launch(&run_dir, &["--metrics-addr", &port])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--metrics-addr"), "{err}");
    assert!(
        entries(&run_dir).is_empty(),
        "left: {:?}",
        entries(&run_dir)
    );
    assert!(shm_with(&run_id(&run_dir)).is_empty());
    let out = launch(&run_dir, &[]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_clean(&run_dir);
}

#[test]
fn a_long_run_dir_path_runs_and_status_finds_it() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("r".repeat(140));
    assert!(run_dir.join("control.sock").as_os_str().len() > 108);
    let child = launch(&run_dir, &["--synthetic-us-per-token", "2"])
        .spawn()
        .unwrap();
    wait_until("the control socket", Duration::from_secs(30), || {
        run_dir.join("control.sock").exists()
    });
    let s = status(&run_dir);
    assert_eq!(s["workers"].as_array().unwrap().len(), 3);
    assert!(
        orch(&["stop", "--run-dir", run_dir.to_str().unwrap()])
            .status
            .success()
    );
    let out = finish(child);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_clean(&run_dir);
}

/// An undisturbed run (`reference`), then a slow run of the same plan (`run`) that has committed
/// `commits` batches: the temporary directory, both run directories and the slow run's process.
fn reference_and_slow_run(
    commits_before: usize,
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
    std::process::Child,
) {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference");
    finish(launch(&reference, &[]).spawn().unwrap());
    let run_dir = dir.path().join("run");
    let child = launch(&run_dir, &["--synthetic-us-per-token", "2"])
        .spawn()
        .unwrap();
    wait_until("commits", Duration::from_secs(60), || {
        commits(&run_dir).len() >= commits_before
    });
    (dir, reference, run_dir, child)
}

#[test]
fn resume_refuses_changed_options_naming_them_and_takes_those_that_may_change() {
    let (_dir, reference, run_dir, child) = reference_and_slow_run(10);
    signal(child.id() as i32, "TERM");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    let journal_before = fs::read(run_dir.join("journal.jsonl")).unwrap();
    let out = launch(&run_dir, &["--resume", "--seed", "5", "--accum", "8"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--accum 8 (the run has 4)"), "{err}");
    assert!(err.contains("--seed 5 (the run has 0)"), "{err}");
    assert_eq!(
        fs::read(run_dir.join("journal.jsonl")).unwrap(),
        journal_before,
        "a refused resume writes nothing"
    );
    // The same flags as the run, plus ones that may change on resume.
    let out = launch(
        &run_dir,
        &["--resume", "--max-restarts", "20", "--job-timeout", "300"],
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let resumed = journal_events(&run_dir, "resume");
    assert_eq!(resumed[0]["changes"]["max-restarts"], 20);
    assert_eq!(commits(&run_dir), commits(&reference));
    assert_clean(&run_dir);
}

#[test]
fn a_run_dir_others_can_write_is_refused_and_a_planted_lock_symlink_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
    let out = launch(&open, &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("writable by group or others"));
    assert!(entries(&open).is_empty());

    let run_dir = dir.path().join("run");
    fs::create_dir(&run_dir).unwrap();
    fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o700)).unwrap();
    let victim = dir.path().join("victim.txt");
    fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, run_dir.join("run.lock")).unwrap();
    let out = launch(&run_dir, &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("run.lock"), "{}", stderr(&out));
    assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(entries(&run_dir), ["run.lock"], "nothing else created");
}

#[test]
fn clean_removes_only_the_segments_this_run_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let mut child = launch(&run_dir, &["--synthetic-us-per-token", "2"])
        .spawn()
        .unwrap();
    wait_until("a commit", Duration::from_secs(60), || {
        !commits(&run_dir).is_empty()
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let run_id = run_id(&run_dir);
    let recorded: Vec<String> = fs::read_to_string(run_dir.join("segments"))
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(recorded.len(), 2);
    for path in &recorded {
        assert!(Path::new(path).exists(), "{path}");
        assert!(path.contains(&run_id));
    }
    // Someone else's file with a name like the run's.
    let decoy = format!("/dev/shm/dflash-{run_id}-decoy");
    fs::write(&decoy, "not ours").unwrap();
    for w in journal_events(&run_dir, "worker_start") {
        let pid = w["pid"].as_u64().unwrap();
        wait_until("workers to exit", Duration::from_secs(10), || {
            !dflash_e2e::alive(pid)
        });
    }
    let out = orch(&["clean", "--run-dir", run_dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    for path in &recorded {
        assert!(!Path::new(path).exists(), "{path} left");
    }
    assert!(
        Path::new(&decoy).exists(),
        "clean removed a segment it did not record"
    );
    fs::remove_file(&decoy).unwrap();
}

#[test]
fn sighup_stops_a_launch_cleanly_and_it_resumes() {
    let (_dir, reference, run_dir, child) = reference_and_slow_run(5);
    signal(child.id() as i32, "HUP");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert_eq!(
        journal_events(&run_dir, "end").last().unwrap()["status"],
        "interrupted"
    );
    assert_clean(&run_dir);
    let out = launch(&run_dir, &["--resume"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(commits(&run_dir), commits(&reference));
}

/// The run directory fills up (a 96 KB tmpfs in a mount namespace of our own): the run stops with
/// the reason, the journal holds whole lines only (nothing glued onto a partial one), shared
/// memory is removed, and the run resumes from its journal once there is room.
#[test]
fn a_full_disk_stops_the_run_cleanly_with_whole_journal_lines_and_it_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference");
    finish(launch(&reference, &[]).spawn().unwrap());
    let mnt = dir.path().join("small");
    let moved = dir.path().join("moved");
    fs::create_dir(&mnt).unwrap();
    let script = format!(
        "mount -t tmpfs -o size=96k,mode=0700 tmpfs {m} && {bin} launch {flags} --run-dir {m}/run; echo \"rc=$?\"; cp -a {m}/run {o}",
        bin = bin("dflash-orch").display(),
        flags = [&RUN_FLAGS[..], &SYNTHETIC_PLAN].concat().join(" "),
        m = mnt.display(),
        o = moved.display(),
    );
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let err = stderr(&out);
    assert!(stdout.contains("rc=1"), "{stdout}\n{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let journal = fs::read_to_string(moved.join("journal.jsonl")).unwrap();
    assert!(
        journal.ends_with('\n'),
        "the journal ends with a whole line"
    );
    for (i, line) in journal.lines().enumerate() {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "line {} is not a whole entry: {line:?}",
            i + 1
        );
    }
    let committed = commits(&moved).len();
    assert!(
        committed < commits(&reference).len(),
        "the disk filled mid-run"
    );
    // The rings lived in /dev/shm, outside the namespace's tmpfs: removed on the way out. (Their
    // names carry the id of the run directory's path inside the namespace.)
    fs::create_dir(mnt.join("run")).unwrap();
    assert!(shm_with(&run_id(&mnt.join("run"))).is_empty());
    // The metrics too may end in a line the full disk cut; the resume cuts it before appending.
    // (And a torn line of our own making, whatever the disk did.)
    let metrics = moved.join("metrics.jsonl");
    let mut text = fs::read(&metrics).unwrap();
    text.extend_from_slice(b"{\"kind\":\"batch\",\"ti");
    fs::write(&metrics, text).unwrap();
    let out = launch(&moved, &["--resume"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(commits(&moved), commits(&reference));
    assert_clean(&moved);
    let text = fs::read_to_string(&metrics).unwrap();
    for (i, line) in text.lines().enumerate() {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "metrics line {} is not a whole record: {line:?}",
            i + 1
        );
    }
}

/// A file of the run directory that is a hard link to another file (or not a file at all) is
/// refused before anything is written, its target untouched, by the launch and its dry run
/// alike.
#[test]
fn a_hard_linked_run_file_is_refused_and_the_file_it_links_to_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    for (i, name) in [
        "run.lock",
        "journal.jsonl",
        "metrics.jsonl",
        "logs/worker-0.log",
    ]
    .into_iter()
    .enumerate()
    {
        let run_dir = dir.path().join(format!("hl-{i}"));
        fs::create_dir_all(run_dir.join("logs")).unwrap();
        fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o700)).unwrap();
        fs::write(&victim, "precious\n").unwrap();
        fs::hard_link(&victim, run_dir.join(name)).unwrap();
        for extra in [&[][..], &["--dry-run"][..]] {
            let out = launch(&run_dir, extra).output().unwrap();
            let err = stderr(&out);
            assert_eq!(
                out.status.code(),
                Some(if extra.is_empty() { 2 } else { 1 }),
                "{name}: {err}"
            );
            assert!(
                err.contains(&format!("{name} has 2 hard links")),
                "{name}: {err}"
            );
        }
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious\n", "{name}");
        fs::remove_file(run_dir.join(name)).unwrap();
    }
    // A FIFO where the metrics go: refused too, never opened (a FIFO would block the launch).
    let run_dir = dir.path().join("fifo");
    fs::create_dir(&run_dir).unwrap();
    fs::set_permissions(&run_dir, fs::Permissions::from_mode(0o700)).unwrap();
    let made = Command::new("mkfifo")
        .arg(run_dir.join("metrics.jsonl"))
        .status()
        .unwrap();
    assert!(made.success());
    let out = launch(&run_dir, &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("metrics.jsonl is not a regular file"),
        "{}",
        stderr(&out)
    );
}

/// A failed launch removes every directory it created, its parents too, and nothing else.
#[test]
fn a_failed_launch_removes_the_parents_it_created() {
    let dir = tempfile::tempdir().unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    fs::create_dir(dir.path().join("np")).unwrap();
    for deep in ["np/a/b/run", "fresh/run", "np/run"] {
        let run_dir = dir.path().join(deep);
        let out = launch(&run_dir, &["--metrics-addr", &port])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert_eq!(entries(dir.path()), ["np"], "{deep}");
        assert!(entries(&dir.path().join("np")).is_empty(), "{deep}");
    }
    // A parent that gained a file meanwhile is someone's: kept. (Here: one made beforehand and
    // left alone, the empty ones below it removed.)
    fs::write(dir.path().join("np/keep"), "x").unwrap();
    let out = launch(&dir.path().join("np/c/d/run"), &["--metrics-addr", &port])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(entries(&dir.path().join("np")), ["keep"]);
}

/// What a launch refuses, its dry run refuses with the same message (one validation path).
#[test]
fn the_dry_run_refuses_what_a_launch_refuses_with_the_same_message() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("tiny");
    let out = orch(&["init-tiny", "--output", target.to_str().unwrap()]);
    assert!(out.status.success());
    let context = dflash_worker::model::qwen3::read_config(&target)
        .unwrap()
        .max_position_embeddings
        .unwrap();
    let long = dir.path().join("long.jsonl");
    let ids: Vec<u32> = (0..context as u32 + 808).map(|i| 5 + i % 500).collect();
    fs::write(
        &long,
        serde_json::json!({ "input_ids": ids }).to_string() + "\n",
    )
    .unwrap();
    let completed = dir.path().join("completed");
    assert!(launch(&completed, &[]).output().unwrap().status.success());
    let live_less = dir.path().join("empty-run");
    fs::create_dir(&live_less).unwrap();
    fs::set_permissions(&live_less, fs::Permissions::from_mode(0o700)).unwrap();
    let t = target.to_str().unwrap();
    let dflash = |more: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "--stage",
            "dflash",
            "--target-model",
            t,
            "--draft-layers",
            "1",
            "--num-anchors",
            "8",
        ]
        .map(String::from)
        .to_vec();
        v.extend(more.iter().map(|s| s.to_string()));
        v
    };
    let nonexistent = dir.path().join("nonexistent.jsonl");
    let cases: Vec<(&str, std::path::PathBuf, Vec<String>)> = vec![
        (
            "eval prompts that do not exist",
            dir.path().join("r1"),
            dflash(&[
                "--eval-every",
                "1",
                "--eval-prompts",
                nonexistent.to_str().unwrap(),
            ]),
        ),
        (
            "an eval prompt past the target's context",
            dir.path().join("r2"),
            dflash(&[
                "--eval-every",
                "1",
                "--eval-prompts",
                long.to_str().unwrap(),
            ]),
        ),
        (
            "a resume of a completed run",
            completed.clone(),
            vec!["--resume".into()],
        ),
        (
            "a resume of a directory without a run",
            live_less.clone(),
            vec!["--resume".into()],
        ),
        (
            "a resume that changes the plans",
            completed.clone(),
            vec!["--resume".into(), "--epochs".into(), "3".into()],
        ),
        (
            "a fresh launch into an earlier run",
            completed.clone(),
            vec![],
        ),
        (
            "a target for another stage",
            dir.path().join("r3"),
            dflash(&["--target-layer-ids", "1,99"]),
        ),
    ];
    for (what, run_dir, extra) in cases {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let out = launch(&run_dir, &extra).output().unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{what}: the launch: {err}");
        let message = err
            .lines()
            .find_map(|l| l.strip_prefix("error: "))
            .unwrap_or_else(|| panic!("{what}: no error line: {err}"))
            .to_owned();
        let mut dry = extra.clone();
        dry.push("--dry-run");
        let out = launch(&run_dir, &dry).output().unwrap();
        let dry_err = stderr(&out);
        assert_ne!(
            out.status.code(),
            Some(0),
            "{what}: the dry run passed: {dry_err}"
        );
        assert!(
            dry_err.contains(&message),
            "{what}: the dry run says\n{dry_err}\nthe launch said\n{message}"
        );
    }
}

/// Every interval and timeout option has one range wherever it appears, checked when the line
/// is parsed: out of it, exit 2 naming the option and the range, nothing written.
#[test]
fn every_interval_and_timeout_has_one_range_wherever_it_appears() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let output = dir.path().join("out.jsonl");
    let o = output.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "generate",
                "--target-model",
                d,
                "--input",
                d,
                "--output",
                o,
                "--job-timeout",
                "18446744073709551615",
            ],
            "1 to 604800 seconds",
        ),
        (
            vec![
                "generate",
                "--target-model",
                d,
                "--input",
                d,
                "--output",
                o,
                "--job-timeout",
                "0",
            ],
            "1 to 604800 seconds",
        ),
        (
            vec![
                "eval",
                "--target-model",
                d,
                "--drafter",
                d,
                "--prompts",
                o,
                "--job-timeout",
                "1e9",
            ],
            "1 to 604800 seconds",
        ),
        (
            vec![
                "launch",
                "--synthetic",
                "10",
                "--run-dir",
                d,
                "--job-timeout",
                "0.5",
            ],
            "1 to 604800 seconds",
        ),
        (
            vec!["top", "--run-dir", d, "--interval", "1e-300"],
            "0.05 to 3600 seconds",
        ),
        (
            vec!["top", "--run-dir", d, "--interval", "0"],
            "0.05 to 3600 seconds",
        ),
        (
            vec!["status", "--run-dir", d, "--watch", "1e-300"],
            "0.05 to 3600 seconds",
        ),
        (
            vec![
                "launch",
                "--synthetic",
                "10",
                "--run-dir",
                d,
                "--monitor-interval",
                "1e-300",
            ],
            "0.05 to 3600 seconds",
        ),
    ];
    for (args, range) in cases {
        let out = orch(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let option = args
            .iter()
            .find(|a| {
                a.starts_with("--")
                    && (a.contains("timeout") || a.contains("interval") || a.contains("watch"))
            })
            .unwrap();
        assert!(
            err.contains(option) && err.contains(range),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            entries(dir.path()).is_empty(),
            "{args:?} wrote {:?}",
            entries(dir.path())
        );
    }
}

/// `restart` (and every control client) against a socket that answers garbage, or nothing:
/// the socket is named and the message says the run does not answer.
#[test]
fn a_control_socket_that_answers_garbage_or_nothing_is_named() {
    use std::io::{BufRead, Write};
    use std::os::unix::net::UnixListener;
    for (answer, needle) in [
        (
            Some("garbage\n"),
            "answered something that is not a control answer",
        ),
        (
            Some("null\n"),
            "answered something that is not a control answer",
        ),
        (
            Some("{\"ok\":true}\n"),
            "answered the restart without naming a worker",
        ),
        (None, "the run does not answer on"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let socket = dflash_common::run_dir::control_socket(dir.path());
        let listener = UnixListener::bind(&socket).unwrap();
        fs::set_permissions(&socket, fs::Permissions::from_mode(0o600)).unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                let mut line = String::new();
                let _ = std::io::BufReader::new(&stream).read_line(&mut line);
                match answer {
                    Some(a) => {
                        let _ = stream.write_all(a.as_bytes());
                    }
                    // Silent: holds the connection open.
                    None => std::thread::sleep(Duration::from_secs(30)),
                }
            }
        });
        let out = orch(&[
            "restart",
            "--run-dir",
            dir.path().to_str().unwrap(),
            "--worker",
            "0",
        ]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(needle), "{err}");
        assert!(err.contains("control.sock"), "{err}");
        assert!(!err.contains("restarting worker"), "{err}");
    }
}
