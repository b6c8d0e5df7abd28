"""Where a unit of bench/speed.py spends its time: one torch.profiler run per unit.

    python bench/profile_units.py --dims paper --units stage2,inference --batch 8
    python bench/profile_units.py --dims paper --device cuda --batch 128 --trace-dir traces/

Builds the same worker as bench/speed.py (same model, images and calls), runs each unit once to
warm up, then once under ``torch.profiler``, and prints the operators by their own time (CPU
time on the CPU, CUDA kernel time on a GPU) with each one's share of the unit, plus the share
of the matrix products (``mm``/``addmm``/``bmm``/attention) — what is left is the room a fused,
compiled or lower-precision path can win. ``--trace-dir`` also writes Chrome traces
(chrome://tracing, Perfetto) to read the GPU's idle gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import DIMS, UNITS, Worker  # a sibling script, not a package

#: Operators that are matrix products (the work a device's peak is quoted for).
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product")


def _row(event, key: str, total: float) -> dict:
    own = getattr(event, key)
    return {
        "op": event.key,
        "ms": round(own / 1e3, 1),
        "share": round(own / total, 3),
        "calls": event.count,
    }


def profile_unit(worker: Worker, unit: str, trace_dir: Path | None, rows: int) -> dict:
    """One profiled run of ``unit``: its top operators by own time and the matmul share."""
    run, images = worker.units[unit]
    run()  # warm-up
    activities = [ProfilerActivity.CPU]
    cuda = worker.device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(worker.device)
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / f"{unit}.json"))
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = [e for e in prof.key_averages() if getattr(e, key) > 0]
    total = sum(getattr(e, key) for e in averages)
    averages.sort(key=lambda e: getattr(e, key), reverse=True)
    matmul = sum(getattr(e, key) for e in averages if e.key.startswith(MATMUL))
    return {
        "images": images,
        "self_time_ms": round(total / 1e3, 1),
        "matmul_share": round(matmul / total, 3) if total else 0.0,
        "top": [_row(e, key, total) for e in averages[:rows]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dims", default="paper", choices=DIMS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--units", default="stage2,inference", help=f"comma-separated: {UNITS}")
    parser.add_argument("--batch", type=int, default=8, help="images per batch (2 batches a unit)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rows", type=int, default=12, help="operators listed per unit")
    parser.add_argument("--trace-dir", type=Path, help="also write Chrome traces here")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    units = [u.strip() for u in args.units.split(",") if u.strip()]
    if unknown := [u for u in units if u not in UNITS or u == "mog_fit"]:
        parser.error(f"unknown or unprofiled units: {unknown}")
    worker = Worker(args.dims, args.device, args.threads, args.batch, seed=0)
    result = {
        "dims": args.dims,
        "device": args.device,
        "batch": args.batch,
        "threads": args.threads,
        "torch": torch.__version__,
        "load_1min": os.getloadavg()[0],
        "units": {},
    }
    for unit in units:  # each unit's table as soon as it is done (a paper-dims CPU run is slow)
        result["units"][unit] = profile_unit(worker, unit, args.trace_dir, args.rows)
        result["load_1min_end"] = os.getloadavg()[0]
        print(json.dumps({unit: result["units"][unit]}, indent=2), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
