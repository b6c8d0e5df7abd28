"""Generative replay's objectives and loop: training on features sampled from class mixtures.

After each task, features of every seen class are sampled from its mixture (256 per class per
epoch, redrawn every epoch, shuffled, batches of 128) and used to (the steps ``replay1`` and
``replay2`` in ``starfed.shared.model.training``)

* first level: train the *current* prompts p_c against the keys of all seen classes (past keys
  fixed), so new keys do not steal past classes' images; the keys are then frozen;
* second level: train a copy of the head on LogitNorm-ed logits for 10 + 5·t epochs; the
  aligned copy is used for prediction while the next task resumes from the real-data head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.progress import Progress

from starfed.shared.codebook.mixture import GaussianMixture, sample_replay_features
from starfed.shared.model.first_level import TextKeyEncoder, first_level_logits
from starfed.shared.model.losses import logit_norm
from starfed.shared.progress import progress_task


@dataclass(frozen=True)
class ReplayConfig:
    epochs: int
    lr: float
    samples_per_class: int = 256
    batch_size: int = 128


def first_level_replay_loss(
    encoder: TextKeyEncoder,
    features: torch.Tensor,
    labels: torch.Tensor,
    past_keys: torch.Tensor,
    current_prompts: torch.Tensor,
    current_embeds: torch.Tensor,
    current_eot: torch.Tensor,
) -> torch.Tensor:
    """CE of normalised synthetic CLIP features against all seen keys (past ones fixed)."""
    keys = torch.cat([past_keys.detach(), encoder(current_prompts, current_embeds, current_eot)])
    logits = first_level_logits(F.normalize(features, dim=-1), keys, encoder.logit_scale)
    return F.cross_entropy(logits, labels)


def head_replay_loss(
    features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """CE of LogitNorm-ed head logits on synthetic ViT features."""
    return F.cross_entropy(logit_norm(F.linear(features, weight, bias)), labels)


def replay_epochs(
    mixtures: list[GaussianMixture],
    config: ReplayConfig,
    params: list[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    generator: torch.Generator,
    description: str,
    progress: Progress | None,
) -> None:
    """SGD (no momentum, no weight decay) over freshly sampled features each epoch."""
    optimizer = torch.optim.SGD(params, lr=config.lr, momentum=0.0, weight_decay=0.0)
    with progress_task(progress, description, config.epochs) as advance:
        for _ in range(config.epochs):
            features, labels = sample_replay_features(mixtures, config.samples_per_class, generator)
            features, labels = features.to(params[0].device), labels.to(params[0].device)
            order = torch.randperm(len(labels), generator=generator)
            for batch in order.split(config.batch_size):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(features[batch], labels[batch]).backward()
                optimizer.step()
            advance()
