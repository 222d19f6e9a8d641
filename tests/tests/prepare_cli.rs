//! `dflash-orch prepare`, `inspect` and `plan --data` end to end, on fixtures written by the real
//! Python libraries (scripts/make-prepare-fixtures) and on bad input made here.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dflash_e2e::{assert_refused, bin, orch, stdout_ok};
use dflash_orch::store::Store;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/prepare")
        .join(name)
}

fn arg(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `(input_ids, loss_mask)` of every sample of an expected-output fixture.
fn expected(name: &str) -> Vec<(Vec<u32>, Vec<u8>)> {
    let v: Value = serde_json::from_str(&fs::read_to_string(fixture(name)).unwrap()).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let ids = s["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let mask = s["loss_mask"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u8)
                .collect();
            (ids, mask)
        })
        .collect()
}

fn read_back(store: &Path) -> Vec<(Vec<u32>, Vec<u8>)> {
    let s = Store::open(store).unwrap();
    s.verify().unwrap();
    (0..s.len())
        .map(|i| (s.tokens(i).to_vec(), s.loss_mask(i).to_vec()))
        .collect()
}

fn prepare(args: &[&str]) -> std::process::Output {
    let mut all = vec!["prepare"];
    all.extend_from_slice(args);
    orch(&all)
}

/// `prepare`'s summary kept `samples` samples and skipped `skipped` for `reason`.
fn assert_kept_and_skipped(summary: &Value, samples: u64, reason: &str, skipped: u64) {
    assert_eq!(
        (
            summary["samples"].as_u64(),
            summary["skipped"][reason].as_u64()
        ),
        (Some(samples), Some(skipped)),
        "{summary}"
    );
}

/// Runs `prepare ARGS --json`, which must succeed, and returns its summary.
fn prepare_json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    serde_json::from_str(&stdout_ok(&prepare(&all))).unwrap()
}

/// Nothing but `keep` in `dir`: no store, no temporary directory.
fn assert_only(dir: &Path, keep: &[&str]) {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut keep: Vec<String> = keep.iter().map(|s| s.to_string()).collect();
    keep.sort();
    assert_eq!(names, keep, "unexpected entries in {}", dir.display());
}

#[test]
fn every_pretokenized_format_reads_back_exactly() {
    let want = expected("expected_pretok.json");
    let dir = tempfile::tempdir().unwrap();
    for (i, input) in [
        "pretok.jsonl",
        "pretok.parquet",
        "pretok_snappy.parquet",
        "hf_dataset",
    ]
    .iter()
    .enumerate()
    {
        let out = dir.path().join(format!("store{i}"));
        stdout_ok(&prepare(&[
            "--input",
            arg(&fixture(input)),
            "--output",
            arg(&out),
        ]));
        assert_eq!(read_back(&out), want, "{input}");
    }
}

#[test]
fn conversations_tokenize_like_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let tok = fixture("tokenizer.json");
    for (input, template, want) in [
        (
            "conversations.jsonl",
            "chatml",
            "expected_conversations_chatml.json",
        ),
        (
            "conversations_sharegpt.jsonl",
            "chatml",
            "expected_conversations_chatml.json",
        ),
        (
            "conversations.jsonl",
            "llama3",
            "expected_conversations_llama3.json",
        ),
        (
            "conversations_sharegpt.jsonl",
            "llama3",
            "expected_conversations_llama3.json",
        ),
    ] {
        let out = dir.path().join(format!("{input}-{template}"));
        stdout_ok(&prepare(&[
            "--input",
            arg(&fixture(input)),
            "--tokenizer",
            arg(&tok),
            "--chat-template",
            template,
            "--output",
            arg(&out),
        ]));
        assert_eq!(read_back(&out), expected(want), "{input} {template}");
        let meta: Value =
            serde_json::from_str(&fs::read_to_string(out.join("meta.json")).unwrap()).unwrap();
        assert_eq!(meta["vocab_size"], 600, "vocabulary from the tokenizer");
    }
}

#[test]
fn several_inputs_make_one_store_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    let summary = prepare_json(&[
        "--input",
        arg(&fixture("pretok.jsonl")),
        arg(&fixture("hf_dataset")),
        "--output",
        arg(&out),
    ]);
    assert_eq!(summary["samples"], 80);
    assert_eq!(
        summary["sources"].as_array().unwrap().len(),
        3,
        "one jsonl + two arrow shards"
    );
    let mut want = expected("expected_pretok.json");
    want.extend(expected("expected_pretok.json"));
    assert_eq!(read_back(&out), want);
}

/// A JSONL input made of the given lines, in a fresh directory.
fn jsonl(lines: &[String]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl");
    fs::write(&path, lines.join("\n") + "\n").unwrap();
    (dir, path)
}

fn good(n: usize) -> String {
    let ids: Vec<String> = (0..n).map(|i| (i % 500).to_string()).collect();
    format!(r#"{{"input_ids":[{}]}}"#, ids.join(","))
}

/// One bad line among good ones: `fail` stops naming file and line, leaving nothing; `skip`
/// keeps the good samples and counts the bad one under `reason`.
fn check_bad_line(bad: &str, reason: &str, needle: &str, extra: &[&str]) {
    let lines = vec![good(40), good(50), bad.to_owned(), good(60)];
    let (dir, input) = jsonl(&lines);
    let out = dir.path().join("store");
    let mut args = vec!["--input", arg(&input), "--output", arg(&out)];
    args.extend_from_slice(extra);
    let failed = prepare(&args);
    assert_refused(&failed, 2, &format!("{}:3", input.display()));
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    assert!(stderr.contains(reason), "{reason} not in {stderr}");
    assert_only(dir.path(), &["data.jsonl"]);

    args.extend_from_slice(&["--on-bad", "skip"]);
    let summary = prepare_json(&args);
    assert_eq!(summary["samples"], 3, "{bad}");
    assert_eq!(summary["skipped"][reason], 1, "{summary}");
    let meta: Value =
        serde_json::from_str(&fs::read_to_string(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["skipped"][reason], 1);
    assert_eq!(
        meta["skipped_examples"][0]["location"],
        format!("{}:3", input.display())
    );
    let inspect = stdout_ok(&orch(&["inspect", arg(&out)]));
    assert!(inspect.contains(&format!("{reason}: 1")), "{inspect}");
    assert_only(dir.path(), &["data.jsonl", "store"]);
}

#[test]
fn malformed_json_names_file_and_line() {
    check_bad_line(
        r#"{"input_ids": [1, 2"#,
        "malformed_json",
        "malformed JSON",
        &[],
    );
}

#[test]
fn mask_length_mismatch() {
    let ids: Vec<String> = (0..40).map(|i| i.to_string()).collect();
    let mask = vec!["1"; 39].join(",");
    let bad = format!(
        r#"{{"input_ids":[{}],"loss_mask":[{mask}]}}"#,
        ids.join(",")
    );
    check_bad_line(
        &bad,
        "mask_length_mismatch",
        "loss_mask has 39 values, input_ids has 40",
        &[],
    );
}

#[test]
fn non_integer_negative_and_out_of_vocab_ids() {
    check_bad_line(
        r#"{"input_ids":[1,2,3.5]}"#,
        "bad_token_id",
        "input_ids[2]: token id 3.5 is not an integer",
        &[],
    );
    check_bad_line(
        r#"{"input_ids":[1,"x"]}"#,
        "bad_token_id",
        "input_ids[1]",
        &[],
    );
    check_bad_line(
        r#"{"input_ids":[1,-7]}"#,
        "bad_token_id",
        "negative token id -7",
        &[],
    );
    let ids: Vec<String> = (0..40).map(|i| (i * 10).to_string()).collect();
    let bad = format!(r#"{{"input_ids":[{}]}}"#, ids.join(","));
    check_bad_line(
        &bad,
        "out_of_vocab",
        "input_ids[10] = 100 is outside the vocabulary (size 100)",
        &["--vocab-size", "100"],
    );
}

#[test]
fn bad_mask_values_and_missing_ids() {
    check_bad_line(
        r#"{"input_ids":[1,2],"loss_mask":[1,5]}"#,
        "bad_loss_mask",
        "loss_mask[1]",
        &[],
    );
    check_bad_line(r#"{"tokens":[1,2]}"#, "missing_field", "no input_ids", &[]);
    check_bad_line(
        r#"{"input_ids":[]}"#,
        "empty_sample",
        "input_ids is empty",
        &[],
    );
}

/// A bad whole input file: refused under `--on-bad fail` naming it and `reason`, leaving only the
/// files already in its directory; skipped and counted beside a good fixture under `--on-bad skip`.
fn check_bad_file(dir: &Path, bad: &Path, reason: &str, good: &str) {
    let before: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let keep: Vec<&str> = before.iter().map(String::as_str).collect();
    let out = dir.join("store");
    let name = bad.file_name().unwrap().to_str().unwrap();
    let failed = prepare(&["--input", arg(bad), "--output", arg(&out)]);
    assert_refused(&failed, 2, name);
    assert!(String::from_utf8_lossy(&failed.stderr).contains(reason));
    assert_only(dir, &keep);
    let summary = prepare_json(&[
        "--input",
        arg(bad),
        arg(&fixture(good)),
        "--output",
        arg(&out),
        "--on-bad",
        "skip",
    ]);
    assert_kept_and_skipped(&summary, 40, reason, 1);
}

#[test]
fn empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.jsonl");
    fs::write(&empty, "").unwrap();
    check_bad_file(dir.path(), &empty, "empty_file", "pretok.jsonl");
    // Skipped and nothing else: no store.
    let alone = prepare(&[
        "--input",
        arg(&empty),
        "--output",
        arg(&dir.path().join("s2")),
        "--on-bad",
        "skip",
    ]);
    assert_refused(&alone, 2, "no samples to store");
}

#[test]
fn too_few_loss_tokens_is_filtered_and_counted() {
    let short_loss = format!(
        r#"{{"input_ids":[{}],"loss_mask":[{}]}}"#,
        vec!["5"; 100].join(","),
        [vec!["0"; 90], vec!["1"; 10]].concat().join(",")
    );
    let (dir, input) = jsonl(&[good(40), short_loss, good(40)]);
    let out = dir.path().join("store");
    // A filter, not bad input: applied and counted even with --on-bad fail.
    let summary = prepare_json(&["--input", arg(&input), "--output", arg(&out)]);
    assert_eq!(summary["samples"], 2);
    assert_eq!(summary["skipped"]["too_few_loss_tokens"], 1);
    let summary = prepare_json(&[
        "--input",
        arg(&input),
        "--output",
        arg(&out),
        "--force",
        "--min-loss-tokens",
        "10",
    ]);
    assert_eq!(summary["samples"], 3);
}

#[test]
fn overlong_samples_under_each_policy() {
    let (dir, input) = jsonl(&[good(40), good(300), good(100)]);
    let out = dir.path().join("store");
    let summary = prepare_json(&[
        "--input",
        arg(&input),
        "--output",
        arg(&out),
        "--max-len",
        "120",
    ]);
    assert_eq!(
        (summary["samples"].as_u64(), summary["truncated"].as_u64()),
        (Some(3), Some(1))
    );
    let store = Store::open(&out).unwrap();
    assert_eq!(store.lengths(), vec![40, 120, 100]);
    assert_eq!(store.tokens(1), &(0..120).collect::<Vec<u32>>()[..]);

    let summary = prepare_json(&[
        "--input",
        arg(&input),
        "--output",
        arg(&out),
        "--force",
        "--max-len",
        "120",
        "--on-overlong",
        "drop",
    ]);
    assert_kept_and_skipped(&summary, 2, "overlong", 1);
    assert_eq!(Store::open(&out).unwrap().lengths(), vec![40, 100]);
}

#[test]
fn unknown_role_in_a_conversation() {
    let good_turns = |i: usize| {
        let words = vec!["word"; 60].join(" ");
        format!(
            r#"{{"conversations":[{{"role":"user","content":"q{i}"}},{{"role":"assistant","content":"{words}"}}]}}"#
        )
    };
    let bad =
        r#"{"conversations":[{"role":"user","content":"q"},{"role":"narrator","content":"x"}]}"#;
    let (dir, input) = jsonl(&[good_turns(1), good_turns(2), bad.to_owned(), good_turns(3)]);
    let out = dir.path().join("store");
    let tok = fixture("tokenizer.json");
    let failed = prepare(&[
        "--input",
        arg(&input),
        "--tokenizer",
        arg(&tok),
        "--output",
        arg(&out),
    ]);
    assert_refused(&failed, 2, &format!("{}:3", input.display()));
    assert!(String::from_utf8_lossy(&failed.stderr).contains("unknown role \"narrator\""));
    assert_only(dir.path(), &["data.jsonl"]);
    let summary = prepare_json(&[
        "--input",
        arg(&input),
        "--tokenizer",
        arg(&tok),
        "--output",
        arg(&out),
        "--on-bad",
        "skip",
    ]);
    assert_kept_and_skipped(&summary, 3, "unknown_role", 1);
    // Conversations need a tokenizer.
    assert_refused(
        &prepare(&[
            "--input",
            arg(&input),
            "--output",
            arg(&dir.path().join("x")),
        ]),
        2,
        "--tokenizer",
    );
}

#[test]
fn truncated_parquet_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = fs::read(fixture("pretok.parquet")).unwrap();
    let cut = dir.path().join("cut.parquet");
    fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    check_bad_file(dir.path(), &cut, "unreadable_file", "pretok_snappy.parquet");
}

#[test]
fn existing_store_needs_force() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    stdout_ok(&prepare(&[
        "--input",
        arg(&fixture("pretok.jsonl")),
        "--output",
        arg(&out),
    ]));
    assert_refused(
        &prepare(&[
            "--input",
            arg(&fixture("pretok.jsonl")),
            "--output",
            arg(&out),
        ]),
        2,
        "already exists",
    );
    stdout_ok(&prepare(&[
        "--input",
        arg(&fixture("hf_dataset")),
        "--output",
        arg(&out),
        "--force",
    ]));
    assert_eq!(Store::open(&out).unwrap().len(), 40);
    assert_only(dir.path(), &["store"]);
}

fn good_store() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    stdout_ok(&prepare(&[
        "--input",
        arg(&fixture("pretok.jsonl")),
        "--output",
        arg(&out),
    ]));
    (dir, out)
}

#[test]
fn truncated_store_is_refused_on_open() {
    let (_dir, store) = good_store();
    let tokens = store.join("tokens.bin");
    let len = fs::metadata(&tokens).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&tokens)
        .unwrap()
        .set_len(len - 4)
        .unwrap();
    assert_refused(&orch(&["inspect", arg(&store)]), 2, "tokens.bin is");
    assert_refused(&orch(&["plan", "--data", arg(&store)]), 2, "damaged");
}

#[test]
fn altered_store_is_caught_by_verify() {
    let (_dir, store) = good_store();
    let mask = store.join("loss_mask.bin");
    let mut bytes = fs::read(&mask).unwrap();
    bytes[100] ^= 1;
    fs::write(&mask, bytes).unwrap();
    stdout_ok(&orch(&["inspect", arg(&store)]));
    assert_refused(
        &orch(&["inspect", arg(&store), "--verify"]),
        2,
        "checksum mismatch in loss_mask.bin",
    );
}

#[test]
fn store_with_unknown_version_or_bad_meta_is_refused() {
    let (_dir, store) = good_store();
    let meta_path = store.join("meta.json");
    let meta = fs::read_to_string(&meta_path).unwrap();
    fs::write(&meta_path, meta.replace("\"version\": 1", "\"version\": 9")).unwrap();
    assert_refused(
        &orch(&["inspect", arg(&store)]),
        2,
        "version 9 is not supported",
    );
    fs::write(&meta_path, "{not json").unwrap();
    assert_refused(&orch(&["inspect", arg(&store)]), 2, "not valid JSON");
    assert_refused(
        &orch(&["inspect", "/nonexistent/store"]),
        2,
        "no such directory",
    );
}

#[test]
fn inspect_reports_counts_and_lengths() {
    let (_dir, store) = good_store();
    let v: Value = serde_json::from_str(&stdout_ok(&orch(&[
        "inspect",
        arg(&store),
        "--json",
        "--verify",
    ])))
    .unwrap();
    let want = expected("expected_pretok.json");
    let tokens: usize = want.iter().map(|s| s.0.len()).sum();
    let loss: usize = want
        .iter()
        .map(|s| s.1.iter().filter(|&&m| m == 1).count())
        .sum();
    assert_eq!(v["samples"], 40);
    assert_eq!(v["tokens"], tokens);
    assert_eq!(v["loss_tokens"], loss);
    assert_eq!(v["verified"], true);
    let max = want.iter().map(|s| s.0.len()).max().unwrap();
    assert_eq!(v["lengths"]["max"], max);
    let binned: u64 = v["histogram"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["samples"].as_u64().unwrap())
        .sum();
    assert_eq!(binned, 40);
    let text = stdout_ok(&orch(&["inspect", arg(&store)]));
    assert!(
        text.contains("samples 40") && text.contains("median"),
        "{text}"
    );
}

#[test]
fn plan_from_a_store_equals_plan_from_its_lengths() {
    let (dir, store) = good_store();
    let lengths: Vec<String> = expected("expected_pretok.json")
        .iter()
        .map(|s| s.0.len().to_string())
        .collect();
    let file = dir.path().join("lengths.txt");
    fs::write(&file, lengths.join("\n")).unwrap();
    let common = [
        "--token-budget",
        "2048",
        "--max-len",
        "512",
        "--buckets",
        "auto:3",
        "--json",
    ];
    let from_store: Value = {
        let mut a = vec!["plan", "--data", arg(&store)];
        a.extend_from_slice(&common);
        serde_json::from_str(&stdout_ok(&orch(&a))).unwrap()
    };
    let from_file: Value = {
        let mut a = vec!["plan", "--lengths", arg(&file)];
        a.extend_from_slice(&common);
        serde_json::from_str(&stdout_ok(&orch(&a))).unwrap()
    };
    for key in [
        "samples",
        "batches",
        "real_tokens",
        "padded_tokens",
        "buckets",
        "max_same_bucket_run",
    ] {
        assert_eq!(from_store[key], from_file[key], "{key}");
    }
}

/// A pre-tokenized JSONL big enough that prepare takes a while.
fn big_input(dir: &Path) -> PathBuf {
    let path = dir.join("big.jsonl");
    let line = good(2000) + "\n";
    fs::write(&path, line.repeat(20_000)).unwrap();
    path
}

fn wait_for(deadline: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

fn temp_dirs(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".store."))
        .collect()
}

#[test]
fn interrupted_prepare_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let input = big_input(dir.path());
    let out = dir.path().join("store");
    let child = Command::new(bin("dflash-orch"))
        .args(["prepare", "--input", arg(&input), "--output", arg(&out)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupt once it is writing.
    assert!(
        wait_for(Duration::from_secs(20), || !temp_dirs(dir.path())
            .is_empty()),
        "prepare never started writing"
    );
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out_child = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out_child.stderr);
    if out_child.status.code() == Some(0) {
        // Finished before the signal arrived: the store must then be whole.
        Store::open(&out).unwrap().verify().unwrap();
        return;
    }
    assert_eq!(out_child.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert_only(dir.path(), &["big.jsonl"]);
}

#[test]
fn killed_prepare_is_cleaned_up_by_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let input = big_input(dir.path());
    let out = dir.path().join("store");
    let mut child = Command::new(bin("dflash-orch"))
        .args(["prepare", "--input", arg(&input), "--output", arg(&out)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_for(Duration::from_secs(20), || !temp_dirs(dir.path())
        .is_empty()));
    child.kill().unwrap();
    child.wait().unwrap();
    if out.exists() {
        return; // finished before the kill
    }
    assert!(
        !temp_dirs(dir.path()).is_empty(),
        "SIGKILL leaves the temporary directory"
    );
    stdout_ok(&prepare(&[
        "--input",
        arg(&fixture("pretok.jsonl")),
        "--output",
        arg(&out),
    ]));
    assert!(
        temp_dirs(dir.path()).is_empty(),
        "the next prepare removed it"
    );
    assert_eq!(Store::open(&out).unwrap().len(), 40);
}

#[test]
fn bad_arguments_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    let o = arg(&out);
    let f = fixture("pretok.jsonl");
    assert_refused(
        &prepare(&["--input", "/nonexistent.jsonl", "--output", o]),
        2,
        "no such file",
    );
    assert_refused(
        &prepare(&["--input", arg(&f), "--output", o, "--format", "csv"]),
        2,
        "unknown format",
    );
    assert_refused(
        &prepare(&[
            "--input",
            arg(&f),
            "--output",
            o,
            "--chat-template",
            "vicuna",
        ]),
        2,
        "unknown chat template",
    );
    assert_refused(
        &prepare(&["--input", arg(&f), "--output", o, "--max-len", "0"]),
        2,
        "--max-len",
    );
    assert_refused(
        &prepare(&["--input", arg(&f), "--output", o, "--tokenizer", arg(&f)]),
        2,
        "not a usable tokenizer.json",
    );
    let odd = dir.path().join("data.csv");
    fs::write(&odd, "1,2,3\n").unwrap();
    assert_refused(
        &prepare(&["--input", arg(&odd), "--output", o]),
        2,
        "cannot tell the format",
    );
    assert_only(dir.path(), &["data.csv"]);
}

#[test]
fn byte_order_mark_and_crlf_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bom.jsonl");
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend_from_slice((good(40) + "\r\n" + &good(41) + "\r\n").as_bytes());
    fs::write(&input, bytes).unwrap();
    let out = dir.path().join("store");
    stdout_ok(&prepare(&["--input", arg(&input), "--output", arg(&out)]));
    assert_eq!(Store::open(&out).unwrap().lengths(), vec![40, 41]);
}

#[test]
fn broken_save_to_disk_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds");
    fs::create_dir(&ds).unwrap();
    let out = dir.path().join("store");
    fs::write(ds.join("state.json"), "{oops").unwrap();
    assert_refused(
        &prepare(&["--input", arg(&ds), "--output", arg(&out)]),
        2,
        "not a datasets state.json",
    );
    fs::write(
        ds.join("state.json"),
        r#"{"_data_files":[{"filename":"../../etc/passwd"}]}"#,
    )
    .unwrap();
    assert_refused(
        &prepare(&["--input", arg(&ds), "--output", arg(&out)]),
        2,
        "not a plain file name",
    );
    fs::write(
        ds.join("state.json"),
        r#"{"_data_files":[{"filename":"data-00000-of-00001.arrow"}]}"#,
    )
    .unwrap();
    fs::write(ds.join("data-00000-of-00001.arrow"), b"not arrow at all").unwrap();
    let failed = prepare(&["--input", arg(&ds), "--output", arg(&out)]);
    assert_refused(&failed, 2, "data-00000-of-00001.arrow");
    assert!(String::from_utf8_lossy(&failed.stderr).contains("unreadable_file"));
    assert_only(dir.path(), &["ds"]);
}

/// Auto-detection on a file whose bytes are not UTF-8 says so, with the line and the byte, as
/// it does wherever the bad line is the first record.
#[test]
fn invalid_utf8_is_named_with_its_line_and_byte_when_the_format_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    for (text, line, byte) in [
        (
            &b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi \xff\"}]}\n"[..],
            1,
            47,
        ),
        (
            &b"\n\n{\"conversations\": [{\"from\": \"human\", \"value\": \"\xc3\"}]}\n"[..],
            3,
            48,
        ),
        (&b"{\"input_ids\": [1, 2], \"note\": \"\xfe\"}\n"[..], 1, 32),
    ] {
        let input = dir.path().join("conv.jsonl");
        fs::write(&input, text).unwrap();
        let o = prepare(&["--input", arg(&input), "--output", arg(&out)]);
        assert_refused(
            &o,
            2,
            &format!("conv.jsonl:{line}: invalid UTF-8 at byte {byte} of the line"),
        );
        assert!(!out.exists());
    }
}
