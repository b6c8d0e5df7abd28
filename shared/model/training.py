"""Local training of one task, stage by stage (the loops a site runs on its own images).

Every function changes only the rows of the *current* classes — bank rows ``n_past:`` — and
reads past rows as frozen. Hyper-parameters default to the reference's Split CropDiseases
settings (DESIGN §1). Frozen-encoder work is done once: CLIP features of un-augmented images
are computed by the caller, cached, and passed in; only stage 2 needs CLIP features of
augmented views, which change every epoch.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from rich.progress import Progress

from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.config import Values
from starfed.shared.data.cropdiseases import augment, normalize, to_unit
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.first_level import first_level_logits
from starfed.shared.model.losses import (
    masked_cross_entropy,
    prompt_orthogonality_loss,
    query_orthogonality_loss,
)
from starfed.shared.model.replay import ReplayConfig, align_first_level, align_head
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.progress import progress_task

EVAL_BATCH_SIZE = 256


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one task (reference values for Split CropDiseases)."""

    batch_size: int = 128
    stage1_epochs: int = 5
    stage1_lr: float = 0.002  # SGD, no momentum
    lambda_op: float = 30.0
    stage2_epochs: int = 5
    stage2_lr: float = 0.001  # Adam, cosine schedule over epochs
    lambda_oq: float = 5.0
    replay1_epochs: int = 10
    replay1_lr: float = 0.01
    replay2_epochs: int = 10  # + replay2_epochs_per_task · task index
    replay2_epochs_per_task: int = 5
    replay2_lr: float = 0.001
    replay_samples: int = 256
    replay_batch_size: int = 128
    mixture_components: int = 5  # 1 = the paper's "unimodal" ablation
    generative_replay: bool = True
    confidence_modulation: bool = True
    seed: int = 1993

    @classmethod
    def from_config(cls, values: Values) -> TrainConfig:
        """The training knobs (and the seed) of a parsed config; a knob's key is its field's
        name with dashes. The other fields keep the reference values."""
        dashed = {f.name: f.name.replace("_", "-") for f in fields(cls)}
        return cls(**{name: values[key] for name, key in dashed.items() if key in values})

    def to_dict(self) -> dict:
        return asdict(self)


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


def phase_generator(seed: int, task: int, phase: str, round_index: int = 0) -> torch.Generator:
    """The random stream of one phase of one task: independent of where the phase runs.

    A single site and a federation (client phases on clients, replay on the server) draw the
    same numbers for the same phase, so their results can be compared exactly.
    """
    digest = hashlib.sha256(f"{seed}/{task}/{phase}/{round_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    return list(torch.randperm(n, generator=generator).split(batch_size))


@torch.no_grad()
def clip_features(backbones: Backbones, images: torch.Tensor) -> torch.Tensor:
    """Raw CLIP features of un-augmented uint8 images (compute once, then cache)."""
    views = Views.of(backbones)
    out = [
        backbones.clip_image_features(views.pair(to_unit(images[i : i + EVAL_BATCH_SIZE]))[1])
        for i in range(0, len(images), EVAL_BATCH_SIZE)
    ]
    return torch.cat(out) if out else torch.zeros(0, backbones.dims.d_clip)


def train_first_level(
    model: StarPrompt,
    image_features: torch.Tensor,
    labels: torch.Tensor,
    n_past: int,
    config: TrainConfig,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> None:
    """Stage 1: fit the current prompts p_c with CE (past masked) + λ₁·L_OP."""
    bank, rows = model.bank, slice(n_past, len(model))
    prompts = bank.prompts[rows].clone().requires_grad_(True)
    past_keys, past_prompts = bank.keys[:n_past], bank.prompts[:n_past]
    optimizer = torch.optim.SGD([prompts], lr=config.stage1_lr, momentum=0.0)
    batches_per_epoch = -(-len(labels) // config.batch_size)
    total = config.stage1_epochs * batches_per_epoch
    with progress_task(progress, "stage 1: prompts", total) as advance:
        for _ in range(config.stage1_epochs):
            for batch in _batches(len(labels), config.batch_size, generator):
                keys = torch.cat([past_keys, model.compute_keys(prompts, rows)])
                logits = first_level_logits(image_features[batch], keys, model.encoder.logit_scale)
                loss = masked_cross_entropy(logits, labels[batch], n_past)
                loss = loss + config.lambda_op * prompt_orthogonality_loss(prompts, past_prompts)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                advance()
    bank.set_rows("prompts", n_past, prompts)


def fit_mixtures(
    features: torch.Tensor,
    labels: torch.Tensor,
    rows: range,
    n_components: int,
    seed: int,
) -> list[GaussianMixture]:
    """One mixture per class row in ``rows`` from that class's features."""
    mixtures = []
    for row in rows:
        class_features = features[labels == row]
        if len(class_features) == 0:
            raise ValueError(f"no training features for class row {row}")
        mixtures.append(GaussianMixture.fit(class_features, n_components, seed=seed + row))
    return mixtures


def replay_first_level(
    model: StarPrompt,
    n_past: int,
    config: TrainConfig,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> None:
    """First-level generative replay: re-align current prompts against all seen keys."""
    bank, rows = model.bank, slice(n_past, len(model))
    if any(m is None for m in bank.clip_mixtures):
        raise ValueError("every seen class needs a CLIP-feature mixture before replay")
    embeds, eot = model.text_inputs(rows)
    aligned = align_first_level(
        model.encoder,
        list(bank.clip_mixtures),
        bank.keys[:n_past],
        bank.prompts[rows],
        embeds,
        eot,
        ReplayConfig(
            config.replay1_epochs,
            config.replay1_lr,
            config.replay_samples,
            config.replay_batch_size,
        ),
        generator,
        progress,
    )
    bank.set_rows("prompts", n_past, aligned)


@torch.no_grad()
def freeze_keys(model: StarPrompt, n_past: int) -> None:
    """Compute the current classes' keys once from their final prompts."""
    rows = slice(n_past, len(model))
    model.bank.set_rows("keys", n_past, model.compute_keys(model.bank.prompts[rows], rows))


def train_second_level(
    model: StarPrompt,
    images: torch.Tensor,
    labels: torch.Tensor,
    n_past: int,
    config: TrainConfig,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> None:
    """Stage 2: fit current A_c, Q_c and head rows with CE (past masked) + λ₂·L_OQ."""
    bank, views = model.bank, Views.of(model.backbones)
    current = {
        name: getattr(bank, name)[n_past:].clone().requires_grad_(True)
        for name in ("query_weights", "query_prompts", "head_weight", "head_bias")
    }
    past = {name: getattr(bank, name)[:n_past] for name in current}
    optimizer = torch.optim.Adam(current.values(), lr=config.stage2_lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.stage2_epochs)
    batches_per_epoch = -(-len(labels) // config.batch_size)

    def seen(name: str) -> torch.Tensor:
        return torch.cat([past[name], current[name]])

    total = config.stage2_epochs * batches_per_epoch
    with progress_task(progress, "stage 2: residual prompts", total) as advance:
        for _ in range(config.stage2_epochs):
            for batch in _batches(len(labels), config.batch_size, generator):
                vit_in, clip_in = views.pair(augment(images[batch], generator))
                z = model.backbones.clip_image_features(clip_in)
                out = model.second_level(vit_in, z, seen("query_weights"), seen("query_prompts"))
                logits = F.linear(out.features, seen("head_weight"), seen("head_bias"))
                loss = masked_cross_entropy(logits, labels[batch], n_past)
                loss = loss + config.lambda_oq * query_orthogonality_loss(
                    current["query_prompts"], past["query_prompts"]
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                advance()
            scheduler.step()
    for name, value in current.items():
        bank.set_rows(name, n_past, value)


@torch.no_grad()
def vit_features(
    model: StarPrompt, images: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Prompted final-LN CLS features; augmented views when a generator is given (as the
    reference fits H_c on its training loader, which augments)."""
    views = Views.of(model.backbones)
    out = []
    for i in range(0, len(images), EVAL_BATCH_SIZE):
        chunk = images[i : i + EVAL_BATCH_SIZE]
        unit = augment(chunk, generator) if generator is not None else to_unit(chunk)
        vit_in, clip_in = views.pair(unit)
        z = model.backbones.clip_image_features(clip_in)
        out.append(model.second_level(vit_in, z).features)
    return torch.cat(out) if out else torch.zeros(0, model.bank.dims.d_vit)


def replay_head(
    model: StarPrompt,
    task_index: int,
    config: TrainConfig,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> None:
    """Second-level generative replay: align a copy of the head; the copy predicts."""
    bank = model.bank
    if any(m is None for m in bank.vit_mixtures):
        raise ValueError("every seen class needs a ViT-feature mixture before replay")
    epochs = config.replay2_epochs + config.replay2_epochs_per_task * task_index
    weight, bias = align_head(
        bank.head_weight,
        bank.head_bias,
        list(bank.vit_mixtures),
        ReplayConfig(epochs, config.replay2_lr, config.replay_samples, config.replay_batch_size),
        generator,
        progress,
    )
    bank.aligned_head_weight, bank.aligned_head_bias = weight, bias


def use_real_head(model: StarPrompt) -> None:
    """Predict with the head trained on real data (first task, or replay disabled)."""
    bank = model.bank
    bank.aligned_head_weight = bank.head_weight.clone()
    bank.aligned_head_bias = bank.head_bias.clone()


# --- The phases of one task. A single site runs them in order (``learn_task``); in a
# federation the client runs stage 1/2 and their statistics, the server the alignments. Each
# phase draws from its own ``phase_generator`` stream, so both paths compute the same thing.


def stage1(
    model: StarPrompt,
    image_features: torch.Tensor,
    labels: torch.Tensor,
    n_past: int,
    config: TrainConfig,
    task: int,
    round_index: int = 0,
    progress: Progress | None = None,
) -> None:
    generator = phase_generator(config.seed, task, "stage1", round_index)
    train_first_level(model, image_features, labels, n_past, config, generator, progress)


def stage1_statistics(
    model: StarPrompt,
    image_features: torch.Tensor,
    labels: torch.Tensor,
    n_past: int,
    config: TrainConfig,
    task: int,
) -> None:
    """Fit G_c of the current classes on their (un-augmented) CLIP features."""
    rows = range(n_past, len(model))
    model.bank.clip_mixtures[n_past:] = fit_mixtures(
        image_features, labels, rows, config.mixture_components, mixture_seed(config.seed, task)
    )


def first_level_alignment(
    model: StarPrompt, n_past: int, config: TrainConfig, task: int, progress: Progress | None = None
) -> None:
    """First-level replay (unless disabled), then freeze the current classes' keys."""
    if config.generative_replay:
        generator = phase_generator(config.seed, task, "replay1")
        replay_first_level(model, n_past, config, generator, progress)
    freeze_keys(model, n_past)


def stage2(
    model: StarPrompt,
    images: torch.Tensor,
    labels: torch.Tensor,
    n_past: int,
    config: TrainConfig,
    task: int,
    round_index: int = 0,
    progress: Progress | None = None,
) -> None:
    generator = phase_generator(config.seed, task, "stage2", round_index)
    train_second_level(model, images, labels, n_past, config, generator, progress)


def stage2_statistics(
    model: StarPrompt,
    images: torch.Tensor,
    labels: torch.Tensor,
    n_past: int,
    config: TrainConfig,
    task: int,
) -> None:
    """Fit H_c of the current classes on prompted CLS features of augmented views."""
    features = vit_features(model, images, phase_generator(config.seed, task, "stage2_stats"))
    rows = range(n_past, len(model))
    model.bank.vit_mixtures[n_past:] = fit_mixtures(
        features, labels, rows, config.mixture_components, mixture_seed(config.seed, task)
    )


def head_alignment(
    model: StarPrompt, config: TrainConfig, task: int, progress: Progress | None = None
) -> None:
    """Head replay from the second task on (unless disabled); otherwise the real-data head."""
    if config.generative_replay and task > 0:
        replay_head(model, task, config, phase_generator(config.seed, task, "replay2"), progress)
    else:
        use_real_head(model)


def learn_task(
    model: StarPrompt,
    images: torch.Tensor,
    labels: torch.Tensor,
    image_features: torch.Tensor,
    n_past: int,
    task: int,
    config: TrainConfig,
    progress: Progress | None = None,
) -> None:
    """Everything a single site does for one task, in the reference's order.

    Stage 1 → G_c fit → first-level replay → key freezing → stage 2 → H_c fit → head replay.
    ``labels`` are bank rows in ``[n_past, len(model))``; ``image_features`` are the cached
    CLIP features of the un-augmented ``images``.
    """
    stage1(model, image_features, labels, n_past, config, task, progress=progress)
    stage1_statistics(model, image_features, labels, n_past, config, task)
    first_level_alignment(model, n_past, config, task, progress)
    stage2(model, images, labels, n_past, config, task, progress=progress)
    stage2_statistics(model, images, labels, n_past, config, task)
    head_alignment(model, config, task, progress)
    add_counts(model, labels, n_past)


def add_counts(model: StarPrompt, labels: torch.Tensor, n_past: int) -> None:
    """Record how many training examples each current class had."""
    for row in range(n_past, len(model)):
        model.bank.counts[row] += int((labels == row).sum())


def mixture_seed(seed: int, task: int) -> int:
    """k-means seed of the mixtures fitted in one task."""
    return seed + 1000 * task
