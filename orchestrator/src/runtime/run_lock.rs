//! The run directory as a launch finds and leaves it: its lock (one live orchestrator), the
//! checks that it can be trusted and holds no live or earlier run, the record of shared-memory
//! segments, and the guard that undoes what a failed launch created.

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use dflash_common::run_dir;

use super::RunError;
use super::journal::{self};

/// The run directory's lock, held while the orchestrator lives.
pub struct RunLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

/// Takes the run directory's lock: one live orchestrator per run directory. The lock file is
/// opened without following a symlink.
pub fn lock_run_dir(dir: &Path) -> Result<RunLock, RunError> {
    use std::io::{Read, Seek, Write};
    let path = run_dir::lock(dir);
    let mut file = crate::fsutil::open_own(
        &path,
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600),
    )
    .map_err(|e| RunError::Invalid(format!("{}: {e}", path.display())))?;
    let mut holder = String::new();
    let _ = file.read_to_string(&mut holder);
    let mut lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|_| live_run(dir, &holder))?;
    let _ = lock.set_len(0);
    let _ = lock.rewind();
    let _ = write!(lock, "{}", std::process::id());
    Ok(RunLock { _lock: lock })
}

/// Removes the segments the run directory's record names (only those, and only under
/// `/dev/shm` with this run's prefix), then the record; returns the paths removed.
pub fn remove_recorded_segments(dir: &Path) -> Vec<PathBuf> {
    let record = run_dir::segments_record(dir);
    let prefix = run_dir::segment_prefix(&run_dir::run_id(dir));
    let mut removed = Vec::new();
    let Ok(text) = std::fs::read_to_string(&record) else {
        return removed;
    };
    for line in text.lines() {
        let path = Path::new(line.trim());
        let ours = path.parent() == Some(Path::new(run_dir::SHM_DIR))
            && path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&prefix));
        if ours && std::fs::remove_file(path).is_ok() {
            removed.push(path.to_path_buf());
        }
    }
    let _ = std::fs::remove_file(&record);
    removed
}

/// Bytes free in `/dev/shm`.
pub(super) fn shm_free() -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(run_dir::SHM_DIR).ok()?;
    Some(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// Refuses a run directory that another user could tamper with: not owned by us, or writable by
/// group or others. `Ok(false)` when it does not exist yet.
pub fn check_run_dir_trust(dir: &Path) -> Result<bool, RunError> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(RunError::Invalid(format!("{}: {e}", dir.display()))),
    };
    if !meta.is_dir() {
        return Err(RunError::Invalid(format!(
            "--run-dir {} is not a directory",
            dir.display()
        )));
    }
    let me = nix::unistd::getuid().as_raw();
    if meta.uid() != me {
        return Err(RunError::Invalid(format!(
            "--run-dir {} is owned by uid {}, not by you (uid {me}): another user could change what the run reads; use a directory of your own",
            dir.display(),
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o022 != 0 {
        return Err(RunError::Invalid(format!(
            "--run-dir {} is writable by group or others (mode {mode:o}): another user could plant files in it; `chmod go-w {}` first",
            dir.display(),
            dir.display()
        )));
    }
    Ok(true)
}

/// Refuses a run directory whose files that a launch writes (`run.lock`, the journal, the
/// metrics, the workers' logs) are not regular files of one link: a hard link planted there
/// would have the run overwrite another file. Checked before anything is written; the files
/// are opened the same way ([`crate::fsutil::open_own`]) when written.
pub fn check_own_files(dir: &Path) -> Result<(), RunError> {
    let mut paths = vec![
        run_dir::lock(dir),
        run_dir::journal(dir),
        dir.join(super::metrics::FILE),
    ];
    if let Ok(logs) = std::fs::read_dir(super::workers::log_dir(dir)) {
        paths.extend(logs.flatten().map(|e| e.path()));
    }
    for path in paths {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let why = if meta.file_type().is_symlink() {
            "is a symbolic link".to_owned()
        } else if !meta.is_file() {
            "is not a regular file".to_owned()
        } else if meta.nlink() != 1 {
            format!(
                "has {} hard links: writing to it would change another file too",
                meta.nlink()
            )
        } else {
            continue;
        };
        return Err(RunError::Invalid(format!(
            "{} {why}; a run writes only files of its own (remove it first)",
            path.display()
        )));
    }
    Ok(())
}

/// Refuses a run directory whose run is live (its orchestrator holds the lock), creating nothing.
pub fn check_not_live(dir: &Path) -> Result<(), RunError> {
    let path = run_dir::lock(dir);
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
    else {
        return Ok(());
    };
    let holder = std::fs::read_to_string(&path).unwrap_or_default();
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockSharedNonblock) {
        Ok(_released_on_drop) => Ok(()),
        Err(_) => Err(live_run(dir, &holder)),
    }
}

/// The run directory's lock is held by `holder` (its pid, as the lock file says).
pub(super) fn live_run(dir: &Path, holder: &str) -> RunError {
    RunError::Invalid(format!(
        "run dir {} holds a live run (orchestrator pid {}); stop it first or use another --run-dir",
        dir.display(),
        holder.trim()
    ))
}

/// A journal without its run line: a launch that died before its run started (not a run).
pub(super) fn stillborn_journal(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() == 0)
        || journal::read(path).is_ok_and(|h| h.config.is_none())
}

/// What in `dir` belongs to an earlier run (a fresh launch refuses it).
pub(super) fn earlier_run(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let journal = run_dir::journal(dir);
    if journal.exists() && !stillborn_journal(&journal) {
        found.push(format!("a journal ({})", run_dir::JOURNAL));
    }
    let checkpoints = dir.join("checkpoints");
    if std::fs::read_dir(&checkpoints).is_ok_and(|mut d| d.next().is_some()) {
        found.push("checkpoints (checkpoints/)".into());
    }
    if run_dir::segments_record(dir).exists() {
        found.push(format!("shared-memory rings ({})", run_dir::SEGMENTS));
    }
    if dir.join(super::metrics::FILE).exists() {
        found.push(format!("metrics ({})", super::metrics::FILE));
    }
    found
}

/// Undoes what a launch created unless `commit`ted: entries of the run directory that were not
/// there before (or the directory itself), and shared-memory segments.
pub(super) struct Guard {
    dir: PathBuf,
    dir_created: bool,
    /// The parents of the run directory this launch created, deepest first.
    parents_created: Vec<PathBuf>,
    before: BTreeSet<std::ffi::OsString>,
    segments: Vec<PathBuf>,
    armed: bool,
}

impl Guard {
    /// Creates the run directory if needed (owner-only) and remembers what it held.
    pub(super) fn new(dir: &Path, existed: bool) -> Result<Self, RunError> {
        // The missing ancestors, so that a failed launch removes every directory it made.
        let parents_created: Vec<PathBuf> = if existed {
            Vec::new()
        } else {
            dir.ancestors()
                .skip(1)
                .take_while(|p| !p.as_os_str().is_empty() && std::fs::symlink_metadata(p).is_err())
                .map(Path::to_path_buf)
                .collect()
        };
        if !existed {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| RunError::Invalid(format!("--run-dir {}: {e}", dir.display())))?;
        }
        let before = std::fs::read_dir(dir)
            .map_err(|e| RunError::Invalid(format!("--run-dir {}: {e}", dir.display())))?
            .flatten()
            .map(|e| e.file_name())
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            dir_created: !existed,
            parents_created,
            before,
            segments: Vec::new(),
            armed: true,
        })
    }

    pub(super) fn segment(&mut self, path: &Path) {
        self.segments.push(path.to_path_buf());
    }

    /// The launch went through: keep everything.
    pub(super) fn commit(mut self) {
        self.armed = false;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for segment in &self.segments {
            let _ = std::fs::remove_file(segment);
        }
        if self.dir_created {
            let _ = std::fs::remove_dir_all(&self.dir);
            // Only directories still empty: never what someone else put there meanwhile.
            for parent in &self.parents_created {
                if std::fs::remove_dir(parent).is_err() {
                    break;
                }
            }
            return;
        }
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            if self.before.contains(&entry.file_name()) {
                continue;
            }
            let path = entry.path();
            let _ = match entry.file_type() {
                Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
                _ => std::fs::remove_file(&path),
            };
        }
    }
}
