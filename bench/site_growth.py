"""A site's work per step as the federation's past classes grow: it should not.

The same 4 current classes and 80 random images at every size; a tiny-preset model holding C
classes (the first C − 4 past), one thread; CPU seconds of the site's four steps
(``shared/model/training.py``: ``stage1``, ``stage1_stats``, ``stage2``, ``stage2_stats``).

    python bench/site_growth.py                      # C = 8, 104, 404, 1004
"""

from __future__ import annotations

import os
import time

import torch

from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.features import clip_features
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import (
    TaskTraining,
    TrainConfig,
    stage1,
    stage1_stats,
    stage2,
    stage2_stats,
)

NEW = 4
PER_CLASS = 20


def site_seconds(model: StarPrompt, n_past: int, images, features, config) -> dict:
    """CPU seconds of each of the site's steps on the current classes' images."""
    labels = torch.arange(n_past, n_past + NEW).repeat_interleave(PER_CLASS)
    on = TaskTraining(model, labels, n_past, config, 1)
    steps = {
        "stage1": lambda: stage1(on, features),
        "stage1_stats": lambda: stage1_stats(on, features),
        "stage2": lambda: stage2(on, images),
        "stage2_stats": lambda: stage2_stats(on, images),
    }
    cpu = {}
    for name, step in steps.items():
        start = time.process_time()
        step()
        cpu[name] = round(time.process_time() - start, 3)
    return cpu


def main() -> None:
    torch.set_num_threads(1)
    backbones = create_backbones("tiny", seed=0)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (NEW * PER_CLASS, 3, 64, 64), generator=generator)
    images = images.to(torch.uint8)
    features = clip_features(backbones, images)
    config = TrainConfig(stage1_epochs=2, stage2_epochs=2)
    for n_past in (4, 100, 400, 1000):
        model = StarPrompt(backbones)
        model.add_classes([f"class {i}" for i in range(n_past + NEW)], seed=0)
        cpu = site_seconds(model, n_past, images, features, config)
        print(f"{n_past + NEW:5d} classes: CPU-s {cpu}, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
