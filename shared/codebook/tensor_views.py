"""Where a received message's tensor bytes are, found in its bytes: views, not copies.

protobuf's Python API hands out a copy of every bytes field it is asked for; an update's tensors
are most of its bytes, and the server only reads them once (to validate and add them). This
module finds each tensor's ``data`` inside the received bytes instead, walking the wire format
(``protowalk``: varint tags, length-delimited fields), so the arrays can be views of them. It
runs only on a message protobuf has already parsed, and agrees with it or rejects it — except
``check_parts``, which counts an update's parts before protobuf makes an object of any.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import numpy as np
import torch

from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import protowalk, schema
from starfed.shared.codebook.framing import CodebookError
from starfed.shared.codebook.protowalk import LENGTH_DELIMITED

#: What a walk that fails says (the message is a ``ClientUpdate``, or a stored codebook).
INVALID = "not a valid ClientUpdate message"
UPDATE_ENTRIES = pb.ClientUpdate.DESCRIPTOR.fields_by_name["entries"].number
CODEBOOK_ENTRIES = pb.Codebook.DESCRIPTOR.fields_by_name["entries"].number
_UPDATE_METADATA = pb.ClientUpdate.DESCRIPTOR.fields_by_name["metadata"].number
_TENSOR_SHAPE = pb.Tensor.DESCRIPTOR.fields_by_name["shape"].number
#: What one update may hold besides its entries, before protobuf makes an object of each part:
#: metadata pairs, fields of an entry (its tensors, mixtures and field versions, one each per
#: schema field), fields of a tensor or mixture, and the bytes of a tensor's packed shape (a
#: handful of dimensions of up to 10 bytes each).
MAX_METADATA = 256
MAX_ENTRY_FIELDS = 4 * len(schema.FIELDS) + 8
MAX_PART_FIELDS = 16
MAX_SHAPE_BYTES = 80
_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_TENSOR_FIELDS = {
    pb.ClassEntry.DESCRIPTOR.fields_by_name[name].number: name for name in schema.TENSORS
}
_MIXTURE_FIELDS = {
    pb.ClassEntry.DESCRIPTOR.fields_by_name[name].number: name for name in schema.MIXTURES
}
_MIXTURE_PARTS = {
    field.number: field.name for field in pb.Mixture.DESCRIPTOR.fields if field.name != "count"
}
#: One entry's tensor bytes in a received message: a tensor field's view, or a mixture field's
#: views by part.
EntryViews = dict[str, "memoryview | dict[str, memoryview]"]


def _fields(
    data: bytes, start: int, end: int, limit: int | None = None, what: str = "one message"
) -> list[tuple[int, int, int]]:
    """(field number, start, end) of every length-delimited field in ``data[start:end]``; with
    ``limit``, ``CodebookError`` as soon as there are more fields than that (of any type)."""
    walk = protowalk.fields(data, start, end, INVALID)
    found = list(walk if limit is None else itertools.islice(walk, limit + 1))
    if limit is not None and len(found) > limit:  # the walk stops there: the rest is unread
        raise CodebookError(f"more than {limit} fields in {what}")
    return [(n, value, stop) for n, kind, value, stop in found if kind == LENGTH_DELIMITED]


def _data_view(data: bytes, whole: memoryview, start: int, end: int, what: str) -> memoryview:
    """The ``data`` bytes of the Tensor message in ``data[start:end]``, as a view."""
    spans = [(s, e) for n, s, e in _fields(data, start, end) if n == _TENSOR_DATA]
    if len(spans) > 1:
        raise CodebookError(f"{what} appears twice in an entry")
    return whole[spans[0][0] : spans[0][1]] if spans else whole[0:0]


def check_parts(data: bytes, max_entries: int) -> None:
    """Count an update's parts in its bytes before protobuf materialises any: at most
    ``max_entries`` entries (what its site can have: e.g. the classes it reported at the sync)
    and the bounds above on everything inside them, so that decoding a reply costs memory in
    proportion to its tensors' bytes, not to the number of (empty) parts it packs."""
    what = f"the update (at most {max_entries} entries: the classes its site can send)"
    top = _fields(data, 0, len(data), limit=max_entries + MAX_METADATA + 16, what=what)
    entries = [(s, e) for n, s, e in top if n == UPDATE_ENTRIES]
    if len(entries) > max_entries:
        raise CodebookError(
            f"the update carries {len(entries)} entries, at most "
            f"{max_entries} (the classes its site can send)"
        )
    if sum(n == _UPDATE_METADATA for n, _, _ in top) > MAX_METADATA:
        raise CodebookError(f"the update carries over {MAX_METADATA} metadata pairs")
    for start, end in entries:
        for field, f_start, f_end in _fields(data, start, end, limit=MAX_ENTRY_FIELDS):
            if field in _TENSOR_FIELDS:
                _check_tensor(data, f_start, f_end)
            elif field in _MIXTURE_FIELDS:
                for n, s, e in _fields(data, f_start, f_end, limit=MAX_PART_FIELDS):
                    if n in _MIXTURE_PARTS:
                        _check_tensor(data, s, e)


def _check_tensor(data: bytes, start: int, end: int) -> None:
    for number, s, e in _fields(data, start, end, limit=MAX_PART_FIELDS):
        if number == _TENSOR_SHAPE and e - s > MAX_SHAPE_BYTES:
            raise CodebookError(f"a tensor shape of {e - s} bytes (at most {MAX_SHAPE_BYTES})")


def tensor_views(data: bytes, entries_field: int = UPDATE_ENTRIES) -> list[EntryViews]:
    """Per entry of a parsed ``ClientUpdate`` (or ``Codebook``: its ``entries_field``), the
    ``data`` bytes of its tensors as views of ``data``: by field name, a tensor's view, or a
    mixture's views by part (``means``, ...). A field or part that appears twice (protobuf
    would merge the two) is rejected: no encoder of this schema writes one."""
    whole = memoryview(data)
    entries = []
    for number, start, end in _fields(data, 0, len(data)):
        if number != entries_field:
            continue
        views: EntryViews = {}
        for field, f_start, f_end in _fields(data, start, end):
            if field in _TENSOR_FIELDS:
                name = _TENSOR_FIELDS[field]
                view: memoryview | dict[str, memoryview] = _data_view(
                    data, whole, f_start, f_end, name
                )
            elif field in _MIXTURE_FIELDS:
                name, view = _MIXTURE_FIELDS[field], {}
                for n, s, e in _fields(data, f_start, f_end):
                    if n in _MIXTURE_PARTS:
                        part = _MIXTURE_PARTS[n]
                        if part in view:
                            raise CodebookError(f"{name}.{part} appears twice in an entry")
                        view[part] = _data_view(data, whole, s, e, f"{name}.{part}")
            else:
                continue
            if name in views:
                raise CodebookError(f"{name} appears twice in an entry")
            views[name] = view
        entries.append(views)
    return entries


@functools.cache
def quiet_read_only_views() -> None:
    """An update's tensors are views of the received bytes, which are read-only; torch warns
    once per process when it wraps one (it cannot mark a tensor read-only). Nothing writes to
    an update's values, so that one warning is spent here, silenced, rather than in a log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(np.frombuffer(b"\0\0\0\0", dtype=np.float32))
