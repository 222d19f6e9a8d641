//! Fuzz harnesses: one function per family of parsers of outside input.
//!
//! Each function takes the raw fuzz input, turns it into what the parser reads (bytes, text, or
//! files in a scratch directory) and calls the parser; the only check is that nothing panics. The
//! fuzz targets (`fuzz/fuzz_targets/*.rs`) and the regression test
//! (`orchestrator/tests/fuzz_corpus.rs`, which includes this file) share these functions, so a saved
//! input replays exactly as the fuzzer ran it.
//!
//! Inputs made of several files are split on [`SEP`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use dflash_common::dflash;
use dflash_common::ring::{self, Ring};
use dflash_orch::ingest::chat::{Template, parse_conversation};
use dflash_orch::ingest::jsonl::parse_pretokenized;
use dflash_orch::planner::{BucketSpec, Interleave, Mode, OverlongPolicy};
use dflash_orch::runtime::control::parse_request;
use dflash_orch::runtime::journal;
use dflash_orch::runtime::spec::{GpuSpec, Topology};
use dflash_orch::store::{self, Store};
use dflash_orch::workload::parse_lengths;

/// A harness: feeds one fuzz input to its parsers.
pub type Harness = fn(&[u8]);

/// Every target: its name (the fuzz target's, and its folder under `fuzz/regressions/`) and its
/// harness.
pub const TARGETS: &[(&str, Harness)] = &[
    ("lengths", lengths),
    ("jsonl", jsonl),
    ("chat", chat),
    ("store", store),
    ("ring", ring),
    ("journal", journal),
    ("control", control),
    ("options", options),
    ("model", model),
];

/// Separates the files of a multi-file input.
pub const SEP: &[u8] = b"\n#FILE#\n";

/// This process's scratch directory (created on first use; the caller removes it when done).
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("dflash-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        dir
    })
}

/// An empty directory of the scratch directory, one per target (so targets may run in parallel).
fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

/// The first byte (0 when empty) and the rest.
fn flags(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&f, rest)) => (f, rest),
        None => (0, data),
    }
}

/// `data` cut at the first `N - 1` separators; missing parts are empty.
fn parts<const N: usize>(data: &[u8]) -> [&[u8]; N] {
    let mut out = [&[][..]; N];
    let mut rest = data;
    for (i, slot) in out.iter_mut().enumerate() {
        if i + 1 == N {
            *slot = rest;
            break;
        }
        match rest.windows(SEP.len()).position(|w| w == SEP) {
            Some(at) => {
                *slot = &rest[..at];
                rest = &rest[at + SEP.len()..];
            }
            None => {
                *slot = rest;
                rest = &[];
            }
        }
    }
    out
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write a scratch file");
}

/// `--lengths FILE`.
pub fn lengths(data: &[u8]) {
    let _ = parse_lengths(data);
}

/// One line of pre-tokenized JSONL.
pub fn jsonl(data: &[u8]) {
    let _ = parse_pretokenized(data);
}

/// One conversation row, rendered with both templates when it parses.
pub fn chat(data: &[u8]) {
    if let Ok(turns) = parse_conversation(data) {
        let borrowed: Vec<_> = turns.iter().map(|(r, t)| (*r, t.as_str())).collect();
        for template in [Template::ChatMl, Template::Llama3] {
            let _ = template.render(&borrowed);
        }
    }
}

/// A store directory: `meta.json`, then `index.bin`, `tokens.bin` and `loss_mask.bin`.
///
/// Flags (first byte): bit 0 derives `meta.json` from the other files' sizes (so the fuzzer gets
/// past the size checks to the index check), bit 1 also takes `loss_tokens` from the index,
/// bit 2 leaves out `index.bin`, bit 3 sizes the mask to the tokens. Without bit 0, the first part
/// is `meta.json` as is. A store that opens must then answer every accessor.
pub fn store(data: &[u8]) {
    let dir = fresh_dir("store");
    let (flags, rest) = flags(data);
    let [meta, index, tokens, mask] = parts::<4>(rest);
    let mut index = index.to_vec();
    let mut tokens = tokens.to_vec();
    let mut mask = mask.to_vec();
    if flags & 1 != 0 {
        index.truncate(index.len() / 16 * 16);
        tokens.truncate(tokens.len() / 4 * 4);
        let n_tokens = tokens.len() as u64 / 4;
        if flags & 8 != 0 {
            mask.resize(n_tokens as usize, 0);
        }
        let loss_tokens = if flags & 2 != 0 {
            index
                .chunks_exact(16)
                .map(|e| u64::from(u32::from_le_bytes(e[12..16].try_into().unwrap())))
                .sum::<u64>()
        } else {
            meta.get(..8)
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()))
        };
        let meta_json = format!(
            r#"{{"format":"dflash-store","version":1,"samples":{},"tokens":{n_tokens},"loss_tokens":{loss_tokens},"vocab_size":null,"max_len":8192,"on_overlong":"truncate","min_loss_tokens":0,"truncated":0,"skipped":{{}},"skipped_examples":[],"sources":[],"files":{{"index.bin":{{"bytes":{},"crc32c":0}},"tokens.bin":{{"bytes":{},"crc32c":0}},"loss_mask.bin":{{"bytes":{},"crc32c":0}}}},"created_by":"fuzz"}}"#,
            index.len() / 16,
            index.len(),
            tokens.len(),
            mask.len(),
        );
        write(&dir.join(store::META_FILE), meta_json.as_bytes());
    } else {
        let _ = store::parse_meta(&dir, meta);
        write(&dir.join(store::META_FILE), meta);
    }
    if flags & 4 == 0 {
        write(&dir.join(store::INDEX_FILE), &index);
    }
    write(&dir.join(store::TOKENS_FILE), &tokens);
    write(&dir.join(store::MASK_FILE), &mask);
    let Ok(store) = Store::open(&dir) else {
        return;
    };
    let _ = store.verify();
    let _ = (store.len(), store.is_empty(), store.meta(), store.lengths());
    for i in 0..store.len() {
        let _ = (store.tokens(i), store.loss_mask(i));
    }
}

/// A shared-memory ring file, then every slot's batch read back as a worker reads it.
///
/// Flags (first byte): bit 0 writes the magic, bit 1 the layout version, bit 2 slot fields that
/// fit the file (slot size `64 * (1 + (flags >> 4))`, the file padded to whole slots). The rest is
/// the file.
pub fn ring(data: &[u8]) {
    let dir = fresh_dir("ring");
    let (flags, rest) = flags(data);
    let mut bytes = rest.to_vec();
    if bytes.len() < ring::HEADER_BYTES && flags & 7 != 0 {
        bytes.resize(ring::HEADER_BYTES, 0);
    }
    if flags & 1 != 0 {
        bytes[..8].copy_from_slice(&ring::MAGIC.to_le_bytes());
    }
    if flags & 2 != 0 {
        bytes[8..12].copy_from_slice(&ring::LAYOUT_VERSION.to_le_bytes());
    }
    if flags & 4 != 0 {
        let slot_bytes = 64 * (1 + usize::from(flags >> 4));
        let slots = (bytes.len() - ring::HEADER_BYTES).div_ceil(slot_bytes);
        bytes.resize(ring::HEADER_BYTES + slots * slot_bytes, 0);
        bytes[12..16].copy_from_slice(&(slots as u32).to_le_bytes());
        bytes[16..24].copy_from_slice(&(slot_bytes as u64).to_le_bytes());
    }
    let path = dir.join("ring");
    write(&path, &bytes);
    let Ok(ring) = Ring::open(&path) else {
        return;
    };
    let _ = ring.data_bytes();
    for slot in 0..ring.slot_count().min(64) {
        let generation = ring.generation(slot);
        let _ = ring.written(slot);
        let Ok(meta) = ring.check(slot, generation) else {
            continue;
        };
        let data = ring.data(slot);
        let mut tokens = Vec::new();
        let _ = ring::read_tokens(data, &meta, &mut tokens);
        let _ = ring::read_lengths(data, &meta);
        let _ = ring::read_masks(data, &meta);
    }
}

/// The run journal. Flags (first byte): bit 0 puts a valid run line first. The rest is the file.
pub fn journal(data: &[u8]) {
    let dir = fresh_dir("journal");
    let (flags, rest) = flags(data);
    let mut bytes = Vec::new();
    if flags & 1 != 0 {
        bytes.extend_from_slice(b"{\"event\":\"run\",\"version\":1,\"config\":{}}\n");
    }
    bytes.extend_from_slice(rest);
    let path = dir.join("journal.jsonl");
    write(&path, &bytes);
    let _ = journal::read(&path);
}

/// One control-socket request line.
pub fn control(data: &[u8]) {
    let _ = parse_request(data);
}

/// Whether `addr.to_socket_addrs()` would ask the resolver (a host name with a valid port): the
/// fuzzer must not wait on DNS.
fn needs_resolver(addr: &str) -> bool {
    let addr = addr.trim();
    if addr.parse::<u16>().is_ok() || addr.parse::<SocketAddr>().is_ok() {
        return false;
    }
    match addr.rsplit_once(':') {
        Some((_, port)) => port.parse::<u16>().is_ok(),
        None => false,
    }
}

/// Command-line option values: the text given to every option parser, and what is done with the
/// value next (validation against a machine or a max length).
pub fn options(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(b) = text.parse::<BucketSpec>() {
        let _ = (
            b.validate(8192),
            b.validate(1),
            b.validate(u32::MAX),
            b.to_string(),
        );
    }
    if let Ok(g) = text.parse::<GpuSpec>() {
        let _ = (
            g.devices(Ok(8)),
            g.devices(Ok(0)),
            g.devices(Err("none".into())),
        );
    }
    if let Ok(t) = text.parse::<Topology>() {
        // `4294967295:1` once overflowed the sum of targets and drafters
        // (fuzz/regressions/options/crash-topology-overflow).
        for workers in [1, 2, 8, 1024] {
            if let Ok(r) = Topology::resolve(Some(t), workers) {
                assert_eq!(
                    u64::from(r.targets) + u64::from(r.drafters),
                    u64::from(workers)
                );
            }
        }
    }
    let _ = text.parse::<Mode>();
    let _ = text.parse::<Interleave>();
    let _ = text.parse::<OverlongPolicy>();
    if !needs_resolver(text) {
        let _ = dflash_orch::observe::prom::parse_addr(text);
    }
}

/// A target model directory. The first byte picks what the rest is: 0, a safetensors file
/// (`tensor_shapes`); 1, `config.json`; 2, `model.safetensors.index.json` (`weight_files`);
/// 3, `config.json` then `model.safetensors` then one byte of layers (`check_weights`).
pub fn model(data: &[u8]) {
    let dir = fresh_dir("model");
    let (flags, rest) = flags(data);
    match flags % 4 {
        0 => {
            let path = dir.join("model.safetensors");
            write(&path, rest);
            let _ = dflash::tensor_shapes(&path);
        }
        1 => {
            write(&dir.join("config.json"), rest);
            let _ = dflash::read_config(&dir);
        }
        2 => {
            write(&dir.join("model.safetensors.index.json"), rest);
            write(&dir.join("shard.safetensors"), b"");
            let _ = dflash::weight_files(&dir);
        }
        _ => {
            let [config, weights, layers] = parts::<3>(rest);
            write(&dir.join("config.json"), config);
            write(&dir.join("model.safetensors"), weights);
            if let Ok(config) = dflash::read_config(&dir) {
                let layers = layers.first().map_or(usize::MAX, |&l| usize::from(l));
                let _ = dflash::check_weights(&dir, &config, layers);
            }
        }
    }
}
