"""A shared class's mixtures under the median merge (issue 43, attack 3): each site's components
pooled by count, except a site's whose mean lies far from the others' (``mixture_distances``),
where three or more sites send the class's mixture: the screen rejects it, a finding against
the site."""

from __future__ import annotations

import pytest
import torch

from starfed.server.field_bounds import PhaseScreen
from starfed.server.records import Exchange
from starfed.server.robust import MIXTURE_OUTLIER, MedianStrategy, mixture_distances
from starfed.server.screening import Screen, ScreeningOptions
from starfed.server.strategy import MeanStrategy, PhaseState
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import DEFAULT_REG, GaussianMixture
from starfed.shared.model.training import TrainConfig
from starfed.shared.protocol import Phase


def _summary(features: torch.Tensor) -> GaussianMixture:
    """One site's statistics of its features: one component, their mean and variance."""
    variances = features.var(0, unbiased=False) + DEFAULT_REG
    return GaussianMixture(
        torch.ones(1, dtype=torch.float64),
        features.mean(0, keepdim=True),
        variances.unsqueeze(0),
        count=len(features),
    )


def _site(generator: torch.Generator, centre: torch.Tensor, count: int) -> GaussianMixture:
    """An honest site's statistics: ``count`` features of the class around ``centre``."""
    noise = torch.randn(count, len(centre), generator=generator, dtype=torch.float64)
    return _summary(centre + 0.3 * noise)


def _statistics(codebook: Codebook, name: str, mixture: GaussianMixture) -> ClientUpdate:
    entry = ClassEntry(name, mixture.count, {"clip_mixture": mixture})
    phase = Phase.STAGE1_STATS
    return ClientUpdate(codebook.fingerprint, codebook.dims, phase, codebook.version, [entry])


def _merged(strategy, codebook: Codebook, name: str, mixtures: list[GaussianMixture]):
    return _merged_updates(
        strategy, codebook, name, [_statistics(codebook, name, m) for m in mixtures]
    )


def _merged_updates(strategy, codebook: Codebook, name: str, updates: list[ClientUpdate]):
    state = PhaseState(0, 0, codebook, (name,), {}, None, TrainConfig())
    return strategy.merge(iter(updates), state)[name]


def _outlying(mixtures: list[GaussianMixture], bound: float = MIXTURE_OUTLIER) -> list[bool]:
    return [far > bound for far in mixture_distances(mixtures)]


def _screened(codebook: Codebook, name: str, mixtures: list[GaussianMixture]):
    """Sites s0, s1, … each sending its mixture of ``name`` (their sync reported its count),
    through the screen of a stage-1 statistics phase: the updates kept, and the findings."""
    screen = Screen(ScreeningOptions(), step=0)
    sites = [f"s{i}" for i in range(len(mixtures))]
    synced = [
        (Exchange(0, "sync", 0, node, site, 0), _sync(codebook, name, m.count))
        for node, (site, m) in enumerate(zip(sites, mixtures, strict=True), start=1)
    ]
    assert len(screen.sync(synced, codebook, {})) == len(sites)
    phase = PhaseScreen(screen, Phase.STAGE1_STATS, 0, codebook)
    updates = [_statistics(codebook, name, m) for m in mixtures]
    for site, update in zip(sites, updates, strict=True):
        phase.observe(site, update)
    phase.decide()
    kept = [phase.apply(site, u) for site, u in zip(sites, updates, strict=True)]
    return [u for u in kept if u is not None], screen.findings


def _sync(codebook: Codebook, name: str, count: int) -> ClientUpdate:
    entries = [ClassEntry(name, count)]
    return ClientUpdate(codebook.fingerprint, codebook.dims, Phase.SYNC, 0, entries)


def _same(a: GaussianMixture, b: GaussianMixture) -> bool:
    return a.count == b.count and all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in ("weights", "means", "variances")
    )


@pytest.mark.adversarial
@pytest.mark.parametrize("honest_sites", [2, 3])
def test_a_far_mixture_of_a_class_three_sites_hold_is_a_finding(make_codebook, honest_sites):
    """m's mean lies 3 × the class's size from the honest sites' (inside ``mixture-bound``,
    1000 ×): with three or more holders the screen rejects it, a finding against m that names
    the class, and the class is the honest sites' pool, with their count."""
    codebook = make_codebook(n_classes=1)
    (name,) = codebook.names
    generator = torch.Generator().manual_seed(0)
    centre = torch.randn(codebook.dims.d_clip, generator=generator, dtype=torch.float64)
    honest = [_site(generator, centre, count) for count in (10, 25, 4)[:honest_sites]]
    far = _site(generator, 4 * centre, 10)
    assert _outlying([*honest, far]) == [False] * honest_sites + [True]
    kept, findings = _screened(codebook, name, [*honest, far])
    (finding,) = findings
    m = f"s{honest_sites}"
    assert (finding.site, finding.name, finding.action) == (m, name, "rejected")
    assert f"over {MIXTURE_OUTLIER:g}" in finding.reason
    got = _merged_updates(MedianStrategy, codebook, name, kept)
    assert _same(
        got.values["clip_mixture"],
        _merged(MeanStrategy, codebook, name, honest).values["clip_mixture"],
    )
    assert got.count == sum(m.count for m in honest)


def test_with_two_holders_nothing_tells_the_far_mixture_apart(make_codebook) -> None:
    """Two holders: the median of two means is no judge of either, so both pass the screen and
    are pooled by count, as the mean strategy pools them."""
    codebook = make_codebook(n_classes=1)
    (name,) = codebook.names
    generator = torch.Generator().manual_seed(1)
    centre = torch.randn(codebook.dims.d_clip, generator=generator, dtype=torch.float64)
    pair = [_site(generator, centre, 10), _site(generator, 4 * centre, 10)]
    kept, findings = _screened(codebook, name, pair)
    assert not findings and len(kept) == 2
    got = _merged_updates(MedianStrategy, codebook, name, kept).values["clip_mixture"]
    assert _same(got, _merged(MeanStrategy, codebook, name, pair).values["clip_mixture"])
    assert got.count == 20


def test_honest_sites_of_any_counts_are_kept() -> None:
    """Sites whose features come from one class are never left out, whatever their counts,
    even at half the bound: 300 draws of 3-8 sites of 1-100 features each, and one site of
    1,000 among sites of one (whose mean the median of the others misses most)."""
    generator = torch.Generator().manual_seed(2)
    centre = torch.randn(16, generator=generator, dtype=torch.float64)
    draws = [
        torch.randint(
            1, 101, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator
        ).tolist()
        for _ in range(300)
    ]
    for counts in [*draws, [1, 1, 1, 1000]]:
        mixtures = [_site(generator, centre, count) for count in counts]
        assert not any(_outlying(mixtures, MIXTURE_OUTLIER / 2)), counts


def test_sites_with_the_same_images_hold_the_others_to_their_features_spread() -> None:
    """Two sites with the same images agree exactly, so the median distance is 0: the scale is
    then the spread of the class's features, which a third honest site's mean is within and a
    far one is not."""
    generator = torch.Generator().manual_seed(3)
    centre = torch.randn(16, generator=generator, dtype=torch.float64)
    same = _site(generator, centre, 12)
    honest, far = _site(generator, centre, 12), _site(generator, 4 * centre, 12)
    assert _outlying([same, same, honest]) == [False, False, False]
    assert _outlying([same, same, far]) == [False, False, True]
