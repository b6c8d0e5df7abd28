"""The statistics steps' mixture fits: scikit-learn's per-class fit vs the batched torch fit.

    python bench/mixture_fit.py --dims T,paper --repeats 5 --steps 2 --json out.json

Two parts, both interleaved (each repetition times one side then the other, alternating which
goes first, so the shared machine's load hits both alike):

* ``fits``: the fit alone of one statistics step (stage-1 statistics: CLIP features, stage-2
  statistics: prompted CLS features of augmented views) of the bundled set's task 0 on one
  site. At T dims the real features of the T backbones; at paper dims those features lifted
  to 768 dimensions (``lifted``): EM's iteration count, hence its cost, depends on the data's
  shape, and the paper backbones' own features cost minutes per task on a CPU.
* ``steps`` (T dims only): a single site's whole task steps (stage 1 → stage-2 statistics →
  head replay, ``learn_task``'s order) on the bundled images with the default hyper-parameters,
  each phase's process CPU time; the statistics steps' share of the step with either fit.

Times are medians of wall and process CPU seconds (the CPU time is steadier on a shared
machine).

``--device cuda`` runs the batched fit there (the scikit-learn side stays on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from starfed.shared.codebook.mixture_fit import fit_on
from starfed.shared.data.cropdiseases import SplitCropDiseases, bundled_dataset_root
from starfed.shared.data.images import decode_images
from starfed.shared.model import features as model_features
from starfed.shared.model import training
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.star_prompt import StarPrompt

CONFIG_T = Path(__file__).resolve().parent / "config-T-backbone.json"
SEED = 1993
PHASES = ("stage1", "stage1_stats", "replay1", "stage2", "stage2_stats", "replay2")
STATISTICS = ("stage1_stats", "stage2_stats")


def real_features(split: SplitCropDiseases, backbones) -> dict[str, tuple[torch.Tensor, ...]]:
    """Task 0's features at T dims, as each statistics step fits them: raw CLIP features, and
    prompted CLS features of augmented views (fresh prompts)."""
    data = decode_images(split.samples("train", [0]), backbones.config.image_size, progress=False)
    labels = data.labels - split.task_labels(0)[0]
    model = StarPrompt(backbones)
    model.add_classes([split.class_folders[label] for label in split.task_labels(0)], SEED)
    generator = torch.Generator().manual_seed(SEED)
    return {
        "stage1_stats": (model_features.clip_features(backbones, data.images), labels),
        "stage2_stats": (model_features.vit_features(model, data.images, generator), labels),
    }


def lifted(features: torch.Tensor, dim: int) -> torch.Tensor:
    """``features`` mapped to ``dim`` dimensions by a fixed random linear map plus 1 % noise: the
    paper's feature size with the T features' cluster shape (and so EM's iteration count), as
    the paper backbones' features cost minutes per task on a CPU."""
    g = torch.Generator().manual_seed(SEED)
    lift = torch.randn(features.shape[1], dim, generator=g) / features.shape[1] ** 0.5
    out = features @ lift
    return out + 0.01 * out.std() * torch.randn(out.shape, generator=g)


#: The paper's feature sizes: ViT-L/14's CLIP embedding and ViT-B/16's CLS (the paper preset
#: names its models, so its config holds no sizes).
PAPER_DIMS = {"stage1_stats": 768, "stage2_stats": 768}


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> tuple[float, float]:
    """(wall, process CPU) seconds of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_fits(
    features: dict[str, tuple[torch.Tensor, ...]], device: torch.device, repeats: int
) -> dict:
    """Median wall and CPU seconds of one statistics step's fit, per phase and side."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sides = {"sklearn": training.fit_mixtures, "batched": fit_on(device)}
    out = {}
    for phase, (x, y) in features.items():
        rows = range(int(y.max()) + 1)
        times: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        sides["batched"](x, y, rows, 5, SEED)  # warm-up (kernels, allocator)
        for r in range(repeats):
            for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                times[side].append(timed(partial(sides[side], x, y, rows, 5, SEED), sync))
        cell: dict = {"dim": x.shape[1]}
        for side, pairs in times.items():
            cell[f"{side}_wall_s"] = round(statistics.median(w for w, _ in pairs), 4)
            cell[f"{side}_cpu_s"] = round(statistics.median(c for _, c in pairs), 4)
        cell["cpu_ratio"] = round(cell["sklearn_cpu_s"] / cell["batched_cpu_s"], 2)
        out[phase] = cell
    return out


def phase_calls(model, features, images, labels, n_past, config, task, fit) -> dict:
    """Each phase of one task step as a call (``learn_task``'s order)."""
    on = training.TaskTraining(model, labels, n_past, config, task)
    return {
        "stage1": partial(training.stage1, on, features),
        "stage1_stats": partial(training.stage1_stats, on, features, fit),
        "replay1": partial(training.replay1, model, n_past, config, task),
        "stage2": partial(training.stage2, on, images),
        "stage2_stats": partial(training.stage2_stats, on, images, fit),
        "replay2": partial(training.replay2, model.bank, n_past, config, task),
    }


def task_step(split: SplitCropDiseases, backbones, task: int, fit) -> dict[str, float]:
    """CPU seconds of each phase of task ``task``'s step (after tasks ``0..task-1``)."""
    config = training.TrainConfig(seed=SEED)
    model = StarPrompt(backbones)
    seconds: dict[str, float] = {}
    for t in range(task + 1):
        data = decode_images(
            split.samples("train", [t]), backbones.config.image_size, progress=False
        )
        n_past = len(model)
        model.add_classes([split.class_folders[label] for label in split.task_labels(t)], SEED)
        labels = data.labels - split.task_labels(t)[0] + n_past
        features = model_features.clip_features(backbones, data.images)
        calls = phase_calls(model, features, data.images, labels, n_past, config, t, fit)
        seconds = {phase: timed(calls[phase], lambda: None)[1] for phase in PHASES}
        training.add_counts(model, labels, n_past)
    return seconds


def bench_steps(split: SplitCropDiseases, backbones, tasks: int, repeats: int) -> dict:
    """Per-phase CPU seconds of the last of ``tasks`` task steps at T dims, both fits,
    interleaved."""
    sides = {"sklearn": training.fit_mixtures, "batched": fit_on(torch.device("cpu"))}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for r in range(repeats):
        for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            runs[side].append(task_step(split, backbones, tasks - 1, sides[side]))
    out = {}
    for side, per_run in runs.items():
        phases = {p: round(statistics.median(run[p] for run in per_run), 3) for p in PHASES}
        total = sum(phases.values())
        share = sum(phases[p] for p in STATISTICS) / total
        out[side] = {"phases_s": phases, "step_s": round(total, 3), "fit_share": round(share, 4)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dims", default="T,paper", help="comma-separated: T, paper")
    parser.add_argument("--device", default="cpu", help="where the batched fit runs")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side")
    parser.add_argument(
        "--steps", type=int, default=2, help="task steps of the T-dims run; 0: skip"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    dims = [d.strip() for d in args.dims.split(",") if d.strip()]
    if unknown := [d for d in dims if d not in ("T", "paper")]:
        parser.error(f"unknown dims: {unknown}")
    torch.set_num_threads(args.threads)
    split = SplitCropDiseases.from_root(bundled_dataset_root(), seed=SEED)
    backbones = create_backbones(config_path=CONFIG_T)
    features = real_features(split, backbones)
    sizes = {
        "T": features,
        "paper": {phase: (lifted(x, PAPER_DIMS[phase]), y) for phase, (x, y) in features.items()},
    }
    result: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": args.threads,
        "device": args.device,
        "load_1min": os.getloadavg()[0],
        "fits": {},
    }
    for d in dims:
        result["fits"][d] = bench_fits(sizes[d], torch.device(args.device), args.repeats)
    report(result, args.json)  # the fits now: the steps part takes minutes per task on a CPU
    if args.steps:
        result["steps_T"] = bench_steps(split, backbones, args.steps, max(1, args.repeats // 2))
        report(result, args.json)


def report(result: dict, path: str | None) -> None:
    result["load_1min_end"] = os.getloadavg()[0]
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if path:
        Path(path).write_text(text + "\n")


if __name__ == "__main__":
    main()
