"""The site side of every protocol phase, without Flower: one site's data, caches and training.

A ``Site`` answers the server's phases for one global step; ``HANDLERS`` maps each training or
statistics phase to its step (``starfed.shared.model.training``). Its task stream (which classes
it holds now) comes from the scenario; its memory across messages and runs lives on disk under
``cache_dir`` (decoded images, CLIP features), because in deployment every message starts a
fresh process. Only codebook updates leave it: prompts, head rows and mixture statistics.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.data.cropdiseases import DecodedImages, decode_images
from starfed.shared.data.scenario import Scenario
from starfed.shared.files import write_atomic
from starfed.shared.model import training
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.evaluation import TaskScores, evaluate_decoded
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, clip_features
from starfed.shared.protocol import Phase

logger = logging.getLogger(__name__)


@dataclass
class TaskData:
    """A site's training images of one task, with cached CLIP features."""

    images: torch.Tensor  # uint8 [N, 3, S, S]
    names: list[str]  # class name of each image
    features: torch.Tensor  # raw CLIP features of the un-augmented images
    counts: Counter[str]  # images per class


@dataclass
class LocalView:
    """The codebook re-ordered for local training: context classes first, own classes last."""

    model: StarPrompt
    n_past: int
    own: list[str]
    labels: torch.Tensor  # local row of each training image this site trains on
    mine: torch.Tensor  # bool mask over the task's images: those of the own classes


class Site:
    """One client: a partition of the scenario, frozen backbones and on-disk caches."""

    def __init__(
        self,
        scenario: Scenario,
        client: int,
        backbones: Backbones,
        config: TrainConfig,
        cache_dir: Path,
    ) -> None:
        self.scenario = scenario
        self.client = client
        self.backbones = backbones
        self.config = config
        self.cache_dir = Path(cache_dir)
        self._tasks: dict[int, TaskData] = {}

    @property
    def fingerprint(self) -> str:
        return self.backbones.fingerprint

    # --- data -------------------------------------------------------------------------------

    def task_at(self, step: int) -> int | None:
        return self.scenario.task_at(self.client, step)

    def class_counts(self, step: int) -> dict[str, int]:
        """Classes this site holds training images of at ``step``, with their counts."""
        task = self.task_at(step)
        if task is None:
            return {}
        return dict(self.task_data(task).counts)

    def _decode(self, samples: list[tuple[str, int]]) -> DecodedImages:
        return decode_images(
            samples, self.backbones.config.image_size, self.cache_dir / "images", progress=False
        )

    def task_data(self, task: int) -> TaskData:
        if task not in self._tasks:
            decoded = self._decode(self.scenario.train_samples(self.client, task))
            folders = self.scenario.split.class_folders
            names = [folders[int(label)] for label in decoded.labels]
            features = self._cached_features(decoded)
            self._tasks[task] = TaskData(decoded.images, names, features, Counter(names))
        return self._tasks[task]

    def _cached_features(self, decoded: DecodedImages) -> torch.Tensor:
        """CLIP features of un-augmented images, computed once per backbone and image set."""
        key = hashlib.sha256("\n".join([self.fingerprint, *decoded.paths]).encode()).hexdigest()
        path = self.cache_dir / "features" / f"{key[:32]}.npy"
        if path.is_file():
            return torch.from_numpy(np.load(path, allow_pickle=False))
        features = clip_features(self.backbones, decoded.images)
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, features.numpy(), allow_pickle=False)
        write_atomic(path, buffer.getvalue())
        return features

    # --- phases -----------------------------------------------------------------------------

    def _view(self, codebook: Codebook, step: int, with_in_progress: bool) -> LocalView | None:
        """Local model: frozen classes (and, in stage 2, other sites' current classes) as
        fixed context, then this site's trainable classes. None when it has nothing to train."""
        task = self.task_at(step)
        if task is None:
            return None
        data = self.task_data(task)
        frozen = codebook.frozen
        own = [name for name in codebook.names if name in data.counts and name not in frozen]
        unknown = set(data.counts) - set(codebook.names)
        if unknown:
            logger.info("site %d: classes not registered by the server: %s", self.client, unknown)
        if not own:
            return None
        context = [
            name
            for name in codebook.names
            if name not in own and (name in frozen or with_in_progress)
        ]
        model = StarPrompt(self.backbones, confidence_modulation=self.config.confidence_modulation)
        model.load_bank(codebook.bank(context + own))
        row = {name: i for i, name in enumerate(model.bank.names)}
        own_set = set(own)
        mine = torch.tensor([name in own_set for name in data.names])
        labels = torch.tensor([row[name] for name in data.names if name in own_set])
        for name in own:
            model.bank.counts[row[name]] = data.counts[name]
        return LocalView(model, len(context), own, labels, mine)

    def sync(self, step: int) -> ClientUpdate:
        """The classes of the site's task at ``step``: names, counts and class-order positions
        (the server registers new classes in this order)."""
        counts = self.class_counts(step)
        folders = self.scenario.split.class_folders
        task = self.task_at(step)
        return ClientUpdate(
            self.fingerprint,
            self.backbones.dims,
            Phase.SYNC,
            base_version=0,
            entries=[ClassEntry(name, count) for name, count in counts.items()],
            class_order=[folders.index(name) for name in counts],
            metadata={"task": str(-1 if task is None else task)},
        )

    def run_phase(self, phase: Phase, codebook: Codebook, step: int, round_index: int = 0):
        """Train or fit statistics for ``phase``; the update carries this site's classes."""
        in_stage2 = phase in (Phase.STAGE2, Phase.STAGE2_STATS)
        view = self._view(codebook, step, with_in_progress=in_stage2)
        entries = []
        if view is not None:
            task = self.task_at(step)
            data = self.task_data(task)
            images, features = data.images[view.mine], data.features[view.mine]
            HANDLERS[phase](view, images, features, self.config, task, round_index)
            entries = view.model.bank.entries(view.own, fields=schema.trained_in(phase))
        return ClientUpdate(self.fingerprint, codebook.dims, phase, codebook.version, entries)

    def evaluate(self, codebook: Codebook, step: int) -> TaskScores | None:
        """Accuracy on the site's own test images of every task it has seen so far."""
        task = self.task_at(step)
        if task is None or len(codebook) == 0:
            return None
        model = StarPrompt(self.backbones, confidence_modulation=self.config.confidence_modulation)
        model.load_bank(codebook.bank())
        test = self._decode(self.scenario.test_samples(self.client, range(task + 1)))
        features = clip_features(self.backbones, test.images)
        return evaluate_decoded(model, test, features, self.scenario.split, task + 1)


# The site's step of each training or statistics phase: (view, images of its classes, their
# CLIP features, config, task, round) -> None, training the view's model in place.
HANDLERS: dict[Phase, Callable[..., None]] = {
    Phase.STAGE1: lambda view, images, features, config, task, round_index: training.stage1(
        view.model, features, view.labels, view.n_past, config, task, round_index
    ),
    Phase.STAGE1_STATS: lambda view, images, features, config, task, _: training.stage1_stats(
        view.model, features, view.labels, view.n_past, config, task
    ),
    Phase.STAGE2: lambda view, images, features, config, task, round_index: training.stage2(
        view.model, images, view.labels, view.n_past, config, task, round_index
    ),
    Phase.STAGE2_STATS: lambda view, images, features, config, task, _: training.stage2_stats(
        view.model, images, view.labels, view.n_past, config, task
    ),
}
