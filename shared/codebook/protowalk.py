"""Walking protobuf bytes field by field, without parsing them into objects — no torch.

A 10,000-class codebook is about 2 GB of protobuf: parsing it makes an object of every tensor
and copies every byte. What ``starfed server check`` wants of a store's base (its classes'
names, counts, versions, flags: ``store_layout.scan``) is a walk over the field headers
(varint tags, lengths), skipping the tensor bytes; so is finding a received message's tensors
in its bytes (``tensor_views``). The walk follows the wire format strictly: a field that
runs past its message's end, or a wire type no encoder of this schema writes, is
``CodebookError``.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

from starfed.shared.codebook.framing import CodebookError

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
#: What a walk reads: a message's bytes, or a memory map of a file holding them.
Data = bytes | bytearray | memoryview | mmap.mmap
_FIXED = {FIXED64: 8, FIXED32: 4}


def varint(data: Data, i: int) -> tuple[int, int]:
    """The varint at ``data[i]`` and the index after it (``IndexError`` past the end)."""
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise CodebookError("a varint longer than 10 bytes")


def fields(data: Data, start: int, end: int, what: str) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value, end) of each field in ``data[start:end]``: a varint's
    value, or a length-delimited field's start (its bytes are ``data[value:end]``); fixed-width
    fields give their start too. ``what`` names the message in errors."""
    i = start
    try:
        while i < end:
            tag, i = (data[i], i + 1) if data[i] < 0x80 else varint(data, i)
            kind = tag & 7
            if kind == VARINT:
                value, i = (data[i], i + 1) if data[i] < 0x80 else varint(data, i)
                yield tag >> 3, kind, value, i
            elif kind == LENGTH_DELIMITED:
                length, i = (data[i], i + 1) if data[i] < 0x80 else varint(data, i)
                if i + length > end:
                    raise CodebookError(f"{what}: a field runs past its end")
                yield tag >> 3, kind, i, i + length
                i += length
            elif kind in _FIXED:
                yield tag >> 3, kind, i, i + _FIXED[kind]
                i += _FIXED[kind]
            else:
                raise CodebookError(f"{what}: unexpected wire type {kind}")
    except IndexError:
        raise CodebookError(f"{what}: truncated") from None
    if i != end:
        raise CodebookError(f"{what}: a field runs past its end")
