"""`starfed predict`: classify image files with a deployable codebook, offline.

The codebook is a file (``--codebook``, from ``starfed server export``) or a local copy that
the codebook service keeps current (``--from HOST:PORT --ca ca.pem --cache DIR``); besides it,
only the backbones it was trained with are needed. Input is checked before torch or the
backbones load. One row per image — path, class, probability, task — as CSV on stdout or one
JSON object; unreadable images are skipped with one warning line each (exit 2 if none could be
read). docs/inference.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

from starfed.cli._common import warn, warn_unreadable
from starfed.cli.flags import BACKBONE_FLAGS, add_command, device_flag, parsed, same_name
from starfed.ops.exit_codes import EXIT_FAILED
from starfed.shared.knob import ConfigError, as_int, as_str
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.progress import counted

COMMAND = "predict"
FLAGS = (
    *BACKBONE_FLAGS,
    device_flag("the images are classified"),
    *same_name("batch-size", "format", "cache"),
)


def default_cache() -> Path:
    """Where ``--from`` keeps its copy when ``--cache`` is "" (the knob's default)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "starfed" / "codebook"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, COMMAND, _main, FLAGS)
    p.add_argument("inputs", nargs="+", metavar="IMAGE|DIR", help="image files or folders")
    source = p.add_argument_group("codebook (give --codebook or --from)")
    source.add_argument("--codebook", type=Path, metavar="FILE", help="an exported codebook")
    source.add_argument(
        "--from",
        dest="service",
        metavar="HOST:PORT",
        help="keep a local copy current through `starfed server serve` and predict with it",
    )
    source.add_argument("--ca", type=Path, help="the federation's ca.pem (with --from)")
    source.add_argument(
        "--insecure", action="store_true", help="--from without TLS: loopback addresses only"
    )


def _check(args: argparse.Namespace) -> None:
    if (args.codebook is None) == (args.service is None):
        raise ConfigError("give either --codebook FILE or --from HOST:PORT")
    if args.codebook is not None and not args.codebook.is_file():
        raise ConfigError(f"--codebook {args.codebook}: no such file")
    if args.service is not None and not args.insecure and args.ca is None:
        raise ConfigError("--from needs --ca (the federation's ca.pem)")
    for path in args.inputs:
        if not os.path.exists(path):
            raise ConfigError(f"{path}: no such file or folder")


def image_paths(inputs: list[str]) -> list[str]:
    """Files as given; folders searched recursively for images, in sorted order."""
    from starfed.shared.data.images import IMAGE_EXTENSIONS

    paths: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found, seen = [], set()
            for folder, subfolders, files in os.walk(item, followlinks=True):
                if os.path.realpath(folder) in seen:  # a link back up the tree
                    subfolders.clear()
                    continue
                seen.add(os.path.realpath(folder))
                found += [
                    os.path.join(folder, f)
                    for f in files
                    if Path(f).suffix.lower() in IMAGE_EXTENSIONS
                ]
            found.sort()
            if not found:
                raise ConfigError(f"{item}: no image files in this folder")
            paths += found
        else:
            paths.append(item)
    return paths


def _codebook(args: argparse.Namespace, cache: Path):
    """The codebook file, or the service's current codebook (None: could not get one)."""
    from starfed.shared.codebook import wire

    if args.codebook is not None:
        return wire.read_file(args.codebook)
    from starfed.ops.follow import DistributionError, SourceError, fetch

    try:
        fetched = fetch(args.service, cache, ca=args.ca, insecure=args.insecure)
    except SourceError as err:
        raise ConfigError(str(err)) from None
    except DistributionError as err:
        print(f"starfed {COMMAND}: error: {err}", file=sys.stderr)
        return None
    if fetched.status == "offline":
        warn(
            args,
            f"cannot update the codebook ({fetched.reason}); using version "
            f"{fetched.codebook.version} in {cache}",
        )
    else:
        print(
            f"starfed {COMMAND}: codebook version {fetched.codebook.version} "
            f"({fetched.status}, {fetched.reply_bytes} bytes from {args.service})",
            file=sys.stderr,
        )
    return fetched.codebook


def _main(args: argparse.Namespace) -> int:
    """classify images with an exported codebook (offline), CSV or JSON

    Predict the class of each image with a deployable codebook and the backbones it was trained
    with: path, class, probability (softmax of the aligned head) and task (the step that
    registered the class whose prompts the image selected most). Folders are searched
    recursively.
    """
    values, own, _ = parsed(args, FLAGS, COMMAND)
    _check(args)
    options = BackboneOptions.from_config(values)

    from starfed.shared.inference.predict import Predictor

    paths = image_paths(args.inputs)
    codebook = _codebook(args, Path(as_str(own, "cache")) if own["cache"] else default_cache())
    if codebook is None:
        return EXIT_FAILED
    try:
        backbones = options.load(as_str(values, "device"))
    except ValueError as err:  # a device this machine does not have
        raise ConfigError(f"--device {values['device']}: {err}") from None
    predictor = Predictor(codebook, backbones)
    rows, skipped = [], []
    writer = csv.writer(sys.stdout, lineterminator="\n") if own["format"] == "csv" else None
    if writer:
        writer.writerow(["path", "class", "probability", "task"])
    for predictions, unreadable in predictor.predict_files(paths, as_int(own, "batch-size")):
        warn_unreadable(args, unreadable)
        skipped += unreadable
        if writer:
            writer.writerows([p.path, p.name, f"{p.probability:.6f}", p.task] for p in predictions)
            sys.stdout.flush()
        rows += predictions
    if not rows:
        raise ConfigError(f"none of the {counted(len(paths), 'image')} could be read")
    if own["format"] == "json":
        codebook_info = {
            "version": codebook.version,
            "classes": len(codebook),
            "fingerprint": codebook.fingerprint,
        }
        listed = [
            {"path": p.path, "class": p.name, "probability": p.probability, "task": p.task}
            for p in rows
        ]
        print(
            json.dumps(
                {"codebook": codebook_info, "predictions": listed, "skipped": skipped}, indent=2
            )
        )
    return 0
