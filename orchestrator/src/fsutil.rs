//! File-system helpers: outputs appear whole or not at all.

use std::fs::{self, File};
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};

/// Writes `path` through a temporary file in the same directory, renamed into place once complete
/// and flushed to disk. On any error the temporary file is removed and `path` is left untouched.
pub fn write_atomically<F>(path: &Path, write: F) -> io::Result<()>
where
    F: FnOnce(&mut BufWriter<File>) -> io::Result<()>,
{
    let tmp = temp_sibling(path);
    let result = (|| {
        // A fresh file: never one planted at the temporary name (nor a symlink's target).
        let _ = fs::remove_file(&tmp);
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&tmp)?
        };
        let mut out = BufWriter::new(file);
        write(&mut out)?;
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Opens `path` for writing as `options` say, never through a symlink (`O_NOFOLLOW`), and
/// refuses what is not a regular file of one link: a hard link to another file (planted, say, as
/// a run directory's `run.lock`) would have the run overwrite that file's contents. Every file a
/// run directory or an output directory holds is opened for writing through this.
pub fn open_own(path: &Path, options: &mut fs::OpenOptions) -> io::Result<File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = options
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(nix::libc::ELOOP) {
                io::Error::new(
                    e.kind(),
                    format!(
                        "{} is a symbolic link: refusing to write through it",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not a regular file: refusing to write to it",
                path.display()
            ),
        ));
    }
    if meta.nlink() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} has {} hard links: writing to it would change another file too; remove it first",
                path.display(),
                meta.nlink()
            ),
        ));
    }
    Ok(file)
}

/// Cuts `file` back to the end of its last whole line (a line a crash or a full disk cut short
/// is dropped, so the next append starts a line of its own); returns the bytes dropped. Reads
/// backwards from the end, a block at a time: a long file costs one block.
pub fn cut_torn_tail(file: &File) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let len = file.metadata()?.len();
    let mut end = len;
    let mut block = vec![0u8; 64 * 1024];
    while end > 0 {
        let start = end.saturating_sub(block.len() as u64);
        let chunk = &mut block[..(end - start) as usize];
        file.read_exact_at(chunk, start)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            let keep = start + i as u64 + 1;
            if keep < len {
                file.set_len(keep)?;
                file.sync_all()?;
            }
            return Ok(len - keep);
        }
        end = start;
    }
    if len > 0 {
        file.set_len(0)?;
        file.sync_all()?;
    }
    Ok(len)
}

/// Creates a fresh private file (mode 0600): never one that exists, never through a symlink.
pub fn create_private(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn failed_write_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("dflash-fsutil-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let target = dir.join("out.txt");
        let err = write_atomically(&target, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("boom"))
        });
        assert!(err.is_err());
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        write_atomically(&target, |w| w.write_all(b"whole")).unwrap();
        assert_eq!(fs::read_to_string(&target).unwrap(), "whole");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_torn_last_line_is_cut_and_whole_lines_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lines");
        let long = "x".repeat(200_000);
        for (text, kept) in [
            ("a\nb\n".to_owned(), "a\nb\n".to_owned()),
            ("a\nb\nhal".to_owned(), "a\nb\n".to_owned()),
            ("half".to_owned(), String::new()),
            (String::new(), String::new()),
            (format!("a\n{long}"), "a\n".to_owned()),
            (format!("{long}\n{long}"), format!("{long}\n")),
        ] {
            fs::write(&path, &text).unwrap();
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let dropped = cut_torn_tail(&f).unwrap();
            assert_eq!(fs::read_to_string(&path).unwrap(), kept);
            assert_eq!(dropped as usize, text.len() - kept.len());
        }
    }

    #[test]
    fn only_a_regular_file_of_one_link_is_opened_for_writing() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, "precious").unwrap();
        let append = || {
            let mut o = fs::OpenOptions::new();
            o.create(true).append(true);
            o
        };
        // A hard link, a symlink, a FIFO and a directory: each refused, the victim untouched.
        let hard = dir.path().join("hard");
        fs::hard_link(&victim, &hard).unwrap();
        let e = open_own(&hard, &mut append()).unwrap_err();
        assert!(e.to_string().contains("2 hard links"), "{e}");
        let soft = dir.path().join("soft");
        std::os::unix::fs::symlink(&victim, &soft).unwrap();
        let e = open_own(&soft, &mut append()).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = open_own(&fifo, fs::OpenOptions::new().read(true).write(true)).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = open_own(dir.path(), fs::OpenOptions::new().read(true)).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        // A file of its own: opened (and created when missing).
        let own = dir.path().join("own");
        open_own(&own, &mut append())
            .unwrap()
            .write_all(b"x")
            .unwrap();
        open_own(&own, &mut append())
            .unwrap()
            .write_all(b"y")
            .unwrap();
        assert_eq!(fs::read_to_string(&own).unwrap(), "xy");
        // A private file is new or nothing.
        let private = dir.path().join("private");
        create_private(&private).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&private).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(create_private(&private).is_err());
        assert!(create_private(&soft).is_err());
    }
}
