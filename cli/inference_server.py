"""``starfed server export``: the federation's codebook for inference-only devices.

``export`` writes the deployable codebook (finished classes, no mixtures) and its model card.
It reads the federation folder and loads no backbones. Registered on the ``server``
command by ``starfed.cli.server``, whose guard gives every error one line and its exit code.
docs/inference.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

Handler = Callable[[argparse.Namespace], int]


class BadInput(ValueError):
    """Not a federation folder, a bad address; exit 2."""


class Failed(RuntimeError):
    """Nothing to export or serve yet, a port in use; exit 1."""


def add_actions(
    actions: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    guard: Callable[[Handler], Handler],
) -> None:
    p = actions.add_parser(
        "export",
        help="write a deployable codebook (finished classes, no mixtures) and its model card",
        description=(
            "Write the federation's deployable codebook for inference-only devices: finished "
            "classes only (a step in progress is left out, and named), no mixtures, class names "
            "and the step that registered each, the backbone fingerprint; and <out>.card.json "
            "with the classes, sites, backbones and the federation's scores."
        ),
    )
    p.add_argument(
        "--federation", type=Path, required=True, metavar="FEDERATION", help="federation folder"
    )
    p.add_argument("--out", type=Path, help="codebook file (default: codebook-v<VERSION>.bin here)")
    p.add_argument("--float16", action="store_true", help="tensors in float16 (half the bytes)")
    p.add_argument("--json", action="store_true", help="the model card as one JSON object")
    p.set_defaults(func=guard(run_export))


def _federation(path: Path):
    from starfed.server.federation import Federation, FederationError
    from starfed.shared.codebook.codebook import CodebookError

    try:
        federation = Federation.open(path)
        federation.codebook()  # a damaged codebook.bin is bad input, found here
    except (FederationError, CodebookError) as err:
        raise BadInput(str(err)) from None
    return federation


def run_export(args: argparse.Namespace) -> int:
    from starfed.server import export

    federation = _federation(args.federation)
    dtype = "float16" if args.float16 else "float32"
    version = export.deployable(federation).codebook.version
    out = args.out or Path(f"codebook-v{version}.bin")
    try:
        result, card = export.write(federation, out, dtype)
    except export.NothingToExport as err:
        raise Failed(str(err)) from None
    if args.json:
        print(json.dumps({"success": True, "codebook": str(out),
                          "card": str(export.card_path(out)), **card}, indent=2))  # fmt: skip
        return 0
    book, fingerprint = card["codebook"], card["backbones"]["fingerprint"]
    print(
        f"exported {out}: version {book['version']}, {book['classes']} classes, "
        f"{book['bytes']} bytes ({dtype}), backbones {fingerprint[:12]}"
    )
    print(f"model card {export.card_path(out)}")
    if result.left_out:
        print(f"left out (step in progress, not finished): {', '.join(result.left_out)}")
    return 0
