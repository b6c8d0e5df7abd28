"""ε of a sequence of Gaussian mechanisms, and the noise the rest of a budget allows.

Both are dp-accounting's (Google's library, which Flower's ``flwr[dp]`` uses): its Rényi-DP
accountant composes the releases and its ``calibrate_dp_mechanism`` searches the noise
multiplier, so no privacy arithmetic is written here. A release is one Gaussian mechanism,
given by its noise multiplier (noise standard deviation over L2 sensitivity); releases are
adaptive compositions (each may depend on what came before).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import dp_accounting
from dp_accounting.mechanism_calibration import ExplicitBracketInterval, calibrate_dp_mechanism
from dp_accounting.rdp import RdpAccountant

#: The largest noise multiplier a site releases with: a release that would need more noise to
#: fit the remaining budget is refused (the budget is exhausted), since it would carry nothing.
MAX_NOISE_MULTIPLIER = 100.0
#: The smallest noise multiplier searched (a budget so large that less noise would do).
MIN_NOISE_MULTIPLIER = 0.05
#: How close the calibrated noise multiplier is to the smallest that fits the budget.
TOLERANCE = 1e-6


def event(noise_multipliers: Sequence[float]) -> dp_accounting.DpEvent:
    """The releases, in order, as one composed event."""
    return dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(float(z)) for z in noise_multipliers]
    )


#: Results kept per function: both are pure, and a site asks them again for every class at
#: every release (the site's ε over all its classes; classes of one task share a history).
CACHED = 4096


def epsilon(noise_multipliers: Sequence[float], delta: float) -> float:
    """ε at ``delta`` of the releases (0 for none)."""
    return _epsilon(tuple(float(z) for z in noise_multipliers), delta)


@functools.lru_cache(maxsize=CACHED)
def _epsilon(noise_multipliers: tuple[float, ...], delta: float) -> float:
    if not noise_multipliers:
        return 0.0
    return float(RdpAccountant().compose(event(noise_multipliers)).get_epsilon(delta))


def noise_multiplier(
    past: Sequence[float], releases: int, target_epsilon: float, delta: float
) -> float | None:
    """The smallest noise multiplier z such that ``past`` then ``releases`` releases at z stay
    within (``target_epsilon``, ``delta``); None when even ``MAX_NOISE_MULTIPLIER`` does not
    fit (the budget is exhausted)."""
    if releases < 1:
        raise ValueError(f"need at least one release to plan, got {releases}")
    return _noise_multiplier(tuple(float(z) for z in past), releases, target_epsilon, delta)


@functools.lru_cache(maxsize=CACHED)
def _noise_multiplier(
    past: tuple[float, ...], releases: int, target_epsilon: float, delta: float
) -> float | None:
    def planned(z: float) -> dp_accounting.DpEvent:
        return event([*past, *[z] * releases])

    def spent(z: float) -> float:
        return float(RdpAccountant().compose(planned(z)).get_epsilon(delta))

    if spent(MAX_NOISE_MULTIPLIER) > target_epsilon:
        return None
    if spent(MIN_NOISE_MULTIPLIER) <= target_epsilon:
        return MIN_NOISE_MULTIPLIER
    return float(
        calibrate_dp_mechanism(
            RdpAccountant,
            planned,
            target_epsilon,
            delta,
            ExplicitBracketInterval(MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER),
            tol=TOLERANCE,
        )
    )
