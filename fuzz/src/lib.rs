//! Fuzz harnesses: one function per family of parsers of outside input.
//!
//! Each function takes the raw fuzz input, turns it into what the parser reads (bytes, text, or
//! files in a scratch directory) and calls the parser; the only check is that nothing panics. The
//! fuzz targets (`fuzz/fuzz_targets/*.rs`) and the regression test
//! (`orchestrator/tests/fuzz_corpus.rs`, which includes this file) share these functions, so a saved
//! input replays exactly as the fuzzer ran it.
//!
//! Inputs made of several files are split on [`SEP`].

use std::ffi::{OsStr, OsString};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dflash_common::dflash;
use dflash_common::ring::{self, Ring};
use dflash_orch::cli::Command;
use dflash_orch::commands::eval::EvalArgs;
use dflash_orch::commands::generate::GenerateArgs;
use dflash_orch::commands::launch::{self, LaunchArgs};
use dflash_orch::commands::plan::{self, PlanArgs};
use dflash_orch::ingest::chat::{Template, parse_conversation};
use dflash_orch::ingest::jsonl::parse_pretokenized;
use dflash_orch::options::{INTERVAL_S, JOB_TIMEOUT_S};
use dflash_orch::planner::{BucketSpec, Interleave, Mode, OverlongPolicy, Planner};
use dflash_orch::runtime::RunConfig;
use dflash_orch::runtime::control::parse_request;
use dflash_orch::runtime::journal;
use dflash_orch::runtime::launch_plan::check_options;
use dflash_orch::runtime::nodes;
use dflash_orch::runtime::resume;
use dflash_orch::runtime::spec::{Device, GpuSpec, Topology};
use dflash_orch::store::{self, Store};
use dflash_orch::workload::{parse_lengths, synthetic_lengths};

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
    ("decoding", decoding),
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

/// One control-socket request line. The same bytes as the nodes' link (see [`link`]), as a
/// `--rendezvous` value and as a Slurm node list.
pub fn control(data: &[u8]) {
    let _ = parse_request(data);
    link(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = nodes::parse_rendezvous(text);
        let _ = nodes::first_slurm_host(text);
    }
}

/// The secret of [`link`]'s sessions, and its nonces: node 0's, the joining node's.
const LINK_SECRET: [u8; 32] = [0x5a; 32];
const LINK_NONCES: ([u8; 32], [u8; 32]) = ([1; 32], [2; 32]);

/// The nodes' link, read as each end reads it, in two ways.
///
/// As they come: the first line as node 0's challenge (what a joining node reads first) and as a
/// hello (what node 0 reads first; one that opens goes through `mismatch`, `common_step` and
/// `check_go`), then every line as the next message of each direction, under the session of
/// [`LINK_SECRET`] and [`LINK_NONCES`] (the regression inputs hold lines sealed so).
///
/// Sealed, then tampered with: the lines after the first byte are sealed in order as the joining
/// node's messages (their text as it is), then the first byte's low two bits choose what is done
/// to the stream: nothing, a bit flipped (at a place the rest of the byte picks), the first line
/// sent again at the end (a replay), or the first two lines swapped; bit 2 also cuts the stream
/// short. Node 0 reads it back until the first refusal, and must have opened only the lines that
/// were sealed, each at its own place: anything else would be a message obeyed that its sender
/// never sent, and panics.
pub fn link(data: &[u8]) {
    let Ok(secret) = nodes::Secret::new(LINK_SECRET.to_vec()) else {
        unreachable!("the secret has 32 bytes")
    };
    let (zero, one) = LINK_NONCES;
    let session = nodes::Session::new(&secret, &zero, &one);
    let ours = nodes::Hello {
        version: nodes::VERSION,
        node: 0,
        nodes: 2,
        drafters: 1,
        run: [("seed".to_owned(), "00".to_owned())].into(),
        checkpoints: vec![3, 6],
        resume: true,
    };
    let (_, mut at_zero) = session.node0();
    let (_, mut at_node) = session.node();
    let mut stream = std::io::BufReader::new(data);
    let mut first = true;
    while let Ok(Some(line)) = nodes::read_line(&mut stream, nodes::MAX_LINE) {
        if std::mem::take(&mut first) {
            let _ = nodes::parse_challenge(&line);
            if let Ok((theirs, _)) = nodes::open_hello(&secret, &zero, &line) {
                let _ = nodes::mismatch(&ours, &theirs);
                let step = nodes::common_step(&[&ours.checkpoints, &theirs.checkpoints]);
                let _ = nodes::check_go(&theirs, 7, step);
            }
        }
        let _ = at_zero.open(&line);
        let _ = at_node.open(&line);
    }

    let (how, rest) = flags(data);
    let (mut seal, _) = session.node();
    let sealed: Vec<Vec<u8>> = rest
        .split(|&b| b == b'\n')
        .take(64)
        .map(|text| seal.seal_text(text))
        .collect();
    let mut sent = sealed.clone();
    match how & 3 {
        1 => {
            let line = &mut sent[0];
            let last = line.len() - 1;
            let at = (usize::from(how >> 3) * line.len() / 32).min(last);
            line[at] ^= 1 << (how >> 5);
        }
        2 => sent.push(sealed[0].clone()),
        3 if sent.len() > 1 => sent.swap(0, 1),
        _ => {}
    }
    let mut bytes = sent.concat();
    if how & 4 != 0 {
        bytes.truncate(bytes.len() * usize::from(how >> 3) / 32);
    }
    let (_, mut open) = session.node0();
    let mut stream = std::io::BufReader::new(bytes.as_slice());
    let mut opened = 0;
    while let Ok(Some(line)) = nodes::read_line(&mut stream, nodes::MAX_LINE) {
        if open.open(&line).is_err() {
            break;
        }
        assert!(
            sealed.get(opened) == Some(&line),
            "line {opened} opened, but it is not the line sealed there"
        );
        opened += 1;
    }
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

/// The commands the `options` target drives. The input's first byte, less `b'0'` (wrapping),
/// modulo `OPTION_COMMANDS.len() + 1` (10) picks one, so the ASCII digits `0` to `8` pick them in
/// this order; the last value (`9`) hands the rest to the value parsers alone ([`option_values`]).
pub const OPTION_COMMANDS: [&str; 9] = [
    "launch", "status", "plan", "prepare", "demo", "generate", "eval", "top", "report",
];

/// A whole command line: the first byte picks the command (see [`OPTION_COMMANDS`]), the rest is
/// its arguments, one per line (a NUL also ends one; a final newline ends the last line, so
/// `--gpus\n\n` is `--gpus ""`), bytes as they are (not necessarily UTF-8, as on Linux).
///
/// The line goes through `cli::parse` (clap, with the numeric ranges), then through what the
/// command does with its arguments before it touches anything:
/// - `launch`: `commands::launch::config_from_args` (with `--resume`: against two journaled
///   configurations, a synthetic and a DFlash one, then `runtime::resume::given_values` and
///   `merge`), `runtime::launch_plan::check_options` with no GPU and with 8, the seconds turned
///   into `Duration`s as the supervisor does, and `DflashSettings::check` against the target's
///   config. Paths are kept inside the scratch folder: `--target-model model` is a valid tiny
///   Qwen3 `config.json`, any other `--target-model` and every `--data` a path that does not
///   exist; a `--metrics-addr` that would go to the resolver becomes `0`.
/// - `status`: `--watch` inside the interval range, turned into a `Duration` as `status` does,
///   and a deadline that far from now.
/// - `plan`: `commands::plan::config_from_args`, then `Planner::new` on a small synthetic
///   workload (`--synthetic N`, at most 256 samples; 64 without it), `plan_epoch(--epoch)`,
///   `stats` and the summary.
/// - `prepare`: `commands::prepare::check_args` (`--format`, `--chat-template`, the option
///   checks that need no input file).
/// - `demo`: `commands::demo::check_args`.
/// - `generate`: the `--temperature` check `generate` makes first (finite, not negative); then
///   `--job-timeout` inside the job-deadline range, made into a `Duration` (the server's timeout,
///   the pool's job deadline) and a deadline that far from now, `--gpus` resolved with no GPU and
///   with 8 (without `--server`) and `--dtype` for what they give, and the sizes as `usize`
///   (inside their ranges). Not driven: what reads `--target-model`, the inputs, the tokenizer
///   and `--output`, and `--server` (a connection).
/// - `eval`: `--job-timeout` as for `generate` (the worker's deadline per prompt), `--dtype` as
///   `commands::eval::prepare` resolves it, and `--max-new-tokens`, `--block-size` and `--limit`
///   as `usize` (inside their ranges). Not driven: the rest of `commands::eval::prepare` (it
///   reads the target, the drafter and the prompts) and the worker.
/// - `top`: `--interval` inside the interval range, made into a `Duration` (the poller's sleep)
///   and a deadline that far from now, and the `View` it starts with (its fields are private to
///   `commands::top`, so only `View::new` is driven). Not driven: the control socket and the
///   terminal.
/// - `report`: `cli::parse` only: everything it does with `--run-dir`, `--output` and `--title`
///   reads the run directory (its page is private to `commands::report`).
pub fn options(data: &[u8]) {
    use std::os::unix::ffi::OsStringExt;

    let (pick, rest) = flags(data);
    let pick = usize::from(pick.wrapping_sub(b'0')) % (OPTION_COMMANDS.len() + 1);
    let Some(&command) = OPTION_COMMANDS.get(pick) else {
        return option_values(rest);
    };
    let rest = rest.strip_suffix(b"\n").unwrap_or(rest);
    let mut argv = vec![OsString::from("dflash-orch"), OsString::from(command)];
    if !rest.is_empty() {
        argv.extend(
            rest.split(|&b| b == b'\n' || b == 0)
                .map(|arg| OsString::from_vec(arg.to_vec())),
        );
    }
    let Some(cli) = shown(dflash_orch::cli::parse(argv)) else {
        return;
    };
    match cli.command {
        Command::Launch(args) => launch_options(*args),
        Command::Status(args) => {
            // `status::run` sleeps this long between two reads.
            if let Some(secs) = args.watch
                && secs > 0.0
            {
                seconds_within("--watch", secs, INTERVAL_S);
            }
        }
        Command::Plan(args) => plan_options(&args),
        Command::Prepare(args) => {
            let _ = shown(dflash_orch::commands::prepare::check_args(&args));
        }
        Command::Demo(args) => {
            let _ = shown(dflash_orch::commands::demo::check_args(&args));
        }
        Command::Generate(args) => generate_options(&args),
        Command::Eval(args) => eval_options(&args),
        Command::Top(args) => {
            // `top::run` sleeps this long between two polls and shows it in its view.
            seconds_within("--interval", args.interval, INTERVAL_S);
            let _ = dflash_orch::commands::top::View::new(&args.run_dir, args.interval);
        }
        // `report` only reads its paths (and `--title` goes on the page as it is).
        Command::Report(_) => {}
        _ => {}
    }
}

/// An option's seconds as the commands use them: inside the option's range (the value parser's
/// promise), made into a `Duration` (which panics on a negative, non-finite or huge number) and
/// into a deadline that far from now (which panics with "overflow when adding duration to
/// instant" past what `Instant` holds: a huge `--job-timeout` once did).
fn seconds_within(option: &str, secs: f64, (lo, hi): (f64, f64)) {
    assert!(
        secs.is_finite() && (lo..=hi).contains(&secs),
        "{option} {secs} passed the parser outside {lo} to {hi}"
    );
    let _deadline = Instant::now() + Duration::from_secs_f64(secs);
}

/// `generate`'s arguments, as far as `generate::run` goes before it reads a file.
fn generate_options(args: &GenerateArgs) {
    // The first check of `generate::run`: a refused temperature ends the command there.
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return;
    }
    // The server's request timeout and the pool's job deadline.
    seconds_within("--job-timeout", args.job_timeout, JOB_TIMEOUT_S);
    // With `--server` no worker runs; otherwise the devices, as many as the machine has.
    if args.server.is_none() {
        for gpus in [Err("no GPU".to_string()), Ok(8)] {
            if let Some(devices) = shown(args.gpus.devices(gpus)) {
                let gpu = devices.iter().any(|d| matches!(d, Device::Gpu(_)));
                let _ = args.dtype.resolve(gpu);
            }
        }
    }
    // The sizes as `generate` uses them (a batch of rows, requests in flight at once).
    let max_new = args.max_new_tokens as usize;
    let (batch, concurrency) = (u64::from(args.batch_size), args.concurrency as usize);
    assert!(
        max_new >= 1 && batch >= 1 && concurrency >= 1,
        "a size below 1 passed the parser"
    );
    let _ = (
        args.seed,
        args.stop_token_ids.as_deref(),
        args.chat_template.name(),
    );
}

/// `eval`'s arguments, as far as `eval::run` goes without reading a file.
fn eval_options(args: &EvalArgs) {
    // The worker's deadline for each prompt.
    seconds_within("--job-timeout", args.job_timeout, JOB_TIMEOUT_S);
    let max_new = args.max_new_tokens as usize;
    let limit = args.limit.map(|n| n as usize);
    let block_size = args.block_size.map(|b| b as usize);
    assert!(max_new >= 1, "--max-new-tokens 0 passed the parser");
    assert!(limit.is_none_or(|n| n >= 1), "--limit 0 passed the parser");
    assert!(
        block_size.is_none_or(|b| (2..=1024).contains(&b)),
        "--block-size outside 2 to 1024 passed the parser"
    );
    let _ = args.dtype.resolve(args.gpu.is_some());
    let _ = (
        args.init_seed,
        args.stop_token_ids.as_deref(),
        args.ignore_eos,
    );
}

/// `Some` of an `Ok`; an error's message is written out (to a string) as the command would.
fn shown<T, E: std::fmt::Display>(result: Result<T, E>) -> Option<T> {
    result.map_err(|e| e.to_string()).ok()
}

/// `--target-model` naming the valid tiny target (see [`options`]).
const TINY_TARGET: &str = "model";
/// Every `--rendezvous-secret-file`: a valid secret of the scratch folder.
const SECRET: &str = "secret";

/// The `options` scratch folder, holding `model/config.json` (a valid tiny Qwen3 target).
fn options_dir() -> PathBuf {
    let dir = scratch().join("options");
    let config = dir.join(TINY_TARGET).join("config.json");
    if !config.is_file() {
        std::fs::create_dir_all(dir.join(TINY_TARGET)).expect("create a scratch directory");
        write(
            &config,
            br#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-06, "tie_word_embeddings": true}"#,
        );
    }
    let secret = dir.join(SECRET);
    if !secret.is_file() {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&secret)
            .and_then(|mut f| f.write_all(&[7; 32]))
            .expect("write the scratch secret");
    }
    dir
}

/// The configurations a `--resume` is checked against: a synthetic run's and a DFlash run's, as a
/// fresh launch made them (once per process).
fn journaled_configs(dir: &Path) -> &'static [RunConfig] {
    static CONFIGS: OnceLock<Vec<RunConfig>> = OnceLock::new();
    CONFIGS.get_or_init(|| fresh_configs(dir))
}

fn fresh_configs(dir: &Path) -> Vec<RunConfig> {
    let model = dir.join(TINY_TARGET);
    let fresh = |extra: &[&OsStr]| {
        let mut argv: Vec<&OsStr> = [
            "dflash-orch",
            "launch",
            "--run-dir",
            "run",
            "--gpus",
            "cpu:3",
        ]
        .map(OsStr::new)
        .to_vec();
        argv.extend_from_slice(extra);
        let cli = dflash_orch::cli::parse(argv).expect("a valid launch command line");
        let Command::Launch(args) = cli.command else {
            unreachable!("a launch command line")
        };
        launch::config_from_args(&args, None).expect("a valid launch configuration")
    };
    vec![
        fresh(&["--synthetic", "1000"].map(OsStr::new)),
        fresh(&[
            OsStr::new("--data"),
            dir.join("absent-store").as_os_str(),
            OsStr::new("--stage"),
            OsStr::new("dflash"),
            OsStr::new("--target-model"),
            model.as_os_str(),
        ]),
    ]
}

/// `launch`'s arguments, as far as a launch goes before its first side effect.
fn launch_options(mut args: LaunchArgs) {
    let dir = options_dir();
    if let Some(model) = &args.dflash.target_model {
        args.dflash.target_model = Some(if model.as_os_str() == TINY_TARGET {
            dir.join(TINY_TARGET)
        } else {
            dir.join("absent-model")
        });
    }
    if args.data.is_some() {
        args.data = Some(dir.join("absent-store"));
    }
    if args.metrics_addr.as_deref().is_some_and(needs_resolver) {
        args.metrics_addr = Some("0".into());
    }
    if args.rendezvous_secret_file.is_some() {
        args.rendezvous_secret_file = Some(dir.join(SECRET));
    }
    if !args.resume {
        if let Some(config) = shown(launch::config_from_args(&args, None)) {
            check_run(&config);
        }
        return;
    }
    for stored in journaled_configs(&dir) {
        let Some(session) = shown(launch::config_from_args(&args, Some(stored))) else {
            continue;
        };
        let given = resume::given_values(&args.given, &session);
        if let Some((config, _changes)) = shown(resume::merge(stored.clone(), &given, &session)) {
            check_run(&config);
        }
    }
}

/// What a launch checks of its configuration before it touches anything, and the values the run
/// then makes of it.
fn check_run(config: &RunConfig) {
    let mut checked = false;
    for gpus in [Err("no GPU".to_string()), Ok(8)] {
        if let Some(c) = shown(check_options(config, gpus)) {
            assert_eq!(
                u64::from(c.topology.targets) + u64::from(c.topology.drafters),
                c.devices.len() as u64,
                "the topology's workers are the devices"
            );
            checked = true;
        }
    }
    if !checked {
        return;
    }
    // The rings' sizes, in checked arithmetic, for any number of targets the topology allows.
    for targets in [1, 7, 255] {
        let width = config
            .dflash
            .as_ref()
            .map(|d| 5 * 4096 * d.feature_dtype.bytes());
        let _ = shown(dflash_orch::runtime::dry_run::ring_bytes(
            targets,
            config.planner.token_budget,
            width,
        ));
    }
    // The supervisor, the stop and the monitor turn these seconds into `Duration`s (which panics
    // on a negative, non-finite or huge number).
    let seconds = [
        Some(config.heartbeat_timeout_s),
        Some(config.restart_window_s),
        Some(config.stop_grace_s),
        Some(config.monitor_interval_s.max(0.01)),
        config.job_timeout_s,
    ];
    for s in seconds.into_iter().flatten() {
        let _ = Duration::from_secs_f64(s);
    }
    if let Some(settings) = &config.dflash
        && let Some(target) = shown(dflash::read_config(&settings.target_model))
        && shown(settings.check(&target)).is_some()
    {
        let _ = (
            settings.feature_width(&target),
            settings.target_layers_needed(target.num_hidden_layers),
            settings.warmup_steps(),
        );
    }
}

/// `plan`'s arguments: the planner's configuration, then one epoch of a small workload planned
/// with it.
fn plan_options(args: &PlanArgs) {
    let Some(config) = shown(plan::config_from_args(&args.planner)) else {
        return;
    };
    let samples = args.synthetic.map_or(64, |n| n.min(256));
    let lengths = synthetic_lengths(samples, args.synthetic_seed);
    if let Some(planner) = shown(Planner::new(lengths, config)) {
        let epoch = planner.plan_epoch(args.epoch);
        let _ = plan::summary(&planner.stats(&epoch), "fuzz");
    }
}

/// Command-line option values alone (selector `9`): the text given to every option parser, and
/// what is done with the value next (validation against a machine or a max length).
pub fn option_values(data: &[u8]) {
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
            let _ = dflash_orch::model_dir::tensor_shapes(&path);
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
                let _ = dflash_orch::model_dir::check_weights(&dir, &config, layers);
            }
        }
    }
}

/// What `eval`, `generate` and `launch --eval-every` read. The first byte picks what the rest is:
/// 0, a drafter checkpoint's `config.json` (`DraftConfig::parse`, then checked against a small
/// target); 1, an `eval --prompts` file (`read_prompts`, then `check_prompts`); 2, a generate
/// record `OUTPUT.partial.json` then the partial file (`starting_point` with `--resume`); 3, a
/// `generate --input` file of pre-tokenized rows (`read_items`).
pub fn decoding(data: &[u8]) {
    use dflash_orch::commands::eval as cmd_eval;
    use dflash_orch::commands::generate::{self, output};
    let dir = fresh_dir("decoding");
    let (flags, rest) = flags(data);
    write(
        &dir.join("config.json"),
        br#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 600, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}"#,
    );
    let target = dflash::read_config(&dir).expect("a valid config");
    match flags % 4 {
        0 => {
            if let Ok(config) = dflash_common::eval::DraftConfig::parse(rest) {
                let _ = config.check_target(&target);
            }
        }
        1 => {
            let path = dir.join("prompts.jsonl");
            write(&path, rest);
            let tokenizer = dir.join("tokenizer.json");
            if let Ok(prompts) = cmd_eval::read_prompts(&path, Template::ChatMl, &tokenizer, None) {
                let _ = cmd_eval::check_prompts(&prompts, &path, &target, 64);
            }
        }
        2 => {
            let [record, partial] = parts::<2>(rest);
            let paths = output::Paths::of(&dir.join("out.jsonl"));
            write(&paths.record, record);
            write(&paths.partial, partial);
            let settings = output::Settings {
                producer: "target".into(),
                engine: Some("candle".into()),
                target_model: None,
                server: None,
                server_model: None,
                inputs: Vec::new(),
                rows: 4,
                batch_size: 2,
                max_new_tokens: 8,
                temperature: 0.0,
                seed: 0,
                stop_token_ids: Vec::new(),
                dtype: "f32".into(),
                input_hash: String::new(),
                chat_template: "chatml".into(),
                chat_template_hash: String::new(),
                tokenizer_hash: None,
                target_weights: None,
            };
            let _ = output::starting_point(&paths, &settings, true, false);
        }
        _ => {
            let path = dir.join("rows.jsonl");
            write(&path, rest);
            let _ = generate::read_items(&[path], None, || Err("no tokenizer".into()));
        }
    }
}
