"""`starfed-no-replay`: federated STAR-Prompt without generative replay (the paper's Table 4
ablation, federated): what the mixtures buy a federation.

The server registers, merges (statistics included) and freezes as `starfed` does, but never
calibrates the keys or the head on features drawn from the merged class mixtures: after the
stage-1 statistics the keys are computed from the merged prompts as they are, after the stage-2
statistics the predicting head is the merged real-data head (``replay1`` / ``replay2`` with
replay off). Sites do exactly what they do in `starfed`.
"""

from __future__ import annotations

from dataclasses import replace

from starfed.server.strategy import MeanStrategy, PhaseState
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.protocol import Phase


class NoReplay(MeanStrategy):
    def replay(self, phase: Phase, codebook: Codebook, state: PhaseState) -> Codebook:
        without = replace(state.train, generative_replay=False)
        return super().replay(phase, codebook, replace(state, train=without))
