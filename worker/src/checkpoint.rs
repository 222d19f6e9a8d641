//! Drafter checkpoints: `RUN_DIR/checkpoints/step-N/` with `model.safetensors` and `config.json` in
//! the Hugging Face DFlash draft layout (serving stacks load them unchanged), `optimizer.safetensors`
//! (AdamW moments) and `state.json` (step, epoch, plan cursor, and the run fingerprint that ties the
//! checkpoint to the run that wrote it). Each one is built in a temporary directory
//! (`.step-N.tmp-PID`) and renamed into place, then `latest` is replaced (through
//! `.latest.tmp-PID`), then all but the newest `keep` are removed.
//!
//! [`Writer`] writes them on a thread of its own from a snapshot, so training does not wait for
//! the disk, with one snapshot queued at most: a training thread that gets ahead of the disk
//! blocks in [`Writer::submit`] rather than piling snapshots (three copies of the model each) up
//! in memory. A panic of that thread is reported to the stage, never swallowed. Starting a writer
//! removes the temporary files of writers that were killed.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::drafter::{Drafter, DrafterConfig};
use crate::model::qwen3::Qwen3Config;
use crate::train::AdamW;

/// Where training stands.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Optimiser steps taken.
    pub step: u64,
    pub epoch: u32,
    /// Batches of the run consumed (the plan position to resume from).
    pub plan_cursor: u64,
    /// AdamW's step counter.
    pub adam_t: u64,
    /// The fingerprint of the run that wrote the checkpoint (`DflashSettings::fingerprint`);
    /// empty in checkpoints written before runs had one.
    #[serde(default)]
    pub fingerprint: BTreeMap<String, String>,
}

/// A named f32 tensor: name, shape, values.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);
/// A weight's AdamW moments: name, shape, first moment, second moment.
pub type NamedMoments = (String, Vec<usize>, Vec<f32>, Vec<f32>);

/// A copy of everything a checkpoint holds, taken on the training thread.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub state: TrainingState,
    /// `(name, shape, values)` of every drafter weight.
    pub weights: Vec<NamedTensor>,
    /// First and second moments, by weight name.
    pub moments: Vec<NamedMoments>,
    /// `config.json`.
    pub config: Value,
    /// Where an engine already wrote `model.safetensors` and `optimizer.safetensors` itself (the
    /// torch engine's child, into the checkpoint's staging directory [`staging_dir`]):
    /// `weights` and `moments` are then empty, and [`save`] adds the rest and publishes that
    /// directory, so that the tensors cross the disk once.
    pub written: Option<PathBuf>,
}

/// The directory a checkpoint of `step` is built in under `root` before it is renamed into
/// place, by this process (`.step-N.tmp-PID`; what [`remove_stale`] removes after a crash).
pub fn staging_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".step-{step}.tmp-{}", std::process::id()))
}

fn write_safetensors(path: &Path, tensors: &[(String, &[usize], &[f32])]) -> io::Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), b)
                .map(|v| (name.clone(), v))
                .map_err(io::Error::other)
        })
        .collect::<io::Result<Vec<_>>>()?;
    let metadata: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(io::Error::other)
}

fn read_safetensors(path: &Path) -> io::Result<Vec<NamedTensor>> {
    let bytes = fs::read(path)?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes).map_err(io::Error::other)?;
    let bad = |what: String| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {what}", path.display()),
        )
    };
    let mut out: Vec<NamedTensor> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            // Training state is written in f32 only: another dtype is a file changed by hand
            // (or relabelled), whose bytes would be read as wrong numbers.
            if view.dtype() != safetensors::Dtype::F32 {
                return Err(bad(format!(
                    "tensor {name} is {:?}, a checkpoint holds F32 only",
                    view.dtype()
                )));
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(bad(format!(
                    "tensor {name} holds a non-finite value ({} at element {i})",
                    values[i]
                )));
            }
            Ok((name, view.shape().to_vec(), values))
        })
        .collect::<io::Result<_>>()?;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Checks, from their headers alone, that `dir` holds a checkpoint's two tensor files with
/// exactly the weights `expected` (name, shape) and both moments of each, all f32, and that each
/// file is as long as its header says: what an engine wrote itself, before it is published
/// (the values' finiteness is the engine's to check as it writes them).
pub fn check_tensor_files(dir: &Path, expected: &[(String, Vec<usize>)]) -> io::Result<()> {
    let weights: BTreeMap<String, Vec<usize>> = expected.iter().cloned().collect();
    let moments: BTreeMap<String, Vec<usize>> = expected
        .iter()
        .flat_map(|(n, s)| [(format!("m.{n}"), s.clone()), (format!("v.{n}"), s.clone())])
        .collect();
    check_header(&dir.join("model.safetensors"), &weights)?;
    check_header(&dir.join("optimizer.safetensors"), &moments)
}

fn check_header(path: &Path, expected: &BTreeMap<String, Vec<usize>>) -> io::Result<()> {
    use std::io::Read;

    let bad = |what: String| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: {what}", path.display()),
        )
    };
    let mut file = fs::File::open(path)?;
    let size = file.metadata()?.len();
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix)
        .map_err(|_| bad("shorter than a safetensors header".into()))?;
    let n = u64::from_le_bytes(prefix);
    if n > 100 << 20 || 8 + n > size {
        return Err(bad(format!("a header of {n} bytes in a file of {size}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)?;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("its header is not JSON: {e}")))?;
    let mut end = 0u64;
    let mut seen = 0usize;
    for (name, entry) in &header {
        if name == "__metadata__" {
            continue;
        }
        let Some(shape) = expected.get(name) else {
            return Err(bad(format!(
                "holds {name}, which the drafter does not have"
            )));
        };
        seen += 1;
        if entry["dtype"] != "F32" {
            return Err(bad(format!("tensor {name} is {}, not F32", entry["dtype"])));
        }
        let got: Option<Vec<usize>> = entry["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
        if got.as_ref() != Some(shape) {
            return Err(bad(format!(
                "tensor {name} has shape {}, not {shape:?}",
                entry["shape"]
            )));
        }
        let offsets: Option<Vec<u64>> = entry["data_offsets"]
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect());
        let Some([from, to]) = offsets
            .as_deref()
            .and_then(|o| <[u64; 2]>::try_from(o).ok())
        else {
            return Err(bad(format!("tensor {name} has no data offsets")));
        };
        let elements: u64 = shape.iter().map(|&d| d as u64).product();
        if to < from || to - from != elements * 4 {
            return Err(bad(format!(
                "tensor {name}'s data is {} bytes, its shape needs {}",
                to.saturating_sub(from),
                elements * 4
            )));
        }
        end = end.max(to);
    }
    if seen != expected.len() {
        let missing = expected.keys().find(|k| !header.contains_key(*k));
        return Err(bad(format!(
            "lacks {}",
            missing.map_or("a tensor", String::as_str)
        )));
    }
    if 8 + n + end != size {
        return Err(bad(format!(
            "is {size} bytes, its header accounts for {}",
            8 + n + end
        )));
    }
    Ok(())
}

fn sync_dir(path: &Path) {
    let _ = fs::File::open(path).and_then(|d| d.sync_all());
}

/// Writes `model.safetensors` (the weights) and `optimizer.safetensors` (their moments, `m.NAME`
/// and `v.NAME`) into `dir`: a checkpoint's tensors, and what the torch engine's child and this
/// process hand each other.
pub fn write_tensors(
    dir: &Path,
    weights: &[NamedTensor],
    moments: &[NamedMoments],
) -> io::Result<()> {
    let weights: Vec<(String, &[usize], &[f32])> = weights
        .iter()
        .map(|(n, s, v)| (n.clone(), s.as_slice(), v.as_slice()))
        .collect();
    write_safetensors(&dir.join("model.safetensors"), &weights)?;
    let moments: Vec<(String, &[usize], &[f32])> = moments
        .iter()
        .flat_map(|(n, s, m, v)| {
            [
                (format!("m.{n}"), s.as_slice(), m.as_slice()),
                (format!("v.{n}"), s.as_slice(), v.as_slice()),
            ]
        })
        .collect();
    write_safetensors(&dir.join("optimizer.safetensors"), &moments)
}

/// Reads what [`write_tensors`] wrote into `dir`: every weight (sorted by name) and the moments
/// of each.
pub fn read_tensors(dir: &Path) -> io::Result<(Vec<NamedTensor>, Vec<NamedMoments>)> {
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let weights = read_safetensors(&dir.join("model.safetensors"))?;
    let opt = read_safetensors(&dir.join("optimizer.safetensors"))?;
    let find = |key: String| {
        opt.iter()
            .find(|(n, _, _)| *n == key)
            .map(|(_, _, v)| v.clone())
    };
    let moments = weights
        .iter()
        .map(|(n, s, _)| {
            let m = find(format!("m.{n}")).ok_or_else(|| bad(format!("no moment m.{n}")))?;
            let v = find(format!("v.{n}")).ok_or_else(|| bad(format!("no moment v.{n}")))?;
            Ok((n.clone(), s.clone(), m, v))
        })
        .collect::<io::Result<_>>()?;
    Ok((weights, moments))
}

/// Writes one checkpoint under `root` and rotates; returns its directory.
pub fn save(root: &Path, snapshot: &Snapshot, keep: usize) -> io::Result<PathBuf> {
    fs::create_dir_all(root)?;
    let name = format!("step-{}", snapshot.state.step);
    let done = root.join(&name);
    let temp = staging_dir(root, snapshot.state.step);
    match &snapshot.written {
        // The engine's files are the checkpoint's: they are published where they lie.
        Some(dir) if *dir == temp => {}
        Some(dir) => {
            let _ = fs::remove_dir_all(dir);
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: a checkpoint of step {} is built in {}",
                    dir.display(),
                    snapshot.state.step,
                    temp.display()
                ),
            ));
        }
        None => {
            let _ = fs::remove_dir_all(&temp);
            fs::create_dir(&temp)?;
        }
    }
    let result = (|| -> io::Result<()> {
        if snapshot.written.is_none() {
            write_tensors(&temp, &snapshot.weights, &snapshot.moments)?;
        }
        fs::write(
            temp.join("config.json"),
            serde_json::to_vec_pretty(&snapshot.config)?,
        )?;
        fs::write(
            temp.join("state.json"),
            serde_json::to_vec_pretty(&snapshot.state)?,
        )?;
        for f in fs::read_dir(&temp)? {
            fs::File::open(f?.path())?.sync_all()?;
        }
        sync_dir(&temp);
        let _ = fs::remove_dir_all(&done);
        fs::rename(&temp, &done)?;
        let pointer = root.join(format!(".latest.tmp-{}", std::process::id()));
        fs::write(&pointer, &name)?;
        fs::File::open(&pointer)?.sync_all()?;
        fs::rename(&pointer, root.join("latest"))?;
        sync_dir(root);
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&temp);
        return Err(e);
    }
    rotate(root, keep)?;
    Ok(done)
}

/// Steps of the finished checkpoints under `root`, ascending.
pub fn steps(root: &Path) -> Vec<u64> {
    dflash_common::run_dir::checkpoint_steps(root)
}

fn rotate(root: &Path, keep: usize) -> io::Result<()> {
    let all = steps(root);
    let latest = fs::read_to_string(root.join("latest")).unwrap_or_default();
    for step in &all[..all.len().saturating_sub(keep.max(1))] {
        let name = format!("step-{step}");
        if name != latest.trim() {
            fs::remove_dir_all(root.join(name))?;
        }
    }
    Ok(())
}

/// The checkpoint `latest` points to, read back with its directory: `None` when there is none.
pub fn load_latest(root: &Path) -> io::Result<Option<(PathBuf, Snapshot)>> {
    let Ok(name) = fs::read_to_string(root.join("latest")) else {
        return Ok(None);
    };
    load_dir(root.join(name.trim()))
}

/// The checkpoint of `step` (`None` for step 0: fresh weights); an error when it is not there.
pub fn load_step(root: &Path, step: u64) -> io::Result<Option<(PathBuf, Snapshot)>> {
    if step == 0 {
        return Ok(None);
    }
    let dir = root.join(format!("step-{step}"));
    if !dir.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "no checkpoint of step {step} ({} is missing)",
                dir.display()
            ),
        ));
    }
    load_dir(dir)
}

fn load_dir(dir: PathBuf) -> io::Result<Option<(PathBuf, Snapshot)>> {
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let state: TrainingState = serde_json::from_slice(&fs::read(dir.join("state.json"))?)
        .map_err(|e| bad(format!("{}: {e}", dir.join("state.json").display())))?;
    let config: Value = serde_json::from_slice(&fs::read(dir.join("config.json"))?)
        .map_err(|e| bad(format!("{}: {e}", dir.join("config.json").display())))?;
    let (weights, moments) = read_tensors(&dir)?;
    Ok(Some((
        dir,
        Snapshot {
            state,
            weights,
            moments,
            config,
            written: None,
        },
    )))
}

/// Refuses the checkpoint in `dir` when another run wrote it: its fingerprint `theirs` must equal
/// this run's, `ours`. An empty `ours` (settings from before runs had fingerprints) checks nothing.
/// Returns the fields that could not be checked because the checkpoint predates them
/// ([`dflash_common::dflash::FINGERPRINT_ADDED_LATER`]).
pub fn check_fingerprint(
    dir: &Path,
    ours: &BTreeMap<String, String>,
    theirs: &BTreeMap<String, String>,
) -> Result<Vec<String>, String> {
    if ours.is_empty() {
        return Ok(Vec::new());
    }
    let why = if theirs.is_empty() {
        "it has no run fingerprint".to_owned()
    } else {
        let compared = dflash_common::dflash::compare_fingerprints(ours, theirs);
        if compared.differ.is_empty() {
            return Ok(compared.unchecked);
        }
        format!("it differs in {}", compared.differ.join(", "))
    };
    Err(format!(
        "checkpoint {} belongs to another run: {why} (resume only the run that wrote it, or launch into a new --run-dir)",
        dir.display()
    ))
}

/// The checkpoint writer's thread died: it panicked with `message`. Nothing is written after that.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("checkpoint writer failed: {message}")]
pub struct WriterFailed {
    pub message: String,
}

impl WriterFailed {
    fn from_panic(payload: Box<dyn std::any::Any + Send>) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "it panicked".to_owned());
        Self { message }
    }
}

/// Snapshots queued for the writer besides the one it is writing: a bound, so that a training
/// thread faster than the disk waits instead of holding ever more copies of the model.
const QUEUED: usize = 1;

/// Writes checkpoints on a thread of its own, in order, holding at most [`QUEUED`] snapshots
/// besides the one being written.
pub struct Writer {
    jobs: mpsc::SyncSender<Snapshot>,
    done: mpsc::Receiver<io::Result<PathBuf>>,
    /// `None` once joined.
    thread: Option<JoinHandle<()>>,
    /// Why the thread died, once it has.
    failed: Option<WriterFailed>,
}

impl Writer {
    /// Starts writing the checkpoints under `root`, keeping the newest `keep`. First removes what
    /// killed writers left there (see [`remove_stale`]).
    pub fn start(root: PathBuf, keep: usize) -> io::Result<Self> {
        Self::start_with(root, keep, save)
    }

    /// [`Writer::start`] with `write` in place of [`save`] (tests make it fail).
    fn start_with(
        root: PathBuf,
        keep: usize,
        mut write: impl FnMut(&Path, &Snapshot, usize) -> io::Result<PathBuf> + Send + 'static,
    ) -> io::Result<Self> {
        remove_stale(&root);
        let (jobs, inbox) = mpsc::sync_channel::<Snapshot>(QUEUED);
        let (report, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("checkpoints".into())
            .spawn(move || {
                for snapshot in inbox {
                    let _ = report.send(write(&root, &snapshot, keep));
                }
            })?;
        Ok(Self {
            jobs,
            done,
            thread: Some(thread),
            failed: None,
        })
    }

    /// Queues a checkpoint. Returns at once while the writer keeps up, blocks while it already
    /// holds a queued one (back-pressure), and fails once its thread has died.
    pub fn submit(&mut self, snapshot: Snapshot) -> Result<(), WriterFailed> {
        if let Some(failed) = self.died() {
            return Err(failed);
        }
        if self.jobs.send(snapshot).is_err() {
            // The receiver is gone while we hold the sender: the thread is unwinding from a panic.
            return Err(self.reap());
        }
        Ok(())
    }

    /// Results of the checkpoints finished since the last call; fails once the thread has died.
    pub fn finished(&mut self) -> Result<Vec<io::Result<PathBuf>>, WriterFailed> {
        let results = self.done.try_iter().collect();
        match self.died() {
            Some(failed) => Err(failed),
            None => Ok(results),
        }
    }

    /// Waits for every queued checkpoint; returns their results, or why the thread died.
    pub fn finish(self) -> Result<Vec<io::Result<PathBuf>>, WriterFailed> {
        let Self {
            jobs,
            done,
            thread,
            failed,
        } = self;
        // Ends the thread's loop once the queue is empty.
        drop(jobs);
        if let Some(failed) = failed {
            return Err(failed);
        }
        if let Some(Err(payload)) = thread.map(JoinHandle::join) {
            return Err(WriterFailed::from_panic(payload));
        }
        Ok(done.try_iter().collect())
    }

    /// Why the thread died, if it has. While we hold the sender its loop does not end, so a
    /// finished thread is one that panicked.
    fn died(&mut self) -> Option<WriterFailed> {
        if self.failed.is_none() && self.thread.as_ref().is_some_and(JoinHandle::is_finished) {
            self.reap();
        }
        self.failed.clone()
    }

    /// Joins the thread, which has died or is dying, and records why.
    fn reap(&mut self) -> WriterFailed {
        if let Some(thread) = self.thread.take() {
            self.failed = Some(match thread.join() {
                Err(payload) => WriterFailed::from_panic(payload),
                Ok(()) => WriterFailed {
                    message: "its thread ended early".into(),
                },
            });
        }
        self.failed.clone().unwrap_or_else(|| WriterFailed {
            message: "its thread is gone".into(),
        })
    }
}

/// Removes what checkpoint writers that were killed left under `root`: `.step-N.tmp-PID`
/// directories and `.latest.tmp-PID` pointers of processes no longer running (ours is running),
/// and the `.latest.tmp` of older builds, which this build never writes (one drafter at a time
/// writes a run's checkpoints).
pub fn remove_stale(root: &Path) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        let stale = match name.strip_prefix('.').and_then(|n| n.rsplit_once(".tmp-")) {
            Some((what, pid))
                if what == "latest" || what == "engine" || what.starts_with("step-") =>
            {
                pid.parse::<u32>().is_ok_and(|pid| !alive(pid))
            }
            _ => name == ".latest.tmp",
        };
        if !stale {
            continue;
        }
        let path = entry.path();
        tracing::info!(path = %path.display(), "removing what a killed checkpoint writer left");
        let removed = match entry.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        if let Err(e) = removed {
            tracing::warn!(path = %path.display(), "cannot remove it: {e}");
        }
    }
}

/// Whether process `pid` is running (ours is).
fn alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(step: u64) -> Snapshot {
        Snapshot {
            state: TrainingState {
                step,
                epoch: 1,
                plan_cursor: step * 4,
                adam_t: step,
                fingerprint: fingerprint(&[("data", "d1"), ("seed", "s1"), ("target", "t1")]),
            },
            weights: vec![
                (
                    "fc.weight".into(),
                    vec![2, 3],
                    vec![step as f32, 1.0, 2.0, 3.0, 4.0, 5.0],
                ),
                ("norm.weight".into(), vec![2], vec![1.0, 0.5]),
            ],
            moments: vec![
                ("fc.weight".into(), vec![2, 3], vec![0.1; 6], vec![0.2; 6]),
                ("norm.weight".into(), vec![2], vec![0.3; 2], vec![0.4; 2]),
            ],
            config: serde_json::json!({"architectures": ["DFlashDraftModel"], "block_size": 16}),
            written: None,
        }
    }

    fn fingerprint(fields: &[(&str, &str)]) -> BTreeMap<String, String> {
        fields
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn temp_root(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("dflash-ckpt-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn round_trip_latest_and_rotation() {
        let root = temp_root("a");
        assert!(load_latest(&root).unwrap().is_none());
        let mut writer = Writer::start(root.clone(), 2).unwrap();
        for step in [10, 20, 30] {
            writer.submit(snapshot(step)).unwrap();
        }
        let results = writer.finish().unwrap();
        assert_eq!(results.len(), 3);
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(steps(&root), vec![20, 30], "the newest two are kept");
        let (dir, loaded) = load_latest(&root).unwrap().unwrap();
        assert_eq!(dir, root.join("step-30"));
        assert_eq!(loaded, snapshot(30), "the run fingerprint included");
        // An agreed step other than the latest, fresh weights, and a rotated step refused.
        let (dir, loaded) = load_step(&root, 20).unwrap().unwrap();
        assert_eq!((dir, loaded), (root.join("step-20"), snapshot(20)));
        assert!(load_step(&root, 0).unwrap().is_none());
        let gone = load_step(&root, 10).unwrap_err().to_string();
        assert!(gone.contains("no checkpoint of step 10"), "{gone}");
        // Nothing half-made is left beside them.
        let names: Vec<String> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        fs::remove_dir_all(&root).unwrap();
    }

    fn expected(s: &Snapshot) -> Vec<(String, Vec<usize>)> {
        s.weights
            .iter()
            .map(|(n, sh, _)| (n.clone(), sh.clone()))
            .collect()
    }

    /// A snapshot whose tensors an engine wrote itself into the staging directory is published
    /// where it lies (the files are not read or written again) and reads back as the snapshot
    /// the writer would have written from memory, with the same tensor bytes.
    #[test]
    fn a_checkpoint_an_engine_wrote_is_published_where_it_lies() {
        let root = temp_root("written");
        fs::create_dir_all(&root).unwrap();
        let full = snapshot(10);
        let staging = staging_dir(&root, 10);
        fs::create_dir(&staging).unwrap();
        write_tensors(&staging, &full.weights, &full.moments).unwrap();
        check_tensor_files(&staging, &expected(&full)).unwrap();
        let before = fs::metadata(staging.join("model.safetensors")).unwrap();
        let written = Snapshot {
            weights: Vec::new(),
            moments: Vec::new(),
            written: Some(staging.clone()),
            ..full.clone()
        };
        let mut writer = Writer::start(root.clone(), 2).unwrap();
        writer.submit(written).unwrap();
        assert!(writer.finish().unwrap().iter().all(Result::is_ok));
        assert!(!staging.exists());
        let (dir, back) = load_latest(&root).unwrap().unwrap();
        assert_eq!(dir, root.join("step-10"));
        assert_eq!(back, full);
        // The same file, moved: its inode is the one the engine wrote.
        use std::os::unix::fs::MetadataExt;
        let after = fs::metadata(dir.join("model.safetensors")).unwrap();
        assert_eq!(before.ino(), after.ino());
        let other = temp_root("written-from-memory");
        save(&other, &full, 2).unwrap();
        for file in ["model.safetensors", "optimizer.safetensors"] {
            assert_eq!(
                fs::read(dir.join(file)).unwrap(),
                fs::read(other.join("step-10").join(file)).unwrap(),
                "{file}"
            );
        }
        // A snapshot claiming files elsewhere is refused, and those files removed.
        let stray = root.join("stray");
        fs::create_dir(&stray).unwrap();
        let wrong = Snapshot {
            written: Some(stray.clone()),
            ..snapshot(20)
        };
        let err = save(&root, &wrong, 2).unwrap_err().to_string();
        assert!(err.contains("is built in"), "{err}");
        assert!(!stray.exists());
        assert_eq!(steps(&root), vec![10]);
        fs::remove_dir_all(&root).unwrap();
        fs::remove_dir_all(&other).unwrap();
    }

    /// Tensor files that are not the drafter's are refused from their headers, naming what is
    /// wrong: a tensor missing, one the drafter lacks, another shape, a truncated file, a header
    /// that is not JSON or is longer than the file.
    #[test]
    fn tensor_files_that_are_not_the_drafters_are_refused_by_their_headers() {
        let root = temp_root("headers");
        fs::create_dir_all(&root).unwrap();
        let full = snapshot(10);
        write_tensors(&root, &full.weights, &full.moments).unwrap();
        let good = expected(&full);
        check_tensor_files(&root, &good).unwrap();
        let mut extra = good.clone();
        extra.push(("lm_head.weight".into(), vec![2]));
        let mut fewer = good.clone();
        fewer.pop();
        let mut reshaped = good.clone();
        reshaped[0].1 = vec![3, 2];
        for (expected, needle) in [
            (&extra, "lacks lm_head.weight"),
            (&fewer, "which the drafter does not have"),
            (&reshaped, "has shape [2,3], not [3, 2]"),
        ] {
            let err = check_tensor_files(&root, expected).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
            assert!(err.contains("model.safetensors"), "{err}");
        }
        let path = root.join("optimizer.safetensors");
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = check_tensor_files(&root, &good).unwrap_err().to_string();
        assert!(
            err.contains("optimizer.safetensors") && err.contains("its header accounts for"),
            "{err}"
        );
        let mut garbage = bytes.clone();
        garbage[8] = b'!';
        fs::write(&path, &garbage).unwrap();
        let err = check_tensor_files(&root, &good).unwrap_err().to_string();
        assert!(err.contains("not JSON"), "{err}");
        fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        let err = check_tensor_files(&root, &good).unwrap_err().to_string();
        assert!(err.contains("a header of"), "{err}");
        fs::write(&path, b"abc").unwrap();
        let err = check_tensor_files(&root, &good).unwrap_err().to_string();
        assert!(err.contains("shorter than a safetensors header"), "{err}");
        fs::remove_dir_all(&root).unwrap();
    }

    /// A checkpoint changed by hand is refused at resume, naming the tensor: a dtype relabelled
    /// (the same bytes read as other numbers), NaN or infinite values, in the weights or the
    /// optimiser's moments.
    #[test]
    fn a_damaged_checkpoint_is_refused_at_resume_naming_the_tensor() {
        type Damage = fn(&mut [u8]);
        let cases: [(&str, &str, Damage); 4] = [
            ("model.safetensors", "tensor fc.weight is I32", |b| {
                relabel(b, "fc.weight", "I32")
            }),
            (
                "model.safetensors",
                "tensor norm.weight holds a non-finite value (inf",
                |b| fill(b, "norm.weight", f32::INFINITY),
            ),
            (
                "model.safetensors",
                "tensor fc.weight holds a non-finite value (NaN",
                |b| fill(b, "fc.weight", f32::NAN),
            ),
            (
                "optimizer.safetensors",
                "tensor v.fc.weight holds a non-finite value",
                |b| fill(b, "v.fc.weight", f32::NEG_INFINITY),
            ),
        ];
        for (i, (file, want, damage)) in cases.into_iter().enumerate() {
            let root = temp_root(&format!("damaged-{i}"));
            save(&root, &snapshot(5), 2).unwrap();
            let path = root.join("step-5").join(file);
            let mut bytes = fs::read(&path).unwrap();
            damage(&mut bytes);
            fs::write(&path, bytes).unwrap();
            let e = load_latest(&root).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
            assert!(e.contains(file), "{e}");
            fs::remove_dir_all(&root).unwrap();
        }
    }

    /// The header (JSON table) and data of a safetensors file.
    fn split(bytes: &[u8]) -> (Value, usize) {
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), 8 + n)
    }

    fn relabel(bytes: &mut [u8], name: &str, dtype: &str) {
        let (mut header, start) = split(bytes);
        header[name]["dtype"] = dtype.into();
        let mut text = header.to_string().into_bytes();
        text.resize(start - 8, b' ');
        assert_eq!(
            text.len(),
            start - 8,
            "the new table fits the old one's room"
        );
        bytes[8..start].copy_from_slice(&text);
    }

    fn fill(bytes: &mut [u8], name: &str, value: f32) {
        let (header, start) = split(bytes);
        let offsets = &header[name]["data_offsets"];
        let (a, b) = (
            start + offsets[0].as_u64().unwrap() as usize,
            start + offsets[1].as_u64().unwrap() as usize,
        );
        for chunk in bytes[a..b].chunks_exact_mut(4) {
            chunk.copy_from_slice(&value.to_le_bytes());
        }
    }

    #[test]
    fn weights_use_the_hugging_face_names_and_pt_metadata() {
        let root = temp_root("b");
        let dir = save(&root, &snapshot(5), 3).unwrap();
        let bytes = fs::read(dir.join("model.safetensors")).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            meta.metadata()
                .as_ref()
                .unwrap()
                .get("format")
                .map(String::as_str),
            Some("pt")
        );
        let names: Vec<String> = read_safetensors(&dir.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(names, vec!["fc.weight", "norm.weight"]);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_checkpoint_of_another_run_is_refused_naming_what_differs() {
        let root = temp_root("fingerprint");
        save(&root, &snapshot(40), 2).unwrap();
        let (dir, loaded) = load_latest(&root).unwrap().unwrap();
        let theirs = &loaded.state.fingerprint;
        let ours = fingerprint(&[("data", "d1"), ("seed", "s1"), ("target", "t1")]);
        assert_eq!(check_fingerprint(&dir, &ours, theirs), Ok(vec![]));
        let ours = fingerprint(&[("data", "d2"), ("seed", "s2"), ("target", "t1")]);
        assert_eq!(
            check_fingerprint(&dir, &ours, theirs).unwrap_err(),
            format!(
                "checkpoint {} belongs to another run: it differs in data, seed (resume only the run that wrote it, or launch into a new --run-dir)",
                root.join("step-40").display()
            )
        );
        // A field only one side has differs too.
        let ours = fingerprint(&[
            ("data", "d1"),
            ("epochs", "e1"),
            ("seed", "s1"),
            ("target", "t1"),
        ]);
        let e = check_fingerprint(&dir, &ours, theirs).unwrap_err();
        assert!(e.contains("it differs in epochs ("), "{e}");
        // A field added later that the checkpoint predates is reported as unchecked, not as a
        // difference; once the checkpoint has it, it must match.
        let ours = fingerprint(&[
            ("data", "d1"),
            ("seed", "s1"),
            ("target", "t1"),
            ("target_weights", "w1"),
        ]);
        assert_eq!(
            check_fingerprint(&dir, &ours, theirs),
            Ok(vec!["target_weights".to_owned()])
        );
        let mut newer = theirs.clone();
        newer.insert("target_weights".into(), "w2".into());
        let e = check_fingerprint(&dir, &ours, &newer).unwrap_err();
        assert!(e.contains("it differs in target_weights ("), "{e}");
        newer.insert("target_weights".into(), "w1".into());
        assert_eq!(check_fingerprint(&dir, &ours, &newer), Ok(vec![]));
        // The absence of an older field is no such excuse.
        let mut older = theirs.clone();
        older.remove("seed");
        let e = check_fingerprint(&dir, &ours, &older).unwrap_err();
        assert!(e.contains("it differs in seed ("), "{e}");
        // Settings without a fingerprint check nothing.
        assert_eq!(
            check_fingerprint(&dir, &BTreeMap::new(), theirs),
            Ok(vec![])
        );
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_checkpoint_without_a_fingerprint_is_refused_by_a_run_with_one() {
        let root = temp_root("no-fingerprint");
        let mut old = snapshot(8);
        old.state.fingerprint.clear();
        save(&root, &old, 2).unwrap();
        // As written before checkpoints carried one: no such field at all.
        let state = root.join("step-8/state.json");
        let mut json: Value = serde_json::from_slice(&fs::read(&state).unwrap()).unwrap();
        json.as_object_mut().unwrap().remove("fingerprint");
        fs::write(&state, serde_json::to_vec(&json).unwrap()).unwrap();
        let (dir, loaded) = load_latest(&root).unwrap().unwrap();
        assert!(loaded.state.fingerprint.is_empty());
        let e = check_fingerprint(
            &dir,
            &snapshot(8).state.fingerprint,
            &loaded.state.fingerprint,
        )
        .unwrap_err();
        assert_eq!(
            e,
            format!(
                "checkpoint {} belongs to another run: it has no run fingerprint (resume only the run that wrote it, or launch into a new --run-dir)",
                dir.display()
            )
        );
        assert_eq!(
            check_fingerprint(&dir, &BTreeMap::new(), &BTreeMap::new()),
            Ok(vec![])
        );
        fs::remove_dir_all(&root).unwrap();
    }

    /// Polls `writer` until it reports its thread dead; fails the test after a minute.
    fn wait_for_failure(writer: &mut Writer) -> WriterFailed {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            match writer.finished() {
                Err(failed) => return failed,
                Ok(_) => {
                    assert!(std::time::Instant::now() < deadline, "no failure reported");
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        }
    }

    #[test]
    fn a_panic_of_the_writer_thread_is_reported_not_swallowed() {
        let root = temp_root("panic");
        let mut writer = Writer::start_with(root.clone(), 2, |root, snapshot, keep| {
            if snapshot.state.step == 20 {
                panic!("disk on fire at step {}", snapshot.state.step);
            }
            save(root, snapshot, keep)
        })
        .unwrap();
        writer.submit(snapshot(10)).unwrap();
        writer.submit(snapshot(20)).unwrap();
        let failed = wait_for_failure(&mut writer);
        assert_eq!(
            failed.to_string(),
            "checkpoint writer failed: disk on fire at step 20"
        );
        // From then on every call says so, and nothing more is written.
        assert_eq!(writer.submit(snapshot(30)), Err(failed.clone()));
        assert_eq!(writer.finished().unwrap_err(), failed);
        assert_eq!(writer.finish().unwrap_err(), failed);
        assert_eq!(steps(&root), vec![10]);

        // Reported by `finish` too when nobody asked before.
        let mut writer = Writer::start_with(root.clone(), 2, |_, _, _| -> io::Result<PathBuf> {
            panic!("no space")
        })
        .unwrap();
        writer.submit(snapshot(40)).unwrap();
        assert_eq!(
            writer.finish().unwrap_err().to_string(),
            "checkpoint writer failed: no space"
        );
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn submit_waits_while_the_writer_is_behind() {
        let root = temp_root("bounded");
        let (gate, opened) = mpsc::channel::<()>();
        let mut writer = Writer::start_with(root.clone(), 5, move |root, snapshot, keep| {
            opened.recv().unwrap();
            save(root, snapshot, keep)
        })
        .unwrap();
        // One being written (held at the gate), one queued: the third waits for room.
        writer.submit(snapshot(1)).unwrap();
        writer.submit(snapshot(2)).unwrap();
        let third = std::thread::spawn(move || {
            writer.submit(snapshot(3)).unwrap();
            writer
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!third.is_finished(), "submit returned with the queue full");
        for _ in 0..3 {
            gate.send(()).unwrap();
        }
        let writer = third.join().unwrap();
        assert_eq!(writer.finish().unwrap().len(), 3);
        assert_eq!(steps(&root), vec![1, 2, 3]);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn starting_removes_what_killed_writers_left() {
        let root = temp_root("stale");
        fs::create_dir_all(&root).unwrap();
        // Above the largest pid Linux hands out (2^22): never a running process.
        let dead = 4_194_304 + 17;
        let live = [1, std::process::id()];
        let stale = [
            format!(".step-40.tmp-{dead}"),
            format!(".latest.tmp-{dead}"),
            ".latest.tmp".to_owned(),
        ];
        let kept = [
            format!(".step-50.tmp-{}", live[0]),
            format!(".step-60.tmp-{}", live[1]),
            format!(".latest.tmp-{}", live[0]),
            format!(".other.tmp-{dead}"),
            "step-30".to_owned(),
        ];
        for name in stale.iter().chain(&kept) {
            if name.contains("step-") || name.starts_with(".other") {
                fs::create_dir(root.join(name)).unwrap();
                fs::write(root.join(name).join("model.safetensors"), b"half").unwrap();
            } else {
                fs::write(root.join(name), b"step-30").unwrap();
            }
        }
        let writer = Writer::start(root.clone(), 2).unwrap();
        assert!(writer.finish().unwrap().is_empty());
        for name in &stale {
            assert!(!root.join(name).exists(), "{name} is left");
        }
        for name in &kept {
            assert!(root.join(name).exists(), "{name} was removed");
        }
        fs::remove_dir_all(&root).unwrap();
    }
}

/// `config.json` of a drafter checkpoint: the Hugging Face DFlash draft layout, with every field
/// the official `DFlashDraftModel` and the serving loaders (SGLang, vLLM) read: `block_size` at
/// the top level and in `dflash_config` (readers differ on where they look), the target's layer
/// ids (layer id k is the output of target layer k, `hidden_states[k + 1]`), the mask token, the
/// target's layer count, and an explicit `layer_types` (the drafter's attention is not causal;
/// a reader that infers a sliding or causal layer from a missing field would get it wrong).
/// `auto_map` names the class as the published DFlash drafters do: `AutoModel` with
/// `trust_remote_code` finds it in a `dflash.py` beside the weights, and the `dflash` package's
/// `DFlashDraftModel.from_pretrained` loads the directory as it is.
pub fn hf_config(c: &DrafterConfig, target: &Qwen3Config) -> Value {
    let mut config = dflash_config(c, target);
    // A DFlash2 drafter: the official class, its sizes where every loader reads them
    // (`dflash_config`), its codebooks stored without `.weight` (the official `from_pretrained`
    // maps them; SGLang and vLLM read them as they are).
    if let Some(d) = &c.dflash2 {
        config["architectures"] = serde_json::json!(["DFlash2DraftModel"]);
        config["auto_map"] = serde_json::json!({"AutoModel": "dflash.DFlash2DraftModel"});
        let fields = &mut config["dflash_config"];
        fields["conv_kernel_size"] = d.conv_kernel_size.into();
        fields["conv_group_size"] = d.conv_group_size.into();
        fields["selector_rank"] = d.selector_rank.into();
        fields["selector_top_k"] = d.selector_top_k.into();
    }
    // Sliding layers, stated in every field a reader may derive them from (a transformers
    // Qwen3Config drops `sliding_window` unless `use_sliding_window`, and derives `layer_types`
    // from `max_window_layers`); the block still sees itself whole: `is_causal` false, which
    // the official package would otherwise infer true for sliding layers.
    if let Some(w) = c.sliding_window {
        config["layer_types"] = serde_json::json!(vec!["sliding_attention"; c.shape.layers]);
        config["use_sliding_window"] = true.into();
        config["sliding_window"] = w.into();
        config["max_window_layers"] = c.shape.layers.into();
        config["is_causal"] = false.into();
    }
    config
}

fn dflash_config(c: &DrafterConfig, target: &Qwen3Config) -> Value {
    serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": c.block_size,
        "dflash_config": {
            "block_size": c.block_size,
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": c.target_layer_ids,
        },
        "num_target_layers": target.num_hidden_layers,
        "vocab_size": c.shape.vocab,
        "hidden_size": c.shape.hidden,
        "intermediate_size": c.shape.intermediate,
        "num_hidden_layers": c.shape.layers,
        "layer_types": vec!["full_attention"; c.shape.layers],
        "num_attention_heads": c.shape.heads,
        "num_key_value_heads": c.shape.kv_heads,
        "head_dim": c.shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.shape.rms_eps,
        "rope_theta": c.shape.rope_theta,
        "max_position_embeddings": target.max_position_embeddings.unwrap_or(32_768),
        "tie_word_embeddings": false,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "sliding_window": null,
        "torch_dtype": "float32",
    })
}

fn flat(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// The drafter's weights as a checkpoint holds them: name, shape, f32 values.
pub fn weights(drafter: &Drafter) -> candle_core::Result<Vec<NamedTensor>> {
    drafter
        .params
        .iter()
        .map(|p| {
            let t = p.var.as_tensor();
            Ok((p.name.clone(), t.dims().to_vec(), flat(t)?))
        })
        .collect()
}

/// Copies the drafter's weights and the optimiser's moments (on the training thread).
pub fn snapshot(
    drafter: &Drafter,
    opt: &AdamW,
    state: TrainingState,
    config: Value,
) -> candle_core::Result<Snapshot> {
    let weights = weights(drafter)?;
    let mut moments = Vec::with_capacity(drafter.params.len());
    for ((name, shape, _), (m, v)) in weights.iter().zip(&opt.moments) {
        moments.push((name.clone(), shape.clone(), flat(m)?, flat(v)?));
    }
    Ok(Snapshot {
        state: TrainingState {
            adam_t: opt.t,
            ..state
        },
        weights,
        moments,
        config,
        written: None,
    })
}

/// Checks that a snapshot holds every weight of a drafter of `config`, in its shape, with its
/// moments.
pub fn fits(snapshot: &Snapshot, config: &DrafterConfig) -> Result<(), String> {
    for (name, shape, _) in config.tensors() {
        let (_, found, _) = snapshot
            .weights
            .iter()
            .find(|(n, _, _)| *n == name)
            .ok_or_else(|| format!("checkpoint has no {name}"))?;
        if *found != shape {
            return Err(format!(
                "{name}: checkpoint shape {found:?}, drafter {shape:?}"
            ));
        }
        if !snapshot.moments.iter().any(|(n, ..)| *n == name) {
            return Err(format!("checkpoint has no moments of {name}"));
        }
    }
    Ok(())
}

/// Puts a snapshot's weights and moments back into a drafter of the same shape and its optimiser.
pub fn restore(
    snapshot: &Snapshot,
    drafter: &Drafter,
    opt: &mut AdamW,
    device: &Device,
) -> Result<(), String> {
    fits(snapshot, &drafter.config)?;
    for (i, p) in drafter.params.iter().enumerate() {
        let (_, shape, values) = snapshot
            .weights
            .iter()
            .find(|(n, _, _)| *n == p.name)
            .ok_or_else(|| format!("checkpoint has no {}", p.name))?;
        let tensor = |v: &[f32]| {
            Tensor::from_vec(v.to_vec(), shape.clone(), device).map_err(|e| e.to_string())
        };
        p.var.set(&tensor(values)?).map_err(|e| e.to_string())?;
        let (_, _, m, v) = snapshot
            .moments
            .iter()
            .find(|(n, ..)| *n == p.name)
            .ok_or_else(|| format!("checkpoint has no moments of {}", p.name))?;
        opt.moments[i] = (tensor(m)?, tensor(v)?);
    }
    opt.t = snapshot.state.adam_t;
    Ok(())
}

#[cfg(test)]
mod resume_tests {
    use super::*;
    use crate::model::drafter::{DrafterConfig, Heads, Sequence};
    use crate::train::{AdamWConfig, grads_of};
    use dflash_common::dflash::Qwen3Shape;

    fn drafter() -> Drafter {
        let config = DrafterConfig {
            shape: Qwen3Shape {
                hidden: 16,
                intermediate: 32,
                layers: 1,
                heads: 2,
                kv_heads: 1,
                head_dim: 8,
                rms_eps: 1e-6,
                rope_theta: 10_000.0,
                vocab: 20,
            },
            block_size: 3,
            mask_token_id: 1,
            target_layer_ids: vec![1],
            dflash2: None,
            sliding_window: None,
        };
        Drafter::new(config, 3, &Device::Cpu).unwrap()
    }

    fn train(d: &Drafter, opt: &mut AdamW, steps: std::ops::Range<u64>) {
        let dev = Device::Cpu;
        for step in steps {
            let f: Vec<f32> = (0..8 * 16)
                .map(|i| ((i as u64 * 7 + step) % 13) as f32 / 13.0)
                .collect();
            let features = Tensor::from_vec(f, (8, 16), &dev).unwrap();
            let e: Vec<f32> = (0..20 * 16)
                .map(|i| ((i * 5) % 11) as f32 / 11.0 - 0.5)
                .collect();
            let emb = Tensor::from_vec(e, (20, 16), &dev).unwrap();
            let tokens: Vec<u32> = (0..8).map(|i| (i * 3 + step as u32) % 20).collect();
            let (loss, _) = d
                .loss(
                    &features,
                    Sequence {
                        tokens: &tokens,
                        loss_mask: &[1; 8],
                        anchors: &[1, 4],
                    },
                    Heads {
                        embedding: &emb,
                        lm_head: &emb,
                    },
                    Default::default(),
                )
                .unwrap();
            let vars: Vec<_> = d.params.iter().map(|p| p.var.clone()).collect();
            opt.step(&grads_of(&loss.backward().unwrap(), &vars), 1e-2)
                .unwrap();
        }
    }

    fn tiny_target(layers: usize) -> Qwen3Config {
        serde_json::from_value(serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 20, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": layers, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6
        }))
        .unwrap()
    }

    /// The checkpoint's config.json reads back as the drafter it describes, with the fields the
    /// serving loaders look for.
    #[test]
    fn config_json_describes_the_drafter() {
        let d = drafter();
        let value = hf_config(&d.config, &tiny_target(4));
        let read =
            dflash_common::eval::DraftConfig::parse(&serde_json::to_vec(&value).unwrap()).unwrap();
        let c = &d.config;
        assert_eq!(
            (
                read.shape.hidden,
                read.shape.layers,
                read.block_size,
                read.mask_token_id
            ),
            (
                c.shape.hidden,
                c.shape.layers,
                c.block_size,
                c.mask_token_id
            )
        );
        assert_eq!(read.target_layer_ids, c.target_layer_ids);
        assert_eq!(read.num_target_layers, Some(4));
        assert_eq!(value["block_size"], value["dflash_config"]["block_size"]);
        assert_eq!(
            value["layer_types"].as_array().unwrap().len(),
            c.shape.layers
        );
        assert_eq!(value["auto_map"]["AutoModel"], "dflash.DFlashDraftModel");
    }

    /// Saved at step 3 and resumed, training ends bit-identical to an uninterrupted run.
    #[test]
    fn resume_from_a_checkpoint_is_exact() {
        let root = std::env::temp_dir().join(format!("dflash-resume-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let straight = drafter();
        let mut opt = AdamW::new(
            straight.params.iter().map(|p| p.var.clone()).collect(),
            AdamWConfig::default(),
        )
        .unwrap();
        train(&straight, &mut opt, 0..6);

        let first = drafter();
        let mut opt1 = AdamW::new(
            first.params.iter().map(|p| p.var.clone()).collect(),
            AdamWConfig::default(),
        )
        .unwrap();
        train(&first, &mut opt1, 0..3);
        let state = TrainingState {
            step: 3,
            epoch: 0,
            plan_cursor: 3,
            adam_t: 0,
            fingerprint: BTreeMap::new(),
        };
        save(
            &root,
            &snapshot(
                &first,
                &opt1,
                state,
                hf_config(&first.config, &tiny_target(4)),
            )
            .unwrap(),
            2,
        )
        .unwrap();

        let resumed = Drafter::new(first.config.clone(), 99, &Device::Cpu).unwrap();
        let mut opt2 = AdamW::new(
            resumed.params.iter().map(|p| p.var.clone()).collect(),
            AdamWConfig::default(),
        )
        .unwrap();
        let (_, loaded) = load_latest(&root).unwrap().unwrap();
        assert_eq!(loaded.state.step, 3);
        assert_eq!(loaded.config["architectures"][0], "DFlashDraftModel");
        restore(&loaded, &resumed, &mut opt2, &Device::Cpu).unwrap();
        train(&resumed, &mut opt2, 3..6);
        for (a, b) in straight.params.iter().zip(&resumed.params) {
            assert_eq!(
                flat(a.var.as_tensor()).unwrap(),
                flat(b.var.as_tensor()).unwrap(),
                "{}",
                a.name
            );
        }
        fs::remove_dir_all(&root).unwrap();
    }
}
