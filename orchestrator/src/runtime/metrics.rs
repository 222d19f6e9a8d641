//! Training metrics: `RUN_DIR/metrics.jsonl`, one line per optimiser step, summed from the
//! drafter's micro-batch reports. A replay after a drafter restart writes its steps again; the
//! last line of a step is the one that counts.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use dflash_common::wire::TrainMetrics;
use serde_json::{Value, json};

pub const FILE: &str = "metrics.jsonl";

#[derive(Default)]
struct Group {
    correct: Vec<u64>,
    counted: Vec<u64>,
    tokens: u64,
    anchors: u64,
    compute_s: f64,
}

/// Accumulates a group's micro-batches and writes a line per optimiser step.
pub struct Metrics {
    file: File,
    group: Group,
    /// The newest step line.
    pub last: Option<Value>,
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
    pub fn open(run_dir: &Path) -> io::Result<Self> {
        Ok(Self {
            file: OpenOptions::new()
                .create(true)
                .append(true)
                .open(run_dir.join(FILE))?,
            group: Group::default(),
            last: None,
        })
    }

    /// Adds a micro-batch of `tokens` real tokens; at the end of its group, writes and returns
    /// the step's line.
    pub fn add(
        &mut self,
        epoch: u32,
        plan_step: u64,
        tokens: u64,
        m: &TrainMetrics,
    ) -> io::Result<Option<Value>> {
        let g = &mut self.group;
        g.correct.resize(m.correct.len().max(g.correct.len()), 0);
        g.counted.resize(m.counted.len().max(g.counted.len()), 0);
        for (k, (&c, &n)) in m.correct.iter().zip(&m.counted).enumerate() {
            g.correct[k] += u64::from(c);
            g.counted[k] += u64::from(n);
        }
        g.tokens += tokens;
        g.anchors += u64::from(m.anchors);
        g.compute_s += m.compute_s;
        let Some(update) = &m.update else {
            return Ok(None);
        };
        let g = std::mem::take(&mut self.group);
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
        let time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let line = json!({
            "time": time,
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
        });
        let mut text = serde_json::to_vec(&line).map_err(io::Error::other)?;
        text.push(b'\n');
        self.file.write_all(&text)?;
        self.last = Some(line.clone());
        Ok(Some(line))
    }

    /// Forgets a partly summed group (the drafter restarted).
    pub fn reset_group(&mut self) {
        self.group = Group::default();
    }
}

/// Reads `metrics.jsonl`: the step lines, the last one of each step kept, in step order.
pub fn read(run_dir: &Path) -> io::Result<Vec<Value>> {
    let text = std::fs::read_to_string(run_dir.join(FILE))?;
    let mut steps = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Ok(v) = serde_json::from_str::<Value>(line)
            && let Some(step) = v["step"].as_u64()
        {
            steps.insert(step, v);
        }
    }
    Ok(steps.into_values().collect())
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
}
