"""Replay schedules: the bounded one's work per step does not grow with the federation's age."""

from __future__ import annotations

import pytest
import torch
from small_training import small_train

from starfed.shared.codebook.mixture import GaussianMixture, MixtureStack
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.replay import (
    REFERENCE_TASKS,
    ReplaySchedule,
    ReplayWork,
    balanced_labels,
)
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, replay1, replay2

NEW_PER_STEP = 4
BUDGET1, BUDGET2 = 5, 12
BOUNDED = small_train(
    replay_samples=16,
    replay_batch_size=8,
    replay_schedule=ReplaySchedule.BOUNDED,
    replay1_steps=BUDGET1,
    replay2_steps=BUDGET2,
)


@pytest.fixture(scope="module")
def backbones():
    return create_backbones("tiny", seed=0)


def mixture(dim: int, generator: torch.Generator) -> GaussianMixture:
    weights = torch.rand(2, dtype=torch.float64, generator=generator) + 0.1
    return GaussianMixture(
        weights / weights.sum(),
        torch.randn(2, dim, dtype=torch.float64, generator=generator),
        torch.rand(2, dim, dtype=torch.float64, generator=generator) + 0.1,
        count=10,
    )


def model_at(backbones, step: int) -> tuple[StarPrompt, int]:
    """A model at ``step`` (NEW_PER_STEP classes a step) whose classes all have mixtures."""
    model = StarPrompt(backbones)
    n_classes = NEW_PER_STEP * (step + 1)
    model.add_classes([f"class {i}" for i in range(n_classes)], seed=0)
    generator = torch.Generator().manual_seed(step)
    dims = backbones.dims
    model.bank["clip_mixture"] = [mixture(dims.d_clip, generator) for _ in range(n_classes)]
    model.bank["vit_mixture"] = [mixture(dims.d_vit, generator) for _ in range(n_classes)]
    return model, n_classes - NEW_PER_STEP


def drawn_samples(monkeypatch) -> list[int]:
    """Every sample the replays draw, counted where they are drawn."""
    counts: list[int] = []
    sample = MixtureStack.sample

    def counting(self, labels, generator):
        counts.append(len(labels))
        return sample(self, labels, generator)

    monkeypatch.setattr(MixtureStack, "sample", counting)
    return counts


def test_bounded_work_per_step_does_not_grow_with_t(backbones, monkeypatch) -> None:
    drawn = drawn_samples(monkeypatch)
    work = {}
    for step in (1, 50):
        model, n_past = model_at(backbones, step)
        drawn.clear()
        work[step, 1] = replay1(model, n_past, BOUNDED, step)
        work[step, 2] = replay2(model.bank, n_past, BOUNDED, step)
        assert sum(drawn) == work[step, 1].samples + work[step, 2].samples  # counted honestly
    first = ReplayWork(BUDGET1, BUDGET1 * BOUNDED.replay_batch_size)
    head = ReplayWork(BUDGET2, BUDGET2 * BOUNDED.replay_batch_size)
    # 8 classes at t = 1, 204 at t = 50 (where the reference runs 1 + 50 epochs over each)
    assert work[1, 1] == work[50, 1] == first
    assert work[1, 2] == work[50, 2] == head
    # the reference schedule grows: 1 + t epochs over 16 samples of each of 4 (t + 1) classes
    model, n_past = model_at(backbones, 3)
    reference = TrainConfig(**{**BOUNDED.to_dict(), "replay_schedule": ReplaySchedule.REFERENCE})
    assert replay2(model.bank, n_past, reference, 3).steps == 4 * 16 * 16 // 8


def test_balanced_labels_draw_every_class_equally() -> None:
    labels = balanced_labels(7, 5, torch.Generator().manual_seed(0))
    drawn = torch.cat([next(labels) for _ in range(14)])  # 70 labels: 10 rounds of 7 classes
    assert torch.bincount(drawn, minlength=7).tolist() == [10] * 7


def test_bounded_head_replay_starts_from_the_last_alignment(backbones) -> None:
    """Past rows start aligned (bounded) or from the real-data head (reference); a zero rate
    shows where each starts."""
    model, n_past = model_at(backbones, 2)
    bank = model.bank
    bank["aligned_head_weight"] = bank["head_weight"] + 1.0
    expected = torch.cat([bank["aligned_head_weight"][:n_past], bank["head_weight"][n_past:]])
    still = TrainConfig(**{**BOUNDED.to_dict(), "replay2_lr": 0.0})
    replay2(bank, n_past, still, 2)
    assert torch.equal(bank["aligned_head_weight"], expected)
    reference = TrainConfig(**{**still.to_dict(), "replay_schedule": ReplaySchedule.REFERENCE})
    replay2(bank, n_past, reference, 2)
    assert torch.equal(bank["aligned_head_weight"], bank["head_weight"])


def test_auto_replays_as_the_reference_for_the_papers_tasks_then_bounded(backbones) -> None:
    reference, bounded = ReplaySchedule.REFERENCE, ReplaySchedule.BOUNDED
    tasks = (0, REFERENCE_TASKS - 1, REFERENCE_TASKS, 500)
    assert [ReplaySchedule.AUTO.at(t) for t in tasks] == [reference, reference, bounded, bounded]
    assert [s.at(500) for s in (reference, bounded)] == [reference, bounded]
    auto = TrainConfig(**{**BOUNDED.to_dict(), "replay_schedule": ReplaySchedule.AUTO})
    model, n_past = model_at(backbones, 3)
    assert replay2(model.bank, n_past, auto, 3).steps == 4 * 16 * 16 // 8  # as the reference
    model, n_past = model_at(backbones, REFERENCE_TASKS)
    assert replay2(model.bank, n_past, auto, REFERENCE_TASKS).steps == BUDGET2
    assert replay1(model, n_past, auto, REFERENCE_TASKS).steps == BUDGET1
