"""The Flower ServerApp: reads the run config, runs the ``Coordinator``, writes the results.

Results go to ``<results-dir>/<run-name>/``: ``metrics.json`` (accuracy matrix from the global
test set, clients' own reports, FAA, forgetting, prompt-selection accuracy, bytes per client per
round, wall time per phase, config, fingerprint), ``accuracy_matrix.png``,
``accuracy_over_time.png``, the final ``codebook.bin`` and ``state.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from rich.console import Console

from starfed.server.coordinator import Coordinator
from starfed.shared.config import BackboneOptions, ProtocolOptions, parse, writable_dir
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.files import write_atomic
from starfed.shared.metrics import (
    final_average_accuracy,
    final_forgetting,
    plot_accuracy_matrix,
    plot_accuracy_over_time,
)
from starfed.shared.model.training import TrainConfig

app = ServerApp()


def run_server(grid: Grid, run_config: dict, console: Console | None = None) -> dict:
    """Everything the ServerApp does, callable without Flower's runtime (tests use it).

    A bad run config fails here at once, with the one-line ConfigError, before anything loads.
    """
    console = console or Console(stderr=True)
    started = time.perf_counter()
    values = parse(run_config)
    protocol = ProtocolOptions.from_config(values)
    writable_dir(protocol.results_dir, "results-dir")
    train = TrainConfig.from_config(values)
    # The federation decides how many sites there are (in simulation, its SuperNodes); the
    # run config's num-clients only matters when nobody has connected yet.
    n_nodes = len(list(grid.get_node_ids()))
    scenario_config = ScenarioConfig.from_config(
        {**values, "num-clients": n_nodes or values["num-clients"]}
    )
    scenario = Scenario(scenario_config) if protocol.server_eval else None
    n_steps = scenario_config.n_steps
    backbones = BackboneOptions.from_config(values).load()
    run_name = protocol.run_name or datetime.now(UTC).strftime("fed-%Y%m%d-%H%M%S")
    run_dir = Path(protocol.results_dir) / run_name
    console.print(
        f"[bold]starfed server[/] {n_steps} steps · {scenario_config.n_clients} clients · "
        f"alpha {scenario_config.alpha} · backbones {backbones.config.name} "
        f"({backbones.fingerprint[:12]}) · results in {run_dir}"
    )
    coordinator = Coordinator(
        grid, backbones, train, protocol, n_steps, run_dir, scenario=scenario, console=console
    )
    log = coordinator.run()
    matrix = log.accuracy_matrix
    metrics = {
        "accuracy_matrix": matrix,
        "final_average_accuracy": final_average_accuracy(matrix) if matrix else None,
        "final_forgetting": final_forgetting(matrix) if matrix else None,
        "prompt_selection_accuracy": log.selection_matrix[-1] if log.selection_matrix else None,
        "prompt_selection_accuracy_matrix": log.selection_matrix,
        "client_reports": log.client_reports,
        "exchanges": coordinator.exchanges_as_dicts(),
        "phase_wall_time_s": log.phase_seconds,
        "wall_time_s": time.perf_counter() - started,
        "n_steps": n_steps,
        "classes": coordinator.codebook.bank.names,
        "codebook_version": coordinator.codebook.version,
        "backbone_fingerprint": backbones.fingerprint,
        "config": {
            "run_config": dict(run_config),
            "train": train.to_dict(),
            "protocol": dataclasses.asdict(protocol),
            "scenario": dataclasses.asdict(scenario_config),
        },
    }
    write_atomic(run_dir / "metrics.json", json.dumps(metrics, indent=2).encode())
    if matrix:
        title = (
            f"federated STAR-Prompt, {scenario_config.n_clients} clients, α={scenario_config.alpha}"
        )
        plot_accuracy_matrix(matrix, run_dir / "accuracy_matrix.png", title)
        plot_accuracy_over_time(matrix, run_dir / "accuracy_over_time.png", title)
        console.print(
            f"[bold green]FAA {metrics['final_average_accuracy']:.2f}%[/] · forgetting "
            f"{metrics['final_forgetting']:.2f} · wall {metrics['wall_time_s']:.0f}s"
        )
    return metrics


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, dict(context.run_config))
