//! The run journal: append-only, fsync'd JSON lines, everything a resume needs.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One journal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Entry {
    /// First line: the run's parameters (what a resume re-plans from).
    Run {
        version: u32,
        config: Value,
        /// The session's topology and how it was decided (`topology::Choice`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        topology: Option<Value>,
    },
    /// An orchestrator (re)started the run.
    Resume {
        committed: u64,
        /// Options this session changed (those that may change on resume), with their values.
        #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
        changes: serde_json::Map<String, Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        topology: Option<Value>,
    },
    Epoch {
        epoch: u32,
        batches: u64,
    },
    Commit {
        epoch: u32,
        step: u64,
        batch: u64,
        samples: u32,
        checksum: u32,
    },
    /// The drafter resumed from a checkpoint at an earlier plan position: the commits after it are
    /// void and are made again by the replay.
    Rewind {
        to_step: u64,
        epoch: u32,
        batch: u64,
        reason: String,
    },
    /// The drafter's checkpoint held batches the journal had not committed (the orchestrator died
    /// after the checkpoint): they were committed from the plan, not trained again.
    CommittedFromCheckpoint {
        from_step: u64,
        to_step: u64,
    },
    /// An optimiser step skipped for a NaN or infinity (`--on-nonfinite skip`).
    SkippedStep {
        step: u64,
        epoch: u32,
        batch: u64,
        reason: String,
    },
    WorkerStart {
        worker: u32,
        role: String,
        pid: u32,
    },
    WorkerExit {
        worker: u32,
        pid: u32,
        reason: String,
    },
    /// Data-parallel drafters: drafter `rank` (worker `worker`) left the process group, so every
    /// drafter is restarted from the last committed checkpoint and the batches after it replayed.
    DrafterGroupRestart {
        worker: u32,
        rank: u32,
        reason: String,
    },
    End {
        status: String,
        reason: Option<String>,
    },
}

pub const VERSION: u32 = 1;

/// Appends entries, each flushed to disk before `append` returns. A failed append (a full disk)
/// cuts the file back to its last whole line and refuses every later append, so no entry can be
/// glued onto a partial line: the run stops with the reason.
pub struct JournalWriter {
    path: PathBuf,
    file: File,
    /// Bytes of whole lines written.
    len: u64,
    failed: Option<String>,
}

impl JournalWriter {
    /// Opens (or creates, fsyncing its directory) the journal for appending.
    pub fn open(path: &Path) -> io::Result<Self> {
        let created = !path.exists();
        let file = crate::fsutil::open_own(path, OpenOptions::new().create(true).append(true))?;
        if created {
            file.sync_all()?;
            if let Some(dir) = path.parent() {
                File::open(if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                })?
                .sync_all()?;
            }
        }
        let len = file.metadata()?.len();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            len,
            failed: None,
        })
    }

    pub fn append(&mut self, entry: &Entry) -> io::Result<()> {
        if let Some(why) = &self.failed {
            return Err(io::Error::other(format!(
                "an earlier append failed ({why}); nothing more is written"
            )));
        }
        let mut line = serde_json::to_vec(entry).map_err(io::Error::other)?;
        line.push(b'\n');
        let written = self
            .file
            .write_all(&line)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += line.len() as u64;
                Ok(())
            }
            Err(e) => {
                // Cut a partial line off, so a resume reads whole lines only.
                let _ = self.file.set_len(self.len);
                let _ = self.file.sync_all();
                self.failed = Some(e.to_string());
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Truncates the journal after its last complete line.
pub fn drop_torn_tail(path: &Path) -> io::Result<()> {
    let file = crate::fsutil::open_own(path, OpenOptions::new().read(true).write(true))?;
    crate::fsutil::cut_torn_tail(&file).map(|_| ())
}

/// A journal that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}:{line}: corrupt journal line: {reason}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

/// What a journal says, read back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    pub config: Option<Value>,
    /// Commits of each epoch, in order (`batch` numbers, contiguous from 0).
    pub committed: Vec<u64>,
    /// Batches of each epoch that was started.
    pub epoch_batches: Vec<u64>,
    pub ended: Option<String>,
    /// The drafters of the last session that recorded its topology (a journal written before
    /// topologies were recorded has none).
    pub drafters: Option<u32>,
    /// A last line cut short by a crash was dropped.
    pub torn_tail: bool,
}

impl History {
    pub fn total_committed(&self) -> u64 {
        self.committed.iter().sum()
    }
}

/// The drafters of a recorded topology; an error names what is wrong with it.
fn drafters_of(topology: Option<&Value>) -> Result<Option<u32>, String> {
    let Some(t) = topology else { return Ok(None) };
    t.get("drafters")
        .and_then(Value::as_u64)
        .and_then(|d| u32::try_from(d).ok())
        .filter(|&d| d >= 1)
        .map(Some)
        .ok_or_else(|| format!("topology {t} has no drafter count of 1 or more"))
}

/// Reads a journal. A last line without its newline (a write cut short by a crash) is ignored;
/// any other line that is not a journal entry, or commits out of plan order, are an error naming
/// the line.
pub fn read(path: &Path) -> Result<History, JournalError> {
    let bytes = std::fs::read(path).map_err(|source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut history = History::default();
    let text_lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    let last = text_lines.len() - 1;
    for (i, raw) in text_lines.iter().enumerate() {
        let line = i + 1;
        let corrupt = |reason: String| JournalError::Corrupt {
            path: path.to_path_buf(),
            line,
            reason,
        };
        if raw.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let entry: Entry = match serde_json::from_slice(raw) {
            Ok(e) => e,
            Err(_) if i == last => {
                history.torn_tail = true;
                break;
            }
            Err(e) => return Err(corrupt(e.to_string())),
        };
        match entry {
            Entry::Run {
                version,
                config,
                topology,
            } => {
                history.drafters = drafters_of(topology.as_ref()).map_err(corrupt)?;
                if version != VERSION {
                    return Err(corrupt(format!(
                        "journal version {version}, this build writes {VERSION}"
                    )));
                }
                if history.config.is_some() {
                    return Err(corrupt("a second run line".into()));
                }
                history.config = Some(config);
            }
            Entry::Epoch { epoch, batches } => {
                if epoch as usize != history.epoch_batches.len()
                    && epoch as usize + 1 != history.epoch_batches.len()
                {
                    return Err(corrupt(format!("epoch {epoch} out of order")));
                }
                if epoch as usize == history.epoch_batches.len() {
                    history.epoch_batches.push(batches);
                    history.committed.push(0);
                }
            }
            Entry::Commit { epoch, batch, .. } => {
                let e = epoch as usize;
                if e + 1 != history.committed.len() {
                    return Err(corrupt(format!(
                        "commit for epoch {epoch}, not the current epoch"
                    )));
                }
                if batch != history.committed[e] {
                    return Err(corrupt(format!(
                        "commit of batch {batch}, expected batch {} (commits are in plan order)",
                        history.committed[e]
                    )));
                }
                history.committed[e] += 1;
            }
            Entry::Rewind { epoch, batch, .. } => {
                let e = epoch as usize;
                if e >= history.committed.len() || batch > history.committed[e] {
                    return Err(corrupt(format!(
                        "rewind to batch {batch} of epoch {epoch}, which was not committed"
                    )));
                }
                history.committed.truncate(e + 1);
                history.epoch_batches.truncate(e + 1);
                history.committed[e] = batch;
            }
            Entry::End { status, .. } => history.ended = Some(status),
            Entry::Resume { topology, .. } => {
                history.ended = None;
                if let Some(d) = drafters_of(topology.as_ref()).map_err(corrupt)? {
                    history.drafters = Some(d);
                }
            }
            Entry::SkippedStep { .. }
            | Entry::WorkerStart { .. }
            | Entry::WorkerExit { .. }
            | Entry::DrafterGroupRestart { .. }
            | Entry::CommittedFromCheckpoint { .. } => {}
        }
        if history.config.is_none() {
            return Err(corrupt("the journal does not start with a run line".into()));
        }
    }
    Ok(history)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(lines: &str) -> (tempfile_dir::Dir, PathBuf) {
        let dir = tempfile_dir::Dir::new();
        let path = dir.0.join("journal.jsonl");
        std::fs::write(&path, lines).unwrap();
        (dir, path)
    }

    mod tempfile_dir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "dflash-journal-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    const RUN: &str = r#"{"event":"run","version":1,"config":{}}"#;

    #[test]
    fn a_failed_append_refuses_every_later_one() {
        // /dev/full: every write fails with ENOSPC, as on a full disk. (Not a regular file, so
        // `open` refuses it: the writer is made around it directly.)
        let e = JournalWriter::open(Path::new("/dev/full")).err().unwrap();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let mut journal = JournalWriter {
            path: PathBuf::from("/dev/full"),
            file: OpenOptions::new().append(true).open("/dev/full").unwrap(),
            len: 0,
            failed: None,
        };
        let entry = Entry::Resume {
            committed: 3,
            changes: Default::default(),
            topology: None,
        };
        let first = journal.append(&entry).unwrap_err();
        assert_eq!(first.raw_os_error(), Some(nix::libc::ENOSPC));
        let second = journal.append(&entry).unwrap_err();
        assert!(
            second.to_string().contains("an earlier append failed"),
            "{second}"
        );
    }

    #[test]
    fn reads_commits_per_epoch() {
        let text = format!(
            "{RUN}\n{}\n{}\n{}\n{}\n",
            r#"{"event":"epoch","epoch":0,"batches":2}"#,
            r#"{"event":"commit","epoch":0,"step":0,"batch":0,"samples":3,"checksum":1}"#,
            r#"{"event":"commit","epoch":0,"step":1,"batch":1,"samples":3,"checksum":1}"#,
            r#"{"event":"epoch","epoch":1,"batches":2}"#,
        );
        let (_d, p) = write(&text);
        let h = read(&p).unwrap();
        assert_eq!(h.committed, vec![2, 0]);
        assert_eq!(h.total_committed(), 2);
    }

    #[test]
    fn a_rewind_voids_later_commits_even_across_epochs() {
        let commit = |e: u32, b: u64| {
            format!(
                r#"{{"event":"commit","epoch":{e},"step":0,"batch":{b},"samples":1,"checksum":1}}"#
            )
        };
        let epoch = |e: u32| format!(r#"{{"event":"epoch","epoch":{e},"batches":2}}"#);
        let rewind = |e: u32, b: u64| {
            format!(r#"{{"event":"rewind","to_step":0,"epoch":{e},"batch":{b},"reason":"r"}}"#)
        };
        let lines = [
            RUN.to_owned(),
            epoch(0),
            commit(0, 0),
            commit(0, 1),
            epoch(1),
            commit(1, 0),
            rewind(0, 1),
            commit(0, 1),
            epoch(1),
            commit(1, 0),
        ];
        let (_d, p) = write(&(lines.join("\n") + "\n"));
        let h = read(&p).unwrap();
        assert_eq!(h.committed, vec![2, 1]);
        assert_eq!(h.epoch_batches, vec![2, 2]);
        // A rewind past what was committed is refused.
        let (_d, p) = write(&format!("{RUN}\n{}\n{}\n", epoch(0), rewind(0, 1)));
        assert!(
            read(&p)
                .unwrap_err()
                .to_string()
                .contains("was not committed")
        );
        let (_d, p) = write(&format!("{RUN}\n{}\n{}\n", epoch(0), rewind(3, 0)));
        assert!(read(&p).is_err());
    }

    #[test]
    fn torn_last_line_is_dropped_and_corrupt_lines_are_named() {
        let (_d, p) = write(&format!("{RUN}\n{{\"event\":\"epo"));
        assert!(read(&p).unwrap().torn_tail);
        drop_torn_tail(&p).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), format!("{RUN}\n"));
        assert!(!read(&p).unwrap().torn_tail);
        let (_d, p) = write(&format!("{RUN}\nnot json\n{RUN}\n"));
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains(":2: corrupt journal line"), "{e}");
        let text = format!(
            "{RUN}\n{}\n{}\n",
            r#"{"event":"epoch","epoch":0,"batches":2}"#,
            r#"{"event":"commit","epoch":0,"step":1,"batch":1,"samples":3,"checksum":1}"#
        );
        let (_d, p) = write(&text);
        assert!(
            read(&p)
                .unwrap_err()
                .to_string()
                .contains(":3: corrupt journal line: commit of batch 1, expected batch 0")
        );
        let (_d, p) = write(r#"{"event":"epoch","epoch":0,"batches":2}"#);
        assert!(read(&p).is_err() || read(&p).unwrap().torn_tail);
    }
}
