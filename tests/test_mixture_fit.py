"""The batched torch mixture fit (the statistics steps' fit on a GPU) against scikit-learn's.

Run here on the CPU: the same code runs on a GPU (tests/test_gpu.py repeats the comparison with
``device="cuda"``). Tolerances: on well-separated clusters both find the same optimum, so the
mean log-likelihood per sample agrees to 1e-6 nats and the parameters to 1e-6; on overlapping
clusters k-means++ draws differ and either may stop in another local optimum, so over 20 classes
the mean log-likelihood per sample agrees within 2 %. The mixture's overall mean and variance equal
the data's (variance + reg) to 1e-9 in every case, as EM guarantees.
"""

from __future__ import annotations

import math

import pytest
import torch

from starfed.shared.codebook.mixture import DEFAULT_REG, GaussianMixture
from starfed.shared.codebook.mixture_fit import fit_mixtures_batched
from starfed.shared.model.training import fit_mixtures, mixture_fit_for


def blobs(
    sizes: list[int], dim: int, spread: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class ``n`` points around 5 random centres ``spread`` apart (unit noise)."""
    g = torch.Generator().manual_seed(seed)
    features, labels = [], []
    for row, n in enumerate(sizes):
        centres = torch.randn(5, dim, generator=g) * spread
        picks = torch.randint(0, 5, (n,), generator=g)
        features.append(centres[picks] + torch.randn(n, dim, generator=g))
        labels.append(torch.full((n,), row))
    return torch.cat(features), torch.cat(labels)


def log_likelihood(mixture: GaussianMixture, x: torch.Tensor) -> float:
    """Mean log-likelihood per sample of ``x`` under ``mixture``."""
    x = x.to(torch.float64)
    quad = ((x[:, None] - mixture.means[None]) ** 2 / mixture.variances[None]).sum(-1)
    log_det = mixture.variances.log().sum(-1)
    log_prob = -0.5 * (x.shape[1] * math.log(2 * math.pi) + log_det[None] + quad)
    return torch.logsumexp(log_prob + mixture.weights.log()[None], 1).mean().item()


def overall_moments(mixture: GaussianMixture) -> tuple[torch.Tensor, torch.Tensor]:
    mean = mixture.mean()
    second = mixture.weights @ (mixture.variances + mixture.means**2)
    return mean, second - mean**2


def test_separated_clusters_give_scikit_learns_fit() -> None:
    x, y = blobs([120, 80, 60], dim=32, spread=10.0, seed=0)
    ours = fit_mixtures_batched(x, y, range(3), 5, seed=11)
    reference = fit_mixtures(x, y, range(3), 5, seed=11)
    for row, (a, b) in enumerate(zip(ours, reference, strict=True)):
        own = x[y == row]
        assert a.count == b.count == len(own) and a.n_components == b.n_components == 5
        assert log_likelihood(a, own) == pytest.approx(log_likelihood(b, own), abs=1e-6)
        order_a, order_b = a.means[:, 0].argsort(), b.means[:, 0].argsort()  # same components
        for field in ("weights", "means", "variances"):
            torch.testing.assert_close(
                getattr(a, field)[order_a], getattr(b, field)[order_b], atol=1e-6, rtol=1e-6
            )


def test_overlapping_clusters_agree_in_log_likelihood_and_moments() -> None:
    sizes = [40 + 7 * i for i in range(20)]
    x, y = blobs(sizes, dim=48, spread=1.5, seed=1)
    ours = fit_mixtures_batched(x, y, range(20), 5, seed=3)
    reference = fit_mixtures(x, y, range(20), 5, seed=3)
    ll = [log_likelihood(m, x[y == row]) for row, m in enumerate(ours)]
    ll_sk = [log_likelihood(m, x[y == row]) for row, m in enumerate(reference)]
    assert sum(ll) / 20 == pytest.approx(sum(ll_sk) / 20, rel=0.02)
    for row, mixture in enumerate(ours):
        own = x[y == row].to(torch.float64)
        mean, variance = overall_moments(mixture)
        torch.testing.assert_close(mean, own.mean(0), atol=1e-9, rtol=1e-9)
        expected = own.var(0, unbiased=False) + DEFAULT_REG
        torch.testing.assert_close(variance, expected, atol=1e-9, rtol=1e-9)
        assert mixture.weights.sum().item() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.filterwarnings("ignore:Number of distinct clusters")  # scikit-learn, on duplicates
def test_degenerate_classes_are_fitted_like_scikit_learns() -> None:
    """Fewer points than components, one point, and duplicate points, in one batch."""
    g = torch.Generator().manual_seed(2)
    few = torch.randn(3, 16, generator=g)
    one = torch.randn(1, 16, generator=g)
    duplicates = torch.randn(2, 16, generator=g).repeat(6, 1)  # 12 points, 2 distinct
    normal, _ = blobs([30], dim=16, spread=10.0, seed=2)
    x = torch.cat([few, one, duplicates, normal])
    y = torch.tensor([0] * 3 + [1] + [2] * 12 + [3] * 30)
    ours = fit_mixtures_batched(x, y, range(4), 5, seed=5)
    reference = fit_mixtures(x, y, range(4), 5, seed=5)
    assert [m.n_components for m in ours] == [m.n_components for m in reference] == [3, 1, 5, 5]
    assert [m.count for m in ours] == [3, 1, 12, 30]
    for row, (a, b) in enumerate(zip(ours, reference, strict=True)):
        own = x[y == row]
        assert torch.isfinite(a.means).all() and (a.variances >= DEFAULT_REG * (1 - 1e-9)).all()
        assert log_likelihood(a, own) == pytest.approx(log_likelihood(b, own), abs=1e-6)
        torch.testing.assert_close(a.mean(), own.to(torch.float64).mean(0), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ours[1].means, one.to(torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        ours[1].variances, torch.full((1, 16), DEFAULT_REG, dtype=torch.float64)
    )
    assert ours[3].sample(4, torch.Generator().manual_seed(0)).shape == (4, 16)


def test_a_class_fit_does_not_depend_on_its_batch() -> None:
    x, y = blobs([50, 70, 40], dim=24, spread=2.0, seed=4)
    together = fit_mixtures_batched(x, y, range(3), 4, seed=9)
    alone = fit_mixtures_batched(x[y == 1], y[y == 1], range(1, 2), 4, seed=9)
    torch.testing.assert_close(together[1].means, alone[0].means, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(together[1].weights, alone[0].weights, atol=1e-9, rtol=1e-9)


def test_bad_input_is_a_clear_error() -> None:
    x, y = blobs([10, 10], dim=4, spread=1.0, seed=0)
    with pytest.raises(ValueError, match="no training features for class row 2"):
        fit_mixtures_batched(x, y, range(3), 5, seed=0)
    assert fit_mixtures_batched(x, y, range(0), 5, seed=0) == fit_mixtures(x, y, range(0), 5, 0)
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        fit_mixtures_batched(x, y, range(2), 5, seed=0)


def test_the_cpu_keeps_scikit_learns_fit() -> None:
    """The CPU codebook does not change: only a CUDA device gets the batched fit."""
    assert mixture_fit_for(torch.device("cpu")) is fit_mixtures
    fit = mixture_fit_for(torch.device("cuda"))
    assert fit.func is fit_mixtures_batched and fit.keywords == {"device": torch.device("cuda")}
