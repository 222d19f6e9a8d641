//! Starting worker processes: pinned, in their own process group, dying with the orchestrator,
//! connected over ipc-channel (the one-shot server's `accept` blocks without a timeout, so it runs
//! on a thread of its own, which a dummy connection unblocks if the child dies first).

use std::fs::OpenOptions;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use dflash_common::wire::{Event, Hello, Job, Role};
use ipc_channel::ipc::{self, IpcOneShotServer, IpcSender};

use super::spec::Device;
use super::{Input, WorkerInput};

/// What every worker of the run is started with.
#[derive(Debug, Clone)]
pub struct Launch {
    pub binary: PathBuf,
    pub input_ring: PathBuf,
    pub feature_ring: PathBuf,
    pub stage: String,
    pub synthetic_us_per_token: f64,
    /// The synthetic stage's drafter cost (microseconds a token).
    pub synthetic_drafter_us_per_token: f64,
    pub heartbeat_ms: u64,
    pub log_dir: PathBuf,
    /// The DFlash settings file (`--stage dflash`).
    pub dflash_config: Option<PathBuf>,
    /// The torch engine's interpreter, where the run has one (its CUDA wheels may hold the
    /// libraries a CUDA worker needs).
    pub python: Option<PathBuf>,
    /// Data-parallel drafters, when the run has more than one.
    pub drafters: Option<DrafterGroup>,
}

/// The run's data-parallel drafters: workers `first..first + ranks`, one `torch.distributed`
/// process group, formed afresh (a new store) each time the group starts.
///
/// On one node the group meets in a `torch.distributed` FileStore in a directory of the run's
/// own (mode 0700): no port, nothing another user can reach or guess. With several nodes it meets
/// at `host:port` of node 0.
#[derive(Debug, Clone)]
pub struct DrafterGroup {
    pub first: u32,
    pub ranks: u32,
    /// With several nodes: the address rank 0 listens on, and the port node 0 picked.
    pub host: String,
    pub port: u16,
    pub timeout_s: f64,
    /// With several nodes: where this node's drafters stand among every node's.
    pub nodes: Option<NodeShare>,
    /// On one node: the directory of the group's stores (made 0700 at the first start).
    pub store_dir: Option<PathBuf>,
    /// Starts so far: each start's store is a new file.
    pub starts: u64,
    /// With several nodes: the key of the store at `host:port` (hex, derived from the run's
    /// secret), handed to the drafters as `DFLASH_DRAFTERS_KEY`.
    pub key: Option<String>,
}

/// This node's drafters among every node's: ranks `base..base + ranks` of `world`, meeting at
/// the port node 0 picked, starting from the checkpoint step every node has.
#[derive(Debug, Clone, Copy)]
pub struct NodeShare {
    pub base: u32,
    pub world: u32,
    pub resume_step: u64,
}

impl DrafterGroup {
    /// Worker `id`'s rank, if it is one of the group's.
    pub fn rank_of(&self, id: u32) -> Option<u32> {
        id.checked_sub(self.first).filter(|&r| r < self.ranks)
    }

    /// Readies the group's next start: on one node a new store file (the stores of earlier
    /// starts, which a killed rank may have left, are removed); with several nodes, node 0
    /// picked the port for every node.
    pub fn next_start(&mut self) -> std::io::Result<()> {
        let Some(dir) = &self.store_dir else {
            return Ok(());
        };
        match std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(false)
            .create(dir)
        {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
        let meta = std::fs::symlink_metadata(dir)?;
        if !meta.is_dir() || meta.permissions().mode() & 0o077 != 0 {
            return Err(std::io::Error::other(format!(
                "{} is not a private directory (mode {:o})",
                dir.display(),
                meta.permissions().mode() & 0o7777
            )));
        }
        for entry in std::fs::read_dir(dir)?.flatten() {
            let _ = std::fs::remove_file(entry.path());
        }
        self.starts += 1;
        Ok(())
    }

    /// Where the ranks meet ([`dflash_common::dflash::DrafterRank::ENV`]'s rendezvous): the
    /// current start's store file (`file:PATH`), or `HOST:PORT`.
    pub fn rendezvous(&self) -> String {
        match &self.store_dir {
            Some(dir) => format!(
                "file:{}",
                dir.join(format!("store-{}", self.starts)).display()
            ),
            None if self.host.contains(':') => format!("[{}]:{}", self.host, self.port),
            None => format!("{}:{}", self.host, self.port),
        }
    }
}

/// A started worker process.
pub struct Process {
    pub child: Child,
    pub pid: u32,
    /// The IPC server name, to unblock its accept thread if the child never connects.
    server_name: String,
    pub connected: bool,
}

/// The CUDA libraries a CUDA build of the worker links (`libcuda.so.1` is the driver's).
pub const CUDA_LIBRARIES: [&str; 4] = [
    "libcublas.so.13",
    "libcublasLt.so.13",
    "libcudart.so.13",
    "libcurand.so.10",
];

/// Folders that may hold the CUDA libraries: `$CUDA_HOME` and `$CUDA_PATH`, the usual install
/// places, then the `nvidia/*/lib` folders of PyTorch's CUDA wheels in `site_packages`.
fn cuda_library_candidates(site_packages: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .into_iter()
        .filter_map(std::env::var_os)
        .map(|home| PathBuf::from(home).join("lib64"))
        .collect();
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    for sp in site_packages {
        if let Ok(entries) = std::fs::read_dir(sp.join("nvidia")) {
            let mut found: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("lib")).collect();
            found.sort();
            dirs.extend(found);
        }
    }
    dirs
}

/// The site-packages folders of `python` (none when it does not run).
fn site_packages(python: &Path) -> Vec<PathBuf> {
    if !python.is_absolute() {
        return Vec::new(); // not found on PATH (see torch_engine::python)
    }
    let mut command = Command::new(python);
    command.arg("-c").arg(dflash_common::python::guarded(
        "import site\nprint('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))",
    ));
    dflash_common::python::safe_environment(&mut command, None, Path::new("/"));
    let out = command.stdin(Stdio::null()).stderr(Stdio::null()).output();
    match out {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// `LD_LIBRARY_PATH` for a worker: the entries of `current` that no other user can write (a
/// relative or empty entry names the working directory, where another user may have put a
/// library), then, on a GPU (`candidates` given), every candidate folder holding one of
/// [`CUDA_LIBRARIES`] (the user's own folders keep precedence); `None` when that is `current`.
pub fn cuda_library_path(
    current: Option<&std::ffi::OsStr>,
    candidates: &[PathBuf],
) -> Option<std::ffi::OsString> {
    let given: Vec<PathBuf> = current
        .map(|c| std::env::split_paths(c).collect())
        .unwrap_or_default();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for dir in &given {
        match dflash_common::python::unsafe_import_dir(dir) {
            None if !dirs.contains(dir) => dirs.push(dir.clone()),
            None => {}
            Some(why) => tracing::warn!(
                "LD_LIBRARY_PATH entry {:?} left out of the workers' environment: {why}",
                crate::format::clip(&dir.to_string_lossy(), 200)
            ),
        }
    }
    for dir in candidates {
        if !dirs.contains(dir)
            && CUDA_LIBRARIES.iter().any(|l| dir.join(l).is_file())
            && dflash_common::python::unsafe_import_dir(dir).is_none()
        {
            dirs.push(dir.clone());
        }
    }
    (dirs != given).then(|| std::env::join_paths(dirs).ok())?
}

/// The environment of a process on `gpu` (none: a CPU process): `CUDA_VISIBLE_DEVICES`, with
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID` so that CUDA numbers the GPUs as NVML does (CUDA's default
/// puts the fastest first, and GPU 1 of `--gpus` would be another GPU than NVML's GPU 1); an
/// `LD_LIBRARY_PATH` without the entries another user could write; and on a GPU, the CUDA
/// libraries' folders on it (found once per process; `python` is the interpreter whose CUDA
/// wheels may hold them), so a CUDA build of the worker finds them without the user exporting
/// anything.
pub fn device_env(command: &mut Command, gpu: Option<u32>, python: Option<&Path>) {
    command
        .env(
            "CUDA_VISIBLE_DEVICES",
            gpu.map(|g| g.to_string()).unwrap_or_default(),
        )
        .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    type Found = std::sync::OnceLock<Option<std::ffi::OsString>>;
    static GPU: Found = std::sync::OnceLock::new();
    static CPU: Found = std::sync::OnceLock::new();
    let current = std::env::var_os("LD_LIBRARY_PATH");
    let path = if gpu.is_some() {
        GPU.get_or_init(|| {
            let python = crate::runtime::torch_engine::python(python);
            let candidates = cuda_library_candidates(&site_packages(&python));
            cuda_library_path(current.as_deref(), &candidates)
        })
    } else {
        CPU.get_or_init(|| cuda_library_path(current.as_deref(), &[]))
    };
    match path {
        Some(path) if path.is_empty() => {
            command.env_remove("LD_LIBRARY_PATH");
        }
        Some(path) => {
            command.env("LD_LIBRARY_PATH", path);
        }
        None => {}
    }
}

/// The worker binary beside this executable (`DFLASH_WORKER_BIN` overrides it).
pub fn worker_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("DFLASH_WORKER_BIN") {
        return PathBuf::from(path);
    }
    std::env::current_exe()
        .map(|exe| exe.with_file_name("dflash-worker"))
        .unwrap_or_else(|_| PathBuf::from("dflash-worker"))
}

/// Makes the process `command` starts a child of this one in every way that matters: in its own
/// process group (signals to the orchestrator's group do not reach it, and it can be stopped with
/// everything it started), killed when this process dies, pinned to `cpus` (none: unpinned).
pub fn bind_to_parent(command: &mut Command, cpus: &[usize]) {
    let parent = std::process::id();
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        let _ = set.set(cpu);
    }
    let pin = !cpus.is_empty();
    // SAFETY: only async-signal-safe calls between fork and exec (setpgid, prctl, getppid,
    // sched_setaffinity, _exit).
    unsafe {
        command.pre_exec(move || {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The parent died before the prctl took effect.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            if pin {
                let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
            }
            Ok(())
        });
    }
}

/// CPUs this process may run on.
pub fn available_cpus() -> Vec<usize> {
    match nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

/// The CPUs of worker `index` of `workers`: an equal share of the available CPUs (one each, in
/// turn, when there are more workers than CPUs).
pub fn cpus_for(index: usize, workers: usize, available: &[usize]) -> Vec<usize> {
    if available.is_empty() {
        return Vec::new();
    }
    let share = (available.len() / workers.max(1)).max(1);
    (0..share)
        .map(|k| available[(index * share + k) % available.len()])
        .collect()
}

/// Starts worker `id` (its `incarnation`-th process); its events arrive on `to_loop`.
pub fn spawn(
    id: u32,
    incarnation: u64,
    role: Role,
    device: Device,
    cpus: &[usize],
    launch: &Launch,
    to_loop: &mpsc::Sender<Input>,
) -> std::io::Result<Process> {
    let (server, name) = IpcOneShotServer::<Hello>::new()?;
    let log = crate::fsutil::open_own(
        &launch.log_dir.join(format!("worker-{id}.log")),
        OpenOptions::new().create(true).append(true),
    )?;
    let mut command = Command::new(&launch.binary);
    command
        .args([
            "--ipc",
            &name,
            "--worker",
            &id.to_string(),
            "--role",
            role.name(),
        ])
        .args(["--stage", &launch.stage])
        .arg("--synthetic-us-per-token")
        .arg(
            match role {
                Role::Target => launch.synthetic_us_per_token,
                Role::Drafter => launch.synthetic_drafter_us_per_token,
            }
            .to_string(),
        )
        .arg("--input-ring")
        .arg(&launch.input_ring)
        .arg("--feature-ring")
        .arg(&launch.feature_ring)
        .args(["--heartbeat-ms", &launch.heartbeat_ms.to_string()])
        .args(
            launch
                .dflash_config
                .iter()
                .flat_map(|p| [std::ffi::OsStr::new("--dflash-config"), p.as_os_str()]),
        )
        // Compute threads match the CPUs the worker is pinned to: more threads than CPUs spin
        // against each other (measured 7x slower on small kernels).
        .env(
            "RAYON_NUM_THREADS",
            std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| cpus.len().max(1).to_string()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    device_env(
        &mut command,
        match device {
            Device::Gpu(i) => Some(i),
            Device::Cpu(_) => None,
        },
        launch.python.as_deref(),
    );
    if let Some((group, rank)) = launch
        .drafters
        .as_ref()
        .filter(|_| role == Role::Drafter)
        .and_then(|g| Some((g, g.rank_of(id)?)))
    {
        let [rank_var, ranks_var, rendezvous_var, timeout_var] =
            dflash_common::dflash::DrafterRank::ENV;
        let (base, world) = group.nodes.map_or((0, group.ranks), |n| (n.base, n.world));
        command
            .env(rank_var, (base + rank).to_string())
            .env(ranks_var, world.to_string())
            .env(rendezvous_var, group.rendezvous())
            .env(timeout_var, group.timeout_s.to_string());
        if let Some(key) = &group.key {
            command.env("DFLASH_DRAFTERS_KEY", key);
        }
        if let Some(share) = group.nodes {
            let [local_var, resume_var] = dflash_common::dflash::DrafterRank::NODE_ENV;
            command
                .env(local_var, rank.to_string())
                .env(resume_var, share.resume_step.to_string());
        }
    }
    bind_to_parent(&mut command, cpus);
    let child = command.spawn()?;
    let pid = child.id();
    let to_loop = to_loop.clone();
    std::thread::Builder::new()
        .name(format!("worker-{id}-ipc"))
        .spawn(move || {
            let send = |event| {
                let _ = to_loop.send(Input::Worker {
                    worker: id,
                    incarnation,
                    event,
                });
            };
            let Ok((_, hello)) = server.accept() else {
                send(WorkerInput::Gone);
                return;
            };
            if hello.worker != id || hello.pid != pid {
                // The dummy connection of `abandon`, or a stranger.
                send(WorkerInput::Gone);
                return;
            }
            if hello.protocol != dflash_common::wire::PROTOCOL {
                send(WorkerInput::Event(Event::Failed {
                    id: None,
                    reason: format!(
                        "worker speaks protocol {}, this orchestrator {}: rebuild both",
                        hello.protocol,
                        dflash_common::wire::PROTOCOL
                    ),
                }));
                return;
            }
            let events = hello.events;
            send(WorkerInput::Connected(hello.jobs));
            while let Ok(event) = dflash_common::wire::recv(&events) {
                send(WorkerInput::Event(event));
            }
            send(WorkerInput::Gone);
        })?;
    Ok(Process {
        child,
        pid,
        server_name: name,
        connected: false,
    })
}

impl Process {
    /// SIGKILL to the worker's process group.
    pub fn kill(&self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }

    /// Unblocks the accept thread of a worker that died before connecting.
    pub fn abandon(&self) {
        if self.connected {
            return;
        }
        let Ok(sender) = IpcSender::<Hello>::connect(self.server_name.clone()) else {
            return;
        };
        let (Ok((jobs, _)), Ok((_, events))) = (ipc::channel::<Job>(), ipc::channel::<Event>())
        else {
            return;
        };
        let _ = sender.send(Hello {
            protocol: 0,
            worker: u32::MAX,
            pid: 0,
            jobs,
            events,
        });
    }
}

/// Describes how a process ended.
pub fn exit_reason(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(0), _) => "exited normally".into(),
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => {
            let name = nix::sys::signal::Signal::try_from(sig)
                .map(|s| s.as_str().to_owned())
                .unwrap_or_else(|_| format!("signal {sig}"));
            format!("killed by {name}")
        }
        (None, None) => "ended".into(),
    }
}

pub fn log_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("logs")
}

/// Where one node's data-parallel drafters meet (see [`DrafterGroup`]).
pub fn drafter_store_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("drafters")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_shares() {
        assert_eq!(cpus_for(0, 2, &[0, 1, 2, 3]), vec![0, 1]);
        assert_eq!(cpus_for(1, 2, &[0, 1, 2, 3]), vec![2, 3]);
        assert_eq!(cpus_for(2, 3, &[0, 1]), vec![0]);
        assert!(cpus_for(0, 1, &[]).is_empty());
    }

    /// A GPU worker's `LD_LIBRARY_PATH`: the user's folders first, then each candidate holding a
    /// CUDA library (PyTorch's wheels' layout), once; nothing added, nothing set.
    #[test]
    fn gpu_workers_find_the_cuda_libraries() {
        let dir = tempfile::tempdir().unwrap();
        let sp = dir.path().join("site-packages");
        for (wheel, lib) in [
            ("cublas", "libcublas.so.13"),
            ("cuda_runtime", "libcudart.so.13"),
        ] {
            std::fs::create_dir_all(sp.join("nvidia").join(wheel).join("lib")).unwrap();
            std::fs::write(sp.join("nvidia").join(wheel).join("lib").join(lib), b"").unwrap();
        }
        std::fs::create_dir_all(sp.join("nvidia/empty/lib")).unwrap();
        let candidates = cuda_library_candidates(&[sp.clone(), dir.path().join("missing")]);
        let cublas = sp.join("nvidia/cublas/lib");
        let cudart = sp.join("nvidia/cuda_runtime/lib");
        assert!(candidates.contains(&cublas) && candidates.contains(&cudart));
        let mine = dir.path().join("mine");
        std::fs::create_dir(&mine).unwrap();
        let current = std::env::join_paths([mine.as_path(), "".as_ref(), "lib".as_ref()]).unwrap();
        let path = cuda_library_path(Some(&current), &candidates).unwrap();
        let dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
        // The user's folder first; the working directory ("" and "lib") never.
        assert_eq!(dirs[0], mine);
        assert!(!dirs.iter().any(|d| d.is_relative()), "{dirs:?}");
        assert!(dirs.contains(&cublas) && dirs.contains(&cudart), "{dirs:?}");
        assert!(!dirs.contains(&sp.join("nvidia/empty/lib")));
        // Already there: nothing to add.
        let again = cuda_library_path(Some(&path), &candidates);
        assert_eq!(again, None);
        assert_eq!(cuda_library_path(None, &[dir.path().join("missing")]), None);
        // A CPU worker keeps the user's safe folders and loses the rest.
        assert_eq!(cuda_library_path(Some(mine.as_os_str()), &[]), None);
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let mixed = std::env::join_paths([open.as_path(), mine.as_path()]).unwrap();
        assert_eq!(
            cuda_library_path(Some(&mixed), &[]),
            Some(mine.clone().into())
        );
        assert_eq!(
            cuda_library_path(Some("rel".as_ref()), &[]),
            Some("".into())
        );
        // A GPU process numbers GPUs as NVML does; a CPU one sees none.
        let mut c = Command::new("true");
        device_env(&mut c, None, None);
        let envs: Vec<_> = c.get_envs().collect();
        assert!(envs.contains(&("CUDA_DEVICE_ORDER".as_ref(), Some("PCI_BUS_ID".as_ref()))));
        assert!(envs.contains(&("CUDA_VISIBLE_DEVICES".as_ref(), Some("".as_ref()))));
    }
}
