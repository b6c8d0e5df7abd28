"""Per-class merging: count-weighted averages, mixture reduction by moment matching, frozen rows,
and the streamed merge (order, moments through intermediate reductions, bounded memory)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from codebooks import covariance_diagonal, merge_updates

from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassBank, ClassEntry
from starfed.shared.codebook.merge import (
    POOL_BOUND,
    MergeAccumulator,
    merge_mixtures,
)
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.protocol import Phase


def union_moments(mixtures: list[GaussianMixture]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance diagonal of the count-weighted union, computed independently."""
    total = sum(m.count for m in mixtures)
    mean = sum(m.count / total * m.mean() for m in mixtures)
    second = sum(m.count / total * (covariance_diagonal(m) + m.mean() ** 2) for m in mixtures)
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
    torch.testing.assert_close(covariance_diagonal(merged), covariance, rtol=0, atol=1e-12)


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
def codebook(make_codebook: Callable[..., Codebook]) -> Codebook:
    codebook = make_codebook(n_classes=3, version=4)
    return codebook.set_values({}, freeze=["class_0"])  # version 5, class_0 frozen


def site_bank(make_codebook: Callable[..., Codebook], seed: int) -> ClassBank:
    """What a site trained: other random values for the same classes."""
    return make_codebook(n_classes=3, seed=seed).bank()


def site_update(
    codebook: Codebook, bank: ClassBank, phase: Phase, counts: dict[str, int]
) -> ClientUpdate:
    """An update from a site holding ``counts`` examples of some classes of ``bank``."""
    entries = [
        replace(entry, count=counts[entry.name])
        for entry in bank.entries(list(counts), fields=schema.trained_in(phase))
    ]
    return ClientUpdate(codebook.fingerprint, codebook.dims, phase, codebook.version, entries)


def value(codebook: Codebook, name: str, field: str):
    return codebook[name].values[field]


def test_parameters_are_count_weighted(codebook: Codebook, make_codebook) -> None:
    a, b = site_bank(make_codebook, 1), site_bank(make_codebook, 2)
    updates = [
        site_update(codebook, a, Phase.STAGE2, {"class_1": 10, "class_2": 7}),
        site_update(codebook, b, Phase.STAGE2, {"class_1": 30}),
    ]
    merged = merge_updates(codebook, updates)
    for field in schema.trained_in(Phase.STAGE2):
        expected = (10 * a[field][1] + 30 * b[field][1]) / 40
        torch.testing.assert_close(value(merged, "class_1", field), expected)
        # A class carried by one site takes that site's values exactly.
        assert torch.equal(value(merged, "class_2", field), a[field][2])
    for field in ("prompt", "key", "aligned_head_weight", "aligned_head_bias"):
        for name in codebook.names:
            assert torch.equal(value(merged, name, field), value(codebook, name, field))
    assert [e.count for e in merged.entries.values()] == [codebook["class_0"].count, 40, 7]
    assert merged.version == 6
    assert [e.version for e in merged.entries.values()] == [codebook["class_0"].version, 6, 6]
    wire.decode_codebook(wire.encode(merged))  # a valid codebook


def test_input_codebook_is_not_modified(codebook: Codebook, make_codebook) -> None:
    before = wire.encode(codebook)
    update = site_update(codebook, site_bank(make_codebook, 3), Phase.STAGE1, {"class_1": 5})
    merge_updates(codebook, [update])
    assert wire.encode(codebook) == before


def test_statistics_updates_merge_mixtures(codebook: Codebook, make_codebook) -> None:
    a, b = site_bank(make_codebook, 1), site_bank(make_codebook, 2)
    updates = [
        site_update(codebook, a, Phase.STAGE1_STATS, {"class_1": 10}),
        site_update(codebook, b, Phase.STAGE1_STATS, {"class_1": 30}),
    ]
    merged = merge_updates(codebook, updates)
    sites = [a["clip_mixture"][1], b["clip_mixture"][1]]
    expected = merge_mixtures(sites)
    result = value(merged, "class_1", "clip_mixture")
    assert torch.equal(result.means, expected.means)
    mean, _ = union_moments(sites)
    torch.testing.assert_close(result.mean(), mean, rtol=0, atol=1e-12)
    assert value(merged, "class_1", "vit_mixture") is value(codebook, "class_1", "vit_mixture")
    for field in schema.TENSORS:
        assert torch.equal(value(merged, "class_1", field), value(codebook, "class_1", field))


def test_frozen_rows_are_ignored(
    codebook: Codebook, make_codebook, caplog: pytest.LogCaptureFixture
) -> None:
    site = site_bank(make_codebook, 9)
    update = site_update(codebook, site, Phase.STAGE2, {"class_0": 50, "class_1": 5})
    stats = site_update(codebook, site, Phase.STAGE2_STATS, {"class_0": 50})
    with caplog.at_level(logging.INFO, logger="starfed.shared.codebook.merge"):
        merged = merge_updates(codebook, [update, stats])
    assert "class_0" in caplog.text
    assert merged["class_0"] is codebook["class_0"]
    assert merged.frozen == {"class_0"}
    assert torch.equal(value(merged, "class_1", "head_weight"), site["head_weight"][1])


def test_no_updates_only_bumps_the_version(codebook: Codebook) -> None:
    merged = merge_updates(codebook, [])
    assert merged.version == codebook.version + 1
    assert all(merged[n] is codebook[n] for n in codebook.names)


# --- streaming (MergeAccumulator) ----------------------------------------------------------------


def mixture_update(codebook: Codebook, mixtures: dict[str, GaussianMixture]) -> ClientUpdate:
    """A stage-1 statistics update carrying ``mixtures`` (class -> G_c), counts from them."""
    entries = [ClassEntry(name, m.count, {"clip_mixture": m}) for name, m in mixtures.items()]
    return ClientUpdate(
        codebook.fingerprint, codebook.dims, Phase.STAGE1_STATS, codebook.version, entries
    )


def random_site_mixtures(
    make_mixture: Callable[..., GaussianMixture], dim: int, n: int, seed: int
) -> list[GaussianMixture]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 6, (n,), generator=generator).tolist()
    return [make_mixture(dim, generator, n_components=k) for k in sizes]


def test_streamed_tensor_sums_do_not_depend_on_order(codebook: Codebook, make_codebook) -> None:
    """Any order gives the float64 count-weighted average rounded to float32 (1 ulp)."""
    banks = [site_bank(make_codebook, seed) for seed in range(40)]
    counts = [1 + 37 * seed % 101 for seed in range(40)]
    updates = [
        site_update(codebook, bank, Phase.STAGE2, {"class_1": c, "class_2": c + 1})
        for bank, c in zip(banks, counts, strict=True)
    ]
    forward = merge_updates(codebook, updates)
    backward = merge_updates(codebook, updates[::-1])
    shuffled = merge_updates(codebook, [updates[i] for i in torch.randperm(40).tolist()])
    for field in schema.trained_in(Phase.STAGE2):
        weights = torch.tensor(counts, dtype=torch.float64)
        rows = torch.stack([bank[field][1].double() for bank in banks])
        exact = (torch.tensordot(weights, rows, dims=1) / weights.sum()).float()
        for merged in (forward, backward, shuffled):
            result = value(merged, "class_1", field)
            torch.testing.assert_close(result, exact, rtol=2**-23, atol=1e-30)
    assert forward["class_2"].count == sum(counts) + 40


def test_streamed_mixtures_keep_moments_through_reductions(
    make_codebook, make_mixture: Callable[..., GaussianMixture]
) -> None:
    """A bound of 8 components forces a reduction every few sites: the union's mean and
    diagonal covariance survive all of them."""
    codebook = make_codebook(n_classes=2)
    dim = codebook.dims.d_clip
    sites = random_site_mixtures(make_mixture, dim, 60, seed=3)
    accumulator = MergeAccumulator(codebook, n_components=3, bound=8)
    for mixture in sites:
        accumulator.add(mixture_update(codebook, {"class_1": mixture}))
    merged = accumulator.result()["class_1"].values["clip_mixture"]
    assert merged.n_components == 3
    assert merged.count == sum(m.count for m in sites)
    assert float(merged.weights.sum()) == pytest.approx(1.0, abs=1e-12)
    assert (merged.variances > 0).all()
    mean, covariance = union_moments(sites)
    torch.testing.assert_close(merged.mean(), mean, rtol=0, atol=1e-10)
    torch.testing.assert_close(covariance_diagonal(merged), covariance, rtol=0, atol=1e-10)


def test_streamed_mixtures_below_the_bound_are_one_merge(
    make_codebook, make_mixture: Callable[..., GaussianMixture]
) -> None:
    """Up to ``POOL_BOUND`` components a class's mixture is ``merge_mixtures`` of all sites."""
    codebook = make_codebook(n_classes=2)
    sites = random_site_mixtures(make_mixture, codebook.dims.d_clip, 40, seed=4)
    assert sum(m.n_components for m in sites) <= POOL_BOUND
    merged = merge_updates(codebook, [mixture_update(codebook, {"class_1": m}) for m in sites])
    result, expected = value(merged, "class_1", "clip_mixture"), merge_mixtures(sites)
    for part in ("weights", "means", "variances"):
        assert torch.equal(getattr(result, part), getattr(expected, part))


def test_accumulator_memory_does_not_grow_with_updates(
    codebook: Codebook, make_codebook, make_mixture: Callable[..., GaussianMixture]
) -> None:
    dims, bound = codebook.dims, 16
    tensors = MergeAccumulator(codebook)
    mixtures = MergeAccumulator(codebook, bound=bound)
    bank = site_bank(make_codebook, 1)
    sites = random_site_mixtures(make_mixture, dims.d_clip, 400, seed=5)
    held = []
    for i, mixture in enumerate(sites):
        tensors.add(site_update(codebook, bank, Phase.STAGE2, {"class_1": 3, "class_2": 4}))
        mixtures.add(mixture_update(codebook, {"class_1": mixture, "class_2": mixture}))
        held.append(mixtures.nbytes)
        if i == 0:
            first = tensors.nbytes
    assert tensors.nbytes == first  # one float64 sum per class and field, from the first update
    # at most a full pool plus one site's mixture per class (weights, means and variances)
    limit = 2 * (bound + 5) * (2 * dims.d_clip + 1) * 8
    assert max(held) <= limit < sum(m.means.nbytes + m.variances.nbytes for m in sites)
