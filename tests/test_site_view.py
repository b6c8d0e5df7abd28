"""A site's task view outlives its phase: refreshed by the next codebook, it holds exactly what
a view stacked anew from that codebook holds (so refreshing never moves a number)."""

from __future__ import annotations

from pathlib import Path

import torch
from site_folders import CLASSES, site_folder

from starfed.client.memory import SiteMemory
from starfed.client.site import Site
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.entry import ClassBank
from starfed.shared.config import parse
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import Phase

CONFIG = TrainConfig(stage1_epochs=1, stage2_epochs=1, batch_size=8, mixture_components=1)


def assert_same_bank(a: ClassBank, b: ClassBank) -> None:
    assert a.names == b.names and a.counts == b.counts
    for f in schema.FIELDS:
        if f.kind is schema.Kind.TENSOR:
            assert torch.equal(a[f.name], b[f.name]), f.name
        else:
            assert list(a[f.name]) == list(b[f.name]), f.name  # None: no mixture broadcast


def test_a_refreshed_view_holds_what_a_new_view_stacks(tmp_path: Path) -> None:
    backbones = BackboneOptions.from_config(parse({"preset": "tiny"})).load()
    own, past = CLASSES[0:2], CLASSES[2]
    data = site_folder(tmp_path / "farm", {"task-00": own})
    memory = SiteMemory(tmp_path / "state", backbones.fingerprint, backbones.dims)
    site = Site("farm", data, memory, backbones, CONFIG, tmp_path / "cache")
    model = StarPrompt(backbones)
    codebook = Codebook(backbones.fingerprint, backbones.dims)
    codebook = codebook.register(model.new_entries([past], seed=1))
    codebook = codebook.set_values({}, counts={past: 5}, freeze=[past])
    codebook = codebook.register(model.new_entries(own, seed=2))
    index, task = site.current(site.scan(), codebook.frozen)

    site.run_phase(Phase.STAGE1, codebook, 0)  # trains both own prompts in the view's bank
    view = site._view[1]
    # The server merged: a new prompt for one own class, the other's left as it was sent.
    merged = codebook.set_values({own[0]: {"prompt": torch.full((backbones.dims.d_txt,), 0.5)}})
    site.run_phase(Phase.STAGE1_STATS, merged, 0)  # writes the own rows' CLIP mixtures
    assert site._view[1] is view  # refreshed, not stacked anew

    again = site.view(merged, index, task, False, 0)
    assert again is view
    fresh = merged.bank([past, *own])
    for name in own:
        fresh.counts[fresh.names.index(name)] = view.model.bank.counts[fresh.names.index(name)]
    assert_same_bank(view.model.bank, fresh)
    assert torch.equal(view.model.bank["prompt"][2], merged[own[1]].values["prompt"])

    # Stage 2 sees other sites' current classes as context: another view, stacked anew.
    assert site.view(merged, index, task, True, 0) is view  # no other site's class here
    other = merged.register(model.new_entries([CLASSES[3]], seed=3))
    stage2 = site.view(other, index, task, True, 0)
    assert stage2 is not view and stage2.n_past == 2
