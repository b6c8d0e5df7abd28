"""Membership check: does a class's released mixture tell whether one image was in a site's set?

An observer holds one image of a class and the class's mixture a site released (its G_c, over
CLIP features), and guesses that the image was among the site's training images when a mixture
mean lies close to its feature. Per trial the site's set is ``n`` images of the class drawn from
the bundled mini Split CropDiseases (tiny backbones); the target is one of them or, as often,
one of the class's other images. The score is the AUC of "−(distance to the nearest released
mean)" over the trials: 0.5 is a coin toss, 1.0 always right. Released as starfed releases them:
without the privacy setting the ordinary fit (``mixture-components`` Gaussians); with it, one
clipped, noised Gaussian (``private_gaussian``) whose noise multiplier is what a class's budget
gives each of its five releases per task (``noise_multiplier``) — the attack sees one of them,
so the ε shown bounds the whole task's releases, not only this one. Any (ε, δ)-DP release
bounds every such test: true-positive rate ≤ e^ε · false-positive rate + δ.

    python bench/membership.py                    # n 10 and 40, 2000 trials, ε 1 4 8 ∞
    python bench/membership.py --n 10 --trials 500
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from starfed.shared.codebook.mixture import DEFAULT_COMPONENTS, GaussianMixture
from starfed.shared.config import parse
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.data.images import decode_images
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.features import clip_features
from starfed.shared.privacy.accountant import noise_multiplier
from starfed.shared.privacy.mechanisms import private_gaussian

RELEASES_PER_TASK = 5  # count, stage 1, G_c, stage 2, H_c at one round per stage
DELTA = 1e-5
CLIP_RADIUS = 0.4  # the privacy-clip-radius default, × √dim


def class_features(cache: Path) -> list[torch.Tensor]:
    """CLIP features of every training image of the bundled set, per class."""
    root = bundled_dataset_root() / "train"
    backbones = BackboneOptions.from_config(parse({})).load("cpu")
    features = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        samples = [(str(path), 0) for path in sorted(folder.iterdir())]
        decoded = decode_images(samples, backbones.config.image_size, cache, progress=False)
        features.append(clip_features(backbones, decoded.images))
    size = backbones.config.image_size
    gray = torch.full((1, 3, size, size), 128, dtype=torch.uint8)
    features.append(clip_features(backbones, gray))  # last: the clipping centre
    return features


@functools.cache
def per_release_noise(epsilon: float) -> float:
    z = noise_multiplier([], RELEASES_PER_TASK, epsilon, DELTA)
    assert z is not None, "a fresh budget affords its planned releases"
    return z


def released_means(
    members: torch.Tensor, epsilon: float, centre: torch.Tensor, rng: np.random.Generator
) -> torch.Tensor:
    if math.isinf(epsilon):
        return GaussianMixture.fit(members, DEFAULT_COMPONENTS, seed=0).means
    z = per_release_noise(epsilon)
    count = len(members)  # the noisy count is another release; the exact one favours the attack
    radius = CLIP_RADIUS * math.sqrt(members.shape[1])
    return private_gaussian(members, centre, radius, count, z, rng).means


def auc(
    features: list[torch.Tensor], centre: torch.Tensor, n: int, epsilon: float, trials: int
) -> float:
    rng = np.random.default_rng(0)
    scores, labels = [], []
    for _ in range(trials):
        pool = features[rng.integers(len(features))]
        order = rng.permutation(len(pool))
        members = pool[order[:n]]
        member = bool(rng.integers(2))
        target = pool[order[0]] if member else pool[order[n]]
        means = released_means(members, epsilon, centre, rng)
        scores.append(-float((means - target.double()).norm(dim=1).min()))
        labels.append(member)
    return float(roc_auc_score(labels, scores))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="10,40", help="site images of the class, comma-separated")
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--epsilons", default="1,4,8,inf")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "starfed" / "images"))
    args = parser.parse_args()
    torch.manual_seed(0)
    *features, centre = class_features(Path(args.cache))
    rows = []
    for n in (int(v) for v in args.n.split(",")):
        for epsilon in (float(v) for v in args.epsilons.split(",")):
            value = auc(features, centre[0], n, epsilon, args.trials)
            rows.append({"n": n, "epsilon": epsilon, "auc": round(value, 3)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
