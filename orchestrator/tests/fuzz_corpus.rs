//! Replays the saved fuzz inputs (`fuzz/regressions/<target>/*`: every crash found, and a small
//! spread of the corpus) through the same harnesses the fuzz targets run: each parser must answer
//! (a value or an error), never panic.

#[path = "../../fuzz/src/lib.rs"]
mod harness;

use std::path::PathBuf;

/// Runs every saved input of `target`; fails naming each input that panicked.
fn replay(target: &str) {
    let (_, run) = harness::TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .unwrap_or_else(|| panic!("no harness {target}"));
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("read the regressions folder").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no saved inputs", dir.display());
    let mut panicked = Vec::new();
    for file in &files {
        let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            panicked.push(file.display().to_string());
        }
    }
    let _ = std::fs::remove_dir_all(harness::scratch().join(target));
    let _ = std::fs::remove_dir(harness::scratch());
    assert!(
        panicked.is_empty(),
        "{target}: {} of {} saved inputs panicked: {panicked:#?}",
        panicked.len(),
        files.len()
    );
}

#[test]
fn every_target_has_a_test() {
    let tested = [
        "lengths", "jsonl", "chat", "store", "ring", "journal", "control", "options", "model",
        "decoding",
    ];
    let targets: Vec<&str> = harness::TARGETS.iter().map(|(name, _)| *name).collect();
    assert_eq!(targets, tested);
    assert!(!harness::SEP.is_empty());
}

#[test]
fn lengths() {
    replay("lengths");
}

#[test]
fn jsonl() {
    replay("jsonl");
}

#[test]
fn chat() {
    replay("chat");
}

#[test]
fn store() {
    replay("store");
}

#[test]
fn ring() {
    replay("ring");
}

#[test]
fn journal() {
    replay("journal");
}

#[test]
fn control() {
    replay("control");
}

#[test]
fn options() {
    replay("options");
}

#[test]
fn model() {
    replay("model");
}

#[test]
fn decoding() {
    replay("decoding");
}
