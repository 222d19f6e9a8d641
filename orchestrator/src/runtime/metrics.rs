//! The run's metrics, to every sink at once: `RUN_DIR/metrics.jsonl` (always), TensorBoard event
//! files under `RUN_DIR/tb/` (always) and the Prometheus endpoint (with `--metrics-addr`). Line
//! kinds and fields are documented in docs/metrics.md. Training lines are summed from the drafters'
//! micro-batch reports in plan order, one per optimiser step, once every micro-batch of its group
//! is in (data-parallel drafters report theirs in any order); a replay after a drafter restart
//! writes its steps again, and the last line of a step is the one that counts.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use std::collections::BTreeMap;

use dflash_common::wire::{Group as PlanGroup, TrainMetrics, Update};
use serde_json::{Value, json};

use crate::observe::gpu::{GpuOwner, GpuSample};
use crate::observe::monitor::ProcessSample;
use crate::observe::prom::{GpuLabels, Prom, WorkerLabels};
use crate::observe::tensorboard::TbWriter;

pub const FILE: &str = "metrics.jsonl";
/// TensorBoard's directory in the run directory.
pub const TB_DIR: &str = "tb";

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One committed batch, for the `batch` line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchRecord {
    pub epoch: u32,
    pub batch: u64,
    pub step: u64,
    pub bucket: u16,
    pub samples: u32,
    pub real_tokens: u64,
    pub padded_tokens: u64,
    pub mean_len: f64,
    pub max_len: u32,
    pub wait_s: f64,
    pub compute_s: f64,
    pub tokens_per_s: f64,
    pub padded_tokens_per_s: f64,
    pub padding_efficiency: f64,
    pub input_ring_occupancy: f64,
    pub feature_ring_occupancy: f64,
    pub restarts: u64,
    pub bucket_batches: Vec<u64>,
}

/// An accumulation group's reports so far.
#[derive(Default)]
struct Pending {
    len: u64,
    /// Per plan position: the batch's real tokens and its report.
    micro: BTreeMap<u64, (u64, TrainMetrics)>,
    update: Option<Update>,
}

impl Pending {
    /// Takes an update: the first one counts (every rank steps alike); a skip that another rank
    /// explains is kept.
    fn merge(&mut self, update: &Update) {
        match &mut self.update {
            None => self.update = Some(update.clone()),
            Some(u) => {
                if u.skipped.is_none() {
                    u.skipped.clone_from(&update.skipped);
                }
            }
        }
    }
}

/// The sinks, and the group of micro-batches being summed.
pub struct Metrics {
    file: File,
    tb: Option<TbWriter>,
    pub prom: Option<Prom>,
    /// Groups being summed, by their first plan position.
    groups: BTreeMap<u64, Pending>,
    /// The first plan position of the newest group written (later updates of it are other
    /// ranks' copies).
    written: Option<u64>,
    /// The newest step line.
    pub last: Option<Value>,
    /// Monitor ticks written, the step of the `gpu*/` and `worker*/` scalars.
    ticks: i64,
    /// Optimiser steps skipped for a NaN or infinity this session.
    pub skipped_steps: u64,
    /// The newest served-acceptance evaluation's line.
    pub last_eval: Option<Value>,
    /// With several nodes: this node's drafters, ranks `base..base + drafters` of `world`
    /// (each step line sums this node's share of its group), and the node's rank (on every
    /// line).
    share: Option<(u64, u64, u64)>,
    node: Option<u32>,
}

/// Simulated acceptance length of a block: the expected number of draft tokens accepted in a
/// row, Σ_k Π_{j<=k} acc_j over the predicted positions.
pub fn acceptance_length(accuracy: &[f64]) -> f64 {
    let mut run = 1.0;
    let mut total = 0.0;
    for a in accuracy {
        run *= a;
        total += run;
    }
    total
}

impl Metrics {
    /// Opens the sinks of the run in `run_dir`; `prom` is the endpoint, if one was asked for.
    pub fn open(run_dir: &Path, prom: Option<Prom>) -> io::Result<Self> {
        let tb = match TbWriter::create(&run_dir.join(TB_DIR)) {
            Ok(tb) => Some(tb),
            Err(e) => {
                tracing::warn!("no TensorBoard events for this run: {e}");
                None
            }
        };
        let path = run_dir.join(FILE);
        let file = crate::fsutil::open_own(
            &path,
            OpenOptions::new().read(true).create(true).append(true),
        )?;
        // A line cut short (a full disk, a crash mid-write) is dropped: appending to it would
        // fuse two records into one malformed line.
        let dropped = crate::fsutil::cut_torn_tail(&file)?;
        if dropped > 0 {
            tracing::warn!(
                "{}: dropped a last line cut short ({dropped} bytes) before appending",
                path.display()
            );
        }
        Ok(Self {
            file,
            tb,
            prom,
            groups: BTreeMap::new(),
            written: None,
            last: None,
            ticks: 0,
            skipped_steps: 0,
            last_eval: None,
            share: None,
            node: None,
        })
    }

    /// This node trains ranks `base..base + drafters` of every node's `world` drafters: its
    /// step lines sum its share of each group, and every line carries `node`.
    pub fn share(&mut self, base: u32, drafters: u32, world: u32, node: u32) {
        self.share = Some((u64::from(base), u64::from(drafters), u64::from(world)));
        self.node = Some(node);
    }

    /// The micro-batches of a group of `len` this node trains.
    fn local_in_group(&self, len: u64) -> u64 {
        match self.share {
            None => len,
            Some((base, drafters, world)) => (0..len)
                .filter(|p| (base..base + drafters).contains(&(p % world.max(1))))
                .count() as u64,
        }
    }

    /// Appends one line to `metrics.jsonl`, with its kind and time.
    fn line(&mut self, kind: &str, mut value: Value) -> io::Result<f64> {
        let time = now();
        if let Value::Object(m) = &mut value {
            m.insert("kind".into(), json!(kind));
            m.insert("time".into(), json!(time));
            if let Some(node) = self.node {
                m.insert("node".into(), json!(node));
            }
        }
        let mut text = serde_json::to_vec(&value).map_err(io::Error::other)?;
        text.push(b'\n');
        self.file.write_all(&text)?;
        Ok(time)
    }

    /// TensorBoard scalars; a failing writer is dropped with a warning (the run goes on).
    fn scalars(&mut self, step: i64, time: f64, values: &[(&str, f64)]) {
        let Some(tb) = self.tb.as_mut() else { return };
        for (tag, value) in values {
            if value.is_finite()
                && let Err(e) = tb.scalar(tag, step, *value, time)
            {
                tracing::warn!("TensorBoard events stopped: {e}");
                self.tb = None;
                return;
            }
        }
    }

    /// Flushes the buffered sinks (each monitor tick and at the end).
    pub fn flush(&mut self) {
        if let Some(tb) = self.tb.as_mut()
            && let Err(e) = tb.flush()
        {
            tracing::warn!("TensorBoard events stopped: {e}");
            self.tb = None;
        }
    }

    /// A committed batch.
    pub fn batch(&mut self, r: &BatchRecord) -> io::Result<()> {
        let time = self.line("batch", serde_json::to_value(r).map_err(io::Error::other)?)?;
        let mut values = vec![
            ("pipeline/tokens_per_s", r.tokens_per_s),
            ("pipeline/padded_tokens_per_s", r.padded_tokens_per_s),
            ("pipeline/padding_efficiency", r.padding_efficiency),
            ("pipeline/batch_mean_len", r.mean_len),
            ("pipeline/batch_max_len", f64::from(r.max_len)),
            ("pipeline/bucket", f64::from(r.bucket)),
            ("pipeline/wait_s", r.wait_s),
            ("pipeline/compute_s", r.compute_s),
            ("pipeline/input_ring_occupancy", r.input_ring_occupancy),
            ("pipeline/feature_ring_occupancy", r.feature_ring_occupancy),
            ("pipeline/restarts", r.restarts as f64),
        ];
        let bucket_tags: Vec<String> = (0..r.bucket_batches.len())
            .map(|k| format!("pipeline/bucket_{k}_batches"))
            .collect();
        for (tag, &n) in bucket_tags.iter().zip(&r.bucket_batches) {
            values.push((tag, n as f64));
        }
        self.scalars(r.step as i64, time, &values);
        if let Some(p) = &self.prom {
            p.set("dflash_committed_steps", (r.step + 1) as f64);
            p.set("dflash_epoch", f64::from(r.epoch));
            p.set("dflash_tokens_per_second", r.tokens_per_s);
            p.set("dflash_padded_tokens_per_second", r.padded_tokens_per_s);
            p.set("dflash_padding_efficiency_ratio", r.padding_efficiency);
            p.set("dflash_input_ring_occupancy_ratio", r.input_ring_occupancy);
            p.set(
                "dflash_feature_ring_occupancy_ratio",
                r.feature_ring_occupancy,
            );
            for (k, &n) in r.bucket_batches.iter().enumerate() {
                p.bucket_batches
                    .get_or_create(&crate::observe::prom::BucketLabels {
                        bucket: k.to_string(),
                    })
                    .set(n as f64);
            }
        }
        Ok(())
    }

    /// One monitor tick's readings.
    pub fn monitor(
        &mut self,
        gpus: &[(GpuSample, GpuOwner)],
        processes: &[ProcessSample],
    ) -> io::Result<()> {
        let step = self.ticks;
        self.ticks += 1;
        for (s, owner) in gpus {
            let mut v = serde_json::to_value(s).map_err(io::Error::other)?;
            if let Value::Object(m) = &mut v {
                m.insert("worker".into(), json!(owner.worker));
                m.insert("role".into(), json!(owner.role));
            }
            let time = self.line("gpu", v)?;
            let tags: Vec<(String, Option<f64>)> = [
                ("power_w", s.power_w),
                ("utilization_pct", s.utilization_pct.map(f64::from)),
                ("memory_used_bytes", s.memory_used_bytes.map(|b| b as f64)),
                ("temperature_c", s.temperature_c.map(f64::from)),
                ("sm_clock_mhz", s.sm_clock_mhz.map(f64::from)),
            ]
            .into_iter()
            .map(|(name, v)| (format!("gpu{}/{name}", s.gpu), v))
            .collect();
            let values: Vec<(&str, f64)> = tags
                .iter()
                .filter_map(|(t, v)| v.map(|v| (t.as_str(), v)))
                .collect();
            self.scalars(step, time, &values);
            if let Some(p) = &self.prom {
                p.gpu(
                    &GpuLabels {
                        gpu: s.gpu.to_string(),
                        worker: owner.worker.to_string(),
                        role: owner.role.into(),
                    },
                    s,
                );
            }
        }
        for p in processes {
            let time = self.line(
                "process",
                serde_json::to_value(p).map_err(io::Error::other)?,
            )?;
            let cpu = format!("worker{}/cpu_pct", p.worker);
            let rss = format!("worker{}/rss_bytes", p.worker);
            self.scalars(step, time, &[(&cpu, p.cpu_pct), (&rss, p.rss_bytes as f64)]);
            if let Some(prom) = &self.prom {
                let labels = WorkerLabels {
                    worker: p.worker.to_string(),
                    role: p.role.into(),
                };
                prom.worker_cpu
                    .get_or_create(&labels)
                    .set(p.cpu_pct / 100.0);
                prom.worker_rss
                    .get_or_create(&labels)
                    .set(p.rss_bytes as f64);
            }
        }
        self.flush();
        Ok(())
    }

    /// Something that happened: a worker started or exited, a rewind, a warning.
    pub fn event(
        &mut self,
        event: &str,
        worker: Option<(u32, &str)>,
        message: &str,
    ) -> io::Result<()> {
        self.line(
            "event",
            json!({
                "event": event,
                "worker": worker.map(|w| w.0),
                "role": worker.map(|w| w.1),
                "message": message,
            }),
        )?;
        Ok(())
    }

    /// Adds the report of the micro-batch at plan position `plan_step` (in `group`, of `tokens`
    /// real tokens); once its group is complete, writes and returns the step's line.
    pub fn add(
        &mut self,
        epoch: u32,
        plan_step: u64,
        group: PlanGroup,
        tokens: u64,
        m: &TrainMetrics,
    ) -> io::Result<Option<Value>> {
        let start = plan_step - u64::from(group.index);
        let pending = self.groups.entry(start).or_default();
        pending.len = u64::from(group.len);
        pending.micro.insert(plan_step, (tokens, m.clone()));
        if let Some(u) = &m.update {
            pending.merge(u);
        }
        self.complete(epoch, start)
    }

    /// Adds a data-parallel drafter's update of the step of the group ending at plan position
    /// `last` (`group`), from a rank that had no batch in it.
    pub fn add_update(
        &mut self,
        epoch: u32,
        last: u64,
        group: PlanGroup,
        update: &Update,
    ) -> io::Result<Option<Value>> {
        let start = last - u64::from(group.index);
        if self.written.is_some_and(|w| start <= w) && !self.groups.contains_key(&start) {
            return Ok(None); // the step's line is written
        }
        let pending = self.groups.entry(start).or_default();
        pending.len = u64::from(group.len);
        pending.merge(update);
        self.complete(epoch, start)
    }

    /// Writes the line of the group starting at `start` once every micro-batch and an update
    /// of it are in: the sums in plan order, the loss the mean of the micro-batches' losses.
    fn complete(&mut self, epoch: u32, start: u64) -> io::Result<Option<Value>> {
        let done = self.groups.get(&start).is_some_and(|p| {
            p.update.is_some() && p.micro.len() as u64 == self.local_in_group(p.len)
        });
        if !done {
            return Ok(None);
        }
        let Some(Pending {
            len,
            micro,
            update: Some(update),
        }) = self.groups.remove(&start)
        else {
            return Ok(None);
        };
        self.written = Some(start);
        if micro.is_empty() {
            // A node whose drafters had no batch in this (short last) group: nothing of its own
            // to report; the nodes that trained its batches write the step's line.
            return Ok(None);
        }
        let mut g = Sums::default();
        let mut loss = 0.0;
        // DFlash2's selector: its loss's mean over the micro-batches that report it, its right
        // picks over the positions counted in them.
        let (mut selector_loss, mut selector_micro) = (0.0, 0u32);
        let (mut picks, mut picked_of) = (0u64, 0u64);
        // The mean over the micro-batches reported here: the whole group's on one node, this
        // node's share of it on one of several.
        let reported = micro.len() as f64;
        for (tokens, m) in micro.values() {
            g.correct.resize(m.correct.len().max(g.correct.len()), 0);
            g.counted.resize(m.counted.len().max(g.counted.len()), 0);
            for (k, (&c, &n)) in m.correct.iter().zip(&m.counted).enumerate() {
                g.correct[k] += u64::from(c);
                g.counted[k] += u64::from(n);
            }
            g.tokens += tokens;
            g.anchors += u64::from(m.anchors);
            g.compute_s += m.compute_s;
            loss += m.loss / reported;
            if let Some(s) = &m.selector {
                selector_loss += s.loss;
                selector_micro += 1;
                picks += s.correct.iter().map(|&c| u64::from(c)).sum::<u64>();
                picked_of += m.counted.iter().map(|&c| u64::from(c)).sum::<u64>();
            }
        }
        let plan_step = start + len - 1;
        let update = Update { loss, ..update };
        let update = &update;
        // Position 0 (the anchor itself) is never predicted.
        let accuracy: Vec<f64> = g
            .correct
            .iter()
            .zip(&g.counted)
            .skip(1)
            .map(|(&c, &n)| if n == 0 { 0.0 } else { c as f64 / n as f64 })
            .collect();
        let (correct, counted) = (
            g.correct.iter().sum::<u64>() as f64,
            g.counted.iter().sum::<u64>().max(1) as f64,
        );
        if update.skipped.is_some() {
            self.skipped_steps += 1;
        }
        let mut line = json!({
            "epoch": epoch,
            "step": update.step,
            "plan_step": plan_step,
            "loss": update.loss,
            "accuracy": correct / counted,
            "accuracy_by_position": accuracy,
            "acceptance_length": acceptance_length(&accuracy),
            "lr": update.lr,
            "grad_norm": update.grad_norm,
            "tokens": g.tokens,
            "anchors": g.anchors,
            "compute_s": g.compute_s,
            "checkpoint": update.checkpoint,
            "skipped": update.skipped,
            "skipped_steps": self.skipped_steps,
            "reduce_s": update.reduce_s,
        });
        let selector = (selector_micro > 0).then(|| {
            (
                selector_loss / f64::from(selector_micro),
                picks as f64 / picked_of.max(1) as f64,
            )
        });
        if let Some((l, a)) = selector {
            line["selector_loss"] = l.into();
            line["selector_accuracy"] = a.into();
        }
        let time = self.line("train", line.clone())?;
        let mut values = vec![
            ("train/loss", update.loss),
            ("train/accuracy", correct / counted),
            ("train/acceptance_length", acceptance_length(&accuracy)),
            ("train/lr", update.lr),
            ("train/grad_norm", update.grad_norm),
            ("train/skipped_steps", self.skipped_steps as f64),
        ];
        let position_tags: Vec<String> = (1..=accuracy.len())
            .map(|k| format!("train/accuracy_pos{k}"))
            .collect();
        for (tag, &a) in position_tags.iter().zip(&accuracy) {
            values.push((tag, a));
        }
        if let Some((l, a)) = selector {
            values.push(("train/selector_loss", l));
            values.push(("train/selector_accuracy", a));
        }
        self.scalars(update.step as i64, time, &values);
        if let Some(p) = &self.prom {
            p.set("dflash_train_loss", update.loss);
            p.set("dflash_train_accuracy", correct / counted);
            p.set(
                "dflash_train_acceptance_length",
                acceptance_length(&accuracy),
            );
            p.set("dflash_train_learning_rate", update.lr);
            p.set("dflash_train_grad_norm", update.grad_norm);
            p.set("dflash_train_skipped_steps", self.skipped_steps as f64);
        }
        self.last = Some(line.clone());
        Ok(Some(line))
    }

    /// Writes a served-acceptance evaluation: τ by speculative decoding on the held-out prompts,
    /// at the step of the checkpoint evaluated.
    pub fn eval(&mut self, o: &super::eval::Outcome) -> io::Result<()> {
        let line = json!({
            "step": o.step,
            "tau": o.tau,
            "pooled_tau": o.pooled_tau,
            "histogram": o.histogram,
            "prompts": o.prompts,
            "tokens": o.tokens,
            "seconds": o.seconds,
        });
        let time = self.line("eval", line.clone())?;
        self.scalars(
            o.step as i64,
            time,
            &[("eval/tau", o.tau), ("eval/pooled_tau", o.pooled_tau)],
        );
        if let Some(p) = &self.prom {
            p.set("dflash_eval_tau", o.tau);
        }
        self.last_eval = Some(line);
        self.flush();
        Ok(())
    }

    /// Forgets partly summed groups (a drafter restarted: they are trained again).
    pub fn reset_group(&mut self) {
        self.groups.clear();
        self.written = None;
    }
}

/// A group's sums.
#[derive(Default)]
struct Sums {
    correct: Vec<u64>,
    counted: Vec<u64>,
    tokens: u64,
    anchors: u64,
    compute_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_length_is_the_expected_accepted_run() {
        assert_eq!(acceptance_length(&[]), 0.0);
        assert_eq!(acceptance_length(&[1.0, 1.0, 1.0]), 3.0);
        assert!((acceptance_length(&[0.5, 0.5]) - 0.75).abs() < 1e-12);
        assert_eq!(acceptance_length(&[0.0, 1.0]), 0.0);
    }

    /// Node 1 of two (one drafter each, `--accum 4`, a short last group of 2 at plan steps
    /// 4 and 5): its line for the first group comes once its two micro-batches (positions 1
    /// and 3) and the step's update are in, with their mean loss and its own tokens, and names
    /// the node; the short group holds none of its batches and gets no line here.
    #[test]
    fn a_node_reports_its_share_of_each_step() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = Metrics::open(dir.path(), None).unwrap();
        m.share(1, 1, 2, 1);
        let update = Update {
            step: 1,
            lr: 1e-3,
            grad_norm: 1.0,
            loss: 0.0,
            checkpoint: false,
            skipped: None,
            reduce_s: 0.0,
        };
        let micro = |loss: f64, update: Option<Update>| TrainMetrics {
            loss,
            correct: vec![0, 1],
            counted: vec![2, 2],
            anchors: 2,
            compute_s: 0.1,
            update,
            selector: None,
        };
        let group = |index| PlanGroup { index, len: 4 };
        assert!(
            m.add(0, 1, group(1), 100, &micro(2.0, None))
                .unwrap()
                .is_none()
        );
        let line = m
            .add(0, 3, group(3), 50, &micro(4.0, Some(update.clone())))
            .unwrap()
            .expect("the node's two micro-batches and the update are in");
        assert_eq!(line["loss"], 3.0);
        assert_eq!(line["tokens"], 150);
        assert_eq!(line["plan_step"], 3);
        let short = PlanGroup { index: 1, len: 2 };
        let none = m
            .add_update(0, 5, short, &Update { step: 2, ..update })
            .unwrap();
        assert!(none.is_none(), "{none:?}");
        let text = std::fs::read_to_string(dir.path().join(FILE)).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert_eq!(lines[0]["node"], 1);
    }
}
