"""ε of a sequence of releases, and the noise the rest of a budget allows.

Both are dp-accounting's (Google's library, which Flower's ``flwr[dp]`` uses): its Rényi-DP
accountant composes the releases and its ``calibrate_dp_mechanism`` searches the noise
multiplier, so no privacy arithmetic is written here. A release is one Gaussian mechanism,
given by its noise multiplier (noise standard deviation over L2 sensitivity), or DP-SGD's
training (``Sampling.steps`` Gaussian mechanisms, each on a Poisson sample of rate
``Sampling.rate``); releases are adaptive compositions (each may depend on what came
before).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import dp_accounting
from dp_accounting.mechanism_calibration import ExplicitBracketInterval, calibrate_dp_mechanism
from dp_accounting.rdp import RdpAccountant

#: The Rényi orders the accountant composes at: the integer ones of dp-accounting's defaults.
#: Its Poisson-subsampled Gaussian (DP-SGD's steps) is exact at integer orders and fast; at the
#: fractional ones its series is slow (about 1 s an ε on a loaded 2-core machine, 25 of them
#: to calibrate one release) and fails to converge at small noise. Fewer orders give a slightly
#: larger ε (0.3 % at ε 8): conservative.
ORDERS = (*range(2, 64), 128, 256, 512, 1024)

#: The largest noise multiplier a site releases with: a release that would need more noise to
#: fit the remaining budget is refused (the budget is exhausted), since it would carry nothing.
MAX_NOISE_MULTIPLIER = 100.0
#: The smallest noise multiplier searched (a budget so large that less noise would do).
MIN_NOISE_MULTIPLIER = 0.05
#: How close the calibrated noise multiplier is to the smallest that fits the budget.
TOLERANCE = 1e-6


@dataclass(frozen=True)
class Sampling:
    """How a release uses its data: once, whole (a Gaussian mechanism: the default), or in
    ``steps`` Poisson samples each taking every unit with probability ``rate`` (DP-SGD)."""

    rate: float = 1.0
    steps: int = 1

    def __post_init__(self) -> None:
        if not (0.0 < self.rate <= 1.0 and self.steps >= 1):
            raise ValueError(f"a sampling needs 0 < rate <= 1 and steps >= 1, not {self}")

    def event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        """The release at ``noise_multiplier`` as dp-accounting's event."""
        gaussian = dp_accounting.GaussianDpEvent(float(noise_multiplier))
        if self == WHOLE:
            return gaussian
        sampled = dp_accounting.PoissonSampledDpEvent(self.rate, gaussian)
        return dp_accounting.SelfComposedDpEvent(sampled, self.steps)


#: A Gaussian mechanism on the whole data, once: every release but DP-SGD's.
WHOLE = Sampling()


@dataclass(frozen=True)
class Release:
    """One release in a site's ledger: its noise multiplier, and how it sampled the data."""

    noise_multiplier: float
    sampling: Sampling = WHOLE

    def to_json(self) -> float | list[float]:
        """A Gaussian as its noise multiplier (as ledgers always held it); DP-SGD's as
        ``[z, rate, steps]``."""
        if self.sampling == WHOLE:
            return self.noise_multiplier
        return [self.noise_multiplier, self.sampling.rate, self.sampling.steps]

    @classmethod
    def from_json(cls, raw: float | list[float]) -> Release:
        if isinstance(raw, list):
            z, rate, steps = raw
            return cls(float(z), Sampling(float(rate), int(steps)))
        return cls(float(raw))


def event(past: Sequence[Release]) -> dp_accounting.DpEvent:
    """The releases, in order, as one composed event."""
    return dp_accounting.ComposedDpEvent([r.sampling.event(r.noise_multiplier) for r in past])


#: Results kept per function: both are pure, and a site asks them again for every class at
#: every release (the site's ε over all its classes; classes of one task share a history).
CACHED = 4096


def releases(past: Sequence[float | Release]) -> tuple[Release, ...]:
    """``past`` as releases: a bare number is a Gaussian mechanism's noise multiplier."""
    return tuple(r if isinstance(r, Release) else Release(float(r)) for r in past)


def epsilon(past: Sequence[float | Release], delta: float) -> float:
    """ε at ``delta`` of the releases (0 for none)."""
    return _epsilon(releases(past), delta)


@functools.lru_cache(maxsize=CACHED)
def _epsilon(past: tuple[Release, ...], delta: float) -> float:
    if not past:
        return 0.0
    return float(RdpAccountant(ORDERS).compose(event(past)).get_epsilon(delta))


def noise_multiplier(
    past: Sequence[float | Release],
    planned: int | Sequence[Sampling],
    target_epsilon: float,
    delta: float,
) -> float | None:
    """The smallest noise multiplier z such that ``past`` then the ``planned`` releases at z
    (a number: that many Gaussian mechanisms) stay within (``target_epsilon``, ``delta``);
    None when even ``MAX_NOISE_MULTIPLIER`` does not fit (the budget is exhausted)."""
    samplings = (WHOLE,) * planned if isinstance(planned, int) else tuple(planned)
    if not samplings:
        raise ValueError("need at least one release to plan, got none")
    return _noise_multiplier(releases(past), samplings, target_epsilon, delta)


@functools.lru_cache(maxsize=CACHED)
def _noise_multiplier(
    past: tuple[Release, ...], samplings: tuple[Sampling, ...], target_epsilon: float, delta: float
) -> float | None:
    def planned(z: float) -> dp_accounting.DpEvent:
        return event([*past, *(Release(z, sampling) for sampling in samplings)])

    def spent(z: float) -> float:
        return float(RdpAccountant(ORDERS).compose(planned(z)).get_epsilon(delta))

    if spent(MAX_NOISE_MULTIPLIER) > target_epsilon:
        return None
    if spent(MIN_NOISE_MULTIPLIER) <= target_epsilon:
        return MIN_NOISE_MULTIPLIER
    return float(
        calibrate_dp_mechanism(
            lambda: RdpAccountant(ORDERS),
            planned,
            target_epsilon,
            delta,
            ExplicitBracketInterval(MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER),
            tol=TOLERANCE,
        )
    )
