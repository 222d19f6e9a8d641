//! Shared-memory rings: the layout both sides agree on, and mapping a ring.
//!
//! A ring is one file under `/dev/shm` (mode 0600, the run id in its name): a 64-byte header, then
//! `slot_count` slots of `slot_bytes` each. Every slot starts with a 64-byte [`SlotHeader`]:
//! `generation` (set by the orchestrator each time it fills or assigns the slot), `written` (the
//! generation whose data a worker finished writing, for feature slots) and the batch shape; then
//! the data. The ring header's magic is written last, so a reader never sees a half-made ring.
//!
//! Who writes what, and when, is decided by the orchestrator's dispatcher alone; a slot is never
//! written while it is being read. The atomics below only order each writer's data before the
//! number that publishes it.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// "DFLRING1", little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"DFLRING1");
/// Layout version: bumped on any change to the header, slot header or data layout.
pub const LAYOUT_VERSION: u32 = 2;
pub const HEADER_BYTES: usize = 64;
pub const SLOT_HEADER_BYTES: usize = 64;

/// How a batch's tokens are laid out in an input slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Layout {
    /// `count` rows of `max_len` tokens, right-padded with 0; `lengths[count]` before them.
    Padded = 0,
    /// Sequences concatenated; `cu_seqlens[count + 1]` before them.
    Packed = 1,
}

/// Shape of the batch in a slot (after the two generation words of the slot header).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SlotMeta {
    pub layout: u32,
    /// Samples in the batch.
    pub count: u32,
    pub max_len: u32,
    /// Real (unpadded) tokens.
    pub tokens: u32,
    /// Byte offset of the token array within the slot's data.
    pub tokens_offset: u32,
    /// Checksum of the real tokens, in sample order ([`token_checksum`]).
    pub checksum: u32,
    /// Byte offset of the loss masks (one byte per real token, in sample order).
    pub masks_offset: u32,
}

/// Checksum of token ids (CRC-32C of their little-endian bytes): what the orchestrator wrote, what
/// the drafter must find again.
pub fn token_checksum(tokens: &[u32]) -> u32 {
    crc32c::crc32c(bytemuck::cast_slice(tokens))
}

/// Byte offset of the token array in an input slot for batches of at most `token_budget` tokens.
pub fn tokens_offset(token_budget: u64) -> usize {
    4 * (token_budget as usize + 1)
}

/// Byte offset of the loss masks in an input slot for batches of at most `token_budget` tokens.
pub fn masks_offset(token_budget: u64) -> usize {
    tokens_offset(token_budget) + 4 * token_budget as usize
}

/// Writes a batch into an input slot's data: `lengths[count]` then `count` rows of `max_len`
/// tokens zero-padded (padded layout), or `cu_seqlens[count + 1]` then the tokens back to back
/// (packed); then the loss masks of the real tokens. `tokens` and `masks` hold the real tokens and
/// their masks in sample order. Returns the slot meta (checksum included) for [`Ring::publish`].
pub fn write_batch(
    data: &mut [u8],
    layout: Layout,
    lengths: &[u32],
    tokens: &[u32],
    masks: &[u8],
    max_len: u32,
    token_budget: u64,
) -> SlotMeta {
    debug_assert_eq!(tokens.len(), masks.len());
    debug_assert!(match layout {
        Layout::Padded => (lengths.len() as u64) * u64::from(max_len) <= token_budget,
        Layout::Packed => tokens.len() as u64 <= token_budget,
    });
    let masks_at = masks_offset(token_budget);
    data[masks_at..masks_at + masks.len()].copy_from_slice(masks);
    let base = tokens_offset(token_budget);
    let count = lengths.len();
    match layout {
        Layout::Padded => {
            data[..4 * count].copy_from_slice(bytemuck::cast_slice(lengths));
            let row = 4 * max_len as usize;
            let mut from = 0;
            for (r, &len) in lengths.iter().enumerate() {
                let len = len as usize;
                let dst = &mut data[base + r * row..base + (r + 1) * row];
                dst[..4 * len].copy_from_slice(bytemuck::cast_slice(&tokens[from..from + len]));
                dst[4 * len..].fill(0);
                from += len;
            }
        }
        Layout::Packed => {
            let mut cu = 0u32;
            data[..4].copy_from_slice(&0u32.to_le_bytes());
            for (i, &len) in lengths.iter().enumerate() {
                cu += len;
                data[4 * (i + 1)..4 * (i + 2)].copy_from_slice(&cu.to_le_bytes());
            }
            data[base..base + 4 * tokens.len()].copy_from_slice(bytemuck::cast_slice(tokens));
        }
    }
    SlotMeta {
        layout: layout as u32,
        count: count as u32,
        max_len,
        tokens: tokens.len() as u32,
        tokens_offset: base as u32,
        checksum: token_checksum(tokens),
        masks_offset: masks_at as u32,
    }
}

/// The loss masks of the batch in an input slot's data (one byte per real token).
pub fn read_masks<'a>(data: &'a [u8], meta: &SlotMeta) -> Result<&'a [u8], String> {
    let from = meta.masks_offset as usize;
    from.checked_add(meta.tokens as usize)
        .and_then(|end| data.get(from..end))
        .ok_or_else(|| format!("batch shape {meta:?} exceeds the slot"))
}

/// Appends the real tokens of the batch in an input slot's data to `out`, in sample order,
/// checking the shape against the slot.
pub fn read_tokens(data: &[u8], meta: &SlotMeta, out: &mut Vec<u32>) -> Result<(), String> {
    let words = |from: usize, n: usize| -> Result<&[u32], String> {
        let bytes = from
            .checked_add(4 * n)
            .and_then(|end| data.get(from..end))
            .ok_or_else(|| format!("batch shape {meta:?} exceeds the slot"))?;
        bytemuck::try_cast_slice(bytes).map_err(|e| format!("slot data: {e:?}"))
    };
    let count = meta.count as usize;
    let base = meta.tokens_offset as usize;
    let start = out.len();
    if meta.layout == Layout::Padded as u32 {
        let max = meta.max_len as usize;
        for (row, &len) in words(0, count)?.iter().enumerate() {
            if len as usize > max {
                return Err(format!("row {row} length {len} exceeds max_len {max}"));
            }
            out.extend_from_slice(words(base + 4 * row * max, len as usize)?);
        }
    } else if meta.layout == Layout::Packed as u32 {
        let cu = words(0, count + 1)?;
        if cu.first() != Some(&0) || cu.windows(2).any(|w| w[1] < w[0]) {
            return Err("cu_seqlens does not start at 0 and increase".into());
        }
        out.extend_from_slice(words(base, *cu.last().unwrap_or(&0) as usize)?);
    } else {
        return Err(format!("unknown layout {}", meta.layout));
    }
    if out.len() - start != meta.tokens as usize {
        return Err(format!(
            "batch holds {} tokens, its header says {}",
            out.len() - start,
            meta.tokens
        ));
    }
    Ok(())
}

/// The length of every sample of the batch in a slot's data, in sample order.
pub fn read_lengths(data: &[u8], meta: &SlotMeta) -> Result<Vec<u32>, String> {
    let count = meta.count as usize;
    let words = |n: usize| -> Result<Vec<u32>, String> {
        data.get(..4 * n)
            .ok_or_else(|| format!("batch shape {meta:?} exceeds the slot"))
            .map(|b| {
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect()
            })
    };
    let lengths: Vec<u32> = if meta.layout == Layout::Padded as u32 {
        words(count)?
    } else if meta.layout == Layout::Packed as u32 {
        let cu = words(count + 1)?;
        if cu.first() != Some(&0) || cu.windows(2).any(|w| w[1] < w[0]) {
            return Err("cu_seqlens does not start at 0 and increase".into());
        }
        cu.windows(2).map(|w| w[1] - w[0]).collect()
    } else {
        return Err(format!("unknown layout {}", meta.layout));
    };
    if lengths.iter().map(|&l| u64::from(l)).sum::<u64>() != u64::from(meta.tokens) {
        return Err(format!(
            "batch lengths sum to {}, its header says {} tokens",
            lengths.iter().map(|&l| u64::from(l)).sum::<u64>(),
            meta.tokens
        ));
    }
    Ok(lengths)
}

/// Byte offset of the features in a feature slot for batches of at most `token_budget` tokens
/// (after the batch itself, laid out as in an input slot, 64-byte aligned).
pub fn features_offset(token_budget: u64) -> usize {
    (input_data_bytes(token_budget) as usize).next_multiple_of(64)
}

/// The largest token budget a slot can describe: sample lengths and `cu_seqlens` are `u32`
/// offsets into the slot's tokens.
pub const MAX_TOKEN_BUDGET: u64 = u32::MAX as u64;

/// Data bytes of a feature slot: the batch (packed) and `bytes_per_token` bytes of features per
/// token.
pub fn feature_data_bytes(token_budget: u64, bytes_per_token: u64) -> u64 {
    features_offset(token_budget) as u64 + token_budget * bytes_per_token
}

/// Data bytes a slot needs to hold a batch of at most `token_budget` tokens, with its per-sample
/// array (`lengths` or `cu_seqlens`) and its loss masks.
pub fn input_data_bytes(token_budget: u64) -> u64 {
    4 * (token_budget + 1) + 4 * token_budget + token_budget
}

/// Why a ring cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not a ring (bad magic or too small)")]
    NotARing { path: PathBuf },
    #[error("{path}: ring layout version {found}, this build uses {LAYOUT_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error(
        "{path}: ring header says {slots} slots of {slot_bytes} bytes, the file has {len} bytes"
    )]
    Size {
        path: PathBuf,
        slots: u32,
        slot_bytes: u64,
        len: u64,
    },
    #[error("slot {slot}: expected generation {expected}, found {found} (stale or reused slot)")]
    Generation {
        slot: u32,
        expected: u64,
        found: u64,
    },
    #[error("slot {slot}: batch shape does not fit the slot ({reason})")]
    Shape { slot: u32, reason: String },
}

/// A mapped ring.
pub struct Ring {
    path: PathBuf,
    map: memmap2::MmapMut,
    slot_count: u32,
    slot_bytes: u64,
}

// SAFETY: the mapping is plain memory; cross-process access is coordinated by the protocol above.
unsafe impl Send for Ring {}

impl Ring {
    /// Creates a ring (replacing a stale file of the same name), owner-only, header last.
    pub fn create(path: &Path, slot_count: u32, slot_bytes: u64) -> Result<Ring, RingError> {
        let io = |source| RingError::Io {
            path: path.to_path_buf(),
            source,
        };
        let slot_bytes = slot_bytes.next_multiple_of(64);
        let len = HEADER_BYTES as u64 + u64::from(slot_count) * slot_bytes;
        let _ = std::fs::remove_file(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        file.set_len(len).map_err(io)?;
        // Touch every page now, so a /dev/shm too small fails here rather than with SIGBUS later.
        allocate(&file, len).map_err(io)?;
        // SAFETY: a new file of ours, sized above; only this run maps it.
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(io)?;
        let mut ring = Ring {
            path: path.to_path_buf(),
            map,
            slot_count,
            slot_bytes,
        };
        ring.map[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
        ring.map[12..16].copy_from_slice(&slot_count.to_le_bytes());
        ring.map[16..24].copy_from_slice(&slot_bytes.to_le_bytes());
        // SYNC POINT: publishes the header fields above to any process that reads MAGIC.
        ring.word(0).store(MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// Opens an existing ring and checks its header.
    pub fn open(path: &Path) -> Result<Ring, RingError> {
        let io = |source| RingError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < HEADER_BYTES as u64 {
            return Err(RingError::NotARing {
                path: path.to_path_buf(),
            });
        }
        // SAFETY: the run's own ring; its owner keeps it sized while the run lives.
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(io)?;
        let mut ring = Ring {
            path: path.to_path_buf(),
            map,
            slot_count: 0,
            slot_bytes: 0,
        };
        // SYNC POINT: pairs with the Release store of MAGIC in `create`.
        if ring.word(0).load(Ordering::Acquire) != MAGIC {
            return Err(RingError::NotARing {
                path: path.to_path_buf(),
            });
        }
        let version = u32::from_le_bytes(ring.map[8..12].try_into().expect("4 bytes"));
        if version != LAYOUT_VERSION {
            return Err(RingError::Version {
                path: path.to_path_buf(),
                found: version,
            });
        }
        let slots = u32::from_le_bytes(ring.map[12..16].try_into().expect("4 bytes"));
        let slot_bytes = u64::from_le_bytes(ring.map[16..24].try_into().expect("8 bytes"));
        let needed = u64::from(slots)
            .checked_mul(slot_bytes)
            .and_then(|b| b.checked_add(HEADER_BYTES as u64));
        if slot_bytes < SLOT_HEADER_BYTES as u64
            || !slot_bytes.is_multiple_of(64)
            || needed != Some(len)
        {
            return Err(RingError::Size {
                path: path.to_path_buf(),
                slots,
                slot_bytes,
                len,
            });
        }
        ring.slot_count = slots;
        ring.slot_bytes = slot_bytes;
        Ok(ring)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn slot_count(&self) -> u32 {
        self.slot_count
    }

    /// Data bytes per slot.
    pub fn data_bytes(&self) -> usize {
        self.slot_bytes as usize - SLOT_HEADER_BYTES
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= self.map.len());
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned); only ever accessed
        // atomically.
        unsafe { AtomicU64::from_ptr(self.map.as_ptr().add(offset) as *mut u64) }
    }

    fn slot_offset(&self, slot: u32) -> usize {
        assert!(slot < self.slot_count, "slot {slot} of {}", self.slot_count);
        HEADER_BYTES + slot as usize * self.slot_bytes as usize
    }

    /// The generation the orchestrator last gave the slot.
    pub fn generation(&self, slot: u32) -> u64 {
        // SYNC POINT: pairs with the Release store in `publish`: data and meta before it are seen.
        self.word(self.slot_offset(slot)).load(Ordering::Acquire)
    }

    /// Publishes the slot's data and meta under a new generation.
    pub fn publish(&mut self, slot: u32, generation: u64, meta: SlotMeta) {
        let off = self.slot_offset(slot);
        self.map[off + 16..off + 16 + std::mem::size_of::<SlotMeta>()]
            .copy_from_slice(bytemuck::bytes_of(&meta));
        // SYNC POINT: everything written to the slot before this is visible to a reader that
        // loads this generation with Acquire.
        self.word(off).store(generation, Ordering::Release);
    }

    /// The generation whose data a worker last finished writing into the slot.
    pub fn written(&self, slot: u32) -> u64 {
        // SYNC POINT: pairs with the Release store in `mark_written`.
        self.word(self.slot_offset(slot) + 8)
            .load(Ordering::Acquire)
    }

    /// Marks the data written for `generation` (by the worker that wrote it).
    pub fn mark_written(&mut self, slot: u32, generation: u64, meta: SlotMeta) {
        let off = self.slot_offset(slot);
        self.map[off + 16..off + 16 + std::mem::size_of::<SlotMeta>()]
            .copy_from_slice(bytemuck::bytes_of(&meta));
        // SYNC POINT: the feature data written before this is visible to whoever loads `written`.
        self.word(off + 8).store(generation, Ordering::Release);
    }

    pub fn meta(&self, slot: u32) -> SlotMeta {
        let off = self.slot_offset(slot) + 16;
        bytemuck::pod_read_unaligned(&self.map[off..off + std::mem::size_of::<SlotMeta>()])
    }

    /// Checks that the slot holds what `expected` says, for a reader.
    pub fn check(&self, slot: u32, expected: u64) -> Result<SlotMeta, RingError> {
        let found = self.generation(slot);
        if found != expected {
            return Err(RingError::Generation {
                slot,
                expected,
                found,
            });
        }
        Ok(self.meta(slot))
    }

    /// Where the slot's data starts in the ring's file: what a process that maps the file itself
    /// (the torch engine's compute child) is told to write at, instead of reading the header.
    pub fn data_file_offset(&self, slot: u32) -> u64 {
        (self.slot_offset(slot) + SLOT_HEADER_BYTES) as u64
    }

    pub fn data(&self, slot: u32) -> &[u8] {
        let off = self.slot_offset(slot) + SLOT_HEADER_BYTES;
        &self.map[off..off + self.data_bytes()]
    }

    pub fn data_mut(&mut self, slot: u32) -> &mut [u8] {
        let off = self.slot_offset(slot) + SLOT_HEADER_BYTES;
        let n = self.data_bytes();
        &mut self.map[off..off + n]
    }
}

/// Reserves the file's blocks (tmpfs: its memory) so that a full `/dev/shm` is an error now.
fn allocate(file: &File, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(io::Error::other)?;
    // SAFETY: a valid descriptor and a range inside the file.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        // posix_fallocate returns the error number rather than setting errno.
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("dflash-ring-test-{}-{name}", std::process::id()))
    }

    #[test]
    fn create_publish_open_check() {
        let path = temp("a");
        let mut ring = Ring::create(&path, 3, 1000).unwrap();
        assert_eq!(ring.data_bytes(), 1024 - 64);
        ring.data_mut(1)[..4].copy_from_slice(&7u32.to_le_bytes());
        let meta = SlotMeta {
            layout: Layout::Packed as u32,
            count: 1,
            max_len: 1,
            tokens: 1,
            tokens_offset: 0,
            checksum: token_checksum(&[7]),
            masks_offset: 0,
        };
        ring.publish(1, 5, meta);
        let other = Ring::open(&path).unwrap();
        assert_eq!(other.check(1, 5).unwrap(), meta);
        assert_eq!(&other.data(1)[..4], &7u32.to_le_bytes());
        assert!(matches!(
            other.check(1, 4),
            Err(RingError::Generation { .. })
        ));
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn write_then_read_both_layouts() {
        let lengths = [3, 1, 2];
        let tokens = [10, 11, 12, 20, 30, 31];
        let masks = [0, 1, 1, 1, 0, 1];
        for layout in [Layout::Padded, Layout::Packed] {
            let mut data = vec![0xAAu8; input_data_bytes(9) as usize];
            let meta = write_batch(&mut data, layout, &lengths, &tokens, &masks, 3, 9);
            assert_eq!(meta.checksum, token_checksum(&tokens));
            let mut out = vec![99];
            read_tokens(&data, &meta, &mut out).unwrap();
            assert_eq!(out, [99, 10, 11, 12, 20, 30, 31]);
            assert_eq!(read_masks(&data, &meta).unwrap(), masks);
            assert_eq!(read_lengths(&data, &meta).unwrap(), lengths);
            // A header that lies is caught, not read past the slot.
            let mut bad = meta;
            bad.count = 1000;
            assert!(read_tokens(&data, &bad, &mut Vec::new()).is_err());
            bad = meta;
            bad.tokens += 1;
            assert!(read_tokens(&data, &bad, &mut Vec::new()).is_err());
            assert!(read_lengths(&data, &bad).is_err());
            bad.layout = 7;
            assert!(read_lengths(&data, &bad).is_err());
            bad.masks_offset = u32::MAX;
            assert!(read_masks(&data, &bad).is_err());
        }
    }

    #[test]
    fn rejects_bad_headers() {
        let path = temp("b");
        std::fs::write(&path, [0u8; 10]).unwrap();
        assert!(matches!(Ring::open(&path), Err(RingError::NotARing { .. })));
        std::fs::write(&path, [0u8; 200]).unwrap();
        assert!(matches!(Ring::open(&path), Err(RingError::NotARing { .. })));
        Ring::create(&path, 2, 128).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8] = 9;
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(Ring::open(&path), Err(RingError::Version { .. })));
        bytes[8] = LAYOUT_VERSION as u8;
        bytes.truncate(bytes.len() - 64);
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(Ring::open(&path), Err(RingError::Size { .. })));
        std::fs::remove_file(&path).unwrap();
    }
}
