"""A site and its side of every protocol phase, without Flower.

A site's tasks are the task folders of its data folder, in order (``SiteFolder``,
docs/sites.md); its current task is the first whose classes are not all frozen in
the federation, so a new folder is picked up at the next step and a site that was offline
catches up. Its memory — the last codebook, its completed tasks — is its state folder
(``SiteMemory``); decoded images and CLIP features are cached on disk. A phase sees the current
task through the codebook (``TaskView``), and ``HANDLERS`` maps each training or statistics
phase to its step on that view (``starfed.shared.model.training``). Only codebook updates and
evaluation counts leave a site: prompts, head rows, mixture statistics — with the privacy
setting, clipped and noised within the site's budget (``starfed.client.privacy``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from starfed.client.memory import SiteMemory
from starfed.client.policy import SitePolicy
from starfed.client.privacy import PrivacySetting, PrivacyUnit, PrivateReleases
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import ClientUpdate, Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.data.images import DecodedImages, decode_images
from starfed.shared.data.site_folder import SiteFolder, SiteTask, class_key, patient_of
from starfed.shared.files import write_atomic
from starfed.shared.model import training
from starfed.shared.model.backbones import Backbones
from starfed.shared.model.evaluation import score_classes
from starfed.shared.model.features import clip_features, clip_features_signature
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import MixtureFit, TrainConfig
from starfed.shared.protocol import SITE, STATISTICS, TASK, TEST_IMAGES, Phase
from starfed.shared.report import EvaluationReport

logger = logging.getLogger(__name__)


@dataclass
class TaskData:
    """A site's training images of one task, with cached CLIP features."""

    images: torch.Tensor  # uint8 [N, 3, S, S]
    keys: list[str]  # class key of each image
    features: torch.Tensor  # raw CLIP features of the un-augmented images
    counts: Counter[str]  # images per class key
    paths: list[str]  # each image's file, as the folder names it


#: A bank cell the site's handler wrote (trained or fitted): the codebook's value replaces it.
_WRITTEN = object()


@dataclass
class TaskView:
    """The site's current task seen through the codebook: what a phase's handler works on.

    The local model holds the context classes first (rows ``:n_past``: the frozen classes, and
    in stage 2 the classes other sites are learning), then the classes this site trains (rows
    ``n_past:``); the images and CLIP features are the task's images of those classes.

    A view outlives its phase: the next phase's codebook rewrites only the bank cells whose
    value changed or that a handler wrote (``refresh``), so a class's unchanged tensors are
    stacked once per view instead of once per phase (docs/design.md#the-codebook).
    """

    model: StarPrompt
    n_past: int
    own: list[str]  # codebook names of the classes this site trains, in row order
    labels: torch.Tensor  # local row of each image
    images: torch.Tensor  # uint8 [N, 3, S, S]: the task's images of the own classes
    features: torch.Tensor  # their raw CLIP features
    paths: list[str]  # their files (a private site's units)
    task: int  # index of the task among the site's tasks (it keys the random streams)
    round_index: int  # round of the phase within the step
    # the codebook value each bank cell holds, by class and field (_WRITTEN: a handler's)
    sources: dict[str, dict[str, object]] = field(default_factory=dict)

    def refresh(self, codebook: Codebook) -> None:
        """Make the bank what ``codebook`` stacks for its classes: a cell is rewritten when the
        codebook holds another value object for it (codebooks share unchanged values) or a
        handler wrote it; context rows take the codebook's counts."""
        bank = self.model.bank
        for row, name in enumerate(bank.names):
            entry, sources = codebook[name], self.sources[name]
            for f in schema.FIELDS:
                value = entry.values.get(f.name)
                if sources.get(f.name) is not value:
                    rows = value.unsqueeze(0) if isinstance(value, torch.Tensor) else [value]
                    bank.set_rows(f.name, row, rows)
                    sources[f.name] = value
            if row < self.n_past:
                bank.counts[row] = entry.count

    def written(self, fields: Iterable[str]) -> None:
        """The handler wrote ``fields`` of the own classes' rows."""
        for name in self.own:
            self.sources[name].update(dict.fromkeys(fields, _WRITTEN))


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
        privacy: PrivacySetting | None = None,
        policy: SitePolicy | None = None,
    ) -> None:
        self.name = name
        self.policy = policy or SitePolicy()
        self.data_dir = Path(data_dir)
        self.memory = memory
        self.backbones = backbones
        self.config = config
        self.cache_dir = Path(cache_dir)
        self.private: PrivateReleases | None = None
        if privacy is not None:
            size = backbones.config.image_size  # a mid-gray image: a point the backbone fixes
            gray = torch.full((1, 3, size, size), 128, dtype=torch.uint8)
            centre = clip_features(backbones, gray)[0].to(torch.float64)
            self.private = PrivateReleases(privacy, memory, centre)
        self._data: dict[str, TaskData] = {}
        self._view: tuple[tuple, TaskView] | None = None  # the last phase's, with its classes

    @property
    def fingerprint(self) -> str:
        return self.backbones.fingerprint

    # --- tasks ------------------------------------------------------------------------------

    def scan(self) -> SiteFolder:
        """The data folder as it is now (read at every message: it may grow; a simulation
        writes its simulated sites' folders before each step), without the classes the site's
        policy does not admit; with the privacy setting, the images its releases may use
        (``PrivateReleases.protect``: each image, or patient, in one class, at most
        ``privacy-patient-images`` of a patient's)."""
        folder = SiteFolder.scan(self.data_dir)
        if self.policy.filters_classes:
            private = self.private
            patients = private is not None and private.setting.unit is PrivacyUnit.PATIENT
            folder, left_out = admitted(folder, self.policy, patients)
            if left_out:
                logger.debug("the site's policy leaves out %s", left_out)
        return folder if self.private is None else self.private.protect(folder)

    @staticmethod
    def current(folder: SiteFolder, frozen: Iterable[str]) -> tuple[int, SiteTask] | None:
        """The first task with a class that is not frozen, with its index; tasks without
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
            readable = set(decoded.paths)  # real paths; the folder's names are the units'
            paths = [p for p, _ in samples if os.path.realpath(p) in readable]
            data = TaskData(images, keys, features, Counter(keys), paths)
            self._data[task.name] = data
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
        folder = self.scan()
        current = self.current(folder, frozen)
        for task in folder.tasks[: None if current is None else current[0]]:
            self.memory.complete(task.name, step)
        self.memory.saw([task.name for task in folder.tasks])
        test_images = sum(len(paths) for paths in folder.test.values())
        # what the server bounds this site's evaluation reports by (server/screening.py)
        entries, metadata = [], {SITE: self.name, TASK: "", TEST_IMAGES: str(test_images)}
        if current is not None:
            _, task = current
            metadata[TASK] = task.name
            counts = {name: len(paths) for name, paths in task.train.items() if paths}
            if self.private is None:
                entries = [ClassEntry(name, count) for name, count in counts.items()]
            else:
                self.private.setting.check_delta(len(folder.patients()))  # images or patients
                entries, refused = self.private.counts(counts)
                metadata.update(self.private.metadata(refused))
        brings = ", ".join(f"{e.name} ({e.count} images)" for e in entries)
        where = f"task {metadata[TASK]} brings {brings}" if brings else "nothing new to bring"
        logger.info("step %d: %s; %d test images in the folder", step + 1, where, test_images)
        return ClientUpdate(
            self.fingerprint,
            self.backbones.dims,
            Phase.SYNC,
            self.memory.held_version(epoch),
            tuple(entries),
            metadata,
        )

    def view(
        self, codebook: Codebook, index: int, task: SiteTask, stage2: bool, round_index: int
    ) -> TaskView | None:
        """Task ``index`` through ``codebook``: frozen classes (and, in stage 2, other sites'
        current classes) as fixed context, then this site's trainable classes. The last
        phase's view is refreshed when it holds the same classes in the same roles, else the
        bank is stacked anew. None when the site has nothing to train."""
        data = self.task_data(task)
        frozen = codebook.frozen
        own = [n for n in codebook.names if class_key(n) in data.counts and n not in frozen]
        if not own:
            return None
        context = [
            name for name in codebook.names if name not in own and (name in frozen or stage2)
        ]
        key = (task.name, tuple(context), tuple(own))
        if self._view is not None and self._view[0] == key:
            view = self._view[1]
            view.refresh(codebook)
            view.round_index = round_index
            return view
        model = StarPrompt(self.backbones, confidence_modulation=self.config.confidence_modulation)
        model.load_bank(codebook.bank(context + own))
        row = {class_key(name): i for i, name in enumerate(model.bank.names)}
        own_keys = {class_key(name) for name in own}
        mine = torch.tensor([key in own_keys for key in data.keys])
        labels = torch.tensor([row[key] for key in data.keys if key in own_keys])
        for name in own:
            model.bank.counts[row[class_key(name)]] = data.counts[class_key(name)]
        images, features = data.images[mine], data.features[mine]
        paths = [path for path, key in zip(data.paths, data.keys, strict=True) if key in own_keys]
        sources: dict[str, dict[str, object]] = {
            name: dict(codebook[name].values) for name in model.bank.names
        }
        view = TaskView(
            model, len(context), own, labels, images, features, paths, index, round_index, sources
        )
        self._view = (key, view)
        return view

    def run_phase(
        self, phase: Phase, codebook: Codebook, step: int, round_index: int = 0
    ) -> ClientUpdate:
        """Train or fit statistics for ``phase``; the update carries this site's classes."""
        current = self.current(self.scan(), codebook.frozen)
        entries: list[ClassEntry] = []
        metadata = {} if self.private is None else self.private.metadata([])
        if current is not None:
            stage2 = phase in (Phase.STAGE2, Phase.STAGE2_STATS)
            view = self.view(codebook, *current, stage2, round_index)
            if view is not None:
                trained = schema.trained_in(phase)
                private = self.private
                plan = None if private is None else private.plan(view.own, phase, round_index)
                if private is not None and plan is not None and phase in STATISTICS:  # its own fit
                    fit = private.mixture_fit(phase, view.own, plan)
                    HANDLERS[phase](view, self.config, fit=fit)
                elif private is not None and plan is not None:  # its DP-SGD
                    steps = private.steps(phase, view.own, plan, view.paths)
                    HANDLERS[phase](view, self.config, private=steps)
                else:
                    HANDLERS[phase](view, self.config)
                view.written(trained)
                entries = view.model.bank.entries(view.own, fields=trained)
                if private is not None and plan is not None:
                    entries, metadata = private.release(phase, entries, plan)
                _say_phase(step, phase, round_index, view, entries)
        return ClientUpdate(
            self.fingerprint, codebook.dims, phase, codebook.version, tuple(entries), metadata
        )

    def evaluate(
        self, codebook: Codebook, class_steps: list[int], use_keys: bool = False
    ) -> EvaluationReport:
        """Counts on the site's test images of every class it has had — of the tasks its
        last sync saw, up to the last one the federation knows a class of — that the codebook
        knows (a task folder that appeared since waits for the next step's evaluation, which
        may travel with the next sync). ``class_steps`` are the steps that registered the
        codebook's classes (a prompt selection is right when it picks a key of the image
        class's step); ``use_keys``: predict with the first-level keys alone (the keys
        ablation's evaluate config)."""
        row_of = {class_key(name): i for i, name in enumerate(codebook.names)}
        folder = self.scan()
        synced = self.memory.synced
        seen = [task for task in folder.tasks if synced is None or task.name in synced]
        known = [i for i, task in enumerate(seen) if task.keys & row_of.keys()]
        tasks = seen[: known[-1] + 1] if known else []
        had = set().union(*(task.keys for task in tasks))
        samples = [
            (path, row_of[key])
            for key, paths in folder.test.items()
            if key in had and key in row_of
            for path in paths
        ]
        metadata = {SITE: self.name}
        if not samples:
            return EvaluationReport(codebook.fingerprint, codebook.version, metadata=metadata)
        test = self._decode(samples)
        model = StarPrompt(self.backbones, confidence_modulation=self.config.confidence_modulation)
        model.load_bank(codebook.bank())
        steps = torch.tensor(class_steps)
        features = self._cached_features(test)
        scores = score_classes(model, test.images, test.labels, features, steps, use_keys)
        images, correct = int(scores.images.sum()), int(scores.correct.sum())
        in_folder = sum(len(paths) for paths in folder.test.values())
        logger.info(
            "codebook version %d: accuracy %.1f%% on the %d test images here of the classes "
            "it has learnt (%d in the folder)",
            codebook.version,
            100.0 * correct / images,
            images,
            in_folder,
        )
        newest = max(class_steps)
        takers = {  # the newest step's classes not the site's: whose takings it reports
            row
            for row, name in enumerate(codebook.names)
            if class_steps[row] == newest and class_key(name) not in had
        }
        return EvaluationReport.of(codebook, scores, takers, **metadata)


def admitted(
    folder: SiteFolder, policy: SitePolicy, patients: bool
) -> tuple[SiteFolder, dict[str, str]]:
    """The folder as ``policy`` lets the site release it, and each class left out with why:
    not admitted by name, or fewer images (``patients``: patients) than its ``min_images``.
    Their test images are left out too: no evaluation counts of them leave either."""
    left_out: dict[str, str] = {}
    tasks = []
    for task in folder.tasks:
        kept = {}
        for name, paths in task.train.items():
            units = len({patient_of(p) or p for p in paths}) if patients else len(paths)
            if not policy.admits(name):
                left_out[name] = "not allowed by classes.allow/deny"
            elif paths and units < policy.min_images:
                unit = "patients" if patients else "images"
                left_out[name] = f"{units} {unit} < classes.min-images {policy.min_images}"
            else:
                kept[name] = paths
        tasks.append(SiteTask(task.name, kept))
    refused = {class_key(name) for name in left_out}
    test = {key: paths for key, paths in folder.test.items() if key not in refused}
    return SiteFolder(folder.root, tasks, test), left_out


def _say_phase(
    step: int, phase: Phase, round_index: int, view: TaskView, sent: list[ClassEntry]
) -> None:
    """The site engineer's line for a phase: what was trained or fitted on how many images,
    and what left the site (the classes whose fields were sent; a private site may hold some
    back)."""
    did = "fitted statistics of" if phase in STATISTICS else "trained"
    names = [entry.name for entry in sent]
    kept_back = [name for name in view.own if name not in names]
    whose = "of none" if not names else ("of them" if not kept_back else f"of {', '.join(names)}")
    logger.info(
        "step %d · %s/%d: %s %s on %d images; sent %s %s%s",
        step + 1,
        phase.key,
        round_index,
        did,
        ", ".join(view.own),
        len(view.labels),
        ", ".join(schema.trained_in(phase)),
        whose,
        f" (held back: {', '.join(kept_back)})" if names and kept_back else "",
    )


# --- the handlers: each phase's step on the task view, training its model in place --------------


def _training(
    view: TaskView, config: TrainConfig, private: training.PrivateSteps | None = None
) -> training.TaskTraining:
    """What the model's steps are given, from the view of the task (``private``: a private
    site's DP-SGD)."""
    return training.TaskTraining(
        view.model, view.labels, view.n_past, config, view.task, view.round_index, private=private
    )


def _stage1(
    view: TaskView, config: TrainConfig, private: training.PrivateSteps | None = None
) -> None:
    training.stage1(_training(view, config, private), view.features)


def _stage1_stats(view: TaskView, config: TrainConfig, fit: MixtureFit | None = None) -> None:
    training.stage1_stats(_training(view, config), view.features, fit)


def _stage2(
    view: TaskView, config: TrainConfig, private: training.PrivateSteps | None = None
) -> None:
    training.stage2(_training(view, config, private), view.images)


def _stage2_stats(view: TaskView, config: TrainConfig, fit: MixtureFit | None = None) -> None:
    per_image = fit is not None  # a private site's fit: views augmented per image
    training.stage2_stats(_training(view, config), view.images, fit, per_image)


#: Each phase's step; the statistics steps also take the mixture fit (a private site's own), the
#: training steps a private site's DP-SGD.
HANDLERS: dict[Phase, Callable[..., None]] = {
    Phase.STAGE1: _stage1,
    Phase.STAGE1_STATS: _stage1_stats,
    Phase.STAGE2: _stage2,
    Phase.STAGE2_STATS: _stage2_stats,
}
