"""The glossary enforced (docs/design.md#glossary): words starfed retired appear in no code.

A retired run-config key is spelled in one place, its alias table (``shared/retired_names.py``),
which reads it under its new name; tests of that alias say it too (they are not scanned). A
retired word for a concept (``enrol``: a site's sync) is spelled nowhere. ``held`` names one
concept, the codebook a site (or a device following the codebook service) stores: an identifier
that contains it is one of ``HELD_NAMES``, or ``held`` itself as the module or ``SiteMemory``'s
attribute (``codebook.held``, ``memory.held``) or in the two modules that own it. Comments and
strings may use the English word ("held to its bound").
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from starfed.shared import retired_names

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("cli", "client", "server", "shared", "simulations", "ops", "host", "proto", "bench")
ALIAS_TABLE = "shared/retired_names.py"
#: Retired words: the pattern, and what is said instead.
RETIRED = {
    r"\benrol": "sync (a site says what it brings at the step's sync)",
    **{
        rf"\b{re.escape(spelt)}\b": new
        for old, new in retired_names.RUN_CONFIG.items()
        for spelt in (old, old.replace("-", "_"))  # the key, and as an identifier
    },
}
#: The identifiers that may contain ``held``: the site's stored codebook (its class), the
#: reply record that says its version, and that version (a site's, a device's request field).
HELD_NAMES = frozenset({"HeldCodebook", "HELD", "held_version"})
HELD_MODULE = "shared/codebook/held.py"
#: Where ``held`` (``_held``) alone is the stored codebook: its module, and the site's memory.
HELD_OWNERS = frozenset({HELD_MODULE, "client/memory.py"})
#: ``<qualifier>.held`` elsewhere: the module (``shared.codebook.held``), ``SiteMemory.held``.
HELD_QUALIFIERS = frozenset({"codebook", "memory"})


def _code() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    }


def stray_held(name: str, text: str) -> list[str]:
    """The identifiers of module ``name`` (source ``text``) that use ``held`` for anything but
    the stored codebook: ``name:line: identifier``. Tokens, so comments and strings are not
    read."""
    found = []
    code = [
        token
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type in (tokenize.NAME, tokenize.OP)
    ]
    for index, token in enumerate(code):
        if token.type != tokenize.NAME or "held" not in token.string.lower():
            continue
        dotted = index >= 2 and code[index - 1].string == "."
        qualifier = code[index - 2].string if dotted else ""
        allowed = token.string in HELD_NAMES or (
            token.string in ("held", "_held")
            and (name in HELD_OWNERS or qualifier in HELD_QUALIFIERS)
        )
        if not allowed:
            found.append(f"{name}:{token.start[0]}: {token.string}")
    return found


def test_no_retired_word_in_code() -> None:
    found = [
        f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group()!r} (say {new})"
        for name, text in _code().items()
        if name != ALIAS_TABLE
        for pattern, new in RETIRED.items()
        for match in re.finditer(pattern, text, re.IGNORECASE)
    ]
    assert found == []


def test_held_names_only_the_stored_codebook() -> None:
    found = [line for name, text in _code().items() for line in stray_held(name, text)]
    assert found == []


def test_the_held_scan_finds_a_new_identifier_and_passes_the_concept(tmp_path: Path) -> None:
    """The check itself, on a module written here: ``held`` as a node's version, a lock that is
    held (``lock.held()``) or classes held is found; the stored codebook's names, its module,
    ``memory.held`` and the English word in a comment or a string are not."""
    source = tmp_path / "bad.py"
    source.write_text(
        "from starfed.shared.codebook.held import HeldCodebook\n"
        "held_versions = {}  # a node's version: say version\n"
        "def take(lock):\n"
        "    with lock.held() as lock_held:  # the lock is held\n"
        "        memory.held.drop_staging()\n"
        "    classes_held = ['held to its bound']\n"
        "    return HELD, held_version\n"
    )
    found = stray_held("cli/bad.py", source.read_text())
    assert found == [
        "cli/bad.py:2: held_versions",
        "cli/bad.py:4: held",
        "cli/bad.py:4: lock_held",
        "cli/bad.py:6: classes_held",
    ]
    assert stray_held(HELD_MODULE, "held = codebook\n") == []
    assert stray_held("client/x.py", "held = codebook\n") == ["client/x.py:1: held"]


def test_the_scan_sees_the_alias_table() -> None:
    """The check itself: the alias table spells every retired key it reads, and a retired key
    or ``enrol…`` in a module is found, as the key and as an identifier."""
    table = _code()[ALIAS_TABLE]
    assert all(old in table for old in retired_names.RUN_CONFIG)
    text = 'num_clients = config["num-clients"]  # enrolled\n'
    found = [m.group() for pattern in RETIRED for m in re.finditer(pattern, text, re.IGNORECASE)]
    assert sorted(found) == ["enrol", "num-clients", "num_clients"]
