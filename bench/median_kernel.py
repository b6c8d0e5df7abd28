"""The median's kernel against a copy, and a selection compiled with it (not adopted).

``server.robust.SiteStack`` gathers each cache-sized block of a field's values straight from the
rows with a loop numba compiles (``_gather_block``: sites on the block's last axis) and selects
the middle value there with numpy's partition. Issue 48 also asked whether one compiled loop
that gathers and selects in place does better. This measures, interleaved, on one class's
stage-2 rows at the paper's dims (the fields ``merge_scale.py`` merges), the CPU time of:

- ``copy``: each row's bytes copied once (``merge_floor.median_parts``'s copy);
- ``site_stack``: ``SiteStack.median`` (the merge);
- ``fused``: one compiled loop, ``LANES`` coordinates at a time: their values from every row
  into a [16, sites] scratch (``_gather_block``), each coordinate's middle value selected there
  by a branch-free three-way quickselect (out of place, two buffers; a heap selection after
  2·log₂(sites) rounds bounds the worst case an attacker could aim at).

Both are first checked against ``torch.median(dim=0)`` on ties, signed zeros and infinities
(equal values; a signed zero's sign where ``0.0`` and ``-0.0`` meet at the middle is printed
when it differs from torch's). ``--jit`` times the first median in a fresh process with an
empty numba cache folder (compilation) and in a second one (the cache).

    python bench/median_kernel.py                   # 10, 100, 1000 sites, median of 5 runs
    python bench/median_kernel.py --jit
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import numba
import numpy as np
import torch
from codebook_sizes import PAPER, parse_dims
from merge_floor import interleaved

from starfed.server.robust import LANES, SiteStack, _gather_block
from starfed.shared.codebook import schema
from starfed.shared.protocol import Phase

SMALL = 24  # a range this short is sorted by insertion


@numba.njit(cache=True, nogil=True)
def _sift_down(a, i, size):
    value = a[i]
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and a[child] < a[child + 1]:
            child += 1
        if not value < a[child]:
            break
        a[i] = a[child]
        i = child
    a[i] = value


@numba.njit(cache=True, nogil=True)
def _heap_select(a, k):
    """The k-th smallest of ``a`` in O(n log k) whatever the values: a max-heap of k + 1."""
    size = k + 1
    for top in range(size // 2 - 1, -1, -1):
        _sift_down(a, top, size)
    for i in range(size, a.size):
        if a[i] < a[0]:
            a[0] = a[i]
            _sift_down(a, 0, size)
    return a[0]


@numba.njit(cache=True, nogil=True)
def _select(a, spare, k):
    """The k-th smallest of ``a`` (``a`` and ``spare``, as long, are overwritten)."""
    n, lo, rounds = a.size, 0, 2 * int(math.log2(a.size) + 1)
    source, target = a, spare
    while n > SMALL:
        if rounds == 0:
            return _heap_select(source[lo : lo + n], k)
        rounds -= 1
        x, y, z = source[lo], source[lo + n // 2], source[lo + n - 1]
        if y < x:
            x, y = y, x
        pivot = max(x, min(y, z))  # the median of the three
        less = greater = 0
        for i in range(lo, lo + n):  # branch-free: each value written to both ends
            value = source[i]
            target[less] = value
            target[n - 1 - greater] = value
            less += value < pivot
            greater += pivot < value
        if k < less:
            lo, n = 0, less
        elif k >= n - greater:
            k, lo, n = k - (n - greater), n - greater, greater
        else:
            return pivot
        source, target = target, source
    rest = source[lo : lo + n]
    for i in range(1, n):
        value, j = rest[i], i - 1
        while j >= 0 and value < rest[j]:
            rest[j + 1] = rest[j]
            j -= 1
        rest[j + 1] = value
    return rest[k]


@numba.njit(cache=True, nogil=True)
def fused_medians(addresses, out):
    """``out[c]`` = the lower median over the rows of coordinate ``c``."""
    sites, coordinates = addresses.size, out.size
    middle = (sites - 1) // 2
    block = np.empty((LANES, sites), out.dtype)
    spare = np.empty(sites, out.dtype)
    for start in range(0, coordinates, LANES):
        width = min(LANES, coordinates - start)
        _gather_block(addresses, start, block[:width], out)
        for c in range(width):
            out[start + c] = _select(block[c], spare, middle)


def fused(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.empty(rows[0].shape, dtype=rows[0].dtype)
    addresses = np.array([row.data_ptr() for row in rows], dtype=np.int64)
    fused_medians(addresses, out.numpy().reshape(-1))
    return out


def check(medians: dict) -> None:
    """Each candidate bit for bit against ``torch.median(dim=0)``, rows left as they were."""
    generator = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf])
    for sites, shape in [
        (7, (3, 4)),
        (4, (5,)),
        (130, (2, 2_600)),
        (1000, (40,)),
        (3, ()),
        (1, (2,)),
    ]:
        rows = [torch.randn(shape, generator=generator) for _ in range(sites)]
        rows += [rows[0].clone()] * (sites // 3)  # ties
        rows += [
            special[torch.randint(0, 4, shape, generator=generator)] for _ in range(sites // 2)
        ]
        before = [row.clone() for row in rows]
        expected = torch.stack(rows).median(dim=0).values
        for name, median in medians.items():
            got = median(rows)
            assert torch.equal(got, expected), (name, sites, shape)
            signs = torch.equal(got.signbit(), expected.signbit())
            if not signs:
                print(f"# {name}, {sites} sites: a signed zero differs from torch's (equal)")
        for row, kept in zip(rows, before, strict=True):
            assert row.view(torch.int32).equal(kept.view(torch.int32))


def timings(sites: int, dims, runs: int) -> dict[str, float]:
    """CPU seconds (median of ``runs``, interleaved) of each candidate on every stage-2 field of
    one class."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    fields = [
        [torch.randn(schema.BY_NAME[name].shape(dims), generator=generator) for _ in range(sites)]
        for name in schema.trained_in(Phase.STAGE2)
    ]
    stack = SiteStack()

    def copy() -> None:
        for rows in fields:
            for row in rows:
                bytearray(row.numpy().reshape(-1).view(np.uint8))

    parts = {
        "copy": copy,
        "site_stack": lambda: [stack.median(rows) for rows in fields],
        "fused": lambda: [fused(rows) for rows in fields],
    }
    values = sum(len(rows) * rows[0].numel() for rows in fields)
    return interleaved(parts, runs) | {"values": values}


def first_call() -> None:
    """In this (fresh) process: import, then the first call of each kernel, timed."""
    rows = [torch.randn(100) for _ in range(5)]
    started = time.perf_counter()
    SiteStack().median(rows)
    fused(rows)
    print(f"{time.perf_counter() - started:.2f}")


def jit(cache: str) -> float:
    environment = os.environ | {"NUMBA_CACHE_DIR": cache}
    command = [sys.executable, __file__, "--first-call"]
    done = subprocess.run(command, env=environment, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="10,100,1000", help="comma-separated site counts")
    parser.add_argument("--dims", type=parse_dims, default=PAPER, help="d_txt,d_clip,d_vit,L")
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs (median)")
    parser.add_argument("--jit", action="store_true", help="compile and cached-load times")
    parser.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_call:
        first_call()
        return
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if args.jit:
        with tempfile.TemporaryDirectory() as cache:
            compiled, cached = jit(cache), jit(cache)
        print(f"# {machine}, load {os.getloadavg()[0]:.1f}; numba {numba.__version__}")
        print(f"first call, empty cache: {compiled:.2f} s; with the cache: {cached:.2f} s")
        return
    check({"site_stack": SiteStack().median, "fused": fused})
    print(f"# {machine}, load {os.getloadavg()[0]:.1f}; CPU ms, median of {args.runs} runs")
    print("| sites | MB | copy | site_stack | fused | ÷ copy (same order) |")
    print("|---|---|---|---|---|---|")
    for sites in (int(n) for n in args.sites.split(",")):
        t = timings(sites, args.dims, args.runs)
        ratios = " / ".join(f"{t[name] / t['copy']:.1f}" for name in ("site_stack", "fused"))
        print(
            f"| {sites} | {t['values'] * 4 / 2**20:.0f} | {t['copy'] * 1e3:.1f} | "
            f"{t['site_stack'] * 1e3:.1f} | {t['fused'] * 1e3:.1f} | {ratios} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
