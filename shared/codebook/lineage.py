"""Which federation a codebook belongs to, and which version line of it: its lineage.

A codebook's version counts changes, but a version number alone does not say whose codebook it
is: two federations both reach version 12, and a federation rolled back to a step's start
(docs/federation.md) counts up again from an older version. The lineage — the federation's id
and an *epoch*, a fresh random id whenever the server starts a new version line — names the line,
so a site or an inference device applies a delta only to a codebook of the same line. It travels
in the codebook's metadata under the two keys below, the only spellings of them anywhere.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starfed.shared.codebook.codebook import Codebook, Delta

FEDERATION_KEY = "federation"  # codebook metadata: the federation's id
EPOCH_KEY = "epoch"  # codebook metadata: the version line (a rollback starts a new one)


@dataclass(frozen=True)
class Lineage:
    """A federation's id and the epoch of its version line ("" where a codebook has none)."""

    federation: str = ""
    epoch: str = ""

    @classmethod
    def of(cls, codebook: Codebook | Delta | None) -> Lineage:
        """The lineage a codebook (or a delta) carries (empty for none, or for one without)."""
        return cls() if codebook is None else cls.in_metadata(codebook.metadata)

    @classmethod
    def in_metadata(cls, metadata: Mapping[str, str]) -> Lineage:
        """The lineage these metadata carry (empty where they carry none)."""
        return cls(metadata.get(FEDERATION_KEY, ""), metadata.get(EPOCH_KEY, ""))

    def new_epoch(self) -> Lineage:
        """The same federation on a new version line."""
        return Lineage(self.federation, uuid.uuid4().hex)

    def as_metadata(self) -> dict[str, str]:
        """The metadata entries that carry it."""
        return {FEDERATION_KEY: self.federation, EPOCH_KEY: self.epoch}
