"""The `starfed` command line: one entry point, one subcommand per user task.

Each subcommand is a module of this package (``starfed.cli.train_local``, ...) that registers
itself through ``add_parser`` and loads the code it drives only once its input is checked.
This module assembles them; a run imports only its own subcommand's module, so bad input is
reported in a fraction of a second. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from typing import NoReturn

from starfed.cli._common import fail
from starfed.ops.exit_codes import EXIT_BAD_INPUT, EXIT_PIPE_CLOSED
from starfed.shared.knob import ConfigError
from starfed.shared.version import package_version

# Before any module loads torch and its OpenMP runtime, which reads this once: a thread waiting
# for its pool's others sleeps instead of spinning. Spinning threads of two processes on a busy
# machine wait out each other's time slices: one run slowed 10x when another shared its two
# cores (docs/benchmarks.md#a-busy-machine-benchbusy_machinepy). Children (cells, Flower's
# processes, Ray's workers) inherit it; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Modules that define `add_parser(subparsers)`, in help order; each module's name is its
# command's (train_local: `starfed train-local`).
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "starfed.cli.train_local",
    "starfed.cli.codebook",
    "starfed.cli.simulate",
    "starfed.cli.experiment",
    "starfed.cli.server",
    "starfed.cli.site",
    "starfed.cli.predict",
    "starfed.cli.evaluate",
)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other bad input; a mistyped flag is named first
    (argparse would report the required flag it hides: ``--sever`` -> "required: --server")."""

    typed: tuple[str, ...] = ()

    def parse_known_args(self, args=None, namespace=None):
        self.typed = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        unknown = [flag for flag in map(_flag, self.typed) if flag and not self._knows(flag)]
        if unknown and message.startswith("the following arguments are required"):
            near = difflib.get_close_matches(unknown[0], self._option_string_actions, n=1)
            message = f"unknown flag {unknown[0]}" + (f" (did you mean {near[0]}?)" if near else "")
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")

    def _knows(self, flag: str) -> bool:
        """A flag of this command, or an abbreviation of one (argparse accepts both)."""
        return any(known.startswith(flag) for known in self._option_string_actions)


def _flag(arg: str) -> str:
    """``--name`` of ``--name`` or ``--name=value``; "" for anything else."""
    return arg.partition("=")[0] if arg.startswith("--") and len(arg) > 2 else ""


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that describe bad input (paths, configs, files) rather than a bug."""
    from starfed.shared.codebook.codebook import CodebookError
    from starfed.shared.data.images import DatasetError
    from starfed.shared.model.backbone_config import BackboneError
    from starfed.simulations.simulate import SimulationError

    return (BackboneError, CodebookError, DatasetError, FileNotFoundError, SimulationError)


def _modules(argv: list[str]) -> tuple[str, ...]:
    """The module of the subcommand in ``argv``, or all of them (``--help``, no command)."""
    by_command = {m.rsplit(".", 1)[1].replace("_", "-"): m for m in SUBCOMMAND_MODULES}
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return (by_command[first],) if first in by_command else SUBCOMMAND_MODULES


def build_parser(modules: tuple[str, ...] = SUBCOMMAND_MODULES) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="starfed",
        description=(
            "Federated STAR-Prompt continual learning on Flower. Sites learn new classes as they "
            "arrive and share only per-class prompts, head rows and feature statistics."
        ),
    )
    parser.add_argument("--version", action="version", version=f"starfed {package_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in modules:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_modules(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is caught below
        return code
    except BrokenPipeError:
        return _reader_gone()
    except ConfigError as err:  # matched first: naming it imports nothing
        return fail(args, err, EXIT_BAD_INPUT)
    except _user_errors() as err:
        return fail(args, err, EXIT_BAD_INPUT)


def _reader_gone() -> int:
    """The reader of stdout went away (``starfed predict … | head``): what it did not read is
    dropped silently, as by a command that SIGPIPE ends, not a traceback; stdout is pointed at
    the null device so that Python's own flush at exit cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
