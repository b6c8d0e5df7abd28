"""One reply, bounded before it is parsed: a valid protobuf update of millions of empty parts.

A registered site's reply of 30 M empty entries (57 MiB, under the message limit) took the
ServerApp from 1.1 to 5.7 GB before it was rejected: protobuf makes an object of every entry.
The update's parts are now counted in its bytes first (``wire.check_parts``). Each case runs in
a fresh interpreter, whose peak resident memory is the measure (protobuf's objects live outside
Python's allocator).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import ClientUpdate, CodebookError
from starfed.shared.protocol import Phase

pytestmark = pytest.mark.adversarial

PARTS = 3_000_000  # 6 MB of two-byte parts: ≈ 460 MB once parsed
#: The peak's growth over the interpreter's, at most this multiple of the reply's bytes.
MEMORY_MULTIPLE = 4

PROBE = """
import json, resource, sys
from starfed.shared.codebook import wire
from starfed.shared.codebook.codebook import CodebookError
from starfed.shared.protocol import Phase
from conftest import random_codebook
from starfed.shared.codebook.codebook import ClientUpdate
codebook = random_codebook(n_classes=2)
good = wire.encode(ClientUpdate(codebook.fingerprint, codebook.dims, Phase.STAGE1, 2, ()))
parts = {"entries": b"\\x32\\x00", "metadata": b"\\x3a\\x00", "unknown": b"\\xf8\\x01\\x00"}
for kind, part in parts.items():  # peak memory only grows: each is measured from the start
    data = good + part * int(sys.argv[1])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        wire.decode_update(data, against=codebook, phase=Phase.STAGE1, max_entries=2)
        error = None
    except CodebookError as err:
        error = str(err)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"kind": kind, "bytes": len(data), "grew": (after - before) * 1024,
                      "error": error}))
    del data
"""


def test_a_reply_of_millions_of_empty_parts_is_rejected_before_it_is_parsed(
    request: pytest.FixtureRequest,
) -> None:
    """Empty entries, empty metadata pairs and unknown fields, 3 M of each, in one interpreter
    (each starts one: torch's import alone is most of the test's time)."""
    tests = str(request.path.parent)
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(PARTS)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.getenv("PYTHONPATH", "")])},
    )
    probes = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert [probe["kind"] for probe in probes] == ["entries", "metadata", "unknown"]
    for probe in probes:
        assert probe["error"], probe
        assert probe["grew"] <= MEMORY_MULTIPLE * probe["bytes"], probe


def test_entries_beyond_what_the_site_reported_are_named(make_codebook) -> None:
    codebook = make_codebook(n_classes=3)
    update = ClientUpdate(codebook.fingerprint, codebook.dims, Phase.STAGE1, 2, ())
    data = wire.encode(update) + b"\x32\x00" * 3
    with pytest.raises(CodebookError, match="carries 3 entries, at most 2"):
        wire.decode_update(data, against=codebook, phase=Phase.STAGE1, max_entries=2)
