"""How many starfed modules one federation step passes through: the server's, then the sites'.

Issue 42 asks that a newcomer can follow one step from send to commit, and that the number of
modules it passes through be stated before and after the redesign. This runs one step through
the real apps on the local runtime (``run_server`` over a ``LocalGrid`` of the real ClientApp,
tiny backbones, two sites bringing two classes each) and, while ``Coordinator.run_step`` runs,
notes the module of every starfed function called (``sys.setprofile``). A call made while the
grid hands a message to a site's ClientApp is the site's; any other is the server's. Each
side's modules are printed in the order of their first call: the step's path.

    python bench/step_modules.py [--json OUT]

The count depends on the code only (not on the machine or its load): one run is the number.
A site builds itself (backbones, caches) at its first message, inside the step: those modules
are on its path as in a deployed ClientApp process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from starfed.client import app as client_app
from starfed.server.app import run_server
from starfed.server.coordinator import Coordinator
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.simulations.local_grid import LocalGrid, new_run_id

RUN: dict[str, object] = {
    "preset": "tiny",
    "seed": 1993,
    "max-steps": 1,
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "timeout-s": 60,
    "wait-s": 0.5,
}
SITES = {"farm-a": 0, "farm-b": 2}  # site -> the first of its two bundled classes
IMAGES = {"train": 3, "test": 1}
SERVER, SITE = "server", "site"


class Trace:
    """The starfed modules whose functions run, per side, in the order of their first call."""

    def __init__(self) -> None:
        self.side: str | None = None  # None: not inside the step
        self.modules: dict[str, dict[str, None]] = {SERVER: {}, SITE: {}}

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.side is None:
            return
        name = frame.f_globals.get("__name__", "")
        if name.startswith("starfed."):
            self.modules[self.side].setdefault(name, None)

    def during(self, side: str, call: Callable[[], Any]) -> Any:
        """``call()`` with its calls counted as ``side``'s."""
        before, self.side = self.side, side
        try:
            return call()
        finally:
            self.side = before


TRACE = Trace()


class TracedGrid(LocalGrid):
    """The local runtime, a site's answer counted as the site's."""

    def _deliver(self, message):  # type: ignore[no-untyped-def]
        return TRACE.during(SITE, lambda: super(TracedGrid, self)._deliver(message))


def _site_data(root: Path, first: int) -> Path:
    """A site folder with one task of two bundled classes, a few images each (links)."""
    bundled = bundled_dataset_root()
    classes = sorted(p.name for p in (bundled / "train").iterdir())[first : first + 2]
    for name in classes:
        for split, n in IMAGES.items():
            target = root / ("t1" if split == "train" else "test") / name
            target.mkdir(parents=True, exist_ok=True)
            for image in sorted((bundled / split / name).iterdir())[:n]:
                (target / image.name).symlink_to(image)
    return root


def one_step(tmp: Path) -> dict:
    """One step of two sites through the real apps, traced; the run's metrics."""
    config = {**RUN, "federation-dir": str(tmp / "federation")}
    nodes = {
        node: {
            "data-dir": str(_site_data(tmp / site, first)),
            "state-dir": str(tmp / f"{site}-state"),
            "site-name": site,
            "cache-dir": str(tmp / "cache"),
        }
        for node, (site, first) in enumerate(SITES.items(), start=1)
    }
    run_step = Coordinator.run_step

    def traced(self: Coordinator):  # type: ignore[no-untyped-def]
        sys.setprofile(TRACE.profile)
        threading.setprofile(TRACE.profile)
        try:
            return TRACE.during(SERVER, lambda: run_step(self))
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    Coordinator.run_step = traced  # type: ignore[method-assign]
    try:
        grid = TracedGrid(client_app.app, config, nodes, run_id=new_run_id())
        return run_server(grid, config, grid.run_id)
    finally:
        Coordinator.run_step = run_step  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the counts and lists here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = one_step(Path(tmp))
    if metrics.get("status") != "completed":
        print(f"the step did not complete: {metrics.get('status')}", file=sys.stderr)
        return 1
    for side, modules in TRACE.modules.items():
        print(f"{side}: {len(modules)} modules")
        for index, name in enumerate(modules, start=1):
            print(f"  {index:3d} {name.removeprefix('starfed.')}")
    both = set(TRACE.modules[SERVER]) | set(TRACE.modules[SITE])
    print(f"both sides: {len(both)} modules")
    if args.json:
        counts = {side: len(modules) for side, modules in TRACE.modules.items()}
        lists = {side: list(modules) for side, modules in TRACE.modules.items()}
        out = {"counts": {**counts, "both": len(both)}, "modules": lists}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
