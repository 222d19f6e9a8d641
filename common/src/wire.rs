//! Messages between the orchestrator and its workers (over ipc-channel). Versioned with the
//! protocol number in [`Hello`]: both sides are built together, but a stale worker binary is
//! refused rather than misread.

use ipc_channel::ipc::{IpcReceiver, IpcSender};
use serde::{Deserialize, Serialize};

/// Bumped on any change to these messages or to the ring layout.
pub const PROTOCOL: u32 = 5;

/// What a worker does in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Runs the (frozen) target model forward: input ring -> feature ring.
    Target,
    /// Trains the drafter on features, in plan order.
    Drafter,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Target => "target",
            Role::Drafter => "drafter",
        }
    }
}

/// The first message of a worker: its channels.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    pub worker: u32,
    pub pid: u32,
    /// Where the orchestrator sends jobs.
    pub jobs: IpcSender<Job>,
    /// Where the worker sends its events.
    pub events: IpcReceiver<Event>,
}

/// A slot of a ring with the generation the reader must find in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRef {
    pub slot: u32,
    pub generation: u64,
}

/// Identity of one batch of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchId {
    pub epoch: u32,
    /// Position in the epoch's plan.
    pub batch: u32,
    /// Step counter across epochs.
    pub step: u64,
}

/// Where a batch stands in its gradient-accumulation group (the planner's windows of `--accum`
/// batches; the last group of an epoch may be shorter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    /// 0-based position of the batch in its group.
    pub index: u32,
    /// Batches in the group.
    pub len: u32,
}

impl Group {
    /// The group of `batch` in an epoch of `batches` batches with windows of `accum`.
    pub fn of(batch: u64, batches: u64, accum: u32) -> Group {
        let accum = u64::from(accum.max(1));
        let start = batch - batch % accum;
        Group {
            index: (batch - start) as u32,
            len: accum.min(batches - start) as u32,
        }
    }

    pub fn is_last(self) -> bool {
        self.index + 1 == self.len
    }

    /// With `ranks` data-parallel drafters (rank `index % ranks` trains a batch): whether no
    /// later batch of the group goes to this batch's rank, so that the rank steps after it.
    pub fn is_last_of_rank(self, ranks: u32) -> bool {
        self.index + ranks.max(1) >= self.len
    }
}

/// Orchestrator -> worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Job {
    /// Read the batch in `input`, write its features into `feature`.
    Forward {
        id: BatchId,
        input: SlotRef,
        feature: SlotRef,
    },
    /// Train on the features in `feature`; `checksum` is the orchestrator's checksum of the
    /// batch's tokens.
    Train {
        id: BatchId,
        feature: SlotRef,
        checksum: u32,
        group: Group,
        /// What the target worker reported not finite in these features (`--on-nonfinite skip`):
        /// the drafter skips the step without checking them again.
        nonfinite: Option<String>,
    },
    /// Data-parallel drafters: the accumulation group ending with batch `id` holds no batch for
    /// this drafter rank (a short last group of an epoch); it takes part in the group's
    /// optimiser step with no gradient of its own.
    Step { id: BatchId, group: Group },
    /// Finish and exit (a drafter writes its final checkpoint first).
    Stop,
}

/// An optimiser update, reported with the batch that completed its accumulation group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Update {
    /// Optimiser steps taken, this one included.
    pub step: u64,
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Mean loss over the group's micro-batches.
    pub loss: f64,
    /// A checkpoint of this step was queued.
    pub checkpoint: bool,
    /// The step was skipped (`--on-nonfinite skip`): what was not finite, and where.
    pub skipped: Option<String>,
    /// Seconds the step spent summing the data-parallel drafters' gradients (0 with one).
    pub reduce_s: f64,
}

/// What training one micro-batch measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainMetrics {
    pub loss: f64,
    /// Per block position: correct predictions and positions counted.
    pub correct: Vec<u32>,
    pub counted: Vec<u32>,
    /// Anchors (blocks) trained.
    pub anchors: u32,
    /// Seconds of compute.
    pub compute_s: f64,
    pub update: Option<Update>,
    /// DFlash2's selector: its weighted mean cross-entropy and, per block position, its right
    /// picks (of the same positions counted). Always written: the IPC encoding is not
    /// self-describing, so no field may be left out.
    pub selector: Option<SelectorMetrics>,
}

/// What DFlash2's candidate selector learned in a micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectorMetrics {
    pub loss: f64,
    pub correct: Vec<u32>,
}

/// Worker -> orchestrator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Event {
    /// Alive, whatever it is doing (sent from a thread of its own).
    Heartbeat,
    /// A drafter with state: training continues from plan position `cursor` (batches of the run
    /// trained into its weights; 0 for fresh weights), restored from the checkpoint of optimiser
    /// step `step`. Sent once, before the first `Ready`.
    Resumed { cursor: u64, step: u64 },
    /// Ready for a job (after start-up and after each job).
    Ready,
    /// Features of the batch are in the feature slot.
    Forwarded {
        id: BatchId,
        /// Where the features hold a NaN or an infinity (the first target layer that does).
        nonfinite: Option<String>,
    },
    /// The step is trained; the orchestrator commits it.
    Trained {
        id: BatchId,
        checksum: u32,
        metrics: Option<TrainMetrics>,
    },
    /// A [`Job::Step`] is done.
    Stepped { id: BatchId, update: Update },
    /// The job could not be done: the run fails with this reason.
    Failed { id: Option<BatchId>, reason: String },
}

/// Receives the next message, retrying when a signal interrupted the wait (a handled signal, e.g.
/// the runtime's own SIGSEGV handler, must not read as a lost peer).
pub fn recv<T: for<'de> Deserialize<'de> + Serialize>(
    from: &IpcReceiver<T>,
) -> Result<T, ipc_channel::IpcError> {
    loop {
        match from.recv() {
            Err(ipc_channel::IpcError::Io(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape of a trained step's metrics crosses the IPC channel whole, with the DFlash2
    /// selector's figures and without them (a field left out of the encoding would shift every
    /// field after it).
    #[test]
    fn train_metrics_cross_the_channel_with_and_without_the_selector() {
        let (tx, rx) = ipc_channel::ipc::channel::<Event>().unwrap();
        let metrics = |selector| TrainMetrics {
            loss: 1.5,
            correct: vec![0, 3],
            counted: vec![0, 4],
            anchors: 2,
            compute_s: 0.25,
            update: Some(Update {
                step: 7,
                lr: 1e-3,
                grad_norm: 0.5,
                loss: 1.5,
                checkpoint: false,
                skipped: None,
                reduce_s: 0.0,
            }),
            selector,
        };
        let id = BatchId {
            epoch: 1,
            batch: 2,
            step: 3,
        };
        for selector in [
            None,
            Some(SelectorMetrics {
                loss: 0.7,
                correct: vec![0, 2],
            }),
        ] {
            let sent = metrics(selector);
            tx.send(Event::Trained {
                id,
                checksum: 9,
                metrics: Some(sent.clone()),
            })
            .unwrap();
            tx.send(Event::Ready).unwrap();
            match recv(&rx).unwrap() {
                Event::Trained {
                    metrics: Some(got),
                    checksum: 9,
                    ..
                } => assert_eq!(format!("{got:?}"), format!("{sent:?}")),
                other => panic!("{other:?}"),
            }
            assert!(matches!(recv(&rx).unwrap(), Event::Ready));
        }
    }

    #[test]
    fn groups_follow_the_planner_windows() {
        assert_eq!(Group::of(0, 10, 4), Group { index: 0, len: 4 });
        assert_eq!(Group::of(7, 10, 4), Group { index: 3, len: 4 });
        assert!(Group::of(7, 10, 4).is_last());
        assert_eq!(Group::of(8, 10, 4), Group { index: 0, len: 2 });
        assert_eq!(Group::of(9, 10, 4), Group { index: 1, len: 2 });
        assert!(Group::of(9, 10, 4).is_last());
        assert_eq!(Group::of(5, 6, 1), Group { index: 0, len: 1 });
        assert_eq!(Group::of(5, 6, 0), Group { index: 0, len: 1 });
    }
}
