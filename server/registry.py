"""``registry.json``: every class the federation registered, the step that did and the sites
that brought it. One reader and one writer for a run, ``check`` and ``repair`` alike."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starfed.server.folder_files import REGISTRY_FILE, DamagedFile
from starfed.server.records import now
from starfed.shared.files import write_atomic

_KEYS = ("step", "registered", "sites")


@dataclass(frozen=True)
class Registration:
    """What the federation knows of one class besides its codebook entry."""

    step: int  # the step that registered it
    registered: str = field(default_factory=now)
    sites: Mapping[str, str] = field(default_factory=dict)  # site -> when it first brought it

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "registered": self.registered, "sites": dict(self.sites)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Registration:
        """The entry ``raw`` writes (ValueError, TypeError, KeyError: it does not)."""
        if unknown := sorted(set(raw) - set(_KEYS)):
            raise ValueError(f"unknown keys {unknown}")
        sites = {str(site): str(when) for site, when in dict(raw.get("sites", {})).items()}
        return cls(int(raw["step"]), str(raw.get("registered", now())), sites)

    def brought_by(self, site: str, when: str) -> Registration:
        """The entry with ``site`` among its sites (its first time kept)."""
        if site in self.sites:
            return self
        return Registration(self.step, self.registered, {**self.sites, site: when})

    def without(self, site: str) -> Registration:
        """The entry with ``site`` no longer among its sites."""
        sites = {s: when for s, when in self.sites.items() if s != site}
        return Registration(self.step, self.registered, sites)


def read_registry(root: Path) -> dict[str, Registration]:
    """``registry.json`` of the federation folder ``root`` (none yet: empty); ``DamagedFile``
    when it does not read."""
    path = root / REGISTRY_FILE
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
        return {str(name): Registration.from_json(entry) for name, entry in raw.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise DamagedFile(path, err) from None


def registry_bytes(registry: Mapping[str, Registration]) -> bytes:
    """``registry.json`` as ``read_registry`` reads it back."""
    return json.dumps(
        {name: entry.to_json() for name, entry in registry.items()}, indent=2
    ).encode()


def write_registry(root: Path, registry: Mapping[str, Registration]) -> None:
    write_atomic(root / REGISTRY_FILE, registry_bytes(registry))
