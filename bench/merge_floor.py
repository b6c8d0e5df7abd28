"""The floor of the stage-2 merge if each update held one array per field (a packed layout).

starfed's updates carry one tensor per class and field (``proto/codebook.proto``), and at the
paper's dims the merge's time is per tensor, not per byte (docs/benchmarks.md, "Server merge at
scale"). This asks what the same work costs without that: each site's reply is one buffer of
four [C, ...] float32 arrays (Q, A, head weight and bias, the classes in the codebook's order);
its "decode" is a view of each array and its finiteness check, its "screen" each row's
‖value − sent‖ (one subtraction into a reused buffer, one norm per field), its "merge" a
float64 ``addcmul_`` of count × rows into the sums. No protobuf, no validation of shapes or
names, no Python per class: a lower bound on what a packed wire layout could reach with torch
and numpy, against the same copy ``merge_scale.py`` measures, in the same process.

    python bench/merge_floor.py                     # 1000 sites × 35 classes, 1 and 2 threads
    python bench/merge_floor.py --sites 100 --threads 1

``--median`` asks the same of the median merge (``server.robust.SiteStack``), one thread, by
part, on one class's stage-2 rows from every site (sites × 18,433 values at the paper's dims):
the compiled gather of cache-sized blocks from the rows (sites on the last axis) and numpy's
partition in them, each against a copy of the same bytes — the selection alone is the floor of
any merge that selects with numpy — and, for comparison, what the gather replaced: the stack of
the rows and the numpy transposition of its blocks, 64 sites at a time.

    python bench/merge_floor.py --median            # 1000 sites, median of 5 interleaved runs
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from codebook_sizes import PAPER, parse_dims

from starfed.server.robust import BLOCK_BYTES, SiteStack, _gather_block
from starfed.shared.codebook import schema
from starfed.shared.protocol import Phase

SITES_AT_ONCE = 64  # the numpy transposition's groups of sites, before the compiled gather


def packed_replies(sites: int, shapes: dict, generator: torch.Generator) -> list[bytes]:
    """One buffer per site: each field's rows for every class, field after field."""

    def reply() -> bytes:
        return b"".join(
            torch.randn(s, generator=generator).numpy().tobytes() for s in shapes.values()
        )

    return [reply() for _ in range(sites)]


def copy_once(replies: list[bytes]) -> float:
    """Seconds to copy each reply into a new buffer once (as ``merge_scale.copy_once``)."""
    started = time.perf_counter()
    for data in replies:
        copy = bytearray(data)
        del copy
    return time.perf_counter() - started


def merge(replies: list[bytes], shapes: dict, sent: dict, counts: torch.Tensor) -> dict:
    """Seconds of decode, screen and merge over ``replies``, the three passes as the coordinator
    makes them: views and changes of every reply first, then the sums."""
    scratch = {name: torch.empty(shape) for name, shape in shapes.items()}
    sums = {name: torch.zeros(shape, dtype=torch.float64) for name, shape in shapes.items()}
    wall = dict.fromkeys(("decode", "screen", "merge"), 0.0)
    decoded = []
    for data in replies:
        started = time.perf_counter()
        whole, offset, arrays = np.frombuffer(data, dtype=np.float32), 0, {}
        for name, shape in shapes.items():
            size = math.prod(shape)
            array = whole[offset : offset + size].reshape(shape)
            offset += size
            if not np.isfinite(array).all():
                raise ValueError(f"{name}: not finite")
            arrays[name] = torch.from_numpy(array)
        measured = time.perf_counter()
        for name, rows in arrays.items():
            torch.sub(rows, sent[name], out=scratch[name])
            torch.linalg.vector_norm(scratch[name].reshape(len(rows), -1), dim=1)
        wall["decode"] += measured - started
        wall["screen"] += time.perf_counter() - measured
        decoded.append(arrays)
    started = time.perf_counter()
    for site, arrays in enumerate(decoded):
        for name, rows in arrays.items():
            weights = counts[site].view(-1, *[1] * (rows.dim() - 1))
            sums[name].addcmul_(rows, weights)
    wall["merge"] = time.perf_counter() - started
    return wall


def interleaved(parts: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """The CPU seconds of each part, the median of ``runs`` in which the parts take turns (each
    under the same load)."""
    seconds: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(runs):
        for name, work in parts.items():
            started = time.process_time()
            work()
            seconds[name].append(time.process_time() - started)
    return {name: statistics.median(times) for name, times in seconds.items()}


def median_parts(rows: list[torch.Tensor], runs: int) -> dict[str, float]:
    """CPU seconds (median of ``runs``, the parts interleaved) of one field's median by part:
    ``copy`` (each row's bytes once), ``gather`` (``SiteStack``'s: blocks from the rows, sites
    last), ``stack`` and ``transpose`` (the stack's blocks, sites last: what the gather
    replaced), ``select`` (numpy's partition of each block, in cache: a copy of the block into a
    cache-sized buffer and its partition, less that copy) and ``site_stack``
    (``SiteStack.median``)."""
    sites, coordinates = len(rows), rows[0].numel()
    width = max(1, min(coordinates, BLOCK_BYTES // (sites * 4)))
    stacked = torch.stack([row.reshape(-1) for row in rows]).numpy()
    transposed = np.ascontiguousarray(stacked.T)
    block = np.empty((width, sites), np.float32)
    middle, stack = (sites - 1) // 2, SiteStack()
    into = torch.empty(sites, coordinates)  # reused, as SiteStack's

    def copy() -> None:
        for row in rows:
            bytearray(row.numpy().reshape(-1).view(np.uint8))

    addresses = np.array([row.data_ptr() for row in rows], dtype=np.int64)

    def gather() -> None:
        for start in range(0, coordinates, width):
            _gather_block(addresses, start, block[: min(width, coordinates - start)], block)

    def transpose() -> None:
        for start in range(0, coordinates, width):
            part = block[: min(width, coordinates - start)]
            for first in range(0, sites, SITES_AT_ONCE):
                part[:, first : first + SITES_AT_ONCE] = stacked[
                    first : first + SITES_AT_ONCE, start : start + width
                ].T

    def blocks(select: bool) -> None:
        for start in range(0, coordinates, width):
            part = block[: min(width, coordinates - start)]
            np.copyto(part, transposed[start : start + width])
            if select:
                part.partition(middle, axis=1)

    parts = {
        "copy": copy,
        "gather": gather,
        "stack": lambda: torch.stack([row.reshape(-1) for row in rows], out=into),
        "transpose": transpose,
        "block_copy": lambda: blocks(select=False),
        "block_select": lambda: blocks(select=True),
        "site_stack": lambda: stack.median(rows),
    }
    out = interleaved(parts, runs)
    out["select"] = out.pop("block_select") - out.pop("block_copy")
    return out


def median_floor(sites: int, dims, runs: int) -> None:
    """``median_parts`` of each stage-2 field of one class, summed, against the copy."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    totals: dict[str, float] = {}
    values = 0
    for name in schema.trained_in(Phase.STAGE2):
        shape = schema.BY_NAME[name].shape(dims)
        rows = [torch.randn(shape, generator=generator) for _ in range(sites)]
        values += sites * math.prod(shape)
        for part, seconds in median_parts(rows, runs).items():
            totals[part] = totals.get(part, 0.0) + seconds
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}; {sites} sites × one class's stage-2 rows, "
        f"{values * 4 / 2**20:.0f} MB; CPU ms, median of {runs} interleaved runs"
    )
    print("| part | CPU ms | ns a value | ÷ copy |")
    print("|---|---|---|---|")
    for part in ("copy", "gather", "stack", "transpose", "select", "site_stack"):
        seconds = totals[part]
        print(
            f"| {part} | {seconds * 1e3:.1f} | {seconds * 1e9 / values:.2f} | "
            f"{seconds / totals['copy']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=35, help="classes every site carries")
    parser.add_argument("--dims", type=parse_dims, default=PAPER, help="d_txt,d_clip,d_vit,L")
    parser.add_argument("--threads", default="1,2", help="torch intra-op threads to try")
    parser.add_argument("--median", action="store_true", help="the median's parts, one thread")
    parser.add_argument("--runs", type=int, default=5, help="--median: interleaved runs")
    args = parser.parse_args()
    if args.median:
        median_floor(args.sites, args.dims, args.runs)
        return
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    shapes = {
        name: (args.classes, *schema.BY_NAME[name].shape(args.dims))
        for name in schema.trained_in(Phase.STAGE2)
    }
    generator = torch.Generator().manual_seed(0)
    sent = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    counts = torch.randint(1, 200, (args.sites, args.classes), generator=generator).double()
    replies = packed_replies(args.sites, shapes, generator)
    megabytes = sum(map(len, replies)) / 2**20
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}; {args.sites} sites × {args.classes} classes, "
        f"{megabytes:.0f} MB"
    )
    print("| threads | decode s | screen s | merge s | total s | copy s | total ÷ copy |")
    print("|---|---|---|---|---|---|---|")
    for threads in (int(n) for n in args.threads.split(",")):
        torch.set_num_threads(threads)
        copy = copy_once(replies)
        wall = merge(replies, shapes, sent, counts)
        total = sum(wall.values())
        print(
            f"| {threads} | {wall['decode']:.3f} | {wall['screen']:.3f} | {wall['merge']:.3f} "
            f"| {total:.3f} | {copy:.3f} | {total / copy:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
