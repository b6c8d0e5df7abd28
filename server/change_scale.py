"""The scale of honest changes per field, measured over a federation's earlier completed steps.

Where fewer than three sites send a field in a phase, their median is no bound (a lone sender's
is its own change), and the screening holds each row to ``reference-bound`` × its class's own
size — loose, so that a site training a fresh class hard is not rejected, and so a lone
attacker may move its class by up to that multiple. Phases where three or more sites sent the
field measured how far honest training moves a row relative to its class's size: each such
site's median of change ÷ size over its kept rows is one observation (one vote per site). The
median of the newest ``KEPT`` observations per field, kept in the federation folder
(``FILE``), is a reference no sender of a later phase can move; ``history-bound`` × it ×
the class's size (× ``field_bounds.SGD_TAIL`` for stage 1's rows, trained by plain SGD) is the
tighter bound of every row, however many sites send its field, once
``MIN_OBSERVED`` observations exist (docs/security.md). A step adds its observations once it
completed (``through_step``); a failed step adds none, and a step resumed after a crash adds
those of the phases it ran after.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starfed.shared.files import write_atomic

logger = logging.getLogger(__name__)

FILE = "change-scale.json"  # in the federation folder
KEPT = 256  # observations kept per field, the newest: the file and its median stay small
MIN_OBSERVED = 3  # observations before the scale is a reference


@dataclass
class ChangeScale:
    """Per field, observed honest changes relative to their class's size (newest last), and
    the last step they include."""

    fields: dict[str, list[float]] = field(default_factory=dict)
    through_step: int = -1

    @classmethod
    def read(cls, folder: Path) -> ChangeScale:
        """The folder's scale; none (with a warning) where the file is unreadable: lone
        senders are then held to ``reference-bound`` alone, as before any history."""
        path = Path(folder) / FILE
        if not path.is_file():
            return cls()
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            logger.warning(
                "%s is unreadable (%s): no scale of earlier steps until the next "
                "completed step writes it again",
                path,
                err,
            )
            return cls()

    def to_json(self) -> dict[str, Any]:
        return {"through_step": self.through_step, "fields": self.fields}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ChangeScale:
        """The scale ``raw`` writes, the newest ``KEPT`` of each field (ValueError, TypeError,
        KeyError, AttributeError: it does not)."""
        fields = {
            str(name): [float(v) for v in values][-KEPT:] for name, values in raw["fields"].items()
        }
        return cls(fields, int(raw["through_step"]))

    def reference(self, name: str) -> float | None:
        """The median observed change ÷ size of field ``name``; None before ``MIN_OBSERVED``."""
        values = [v for v in self.fields.get(name, ()) if math.isfinite(v) and v > 0]
        return statistics.median(values) if len(values) >= MIN_OBSERVED else None

    def save(self, folder: Path, step: int, observed: dict[str, list[float]]) -> None:
        """Add completed ``step``'s observations (once: a step already included adds none).
        A failed write is logged, not raised: the step is committed, and the scale only
        tightens a bound."""
        if step <= self.through_step or not any(observed.values()):
            return
        for name, values in observed.items():
            self.fields[name] = (self.fields.get(name, []) + values)[-KEPT:]
        self.through_step = step
        try:
            write_atomic(Path(folder) / FILE, json.dumps(self.to_json(), indent=1).encode())
        except OSError as err:
            logger.warning(
                "could not write %s (%s): step %d's changes are not kept",
                Path(folder) / FILE,
                err,
                step + 1,
            )
