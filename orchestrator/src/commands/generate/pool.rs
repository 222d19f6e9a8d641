//! The generating workers: one `dflash-worker --generate` per device, pinned, in its own process
//! group and dying with this process. Workers pull: an idle one gets the next batch. A worker
//! that dies or overruns its job deadline is killed, its batch goes back to the front of the
//! queue and it is restarted, within a restart budget; its batch is decoded again from the
//! start, so the output does not depend on who decoded it.
//!
//! Not every failure is worth a restart. A worker that ends by itself with an error before any
//! batch was answered failed to load the model or read its request (a truncated weights file, a
//! bad checkpoint): a restart would fail the same way, so the command fails at once with its
//! reason. A worker that answers out of turn (another batch, a line that is no answer) breaks
//! the protocol, which fails the command too. Errors quote the worker's last lines.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dflash_common::eval::{GenerateDone, GenerateJob};

use crate::commands::eval::worker_output::{Line, LogTail, last_words, read_line};
use crate::runtime::spec::Device;
use crate::runtime::workers::{available_cpus, bind_to_parent, cpus_for, exit_reason};

/// Restarts allowed per worker before the command fails.
pub const RESTARTS: u32 = 3;

enum Message {
    Done(usize, u64, GenerateDone),
    /// Its output ended (None), or held a line that is no answer (why).
    Gone(usize, u64, Option<String>),
}

struct Slot {
    device: Device,
    cpus: Vec<usize>,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    /// The last bytes of its log, and the thread reading it.
    log: LogTail,
    log_reader: Option<std::thread::JoinHandle<()>>,
    incarnation: u64,
    restarts: u32,
    /// The batch it decodes, its rows, and since when.
    job: Option<(u64, usize, Instant)>,
}

/// The workers and the batches they owe.
pub struct Pool {
    binary: PathBuf,
    /// The request as one JSON line, the first a worker reads on stdin.
    request: String,
    /// The torch engine's interpreter, where it serves (for the CUDA libraries' folders).
    python: Option<PathBuf>,
    slots: Vec<Slot>,
    tx: mpsc::Sender<Message>,
    rx: mpsc::Receiver<Message>,
    job_timeout: Duration,
    /// The longest answer line a worker may print (see [`crate::commands::eval::worker_output`]).
    max_line: usize,
    /// Whether any worker has answered a batch: the model loads.
    answered: bool,
}

impl Pool {
    /// Starts one worker per device, loading the model of `request` (one JSON line); an answer
    /// line longer than `max_line` bytes is a fault.
    pub fn start(
        binary: PathBuf,
        request: String,
        python: Option<PathBuf>,
        devices: &[Device],
        job_timeout: Duration,
        max_line: usize,
    ) -> Result<Self, String> {
        let available = available_cpus();
        let (tx, rx) = mpsc::channel();
        let mut pool = Self {
            binary,
            request,
            python,
            slots: devices
                .iter()
                .enumerate()
                .map(|(i, &device)| Slot {
                    device,
                    cpus: cpus_for(i, devices.len(), &available),
                    child: None,
                    stdin: None,
                    log: LogTail::default(),
                    log_reader: None,
                    incarnation: 0,
                    restarts: 0,
                    job: None,
                })
                .collect(),
            tx,
            rx,
            job_timeout,
            max_line,
            answered: false,
        };
        for i in 0..pool.slots.len() {
            pool.spawn(i)?;
        }
        Ok(pool)
    }

    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let slot = &mut self.slots[i];
        slot.incarnation += 1;
        let mut command = Command::new(&self.binary);
        crate::runtime::workers::device_env(
            &mut command,
            match slot.device {
                Device::Gpu(g) => Some(g),
                Device::Cpu(_) => None,
            },
            self.python.as_deref(),
        );
        command
            .args(["--generate", "-"])
            .env(
                "RAYON_NUM_THREADS",
                std::env::var("RAYON_NUM_THREADS")
                    .unwrap_or_else(|_| slot.cpus.len().max(1).to_string()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        bind_to_parent(&mut command, &slot.cpus);
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        slot.stdin = child.stdin.take();
        slot.child = Some(child);
        // Its log, bounded, for the error message when it fails.
        slot.log = LogTail::default();
        slot.log_reader = Some(slot.log.follow(stderr));
        // The request first: no request file exists for anyone to read or replace. A worker dead
        // already is seen by its reader thread.
        if let Some(stdin) = slot.stdin.as_mut()
            && writeln!(stdin, "{}", self.request)
                .and_then(|()| stdin.flush())
                .is_err()
        {
            slot.stdin = None;
        }
        let (tx, incarnation, max) = (self.tx.clone(), slot.incarnation, self.max_line);
        std::thread::spawn(move || {
            let mut stdout = BufReader::new(stdout);
            loop {
                let message = match read_line(&mut stdout, max) {
                    Line::Text(line) => match serde_json::from_str::<GenerateDone>(&line) {
                        Ok(done) => Message::Done(i, incarnation, done),
                        Err(e) => Message::Gone(
                            i,
                            incarnation,
                            Some(format!(
                                "printed {:?}: {e}",
                                crate::format::clip(&line, 200)
                            )),
                        ),
                    },
                    Line::Closed => Message::Gone(i, incarnation, None),
                    Line::Bad(why) => Message::Gone(i, incarnation, Some(why)),
                };
                let last = !matches!(message, Message::Done(..));
                if tx.send(message).is_err() || last {
                    return;
                }
            }
        });
        Ok(())
    }

    /// Kills worker `i` and reaps it: its exit status, or None when it was gone already.
    fn kill(&mut self, i: usize) -> Option<ExitStatus> {
        let slot = &mut self.slots[i];
        slot.stdin = None;
        let mut child = slot.child.take()?;
        let _ = child.kill();
        child.wait().ok()
    }

    /// Worker `i`'s reason (its last words) and the lines of its log before it, once its log
    /// has ended (or two seconds have passed: a child of its own may hold it open).
    fn last_words(&mut self, i: usize) -> (String, String) {
        let slot = &mut self.slots[i];
        if let Some(reader) = slot.log_reader.take() {
            let since = Instant::now();
            while !reader.is_finished() && since.elapsed() < Duration::from_secs(2) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        last_words(&slot.log.text())
    }

    /// A worker broke the protocol: it is killed and the command fails with `why` and its log.
    fn fault(&mut self, i: usize, why: &str) -> String {
        self.kill(i);
        let (_, before) = self.last_words(i);
        format!(
            "generate worker {i} ({}) {why}{before}",
            self.slots[i].device
        )
    }

    /// Decodes every batch of `queue` (`job(batch)` builds its job), handing each finished one
    /// to `commit` in batch order. Stops cleanly (workers killed, nothing committed after) when
    /// `stop` is set.
    pub fn run(
        &mut self,
        mut queue: VecDeque<u64>,
        job: impl Fn(u64) -> GenerateJob,
        mut commit: impl FnMut(u64, Vec<Vec<u32>>) -> Result<(), String>,
        stop: &AtomicBool,
    ) -> Result<bool, String> {
        let mut next = queue.iter().copied().min().unwrap_or(0);
        let total = queue.len();
        let mut committed = 0;
        let mut finished: BTreeMap<u64, Vec<Vec<u32>>> = BTreeMap::new();
        while committed < total {
            if stop.load(Ordering::SeqCst) {
                return Ok(false);
            }
            for i in 0..self.slots.len() {
                if self.slots[i].job.is_some() || self.slots[i].stdin.is_none() {
                    continue;
                }
                let Some(batch) = queue.pop_front() else {
                    break;
                };
                let job = job(batch);
                let line = serde_json::to_string(&job).map_err(|e| e.to_string())?;
                let slot = &mut self.slots[i];
                slot.job = Some((batch, job.prompts.len(), Instant::now()));
                let stdin = slot.stdin.as_mut().expect("checked");
                if writeln!(stdin, "{line}")
                    .and_then(|()| stdin.flush())
                    .is_err()
                {
                    // Dead already: its Gone message brings the batch back.
                    self.slots[i].stdin = None;
                }
            }
            for i in 0..self.slots.len() {
                if let Some((batch, _, since)) = self.slots[i].job
                    && since.elapsed() > self.job_timeout
                    && self.slots[i].child.is_some()
                {
                    tracing::warn!(
                        "generate worker {i} overran its job deadline ({:?}) on batch {batch}: killing it",
                        self.job_timeout
                    );
                    self.kill(i);
                }
            }
            match self.rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Message::Done(i, inc, done)) => {
                    if inc != self.slots[i].incarnation {
                        continue;
                    }
                    match self.slots[i].job {
                        Some((batch, rows, _))
                            if batch == done.batch && rows == done.outputs.len() =>
                        {
                            self.slots[i].job = None;
                            self.answered = true;
                            finished.insert(done.batch, done.outputs);
                        }
                        Some((batch, rows, _)) if batch == done.batch => {
                            return Err(self.fault(
                                i,
                                &format!(
                                    "answered batch {batch} with {} outputs for its {rows} rows",
                                    done.outputs.len()
                                ),
                            ));
                        }
                        Some((batch, ..)) => {
                            return Err(self.fault(
                                i,
                                &format!("answered batch {} where {batch} was due", done.batch),
                            ));
                        }
                        None => {
                            return Err(self.fault(
                                i,
                                &format!("answered batch {} when none was due", done.batch),
                            ));
                        }
                    }
                }
                Ok(Message::Gone(i, inc, bad)) => {
                    if inc != self.slots[i].incarnation {
                        continue;
                    }
                    if let Some(why) = bad {
                        return Err(self.fault(i, &why));
                    }
                    // None: this process killed it already (past its job deadline).
                    let status = self.kill(i);
                    let (reason, before) = self.last_words(i);
                    let how = status.map_or_else(|| "was stopped".to_owned(), exit_reason);
                    let slot = &mut self.slots[i];
                    let owed = match slot.job.take() {
                        Some((batch, ..)) => {
                            queue.push_front(batch);
                            format!(" owing batch {batch}")
                        }
                        None => String::new(),
                    };
                    // Ended by itself (an exit code, not a signal), before any batch was
                    // answered: the model or the request cannot be loaded, and would not be on
                    // a restart either.
                    if !self.answered && status.is_some_and(|s| s.code().is_some()) {
                        return Err(format!(
                            "generate worker {i} ({}) {how}{owed} before any batch was done (not restarted: it would fail the same way): {reason}{before}",
                            slot.device
                        ));
                    }
                    slot.restarts += 1;
                    if slot.restarts > RESTARTS {
                        return Err(format!(
                            "generate worker {i} ({}) failed {} times; last: {how}{owed}: {reason}{before}",
                            slot.device, slot.restarts
                        ));
                    }
                    tracing::warn!(
                        "generate worker {i} ({}) {how}{owed}: {reason}; restarting it",
                        slot.device
                    );
                    self.spawn(i)?;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err("lost every generate worker".into());
                }
            }
            while let Some(outputs) = finished.remove(&next) {
                commit(next, outputs)?;
                committed += 1;
                next += 1;
            }
        }
        Ok(true)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for i in 0..self.slots.len() {
            self.kill(i);
        }
    }
}
