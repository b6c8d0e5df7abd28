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
