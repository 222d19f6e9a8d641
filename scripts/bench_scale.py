#!/usr/bin/env python3
"""CPU scale rehearsal of the DFlash stages at real sequence lengths: peak memory per worker and
stage throughput as the token budget grows. Run by scripts/bench-scale (see its --help).

For each token budget B, one `dflash-orch launch --stage dflash --gpus cpu:2 --topology 1:1` on a
dataset whose sequences are all --max-len tokens long (B / max-len sequences per batch, --batches
batches, one epoch), under a wall-clock limit and a memory cap. From the run's metrics.jsonl:

  peak RSS     per worker, the largest `peak_rss_bytes` (the kernel's VmHWM, the worker's plus
               its children's: a torch worker's Python side) of its `process` lines
               (`rss_bytes` where a line has no peak), and the VmHWM this script read from
               /proc while the worker and its children lived, whichever is larger
  drafter      tokens/s = real tokens / the drafter's job time (`compute_s` of the `batch` lines,
               dispatch to answer), over the batches after the first (all of them if only one)
  target       tokens/s = real tokens the target forwarded / its busy time, measured as the CPU
               time (utime + stime from /proc) it used divided by the CPUs it was pinned to (no
               metrics line times the target's jobs); a lower bound when the run was cut short

Beside each peak, the memory `launch --dry-run --json` plans for that worker (its host memory).

The goals: peak(largest budget) / peak(smallest budget) <= --goal-ratio per role (memory linear in
a batch's tokens: 4x the tokens, at most 4.5x the memory), and every peak < --goal-peak-gb.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

GB = 1e9


def log(msg):
    print(f"bench-scale: {msg}", file=sys.stderr, flush=True)


class Usage(Exception):
    pass


def positive_int(name, lo=1, hi=None):
    """An integer in lo..hi (argparse names the option in front of the message)."""
    def parse(text):
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {lo}..{hi}, got {v}" if hi is not None
                                             else f"must be at least {lo}, got {v}")
        return v

    return parse


def positive_float(name, lo=0.0, hi=None, allow_zero=False):
    """A finite number above lo (or equal to 0 where allowed), at most hi."""
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}")
        ok = v == v and abs(v) != float("inf") and (v > lo or (allow_zero and v == 0)) \
            and (hi is None or v <= hi)
        if not ok:
            bound = (f"at least {lo:g}" if allow_zero else f"above {lo:g}") \
                + (f" and at most {hi:g}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}")
        return v

    return parse


def budget_list(text):
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token counts: {text!r}")
    values = [int(p) for p in parts]
    if any(v <= 0 for v in values) or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"budgets must be positive and increasing, got {text!r}")
    return values


def chunk_size(text):
    """launch --anchor-chunk: a count of anchors, or auto."""
    if text == "auto":
        return text
    return positive_int("--anchor-chunk", 1, 65536)(text)


def dtype_name(name):
    def parse(text):
        if not text or not all(c.isalnum() or c in "-_" for c in text):
            raise argparse.ArgumentTypeError(f"not a dtype name such as f32 or bf16: {text!r}")
        return text

    return parse


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="scripts/bench-scale", add_help=False, allow_abbrev=False)
    ap.add_argument("--budgets", type=budget_list, default=[8192, 16384, 32768])
    ap.add_argument("--max-len", type=positive_int("--max-len", 16, 1 << 20), default=8192)
    ap.add_argument("--batches", type=positive_int("--batches", 1, 1000), default=3)
    ap.add_argument("--hidden", type=positive_int("--hidden", 16, 32768), default=256)
    ap.add_argument("--layers", type=positive_int("--layers", 1, 256), default=4)
    ap.add_argument("--heads", type=positive_int("--heads", 1, 1024), default=4)
    ap.add_argument("--kv-heads", type=positive_int("--kv-heads", 1, 1024), default=4)
    ap.add_argument("--head-dim", type=positive_int("--head-dim", 2, 1024), default=64)
    ap.add_argument("--intermediate", type=positive_int("--intermediate", 1, 262144), default=768)
    ap.add_argument("--vocab", type=positive_int("--vocab", 600, 4_194_304), default=4096)
    ap.add_argument("--num-anchors", type=positive_int("--num-anchors", 1, 65536), default=512)
    ap.add_argument("--block-size", type=positive_int("--block-size", 2, 256), default=16)
    ap.add_argument("--draft-layers", type=positive_int("--draft-layers", 1, 64), default=1)
    ap.add_argument("--gpus", default="cpu:2")
    ap.add_argument("--anchor-chunk", type=chunk_size)
    ap.add_argument("--dtype", type=dtype_name("--dtype"))
    ap.add_argument("--feature-dtype", type=dtype_name("--feature-dtype"))
    ap.add_argument("--engine", choices=["candle", "torch"], default="candle")
    ap.add_argument("--drafter-arch", choices=["dflash", "dflash2"])
    ap.add_argument("--python")
    ap.add_argument("--launch-timeout", type=positive_float("--launch-timeout", 1.0, 86400.0), default=480.0)
    ap.add_argument("--time-limit", type=positive_float("--time-limit", 1.0, 7 * 86400.0), default=1140.0)
    ap.add_argument("--mem-cap", type=positive_float("--mem-cap", 0.0, 1e6, allow_zero=True))
    ap.add_argument("--goal-ratio", type=positive_float("--goal-ratio", 0.0, 1e6), default=4.5)
    ap.add_argument("--goal-peak-gb", type=positive_float("--goal-peak-gb", 0.0, 1e6), default=4.0)
    ap.add_argument("--seed", type=positive_int("--seed", 0, 2**63 - 1), default=0)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--root", required=True)

    def fail(message):
        raise Usage(message)

    ap.error = fail
    args = ap.parse_args(argv)
    if not args.gpus.startswith("cpu:"):
        raise Usage(f"--gpus must be cpu:N (a CPU rehearsal), got {args.gpus!r}")
    if args.budgets[0] < args.max_len:
        raise Usage(f"--budgets: {args.budgets[0]} is below --max-len {args.max_len}: no sequence fits a batch")
    if args.json_out == "":
        raise Usage("--json needs a path")
    if args.python is not None and args.engine != "torch":
        raise Usage("--python is for --engine torch")
    if args.drafter_arch == "dflash2" and args.engine != "torch":
        raise Usage("--drafter-arch dflash2 trains on --engine torch only")
    return args


# ---------------------------------------------------------------------------------------------
# /proc


def proc_status(pid):
    """VmHWM and VmRSS in bytes and the number of allowed CPUs of a process, or None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.split()
        if key in ("VmHWM", "VmRSS") and len(value) == 2 and value[0].isdigit() and value[1] == "kB":
            out[key] = int(value[0]) * 1024
        elif key == "Cpus_allowed_list" and value:
            n = 0
            for part in value[0].split(","):
                lo, _, hi = part.partition("-")
                try:
                    n += (int(hi) - int(lo) + 1) if hi else 1
                except ValueError:
                    pass
            out["cpus"] = max(n, 1)
    return out


def proc_cpu_s(pid):
    """utime + stime of a process in seconds, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError):
        return None


def children(pid):
    """Pids whose parent is pid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def mem_total():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---------------------------------------------------------------------------------------------
# Runs


def run_checked(cmd, what, log_path):
    with open(log_path, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"bench-scale: {what} failed (exit {proc.returncode}):\n{tail}")


def write_dataset(path, sequences, length, vocab, rng):
    """JSON lines of `sequences` samples of exactly `length` tokens, the first 64 without loss."""
    prompt = min(64, length // 4)
    mask = json.dumps([0] * prompt + [1] * (length - prompt))
    with open(path, "w") as f:
        for _ in range(sequences):
            ids = [rng.randrange(vocab) for _ in range(length)]
            f.write('{"input_ids": ' + json.dumps(ids) + ', "loss_mask": ' + mask + "}\n")


def read_metrics(path):
    lines = []
    try:
        with open(path) as f:
            for raw in f:
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    pass
    except OSError:
        pass
    return lines


class Launch:
    """One launch under a deadline and a memory cap; its workers watched through /proc."""

    def __init__(self, cmd, run_dir, log_path, deadline_s, cap_bytes, orch):
        self.cmd, self.run_dir, self.orch = cmd, run_dir, orch
        self.deadline_s, self.cap = deadline_s, cap_bytes
        self.log_path = log_path
        self.proc = None
        self.seen = {}  # pid -> {"hwm", "cpu_s", "cpus"}
        self.reason = None
        self.cut = False
        self.over_cap = None  # (pid, RSS) of the worker the watchdog stopped

    def start(self):
        self.log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def watch(self):
        for pid in children(self.proc.pid):
            st = proc_status(pid)
            cpu = proc_cpu_s(pid)
            if st is None:
                continue
            rec = self.seen.setdefault(pid, {"hwm": 0, "cpu_s": 0.0, "cpus": 1, "kids": {}})
            rec["hwm"] = max(rec["hwm"], st.get("VmHWM", 0))
            rec["cpus"] = st.get("cpus", rec["cpus"])
            if cpu is not None:
                rec["cpu_s"] = max(rec["cpu_s"], cpu)
            rss = st.get("VmRSS", 0)
            # A torch worker's Python side is its child: counted in (peak and CPU time).
            for kid in children(pid):
                kst, kcpu = proc_status(kid), proc_cpu_s(kid)
                if kst is None:
                    continue
                k = rec["kids"].setdefault(kid, {"hwm": 0, "cpu_s": 0.0})
                k["hwm"] = max(k["hwm"], kst.get("VmHWM", 0))
                if kcpu is not None:
                    k["cpu_s"] = max(k["cpu_s"], kcpu)
                rss += kst.get("VmRSS", 0)
            if self.cap and rss > self.cap and self.reason is None:
                self.over_cap = (pid, rss)
                self.reason = f"worker pid {pid} went over the memory cap ({self.cap / GB:.1f} GB)"
                self.kill()

    def stop(self, why):
        """Asks the run to stop, then kills what is left."""
        if self.reason is None:
            self.reason = why
        subprocess.run([self.orch, "stop", "--run-dir", self.run_dir],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self):
        # The workers end with their parent (PR_SET_PDEATHSIG); kill them too in case.
        pids = children(self.proc.pid)
        for pid in [self.proc.pid] + pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def run(self):
        self.start()
        try:
            while self.proc.poll() is None:
                self.watch()
                if time.monotonic() - self.started > self.deadline_s:
                    self.cut = self.reason is None
                    self.stop(f"cut at the time limit ({self.deadline_s:.0f} s)")
                    break
                time.sleep(0.25)
        except BaseException:
            if self.proc.poll() is None:
                self.stop("interrupted")
            raise
        finally:
            self.wall_s = time.monotonic() - self.started
            self.log.close()
            # Segments of a run killed outright; harmless after a clean exit.
            subprocess.run([self.orch, "clean", "--run-dir", self.run_dir],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self.proc.returncode


def summarize(launch, budget, planned_batches, per_batch, max_len):
    lines = read_metrics(os.path.join(launch.run_dir, "metrics.jsonl"))
    workers = {}  # worker id -> record
    pid_role = {}
    exits = []
    for v in lines:
        kind = v.get("kind")
        if kind == "process":
            w = workers.setdefault(v["worker"], {"worker": v["worker"], "role": v["role"], "peak_rss_bytes": 0,
                                                 "pids": set()})
            peak = v.get("peak_rss_bytes", v.get("rss_bytes", 0)) or 0
            w["peak_rss_bytes"] = max(w["peak_rss_bytes"], peak)
            w["pids"].add(v["pid"])
            pid_role[v["pid"]] = v["worker"]
        elif kind == "event" and v.get("event") == "worker_start":
            msg = v.get("message") or ""
            if msg.startswith("pid ") and msg.split()[1].isdigit():
                pid = int(msg.split()[1])
                w = workers.setdefault(v["worker"], {"worker": v["worker"], "role": v.get("role"),
                                                     "peak_rss_bytes": 0, "pids": set()})
                w["pids"].add(pid)
                pid_role[pid] = v["worker"]
        elif kind == "event" and v.get("event") == "worker_exit":
            exits.append(f"{v.get('role')} worker {v.get('worker')}: {v.get('message')}")
    # The VmHWM and CPU time this script read while the workers lived.
    for pid, rec in launch.seen.items():
        wid = pid_role.get(pid)
        if wid is None:
            continue
        w = workers[wid]
        kids = rec.get("kids", {}).values()
        w["peak_rss_bytes"] = max(w["peak_rss_bytes"], rec["hwm"] + sum(k["hwm"] for k in kids))
        w["cpu_s"] = w.get("cpu_s", 0.0) + rec["cpu_s"] + sum(k["cpu_s"] for k in kids)
        w["cpus"] = rec["cpus"]
    batches = [v for v in lines if v.get("kind") == "batch"]
    batches.sort(key=lambda v: v.get("step", 0))
    committed = len(batches)
    completed = launch.proc.returncode == 0 and launch.reason is None and committed == planned_batches
    steady = batches[1:] if len(batches) > 1 else batches
    drafter_tps = None
    if steady and sum(b.get("compute_s", 0) for b in steady) > 0:
        drafter_tps = sum(b["real_tokens"] for b in steady) / sum(b["compute_s"] for b in steady)
    tokens_per_batch = per_batch * max_len
    rows = []
    for wid in sorted(workers):
        w = workers[wid]
        row = {"worker": wid, "role": w["role"], "peak_rss_bytes": w["peak_rss_bytes"] or None,
               "tokens_per_s": None, "tokens_per_s_bound": False, "cpu_s": w.get("cpu_s")}
        if w["role"] == "drafter":
            row["tokens_per_s"] = drafter_tps
        elif w["role"] == "target" and w.get("cpu_s"):
            # Everything the plan holds was forwarded when the run completed; else at least what
            # was committed (the target may have forwarded more: a lower bound).
            forwarded = planned_batches if completed else committed
            busy = w["cpu_s"] / max(w.get("cpus", 1), 1)
            if forwarded and busy > 0:
                row["tokens_per_s"] = forwarded * tokens_per_batch / busy
                row["tokens_per_s_bound"] = not completed
        rows.append(row)
    with open(launch.log_path, errors="replace") as f:
        log_lines = [l.strip() for l in f.read().replace("\r", "\n").splitlines() if l.strip()]
    error = next((l for l in reversed(log_lines) if l.startswith("error")), None)
    # A worker whose allocation failed (the address-space cap, or the machine) says so in its log.
    oom = None
    for wid in sorted(workers):
        try:
            with open(os.path.join(launch.run_dir, "logs", f"worker-{wid}.log"), errors="replace") as f:
                hit = next((l.strip() for l in f if "memory allocation of" in l
                            or "can't allocate memory" in l or "CUDA out of memory" in l), None)
        except OSError:
            hit = None
        if hit and oom is None:
            oom = f"{workers[wid]['role']} worker {wid} ran out of memory ({hit})"
    if launch.over_cap and launch.over_cap[0] in pid_role:
        wid = pid_role[launch.over_cap[0]]
        launch.reason = (f"{workers[wid]['role']} worker {wid} went over the memory cap "
                         f"({launch.over_cap[1] / GB:.2f} GB resident, cap {launch.cap / GB:.1f} GB): stopped")
    if completed:
        outcome = "completed"
    elif launch.reason:
        outcome = launch.reason
    elif oom:
        outcome = oom + (f" under the {launch.cap / GB:.1f} GB cap" if launch.cap else "")
    elif error:
        outcome = error
    else:
        outcome = f"exit {launch.proc.returncode}"
    return {
        "budget": budget, "sequences_per_batch": per_batch, "batches_planned": planned_batches,
        "batches_committed": committed, "completed": completed,
        # Cut short at the time limit after at least one batch: what it measured counts.
        "measured": completed or (launch.cut and committed > 0), "outcome": outcome,
        "worker_exits": exits, "wall_s": launch.wall_s, "workers": rows,
    }


def dry_run(cmd):
    """Each role's planned host memory (bytes) from `launch --dry-run --json` with the same
    options; empty where this build has no dry run or refuses the launch."""
    try:
        out = subprocess.run(cmd + ["--dry-run", "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             timeout=120)
        plan = json.loads(out.stdout)["plan"]
    except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        return {}
    found = {}
    for role in ("target", "drafter"):
        value = plan.get(f"{role}_host")
        if value is None and isinstance(plan.get(role), dict):
            value = plan[role].get("total")
        if isinstance(value, (int, float)):
            found[role] = value
    return found


def fmt_gb(b):
    return "-" if not b else f"{b / GB:.2f}"


def fmt_tps(row):
    v = row["tokens_per_s"]
    if v is None:
        return "-"
    return ("≥ " if row.get("tokens_per_s_bound") else "") + f"{v:,.0f}"


def main(argv):
    try:
        args = parse_args(argv)
    except Usage as e:
        print(f"bench-scale: {e}", file=sys.stderr)
        print("Try 'scripts/bench-scale --help'.", file=sys.stderr)
        return 2
    root = args.root
    orch = os.path.join(root, "target", "release", "dflash-orch")
    if not args.no_build or not os.access(orch, os.X_OK):
        log("cargo build --release --bins")
        if subprocess.run(["cargo", "build", "--release", "--bins"], cwd=root).returncode != 0:
            log("the build failed")
            return 1

    def terminated(signum, frame):
        raise KeyboardInterrupt

    # SIGTERM stops the launch under way as Ctrl-C does (it runs in a session of its own).
    signal.signal(signal.SIGTERM, terminated)
    total = mem_total()
    if args.mem_cap is None:
        cap = int(min(0.4 * total, 16 * 2**30)) if total else 16 * 2**30
    else:
        cap = int(args.mem_cap * GB)
    prlimit = shutil.which("prlimit")
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="bench-scale.")
    results = {"settings": {k: v for k, v in vars(args).items() if k not in ("root", "json_out")},
               "mem_cap_bytes": cap or None, "runs": []}
    launch = None
    try:
        target = os.path.join(work, "target")
        shape = ["--hidden-size", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
                 "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
                 "--intermediate", str(args.intermediate), "--vocab", str(args.vocab)]
        run_checked([orch, "init-tiny", "--output", target, "--seed", str(args.seed)] + shape,
                    "init-tiny", os.path.join(work, "init-tiny.log"))
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
        results["target"] = {k: config[k] for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size")}
        print(f"target: Qwen3 (random weights) hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
              f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} kv heads of "
              f"{config['head_dim']}, intermediate {config['intermediate_size']}, vocab {config['vocab_size']}")
        print(f"drafter: {args.draft_layers} layer(s), block {args.block_size}, {args.num_anchors} anchors per "
              f"sequence; sequences of {args.max_len} tokens; {args.batches} batch(es) per budget; "
              f"--gpus {args.gpus} --topology 1:1 --engine {args.engine}"
              + "".join(f"; --{k.replace('_', '-')} {getattr(args, k)}"
                        for k in ("anchor_chunk", "dtype", "feature_dtype", "drafter_arch")
                        if getattr(args, k) is not None))
        print(f"limits: {args.launch_timeout:.0f} s per launch, {args.time_limit:.0f} s in all; memory cap "
              + (f"{cap / GB:.1f} GB per process ({'address space, prlimit --as, and ' if prlimit else ''}"
                 f"RSS watched every 0.25 s)" if cap else "none"), flush=True)
        rng = random.Random(args.seed)
        for budget in args.budgets:
            per_batch = budget // args.max_len
            sequences = per_batch * args.batches
            left = args.time_limit - (time.monotonic() - started)
            if left < 30:
                results["runs"].append({"budget": budget, "sequences_per_batch": per_batch,
                                        "batches_planned": args.batches, "batches_committed": 0,
                                        "completed": False, "measured": False,
                                        "outcome": "skipped: the time limit was reached",
                                        "worker_exits": [], "wall_s": 0.0, "workers": []})
                log(f"budget {budget}: skipped (time limit)")
                continue
            data = os.path.join(work, f"data-{budget}.jsonl")
            store = os.path.join(work, f"store-{budget}")
            write_dataset(data, sequences, args.max_len, args.vocab, rng)
            run_checked([orch, "prepare", "--input", data, "--output", store, "--vocab-size", str(args.vocab),
                         "--max-len", str(args.max_len)], "prepare", os.path.join(work, f"prepare-{budget}.log"))
            os.remove(data)
            run_dir = os.path.join(work, f"run-{budget}")
            deadline = min(args.launch_timeout, left - 15)
            cmd = [orch, "launch", "--stage", "dflash", "--gpus", args.gpus, "--topology", "1:1",
                   "--run-dir", run_dir, "--data", store, "--target-model", target,
                   "--max-len", str(args.max_len), "--token-budget", str(budget), "--mode", "sorted",
                   "--accum", "1", "--num-anchors", str(args.num_anchors), "--block-size", str(args.block_size),
                   "--draft-layers", str(args.draft_layers), "--epochs", "1", "--monitor-interval", "0.2",
                   "--max-restarts", "0", "--job-timeout", str(int(deadline) + 60), "--stop-grace", "10",
                   "--seed", str(args.seed)]
            for k in ("anchor_chunk", "dtype", "feature_dtype", "drafter_arch"):
                if getattr(args, k) is not None:
                    cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            cmd += ["--engine", args.engine] + (["--python", args.python] if args.python else [])
            planned = dry_run(cmd)
            if cap and prlimit:
                cmd = [prlimit, f"--as={cap}", "--"] + cmd
            log(f"budget {budget}: {sequences} sequences, {per_batch} per batch, up to {deadline:.0f} s")
            launch = Launch(cmd, run_dir, os.path.join(work, f"launch-{budget}.log"), deadline, cap, orch)
            launch.run()
            r = summarize(launch, budget, args.batches, per_batch, args.max_len)
            for row in r["workers"]:
                row["planned_bytes"] = planned.get(row["role"])
            launch = None
            results["runs"].append(r)
            log(f"budget {budget}: {r['outcome']} ({r['batches_committed']}/{r['batches_planned']} batches, "
                f"{r['wall_s']:.0f} s)")
            shutil.rmtree(store, ignore_errors=True)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    # The table.
    print()
    print("| budget | worker | role | peak RSS GB | planned GB | stage tokens/s | batches | outcome |")
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    for r in results["runs"]:
        rows = r["workers"] or [{"worker": "-", "role": "-", "peak_rss_bytes": None, "tokens_per_s": None}]
        for i, row in enumerate(rows):
            print(f"| {r['budget']} | {row['worker']} | {row['role']} | {fmt_gb(row['peak_rss_bytes'])} | "
                  f"{fmt_gb(row.get('planned_bytes'))} | {fmt_tps(row)} | {r['batches_committed']}/{r['batches_planned']} | "
                  f"{r['outcome'] if i == 0 else ''} |")
    # The goals.
    first, last = results["runs"][0], results["runs"][-1]
    goals = []
    ok = True
    print()
    for role in ("target", "drafter"):
        peaks = {r["budget"]: max((w["peak_rss_bytes"] or 0 for w in r["workers"] if w["role"] == role),
                                  default=0) for r in results["runs"]}
        lo, hi = peaks.get(first["budget"], 0), peaks.get(last["budget"], 0)
        ratio = hi / lo if lo and hi else None
        top = max(peaks.values(), default=0)
        measured = all(peaks.values()) and all(r["measured"] for r in results["runs"])
        passed = measured and ratio is not None and ratio <= args.goal_ratio and top < args.goal_peak_gb * GB
        ok = ok and passed
        goals.append({"role": role, "peak_ratio": ratio, "max_peak_bytes": top or None,
                      "all_budgets_measured": measured, "pass": passed})
        ratio_text = f"{ratio:.2f}" if ratio is not None else "-"
        print(f"{role}: peak({last['budget']}) / peak({first['budget']}) = {ratio_text} (goal <= {args.goal_ratio:g}); "
              f"largest peak {fmt_gb(top)} GB (goal < {args.goal_peak_gb:g} GB)"
              + ("" if measured else "; not every budget was measured")
              + ("; a run was cut at the time limit, its peak is over the batches it ran"
                 if measured and not all(r["completed"] for r in results["runs"]) else "")
              + f": {'PASS' if passed else 'FAIL'}")
    results["goals"] = goals
    results["pass"] = ok
    results["elapsed_s"] = time.monotonic() - started
    print(f"\n{'all goals met' if ok else 'a goal failed'} ({results['elapsed_s']:.0f} s)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
