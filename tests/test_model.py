"""The two-level model, its initialisation, the local training loops and the backbone factory."""

from __future__ import annotations

import json

import pytest
import torch
from small_training import small_train

from starfed.shared.codebook import schema
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.metrics import final_average_accuracy, final_forgetting
from starfed.shared.model.backbones import (
    BackboneError,
    create_backbones,
    load_state_dict_file,
    preset_config,
    save_backbones,
)
from starfed.shared.model.features import clip_features
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import learn_task

FAST = small_train(
    stage1_epochs=1, stage2_epochs=1, replay_samples=16, batch_size=8, mixture_components=2
)


@pytest.fixture(scope="module")
def backbones():
    return create_backbones("tiny", seed=0)


def synthetic_task(n_classes: int, per_class: int, first_label: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n_classes * per_class, 3, 64, 64), generator=g).to(torch.uint8)
    labels = torch.arange(first_label, first_label + n_classes).repeat_interleave(per_class)
    return images, labels


def test_backbones_are_frozen_and_fingerprinted(backbones) -> None:
    assert not any(p.requires_grad for p in backbones.parameters())
    assert backbones.dims.n_layers == preset_config("tiny").vit["depth"]
    assert len(backbones.fingerprint) == 64
    assert create_backbones("tiny", seed=0).fingerprint == backbones.fingerprint
    assert create_backbones("tiny", seed=1).fingerprint != backbones.fingerprint


def test_local_weight_files_round_trip(backbones, tmp_path) -> None:
    saved = save_backbones(backbones, tmp_path / "safetensors")
    loaded = create_backbones(
        config_path=saved.config_path,
        clip_weights=saved.clip_weights,
        vit_weights=saved.vit_weights,
    )
    assert loaded.fingerprint == backbones.fingerprint
    # torch files are read with weights_only=True (no pickled code)
    pt = tmp_path / "vit.pt"
    torch.save(backbones.vit.state_dict(), pt)
    assert load_state_dict_file(pt).keys() == backbones.vit.state_dict().keys()
    loaded_pt = create_backbones(
        config_path=saved.config_path, clip_weights=saved.clip_weights, vit_weights=pt
    )
    assert loaded_pt.fingerprint == backbones.fingerprint


def test_wrong_weights_and_configs_are_clear_errors(backbones, tmp_path) -> None:
    saved = save_backbones(backbones, tmp_path)
    with pytest.raises(BackboneError, match="ViT weights do not fit"):
        create_backbones(config_path=saved.config_path, vit_weights=saved.clip_weights)
    with pytest.raises(BackboneError, match="not found"):
        create_backbones(vit_weights=tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "colour": "red"}))
    with pytest.raises(BackboneError, match="unknown backbone config keys"):
        create_backbones(config_path=bad)
    with pytest.raises(BackboneError, match="unknown preset"):
        create_backbones("huge")
    with pytest.raises(BackboneError, match="only applies to the 'paper' preset"):
        create_backbones("tiny", download=True)


def test_class_initialisation_is_deterministic_and_reference_shaped(backbones) -> None:
    a, b = StarPrompt(backbones), StarPrompt(backbones)
    names = ["leaf a", "leaf b", "leaf c"]
    a.add_classes(names, seed=3)
    b.add_classes(names, seed=3)
    for field in schema.TENSORS:
        assert torch.equal(a.bank[field], b.bank[field]), field
    d = backbones.dims
    q, w = a.bank["query_prompt"], a.bank["query_weight"]
    assert q.shape == (3, d.n_layers, d.d_vit) and w.shape == (3, d.n_layers, d.d_clip)
    # A: orthonormal rows per block; Q: index 0 of a [C, 3, d] orthogonal init, so not unit norm
    for layer in range(d.n_layers):
        torch.testing.assert_close(w[:, layer] @ w[:, layer].T, torch.eye(3), atol=1e-5, rtol=0)
    assert (q.norm(dim=-1) < 1).all()
    torch.testing.assert_close(a.bank["key"].norm(dim=-1), torch.ones(3))
    c = StarPrompt(backbones)
    c.add_classes(names, seed=4)
    assert not torch.equal(c.bank["prompt"], a.bank["prompt"])
    with pytest.raises(ValueError, match="already in the bank"):
        a.add_classes(["leaf a"], seed=3)


def test_two_tasks_train_only_current_rows(backbones) -> None:
    """Past classes are frozen: a second task changes none of their rows, only adds its own."""
    torch.manual_seed(0)
    model = StarPrompt(backbones)
    model.add_classes(["a", "b"], seed=0)
    images, labels = synthetic_task(2, 6, 0, seed=1)
    initial = {f: model.bank[f].clone() for f in schema.TENSORS}
    learn_task(model, images, labels, clip_features(backbones, images), 0, 0, FAST)
    for field in ("prompt", "query_prompt", "query_weight", "head_weight"):
        assert not torch.equal(model.bank[field], initial[field]), f"{field} not trained"
    after_first = {f: model.bank[f].clone() for f in schema.TENSORS}
    assert all(isinstance(m, GaussianMixture) for m in model.bank["clip_mixture"])
    assert model.bank.counts == [6, 6]

    model.add_classes(["c", "d"], seed=0)
    images, labels = synthetic_task(2, 6, 2, seed=2)
    learn_task(model, images, labels, clip_features(backbones, images), 2, 1, FAST)
    for field in ("prompt", "key", "query_prompt", "query_weight", "head_weight", "head_bias"):
        assert torch.equal(model.bank[field][:2], after_first[field]), field
    # the head replay realigned every seen row, the real-data head is kept for the next task
    assert not torch.equal(model.bank["aligned_head_weight"], model.bank["head_weight"])
    assert len(model.bank["vit_mixture"]) == 4 and model.bank.counts == [6, 6, 6, 6]


def test_prediction_and_key_ablation(backbones) -> None:
    model = StarPrompt(backbones)
    model.add_classes(["a", "b", "c"], seed=0)
    images, _ = synthetic_task(3, 2, 0, seed=5)
    unit = images.float() / 255
    z = model.backbones.clip_image_features(unit)
    pred = model.predict(unit, z)
    assert pred.logits.shape == (6, 3) and pred.selected.shape == (6, backbones.dims.n_layers)
    by_keys = model.predict(unit, z, use_keys=True)
    assert by_keys.selected.shape == pred.selected.shape  # one per block, as reports count
    assert (by_keys.selected == by_keys.logits.argmax(-1, keepdim=True)).all()


def test_mixture_fit_and_sample() -> None:
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[-5.0, 0.0], [5.0, 2.0]])
    x = torch.cat(
        [
            centres[0] + 0.1 * torch.randn(200, 2, generator=g),
            centres[1] + 0.1 * torch.randn(100, 2, generator=g),
        ]
    )
    mixture = GaussianMixture.fit(x, n_components=2, seed=0)
    assert mixture.count == 300 and mixture.means.dtype == torch.float64
    torch.testing.assert_close(mixture.weights.sum(), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(mixture.mean(), x.double().mean(0), atol=1e-6, rtol=0)
    samples = mixture.sample(4000, torch.Generator().manual_seed(1))
    assert samples.dtype == torch.float32
    torch.testing.assert_close(samples.mean(0), x.mean(0), atol=0.2, rtol=0)
    # fewer points than components still gives statistics, one point gives a point mass
    assert GaussianMixture.fit(x[:3], n_components=5).n_components == 3
    assert GaussianMixture.fit(x[:1]).n_components == 1
    with pytest.raises(ValueError, match="NaN"):
        GaussianMixture.fit(torch.tensor([[float("nan"), 0.0], [1.0, 1.0]]))


def test_accuracy_matrix_metrics() -> None:
    matrix = [[90.0], [80.0, 70.0], [60.0, 65.0, 50.0]]
    assert final_average_accuracy(matrix) == pytest.approx(175 / 3)
    # task 1: best 90 → 60 (30); task 2: best 70 → 65 (5)
    assert final_forgetting(matrix) == pytest.approx(17.5)
    assert final_forgetting([[50.0]]) == 0.0


def test_evaluation_of_an_empty_test_set_is_nan_not_a_crash(backbones) -> None:
    from starfed.shared.model.evaluation import group_scores, score_classes

    model = StarPrompt(backbones)
    model.add_classes(["a", "b"], seed=0)
    empty = torch.zeros(0, 3, 64, 64, dtype=torch.uint8)
    groups = torch.tensor([0, 0])
    counts = score_classes(
        model, empty, torch.zeros(0, dtype=torch.long), torch.zeros(0, 64), groups
    )
    assert counts.images.tolist() == [0, 0]
    scores = group_scores(counts, groups, 1)
    assert len(scores.accuracy) == 1 and scores.accuracy[0] != scores.accuracy[0]  # NaN


def test_scores_count_per_class_and_group(backbones) -> None:
    """Per-class counts add up per group; selection counts one choice per image and block."""
    from starfed.shared.model.evaluation import group_scores, score_classes

    model = StarPrompt(backbones)
    model.add_classes(["a", "b", "c"], seed=0)
    images, rows = synthetic_task(3, 4, 0, seed=3)
    features = clip_features(backbones, images)
    groups = torch.tensor([0, 0, 1])
    counts = score_classes(model, images, rows, features, groups)
    assert counts.images.tolist() == [4, 4, 4]
    assert (counts.selections == 4 * backbones.dims.n_layers).all()
    assert (counts.correct <= counts.images).all()
    true, predicted, images = counts.mistaken.T  # each wrong (true, predicted) pair, once
    pairs = set(zip(true.tolist(), predicted.tolist(), strict=True))
    assert (true != predicted).all() and len(pairs) == len(true)
    wrong = torch.zeros(3, dtype=torch.int64).index_add_(0, true, images)
    assert wrong.tolist() == (counts.images - counts.correct).tolist()
    scores = group_scores(counts, groups, 2)
    expected = 100 * int(counts.correct[:2].sum()) / 8
    assert scores.accuracy[0] == pytest.approx(expected)


def test_paper_preset_builds_offline_with_the_paper_dims() -> None:
    """open_clip ViT-L-14 + timm ViT-B/16 architectures, random weights (no download)."""
    paper = create_backbones("paper")
    assert paper.dims.d_txt == paper.dims.d_clip == paper.dims.d_vit == 768
    assert paper.dims.n_layers == 12 and paper.config.image_size == 224
