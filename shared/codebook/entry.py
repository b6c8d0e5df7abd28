"""A class entry, and the class bank: the same entries stacked by field for computing.

A ``ClassEntry`` is everything learned about one class, keyed by the schema's field names
(``schema.FIELDS``); in a site's update it holds only the fields the phase trains. The model
computes with a ``ClassBank`` instead, where row ``i`` of every column belongs to ``names[i]``
(one matmul over all classes rather than a loop over entries). ``ClassBank.from_entries`` and
``ClassBank.entries`` are the one conversion between the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import torch

from starfed.shared.codebook import schema
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims

Value = torch.Tensor | GaussianMixture


@dataclass(frozen=True, eq=False)  # tensors have no single truth value: compare encodings
class ClassEntry:
    """One class: its values by field name, its example count and the server's bookkeeping.

    A value: ``dataclasses.replace`` makes a changed copy; the mappings are read-only, and the
    tensors are never modified in place (codebooks share them, docs/design.md#the-codebook).
    """

    name: str
    count: int = 0  # training examples behind the values
    values: Mapping[str, Value] = field(default_factory=dict)
    version: int = 0  # codebook version at which the entry last changed (server bookkeeping)
    frozen: bool = False  # the class's task is finished: merges never change it
    field_versions: Mapping[str, int] = field(default_factory=dict)  # version of each value

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        object.__setattr__(self, "field_versions", MappingProxyType(dict(self.field_versions)))

    def tensor(self, field_name: str) -> torch.Tensor:
        """A tensor field's value (``KeyError`` when it is not set)."""
        value = self.values[field_name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self.name}: {field_name} holds a mixture, not a tensor")
        return value

    def mixture(self, field_name: str) -> GaussianMixture:
        """A mixture field's value (``KeyError`` when it is not set)."""
        value = self.values[field_name]
        if not isinstance(value, GaussianMixture):
            raise TypeError(f"{self.name}: {field_name} holds a tensor, not a mixture")
        return value


class ClassBank:
    """Per-class state stacked by field: float32 tensor columns ``[C, *row]`` and mixture lists.

    Rows are appended, never reordered, so a row index is stable for the life of a bank.
    Columns are indexed by field name: ``bank["prompt"]`` is ``[C, d_txt]``,
    ``bank["clip_mixture"]`` a list of ``C`` mixtures (None where not fitted yet).
    """

    def __init__(self, dims: ModelDims) -> None:
        self.dims = dims
        self.names: list[str] = []
        self.counts: list[int] = []
        self._columns: dict[str, torch.Tensor | list[GaussianMixture | None]] = {
            f.name: torch.zeros(0, *f.shape(dims)) if f.kind is schema.Kind.TENSOR else []
            for f in schema.FIELDS
        }

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, field_name: str) -> Any:
        """The column: a tensor, or a list for a mixture field (its ``schema`` kind says which;
        the model indexes both by name)."""
        return self._columns[field_name]

    def _tensor(self, field_name: str) -> torch.Tensor:
        column = self._columns[field_name]
        assert isinstance(column, torch.Tensor), f"{field_name} is not a tensor field"
        return column

    def _mixtures(self, field_name: str) -> list[GaussianMixture | None]:
        column = self._columns[field_name]
        assert isinstance(column, list), f"{field_name} is not a mixture field"
        return column

    def __setitem__(
        self, field_name: str, column: torch.Tensor | list[GaussianMixture | None]
    ) -> None:
        """Replace a whole column (same length; tensors are stored detached, float32)."""
        if len(column) != len(self):
            raise ValueError(f"{field_name}: {len(column)} rows for {len(self)} classes")
        if isinstance(column, torch.Tensor):
            column = column.detach().to(torch.float32)
        self._columns[field_name] = column

    def to(self, device: torch.device) -> ClassBank:
        """The tensor columns moved to ``device`` (in place); mixtures are float64 statistics
        and stay on the CPU."""
        for name in schema.TENSORS:
            self._columns[name] = self._tensor(name).to(device)
        return self

    def set_rows(
        self,
        field_name: str,
        start: int,
        value: torch.Tensor | Sequence[GaussianMixture | None],
    ) -> None:
        """Overwrite rows ``start : start + len(value)`` of one column."""
        column = self._columns[field_name]
        if isinstance(column, torch.Tensor):
            assert isinstance(value, torch.Tensor), f"{field_name} takes tensor rows"
            rows = value.detach().to(device=column.device, dtype=column.dtype)
            column[start : start + value.shape[0]] = rows
        else:
            column[start : start + len(value)] = list(value)

    def append(self, entries: Sequence[ClassEntry]) -> None:
        """Add new classes; every entry must hold every tensor field (mixtures are optional)."""
        names = [e.name for e in entries]
        duplicate = set(names) & set(self.names)
        if duplicate or len(set(names)) != len(names):
            raise ValueError(f"classes already in the bank or repeated: {sorted(duplicate)}")
        for name in schema.TENSORS:
            rows = [row for e in entries if isinstance(row := e.values.get(name), torch.Tensor)]
            if len(rows) != len(entries):
                raise ValueError(f"missing {name} for a new class")
            current = self._tensor(name)
            if rows:
                stacked = torch.stack([row.detach().to(current) for row in rows])
                if stacked.shape[1:] != current.shape[1:]:
                    raise ValueError(
                        f"{name}: row shape {tuple(stacked.shape[1:])}, "
                        f"expected {tuple(current.shape[1:])}"
                    )
                self._columns[name] = torch.cat([current, stacked]) if len(current) else stacked
        for name in schema.MIXTURES:
            self._mixtures(name).extend(
                cast(GaussianMixture | None, e.values.get(name)) for e in entries
            )
        self.names.extend(names)
        self.counts.extend(e.count for e in entries)

    @classmethod
    def from_entries(cls, dims: ModelDims, entries: Iterable[ClassEntry]) -> ClassBank:
        """Stack entries (copies: training the bank never changes the entries)."""
        bank = cls(dims)
        bank.append(list(entries))
        return bank

    def entries(
        self, names: Iterable[str] | None = None, fields: Iterable[str] | None = None
    ) -> list[ClassEntry]:
        """Entries of ``names`` (default all) holding ``fields`` (default all that are set).

        The rows of each tensor column are gathered to the CPU in one copy and the entries hold
        views of it: later training does not change them, they can be encoded wherever the bank
        computed, and no class costs a copy of its own.
        """
        row = {name: i for i, name in enumerate(self.names)}
        rows = [row[name] for name in (self.names if names is None else names)]
        index = torch.tensor(rows, dtype=torch.long)
        columns: dict[str, torch.Tensor | list[GaussianMixture | None]] = {}
        for name in schema.BY_NAME if fields is None else fields:
            column = self._columns[name]
            if isinstance(column, torch.Tensor):
                columns[name] = column.detach()[index.to(column.device)].to("cpu")
            else:
                columns[name] = [column[i] for i in rows]
        return [
            ClassEntry(
                self.names[i],
                self.counts[i],
                {f: value for f, column in columns.items() if (value := column[k]) is not None},
            )
            for k, i in enumerate(rows)
        ]
