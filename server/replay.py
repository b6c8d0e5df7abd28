"""The server's side of a step as pure functions: codebook in, new codebook out.

The server holds the mixtures of every class, so it runs both generative replays
(``starfed.shared.model.training.replay1``/``replay2``) and registers new classes with their
deterministic initial values. Each function builds a throw-away model from the codebook, runs
the same step a single site runs, and returns the codebook with the changed values, so the
codebook stays the server's single source of truth.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from starfed.shared.codebook.codebook import Codebook
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, replay1, replay2


def _past_prefix(codebook: Codebook) -> int:
    """How many classes are frozen; they must come first (classes are appended and a step
    freezes all its classes or, if it fails, is rolled back), as both replays assume."""
    n_past = len(codebook.frozen)
    if not all(codebook[name].frozen for name in codebook.names[:n_past]):
        raise ValueError("frozen classes must precede the classes in play")
    return n_past


def register(
    codebook: Codebook, names: list[str], backbones: Backbones, config: TrainConfig
) -> Codebook:
    """``names`` appended with the initial values every site would compute for them."""
    model = StarPrompt(backbones, confidence_modulation=config.confidence_modulation)
    return codebook.register(model.new_entries(names, seed=config.seed))


def replay_first_level(
    codebook: Codebook, backbones: Backbones, config: TrainConfig, step: int
) -> Codebook:
    """First-level replay over every class's G_c; the classes in play get their final prompts
    and keys (frozen from now on)."""
    n_past = _past_prefix(codebook)
    model = StarPrompt(backbones, confidence_modulation=config.confidence_modulation)
    model.load_bank(codebook.bank())
    replay1(model, n_past, config, step)
    current = model.bank.entries(model.bank.names[n_past:], fields=("prompt", "key"))
    return codebook.set_values({entry.name: entry.values for entry in current})


def replay_head(
    codebook: Codebook, config: TrainConfig, step: int, freeze: Iterable[str], device: torch.device
) -> Codebook:
    """The prediction head of every class re-aligned by replay on every class's H_c (on
    ``device``); the classes ``freeze`` (the step's) are finished."""
    n_past = _past_prefix(codebook)
    bank = codebook.bank().to(device)
    replay2(bank, n_past, config, step)
    aligned = bank.entries(fields=("aligned_head_weight", "aligned_head_bias"))
    return codebook.set_values({entry.name: entry.values for entry in aligned}, freeze=freeze)
