"""``STARFED_FUSED_ADAM``: stage 2 with the fused Adam (a GPU option, off by default) trains the
same rows as the default on the CPU, to float32 rounding over two Adam steps."""

from __future__ import annotations

import pytest
import torch

from starfed.shared.codebook import schema
from starfed.shared.model import training
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.protocol import Phase


def stage2_rows(backbones, fused: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("STARFED_FUSED_ADAM", "1" if fused else "0")
    model = StarPrompt(backbones)
    model.add_classes(["a", "b"], seed=0)
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (8, 3, 64, 64), generator=g).to(torch.uint8)
    labels = torch.arange(2).repeat_interleave(4)
    config = training.TrainConfig(stage2_epochs=1, batch_size=4, seed=0)
    training.stage2(training.TaskTraining(model, labels, 0, config, task=0), images)
    return {name: model.bank[name].clone() for name in schema.trained_in(Phase.STAGE2)}


def test_fused_adam_trains_what_the_default_does(monkeypatch: pytest.MonkeyPatch) -> None:
    backbones = create_backbones("tiny", seed=0)
    default = stage2_rows(backbones, False, monkeypatch)
    fused = stage2_rows(backbones, True, monkeypatch)
    initial = StarPrompt(backbones)
    initial.add_classes(["a", "b"], seed=0)
    for name, value in default.items():
        assert not torch.equal(value, initial.bank[name]), f"{name} not trained"
        torch.testing.assert_close(fused[name], value, atol=1e-5, rtol=1e-5, msg=name)
