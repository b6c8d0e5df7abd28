"""``starfed site check``: everything a site needs before joining, checked with the site's code.

A site finds out about a bad folder only when the server's sync or training message fails on
it — minutes later, as a line in someone else's log. This reads the data folder as the site will
(``SiteFolder.scan``), decodes every image with the project's decoder, builds the backbones and
compares their fingerprint with the federation's, and looks at the state folder; every finding
is one line. A *problem* would stop the site (or make its sync fail); a *warning* is something
it would do that the engineer may not expect (skip a task, score no test image of a class).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from starfed.client import memory
from starfed.client.policy import (
    POLICY_FILE,
    PolicyError,
    PrivacyTerms,
    SitePolicy,
    read_policy,
    releases_of,
)
from starfed.client.privacy import PrivacySetting
from starfed.client.site import admitted
from starfed.shared.codebook.framing import read_message
from starfed.shared.config import parse
from starfed.shared.data.images import DatasetError, decode_quietly
from starfed.shared.data.site_folder import TEST_FOLDER, TEST_SHARE, SiteFolder, class_key
from starfed.shared.knob import Values
from starfed.shared.model.backbone_config import BackboneError, preset_config, read_backbone_config
from starfed.shared.model.backbone_options import BackboneOptions
from starfed.shared.progress import counted
from starfed.shared.protocol import Phase

OK, WARNING, PROBLEM = "ok", "warning", "problem"
DECODE_BATCH = 256  # images decoded at a time: bounds memory on large folders
SHOWN = 5  # file names listed in one finding


@dataclass
class Finding:
    level: str  # ok | warning | problem
    topic: str  # data, tasks, test images, class names, images, backbones, state
    message: str


@dataclass
class Task:
    name: str
    classes: dict[str, int]  # class folder -> training images


@dataclass
class SiteCheck:
    """What ``check`` found; ``ready`` when nothing would stop the site."""

    data: str
    state: str
    tasks: list[Task] = field(default_factory=list)
    test_images: dict[str, int] = field(default_factory=dict)  # class -> test images
    test_share: bool = False  # test images are a share of each class (no test/ folder)
    unreadable: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    federation_fingerprint: str | None = None
    remembered: dict[str, object] | None = None  # site.json: federation, completed tasks
    policy: dict[str, object] | None = None  # the policy in force, by its file's keys
    findings: list[Finding] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return all(f.level != PROBLEM for f in self.findings)

    def add(self, level: str, topic: str, message: str) -> None:
        self.findings.append(Finding(level, topic, message))

    def to_json(self) -> dict:
        return {"ready": self.ready, **asdict(self)}


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:SHOWN]) + (
        f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
    )


def check_site(
    data: Path,
    state: Path,
    backbones: BackboneOptions,
    federation_fingerprint: str | None = None,
    progress: bool = False,
    policy: Path | None = None,
    run_config: Values | None = None,
) -> SiteCheck:
    """Check a site's folders, policy and backbones; ``federation_fingerprint`` (a full
    fingerprint or a prefix) is what the federation's codebook says; ``policy``: the file
    ``site start --policy`` will be given (else the state folder's); ``run_config``: the
    server's, for what the policy would refuse."""
    report = SiteCheck(str(data), str(state), federation_fingerprint=federation_fingerprint)
    try:
        folder = SiteFolder.scan(data)
    except DatasetError as err:
        report.add(PROBLEM, "data", str(err))
        folder = None
    if folder is not None:
        _tasks(report, folder)
        _test_images(report, folder)
        _class_names(report, folder)
        _images(report, folder, _image_size(backbones), progress)
    _state(report, state, data)
    _policy(report, folder, state, policy, run_config)
    _backbones(report, backbones)
    return report


def _tasks(report: SiteCheck, folder: SiteFolder) -> None:
    report.tasks = [Task(t.name, {c: len(p) for c, p in t.train.items()}) for t in folder.tasks]
    images = sum(sum(t.classes.values()) for t in report.tasks)
    with_images = [t for t in report.tasks if any(t.classes.values())]
    if not with_images:
        report.add(PROBLEM, "tasks", f"{folder.root} holds no training image in any task")
        return
    report.add(
        OK, "tasks", f"{counted(len(with_images), 'task')}, {counted(images, 'training image')}"
    )
    for task in report.tasks:
        if not any(task.classes.values()):
            report.add(WARNING, "tasks", f"task {task.name} has no images: it is skipped")
        elif empty := [c for c, n in task.classes.items() if not n]:
            report.add(WARNING, "tasks", f"task {task.name}: empty class folders {empty}")


def _test_images(report: SiteCheck, folder: SiteFolder) -> None:
    report.test_share = not (folder.root / TEST_FOLDER).is_dir()
    trained = {class_key(c): c for t in report.tasks for c, n in t.classes.items() if n}
    counts = {key: len(paths) for key, paths in folder.test.items()}
    report.test_images = {trained.get(key, key): n for key, n in counts.items()}
    missing = [name for key, name in trained.items() if not counts.get(key)]
    how = (
        f"no {TEST_FOLDER}/ folder: {TEST_SHARE:.0%} of each class's images are held out"
        if report.test_share
        else f"{TEST_FOLDER}/"
    )
    report.add(OK, "test images", f"{sum(report.test_images.values())} ({how})")
    if missing:
        names = ", ".join(missing)
        report.add(WARNING, "test images", f"none for {names}: this site cannot score them")
    strays = sorted(set(counts) - set(trained))
    if strays and not report.test_share:
        names = ", ".join(strays)
        report.add(WARNING, "test images", f"{TEST_FOLDER}/ classes of no task: {names}")


def _class_names(report: SiteCheck, folder: SiteFolder) -> None:
    """Within a task, colliding names fail the scan; across tasks, a class in a later task is
    a frozen class brought again: the federation keeps it frozen (docs/sites.md)."""
    first: dict[str, tuple[str, str]] = {}  # class key -> (task, spelling)
    repeats = []
    for task in report.tasks:
        for name, n in task.classes.items():
            key = class_key(name)
            if n and key in first and first[key][0] != task.name:
                earlier, spelling = first[key]
                repeats.append(f"{name!r} in {task.name} (first {spelling!r} in {earlier})")
            elif n:
                first.setdefault(key, (task.name, name))
    if repeats:
        report.add(
            WARNING,
            "class names",
            "classes of an earlier task again, not trained again once finished: "
            + "; ".join(repeats),
        )
    else:
        report.add(OK, "class names", f"{len(first)} distinct classes under class_key")


def _image_size(options: BackboneOptions) -> int:
    config = (
        read_backbone_config(options.config_path)
        if options.config_path
        else preset_config(options.preset)
    )
    return config.image_size


def _images(report: SiteCheck, folder: SiteFolder, size: int, progress: bool) -> None:
    """Decode every image the site would read, in batches; report the unreadable ones."""
    owners: dict[str, str] = {}  # path -> the class (task/class, or test/key) it belongs to
    for task in folder.tasks:
        for name, paths in task.train.items():
            owners |= dict.fromkeys(paths, f"{task.name}/{name}")
    for key, paths in folder.test.items():
        owners |= {p: owners.get(p, f"{TEST_FOLDER}/{key}") for p in paths}
    paths = list(owners)
    report.unreadable = []
    for start in range(0, len(paths), DECODE_BATCH):
        batch = paths[start : start + DECODE_BATCH]
        report.unreadable += decode_quietly([(p, 0) for p in batch], size, progress)[1]
    if not report.unreadable:
        report.add(OK, "images", f"all {len(paths)} images decode")
        return
    report.add(
        WARNING,
        "images",
        f"{len(report.unreadable)} unreadable (skipped by the site): " + _listed(report.unreadable),
    )
    bad = set(report.unreadable)
    for task in folder.tasks:
        for name, files in task.train.items():
            if files and all(p in bad for p in files):
                report.add(
                    PROBLEM, "images", f"class {task.name}/{name} has no readable training image"
                )


def _backbones(report: SiteCheck, options: BackboneOptions) -> None:
    try:
        backbones = options.load()
    except (BackboneError, OSError, RuntimeError, ValueError) as err:
        report.add(PROBLEM, "backbones", f"cannot be loaded: {err}")
        return
    report.fingerprint = backbones.fingerprint
    weights = [w for w in (options.clip_weights, options.vit_weights) if w]
    source = f"weights {', '.join(weights)}" if weights else "no weight files (seeded init)"
    what = f"{backbones.config.name}, {source}, fingerprint {backbones.fingerprint[:12]}…"
    expected = report.federation_fingerprint
    if expected is None:
        report.add(
            WARNING,
            "backbones",
            f"{what}; not compared with the federation's (pass --codebook or --fingerprint)",
        )
    elif backbones.fingerprint.startswith(expected.lower()):
        report.add(OK, "backbones", f"{what}: the federation's")
    else:
        report.add(
            PROBLEM,
            "backbones",
            f"{what}, but the federation's are {expected[:12]}…: use the federation's --preset, "
            "--backbone-config and weight files (the server refuses other backbones)",
        )


def _state(report: SiteCheck, state: Path, data: Path) -> None:
    """Writable, outside the data folder; what it remembers (client/memory.py)."""
    if state == data or data in state.parents:
        report.add(PROBLEM, "state", f"{state} is inside the data folder {data}")
        return
    existing = next(p for p in (state, *state.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a folder")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        report.add(PROBLEM, "state", f"{state}: cannot write there ({err})")
        return
    if existing != state:
        report.add(OK, "state", f"{state} (new: made at the first message)")
        return
    remembered = _remembered(state)
    report.remembered = remembered
    if not remembered:
        report.add(OK, "state", f"{state} (writable; remembers no federation yet)")
        return
    completed = remembered["completed"]
    tasks = ", ".join(completed) or "none"
    version = remembered["codebook_version"]
    codebook = f", codebook v{version}" if version else ""
    federation = remembered["federation"][:8]
    report.add(OK, "state", f"{state}: federation {federation}, completed tasks: {tasks}{codebook}")
    gone = [t for t in completed if t not in {task.name for task in report.tasks}]
    if gone and report.tasks:
        report.add(WARNING, "state", f"completed tasks no longer in the data folder: {gone}")
    fingerprint = remembered.get("codebook_fingerprint")
    if report.federation_fingerprint is None and fingerprint:
        report.federation_fingerprint = fingerprint  # of the last codebook this site received


def _policy(
    report: SiteCheck,
    folder: SiteFolder | None,
    state: Path,
    path: Path | None,
    run_config: Values | None,
) -> None:
    """The policy in force, read as the site will (client/policy.py): what it sets, the
    classes it leaves out of the data folder, and the messages of ``run_config`` (the
    server's, as the operator announces it) it would refuse."""
    try:
        policy = read_policy(path, state)
    except PolicyError as err:
        report.add(PROBLEM, "policy", str(err))
        return
    report.policy = policy.to_json()
    default = SitePolicy().to_json()
    changed = [f"{k} = {v}" for k, v in report.policy.items() if v != default[k]]
    if not changed:
        report.add(OK, "policy", "none: every message answered, to any server")
        return
    report.add(OK, "policy", f"{path or state / POLICY_FILE}: {'; '.join(changed)}")
    if folder is not None and policy.filters_classes:
        _, left_out = admitted(folder, policy, patients=policy.privacy_unit == "patient")
        for name, why in left_out.items():
            report.add(WARNING, "policy", f"class {name} is never announced: {why}")
    if run_config is not None:
        _refusals(report, policy, run_config)


def _refusals(report: SiteCheck, policy: SitePolicy, run_config: Values) -> None:
    """Each message of a step the policy would refuse under ``run_config`` (the site's own
    privacy setting unknown here: the run's; the server and federation pins aside)."""
    setting = PrivacySetting.of(run_config, parse({}, "node-config"))
    terms = (
        None
        if setting is None
        else PrivacyTerms(setting.epsilon, setting.delta, setting.unit.value)
    )
    dtype = str(run_config["wire-dtype"])
    refused = False
    for phase in Phase:
        releases = releases_of(phase, ())
        reason = policy.refusal(
            releases, dtype, policy.federation, policy.server_certificate, terms
        )
        if reason is not None:
            refused = True
            report.add(WARNING, "policy", f"under this run config it refuses {phase.key}: {reason}")
    if not refused:
        report.add(OK, "policy", "under this run config it answers every message")


def _remembered(state: Path) -> dict | None:
    """``site.json`` and the held codebook's header, read without changing anything."""
    path = state / memory.STATE_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet (or damaged: the site starts its memory afresh)
        return None
    remembered: dict[str, object] = {
        "federation": str(saved.get("federation", "")),
        "completed": {str(k): int(v) for k, v in saved.get("completed", {}).items()},
        "codebook_version": None,
        "codebook_fingerprint": None,
    }
    codebook_path = state / memory.CODEBOOK_FILE
    if codebook_path.is_file():
        try:
            message = read_message(codebook_path)
        except (OSError, ValueError):  # damaged: the site downloads the whole codebook again
            return remembered
        remembered["codebook_version"] = message.version
        remembered["codebook_fingerprint"] = message.backbone_fingerprint
    return remembered
