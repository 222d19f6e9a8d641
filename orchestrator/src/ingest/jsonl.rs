//! JSON lines: the line reader shared by pre-tokenized samples and conversations.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use super::{CrcReader, JsonNumber, Location, Position, RawSample, Reason, Sink, Stop};

/// What reading one file found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileRead {
    pub crc32c: u32,
    pub bytes: u64,
}

/// Lines gathered before parsing them in parallel.
const BLOCK_LINES: usize = 4096;
const BLOCK_BYTES: usize = 8 << 20;

/// Reads a JSON-lines file in blocks of lines; `parse` turns each non-blank line into a value
/// (half of every block on a helper thread), then `deliver` hands the values to the sink in file
/// order with their locations. An unreadable file or one without records is rejected as a whole.
pub fn for_each_record<T: Send>(
    path: &Path,
    sink: &mut dyn Sink,
    parse: impl Fn(&[u8]) -> T + Sync,
    mut deliver: impl FnMut(&Location, T, &mut dyn Sink) -> Result<(), Stop>,
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
    let mut block: Vec<u8> = Vec::with_capacity(BLOCK_BYTES + (1 << 16));
    // (line number, start, end) of each record in `block`.
    let mut lines: Vec<(u64, usize, usize)> = Vec::with_capacity(BLOCK_LINES);
    let mut number = 0u64;
    let mut records = 0u64;
    let mut failed = None;
    loop {
        block.clear();
        lines.clear();
        let mut eof = false;
        while lines.len() < BLOCK_LINES && block.len() < BLOCK_BYTES {
            let start = block.len();
            match reader.read_until(b'\n', &mut block) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    number += 1;
                    sink.progress(n as u64);
                    let mut begin = start;
                    if number == 1 && block[start..].starts_with(b"\xEF\xBB\xBF") {
                        begin += 3;
                    }
                    if !block[begin..].iter().all(u8::is_ascii_whitespace) {
                        lines.push((number, begin, block.len()));
                    }
                }
                Err(e) => {
                    failed = Some((number + 1, e));
                    eof = true;
                    break;
                }
            }
        }
        records += lines.len() as u64;
        let parsed = crate::parallel::map_halves(&lines, |&(_, a, b)| parse(&block[a..b]));
        for (&(line, _, _), value) in lines.iter().zip(parsed) {
            at.at = Position::Line(line);
            deliver(&at, value, sink)?;
        }
        if eof {
            break;
        }
    }
    if let Some((line, e)) = failed {
        at.at = Position::Line(line);
        sink.reject(&at, Reason::UnreadableFile, format!("read error: {e}"))?;
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

/// The fields of a pre-tokenized record, parsed straight into their final vectors; the first bad
/// value is remembered while the rest of the line is still parsed (so malformed JSON wins).
#[derive(Default)]
struct Fields {
    input_ids: Option<Vec<u32>>,
    loss_mask: Option<Vec<u8>>,
    bad: Option<(Reason, String)>,
}

/// Deserializes one list field into `T`s with `convert`, or `None` for null.
struct ListSeed<T> {
    name: &'static str,
    convert: fn(JsonNumber) -> Result<T, String>,
}

impl<'de, T> serde::de::DeserializeSeed<'de> for ListSeed<T> {
    type Value = Option<(Vec<T>, Option<String>)>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T> serde::de::Visitor<'de> for ListSeed<T> {
    type Value = Option<(Vec<T>, Option<String>)>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} to be a list of integers", self.name)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(1024));
        let mut bad = None;
        let mut i = 0usize;
        while let Some(value) = seq.next_element::<JsonNumber>()? {
            if bad.is_none() {
                match (self.convert)(value) {
                    Ok(v) => out.push(v),
                    Err(e) => bad = Some(format!("{}[{i}]: {e}", self.name)),
                }
            }
            i += 1;
        }
        Ok(Some((out, bad)))
    }
}

struct RecordVisitor;

impl<'de> serde::de::Visitor<'de> for RecordVisitor {
    type Value = Fields;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
        let mut fields = Fields::default();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "input_ids" => {
                    let seed = ListSeed {
                        name: "input_ids",
                        convert: JsonNumber::token_id,
                    };
                    fields.input_ids = match map.next_value_seed(seed)? {
                        Some((ids, bad)) => {
                            if let Some(e) = bad {
                                fields.bad.get_or_insert((Reason::BadTokenId, e));
                            }
                            Some(ids)
                        }
                        None => None,
                    };
                }
                "loss_mask" => {
                    let seed = ListSeed {
                        name: "loss_mask",
                        convert: JsonNumber::mask_value,
                    };
                    fields.loss_mask = match map.next_value_seed(seed)? {
                        Some((mask, bad)) => {
                            if let Some(e) = bad {
                                fields.bad.get_or_insert((Reason::BadLossMask, e));
                            }
                            Some(mask)
                        }
                        None => None,
                    };
                }
                _ => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(fields)
    }
}

/// The common case, parsed fast: both lists plain non-negative integers written without exponent,
/// sign or fraction. Anything else goes to the full parser, which names what is wrong.
#[derive(serde::Deserialize)]
struct PlainRecord<'a> {
    #[serde(borrow)]
    input_ids: &'a serde_json::value::RawValue,
    #[serde(borrow, default)]
    loss_mask: Option<&'a serde_json::value::RawValue>,
}

/// Parses `[1, 2, 3]` (JSON already validated) into `out`; `false` for anything but plain integers
/// up to `max` (at most 10 digits).
fn plain_list<T: TryFrom<u64>>(raw: &str, max: u64, out: &mut Vec<T>) -> bool {
    let bytes = raw.as_bytes();
    let (Some(b'['), Some(b']')) = (bytes.first(), bytes.last()) else {
        return false;
    };
    let inner = &bytes[1..bytes.len() - 1];
    out.reserve(inner.len() / 4);
    let (mut value, mut digits) = (0u64, 0u32);
    let mut push = |value: u64| match T::try_from(value) {
        Ok(v) if value <= max => {
            out.push(v);
            true
        }
        _ => false,
    };
    for &b in inner {
        match b {
            b'0'..=b'9' => {
                value = value * 10 + u64::from(b - b'0');
                digits += 1;
                if digits > 10 {
                    return false;
                }
            }
            b',' => {
                if digits == 0 || !push(value) {
                    return false;
                }
                (value, digits) = (0, 0);
            }
            b' ' | b'\n' | b'\r' | b'\t' => {}
            _ => return false,
        }
    }
    digits == 0 && inner.iter().all(u8::is_ascii_whitespace) || digits > 0 && push(value)
}

fn parse_plain(line: &[u8]) -> Option<RawSample> {
    let record: PlainRecord = serde_json::from_slice(line).ok()?;
    let mut input_ids = Vec::new();
    if !plain_list(record.input_ids.get(), u64::from(u32::MAX), &mut input_ids) {
        return None;
    }
    let loss_mask = match record.loss_mask.map(|raw| raw.get()) {
        None | Some("null") => None,
        Some(raw) => {
            let mut mask = Vec::new();
            if !plain_list(raw, 1, &mut mask) {
                return None;
            }
            Some(mask)
        }
    };
    Some(RawSample {
        input_ids,
        loss_mask,
    })
}

/// Parses one pre-tokenized record, or says why it is not one.
pub fn parse_pretokenized(line: &[u8]) -> Result<RawSample, (Reason, String)> {
    if let Some(sample) = parse_plain(line) {
        return Ok(sample);
    }
    parse_checked(line)
}

/// The full parser: every value checked, the first bad one named.
fn parse_checked(line: &[u8]) -> Result<RawSample, (Reason, String)> {
    use serde::Deserializer as _;
    let mut de = serde_json::Deserializer::from_slice(line);
    let fields = de
        .deserialize_map(RecordVisitor)
        .and_then(|f| de.end().map(|()| f))
        .map_err(|e| json_error(&e))?;
    let input_ids = fields
        .input_ids
        .ok_or((Reason::MissingField, "no input_ids".to_owned()))?;
    if let Some(bad) = fields.bad {
        return Err(bad);
    }
    Ok(RawSample {
        input_ids,
        loss_mask: fields.loss_mask,
    })
}

/// Reads a file of pre-tokenized JSON lines into `sink`.
pub fn read_pretokenized(path: &Path, sink: &mut dyn Sink) -> Result<FileRead, Stop> {
    for_each_record(
        path,
        sink,
        parse_pretokenized,
        |at, parsed, sink| match parsed {
            Ok(sample) => sink.accept(at, sample),
            Err((reason, message)) => sink.reject(at, reason, message),
        },
    )
}

/// Which JSON-lines format a file holds, judged by its first record's keys.
pub fn sniff(path: &Path) -> Result<super::Format, String> {
    let file = File::open(path).map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    let mut number = 0usize;
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            // Empty: either reader reports it the same way.
            return Ok(super::Format::Jsonl);
        }
        number += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let value: serde_json::Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            Err(_) => {
                // Bytes that are not text say so, wherever they are: no format can read them.
                if let Err(bad) = std::str::from_utf8(&line) {
                    return Err(format!(
                        "{}:{number}: invalid UTF-8 at byte {} of the line (JSON lines must be UTF-8 text)",
                        path.display(),
                        bad.valid_up_to() + 1
                    ));
                }
                // Let the reader report the malformed line with its number.
                return Ok(super::Format::Jsonl);
            }
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

    /// The fast path and the full parser agree wherever the fast path answers.
    #[test]
    fn plain_and_checked_parsers_agree() {
        for line in [
            r#"{"input_ids":[1,2,3],"loss_mask":[0,1,1]}"#,
            r#"{"id":"x","input_ids":[ 4294967295 , 0 ]}"#,
            r#"{"input_ids":[],"loss_mask":[]}"#,
            r#"{"input_ids":[7],"loss_mask":null,"meta":{"a":[1,{"b":2}]}}"#,
            r#"{"input_ids":[7],"loss_mask":[1,1]}"#,
        ] {
            let fast = parse_plain(line.as_bytes()).expect(line);
            assert_eq!(Ok(fast), parse_checked(line.as_bytes()), "{line}");
        }
        for line in [
            r#"{"input_ids":[1,2.0]}"#,
            r#"{"input_ids":[1,-2]}"#,
            r#"{"input_ids":[1,1e3]}"#,
            r#"{"input_ids":[4294967296]}"#,
            r#"{"input_ids":[1],"loss_mask":[2]}"#,
            r#"{"input_ids":[1],"loss_mask":[true]}"#,
            r#"{"input_ids":null}"#,
            r#"{"input_ids":[1],"input_ids":[2]}"#,
            r#"{"input_ids":["1"]}"#,
        ] {
            assert!(parse_plain(line.as_bytes()).is_none(), "{line}");
        }
        assert_eq!(
            parse_pretokenized(br#"{"input_ids":[1],"loss_mask":[true]}"#)
                .unwrap()
                .loss_mask,
            Some(vec![1])
        );
    }

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
