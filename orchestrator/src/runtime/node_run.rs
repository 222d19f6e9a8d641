//! A run's side of the link to its other nodes (see [`super::nodes`]): their messages, this
//! node's status for node 0, and the run's end when another node stops, fails or is lost.

use std::time::{Duration, Instant};

use super::nodes::{Message, NodeEvent};
use super::{Outcome, Run, RunError};

/// What a node stopped by another's failure tells its user.
pub(super) const RELAUNCH: &str = "this node stops at its last checkpoint; once every node is back, relaunch each with the same command and --resume";

/// How long a broken drafter group waits for the link to name a lost node.
const LINK_GRACE: Duration = Duration::from_secs(2);

impl Run {
    pub(super) fn node_event(&mut self, event: NodeEvent) -> Result<(), RunError> {
        let Some(link) = self.link.as_mut() else {
            return Ok(());
        };
        match event {
            NodeEvent::Message(node, Message::Status { status }) => {
                link.status.insert(node, (Instant::now(), status));
            }
            NodeEvent::Message(_, Message::Alive) => {}
            NodeEvent::Message(node, Message::Done) => {
                link.done.insert(node);
            }
            NodeEvent::Message(node, Message::Stop { why }) => {
                if self.stopping.is_none() {
                    tracing::warn!(
                        "node {node} stops the run ({why}): every node stops at its last checkpoint"
                    );
                    let _ = self
                        .metrics
                        .event("node_stop", None, &format!("node {node}: {why}"));
                    self.stopping = Some(Outcome::Stopped);
                }
            }
            NodeEvent::Message(node, Message::Failed { why }) => {
                return Err(RunError::Failed(format!(
                    "node {node} failed ({why}): {RELAUNCH}"
                )));
            }
            NodeEvent::Closed(node, why) => {
                if !link.done.contains(&node) && self.stopping.is_none() {
                    return Err(RunError::Failed(format!(
                        "node {node} is lost ({why}): {RELAUNCH}"
                    )));
                }
            }
            NodeEvent::Message(node, other) => {
                tracing::warn!("node {node} sent {other:?} mid-run: ignored");
            }
        }
        Ok(())
    }

    /// Once a tick: this node's status to node 0 (node 0's keepalive to the others); a drafter
    /// group broken across nodes ends the run once the link had its moment.
    pub(super) fn tend_nodes(&mut self) -> Result<(), RunError> {
        if self.link.as_mut().is_some_and(|l| l.tick_due()) {
            // The status is taken with the link in place: it names this node.
            let rank = self.link.as_ref().map_or(0, |l| l.rank);
            let status = (rank != 0).then(|| self.status());
            if let Some(link) = self.link.as_mut() {
                link.tick(|| status.unwrap_or_default());
            }
        }
        match &self.node_failure {
            Some((at, why)) if Instant::now() >= *at => Err(RunError::Failed(why.clone())),
            _ => Ok(()),
        }
    }

    /// Whether this stop kills the workers at once (several nodes, a stop before the end: the
    /// nodes resume from their last checkpoint); tells the other nodes, once.
    pub(super) fn stops_at_checkpoint(&mut self, outcome: Outcome) -> bool {
        let Some(link) = self.link.as_mut() else {
            return false;
        };
        if outcome == Outcome::Completed {
            return false;
        }
        link.stop(&format!("node {} stopped", link.rank));
        true
    }

    /// A drafter of this node left the group of every node's drafters: it cannot re-form while
    /// the other nodes run, so the run ends (see [`Run::tend_nodes`]).
    pub(super) fn node_group_broken(&mut self, rank: u32, id: u32, reason: &str) {
        if self.stopping.is_some() {
            return;
        }
        self.node_failure.get_or_insert_with(|| {
            (
                Instant::now() + LINK_GRACE,
                format!(
                    "drafter rank {rank} (worker {id}) left the drafters' group of every node ({reason}): {RELAUNCH}"
                ),
            )
        });
    }
}
