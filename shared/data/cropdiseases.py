"""Split CropDiseases (PlantVillage) for class-incremental learning, as STAR-Prompt uses it.

Follows the authors' mammoth ``datasets/seq_cropdisease.py``: the three classes the paper leaves out
are dropped, the sorted (ImageFolder-order) class folders are permuted with
``np.random.RandomState(seed).permutation(n_classes)`` and the permuted position is the global
label, so task ``t`` holds labels ``[t * cpt, (t + 1) * cpt)``.

A root is either pre-split (``train/<class>/*`` and ``test/<class>/*``, like the bundled
``cropdiseases-mini``) or one ImageFolder (``<class>/*``, like a raw PlantVillage download). The
latter is split per class with a fixed seed (:data:`SPLIT_SEED`, independent of the class-order
seed), so the paper's seeds 1993/1996/1997 change the task order but never the test images.

Decoding, caching and augmenting the images: ``starfed.shared.data.images``.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from starfed.shared.data.images import IMAGE_EXTENSIONS, DatasetError

PAPER_DROPPED_CLASSES: tuple[str, ...] = (
    "Potato___healthy",
    "Apple___Cedar_apple_rust",
    "Peach___healthy",
)

#: Seed of the per-class train/test split of an unsplit root (mixed with each folder name).
SPLIT_SEED = 0

# The reference's label names shorten these PlantVillage prefixes; the text feeds CLIP prompts.
_TEXT_PREFIXES = {"Cherry_(including_sour)___": "Cherry___", "Corn_(maize)___": "Corn___"}
_TEXT_NAMES = {"Corn_(maize)___Common_rust_": "Corn___Common_rust"}


def bundled_dataset_root() -> Path:
    """Path of the small real dataset shipped with the package (offline tests and demos)."""
    return (Path(__file__).parent / "datasets" / "cropdiseases-mini").resolve()


def dataset_root(configured: str = "") -> str:
    """The folder a ``data-root`` setting names: "" is the bundled set."""
    return configured or str(bundled_dataset_root())


def class_name_to_text(folder_name: str) -> str:
    """Class text as the reference writes it: its label name with every ``_`` made a space."""
    name = _TEXT_NAMES.get(folder_name, folder_name)
    for prefix, short in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            name = short + name[len(prefix) :]
            break
    return name.replace("_", " ")


def _class_dirs(folder: Path) -> dict[str, Path]:
    """Visible subfolders by name (hidden ones such as ``.ipynb_checkpoints`` are not classes)."""
    return {p.name: p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}


def _image_files(class_dir: Path) -> list[str]:
    """Sorted image paths in one class folder; an empty class is an error, not a silent gap."""
    files = sorted(
        str(p)
        for p in class_dir.iterdir()
        if p.is_file() and p.name.lower().endswith(IMAGE_EXTENSIONS)
    )
    if not files:
        raise DatasetError(
            f"class folder {class_dir} holds no images ({'/'.join(IMAGE_EXTENSIONS)})"
        )
    return files


def _split_class(
    folder: str, files: list[str], test_fraction: float
) -> tuple[list[str], list[str]]:
    """Seeded split of one class; seeded per folder name so it ignores which other classes exist."""
    order = np.random.RandomState(zlib.crc32(f"{SPLIT_SEED}:{folder}".encode())).permutation(
        len(files)
    )
    n_test = min(max(round(len(files) * test_fraction), 1), len(files) - 1) if len(files) > 1 else 0
    test = sorted(files[i] for i in order[:n_test])
    train = sorted(files[i] for i in order[n_test:])
    return train, test


def _scan(
    root: Path, test_fraction: float
) -> tuple[bool, dict[str, list[str]], dict[str, list[str]]]:
    """Find the classes of ``root``: (presplit, train files by class, test files by class)."""
    if not root.exists():
        raise DatasetError(f"dataset root {root} does not exist")
    if not root.is_dir():
        raise DatasetError(f"dataset root {root} is not a folder")
    subdirs = _class_dirs(root)
    has_train, has_test = "train" in subdirs, "test" in subdirs
    if has_train != has_test:
        raise DatasetError(
            f"dataset root {root} has a {'train' if has_train else 'test'}/ folder but no "
            f"{'test' if has_train else 'train'}/ folder; give both or one folder per class"
        )
    if has_train:
        train_dirs, test_dirs = _class_dirs(root / "train"), _class_dirs(root / "test")
        for name in PAPER_DROPPED_CLASSES:
            train_dirs.pop(name, None)
            test_dirs.pop(name, None)
        if train_dirs.keys() != test_dirs.keys():
            only = sorted(train_dirs.keys() ^ test_dirs.keys())
            raise DatasetError(f"train/ and test/ under {root} differ in class folders: {only}")
        train = {name: _image_files(d) for name, d in train_dirs.items()}
        test = {name: _image_files(d) for name, d in test_dirs.items()}
    else:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        for name in PAPER_DROPPED_CLASSES:
            subdirs.pop(name, None)
        train, test = {}, {}
        for name, d in subdirs.items():
            train[name], test[name] = _split_class(name, _image_files(d), test_fraction)
    if not train:
        raise DatasetError(
            f"no class folders under {root} (expected train/<class>/ and test/<class>/, "
            "or one folder per class)"
        )
    return has_train, train, test


@dataclass(frozen=True)
class SplitCropDiseases:
    """The class-incremental split: which classes form each task and which images belong to them.

    ``class_folders[label]`` is the folder of global label ``label``; only the classes used by the
    ``n_tasks`` tasks are kept. Samples are ``(path, global label)``, ordered by label then path.
    """

    root: Path
    class_folders: tuple[str, ...]
    n_tasks: int
    classes_per_task: int
    seed: int
    presplit: bool  # True: the root had train/ and test/; False: split here with SPLIT_SEED
    train_samples: list[tuple[str, int]]
    test_samples: list[tuple[str, int]]

    @classmethod
    def from_root(
        cls,
        root: str | os.PathLike[str],
        n_tasks: int = 7,
        classes_per_task: int | None = None,
        seed: int = 1993,
        test_fraction: float = 0.2,
    ) -> SplitCropDiseases:
        """Scan ``root`` and build the split (``classes_per_task`` defaults to all classes spread
        evenly over the tasks; ``test_fraction`` only applies to an unsplit root)."""
        root = Path(root).expanduser().resolve()
        presplit, train, test = _scan(root, test_fraction)
        available = sorted(train)
        if n_tasks < 1:
            raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
        cpt = len(available) // n_tasks if classes_per_task is None else classes_per_task
        if cpt < 1 or n_tasks * cpt > len(available):
            raise ValueError(
                f"{n_tasks} tasks x {cpt} classes per task needs {n_tasks * cpt} classes, but "
                f"{root} has {len(available)} usable classes"
            )
        perm = np.random.RandomState(seed).permutation(len(available))
        folders = tuple(available[i] for i in perm[: n_tasks * cpt])
        return cls(
            root=root,
            class_folders=folders,
            n_tasks=n_tasks,
            classes_per_task=cpt,
            seed=seed,
            presplit=presplit,
            train_samples=[(p, lab) for lab, f in enumerate(folders) for p in train[f]],
            test_samples=[(p, lab) for lab, f in enumerate(folders) for p in test[f]],
        )

    @property
    def n_classes(self) -> int:
        """Classes over all tasks."""
        return len(self.class_folders)

    def task_labels(self, task: int) -> list[int]:
        """Global labels introduced by ``task``."""
        if not 0 <= task < self.n_tasks:
            raise ValueError(f"task must be in [0, {self.n_tasks}), got {task}")
        return list(range(task * self.classes_per_task, (task + 1) * self.classes_per_task))

    def task_of_label(self, label: int) -> int:
        """Task that introduces global label ``label``."""
        if not 0 <= label < self.n_classes:
            raise ValueError(f"label must be in [0, {self.n_classes}), got {label}")
        return label // self.classes_per_task

    def samples(self, split: str, tasks: Iterable[int]) -> list[tuple[str, int]]:
        """Samples of ``split`` ("train" or "test") whose labels belong to any of ``tasks``."""
        pool = {"train": self.train_samples, "test": self.test_samples}.get(split)
        if pool is None:
            raise ValueError(f'split must be "train" or "test", got {split!r}')
        wanted = set(tasks)
        for task in wanted:
            self.task_labels(task)  # validates the task index
        return [s for s in pool if s[1] // self.classes_per_task in wanted]
