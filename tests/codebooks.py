"""Codebook helpers only tests use: the whole-list merge and a mixture's covariance diagonal.

The server merges a phase one decoded reply at a time (``MergeAccumulator``); tests state the
merge's rules on a list of updates, and check its invariant (the union's mean and diagonal
covariance are kept) with the law of total variance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.codebook.mixture import DEFAULT_COMPONENTS, GaussianMixture
from starfed.shared.codebook.schema import FIELDS, Kind, ModelDims


def merge_updates(
    codebook: Codebook,
    updates: Iterable[ClientUpdate],
    *,
    n_components: int = DEFAULT_COMPONENTS,
    seed: int = 0,
) -> Codebook:
    """A new codebook, one version later, with the updates merged class by class (the rules
    are ``MergeAccumulator``'s)."""
    accumulator = MergeAccumulator(codebook, n_components=n_components, seed=seed)
    for update in updates:
        accumulator.add(update)
    return accumulator.result()


def covariance_diagonal(mixture: GaussianMixture) -> torch.Tensor:
    """Diagonal of the mixture's overall covariance, [D] (law of total variance)."""
    second_moment = mixture.weights @ (mixture.variances + mixture.means**2)
    return second_moment - mixture.mean() ** 2


def full_entry(
    name: str, dims: ModelDims, generator: torch.Generator, components: int = 5
) -> ClassEntry:
    """One frozen class with every field at ``dims``, random values (mixtures of equal
    weights)."""
    values = {}
    for f in FIELDS:
        shape = f.shape(dims)
        if f.kind is Kind.TENSOR:
            values[f.name] = torch.randn(shape, generator=generator)
        else:
            means = torch.randn((components, *shape), generator=generator, dtype=torch.float64)
            weights = torch.full((components,), 1 / components, dtype=torch.float64)
            values[f.name] = GaussianMixture(weights, means, means.abs() + 0.1, 40)
    return ClassEntry(name, 40, values, frozen=True)
