"""`starfed simulate --runtime local` computes what the Flower runtime computes.

The local runtime hands each message straight to the ClientApp in this process; the Flower
runtime goes through a SuperLink, SuperExec and Ray actors. Same scenario, same seed: the final
codebooks must hold the same tensors and the metrics the same accuracies. Smallest sizes: tiny
backbones, 2 sites, 2 tasks x 2 classes, one epoch everywhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from starfed.cli import main
from starfed.shared.codebook import schema, wire

SMALL = [
    "--clients=2",
    "--tasks=2",
    "--classes-per-task=2",
    "--epochs=1",
    "--run-config=replay1-epochs=1",
    "--run-config=replay2-epochs=1",
    "--run-config=replay2-epochs-per-task=0",
    "--run-config=timeout-s=120",
]
FLOWER_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[Path, int, str]:
    """The small scenario on the local runtime, through the command line, in this process."""
    out = tmp_path_factory.mktemp("local-runtime")
    argv = ["simulate", "--runtime=local", *SMALL, f"--results-dir={out}", "--run-name=local"]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("STARFED_CACHE_DIR", str(out / "cache"))
        code = main(argv)
    return out, code, printed.getvalue()


def test_local_runtime_runs_the_federation(local_run) -> None:
    out, code, printed = local_run
    assert code == 0, printed
    assert "local runtime: 2 simulated sites" in printed and "FAA" in printed
    metrics = json.loads((out / "local" / "metrics.json").read_text())
    assert metrics["status"] == "completed"
    assert [len(row) for row in metrics["accuracy_matrix"]] == [1, 2]
    assert {e["status"] for e in metrics["exchanges"]} == {"ok"}
    assert metrics["sites"] == ["site-0", "site-1"]
    for name in ("accuracy_matrix.png", "accuracy_over_time.png", "codebook.bin"):
        assert (out / "local" / name).is_file(), name


@pytest.mark.e2e
@pytest.mark.slow  # CI runs each runtime on its own: test_e2e_flwr.py, test_protocol.py
def test_local_and_flower_runtimes_compute_the_same(local_run) -> None:
    out, code, _ = local_run
    assert code == 0
    env = dict(os.environ, STARFED_CACHE_DIR=str(out / "cache"))
    command = [
        sys.executable,
        "-m",
        "starfed.cli",
        "simulate",
        "--runtime=flower",
        *SMALL,
        f"--results-dir={out}",
        "--run-name=flower",
        f"--timeout={FLOWER_TIMEOUT_S - 30}",
    ]
    result = subprocess.run(
        command, cwd=out, env=env, capture_output=True, text=True, timeout=FLOWER_TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout + result.stderr

    local = json.loads((out / "local" / "metrics.json").read_text())
    flower = json.loads((out / "flower" / "metrics.json").read_text())
    for key in (
        "accuracy_matrix",
        "final_average_accuracy",
        "final_forgetting",
        "prompt_selection_accuracy_matrix",
        "sites",
        "steps",
    ):
        assert flower[key] == local[key], key
    a = wire.read_file(out / "local" / "codebook.bin")
    b = wire.read_file(out / "flower" / "codebook.bin")
    assert a.names == b.names and a.version == b.version
    for name in a.names:
        assert a[name].count == b[name].count
        for field in schema.FIELDS:
            x, y = a[name].values.get(field.name), b[name].values.get(field.name)
            if field.kind is schema.Kind.TENSOR:
                assert torch.equal(x, y), (name, field.name)
            elif x is not None:
                assert torch.equal(x.means, y.means) and torch.equal(x.variances, y.variances)
                assert torch.equal(x.weights, y.weights), (name, field.name)
