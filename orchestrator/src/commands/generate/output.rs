//! The output of `generate`, resumable and never half-written.
//!
//! Rows go to `OUTPUT.partial` a whole batch at a time (appended, then synced), and
//! `OUTPUT.partial.json` records how many batches, rows and bytes of it are committed (written
//! to a temporary name, synced and renamed over the old record). A killed run leaves both; a
//! resumed one cuts the partial file back to the committed bytes (a batch written after the last
//! record is dropped and redone) and continues with the next batch. At the end `OUTPUT.meta.json`
//! (what produced the rows) and `OUTPUT` appear by rename, and the partial record goes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What decides the rows: a resumed run must match it exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// "target" (our workers) or "server" (an OpenAI-compatible server).
    pub producer: String,
    /// The engine our workers decode on (`candle`, `torch`); none for a server. The engines'
    /// rows differ: sampled rows draw from each engine's own random stream, and even greedy
    /// rows are not provably equal (their arithmetic differs, and a near-tie between two tokens
    /// can go either way), so an output is never continued on another engine.
    pub engine: Option<String>,
    pub target_model: Option<String>,
    pub server: Option<String>,
    pub server_model: Option<String>,
    pub inputs: Vec<String>,
    pub rows: u64,
    pub batch_size: u64,
    pub max_new_tokens: u64,
    pub temperature: f64,
    pub seed: u64,
    pub stop_token_ids: Vec<u32>,
    pub dtype: String,
    /// A hash of the inputs' bytes (every file, in order).
    pub input_hash: String,
    /// The chat template conversations are rendered with, and a hash of its text.
    pub chat_template: String,
    pub chat_template_hash: String,
    /// A hash of the tokenizer.json (none when there is none).
    pub tokenizer_hash: Option<String>,
    /// The target's identity (config and weight headers, as launch binds checkpoints) and a
    /// sample of its weights; none when a server produces the rows.
    pub target_weights: Option<String>,
}

/// The committed part of the partial file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Committed {
    pub version: u32,
    pub settings: Settings,
    pub batches: u64,
    pub rows: u64,
    pub bytes: u64,
}

/// 2: the settings identify the inputs, template, tokenizer and weights. 3: and the engine.
const VERSION: u32 = 3;

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Paths of one output.
#[derive(Debug, Clone)]
pub struct Paths {
    pub output: PathBuf,
    pub partial: PathBuf,
    pub record: PathBuf,
    pub meta: PathBuf,
}

impl Paths {
    pub fn of(output: &Path) -> Self {
        Self {
            output: output.to_path_buf(),
            partial: with_suffix(output, ".partial"),
            record: with_suffix(output, ".partial.json"),
            meta: with_suffix(output, ".meta.json"),
        }
    }
}

/// Where a run starts: from scratch, or after the committed batches of a killed one.
pub fn starting_point(
    paths: &Paths,
    settings: &Settings,
    resume: bool,
    force: bool,
) -> Result<Option<Committed>, String> {
    if paths.output.exists() && !force {
        return Err(format!(
            "--output {} exists (pass --force to replace it)",
            paths.output.display()
        ));
    }
    let has_record = paths.record.exists();
    if !resume {
        if has_record || paths.partial.exists() {
            return Err(format!(
                "{} holds the rows of an interrupted generate: pass --resume to continue it, or \
                 remove it and {} to start over",
                paths.partial.display(),
                paths.record.display()
            ));
        }
        return Ok(None);
    }
    if !has_record {
        return Ok(None);
    }
    let text = fs::read(&paths.record)
        .map_err(|e| format!("{}: cannot read: {e}", paths.record.display()))?;
    let committed: Committed = serde_json::from_slice(&text)
        .map_err(|e| format!("{}: not a generate record: {e}", paths.record.display()))?;
    if committed.version != VERSION {
        return Err(format!(
            "{}: record version {}, this build writes {VERSION}: finish it with the dflash-orch \
             that started it, or remove it and {} to start over",
            paths.record.display(),
            committed.version,
            paths.partial.display()
        ));
    }
    if let (Some(was), Some(now)) = (&committed.settings.engine, &settings.engine)
        && was != now
    {
        return Err(format!(
            "--resume: the rows of {} were generated on the {was} engine, and --engine {now} \
             would continue them: {}, so one output never mixes the two; resume with --engine \
             {was}, or remove it and {} to start over",
            paths.partial.display(),
            if settings.temperature > 0.0 {
                "sampled rows depend on the engine (each draws from its own random stream)"
            } else {
                "even greedy rows are not provably the same on both (their arithmetic differs, \
                 and a near-tie between two tokens can go either way)"
            },
            paths.record.display()
        ));
    }
    if committed.settings != *settings {
        return Err(format!(
            "--resume: {} was made from other inputs or settings ({}); run it with the same \
             inputs, model and options, or remove it to start over",
            paths.partial.display(),
            differences(&committed.settings, settings).join("; ")
        ));
    }
    let size = fs::metadata(&paths.partial).map(|m| m.len()).unwrap_or(0);
    if size < committed.bytes {
        return Err(format!(
            "{} is shorter ({size} bytes) than its record says ({} bytes): it was changed by \
             hand; remove it and {} to start over",
            paths.partial.display(),
            committed.bytes,
            paths.record.display()
        ));
    }
    Ok(Some(committed))
}

/// The settings that differ, each named with the recorded value and this run's.
fn differences(a: &Settings, b: &Settings) -> Vec<String> {
    let (a, b) = (
        serde_json::to_value(a).unwrap_or_default(),
        serde_json::to_value(b).unwrap_or_default(),
    );
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return Vec::new();
    };
    a.iter()
        .filter(|(k, v)| b.get(*k) != Some(v))
        .map(|(k, v)| {
            let now = b.get(k).cloned().unwrap_or_default();
            format!(
                "{}: recorded {}, now {}",
                k.replace('_', "-"),
                crate::format::clip(&v.to_string(), 200),
                crate::format::clip(&now.to_string(), 200)
            )
        })
        .collect()
}

/// Appends committed batches to the partial file.
pub struct Writer {
    paths: Paths,
    file: File,
    committed: Committed,
}

impl Writer {
    /// Opens the partial file after `from` (cut back to its committed bytes), or a new one.
    pub fn open(paths: &Paths, settings: Settings, from: Option<Committed>) -> io::Result<Self> {
        if let Some(dir) = paths.output.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir)?;
        }
        let committed = from.unwrap_or(Committed {
            version: VERSION,
            settings,
            batches: 0,
            rows: 0,
            bytes: 0,
        });
        let file = crate::fsutil::open_own(
            &paths.partial,
            OpenOptions::new().create(true).write(true).truncate(false),
        )?;
        file.set_len(committed.bytes)?;
        let mut writer = Self {
            paths: paths.clone(),
            file,
            committed,
        };
        writer.write_record()?;
        Ok(writer)
    }

    pub fn committed(&self) -> &Committed {
        &self.committed
    }

    fn write_record(&mut self) -> io::Result<()> {
        let temp = with_suffix(&self.paths.record, ".tmp");
        let _ = fs::remove_file(&temp);
        let mut f = crate::fsutil::create_private(&temp)?;
        f.write_all(&serde_json::to_vec_pretty(&self.committed).map_err(io::Error::other)?)?;
        f.sync_all()?;
        fs::rename(&temp, &self.paths.record)
    }

    /// Appends one batch's rows (JSON lines) and commits them.
    pub fn commit(&mut self, rows: &[String]) -> io::Result<()> {
        use std::io::{Seek, SeekFrom};
        self.file.seek(SeekFrom::Start(self.committed.bytes))?;
        let mut bytes = Vec::new();
        for row in rows {
            bytes.extend_from_slice(row.as_bytes());
            bytes.push(b'\n');
        }
        self.file.write_all(&bytes)?;
        self.file.sync_data()?;
        self.committed.bytes += bytes.len() as u64;
        self.committed.rows += rows.len() as u64;
        self.committed.batches += 1;
        self.write_record()
    }

    /// Every row is in: the metadata, then the output, appear by rename.
    pub fn finish(self, meta: &serde_json::Value) -> io::Result<()> {
        let temp = with_suffix(&self.paths.meta, ".tmp");
        let _ = fs::remove_file(&temp);
        let mut f = crate::fsutil::create_private(&temp)?;
        f.write_all(&serde_json::to_vec_pretty(meta).map_err(io::Error::other)?)?;
        f.sync_all()?;
        fs::rename(&temp, &self.paths.meta)?;
        self.file.sync_all()?;
        fs::rename(&self.paths.partial, &self.paths.output)?;
        fs::remove_file(&self.paths.record)?;
        if let Some(dir) = self.paths.output.parent() {
            let _ = File::open(if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            })
            .and_then(|d| d.sync_all());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(rows: u64) -> Settings {
        Settings {
            producer: "target".into(),
            engine: Some("torch".into()),
            target_model: Some("t".into()),
            server: None,
            server_model: None,
            inputs: vec!["in.jsonl".into()],
            rows,
            batch_size: 2,
            max_new_tokens: 8,
            temperature: 0.0,
            seed: 0,
            stop_token_ids: vec![2],
            dtype: "f32".into(),
            input_hash: "00aa".into(),
            chat_template: "chatml".into(),
            chat_template_hash: "11bb".into(),
            tokenizer_hash: Some("22cc".into()),
            target_weights: Some("33dd".into()),
        }
    }

    #[test]
    fn a_resume_from_other_inputs_is_refused_naming_what_changed_and_both_values() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::of(&dir.path().join("out.jsonl"));
        let mut w = Writer::open(&paths, settings(4), None).unwrap();
        w.commit(&["a".into(), "b".into()]).unwrap();
        drop(w);
        type Change = fn(&mut Settings);
        let table: [(&str, Change, &str, &str); 7] = [
            (
                "input-hash",
                |s| s.input_hash = "ffff".into(),
                "\"00aa\"",
                "\"ffff\"",
            ),
            (
                "chat-template",
                |s| s.chat_template = "llama3".into(),
                "\"chatml\"",
                "\"llama3\"",
            ),
            (
                "chat-template-hash",
                |s| s.chat_template_hash = "x".into(),
                "\"11bb\"",
                "\"x\"",
            ),
            (
                "tokenizer-hash",
                |s| s.tokenizer_hash = None,
                "\"22cc\"",
                "null",
            ),
            (
                "target-weights",
                |s| s.target_weights = Some("44".into()),
                "\"33dd\"",
                "\"44\"",
            ),
            (
                "server",
                |s| s.server = Some("http://h:1".into()),
                "null",
                "\"http://h:1\"",
            ),
            ("temperature", |s| s.temperature = 0.5, "0.0", "0.5"),
        ];
        for (name, change, was, now) in table {
            let mut other = settings(4);
            change(&mut other);
            let err = starting_point(&paths, &other, true, false).unwrap_err();
            assert!(
                err.contains(&format!("{name}: recorded {was}, now {now}")),
                "{name}: {err}"
            );
        }
        assert!(starting_point(&paths, &settings(4), true, false).is_ok());
    }

    #[test]
    fn a_resumed_output_continues_after_the_committed_batches() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::of(&dir.path().join("out.jsonl"));
        assert_eq!(
            starting_point(&paths, &settings(5), false, false).unwrap(),
            None
        );
        let mut w = Writer::open(&paths, settings(5), None).unwrap();
        w.commit(&["a".into(), "b".into()]).unwrap();
        w.commit(&["c".into(), "d".into()]).unwrap();
        drop(w);
        // A batch written after the last record (a kill in between) is cut off.
        let mut f = OpenOptions::new()
            .append(true)
            .open(&paths.partial)
            .unwrap();
        f.write_all(b"e\nhalf").unwrap();
        let err = starting_point(&paths, &settings(5), false, false).unwrap_err();
        assert!(err.contains("--resume"), "{err}");
        let err = starting_point(&paths, &settings(6), true, false).unwrap_err();
        assert!(err.contains("rows: recorded 5, now 6"), "{err}");
        let from = starting_point(&paths, &settings(5), true, false)
            .unwrap()
            .unwrap();
        assert_eq!((from.batches, from.rows), (2, 4));
        let mut w = Writer::open(&paths, settings(5), Some(from)).unwrap();
        w.commit(&["e".into()]).unwrap();
        w.finish(&serde_json::json!({"producer": "target"}))
            .unwrap();
        assert_eq!(
            fs::read_to_string(&paths.output).unwrap(),
            "a\nb\nc\nd\ne\n"
        );
        assert!(!paths.partial.exists() && !paths.record.exists());
        assert!(paths.meta.exists());
        let err = starting_point(&paths, &settings(5), false, false).unwrap_err();
        assert!(err.contains("--force"), "{err}");
    }

    #[test]
    fn a_partial_file_shorter_than_its_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::of(&dir.path().join("out.jsonl"));
        let mut w = Writer::open(&paths, settings(4), None).unwrap();
        w.commit(&["a".into(), "b".into()]).unwrap();
        drop(w);
        fs::write(&paths.partial, "a").unwrap();
        let err = starting_point(&paths, &settings(4), true, false).unwrap_err();
        assert!(err.contains("shorter"), "{err}");
        fs::write(&paths.record, "{").unwrap();
        let err = starting_point(&paths, &settings(4), true, false).unwrap_err();
        assert!(err.contains("not a generate record"), "{err}");
    }
}
