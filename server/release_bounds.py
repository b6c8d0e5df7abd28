"""The most a private site's training release can move one row: derived from its DP-SGD.

A private site trains by DP-SGD (``shared.model.training.PrivateSteps``): T steps, each taking
every protected unit with probability q (Poisson), clipping each taken unit's gradient to C,
adding Gaussian noise z·C per coordinate to their sum, and dividing by E = q·N, the images a
step takes on average by the released counts N. What it releases is the optimizer's change
over those steps. The server knows every number of that but the noise the site drew: C, the
batch size b and the epochs are the run config's (a node cannot change them), q = min(1, b/N)
and T = epochs · ⌈1/q⌉ follow from the counts of the reply (capped at the sync's), and the
rates and the optimizer are ``TrainConfig``'s. So each row's change is bounded from the
training itself (``TrainingRelease.row_bound``), in the units of the row (the L2 norm of its
change from the value sent), for a row of d values:

- **Stage 1, SGD without momentum** at rate η: the row moves by η/E × the sum over the steps
  of (the clipped gradients, at most C per unit taken, plus the noise), so
  ‖Δ‖ ≤ η·C/E · (S + z·√T·(√d + s)), where S bounds the units the T steps take together and
  z·C·√T·(√d + s) the noise's norm over the row (a sum of T Gaussians per coordinate; Gaussian
  concentration of the norm, s = √(2 ln 10⁹)). S is the 1 − 10⁻⁹ Bernstein bound of a
  Binomial(T·U, q) (T·U when q = 1), where U, the site's units, is at most its true images: a
  released count N_c is the true one plus Gaussian noise of z_c·k, announced only over a
  threshold of k(1 + z_c·τ) with τ = Φ⁻¹(1 − δ/2) (``client.privacy``: the run's δ, which a
  site's own can only lower), so z_c·k < N_c/τ and the true count is at most
  N_c + ½ + Φ⁻¹(1 − 10⁻⁹/K)·N_c/τ (at δ 10⁻⁵, 2.4 × N_c) whatever its noise multiplier.
  z is ``MAX_NOISE_MULTIPLIER`` (100): the multiplier the registered ε gives a class's planned
  releases is only the smallest it uses, since each release beyond the plan (a resumed phase, a
  class trained again, another federation's releases in its ledger) raises it, up to that
  maximum, past which the site refuses to release.
- **Stage 2, Adam** (β₁ 0.9, β₂ 0.999, torch's) at rate η_t (cosine over the epochs): each
  coordinate moves at step t by at most η_t·κ_t, κ_t = (1 − β₁)/(1 − β₁ᵗ) · √((1 − β₂ᵗ)/(1 − β₂))
  · √((1 − γᵗ)/(1 − γ)), γ = β₁²/β₂ (Cauchy–Schwarz on the moment estimates: κ₁ = 1, κ_t < 7.3),
  whatever the gradients and their noise, so ‖Δ‖ ≤ √d · Σ_t η_t·κ_t: no probability, no z.

The failure probability is at most 3 × 10⁻⁹ per row (counts, sampling, noise); the float
arithmetic adds its rounding (``ROUNDING``, ``STEP_ROUNDING``). The screen holds a private
site's rows to the tighter of this and ``reference-bound`` × its class's size
(``server.field_bounds``; docs/security.md §1b).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from starfed.shared.model.training import TrainConfig
from starfed.shared.privacy.accountant import MAX_NOISE_MULTIPLIER
from starfed.shared.protocol import Phase

#: The probability with which each part of the bound (counts, sampling, noise) may fail.
FAILURE = 1e-9
#: Adam's moment decays: torch's defaults, which stage 2 uses (``shared.model.training``).
ADAM_BETAS = (0.9, 0.999)
#: A row's rounding, relative to its norm: on the wire (float16's half a unit in the last
#: place; float32's is less), and per float32 optimizer step.
ROUNDING = 2.0**-11
STEP_ROUNDING = 2.0**-23


class Optimizer(enum.Enum):
    """How a training phase turns its noisy gradients into a change."""

    SGD = "sgd"  # stage 1: plain SGD, constant rate
    ADAM = "adam"  # stage 2: Adam, cosine rate over the epochs


@dataclass(frozen=True)
class TrainingRelease:
    """What fixes a private site's training release in one phase: the run's batch size,
    epochs, clip and δ, the phase's optimizer and rate."""

    optimizer: Optimizer
    lr: float
    epochs: int
    batch_size: int
    clip: float
    delta: float  # the run's privacy-delta: a site's own is at most it

    @classmethod
    def of(
        cls, phase: Phase, batch_size: int, epochs: int, clip: float, delta: float
    ) -> TrainingRelease:
        """Stage 1's (SGD) or stage 2's (Adam) release."""
        if phase is Phase.STAGE1:
            return cls(Optimizer.SGD, TrainConfig.stage1_lr, epochs, batch_size, clip, delta)
        if phase is Phase.STAGE2:
            return cls(Optimizer.ADAM, TrainConfig.stage2_lr, epochs, batch_size, clip, delta)
        raise ValueError(f"{phase.key} releases no training")

    def steps(self, images: int) -> tuple[float, int]:
        """The sampling rate q and the steps T of a task of ``images`` released images
        (``client.privacy.PrivacySetting.sampling``)."""
        rate = min(1.0, self.batch_size / max(images, 1))
        return rate, self.epochs * math.ceil(1 / rate)

    def row_bound(self, counts: Sequence[int], coordinates: int, size: float = 0.0) -> float:
        """The most the release of a task whose classes have the released ``counts`` moves a
        row of ``coordinates`` values whose norm was ``size`` (module docstring), with its
        rounding: Adam's first step moves every coordinate by its rate exactly, so an honest
        row is at the bound but for the float arithmetic."""
        images = sum(counts)
        rate, steps = self.steps(images)
        if self.optimizer is Optimizer.ADAM:
            exact = math.sqrt(coordinates) * sum(
                self._cosine_rate(t // max(1, steps // self.epochs)) * adam_step(t + 1)
                for t in range(steps)
            )
        else:
            taken = _binomial_tail(steps * math.floor(self._units(counts)), rate)
            tail = math.sqrt(2.0 * math.log(1.0 / FAILURE))
            noise = MAX_NOISE_MULTIPLIER * math.sqrt(steps) * (math.sqrt(coordinates) + tail)
            exact = self.lr * self.clip / (rate * images) * (taken + noise)
        return exact + (ROUNDING + steps * STEP_ROUNDING) * (size + exact)

    def _units(self, counts: Sequence[int]) -> float:
        """The most protected units behind ``counts`` (each class announced over its
        threshold: module docstring)."""
        threshold = NormalDist().inv_cdf(1 - self.delta / 2)
        tail = NormalDist().inv_cdf(1 - FAILURE / max(len(counts), 1))
        return sum(n + 0.5 + tail * n / threshold for n in counts)

    def _cosine_rate(self, epoch: int) -> float:
        """Stage 2's rate in ``epoch`` (``CosineAnnealingLR`` over the epochs, stepped after
        each); the full rate past them."""
        if epoch > self.epochs:
            return self.lr
        return self.lr * (1 + math.cos(math.pi * epoch / self.epochs)) / 2


def adam_step(t: int) -> float:
    """κ_t: the most one coordinate of Adam's t-th step (1-based) moves, in units of its rate,
    whatever the gradients (module docstring)."""
    beta1, beta2 = ADAM_BETAS
    gamma = beta1**2 / beta2
    return (
        (1 - beta1)
        / (1 - beta1**t)
        * math.sqrt((1 - beta2**t) / (1 - beta2))
        * math.sqrt((1 - gamma**t) / (1 - gamma))
    )


def _binomial_tail(trials: int, rate: float) -> float:
    """A number a Binomial(``trials``, ``rate``) exceeds with probability at most ``FAILURE``
    (Bernstein's inequality), at most ``trials``."""
    mean, variance = trials * rate, trials * rate * (1 - rate)
    log = math.log(1.0 / FAILURE)
    return min(float(trials), mean + log / 3 + math.sqrt(log**2 / 9 + 2 * log * variance))
