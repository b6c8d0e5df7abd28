"""`starfed evaluate`: score a deployable codebook on a folder of labelled test images.

The folder is an ImageFolder of class folders, or a site's data folder (its ``test/``); its
classes are matched to the codebook's by class key, and images of classes the codebook lacks
are counted and left out. The scoring is the server's own
(``starfed.shared.inference.predict``), so on the server's test set it reproduces the server's
numbers. Accuracy per class, per task (the step that registered the class) and overall,
prompt-selection accuracy, and a confusion-matrix plot. docs/inference.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from starfed.cli.flags import add_command
from starfed.cli.predict import BACKBONE_FLAGS, backbone_options
from starfed.shared.config import ConfigError

COMMAND = "evaluate"
DEFAULT_PLOT = "confusion_matrix.png"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        COMMAND,
        BACKBONE_FLAGS,
        _main,
        help="accuracy of an exported codebook on labelled test images, with a confusion matrix",
        description=(
            "Score a deployable codebook on DIR: an ImageFolder of class folders (every image "
            "counts) or a site's data folder (its test/ images). Classes are matched by class "
            "key. Reports accuracy per class, per task and overall, prompt-selection accuracy, "
            "and writes a confusion-matrix plot."
        ),
    )
    own = p.add_argument_group("this command")
    own.add_argument("--codebook", type=Path, required=True, metavar="FILE", help="the codebook")
    own.add_argument("--data", type=Path, required=True, metavar="DIR", help="labelled images")
    own.add_argument(
        "--plot", type=Path, default=Path(DEFAULT_PLOT), help="PNG to write (default: %(default)s)"
    )
    own.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _print(result: dict) -> None:
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    book = result["codebook"]
    console.print(
        f"codebook v{book['version']} ({book['classes']} classes) on {result['data']}: "
        f"{result['images']} images · accuracy {_percent(result['accuracy'])}% · prompt "
        f"selection {_percent(result['selection_accuracy'])}%"
    )
    tasks = Table("task", "classes", "images", "accuracy %", "selection %", box=None)
    for t in result["tasks"]:
        tasks.add_row(str(t["step"]), str(t["classes"]), str(t["images"]),
                      _percent(t["accuracy"]), _percent(t["selection_accuracy"]))  # fmt: skip
    console.print(tasks)
    classes = Table("class", "task", "images", "accuracy %", "selection %", box=None)
    for c in result["classes"]:
        classes.add_row(c["name"], str(c["step"]), str(c["images"]),
                        _percent(c["accuracy"]), _percent(c["selection_accuracy"]))  # fmt: skip
    console.print(classes)
    if result["left_out"]:
        n = sum(result["left_out"].values())
        console.print(f"left out: {n} images of {len(result['left_out'])} classes the codebook "
                      f"lacks ({', '.join(sorted(result['left_out']))})")  # fmt: skip
    if result["unreadable"]:
        console.print(f"unreadable: {result['unreadable']} image files skipped")
    console.print(f"confusion matrix: {result['plot']}")


def _main(args: argparse.Namespace) -> int:
    if not args.codebook.is_file():
        raise ConfigError(f"--codebook {args.codebook}: no such file")
    if not args.data.is_dir():
        raise ConfigError(f"--data {args.data}: no such folder")
    if args.plot.parent and not args.plot.parent.is_dir():
        raise ConfigError(f"--plot {args.plot}: no folder {args.plot.parent}")
    options = backbone_options(args)

    from starfed.shared.codebook.codebook import Codebook
    from starfed.shared.inference.predict import evaluate
    from starfed.shared.metrics import plot_confusion_matrix

    codebook = Codebook.load(args.codebook)
    evaluation = evaluate(codebook, options.load(), args.data)
    title = f"codebook v{codebook.version} on {args.data.name}"
    plot_confusion_matrix(evaluation.confusion.numpy(), codebook.names, args.plot, title)
    result = {
        "codebook": {"file": str(args.codebook), "version": codebook.version,
                     "classes": len(codebook), "fingerprint": codebook.fingerprint},
        "data": str(args.data),
        **evaluation.to_dict(),
        "class_names": codebook.names,  # rows and columns of the confusion matrix
        "plot": str(args.plot),
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0
