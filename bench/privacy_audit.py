"""Privacy audit: an empirical lower bound on the ε of a private site's mixture release.

A canary image is put in one class of a site's training set (or left out), the class's G_c or
H_c is released as a private site releases it, and an auditor who knows everything but the
noise guesses from the release whether the canary was in. Its error rates bound ε from below:
an (ε, δ)-DP release has TPR ≤ e^ε·FPR + δ for every test (Jagielski et al. 2020, "Auditing
differentially private machine learning: how private is private SGD?"). With Clopper–Pearson
upper bounds on the false-positive and false-negative rates (confidence 1 − α over both)

    ε_lower = max(log((1 − δ − FNR⁺) / FPR⁺), log((1 − δ − FPR⁺) / FNR⁺)).

The release audited is one statistics release of one class with the noise multiplier
(``accountant.noise_multiplier``) that spends the whole claimed ε on it alone, so the bound is
checked against the claim itself, not against a fraction of it. The features are the real
pipeline's (``starfed.client.site``'s handlers on the bundled images, tiny backbones; H_c's views
augmented per image) and the ball the site's ``PrivateReleases.ball``; each run is one call of
``private_gaussian`` with fresh noise, so many runs are cheap. The auditor's score is the
released moments' projection on what the canary adds to them ((u, u²) for its clipped feature
u: the most the sensitivity √2 allows when ‖u‖ = 1), read back from the released mean and
variances — exact unless the release projected them onto what clipped data can have. The
threshold is the one that does best on the first half of the runs; the bound is computed on
the second.

``--one-run m`` adds the one-run audit (Steinke, Nasr, Jagielski 2023, "Privacy auditing with one
(1) training run"): m canaries, each in the class with probability ½, one release; the auditor
guesses in or out for the k canaries it is surest of, and the number it gets right bounds ε.

    python bench/privacy_audit.py                       # G_c and H_c, ε 1 4 8, 4000 runs each
    python bench/privacy_audit.py --epsilons 4 --runs 1000 --one-run 200 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from starfed.client.memory import SiteMemory
from starfed.client.privacy import PrivacySetting, PrivateReleases
from starfed.client.site import HANDLERS, TaskView
from starfed.shared.config import parse
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.data.images import decode_images
from starfed.shared.model.backbones import Backbones, create_backbones
from starfed.shared.model.features import clip_features
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig
from starfed.shared.privacy import accountant
from starfed.shared.privacy.mechanisms import clipped_moments, private_gaussian
from starfed.shared.protocol import Phase

DELTA = 1e-5
PHASES = {"G_c": Phase.STAGE1_STATS, "H_c": Phase.STAGE2_STATS}
AUDITED = "Apple___Apple_scab"  # the class whose release is audited
CANARIES = ("Tomato___healthy", "Corn_(maize)___healthy")  # classes the canaries are drawn from


def features_of(backbones: Backbones, statistic: str, images: torch.Tensor) -> torch.Tensor:
    """The features a private site's statistics phase computes for ``images`` (one class)."""
    phase = PHASES[statistic]
    model = StarPrompt(backbones)
    model.add_classes([AUDITED], seed=0)
    labels = torch.zeros(len(images), dtype=torch.int64)
    features, paths = clip_features(backbones, images), [""] * len(images)  # no paths: no units
    view = TaskView(model, 0, [AUDITED], labels, images, features, paths, 0, 0)
    captured = []

    def fit(features, labels_, rows, n_components, seed):
        captured.append(features)
        return [None] * len(rows)

    HANDLERS[phase](view, TrainConfig(seed=1993), fit=fit)
    return captured[0].double()


def images_of(folder: str, size: int, limit: int | None = None) -> torch.Tensor:
    paths = sorted((bundled_dataset_root() / "train" / folder).iterdir())[:limit]
    return decode_images([(str(p), 0) for p in paths], size, progress=False).images


def clopper_pearson_upper(errors: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    """One-sided Clopper–Pearson upper bounds on rates (confidence 1 − alpha each)."""
    errors = np.asarray(errors)
    upper = stats.beta.ppf(1 - alpha, errors + 1, np.maximum(trials - errors, 1))
    return np.where(errors >= trials, 1.0, upper)


def bounds(out: np.ndarray, into: np.ndarray, thresholds: np.ndarray, alpha: float) -> dict:
    """For each threshold (guess "in" above it): the error rates and Jagielski et al.'s bound
    with Clopper–Pearson upper bounds on both rates (α/2 each)."""
    fp = len(out) - np.searchsorted(np.sort(out), thresholds, side="right")
    fn = np.searchsorted(np.sort(into), thresholds, side="right")
    fpr = clopper_pearson_upper(fp, len(out), alpha / 2)
    fnr = clopper_pearson_upper(fn, len(into), alpha / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.maximum((1 - DELTA - fnr) / fpr, (1 - DELTA - fpr) / fnr)
        lower = np.where(ratios > 1, np.log(ratios), 0.0)
    return {"epsilon_lower": lower, "fpr": fp / len(out), "fnr": fn / len(into)}


def epsilon_lower_bound(out: np.ndarray, into: np.ndarray, alpha: float) -> dict:
    """Jagielski et al.'s bound from scores without (``out``) and with (``into``) the canary:
    the threshold that does best on the first half of the runs, its bound on the second."""
    half_out, half_in = len(out) // 2, len(into) // 2
    candidates = np.unique(np.concatenate([out[:half_out], into[:half_in]]))
    chosen = bounds(out[:half_out], into[:half_in], candidates, alpha)["epsilon_lower"]
    threshold = candidates[int(np.argmax(chosen))]
    evaluated = bounds(out[half_out:], into[half_in:], np.array([threshold]), alpha)
    return {key: float(value[0]) for key, value in evaluated.items()} | {
        "threshold": float(threshold)
    }


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Steinke et al.'s p-value of v right guesses of r among m canaries under (ε, δ)-DP."""
    q = 1 / (1 + math.exp(-epsilon))
    beta = float(stats.binom.sf(v - 1, r, q))
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += float(stats.binom.pmf(v - i, r, q))
        alpha = max(alpha, total / i)
    return min(1.0, beta + alpha * delta * 2 * m)


def one_run_lower_bound(m: int, r: int, v: int, confidence: float) -> float:
    """The largest ε the one-run audit rejects at ``confidence`` (0 when none)."""
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, DELTA) < 1 - confidence:
        hi += 1
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, DELTA) < 1 - confidence else (lo, mid)
    return lo


class Audit:
    """One statistic's features, its ball, and the canaries, for releases at any ε."""

    def __init__(self, statistic: str, state: Path) -> None:
        backbones = create_backbones("tiny", seed=0)
        size = backbones.config.image_size
        self.phase = PHASES[statistic]
        self.base = features_of(backbones, statistic, images_of(AUDITED, size))
        candidates = torch.cat([images_of(folder, size) for folder in CANARIES])
        self.candidates = features_of(backbones, statistic, candidates)
        gray = torch.full((1, 3, size, size), 128, dtype=torch.uint8)
        memory = SiteMemory(state, "audit", backbones.dims)
        setting = PrivacySetting.from_config(parse({"privacy-epsilon": 1.0}))
        releases = PrivateReleases(setting, memory, clip_features(backbones, gray)[0].double())
        self.centre, self.radius = releases.ball(self.phase, self.base.shape[1])
        self.known = np.concatenate(clipped_moments(self.base, self.centre, self.radius))
        self.units = np.stack(
            [
                np.concatenate(clipped_moments(c.unsqueeze(0), self.centre, self.radius))
                for c in self.candidates
            ]
        )  # what each canary adds to the moments: its clipped feature u and u²

    def released_moments(self, features: torch.Tensor, count: int, z: float, rng) -> np.ndarray:
        """The class's moments as read back from its release (sum and sum of squares, in units
        of the radius: mean × count and (variance + mean²) × count, exact unless the release
        projected them), less those without canaries (what the auditor knows)."""
        mixture = private_gaussian(features, self.centre, self.radius, count, z, rng)
        mean = (mixture.means[0] - self.centre.double()).numpy() / self.radius
        variance = mixture.variances[0].numpy() / self.radius**2
        moments = np.concatenate([mean * count, (variance + mean**2) * count])
        return moments - self.known

    def runs(self, epsilon: float, runs: int, alpha: float, rng) -> dict:
        """Jagielski et al.'s audit with the most exposed canary (largest clipped feature)."""
        z = accountant.noise_multiplier([], 1, epsilon, DELTA)
        pick = int(np.linalg.norm(self.units, axis=1).argmax())
        canary, direction = (
            self.candidates[pick],
            self.units[pick] / np.linalg.norm(self.units[pick]),
        )
        count = len(self.base)
        scores = {}
        for world, features in (("out", self.base), ("in", torch.cat([self.base, canary[None]]))):
            scores[world] = np.array(
                [self.released_moments(features, count, z, rng) @ direction for _ in range(runs)]
            )
        result = epsilon_lower_bound(scores["out"], scores["in"], alpha)
        return {
            "noise_multiplier": z,
            "canary_norm": float(np.linalg.norm(self.units[pick])),
            **result,
        }

    def one_run(self, epsilon: float, m: int, guesses: int, confidence: float, rng) -> dict:
        """Steinke et al.'s audit: ``m`` canaries, each in with probability ½, one release."""
        z = accountant.noise_multiplier([], 1, epsilon, DELTA)
        m = min(m, len(self.candidates))
        units, features = self.units[:m], self.candidates[:m]
        included = rng.random(m) < 0.5
        count = len(self.base) + m // 2
        noisy = self.released_moments(torch.cat([self.base, features[included]]), count, z, rng)
        expected_others = 0.5 * (units.sum(0)[None, :] - units)  # the auditor's prior
        directions = units / np.linalg.norm(units, axis=1, keepdims=True)
        scores = ((noisy[None, :] - expected_others) * directions).sum(1)
        order = np.argsort(scores)
        guessed_in, guessed_out = order[-(guesses // 2) :], order[: guesses // 2]
        right = int(included[guessed_in].sum() + (~included[guessed_out]).sum())
        lower = one_run_lower_bound(m, 2 * (guesses // 2), right, confidence)
        return {
            "canaries": m,
            "guesses": 2 * (guesses // 2),
            "right": right,
            "epsilon_lower": lower,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    parser.add_argument("--statistics", nargs="+", choices=sorted(PHASES), default=sorted(PHASES))
    parser.add_argument("--runs", type=int, default=4000, help="releases per world (with/without)")
    parser.add_argument("--alpha", type=float, default=0.05, help="1 − confidence of the bounds")
    parser.add_argument(
        "--one-run",
        type=int,
        default=0,
        metavar="M",
        help="canaries of the one-run audit (0: skip)",
    )
    parser.add_argument("--guesses", type=int, default=20, help="guesses of the one-run audit")
    parser.add_argument("--seed", type=int, default=0, help="the audit's own noise (not a site's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    results = []
    with tempfile.TemporaryDirectory() as state:
        for statistic in args.statistics:
            audit = Audit(statistic, Path(state) / statistic)
            for epsilon in args.epsilons:
                row = {"statistic": statistic, "claimed_epsilon": epsilon, "delta": DELTA}
                row |= audit.runs(epsilon, args.runs, args.alpha, rng)
                if args.one_run:
                    one = audit.one_run(epsilon, args.one_run, args.guesses, 1 - args.alpha, rng)
                    row["one_run"] = one
                results.append(row)
                if not args.json:
                    print(_line(row, args), flush=True)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    return 0 if all(r["epsilon_lower"] < r["claimed_epsilon"] for r in results) else 1


def _line(row: dict, args: argparse.Namespace) -> str:
    text = (
        f"{row['statistic']} ε {row['claimed_epsilon']:g} (z {row['noise_multiplier']:.3g}): "
        f"lower bound {row['epsilon_lower']:.3f} at {1 - args.alpha:.0%} "
        f"(FPR {row['fpr']:.4f}, FNR {row['fnr']:.4f}, {args.runs} runs per world)"
    )
    if "one_run" in row:
        one = row["one_run"]
        text += f"; one run: {one['right']}/{one['guesses']} right → {one['epsilon_lower']:.3f}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
