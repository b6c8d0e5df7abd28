"""Mixture fits of many classes at once, in torch, on the device the features are on.

``GaussianMixture.fit`` fits one class at a time with scikit-learn on the CPU: at paper dims on a
GPU a statistics step then waits on the CPU (issue 37). This module fits the same model — diagonal
covariances, k-means++ then Lloyd's k-means as the initialisation, EM with the covariance
regulariser ``reg``, stopping when the mean log-likelihood moves by less than ``tol`` — for every
class of a step in one batch: classes are padded to the largest class's size and masked, so every
iteration is a few batched matrix products. It is float64 throughout, like the statistics it
returns (the quadratic forms of a 768-dimensional Gaussian lose digits in float32).

It is not scikit-learn's random stream: k-means++ draws from ``torch.Generator(seed + row)`` per
class (so a class's fit does not depend on which classes share its batch, nor on the device), so
the fits agree with scikit-learn's within EM's tolerance where both find the same optimum, and in
log-likelihood per sample otherwise (tests/test_mixture_fit.py states the tolerances). The
overall mean and variance of every fit equal the data's exactly, as in scikit-learn's.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from starfed.shared.codebook.mixture import DEFAULT_REG, GaussianMixture

EM_TOL = 1e-3  # scikit-learn's default ``tol``: change of the mean log-likelihood
EM_MAX_ITER = 100
KMEANS_MAX_ITER = 300  # scikit-learn's KMeans defaults
KMEANS_TOL = 1e-4  # times the mean per-dimension variance of the class's features
_LOG_2PI = math.log(2 * math.pi)


def fit_mixtures_batched(
    features: torch.Tensor,
    labels: torch.Tensor,
    rows: range,
    n_components: int,
    seed: int,
    device: torch.device | None = None,
    reg: float = DEFAULT_REG,
) -> list[GaussianMixture]:
    """One mixture per class row in ``rows`` (``MixtureFit``'s signature), fitted on ``device``
    (default: where ``features`` are). Class ``row`` has ``min(n_components, its count)``
    components, like ``GaussianMixture.fit``; results come back on the CPU."""
    if len(rows) == 0:
        return []
    device = features.device if device is None else torch.device(device)
    x, mask = _pack(features, labels, rows, device)
    counts = mask.sum(1)
    components = counts.clamp(max=n_components)
    live = torch.arange(n_components, device=device) < components[:, None]  # [C, M]
    uniforms = _uniforms(rows, seed, n_components).to(device)
    centres = _kmeans_plus_plus(x, mask, counts, n_components, uniforms)
    assignment = _lloyd(x, mask, live, centres)
    resp = torch.nn.functional.one_hot(assignment, n_components).to(x.dtype) * mask[..., None]
    weights, means, variances = _m_step(x, resp, live, reg)
    weights, means, variances = _em(x, mask, counts, live, (weights, means, variances), reg)
    return [
        GaussianMixture(
            weights=weights[i, :m].cpu(),
            means=means[i, :m].cpu(),
            variances=variances[i, :m].cpu(),
            count=int(n),
        )
        for i, (m, n) in enumerate(zip(components.tolist(), counts.tolist(), strict=True))
    ]


def fit_on(device: torch.device) -> partial[list[GaussianMixture]]:
    """``fit_mixtures_batched`` bound to ``device`` (a ``MixtureFit``)."""
    return partial(fit_mixtures_batched, device=device)


def _pack(
    features: torch.Tensor, labels: torch.Tensor, rows: range, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class's features as float64 ``[C, N_max, D]``, zero-padded, and the ``[C, N_max]``
    mask of real rows."""
    if features.ndim != 2:
        raise ValueError(f"need an [N, D] feature matrix, got shape {tuple(features.shape)}")
    features = features.detach().to(device, torch.float64)
    labels = labels.to(device)
    per_class = []
    for row in rows:
        own = features[labels == row]
        if len(own) == 0:
            raise ValueError(f"no training features for class row {row}")
        per_class.append(own)
    x = torch.nn.utils.rnn.pad_sequence(per_class, batch_first=True)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("features contain NaN or infinite values")
    lengths = torch.tensor([len(own) for own in per_class], device=device)
    mask = torch.arange(x.shape[1], device=device) < lengths[:, None]
    return x, mask


def _uniforms(rows: range, seed: int, n_components: int) -> torch.Tensor:
    """k-means++'s random numbers, ``[C, M, trials]`` float64 in [0, 1): row ``c`` from its own
    generator ``seed + row`` on the CPU, so a class's fit is the same in any batch, any device.
    ``[:, 0, 0]`` picks the first centre; ``[:, k, :]`` the candidates of centre ``k``."""
    trials = 2 + int(math.log(n_components))  # scikit-learn's n_local_trials
    draws = [
        torch.rand(
            n_components,
            trials,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(seed + row),
        )
        for row in rows
    ]
    return torch.stack(draws)


def _sq_distances(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """``[C, N, K]`` squared distances from points ``[C, N, D]`` to centres ``[C, K, D]``."""
    cross = torch.baddbmm(
        (centres * centres).sum(-1)[:, None, :], x, centres.transpose(1, 2), alpha=-2.0
    )
    return (cross + (x * x).sum(-1, keepdim=True)).clamp_(min=0.0)


def _kmeans_plus_plus(
    x: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor, m: int, u: torch.Tensor
) -> torch.Tensor:
    """Greedy k-means++ (scikit-learn's ``_kmeans_plus_plus``): each next centre is the best of
    a few candidates drawn with probability ∝ squared distance. Returns ``[C, M, D]``; centres
    past a class's point count repeat points and are masked later."""
    c = torch.arange(x.shape[0], device=x.device)
    last = (counts - 1)[:, None]
    first = (u[:, 0, 0] * counts).long().clamp(max=last[:, 0])
    centres = [x[c, first]]
    closest = _sq_distances(x, centres[0][:, None])[..., 0] * mask  # [C, N]
    for k in range(1, m):
        potential = closest.sum(1, keepdim=True)  # [C, 1]
        cumulative = closest.cumsum(1)
        candidates = torch.searchsorted(cumulative, u[:, k] * potential).clamp(max=last)
        to_candidates = _sq_distances(x, x[c[:, None], candidates]) * mask[..., None]
        reduced = torch.minimum(closest[..., None], to_candidates)  # [C, N, trials]
        best = reduced.sum(1).argmin(1)  # [C]
        centres.append(x[c, candidates[c, best]])
        closest = reduced[c, :, best]
    return torch.stack(centres, 1)


def _lloyd(
    x: torch.Tensor, mask: torch.Tensor, live: torch.Tensor, centres: torch.Tensor
) -> torch.Tensor:
    """Lloyd's iterations from ``centres`` until no label changes or the centres move less than
    ``KMEANS_TOL`` x the mean variance (per class; converged classes stop). An empty cluster
    keeps its centre. Returns each point's cluster ``[C, N]``."""
    counts = mask.sum(1, keepdim=True).to(x.dtype)
    mean = (x * mask[..., None]).sum(1) / counts
    sq_mean = (x * x * mask[..., None]).sum(1) / counts
    tol = KMEANS_TOL * (sq_mean - mean * mean).mean(1)  # [C]
    assignment = _assign(x, live, centres)
    active = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    for _ in range(KMEANS_MAX_ITER):
        onehot = torch.nn.functional.one_hot(assignment, centres.shape[1]).to(x.dtype)
        onehot = onehot * mask[..., None]
        sizes = onehot.sum(1)[..., None]  # [C, M, 1]
        moved = torch.where(sizes > 0, onehot.transpose(1, 2) @ x / sizes.clamp(min=1), centres)
        moved = torch.where(active[:, None, None], moved, centres)
        shift = ((moved - centres) ** 2).sum((1, 2))
        centres = moved
        new = _assign(x, live, centres)
        same = ((new == assignment) | ~mask).all(1)
        assignment = torch.where(active[:, None], new, assignment)
        active = active & ~same & (shift > tol)
        if not bool(active.any()):
            break
    return assignment


def _assign(x: torch.Tensor, live: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    distances = _sq_distances(x, centres).masked_fill(~live[:, None, :], math.inf)
    return distances.argmin(-1)


Params = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # weights [C, M], means, variances


def _m_step(x: torch.Tensor, resp: torch.Tensor, live: torch.Tensor, reg: float) -> Params:
    """scikit-learn's diagonal M-step: ``n_k`` with its 10·eps floor, weighted means, and
    ``E[x²] - μ²`` plus ``reg`` as the variances. Dead components get weight 0."""
    nk = resp.sum(1) + 10 * torch.finfo(x.dtype).eps  # [C, M]
    means = resp.transpose(1, 2) @ x / nk[..., None]
    sq = resp.transpose(1, 2) @ (x * x) / nk[..., None]
    variances = (sq - means * means).clamp_(min=0.0) + reg
    weights = torch.where(live, nk, 0.0)
    return weights / weights.sum(1, keepdim=True), means, variances


def _log_likelihoods(x: torch.Tensor, live: torch.Tensor, params: Params) -> torch.Tensor:
    """``log w_k + log N(x | μ_k, diag σ²_k)`` as ``[C, N, M]`` (-inf for dead components)."""
    weights, means, variances = params
    precision = variances.reciprocal()  # [C, M, D]
    quad = torch.baddbmm(
        (means * means * precision).sum(-1)[:, None, :],
        x,
        (means * precision).transpose(1, 2),
        alpha=-2.0,
    ) + (x * x) @ precision.transpose(1, 2)
    log_det = variances.log().sum(-1)  # [C, M]
    log_prob = -0.5 * (x.shape[-1] * _LOG_2PI + log_det[:, None, :] + quad)
    return (log_prob + weights.log()[:, None, :]).masked_fill(~live[:, None, :], -math.inf)


def _em(
    x: torch.Tensor,
    mask: torch.Tensor,
    counts: torch.Tensor,
    live: torch.Tensor,
    params: Params,
    reg: float,
) -> Params:
    """EM from ``params`` as scikit-learn runs it (E-step, M-step, stop when the E-step's mean
    log-likelihood changed by less than ``EM_TOL``), each class stopping on its own."""
    active = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    bound = torch.full((x.shape[0],), -math.inf, dtype=x.dtype, device=x.device)
    for _ in range(EM_MAX_ITER):
        joint = _log_likelihoods(x, live, params)
        norm = torch.logsumexp(joint, -1)  # [C, N]
        resp = (joint - norm[..., None]).exp() * mask[..., None]
        fitted = _m_step(x, resp, live, reg)
        weights, means, variances = (
            torch.where(active.view(-1, *[1] * (new.ndim - 1)), new, old)
            for new, old in zip(fitted, params, strict=True)
        )
        params = (weights, means, variances)
        previous, bound = bound, torch.where(active, (norm * mask).sum(1) / counts, bound)
        active = active & ((bound - previous).abs() >= EM_TOL)
        if not bool(active.any()):
            break
    return params
