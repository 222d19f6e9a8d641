//! Runs of several nodes: one orchestrator per node, each with its own targets feeding its own
//! drafters, every node's drafters in one `torch.distributed` group (only gradients cross
//! nodes). Node 0 listens at the rendezvous and the others join it over one TCP link each. The
//! link checks, before anything starts, that every node trains the same run; agrees where the
//! run resumes and where the drafters' group meets; carries the other nodes' status to node 0;
//! and tells every node when one stops, fails or is lost.
//!
//! Only the run's own nodes are heard, by a secret of the run that every node reads
//! (`--rendezvous-secret-file`, a [`Secret`]):
//! - Node 0 answers every connection with a challenge: a fresh random nonce, and the secret's key
//!   id (so that a node given another secret is told so at once).
//! - The joining node answers with a fresh nonce of its own and its hello, under an HMAC-SHA256
//!   keyed by the secret over both nonces and the hello: it proves the key for this connection
//!   only, so a hello recorded from another connection is worth nothing.
//! - Every later message, both ways, carries an HMAC keyed by a session key derived from the
//!   secret and both nonces, over its direction, its sequence number and its text ([`Sealer`],
//!   [`Opener`]). Node 0's first answer proves the key to the joining node in turn; a message
//!   forged, replayed, reordered, reflected or cut short fails, and its link is closed, never
//!   obeyed.
//! - Node 0 proves each connection on a thread of its own within [`HANDSHAKE_TIMEOUT`], so that
//!   silent or slow connections cannot keep a node out, and ends the whole join at
//!   `--rendezvous-timeout`. A connection that fails is dropped and logged; node 0 goes on
//!   waiting for the real node.
//!
//! The wire is lines of at most [`MAX_LINE`] bytes: node 0's challenge (JSON), then
//! `MAC SPACE JSON` lines, the MAC in 64 hex digits.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Sha256;

use crate::format::clip;

/// The version of the link's messages: nodes of other versions are refused.
pub const VERSION: u32 = 2;
/// The longest message line accepted.
pub const MAX_LINE: u64 = 4 << 20;
/// The longest line of a handshake (a challenge, a hello): what a connection not yet proven may
/// make node 0 hold.
pub const MAX_HANDSHAKE_LINE: u64 = 256 << 10;
/// How long one connection may take to prove itself to node 0, from its accept.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections node 0 proves at once; one more is closed at once (the joining node retries).
pub const MAX_HANDSHAKES: usize = 512;
/// Seconds between a node's status (or node 0's keepalive) on the link.
pub const TICK: Duration = Duration::from_secs(1);
/// The most nodes a run may have.
pub const MAX_NODES: u32 = 4096;
/// The fewest and most bytes of a secret.
pub const MIN_SECRET: u64 = 32;
pub const MAX_SECRET: u64 = 64 << 10;
/// How to make a secret, for the messages that ask for one.
pub const MAKE_SECRET: &str = "make one with `umask 077; head -c 32 /dev/urandom > FILE` where every node reads it (see docs/multi-node.md)";
/// A host name has at most this many bytes (DNS).
const MAX_HOST: usize = 253;
/// The longest reason quoted from another node.
const MAX_WHY: usize = 1000;

const NONCE: usize = 32;
const TAG: usize = 32;
/// Directions of a connection, in its MACs: a message cannot be reflected to its sender.
const FROM_NODE0: u8 = 0;
const TO_NODE0: u8 = 1;
/// Labels of the MACs: each key and tag serves one purpose.
const KEY_ID: &[u8] = b"dflash-orch link key id";
const HELLO: &[u8] = b"dflash-orch link hello";
const SESSION: &[u8] = b"dflash-orch link session";
const DRAFTERS: &[u8] = b"dflash-orch drafters store";

/// A run's place among several nodes (`--nodes`, `--node-rank`, `--rendezvous`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeConfig {
    pub nodes: u32,
    pub rank: u32,
    /// Node 0's address, `HOST:PORT`: the link's port; the drafters' group meets on another
    /// port of the same host that node 0 picks.
    pub rendezvous: String,
    /// How long joining may take, in seconds.
    pub timeout_s: f64,
    /// The run's secret (`--rendezvous-secret-file`), read anew by every launch: never journaled.
    #[serde(skip)]
    pub secret: Option<Secret>,
}

impl NodeConfig {
    /// Checks the values alone (no network).
    pub fn check(&self) -> Result<(), String> {
        if !(2..=MAX_NODES).contains(&self.nodes) {
            return Err(format!(
                "--nodes {}: a run of several nodes has 2 to {MAX_NODES} (one node needs no --nodes)",
                self.nodes
            ));
        }
        if self.rank >= self.nodes {
            return Err(format!(
                "--node-rank {} is not a node of --nodes {} (ranks 0 to {})",
                self.rank,
                self.nodes,
                self.nodes - 1
            ));
        }
        parse_rendezvous(&self.rendezvous).map_err(|e| format!("--rendezvous {e}"))?;
        Ok(())
    }

    pub fn host(&self) -> String {
        parse_rendezvous(&self.rendezvous)
            .map(|(h, _)| h)
            .unwrap_or_default()
    }
}

/// `HOST:PORT` (an IPv6 host in brackets) into its host and port (1 to 65535).
pub fn parse_rendezvous(text: &str) -> Result<(String, u16), String> {
    let bad = || {
        format!(
            "{:?} is not HOST:PORT (a host of at most {MAX_HOST} bytes, a port of 1 to 65535)",
            clip(text, 80)
        )
    };
    let (host, port) = text.trim().rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(bad)?;
    if host.is_empty() || host.len() > MAX_HOST || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

/// The first host of a Slurm node list (`SLURM_JOB_NODELIST`): `node[01-04,07],gpu9` gives
/// `node01`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list
        .char_indices()
        .scan(0i32, |depth, (i, c)| {
            match c {
                '[' => *depth += 1,
                ']' => *depth -= 1,
                _ => {}
            }
            Some((i, c, *depth))
        })
        .find(|&(_, c, depth)| c == ',' && depth == 0)
        .map_or(list.len(), |(i, ..)| i);
    let first = &list[..end];
    let host = match first.split_once('[') {
        None => first.to_owned(),
        Some((prefix, rest)) => {
            let range = rest.strip_suffix(']')?;
            let lo = range.split([',', '-']).next()?;
            if lo.is_empty() || !lo.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            format!("{prefix}{lo}")
        }
    };
    (!host.is_empty() && host.len() <= MAX_HOST).then_some(host)
}

/// The run's secret: the key of every MAC on the link. Shown nowhere, written nowhere.
#[derive(Clone)]
pub struct Secret(Arc<Vec<u8>>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(…)")
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Secret {
    /// A secret of `bytes`: at least [`MIN_SECRET`] of them.
    pub fn new(bytes: Vec<u8>) -> Result<Self, String> {
        let n = bytes.len() as u64;
        if n < MIN_SECRET {
            return Err(format!(
                "holds {n} bytes, and a secret needs at least {MIN_SECRET}: {MAKE_SECRET}"
            ));
        }
        if n > MAX_SECRET {
            return Err(format!(
                "holds {n} bytes, and a secret has at most {MAX_SECRET}: {MAKE_SECRET}"
            ));
        }
        Ok(Self(Arc::new(bytes)))
    }

    /// Reads the secret of `path`: a regular file (not a symbolic link) of this user's that
    /// nobody else may read or change, of [`MIN_SECRET`] to [`MAX_SECRET`] bytes. The error
    /// names the file and why.
    pub fn read(path: &Path) -> Result<Self, String> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let shown = clip(&path.display().to_string(), 200);
        let at = |why: String| format!("{shown}: {why}");
        // O_NOFOLLOW: a link planted at the name is refused, not followed; O_NONBLOCK: a FIFO
        // does not block the open. What is checked is the file opened, not the name.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(|e| {
                at(if e.raw_os_error() == Some(libc::ELOOP) {
                    "is a symbolic link: give the secret file itself".into()
                } else {
                    format!("cannot be read ({e}): {MAKE_SECRET}")
                })
            })?;
        let meta = file.metadata().map_err(|e| at(e.to_string()))?;
        if !meta.is_file() {
            return Err(at("is not a regular file".into()));
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me {
            return Err(at(format!(
                "belongs to uid {}, not to this user (uid {me}): the secret must be the user's own",
                meta.uid()
            )));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(at(format!(
                "has mode {:04o}: other users may read or change it; make it owner-only (chmod 600)",
                meta.mode() & 0o7777
            )));
        }
        let mut bytes = Vec::new();
        (&file)
            .take(MAX_SECRET + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| at(e.to_string()))?;
        Self::new(bytes).map_err(at)
    }

    /// The secret's public id: tells two secrets apart without telling them.
    pub fn key_id(&self) -> String {
        hex(&mac(&self.0, &[KEY_ID])[..8])
    }

    /// The key of the drafters' store for the group that meets at `port` (every node derives
    /// the same one; `python/dflash_orch/authstore.py` checks it), as hex.
    pub fn drafters_key(&self, port: u16) -> String {
        hex(&mac(&self.0, &[DRAFTERS, &port.to_be_bytes()]))
    }
}

type HmacSha256 = Hmac<Sha256>;

/// An HMAC-SHA256 of `key` over `parts`, each prefixed by its length (so that their
/// boundaries count).
fn keyed(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes a key of any length: this cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
    for part in parts {
        m.update(&(part.len() as u64).to_le_bytes());
        m.update(part);
    }
    m
}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; TAG] {
    keyed(key, parts).finalize().into_bytes().into()
}

/// Whether `tag` is the MAC of `parts`, compared in constant time.
fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    keyed(key, parts).verify_slice(tag).is_ok()
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `N` bytes from exactly 2·N lowercase hex digits (one spelling per value: a MAC is read back
/// only as it was written).
fn unhex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(u32::from(c - b'0')),
        b'a'..=b'f' => Some(u32::from(c - b'a' + 10)),
        _ => None,
    };
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *o = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(out)
}

/// A nonce from the operating system's random source.
pub fn nonce() -> Result<[u8; NONCE], String> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| format!("the system's random source failed: {e}"))?;
    Ok(n)
}

/// The keys of one connection, from the secret and both ends' nonces.
pub struct Session {
    key: [u8; TAG],
}

impl Session {
    pub fn new(secret: &Secret, node0_nonce: &[u8], node_nonce: &[u8]) -> Self {
        Self {
            key: mac(&secret.0, &[SESSION, node0_nonce, node_nonce]),
        }
    }

    /// Node 0's end: what it sends and what it reads.
    pub fn node0(&self) -> (Sealer, Opener) {
        (self.sealer(FROM_NODE0), self.opener(TO_NODE0))
    }

    /// The joining node's end.
    pub fn node(&self) -> (Sealer, Opener) {
        (self.sealer(TO_NODE0), self.opener(FROM_NODE0))
    }

    fn sealer(&self, direction: u8) -> Sealer {
        Sealer {
            key: self.key,
            direction,
            seq: 0,
        }
    }

    fn opener(&self, direction: u8) -> Opener {
        Opener {
            key: self.key,
            direction,
            seq: 0,
        }
    }
}

/// Seals one direction's messages: each carries the MAC of its direction, its sequence number
/// and its text.
pub struct Sealer {
    key: [u8; TAG],
    direction: u8,
    seq: u64,
}

impl Sealer {
    /// The line of `m`, newline included.
    pub fn seal(&mut self, m: &Message) -> std::io::Result<Vec<u8>> {
        let json = serde_json::to_vec(m).map_err(std::io::Error::other)?;
        Ok(self.seal_text(&json))
    }

    /// The line of a message's text as given (tests and fuzzing seal what no [`Message`] is).
    pub fn seal_text(&mut self, json: &[u8]) -> Vec<u8> {
        let tag = mac(
            &self.key,
            &[&[self.direction], &self.seq.to_le_bytes(), json],
        );
        self.seq += 1;
        let mut line = hex(&tag).into_bytes();
        line.push(b' ');
        line.extend_from_slice(json);
        line.push(b'\n');
        line
    }
}

/// Opens one direction's messages, in order: a line whose MAC is not that of the next sequence
/// number is refused.
pub struct Opener {
    key: [u8; TAG],
    direction: u8,
    seq: u64,
}

impl Opener {
    /// The message of one line (its newline optional).
    pub fn open(&mut self, line: &[u8]) -> Result<Message, String> {
        let (tag, json) = split_tagged(line)?;
        if !verify(
            &self.key,
            &[&[self.direction], &self.seq.to_le_bytes(), json],
            &tag,
        ) {
            return Err(format!(
                "message {} fails authentication (forged, replayed, reordered or altered)",
                self.seq
            ));
        }
        self.seq += 1;
        parse_message(json).map(Message::clipped)
    }
}

/// A line's MAC and text.
fn split_tagged(line: &[u8]) -> Result<([u8; TAG], &[u8]), String> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let tag = line
        .get(..2 * TAG)
        .filter(|_| line.get(2 * TAG) == Some(&b' '))
        .and_then(unhex::<TAG>)
        .ok_or_else(|| {
            format!(
                "a line without a MAC (not a node of this run, or an older dflash-orch): {:?}",
                clip(&String::from_utf8_lossy(line), 120)
            )
        })?;
    Ok((tag, &line[2 * TAG + 1..]))
}

/// Node 0's first line on every connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Challenge {
    pub kind: String,
    pub version: u32,
    /// Node 0's nonce, in hex.
    pub nonce: String,
    /// [`Secret::key_id`] of node 0's secret.
    pub key_id: String,
}

impl Challenge {
    fn new(nonce: &[u8], secret: &Secret) -> Self {
        Self {
            kind: "challenge".into(),
            version: VERSION,
            nonce: hex(nonce),
            key_id: secret.key_id(),
        }
    }

    fn line(&self) -> Vec<u8> {
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        line.push(b'\n');
        line
    }
}

/// A challenge from its line, and its nonce.
pub fn parse_challenge(line: &[u8]) -> Result<(Challenge, [u8; NONCE]), String> {
    let bad = |why: String| {
        format!(
            "not a challenge of node 0 ({why}): {:?}",
            clip(&String::from_utf8_lossy(line), 120)
        )
    };
    let c: Challenge = serde_json::from_slice(line).map_err(|e| bad(e.to_string()))?;
    if c.kind != "challenge" {
        return Err(bad(format!("kind {:?}", clip(&c.kind, 40))));
    }
    let nonce = unhex::<NONCE>(c.nonce.as_bytes()).ok_or_else(|| bad("its nonce".into()))?;
    Ok((c, nonce))
}

/// The joining node's answer to a challenge: its nonce and hello.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Joining {
    nonce: String,
    hello: Hello,
}

/// The joining node's hello line, answering node 0's nonce `node0_nonce` with its own.
pub fn seal_hello(
    secret: &Secret,
    node0_nonce: &[u8],
    node_nonce: &[u8],
    hello: &Hello,
) -> std::io::Result<Vec<u8>> {
    let json = serde_json::to_vec(&Joining {
        nonce: hex(node_nonce),
        hello: hello.clone(),
    })
    .map_err(std::io::Error::other)?;
    let tag = mac(&secret.0, &[HELLO, node0_nonce, &json]);
    let mut line = hex(&tag).into_bytes();
    line.push(b' ');
    line.extend_from_slice(&json);
    line.push(b'\n');
    Ok(line)
}

/// Node 0's check of a hello line answering its nonce: the hello and the joining node's nonce,
/// or why it is not one of the run's nodes.
pub fn open_hello(
    secret: &Secret,
    node0_nonce: &[u8],
    line: &[u8],
) -> Result<(Hello, [u8; NONCE]), String> {
    let (tag, json) = split_tagged(line)?;
    if !verify(&secret.0, &[HELLO, node0_nonce, json], &tag) {
        return Err(
            "its hello does not prove the run's secret (a node given another secret, a hello recorded from another connection, or not a node of this run)"
                .into(),
        );
    }
    let joining: Joining = serde_json::from_slice(json)
        .map_err(|e| format!("a malformed hello ({})", clip(&e.to_string(), 200)))?;
    let nonce = unhex::<NONCE>(joining.nonce.as_bytes())
        .ok_or_else(|| "a malformed hello (its nonce)".to_owned())?;
    Ok((joining.hello, nonce))
}

/// What a node tells node 0 when it joins: who it is and what run it trains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    pub node: u32,
    pub nodes: u32,
    /// Drafters on the node (every node has as many).
    pub drafters: u32,
    /// What decides the weights: the run fingerprint's fields, the options beside them and the
    /// code that computes (the engine's package, the worker binary, torch and transformers).
    pub run: BTreeMap<String, String>,
    /// Steps of the node's finished checkpoints.
    pub checkpoints: Vec<u64>,
    /// Whether the node resumes its run (every node does, or none).
    pub resume: bool,
}

/// One message of the link, after the handshake.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Message {
    /// Node 0's answer once every node has joined: the drafters' group meets at
    /// `group_port` of node 0's host, and every drafter starts from the checkpoint of
    /// `resume_step` (0: fresh weights).
    Go {
        group_port: u16,
        resume_step: u64,
    },
    Refused {
        why: String,
    },
    /// A node's `status` answer, for node 0's.
    Status {
        status: Value,
    },
    /// Node 0's keepalive.
    Alive,
    /// The node stops (a stop request, an interrupt): so do the others.
    Stop {
        why: String,
    },
    /// The node failed: the others cannot go on.
    Failed {
        why: String,
    },
    /// The node completed its run.
    Done,
}

impl Message {
    /// With its reason clipped to what a log line shows.
    fn clipped(self) -> Self {
        match self {
            Message::Refused { why } => Message::Refused {
                why: clip(&why, MAX_WHY),
            },
            Message::Stop { why } => Message::Stop {
                why: clip(&why, MAX_WHY),
            },
            Message::Failed { why } => Message::Failed {
                why: clip(&why, MAX_WHY),
            },
            other => other,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Message::Go { .. } => "go",
            Message::Refused { .. } => "refused",
            Message::Status { .. } => "status",
            Message::Alive => "alive",
            Message::Stop { .. } => "stop",
            Message::Failed { .. } => "failed",
            Message::Done => "done",
        }
    }
}

/// Reads one line of at most `max` bytes, its newline included; `None` at the end of the
/// stream.
pub fn read_line(from: &mut impl BufRead, max: u64) -> Result<Option<Vec<u8>>, String> {
    let mut line = Vec::new();
    let n = from
        .take(max)
        .read_until(b'\n', &mut line)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "silent past its deadline".to_owned()
            }
            _ => e.to_string(),
        })?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() != Some(&b'\n') {
        return Err(if n as u64 >= max {
            format!("a line longer than {max} bytes")
        } else {
            "the link closed in the middle of a message".to_owned()
        });
    }
    Ok(Some(line))
}

/// One message from its text.
pub fn parse_message(json: &[u8]) -> Result<Message, String> {
    serde_json::from_slice(json).map_err(|e| {
        format!(
            "a malformed message ({}): {:?}",
            clip(&e.to_string(), 200),
            clip(&String::from_utf8_lossy(json), 120)
        )
    })
}

/// A TCP stream whose reads end at a deadline over a whole exchange, so that a peer sending a
/// byte now and then cannot stretch it; without one, at the socket's own read timeout.
struct Conn {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        self.stream.read(buf)
    }
}

fn reader(stream: &TcpStream, deadline: Instant) -> std::io::Result<BufReader<Conn>> {
    Ok(BufReader::new(Conn {
        stream: stream.try_clone()?,
        deadline: Some(deadline),
    }))
}

/// Something a node's link reports to its run loop.
#[derive(Debug)]
pub enum NodeEvent {
    Message(u32, Message),
    /// The link to `node` ended (closed, silent, malformed, or failing authentication): why.
    Closed(u32, String),
}

/// The nodes have joined: where the run starts, and the link to the other nodes.
pub struct Joined {
    pub group_port: u16,
    pub resume_step: u64,
    pub link: Link,
    readers: Vec<(u32, BufReader<Conn>, Opener)>,
}

/// One other node on the link: its stream and this end's sealer.
struct Peer {
    node: u32,
    stream: TcpStream,
    sealer: Sealer,
}

impl Peer {
    fn send(&mut self, m: &Message) -> std::io::Result<()> {
        let line = self.sealer.seal(m)?;
        self.stream.write_all(&line)
    }
}

/// The live link to the other nodes: node 0 holds one stream per other node, the others one
/// to node 0.
pub struct Link {
    pub rank: u32,
    pub nodes: u32,
    peers: Vec<Peer>,
    /// Node 0: each other node's newest status and when it came.
    pub status: BTreeMap<u32, (Instant, Value)>,
    /// Nodes that completed (their link closing is not a loss).
    pub done: BTreeSet<u32>,
    last_tick: Instant,
    stopped: bool,
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {}: {e}", clip(host, 80)))?
        .next()
        .ok_or_else(|| format!("{} has no address", clip(host, 80)))
}

/// Node 0's listener at the rendezvous. A launch binds it among its checks (and its dry run
/// binds and releases it), so that a port taken or an address this machine does not have is
/// refused before anything is created.
pub fn bind(config: &NodeConfig) -> Result<TcpListener, String> {
    let (host, port) =
        parse_rendezvous(&config.rendezvous).map_err(|e| format!("--rendezvous {e}"))?;
    let addr =
        resolve(&host, port).map_err(|e| format!("--rendezvous {}: {e}", config.rendezvous))?;
    TcpListener::bind(addr).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                ": the port is in use (another run's node 0, or another program); pick another --rendezvous port"
            }
            std::io::ErrorKind::AddrNotAvailable => {
                ": this machine has no such address; node 0 runs on the host that --rendezvous names"
            }
            _ => "",
        };
        format!(
            "--rendezvous {}: node 0 cannot listen there ({e}){hint}",
            config.rendezvous
        )
    })
}

/// Joins the run's nodes (node 0 waits for every other; the others reach node 0), within
/// `config.timeout_s`. `hello` is this node's; node 0 listens on `listener` ([`bind`]), or
/// binds its own without one.
pub fn join(
    config: &NodeConfig,
    hello: Hello,
    listener: Option<TcpListener>,
) -> Result<Joined, String> {
    let (host, port) =
        parse_rendezvous(&config.rendezvous).map_err(|e| format!("--rendezvous {e}"))?;
    let secret = config.secret.clone().ok_or_else(|| {
        format!(
            "a run of several nodes needs its secret (--rendezvous-secret-file FILE): {MAKE_SECRET}"
        )
    })?;
    let timeout = Duration::from_secs_f64(config.timeout_s);
    let deadline = Instant::now() + timeout;
    if config.rank == 0 {
        let listener = match listener {
            Some(l) => l,
            None => bind(config)?,
        };
        host_join(config, listener, deadline, hello, &secret)
    } else {
        peer_join(config, &host, port, deadline, hello, &secret)
    }
}

fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100))
}

/// Fields of the run whose values are shown when they differ (the others are hashes).
const SHOWN: [&str; 2] = ["torch", "transformers"];

/// Why `theirs` cannot join `ours`' run, if it cannot.
pub fn mismatch(ours: &Hello, theirs: &Hello) -> Option<String> {
    if theirs.version != ours.version {
        return Some(format!(
            "it speaks version {} of the link, node 0 {} (run the same dflash-orch on every node)",
            theirs.version, ours.version
        ));
    }
    if theirs.nodes != ours.nodes {
        return Some(format!(
            "it was given --nodes {}, node 0 --nodes {}",
            theirs.nodes, ours.nodes
        ));
    }
    if theirs.drafters != ours.drafters {
        return Some(format!(
            "it has {} drafters, node 0 {} (every node needs the same --topology T:D drafters)",
            theirs.drafters, ours.drafters
        ));
    }
    if theirs.resume != ours.resume {
        let (r, f) = if theirs.resume {
            ("it", "node 0")
        } else {
            ("node 0", "it")
        };
        return Some(format!(
            "{r} resumes its run and {f} starts a new one (pass --resume on every node, or on none)"
        ));
    }
    let keys: BTreeSet<&String> = ours.run.keys().chain(theirs.run.keys()).collect();
    let differ: Vec<String> = keys
        .into_iter()
        .filter(|k| ours.run.get(*k) != theirs.run.get(*k))
        .take(20)
        .map(|k| {
            let value = |h: &Hello| clip(h.run.get(k).map_or("none", String::as_str), 40);
            if SHOWN.contains(&k.as_str()) {
                format!("{} ({} there, {} on node 0)", k, value(theirs), value(ours))
            } else {
                clip(k, 40)
            }
        })
        .collect();
    if !differ.is_empty() {
        return Some(format!(
            "its run differs from node 0's in {} (every node must train the same run: the same store, by content, the same options, and the same code: dflash-orch, its worker, its Python package, torch and transformers)",
            differ.join(", ")
        ));
    }
    None
}

/// The newest step every node has a checkpoint of (0: fresh weights).
pub fn common_step(all: &[&[u64]]) -> u64 {
    let Some((first, rest)) = all.split_first() else {
        return 0;
    };
    first
        .iter()
        .copied()
        .filter(|s| rest.iter().all(|other| other.contains(s)))
        .max()
        .unwrap_or(0)
}

/// Why node 0's `Go` cannot start this node's run (`hello`), if it cannot: the step must be one
/// this node can start from.
pub fn check_go(hello: &Hello, group_port: u16, resume_step: u64) -> Option<String> {
    if group_port == 0 {
        return Some("node 0 named port 0 for the drafters' group".into());
    }
    if resume_step == 0 {
        return None;
    }
    if !hello.resume {
        return Some(format!(
            "node 0 named step {resume_step} to resume from, and this node starts a new run (pass --resume on every node, or on none)"
        ));
    }
    if !hello.checkpoints.contains(&resume_step) {
        let held: Vec<String> = hello
            .checkpoints
            .iter()
            .rev()
            .take(10)
            .map(u64::to_string)
            .collect();
        return Some(format!(
            "node 0 named step {resume_step} to resume from, and this node holds no checkpoint of it (its newest: {})",
            if held.is_empty() {
                "none".to_owned()
            } else {
                held.join(", ")
            }
        ));
    }
    None
}

/// A connection that proved the run's secret, with its hello.
struct Proven {
    from: SocketAddr,
    hello: Hello,
    peer: Peer,
    reader: BufReader<Conn>,
    opener: Opener,
}

/// Node 0's side of one connection: its challenge, then the hello that must prove the secret,
/// by `deadline`.
fn prove(
    stream: TcpStream,
    from: SocketAddr,
    secret: &Secret,
    deadline: Instant,
) -> Result<Proven, String> {
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_write_timeout(Some(left(deadline))))
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let ours = nonce()?;
    (&stream)
        .write_all(&Challenge::new(&ours, secret).line())
        .map_err(|e| format!("the challenge could not be sent: {e}"))?;
    let mut reader = reader(&stream, deadline).map_err(|e| e.to_string())?;
    let line = read_line(&mut reader, MAX_HANDSHAKE_LINE)?
        .ok_or_else(|| "it closed the link without a hello".to_owned())?;
    let (hello, theirs) = open_hello(secret, &ours, &line)?;
    let (sealer, opener) = Session::new(secret, &ours, &theirs).node0();
    Ok(Proven {
        from,
        hello,
        peer: Peer {
            node: 0,
            stream,
            sealer,
        },
        reader,
        opener,
    })
}

/// Node 0: waits for every other node, proving each connection on a thread of its own.
fn host_join(
    config: &NodeConfig,
    listener: TcpListener,
    deadline: Instant,
    hello: Hello,
    secret: &Secret,
) -> Result<Joined, String> {
    let addr = listener
        .local_addr()
        .map_err(|e| format!("--rendezvous {}: {e}", config.rendezvous))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("--rendezvous {}: {e}", config.rendezvous))?;
    let (to_join, proofs) = mpsc::channel::<(SocketAddr, Result<Proven, String>)>();
    let proving = Arc::new(AtomicUsize::new(0));
    let mut joined: BTreeMap<u32, Proven> = BTreeMap::new();
    let mut dropped = 0u64;
    let mut drop_peer = |from: &SocketAddr, why: &str| {
        dropped += 1;
        let line = format!(
            "{from} at the rendezvous: {}: dropped (node 0 goes on waiting for the run's nodes)",
            clip(why, 300)
        );
        // The first few in full; a flood of connections does not flood the log.
        if dropped <= 20 {
            tracing::warn!("{line}");
        } else {
            tracing::debug!("{line}");
        }
    };
    let refuse = |p: &mut Proven, why: &str| {
        let _ = p.peer.send(&Message::Refused { why: why.into() });
    };
    let refuse_all = |joined: &mut BTreeMap<u32, Proven>, why: &str| {
        for p in joined.values_mut() {
            refuse(p, why);
        }
    };
    let timed_out = |joined: &BTreeMap<u32, Proven>| {
        let missing: Vec<u32> = (1..config.nodes)
            .filter(|n| !joined.contains_key(n))
            .collect();
        format!(
            "node 0 waited {} s (--rendezvous-timeout) at {addr}, and nodes {missing:?} of {} did not join",
            config.timeout_s, config.nodes
        )
    };
    while joined.len() + 1 < config.nodes as usize {
        if Instant::now() >= deadline {
            let why = timed_out(&joined);
            refuse_all(&mut joined, &why);
            return Err(why);
        }
        // Every connection waiting, each proven on its own thread by its own deadline.
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    if proving.load(Ordering::Relaxed) >= MAX_HANDSHAKES {
                        drop_peer(
                            &from,
                            &format!("{MAX_HANDSHAKES} connections are being proven already"),
                        );
                        continue;
                    }
                    let until = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
                    let (to_join, proving, secret) =
                        (to_join.clone(), proving.clone(), secret.clone());
                    proving.fetch_add(1, Ordering::Relaxed);
                    let spawned =
                        std::thread::Builder::new()
                            .name("rendezvous".into())
                            .spawn(move || {
                                let proof = prove(stream, from, &secret, until);
                                proving.fetch_sub(1, Ordering::Relaxed);
                                let _ = to_join.send((from, proof));
                            });
                    if let Err(e) = spawned {
                        drop_peer(&from, &format!("no thread to prove it ({e})"));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // A connection reset before its accept, or no descriptor left for now (a flood):
                // the real node retries.
                Err(e) => {
                    tracing::debug!("rendezvous accept: {e}");
                    break;
                }
            }
        }
        let (from, proof) = match proofs.recv_timeout(Duration::from_millis(20)) {
            Ok(p) => p,
            Err(_) => continue,
        };
        let mut p = match proof {
            Ok(p) => p,
            Err(why) => {
                drop_peer(&from, &why);
                continue;
            }
        };
        if Instant::now() >= deadline {
            // Proven too late: nothing is started for it.
            let why = timed_out(&joined);
            refuse(&mut p, &why);
            refuse_all(&mut joined, &why);
            return Err(why);
        }
        let node = p.hello.node;
        if let Some(why) = mismatch(&hello, &p.hello) {
            let why = format!("node {node} ({from}) cannot join: {why}");
            refuse(&mut p, &why);
            refuse_all(&mut joined, &why);
            return Err(why);
        }
        let wrong = if node == 0 || node >= config.nodes {
            Some(format!(
                "it says it is node {node}, and the nodes joining node 0 are 1 to {}",
                config.nodes - 1
            ))
        } else {
            joined.get(&node).map(|first| {
                format!(
                    "node {node} has joined already from {} (two nodes were given --node-rank {node}?)",
                    first.from
                )
            })
        };
        if let Some(why) = wrong {
            refuse(&mut p, &format!("node 0 refuses it: {why}"));
            drop_peer(&from, &why);
            continue;
        }
        tracing::info!(node, %from, "node joined");
        joined.insert(node, p);
    }
    if dropped > 20 {
        tracing::warn!("{dropped} connections in all were dropped at the rendezvous");
    }
    let mut all: Vec<&[u64]> = vec![hello.checkpoints.as_slice()];
    all.extend(joined.values().map(|p| p.hello.checkpoints.as_slice()));
    let resume_step = common_step(&all);
    let resumes = hello.resume && hello.checkpoints.iter().any(|&s| s > 0);
    if resumes && resume_step == 0 && all.iter().all(|c| !c.is_empty()) {
        tracing::warn!(
            "the nodes have no checkpoint step in common (every node keeps its own, --keep-checkpoints): the drafters start from fresh weights"
        );
    }
    // The drafters' group meets on a port of this host free now (rank 0 binds it moments later).
    let group_port = TcpListener::bind((addr.ip(), 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on {} for the drafters' group: {e}", addr.ip()))?;
    let go = Message::Go {
        group_port,
        resume_step,
    };
    let mut peers = Vec::new();
    let mut readers = Vec::new();
    for (node, mut p) in joined {
        p.peer
            .send(&go)
            .map_err(|e| format!("node {node} left while joining: {e}"))?;
        p.peer.node = node;
        peers.push(p.peer);
        readers.push((node, p.reader, p.opener));
    }
    Ok(Joined {
        group_port,
        resume_step,
        link: Link::new(config, peers),
        readers,
    })
}

/// How one attempt to join node 0 ended, when it did not join.
enum Attempt {
    /// Node 0 is not there yet, or busy: try again until the deadline.
    Again(String),
    /// Refused, or not node 0 of this run: give up.
    Refused(String),
}

fn peer_join(
    config: &NodeConfig,
    host: &str,
    port: u16,
    deadline: Instant,
    hello: Hello,
    secret: &Secret,
) -> Result<Joined, String> {
    let unreachable = |why: String| {
        format!(
            "cannot reach node 0 at {} within {} s (--rendezvous-timeout): {why}",
            config.rendezvous, config.timeout_s
        )
    };
    loop {
        let attempt = resolve(host, port).and_then(|addr| {
            TcpStream::connect_timeout(&addr, left(deadline).min(Duration::from_secs(2)))
                .map_err(|e| e.to_string())
        });
        let why = match attempt {
            Ok(stream) => match peer_attempt(config, stream, deadline, &hello, secret) {
                Ok(joined) => return Ok(joined),
                Err(Attempt::Refused(why)) => return Err(why),
                Err(Attempt::Again(why)) => why,
            },
            Err(why) => why,
        };
        if Instant::now() >= deadline {
            return Err(unreachable(why));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One attempt of a joining node on a connection to node 0: the challenge, the hello, and node
/// 0's answer, which must prove the secret in turn.
fn peer_attempt(
    config: &NodeConfig,
    stream: TcpStream,
    deadline: Instant,
    hello: &Hello,
    secret: &Secret,
) -> Result<Joined, Attempt> {
    let node = hello.node;
    let at = &config.rendezvous;
    let waited = |why: String| {
        Attempt::Refused(format!(
            "node 0 at {at} did not answer within {} s (--rendezvous-timeout; it waits for every node): {why}",
            config.timeout_s
        ))
    };
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(left(deadline)));
    let mut reader = reader(&stream, deadline).map_err(|e| Attempt::Again(e.to_string()))?;
    let line = match read_line(&mut reader, MAX_HANDSHAKE_LINE) {
        Ok(Some(line)) => line,
        // Closed before its challenge: node 0 busy, or not node 0 yet.
        Ok(None) => return Err(Attempt::Again("the link closed at once".into())),
        Err(why) if Instant::now() >= deadline => return Err(waited(why)),
        Err(why) => return Err(Attempt::Again(why)),
    };
    let (challenge, theirs) = parse_challenge(&line).map_err(|why| {
        Attempt::Refused(format!(
            "the node at {at} is not node 0 of a run of this dflash-orch: {why}"
        ))
    })?;
    if challenge.version != VERSION {
        return Err(Attempt::Refused(format!(
            "node 0 at {at} speaks version {} of the link, this node {VERSION} (run the same dflash-orch on every node)",
            challenge.version
        )));
    }
    if challenge.key_id != secret.key_id() {
        return Err(Attempt::Refused(format!(
            "the node at {at} holds another secret than this node (key id {:?}, this node's {}): every node must read the same --rendezvous-secret-file",
            clip(&challenge.key_id, 40),
            secret.key_id()
        )));
    }
    let ours = nonce().map_err(Attempt::Refused)?;
    let sealed = seal_hello(secret, &theirs, &ours, hello)
        .map_err(|e| Attempt::Refused(format!("the hello: {e}")))?;
    (&stream)
        .write_all(&sealed)
        .map_err(|e| Attempt::Again(format!("the link closed: {e}")))?;
    let (sealer, mut opener) = Session::new(secret, &theirs, &ours).node();
    let answer = match read_line(&mut reader, MAX_LINE) {
        Ok(Some(line)) => line,
        Ok(None) => {
            return Err(Attempt::Refused(format!(
                "node 0 at {at} closed the link before answering (it drops a node it does not accept, and stops when another node is refused: see its output)"
            )));
        }
        Err(why) => return Err(waited(why)),
    };
    let refused = Attempt::Refused;
    match opener.open(&answer) {
        Ok(Message::Go {
            group_port,
            resume_step,
        }) => {
            if let Some(why) = check_go(hello, group_port, resume_step) {
                return Err(refused(format!(
                    "node {node} refuses node 0's start: {why}"
                )));
            }
            Ok(Joined {
                group_port,
                resume_step,
                link: Link::new(
                    config,
                    vec![Peer {
                        node: 0,
                        stream,
                        sealer,
                    }],
                ),
                readers: vec![(0, reader, opener)],
            })
        }
        Ok(Message::Refused { why }) => Err(refused(format!("node 0 refused node {node}: {why}"))),
        Ok(other) => Err(refused(format!(
            "node 0 answered the hello with {:?} (run the same dflash-orch on every node)",
            other.kind()
        ))),
        Err(why) => Err(refused(format!(
            "the answer of the node at {at} is not node 0's of this run: {why}"
        ))),
    }
}

impl Joined {
    /// Starts one reader thread per link: every message becomes a [`NodeEvent`] on `to_loop`
    /// (wrapped by `wrap`); a link silent for `silence`, or whose message fails authentication,
    /// is reported closed.
    pub fn listen<T: Send + 'static>(
        self,
        to_loop: mpsc::Sender<T>,
        wrap: fn(NodeEvent) -> T,
        silence: Duration,
    ) -> (Link, u16, u64) {
        for (node, mut reader, mut opener) in self.readers {
            let to_loop = to_loop.clone();
            reader.get_mut().deadline = None;
            let _ = reader.get_ref().stream.set_read_timeout(Some(silence));
            std::thread::spawn(move || {
                loop {
                    let event = match read_line(&mut reader, MAX_LINE) {
                        Ok(Some(line)) => match opener.open(&line) {
                            Ok(m) => NodeEvent::Message(node, m),
                            Err(why) => NodeEvent::Closed(node, why),
                        },
                        Ok(None) => NodeEvent::Closed(node, "its link closed".into()),
                        Err(why) => NodeEvent::Closed(node, why),
                    };
                    let last = matches!(event, NodeEvent::Closed(..));
                    if to_loop.send(wrap(event)).is_err() || last {
                        return;
                    }
                }
            });
        }
        (self.link, self.group_port, self.resume_step)
    }
}

impl Link {
    fn new(config: &NodeConfig, peers: Vec<Peer>) -> Self {
        for p in &peers {
            let _ = p.stream.set_write_timeout(Some(Duration::from_secs(10)));
        }
        Self {
            rank: config.rank,
            nodes: config.nodes,
            peers,
            status: BTreeMap::new(),
            done: BTreeSet::new(),
            last_tick: Instant::now(),
            stopped: false,
        }
    }

    /// Tells the other nodes this one stops (once).
    pub fn stop(&mut self, why: &str) {
        if !std::mem::replace(&mut self.stopped, true) {
            self.send_all(&Message::Stop { why: why.into() });
        }
    }

    /// Sends `m` to every node linked (a failed write is the reader's to report).
    pub fn send_all(&mut self, m: &Message) {
        for peer in &mut self.peers {
            if let Err(e) = peer.send(m) {
                tracing::debug!(node = peer.node, "link: {e}");
            }
        }
    }

    /// Whether a tick is due (once every [`TICK`]); the caller then sends [`Link::tick`].
    pub fn tick_due(&mut self) -> bool {
        if self.last_tick.elapsed() < TICK {
            return false;
        }
        self.last_tick = Instant::now();
        true
    }

    /// This node's status to node 0, or node 0's keepalive to the others (`status` unused).
    pub fn tick(&mut self, status: impl FnOnce() -> Value) {
        let m = if self.rank == 0 {
            Message::Alive
        } else {
            Message::Status { status: status() }
        };
        self.send_all(&m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(node: u32) -> Hello {
        Hello {
            version: VERSION,
            node,
            nodes: 2,
            drafters: 1,
            run: [
                ("data".to_owned(), "ab".to_owned()),
                ("seed".to_owned(), "1".to_owned()),
            ]
            .into_iter()
            .collect(),
            checkpoints: vec![],
            resume: false,
        }
    }

    fn secret(fill: u8) -> Secret {
        Secret::new(vec![fill; 32]).unwrap()
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn config(nodes: u32, rank: u32, port: u16, timeout_s: f64) -> NodeConfig {
        NodeConfig {
            nodes,
            rank,
            rendezvous: format!("127.0.0.1:{port}"),
            timeout_s,
            secret: Some(secret(7)),
        }
    }

    #[test]
    fn rendezvous_and_node_options_are_checked() {
        assert_eq!(
            parse_rendezvous("node0:29400").unwrap(),
            ("node0".into(), 29400)
        );
        assert_eq!(parse_rendezvous("[::1]:5").unwrap(), ("::1".into(), 5));
        for bad in ["node0", ":80", "h:0", "h:70000", "h:x", "", "a b:1"] {
            assert!(
                parse_rendezvous(bad).unwrap_err().contains("HOST:PORT"),
                "{bad}"
            );
        }
        // A junk value is refused in a short line.
        let junk = format!("{}:29400", "x".repeat(10_000));
        let e = parse_rendezvous(&junk).unwrap_err();
        assert!(e.contains("HOST:PORT") && e.len() < 300, "{e}");
        let config = |nodes, rank| NodeConfig {
            nodes,
            rank,
            rendezvous: "127.0.0.1:1".into(),
            timeout_s: 1.0,
            secret: None,
        };
        assert!(config(2, 1).check().is_ok());
        let e = config(2, 2).check().unwrap_err();
        assert!(
            e.contains("--node-rank 2 is not a node of --nodes 2"),
            "{e}"
        );
        assert!(config(1, 0).check().unwrap_err().contains("--nodes 1"));
    }

    #[test]
    fn the_first_slurm_host_is_read_from_its_node_list() {
        let long = "n".repeat(10_000);
        for (list, first) in [
            ("node01", Some("node01")),
            ("gpu[03-07,9],cpu1", Some("gpu03")),
            ("a,b", Some("a")),
            ("rack1-n[2]", Some("rack1-n2")),
            ("n[x-y]", None),
            ("n[", None),
            ("", None),
            (long.as_str(), None),
        ] {
            assert_eq!(first_slurm_host(list).as_deref(), first, "{list}");
        }
    }

    #[test]
    fn lines_and_messages_are_read_with_limits() {
        for (line, says) in [
            (&b"{\"kind\":\"go\"}"[..], "malformed"),
            (b"not json", "malformed"),
            (b"{\"kind\":\"launch_missiles\"}", "malformed"),
            (b"{\"kind\":\"hello\",\"node\":1}", "malformed"),
            (b"\xff\xfe", "malformed"),
        ] {
            let e = parse_message(line).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        let cut = read_line(&mut &b"{\"kind\":\"done\""[..], MAX_LINE).unwrap_err();
        assert!(cut.contains("in the middle"), "{cut}");
        let long = vec![b'x'; MAX_HANDSHAKE_LINE as usize + 10];
        let e = read_line(&mut &long[..], MAX_HANDSHAKE_LINE).unwrap_err();
        assert!(e.contains("longer than"), "{e}");
        assert_eq!(read_line(&mut &b""[..], MAX_LINE).unwrap(), None);
        let junk = parse_message(&vec![b'x'; 100_000]).unwrap_err();
        assert!(junk.len() < 600, "{junk}");
    }

    /// Sealed messages open in order on the other end, and only there: a bad MAC, a replay, a
    /// reordering, a reflection to the sender, another session's key and a cut line all fail.
    #[test]
    fn every_message_is_authenticated_in_order() {
        let s = secret(1);
        let session = Session::new(&s, &[1; NONCE], &[2; NONCE]);
        let (mut zero_out, mut zero_in) = session.node0();
        let (mut one_out, mut one_in) = session.node();
        let go = Message::Go {
            group_port: 7,
            resume_step: 0,
        };
        let first = zero_out.seal(&go).unwrap();
        let second = zero_out.seal(&Message::Alive).unwrap();
        let third = zero_out.seal(&Message::Stop { why: "x".into() }).unwrap();

        // Reordered: the second before the first fails (and the link would close there).
        let mut reader = session.node().1;
        assert!(reader.open(&second).unwrap_err().contains("message 0"));
        // Reflected: node 0's own line is not a message to node 0.
        assert!(zero_in.open(&first).is_err());
        // Another session (another nonce of node 0): the same line fails.
        let other = Session::new(&s, &[9; NONCE], &[2; NONCE]);
        assert!(other.node().1.open(&first).is_err());
        // Another secret.
        let stranger = Session::new(&secret(2), &[1; NONCE], &[2; NONCE]);
        assert!(stranger.node().1.open(&first).is_err());

        assert_eq!(one_in.open(&first).unwrap(), go);
        // Replayed: the same line again fails.
        let e = one_in.open(&first).unwrap_err();
        assert!(e.contains("fails authentication"), "{e}");
        assert_eq!(one_in.open(&second).unwrap(), Message::Alive);

        // Altered: a MAC digit, then a byte of the text.
        let mut bad = third.clone();
        bad[0] = if bad[0] == b'0' { b'1' } else { b'0' };
        assert!(one_in.open(&bad).is_err());
        let mut bad = third.clone();
        let at = bad.len() - 3;
        bad[at] = b'y';
        assert!(one_in.open(&bad).is_err());
        // Cut short: by a byte, or to its MAC alone.
        assert!(one_in.open(&third[..third.len() - 2]).is_err());
        let e = one_in.open(&third[..64]).unwrap_err();
        assert!(e.contains("without a MAC"), "{e}");
        assert!(one_in.open(b"{\"kind\":\"stop\",\"why\":\"x\"}").is_err());
        // The failures consumed nothing: the real third message still opens.
        assert_eq!(
            one_in.open(&third).unwrap(),
            Message::Stop { why: "x".into() }
        );

        // The other direction.
        let status = Message::Status {
            status: serde_json::json!({"run": {"node": 1}}),
        };
        let line = one_out.seal(&status).unwrap();
        assert!(one_in.open(&line).is_err(), "reflected");
        assert_eq!(zero_in.open(&line).unwrap(), status);
        // A valid MAC over a text that is no message is refused as malformed.
        let junk = one_out.seal_text(b"{\"kind\":\"launch\"}");
        assert!(zero_in.open(&junk).unwrap_err().contains("malformed"));
        // Reasons are clipped.
        let long = one_out
            .seal(&Message::Failed {
                why: "w".repeat(100_000),
            })
            .unwrap();
        let Message::Failed { why } = zero_in.open(&long).unwrap() else {
            panic!("a failure");
        };
        assert!(why.len() < 1100, "{}", why.len());
    }

    /// A hello proves the secret over node 0's nonce: under another nonce (recorded from another
    /// connection), another secret, or altered, it fails.
    #[test]
    fn a_hello_proves_the_secret_for_its_connection_only() {
        let s = secret(3);
        let line = seal_hello(&s, &[1; NONCE], &[2; NONCE], &hello(1)).unwrap();
        let (h, theirs) = open_hello(&s, &[1; NONCE], &line).unwrap();
        assert_eq!((h, theirs), (hello(1), [2; NONCE]));
        let e = open_hello(&s, &[3; NONCE], &line).unwrap_err();
        assert!(e.contains("does not prove the run's secret"), "{e}");
        assert!(open_hello(&secret(4), &[1; NONCE], &line).is_err());
        let text = String::from_utf8(line.clone()).unwrap();
        let claims_two = text.replace("\"node\":1", "\"node\":2");
        assert!(open_hello(&s, &[1; NONCE], claims_two.as_bytes()).is_err());
        let unsealed = serde_json::to_vec(&hello(1)).unwrap();
        let e = open_hello(&s, &[1; NONCE], &unsealed).unwrap_err();
        assert!(e.contains("without a MAC"), "{e}");
        // The challenge: its nonce and key id.
        let c = Challenge::new(&[5; NONCE], &s);
        let (parsed, nonce) = parse_challenge(&c.line()).unwrap();
        assert_eq!((parsed.key_id, nonce), (s.key_id(), [5; NONCE]));
        assert_ne!(s.key_id(), secret(4).key_id());
        assert!(parse_challenge(b"{\"kind\":\"go\"}").is_err());
    }

    /// The secret file is the user's own, owner-only, a regular file and long enough; each
    /// refusal names the file and why.
    #[test]
    fn the_secret_file_is_checked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, [7u8; 32]).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Secret::read(&file).unwrap(), secret(7));
        assert!(format!("{:?}", Secret::read(&file).unwrap()).contains('…'));

        let refused = |path: &Path, says: &str| {
            let e = Secret::read(path).unwrap_err();
            assert!(e.contains(&path.display().to_string()), "{e}");
            assert!(e.contains(says), "{says}: {e}");
        };
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        refused(&file, "has mode 0640");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        refused(&link, "is a symbolic link");
        refused(dir.path(), "not a regular file");
        refused(&dir.path().join("none"), "cannot be read");
        let short = dir.path().join("short");
        std::fs::write(&short, b"hunter2\n").unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        refused(&short, "holds 8 bytes, and a secret needs at least 32");
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&file, Some(65534), Some(65534)).unwrap();
            refused(&file, "belongs to uid 65534");
        }
    }

    #[test]
    fn a_node_of_another_run_is_named_by_what_differs() {
        let ours = hello(0);
        assert_eq!(mismatch(&ours, &hello(1)), None);
        let mut theirs = hello(1);
        theirs.run.insert("data".into(), "cd".into());
        let e = mismatch(&ours, &theirs).unwrap();
        assert!(e.contains("differs from node 0's in data"), "{e}");
        let mut theirs = hello(1);
        theirs.run.insert("torch".into(), "2.10.0".into());
        let e = mismatch(&ours, &theirs).unwrap();
        assert!(e.contains("torch (2.10.0 there, none on node 0)"), "{e}");
        let mut theirs = hello(1);
        theirs.drafters = 2;
        assert!(mismatch(&ours, &theirs).unwrap().contains("2 drafters"));
        let mut theirs = hello(1);
        theirs.resume = true;
        assert!(
            mismatch(&ours, &theirs)
                .unwrap()
                .contains("--resume on every node")
        );
        let mut theirs = hello(1);
        theirs.nodes = 3;
        assert!(mismatch(&ours, &theirs).unwrap().contains("--nodes 3"));
    }

    #[test]
    fn the_nodes_resume_from_their_newest_common_checkpoint() {
        assert_eq!(common_step(&[&[25, 50], &[25, 50]]), 50);
        assert_eq!(common_step(&[&[25, 50], &[0, 25]]), 25);
        assert_eq!(common_step(&[&[50], &[25]]), 0);
        assert_eq!(common_step(&[&[], &[25]]), 0);
    }

    /// Node 0's start is checked against this node's state: a fresh run starts at step 0, a
    /// resumed one from a checkpoint it holds.
    #[test]
    fn a_start_this_node_cannot_make_is_refused() {
        let fresh = hello(1);
        assert_eq!(check_go(&fresh, 9, 0), None);
        let e = check_go(&fresh, 9, 999_999).unwrap();
        assert!(
            e.contains("step 999999") && e.contains("starts a new run"),
            "{e}"
        );
        assert!(check_go(&fresh, 0, 0).unwrap().contains("port 0"));
        let mut resumed = hello(1);
        resumed.resume = true;
        resumed.checkpoints = vec![25, 50];
        assert_eq!(check_go(&resumed, 9, 50), None);
        assert_eq!(check_go(&resumed, 9, 0), None);
        let e = check_go(&resumed, 9, 75).unwrap();
        assert!(
            e.contains("holds no checkpoint of it (its newest: 50, 25)"),
            "{e}"
        );
    }

    /// Two nodes on loopback: a join agrees on the step and the port; a node of another run is
    /// refused on both sides; nobody at the rendezvous is reported within the timeout.
    #[test]
    fn nodes_join_over_loopback_and_refuse_another_run() {
        let port = free_port();
        let mut h0 = hello(0);
        h0.checkpoints = vec![25, 50];
        h0.resume = true;
        let mut h1 = hello(1);
        h1.checkpoints = vec![25];
        h1.resume = true;
        let host = std::thread::spawn(move || join(&config(2, 0, port, 20.0), h0, None));
        let peer = join(&config(2, 1, port, 20.0), h1, None).unwrap();
        let host = host.join().unwrap().unwrap();
        assert_eq!((peer.resume_step, host.resume_step), (25, 25));
        assert_eq!(peer.group_port, host.group_port);
        // The link works both ways once listened to.
        let (to_zero, at_zero) = mpsc::channel();
        let (to_one, at_one) = mpsc::channel();
        let wrap: fn(NodeEvent) -> NodeEvent = |e| e;
        let (mut zero, ..) = host.listen(to_zero, wrap, Duration::from_secs(20));
        let (mut one, ..) = peer.listen(to_one, wrap, Duration::from_secs(20));
        one.tick(|| serde_json::json!({"n": 1}));
        zero.stop("done here");
        let got = at_zero.recv_timeout(Duration::from_secs(20)).unwrap();
        assert!(
            matches!(&got, NodeEvent::Message(1, Message::Status { status }) if status["n"] == 1),
            "{got:?}"
        );
        let got = at_one.recv_timeout(Duration::from_secs(20)).unwrap();
        assert!(
            matches!(&got, NodeEvent::Message(0, Message::Stop { why }) if why == "done here"),
            "{got:?}"
        );
        drop((zero, one));

        // Another seed on node 1: both sides refuse, naming it.
        let port = free_port();
        let host = std::thread::spawn(move || join(&config(2, 0, port, 20.0), hello(0), None));
        let mut h1 = hello(1);
        h1.run.insert("seed".into(), "2".into());
        let e1 = join(&config(2, 1, port, 20.0), h1, None).err().unwrap();
        let e0 = host.join().unwrap().err().unwrap();
        assert!(e0.contains("differs from node 0's in seed"), "{e0}");
        assert!(
            e1.contains("node 0 refused node 1") && e1.contains("seed"),
            "{e1}"
        );

        // Nobody listens: node 1 gives up within its timeout.
        let e = join(&config(2, 1, free_port(), 0.5), hello(1), None)
            .err()
            .unwrap();
        assert!(e.contains("cannot reach node 0"), "{e}");
        // No secret: refused naming the option.
        let mut none = config(2, 1, 1, 0.5);
        none.secret = None;
        let e = join(&none, hello(1), None).err().unwrap();
        assert!(e.contains("--rendezvous-secret-file"), "{e}");
    }

    /// A node given another secret is told so by the challenge at once; node 0 goes on waiting
    /// for the real node to its deadline. A node of the run with the secret but a rank that is
    /// not a joining node's is refused, and node 0 goes on waiting too.
    #[test]
    fn another_secret_or_a_wrong_rank_does_not_end_node_0s_wait() {
        let port = free_port();
        let host =
            std::thread::spawn(move || join(&config(3, 0, port, 30.0), hello_of(0, 3), None));
        let mut other = config(3, 1, port, 30.0);
        other.secret = Some(secret(8));
        let e = join(&other, hello_of(1, 3), None).err().unwrap();
        assert!(e.contains("holds another secret than this node"), "{e}");
        for wrong in [0, 7] {
            let e = join(&config(3, 1, port, 30.0), hello_of(wrong, 3), None)
                .err()
                .unwrap();
            assert!(
                e.contains(&format!("node 0 refused node {wrong}"))
                    && e.contains(&format!("it says it is node {wrong}")),
                "{e}"
            );
        }
        // Two nodes 1: one is refused (whichever came second), and the join goes on.
        let ones: Vec<_> = (0..2)
            .map(|_| {
                std::thread::spawn(move || join(&config(3, 1, port, 30.0), hello_of(1, 3), None))
            })
            .collect();
        let until = Instant::now() + Duration::from_secs(30);
        while !ones.iter().any(std::thread::JoinHandle::is_finished) {
            assert!(Instant::now() < until, "neither node 1 was refused");
            std::thread::sleep(Duration::from_millis(20));
        }
        let two = join(&config(3, 2, port, 30.0), hello_of(2, 3), None).unwrap();
        let zero = host.join().unwrap().unwrap();
        let results: Vec<_> = ones.into_iter().map(|t| t.join().unwrap()).collect();
        let refused: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().err().cloned())
            .collect();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(
            refused[0].contains("node 1 has joined already"),
            "{}",
            refused[0]
        );
        let one = results.into_iter().find_map(Result::ok).unwrap();
        assert_eq!(
            (one.group_port, two.group_port),
            (zero.group_port, zero.group_port)
        );
    }

    /// A hello that proves the secret but arrives after node 0's deadline starts nothing: node 0
    /// ends its wait with the timeout, naming the missing node, and the late node never gets a
    /// `go` (its link is closed or refused).
    #[test]
    fn a_hello_after_node_0s_deadline_is_refused() {
        let port = free_port();
        let host = std::thread::spawn(move || join(&config(2, 0, port, 1.0), hello(0), None));
        let until = Instant::now() + Duration::from_secs(20);
        let stream = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < until, "node 0 never listened: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let line = read_line(&mut reader, MAX_HANDSHAKE_LINE).unwrap().unwrap();
        let (_, node0_nonce) = parse_challenge(&line).unwrap();
        // Past node 0's deadline, whose wait has ended by now.
        while !host.is_finished() {
            assert!(Instant::now() < until, "node 0 waited past its deadline");
            std::thread::sleep(Duration::from_millis(10));
        }
        let e = host.join().unwrap().err().unwrap();
        assert!(
            e.contains("--rendezvous-timeout") && e.contains("nodes [1] of 2 did not join"),
            "{e}"
        );
        let ours = nonce().unwrap();
        let line = seal_hello(&secret(7), &node0_nonce, &ours, &hello(1)).unwrap();
        // The write may land in a closed socket's buffer, or fail: either way nothing reads it.
        let _ = (&stream).write_all(&line);
        let mut opener = Session::new(&secret(7), &node0_nonce, &ours).node().1;
        if let Ok(Some(answer)) = read_line(&mut reader, MAX_LINE) {
            let m = opener.open(&answer);
            assert!(!matches!(m, Ok(Message::Go { .. })), "{m:?}");
        }
    }

    fn hello_of(node: u32, nodes: u32) -> Hello {
        Hello {
            nodes,
            ..hello(node)
        }
    }
}
