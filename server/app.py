"""The Flower ServerApp: one server run over a federation folder, then its results.

The run continues the federation in ``federation-dir`` (a simulation's own run folder when
unset): it performs aggregation steps over what the sites bring now (``Coordinator``) and
writes, next to the federation's files, ``metrics.json`` — the federation's accuracy matrix by
arrival step (from the sites' own test images), FAA, forgetting, prompt-selection accuracy,
each site's accuracy, participation per site and phase, bytes per site and step, wall time per
phase, and this run's status — plus ``accuracy_matrix.png`` and ``accuracy_over_time.png``.

A run ends ``completed``, ``degraded`` (some site failed, went silent or was rejected; the
steps still finished) or ``failed`` (no site connected, or a step could not finish): a failed
run raises, so Flower reports ``finished:failed``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from starfed.server import folder_lock
from starfed.server.coordinator import Coordinator
from starfed.server.federation import Federation
from starfed.server.folder_files import METRICS_FILE, FederationError
from starfed.server.messaging import SiteGrid
from starfed.server.robust import with_merge
from starfed.server.scores import accuracy_matrix, selection_matrix
from starfed.server.screening import ScreeningOptions
from starfed.server.step_records import RUN_END_LEVELS, RunLog
from starfed.server.strategy import Strategy
from starfed.server.test_set import ServerTestSet
from starfed.shared import progress
from starfed.shared.codebook import parts
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.config import ProtocolOptions, parse, run_dir
from starfed.shared.files import write_atomic
from starfed.shared.knob import writable_dir
from starfed.shared.metrics import (
    MATRIX_PLOT,
    OVER_TIME_PLOT,
    faa_text,
    final_average_accuracy,
    final_forgetting,
    forgetting_text,
    nan_to_none,
    plot_accuracy_matrix,
    plot_accuracy_over_time,
    random_backbones_note,
)
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.training import TrainConfig
from starfed.shared.run_status import FAILED

logger = logging.getLogger(__name__)

app = ServerApp()


class RunFailed(RuntimeError):
    """The run could not do its work (the message says why); Flower marks it failed."""


def run_server(
    grid: SiteGrid,
    run_config: dict,
    run_id: int = 0,
    *,
    strategy: Strategy | None = None,
    before_step: Callable[[int], None] | None = None,
) -> dict:
    """Everything the ServerApp does, callable without Flower's runtime (tests use it); the
    metrics it wrote. ``strategy`` and ``before_step`` go to the ``Coordinator`` (a baseline's
    strategy; a simulation writing its sites' folders before each step).

    A bad run config fails here at once, with the one-line ConfigError, before anything loads.
    The run holds the federation folder's lock (``server.folder_lock``) from before it reads
    the folder until it ends, however it ends; a folder another live run holds fails the run
    at once, naming the holder.
    """
    started = time.perf_counter()
    values = parse(run_config)
    protocol = ProtocolOptions.from_config(values)
    strategy = with_merge(strategy, protocol.merge)
    folder = writable_dir(protocol.federation_dir or run_dir(values, run_id), "federation-dir")
    try:
        with folder_lock.locked(folder, f"server run {run_id}"):
            return _run_locked(
                grid,
                values,
                run_config,
                run_id,
                folder,
                protocol,
                started,
                strategy=strategy,
                before_step=before_step,
            )
    except (folder_lock.FolderLocked, FederationError) as err:  # one line: the folder's state
        logger.error("%s", err)
        raise RunFailed(str(err)) from None


def _run_locked(
    grid: SiteGrid,
    values: dict,
    run_config: dict,
    run_id: int,
    folder: Path,
    protocol: ProtocolOptions,
    started: float,
    *,
    strategy: Strategy | None,
    before_step: Callable[[int], None] | None,
) -> dict:
    """``run_server``'s work, with the federation folder locked: first finish what a crash
    interrupted (``Federation.recover``), then the steps, then metrics.json."""
    train = TrainConfig.from_config(values)
    options = BackboneOptions.from_config(values)
    backbones = options.load(values["device"])
    federation = Federation(folder, backbones.fingerprint, backbones.dims)
    if note := federation.recover(protocol.checkpoints_kept):
        logger.warning("federation folder: %s", note)
    federation.history()  # a damaged history fails the run now, not after a step's work
    if note := federation.rerunning():
        logger.warning("federation folder: %s", note)
    server_eval = None
    if protocol.server_test_dir:
        server_eval = ServerTestSet(protocol.server_test_dir, backbones, train)
    logger.info(
        f"starfed server: federation {federation.id[:8]} in {folder} · "
        f"{progress.counted(_steps_done(federation), 'step')} so far · "
        f"backbones {backbones.config.name} ({backbones.fingerprint[:12]})"
    )
    coordinator = Coordinator(
        grid,
        backbones,
        train,
        protocol,
        federation,
        server_eval,
        strategy=strategy,
        before_step=before_step,
        screening=ScreeningOptions.from_config(values),
    )
    _check_part_bytes(coordinator.codebook, protocol)
    log = coordinator.run(protocol.max_steps or None)
    metrics = summarize(federation, log, time.perf_counter() - started)
    metrics["config"] = {
        "run_config": dict(run_config),
        "train": train.to_dict(),
        "protocol": dataclasses.asdict(protocol),
        "strategy": strategy_name(coordinator.strategy),
    }
    write_atomic(folder / METRICS_FILE, json.dumps(nan_to_none(metrics), indent=2).encode())
    matrix = metrics["accuracy_matrix"]
    if matrix:
        title = f"federation {federation.id[:8]}, {progress.counted(len(metrics['sites']), 'site')}"
        weights = bool(options.clip_weights and options.vit_weights)
        note = random_backbones_note(backbones.config.name, weights)
        plot_accuracy_matrix(matrix, folder / MATRIX_PLOT, title, note)
        plot_accuracy_over_time(matrix, folder / OVER_TIME_PLOT, title, note)
    logger.log(
        RUN_END_LEVELS.get(log.status, logging.INFO),
        f"{log.status} · {progress.counted(len(log.steps), 'step')} this run · "
        f"{faa_text(metrics['final_average_accuracy'])} · "
        f"{forgetting_text(metrics['final_forgetting'])} · wall {metrics['wall_time_s']:.0f}s",
    )
    if log.status == FAILED:
        raise RunFailed(log.reason)
    return metrics


def _check_part_bytes(codebook: Codebook, protocol: ProtocolOptions) -> None:
    """Fail the run, before any step, when a catch-up's part could not hold one class at these
    dims (``part-bytes`` is checked against the dims only once the backbones are known)."""
    least = parts.least_part_bytes(codebook, protocol.wire_dtype)
    if protocol.part_bytes < least:
        reason = (
            f"part-bytes = {protocol.part_bytes}: one class of these backbones takes up to "
            f"{least} bytes in a {protocol.wire_dtype} part; set at least {least}"
        )
        logger.error(reason)
        raise RunFailed(reason)


def strategy_name(strategy: Strategy) -> str:
    """Where the strategy's class lives ("module.Class"), for metrics.json."""
    return f"{type(strategy).__module__}.{type(strategy).__qualname__}"


def _steps_done(federation: Federation) -> int:
    """The steps the saved codebook has completed, from its manifest (no codebook decoded)."""
    checkpoint = federation.checkpoints.last_checkpoint()
    return 0 if checkpoint is None else checkpoint.position.step


def summarize(federation: Federation, log: RunLog, wall_s: float) -> dict:
    """metrics.json: the federation's scores over all its steps, and what this run did."""
    history = [r for r in federation.history() if r.status != FAILED]
    matrix = accuracy_matrix(history)
    selection = selection_matrix(history)
    last = history[-1].scores if history else None
    participation: dict[str, dict[str, int]] = {}
    traffic: list[dict] = []
    epsilon: dict[str, float] = {}  # each private site's ε, as its last reply said
    for record in history:
        per_site: dict[str, dict] = {}
        for e in record.exchanges:
            if e.epsilon is not None:
                epsilon[e.site or str(e.node_id)] = e.epsilon
            counts = participation.setdefault(e.site or str(e.node_id), {})
            key = f"{e.phase}:{e.status.outcome}"
            counts[key] = counts.get(key, 0) + 1
            site = per_site.setdefault(e.site, {"bytes_down": 0, "bytes_up": 0})
            site["bytes_down"] += e.bytes_down
            site["bytes_up"] += e.bytes_up
        traffic.append({"step": record.step, "sites": per_site})
    return {
        "status": log.status,
        "reason": log.reason,
        "federation": federation.id,
        "steps": len(history),
        "steps_this_run": [
            {k: getattr(r, k) for k in ("step", "attempt", "status", "reason", "wall_s")}
            for r in log.steps
        ],
        "accuracy_matrix": matrix,
        "final_average_accuracy": final_average_accuracy(matrix),
        "final_forgetting": final_forgetting(matrix),
        "prompt_selection_accuracy": selection[-1] if selection else None,
        "prompt_selection_accuracy_matrix": selection,
        "site_accuracy": {site: s["accuracy"] for site, s in last.sites.items()} if last else {},
        "sites": sorted(participation),
        "participation": participation,
        "privacy_epsilon": epsilon,
        "traffic": traffic,
        "exchanges": [e.to_json() for e in log.exchanges],  # this run's
        "phase_wall_time_s": [
            {"step": r.step, **dataclasses.asdict(p)} for r in history for p in r.phase_seconds
        ],
        "step_wall_time_s": [r.wall_s for r in history],
        "wall_time_s": wall_s,
        "server_test_accuracy_matrix": accuracy_matrix(history, server=True),
        "classes": {
            name: {"step": reg.step, "sites": sorted(reg.sites)}
            for name, reg in federation.registry.items()
        },
        "codebook_version": getattr(federation.checkpoints.last_checkpoint(), "version", 0),
        "backbone_fingerprint": federation.fingerprint,
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    with progress.logged_to(progress.console(stderr=True)):
        run_server(grid, dict(context.run_config), context.run_id)
