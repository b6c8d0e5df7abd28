"""A site and its side of every protocol phase, without Flower.

A site's tasks are the task folders of its data folder, in order (``SiteFolder``,
docs/sites.md); its current task is the first whose classes are not all finished (frozen) in
the federation, so a new folder is picked up at the next step and a site that was offline
catches up. Its memory — the last codebook, its completed tasks — is its state folder
(``SiteMemory``); decoded images and CLIP features are cached on disk. ``HANDLERS`` maps each
training or statistics phase to its step (``starfed.shared.model.training``). Only codebook
updates and evaluation counts leave a site: prompts, head rows, mixture statistics.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from starfed.client.memory import SiteMemory
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.data.images import DecodedImages, decode_images
from starfed.shared.data.site_folder import SiteFolder, SiteTask, class_key
from starfed.shared.files import write_atomic
from starfed.shared.model import training
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.evaluation import score_classes
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig, clip_features, clip_features_signature
from starfed.shared.protocol import Phase
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)


@dataclass
class TaskData:
    """A site's training images of one task, with cached CLIP features."""

    images: torch.Tensor  # uint8 [N, 3, S, S]
    keys: list[str]  # class key of each image
    features: torch.Tensor  # raw CLIP features of the un-augmented images
    counts: Counter[str]  # images per class key


@dataclass
class LocalView:
    """The codebook re-ordered for local training: context classes first, own classes last."""

    model: StarPrompt
    n_past: int
    own: list[str]  # codebook names of the classes this site trains
    labels: torch.Tensor  # local row of each training image this site trains on
    mine: torch.Tensor  # bool mask over the task's images: those of the own classes


class Site:
    """One site: its data folder, its state folder, the frozen backbones."""

    def __init__(
        self,
        name: str,
        data_dir: str | Path,
        memory: SiteMemory,
        backbones: Backbones,
        config: TrainConfig,
        cache_dir: str | Path,
        before_scan: Callable[[int], None] | None = None,
    ) -> None:
        self.name = name
        self.data_dir = Path(data_dir)
        self.memory = memory
        self.backbones = backbones
        self.config = config
        self.cache_dir = Path(cache_dir)
        self.before_scan = before_scan  # a simulation fills the data folder up to a step here
        self._data: dict[str, TaskData] = {}

    @property
    def fingerprint(self) -> str:
        return self.backbones.fingerprint

    # --- tasks ------------------------------------------------------------------------------

    def scan(self) -> SiteFolder:
        """The data folder as it is now (read at every message: it may grow, and in a
        simulation another worker process may have filled it)."""
        return SiteFolder.scan(self.data_dir)

    @staticmethod
    def current(folder: SiteFolder, frozen: Iterable[str]) -> tuple[int, SiteTask] | None:
        """The first task with a class that is not finished, with its index; tasks without
        images are skipped. None when every task is completed."""
        finished = {class_key(name) for name in frozen}
        for index, task in enumerate(folder.tasks):
            if task.keys and not task.keys <= finished:
                return index, task
        return None

    def task_data(self, task: SiteTask) -> TaskData:
        if task.name not in self._data:
            classes = list(task.train)
            samples = [(p, i) for i, name in enumerate(classes) for p in task.train[name]]
            decoded = self._decode(samples)
            keys = [class_key(classes[label]) for label in decoded.labels.tolist()]
            device = self.backbones.device  # images and features stay there for the task
            features = self._cached_features(decoded).to(device)
            images = decoded.images.to(device)
            self._data[task.name] = TaskData(images, keys, features, Counter(keys))
        return self._data[task.name]

    def _decode(self, samples: list[tuple[str, int]]) -> DecodedImages:
        return decode_images(
            samples, self.backbones.config.image_size, self.cache_dir / "images", progress=False
        )

    def _cached_features(self, decoded: DecodedImages) -> torch.Tensor:
        """CLIP features of un-augmented images, computed once per backbone, code path, device
        and image set (``clip_features_signature``)."""
        signature = clip_features_signature(self.backbones)
        key = hashlib.sha256("\n".join([signature, *decoded.paths]).encode()).hexdigest()
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

    def sync(self, step: int, frozen: list[str], federation: str, epoch: str) -> ClientUpdate:
        """The classes of the current task with their image counts; the base version is the
        version of the codebook the site holds of the federation's line ``epoch`` (0: none)."""
        self.memory.join(federation)
        if self.before_scan is not None:
            self.before_scan(step)
        folder = self.scan()
        current = self.current(folder, frozen)
        for task in folder.tasks[: None if current is None else current[0]]:
            self.memory.complete(task.name, step)
        entries, metadata = [], {"site": self.name, "task": ""}
        if current is not None:
            _, task = current
            metadata["task"] = task.name
            entries = [ClassEntry(name, len(paths)) for name, paths in task.train.items() if paths]
        return ClientUpdate(
            self.fingerprint, self.backbones.dims, Phase.SYNC,
            self.memory.held_version(epoch), entries, metadata,
        )  # fmt: skip

    def _view(self, codebook: Codebook, task: SiteTask, with_in_progress: bool) -> LocalView | None:
        """Local model: frozen classes (and, in stage 2, other sites' current classes) as
        fixed context, then this site's trainable classes. None when it has nothing to train."""
        data = self.task_data(task)
        frozen = codebook.frozen
        own = [n for n in codebook.names if class_key(n) in data.counts and n not in frozen]
        if not own:
            return None
        context = [
            name
            for name in codebook.names
            if name not in own and (name in frozen or with_in_progress)
        ]
        model = StarPrompt(self.backbones, confidence_modulation=self.config.confidence_modulation)
        model.load_bank(codebook.bank(context + own))
        row = {class_key(name): i for i, name in enumerate(model.bank.names)}
        own_keys = {class_key(name) for name in own}
        mine = torch.tensor([key in own_keys for key in data.keys])
        labels = torch.tensor([row[key] for key in data.keys if key in own_keys])
        for name in own:
            model.bank.counts[row[class_key(name)]] = data.counts[class_key(name)]
        return LocalView(model, len(context), own, labels, mine)

    def run_phase(
        self, phase: Phase, codebook: Codebook, step: int, round_index: int = 0
    ) -> ClientUpdate:
        """Train or fit statistics for ``phase``; the update carries this site's classes."""
        current = self.current(self.scan(), codebook.frozen)
        entries: list[ClassEntry] = []
        if current is not None:
            index, task = current
            in_stage2 = phase in (Phase.STAGE2, Phase.STAGE2_STATS)
            view = self._view(codebook, task, with_in_progress=in_stage2)
            if view is not None:
                data = self.task_data(task)
                images, features = data.images[view.mine], data.features[view.mine]
                HANDLERS[phase](view, images, features, self.config, index, round_index)
                entries = view.model.bank.entries(view.own, fields=schema.trained_in(phase))
        return ClientUpdate(self.fingerprint, codebook.dims, phase, codebook.version, entries)

    def evaluate(self, codebook: Codebook, class_steps: list[int]) -> EvaluationReport:
        """Counts on the site's test images of every class it has held — its tasks up to the
        last one the federation knows a class of — that the codebook knows. ``class_steps``
        are the steps that registered the codebook's classes (a prompt selection is right when
        it picks a key of the image class's step)."""
        row_of = {class_key(name): i for i, name in enumerate(codebook.names)}
        folder = self.scan()
        known = [i for i, task in enumerate(folder.tasks) if task.keys & row_of.keys()]
        tasks = folder.tasks[: known[-1] + 1] if known else []
        held = set().union(*(task.keys for task in tasks))
        samples = [
            (path, row_of[key])
            for key, paths in folder.test.items()
            if key in held and key in row_of
            for path in paths
        ]
        if not samples:
            metadata = {"site": self.name}
            return EvaluationReport(codebook.fingerprint, codebook.version, metadata=metadata)
        test = self._decode(samples)
        model = StarPrompt(self.backbones, confidence_modulation=self.config.confidence_modulation)
        model.load_bank(codebook.bank())
        steps = torch.tensor(class_steps)
        features = self._cached_features(test)
        scores = score_classes(
            model, test.images, test.labels, features, steps, self.config.classify_with_keys
        )
        return EvaluationReport.of(codebook, scores, site=self.name)


# The site's step of each training or statistics phase: (view, images of its classes, their
# CLIP features, config, task index, round) -> None, training the view's model in place.
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
