#!/usr/bin/env python3
"""The GPU check of dflash-orch: one pass over what only real hardware can show.

Started by scripts/gpu-check (which see for the usage). Steps, each recorded in the summary with
"ok" and, when it failed, "error"; a failed step does not stop the ones after it:

  environment   what a first GPU run trips on: the driver's CUDA against the worker's and torch's
                CUDA builds; CUDA and NVML numbering the GPUs alike (CUDA_DEVICE_ORDER=PCI_BUS_ID,
                which dflash-orch sets for its workers); LD_LIBRARY_PATH left to dflash-orch
  capabilities  dflash-worker --capabilities (the binary starts, its CUDA libraries resolve)
  nvml          a short synthetic run; the NVML readings in metrics.jsonl; nvidia-smi
  model         dflash-orch init-tiny: Qwen3-0.6B's shape with random weights (--cpu: a tiny one)
  dflash        a DFlash run, a target and a drafter worker sharing GPU 0: tokens/s, every
                worker's peak GPU memory, whether the loss falls
  serve         the dflash run's checkpoint served: `generate` (the target writes replies on the
                device) and `eval` (speculative decoding against plain greedy decoding on the
                device): τ, speedup, whether the output equals greedy decoding (bf16 may differ)
  crash_resume  the same run again, the drafter SIGKILLed mid-run and restarted by the
                orchestrator: the loss per optimiser step against the uninterrupted run
  pytorch       the same model shape and batch through PyTorch (transformers' Qwen3 target,
                scripts/bench_dflash.py's drafter port) on the same device: tokens/s and the ratio;
                a batch that runs out of memory is halved and tried again (said in the summary)
  torch_dflash  the dflash run on the torch engine (--engine torch): tokens/s, peak memory, the
                loss falls
  torch_crash_resume  the crash_resume step on the torch engine
  drafter_step  one drafter training step at the seeds' shape (Qwen3-8B widths, 5 layers, 6
                sequences of 8,192 tokens = budget 49,152, 512 anchors, block 16, bf16) on both
                engines (dflash-worker --drafter-bench, python -m dflash_orch.bench_step; the
                torch drafter's batched step, eager and compiled, and its legacy per-sequence
                path): tokens/s and MFU beside the accounting benchmark's projection, and what
                compiling cost (--cpu: a tiny shape)
  target_step   the torch target's micro-batch at the seeds' shape (Qwen3-8B widths up to the last
                feature layer, budget 49,152, sequences of about 2,048 and 8,192 tokens) in rows
                of one length and packed (python -m dflash_orch.bench_target): tokens/s, MFU and
                the accounting's projection of each, the packed features' difference from the
                rows'; tiny Qwen3 and gpt-oss targets packed against their rows (--cpu: tiny)
  topology      --topology auto against this GPU: the split of 8 GPUs that the pytorch step's
                measured target and drafter costs balance, beside the one auto picks from its
                FLOP model (launch --dry-run, same model, settings and batch shape), and the
                measured rate of auto's split as a share of the measured best

Progress goes to stderr; the summary, one JSON object, to stdout at the end.
Exit codes: 0 every step passed, 1 a step failed, 2 bad usage.

Nothing this script or a Python process it starts imports comes from the working directory or
from a folder another user can write: before its first import, the relative and unsafe entries
leave sys.path and PYTHONPATH (said on stderr), PYTHONSAFEPATH is set for the children, and the
Python children run from the check's own working folder.
"""

# Before anything else is imported (sys is built in; site imported os at start-up).
import sys  # noqa: E402

import os  # noqa: E402


def _unsafe_import_dir(path):
    """Why another user could put a module at `path` (None: nobody can); as
    dflash_common::python::unsafe_import_dir."""
    if not path.startswith("/"):
        return "a relative path (it names a folder under the working directory)"
    me, at, first = os.geteuid(), path, True
    while True:
        try:
            st = os.stat(at)
        except OSError as e:
            return f"cannot be read ({e.strerror}); another user might make it" if first else f"{at} cannot be read"
        sticky, open_write, ours = st.st_mode & 0o1000, st.st_mode & 0o022, st.st_uid in (me, 0)
        if first and not ours:
            return f"owned by uid {st.st_uid}, another user"
        if open_write and (first or not sticky):
            return f"{'it' if first else at + ' above it'} is writable by other users (mode {st.st_mode & 0o7777:o})"
        if not ours and not sticky:
            return f"{at} above it is owned by uid {st.st_uid}, another user"
        parent = os.path.dirname(at)
        if parent == at:
            return None
        at, first = parent, False


def _guard_imports():
    """Drops the working directory and unsafe folders from this process's sys.path and from
    the PYTHONPATH its children inherit."""
    sys.path[:] = [p for p in sys.path if p.startswith("/")]
    kept = []
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.environ.get("PYTHONPATH") else []:
        why = "an empty entry (it means the working directory)" if not entry else _unsafe_import_dir(entry)
        if why:
            print(f"gpu-check: PYTHONPATH entry {entry[:200]!r} left out: {why}", file=sys.stderr)
            if entry in sys.path:
                sys.path.remove(entry)
        elif entry not in kept:
            kept.append(entry)
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)
    os.environ["PYTHONSAFEPATH"] = "1"


_guard_imports()

# The code of `python -c`: drops the relative sys.path entries before any import, then runs
# sys.argv[1] as __main__ (dflash_common::python::BOOTSTRAP).
PATH_GUARD = "import sys\nsys.path[:] = [p for p in sys.path if p.startswith('/')]\n"
BOOTSTRAP = PATH_GUARD + "import runpy\ndel sys.argv[0]\nrunpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NVML_READINGS = ["power_w", "utilization_pct", "memory_used_bytes", "memory_total_bytes",
                 "temperature_c", "sm_clock_mhz"]
# What the CUDA worker links against; on the GPU machine they come from PyTorch's wheels.
CUDA_LIBS = ["libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13", "libcurand.so.10",
             "libnvrtc.so.13"]
MIB = 1 << 20
T0 = time.monotonic()


def log(msg):
    print(f"gpu-check [{time.monotonic() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


class StepFailed(Exception):
    """A step's failure, with what it measured before failing."""

    def __init__(self, error, **partial):
        super().__init__(error)
        self.partial = partial


# ---------------------------------------------------------------------------------------------
# Finding things.


def find_binaries(args):
    """(dflash-orch, dflash-worker): --bin-dir, this folder (packaged), or the repository's target/."""
    def unpack(path):
        # The package carries the binaries xz-compressed (to stay small); unpack once, beside them.
        if not os.path.exists(path) and os.path.exists(path + ".xz"):
            import lzma
            log(f"unpacking {os.path.basename(path)}.xz")
            tmp = path + ".tmp"
            with lzma.open(path + ".xz") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
        return path

    if args.bin_dir:
        d = os.path.abspath(args.bin_dir)
        return unpack(os.path.join(d, "dflash-orch")), unpack(os.path.join(d, "dflash-worker"))
    if os.path.exists(os.path.join(HERE, "dflash-orch")) or os.path.exists(os.path.join(HERE, "dflash-orch.xz")):
        return unpack(os.path.join(HERE, "dflash-orch")), unpack(os.path.join(HERE, "dflash-worker"))
    root = os.path.dirname(HERE)
    orch = os.path.join(root, "target", "release", "dflash-orch")
    cuda_worker = os.path.join(root, "target", "cuda", "release", "dflash-worker")
    cpu_worker = os.path.join(root, "target", "release", "dflash-worker")
    if not args.cpu and os.path.exists(cuda_worker):
        return orch, cuda_worker
    return orch, cpu_worker


def cuda_lib_dirs(python):
    """Folders holding the CUDA libraries: PyTorch's nvidia wheels of `python`, then the usual places."""
    dirs = []
    try:
        out = subprocess.run(
            [python, "-c",
             PATH_GUARD + "import json, site; print(json.dumps(site.getsitepackages() + [site.getusersitepackages()]))"],
            check=True, capture_output=True, text=True, timeout=30, cwd="/").stdout
        for sp in json.loads(out):
            nv = os.path.join(sp, "nvidia")
            if os.path.isdir(nv):
                for sub in sorted(os.listdir(nv)):
                    lib = os.path.join(nv, sub, "lib")
                    if os.path.isdir(lib):
                        dirs.append(lib)
            if os.path.isdir(os.path.join(sp, "torch", "lib")):
                dirs.append(os.path.join(sp, "torch", "lib"))
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log(f"could not list {python}'s site-packages: {e}")
    dirs += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
    return [d for d in dirs if os.path.isdir(d)]


def child_env(args, worker, libraries):
    """The environment of the check's commands. With `libraries`, the CUDA libraries' folders on
    LD_LIBRARY_PATH: for running dflash-worker directly, and in --cpu mode (the packaged worker is
    the CUDA build, which needs them to start at all, and dflash-orch adds them for GPU workers
    only). Without: dflash-orch's GPU runs show that the orchestrator sets them itself."""
    env = dict(os.environ)
    env["DFLASH_WORKER_BIN"] = worker
    env.setdefault("RUST_BACKTRACE", "1")
    if not libraries:
        return env
    have = [d for d in cuda_lib_dirs(args.python)
            if any(os.path.exists(os.path.join(d, lib)) for lib in CUDA_LIBS)]
    old = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    if have:
        env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(old + have))
    return env


def help_text(orch, *cmd):
    try:
        return subprocess.run([orch, *cmd, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# ---------------------------------------------------------------------------------------------
# Runs.


def read_jsonl(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass  # a line being written when the run was stopped
    except FileNotFoundError:
        pass
    return rows


def alive(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dflash" in f.read()
    except OSError:
        return False


def worker_pids(metrics):
    """{pid: role} of every worker the run started, from its worker_start events."""
    pids = {}
    for m in metrics:
        if m.get("kind") == "event" and m.get("event") == "worker_start":
            found = re.match(r"pid (\d+)", m.get("message") or "")
            if found:
                pids[int(found.group(1))] = m.get("role")
    return pids


class GpuMemoryPoller:
    """Peak GPU memory per process, from nvidia-smi, polled in the background."""

    def __init__(self, interval=0.5):
        self.peak = {}
        self.interval = interval
        self.error = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        else:
            self.error = "nvidia-smi not found"
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10).stdout
                for line in out.splitlines():
                    parts = [p.strip() for p in line.split(",")]
                    if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                        pid, mib = int(parts[0]), int(parts[1])
                        self.peak[pid] = max(self.peak.get(pid, 0), mib)
            except (OSError, subprocess.SubprocessError) as e:
                self.error = str(e)
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=15)


class Run:
    """One `dflash-orch launch` in the background, stopped cleanly (or killed) when it overruns."""

    def __init__(self, ctx, name, launch_args):
        self.ctx = ctx
        self.dir = os.path.join(ctx.work, name)
        self.log = os.path.join(ctx.work, f"{name}.log")
        self.args = [ctx.orch, "launch", "--run-dir", self.dir, *launch_args]
        self.proc = None
        self.started = None
        self.wall_s = None
        self.timed_out = False

    def start(self):
        log(f"{os.path.basename(self.dir)}: {' '.join(self.args[1:])}")
        self.started = time.monotonic()
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=err, env=self.ctx.env,
                                         stdin=subprocess.DEVNULL)
        return self

    def metrics(self):
        return read_jsonl(os.path.join(self.dir, "metrics.jsonl"))

    def status(self):
        try:
            out = subprocess.run([self.ctx.orch, "status", "--run-dir", self.dir, "--json"], capture_output=True,
                                 text=True, timeout=20, env=self.ctx.env)
            return json.loads(out.stdout) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, ValueError):
            return None

    def stop(self, grace=30):
        """SIGINT (a clean stop: workers stop, the drafter checkpoints), then SIGKILL after `grace`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log(f"{os.path.basename(self.dir)}: the orchestrator did not stop in {grace} s: SIGKILL")
                self.proc.kill()
                self.proc.wait()
        for pid in worker_pids(self.metrics()):
            if alive(pid):
                log(f"killing leftover worker {pid}")
                os.kill(pid, signal.SIGKILL)
        subprocess.run([self.ctx.orch, "clean", "--run-dir", self.dir], capture_output=True, timeout=30)

    def wait(self, timeout):
        try:
            self.proc.wait(max(timeout, 1))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            log(f"{os.path.basename(self.dir)}: still running after {timeout:.0f} s: stopping it")
            self.stop()
        self.wall_s = time.monotonic() - self.started
        return self.proc.returncode

    def tail(self, n=12):
        """The end of the launch's stderr, without backtrace frames; a panic's message first."""
        try:
            with open(self.log, errors="replace") as f:
                lines = [line.rstrip() for line in f if line.strip()]
        except OSError:
            return ""
        panic = [i for i, line in enumerate(lines) if "panicked at" in line]
        head = lines[panic[0]:panic[0] + 2] if panic else []
        frames = re.compile(r"^\s*(\d+: |at |stack backtrace:|note: )")
        rest = [line for line in lines if not frames.match(line) and line not in head]
        return "\n".join(head + rest[-n:])


def train_losses(metrics):
    """{optimiser step: loss}; a step recomputed after a restart keeps its last value."""
    losses = {}
    for m in metrics:
        if m.get("kind") == "train" and m.get("loss") is not None:
            losses[int(m["step"])] = float(m["loss"])
    return losses


def run_measures(run, poller=None):
    """What a finished (or stopped) DFlash run shows: throughput, memory, loss."""
    metrics = run.metrics()
    batches = [m for m in metrics if m.get("kind") == "batch"]
    out = {"run_dir": run.dir, "wall_s": round(run.wall_s or 0, 1), "exit_code": run.proc.returncode,
           "batches": len(batches), "tokens": sum(int(b.get("real_tokens", 0)) for b in batches)}
    if len(batches) >= 2:
        span = batches[-1]["time"] - batches[0]["time"]
        tokens = sum(int(b.get("real_tokens", 0)) for b in batches[1:])
        # From the first batch's end to the last's: the steady rate, without start-up.
        out["tokens_per_s"] = round(tokens / span, 1) if span > 0 else None
        padded = sum(int(b.get("padded_tokens", 0)) for b in batches[1:])
        out["padded_tokens_per_s"] = round(padded / span, 1) if span > 0 else None
    summary = re.findall(r"([\d.]+) tokens this session in ([\d.]+) s", run.tail(50))
    if summary:
        tokens, secs = map(float, summary[-1])
        out["tokens_per_s_whole_run"] = round(tokens / secs, 1) if secs > 0 else None
    losses = train_losses(metrics)
    out["steps"] = len(losses)
    if len(losses) >= 2:
        seq = [losses[k] for k in sorted(losses)]
        tenth = max(1, len(seq) // 10)
        first, last = statistics.fmean(seq[:tenth]), statistics.fmean(seq[-tenth:])
        out.update(loss_first_tenth=round(first, 5), loss_last_tenth=round(last, 5), loss_falls=last < first)
    pids = worker_pids(metrics)
    rss = {}
    for m in metrics:
        if m.get("kind") == "process" and m.get("rss_bytes") is not None:
            role = m.get("role") or "?"
            rss[role] = max(rss.get(role, 0), m["rss_bytes"])
    out["peak_rss_mib"] = {k: round(v / MIB) for k, v in rss.items()}
    gpu = [m for m in metrics if m.get("kind") == "gpu" and m.get("memory_used_bytes") is not None]
    if gpu:
        out["gpu_memory_used_peak_mib"] = round(max(m["memory_used_bytes"] for m in gpu) / MIB)
    if poller is not None:
        per_role = {}
        for pid, mib in poller.peak.items():
            role = pids.get(pid)
            if role:
                per_role[role] = max(per_role.get(role, 0), mib)
        out["peak_gpu_memory_mib"] = per_role
        if poller.peak and not per_role:
            # nvidia-smi saw processes, none of them ours by pid: a PID namespace (container) hides them.
            out["peak_gpu_memory_unmatched_mib"] = {str(k): v for k, v in poller.peak.items()}
        if poller.error:
            out["peak_gpu_memory_error"] = poller.error
    return out


def journal_config(run_dir):
    for row in read_jsonl(os.path.join(run_dir, "journal.jsonl")):
        if row.get("event") == "run":
            return row.get("config") or {}
    return {}


# ---------------------------------------------------------------------------------------------
# The steps.


TORCH_PROBE = PATH_GUARD + r"""
import json, torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
       "devices": []}
if out["available"]:
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["devices"].append({"index": i, "name": p.name, "uuid": str(getattr(p, "uuid", "") or ""),
                               "total_mib": p.total_memory >> 20})
print(json.dumps(out))
"""


def version_tuple(text):
    m = re.match(r"(\d+)\.(\d+)", str(text or ""))
    return (int(m[1]), int(m[2])) if m else None


def uuid_key(text):
    return str(text or "").strip().lower().removeprefix("gpu-")


def step_environment(ctx):
    """What the first GPU run would trip on, before it runs."""
    if ctx.cpu:
        return {"skipped": "--cpu: no driver to check"}
    if not shutil.which("nvidia-smi"):
        raise StepFailed("nvidia-smi is not on PATH (no NVIDIA driver?)")
    res, problems = {}, []
    head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
    m = re.search(r"CUDA Version:\s*([\d.]+)", head.stdout)
    res["driver_cuda"] = m[1] if m else None
    q = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,driver_version",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
    gpus = [dict(zip(("index", "uuid", "pci_bus_id", "driver"), (x.strip() for x in line.split(","))))
            for line in q.stdout.splitlines() if line.count(",") >= 3]
    res["driver"] = gpus[0]["driver"] if gpus else None
    res["nvml_gpus"] = gpus
    res["worker_cuda"] = (ctx.build or {}).get("cuda_version")
    env = dict(ctx.env, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    probe = subprocess.run([ctx.args.python, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=180,
                           env=env, cwd=ctx.work)
    try:
        torch_info = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        torch_info = {}
        problems.append(f"{ctx.args.python} cannot report torch's CUDA: {probe.stderr.strip()[-300:]}")
    res["torch"] = torch_info
    driver = version_tuple(res["driver_cuda"])
    if driver is None:
        problems.append("nvidia-smi names no CUDA version (no driver loaded?)")
    for what, built in (("the CUDA worker", res["worker_cuda"]), ("torch", torch_info.get("cuda"))):
        need = version_tuple(built)
        if driver and need and need > driver:
            problems.append(f"{what} is built for CUDA {built}, the driver supports CUDA {res['driver_cuda']} at "
                            f"most: update the driver, or use a build for CUDA {res['driver_cuda']}")
    if torch_info and not torch_info.get("available"):
        problems.append(f"torch {torch_info.get('torch')} sees no CUDA device")
    # dflash-orch gives each worker CUDA_VISIBLE_DEVICES=<NVML index> with CUDA_DEVICE_ORDER=PCI_BUS_ID:
    # CUDA's device i must then be NVML's GPU i.
    cuda_ids = [uuid_key(d.get("uuid")) for d in torch_info.get("devices", [])]
    nvml_ids = [uuid_key(g["uuid"]) for g in gpus]
    if cuda_ids and all(cuda_ids):
        res["numbering_matches"] = cuda_ids == nvml_ids
        if cuda_ids != nvml_ids:
            problems.append("with CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA numbers the GPUs unlike NVML: "
                            f"CUDA {cuda_ids}, NVML {nvml_ids}")
    else:
        res["numbering_matches"] = None
        res["numbering_note"] = "torch gives no device UUIDs: the numbering was not compared"
    res["ld_library_path"] = os.environ.get("LD_LIBRARY_PATH")
    res["ld_library_path_for_workers"] = ("left to dflash-orch: the launches of this check get no CUDA library "
                                          "folders from it")
    if problems:
        raise StepFailed("; ".join(problems), **res)
    return res


def step_capabilities(ctx):
    for path in (ctx.orch, ctx.worker):
        if not os.access(path, os.X_OK):
            raise StepFailed(f"{path} is missing or not executable (in the repository: cargo build --release "
                             "--bins, and scripts/build-cuda for the CUDA worker; or use scripts/package-gpu-check's "
                             "folder)")
    out = subprocess.run([ctx.worker, "--capabilities"], capture_output=True, text=True, timeout=60,
                         env=ctx.worker_env)
    res = {"worker": ctx.worker, "orchestrator": ctx.orch}
    if out.returncode != 0:
        missing = []
        if shutil.which("ldd"):
            ldd = subprocess.run(["ldd", ctx.worker], capture_output=True, text=True, env=ctx.worker_env).stdout
            missing = [line.split()[0] for line in ldd.splitlines() if "not found" in line]
        hint = (f"; libraries not found: {', '.join(missing)} (install PyTorch's CUDA 13 wheels, or point "
                "LD_LIBRARY_PATH at them)") if missing else ""
        raise StepFailed(f"dflash-worker --capabilities exited {out.returncode}: {out.stderr.strip()[-500:]}{hint}",
                         missing_libraries=missing, **res)
    caps = json.loads(out.stdout)
    res.update(caps=caps, cuda=caps.get("cuda"))
    if not ctx.cpu and caps.get("cuda") is not True:
        raise StepFailed("dflash-worker was built without CUDA (build it with scripts/build-cuda)", **res)
    return res


def step_copy(ctx):
    """The features' two copies on the worker's device: into a host buffer as a target writes its
    feature slot (device to host) and out of it as the drafter reads one (host to device)."""
    env = dict(ctx.worker_env)
    if ctx.cpu:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ctx.pair.split(",")[0]
    out = subprocess.run([ctx.worker, "--copy-bench", "1024"], capture_output=True, text=True,
                         timeout=ctx.remaining(120), env=env)
    if out.returncode != 0:
        raise StepFailed(f"dflash-worker --copy-bench exited {out.returncode}: {out.stderr.strip()[-500:]}")
    report = json.loads(out.stdout)
    return {"device": report.get("device"),
            "copies": {c["dtype"]: {"device_to_host_gb_s": round(c["device_to_host_gb_s"], 2),
                                    "host_to_device_gb_s": round(c["host_to_device_gb_s"], 2)}
                       for c in report.get("copies", [])}}


def nvidia_smi():
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory_total": parts[1], "driver": parts[2]})
    return gpus


def step_nvml(ctx):
    res = {"nvidia_smi": nvidia_smi()}
    run = Run(ctx, "nvml", ["--gpus", ctx.pair, "--topology", "1:1", "--synthetic", "4000", "--epochs", "1",
                            "--synthetic-us-per-token", "2", "--monitor-interval", "0.5", "--max-len", "4096",
                            "--token-budget", "16384"]).start()
    sock = os.path.join(run.dir, "control.sock")
    deadline = time.monotonic() + 30
    while not os.path.exists(sock) and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if run.proc.poll() is None:
        time.sleep(4)
    status = run.status()
    run.stop()
    gpu = [m for m in run.metrics() if m.get("kind") == "gpu"]
    res["gpu_lines"] = len(gpu)
    res["last"] = gpu[-1] if gpu else None
    if status:
        res["status_workers"] = [{k: v for k, v in w.items() if k.startswith("gpu") or k in ("role", "device")}
                                 for w in status.get("workers", [])]
        res["gpu_unavailable"] = status.get("run", {}).get("gpu_unavailable")
    if ctx.cpu:
        res["skipped"] = "no GPU readings in --cpu mode (the synthetic run only)"
        if status is None:
            raise StepFailed(f"the synthetic run did not answer `status`: {run.tail()}", **res)
        return res
    missing = [k for k in NVML_READINGS if not gpu or gpu[-1].get(k) is None]
    res["missing"] = missing
    if status is None and not gpu:
        raise StepFailed(f"the synthetic run failed: {run.tail()}", **res)
    if missing:
        raise StepFailed(f"NVML readings missing: {', '.join(missing)}", **res)
    return res


def step_model(ctx):
    model = os.path.join(ctx.work, "model")
    cmd = [ctx.orch, "init-tiny", "--output", model, "--seed", "0", "--force"]
    if not ctx.cpu:
        if "--preset" not in help_text(ctx.orch, "init-tiny"):
            raise StepFailed("this dflash-orch's init-tiny has no --preset (qwen3-0.6b)")
        cmd += ["--preset", "qwen3-0.6b"]
        if "--dtype" in help_text(ctx.orch, "init-tiny"):
            cmd += ["--dtype", "bf16"]  # half the size; what the bf16 run computes in anyway
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.remaining(120), env=ctx.env)
    if out.returncode != 0:
        raise StepFailed(f"init-tiny exited {out.returncode}: {out.stderr.strip()[-800:]}")
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    ctx.model = model
    size = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model))
    return {"dir": model, "preset": None if ctx.cpu else "qwen3-0.6b", "size_mib": round(size / MIB),
            "hidden_size": cfg.get("hidden_size"), "layers": cfg.get("num_hidden_layers"),
            "heads": cfg.get("num_attention_heads"), "kv_heads": cfg.get("num_key_value_heads"),
            "vocab": cfg.get("vocab_size")}


def dflash_args(ctx, engine=None):
    a = ["--engine", engine, "--python", ctx.args.python] if engine else []
    a += ["--stage", "dflash", "--target-model", ctx.model, "--gpus", ctx.pair, "--topology", "1:1",
         "--synthetic", str(ctx.args.samples), "--max-len", str(ctx.args.max_len),
         "--token-budget", str(ctx.args.token_budget), "--epochs", "1", "--save-every", str(ctx.args.save_every)]
    if ctx.dtype_flags:
        a += ["--dtype", ctx.dtype, "--feature-dtype", ctx.dtype]
    return a + ctx.args.launch_arg


def step_dflash(ctx, engine=None):
    if ctx.model is None:
        raise StepFailed("no model (the model step failed)")
    run = Run(ctx, f"dflash-{engine}" if engine else "dflash", dflash_args(ctx, engine))
    plan = memory_plan(ctx, run)
    with GpuMemoryPoller() if not ctx.cpu else _Null() as poller:
        run.start()
        code = run.wait(ctx.remaining(ctx.args.run_timeout))
    res = run_measures(run, None if ctx.cpu else poller)
    res["dtype"] = ctx.dtype if ctx.dtype_flags else "default (this dflash-orch has no --dtype)"
    res["memory_plan"] = plan
    res["launch"] = " ".join(run.args[1:])
    ctx.references[engine] = run
    if run.timed_out:
        raise StepFailed(f"the run did not finish within {ctx.args.run_timeout} s (raise --run-timeout or lower "
                         f"--samples)", **res)
    if code != 0:
        raise StepFailed(f"dflash-orch launch exited {code}: {run.tail()}", **res)
    if res.get("loss_falls") is not True:
        raise StepFailed("the loss did not fall (first tenth of the steps against the last)", **res)
    return res


def memory_plan(ctx, run):
    """What `launch --dry-run --json` predicts for each worker's peak memory, to set beside the measured peaks."""
    if "--dry-run" not in help_text(ctx.orch, "launch"):
        return None
    try:
        out = subprocess.run(run.args + ["--dry-run", "--json"], capture_output=True, text=True, timeout=120,
                             env=ctx.env)
        dry = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return {"error": str(e)}
    plan = dry.get("plan") or {}
    res = {role: {k: round(v / MIB, 1) for k, v in (plan.get(role) or {}).items() if isinstance(v, (int, float))}
           for role in ("target", "drafter")}
    res.update(anchor_chunk=plan.get("anchor_chunk"), refusals=dry.get("refusals"), notes=dry.get("notes"),
               exit_code=out.returncode)
    return res


class _Null:
    peak = {}
    error = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def step_serve(ctx):
    """generate and eval on the device, with the dflash step's checkpoint."""
    ref = ctx.references.get(None)
    if ctx.model is None or ref is None or ref.proc is None or ref.proc.returncode != 0:
        raise StepFailed("no checkpoint (the dflash step failed or was skipped)")
    for sub in ("generate", "eval"):
        if sub not in help_text(ctx.orch):
            raise StepFailed(f"this dflash-orch has no {sub} command")
    with open(os.path.join(ctx.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = os.path.join(ctx.work, "serve-prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(8):
            f.write(json.dumps({"input_ids": [(i * 977 + k * 131) % (min(vocab, 30000) - 1) + 1
                                              for k in range(32 + 8 * i)]}) + "\n")
    gpu = None if ctx.cpu else ctx.pair.split(",")[0]
    res = {}
    gen = [ctx.orch, "generate", "--target-model", ctx.model, "--input", prompts,
           "--output", os.path.join(ctx.work, "generated.jsonl"), "--max-new-tokens", "128",
           "--gpus", ctx.pair.split(",")[0] if not ctx.cpu else "cpu:1", "--json", "--force"]
    out = subprocess.run(gen, capture_output=True, text=True, timeout=ctx.remaining(120), env=ctx.env)
    if out.returncode != 0:
        raise StepFailed(f"generate exited {out.returncode}: {out.stderr.strip()[-800:]}")
    g = json.loads(out.stdout)
    res["generate"] = {k: g.get(k) for k in ("rows", "tokens_generated", "seconds", "tokens_per_second")}
    ev = [ctx.orch, "eval", "--target-model", ctx.model, "--drafter", ref.dir, "--prompts", prompts,
          "--max-new-tokens", "128", "--ignore-eos", "--json"]
    if gpu is not None:
        ev += ["--gpu", gpu]
    out = subprocess.run(ev, capture_output=True, text=True, timeout=ctx.remaining(180), env=ctx.env)
    if out.returncode != 0:
        raise StepFailed(f"eval exited {out.returncode}: {out.stderr.strip()[-800:]}", **res)
    e = json.loads(out.stdout)
    res["eval"] = {k: e.get(k) for k in ("tau", "pooled_tau", "speedup", "lossless", "tokens", "dtype",
                                         "baseline_seconds_per_token", "speculative_seconds_per_token")}
    return res


def step_crash_resume(ctx, engine=None):
    if ctx.model is None:
        raise StepFailed("no model (the model step failed)")
    ref = ctx.references.get(engine)
    if ref is not None and ref.timed_out:
        raise StepFailed("not run: the uninterrupted run did not finish in time, this one would not either")
    ref_losses = train_losses(ref.metrics()) if ref is not None and ref.proc.returncode == 0 else None
    run = Run(ctx, f"crash-{engine}" if engine else "crash", dflash_args(ctx, engine)).start()
    # The run's timeout: room for the restart and the replayed batches on top of the reference.
    limit = ctx.args.run_timeout if ref is None or ref.wall_s is None else 2 * ref.wall_s + 60
    # Leave the PyTorch step its time: its number is wanted even when this run is slow.
    reserve = 0 if "pytorch" in ctx.args.skip else min(90, ctx.args.torch_timeout)
    deadline = time.monotonic() + ctx.remaining(limit, reserve)
    total = None
    killed = None
    while run.proc.poll() is None and time.monotonic() < deadline:
        total = total or (journal_config(run.dir).get("dflash") or {}).get("total_steps")
        status = run.status()
        if total and status:
            step = (status.get("run", {}).get("training") or {}).get("step") or 0
            drafter = [w for w in status.get("workers", []) if w.get("role") == "drafter"]
            # Past the first checkpoint and about halfway: the restart resumes from a checkpoint
            # and replays the batches after it.
            kill_at = min(max(ctx.args.save_every + 1, total // 2), max(total - 1, 1))
            if step >= kill_at and drafter and drafter[0].get("pid"):
                pid = drafter[0]["pid"]
                log(f"crash: SIGKILL to the drafter (pid {pid}) at optimiser step {step} of {total}")
                os.kill(pid, signal.SIGKILL)
                killed = {"pid": pid, "at_step": step, "total_steps": total}
                break
        time.sleep(0.2)
    code = run.wait(deadline - time.monotonic())
    metrics = run.metrics()
    events = [m for m in metrics if m.get("kind") == "event"]
    res = {"run_dir": run.dir, "wall_s": round(run.wall_s, 1), "exit_code": code, "killed": killed,
           "drafter_exits": [e.get("message") for e in events
                             if e.get("event") == "worker_exit" and e.get("role") == "drafter"],
           "drafter_starts": sum(1 for e in events if e.get("event") == "worker_start" and e.get("role") == "drafter"),
           "rewinds": [e.get("message") for e in events if e.get("event") == "rewind"]}
    losses = train_losses(metrics)
    res["steps"] = len(losses)
    if ref_losses:
        common = sorted(set(ref_losses) & set(losses))
        devs = [abs(losses[k] - ref_losses[k]) / max(abs(ref_losses[k]), 1e-12) for k in common]
        worst = max(range(len(devs)), key=devs.__getitem__) if devs else None
        res.update(steps_compared=len(common), tolerance=ctx.args.tolerance,
                   max_rel_deviation=max(devs) if devs else None,
                   worst_step=common[worst] if worst is not None else None,
                   steps_only_in_reference=sorted(set(ref_losses) - set(losses)),
                   steps_only_here=sorted(set(losses) - set(ref_losses)))
    if killed is None:
        if run.timed_out:
            raise StepFailed("the run did not reach the kill point in time", **res)
        if code != 0:
            raise StepFailed(f"dflash-orch launch exited {code} before the kill point: {run.tail()}", **res)
        raise StepFailed("the run ended before the kill point (too short: raise --samples)", **res)
    if run.timed_out:
        raise StepFailed("the run did not finish after the restart in time", **res)
    if code != 0:
        raise StepFailed(f"dflash-orch launch exited {code} after the drafter was killed: {run.tail()}", **res)
    if res["drafter_starts"] < 2:
        raise StepFailed("the drafter was not restarted", **res)
    if not ref_losses:
        raise StepFailed("no uninterrupted run to compare with (the dflash step failed or was skipped)", **res)
    if res["steps_only_in_reference"] or res["steps_only_here"]:
        raise StepFailed("the two runs have different optimiser steps", **res)
    if res["max_rel_deviation"] is None or res["max_rel_deviation"] > ctx.args.tolerance:
        raise StepFailed(f"loss per step deviates by {res['max_rel_deviation']:.3g} relative (step "
                         f"{res['worst_step']}), above {ctx.args.tolerance:g}", **res)
    return res


def fallback_drafter_settings(ctx):
    with open(os.path.join(ctx.model, "config.json")) as f:
        cfg = json.load(f)
    extra = dict(zip(ctx.args.launch_arg[::2], ctx.args.launch_arg[1::2]))
    n = int(extra.get("--draft-layers", 5))
    top = max(1, cfg["num_hidden_layers"] - 3)
    ids = sorted({round(1 + i * (top - 1) / (n - 1)) for i in range(n)}) if n > 1 else [top]
    return {"draft_layers": n, "block_size": int(extra.get("--block-size", 16)),
            "num_anchors": int(extra.get("--num-anchors", 512)), "mask_token_id": cfg["vocab_size"] - 1,
            "target_layer_ids": [int(x) for x in extra["--target-layer-ids"].split(",")]
            if "--target-layer-ids" in extra else ids}


def step_pytorch(ctx):
    if ctx.model is None:
        raise StepFailed("no model (the model step failed)")
    bench = os.path.join(HERE, "bench_dflash.py")
    if not os.path.exists(bench):
        raise StepFailed(f"{bench} is missing")
    ref = ctx.references.get(None)
    d = (journal_config(ref.dir).get("dflash") if ref is not None else None) or {}
    source = "the dflash run's journal"
    if not d:
        # The Rust run left no journal: launch's defaults (and --launch-arg), so that PyTorch's
        # number still comes.
        d, source = fallback_drafter_settings(ctx), "launch's defaults (the dflash run left no journal)"
    # The batch: the median batch shape of the run (or of its plan): longest sample of the batch,
    # and as many sequences of it as the token budget holds.
    batches = [m for m in ref.metrics() if m.get("kind") == "batch"] if ref is not None else []
    if not batches:
        plan = os.path.join(ctx.work, "plan.jsonl")
        subprocess.run([ctx.orch, "plan", "--synthetic", str(ctx.args.samples), "--max-len", str(ctx.args.max_len),
                        "--token-budget", str(ctx.args.token_budget), "--dump", plan], capture_output=True,
                       timeout=60, env=ctx.env)
        batches = read_jsonl(plan)
    seq = int(statistics.median(int(b["max_len"]) for b in batches)) if batches else ctx.args.max_len // 2
    batch = max(1, ctx.args.token_budget // max(seq, 1))
    out_json = os.path.join(ctx.work, "pytorch.json")
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1", TOKENIZERS_PARALLELISM="false")
    if ctx.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    requested, halvings = batch, []
    # The reference must give a number: a batch that runs out of memory is halved and tried again.
    while True:
        cmd = [ctx.args.python, os.path.abspath(__file__), "_pytorch_side", "--bench", bench, "--model", ctx.model,
               "--device", "cpu" if ctx.cpu else "cuda", "--dtype", ctx.dtype, "--batch", str(batch),
               "--seq", str(seq), "--target-layer-ids", ",".join(map(str, d["target_layer_ids"])),
               "--draft-layers", str(d["draft_layers"]), "--block-size", str(d["block_size"]),
               "--num-anchors", str(d["num_anchors"]), "--mask-token-id", str(d["mask_token_id"]),
               "--lr", repr(d.get("lr", 6e-4)), "--weight-decay", repr(d.get("weight_decay", 0.01)),
               "--clip", repr(d.get("clip", 1.0)), "--iters", str(3 if ctx.cpu else 5), "--json", out_json]
        if d.get("gamma") is not None:
            cmd += ["--gamma", repr(d["gamma"])]
        if d.get("anchor_chunk"):
            cmd += ["--anchor-chunk", str(d["anchor_chunk"])]
        log(f"pytorch: {batch} x {seq} tokens, {d['draft_layers']} drafter layers, {d['num_anchors']} anchors "
            f"({os.path.basename(ctx.args.python)})")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 timeout=ctx.remaining(ctx.args.torch_timeout), env=env, cwd=ctx.work)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"the PyTorch side did not finish within {ctx.args.torch_timeout} s",
                             oom_halvings=halvings) from None
        oom = out.returncode != 0 and ("OutOfMemoryError" in out.stderr or "out of memory" in out.stderr)
        if oom and batch > 1:
            halvings.append(batch)
            batch //= 2
            continue
        if out.returncode != 0:
            raise StepFailed(f"the PyTorch side exited {out.returncode}: {out.stderr.strip()[-1500:]}",
                             oom_halvings=halvings)
        break
    with open(out_json) as f:
        res = json.load(f)
    res["settings_from"] = source
    res["batch_requested"] = requested
    res["oom_halvings"] = halvings
    rust = (ctx.results.get("dflash") or {}).get("tokens_per_s")
    res["rust_tokens_per_s"] = rust
    res["ratio"] = round(rust / res["tokens_per_s"], 3) if rust and res.get("tokens_per_s") else None
    return res


def split_rate(t, d, target_s, drafter_s):
    """Micro-batches a second with `t` targets and `d` drafters at these costs."""
    return min(t / target_s, d / drafter_s)


def balanced(workers, target_s, drafter_s):
    """The T:D of `workers` that moves the most micro-batches a second, the fewest drafters among
    equals (what `--topology auto` does with its own costs), and that rate."""
    best = (workers - 1, 1)
    for d in range(2, workers):
        if split_rate(workers - d, d, target_s, drafter_s) > split_rate(*best, target_s, drafter_s) * (1 + 1e-9):
            best = (workers - d, d)
    return best, split_rate(*best, target_s, drafter_s)


def step_topology(ctx, workers=8):
    """`--topology auto` against the GPU: the `pytorch` step measured one target forward and one
    drafter step of the same micro-batch on this GPU; the split of `workers` GPUs those measured
    costs balance is set beside the one auto picks from its FLOP model (`launch --dry-run`, the
    same model, settings and batch shape), with the measured rate of auto's split as a share of
    the measured best."""
    if "pytorch" in ctx.args.skip:
        return {"skipped": "the pytorch step was skipped (--skip): no measured costs"}
    p = ctx.results.get("pytorch") or {}
    tm, dm = p.get("target_forward_s"), p.get("train_step_s")
    if not tm or not dm:
        raise StepFailed("no measured costs (the pytorch step did not run)")
    ref = ctx.references.get(None)
    d = (journal_config(ref.dir).get("dflash") if ref is not None else None) or fallback_drafter_settings(ctx)
    gpus = f"cpu:{workers}" if ctx.cpu else ",".join([ctx.pair.split(",")[0]] * workers)
    cmd = [ctx.orch, "launch", "--dry-run", "--json", "--stage", "dflash", "--engine", "torch",
           "--python", ctx.args.python, "--target-model", ctx.model, "--gpus", gpus, "--topology", "auto",
           "--synthetic", str(ctx.args.samples), "--max-len", str(p["seq"]),
           "--token-budget", str(p["tokens_per_batch"]), "--accum", str(workers - 1),
           "--draft-layers", str(d["draft_layers"]), "--block-size", str(d["block_size"]),
           "--num-anchors", str(d["num_anchors"]),
           "--target-layer-ids", ",".join(map(str, d["target_layer_ids"])),
           "--run-dir", os.path.join(ctx.work, "topology-dry-run"), "--gpu-memory", "141"]
    if ctx.dtype_flags:
        cmd += ["--dtype", ctx.dtype, "--feature-dtype", ctx.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.remaining(120), env=ctx.env)
    try:
        auto = json.loads(out.stdout)["topology"]
    except (ValueError, KeyError, TypeError):
        raise StepFailed(f"launch --dry-run exited {out.returncode}: {out.stderr.strip()[-800:]}") from None
    (mt, md), best_rate = balanced(workers, tm, dm)
    res = {"workers": workers, "batch": f"{p['batch']} x {p['seq']} tokens",
           "measured": {"target_s": tm, "drafter_s": dm, "drafter_over_target": round(dm / tm, 3),
                        "balanced": f"{mt}:{md}"},
           "auto": {"choice": f"{auto['targets']}:{auto['drafters']}", "reason": auto.get("reason"),
                    "costs": auto.get("costs")}}
    costs = auto.get("costs") or {}
    if costs.get("target_s") and costs.get("drafter_s"):
        res["auto"]["drafter_over_target"] = round(costs["drafter_s"] / costs["target_s"], 3)
    # What auto's split moves at the measured costs, against the measured best.
    res["auto_share_of_best"] = round(split_rate(auto["targets"], auto["drafters"], tm, dm) / best_rate, 3)
    res["all_but_one_share_of_best"] = round(split_rate(workers - 1, 1, tm, dm) / best_rate, 3)
    return res


# ---------------------------------------------------------------------------------------------
# One drafter training step at the seeds' shape, on both engines.

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": False}
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 600, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}
# Dense bf16 tensor-core peaks (FLOP/s) by the GPU's name, for the MFU.
BF16_PEAKS = [("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12)]


def seeds_request(ctx):
    """The seeds' drafter step: Qwen3-8B widths, 5 layers, 6 x 8,192 tokens (budget 49,152), 512
    anchors of 16; --cpu: a tiny one."""
    if ctx.cpu:
        return {"target": TINY, "draft_layers": 1, "target_layer_ids": [0, 2], "block_size": 8,
                "num_anchors": 16, "sequences": 2, "seq_len": 256, "prompt": 32, "dtype": "f32",
                "gamma": 7.0, "warmup": 1, "steps": 2, "seed": 0}
    return {"target": QWEN3_8B, "draft_layers": 5, "target_layer_ids": [1, 9, 17, 25, 33], "block_size": 16,
            "num_anchors": 512, "sequences": 6, "seq_len": 8192, "prompt": 1024, "dtype": "bf16",
            "gamma": 7.0, "warmup": 1, "steps": ctx.args.seeds_steps, "seed": 0}


def step_flops(req):
    """Model FLOPs of one drafter step: the context's projections per token, the blocks' layers
    and attention over the context they see, the frozen lm_head; backward twice the forward,
    once for the lm_head (no weight gradient)."""
    t = req["target"]
    h, inter, vocab = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    hd = t.get("head_dim") or h // t["num_attention_heads"]
    hq, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    layers, b, n = req["draft_layers"], req["block_size"], len(req["target_layer_ids"])
    tokens = req["sequences"] * req["seq_len"]
    positions = req["seq_len"] - 1 - req["prompt"]
    blocks = req["sequences"] * min(req["num_anchors"], positions) * b
    keys = (req["prompt"] + req["seq_len"]) / 2 + b  # the mean context an anchor's block sees
    ctx_fwd = tokens * (2 * n * h * h + layers * 2 * 2 * h * kv)
    block_fwd = blocks * layers * (2 * h * hq + 2 * 2 * h * kv + 2 * hq * h + 3 * 2 * h * inter + 2 * 2 * hq * keys)
    head_fwd = blocks * 2 * h * vocab
    return 3 * (ctx_fwd + block_fwd) + 2 * head_fwd


def planned_chunk(ctx, engine, req):
    """The anchor chunk `launch --anchor-chunk auto` picks for this shape and engine (from a dry run):
    on a GPU from its own memory (NVML), as a launch on it would."""
    model = os.path.join(ctx.work, "seeds-shape")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(req["target"], f)
    gpus = "cpu:2" if ctx.cpu else ctx.pair.split(",")[0] + "," + ctx.pair.split(",")[0]
    cmd = [ctx.orch, "launch", "--dry-run", "--json", "--stage", "dflash", "--synthetic", "10",
           "--target-model", model, "--run-dir", os.path.join(ctx.work, "seeds-dry-run"), "--gpus", gpus,
           "--topology", "1:1", *(["--gpu-memory", "141"] if ctx.cpu else []), "--max-len", str(req["seq_len"]),
           "--token-budget", str(req["sequences"] * req["seq_len"]), "--draft-layers", str(req["draft_layers"]),
           "--num-anchors", str(req["num_anchors"]), "--block-size", str(req["block_size"]),
           "--target-layer-ids", ",".join(map(str, req["target_layer_ids"])), "--dtype", req["dtype"],
           "--engine", engine, "--python", ctx.args.python]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ctx.env)
        return (json.loads(out.stdout).get("plan") or {}).get("anchor_chunk")
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def package_dir(ctx):
    for d in (os.path.join(os.path.dirname(ctx.orch), "python"), os.path.join(HERE, "..", "python"),
              os.path.join(os.path.dirname(ctx.orch), "..", "..", "python")):
        if os.path.exists(os.path.join(d, "dflash_orch", "__init__.py")):
            return os.path.abspath(d)
    return None


def step_drafter_step(ctx):
    req = seeds_request(ctx)
    flops = step_flops(req)
    gpu = None if ctx.cpu else ctx.pair.split(",")[0]
    name = None
    if gpu is not None:
        smi = nvidia_smi() or []
        name = smi[0].get("name") if smi and isinstance(smi[0], dict) else None
    peak = next((p for key, p in BF16_PEAKS if name and key in name), None)
    res = {"shape": {k: v for k, v in req.items() if k != "target"}, "target_widths": req["target"],
           "tokens_per_step": req["sequences"] * req["seq_len"], "model_flops_per_step": flops, "gpu": name,
           "bf16_peak_flops": peak}
    pkg = package_dir(ctx)
    failures = []
    for engine in ("candle", "torch", "torch_compiled", "torch_compiled_again", "torch_legacy"):
        one = dict(req, anchor_chunk=planned_chunk(ctx, engine.split("_")[0], req))
        if engine.startswith("torch_compiled"):
            # The batched step with its elementwise chains compiled (`--drafter-compile`): the
            # gain over `torch` and what compiling cost (`compile_s`).
            one["compile"] = True
        if engine == "torch_compiled_again":
            # Compiled again in a new process, its first two steps (the second's loss reads the
            # first's gradients and update): a restarted drafter must compute the same bits
            # (exact replay), whatever the compiler's tuning picks in each process. On a GPU
            # with empty caches, so that the tuning runs again; on CPUs, where Inductor tunes
            # nothing (its C++ kernels are generated, not benchmarked), from the first
            # process's caches, as a restarted drafter loads them (compiling the same code
            # again would cost a minute on two cores and test nothing more).
            one.update(warmup=0, steps=2)
        env = dict(ctx.worker_env if engine == "candle" else ctx.env)
        env["CUDA_VISIBLE_DEVICES"] = gpu or ""
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # The torch drafter's batched step (flex attention compiled, the linear cross-entropy,
        # fused AdamW) and the per-sequence path before it, side by side.
        env["DFLASH_DRAFTER_PATH"] = "legacy" if engine == "torch_legacy" else "batched"
        if engine == "torch_compiled_again" and not ctx.cpu:
            for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
                env[name] = os.path.join(ctx.work, ".torch-compile-again", sub)
        if engine == "candle":
            cmd = [ctx.worker, "--drafter-bench", "-"]
        else:
            cmd = [ctx.args.python, "-c", BOOTSTRAP, "dflash_orch.bench_step", "-"]
            if pkg:
                env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
        log(f"drafter_step: {engine}, {res['tokens_per_step']} tokens, anchor chunk {one['anchor_chunk']}")
        with GpuMemoryPoller() if not ctx.cpu else _Null() as poller:
            try:
                out = subprocess.run(cmd, input=json.dumps(one), capture_output=True, text=True,
                                     timeout=ctx.remaining(ctx.args.step_timeout), env=env, cwd=ctx.work)
            except subprocess.TimeoutExpired:
                res[engine] = {"error": f"did not finish within {ctx.args.step_timeout:g} s"}
                failures.append(engine)
                continue
        if out.returncode != 0:
            res[engine] = {"error": f"exited {out.returncode}: {out.stderr.strip()[-800:]}",
                           "anchor_chunk": one["anchor_chunk"]}
            failures.append(engine)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["anchor_chunk"] = one["anchor_chunk"]
        r["peak_gpu_memory_mib_nvidia_smi"] = max(poller.peak.values(), default=None) if not ctx.cpu else None
        r["achieved_flops"] = flops / r["median_s"]
        r["mfu"] = round(r["achieved_flops"] / peak, 4) if peak else None
        res[engine] = r
    if res.get("candle", {}).get("median_s") and res.get("torch", {}).get("median_s"):
        res["torch_over_candle"] = round(res["candle"]["median_s"] / res["torch"]["median_s"], 3)
    again = res.get("torch_compiled_again", {}).get("losses")
    first = res.get("torch_compiled", {}).get("losses")
    if again and first:
        # Bit for bit: the JSON floats are the losses' shortest round-trip forms.
        res["compiled_replays_to_the_bit"] = again[:2] == first[:2]
        res["compiled_again_caches"] = "the first's" if ctx.cpu else "empty"
        if not res["compiled_replays_to_the_bit"]:
            failures.append("torch_compiled_again (another process's losses differ)")
    if res.get("torch", {}).get("median_s") and res.get("torch_compiled", {}).get("median_s"):
        res["compiled_over_eager"] = round(
            res["torch"]["median_s"] / res["torch_compiled"]["median_s"], 3)
    if not ctx.cpu:
        # The accounting benchmark's projection of the same step (scripts/bench-step-account),
        # beside what the GPU measured.
        env = dict(ctx.env)
        if pkg:
            env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [ctx.args.python, "-c", BOOTSTRAP, "dflash_orch.account_cli", "--seq-lens", "8192",
               "--json"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ctx.work,
                                 timeout=ctx.remaining(300))
            projected = json.loads(out.stdout)["drafter"] if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            projected = None
        if projected:
            for engine, column in (("torch", "batched 8192"), ("torch_compiled", "batched 8192"),
                                   ("torch_legacy", "legacy 8192")):
                p = projected[column]
                res.setdefault(engine, {})["projected"] = {
                    k: p[k] for k in ("step_s", "mfu", "tokens_per_s", "executed_over_useful",
                                      "aten_ops", "host_syncs")}
    if failures:
        raise StepFailed(f"the drafter step failed on {', '.join(failures)}", **res)
    return res


def step_target_step(ctx):
    """The torch target's micro-batch at the seeds' shape (Qwen3-8B widths up to the last feature
    layer, budget 49,152, sequences of about 2,048 and 8,192 tokens), rows of one length against
    packed rows (one variable-length flash kernel per layer), with the packed features'
    difference; tiny Qwen3 and gpt-oss (sinks, sliding windows) packed against their rows; and
    the accounting's projection of the same micro-batches. --cpu: a tiny one."""
    if ctx.cpu:
        req = {"target": TINY, "target_layer_ids": [0, 2], "seq_lens": [256, 64], "budget": 1024,
               "dtype": "f32", "warmup": 1, "iters": 2, "check": ["qwen3", "gpt_oss"]}
    else:
        req = {"target": QWEN3_8B, "target_layer_ids": [1, 9, 17, 25, 33], "seq_lens": [2048, 8192],
               "budget": 49152, "dtype": "bf16", "warmup": 1, "iters": 3, "check": ["qwen3", "gpt_oss"]}
    gpu = None if ctx.cpu else ctx.pair.split(",")[0]
    env = dict(ctx.env)
    env["CUDA_VISIBLE_DEVICES"] = gpu or ""
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    pkg = package_dir(ctx)
    if pkg:
        env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [ctx.args.python, "-c", BOOTSTRAP, "dflash_orch.bench_target", "-"]
    log(f"target_step: sequences of {req['seq_lens']} tokens, budget {req['budget']}")
    try:
        out = subprocess.run(cmd, input=json.dumps(req), capture_output=True, text=True, env=env,
                             cwd=ctx.work, timeout=ctx.remaining(ctx.args.step_timeout))
    except subprocess.TimeoutExpired:
        raise StepFailed(f"did not finish within {ctx.args.step_timeout:g} s") from None
    if out.returncode != 0:
        raise StepFailed(f"exited {out.returncode}: {out.stderr.strip()[-1500:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    peak = next((p for key, p in BF16_PEAKS if key in (res.get("gpu") or "")), None)
    for one in res["lengths"].values():
        for name in ("rows", "packed"):
            one[name]["mfu"] = round(one[name]["model_flops_per_s"] / peak, 4) if peak else None
    if not ctx.cpu:
        cmd = [ctx.args.python, "-c", BOOTSTRAP, "dflash_orch.account_cli", "--json"]
        try:
            acc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ctx.work,
                                 timeout=ctx.remaining(300))
            projected = json.loads(acc.stdout)["target"] if acc.returncode == 0 else {}
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            projected = {}
        for seq, one in res["lengths"].items():
            for name, column in (("rows", f"target {seq}"), ("packed", f"packed target {seq}")):
                p = projected.get(column)
                if p:
                    one[name]["projected"] = {k: p[k] for k in ("step_s", "mfu", "tokens_per_s")}
    # The target's own probe (packed against rows at start) may refuse packing: that is a
    # finding here, not a fallback to time.
    kernels = [one["packed"]["kernel"] for one in res["lengths"].values()]
    kernels += [c["packing"] for c in res["check"].values()]
    refused = [k for k in kernels if not k.startswith("packed, ")]
    if refused:
        raise StepFailed(f"the target refused packing: {refused[0]}", **res)
    bad = [f"{seq}: {one['relative_max_diff']:.3g}" for seq, one in res["lengths"].items()
           if not one["relative_max_diff"] <= 0.05]
    bad += [f"{arch}: {c['relative_max_diff']:.3g}" for arch, c in res["check"].items()
            if not c["relative_max_diff"] <= 0.05]
    if bad:
        raise StepFailed("packed features differ from rows' past 5 % of their scale: "
                         + ", ".join(bad), **res)
    return res


# ---------------------------------------------------------------------------------------------
# The PyTorch side, in its own process (so that its GPU memory is gone when it ends).


def pytorch_side(argv):
    ap = argparse.ArgumentParser(prog="gpu_check.py _pytorch_side")
    ap.add_argument("--bench", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--target-layer-ids", required=True)
    ap.add_argument("--draft-layers", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--num-anchors", type=int, required=True)
    ap.add_argument("--mask-token-id", type=int, required=True)
    ap.add_argument("--gamma", type=float, default=None)
    ap.add_argument("--anchor-chunk", type=int, default=None)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)

    import random

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.abspath(a.bench)))
    import bench_dflash as bd  # wl_rope_theta, engine_package

    bd.engine_package()
    from dflash_orch.bench_step import drafter_for

    transformers.utils.logging.set_verbosity_error()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("torch.cuda.is_available() is False")
    bf16 = a.dtype == "bf16"
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    def sync():
        if cuda:
            torch.cuda.synchronize()

    dtype = torch.bfloat16 if bf16 else torch.float32
    t_load = time.monotonic()
    with torch.device("cpu"):
        try:
            model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    load_s = time.monotonic() - t_load
    tc = model.config
    ids_layers = [int(x) for x in a.target_layer_ids.split(",")]
    b, s = a.batch, a.seq
    prompt = max(1, s // 8)
    vocab = tc.vocab_size
    tokens = torch.randint(0, vocab - 1, (b, s)).to(device)
    real = b * s

    def target_forward():
        with torch.no_grad():
            out = model.model(input_ids=tokens, attention_mask=torch.ones_like(tokens), output_hidden_states=True,
                              use_cache=False)
            return torch.cat([out.hidden_states[k + 1] for k in ids_layers], dim=-1)

    t_times = []
    for i in range(a.warmup + a.iters):
        sync()
        t0 = time.perf_counter()
        features = target_forward()
        sync()
        if i >= a.warmup:
            t_times.append(time.perf_counter() - t0)

    # The drafter: the torch engine's own (python/dflash_orch/drafter.py), what a `--engine torch`
    # drafter worker runs, fed this forward's features; the target's embedding and lm_head.
    sd = model.state_dict()
    embedding = sd["model.embed_tokens.weight"].detach()
    lm_head = (sd["lm_head.weight"] if "lm_head.weight" in sd else embedding).detach()
    drafter = drafter_for(tc.to_dict(), a.draft_layers, a.block_size, len(ids_layers), a.dtype, device,
                          heads=(embedding.to(dtype), lm_head.to(dtype)), gamma=a.gamma,
                          anchor_chunk=a.anchor_chunk, weight_decay=a.weight_decay,
                          rope_theta=bd.wl_rope_theta(a.model), mask_token_id=a.mask_token_id, seed=a.seed)
    flat = features.reshape(b * s, -1)
    flat_tokens = tokens.reshape(-1).tolist()
    flat_mask = ([0] * prompt + [1] * (s - prompt)) * b
    d_times, losses = [], []
    for i in range(a.warmup + a.iters):
        positions = range(prompt, s - 1)
        sequences = [(row * s, s, sorted(rng.sample(positions, min(a.num_anchors, len(positions)))))
                     for row in range(b)]
        sync()
        t0 = time.perf_counter()
        out = drafter.micro_batch(flat, flat_tokens, flat_mask, sequences, 1)
        drafter.step(a.lr, a.clip, False)
        losses.append(out["loss"])
        sync()
        if i >= a.warmup:
            d_times.append(time.perf_counter() - t0)

    tm, dm = statistics.median(t_times), statistics.median(d_times)
    result = {
        "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "precision": "bf16 (the drafter's f32 masters, bf16 compute)" if bf16 else "float32",
        "drafter_engine": "dflash_orch.drafter (the torch engine's drafter)",
        "batch": b, "seq": s, "prompt_without_loss": prompt, "tokens_per_batch": real,
        "drafter": {"layers": a.draft_layers, "block_size": a.block_size, "num_anchors": a.num_anchors,
                    "target_layer_ids": ids_layers},
        "iterations": {"warmup": a.warmup, "timed": a.iters}, "model_load_s": round(load_s, 2),
        "target_forward_s": round(tm, 5), "train_step_s": round(dm, 5),
        "target_tokens_per_s": round(real / tm, 1), "train_tokens_per_s": round(real / dm, 1),
        # Target forward and drafter step one after the other, as one process on one GPU does.
        "tokens_per_s": round(real / (tm + dm), 1),
        "losses": [round(x, 5) for x in losses],
        "peak_gpu_memory_mib": round(torch.cuda.max_memory_allocated(device) / MIB) if cuda else None,
    }
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------------------


class Context:
    def __init__(self, args):
        self.args = args
        self.cpu = args.cpu
        self.pair = args.gpus or ("cpu:2" if args.cpu else "0,0")
        self.dtype = "f32" if args.cpu else "bf16"
        self.model = None
        # The uninterrupted dflash run of each engine (None: the launch default), for the steps after.
        self.references = {}
        self.build = None
        self.results = {}
        self.deadline = T0 + args.budget

    def remaining(self, want, reserve=0.0):
        """`want` seconds, or what is left of the time budget less `reserve` (at least 1)."""
        return max(1.0, min(want, self.deadline - time.monotonic() - reserve))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_pytorch_side":
        return pytorch_side(sys.argv[2:])
    ap = argparse.ArgumentParser(
        prog="gpu-check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The GPU check of dflash-orch (docs/gpu-check.md). Steps, each recorded in the summary "
                    "with \"ok\"\nand, when it failed, \"error\"; a failed step does not stop the ones after it:\n\n"
                    + __doc__.split("after it:\n\n", 1)[1],
        epilog="Run from the folder scripts/package-gpu-check made (it finds the binaries beside itself), or from "
               "the repository (target/release/dflash-orch, target/cuda/release/dflash-worker).")
    ap.add_argument("--cpu", action="store_true",
                    help="the same flow on CPU workers (cpu:2, f32, a tiny model, a small budget): tests this script "
                         "without a GPU")
    ap.add_argument("--bin-dir", help="where dflash-orch and dflash-worker are [default: beside this script, or the "
                                      "repository's target/]")
    ap.add_argument("--gpus", help="--gpus of the runs: the target and the drafter worker [default: 0,0, both on "
                                   "GPU 0; --cpu: cpu:2]")
    ap.add_argument("--work", help="working folder, kept [default: a temporary one, removed when every step passed]")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--python", default=sys.executable, help="the Python with torch and transformers "
                                                             "[default: this one]")
    ap.add_argument("--samples", type=int, help="synthetic samples of the DFlash runs [default: 256; --cpu: 192]")
    ap.add_argument("--max-len", type=int, help="--max-len of the DFlash runs [default: 4096; --cpu: 512]")
    ap.add_argument("--token-budget", type=int, help="--token-budget of the DFlash runs [default: 16384; --cpu: 2048]")
    ap.add_argument("--save-every", type=int, default=2, help="checkpoint every N optimiser steps [default: 2]")
    ap.add_argument("--launch-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for both DFlash launches (repeat it: --launch-arg=--num-anchors "
                         "--launch-arg=64)")
    ap.add_argument("--tolerance", type=float, default=2e-2,
                    help="largest relative loss difference per step after the crash [default: 0.02]")
    ap.add_argument("--run-timeout", type=float, default=180, help="seconds one DFlash run may take [default: 180]")
    ap.add_argument("--torch-timeout", type=float, default=120, help="seconds the PyTorch side may take [default: 120]")
    ap.add_argument("--budget", type=float, default=780, help="seconds for the whole check [default: 780]")
    ap.add_argument("--step-timeout", type=float, default=240,
                    help="seconds each engine's drafter step at the seeds' shape may take [default: 240]")
    ap.add_argument("--seeds-steps", type=int, default=2,
                    help="timed drafter steps at the seeds' shape, after one untimed [default: 2]")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["environment", "copy", "nvml", "dflash", "serve", "crash_resume", "pytorch",
                             "torch_dflash", "torch_crash_resume", "drafter_step", "target_step",
                             "topology"],
                    help="leave a step out (repeatable; serve and crash_resume need dflash's run)")
    args = ap.parse_args()
    args.samples = args.samples or (192 if args.cpu else 256)
    args.max_len = args.max_len or (512 if args.cpu else 4096)
    args.token_budget = args.token_budget or (2048 if args.cpu else 16384)
    if args.cpu:
        # A tiny drafter, so that a CPU run takes seconds.
        have = " ".join(args.launch_arg)
        if "--draft-layers" not in have:
            args.launch_arg += ["--draft-layers", "1"]
        if "--num-anchors" not in have:
            args.launch_arg += ["--num-anchors", "16"]
    # The steps run in their own directories: a Python named by a relative path is resolved here.
    if os.sep in args.python:
        args.python = os.path.abspath(args.python)
    for name in ("samples", "max_len", "token_budget", "save_every", "seeds_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")

    ctx = Context(args)
    try:
        ctx.orch, ctx.worker = find_binaries(args)
    except OSError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    ctx.work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix="gpu-check.")
    os.makedirs(ctx.work, exist_ok=True)
    # torch.compile's caches (code the compiler loads again) in the check's own directory, never
    # the shared /tmp they default to; the runs it launches keep theirs in their run directories.
    for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        os.environ[name] = os.path.join(ctx.work, ".torch-compile", sub)
    ctx.worker_env = child_env(args, ctx.worker, libraries=True)
    ctx.env = child_env(args, ctx.worker, libraries=args.cpu)
    ctx.dtype_flags = "--dtype" in help_text(ctx.orch, "launch")
    log(f"{'CPU' if args.cpu else 'GPU'} mode; binaries {ctx.orch}, {ctx.worker}; work {ctx.work}")

    summary = {"mode": "cpu" if args.cpu else "gpu", "ok": True, "work": ctx.work,
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": ctx.results}
    build = os.path.join(os.path.dirname(ctx.orch), "BUILD.json")
    if os.path.exists(build):
        with open(build) as f:
            summary["build"] = ctx.build = json.load(f)
    steps = [("environment", step_environment), ("capabilities", step_capabilities), ("copy", step_copy),
             ("nvml", step_nvml), ("model", step_model), ("dflash", step_dflash), ("serve", step_serve),
             ("crash_resume", step_crash_resume), ("pytorch", step_pytorch),
             ("torch_dflash", lambda c: step_dflash(c, "torch")),
             ("torch_crash_resume", lambda c: step_crash_resume(c, "torch")),
             ("drafter_step", step_drafter_step), ("target_step", step_target_step),
             ("topology", step_topology)]
    for name, fn in steps:
        if name in args.skip:
            ctx.results[name] = {"ok": True, "skipped": "--skip"}
            continue
        if time.monotonic() > ctx.deadline:
            ctx.results[name] = {"ok": False, "error": f"not run: the {args.budget:g} s budget is spent"}
            summary["ok"] = False
            continue
        log(f"{name} ...")
        t = time.monotonic()
        try:
            res = {"ok": True, **fn(ctx)}
        except StepFailed as e:
            res = {"ok": False, "error": str(e), **e.partial}
        except Exception as e:  # noqa: BLE001 - one step's surprise must not stop the others
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res["seconds"] = round(time.monotonic() - t, 1)
        ctx.results[name] = res
        summary["ok"] = summary["ok"] and res["ok"]
        log(f"{name}: {'ok' if res['ok'] else 'FAILED: ' + res['error'][:300]} ({res['seconds']} s)")

    d, p = ctx.results.get("dflash", {}), ctx.results.get("pytorch", {})
    summary["headline"] = {
        "tokens_per_s": d.get("tokens_per_s"), "pytorch_tokens_per_s": p.get("tokens_per_s"),
        "ratio": p.get("ratio"), "loss_falls": d.get("loss_falls"),
        "peak_gpu_memory_mib": d.get("peak_gpu_memory_mib"),
        "feature_copy_gb_s": ctx.results.get("copy", {}).get("copies"),
        "crash_resume_max_rel_deviation": ctx.results.get("crash_resume", {}).get("max_rel_deviation"),
        "torch_tokens_per_s": ctx.results.get("torch_dflash", {}).get("tokens_per_s"),
        "torch_crash_resume_max_rel_deviation":
            ctx.results.get("torch_crash_resume", {}).get("max_rel_deviation"),
        "seeds_drafter_step": {e: {k: (ctx.results.get("drafter_step", {}).get(e) or {}).get(k)
                                   for k in ("tokens_per_s", "mfu", "anchor_chunk", "compile_s")}
                               for e in ("candle", "torch", "torch_compiled")},
        "seeds_target_step": {seq: {k: (one.get(k) or {}).get("mfu") for k in ("rows", "packed")}
                              for seq, one in
                              (ctx.results.get("target_step", {}).get("lengths") or {}).items()},
        "served": ctx.results.get("serve", {}).get("eval"),
        "topology": {k: ctx.results.get("topology", {}).get(k) for k in ("auto", "measured", "auto_share_of_best")},
    }
    summary["elapsed_s"] = round(time.monotonic() - T0, 1)
    text = json.dumps(summary, indent=1, default=str)
    with open(os.path.join(ctx.work, "summary.json"), "w") as f:
        f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if summary["ok"] and not args.work:
        shutil.rmtree(ctx.work, ignore_errors=True)
        summary["work"] = None
        text = json.dumps(summary, indent=1, default=str)
    else:
        log(f"kept {ctx.work}")
    log("every step passed" if summary["ok"] else
        "failed: " + ", ".join(k for k, v in ctx.results.items() if not v.get("ok")))
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
