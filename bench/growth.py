"""Server replay as a federation ages: both replay schedules side by side, per (classes, step).

A synthetic codebook at the paper's dims (768, M = 5: ``codebook_sizes.random_codebook``) holds
C classes at step t: the first C − 4 frozen, the last 4 the step's. For each point and schedule
(``replay-schedule``, docs/model.md#bounded-replay) this times, on one thread, the server's own
work of a step besides merging updates: registering the step's classes, the first-level replay
(``server.replay.replay_first_level``: CLIP's text tower on the step's prompts at every
optimizer step) and the head replay (``replay_head``) — CPU seconds (process time) and wall.

A replay whose optimizer steps exceed a cap (``--level1-cap``, ``--level2-cap``) is run for that
many steps only — the reference on one epoch of fewer samples per class, the bounded schedule
on a smaller budget — and its time extrapolated: fixed cost (the same replay with no steps) +
measured per-step cost × all its steps. Rows say ``extrapolated`` where that is so; the
per-step cost of both schedules does not depend on the step count, so this is linear.

    python bench/growth.py                                   # the four points, paper dims
    python bench/growth.py --points 28:7 --preset tiny       # a quick look
    python bench/growth.py --json results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable

import torch
from codebook_sizes import random_codebook

from starfed.server import replay
from starfed.shared import thread_pools
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.model.backbones import Backbones, create_backbones
from starfed.shared.model.replay import ReplaySchedule
from starfed.shared.model.training import TrainConfig

POINTS = ((28, 7), (100, 25), (400, 100), (1000, 250))
NEW_PER_STEP = 4


def aged_codebook(
    backbones: Backbones, classes: int, new: int = NEW_PER_STEP
) -> tuple[Codebook, Codebook]:
    """Random values for ``classes`` classes, all but the step's last ``new`` frozen; and the
    codebook before the step registered its classes."""
    codebook = random_codebook(backbones.dims, classes, n_components=5)
    entries = dict(codebook.entries)
    names = list(entries)
    for name in names[: classes - new]:
        entries[name] = dataclasses.replace(entries[name], frozen=True)
    past = {name: entries[name] for name in names[: classes - new]}
    return dataclasses.replace(codebook, entries=entries), dataclasses.replace(
        codebook, entries=past
    )


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``work()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.process_time() - cpu, time.perf_counter() - wall


def steps(config: TrainConfig, level: int, classes: int, step: int) -> int:
    """Optimizer steps one replay takes under ``config``."""
    epochs = (
        config.replay1_epochs
        if level == 1
        else config.replay2_epochs + config.replay2_epochs_per_task * step
    )
    budget = config.replay1_steps if level == 1 else config.replay2_steps
    replay_config = config.replay_config(epochs, 0.0, budget, step)
    if replay_config.schedule is ReplaySchedule.BOUNDED:
        return replay_config.steps
    return replay_config.reference_steps(classes)


def shortened(config: TrainConfig, level: int, classes: int, step: int, cap: int) -> TrainConfig:
    """The same replay cut to about ``cap`` optimizer steps (0: none), as module docs say."""
    if config.replay_schedule.at(step) is ReplaySchedule.BOUNDED:
        return dataclasses.replace(config, **{f"replay{level}_steps": cap})
    samples = max(1, cap * config.replay_batch_size // classes) if cap else 1
    epochs = 1 if cap else 0
    if level == 1:
        return dataclasses.replace(config, replay1_epochs=epochs, replay_samples=samples)
    return dataclasses.replace(
        config, replay2_epochs=epochs, replay2_epochs_per_task=0, replay_samples=samples
    )


def measure_level(
    level: int,
    codebook: Codebook,
    backbones: Backbones,
    config: TrainConfig,
    step: int,
    cap: int,
    new: int = NEW_PER_STEP,
) -> dict:
    """One replay at one point: measured, or extrapolated from ``cap`` of its steps."""
    classes, in_play = len(codebook), codebook.names[-new:]

    def run(run_config: TrainConfig) -> tuple[float, float]:
        if level == 1:
            return timed(lambda: replay.replay_first_level(codebook, backbones, run_config, step))
        return timed(
            lambda: replay.replay_head(codebook, run_config, step, in_play, backbones.device)
        )

    full = steps(config, level, classes, step)
    if full <= cap:
        cpu, wall = run(config)
        return {"steps": full, "cpu_s": cpu, "wall_s": wall, "extrapolated": False}
    part = shortened(config, level, classes, step, cap)
    measured = steps(part, level, classes, step)
    fixed_cpu, fixed_wall = run(shortened(config, level, classes, step, 0))
    cpu, wall = run(part)
    scale = full / measured
    return {
        "steps": full,
        "measured_steps": measured,
        "cpu_s": fixed_cpu + max(0.0, cpu - fixed_cpu) * scale,
        "wall_s": fixed_wall + max(0.0, wall - fixed_wall) * scale,
        "extrapolated": True,
    }


def measure_point(
    backbones: Backbones,
    classes: int,
    step: int,
    caps: tuple[int, int],
    schedules: list[ReplaySchedule],
    new: int = NEW_PER_STEP,
) -> list[dict]:
    codebook, before = aged_codebook(backbones, classes, new)
    in_play = codebook.names[-new:]
    rows = []
    for schedule in schedules:
        config = TrainConfig(replay_schedule=schedule)
        row = {"classes": classes, "in_play": new, "step": step, "schedule": schedule.value}
        row["register_cpu_s"], _ = timed(
            lambda c=config: replay.register(before, in_play, backbones, c)
        )
        for level in (1, 2):
            row[f"level{level}"] = measure_level(
                level, codebook, backbones, config, step, caps[level - 1], new
            )
        row["replay_cpu_s"] = row["level1"]["cpu_s"] + row["level2"]["cpu_s"]
        row["replay_wall_s"] = row["level1"]["wall_s"] + row["level2"]["wall_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--points",
        default=",".join(f"{c}:{s}" for c, s in POINTS),
        help="CLASSES:STEP,... (default: %(default)s)",
    )
    parser.add_argument("--preset", default="paper-random", help="backbone pair")
    parser.add_argument(
        "--level1-cap",
        type=int,
        default=20,
        help="first-level replay steps run before extrapolating",
    )
    parser.add_argument(
        "--level2-cap", type=int, default=1000, help="head replay steps run before extrapolating"
    )
    parser.add_argument(
        "--schedules",
        default="reference,bounded",
        help="replay-schedule values (default: %(default)s)",
    )
    parser.add_argument(
        "--in-play",
        type=int,
        default=NEW_PER_STEP,
        help="the step's classes, the last of each point's (default: %(default)s; "
        "max-step-classes bounds them)",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    thread_pools.controller().limit(limits=1)
    backbones = create_backbones(args.preset, seed=0)
    print(
        f"# {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, preset {args.preset}, "
        f"dims {backbones.dims}, 1 thread, torch {torch.__version__}",
        flush=True,
    )
    rows = []
    for point in args.points.split(","):
        classes, step = (int(v) for v in point.split(":"))
        caps = (args.level1_cap, args.level2_cap)
        schedules = [ReplaySchedule(s) for s in args.schedules.split(",")]
        rows += measure_point(backbones, classes, step, caps, schedules, args.in_play)
    print(f"# load at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
