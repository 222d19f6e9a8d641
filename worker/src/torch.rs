//! The torch engine's side of a worker: this process keeps the loop, the heartbeats, the rings
//! and the descriptors; a Python child (`dflash_orch.serve`, started as
//! [`dflash_common::python`] says) computes. One JSON request per line goes to its stdin and one
//! answer per line comes back on its stdout; its stderr is the worker's log. Every request carries an `id` (a count from 1) and its answer names it.
//!
//! The child never reads a ring header: for each batch this side tells it which byte range of the
//! mapped feature ring to fill (computed here from the ring's layout), and publishes the slot
//! itself once the answer says the bytes are there.
//!
//! A child that dies (a segfault, the OOM killer, a SIGKILL) takes the worker with it: the
//! orchestrator sees a dead worker and restarts it, exactly as for a candle worker. A job the
//! child refuses or fails (a Python exception) fails the run with the child's reason, as a candle
//! stage error does. A child that breaks the protocol (a line that is not UTF-8 or not JSON, a
//! line over [`MAX_ANSWER`], an answer to another request) is killed at once and fails the run
//! with that reason. A hung child hangs the job, and the orchestrator's job deadline kills the
//! worker; the child dies with it (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dflash_common::dflash::{DflashSettings, DrafterRank, TorchRuntime};
use dflash_common::ring::{Ring, features_offset};
use dflash_common::wire::SlotRef;
use serde_json::{Value, json};

use std::ops::Range;

use crate::checkpoint::{self, Snapshot, TrainingState};
use crate::dflash::{SlotFeatures, Stepped};
use crate::model::drafter::{DrafterConfig, MicroBatchLoss};
use crate::stage::{Stage, publish_features, read_target_batch};

/// How the child's error starts when the data-parallel drafters' rendezvous failed
/// (`dflash_orch.serve.RENDEZVOUS_FAILED`).
pub const RENDEZVOUS_FAILED: &str = "the drafters' rendezvous failed";

/// The version of the pipe protocol (`dflash_orch.PROTOCOL`). 2: requests carry an `id` that
/// their answer names.
pub const PROTOCOL: u64 = 2;

/// The longest answer line the child may send, its newline not counted (as the node link's
/// lines): answers are a few hundred bytes, so a longer line is a fault, never buffered whole.
pub const MAX_ANSWER: usize = 4 << 20;

/// How long a child whose output ended may take to exit by itself before it is killed: its own
/// exit status (a Python exception, a segfault) says more than our SIGKILL.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// The Python compute child.
pub struct TorchChild {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The id of the last request sent (ids count from 1).
    last_id: u64,
    /// The protocol fault the child was killed for: every later request fails with it.
    fault: Option<String>,
}

impl TorchChild {
    /// Starts `dflash_orch.serve` as `runtime` says, in `cwd` (the run directory): it imports
    /// nothing from this process's working directory (see [`dflash_common::python`]).
    pub fn start(runtime: &TorchRuntime, cwd: &Path) -> Result<Self, String> {
        let (mut command, _) = runtime.module_command("dflash_orch.serve", cwd);
        command
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let parent = std::process::id();
        // SAFETY: only async-signal-safe calls between fork and exec (prctl, getppid, _exit).
        unsafe {
            command.pre_exec(move || {
                // The child dies with this worker, whichever way the worker ends.
                nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGKILL);
                if nix::libc::getppid() as u32 != parent {
                    nix::libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(|e| {
            format!(
                "cannot start the torch engine's Python {}: {e}",
                runtime.python.display()
            )
        })?;
        let stdin = child.stdin.take().ok_or("the child has no stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("the child has no stdout")?);
        Ok(Self {
            child,
            stdin,
            stdout,
            last_id: 0,
            fault: None,
        })
    }

    /// Sends `request` (a JSON object; its `id` is set here) and returns the answer's fields;
    /// `Err` with the child's reason when it could not do the job, or with the protocol fault
    /// the child was killed for. A child that is gone ends this process (see the module's
    /// comment).
    pub fn request(&mut self, mut request: Value) -> Result<Value, String> {
        if let Some(fault) = &self.fault {
            return Err(fault.clone());
        }
        self.last_id += 1;
        let id = self.last_id;
        request["id"] = id.into();
        let mut line = serde_json::to_string(&request).map_err(|e| e.to_string())?;
        line.push('\n');
        if let Err(e) = self
            .stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
        {
            self.gone(&format!("writing to it failed: {e}"));
        }
        let line = match read_line_bounded(&mut self.stdout, MAX_ANSWER) {
            Ok(line) => line,
            Err(LineFault::Closed) => self.gone("closed its output"),
            Err(LineFault::Cut) => self.gone("closed its output in the middle of an answer"),
            Err(LineFault::Io(e)) => self.gone(&format!("reading from it failed: {e}")),
            Err(LineFault::TooLong) => {
                return Err(self.refuse(&format!(
                    "sent an answer line longer than {} MiB",
                    MAX_ANSWER >> 20
                )));
            }
            Err(LineFault::NotUtf8) => return Err(self.refuse("sent a line that is not UTF-8")),
        };
        let answer = parse_answer(&line).map_err(|why| self.refuse(&why))?;
        match answer.id {
            Some(n) if n == id => answer.result,
            Some(n) => Err(self.refuse(&format!("answered request {n} where {id} was due"))),
            // A package older than protocol 2 answers no id: its refusal of our protocol (the
            // answer to `init`) is the clearest reason there is.
            None => Err(self.refuse(&format!(
                "answered without a request id (a dflash_orch package older than protocol {PROTOCOL}): {}",
                match answer.result {
                    Err(why) => clip(&why, 400).to_owned(),
                    Ok(_) => clip(&line, 200).to_owned(),
                }
            ))),
        }
    }

    /// The child broke the protocol while alive: it is killed and reaped at once, and the run
    /// fails with the reason (returned, and said in the log now). It is running code that does
    /// not speak this worker's protocol (another package, a corrupted process): a restarted
    /// worker would start the same code, so a restart would only repeat the fault.
    fn refuse(&mut self, how: &str) -> String {
        let status = stop(&mut self.child, Duration::ZERO);
        let fault = format!("the torch child {how}; {status}");
        eprintln!("error: {fault}");
        self.fault = Some(fault.clone());
        fault
    }

    /// The pipe to the child is gone (it died, or closed its end): the child is reaped (killed
    /// when it does not exit by itself within [`EXIT_GRACE`]) and this worker exits as if it
    /// had crashed itself, so that the orchestrator restarts it. A dead child is what the OOM
    /// killer or a segfault leave, which a fresh worker may well not meet again; the
    /// orchestrator's restart budget ends a child that dies every time.
    fn gone(&mut self, how: &str) -> ! {
        let status = stop(&mut self.child, EXIT_GRACE);
        eprintln!("error: the torch child {how}; {status}");
        std::process::exit(i32::from(dflash_common::exit_code::FAILURE));
    }
}

/// Ends `child`: waits up to `grace` for it to exit by itself, then kills it; reaps it either
/// way (never waits on a live child) and says how it ended.
fn stop(child: &mut Child, grace: Duration) -> String {
    let since = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return format!("it exited ({status})"),
            Ok(None) if since.elapsed() < grace => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => break,
            Err(e) => return format!("it cannot be waited for: {e}"),
        }
    }
    let _ = child.kill();
    match child.wait() {
        Ok(status) => format!("it was still running and was killed ({status})"),
        Err(e) => format!("it was killed, and cannot be waited for: {e}"),
    }
}

/// Why a line could not be read.
#[derive(Debug)]
pub enum LineFault {
    /// End of input before the line began.
    Closed,
    /// End of input inside the line.
    Cut,
    /// Longer than allowed: not read further.
    TooLong,
    NotUtf8,
    Io(std::io::Error),
}

/// Reads one line of at most `max` bytes (its newline not counted), never buffering more.
pub fn read_line_bounded(reader: &mut impl BufRead, max: usize) -> Result<String, LineFault> {
    let mut buf = Vec::new();
    let n = reader
        .take(max as u64 + 1)
        .read_until(b'\n', &mut buf)
        .map_err(LineFault::Io)?;
    if n == 0 {
        return Err(LineFault::Closed);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > max {
        return Err(LineFault::TooLong);
    } else {
        return Err(LineFault::Cut);
    }
    String::from_utf8(buf).map_err(|_| LineFault::NotUtf8)
}

impl Drop for TorchChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answer read: the request it names, and its fields when `ok`, else the child's error.
#[derive(Debug)]
pub struct Answer {
    pub id: Option<u64>,
    pub result: Result<Value, String>,
}

/// An answer line; `Err` when it is not an answer at all (a protocol fault).
pub fn parse_answer(line: &str) -> Result<Answer, String> {
    let value: Value = serde_json::from_str(line.trim()).map_err(|e| {
        format!(
            "sent an answer that is not JSON ({e}): {:?}",
            clip(line, 200)
        )
    })?;
    let id = match value.get("id") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            format!(
                "sent an answer whose id is not a count: {:?}",
                clip(line, 200)
            )
        })?),
    };
    let result = match value.get("ok").and_then(Value::as_bool) {
        Some(true) => Ok(value),
        Some(false) => Err(value
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("the torch engine failed without a reason")
            .to_owned()),
        None => {
            return Err(format!(
                "sent an answer without \"ok\": {:?}",
                clip(line, 200)
            ));
        }
    };
    Ok(Answer { id, result })
}

fn clip(s: &str, n: usize) -> &str {
    let mut end = s.len().min(n);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The target stage on the torch engine.
pub struct TargetStage {
    child: TorchChild,
    /// The target layer of each hidden state in a token's features (see `feature_layers`).
    layer_ids: Vec<usize>,
    vocab: u32,
    budget: u64,
}

impl TargetStage {
    /// Starts the child and loads the target there; `feature_ring` is the ring it maps.
    pub fn new(settings: &DflashSettings, feature_ring: &Path) -> Result<Self, String> {
        let runtime = settings.torch.as_ref().ok_or(
            "the torch engine was chosen, but the settings say no Python (a stale dflash.json?)",
        )?;
        let mut child = TorchChild::start(runtime, run_dir(settings))?;
        let threads = threads();
        let init = child.request(json!({
            "op": "init",
            "protocol": PROTOCOL,
            "role": "target",
            "model": settings.target_model,
            "layer_ids": settings.target_layer_ids,
            "final": settings.distill().is_some(),
            "dtype": settings.dtype.name(),
            "feature_dtype": settings.feature_dtype.name(),
            "token_budget": settings.token_budget,
            "packing": if settings.target_packing { "on" } else { "off" },
            "ring": feature_ring,
            "threads": threads,
        }))?;
        let field = |name: &str| {
            init.get(name)
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("the torch engine's init answer has no {name}: {init}"))
        };
        let layers = field("layers")? as usize;
        let vocab = u32::try_from(field("vocab")?).map_err(|e| e.to_string())?;
        tracing::info!(
            "torch target: {} layers, hidden {}, {} attention, {}, on {}, ring {} (torch {}, transformers {})",
            layers,
            field("hidden")?,
            init["attention"].as_str().unwrap_or("?"),
            init["packing"].as_str().unwrap_or("rows of one length"),
            init["device"].as_str().unwrap_or("?"),
            init["ring"].as_str().unwrap_or("?"),
            init["torch"].as_str().unwrap_or("?"),
            init["transformers"].as_str().unwrap_or("?"),
        );
        Ok(Self {
            child,
            layer_ids: crate::dflash::feature_layers(settings, layers),
            vocab,
            budget: settings.token_budget,
        })
    }
}

impl Stage for TargetStage {
    fn forward(
        &mut self,
        input: &Ring,
        at: SlotRef,
        features: &mut Ring,
        out: SlotRef,
    ) -> Result<Option<String>, String> {
        let batch = read_target_batch(input, at, features, out, self.vocab)?;
        let from = features_offset(self.budget);
        let room = features
            .data_bytes()
            .checked_sub(from)
            .ok_or("the feature slot is smaller than its header")?;
        let answer = self.child.request(json!({
            "op": "forward",
            "tokens": batch.tokens,
            "lengths": batch.lengths,
            "offset": features.data_file_offset(out.slot) + from as u64,
            "bytes": room,
        }))?;
        let nonfinite = match answer.get("nonfinite") {
            None | Some(Value::Null) => None,
            Some(j) => {
                let layer = j
                    .as_u64()
                    .and_then(|j| self.layer_ids.get(j as usize))
                    .ok_or_else(|| format!("the torch engine named no layer {j}"))?;
                Some(crate::dflash::nonfinite_features(*layer))
            }
        };
        // SYNC POINT: the child's writes to the shared mapping happened before it wrote its
        // answer, which this process has read; `publish_features` publishes them with the batch.
        publish_features(features, out, &batch, self.budget);
        Ok(nonfinite)
    }
}

/// The drafter's compute on the torch engine: the child holds the weights, the gradients and
/// AdamW's moments; this process decides everything else (see [`crate::dflash::DrafterStage`]).
///
/// Weights and moments cross between the two as a checkpoint's two tensor files: the initial
/// weights (drawn here from the run's seed, as the candle drafter draws them) or a checkpoint's
/// go in at start through a directory of this process's own beside the checkpoints
/// (`.engine.tmp-PID`); for each checkpoint the child writes them into the checkpoint's staging
/// directory, which the writer completes and publishes (one write of the tensors).
pub struct DrafterEngine {
    child: TorchChild,
    exchange: std::path::PathBuf,
    /// The checkpoints' directory: the child writes a checkpoint's tensors into its staging
    /// directory there ([`checkpoint::staging_dir`]).
    checkpoints: std::path::PathBuf,
    /// The drafter's weights (name, shape): what a checkpoint the child wrote must hold.
    expected: Vec<(String, Vec<usize>)>,
    /// Seconds the last step spent summing the ranks' gradients.
    reduce_s: f64,
}

impl DrafterEngine {
    /// Starts the child and loads the drafter of `config` there, with the weights and moments of
    /// `resume` or the run's initial weights.
    pub fn new(
        settings: &DflashSettings,
        config: &DrafterConfig,
        resume: Option<&Snapshot>,
        feature_ring: &Path,
        rank: &DrafterRank,
    ) -> Result<Self, String> {
        let runtime = settings.torch.as_ref().ok_or(
            "the torch engine was chosen, but the settings say no Python (a stale dflash.json?)",
        )?;
        let exchange = settings
            .checkpoint_dir
            .join(format!(".engine.tmp-{}", std::process::id()));
        let fresh;
        let (weights, moments, adam_t) = match resume {
            Some(s) => (&s.weights, Some(&s.moments), s.state.adam_t),
            None => {
                fresh = config.initial_weights(settings.seed);
                (&fresh, None, 0)
            }
        };
        let zeros;
        let moments = match moments {
            Some(m) => m,
            None => {
                zeros = weights
                    .iter()
                    .map(|(n, s, v)| (n.clone(), s.clone(), vec![0.0; v.len()], vec![0.0; v.len()]))
                    .collect::<Vec<_>>();
                &zeros
            }
        };
        let _ = std::fs::remove_dir_all(&exchange);
        std::fs::create_dir_all(&exchange)
            .and_then(|()| checkpoint::write_tensors(&exchange, weights, moments))
            .map_err(|e| format!("{}: {e}", exchange.display()))?;
        let mut engine = Self {
            child: TorchChild::start(runtime, run_dir(settings))?,
            exchange,
            checkpoints: settings.checkpoint_dir.clone(),
            expected: config
                .tensors()
                .into_iter()
                .map(|(n, s, _)| (n, s))
                .collect(),
            reduce_s: 0.0,
        };
        let shape = &config.shape;
        let init = engine.child.request(json!({
            "op": "init",
            "protocol": PROTOCOL,
            "role": "drafter",
            "model": settings.target_model,
            "names": config.tensors().into_iter().map(|(n, ..)| n).collect::<Vec<_>>(),
            "shape": {
                "hidden": shape.hidden,
                "intermediate": shape.intermediate,
                "layers": shape.layers,
                "heads": shape.heads,
                "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "rms_eps": shape.rms_eps,
                "rope_theta": shape.rope_theta,
                "vocab": shape.vocab,
            },
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "states": config.target_layer_ids.len(),
            "gamma": settings.gamma,
            "distill": settings.distill(),
            "dpace_alpha": settings.dpace(),
            "dflash2": config.dflash2,
            "sliding_window": config.sliding_window,
            "anchor_chunk": settings.anchor_chunk,
            "compile": settings.drafter_compile,
            "weight_decay": settings.weight_decay,
            "dtype": settings.dtype.name(),
            "feature_dtype": settings.feature_dtype.name(),
            "ring": feature_ring,
            "weights": engine.exchange,
            "adam_t": adam_t,
            "threads": threads(),
            "group": group_request(rank),
        }));
        let _ = std::fs::remove_dir_all(&engine.exchange);
        let init = init?;
        tracing::info!(
            "torch drafter: {} attention, kernels {}, on {}, ring {} (torch {})",
            init["attention"].as_str().unwrap_or("?"),
            init["compile"].as_str().unwrap_or("eager"),
            init["device"].as_str().unwrap_or("?"),
            init["ring"].as_str().unwrap_or("?"),
            init["torch"].as_str().unwrap_or("?"),
        );
        Ok(engine)
    }
}

impl Drop for DrafterEngine {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.exchange);
    }
}

/// The run directory, the torch child's working directory (the checkpoints' parent).
fn run_dir(settings: &DflashSettings) -> &Path {
    settings
        .checkpoint_dir
        .parent()
        .filter(|d| d.is_absolute())
        .unwrap_or(Path::new("/"))
}

/// The process group of data-parallel drafters, for the child's `init` (null: one drafter):
/// a FileStore's path on one node, node 0's address and port with several.
fn group_request(rank: &DrafterRank) -> Value {
    let Some(rendezvous) = rank.rendezvous.as_deref().filter(|_| rank.ranks > 1) else {
        return Value::Null;
    };
    let mut group = json!({
        "rank": rank.rank,
        "world": rank.ranks,
        "timeout_s": rank.timeout_s,
    });
    if let Some(path) = rendezvous.strip_prefix("file:") {
        group["store"] = json!(path);
    } else if let Some((address, port)) = rendezvous.rsplit_once(':') {
        group["address"] = json!(address.trim_start_matches('[').trim_end_matches(']'));
        group["port"] = json!(port.parse::<u16>().unwrap_or(0));
    }
    group
}

/// Threads for the child: the worker's own setting (`RAYON_NUM_THREADS`), else the child's
/// default (0).
fn threads() -> u64 {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
}

fn number(answer: &Value, name: &str) -> Result<f64, String> {
    answer
        .get(name)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("the torch engine's answer has no {name}: {answer}"))
}

fn counts(answer: &Value, name: &str) -> Result<Vec<u32>, String> {
    answer
        .get(name)
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
                .collect()
        })
        .ok_or_else(|| format!("the torch engine's answer has no {name}: {answer}"))
}

impl crate::dflash::DrafterCompute for DrafterEngine {
    fn micro_batch(
        &mut self,
        features: SlotFeatures,
        tokens: &[u32],
        loss_mask: &[u8],
        sequences: &[(Range<usize>, Vec<usize>)],
        accum: usize,
    ) -> Result<MicroBatchLoss, String> {
        let sequences: Vec<Value> = sequences
            .iter()
            .map(|(range, anchors)| json!([range.start, range.len(), anchors]))
            .collect();
        let answer = self.child.request(json!({
            "op": "train",
            "offset": features.file_offset,
            "bytes": features.bytes.len(),
            "tokens": tokens,
            "loss_mask": loss_mask,
            "width": features.width,
            "sequences": sequences,
            "accum": accum,
        }))?;
        let weight = number(&answer, "weight")?;
        Ok(MicroBatchLoss {
            loss: if weight > 0.0 {
                number(&answer, "loss")?
            } else {
                0.0
            },
            weight,
            anchors: number(&answer, "anchors")? as u32,
            correct: counts(&answer, "correct")?,
            counted: counts(&answer, "counted")?,
            selector: match answer.get("selector_loss") {
                None => None,
                Some(_) => Some(dflash_common::wire::SelectorMetrics {
                    loss: if weight > 0.0 {
                        number(&answer, "selector_loss")?
                    } else {
                        0.0
                    },
                    correct: counts(&answer, "selector_correct")?,
                }),
            },
        })
    }

    fn step(&mut self, lr: f64, clip: f64, skip: bool) -> Result<Stepped, String> {
        let answer = self.child.request(json!({
            "op": "step", "lr": lr, "clip": clip, "skip": skip,
        }))?;
        self.reduce_s = answer
            .get("reduce_s")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        if let Some(name) = answer.get("nonfinite").and_then(Value::as_str) {
            return Ok(Stepped::NonFinite(name.to_owned()));
        }
        Ok(match answer.get("grad_norm").and_then(Value::as_f64) {
            Some(grad_norm) => Stepped::Applied { grad_norm },
            None => Stepped::Nothing,
        })
    }

    fn reduce_seconds(&self) -> f64 {
        self.reduce_s
    }

    fn check_replicas(&mut self) -> Result<(), String> {
        self.child.request(json!({"op": "check_replicas"}))?;
        Ok(())
    }

    /// The child writes the checkpoint's tensors into its staging directory itself (checking
    /// every value is finite); this process checks the files' headers and hands the directory to
    /// the writer, which adds `config.json` and `state.json` and publishes it: the tensors cross
    /// the disk once. On failure nothing is left.
    fn snapshot(&mut self, state: TrainingState, config: Value) -> Result<Snapshot, String> {
        let dir = checkpoint::staging_dir(&self.checkpoints, state.step);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let written = self
            .child
            .request(json!({"op": "snapshot", "dir": dir}))
            .and_then(|answer| number(&answer, "adam_t"))
            .and_then(|adam_t| {
                checkpoint::check_tensor_files(&dir, &self.expected)
                    .map(|()| adam_t as u64)
                    .map_err(|e| format!("the torch engine's checkpoint is not the drafter's: {e}"))
            });
        let adam_t = match written {
            Ok(t) => t,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(Snapshot {
            state: TrainingState { adam_t, ..state },
            weights: Vec::new(),
            moments: Vec::new(),
            config,
            written: Some(dir),
        })
    }
}

/// `dflash-worker --eval` and `--generate` on the torch engine: `dflash_orch.decode
/// MODE` decodes, given `request` as its first stdin line and then every further line of this
/// process's stdin (a generate's jobs); its answers go straight to this process's stdout. Fails
/// with the child's last words when it fails, or when it exits before its input ended (the
/// answers it owed never came); a SIGINT or SIGTERM to this process ends the child and returns.
pub fn decode(
    mode: &str,
    request: &impl serde::Serialize,
    runtime: &TorchRuntime,
) -> Result<(), String> {
    // From here a SIGINT or SIGTERM to this worker ends the child (once started) and returns,
    // so that what the caller made for it (the untrained drafter's weights) is removed on the
    // way out.
    let signalled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register_usize(signal, Arc::clone(&signalled), signal as usize);
    }
    let mut line = serde_json::to_string(request).map_err(|e| e.to_string())?;
    line.push('\n');
    // A working directory of its own, removed when the decoder is done: nothing the caller's
    // directory holds is imported or read (the request's paths are absolute).
    let cwd = tempfile::Builder::new()
        .prefix("dflash-decode-")
        .tempdir()
        .map_err(|e| format!("cannot make a private directory for the torch engine: {e}"))?;
    let (mut command, _) = runtime.module_command("dflash_orch.decode", cwd.path());
    command
        .arg(mode)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::inherit())
        // Its log passes through this process, which keeps the last lines for the error
        // message.
        .stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec (prctl).
    unsafe {
        command.pre_exec(|| {
            nix::libc::prctl(nix::libc::PR_SET_PDEATHSIG, nix::libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| {
        format!(
            "cannot start the torch engine's Python {}: {e}",
            runtime.python.display()
        )
    })?;
    let log = StderrTail::forward(child.stderr.take());
    // From here the child is reaped on every return, killed first when it still runs.
    let Some(mut stdin) = child.stdin.take() else {
        let how = stop(&mut child, Duration::ZERO);
        return Err(format!("the torch engine's decoder has no stdin; {how}"));
    };
    if let Err(e) = stdin.write_all(line.as_bytes()) {
        drop(stdin);
        let how = stop(&mut child, EXIT_GRACE);
        return Err(format!(
            "cannot hand the request to the torch engine's decoder ({e}); {how}: {}",
            log.last_words()
        ));
    }
    // The rest of our stdin (a generate's jobs) follows, line by line, until it ends.
    let input_ended = Arc::new(AtomicBool::new(false));
    let ended = Arc::clone(&input_ended);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(mut line) = line else { return };
            line.push('\n');
            if stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.flush())
                .is_err()
            {
                return;
            }
        }
        // Set before `stdin` is dropped: the child sees the end of its input after this.
        ended.store(true, Ordering::SeqCst);
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => {
                let how = stop(&mut child, Duration::ZERO);
                return Err(format!("lost the torch engine's decoder ({e}); {how}"));
            }
        }
        let signal = signalled.load(Ordering::SeqCst);
        if signal != 0 {
            let how = stop(&mut child, Duration::ZERO);
            let name = nix::sys::signal::Signal::try_from(signal as i32)
                .map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_owned());
            return Err(format!(
                "stopped by {name}: the torch engine's decoder was ended; {how}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    decoder_outcome(
        status,
        input_ended.load(Ordering::SeqCst),
        &log.last_words(),
    )
}

/// How a decoder child that exited with `status` ended the command: an error with its last
/// words when it failed, or when it exited normally before its input ended (`input_ended`
/// false), that is without the answers it owed for the jobs still to come.
fn decoder_outcome(status: ExitStatus, input_ended: bool, last_words: &str) -> Result<(), String> {
    if !status.success() {
        return Err(format!(
            "the torch engine's decoder failed ({status}): {last_words}"
        ));
    }
    if !input_ended {
        return Err(format!(
            "the torch engine's decoder exited normally before its input ended, without the \
             answers it owed; its last words: {last_words}"
        ));
    }
    Ok(())
}

/// The most of a decoder's stderr kept for its error message.
const STDERR_KEPT: usize = 16 * 1024;

/// A child's stderr, passed on to this process's stderr as it comes (the worker's log), its
/// last bytes kept for the error message.
struct StderrTail {
    kept: Arc<std::sync::Mutex<Vec<u8>>>,
    done: Arc<AtomicBool>,
}

impl StderrTail {
    fn forward(from: Option<std::process::ChildStderr>) -> Self {
        let kept = Arc::new(std::sync::Mutex::new(Vec::new()));
        let done = Arc::new(AtomicBool::new(false));
        let (k, d) = (Arc::clone(&kept), Arc::clone(&done));
        std::thread::spawn(move || {
            if let Some(mut from) = from {
                let mut buf = [0u8; 8192];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let _ = std::io::stderr().write_all(&buf[..n]);
                    let mut kept = k.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    kept.extend_from_slice(&buf[..n]);
                    if kept.len() > 2 * STDERR_KEPT {
                        let cut = kept.len() - STDERR_KEPT;
                        kept.drain(..cut);
                    }
                }
            }
            d.store(true, Ordering::SeqCst);
        });
        Self { kept, done }
    }

    /// The last line the child printed (clipped), once its stderr has ended or a second has
    /// passed (a grandchild may hold it open).
    fn last_words(&self) -> String {
        let since = Instant::now();
        while !self.done.load(Ordering::SeqCst) && since.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let kept = self
            .kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        last_line(&String::from_utf8_lossy(&kept))
    }
}

/// The last non-empty line of `text`, without an `error: ` prefix, clipped; "it printed
/// nothing" when there is none.
fn last_line(text: &str) -> String {
    match text.lines().rev().map(str::trim).find(|l| !l.is_empty()) {
        Some(line) => clip(line.trim_start_matches("error: "), 400).to_owned(),
        None => "it printed nothing".to_owned(),
    }
}

/// A drafter checkpoint directory of the untrained weights a run of `seed` starts from, for
/// `eval --init-seed` on the torch engine: `config.json` of `drafter` and those weights, in a
/// fresh directory of mode 0700 with an unguessable name under the temporary directory (made by
/// `mkdtemp`: a name another user made first, or a link, is never used), removed on drop. `eval`
/// points this process's `TMPDIR` at a private directory of its own, which it removes however
/// this process ends.
pub struct InitialDrafter(pub std::path::PathBuf);

impl InitialDrafter {
    pub fn write(drafter: &Path, config: &DrafterConfig, seed: u64) -> Result<Self, String> {
        let template = std::env::temp_dir().join("dflash-init-drafter-XXXXXX");
        let dir = nix::unistd::mkdtemp(&template)
            .map_err(|e| format!("cannot make a directory like {}: {e}", template.display()))?;
        let made = Self(dir.clone());
        let weights = config.initial_weights(seed);
        std::fs::copy(drafter.join("config.json"), dir.join("config.json"))
            .and_then(|_| checkpoint::write_tensors(&dir, &weights, &[]))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(made)
    }
}

impl Drop for InitialDrafter {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn answers_are_read_or_refused_with_a_reason() {
        let a = parse_answer("{\"ok\": true, \"nonfinite\": null, \"id\": 3}\n").unwrap();
        assert_eq!(a.id, Some(3));
        assert_eq!(a.result.unwrap()["nonfinite"], Value::Null);
        let a =
            parse_answer("{\"ok\": false, \"error\": \"CUDA out of memory\", \"id\": 4}").unwrap();
        assert_eq!(
            (a.id, a.result.unwrap_err().as_str()),
            (Some(4), "CUDA out of memory")
        );
        let a = parse_answer("{\"ok\": false}").unwrap();
        assert_eq!(a.id, None);
        assert_eq!(
            a.result.unwrap_err(),
            "the torch engine failed without a reason"
        );
        for bad in [
            "",
            "garbage",
            "[1, 2]",
            "{\"ok\": 1}",
            "{\"nonfinite\": 0}",
            "{\"ok\": true, \"id\": -1}",
            "{\"ok\": true, \"id\": \"7\"}",
        ] {
            let e = parse_answer(bad).unwrap_err();
            assert!(e.starts_with("sent an answer"), "{bad:?}: {e}");
        }
        // A long garbage line is quoted briefly, never split inside a character.
        let long = "é".repeat(1000);
        assert!(parse_answer(&long).unwrap_err().len() < 400);
    }

    #[test]
    fn lines_are_read_within_their_bound() {
        let mut r = std::io::Cursor::new(b"{}\n\xff\n12345678\n123456789\nhalf".to_vec());
        assert_eq!(read_line_bounded(&mut r, 8).unwrap(), "{}");
        assert!(matches!(
            read_line_bounded(&mut r, 8),
            Err(LineFault::NotUtf8)
        ));
        assert_eq!(read_line_bounded(&mut r, 8).unwrap(), "12345678");
        assert!(matches!(
            read_line_bounded(&mut r, 8),
            Err(LineFault::TooLong)
        ));
        // Not read past the bound: the rest of that line comes next.
        assert_eq!(read_line_bounded(&mut r, 8).unwrap(), "");
        assert!(matches!(read_line_bounded(&mut r, 8), Err(LineFault::Cut)));
        assert!(matches!(
            read_line_bounded(&mut r, 8),
            Err(LineFault::Closed)
        ));
    }

    #[test]
    fn a_decoder_that_fails_or_leaves_answers_owed_is_an_error_with_its_last_words() {
        let ok = ExitStatus::from_raw(0);
        let failed = ExitStatus::from_raw(1 << 8);
        assert_eq!(decoder_outcome(ok, true, "-"), Ok(()));
        let e = decoder_outcome(failed, true, "ValueError: bad").unwrap_err();
        assert_eq!(
            e,
            "the torch engine's decoder failed (exit status: 1): ValueError: bad"
        );
        let e = decoder_outcome(ok, false, "it printed nothing").unwrap_err();
        assert!(
            e.contains("exited normally before its input ended, without the answers it owed")
                && e.ends_with("it printed nothing"),
            "{e}"
        );
        assert_eq!(
            last_line("a\nerror: ValueError: x\n\n  \n"),
            "ValueError: x"
        );
        assert_eq!(last_line(""), "it printed nothing");
        assert!(last_line(&"é".repeat(1000)).len() <= 400);
    }

    /// A child whose `serve` is a shell script: it answers `init` with `answer` (after `read`),
    /// then does `then` for the next request.
    fn child(dir: &Path, name: &str, answer: &str, then: &str) -> TorchChild {
        let script = dir.join(name);
        std::fs::write(
            &script,
            format!("#!/bin/sh\nread line\nprintf '%s\\n' '{answer}'\nread line\n{then}\nexec sleep 600\n"),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        TorchChild::start(
            &TorchRuntime {
                python: script,
                package_dir: None,
            },
            dir,
        )
        .unwrap()
    }

    #[test]
    fn a_child_that_breaks_the_protocol_is_killed_and_reaped_and_named() {
        let dir = tempfile_dir();
        let init = "{\"ok\": true, \"id\": 1}";
        let cases = [
            (
                "not-utf8",
                "printf '\\377\\376\\n'",
                "sent a line that is not UTF-8",
            ),
            (
                "long",
                "head -c 5000000 /dev/zero | tr '\\0' a",
                "sent an answer line longer than 4 MiB",
            ),
            (
                "other-id",
                "printf '%s\\n' '{\"ok\": true, \"id\": 7}'",
                "answered request 7 where 2 was due",
            ),
            (
                "no-id",
                "printf '%s\\n' '{\"ok\": false, \"error\": \"old package\"}'",
                "answered without a request id (a dflash_orch package older than protocol 2): old package",
            ),
            (
                "not-json",
                "printf 'hello\\n'",
                "sent an answer that is not JSON",
            ),
        ];
        for (name, then, says) in cases {
            let mut c = child(&dir, name, init, then);
            assert_eq!(c.request(json!({"op": "init"})).unwrap()["id"], 1);
            let pid = c.child.id();
            let e = c.request(json!({"op": "forward"})).unwrap_err();
            assert!(
                e.starts_with(&format!("the torch child {says}")),
                "{name}: {e}"
            );
            assert!(
                e.ends_with("; it was still running and was killed (signal: 9 (SIGKILL))"),
                "{name}: {e}"
            );
            // Reaped: no process of that pid is left, not even a zombie.
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists()
                    || std::fs::read_to_string(format!("/proc/{pid}/status"))
                        .is_ok_and(|s| !s.contains(&format!("PPid:\t{}", std::process::id()))),
                "{name}: child {pid} left"
            );
            // Every later request fails with the same fault, without touching the pipe.
            assert_eq!(c.request(json!({"op": "step"})).unwrap_err(), e);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let template = std::env::temp_dir().join("dflash-torch-test-XXXXXX");
        nix::unistd::mkdtemp(&template).unwrap()
    }

    #[test]
    fn the_untrained_drafter_is_written_to_a_private_directory_and_removed_on_drop() {
        let dir = tempfile_dir();
        let config = DrafterConfig {
            shape: dflash_common::dflash::Qwen3Shape {
                hidden: 16,
                intermediate: 32,
                layers: 1,
                heads: 2,
                kv_heads: 1,
                head_dim: 8,
                rms_eps: 1e-6,
                rope_theta: 10_000.0,
                vocab: 40,
            },
            block_size: 4,
            mask_token_id: 1,
            target_layer_ids: vec![0],
            dflash2: None,
            sliding_window: None,
        };
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        let init = InitialDrafter::write(&dir, &config, 0).unwrap();
        let meta = std::fs::symlink_metadata(&init.0).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
        let name = init.0.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("dflash-init-drafter-"), "{name}");
        assert!(!name.ends_with(&std::process::id().to_string()), "{name}");
        assert!(init.0.join("model.safetensors").is_file());
        let path = init.0.clone();
        drop(init);
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
