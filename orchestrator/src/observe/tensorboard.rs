//! TensorBoard event files: a writer for scalar summaries, and a strict reader for tests.
//!
//! An event file is a TFRecord stream of `tensorflow.Event` protobuf messages: each record is the
//! data length (u64, little-endian), the masked CRC-32C of those 8 bytes (u32, little-endian), the
//! data, and the masked CRC-32C of the data. The first event carries `file_version:
//! "brain.Event:2"`; each scalar is an event with `wall_time`, `step` and a one-value `Summary`.
//!
//! Hand-written on `prost` derive and `crc32c` rather than taken from a crate: the Rust TensorBoard
//! writers are unmaintained or need `protoc` at build time, and the part of the format used here is
//! small (three messages declared by hand with their field numbers from TensorFlow's
//! `event.proto` and `summary.proto`, and the record framing).

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

/// `tensorflow.Event`, only the fields written here.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`. `simple_value` is a member of the `value` oneof upstream, so it has
/// presence: declared `optional`, a 0.0 is still written (TensorBoard skips a value without it).
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

const FILE_VERSION: &str = "brain.Event:2";

/// TFRecord's masked CRC-32C: `((crc >> 15) | (crc << 17)) + 0xa282ead8`, wrapping.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty() && !h.contains('/'))
        .unwrap_or_else(|| "localhost".to_string())
}

/// Writes scalars to one TensorBoard event file.
pub struct TbWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl TbWriter {
    /// Creates `dir` and `events.out.tfevents.<unix seconds>.<hostname>` in it, and writes the
    /// file-version event. An existing file of that name is appended to, never truncated.
    pub fn create(dir: &Path) -> io::Result<TbWriter> {
        fs::create_dir_all(dir)?;
        let wall_time = now();
        let path = dir.join(format!(
            "events.out.tfevents.{}.{}",
            wall_time as u64,
            hostname()
        ));
        let file = crate::fsutil::open_own(&path, OpenOptions::new().create(true).append(true))?;
        let mut writer = TbWriter {
            out: BufWriter::new(file),
            path,
        };
        writer.write_event(&Event {
            wall_time,
            step: 0,
            what: Some(What::FileVersion(FILE_VERSION.to_string())),
        })?;
        writer.flush()?;
        Ok(writer)
    }

    /// Appends one scalar (stored as f32, as TensorBoard does).
    pub fn scalar(&mut self, tag: &str, step: i64, value: f64, wall_time: f64) -> io::Result<()> {
        self.write_event(&Event {
            wall_time,
            step,
            what: Some(What::Summary(Summary {
                value: vec![SummaryValue {
                    tag: tag.to_string(),
                    simple_value: Some(value as f32),
                }],
            })),
        })
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_event(&mut self, event: &Event) -> io::Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(&data)?;
        self.out.write_all(&masked_crc(&data).to_le_bytes())
    }
}

/// Reads every scalar of an event file as `(tag, step, value)`, in file order. Both CRCs of every
/// record are checked; a truncated record, a CRC mismatch or an undecodable event is an error
/// naming the record and its byte offset.
pub fn read_scalars(path: &Path) -> Result<Vec<(String, i64, f32)>, String> {
    let bytes = fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_scalars(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// [`read_scalars`] on the bytes of an event file.
fn parse_scalars(bytes: &[u8]) -> Result<Vec<(String, i64, f32)>, String> {
    let fail = |record: usize, offset: usize, what: String| {
        format!("record {record} at byte {offset}: {what}")
    };
    let mut scalars = Vec::new();
    let mut offset = 0;
    let mut record = 0;
    while offset < bytes.len() {
        let rest = &bytes[offset..];
        if rest.len() < 12 {
            return Err(fail(
                record,
                offset,
                format!("truncated header ({} of 12 bytes)", rest.len()),
            ));
        }
        let (len_bytes, crc_bytes) = (&rest[..8], &rest[8..12]);
        if masked_crc(len_bytes) != u32::from_le_bytes(crc_bytes.try_into().unwrap_or_default()) {
            return Err(fail(record, offset, "length CRC mismatch".to_string()));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap_or_default());
        let available = (rest.len() - 12) as u64;
        if len.saturating_add(4) > available {
            return Err(fail(
                record,
                offset,
                format!("truncated data ({len} bytes + CRC declared, {available} present)"),
            ));
        }
        let len = len as usize;
        let data = &rest[12..12 + len];
        let data_crc = &rest[12 + len..16 + len];
        if masked_crc(data) != u32::from_le_bytes(data_crc.try_into().unwrap_or_default()) {
            return Err(fail(record, offset, "data CRC mismatch".to_string()));
        }
        let event = Event::decode(data)
            .map_err(|e| fail(record, offset, format!("bad Event protobuf: {e}")))?;
        if let Some(What::Summary(summary)) = event.what {
            for value in summary.value {
                if let Some(v) = value.simple_value {
                    scalars.push((value.tag, event.step, v));
                }
            }
        }
        offset += 16 + len;
        record += 1;
    }
    Ok(scalars)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            static N: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "dflash-tb-test-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&dir);
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn sample(dir: &Path) -> (PathBuf, Vec<(String, i64, f32)>) {
        let mut w = TbWriter::create(dir).unwrap();
        let mut want = Vec::new();
        for step in 0..5 {
            for (tag, value) in [
                ("train/loss", 2.5 / (step as f64 + 1.0)),
                ("pipeline/tokens_per_s", 1e6 + step as f64 * 0.1),
                ("gpu0/power_w", 0.0),
            ] {
                w.scalar(tag, step, value, 1.7e9 + step as f64).unwrap();
                want.push((tag.to_string(), step, value as f32));
            }
        }
        w.scalar("train/loss", -3, -0.125, 0.0).unwrap();
        want.push(("train/loss".to_string(), -3, -0.125));
        w.flush().unwrap();
        (w.path().to_path_buf(), want)
    }

    #[test]
    fn tensorboard_round_trip() {
        let dir = TempDir::new();
        let (path, want) = sample(&dir.0.join("tb"));
        let name = path.file_name().unwrap().to_str().unwrap();
        let parts: Vec<&str> = name.splitn(5, '.').collect();
        assert_eq!(parts[..3], ["events", "out", "tfevents"], "{name}");
        assert!(parts[3].parse::<u64>().unwrap() > 1_600_000_000, "{name}");
        assert!(!parts[4].is_empty(), "{name}");
        assert_eq!(read_scalars(&path).unwrap(), want);

        // The first record is the file-version event.
        let bytes = fs::read(&path).unwrap();
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let first = Event::decode(&bytes[12..12 + len]).unwrap();
        assert_eq!(
            first.what,
            Some(What::FileVersion(FILE_VERSION.to_string()))
        );
    }

    #[test]
    fn tensorboard_rejects_truncated_files() {
        let dir = TempDir::new();
        let (path, want) = sample(&dir.0);
        let bytes = fs::read(&path).unwrap();
        // Record boundaries: a file cut there is a valid, shorter file.
        let mut boundaries = vec![0];
        let mut at = 0;
        while at < bytes.len() {
            at += 16 + u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            boundaries.push(at);
        }
        for n in 0..bytes.len() {
            match parse_scalars(&bytes[..n]) {
                Ok(got) => {
                    assert!(boundaries.contains(&n), "cut at {n} accepted");
                    assert_eq!(got[..], want[..got.len()]);
                }
                Err(e) => {
                    assert!(!boundaries.contains(&n), "cut at boundary {n}: {e}");
                    assert!(e.contains("truncated"), "cut at {n}: {e}");
                }
            }
        }
    }

    #[test]
    fn tensorboard_rejects_any_flipped_byte() {
        let dir = TempDir::new();
        let (path, _) = sample(&dir.0);
        let bytes = fs::read(&path).unwrap();
        for i in 0..bytes.len() {
            for mask in [0x01u8, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= mask;
                let e = parse_scalars(&b).expect_err("flipped byte accepted");
                assert!(e.contains("CRC mismatch"), "byte {i} ^ {mask:#x}: {e}");
            }
        }
    }

    #[test]
    fn tensorboard_rejects_bad_protobuf_and_huge_lengths() {
        let dir = TempDir::new();
        let bad = dir.0.join("bad");
        fs::create_dir_all(&dir.0).unwrap();

        // Valid framing around bytes that are not an Event (a truncated varint).
        let data = [0x10u8, 0xff, 0xff];
        let mut b = Vec::new();
        let len = (data.len() as u64).to_le_bytes();
        b.extend_from_slice(&len);
        b.extend_from_slice(&masked_crc(&len).to_le_bytes());
        b.extend_from_slice(&data);
        b.extend_from_slice(&masked_crc(&data).to_le_bytes());
        fs::write(&bad, &b).unwrap();
        let e = read_scalars(&bad).unwrap_err();
        assert!(e.contains("bad Event protobuf"), "{e}");

        // A length with a valid CRC but far beyond the file.
        let len = u64::MAX.to_le_bytes();
        let mut b = len.to_vec();
        b.extend_from_slice(&masked_crc(&len).to_le_bytes());
        b.extend_from_slice(&[0; 8]);
        fs::write(&bad, &b).unwrap();
        let e = read_scalars(&bad).unwrap_err();
        assert!(e.contains("truncated data"), "{e}");

        let e = read_scalars(&dir.0.join("missing")).unwrap_err();
        assert!(e.contains("missing"), "{e}");
    }
}
