"""The honest tail the history bound must clear: each lone row against the kept scale.

``history-bound`` × the scale of earlier steps × a class's size holds every row of a site that
is not private (docs/security.md §1b); stage 1's rows (plain SGD) get ``SGD_TAIL`` × that.
Over the spread's genuine draws of attack 5 (``bench/attacks.py --spread``: three sites found
the federation in step 1, farm-m alone brings X and ten genuine classes in step 2), this
prints, per phase and field, each row's change ÷ its class's size ÷ the kept scale — the
multiple of the scale an honest row reached — the largest ones with their draw, and how many
rows the bounds rejected. The screen's first pass is read as it measures
(``PhaseScreen._bound_rows`` wrapped): nothing else changes.

    nice -n 10 python bench/history_rows.py --seeds $(seq 1993 2003) --spellings 3
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attacks

from starfed.server import field_bounds

#: (phase, field) -> (multiple of the scale, seed, spelling, class), every lone row of a draw
Rows = dict[tuple[str, str], list[tuple[float, int, str, str]]]


def measure(seeds: list[int], spellings: int) -> tuple[Rows, int]:
    """Every row held to a kept scale in the draws, and the rows the bounds rejected."""
    rows: Rows = collections.defaultdict(list)
    draw: dict[str, object] = {}
    measured = field_bounds.PhaseScreen._bound_rows

    def bound_rows(self, name, changes, senders) -> None:  # type: ignore[no-untyped-def]
        scale = self.screen.scale.reference(name)
        for row in changes if scale else ():
            multiple = row.change / row.size / scale
            rows[self.phase.key, name].append((multiple, draw["seed"], draw["spelling"], row.cls))
        measured(self, name, changes, senders)

    field_bounds.PhaseScreen._bound_rows = bound_rows  # type: ignore[method-assign]
    rejected = 0
    for spelling in attacks.SPELLINGS[:spellings]:
        for seed in seeds:
            draw.update(seed=seed, spelling=spelling)
            classes = attacks.ten_classes(attacks.Ten.GENUINE, spelling)
            got = attacks.run(classes, 2, seed, lambda _: {}, 5, "genuine", 48)
            rejected += got.findings
            print(f"seed {seed} {spelling!r}: {got.findings} findings, {got.status}", flush=True)
    return rows, rejected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1993, 1994, 1995])
    parser.add_argument("--spellings", type=int, default=3, help="draws per seed")
    parser.add_argument("--json", type=Path, help="every row, by phase and field")
    args = parser.parse_args()
    rows, rejected = measure(args.seeds, args.spellings)
    print(f"\nfindings against farm-m: {rejected}")
    for (phase, name), values in sorted(rows.items()):
        values.sort(reverse=True)
        top = ", ".join(
            f"{m:.1f} ({seed} {spelling!r} {cls})" for m, seed, spelling, cls in values[:3]
        )
        over = sum(m > 4 for m, *_ in values)
        print(f"{phase} {name}: {len(values)} rows, {over} over 4 × the scale; largest {top}")
    if args.json:
        args.json.write_text(json.dumps({f"{p} {n}": v for (p, n), v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
