"""Command-line flags generated from the knob table (``starfed.cli.command_knobs``).

A command lists its flags as a table of :class:`Flag`: the flag's name and the schema keys it
sets, from the run config or the command's own table (``TABLES[command]``, e.g. ``server
start``). Type, help text and the default shown in ``--help`` come from the schema, so they
cannot drift from what the run uses. argparse keeps every value as the text typed; the schema's
:func:`~starfed.shared.config.parse` converts and checks it, naming the flag in its message,
before anything heavy loads.
"""

from __future__ import annotations

import argparse
import inspect
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starfed.cli.command_knobs import TABLES, parse
from starfed.shared import retired_names
from starfed.shared.knob import ConfigError, Knob, Value, show

#: Help sections, in order, by schema group.
SECTIONS = {
    "scenario": "scenario",
    "backbones": "backbones",
    "training": "training",
    "privacy": "privacy",
    "protocol": "protocol and output",
    "screening": "screening: what the server believes of a site",
    "command": "this command",
}


@dataclass(frozen=True)
class Flag:
    """One option: the schema keys it sets and, for a switch, the value it sets them to."""

    name: str
    keys: tuple[str, ...]
    const: Value | None = None  # a switch: sets its keys to this value
    help: str | None = None  # instead of the first key's help (a flag that sets several keys)
    retired: tuple[str, ...] = ()  # old names that still work, unlisted, with a note (not both)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def same_name(*keys: str) -> tuple[Flag, ...]:
    """Flags named after their key: ``--seed`` sets ``seed``."""
    return tuple(Flag(f"--{key}", (key,)) for key in keys)


#: The frozen backbone pair (``BackboneOptions``): what every command that loads it takes.
BACKBONE_FLAGS = same_name("preset", "backbone-config", "clip-weights", "vit-weights")


def device_flag(what: str) -> Flag:
    """``--device``: the run config's ``device`` knob, said of what this command computes."""
    return Flag("--device", ("device",), help=f"where {what}: {DEVICES}")


DEVICES = "auto (the GPU when there is one), cpu, cuda, cuda:N, mps"


def switch(name: str, key: str, const: Value, help: str | None = None) -> Flag:
    return Flag(name, (key,), const, help)


def _knobs(table: str) -> dict[str, Knob]:
    """The knobs a command's flags may set: the run config's and its own table's (which win)."""
    return {**TABLES["run-config"], **TABLES.get(table, {})}


def add_command(
    subparsers: argparse._SubParsersAction,
    command: str,
    run: Callable[[argparse.Namespace], int],
    flags: Iterable[Flag] = (),
    parents: Sequence[argparse.ArgumentParser] = (),
    table: str | None = None,
    hidden: bool = False,
) -> argparse.ArgumentParser:
    """Register ``command`` with its schema flags (and ``parents``' options); ``run`` gets the
    parsed arguments. As with click, ``run``'s docstring is the help: its first paragraph the
    line in the command list, the rest the description. ``table``: the command's own knobs
    (default: the command's name); ``hidden``: left out of the command list (a retired name)."""
    summary, _, description = (inspect.getdoc(run) or "").partition("\n\n")
    listed: dict[str, Any] = {} if hidden else {"help": " ".join(summary.split())}
    parser = subparsers.add_parser(
        command, description=" ".join(description.split()) or None, parents=list(parents), **listed
    )
    _add_flags(parser, flags, table or command)
    parser.set_defaults(func=run)
    return parser


def _add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag], table: str) -> None:
    """Add ``flags`` in help sections by group; every help line ends with the real default."""
    knobs = _knobs(table)
    sections = {group: parser.add_argument_group(title) for group, title in SECTIONS.items()}
    for flag in flags:
        knob = knobs[flag.keys[0]]
        text = flag.help or knob.help
        section: argparse._ActionsContainer = sections[knob.group]
        if flag.retired:
            section = section.add_mutually_exclusive_group()  # the old name or the new one
            for old in flag.retired:
                section.add_argument(
                    old, dest=flag.dest, action=_Retired, new=flag.name, help=argparse.SUPPRESS
                )
        if flag.const is None:
            metavar = "{" + ",".join(knob.choices) + "}" if knob.choices else None
            section.add_argument(
                flag.name,
                dest=flag.dest,
                metavar=metavar,
                help=f"{text} (default: {show(knob.default)})",
            )
        else:
            section.add_argument(
                flag.name,
                dest=flag.dest,
                action="store_const",
                const=flag.const,
                help=f"{text}: {knob.key}={show(flag.const)} (default: {show(knob.default)})",
            )


class _Retired(argparse.Action):
    """A flag's retired name: sets what the flag sets, and says the new name on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        retired_names.note(str(option_string), self.new)
        setattr(namespace, self.dest, values)


def given(
    args: argparse.Namespace, flags: Iterable[Flag], table: str | None = None
) -> tuple[dict[str, object], dict[str, object], dict[str, str]]:
    """What the flags set: (run-config values, the command's own values, key -> flag name).

    A key of the command's ``table`` (or of no run-config knob) is its own, any other a
    run-config key. Unset flags are left out, so the schema's (or a project's) defaults apply.
    """
    own_keys = TABLES.get(table or "", {})
    run_config: dict[str, object] = {}
    own: dict[str, object] = {}
    names: dict[str, str] = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        if value is None:
            continue
        for key in flag.keys:
            mine = key in own_keys or key not in TABLES["run-config"]
            (own if mine else run_config)[key] = value
            names[key] = flag.name
    return run_config, own, names


def parsed(
    args: argparse.Namespace, flags: Iterable[Flag], table: str
) -> tuple[dict[str, Value], dict[str, Value], dict[str, str]]:
    """The flags' values checked by the schema: (every run-config value, every value of the
    command's own ``table``, key -> flag name for messages)."""
    run_config, own, names = given(args, flags, table)
    values = parse(run_config, "run-config", names)
    return values, parse(own, table, names) if table in TABLES else {}, names


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
    pairs = run_config_pairs(args.run_config)
    names = retired_names.written_as(pairs) | names
    overrides = retired_names.current_keys(pairs) | named
    values = parse(overrides, "run-config", names)
    sent = {key: values[key] for key in [*overrides, *always]}
    for key, value in sent.items():
        if TABLES["run-config"][key].path and value:
            sent[key] = str(Path(str(value)).expanduser().resolve())
    return values, sent
