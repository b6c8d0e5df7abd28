"""`starfed train-local`: single-site continual STAR-Prompt over Split CropDiseases.

The baseline every federated run is compared with: one site holds all the data and learns
the tasks in order. Writes ``metrics.json``, ``accuracy_matrix.png`` and the final codebook
(``codebook.bin``) into the results directory and prints one table row per task.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from starfed.shared.codebook.codebook import Codebook
from starfed.shared.data.cropdiseases import SplitCropDiseases, bundled_dataset_root, decode_images
from starfed.shared.metrics import final_average_accuracy, final_forgetting, plot_accuracy_matrix
from starfed.shared.model.backbone_config import PAPER_VIT_TAGS, PRESETS
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.evaluation import evaluate_decoded
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, clip_features, learn_task

CODEBOOK_FILE = "codebook.bin"


@dataclass
class LocalRunOptions:
    """Everything that defines a single-site run (recorded in metrics.json)."""

    data_root: str = field(default_factory=lambda: str(bundled_dataset_root()))
    n_tasks: int = 7
    classes_per_task: int | None = None
    preset: str = "tiny"
    backbone_config: str | None = None
    clip_weights: str | None = None
    vit_weights: str | None = None
    download: bool = False
    vit_tag: str = "augreg_in21k"
    classify_with_keys: bool = False
    results_dir: str = "results"
    run_name: str | None = None
    cache_dir: str | None = None
    train: TrainConfig = field(default_factory=TrainConfig)


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
    console = console or Console(stderr=True)
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
    )
    model = StarPrompt(backbones, confidence_modulation=config.confidence_modulation)
    size = backbones.config.image_size
    console.print(
        f"[bold]starfed train-local[/] {split.n_tasks} tasks × {split.classes_per_task} classes "
        f"from {split.root} · backbones {backbones.config.name} "
        f"({backbones.fingerprint[:12]}) · seed {config.seed}"
    )
    train = decode_images(split.samples("train", range(split.n_tasks)), size, options.cache_dir)
    test = decode_images(split.samples("test", range(split.n_tasks)), size, options.cache_dir)
    if train.n_skipped or test.n_skipped:
        console.print(f"[yellow]skipped {train.n_skipped + test.n_skipped} unreadable images")
    test_features = clip_features(backbones, test.images)  # frozen CLIP: computed once

    matrix: list[list[float]] = []
    selection: list[list[float]] = []
    task_seconds: list[float] = []
    table = Table("task", "accuracy per seen task (%)", "avg", "selection (%)", "s")
    with _progress(console) as progress:
        for t in range(split.n_tasks):
            task_start = time.perf_counter()
            labels = split.task_labels(t)
            n_past = len(model)
            model.add_classes([split.class_folders[r] for r in labels], seed=config.seed)
            in_task = torch.isin(train.labels, torch.tensor(labels))
            images, targets = train.images[in_task], train.labels[in_task]
            features = clip_features(backbones, images)
            learn_task(model, images, targets, features, n_past, t, config, progress)

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
    run_dir = Path(options.results_dir) / (
        options.run_name or datetime.now(UTC).strftime("local-%Y%m%d-%H%M%S")
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    Codebook.from_bank(
        model.bank,
        backbones.fingerprint,
        version=split.n_tasks,
        frozen=model.bank.names,
        metadata={"producer": "starfed train-local", "seed": str(config.seed)},
    ).save(run_dir / CODEBOOK_FILE)
    plot_accuracy_matrix(
        matrix,
        run_dir / "accuracy_matrix.png",
        f"STAR-Prompt, {backbones.config.name} backbones, seed {config.seed}: "
        f"FAA {metrics['final_average_accuracy']:.1f}%",
    )
    console.print(
        f"[bold green]FAA {metrics['final_average_accuracy']:.2f}%[/] · forgetting "
        f"{metrics['final_forgetting']:.2f} · wall {metrics['wall_time_s']:.0f}s · "
        f"results in {run_dir}"
    )
    metrics["run_dir"] = str(run_dir)
    return metrics


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = TrainConfig()
    p = subparsers.add_parser(
        "train-local",
        help="single-site continual training over Split CropDiseases (the baseline)",
        description=(
            "Train STAR-Prompt on one site, task after task, and evaluate on every seen task. "
            "Defaults: the bundled 28-class mini set (7 tasks × 4), tiny random backbones, the "
            "reference's Split CropDiseases hyper-parameters."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    data = p.add_argument_group("data")
    data.add_argument("--data-root", default=str(bundled_dataset_root()), help="ImageFolder root")
    data.add_argument("--tasks", type=int, default=7, help="number of tasks")
    data.add_argument("--classes-per-task", type=int, default=None, help="default: all / tasks")
    data.add_argument("--seed", type=int, default=defaults.seed, help="class order and training")
    data.add_argument("--cache-dir", default=None, help="reuse decoded images across runs")
    bb = p.add_argument_group("backbones")
    bb.add_argument("--preset", choices=PRESETS, default="tiny")
    bb.add_argument("--backbone-config", default=None, help="JSON config (overrides --preset)")
    bb.add_argument("--clip-weights", default=None, help="local CLIP weights (.safetensors/.pt)")
    bb.add_argument("--vit-weights", default=None, help="local ViT weights (.safetensors/.pt)")
    bb.add_argument("--download", action="store_true", help="fetch paper weights from the hub")
    bb.add_argument("--vit-tag", choices=PAPER_VIT_TAGS, default="augreg_in21k")
    tr = p.add_argument_group("training")
    tr.add_argument("--epochs", type=int, default=None, help="stage-1 and stage-2 epochs")
    tr.add_argument("--batch-size", type=int, default=defaults.batch_size)
    tr.add_argument("--replay-epochs", type=int, default=None, help="first-level replay epochs")
    ab = p.add_argument_group("ablations (paper, Tab. 3)")
    ab.add_argument("--no-generative-replay", action="store_true")
    ab.add_argument("--unimodal", action="store_true", help="one Gaussian instead of a MoG")
    ab.add_argument("--no-confidence-modulation", action="store_true")
    ab.add_argument("--classify-with-keys", action="store_true", help="predict with keys only")
    out = p.add_argument_group("output")
    out.add_argument("--results-dir", default="results")
    out.add_argument("--run-name", default=None, help="default: local-<timestamp>")
    out.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, args.threads))
    overrides = {}
    if args.epochs is not None:
        overrides |= {"stage1_epochs": args.epochs, "stage2_epochs": args.epochs}
    if args.replay_epochs is not None:
        overrides["replay1_epochs"] = args.replay_epochs
    train = TrainConfig(
        seed=args.seed,
        batch_size=args.batch_size,
        generative_replay=not args.no_generative_replay,
        mixture_components=1 if args.unimodal else TrainConfig.mixture_components,
        confidence_modulation=not args.no_confidence_modulation,
        **overrides,
    )
    options = LocalRunOptions(
        data_root=args.data_root,
        n_tasks=args.tasks,
        classes_per_task=args.classes_per_task,
        preset=args.preset,
        backbone_config=args.backbone_config,
        clip_weights=args.clip_weights,
        vit_weights=args.vit_weights,
        download=args.download,
        vit_tag=args.vit_tag,
        classify_with_keys=args.classify_with_keys,
        results_dir=args.results_dir,
        run_name=args.run_name,
        cache_dir=args.cache_dir,
        train=train,
    )
    run_local(options)
    return 0
