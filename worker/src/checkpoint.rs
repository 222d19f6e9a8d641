//! Drafter checkpoints: `RUN_DIR/checkpoints/step-N/` with `model.safetensors` and `config.json` in
//! the Hugging Face DFlash draft layout (serving stacks load them unchanged), `optimizer.safetensors`
//! (AdamW moments) and `state.json` (step, epoch, plan cursor). Written by a background thread from
//! a snapshot, so training does not wait; each one is built in a temporary directory and renamed
//! into place, then `latest` is replaced, then all but the newest `keep` are removed.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::drafter::Drafter;
use crate::train::AdamW;

/// Where training stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Optimiser steps taken.
    pub step: u64,
    pub epoch: u32,
    /// Batches of the run consumed (the plan position to resume from).
    pub plan_cursor: u64,
    /// AdamW's step counter.
    pub adam_t: u64,
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
    let mut out: Vec<NamedTensor> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            (name, view.shape().to_vec(), values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

fn sync_dir(path: &Path) {
    let _ = fs::File::open(path).and_then(|d| d.sync_all());
}

/// Writes one checkpoint under `root` and rotates; returns its directory.
pub fn save(root: &Path, snapshot: &Snapshot, keep: usize) -> io::Result<PathBuf> {
    fs::create_dir_all(root)?;
    let name = format!("step-{}", snapshot.state.step);
    let done = root.join(&name);
    let temp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&temp);
    fs::create_dir(&temp)?;
    let result = (|| -> io::Result<()> {
        let weights: Vec<(String, &[usize], &[f32])> = snapshot
            .weights
            .iter()
            .map(|(n, s, v)| (n.clone(), s.as_slice(), v.as_slice()))
            .collect();
        write_safetensors(&temp.join("model.safetensors"), &weights)?;
        let moments: Vec<(String, &[usize], &[f32])> = snapshot
            .moments
            .iter()
            .flat_map(|(n, s, m, v)| {
                [
                    (format!("m.{n}"), s.as_slice(), m.as_slice()),
                    (format!("v.{n}"), s.as_slice(), v.as_slice()),
                ]
            })
            .collect();
        write_safetensors(&temp.join("optimizer.safetensors"), &moments)?;
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
        let pointer = root.join(".latest.tmp");
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
    let mut steps: Vec<u64> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort_unstable();
    steps
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

/// The checkpoint `latest` points to, read back: `None` when there is none.
pub fn load_latest(root: &Path) -> io::Result<Option<Snapshot>> {
    let Ok(name) = fs::read_to_string(root.join("latest")) else {
        return Ok(None);
    };
    let dir = root.join(name.trim());
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let state: TrainingState = serde_json::from_slice(&fs::read(dir.join("state.json"))?)
        .map_err(|e| bad(format!("{}: {e}", dir.join("state.json").display())))?;
    let config: Value = serde_json::from_slice(&fs::read(dir.join("config.json"))?)
        .map_err(|e| bad(format!("{}: {e}", dir.join("config.json").display())))?;
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
    Ok(Some(Snapshot {
        state,
        weights,
        moments,
        config,
    }))
}

/// Writes checkpoints on a thread of its own, in order.
pub struct Writer {
    jobs: Option<mpsc::Sender<Snapshot>>,
    done: mpsc::Receiver<io::Result<PathBuf>>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    pub fn start(root: PathBuf, keep: usize) -> io::Result<Self> {
        let (jobs, inbox) = mpsc::channel::<Snapshot>();
        let (report, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("checkpoints".into())
            .spawn(move || {
                for snapshot in inbox {
                    let _ = report.send(save(&root, &snapshot, keep));
                }
            })?;
        Ok(Self {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    /// Queues a checkpoint; returns at once.
    pub fn submit(&self, snapshot: Snapshot) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(snapshot);
        }
    }

    /// Results of the checkpoints finished since the last call.
    pub fn finished(&self) -> Vec<io::Result<PathBuf>> {
        self.done.try_iter().collect()
    }

    /// Waits for every queued checkpoint; returns their results.
    pub fn finish(mut self) -> Vec<io::Result<PathBuf>> {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.done.try_iter().collect()
    }
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
        }
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
        let writer = Writer::start(root.clone(), 2).unwrap();
        for step in [10, 20, 30] {
            writer.submit(snapshot(step));
        }
        let results = writer.finish();
        assert_eq!(results.len(), 3);
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(steps(&root), vec![20, 30], "the newest two are kept");
        assert_eq!(load_latest(&root).unwrap().unwrap(), snapshot(30));
        // Nothing half-made is left beside them.
        let names: Vec<String> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        fs::remove_dir_all(&root).unwrap();
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
}

/// `config.json` of a drafter checkpoint: the Hugging Face DFlash draft layout.
pub fn hf_config(drafter: &Drafter, target_layers: usize) -> Value {
    let c = &drafter.config;
    serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": c.block_size,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": c.target_layer_ids,
        },
        "num_target_layers": target_layers,
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "torch_dtype": "float32",
    })
}

fn flat(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// Copies the drafter's weights and the optimiser's moments (on the training thread).
pub fn snapshot(
    drafter: &Drafter,
    opt: &AdamW,
    state: TrainingState,
    config: Value,
) -> candle_core::Result<Snapshot> {
    let mut weights = Vec::with_capacity(drafter.params.len());
    let mut moments = Vec::with_capacity(drafter.params.len());
    for (p, (m, v)) in drafter.params.iter().zip(&opt.moments) {
        let shape = p.var.as_tensor().dims().to_vec();
        weights.push((p.name.clone(), shape.clone(), flat(p.var.as_tensor())?));
        moments.push((p.name.clone(), shape, flat(m)?, flat(v)?));
    }
    Ok(Snapshot {
        state: TrainingState {
            adam_t: opt.t,
            ..state
        },
        weights,
        moments,
        config,
    })
}

/// Puts a snapshot's weights and moments back into a drafter of the same shape and its optimiser.
pub fn restore(
    snapshot: &Snapshot,
    drafter: &Drafter,
    opt: &mut AdamW,
    device: &Device,
) -> Result<(), String> {
    for (i, p) in drafter.params.iter().enumerate() {
        let (_, shape, values) = snapshot
            .weights
            .iter()
            .find(|(n, _, _)| *n == p.name)
            .ok_or_else(|| format!("checkpoint has no {}", p.name))?;
        if shape.as_slice() != p.var.as_tensor().dims() {
            return Err(format!(
                "{}: checkpoint shape {shape:?}, drafter {:?}",
                p.name,
                p.var.as_tensor().dims()
            ));
        }
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
    use crate::model::drafter::DrafterConfig;
    use crate::train::{AdamWConfig, grads_of};

    fn drafter() -> Drafter {
        let config = DrafterConfig {
            hidden: 16,
            intermediate: 32,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            rms_eps: 1e-6,
            rope_theta: 10_000.0,
            block_size: 3,
            mask_token_id: 1,
            target_layer_ids: vec![1],
            vocab: 20,
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
                .loss(&features, &tokens, &[1; 8], &[1, 4], &emb, &emb, None)
                .unwrap();
            let vars: Vec<_> = d.params.iter().map(|p| p.var.clone()).collect();
            opt.step(&grads_of(&loss.backward().unwrap(), &vars), 1e-2)
                .unwrap();
        }
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
        };
        save(
            &root,
            &snapshot(&first, &opt1, state, hf_config(&first, 4)).unwrap(),
            2,
        )
        .unwrap();

        let resumed = Drafter::new(first.config.clone(), 99, &Device::Cpu).unwrap();
        let mut opt2 = AdamW::new(
            resumed.params.iter().map(|p| p.var.clone()).collect(),
            AdamWConfig::default(),
        )
        .unwrap();
        let loaded = load_latest(&root).unwrap().unwrap();
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
