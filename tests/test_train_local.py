"""`starfed train-local` end to end on the bundled images (2 short tasks), then its codebook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from starfed.cli import main
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.data.site_folder import class_key
from starfed.shared.inference.predict import LabelledImages, codebook_model
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.evaluation import group_scores


def _rescored(codebook: Codebook, classes: list[str], folder: Path) -> list[float]:
    """Per task (two classes each, in split order), the accuracy of ``codebook`` on the bundled
    test images of ``classes``, through the inference code."""
    folder.mkdir()
    for name in classes:
        (folder / name).symlink_to(bundled_dataset_root() / "test" / name, target_is_directory=True)
    backbones = BackboneOptions(preset="tiny").load("cpu")
    model = codebook_model(codebook, backbones)
    task_of_row = torch.tensor([classes.index(name) // 2 for name in model.bank.names])
    scores = LabelledImages(folder, backbones).score(model, task_of_row)
    return group_scores(scores, task_of_row, 2).accuracy


def test_train_local_writes_results_and_a_valid_codebook(tmp_path, capsys) -> None:
    argv = [
        "train-local",
        "--tasks",
        "2",
        "--classes-per-task",
        "2",
        "--epochs",
        "1",
        "--replay-epochs",
        "1",
        "--results-dir",
        str(tmp_path),
        "--run-name",
        "run",
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    assert main(argv) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    matrix = metrics["accuracy_matrix"]
    assert [len(row) for row in matrix] == [1, 2]
    # The summary numbers are the matrix's: FAA the mean of its last row, forgetting the mean
    # drop of the earlier tasks from their best.
    assert metrics["final_average_accuracy"] == pytest.approx(sum(matrix[1]) / 2)
    assert metrics["final_forgetting"] == pytest.approx(max(matrix[0][0] - matrix[1][0], 0.0))
    assert len(metrics["prompt_selection_accuracy"]) == 2
    assert metrics["n_train_images"] > 0 and metrics["n_skipped_images"] == 0
    assert (run / "accuracy_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    codebook = wire.read_file(run / "codebook.bin", fingerprint=metrics["backbone_fingerprint"])
    order = metrics["class_order"]  # the split's; each task registers its classes by class key
    assert codebook.names == sorted(order[:2], key=class_key) + sorted(order[2:4], key=class_key)
    assert codebook.frozen == set(codebook.names)
    assert all("vit_mixture" in entry.values for entry in codebook.entries.values())
    # The accuracies reported are those of the codebook written: scored again from the file on
    # the same test images, each task's accuracy is the matrix's last row.
    assert _rescored(codebook, order[:4], tmp_path / "labelled") == pytest.approx(matrix[1])

    capsys.readouterr()
    assert main(["codebook", "inspect", str(run / "codebook.bin")]) == 0
    shown = capsys.readouterr().out
    assert metrics["backbone_fingerprint"][:12] in shown
    assert main(["codebook", "diff", str(run / "codebook.bin"), str(run / "codebook.bin")]) == 0


def test_bad_paths_are_one_line_errors(tmp_path, capsys) -> None:
    assert main(["train-local", "--data-root", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("starfed train-local: error:") and "missing" in err and "\n" not in err
    assert main(["train-local", "--clip-weights", str(tmp_path / "nope.safetensors")]) == 2
    assert "--clip-weights" in (err := capsys.readouterr().err) and "no such file" in err


def test_device_cpu_and_auto_compute_the_same(tmp_path, capsys) -> None:
    """On a machine without a GPU, ``--device auto`` is the CPU: the same numbers as ``cpu``."""
    base = [
        "train-local",
        "--tasks",
        "1",
        "--classes-per-task",
        "2",
        "--epochs",
        "1",
        "--replay-epochs",
        "1",
        "--results-dir",
        str(tmp_path),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    assert main([*base, "--run-name", "cpu", "--device", "cpu"]) == 0
    assert main([*base, "--run-name", "auto"]) == 0
    runs = [json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("cpu", "auto")]
    assert runs[0]["accuracy_matrix"] == runs[1]["accuracy_matrix"]
    codebooks = [wire.read_file(tmp_path / name / "codebook.bin") for name in ("cpu", "auto")]
    assert wire.encode(codebooks[0]) == wire.encode(codebooks[1])
    assert main([*base, "--run-name", "gpu", "--device", "gpu"]) == 2
    assert "device" in capsys.readouterr().err
