"""`starfed-unmerged`: every site's Gaussians kept as they came, not merged into one mixture
per class; the server replays from them (HGP/CCVR-style): what the mixture merge costs or buys.

In `starfed` the server merges the sites' mixtures of a class into ``mixture-components``
Gaussians (k-means over the union's components, moment-matched: ``merge_mixtures``) before the
first-level replay and the head's replay. Here the union is kept whole: each site's components,
weighted by its share of the class's examples, so a replay draws from each site's Gaussians in
proportion to its examples, as CCVR samples per client. Only the statistics phases' aggregation
is overridden; training, registration, the replays themselves and evaluation are starfed's. The
codebook then holds up to sites × components Gaussians per class, which only the server ever
holds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from starfed.server.strategy import MeanStrategy, PhaseState
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.protocol import Phase

#: Components kept per class: no reduction, whatever the number of sites.
UNBOUNDED = sys.maxsize


class Unmerged(MeanStrategy):
    def aggregate_statistics(
        self, phase: Phase, updates: Iterable[ClientUpdate], state: PhaseState
    ) -> Codebook:
        """The updates' mixtures pooled per class (count-weighted union, nothing reduced);
        their counts summed as in the merge."""
        pool = MergeAccumulator(state.codebook, n_components=UNBOUNDED, bound=UNBOUNDED)
        for update in updates:
            pool.add(update)
        return pool.result()
