"""The same federated step on a GPU as on the CPU, and the GPU-only paths (skipped without CUDA).

On a GPU the frozen backbones run in half precision under autocast while the per-class tensors
learn in float32 (``starfed.shared.device``); the codebook a GPU step produces must agree with the
CPU step's within half-precision tolerance: registration (no backbone involved) exactly, learned
tensors to 5e-2 absolute, and the same classes, counts and frozen flags. At paper dims one step
runs on the GPU alone (the CPU's is tests/test_paper_dims.py, slow); the batched mixture fit and
the prefetching copies are checked against scikit-learn and plain slices.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from site_folders import CLASSES, site_folder
from test_mixture_fit import blobs, log_likelihood
from test_paper_dims import PAPER_DIMS, one_step_config

from starfed.client import app as client_app
from starfed.server.app import run_server
from starfed.server.folder_files import CODEBOOK_FILE
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.mixture_fit import fit_mixtures_batched
from starfed.shared.data.images import device_batches
from starfed.shared.model.training import fit_mixtures
from starfed.simulations.local_grid import LocalGrid, run_locally

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
_run_ids = itertools.count(9000)


def federated_step(tmp: Path, device: str) -> tuple[dict, Codebook]:
    config = {
        "preset": "tiny",
        "seed": 1993,
        "stage1-epochs": 1,
        "stage2-epochs": 1,
        "replay1-epochs": 1,
        "replay2-epochs": 1,
        "timeout-s": 60,
        "wait-s": 0.5,
        "device": device,
        "federation-dir": str(tmp / f"federation-{device}"),
    }
    nodes = {}
    for node, (name, classes) in enumerate({"a": CLASSES[0:2], "b": CLASSES[2:4]}.items(), 1):
        data = site_folder(tmp / name, {"t1": classes})
        nodes[node] = {
            "data-dir": str(data),
            "state-dir": str(tmp / f"{name}-{device}"),
            "site-name": name,
            "cache-dir": str(tmp / "cache"),
        }
    grid = LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids))
    metrics = run_server(grid, config, grid.run_id)
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


def test_one_federated_step_at_paper_dims_on_cuda(tmp_path: Path, monkeypatch) -> None:
    """Two sites, one step, the local runtime, ``device=cuda``: the statistics steps take the
    batched fit there (``mixture_fit_for``)."""
    monkeypatch.setenv("STARFED_CACHE_DIR", str(tmp_path / "cache"))
    config = one_step_config(tmp_path, "cuda", "paper-cuda")
    metrics = run_locally(config)
    assert metrics["status"] == "completed", metrics["reason"]
    assert {e["status"] for e in metrics["exchanges"]} == {"ok"}
    codebook = wire.read_file(tmp_path / "results" / "paper-cuda" / CODEBOOK_FILE)
    assert codebook.dims == PAPER_DIMS and len(codebook) == 2
    for entry in codebook.entries.values():
        for field in schema.MIXTURES:
            mixture = entry.values[field]
            assert mixture.means.shape[1:] == schema.BY_NAME[field].shape(PAPER_DIMS), field
            assert torch.isfinite(mixture.means).all() and (mixture.variances > 0).all()
            assert mixture.weights.sum().item() == pytest.approx(1.0, abs=1e-9)


def test_the_batched_fit_on_cuda_matches_scikit_learn_and_the_cpu() -> None:
    """The tolerances of tests/test_mixture_fit.py; the GPU's fit equals the CPU's (same
    k-means++ draws) to float64 rounding."""
    x, y = blobs([120, 80, 60, 3, 1], dim=768, spread=10.0, seed=0)
    gpu = fit_mixtures_batched(x.cuda(), y.cuda(), range(5), 5, seed=11)
    cpu = fit_mixtures_batched(x, y, range(5), 5, seed=11)
    reference = fit_mixtures(x, y, range(5), 5, seed=11)
    for row, (a, b, c) in enumerate(zip(gpu, cpu, reference, strict=True)):
        own = x[y == row]
        assert a.n_components == c.n_components and a.means.device.type == "cpu"
        assert log_likelihood(a, own) == pytest.approx(log_likelihood(c, own), abs=1e-6)
        torch.testing.assert_close(a.means, b.means, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(a.variances, b.variances, atol=1e-9, rtol=1e-9)


def test_device_batches_copy_to_cuda_while_computing() -> None:
    """Side-stream copies from page-locked memory: every batch arrives whole, in order, while
    the default stream is busy with the previous one."""
    images = torch.randint(0, 256, (37, 3, 224, 224), dtype=torch.uint8)
    seen = []
    for batch in device_batches(images, 8, torch.device("cuda")):
        assert batch.is_cuda
        busy = torch.randn(2048, 2048, device="cuda")
        busy @ busy  # keeps the default stream busy while the next copy is in flight
        seen.append(batch.float().sum(dim=(1, 2, 3)))
    expected = images.float().sum(dim=(1, 2, 3))
    torch.testing.assert_close(torch.cat(seen).cpu(), expected)
