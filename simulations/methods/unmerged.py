"""`starfed-unmerged`: every site's Gaussians kept as they came, not merged into one mixture
per class; the server replays from them (HGP/CCVR-style): what the mixture merge costs or buys.

In `starfed` the server merges the sites' mixtures of a class into ``mixture-components``
Gaussians (k-means over the union's components, moment-matched: ``merge_mixtures``) before the
first-level replay and the head's replay. Here the union is kept whole: each site's components,
weighted by its share of the class's examples, so a replay draws from each site's Gaussians in
proportion to its examples, as CCVR samples per client. Both statistics phases are reduced so;
training, registration, the replays themselves and evaluation are starfed's (only the two
statistics reducers are swapped: ``starfed.simulations.methods.reducers``). The codebook then
holds up to sites × components Gaussians per class, which only the server ever holds.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from starfed.server import replay
from starfed.server.coordinator import Coordinator, StepFailed
from starfed.server.messaging import Reply
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.config import Values
from starfed.shared.protocol import Phase
from starfed.simulations.methods.reducers import run_with

#: Components kept per class: no reduction, whatever the number of sites.
UNBOUNDED = sys.maxsize


def pool_statistics(coordinator: Coordinator, phase: Phase, replies: list[Reply]) -> None:
    """The replies' mixtures pooled per class (count-weighted union, nothing reduced); their
    counts summed as in the merge."""
    pool = MergeAccumulator(coordinator.codebook, n_components=UNBOUNDED, bound=UNBOUNDED)
    for _, update in coordinator._updates(replies, phase):  # decoded = validated
        pool.add(update)
    if not pool.carried & set(coordinator.in_play):
        raise StepFailed(f"no site's {phase.key} update arrived for any class in play")
    coordinator.codebook = pool.result()


def stage1_statistics(
    coordinator: Coordinator, phase: Phase, step: int, replies: list[Reply]
) -> None:
    """The coordinator's stage-1 statistics step with the sites' Gaussians pooled."""
    pool_statistics(coordinator, phase, replies)
    coordinator._drop_unfitted("clip_mixture")
    coordinator.codebook = replay.replay_first_level(
        coordinator.codebook, coordinator.backbones, coordinator.train, step
    )


def stage2_statistics(
    coordinator: Coordinator, phase: Phase, step: int, replies: list[Reply]
) -> None:
    """The coordinator's stage-2 statistics step with the sites' Gaussians pooled."""
    pool_statistics(coordinator, phase, replies)
    coordinator._drop_unfitted("vit_mixture")
    coordinator.codebook = replay.replay_head(
        coordinator.codebook, coordinator.train, step, coordinator.in_play,
        coordinator.backbones.device,
    )  # fmt: skip


def run(values: Values, seed: int, out_dir: Path, console: Console) -> None:
    unmerged = {Phase.STAGE1_STATS: stage1_statistics, Phase.STAGE2_STATS: stage2_statistics}
    run_with(unmerged, values, seed, out_dir, console)
