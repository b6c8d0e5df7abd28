"""A site joining late: the catch-up's traffic and time at the paper's dims (issue 34, part 1).

For a federation of C paper-dims classes (random tensors: float bytes do not compress), what a
site that holds nothing receives before its first phase: the codebook in parts of at most
``parts.PART_BYTES`` (``starfed.server.catch_up``). Measured without Flower (the wire is a folder),
each end in a fresh process so that its peak RSS is its own: the server (holding the codebook)
decides who is behind, plans and encodes every part, one at a time; the site stages each part
as it arrives (decoded, written) and after the last writes the held file from the parts and
decodes it. Bytes and messages are what the wire would carry, the phase message's empty delta
left out.

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
        ClassEntry(
            f"class_{i:05d}",
            100,
            {
                f.name: torch.randn(f.shape(PAPER), generator=generator)
                for f in schema.FIELDS
                if f.broadcast
            },
        )
        for i in range(n_classes)
    ]
    return Codebook(FINGERPRINT, PAPER, {}, 0, LINE.as_metadata()).register(entries)


def server(n_classes: int, dtype: str, folder: Path) -> dict[str, object]:
    """The server's side: who is behind, the plan, every part encoded (and written to
    ``folder`` for the site's side, outside the timing)."""
    codebook = federation(n_classes)
    rss_before = _rss_mb()
    t0 = time.perf_counter()
    late = catch_up.behind(codebook, {}, [1], dtype)
    plan = parts.plan(codebook, dtype)
    encode_s, sent = time.perf_counter() - t0, 0
    for index in range(len(plan.parts)):
        t0 = time.perf_counter()
        data = plan.encoded(index)
        encode_s += time.perf_counter() - t0
        sent += len(data)
        (folder / f"{index}.bin").write_bytes(data)
        del data
    return {
        "classes": n_classes,
        "dtype": dtype,
        "behind": late == [1],
        "messages": len(plan.parts),
        "bytes": sent,
        "part_limit": parts.PART_BYTES,
        "server_encode_s": round(encode_s, 2),
        "server_peak_rss_mb": _rss_mb(),
        "server_codebook_rss_mb": rss_before,
    }


def site(n_classes: int, messages: int, folder: Path) -> dict[str, object]:
    """The site's side: each part staged as it arrives, then the codebook held."""
    baseline = _rss_mb()
    stored = HeldCodebook(folder / "state" / "codebook.bin", fingerprint=FINGERPRINT, dims=PAPER)
    stage_s = 0.0
    for index in range(messages):
        data = (folder / f"{index}.bin").read_bytes()
        t0 = time.perf_counter()
        stored.stage(data, index, messages, n_classes)
        stage_s += time.perf_counter() - t0
        del data
    assert stored.version_for(LINE) == 1 and len(stored.codebook() or ()) == n_classes
    return {
        "site_stage_and_hold_s": round(stage_s, 2),
        "site_peak_rss_mb": _rss_mb(),
        "site_baseline_rss_mb": baseline,
    }


def _rss_mb() -> int:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _side(*argv: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, __file__, *argv], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--side", choices=["server", "site"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--messages", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "server":
        print(json.dumps(server(args.classes[0], args.dtype, args.folder)))
        return
    if args.side == "site":
        print(json.dumps(site(args.classes[0], args.messages, args.folder)))
        return
    for n in args.classes:
        with tempfile.TemporaryDirectory() as tmp:
            row = _side(
                "--side", "server", "--classes", str(n), "--dtype", args.dtype, "--folder", tmp
            )
            row |= _side(
                "--side",
                "site",
                "--classes",
                str(n),
                "--messages",
                str(row["messages"]),
                "--folder",
                tmp,
            )
        print(json.dumps(row), flush=True)
    load = os.getloadavg()[0]
    print(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "load_1min": load}))


if __name__ == "__main__":
    main()
