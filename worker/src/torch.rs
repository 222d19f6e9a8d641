//! The torch engine's side of a worker: this process keeps the loop, the heartbeats, the rings
//! and the descriptors; a Python child (`python -m dflash_orch.serve`) computes. One JSON request
//! per line goes to its stdin and one answer per line comes back on its stdout; its stderr is the
//! worker's log.
//!
//! The child never reads a ring header: for each batch this side tells it which byte range of the
//! mapped feature ring to fill (computed here from the ring's layout), and publishes the slot
//! itself once the answer says the bytes are there.
//!
//! A child that dies (a segfault, the OOM killer, a SIGKILL) takes the worker with it: the
//! orchestrator sees a dead worker and restarts it, exactly as for a candle worker. A job the
//! child refuses or fails (a Python exception) fails the run with the child's reason, as a candle
//! stage error does. A hung child hangs the job, and the orchestrator's job deadline kills the
//! worker; the child dies with it (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Stdio};

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

/// The version of the pipe protocol (`dflash_orch.PROTOCOL`).
pub const PROTOCOL: u64 = 1;

/// The Python compute child.
pub struct TorchChild {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
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
        })
    }

    /// Sends `request` and returns the answer's fields; `Err` with the child's reason when it
    /// could not do the job. A child that is gone ends this process (see the module's comment).
    pub fn request(&mut self, request: &Value) -> Result<Value, String> {
        let mut line = serde_json::to_string(request).map_err(|e| e.to_string())?;
        line.push('\n');
        if let Err(e) = self
            .stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
        {
            self.gone(&format!("writing to it failed: {e}"));
        }
        let mut answer = String::new();
        match self.stdout.read_line(&mut answer) {
            Ok(0) => self.gone("it closed its output"),
            Err(e) => self.gone(&format!("reading from it failed: {e}")),
            Ok(_) => {}
        }
        parse_answer(&answer)
    }

    /// The child is gone: this worker exits as if it had crashed itself, so that the
    /// orchestrator restarts it.
    fn gone(&mut self, how: &str) -> ! {
        let status = self
            .child
            .wait()
            .map_or_else(|e| e.to_string(), |s| s.to_string());
        eprintln!("error: the torch engine's Python child died ({how}; {status})");
        std::process::exit(i32::from(dflash_common::exit_code::FAILURE));
    }
}

impl Drop for TorchChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answer line: its fields when `ok`, else the child's error.
pub fn parse_answer(line: &str) -> Result<Value, String> {
    let value: Value = serde_json::from_str(line.trim()).map_err(|e| {
        format!(
            "the torch engine's answer is not JSON ({e}): {:?}",
            clip(line, 200)
        )
    })?;
    match value.get("ok").and_then(Value::as_bool) {
        Some(true) => Ok(value),
        Some(false) => Err(value
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("the torch engine failed without a reason")
            .to_owned()),
        None => Err(format!(
            "the torch engine's answer has no \"ok\": {:?}",
            clip(line, 200)
        )),
    }
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
        let init = child.request(&json!({
            "op": "init",
            "protocol": PROTOCOL,
            "role": "target",
            "model": settings.target_model,
            "layer_ids": settings.target_layer_ids,
            "final": settings.distill().is_some(),
            "dtype": settings.dtype.name(),
            "feature_dtype": settings.feature_dtype.name(),
            "token_budget": settings.token_budget,
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
            "torch target: {} layers, hidden {}, {} attention on {} (torch {}, transformers {})",
            layers,
            field("hidden")?,
            init["attention"].as_str().unwrap_or("?"),
            init["device"].as_str().unwrap_or("?"),
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
        let answer = self.child.request(&json!({
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
/// Weights and moments cross between the two as a checkpoint's two tensor files, in a directory
/// of this process's own beside the checkpoints (`.engine.tmp-PID`): the initial weights (drawn
/// here from the run's seed, as the candle drafter draws them) or a checkpoint's go in at
/// start, and a copy comes out for each checkpoint, which this process writes as the candle
/// drafter's are written.
pub struct DrafterEngine {
    child: TorchChild,
    exchange: std::path::PathBuf,
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
            reduce_s: 0.0,
        };
        let shape = &config.shape;
        let init = engine.child.request(&json!({
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
            "anchor_chunk": settings.anchor_chunk,
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
            "torch drafter: {} attention on {} (torch {})",
            init["attention"].as_str().unwrap_or("?"),
            init["device"].as_str().unwrap_or("?"),
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
        let answer = self.child.request(&json!({
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
        })
    }

    fn step(&mut self, lr: f64, clip: f64, skip: bool) -> Result<Stepped, String> {
        let answer = self.child.request(&json!({
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
        self.child.request(&json!({"op": "check_replicas"}))?;
        Ok(())
    }

    fn snapshot(&mut self, state: TrainingState, config: Value) -> Result<Snapshot, String> {
        let _ = std::fs::remove_dir_all(&self.exchange);
        std::fs::create_dir_all(&self.exchange)
            .map_err(|e| format!("{}: {e}", self.exchange.display()))?;
        let answer = self.child.request(&json!({
            "op": "snapshot", "dir": self.exchange,
        }))?;
        let adam_t = number(&answer, "adam_t")? as u64;
        let read = checkpoint::read_tensors(&self.exchange);
        let _ = std::fs::remove_dir_all(&self.exchange);
        let (weights, moments) = read
            .map_err(|e| format!("the torch engine's copy of the drafter cannot be read: {e}"))?;
        Ok(Snapshot {
            state: TrainingState { adam_t, ..state },
            weights,
            moments,
            config,
        })
    }
}

/// `dflash-worker --eval` and `--generate` on the torch engine: `python -m dflash_orch.decode
/// MODE` decodes, given `request` as its first stdin line and then every further line of this
/// process's stdin (a generate's jobs); its answers go straight to this process's stdout. Fails
/// with the child's last words when it fails.
pub fn decode(
    mode: &str,
    request: &impl serde::Serialize,
    runtime: &TorchRuntime,
) -> Result<(), String> {
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
        .stderr(Stdio::inherit());
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
    let mut stdin = child.stdin.take().ok_or("the child has no stdin")?;
    stdin
        .write_all(line.as_bytes())
        .map_err(|e| format!("cannot hand the request to the torch engine: {e}"))?;
    // The rest of our stdin (a generate's jobs) follows, line by line, until it ends.
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(mut line) = line else { break };
            line.push('\n');
            if stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.flush())
                .is_err()
            {
                break;
            }
        }
    });
    let status = child
        .wait()
        .map_err(|e| format!("lost the torch engine's child: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "the torch engine's decoder failed ({status}); its log is above"
        ))
    }
}

/// A drafter checkpoint directory of the untrained weights a run of `seed` starts from, for
/// `eval --init-seed` on the torch engine: `config.json` of `drafter` and those weights, in a
/// directory of this process's own under the system's temporary directory (removed on drop).
pub struct InitialDrafter(pub std::path::PathBuf);

impl InitialDrafter {
    pub fn write(drafter: &Path, config: &DrafterConfig, seed: u64) -> Result<Self, String> {
        let dir = std::env::temp_dir().join(format!("dflash-init-drafter-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let made = Self(dir.clone());
        let weights = config.initial_weights(seed);
        std::fs::create_dir(&dir)
            .and_then(|()| std::fs::copy(drafter.join("config.json"), dir.join("config.json")))
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

    #[test]
    fn answers_are_read_or_refused_with_a_reason() {
        assert_eq!(
            parse_answer("{\"ok\": true, \"nonfinite\": null}\n").unwrap()["nonfinite"],
            Value::Null
        );
        assert_eq!(
            parse_answer("{\"ok\": false, \"error\": \"CUDA out of memory\"}").unwrap_err(),
            "CUDA out of memory"
        );
        assert_eq!(
            parse_answer("{\"ok\": false}").unwrap_err(),
            "the torch engine failed without a reason"
        );
        for bad in ["", "garbage", "[1, 2]", "{\"ok\": 1}", "{\"nonfinite\": 0}"] {
            let e = parse_answer(bad).unwrap_err();
            assert!(e.starts_with("the torch engine's answer"), "{bad:?}: {e}");
        }
        // A long garbage line is quoted briefly, never split inside a character.
        let long = "é".repeat(1000);
        assert!(parse_answer(&long).unwrap_err().len() < 400);
    }
}
