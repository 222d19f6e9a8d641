//! Supervision: reaping exited workers, killing hung ones (missed heartbeats, or a job past its
//! deadline), restarting them with backoff within the restart budget, and winding down.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use dflash_common::wire::{Job, Role};

use super::journal::Entry;
use super::{Run, RunError, STARTUP_TIMEOUT, WorkerState, workers};

/// Recent job times of one role, in seconds.
#[derive(Debug, Clone, Default)]
pub struct JobTimes {
    recent: VecDeque<f64>,
    /// The p95 of `recent`, kept current.
    p95: Option<f64>,
}

/// Jobs remembered for the moving p95.
const JOB_WINDOW: usize = 200;
/// `--job-timeout auto`: the floor, and the multiple of the p95.
const AUTO_FLOOR: Duration = Duration::from_secs(120);
const AUTO_FACTOR: f64 = 10.0;

impl JobTimes {
    pub fn record(&mut self, seconds: f64) {
        if self.recent.len() == JOB_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(seconds);
        let mut sorted: Vec<f64> = self.recent.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let at = ((sorted.len() as f64 * 0.95).ceil() as usize).clamp(1, sorted.len()) - 1;
        self.p95 = Some(sorted[at]);
    }

    pub fn p95(&self) -> Option<f64> {
        self.p95
    }
}

pub fn role_index(role: Role) -> usize {
    match role {
        Role::Target => 0,
        Role::Drafter => 1,
    }
}

/// How long a job may run: `--job-timeout SECONDS`, or auto, the larger of 120 s and ten times
/// the role's moving p95 job time (120 s until the first job is done).
pub fn job_deadline(fixed: Option<f64>, times: &JobTimes) -> Duration {
    match fixed {
        Some(seconds) => Duration::from_secs_f64(seconds),
        None => {
            let learned = times.p95().map_or(0.0, |p| AUTO_FACTOR * p);
            AUTO_FLOOR.max(Duration::from_secs_f64(learned.min(1e9)))
        }
    }
}

impl Run {
    /// Reaps exited workers, kills hung ones, restarts with backoff, enforces the budget.
    pub(super) fn supervise(&mut self) -> Result<(), RunError> {
        let now = Instant::now();
        let timeout = Duration::from_secs_f64(self.config.heartbeat_timeout_s);
        for i in 0..self.workers.len() {
            // Hung: no word within the deadline.
            let w = &mut self.workers[i];
            if let Some(p) = &w.process {
                let limit = if p.connected {
                    timeout
                } else {
                    STARTUP_TIMEOUT.max(timeout)
                };
                if now.duration_since(w.last_seen) > limit {
                    tracing::warn!(
                        worker = w.id,
                        "no heartbeat for {:.1} s: killing it",
                        limit.as_secs_f64()
                    );
                    // The first reason found stands (a job deadline may have come first).
                    w.hung.get_or_insert(format!(
                        "missed heartbeats for {:.1} s (hung)",
                        limit.as_secs_f64()
                    ));
                    p.kill();
                    w.last_seen = now;
                    // Killed already: its job deadline must not name another reason.
                    w.job = None;
                }
            }
            // Hung inside a job: heartbeats come from their own thread and stay fresh.
            let w = &mut self.workers[i];
            if let (Some(p), Some((since, batch))) = (&w.process, w.job) {
                let limit = job_deadline(
                    self.config.job_timeout_s,
                    &self.job_times[role_index(w.role)],
                );
                let took = now.duration_since(since);
                if took > limit {
                    let reason = format!(
                        "job timeout after {:.1} s (batch {batch} of epoch {})",
                        took.as_secs_f64(),
                        self.epoch
                    );
                    tracing::warn!(worker = w.id, "{reason}: killing it");
                    w.hung.get_or_insert(reason);
                    w.job = None;
                    p.kill();
                }
            }
            // Exited.
            let exited = match w.process.as_mut().map(|p| p.child.try_wait()) {
                Some(Ok(Some(status))) => Some(status),
                _ => None,
            };
            if let Some(status) = exited {
                let process = self.workers[i].process.take().expect("checked above");
                process.abandon();
                let reason = workers::exit_reason(status);
                let w = &mut self.workers[i];
                let reason = match w.hung.take() {
                    Some(hung) => format!("{hung}; {reason}"),
                    None => reason,
                };
                w.jobs = None;
                w.last_exit = Some(reason.clone());
                self.journal
                    .append(&Entry::WorkerExit {
                        worker: w.id,
                        pid: process.pid,
                        reason: reason.clone(),
                    })
                    .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
                self.reclaim(i);
                let w = &self.workers[i];
                let _ = self
                    .metrics
                    .event("worker_exit", Some((w.id, w.role.name())), &reason);
                let w = &mut self.workers[i];
                w.resumed = None;
                let clean_stop = self.stopping.is_some() && status.success();
                if w.role == Role::Drafter && !clean_stop {
                    self.break_drafter_group(i, &reason)?;
                }
                let w = &mut self.workers[i];
                if w.role == Role::Drafter {
                    self.drafter_resumed = false;
                    if self.stopping.is_some() && self.config.dflash.is_some() && !status.success()
                    {
                        self.final_checkpoint_lost = Some(if self.link.is_some() {
                            // Several nodes stop at once (see `Run::stops_at_checkpoint`).
                            format!(
                                "every node stopped its drafters at once, at their last checkpoint: relaunch each node with `launch --resume`; they replay from there ({reason})"
                            )
                        } else {
                            format!(
                                "the drafter ({reason}) may not have written its final checkpoint: `launch --resume` replays from its latest checkpoint and finishes"
                            )
                        });
                    }
                }
                if self.stopping.is_some() {
                    w.state = WorkerState::Stopped;
                    continue;
                }
                if std::mem::take(&mut w.exit_requested) {
                    w.restart_at = Some(now);
                } else {
                    w.crashes.push_back(now);
                    let window = Duration::from_secs_f64(self.config.restart_window_s);
                    while w
                        .crashes
                        .front()
                        .is_some_and(|&t| now.duration_since(t) > window)
                    {
                        w.crashes.pop_front();
                    }
                    if w.crashes.len() as u32 > self.config.max_restarts {
                        w.state = WorkerState::Failed;
                        return Err(RunError::Failed(format!(
                            "worker {} ({}, {}) exceeded --max-restarts {} within {:.0} s; last exit: {reason}",
                            w.id,
                            w.role.name(),
                            w.device,
                            self.config.max_restarts,
                            self.config.restart_window_s
                        )));
                    }
                    let backoff = Duration::from_millis(100u64 << (w.crashes.len() - 1).min(6));
                    tracing::warn!(worker = w.id, %reason, "worker exited; restarting in {} ms", backoff.as_millis());
                    w.restart_at = Some(now + backoff);
                }
                w.state = WorkerState::Restarting;
            }
            // Due to (re)start (data-parallel drafters start together, below).
            let w = &self.workers[i];
            let in_group = self.launch.drafters.as_ref().and_then(|g| g.rank_of(w.id));
            if self.stopping.is_none()
                && in_group.is_none()
                && w.process.is_none()
                && w.restart_at.is_some_and(|t| now >= t)
            {
                self.start_worker(i, now)?;
            }
        }
        self.start_drafter_group(now)
    }

    /// Starts worker `i`'s next process.
    fn start_worker(&mut self, i: usize, now: Instant) -> Result<(), RunError> {
        let w = &mut self.workers[i];
        w.restart_at = None;
        w.incarnation += 1;
        if w.incarnation > 1 {
            w.restarts += 1;
        }
        let process = workers::spawn(
            w.id,
            w.incarnation,
            w.role,
            w.device,
            &w.cpus,
            &self.launch,
            &self.to_loop,
        )
        .map_err(|e| RunError::Failed(format!("cannot start worker {}: {e}", w.id)))?;
        self.journal
            .append(&Entry::WorkerStart {
                worker: w.id,
                role: w.role.name().into(),
                pid: process.pid,
            })
            .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
        let _ = self.metrics.event(
            "worker_start",
            Some((w.id, w.role.name())),
            &format!("pid {} on {}", process.pid, w.device),
        );
        w.process = Some(process);
        w.state = WorkerState::Starting;
        w.last_seen = now;
        w.started = now;
        Ok(())
    }

    /// The workers of the data-parallel drafter group, if the run has one.
    pub(super) fn group_workers(&self) -> std::ops::Range<usize> {
        match &self.launch.drafters {
            Some(g) => g.first as usize..(g.first + g.ranks) as usize,
            None => 0..0,
        }
    }

    /// Data-parallel drafters start together, once every one of them is down and due, at a
    /// rendezvous of their own (a stale group can never be joined).
    fn start_drafter_group(&mut self, now: Instant) -> Result<(), RunError> {
        let members = self.group_workers();
        if self.stopping.is_some() || members.is_empty() || self.node_failure.is_some() {
            return Ok(());
        }
        let group = &self.workers[members.clone()];
        let due = group
            .iter()
            .all(|w| w.process.is_none() && w.restart_at.is_some_and(|t| now >= t));
        if !due {
            return Ok(());
        }
        if let Some(g) = self.launch.drafters.as_mut() {
            g.next_start().map_err(|e| {
                RunError::Failed(format!(
                    "cannot ready the drafters' rendezvous ({}): {e}",
                    g.rendezvous()
                ))
            })?;
        }
        for i in members {
            self.start_worker(i, now)?;
        }
        Ok(())
    }

    /// Data-parallel drafter `i` left the process group (`reason`): the others cannot go on (a
    /// collective waits for it), so they are stopped too, and the whole group restarts from the
    /// last checkpoint and replays the batches after it. Journaled once, naming the rank.
    fn break_drafter_group(&mut self, i: usize, reason: &str) -> Result<(), RunError> {
        let members = self.group_workers();
        if !members.contains(&i) || self.workers[i].stopped_with_group {
            self.workers[i].stopped_with_group = false;
            return Ok(());
        }
        let rank = i - members.start;
        let id = self.workers[i].id;
        if let Some(share) = self.launch.drafters.as_ref().and_then(|g| g.nodes) {
            self.node_group_broken(share.base + rank as u32, id, reason);
            return Ok(());
        }
        let mut stopped = Vec::new();
        for j in members.clone() {
            let peer = &mut self.workers[j];
            if j == i || peer.stopped_with_group {
                continue;
            }
            if let Some(p) = &peer.process {
                p.kill();
                peer.stopped_with_group = true;
                peer.exit_requested = true;
                peer.job = None;
                peer.hung.get_or_insert(format!(
                    "stopped with the drafter group (rank {rank}, worker {id}, left it)"
                ));
                stopped.push(peer.id);
            }
        }
        self.journal
            .append(&Entry::DrafterGroupRestart {
                worker: id,
                rank: rank as u32,
                reason: reason.to_owned(),
            })
            .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
        let message = format!(
            "drafter rank {rank} (worker {id}) left the process group ({reason}): stopping drafters {stopped:?}; the group restarts from its last checkpoint"
        );
        tracing::warn!("{message}");
        let _ = self.metrics.event(
            "drafter_group_restart",
            Some((id, Role::Drafter.name())),
            &message,
        );
        Ok(())
    }

    /// While stopping: idle workers are told to stop (once data-parallel drafters stand at a
    /// step boundary: `draining` until then); past the grace period, everyone is killed.
    pub(super) fn wind_down(&mut self, force: bool, draining: bool) {
        for w in &mut self.workers {
            let Some(p) = &w.process else { continue };
            if force {
                p.kill();
            } else if draining {
                continue;
            } else if w.state == WorkerState::Ready
                || w.state == WorkerState::Starting && w.jobs.is_some()
            {
                w.exit_requested = true;
                if let Some(jobs) = &w.jobs {
                    let _ = jobs.send(Job::Stop);
                }
                w.state = WorkerState::Stopped;
            } else if w.jobs.is_none() && p.connected {
                p.kill();
            }
        }
    }

    /// Kills whatever is left (on any way out of `drive`).
    pub(super) fn shutdown(&mut self) {
        for w in &mut self.workers {
            if let Some(mut p) = w.process.take() {
                p.kill();
                let _ = p.child.wait();
                p.abandon();
            }
        }
    }

    /// A job was sent to worker `i`: its deadline starts now.
    pub(super) fn job_sent(&mut self, i: usize, batch: usize) {
        self.workers[i].job = Some((Instant::now(), batch));
    }

    /// Worker `i` answered its job: its time joins the role's statistics.
    pub(super) fn job_done(&mut self, i: usize) {
        let w = &mut self.workers[i];
        if let Some((since, _)) = w.job.take() {
            self.job_times[role_index(w.role)].record(since.elapsed().as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_deadline_is_ten_p95s_above_its_floor() {
        let mut times = JobTimes::default();
        assert_eq!(job_deadline(None, &times), AUTO_FLOOR);
        for _ in 0..100 {
            times.record(1.0);
        }
        assert_eq!(
            job_deadline(None, &times),
            AUTO_FLOOR,
            "10 x 1 s is under the floor"
        );
        for _ in 0..100 {
            times.record(30.0);
        }
        // Half the window at 30 s: the p95 is 30 s.
        assert_eq!(times.p95(), Some(30.0));
        assert_eq!(job_deadline(None, &times), Duration::from_secs(300));
        assert_eq!(
            job_deadline(Some(2.5), &times),
            Duration::from_secs_f64(2.5)
        );
    }

    #[test]
    fn the_window_forgets_old_jobs() {
        let mut times = JobTimes::default();
        for _ in 0..JOB_WINDOW {
            times.record(50.0);
        }
        for _ in 0..JOB_WINDOW {
            times.record(1.0);
        }
        assert_eq!(times.p95(), Some(1.0));
    }
}
