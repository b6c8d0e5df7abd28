"""Site data folders for tests: task folders of links to a few bundled images per class."""

from __future__ import annotations

from pathlib import Path

from starfed.shared.data.cropdiseases import bundled_dataset_root

BUNDLED = bundled_dataset_root()
CLASSES = sorted(p.name for p in (BUNDLED / "train").iterdir())


def site_folder(root: Path, tasks: dict[str, list[str]], train: int = 10, test: int = 4) -> Path:
    """A site's data folder: ``tasks`` maps task folder -> bundled class folders (a name may
    be respelled with ``folder=spelling``); each class gets links to a few bundled images."""
    for task, classes in tasks.items():
        for spec in classes:
            source, _, spelling = spec.partition("=")
            for split, n in (("train", train), ("test", test)):
                target = (
                    root / task / (spelling or source)
                    if split == "train"
                    else (root / "test" / (spelling or source))
                )
                target.mkdir(parents=True, exist_ok=True)
                for image in sorted((BUNDLED / split / source).iterdir())[:n]:
                    link = target / image.name
                    if not link.exists():
                        link.symlink_to(image)
    (root / "test").mkdir(parents=True, exist_ok=True)
    return root


#: Training images per class at each site of the attack tests (``test_adversarial_alone``) and
#: their benchmark (bench/attacks.py).
TRAIN_IMAGES = 12


def site_with_tests(root: Path, tasks: dict[str, list[str]], test_images: int) -> Path:
    """A site's folder of ``TRAIN_IMAGES`` training images a class and ``test_images`` test
    images: the bundled test split's, then the bundled training split's last (never trained
    on: the folder trains on its first ``TRAIN_IMAGES``)."""
    folder = site_folder(root, tasks, train=TRAIN_IMAGES, test=test_images)
    for spec in {spec for classes in tasks.values() for spec in classes}:
        source, _, spelling = spec.partition("=")
        test = folder / "test" / (spelling or source)
        extra = test_images - len(list(test.iterdir()))
        unused = sorted((BUNDLED / "train" / source).iterdir())[TRAIN_IMAGES:]
        if extra > len(unused):
            raise ValueError(f"{source} has {len(unused)} images to spare, not {extra}")
        for image in unused[len(unused) - extra :] if extra > 0 else []:
            link = test / f"held-{image.name}"
            if not link.exists():
                link.symlink_to(image)
    return folder


def disjoint_images(root: Path, tasks: dict[str, list[str]], test_images: int) -> Path:
    """``site_with_tests``, with the classes respelled from one source each trained on a share
    of its own of the source's images no site trains on and no site tests on (training images
    ``TRAIN_IMAGES`` on, up to the test images the folders take from the end): attack 5 aimed
    apart, ten classes each a different sample of A1's class, which ``server.copies`` cannot
    tell from an honest class of that kind."""
    folder = site_with_tests(root, tasks, test_images)
    specs = [spec.partition("=") for classes in tasks.values() for spec in classes]
    respelled: dict[str, list[str]] = {}
    for source, _, spelling in specs:
        if spelling:
            respelled.setdefault(source, []).append(spelling)
    for task, classes in tasks.items():
        for source, _, spelling in (spec.partition("=") for spec in classes):
            if not spelling:
                continue
            images = sorted((BUNDLED / "train" / source).iterdir())
            tested = test_images - len(list((BUNDLED / "test" / source).iterdir()))
            free = images[TRAIN_IMAGES : len(images) - max(tested, 0)]
            share = len(free) // len(respelled[source])
            if share < 2:
                raise ValueError(f"{source} has {len(free)} images to share, under 2 a class")
            i = respelled[source].index(spelling)
            target = folder / task / spelling
            for link in target.iterdir():
                link.unlink()
            for image in free[i * share : (i + 1) * share]:
                (target / image.name).symlink_to(image)
    return folder
