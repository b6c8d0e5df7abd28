"""Tests for the Split CropDiseases data pipeline (starfed.shared.data.cropdiseases)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF2
from PIL import Image
from torchvision.transforms import InterpolationMode

from starfed.shared.data import images as data
from starfed.shared.data.cropdiseases import (
    PAPER_DROPPED_CLASSES,
    SplitCropDiseases,
    bundled_dataset_root,
    class_name_to_text,
)
from starfed.shared.data.images import (
    DatasetError,
    augment,
    decode_images,
    normalize,
    to_unit,
)
from starfed.shared.model.backbone_config import CLIP_MEAN, CLIP_STD, IMAGENET_MEAN, IMAGENET_STD

KEPT = [
    "Apple___Apple_scab",
    "Blueberry___healthy",
    "Cherry_(including_sour)___healthy",
    "Corn_(maize)___Common_rust_",
    "Grape___Black_rot",
    "Pepper,_bell___Bacterial_spot",
    "Tomato___Spider_mites Two-spotted_spider_mite",
    "Tomato___healthy",
]


def _write_jpeg(path: Path, seed: int, size: int = 16) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)


def _image_folder(root: Path, classes: list[str], per_class: int) -> Path:
    for c, name in enumerate(classes):
        for i in range(per_class):
            _write_jpeg(root / name / f"{i:03d}.jpg", seed=100 * c + i)
    return root


@pytest.fixture
def presplit_root(tmp_path: Path) -> Path:
    """Pre-split fake PlantVillage holding the three classes the paper drops."""
    classes = [*KEPT, *PAPER_DROPPED_CLASSES]
    _image_folder(tmp_path / "ds" / "train", classes, per_class=3)
    _image_folder(tmp_path / "ds" / "test", classes, per_class=2)
    return tmp_path / "ds"


def test_paper_classes_are_dropped(presplit_root: Path) -> None:
    ds = SplitCropDiseases.from_root(presplit_root, n_tasks=4)
    assert ds.presplit
    assert sorted(ds.class_folders) == sorted(KEPT)
    assert ds.classes_per_task == len(KEPT) // 4 == 2
    seen = {Path(p).parent.name for p, _ in ds.train_samples + ds.test_samples}
    assert seen.isdisjoint(PAPER_DROPPED_CLASSES)
    assert len(ds.train_samples) == 3 * len(KEPT)
    assert len(ds.test_samples) == 2 * len(KEPT)


def test_class_order_follows_seeded_permutation(presplit_root: Path) -> None:
    ds = SplitCropDiseases.from_root(presplit_root, n_tasks=4, seed=1993)
    perm = np.random.RandomState(1993).permutation(len(KEPT))
    assert ds.class_folders == tuple(sorted(KEPT)[i] for i in perm)
    # Global label = position in the permuted order.
    for path, label in ds.train_samples:
        assert Path(path).parent.name == ds.class_folders[label]
    again = SplitCropDiseases.from_root(presplit_root, n_tasks=4, seed=1993)
    assert again == ds
    orders = {
        SplitCropDiseases.from_root(presplit_root, n_tasks=4, seed=s).class_folders
        for s in (1993, 1996, 1997)
    }
    assert len(orders) == 3


def test_task_label_ranges(presplit_root: Path) -> None:
    ds = SplitCropDiseases.from_root(presplit_root, n_tasks=3, classes_per_task=2)
    assert ds.n_classes == 6
    assert [ds.task_labels(t) for t in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [ds.task_of_label(lab) for lab in range(6)] == [0, 0, 1, 1, 2, 2]
    # Only the first n_tasks * cpt classes of the permuted order are used.
    perm = np.random.RandomState(1993).permutation(len(KEPT))
    assert ds.class_folders == tuple(sorted(KEPT)[i] for i in perm[:6])
    assert {lab for _, lab in ds.train_samples} == set(range(6))
    task1 = ds.samples("test", [1])
    assert {lab for _, lab in task1} == {2, 3} and len(task1) == 4
    assert len(ds.samples("train", range(3))) == len(ds.train_samples)
    with pytest.raises(ValueError, match="task"):
        ds.task_labels(3)
    with pytest.raises(ValueError, match="label"):
        ds.task_of_label(6)
    with pytest.raises(ValueError, match="split"):
        ds.samples("val", [0])
    with pytest.raises(ValueError, match="needs 9 classes"):
        SplitCropDiseases.from_root(presplit_root, n_tasks=3, classes_per_task=3)


@pytest.mark.parametrize(
    ("folder", "text"),
    [
        ("Apple___Apple_scab", "Apple   Apple scab"),
        ("Cherry_(including_sour)___Powdery_mildew", "Cherry   Powdery mildew"),
        ("Corn_(maize)___Common_rust_", "Corn   Common rust"),
        (
            "Corn_(maize)___Cercospora_leaf_spot Gray_leaf_spot",
            "Corn   Cercospora leaf spot Gray leaf spot",
        ),
        ("Corn_(maize)___healthy", "Corn   healthy"),
        ("Pepper,_bell___healthy", "Pepper, bell   healthy"),
        ("Orange___Haunglongbing_(Citrus_greening)", "Orange   Haunglongbing (Citrus greening)"),
    ],
)
def test_class_name_to_text(folder: str, text: str) -> None:
    assert class_name_to_text(folder) == text


def test_bundled_mini_dataset() -> None:
    ds = SplitCropDiseases.from_root(bundled_dataset_root())
    assert ds.presplit
    assert (ds.n_tasks, ds.classes_per_task, ds.n_classes) == (7, 4, 28)
    assert len(ds.train_samples) == 2213
    assert len(ds.test_samples) == 560
    assert len({class_name_to_text(f) for f in ds.class_folders}) == 28
    decoded = decode_images(ds.samples("test", [0])[:6], image_size=32, progress=False)
    assert decoded.images.shape == (6, 3, 32, 32) and decoded.images.dtype == torch.uint8
    assert decoded.n_skipped == 0
    assert decoded.images.float().std() > 10  # real pictures, not blank arrays


def test_missing_root_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError, match="does not exist") as err:
        SplitCropDiseases.from_root(missing)
    assert str(missing) in str(err.value)


def test_root_without_classes_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no class folders") as err:
        SplitCropDiseases.from_root(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(err.value)


def test_empty_class_is_a_clear_error(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "ds", KEPT[:3], per_class=4)
    (root / "Tomato___healthy").mkdir()
    with pytest.raises(DatasetError, match="holds no images") as err:
        SplitCropDiseases.from_root(root, n_tasks=1)
    assert "Tomato___healthy" in str(err.value)


def test_train_without_test_is_a_clear_error(tmp_path: Path) -> None:
    _image_folder(tmp_path / "ds" / "train", KEPT[:2], per_class=2)
    with pytest.raises(DatasetError, match="no test/ folder"):
        SplitCropDiseases.from_root(tmp_path / "ds", n_tasks=1)


def test_unsplit_root_is_split_per_class_deterministically(tmp_path: Path) -> None:
    root = _image_folder(tmp_path / "flat", [*KEPT[:4], PAPER_DROPPED_CLASSES[0]], per_class=10)
    a = SplitCropDiseases.from_root(root, n_tasks=2)
    assert not a.presplit
    assert sorted(a.class_folders) == sorted(KEPT[:4])
    assert len(a.train_samples) == 4 * 8 and len(a.test_samples) == 4 * 2
    train = {p for p, _ in a.train_samples}
    test = {p for p, _ in a.test_samples}
    assert train.isdisjoint(test) and len(train | test) == 40
    # Same split on a rebuild and under another class-order seed (only the labels move).
    b = SplitCropDiseases.from_root(root, n_tasks=2, seed=1996)
    assert a.test_samples == SplitCropDiseases.from_root(root, n_tasks=2).test_samples
    assert {p for p, _ in b.test_samples} == test
    # Each class draws its own test files (seeded by folder name), not a fixed slice.
    per_class: dict[str, set[str]] = {}
    for p in test:
        per_class.setdefault(Path(p).parent.name, set()).add(Path(p).name)
    assert len({frozenset(names) for names in per_class.values()}) > 1
    third = SplitCropDiseases.from_root(root, n_tasks=2, test_fraction=0.5)
    assert len(third.test_samples) == 20


def test_corrupt_images_are_skipped_with_a_warning(tmp_path: Path) -> None:
    good = tmp_path / "good.jpg"
    _write_jpeg(good, seed=1, size=40)
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"this is not a jpeg at all" * 10)
    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(buf, format="JPEG")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    samples = [(str(garbage), 0), (str(good), 1), (str(truncated), 2), (str(good), 3)]
    with pytest.warns(RuntimeWarning, match="skipped 2 unreadable") as record:
        decoded = decode_images(samples, image_size=24, progress=False)
    assert "garbage.jpg" in str(record[0].message)
    assert decoded.n_skipped == 2
    assert decoded.paths == [str(good), str(good)]
    assert decoded.labels.tolist() == [1, 3]
    assert decoded.images.shape == (2, 3, 24, 24)


def test_a_class_without_readable_images_is_an_error_when_every_class_counts(
    tmp_path: Path,
) -> None:
    root = _image_folder(tmp_path / "ds", ["good", "bad"], per_class=2)
    for path in (root / "bad").iterdir():
        path.write_bytes(b"garbage")
    samples = [(str(p), int(p.parent.name == "bad")) for p in sorted(root.rglob("*.jpg"))]
    with pytest.warns(RuntimeWarning, match="skipped 2"):  # a site simply lacks the class
        assert decode_images(samples, image_size=8, progress=False).labels.tolist() == [0, 0]
    with pytest.raises(DatasetError, match=r"class folder .*bad has no readable image \(2 "):
        decode_images(samples, image_size=8, progress=False, every_class=True)


def test_decode_matches_reference_test_view(tmp_path: Path) -> None:
    path = tmp_path / "wide.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)).save(path)
    decoded = decode_images([(str(path), 0)], image_size=20, progress=False)
    with Image.open(path) as img:
        ref = TF2.center_crop(TF2.resize(img, 20, InterpolationMode.BICUBIC), [20, 20])
    expected = torch.from_numpy(np.asarray(ref).transpose(2, 0, 1).copy())
    assert torch.equal(decoded.images[0], expected)


def test_decode_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _image_folder(tmp_path / "imgs", ["a", "b"], per_class=3)
    samples = [(str(p), i % 2) for i, p in enumerate(sorted(root.rglob("*.jpg")))]
    cache = tmp_path / "cache"
    first = decode_images(samples, image_size=16, cache_dir=cache, progress=False)
    assert len(list(cache.glob("*.npy"))) == 1

    opened: list[str] = []
    real_open = data.Image.open

    def counting_open(fp, *args, **kwargs):
        opened.append(str(fp))
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(data.Image, "open", counting_open)
    relabelled = [(p, 1 - lab) for p, lab in reversed(samples)]
    second = decode_images(relabelled, image_size=16, cache_dir=cache, progress=False)
    assert opened == []  # served from the cache, nothing decoded
    assert torch.equal(second.images, first.images.flip(0))
    assert second.labels.tolist() == [1 - lab for _, lab in reversed(samples)]

    # Another image size or a touched file is a different cache entry.
    decode_images(samples, image_size=8, cache_dir=cache, progress=False)
    assert len(opened) == len(samples)
    _write_jpeg(Path(samples[0][0]), seed=999)
    third = decode_images(samples, image_size=16, cache_dir=cache, progress=False)
    assert len(opened) == 2 * len(samples)
    assert not torch.equal(third.images[0], first.images[0])
    assert torch.equal(third.images[1:], first.images[1:])


def _half_black_batch(n: int, size: int = 32) -> torch.Tensor:
    images = torch.zeros(n, 3, size, size, dtype=torch.uint8)
    images[..., size // 2 :] = 255
    return images


def test_augment_shape_range_and_determinism() -> None:
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    a = augment(images, torch.Generator().manual_seed(0))
    b = augment(images, torch.Generator().manual_seed(0))
    c = augment(images, torch.Generator().manual_seed(1))
    assert a.shape == (64, 3, 32, 32) and a.dtype == torch.float32
    assert a.min() >= 0 and a.max() <= 1
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert augment(images[:0], torch.Generator()).shape == (0, 3, 32, 32)
    # A flat image stays flat under any crop and flip.
    flat = torch.full((4, 3, 32, 32), 77, dtype=torch.uint8)
    assert torch.allclose(augment(flat, torch.Generator()), to_unit(flat), atol=1e-5)


def test_augment_flips_about_half() -> None:
    out = augment(_half_black_batch(400), torch.Generator().manual_seed(3))
    flipped = out[..., 0].mean(dim=(1, 2)) > out[..., -1].mean(dim=(1, 2))
    assert 0.4 < flipped.float().mean() < 0.6


def test_augment_equals_torchvision_resized_crop() -> None:
    images = torch.randint(0, 256, (16, 3, 24, 24), dtype=torch.uint8)
    out = augment(images, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)  # replay the same draws
    top, left, h, w = data._crop_boxes(16, 24, 24, g)
    flips = torch.rand(16, generator=g) < 0.5
    for k in range(16):
        ref = TF2.resized_crop(
            to_unit(images[k]),
            int(top[k]),
            int(left[k]),
            int(h[k]),
            int(w[k]),
            [24, 24],
            InterpolationMode.BICUBIC,
            antialias=True,
        )
        if flips[k]:
            ref = TF2.horizontal_flip(ref)
        assert torch.allclose(out[k], ref.clamp(0, 1), atol=1e-5)
    assert ((h * w) >= 0.08 * 24 * 24 - 24).all() and (h <= 24).all() and (w <= 24).all()


def test_normalize_per_channel() -> None:
    x = to_unit(torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8))
    assert x.max() <= 1 and x.dtype == torch.float32
    vit = normalize(x, IMAGENET_MEAN, IMAGENET_STD)
    for c in range(3):
        expected = (x[:, c] - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
        assert torch.allclose(vit[:, c], expected)
    clip = normalize(x, CLIP_MEAN, CLIP_STD)
    assert torch.allclose(
        clip * torch.tensor(CLIP_STD).view(-1, 1, 1) + torch.tensor(CLIP_MEAN).view(-1, 1, 1),
        x,
        atol=1e-6,
    )
