//! Messages between the orchestrator and its workers (over ipc-channel). Versioned with the
//! protocol number in [`Hello`]: both sides are built together, but a stale worker binary is
//! refused rather than misread.

use ipc_channel::ipc::{IpcReceiver, IpcSender};
use serde::{Deserialize, Serialize};

/// Bumped on any change to these messages or to the ring layout.
pub const PROTOCOL: u32 = 1;

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
    },
    /// Finish and exit.
    Stop,
}

/// Worker -> orchestrator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Event {
    /// Alive, whatever it is doing (sent from a thread of its own).
    Heartbeat,
    /// Ready for a job (after start-up and after each job).
    Ready,
    /// Features of the batch are in the feature slot.
    Forwarded { id: BatchId },
    /// The step is trained; the orchestrator commits it.
    Trained { id: BatchId, checksum: u32 },
    /// The job could not be done: the run fails with this reason.
    Failed { id: Option<BatchId>, reason: String },
}
