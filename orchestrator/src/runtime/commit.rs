//! Committing trained batches in plan order (the journal line that makes a batch done), entering
//! an epoch, putting the run back at its first uncommitted batch after a crash, and the metrics
//! record of a committed batch.

use std::time::{Duration, Instant};

use super::journal::Entry;
use super::{Outcome, Run, RunError, metrics};
use crate::planner::Layout as PlanLayout;

impl Run {
    /// Commits trained batches in plan order.
    pub(super) fn commit_ready(&mut self) -> Result<(), RunError> {
        // Also while stopping: what the drafter trained is in its final checkpoint.
        while self.epoch < self.config.epochs {
            let Some(b) = self.dispatch.commit_next() else {
                return Ok(());
            };
            self.commit(b, self.checksums[b])?;
        }
        Ok(())
    }

    /// Journals the commit of batch `b` (the dispatcher's cursor has just passed it); moves to the
    /// next epoch at the end of one.
    pub(super) fn commit(&mut self, b: usize, checksum: u32) -> Result<(), RunError> {
        let batch = &self.plan.batches[b];
        self.journal
            .append(&Entry::Commit {
                epoch: self.epoch,
                step: self.step_base + b as u64,
                batch: b as u64,
                samples: batch.count,
                checksum,
            })
            .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
        self.tokens_committed += batch.real_tokens;
        let record = self.batch_record(b);
        self.metrics
            .batch(&record)
            .map_err(|e| RunError::Failed(format!("{}: {e}", metrics::FILE)))?;
        self.committed_total += 1;
        if b + 1 == self.plan.batches.len() {
            if self.epoch + 1 == self.config.epochs {
                self.epoch += 1;
                self.stopping.get_or_insert(Outcome::Completed);
                return Ok(());
            }
            let base = self.step_base + self.plan.batches.len() as u64;
            self.enter(self.epoch + 1, base, 0);
            self.journal_epoch()?;
        }
        Ok(())
    }

    /// Positions the run at `batch` of `epoch` (whose first step is `base`) with an empty
    /// pipeline: nothing fed, queued or leased.
    pub(super) fn enter(&mut self, epoch: u32, base: u64, batch: usize) {
        if epoch != self.epoch || self.plan.batches.is_empty() {
            self.plan = self.planner.plan_epoch(u64::from(epoch));
        }
        self.epoch = epoch;
        self.step_base = base;
        let n = self.plan.batches.len();
        self.checksums = vec![0; n];
        self.nonfinite = vec![None; n];
        self.timing = vec![(0.0, None, 0.0); n];
        if batch == 0 {
            self.bucket_batches.clear();
        }
        self.dispatch.enter(n, batch);
        self.committed_total = base + batch as u64;
    }

    /// Moves the run to plan position `cursor`, where the drafter resumed, once no worker holds a
    /// lease. Backwards (the drafter restarted from a checkpoint): the later commits are void and
    /// the batches are replayed. Forwards (the orchestrator died after the drafter checkpointed
    /// batches it had not journaled yet): those batches are committed from the plan.
    pub(super) fn reposition(&mut self) -> Result<(), RunError> {
        let Some(cursor) = self.rewind_to else {
            return Ok(());
        };
        if self.dispatch.holds_leases() {
            return Ok(());
        }
        self.rewind_to = None;
        if cursor == self.committed_total {
            // Nothing voided, nothing ahead: the pipeline starts again from the commit cursor
            // (the ranks' cursors of data-parallel drafters with it).
            if self.epoch < self.config.epochs {
                self.enter(self.epoch, self.step_base, self.dispatch.next_commit());
            }
            return Ok(());
        }
        if cursor > self.committed_total {
            let from = self.committed_total;
            self.enter(self.epoch, self.step_base, self.dispatch.next_commit());
            while self.committed_total < cursor && self.epoch < self.config.epochs {
                let b = self.dispatch.skip_next();
                let checksum = self.batch_checksum(b);
                self.commit(b, checksum)?;
            }
            if self.epoch < self.config.epochs {
                self.enter(self.epoch, self.step_base, self.dispatch.next_commit());
            }
            let message = format!(
                "the drafter's checkpoint is ahead of the journal: committed plan positions {from}..{cursor} from the checkpoint without training them again"
            );
            tracing::warn!("{message}");
            self.journal
                .append(&Entry::CommittedFromCheckpoint {
                    from_step: from,
                    to_step: cursor,
                })
                .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
            let _ = self
                .metrics
                .event("committed_from_checkpoint", None, &message);
            return Ok(());
        }
        let mut base = 0;
        let mut epoch = 0;
        for &size in &self.epoch_sizes {
            if cursor < base + size {
                break;
            }
            base += size;
            epoch += 1;
        }
        let batch = (cursor - base) as usize;
        let voided = self.committed_total - cursor;
        self.journal
            .append(&Entry::Rewind {
                to_step: cursor,
                epoch,
                batch: batch as u64,
                reason: format!("the drafter resumed from its checkpoint at step {cursor}"),
            })
            .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
        let message = format!(
            "drafter resumed at plan position {cursor}: replaying {voided} batches from epoch {epoch} batch {batch}"
        );
        tracing::warn!("{message}");
        let _ = self.metrics.event("rewind", None, &message);
        self.epoch_sizes.truncate(epoch as usize + 1);
        self.enter(epoch, base, batch);
        Ok(())
    }

    /// The `batch` metrics of batch `b`, committed now.
    pub(super) fn batch_record(&mut self, b: usize) -> metrics::BatchRecord {
        let batch = self.plan.batches[b];
        // Padded: rows × longest row; packed: the batch's capacity (as the planner counts them).
        let padded_tokens = match self.plan.layout {
            PlanLayout::Padded => u64::from(batch.count) * u64::from(batch.max_len),
            PlanLayout::Packed => self.config.planner.token_budget,
        };
        let now = Instant::now();
        self.window
            .push_back((now, batch.real_tokens, padded_tokens));
        while self
            .window
            .front()
            .is_some_and(|(t, ..)| now.duration_since(*t) > Duration::from_secs(10))
        {
            self.window.pop_front();
        }
        let span = self
            .window
            .front()
            .map_or(0.0, |(t, ..)| now.duration_since(*t).as_secs_f64())
            .max(self.started.elapsed().as_secs_f64().min(10.0))
            .max(1e-3);
        let (real, padded) = self
            .window
            .iter()
            .fold((0, 0), |(r, p), (_, a, b)| (r + a, p + b));
        self.session_tokens.0 += batch.real_tokens;
        self.session_tokens.1 += padded_tokens;
        let (input_ring_occupancy, feature_ring_occupancy) = self.dispatch.occupancy();
        let (wait_s, _, compute_s) = self.timing.get(b).copied().unwrap_or((0.0, None, 0.0));
        metrics::BatchRecord {
            epoch: self.epoch,
            batch: b as u64,
            step: self.step_base + b as u64,
            bucket: batch.bucket,
            samples: batch.count,
            real_tokens: batch.real_tokens,
            padded_tokens,
            mean_len: batch.real_tokens as f64 / f64::from(batch.count.max(1)),
            max_len: batch.max_len,
            wait_s,
            compute_s,
            tokens_per_s: real as f64 / span,
            padded_tokens_per_s: padded as f64 / span,
            padding_efficiency: self.session_tokens.0 as f64 / self.session_tokens.1.max(1) as f64,
            input_ring_occupancy,
            feature_ring_occupancy,
            restarts: self.workers.iter().map(|w| w.restarts).sum(),
            bucket_batches: self.bucket_batches.clone(),
        }
    }
}
