"""A site's cached CLIP features are keyed by what decides their bits, not by the weights alone.

Found on 2026-11-23: features cached before the frozen towers (another float32 summation order)
were reused after them, and the default simulation's seed 1993 read FAA 17.50 from a warm cache
against 16.61 from a cold one (docs/benchmarks.md, "Default simulation across seeds").
"""

from __future__ import annotations

from pathlib import Path

import torch
from site_folders import BUNDLED, CLASSES

from starfed.client.memory import SiteMemory
from starfed.client.site import Site
from starfed.shared.config import parse
from starfed.shared.data.images import decode_images
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.features import clip_features_signature
from starfed.shared.model.training import TrainConfig


def test_features_cached_on_one_code_path_are_not_reused_on_the_other(tmp_path: Path, monkeypatch):
    backbones = BackboneOptions.from_config(parse({"preset": "tiny"})).load()
    assert backbones.fast_clip  # the frozen towers' path (the knob's default)
    memory = SiteMemory(tmp_path / "state", backbones.fingerprint, backbones.dims)
    site = Site("a", tmp_path / "data", memory, backbones, TrainConfig(), tmp_path / "cache")
    images = sorted((BUNDLED / "train" / CLASSES[0]).iterdir())[:4]
    decoded = decode_images([(str(p), 0) for p in images], backbones.config.image_size)
    cached = tmp_path / "cache" / "features"

    fast_key = clip_features_signature(backbones)
    fast = site._cached_features(decoded)
    assert len(list(cached.iterdir())) == 1
    assert torch.equal(site._cached_features(decoded), fast)  # read back, not recomputed

    monkeypatch.setenv("STARFED_FAST_TOWERS", "0")  # read when a pair is built: build one
    plain_backbones = create_backbones("tiny").place(torch.device("cpu"))
    assert plain_backbones.fingerprint == backbones.fingerprint and not plain_backbones.fast_clip
    assert clip_features_signature(plain_backbones) != fast_key
    site = Site("a", tmp_path / "data", memory, plain_backbones, TrainConfig(), tmp_path / "cache")
    plain = site._cached_features(decoded)
    assert len(list(cached.iterdir())) == 2  # computed on this path, stored beside the other
    torch.testing.assert_close(plain, fast, rtol=1e-4, atol=1e-5)  # the same features, rounded
