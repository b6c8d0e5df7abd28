"""How the server turns a phase's replies into the next codebook: the strategy.

In the spirit of Flower's ``Strategy`` (``configure_train`` / ``aggregate_train``, ...), with
names of its own because its hooks take other arguments (a phase's validated updates, a frozen
``PhaseState``) and return a codebook: the
``Coordinator`` runs the protocol — sync, sampling, messaging, decoding (= validating) and
rejecting replies, checkpoints, the step's record — and asks its strategy, at every codebook
phase of ``starfed.shared.protocol.PHASES``, what the message carries beyond the protocol's own
config (``configure``) and how the validated replies become a new codebook (``aggregate_training``,
``aggregate_statistics`` then ``replay``) or the step's scores (``aggregate_evaluation``).

``Strategy`` itself is starfed's: every class averaged over the sites that carry it, weighted by
their examples, mixtures merged (``MergeAccumulator``, docs/design.md#the-codebook), then the
server's generative replays (``starfed.server.replay``). A baseline is a subclass that overrides
one hook (``starfed.simulations.methods``). Hooks read a ``PhaseState`` and return new values;
they never change the coordinator, and updates arrive one at a time (a phase never holds every
decoded update), in an order of their content, which fixes the float rounding of a merge.
"""

from __future__ import annotations

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


class Strategy:
    """starfed's strategy: the per-class merge, then replay after each statistics phase."""

    def configure(self, phase: Phase, state: PhaseState) -> dict[str, ConfigValue]:
        """Entries the phase's message config carries besides the protocol's (none)."""
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
        """The sites' counts added up, grouped by arrival step (``server.scores``)."""
        n_layers = state.codebook.dims.n_layers
        return aggregate(reports, state.class_steps, state.step, n_layers)

    @staticmethod
    def merge(updates: Iterable[ClientUpdate], state: PhaseState) -> Codebook:
        """The updates folded one at a time into the per-class merge of ``state.codebook``."""
        merge = MergeAccumulator(state.codebook, n_components=state.train.mixture_components)
        for update in updates:
            merge.add(update)
        return merge.result()
