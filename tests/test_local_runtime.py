"""`starfed simulate --runtime local` computes what the Flower runtime computes.

The local runtime hands each message straight to the ClientApp in this process; the Flower
runtime goes through a SuperLink, SuperExec and Ray actors. Same scenario, same seed: the final
codebooks must hold the same tensors and the metrics the same accuracies. Smallest sizes: tiny
backbones, 2 sites, 2 tasks x 2 classes, one epoch everywhere. In the fast suite, what the local
run reports must be what the codebook it wrote does on the sites' test images.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from starfed.cli import main
from starfed.server.federation import Federation
from starfed.server.serving import export
from starfed.shared.codebook import schema, wire
from starfed.shared.config import parse
from starfed.shared.inference.predict import evaluate
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.evaluation import group_scores

SMALL = [
    "--sites=2",
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


def test_the_metrics_are_what_the_written_codebook_scores(local_run, monkeypatch) -> None:
    """The codebook the run wrote, exported as devices get it and scored by `starfed
    evaluate`'s scorer on each simulated site's test folder, gives each site's accuracy and,
    averaged over the sites with test images of a step's classes (``server.scores``: one site,
    one vote), the final rows of the accuracy and prompt-selection matrices; FAA and
    forgetting follow from the matrix."""
    out, code, _ = local_run
    assert code == 0
    run = out / "local"
    metrics = json.loads((run / "metrics.json").read_text())
    codebook = export.deployable(Federation.open(run)).codebook
    assert sorted(codebook.names) == sorted(metrics["classes"])
    assert codebook.frozen == set(codebook.names)  # every class of the run frozen
    monkeypatch.setenv("STARFED_CACHE_DIR", str(out / "cache"))
    backbones = BackboneOptions.from_config(parse({})).load("cpu")  # refused if not the run's
    per_site = []
    for site in metrics["sites"]:
        evaluation = evaluate(codebook, backbones, run / "sites" / site / "data")
        assert evaluation.left_out == {} and evaluation.unreadable == []
        scores = evaluation.scores
        accuracy = 100 * int(scores.correct.sum()) / int(scores.images.sum())
        assert accuracy == pytest.approx(metrics["site_accuracy"][site]), site
        group = torch.tensor([evaluation.steps[name] for name in evaluation.names])
        per_site.append(group_scores(scores, group, metrics["steps"]))

    def site_mean(values: list[float]) -> float:
        scored = [v for v in values if not math.isnan(v)]  # NaN: no test image of the step
        return sum(scored) / len(scored)

    steps = range(metrics["steps"])
    matrix = metrics["accuracy_matrix"]
    accuracy = [site_mean([s.accuracy[j] for s in per_site]) for j in steps]
    assert accuracy == pytest.approx(matrix[-1])
    selection = [site_mean([s.selection_accuracy[j] for s in per_site]) for j in steps]
    assert selection == pytest.approx(metrics["prompt_selection_accuracy_matrix"][-1])
    assert metrics["final_average_accuracy"] == pytest.approx(sum(matrix[-1]) / len(matrix[-1]))
    assert metrics["final_forgetting"] == pytest.approx(matrix[0][0] - matrix[1][0])


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
