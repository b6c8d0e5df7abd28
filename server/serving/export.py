"""The deployable codebook of a federation: what inference-only devices receive.

A device predicts; it never trains. It needs the finished (frozen) classes in broadcast form —
no mixtures (the server's replay memory and most of a codebook's bytes), no server bookkeeping —
the backbone fingerprint, and in the metadata the step that registered each class and how the
model was trained (``starfed.shared.inference.predict``). The classes of a step in progress are left
out: they are half trained.

Its version is the version at which its classes last changed (every step's head replay touches
every class and freezes the new ones), so it is a function of what the federation finished:
exporting twice gives the same bytes, and the codebook service (``server.serving.distribution``)
answers a device holding version v with ``Codebook.delta(v)`` of it. Every class a device lacks
arrived after the version it holds, so the delta carries all of such a class's fields.

``write`` saves it (``starfed server export``) with a model card next to it, ``<out>.card.json``:
classes with the step and sites that brought them, backbones, the federation's scores.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from starfed.server.federation import Federation
from starfed.server.folder_files import FederationError, append_export
from starfed.server.records import ExportRecord, now
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.deployment import CONFIDENCE_KEY, deployment_metadata
from starfed.shared.codebook.lineage import Lineage
from starfed.shared.config import TABLES
from starfed.shared.files import write_atomic
from starfed.shared.metrics import nan_to_none
from starfed.shared.model.backbone_config import BackboneError, read_backbone_config
from starfed.shared.version import package_version

CARD_SUFFIX = ".card.json"
CARD_FORMAT = "starfed-model-card/1"
METRIC_KEYS = (
    "final_average_accuracy",
    "final_forgetting",
    "accuracy_matrix",
    "prompt_selection_accuracy",
    "prompt_selection_accuracy_matrix",
    "server_test_accuracy_matrix",
    "steps",
    "codebook_version",
)


class NothingToExport(RuntimeError):
    """The federation has no frozen class yet."""


@dataclass
class Deployable:
    """The deployable codebook (field versions kept, so it can make deltas; ``broadcast()`` is
    what is written and sent) and the classes of the step in progress it leaves out."""

    codebook: Codebook
    left_out: list[str]


def deployable(federation: Federation) -> Deployable:
    """The frozen classes of ``federation``'s codebook, as devices receive them."""
    codebook = federation.checkpoints.codebook()
    entries = {name: e for name, e in codebook.entries.items() if e.frozen}
    train = federation.metrics().get("config", {}).get("train", {})
    modulation = train.get(
        "confidence_modulation", TABLES["run-config"]["confidence-modulation"].default
    )
    unknown = [name for name in entries if name not in federation.registry]
    if unknown:
        raise FederationError(f"{federation.root}: registry.json lacks class {unknown[0]!r}")
    steps = {name: federation.registry[name].step for name in entries}
    metadata = deployment_metadata(Lineage.of(codebook), steps, modulation)
    frozen = Codebook(
        codebook.fingerprint,
        codebook.dims,
        entries,
        max((e.version for e in entries.values()), default=0),
        metadata,
    )
    return Deployable(frozen, [name for name in codebook.names if name not in entries])


def card_path(out: Path) -> Path:
    return out.with_name(out.name + CARD_SUFFIX)


def _backbone_name(run_config: dict) -> str | None:
    """The backbone config the federation's last run named, if it says."""
    path = run_config.get("backbone-config")
    if not path:
        return run_config.get("preset")
    try:
        return read_backbone_config(path).name
    except BackboneError:
        return Path(path).stem


def model_card(federation: Federation, export: Deployable, out: Path, dtype: str) -> dict:
    """What a person (or a registry) wants to know about an exported codebook."""
    codebook = export.codebook
    metrics = federation.metrics()
    data = out.read_bytes()
    return {
        "format": CARD_FORMAT,
        "codebook": {
            "file": out.name,
            "version": codebook.version,
            "classes": len(codebook),
            "dtype": dtype,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        },
        "federation": federation.id,
        "backbones": {
            "fingerprint": codebook.fingerprint,
            "config": _backbone_name(metrics.get("config", {}).get("run_config", {})),
            "dims": vars(codebook.dims),
        },
        "confidence_modulation": codebook.metadata[CONFIDENCE_KEY] == "true",
        "classes": [
            {
                "name": name,
                "step": federation.registry[name].step + 1,  # 1-based, as shown
                "registered": federation.registry[name].registered,
                "sites": federation.registry[name].sites,
            }
            for name in codebook.names
        ],
        "left_out": export.left_out,
        "metrics": {key: nan_to_none(metrics.get(key)) for key in METRIC_KEYS} if metrics else None,
        "created": now(),
        "starfed_version": package_version(),
    }


def write(federation: Federation, export: Deployable, out: Path, dtype: str = "float32") -> dict:
    """Write ``export`` (of ``federation``) to ``out`` and its model card next to it (both
    atomic); returns the card."""
    if not len(export.codebook):
        raise NothingToExport(
            f"federation {federation.id[:8]} has no frozen class yet"
            + (f" ({len(export.left_out)} in the step in progress)" if export.left_out else "")
        )
    wire.write_file(out, export.codebook.broadcast(), dtype)
    card = model_card(federation, export, out, dtype)
    write_atomic(card_path(out), (json.dumps(card, indent=2) + "\n").encode())
    names = tuple(export.codebook.names)
    record = ExportRecord(str(out.resolve()), now(), export.codebook.version, names)
    append_export(federation.root, record)
    return card
