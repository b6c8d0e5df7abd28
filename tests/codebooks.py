"""Codebook helpers for tests and benches: the whole-list merge, a mixture's covariance
diagonal, random classes at any dims, and what one codebook changed of another.

The server merges a phase one decoded reply at a time (``MergeAccumulator``); tests state the
merge's rules on a list of updates, and check its invariant (the union's mean and diagonal
covariance are kept) with the law of total variance.

No pytest here, and nothing but the package's codebook modules: ``bench/big_federation.py``
imports this module too (it puts ``tests/`` on its path), so the federations it measures are
built of the same random classes the store tests write, and a step's bytes are bounded by the
same reckoning of what it changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

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
    name: str, dims: ModelDims, generator: torch.Generator, components: int = 5, version: int = 0
) -> ClassEntry:
    """One frozen class with every field at ``dims``, random values (mixtures of equal
    weights); ``version``: the codebook version it and each of its fields carry (0: none)."""
    values = {}
    for f in FIELDS:
        shape = f.shape(dims)
        if f.kind is Kind.TENSOR:
            values[f.name] = torch.randn(shape, generator=generator)
        else:
            means = torch.randn((components, *shape), generator=generator, dtype=torch.float64)
            weights = torch.full((components,), 1 / components, dtype=torch.float64)
            values[f.name] = GaussianMixture(weights, means, means.abs() + 0.1, 40)
    stamps = dict.fromkeys(values, version) if version else {}
    return ClassEntry(name, 40, values, version, frozen=True, field_versions=stamps)


def changed_fields(before: Codebook, after: Codebook) -> Codebook:
    """The entries and fields ``after`` changed of ``before`` (by identity: codebooks share
    what they do not change), as a codebook: its encoded size is what a checkpoint of
    ``after`` must write at the least."""
    entries = {}
    for name, e in after.entries.items():
        old = before.entries.get(name)
        if old is not e:
            fields = {f: v for f, v in e.values.items() if old is None or old.values[f] is not v}
            entries[name] = replace(e, values=fields, field_versions={})
    return Codebook(after.fingerprint, after.dims, entries, after.version)
