//! Helpers for end-to-end tests: find the real binaries and run them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
