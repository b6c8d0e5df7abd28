"""A lone class cannot be another class under a new name (issue 43, attack 5): ``copies.copies``
names a class in play one site alone holds whose G_c is, within ``COPY_BOUND`` standard errors,
the G_c of another class — any but a lone class another site brings in the same step."""

from __future__ import annotations

import pytest
import torch

from starfed.server.copies import COPY_BOUND, FIELD, copies
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.mixture import GaussianMixture

pytestmark = pytest.mark.adversarial


def _fitted(codebook: Codebook, seed: int) -> GaussianMixture:
    """A mixture fitted on 40 features of one class (a Gaussian of its own spread)."""
    generator = torch.Generator().manual_seed(seed)
    centre = torch.full((codebook.dims.d_clip,), 3.0)
    return GaussianMixture.fit(centre + torch.randn(40, codebook.dims.d_clip, generator=generator))


@pytest.fixture
def codebook(make_codebook) -> Codebook:
    """Four classes; the first three hold the same class's statistics: of_a's fitted on 40
    features, x's the very same (the same images), y's on 40 other features of it."""
    codebook = make_codebook(n_classes=4)
    x, of_a, y, _ = codebook.names
    same = _fitted(codebook, seed=1)
    return codebook.set_values(
        {x: {FIELD: same}, of_a: {FIELD: same}, y: {FIELD: _fitted(codebook, seed=2)}}
    )


def test_a_lone_class_with_another_sites_statistics_is_named(codebook) -> None:
    x, of_a, _, of_b = codebook.names
    holders = {x: {"m"}, of_a: {"a"}, of_b: {"b"}}
    found = copies(codebook, [x], holders)
    assert [(f.name, f.site, f.other) for f in found] == [(x, "m", of_a)]
    assert found[0].distance == 0.0
    assert f"those of {of_a!r} (brought by a): the same images" in found[0].reason


def test_another_sample_of_the_same_class_is_no_copy(codebook) -> None:
    """Two fits of different features of one class lie about 1 standard error apart: an honest
    site's new class of the same kind as another's is not named."""
    _, of_a, y, _ = codebook.names
    assert copies(codebook, [y], {y: {"m"}, of_a: {"a"}}) == []
    mixture = codebook[y].mixture(FIELD)
    other = codebook[of_a].mixture(FIELD)
    error = other.deviation() * (1 / mixture.count + 1 / other.count) ** 0.5
    assert float((mixture.mean() - other.mean()).norm() / error) > 2 * COPY_BOUND


def test_a_copy_of_a_lone_class_another_site_brings_in_the_step_is_not_named(codebook) -> None:
    """Of two lone classes of two sites in one step, nothing tells which is the copy: neither
    is named; a class two sites bring, or one of an earlier step, is the reference."""
    x, of_a, _, _ = codebook.names
    assert copies(codebook, [x, of_a], {x: {"m"}, of_a: {"a"}}) == []
    found = copies(codebook, [x, of_a], {x: {"m"}, of_a: {"a", "b"}})
    assert [(f.name, f.other, f.holders) for f in found] == [(x, of_a, ("a", "b"))]


def test_copies_of_a_class_of_the_same_site_are_named(codebook) -> None:
    """A site's class copying one of its own, or a class it shares, or two of its new classes
    of the same images (attack 5's aimed variant: ten classes of A1's other images): each is
    named — ten names for one class's images crowd the others' images as ten classes would."""
    x, of_a, _, _ = codebook.names
    assert [f.other for f in copies(codebook, [x], {x: {"m"}, of_a: {"a", "m"}})] == [of_a]
    twins = copies(codebook, [x, of_a], {x: {"m"}, of_a: {"m"}})
    assert sorted((f.name, f.other) for f in twins) == sorted([(x, of_a), (of_a, x)])
