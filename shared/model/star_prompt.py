"""The two-level STAR-Prompt model: frozen backbones plus a growing bank of per-class tensors.

The same object serves a single site, a federated client, the server (which only needs the
text tower and the head) and inference. It knows how to register classes with deterministic
initial values, compute keys, classify, and report which key each image selected; the
training loops that change the bank live in ``starfed.shared.model.training``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from starfed.shared.codebook.entry import ClassBank, ClassEntry
from starfed.shared.data.cropdiseases import class_name_to_text
from starfed.shared.device import autocast
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.first_level import TextKeyEncoder, first_level_logits, init_prompts
from starfed.shared.model.second_level import (
    PromptedViT,
    SecondLevelOutput,
    init_query_prompts,
    init_query_weights,
    second_level_forward,
)

HEAD_INIT_STD = 0.02


def class_init_generator(seed: int, names: list[str]) -> torch.Generator:
    """A generator seeded by (seed, class names): every site initialises a class identically."""
    digest = hashlib.sha256(json.dumps([seed, names]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def init_class_rows(
    model: StarPrompt, names: list[str], texts: list[str], seed: int
) -> dict[str, torch.Tensor]:
    """Initial per-class tensors for new classes, as the reference initialises them."""
    d = model.bank.dims
    n = len(names)
    g = class_init_generator(seed, names)
    prompts = init_prompts(n, d.d_txt, g)
    head_weight = torch.nn.init.trunc_normal_(
        torch.empty(n, d.d_vit), std=HEAD_INIT_STD, generator=g
    )
    with torch.no_grad():
        embeds, eot = model.encoder.embed_texts(texts)
        keys = model.encoder(prompts.to(model.device), embeds, eot).cpu()
    return {
        "prompt": prompts,
        "key": keys,
        "query_prompt": init_query_prompts(n, d.n_layers, d.d_vit, g),
        "query_weight": init_query_weights(n, d.n_layers, d.d_clip, g),
        "head_weight": head_weight,
        "head_bias": torch.zeros(n),
        "aligned_head_weight": head_weight.clone(),
        "aligned_head_bias": torch.zeros(n),
    }


@dataclass
class Prediction:
    logits: torch.Tensor  # [B, C] over the bank's classes
    selected: torch.Tensor  # c* [B, L] (row indices); with keys alone, their argmax in every block


class StarPrompt:
    """Backbones + per-class bank; rows of the bank are the model's label space."""

    def __init__(self, backbones: Backbones, confidence_modulation: bool = True) -> None:
        self.backbones = backbones
        self.device = backbones.device  # where the bank lives and the model computes
        self.encoder = TextKeyEncoder(backbones.clip)
        self.vit = PromptedViT(backbones.vit, backbones.fast_towers)
        self.bank = ClassBank(backbones.dims).to(self.device)
        self.class_texts: list[str] = []
        self.confidence_modulation = confidence_modulation
        d = backbones.dims
        self._token_embeds = torch.zeros(0, 1, d.d_txt)
        self._eot = torch.zeros(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.bank)

    def new_entries(self, names: list[str], seed: int) -> list[ClassEntry]:
        """Initial entries of new classes, identical wherever they are made (seeded by names).

        The CLIP text of a class is derived from its name (``class_name_to_text``).
        """
        texts = [class_name_to_text(name) for name in names]
        rows = init_class_rows(self, names, texts, seed)
        return [
            ClassEntry(name, values={f: rows[f][i] for f in rows}) for i, name in enumerate(names)
        ]

    def add_classes(self, names: list[str], seed: int) -> None:
        """Register new classes (appended; existing rows never move)."""
        self.bank.append(self.new_entries(names, seed))
        self.class_texts.extend(class_name_to_text(name) for name in names)
        self._cache_text_inputs()

    def load_bank(self, bank: ClassBank) -> None:
        """Use ``bank`` (e.g. decoded from a codebook) as the model's per-class state."""
        if bank.dims != self.backbones.dims:
            raise ValueError(f"bank dims {bank.dims} do not match backbones {self.backbones.dims}")
        self.bank = bank.to(self.device)
        self.class_texts = [class_name_to_text(name) for name in bank.names]
        self._cache_text_inputs()

    def _cache_text_inputs(self) -> None:
        """Token embeddings of all class texts (frozen, so computed once per class set)."""
        self._token_embeds, self._eot = self.encoder.embed_texts(self.class_texts)

    def text_inputs(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        return self._token_embeds[rows], self._eot[rows]

    def compute_keys(self, prompts: torch.Tensor, rows: slice) -> torch.Tensor:
        """Keys of the classes in ``rows`` for the given prompts (differentiable)."""
        embeds, eot = self.text_inputs(rows)
        keys: torch.Tensor = self.encoder(prompts, embeds, eot)
        return keys

    def second_level(
        self,
        images: torch.Tensor,
        image_features: torch.Tensor,
        query_weights: torch.Tensor | None = None,
        query_prompts: torch.Tensor | None = None,
    ) -> SecondLevelOutput:
        """Prompted ViT forward over all bank classes (optionally with trainable A/Q), on the
        model's device; the frozen ViT under autocast on a GPU, the outputs float32."""
        bank = self.bank
        with autocast(self.device):
            out = second_level_forward(
                self.vit,
                images.to(self.device),
                image_features.to(self.device),
                bank["key"],
                bank["query_weight"] if query_weights is None else query_weights,
                bank["query_prompt"] if query_prompts is None else query_prompts,
                self.confidence_modulation,
            )
        out.features = out.features.float()
        return out

    @torch.no_grad()
    def predict(
        self, images: torch.Tensor, image_features: torch.Tensor, use_keys: bool = False
    ) -> Prediction:
        """Logits over all bank classes with the replay-aligned head.

        ``use_keys`` classifies with the first-level keys alone (the paper's ablation); the
        selection is then that argmax in each of the L blocks, so prompt-selection counts keep
        their images × L denominator (``starfed.shared.report``).
        """
        bank = self.bank
        if use_keys:
            features = image_features.to(self.device)
            logits = first_level_logits(features, bank["key"], self.encoder.logit_scale)
            selected = logits.argmax(-1, keepdim=True).expand(-1, bank.dims.n_layers)
            return Prediction(logits, selected)
        out = self.second_level(images, image_features)
        logits = F.linear(out.features, bank["aligned_head_weight"], bank["aligned_head_bias"])
        return Prediction(logits, out.selected)
