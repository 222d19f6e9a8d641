//! The link between nodes under attack from another user (uid 65534, `link-attacker`), at the
//! join, where every attack on it lands: two real nodes of the link (`nodes::join`, as each
//! orchestrator runs it) on 127.0.0.1 and an attacker without the run's secret. Whatever the
//! attacker sends is dropped and the real nodes join as they would have; a fake node 0 is
//! refused by the real node 1. (`multi_node.rs` trains two whole orchestrators to the undisturbed
//! bytes while attacked.)

use std::net::TcpListener;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dflash_e2e::LinkAttacker;
use dflash_orch::runtime::nodes::{self, Hello, Joined, Message, NodeConfig, NodeEvent, Secret};

fn secret() -> Secret {
    let mut bytes = vec![0u8; 32];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut bytes))
        .unwrap();
    Secret::new(bytes).unwrap()
}

fn config(nodes: u32, rank: u32, port: u16, timeout_s: f64, secret: &Secret) -> NodeConfig {
    NodeConfig {
        nodes,
        rank,
        rendezvous: format!("127.0.0.1:{port}"),
        timeout_s,
        secret: Some(secret.clone()),
    }
}

fn hello(node: u32, nodes: u32) -> Hello {
    Hello {
        version: nodes::VERSION,
        node,
        nodes,
        drafters: 1,
        run: [("seed".to_owned(), "1".to_owned())].into(),
        checkpoints: vec![],
        resume: false,
    }
}

/// Node 0 of `nodes`, listening before this returns: its port and its join.
fn node0(nodes: u32, timeout_s: f64, secret: &Secret) -> (u16, JoinHandle<Result<Joined, String>>) {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = config(nodes, 0, port, timeout_s, secret);
    let listener = nodes::bind(&c).unwrap();
    let join = std::thread::spawn(move || nodes::join(&c, hello(0, nodes), Some(listener)));
    (port, join)
}

fn join(nodes: u32, rank: u32, port: u16, secret: &Secret) -> Result<Joined, String> {
    nodes::join(
        &config(nodes, rank, port, 120.0, secret),
        hello(rank, nodes),
        None,
    )
}

/// Forged hellos (old-style claiming node 1 or node 7, with a made-up MAC), forged stops, garbage
/// and an overlong line each reach node 0 before the real node 1, and each is dropped: node 0
/// goes on waiting, and node 1 then joins. Once joined, node 0 listens no more (a forged stop
/// finds nobody), and the link carries node 1's own messages.
#[test]
fn forged_hellos_and_stops_are_dropped_and_the_real_node_joins() {
    let secret = secret();
    let (port, zero) = node0(2, 120.0, &secret);
    let addr = format!("127.0.0.1:{port}");
    let forger = LinkAttacker::start(&["forge", &addr]);
    let outcomes = forger.lines_until("done");
    assert_eq!(outcomes.len(), 7, "{outcomes:?}");
    assert!(outcomes.iter().all(|o| o == "dropped"), "{outcomes:?}");

    let one = join(2, 1, port, &secret).unwrap();
    let zero = zero.join().unwrap().unwrap();
    assert_eq!(one.group_port, zero.group_port);

    let late = LinkAttacker::start(&["forge-now", &addr]);
    assert_eq!(late.line(), "unreachable");
    let (to_zero, at_zero) = mpsc::channel();
    let wrap: fn(NodeEvent) -> NodeEvent = |e| e;
    let (_zero_link, ..) = zero.listen(to_zero, wrap, Duration::from_secs(60));
    let (to_one, _at_one) = mpsc::channel();
    let (mut one_link, ..) = one.listen(to_one, wrap, Duration::from_secs(60));
    one_link.tick(|| serde_json::json!({"from": "node 1"}));
    let got = at_zero.recv_timeout(Duration::from_secs(60)).unwrap();
    assert!(
        matches!(&got, NodeEvent::Message(1, Message::Status { status }) if status["from"] == "node 1"),
        "{got:?}"
    );
}

/// A hello recorded through a relay (the attacker forwards node 1's real join and keeps its
/// hello line) and replayed is dropped: to the same node 0 while it waits for a third node, and
/// to the next launch's node 0 with the same secret. The real nodes join both times.
#[test]
fn a_replayed_hello_is_dropped() {
    let secret = secret();
    let (port, zero) = node0(3, 120.0, &secret);
    let addr = format!("127.0.0.1:{port}");
    let relay = LinkAttacker::start(&["relay", &addr]);
    let relay_port: u16 = relay
        .line()
        .strip_prefix("listening ")
        .unwrap()
        .parse()
        .unwrap();
    let one = {
        let secret = secret.clone();
        std::thread::spawn(move || join(3, 1, relay_port, &secret))
    };
    let recorded = relay.line();
    let recorded = recorded.strip_prefix("hello ").unwrap().to_owned();
    let replayer = LinkAttacker::start(&["replay", &addr, &recorded]);
    assert_eq!(replayer.line(), "dropped");
    let two = join(3, 2, port, &secret).unwrap();
    let zero = zero.join().unwrap().unwrap();
    let one = one.join().unwrap().unwrap();
    assert_eq!(
        (one.group_port, two.group_port),
        (zero.group_port, zero.group_port)
    );

    // The next launch of the run: the recording is worth nothing there either.
    let (port, zero) = node0(2, 120.0, &secret);
    let replayer = LinkAttacker::start(&["replay", &format!("127.0.0.1:{port}"), &recorded]);
    assert_eq!(replayer.line(), "dropped");
    let one = join(2, 1, port, &secret).unwrap();
    assert_eq!(one.group_port, zero.join().unwrap().unwrap().group_port);
}

/// A hundred silent connections and one sending a byte every 5 s neither keep the real node out
/// (it joins while they hang on; node 0 then cuts the slow one) nor hold node 0 past its
/// `--rendezvous-timeout` when the real node never comes.
#[test]
fn silent_and_slow_connections_neither_keep_a_node_out_nor_hold_node_0() {
    let secret = secret();
    let (port, zero) = node0(2, 120.0, &secret);
    let addr = format!("127.0.0.1:{port}");
    let silent = LinkAttacker::start(&["silent", &addr, "100"]);
    assert_eq!(silent.line(), "open 100");
    let slow = LinkAttacker::start(&["slowloris", &addr, "5"]);
    assert_eq!(slow.line(), "writing");
    let one = join(2, 1, port, &secret).unwrap();
    assert_eq!(one.group_port, zero.join().unwrap().unwrap().group_port);
    let cut = slow.line();
    assert!(cut.starts_with("cut after"), "{cut}");

    let (port, zero) = node0(2, 3.0, &secret);
    let addr = format!("127.0.0.1:{port}");
    let silent = LinkAttacker::start(&["silent", &addr, "100"]);
    let slow = LinkAttacker::start(&["slowloris", &addr, "1"]);
    assert_eq!(
        (silent.line(), slow.line()),
        ("open 100".into(), "writing".into())
    );
    let started = Instant::now();
    let e = zero.join().unwrap().err().unwrap();
    assert!(
        e.contains("node 0 waited 3 s (--rendezvous-timeout)")
            && e.contains("nodes [1] of 2 did not join"),
        "{e}"
    );
    eprintln!(
        "node 0 gave up {:.1} s after the attackers were in place",
        started.elapsed().as_secs_f64()
    );
}

/// A fake node 0 (another user listening where node 1 looks for node 0) is refused by node 1:
/// with a key id of its own at once, and with the real key id (copied from a real challenge)
/// when its `go` to step 999999 does not prove the secret.
#[test]
fn a_fake_node_0_is_refused() {
    let secret = secret();
    let port = |fake: &LinkAttacker| -> u16 {
        fake.line()
            .strip_prefix("listening ")
            .unwrap()
            .parse()
            .unwrap()
    };
    let fake = LinkAttacker::start(&["fake0", "random"]);
    let e = join(2, 1, port(&fake), &secret).err().unwrap();
    assert!(e.contains("holds another secret than this node"), "{e}");

    let fake = LinkAttacker::start(&["fake0", &secret.key_id()]);
    let e = join(2, 1, port(&fake), &secret).err().unwrap();
    assert!(
        e.contains("is not node 0's of this run") && e.contains("fails authentication"),
        "{e}"
    );
    assert_eq!(fake.line(), "answered");
}
