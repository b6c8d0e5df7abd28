"""The Gaussian mechanisms of a private site: clipped, noised counts, moments and gradients.

Each function bounds one unit's influence (its L2 sensitivity) by clipping, then adds Gaussian
noise of ``noise_multiplier`` × that sensitivity, so the accountant can compose it as one
``GaussianDpEvent`` (a DP-SGD step's on a Poisson sample: ``accountant.Sampling``). Noise comes
from the generator the caller passes: a private site draws it from the operating system's
entropy (``numpy.random.default_rng()``), never from a seed others know. What follows the noise
is post-processing (rounding, projecting onto values clipped data can have, the optimizer's
steps) and costs no privacy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from starfed.shared.codebook.mixture import DEFAULT_REG, GaussianMixture

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


def private_gradient(
    gradients: Sequence[torch.Tensor],
    like: Sequence[torch.Tensor],
    clip: float,
    noise_std: float,
    rng: np.random.Generator,
) -> list[torch.Tensor]:
    """One DP-SGD step's gradient sum: each unit's gradient (all the parameters' as one
    vector) clipped to L2 norm ``clip``, summed, plus Gaussian noise of standard deviation
    ``noise_std`` per coordinate (the caller sets it to z × ``clip``: one unit moves the sum by
    at most ``clip``). ``gradients``: one tensor per parameter, the units along its first
    dimension (``training.unit_gradients``). The sum has the shapes, dtypes and devices of the
    parameters ``like``."""
    flat = [g.detach().to("cpu", torch.float64) for g in gradients]
    norms = torch.cat([g.flatten(1) for g in flat], dim=1).norm(dim=1)
    scale = torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)
    total = [torch.einsum("u,u...->...", scale, g) for g in flat]
    return [
        (t + torch.from_numpy(rng.normal(0.0, noise_std, t.numel())).reshape(t.shape)).to(
            device=p.device, dtype=p.dtype
        )
        for t, p in zip(total, like, strict=True)
    ]
