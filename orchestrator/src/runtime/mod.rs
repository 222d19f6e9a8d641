//! The runtime: one orchestrator feeding planned batches through shared-memory rings to pinned
//! worker processes, supervising them, and journaling every committed step.
//!
//! The main loop owns every piece of run state (slots, leases, workers, plan cursor); threads only
//! forward messages to it (worker IPC readers, the control socket). Workers pull: an idle target
//! gets the next batch in plan order, drafters get features in plan order, and the loop commits
//! steps strictly in plan order. A worker that dies or hangs has its leases reclaimed (its batch
//! goes back to the front of the queue) and is restarted with backoff.

mod commit;
mod config;
pub mod control;
pub(crate) mod dflash_stage;
pub mod dispatch;
pub mod dry_run;
pub mod eval;
mod feeder;
mod handlers;
pub mod journal;
pub mod launch_plan;
pub mod memory;
pub mod metrics;
mod node_run;
pub mod nodes;
mod progress;
pub mod resume;
pub mod run_lock;
pub mod spec;
mod supervisor;
pub mod topology;
pub mod torch_engine;
pub mod workers;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dflash_common::dflash::NonFinite;
use dflash_common::ring::{Ring, SlotMeta};
use dflash_common::wire::{BatchId, Event, Group, Job, Role};
use ipc_channel::ipc::IpcSender;

use crate::planner::{EpochPlan, Planner};

pub use config::{PlannerSettings, RunConfig};
use dispatch::Dispatch;
use feeder::{SYNTHETIC_VOCAB, Tokens};
use journal::{Entry, JournalWriter};
pub use launch_plan::launch;
pub use run_lock::{RunLock, lock_run_dir, remove_recorded_segments};
use spec::Device;

/// Why a run could not start or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Bad options or input, found before anything started.
    #[error("{0}")]
    Invalid(String),
    /// The run started and failed.
    #[error("{0}")]
    Failed(String),
}

/// What a run did, for the closing line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub steps: u64,
    pub tokens: u64,
    pub seconds: f64,
    pub restarts: u64,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// `stop` request.
    Stopped,
    /// SIGINT or SIGTERM.
    Interrupted,
}

/// Messages to the main loop.
pub enum Input {
    Worker {
        worker: u32,
        incarnation: u64,
        event: WorkerInput,
    },
    Control(control::Pending),
    /// From the link to the run's other nodes.
    Node(nodes::NodeEvent),
}

pub enum WorkerInput {
    Connected(IpcSender<Job>),
    Event(Event),
    Gone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WorkerState {
    Starting,
    Ready,
    Busy,
    Restarting,
    Failed,
    Stopped,
}

impl WorkerState {
    fn name(self) -> &'static str {
        match self {
            WorkerState::Starting => "starting",
            WorkerState::Ready => "ready",
            WorkerState::Busy => "busy",
            WorkerState::Restarting => "restarting",
            WorkerState::Failed => "failed",
            WorkerState::Stopped => "stopped",
        }
    }
}

struct Worker {
    id: u32,
    role: Role,
    device: Device,
    cpus: Vec<usize>,
    incarnation: u64,
    process: Option<workers::Process>,
    jobs: Option<IpcSender<Job>>,
    state: WorkerState,
    last_seen: Instant,
    started: Instant,
    batches_done: u64,
    restarts: u64,
    /// Times of unrequested exits, for the restart budget.
    crashes: VecDeque<Instant>,
    last_exit: Option<String>,
    restart_at: Option<Instant>,
    /// Stop after the current job, then start again (a `restart` without --force).
    restart_when_idle: bool,
    /// The next exit was asked for: restart at once, without counting it.
    exit_requested: bool,
    /// Since when the worker has been ready and idle.
    ready_since: Instant,
    /// Why the worker is being killed as hung (prefixed to its exit reason).
    hung: Option<String>,
    /// The job it is working on: since when, and which batch of the epoch.
    job: Option<(Instant, usize)>,
    /// A drafter's report of where its weights stand (plan position), this process.
    resumed: Option<u64>,
    /// A data-parallel drafter killed because another left the group (not a crash of its own).
    stopped_with_group: bool,
}

struct Run {
    config: RunConfig,
    run_dir: PathBuf,
    run_id: String,
    journal: JournalWriter,
    planner: Planner,
    tokens: Tokens,
    epoch: u32,
    plan: EpochPlan,
    step_base: u64,
    checksums: Vec<u32>,
    /// Per batch of the epoch, what its target worker found not finite in its features.
    nonfinite: Vec<Option<String>>,
    /// Slots, leases and the plan-order cursors of the current epoch.
    dispatch: Dispatch,
    /// Batches of every epoch journaled so far.
    epoch_sizes: Vec<u64>,
    /// A drafter resumed at this plan position: the pipeline is drained, then repositioned.
    rewind_to: Option<u64>,
    /// The live drafter has reported where its weights stand.
    drafter_resumed: bool,
    /// Why the run cannot count as completed (the drafter died while stopping).
    final_checkpoint_lost: Option<String>,
    metrics: metrics::Metrics,
    /// Plan position where this session started (for its rate).
    session_start: u64,
    last_progress: Instant,
    /// The progress line on a terminal (hidden otherwise: lines are printed instead).
    bar: indicatif::ProgressBar,
    committed_total: u64,
    tokens_committed: u64,
    input: Ring,
    features: Ring,
    workers: Vec<Worker>,
    launch: workers::Launch,
    to_loop: mpsc::Sender<Input>,
    started: Instant,
    stopping: Option<Outcome>,
    scratch: Vec<u32>,
    monitor: crate::observe::monitor::Background,
    /// Per batch of the epoch: the drafter's wait before it, when its job was sent, its compute.
    timing: Vec<(f64, Option<Instant>, f64)>,
    /// Commits of the last 10 s: (time, real tokens, padded tokens).
    window: VecDeque<(Instant, u64, u64)>,
    /// Real and padded tokens committed this session.
    session_tokens: (u64, u64),
    /// Batches dispatched per bucket this epoch.
    bucket_batches: Vec<u64>,
    /// Recent job times of each role (target, drafter), for `--job-timeout auto`.
    job_times: [supervisor::JobTimes; 2],
    /// Served-acceptance evaluations of the checkpoints (`--eval-every`).
    evaluator: Option<eval::Evaluator>,
    /// The link to the run's other nodes, with several.
    link: Option<nodes::Link>,
    /// The drafters' group across nodes broke: the run fails with this once the link had a
    /// moment to say why (a lost node's reason is the better one).
    node_failure: Option<(Instant, String)>,
}

/// How many GPUs NVML reports, or why none.
pub fn gpu_count(nvml: &Result<&'static nvml_wrapper::Nvml, String>) -> Result<u32, String> {
    match nvml {
        Ok(n) => n.device_count().map_err(|e| format!("NVML: {e}")),
        Err(why) => Err(why.clone()),
    }
}

/// NVML, loaded once per process (the monitor keeps using it for the run's life).
pub fn init_nvml() -> Result<&'static nvml_wrapper::Nvml, String> {
    static NVML: std::sync::OnceLock<Result<nvml_wrapper::Nvml, String>> =
        std::sync::OnceLock::new();
    NVML.get_or_init(|| nvml_wrapper::Nvml::init().map_err(|e| format!("NVML not available: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

const TICK: Duration = Duration::from_millis(20);
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long stopping workers may take (a drafter writes its final checkpoint) before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(60);

impl Run {
    fn drive(
        &mut self,
        inbox: &mpsc::Receiver<Input>,
        new_epoch: bool,
    ) -> Result<Outcome, RunError> {
        let signals = crate::signals::count_stop_signals();
        if new_epoch {
            self.journal_epoch()?;
        }
        let mut stop_deadline: Option<Instant> = None;
        loop {
            match inbox.recv_timeout(TICK) {
                Ok(input) => self.handle(input)?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(RunError::Failed("internal channel closed".into()));
                }
            }
            while let Ok(input) = inbox.try_recv() {
                self.handle(input)?;
            }
            let interrupts = signals.load(Ordering::SeqCst);
            if interrupts >= 1 && self.stopping.is_none() {
                tracing::warn!(
                    "interrupted: stopping the workers (a drafter writes its checkpoint); interrupt again to stop at once"
                );
                eprintln!(
                    "\ninterrupted: stopping the workers cleanly; interrupt again to stop at once"
                );
                self.stopping = Some(Outcome::Interrupted);
            }
            if interrupts >= 1
                && let Some(ev) = self.evaluator.as_mut()
                && !ev.cancelled()
            {
                // An evaluation never holds up a stop: its worker is killed.
                ev.cancel();
            }
            if interrupts >= 2 && stop_deadline.is_none_or(|d| d > Instant::now()) {
                // At once: the grace period is over.
                stop_deadline = Some(Instant::now());
            }
            self.supervise()?;
            self.tend_nodes()?;
            if let Some((step, result)) = self.evaluator.as_mut().and_then(eval::Evaluator::poll) {
                self.evaluated(step, result)?;
            }
            if self.monitor.due() {
                self.monitor_request();
            }
            if let Some(tick) = self.monitor.poll() {
                self.monitor_tick(tick);
            }
            if let Some(outcome) = self.stopping {
                let grace = Duration::from_secs_f64(self.config.stop_grace_s);
                let deadline = *stop_deadline.get_or_insert_with(|| Instant::now() + grace);
                // Several nodes stop together at their last checkpoint: a drafter group across
                // nodes cannot agree on a later boundary once one node stops.
                let force = Instant::now() > deadline || self.stops_at_checkpoint(outcome);
                let draining = !force && self.draining();
                if draining {
                    // Data-parallel drafters finish the groups they started, together.
                    self.feed(self.dispatch.step_boundary());
                    self.dispatch();
                }
                self.wind_down(force, draining);
                if self.workers.iter().all(|w| w.process.is_none()) {
                    if outcome == Outcome::Completed
                        && self.final_checkpoint_lost.is_none()
                        && !self.final_evaluation_done()
                    {
                        // The loop goes on meanwhile: control requests and signals are answered.
                        continue;
                    }
                    self.progress(true);
                    self.metrics.flush();
                    let mut outcome = outcome;
                    let reason = self.final_checkpoint_lost.take().inspect(|why| {
                        tracing::warn!("{why}");
                        if outcome == Outcome::Completed {
                            outcome = Outcome::Stopped;
                        }
                    });
                    let status = match outcome {
                        Outcome::Completed => "completed",
                        Outcome::Stopped => "stopped",
                        Outcome::Interrupted => "interrupted",
                    };
                    self.journal
                        .append(&Entry::End {
                            status: status.into(),
                            reason,
                        })
                        .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
                    return Ok(outcome);
                }
                continue;
            }
            self.reposition()?;
            if self.epoch >= self.config.epochs {
                // Every batch is committed (a resume after the last commit): done once the
                // drafter has said where its weights stand, or after replaying up to here.
                if self.rewind_to.is_none()
                    && (self.config.dflash.is_none() || self.drafter_resumed)
                {
                    self.stopping = Some(Outcome::Completed);
                }
                continue;
            }
            self.feed(usize::MAX);
            self.dispatch();
            self.progress(false);
        }
    }

    /// While stopping: whether the data-parallel drafters must first reach a step boundary
    /// (every rank alive and one of them inside a group the others have not finished: a rank
    /// told to stop now would leave the others waiting in a collective).
    fn draining(&self) -> bool {
        let members = self.group_workers();
        !members.is_empty()
            && self.epoch < self.config.epochs
            && self.rewind_to.is_none()
            && self.workers[members]
                .iter()
                .all(|w| w.process.is_some() && w.resumed.is_some())
            && !self.dispatch.drafters_at_step_boundary()
    }

    /// Records an evaluation's outcome; a failed evaluation is reported, not fatal.
    fn evaluated(
        &mut self,
        step: u64,
        result: Result<eval::Outcome, String>,
    ) -> Result<(), RunError> {
        match result {
            Ok(outcome) => self
                .metrics
                .eval(&outcome)
                .map_err(|e| RunError::Failed(format!("{}: {e}", metrics::FILE))),
            Err(why) => {
                tracing::warn!("the evaluation of step {step} failed: {why}");
                self.metrics
                    .event("eval_failed", None, &format!("step {step}: {why}"))
                    .map_err(|e| RunError::Failed(format!("{}: {e}", metrics::FILE)))
            }
        }
    }

    /// At the end of a completed run: the evaluation in flight, then the final checkpoint's
    /// when it was not evaluated yet. Never waits: true once there is nothing left to evaluate
    /// (the loop polls the evaluator meanwhile).
    fn final_evaluation_done(&mut self) -> bool {
        let final_step = self.metrics.last.as_ref().and_then(|m| m["step"].as_u64());
        let (Some(ev), Some(d)) = (self.evaluator.as_mut(), self.config.dflash.as_ref()) else {
            return true;
        };
        if ev.busy() {
            return false;
        }
        if let Some(step) = final_step
            && ev.start(step, &d.checkpoint_dir)
        {
            eprintln!(
                "evaluating the final checkpoint (step {step}): served acceptance on the held-out prompts"
            );
            return false;
        }
        true
    }

    fn journal_epoch(&mut self) -> Result<(), RunError> {
        let batches = self.plan.batches.len() as u64;
        let entry = Entry::Epoch {
            epoch: self.epoch,
            batches,
        };
        self.epoch_sizes.truncate(self.epoch as usize);
        self.epoch_sizes.push(batches);
        self.journal
            .append(&entry)
            .map_err(|e| RunError::Failed(format!("journal: {e}")))
    }

    fn handle(&mut self, input: Input) -> Result<(), RunError> {
        match input {
            Input::Control(pending) => {
                let answer = self.control(pending.request);
                let _ = pending.reply.send(answer);
                Ok(())
            }
            Input::Node(event) => self.node_event(event),
            Input::Worker {
                worker,
                incarnation,
                event,
            } => {
                let Some(w) = self.workers.get_mut(worker as usize) else {
                    return Ok(());
                };
                if w.incarnation != incarnation || w.process.is_none() {
                    return Ok(()); // an earlier process of this worker
                }
                w.last_seen = Instant::now();
                match event {
                    WorkerInput::Connected(jobs) => {
                        w.jobs = Some(jobs);
                        if let Some(p) = w.process.as_mut() {
                            p.connected = true;
                        }
                        Ok(())
                    }
                    WorkerInput::Gone => {
                        // The process is reaped (and its leases reclaimed) by `supervise`.
                        w.jobs = None;
                        Ok(())
                    }
                    WorkerInput::Event(event) => self.worker_event(worker, event),
                }
            }
        }
    }

    fn worker_event(&mut self, id: u32, event: Event) -> Result<(), RunError> {
        let w = &mut self.workers[id as usize];
        match event {
            Event::Heartbeat => {}
            Event::Ready => {
                if w.state == WorkerState::Starting || w.state == WorkerState::Busy {
                    w.state = WorkerState::Ready;
                    w.ready_since = Instant::now();
                }
                let stop = self.stopping.is_some() && !self.draining();
                let w = &mut self.workers[id as usize];
                if w.restart_when_idle || stop {
                    w.restart_when_idle = false;
                    w.exit_requested = true;
                    if let Some(jobs) = &w.jobs {
                        let _ = jobs.send(Job::Stop);
                    }
                    w.state = WorkerState::Stopped;
                }
            }
            Event::Resumed { cursor, step } => {
                if w.role != Role::Drafter {
                    return Err(RunError::Failed(format!(
                        "worker {id} ({}) reported a drafter resume",
                        w.role.name()
                    )));
                }
                tracing::info!(
                    worker = id,
                    cursor,
                    step,
                    "drafter starts at plan position {cursor} (optimiser step {step})"
                );
                w.resumed = Some(cursor);
                let drafters = self.workers.iter().filter(|w| w.role == Role::Drafter);
                let cursors: Vec<Option<u64>> = drafters.map(|w| w.resumed).collect();
                if let Some(other) = cursors.iter().flatten().find(|&&c| c != cursor) {
                    return Err(RunError::Failed(format!(
                        "the data-parallel drafters resumed at different plan positions ({cursor} and {other}): their checkpoints disagree"
                    )));
                }
                self.metrics.reset_group();
                // Data-parallel drafters: once every rank has said where it stands.
                self.drafter_resumed = cursors.iter().all(Option::is_some);
                // Data-parallel drafters always re-enter at the checkpoint: a rank may hold a lease
                // past it (trained, not committable before another rank's batch) that the new
                // processes must be given again.
                if cursor != self.committed_total
                    || self.rewind_to.is_some()
                    || !self.group_workers().is_empty()
                {
                    self.rewind_to = Some(cursor);
                }
            }
            Event::Forwarded {
                id: batch_id,
                nonfinite,
            } => {
                if let Some(what) = nonfinite {
                    let at = format!(
                        "batch {} of epoch {} (step {}), from target worker {id}",
                        batch_id.batch, batch_id.epoch, batch_id.step
                    );
                    let skip = self
                        .config
                        .dflash
                        .as_ref()
                        .is_some_and(|d| d.on_nonfinite == NonFinite::Skip);
                    if !skip {
                        return Err(RunError::Failed(format!(
                            "{what} in {at} (--on-nonfinite stop; resume with --on-nonfinite skip to skip such steps)"
                        )));
                    }
                    tracing::warn!("{what} in {at}: the drafter skips its step");
                    if let Some(slot) = self.nonfinite.get_mut(batch_id.batch as usize) {
                        *slot = Some(format!("{what} (target worker {id})"));
                    }
                }
                self.dispatch.forwarded(id as usize).map_err(|_| {
                    RunError::Failed(format!(
                        "worker {id} reported a forward it was not given ({batch_id:?})"
                    ))
                })?;
                w.batches_done += 1;
                self.job_done(id as usize);
            }
            Event::Trained {
                id: batch_id,
                checksum,
                metrics,
            } => {
                let batch = self.dispatch.trained(id as usize).map_err(|_| {
                    RunError::Failed(format!(
                        "worker {id} reported training it was not given ({batch_id:?})"
                    ))
                })?;
                w.batches_done += 1;
                self.job_done(id as usize);
                if checksum != self.checksums[batch] {
                    return Err(RunError::Failed(format!(
                        "corrupt batch {batch} of epoch {}: drafter saw checksum {checksum:08x}, the orchestrator wrote {:08x}",
                        self.epoch, self.checksums[batch]
                    )));
                }
                if let Some(t) = self.timing.get_mut(batch) {
                    t.2 = t.1.map_or(0.0, |at| at.elapsed().as_secs_f64());
                }
                if let Some(m) = metrics {
                    let tokens = self.plan.batches[batch].real_tokens;
                    let group = self.group_of(batch);
                    let line = self
                        .metrics
                        .add(batch_id.epoch, batch_id.step, group, tokens, &m)
                        .map_err(|e| RunError::Failed(format!("{}: {e}", metrics::FILE)))?;
                    self.stepped_line(batch_id, line)?;
                }
                self.commit_ready()?;
            }
            Event::Stepped {
                id: batch_id,
                update,
            } => {
                self.dispatch.stepped(id as usize).map_err(|_| {
                    RunError::Failed(format!(
                        "worker {id} reported a step it was not given ({batch_id:?})"
                    ))
                })?;
                self.job_done(id as usize);
                let group = Group::of(
                    u64::from(batch_id.batch),
                    u64::from(batch_id.batch) + 1,
                    self.config.planner.accum,
                );
                let line = self
                    .metrics
                    .add_update(batch_id.epoch, batch_id.step, group, &update)
                    .map_err(|e| RunError::Failed(format!("{}: {e}", metrics::FILE)))?;
                self.stepped_line(batch_id, line)?;
                // Another node's last batch of the epoch waits for this step.
                self.commit_ready()?;
            }
            Event::Failed { id: batch, reason } => {
                return Err(RunError::Failed(format!(
                    "worker {id} failed{}: {reason}",
                    batch
                        .map(|b| format!(" on batch {} of epoch {}", b.batch, b.epoch))
                        .unwrap_or_default()
                )));
            }
        }
        Ok(())
    }

    /// Asks the monitor thread for a reading of the run's GPUs and worker processes.
    fn monitor_request(&mut self) {
        use crate::observe::gpu::GpuOwner;
        let gpus: Vec<(u32, GpuOwner)> = self
            .workers
            .iter()
            .filter_map(|w| match w.device {
                Device::Gpu(g) => Some((
                    g,
                    GpuOwner {
                        worker: w.id,
                        role: w.role.name(),
                    },
                )),
                Device::Cpu(_) => None,
            })
            .collect();
        let processes: Vec<(u32, &'static str, u32)> = self
            .workers
            .iter()
            .filter_map(|w| Some((w.id, w.role.name(), w.process.as_ref()?.pid)))
            .collect();
        self.monitor.request(gpus, processes);
    }

    /// Writes a reading of the monitor and any warning it calls for.
    fn monitor_tick(&mut self, tick: crate::observe::monitor::Tick) {
        for warning in &tick.warnings {
            tracing::warn!("{warning}");
            let _ = self.metrics.event("warning", None, warning);
        }
        if let Err(e) = self.metrics.monitor(&tick.gpus, &tick.processes) {
            tracing::warn!("{}: {e}", metrics::FILE);
        }
        if let Some(p) = &self.metrics.prom {
            for w in &self.workers {
                let labels = crate::observe::prom::WorkerLabels {
                    worker: w.id.to_string(),
                    role: w.role.name().into(),
                };
                p.worker_up
                    .get_or_create(&labels)
                    .set(if w.process.is_some() { 1.0 } else { 0.0 });
                p.worker_batches
                    .get_or_create(&labels)
                    .set(w.batches_done as f64);
                p.worker_restarts
                    .get_or_create(&labels)
                    .set(w.restarts as f64);
            }
        }
    }

    /// The accumulation group of batch `batch` of the epoch.
    fn group_of(&self, batch: usize) -> Group {
        Group::of(
            batch as u64,
            self.plan.batches.len() as u64,
            self.config.planner.accum,
        )
    }

    /// An optimiser step's metrics line, once its group is complete: a skipped step is
    /// journaled, and a checkpoint due for evaluation is evaluated.
    fn stepped_line(
        &mut self,
        id: BatchId,
        line: Option<serde_json::Value>,
    ) -> Result<(), RunError> {
        let Some(line) = line else { return Ok(()) };
        let step = line["step"].as_u64().unwrap_or(0);
        if let Some(reason) = line["skipped"].as_str() {
            self.journal
                .append(&Entry::SkippedStep {
                    step,
                    epoch: id.epoch,
                    batch: u64::from(id.batch),
                    reason: reason.to_owned(),
                })
                .map_err(|e| RunError::Failed(format!("journal: {e}")))?;
        }
        if let (Some(ev), Some(d)) = (self.evaluator.as_mut(), self.config.dflash.as_ref())
            && line["checkpoint"].as_bool() == Some(true)
            && ev.due(step)
            && ev.start(step, &d.checkpoint_dir)
        {
            tracing::info!("evaluating the checkpoint of step {step}");
        }
        Ok(())
    }

    fn batch_id(&self, batch: usize) -> BatchId {
        BatchId {
            epoch: self.epoch,
            batch: batch as u32,
            step: self.step_base + batch as u64,
        }
    }

    /// Hands work to idle workers: targets get queued batches in plan order, drafters get
    /// features in plan order.
    fn dispatch(&mut self) {
        if self.rewind_to.is_some() {
            return;
        }
        for i in 0..self.workers.len() {
            let w = &self.workers[i];
            if w.state != WorkerState::Ready || w.jobs.is_none() || w.restart_when_idle {
                continue;
            }
            let job = match w.role {
                Role::Target => {
                    let Some(job) = self.dispatch.lease_forward(i) else {
                        continue;
                    };
                    let bucket = usize::from(self.plan.batches[job.batch].bucket);
                    if self.bucket_batches.len() <= bucket {
                        self.bucket_batches.resize(bucket + 1, 0);
                    }
                    self.bucket_batches[bucket] += 1;
                    // The target writes the features under this generation.
                    self.features.publish(
                        job.feature.slot,
                        job.feature.generation,
                        SlotMeta::default(),
                    );
                    self.job_sent(i, job.batch);
                    Job::Forward {
                        id: self.batch_id(job.batch),
                        input: job.input,
                        feature: job.feature,
                    }
                }
                Role::Drafter => {
                    if !self.group_workers().is_empty() && !self.drafter_resumed {
                        continue; // data-parallel drafters start once all stand at one place
                    }
                    let Some(job) = self.dispatch.lease_train(i) else {
                        if let Some(last) = self.dispatch.lease_step(i) {
                            self.job_sent(i, last);
                            let job = Job::Step {
                                id: self.batch_id(last),
                                group: self.group_of(last),
                            };
                            self.send_job(i, job);
                        }
                        continue;
                    };
                    let batch = job.batch;
                    if let Some(t) = self.timing.get_mut(batch) {
                        *t = (
                            self.workers[i].ready_since.elapsed().as_secs_f64(),
                            Some(Instant::now()),
                            0.0,
                        );
                    }
                    self.job_sent(i, batch);
                    Job::Train {
                        id: self.batch_id(batch),
                        feature: job.feature,
                        checksum: self.checksums[batch],
                        nonfinite: self.nonfinite.get(batch).cloned().flatten(),
                        group: self.group_of(batch),
                    }
                }
            };
            self.send_job(i, job);
        }
    }

    /// Sends worker `i` its job: it is busy until it answers.
    fn send_job(&mut self, i: usize, job: Job) {
        let w = &mut self.workers[i];
        w.state = WorkerState::Busy;
        if let Some(jobs) = &w.jobs
            && jobs.send(job).is_err()
        {
            // Lost: `supervise` reaps it and reclaims the lease.
            w.jobs = None;
        }
    }

    /// Puts a worker's leased work back for others.
    fn reclaim(&mut self, i: usize) {
        self.dispatch.reclaim(i);
        self.workers[i].job = None;
    }
}
