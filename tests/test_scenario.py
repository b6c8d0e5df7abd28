"""The federated scenario on the bundled dataset: partitions, task streams, local test sets."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from starfed.client.answer import simulated_site_dir
from starfed.shared.config import parse
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.data.site_folder import SiteFolder, class_key
from starfed.simulations.simulated_sites import SimulatedSites


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return Scenario(ScenarioConfig())


def _mean_site_entropy(scenario: Scenario) -> float:
    """Mean (over tasks and non-empty sites) entropy of a site's class distribution."""
    entropies = []
    for task in range(scenario.n_tasks):
        for row in scenario.class_counts(task):
            if row.sum() == 0:
                continue
            p = row[row > 0] / row.sum()
            entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


def _counts_by_folder(scenario: Scenario) -> dict[str, list[int]]:
    """Per-site training counts of each class folder (independent of the label order)."""
    out = {}
    for task in range(scenario.n_tasks):
        counts = scenario.class_counts(task)
        for col, label in enumerate(scenario.split.task_labels(task)):
            out[scenario.split.class_folders[label]] = counts[:, col].tolist()
    return out


@pytest.mark.parametrize("sites", [5, 1000])  # 1000: more sites than images in a task
def test_train_partitions_are_disjoint_and_cover_each_task(sites: int) -> None:
    scenario = Scenario(ScenarioConfig(n_sites=sites))
    for task in range(scenario.n_tasks):
        expected = scenario.split.samples("train", [task])
        parts = [scenario.train_samples(c, task) for c in range(scenario.n_sites)]
        merged = [s for part in parts for s in part]
        assert len(merged) == len(set(merged)) == len(expected)
        assert set(merged) == set(expected)
        order = {s: i for i, s in enumerate(expected)}
        for part in parts:
            assert [order[s] for s in part] == sorted(order[s] for s in part)
        counts = scenario.class_counts(task)
        assert counts.shape == (scenario.n_sites, scenario.split.classes_per_task)
        assert counts.sum(axis=1).tolist() == [len(p) for p in parts]


@pytest.mark.parametrize("sites", [2, 5, 1000])
def test_a_simulated_patient_is_at_one_site(sites: int) -> None:
    """The partition is drawn over patients: each patient's images at one site (a patient is
    one hospital's), every image of the task at one site."""
    scenario = Scenario(ScenarioConfig(n_sites=sites, patient_images=5))
    for task in (0, scenario.n_tasks - 1):
        samples = scenario.split.samples("train", [task])
        patients = scenario._patients(samples)
        holder = {}
        for site in range(sites):
            for path, _ in scenario.train_samples(site, task):
                assert holder.setdefault(patients[path], site) == site, patients[path]
        assert sum(len(scenario.train_samples(c, task)) for c in range(sites)) == len(samples)
        assert len(holder) == len(set(patients.values())) > len(samples) // 5


def test_one_site_sees_exactly_the_single_site_data() -> None:
    single = Scenario(ScenarioConfig(n_sites=1, alpha=0.1))
    for task in range(single.n_tasks):
        assert single.train_samples(0, task) == single.split.samples("train", [task])
    tasks = [0, 3, 6]
    assert single.test_samples(0, tasks) == single.split.samples("test", tasks)


def test_small_alpha_skews_class_mixes_more_than_large_alpha() -> None:
    skewed = _mean_site_entropy(Scenario(ScenarioConfig(alpha=0.1)))
    even = _mean_site_entropy(Scenario(ScenarioConfig(alpha=100.0)))
    assert even > np.log(4) - 0.05  # near-uniform over the 4 classes of a task
    assert skewed < even - 0.5


def test_partition_is_deterministic_and_seed_sensitive(scenario: Scenario) -> None:
    again = Scenario(ScenarioConfig())
    for task in range(scenario.n_tasks):
        for c in range(scenario.n_sites):
            assert again.train_samples(c, task) == scenario.train_samples(c, task)
            assert again.test_samples(c, [task]) == scenario.test_samples(c, [task])
    other = Scenario(ScenarioConfig(seed=1996))
    assert other.split.class_folders != scenario.split.class_folders
    # Not just relabelled: the sites' counts of each class folder change with the seed.
    assert _counts_by_folder(other) != _counts_by_folder(scenario)


def test_task_stream_with_asynchronous_arrival() -> None:
    s = Scenario(ScenarioConfig(arrival_offset=1))
    assert s.n_steps == 7 + 4
    assert s.task_at(2, 1) is None
    assert s.task_at(2, 2) == 0
    assert s.task_at(2, 8) == 6
    assert s.task_at(2, 9) is None
    assert s.task_at(0, 0) == 0 and s.task_at(0, 7) is None
    assert s.task_at(4, s.n_steps - 1) == s.n_tasks - 1
    assert [s.task_at(c, 3) for c in range(5)] == [3, 2, 1, 0, None]
    with pytest.raises(ValueError, match=r"site must be in \[0, 5\)"):
        s.task_at(5, 0)


def test_the_simulation_writes_each_site_folder_as_its_stream_arrives(tmp_path: Path) -> None:
    """Before each step every simulated site's data folder holds the tasks its stream reached,
    where the site finds it by its partition; writing a step again changes nothing."""
    s = Scenario(ScenarioConfig(n_tasks=3, classes_per_task=2, n_sites=2, arrival_offset=1))
    write = SimulatedSites(s, tmp_path)

    def tasks(partition: int) -> list[str]:
        return [
            t.name for t in SiteFolder.scan(simulated_site_dir(tmp_path, partition) / "data").tasks
        ]

    write(0)
    assert tasks(0) == ["task-00"] and tasks(1) == []  # site 1 joins one step later
    write(1)
    write(1)
    assert tasks(0) == ["task-00", "task-01"] and tasks(1) == ["task-00"]
    write(s.n_steps + 2)  # after the streams end: every task has arrived
    assert tasks(0) == tasks(1) == ["task-00", "task-01", "task-02"]
    for partition in range(2):
        folder = SiteFolder.scan(simulated_site_dir(tmp_path, partition) / "data")
        for task, t in enumerate(folder.tasks):
            train = {Path(p).resolve() for paths in t.train.values() for p in paths}
            assert train == {Path(p).resolve() for p, _ in s.train_samples(partition, task)}
        test = {Path(p).resolve() for paths in folder.test.values() for p in paths}
        assert test == {Path(p).resolve() for p, _ in s.test_samples(partition, range(3))}
        assert set(folder.test) <= {class_key(n) for t in folder.tasks for n in t.train}


def test_synchronous_stream(scenario: Scenario) -> None:
    assert scenario.n_steps == scenario.n_tasks
    assert all(scenario.task_at(c, 4) == 4 for c in range(scenario.n_sites))


def test_local_test_sets_follow_training_shares(scenario: Scenario) -> None:
    for task in range(scenario.n_tasks):
        counts = scenario.class_counts(task)
        labels = scenario.split.task_labels(task)
        test = scenario.global_test_samples([task])
        parts = [scenario.test_samples(c, [task]) for c in range(scenario.n_sites)]
        merged = [s for part in parts for s in part]
        assert len(merged) == len(set(merged))
        trained = {lab for col, lab in enumerate(labels) if counts[:, col].sum() > 0}
        assert set(merged) == {s for s in test if s[1] in trained}
        for col, label in enumerate(labels):
            n_test = sum(1 for _, lab in test if lab == label)
            share = counts[:, col] / counts[:, col].sum()
            got = np.array([sum(1 for _, lab in p if lab == label) for p in parts])
            assert got[counts[:, col] == 0].sum() == 0
            assert np.all(np.abs(got - n_test * share) < 1)  # largest-remainder rounding


def test_test_samples_keep_split_order_over_several_tasks(scenario: Scenario) -> None:
    tasks = [5, 1, 3]
    order = {s: i for i, s in enumerate(scenario.global_test_samples(tasks))}
    assert scenario.global_test_samples(tasks) == scenario.split.samples("test", tasks)
    for c in range(scenario.n_sites):
        local = scenario.test_samples(c, tasks)
        assert all(s in order for s in local)
        assert [order[s] for s in local] == sorted(order[s] for s in local)
        assert local == [s for t in sorted(tasks) for s in scenario.test_samples(c, [t])]


def test_a_class_without_training_images_gets_no_local_test_images() -> None:
    # alpha = 0.05 leaves most sites without most classes.
    s = Scenario(ScenarioConfig(alpha=0.05))
    counts = s.class_counts(0)
    missing = [(c, lab) for c in range(5) for lab in range(4) if counts[c, lab] == 0]
    assert missing
    for c, lab in missing:
        assert all(label != lab for _, label in s.test_samples(c, [0]))


def test_more_sites_than_images_leave_most_sites_without_a_task() -> None:
    """Past one site per image, the same Dirichlet draw per class, without the partitioner's
    refusal: deterministic, and a site mostly holds one class of a task, or nothing."""
    many = Scenario(ScenarioConfig(n_sites=1000))
    counts = many.class_counts(0)
    holding = counts.sum(axis=1) > 0
    assert 0 < holding.sum() < 500
    assert ((counts[holding] > 0).sum(axis=1) == 1).mean() > 0.8
    again = Scenario(ScenarioConfig(n_sites=1000))
    assert all(many.train_samples(c, 3) == again.train_samples(c, 3) for c in range(1000))
    other_seed = Scenario(ScenarioConfig(n_sites=1000, seed=7))
    assert not (other_seed.class_counts(0) == counts).all()


def test_min_partition_size() -> None:
    s = Scenario(ScenarioConfig(alpha=1.0, min_partition_size=30))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the partitioner warns when it resamples
        for task in range(s.n_tasks):
            assert s.class_counts(task).sum(axis=1).min() >= 30
        impossible = Scenario(ScenarioConfig(min_partition_size=100))  # 5 x 100 > ~320 images
        with pytest.raises(ValueError, match="task 0"):
            impossible.train_samples(0, 0)


def test_from_config_reads_dashed_keys(tmp_path: Path) -> None:
    config = ScenarioConfig.from_config(
        parse(
            {
                "data-root": "",
                "num-tasks": 4,
                "classes-per-task": 0,
                "seed": 1996,
                "num-sites": "3",
                "alpha": 1,
                "arrival-offset": 2,
                "min-partition-size": 5,
            }
        )
    )
    assert config == ScenarioConfig(
        data_root=str(bundled_dataset_root()),
        n_tasks=4,
        classes_per_task=None,
        seed=1996,
        n_sites=3,
        alpha=1.0,
        arrival_offset=2,
        min_partition_size=5,
    )
    assert ScenarioConfig.from_config(parse({})) == ScenarioConfig()
    assert ScenarioConfig.from_config(parse({"classes-per-task": 2})).classes_per_task == 2
    root = str(tmp_path)  # a folder: data-root must exist
    assert ScenarioConfig.from_config(parse({"data-root": root})).data_root == root
