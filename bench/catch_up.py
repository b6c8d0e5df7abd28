"""A site joining late: the catch-up's traffic and time at the paper's dims (issue 34, part 1).

For a federation of C paper-dims classes (random tensors: float bytes do not compress), what a
site that holds nothing receives before its first phase: the codebook in parts of at most
``parts.PART_BYTES`` (``starfed.server.catch_up``). Measured without Flower, both ends in one
process, each size in a fresh one so its peak RSS is its own: the server's plan and the
encoding of every part, one at a time; the site's staging of each part (decoded, written) and
the assembly after the last (decoded again, held: written as one file). Bytes and messages are
what the wire would carry, the phase message's empty delta left out.

    python bench/catch_up.py                        # 100, 1000, 10000 classes, float32
    python bench/catch_up.py --classes 100 1000 --dtype float16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from codebook_sizes import PAPER

from starfed.server import catch_up
from starfed.shared.codebook import parts, schema
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.held import HeldCodebook
from starfed.shared.codebook.lineage import Lineage

FINGERPRINT = "ab" * 32
LINE = Lineage("bench", "epoch-1")


def federation(n_classes: int) -> Codebook:
    """A codebook of ``n_classes`` paper-dims classes with every field sites read."""
    generator = torch.Generator().manual_seed(0)
    entries = [
        ClassEntry(f"class_{i:05d}", 100, {
            f.name: torch.randn(f.shape(PAPER), generator=generator)
            for f in schema.FIELDS if f.broadcast
        })
        for i in range(n_classes)
    ]  # fmt: skip
    return Codebook(FINGERPRINT, PAPER, {}, 0, LINE.as_metadata()).register(entries)


def one(n_classes: int, dtype: str) -> dict[str, object]:
    codebook = federation(n_classes)
    late = catch_up.behind(codebook, {}, [1], dtype)
    t0 = time.perf_counter()
    plan = parts.plan(codebook, dtype)
    encode_s = stage_s = 0.0
    sent = 0
    with tempfile.TemporaryDirectory() as tmp:
        held = HeldCodebook(Path(tmp) / "codebook.bin", fingerprint=FINGERPRINT, dims=PAPER)
        for index in range(len(plan.parts)):
            t0 = time.perf_counter()
            data = plan.encoded(index)
            t1 = time.perf_counter()
            held.stage(data, index, len(plan.parts), len(codebook))
            encode_s += t1 - t0
            stage_s += time.perf_counter() - t1
            sent += len(data)
            del data
        assert held.version_for(LINE) == codebook.version
    return {
        "classes": n_classes, "dtype": dtype, "behind": late == [1], "messages": len(plan.parts),
        "bytes": sent, "largest_part_limit": parts.PART_BYTES,
        "server_encode_s": round(encode_s, 2), "site_stage_and_hold_s": round(stage_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.classes[0], args.dtype)))
        return
    rows = []
    for n in args.classes:
        out = subprocess.run(
            [sys.executable, __file__, "--one", "--classes", str(n), "--dtype", args.dtype],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        rows.append(json.loads(out))
        print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()[0]
    print(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "load_1min": load}))


if __name__ == "__main__":
    main()
