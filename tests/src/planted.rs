//! Modules planted by another user where a careless Python would import them: a world-writable
//! directory that a command is run from, and that the caller's `PYTHONPATH` names (with `.` too).
//! Each planted module leaves a marker when imported, so a test proves that none ran.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The uid and gid the attacker runs as (`nobody`).
pub const ATTACKER: u32 = 65534;

/// The modules planted: what the torch engine, the decoder and the pre-flight import, the
/// bootstrap's own `runpy`, and our package's name.
pub const MODULES: [&str; 9] = [
    "torch",
    "transformers",
    "safetensors",
    "numpy",
    "json",
    "runpy",
    "site",
    "sitecustomize",
    "dflash_orch",
];

/// A world-writable directory holding the planted modules, written by [`ATTACKER`] (when the
/// tests run as root; by this user otherwise).
pub struct Planted {
    pub dir: PathBuf,
}

impl Planted {
    pub fn new(parent: &Path) -> Self {
        let dir = parent.join("shared");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        // Each module writes `ran-NAME` beside itself, then goes on as if nothing happened
        // (the real module is not there, so what imported it fails later; the marker is what
        // the test reads).
        let mut script = String::from("set -e\n");
        for name in MODULES {
            let body = format!(
                "import os as _os\nopen(_os.path.join({dir:?}, 'ran-{name}'), 'w').close()\n",
                dir = dir.display().to_string()
            );
            if name == "dflash_orch" {
                script.push_str(&format!(
                    "mkdir -p dflash_orch\ncat > dflash_orch/__init__.py <<'EOF'\n{body}EOF\n\
                     for m in serve decode preflight bench_step; do cp dflash_orch/__init__.py dflash_orch/$m.py; done\n"
                ));
            } else {
                script.push_str(&format!("cat > {name}.py <<'EOF'\n{body}EOF\n"));
            }
        }
        // And an interpreter, for a PATH that names the working directory.
        script.push_str(&format!(
            "printf '#!/bin/sh\\ntouch {dir}/ran-python3\\nexit 1\\n' > python3\nchmod 755 python3\n",
            dir = dir.display()
        ));
        let mut sh = Command::new("sh");
        sh.arg("-c").arg(script).current_dir(&dir);
        if is_root() {
            sh.uid(ATTACKER).gid(ATTACKER);
        }
        let out = sh.output().unwrap();
        assert!(
            out.status.success(),
            "planting: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    /// A `PYTHONPATH` naming the working directory (`.`, and an empty entry) and the planted
    /// directory by its absolute path.
    pub fn python_path(&self) -> OsString {
        std::env::join_paths([Path::new("."), Path::new(""), self.dir.as_path()]).unwrap()
    }

    /// `command` run from the planted directory with [`Self::python_path`].
    pub fn run_from<'c>(&self, command: &'c mut Command) -> &'c mut Command {
        command
            .current_dir(&self.dir)
            .env("PYTHONPATH", self.python_path())
    }

    /// Panics naming every planted module that was imported.
    pub fn assert_none_ran(&self, what: &str) {
        let ran: Vec<String> = std::fs::read_dir(&self.dir)
            .unwrap()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_prefix("ran-")
                    .map(str::to_owned)
            })
            .collect();
        assert!(
            ran.is_empty(),
            "{what} imported modules planted in {}: {ran:?}",
            self.dir.display()
        );
    }
}

/// Whether the tests run as root (and can play another user).
pub fn is_root() -> bool {
    unsafe extern "C" {
        fn geteuid() -> u32;
    }
    // SAFETY: geteuid has no preconditions.
    unsafe { geteuid() == 0 }
}
