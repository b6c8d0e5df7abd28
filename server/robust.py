"""A robust per-class merge: the coordinate-wise median of the sites that hold a class.

starfed's strategy averages a class over its holders weighted by their examples, so one site
that holds a class with others moves it by its own rows as far as its weight allows — with
consistent lies about its own data (docs/security.md), as far as it likes. When three or more
sites hold a class, the coordinate-wise median of their rows ignores any one of them, whatever
its count: ``merge = median`` (the default) makes this the default strategy, and
``with_merge`` gives a baseline's strategy the same merge (``MERGE_STRATEGIES``: each value of
the ``merge`` knob and its strategy). Classes held by one or two sites merge as in
``MeanStrategy`` (the weighted mean). Mixtures are pooled by count as there, each site's
components kept; where three or more sites send a class's mixture, a site's whose mean lies
far from the others' (``mixture_distances``) never reaches the pool: the screen stage rejects
it, a finding against its site (``server.field_bounds``, under this merge). With two nothing
tells the honest one from the other.

The median needs every row of the class at once, so unlike the streamed mean this strategy
holds the phase's updates until its end (views of the replies' bytes, which the coordinator
holds anyway for the screening's two passes); beyond them it needs one cache-sized block of
one field's values, gathered from the rows with the sites side by side (``SiteStack``, a loop
numba compiles): memory grows with the sites that hold a class, not with the classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from starfed.server.strategy import MeanStrategy, PhaseState, Strategy
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.knob import ConfigError

MIN_HOLDERS = 3  # below this, a median is no more robust than a mean
#: The ``merge`` knob's value of this strategy: the screen holds mixtures to it as well.
ROBUST_MERGE = "median"
# A mixture is rejected when its mean is more than this many times further from the median of
# the senders' means than the senders' median distance (or the spread of the class's features,
# if larger), each distance on the scale of its count (``mixture_distances``). In the default
# simulation the largest honest one is 7.8 × (docs/security.md, §1c, attack 3).
MIXTURE_OUTLIER = 20.0
# Coordinates gathered from every row at a time: one 64-byte line of float32 from each row, the
# block's rows written 16 at a time (at 1,000 sites 16 measured 1.2x faster than 8 and 1.9x
# faster than 64: docs/benchmarks.md#the-median-merge).
LANES = 16
# The bytes of one block of coordinates with every site's values: small enough to stay in a
# core's L2 cache (1-4 MB on today's server cores; blocks of 1, 2 and 4 MB measured the same on
# one of 4 MB) while numpy's partition selects in it, which it does 1.3-1.8x faster there than
# in a field-sized buffer in memory (docs/benchmarks.md#the-median-merge).
BLOCK_BYTES = 2**21


def _as_pointer(typingctx, address, like):
    """``_pointer``'s signature and machine code (numba's ``intrinsic``)."""
    signature = types.CPointer(like.dtype)(address, like)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen


#: ``_pointer(address, like)`` in compiled code: the integer ``address`` (a row's ``data_ptr``)
#: as a pointer to ``like``'s element type, read as an array
_pointer: Any = intrinsic(_as_pointer)


def _compiled(function: Callable[..., None]) -> Callable[..., None]:
    """``function`` compiled by numba on its first call, the machine code cached on disk: next
    to this module (``__pycache__``) if that folder is writable, else under the user's cache
    folder (``~/.cache/numba``), or where ``NUMBA_CACHE_DIR`` says. With none writable (a
    read-only install and home) numba refuses to cache; then each process compiles it again
    (seconds: docs/benchmarks.md#the-median-merge) rather than the import failing."""
    try:
        return numba.njit(cache=True, nogil=True)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True)(function)


@_compiled
def _gather_block(addresses, start, block, like):
    """``block[c, s]`` = row ``s``'s value ``start + c``, ``LANES`` coordinates at a time."""
    width, sites = block.shape
    for first in range(0, width, LANES):
        last = min(first + LANES, width)
        for s in range(sites):
            row = _pointer(addresses[s], like)
            for c in range(first, last):
                block[c, s] = row[start + c]


class SiteStack:
    """The lower median over sites, coordinate by coordinate, of one field's rows.

    One block of coordinates at a time, a compiled loop reads their values straight from every
    row into a cache-sized buffer with the sites on its last, contiguous axis
    (``_gather_block``), where numpy's in-place partition selects the middle one. The buffer is
    reused from field to field and class to class: memory is one block. Stacking the rows and
    transposing the stack's blocks with numpy instead made the whole merge 1.4x slower at 1,000
    sites, and a compiled selection (a branch-free quickselect) is 1.9x slower than numpy's, which
    is SIMD (docs/benchmarks.md#the-median-merge). The k-th smallest is the same value whatever
    selects it, so the result is what ``torch.median`` gives (of ``-0.0`` and ``0.0`` at the
    median, either may come).
    """

    def __init__(self) -> None:
        self._block = np.empty(0, np.float32)  # [coordinates of a block, sites]

    def median(self, rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """The lower of the two middle values for an even number of rows (``torch.median``'s)."""
        shape, sites, coordinates = rows[0].shape, len(rows), rows[0].numel()
        if any(
            row.shape != shape or row.dtype != rows[0].dtype or row.device.type != "cpu"
            for row in rows
        ):  # the kernel reads every row's memory as long as the first's: decoding checked them
            raise ValueError(f"rows of one field differ in shape, type or device: {shape} first")
        laid_out = [row.contiguous() for row in rows]  # the addresses below point into these
        addresses = np.array([row.data_ptr() for row in laid_out], dtype=np.int64)
        result = torch.empty(coordinates, dtype=rows[0].dtype)
        selected = result.numpy()
        width = max(1, min(coordinates, BLOCK_BYTES // (sites * selected.itemsize)))
        if self._block.size < width * sites or self._block.dtype != selected.dtype:
            self._block = np.empty(width * sites, selected.dtype)
        middle = (sites - 1) // 2
        for start in range(0, coordinates, width):
            stop = min(start + width, coordinates)
            block = self._block[: (stop - start) * sites].reshape(stop - start, sites)
            _gather_block(addresses, start, block, selected)
            block.partition(middle, axis=1)
            selected[start:stop] = block[:, middle]
        return result.view(shape)


class MedianStrategy(Strategy):
    """starfed's hooks with the coordinate-wise median of the tensor rows of every class that at
    least ``MIN_HOLDERS`` updates carry."""

    @staticmethod
    def merge(updates: Iterable[ClientUpdate], state: PhaseState) -> Codebook:
        """Tensor rows are held per class until the end; the classes with enough holders get
        one row, their median, with their summed count; the rest merge as in ``MeanStrategy``
        (the screen has rejected the mixtures ``mixture_distances`` finds far)."""
        received = list(updates)
        rows: dict[str, list[ClassEntry]] = {}
        for update in received:
            for entry in update.entries:
                if not any(isinstance(v, GaussianMixture) for v in entry.values.values()):
                    rows.setdefault(entry.name, []).append(entry)
        robust = {name for name, entries in rows.items() if len(entries) >= MIN_HOLDERS}
        merge = MergeAccumulator(state.codebook, n_components=state.train.mixture_components)
        for update in received:
            merge.add(update.only({e.name for e in update.entries} - robust))
        stack = SiteStack()  # one buffer for every field of every class
        medians = tuple(_median_entry(rows[name], stack) for name in sorted(robust))
        if medians:
            first = received[0]
            merge.add(
                ClientUpdate(
                    first.fingerprint, first.dims, first.phase, first.base_version, medians
                )
            )
        return merge.result()


def _median_entry(entries: Sequence[ClassEntry], stack: SiteStack) -> ClassEntry:
    """One class's entries (tensor fields only, from ``MIN_HOLDERS`` or more sites) as one: each
    field's coordinate-wise median, the entries' summed count."""
    values = {
        field: stack.median([e.tensor(field) for e in entries]) for field in entries[0].values
    }
    return ClassEntry(entries[0].name, sum(e.count for e in entries), values)


def mixture_distances(mixtures: Sequence[GaussianMixture]) -> list[float]:
    """For each of one class's mixtures (one per site, ``MIN_HOLDERS`` or more), how far its
    mean lies from the coordinate-wise median of the means, on its count's scale, in units of
    the senders' median of the same: over ``MIXTURE_OUTLIER`` it is an outlier.

    A site's mean of n features misses the class's by about their spread × √(1/n), and the
    median misses it by about that of a typical site's count (the median count, n₀), so each
    distance is divided by √(1/n + 1/n₀): every honest site is on one scale, whatever its
    count. A site that claims many images to weigh more in the pool is held to about the
    distance of a site of n₀, so its pull on the pooled mean stays within ``MIXTURE_OUTLIER`` ×
    an honest site's. The unit is at least the spread of the class's features (the median over
    senders of each mixture's total standard deviation), which an honest site's distance is
    about: where most sites' means agree exactly (sites with the same images) it is that."""
    means = torch.stack([m.mean() for m in mixtures])
    counts = torch.tensor([m.count for m in mixtures], dtype=torch.float64)
    centre = means.median(dim=0).values
    spread = (means - centre).norm(dim=1) / (1 / counts + 1 / counts.median()).sqrt()
    features = torch.stack([m.deviation() for m in mixtures]).median()
    scale = max(float(spread.median()), float(features))
    return [float(s) / max(scale, 1e-300) for s in spread]


#: Each value of the ``merge`` knob (``shared.config.MERGES``) and the strategy it names: a new
#: merge rule is a line here, and ``run_server`` (``server/app.py``) needs no change.
MERGE_STRATEGIES: dict[str, type[Strategy]] = {"mean": MeanStrategy, ROBUST_MERGE: MedianStrategy}


def with_merge(strategy: Strategy | None, merge: str) -> Strategy:
    """``strategy`` (None: starfed's) merging by the protocol's ``merge``: a baseline that
    changes another hook (``starfed.simulations.methods``) is then compared with starfed at the
    same merge. With ``mean`` a strategy keeps its own ``merge``; with another value its class
    is subclassed under its own name (metrics.json names the baseline; the estimator is the
    protocol's ``merge``), and a strategy with a ``merge`` of its own is refused."""
    chosen = MERGE_STRATEGIES[merge]
    if strategy is None:
        return chosen()
    if chosen is MeanStrategy or isinstance(strategy, chosen):
        return strategy
    cls = type(strategy)
    if cls.merge is not MeanStrategy.merge:
        raise ConfigError(
            f"merge = {merge}: {cls.__qualname__} merges its own way; set merge = mean"
        )
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    variant_class: type[Strategy] = type(cls.__name__, (chosen, cls), names)
    variant = variant_class.__new__(variant_class)
    variant.__dict__.update(vars(strategy))
    return variant
