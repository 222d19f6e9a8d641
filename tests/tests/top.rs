//! `dflash-orch top` in a real terminal: a tmux server of the test's own runs it against a live
//! run on `cpu:3`; the test reads the screen with `capture-pane`, presses keys with `send-keys`,
//! and checks the run with `status --json`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use dflash_e2e::{alive, assert_clean, assert_refused, bin, finish, orch, status, wait_until};

const TMUX: &str = "/usr/bin/tmux";

/// A run in the background, slow enough to outlast the test (the whole plan takes about 45 s on
/// two cores; the test stops it long before). Stopped and reaped when dropped, whatever happened.
struct Run {
    orch: PathBuf,
    dir: PathBuf,
    child: Option<Child>,
}

impl Run {
    fn start(dir: &Path) -> Self {
        let orch = bin("dflash-orch");
        let child = Command::new(&orch)
            .args(["launch", "--gpus", "cpu:3", "--run-dir"])
            .arg(dir)
            .args(["--synthetic", "1000", "--token-budget", "16384"])
            .args(["--max-len", "4096", "--buckets", "auto:4", "--epochs", "2"])
            .args([
                "--synthetic-us-per-token",
                "20",
                "--heartbeat-timeout",
                "1.5",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start dflash-orch launch");
        Run {
            orch,
            dir: dir.to_owned(),
            child: Some(child),
        }
    }

    /// Stops the run and checks that `launch` ended well.
    fn stop(&mut self) {
        let out = orch(&["stop", "--run-dir", self.dir.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        finish(self.child.take().expect("the run is started once"));
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new(&self.orch)
            .args(["stop", "--run-dir"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A detached 200x50 tmux session on a server of its own (its socket in a temporary directory
/// of its own); the server is killed when dropped.
struct Screen {
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

const SESSION: &str = "top";

impl Screen {
    /// Runs `command` (a `sh -c` line) in a new session.
    fn start(command: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("dflash-top-tmux")
            .tempdir()
            .unwrap();
        let screen = Screen {
            socket: dir.path().join("socket"),
            _dir: dir,
        };
        let out = screen.tmux(&[
            "new-session",
            "-d",
            "-s",
            SESSION,
            "-x",
            "200",
            "-y",
            "50",
            command,
        ]);
        assert!(
            out.status.success(),
            "tmux new-session: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        screen
    }

    fn tmux(&self, args: &[&str]) -> Output {
        Command::new(TMUX)
            .arg("-S")
            .arg(&self.socket)
            .args(["-f", "/dev/null"])
            .args(args)
            .env_remove("TMUX")
            .stdin(Stdio::null())
            .output()
            .expect("run tmux")
    }

    /// What the pane shows now (empty once the session is gone).
    fn capture(&self) -> String {
        let out = self.tmux(&["capture-pane", "-p", "-t", SESSION]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", SESSION];
        args.extend_from_slice(keys);
        let out = self.tmux(&args);
        assert!(
            out.status.success(),
            "tmux send-keys {keys:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A pane variable, e.g. `#{alternate_on}`.
    fn show(&self, format: &str) -> String {
        let out = self.tmux(&["display-message", "-p", "-t", SESSION, format]);
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn alive(&self) -> bool {
        self.tmux(&["has-session", "-t", SESSION]).status.success()
    }

    /// Waits until the screen satisfies `ready`; returns that screen, or panics with the last one.
    fn wait_for(&self, what: &str, mut ready: impl FnMut(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let screen = self.capture();
            if ready(&screen) {
                return screen;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "timed out waiting for {what}; the screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
    }
}

fn quote(p: &Path) -> String {
    format!("'{}'", p.to_str().unwrap().replace('\'', r"'\''"))
}

/// The worker row of `device` on the screen, split into its columns.
fn row(screen: &str, device: &str) -> Option<Vec<String>> {
    let line = screen
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == device))?;
    Some(
        line.split(['│', ' '])
            .filter(|w| !w.is_empty())
            .map(str::to_owned)
            .collect(),
    )
}

/// `[id, role, device, pid, state, batches, restarts, ...]` of the row, without the selection mark.
fn columns(screen: &str, device: &str) -> Vec<String> {
    let mut r = row(screen, device).unwrap_or_else(|| panic!("no {device} row in\n{screen}"));
    if r.first().is_some_and(|c| c == ">") {
        r.remove(0);
    }
    r
}

fn restarts(run_dir: &Path, worker: u64) -> u64 {
    let s = status(run_dir);
    let w = s["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == worker)
        .unwrap_or_else(|| panic!("no worker {worker} in {s}"));
    w["restarts"].as_u64().unwrap()
}

fn wait_file(path: &Path) -> String {
    wait_until(
        &format!("{} to be written", path.display()),
        Duration::from_secs(30),
        || fs::read_to_string(path).is_ok_and(|t| t.ends_with('\n')),
    );
    fs::read_to_string(path).unwrap()
}

#[test]
fn top_shows_every_worker_and_restarts_the_selected_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let mut run = Run::start(dir.path());
    wait_until("the control socket", Duration::from_secs(60), || {
        dir.path().join("control.sock").exists()
    });

    // After top: its exit status and the terminal's settings, then a key to end the session.
    let exit = out.path().join("top.exit");
    let stty = out.path().join("top.stty");
    let screen = Screen::start(&format!(
        "{} top --run-dir {}; echo \"exit=$?\" > {}; stty -a > {}; read line",
        quote(&bin("dflash-orch")),
        quote(dir.path()),
        quote(&exit),
        quote(&stty),
    ));

    // Every worker up: a pid, and ready or busy.
    // A second view, whose terminal goes away under it.
    let closed = Screen::start(&format!(
        "exec {} top --run-dir {} --interval 0.2",
        quote(&bin("dflash-orch")),
        quote(dir.path()),
    ));

    let first = screen.wait_for("the three workers", |s| {
        s.contains("workers (3)")
            && ["cpu:0", "cpu:1", "cpu:2"].iter().all(|d| {
                row(s, d).is_some_and(|_| {
                    let c = columns(s, d);
                    c.len() > 5
                        && c[3].parse::<u32>().is_ok()
                        && ["ready", "busy"].contains(&&*c[4])
                })
            })
    });
    for (device, id, role) in [
        ("cpu:0", "0", "target"),
        ("cpu:1", "1", "target"),
        ("cpu:2", "2", "drafter"),
    ] {
        let c = columns(&first, device);
        assert_eq!((c[0].as_str(), c[1].as_str()), (id, role), "{first}");
        assert!(c[3].parse::<u32>().is_ok(), "a pid: {c:?}");
    }
    assert!(first.contains("dflash-orch top"), "{first}");
    assert!(first.contains("committed steps"), "{first}");
    assert!(first.contains("GPU telemetry unavailable: CPU worker"));
    assert_eq!(
        screen.show("#{alternate_on}"),
        "1",
        "top uses the alternate screen"
    );
    assert!(
        row(&first, "cpu:0").unwrap()[0] == ">",
        "worker 0 selected first"
    );

    screen.keys(&["Down"]);
    screen.wait_for("worker 1 to be selected", |s| {
        row(s, "cpu:1").is_some_and(|r| r[0] == ">")
    });
    let before = restarts(dir.path(), 1);
    screen.keys(&["R"]);
    wait_until("worker 1 to restart", Duration::from_secs(30), || {
        restarts(dir.path(), 1) > before
    });
    assert_eq!(restarts(dir.path(), 1), before + 1);
    assert_eq!(restarts(dir.path(), 0), 0, "only the selected worker");
    let answered = screen.wait_for("the answer and the new count", |s| {
        s.contains("restart worker 1 at once: ok")
            && columns(s, "cpu:1")[6] == (before + 1).to_string()
    });
    assert!(answered.contains("run throughput"), "{answered}");

    // Its terminal gone (the tmux server killed), top ends instead of reading a dead terminal.
    closed.wait_for("the second view", |s| s.contains("workers (3)"));
    let pid: u64 = closed.show("#{pane_pid}").parse().unwrap();
    assert!(alive(pid));
    drop(closed);
    wait_until(
        "top to exit once its terminal is gone",
        Duration::from_secs(10),
        || !alive(pid),
    );

    // The run ends: the last screen stays, saying so.
    run.stop();
    let ended = screen.wait_for("run not running", |s| s.contains("run not running"));
    assert!(
        ended.contains("cpu:0") && ended.contains("cpu:2"),
        "{ended}"
    );
    assert!(screen.alive(), "top waits for q");

    screen.keys(&["q"]);
    assert_eq!(wait_file(&exit), "exit=0\n");
    // The terminal as it was: line editing and echo back, the normal screen, the cursor shown.
    let settings = wait_file(&stty);
    let flags: Vec<&str> = settings.split_whitespace().collect();
    for flag in ["icanon", "echo", "isig"] {
        assert!(flags.contains(&flag), "{flag} not restored:\n{settings}");
    }
    assert_eq!(screen.show("#{alternate_on}"), "0");
    assert_eq!(screen.show("#{cursor_flag}"), "1");
    let after = screen.capture();
    assert!(!after.contains("workers (3)"), "{after}");
    screen.keys(&["Enter"]);
    wait_until("the tmux session to end", Duration::from_secs(10), || {
        !screen.alive()
    });
    drop(screen);
    assert_clean(dir.path());
}

#[test]
fn top_refuses_without_a_terminal_or_a_live_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().to_str().unwrap();
    // Stdout is a pipe here.
    assert_refused(&orch(&["top", "--run-dir", run_dir]), 2, "status --watch");
    for bad in ["0", "-1", "NaN", "1e30"] {
        assert_refused(
            &orch(&["top", "--run-dir", run_dir, &format!("--interval={bad}")]),
            2,
            "--interval",
        );
    }

    // In a terminal, but no run: the same error as `status`, and the terminal untouched.
    let out = tempfile::tempdir().unwrap();
    let (exit, err) = (out.path().join("exit"), out.path().join("stderr"));
    let screen = Screen::start(&format!(
        "{} top --run-dir {} 2> {}; echo \"exit=$?\" > {}",
        quote(&bin("dflash-orch")),
        quote(dir.path()),
        quote(&err),
        quote(&exit),
    ));
    assert_eq!(wait_file(&exit), "exit=1\n");
    wait_until("the tmux session to end", Duration::from_secs(10), || {
        !screen.alive()
    });
    let status_err = orch(&["status", "--run-dir", run_dir]);
    assert_eq!(status_err.status.code(), Some(1));
    assert_eq!(
        fs::read_to_string(&err).unwrap(),
        String::from_utf8_lossy(&status_err.stderr)
    );
    assert!(
        String::from_utf8_lossy(&status_err.stderr).contains("no live run"),
        "{status_err:?}"
    );
}
