"""Differential privacy of what a site releases: the accountant, the mechanisms, the budget.

The accountant is dp-accounting's, so its ε is checked against the library called directly (and
against its PLD accountant, which an RDP bound may not undercut); the noise a release gets
follows the budget left; the budget lives in the site's state folder; and in-process
federations (the real ServerApp and ClientApp through ``LocalGrid``, as in test_protocol.py)
show a private run within its budget and a site at its budget refusing while the federation
goes on. With the setting off nothing changes: the protocol tests and the default simulation's
codebook (docs/results.md#differential-privacy) cover that.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from starfed.client import app as client_app
from starfed.client.memory import SiteMemory
from starfed.client.ops.site_options import SiteOptions
from starfed.client.privacy import PrivacySetting, PrivateReleases
from starfed.server.app import run_server
from starfed.server.folder_files import CODEBOOK_FILE
from starfed.shared.codebook import wire
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.config import parse
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.data.site_folder import class_key
from starfed.shared.privacy import accountant
from starfed.shared.privacy.accountant import Release, Sampling
from starfed.shared.privacy.mechanisms import MOMENTS_SENSITIVITY, private_gaussian
from starfed.shared.protocol import BUDGET_EXHAUSTED, PRIVACY_EPSILON, Phase
from starfed.simulations import grid as grids
from starfed.simulations.local_grid import LocalGrid
from starfed.simulations.simulated_sites import SimulatedSites

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = [pytest.mark.privacy, pytest.mark.usefixtures("one_torch_thread")]

DELTA = 1e-5
#: What the accountant composes a class's releases at: the half of δ not spent on announcing.
RELEASE_DELTA = DELTA / 2
CONFIG = {
    "preset": "tiny",
    "num-tasks": 2,
    "classes-per-task": 2,
    "seed": 1993,
    "alpha": 100.0,  # both sites hold every class
    "stage1-epochs": 1,
    "stage2-epochs": 1,
    "replay1-epochs": 1,
    "replay2-epochs": 1,
    "timeout-s": 5,
    "privacy-epsilon": 4.0,
}
_run_ids = itertools.count(5000)


def setting(epsilon: float = 4.0, rounds: int = 1) -> PrivacySetting:
    return PrivacySetting(epsilon, DELTA, 0.4, 1.0, 0.02, 0.05, rounds, rounds)


def memory(path: Path) -> SiteMemory:
    return SiteMemory(path, "fingerprint", ModelDims(8, 8, 8, 1))


# --- the accountant -----------------------------------------------------------------------------


@pytest.mark.parametrize("z,k", [(1.0, 1), (2.5, 5), (9.0, 13)])
def test_epsilon_is_dp_accountings_own(z, k):
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), k)
    library = RdpAccountant(accountant.ORDERS).compose(event).get_epsilon(DELTA)
    assert accountant.epsilon([z] * k, DELTA) == pytest.approx(library, rel=1e-9)
    # its integer orders claim at most a little more than the library's default orders
    default = RdpAccountant().compose(event).get_epsilon(DELTA)
    assert default <= library <= default * 1.01
    # The PLD accountant is tighter: the RDP bound never claims less privacy loss than it.
    tight = PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(DELTA)
    assert tight <= library * 1.001


@pytest.mark.parametrize("z,rate,steps", [(1.0, 0.25, 8), (1.4, 0.1, 30), (3.0, 1.0, 2)])
def test_dp_sgd_steps_are_dp_accountings_poisson_sampled_gaussians(z, rate, steps):
    """A DP-SGD release is its steps, each a Gaussian on a Poisson sample: the library's event,
    composed after the Gaussians before it; sampling amplifies (less ε than full batches)."""
    sampled = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z))
    event = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(2.0), dp_accounting.SelfComposedDpEvent(sampled, steps)]
    )
    library = RdpAccountant(accountant.ORDERS).compose(event).get_epsilon(DELTA)
    releases = [Release(2.0), Release(z, Sampling(rate, steps))]
    assert accountant.epsilon(releases, DELTA) == pytest.approx(library, rel=1e-9)
    whole = accountant.epsilon([Release(2.0), *[Release(z)] * steps], DELTA)
    assert accountant.epsilon(releases, DELTA) <= whole * (1 + 1e-9)
    if rate < 1:
        assert accountant.epsilon(releases, DELTA) < whole
    # a ledger keeps it as [z, rate, steps], and reads it back
    assert Release.from_json(releases[1].to_json()) == releases[1]
    z_planned = accountant.noise_multiplier([Release(2.0)], [Sampling(rate, steps)], 8.0, DELTA)
    assert z_planned is not None
    spent = accountant.epsilon([Release(2.0), Release(z_planned, Sampling(rate, steps))], DELTA)
    assert 8.0 * 0.999 <= spent <= 8.0


def test_calibrated_noise_spends_exactly_the_budget():
    for target in (1.0, 4.0, 8.0):
        z = accountant.noise_multiplier([], 5, target, DELTA)
        assert target * 0.999 <= accountant.epsilon([z] * 5, DELTA) <= target
        # then the budget is exhausted: the next release cannot be afforded
        assert accountant.noise_multiplier([z] * 5, 1, target, DELTA) is None


def test_noise_follows_the_budget():
    z = {eps: accountant.noise_multiplier([], 5, eps, DELTA) for eps in (1.0, 4.0, 8.0)}
    assert z[1.0] > z[4.0] > z[8.0]
    # what was spent before leaves less: the same releases need more noise
    spent = accountant.noise_multiplier([z[8.0]], 4, 4.0, DELTA)
    assert spent > z[4.0]
    # and more planned releases share the budget: each one noisier
    assert accountant.noise_multiplier([], 10, 4.0, DELTA) > z[4.0]


def test_released_gaussian_noise_has_the_calibrated_scale():
    """All features at the centre: the released mean is the noise alone, of standard deviation
    z·√2·R/n per coordinate (below the projection's reach)."""
    n, dim, radius, z = 50, 16, 2.0, 1.5
    features = torch.zeros(n, dim)
    rng = np.random.default_rng(0)
    means = torch.stack(
        [
            private_gaussian(features, torch.zeros(dim), radius, n, z, rng).means[0]
            for _ in range(400)
        ]
    )
    expected = z * MOMENTS_SENSITIVITY * radius / n
    assert means.std().item() == pytest.approx(expected, rel=0.05)


def test_released_gaussian_is_plausible_under_heavy_noise():
    """Noise far above the signal still gives what the wire accepts and clipped data can
    have: a mean inside the ball, positive variances that together fit in it."""
    features = torch.randn(5, 32) * 10
    centre, radius = torch.ones(32), 3.0
    mixture = private_gaussian(features, centre, radius, 5, 50.0, np.random.default_rng(1))
    assert mixture.count == 5 and mixture.weights.tolist() == [1.0]
    assert float((mixture.means[0] - centre.double()).norm()) <= radius * (1 + 1e-9)
    assert (mixture.variances > 0).all()
    assert float(mixture.variances.sum()) <= radius**2 * (1 + 1e-9)


# --- the budget in the site's memory ------------------------------------------------------------


def test_budget_survives_a_restart_and_another_federation(tmp_path):
    private = PrivateReleases(setting(), memory(tmp_path), torch.zeros(8))
    entries, refused = private.counts({"Apple scab": 120})
    assert refused == [] and entries[0].count >= 1
    spent = private.epsilon()
    assert 0 < spent < 4.0
    restarted = memory(tmp_path)  # a new process reads the same state folder
    restarted.join("another-federation")
    again = PrivateReleases(setting(), restarted, torch.zeros(8))
    assert again.epsilon() == spent
    # the count was released once: the sync reuses it, spending nothing more
    entries_again, refused_again = again.counts({"Apple scab": 120})
    assert [(e.name, e.count) for e in entries_again] == [("Apple scab", entries[0].count)]
    assert refused_again == []
    assert again.epsilon() == spent


def test_class_at_its_budget_is_trained_but_not_shared(tmp_path):
    site = memory(tmp_path)
    private = PrivateReleases(setting(), site, torch.zeros(8))
    private.counts({"a": 100, "b": 100})  # enough to clear the announcing threshold
    z = accountant.noise_multiplier([], 5, 4.0, RELEASE_DELTA)
    with site.updating_ledger() as ledger:
        ledger.releases["a"] = [Release(z)] * 5  # a spent its whole budget
    restarted = PrivateReleases(setting(), memory(tmp_path), torch.zeros(8))
    # a training release moves both classes: refused for both
    plan = restarted.plan(["a", "b"], Phase.STAGE1, 0)
    assert plan == {"a": None, "b": None}
    values = {"prompt": torch.zeros(8)}
    entries = [ClassEntry("a", 10, values), ClassEntry("b", 10, values)]
    shared, metadata = restarted.release(Phase.STAGE1, entries, plan)
    assert shared == []
    assert metadata[BUDGET_EXHAUSTED] == "a,b"
    assert float(metadata[PRIVACY_EPSILON]) == pytest.approx(4.0, rel=1e-3)
    # statistics of b depend on b's images only: b still shares them
    stats = restarted.plan(["a", "b"], Phase.STAGE1_STATS, 0)
    assert stats["a"] is None and stats["b"] is not None


def test_a_release_planned_from_a_ledger_that_changed_is_refused(tmp_path):
    """Two processes of one site plan the same class's release from one ledger: the first to
    record it releases, the second is refused at recording (plan and record are one step of
    the filter), so the class's budget never pays twice for one plan."""
    first, second = (PrivateReleases(setting(), memory(tmp_path), torch.zeros(8)) for _ in "ab")
    first.counts({"a": 100})
    plans = [p.plan(["a"], Phase.STAGE1_STATS, 0) for p in (first, second)]
    features, labels = torch.randn(100, 8), torch.zeros(100, dtype=torch.int64)
    for private, plan in zip((first, second), plans, strict=True):
        private.mixture_fit(Phase.STAGE1_STATS, ["a"], plan)(features, labels, [0], 1, 0)
    assert plans[0]["a"] is not None and plans[1]["a"] is None  # the second: trained, kept
    assert len(first.memory.ledger().releases["a"]) == 2  # the count, then one G_c


def test_setting_comes_from_the_node_before_the_run():
    run = parse({"privacy-epsilon": 8.0})
    assert PrivacySetting.of(parse({}), parse({}, "node-config")) is None
    assert PrivacySetting.of(run, parse({}, "node-config")).epsilon == 8.0
    node = parse({"privacy-epsilon": 2.0, "privacy-delta": 1e-6}, "node-config")
    own = PrivacySetting.of(run, node)
    assert (own.epsilon, own.delta) == (2.0, 1e-6)


def test_site_start_puts_its_own_target_in_the_node_config(tmp_path):
    options = SiteOptions(
        "127.0.0.1:9092", tmp_path, tmp_path / "state", "clinic", privacy=(2.0, 1e-6)
    )
    node = parse(options.node_config(), "node-config")
    own = PrivacySetting.of(parse({}), node)
    assert (own.epsilon, own.delta) == (2.0, 1e-6)
    off = SiteOptions("127.0.0.1:9092", tmp_path, tmp_path / "state", "clinic")
    assert "privacy-epsilon" not in off.node_config()


def test_privacy_grid_sweeps_epsilon_over_the_default_scenario():
    grid = grids.load("privacy")
    assert grid.seeds == (1993, 1996, 1997) and grid.methods == ("starfed",)
    assert [s.values["privacy-epsilon"] for s in grid.scenarios] == [0.0, 8.0, 4.0, 1.0]
    default = grids.load("default").scenarios[0].values
    for scenario in grid.scenarios:  # the default scenario otherwise
        assert {k: v for k, v in scenario.values.items() if k != "privacy-epsilon"} == {
            k: v for k, v in default.items() if k != "privacy-epsilon"
        }


# --- federations --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("site-cache")


def run(cache_dir: Path, results: Path, prepare=None) -> tuple[dict, Path]:
    config = {**CONFIG, "num-sites": 2, "results-dir": str(results), "run-name": "run"}
    nodes = {
        i + 1: {"partition-id": i, "num-partitions": 2, "cache-dir": str(cache_dir)}
        for i in range(2)
    }
    grid = LocalGrid(client_app.app, config, nodes, run_id=next(_run_ids))
    if prepare is not None:
        prepare(results / "run" / "sites")
    sites = SimulatedSites.of(config, grid.run_id)
    return run_server(grid, config, grid.run_id, before_step=sites), results / "run"


def test_private_federation_stays_within_its_budget(cache_dir, tmp_path):
    metrics, run_dir = run(cache_dir, tmp_path)
    assert metrics["status"] == "completed"
    assert {e["status"] for e in metrics["exchanges"]} == {"ok"}
    epsilon = metrics["privacy_epsilon"]
    assert set(epsilon) == {"site-0", "site-1"}
    # every class made its five planned releases: the budget is spent, and not exceeded
    assert all(3.99 <= value <= 4.0 for value in epsilon.values())
    codebook = wire.read_file(run_dir / CODEBOOK_FILE, fingerprint=metrics["backbone_fingerprint"])
    assert len(codebook.names) == 4
    for entry in codebook.entries.values():
        for name in ("clip_mixture", "vit_mixture"):  # merged from one Gaussian per site
            assert entry.values[name].n_components <= 2
    # a restart reads the ledger: every class's budget is spent, so nothing more is released
    state = run_dir / "sites" / "site-0" / "state"
    restarted = PrivateReleases(setting(), memory(state), torch.zeros(8))
    assert restarted.epsilon() == pytest.approx(epsilon["site-0"], abs=1e-5)
    names = list(codebook.names)
    assert set(restarted.plan(names, Phase.STAGE2_STATS, 0).values()) == {None}


def test_site_at_its_budget_refuses_and_the_federation_goes_on(cache_dir, tmp_path):
    """site-0 spent its budget on every class before: it syncs with the counts it released
    then, refuses every release, and the server records refusals while site-1 trains."""
    z = accountant.noise_multiplier([], 5, CONFIG["privacy-epsilon"], RELEASE_DELTA)
    keys = [class_key(p.name) for p in (bundled_dataset_root() / "train").iterdir()]

    def exhaust(sites: Path) -> None:
        site = memory(sites / "site-0" / "state")
        with site.updating_ledger() as ledger:
            ledger.releases = {key: [Release(z)] * 5 for key in keys}
            ledger.counts = dict.fromkeys(keys, 20)

    metrics, run_dir = run(cache_dir, tmp_path, exhaust)
    assert metrics["status"] == "completed", metrics["reason"]
    assert metrics["steps"] == 2
    refused = {
        (e["phase"], e["status"].split(":")[0])
        for e in metrics["exchanges"]
        if e["site"] == "site-0"
    }
    # the stage-1 statistics travel with stage 1's message: one exchange refuses both
    assert refused == {
        ("sync", "ok"),
        ("evaluate", "ok"),
        ("stage1", "refused"),
        ("stage2", "refused"),
        ("stage2_stats", "refused"),
    }
    assert all(
        "privacy budget exhausted" in e["status"]
        for e in metrics["exchanges"]
        if e["status"].startswith("refused")
    )
    assert {e["status"] for e in metrics["exchanges"] if e["site"] == "site-1"} == {"ok"}
    assert metrics["privacy_epsilon"]["site-0"] <= CONFIG["privacy-epsilon"]
    assert math.isclose(
        metrics["privacy_epsilon"]["site-0"],
        accountant.epsilon([z] * 5, RELEASE_DELTA),
        rel_tol=1e-5,
    )
    # the classes were learnt from site-1 alone: four classes, frozen
    codebook = wire.read_file(run_dir / CODEBOOK_FILE, fingerprint=metrics["backbone_fingerprint"])
    assert len(codebook.frozen) == 4


@pytest.mark.slow  # a real site six times, and 10⁸ audit runs per world: 45 s at load 5
def test_the_audit_through_a_site_flags_broken_releases_and_not_the_site():
    """bench/privacy_audit_site.py: the honest release is never flagged, and each broken one
    (features summed unclipped; a quarter of the noise) is, at some ε (docs/results.md)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    import privacy_audit_site

    assert privacy_audit_site.main([]) == 0
