//! Starting worker processes: pinned, in their own process group, dying with the orchestrator,
//! connected over ipc-channel (the one-shot server's `accept` blocks without a timeout, so it runs
//! on a thread of its own, which a dummy connection unblocks if the child dies first).

use std::fs::OpenOptions;
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
    pub heartbeat_ms: u64,
    pub log_dir: PathBuf,
    /// The DFlash settings file (`--stage dflash`).
    pub dflash_config: Option<PathBuf>,
}

/// A started worker process.
pub struct Process {
    pub child: Child,
    pub pid: u32,
    /// The IPC server name, to unblock its accept thread if the child never connects.
    server_name: String,
    pub connected: bool,
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
        .arg(launch.synthetic_us_per_token.to_string())
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
        .env(
            "CUDA_VISIBLE_DEVICES",
            match device {
                Device::Gpu(i) => i.to_string(),
                Device::Cpu(_) => String::new(),
            },
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
}
