"""Per-class merging: count-weighted averages, mixture reduction by moment matching, frozen rows."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from starfed.shared.codebook.codebook import (
    ClassUpdate,
    ClientUpdate,
    Codebook,
    CodebookError,
    Phase,
)
from starfed.shared.codebook.entry import ClassBank, ModelDims
from starfed.shared.codebook.merge import check_update, merge_mixtures, merge_updates
from starfed.shared.codebook.mixture import GaussianMixture


def union_moments(mixtures: list[GaussianMixture]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance diagonal of the count-weighted union, computed independently."""
    total = sum(m.count for m in mixtures)
    mean = sum(m.count / total * m.mean() for m in mixtures)
    second = sum(m.count / total * (m.covariance_diagonal() + m.mean() ** 2) for m in mixtures)
    return mean, second - mean**2


@pytest.mark.parametrize("seed", range(5))
def test_merge_mixtures_preserves_mean_and_covariance(
    make_mixture: Callable[..., GaussianMixture], seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    mixtures = [make_mixture(7, generator, n_components=k) for k in (5, 3, 5, 1)]
    merged = merge_mixtures(mixtures, n_components=5)
    assert merged.n_components == 5
    assert merged.count == sum(m.count for m in mixtures)
    assert merged.weights.dtype == merged.means.dtype == merged.variances.dtype == torch.float64
    assert float(merged.weights.sum()) == pytest.approx(1.0, abs=1e-12)
    assert (merged.variances > 0).all()
    mean, covariance = union_moments(mixtures)
    torch.testing.assert_close(merged.mean(), mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(merged.covariance_diagonal(), covariance, rtol=0, atol=1e-12)


def test_merge_mixtures_weights_by_count() -> None:
    def point(value: float, count: int) -> GaussianMixture:
        return GaussianMixture(
            torch.ones(1, dtype=torch.float64),
            torch.full((1, 2), value, dtype=torch.float64),
            torch.ones(1, 2, dtype=torch.float64),
            count,
        )

    merged = merge_mixtures([point(0.0, 1), point(10.0, 99)])
    torch.testing.assert_close(merged.weights, torch.tensor([0.01, 0.99], dtype=torch.float64))
    torch.testing.assert_close(merged.mean(), torch.full((2,), 9.9, dtype=torch.float64))


def test_merge_mixtures_small_union_is_kept_and_single_is_identity(
    make_mixture: Callable[..., GaussianMixture],
) -> None:
    generator = torch.Generator().manual_seed(0)
    one = make_mixture(4, generator, n_components=3)
    same = merge_mixtures([one])
    assert torch.equal(same.weights, one.weights)
    assert torch.equal(same.means, one.means)
    assert torch.equal(same.variances, one.variances)
    two = merge_mixtures([one, make_mixture(4, generator, n_components=2)])
    assert two.n_components == 5


def test_merge_mixtures_of_identical_sites(make_mixture: Callable[..., GaussianMixture]) -> None:
    """Fewer distinct means than components: no empty clusters, the mixture comes back."""
    one = make_mixture(4, torch.Generator().manual_seed(1), n_components=3)
    merged = merge_mixtures([one, one, one], n_components=5)
    assert merged.n_components == 3
    assert merged.count == 3 * one.count
    order = torch.argsort(merged.means[:, 0])
    reference = torch.argsort(one.means[:, 0])
    torch.testing.assert_close(merged.means[order], one.means[reference])
    torch.testing.assert_close(merged.variances[order], one.variances[reference])
    torch.testing.assert_close(merged.weights[order], one.weights[reference])


def test_merge_mixtures_is_deterministic(make_mixture: Callable[..., GaussianMixture]) -> None:
    generator = torch.Generator().manual_seed(2)
    mixtures = [make_mixture(6, generator, n_components=5) for _ in range(4)]
    a, b = merge_mixtures(mixtures), merge_mixtures(mixtures)
    assert torch.equal(a.means, b.means) and torch.equal(a.variances, b.variances)


def test_merge_mixtures_rejects_mismatched_dims(
    make_mixture: Callable[..., GaussianMixture],
) -> None:
    generator = torch.Generator()
    with pytest.raises(ValueError, match="dimensions"):
        merge_mixtures([make_mixture(3, generator), make_mixture(4, generator)])
    with pytest.raises(ValueError, match="at least one"):
        merge_mixtures([])


# --- merge_updates -------------------------------------------------------------------------------


@pytest.fixture
def codebook(make_bank: Callable[..., ClassBank], fingerprint: str) -> Codebook:
    return Codebook.from_bank(make_bank(n_classes=3), fingerprint, version=4, frozen={"class_0"})


def site_update(
    codebook: Codebook,
    bank: ClassBank,
    phase: Phase,
    counts: dict[str, int],
) -> ClientUpdate:
    """An update from a site holding ``counts`` examples of some classes of ``bank``."""
    update = ClientUpdate.from_bank(
        bank,
        fingerprint=codebook.fingerprint,
        phase=phase,
        base_version=codebook.version,
        classes=list(counts),
    )
    for entry in update.entries:
        entry.count = counts[entry.name]
    return update


def test_parameters_are_count_weighted(
    codebook: Codebook, make_bank: Callable[..., ClassBank]
) -> None:
    a, b = make_bank(n_classes=3, seed=1), make_bank(n_classes=3, seed=2)
    updates = [
        site_update(codebook, a, Phase.STAGE2, {"class_1": 10, "class_2": 7}),
        site_update(codebook, b, Phase.STAGE2, {"class_1": 30}),
    ]
    merged = merge_updates(codebook, updates)
    for field_name in ("query_prompts", "query_weights", "head_weight", "head_bias"):
        expected = (10 * getattr(a, field_name)[1] + 30 * getattr(b, field_name)[1]) / 40
        torch.testing.assert_close(getattr(merged.bank, field_name)[1], expected)
        # A class carried by one site takes that site's values exactly.
        assert torch.equal(getattr(merged.bank, field_name)[2], getattr(a, field_name)[2])
    for field_name in ("prompts", "keys", "aligned_head_weight", "aligned_head_bias"):
        assert torch.equal(getattr(merged.bank, field_name), getattr(codebook.bank, field_name))
    assert merged.bank.counts == [codebook.bank.counts[0], 40, 7]
    assert merged.version == 5
    assert merged.bank.versions == [codebook.bank.versions[0], 5, 5]
    merged.validate()


def test_input_codebook_is_not_modified(
    codebook: Codebook, make_bank: Callable[..., ClassBank]
) -> None:
    before = codebook.to_bytes()
    update = site_update(codebook, make_bank(seed=3), Phase.STAGE1, {"class_1": 5, "class_3": 2})
    merge_updates(codebook, [update])
    assert codebook.to_bytes() == before


def test_statistics_updates_merge_mixtures(
    codebook: Codebook, make_bank: Callable[..., ClassBank]
) -> None:
    a, b = make_bank(n_classes=3, seed=1), make_bank(n_classes=3, seed=2)
    updates = [
        site_update(codebook, a, Phase.STAGE1_STATS, {"class_1": 10}),
        site_update(codebook, b, Phase.STAGE1_STATS, {"class_1": 30}),
    ]
    merged = merge_updates(codebook, updates)
    sites = [a.clip_mixtures[1], b.clip_mixtures[1]]
    expected = merge_mixtures(sites)
    result = merged.bank.clip_mixtures[1]
    assert torch.equal(result.means, expected.means)
    mean, _ = union_moments(sites)
    torch.testing.assert_close(result.mean(), mean, rtol=0, atol=1e-12)
    assert torch.equal(merged.bank.vit_mixtures[1].means, codebook.bank.vit_mixtures[1].means)
    for field_name in ClassBank.TENSOR_FIELDS:
        assert torch.equal(getattr(merged.bank, field_name), getattr(codebook.bank, field_name))


def test_new_classes_are_appended_in_order_of_appearance(
    codebook: Codebook, make_bank: Callable[..., ClassBank]
) -> None:
    site = make_bank(n_classes=2, seed=5, prefix="new")
    sync = site_update(codebook, site, Phase.SYNC, {"new_1": 4, "new_0": 6})
    stage1 = site_update(codebook, site, Phase.STAGE1, {"new_0": 2})
    merged = merge_updates(codebook, [sync, stage1])
    assert merged.bank.names == ["class_0", "class_1", "class_2", "new_1", "new_0"]
    assert merged.bank.counts[3:] == [4, 8]
    assert merged.bank.versions[3:] == [5, 5]
    # new_0's prompt comes from the only update carrying it; parts nobody sent start at zero.
    assert torch.equal(merged.bank.prompts[4], site.prompts[0])
    assert not merged.bank.prompts[3].any()
    assert not merged.bank.query_prompts[3:].any()
    assert merged.bank.clip_mixtures[3:] == [None, None]
    Codebook.from_bytes(merged.to_bytes())  # a sync-registered class is a valid entry


def test_frozen_rows_are_ignored(
    codebook: Codebook,
    make_bank: Callable[..., ClassBank],
    caplog: pytest.LogCaptureFixture,
) -> None:
    site = make_bank(n_classes=3, seed=9)
    update = site_update(codebook, site, Phase.STAGE2, {"class_0": 50, "class_1": 5})
    stats = site_update(codebook, site, Phase.STAGE2_STATS, {"class_0": 50})
    with caplog.at_level(logging.INFO, logger="starfed.shared.codebook.merge"):
        merged = merge_updates(codebook, [update, stats])
    assert "class_0" in caplog.text
    for field_name in ClassBank.TENSOR_FIELDS:
        assert torch.equal(
            getattr(merged.bank, field_name)[0], getattr(codebook.bank, field_name)[0]
        )
    assert torch.equal(merged.bank.vit_mixtures[0].means, codebook.bank.vit_mixtures[0].means)
    assert merged.bank.counts[0] == codebook.bank.counts[0]
    assert merged.bank.versions[0] == codebook.bank.versions[0]
    assert merged.frozen == {"class_0"}
    assert torch.equal(merged.bank.head_weight[1], site.head_weight[1])  # the rest is merged


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda u: setattr(u, "fingerprint", "cd" * 32), "fingerprint"),
        (lambda u: setattr(u, "dims", ModelDims(8, 6, 10, 3)), "dims"),
        (lambda u: setattr(u, "base_version", 3), "stale"),
        (lambda u: u.entries[0].tensors["head_weight"].fill_(float("nan")), "NaN"),
        (lambda u: u.entries[0].tensors.__setitem__("head_weight", torch.zeros(3)), "shape"),
        (lambda u: setattr(u.entries[0], "count", 0), "count"),
        (lambda u: u.entries.append(ClassUpdate("class_1", 1)), "twice"),
        (lambda u: u.entries[0].tensors.__setitem__("bogus", torch.zeros(1)), "unknown fields"),
    ],
)
def test_one_invalid_update_merges_nothing(
    codebook: Codebook,
    make_bank: Callable[..., ClassBank],
    spoil: Callable[[ClientUpdate], None],
    reason: str,
) -> None:
    good = site_update(codebook, make_bank(seed=1), Phase.STAGE2, {"class_2": 3})
    bad = site_update(codebook, make_bank(seed=2), Phase.STAGE2, {"class_1": 3})
    spoil(bad)
    check_update(codebook, good)
    with pytest.raises(CodebookError, match=reason):
        check_update(codebook, bad)
    with pytest.raises(CodebookError, match=reason):
        merge_updates(codebook, [good, bad])


def test_no_updates_only_bumps_the_version(codebook: Codebook) -> None:
    merged = merge_updates(codebook, [])
    assert merged.version == codebook.version + 1
    assert merged.bank.versions == codebook.bank.versions
