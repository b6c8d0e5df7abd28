"""``starfed codebook inspect|diff``: look into codebook files (checkpoints, exports, broadcasts).

A file that is missing, corrupt or invalid gives one line on stderr and exit code 2, so scripts
can tell "bad input" from a crash.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from starfed.cli._common import add_group, console, guard
from starfed.cli.flags import add_command
from starfed.ops.exit_codes import EXIT_OK
from starfed.proto import codebook_pb2 as pb
from starfed.shared.codebook import schema, store_layout
from starfed.shared.codebook.codebook import Codebook, CodebookError
from starfed.shared.codebook.framing import read_payload
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.codebook.wire import decode_codebook, parse, read_file, to_proto

#: A missing, corrupt or invalid file is bad input (exit 2).
guarded = guard(bad_input=(CodebookError, OSError))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """inspect or compare codebook files

    Inspect or compare codebook files (checkpoints, exports, broadcasts).
    """
    actions = add_group(subparsers, "codebook", add_parser)
    inspect = add_command(actions, "inspect", guarded(run_inspect))
    inspect.add_argument("file", type=Path, help="codebook file")
    diff = add_command(actions, "diff", guarded(run_diff))
    diff.add_argument("a", type=Path, help="older codebook file")
    diff.add_argument("b", type=Path, help="newer codebook file")


def _load(path: Path) -> tuple[Codebook, pb.Codebook]:
    """The codebook and its message (a federation folder's manifest: the codebook it names)."""
    payload = read_payload(path)
    message = parse(pb.Codebook, payload, None)
    if store_layout.Ref.of(message.metadata) is not None:
        codebook = read_file(path)
        return codebook, to_proto(codebook)
    return decode_codebook(payload), message


def _mixture_label(mixture: object) -> str:
    """A mixture field's value (None: not fitted yet)."""
    return (
        "—"
        if not isinstance(mixture, GaussianMixture)
        else f"M={mixture.n_components}, n={mixture.count}"
    )


def _dims_text(dims: ModelDims) -> str:
    return f"d_txt={dims.d_txt} d_clip={dims.d_clip} d_vit={dims.d_vit} n_layers={dims.n_layers}"


def _say(out: Console, line: str) -> None:
    """Print user data verbatim (no rich markup or highlighting inside names and paths)."""
    out.print(line, markup=False, highlight=False)


def run_inspect(args: argparse.Namespace) -> int:
    """classes, counts, versions and sizes of one codebook"""
    codebook, message = _load(args.file)
    out = console()
    _say(out, str(args.file))
    _say(out, f"fingerprint  {codebook.fingerprint}")
    _say(out, f"dims         {_dims_text(codebook.dims)}")
    _say(out, f"version      {codebook.version}")
    _say(out, f"classes      {len(codebook)} ({len(codebook.frozen)} frozen)")
    for key, value in sorted(codebook.metadata.items()):
        _say(out, f"metadata     {key} = {value}")

    classes = Table(title="classes")
    mixtures = [schema.BY_NAME[name] for name in schema.MIXTURES]
    columns = ["#", "class", "count", "version", "frozen"]
    columns += [f"{f.symbol} ({f.name})" for f in mixtures]
    for column in columns:
        classes.add_column(
            column,
            justify="right" if column in ("#", "count", "version") else "left",
            overflow="fold" if column == "class" else "ellipsis",  # a name is never cut
        )
    for i, entry in enumerate(codebook.entries.values()):
        classes.add_row(
            str(i),
            Text(entry.name),
            str(entry.count),
            str(entry.version),
            "yes" if entry.frozen else "",
            *(_mixture_label(entry.values.get(f.name)) for f in mixtures),
        )
    out.print(classes)

    total = message.ByteSize()
    sizes = {
        f"{f.symbol} ({f.name})": sum(getattr(e, f.name).ByteSize() for e in message.entries)
        for f in schema.FIELDS
    }
    sizes["other (names, counts, framing)"] = total - sum(sizes.values())
    parts = Table(title="bytes per part")
    parts.add_column("part")
    parts.add_column("bytes", justify="right")
    parts.add_column("share", justify="right")
    for part, size in {**sizes, "total": total}.items():
        parts.add_row(part, f"{size:,}", f"{size / max(total, 1):.1%}")
    out.print(parts)
    return EXIT_OK


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


def _changes(old: Codebook, new: Codebook, name: str) -> str:
    """Non-zero max |b − a| per tensor of one class; mixtures compare their overall means."""
    parts = []
    a, b = old[name].values, new[name].values
    for f in schema.FIELDS:
        x, y = a.get(f.name), b.get(f.name)
        if x is None or y is None:
            if x is not y:
                parts.append(f"{f.symbol} {'added' if x is None else 'removed'}")
        elif f.kind is schema.Kind.MIXTURE:
            if value := _max_abs(x.mean(), y.mean()):
                parts.append(f"{f.symbol} mean {value:.2e}")
        elif (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and (value := _max_abs(x, y))
        ):
            parts.append(f"{f.symbol} {value:.2e}")
    return ", ".join(parts) or "unchanged"


def _change(a: object, b: object) -> str:
    return str(a) if a == b else f"{a} → {b}"


def run_diff(args: argparse.Namespace) -> int:
    """what changed between two codebooks"""
    old, _ = _load(args.a)
    new, _ = _load(args.b)
    out = console()
    _say(out, f"{args.a} → {args.b}")
    _say(out, f"version      {_change(old.version, new.version)}")
    same_backbone = old.fingerprint == new.fingerprint
    _say(out, f"fingerprint  {'same' if same_backbone else 'DIFFERENT'}")
    _say(out, f"dims         {_change(_dims_text(old.dims), _dims_text(new.dims))}")
    added = [n for n in new.names if n not in old]
    removed = [n for n in old.names if n not in new]
    _say(out, f"added        {', '.join(added) or '—'}")
    _say(out, f"removed      {', '.join(removed) or '—'}")
    if old.dims != new.dims:
        _say(out, "tensors not compared: the dims differ")
        return EXIT_OK

    table = Table(
        Column("class", overflow="fold"),  # a name is never cut
        "count",
        "version",
        "frozen",
        "changes",
        title="per class: max |b − a| of each tensor that changed",
    )
    for name in (n for n in old.names if n in new):
        table.add_row(
            Text(name),
            _change(old[name].count, new[name].count),
            _change(old[name].version, new[name].version),
            _change(*("yes" if c[name].frozen else "no" for c in (old, new))),
            _changes(old, new, name),
        )
    out.print(table)
    return EXIT_OK
