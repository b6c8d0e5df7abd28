"""The glossary enforced (docs/design.md#glossary): words starfed retired appear in no code.

A retired run-config key is spelled in one place, its alias table (``shared/retired_names.py``),
which reads it under its new name; tests of that alias say it too (they are not scanned). A
retired word for a concept (``enrol``: a site's sync) is spelled nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path

from starfed.shared import retired_names

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("cli", "client", "server", "shared", "simulations", "ops", "host", "proto", "bench")
ALIAS_TABLE = "shared/retired_names.py"
#: Retired words: the pattern, and what is said instead.
RETIRED = {
    r"\benrol": "sync (a site says what it brings at the step's sync)",
    **{rf"\b{re.escape(old)}\b": new for old, new in retired_names.RUN_CONFIG.items()},
}


def _code() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    }


def test_no_retired_word_in_code() -> None:
    found = [
        f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group()!r} (say {new})"
        for name, text in _code().items()
        if name != ALIAS_TABLE
        for pattern, new in RETIRED.items()
        for match in re.finditer(pattern, text, re.IGNORECASE)
    ]
    assert found == []


def test_the_scan_sees_the_alias_table() -> None:
    """The check itself: the alias table spells every retired key it reads."""
    table = _code()[ALIAS_TABLE]
    assert all(old in table for old in retired_names.RUN_CONFIG)
