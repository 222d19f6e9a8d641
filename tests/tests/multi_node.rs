//! Several nodes on one machine: two orchestrators on 127.0.0.1, each with its own target and
//! drafter (`cpu:2`, `--topology 1:1`), whose drafters form one gloo group across the nodes. They
//! end with the bytes of one node training both drafters (while another user attacks the
//! rendezvous), stop together when one is lost, resume to the bytes of an undisturbed run, and
//! refuse what would make them train different runs: other options, other code, another secret,
//! a fake node 0.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use dflash_e2e::{
    DATA_PARALLEL_FLAGS, LinkAttacker, alive, assert_clean, assert_refused, bin, final_bytes,
    finish, journal_events, launch_with, secret_file, status, tiny_target, wait_until,
};
use serde_json::Value;

/// A port nobody listens on now (the kernel's pick, released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A torch launch of [`DATA_PARALLEL_FLAGS`] over 4 epochs on `gpus` with `topology`; `extra`
/// adds options or changes those of DATA_PARALLEL_FLAGS.
fn launch(run_dir: &Path, target: &Path, gpus: &str, topology: &str, extra: &[&str]) -> Command {
    let mut args = vec!["--gpus", gpus, "--topology", topology, "--engine", "torch"];
    if !extra.contains(&"--epochs") {
        args.extend(["--epochs", "4"]);
    }
    args.extend_from_slice(extra);
    launch_with(run_dir, target, &DATA_PARALLEL_FLAGS, &args)
}

/// Node `rank` of two meeting at `port`, with the run's `secret` file.
fn node(
    run_dir: &Path,
    target: &Path,
    rank: u32,
    port: u16,
    secret: &Path,
    extra: &[&str],
) -> Command {
    node_at(
        run_dir,
        target,
        rank,
        &format!("127.0.0.1:{port}"),
        secret,
        extra,
    )
}

/// Node `rank` of two meeting at `rendezvous`.
fn node_at(
    run_dir: &Path,
    target: &Path,
    rank: u32,
    rendezvous: &str,
    secret: &Path,
    extra: &[&str],
) -> Command {
    let secret = secret.to_str().unwrap();
    let mut args = vec![
        "--nodes",
        "2",
        "--rendezvous",
        rendezvous,
        "--node-rank",
        if rank == 0 { "0" } else { "1" },
        "--rendezvous-secret-file",
        secret,
    ];
    args.extend_from_slice(extra);
    launch(run_dir, target, "cpu:2", "1:1", &args)
}

/// `launch --resume`, the secret from its variable.
fn resume(run_dir: &Path, secret: &Path) -> Child {
    Command::new(bin("dflash-orch"))
        .args(["launch", "--resume", "--run-dir"])
        .arg(run_dir)
        .env("DFLASH_RENDEZVOUS_SECRET_FILE", secret)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn commits(run_dir: &Path) -> usize {
    journal_events(run_dir, "commit").len()
}

/// Two nodes end with the bytes of one node training both drafters on the same global batch,
/// although another user (uid 65534) first sends node 0 forged hellos and stops and holds a
/// hundred silent connections and a slow one open at the rendezvous (each dropped and logged),
/// and finds nobody to send a stop to once the nodes have joined. Node 0's `status` shows both
/// nodes' workers, and every journal and metrics line names its node. SIGKILL the whole rank-1
/// orchestrator mid-run: node 0 stops at once, naming the lost node, with nothing left running;
/// both relaunched with `--resume` end with the undisturbed run's bytes. The same holds when
/// node 0 is the one lost.
#[test]
fn two_nodes_train_as_one_and_a_lost_node_costs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let secret = secret_file(dir.path(), "secret");
    let one = dir.path().join("one");
    finish(launch(&one, &target, "cpu:4", "2:2", &[]).spawn().unwrap());

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let runs: Vec<PathBuf> = (0..2).map(|r| dir.path().join(format!("n{r}"))).collect();
    let mut children = vec![
        node(&runs[0], &target, 0, port, &secret, &[])
            .spawn()
            .unwrap(),
    ];
    let forger = LinkAttacker::start(&["forge", &addr]);
    let forged = forger.lines_until("done");
    assert!(forged.iter().all(|o| o == "dropped"), "{forged:?}");
    let silent = LinkAttacker::start(&["silent", &addr, "100"]);
    assert_eq!(silent.line(), "open 100");
    let slow = LinkAttacker::start(&["slowloris", &addr, "5"]);
    assert_eq!(slow.line(), "writing");
    children.push(
        node(&runs[1], &target, 1, port, &secret, &[])
            .spawn()
            .unwrap(),
    );
    // Node 0's status carries node 1's workers once node 1 has reported.
    let mut seen = Value::Null;
    wait_until(
        "node 0's status to show both nodes",
        Duration::from_secs(300),
        || {
            if !runs[0].join("control.sock").exists() {
                return false;
            }
            let s = status(&runs[0]);
            let both = s["workers"].as_array().is_some_and(|w| {
                w.iter().any(|w| w["node"] == 1) && w.iter().any(|w| w["node"] == 0)
            });
            if both {
                seen = s;
            }
            both
        },
    );
    assert_eq!(seen["run"]["node"], 0, "{seen}");
    assert_eq!(seen["nodes"][1]["run"]["node"], 1, "{seen}");
    assert_eq!(seen["workers"].as_array().unwrap().len(), 4, "{seen}");
    let late = LinkAttacker::start(&["forge-now", &addr]);
    assert_eq!(late.line(), "unreachable");
    drop((forger, silent, slow, late));
    let outs: Vec<Output> = children.into_iter().map(finish).collect();
    let logged = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        logged.contains("at the rendezvous: a line without a MAC")
            && logged.contains("dropped (node 0 goes on waiting"),
        "{logged}"
    );
    let reference = final_bytes(&runs[0]);
    assert!(
        final_bytes(&runs[1]) == reference,
        "the two nodes' final weights differ"
    );
    assert!(
        final_bytes(&one) == reference,
        "two nodes ended with other weights than one node with both drafters"
    );
    for (r, run_dir) in runs.iter().enumerate() {
        let lines = fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
        for line in lines.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["node"], r, "node {r}'s metrics line: {line}");
        }
        let run = &journal_events(run_dir, "run")[0];
        assert_eq!(run["config"]["nodes"]["rank"], r, "{run}");
        assert_clean(run_dir);
    }

    for lost in [1usize, 0] {
        let port = free_port();
        let runs: Vec<PathBuf> = (0..2)
            .map(|r| dir.path().join(format!("lost{lost}-n{r}")))
            .collect();
        let mut children: Vec<Child> = (0..2)
            .map(|r| {
                node(&runs[r], &target, r as u32, port, &secret, &[])
                    .spawn()
                    .unwrap()
            })
            .collect();
        wait_until("a few checkpoints", Duration::from_secs(300), || {
            commits(&runs[lost]) >= 50
        });
        children[lost].kill().unwrap();
        children[lost].wait().unwrap();
        let survivor = 1 - lost;
        let since = Instant::now();
        let out: Output = children.remove(survivor).wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("node {lost} is lost"))
                && stderr.contains("relaunch each with the same command and --resume"),
            "{stderr}"
        );
        eprintln!(
            "node {survivor} stopped {:.1} s after node {lost} was killed",
            since.elapsed().as_secs_f64()
        );
        assert!(commits(&runs[survivor]) < 120, "stopped mid-run");
        for w in journal_events(&runs[survivor], "worker_start") {
            let pid = w["pid"].as_u64().unwrap();
            wait_until(
                "the survivor's workers to exit",
                Duration::from_secs(10),
                || !alive(pid),
            );
        }
        let resumed: Vec<Child> = runs.iter().map(|r| resume(r, &secret)).collect();
        for child in resumed {
            finish(child);
        }
        for run_dir in &runs {
            assert!(
                final_bytes(run_dir) == reference,
                "node {lost} lost: {} ended with other weights than the undisturbed run",
                run_dir.display()
            );
            assert_clean(run_dir);
        }
    }
}

/// DFlash2 drafters across two nodes (one target and one drafter each) end with the bytes of one
/// node training both drafters: the convolutions and the selector are reduced as the layers are.
#[test]
fn dflash2_drafters_on_two_nodes_train_as_on_one() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let secret = secret_file(dir.path(), "secret");
    let extra = [
        "--epochs",
        "1",
        "--drafter-arch",
        "dflash2",
        "--selector-top-k",
        "8",
    ];
    let one = dir.path().join("one");
    finish(
        launch(&one, &target, "cpu:4", "2:2", &extra)
            .spawn()
            .unwrap(),
    );
    let port = free_port();
    let rendezvous = format!("127.0.0.1:{port}");
    let runs: Vec<PathBuf> = (0..2).map(|r| dir.path().join(format!("n{r}"))).collect();
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let mut args = vec![
                "--nodes",
                "2",
                "--node-rank",
                if r == 0 { "0" } else { "1" },
            ];
            args.extend(["--rendezvous", rendezvous.as_str()]);
            args.extend(["--rendezvous-secret-file", secret.to_str().unwrap()]);
            args.extend(extra);
            launch(&runs[r], &target, "cpu:2", "1:1", &args)
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        finish(child);
    }
    for run_dir in &runs {
        assert!(
            final_bytes(run_dir) == final_bytes(&one),
            "{}: other weights than one node with both DFlash2 drafters",
            run_dir.display()
        );
        assert_clean(run_dir);
    }
}

/// Two nodes of two drafters each (`--accum 4`, 30 batches an epoch: each epoch's last group
/// holds 2 batches, both node 0's): node 1's drafters take part in that group's step with no
/// batch, and the nodes end with the bytes of one node training all four drafters. Node 0
/// writes a line for every step, node 1 for those it had batches in, each the mean over its own
/// micro-batches.
#[test]
fn a_node_without_a_batch_in_a_short_group_takes_part_in_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let secret = secret_file(dir.path(), "secret");
    let epochs = ["--epochs", "2"];
    let one = dir.path().join("one");
    finish(
        launch(&one, &target, "cpu:5", "1:4", &epochs)
            .spawn()
            .unwrap(),
    );
    let port = free_port();
    let runs: Vec<PathBuf> = (0..2).map(|r| dir.path().join(format!("n{r}"))).collect();
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let mut args = vec![
                "--nodes",
                "2",
                "--node-rank",
                if r == 0 { "0" } else { "1" },
            ];
            let rendezvous = format!("127.0.0.1:{port}");
            args.extend(["--rendezvous", rendezvous.as_str()]);
            args.extend(["--rendezvous-secret-file", secret.to_str().unwrap()]);
            args.extend(epochs);
            launch(&runs[r], &target, "cpu:3", "1:2", &args)
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        finish(child);
    }
    for run_dir in &runs {
        assert!(
            final_bytes(run_dir) == final_bytes(&one),
            "{}: other weights than one node with four drafters",
            run_dir.display()
        );
        assert_clean(run_dir);
    }
    let train = |run_dir: &Path| -> Vec<Value> {
        fs::read_to_string(run_dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["kind"] == "train")
            .collect()
    };
    let steps = |lines: &[Value]| -> Vec<u64> {
        lines.iter().map(|l| l["step"].as_u64().unwrap()).collect()
    };
    let (reference, zero, first) = (train(&one), train(&runs[0]), train(&runs[1]));
    assert_eq!(steps(&zero), steps(&reference), "node 0 reports every step");
    let without_short: Vec<u64> = steps(&reference)
        .into_iter()
        .filter(|s| s % 8 != 0)
        .collect();
    assert_eq!(
        steps(&first),
        without_short,
        "node 1: the steps it trained in"
    );
    for line in zero.iter().chain(&first) {
        assert!(line["loss"].as_f64().is_some_and(|l| l > 0.0), "{line}");
    }
}

/// Refused, with nothing created: a node rank outside `--nodes`; node 1 whose options or store
/// differ from node 0's (named, and node 0 refuses too); a rendezvous nobody answers (within
/// `--rendezvous-timeout`); a rendezvous port already in use, by the launch and by its dry run
/// alike, and by the dry run an address this machine does not have.
#[test]
fn nodes_refuse_what_would_train_different_runs() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let secret = secret_file(dir.path(), "secret");
    let run_dir = dir.path().join("refused");
    let timeout = ["--rendezvous-timeout", "20"];

    let out = launch(
        &run_dir,
        &target,
        "cpu:2",
        "1:1",
        &[
            "--nodes",
            "2",
            "--node-rank",
            "2",
            "--rendezvous",
            "127.0.0.1:1",
        ],
    )
    .output()
    .unwrap();
    assert_refused(&out, 2, "--node-rank 2 is not a node of --nodes 2");
    assert!(!run_dir.exists());

    for (extra, needle) in [
        (&["--seed", "7"][..], "seed"),
        (&["--synthetic", "200"][..], "data"),
        (&["--lr", "0.001"][..], "optimiser"),
    ] {
        let port = free_port();
        let zero = dir.path().join("zero");
        let first = node(&zero, &target, 0, port, &secret, &timeout)
            .spawn()
            .unwrap();
        let mut args = timeout.to_vec();
        args.extend_from_slice(extra);
        let out = node(&run_dir, &target, 1, port, &secret, &args)
            .output()
            .unwrap();
        assert_refused(&out, 2, "node 0 refused node 1");
        assert_refused(&out, 2, needle);
        let zero_out = first.wait_with_output().unwrap();
        assert_refused(&zero_out, 2, "node 1 (127.0.0.1:");
        assert_refused(
            &zero_out,
            2,
            "cannot join: its run differs from node 0's in",
        );
        assert_refused(&zero_out, 2, needle);
        assert!(!run_dir.exists() && !zero.exists(), "nothing is created");
    }

    let port = free_port();
    let started = Instant::now();
    let out = node(
        &run_dir,
        &target,
        1,
        port,
        &secret,
        &["--rendezvous-timeout", "3"],
    )
    .output()
    .unwrap();
    assert_refused(
        &out,
        2,
        &format!("cannot reach node 0 at 127.0.0.1:{port} within 3 s (--rendezvous-timeout)"),
    );
    eprintln!(
        "an unreachable rendezvous was refused after {:.1} s (preparation included)",
        started.elapsed().as_secs_f64()
    );
    assert!(!run_dir.exists());

    // A node 1 that holds the secret but says its hello only after node 0's deadline: its open
    // handshake does not hold node 0 past the deadline, and node 0 ends its wait naming the
    // missing node, creates nothing, and never sends the late node a go.
    let port = free_port();
    let late = dir.path().join("late");
    let zero = node(
        &late,
        &target,
        0,
        port,
        &secret,
        &["--rendezvous-timeout", "4"],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let (zero_out, answer) = tardy_node(port, &secret, zero);
    assert_refused(&zero_out, 2, "waited 4 s (--rendezvous-timeout)");
    assert_refused(&zero_out, 2, "nodes [1] of 2 did not join");
    assert!(
        !answer.contains("\"go\""),
        "the late node was answered: {answer}"
    );
    assert!(!late.exists(), "nothing is created");

    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = node(&run_dir, &target, 0, port, &secret, &timeout)
        .output()
        .unwrap();
    assert_refused(&out, 2, "the port is in use");
    let out = node(&run_dir, &target, 0, port, &secret, &["--dry-run"])
        .output()
        .unwrap();
    assert_refused(&out, 1, "a launch would be refused");
    assert_refused(&out, 1, "the port is in use");
    // An address this machine does not have (TEST-NET-1): EADDRNOTAVAIL, which the launch meets
    // at the same bind.
    let out = node_at(
        &run_dir,
        &target,
        0,
        "192.0.2.7:29400",
        &secret,
        &["--dry-run"],
    )
    .output()
    .unwrap();
    assert_refused(&out, 1, "this machine has no such address");
    assert!(!run_dir.exists());
}

/// Node 1 of the run, late: it reaches node 0 (a child spawned with piped stderr), reads its
/// challenge, waits until node 0 has ended, then sends a hello that proves the secret. Node 0's
/// output, and whatever node 0 answered the hello with (the empty string when nothing).
fn tardy_node(port: u16, secret: &Path, zero: Child) -> (Output, String) {
    use dflash_orch::runtime::nodes::{Hello, nonce, parse_challenge, seal_hello};
    use std::io::{BufRead, BufReader, Read, Write};
    let secret = dflash_orch::runtime::nodes::Secret::read(secret).unwrap();
    let until = Instant::now() + Duration::from_secs(120);
    let stream = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(e) => {
                assert!(Instant::now() < until, "node 0 never listened: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line).unwrap();
    let (challenge, node0_nonce) = parse_challenge(&line).unwrap();
    let out = zero.wait_with_output().unwrap();
    let hello = Hello {
        version: challenge.version,
        node: 1,
        nodes: 2,
        drafters: 1,
        run: Default::default(),
        checkpoints: vec![],
        resume: false,
    };
    let line = seal_hello(&secret, &node0_nonce, &nonce().unwrap(), &hello).unwrap();
    // Node 0 has exited: the write may fail, and nothing can answer.
    let _ = (&stream).write_all(&line);
    let mut answer = Vec::new();
    let _ = reader.read_to_end(&mut answer);
    (out, String::from_utf8_lossy(&answer).into_owned())
}

/// The run's secret and the link's peers: a launch of several nodes without a secret, or with
/// a secret file others may read, is refused naming the option (its dry run too); non-UTF-8 and
/// junk Slurm variables are refused in a short line; a fake node 0 (another user, who copied the
/// secret's key id from a real challenge) answering a fresh run with step 999999 is refused by
/// node 1; a node running a changed `dflash_orch` package is refused by node 0, naming the
/// engine's code. Nothing is created by any of them. (A node given another secret: the unit
/// tests of `runtime::nodes`.)
#[test]
fn nodes_refuse_a_peer_without_the_secret_or_with_other_code() {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let secret = secret_file(dir.path(), "secret");
    let run_dir = dir.path().join("refused");
    let zero = dir.path().join("zero");
    let bare = |extra: &[&str]| {
        let mut args = vec![
            "--nodes",
            "2",
            "--node-rank",
            "1",
            "--rendezvous",
            "127.0.0.1:1",
        ];
        args.extend_from_slice(extra);
        launch(&run_dir, &target, "cpu:2", "1:1", &args)
    };

    let out = bare(&[])
        .env_remove("DFLASH_RENDEZVOUS_SECRET_FILE")
        .output()
        .unwrap();
    assert_refused(&out, 2, "--nodes 2 needs --rendezvous-secret-file FILE");
    let out = bare(&["--dry-run"]).output().unwrap();
    assert_refused(&out, 1, "--nodes 2 needs --rendezvous-secret-file FILE");
    let open = secret_file(dir.path(), "open");
    fs::set_permissions(&open, fs::Permissions::from_mode(0o644)).unwrap();
    let out = bare(&["--rendezvous-secret-file", open.to_str().unwrap()])
        .output()
        .unwrap();
    assert_refused(&out, 2, "has mode 0644: other users may read or change it");

    let mut bad = bare(&[]);
    bad.env("SLURM_NNODES", std::ffi::OsStr::from_bytes(b"2\xff"));
    assert_refused(
        &bad.output().unwrap(),
        2,
        "SLURM_NNODES=\"2\u{fffd}\" is not UTF-8 text",
    );
    let junk = format!("n[{}", "x".repeat(10_000));
    let mut bad = launch(&run_dir, &target, "cpu:2", "1:1", &[]);
    bad.env("SLURM_NNODES", "2")
        .env("SLURM_JOB_NODELIST", &junk);
    let out = bad.output().unwrap();
    assert_refused(&out, 2, "SLURM_JOB_NODELIST=");
    let first = String::from_utf8_lossy(&out.stderr)
        .lines()
        .next()
        .unwrap()
        .len();
    assert!(first < 300, "an error line of {first} bytes");
    assert!(!run_dir.exists());

    // A fake node 0 with the key id copied.
    let key_id = dflash_orch::runtime::nodes::Secret::read(&secret)
        .unwrap()
        .key_id();
    let fake = LinkAttacker::start(&["fake0", &key_id]);
    let port: u16 = fake
        .line()
        .strip_prefix("listening ")
        .unwrap()
        .parse()
        .unwrap();
    let out = node(
        &run_dir,
        &target,
        1,
        port,
        &secret,
        &["--rendezvous-timeout", "60"],
    )
    .output()
    .unwrap();
    assert_refused(&out, 2, "is not node 0's of this run");
    assert_eq!(fake.line(), "answered");
    assert!(!run_dir.exists());

    // Node 1 runs a copy of dflash-orch beside a changed copy of its package.
    let install = dir.path().join("install");
    let package = install.join("python/dflash_orch");
    fs::create_dir_all(install.join("bin")).unwrap();
    fs::create_dir_all(&package).unwrap();
    fs::copy(bin("dflash-orch"), install.join("bin/dflash-orch")).unwrap();
    let ours = dflash_e2e::workspace_root().join("python/dflash_orch");
    for file in fs::read_dir(&ours).unwrap() {
        let file = file.unwrap().path();
        if file.extension().is_some_and(|e| e == "py") {
            fs::copy(&file, package.join(file.file_name().unwrap())).unwrap();
        }
    }
    let drafter = package.join("drafter.py");
    let mut text = fs::read_to_string(&drafter).unwrap();
    text.push_str("\n# changed on this node only\n");
    fs::write(&drafter, text).unwrap();
    let port = free_port();
    let first = node(
        &zero,
        &target,
        0,
        port,
        &secret,
        &["--rendezvous-timeout", "120"],
    )
    .spawn()
    .unwrap();
    let changed = node(
        &run_dir,
        &target,
        1,
        port,
        &secret,
        &["--rendezvous-timeout", "120"],
    );
    let out = Command::new(install.join("bin/dflash-orch"))
        .args(changed.get_args())
        .env("DFLASH_WORKER_BIN", bin("dflash-worker"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_refused(&out, 2, "node 0 refused node 1");
    assert_refused(&out, 2, "engine_code");
    let zero_out = first.wait_with_output().unwrap();
    assert_refused(&zero_out, 2, "its run differs from node 0's in engine_code");
    assert!(!run_dir.exists() && !zero.exists(), "nothing is created");
}
