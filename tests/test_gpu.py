"""The same federated step on a GPU as on the CPU (skipped without CUDA).

On a GPU the frozen backbones run in half precision under autocast while the per-class tensors
learn in float32 (``starfed.shared.device``); the codebook a GPU step produces must agree with the
CPU step's within half-precision tolerance: registration (no backbone involved) exactly, learned
tensors to 5e-2 absolute, and the same classes, counts and frozen flags.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from rich.console import Console
from site_folders import CLASSES, site_folder

from starfed.client import answer
from starfed.client import app as client_app
from starfed.server.app import run_server
from starfed.server.federation import CODEBOOK_FILE
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.simulations.local_grid import LocalGrid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
_run_ids = itertools.count(9000)


def federated_step(tmp: Path, device: str) -> tuple[dict, Codebook]:
    config = {
        "preset": "tiny", "seed": 1993, "stage1-epochs": 1, "stage2-epochs": 1,
        "replay1-epochs": 1, "replay2-epochs": 1, "timeout-s": 60, "wait-s": 0.5,
        "device": device, "federation-dir": str(tmp / f"federation-{device}"),
    }  # fmt: skip
    nodes = {}
    for node, (name, classes) in enumerate({"a": CLASSES[0:2], "b": CLASSES[2:4]}.items(), 1):
        data = site_folder(tmp / name, {"t1": classes})
        nodes[node] = {"data-dir": str(data), "state-dir": str(tmp / f"{name}-{device}"),
                       "site-name": name, "cache-dir": str(tmp / "cache")}  # fmt: skip
    grid = LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids))
    try:
        metrics = run_server(grid, config, grid.run_id, Console(quiet=True))
    finally:
        answer.SITES.clear()
    return metrics, wire.read_file(tmp / f"federation-{device}" / CODEBOOK_FILE)


def test_a_federated_step_on_cuda_matches_the_cpu(tmp_path: Path) -> None:
    cpu_metrics, cpu = federated_step(tmp_path, "cpu")
    gpu_metrics, gpu = federated_step(tmp_path, "cuda")
    assert gpu_metrics["status"] == cpu_metrics["status"] == "completed"
    assert gpu.names == cpu.names and gpu.frozen == cpu.frozen
    for name in cpu.names:
        assert gpu[name].count == cpu[name].count
        for field, value in cpu[name].values.items():
            other = gpu[name].values[field]
            if field.endswith("mixture"):
                torch.testing.assert_close(other.mean(), value.mean(), atol=5e-2, rtol=5e-2)
            else:
                torch.testing.assert_close(other, value, atol=5e-2, rtol=5e-2, msg=field)
    assert abs(gpu_metrics["final_average_accuracy"] - cpu_metrics["final_average_accuracy"]) < 10
