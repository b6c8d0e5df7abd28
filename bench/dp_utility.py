"""What differential privacy costs when sites hold hundreds of images per class (issue 44).

The bundled mini Split CropDiseases holds 80 training images per class, spread over five sites:
a few per class per site, too few for any noise to hide one image behind (docs/results.md).
No larger dataset can be downloaded here, so this script makes one: ``classes`` bundled classes
(chosen by ``--data-seed``), each training image expanded into ``copies`` distinct images by
seeded augmentations (a random crop of 60–100 % of the area, aspect 3:4–4:3, resized back; a
horizontal flip with probability ½; a rotation of ±15°; brightness, contrast and saturation
× 0.8–1.2), the test images copied unchanged from the bundled test split. Every copy of source
image ``i`` of a class is ``s<iii>-v<j>.jpg``, so each run of ``copies`` consecutive images is one
source photo's: ``simulated-patient-images = copies`` makes each source photo one simulated
patient, kept at one site by the partition.

Then the grid: ``num-sites`` 2 sites (``alpha`` 10 000: each class shared about evenly, so a site
holds about ``80 × copies / 2`` images of a class), ``classes / 2`` tasks of 2 classes, without
the privacy setting and at ε 8, 4, 1 per image and per patient (k = ``copies``), the paper's
three seeds, ``--jobs 1``; 2 epochs of stage 1 and 1 of stage 2 (the default run's 5 and 5
would take a 2-core machine about 6 min a cell).

    python bench/dp_utility.py --out /tmp/dpu                    # the data, the grid, the runs
    python bench/dp_utility.py --out /tmp/dpu --data-only        # the data and grid file only
    python bench/dp_utility.py --out /tmp/dpu --attribute 1993   # ε 8, each release un-noised
    python bench/dp_utility.py --out /tmp/dpu --attribute 1996 --unnoised updates
    python bench/dp_utility.py --out /tmp/dpu --attribute 1993 --unnoised stage1 stage2

Augmented copies of one photo are correlated: the per-image unit counts each copy as an image,
which is weaker than a guarantee per photo; the patient unit with k = copies is the one that
covers a source photo (docs/results.md#dp-at-realistic-sizes-benchdp_utilitypy).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import numpy as np
from PIL import Image, ImageEnhance

from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.protocol import Phase

EPSILONS = (8.0, 4.0, 1.0)


def augment(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """One distinct copy: crop, flip, rotation and colour, each drawn from ``rng``."""
    width, height = image.size
    area = width * height * rng.uniform(0.6, 1.0)
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    w = min(width, round(np.sqrt(area * aspect)))
    h = min(height, round(np.sqrt(area / aspect)))
    left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
    out = image.crop((left, top, left + w, top + h)).resize((width, height), Image.BILINEAR)
    if rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    out = out.rotate(rng.uniform(-15, 15), resample=Image.BILINEAR)
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        out = enhance(out).enhance(rng.uniform(0.8, 1.2))
    return out


def make_root(out: Path, classes: int, copies: int, seed: int) -> list[str]:
    """Write ``out/train/<class>/s<i>-v<j>.jpg`` and ``out/test/<class>/``; the classes."""
    bundled = bundled_dataset_root()
    available = sorted(p.name for p in (bundled / "train").iterdir() if p.is_dir())
    picked = np.random.default_rng(seed).permutation(len(available))[:classes]
    chosen = sorted(available[i] for i in picked)
    shutil.rmtree(out, ignore_errors=True)
    for c, name in enumerate(chosen):
        train = out / "train" / name
        train.mkdir(parents=True)
        for i, source in enumerate(sorted((bundled / "train" / name).iterdir())):
            image = Image.open(source).convert("RGB")
            for j in range(copies):
                rng = np.random.default_rng([seed, c, i, j])
                augment(image, rng).save(train / f"s{i:03d}-v{j}.jpg", quality=95)
        shutil.copytree(bundled / "test" / name, out / "test" / name)
    return chosen


def grid(root: Path, classes: int, copies: int, epochs: tuple[int, int]) -> str:
    """The experiment grid: ε ∞, then ε 8, 4, 1 per image and per patient (k = copies)."""
    lines = [
        "# bench/dp_utility.py: DP at realistic sizes (docs/results.md)",
        "[experiment]",
        'name = "dp-utility"',
        "seeds = [1993, 1996, 1997]",
        'methods = ["starfed"]',
        "",
        "[defaults]",
        f'data-root = "{root}"',
        "num-sites = 2",
        "alpha = 10000.0",
        f"num-tasks = {classes // 2}",
        "classes-per-task = 2",
        f"simulated-patient-images = {copies}",
        f"stage1-epochs = {epochs[0]}",
        f"stage2-epochs = {epochs[1]}",
        "",
        "[[scenario]]",
        'name = "eps-inf"',
        "privacy-epsilon = 0.0",
    ]
    for unit in ("image", "patient"):
        for epsilon in EPSILONS:
            lines += [
                "",
                "[[scenario]]",
                f'name = "{unit}-eps-{epsilon:g}"',
                f"privacy-epsilon = {epsilon}",
                f'privacy-unit = "{unit}"',
                f"privacy-patient-images = {copies}",
            ]
    return "\n".join(lines) + "\n"


#: Where ε 8's loss comes from: the run with one kind of release left un-noised (clipped as
#: the setting clips it, its noise multiplier 0; the ledger still records the planned one):
#: the training phases' DP-SGD steps (both, or one), or the statistics. A measurement only:
#: such a run is not private.
UNNOISED = {
    "updates": (Phase.STAGE1, Phase.STAGE2),  # prompt and head updates: clipped, not noised
    "stage1": (Phase.STAGE1,),  # stage 1's prompts only; stage 2's noised as usual
    "stage2": (Phase.STAGE2,),  # stage 2's Q_c, A_c and head rows only; stage 1's noised
    "statistics": (Phase.STAGE1_STATS, Phase.STAGE2_STATS),  # G_c, H_c: clipped, not noised
}


def unnoised(kind: str) -> mock._patch:
    """The patch that leaves ``kind``'s releases un-noised."""
    from starfed.client import privacy

    phases = UNNOISED[kind]
    if Phase.STAGE1_STATS in phases:
        fit = privacy.private_gaussian

        def gaussian(features, centre, radius, count, z, rng, group=1):
            return fit(features, centre, radius, count, 0.0, rng, group)

        return mock.patch.object(privacy, "private_gaussian", gaussian)
    steps = privacy.PrivateReleases.steps

    def dp_sgd(self, phase, names, plan, paths):
        dp = steps(self, phase, names, plan, paths)
        return dp if dp is None or phase not in phases else replace(dp, noise_multiplier=0.0)

    return mock.patch.object(privacy.PrivateReleases, "steps", dp_sgd)


def attribute(
    grid_file: Path, out: Path, seed: int, epsilon: float, kinds: list[str]
) -> dict[str, float]:
    """FAA of the grid's image-unit run at ``epsilon`` with each kind of release un-noised,
    in this process (the local runtime, so the patch reaches every simulated site)."""
    from starfed.shared.config import parse
    from starfed.simulations.grid import load
    from starfed.simulations.local_grid import run_locally

    values = next(
        s.run_config for s in load(str(grid_file)).scenarios if s.name == f"image-eps-{epsilon:g}"
    )
    faa = {}
    for kind in kinds:
        config = {**parse({**values, "seed": seed}), "results-dir": str(out)}
        config["run-name"] = f"{kind}-unnoised-eps-{epsilon:g}-seed{seed}"
        with unnoised(kind):
            metrics = run_locally(config)
        faa[kind] = float(metrics["final_average_accuracy"])
        print(f"ε {epsilon:g}, {kind} un-noised, seed {seed}: FAA {faa[kind]:.2f}", flush=True)
    return faa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="data root, grid and results")
    parser.add_argument("--classes", type=int, default=8, help="bundled classes (even)")
    parser.add_argument("--copies", type=int, default=7, help="augmented copies per image")
    parser.add_argument("--data-seed", type=int, default=0, help="classes and augmentations")
    parser.add_argument("--stage1-epochs", type=int, default=2, help="(default run: 5)")
    parser.add_argument("--stage2-epochs", type=int, default=1, help="(default run: 5)")
    parser.add_argument("--data-only", action="store_true", help="write the data and grid only")
    parser.add_argument(
        "--attribute",
        type=int,
        metavar="SEED",
        help="instead of the grid: ε 8 per image with one kind of release un-noised",
    )
    parser.add_argument(
        "--unnoised",
        nargs="+",
        choices=list(UNNOISED),
        default=list(UNNOISED),
        help="with --attribute: the kinds, one run each (default: both)",
    )
    args = parser.parse_args(argv)
    if args.classes < 2 or args.classes % 2:
        parser.error("--classes must be even (tasks of 2 classes)")
    root, grid_file = args.out / "data", args.out / "dp-utility.toml"
    if args.attribute is not None:  # on the data and grid already written
        if not grid_file.is_file():
            parser.error(f"--attribute: no {grid_file}; run with --data-only first")
        attribute(grid_file, args.out / "attribution", args.attribute, 8.0, args.unnoised)
        return 0
    chosen = make_root(root, args.classes, args.copies, args.data_seed)
    epochs = (args.stage1_epochs, args.stage2_epochs)
    grid_file.write_text(grid(root.resolve(), args.classes, args.copies, epochs))
    print(f"{root}: {len(chosen)} classes ({', '.join(chosen)}), ×{args.copies} copies")
    print(f"grid: {grid_file}")
    if args.data_only:
        return 0
    starfed = str(Path(sys.executable).with_name("starfed"))  # this environment's
    results = ["--results-dir", str(args.out / "results"), "--jobs", "1"]
    return subprocess.call([starfed, "experiment", str(grid_file), *results])


if __name__ == "__main__":
    sys.exit(main())
