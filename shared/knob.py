"""One knob: its key, type, allowed values, default and help, and the typed reading of a value.

The machinery under every knob table (``starfed.shared.config``: the model's knobs;
``starfed.simulations.research_knobs`` and ``starfed.cli.command_knobs``: the commands' own):
how one raw value — a typed value, or text from a command line or an environment variable —
becomes the knob's type or one :class:`ConfigError`, how code reads a parsed value as its type
(``as_str``, ...), and the checks of path knobs (``existing_file``, ``existing_dir``,
``writable_dir``).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

Value = int | float | bool | str
Values = Mapping[str, Value]


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Knob:
    """One setting: its dashed key, type, allowed values, default and help text."""

    key: str
    kind: type[Value]
    default: Value
    help: str
    group: str
    ge: float | None = None  # numbers: smallest allowed value
    gt: float | None = None  # numbers: allowed values lie above this
    le: float | None = None  # numbers: largest allowed value
    choices: tuple[str, ...] = ()
    check: Callable[[str], object] | None = None  # non-empty strings: ValueError if unusable
    path: bool = False  # a file or folder (made absolute where it travels to other processes)
    command: str | tuple[str, ...] | None = None  # group "command": whose option it is

    @property
    def commands(self) -> tuple[str, ...]:
        """The commands whose option this is (one knob for all: the same check and help)."""
        return (self.command,) if isinstance(self.command, str) else self.command or ()

    @property
    def allowed(self) -> str:
        """What the knob accepts, in words (for errors)."""
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return f"one of {', '.join(self.choices)}" if self.choices else "a string"
        noun = "an integer" if self.kind is int else "a number"
        if self.ge is not None and self.le is not None:
            return f"{noun} in [{show(self.ge)}, {show(self.le)}]"
        if self.ge is not None:
            return f"{noun} >= {show(self.ge)}"
        return f"{noun} > {show(self.gt)}" if self.gt is not None else noun

    def parse(self, raw: object, name: str | None = None) -> Value:
        """``raw`` (a typed value, or text from a command line) as this knob's type, checked."""
        name = name or self.key
        shown = f"{name} {show(raw)}" if name.startswith("-") else f"{name}={show(raw)}"
        value = _convert(self.kind, raw)
        if value is None or not self._admits(value):
            raise ConfigError(f"{shown}: expected {self.allowed}")
        if self.check is not None and isinstance(value, str) and value:
            try:
                self.check(value)
            except ValueError as err:
                raise ConfigError(f"{shown}: {err}") from None
        return value

    def _admits(self, value: Value) -> bool:
        if self.choices:
            return value in self.choices
        if isinstance(value, bool | str):  # the knob's kind: ``_convert`` made it one
            return True
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
        )


def _convert(kind: type[Value], raw: object) -> Value | None:
    """``raw`` as ``kind``, or None. Text converts to any type; booleans are not numbers."""
    if kind is str:
        return raw if isinstance(raw, str) else None
    if kind is bool:
        if isinstance(raw, str):
            return {"true": True, "false": False, "1": True, "0": False}.get(raw.strip().lower())
        return raw if isinstance(raw, bool) else None
    if isinstance(raw, str):
        try:
            raw = kind(raw.strip())
        except ValueError:
            return None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return None
    if kind is int:
        return raw if isinstance(raw, int) else None
    return float(raw) if math.isfinite(raw) else None


def show(value: object) -> str:
    """A value as a user would type it (messages, ``--help``)."""
    if isinstance(value, bool):
        return str(value).lower()
    return '""' if value == "" else str(value)


def existing_file(path: str) -> None:
    """A path knob's check: a file is there."""
    if not Path(path).expanduser().is_file():
        raise ValueError("no such file")


def existing_dir(path: str) -> None:
    """A path knob's check: a folder is there."""
    if not Path(path).expanduser().is_dir():
        raise ValueError("no such folder")


def writable_dir(path: str | os.PathLike[str], name: str) -> Path:
    """Create ``path`` if needed and prove it takes files, so a run never fails at its end."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ConfigError(f"{name} {path}: cannot write there ({err.strerror})") from None
    return path


def optional(value: Value) -> Value | None:
    """An optional knob's value: "" (or 0) means not set."""
    return value or None


# --- one value, typed: ``parse`` gave each knob its kind; these say which to the type checker --

_Kind = TypeVar("_Kind", str, int, bool)


def _of(values: Values, key: str, kind: type[_Kind]) -> _Kind:
    value = values[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={show(value)}: expected {kind.__name__}")
    return value


def as_str(values: Values, key: str) -> str:
    """A text knob's value (a path, a name, a choice)."""
    return _of(values, key, str)


def as_int(values: Values, key: str) -> int:
    """An integer knob's value."""
    return _of(values, key, int)


def as_bool(values: Values, key: str) -> bool:
    """A true/false knob's value."""
    return _of(values, key, bool)


def as_float(values: Values, key: str) -> float:
    """A number knob's value (an integer given for it reads as a float)."""
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={show(value)}: expected a number")
    return float(value)
