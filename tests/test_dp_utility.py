"""bench/dp_utility.py's data root: reproducible from its seed, each source photo's copies
distinct images of one simulated patient, at one site (docs/results.md, DP at realistic
sizes)."""

from __future__ import annotations

import sys
from pathlib import Path

from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.data.site_folder import file_digests, patient_of

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import dp_utility  # a bench script, not a package

COPIES = 3


def digests(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*.jpg"))
    return dict(zip((str(p.relative_to(root)) for p in files), file_digests(files), strict=True))


def test_the_data_root_is_its_seeds_and_each_copy_a_distinct_image(tmp_path: Path) -> None:
    classes = dp_utility.make_root(tmp_path / "a", 2, COPIES, seed=0)
    again = dp_utility.make_root(tmp_path / "b", 2, COPIES, seed=0)
    dp_utility.make_root(tmp_path / "c", 2, COPIES, seed=1)
    first = digests(tmp_path / "a")
    assert classes == again and first == digests(tmp_path / "b")
    assert digests(tmp_path / "c") != first  # another seed, other classes or copies
    train = {k: v for k, v in first.items() if k.startswith("train/")}
    assert len(set(train.values())) == len(train)  # no two copies the same image
    bundled = len(list((tmp_path / "a" / "test").rglob("*.jpg")))
    assert bundled == 40 and len(train) % COPIES == 0


def test_a_source_photos_copies_are_one_patient_at_one_site(tmp_path: Path) -> None:
    dp_utility.make_root(tmp_path / "d", 2, COPIES, seed=0)
    config = ScenarioConfig(
        data_root=str(tmp_path / "d"), n_tasks=1, n_sites=2, alpha=1e4, patient_images=COPIES
    )
    scenario = Scenario(config)
    for site in range(2):
        scenario.write_site(site, tmp_path / f"site-{site}", config.n_steps)
    sources: dict[tuple[str, str], set[str]] = {}  # (class, source) -> patients, with site
    for site in range(2):
        for image in (tmp_path / f"site-{site}" / "task-00").rglob("*.jpg"):
            source = image.name.split("__", 1)[1].split("-v")[0]
            sources.setdefault((image.parent.name, source), set()).add(
                f"{patient_of(str(image))}@{site}"
            )
    assert sources and all(len(patients) == 1 for patients in sources.values())
