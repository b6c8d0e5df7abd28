"""A robust per-class merge: the coordinate-wise median of the sites that hold a class.

starfed's strategy averages a class over its holders weighted by their examples, so one site
that holds a class with others moves it by its own rows as far as its weight allows — with
consistent lies about its own data (docs/security.md), as far as it likes. When three or more
sites hold a class, the coordinate-wise median of their rows ignores any one of them, whatever
its count: ``merge = median`` (the default) makes this the default strategy, and
``with_merge`` gives a baseline's strategy the same merge (``MERGE_STRATEGIES``: each value of
the ``merge`` knob and its strategy). Classes held by one or two sites, and every
mixture, merge as in ``MeanStrategy`` (the weighted mean).

The median needs every row of the class at once, so unlike the streamed mean this strategy
holds the tensor rows of a phase's classes until its end: memory grows with the sites that
hold a class, not only with the classes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from starfed.server.strategy import MeanStrategy, PhaseState, Strategy
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.knob import ConfigError

MIN_HOLDERS = 3  # below this, a median is no more robust than a mean


class MedianStrategy(Strategy):
    """starfed's hooks with the coordinate-wise median of the tensor rows of every class that at
    least ``MIN_HOLDERS`` updates carry."""

    @staticmethod
    def merge(updates: Iterable[ClientUpdate], state: PhaseState) -> Codebook:
        """Tensor rows are held per class until the end; the classes with enough holders get
        one row, their median, with their summed count; the rest merge as in ``MeanStrategy``."""
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
        medians = []
        for name in sorted(robust):
            entries = rows[name]
            values = {  # the lower of the two middle rows for an even number of holders
                field: torch.stack([e.tensor(field) for e in entries]).median(dim=0).values
                for field in entries[0].values
            }
            medians.append(ClassEntry(name, sum(e.count for e in entries), values))
        if medians:
            first = received[0]
            merge.add(
                ClientUpdate(
                    first.fingerprint, first.dims, first.phase, first.base_version, tuple(medians)
                )
            )
        return merge.result()


#: Each value of the ``merge`` knob (``shared.config.MERGES``) and the strategy it names: a new
#: merge rule is a line here, and ``run_server`` (``server/app.py``) needs no change.
MERGE_STRATEGIES: dict[str, type[Strategy]] = {"mean": MeanStrategy, "median": MedianStrategy}


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
