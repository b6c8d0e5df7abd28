"""Per-class merging of site updates into the codebook, without Flower.

Built-in FedAvg needs identical arrays from every site; here every site sends the classes it
holds, so aggregation is per class: each class is averaged over the updates that carry it
(docs/design.md#the-codebook). The merge streams: the server adds each decoded reply to a
``MergeAccumulator`` and lets it go, so a phase's memory grows with its classes, not with its
sites (docs/benchmarks.md#server-merge-at-scale-benchmerge_scalepy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.cluster import KMeans, kmeans_plusplus

from starfed.shared import thread_pools
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import Value
from starfed.shared.codebook.mixture import DEFAULT_COMPONENTS, GaussianMixture

logger = logging.getLogger(__name__)

# Mixture components pooled per class and field before an intermediate reduction: 51 sites at
# M = 5, so every federation of up to 50 sites (the largest of the experiment grids) merges
# exactly as one k-means over the union; at the paper's dims a full pool is 3 MB.
POOL_BOUND = 256
# Assignment passes of a streamed reduction, at most: warm-started, Lloyd settles in a few, and
# more did not change held-out likelihoods in a synthetic check (docs/benchmarks.md).
LLOYD_ITERATIONS = 3


def _one_thread() -> AbstractContextManager[object]:
    """A merge's k-means and sums are small (at most ``POOL_BOUND`` points, one class at a time):
    BLAS and OpenMP thread teams cost more than they save, and far more when the server shares
    its cores with sites (docs/benchmarks.md). Results do not change: below 512 points
    scikit-learn's k-means runs in one chunk whatever the thread count."""
    limited: AbstractContextManager[object] = thread_pools.controller().limit(limits=1)
    return limited


# --- mixtures -----------------------------------------------------------------------------------


def _union(mixtures: Sequence[GaussianMixture]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The count-weighted union's weights [P], means and variances [P, D], and total count.

    Each mixture stands for ``count`` feature vectors, so its weights are scaled by its share of
    the total count; zero-weight components carry no mass (and would divide by zero) and go.
    """
    if not mixtures:
        raise ValueError("need at least one mixture")
    if len({m.dim for m in mixtures}) != 1:
        raise ValueError(f"mixtures of different dimensions: {sorted({m.dim for m in mixtures})}")
    total = sum(m.count for m in mixtures)
    weights = np.concatenate([m.weights.numpy() * (m.count / total) for m in mixtures])
    means = np.concatenate([m.means.numpy() for m in mixtures])
    variances = np.concatenate([m.variances.numpy() for m in mixtures])
    keep = weights > 0
    if keep.all():  # the usual case: no copies
        return weights, means, variances, total
    return weights[keep], means[keep], variances[keep], total


def _moment_match(
    weights: np.ndarray, means: np.ndarray, variances: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each cluster of components replaced by the single Gaussian with its weight, mean and
    per-dimension variance: the union's overall mean and diagonal covariance are kept exactly."""
    clusters = []
    for label in np.unique(labels):
        chosen = labels == label
        w, m = weights[chosen], means[chosen]
        mass = w.sum()
        mu = w @ m / mass
        # Within-cluster law of total variance, written as deviations from the cluster mean so
        # it stays positive (no cancellation of two large second moments); in place, m is a copy.
        m -= mu
        m **= 2
        m += variances[chosen]
        clusters.append((mass, mu, w @ m / mass))
    mass, mu, var = zip(*clusters, strict=True)
    return np.array(mass), np.stack(mu), np.stack(var)


def _mixture(
    weights: np.ndarray, means: np.ndarray, variances: np.ndarray, count: int
) -> GaussianMixture:
    return GaussianMixture(
        weights=torch.from_numpy(weights / weights.sum()),
        means=torch.from_numpy(means),
        variances=torch.from_numpy(variances),
        count=count,
    )


def merge_mixtures(
    mixtures: Sequence[GaussianMixture], n_components: int = DEFAULT_COMPONENTS, seed: int = 0
) -> GaussianMixture:
    """Count-weighted union of the mixtures' components, reduced to at most ``n_components``.

    If the union has more components than wanted, the component means are clustered with
    k-means (weighted by component weight, 10 restarts) and each cluster is moment-matched
    (``_moment_match``), which preserves the union's overall mean and diagonal covariance
    exactly, so the reduction only loses shape, not location or spread.
    """
    weights, means, variances, total = _union(mixtures)
    if len(weights) > n_components:
        n_clusters = min(n_components, len(np.unique(means, axis=0)))
        with _one_thread():
            kmeans = KMeans(n_clusters=n_clusters, n_init=10, random_state=seed)
            labels = kmeans.fit(means, sample_weight=weights).labels_
        weights, means, variances = _moment_match(weights, means, variances, labels)
    return _mixture(weights, means, variances, total)


def _nearest(points: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Each point's nearest centre: ‖x - c‖² = ‖x‖² - 2 x·c + ‖c‖², ‖x‖² the same for all c."""
    nearest: np.ndarray = ((centres**2).sum(1) - 2 * points @ centres.T).argmin(1)
    return nearest


def _lloyd(points: np.ndarray, weights: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Weighted Lloyd iterations from ``centres`` [K, D]: each point's cluster [P]. A centre left
    without points stays where it is (its cluster is empty). In float32: only the labels come
    out, and each pass over the points costs half as much."""
    points, centres = points.astype(np.float32), centres.astype(np.float32)
    weights = weights.astype(np.float32)
    rows = np.arange(len(points))
    labels = _nearest(points, centres)
    for _ in range(LLOYD_ITERATIONS - 1):
        assignment = np.zeros((len(centres), len(points)), np.float32)
        assignment[labels, rows] = weights
        mass = assignment.sum(1, keepdims=True)
        centres = np.divide(assignment @ points, mass, out=centres.copy(), where=mass > 0)
        nearest = _nearest(points, centres)
        if np.array_equal(nearest, labels):
            break
        labels = nearest
    return labels


def _reduce(
    mixtures: Sequence[GaussianMixture], n_components: int, seed: int, warm: bool
) -> GaussianMixture:
    """``merge_mixtures`` for a streamed pool: k-means as Lloyd iterations started from the
    running reduction's means (``warm``: ``mixtures[0]`` summarises every earlier site) or from a
    k-means++ draw, without restarts; the same moment matching, so the same invariant."""
    weights, means, variances, total = _union(mixtures)
    if len(weights) > n_components:
        with _one_thread():
            if warm:
                centres = mixtures[0].means.numpy()
            else:
                centres, _ = kmeans_plusplus(
                    means, n_components, sample_weight=weights, random_state=seed
                )
            labels = _lloyd(means, weights, centres)
        weights, means, variances = _moment_match(weights, means, variances, labels)
    return _mixture(weights, means, variances, total)


@dataclass
class _Pool:
    """One class's mixtures of one field, pooled until they hold more than the bound's
    components; after a reduction, ``mixtures[0]`` is the running reduction of all before it."""

    mixtures: list[GaussianMixture] = field(default_factory=list)
    components: int = 0
    reduced: bool = False

    def add(self, mixture: GaussianMixture, bound: int, n_components: int, seed: int) -> None:
        self.mixtures.append(mixture)
        self.components += mixture.n_components
        if self.components > bound:
            self.mixtures = [_reduce(self.mixtures, n_components, seed, warm=self.reduced)]
            self.components = self.mixtures[0].n_components
            self.reduced = True

    def result(self, n_components: int, seed: int) -> GaussianMixture:
        if not self.reduced:  # never over the bound: the one k-means over the whole union
            return merge_mixtures(self.mixtures, n_components, seed)
        if len(self.mixtures) == 1:
            return self.mixtures[0]
        return _reduce(self.mixtures, n_components, seed, warm=True)

    @property
    def nbytes(self) -> int:
        return sum(m.means.nbytes + m.variances.nbytes + m.weights.nbytes for m in self.mixtures)


# --- updates ------------------------------------------------------------------------------------


@dataclass
class _Sum:
    """One class's rows of one tensor field: float64 sum of count × row, and the counts."""

    total: torch.Tensor
    weight: int = 0


class MergeAccumulator:
    """One phase's merge, fed one decoded update at a time (``add``), read with ``result``: a
    new codebook, one version later, with the updates merged class by class.

    The updates were validated when they were decoded (``wire.decode_update``), so they name
    registered classes and carry their phase's fields. They are consumed one at a time, so
    the merge's own state does not grow with the number of updates.

    - Per class and per field, the new value is the average over the updates that carry that
      class, weighted by their example counts (FedAvg per class: the previous value does not
      take part). Mixtures are merged as by ``merge_mixtures`` (pooled, see below).
    - A class's count becomes the sum of the counts of the updates carrying it: the examples
      behind the merged values. It is not added to the previous count, because every round
      re-reports the same examples.
    - Frozen classes are never changed. Rows for them are ignored (logged), not rejected.
    - Changed classes get the new version as their version. Inputs are not modified.

    Its state is per class and field, whatever the number of updates: a float64 sum for a
    tensor, a pool of at most ``bound`` (plus one site's) components for a mixture. Below the
    bound the result is what merging the whole list at once gives: ``merge_mixtures`` over the
    union; tensor averages equal up to float64 rounding, which depends on the order of updates
    (the server adds them in an order of their content, docs/design.md#the-codebook). Beyond
    it, pools are reduced on the way, which keeps every mixture's mean and diagonal covariance
    but makes its shape depend on that order.
    """

    def __init__(
        self,
        codebook: Codebook,
        *,
        n_components: int = DEFAULT_COMPONENTS,
        seed: int = 0,
        bound: int = POOL_BOUND,
    ) -> None:
        self.codebook = codebook
        self.n_components = n_components
        self.seed = seed
        self.bound = bound
        self._counts: dict[str, int] = {}  # class -> examples behind its rows; first-seen order
        self._sums: dict[tuple[str, str], _Sum] = {}
        self._pools: dict[tuple[str, str], _Pool] = {}
        self._ignored: set[str] = set()

    @property
    def carried(self) -> set[str]:
        """The classes some update carried rows for (frozen ones excluded)."""
        return set(self._counts)

    @property
    def nbytes(self) -> int:
        """Bytes of the sums and pooled mixtures held: bounded per class and field."""
        sums = sum(s.total.nbytes for s in self._sums.values())
        return sums + sum(pool.nbytes for pool in self._pools.values())

    def add(self, update: ClientUpdate) -> None:
        """Fold one validated update in (``wire.decode_update``: registered classes, its phase's
        fields). Rows of frozen classes are ignored, not rejected: a site whose task stream
        reaches a class after it was frozen elsewhere is legitimate."""
        with _one_thread():
            for entry in update.entries:
                if self.codebook[entry.name].frozen:
                    self._ignored.add(entry.name)
                    continue
                self._counts[entry.name] = self._counts.get(entry.name, 0) + entry.count
                for name, value in entry.values.items():
                    key = (entry.name, name)
                    if isinstance(value, GaussianMixture):
                        pool = self._pools.setdefault(key, _Pool())
                        pool.add(value, self.bound, self.n_components, self.seed)
                    else:
                        if key not in self._sums:
                            self._sums[key] = _Sum(torch.zeros(value.shape, dtype=torch.float64))
                        # count × row is exact in float64 (a float32 times an integer < 2**29)
                        self._sums[key].total.add_(value, alpha=entry.count)
                        self._sums[key].weight += entry.count

    def result(self) -> Codebook:
        """A new codebook, one version later, with the merged classes."""
        if self._ignored:
            logger.info("ignored update rows of frozen classes: %s", sorted(self._ignored))
        values: dict[str, dict[str, Value]] = {name: {} for name in self._counts}
        for f in schema.FIELDS:
            for name in self._counts:
                key = (name, f.name)
                if key in self._sums:
                    s = self._sums[key]
                    values[name][f.name] = (s.total / s.weight).to(torch.float32)
                elif key in self._pools:
                    values[name][f.name] = self._pools[key].result(self.n_components, self.seed)
        return self.codebook.set_values(values, self._counts)
