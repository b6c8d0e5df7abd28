"""A site's data folder: its tasks in arrival order, each an ImageFolder of classes, and tests.

Layout (docs/sites.md)::

    <data>/<task>/<class>/*.jpg     one folder per task; tasks arrive in the sorted order of
                                    their names (e.g. 2026-03-01-scab/), a new folder is a new task
    <data>/test/<class>/*.jpg       optional test images per class
    <data>/<class>/*.jpg            or: a flat ImageFolder, which is one task

Without ``test/``, a fixed share of each class's images is held out for testing, chosen by a
hash of the file name, so adding images never moves the others between train and test.

A class is identified by its name under ``class_key``: Unicode NFKC, case folded, runs of
spaces, underscores and hyphens made one underscore, outer ones dropped — so
``Tomato___Early_blight`` and ``tomato early-blight`` are the same class everywhere in a
federation.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from starfed.shared.data.images import IMAGE_EXTENSIONS, DatasetError

TEST_FOLDER = "test"
TEST_SHARE = 0.2  # of each class's images, when the site has no test/ folder
PATIENT_SEPARATOR = "__"  # <patient>__<name>: an image's patient (the patient privacy unit)
_SEPARATORS = re.compile(r"[\s_\-]+")


def class_key(name: str) -> str:
    """The identity of a class name (see the module docstring)."""
    return _SEPARATORS.sub("_", unicodedata.normalize("NFKC", name).casefold()).strip("_")


def patient_of(path: str) -> str | None:
    """The patient an image belongs to: its file name's part before ``__`` (docs/sites.md:
    ``p0042__scan-3.jpg`` is patient ``p0042``'s); None for a name without one."""
    name = Path(path).name
    return name.split(PATIENT_SEPARATOR, 1)[0] if PATIENT_SEPARATOR in name[1:] else None


def patient_name(patient: str, path: str) -> str:
    """The file name that says ``path`` is ``patient``'s image."""
    return f"{patient}{PATIENT_SEPARATOR}{Path(path).name}"


def training_patient(path: str) -> str:
    """The patient of a training image, with the patient privacy unit: an image without one in
    its name is an error."""
    patient = patient_of(path)
    if patient is None:
        raise DatasetError(
            f"{path}: no patient in its name; with the patient privacy unit name every "
            f"training image <patient>{PATIENT_SEPARATOR}<name> (docs/sites.md#patients)"
        )
    return patient


def file_digests(paths: list[str]) -> list[str]:
    """The files' contents as short digests (sha256, 16 hex digits): an image's identity that
    survives renaming its file or folder (a private site's ledger knows its images by it)."""
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16] for p in paths]


def _images(folder: Path) -> list[str]:
    return sorted(
        str(p) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    )


def _subfolders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _in_test_share(path: str, share: float) -> bool:
    """Whether an image is a test image: a stable function of its class folder and name."""
    p = Path(path)
    digest = hashlib.sha256(f"{p.parent.name}/{p.name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") < share * 2**64


def _classes(task_dir: Path) -> dict[str, list[str]]:
    """Class folder name -> image paths; two folders with the same class key are an error."""
    classes: dict[str, list[str]] = {}
    keys: dict[str, str] = {}
    for folder in _subfolders(task_dir):
        key = class_key(folder.name)
        if not key:
            raise DatasetError(f"{folder}: a class folder name needs letters or digits")
        if key in keys:
            raise DatasetError(
                f"{task_dir}: class folders {keys[key]!r} and {folder.name!r} name the same class"
            )
        keys[key] = folder.name
        classes[folder.name] = _images(folder)
    return classes


@dataclass(frozen=True)
class SiteTask:
    """One task: its folder name and its classes' training images."""

    name: str
    train: dict[str, list[str]]  # class name -> image paths

    @property
    def keys(self) -> set[str]:
        return {class_key(name) for name, paths in self.train.items() if paths}


@dataclass(frozen=True)
class SiteFolder:
    """What a site's data folder holds now (scan again to see new tasks)."""

    root: Path
    tasks: list[SiteTask]
    test: dict[str, list[str]] = field(default_factory=dict)  # class key -> test image paths

    @classmethod
    def scan(cls, root: str | Path) -> SiteFolder:
        root = Path(root).expanduser()
        if not root.is_dir():
            raise DatasetError(f"site data folder {root} does not exist or is not a folder")
        top = [p for p in _subfolders(root) if p.name != TEST_FOLDER]
        flat = any(_images(p) for p in top)
        nested = any(_subfolders(p) for p in top)
        if flat and nested:
            raise DatasetError(
                f"{root} mixes class folders with task folders; use <data>/<task>/<class>/ "
                "for tasks or <data>/<class>/ for one task"
            )
        tasks = (
            [SiteTask(root.name, _classes(root))]
            if flat
            else [SiteTask(p.name, _classes(p)) for p in top]
        )
        test: dict[str, list[str]] = {}
        if (root / TEST_FOLDER).is_dir():
            test = {class_key(n): paths for n, paths in _classes(root / TEST_FOLDER).items()}
            return cls(root, tasks, test)
        split = []
        for task in tasks:
            train = {}
            for name, paths in task.train.items():
                train[name] = [p for p in paths if not _in_test_share(p, TEST_SHARE)]
                tested = [p for p in paths if _in_test_share(p, TEST_SHARE)]
                test.setdefault(class_key(name), []).extend(tested)
            split.append(SiteTask(task.name, train))
        return cls(root, split, test)

    def patients(self) -> dict[str, set[str]]:
        """The class keys each patient has training images in."""
        found: dict[str, set[str]] = {}
        for task in self.tasks:
            for name, paths in task.train.items():
                for path in paths:
                    found.setdefault(patient_of(path) or path, set()).add(class_key(name))
        return found


def folder_test_images(root: str | Path) -> dict[str, list[str]]:
    """Labelled test images of a folder, by class key: a plain ImageFolder of class folders is
    a held-out test set (every image counts); a site's data folder gives its test images
    (``test/``, or else the held-out share of its task folders, as ``SiteFolder.scan``)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetError(f"test folder {root} does not exist or is not a folder")
    classes = [p for p in _subfolders(root) if p.name != TEST_FOLDER]
    if (root / TEST_FOLDER).is_dir() or any(_subfolders(p) for p in classes):
        found = SiteFolder.scan(root).test
    else:
        found = {class_key(name): paths for name, paths in _classes(root).items()}
    return {key: paths for key, paths in found.items() if paths}
