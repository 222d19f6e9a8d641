//! The dataset store: what `prepare` writes once and everything else reads, memory-mapped.
//!
//! A store is a directory:
//! - `tokens.bin`: every sample's token ids, concatenated, u32 little-endian;
//! - `loss_mask.bin`: one byte (0 or 1) per token;
//! - `index.bin`: one [`IndexEntry`] (16 bytes) per sample: token offset, length, loss tokens;
//! - `meta.json`: format and version, counts, options, sources and their checksums, the size and
//!   CRC-32C of every file above, and what was skipped and why.
//!
//! Opening checks the version, every file's size against `meta.json` and the index's consistency,
//! so a truncated or mismatched store is refused at once; [`Store::verify`] also compares
//! checksums.

mod writer;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use writer::StoreWriter;

#[cfg(not(target_endian = "little"))]
compile_error!("the store format is little-endian; big-endian hosts are not supported");

/// `format` field of `meta.json`.
pub const FORMAT: &str = "dflash-store";
/// Layout version this build writes and reads.
pub const VERSION: u32 = 1;
pub const TOKENS_FILE: &str = "tokens.bin";
pub const MASK_FILE: &str = "loss_mask.bin";
pub const INDEX_FILE: &str = "index.bin";
pub const META_FILE: &str = "meta.json";
/// `meta.json` larger than this is not a store's (it holds counts and a few examples).
const META_MAX_BYTES: u64 = 16 << 20;

/// Where one sample lives in the token and mask files.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct IndexEntry {
    /// First token, counted in tokens from the start of `tokens.bin`.
    pub offset: u64,
    pub len: u32,
    /// Tokens whose loss mask is 1.
    pub loss_tokens: u32,
}

/// Size and CRC-32C of one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    pub bytes: u64,
    pub crc32c: u32,
}

/// One input of `prepare`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceMeta {
    pub path: String,
    pub format: String,
    pub bytes: u64,
    pub crc32c: u32,
    pub samples: u64,
    pub skipped: u64,
}

/// One skipped sample, as an example of its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkipExample {
    pub reason: String,
    pub location: String,
    pub message: String,
}

/// `meta.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreMeta {
    pub format: String,
    pub version: u32,
    pub samples: u64,
    pub tokens: u64,
    pub loss_tokens: u64,
    pub vocab_size: Option<u32>,
    pub max_len: u32,
    pub on_overlong: String,
    pub min_loss_tokens: u32,
    pub truncated: u64,
    /// Samples left out, by reason (bad input skipped with `--on-bad skip`, and filters).
    pub skipped: BTreeMap<String, u64>,
    pub skipped_examples: Vec<SkipExample>,
    pub sources: Vec<SourceMeta>,
    pub files: BTreeMap<String, FileMeta>,
    pub created_by: String,
}

/// Why a store cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a dflash-orch store: {reason}")]
    NotAStore { path: PathBuf, reason: String },
    #[error(
        "{path}: store format version {found} is not supported (this build reads version {VERSION}); prepare it again"
    )]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: store is damaged: {reason}")]
    Damaged { path: PathBuf, reason: String },
    #[error("{path} already exists (pass --force to replace it)")]
    Exists { path: PathBuf },
    #[error(
        "{path}: checksum mismatch in {file}: CRC-32C {found:08x}, meta.json records {expected:08x}"
    )]
    Checksum {
        path: PathBuf,
        file: &'static str,
        found: u32,
        expected: u32,
    },
}

/// An open, checked store; token data is memory-mapped, never copied.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    meta: StoreMeta,
    tokens: Mapped,
    mask: Mapped,
    index: Mapped,
}

/// A read-only file mapping (empty files are not mapped).
#[derive(Debug)]
struct Mapped(Option<memmap2::Mmap>);

impl Mapped {
    fn bytes(&self) -> &[u8] {
        self.0.as_deref().unwrap_or(&[])
    }
}

impl Store {
    /// Opens and checks a store: version, file sizes, index consistency.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| StoreError::Io {
            path: path.clone(),
            source,
        };
        let damaged = |reason: String| StoreError::Damaged {
            path: path.clone(),
            reason,
        };
        if !path.is_dir() {
            return Err(StoreError::NotAStore {
                path: path.clone(),
                reason: if path.exists() {
                    "not a directory".into()
                } else {
                    "no such directory".into()
                },
            });
        }
        let meta_path = path.join(META_FILE);
        let meta_len = std::fs::metadata(&meta_path)
            .map_err(|_| StoreError::NotAStore {
                path: path.clone(),
                reason: format!("no {META_FILE}"),
            })?
            .len();
        if meta_len > META_MAX_BYTES {
            return Err(damaged(format!("{META_FILE} is {meta_len} bytes")));
        }
        let text = std::fs::read(&meta_path).map_err(io)?;
        let meta = parse_meta(&path, &text)?;

        let expected = [
            (TOKENS_FILE, meta.tokens.checked_mul(4)),
            (MASK_FILE, Some(meta.tokens)),
            (INDEX_FILE, meta.samples.checked_mul(16)),
        ];
        for (name, size) in expected {
            let size = size.ok_or_else(|| damaged(format!("{META_FILE} counts overflow")))?;
            let recorded = meta
                .files
                .get(name)
                .ok_or_else(|| damaged(format!("{META_FILE} does not describe {name}")))?;
            if recorded.bytes != size {
                return Err(damaged(format!(
                    "{META_FILE} records {} bytes for {name}, its counts need {size}",
                    recorded.bytes
                )));
            }
            let actual = std::fs::metadata(path.join(name))
                .map_err(|e| damaged(format!("{name}: {e}")))?
                .len();
            if actual != size {
                return Err(damaged(format!(
                    "{name} is {actual} bytes, expected {size} (truncated or altered)"
                )));
            }
        }
        let map = |name: &str| -> Result<Mapped, StoreError> {
            let file_path = path.join(name);
            let file = File::open(&file_path).map_err(|source| StoreError::Io {
                path: file_path.clone(),
                source,
            })?;
            if file.metadata().map_err(io)?.len() == 0 {
                return Ok(Mapped(None));
            }
            // SAFETY: store files are written once by `prepare` and never modified in place;
            // a store replaced under a running reader is outside the contract (prepare renames a
            // new directory into place, leaving open mappings of the old files valid).
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| StoreError::Io {
                path: file_path,
                source,
            })?;
            Ok(Mapped(Some(mmap)))
        };
        let store = Store {
            tokens: map(TOKENS_FILE)?,
            mask: map(MASK_FILE)?,
            index: map(INDEX_FILE)?,
            meta,
            path: path.clone(),
        };
        store.check_index()?;
        Ok(store)
    }

    fn check_index(&self) -> Result<(), StoreError> {
        let damaged = |reason: String| StoreError::Damaged {
            path: self.path.clone(),
            reason,
        };
        if self.meta.samples == 0 {
            return Err(damaged("no samples".into()));
        }
        let mut next = 0u64;
        let mut loss = 0u64;
        for (i, e) in self.index().iter().enumerate() {
            if e.offset != next || e.len == 0 || e.loss_tokens > e.len {
                return Err(damaged(format!(
                    "{INDEX_FILE} entry {i} (offset {}, length {}, loss tokens {}) does not follow \
                     the previous sample",
                    e.offset, e.len, e.loss_tokens
                )));
            }
            next += u64::from(e.len);
            loss += u64::from(e.loss_tokens);
        }
        if next != self.meta.tokens || loss != self.meta.loss_tokens {
            return Err(damaged(format!(
                "{INDEX_FILE} covers {next} tokens ({loss} loss tokens), {META_FILE} records {} \
                 ({})",
                self.meta.tokens, self.meta.loss_tokens
            )));
        }
        Ok(())
    }

    /// Compares every file's CRC-32C with `meta.json`.
    pub fn verify(&self) -> Result<(), StoreError> {
        for (name, mapped) in [
            (TOKENS_FILE, &self.tokens),
            (MASK_FILE, &self.mask),
            (INDEX_FILE, &self.index),
        ] {
            let found = crc32c::crc32c(mapped.bytes());
            let expected = self.meta.files[name].crc32c;
            if found != expected {
                return Err(StoreError::Checksum {
                    path: self.path.clone(),
                    file: name,
                    found,
                    expected,
                });
            }
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn meta(&self) -> &StoreMeta {
        &self.meta
    }

    pub fn len(&self) -> usize {
        self.meta.samples as usize
    }

    pub fn is_empty(&self) -> bool {
        self.meta.samples == 0
    }

    pub fn index(&self) -> &[IndexEntry] {
        bytemuck::cast_slice(self.index.bytes())
    }

    /// Every sample's length, in store order.
    pub fn lengths(&self) -> Vec<u32> {
        self.index().iter().map(|e| e.len).collect()
    }

    /// The tokens of sample `i` (zero-copy).
    pub fn tokens(&self, i: usize) -> &[u32] {
        let e = self.index()[i];
        let all: &[u32] = bytemuck::cast_slice(self.tokens.bytes());
        &all[e.offset as usize..e.offset as usize + e.len as usize]
    }

    /// The loss mask of sample `i` (zero-copy), one byte per token.
    pub fn loss_mask(&self, i: usize) -> &[u8] {
        let e = self.index()[i];
        &self.mask.bytes()[e.offset as usize..e.offset as usize + e.len as usize]
    }
}

/// Parses and checks `meta.json`.
pub fn parse_meta(path: &Path, text: &[u8]) -> Result<StoreMeta, StoreError> {
    let not_a_store = |reason: String| StoreError::NotAStore {
        path: path.to_path_buf(),
        reason,
    };
    // Format and version first, so a future layout gets the version message, not a parse error.
    #[derive(Deserialize)]
    struct Header {
        format: Option<String>,
        version: Option<u32>,
    }
    let header: Header = serde_json::from_slice(text)
        .map_err(|e| not_a_store(format!("{META_FILE} is not valid JSON: {e}")))?;
    if header.format.as_deref() != Some(FORMAT) {
        return Err(not_a_store(format!(
            "{META_FILE} has format {:?}, expected {FORMAT:?}",
            header.format.unwrap_or_default()
        )));
    }
    match header.version {
        Some(VERSION) => {}
        Some(found) => {
            return Err(StoreError::Version {
                path: path.to_path_buf(),
                found,
            });
        }
        None => return Err(not_a_store(format!("{META_FILE} has no version"))),
    }
    serde_json::from_slice(text).map_err(|e| StoreError::Damaged {
        path: path.to_path_buf(),
        reason: format!("{META_FILE}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_parser_rejects_bad_input() {
        let p = Path::new("s");
        let err = |t: &str| parse_meta(p, t.as_bytes()).unwrap_err().to_string();
        assert!(err("{").contains("not valid JSON"));
        assert!(err("[]").contains("not valid JSON"));
        assert!(err(r#"{"format":"other","version":1}"#).contains("expected \"dflash-store\""));
        assert!(
            err(r#"{"format":"dflash-store","version":7}"#).contains("version 7 is not supported")
        );
        assert!(err(r#"{"format":"dflash-store"}"#).contains("no version"));
        assert!(err(r#"{"format":"dflash-store","version":1,"samples":"x"}"#).contains("damaged"));
    }

    #[test]
    fn index_entry_is_16_bytes() {
        assert_eq!(std::mem::size_of::<IndexEntry>(), 16);
    }
}
