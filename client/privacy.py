"""A site's privacy setting and budget: what it releases, with how much noise, or refuses.

Opt-in (``privacy-epsilon`` in the node config of a deployed site, or the run config of
simulated ones; docs/security.md#differential-privacy). The unit protected is one training
image (its content), or one patient (``PrivacyUnit``). A unit is used in one class only, the
first it was seen in, with at most k of its images there (k = 1 for an image, the patient cap
for a patient; ``PrivateReleases.protect``), so removing a unit changes one class's images by at
most k, whatever the folder holds. Every release that can depend on an image is a Gaussian
mechanism recorded, by its noise multiplier, under the image's class in the site's ledger
(``SiteMemory``, locked, so a restart never resets it):

* the sync's image count of the class (once; later messages reuse it), noise × k; a class
  is announced only when that noisy count clears a threshold that a class of one unit clears
  with probability at most half the site's δ (Gaussian partition selection), so a class of one
  unit is hidden like any other fact about the unit;
* each training phase, one release over all the classes of the task (an image of one class
  moves every class's update through the softmax), trained by DP-SGD (``PrivateSteps``): each
  step takes every unit with probability q (Poisson; q = batch size over the task's released
  counts), clips each taken unit's gradient to the phase's bound C, adds noise z·C to their
  sum; the update released is post-processing of the steps, recorded as its steps'
  Poisson-subsampled Gaussians (``accountant.Sampling``);
* each statistics phase's Gaussian of the class (``private_gaussian``, noise × k; only that
  class's images: H_c's views are augmented per image, ``augment_each``).

Each release takes the smallest noise with which the class's releases so far and the ones its
task still plans (the rounds, epochs and batch size of the run config) stay within the target
ε at the other half of δ; a release that would need more than ``MAX_NOISE_MULTIPLIER`` is
refused: the class is trained but not shared, and the reply says so (``BUDGET_EXHAUSTED``): the
ledger is a privacy filter.
The site's ε is the largest of its announced classes' (a unit is in one class), reported in
every reply (``PRIVACY_EPSILON``) and logged with its unit. The site's δ is its own (the run
config may only lower it) and at most 1/n.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch

from starfed.client.memory import NOT_ANNOUNCED, SITE_WIDE, PrivacyLedger, SiteMemory
from starfed.shared.codebook import schema
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.config import Options, knob
from starfed.shared.data.site_folder import (
    SiteFolder,
    SiteTask,
    class_key,
    file_digests,
    training_patient,
)
from starfed.shared.knob import Values
from starfed.shared.model.training import MixtureFit, PrivateSteps
from starfed.shared.privacy import accountant
from starfed.shared.privacy.accountant import WHOLE, Release, Sampling
from starfed.shared.privacy.mechanisms import noisy_count, private_gaussian
from starfed.shared.privacy.unit import PrivacyUnit
from starfed.shared.protocol import BUDGET_EXHAUSTED, PRIVACY_EPSILON, STATISTICS, Phase

logger = logging.getLogger(__name__)


class PrivacyError(ValueError):
    """A privacy setting the site cannot honour (its δ is too large for its data)."""


@dataclass(frozen=True)
class PrivacySetting(Options):
    """The target (ε, δ), the clipping bounds, and the rounds, epochs and batch size a class's
    task plans."""

    epsilon: float = knob("privacy-epsilon")
    delta: float = knob("privacy-delta")
    clip_radius: float = knob("privacy-clip-radius")  # × √dim, about a mid-gray image's feature
    vit_radius: float = knob("privacy-vit-radius")  # × √dim, about the origin
    stage1_clip: float = knob("privacy-stage1-clip")  # one unit's gradient in a DP-SGD step
    stage2_clip: float = knob("privacy-stage2-clip")
    stage1_rounds: int = knob("stage1-rounds")
    stage2_rounds: int = knob("stage2-rounds")
    stage1_epochs: int = knob("stage1-epochs")
    stage2_epochs: int = knob("stage2-epochs")
    batch_size: int = knob("batch-size")
    unit: PrivacyUnit = knob("privacy-unit", PrivacyUnit)  # noqa: RUF009 (an enum: immutable)
    patient_images: int = knob("privacy-patient-images")  # the cap k of the patient unit

    @property
    def group(self) -> int:
        """The most images of one protected unit in a class: the factor on the sensitivity
        of its count and moments (DP-SGD clips a unit's gradient as a whole, so its bound
        holds for any number of the unit's images)."""
        return self.patient_images if self.unit is PrivacyUnit.PATIENT else 1

    @property
    def selection_delta(self) -> float:
        """The δ of announcing classes: the most probability that a class of one unit is
        announced (half the site's δ)."""
        return self.delta / 2

    @property
    def release_delta(self) -> float:
        """The δ the accountant composes each class's releases at: the rest of the site's."""
        return self.delta - self.selection_delta

    def threshold(self, noise_multiplier: float) -> int:
        """The smallest noisy count (drawn at ``noise_multiplier``) a class is announced with:
        a class of one unit, at most ``group`` images, reaches it with probability at most
        ``selection_delta`` (Gaussian partition selection; Desfontaines et al., "Differentially
        private partition selection", PoPETs 2022). The count is rounded: round(x) ≥ t iff
        x ≥ t − ½."""
        tail = NormalDist().inv_cdf(1 - self.selection_delta)
        return math.ceil(self.group * (1 + noise_multiplier * tail) + 0.5)

    @classmethod
    def of(cls, run: Values, node: Values) -> PrivacySetting | None:
        """The setting from parsed run and node configs; None when off. A node's own ε wins;
        its δ (default 1e-5) is a ceiling the run config may lower, never raise; its unit is
        the patient when either asks for it: the server cannot weaken a site's guarantee."""
        setting = cls.from_config(run)
        epsilon = float(node["privacy-epsilon"]) or setting.epsilon
        delta = min(float(node["privacy-delta"]), setting.delta)
        units = {setting.unit, PrivacyUnit(str(node["privacy-unit"]))}  # the stricter of the two
        unit = PrivacyUnit.PATIENT if PrivacyUnit.PATIENT in units else PrivacyUnit.IMAGE
        return replace(setting, epsilon=epsilon, delta=delta, unit=unit) if epsilon else None

    def check_delta(self, n: int) -> None:
        """Refuse a δ above 1/n for a site of ``n`` protected units: such a δ allows a release
        that reveals one of them outright."""
        if n and self.delta > 1 / n:
            raise PrivacyError(
                f"privacy-delta {self.delta:g} is more than 1/n = {1 / n:.3g} for this site's "
                f"{n} training {self.unit.value}s: set privacy-delta to at most {1 / n:.3g}"
            )

    def sampling(self, phase: Phase, images: int | None) -> Sampling:
        """DP-SGD's sampling in a training phase of a task of ``images`` images by its released
        counts: rate batch size / images, one epoch about 1 / rate steps. None (at the sync,
        before the counts are drawn): a plan only, one full batch an epoch."""
        epochs = self.stage1_epochs if phase is Phase.STAGE1 else self.stage2_epochs
        if images is None:
            return Sampling(1.0, epochs)
        rate = min(1.0, self.batch_size / images)
        return Sampling(rate, epochs * math.ceil(1 / rate))

    def releases_left(
        self, phase: Phase, round_index: int = 0, images: int | None = None
    ) -> list[Sampling]:
        """Releases of a class's key from this one to the end of its task, in a task of
        ``images`` images (None: not yet known): the count, the stage-1 rounds, the G_c, the
        stage-2 rounds, the H_c."""
        r1, r2 = self.stage1_rounds, self.stage2_rounds
        s1, s2 = self.sampling(Phase.STAGE1, images), self.sampling(Phase.STAGE2, images)
        return {
            Phase.SYNC: [WHOLE, *[s1] * r1, WHOLE, *[s2] * r2, WHOLE],
            Phase.STAGE1: [*[s1] * (r1 - round_index), WHOLE, *[s2] * r2, WHOLE],
            Phase.STAGE1_STATS: [WHOLE, *[s2] * r2, WHOLE],
            Phase.STAGE2: [*[s2] * (r2 - round_index), WHOLE],
            Phase.STAGE2_STATS: [WHOLE],
        }[phase]


class PrivateReleases:
    """One private site's releases: noise calibrated to what its budget still allows."""

    def __init__(
        self,
        setting: PrivacySetting,
        memory: SiteMemory,
        clip_centre: torch.Tensor,
    ) -> None:
        self.setting = setting
        self.memory = memory
        self.clip_centre = clip_centre  # CLIP feature of a mid-gray image: public
        # The operating system's entropy: noise from a seed others know hides nothing.
        self.rng = np.random.default_rng()
        self._digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> digest
        self._planned: dict[str, int] = {}  # key -> its releases when its noise was planned
        if not memory.has_ledger():
            logger.warning(
                "privacy: no ledger in %s: this site's budget starts at zero here; releases "
                "made from another state folder are not counted",
                memory.root,
            )

    # --- the budget -----------------------------------------------------------------------

    def noise(
        self,
        keys: list[str],
        phase: Phase,
        round_index: int = 0,
        ledger: PrivacyLedger | None = None,
        images: int | None = None,
    ) -> float | None:
        """The noise multiplier one release depending on the images of ``keys`` needs so that
        every one of them stays within budget, in a task of ``images`` released images; None
        when one of them cannot afford it (``ledger``: the one in hand, else it is read)."""
        left = self.setting.releases_left(phase, round_index, images)
        ledger = self.memory.ledger() if ledger is None else ledger
        needed = []
        for key in keys:
            self._planned[key] = len(ledger.past(key))
            z = accountant.noise_multiplier(
                ledger.past(key), left, self.setting.epsilon, self.setting.release_delta
            )
            if z is None:
                return None
            needed.append(z)
        return max(needed)

    def epsilon(self, ledger: PrivacyLedger | None = None) -> float:
        """The site's ε per unit: the largest of its announced classes' (a unit is in one
        class; a class not announced spent one count release, within budget, and its
        presence is what partition selection hides). ``ledger``: the one in hand, else read."""
        ledger = self.memory.ledger() if ledger is None else ledger
        pasts = [
            ledger.past(key)
            for key in ledger.class_keys()
            if ledger.counts.get(key) != NOT_ANNOUNCED
        ]
        pasts.append(ledger.releases.get(SITE_WIDE, []))  # an old ledger's, before any class's
        return max(accountant.epsilon(past, self.setting.release_delta) for past in pasts)

    def key(self, name: str, ledger: PrivacyLedger | None = None) -> str:
        """The ledger key of class ``name`` (``ledger``: the one in hand, else it is read)."""
        return (self.memory.ledger() if ledger is None else ledger).key(class_key(name))

    def _record(self, names: list[str], release: Release, what: str) -> bool:
        """Record a release of ``names``' images, if no release of theirs was recorded
        since its noise was planned (another process of the site may have released): plan and
        record then act as one step of the privacy filter. False: refused, nothing recorded,
        and the release must not leave."""
        with self.memory.updating_ledger() as ledger:
            keys = sorted({self.key(name, ledger) for name in names})
            if any(len(ledger.past(key)) != self._planned.get(key) for key in keys):
                logger.warning(
                    "privacy: %s of %s not released: the ledger changed since it was planned",
                    what,
                    ", ".join(names),
                )
                return False
            ledger.record(keys, release)
        delta = self.setting.release_delta  # the ledger as written: read once per release
        spent = max(accountant.epsilon(ledger.past(key), delta) for key in keys)
        logger.info(
            "privacy: released %s of %s with noise multiplier %.3g: their ε %.3g, the site's "
            "%.3g, of %.3g (δ %g, per %s)",
            what,
            ", ".join(names),
            release.noise_multiplier,
            spent,
            self.epsilon(ledger),
            self.setting.epsilon,
            self.setting.delta,
            self.setting.unit.value,
        )
        return True

    def metadata(self, refused: list[str]) -> dict[str, str]:
        """What the reply tells the server: the site's ε, and the classes it refused."""
        metadata = {PRIVACY_EPSILON: f"{self.epsilon():.6g}"}
        if refused:
            metadata[BUDGET_EXHAUSTED] = ",".join(refused)
            logger.warning(
                "privacy budget exhausted for %s: trained, not shared", ", ".join(refused)
            )
        return metadata

    # --- the releases ---------------------------------------------------------------------

    def protect(self, folder: SiteFolder) -> SiteFolder:
        """The training images the site may use: each protected unit in one class only, the
        one the ledger first saw it in (a copy of an image, or a patient, in another class is
        left out there), at most ``group`` of its images (the first in name order), and none
        of a class that was not announced. The units seen are written to the ledger."""
        units = self._units(folder)
        tasks, dropped = [], 0
        with self.memory.updating_ledger() as ledger:
            for task in folder.tasks:
                train = {}
                for name, paths in task.train.items():
                    key = self.key(name, ledger)
                    used: Counter[str] = Counter()
                    kept = []
                    if ledger.counts.get(key) != NOT_ANNOUNCED:
                        for path in paths:
                            unit = units[path]
                            if ledger.units.setdefault(unit, key) != key:
                                dropped += 1  # the unit is another class's
                            elif used[unit] < self.setting.group:
                                used[unit] += 1
                                kept.append(path)
                    train[name] = kept
                tasks.append(SiteTask(task.name, train))
        if dropped:
            logger.info(
                "privacy: %d training images left out: their %s is in another class",
                dropped,
                self.setting.unit.value,
            )
        return SiteFolder(folder.root, tasks, folder.test)

    def _units(self, folder: SiteFolder) -> dict[str, str]:
        """The protected unit of each training image: its content's digest, or its patient."""
        paths = [p for task in folder.tasks for ps in task.train.values() for p in ps]
        if self.setting.unit is PrivacyUnit.PATIENT:
            return {path: f"patient {training_patient(path)}" for path in paths}
        units = {}
        for path in paths:
            stat = Path(path).stat()
            known = (path, stat.st_size, stat.st_mtime_ns)
            if known not in self._digests:
                self._digests[known] = file_digests([path])[0]
            units[path] = self._digests[known]
        return units

    def counts(self, counts: Mapping[str, int]) -> tuple[list[ClassEntry], list[str]]:
        """The sync's entries: each announced class's noisy count (drawn once, then
        reused; a class whose count falls under the threshold is not announced, now or
        later), and the classes whose budget cannot afford even that."""
        entries, refused = [], []
        for name, count in counts.items():
            key = self.key(name)
            released = self.memory.ledger().counts.get(key)
            if released is None:
                z = self.noise([key], Phase.SYNC)
                if z is None:
                    refused.append(name)
                    continue
                released = noisy_count(count, z, self.rng, self.setting.group)
                if released < self.setting.threshold(z):
                    released = NOT_ANNOUNCED
                    logger.info(
                        "privacy: class %s not announced: its noisy count is under the "
                        "threshold %d that hides a class of one %s",
                        name,
                        self.setting.threshold(z),
                        self.setting.unit.value,
                    )
                if not self._record([name], Release(z), "the image count"):
                    refused.append(name)
                    continue
                with self.memory.updating_ledger() as ledger:
                    ledger.counts[key] = released
            if released != NOT_ANNOUNCED:
                entries.append(ClassEntry(name, released))
        return entries, refused

    def plan(self, names: list[str], phase: Phase, round_index: int) -> dict[str, float | None]:
        """The noise multiplier of each class's release in ``phase`` (None: refused). A
        training phase is one release over all the classes; a class without a released count
        is refused (its count at the sync was)."""
        ledger = self.memory.ledger()
        keys = {
            name: self.key(name, ledger)
            for name in names
            if ledger.counts.get(self.key(name, ledger), NOT_ANNOUNCED) != NOT_ANNOUNCED
        }
        images = self.images(names, ledger)
        if phase in STATISTICS:
            plan = {
                name: self.noise([key], phase, ledger=ledger, images=images)
                for name, key in keys.items()
            }
        else:  # every class's images move every class's update: all share, or none
            whole = len(keys) == len(names)
            shared = sorted(set(keys.values()))
            z = self.noise(shared, phase, round_index, ledger, images) if whole else None
            plan = dict.fromkeys(keys, z)
        return {name: plan.get(name) for name in names}

    def images(self, names: list[str], ledger: PrivacyLedger) -> int:
        """The task's images by the released counts of its classes ``names`` (public)."""
        return sum(max(ledger.counts.get(self.key(name, ledger), 0), 0) for name in names)

    def steps(
        self, phase: Phase, names: list[str], plan: Mapping[str, float | None], paths: list[str]
    ) -> PrivateSteps | None:
        """A training phase's DP-SGD, of the task's images ``paths`` (of the classes ``names``),
        at the plan's noise multiplier; None when the plan refused the release (the site
        trains as usual and shares nothing)."""
        z = plan[names[0]] if names else None
        if z is None:
            return None
        sampling = self.setting.sampling(phase, self.images(names, self.memory.ledger()))
        if self.setting.unit is PrivacyUnit.PATIENT:
            index: dict[str, int] = {}
            units = [index.setdefault(training_patient(p), len(index)) for p in paths]
        else:  # an image is used once (``protect``): each its own unit
            units = list(range(len(paths)))
        clip = self.setting.stage1_clip if phase is Phase.STAGE1 else self.setting.stage2_clip
        expected = sampling.rate * self.images(names, self.memory.ledger())
        return PrivateSteps(torch.tensor(units), sampling, clip, z, expected, self.rng)

    def ball(self, phase: Phase, dim: int) -> tuple[torch.Tensor, float]:
        """The (centre, radius) a statistics phase clips its ``dim``-dimensional features to:
        CLIP features about a mid-gray image's, ViT features about the origin."""
        if phase is Phase.STAGE1_STATS:
            return self.clip_centre, self.setting.clip_radius * math.sqrt(dim)
        return torch.zeros(dim, dtype=torch.float64), self.setting.vit_radius * math.sqrt(dim)

    def mixture_fit(
        self, phase: Phase, names: list[str], plan: dict[str, float | None]
    ) -> MixtureFit:
        """The statistics step's fit: for a class to share, one private Gaussian of its
        clipped features (records the release); for a refused one the ordinary fit, kept. A
        release the ledger refuses when it is recorded becomes refused in ``plan``."""
        ledger = self.memory.ledger()  # the counts, released before this phase

        def fit(features, labels, rows, n_components, seed) -> list[GaussianMixture]:
            centre, radius = self.ball(phase, features.shape[1])
            mixtures = []
            for i, row in enumerate(rows):
                name, own = names[i], features[labels == row]
                z = plan[name]
                if z is None:
                    mixtures.append(GaussianMixture.fit(own, n_components, seed=seed + row))
                    continue
                count, group = ledger.counts[self.key(name, ledger)], self.setting.group
                private = private_gaussian(own, centre, radius, count, z, self.rng, group)
                if not self._record([name], Release(z), schema.trained_in(phase)[0]):
                    plan[name] = None
                    private = GaussianMixture.fit(own, n_components, seed=seed + row)
                mixtures.append(private)
            return mixtures

        return fit

    def release(
        self,
        phase: Phase,
        entries: list[ClassEntry],
        plan: Mapping[str, float | None],
    ) -> tuple[list[ClassEntry], dict[str, str]]:
        """The update's entries as released — statistics as fitted, training updates as DP-SGD
        trained them (recorded: its steps) — with the noisy counts, and the reply's metadata."""
        refused = [e.name for e in entries if plan[e.name] is None]
        shared = [e for e in entries if plan[e.name] is not None]
        ledger = self.memory.ledger()
        if phase not in STATISTICS and shared:
            z = plan[shared[0].name]
            assert z is not None  # shared: the entries with a plan
            names = [e.name for e in entries]
            sampling = self.setting.sampling(phase, self.images(names, ledger))
            if not self._record(names, Release(z, sampling), f"the {phase.key} update"):
                refused, shared = names, []
        shared = [
            ClassEntry(e.name, ledger.counts[self.key(e.name, ledger)], e.values) for e in shared
        ]
        return shared, self.metadata(refused)
