//! Reading training data in the formats users already have, into samples for the store.
//!
//! Each reader streams its input and hands every record to a [`Sink`]: a sample, or a rejection
//! with its reason and location. Checks common to all formats (mask length, vocabulary, length
//! limits) live in the sink, so every format is held to the same rules.

pub mod arrow;
pub mod chat;
pub mod jsonl;

use std::fmt;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// The input formats `prepare` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// JSON lines of `{"input_ids": [...], "loss_mask": [...]}`.
    Jsonl,
    /// JSON lines of conversations, tokenized with a chat template.
    Chat,
    /// Parquet files with `input_ids` and `loss_mask` list columns.
    Parquet,
    /// A Hugging Face `datasets` `save_to_disk` directory.
    HfDisk,
    /// One Arrow IPC stream file.
    Arrow,
}

impl Format {
    pub const ALL: [Format; 5] = [
        Format::Jsonl,
        Format::Chat,
        Format::Parquet,
        Format::HfDisk,
        Format::Arrow,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::Jsonl => "jsonl",
            Format::Chat => "chat",
            Format::Parquet => "parquet",
            Format::HfDisk => "hf-disk",
            Format::Arrow => "arrow",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown format {s:?} (expected one of: jsonl, chat, parquet, hf-disk, arrow)"
                )
            })
    }
}

/// Where a record came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub at: Position,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// 1-based line of a text file.
    Line(u64),
    /// 0-based row of a table.
    Row(u64),
    /// The file as a whole.
    File,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Position::Line(n) => write!(f, "{}:{n}", self.file.display()),
            Position::Row(n) => write!(f, "{} row {n}", self.file.display()),
            Position::File => write!(f, "{}", self.file.display()),
        }
    }
}

/// Why a record does not become a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    MalformedJson,
    MissingField,
    BadTokenId,
    OutOfVocab,
    BadLossMask,
    MaskLengthMismatch,
    EmptySample,
    EmptyFile,
    UnknownRole,
    BadConversation,
    BadRecord,
    UnreadableFile,
    /// Filter: fewer loss tokens than `--min-loss-tokens`.
    TooFewLossTokens,
    /// Filter: longer than `--max-len` with `--on-overlong drop`.
    Overlong,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::MalformedJson => "malformed_json",
            Reason::MissingField => "missing_field",
            Reason::BadTokenId => "bad_token_id",
            Reason::OutOfVocab => "out_of_vocab",
            Reason::BadLossMask => "bad_loss_mask",
            Reason::MaskLengthMismatch => "mask_length_mismatch",
            Reason::EmptySample => "empty_sample",
            Reason::EmptyFile => "empty_file",
            Reason::UnknownRole => "unknown_role",
            Reason::BadConversation => "bad_conversation",
            Reason::BadRecord => "bad_record",
            Reason::UnreadableFile => "unreadable_file",
            Reason::TooFewLossTokens => "too_few_loss_tokens",
            Reason::Overlong => "overlong",
        }
    }

    /// Filters are options the user chose (`--min-loss-tokens`, `--on-overlong drop`): they drop
    /// samples and count them, whatever `--on-bad` says. Everything else is bad input.
    pub fn is_filter(self) -> bool {
        matches!(self, Reason::TooFewLossTokens | Reason::Overlong)
    }
}

/// A record read from an input, before the common checks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RawSample {
    pub input_ids: Vec<u32>,
    /// One 0/1 value per token; `None` means all ones.
    pub loss_mask: Option<Vec<u8>>,
}

/// What ends reading early. Readers pass it through unchanged.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    /// Bad input under `--on-bad fail`.
    #[error("{at}: {message} ({reason}; pass --on-bad skip to skip such samples and count them)", reason = reason.name())]
    Bad {
        at: Location,
        reason: Reason,
        message: String,
    },
    #[error("interrupted")]
    Interrupted,
    #[error(transparent)]
    Write(#[from] crate::store::StoreError),
}

/// Receives what readers read.
pub trait Sink {
    fn accept(&mut self, at: &Location, sample: RawSample) -> Result<(), Stop>;
    fn reject(&mut self, at: &Location, reason: Reason, message: String) -> Result<(), Stop>;
    /// `bytes` more of the current input were read.
    fn progress(&mut self, bytes: u64);
}

/// A reader that keeps the CRC-32C and count of the bytes it passes on.
pub struct CrcReader<R> {
    inner: R,
    pub crc: u32,
    pub bytes: u64,
}

impl<R: Read> CrcReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            crc: 0,
            bytes: 0,
        }
    }
}

impl<R: Read> Read for CrcReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// CRC-32C and size of a whole file.
pub fn file_crc(path: &Path) -> io::Result<(u32, u64)> {
    let mut reader = CrcReader::new(std::fs::File::open(path)?);
    io::copy(&mut reader, &mut io::sink())?;
    Ok((reader.crc, reader.bytes))
}

/// How to treat a JSON number that should be a token id or mask value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum JsonNumber {
    Unsigned(u64),
    Negative(i64),
    Float(f64),
    Bool(bool),
    /// Not a number at all (string, null, list, object): its JSON type.
    Other(&'static str),
}

impl JsonNumber {
    /// The value as a token id, or why it is not one.
    pub fn token_id(self) -> Result<u32, String> {
        match self {
            JsonNumber::Unsigned(v) => {
                u32::try_from(v).map_err(|_| format!("token id {v} does not fit in 32 bits"))
            }
            JsonNumber::Negative(v) => Err(format!("negative token id {v}")),
            JsonNumber::Float(v) => Err(format!("token id {v} is not an integer")),
            JsonNumber::Bool(v) => Err(format!("token id {v} is a boolean, not an integer")),
            JsonNumber::Other(kind) => Err(format!("token id is {kind}, not an integer")),
        }
    }

    /// The value as a loss-mask entry (0/1 or a boolean), or why it is not one.
    pub fn mask_value(self) -> Result<u8, String> {
        match self {
            JsonNumber::Unsigned(0) | JsonNumber::Bool(false) => Ok(0),
            JsonNumber::Unsigned(1) | JsonNumber::Bool(true) => Ok(1),
            JsonNumber::Unsigned(v) => Err(format!("loss_mask value {v} is not 0 or 1")),
            JsonNumber::Negative(v) => Err(format!("loss_mask value {v} is not 0 or 1")),
            JsonNumber::Float(v) => Err(format!("loss_mask value {v} is not 0 or 1")),
            JsonNumber::Other(kind) => Err(format!("loss_mask value is {kind}, not 0 or 1")),
        }
    }
}

impl<'de> serde::Deserialize<'de> for JsonNumber {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = JsonNumber;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_u64<E>(self, v: u64) -> Result<JsonNumber, E> {
                Ok(JsonNumber::Unsigned(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<JsonNumber, E> {
                Ok(if v >= 0 {
                    JsonNumber::Unsigned(v as u64)
                } else {
                    JsonNumber::Negative(v)
                })
            }
            fn visit_f64<E>(self, v: f64) -> Result<JsonNumber, E> {
                Ok(JsonNumber::Float(v))
            }
            fn visit_bool<E>(self, v: bool) -> Result<JsonNumber, E> {
                Ok(JsonNumber::Bool(v))
            }
            fn visit_str<E>(self, _: &str) -> Result<JsonNumber, E> {
                Ok(JsonNumber::Other("a string"))
            }
            fn visit_unit<E>(self) -> Result<JsonNumber, E> {
                Ok(JsonNumber::Other("null"))
            }
            fn visit_none<E>(self) -> Result<JsonNumber, E> {
                Ok(JsonNumber::Other("null"))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<JsonNumber, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(JsonNumber::Other("a list"))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<JsonNumber, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(JsonNumber::Other("an object"))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Turns values into token ids, naming the first bad one.
pub fn token_ids(values: impl IntoIterator<Item = JsonNumber>) -> Result<Vec<u32>, String> {
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| v.token_id().map_err(|e| format!("input_ids[{i}]: {e}")))
        .collect()
}

/// Turns values into a 0/1 loss mask, naming the first bad one.
pub fn mask_values(values: impl IntoIterator<Item = JsonNumber>) -> Result<Vec<u8>, String> {
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| v.mask_value().map_err(|e| format!("loss_mask[{i}]: {e}")))
        .collect()
}
