"""The topology benchmark, run by scripts/bench-topology.

    bench_topology.py --orch BIN --work DIR [--gpus cpu:8] [--samples 2000] [--json FILE]
                      [--case TARGET_US/DRAFTER_US ...]

For each case (microseconds per token of a target and of a drafter on the synthetic stage) it
runs the same synthetic epoch twice, once with `--topology auto` and once with all but one worker
as targets, and reads from each run what it measured (the launch's closing line: tokens this
session over its wall time) and, from the auto run's journal, what the topology predicted (its
micro-batches a second against all but one's). It prints the measured ratio beside the predicted
one; the goal is that they agree within 20 %.
"""

import argparse
import json
import os
import re
import subprocess
import sys

DONE = re.compile(r"run completed: .* tokens this session in ([0-9.]+) s \(([0-9]+) tokens/s\)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def case(text: str) -> tuple[float, float]:
    try:
        t, d = (float(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TARGET_US/DRAFTER_US, e.g. 2/6, got {text!r}")
    if not (0 < t <= 1e6 and 0 < d <= 1e6):
        raise argparse.ArgumentTypeError(f"costs must be in (0, 1e6] microseconds, got {text!r}")
    return t, d


def run(orch: str, run_dir: str, gpus: str, samples: int, costs: tuple[float, float],
        topology: str) -> tuple[float, dict]:
    """One synthetic epoch to completion: its tokens/s and the journal's topology."""
    cmd = [orch, "launch", "--run-dir", run_dir, "--gpus", gpus, "--synthetic", str(samples),
           "--epochs", "1", "--synthetic-us-per-token", str(costs[0]),
           "--synthetic-drafter-us-per-token", str(costs[1]), "--topology", topology]
    log("  $ " + " ".join(cmd))
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        sys.exit(f"bench-topology: the launch failed ({out.returncode}):\n{out.stderr[-4000:]}")
    found = DONE.search(out.stderr + out.stdout)
    if not found:
        sys.exit(f"bench-topology: no closing line in the launch's output:\n{out.stderr[-4000:]}")
    with open(os.path.join(run_dir, "journal.jsonl")) as f:
        first = json.loads(f.readline())
    return float(found.group(2)), first["topology"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--orch", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--gpus", default="cpu:8")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--case", type=case, action="append", dest="cases")
    p.add_argument("--json")
    a = p.parse_args()
    if a.samples < 1:
        p.error("--samples must be at least 1")
    cases = a.cases or [(2.0, 6.0), (4.0, 2.0), (2.0, 0.25)]
    rows = []
    for i, costs in enumerate(cases):
        log(f"== case {i + 1}: a target {costs[0]} us/token, a drafter {costs[1]} us/token")
        auto_rate, choice = run(a.orch, os.path.join(a.work, f"{i}-auto"), a.gpus, a.samples,
                                costs, "auto")
        workers = choice["targets"] + choice["drafters"]
        base = f"{workers - 1}:1"
        base_rate, _ = run(a.orch, os.path.join(a.work, f"{i}-base"), a.gpus, a.samples, costs,
                           base)
        predicted = choice["rate"] / choice["rate_all_but_one"]
        measured = auto_rate / base_rate
        rows.append({
            "target_us": costs[0], "drafter_us": costs[1],
            "auto": f"{choice['targets']}:{choice['drafters']}", "all_but_one": base,
            "auto_tokens_per_s": auto_rate, "all_but_one_tokens_per_s": base_rate,
            "predicted_ratio": predicted, "measured_ratio": measured,
            "agreement": measured / predicted,
        })
    head = ("| target µs/tok | drafter µs/tok | auto | tokens/s auto | tokens/s all but one "
            "| measured ratio | predicted ratio | measured / predicted |")
    print(head)
    print("|" + "---:|" * 8)
    ok = True
    for r in rows:
        good = abs(r["agreement"] - 1) <= 0.2
        ok &= good
        print(f"| {r['target_us']:g} | {r['drafter_us']:g} | {r['auto']} "
              f"| {r['auto_tokens_per_s']:,.0f} | {r['all_but_one_tokens_per_s']:,.0f} "
              f"({r['all_but_one']}) | {r['measured_ratio']:.2f}x | {r['predicted_ratio']:.2f}x "
              f"| {r['agreement']:.2f}{'' if good else ' (outside 20 %)'} |")
    print(f"\ngoal (measured within 20 % of predicted): {'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
