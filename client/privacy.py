"""A site's privacy setting and budget: what it releases, with how much noise, or refuses.

Opt-in (``privacy-epsilon`` in the node config of a deployed site, or the run config of
simulated ones; docs/security.md#differential-privacy). The unit protected is one training
image. Every release that can depend on an image is a Gaussian mechanism recorded, by its
noise multiplier, under the image's class in the site's ledger (``SiteMemory``, so a restart
never resets it):

* the enrolment's image count of the class (once; later messages reuse it);
* each training phase's update, one mechanism over all the classes of the task (an image of one
  class moves every class's update through the softmax): each class's update clipped to the
  phase's bound C, noise C·2·√K per coordinate for K classes (two clipped updates differ by at
  most 2C per class);
* each statistics phase's Gaussian of the class (``private_gaussian``; only that class's images).

Each release takes the smallest noise with which the class's releases so far and the ones its
task still plans (the rounds of the run config) stay within the target (ε, δ); a release that
would need more than ``MAX_NOISE_MULTIPLIER`` is refused: the class is trained but not shared,
and the reply says so (``BUDGET_EXHAUSTED``). The site's ε is the largest of its classes' (an
image belongs to one class), reported in every reply (``PRIVACY_EPSILON``) and logged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from starfed.client.memory import SiteMemory
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.entry import ClassEntry
from starfed.shared.codebook.mixture import GaussianMixture
from starfed.shared.config import Options, Values, knob
from starfed.shared.data.site_folder import class_key
from starfed.shared.model.training import MixtureFit
from starfed.shared.privacy import accountant
from starfed.shared.privacy.mechanisms import noisy_count, private_gaussian, private_update
from starfed.shared.protocol import BUDGET_EXHAUSTED, PRIVACY_EPSILON, STATISTICS, Phase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivacySetting(Options):
    """The target (ε, δ), the clipping bounds, and the rounds a class's task plans."""

    epsilon: float = knob("privacy-epsilon")
    delta: float = knob("privacy-delta")
    clip_radius: float = knob("privacy-clip-radius")  # × √dim, about a mid-gray image's feature
    vit_radius: float = knob("privacy-vit-radius")  # × √dim, about the origin
    stage1_clip: float = knob("privacy-stage1-clip")
    stage2_clip: float = knob("privacy-stage2-clip")
    stage1_rounds: int = knob("stage1-rounds")
    stage2_rounds: int = knob("stage2-rounds")

    @classmethod
    def of(cls, run: Values, node: Values) -> PrivacySetting | None:
        """The setting from parsed run and node configs (a node's own target wins); None when
        off."""
        setting = cls.from_config(run)
        epsilon = float(node["privacy-epsilon"]) or setting.epsilon
        delta = float(node["privacy-delta"]) or setting.delta
        return replace(setting, epsilon=epsilon, delta=delta) if epsilon else None

    def releases_left(self, phase: Phase, round_index: int = 0) -> int:
        """Releases of a class from this one to the end of its task: its count, the stage-1
        rounds, G_c, the stage-2 rounds, H_c."""
        r1, r2 = self.stage1_rounds, self.stage2_rounds
        return {
            Phase.SYNC: r1 + r2 + 3,
            Phase.STAGE1: r1 - round_index + r2 + 2,
            Phase.STAGE1_STATS: r2 + 2,
            Phase.STAGE2: r2 - round_index + 1,
            Phase.STAGE2_STATS: 1,
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

    # --- the budget -----------------------------------------------------------------------

    def noise(self, keys: list[str], phase: Phase, round_index: int = 0) -> float | None:
        """The noise multiplier one release depending on the images of ``keys`` needs so that
        every one of them stays within budget; None when one of them cannot afford it."""
        ledger, left = self.memory.ledger(), self.setting.releases_left(phase, round_index)
        needed = []
        for key in keys:
            z = accountant.noise_multiplier(
                ledger.releases.get(key, []), left, self.setting.epsilon, self.setting.delta
            )
            if z is None:
                return None
            needed.append(z)
        return max(needed)

    def epsilon(self) -> float:
        """The site's ε: the largest of its classes' (each image is of one class)."""
        ledger = self.memory.ledger()
        return max(
            (accountant.epsilon(z, self.setting.delta) for z in ledger.releases.values()),
            default=0.0,
        )

    def _record(self, keys: list[str], z: float, what: str) -> None:
        ledger = self.memory.ledger()
        ledger.record(keys, z)
        self.memory.save_ledger(ledger)
        spent = max(accountant.epsilon(ledger.releases[key], self.setting.delta) for key in keys)
        logger.info(
            "privacy: released %s of %s with noise multiplier %.3g: their ε %.3g, the site's "
            "%.3g, of %.3g (δ %g)", what, ", ".join(keys), z, spent, self.epsilon(),
            self.setting.epsilon, self.setting.delta,
        )  # fmt: skip

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

    def counts(self, counts: Mapping[str, int]) -> tuple[list[ClassEntry], list[str]]:
        """The enrolment's entries: each class's noisy count (drawn once, then reused), and
        the classes whose budget cannot afford even that."""
        entries, refused = [], []
        for name, count in counts.items():
            key = class_key(name)
            released = self.memory.ledger().counts.get(key)
            if released is None:
                z = self.noise([key], Phase.SYNC)
                if z is None:
                    refused.append(name)
                    continue
                released = noisy_count(count, z, self.rng)
                ledger = self.memory.ledger()
                ledger.counts[key] = released
                self.memory.save_ledger(ledger)
                self._record([key], z, "the image count")
            entries.append(ClassEntry(name, released))
        return entries, refused

    def plan(self, names: list[str], phase: Phase, round_index: int) -> dict[str, float | None]:
        """The noise multiplier of each class's release in ``phase`` (None: refused). A
        training phase is one release over all the classes; a class without a released count
        is refused (its enrolment was)."""
        counts = self.memory.ledger().counts
        keys = {name: class_key(name) for name in names if class_key(name) in counts}
        if phase in STATISTICS:
            plan = {name: self.noise([key], phase) for name, key in keys.items()}
        else:  # every class's images move every class's update: all share, or none
            whole = len(keys) == len(names)
            z = self.noise(list(keys.values()), phase, round_index) if whole else None
            plan = dict.fromkeys(keys, z)
        return {name: plan.get(name) for name in names}

    def mixture_fit(
        self, phase: Phase, names: list[str], plan: Mapping[str, float | None]
    ) -> MixtureFit:
        """The statistics step's fit: for a class to share, one private Gaussian of its
        clipped features (records the release); for a refused one the ordinary fit, kept."""
        stage1 = phase is Phase.STAGE1_STATS
        counts = self.memory.ledger().counts

        def fit(features, labels, rows, n_components, seed) -> list[GaussianMixture]:
            dim = features.shape[1]
            radius = self.setting.clip_radius if stage1 else self.setting.vit_radius
            radius *= math.sqrt(dim)
            centre = self.clip_centre if stage1 else torch.zeros(dim, dtype=torch.float64)
            mixtures = []
            for i, row in enumerate(rows):
                name, own = names[i], features[labels == row]
                z = plan[name]
                if z is None:
                    mixtures.append(GaussianMixture.fit(own, n_components, seed=seed + row))
                    continue
                count = counts[class_key(name)]
                mixtures.append(private_gaussian(own, centre, radius, count, z, self.rng))
                self._record([class_key(name)], z, schema.trained_in(phase)[0])
            return mixtures

        return fit

    def release(
        self,
        phase: Phase,
        entries: list[ClassEntry],
        sent: Codebook,
        plan: Mapping[str, float | None],
    ) -> tuple[list[ClassEntry], dict[str, str]]:
        """The update's entries as released — statistics as fitted, training updates clipped
        and noised (recorded) — with the noisy counts, and the reply's metadata."""
        refused = [e.name for e in entries if plan[e.name] is None]
        shared = [e for e in entries if plan[e.name] is not None]
        counts = self.memory.ledger().counts
        if phase not in STATISTICS and shared:
            z = float(plan[shared[0].name])
            clip = self.setting.stage1_clip if phase is Phase.STAGE1 else self.setting.stage2_clip
            std = z * 2.0 * clip * math.sqrt(len(shared))
            released = []
            for entry in shared:
                before = {f: sent[entry.name].values[f] for f in entry.values}
                values = private_update(before, dict(entry.values), clip, std, self.rng)
                released.append(ClassEntry(entry.name, entry.count, values))
            shared = released
            self._record([class_key(e.name) for e in shared], z, f"the {phase.key} update")
        shared = [ClassEntry(e.name, counts[class_key(e.name)], e.values) for e in shared]
        return shared, self.metadata(refused)
