"""The codebook — the ordered class entries plus what they are only valid with — and an update.

A ``Codebook`` is the unit every part of starfed exchanges: server broadcasts, checkpoints and
exports. It is an immutable value: the functions that evolve it (registration, merging, replay,
freezing) return a new codebook and share the unchanged entries' tensors, which nobody modifies
in place. A ``Delta`` is what changed between two versions, which is all a receiver that holds
the last codebook needs (``starfed.shared.codebook.held``). A ``ClientUpdate`` is what one site
returns for one phase: entries restricted to the fields the phase trains
(``schema.trained_in``), or for sync, names and counts only.

These are values only; bytes and files are ``starfed.shared.codebook.wire``'s, where decoding
validates. A value built in memory by this code is trusted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from starfed.shared.codebook import schema
from starfed.shared.codebook.entry import ClassBank, ClassEntry, Value
from starfed.shared.codebook.framing import CodebookError as CodebookError  # re-exported
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.protocol import Phase


def _read_only(value: object, name: str, mapping: Mapping[str, object]) -> None:
    """Store a private copy of ``mapping`` that cannot be changed through the value."""
    object.__setattr__(value, name, MappingProxyType(dict(mapping)))


@dataclass(frozen=True, eq=False)
class Codebook:
    """Class entries in class-index order, keyed by name, for one backbone pair."""

    fingerprint: str
    dims: ModelDims
    entries: Mapping[str, ClassEntry] = field(default_factory=dict)
    version: int = 0  # +1 for every change
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _read_only(self, "entries", self.entries)
        _read_only(self, "metadata", self.metadata)

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

    # --- evolution: each returns a new codebook one version later; entries it does not
    # change are shared, and the changed entries and fields carry the new version.

    def register(self, entries: Iterable[ClassEntry]) -> Codebook:
        """New classes appended (names must be new)."""
        version = self.version + 1
        added = {}
        for entry in entries:
            if entry.name in self.entries or entry.name in added:
                raise ValueError(f"class {entry.name!r} is already registered")
            stamps = dict.fromkeys(entry.values, version)
            added[entry.name] = replace(entry, version=version, field_versions=stamps)
        return replace(self, entries={**self.entries, **added}, version=version)

    def set_values(
        self,
        values: Mapping[str, Mapping[str, Value]],
        counts: Mapping[str, int] | None = None,
        freeze: Iterable[str] = (),
    ) -> Codebook:
        """New values (and counts) for some classes, and the classes ``freeze`` frozen."""
        version = self.version + 1
        counts, freeze = counts or {}, set(freeze)
        entries = dict(self.entries)
        for name in {**values, **dict.fromkeys(freeze)}:
            old, new = self.entries[name], values.get(name, {})
            entries[name] = replace(
                old,
                values={**old.values, **new},
                count=counts.get(name, old.count),
                version=version,
                frozen=old.frozen or name in freeze,
                field_versions={**old.field_versions, **dict.fromkeys(new, version)},
            )
        return replace(self, entries=entries, version=version)

    def without(self, names: Iterable[str]) -> Codebook:
        """Without the classes ``names``."""
        gone = set(names)
        kept = {n: e for n, e in self.entries.items() if n not in gone}
        return replace(self, entries=kept, version=self.version + 1)

    # --- what sites receive

    def broadcast(self) -> Codebook:
        """The form sites receive: only the fields they read (``schema.BROADCAST``), no server
        bookkeeping; same version. Mixtures are the server's replay memory and most of a
        codebook's bytes."""
        entries = {
            name: replace(
                e,
                values={f: v for f, v in e.values.items() if f in schema.BROADCAST},
                field_versions={},
            )
            for name, e in self.entries.items()
        }
        return replace(self, entries=entries)

    def delta(self, since: int) -> Delta:
        """What changed since version ``since``, in broadcast form (see ``Delta``)."""
        if not 0 < since <= self.version:
            raise ValueError(f"no delta from version {since} to {self.version}")
        changed = {}
        for name, entry in self.broadcast().entries.items():
            stamps = self.entries[name].field_versions
            if entry.version > since:
                fields = {f: v for f, v in entry.values.items() if stamps.get(f, 0) > since}
                changed[name] = replace(entry, values=fields)
        return Delta(
            self.fingerprint,
            self.dims,
            self.version,
            since,
            tuple(self.names),
            changed,
            self.metadata,
        )

    def apply(self, delta: Delta) -> Codebook:
        """The codebook ``delta`` leads to from this one (a site's held codebook).

        Raises CodebookError if the delta starts from another version or backbone, or leaves a
        class without a value it must have.
        """
        if delta.base_version != self.version or delta.fingerprint != self.fingerprint:
            raise CodebookError(
                f"a delta from version {delta.base_version} cannot apply to version "
                f"{self.version} of this codebook"
            )
        entries = {}
        for name in delta.names:
            old, new = self.entries.get(name), delta.entries.get(name)
            if new is None:
                if old is None:
                    raise CodebookError(f"the delta names class {name!r} but carries no values")
                entries[name] = old
                continue
            values = {**(old.values if old else {}), **new.values}
            missing = [f for f in schema.BROADCAST if f not in values]
            if missing:
                raise CodebookError(f"class {name!r} lacks {missing[0]} after the delta")
            entries[name] = replace(new, values=values)
        return Codebook(self.fingerprint, self.dims, entries, delta.version, delta.metadata)


@dataclass(frozen=True, eq=False)
class Delta:
    """The changes from codebook version ``base_version`` to ``version``: the entries that
    changed, each with only the fields that changed, and every class name in the new order.
    A receiver that holds version ``base_version`` rebuilds the new codebook with
    ``Codebook.apply``; the server sends one to every site whose held version it knows."""

    fingerprint: str
    dims: ModelDims
    version: int
    base_version: int
    names: tuple[str, ...]
    entries: Mapping[str, ClassEntry] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(self.names))
        _read_only(self, "entries", self.entries)
        _read_only(self, "metadata", self.metadata)


@dataclass(frozen=True, eq=False)
class ClientUpdate:
    """What one site returns for one phase, answering codebook version ``base_version``.

    For sync, ``entries`` are the classes of the site's current task (names and counts) and
    ``base_version`` is the version of the codebook the site holds (0: none).
    """

    fingerprint: str
    dims: ModelDims
    phase: Phase
    base_version: int
    entries: tuple[ClassEntry, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        _read_only(self, "metadata", self.metadata)

    def only(self, names: Collection[str]) -> ClientUpdate:
        """The same update without the rows of classes outside ``names``."""
        return replace(self, entries=tuple(e for e in self.entries if e.name in names))
