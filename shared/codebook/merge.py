"""Per-class merging of site updates into the codebook, without Flower.

Built-in FedAvg needs identical arrays from every site; here every site sends the classes it
holds, so aggregation is per class: each class is averaged over the updates that carry it
(docs/design.md#the-codebook).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from sklearn.cluster import KMeans

from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import DEFAULT_COMPONENTS, GaussianMixture

logger = logging.getLogger(__name__)


def merge_mixtures(
    mixtures: Sequence[GaussianMixture], n_components: int = DEFAULT_COMPONENTS, seed: int = 0
) -> GaussianMixture:
    """Count-weighted union of the mixtures' components, reduced to at most ``n_components``.

    Each mixture stands for ``count`` feature vectors, so its weights are scaled by its share of
    the total count. If the union has more components than wanted, the component means are
    clustered with k-means (weighted by component weight) and each cluster is replaced by the
    single Gaussian with the same weight, mean and per-dimension variance (moment matching).
    Moment matching preserves the union's overall mean and diagonal covariance exactly, so the
    reduction only loses shape, not location or spread.
    """
    if not mixtures:
        raise ValueError("need at least one mixture")
    if len({m.dim for m in mixtures}) != 1:
        raise ValueError(f"mixtures of different dimensions: {sorted({m.dim for m in mixtures})}")
    total = sum(m.count for m in mixtures)
    weights = np.concatenate([m.weights.numpy() * (m.count / total) for m in mixtures])
    means = np.concatenate([m.means.numpy() for m in mixtures])
    variances = np.concatenate([m.variances.numpy() for m in mixtures])
    keep = weights > 0  # a zero-weight component carries no mass (and would divide by zero)
    weights, means, variances = weights[keep], means[keep], variances[keep]
    if len(weights) > n_components:
        n_clusters = min(n_components, len(np.unique(means, axis=0)))
        labels = (
            KMeans(n_clusters=n_clusters, n_init=10, random_state=seed)
            .fit(means, sample_weight=weights)
            .labels_
        )
        groups = [labels == label for label in np.unique(labels)]
        cluster_weights = np.array([weights[g].sum() for g in groups])
        cluster_means = np.stack(
            [weights[g] @ means[g] / w for g, w in zip(groups, cluster_weights, strict=True)]
        )
        # Within-cluster law of total variance, written as deviations from the cluster mean so
        # it stays positive (no cancellation of two large second moments).
        cluster_variances = np.stack(
            [
                weights[g] @ (variances[g] + (means[g] - mu) ** 2) / w
                for g, w, mu in zip(groups, cluster_weights, cluster_means, strict=True)
            ]
        )
        weights, means, variances = cluster_weights, cluster_means, cluster_variances
    return GaussianMixture(
        weights=torch.from_numpy(weights / weights.sum()),
        means=torch.from_numpy(means),
        variances=torch.from_numpy(variances),
        count=total,
    )


def _weighted_mean(rows: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """Count-weighted average, accumulated in float64 (one carrier returns its row exactly)."""
    weights = torch.tensor(counts, dtype=torch.float64)
    stacked = torch.stack([row.detach().to(torch.float64) for row in rows])
    return (torch.tensordot(weights, stacked, dims=1) / weights.sum()).to(torch.float32)


def merge_updates(
    codebook: Codebook,
    updates: Sequence[ClientUpdate],
    *,
    n_components: int = DEFAULT_COMPONENTS,
    seed: int = 0,
) -> Codebook:
    """A new codebook, one version later, with the updates merged class by class.

    The updates were validated when they were decoded (``wire.decode_update``), so they name
    registered classes and carry their phase's fields.

    - Per class and per field, the new value is the average over the updates that carry that
      class, weighted by their example counts (FedAvg per class: the previous value does not
      take part). Mixtures are merged with ``merge_mixtures``.
    - A class's count becomes the sum of the counts of the updates carrying it: the examples
      behind the merged values. It is not added to the previous count, because every round
      re-reports the same examples.
    - Frozen classes are never changed. Rows for them are ignored (logged), not rejected: a
      site whose task stream reaches a class after it was finished elsewhere is legitimate,
      and rejecting would fail the whole round for it.
    - Changed classes get the new version as their version. Inputs are not modified.
    """
    carriers: dict[str, list[ClassEntry]] = {}
    ignored: list[str] = []
    for update in updates:
        for entry in update.entries:
            if codebook[entry.name].frozen:
                ignored.append(entry.name)
            else:
                carriers.setdefault(entry.name, []).append(entry)
    if ignored:
        logger.info("ignored update rows of frozen classes: %s", sorted(set(ignored)))
    values: dict[str, dict] = {}
    for name, entries in carriers.items():
        values[name] = {}
        for f in schema.FIELDS:
            having = [e for e in entries if f.name in e.values]
            if not having:
                continue
            if f.kind is schema.Kind.MIXTURE:
                mixtures = [e.values[f.name] for e in having]
                values[name][f.name] = merge_mixtures(mixtures, n_components, seed)
            else:
                rows = [e.values[f.name] for e in having]
                values[name][f.name] = _weighted_mean(rows, [e.count for e in having])
    counts = {name: sum(e.count for e in entries) for name, entries in carriers.items()}
    return codebook.set_values(values, counts)
