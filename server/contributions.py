"""Each site's last contribution per class: what a site's leaving is undone from.

A class's values are the merge of the rows its holders sent in the step that trained it (then
it is frozen). To take one site out of a class (``server.withdrawal``) the server re-merges the
other holders' rows, so it keeps, for every (site, class), the screened rows of that site that
reached the last merge of each phase: its trained fields and its mixtures, each with the count
it was weighted by. A phase's merge of a class *replaces* that class's kept rows of the phase's
fields: the senders' rows in, every other site's rows of those fields out. So what is kept is
exactly what the last committed merge of each class merged, and a phase that a crash made the
server repeat leaves no row of the attempt before.

They are kept as one codebook in the federation's codebook store (``contributions.bin``, a
manifest, ``shared.codebook.store_io``: a save writes only the rows that changed), one entry per
(site, class) under a short key; the manifest's metadata (``CONTRIBUTIONS_KEY``) says whose rows
each key holds, which fields the site sent and the count of each. The tensor fields a site did
not send are stored as zeros (a stored entry holds every tensor field); they are never read.
The cost: about 210 kB per site per class at the paper's dims, 2.1 GB for one holder of each of
10,000 classes (docs/benchmarks.md#withdrawal-benchwithdrawalpy).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import ClientUpdate, Codebook, CodebookError
from starfed.shared.codebook.entry import ClassEntry, Value
from starfed.shared.protocol import Phase

CONTRIBUTIONS_KEY = "starfed.contributions"  # the manifest's metadata: key -> whose rows


def row_key(site: str, name: str) -> str:
    """The stored entry's name of ``site``'s rows of class ``name``: short and printable
    whatever the names (a class name may be as long as a stored name may be)."""
    return "c-" + hashlib.sha256(json.dumps([site, name]).encode()).hexdigest()[:32]


def owners(metadata: Mapping[str, str]) -> list[tuple[str, str]]:
    """(site, class) of every row a stored codebook's table names, without decoding a tensor
    (a manifest's metadata is enough); ``CodebookError`` when the table does not read."""
    try:
        table = json.loads(metadata.get(CONTRIBUTIONS_KEY, "{}"))
        return [(str(line["site"]), str(line["class"])) for line in table.values()]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CodebookError(f"its table of contributions is damaged ({err!r})") from None


@dataclass(frozen=True)
class Rows:
    """One site's kept rows of one class: field -> value, and field -> the count it was
    weighted by."""

    site: str
    name: str
    values: Mapping[str, Value]
    counts: Mapping[str, int]

    def of(self, phase: Phase) -> ClassEntry | None:
        """The entry the site sent in ``phase`` (its fields, its count), None when none."""
        fields = [f for f in schema.trained_in(phase) if f in self.values]
        if not fields:
            return None
        values = {f: self.values[f] for f in fields}
        return ClassEntry(self.name, self.counts[fields[0]], values)


@dataclass(frozen=True)
class Contributions:
    """Every site's kept rows of every class, as stored (``codebook``, None before the first
    save) and as read."""

    rows: Mapping[tuple[str, str], Rows] = field(default_factory=dict)
    codebook: Codebook | None = None  # the stored codebook: a save writes what changed from it

    def merged(
        self, phase: Phase, sites: Iterable[str], updates: Iterable[ClientUpdate]
    ) -> Contributions:
        """With the rows of a phase's merge (``sites[i]`` sent ``updates[i]``): for each class
        merged, the senders' rows of the phase's fields replace every site's."""
        fields = set(schema.trained_in(phase))
        sent: dict[tuple[str, str], ClassEntry] = {}
        for site, update in zip(sites, updates, strict=True):
            for entry in update.entries:
                sent[site, entry.name] = entry
        classes = {name for _, name in sent}
        rows = dict(self.rows)
        for key, kept in self.rows.items():
            if kept.name in classes and key not in sent:
                values = {f: v for f, v in kept.values.items() if f not in fields}
                counts = {f: c for f, c in kept.counts.items() if f not in fields}
                rows[key] = replace(kept, values=values, counts=counts)
        for (site, name), entry in sent.items():
            kept = rows.get((site, name)) or Rows(site, name, {}, {})
            values = {f: v for f, v in kept.values.items() if f not in fields}
            counts = {f: c for f, c in kept.counts.items() if f not in fields}
            values.update({f: v for f, v in entry.values.items() if f in fields})
            counts.update({f: entry.count for f in entry.values if f in fields})
            rows[site, name] = Rows(site, name, values, counts)
        return replace(self, rows={k: r for k, r in rows.items() if r.values})

    def without(self, site: str | None = None, classes: Iterable[str] = ()) -> Contributions:
        """Without ``site``'s rows and without every row of ``classes``."""
        gone = set(classes)
        rows = {k: r for k, r in self.rows.items() if r.site != site and r.name not in gone}
        return replace(self, rows=rows)

    def holders(self, name: str) -> list[str]:
        """The sites with rows of class ``name``, in name order (the merge's order)."""
        return sorted(r.site for r in self.rows.values() if r.name == name)

    def sites(self) -> set[str]:
        return {r.site for r in self.rows.values()}

    def updates(self, phase: Phase, names: Iterable[str], like: Codebook) -> list[ClientUpdate]:
        """The kept rows of ``names`` for ``phase`` as the updates the merge had, one per site,
        in the order of site names (as the coordinator hands them to the strategy)."""
        wanted = set(names)
        by_site: dict[str, list[ClassEntry]] = {}
        for (site, name), rows in sorted(self.rows.items()):
            entry = rows.of(phase) if name in wanted else None
            if entry is not None:
                by_site.setdefault(site, []).append(entry)
        return [
            ClientUpdate(like.fingerprint, like.dims, phase, like.version, tuple(entries))
            for _, entries in sorted(by_site.items())
        ]

    # --- stored form ---------------------------------------------------------------------

    def as_codebook(self, like: Codebook) -> Codebook:
        """The codebook that stores them: the entries of rows that did not change since the
        last save are that save's own (a save writes by identity, ``store_io._changes``)."""
        before = self.codebook.entries if self.codebook is not None else {}
        table: dict[str, dict] = {}
        entries: dict[str, ClassEntry] = {}
        zeros = _Zeros(like)
        for (site, name), rows in sorted(self.rows.items()):
            key = row_key(site, name)
            table[key] = {"site": site, "class": name, "counts": dict(rows.counts)}
            old = before.get(key)
            values = {
                f: rows.values.get(f, zeros(f) if old is None else old.values[f])
                for f in schema.TENSORS
            }
            values.update({f: rows.values[f] for f in schema.MIXTURES if f in rows.values})
            if old is not None and _same(old.values, values):
                entries[key] = old
            else:
                entries[key] = ClassEntry(key, max(rows.counts.values()), values)
        metadata = {CONTRIBUTIONS_KEY: json.dumps(table, separators=(",", ":"))}
        return Codebook(like.fingerprint, like.dims, entries, like.version, metadata)

    @classmethod
    def from_codebook(cls, codebook: Codebook) -> Contributions:
        """The rows a stored codebook holds; ``CodebookError`` when its table does not read."""
        try:
            table = json.loads(codebook.metadata.get(CONTRIBUTIONS_KEY, "{}"))
            rows = {}
            for key, line in table.items():
                entry = codebook[key]
                counts = {str(f): int(c) for f, c in line["counts"].items()}
                values = {f: entry.values[f] for f in counts}
                rows[str(line["site"]), str(line["class"])] = Rows(
                    str(line["site"]), str(line["class"]), values, counts
                )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CodebookError(f"its table of contributions is damaged ({err!r})") from None
        return cls(rows, codebook)


def _same(old: Mapping[str, Value], new: Mapping[str, Value]) -> bool:
    return old.keys() == new.keys() and all(old[f] is new[f] for f in new)


class _Zeros:
    """One zero row per tensor field, shared by every entry that did not send the field."""

    def __init__(self, like: Codebook) -> None:
        self.dims = like.dims
        self.made: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> Value:
        if name not in self.made:
            self.made[name] = torch.zeros(schema.BY_NAME[name].shape(self.dims))
        return self.made[name]
