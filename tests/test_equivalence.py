"""One client holding all the data, one round per stage = `starfed train-local`, same seed.

The federated path splits each task across processes (client: stage 1/2 and statistics;
server: registration, merging, both replays); with a single client and one round per stage it
must compute the same per-class parameters and the same accuracy matrix as a single site.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rich.console import Console
from small_training import small_train

from starfed.client.app import app as client_app
from starfed.server.app import run_server
from starfed.shared.codebook import schema, wire
from starfed.simulations.local_grid import LocalGrid
from starfed.simulations.simulated_sites import SimulatedSites
from starfed.simulations.train_local import LocalRunOptions, run_local

TRAIN = small_train(stage1_epochs=2, stage2_epochs=2, replay1_epochs=2, batch_size=64, seed=1996)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence")
    quiet = Console(quiet=True)
    local = run_local(
        LocalRunOptions(
            n_tasks=3,
            classes_per_task=2,
            results_dir=str(out),
            run_name="local",
            cache_dir=str(out / "cache"),
            train=TRAIN,
        ),
        quiet,
    )
    run_config = {
        "num-tasks": 3,
        "classes-per-task": 2,
        "num-sites": 1,
        "seed": TRAIN.seed,
        "stage1-epochs": TRAIN.stage1_epochs,
        "stage2-epochs": TRAIN.stage2_epochs,
        "replay1-epochs": TRAIN.replay1_epochs,
        "replay2-epochs": TRAIN.replay2_epochs,
        "replay2-epochs-per-task": TRAIN.replay2_epochs_per_task,
        "batch-size": TRAIN.batch_size,
        "results-dir": str(out),
        "run-name": "federated",
        "timeout-s": 120,
    }
    grid = LocalGrid(
        client_app,
        run_config,
        {7: {"partition-id": 0, "num-partitions": 1, "cache-dir": str(out / "cache")}},
    )
    sites = SimulatedSites.of(run_config, 1)
    federated = run_server(grid, run_config, 1, before_step=sites)
    return out, local, federated


def test_same_per_class_parameters(runs) -> None:
    out, _, _ = runs
    a = wire.read_file(out / "local" / "codebook.bin")
    b = wire.read_file(out / "federated" / "codebook.bin")
    assert a.names == b.names
    assert [e.count for e in a.entries.values()] == [e.count for e in b.entries.values()]
    for name in a.names:
        for field in schema.FIELDS:
            x, y = a[name].values[field.name], b[name].values[field.name]
            if field.kind is schema.Kind.TENSOR:
                torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-4, msg=field.name)
            else:
                torch.testing.assert_close(y.means, x.means, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(y.variances, x.variances, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(y.weights, x.weights, atol=1e-6, rtol=0)


def test_same_accuracy(runs) -> None:
    _, local, federated = runs
    assert len(federated["accuracy_matrix"]) == len(local["accuracy_matrix"]) == 3
    for fed_row, local_row in zip(
        federated["accuracy_matrix"], local["accuracy_matrix"], strict=True
    ):
        assert fed_row == pytest.approx(local_row, abs=1e-6)
    assert federated["final_average_accuracy"] == pytest.approx(
        local["final_average_accuracy"], abs=1e-6
    )
    assert federated["prompt_selection_accuracy"] == pytest.approx(
        local["prompt_selection_accuracy"], abs=1e-6
    )


def test_results_do_not_depend_on_node_ids(tmp_path) -> None:
    """Flower assigns random node ids; registration and merge order must not follow them."""
    run_config = {
        "num-tasks": 2,
        "classes-per-task": 2,
        "num-sites": 2,
        "alpha": 0.3,
        "stage1-epochs": 1,
        "stage2-epochs": 1,
        "replay1-epochs": 1,
        "replay2-epochs": 1,
        "results-dir": str(tmp_path),
        "timeout-s": 120,
    }
    codebooks = []
    for run_id, ids in ((11, (5, 9)), (12, (9, 5))):
        nodes = {
            node: {"partition-id": p, "num-partitions": 2, "cache-dir": str(tmp_path / "cache")}
            for p, node in enumerate(ids)
        }
        config = {**run_config, "run-name": f"ids-{run_id}"}
        grid = LocalGrid(client_app, config, nodes, run_id=run_id)
        sites = SimulatedSites.of(config, run_id)
        run_server(grid, config, run_id, before_step=sites)
        codebook = wire.read_file(tmp_path / f"ids-{run_id}" / "codebook.bin")
        codebooks.append(wire.encode(replace(codebook, metadata={})))  # ids and epochs differ
    assert codebooks[0] == codebooks[1]
