"""A site leaves: what the kept rows cost, and an immediate withdrawal's wall time, at the
paper's dims.

Storage: each site's last rows per class (``server.contributions``) are kept in the folder's
codebook store; this writes one site's rows of ``C`` classes (every trained field and both
mixtures at M components, the server's own fields stored as zeros) as a first save (a base) and
reports the bytes per site per class, with the totals at 100 / 1,000 / 10,000 classes (for one
holder per class: multiply by the holders). Wall time: a folder with ``C`` frozen classes (random
values), one leaving site with 10 classes of its own and 10 shared with two others, and the
withdrawal's parts timed: the plan, the merge again of the shared classes (the strategy's
``merge``, every trained phase), and the commit (``Federation.withdraw``: the codebook's
manifest and record, the registry, the quarantine and the kept rows). The replays that follow
are a step's own (the head's over every class, the first level over the shared classes):
docs/benchmarks.md gives their cost at these sizes; they are not timed here (they need the
paper's backbones). Per phase: what keeping the rows adds to every phase's commit of a
federation that holds ``C`` classes (one holder each), when ``IN_PLAY`` classes are trained —
``Contributions.merged`` and ``Federation.save_contributions`` — and what a run's start reads
(``Federation.contributions``).

    python bench/withdrawal.py                       # 100, 1000, 10000 classes
    python bench/withdrawal.py --classes 100,1000
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from codebook_sizes import PAPER, random_codebook

from starfed.server.contributions import Contributions, Rows
from starfed.server.federation import Federation
from starfed.server.records import Position, Withdrawal, now
from starfed.server.robust import MedianStrategy
from starfed.server.withdrawal import Setting, merged_without, plan
from starfed.shared.codebook import schema, store_io
from starfed.shared.codebook.codebook import ClientUpdate
from starfed.shared.config import parse
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import Phase

COMPONENTS = 5
OWN, SHARED = 10, 10
IN_PLAY = 10  # classes a phase trains, per phase measurement


def site_rows(codebook, names: list[str], site: str, seed: int) -> dict:
    """``site``'s rows of ``names``: every trained field, random, count 40."""
    generator = torch.Generator().manual_seed(seed)
    rows = {}
    for name in names:
        values = {}
        for phase in (Phase.STAGE1, Phase.STAGE1_STATS, Phase.STAGE2, Phase.STAGE2_STATS):
            for field in schema.trained_in(phase):
                value = codebook[name].values[field]
                values[field] = (
                    value
                    if not isinstance(value, torch.Tensor)
                    else torch.randn(value.shape, generator=generator)
                )
        rows[site, name] = Rows(site, name, values, dict.fromkeys(values, 40))
    return rows


def storage(n_classes: int) -> dict:
    codebook = random_codebook(PAPER, n_classes, COMPONENTS)
    rows = Contributions(site_rows(codebook, codebook.names, "site-a", 1))
    with tempfile.TemporaryDirectory() as folder:
        saved, manifest = store_io.save(Path(folder), rows.as_codebook(codebook), None)
        base = saved.base_bytes
    per = (base + len(manifest)) / n_classes
    return {
        "classes": n_classes,
        "bytes": base + len(manifest),
        "bytes_per_site_per_class": round(per),
        "at": {str(c): round(per * c) for c in (100, 1_000, 10_000)},
    }


def withdrawal(n_classes: int, setting: Setting) -> dict:
    codebook = random_codebook(PAPER, n_classes, COMPONENTS)
    names = codebook.names
    own, shared = names[:OWN], names[OWN : OWN + SHARED]
    rows = {
        **site_rows(codebook, own + shared, "leaver", 1),
        **site_rows(codebook, shared, "site-a", 2),
        **site_rows(codebook, shared, "site-b", 3),
        **site_rows(codebook, names[OWN + SHARED :], "site-a", 4),
    }
    with tempfile.TemporaryDirectory() as folder:
        fed = Federation(folder, codebook.fingerprint, PAPER)
        brought = {n: ["leaver"] for n in own}
        brought |= {n: ["leaver", "site-a", "site-b"] for n in shared}
        brought |= {n: ["site-a"] for n in names[OWN + SHARED :]}
        fed.register(names, 0, brought)
        fed.checkpoint(codebook, Position(1))
        fed.save_contributions(Contributions(rows), codebook)
        fed = Federation(folder, codebook.fingerprint, PAPER)
        t0 = time.perf_counter()
        chosen = plan(fed, "leaver")
        kept, current = fed.contributions(), fed.checkpoints.codebook()
        t1 = time.perf_counter()
        steps = {n: r.step for n, r in fed.registry.items()}
        new = merged_without(current, kept, chosen, setting, steps)
        new = replace(new, entries={n: replace(e, frozen=True) for n, e in new.entries.items()})
        t2 = time.perf_counter()
        record = Withdrawal("leaver", now(), 1, chosen.removed, chosen.remerged)
        fed.withdraw(record, new)
        t3 = time.perf_counter()
    return {
        "classes": n_classes,
        "read_and_plan_s": round(t1 - t0, 3),
        "merge_again_s": round(t2 - t1, 3),
        "commit_s": round(t3 - t2, 3),
        "total_s": round(t3 - t0, 3),
    }


def per_phase(n_classes: int) -> dict:
    """The kept rows' share of one phase's commit, and of a run's start, at ``n_classes``."""
    codebook = random_codebook(PAPER, n_classes, COMPONENTS)
    names = codebook.names
    rows = site_rows(codebook, names, "site-a", 1)
    with tempfile.TemporaryDirectory() as folder:
        fed = Federation(folder, codebook.fingerprint, PAPER)
        fed.save_contributions(Contributions(rows), codebook)
        fed = Federation(folder, codebook.fingerprint, PAPER)
        t0 = time.perf_counter()
        kept = fed.contributions()
        t1 = time.perf_counter()
        trained = site_rows(codebook, names[:IN_PLAY], "site-a", 2)
        update = ClientUpdate(
            codebook.fingerprint,
            codebook.dims,
            Phase.STAGE2,
            codebook.version,
            tuple(r.of(Phase.STAGE2) for r in trained.values()),
        )
        before = _store_bytes(Path(folder))
        t2 = time.perf_counter()
        fed.save_contributions(kept.merged(Phase.STAGE2, ["site-a"], [update]), codebook)
        t3 = time.perf_counter()
        written = _store_bytes(Path(folder)) - before
    return {
        "classes": n_classes,
        "in_play": IN_PLAY,
        "run_start_read_s": round(t1 - t0, 3),
        "phase_keep_s": round(t3 - t2, 3),
        "phase_bytes_written": written,
    }


def _store_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default="100,1000,10000")
    args = parser.parse_args()
    sizes = [int(c) for c in args.classes.split(",")]
    values = parse({"preset": "tiny"})
    setting = Setting(
        MedianStrategy(),
        BackboneOptions.from_config(values).load("cpu"),  # the merge reads no backbones
        replace(TrainConfig.from_config(values), mixture_components=COMPONENTS),
    )
    out = {
        "machine": platform.platform(),
        "dims": vars(PAPER),
        "components": COMPONENTS,
        "storage": storage(100),  # linear in the classes
        "withdrawal": [withdrawal(n, setting) for n in sizes],
        "per_phase": [per_phase(n) for n in sizes],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
