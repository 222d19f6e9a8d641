//! `dflash-orch generate`: training data written by the target, as the DFlash recipe asks.
//!
//! Every input row becomes a prompt: a conversation up to its last assistant reply (which the
//! target writes anew), or the tokens of a pre-tokenized row before its first loss token. The
//! output is JSON lines `prepare` reads: `input_ids` (prompt and response), `loss_mask` (the
//! response only), `source` (the input row) and, with a tokenizer, the `response` text.
//!
//! Everything is read and checked before the first worker starts. Rows are decoded in fixed
//! batches of `--batch-size` input rows by our workers (one per `--gpus` device) or sent to an
//! OpenAI-compatible `--server`, and committed in input order a batch at a time (see
//! [`output`]), so a killed run resumed with `--resume` redoes at most the batches in flight and
//! greedy decoding gives the same file as an uninterrupted run.

pub mod output;
pub mod pool;
pub mod server;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use clap::Args;
use dflash_common::eval::{EVAL_VERSION, GenerateJob, GenerateRequest};
use serde::Serialize;
use tokenizers::Tokenizer;

use crate::error::CliError;
use crate::ingest::chat::{ChatEncoder, Role, Template, load_tokenizer, parse_conversation};
use crate::ingest::{self, Format, Location, RawSample, Reason, Sink, Stop};
use crate::options::DtypeChoice;
use crate::runtime::spec::{Device, GpuSpec};

const AFTER_HELP: &str = "\
Inputs are what `prepare` reads: JSON lines of conversations (the last assistant reply is written \
anew by the target; the turns before it are the prompt) or pre-tokenized rows (the tokens before \
the first loss token are the prompt), Parquet files or directories, save_to_disk directories, \
Arrow streams.

The output rows are what `prepare` reads (loss on the response only). While it runs, OUTPUT.partial \
and OUTPUT.partial.json hold the committed batches; a killed or interrupted generate continues \
with --resume (the same options), and OUTPUT appears only when every row is in, with \
OUTPUT.meta.json saying what produced it.";

/// Regenerate the responses of a dataset with the target.
#[derive(Debug, Clone, Args)]
#[command(after_help = AFTER_HELP)]
pub struct GenerateArgs {
    /// The target's Hugging Face directory (its tokenizer.json renders conversations).
    #[arg(long, value_name = "DIR")]
    pub target_model: PathBuf,

    /// Input files or directories (repeatable).
    #[arg(long = "input", value_name = "PATH", required = true)]
    pub inputs: Vec<PathBuf>,

    /// Input format [default: from the extension and the first record].
    #[arg(long, value_name = "FORMAT")]
    pub format: Option<Format>,

    /// The output file (JSON lines).
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,

    /// New tokens per response at most.
    #[arg(long, value_name = "N", default_value_t = 2048,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub max_new_tokens: u32,

    /// 0: greedy decoding; above: sampling at this temperature.
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f64,

    /// Sampling seed (each row draws from its own stream of it).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,

    /// Workers: GPU ids (0-7, 0,2,5, all) or cpu:N.
    #[arg(long, value_name = "LIST", default_value = "cpu:1")]
    pub gpus: GpuSpec,

    #[command(flatten)]
    pub decode: crate::runtime::torch_engine::DecodeEngine,

    /// Input rows decoded together (and committed together).
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub batch_size: u32,

    /// Weights and activations: auto (bf16 on GPUs, f32 on CPUs), f32 or bf16.
    #[arg(long, value_name = "TYPE", default_value = "auto", value_parser = crate::options::dtype_choice())]
    pub dtype: DtypeChoice,

    /// Generation stops after any of these tokens [default: the target's eos_token_id].
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub stop_token_ids: Option<Vec<u32>>,

    /// Chat template of conversation inputs: chatml or llama3.
    #[arg(long, value_name = "NAME", default_value = "chatml")]
    pub chat_template: Template,

    /// tokenizer.json [default: the target's].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,

    /// Take the responses from this OpenAI-compatible server (http://HOST:PORT) instead of our
    /// workers: SGLang or vLLM serving the target.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,

    /// The server's model name [default: the first /v1/models lists].
    #[arg(long, value_name = "NAME", requires = "server")]
    pub server_model: Option<String>,

    /// Requests in flight at once with --server.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,

    /// Seconds one batch (or one server request) may take before its worker is restarted and
    /// the batch redone (or the request fails); 1 to 604800.
    #[arg(long, value_name = "SECS", default_value_t = 3600.0,
          value_parser = crate::options::job_timeout())]
    pub job_timeout: f64,

    /// Continue the interrupted generate of this --output.
    #[arg(long)]
    pub resume: bool,

    /// Replace an existing --output.
    #[arg(long)]
    pub force: bool,

    /// Print one JSON object on stdout at the end.
    #[arg(long)]
    pub json: bool,
}

/// One prompt to answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// Where it came from (file:line or file row N).
    pub source: String,
    pub prompt: Vec<u32>,
    /// The conversation before the reply (for --server).
    pub turns: Option<Vec<(Role, String)>>,
}

/// Collects pre-tokenized rows as prompts: the tokens before the first loss token.
struct Collector<'a> {
    items: &'a mut Vec<Item>,
}

impl Sink for Collector<'_> {
    fn accept(&mut self, at: &Location, sample: RawSample) -> Result<(), Stop> {
        let mask = sample.loss_mask.as_deref().unwrap_or(&[]);
        let Some(prompt) = crate::runtime::eval::prompt_of(&sample.input_ids, mask) else {
            return Err(Stop::Bad {
                at: at.clone(),
                reason: Reason::EmptySample,
                message: "no prompt: the first token already carries loss".into(),
            });
        };
        self.items.push(Item {
            source: at.to_string(),
            prompt,
            turns: None,
        });
        Ok(())
    }

    fn reject(&mut self, at: &Location, reason: Reason, message: String) -> Result<(), Stop> {
        Err(Stop::Bad {
            at: at.clone(),
            reason,
            message,
        })
    }

    fn progress(&mut self, _: u64) {}
}

/// Reads every input into prompts.
pub fn read_items(
    inputs: &[PathBuf],
    format: Option<Format>,
    encoder: impl Fn() -> Result<ChatEncoder, String>,
) -> Result<Vec<Item>, String> {
    let inputs = crate::commands::prepare::resolve_inputs(inputs, format)?;
    let mut items = Vec::new();
    let mut chat: Option<ChatEncoder> = None;
    for input in &inputs {
        let stop = |s: Stop| {
            s.to_string().replace(
                "; pass --on-bad skip to skip such samples and count them",
                "",
            )
        };
        let mut sink = Collector { items: &mut items };
        match input.format {
            Format::Jsonl => ingest::jsonl::read_pretokenized(&input.path, &mut sink)
                .map(|_| ())
                .map_err(stop)?,
            Format::Parquet => ingest::arrow::read_parquet(&input.path, &mut sink).map_err(stop)?,
            Format::HfDisk | Format::Arrow => {
                ingest::arrow::read_arrow_stream(&input.path, &mut sink).map_err(stop)?
            }
            Format::Chat => {
                if chat.is_none() {
                    chat = Some(encoder()?);
                }
                let enc = chat.as_ref().expect("made above");
                let text = std::fs::read(&input.path)
                    .map_err(|e| format!("{}: cannot read: {e}", input.path.display()))?;
                for (i, line) in text.split(|&b| b == b'\n').enumerate() {
                    let line = line.trim_ascii();
                    if line.is_empty() {
                        continue;
                    }
                    let at = format!("{}:{}", input.path.display(), i + 1);
                    let mut turns =
                        parse_conversation(line).map_err(|(_, why)| format!("{at}: {why}"))?;
                    // The prompt: everything before the last assistant reply.
                    let reply = turns.iter().rposition(|(role, _)| *role == Role::Assistant);
                    turns.truncate(reply.unwrap_or(turns.len()));
                    if turns.is_empty() {
                        return Err(format!("{at}: no turn before the assistant's reply"));
                    }
                    let borrowed: Vec<(Role, &str)> =
                        turns.iter().map(|(r, t)| (*r, t.as_str())).collect();
                    let prompt = enc
                        .encode_prompt(&borrowed)
                        .map_err(|e| format!("{at}: {e}"))?;
                    items.push(Item {
                        source: at,
                        prompt,
                        turns: Some(turns),
                    });
                }
            }
        }
    }
    if items.is_empty() {
        return Err("the inputs hold no rows".into());
    }
    Ok(items)
}

/// One output row.
pub fn render_row(item: &Item, response: &[u32], tokenizer: Option<&Tokenizer>) -> String {
    let mut ids = item.prompt.clone();
    ids.extend_from_slice(response);
    let mut mask = vec![0u8; item.prompt.len()];
    mask.resize(ids.len(), 1);
    let mut row = serde_json::json!({
        "input_ids": ids,
        "loss_mask": mask,
        "source": item.source,
    });
    if let Some(text) = tokenizer.and_then(|t| t.decode(response, false).ok()) {
        row["response"] = text.into();
    }
    row.to_string()
}

/// What `generate` reports.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub output: String,
    pub rows: u64,
    /// Rows that were already committed by the run this one resumed.
    pub resumed_rows: u64,
    pub tokens_generated: u64,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub producer: String,
    /// Server replies cut to --max-new-tokens tokens.
    pub replies_cut: u64,
}

fn invalid(message: impl Into<String>) -> CliError {
    CliError::Invalid(message.into())
}

pub fn run(args: GenerateArgs) -> Result<(), CliError> {
    // Validation: nothing is written or started before all of it passes.
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(invalid(format!(
            "--temperature {} must be 0 or positive",
            args.temperature
        )));
    }
    let engine = args.decode.engine;
    let target = dflash_common::dflash::read_config_for(&args.target_model, engine)
        .map_err(|e| invalid(format!("--target-model {e}")))?;
    let tokenizer_path = args
        .tokenizer
        .clone()
        .unwrap_or_else(|| args.target_model.join("tokenizer.json"));
    let template = args.chat_template;
    // Read once: it renders conversations and decodes responses (Qwen3's is 11 MB of JSON).
    let tokenizer = if tokenizer_path.is_file() {
        Some(Arc::new(load_tokenizer(&tokenizer_path).map_err(invalid)?))
    } else {
        None
    };
    let make_encoder = || {
        let tok = match &tokenizer {
            Some(t) => Tokenizer::clone(t),
            None => load_tokenizer(&tokenizer_path)?,
        };
        ChatEncoder::new(tok, &tokenizer_path, template)
    };
    let items = Arc::new(read_items(&args.inputs, args.format, make_encoder).map_err(invalid)?);
    let context = target.max_position_embeddings;
    let max_new = args.max_new_tokens as usize;
    for item in items.iter() {
        crate::commands::eval::check_prompt(&item.source, &item.prompt, &target, max_new)
            .map_err(invalid)?;
    }
    let stop_token_ids = match &args.stop_token_ids {
        Some(ids) => ids.clone(),
        None => crate::commands::eval::eos_tokens(&args.target_model).map_err(invalid)?,
    };
    crate::commands::eval::check_stop_tokens(&stop_token_ids, &target).map_err(invalid)?;
    let server = match &args.server {
        Some(url) => Some(
            server::Server::connect(
                url,
                args.server_model.as_deref(),
                Duration::from_secs_f64(args.job_timeout),
            )
            .map_err(invalid)?,
        ),
        None => None,
    };
    if server.is_some() && tokenizer.is_none() {
        return Err(invalid(format!(
            "--server needs the target's tokenizer to turn responses into tokens: {} is missing (pass --tokenizer)",
            tokenizer_path.display()
        )));
    }
    let devices = if server.is_some() {
        Vec::new()
    } else {
        args.gpus
            .devices(crate::runtime::gpu_count(&crate::runtime::init_nvml()))
            .map_err(invalid)?
    };
    let gpu = devices.iter().any(|d| matches!(d, Device::Gpu(_)));
    let gpu_ids: Vec<u32> = devices
        .iter()
        .filter_map(|d| match d {
            Device::Gpu(g) => Some(*g),
            Device::Cpu(_) => None,
        })
        .collect();
    let torch = if server.is_some() {
        None
    } else {
        args.decode
            .runtime(&gpu_ids, &args.target_model)
            .map_err(invalid)?
    };
    if !gpu && matches!(args.gpus, GpuSpec::Cpu(_)) && torch.is_none() {
        crate::model_dir::check_weights(&args.target_model, &target, target.num_hidden_layers)
            .map_err(|e| invalid(format!("--target-model {e}")))?;
    }
    let dtype = args.dtype.resolve(gpu);
    let batch = args.batch_size as u64;
    let rows = items.len() as u64;
    // What determines the rows, so that a resume never mixes two of them.
    let input_hash = hash_inputs(&args.inputs, args.format).map_err(invalid)?;
    let tokenizer_hash = if tokenizer_path.is_file() {
        Some(hash_files(std::slice::from_ref(&tokenizer_path)).map_err(invalid)?)
    } else {
        None
    };
    let target_weights = if server.is_some() {
        None
    } else {
        let identity = crate::runtime::dflash_stage::target_identity(&args.target_model)
            .map_err(|e| invalid(format!("--target-model {e}")))?;
        let sample = crate::runtime::dflash_stage::weights_sample(&args.target_model)
            .map_err(|e| invalid(format!("--target-model {e}")))?;
        Some(format!("{identity}-{sample}"))
    };
    let settings = output::Settings {
        producer: if server.is_some() { "server" } else { "target" }.into(),
        engine: server.is_none().then(|| engine.name().to_owned()),
        target_model: Some(args.target_model.display().to_string()),
        server: args.server.clone(),
        server_model: server.as_ref().map(|s| s.model.clone()),
        inputs: args
            .inputs
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        rows,
        batch_size: batch,
        max_new_tokens: max_new as u64,
        temperature: args.temperature,
        seed: args.seed,
        stop_token_ids: stop_token_ids.clone(),
        dtype: dtype.name().into(),
        input_hash,
        chat_template: template.name().into(),
        chat_template_hash: crate::runtime::dflash_stage::digest([template.text().as_bytes()]),
        tokenizer_hash,
        target_weights,
    };
    let paths = output::Paths::of(&args.output);
    let from =
        output::starting_point(&paths, &settings, args.resume, args.force).map_err(invalid)?;

    // Side effects from here on.
    let interrupted = crate::signals::watch_stop_signals();
    let mut writer = output::Writer::open(&paths, settings.clone(), from)
        .map_err(|e| CliError::io(format!("cannot write {}", paths.partial.display()), e))?;
    let resumed_rows = writer.committed().rows;
    let first = writer.committed().batches;
    let batches = rows.div_ceil(batch);
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(rows),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} generate [{elapsed_precise}] {wide_bar} {pos}/{len} rows (eta {eta}) {msg}",
        )
        .expect("valid template"),
    );
    bar.set_position(resumed_rows);
    bar.reset_eta();
    let started = Instant::now();
    let mut generated = 0u64;
    let range = |b: u64| (b * batch) as usize..((b + 1) * batch).min(rows) as usize;
    let mut commit = |b: u64, outputs: Vec<Vec<u32>>| -> Result<(), String> {
        let first_row = range(b).start;
        for (k, (item, out)) in items[range(b)].iter().zip(&outputs).enumerate() {
            let len = item.prompt.len() + out.len();
            if let Some(context) = context
                && len > context
            {
                return Err(format!(
                    "row {} ({}): {len} tokens (prompt and response) exceed the target's context of {context} tokens",
                    first_row + k + 1,
                    item.source
                ));
            }
        }
        let rendered: Vec<String> = items[range(b)]
            .iter()
            .zip(&outputs)
            .map(|(item, out)| render_row(item, out, tokenizer.as_deref()))
            .collect();
        writer
            .commit(&rendered)
            .map_err(|e| format!("cannot write {}: {e}", paths.partial.display()))?;
        generated += outputs.iter().map(|o| o.len() as u64).sum::<u64>();
        bar.set_position(writer.committed().rows);
        bar.set_message(format!(
            "{:.0} tok/s",
            generated as f64 / started.elapsed().as_secs_f64().max(1e-9)
        ));
        Ok(())
    };
    let replies_cut = Arc::new(AtomicU64::new(0));
    let complete = match server {
        Some(server) => {
            let asker = Arc::new(Asker {
                server,
                tokenizer: Arc::clone(tokenizer.as_ref().expect("checked above")),
                encoder: if items.iter().any(|i| i.turns.is_some()) {
                    Some(make_encoder().map_err(invalid)?)
                } else {
                    None
                },
                stop_token: stop_token_ids.first().copied(),
                max_new,
                temperature: args.temperature,
                seed: args.seed,
                cut: Arc::clone(&replies_cut),
            });
            let concurrency = args.concurrency as usize;
            let mut done = true;
            'batches: for b in first..batches {
                // Each batch's requests run on threads of their own: a stop signal ends the
                // command at once (the batch in flight is dropped, resumable), without waiting
                // for a slow server.
                let (tx, rx) = mpsc::channel();
                let (asker, items, rows) = (Arc::clone(&asker), Arc::clone(&items), range(b));
                std::thread::spawn(move || {
                    let _ = tx.send(ask_all(&items[rows], concurrency, &|item| asker.ask(item)));
                });
                let outputs = loop {
                    if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
                        done = false;
                        break 'batches;
                    }
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(outputs) => break outputs.map_err(CliError::Failed)?,
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => {
                            return Err(CliError::Failed("a request thread died".into()));
                        }
                    }
                };
                commit(b, outputs).map_err(CliError::Failed)?;
            }
            done
        }
        None => {
            let request = GenerateRequest {
                version: EVAL_VERSION,
                target_model: args.target_model.clone(),
                dtype,
                max_new_tokens: max_new,
                stop_token_ids: stop_token_ids.clone(),
                temperature: args.temperature,
                seed: args.seed,
                torch: torch.clone(),
            };
            let result = pool::Pool::start(
                crate::runtime::workers::worker_binary(),
                serde_json::to_string(&request).map_err(|e| CliError::Failed(e.to_string()))?,
                torch.as_ref().map(|t| t.python.clone()),
                &devices,
                Duration::from_secs_f64(args.job_timeout),
                // A batch's rows of up to --max-new-tokens tokens each.
                crate::commands::eval::worker_output::max_line(
                    (batch as usize).saturating_mul(max_new.saturating_add(1)),
                ),
            )
            .and_then(|mut pool| {
                pool.run(
                    (first..batches).collect::<VecDeque<u64>>(),
                    |b| GenerateJob {
                        batch: b,
                        prompts: items[range(b)]
                            .iter()
                            .enumerate()
                            .map(|(k, item)| (b * batch + k as u64, item.prompt.clone()))
                            .collect(),
                    },
                    &mut commit,
                    &interrupted,
                )
            });
            result.map_err(CliError::Failed)?
        }
    };
    bar.finish_and_clear();
    if !complete {
        return Err(CliError::Interrupted(format!(
            "generate stopped after {} of {rows} rows; run it again with --resume to continue",
            writer.committed().rows
        )));
    }
    let seconds = started.elapsed().as_secs_f64();
    let replies_cut = replies_cut.load(std::sync::atomic::Ordering::SeqCst);
    let meta = serde_json::json!({
        "format": "dflash-generate",
        // 3: the settings name the engine.
        "version": 3,
        "settings": settings,
        "rows": rows,
        // Server replies longer than --max-new-tokens once tokenised, cut to it (this run's
        // rows; a resumed run counts its own).
        "replies_cut": replies_cut,
        "produced_by": if args.server.is_some() {
            format!("server {} (model {})", args.server.as_deref().unwrap_or(""), settings.server_model.as_deref().unwrap_or(""))
        } else {
            format!("target {} on {} ({}, the {} engine)", args.target_model.display(), args.gpus_label(), dtype, engine.name())
        },
    });
    writer
        .finish(&meta)
        .map_err(|e| CliError::io(format!("cannot finish {}", paths.output.display()), e))?;
    let summary = Summary {
        output: args.output.display().to_string(),
        rows,
        resumed_rows,
        tokens_generated: generated,
        seconds,
        tokens_per_second: generated as f64 / seconds.max(1e-9),
        producer: settings.producer,
        replies_cut,
    };
    crate::commands::print_result(args.json, &summary, || {
        format!(
            "generate: {} rows to {} ({} resumed), {} tokens generated in {:.1} s ({:.0} tok/s) by the {}\n",
            summary.rows,
            summary.output,
            summary.resumed_rows,
            summary.tokens_generated,
            summary.seconds,
            summary.tokens_per_second,
            summary.producer
        )
    })
}

impl GenerateArgs {
    fn gpus_label(&self) -> String {
        match &self.gpus {
            GpuSpec::All => "all GPUs".into(),
            GpuSpec::Cpu(n) => format!("{n} CPU workers"),
            GpuSpec::Ids(ids) => format!(
                "GPUs {}",
                ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            ),
        }
    }
}

/// What asks a server for one response and turns it into at most `max_new` tokens.
struct Asker {
    server: server::Server,
    tokenizer: Arc<Tokenizer>,
    /// Renders conversations (and knows the end-of-turn token) when the inputs have any.
    encoder: Option<ChatEncoder>,
    /// The end token of a completion from token ids.
    stop_token: Option<u32>,
    max_new: usize,
    temperature: f64,
    seed: u64,
    /// Replies cut to `max_new` tokens.
    cut: Arc<AtomicU64>,
}

impl Asker {
    fn ask(&self, item: &Item) -> Result<Vec<u32>, String> {
        let (reply, end) = match &item.turns {
            Some(turns) => (
                self.server
                    .chat(turns, self.max_new, self.temperature, self.seed)?,
                self.encoder.as_ref().and_then(ChatEncoder::end_token_id),
            ),
            None => (
                self.server
                    .complete(&item.prompt, self.max_new, self.temperature, self.seed)?,
                self.stop_token,
            ),
        };
        let mut ids = self
            .tokenizer
            .encode(reply.text.as_str(), false)
            .map_err(|e| format!("{}: tokenizer failed: {e}", item.source))?
            .get_ids()
            .to_vec();
        // A server may answer more than it was asked for: never more than --max-new-tokens.
        if ids.len() > self.max_new {
            ids.truncate(self.max_new);
            self.cut.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        } else if reply.finished
            && let Some(end) = end
            && ids.len() < self.max_new
        {
            ids.push(end);
        }
        Ok(ids)
    }
}

/// A hash of the bytes of every input file (as `prepare` resolves them), in order.
fn hash_inputs(inputs: &[PathBuf], format: Option<Format>) -> Result<String, String> {
    let files: Vec<PathBuf> = crate::commands::prepare::resolve_inputs(inputs, format)?
        .into_iter()
        .map(|i| i.path)
        .collect();
    hash_files(&files)
}

/// A hash of the files' names' order and bytes, read a block at a time.
fn hash_files(files: &[PathBuf]) -> Result<String, String> {
    use std::io::Read;
    let mut parts: Vec<Vec<u8>> = Vec::new();
    for path in files {
        let mut f = std::fs::File::open(path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let mut block = vec![0u8; 1 << 20];
        let mut hashes = Vec::new();
        loop {
            let n = f
                .read(&mut block)
                .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
            if n == 0 {
                break;
            }
            hashes
                .extend_from_slice(crate::runtime::dflash_stage::digest([&block[..n]]).as_bytes());
        }
        parts.push(hashes);
    }
    Ok(crate::runtime::dflash_stage::digest(
        parts.iter().map(Vec::as_slice),
    ))
}

/// Asks for every item's response, `concurrency` at a time, in item order.
fn ask_all(
    items: &[Item],
    concurrency: usize,
    ask: &(dyn Fn(&Item) -> Result<Vec<u32>, String> + Sync),
) -> Result<Vec<Vec<u32>>, String> {
    let mut out = Vec::with_capacity(items.len());
    for chunk in items.chunks(concurrency.max(1)) {
        let answers: Vec<Result<Vec<u32>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|item| s.spawn(move || ask(item)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a request thread panicked".into()))
                })
                .collect()
        });
        for a in answers {
            out.push(a?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_carry_loss_on_the_response_only() {
        let item = Item {
            source: "in.jsonl:3".into(),
            prompt: vec![5, 6, 7],
            turns: None,
        };
        let row: serde_json::Value =
            serde_json::from_str(&render_row(&item, &[8, 2], None)).unwrap();
        assert_eq!(row["input_ids"], serde_json::json!([5, 6, 7, 8, 2]));
        assert_eq!(row["loss_mask"], serde_json::json!([0, 0, 0, 1, 1]));
        assert_eq!(row["source"], "in.jsonl:3");
        // What prepare reads back.
        let sample =
            crate::ingest::jsonl::parse_pretokenized(render_row(&item, &[8], None).as_bytes())
                .unwrap();
        assert_eq!(sample.input_ids, vec![5, 6, 7, 8]);
    }

    #[test]
    fn pretokenized_prompts_end_before_the_first_loss_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(
            &path,
            "{\"input_ids\": [1, 2, 3, 4], \"loss_mask\": [0, 0, 1, 1]}\n{\"input_ids\": [9, 8]}\n",
        )
        .unwrap();
        let items = read_items(std::slice::from_ref(&path), None, || {
            Err("no tokenizer".into())
        })
        .unwrap();
        assert_eq!(items[0].prompt, vec![1, 2]);
        assert_eq!(items[1].prompt, vec![9, 8]);
        assert!(items[0].source.ends_with("in.jsonl:1"));
        std::fs::write(&path, "{\"input_ids\": [1, 2], \"loss_mask\": [1, 1]}\n").unwrap();
        let err = read_items(std::slice::from_ref(&path), None, || Err("x".into())).unwrap_err();
        assert!(
            err.contains("in.jsonl:1") && err.contains("no prompt"),
            "{err}"
        );
        std::fs::write(&path, "{\"input_ids\": [1, \"a\"]}\n").unwrap();
        let err = read_items(&[path], None, || Err("x".into())).unwrap_err();
        assert!(err.contains("in.jsonl:1"), "{err}");
    }
}
