//! `dflash-orch generate` end to end: rows `prepare` reads, decoded by the target equal to
//! greedy decoding of each prompt alone; a run killed with SIGKILL mid-way and resumed gives the
//! same file as an uninterrupted one; a server's responses are taken in order and recorded as
//! such; an unreachable server is refused before anything is written.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use candle_core::{DType, Device};
use dflash_e2e::{assert_refused, bin, children, orch, signal, stdout_ok, wait_until};
use dflash_worker::model::qwen3::{Qwen3, load_heads};
use dflash_worker::speculative::Target;
use serde_json::Value;

fn tiny(dir: &Path) -> PathBuf {
    let out = dir.join("tiny");
    stdout_ok(&orch(&["init-tiny", "--output", out.to_str().unwrap()]));
    out
}

/// `rows` pre-tokenized prompts (loss on a tail the target will replace) and conversations.
fn inputs(dir: &Path, rows: usize) -> (PathBuf, PathBuf) {
    let tokens = dir.join("tokens.jsonl");
    let mut text = String::new();
    for r in 0..rows {
        let ids: Vec<u32> = (0..3 + r % 7)
            .map(|i| ((r * 31 + i * 17) % 590 + 4) as u32)
            .collect();
        let mut mask = vec![0; ids.len()];
        *mask.last_mut().unwrap() = 1;
        text.push_str(&serde_json::json!({"input_ids": ids, "loss_mask": mask}).to_string());
        text.push('\n');
    }
    std::fs::write(&tokens, text).unwrap();
    let chat = dir.join("chat.jsonl");
    std::fs::write(
        &chat,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Spell river.\"}, {\"role\": \"assistant\", \"content\": \"R-I-V-E-R\"}]}\n\
         {\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Spell sun.\"}]}\n",
    )
    .unwrap();
    (tokens, chat)
}

fn generate(target: &Path, input: &Path, output: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "generate",
        "--target-model",
        target.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn rows_equal_greedy_decoding_of_each_prompt_alone_and_prepare_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path());
    let (tokens, chat) = inputs(dir.path(), 9);
    let out = dir.path().join("out.jsonl");
    let args = generate(
        &target,
        &tokens,
        &out,
        &[
            "--max-new-tokens",
            "12",
            "--batch-size",
            "4",
            "--gpus",
            "cpu:2",
            "--json",
        ],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let summary: Value = serde_json::from_str(&stdout_ok(&orch(&args))).unwrap();
    assert_eq!(summary["rows"], 9);
    let rows = lines(&out);
    let model = Qwen3::load(&target, None, &Device::Cpu, DType::F32).unwrap();
    let (_, lm_head) = load_heads(&target, &Device::Cpu, DType::F32).unwrap();
    let alone = Target {
        model: &model,
        lm_head: &lm_head,
    };
    for (r, row) in rows.iter().enumerate() {
        let ids: Vec<u32> = serde_json::from_value(row["input_ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(row["loss_mask"].clone()).unwrap();
        let prompt_len = 2 + r % 7;
        assert_eq!(
            mask.iter().position(|&m| m == 1),
            Some(prompt_len),
            "row {r}"
        );
        let want = alone
            .generate(None, &ids[..prompt_len], 12, &[2])
            .unwrap()
            .output_ids;
        assert_eq!(ids[prompt_len..].to_vec(), want, "row {r}");
        assert!(
            row["source"]
                .as_str()
                .unwrap()
                .ends_with(&format!("tokens.jsonl:{}", r + 1))
        );
    }
    let meta: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("out.jsonl.meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["settings"]["producer"], "target");
    // prepare takes the rows.
    let store = dir.path().join("store");
    stdout_ok(&orch(&[
        "prepare",
        "--input",
        out.to_str().unwrap(),
        "--output",
        store.to_str().unwrap(),
        "--min-loss-tokens",
        "1",
    ]));

    // Conversations: the prompt ends with the assistant's header, the reply is new.
    let out = dir.path().join("chat-out.jsonl");
    let args = generate(&target, &chat, &out, &["--max-new-tokens", "6"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    stdout_ok(&orch(&args));
    let rows = lines(&out);
    assert_eq!(rows.len(), 2);
    for row in &rows {
        assert!(row["response"].is_string());
        let n = row["loss_mask"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| **m == 1)
            .count();
        assert!((1..=6).contains(&n), "{row}");
    }
    // An output that exists is kept unless --force.
    assert_refused(&orch(&args), 2, "--force");
}

#[test]
fn a_killed_generate_resumes_to_the_same_file() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path());
    let (tokens, _) = inputs(dir.path(), 240);
    let options = [
        "--max-new-tokens",
        "160",
        "--batch-size",
        "2",
        "--gpus",
        "cpu:1",
    ];
    let straight = dir.path().join("straight.jsonl");
    let args = generate(&target, &tokens, &straight, &options);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    stdout_ok(&orch(&args));

    let killed = dir.path().join("killed.jsonl");
    let args = generate(&target, &tokens, &killed, &options);
    let mut child = Command::new(bin("dflash-orch"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let committed = || committed_rows(&killed);
    wait_until("a few batches", Duration::from_secs(60), || {
        committed() >= 20
    });
    signal(child.id() as i32, "KILL");
    child.wait().unwrap();
    let at_kill = committed();
    assert!(at_kill < 240, "finished before the kill ({at_kill} rows)");
    assert!(!killed.exists());
    // Without --resume the leftovers are named, not overwritten.
    let plain: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_refused(&orch(&plain), 2, "--resume");
    // Resuming with other settings is refused, naming them.
    let mut other = args.clone();
    other.extend(["--resume".into(), "--seed".into(), "7".into()]);
    let other: Vec<&str> = other.iter().map(String::as_str).collect();
    assert_refused(&orch(&other), 2, "seed: recorded 0, now 7");
    let mut resumed_args = args.clone();
    resumed_args.push("--resume".into());
    resumed_args.push("--json".into());
    let resumed: Vec<&str> = resumed_args.iter().map(String::as_str).collect();
    let summary: Value = serde_json::from_str(&stdout_ok(&orch(&resumed))).unwrap();
    assert!(
        summary["resumed_rows"].as_u64().unwrap() >= at_kill,
        "{summary}"
    );
    assert_eq!(
        std::fs::read(&killed).unwrap(),
        std::fs::read(&straight).unwrap(),
        "the resumed file differs from the uninterrupted one"
    );
    assert!(!dir.path().join("killed.jsonl.partial").exists());

    // A worker SIGKILLed mid-run: restarted, its batch redone, the same file.
    let lost = dir.path().join("lost-worker.jsonl");
    let args = generate(&target, &tokens, &lost, &options);
    let child = Command::new(bin("dflash-orch"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("a few batches", Duration::from_secs(60), || {
        committed_rows(&lost) >= 10
    });
    let worker = children(child.id())
        .into_iter()
        .next()
        .expect("a generate worker");
    signal(worker as i32, "KILL");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("restarting it"),
        "the worker's death is reported"
    );
    assert_eq!(
        std::fs::read(&lost).unwrap(),
        std::fs::read(&straight).unwrap(),
        "a lost worker changed the output"
    );
}

/// A minimal OpenAI-compatible server: lists one model and answers every chat completion with
/// the same reply; returns its URL and the request bodies it saw.
fn fake_server() -> (String, std::sync::mpsc::Receiver<Value>) {
    fake_server_with(Duration::ZERO, |_| {
        (
            200,
            serde_json::json!({"choices": [{"message": {"role": "assistant", "content": "R-I-V-E-R"}, "finish_reason": "stop"}]})
                .to_string(),
        )
    })
}

/// A server that waits `delay` before each completion and answers it with `answer(request)`:
/// (HTTP status, body).
fn fake_server_with(
    delay: Duration,
    answer: fn(&Value) -> (u16, String),
) -> (String, std::sync::mpsc::Receiver<Value>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { break };
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut head = String::new();
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                    head.push_str(&line);
                }
                let mut body = vec![0; length];
                let _ = reader.read_exact(&mut body);
                let (status, text) = if head.starts_with("GET /v1/models") {
                    (
                        200,
                        serde_json::json!({"data": [{"id": "served-target"}]}).to_string(),
                    )
                } else {
                    let request = serde_json::from_slice::<Value>(&body).unwrap_or_default();
                    let _ = tx.send(request.clone());
                    std::thread::sleep(delay);
                    answer(&request)
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
            });
        }
    });
    (url, rx)
}

/// Generate's options as `&str`s.
fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// The rows the running (or interrupted) generate of `output` has committed, as its record says.
fn committed_rows(output: &Path) -> u64 {
    std::fs::read(format!("{}.partial.json", output.display()))
        .ok()
        .and_then(|t| serde_json::from_slice::<Value>(&t).ok())
        .and_then(|v| v["rows"].as_u64())
        .unwrap_or(0)
}

/// Waits until the generate of `output` has committed `rows` rows.
fn wait_for_rows(output: &Path, rows: u64) {
    wait_until("committed rows", Duration::from_secs(120), || {
        committed_rows(output) >= rows
    });
}

#[test]
fn a_resume_never_mixes_two_inputs_and_names_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path());
    let (tokens, _) = inputs(dir.path(), 200);
    let options = [
        "--max-new-tokens",
        "120",
        "--batch-size",
        "2",
        "--gpus",
        "cpu:1",
    ];
    let output = dir.path().join("out.jsonl");
    let args = generate(&target, &tokens, &output, &options);
    let child = Command::new(bin("dflash-orch"))
        .args(strs(&args))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_rows(&output, 6);
    // A clean stop: resumable.
    signal(child.id() as i32, "INT");
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resume = |extra: &[&str], input: &Path| {
        let mut a = generate(&target, input, &output, &options);
        a.push("--resume".into());
        a.extend(extra.iter().map(|s| s.to_string()));
        orch(&strs(&a))
    };
    // Another chat template.
    assert_refused(
        &resume(&["--chat-template", "llama3"], &tokens),
        2,
        "chat-template: recorded \"chatml\", now \"llama3\"",
    );
    // The input edited, its row count the same.
    let text = std::fs::read_to_string(&tokens).unwrap();
    std::fs::write(&tokens, text.replacen("[", "[7, ", 1)).unwrap();
    assert_refused(&resume(&[], &tokens), 2, "input-hash: recorded");
    std::fs::write(&tokens, &text).unwrap();
    // Another model of the same shape at the same path.
    let saved = dir.path().join("tiny-saved");
    std::fs::rename(&target, &saved).unwrap();
    stdout_ok(&orch(&[
        "init-tiny",
        "--output",
        target.to_str().unwrap(),
        "--seed",
        "7",
        "--force",
    ]));
    assert_refused(&resume(&[], &tokens), 2, "target-weights: recorded");
    std::fs::remove_dir_all(&target).unwrap();
    std::fs::rename(&saved, &target).unwrap();
    // Only what may change (the workers): it goes on, and ends equal to an uninterrupted run.
    let mut other = generate(
        &target,
        &tokens,
        &output,
        &[
            "--max-new-tokens",
            "120",
            "--batch-size",
            "2",
            "--gpus",
            "cpu:2",
            "--resume",
        ],
    );
    other.push("--json".into());
    let summary: Value = serde_json::from_str(&stdout_ok(&orch(&strs(&other)))).unwrap();
    assert!(summary["resumed_rows"].as_u64().unwrap() >= 6, "{summary}");
    let straight = dir.path().join("straight.jsonl");
    stdout_ok(&orch(&strs(&generate(
        &target, &tokens, &straight, &options,
    ))));
    assert_eq!(
        std::fs::read(&output).unwrap(),
        std::fs::read(&straight).unwrap()
    );
    let meta: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("out.jsonl.meta.json")).unwrap())
            .unwrap();
    for field in [
        "input_hash",
        "chat_template",
        "chat_template_hash",
        "tokenizer_hash",
        "target_weights",
    ] {
        assert!(!meta["settings"][field].is_null(), "{field}: {meta}");
    }
}

#[test]
fn a_slow_server_is_left_at_once_on_a_stop_signal_and_the_output_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path());
    let (tokens, _) = inputs(dir.path(), 12);
    // Every completion takes 30 s.
    let (url, requests) = fake_server_with(Duration::from_secs(30), |_| {
        (
            200,
            serde_json::json!({"choices": [{"text": "R", "finish_reason": "stop"}]}).to_string(),
        )
    });
    for sig in ["INT", "TERM"] {
        let output = dir.path().join(format!("slow-{sig}.jsonl"));
        let args = generate(
            &target,
            &tokens,
            &output,
            &["--server", &url, "--batch-size", "4"],
        );
        let child = Command::new(bin("dflash-orch"))
            .args(strs(&args))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // A request in flight, then the signal.
        requests.recv_timeout(Duration::from_secs(30)).unwrap();
        let sent = std::time::Instant::now();
        signal(child.id() as i32, sig);
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(130),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            sent.elapsed() < Duration::from_secs(20),
            "the stop waited for the server: {:?}",
            sent.elapsed()
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"));
        // Resumable: the leftovers are named, and --resume takes them.
        assert!(PathBuf::from(format!("{}.partial.json", output.display())).exists());
        while requests.try_recv().is_ok() {}
    }
}

#[test]
fn server_replies_are_bounded_and_its_errors_quoted_briefly() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path());
    let (tokens, _) = inputs(dir.path(), 3);
    // 560 KB of text for --max-new-tokens 16.
    let (url, _) = fake_server_with(Duration::ZERO, |_| {
        let text = "river ".repeat(93_000);
        (
            200,
            serde_json::json!({"choices": [{"text": text, "finish_reason": "stop"}]}).to_string(),
        )
    });
    let output = dir.path().join("cut.jsonl");
    let args = generate(
        &target,
        &tokens,
        &output,
        &["--server", &url, "--max-new-tokens", "16", "--json"],
    );
    let summary: Value = serde_json::from_str(&stdout_ok(&orch(&strs(&args)))).unwrap();
    assert_eq!(summary["replies_cut"], 3, "{summary}");
    for row in lines(&output) {
        let ids = row["input_ids"].as_array().unwrap().len();
        let response = row["loss_mask"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| **m == 1)
            .count();
        assert_eq!(response, 16, "{row}");
        assert!(ids <= 16 + 12, "{row}");
    }
    let meta: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("cut.jsonl.meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["replies_cut"], 3);
    // A 500 with a 5 MB body: the error quotes a few hundred bytes of it.
    let (url, _) = fake_server_with(Duration::ZERO, |_| (500, "x".repeat(5 << 20)));
    let output = dir.path().join("failed.jsonl");
    let args = generate(&target, &tokens, &output, &["--server", &url]);
    let out = orch(&strs(&args));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("answered 500"),
        "{}",
        &err[..err.len().min(500)]
    );
    assert!(
        err.contains("(5242880 bytes in all)"),
        "{}",
        &err[..err.len().min(500)]
    );
    assert!(err.len() < 4096, "{} bytes on stderr", err.len());
}

#[test]
fn a_server_writes_the_responses_and_an_unreachable_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = tiny(dir.path());
    let (_, chat) = inputs(dir.path(), 1);
    let (url, requests) = fake_server();
    let out = dir.path().join("served.jsonl");
    let args = generate(
        &target,
        &chat,
        &out,
        &["--server", &url, "--max-new-tokens", "32"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    stdout_ok(&orch(&args));
    let rows = lines(&out);
    assert_eq!(rows.len(), 2);
    assert!(
        rows[0]["response"]
            .as_str()
            .unwrap()
            .starts_with("R-I-V-E-R"),
        "{}",
        rows[0]
    );
    // The rows are asked for concurrently: in whatever order they arrive.
    let mut sent: Vec<Value> = (0..2)
        .map(|_| requests.recv_timeout(Duration::from_secs(5)).unwrap())
        .collect();
    sent.sort_by_key(|r| r["messages"].as_array().unwrap().len());
    for r in &sent {
        assert_eq!(r["model"], "served-target");
        assert_eq!(r["max_tokens"], 32);
    }
    // The reply to replace is not sent; the turns before it are.
    assert_eq!(sent[0]["messages"].as_array().unwrap().len(), 1);
    assert_eq!(sent[1]["messages"].as_array().unwrap().len(), 2);
    let meta: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("served.jsonl.meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["settings"]["producer"], "server");
    assert!(meta["produced_by"].as_str().unwrap().contains(&url));

    // Nothing listens on port 9 here: refused before anything is written.
    let out = dir.path().join("never.jsonl");
    let args = generate(&target, &chat, &out, &["--server", "http://127.0.0.1:9"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_refused(&orch(&args), 2, "cannot reach --server http://127.0.0.1:9");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("never"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
