"""Shared fixtures: small random class banks with tiny dims for codebook and merge tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from starfed.shared.codebook.codebook import row_shape
from starfed.shared.codebook.entry import ClassBank, ModelDims
from starfed.shared.codebook.mixture import GaussianMixture

TINY_DIMS = ModelDims(d_txt=8, d_clip=6, d_vit=10, n_layers=2)
FINGERPRINT = "ab" * 32


def random_mixture(dim: int, generator: torch.Generator, n_components: int = 3) -> GaussianMixture:
    weights = torch.rand(n_components, generator=generator, dtype=torch.float64) + 0.1
    return GaussianMixture(
        weights=weights / weights.sum(),
        means=torch.randn(n_components, dim, generator=generator, dtype=torch.float64),
        variances=torch.rand(n_components, dim, generator=generator, dtype=torch.float64) + 0.1,
        count=int(torch.randint(5, 50, (), generator=generator)),
    )


def random_bank(
    dims: ModelDims = TINY_DIMS,
    n_classes: int = 4,
    seed: int = 0,
    prefix: str = "class",
    mixtures: bool = True,
) -> ClassBank:
    """A bank whose every value is random (counts >= 1, versions 0..2, optional mixtures)."""
    generator = torch.Generator().manual_seed(seed)
    bank = ClassBank(dims)
    names = [f"{prefix}_{i}" for i in range(n_classes)]
    rows = {
        f: torch.randn(n_classes, *row_shape(f, dims), generator=generator)
        for f in ClassBank.TENSOR_FIELDS
    }
    bank.append(names, rows)
    for i in range(n_classes):
        bank.counts[i] = 10 + i
        bank.versions[i] = i % 3
        if mixtures:
            bank.clip_mixtures[i] = random_mixture(dims.d_clip, generator)
            bank.vit_mixtures[i] = random_mixture(dims.d_vit, generator)
    return bank


@pytest.fixture(scope="session")
def make_bank() -> Callable[..., ClassBank]:
    """Factory for random banks: ``make_bank(dims=..., n_classes=..., seed=..., prefix=...)``."""
    return random_bank


@pytest.fixture(scope="session")
def make_mixture() -> Callable[..., GaussianMixture]:
    """Factory for random mixtures: ``make_mixture(dim, generator, n_components=3)``."""
    return random_mixture


@pytest.fixture(scope="session")
def tiny_dims() -> ModelDims:
    return TINY_DIMS


@pytest.fixture(scope="session")
def fingerprint() -> str:
    return FINGERPRINT
