"""Each site's kept rows per class (``server.contributions``), and the checkpoints an exact
withdrawal needs, without a federation run."""

from __future__ import annotations

from pathlib import Path

import torch
from codebooks import full_entry
from conftest import FINGERPRINT, TINY_DIMS

from starfed.server.contributions import Contributions
from starfed.server.federation import Federation
from starfed.server.records import StepRecord
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.protocol import Phase

DIMS = TINY_DIMS


def update(phase: Phase, rows: dict[str, float], count: int = 5) -> ClientUpdate:
    """A stage-1 update: each class's prompt filled with ``rows[class]``."""
    entries = [ClassEntry(n, count, {"prompt": torch.full((8,), v)}) for n, v in rows.items()]
    return ClientUpdate(FINGERPRINT, DIMS, phase, 1, tuple(entries))


def test_a_phase_merge_replaces_every_sites_rows_of_its_classes(tmp_path: Path) -> None:
    """What is kept is exactly what the last merge of each class merged: a site that sent
    rows in an attempt and not in the phase run again keeps none of that class."""
    kept = Contributions().merged(
        Phase.STAGE1,
        ["a", "b"],
        [update(Phase.STAGE1, {"x": 1.0, "y": 2.0}), update(Phase.STAGE1, {"x": 3.0})],
    )
    assert kept.holders("x") == ["a", "b"] and kept.holders("y") == ["a"]
    again = kept.merged(Phase.STAGE1, ["a"], [update(Phase.STAGE1, {"x": 4.0}, count=7)])
    assert again.holders("x") == ["a"] and again.holders("y") == ["a"]  # y: not merged again
    assert torch.equal(again.rows["a", "x"].values["prompt"], torch.full((8,), 4.0))
    assert again.rows["a", "x"].counts == {"prompt": 7}
    [entry] = again.updates(Phase.STAGE1, ["x"], Codebook(FINGERPRINT, DIMS))[0].entries
    assert (
        entry.count == 7 and again.updates(Phase.STAGE2, ["x"], Codebook(FINGERPRINT, DIMS)) == []
    )
    # kept in the store: read back as written; a save writes only the rows that changed
    generator = torch.Generator().manual_seed(3)
    like = Codebook(FINGERPRINT, DIMS).register([full_entry(n, DIMS, generator) for n in "xy"])
    federation = Federation(tmp_path, FINGERPRINT, DIMS)
    saved = federation.save_contributions(again, like)
    back = Federation(tmp_path, FINGERPRINT, DIMS).contributions()
    assert set(back.rows) == set(again.rows)
    assert torch.equal(back.rows["a", "x"].values["prompt"], torch.full((8,), 4.0))
    assert saved.without("a").rows == {}


def test_the_checkpoint_before_each_sites_first_step_outlives_checkpoints_kept(
    tmp_path: Path,
) -> None:
    """``checkpoints-kept`` 1: the newest step's codebook is kept, and the one before the
    first step of each site, which an exact withdrawal goes back to."""
    generator = torch.Generator().manual_seed(4)
    federation = Federation(tmp_path, FINGERPRINT, DIMS)
    codebook = Codebook(FINGERPRINT, DIMS)
    for step, site in enumerate(["a", "b", "a", "a"]):
        name = f"class-{step}"
        federation.register([name], step, {name: [site]})
        codebook = codebook.register([full_entry(name, DIMS, generator)])
        federation.begin_step(codebook)
        record = StepRecord(step, "completed", 0.0, 1.0, classes=(name,), sites=(site,))
        codebook = federation.end_step(record, codebook, keep_steps=1)
    kept = [path.name for path in sorted((tmp_path / "checkpoints").glob("step-*.bin"))]
    assert federation.first_steps() == {"a": 0, "b": 1}
    assert kept == ["step-0001.bin", "step-0004.bin"]  # b's first step was the second
