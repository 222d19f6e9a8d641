//! Several nodes on one machine: two orchestrators on 127.0.0.1, each with its own target and
//! drafter (`cpu:2`, `--topology 1:1`), whose drafters form one gloo group across the nodes. They
//! end with the bytes of one node training both drafters, stop together when one is lost, resume
//! to the bytes of an undisturbed run, and refuse what would make them train different runs.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use dflash_e2e::{
    DATA_PARALLEL_FLAGS, alive, assert_clean, assert_refused, bin, final_bytes, finish,
    journal_events, launch_with, status, tiny_target, wait_until,
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

/// Node `rank` of two meeting at `port`.
fn node(run_dir: &Path, target: &Path, rank: u32, port: u16, extra: &[&str]) -> Command {
    let rendezvous = format!("127.0.0.1:{port}");
    let mut args = vec![
        "--nodes",
        "2",
        "--rendezvous",
        &rendezvous,
        "--node-rank",
        if rank == 0 { "0" } else { "1" },
    ];
    args.extend_from_slice(extra);
    launch(run_dir, target, "cpu:2", "1:1", &args)
}

fn resume(run_dir: &Path) -> Child {
    Command::new(bin("dflash-orch"))
        .args(["launch", "--resume", "--run-dir"])
        .arg(run_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn commits(run_dir: &Path) -> usize {
    journal_events(run_dir, "commit").len()
}

/// Two nodes end with the bytes of one node training both drafters on the same global batch;
/// node 0's `status` shows both nodes' workers, and every journal and metrics line names its
/// node. SIGKILL the whole rank-1 orchestrator mid-run: node 0 stops at once, naming the lost
/// node, with nothing left running; both relaunched with `--resume` end with the undisturbed
/// run's bytes. The same holds when node 0 is the one lost.
#[test]
fn two_nodes_train_as_one_and_a_lost_node_costs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
    let one = dir.path().join("one");
    finish(launch(&one, &target, "cpu:4", "2:2", &[]).spawn().unwrap());

    let port = free_port();
    let runs: Vec<PathBuf> = (0..2).map(|r| dir.path().join(format!("n{r}"))).collect();
    let children: Vec<Child> = (0..2)
        .map(|r| {
            node(&runs[r], &target, r as u32, port, &[])
                .spawn()
                .unwrap()
        })
        .collect();
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
    for child in children {
        finish(child);
    }
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
                node(&runs[r], &target, r as u32, port, &[])
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
        let resumed: Vec<Child> = runs.iter().map(|r| resume(r)).collect();
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

/// Two nodes of two drafters each (`--accum 4`, 30 batches an epoch: each epoch's last group
/// holds 2 batches, both node 0's): node 1's drafters take part in that group's step with no
/// batch, and the nodes end with the bytes of one node training all four drafters. Node 0
/// writes a line for every step, node 1 for those it had batches in, each the mean over its own
/// micro-batches.
#[test]
fn a_node_without_a_batch_in_a_short_group_takes_part_in_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
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
/// `--rendezvous-timeout`); a rendezvous port already in use.
#[test]
fn nodes_refuse_what_would_train_different_runs() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny_target(dir.path());
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
        let first = node(&zero, &target, 0, port, &timeout).spawn().unwrap();
        let mut args = timeout.to_vec();
        args.extend_from_slice(extra);
        let out = node(&run_dir, &target, 1, port, &args).output().unwrap();
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
    let out = node(&run_dir, &target, 1, port, &["--rendezvous-timeout", "3"])
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

    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = node(&run_dir, &target, 0, port, &timeout).output().unwrap();
    assert_refused(&out, 2, "the port is in use");
    assert!(!run_dir.exists());
}
