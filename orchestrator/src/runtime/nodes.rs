//! Runs of several nodes: one orchestrator per node, each with its own targets feeding its own
//! drafters, every node's drafters in one `torch.distributed` group (only gradients cross
//! nodes). Node 0 listens at the rendezvous and the others join it over one TCP link each. The
//! link checks, before anything starts, that every node trains the same run; agrees where the
//! run resumes and where the drafters' group meets; carries the other nodes' status to node 0;
//! and tells every node when one stops, fails or is lost.
//!
//! The wire is one JSON object per line ([`Message`]), each at most [`MAX_LINE`] bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The version of the link's messages: nodes of other versions are refused.
pub const VERSION: u32 = 1;
/// The longest message line accepted.
pub const MAX_LINE: u64 = 4 << 20;
/// Seconds between a node's status (or node 0's keepalive) on the link.
pub const TICK: Duration = Duration::from_secs(1);
/// The most nodes a run may have.
pub const MAX_NODES: u32 = 4096;

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
    let bad = || format!("{text:?} is not HOST:PORT (a port of 1 to 65535)");
    let (host, port) = text.trim().rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(bad)?;
    if host.is_empty() || host.contains(char::is_whitespace) {
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
    (!host.is_empty()).then_some(host)
}

/// What a node tells node 0 when it joins: who it is and what run it trains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    pub node: u32,
    pub nodes: u32,
    /// Drafters on the node (every node has as many).
    pub drafters: u32,
    /// What decides the weights: the run fingerprint's fields and the options beside them.
    pub run: BTreeMap<String, String>,
    /// Steps of the node's finished checkpoints.
    pub checkpoints: Vec<u64>,
    /// Whether the node resumes its run (every node does, or none).
    pub resume: bool,
}

/// One line of the link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Message {
    Hello(Hello),
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

/// Reads one message line; `None` at the end of the stream.
pub fn read_message(from: &mut impl BufRead) -> Result<Option<Message>, String> {
    let mut line = Vec::new();
    let n = from
        .take(MAX_LINE)
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
        return Err(if n as u64 >= MAX_LINE {
            format!("a message longer than {MAX_LINE} bytes")
        } else {
            "the link closed in the middle of a message".to_owned()
        });
    }
    parse_message(&line).map(Some)
}

/// One message from its line.
pub fn parse_message(line: &[u8]) -> Result<Message, String> {
    serde_json::from_slice(line).map_err(|e| {
        format!(
            "a malformed message ({e}): {}",
            crate::format::clip(&String::from_utf8_lossy(line), 120)
        )
    })
}

fn write_message(to: &mut TcpStream, m: &Message) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(m).map_err(std::io::Error::other)?;
    line.push(b'\n');
    to.write_all(&line)
}

/// Something a node's link reports to its run loop.
#[derive(Debug)]
pub enum NodeEvent {
    Message(u32, Message),
    /// The link to `node` ended (closed, silent, malformed): why.
    Closed(u32, String),
}

/// The nodes have joined: where the run starts, and the link to the other nodes.
pub struct Joined {
    pub group_port: u16,
    pub resume_step: u64,
    pub link: Link,
    readers: Vec<(u32, BufReader<TcpStream>)>,
}

/// The live link to the other nodes: node 0 holds one stream per other node, the others one
/// to node 0.
pub struct Link {
    pub rank: u32,
    pub nodes: u32,
    peers: Vec<(u32, TcpStream)>,
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
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} has no address"))
}

/// Joins the run's nodes (node 0 waits for every other; the others reach node 0), within
/// `config.timeout_s`. `hello` is this node's.
pub fn join(config: &NodeConfig, hello: Hello) -> Result<Joined, String> {
    let (host, port) =
        parse_rendezvous(&config.rendezvous).map_err(|e| format!("--rendezvous {e}"))?;
    let timeout = Duration::from_secs_f64(config.timeout_s);
    let deadline = Instant::now() + timeout;
    if config.rank == 0 {
        host_join(config, &host, port, deadline, hello)
    } else {
        peer_join(config, &host, port, deadline, hello)
    }
}

fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100))
}

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
    let differ: Vec<&str> = keys
        .into_iter()
        .filter(|k| ours.run.get(*k) != theirs.run.get(*k))
        .map(String::as_str)
        .collect();
    if !differ.is_empty() {
        return Some(format!(
            "its run differs from node 0's in {} (every node must train the same run: the same store, by content, and the same options)",
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

fn host_join(
    config: &NodeConfig,
    host: &str,
    port: u16,
    deadline: Instant,
    hello: Hello,
) -> Result<Joined, String> {
    let addr =
        resolve(host, port).map_err(|e| format!("--rendezvous {}: {e}", config.rendezvous))?;
    let listener = TcpListener::bind(addr).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            ": the port is in use (another run's node 0, or another program); pick another --rendezvous port"
        } else {
            ""
        };
        format!(
            "--rendezvous {}: node 0 cannot listen there ({e}){hint}",
            config.rendezvous
        )
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("--rendezvous {}: {e}", config.rendezvous))?;
    let mut joined: BTreeMap<u32, (Hello, TcpStream, BufReader<TcpStream>)> = BTreeMap::new();
    let refuse_all = |joined: &mut BTreeMap<u32, (Hello, TcpStream, BufReader<TcpStream>)>,
                      why: &str| {
        for (_, stream, _) in joined.values_mut() {
            let _ = write_message(stream, &Message::Refused { why: why.into() });
        }
    };
    while joined.len() + 1 < config.nodes as usize {
        let (stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<u32> = (1..config.nodes)
                        .filter(|n| !joined.contains_key(n))
                        .collect();
                    let why = format!(
                        "node 0 waited {} s (--rendezvous-timeout) at {addr}, and nodes {missing:?} of {} did not join",
                        config.timeout_s, config.nodes
                    );
                    refuse_all(&mut joined, &why);
                    return Err(why);
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(format!("--rendezvous {}: {e}", config.rendezvous)),
        };
        let mut stream = stream;
        let setup = stream
            .set_nonblocking(false)
            .and_then(|()| {
                stream.set_read_timeout(Some(left(deadline).min(Duration::from_secs(10))))
            })
            .and_then(|()| stream.try_clone());
        let Ok(read_half) = setup else { continue };
        let mut reader = BufReader::new(read_half);
        let theirs = match read_message(&mut reader) {
            Ok(Some(Message::Hello(h))) => h,
            // Not a node of ours (a port scanner, a health check): ignored.
            Ok(_) | Err(_) => {
                tracing::warn!(
                    "{from} connected to the rendezvous without a node's hello: ignored"
                );
                continue;
            }
        };
        let why = if theirs.node == 0 || theirs.node >= config.nodes {
            Some(format!(
                "it says it is node {} of {}",
                theirs.node, theirs.nodes
            ))
        } else if joined.contains_key(&theirs.node) {
            Some(format!(
                "node {} has joined already (two nodes were given --node-rank {})",
                theirs.node, theirs.node
            ))
        } else {
            mismatch(&hello, &theirs)
        };
        if let Some(why) = why {
            let why = format!("node {} ({from}) cannot join: {why}", theirs.node);
            let _ = write_message(&mut stream, &Message::Refused { why: why.clone() });
            refuse_all(&mut joined, &why);
            return Err(why);
        }
        tracing::info!(node = theirs.node, %from, "node joined");
        joined.insert(theirs.node, (theirs, stream, reader));
    }
    let mut all: Vec<&[u64]> = vec![hello.checkpoints.as_slice()];
    all.extend(joined.values().map(|(h, ..)| h.checkpoints.as_slice()));
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
    for (node, (_, mut stream, reader)) in joined {
        write_message(&mut stream, &go)
            .map_err(|e| format!("node {node} left while joining: {e}"))?;
        peers.push((node, stream));
        readers.push((node, reader));
    }
    Ok(Joined {
        group_port,
        resume_step,
        link: Link::new(config, peers),
        readers,
    })
}

fn peer_join(
    config: &NodeConfig,
    host: &str,
    port: u16,
    deadline: Instant,
    hello: Hello,
) -> Result<Joined, String> {
    let unreachable = |why: String| {
        format!(
            "cannot reach node 0 at {} within {} s (--rendezvous-timeout): {why}",
            config.rendezvous, config.timeout_s
        )
    };
    let mut stream = loop {
        let attempt = resolve(host, port).and_then(|addr| {
            TcpStream::connect_timeout(&addr, left(deadline).min(Duration::from_secs(2)))
                .map_err(|e| e.to_string())
        });
        match attempt {
            Ok(s) => break s,
            Err(why) if Instant::now() >= deadline => return Err(unreachable(why)),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let node = hello.node;
    write_message(&mut stream, &Message::Hello(hello))
        .map_err(|e| unreachable(format!("the link closed: {e}")))?;
    stream
        .set_read_timeout(Some(left(deadline)))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    match read_message(&mut reader) {
        Ok(Some(Message::Go {
            group_port,
            resume_step,
        })) => Ok(Joined {
            group_port,
            resume_step,
            link: Link::new(config, vec![(0, stream)]),
            readers: vec![(0, reader)],
        }),
        Ok(Some(Message::Refused { why })) => Err(format!("node 0 refused node {node}: {why}")),
        Ok(Some(other)) => Err(format!(
            "node 0 answered the hello with {other:?} (run the same dflash-orch on every node)"
        )),
        Ok(None) => Err(
            "node 0 closed the link before answering (another node was refused, or node 0 stopped: see its output)".to_owned(),
        ),
        Err(why) => Err(format!(
            "node 0 did not answer within {} s (--rendezvous-timeout; it waits for every node): {why}",
            config.timeout_s
        )),
    }
}

impl Joined {
    /// Starts one reader thread per link: every message becomes a [`NodeEvent`] on `to_loop`
    /// (wrapped by `wrap`); a link silent for `silence` is reported closed.
    pub fn listen<T: Send + 'static>(
        self,
        to_loop: mpsc::Sender<T>,
        wrap: fn(NodeEvent) -> T,
        silence: Duration,
    ) -> (Link, u16, u64) {
        for (node, mut reader) in self.readers {
            let to_loop = to_loop.clone();
            let _ = reader.get_ref().set_read_timeout(Some(silence));
            std::thread::spawn(move || {
                loop {
                    match read_message(&mut reader) {
                        Ok(Some(m)) => {
                            if to_loop.send(wrap(NodeEvent::Message(node, m))).is_err() {
                                return;
                            }
                        }
                        Ok(None) => {
                            let _ = to_loop
                                .send(wrap(NodeEvent::Closed(node, "its link closed".into())));
                            return;
                        }
                        Err(why) => {
                            let _ = to_loop.send(wrap(NodeEvent::Closed(node, why)));
                            return;
                        }
                    }
                }
            });
        }
        (self.link, self.group_port, self.resume_step)
    }
}

impl Link {
    fn new(config: &NodeConfig, peers: Vec<(u32, TcpStream)>) -> Self {
        for (_, s) in &peers {
            let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
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
        for (node, stream) in &mut self.peers {
            if let Err(e) = write_message(stream, m) {
                tracing::debug!(node = *node, "link: {e}");
            }
        }
    }

    /// Once a [`TICK`]: the status to node 0 (`status` is asked for only then), node 0's
    /// keepalive to the others.
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
        let config = |nodes, rank| NodeConfig {
            nodes,
            rank,
            rendezvous: "127.0.0.1:1".into(),
            timeout_s: 1.0,
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
        for (list, first) in [
            ("node01", Some("node01")),
            ("gpu[03-07,9],cpu1", Some("gpu03")),
            ("a,b", Some("a")),
            ("rack1-n[2]", Some("rack1-n2")),
            ("n[x-y]", None),
            ("n[", None),
            ("", None),
        ] {
            assert_eq!(first_slurm_host(list).as_deref(), first, "{list}");
        }
    }

    #[test]
    fn malformed_messages_are_refused_naming_why() {
        for (line, says) in [
            (&b"{\"kind\":\"go\"}\n"[..], "malformed"),
            (b"not json\n", "malformed"),
            (b"{\"kind\":\"launch_missiles\"}\n", "malformed"),
            (b"\xff\xfe\n", "malformed"),
        ] {
            let e = read_message(&mut &line[..]).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        let cut = read_message(&mut &b"{\"kind\":\"done\""[..]).unwrap_err();
        assert!(cut.contains("in the middle"), "{cut}");
        let long = vec![b'x'; MAX_LINE as usize + 10];
        let e = read_message(&mut &long[..]).unwrap_err();
        assert!(e.contains("longer than"), "{e}");
        assert_eq!(read_message(&mut &b""[..]).unwrap(), None);
        let m = Message::Go {
            group_port: 7,
            resume_step: 50,
        };
        let mut line = serde_json::to_vec(&m).unwrap();
        line.push(b'\n');
        assert_eq!(read_message(&mut &line[..]).unwrap(), Some(m));
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

    /// Two nodes on loopback: a join agrees on the step and the port; a node of another run is
    /// refused on both sides; nobody at the rendezvous is reported within the timeout.
    #[test]
    fn nodes_join_over_loopback_and_refuse_another_run() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = |rank| NodeConfig {
            nodes: 2,
            rank,
            rendezvous: format!("127.0.0.1:{port}"),
            timeout_s: 20.0,
        };
        let mut h0 = hello(0);
        h0.checkpoints = vec![25, 50];
        h0.resume = true;
        let mut h1 = hello(1);
        h1.checkpoints = vec![25];
        h1.resume = true;
        let host = std::thread::spawn({
            let c = config(0);
            move || join(&c, h0)
        });
        let peer = join(&config(1), h1).unwrap();
        let host = host.join().unwrap().unwrap();
        assert_eq!((peer.resume_step, host.resume_step), (25, 25));
        assert_eq!(peer.group_port, host.group_port);
        drop((peer, host));

        // Another seed on node 1: both sides refuse, naming it.
        let host = std::thread::spawn({
            let c = config(0);
            move || join(&c, hello(0))
        });
        let mut h1 = hello(1);
        h1.run.insert("seed".into(), "2".into());
        let e1 = join(&config(1), h1).err().unwrap();
        let e0 = host.join().unwrap().err().unwrap();
        assert!(e0.contains("differs from node 0's in seed"), "{e0}");
        assert!(
            e1.contains("node 0 refused node 1") && e1.contains("seed"),
            "{e1}"
        );

        // Nobody listens: node 1 gives up within its timeout.
        let mut alone = config(1);
        alone.timeout_s = 0.5;
        let e = join(&alone, hello(1)).err().unwrap();
        assert!(e.contains("cannot reach node 0"), "{e}");
    }
}
