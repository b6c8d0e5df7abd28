"""The Gaussian mechanisms of a private site: clipped, noised counts, moments and updates.

Each function bounds one image's influence (its L2 sensitivity) by clipping, then adds Gaussian
noise of ``noise_multiplier`` × that sensitivity, so the accountant can compose it as one
``GaussianDpEvent``. Noise comes from the generator the caller passes: a private site draws it
from the operating system's entropy (``numpy.random.default_rng()``), never from a seed others
know. What follows the noise is post-processing (rounding, projecting onto values clipped data
can have) and costs no privacy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from starfed.shared.codebook.mixture import DEFAULT_REG, GaussianMixture

#: The probability with which a release's noise may exceed ``release_bound``'s allowance.
RELEASE_FAILURE = 1e-9

#: L2 sensitivity of the moments (Σ(x−c)/R, Σ((x−c)/R)²) to adding or removing one clipped
#: image: √(‖u‖² + ‖u²‖²) ≤ √2 for ‖u‖ ≤ 1.
MOMENTS_SENSITIVITY = math.sqrt(2.0)


def noisy_count(
    count: int, noise_multiplier: float, rng: np.random.Generator, group: int = 1
) -> int:
    """A count released with Gaussian noise (sensitivity ``group``: the most images one
    protected unit has in the class), rounded, at least 1 (the wire's smallest count)."""
    return max(1, round(count + rng.normal(0.0, noise_multiplier * group)))


def clip_rows(x: torch.Tensor, centre: torch.Tensor, radius: float) -> torch.Tensor:
    """``x − centre``, each row scaled into the ball of ``radius`` (rows inside unchanged)."""
    offset = x.detach().to("cpu", torch.float64) - centre.to("cpu", torch.float64)
    norms = offset.norm(dim=1, keepdim=True)
    return offset * torch.clamp(radius / norms.clamp_min(1e-12), max=1.0)


def clipped_moments(
    features: torch.Tensor, centre: torch.Tensor, radius: float
) -> tuple[np.ndarray, np.ndarray]:
    """What ``private_gaussian`` noises: the sum and the sum of squares of the features clipped
    to the ball (``centre``, ``radius``), in units of the radius (one image moves the pair by
    at most ``MOMENTS_SENSITIVITY``)."""
    unit = clip_rows(features, centre, radius) / radius  # rows of norm ≤ 1
    return unit.sum(0).numpy(), unit.pow(2).sum(0).numpy()


def private_gaussian(
    features: torch.Tensor,
    centre: torch.Tensor,
    radius: float,
    count: int,
    noise_multiplier: float,
    rng: np.random.Generator,
    group: int = 1,
) -> GaussianMixture:
    """One Gaussian from the noisy sum and sum of squares of the features clipped to the ball
    (``centre``, ``radius``), normalised by the already-released noisy ``count``. ``group``:
    the most images one protected unit has among the features (a patient's cap; sensitivity
    ``group`` × ``MOMENTS_SENSITIVITY``).

    The noisy mean is projected into the ball and the variances into what clipped data can
    have (each ≥ the mixture regulariser, together ≤ radius²), so the wire's checks hold.
    """
    total, squares = clipped_moments(features, centre, radius)
    std = noise_multiplier * MOMENTS_SENSITIVITY * group
    dim = total.shape[0]
    total = total + rng.normal(0.0, std, dim)
    squares = squares + rng.normal(0.0, std, dim)
    mean = total / count
    norm = float(np.linalg.norm(mean))
    if norm > 1.0:
        mean = mean / norm
    # each ≥ the regulariser (no fit's variance is below it: the screening checks so), the
    # excess over it shrunk until they sum to at most 1
    floor = DEFAULT_REG / radius**2
    excess = np.clip(squares / count - mean**2, floor, 1.0) - floor
    room = 1.0 - floor * dim
    variance = floor + excess * min(1.0, room / max(float(excess.sum()), 1e-300))
    means = centre.to("cpu", torch.float64) + torch.from_numpy(mean) * radius
    return GaussianMixture(
        weights=torch.ones(1, dtype=torch.float64),
        means=means.unsqueeze(0),
        variances=torch.from_numpy(variance * radius**2).unsqueeze(0),
        count=count,
    )


def private_update(
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    clip: float,
    noise_std: float,
    rng: np.random.Generator,
) -> dict[str, torch.Tensor]:
    """One class's values ``before`` plus its update ``after − before`` (all its fields as one
    vector) clipped to L2 norm ``clip``, plus Gaussian noise of standard deviation
    ``noise_std`` (the caller sets it from the sensitivity of the whole release)."""
    names = list(before)
    start = {name: before[name].to(torch.float64).cpu() for name in names}
    update = torch.cat([(after[n].to(torch.float64).cpu() - start[n]).reshape(-1) for n in names])
    update = update * min(1.0, clip / max(float(update.norm()), 1e-12))
    update = update + torch.from_numpy(rng.normal(0.0, noise_std, update.numel()))
    released, offset = {}, 0
    for name in names:
        size = start[name].numel()
        value = start[name] + update[offset : offset + size].reshape(start[name].shape)
        released[name] = value.to(before[name].dtype)
        offset += size
    return released


def release_bound(
    clip: float,
    noise_multiplier: float,
    classes: int,
    coordinates: int,
    failure: float = RELEASE_FAILURE,
) -> float:
    """The largest L2 change of ``coordinates`` values of one class that ``private_update``
    releases, but with probability at most ``failure``: the server holds a private site's
    rows to it (``server.field_bounds``).

    The update is clipped to ``clip`` as a whole, so any part of it (one field's
    ``coordinates`` values) moves by at most ``clip``. The noise of a training release over
    ``classes`` classes has standard deviation σ = ``noise_multiplier`` · 2 · ``clip`` · √K
    per coordinate (``client.privacy``: two clipped updates differ by at most 2C per class).
    Its norm over d coordinates, ‖σ·g‖ with g standard normal in d dimensions, is a
    1-Lipschitz function of σ·g with E‖g‖ ≤ √d, so by Gaussian concentration (Borell–TIS)
    P(‖σ·g‖ ≥ σ(√d + s)) ≤ exp(−s²/2): with s = √(2 ln(1/``failure``)) the norm exceeds
    σ(√d + s) with probability at most ``failure``. The bound is C + σ(√d + s).
    """
    sigma = noise_multiplier * 2.0 * clip * math.sqrt(classes)
    tail = math.sqrt(2.0 * math.log(1.0 / failure))
    return clip + sigma * (math.sqrt(coordinates) + tail)
