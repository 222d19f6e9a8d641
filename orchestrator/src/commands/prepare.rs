//! `dflash-orch prepare`: turn training data into a dataset store, once.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use crate::error::CliError;
use crate::ingest::chat::{ChatEncoder, Template, load_tokenizer, read_chat};
use crate::ingest::{self, Format, Location, RawSample, Reason, Sink, Stop};
use crate::planner::{MAX_SUPPORTED_LEN, OverlongPolicy};
use crate::store::{FORMAT, SkipExample, SourceMeta, StoreError, StoreMeta, StoreWriter, VERSION};

/// What `--on-bad` says to do with bad input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnBad {
    /// Stop at the first bad record; no store is written.
    Fail,
    /// Skip bad records and count them by reason.
    Skip,
}

#[derive(Debug, Clone, Args)]
pub struct PrepareArgs {
    /// Input files or directories: JSON lines (pre-tokenized or conversations), Parquet files (or a
    /// directory of them), Arrow stream files, or a Hugging Face save_to_disk directory.
    #[arg(long, value_name = "PATH", num_args = 1.., required = true)]
    pub input: Vec<PathBuf>,

    /// The store directory to create.
    #[arg(long, value_name = "STORE_DIR")]
    pub output: PathBuf,

    /// Input format, for every input [default: from the extension and the first record]:
    /// jsonl | chat | parquet | hf-disk | arrow.
    #[arg(long, value_name = "FORMAT")]
    pub format: Option<String>,

    /// A Hugging Face tokenizer.json: tokenizes conversations, and gives the vocabulary size.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,

    /// How conversations are rendered: chatml (Qwen and others) | llama3.
    #[arg(long, value_name = "TEMPLATE", default_value = "chatml")]
    pub chat_template: String,

    /// Longest sample; longer ones are handled by --on-overlong.
    #[arg(long, value_name = "TOKENS", default_value_t = 8192,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::planner::MAX_SUPPORTED_LEN)))]
    pub max_len: u32,

    /// What to do with samples longer than --max-len: truncate | drop.
    #[arg(long, value_name = "POLICY", default_value = "truncate")]
    pub on_overlong: OverlongPolicy,

    /// Leave out samples with fewer loss tokens than this (2 × block size).
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(0..=i64::from(crate::planner::MAX_SUPPORTED_LEN)))]
    pub min_loss_tokens: u32,

    /// Vocabulary size: token ids must be below it [default: the tokenizer's, if given].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub vocab_size: Option<u32>,

    /// What to do with bad records (malformed, bad ids or masks, unknown roles, unreadable files).
    #[arg(long, value_enum, default_value = "fail")]
    pub on_bad: OnBad,

    /// Replace STORE_DIR if it exists.
    #[arg(long)]
    pub force: bool,

    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// One input file, with its format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    pub path: PathBuf,
    pub format: Format,
}

/// Expands and classifies the inputs; fails on anything it cannot read.
pub fn resolve_inputs(paths: &[PathBuf], forced: Option<Format>) -> Result<Vec<Input>, String> {
    let mut inputs = Vec::new();
    for path in paths {
        if !path.exists() {
            return Err(format!(
                "input {}: no such file or directory",
                path.display()
            ));
        }
        if path.is_dir() {
            if forced.is_none_or(|f| f == Format::HfDisk) && path.join("state.json").exists() {
                for file in ingest::arrow::hf_disk_files(path)? {
                    inputs.push(Input {
                        path: file,
                        format: Format::HfDisk,
                    });
                }
                continue;
            }
            let mut parquet: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| format!("input {}: {e}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
                .collect();
            if parquet.is_empty() || forced.is_some_and(|f| f != Format::Parquet) {
                return Err(format!(
                    "input {}: a directory must be a save_to_disk dataset (state.json) or hold \
                     .parquet files",
                    path.display()
                ));
            }
            parquet.sort();
            inputs.extend(parquet.into_iter().map(|path| Input {
                path,
                format: Format::Parquet,
            }));
            continue;
        }
        let format = match forced {
            Some(f) => f,
            None => {
                let ext = path
                    .extension()
                    .map(|e| e.to_string_lossy().to_lowercase())
                    .unwrap_or_default();
                match ext.as_str() {
                    "parquet" => Format::Parquet,
                    "arrow" => Format::Arrow,
                    "jsonl" | "json" | "ndjson" => ingest::jsonl::sniff(path)?,
                    _ => {
                        return Err(format!(
                            "input {}: cannot tell the format from the extension (pass --format)",
                            path.display()
                        ));
                    }
                }
            }
        };
        inputs.push(Input {
            path: path.clone(),
            format,
        });
    }
    Ok(inputs)
}

/// The validated options of a prepare.
struct Options {
    max_len: u32,
    on_overlong: OverlongPolicy,
    min_loss_tokens: u32,
    vocab_size: Option<u32>,
    on_bad: OnBad,
}

/// Examples kept per reason in `meta.json`.
const EXAMPLES_PER_REASON: usize = 3;

/// Receives samples, applies the common checks, writes the store, counts what it leaves out.
struct Preparer {
    opts: Options,
    writer: StoreWriter,
    skipped: BTreeMap<Reason, u64>,
    examples: Vec<SkipExample>,
    truncated: u64,
    source_samples: u64,
    source_skipped: u64,
    bar: indicatif::ProgressBar,
    interrupted: Arc<AtomicBool>,
    started: Instant,
}

impl Preparer {
    fn check(&self, sample: RawSample) -> Result<(Vec<u32>, Vec<u8>), (Reason, String)> {
        let RawSample {
            mut input_ids,
            loss_mask,
        } = sample;
        if input_ids.is_empty() {
            return Err((Reason::EmptySample, "input_ids is empty".into()));
        }
        let mut mask = match loss_mask {
            Some(m) if m.len() != input_ids.len() => {
                return Err((
                    Reason::MaskLengthMismatch,
                    format!(
                        "loss_mask has {} values, input_ids has {}",
                        m.len(),
                        input_ids.len()
                    ),
                ));
            }
            Some(m) => m,
            None => vec![1; input_ids.len()],
        };
        if let Some(vocab) = self.opts.vocab_size
            && let Some((i, id)) = input_ids.iter().enumerate().find(|&(_, &id)| id >= vocab)
        {
            return Err((
                Reason::OutOfVocab,
                format!("input_ids[{i}] = {id} is outside the vocabulary (size {vocab})"),
            ));
        }
        let max = self.opts.max_len as usize;
        if input_ids.len() > max {
            match self.opts.on_overlong {
                OverlongPolicy::Drop => {
                    return Err((
                        Reason::Overlong,
                        format!("{} tokens, more than --max-len {max}", input_ids.len()),
                    ));
                }
                OverlongPolicy::Truncate => {
                    input_ids.truncate(max);
                    mask.truncate(max);
                }
            }
        }
        let loss = mask.iter().filter(|&&m| m != 0).count();
        if loss < self.opts.min_loss_tokens as usize {
            return Err((
                Reason::TooFewLossTokens,
                format!(
                    "{loss} loss tokens, fewer than --min-loss-tokens {}",
                    self.opts.min_loss_tokens
                ),
            ));
        }
        Ok((input_ids, mask))
    }
}

impl Sink for Preparer {
    fn accept(&mut self, at: &Location, sample: RawSample) -> Result<(), Stop> {
        if self.interrupted.load(Ordering::Relaxed) {
            return Err(Stop::Interrupted);
        }
        let overlong = sample.input_ids.len() > self.opts.max_len as usize;
        match self.check(sample) {
            Ok((ids, mask)) => {
                self.writer.push(&ids, &mask)?;
                self.truncated += u64::from(overlong);
                self.source_samples += 1;
                let samples = self.writer.written().samples;
                if samples.is_multiple_of(4096) {
                    let rate = samples as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
                    self.bar
                        .set_message(format!("{samples} samples, {rate:.0} samples/s"));
                }
                Ok(())
            }
            Err((reason, message)) => self.reject(at, reason, message),
        }
    }

    fn reject(&mut self, at: &Location, reason: Reason, message: String) -> Result<(), Stop> {
        if self.interrupted.load(Ordering::Relaxed) {
            return Err(Stop::Interrupted);
        }
        if !reason.is_filter() && self.opts.on_bad == OnBad::Fail {
            return Err(Stop::Bad {
                at: at.clone(),
                reason,
                message,
            });
        }
        let count = self.skipped.entry(reason).or_insert(0);
        *count += 1;
        self.source_skipped += 1;
        if *count as usize <= EXAMPLES_PER_REASON {
            self.examples.push(SkipExample {
                reason: reason.name().to_owned(),
                location: at.to_string(),
                message,
            });
        }
        Ok(())
    }

    fn progress(&mut self, bytes: u64) {
        self.bar.inc(bytes);
    }
}

/// What `prepare` prints at the end.
#[derive(Debug, Serialize)]
struct Summary {
    store: String,
    samples: u64,
    tokens: u64,
    loss_tokens: u64,
    truncated: u64,
    skipped: BTreeMap<String, u64>,
    sources: Vec<SourceMeta>,
    input_bytes: u64,
    seconds: f64,
    input_mb_per_s: f64,
}

fn options(args: &PrepareArgs, tokenizer_vocab: Option<u32>) -> Result<Options, CliError> {
    if args.max_len == 0 || args.max_len > MAX_SUPPORTED_LEN {
        return Err(CliError::Invalid(format!(
            "--max-len {} is outside 1..={MAX_SUPPORTED_LEN}",
            args.max_len
        )));
    }
    if args.vocab_size == Some(0) {
        return Err(CliError::Invalid("--vocab-size must be at least 1".into()));
    }
    Ok(Options {
        max_len: args.max_len,
        on_overlong: args.on_overlong,
        min_loss_tokens: args.min_loss_tokens,
        vocab_size: args.vocab_size.or(tokenizer_vocab),
        on_bad: args.on_bad,
    })
}

/// Checks the options that need no input file (no side effect).
pub fn check_args(args: &PrepareArgs) -> Result<(), CliError> {
    if let Some(format) = args.format.as_deref() {
        format.parse::<Format>().map_err(CliError::Invalid)?;
    }
    args.chat_template
        .parse::<Template>()
        .map_err(CliError::Invalid)?;
    options(args, None).map(drop)
}

pub fn run(args: PrepareArgs) -> Result<(), CliError> {
    let forced = args
        .format
        .as_deref()
        .map(str::parse::<Format>)
        .transpose()
        .map_err(CliError::Invalid)?;
    let template: Template = args.chat_template.parse().map_err(CliError::Invalid)?;
    let inputs = resolve_inputs(&args.input, forced).map_err(CliError::Invalid)?;
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(load_tokenizer)
        .transpose()
        .map_err(CliError::Invalid)?;
    let tokenizer_vocab = tokenizer.as_ref().map(|t| t.get_vocab_size(true) as u32);
    let opts = options(&args, tokenizer_vocab)?;
    let encoder = match inputs.iter().find(|i| i.format == Format::Chat) {
        None => None,
        Some(input) => {
            let (Some(tokenizer), Some(path)) = (tokenizer, args.tokenizer.as_deref()) else {
                return Err(CliError::Invalid(format!(
                    "input {} holds conversations: pass --tokenizer tokenizer.json",
                    input.path.display()
                )));
            };
            Some(ChatEncoder::new(tokenizer, path, template).map_err(CliError::Invalid)?)
        }
    };

    // Before anything is written: an interrupt from here on must find the handler in place and
    // remove what was written.
    let interrupted = crate::signals::watch_stop_signals();
    let writer = StoreWriter::create(&args.output, args.force).map_err(store_error)?;
    let total: u64 = inputs
        .iter()
        .map(|i| std::fs::metadata(&i.path).map(|m| m.len()).unwrap_or(0))
        .sum();
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} prepare [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta}) {msg}",
        )
        .expect("valid template"),
    );
    let mut prep = Preparer {
        opts,
        writer,
        skipped: BTreeMap::new(),
        examples: Vec::new(),
        truncated: 0,
        source_samples: 0,
        source_skipped: 0,
        bar,
        interrupted,
        started: Instant::now(),
    };

    let mut sources = Vec::new();
    for input in &inputs {
        prep.source_samples = 0;
        prep.source_skipped = 0;
        prep.bar
            .set_message(format!("{} samples", prep.writer.written().samples));
        let read = match input.format {
            Format::Jsonl => ingest::jsonl::read_pretokenized(&input.path, &mut prep).map(Some),
            Format::Chat => read_chat(
                &input.path,
                encoder.as_ref().expect("encoder made for chat inputs"),
                &mut prep,
            )
            .map(Some),
            Format::Parquet => ingest::arrow::read_parquet(&input.path, &mut prep).map(|()| None),
            Format::HfDisk | Format::Arrow => {
                ingest::arrow::read_arrow_stream(&input.path, &mut prep).map(|()| None)
            }
        };
        let read = match read {
            Ok(r) => r,
            Err(stop) => {
                prep.bar.finish_and_clear();
                return Err(match stop {
                    Stop::Bad { .. } => CliError::Invalid(format!("{stop}; no store was written")),
                    Stop::Interrupted => CliError::Interrupted(format!(
                        "prepare stopped; no store was written at {}",
                        args.output.display()
                    )),
                    Stop::Write(e) => store_error(e),
                });
            }
        };
        let (crc32c, bytes) = match read {
            Some(r) => (r.crc32c, r.bytes),
            None => ingest::file_crc(&input.path).unwrap_or((0, 0)),
        };
        sources.push(SourceMeta {
            path: input.path.display().to_string(),
            format: input.format.name().to_owned(),
            bytes,
            crc32c,
            samples: prep.source_samples,
            skipped: prep.source_skipped,
        });
    }
    prep.bar.finish_and_clear();

    let written = prep.writer.written();
    if written.samples == 0 {
        let skipped: u64 = prep.skipped.values().sum();
        return Err(CliError::Invalid(format!(
            "no samples to store: all {skipped} records were left out ({}); no store was written",
            reasons_line(&prep.skipped)
        )));
    }
    let skipped: BTreeMap<String, u64> = prep
        .skipped
        .iter()
        .map(|(r, n)| (r.name().to_owned(), *n))
        .collect();
    let meta = StoreMeta {
        format: FORMAT.to_owned(),
        version: VERSION,
        samples: 0,
        tokens: 0,
        loss_tokens: 0,
        vocab_size: prep.opts.vocab_size,
        max_len: prep.opts.max_len,
        on_overlong: prep.opts.on_overlong.name().to_owned(),
        min_loss_tokens: prep.opts.min_loss_tokens,
        truncated: prep.truncated,
        skipped: skipped.clone(),
        skipped_examples: prep.examples.clone(),
        sources: sources.clone(),
        files: BTreeMap::new(),
        created_by: format!("dflash-orch {}", env!("CARGO_PKG_VERSION")),
    };
    let seconds = prep.started.elapsed().as_secs_f64();
    prep.writer.finish(meta).map_err(store_error)?;

    let input_bytes: u64 = sources.iter().map(|s| s.bytes).sum();
    let summary = Summary {
        store: args.output.display().to_string(),
        samples: written.samples,
        tokens: written.tokens,
        loss_tokens: written.loss_tokens,
        truncated: prep.truncated,
        skipped,
        sources,
        input_bytes,
        seconds,
        input_mb_per_s: input_bytes as f64 / 1e6 / seconds.max(1e-9),
    };
    crate::commands::print_result(args.json, &summary, || {
        summary_text(&summary, &prep.skipped, &prep.examples)
    })
}

fn reasons_line(skipped: &BTreeMap<Reason, u64>) -> String {
    if skipped.is_empty() {
        return "none".into();
    }
    skipped
        .iter()
        .map(|(r, n)| format!("{} {n}", r.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn summary_text(s: &Summary, skipped: &BTreeMap<Reason, u64>, examples: &[SkipExample]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "prepared {}: {} samples, {} tokens ({} loss tokens) from {} input file(s), {:.1} MB in {:.2} s ({:.1} MB/s)",
        s.store,
        s.samples,
        s.tokens,
        s.loss_tokens,
        s.sources.len(),
        s.input_bytes as f64 / 1e6,
        s.seconds,
        s.input_mb_per_s
    );
    let total: u64 = skipped.values().sum();
    let _ = writeln!(
        o,
        "truncated {}; left out {total}: {}",
        s.truncated,
        reasons_line(skipped)
    );
    for e in examples {
        let _ = writeln!(o, "  {} at {}: {}", e.reason, e.location, e.message);
    }
    o
}

fn store_error(e: StoreError) -> CliError {
    match e {
        StoreError::Exists { .. } => CliError::Invalid(e.to_string()),
        other => CliError::Failed(format!("failed to write the store: {other}")),
    }
}
