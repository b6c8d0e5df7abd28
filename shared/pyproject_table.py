"""``pyproject.toml``'s run-config table, written from the knob table (``shared/config.py``).

Flower reads the run config's keys and defaults from ``[tool.flwr.app.config]``, so that table
repeats the knobs' defaults; it is written from them, never by hand: ``python -m
starfed.shared.pyproject_table --write-pyproject pyproject.toml`` (``make pyproject``);
``--check`` is the CI check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from starfed.shared.config import TABLES
from starfed.shared.knob import ConfigError, Value, show

PYPROJECT_TABLE = "[tool.flwr.app.config]"


def _toml(value: Value) -> str:
    """A default as a TOML value (a JSON string is a TOML basic string)."""
    return json.dumps(value) if isinstance(value, str) else show(value)


def run_config_table() -> list[str]:
    """The lines of ``[tool.flwr.app.config]``: every run-config knob with its default, by
    group. Flower needs every key the apps read there, and takes the defaults from it."""
    lines, group = [], None
    for k in TABLES["run-config"].values():
        if k.group != group:
            lines.append(f"# {k.group}\n")
            group = k.group
        lines.append(f"{k.key} = {_toml(k.default)}\n")
    return lines


def with_run_config_table(text: str) -> str:
    """``text`` (a pyproject.toml) with its run-config table written from the knobs: the lines
    from the table's header to its first blank line (or the next table) are replaced, every
    other byte is kept."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == PYPROJECT_TABLE) + 1
    except StopIteration:
        raise ConfigError(f"no {PYPROJECT_TABLE} table") from None
    end = start
    while end < len(lines) and lines[end].strip() and not lines[end].startswith("["):
        end += 1
    return "".join(lines[:start] + run_config_table() + lines[end:])


def main(argv: list[str] | None = None) -> int:
    """``python -m starfed.shared.pyproject_table --write-pyproject pyproject.toml [--check]``."""
    parser = argparse.ArgumentParser(
        prog="python -m starfed.shared.pyproject_table",
        description=f"Write {PYPROJECT_TABLE} of a pyproject.toml from the knob table.",
    )
    parser.add_argument("--write-pyproject", type=Path, required=True, metavar="PYPROJECT")
    parser.add_argument("--check", action="store_true", help="exit 1 if it is not written")
    args = parser.parse_args(argv)
    path: Path = args.write_pyproject
    try:
        text = path.read_text(encoding="utf-8")
        written = with_run_config_table(text)
    except (OSError, ConfigError) as err:
        print(f"{parser.prog}: error: {path}: {err}", file=sys.stderr)
        return 2
    if args.check:
        if written == text:
            return 0
        print(
            f"{path}: {PYPROJECT_TABLE} is not the knob table's (shared/config.py); write it: "
            f"python -m starfed.shared.pyproject_table --write-pyproject {path}",
            file=sys.stderr,
        )
        return 1
    if written != text:
        path.write_text(written, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
