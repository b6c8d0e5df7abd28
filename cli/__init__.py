"""The `starfed` command line: one entry point, one subcommand per user task.

Each subcommand lives next to the code it drives (``starfed.simulations.train_local``,
``starfed.cli.codebook``, ...) and registers itself through ``add_parser``; this
module only assembles them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# Modules that define `add_parser(subparsers)`, in help order.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "starfed.simulations.train_local",
    "starfed.cli.codebook",
    "starfed.simulations.simulate",
    "starfed.cli.server",
    "starfed.cli.site",
)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that describe bad input (paths, configs, files) rather than a bug."""
    from starfed.shared.codebook.codebook import CodebookError
    from starfed.shared.data.cropdiseases import DatasetError
    from starfed.shared.model.backbones import BackboneError

    return (BackboneError, CodebookError, DatasetError, FileNotFoundError)


def package_version() -> str:
    try:
        return version("starfed")
    except PackageNotFoundError:  # running from a source tree without installing
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="starfed",
        description=(
            "Federated STAR-Prompt continual learning on Flower. Sites learn new classes as they "
            "arrive and share only per-class prompts, head rows and feature statistics."
        ),
    )
    parser.add_argument("--version", action="version", version=f"starfed {package_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except _user_errors() as err:  # bad input: one line, no traceback
        print(f"starfed {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
