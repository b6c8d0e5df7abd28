"""Privacy audit through a real site: a canary image at the clipping bound, the audit's power,
and a positive control (issue 44 item 6).

``bench/privacy_audit.py`` audits ``private_gaussian`` alone, on canary features computed
apart from the class's: coupling through the pipeline is invisible to it, and its 20 000 runs
cannot certify more than ε ≈ 7.9. Here the canary is an image file in a class folder of a real
private ``Site`` (``tests/test_privacy_sensitivity.py``'s ``release``: sync, both stages and
both statistics phases, noise off), so its features, the other images' and the release are the
site's own. A release is then what the site computes, which is deterministic given the images,
plus Gaussian noise independent of them: per statistics phase the moments m_in (canary in) or
m_out (out), read back from the released Gaussian, plus N(0, σ²) per coordinate, where σ is
the standard deviation the site drew, rescaled to spend the claimed ε in this one release
(σ · z_claim / z_site, with z_site the ledger's noise multiplier for it).

The auditor knows everything but the noise and uses the most powerful test (Neyman–Pearson:
the projection of the release on m_in − m_out), a score distributed N(0, 1) without the canary
and N(μ, 1) with it, μ = ‖m_in − m_out‖ / σ. The audit draws N such scores per world as a
histogram (a multinomial over fine bins: exact, and cheap for any N) and bounds ε from below
as ``privacy_audit`` does (Jagielski et al. 2020: Clopper–Pearson upper bounds on both error
rates; the threshold chosen on the first half of the runs, the bound computed on the second).

* **Canary at the bound.** A black image: its CLIP feature lies 1.8 radii from the mid-gray
  centre, so clipping puts it on the ball's edge (‖u‖ = 1, the most any image moves a sum).
  The sensitivity √2 is reached only by a feature along one axis (‖u²‖ = ‖u‖² = 1), which no
  image's is.
* **Power.** The smallest break r — a release that moves by r times the sensitivity the site
  claims — whose lower bound passes the claimed ε, at ε 1, 4 and 8 with N runs per world.
* **Positive control.** The same site with a broken release: ``unclipped`` (features summed
  unclipped) and ``noise-quarter`` (the moments' noise a quarter of what √2 needs); the audit
  must flag each at some ε. (Noise for sensitivity 1, not √2, is a break no image can show:
  no canary moves the moments by more than about 1.)

    python bench/privacy_audit_site.py                 # N = 10⁸ per world; JSON lines
    python bench/privacy_audit_site.py --runs 1000000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from privacy_audit import DELTA, clopper_pearson_upper
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_privacy_sensitivity import (  # the tests' site harness
    BLACK,
    CLASSES,
    data_folder,
    release,
    task_images,
)

from starfed.client.privacy import PrivacySetting
from starfed.shared.data.site_folder import class_key
from starfed.shared.model.backbones import create_backbones
from starfed.shared.privacy import accountant, mechanisms
from starfed.shared.protocol import Phase

PHASES = {"G_c": Phase.STAGE1_STATS, "H_c": Phase.STAGE2_STATS}
EPSILONS = (1.0, 4.0, 8.0)
#: The site's setting (noise off: its target sets only which classes clear the threshold).
SETTING = PrivacySetting(8.0, DELTA, 0.4, 1.0, 1e-4, 1e-4, 1, 1)
#: Bundled images of each class: at this setting a class is announced from 12 images (the
#: count's noise multiplier 2.36), so the canary's class clears it with and without the canary.
PER_CLASS = 16
#: Score bins of the histogram, in units of σ: wide enough that no run falls outside.
STEP = 0.005


def shift(released_in, released_out, phase: Phase, name: str) -> tuple[float, float]:
    """‖m_in − m_out‖ of class ``name``'s release, and the sensitivity the site claims for it
    (the standard deviation it drew over the ledger's noise multiplier)."""
    change = float(
        np.linalg.norm(released_in.moments[phase][name] - released_out.moments[phase][name])
    )
    (charged,) = set(released_in.charged[phase][class_key(name)])
    return change, released_in.noise[phase][0] / charged.noise_multiplier


def lower_bound(mu: float, runs: int, alpha: float, rng: np.random.Generator) -> float:
    """Jagielski et al.'s bound from ``runs`` scores per world, N(0, 1) out and N(mu, 1) in:
    the threshold that does best on one half, its bound on the other."""
    edges = np.arange(-8.0, mu + 8.0, STEP)
    p_out = np.diff(stats.norm.cdf(edges, 0.0))
    p_in = np.diff(stats.norm.cdf(edges, mu))

    def half() -> tuple[np.ndarray, np.ndarray, int]:
        n = runs // 2
        out = rng.multinomial(n, p_out / p_out.sum())
        into = rng.multinomial(n, p_in / p_in.sum())
        fp = out[::-1].cumsum()[::-1]  # out-scores at or above each bin: guessed "in"
        fn = np.concatenate([[0], into.cumsum()[:-1]])  # in-scores below it
        return fp, fn, n

    def bounds(fp: np.ndarray, fn: np.ndarray, n: int) -> np.ndarray:
        fpr = clopper_pearson_upper(fp, n, alpha / 2)
        fnr = clopper_pearson_upper(fn, n, alpha / 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.maximum((1 - DELTA - fnr) / fpr, (1 - DELTA - fpr) / fnr)
            return np.where(ratios > 1, np.log(ratios), 0.0)

    chosen = int(np.argmax(bounds(*half())))
    fp, fn, n = half()
    return float(bounds(fp[chosen : chosen + 1], fn[chosen : chosen + 1], n)[0])


def audit(mu_per_z: float, epsilon: float, runs: int, alpha: float, rng) -> dict:
    """The audit of one release spending ``epsilon`` alone, whose shift is ``mu_per_z`` noise
    multipliers' worth (‖Δ‖ / sensitivity claimed)."""
    z = accountant.noise_multiplier([], 1, epsilon, DELTA)
    bound = lower_bound(mu_per_z / z, runs, alpha, rng)
    return {"claimed_epsilon": epsilon, "z": z, "epsilon_lower": bound, "flagged": bound > epsilon}


def power(epsilon: float, runs: int, alpha: float, rng) -> float | None:
    """The smallest break r (in steps of 0.05, up to 4) the audit flags at ``epsilon``."""
    for r in np.arange(1.0, 4.0001, 0.05):
        if audit(float(r), epsilon, runs, alpha, rng)["flagged"]:
            return round(float(r), 2)
    return None


@contextmanager
def broken(name: str):
    """The site's release broken as ``name`` says, for the positive control."""
    if name == "unclipped":
        saved = mechanisms.clip_rows
        mechanisms.clip_rows = lambda x, centre, radius: (  # type: ignore[assignment]
            x.detach().to("cpu", torch.float64) - centre.to("cpu", torch.float64)
        )
        try:
            yield
        finally:
            mechanisms.clip_rows = saved
    elif name == "noise-quarter":
        saved_s = mechanisms.MOMENTS_SENSITIVITY
        mechanisms.MOMENTS_SENSITIVITY = math.sqrt(2.0) / 4
        try:
            yield
        finally:
            mechanisms.MOMENTS_SENSITIVITY = saved_s
    else:
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10**8, help="scores per world")
    parser.add_argument("--alpha", type=float, default=0.05, help="1 − confidence")
    parser.add_argument("--seed", type=int, default=0, help="the audit's own randomness")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    backbones = create_backbones("tiny", seed=0)
    canary = CLASSES[0]  # the class the black image is added to (task_images)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        images = task_images(root, PER_CLASS)
        without = [image for image in images if image[2] != BLACK]
        for control in ("none", "unclipped", "noise-quarter"):
            with broken(control):
                worlds = {
                    world: release(
                        backbones,
                        data_folder(root / control / world / "data", kept),
                        root / control / world / "state",
                        SETTING,
                    )
                    for world, kept in (("in", images), ("out", without))
                }
            unannounced = sorted(w for w, out in worlds.items() if canary not in out.counts)
            if unannounced:
                print(f"the canary's class is not announced in world {unannounced}: no audit")
                return 1
            for statistic, phase in PHASES.items():
                change, sensitivity = shift(worlds["in"], worlds["out"], phase, canary)
                row = {
                    "release": control,
                    "statistic": statistic,
                    "class_images": worlds["in"].counts[canary],
                    "canary_shift": change,
                    "sensitivity_drawn_for": sensitivity,
                    "runs_per_world": args.runs,
                    "audits": [
                        audit(change / sensitivity, e, args.runs, args.alpha, rng) for e in EPSILONS
                    ],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    smallest = {e: power(e, args.runs, args.alpha, rng) for e in EPSILONS}
    print(json.dumps({"power_smallest_break_flagged": smallest, "runs_per_world": args.runs}))
    honest = all(not a["flagged"] for r in rows if r["release"] == "none" for a in r["audits"])
    controls = {r["release"] for r in rows for a in r["audits"] if a["flagged"]}
    return 0 if honest and controls >= {"unclipped", "noise-quarter"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
