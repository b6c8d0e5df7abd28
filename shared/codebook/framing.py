"""Codebook files as frames, and the one error type of bad codebook data — no torch.

A file is ``magic (8 bytes) | payload length (u64 LE) | sha256(payload) (32 bytes) | payload``,
written atomically, so a crash leaves either the old file or the new one. Checking the frame
(kind, size before reading, checksum) needs no tensors, so views that only want a codebook's
version, metadata and class names (``starfed server status``, an interrupted run's marker) read
the protobuf message here and never import torch; decoding the tensors is ``wire``'s.

A file has no size limit: a federation's codebook grows with its classes for years (1,000
classes at the paper's dims are about 200 MB), and the disk, not a constant, bounds it. What
bounds reading is the file itself: the header's length is checked against the file's size
before anything is read, so a damaged header never makes a reader allocate what is not there.
Messages on the wire keep their limit (``DEFAULT_MAX_BYTES``, ``wire.parse``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from starfed.proto import codebook_pb2 as pb

DEFAULT_MAX_BYTES = 64 * 2**20  # the default limit of a message on the wire, not of a file
CODEBOOK_MAGIC = b"SFCODEBK"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload
HEADER_SIZE = _HEADER.size
_CHUNK = 8 * 2**20  # bytes hashed at a time by verify_file


class CodebookError(ValueError):
    """Invalid codebook data; the message says what and where, on one line."""


def frame(payload: bytes) -> bytes:
    """Header (magic, length, sha256) + ``payload``: a codebook file's bytes."""
    return header(len(payload), hashlib.sha256(payload).digest()) + payload


def header(length: int, digest: bytes) -> bytes:
    """The header of a file whose payload of ``length`` bytes has the sha256 ``digest`` (for a
    payload written in pieces, ``parts``)."""
    return _HEADER.pack(CODEBOOK_MAGIC, length, digest)


def read_payload(path: str | os.PathLike[str], max_bytes: int | None = None) -> bytes:
    """The checksum-verified message bytes of a codebook file.

    Raises ``CodebookError`` for another kind of file, a truncated or corrupted one, or (only
    when a caller sets ``max_bytes``) one over it; ``OSError`` when it cannot be read at all.
    """
    with open(path, "rb") as file:
        length, digest = _header(file, path, max_bytes)
        payload = file.read(length)
    if len(payload) != length:
        raise CodebookError(f"{path}: header announces {length} bytes, file holds {len(payload)}")
    if hashlib.sha256(payload).digest() != digest:
        raise CodebookError(f"{path}: checksum mismatch (file corrupted)")
    return payload


@contextlib.contextmanager
def payload_checked_alongside(
    path: str | os.PathLike[str], max_bytes: int | None = None
) -> Iterator[bytes]:
    """``read_payload``, its checksum computed in a thread while the block decodes the payload
    (hashlib hashes without the GIL: a 10,000-class export's 0.9 GB cost 0.5 s more in turn).
    The block ends only once the checksum holds; when it does not, its error is the block's,
    whatever the block raised on the damaged bytes (decoding validates whatever it reads)."""
    with open(path, "rb") as file:
        length, digest = _header(file, path, max_bytes)
        payload = file.read(length)
    if len(payload) != length:
        raise CodebookError(f"{path}: header announces {length} bytes, file holds {len(payload)}")
    with ThreadPoolExecutor(max_workers=1) as pool:
        hashed = pool.submit(lambda: hashlib.sha256(payload).digest())
        try:
            yield payload
        except Exception:
            if hashed.result() != digest:
                raise CodebookError(f"{path}: checksum mismatch (file corrupted)") from None
            raise
        if hashed.result() != digest:
            raise CodebookError(f"{path}: checksum mismatch (file corrupted)")


def verify_file(path: str | os.PathLike[str], name: str | None = None) -> int:
    """Check a codebook file's frame and checksum as ``read_payload`` does (same errors), its
    bytes streamed through sha256 a chunk at a time: memory stays at one chunk however large
    the file (a 10,000-class base is 2 GB). The payload's length; it starts at ``HEADER_SIZE``.
    ``name``: the file in errors (default: its path).

    sha256 rather than a faster hash: it is the frame's own checksum (every file ever written
    carries it), and with the SHA extensions of current CPUs hashlib's sha256 runs at about
    2 GB/s, twice blake2b (docs/benchmarks.md, issue 34)."""
    name = str(path) if name is None else name
    with open(path, "rb") as file:
        length, digest = _header(file, name, None)
        hasher, chunk, left = hashlib.sha256(), bytearray(_CHUNK), length
        view = memoryview(chunk)
        while left:
            got = file.readinto(view[: min(left, _CHUNK)])
            if not got:
                raise CodebookError(
                    f"{name}: header announces {length} bytes, file holds {length - left}"
                )
            hasher.update(view[:got])
            left -= got
    if hasher.digest() != digest:
        raise CodebookError(f"{name}: checksum mismatch (file corrupted)")
    return length


def _header(file: BinaryIO, path: object, max_bytes: int | None) -> tuple[int, bytes]:
    """The payload length and digest of the frame ``file`` starts with, checked against the
    file's size before anything else is read (the header may be the damaged part)."""
    header = file.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise CodebookError(f"{path}: too short to be a starfed codebook file")
    found, length, digest = _HEADER.unpack(header)
    if found != CODEBOOK_MAGIC:
        raise CodebookError(f"{path}: not a starfed codebook file")
    if max_bytes is not None and length > max_bytes:
        raise CodebookError(f"{path}: payload of {length} bytes exceeds the limit {max_bytes}")
    size = os.fstat(file.fileno()).st_size - _HEADER.size
    if length != size:
        raise CodebookError(f"{path}: header announces {length} bytes, file holds {size}")
    return length, digest


def unframe(data: bytes, what: str) -> bytes:
    """The checksum-verified payload of one frame held in ``data`` (a record of an append-only
    log, ``store_layout``); ``what`` names it in the error."""
    if len(data) < _HEADER.size:
        raise CodebookError(f"{what}: too short to be a starfed codebook file")
    found, length, digest = _HEADER.unpack_from(data)
    if found != CODEBOOK_MAGIC:
        raise CodebookError(f"{what}: not a starfed codebook file")
    if length != len(data) - _HEADER.size:
        raise CodebookError(
            f"{what}: header announces {length} bytes, file holds {len(data) - _HEADER.size}"
        )
    payload = data[_HEADER.size :]
    if hashlib.sha256(payload).digest() != digest:
        raise CodebookError(f"{what}: checksum mismatch (file corrupted)")
    return bytes(payload)


def read_message(path: str | os.PathLike[str]) -> pb.Codebook:
    """A codebook file's message, tensors left as bytes: its version, fingerprint, metadata and
    entry names without decoding (nothing here is validated beyond the frame)."""
    try:
        return pb.Codebook.FromString(read_payload(path))
    except ValueError as err:  # protobuf's DecodeError
        if isinstance(err, CodebookError):
            raise
        raise CodebookError(f"{path}: not a codebook message ({err})") from None
