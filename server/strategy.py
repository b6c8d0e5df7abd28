"""How the server turns a phase's replies into the next codebook: the strategy.

In the spirit of Flower's ``Strategy`` (``configure_train`` / ``aggregate_train``, ...), with
names of its own because its hooks take other arguments (a phase's validated updates, a frozen
``PhaseState``) and return a codebook: the
``Coordinator`` runs the protocol — sync, sampling, messaging, decoding (= validating) and
rejecting replies, checkpoints, the step's record — and asks its strategy, at every codebook
phase of ``starfed.shared.protocol.PHASES``, what the message carries beyond the protocol's own
config (``configure``) and how the validated replies become a new codebook (``aggregate_training``,
``aggregate_statistics`` then ``replay``) or the step's scores (``aggregate_evaluation``).

``Strategy`` is the hooks, each starfed's own except the per-class ``merge``, which is named
for what it computes: ``MeanStrategy`` averages every class over the sites that carry it,
weighted by their examples, mixtures merged (``MergeAccumulator``, docs/design.md#the-codebook);
``server.robust.MedianStrategy`` (``merge = median``, the default) takes the coordinate-wise
median where three or more sites hold a class. After a statistics phase come the server's
generative replays (``starfed.server.replay``). A baseline is a subclass of ``MeanStrategy``
that overrides one hook (``starfed.simulations.methods``). Hooks read a ``PhaseState`` and
return new values; they never change the coordinator. Updates arrive screened
(``server.field_bounds.screen_phase``), as views of the replies' bytes, in the order of site
names, which fixes the float rounding of a merge.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from starfed.server import replay
from starfed.server.records import StepScores
from starfed.server.scores import aggregate
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.merge import MergeAccumulator
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import ConfigValue, Phase
from starfed.shared.report import EvaluationReport


@dataclass(frozen=True)
class PhaseState:
    """What a hook may read about the phase in progress (a snapshot; changing it changes
    nothing)."""

    step: int
    round: int
    # the codebook the phase merges into: the one it was sent with, or for a phase that
    # travels with another (``PhaseSpec.travels_with``), the one that phase just made
    codebook: Codebook
    in_play: tuple[str, ...]  # the classes the step trains
    class_steps: Mapping[str, int]  # the step that registered each codebook class
    backbones: Backbones
    train: TrainConfig


class Strategy(ABC):
    """The hooks the coordinator calls: a phase's config, the per-class ``merge`` of its
    updates (the subclass's), replay after each statistics phase, the evaluation's scores."""

    def configure(self, phase: Phase, state: PhaseState) -> dict[str, ConfigValue]:
        """Entries the phase's message config carries besides the protocol's (none); asked
        once per phase round of a step (``Coordinator._configure``)."""
        return {}

    def aggregate_training(
        self, phase: Phase, updates: Iterable[ClientUpdate], state: PhaseState
    ) -> Codebook:
        """A training phase's updates merged class by class (``MergeAccumulator``)."""
        return self.merge(updates, state)

    def aggregate_statistics(
        self, phase: Phase, updates: Iterable[ClientUpdate], state: PhaseState
    ) -> Codebook:
        """A statistics phase's mixtures merged class by class (``merge_mixtures``). Classes no
        update carried statistics for are then unregistered by the coordinator."""
        return self.merge(updates, state)

    def replay(self, phase: Phase, codebook: Codebook, state: PhaseState) -> Codebook:
        """After the stage-1 statistics, the first-level replay (prompts and keys of the classes
        in play are final); after the stage-2 statistics, the head's replay, and the classes in
        play are frozen. ``codebook`` is the merged one; ``state.in_play`` the classes left."""
        if phase is Phase.STAGE1_STATS:
            return replay.replay_first_level(codebook, state.backbones, state.train, state.step)
        if phase is Phase.STAGE2_STATS:
            device = state.backbones.device
            return replay.replay_head(codebook, state.train, state.step, state.in_play, device)
        raise ValueError(f"{phase.key} is not a statistics phase")

    def aggregate_evaluation(
        self, reports: Iterable[tuple[str, EvaluationReport]], state: PhaseState
    ) -> StepScores:
        """The sites' scores by arrival step, each site one vote (``server.scores``)."""
        n_layers = state.codebook.dims.n_layers
        return aggregate(reports, state.class_steps, state.step, n_layers)

    @staticmethod
    @abstractmethod
    def merge(updates: Iterable[ClientUpdate], state: PhaseState) -> Codebook:
        """The updates merged class by class into ``state.codebook``."""


class MeanStrategy(Strategy):
    """The per-class weighted mean: starfed's strategy with ``merge = mean``, and the base of
    the baselines (``starfed.simulations.methods``)."""

    @staticmethod
    def merge(updates: Iterable[ClientUpdate], state: PhaseState) -> Codebook:
        """The updates folded one at a time into the per-class mean of ``state.codebook``
        (weighted by examples; mixtures pooled and reduced, ``MergeAccumulator``)."""
        merge = MergeAccumulator(state.codebook, n_components=state.train.mixture_components)
        for update in updates:
            merge.add(update)
        return merge.result()
