"""Images as tensors: decoded once (and cached), normalised, augmented in batches.

Images are decoded once (Resize + CenterCrop, the reference test view) into a uint8 tensor, and
training augmentation runs batched on tensors (:func:`augment`), which keeps a CPU run fast.
Batches reach the device through :func:`device_batches`, the next copy in flight on a GPU.
Deviation from the reference: RandomResizedCrop crops the decoded ``S x S`` image instead of the
original 256x256 photo, so crops are upsampled from fewer pixels.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
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

from starfed.shared.progress import counted

#: File endings counted as images (torchvision ImageFolder's list).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_CACHE_FORMAT = 1  # bump when the cached array layout changes
_PROGRESS_MIN = 256  # below this many images a bar is just noise


class DatasetError(ValueError):
    """The dataset folder is missing or not laid out as expected."""


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
    files: list[tuple[str, int | None, int | None]] = []
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
        results: Iterable[np.ndarray | None] = pool.map(lambda p: _decode_one(p, size), paths)
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
        warnings.warn(skipped_files(failed), RuntimeWarning, stacklevel=2)
    return DecodedImages(
        images=torch.from_numpy(np.ascontiguousarray(images)),
        labels=torch.tensor([label for _, label in kept], dtype=torch.int64),
        paths=[p for p, _ in kept],
        n_skipped=len(samples) - len(kept),
    )


def skipped_files(paths: Sequence[str]) -> str:
    """One line naming unreadable files (the first five)."""
    shown = ", ".join(paths[:5]) + (", ..." if len(paths) > 5 else "")
    return f"skipped {counted(len(paths), 'unreadable image file')}: {shown}"


def decode_quietly(
    samples: Sequence[tuple[str, int]], image_size: int, progress: bool = False
) -> tuple[DecodedImages, list[str]]:
    """``decode_images`` for whoever names each unreadable file itself (``predict``,
    ``evaluate``, ``site check``: one clean line, not a Python warning): the decoded images and
    the unreadable paths, as given."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        decoded = decode_images(samples, image_size, progress=progress)
    read = set(decoded.paths)
    return decoded, [p for p, _ in samples if os.path.realpath(p) not in read]


class _Copier:
    """Host→device copies of batches: on a CUDA device issued on a side stream from page-locked
    memory, so a copy runs while the default stream computes; elsewhere a plain ``to``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, batch: torch.Tensor) -> torch.Tensor:
        if self.stream is None or batch.device.type == "cuda":
            return batch.to(self.device)
        host = batch if batch.is_pinned() else batch.pin_memory()
        with torch.cuda.stream(self.stream):
            return host.to(self.device, non_blocking=True)

    def ready(self, batch: torch.Tensor) -> torch.Tensor:
        """``batch`` usable on the current stream (its copy finished first; its memory kept
        until the current stream is done with it)."""
        if self.stream is not None and batch.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            batch.record_stream(current)
        return batch


def device_batches(
    images: torch.Tensor, batch_size: int, device: torch.device
) -> Iterator[torch.Tensor]:
    """Consecutive ``batch_size`` slices of ``images`` on ``device``, the next one's copy started
    before this one is handed out, so on a CUDA GPU the copies overlap the caller's compute
    (docs/benchmarks.md#the-gpu-kept-busy-issue-37). The same loop runs on the CPU, where a copy
    is a slice."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    copier = _Copier(torch.device(device))
    pending = copier.start(images[:batch_size]) if len(images) else None
    for i in range(batch_size, len(images) + batch_size, batch_size):
        assert pending is not None  # started above or in the previous pass: images remain
        batch = copier.ready(pending)
        pending = copier.start(images[i : i + batch_size]) if i < len(images) else None
        yield batch


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels to float32 in [0, 1] (what ToTensor does)."""
    return images.to(torch.float32).div_(255.0)


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel ``(x - mean) / std`` on a ``[B, 3, H, W]`` batch."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return (x - m) / s


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
    (antialiased bicubic, as PIL) and ``hflip`` with parameters drawn from ``generator``.
    """
    _check_batch(images)
    b, _, h, w = images.shape
    boxes = torch.stack(_crop_boxes(b, h, w, generator), dim=1)
    flip = torch.rand(b, generator=generator, device=generator.device) < 0.5
    return _apply_views(images, boxes, flip)


def augment_each(images: torch.Tensor, seed: int) -> torch.Tensor:
    """``augment`` with each image's crop and flip drawn from its own generator, seeded by
    ``seed`` and the image's pixels: an image's view does not depend on which other images are
    in the batch, so removing one image changes no other image's view (what a private site's
    released statistics need, docs/security.md#differential-privacy)."""
    _check_batch(images)
    b, _, h, w = images.shape
    boxes, flips = [], []
    for image in images.cpu():
        generator = torch.Generator().manual_seed(image_seed(image, seed))
        boxes.append(torch.stack(_crop_boxes(1, h, w, generator), dim=1))
        flips.append(torch.rand(1, generator=generator) < 0.5)
    empty = torch.zeros(0, 4), torch.zeros(0, dtype=torch.bool)
    boxes_all, flip = (torch.cat(boxes), torch.cat(flips)) if b else empty
    return _apply_views(images, boxes_all, flip)


def image_seed(image: torch.Tensor, seed: int) -> int:
    """A generator seed from ``seed`` and one uint8 image's pixels (its identity)."""
    digest = hashlib.sha256(f"{seed}/".encode() + image.contiguous().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _check_batch(images: torch.Tensor) -> None:
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(f"expected a uint8 [B, C, H, W] batch, got {images.dtype} {images.shape}")


def _apply_views(images: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Crop each image to its box (top, left, h, w), resize back, flip where ``flip``. A loop of
    small ``interpolate`` calls beats one batched bicubic ``grid_sample`` on CPU."""
    x = to_unit(images)
    h, w = images.shape[-2:]
    out = torch.empty_like(x)
    for k, (top, left, ch, cw) in enumerate(boxes.to(torch.int64).tolist()):
        crop = x[k : k + 1, :, top : top + ch, left : left + cw]
        out[k] = F.interpolate(crop, size=(h, w), mode="bicubic", antialias=True)[0]
    out = torch.where(flip.to(x.device).view(-1, 1, 1, 1), out.flip(-1), out)
    return out.clamp_(0.0, 1.0)
