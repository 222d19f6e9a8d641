//! The generating workers: one `dflash-worker --generate` per device, pinned, in its own process
//! group and dying with this process. Workers pull: an idle one gets the next batch. A worker
//! that dies or overruns its job deadline is killed, its batch goes back to the front of the
//! queue and it is restarted, within a restart budget; its batch is decoded again from the
//! start, so the output does not depend on who decoded it.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dflash_common::eval::{GenerateDone, GenerateJob};

use crate::runtime::spec::Device;
use crate::runtime::workers::{available_cpus, bind_to_parent, cpus_for, exit_reason};

/// Restarts allowed per worker before the command fails.
pub const RESTARTS: u32 = 3;

enum Message {
    Done(usize, u64, GenerateDone),
    Gone(usize, u64, String),
}

struct Slot {
    device: Device,
    cpus: Vec<usize>,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    incarnation: u64,
    restarts: u32,
    job: Option<(u64, Instant)>,
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
}

impl Pool {
    /// Starts one worker per device, loading the model of `request` (one JSON line).
    pub fn start(
        binary: PathBuf,
        request: String,
        python: Option<PathBuf>,
        devices: &[Device],
        job_timeout: Duration,
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
                    incarnation: 0,
                    restarts: 0,
                    job: None,
                })
                .collect(),
            tx,
            rx,
            job_timeout,
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
        let mut stderr = child.stderr.take().expect("piped");
        slot.stdin = child.stdin.take();
        slot.child = Some(child);
        // The request first: no request file exists for anyone to read or replace. A worker dead
        // already is seen by its reader threads.
        if let Some(stdin) = slot.stdin.as_mut()
            && writeln!(stdin, "{}", self.request)
                .and_then(|()| stdin.flush())
                .is_err()
        {
            slot.stdin = None;
        }
        let (tx, incarnation) = (self.tx.clone(), slot.incarnation);
        std::thread::spawn(move || {
            // Its last words, for the error message when it dies.
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            let last = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim_start_matches("error: ")
                .to_owned();
            let _ = tx.send(Message::Gone(i, incarnation, last));
        });
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<GenerateDone>(&line) {
                    Ok(done) => {
                        if tx.send(Message::Done(i, incarnation, done)).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Message::Gone(
                            i,
                            incarnation,
                            format!("printed {line:?}: {e}"),
                        ));
                        break;
                    }
                }
            }
        });
        Ok(())
    }

    fn kill(&mut self, i: usize) -> Option<String> {
        let slot = &mut self.slots[i];
        slot.stdin = None;
        let child = slot.child.take()?;
        let mut child = child;
        let _ = child.kill();
        child.wait().ok().map(exit_reason)
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
                let line = serde_json::to_string(&job(batch)).map_err(|e| e.to_string())?;
                let slot = &mut self.slots[i];
                slot.job = Some((batch, Instant::now()));
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
                if let Some((batch, since)) = self.slots[i].job
                    && since.elapsed() > self.job_timeout
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
                    let slot = &mut self.slots[i];
                    if inc == slot.incarnation && slot.job.map(|j| j.0) == Some(done.batch) {
                        slot.job = None;
                        finished.insert(done.batch, done.outputs);
                    }
                }
                Ok(Message::Gone(i, inc, last)) => {
                    if inc != self.slots[i].incarnation {
                        continue;
                    }
                    let status = self.kill(i).unwrap_or_else(|| "was stopped".into());
                    let slot = &mut self.slots[i];
                    if let Some((batch, _)) = slot.job.take() {
                        queue.push_front(batch);
                    }
                    slot.restarts += 1;
                    if slot.restarts > RESTARTS {
                        return Err(format!(
                            "generate worker {i} ({}) failed {} times; last: {status}: {last}",
                            slot.device, slot.restarts
                        ));
                    }
                    tracing::warn!(
                        "generate worker {i} ({}) {status}: {last}; restarting it",
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
