"""What a deployable codebook says about itself, for devices that have only the file.

An inference-only device holds the backbones and one codebook (``starfed server export``, or
a copy the codebook service keeps current). Besides the tensors it needs two facts about the
federation, carried in the codebook's metadata: the step that registered each class (the task
a prediction's prompts came from) and whether the model was trained with confidence
modulation. ``server/serving/export.py`` writes them, ``starfed.shared.inference.predict``
reads them; both through this module, which imports nothing heavy. The metadata also carries
the codebook's lineage (``starfed.shared.codebook.lineage``), so a device that follows the
federation applies a delta only to a codebook of the same version line
(``starfed.shared.codebook.held``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.lineage import Lineage

CLASS_STEPS_KEY = "class-steps"  # JSON {class: the step that registered it}
CONFIDENCE_KEY = "confidence-modulation"  # "true" | "false", as the federation trained


def deployment_metadata(
    lineage: Lineage, steps: Mapping[str, int], modulation: bool
) -> dict[str, str]:
    return {
        **lineage.as_metadata(),
        CLASS_STEPS_KEY: json.dumps(dict(steps)),
        CONFIDENCE_KEY: "true" if modulation else "false",
    }


def class_steps(codebook: Codebook) -> dict[str, int]:
    """The registration step of every class (validated: one for each class, integers >= 0)."""
    raw = codebook.metadata.get(CLASS_STEPS_KEY)
    if raw is None:
        raise CodebookError(
            "the codebook names no class steps: use a codebook from `starfed server export`"
        )
    try:
        steps = json.loads(raw)
    except json.JSONDecodeError:
        steps = None
    if not (
        isinstance(steps, dict)
        and set(steps) == set(codebook.names)
        and all(type(v) is int and v >= 0 for v in steps.values())
    ):
        raise CodebookError("the codebook's class steps do not match its classes")
    return steps


def confidence_modulation(codebook: Codebook) -> bool:
    value = codebook.metadata.get(CONFIDENCE_KEY, "true")
    if value not in ("true", "false"):
        raise CodebookError(f"{CONFIDENCE_KEY} must be true or false, not {value[:20]!r}")
    return value == "true"
