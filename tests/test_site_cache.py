"""A process builds each site once and keeps the ones it used last; a site is keyed by what it
was built from, so a second run under the same ids but another config never gets the first's."""

from __future__ import annotations

from pathlib import Path

from site_folders import CLASSES, site_folder

from starfed.client import answer
from starfed.client.answer import SiteCache, SiteKey


def test_a_run_with_the_same_ids_and_another_config_gets_a_site_of_its_own(tmp_path: Path):
    data = site_folder(tmp_path / "farm", {"t1": CLASSES[0:2]})
    node = {"data-dir": str(data), "site-name": "farm", "cache-dir": str(tmp_path / "cache")}
    run = {"preset": "tiny", "stage1-epochs": 1}
    first = answer.site_for(1, 3, run, node)
    assert answer.site_for(1, 3, dict(reversed(run.items())), dict(node)) is first  # reused
    second = answer.site_for(1, 3, {**run, "stage1-epochs": 2}, node)
    assert second is not first
    assert (first.config.stage1_epochs, second.config.stage1_epochs) == (1, 2)
    moved = answer.site_for(1, 3, run, {**node, "state-dir": str(tmp_path / "elsewhere")})
    assert moved.memory.root == tmp_path / "elsewhere" and first.memory.root != moved.memory.root


def test_the_cache_keeps_the_sites_used_last() -> None:
    built: list[int] = []

    def build(node: int):
        def site() -> str:
            built.append(node)
            return f"site of node {node}"

        return site

    sites = SiteCache(kept=2)
    get = {n: (SiteKey.of(1, n, {}, {}), build(n)) for n in (1, 2, 3)}
    for n in (1, 2, 1, 3):  # node 1 used again before 3 comes: node 2 is the oldest
        assert sites.get(*get[n]) == f"site of node {n}"
    assert built == [1, 2, 3]
    assert sites.get(*get[1]) == "site of node 1" and built == [1, 2, 3]  # kept
    assert sites.get(*get[2]) == "site of node 2" and built == [1, 2, 3, 2]  # built again
