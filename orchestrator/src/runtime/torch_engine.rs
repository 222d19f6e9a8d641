//! The torch engine as the orchestrator sees it: which Python runs it, where our package is, and
//! the pre-flight that checks both before anything else happens (Python, torch, transformers, the
//! package, and CUDA with enough devices when the run is on GPUs).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use dflash_common::dflash::{Engine, TorchRuntime};
use serde::Deserialize;

use crate::format::clip;

/// The oldest versions the engine is built for.
pub const MIN_PYTHON: (u32, u32) = (3, 10);
pub const MIN_TORCH: (u32, u32) = (2, 11);
pub const MIN_TRANSFORMERS: (u32, u32) = (5, 15);

/// How long the pre-flight's Python may take (importing torch from a cold disk is slow).
const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(180);

/// The interpreter: `--python`, else `DFLASH_PYTHON`, else `python3` on PATH; a bare name is
/// looked up in PATH's absolute folders only (never the working directory), and made absolute.
pub fn python(given: Option<&Path>) -> PathBuf {
    let named = given
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("DFLASH_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"));
    match dflash_common::python::find_program(&named) {
        Some(found) => std::path::absolute(&found).unwrap_or(found),
        // Not found: the bare name stays, and the pre-flight says so (it is never run as is).
        None => named,
    }
}

/// The tree's `python/` directory holding `dflash_orch`, found beside this binary: in a cargo
/// build (`target/<profile>/` two levels below the tree) or a packaged folder (`python/` beside
/// `bin/` or beside the binary). None: the package must be installed in the interpreter.
pub fn package_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join("python"),
        dir.join("../python"),
        dir.join("../../python"),
    ]
    .into_iter()
    .find(|d| d.join("dflash_orch/__init__.py").is_file())
    .map(|d| d.canonicalize().unwrap_or(d))
}

/// The runtime a run's workers start the engine with.
pub fn runtime(given: Option<&Path>) -> TorchRuntime {
    TorchRuntime {
        python: python(given),
        package_dir: package_dir(),
    }
}

/// `--engine` and `--python` of the commands that decode (`eval`, `generate`).
#[derive(Debug, Clone, clap::Args)]
pub struct DecodeEngine {
    /// What decodes: candle (Rust, embedded, no Python; Qwen3 targets) or torch (PyTorch and
    /// transformers in a Python child of the worker; any causal LM transformers loads).
    #[arg(long, value_name = "candle|torch", default_value = "candle")]
    pub engine: Engine,

    /// The Python of the torch engine [default: $DFLASH_PYTHON, else python3 on PATH].
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
}

impl DecodeEngine {
    /// With torch, its runtime once its pre-flight has passed for `gpus` (said on stderr);
    /// with candle, none.
    pub fn runtime(&self, gpus: &[u32], model: &Path) -> Result<Option<TorchRuntime>, String> {
        if self.engine == Engine::Candle {
            return Ok(None);
        }
        let runtime = runtime(self.python.as_deref());
        let report = check(&runtime, gpus, Some(model))?;
        tracing::info!("torch engine: {}", report.describe());
        Ok(Some(runtime))
    }
}

/// What `python -m dflash_orch.preflight` reported.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Preflight {
    pub python: String,
    #[serde(default)]
    pub executable: String,
    pub package: String,
    #[serde(default)]
    pub package_path: String,
    pub protocol: u64,
    pub torch: Option<String>,
    #[serde(default)]
    pub torch_error: Option<String>,
    pub transformers: Option<String>,
    #[serde(default)]
    pub transformers_error: Option<String>,
    #[serde(default)]
    pub cuda_available: bool,
    #[serde(default)]
    pub cuda_devices: u32,
    #[serde(default)]
    pub cuda_version: Option<String>,
    /// Why transformers cannot load the model directory the probe was given as a causal LM.
    #[serde(default)]
    pub model_error: Option<String>,
}

impl Preflight {
    /// One line for the start of a run.
    pub fn describe(&self) -> String {
        format!(
            "Python {} ({}), torch {}{}, transformers {}, dflash_orch {} ({})",
            self.python,
            self.executable,
            self.torch.as_deref().unwrap_or("-"),
            match (&self.cuda_version, self.cuda_available) {
                (Some(v), true) => format!(" with CUDA {v}, {} device(s)", self.cuda_devices),
                (Some(v), false) => format!(" built for CUDA {v}, no device visible"),
                (None, _) => " (CPU build)".into(),
            },
            self.transformers.as_deref().unwrap_or("-"),
            self.package,
            self.package_path,
        )
    }
}

/// The leading `major.minor` of a version string (`2.13.0+cu130` -> (2, 13)).
pub fn major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Runs the pre-flight in `runtime`'s Python and reads its answer.
pub fn probe(runtime: &TorchRuntime, model: Option<&Path>) -> Result<Preflight, String> {
    let py = runtime.python.display();
    if !runtime
        .python
        .as_os_str()
        .as_encoded_bytes()
        .contains(&b'/')
    {
        return Err(format!(
            "the torch engine needs Python >= {}.{}: {py} was not found in PATH's absolute folders (install Python, or point --python or DFLASH_PYTHON at one)",
            MIN_PYTHON.0, MIN_PYTHON.1
        ));
    }
    // A working directory of its own: nothing the caller's directory holds is imported or read.
    let cwd = tempfile::Builder::new()
        .prefix("dflash-preflight-")
        .tempdir()
        .map_err(|e| format!("cannot make a private directory for the pre-flight: {e}"))?;
    let (mut command, dropped) = runtime.module_command("dflash_orch.preflight", cwd.path());
    for d in &dropped {
        tracing::warn!("{d} (the torch engine's Python imports from none of them)");
    }
    if let Some(model) = model {
        let model = std::path::absolute(model).map_err(|e| format!("{}: {e}", model.display()))?;
        command.arg("--model").arg(model);
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = command.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!(
            "the torch engine needs Python >= {}.{}: {py} was not found (install Python, or point --python or DFLASH_PYTHON at one)",
            MIN_PYTHON.0, MIN_PYTHON.1
        ),
        _ => format!("the torch engine's Python {py} cannot be started: {e}"),
    })?;
    let out = wait_with_deadline(child, PREFLIGHT_TIMEOUT)
        .map_err(|e| format!("the torch engine's pre-flight in {py}: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No module named dflash_orch")
        || stderr.contains("No module named 'dflash_orch'")
    {
        return Err(format!(
            "the torch engine's package dflash_orch is not importable by {py}: install it with `{py} -m pip install {}`",
            runtime.package_dir.as_deref().map_or_else(
                || "<the dflash-orch tree>/python".to_owned(),
                |d| d.display().to_string()
            )
        ));
    }
    let last_line = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    if !out.status.success() {
        return Err(format!(
            "the torch engine's pre-flight failed in {py} ({}): {}",
            out.status,
            clip(last_line, 300)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .unwrap_or("");
    serde_json::from_str(line).map_err(|e| {
        format!(
            "the torch engine's pre-flight in {py} answered no report ({e}): {:?}",
            clip(&text, 300)
        )
    })
}

/// Waits for `child`'s output, killing it past `deadline`.
fn wait_with_deadline(
    mut child: std::process::Child,
    deadline: Duration,
) -> Result<std::process::Output, String> {
    use std::io::Read;
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let out_thread = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(s) = stdout.as_mut() {
            let _ = s.take(1 << 20).read_to_end(&mut buf);
        }
        buf
    });
    let err_thread = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = s.take(1 << 20).read_to_end(&mut buf);
        }
        buf
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {} s", deadline.as_secs()));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    Ok(std::process::Output {
        status,
        stdout: out_thread.join().unwrap_or_default(),
        stderr: err_thread.join().unwrap_or_default(),
    })
}

/// Judges a report for a run whose torch workers use `gpus` (GPU indices; empty on CPU workers):
/// the first thing missing, as one line with the command that installs it.
pub fn judge(report: &Preflight, python: &Path, gpus: &[u32]) -> Result<(), String> {
    let py = python.display();
    if major_minor(&report.python).is_none_or(|v| v < MIN_PYTHON) {
        return Err(format!(
            "the torch engine needs Python >= {}.{}: {py} is Python {} (point --python or DFLASH_PYTHON at a newer one)",
            MIN_PYTHON.0, MIN_PYTHON.1, report.python
        ));
    }
    if report.protocol != PROTOCOL {
        return Err(format!(
            "the dflash_orch package at {} speaks protocol {}, this build {}: install the package of this tree (`{py} -m pip install <tree>/python`)",
            report.package_path, report.protocol, PROTOCOL
        ));
    }
    require(
        "torch",
        report.torch.as_deref(),
        report.torch_error.as_deref(),
        MIN_TORCH,
        python,
    )?;
    require(
        "transformers",
        report.transformers.as_deref(),
        report.transformers_error.as_deref(),
        MIN_TRANSFORMERS,
        python,
    )?;
    if let Some(&top) = gpus.iter().max() {
        let torch = report.torch.as_deref().unwrap_or("-");
        if !report.cuda_available {
            return Err(format!(
                "--gpus names GPUs, but torch {torch} in {py} sees no CUDA device ({}): install a CUDA build of torch (https://pytorch.org/get-started/locally/), or use --gpus cpu:N",
                match &report.cuda_version {
                    None => "a CPU-only build".to_owned(),
                    Some(v) => format!("built for CUDA {v}; no driver or no visible device"),
                }
            ));
        }
        if top >= report.cuda_devices {
            return Err(format!(
                "--gpus names GPU {top}, but torch in {py} sees {} CUDA device(s)",
                report.cuda_devices
            ));
        }
    }
    Ok(())
}

/// A package the engine needs in `python`: `found` (its version, None when it does not import,
/// with `error` saying why) at least `min`; else one line with the command that installs it.
fn require(
    package: &str,
    found: Option<&str>,
    error: Option<&str>,
    min: (u32, u32),
    python: &Path,
) -> Result<(), String> {
    let py = python.display();
    let install = format!("`{py} -m pip install '{package}>={}.{}'`", min.0, min.1);
    match found {
        None => Err(format!(
            "the torch engine needs {package} >= {}.{}, and {py} has none{}: install it with {install}",
            min.0,
            min.1,
            error
                .map(|e| format!(" ({})", clip(e, 200)))
                .unwrap_or_default(),
        )),
        Some(v) if major_minor(v).is_none_or(|v| v < min) => Err(format!(
            "the torch engine needs {package} >= {}.{}, {py} has {v}: upgrade it with {install}",
            min.0, min.1
        )),
        Some(_) => Ok(()),
    }
}

/// The pipe protocol this build speaks with `dflash_orch.serve` (the worker's `torch::PROTOCOL`).
pub const PROTOCOL: u64 = 2;

/// Probes and judges in one: the report, or why the engine cannot run.
/// With `model`, transformers must also know its architecture as a causal LM (its config is read;
/// no weight is).
pub fn check(
    runtime: &TorchRuntime,
    gpus: &[u32],
    model: Option<&Path>,
) -> Result<Preflight, String> {
    let report = probe(runtime, model)?;
    judge(&report, &runtime.python, gpus)?;
    if let Some(why) = &report.model_error {
        return Err(format!(
            "transformers {} cannot load {} as a causal LM: {}",
            report.transformers.as_deref().unwrap_or("?"),
            model.map_or_else(String::new, |m| m.display().to_string()),
            clip(why, 300)
        ));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Preflight {
        Preflight {
            python: "3.12.3".into(),
            executable: "/usr/bin/python3".into(),
            package: "0.1.0".into(),
            package_path: "/t/python/dflash_orch/__init__.py".into(),
            protocol: PROTOCOL,
            torch: Some("2.11.0+cu130".into()),
            torch_error: None,
            transformers: Some("5.17.0".into()),
            transformers_error: None,
            cuda_available: true,
            cuda_devices: 8,
            cuda_version: Some("13.0".into()),
            model_error: None,
        }
    }

    #[test]
    fn versions_are_read_by_major_and_minor() {
        assert_eq!(major_minor("2.13.0+cu130"), Some((2, 13)));
        assert_eq!(major_minor("5.15.0.dev0"), Some((5, 15)));
        assert_eq!(major_minor("3.10"), Some((3, 10)));
        for bad in ["", "x", "2", "2.x", "unknown"] {
            assert_eq!(major_minor(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn each_missing_piece_is_one_line_with_the_command_that_installs_it() {
        let py = Path::new("/venv/bin/python");
        assert_eq!(judge(&report(), py, &[0, 7]), Ok(()));
        type Edit = fn(&mut Preflight);
        let cases: Vec<(Edit, &[u32], &str)> = vec![
            (|r| r.python = "3.9.18".into(), &[], "needs Python >= 3.10"),
            (|r| r.torch = None, &[], "pip install 'torch>=2.11'"),
            (
                |r| r.torch = Some("2.10.1".into()),
                &[],
                "has 2.10.1: upgrade",
            ),
            (|r| r.torch = Some("unknown".into()), &[], "has unknown"),
            (
                |r| r.transformers = None,
                &[],
                "pip install 'transformers>=5.15'",
            ),
            (
                |r| r.transformers = Some("4.57.1".into()),
                &[],
                "has 4.57.1",
            ),
            (|r| r.protocol = 99, &[], "speaks protocol 99"),
            (
                |r| {
                    r.cuda_available = false;
                    r.cuda_version = None;
                },
                &[0],
                "sees no CUDA device (a CPU-only build)",
            ),
            (|r| r.cuda_devices = 2, &[0, 3], "names GPU 3, but torch"),
        ];
        for (edit, gpus, says) in cases {
            let mut r = report();
            edit(&mut r);
            let e = judge(&r, py, gpus).unwrap_err();
            assert!(e.contains(says), "{e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
        // CPU workers need no CUDA.
        let mut cpu = report();
        cpu.cuda_available = false;
        cpu.cuda_version = None;
        assert_eq!(judge(&cpu, py, &[]), Ok(()));
    }

    #[test]
    fn a_python_that_does_not_exist_is_named() {
        let e = probe(
            &TorchRuntime {
                python: "/nonexistent/python3".into(),
                package_dir: None,
            },
            None,
        )
        .unwrap_err();
        assert!(e.contains("/nonexistent/python3 was not found"), "{e}");
    }
}
