"""Features of the frozen towers: how images become each backbone's input (``Views``), and the
CLIP and prompted-ViT features the training steps, the evaluation and inference read.

CLIP features of un-augmented images are computed once per image set and cached by a site
(``clip_features_signature`` is their cache key); ViT features depend on the prompts and are
computed by the statistics steps (``starfed.shared.model.training``) on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from starfed.shared.data.images import device_batches, normalize, to_unit
from starfed.shared.device import backbone_dtype
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.star_prompt import StarPrompt

EVAL_BATCH_SIZE = 256


@dataclass(frozen=True)
class Views:
    """How uint8 images become network inputs for one backbone pair."""

    vit_mean: tuple[float, ...]
    vit_std: tuple[float, ...]
    clip_mean: tuple[float, ...]
    clip_std: tuple[float, ...]

    @classmethod
    def of(cls, backbones: Backbones) -> Views:
        c = backbones.config
        return cls(c.vit_mean, c.vit_std, c.clip_mean, c.clip_std)

    def pair(self, unit_images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ViT input, CLIP input) of the same [0, 1] pixels — the reference's renorm path."""
        return (
            normalize(unit_images, self.vit_mean, self.vit_std),
            normalize(unit_images, self.clip_mean, self.clip_std),
        )


#: Bump when ``clip_features`` returns other bits for the same backbones, device and images.
CLIP_FEATURES_VERSION = 2


def clip_features_signature(backbones: Backbones) -> str:
    """What decides the bits ``clip_features`` returns, besides the images: the cache key of a
    site's stored features. The weights, the code path (the frozen towers or each module's own
    forward: another float32 summation order), the device kind and precision, torch's kernels.
    Keyed by the weights alone, features cached by one of them were reused by the other."""
    return "|".join(
        [
            backbones.fingerprint,
            f"v{CLIP_FEATURES_VERSION}",
            f"frozen-towers={backbones.fast_towers}",
            backbones.device.type,
            str(backbone_dtype(backbones.device)),
            f"torch-{torch.__version__}",
        ]
    )


@torch.no_grad()
def clip_features(backbones: Backbones, images: torch.Tensor) -> torch.Tensor:
    """Raw CLIP features of un-augmented uint8 images (compute once, then cache), on the CPU
    (they are cached on disk; the training steps move them to the model's device)."""
    views = Views.of(backbones)
    out = [
        backbones.clip_image_features(views.pair(to_unit(chunk))[1]).cpu()
        for chunk in device_batches(images, EVAL_BATCH_SIZE, backbones.device)
    ]
    return torch.cat(out) if out else torch.zeros(0, backbones.dims.d_clip)


#: uint8 images to augmented [0, 1] views (``augment`` with a generator, or ``augment_each``).
Augmentation = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def vit_features(
    model: StarPrompt, images: torch.Tensor, augmentation: Augmentation | None
) -> torch.Tensor:
    """Prompted final-LN CLS features; of augmented views when ``augmentation`` is given (as
    the reference fits H_c on its training loader, which augments)."""
    views = Views.of(model.backbones)
    out = []
    for chunk in device_batches(images, EVAL_BATCH_SIZE, model.device):
        unit = augmentation(chunk) if augmentation is not None else to_unit(chunk)
        vit_in, clip_in = views.pair(unit)
        z = model.backbones.clip_image_features(clip_in)
        out.append(model.second_level(vit_in, z).features)
    return torch.cat(out) if out else torch.zeros(0, model.bank.dims.d_vit)
