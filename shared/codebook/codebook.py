"""The codebook — the ordered class entries plus what they are only valid with — and an update.

A ``Codebook`` is the unit every part of starfed exchanges: server broadcasts, checkpoints and
exports. It is a value: the functions that evolve it (registration, merging, replay, freezing)
return a new codebook and share the unchanged entries' tensors, which nobody modifies in place.
A ``ClientUpdate`` is what one site returns for one phase: entries restricted to the fields the
phase trains (``schema.trained_in``), or for sync, names and counts only.

Bytes and files go through ``starfed.shared.codebook.wire``, where decoding validates; a value
built in memory by this code is trusted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from starfed.shared.codebook import schema
from starfed.shared.codebook.entry import ClassBank, ClassEntry, Value
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.protocol import Phase


class CodebookError(ValueError):
    """Invalid codebook data; the message says what and where, on one line."""


class _Serialised:
    """Bytes and file conversions, implemented once in ``wire`` for both message kinds."""

    def to_bytes(self, dtype: str = "float32") -> bytes:
        """Deterministic serialisation (same value, same bytes); tensors in ``dtype``."""
        from starfed.shared.codebook import wire  # wire imports this module

        return wire.encode(self, dtype)

    def save(self, path: str | os.PathLike[str], dtype: str = "float32") -> None:
        """Write atomically with a checksum (``wire`` documents the file layout)."""
        from starfed.shared.codebook import wire

        wire.write_file(path, self, dtype)


@dataclass(eq=False)
class Codebook(_Serialised):
    """Class entries in class-index order, keyed by name, for one backbone pair."""

    fingerprint: str
    dims: ModelDims
    entries: dict[str, ClassEntry] = field(default_factory=dict)
    version: int = 0  # +1 for every change
    metadata: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, name: str) -> ClassEntry:
        return self.entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    @property
    def frozen(self) -> set[str]:
        return {name for name, entry in self.entries.items() if entry.frozen}

    def bank(self, names: Iterable[str] | None = None) -> ClassBank:
        """The entries of ``names`` (default all, in order) stacked for a model to compute with."""
        chosen = self.entries.values() if names is None else (self.entries[n] for n in names)
        return ClassBank.from_entries(self.dims, chosen)

    def evolve(self, entries: Iterable[ClassEntry], **changes) -> Codebook:
        """A new codebook one version later with ``entries`` replacing or appending by name."""
        merged = dict(self.entries)
        for entry in entries:
            merged[entry.name] = entry
        return replace(self, entries=merged, version=self.version + 1, **changes)

    def set_values(
        self,
        values: Mapping[str, Mapping[str, Value]],
        counts: Mapping[str, int] | None = None,
        freeze: Iterable[str] = (),
    ) -> Codebook:
        """One version later, with new values (and counts) for some classes and the classes
        ``freeze`` frozen; see ``evolve``."""
        version = self.version + 1
        counts, freeze = counts or {}, set(freeze)
        changed = [
            replace(
                self.entries[name],
                values={**self.entries[name].values, **values.get(name, {})},
                count=counts.get(name, self.entries[name].count),
                version=version,
                frozen=self.entries[name].frozen or name in freeze,
            )
            for name in {**values, **dict.fromkeys(freeze)}
        ]
        return self.evolve(changed)

    def without(self, names: Iterable[str]) -> Codebook:
        """One version later, without the classes ``names``."""
        gone = set(names)
        kept = {n: e for n, e in self.entries.items() if n not in gone}
        return replace(self, entries=kept, version=self.version + 1)

    def without_mixtures(self) -> Codebook:
        """The broadcast form: only the fields sites read (``schema.BROADCAST``), same version.

        Mixtures are the server's replay memory and most of a codebook's bytes.
        """
        entries = {
            name: replace(e, values={f: v for f, v in e.values.items() if f in schema.BROADCAST})
            for name, e in self.entries.items()
        }
        return replace(self, entries=entries)

    @classmethod
    def from_bytes(
        cls, data: bytes, *, fingerprint: str | None = None, dims: ModelDims | None = None
    ) -> Codebook:
        """Decode and validate; ``fingerprint``/``dims`` are the receiver's, when it has them."""
        from starfed.shared.codebook import wire

        return wire.decode_codebook(data, fingerprint=fingerprint, dims=dims)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        fingerprint: str | None = None,
        dims: ModelDims | None = None,
    ) -> Codebook:
        """Read, verify the checksum, decode and validate (``OSError`` if unreadable)."""
        from starfed.shared.codebook import wire

        return wire.decode_codebook(
            wire.read_payload(path, wire.CODEBOOK_MAGIC), fingerprint=fingerprint, dims=dims
        )


@dataclass(eq=False)
class ClientUpdate(_Serialised):
    """What one site returns for one phase, answering codebook version ``base_version``.

    For sync, ``entries`` are the classes of the site's current task (names and counts) and
    ``class_order`` gives each one's position in the site's class order, which fixes the order
    in which the server registers new classes.
    """

    fingerprint: str
    dims: ModelDims
    phase: Phase
    base_version: int
    entries: list[ClassEntry] = field(default_factory=list)
    class_order: list[int] = field(default_factory=list)  # sync only
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_bytes(cls, data: bytes, *, against: Codebook, phase: Phase) -> ClientUpdate:
        """Decode and validate against the codebook the phase was sent with (see ``wire``)."""
        from starfed.shared.codebook import wire

        return wire.decode_update(data, against=against, phase=phase)
