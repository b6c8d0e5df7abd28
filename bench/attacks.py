"""Issue 43's attacks on honest sites' accuracy, each against the clean run, over seeds.

Each attack is the one its test rebuilds (``tests/test_adversarial_accuracy.py``,
``tests/test_adversarial_alone.py``, ``tests/test_adversarial.py``): three sites through the
real ClientApp on the local runtime (``LocalGrid``, tiny backbones, the default merge), farm-m's
replies edited as protobuf bytes. Per seed, each scenario runs once clean (farm-m honest) and
once per attack; the row is each honest site's accuracy after the run (a rolled-back step
leaves the step before's), its change against the clean run, the findings against farm-m and
the run's status and wall. An attack that adds what an honest site could add is measured
against that honest site instead (``Attack.against``: ten invented classes against ten genuine
ones). The goal (issue 43): no attack costs an honest site more than 5
points unseen — an attack with findings is seen, one without must cost nothing.

The tests' folders have 5 test images per class: one image is 10 points of a site of two
classes, too coarse to tell 5 points from noise. The bench's sites keep the tests' 12 training
images per class and test on ``--test-images`` (48 by default) of the same class: the bundled
set's 20 test images and its last training images, which no site trains on (the folders take
the first 12): one image is about 1 point. They are real images, not augmented copies, but few
(the bundled set has 80 + 20 a class) and the same at every site that holds the class.

    python bench/attacks.py                         # seeds 1993 1994 1995, every attack
    python bench/attacks.py --seeds 1993 --attacks 1 3
    python bench/attacks.py --test-images 5         # the tests' folders
    python bench/attacks.py --json results.json

Is attack 5's cost of a few invented classes noise? ``--spread`` runs, instead of the attacks,
farm-m's ten classes over draws: per seed and per spelling of the ten names (``SPELLINGS``: a
class's name seeds its initial values, so each spelling is another draw of the same
federation), the ten genuine (``FEW_REAL``'s classes), invented (copies of A1's training
images, ``FEW_INVENTED``), aimed (A1's images no site trains on, ``others_images``) and aimed
apart (a share each of those images, ``disjoint_images``; ``--tens`` picks the kinds). The
noise is the difference of two genuine draws of one seed; the attack's cost, an invented draw
less the genuine one of its seed and spelling. Each site's differences get their mean, its
95 % t intervals (over the pairs, and over the seeds' means), their spread and range; the JSON
is written after every run, so a run that dies keeps its rows (bench/results/attacks_spread.md):

    nice -n 10 python bench/attacks.py --spread --seeds $(seq 1993 2007) --spellings 3 \\
        --json spread.json
    python bench/attacks.py --summary spread.json more.json   # their draws' table
"""

from __future__ import annotations

import argparse
import enum
import functools
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_adversarial_accuracy as accuracy_tests
from site_folders import BUNDLED, TRAIN_IMAGES, disjoint_images, site_with_tests
from test_adversarial import (
    STATISTICS,
    TRAINING,
    UPDATE_RECORDS,
    claim_classes,
    edit_update,
)
from test_adversarial_alone import (
    A1,
    C0,
    FEW_INVENTED,
    FEW_REAL,
    LONE,
    M1,
    OWN,
    REGISTERED,
    X,
    along_a1s_head,
    federate,
    scaled,
)

from starfed.proto import codebook_pb2 as pb
from starfed.server.federation import Federation
from starfed.shared.protocol import PRIVACY_EPSILON

HONEST = ("farm-a", "farm-b")


def others_images(root: Path, tasks: dict[str, list[str]], test_images: int) -> Path:
    """``site_with_tests``, with each class respelled from another (``source=spelling``) trained
    on the source's training images ``TRAIN_IMAGES`` to 2 × ``TRAIN_IMAGES`` instead of its
    first: images of that class which no site trains on (attack 5 aimed: not a copy of the
    other site's class, more images of it)."""
    folder = site_with_tests(root, tasks, test_images)
    for task, classes in tasks.items():
        for source, _, spelling in (spec.partition("=") for spec in classes):
            if spelling:
                target = folder / task / spelling
                for link in target.iterdir():
                    link.unlink()
                images = sorted((BUNDLED / "train" / source).iterdir())
                for image in images[TRAIN_IMAGES : 2 * TRAIN_IMAGES]:
                    (target / image.name).symlink_to(image)
    return folder


#: Training images of each respelled class in ``few_images``: ``disjoint_images``'s share.
FEW = 4


def few_images(root: Path, tasks: dict[str, list[str]], test_images: int) -> Path:
    """``site_with_tests``, with each respelled class trained on its first ``FEW`` images
    only: the genuine ten at the disjoint variant's size, to tell what its few images cost
    from what its aim does."""
    folder = site_with_tests(root, tasks, test_images)
    for task, classes in tasks.items():
        for _, _, spelling in (spec.partition("=") for spec in classes):
            if spelling:
                for link in sorted((folder / task / spelling).iterdir())[FEW:]:
                    link.unlink()
    return folder


def _private_scaled(message: pb.ClientUpdate) -> None:
    """Attack 2: X's rows × 20 and the privacy key (ε 8) in the reply's metadata, from a site
    registered without the privacy setting (``REGISTERED``)."""
    scaled(20.0, {X})(message)
    message.metadata[PRIVACY_EPSILON] = "8"


@dataclass(frozen=True)
class Attack:
    """One attack: its number in issue 43, its scenario (sites, steps, run config beyond the
    tiny one), farm-m's faults (given the run's folder)."""

    number: int
    what: str
    sites: dict
    steps: int
    faults: Callable[[Path], dict]
    #: the sites of the run it is measured against, where not ``sites`` with farm-m honest:
    #: farm-m absent (an attack whose site sits the step out), or farm-m's genuine counterpart
    against: dict | None = None
    config: tuple[tuple[str, str], ...] = ()
    #: how each site's folder is made (given its root, tasks and test images)
    folder: Callable[[Path, dict[str, list[str]], int], Path] = site_with_tests


ATTACKS = (
    Attack(
        1,
        "lone holder in a busy phase, its class's head row x 30",
        accuracy_tests.BUSY,
        2,
        lambda _: {
            "train.stage2": edit_update(accuracy_tests.head_scaled(30.0, {accuracy_tests.M2}))
        },
    ),
    Attack(
        2,
        "lone sender registered not private, rows x 20 and the privacy key in its metadata",
        LONE,
        2,
        lambda _: {t: edit_update(_private_scaled) for t in TRAINING},
        config=tuple(REGISTERED.items()),
    ),
    Attack(
        3,
        "deflated mixtures (means x 1e-4, variances 1e-6)",
        accuracy_tests.SHARED,
        1,
        lambda _: {t: edit_update(accuracy_tests.deflate, UPDATE_RECORDS) for t in STATISTICS},
    ),
    Attack(
        3,
        "a shared class's mixtures moved by three times their norm",
        accuracy_tests.SHARED,
        1,
        lambda _: {t: edit_update(accuracy_tests.moved, UPDATE_RECORDS) for t in STATISTICS},
    ),
    Attack(
        4,
        "its own lone class's H_c moved along another site's class head",
        LONE,
        2,
        lambda folder: {"query.stage2_stats": edit_update(along_a1s_head(folder), UPDATE_RECORDS)},
    ),
    Attack(
        4,
        "the same pulled 0.05 x their norm: its replayed row's cosine under the check's 0.6",
        LONE,
        2,
        lambda folder: {
            "query.stage2_stats": edit_update(along_a1s_head(folder, pull=0.05), UPDATE_RECORDS)
        },
    ),
    Attack(
        5,
        "998 invented classes at the sync",
        accuracy_tests.SHARED,
        1,
        lambda _: {"query.sync": claim_classes(998)},
        against={name: tasks for name, tasks in accuracy_tests.SHARED.items() if name != "farm-m"},
    ),
    Attack(
        5,
        "ten invented classes of another site's class's images (against ten genuine classes)",
        FEW_INVENTED,
        2,
        lambda _: {},
        against=FEW_REAL,
    ),
    Attack(
        5,
        "ten invented classes of another site's class's other images (against ten genuine)",
        FEW_INVENTED,
        2,
        lambda _: {},
        against=FEW_REAL,
        folder=others_images,
    ),
)


@dataclass(frozen=True)
class Run:
    attack: int  # 0: a clean run
    what: str  # the attack's ``what``; "clean"
    seed: int
    steps: list[dict[str, float]]  # each completed step's honest sites' accuracy
    findings: int
    status: str  # of the last step
    wall_s: float
    #: per honest site, the points the last completed step's record says farm-m's new classes
    #: took from its earlier classes (``server.taken``; a site not here: none over the bound)
    taken: dict[str, float] = field(default_factory=dict)


def run(
    sites: dict,
    steps: int,
    seed: int,
    faults: Callable[[Path], dict],
    attack: int,
    what: str,
    test_images: int,
    config: tuple[tuple[str, str], ...] = (),
    folder: Callable[[Path, dict[str, list[str]], int], Path] = site_with_tests,
) -> Run:
    with tempfile.TemporaryDirectory() as temporary:
        tmp = Path(temporary)
        start = time.perf_counter()
        make = functools.partial(folder, test_images=test_images)
        settings = {"max-steps": steps, "seed": seed, **dict(config)}
        try:
            federate(sites, tmp, faults(tmp), folder=make, **settings)
        except Exception as err:  # a rolled-back step: its record says so
            print(f"  run ended: {str(err)[:120]}", flush=True)
        wall = time.perf_counter() - start
        history = Federation.open(tmp / "federation").history()
        accuracy = [
            {site: r.scores.sites[site]["accuracy"] for site in HONEST if site in r.scores.sites}
            for r in history
            if r.status != "failed"
        ]
        found = [f for r in history for f in r.findings if f.site == "farm-m"]
        last = [r for r in history if r.status != "failed"][-1]
        took = {t.site: t.points for t in last.taken if "farm-m" in t.by}
        return Run(attack, what, seed, accuracy, len(found), history[-1].status, wall, took)


# --- the spread: attack 5's ten classes over draws (``--spread``) ----------------------------

#: Spellings of farm-m's ten classes, each another draw of the same federation: a class's name
#: seeds its initial values (``class_init_generator``, shared/model/star_prompt.py). The first
#: two are security.md's draws of attack 5 (the second's aimed copies: farm-b −14.6 points at
#: seed 1995 against ``FEW_REAL``'s names, −8.3 against ten genuine classes of its own names).
SPELLINGS = (
    "invented class {}",
    "invented class {:02d}",
    "new class {}",
    "class {:03d}",
    "extra {}",
    "m class {}",
    "farm-m class {}",
    "class {} of farm-m",
)


class Ten(enum.Enum):
    """What farm-m's ten classes beside X are in a draw."""

    GENUINE = "genuine"  # ``FEW_REAL``'s: classes of images no other site holds
    INVENTED = "invented"  # ``FEW_INVENTED``'s: copies of A1's 12 training images
    OTHERS = "others"  # A1's training images 12-23, which no site trains on (``others_images``)
    DISJOINT = "disjoint"  # a share each of A1's images no site trains on (``disjoint_images``)
    GENUINE_FEW = "genuine-few"  # the genuine ten on ``FEW`` images each (``few_images``)
    NEAR_FEW = "near-few"  # ten genuine classes nearest A1 and B1 (``NEAR``), ``FEW`` images each


#: The ten bundled classes no site of ``LONE`` holds whose G_c lie nearest A1's or B1's — by
#: ``‖μ_c − μ_k‖ / s_k`` (``server.copies``'s distance without the counts) in the default
#: simulation's codebook (tiny preset, 80 images a class), 0.32-0.73: what honest classes
#: alike to the victims' cost, beside the disjoint variant's aimed ones.
NEAR = [
    "Tomato___Leaf_Mold",
    "Tomato___healthy",
    "Tomato___Tomato_mosaic_virus",
    "Tomato___Target_Spot",
    "Tomato___Early_blight",
    "Tomato___Septoria_leaf_spot",
    "Tomato___Late_blight",
    "Pepper,_bell___healthy",
    "Potato___Late_blight",
    "Raspberry___healthy",
]


def ten_classes(ten: Ten, spelling: str) -> dict:
    """``LONE`` with farm-m bringing, beside X in step 2, ten classes spelled ``spelling``."""
    sources = {Ten.GENUINE: OWN, Ten.GENUINE_FEW: OWN, Ten.NEAR_FEW: NEAR}.get(ten, [A1] * 10)
    classes = [f"{source}={spelling.format(i)}" for i, source in enumerate(sources)]
    return {**LONE, "farm-m": {"t1": [C0, M1], "t2": [X, *classes]}}


@dataclass(frozen=True)
class Draw:
    """One run of the spread: its ten classes, their spelling, the run (seed, accuracy, ...)."""

    ten: Ten
    spelling: str
    run: Run

    def after(self) -> dict[str, float]:
        """The honest sites' accuracy after step 2 (the run's last completed step)."""
        return self.run.steps[-1]


@dataclass(frozen=True)
class Spread:
    """A site's accuracy differences, in points, between draws of one seed: ``ten``'s draw
    less the genuine one of its spelling, or for ``Ten.GENUINE`` (the noise) a genuine draw
    less a later spelling's, every pair (whose sign is the spellings' order)."""

    ten: Ten
    site: str
    pairs: int
    mean: float
    low: float  # the mean's 95 % t interval, the pairs taken as independent
    high: float
    #: the same over the seeds' means (the mean of the seeds' mean differences): no
    #: independence assumed between one seed's pairs, which share its first step
    seeds: int
    seeds_low: float
    seeds_high: float
    sd: float
    smallest: float
    largest: float
    #: pairs below -5 points: draws past issue 43's bound, were the pair's genuine draw the
    #: reference
    past_5: int
    #: of them, those whose draw's record says nothing farm-m's classes took from the site
    #: (``server.taken``): past the bound unseen
    unseen: int


def differences(draws: list[Draw], ten: Ten, site: str) -> list[tuple[int, float, bool]]:
    """``Spread``'s pairs, each with its seed and whether the draw's record names what farm-m
    took from ``site``: per seed, ``ten``'s draw less the genuine one of its spelling; for
    ``Ten.GENUINE`` each genuine draw less each later spelling's (recorded: the earlier's)."""
    genuine = {(d.run.seed, d.spelling): d for d in draws if d.ten is Ten.GENUINE}
    if ten is Ten.GENUINE:
        seeds = sorted({seed for seed, _ in genuine})
        order = {spelling: i for i, spelling in enumerate(SPELLINGS)}
        pairs = [
            (genuine[seed, one], genuine[seed, two])
            for seed in seeds
            for one, two in itertools.combinations(
                sorted((s for t, s in genuine if t == seed), key=order.__getitem__), 2
            )
        ]
    else:
        pairs = [
            (d, genuine[d.run.seed, d.spelling])
            for d in draws
            if d.ten is ten and (d.run.seed, d.spelling) in genuine
        ]
    return [
        (d.run.seed, d.after()[site] - less.after()[site], site in d.run.taken) for d, less in pairs
    ]


def interval(values: np.ndarray) -> tuple[float, float]:
    """The 95 % t interval of ``values``' mean (nan for fewer than two)."""
    if len(values) < 2:
        return float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean() - half), float(values.mean() + half)


def spread(draws: list[Draw]) -> list[Spread]:
    """Each kind's and site's ``Spread``, where there are two pairs or more."""
    rows = []
    for ten, site in itertools.product(Ten, HONEST):
        pairs = differences(draws, ten, site)
        if len(pairs) < 2:
            continue
        got = np.array([d for _, d, _ in pairs])
        seeds = sorted({s for s, _, _ in pairs})
        by_seed = np.array([np.mean([d for s, d, _ in pairs if s == seed]) for seed in seeds])
        rows.append(
            Spread(
                ten,
                site,
                len(got),
                float(got.mean()),
                *interval(got),
                len(by_seed),
                *interval(by_seed),
                float(got.std(ddof=1)),
                float(got.min()),
                float(got.max()),
                int((got < -5).sum()),
                sum(d < -5 and not seen for _, d, seen in pairs),
            )
        )
    return rows


def table(rows: list[Spread]) -> str:
    """``rows`` as a markdown table, points after step 2."""
    lines = [
        "| ten classes, less genuine | site | pairs | mean | 95 % interval: pairs | seeds "
        "| sd | range | below −5 | of them unseen |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.ten.value} | {r.site} | {r.pairs} | {r.mean:+.1f} | "
            f"{r.low:+.1f} to {r.high:+.1f} | {r.seeds_low:+.1f} to {r.seeds_high:+.1f} "
            f"({r.seeds}) | {r.sd:.1f} | {r.smallest:+.1f} to {r.largest:+.1f} | {r.past_5} "
            f"| {r.unseen} |"
        )
    return "\n".join(lines)


def read_draws(path: Path) -> list[Draw]:
    """The draws a ``--spread --json`` file holds."""
    return [
        Draw(Ten(d["ten"]), d["spelling"], Run(**d["run"]))
        for d in json.loads(path.read_text())["draws"]
    ]


#: How each kind of ten classes' site folders are made.
FOLDERS = {
    Ten.OTHERS: others_images,
    Ten.DISJOINT: disjoint_images,
    Ten.GENUINE_FEW: few_images,
    Ten.NEAR_FEW: few_images,
}


def measure_spread(
    seeds: list[int], spellings: int, test_images: int, out: Path | None, tens: list[Ten]
) -> None:
    """The spread's draws of ``tens``, spelling by spelling (each spelling over every seed: a
    measurement cut short keeps whole spellings), ``out`` rewritten after each run."""
    draws: list[Draw] = []
    for spelling, seed, ten in itertools.product(SPELLINGS[:spellings], seeds, tens):
        folder = FOLDERS.get(ten, site_with_tests)
        got = run(
            ten_classes(ten, spelling),
            2,
            seed,
            lambda _: {},
            5,
            ten.value,
            test_images,
            folder=folder,
        )
        draws.append(Draw(ten, spelling, got))
        print(
            f"seed {seed} {spelling!r} {ten.value}: {got.steps[-1]} after step {len(got.steps)}, "
            f"{got.findings} findings, {got.status}, {got.wall_s:.0f} s",
            flush=True,
        )
        if out:
            rows = {"draws": draws, "spread": spread(draws)}
            record = {key: [asdict(row) for row in value] for key, value in rows.items()}
            out.write_text(json.dumps(record, indent=1, default=lambda value: value.value))
    print(table(spread(draws)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1993, 1994, 1995])
    parser.add_argument("--attacks", type=int, nargs="+", default=[a.number for a in ATTACKS])
    parser.add_argument("--test-images", type=int, default=48, help="per class and site")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--spread", action="store_true", help="attack 5's ten classes over draws")
    parser.add_argument("--spellings", type=int, default=2, help="draws per seed (--spread)")
    parser.add_argument(
        "--tens",
        nargs="+",
        type=Ten,
        default=list(Ten),
        choices=list(Ten),
        metavar="TEN",
        help=f"the ten classes' kinds (--spread): {', '.join(t.value for t in Ten)}",
    )
    parser.add_argument(
        "--summary", type=Path, nargs="+", help="--spread --json files' table, their draws together"
    )
    args = parser.parse_args()
    if args.summary:
        print(table(spread([d for path in args.summary for d in read_draws(path)])))
        return
    if args.spread:
        measure_spread(args.seeds, args.spellings, args.test_images, args.json, args.tens)
        return
    chosen = [a for a in ATTACKS if a.number in args.attacks]
    runs: list[Run] = []
    for seed in args.seeds:
        clean: dict[tuple, Run] = {}
        for attack in chosen:
            against = attack.against or attack.sites
            scenario = (id(against), attack.steps, attack.config)
            if scenario not in clean:
                clean[scenario] = run(
                    against,
                    attack.steps,
                    seed,
                    lambda _: {},
                    0,
                    "clean",
                    args.test_images,
                    attack.config,
                )
                runs.append(clean[scenario])
            got = run(
                attack.sites,
                attack.steps,
                seed,
                attack.faults,
                attack.number,
                attack.what,
                args.test_images,
                attack.config,
                attack.folder,
            )
            runs.append(got)
            # after as many completed steps (a rolled-back step leaves the one before)
            after = len(got.steps)
            base = clean[scenario].steps[after - 1]
            change = {s: got.steps[-1][s] - base[s] for s in HONEST}
            print(
                f"seed {seed} attack {attack.number} ({attack.what}): clean {base} -> "
                f"{got.steps[-1]} after step "
                f"{after} (change {change}), {got.findings} findings, {got.status}, "
                f"{got.wall_s:.0f} s",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()
