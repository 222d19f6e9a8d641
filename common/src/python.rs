//! How every Python child of the project starts: it imports only from the interpreter's own
//! paths, the `PYTHONPATH` entries no other user can write, and our package's directory, never
//! from the caller's working directory, and it runs in a working directory of ours.
//!
//! `python -m MODULE` puts the working directory first on `sys.path`, so a `torch.py` planted
//! in a shared directory would run as whoever started the run from there. Instead the child runs
//! `python -c BOOTSTRAP MODULE ARGS...`: the bootstrap removes every relative entry from
//! `sys.path` (the working directory is `''`) before its first import, then runs the module as
//! `__main__`, as `-m` does. It works on every Python the engine supports (3.10 has no `-P`);
//! `PYTHONSAFEPATH` is set too, so that 3.11 and later never add the entry at all, in the child
//! and in the processes it starts.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The code of `python -c` that runs `sys.argv[1]` as `__main__` with the rest as its arguments,
/// having dropped every relative `sys.path` entry first.
pub const BOOTSTRAP: &str = "import sys\n\
sys.path[:] = [p for p in sys.path if p.startswith('/')]\n\
import runpy\n\
del sys.argv[0]\n\
runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n";

/// The code of `python -c` that runs `code` (one line or more, which may import) once the
/// relative `sys.path` entries are gone.
pub fn guarded(code: &str) -> String {
    format!("import sys\nsys.path[:] = [p for p in sys.path if p.startswith('/')]\n{code}")
}

/// `program` as a path to run: itself when it names a path (holds a `/`), else the first
/// executable of that name in an absolute `PATH` folder. A relative or empty `PATH` entry (the
/// working directory) is never searched, so a `python3` another user left there is never run.
/// None when there is none.
pub fn find_program(program: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.as_os_str().as_encoded_bytes().contains(&b'/') {
        return Some(program.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A `PYTHONPATH` entry left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub entry: PathBuf,
    pub why: String,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PYTHONPATH entry {:?} left out: {}",
            clip(&self.entry.to_string_lossy(), 200),
            self.why
        )
    }
}

pub fn clip(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_owned();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Why another user could put a module at `dir` (None: nobody but its owner, this user or root,
/// can): it is relative, missing, or it or a directory above it is writable by another user (a
/// sticky directory such as /tmp protects what it holds, not itself).
pub fn unsafe_import_dir(dir: &Path) -> Option<String> {
    if !dir.is_absolute() {
        return Some("a relative path (it would name a folder under the working directory)".into());
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mut at = Some(dir);
    let mut first = true;
    while let Some(d) = at {
        let meta = match std::fs::metadata(d) {
            Ok(m) => m,
            Err(e) if first => {
                return Some(format!("cannot be read ({e}); another user might make it"));
            }
            Err(e) => return Some(format!("{} cannot be read ({e})", d.display())),
        };
        let owner_ok = meta.uid() == me || meta.uid() == 0;
        let open_write = meta.mode() & 0o022 != 0;
        let sticky = meta.mode() & 0o1000 != 0;
        if !owner_ok && first {
            return Some(format!("owned by uid {}, another user", meta.uid()));
        }
        if open_write && (first || !sticky) {
            return Some(if first {
                format!("writable by other users (mode {:o})", meta.mode() & 0o7777)
            } else {
                format!(
                    "{} above it is writable by other users (mode {:o})",
                    d.display(),
                    meta.mode() & 0o7777
                )
            });
        }
        if !owner_ok && !sticky {
            return Some(format!(
                "{} above it is owned by uid {}, another user",
                d.display(),
                meta.uid()
            ));
        }
        first = false;
        at = d.parent();
    }
    None
}

/// The `PYTHONPATH` of a child: `package_dir` first (when the package is not installed), then
/// the entries of `existing` (the caller's) that no other user can write; and what was left out.
pub fn python_path(
    package_dir: Option<&Path>,
    existing: Option<&std::ffi::OsStr>,
) -> (Option<OsString>, Vec<Dropped>) {
    let mut kept: Vec<PathBuf> = package_dir.map(Path::to_path_buf).into_iter().collect();
    let mut dropped = Vec::new();
    for entry in existing.map(std::env::split_paths).into_iter().flatten() {
        let why = if entry.as_os_str().is_empty() {
            Some("an empty entry (it means the working directory)".to_owned())
        } else {
            unsafe_import_dir(&entry)
        };
        match why {
            Some(why) => dropped.push(Dropped { entry, why }),
            None if !kept.contains(&entry) => kept.push(entry),
            None => {}
        }
    }
    let joined = (!kept.is_empty())
        .then(|| std::env::join_paths(&kept).ok())
        .flatten();
    (joined, dropped)
}

/// A command running `python -c BOOTSTRAP module` in `cwd`, with the safe `PYTHONPATH` of
/// [`python_path`] (the caller's own from this process's environment) and `PYTHONSAFEPATH`;
/// what was left out of `PYTHONPATH` comes back for the caller to say.
pub fn module_command(
    python: &Path,
    package_dir: Option<&Path>,
    module: &str,
    cwd: &Path,
) -> (Command, Vec<Dropped>) {
    let mut command = Command::new(python);
    command.arg("-c").arg(BOOTSTRAP).arg(module);
    let dropped = safe_environment(&mut command, package_dir, cwd);
    (command, dropped)
}

/// Sets what every Python child gets: `cwd`, the safe `PYTHONPATH` (or none), `PYTHONSAFEPATH`,
/// torch.compile's caches under `cwd`.
pub fn safe_environment(
    command: &mut Command,
    package_dir: Option<&Path>,
    cwd: &Path,
) -> Vec<Dropped> {
    let (path, dropped) = python_path(package_dir, std::env::var_os("PYTHONPATH").as_deref());
    match path {
        Some(path) => command.env("PYTHONPATH", path),
        None => command.env_remove("PYTHONPATH"),
    };
    // torch.compile's caches hold code the compiler loads again (Inductor's and Triton's
    // kernels): kept under the child's own directory, never a shared one such as /tmp, where
    // another user could plant them.
    let cache = cwd.join(".torch-compile");
    command
        .env("PYTHONSAFEPATH", "1")
        .env_remove("PYTHONSTARTUP")
        .env("TORCHINDUCTOR_CACHE_DIR", cache.join("inductor"))
        .env("TRITON_CACHE_DIR", cache.join("triton"))
        .current_dir(cwd);
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir(name: &str, mode: u32) -> PathBuf {
        let root = std::env::temp_dir().join(format!("dflash-python-test-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).unwrap();
        d
    }

    #[test]
    fn only_entries_no_other_user_can_write_stay_on_the_python_path() {
        let private = dir("private", 0o755);
        let open = dir("open", 0o777);
        let group = dir("group", 0o775);
        let under_open = open.join("sub");
        std::fs::create_dir_all(&under_open).unwrap();
        std::fs::set_permissions(&under_open, std::fs::Permissions::from_mode(0o755)).unwrap();
        let existing = std::env::join_paths([
            private.as_path(),
            Path::new(""),
            Path::new("rel/dir"),
            Path::new("."),
            open.as_path(),
            group.as_path(),
            under_open.as_path(),
            Path::new("/nonexistent/dflash-test"),
        ])
        .unwrap();
        let (path, dropped) = python_path(Some(Path::new("/pkg")), Some(&existing));
        assert_eq!(
            path,
            Some(std::env::join_paths([Path::new("/pkg"), private.as_path()]).unwrap())
        );
        let left: Vec<_> = dropped.iter().map(|d| d.entry.clone()).collect();
        assert_eq!(
            left,
            [
                PathBuf::from(""),
                "rel/dir".into(),
                ".".into(),
                open.clone(),
                group,
                under_open,
                "/nonexistent/dflash-test".into()
            ]
        );
        assert!(
            dropped[0].why.contains("working directory"),
            "{}",
            dropped[0]
        );
        assert!(dropped[1].why.contains("relative"), "{}", dropped[1]);
        assert!(
            dropped[3].why.contains("writable by other users"),
            "{}",
            dropped[3]
        );
        assert!(dropped[5].why.contains("above it"), "{}", dropped[5]);
        assert!(
            dropped[6]
                .to_string()
                .contains("another user might make it")
        );
        // Nothing to keep: no PYTHONPATH at all (an empty one would mean the working directory).
        let (none, _) = python_path(None, Some(std::ffi::OsStr::new(":.:rel")));
        assert_eq!(none, None);
        // A sticky, world-writable parent (/tmp) protects what it holds.
        assert_eq!(unsafe_import_dir(&private), None);
        let _ = std::fs::remove_dir_all(private.parent().unwrap());
    }

    #[test]
    fn the_bootstrap_drops_relative_entries_before_importing() {
        assert!(BOOTSTRAP.starts_with("import sys\nsys.path[:] = "));
        assert!(guarded("import site").ends_with("import site"));
        let (command, _) = module_command(
            Path::new("python3"),
            Some(Path::new("/pkg")),
            "dflash_orch.serve",
            Path::new("/"),
        );
        let args: Vec<_> = command.get_args().collect();
        assert_eq!(args[0], "-c");
        assert_eq!(args[2], "dflash_orch.serve");
        assert_eq!(command.get_current_dir(), Some(Path::new("/")));
    }

    #[test]
    fn the_compilers_caches_live_under_the_childs_directory() {
        let run = Path::new("/runs/r1");
        let (command, _) = module_command(Path::new("python3"), None, "dflash_orch.serve", run);
        let env: std::collections::HashMap<_, _> = command.get_envs().collect();
        for (name, dir) in [
            ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
            ("TRITON_CACHE_DIR", "triton"),
        ] {
            let value = env[std::ffi::OsStr::new(name)].expect(name);
            assert_eq!(Path::new(value), run.join(".torch-compile").join(dir));
        }
        assert_eq!(env[std::ffi::OsStr::new("PYTHONPATH")], None);
    }

    #[test]
    fn programs_are_found_on_absolute_path_folders_only() {
        assert_eq!(
            find_program(Path::new("./x/python3")),
            Some(PathBuf::from("./x/python3"))
        );
        // `sh` is on PATH everywhere these tests run; a name nowhere is not found.
        let sh = find_program(Path::new("sh")).unwrap();
        assert!(sh.is_absolute(), "{}", sh.display());
        assert_eq!(find_program(Path::new("dflash-no-such-program")), None);
    }
}
