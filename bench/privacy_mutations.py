"""Mutation check of the privacy tests: every one-line break of a private site's release must
make them fail.

A test that passes whatever the release does proves nothing (issue 44: five such breaks once
passed every privacy test). Each ``MUTANT`` changes one line of the code — an exact text, found
exactly once — in a copy of the checkout (the files git tracks or would track, in a temporary
folder; the working tree is never touched). The privacy tests then run in that copy, with
``starfed`` mapped onto it by a folder of links (pyproject.toml's ``package-dir``, as ``make
typecheck`` does), and the mutant is *caught* when at least one of them fails. The unchanged
copy runs first and must pass, so a failure is the break's, not the copy's.

    python bench/privacy_mutations.py                 # every mutant, a table; exit 1 if one lives
    python bench/privacy_mutations.py --only cap --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The tests each mutant must fail (the slow ones, two fresh interpreters, add nothing here).
TESTS = ["tests/test_privacy_sensitivity.py", "tests/test_privacy.py"]
SELECTION = "privacy and not slow"


@dataclass(frozen=True)
class Mutant:
    """One line of ``path`` changed from ``before`` to ``after``: a break of the release."""

    name: str
    what: str
    path: str
    before: str
    after: str


MUTANTS = [
    Mutant(
        "all-classes",
        "a class's statistics built from every class's features",
        "client/privacy.py",
        "name, own = names[i], features[labels == row]",
        "name, own = names[i], features",
    ),
    Mutant(
        "unclipped",
        "the release summing unclipped features",
        "shared/privacy/mechanisms.py",
        "return offset * torch.clamp(radius / norms.clamp_min(1e-12), max=1.0)",
        "return offset",
    ),
    Mutant(
        "count-k",
        "the patient count noise without × k",
        "client/privacy.py",
        "released = noisy_count(count, z, self.rng, self.setting.group)",
        "released = noisy_count(count, z, self.rng)",
    ),
    Mutant(
        "moments-k",
        "the patient statistics noise without × k",
        "client/privacy.py",
        "private_gaussian(own, centre, radius, count, z, self.rng, group)",
        "private_gaussian(own, centre, radius, count, z, self.rng)",
    ),
    Mutant(
        "cap",
        "the patient cap removed",
        "client/privacy.py",
        "elif used[unit] < self.setting.group:",
        "else:",
    ),
    Mutant(
        "gradient-unclipped",
        "a DP-SGD step summing its units' gradients unclipped",
        "shared/privacy/mechanisms.py",
        "scale = torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)",
        "scale = torch.ones_like(norms)",
    ),
    Mutant(
        "gradient-noise-clip",
        "a DP-SGD step's noise z, not z × its clip",
        "shared/model/training.py",
        "std = dp.noise_multiplier * dp.clip",
        "std = dp.noise_multiplier",
    ),
    Mutant(
        "gradient-per-image",
        "a patient's images clipped one by one in DP-SGD, not as one unit",
        "client/privacy.py",
        "units = [index.setdefault(training_patient(p), len(index)) for p in paths]",
        "units = list(range(len(paths)))",
    ),
    Mutant(
        "gradient-shared-views",
        "stage 2's DP-SGD views augmented from one stream, not per image",
        "shared/model/training.py",
        "return augment_each(images[batch], on.private.seed())  # a step's: each image's own",
        "return augment(images[batch], generator)",
    ),
    Mutant(
        "steps-unrecorded",
        "a training release charged as one Gaussian, not its DP-SGD steps",
        "client/privacy.py",
        'if not self._record(names, Release(z, sampling), f"the {phase.key} update"):',
        'if not self._record(names, Release(z), f"the {phase.key} update"):',
    ),
    Mutant(
        "sensitivity",
        "the moments' sensitivity taken as 1, not √2",
        "shared/privacy/mechanisms.py",
        "MOMENTS_SENSITIVITY = math.sqrt(2.0)",
        "MOMENTS_SENSITIVITY = 1.0",
    ),
    Mutant(
        "unrecorded",
        "a release not recorded in the ledger",
        "client/memory.py",
        "self.releases.setdefault(key, []).append(release)",
        "pass",
    ),
    Mutant(
        "every-class",
        "an image or patient used in every class it is in (one budget key each)",
        "client/privacy.py",
        "if ledger.units.setdefault(unit, key) != key:",
        "if False:",
    ),
    Mutant(
        "site-wide-ignored",
        "an old ledger's site-wide releases left out of each class's budget",
        "client/memory.py",
        "return [*self.releases.get(SITE_WIDE, []), *self.releases.get(key, [])]",
        "return self.releases.get(key, [])",
    ),
    Mutant(
        "no-threshold",
        "every class announced, whatever its noisy count",
        "client/privacy.py",
        "if released < self.setting.threshold(z):",
        "if False:",
    ),
    Mutant(
        "threshold-delta",
        "the announcing threshold calibrated to all of δ, not its half",
        "client/privacy.py",
        "tail = NormalDist().inv_cdf(1 - self.selection_delta)",
        "tail = NormalDist().inv_cdf(1 - self.delta)",
    ),
    Mutant(
        "release-delta",
        "the releases planned at all of δ, leaving none to announcing",
        "client/privacy.py",
        "ledger.past(key), left, self.setting.epsilon, self.setting.release_delta",
        "ledger.past(key), left, self.setting.epsilon, self.setting.delta",
    ),
    Mutant(
        "record-unchecked",
        "a release recorded although the ledger changed since it was planned",
        "client/privacy.py",
        "if any(len(ledger.past(key)) != self._planned.get(key) for key in keys):",
        "if False:",
    ),
    Mutant(
        "shared-stream",
        "H_c's views augmented from one stream, not per image",
        "client/site.py",
        "per_image = fit is not None  # a private site's fit: views augmented per image",
        "per_image = False",
    ),
]


@dataclass(frozen=True)
class Outcome:
    """What the privacy tests did with one mutant."""

    name: str
    what: str
    caught: bool
    failed: list[str]  # the tests that failed (or erred)
    seconds: float


def copy_checkout(target: Path) -> Path:
    """The files git tracks or would track, copied under ``target``; with a folder of links
    that maps them into the ``starfed`` namespace. Returns the folder to put on the path."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    tree = target / "tree"
    for name in filter(None, listed.split("\0")):
        source, copy = ROOT / name, tree / name
        if source.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(source.read_bytes())
    links = target / "path" / "starfed"
    links.mkdir(parents=True)
    setuptools = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in setuptools["package-dir"].items():
        (links / package.removeprefix("starfed.")).symlink_to(tree / folder)
    return tree


def mutate(tree: Path, mutant: Mutant) -> str:
    """Apply ``mutant`` to the copy; returns the original text of its file."""
    path = tree / mutant.path
    text = path.read_text()
    found = text.count(mutant.before)
    if found != 1:
        raise SystemExit(f"{mutant.name}: {mutant.path} holds its line {found} times, not once")
    path.write_text(text.replace(mutant.before, mutant.after))
    return text


def run_tests(tree: Path) -> tuple[int, list[str], str]:
    """The privacy tests in the copy: exit status, the tests that failed, the output's tail."""
    env = {**os.environ, "PYTHONPATH": str(tree.parent / "path"), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    result = subprocess.run(
        [*command, "-m", SELECTION, *TESTS], cwd=tree, env=env, capture_output=True, text=True
    )
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, flags=re.MULTILINE)
    return result.returncode, failed, result.stdout[-3000:] + result.stderr[-2000:]


def check_imports(tree: Path) -> None:
    """The copy, not the checkout, is what the tests import."""
    env = {**os.environ, "PYTHONPATH": str(tree.parent / "path")}
    code = "import starfed.client.privacy as m; print(m.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, check=True, capture_output=True, text=True
    )
    if not Path(out.stdout.strip()).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the copy is not what is imported: {out.stdout.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[m.name for m in MUTANTS])
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="privacy-mutations-") as folder:
        tree = copy_checkout(Path(folder))
        check_imports(tree)
        start = time.monotonic()
        status, failed, tail = run_tests(tree)
        if status != 0:
            raise SystemExit(f"the unchanged copy fails its privacy tests {failed}:\n{tail}")
        print(f"unchanged: passes ({time.monotonic() - start:.0f} s)", file=sys.stderr)
        for mutant in mutants:
            original = mutate(tree, mutant)
            start = time.monotonic()
            status, failed, _ = run_tests(tree)
            (tree / mutant.path).write_text(original)
            outcome = Outcome(
                mutant.name, mutant.what, status != 0, failed, round(time.monotonic() - start, 1)
            )
            outcomes.append(outcome)
            print(_line(outcome), file=sys.stderr, flush=True)
    if args.json:
        json.dump([asdict(o) for o in outcomes], sys.stdout, indent=2)
        print()
    else:
        print("| mutant | the break | caught by | s |\n|---|---|---|---|")
        for o in outcomes:
            caught = "<br>".join(f.split("::")[-1] for f in o.failed) or "**not caught**"
            print(f"| `{o.name}` | {o.what} | {caught} | {o.seconds:.0f} |")
    return 0 if all(o.caught for o in outcomes) else 1


def _line(outcome: Outcome) -> str:
    verdict = f"caught by {len(outcome.failed)} tests" if outcome.caught else "NOT CAUGHT"
    return f"{outcome.name}: {verdict} ({outcome.seconds:.0f} s)"


if __name__ == "__main__":
    raise SystemExit(main())
