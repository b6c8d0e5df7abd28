"""Names starfed no longer uses but still reads, and the note a retired name in use prints.

Users keep scripts, grids and stored results that say the old names; those keep working, and
each use of an old name says the new one in one line on stderr. A run-config key retires here
and nowhere else (``RUN_CONFIG``): ``starfed.shared.config.parse`` reads every run config
through :func:`current_keys`, so Flower's apps, grids and the command line never see an old
key. The command line's retired flags and commands (``starfed.cli.flags``) print :func:`note`
too. docs/design.md#glossary lists the names in use.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TypeVar

from starfed.shared.knob import ConfigError

V = TypeVar("V")

#: Retired run-config keys and the keys that replaced them (docs/design.md#glossary).
RUN_CONFIG: Mapping[str, str] = {
    "num-clients": "num-sites",  # simulated sites are sites: "client" is Flower's ClientApp
}


#: Retired run-config keys with nothing to replace them: read and ignored, with why.
DROPPED: Mapping[str, str] = {
    # a patient site's budgets are per class whatever its data (docs/security.md)
    "privacy-site-tasks": "a patient's budget is per class now, there is no site-wide plan",
}


def note(old: str, new: str) -> None:
    """The one line on stderr that a retired name in use prints."""
    print(f"starfed: {old} is deprecated, use {new} (same meaning)", file=sys.stderr)


def current_keys(raw: Mapping[str, V], quiet: bool = False) -> dict[str, V]:
    """``raw`` with every retired key under its current name, in the same order, and a note for
    each unless ``quiet`` (stored results read back); both names at once is a ConfigError."""
    for old, new in RUN_CONFIG.items():
        if old in raw and new in raw:
            raise ConfigError(f"{old} and {new} both set: {old} is the retired name of {new}")
        if old in raw and not quiet:
            note(old, new)
    for old, why in DROPPED.items():
        if old in raw and not quiet:
            print(f"starfed: {old} is ignored: {why}", file=sys.stderr)
    return {RUN_CONFIG.get(key, key): value for key, value in raw.items() if key not in DROPPED}


def written_as(raw: Mapping[str, object]) -> dict[str, str]:
    """Current key -> the retired key ``raw`` sets it by: a bad value's message names what the
    user wrote (``num-clients=0: ...``)."""
    return {new: old for old, new in RUN_CONFIG.items() if old in raw}
