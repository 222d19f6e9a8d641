//! JSON lines: the line reader shared by pre-tokenized samples and conversations.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::Deserialize;

use super::{
    CrcReader, JsonNumber, Location, Position, RawSample, Reason, Sink, Stop, mask_values,
    token_ids,
};

/// What reading one file found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileRead {
    pub crc32c: u32,
    pub bytes: u64,
}

/// Calls `record` with every non-blank line of a JSON-lines file (its location, its bytes).
/// An unreadable file or one without records is rejected as a whole.
pub fn for_each_line(
    path: &Path,
    sink: &mut dyn Sink,
    mut record: impl FnMut(&Location, &[u8], &mut dyn Sink) -> Result<(), Stop>,
) -> Result<FileRead, Stop> {
    let mut at = Location {
        file: path.to_path_buf(),
        at: Position::File,
    };
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) => {
            sink.reject(&at, Reason::UnreadableFile, format!("cannot open: {e}"))?;
            return Ok(FileRead::default());
        }
    };
    let mut reader = BufReader::with_capacity(1 << 20, CrcReader::new(file));
    let mut line = Vec::with_capacity(1 << 16);
    let mut number = 0u64;
    let mut records = 0u64;
    loop {
        line.clear();
        let n = match reader.read_until(b'\n', &mut line) {
            Ok(n) => n,
            Err(e) => {
                at.at = Position::Line(number + 1);
                sink.reject(&at, Reason::UnreadableFile, format!("read error: {e}"))?;
                break;
            }
        };
        if n == 0 {
            break;
        }
        number += 1;
        sink.progress(n as u64);
        let text = match line.strip_prefix(b"\xEF\xBB\xBF") {
            Some(rest) if number == 1 => rest,
            _ => &line[..],
        };
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        records += 1;
        at.at = Position::Line(number);
        record(&at, text, sink)?;
    }
    if records == 0 {
        at.at = Position::File;
        sink.reject(&at, Reason::EmptyFile, "no records".into())?;
    }
    let counted = reader.into_inner();
    Ok(FileRead {
        crc32c: counted.crc,
        bytes: counted.bytes,
    })
}

/// A serde_json error as a reason and a message without serde's "line 1" (lines are ours).
pub fn json_error(e: &serde_json::Error) -> (Reason, String) {
    use serde_json::error::Category;
    let text = e.to_string();
    let text = match text.rfind(" at line ") {
        Some(i) => format!("{} (column {})", &text[..i], e.column()),
        None => text,
    };
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            (Reason::MalformedJson, format!("malformed JSON: {text}"))
        }
        Category::Data => (Reason::BadRecord, text),
    }
}

#[derive(Deserialize)]
struct PretokenizedRecord {
    #[serde(default)]
    input_ids: Option<Vec<JsonNumber>>,
    #[serde(default)]
    loss_mask: Option<Vec<JsonNumber>>,
}

/// Parses one pre-tokenized record, or says why it is not one.
pub fn parse_pretokenized(line: &[u8]) -> Result<RawSample, (Reason, String)> {
    let record: PretokenizedRecord = serde_json::from_slice(line).map_err(|e| json_error(&e))?;
    let ids = record
        .input_ids
        .ok_or((Reason::MissingField, "no input_ids".to_owned()))?;
    let input_ids = token_ids(&ids).map_err(|e| (Reason::BadTokenId, e))?;
    let loss_mask = match record.loss_mask {
        Some(values) => Some(mask_values(&values).map_err(|e| (Reason::BadLossMask, e))?),
        None => None,
    };
    Ok(RawSample {
        input_ids,
        loss_mask,
    })
}

/// Reads a file of pre-tokenized JSON lines into `sink`.
pub fn read_pretokenized(path: &Path, sink: &mut dyn Sink) -> Result<FileRead, Stop> {
    for_each_line(path, sink, |at, line, sink| {
        match parse_pretokenized(line) {
            Ok(sample) => sink.accept(at, sample),
            Err((reason, message)) => sink.reject(at, reason, message),
        }
    })
}

/// Which JSON-lines format a file holds, judged by its first record's keys.
pub fn sniff(path: &Path) -> Result<super::Format, String> {
    let file = File::open(path).map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            // Empty: either reader reports it the same way.
            return Ok(super::Format::Jsonl);
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let value: serde_json::Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            // Let the reader report the malformed line with its number.
            Err(_) => return Ok(super::Format::Jsonl),
        };
        return if value.get("input_ids").is_some() {
            Ok(super::Format::Jsonl)
        } else if value.get("conversations").is_some() || value.get("messages").is_some() {
            Ok(super::Format::Chat)
        } else {
            Err(format!(
                "{}: cannot tell the format: the first record has neither input_ids nor \
                 conversations (pass --format)",
                path.display()
            ))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids_and_masks() {
        let s =
            parse_pretokenized(br#"{"input_ids":[1,2,3],"loss_mask":[0,true,1],"x":"y"}"#).unwrap();
        assert_eq!(s.input_ids, vec![1, 2, 3]);
        assert_eq!(s.loss_mask, Some(vec![0, 1, 1]));
        let s = parse_pretokenized(br#"{"input_ids":[7],"loss_mask":null}"#).unwrap();
        assert_eq!(s.loss_mask, None);
    }

    #[test]
    fn classifies_bad_records() {
        let reason = |line: &str| parse_pretokenized(line.as_bytes()).unwrap_err();
        assert_eq!(reason(r#"{"input_ids":[1,2"#).0, Reason::MalformedJson);
        assert_eq!(reason("not json").0, Reason::MalformedJson);
        assert_eq!(reason(r#"{"loss_mask":[1]}"#).0, Reason::MissingField);
        let (r, m) = reason(r#"{"input_ids":[1,-2]}"#);
        assert_eq!(
            (r, m.as_str()),
            (Reason::BadTokenId, "input_ids[1]: negative token id -2")
        );
        let (r, m) = reason(r#"{"input_ids":[1,2.5]}"#);
        assert_eq!(r, Reason::BadTokenId);
        assert!(m.contains("not an integer"), "{m}");
        assert_eq!(reason(r#"{"input_ids":["5"]}"#).0, Reason::BadTokenId);
        assert_eq!(
            reason(r#"{"input_ids":[5000000000]}"#).0,
            Reason::BadTokenId
        );
        assert_eq!(
            reason(r#"{"input_ids":[1],"loss_mask":[2]}"#).0,
            Reason::BadLossMask
        );
        let (r, m) = reason(r#"{"input_ids":"abc"}"#);
        assert_eq!(r, Reason::BadRecord);
        assert!(!m.contains("line 1"), "{m}");
        assert_eq!(reason("[1,2]").0, Reason::BadRecord);
    }
}
