//! Ring handoff benchmark: how fast batches go from the feeder to a worker through an input ring,
//! first along the path a run ships, then along an idealised copy, on the same batches in one run.
//!
//! Before measuring, the bench writes a dataset store to a temporary directory with `StoreWriter`,
//! as `dflash-orch prepare` does (`tokens.bin`, `loss_mask.bin`, `index.bin`, `meta.json`), with
//! `--sources` batches of `--rows` samples each, the samples scattered through the store as a
//! shuffled plan scatters them, and a loss mask per sample (a masked prompt, then loss tokens). It
//! opens it with `Store::open`, as `launch --data` does. The idealised variants copy the same
//! batches, gathered from that store once, beforehand, into memory; before measuring, the bench
//! checks that both write the same lengths, padded tokens and checksum into a slot. The store was
//! just written, so it is in the page cache, and with the default 8 batches (1.9 MiB of tokens and
//! masks) the sources of both stay in the CPU caches: neither row pays for reading disk or DRAM.
//!
//! The feeder (this process's main thread) writes batches into the free slots of an input ring in
//! `/dev/shm`, publishes each under a new generation with its `SlotMeta`, and hands the slot to a
//! consumer process over ipc-channel (`Job::Forward`, the orchestrator's own message), with
//! `--slots` batches in flight. The consumer (this binary again, started with `--consumer`) checks
//! the generation, reads the batch, and acks the slot (`Event::Forwarded`). Right after each
//! handoff run, a plain `copy_from_slice` of the batch's lengths and padded tokens (from the same
//! batches into `--slots` rotating buffers), the same number of times, is the yardstick.
//!
//! Variants (feeder write path -> consumer read path), each against the same consumer process:
//!   1. `shipping path`: what a run does for every batch. `Run::feed` takes a free slot and its
//!      next generation from `Dispatch::feed` and calls `Run::write_batch`, which the feeder here
//!      does as that and `Run::gather` do (both private to the runtime, so mirrored line for line,
//!      per-batch allocations included; timing the functions themselves would need the runtime to
//!      expose them): gather each sample's tokens and loss mask from the store (`Store::tokens`,
//!      `Store::loss_mask`, the lengths from `Store::lengths` as the planner holds them) into a
//!      scratch vector, `dflash_common::ring::write_batch` (rows, padding, masks, the CRC-32C
//!      checksum), `Ring::publish`. The consumer reads as the DFlash target does (`Ring::check`,
//!      `read_lengths`, `read_tokens`, `read_masks` copied out) and verifies the CRC-32C of the
//!      tokens against the feeder's, as the drafter does.
//!   2. `idealised: copy -> in place`: lengths, then each row's tokens with one `copy_from_slice`
//!      from memory and its padding zeroed, no masks (the checksum in `SlotMeta` is the source
//!      batch's, computed beforehand); the consumer sums every real token where it lies in the slot.
//!      The handoff alone: the most a feeder and a reader could hope for.
//!   3. `copy -> read_tokens`: as 2, the consumer reads as the synthetic stage does
//!      (`dflash_common::ring::read_tokens`: the real tokens gathered into a vector).
//!   4. `copy+checksum -> read_tokens`: as 3, the feeder also computes `token_checksum` per batch.
//!
//! Then the descriptor round trip: a small `Job::Train` answered by `Event::Trained`, timed one at a
//! time.
//!
//! ```sh
//! cargo run --release -p dflash-orch --example ring_bench -- [--rows 12] [--max-len 4096] \
//!     [--slots 8] [--sources 8] [--rounds 3] [--seconds 0.4] [--rtt 10000] [--json FILE]
//! ```

use std::collections::BTreeMap;
use std::hint::black_box;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;
use dflash_common::ring::{
    Layout, Ring, SlotMeta, input_data_bytes, read_lengths, read_masks, read_tokens,
    token_checksum, write_batch,
};
use dflash_common::wire::{BatchId, Event, Hello, Job, PROTOCOL, SlotRef};
use dflash_orch::store::{FORMAT, Store, StoreMeta, StoreWriter, VERSION};
use ipc_channel::ipc::{self, IpcOneShotServer, IpcReceiver, IpcSender};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(
    name = "ring_bench",
    about = "Input-ring handoff throughput and descriptor round trip"
)]
struct Args {
    /// Rows (samples) per batch.
    #[arg(long, default_value_t = 12)]
    rows: u32,
    /// Padded row length: a batch is rows x max-len tokens.
    #[arg(long, default_value_t = 4096)]
    max_len: u32,
    /// Shortest real row (rows are max-len long when not given; shorter rows are zero-padded).
    #[arg(long)]
    min_len: Option<u32>,
    /// Slots of the ring, all in flight at once.
    #[arg(long, default_value_t = 8)]
    slots: u32,
    /// Distinct batches the feeder cycles through (rows x sources samples in the store).
    #[arg(long, default_value_t = 8)]
    sources: usize,
    /// Measured rounds; each runs every variant, then its memcpy, once.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Length of each handoff run.
    #[arg(long, default_value_t = 0.4)]
    seconds: f64,
    /// Batches handed off per variant before measuring (the consumer verifies their checksums).
    #[arg(long, default_value_t = 200)]
    warmup: u64,
    /// Timed descriptor round trips.
    #[arg(long, default_value_t = 10_000)]
    rtt: usize,
    /// Untimed round trips first.
    #[arg(long, default_value_t = 1_000)]
    rtt_warmup: usize,
    /// Name of the ring file in /dev/shm (default: dflash-bench-ring-PID); removed at the end.
    #[arg(long)]
    shm_name: Option<String>,
    /// Also write the results as one JSON object to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Internal: run as the consumer, connecting to this one-shot IPC server.
    #[arg(long, hide = true, requires = "ring")]
    consumer: Option<String>,
    /// Internal: the ring the consumer maps.
    #[arg(long, hide = true)]
    ring: Option<PathBuf>,
}

/// `BatchId::epoch` tells the consumer which measurement a batch belongs to: 0 for the warm-up
/// (read with `read_tokens`, checksum verified), else the variant's number, with one of these bits
/// set when the consumer reads in place or as a worker does.
const PHASE_WARMUP: u32 = 0;
const READ_IN_PLACE: u32 = 0x100;
const READ_AS_WORKER: u32 = 0x200;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Writer {
    /// Gather from the store, `write_batch`: `Run::write_batch`.
    Shipping,
    Copy,
    CopyChecksum,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Reader {
    /// Check, lengths, tokens and masks as the DFlash target reads them; CRC-32C verified.
    AsWorker,
    InPlace,
    RealTokens,
}

struct Variant {
    name: &'static str,
    writer: Writer,
    reader: Reader,
}

/// The shipping path first, the idealised copy second: the two headline rows.
const SHIPPING: usize = 0;
const IDEALISED: usize = 1;

const VARIANTS: [Variant; 4] = [
    Variant {
        name: "shipping path",
        writer: Writer::Shipping,
        reader: Reader::AsWorker,
    },
    Variant {
        name: "idealised: copy -> in place",
        writer: Writer::Copy,
        reader: Reader::InPlace,
    },
    Variant {
        name: "copy -> read_tokens",
        writer: Writer::Copy,
        reader: Reader::RealTokens,
    },
    Variant {
        name: "copy+checksum -> read_tokens",
        writer: Writer::CopyChecksum,
        reader: Reader::RealTokens,
    },
];

fn phase(v: usize) -> u32 {
    let n = v as u32 + 1;
    match VARIANTS[v].reader {
        Reader::AsWorker => n | READ_AS_WORKER,
        Reader::InPlace => n | READ_IN_PLACE,
        Reader::RealTokens => n,
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.consumer {
        Some(name) => consumer(
            name.clone(),
            args.ring.as_deref().expect("clap requires --ring"),
        ),
        None => feeder(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ring_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Consumer side.

/// Per-phase totals the consumer prints on stdout when it is stopped.
#[derive(Default)]
struct Busy {
    batches: u64,
    tokens: u64,
    read: Duration,
}

fn consumer(name: String, ring_path: &Path) -> Result<(), String> {
    // Die with the feeder, as workers die with the orchestrator.
    // SAFETY: a plain prctl on this process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
    }
    let ring = Ring::open(ring_path).map_err(|e| e.to_string())?;
    let bootstrap = IpcSender::<Hello>::connect(name).map_err(|e| e.to_string())?;
    let (jobs_tx, jobs) = ipc::channel::<Job>().map_err(|e| e.to_string())?;
    let (events, events_rx) = ipc::channel::<Event>().map_err(|e| e.to_string())?;
    bootstrap
        .send(Hello {
            protocol: PROTOCOL,
            worker: 0,
            pid: std::process::id(),
            jobs: jobs_tx,
            events: events_rx,
        })
        .map_err(|e| e.to_string())?;
    let mut busy: BTreeMap<u32, Busy> = BTreeMap::new();
    let mut sink = 0u64;
    loop {
        let job = jobs.recv().map_err(|e| format!("lost the feeder: {e}"))?;
        let reply = match job {
            Job::Stop => break,
            Job::Step { id, .. } => Event::Failed {
                id: Some(id),
                reason: "this bench has one drafter".into(),
            },
            Job::Train { id, checksum, .. } => Event::Trained {
                id,
                checksum,
                metrics: None,
            },
            Job::Forward { id, input, .. } => {
                let started = Instant::now();
                let read = if id.epoch & READ_AS_WORKER != 0 {
                    read_as_worker(&ring, input)
                } else if id.epoch & READ_IN_PLACE != 0 {
                    read_in_place(&ring, input)
                } else {
                    read_real_tokens(&ring, input, id.epoch == PHASE_WARMUP)
                };
                match read {
                    Ok((n, sum)) => {
                        sink = sink.wrapping_add(sum);
                        let b = busy.entry(id.epoch).or_default();
                        b.batches += 1;
                        b.tokens += n as u64;
                        b.read += started.elapsed();
                        Event::Forwarded {
                            id,
                            nonfinite: None,
                        }
                    }
                    Err(reason) => Event::Failed {
                        id: Some(id),
                        reason,
                    },
                }
            }
        };
        events
            .send(reply)
            .map_err(|e| format!("lost the feeder: {e}"))?;
    }
    let phases: serde_json::Map<String, serde_json::Value> = busy
        .iter()
        .map(|(phase, b)| {
            (
                phase.to_string(),
                json!({
                    "batches": b.batches,
                    "tokens": b.tokens,
                    "read_us_per_batch": b.read.as_secs_f64() * 1e6 / b.batches.max(1) as f64,
                }),
            )
        })
        .collect();
    println!("{}", json!({ "phases": phases, "sink": sink }));
    Ok(())
}

/// Checks the slot's generation and reads its real tokens as a target worker does; returns how
/// many there were and their sum. `verify` also checks the feeder's checksum.
fn read_real_tokens(ring: &Ring, at: SlotRef, verify: bool) -> Result<(usize, u64), String> {
    let meta = ring
        .check(at.slot, at.generation)
        .map_err(|e| e.to_string())?;
    let mut tokens = Vec::with_capacity(meta.tokens as usize);
    read_tokens(ring.data(at.slot), &meta, &mut tokens)?;
    if verify {
        let found = token_checksum(&tokens);
        if found != meta.checksum {
            return Err(format!(
                "slot {} generation {}: checksum {found:08x}, the feeder wrote {:08x}",
                at.slot, at.generation, meta.checksum
            ));
        }
    }
    let sum = tokens.iter().map(|&t| u64::from(t)).sum::<u64>();
    Ok((tokens.len(), sum))
}

/// Reads the batch as the DFlash target does (`TargetStage::forward`: the generation check of
/// `claim`, then `read_lengths`, `read_tokens`, `read_masks` copied out) and checks the tokens'
/// CRC-32C against the feeder's, as the drafter does (`train`); returns the token count and a sum
/// over tokens, lengths and masks.
fn read_as_worker(ring: &Ring, at: SlotRef) -> Result<(usize, u64), String> {
    let meta = ring
        .check(at.slot, at.generation)
        .map_err(|e| e.to_string())?;
    let data = ring.data(at.slot);
    let lengths = read_lengths(data, &meta)?;
    let mut tokens = Vec::with_capacity(meta.tokens as usize);
    read_tokens(data, &meta, &mut tokens)?;
    let masks = read_masks(data, &meta)?.to_vec();
    let found = token_checksum(&tokens);
    if found != meta.checksum {
        return Err(format!(
            "corrupt batch in slot {} generation {}: checksum {found:08x}, the feeder wrote {:08x}",
            at.slot, at.generation, meta.checksum
        ));
    }
    let sum = tokens.iter().map(|&t| u64::from(t)).sum::<u64>()
        + lengths.iter().map(|&l| u64::from(l)).sum::<u64>()
        + masks.iter().map(|&m| u64::from(m)).sum::<u64>();
    Ok((tokens.len(), sum))
}

/// Checks the slot's generation and sums every real token where it lies (padded layout), with a
/// wrapping 32-bit sum: one pass over the tokens at memory speed, as a copy to the device would be.
fn read_in_place(ring: &Ring, at: SlotRef) -> Result<(usize, u64), String> {
    let meta = ring
        .check(at.slot, at.generation)
        .map_err(|e| e.to_string())?;
    if meta.layout != Layout::Padded as u32 {
        return Err("the in-place reader handles the padded layout only".into());
    }
    let data = ring.data(at.slot);
    let words = |from: usize, n: usize| -> Result<&[u32], String> {
        let bytes = data
            .get(from..from + 4 * n)
            .ok_or_else(|| format!("batch shape {meta:?} exceeds the slot"))?;
        // The slot data and the offsets are 4-byte aligned.
        bytemuck::try_cast_slice(bytes).map_err(|e| format!("slot data: {e:?}"))
    };
    let lengths = words(0, meta.count as usize)?;
    let max = meta.max_len as usize;
    let base = meta.tokens_offset as usize;
    let (mut n, mut sum) = (0usize, 0u64);
    for (row, &len) in lengths.iter().enumerate() {
        if len as usize > max {
            return Err(format!("row {row} length {len} exceeds max_len {max}"));
        }
        let row_tokens = words(base + 4 * row * max, len as usize)?;
        sum += u64::from(row_tokens.iter().fold(0u32, |a, &t| a.wrapping_add(t)));
        n += row_tokens.len();
    }
    if n != meta.tokens as usize {
        return Err(format!(
            "batch holds {n} tokens, its header says {}",
            meta.tokens
        ));
    }
    Ok((n, sum))
}

// ---------------------------------------------------------------------------------------------
// Feeder side.

/// A batch: the store samples it is made of, and the same batch gathered into memory beforehand
/// for the idealised variants and the memcpy yardstick.
struct Batch {
    /// Store indices of its samples, in batch order (what `EpochPlan::batch_samples` gives).
    samples: Vec<u32>,
    lengths: Vec<u32>,
    /// Real tokens, sample after sample (what `Tokens::sample` gathers).
    real: Vec<u32>,
    /// The padded image: rows x max_len, zero after each row's length.
    padded: Vec<u32>,
    checksum: u32,
}

/// Removes the ring file however the feeder ends.
struct ShmFile(PathBuf);

impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Removes the store's temporary directory however the feeder ends.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kills the consumer if the feeder bails out early.
struct ConsumerProcess(Option<Child>);

impl Drop for ConsumerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Shape {
    rows: usize,
    max_len: usize,
    tokens_offset: usize,
    /// The run's token budget: the input slot is sized for it.
    budget: u64,
}

impl Shape {
    /// Bytes a batch puts into a slot: lengths and padded tokens.
    fn batch_bytes(&self) -> usize {
        4 * self.rows + 4 * self.rows * self.max_len
    }
}

/// A small deterministic generator for the source tokens (splitmix64).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Writes a store of `count` x `rows` samples into `dir` with `StoreWriter` (as `prepare` does),
/// the samples of each batch scattered through it; opens it as `launch --data` does and gathers
/// every batch from it into memory.
fn make_store(
    dir: &Path,
    shape: &Shape,
    min_len: usize,
    count: usize,
) -> Result<(Store, Vec<Batch>), String> {
    let mut state = 0x5EED_u64;
    let n = count * shape.rows;
    // Batch b's samples: order[b * rows..(b + 1) * rows], a shuffle of the store (Fisher-Yates).
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        order.swap(i, (splitmix(&mut state) % (i as u64 + 1)) as usize);
    }
    let path = dir.join("store");
    let store_error = |e: dflash_orch::store::StoreError| e.to_string();
    let mut writer = StoreWriter::create(&path, false).map_err(store_error)?;
    for _ in 0..n {
        let span = (shape.max_len - min_len + 1) as u64;
        let len = min_len + (splitmix(&mut state) % span) as usize;
        let tokens: Vec<u32> = (0..len)
            .map(|_| (splitmix(&mut state) % 151_936) as u32)
            .collect();
        // A prompt without loss, then the answer's tokens with it.
        let prompt = (splitmix(&mut state) % (len as u64 / 4 + 1)) as usize;
        let mask: Vec<u8> = (0..len).map(|p| u8::from(p >= prompt)).collect();
        writer.push(&tokens, &mask).map_err(store_error)?;
    }
    writer
        .finish(StoreMeta {
            format: FORMAT.to_owned(),
            version: VERSION,
            samples: 0,
            tokens: 0,
            loss_tokens: 0,
            vocab_size: Some(151_936),
            max_len: shape.max_len as u32,
            on_overlong: "skip".to_owned(),
            min_loss_tokens: 0,
            truncated: 0,
            skipped: BTreeMap::new(),
            skipped_examples: Vec::new(),
            sources: Vec::new(),
            files: BTreeMap::new(),
            created_by: "ring_bench".to_owned(),
        })
        .map_err(store_error)?;
    let store = Store::open(&path).map_err(store_error)?;
    store.verify().map_err(store_error)?;
    let batches = order
        .chunks_exact(shape.rows)
        .map(|samples| {
            let lengths: Vec<u32> = samples
                .iter()
                .map(|&s| store.index()[s as usize].len)
                .collect();
            let mut real = Vec::new();
            let mut padded = vec![0u32; shape.rows * shape.max_len];
            for (row, &s) in samples.iter().enumerate() {
                let tokens = store.tokens(s as usize);
                real.extend_from_slice(tokens);
                padded[row * shape.max_len..][..tokens.len()].copy_from_slice(tokens);
            }
            let checksum = token_checksum(&real);
            Batch {
                samples: samples.to_vec(),
                lengths,
                real,
                padded,
                checksum,
            }
        })
        .collect();
    Ok((store, batches))
}

/// Where the shipping path reads its batches: the open store, and every sample's length as the
/// planner holds them (`Planner::lengths`, from `Store::lengths`).
struct Source<'a> {
    store: &'a Store,
    lengths: &'a [u32],
}

/// Writes `batch` into a slot's data the chosen way; returns its meta and, for the shipping path,
/// the time spent gathering it from the store.
fn write_slot(
    data: &mut [u8],
    batch: &Batch,
    shape: &Shape,
    source: &Source,
    writer: Writer,
    scratch: &mut Vec<u32>,
) -> (SlotMeta, Duration) {
    let checksum = match writer {
        Writer::Shipping => return ship(data, batch, shape, source, scratch),
        Writer::Copy => {
            copy_rows(data, batch, shape);
            batch.checksum
        }
        Writer::CopyChecksum => {
            let checksum = token_checksum(&batch.real);
            copy_rows(data, batch, shape);
            checksum
        }
    };
    let meta = SlotMeta {
        layout: Layout::Padded as u32,
        count: shape.rows as u32,
        max_len: shape.max_len as u32,
        tokens: batch.real.len() as u32,
        tokens_offset: shape.tokens_offset as u32,
        checksum,
        // The copy variants leave the masks out: they measure the token handoff alone.
        masks_offset: dflash_common::ring::masks_offset(shape.budget) as u32,
    };
    (meta, Duration::ZERO)
}

/// Lengths, then each row's real tokens with one `copy_from_slice` and its padding zeroed.
fn copy_rows(data: &mut [u8], batch: &Batch, shape: &Shape) {
    data[..4 * shape.rows].copy_from_slice(bytemuck::cast_slice(&batch.lengths));
    let mut from = 0;
    for (row, &len) in batch.lengths.iter().enumerate() {
        let len = len as usize;
        let at = shape.tokens_offset + 4 * row * shape.max_len;
        let dst = &mut data[at..at + 4 * shape.max_len];
        dst[..4 * len].copy_from_slice(bytemuck::cast_slice(&batch.real[from..from + len]));
        dst[4 * len..].fill(0);
        from += len;
    }
}

/// The shipping path: `Run::write_batch` with `Run::gather` and `Tokens::sample` for a store, as
/// they are in `orchestrator/src/runtime/mod.rs` (the per-batch `masks` and `lengths` vectors
/// included); `Ring::publish` follows in the caller, as in `Run::write_batch`.
fn ship(
    data: &mut [u8],
    batch: &Batch,
    shape: &Shape,
    source: &Source,
    scratch: &mut Vec<u32>,
) -> (SlotMeta, Duration) {
    let started = Instant::now();
    let mut tokens = std::mem::take(scratch);
    let mut masks = Vec::with_capacity(tokens.capacity());
    // Run::gather
    tokens.clear();
    masks.clear();
    let mut lengths = Vec::with_capacity(batch.samples.len());
    for &s in &batch.samples {
        let len = source.lengths[s as usize];
        // Tokens::sample, Tokens::Store
        tokens.extend_from_slice(&source.store.tokens(s as usize)[..len as usize]);
        masks.extend_from_slice(&source.store.loss_mask(s as usize)[..len as usize]);
        lengths.push(len);
    }
    let gathered = started.elapsed();
    let meta = write_batch(
        data,
        Layout::Padded,
        &lengths,
        &tokens,
        &masks,
        shape.max_len as u32,
        shape.budget,
    );
    *scratch = tokens;
    (meta, gathered)
}

/// The plain-memcpy yardstick: the batch's lengths and padded tokens copied with
/// `copy_from_slice` from the same sources into one of `dst.len()` buffers in turn, `n` times.
fn memcpy_run(dst: &mut [Vec<u8>], sources: &[Batch], shape: &Shape, n: u64) -> Duration {
    let started = Instant::now();
    for i in 0..n as usize {
        let batch = &sources[i % sources.len()];
        let d = &mut dst[i % dst.len()];
        d[..4 * shape.rows].copy_from_slice(bytemuck::cast_slice(&batch.lengths));
        let at = shape.tokens_offset;
        d[at..at + 4 * batch.padded.len()].copy_from_slice(bytemuck::cast_slice(&batch.padded));
        black_box(&mut *d);
    }
    started.elapsed()
}

/// Where a handoff run's time went, on the feeder's side.
#[derive(Default, Clone, Copy)]
struct Handoff {
    batches: u64,
    wall: Duration,
    /// Writing slots and publishing them.
    write: Duration,
    /// Of `write`: gathering from the store (shipping path only).
    gather: Duration,
    /// Sending descriptors.
    send: Duration,
}

struct Feeder<'a> {
    ring: Ring,
    generation: Vec<u64>,
    jobs: IpcSender<Job>,
    events: IpcReceiver<Event>,
    sources: &'a [Batch],
    source: Source<'a>,
    shape: Shape,
    scratch: Vec<u32>,
    sequence: u64,
}

impl Feeder<'_> {
    /// Hands off batches with every slot in flight: `limit` batches, or until `seconds` pass.
    fn handoff(
        &mut self,
        writer: Writer,
        phase: u32,
        limit: Option<u64>,
        seconds: Option<f64>,
    ) -> Result<Handoff, String> {
        let mut free: Vec<u32> = (0..self.ring.slot_count()).rev().collect();
        let mut stats = Handoff::default();
        let mut sent = 0u64;
        let started = Instant::now();
        let deadline = seconds.map(|s| started + Duration::from_secs_f64(s));
        let mut open = true;
        loop {
            while open && let Some(&slot) = free.last() {
                if limit.is_some_and(|n| sent >= n) || deadline.is_some_and(|d| Instant::now() >= d)
                {
                    open = false;
                    break;
                }
                free.pop();
                let t0 = Instant::now();
                let batch = &self.sources[(self.sequence as usize) % self.sources.len()];
                let (meta, gathered) = write_slot(
                    self.ring.data_mut(slot),
                    batch,
                    &self.shape,
                    &self.source,
                    writer,
                    &mut self.scratch,
                );
                self.generation[slot as usize] += 1;
                let generation = self.generation[slot as usize];
                self.ring.publish(slot, generation, meta);
                let t1 = Instant::now();
                let job = Job::Forward {
                    id: BatchId {
                        epoch: phase,
                        batch: slot,
                        step: self.sequence,
                    },
                    input: SlotRef { slot, generation },
                    feature: SlotRef {
                        slot: 0,
                        generation: 0,
                    },
                };
                self.jobs
                    .send(job)
                    .map_err(|e| format!("lost the consumer: {e}"))?;
                stats.write += t1 - t0;
                stats.gather += gathered;
                stats.send += t1.elapsed();
                self.sequence += 1;
                sent += 1;
            }
            if stats.batches == sent && !open {
                break;
            }
            match self
                .events
                .recv()
                .map_err(|e| format!("lost the consumer: {e}"))?
            {
                Event::Forwarded { id, .. } => {
                    free.push(id.batch);
                    stats.batches += 1;
                }
                Event::Failed { reason, .. } => return Err(format!("consumer: {reason}")),
                other => return Err(format!("consumer sent {other:?}")),
            }
        }
        stats.wall = started.elapsed();
        Ok(stats)
    }

    /// Times `n` descriptor round trips (after `warmup` untimed ones), in microseconds.
    fn round_trips(&mut self, warmup: usize, n: usize) -> Result<Vec<f64>, String> {
        let mut times = Vec::with_capacity(n);
        for i in 0..warmup + n {
            let job = Job::Train {
                id: BatchId {
                    epoch: 0,
                    batch: i as u32,
                    step: i as u64,
                },
                feature: SlotRef {
                    slot: 0,
                    generation: i as u64,
                },
                checksum: i as u32,
                group: dflash_common::wire::Group { index: 0, len: 1 },
                nonfinite: None,
            };
            let started = Instant::now();
            self.jobs
                .send(job)
                .map_err(|e| format!("lost the consumer: {e}"))?;
            match self
                .events
                .recv()
                .map_err(|e| format!("lost the consumer: {e}"))?
            {
                Event::Trained { checksum, .. } if checksum == i as u32 => {}
                other => return Err(format!("unexpected reply {other:?}")),
            }
            if i >= warmup {
                times.push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok(times)
    }
}

fn median(values: &[f64]) -> f64 {
    percentile(values, 50.0)
}

/// Nearest-rank percentile.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

type Connection = (ConsumerProcess, IpcSender<Job>, IpcReceiver<Event>);

/// Starts the consumer process and waits (bounded) for its hello.
fn start_consumer(ring: &Path) -> Result<Connection, String> {
    let (server, name) = IpcOneShotServer::<Hello>::new().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let child = Command::new(exe)
        .arg("--consumer")
        .arg(&name)
        .arg("--ring")
        .arg(ring)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the consumer: {e}"))?;
    let child = ConsumerProcess(Some(child));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(server.accept());
    });
    let (_, hello) = rx
        .recv_timeout(Duration::from_secs(20))
        .map_err(|_| "the consumer did not connect within 20 s".to_string())?
        .map_err(|e| format!("consumer hello: {e:?}"))?;
    if hello.protocol != PROTOCOL {
        return Err("the consumer speaks another protocol".into());
    }
    Ok((child, hello.jobs, hello.events))
}

/// Checks that the shipping path and the idealised copy put the same lengths and padded tokens
/// into a slot, with the same checksum, for every batch: both rows measure the same input.
fn same_input(
    sources: &[Batch],
    shape: &Shape,
    source: &Source,
    slot_data: usize,
) -> Result<(), String> {
    let end = shape.tokens_offset + 4 * shape.rows * shape.max_len;
    let (mut shipped, mut copied) = (vec![0u8; slot_data], vec![0u8; slot_data]);
    for (i, batch) in sources.iter().enumerate() {
        let (meta, _) = ship(&mut shipped, batch, shape, source, &mut Vec::new());
        copy_rows(&mut copied, batch, shape);
        if shipped[..end] != copied[..end] || meta.checksum != batch.checksum {
            return Err(format!(
                "batch {i}: the shipping path and the idealised copy wrote different batches"
            ));
        }
    }
    Ok(())
}

fn feeder(args: &Args) -> Result<(), String> {
    if cfg!(target_endian = "big") {
        return Err("the ring layout is little-endian; this bench copies native words".into());
    }
    let rows = args.rows.max(1) as usize;
    let max_len = args.max_len.max(1) as usize;
    let min_len = args
        .min_len
        .map_or(max_len, |m| (m as usize).clamp(1, max_len));
    let budget = (rows * max_len) as u64;
    let shape = Shape {
        rows,
        max_len,
        tokens_offset: dflash_common::ring::tokens_offset(budget),
        budget,
    };
    let name = args
        .shm_name
        .clone()
        .unwrap_or_else(|| format!("dflash-bench-ring-{}", std::process::id()));
    if name.is_empty() || name.contains('/') {
        return Err("--shm-name is a file name in /dev/shm, not a path".into());
    }
    let path = Path::new("/dev/shm").join(&name);
    // The orchestrator's input-slot size for a token budget of rows x max_len.
    let ring = Ring::create(&path, args.slots.max(1), 64 + input_data_bytes(budget))
        .map_err(|e| e.to_string())?;
    let _shm = ShmFile(path.clone());
    let store_dir =
        TempDir(std::env::temp_dir().join(format!("dflash-bench-store-{}", std::process::id())));
    let (store, sources) = make_store(&store_dir.0, &shape, min_len, args.sources.max(1))?;
    let lengths = store.lengths();
    let source = Source {
        store: &store,
        lengths: &lengths,
    };
    same_input(&sources, &shape, &source, ring.data_bytes())?;
    let (mut consumer, jobs, events) = start_consumer(&path)?;
    let slot_data = ring.data_bytes();
    let mut feeder = Feeder {
        generation: vec![0; ring.slot_count() as usize],
        ring,
        jobs,
        events,
        sources: &sources,
        source,
        shape,
        scratch: Vec::new(),
        sequence: 0,
    };
    let batch_bytes = feeder.shape.batch_bytes() as f64;
    let real_tokens: usize = sources.iter().map(|b| b.real.len()).sum::<usize>() / sources.len();
    println!(
        "ring_bench: {} slots of {slot_data} data bytes in {}; {} batches of {rows} x {max_len} \
         tokens ({:.1} KiB of lengths and padded tokens per batch, {real_tokens} real tokens on \
         average) from a store of {} samples in {}; consumer pid {}",
        feeder.ring.slot_count(),
        path.display(),
        sources.len(),
        batch_bytes / 1024.0,
        store.len(),
        store.path().display(),
        consumer.0.as_ref().map_or(0, Child::id),
    );

    // Warm-up: every write path once, read back with real_tokens and checksum-verified.
    for v in &VARIANTS {
        feeder.handoff(v.writer, PHASE_WARMUP, Some(args.warmup), None)?;
    }
    let mut dst: Vec<Vec<u8>> = (0..feeder.ring.slot_count())
        .map(|_| vec![0x5a; slot_data])
        .collect();
    memcpy_run(&mut dst, &sources, &feeder.shape, args.warmup);

    let gbs = |batches: u64, d: Duration| batches as f64 * batch_bytes / d.as_secs_f64() / 1e9;
    let nv = VARIANTS.len();
    let mut memcpy_gbs: Vec<Vec<f64>> = vec![Vec::new(); nv];
    let mut handoff_gbs: Vec<Vec<f64>> = vec![Vec::new(); nv];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); nv];
    let mut stats: Vec<Vec<Handoff>> = vec![Vec::new(); nv];
    println!();
    println!("GB/s per round (handoff / memcpy of the same batch count right after it):");
    print!("{:>5}", "round");
    for v in &VARIANTS {
        print!("  {:>28}", v.name);
    }
    println!("  {:>10}", "ship/ideal");
    // Shipping over idealised, round by round: the two runs are adjacent in time.
    let mut shipping_over_idealised = Vec::new();
    for round in 0..args.rounds.max(1) {
        print!("{:>5}", round + 1);
        for (v, variant) in VARIANTS.iter().enumerate() {
            let h = feeder.handoff(variant.writer, phase(v), None, Some(args.seconds))?;
            let m = memcpy_run(&mut dst, &sources, &feeder.shape, h.batches);
            let (hg, mg) = (gbs(h.batches, h.wall), gbs(h.batches, m));
            handoff_gbs[v].push(hg);
            memcpy_gbs[v].push(mg);
            ratios[v].push(hg / mg);
            stats[v].push(h);
            print!("  {:>28}", format!("{hg:.2} / {mg:.2}"));
        }
        let ratio = handoff_gbs[SHIPPING][round] / handoff_gbs[IDEALISED][round];
        shipping_over_idealised.push(ratio);
        println!("  {ratio:>10.2}");
    }

    // Context only: the same memcpy with destinations cycling through more memory than the
    // last-level cache holds (DRAM-bound writes).
    let cold_bytes = 64usize << 20;
    let mut cold: Vec<Vec<u8>> = (0..cold_bytes.div_ceil(slot_data).max(1))
        .map(|_| vec![0x5a; slot_data])
        .collect();
    let cold_n = (2 * cold.len()) as u64;
    let cold_gbs = median(
        &(0..3)
            .map(|_| {
                gbs(
                    cold_n,
                    memcpy_run(&mut cold, &sources, &feeder.shape, cold_n),
                )
            })
            .collect::<Vec<_>>(),
    );
    drop(cold);

    let rtt = feeder.round_trips(args.rtt_warmup, args.rtt)?;
    feeder
        .jobs
        .send(Job::Stop)
        .map_err(|e| format!("lost the consumer: {e}"))?;
    let mut child = consumer.0.take().expect("started above");
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_string(&mut out);
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("the consumer ended with {status}"));
    }
    let consumer_stats: serde_json::Value = out
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(serde_json::Value::Null);

    println!();
    println!(
        "medians of {} rounds; GB/s = {batch_bytes} bytes (lengths + padded tokens) per batch / wall time",
        args.rounds.max(1)
    );
    println!(
        "  {:<30} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "variant",
        "batches",
        "GB/s",
        "memcpy",
        "x memcpy",
        "us/batch",
        "write",
        "gather",
        "send",
        "consumer"
    );
    let mut variants = Vec::new();
    for (v, variant) in VARIANTS.iter().enumerate() {
        let per = |f: fn(&Handoff) -> Duration| {
            let s = &stats[v];
            let total: f64 = s.iter().map(|h| f(h).as_secs_f64()).sum();
            let batches: u64 = s.iter().map(|h| h.batches).sum();
            total * 1e6 / batches.max(1) as f64
        };
        let batches: u64 = stats[v].iter().map(|h| h.batches).sum();
        let (wall_us, write_us, send_us) = (per(|h| h.wall), per(|h| h.write), per(|h| h.send));
        let gather_us = per(|h| h.gather);
        let read_us = consumer_stats["phases"][phase(v).to_string()]["read_us_per_batch"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let (hg, mg, ratio) = (
            median(&handoff_gbs[v]),
            median(&memcpy_gbs[v]),
            median(&ratios[v]),
        );
        println!(
            "  {:<30} {:>8} {:>8.2} {:>8.2} {:>9.2} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9.1}",
            variant.name, batches, hg, mg, ratio, wall_us, write_us, gather_us, send_us, read_us
        );
        variants.push(json!({
            "name": variant.name,
            "batches": batches,
            "gbs": hg,
            "memcpy_gbs": mg,
            "ratio": ratio,
            "gbs_rounds": handoff_gbs[v],
            "memcpy_gbs_rounds": memcpy_gbs[v],
            "us_per_batch": wall_us,
            "write_us_per_batch": write_us,
            "gather_us_per_batch": gather_us,
            "send_us_per_batch": send_us,
            "consumer_read_us_per_batch": read_us,
        }));
    }
    println!(
        "  (us per batch, feeder: wall, write = write + publish the slot, of which gather = from \
         the store, send = Job::Forward;"
    );
    println!("   consumer = check + read, between its recv and its ack)");
    let ship_ideal = median(&shipping_over_idealised);
    println!(
        "  shipping path / idealised copy: {ship_ideal:.2} (median of the per-round ratios; \
         GB/s {:.2} vs {:.2})",
        median(&handoff_gbs[SHIPPING]),
        median(&handoff_gbs[IDEALISED])
    );
    println!(
        "  context: the same memcpy into buffers cycling through {} MiB (past the caches): \
         {cold_gbs:.2} GB/s",
        cold_bytes >> 20
    );
    let rtt_median = median(&rtt);
    let rtt_p99 = percentile(&rtt, 99.0);
    let rtt_min = rtt.iter().copied().fold(f64::INFINITY, f64::min);
    println!();
    println!(
        "descriptor round trip (Job::Train -> Event::Trained over ipc-channel, {} timed after {} \
         warm-up): median {rtt_median:.1} us, p99 {rtt_p99:.1} us, min {rtt_min:.1} us",
        rtt.len(),
        args.rtt_warmup
    );

    if let Some(file) = &args.json {
        let value = json!({
            "rows": rows,
            "max_len": max_len,
            "min_len": min_len,
            "slots": feeder.ring.slot_count(),
            "batch_bytes": batch_bytes,
            "rounds": args.rounds.max(1),
            "seconds": args.seconds,
            "sources": sources.len(),
            "store_samples": store.len(),
            "variants": variants,
            "shipping_over_idealised": ship_ideal,
            "shipping_over_idealised_rounds": shipping_over_idealised,
            "memcpy_cold_gbs": cold_gbs,
            "rtt_us": {"median": rtt_median, "p99": rtt_p99, "min": rtt_min, "n": rtt.len()},
            "consumer": consumer_stats,
        });
        std::fs::write(file, format!("{value}\n"))
            .map_err(|e| format!("{}: {e}", file.display()))?;
    }
    Ok(())
}
