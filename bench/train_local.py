"""Benchmark: `starfed train-local` wall time and stage-2 training throughput (images/s).

Usage: ``python bench/train_local.py [--seed 1993] [--skip-run]``. Prints a JSON summary;
record the numbers in bench/results/train_local.md with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch
from rich.console import Console

from starfed.shared.data.cropdiseases import SplitCropDiseases, bundled_dataset_root
from starfed.shared.data.images import decode_images
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TaskTraining, TrainConfig, stage2
from starfed.simulations.train_local import LocalRunOptions, run_local


def stage2_throughput(n_images: int, epochs: int, seed: int) -> float:
    """Images/s of the stage-2 loop (augment, CLIP query, prompted ViT fwd+bwd, Adam step)."""
    backbones = create_backbones("tiny")
    split = SplitCropDiseases.from_root(bundled_dataset_root(), seed=seed)
    data = decode_images(split.samples("train", [0]), backbones.config.image_size, progress=False)
    model = StarPrompt(backbones)
    labels = split.task_labels(0)
    model.add_classes([split.class_folders[r] for r in labels], seed)
    images = data.images[:n_images]
    row = {label: i for i, label in enumerate(labels)}  # the model's rows of the task's classes
    targets = torch.tensor([row[int(label)] for label in data.labels[:n_images]])
    config = TrainConfig(stage2_epochs=1, seed=seed)
    stage2(TaskTraining(model, targets, 0, config, task=0), images)  # warm-up
    start = time.perf_counter()
    for round_index in range(epochs):
        stage2(TaskTraining(model, targets, 0, config, task=0, round_index=round_index), images)
    return epochs * len(targets) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=1993)
    parser.add_argument("--skip-run", action="store_true", help="only the throughput part")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    summary: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "stage2_images_per_s": round(stage2_throughput(320, 3, args.seed), 1),
    }
    if not args.skip_run:
        with tempfile.TemporaryDirectory() as tmp:
            options = LocalRunOptions(
                results_dir=tmp, run_name="bench", train=TrainConfig(seed=args.seed)
            )
            metrics = run_local(options, Console(stderr=True, quiet=True))
        summary["train_local_wall_s"] = round(metrics["wall_time_s"], 1)
        summary["train_local_task_s"] = [round(s, 1) for s in metrics["task_wall_time_s"]]
        summary["final_average_accuracy"] = round(metrics["final_average_accuracy"], 2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
