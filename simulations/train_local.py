"""Single-site continual STAR-Prompt over Split CropDiseases (`starfed train-local` runs it).

The baseline every federated run is compared with: one site holds all the data and learns
the tasks in order. Writes ``metrics.json``, ``accuracy_matrix.png`` and the final codebook
(``codebook.bin``) into the results directory and prints one table row per task. The command
line is ``starfed.cli.train_local``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from starfed.shared import progress
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.config import Options
from starfed.shared.data.cropdiseases import SplitCropDiseases, dataset_root
from starfed.shared.data.images import DecodedImages, decode_images
from starfed.shared.data.site_folder import class_key
from starfed.shared.device import resolve
from starfed.shared.knob import Values, optional
from starfed.shared.metrics import (
    MATRIX_PLOT,
    final_average_accuracy,
    final_forgetting,
    forgetting_text,
    plot_accuracy_matrix,
    random_backbones_note,
)
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.evaluation import evaluate_decoded
from starfed.shared.model.features import clip_features
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, learn_task
from starfed.simulations.research_knobs import knob, parse

CODEBOOK_FILE = "codebook.bin"
COMMAND = "train-local"  # the table of the command's own knobs


@dataclass
class LocalRunOptions(Options):
    """Everything that defines a single-site run (recorded in metrics.json): run-config knobs
    and the command's own (``--download``, ...), declared from the knob table."""

    data_root: str = knob("data-root", dataset_root)
    n_tasks: int = knob("num-tasks")
    classes_per_task: int | None = knob("classes-per-task", optional)
    preset: str = knob("preset")
    backbone_config: str | None = knob("backbone-config", optional)
    clip_weights: str | None = knob("clip-weights", optional)
    vit_weights: str | None = knob("vit-weights", optional)
    download: bool = knob("download", table=COMMAND)
    vit_tag: str = knob("vit-tag", table=COMMAND)
    device: str = knob("device")  # starfed.shared.device
    results_dir: str = knob("results-dir")
    run_name: str | None = knob("run-name", optional)
    cache_dir: str | None = knob("cache-dir", optional, table=COMMAND)
    classify_with_keys: bool = knob("classify-with-keys", table=COMMAND)  # evaluation only
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_config(cls, values: Values, own: Values | None = None) -> Self:
        """From parsed run-config values and the command's own options (``--download``, ...)."""
        return super().from_config({**parse({}, COMMAND), **values, **(own or {})})


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def run_local(options: LocalRunOptions, console: Console | None = None) -> dict:
    """Train task after task, evaluate on all seen tasks after each; return the metrics."""
    console = console or progress.console(stderr=True)
    started = time.perf_counter()
    config = options.train
    torch.manual_seed(config.seed)
    split = SplitCropDiseases.from_root(
        options.data_root, options.n_tasks, options.classes_per_task, seed=config.seed
    )
    backbones = create_backbones(
        options.preset,
        config_path=options.backbone_config,
        clip_weights=options.clip_weights,
        vit_weights=options.vit_weights,
        download=options.download,
        vit_tag=options.vit_tag,
    ).place(resolve(options.device))
    model = StarPrompt(backbones, confidence_modulation=config.confidence_modulation)
    console.print(
        f"[bold]starfed train-local[/] {progress.counted(split.n_tasks, 'task')} × "
        f"{progress.counted(split.classes_per_task, 'class')} "
        f"from {split.root} · backbones {backbones.config.name} "
        f"({backbones.fingerprint[:12]}) · seed {config.seed}"
    )
    train, test = _decoded(options, split, backbones.config.image_size, console)
    matrix, selection, task_seconds = _learn_tasks(model, split, train, test, options, console)
    metrics = {
        "accuracy_matrix": matrix,
        "final_average_accuracy": final_average_accuracy(matrix),
        "final_forgetting": final_forgetting(matrix),
        "prompt_selection_accuracy": selection[-1],
        "prompt_selection_accuracy_matrix": selection,
        "wall_time_s": time.perf_counter() - started,
        "task_wall_time_s": task_seconds,
        "n_train_images": len(train.labels),
        "n_test_images": len(test.labels),
        "n_skipped_images": train.n_skipped + test.n_skipped,
        "class_order": split.class_folders,
        "backbone_fingerprint": backbones.fingerprint,
        "backbone_config": json.loads(backbones.config.to_json()),
        "config": dataclasses.asdict(options),
        "torch_threads": torch.get_num_threads(),
    }
    run_dir = _write_results(options, metrics, model, split.n_tasks)
    console.print(
        f"[bold green]FAA {metrics['final_average_accuracy']:.2f}%[/] · "
        f"{forgetting_text(metrics['final_forgetting'])} · wall {metrics['wall_time_s']:.0f}s · "
        f"results in {run_dir}"
    )
    metrics["run_dir"] = str(run_dir)
    return metrics


def _decoded(
    options: LocalRunOptions, split: SplitCropDiseases, size: int, console: Console
) -> tuple[DecodedImages, DecodedImages]:
    """The train and test images of every task, decoded once (unreadable ones skipped)."""
    train = decode_images(
        split.samples("train", range(split.n_tasks)), size, options.cache_dir, every_class=True
    )
    test = decode_images(split.samples("test", range(split.n_tasks)), size, options.cache_dir)
    if train.n_skipped or test.n_skipped:
        skipped = progress.counted(train.n_skipped + test.n_skipped, "unreadable image")
        console.print(f"[yellow]skipped {skipped}")
    return train, test


def _learn_tasks(
    model: StarPrompt,
    split: SplitCropDiseases,
    train: DecodedImages,
    test: DecodedImages,
    options: LocalRunOptions,
    console: Console,
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Each task learned, then every seen task scored: the accuracy and prompt-selection
    matrices and each task's seconds, with a table of them printed at the end."""
    backbones, config = model.backbones, options.train
    test_features = clip_features(backbones, test.images)  # frozen CLIP: computed once
    matrix: list[list[float]] = []
    selection: list[list[float]] = []
    task_seconds: list[float] = []
    table = Table("task", "accuracy per seen task (%)", "avg", "selection (%)", "s")
    with _progress(console) as bars:
        for t in range(split.n_tasks):
            task_start = time.perf_counter()
            n_past = len(model)
            images, targets = _task_examples(model, split, train, t, config.seed)
            features = clip_features(backbones, images)
            learn_task(model, images, targets, features, n_past, t, config, bars)
            scores = evaluate_decoded(
                model, test, test_features, split, t + 1, use_keys=options.classify_with_keys
            )
            matrix.append(scores.accuracy)
            selection.append(scores.selection_accuracy)
            task_seconds.append(time.perf_counter() - task_start)
            mean_accuracy = final_average_accuracy(matrix)  # of the row just added
            table.add_row(
                str(t + 1),
                " ".join(f"{a:5.1f}" for a in scores.accuracy),
                f"{mean_accuracy:.1f}",
                f"{final_average_accuracy(selection):.1f}",
                f"{task_seconds[-1]:.0f}",
            )
            console.print(
                f"task {t + 1}/{split.n_tasks}: avg acc {mean_accuracy:.1f}% "
                f"({task_seconds[-1]:.0f}s)"
            )
    console.print(table)
    return matrix, selection, task_seconds


def _task_examples(
    model: StarPrompt, split: SplitCropDiseases, train: DecodedImages, t: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Task ``t``'s classes added to the model, and its images with their bank rows."""
    labels = split.task_labels(t)
    n_past = len(model)
    # A task's classes are registered in class-key order, as a federation does.
    names = sorted((split.class_folders[label] for label in labels), key=class_key)
    model.add_classes(names, seed=seed)
    row_of = {split.class_folders.index(name): n_past + i for i, name in enumerate(names)}
    # Images in class-row then file order: the order a site reads its task folder in.
    in_task = torch.isin(train.labels, torch.tensor(labels)).nonzero().flatten().tolist()
    in_task.sort(key=lambda i: (row_of[int(train.labels[i])], train.paths[i]))
    targets = torch.tensor([row_of[int(train.labels[i])] for i in in_task])
    return train.images[in_task], targets


def _write_results(
    options: LocalRunOptions, metrics: dict, model: StarPrompt, n_tasks: int
) -> Path:
    """metrics.json, the finished codebook and the accuracy plot in the run's folder."""
    backbones, seed = model.backbones, options.train.seed
    run_dir = Path(options.results_dir) / (
        options.run_name or datetime.now(UTC).strftime("local-%Y%m%d-%H%M%S")
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    finished = {entry.name: replace(entry, frozen=True) for entry in model.bank.entries()}
    metadata = {"producer": "starfed train-local", "seed": str(seed)}
    codebook = Codebook(backbones.fingerprint, backbones.dims, finished, n_tasks, metadata)
    wire.write_file(run_dir / CODEBOOK_FILE, codebook)
    weights = options.download or bool(options.clip_weights and options.vit_weights)
    plot_accuracy_matrix(
        metrics["accuracy_matrix"],
        run_dir / MATRIX_PLOT,
        f"STAR-Prompt, {backbones.config.name} backbones, seed {seed}: "
        f"FAA {metrics['final_average_accuracy']:.1f}%",
        random_backbones_note(backbones.config.name, weights),
    )
    return run_dir
