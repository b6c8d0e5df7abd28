"""What every ``starfed`` subcommand shares: its exit codes, the one-line error, console and JSON
output, how a group of actions is registered, and the server folder the ``server`` actions
work on. Subcommands import this module, never each other's helpers.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from starfed.ops.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
)
from starfed.server.ops.layout import DIR_ENV, ServerFolder, default_dir
from starfed.shared.knob import ConfigError, Value, as_float, as_str
from starfed.shared.progress import console as console  # the one rule for output width

Run = Callable[[argparse.Namespace], int]


class Failed(RuntimeError):
    """Something failed that is not bad input (nothing to export yet, a port in use): exit 1."""


def command_name(args: argparse.Namespace) -> str:
    """The command and its actions as typed: ``server sites add``."""
    words = (v for k, v in vars(args).items() if k == "command" or k.endswith("_action"))
    return " ".join(str(word) for word in words if word)


def emit_json(data: Any) -> None:
    """One JSON object on stdout, for scripts."""
    print(json.dumps(data, indent=2, default=str))


def warn(args: argparse.Namespace, message: str) -> None:
    """One line on stderr that does not stop the command."""
    print(f"starfed {command_name(args)}: warning: {message}", file=sys.stderr)


def warn_unreadable(args: argparse.Namespace, paths: list[str]) -> None:
    """An image file that could not be decoded: one line each, the same in every command."""
    for path in paths:
        warn(args, f"cannot read {path}: skipped")


def fail(args: argparse.Namespace, err: Exception | str, code: int) -> int:
    """Say why in one line on stderr (and, with ``--json``, as one JSON object on stdout)."""
    message = " ".join(str(err).split())
    if getattr(args, "json", False) is True:
        emit_json({"success": False, "error": message, "exit_code": code})
    print(f"starfed {command_name(args)}: error: {message}", file=sys.stderr)
    return code


def guard(
    bad_input: tuple[type[Exception], ...] = (), failed: tuple[type[Exception], ...] = ()
) -> Callable[[Run], Run]:
    """Every expected error of ``run`` as one line and its exit code: :class:`ConfigError` and
    ``bad_input`` exit 2; :class:`Failed`, ``OSError``, ``failed`` and Ctrl-C exit 1. A reader
    of stdout that went away (``BrokenPipeError``) is no failure: ``cli.main`` ends quietly."""

    bad: tuple[type[Exception], ...] = (ConfigError, *bad_input)
    failing: tuple[type[Exception], ...] = (Failed, OSError, *failed)

    def decorate(run: Run) -> Run:
        @functools.wraps(run)
        def guarded(args: argparse.Namespace) -> int:
            try:
                return run(args)
            except BrokenPipeError:
                raise
            except bad as err:
                return fail(args, err, EXIT_BAD_INPUT)
            except failing as err:
                return fail(args, err, EXIT_FAILED)
            except KeyboardInterrupt:  # what was started cleans up after itself; say so
                return fail(args, "interrupted", EXIT_FAILED)

        return guarded

    return decorate


def add_group(
    subparsers: argparse._SubParsersAction, name: str, register: Callable[..., None]
) -> argparse._SubParsersAction:
    """Register the command ``name`` whose actions the returned object takes (``args.<name>_action``
    says which). As with a click group, the docstring of ``register`` (the function that
    registers the group) is its help: first paragraph the summary, the rest the description."""
    summary, _, description = (inspect.getdoc(register) or "").partition("\n\n")
    parser = subparsers.add_parser(
        name, help=" ".join(summary.split()), description=" ".join(description.split()) or None
    )
    return parser.add_subparsers(dest=f"{name}_action", metavar="ACTION", required=True)


def server_options() -> argparse.ArgumentParser:
    """``--dir`` and ``--json``, accepted by every ``server`` action (after the action name)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--dir", type=Path, help=f"server folder (default: ${DIR_ENV} or ./starfed-server)"
    )
    parent.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parent


def server_folder(args: argparse.Namespace) -> ServerFolder:
    """The server folder a ``server`` action works on."""
    return ServerFolder.at(args.dir if args.dir is not None else default_dir())


def existing_server_folder(args: argparse.Namespace) -> ServerFolder:
    """The server folder of an action that only reads it: a folder that is not there is a typo
    (exit 2), not a stopped server."""
    folder = server_folder(args)
    if not folder.root.is_dir():
        given = f"--dir {args.dir}" if args.dir is not None else f"${DIR_ENV} or ./starfed-server"
        raise ConfigError(
            f"no server folder {folder.root} ({given}); `starfed server start` makes one"
            + ("; a simulation's folder: --federation DIR" if hasattr(args, "federation") else "")
        )
    return folder


def federation_option(parser: argparse.ArgumentParser) -> None:
    """``--federation``: every ``server`` action that reads the federation folder finds it in
    the server folder unless told otherwise."""
    parser.add_argument(
        "--federation",
        type=Path,
        default=None,
        metavar="DIR",
        help="the federation folder (default: <server dir>/federation)",
    )


def federation_dir(args: argparse.Namespace, folder: ServerFolder) -> Path:
    """The federation folder a ``server`` action works on (``federation_option``)."""
    return (args.federation or folder.federation).expanduser().resolve()


def add_switches(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, switches: dict[str, str]
) -> None:
    """On/off flags (``--insecure``, ``--json``, ...): flag name -> help."""
    for name, text in switches.items():
        parser.add_argument(name, action="store_true", help=text)


def ray_options(options: Mapping[str, Value]) -> tuple[float, str]:
    """``--gpus-per-client`` and ``--ray-address`` checked against ``--runtime``, the same for
    every command that runs Flower on Ray: both are Ray's, so the local runtime refuses them,
    and a GPU share needs CUDA here unless a cluster (either address) brings its own GPUs."""
    gpus, ray_address = as_float(options, "gpus-per-client"), as_str(options, "ray-address")
    if gpus > 0 and options["runtime"] == "local":
        raise ConfigError(
            "--gpus-per-client is Ray's: the local runtime computes on the run "
            "config's device (auto: the GPU when there is one)"
        )
    if ray_address and options["runtime"] == "local":
        raise ConfigError(
            "--ray-address is Ray's: the local runtime runs without Ray (--runtime flower)"
        )
    if gpus > 0 and not (ray_address or os.environ.get("RAY_ADDRESS")):  # a cluster's own GPUs
        import torch  # only now: the check needs CUDA's driver

        if not torch.cuda.is_available():
            raise ConfigError(f"--gpus-per-client {gpus}: this machine has no CUDA GPU")
    return gpus, ray_address
