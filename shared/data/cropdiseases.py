"""Split CropDiseases (PlantVillage) for class-incremental learning, as STAR-Prompt uses it.

Follows the authors' mammoth ``datasets/seq_cropdisease.py``: the three classes the paper leaves out
are dropped, the sorted (ImageFolder-order) class folders are permuted with
``np.random.RandomState(seed).permutation(n_classes)`` and the permuted position is the global
label, so task ``t`` holds labels ``[t * cpt, (t + 1) * cpt)``.

A root is either pre-split (``train/<class>/*`` and ``test/<class>/*``, like the bundled
``cropdiseases-mini``) or one ImageFolder (``<class>/*``, like a raw PlantVillage download). The
latter is split per class with a fixed seed (:data:`SPLIT_SEED`, independent of the class-order
seed), so the paper's seeds 1993/1996/1997 change the task order but never the test images.

Images are decoded once (Resize + CenterCrop, the reference test view) into a uint8 tensor, and
training augmentation runs batched on tensors (:func:`augment`), which keeps a CPU run fast.
Deviation from the reference: RandomResizedCrop crops the decoded ``S x S`` image instead of the
original 256x256 photo, so crops are upsampled from fewer pixels.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image
from rich.progress import track
from torchvision.transforms import InterpolationMode

PAPER_DROPPED_CLASSES: tuple[str, ...] = (
    "Potato___healthy",
    "Apple___Cedar_apple_rust",
    "Peach___healthy",
)

#: Seed of the per-class train/test split of an unsplit root (mixed with each folder name).
SPLIT_SEED = 0
#: File endings counted as images (torchvision ImageFolder's list).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# The reference's label names shorten these PlantVillage prefixes; the text feeds CLIP prompts.
_TEXT_PREFIXES = {"Cherry_(including_sour)___": "Cherry___", "Corn_(maize)___": "Corn___"}
_TEXT_NAMES = {"Corn_(maize)___Common_rust_": "Corn___Common_rust"}

_CACHE_FORMAT = 1  # bump when the cached array layout changes
_PROGRESS_MIN = 256  # below this many images a bar is just noise


class DatasetError(ValueError):
    """The dataset folder is missing or not laid out as expected."""


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


@dataclass
class DecodedImages:
    """Decoded images of a sample list, in its order, minus the unreadable ones."""

    images: torch.Tensor  # uint8 [N, 3, S, S]
    labels: torch.Tensor  # int64 [N]
    paths: list[str]
    n_skipped: int  # samples dropped because their file could not be decoded


def _decode_one(path: str, size: int) -> np.ndarray | None:
    """Reference test view (Resize shorter side, bicubic; CenterCrop) as uint8 CHW, or None.

    Any failure returns None: one bad file in a large folder must not stop a training run.
    """
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")  # forces a full decode, so truncation shows up here
        rgb = TF.center_crop(TF.resize(rgb, size, InterpolationMode.BICUBIC), [size, size])
        return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    except Exception:
        return None


def _cache_key(paths: Sequence[str], size: int) -> str:
    """Digest of what the decoded array depends on; any edited/added/removed file changes it."""
    files = []
    for p in sorted(paths):
        try:
            st = os.stat(p)
            files.append((p, st.st_size, st.st_mtime_ns))
        except OSError:
            files.append((p, None, None))
    blob = json.dumps({"format": _CACHE_FORMAT, "size": size, "files": files})
    return hashlib.sha256(blob.encode()).hexdigest()


def _load_cache(npy: Path) -> tuple[np.ndarray, list[str], list[str]] | None:
    """Cached (array, decoded paths, skipped paths), or None when absent or unreadable."""
    meta = npy.with_suffix(".json")
    if not meta.is_file():  # written last, so its presence means the array is complete
        return None
    try:
        info = json.loads(meta.read_text())
        array = np.load(npy, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    if array.shape[0] != len(info["paths"]):
        return None
    return array, info["paths"], info["skipped"]


def _save_cache(npy: Path, array: np.ndarray, paths: list[str], skipped: list[str]) -> None:
    """Write atomically (temp file + rename) so a killed run never leaves a half cache behind."""
    try:
        npy.parent.mkdir(parents=True, exist_ok=True)
        tmp = npy.with_suffix(".npy.tmp")
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, npy)
        tmp = npy.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"paths": paths, "skipped": skipped}))
        os.replace(tmp, npy.with_suffix(".json"))
    except OSError as err:
        warnings.warn(f"could not write decode cache in {npy.parent}: {err}", stacklevel=3)


def _decode_all(paths: list[str], size: int, progress: bool) -> tuple[np.ndarray, list[str]]:
    """Decode ``paths`` in parallel threads (PIL releases the GIL); returns (array, failed)."""
    out = np.empty((len(paths), 3, size, size), dtype=np.uint8)
    ok = np.zeros(len(paths), dtype=bool)
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results: Iterator[np.ndarray | None] = pool.map(lambda p: _decode_one(p, size), paths)
        if progress and len(paths) >= _PROGRESS_MIN:
            results = track(
                results, total=len(paths), description="Decoding images", transient=True
            )
        for i, arr in enumerate(results):
            if arr is not None:
                out[i] = arr
                ok[i] = True
    failed = [p for p, good in zip(paths, ok, strict=True) if not good]
    return (out if ok.all() else out[ok]), failed


def _check_every_class(samples: Sequence[tuple[str, int]], readable: set[int]) -> None:
    for path, label in samples:
        if label not in readable:
            n = sum(1 for _, other in samples if other == label)
            raise DatasetError(
                f"class folder {Path(path).parent} has no readable image ({n} unreadable files)"
            )


def decode_images(
    samples: Sequence[tuple[str, int]],
    image_size: int,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    every_class: bool = False,
) -> DecodedImages:
    """Decode every sample once into uint8 ``[N, 3, S, S]``, skipping unreadable files.

    With ``cache_dir`` the array is kept as ``.npy`` keyed by the files (paths, sizes, mtimes) and
    ``image_size``; labels are not cached but taken from ``samples``, so one cache serves any seed.
    Files are known by their real paths (``paths`` holds those), so a folder of links — a
    simulated site — shares the cache of the files it links to.
    ``every_class``: a label of ``samples`` left without any readable image is a DatasetError
    (a single site cannot learn such a class; a federated site simply does not hold it).
    """
    samples = [(os.path.realpath(p), label) for p, label in samples]
    unique = list(dict.fromkeys(p for p, _ in samples))
    npy = None
    if cache_dir is not None:
        npy = Path(cache_dir) / f"decoded-{_cache_key(unique, image_size)}.npy"
    cached = None if npy is None else _load_cache(npy)
    if cached is not None:
        stored, stored_paths, failed = cached
    else:
        stored, failed = _decode_all(unique, image_size, progress)
        bad = set(failed)
        stored_paths = [p for p in unique if p not in bad]
        if npy is not None:
            _save_cache(npy, stored, stored_paths, failed)

    row_of = {p: i for i, p in enumerate(stored_paths)}
    kept = [(p, label) for p, label in samples if p in row_of]
    if every_class:
        _check_every_class(samples, {label for _, label in kept})
    rows = np.fromiter((row_of[p] for p, _ in kept), dtype=np.int64, count=len(kept))
    in_place = len(rows) == len(stored) and bool((rows == np.arange(len(rows))).all())
    # A fresh array already in sample order is used as is; a read-only memmap is always copied.
    images = stored if in_place and stored.flags.writeable else stored[rows]
    if failed:
        shown = ", ".join(failed[:5]) + (", ..." if len(failed) > 5 else "")
        warnings.warn(
            f"skipped {len(failed)} unreadable image file(s): {shown}", RuntimeWarning, stacklevel=2
        )
    return DecodedImages(
        images=torch.from_numpy(np.ascontiguousarray(images)),
        labels=torch.tensor([label for _, label in kept], dtype=torch.int64),
        paths=[p for p, _ in kept],
        n_skipped=len(samples) - len(kept),
    )


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels to float32 in [0, 1] (what ToTensor does)."""
    return images.to(torch.float32).div_(255.0)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel ``(x - mean) / std`` on a ``[B, 3, H, W]`` batch."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return (x - m) / s


def renormalize(
    x: torch.Tensor,
    from_mean: Sequence[float],
    from_std: Sequence[float],
    to_mean: Sequence[float],
    to_std: Sequence[float],
) -> torch.Tensor:
    """Re-express a normalised batch under other statistics (a ViT input as a CLIP query)."""
    m = torch.as_tensor(from_mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(from_std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return normalize(x * s + m, to_mean, to_std)


def _crop_boxes(
    b: int, h: int, w: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchvision's RandomResizedCrop.get_params for ``b`` images at once: (top, left, h, w).

    Same rule (10 tries of scale (0.08, 1) and log-uniform ratio (3/4, 4/3), then a centre crop),
    but drawn from ``generator`` so a run is reproducible without touching the global RNG.
    """
    dev = generator.device
    tries = 10
    area = h * w * (0.08 + 0.92 * torch.rand(b, tries, generator=generator, device=dev))
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    ratio = torch.exp(lo + (hi - lo) * torch.rand(b, tries, generator=generator, device=dev))
    cw = torch.round(torch.sqrt(area * ratio))
    ch = torch.round(torch.sqrt(area / ratio))
    valid = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)  # first valid try
    found = valid.any(dim=1)
    in_ratio = w / h
    if in_ratio < 3 / 4:
        fw, fh = w, round(w / (3 / 4))
    elif in_ratio > 4 / 3:
        fw, fh = round(h * 4 / 3), h
    else:
        fw, fh = w, h
    cw = torch.where(found, cw.gather(1, first).squeeze(1), float(fw))
    ch = torch.where(found, ch.gather(1, first).squeeze(1), float(fh))
    top = torch.floor(torch.rand(b, generator=generator, device=dev) * (h - ch + 1))
    left = torch.floor(torch.rand(b, generator=generator, device=dev) * (w - cw + 1))
    top = torch.where(found, top, torch.div(h - ch, 2, rounding_mode="floor"))
    left = torch.where(found, left, torch.div(w - cw, 2, rounding_mode="floor"))
    return top, left, ch, cw


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Reference train view on a uint8 batch: RandomResizedCrop (bicubic) + horizontal flip.

    Returns float32 ``[B, 3, S, S]`` in [0, 1], equal to torchvision's tensor ``resized_crop``
    (antialiased bicubic, as PIL) and ``hflip`` with parameters drawn from ``generator``. A loop
    of small ``interpolate`` calls beats one batched bicubic ``grid_sample`` on CPU.
    """
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(f"expected a uint8 [B, C, H, W] batch, got {images.dtype} {images.shape}")
    b, _, h, w = images.shape
    x = to_unit(images)
    boxes = torch.stack(_crop_boxes(b, h, w, generator), dim=1).to(torch.int64).tolist()
    flip = torch.rand(b, generator=generator, device=generator.device) < 0.5
    out = torch.empty_like(x)
    for k, (top, left, ch, cw) in enumerate(boxes):
        crop = x[k : k + 1, :, top : top + ch, left : left + cw]
        out[k] = F.interpolate(crop, size=(h, w), mode="bicubic", antialias=True)[0]
    out = torch.where(flip.to(x.device).view(-1, 1, 1, 1), out.flip(-1), out)
    return out.clamp_(0.0, 1.0)
