//! Another user's attacks on the nodes' link, for the tests (run as uid 65534): it knows the
//! protocol's shape but not the run's secret. Each mode prints what it saw, one line per fact,
//! and ends when its work is done or when its stdin closes (the test drops it).
//!
//! - `forge HOST:PORT`: one connection per forgery (an old-style hello claiming node 1, one
//!   claiming node 7, a hello with a made-up MAC, a plain and a MAC'd `stop`, garbage, a line
//!   past the handshake's limit); prints `dropped` for each that node 0 closed without a word
//!   after its challenge, `answered` otherwise, then `done`. `forge-now` does not wait for node
//!   0 to listen: it prints `unreachable` when nothing does.
//! - `silent HOST:PORT N`: opens N connections that send nothing; prints `open N`.
//! - `slowloris HOST:PORT SECS`: one connection sending a byte every SECS seconds; prints
//!   `writing`, then `cut after N bytes` when node 0 closes it.
//! - `relay HOST:PORT`: listens on a port of 127.0.0.1 (prints `listening PORT`) and forwards
//!   one connection to HOST:PORT both ways, printing the joining node's second line, its hello,
//!   as `hello HEX`.
//! - `replay HOST:PORT HEX`: reads node 0's challenge and sends the recorded line; prints
//!   `dropped` or `answered`.
//! - `fake0 KEYID|random`: listens on a port of 127.0.0.1 (prints `listening PORT`) as a node 0
//!   without the secret: a challenge with that key id, then, to the hello, a `go` to step 999999
//!   under a made-up MAC; prints `answered` for each node it fooled into sending a hello.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The test ends this process by closing its stdin.
    std::thread::spawn(|| {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        std::process::exit(0);
    });
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    match arg(0).as_str() {
        "forge" => forge(&arg(1), true),
        "forge-now" => forge(&arg(1), false),
        "silent" => silent(&arg(1), arg(2).parse().unwrap_or(100)),
        "slowloris" => slowloris(&arg(1), arg(2).parse().unwrap_or(5)),
        "relay" => relay(&arg(1)),
        "replay" => say(replay(&arg(1), &unhex(&arg(2)))),
        "fake0" => fake0(&arg(1)),
        other => panic!("unknown mode {other:?}"),
    }
    // Done: wait to be ended, so that the test reads every line first.
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

fn say(line: impl AsRef<str>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", line.as_ref());
    let _ = out.flush();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .filter_map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok())
        .collect()
}

/// Random bytes, for a made-up MAC or nonce.
fn noise(n: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut bytes))
        .expect("/dev/urandom");
    bytes
}

/// A connection to `addr`, retried for up to two minutes (node 0 may still be starting) when
/// `wait`.
fn connect_or_wait(addr: &str, wait: bool) -> Option<TcpStream> {
    let until = Instant::now() + Duration::from_secs(if wait { 120 } else { 0 });
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Some(s),
            Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => return None,
        }
    }
}

/// Reads node 0's challenge line (empty if none within 30 s).
fn challenge(reader: &mut BufReader<TcpStream>) -> String {
    let _ = reader
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(30)));
    let mut line = String::new();
    let _ = reader.read_line(&mut line);
    line
}

fn connect(addr: &str) -> Option<TcpStream> {
    connect_or_wait(addr, true)
}

/// After its challenge, whether node 0 closed the connection without a word (`dropped`).
fn outcome(mut reader: BufReader<TcpStream>) -> String {
    let _ = reader
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(60)));
    let mut rest = Vec::new();
    // A reset (node 0 closed with our bytes unread) is a drop too.
    let _ = reader.read_to_end(&mut rest);
    if rest.is_empty() {
        "dropped".into()
    } else {
        format!("answered {}", String::from_utf8_lossy(&rest).trim())
    }
}

/// Sends `line` after node 0's challenge; what became of it.
fn attempt(addr: &str, line: &[u8], wait: bool) -> String {
    let Some(mut stream) = connect_or_wait(addr, wait) else {
        return "unreachable".into();
    };
    let Ok(read) = stream.try_clone() else {
        return "unreachable".into();
    };
    let mut reader = BufReader::new(read);
    if challenge(&mut reader).is_empty() {
        return "no challenge".into();
    }
    let _ = stream.write_all(line);
    outcome(reader)
}

const HELLO: &str =
    r#"{"version":2,"node":1,"nodes":2,"drafters":1,"run":{},"checkpoints":[],"resume":false}"#;

fn forge(addr: &str, wait: bool) {
    let forged_mac = hex(&noise(32));
    let nonce = hex(&noise(32));
    let lines: Vec<Vec<u8>> = vec![
        format!("{{\"kind\":\"hello\",{}\n", &HELLO[1..]).into_bytes(),
        format!(
            "{{\"kind\":\"hello\",{}\n",
            &HELLO[1..].replace("\"node\":1", "\"node\":7")
        )
        .into_bytes(),
        format!("{forged_mac} {{\"nonce\":\"{nonce}\",\"hello\":{HELLO}}}\n").into_bytes(),
        b"{\"kind\":\"stop\",\"why\":\"forged\"}\n".to_vec(),
        format!("{forged_mac} {{\"kind\":\"stop\",\"why\":\"forged\"}}\n").into_bytes(),
        noise(4096),
        vec![b'x'; 300 << 10],
    ];
    for line in lines {
        let got = attempt(addr, &line, wait);
        say(&got);
        if got == "unreachable" {
            return;
        }
    }
    say("done");
}

fn silent(addr: &str, n: usize) {
    let open: Vec<TcpStream> = (0..n).filter_map(|_| connect(addr)).collect();
    say(format!("open {}", open.len()));
    loop {
        std::thread::sleep(Duration::from_secs(60));
        let _ = &open;
    }
}

fn slowloris(addr: &str, secs: u64) {
    let Some(mut stream) = connect(addr) else {
        say("unreachable");
        return;
    };
    say("writing");
    let mut sent = 0u64;
    let mut drain = [0u8; 4096];
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    loop {
        if stream.write_all(b"{").is_err() {
            break;
        }
        sent += 1;
        let until = Instant::now() + Duration::from_secs(secs);
        let mut closed = false;
        while Instant::now() < until {
            // Node 0's challenge is read and ignored; the end of the stream is its cut.
            match stream.read(&mut drain) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        if closed {
            break;
        }
    }
    say(format!("cut after {sent} bytes"));
}

fn relay(target: &str) {
    let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
        say("cannot listen");
        return;
    };
    say(format!(
        "listening {}",
        listener.local_addr().map(|a| a.port()).unwrap_or(0)
    ));
    let Ok((client, _)) = listener.accept() else {
        return;
    };
    let Some(server) = connect(target) else {
        say("unreachable");
        return;
    };
    let (Ok(client_w), Ok(server_w)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    // Node 0 to the joining node, as it comes.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut &server, &mut &client_w);
    });
    // The joining node to node 0, line by line: its first line is its hello.
    let mut from = BufReader::new(client);
    let mut to = server_w;
    let mut first = true;
    loop {
        let mut line = Vec::new();
        match from.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if std::mem::take(&mut first) {
            say(format!("hello {}", hex(&line)));
        }
        if to.write_all(&line).is_err() {
            return;
        }
    }
}

fn replay(addr: &str, line: &[u8]) -> String {
    attempt(addr, line, true)
}

fn fake0(key_id: &str) {
    let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
        say("cannot listen");
        return;
    };
    say(format!(
        "listening {}",
        listener.local_addr().map(|a| a.port()).unwrap_or(0)
    ));
    let key_id = if key_id == "random" {
        hex(&noise(8))
    } else {
        key_id.to_owned()
    };
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let challenge = format!(
            "{{\"kind\":\"challenge\",\"version\":2,\"nonce\":\"{}\",\"key_id\":\"{key_id}\"}}\n",
            hex(&noise(32))
        );
        if stream.write_all(challenge.as_bytes()).is_err() {
            continue;
        }
        let Ok(read) = stream.try_clone() else {
            continue;
        };
        let mut reader = BufReader::new(read);
        let _ = reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_secs(30)));
        let mut hello = String::new();
        if reader.read_line(&mut hello).is_ok_and(|n| n > 0) {
            say("answered");
            let go = format!(
                "{} {{\"kind\":\"go\",\"group_port\":7,\"resume_step\":999999}}\n",
                hex(&noise(32))
            );
            let _ = stream.write_all(go.as_bytes());
        }
    }
}
