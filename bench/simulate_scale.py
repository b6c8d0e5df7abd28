"""Many sites on one machine: wall time, CPU time, memory of the whole process tree over time,
bytes per site.

Runs ``starfed simulate`` (SuperLink, Ray, the ServerApp, the simulated sites; or with
``-- --runtime local`` all in one process) and samples the memory of every process below it
twice a second: the peak of the summed PSS (shared pages counted once, split between their
users) and of the summed RSS, and one sample every ``--trace-s`` seconds (is it flat?). CPU
seconds are the finished command's and its children's, user and system: on a shared machine
they say more than the wall time, which the other processes' load stretches. Afterwards it
reads the run's ``metrics.json``: bytes per site (``traffic``), seconds per phase of each step,
and the sync phases after the first (the sites only list their classes: what a message costs).

    python bench/simulate_scale.py --sites 100 --tasks 7 --results-dir /tmp/scale
    python bench/simulate_scale.py --sites 100 --tasks 2 -- --epochs 1   # passed to simulate
    python bench/simulate_scale.py --sites 10000 --tasks 2 -- --runtime local --fraction-train 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

SAMPLE_S = 0.5


def children(pid: int) -> list[int]:
    """The processes ``pid``'s threads started: the kernel's list, not a scan of all /proc
    (0.1 against 2.9 ms a sample with 200 processes; reading one process's ``smaps_rollup``,
    ≈ 12 ms at 700 MB, stays the sampler's main cost, outside the run's CPU seconds)."""
    found = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as listed:
                found.extend(int(child) for child in listed.read().split())
        except OSError:
            continue
    return found


def tree_memory_mb(root: int) -> tuple[float, float, int]:
    """Summed PSS and RSS (MB) of ``root`` and every process below it, and their number."""
    pending, pss, rss, count = [root], 0, 0, 0
    while pending:
        pid = pending.pop()
        pending.extend(children(pid))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                fields = dict(line.split(":", 1) for line in rollup if ":" in line)
        except OSError:
            continue
        pss += int(fields.get("Pss", "0 kB").split()[0])
        rss += int(fields.get("Rss", "0 kB").split()[0])
        count += 1
    return pss / 1024, rss / 1024, count


def summary(run_dir: Path, wall_s: float, cpu_s: float, peak: dict, trace: list) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    sites = metrics["sites"]
    down = sum(s["bytes_down"] for t in metrics["traffic"] for s in t["sites"].values())
    up = sum(s["bytes_up"] for t in metrics["traffic"] for s in t["sites"].values())
    phases: dict[str, float] = defaultdict(float)
    per_step: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for p in metrics["phase_wall_time_s"]:
        phases[p["phase"]] += p["seconds"]
        per_step[p["step"]][p["phase"]] += p["seconds"]
    later_syncs = [
        p["seconds"] for p in metrics["phase_wall_time_s"] if p["phase"] == "sync" and p["step"] > 0
    ]
    return {
        "status": metrics["status"],
        "steps": metrics["steps"],
        "sites": len(sites),
        "faa": metrics["final_average_accuracy"],
        "wall_s": round(wall_s, 1),
        "cpu_s": round(cpu_s, 1),
        "server_s": round(metrics["wall_time_s"], 1),
        "peak_pss_mb": round(peak["pss"]),
        "peak_rss_mb": round(peak["rss"]),
        "peak_processes": peak["processes"],
        "kb_down_per_site": round(down / len(sites) / 1e3, 1),
        "kb_up_per_site": round(up / len(sites) / 1e3, 1),
        "phase_s": {k: round(v, 1) for k, v in phases.items()},
        "phase_s_by_step": {
            step: {k: round(v, 1) for k, v in step_phases.items()}
            for step, step_phases in per_step.items()
        },
        "later_sync_s_median": round(statistics.median(later_syncs), 2) if later_syncs else None,
        "load_start_end": [trace[0]["load"], trace[-1]["load"]] if trace else None,
        "memory_trace": trace,
    }


def load_average() -> float:
    with open("/proc/loadavg") as loadavg:
        return float(loadavg.read().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=100)
    parser.add_argument("--tasks", type=int, default=7)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--results-dir", type=Path, default=Path("/tmp/starfed-scale"))
    parser.add_argument("--run-name", default="")
    parser.add_argument("--trace-s", type=float, default=30.0, help="seconds between samples kept")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("extra", nargs="*", help="after --: more `starfed simulate` options")
    args = parser.parse_args()
    name = args.run_name or f"s{args.sites}-t{args.tasks}-a{args.alpha}"
    command = [
        sys.executable,
        "-m",
        "starfed.cli",
        "simulate",
        "--sites",
        str(args.sites),
        "--tasks",
        str(args.tasks),
        "--alpha",
        str(args.alpha),
        "--results-dir",
        str(args.results_dir),
        "--run-name",
        name,
        *args.extra,
    ]
    start = time.perf_counter()
    process = subprocess.Popen(command)
    peak = {"pss": 0.0, "rss": 0.0, "processes": 0}
    trace: list[dict] = []
    while process.poll() is None:
        pss, rss, count = tree_memory_mb(process.pid)
        if pss > peak["pss"]:
            peak.update(pss=pss, rss=rss, processes=count)
        elapsed = time.perf_counter() - start
        if not trace or elapsed - trace[-1]["t_s"] >= args.trace_s:
            trace.append(
                {
                    "t_s": round(elapsed),
                    "pss_mb": round(pss),
                    "rss_mb": round(rss),
                    "load": load_average(),
                }
            )
            print(f"memory {json.dumps(trace[-1])}", file=sys.stderr, flush=True)  # if cut short
        time.sleep(SAMPLE_S)
    wall = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode not in (0, 3):  # 3: degraded, still a finished run
        sys.exit(f"starfed simulate exited with {process.returncode}")
    cpu = children.ru_utime + children.ru_stime
    result = summary(args.results_dir / name, wall, cpu, peak, trace)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
