"""`starfed-keys`: federated STAR-Prompt trained as usual, every evaluation predicting with the
first-level keys alone (the paper's keys-as-classifier ablation, federated): what the second
level buys.

Training and the codebook are `starfed`'s exactly; the evaluate message asks the sites (and a
server test set, scored like one more site) to classify with the keys
(``starfed.shared.protocol.CLASSIFY_WITH_KEYS``).
"""

from __future__ import annotations

from starfed.server.strategy import MeanStrategy, PhaseState
from starfed.shared.protocol import CLASSIFY_WITH_KEYS, ConfigValue, Phase


class ClassifyWithKeys(MeanStrategy):
    def configure(self, phase: Phase, state: PhaseState) -> dict[str, ConfigValue]:
        return {CLASSIFY_WITH_KEYS: True} if phase is Phase.EVALUATE else {}
