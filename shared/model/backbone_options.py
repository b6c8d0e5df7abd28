"""Which frozen backbone pair a participant loads, read from the knob table, and loading it.

Apart from the knob table (``starfed.shared.config``), which must not import the networks: the
frozen towers (``starfed.shared.model.frozen_towers``) read their environment knob from it.
Importing this module loads no torch; :meth:`BackboneOptions.load` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from starfed.shared.config import Options, knob
from starfed.shared.knob import optional

if TYPE_CHECKING:
    from starfed.shared.model.backbones import Backbones


@dataclass(frozen=True)
class BackboneOptions(Options):
    """Which frozen backbone pair every participant loads (their fingerprints must match)."""

    preset: str = knob("preset")
    config_path: str | None = knob("backbone-config", optional)
    clip_weights: str | None = knob("clip-weights", optional)
    vit_weights: str | None = knob("vit-weights", optional)

    def load(self, device: str = "cpu") -> Backbones:
        """The pair, built once per process and device (``starfed.shared.device`` names)."""
        return _load_backbones(self, device)


@cache
def _load_backbones(options: BackboneOptions, device: str) -> Backbones:
    """One backbone pair per process: simulation actors and a long-lived client reuse it."""
    from starfed.shared import device as devices  # torch: only when building
    from starfed.shared.model.backbones import create_backbones

    backbones = create_backbones(
        options.preset,
        config_path=options.config_path,
        clip_weights=options.clip_weights,
        vit_weights=options.vit_weights,
    )
    return backbones.place(devices.resolve(device))
