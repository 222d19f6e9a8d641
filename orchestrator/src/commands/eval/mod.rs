//! `dflash-orch eval`: a drafter's served acceptance, measured by greedy speculative decoding as
//! DFlash serves it (the target's hidden states feed the drafter, the drafter fills a block in
//! one pass, one target pass verifies it), against plain greedy decoding by the target.
//!
//! Everything is checked here before a worker starts: the target directory, the drafter
//! checkpoint against the target (layer ids, hidden size, vocabulary, mask token) and every
//! prompt (tokens inside the vocabulary, prompt plus new tokens inside the target's context). One
//! `dflash-worker --eval` process decodes, pinned and dying with this one, and prints a line per
//! prompt; [`summarize`] turns those lines into τ, the histogram, the speedup and the lossless
//! check.

use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Args;
use dflash_common::dflash::{Precision, Qwen3Config};
use dflash_common::eval::{DraftConfig, EVAL_VERSION, EvalRequest, PromptResult, Sampling};
use serde::Serialize;

use crate::error::CliError;
use crate::ingest::chat::{ChatEncoder, Template, load_tokenizer, parse_conversation};
use crate::ingest::jsonl::parse_pretokenized;
use crate::options::DtypeChoice;
use worker_output::{Line, LogTail, last_words, max_line, read_line};

pub mod worker_output;

const AFTER_HELP: &str = "\
τ (tau) is the acceptance length as z-lab's DFlash benchmark defines it: for each prompt, the mean \
number of tokens one verify step gains (accepted draft tokens + 1; the token of the prefill pass is \
not counted), then the mean over prompts. The pooled mean over all verify steps is shown beside it \
(it weighs long outputs more and is often lower). Speedup is the time per generated token of plain \
greedy decoding divided by that of speculative decoding, both after the prefill, on the same \
device. Lossless means every speculative output equals plain greedy decoding token for token.

Prompts: JSON lines, each {\"input_ids\": [...]} or a conversation ({\"conversations\": [...]} or \
{\"messages\": [...]}), rendered with --chat-template and the target's tokenizer.json up to the \
assistant's reply (trailing assistant turns dropped).";

/// Evaluate a drafter by speculative decoding: τ, speedup, lossless.
#[derive(Debug, Clone, Args)]
#[command(after_help = AFTER_HELP)]
pub struct EvalArgs {
    /// The target's Hugging Face directory (config.json, safetensors, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    pub target_model: PathBuf,

    /// The drafter: a checkpoint directory (config.json + model.safetensors), or a run's
    /// checkpoint directory or run directory (its latest checkpoint).
    #[arg(long, value_name = "DIR")]
    pub drafter: PathBuf,

    /// The prompts (JSON lines; see below).
    #[arg(long, value_name = "FILE")]
    pub prompts: PathBuf,

    /// New tokens per prompt at most (the first, from the prefill, included).
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub max_new_tokens: u32,

    /// Tokens drafted and verified per step [default: the drafter's block_size].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(2..=1024))]
    pub block_size: Option<u32>,

    /// Generation stops after any of these tokens [default: the target's eos_token_id, from
    /// generation_config.json or config.json].
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        conflicts_with = "ignore_eos"
    )]
    pub stop_token_ids: Option<Vec<u32>>,

    /// Never stop early: every prompt generates --max-new-tokens tokens.
    #[arg(long)]
    pub ignore_eos: bool,

    /// Chat template of conversation prompts: chatml or llama3.
    #[arg(long, value_name = "NAME", default_value = "chatml")]
    pub chat_template: Template,

    /// tokenizer.json for conversation prompts [default: the target's].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,

    /// Evaluate the first N prompts only.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,

    /// Sample at this temperature instead of decoding greedily: 0 (greedy) to 100. Drafts are
    /// verified by rejection sampling, so the output is distributed as the target's own sampling
    /// (lossless in distribution, no longer equal token for token).
    #[arg(long, value_name = "T", default_value_t = 0.0,
          value_parser = crate::options::real(0.0, dflash_common::eval::MAX_TEMPERATURE, ""))]
    pub temperature: f64,

    /// With --temperature: sample from the smallest set of most likely tokens whose mass reaches
    /// P, in (0, 1] [default: 1, all].
    #[arg(long, value_name = "P", value_parser = crate::options::positive(1.0, ""))]
    pub top_p: Option<f64>,

    /// With --temperature: sample from the K most likely tokens only [default: 0, all].
    #[arg(long, value_name = "K")]
    pub top_k: Option<u32>,

    /// With --temperature: the seed of the draws. Prompt i draws from a stream of (seed, i), so
    /// a prompt's output does not depend on the others; the same seed gives the same outputs.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// Evaluate the untrained drafter of the checkpoint's shape instead of its weights: the
    /// weights a run with `launch --seed N` starts from (a baseline for the trained one).
    #[arg(long, value_name = "N")]
    pub init_seed: Option<u64>,

    /// The GPU to decode on [default: the CPU].
    #[arg(long, value_name = "ID")]
    pub gpu: Option<u32>,

    #[command(flatten)]
    pub decode: crate::runtime::torch_engine::DecodeEngine,

    /// Weights and activations: auto (bf16 on a GPU, f32 on the CPU), f32 or bf16.
    #[arg(long, value_name = "TYPE", default_value = "auto", value_parser = crate::options::dtype_choice())]
    pub dtype: DtypeChoice,

    /// Seconds the worker may take for one prompt (the first includes loading the models)
    /// before it is taken for hung (stopped, wedged) and killed, failing the command; 1 to 604800.
    #[arg(long, value_name = "SECS", default_value_t = 3600.0,
          value_parser = crate::options::job_timeout())]
    pub job_timeout: f64,

    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// One prompt's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptSummary {
    /// Line of the prompts file.
    pub line: usize,
    pub prompt_tokens: usize,
    /// The prompt's token ids (what another decoder needs to reproduce the row).
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    /// Mean tokens gained per verify step (0 when the prefill's token ended the output).
    pub tau: f64,
    pub steps: usize,
    /// Equal to plain greedy decoding; none when sampling.
    pub lossless: Option<bool>,
}

/// What `eval` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalSummary {
    /// The checkpoint directory evaluated.
    pub drafter: String,
    /// Set when the untrained weights of this seed were evaluated instead of the checkpoint's.
    pub init_seed: Option<u64>,
    pub prompts: usize,
    pub block_size: usize,
    pub max_new_tokens: usize,
    pub device: String,
    pub dtype: Precision,
    /// How the tokens were sampled; none: greedy decoding.
    pub sampling: Option<Sampling>,
    /// Mean over prompts of each prompt's mean tokens per verify step.
    pub tau: f64,
    /// Mean over all verify steps of all prompts.
    pub pooled_tau: f64,
    /// Share of verify steps that gained 1, 2, ..., block_size tokens.
    pub histogram: Vec<f64>,
    /// Tokens generated by speculative decoding, all prompts.
    pub tokens: usize,
    /// Seconds per generated token after the prefill, mean over prompts.
    pub baseline_seconds_per_token: f64,
    pub speculative_seconds_per_token: f64,
    /// Baseline over speculative time per token.
    pub speedup: f64,
    /// Every output equals plain greedy decoding; none when sampling (rejection sampling keeps
    /// the distribution, not the tokens).
    pub lossless: Option<bool>,
    #[serde(rename = "per_prompt")]
    pub per_prompt: Vec<PromptSummary>,
}

/// The summary of the worker's `results` for `req` (in prompt order; `lines[i]` is prompt i's
/// line): τ, the histogram, the speedup and the lossless check.
pub fn summarize(
    results: &[PromptResult],
    lines: &[usize],
    req: &EvalRequest,
    device: String,
) -> EvalSummary {
    let (prompts, block_size) = (&req.prompts, req.block_size);
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let mut histogram = vec![0u64; block_size];
    let mut per_prompt = Vec::with_capacity(results.len());
    let mut taus = Vec::new();
    let (mut spec_tpot, mut base_tpot) = (Vec::new(), Vec::new());
    let mut steps_all = 0u64;
    let mut gained_all = 0u64;
    for r in results {
        for &a in &r.acceptance {
            let k = (a as usize).clamp(1, block_size);
            histogram[k - 1] += 1;
            gained_all += u64::from(a);
        }
        steps_all += r.acceptance.len() as u64;
        let steps = r.acceptance.len();
        let tau = if steps == 0 {
            0.0
        } else {
            r.acceptance.iter().map(|&a| f64::from(a)).sum::<f64>() / steps as f64
        };
        if steps > 0 {
            taus.push(tau);
        }
        let tokens = r.output_ids.len().max(1) as f64;
        spec_tpot.push(r.speculative_seconds / tokens);
        if let Some(s) = r.baseline_seconds {
            base_tpot.push(s / tokens);
        }
        per_prompt.push(PromptSummary {
            line: lines.get(r.prompt).copied().unwrap_or(0),
            prompt_tokens: prompts.get(r.prompt).map_or(0, Vec::len),
            prompt_ids: prompts.get(r.prompt).cloned().unwrap_or_default(),
            output_ids: r.output_ids.clone(),
            tau,
            steps,
            lossless: req
                .sampling
                .is_none()
                .then(|| r.baseline_ids.as_ref() == Some(&r.output_ids)),
        });
    }
    let pooled = if steps_all == 0 {
        0.0
    } else {
        gained_all as f64 / steps_all as f64
    };
    let histogram = histogram
        .iter()
        .map(|&n| n as f64 / steps_all.max(1) as f64)
        .collect();
    let (base, spec) = (mean(&base_tpot), mean(&spec_tpot));
    EvalSummary {
        drafter: req.drafter.display().to_string(),
        init_seed: req.init_seed,
        prompts: results.len(),
        block_size,
        max_new_tokens: req.max_new_tokens,
        device,
        dtype: req.dtype,
        sampling: req.sampling,
        tau: mean(&taus),
        pooled_tau: pooled,
        histogram,
        tokens: per_prompt.iter().map(|p| p.output_ids.len()).sum(),
        baseline_seconds_per_token: base,
        speculative_seconds_per_token: spec,
        speedup: if spec > 0.0 { base / spec } else { 0.0 },
        lossless: req
            .sampling
            .is_none()
            .then(|| per_prompt.iter().all(|p| p.lossless == Some(true))),
        per_prompt,
    }
}

fn invalid(message: impl Into<String>) -> CliError {
    CliError::Invalid(message.into())
}

/// The checkpoint directory `path` names: itself, or what its `latest` (or its `checkpoints/`'s
/// `latest`) points to.
pub fn resolve_drafter(path: &Path) -> Result<PathBuf, String> {
    if path.join("config.json").is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        if let Ok(name) = std::fs::read_to_string(root.join("latest")) {
            let dir = root.join(name.trim());
            if dir.join("config.json").is_file() {
                return Ok(dir);
            }
        }
    }
    Err(format!(
        "--drafter {}: no checkpoint there (neither config.json nor a `latest` pointer)",
        path.display()
    ))
}

/// The target's end-of-sequence tokens: `eos_token_id` (a number or a list) of
/// generation_config.json, else of config.json; none when neither has one.
pub fn eos_tokens(dir: &Path) -> Result<Vec<u32>, String> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        let Ok(text) = std::fs::read(&path) else {
            continue;
        };
        let value: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
        let bad = || {
            format!(
                "{}: eos_token_id is not a token id or a list of them",
                path.display()
            )
        };
        let as_id = |v: &serde_json::Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(bad)
        };
        match value.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::Array(ids)) => {
                return ids.iter().map(as_id).collect();
            }
            Some(v) => return Ok(vec![as_id(v)?]),
        }
    }
    Ok(Vec::new())
}

/// The prompts of `path`, with their line numbers: token ids, or conversations encoded with
/// the template (the tokenizer loaded on the first conversation).
pub fn read_prompts(
    path: &Path,
    template: Template,
    tokenizer: &Path,
    limit: Option<usize>,
) -> Result<Vec<(usize, Vec<u32>)>, String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let mut encoder: Option<ChatEncoder> = None;
    let mut prompts = Vec::new();
    for (i, line) in text.split(|&b| b == b'\n').enumerate() {
        if limit.is_some_and(|n| prompts.len() >= n) {
            break;
        }
        let line_no = i + 1;
        let trimmed = line.trim_ascii();
        if trimmed.is_empty() {
            continue;
        }
        let at = |why: String| format!("{}:{line_no}: {why}", path.display());
        let value: serde_json::Value =
            serde_json::from_slice(trimmed).map_err(|e| at(format!("not JSON: {e}")))?;
        let ids = if value.get("input_ids").is_some() {
            parse_pretokenized(trimmed)
                .map_err(|(_, why)| at(why))?
                .input_ids
        } else if value.get("conversations").is_some() || value.get("messages").is_some() {
            let turns = parse_conversation(trimmed).map_err(|(_, why)| at(why))?;
            if encoder.is_none() {
                let tok = load_tokenizer(tokenizer)?;
                encoder = Some(ChatEncoder::new(tok, tokenizer, template)?);
            }
            let turns: Vec<_> = turns.iter().map(|(r, t)| (*r, t.as_str())).collect();
            encoder
                .as_ref()
                .expect("loaded above")
                .encode_prompt(&turns)
                .map_err(at)?
        } else {
            return Err(at(
                "neither input_ids nor a conversation (conversations or messages)".into(),
            ));
        };
        if ids.is_empty() {
            return Err(at("the prompt has no tokens".into()));
        }
        prompts.push((line_no, ids));
    }
    if prompts.is_empty() {
        return Err(format!("{}: no prompts", path.display()));
    }
    Ok(prompts)
}

/// Checks a prompt against the target: token ids inside the vocabulary, prompt plus new tokens
/// inside its context (`max_position_embeddings`); `at` names it in the error.
pub fn check_prompt(
    at: &str,
    ids: &[u32],
    target: &Qwen3Config,
    max_new_tokens: usize,
) -> Result<(), String> {
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= target.vocab_size) {
        return Err(format!(
            "{at}: token id {bad} is outside the target's vocabulary (0..{})",
            target.vocab_size
        ));
    }
    if let Some(context) = target.max_position_embeddings
        && ids.len() + max_new_tokens > context
    {
        return Err(format!(
            "{at}: {} prompt tokens plus --max-new-tokens {max_new_tokens} exceed the target's context of {context} tokens (max_position_embeddings)",
            ids.len()
        ));
    }
    Ok(())
}

/// Refuses stop tokens outside the target's vocabulary (given, or read from its configs).
pub fn check_stop_tokens(ids: &[u32], target: &Qwen3Config) -> Result<(), String> {
    match ids.iter().find(|&&t| t as usize >= target.vocab_size) {
        Some(bad) => Err(format!(
            "--stop-token-ids: {bad} is outside the target's vocabulary (0..{})",
            target.vocab_size
        )),
        None => Ok(()),
    }
}

/// [`check_prompt`] for every prompt of a file, named by its line.
pub fn check_prompts(
    prompts: &[(usize, Vec<u32>)],
    path: &Path,
    target: &Qwen3Config,
    max_new_tokens: usize,
) -> Result<(), String> {
    prompts.iter().try_for_each(|(line, ids)| {
        check_prompt(
            &format!("{}:{line}", path.display()),
            ids,
            target,
            max_new_tokens,
        )
    })
}

/// How a decoding worker is watched while it runs.
pub struct Watch<'a> {
    /// The longest wait for the next result (the first includes loading the models): past it the
    /// worker is taken for hung (stopped, wedged) and killed.
    pub deadline: Duration,
    /// Set by a stop signal (or the run winding down): the worker is killed and the evaluation
    /// ends as interrupted.
    pub stop: &'a AtomicBool,
}

/// What the eval worker's reader thread reports.
enum Heard {
    Line(String),
    Closed,
    /// A line that is no answer (too long, not UTF-8, cut off).
    Bad(String),
}

/// Runs `dflash-worker --eval` on `request` (on `gpu`, else the CPU with `threads` compute
/// threads, or as many as it has) and collects its lines; `progress` sees each. The request
/// travels on the worker's stdin, so no request file exists for anyone to read or replace. A
/// worker that gives no result within `watch.deadline` is killed and the evaluation fails with
/// the reason; `watch.stop` kills it at once. A failed worker's error quotes its last words and
/// the lines of its log before them.
///
/// On the torch engine the worker (and its Python child) get a private temporary directory of
/// their own (`TMPDIR`, mode 0700, an unguessable name), removed here however the worker ends:
/// the untrained drafter of `--init-seed` is written there, and a worker killed at its deadline
/// cannot remove it itself.
pub fn run_worker(
    request: &EvalRequest,
    gpu: Option<u32>,
    threads: Option<usize>,
    watch: &Watch<'_>,
    mut progress: impl FnMut(&PromptResult),
) -> Result<Vec<PromptResult>, CliError> {
    let mut line = serde_json::to_string(request).map_err(|e| CliError::Failed(e.to_string()))?;
    line.push('\n');
    let scratch = match request.torch {
        Some(_) => Some(
            PrivateDir::new()
                .map_err(|e| CliError::io("cannot make a temporary directory for the worker", e))?,
        ),
        None => None,
    };
    let binary = crate::runtime::workers::worker_binary();
    let mut command = Command::new(&binary);
    crate::runtime::workers::device_env(
        &mut command,
        gpu,
        request.torch.as_ref().map(|t| t.python.as_path()),
    );
    command
        .args(["--eval", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(dir) = &scratch {
        command.env("TMPDIR", &dir.0);
    }
    if let Some(n) = threads {
        command.env("RAYON_NUM_THREADS", n.max(1).to_string());
    }
    crate::runtime::workers::bind_to_parent(&mut command, &[]);
    let mut child = command
        .spawn()
        .map_err(|e| CliError::io(format!("cannot start {}", binary.display()), e))?;
    // From here the child is killed on every early return.
    let mut worker = KillOnDrop(Some(child.id()));
    let mut stdin = child.stdin.take().expect("piped");
    let writer = std::thread::spawn(move || {
        // The request may be larger than the pipe: written on a thread of its own, so a worker
        // that never reads it cannot block this one. Closed when done.
        let _ = stdin.write_all(line.as_bytes());
    });
    // Its log, bounded: a worker that prints without end costs no memory.
    let log = LogTail::default();
    let log_ended = log.follow(child.stderr.take().expect("piped"));
    let (tx, rx) = mpsc::channel();
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    // A result holds the speculative and the baseline output and a count per verify step.
    let max = max_line(request.max_new_tokens.saturating_mul(3));
    std::thread::spawn(move || {
        loop {
            let heard = match read_line(&mut stdout, max) {
                Line::Text(line) => Heard::Line(line),
                Line::Closed => Heard::Closed,
                Line::Bad(why) => Heard::Bad(why),
            };
            let last = !matches!(heard, Heard::Line(_));
            if tx.send(heard).is_err() || last {
                return;
            }
        }
    });
    let mut results = Vec::with_capacity(request.prompts.len());
    let mut since = Instant::now();
    let stop_child = |child: &mut std::process::Child, worker: &mut KillOnDrop| {
        let _ = child.kill();
        let _ = child.wait();
        worker.0 = None;
    };
    // A fault in what the worker printed: it is killed, and the error quotes its log.
    let fault = |child: &mut std::process::Child, worker: &mut KillOnDrop, why: String| {
        stop_child(child, worker);
        let (_, before) = last_words(&log.text());
        CliError::Failed(format!("the eval worker {why}{before}"))
    };
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(Heard::Line(line)) => {
                let result: PromptResult = match serde_json::from_str(&line) {
                    Ok(r) => r,
                    Err(e) => {
                        let why = format!("printed {:?}: {e}", crate::format::clip(&line, 200));
                        return Err(fault(&mut child, &mut worker, why));
                    }
                };
                if result.prompt != results.len() {
                    let why = format!(
                        "answered prompt {} where {} was due",
                        result.prompt,
                        results.len()
                    );
                    return Err(fault(&mut child, &mut worker, why));
                }
                progress(&result);
                results.push(result);
                since = Instant::now();
            }
            Ok(Heard::Bad(why)) => return Err(fault(&mut child, &mut worker, why)),
            Ok(Heard::Closed) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if watch.stop.load(Ordering::SeqCst) {
            stop_child(&mut child, &mut worker);
            return Err(CliError::Interrupted(format!(
                "the evaluation stopped after {} of {} prompts",
                results.len(),
                request.prompts.len()
            )));
        }
        if since.elapsed() > watch.deadline {
            stop_child(&mut child, &mut worker);
            return Err(CliError::Failed(format!(
                "the eval worker gave no result for {} s (--job-timeout), after {} of {} prompts: taken for hung (stopped or wedged) and killed",
                watch.deadline.as_secs_f64(),
                results.len(),
                request.prompts.len()
            )));
        }
    }
    let status = child
        .wait()
        .map_err(|e| CliError::io("cannot wait for the eval worker", e))?;
    worker.0 = None;
    let _ = writer.join();
    let _ = log_ended.join();
    let (reason, before) = last_words(&log.text());
    if !status.success() {
        return Err(CliError::Failed(format!(
            "the eval worker failed ({}): {reason}{before}",
            crate::runtime::workers::exit_reason(status),
        )));
    }
    if results.len() != request.prompts.len() {
        return Err(CliError::Failed(format!(
            "the eval worker exited normally after {} of {} prompts, without the results it owed; its last words: {reason}{before}",
            results.len(),
            request.prompts.len()
        )));
    }
    Ok(results)
}

/// A fresh directory of mode 0700 with an unguessable name under the temporary directory
/// (`mkdtemp`: a name another user made first, or a link, is never used), removed with all it
/// holds when dropped.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn new() -> std::io::Result<Self> {
        let template = std::env::temp_dir().join("dflash-eval-XXXXXX");
        nix::unistd::mkdtemp(&template)
            .map(Self)
            .map_err(std::io::Error::from)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kills the process of this pid when dropped (an early return, a panic), unless taken.
struct KillOnDrop(Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Everything `eval` checks before it starts a worker, and the request it hands over.
pub struct Prepared {
    pub request: EvalRequest,
    pub lines: Vec<usize>,
}

/// Validates the arguments and inputs into the worker's request.
pub fn prepare(args: &EvalArgs) -> Result<Prepared, CliError> {
    let engine = args.decode.engine;
    let target = dflash_common::dflash::read_config_for(&args.target_model, engine)
        .map_err(|e| invalid(format!("--target-model {e}")))?;
    if engine == dflash_common::dflash::Engine::Candle {
        crate::model_dir::check_weights(&args.target_model, &target, target.num_hidden_layers)
            .map_err(|e| invalid(format!("--target-model {e}")))?;
    } else {
        crate::model_dir::check_torch_heads(&args.target_model)
            .map_err(|e| invalid(format!("--target-model {e}")))?;
    }
    let drafter = resolve_drafter(&args.drafter).map_err(invalid)?;
    let draft = DraftConfig::read(&drafter).map_err(|e| invalid(format!("--drafter {e}")))?;
    draft
        .check_target(&target)
        .map_err(|e| invalid(format!("--drafter {}: {e}", drafter.display())))?;
    let weights = drafter.join("model.safetensors");
    if !weights.is_file() {
        return Err(invalid(format!(
            "--drafter {}: has no model.safetensors",
            drafter.display()
        )));
    }
    // The table, before a worker starts: float tensors only (the worker checks the values).
    crate::model_dir::tensor_shapes(&weights).map_err(|e| invalid(format!("--drafter {e}")))?;
    let tokenizer = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| args.target_model.join("tokenizer.json"));
    let max_new = args.max_new_tokens as usize;
    let prompts = read_prompts(
        &args.prompts,
        args.chat_template,
        &tokenizer,
        args.limit.map(|n| n as usize),
    )
    .map_err(invalid)?;
    check_prompts(&prompts, &args.prompts, &target, max_new).map_err(invalid)?;
    let stop_token_ids = if args.ignore_eos {
        Vec::new()
    } else if let Some(ids) = &args.stop_token_ids {
        ids.clone()
    } else {
        eos_tokens(&args.target_model).map_err(invalid)?
    };
    check_stop_tokens(&stop_token_ids, &target).map_err(invalid)?;
    let sampling = sampling(args, &target)?;
    let dtype = args.dtype.resolve(args.gpu.is_some());
    let torch = args
        .decode
        .runtime(args.gpu.as_slice(), &args.target_model)
        .map_err(invalid)?;
    let (lines, prompts): (Vec<usize>, Vec<Vec<u32>>) = prompts.into_iter().unzip();
    Ok(Prepared {
        request: EvalRequest {
            version: EVAL_VERSION,
            target_model: args.target_model.clone(),
            drafter,
            block_size: args.block_size.map_or(draft.block_size, |b| b as usize),
            prompts,
            max_new_tokens: max_new,
            stop_token_ids,
            dtype,
            baseline: true,
            init_seed: args.init_seed,
            torch,
            sampling,
        },
        lines,
    })
}

/// The sampling `args` ask for: none at temperature 0, where --top-p, --top-k and --seed have
/// nothing to act on and are refused; --top-k at most the target's vocabulary.
fn sampling(args: &EvalArgs, target: &Qwen3Config) -> Result<Option<Sampling>, CliError> {
    if args.temperature == 0.0 {
        let given: Vec<&str> = [
            (args.top_p.is_some(), "--top-p"),
            (args.top_k.is_some(), "--top-k"),
            (args.seed.is_some(), "--seed"),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect();
        if !given.is_empty() {
            return Err(invalid(format!(
                "{} {} only when sampling: give --temperature above 0 too (0, the default, is greedy decoding)",
                given.join(", "),
                if given.len() == 1 { "acts" } else { "act" }
            )));
        }
        return Ok(None);
    }
    let top_k = args.top_k.unwrap_or(0);
    if top_k as usize > target.vocab_size {
        return Err(invalid(format!(
            "--top-k {top_k} is larger than the target's vocabulary ({} tokens); 0 keeps every token",
            target.vocab_size
        )));
    }
    let s = Sampling {
        temperature: args.temperature,
        top_p: args.top_p.unwrap_or(1.0),
        top_k,
        seed: args.seed.unwrap_or(0),
    };
    s.check()
        .map_err(|e| invalid(format!("--temperature/--top-p: {e}")))?;
    Ok(Some(s))
}

/// Decodes the prepared prompts and summarises them.
pub fn evaluate(
    prepared: &Prepared,
    gpu: Option<u32>,
    watch: &Watch<'_>,
    quiet: bool,
) -> Result<EvalSummary, CliError> {
    let req = &prepared.request;
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(req.prompts.len() as u64),
        if quiet {
            indicatif::ProgressDrawTarget::hidden()
        } else {
            indicatif::ProgressDrawTarget::stderr()
        },
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} eval [{elapsed_precise}] {wide_bar} {pos}/{len} prompts (eta {eta}) {msg}",
        )
        .expect("valid template"),
    );
    let mut gained = (0u64, 0u64);
    let results = run_worker(req, gpu, None, watch, |r| {
        gained.0 += r.acceptance.iter().map(|&a| u64::from(a)).sum::<u64>();
        gained.1 += r.acceptance.len() as u64;
        bar.set_message(format!(
            "pooled τ {:.2}",
            gained.0 as f64 / gained.1.max(1) as f64
        ));
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let device = gpu.map_or_else(|| "cpu".to_owned(), |g| format!("gpu:{g}"));
    Ok(summarize(&results, &prepared.lines, req, device))
}

/// The summary as a person reads it.
pub fn render(s: &EvalSummary) -> String {
    let mut out = format!(
        "eval: {} ({}), {} prompts, up to {} new tokens each, block {}, {} ({})\n",
        s.drafter,
        s.init_seed.map_or_else(
            || "trained weights".to_owned(),
            |seed| format!("untrained: the weights a run of seed {seed} starts from")
        ),
        s.prompts,
        s.max_new_tokens,
        s.block_size,
        s.device,
        s.dtype
    );
    if let Some(x) = &s.sampling {
        out.push_str(&format!(
            "  sampling: temperature {}, top-p {}, top-k {}, seed {}; drafts verified by rejection sampling\n",
            x.temperature,
            x.top_p,
            if x.top_k == 0 { "all".to_owned() } else { x.top_k.to_string() },
            x.seed
        ));
    }
    out.push_str(&format!(
        "  τ (tokens per verify step, mean over prompts): {:.2}   pooled over all steps: {:.2}\n",
        s.tau, s.pooled_tau
    ));
    let bars: Vec<String> = s
        .histogram
        .iter()
        .enumerate()
        .filter(|(_, share)| **share > 0.0)
        .map(|(k, share)| format!("{}: {:.1}%", k + 1, share * 100.0))
        .collect();
    out.push_str(&format!(
        "  tokens per step:  {}\n",
        if bars.is_empty() {
            "-".to_owned()
        } else {
            bars.join("  ")
        }
    ));
    out.push_str(&format!(
        "  time per token:   target alone {:.2} ms, speculative {:.2} ms: speedup {:.2}×\n",
        s.baseline_seconds_per_token * 1e3,
        s.speculative_seconds_per_token * 1e3,
        s.speedup
    ));
    out.push_str(&format!("  tokens generated: {}\n", s.tokens));
    let differ: Vec<String> = s
        .per_prompt
        .iter()
        .filter(|p| p.lossless == Some(false))
        .map(|p| p.line.to_string())
        .collect();
    out.push_str(&if s.lossless.is_none() {
        "  lossless: in distribution (rejection sampling); sampled outputs are not compared token for token\n".to_owned()
    } else if differ.is_empty() {
        "  lossless: yes, every output equals plain greedy decoding\n".to_owned()
    } else {
        format!(
            "  lossless: NO, the outputs of prompt lines {} differ from plain greedy decoding\n",
            differ.join(", ")
        )
    });
    out
}

pub fn run(args: EvalArgs) -> Result<(), CliError> {
    let prepared = prepare(&args)?;
    // Side effects from here on: a stop signal kills the worker and ends the command cleanly.
    let stop = crate::signals::watch_stop_signals();
    let watch = Watch {
        deadline: Duration::from_secs_f64(args.job_timeout),
        stop: &stop,
    };
    let summary = evaluate(&prepared, args.gpu, &watch, args.json)?;
    crate::commands::print_result(args.json, &summary, || render(&summary))
}

#[cfg(test)]
mod tests;
