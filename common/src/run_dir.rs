//! Names of the files in a run directory, and of the run's shared-memory segments.

use std::path::{Path, PathBuf};

/// Append-only, fsync'd JSON lines: the record a resume reads.
pub const JOURNAL: &str = "journal.jsonl";
/// The orchestrator's control socket (mode 0600).
pub const CONTROL_SOCKET: &str = "control.sock";
/// Held (flock) by the live orchestrator of the run.
pub const LOCK: &str = "run.lock";

pub fn journal(run_dir: &Path) -> PathBuf {
    run_dir.join(JOURNAL)
}

pub fn control_socket(run_dir: &Path) -> PathBuf {
    run_dir.join(CONTROL_SOCKET)
}

pub fn lock(run_dir: &Path) -> PathBuf {
    run_dir.join(LOCK)
}

/// Where shared-memory segments live.
pub const SHM_DIR: &str = "/dev/shm";

/// The id of a run directory: stable across launches of the same directory, so a new launch finds
/// and removes what an earlier one left in shared memory. FNV-1a of the canonical path.
pub fn run_id(run_dir: &Path) -> String {
    let canonical = run_dir
        .canonicalize()
        .unwrap_or_else(|_| run_dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in canonical.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The run directory's record of the shared-memory segments its live (or last) launch created,
/// one path per line: what `clean` and a resume remove, and nothing else.
pub const SEGMENTS: &str = "segments";

pub fn segments_record(run_dir: &Path) -> PathBuf {
    run_dir.join(SEGMENTS)
}

/// Path of one of the run's segments (`input`, `feature`). `nonce` is drawn anew by every launch,
/// so nobody can block a run by creating its segment names first.
pub fn segment(run_id: &str, nonce: u64, ring: &str) -> PathBuf {
    Path::new(SHM_DIR).join(format!("{}{nonce:016x}-{ring}", segment_prefix(run_id)))
}

/// Prefix shared by every segment of the run.
pub fn segment_prefix(run_id: &str) -> String {
    format!("dflash-{run_id}-")
}

/// Steps of the finished checkpoints under `root` (directories `step-N`), ascending.
pub fn checkpoint_steps(root: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort_unstable();
    steps
}
