"""Runtime benchmarks driven from outside the binaries; run by scripts/bench-runtime.

    bench_runtime.py restart --orch BIN --work DIR --out FILE [--kills 20] [--pause 1.2]
    bench_runtime.py cpu --orch BIN --work DIR --out FILE [--us-per-token 66.7] ...
    bench_runtime.py summary [--ring FILE] [--restart FILE] [--cpu FILE]

`restart` starts a synthetic `dflash-orch launch`, SIGKILLs one target worker at a time and times
how long the orchestrator takes to have a new process of that worker serving again (state ready or
busy), polling the run's status every few milliseconds. `cpu` starts a synthetic run paced to a
token rate and reads the orchestrator's CPU time from /proc over a window after warm-up. Both talk
to the run through its control socket (RUN_DIR/control.sock): the request `dflash-orch status
--json` sends, without starting a process per poll, so polls are cheap and a few ms apart. Each
run is stopped with `dflash-orch stop` at the end, or killed (with its workers) if it does not stop.
"""

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

SERVING = ("ready", "busy")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def percentile(values, p):
    """Nearest-rank percentile."""
    v = sorted(values)
    if not v:
        return float("nan")
    rank = max(1, math.ceil(p / 100.0 * len(v)))
    return v[min(rank, len(v)) - 1]


def median(values):
    v = sorted(values)
    if not v:
        return float("nan")
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


class Run:
    """A `dflash-orch launch` in the background, and the means to watch and end it."""

    def __init__(self, orch, run_dir, args):
        self.orch = orch
        self.run_dir = run_dir
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        self.log_path = run_dir + ".log"
        self.log_file = open(self.log_path, "wb")
        cmd = [orch, "launch", "--run-dir", run_dir, *args]
        log("  $ " + " ".join(cmd))
        # Its own session: a Ctrl-C at the terminal reaches this driver, which stops the run.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.socket = os.path.join(run_dir, "control.sock")
        self.journal = os.path.join(run_dir, "journal.jsonl")

    def request(self, cmd, timeout=10.0):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(self.socket)
            s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        finally:
            s.close()
        value = json.loads(buf)
        if "error" in value:
            raise RuntimeError(f"{cmd}: {value['error']}")
        return value

    def status(self):
        return self.request("status")

    def alive(self):
        return self.proc.poll() is None

    def check_alive(self):
        if not self.alive():
            raise RuntimeError(f"the run ended (exit {self.proc.returncode}); see "
                               f"{self.log_path}:\n{self.tail()}")

    def tail(self, lines=20):
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def commits(self):
        try:
            with open(self.journal, "rb") as f:
                return sum(1 for line in f if b'"event":"commit"' in line)
        except OSError:
            return 0

    def journal_events(self, event):
        out = []
        try:
            with open(self.journal, "rb") as f:
                for line in f:
                    if f'"event":"{event}"'.encode() in line:
                        out.append(json.loads(line))
        except OSError:
            pass
        return out

    def wait_commits(self, n=1, timeout=120.0):
        deadline = time.monotonic() + timeout
        while self.commits() < n:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no commit within {timeout:.0f} s; see {self.log_path}")
            time.sleep(0.05)

    def stop(self, timeout=20.0):
        """`dflash-orch stop`, then wait; kill the orchestrator (its workers die with it)."""
        if self.alive():
            subprocess.run([self.orch, "stop", "--run-dir", self.run_dir],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"  the run did not stop within {timeout:.0f} s: killing it")
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        # Segments of a run that did not end cleanly; a no-op otherwise.
        subprocess.run([self.orch, "clean", "--run-dir", self.run_dir],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        return self.proc.returncode


def proc_cpu_s(pid):
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_run_ns(pid):
    """Time on CPU of the process's live threads, in ns (/proc/PID/task/*/schedstat): finer than
    the clock ticks of /proc/PID/stat, but blind to threads that ended in between."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


# ------------------------------------------------------------------------------------------------


def bench_restart(a):
    run_dir = os.path.join(a.work, "restart-run")
    launch = ["--gpus", "cpu:3", "--synthetic", "200000", "--token-budget", "16384",
              "--max-len", "4096", "--epochs", "100", "--heartbeat-timeout", "5",
              "--max-restarts", "100", "--restart-window", "1",
              "--synthetic-us-per-token", "2"]
    run = Run(a.orch, run_dir, launch)
    result = {"kills": [], "launch": "dflash-orch launch --run-dir DIR " + " ".join(launch)}
    try:
        run.wait_commits(1)
        log(f"  committing; {a.kills} kills, one every >= {a.pause:.1f} s, polling every "
            f"{a.poll_ms:.0f} ms")
        last_kill = 0.0
        for k in range(a.kills):
            run.check_alive()
            wait = last_kill + a.pause - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            # The next target worker in turn, once it is serving.
            deadline = time.monotonic() + 30
            while True:
                st = run.status()
                targets = [w for w in st["workers"] if w["role"] == "target"]
                w = targets[k % len(targets)]
                if w["pid"] and w["state"] in SERVING:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {w['id']} not serving: {w}")
                time.sleep(0.05)
            wid, old = w["id"], w["pid"]
            t0 = time.monotonic()
            os.kill(old, signal.SIGKILL)
            last_kill = t0
            reaped = spawned = serving = None
            new_pid = None
            while serving is None:
                now = time.monotonic()
                if now - t0 > 10:
                    raise RuntimeError(f"worker {wid} not serving 10 s after SIGKILL")
                st = run.status()
                t = time.monotonic()
                w = next(x for x in st["workers"] if x["id"] == wid)
                if w["pid"] != old:
                    if reaped is None:
                        reaped = t
                    if w["pid"] is not None:
                        if spawned is None:
                            spawned, new_pid = t, w["pid"]
                        if w["state"] in SERVING:
                            serving = t
                time.sleep(a.poll_ms / 1000)
            kill = {
                "worker": wid, "old_pid": old, "new_pid": new_pid,
                "total_ms": (serving - t0) * 1e3,
                "reaped_ms": (reaped - t0) * 1e3,
                "spawned_ms": (spawned - t0) * 1e3,
            }
            result["kills"].append(kill)
            log(f"  kill {k + 1:>2}: worker {wid} pid {old} -> {new_pid}: serving after "
                f"{kill['total_ms']:.1f} ms (old pid gone from status {kill['reaped_ms']:.1f}, "
                f"new pid {kill['spawned_ms']:.1f})")
        st = run.status()
        result["committed_steps"] = st["run"]["committed_steps"]
        result["run_state"] = st["run"]["state"]
    finally:
        code = run.stop()
    result["exit_code"] = code
    # What the orchestrator logged as its backoff for each restart.
    with open(run.log_path, errors="replace") as f:
        backoffs = [int(m) for m in re.findall(r"restarting in (\d+) ms", f.read())]
    result["backoffs_ms"] = backoffs
    result["journal_worker_exits"] = len(run.journal_events("worker_exit"))
    totals = [k["total_ms"] for k in result["kills"]]
    result["summary"] = {
        "n": len(totals),
        "median_ms": median(totals),
        "p99_ms": percentile(totals, 99),
        "min_ms": min(totals),
        "max_ms": max(totals),
        "reaped_median_ms": median([k["reaped_ms"] for k in result["kills"]]),
        "spawned_median_ms": median([k["spawned_ms"] for k in result["kills"]]),
        "spawn_to_serving_median_ms": median(
            [k["total_ms"] - k["spawned_ms"] for k in result["kills"]]),
        "backoff_ms": median(backoffs) if backoffs else None,
        "poll_ms": a.poll_ms,
    }
    with open(a.out, "w") as f:
        json.dump(result, f)
    s = result["summary"]
    log(f"  restart: median {s['median_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms over {s['n']} "
        f"kills; backoff logged {backoffs[:3]}...; run exit code {code}")


# ------------------------------------------------------------------------------------------------


def bench_cpu(a):
    run_dir = os.path.join(a.work, "cpu-run")
    launch = ["--gpus", "cpu:3", "--synthetic", "200000", "--token-budget", str(a.token_budget),
              "--max-len", str(a.max_len), "--epochs", "100",
              "--synthetic-us-per-token", f"{a.us_per_token:g}"]
    run = Run(a.orch, run_dir, launch)
    result = {"launch": "dflash-orch launch --run-dir DIR " + " ".join(launch),
              "us_per_token": a.us_per_token,
              "expected_tokens_per_s": 2 * 1e6 / a.us_per_token}
    try:
        run.wait_commits(1)
        t_first = time.monotonic()
        log(f"  committing; warm-up {a.warmup:.0f} s, then a {a.window:.0f} s window")
        time.sleep(a.warmup)
        run.check_alive()
        pid = run.proc.pid
        st0 = run.status()
        workers = {w["id"]: w["pid"] for w in st0["workers"]}
        w_cpu0 = {i: proc_run_ns(p) for i, p in workers.items() if p}
        c0, n0, t0 = proc_cpu_s(pid), proc_run_ns(pid), time.monotonic()
        time.sleep(a.window)
        c1, n1, t1 = proc_cpu_s(pid), proc_run_ns(pid), time.monotonic()
        w_cpu1 = {i: proc_run_ns(p) for i, p in workers.items() if p}
        st1 = run.status()
        run.check_alive()
        tokens = lambda st: st["run"]["tokens_per_s"] * st["run"]["uptime_s"]
        window_tokens = tokens(st1) - tokens(st0)
        window_uptime = st1["run"]["uptime_s"] - st0["run"]["uptime_s"]
        same = all(w["pid"] == workers.get(w["id"]) for w in st1["workers"])
        result.update({
            "warmup_s": a.warmup,
            "window_s": t1 - t0,
            "since_first_commit_s": t1 - t_first,
            "orch_cpu_s": c1 - c0,
            "orch_cpu_pct": 100 * (c1 - c0) / (t1 - t0),
            "orch_cpu_pct_schedstat": 100 * (n1 - n0) / 1e9 / (t1 - t0),
            "orch_threads": len(os.listdir(f"/proc/{pid}/task")),
            "workers_cpu_pct": {str(i): 100 * (w_cpu1[i] - w_cpu0[i]) / 1e9 / (t1 - t0)
                                for i in w_cpu0},
            "workers_restarted": not same,
            "tokens_per_s_window": window_tokens / window_uptime,
            "tokens_per_s_run": st1["run"]["tokens_per_s"],
            "steps_window": st1["run"]["committed_steps"] - st0["run"]["committed_steps"],
            "uptime_s": st1["run"]["uptime_s"],
        })
    finally:
        result["exit_code"] = run.stop()
    with open(a.out, "w") as f:
        json.dump(result, f)
    log(f"  cpu: orchestrator {result['orch_cpu_pct']:.2f}% of one core (utime + stime; "
        f"{result['orch_cpu_pct_schedstat']:.2f}% by schedstat), workers "
        + ", ".join(f"{v:.2f}%" for v in result["workers_cpu_pct"].values())
        + f"; tokens/s over the window {result['tokens_per_s_window']:.0f}, whole run "
        f"{result['tokens_per_s_run']:.0f} (expected {result['expected_tokens_per_s']:.0f})")
    log(f"  cpu: {result['steps_window']} steps committed in the {result['window_s']:.1f} s "
        f"window; run exit code {result['exit_code']}")


# ------------------------------------------------------------------------------------------------


GOAL_RING_RATIO = 0.5
GOAL_RESTART_MS = 1000.0
GOAL_CPU_PCT = 5.0


def load(path):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def summary(a):
    ring, restart, cpu = load(a.ring), load(a.restart), load(a.cpu)
    rows = []  # (measure, result, goal, verdict)

    def verdict(ok):
        return "met" if ok else "MISSED"

    if ring:
        shape = f"{ring['rows']} x {ring['max_len']} tokens, {ring['slots']} slots in flight"
        for i, v in enumerate(ring["variants"]):
            goal = i == 0
            rows.append((
                f"ring handoff, {v['name']} ({shape})" if goal else f"ring handoff, {v['name']}",
                f"{v['gbs']:.2f} GB/s = {v['ratio']:.2f}x memcpy ({v['memcpy_gbs']:.1f} GB/s)",
                f">= {GOAL_RING_RATIO}x memcpy" if goal else "-",
                verdict(v["ratio"] >= GOAL_RING_RATIO) if goal else "-",
            ))
        if "shipping_over_idealised" in ring:
            rows.append(("ring handoff, shipping path / idealised copy (same batches, same run)",
                         f"{ring['shipping_over_idealised']:.2f}", "-", "-"))
        rows.append(("memcpy, destinations past the caches (context)",
                     f"{ring['memcpy_cold_gbs']:.2f} GB/s", "-", "-"))
        r = ring["rtt_us"]
        rows.append((f"descriptor round trip, ipc-channel (n = {r['n']})",
                     f"median {r['median']:.1f} us, p99 {r['p99']:.1f} us", "-", "-"))
    if restart:
        s = restart["summary"]
        backoff = s["backoff_ms"]
        rows.append((
            f"worker restart after SIGKILL (n = {s['n']})",
            f"median {s['median_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms",
            f"median < {GOAL_RESTART_MS:.0f} ms",
            verdict(s["median_ms"] < GOAL_RESTART_MS),
        ))
        rows.append((
            "  of which: deliberate backoff",
            f"{backoff:.0f} ms" if backoff is not None else "not logged",
            "-", "-",
        ))
        rows.append((
            "  kill -> old pid gone / new pid / serving (medians)",
            f"{s['reaped_median_ms']:.0f} / {s['spawned_median_ms']:.0f} / "
            f"{s['median_ms']:.0f} ms", "-", "-",
        ))
    if cpu:
        rows.append((
            f"orchestrator CPU, synthetic run (cpu:3, {cpu['us_per_token']:g} us/token)",
            f"{cpu['orch_cpu_pct']:.2f}% of one core ({cpu['orch_cpu_pct_schedstat']:.2f}% by "
            f"schedstat) over {cpu['window_s']:.0f} s at {cpu['tokens_per_s_window']:,.0f} "
            f"tokens/s (run average {cpu['tokens_per_s_run']:,.0f})",
            f"< {GOAL_CPU_PCT:.0f}% of one core",
            verdict(cpu["orch_cpu_pct"] < GOAL_CPU_PCT),
        ))
    if not rows:
        log("summary: no results")
        return 1

    heads = ("measure", "result", "goal", "")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    print()
    print(line(heads))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))
    print()
    print("| measure | result | goal | |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(c.strip() if c != "-" else "" for c in r) + " |")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restart")
    r.add_argument("--orch", required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--kills", type=int, default=20)
    r.add_argument("--pause", type=float, default=1.2)
    r.add_argument("--poll-ms", type=float, default=5.0)
    c = sub.add_parser("cpu")
    c.add_argument("--orch", required=True)
    c.add_argument("--work", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--us-per-token", type=float, default=66.7)
    c.add_argument("--token-budget", type=int, default=16384)
    c.add_argument("--max-len", type=int, default=4096)
    c.add_argument("--warmup", type=float, default=5.0)
    c.add_argument("--window", type=float, default=10.0)
    s = sub.add_parser("summary")
    s.add_argument("--ring")
    s.add_argument("--restart")
    s.add_argument("--cpu")
    a = p.parse_args()
    if a.cmd == "restart":
        bench_restart(a)
    elif a.cmd == "cpu":
        bench_cpu(a)
    else:
        return summary(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
