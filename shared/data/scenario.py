"""The federated Split CropDiseases scenario: which images each simulated site holds, and when.

Every site learns the same task sequence (local task ``t`` holds the classes of global task ``t``
of the split), but each task's training images are spread over the sites by a Dirichlet
distribution over classes (flwr-datasets' :class:`DirichletPartitioner`), so sites see skewed
class mixes. Sites may join late: site ``i`` starts its stream ``i * arrival_offset`` global steps
after site 0, so sites in different tasks share rounds. Each site's test set follows its own
class mix; the global test set (the split's) is what the server scores in simulation.

Partitions are computed per task on first use and kept on the instance, so building a scenario
only scans the dataset folder. A simulation's server process holds the one scenario of its run
and writes every simulated site's folder from it (``starfed.simulations.simulated_sites``); the
sites read only their folders.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from flwr_datasets.partitioner import DirichletPartitioner

from starfed.shared.config import Options, knob
from starfed.shared.data.cropdiseases import SplitCropDiseases, dataset_root
from starfed.shared.data.site_folder import patient_name
from starfed.shared.knob import optional

Sample = tuple[str, int]


@dataclass(frozen=True)
class ScenarioConfig(Options):
    """What defines a federated scenario; equal configs give identical partitions."""

    data_root: str = knob("data-root", dataset_root)  # "": the bundled set
    n_tasks: int = knob("num-tasks")
    classes_per_task: int | None = knob("classes-per-task", optional)  # None: spread evenly
    seed: int = knob("seed")  # class order and partition
    n_sites: int = knob("num-sites")
    alpha: float = knob("alpha")  # Dirichlet concentration: small = each site sees few classes
    arrival_offset: int = knob("arrival-offset")  # site i starts i * offset steps after site 0
    min_partition_size: int = knob("min-partition-size")  # per task, for every site
    patient_images: int = knob("simulated-patient-images")  # 0: images without patients

    @property
    def n_steps(self) -> int:
        """Global steps until the last-arriving site has finished its last task."""
        return self.n_tasks + (self.n_sites - 1) * self.arrival_offset


def _task_seed(seed: int, task: int) -> int:
    """Independent partition seed per task, so adding tasks never reshuffles earlier ones."""
    return int(np.random.SeedSequence([seed, task]).generate_state(1)[0])


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Split ``total`` items in proportion to integer ``weights``; exact, ties to lower index.

    A zero weight always gets zero: the ``total - sum(floors)`` extras go to the largest
    remainders, and fewer extras exist than positive remainders.
    """
    denominator = int(weights.sum())
    if denominator == 0:
        return np.zeros_like(weights)
    floors, remainders = np.divmod(total * weights, denominator)
    extra = total - int(floors.sum())
    floors[np.argsort(-remainders, kind="stable")[:extra]] += 1
    return floors


class Scenario:
    """The images of every simulated site for every task, and the task streams."""

    def __init__(self, config: ScenarioConfig) -> None:
        self.config = config
        self.split = SplitCropDiseases.from_root(
            config.data_root,
            n_tasks=config.n_tasks,
            classes_per_task=config.classes_per_task,
            seed=config.seed,
        )
        self._train: dict[int, list[list[Sample]]] = {}  # task -> per-site samples
        self._test: dict[int, list[list[Sample]]] = {}
        self._counts: dict[int, np.ndarray] = {}

    @property
    def n_sites(self) -> int:
        return self.config.n_sites

    @property
    def n_tasks(self) -> int:
        return self.split.n_tasks

    @property
    def n_steps(self) -> int:
        return self.config.n_steps

    def task_at(self, site: int, step: int) -> int | None:
        """The site's local task at a global step; None before it joins or after it ends."""
        task = step - self._check_site(site) * self.config.arrival_offset
        return task if 0 <= task < self.n_tasks else None

    def train_samples(self, site: int, task: int) -> list[Sample]:
        """The site's share of ``task``'s training images, in ``split.samples`` order."""
        return list(self._train_partition(task)[self._check_site(site)])

    def test_samples(self, site: int, tasks: Iterable[int]) -> list[Sample]:
        """The site's local test images of ``tasks``, in ``split.samples`` order.

        Each class's test images are shared out in proportion to the sites' training images of
        that class, so a site is tested on the class mix it trained on.
        """
        site = self._check_site(site)
        out: list[Sample] = []
        for task in sorted(set(tasks)):  # tasks hold consecutive labels: this keeps split order
            out.extend(self._test_partition(task)[site])
        return out

    def global_test_samples(self, tasks: Iterable[int]) -> list[Sample]:
        """Every test image of ``tasks`` (what the server scores in simulation)."""
        return self.split.samples("test", tasks)

    def class_counts(self, task: int) -> np.ndarray:
        """Training images per site and class of ``task``: int ``[n_sites, classes]``."""
        if task not in self._counts:
            first = self.split.task_labels(task)[0]
            counts = np.zeros((self.n_sites, self.split.classes_per_task), dtype=np.int64)
            for site, samples in enumerate(self._train_partition(task)):
                for _, label in samples:
                    counts[site, label - first] += 1
            self._counts[task] = counts
        return self._counts[task].copy()

    def write_site(self, site: int, data_dir: str | os.PathLike[str], step: int) -> None:
        """Fill a simulated site's data folder as a deployed site's would look at ``step``.

        Each task that has arrived by ``step`` is a folder ``task-NN/<class>/`` of links to the
        site's training images, and ``test/<class>/`` links to its test images of those tasks
        (docs/sites.md); a task folder appears whole (written aside, then renamed), so the site
        code that reads it is the deployed site's. Idempotent.
        """
        root = Path(data_dir)
        root.mkdir(parents=True, exist_ok=True)  # a site that has not joined yet: no tasks
        latest = self.task_at(site, step)
        if latest is None and step >= site * self.config.arrival_offset:
            latest = self.n_tasks - 1  # the stream has ended: every task has arrived
        for task in range(0 if latest is None else latest + 1):
            target = root / f"task-{task:02d}"
            if not target.exists():
                staging = root / f".{target.name}.tmp"
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)  # an empty task is still a task folder
                samples = self.train_samples(site, task)
                _write_class_folders(staging, samples, self.split, self._patient_names(samples))
                staging.rename(target)
            # test images of a class appear with its task
            _write_class_folders(root / "test", self.test_samples(site, [task]), self.split)

    def _patient_names(self, samples: list[Sample]) -> dict[str, str]:
        """Link names that say each image's simulated patient (none when 0)."""
        patients = self._patients(samples)
        return {path: patient_name(patients[path], path) for path, _ in samples if path in patients}

    def _patients(self, samples: list[Sample]) -> dict[str, str]:
        """Every run of ``patient_images`` consecutive training images of a class (in
        ``split.samples`` order) is one simulated patient's, a patient of one class only (none
        when 0): the patient of each of ``samples``."""
        k = self.config.patient_images
        if not k:
            return {}
        first: dict[int, int] = {}
        for i, (_, label) in enumerate(self.split.train_samples):
            first.setdefault(label, i)
        rank = {path: i - first[label] for i, (path, label) in enumerate(self.split.train_samples)}
        return {path: f"c{label:02d}p{rank[path] // k:04d}" for path, label in samples}

    def _check_site(self, site: int) -> int:
        if not 0 <= site < self.n_sites:
            raise ValueError(f"site must be in [0, {self.n_sites}), got {site}")
        return site

    def _train_partition(self, task: int) -> list[list[Sample]]:
        """Each site's images of ``task``. A simulated patient's images go to one site together
        (a patient is one hospital's), so the partition is drawn over units — patients, or
        images without them — each standing for its images (``min-partition-size`` then
        counts patients)."""
        if task not in self._train:
            samples = self.split.samples("train", [task])
            patients = self._patients(samples)
            units: dict[str, list[int]] = {}  # unit -> its images' indices in samples
            for i, (path, _) in enumerate(samples):
                units.setdefault(patients.get(path, path), []).append(i)
            heads = [samples[images[0]] for images in units.values()]  # one sample per unit
            members = list(units.values())
            self._train[task] = [
                [samples[i] for i in sorted(i for u in part for i in members[u])]
                for part in self._unit_partition(task, heads)
            ]
        return self._train[task]

    def _unit_partition(self, task: int, units: list[Sample]) -> list[list[int]]:
        """Which of ``units`` (indices, each site's sorted) each site holds."""
        if self.n_sites >= len(units) and not self.config.min_partition_size:
            return self._sparse_partition(task, units)
        partitioner = DirichletPartitioner(
            num_partitions=self.n_sites,
            partition_by="label",
            alpha=self.config.alpha,
            min_partition_size=self.config.min_partition_size,
            self_balancing=False,
            shuffle=False,  # the order is restored below anyway
            seed=_task_seed(self.config.seed, task),
        )
        partitioner.dataset = datasets.Dataset.from_dict(
            {"index": list(range(len(units))), "label": [label for _, label in units]}
        )
        try:
            return [sorted(partitioner.load_partition(c)["index"]) for c in range(self.n_sites)]
        except ValueError as err:  # too few images, or min_partition_size never met
            raise ValueError(f"cannot partition task {task}: {err}") from err

    def _sparse_partition(self, task: int, samples: list[Sample]) -> list[list[int]]:
        """A Dirichlet partition over at least as many sites as there are images, which
        flwr-datasets' ``DirichletPartitioner`` refuses: its algorithm — per class, shares
        drawn from Dir(alpha) over the sites, the class's shuffled images cut at their
        cumulative sums — without that check, so most sites hold no image of the task (a
        site then brings nothing to its step). Smaller scenarios keep the partitioner's."""
        rng = np.random.default_rng(_task_seed(self.config.seed, task))
        labels = np.array([label for _, label in samples])
        parts: list[list[int]] = [[] for _ in range(self.n_sites)]
        for label in np.unique(labels):
            indices = np.flatnonzero(labels == label)
            rng.shuffle(indices)
            shares = rng.dirichlet(np.full(self.n_sites, self.config.alpha))
            cuts = (np.cumsum(shares) * len(indices)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(indices, cuts), strict=True):
                part.extend(chunk.tolist())
        return [sorted(part) for part in parts]

    def _test_partition(self, task: int) -> list[list[Sample]]:
        if task not in self._test:
            counts = self.class_counts(task)
            parts: list[list[Sample]] = [[] for _ in range(self.n_sites)]
            by_label: dict[int, list[Sample]] = {}
            for sample in self.split.samples("test", [task]):
                by_label.setdefault(sample[1], []).append(sample)
            for col, label in enumerate(self.split.task_labels(task)):
                images = by_label.get(label, [])
                # A seeded shuffle, so a site's share does not follow the file-name order.
                rng = np.random.default_rng([self.config.seed, label])
                order = rng.permutation(len(images))
                sizes = _largest_remainder(len(images), counts[:, col])
                bounds = np.concatenate([[0], np.cumsum(sizes)])
                for site in range(self.n_sites):
                    chosen = np.sort(order[bounds[site] : bounds[site + 1]])
                    parts[site].extend(images[i] for i in chosen)
            self._test[task] = parts
        return self._test[task]


def _write_class_folders(
    parent: Path,
    samples: list[Sample],
    split: SplitCropDiseases,
    names: dict[str, str] | None = None,
) -> None:
    """``parent/<class>/<file>`` links to ``samples`` (named as ``names`` says, else as their
    files); each class folder is written aside and renamed into place, so a reader never sees
    half of one. Existing class folders are kept."""
    by_class: dict[str, list[str]] = {}
    for path, label in samples:
        by_class.setdefault(split.class_folders[label], []).append(path)
    for name, paths in by_class.items():
        target = parent / name
        if target.exists():
            continue
        staging = parent / f".{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for path in paths:
            (staging / (names or {}).get(path, Path(path).name)).symlink_to(Path(path).resolve())
        staging.rename(target)
