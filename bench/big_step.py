"""One real step at N paper-dims classes: 5 sites bring 4 new classes, a sixth joins empty.

Issue 34's "done when": a federation folder of N classes (``big_federation.build``: random
float32 tensors, float64 mixtures, written with the fingerprint and dims of the run's backbones)
runs one step through the real apps on the local runtime — ``run_server`` over a ``LocalGrid``
of the real ClientApp, as ``starfed simulate --runtime local`` does (``simulations/local_grid``)
— in which sites ``site-1`` … ``site-5``, each holding the server's codebook (one broadcast
file, hard-linked into their state folders), bring 4 bundled classes each with a few images,
and ``site-6``, holding nothing (no codebook, no task), joins: it is caught up in parts
(``server/catch_up.py``) and must end the step holding the server's codebook, which the bench
checks value by value.

Each N runs in two fresh processes: one builds the folders, one runs the step, so that the
step's peak RSS is its own. The step's process holds the server and the six sites (the local
runtime runs them in one process): its peak RSS is theirs together, reported with the RSS
before the step (backbones loaded). The server's wall and the bytes it wrote (``/proc/self/io``
wchar; the federation folder is all the server writes) are the step's less the ClientApp calls,
which the grid meters.

    python bench/big_step.py --classes 100 1000 --out bench/results/big-step.json

On the local runtime the step's process holds every site's codebook: ≈ 1.4 MB of RSS a class
(docs/benchmarks.md), so 10,000 classes needs ≈ 18 GB.

Training is kept cheap (``RUN``): 1 epoch per stage and replay, ``TRAIN_IMAGES`` train and
``TEST_IMAGES`` test images per new class; ``--preset tiny`` runs the same path at toy dims
(the fast test, ``tests/test_big_step.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from big_federation import build, wchar

from starfed.client import app as client_app
from starfed.client.memory import CODEBOOK_FILE, STATE_FILE
from starfed.server.app import run_server
from starfed.server.federation import Federation
from starfed.server.folder_files import METRICS_FILE
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.held import HeldCodebook
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.config import parse
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.metrics import MATRIX_PLOT, OVER_TIME_PLOT
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.protocol import CATCH_UP_KEY
from starfed.simulations.local_grid import LocalGrid, new_run_id

SITES, NEW_CLASSES, TRAIN_IMAGES, TEST_IMAGES = 5, 4, 3, 1
JOINING = f"site-{SITES + 1}"
#: The cheapest run of the real protocol: one step, one epoch per stage; the server's replays
#: on the bounded schedule (a fixed number of optimizer steps, whatever the classes: the
#: reference schedule's epochs over every class cost O(classes)), with few steps. The default
#: `max-classes` (10,000) would refuse the step's 20 classes at 10,000: the cap is raised.
RUN: dict[str, object] = {
    "preset": "paper-random",
    "seed": 1993,
    "max-steps": 1,
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay-schedule": "bounded",
    "replay1-steps": 2,
    "replay2-steps": 10,
    "timeout-s": 600,
    "wait-s": 0.5,
    "max-classes": 20_000,
}


def run_config(root: Path, preset: str) -> dict[str, object]:
    return {**RUN, "preset": preset, "federation-dir": str(root / "server" / "federation")}


def node_configs(root: Path) -> dict[int, dict[str, str]]:
    """Six sites by node id: their data, state and (shared) cache folders."""
    return {
        k: {
            "data-dir": str(root / f"site-{k}"),
            "state-dir": str(root / f"site-{k}-state"),
            "site-name": f"site-{k}",
            "cache-dir": str(root / "cache"),
        }
        for k in range(1, SITES + 2)
    }


def site_folders(root: Path) -> None:
    """Sites 1-5: one task of 4 bundled classes each (20 classes, none shared), linked images;
    site 6: a test folder only (no task: it brings nothing)."""
    bundled = bundled_dataset_root()
    classes = sorted(p.name for p in (bundled / "train").iterdir())
    for k in range(1, SITES + 2):
        data = root / f"site-{k}"
        (data / "test").mkdir(parents=True)
        for name in classes[(k - 1) * NEW_CLASSES : k * NEW_CLASSES] if k <= SITES else ():
            for split, target, n in (
                ("train", data / "t1" / name, TRAIN_IMAGES),
                ("test", data / "test" / name, TEST_IMAGES),
            ):
                target.mkdir(parents=True)
                for image in sorted((bundled / split / name).iterdir())[:n]:
                    (target / image.name).symlink_to(image)


def prepare(root: Path, n: int, preset: str) -> dict[str, object]:
    """The federation folder of ``n`` classes for ``preset``'s backbones, the sites' data, and
    sites 1-5 holding the server's codebook as a site holds it (the broadcast with its lineage,
    one file linked into each state folder: a site replaces it, never writes into it)."""
    started = time.perf_counter()
    values = parse(run_config(root, preset))
    backbones = BackboneOptions.from_config(values).load(str(values["device"]))
    folder = build(root, n, fingerprint=backbones.fingerprint, dims=backbones.dims)
    codebook = Federation.open(folder).checkpoints.codebook()
    lineage = Lineage.of(codebook)
    stored = root / "stored.bin"
    wire.write_file(stored, replace(codebook.broadcast(), metadata=lineage.as_metadata()))
    for k in range(1, SITES + 1):
        state = root / f"site-{k}-state"
        state.mkdir()
        os.link(stored, state / CODEBOOK_FILE)
        (state / STATE_FILE).write_text(json.dumps({"federation": lineage.federation}))
    stored.unlink()
    site_folders(root)
    return {
        "classes": n,
        "preset": preset,
        "codebook_version": codebook.version,
        "build_s": round(time.perf_counter() - started, 1),
    }


@dataclass
class MeteredGrid(LocalGrid):
    """The local runtime, timing the ClientApp calls and counting the bytes they write, so
    that what is left of the step is the server's."""

    client_s: float = 0.0
    client_written: int = 0

    def _deliver(self, message):  # type: ignore[no-untyped-def]
        started, written = time.perf_counter(), wchar()
        try:
            return super()._deliver(message)
        finally:
            self.client_s += time.perf_counter() - started
            self.client_written += wchar() - written


def step(root: Path, preset: str, part_bytes: int | None = None) -> dict[str, object]:
    """Run the step over the prepared folders (``part_bytes``: the run config's, None its
    default); what it cost, and what site 6 received."""
    config = run_config(root, preset)
    if part_bytes is not None:
        config["part-bytes"] = part_bytes
    folder = Path(str(config["federation-dir"]))
    values = parse(config)
    BackboneOptions.from_config(values).load(str(values["device"]))  # the pair run_server loads
    rss_before = _peak_rss_mb()
    grid = MeteredGrid(client_app.app, config, node_configs(root), run_id=new_run_id())
    started, written = time.perf_counter(), wchar()
    metrics = run_server(grid, config, grid.run_id)
    wall, server_written = time.perf_counter() - started, wchar() - written - grid.client_written
    joined = [e for e in metrics["exchanges"] if e["site"] == JOINING]
    parts = [e for e in joined if e["phase"] == CATCH_UP_KEY]
    caught_up = sorted({e["site"] for e in metrics["exchanges"] if e["phase"] == CATCH_UP_KEY})
    return {
        "status": metrics["status"],
        "wall_s": round(wall, 1),
        "server_wall_s": round(wall - grid.client_s, 1),
        "clients_wall_s": round(grid.client_s, 1),
        "peak_rss_mb": _peak_rss_mb(),
        "rss_before_step_mb": rss_before,
        "server_bytes_written": server_written,
        "of_which_metrics_and_plots": sum(
            (folder / name).stat().st_size
            for name in (METRICS_FILE, MATRIX_PLOT, OVER_TIME_PLOT)
            if (folder / name).is_file()
        ),
        "clients_bytes_written": grid.client_written,
        "joining_bytes_received": sum(e["bytes_down"] for e in joined),
        "joining_messages": len(joined),
        "joining_catch_up_parts": sum(e["status"] == "ok" for e in parts),
        "joining_statuses": sorted({f"{e['phase']}:{e['status'].split(':')[0]}" for e in joined}),
        "caught_up_sites": caught_up,
        "classes_after": len(metrics["classes"]),
        "joining_holds_the_codebook": holds_the_codebook(root),
    }


def holds_the_codebook(root: Path) -> bool:
    """Site 6's held codebook is the server's broadcast: classes in order, version, lineage,
    counts, frozen flags and every value."""
    server = Federation.open(root / "server" / "federation").checkpoints.codebook().broadcast()
    stored = HeldCodebook(root / f"{JOINING}-state" / CODEBOOK_FILE).codebook()
    return stored is not None and same(stored, server)


def same(stored: Codebook, sent: Codebook) -> bool:
    if (stored.names, stored.version, Lineage.of(stored)) != (
        sent.names,
        sent.version,
        Lineage.of(sent),
    ):
        return False
    for name in sent.names:
        mine, theirs = stored[name], sent[name]
        if (mine.count, mine.frozen, mine.values.keys()) != (
            theirs.count,
            theirs.frozen,
            theirs.values.keys(),
        ):
            return False
        if not all(torch.equal(mine.values[f], v) for f, v in theirs.values.items()):
            return False
    return True


def _peak_rss_mb() -> int:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _child(*argv: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if done.returncode:
        return {"exit": done.returncode, "error": done.stderr.strip().splitlines()[-5:]}
    return json.loads(done.stdout.splitlines()[-1])


def measure(n: int, preset: str) -> dict[str, object]:
    """Build, then run, each in a fresh process; the folders are removed after."""
    with tempfile.TemporaryDirectory(prefix=f"starfed-big-step-{n}-") as tmp:
        load = os.getloadavg()[0]
        row = {
            **_child("--prepare", tmp, "--classes", str(n), "--preset", preset),
            "load_1min_before": round(load, 1),
        }
        if "error" not in row:
            row["step"] = _child("--step", tmp, "--preset", preset)
            row["load_1min_after"] = round(os.getloadavg()[0], 1)
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--preset", default="paper-random", help="the backbones (and dims)")
    parser.add_argument("--out", type=Path, help="write the rows here (JSON)")
    parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)  # measure's children
    parser.add_argument("--step", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        print(json.dumps(prepare(args.prepare, args.classes[0], args.preset)))
        return
    if args.step:
        print(json.dumps(step(args.step, args.preset)))
        return
    rows = []
    for n in args.classes:
        rows.append(measure(n, args.preset))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
