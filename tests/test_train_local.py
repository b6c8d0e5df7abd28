"""`starfed train-local` end to end on the bundled images (2 short tasks), then its codebook."""

from __future__ import annotations

import json

from starfed.cli import main
from starfed.shared.codebook import wire
from starfed.shared.data.site_folder import class_key


def test_train_local_writes_results_and_a_valid_codebook(tmp_path, capsys) -> None:
    argv = [
        "train-local",
        "--tasks", "2", "--classes-per-task", "2", "--epochs", "1", "--replay-epochs", "1",
        "--results-dir", str(tmp_path), "--run-name", "run", "--cache-dir", str(tmp_path / "c"),
    ]  # fmt: skip
    assert main(argv) == 0
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics["accuracy_matrix"]) == 2 and len(metrics["accuracy_matrix"][1]) == 2
    assert all(0 <= a <= 100 for row in metrics["accuracy_matrix"] for a in row)
    assert 0 <= metrics["final_average_accuracy"] <= 100
    assert len(metrics["prompt_selection_accuracy"]) == 2
    assert metrics["n_train_images"] > 0 and metrics["n_skipped_images"] == 0
    assert (run / "accuracy_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    codebook = wire.read_file(run / "codebook.bin", fingerprint=metrics["backbone_fingerprint"])
    order = metrics["class_order"]  # the split's; each task registers its classes by class key
    assert codebook.names == sorted(order[:2], key=class_key) + sorted(order[2:4], key=class_key)
    assert codebook.frozen == set(codebook.names)
    assert all("vit_mixture" in entry.values for entry in codebook.entries.values())

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
    base = ["train-local", "--tasks", "1", "--classes-per-task", "2", "--epochs", "1",
            "--replay-epochs", "1", "--results-dir", str(tmp_path), "--cache-dir",
            str(tmp_path / "c")]  # fmt: skip
    assert main([*base, "--run-name", "cpu", "--device", "cpu"]) == 0
    assert main([*base, "--run-name", "auto"]) == 0
    runs = [json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("cpu", "auto")]
    assert runs[0]["accuracy_matrix"] == runs[1]["accuracy_matrix"]
    codebooks = [wire.read_file(tmp_path / name / "codebook.bin") for name in ("cpu", "auto")]
    assert wire.encode(codebooks[0]) == wire.encode(codebooks[1])
    assert main([*base, "--run-name", "gpu", "--device", "gpu"]) == 2
    assert "device" in capsys.readouterr().err
