"""The one home of the tests' small training settings: every replay at one epoch.

Model and replay tests train the tiny backbones for a few steps; each states only what it
varies on top of ``small_train`` (stage epochs, batch sizes, the replay schedule), so the
settings they share are written once.
"""

from __future__ import annotations

from typing import Any

from starfed.shared.model.training import TrainConfig

#: One epoch of each replay, and one more of the head replay per task.
ONE_EPOCH_REPLAYS = {"replay1_epochs": 1, "replay2_epochs": 1, "replay2_epochs_per_task": 1}


def small_train(**overrides: Any) -> TrainConfig:
    """``TrainConfig`` with ``ONE_EPOCH_REPLAYS``, then ``overrides`` (field names)."""
    return TrainConfig(**{**ONE_EPOCH_REPLAYS, **overrides})
