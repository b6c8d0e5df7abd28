"""Every configuration knob of starfed, defined once: key, type, range, default, help.

Values enter from four places — command-line flags, ``--run-config KEY=VALUE``, Flower's run
config (``[tool.flwr.app.config]`` plus overrides) and a node's node config — and all of them go
through :func:`parse`, which returns typed values or raises one :class:`ConfigError` whose
one-line message names the key, the bad value and what is allowed.

Everything else is derived from the table. The typed options the code reads
(``ProtocolOptions`` here, ``BackboneOptions``, ``ScenarioConfig``, ``TrainConfig``,
``LocalRunOptions``) declare their fields with :func:`knob`, which takes the default from the
knob, and are filled from parsed values by :meth:`Options.from_config`, so nothing downstream
re-checks them. ``pyproject.toml``'s ``[tool.flwr.app.config]`` (Flower reads the run-config
defaults there) is written from the table (``starfed.shared.pyproject_table``).

One knob and the typed reading of its value are ``starfed.shared.knob``; the commands' own
knobs live with the commands (``starfed.simulations.research_knobs``: ``train-local``'s,
``simulate``'s, ``experiment``'s; ``starfed.cli.command_knobs``: ``server start``'s,
``predict``'s, ...), which read them with :func:`parse` and :func:`knob` over their tables.
This module imports nothing heavy: the command line validates with it before torch, data or
Flower are loaded.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from starfed.shared.codebook.framing import DEFAULT_MAX_BYTES
from starfed.shared.device import check as check_device
from starfed.shared.knob import (
    ConfigError,
    Knob,
    Value,
    Values,
    as_str,
    existing_dir,
    existing_file,
    optional,
)
from starfed.shared.model.backbone_config import PRESETS, read_backbone_config
from starfed.shared.registered_sites import parse_site_names, parse_site_privacy
from starfed.shared.retired_names import current_keys, written_as

WIRE_DTYPES = ("float32", "float16")
REPLAY_SCHEDULES = ("reference", "bounded", "auto")  # shared/model/replay.py: ReplaySchedule
PRIVACY_UNITS = ("image", "patient")  # what a site's ε protects (client/privacy.py)
MERGES = ("mean", "median")  # the default strategy's per-class estimator (server/robust.py)

#: Groups whose knobs form Flower's run config; "node" is the node config, "command" holds
#: options of one command that never travel in a Flower config, "environment" what a process
#: reads from ``STARFED_<KEY>`` variables (:func:`environment`).
RUN_GROUPS = ("scenario", "protocol", "screening", "training", "privacy", "backbones")


SCHEMA: tuple[Knob, ...] = (
    # scenario: which images each site holds, and when (docs/simulation.md)
    Knob(
        "data-root",
        str,
        "",
        "ImageFolder root (train/ and test/ class folders, or one folder "
        'per class); "": the bundled cropdiseases-mini set',
        "scenario",
        check=existing_dir,
        path=True,
    ),
    Knob("num-tasks", int, 7, "tasks the classes are split into", "scenario", ge=1),
    Knob(
        "classes-per-task",
        int,
        0,
        "classes per task; 0: all classes spread evenly over the tasks",
        "scenario",
        ge=0,
    ),
    Knob(
        "seed", int, 1993, "class order, partition and training", "scenario", ge=0, le=2**32 - 1
    ),  # what np.random.RandomState (the class order) accepts
    Knob("num-sites", int, 5, "sites (in simulation: SuperNodes)", "scenario", ge=1),
    Knob(
        "alpha",
        float,
        0.5,
        "Dirichlet concentration of the partition (small: each site sees few classes)",
        "scenario",
        gt=0,
    ),
    Knob("arrival-offset", int, 0, "site i joins i x offset steps after site 0", "scenario", ge=0),
    Knob(
        "min-partition-size",
        int,
        0,
        "per task, resample the partition until every site has this many images",
        "scenario",
        ge=0,
    ),
    Knob(
        "simulated-patient-images",
        int,
        0,
        "simulated sites: name every run of this many "
        "consecutive training images of a class as one patient's, all at one site, for the "
        "patient privacy unit (0: no patient names)",
        "scenario",
        ge=0,
    ),
    # protocol: how the server drives the phases, and where results go
    Knob("stage1-rounds", int, 1, "federated rounds of stage 1 per task", "protocol", ge=1),
    Knob("stage2-rounds", int, 1, "federated rounds of stage 2 per task", "protocol", ge=1),
    Knob(
        "wire-dtype", str, "float32", "dtype of the tensors sent", "protocol", choices=WIRE_DTYPES
    ),
    Knob(
        "timeout-s",
        float,
        600.0,
        "seconds the server waits for the replies of one phase",
        "protocol",
        gt=0,
    ),
    Knob(
        "part-bytes",
        int,
        DEFAULT_MAX_BYTES,
        "the most bytes of one message carrying the codebook to a site: a site whose codebook "
        "would pass it is caught up in parts of at most this many (each within timeout-s); less "
        "than a site's limit (the default) where a proxy in front of the server carries less, "
        "or a slow link must deliver each part in time; at least what one class needs",
        "protocol",
        ge=1,
        le=DEFAULT_MAX_BYTES,
    ),
    Knob("results-dir", str, "results", "folder of the run folders", "protocol", path=True),
    Knob(
        "run-name",
        str,
        "",
        'folder in results-dir; "": fed-<UTC time> (flwr run: fed-<run id>; train-local: local-…)',
        "protocol",
    ),
    Knob(
        "federation-dir",
        str,
        "",
        'the federation folder the server continues; "": the run '
        "folder (a simulation's own federation)",
        "protocol",
        path=True,
    ),
    Knob(
        "max-steps",
        int,
        0,
        "aggregation steps of one server run; 0: until no site brings a new class",
        "protocol",
        ge=0,
    ),
    Knob(
        "checkpoints-kept",
        int,
        10,
        "codebooks of completed steps kept in the federation "
        "folder's checkpoints/ for `starfed server repair` (the newest; 0: every one)",
        "protocol",
        ge=0,
    ),
    Knob(
        "min-sites", int, 1, "sites that must be connected before the first step", "protocol", ge=1
    ),
    Knob("wait-s", float, 120.0, "seconds to wait for min-sites", "protocol", gt=0),
    Knob(
        "fraction-train",
        float,
        1.0,
        "share of the sites sampled for each training and "
        "statistics round (seeded; every class in play keeps a holder)",
        "protocol",
        gt=0,
        le=1,
    ),
    Knob("min-train-sites", int, 1, "at least this many sites per sampled round", "protocol", ge=1),
    Knob(
        "server-test-dir",
        str,
        "",
        "a folder of class folders the server also scores each "
        'step on (e.g. a simulation\'s test set); "": none',
        "protocol",
        path=True,
    ),
    Knob(
        "merge",
        str,
        "median",
        "how a class is merged: median (coordinate-wise over its "
        "sites' rows, where 3 or more sites hold it: no one site moves it) or mean (weighted "
        "by examples; always, where fewer sites hold it)",
        "protocol",
        choices=MERGES,
    ),
    # screening: what the server believes of a site (server/screening.py, docs/security.md)
    Knob(
        "update-bound",
        float,
        1000.0,
        "reject a class's update row whose change from the "
        "value sent is over this multiple of the phase's median change (per field, over the "
        "rows that changed); 0: no bound",
        "screening",
        ge=0,
    ),
    Knob(
        "reference-bound",
        float,
        100.0,
        "reject a row whose change is over this multiple of the class's own size before the "
        "phase (its norm, at least 0.02 per element), whatever the senders; 0: no bound",
        "screening",
        ge=0,
    ),
    Knob(
        "history-bound",
        float,
        20.0,
        "also reject a row whose change is over this multiple of the scale of honest changes "
        "in earlier steps (the median change ÷ class size of each site, where 3 or more sites "
        "sent the field; kept in change-scale.json) × the class's size, 5 × it for stage 1's "
        "rows (plain SGD's partial batches move them further); 0: no bound",
        "screening",
        ge=0,
    ),
    Knob(
        "mixture-bound",
        float,
        1000.0,
        "reject mixture statistics whose variances or means are over this multiple of the "
        "reference (median over sites, or the codebook's fitted mixtures), means or E‖x‖² "
        "under its inverse, or variances below any fit's; 0: no bound",
        "screening",
        ge=0,
    ),
    Knob(
        "max-class-share",
        float,
        1.0,
        "the largest share of one site's examples in the merge "
        "of a class that other sites also hold (counts from the sync); 1: no cap",
        "screening",
        gt=0,
        le=1,
    ),
    Knob(
        "quarantine-after",
        int,
        3,
        "screening findings after which a site is left out of the rest of the step; 0: never",
        "screening",
        ge=0,
    ),
    Knob(
        "quarantine-persists",
        bool,
        False,
        "keep a quarantined site out of later steps too "
        "(until the operator removes it from the federation's quarantine.json)",
        "screening",
    ),
    Knob(
        "site-names",
        str,
        "",
        "the registered sites, NODE:NAME ... (`starfed server run` "
        "sets it from sites.json): a registered node is known by its registered name, whatever "
        'it calls itself, and no other node may use that name; "": sites are known by the '
        "names they give",
        "screening",
        check=parse_site_names,
    ),
    Knob(
        "site-privacy",
        str,
        "",
        "the registered sites that declared the privacy setting, NODE:EPSILON ... (`starfed "
        "server run` sets it from sites.json): their rows are held to their release's bound "
        "(clip plus noise) instead of the scale of honest training; with the run's own "
        "privacy-epsilon every site is private",
        "screening",
        check=parse_site_privacy,
    ),
    Knob(
        "max-new-classes",
        int,
        1000,
        "new classes one site may bring in one step (a site bringing more sits the step out)",
        "screening",
        ge=1,
    ),
    Knob(
        "max-step-classes",
        int,
        100,
        "new classes of one step over all sites (the server's replay costs their square; the "
        "largest bringers sit the step out first)",
        "screening",
        ge=1,
    ),
    Knob(
        "max-classes",
        int,
        10000,
        "classes the federation may hold (a codebook past one message reaches a site in parts)",
        "screening",
        ge=1,
    ),
    # training: one task's hyper-parameters (shared/model/training.py: TrainConfig)
    Knob("stage1-epochs", int, 5, "local epochs of stage 1 (per round)", "training", ge=0),
    Knob("stage2-epochs", int, 5, "local epochs of stage 2 (per round)", "training", ge=0),
    Knob("replay1-epochs", int, 10, "first-level replay epochs", "training", ge=0),
    Knob("replay2-epochs", int, 10, "second-level replay epochs at task 0", "training", ge=0),
    Knob(
        "replay2-epochs-per-task",
        int,
        5,
        "extra second-level replay epochs per task index",
        "training",
        ge=0,
    ),
    Knob(
        "replay-schedule",
        str,
        "auto",
        "how many optimizer steps each replay takes: "
        "reference (the paper's epochs over every seen class: a step costs O(t x classes)), "
        "bounded (replay1-steps and replay2-steps class-balanced batches at every step, the "
        "head warm-started from its last alignment: docs/model.md#bounded-replay) or auto "
        "(reference for the first 10 tasks, bounded after)",
        "training",
        choices=REPLAY_SCHEDULES,
    ),
    Knob(
        "replay1-steps",
        int,
        25,
        "the bounded schedule's optimizer steps of one first-level "
        "replay (each a pass of CLIP's text tower), whatever the step and the classes",
        "training",
        ge=1,
    ),
    Knob(
        "replay2-steps",
        int,
        250,
        "the bounded schedule's optimizer steps of one head "
        "replay, whatever the step and the number of classes",
        "training",
        ge=1,
    ),
    Knob("batch-size", int, 128, "training batch size", "training", ge=1),
    Knob("mixture-components", int, 5, "Gaussians per class and feature space", "training", ge=1),
    Knob(
        "confidence-modulation",
        bool,
        True,
        "scale first-level logits by the prompt selection's confidence",
        "training",
    ),
    # differential privacy of what a site releases (docs/security.md#differential-privacy)
    Knob(
        "privacy-epsilon",
        float,
        0.0,
        "each site's target epsilon for one training image "
        "over the federation's life; 0: off (no noise)",
        "privacy",
        ge=0,
    ),
    Knob(
        "privacy-delta",
        float,
        1e-5,
        "each site's target delta, unless the site's own (node config) is lower",
        "privacy",
        gt=0,
        le=0.1,
    ),
    Knob(
        "privacy-clip-radius",
        float,
        0.4,
        "CLIP features are clipped to this radius x sqrt(dim) about a mid-gray image's feature",
        "privacy",
        gt=0,
    ),
    Knob(
        "privacy-vit-radius",
        float,
        1.0,
        "ViT features are clipped to this radius x sqrt(dim) about the origin",
        "privacy",
        gt=0,
    ),
    Knob(
        "privacy-stage1-clip",
        float,
        20.0,
        "L2 bound of one image's (patient's) gradient in a stage-1 DP-SGD step (prompts)",
        "privacy",
        gt=0,
    ),
    Knob(
        "privacy-stage2-clip",
        float,
        5.0,
        "L2 bound of one image's (patient's) gradient in a stage-2 DP-SGD step "
        "(query prompts and weights, head rows)",
        "privacy",
        gt=0,
    ),
    Knob(
        "privacy-unit",
        str,
        "image",
        "what each site's epsilon protects: one training image, "
        "or one patient (images named <patient>__<name>: docs/sites.md#patients)",
        "privacy",
        choices=PRIVACY_UNITS,
    ),
    Knob(
        "privacy-patient-images",
        int,
        5,
        "unit patient: the most images of one patient a "
        "class uses (the others are left out); count and mixture noise grow with it",
        "privacy",
        ge=1,
    ),
    # backbones: the frozen pair every participant loads (fingerprints must match)
    Knob("preset", str, "tiny", "backbone pair", "backbones", choices=PRESETS),
    Knob(
        "device",
        str,
        "auto",
        "where the server and simulated sites compute: auto (the GPU "
        "when there is one), cpu, cuda, cuda:N, mps",
        "backbones",
        check=check_device,
    ),
    Knob(
        "backbone-config",
        str,
        "",
        'JSON BackboneConfig, overrides preset; "": none',
        "backbones",
        check=read_backbone_config,
        path=True,
    ),
    Knob(
        "clip-weights",
        str,
        "",
        'local CLIP weights (.safetensors/.pt); "": none',
        "backbones",
        check=existing_file,
        path=True,
    ),
    Knob(
        "vit-weights",
        str,
        "",
        'local ViT weights (.safetensors/.pt); "": none',
        "backbones",
        check=existing_file,
        path=True,
    ),
    # node config: what one SuperNode says about itself
    Knob(
        "data-dir",
        str,
        "",
        "a deployed site's data folder: its task folders and test/ (docs/sites.md)",
        "node",
        path=True,
    ),
    Knob(
        "state-dir",
        str,
        "",
        "a deployed site's memory (last codebook, completed tasks, "
        'caches); "": <data-dir>/.starfed',
        "node",
        path=True,
    ),
    Knob("site-name", str, "", 'how the federation calls this site; "": node-<node id>', "node"),
    Knob("partition-id", int, 0, "this node's site in a simulation", "node", ge=0),
    Knob(
        "num-partitions",
        int,
        0,
        "sites in a simulation (Flower: num-supernodes); 0: the run config's num-sites",
        "node",
        ge=0,
    ),
    Knob(
        "cache-dir",
        str,
        "",
        'decoded images and CLIP features; "": <state-dir>/cache for a '
        "deployed site, $STARFED_CACHE_DIR or ~/.cache/starfed in a simulation",
        "node",
        path=True,
    ),
    Knob(
        "worker-socket",
        str,
        "",
        "a site worker answering for this node (starfed site start "
        'runs one: starfed.client.worker); "": answer in the ClientApp process',
        "node",
        path=True,
    ),
    Knob(
        "device",
        str,
        "",
        'where this deployed site computes (auto, cpu, cuda, cuda:N, mps); "": the run config\'s',
        "node",
        check=check_device,
    ),
    Knob(
        "privacy-epsilon",
        float,
        0.0,
        "this site's target epsilon for one of its training "
        "images over the federation's life; 0: the run config's",
        "node",
        ge=0,
    ),
    Knob(
        "privacy-unit",
        str,
        "image",
        "what this site's epsilon protects: one training "
        "image, or one patient (docs/sites.md#patients); a run config's patient wins",
        "node",
        choices=PRIVACY_UNITS,
    ),
    Knob(
        "privacy-delta",
        float,
        1e-5,
        "this site's target delta (at most 1/n for its n "
        "training images or patients); the run config's may lower it, never raise it",
        "node",
        gt=0,
        le=0.1,
    ),
    # the model's own knob that one command sets (TrainConfig reads it; the other command options
    # live with the commands: starfed.simulations.research_knobs, starfed.cli.command_knobs)
    Knob(
        "generative-replay",
        bool,
        True,
        "replay features drawn from the class mixtures (a "
        "federation's is its strategy's: the starfed-no-replay baseline)",
        "command",
        command="train-local",
    ),
    # environment: what a process reads from STARFED_<KEY> (``environment()``), whoever starts it
    Knob(
        "cache-dir",
        str,
        "",
        "decoded images and CLIP features of simulated sites and "
        'the experiment\'s single-site methods; "": ~/.cache/starfed',
        "environment",
        path=True,
    ),
    Knob(
        "server-dir",
        str,
        "",
        'the server folder of `starfed server` actions without --dir; "": ./starfed-server',
        "environment",
        path=True,
    ),
    Knob(
        "fused-adam",
        bool,
        False,
        "stage 2's Adam updates all its tensors in one fused kernel "
        "(a GPU option, docs/benchmarks.md)",
        "environment",
    ),
    Knob(
        "fast-towers",
        bool,
        True,
        "the frozen towers run as one fused path "
        "(shared/model/frozen_towers.py); false: each module's own forward, to compare both "
        "(docs/benchmarks.md)",
        "environment",
    ),
)

Tables = Mapping[str, Mapping[str, Knob]]


def tables(schema: tuple[Knob, ...]) -> dict[str, dict[str, Knob]]:
    """Knob tables by where their values come from: Flower's configs, the environment, or one
    command's options."""
    return {
        "run-config": {k.key: k for k in schema if k.group in RUN_GROUPS},
        "node-config": {k.key: k for k in schema if k.group == "node"},
        "environment": {k.key: k for k in schema if k.group == "environment"},
        **{
            command: {k.key: k for k in schema if command in k.commands}
            for command in dict.fromkeys(c for k in schema for c in k.commands)
        },
    }


#: The model's tables; with the commands' own: ``starfed.cli.command_knobs.TABLES``
#: (the research commands' alone: ``starfed.simulations.research_knobs.TABLES``).
TABLES = tables(SCHEMA)


def parse(
    raw: Mapping[str, object],
    table: str = "run-config",
    names: Mapping[str, str] | None = None,
    tables: Tables = TABLES,
) -> dict[str, Value]:
    """Typed values of every knob of ``table``: those in ``raw`` checked, the rest defaults.

    ``names`` says what the user typed for a key (a flag such as ``--tasks``), for the message;
    ``tables``: the model's, or more (``starfed.cli.command_knobs.TABLES``: every one). A retired
    run-config key is read as its new one (``starfed.shared.retired_names``).
    """
    knobs = tables[table]
    if table == "run-config":
        names = {**written_as(raw), **(names or {})}
        raw = current_keys(raw)
    unknown = [key for key in raw if key not in knobs]
    if unknown:
        raise ConfigError(f"unknown {table} key {unknown[0]!r} (known: {', '.join(knobs)})")
    names = names or {}
    return {
        key: knob.parse(raw[key], names.get(key)) if key in raw else knob.default
        for key, knob in knobs.items()
    }


def environment_variable(key: str) -> str:
    """The variable an environment knob is read from: ``cache-dir`` → ``STARFED_CACHE_DIR``."""
    return "STARFED_" + key.upper().replace("-", "_")


def environment() -> dict[str, Value]:
    """Typed values of the environment knobs: those set (and not empty) checked, the rest
    defaults; a bad one is a ``ConfigError`` naming its variable."""
    raw = {key: os.environ.get(environment_variable(key), "") for key in TABLES["environment"]}
    set_ = {key: value for key, value in raw.items() if value}
    return parse(set_, "environment", {key: environment_variable(key) for key in set_})


def run_dir(values: Values, run_id: int) -> Path:
    """The folder of a run: ``<results-dir>/<run-name>``, where an empty run name becomes
    ``fed-<run id>`` — the server and the simulated sites derive the same folder."""
    return Path(as_str(values, "results-dir")) / (as_str(values, "run-name") or f"fed-{run_id}")


# --- typed options, derived from the table ------------------------------------------------


def knob(
    key: str,
    convert: Callable[[Any], Any] | None = None,
    table: str = "run-config",
    tables: Tables = TABLES,
) -> Any:
    """A dataclass field read from knob ``key`` of ``table``: its default is the knob's, passed
    through ``convert`` (e.g. :func:`optional`: "" becomes None) like every parsed value."""
    default = tables[table][key].default
    metadata = {"knob": key, "convert": convert, "table": table}
    if convert is None:
        return dataclasses.field(default=default, metadata=metadata)
    return dataclasses.field(default_factory=lambda: convert(default), metadata=metadata)


class Options:
    """Options whose fields are declared with :func:`knob` (and options nested as a field with
    ``default_factory=`` their class): built from parsed values by one generic rule, never
    copied field by field."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # subclasses: dataclasses

    @classmethod
    def from_config(cls, values: Values) -> Self:
        """The knobs' values in ``values`` (as :func:`parse` returns them); fields that are no
        knob keep their defaults, and so do a command's own knobs outside that command (the
        federation runs its ablations as strategies: ``generative-replay`` stays True there)."""
        given: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            factory = field.default_factory
            if isinstance(factory, type) and issubclass(factory, Options):  # nested options
                given[field.name] = factory.from_config(values)
            elif "knob" in field.metadata:
                key, table = field.metadata["knob"], field.metadata["table"]
                if key not in values and table != "run-config":
                    continue  # a command's own knob keeps its default outside that command
                convert = field.metadata["convert"] or (lambda value: value)
                given[field.name] = convert(values[key])
        return cls(**given)


@dataclass(frozen=True)
class ProtocolOptions(Options):
    """How the server drives the phases, and where a run keeps its federation."""

    stage1_rounds: int = knob("stage1-rounds")
    stage2_rounds: int = knob("stage2-rounds")
    timeout_s: float = knob("timeout-s")
    part_bytes: int = knob("part-bytes")  # of a catch-up's part (server/catch_up.py)
    wire_dtype: str = knob("wire-dtype")
    results_dir: str = knob("results-dir")
    run_name: str | None = knob("run-name", optional)
    federation_dir: str | None = knob("federation-dir", optional)  # None: the run's folder
    max_steps: int = knob("max-steps")  # 0: until no site brings a new class
    checkpoints_kept: int = knob("checkpoints-kept")  # 0: every completed step's codebook
    min_sites: int = knob("min-sites")
    wait_s: float = knob("wait-s")  # for min_sites to connect
    fraction_train: float = knob("fraction-train")  # share of sites per training round
    min_train_sites: int = knob("min-train-sites")
    server_test_dir: str | None = knob("server-test-dir", optional)
    merge: str = knob("merge")  # the default strategy's estimator (server/robust.py)
