//! The control server's own peer check, reached for real: a process of another uid connects to a
//! live run's socket itself and sends a well-formed request line, with no client in the way, and
//! the server answers with its refusal.
//!
//! Why this reaches the server's check and nothing else: the socket and the run directory are
//! owner-only, so the test (root, the run's owner) opens them to everyone for the duration — the
//! kernel then lets the stranger's `connect` through. The stranger is this test binary, copied
//! where uid 65534 can run it and started with `CommandExt::uid`/`gid`, so it is the process that
//! calls `connect` and SO_PEERCRED records uid 65534 (credentials are captured at connect time,
//! by the connecting process; a descriptor handed down by root would carry root's). It speaks the
//! protocol directly, so `control::request`'s client-side checks (permissions, owner) never run.
//! The owner sends the very same line over the very same opened socket and gets the run's status,
//! so the line is valid and the socket is reachable; the only difference is the peer's uid.
//! Were the server's check removed, the stranger would get that status too (no `error`), and a
//! connect stopped by file permissions would be reported as a connect error: either way the exact
//! refusal text asserted below would be missing and the test would fail.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dflash_e2e::{bin, orch, status, wait_until};
use serde_json::Value;

/// Set in the stranger's environment: the socket it connects to.
const STRANGER_SOCKET: &str = "DFLASH_TEST_STRANGER_SOCKET";
/// The uid and gid of `nobody`.
const STRANGER: u32 = 65534;
const TEST_NAME: &str = "another_uid_is_refused_by_the_server";
const REQUEST: &[u8] = b"{\"cmd\":\"status\"}\n";

/// Stops the run if the test fails half-way, so no run outlives it: SIGTERM first (the run stops
/// its workers and removes its segments), SIGKILL if it is still there after 10 s.
struct RunningLaunch(Option<Child>);

impl Drop for RunningLaunch {
    fn drop(&mut self) {
        let Some(mut child) = self.0.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// One request line over a raw connection; the answer line, or why there was none.
fn ask(socket: &Path) -> Result<String, String> {
    let mut stream = UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|e| e.to_string())?;
    // The server answers a stranger without reading the request and closes, so the write may
    // meet a closed socket (EPIPE); the answer is in the receive buffer all the same.
    let written = stream.write_all(REQUEST);
    let mut line = String::new();
    match (BufReader::new(stream).read_line(&mut line), written) {
        (Ok(n), _) if n > 0 => Ok(line.trim_end().to_owned()),
        (_, Err(e)) => Err(format!("write: {e}")),
        (Err(e), Ok(())) => Err(format!("read: {e}")),
        (Ok(_), Ok(())) => Err("closed without an answer".into()),
    }
}

/// The effective uid of this process, from `/proc/self/status`.
fn effective_uid() -> u32 {
    fs::read_to_string("/proc/self/status")
        .expect("read /proc/self/status")
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|euid| euid.parse().ok())
        .expect("an Uid: line")
}

/// The stranger's side: who it is, then the server's answer, one marked line each on stdout.
fn stranger(socket: &Path) {
    println!("stranger uid {}", effective_uid());
    match ask(socket) {
        Ok(answer) => println!("stranger answer {answer}"),
        Err(e) => println!("stranger error {e}"),
    }
}

#[test]
fn another_uid_is_refused_by_the_server() {
    if let Some(socket) = std::env::var_os(STRANGER_SOCKET) {
        stranger(Path::new(&socket));
        return;
    }
    if effective_uid() != 0 {
        eprintln!("skipped: starting a process as uid {STRANGER} needs root");
        return;
    }

    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path();
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("launch.stderr");
    let child = Command::new(bin("dflash-orch"))
        .args(["launch", "--gpus", "cpu:2", "--run-dir"])
        .arg(run_dir)
        .args(["--synthetic", "1000", "--token-budget", "16384"])
        .args(["--max-len", "4096", "--buckets", "auto:4"])
        // Long enough to outlast the test; it is stopped at the end.
        .args(["--epochs", "1000", "--synthetic-us-per-token", "1.5"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut run = RunningLaunch(Some(child));
    let socket = run_dir.join("control.sock");
    wait_until("the control socket", Duration::from_secs(60), || {
        if let Some(end) = run.0.as_mut().and_then(|c| c.try_wait().unwrap()) {
            panic!(
                "the run ended early ({end}): {}",
                fs::read_to_string(&log).unwrap_or_default()
            );
        }
        socket.exists()
            && orch(&["status", "--run-dir", run_dir.to_str().unwrap()])
                .status
                .success()
    });
    assert_eq!(fs::metadata(&socket).unwrap().mode() & 0o777, 0o600);
    assert_eq!(fs::metadata(&socket).unwrap().uid(), 0);

    // The stranger: this test binary, copied where uid 65534 can execute it.
    let helper_dir = tempfile::tempdir().unwrap();
    fs::set_permissions(helper_dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let helper = helper_dir.path().join("control-peer-stranger");
    fs::copy(std::env::current_exe().unwrap(), &helper).unwrap();
    fs::set_permissions(&helper, fs::Permissions::from_mode(0o755)).unwrap();

    // Open the way to the socket: search permission on the run directory, write on the socket.
    fs::set_permissions(run_dir, fs::Permissions::from_mode(0o711)).unwrap();
    fs::set_permissions(&socket, fs::Permissions::from_mode(0o666)).unwrap();
    let owner = ask(&socket);
    let out = Command::new(&helper)
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads", "1"])
        .env_clear()
        .env(STRANGER_SOCKET, &socket)
        .current_dir("/")
        .uid(STRANGER)
        .gid(STRANGER)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    fs::set_permissions(&socket, fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(run_dir, fs::Permissions::from_mode(0o700)).unwrap();

    // The owner's raw line over the opened socket is answered with the run's status.
    let owner: Value = serde_json::from_str(&owner.expect("the owner's request")).unwrap();
    assert!(owner.get("error").is_none(), "{owner}");
    assert!(owner["workers"].is_array(), "{owner}");

    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stranger failed: {stdout}\n{stderr}");
    // libtest's own "test ... " may lead the stranger's first line.
    let marked = |mark: &str| {
        stdout
            .lines()
            .find_map(|l| l.split_once(mark))
            .map(|(_, rest)| rest.to_owned())
    };
    assert_eq!(
        marked("stranger uid ").as_deref(),
        Some("65534"),
        "the stranger did not run as uid {STRANGER}: {stdout}"
    );
    let answer = marked("stranger answer ")
        .unwrap_or_else(|| panic!("the stranger got no answer from the server: {stdout}"));
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(
        answer,
        serde_json::json!({"error": "refused: uid 65534 is not the run's owner"}),
        "the server did not refuse the stranger"
    );

    // The refusal was for that peer only: the run goes on serving its owner, and stops cleanly.
    assert!(status(run_dir)["workers"].is_array());
    let stop = orch(&["stop", "--run-dir", run_dir.to_str().unwrap()]);
    assert!(
        stop.status.success(),
        "{}",
        String::from_utf8_lossy(&stop.stderr)
    );
    let mut child = run.0.take().unwrap();
    assert!(child.wait().unwrap().success());
}
