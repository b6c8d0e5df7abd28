"""Every release a private site makes moves by at most its claimed sensitivity when one image
(or patient) is removed, every other class's releases do not move at all, and the noise drawn
is the ledger's noise multiplier times that sensitivity.

The tests drive a real ``Site`` (``starfed.client.site``) on a data folder of bundled images:
its sync, stage 1, stage-1 statistics, stage 2 and stage-2 statistics, from one codebook, with
the noise switched off (``RecordingNoise`` in place of the site's generator, which also records
the standard deviation of every draw). Its data folder holds D, or D minus one image (or one
patient's files), so the counts are the site's, the patient cap its scan's and the statistics
its own fit's; the releases compared are what the site's replies carry: the noisy counts, the
G_c and H_c moments read back from the released Gaussians, the stage-1 (prompt) and stage-2
(query prompt, query weights, head row) updates, and the first DP-SGD step's gradient sum of each
training phase (the step's inputs are D's or D − 1's alone only in the first step: later ones
start from what earlier steps made). A mutation check (``bench/privacy_mutations.py``)
shows that each one-line break of the release makes one of these tests fail.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
import torch
from PIL import Image

from starfed.client.memory import SITE_WIDE, SiteMemory
from starfed.client.ops.site_options import SiteOptions
from starfed.client.privacy import (
    PrivacyError,
    PrivacySetting,
    PrivacyUnit,
    PrivateReleases,
)
from starfed.client.site import Site
from starfed.shared.codebook import schema
from starfed.shared.codebook.codebook import Codebook
from starfed.shared.codebook.schema import ModelDims
from starfed.shared.config import parse
from starfed.shared.data.cropdiseases import bundled_dataset_root
from starfed.shared.data.images import DatasetError
from starfed.shared.data.scenario import Scenario, ScenarioConfig
from starfed.shared.data.site_folder import (
    SiteFolder,
    class_key,
    patient_name,
    patient_of,
    training_patient,
)
from starfed.shared.model import training
from starfed.shared.model.backbones import create_backbones
from starfed.shared.model.star_prompt import StarPrompt
from starfed.shared.model.training import TrainConfig
from starfed.shared.privacy import accountant
from starfed.shared.privacy.accountant import Release
from starfed.shared.privacy.mechanisms import (
    MOMENTS_SENSITIVITY,
    noisy_count,
    private_gaussian,
    private_gradient,
)
from starfed.shared.protocol import PRIVACY_EPSILON, STATISTICS, Phase

pytestmark = [pytest.mark.privacy, pytest.mark.usefixtures("one_torch_thread")]

CLASSES = ["Apple___Apple_scab", "Apple___Black_rot", "Apple___healthy"]
PER_CLASS = 8
#: Removed images: first, middle and last of the bundled ones, others across the classes, and
#: the black image (``task_images``).
REMOVED = [0, 5, PER_CLASS + 3, 2 * PER_CLASS, 3 * PER_CLASS - 1, 3 * PER_CLASS]
CONFIG = TrainConfig(stage1_epochs=1, stage2_epochs=1, batch_size=8, seed=1993)
#: Clipping bounds small enough that every unit's gradient is clipped (the bound binds); a
#: target loose enough that a class of a few units clears the announcing threshold (noise off,
#: the target sets nothing else the sensitivity tests see).
SETTING = PrivacySetting(16.0, 0.02, 0.4, 1.0, 1e-4, 1e-4, 1, 1, 1, 1, CONFIG.batch_size)
#: Float32 arithmetic depends on the batch an image is computed in (the matrix kernels block by
#: batch size): removing one image re-batches the others, and their features move by rounding
#: alone. ``ROW_ULPS`` float32 ulps per feature row is the budget for that (measured here: under
#: one; a real leak moves a class's moments by O(1/n) of a row, i.e. 10⁵ times more).
ROW_ULPS = 64
FLOAT32_EPS = torch.finfo(torch.float32).eps


def float_slack(rows: int, scale: float = 1.0) -> float:
    """What float32 rounding may move a release by that exact arithmetic leaves unchanged:
    ``rows`` rows, each moved by ``ROW_ULPS`` ulps of its norm in units of the release's bound
    (``scale``: the rows' largest norm in those units, ≥ 1), through both moments."""
    return rows * MOMENTS_SENSITIVITY * ROW_ULPS * FLOAT32_EPS * max(scale, 1.0)


class RecordingNoise:
    """A generator that draws no noise and records the standard deviation of every draw asked
    of it: a site's real release path with its noise switched off, and what its noise was.
    Its DP-SGD takes every unit in every step, and draws every view from seed 0."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: int | None = None):
        self.scales.extend([float(scale)] * (1 if size is None else int(size)))
        return np.zeros(size) if size is not None else 0.0

    def random(self, size: int) -> np.ndarray:
        return np.zeros(size)

    def integers(self, high: int) -> int:
        return 0


@pytest.fixture(scope="module")
def backbones():
    return create_backbones("tiny", seed=0)


def bundled_images(per_class: int) -> list[tuple[str, Path]]:
    """The first ``per_class`` bundled training images of each class, in class order."""
    return [
        (name, path)
        for name in CLASSES
        for path in sorted((bundled_dataset_root() / "train" / name).iterdir())[:per_class]
    ]


#: The bundled training images of the task, in class order: (class, image) pairs.
IMAGES = bundled_images(PER_CLASS)


#: A black image of the first class: its CLIP feature lies 1.8 radii from the mid-gray centre,
#: so clipping binds (the bundled images' lie within about one radius of it).
BLACK = "black.png"


def task_images(root: Path, per_class: int = PER_CLASS) -> list[tuple[str, Path, str]]:
    """The task's images as ``(class, image, file)``: ``per_class`` bundled ones of each class,
    then a black one."""
    black = root / BLACK
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(black)
    bundled = bundled_images(per_class)
    return [(name, path, path.name) for name, path in bundled] + [(CLASSES[0], black, BLACK)]


def data_folder(root: Path, images: list[tuple[str, Path, str]]) -> Path:
    """A site's data folder of one task: links named ``file`` to each (class, image, file),
    and an empty test folder (every image is a training image)."""
    for name, image, file in images:
        (root / "task-00" / name).mkdir(parents=True, exist_ok=True)
        (root / "task-00" / name / file).symlink_to(image)
    (root / "test").mkdir(parents=True, exist_ok=True)
    return root


@dataclass
class Released:
    """What a private site released in one step, noise off: the sync's counts, each statistics
    phase's moments read back from its Gaussians, each training phase's update (flat), the
    noise's standard deviations drawn per phase, and the ledger's new releases."""

    counts: dict[str, int]
    moments: dict[Phase, dict[str, np.ndarray]]
    updates: dict[Phase, torch.Tensor]
    first_step: dict[Phase, torch.Tensor]  # a training phase's first DP-SGD gradient sum, flat
    noise: dict[Phase, list[float]]
    charged: dict[Phase, dict[str, list[Release]]]
    radius: dict[Phase, float]
    centre: dict[Phase, float]  # the ball's centre's norm
    epsilon: dict[Phase, str]  # the site's ε each reply says


def read_back(mixture, centre: torch.Tensor, radius: float) -> np.ndarray:
    """The moments (Σu, Σu²) a released Gaussian says, in units of the radius: count × mean and
    count × (variance + mean²), exact unless the release projected them."""
    mean = (mixture.means[0] - centre.double()).numpy() / radius
    variance = mixture.variances[0].numpy() / radius**2
    return np.concatenate([mean * mixture.count, (variance + mean**2) * mixture.count])


def release(backbones, data: Path, state: Path, setting: PrivacySetting = SETTING) -> Released:
    """One step of a private ``Site`` on ``data`` (``site_step``), each DP-SGD step's noisy
    gradient sum recorded."""
    with pytest.MonkeyPatch.context() as patch:
        sums: list[torch.Tensor] = []

        def recorded(gradients, like, clip, noise_std, rng):
            out = private_gradient(gradients, like, clip, noise_std, rng)
            sums.append(torch.cat([g.detach().double().reshape(-1) for g in out]))
            return out

        patch.setattr(training, "private_gradient", recorded)
        return site_step(backbones, data, state, setting, sums)


def site_step(
    backbones, data: Path, state: Path, setting: PrivacySetting, sums: list[torch.Tensor]
) -> Released:
    """The sync, then stage 1, its statistics, stage 2 and its statistics from one codebook
    (the classes as the server registers them); ``sums``: where the steps' sums are recorded."""
    memory = SiteMemory(state, backbones.fingerprint, backbones.dims)
    site = Site("site", data, memory, backbones, CONFIG, state / "cache", privacy=setting)
    private = site.private
    assert private is not None
    noise = RecordingNoise()
    private.rng = noise
    history = memory.ledger().releases
    out = Released({}, {}, {}, {}, {}, {}, {}, {}, {})

    def spent(phase: Phase) -> None:
        nonlocal history
        now = memory.ledger().releases
        out.charged[phase] = {k: z[len(history.get(k, [])) :] for k, z in now.items()}
        out.noise[phase], history = list(noise.scales), now
        noise.scales.clear()

    sync = site.sync(0, [], "federation", "")
    out.counts = {e.name: e.count for e in sync.entries}
    out.epsilon[Phase.SYNC] = sync.metadata[PRIVACY_EPSILON]
    spent(Phase.SYNC)
    names = sorted(out.counts)
    if not names:
        raise ValueError("no class cleared the sync's announcing threshold: nothing to train")
    codebook = Codebook(backbones.fingerprint, backbones.dims)
    codebook = codebook.register(StarPrompt(backbones).new_entries(names, seed=0))
    for phase in (Phase.STAGE1, Phase.STAGE1_STATS, Phase.STAGE2, Phase.STAGE2_STATS):
        sums.clear()
        update = site.run_phase(phase, codebook, 0)
        out.epsilon[phase] = update.metadata[PRIVACY_EPSILON]
        spent(phase)
        if phase in STATISTICS:
            (field,) = schema.trained_in(phase)
            dim = backbones.dims.d_clip if phase is Phase.STAGE1_STATS else backbones.dims.d_vit
            centre, radius = private.ball(phase, dim)
            out.radius[phase], out.centre[phase] = radius, float(centre.norm())
            out.moments[phase] = {
                e.name: read_back(e.values[field], centre, radius) for e in update.entries
            }
        else:
            out.first_step[phase] = sums[0]
            out.updates[phase] = torch.cat(
                [
                    (e.values[f].double() - codebook[e.name].values[f].double()).reshape(-1)
                    for e in sorted(update.entries, key=lambda e: e.name)
                    for f in sorted(e.values)
                ]
            )
    return out


def moments_slack(released: Released, phase: Phase, name: str) -> float:
    """``float_slack`` of a class's rows: a row's rounding is of its own norm, at most the
    ball's centre's plus one radius in radii (clipped or not)."""
    rows = released.counts[name]
    return float_slack(rows, 1 + released.centre[phase] / released.radius[phase])


@pytest.fixture(scope="module")
def per_image(backbones, tmp_path_factory) -> tuple[Released, dict[int, Released]]:
    """The site's releases on D and on D minus each image of ``REMOVED``."""
    root = tmp_path_factory.mktemp("per-image")
    images = task_images(root)
    full = release(backbones, data_folder(root / "d" / "data", images), root / "d" / "state")
    less = {}
    for index in REMOVED:
        kept = images[:index] + images[index + 1 :]
        folder = root / str(index)
        less[index] = release(backbones, data_folder(folder / "data", kept), folder / "state")
    return full, less


def test_noisy_count_moves_by_one_for_its_class_only(per_image):
    full, less = per_image
    for index, released in less.items():
        own = CLASSES[0] if index == len(IMAGES) else IMAGES[index][0]
        assert full.counts[own] - released.counts[own] == 1
        assert all(full.counts[n] == released.counts[n] for n in CLASSES if n != own)


@pytest.mark.parametrize("phase", [Phase.STAGE1_STATS, Phase.STAGE2_STATS], ids=["G_c", "H_c"])
def test_mixture_moments_move_within_sensitivity_for_their_class_only(phase, per_image):
    full, less = per_image
    for index, released in less.items():
        own = CLASSES[0] if index == len(IMAGES) else IMAGES[index][0]
        changes = {
            n: float(np.linalg.norm(full.moments[phase][n] - released.moments[phase][n]))
            for n in CLASSES
        }
        slack = {n: moments_slack(full, phase, n) for n in CLASSES}
        assert 0 < changes[own] <= MOMENTS_SENSITIVITY + slack[own], (index, changes)
        others = {n: c for n, c in changes.items() if n != own}
        assert all(c <= slack[n] for n, c in others.items()), (index, own, changes, slack)


def clip_of(phase: Phase, setting: PrivacySetting = SETTING) -> float:
    return setting.stage1_clip if phase is Phase.STAGE1 else setting.stage2_clip


#: The DP-SGD steps a training phase of the tests runs: 25 images, batch 8, one epoch.
TRAINING = [Phase.STAGE1, Phase.STAGE2]


@pytest.mark.parametrize("phase", TRAINING, ids=["prompts", "head-Q-A"])
def test_first_dp_sgd_step_moves_within_one_clipped_gradient(phase, per_image):
    """A DP-SGD step's noisy sum (noise off) moves by at most C when one image is removed:
    every other image's gradient is the same (its views drawn from its own seed, the
    parameters the same at the first step), and the removed one's is clipped to C. Every
    image's gradient is clipped here (C 1e-4), so the sum of the 25 is far from 0 or C."""
    full, less = per_image
    clip = clip_of(phase)
    assert float(full.first_step[phase].norm()) > 2 * clip
    for released in less.values():
        change = float((full.first_step[phase] - released.first_step[phase]).norm())
        assert 0 < change <= clip * (1 + 1e-4)


def expected_noise(released: Released, phase: Phase, setting: PrivacySetting) -> list[float]:
    """The standard deviation each of a phase's draws must have, from the releases the ledger
    charged it: z·k per count, z·√2·k per moment coordinate, z·C per coordinate of each of a
    training release's DP-SGD steps (one release, charged to all the task's classes)."""
    charged = released.charged[phase]
    if phase is Phase.SYNC:
        return [rs[0].noise_multiplier * setting.group for _, rs in sorted(charged.items())]
    if phase in STATISTICS:
        dim = len(next(iter(released.moments[phase].values())))  # both moments
        return [
            r.noise_multiplier * MOMENTS_SENSITIVITY * setting.group
            for _, rs in sorted(charged.items())
            for r in rs * dim
        ]
    (release_,) = {r for rs in charged.values() for r in rs}
    assert sorted(charged) == sorted(map(class_key, released.counts))
    size = len(released.updates[phase]) * release_.sampling.steps
    return [release_.noise_multiplier * clip_of(phase, setting)] * size


@pytest.mark.parametrize("phase", TRAINING, ids=["prompts", "head-Q-A"])
def test_a_training_release_is_charged_its_dp_sgd_steps(phase, per_image):
    """The ledger records the sampling the steps ran with: rate batch / the released counts'
    sum, an epoch of ⌈1 / rate⌉ steps."""
    full, _ = per_image
    (release_,) = {r for rs in full.charged[phase].values() for r in rs}
    rate = CONFIG.batch_size / sum(full.counts.values())
    assert release_.sampling.rate == pytest.approx(rate)
    assert release_.sampling.steps == math.ceil(1 / rate) * CONFIG.stage1_epochs


#: Every phase that releases, in the order of a step.
RELEASES = [Phase.SYNC, Phase.STAGE1, Phase.STAGE1_STATS, Phase.STAGE2, Phase.STAGE2_STATS]


@pytest.mark.parametrize("phase", RELEASES, ids=lambda p: p.key)
def test_each_release_draws_z_times_its_sensitivity(phase, per_image):
    """The noise the site actually draws is the ledger's noise multiplier × the release's
    sensitivity: the accountant's ε is of the mechanism that ran."""
    full, _ = per_image
    assert full.noise[phase] == pytest.approx(expected_noise(full, phase, SETTING), rel=1e-12)


# --- each mechanism's noise against its calibration ------------------------------------------


def test_noisy_count_noise_has_the_calibrated_scale():
    """Noise z (sensitivity 1), then rounding: variance z² + 1/12."""
    z, rng = 3.0, np.random.default_rng(0)
    counts = np.array([noisy_count(1000, z, rng) for _ in range(20000)])
    assert counts.mean() == pytest.approx(1000, abs=0.1)
    assert counts.std() == pytest.approx(math.sqrt(z**2 + 1 / 12), rel=0.02)


def test_private_gradient_clips_each_unit_then_adds_the_noise_asked_for():
    like = [torch.zeros(40, dtype=torch.float64), torch.zeros(2, 30)]
    big = [torch.full((40,), 5.0, dtype=torch.float64), torch.ones(2, 30)]  # norm 33
    small = [torch.full((40,), 0.01, dtype=torch.float64), torch.zeros(2, 30)]  # norm 0.06
    units = [torch.stack(unit) for unit in zip(big, small, strict=True)]  # [unit, *shape] each
    none = [torch.zeros(0, *p.shape, dtype=p.dtype) for p in like]
    total = private_gradient(units, like, 0.5, 0.0, np.random.default_rng(0))
    flat = torch.cat([total[0], total[1].double().reshape(-1)])
    clipped = torch.cat([big[0], big[1].double().reshape(-1)])
    clipped = clipped * 0.5 / float(clipped.norm())
    torch.testing.assert_close(flat, clipped + torch.cat([small[0], torch.zeros(60)]))
    assert total[1].dtype == torch.float32  # each parameter keeps its dtype
    noisy = private_gradient(none, like, 0.5, 0.7, np.random.default_rng(1))
    flat = torch.cat([noisy[0], noisy[1].double().reshape(-1)])
    assert float(flat.std()) == pytest.approx(0.7, rel=0.15)  # 100 coordinates
    many = [private_gradient(none, like, 0.5, 0.7, np.random.default_rng(s))[0] for s in range(50)]
    assert float(torch.stack(many).std()) == pytest.approx(0.7, rel=0.03)


# --- the site owns its guarantee -----------------------------------------------------------


def test_the_run_config_cannot_raise_a_sites_delta():
    run = parse({"privacy-epsilon": 8.0, "privacy-delta": 0.1})
    assert PrivacySetting.of(run, parse({}, "node-config")).delta == 1e-5  # the local default
    own = parse({"privacy-delta": 1e-3}, "node-config")
    assert PrivacySetting.of(run, own).delta == 1e-3
    stricter = parse({"privacy-epsilon": 8.0, "privacy-delta": 1e-7})
    assert PrivacySetting.of(stricter, own).delta == 1e-7  # it may lower it


def test_the_run_config_cannot_make_a_patient_site_per_image():
    run = parse({"privacy-epsilon": 4.0})
    node = parse({"privacy-unit": "patient"}, "node-config")
    assert PrivacySetting.of(run, node).unit is PrivacyUnit.PATIENT
    patient_run = parse({"privacy-epsilon": 4.0, "privacy-unit": "patient"})
    assert PrivacySetting.of(patient_run, parse({}, "node-config")).unit is PrivacyUnit.PATIENT
    assert PrivacySetting.of(run, parse({}, "node-config")).unit is PrivacyUnit.IMAGE
    options = SiteOptions(
        "127.0.0.1:9092",
        Path("d"),
        Path("s"),
        "clinic",
        privacy=(4.0, 1e-6),
        privacy_unit="patient",
    )
    assert PrivacySetting.of(run, parse(options.node_config(), "node-config")).unit is (
        PrivacyUnit.PATIENT
    )


def test_a_delta_above_one_over_n_is_refused_in_one_line():
    setting = PrivacySetting.of(parse({"privacy-epsilon": 4.0}), parse({}, "node-config"))
    setting.check_delta(100_000)  # 1e-5 = 1/n: allowed
    with pytest.raises(PrivacyError, match=r"^privacy-delta 1e-05 is more than 1/n = 1e-05") as e:
        setting.check_delta(100_001)
    assert "\n" not in str(e.value)


def test_a_renamed_class_folder_does_not_release_its_images_again(tmp_path, caplog):
    """The ledger knows each image by digest, and the class it was first used in: a class
    folder renamed (or copied) under another name holds images of another class's, left out,
    so they are not released again under a fresh budget; a new state folder says that it
    starts from zero."""
    data = tmp_path / "data"
    (data / "test").mkdir(parents=True)  # every image a training image
    for name in ("scab", "rot"):
        (data / "task" / name).mkdir(parents=True)
        for i in range(3):
            (data / "task" / name / f"{i}.jpg").write_bytes(f"{name} {i}".encode())
    dims = ModelDims(8, 8, 8, 1)
    with caplog.at_level(logging.WARNING):
        private = PrivateReleases(SETTING, SiteMemory(tmp_path / "s", "f", dims), torch.zeros(8))
    assert "budget starts at zero" in caplog.text
    private.rng = RecordingNoise()  # noise off: each class clears the announcing threshold
    folder = private.protect(SiteFolder.scan(data))
    private.counts({name: len(paths) for name, paths in folder.tasks[0].train.items()})
    (data / "task" / "scab").rename(data / "task" / "apple scab")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = PrivateReleases(SETTING, SiteMemory(tmp_path / "s", "f", dims), torch.zeros(8))
        renamed = again.protect(SiteFolder.scan(data))
    assert "budget starts at zero" not in caplog.text
    assert "3 training images left out: their image is in another class" in caplog.text
    assert renamed.tasks[0].train == {"apple scab": [], "rot": folder.tasks[0].train["rot"]}


@pytest.mark.slow  # two fresh interpreters importing torch
def test_ledger_updates_from_two_processes_are_not_lost(tmp_path):
    dims = ModelDims(8, 8, 8, 1)
    code = (
        "import sys\nfrom starfed.client.memory import SiteMemory\n"
        "from starfed.shared.codebook.schema import ModelDims\n"
        "from starfed.shared.privacy.accountant import Release\n"
        "m = SiteMemory(sys.argv[1], 'f', ModelDims(8, 8, 8, 1))\n"
        "for _ in range(40):\n"
        "    with m.updating_ledger() as ledger:\n"
        "        ledger.record([sys.argv[2]], Release(1.0))\n"
    )
    workers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), key]) for key in "ab"]
    assert [w.wait(timeout=120) for w in workers] == [0, 0]
    releases = SiteMemory(tmp_path, "f", dims).ledger().releases
    assert {key: len(z) for key, z in releases.items()} == {"a": 40, "b": 40}


# --- the patient unit ------------------------------------------------------------------------

K = 2  # images per patient the tests cap at
#: Images of a patient in the patient tests: over the cap, so the cap binds; four patients a
#: class, so a class without one still clears the announcing threshold (5 at this target).
PATIENT_IMAGES = 3
PATIENTS = 4
PATIENT_SETTING = replace(SETTING, epsilon=32.0, unit=PrivacyUnit.PATIENT, patient_images=K)


def patient_images() -> list[tuple[str, Path, str]]:
    """Bundled images of the task's classes as patients', ``PATIENT_IMAGES`` consecutive
    images each, of one class: ``(class, image, <patient>__<file>)``."""
    root = bundled_dataset_root() / "train"
    return [
        (name, path, patient_name(f"p{c}-{j // PATIENT_IMAGES}", str(path)))
        for c, name in enumerate(CLASSES)
        for j, path in enumerate(sorted((root / name).iterdir())[: PATIENTS * PATIENT_IMAGES])
    ]


@pytest.fixture(scope="module")
def per_patient(backbones, tmp_path_factory) -> tuple[Released, dict[str, Released]]:
    """The patient site's releases on D and on D without each of three patients."""
    root = tmp_path_factory.mktemp("per-patient")
    images = patient_images()
    full = release(
        backbones, data_folder(root / "d" / "data", images), root / "d" / "state", PATIENT_SETTING
    )
    less = {}
    for patient in ("p0-0", "p1-2", "p2-3"):
        kept = [image for image in images if patient_of(image[2]) != patient]
        folder = root / patient
        data = data_folder(folder / "data", kept)
        less[patient] = release(backbones, data, folder / "state", PATIENT_SETTING)
    return full, less


def own_class(patient: str) -> str:
    return next(name for name, _, file in patient_images() if patient_of(file) == patient)


def test_removing_a_patient_moves_its_count_by_at_most_k(per_patient):
    full, less = per_patient
    for patient, released in less.items():
        own = own_class(patient)
        assert full.counts[own] - released.counts[own] == K  # the cap binds: 3 images, k 2
        assert all(full.counts[n] == released.counts[n] for n in CLASSES if n != own)


@pytest.mark.parametrize("phase", [Phase.STAGE1_STATS, Phase.STAGE2_STATS], ids=["G_c", "H_c"])
def test_removing_a_patient_moves_its_class_within_k_times_the_bound(phase, per_patient):
    full, less = per_patient
    for patient, released in less.items():
        own = own_class(patient)
        changes = {
            n: float(np.linalg.norm(full.moments[phase][n] - released.moments[phase][n]))
            for n in CLASSES
        }
        slack = {n: moments_slack(full, phase, n) for n in CLASSES}
        assert 0 < changes[own] <= K * MOMENTS_SENSITIVITY + slack[own], (patient, changes)
        assert all(c <= slack[n] for n, c in changes.items() if n != own), (changes, slack)


@pytest.mark.parametrize("phase", TRAINING, ids=["prompts", "head-Q-A"])
def test_removing_a_patient_moves_a_dp_sgd_step_by_one_clipped_gradient(phase, per_patient):
    """DP-SGD clips a patient's gradient (of their k images' summed loss) as one unit: removing
    the patient moves the first step's sum by at most C, as one image does."""
    full, less = per_patient
    clip = clip_of(phase, PATIENT_SETTING)
    for patient, released in less.items():
        change = float((full.first_step[phase] - released.first_step[phase]).norm())
        assert 0 < change <= clip * (1 + 1e-4), (patient, change, clip)


@pytest.mark.parametrize("phase", RELEASES, ids=lambda p: p.key)
def test_each_patient_release_draws_z_times_its_sensitivity(phase, per_patient):
    """With the patient unit, the count's and the moments' noise are k times the image's."""
    full, _ = per_patient
    assert full.noise[phase] == pytest.approx(
        expected_noise(full, phase, PATIENT_SETTING), rel=1e-12
    )


def test_patient_names_and_the_cap(tmp_path):
    assert patient_of("/d/scab/p0042__scan-3.jpg") == "p0042"
    assert patient_of("/d/scab/scan-3.jpg") is None and patient_of("/d/__x.jpg") is None
    with pytest.raises(DatasetError, match=r"scan\.jpg: no patient in its name"):
        training_patient("/d/a/scan.jpg")
    files = {
        "scab": ["a__1", "a__2", "a__3", "b__1", "d__2"],
        "rot": ["c__1", "c__2", "c__3", "d__1"],
    }
    (tmp_path / "data" / "test").mkdir(parents=True)  # every image a training image
    for name, names in files.items():
        (tmp_path / "data" / "task" / name).mkdir(parents=True)
        for f in names:
            (tmp_path / "data" / "task" / name / f"{f}.jpg").write_bytes(f.encode())
    memory = SiteMemory(tmp_path / "s", "f", ModelDims(8, 8, 8, 1))
    private = PrivateReleases(PATIENT_SETTING, memory, torch.zeros(8))
    kept = private.protect(SiteFolder.scan(tmp_path / "data")).tasks[0].train
    # at most K of a patient's images, in the first class it is seen in (rot, then scab)
    assert {n: [Path(p).stem for p in ps] for n, ps in kept.items()} == {
        "rot": ["c__1", "c__2", "d__1"],
        "scab": ["a__1", "a__2", "b__1"],
    }


def test_patient_unit_scales_the_noise_by_the_cap():
    z, k, rng = 2.0, 4, np.random.default_rng(3)
    counts = np.array([noisy_count(1000, z, rng, k) for _ in range(20000)])
    assert counts.std() == pytest.approx(math.sqrt((z * k) ** 2 + 1 / 12), rel=0.02)
    n, dim, radius = 50, 16, 2.0
    means = torch.stack(
        [
            private_gaussian(torch.zeros(n, dim), torch.zeros(dim), radius, n, z, rng, k).means[0]
            for _ in range(400)
        ]
    )
    assert means.std().item() == pytest.approx(z * MOMENTS_SENSITIVITY * k * radius / n, rel=0.05)


def test_a_simulated_site_names_its_images_as_patients_of_one_class(tmp_path):
    scenario = Scenario(ScenarioConfig(n_sites=2, patient_images=5))
    scenario.write_site(0, tmp_path, scenario.config.n_steps)
    folder = SiteFolder.scan(tmp_path)
    patients = folder.patients()
    assert patients and all(len(keys) == 1 for keys in patients.values())
    counts = Counter(patient_of(p) for t in folder.tasks for ps in t.train.values() for p in ps)
    assert max(counts.values()) <= 5
    assert all(patient_of(p) is None for ps in folder.test.values() for p in ps)


# --- every unit in one class, the switch the setting's, a class of one unit hidden ---------


def reply_epsilon(released: Released) -> set[str]:
    return set(released.epsilon.values())


def spent_within_target(state: Path, setting: PrivacySetting) -> dict[str, float]:
    """Each ledger key's ε, its own releases after any site-wide ones composed."""
    ledger = SiteMemory(state, "f", ModelDims(8, 8, 8, 1)).ledger()
    spent = {
        k: accountant.epsilon(ledger.past(k), setting.release_delta) for k in ledger.class_keys()
    }
    assert all(e <= setting.epsilon for e in spent.values()), spent
    return spent


def test_an_image_in_two_classes_is_released_in_one(backbones, tmp_path):
    """A copy of an image of the first class in the second (a multi-label image, or a copy):
    each class keeps its own budget key, the copy is left out of the second class — D replies
    exactly what D without the copy does — and D minus the image has the same counts outside
    the first class. (The replies' ε after the sync follow the task's released counts, which
    set DP-SGD's sampling rate, so D − 1's differ from D's through the first class's count.)"""
    (first, image), second = IMAGES[0], CLASSES[1]
    images = [(name, path, path.name) for name, path in IMAGES]
    copy = (second, image, f"copy-{image.name}")
    full = release(backbones, data_folder(tmp_path / "d", [*images, copy]), tmp_path / "ds")
    same = release(backbones, data_folder(tmp_path / "d-copy", images), tmp_path / "d-copys")
    less = release(backbones, data_folder(tmp_path / "d-1", images[1:]), tmp_path / "d-1s")
    assert full.counts == same.counts and full.epsilon == same.epsilon
    assert full.charged == same.charged
    assert full.counts[first] - less.counts[first] == 1
    assert {n: full.counts[n] for n in CLASSES[1:]} == {n: less.counts[n] for n in CLASSES[1:]}
    assert full.counts[second] == PER_CLASS  # not the first class's count
    assert sorted(spent_within_target(tmp_path / "ds", SETTING)) == sorted(map(class_key, CLASSES))
    assert full.epsilon[Phase.SYNC] == less.epsilon[Phase.SYNC]


def test_a_patient_in_two_classes_changes_neither_the_noise_nor_the_reply(backbones, tmp_path):
    """Per-class budgets whatever the patients: one patient with images in two classes is
    used in the first only: every release and reply is that of D without their images in the
    second class, and the sync's noise and ε those of D without them at all (after the sync
    the replies' ε follow the released counts: DP-SGD's sampling rate)."""
    images = patient_images()
    name, image, _ = images[-1]
    cross = (CLASSES[0], image, patient_name("p999", str(image)))  # p999: in two classes
    lone = (name, image, patient_name("p999", "x" + image.name))
    folders = {"d": [*images, cross, lone], "d-lone": [*images, cross], "d-1": images}
    out = {
        world: release(
            backbones, data_folder(tmp_path / world, kept), tmp_path / f"{world}s", PATIENT_SETTING
        )
        for world, kept in folders.items()
    }
    assert out["d"].charged[Phase.SYNC] == out["d-1"].charged[Phase.SYNC]
    assert out["d"].epsilon[Phase.SYNC] == out["d-1"].epsilon[Phase.SYNC]
    assert out["d"].charged == out["d-lone"].charged
    assert out["d"].epsilon == out["d-lone"].epsilon
    assert out["d"].counts[name] == out["d-1"].counts[name]  # p999 is the first class's
    assert out["d"].counts[CLASSES[0]] - out["d-1"].counts[CLASSES[0]] == 1
    spent_within_target(tmp_path / "ds", PATIENT_SETTING)


def test_site_wide_releases_of_an_old_ledger_count_in_every_class(backbones, tmp_path):
    """A ledger of a site whose patients once spanned classes holds site-wide releases: every
    class's budget counts them, so no patient's ε passes the target when they are gone."""
    state = tmp_path / "state"
    z = accountant.noise_multiplier([], 4, PATIENT_SETTING.epsilon, PATIENT_SETTING.release_delta)
    state.mkdir()
    (state / "privacy.json").write_text(json.dumps({"releases": {SITE_WIDE: [z] * 3}}))
    released = release(
        backbones, data_folder(tmp_path / "d", patient_images()), state, PATIENT_SETTING
    )
    spent = spent_within_target(state, PATIENT_SETTING)
    assert sorted(spent) == sorted(map(class_key, CLASSES))
    assert max(float(e) for e in released.epsilon.values()) == pytest.approx(max(spent.values()))


def test_a_class_of_one_image_is_announced_as_rarely_as_delta_allows(backbones, tmp_path):
    """A class whose one image is removed disappears from D − 1; in D it is not announced
    unless its noisy count clears a threshold a single image passes with probability at most
    half of δ (noise off here: never), so the sync and the training releases are D − 1's."""
    alone = (CLASSES[2], IMAGES[-1][1], IMAGES[-1][1].name)
    images = [(n, p, p.name) for n, p in IMAGES if n != CLASSES[2]]
    full = release(backbones, data_folder(tmp_path / "d", [*images, alone]), tmp_path / "ds")
    less = release(backbones, data_folder(tmp_path / "d-1", images), tmp_path / "d-1s")
    assert full.counts == less.counts and CLASSES[2] not in full.counts
    for phase in TRAINING:
        assert full.updates[phase].shape == less.updates[phase].shape
        assert full.charged[phase] == less.charged[phase] | {class_key(CLASSES[2]): []}
    assert full.epsilon == less.epsilon


@pytest.mark.parametrize("unit,k", [(PrivacyUnit.IMAGE, 1), (PrivacyUnit.PATIENT, 5)])
@pytest.mark.parametrize("z", [0.5, 2.6, 20.0])
def test_the_announcing_threshold_hides_a_class_of_one_unit(unit, k, z):
    setting = replace(SETTING, unit=unit, patient_images=k)
    threshold = setting.threshold(z)
    # round(k + N(0, (z·k)²)) ≥ t  ⟺  N ≥ t − ½ − k
    announced = 1 - NormalDist(k, z * k).cdf(threshold - 0.5)
    assert announced <= setting.selection_delta
    assert 1 - NormalDist(k, z * k).cdf(threshold - 1.5) > setting.selection_delta  # tight
    assert setting.selection_delta + setting.release_delta == setting.delta


def test_an_old_ledger_still_reads(tmp_path):
    """A ledger written before units were kept: its image digests tie those images to their
    key, its aliases still apply, its site-wide releases count in every key."""
    old = {
        "releases": {"scab": [2.0, 3.0], SITE_WIDE: [4.0]},
        "counts": {"scab": 7},
        "images": {"scab": ["aa", "bb"]},
        "aliases": {"apple_scab": "scab"},
    }
    (tmp_path / "privacy.json").write_text(json.dumps(old))
    ledger = SiteMemory(tmp_path, "f", ModelDims(8, 8, 8, 1)).ledger()
    assert ledger.units == {"aa": "scab", "bb": "scab"}
    assert ledger.key("apple_scab") == "scab" and ledger.class_keys() == ["scab"]
    assert ledger.past("scab") == [Release(4.0), Release(2.0), Release(3.0)]
    assert ledger.past("rot") == [Release(4.0)]
