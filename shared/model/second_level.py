"""Second level of STAR-Prompt: class-specific residuals added inside a frozen ViT.

For block l and image b, every seen class c scores
``s[b, l, c] = 5 · cos(z_b ⊙ softmax(A_c[l]), w_c)``; the best class c* (per block, over all
seen classes, never the ground truth) contributes the residual ``R_l = s[b,l,c*] · Q_c*[l]``,
added to the attention values of every token. Attention rows sum to one, so that equals adding
``W_o · R_l`` to the block's attention output — which is how it is computed here, with the
output projections of all blocks stacked once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from starfed.shared.model.frozen_towers import supports_timm_vit, timm_vit_cls

SIMILARITY_SCALE = 5.0
_NORMALIZE_EPS = 1e-12  # F.normalize's eps, kept so similarities match the reference


def init_query_prompts(
    n_classes: int, n_layers: int, d_vit: int, generator: torch.Generator
) -> torch.Tensor:
    """Q [C, L, d]: per block, orthogonal init of a [C, 3, d] tensor, keeping index 0.

    The reference (following CODA-Prompt) initialises key/query/value prompts and keeps only
    the value one, so rows are orthogonal over 3·d and *not* unit-norm in d; L_OQ then has
    work to do from the first step. Copied on purpose.
    """
    blocks = []
    for _ in range(n_layers):
        full = torch.empty(n_classes, 3 * d_vit)
        blocks.append(_orthogonal(full, generator).view(n_classes, 3, d_vit)[:, 0])
    return torch.stack(blocks, dim=1)


def init_query_weights(
    n_classes: int, n_layers: int, d_clip: int, generator: torch.Generator
) -> torch.Tensor:
    """A [C, L, d_clip]: per block, orthogonal rows over the classes."""
    return torch.stack(
        [_orthogonal(torch.empty(n_classes, d_clip), generator) for _ in range(n_layers)], dim=1
    )


def _orthogonal(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``nn.init.orthogonal_`` driven by an explicit generator (deterministic per class set)."""
    return nn.init.orthogonal_(tensor, generator=generator)


def query_similarity(
    image_features: torch.Tensor, query_weights: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """s [B, L, C] = 5 · cos(z ⊙ softmax(A_c[l]), w_c) for z [B, d], A [C, L, d], w [C, d].

    Written as two matmuls (numerator and the norm of the modulated query) instead of
    materialising z ⊙ softmax(A) for every (image, class, block): [B, C, L, d] would be
    165 MB per batch at the paper's sizes.
    """
    weights = torch.softmax(query_weights, dim=-1)  # [C, L, d]
    numerator = torch.einsum("bd,cld->blc", image_features, weights * keys[:, None, :])
    norm_sq = torch.einsum("bd,cld->blc", image_features**2, weights**2)
    return SIMILARITY_SCALE * numerator / norm_sq.sqrt().clamp_min(_NORMALIZE_EPS)


def select_residuals(
    similarity: torch.Tensor, query_prompts: torch.Tensor, confidence_modulation: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residuals R [B, L, d_vit] and selections c* [B, L] from s [B, L, C] and Q [C, L, d].

    The forward uses only the selected class (scaled by its similarity). The gradient follows
    the reference, where the argmax mask is applied in place under ``no_grad``: it reaches the
    similarity of *every* class (straight-through), while Q receives gradient only through the
    selected rows. Without confidence modulation the weight is 1 (binary selection, as the
    reference's ablation), which passes no gradient to the similarities.
    """
    selected = similarity.argmax(dim=-1)
    classes = torch.arange(similarity.shape[-1], device=selected.device)
    onehot = (selected.unsqueeze(-1) == classes).to(similarity.dtype)  # F.one_hot, vmap-able
    if confidence_modulation:
        weights = similarity - (similarity * (1 - onehot)).detach()
    else:
        weights = onehot
    return torch.einsum("blc,cld->bld", weights, query_prompts), selected


def _blocks(vit: VisionTransformer) -> list[Block]:
    """A timm ViT's blocks (timm types them as any module)."""
    return cast(list[Block], list(vit.blocks))


class PromptedViT(nn.Module):
    """A frozen timm ViT whose blocks take one residual per image (the semantic residual).

    Plain ViTs run ``frozen_towers.timm_vit_cls`` (frozen-weight GEMMs, class-token-only last
    block); ``fast=False`` (``Backbones.fast_towers``: the knob ``fast-towers``) or an
    unsupported block layout runs the timm modules themselves.
    """

    def __init__(self, vit: VisionTransformer, fast: bool) -> None:
        super().__init__()
        self.vit = vit
        self.fast = fast and supports_timm_vit(vit)

    def output_projections(self) -> torch.Tensor:
        """[L, d_out, d_in] stacked ``attn.proj`` weights (read each call: they are frozen)."""
        return torch.stack([cast(Attention, b.attn).proj.weight for b in _blocks(self.vit)])

    def forward(self, images: torch.Tensor, residuals: torch.Tensor | None = None) -> torch.Tensor:
        """Final-LayerNorm CLS features [B, d_vit]; ``residuals`` [B, L, d_vit] or None."""
        vit = self.vit
        shifts = None
        if residuals is not None:
            shifts = torch.einsum("bld,led->ble", residuals, self.output_projections())
        if self.fast:
            return timm_vit_cls(vit, images, shifts)
        x = vit.patch_embed(images)
        x = vit._pos_embed(x)
        x = vit.patch_drop(x)
        x = vit.norm_pre(x)
        for layer, block in enumerate(_blocks(vit)):
            attended = block.attn(block.norm1(x))
            if shifts is not None:
                attended = attended + shifts[:, layer, None, :]
            x = x + block.drop_path1(block.ls1(attended))
            x = x + block.drop_path2(block.ls2(block.mlp(block.norm2(x))))
        features: torch.Tensor = vit.norm(x)[:, 0]
        return features


@dataclass
class SecondLevelOutput:
    """What one prompted forward produces (kept together for losses, metrics and tests)."""

    features: torch.Tensor  # final-LN CLS features [B, d_vit]
    similarity: torch.Tensor  # s [B, L, C]
    selected: torch.Tensor  # c* [B, L]
    residuals: torch.Tensor  # R [B, L, d_vit]


def second_level_forward(
    prompted_vit: PromptedViT,
    images: torch.Tensor,
    image_features: torch.Tensor,
    keys: torch.Tensor,
    query_weights: torch.Tensor,
    query_prompts: torch.Tensor,
    confidence_modulation: bool = True,
) -> SecondLevelOutput:
    """Score every seen class per block, pick c*, and run the ViT with the residuals.

    ``keys``/``query_weights``/``query_prompts`` cover the seen classes (past rows detached by
    the caller); ``image_features`` are the raw CLIP features of the same images.
    """
    similarity = query_similarity(image_features, query_weights, keys)
    residuals, selected = select_residuals(similarity, query_prompts, confidence_modulation)
    features = prompted_vit(images, residuals)
    return SecondLevelOutput(features, similarity, selected, residuals)
