"""Local training of one task, one function per step, named after its protocol phase.

A site runs ``stage1``, ``stage1_stats``, ``stage2`` and ``stage2_stats`` on its own images; the
replays ``replay1`` and ``replay2`` (``starfed.shared.model.replay``) run where the mixtures of all
classes are, on the server or on a single site (``learn_task`` runs all six in order). Each step
draws from its own random stream (``phase_generator``), so a federation and a single site compute
the same thing. Every step changes only the rows of the *current* classes — bank rows
``n_past:`` — and reads past rows as frozen. Hyper-parameters default to the reference's Split
CropDiseases settings (docs/model.md). Frozen-encoder work is done once: CLIP features of
un-augmented images are computed by the caller, cached, and passed in; only stage 2 needs CLIP
features of augmented views, which change every epoch.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import Progress
from torch.func import grad, vmap

from starfed.shared.codebook import schema
from starfed.shared.codebook.entry import ClassBank
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.codebook.mixture_fit import fit_on
from starfed.shared.config import Options, environment, knob
from starfed.shared.data.images import augment, augment_each
from starfed.shared.knob import as_bool
from starfed.shared.model.features import Views, vit_features
from starfed.shared.model.first_level import first_level_logits
from starfed.shared.model.losses import (
    masked_cross_entropy,
    prompt_orthogonality_loss,
    query_orthogonality_loss,
)
from starfed.shared.model.replay import (
    SCHEDULES,
    ReplayConfig,
    ReplayProblem,
    ReplaySchedule,
    ReplayWork,
    first_level_replay_loss,
    head_replay_loss,
)
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.privacy.accountant import Sampling
from starfed.shared.privacy.mechanisms import private_gradient
from starfed.shared.progress import progress_task
from starfed.shared.protocol import SPECS, Phase


def fused_adam() -> bool:
    """``STARFED_FUSED_ADAM=1``: stage 2's Adam updates all its tensors in one fused kernel
    (``fused=True``) instead of a loop of small ones, which are launch-bound on a GPU (issue 37).
    Off until a GPU measures it; on the CPU it agrees with the default to float32 rounding.
    Read when stage 2 builds its optimizer, not at import: no module global to patch."""
    return as_bool(environment(), "fused-adam")


@dataclass(frozen=True)
class TrainConfig(Options):
    """Hyper-parameters of one task (reference values for Split CropDiseases). The knobs'
    fields take their defaults from the knob table; the others are the reference's."""

    batch_size: int = knob("batch-size")
    stage1_epochs: int = knob("stage1-epochs")
    stage1_lr: float = 0.002  # SGD, no momentum
    lambda_op: float = 30.0
    stage2_epochs: int = knob("stage2-epochs")
    stage2_lr: float = 0.001  # Adam, cosine schedule over epochs
    lambda_oq: float = 5.0
    replay1_epochs: int = knob("replay1-epochs")
    replay1_lr: float = 0.01
    replay2_epochs: int = knob("replay2-epochs")  # + replay2_epochs_per_task · task index
    replay2_epochs_per_task: int = knob("replay2-epochs-per-task")
    replay2_lr: float = 0.001
    replay_samples: int = 256
    replay_batch_size: int = 128
    replay_schedule: ReplaySchedule = knob("replay-schedule", ReplaySchedule)  # noqa: RUF009
    replay1_steps: int = knob("replay1-steps")  # the bounded schedule's budget, first level
    replay2_steps: int = knob("replay2-steps")  # the bounded schedule's budget, head
    mixture_components: int = knob("mixture-components")  # 1 = the paper's "unimodal" ablation
    generative_replay: bool = knob("generative-replay", table="train-local")  # federation: strategy
    confidence_modulation: bool = knob("confidence-modulation")
    seed: int = knob("seed")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def replay_config(self, epochs: int, lr: float, steps: int, task: int) -> ReplayConfig:
        """One replay's settings: its epochs, rate and bounded budget, the shared sampling, and
        the schedule task ``task`` replays with."""
        return ReplayConfig(
            epochs,
            lr,
            self.replay_samples,
            self.replay_batch_size,
            self.replay_schedule.at(task),
            steps,
        )


def phase_generator(
    seed: int, task: int, stream: str | None, round_index: int = 0
) -> torch.Generator:
    """The random stream of one step of one task: independent of where the step runs.

    A single site and a federation (site phases on sites, replay on the server) draw the same
    numbers for the same step, so their results can be compared exactly. Stream names are the
    protocol table's (``starfed.shared.protocol.PHASES``).
    """
    digest = hashlib.sha256(f"{seed}/{task}/{stream}/{round_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    return list(torch.randperm(n, generator=generator).split(batch_size))


@dataclass(frozen=True)
class PrivateSteps:
    """DP-SGD in a private site's training step (docs/security.md#differential-privacy).

    ``sampling.steps`` steps, ``sampling.steps / epochs`` an epoch; each takes every protected
    unit (an image, or a patient's images) with probability ``sampling.rate`` (Poisson),
    clips each taken unit's gradient to ``clip`` and adds noise ``noise_multiplier`` × ``clip``
    to their sum (``private_gradient``), then divides by ``expected``, the images a step takes
    on average by the released counts (public). One unit moves a step's sum by at most
    ``clip`` whatever the parameters, so the step is a Gaussian mechanism on a Poisson sample
    and what the phase releases is post-processing of the steps. ``rng`` is secret (the
    operating system's entropy): the sampling, the noise and stage 2's views are drawn from
    it, each view from a step's seed and its image (``augment_each``)."""

    units: torch.Tensor  # the protected unit of each of the task's images, 0..U-1
    sampling: Sampling
    clip: float
    noise_multiplier: float
    expected: float
    rng: np.random.Generator

    def sample(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One step's Poisson sample of the units: the images taken (indices into the task's),
        the taken unit each belongs to (0..m−1) and m."""
        count = int(self.units.max()) + 1 if len(self.units) else 0
        taken = torch.from_numpy(self.rng.random(count) < self.sampling.rate)
        images = torch.nonzero(taken[self.units]).squeeze(1)
        rank = torch.cumsum(taken.long(), 0) - 1  # a taken unit's place among the taken
        return images, rank[self.units[images]], int(taken.sum())

    def seed(self) -> int:
        """A fresh secret seed of the views of a step's images."""
        return int(self.rng.integers(2**62))


@dataclass(frozen=True)
class StepLoss:
    """A training phase's loss, split where DP-SGD needs it: ``inputs(batch)``, what the
    batch's images give (features, views, labels: nothing trained, drawn once a step), and
    ``of(trained, *inputs)``, the batch's mean loss from them and the ``trained`` tensors by
    name (those the optimizer steps). Split so that a private site's per-image gradients are
    one ``vmap`` of ``grad`` over the inputs (``unit_gradients``); a site that is not private
    calls the two in turn, the same operations as one closure."""

    trained: dict[str, torch.Tensor]
    inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    of: Callable[..., torch.Tensor]

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.of(self.trained, *self.inputs(batch))


def unit_gradients(
    loss: StepLoss, images: torch.Tensor, units: torch.Tensor, count: int
) -> list[torch.Tensor]:
    """Each of ``count`` units' gradient of its images' summed loss (``units``: the unit of each
    of ``images``), one ``[count, *shape]`` tensor per trained tensor.

    Every image's gradient at once — ``torch.func``'s ``vmap`` of ``grad`` of the loss of a
    batch of one (a mean over one image: its own loss, plus the data-free regulariser) — then
    summed per unit (``index_add_``): a patient's images are one unit, clipped together. The
    frozen towers run batched under ``vmap``; where the trained tensors enter once for the
    whole batch (stage 1's prompts through the text tower), the forward runs once and only
    the backward is per image."""
    trained = {name: t.detach() for name, t in loss.trained.items()}
    sums = [torch.zeros(count, *t.shape, dtype=t.dtype, device=t.device) for t in trained.values()]
    if count == 0:
        return sums
    inputs = loss.inputs(images)

    def image_loss(at: dict[str, torch.Tensor], *one: torch.Tensor) -> torch.Tensor:
        return loss.of(at, *(x.unsqueeze(0) for x in one))

    with warnings.catch_warnings():  # attention's batching falls back to a loop: measured
        warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)
        per_image = vmap(grad(image_loss), in_dims=(None, *(0,) * len(inputs)))(trained, *inputs)
    for total, name in zip(sums, trained, strict=True):
        total.index_add_(0, units.to(total.device), per_image[name])
    return sums


@dataclass(frozen=True)
class TaskTraining:
    """What every site step of one task is given: the model whose current rows (``n_past:``)
    it trains, the bank row of each of the task's images (``labels``), the settings, the task
    and round that key the step's random stream (``phase_generator``; the statistics steps
    have one round), and the progress line. Built by the caller: a site's handler per phase,
    ``learn_task`` once a task."""

    model: StarPrompt
    labels: torch.Tensor
    n_past: int
    config: TrainConfig
    task: int
    round_index: int = 0
    progress: Progress | None = None
    private: PrivateSteps | None = None  # a private site's training: DP-SGD

    def generator(self, phase: Phase) -> torch.Generator:
        """``phase``'s site stream in this task and round."""
        stream = SPECS[phase].site_stream
        return phase_generator(self.config.seed, self.task, stream, self.round_index)

    def with_labels(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs`` (the task's images or their features) and the labels, where the model
        computes."""
        return inputs.to(self.model.device), self.labels.to(self.model.device)

    def train(
        self,
        epochs: int,
        generator: torch.Generator,
        optimizer: torch.optim.Optimizer,
        loss: StepLoss,
        description: str,
        after_epoch: Callable[[], object] | None = None,
    ) -> None:
        """``epochs`` passes over the task's images, each in batches of a fresh permutation
        drawn from ``generator``: one optimizer step per batch on ``loss(batch)`` (the
        batch's image indices), the progress line advanced per batch; ``after_epoch``: called
        after each pass (stage 2's schedule). A private site's steps are DP-SGD's instead."""
        if self.private is not None:
            self.train_privately(self.private, epochs, optimizer, loss, description, after_epoch)
            return
        n, size = len(self.labels), self.config.batch_size
        with progress_task(self.progress, description, epochs * -(-n // size)) as advance:
            for _ in range(epochs):
                for batch in _batches(n, size, generator):
                    value = loss(batch)
                    optimizer.zero_grad(set_to_none=True)
                    value.backward()
                    optimizer.step()
                    advance()
                if after_epoch is not None:
                    after_epoch()

    def train_privately(
        self,
        dp: PrivateSteps,
        epochs: int,
        optimizer: torch.optim.Optimizer,
        loss: StepLoss,
        description: str,
        after_epoch: Callable[[], object] | None = None,
    ) -> None:
        """``train``'s DP-SGD steps: a unit's gradient is that of its images' summed loss
        (``unit_gradients``), so the noisy sum over the expected images is a mean gradient
        like ``train``'s. ``loss.trained`` are the optimizer's tensors, in its order."""
        params = list(loss.trained.values())
        per_epoch = max(1, dp.sampling.steps // epochs)
        std = dp.noise_multiplier * dp.clip
        with progress_task(self.progress, description, dp.sampling.steps) as advance:
            for step in range(dp.sampling.steps):
                gradients = unit_gradients(loss, *dp.sample())
                noisy = private_gradient(gradients, params, dp.clip, std, dp.rng)
                for param, gradient in zip(params, noisy, strict=True):
                    param.grad = gradient / dp.expected
                optimizer.step()
                advance()
                if after_epoch is not None and (step + 1) % per_epoch == 0:
                    after_epoch()


def stage1(on: TaskTraining, image_features: torch.Tensor) -> None:
    """Fit the current prompts p_c with CE (past masked) + λ₁·L_OP."""
    model, n_past, config = on.model, on.n_past, on.config
    generator = on.generator(Phase.STAGE1)
    image_features, labels = on.with_labels(image_features)
    bank, rows = model.bank, slice(n_past, len(model))
    prompts = bank["prompt"][rows].clone().requires_grad_(True)
    past_keys, past_prompts = bank["key"][:n_past], bank["prompt"][:n_past]
    optimizer = torch.optim.SGD([prompts], lr=config.stage1_lr, momentum=0.0)

    def inputs(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return image_features[batch], labels[batch]

    def loss_of(
        trained: dict[str, torch.Tensor], features: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        current = trained["prompt"]
        keys = torch.cat([past_keys, model.compute_keys(current, rows)])
        logits = first_level_logits(features, keys, model.encoder.logit_scale)
        loss = masked_cross_entropy(logits, targets, n_past)
        return loss + config.lambda_op * prompt_orthogonality_loss(current, past_prompts)

    loss = StepLoss({"prompt": prompts}, inputs, loss_of)
    on.train(config.stage1_epochs, generator, optimizer, loss, "stage 1: prompts")
    bank.set_rows("prompt", n_past, prompts)


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


#: How a statistics step turns features into its classes' mixtures: ``fit_mixtures``'s
#: signature (a private site passes its own, ``starfed.client.privacy``).
MixtureFit = Callable[[torch.Tensor, torch.Tensor, range, int, int], list[GaussianMixture]]


def mixture_fit_for(device: torch.device) -> MixtureFit:
    """The statistics steps' fit where the model computes: on a CUDA GPU every class at once in
    torch (``starfed.shared.codebook.mixture_fit``: the CPU fits left the card idle, issue 37);
    elsewhere scikit-learn's, one class at a time (the reference point: the CPU codebook stays
    as it was)."""
    return fit_on(device) if device.type == "cuda" else fit_mixtures


def replay1(
    model: StarPrompt,
    n_past: int,
    config: TrainConfig,
    task: int,
    progress: Progress | None = None,
) -> ReplayWork:
    """First-level replay (unless disabled), then the current keys computed once and frozen.

    The current prompts are trained against the keys of all seen classes (past ones fixed) on
    features sampled from every seen class's G_c, so new keys do not steal past classes' images.
    """
    bank, rows = model.bank, slice(n_past, len(model))
    work = ReplayWork(0, 0)
    if config.generative_replay:
        if any(m is None for m in bank["clip_mixture"]):
            raise ValueError("every seen class needs a CLIP-feature mixture before replay")
        embeds, eot = model.text_inputs(rows)
        past_keys = bank["key"][:n_past]
        prompts = bank["prompt"][rows].detach().clone().requires_grad_(True)

        def loss_fn(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return first_level_replay_loss(
                model.encoder, features, labels, past_keys, prompts, embeds, eot
            )

        generator = phase_generator(config.seed, task, SPECS[Phase.STAGE1_STATS].server_stream)
        replay = config.replay_config(
            config.replay1_epochs, config.replay1_lr, config.replay1_steps, task
        )
        problem = ReplayProblem(
            list(bank["clip_mixture"]), [prompts], loss_fn, generator, "replay: prompts", progress
        )
        work = SCHEDULES[replay.schedule](problem, replay)
        bank.set_rows("prompt", n_past, prompts)
    with torch.no_grad():
        bank.set_rows("key", n_past, model.compute_keys(bank["prompt"][rows], rows))
    return work


def stage2(on: TaskTraining, images: torch.Tensor) -> None:
    """Fit the current A_c, Q_c and head rows with CE (past masked) + λ₂·L_OQ."""
    model, n_past, config = on.model, on.n_past, on.config
    generator = on.generator(Phase.STAGE2)
    images, labels = on.with_labels(images)
    bank, views = model.bank, Views.of(model.backbones)
    current = {  # the fields stage 2 trains, as the schema lists them
        name: bank[name][n_past:].clone().requires_grad_(True)
        for name in schema.trained_in(Phase.STAGE2)
    }
    past = {name: bank[name][:n_past] for name in current}
    optimizer = torch.optim.Adam(current.values(), lr=config.stage2_lr, fused=fused_adam() or None)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.stage2_epochs)

    def views_of(batch: torch.Tensor) -> torch.Tensor:
        if on.private is None:
            return augment(images[batch], generator)
        return augment_each(images[batch], on.private.seed())  # a step's: each image's own

    def inputs(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vit_in, clip_in = views.pair(views_of(batch))
        return vit_in, model.backbones.clip_image_features(clip_in), labels[batch]

    def loss_of(
        trained: dict[str, torch.Tensor],
        vit_in: torch.Tensor,
        z: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        def seen(name: str) -> torch.Tensor:
            return torch.cat([past[name], trained[name]])

        out = model.second_level(vit_in, z, seen("query_weight"), seen("query_prompt"))
        logits = F.linear(out.features, seen("head_weight"), seen("head_bias"))
        loss = masked_cross_entropy(logits, targets, n_past)
        return loss + config.lambda_oq * query_orthogonality_loss(
            trained["query_prompt"], past["query_prompt"]
        )

    description = "stage 2: residual prompts"
    loss = StepLoss(current, inputs, loss_of)
    on.train(config.stage2_epochs, generator, optimizer, loss, description, scheduler.step)
    for name, value in current.items():
        bank.set_rows(name, n_past, value)


def _fit_current(
    on: TaskTraining, field_name: str, features: torch.Tensor, fit: MixtureFit | None
) -> None:
    """``field_name``'s mixtures of the current classes fitted on ``features`` (``fit``: the
    device's, ``mixture_fit_for``, unless given), one k-means seed per task."""
    fit = fit or mixture_fit_for(on.model.device)
    rows = range(on.n_past, len(on.model))
    seed = mixture_seed(on.config.seed, on.task)
    mixtures = fit(features, on.labels, rows, on.config.mixture_components, seed)
    on.model.bank.set_rows(field_name, on.n_past, mixtures)


def stage1_stats(
    on: TaskTraining, image_features: torch.Tensor, fit: MixtureFit | None = None
) -> None:
    """Fit G_c of the current classes on their (un-augmented) CLIP features (``fit``: the
    device's, ``mixture_fit_for``, unless given)."""
    _fit_current(on, "clip_mixture", image_features, fit)


def stage2_stats(
    on: TaskTraining, images: torch.Tensor, fit: MixtureFit | None = None, per_image: bool = False
) -> None:
    """Fit H_c of the current classes on prompted CLS features of augmented views (``fit``:
    the device's, ``mixture_fit_for``, unless given).

    ``per_image`` (a private site): each image's view is drawn from the phase's seed and the
    image itself (``augment_each``), so removing an image moves no other image's features and
    no other class's H_c; otherwise the views are drawn in chunks from the phase's stream (of
    round 0: the statistics steps have one round).
    """
    generator = phase_generator(on.config.seed, on.task, SPECS[Phase.STAGE2_STATS].site_stream)
    if per_image:
        seed = int(torch.randint(2**62, (1,), generator=generator))
        features = vit_features(on.model, images, lambda chunk: augment_each(chunk, seed))
    else:
        features = vit_features(on.model, images, lambda chunk: augment(chunk, generator))
    _fit_current(on, "vit_mixture", features, fit)


def head_start(
    bank: ClassBank, n_past: int, schedule: ReplaySchedule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where head replay starts: the real-data head (reference), or the last aligned head of
    the past classes — already aligned with each other — with the current classes' real-data
    rows (bounded: only the new rows need aligning, so a fixed budget suffices)."""
    weight, bias = bank["head_weight"], bank["head_bias"]
    if schedule is ReplaySchedule.BOUNDED:
        weight = torch.cat([bank["aligned_head_weight"][:n_past], weight[n_past:]])
        bias = torch.cat([bank["aligned_head_bias"][:n_past], bias[n_past:]])
    return weight.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)


def replay2(
    bank: ClassBank,
    n_past: int,
    config: TrainConfig,
    task: int,
    progress: Progress | None = None,
) -> ReplayWork:
    """The head that predicts: a copy of the real-data head aligned by replay on every seen
    class's H_c for 10 + 5·t epochs (from the second task on, unless disabled), else the
    real-data head itself. The next task resumes from the real-data head."""
    if not (config.generative_replay and task > 0):
        bank["aligned_head_weight"] = bank["head_weight"].clone()
        bank["aligned_head_bias"] = bank["head_bias"].clone()
        return ReplayWork(0, 0)
    if any(m is None for m in bank["vit_mixture"]):
        raise ValueError("every seen class needs a ViT-feature mixture before replay")
    epochs = config.replay2_epochs + config.replay2_epochs_per_task * task
    replay = config.replay_config(epochs, config.replay2_lr, config.replay2_steps, task)
    weight, bias = head_start(bank, n_past, replay.schedule)

    def loss_fn(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return head_replay_loss(features, labels, weight, bias)

    generator = phase_generator(config.seed, task, SPECS[Phase.STAGE2_STATS].server_stream)
    problem = ReplayProblem(
        list(bank["vit_mixture"]), [weight, bias], loss_fn, generator, "replay: head", progress
    )
    work = SCHEDULES[replay.schedule](problem, replay)
    bank["aligned_head_weight"], bank["aligned_head_bias"] = weight.detach(), bias.detach()
    return work


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

    Stage 1 → G_c fit → first-level replay and key freezing → stage 2 → H_c fit → head
    replay. ``labels`` are bank rows in ``[n_past, len(model))``; ``image_features`` are the
    cached CLIP features of the un-augmented ``images``.
    """
    on = TaskTraining(model, labels, n_past, config, task, progress=progress)
    stage1(on, image_features)
    stage1_stats(on, image_features)
    replay1(model, n_past, config, task, progress)
    stage2(on, images)
    stage2_stats(on, images)
    replay2(model.bank, n_past, config, task, progress)
    add_counts(model, labels, n_past)


def add_counts(model: StarPrompt, labels: torch.Tensor, n_past: int) -> None:
    """Record how many training examples each current class had."""
    for row in range(n_past, len(model)):
        model.bank.counts[row] += int((labels == row).sum())


def mixture_seed(seed: int, task: int) -> int:
    """k-means seed of the mixtures fitted in one task."""
    return seed + 1000 * task
