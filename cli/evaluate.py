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
from pathlib import Path

from rich.table import Column, Table
from rich.text import Text

from starfed.cli._common import add_switches, console, warn_unreadable
from starfed.cli.flags import BACKBONE_FLAGS, add_command, parsed, same_name
from starfed.ops.exit_codes import EXIT_OK
from starfed.shared.knob import ConfigError, as_str
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.progress import counted, percent_text

COMMAND = "evaluate"
FLAGS = (*BACKBONE_FLAGS, *same_name("plot"))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, COMMAND, _main, FLAGS)
    own = p.add_argument_group("this command")
    own.add_argument("--codebook", type=Path, required=True, metavar="FILE", help="the codebook")
    own.add_argument("--data", type=Path, required=True, metavar="DIR", help="labelled images")
    add_switches(own, {"--json": "one JSON object on stdout"})


def _print(result: dict) -> None:
    out = console()
    book = result["codebook"]
    out.print(
        f"codebook v{book['version']} ({counted(book['classes'], 'class')}) on {result['data']}: "
        f"{counted(result['images'], 'image')} · accuracy {percent_text(result['accuracy'])}% · "
        f"prompt selection {percent_text(result['selection_accuracy'])}%"
    )
    tasks = Table("task", "classes", "images", "accuracy %", "selection %", box=None)
    for t in result["tasks"]:
        tasks.add_row(
            str(t["step"]),
            str(t["classes"]),
            str(t["images"]),
            percent_text(t["accuracy"]),
            percent_text(t["selection_accuracy"]),
        )
    out.print(tasks)
    classes = Table(
        Column("class", overflow="fold"), "task", "images", "accuracy %", "selection %", box=None
    )
    for c in result["classes"]:
        classes.add_row(
            Text(c["name"]),
            str(c["step"]),
            str(c["images"]),
            percent_text(c["accuracy"]),
            percent_text(c["selection_accuracy"]),
        )
    out.print(classes)
    if result["left_out"]:
        images = counted(sum(result["left_out"].values()), "image")
        lacked = counted(len(result["left_out"]), "class")
        out.print(
            f"left out: {images} of {lacked} the codebook lacks "
            f"({', '.join(sorted(result['left_out']))})"
        )
    if result["unreadable"]:
        out.print(f"unreadable: {counted(result['unreadable'], 'image file')} skipped")
    out.print(f"confusion matrix: {result['plot']}")


def _main(args: argparse.Namespace) -> int:
    """accuracy of an exported codebook on labelled test images, with a confusion matrix

    Score a deployable codebook on DIR: an ImageFolder of class folders (every image counts) or
    a site's data folder (its test/ images). Classes are matched by class key. Reports accuracy
    per class, per task and overall, prompt-selection accuracy, and writes a confusion-matrix
    plot.
    """
    values, own, _ = parsed(args, FLAGS, COMMAND)
    plot = Path(as_str(own, "plot"))
    if not args.codebook.is_file():
        raise ConfigError(f"--codebook {args.codebook}: no such file")
    if not args.data.is_dir():
        raise ConfigError(f"--data {args.data}: no such folder")
    if plot.parent and not plot.parent.is_dir():
        raise ConfigError(f"--plot {plot}: no folder {plot.parent}")
    options = BackboneOptions.from_config(values)

    from starfed.shared.codebook import wire
    from starfed.shared.inference.predict import evaluate
    from starfed.shared.metrics import plot_confusion_matrix

    codebook = wire.read_file(args.codebook)
    evaluation = evaluate(codebook, options.load(), args.data)
    warn_unreadable(args, evaluation.unreadable)
    title = f"codebook v{codebook.version} on {args.data.name}"
    plot_confusion_matrix(evaluation.confusion.numpy(), codebook.names, plot, title)
    result = {
        "codebook": {
            "file": str(args.codebook),
            "version": codebook.version,
            "classes": len(codebook),
            "fingerprint": codebook.fingerprint,
        },
        "data": str(args.data),
        **evaluation.to_dict(),
        "class_names": codebook.names,  # rows and columns of the confusion matrix
        "plot": str(plot),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return EXIT_OK
