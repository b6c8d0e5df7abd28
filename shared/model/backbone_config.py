"""What a backbone pair is, as data: the named presets and JSON config files.

Kept apart from the networks (``backbones``) and free of heavy imports, so a configuration is
read and checked where it enters, before torch or any model is loaded.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAPER_VIT_TAGS = ("augreg_in21k", "augreg2_in21k_ft_in1k")
# Input normalisation of the pre-trained networks.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)


class BackboneError(ValueError):
    """A backbone config or weight file that cannot be used (wrong keys, shapes, missing file)."""


@dataclass(frozen=True)
class BackboneConfig:
    """What to build. ``clip``/``vit`` hold either ``{"model_name": ...}`` or explicit sizes.

    Explicit CLIP sizes are ``open_clip.CLIP`` arguments (``embed_dim``, ``vision_cfg``,
    ``text_cfg``, ``quick_gelu``); explicit ViT sizes are timm ``VisionTransformer`` arguments.
    """

    name: str
    clip: dict[str, Any]
    vit: dict[str, Any]
    image_size: int
    vit_mean: tuple[float, float, float] = IMAGENET_MEAN
    vit_std: tuple[float, float, float] = IMAGENET_STD
    clip_mean: tuple[float, float, float] = CLIP_MEAN
    clip_std: tuple[float, float, float] = CLIP_STD

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, default=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackboneConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise BackboneError(f"unknown backbone config keys: {sorted(unknown)}")
        try:
            values: dict[str, Any] = {
                k: tuple(v) if k.endswith(("_mean", "_std")) else v for k, v in data.items()
            }
            return cls(**values)
        except TypeError as err:
            raise BackboneError(f"incomplete backbone config: {err}") from None


def read_backbone_config(path: str | Path) -> BackboneConfig:
    """The config in a JSON file; every way the file can be unusable is one BackboneError
    (the caller names the file)."""
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise BackboneError("no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BackboneError(f"not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise BackboneError("not a JSON object")
    return BackboneConfig.from_dict(data)


_PAPER_ARCHITECTURES: dict[str, Any] = {
    "clip": {"model_name": "ViT-L-14"},
    "vit": {"model_name": "vit_base_patch16_224"},
    "image_size": 224,
}
_PRESET_CONFIGS: dict[str, BackboneConfig] = {
    config.name: config
    for config in (
        BackboneConfig(
            name="tiny",
            clip={
                "embed_dim": 64,
                "vision_cfg": {
                    "image_size": 64,
                    "layers": 2,
                    "width": 64,
                    "head_width": 32,
                    "patch_size": 8,
                },
                "text_cfg": {
                    "context_length": 77,
                    "vocab_size": 49408,
                    "width": 64,
                    "heads": 4,
                    "layers": 2,
                },
                "quick_gelu": True,
            },
            vit={"img_size": 64, "patch_size": 8, "embed_dim": 96, "depth": 4, "num_heads": 4},
            image_size=64,
        ),
        # The paper's pair, for its pre-trained weights: from the hub (``download``) or local
        # files (without either it is random too, but fingerprinted as ``paper``).
        BackboneConfig(name="paper", **_PAPER_ARCHITECTURES),
        # The paper's architectures with seeded random weights, never a download: the paper's
        # dims (and costs) anywhere. Its name is in the config, so its fingerprint never equals
        # the pre-trained pair's (docs/model.md).
        BackboneConfig(name="paper-random", **_PAPER_ARCHITECTURES),
    )
}
PRESETS = tuple(_PRESET_CONFIGS)


def preset_config(preset: str) -> BackboneConfig:
    """The config of a named preset (sizes only; weights come from ``create_backbones``)."""
    try:
        return copy.deepcopy(_PRESET_CONFIGS[preset])
    except KeyError:
        raise BackboneError(
            f"unknown preset {preset!r}; choose one of {PRESETS} or give a config file"
        ) from None
