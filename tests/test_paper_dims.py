"""The paper's dims without a download: the ``paper-random`` preset (docs/model.md).

``paper-random`` builds the paper's architectures — open_clip ``ViT-L-14`` and timm
``vit_base_patch16_224`` at 224 px — with seeded random weights. The fast tests read its dims
from the architectures' own configurations and check that its fingerprint is its own; the slow
one runs one federated step of two sites at those dims on the CPU, through the real apps on the
local runtime, and predicts with the codebook it leaves.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import open_clip
import pytest
import timm
import torch
from site_folders import BUNDLED, CLASSES

from starfed.cli import main
from starfed.server.folder_files import CODEBOOK_FILE
from starfed.shared.codebook import schema, wire
from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.model.backbone_config import preset_config
from starfed.shared.model.backbones import Backbones, create_backbones
from starfed.simulations.local_grid import run_locally

PAPER_DIMS = ModelDims(d_txt=768, d_clip=768, d_vit=768, n_layers=12)


def test_paper_random_has_the_paper_dims() -> None:
    """From the architectures' configurations: open_clip's model config, timm's ViT on the
    meta device (shapes, no weights)."""
    config = preset_config("paper-random")
    clip = open_clip.get_model_config(config.clip["model_name"])
    with torch.device("meta"):
        vit = timm.create_model(config.vit["model_name"], pretrained=False, num_classes=0)
    dims = ModelDims(
        d_txt=clip["text_cfg"]["width"],
        d_clip=clip["embed_dim"],
        d_vit=vit.embed_dim,
        n_layers=len(vit.blocks),
    )
    assert dims == PAPER_DIMS
    assert config.image_size == clip["vision_cfg"]["image_size"] == 224
    assert tuple(vit.patch_embed.img_size) == (224, 224)
    assert config.clip == preset_config("paper").clip and config.vit == preset_config("paper").vit


def test_paper_random_never_fingerprints_as_the_paper_preset() -> None:
    """The config names the preset, so even the very same weights under ``paper`` (the
    pre-trained pair's name) fingerprint apart. (That two builds agree, as every site needs,
    the slow test checks.)"""
    backbones = create_backbones("paper-random")
    assert backbones.dims == PAPER_DIMS
    as_paper = Backbones(preset_config("paper"), backbones.clip, backbones.vit)
    assert as_paper.fingerprint != backbones.fingerprint


# --- one federated step at paper dims on the CPU ----------------------------------------------

TRAIN_IMAGES, TEST_IMAGES = 4, 2  # per class: two sites share each class's training images


def small_root(root: Path, classes: list[str]) -> Path:
    """A pre-split ImageFolder root of links to a few bundled (64×64) images per class."""
    for split, n in (("train", TRAIN_IMAGES), ("test", TEST_IMAGES)):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for image in sorted((BUNDLED / split / name).iterdir())[:n]:
                (folder / image.name).symlink_to(image)
    return root


def one_step_config(tmp_path: Path, device: str, run_name: str) -> dict:
    """One step of two sites at paper dims, every epoch count 1 (results in ``run_name``)."""
    return {
        "preset": "paper-random",
        "device": device,
        "seed": 1993,
        "data-root": str(small_root(tmp_path / "data", CLASSES[:4])),
        "num-sites": 2,
        "num-tasks": 2,
        "classes-per-task": 2,
        "alpha": 1000.0,
        "max-steps": 1,
        "batch-size": 4,
        "stage1-epochs": 1,
        "stage2-epochs": 1,
        "replay1-epochs": 1,
        "replay2-epochs": 1,
        "replay2-epochs-per-task": 0,
        "timeout-s": 1800,
        "wait-s": 1,
        "results-dir": str(tmp_path / "results"),
        "run-name": run_name,
    }


@pytest.mark.slow
def test_one_federated_step_at_paper_dims_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STARFED_CACHE_DIR", str(tmp_path / "cache"))
    config = one_step_config(tmp_path, "cpu", "paper")
    metrics = run_locally(config)
    assert metrics["status"] == "completed", metrics["reason"]
    assert metrics["sites"] == ["site-0", "site-1"]
    exchanges = metrics["exchanges"]
    assert {e["status"] for e in exchanges} == {"ok"}
    assert {e["phase"] for e in exchanges} >= {"stage1", "stage2", "stage2_stats", "evaluate"}
    largest = max(max(e["bytes_down"], e["bytes_up"]) for e in exchanges)
    assert 0 < largest <= DEFAULT_MAX_BYTES

    run = tmp_path / "results" / "paper"
    codebook = wire.read_file(run / CODEBOOK_FILE)
    assert codebook.dims == PAPER_DIMS and len(codebook) == 2
    # a fresh build: every site and the server build the same seeded weights
    assert codebook.fingerprint == create_backbones("paper-random").fingerprint
    for entry in codebook.entries.values():
        assert entry.frozen and set(entry.values) == {f.name for f in schema.FIELDS}
        for field in schema.TENSORS:
            assert entry.values[field].shape == schema.BY_NAME[field].shape(PAPER_DIMS), field
        for field in schema.MIXTURES:
            means = entry.values[field].means
            assert means.shape[1:] == schema.BY_NAME[field].shape(PAPER_DIMS), field

    exported = tmp_path / "deploy.bin"
    images = sorted(str(p) for p in (tmp_path / "data" / "test").glob("*/*"))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["server", "export", "--federation", str(run), "--out", str(exported)]) == 0
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            [
                "predict",
                "--codebook",
                str(exported),
                "--preset",
                "paper-random",
                "--device",
                "cpu",
                "--format",
                "json",
                *images,
            ]
        )
    assert code == 0
    predictions = json.loads(printed.getvalue())["predictions"]
    assert len(predictions) == len(images) == 4 * TEST_IMAGES
    assert {p["class"] for p in predictions} <= set(codebook.names)
