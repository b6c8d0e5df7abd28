"""Command-line flags generated from the configuration schema (``starfed.shared.config``).

A command lists its flags as a table of :class:`Flag`: the flag's name and the schema keys it
sets. Type, help text and the default shown in ``--help`` come from the schema, so they cannot
drift from what the run uses. argparse keeps every value as the text typed; the schema's
:func:`~starfed.shared.config.parse` converts and checks it, naming the flag in its message.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from starfed.shared.config import TABLES, ConfigError, Knob, Value, parse, show

#: Help sections, in order, by schema group.
SECTIONS = {
    "scenario": "scenario",
    "backbones": "backbones",
    "training": "training",
    "protocol": "protocol and output",
    "command": "this command",
}


@dataclass(frozen=True)
class Flag:
    """One option: the schema keys it sets and, for a switch, the value it sets them to."""

    name: str
    keys: tuple[str, ...]
    const: Value | None = None  # a switch: sets its keys to this value
    help: str | None = None  # instead of the first key's help (a flag that sets several keys)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def same_name(*keys: str) -> tuple[Flag, ...]:
    """Flags named after their key: ``--seed`` sets ``seed``."""
    return tuple(Flag(f"--{key}", (key,)) for key in keys)


def switch(name: str, key: str, const: Value, help: str | None = None) -> Flag:
    return Flag(name, (key,), const, help)


def _knobs(command: str) -> dict[str, Knob]:
    """The knobs a command's flags may set: the run config's and the command's own (if any)."""
    return {**TABLES["run-config"], **TABLES.get(command, {})}


def add_command(
    subparsers: argparse._SubParsersAction,
    command: str,
    flags: Iterable[Flag],
    run: Callable[[argparse.Namespace], int],
    help: str,
    description: str,
    parents: Sequence[argparse.ArgumentParser] = (),
) -> argparse.ArgumentParser:
    """Register ``command`` with its schema flags (and ``parents``' options); ``run`` gets the
    parsed arguments."""
    parser = subparsers.add_parser(
        command, help=help, description=description, parents=list(parents)
    )
    _add_flags(parser, flags, command)
    parser.set_defaults(func=run)
    return parser


def _add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], command: str) -> None:
    """Add ``flags`` in help sections by group; every help line ends with the real default."""
    knobs = _knobs(command)
    sections = {group: parser.add_argument_group(title) for group, title in SECTIONS.items()}
    for flag in flags:
        knob = knobs[flag.keys[0]]
        text = flag.help or knob.help
        if flag.const is None:
            metavar = "{" + ",".join(knob.choices) + "}" if knob.choices else None
            sections[knob.group].add_argument(
                flag.name,
                dest=flag.dest,
                metavar=metavar,
                help=f"{text} (default: {show(knob.default)})",
            )
        else:
            sections[knob.group].add_argument(
                flag.name,
                dest=flag.dest,
                action="store_const",
                const=flag.const,
                help=f"{text}: {knob.key}={show(flag.const)} (default: {show(knob.default)})",
            )


def given(
    args: argparse.Namespace, flags: Iterable[Flag]
) -> tuple[dict[str, object], dict[str, object], dict[str, str]]:
    """What the flags set: (run-config values, the command's own values, key -> flag name).

    Unset flags are left out, so the schema's (or a project's) defaults apply.
    """
    run_config: dict[str, object] = {}
    own: dict[str, object] = {}
    names: dict[str, str] = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        if value is None:
            continue
        for key in flag.keys:
            (run_config if key in TABLES["run-config"] else own)[key] = value
            names[key] = flag.name
    return run_config, own, names


def add_run_config(parser: argparse.ArgumentParser) -> None:
    """``--run-config KEY=VALUE``, repeatable: any run-config key (read by run_config_pairs)."""
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any run-config key (docs/simulation.md), repeatable; named options win",
    )


def run_config_pairs(items: Iterable[str]) -> dict[str, object]:
    """``--run-config`` items as key -> value: the value as typed, or a quoted TOML string's
    content; the schema converts it to the key's type."""
    pairs: dict[str, object] = {}
    for text in items:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--run-config {text}: expected KEY=VALUE")
        value = raw.strip()
        if value[:1] in ("'", '"'):
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                raise ConfigError(f"--run-config {text}: not a TOML string") from None
        pairs[key.strip()] = value
    return pairs


def run_config(
    args: argparse.Namespace, flags: Iterable[Flag], always: Iterable[str] = ()
) -> tuple[dict[str, Value], dict[str, Value]]:
    """The run config a command submits: ``--run-config`` pairs, then its named flags (which
    win), checked as a whole. Returns every typed value, and the ones to send — those set plus
    ``always`` — with paths made absolute (the apps run in another process's folder)."""
    named, _, names = given(args, flags)
    overrides = run_config_pairs(args.run_config) | named
    values = parse(overrides, "run-config", names)
    sent = {key: values[key] for key in [*overrides, *always]}
    for key, value in sent.items():
        if TABLES["run-config"][key].path and value:
            sent[key] = str(Path(str(value)).expanduser().resolve())
    return values, sent
