"""First level of STAR-Prompt: one learnable token p_c per class inside CLIP's text encoder.

The text of class c is ``"X " + name + "."``; the embedding of the token ``x`` (position 1) is
replaced by p_c, and the text tower's output at the end-of-text token, projected and
L2-normalised, is the class key w_c. Image-to-key cosine similarities, scaled by CLIP's logit
scale, classify CLIP image features; after a task the keys are frozen and become the
second level's lookup keys.
"""

from __future__ import annotations

import open_clip
import torch
import torch.nn.functional as F
from open_clip.model import CLIP
from torch import nn

from starfed.shared.device import autocast

PROMPT_POSITION = 1  # index of the placeholder token "x" in "<SOT> x <name> . <EOT>"
PROMPT_INIT_STD = 0.02


def class_prompt_text(name: str) -> str:
    """The reference's text template; ``name`` is already the display text of the class."""
    return f"X {name}."


def init_prompts(n_classes: int, d_txt: int, generator: torch.Generator) -> torch.Tensor:
    """p_c ~ N(0, 0.02²), as the reference initialises them."""
    return torch.randn(n_classes, d_txt, generator=generator) * PROMPT_INIT_STD


class TextKeyEncoder(nn.Module):
    """Maps first-level prompts to keys through CLIP's frozen text tower.

    Frozen per-class inputs (the token embeddings of each class's text) are prepared once by
    ``embed_texts``; the text is causal, so sequences are cut after the longest end-of-text
    token — positions after it can never influence the key, and a 77-token context usually
    shrinks to ~20 tokens.
    """

    def __init__(self, clip: CLIP) -> None:
        super().__init__()
        self.clip = clip  # shared with Backbones, frozen there

    @property
    def logit_scale(self) -> torch.Tensor:
        scale: torch.Tensor = self.clip.logit_scale.detach().exp()
        return scale

    def tokenize(self, class_texts: list[str]) -> torch.Tensor:
        """BPE ids [C, context_length] of the class texts (EOT is the largest id per row)."""
        ids: torch.Tensor = open_clip.tokenize(
            [class_prompt_text(t) for t in class_texts], context_length=self.clip.context_length
        )
        return ids

    @torch.no_grad()
    def embed_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings cut to the longest text, and each row's end-of-text position."""
        embedding = self.clip.token_embedding
        tokens = tokens.to(embedding.weight.device)
        eot = tokens.argmax(dim=-1)
        length = int(eot.max()) + 1
        return embedding(tokens[:, :length]).float(), eot

    def embed_texts(self, class_texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed_tokens(self.tokenize(class_texts))

    def forward(
        self, prompts: torch.Tensor, token_embeds: torch.Tensor, eot: torch.Tensor
    ) -> torch.Tensor:
        """Keys w [C, d_clip] (unit norm, float32) for prompts [C, d_txt] and their class inputs;
        the frozen text tower under autocast on a GPU."""
        with autocast(self.clip.token_embedding.weight.device):
            return self._keys(prompts, token_embeds, eot).float()

    def _keys(
        self, prompts: torch.Tensor, token_embeds: torch.Tensor, eot: torch.Tensor
    ) -> torch.Tensor:
        clip = self.clip
        length = token_embeds.shape[1]
        x = token_embeds.clone()
        x[:, PROMPT_POSITION] = prompts
        x = x + clip.positional_embedding[:length]
        mask = clip.attn_mask[:length, :length] if clip.attn_mask is not None else None
        if getattr(clip.transformer, "batch_first", True):
            x = clip.transformer(x, attn_mask=mask)
        else:  # older open_clip: sequence-first transformer
            x = clip.transformer(x.transpose(0, 1), attn_mask=mask).transpose(0, 1)
        x = clip.ln_final(x)
        x = x[torch.arange(x.shape[0]), eot]
        if isinstance(clip.text_projection, nn.Linear):
            x = clip.text_projection(x)
        else:
            x = x @ clip.text_projection
        return F.normalize(x, dim=-1)


def first_level_logits(
    image_features: torch.Tensor, keys: torch.Tensor, logit_scale: torch.Tensor
) -> torch.Tensor:
    """exp(logit_scale) · cos(z, w_c) for raw CLIP image features z [B, d_clip]."""
    return logit_scale * F.normalize(image_features, dim=-1) @ keys.t()
