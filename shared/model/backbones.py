"""The two frozen pre-trained networks of STAR-Prompt, built from one config-driven factory.

A backbone pair is CLIP (open_clip: image and text towers) plus an ImageNet ViT (timm). Presets:

* ``paper`` — open_clip ``ViT-L-14``/``openai`` and timm ``vit_base_patch16_224`` with in21k
  weights (``augreg_in21k``; the reference actually ran ``augreg2_in21k_ft_in1k``, selectable
  with ``vit_tag``). Weights are downloaded only when ``download=True``; otherwise the same
  architectures are built with random weights or filled from local files.
* ``paper-random`` — the same architectures with seeded random weights, never downloaded: the
  paper's dims and costs anywhere, under a fingerprint of its own (the config names the preset).
* ``tiny`` — small CLIP and ViT with seeded random weights at 64×64 (the bundled images), so a
  whole continual run fits a 2-core CPU. Used by the tests and the default demo.
* a JSON config file (``config_path``) giving either open_clip/timm model names or explicit
  sizes, plus local weight files — for sites without a model hub.

The configurations themselves (presets, JSON files) are data: ``backbone_config``.

Every pair has a ``fingerprint``: sha256 over the canonical config and every weight tensor.
Clients and servers exchange it so that codebooks trained on different backbones never mix.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import timm
import torch
from open_clip.model import CLIP
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from starfed.shared.codebook.schema import ModelDims
from starfed.shared.device import autocast, backbone_dtype
from starfed.shared.model import frozen_towers
from starfed.shared.model.backbone_config import (
    PAPER_VIT_TAGS,
    BackboneConfig,
    BackboneError,
    preset_config,
    read_backbone_config,
)
from starfed.shared.model.frozen_towers import clip_image_embedding, supports_clip_visual


class Backbones(nn.Module):
    """A frozen CLIP + ViT pair, its dims, normalisation statistics and fingerprint."""

    def __init__(self, config: BackboneConfig, clip: CLIP, vit: VisionTransformer) -> None:
        super().__init__()
        self.config = config
        self.clip = clip
        self.vit = vit
        self.requires_grad_(False)
        self.eval()
        check_prompting_support(vit)
        self.dims = ModelDims(
            d_txt=int(clip.token_embedding.weight.shape[1]),
            d_clip=int(clip.visual.output_dim),
            d_vit=int(vit.embed_dim),
            n_layers=len(vit.blocks),
        )
        self._fingerprint: str | None = None
        #: The towers run through ``frozen_towers`` where they can (the knob ``fast-towers``
        #: when the pair was built; False: each module's own forward).
        self.fast_towers = frozen_towers.enabled()
        #: CLIP image features through ``frozen_towers`` (False: open_clip's own forward).
        self.fast_clip = self.fast_towers and supports_clip_visual(clip.visual)
        self.device = torch.device("cpu")

    def train(self, mode: bool = True) -> Backbones:
        """Backbones stay in eval mode: they are frozen feature extractors."""
        return super().train(False)

    def place(self, device: torch.device) -> Backbones:
        """Move to ``device``, in half precision on a GPU (``starfed.shared.device``). The
        fingerprint is of the weights as built, so it is taken first."""
        _ = self.fingerprint
        self.to(device=device, dtype=backbone_dtype(device))
        self.device = device
        return self

    @torch.no_grad()
    def clip_image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Raw (un-normalised) CLIP image embeddings z [B, d_clip] (float32) of CLIP-normalised
        images, on the backbones' device."""
        images = images.to(self.device)
        with autocast(self.device):
            if self.fast_clip:
                return clip_image_embedding(self.clip.visual, images).float()
            features: torch.Tensor = self.clip.encode_image(images).float()
            return features

    @property
    def fingerprint(self) -> str:
        """sha256 of the config and every weight; computed once (hashing ViT-L takes seconds)."""
        if self._fingerprint is None:
            digest = hashlib.sha256(self.config.to_json().encode())
            for prefix, module in (("clip.", self.clip), ("vit.", self.vit)):
                for key, tensor in sorted(module.state_dict().items()):
                    t = tensor.detach().to("cpu").contiguous().reshape(-1)
                    digest.update(f"{prefix}{key}:{t.dtype}:{tuple(tensor.shape)}".encode())
                    digest.update(t.view(torch.uint8).numpy().tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint


def check_prompting_support(vit: VisionTransformer) -> None:
    """Refuse ViT variants where "add R to the attention values" is not "add W_o·R to the block".

    The residual is applied after attention, before the output projection; a gate or a norm
    between them (some timm variants) would change that identity.
    """
    for i, block in enumerate(vit.blocks):
        attn = block.attn
        if getattr(attn, "gate", None) is not None or not isinstance(
            getattr(attn, "norm", nn.Identity()), nn.Identity
        ):
            raise BackboneError(f"ViT block {i} has a gated or normalised attention output")
    if vit.cls_token is None or vit.global_pool != "token":
        raise BackboneError("the ViT must have a class token and global_pool='token'")


def _build_clip(spec: dict[str, Any], download_tag: str | None) -> CLIP:
    spec = copy.deepcopy(spec)
    if "model_name" in spec:
        model = open_clip.create_model(
            spec["model_name"],
            pretrained=download_tag,
            force_quick_gelu=spec.get("quick_gelu", True),
            load_weights=download_tag is not None,
        )
    else:
        from open_clip.model import CLIPTextCfg, CLIPVisionCfg

        model = CLIP(
            embed_dim=spec["embed_dim"],
            vision_cfg=CLIPVisionCfg(**spec["vision_cfg"]),
            text_cfg=CLIPTextCfg(**spec["text_cfg"]),
            quick_gelu=spec.get("quick_gelu", True),
        )
    if not isinstance(model, CLIP):
        raise BackboneError(f"open_clip built {type(model).__name__}, STAR-Prompt needs a CLIP")
    return model


def _build_vit(spec: dict[str, Any], download_tag: str | None) -> VisionTransformer:
    spec = copy.deepcopy(spec)
    if "model_name" in spec:
        name = spec.pop("model_name")
        if download_tag:
            name = f"{name}.{download_tag}"
        model = timm.create_model(name, pretrained=download_tag is not None, num_classes=0, **spec)
    else:
        model = VisionTransformer(num_classes=0, **spec)
    if not isinstance(model, VisionTransformer):
        raise BackboneError(f"timm built {type(model).__name__}, STAR-Prompt needs a ViT")
    return model


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read weights from safetensors, or a torch file with ``weights_only=True`` (no pickles)."""
    path = Path(path)
    if not path.is_file():
        raise BackboneError(f"weight file not found: {path}")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise BackboneError(f"{path} does not hold a state dict")
    return state


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    # Classifier heads of pre-trained ViTs are not part of STAR-Prompt (it has its own head).
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first_line = str(err).splitlines()[0]
        raise BackboneError(
            f"{what} weights do not fit the configured model: {first_line}"
        ) from None


def create_backbones(
    preset: str = "tiny",
    *,
    config_path: str | Path | None = None,
    clip_weights: str | Path | None = None,
    vit_weights: str | Path | None = None,
    download: bool = False,
    vit_tag: str = "augreg_in21k",
    seed: int = 0,
) -> Backbones:
    """Build a frozen backbone pair (the one factory every part of starfed uses).

    ``config_path`` (JSON of ``BackboneConfig``) overrides ``preset``. Weights come, in order of
    precedence, from local files, from the hub (``download=True``, ``paper`` only), or from a
    seeded random initialisation.
    """
    config = read_backbone_config(config_path) if config_path else preset_config(preset)
    if download and config.name != "paper":
        raise BackboneError("download=True only applies to the 'paper' preset")
    if vit_tag not in PAPER_VIT_TAGS:
        raise BackboneError(f"vit_tag must be one of {PAPER_VIT_TAGS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = _build_clip(config.clip, "openai" if download else None)
        vit = _build_vit(config.vit, vit_tag if download else None)
    if clip_weights is not None:
        _load_into(clip, load_state_dict_file(clip_weights), "CLIP")
    if vit_weights is not None:
        _load_into(vit, load_state_dict_file(vit_weights), "ViT")
    return Backbones(config, clip, vit)


@dataclass
class SavedBackbones:
    """Where ``save_backbones`` wrote a pair: hand these to ``create_backbones``."""

    config_path: Path
    clip_weights: Path
    vit_weights: Path


def save_backbones(backbones: Backbones, directory: str | Path) -> SavedBackbones:
    """Write config + safetensors weights, e.g. to carry the paper weights to an offline site."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "backbone.json"
    config_path.write_text(json.dumps(json.loads(backbones.config.to_json()), indent=2))
    clip_path, vit_path = directory / "clip.safetensors", directory / "vit.safetensors"
    for module, path in ((backbones.clip, clip_path), (backbones.vit, vit_path)):
        state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(path))
    return SavedBackbones(config_path, clip_path, vit_path)
