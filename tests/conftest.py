"""Shared fixtures: small random codebooks with tiny dims for codebook and merge tests, and
what in-process federation runs need around them (one torch thread, the site cache emptied);
and each test's tier (``TIERS``)."""

from __future__ import annotations

import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from xdist.scheduler import LoadScopeScheduling

from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.schema import ModelDims

TINY_DIMS = ModelDims(d_txt=8, d_clip=6, d_vit=10, n_layers=2)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the processes the tests start. A suite started in the background
    (``make test &``) inherits SIGINT ignored, and an ignored signal stays ignored in every
    child; a handler is reset to the default at exec, so the children can be interrupted."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A worker keeps torch's default threads: a test that compares an in-process run with the
    # same run in fresh processes (test_e2e_resume) needs the same reductions bit for bit, and
    # one thread in the worker against the processes' default changed them.


#: The test tiers (docs/start-here.md#one-test-of-each-kind), by module: a module not named here
#: is ``unit``, and a test marked ``e2e`` is end to end wherever it lives. A ``slow`` test is in
#: no quick loop: the unit tier leaves it out (``make test`` leaves out every one).
TIERS = {
    "meta": (
        "test_layers",
        "test_sizes",
        "test_design_doc",
        "test_doc_links",
        "test_retired_words",
        "test_proto_generated",
    ),
    "inprocess": (
        "test_adversarial",
        "test_adversarial_accuracy",
        "test_adversarial_alone",
        "test_adversarial_sites",
        "test_baselines",
        "test_big_step",
        "test_catch_up",
        "test_dashboard",
        "test_equivalence",
        "test_experiment",
        "test_faults",
        "test_federation",
        "test_gpu",
        "test_inference",
        "test_local_runtime",
        "test_paper_dims",
        "test_privacy",
        "test_protocol",
        "test_release_record",
        "test_resume",
        "test_server_status",
        "test_site_policy",
        "test_site_returns",
        "test_train_local",
        "test_withdrawal",
    ),
    "e2e": (
        "test_adversarial_decode",
        "test_adversarial_site_data",
        "test_deploy_operator",
        "test_e2e_catch_up",
        "test_flower_runs",
        "test_locks",
        "test_wheel",
    ),
}
TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}

#: The tiers from the longest tests to the shortest. ``make test TEST_WORKERS=n`` hands whole
#: groups to its workers in collection order (``--dist loadgroup --no-loadscope-reorder``), so a
#: module of the longest tier goes first: a long module started last would leave the other
#: workers idle at the end.
LONGEST_FIRST = ("e2e", "inprocess", "meta", "unit")

#: The modules whose tests start Flower's SuperLink and SuperNodes (a deployment, a Flower
#: simulation): with pytest-xdist they are one group (``PROCESSES``), run one after another on
#: one worker, handed out first. Two deployments started side by side on 2 cores missed their
#: start-up deadlines (120 s) where each alone meets them (bench/results/test_suite.md). Every
#: other module is a group of its own, run whole on one worker (a module fixture built once),
#: its end-to-end tests included: they start lighter processes (a gateway, a refused ``site
#: start``, a wheel's venv, a gRPC server), as an in-process module does.
DEPLOYMENTS = (
    "test_deploy_e2e",
    "test_e2e_catch_up",
    "test_e2e_federation",
    "test_e2e_flwr",
    "test_e2e_resume",
    "test_e2e_server_run",
    "test_e2e_site_lost",
    "test_e2e_site_policy",
    "test_ray_cluster",
)
PROCESSES = "processes"


def group_of(nodeid: str) -> str:
    """A test's xdist group, from its id (``tests/test_x.py::test_y[...]``): ``PROCESSES`` or
    its module."""
    module = Path(nodeid.split("::", 1)[0]).stem
    return PROCESSES if module in DEPLOYMENTS else module


class ModuleGroups(LoadScopeScheduling):
    """``--dist loadgroup`` with the groups of :func:`group_of`. xdist's own reads the
    ``xdist_group`` marks through the test's id, which pytest 9 no longer lets it change
    (xdist 3.8 sets ``item._nodeid``, which pytest 9's ``nodeid`` does not read): every test
    was a group of its own, deployments ran side by side and a module fixture was built on
    each worker."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ModuleGroups | None:
    """Our groups for ``--dist loadgroup``; xdist's own scheduler for any other mode."""
    return ModuleGroups(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets its tier's marker, so that one tier is one ``-m``; ``PROCESSES`` first,
    its modules of fewest tests (a whole run each) first, then the modules in ``LONGEST_FIRST``
    order of their longest tier. xdist gives a worker more work once 2 of its tests are left,
    so the one running ``PROCESSES`` takes more only near its end; with
    ``--no-loadscope-reorder`` it hands the groups out in this order."""
    rank: dict[Path, int] = {}
    for item in items:
        tier = "e2e" if item.get_closest_marker("e2e") else TIER_OF.get(item.path.stem, "unit")
        if tier != "unit" or not item.get_closest_marker("slow"):
            item.add_marker(tier)
        rank[item.path] = min(rank.get(item.path, len(LONGEST_FIRST)), LONGEST_FIRST.index(tier))
    size = Counter(item.path for item in items)

    def order(item: pytest.Item) -> tuple[int, int]:
        if group_of(item.nodeid) == PROCESSES:
            return (-1, size[item.path])
        return (rank[item.path], 0)

    items.sort(key=order)  # stable: a module's tests stay together


FINGERPRINT = "ab" * 32


def random_mixture(dim: int, generator: torch.Generator, n_components: int = 3) -> GaussianMixture:
    weights = torch.rand(n_components, generator=generator, dtype=torch.float64) + 0.1
    return GaussianMixture(
        weights=weights / weights.sum(),
        means=torch.randn(n_components, dim, generator=generator, dtype=torch.float64),
        variances=torch.rand(n_components, dim, generator=generator, dtype=torch.float64) + 0.1,
        count=int(torch.randint(5, 50, (), generator=generator)),
    )


def random_entries(
    dims: ModelDims = TINY_DIMS,
    n_classes: int = 4,
    seed: int = 0,
    prefix: str = "class",
    mixtures: bool = True,
) -> list[ClassEntry]:
    """Entries whose every value is random (counts >= 1, versions 0..2, optional mixtures)."""
    generator = torch.Generator().manual_seed(seed)
    entries = []
    for i in range(n_classes):
        values = {}
        for f in schema.FIELDS:
            if f.kind is schema.Kind.TENSOR:
                values[f.name] = torch.randn(f.shape(dims), generator=generator)
            elif mixtures:
                values[f.name] = random_mixture(f.shape(dims)[0], generator)
        entries.append(ClassEntry(f"{prefix}_{i}", 10 + i, values, version=i % 3))
    return entries


def random_codebook(
    dims: ModelDims = TINY_DIMS, n_classes: int = 4, seed: int = 0, **codebook_fields
) -> Codebook:
    entries = random_entries(dims, n_classes, seed)
    codebook_fields.setdefault("version", 2)
    return Codebook(FINGERPRINT, dims, {e.name: e for e in entries}, **codebook_fields)


@pytest.fixture(scope="session")
def make_entries() -> Callable[..., list[ClassEntry]]:
    """Factory: ``make_entries(dims=..., n_classes=..., seed=..., prefix=..., mixtures=...)``."""
    return random_entries


@pytest.fixture(scope="session")
def make_codebook() -> Callable[..., Codebook]:
    """Factory for random codebooks (fingerprint ``FINGERPRINT``, version 2 by default)."""
    return random_codebook


@pytest.fixture(scope="session")
def make_mixture() -> Callable[..., GaussianMixture]:
    """Factory for random mixtures: ``make_mixture(dim, generator, n_components=3)``."""
    return random_mixture


@pytest.fixture(scope="session")
def tiny_dims() -> ModelDims:
    return TINY_DIMS


@pytest.fixture(scope="session")
def fingerprint() -> str:
    return FINGERPRINT


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module's federation runs: they are tiny, and on a shared 2-core
    machine two threads contending with other processes made a module 3-6x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def forget_sites() -> Iterator[None]:
    """Empty the ClientApp's process-wide cache of sites (``answer.SITES``) once a module is
    done, so that its sites hold no memory after it. For memory only: the cache's keys hold
    what each site was built from, so no run ever gets a site another run built."""
    yield
    answer = sys.modules.get("starfed.client.answer")  # most test modules never build a site
    if answer is not None:
        answer.SITES.clear()
