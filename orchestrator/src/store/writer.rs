//! Writes a store: everything goes to a temporary directory beside the target, which is renamed
//! into place only when complete. A failed or interrupted write leaves nothing behind (and the
//! next write removes what a killed one left).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{
    FileMeta, INDEX_FILE, IndexEntry, MASK_FILE, META_FILE, StoreError, StoreMeta, TOKENS_FILE,
};

const BUFFER: usize = 1 << 20;

/// A file being written, with its running CRC-32C and size.
struct CrcFile {
    out: BufWriter<File>,
    crc: u32,
    bytes: u64,
}

impl CrcFile {
    fn create(path: &Path) -> io::Result<Self> {
        Ok(Self {
            out: BufWriter::with_capacity(BUFFER, File::create(path)?),
            crc: 0,
            bytes: 0,
        })
    }

    fn write(&mut self, data: &[u8]) -> io::Result<()> {
        self.crc = crc32c::crc32c_append(self.crc, data);
        self.bytes += data.len() as u64;
        self.out.write_all(data)
    }

    fn finish(self) -> io::Result<FileMeta> {
        let file = self
            .out
            .into_inner()
            .map_err(io::IntoInnerError::into_error)?;
        file.sync_all()?;
        Ok(FileMeta {
            bytes: self.bytes,
            crc32c: self.crc,
        })
    }
}

/// Totals of what was written, for `meta.json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    pub samples: u64,
    pub tokens: u64,
    pub loss_tokens: u64,
}

/// A store being written.
pub struct StoreWriter {
    target: PathBuf,
    temp: PathBuf,
    force: bool,
    files: Option<[CrcFile; 3]>,
    written: Written,
}

impl StoreWriter {
    /// Starts a store at `target` (which must not exist unless `force`).
    pub fn create(target: &Path, force: bool) -> Result<Self, StoreError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, source }
        };
        if target.exists() && !force {
            return Err(StoreError::Exists {
                path: target.to_path_buf(),
            });
        }
        let name = target
            .file_name()
            .ok_or_else(|| StoreError::Io {
                path: target.to_path_buf(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "not a directory name"),
            })?
            .to_string_lossy()
            .into_owned();
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(io(&parent))?;
        recover_stale(&parent, &name, target);
        let temp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        let _ = fs::remove_dir_all(&temp);
        fs::create_dir(&temp).map_err(io(&temp))?;
        let mut writer = Self {
            target: target.to_path_buf(),
            temp,
            force,
            files: None,
            written: Written::default(),
        };
        let open = |file: &str| {
            let path = writer.temp.join(file);
            CrcFile::create(&path).map_err(io(&path))
        };
        let files = [open(TOKENS_FILE)?, open(MASK_FILE)?, open(INDEX_FILE)?];
        writer.files = Some(files);
        Ok(writer)
    }

    /// Appends one sample (`mask` has one 0/1 byte per token).
    pub fn push(&mut self, tokens: &[u32], mask: &[u8]) -> Result<(), StoreError> {
        debug_assert_eq!(tokens.len(), mask.len());
        let loss = mask.iter().filter(|&&m| m != 0).count() as u32;
        let entry = IndexEntry {
            offset: self.written.tokens,
            len: tokens.len() as u32,
            loss_tokens: loss,
        };
        let [t, m, i] = self.files.as_mut().expect("files open until finish");
        let temp = &self.temp;
        let err = |source| StoreError::Io {
            path: temp.clone(),
            source,
        };
        t.write(bytemuck::cast_slice(tokens)).map_err(err)?;
        m.write(mask).map_err(err)?;
        i.write(bytemuck::bytes_of(&entry)).map_err(err)?;
        self.written.samples += 1;
        self.written.tokens += tokens.len() as u64;
        self.written.loss_tokens += u64::from(loss);
        Ok(())
    }

    pub fn written(&self) -> Written {
        self.written
    }

    /// Completes the store: flushes and syncs the data, writes `meta.json` (counts and file
    /// entries filled in here), and renames the directory into place.
    pub fn finish(mut self, mut meta: StoreMeta) -> Result<(), StoreError> {
        let temp = self.temp.clone();
        let err = |source| StoreError::Io {
            path: temp.clone(),
            source,
        };
        let [t, m, i] = self.files.take().expect("files open until finish");
        let mut files = BTreeMap::new();
        files.insert(TOKENS_FILE.to_owned(), t.finish().map_err(err)?);
        files.insert(MASK_FILE.to_owned(), m.finish().map_err(err)?);
        files.insert(INDEX_FILE.to_owned(), i.finish().map_err(err)?);
        meta.files = files;
        meta.samples = self.written.samples;
        meta.tokens = self.written.tokens;
        meta.loss_tokens = self.written.loss_tokens;
        let json = serde_json::to_vec_pretty(&meta).map_err(|e| err(io::Error::other(e)))?;
        let meta_path = self.temp.join(META_FILE);
        let mut f = File::create(&meta_path).map_err(err)?;
        f.write_all(&json).map_err(err)?;
        f.sync_all().map_err(err)?;
        File::open(&self.temp)
            .and_then(|d| d.sync_all())
            .map_err(err)?;

        let parent = self.temp.parent().unwrap_or(Path::new(".")).to_path_buf();
        let old = self.force && self.target.exists();
        let aside = parent.join(format!(
            ".{}.old-{}",
            self.target
                .file_name()
                .unwrap_or_default()
                .to_string_lossy(),
            std::process::id()
        ));
        let io_target = |source| StoreError::Io {
            path: self.target.clone(),
            source,
        };
        if old {
            fs::rename(&self.target, &aside).map_err(io_target)?;
        }
        if let Err(e) = fs::rename(&self.temp, &self.target) {
            if old {
                let _ = fs::rename(&aside, &self.target);
            }
            return Err(io_target(e));
        }
        if old {
            let _ = fs::remove_dir_all(&aside);
        }
        let _ = File::open(&parent).and_then(|d| d.sync_all());
        self.temp = PathBuf::new();
        Ok(())
    }
}

impl Drop for StoreWriter {
    fn drop(&mut self) {
        // Not finished: nothing of it may remain.
        if !self.temp.as_os_str().is_empty() {
            self.files = None;
            let _ = fs::remove_dir_all(&self.temp);
        }
    }
}

/// Cleans up after writers of `NAME` that were killed: `.NAME.tmp-PID` directories of processes no
/// longer running are removed; a `.NAME.old-PID` (a replaced store set aside) is put back if the
/// target is missing, otherwise removed.
fn recover_stale(parent: &Path, name: &str, target: &Path) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        let Some(rest) = file_name.strip_prefix(&format!(".{name}.")) else {
            continue;
        };
        let (kind, pid) = match rest.split_once('-') {
            Some((kind @ ("tmp" | "old"), pid)) => (kind, pid.parse::<u32>().ok()),
            _ => continue,
        };
        let Some(pid) = pid else { continue };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let path = entry.path();
        if kind == "old" && !target.exists() {
            tracing::warn!(path = %path.display(), "restoring a store set aside by a killed prepare");
            let _ = fs::rename(&path, target);
        } else {
            tracing::info!(path = %path.display(), "removing what a killed prepare left");
            let _ = fs::remove_dir_all(&path);
        }
    }
}
