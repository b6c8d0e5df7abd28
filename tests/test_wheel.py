"""The wheel is what a site installs, so the wheel is what this tests: built from the checkout's
package folders, installed (not editable) into a clean virtual environment, and run from a folder
outside the checkout — every module imported, a simulation, ``starfed site check``.

The clean environment gets the wheel with ``--no-deps``; the dependencies already installed for
the tests are made visible through a ``.pth`` line appended after its own site-packages, so a
module or data file missing from the wheel still fails (each imported module must come from the
clean environment). A real install of the dependencies would need the network (torch alone is
≈ 1 GB; no test may download), so instead ``pip check`` in the clean environment proves the
wheel's declared requirements are met by installed versions, and
``test_every_third_party_import_is_declared`` proves they cover every import.
Cost: ≈ 42 s of CPU time (docs/benchmarks.md, "The wheel test and the failing-site tests").
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")  # what the build reads
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def package_files() -> dict[str, Path]:
    """Every file of the package folders, by its path inside the wheel (``starfed/…``)."""
    files = {}
    for name, folder in PACKAGE_DIR.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                inside = path.relative_to(REPO / folder).as_posix()
                files[f"{name.replace('.', '/')}/{inside}"] = path
    return files


def third_party_imports() -> dict[str, bool]:
    """Top-level names of third-party imports in the package modules → whether any is made at
    module level (needed to import the module) rather than inside a function."""
    found: dict[str, bool] = {}
    for inside, path in package_files().items():
        if not inside.endswith(".py"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        in_function = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - {"starfed", *sys.stdlib_module_names}:
                found[top] = found.get(top, False) or id(node) not in in_function
    return found


def declared(extras: bool) -> set[str]:
    """Distribution names pyproject.toml declares (with ``extras``: the optional ones too)."""
    requirements = list(PYPROJECT["project"]["dependencies"])
    if extras:
        for group in PYPROJECT["project"]["optional-dependencies"].values():
            requirements += group
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_every_third_party_import_is_declared():
    """A module-level import needs a declared dependency; one inside a function (a tool such as
    proto/generate.py's grpc_tools) may come from an extra. Flower brings most of them today,
    which is no promise it will tomorrow."""
    providers = packages_distributions()
    core, any_extra = declared(extras=False), declared(extras=True)
    missing = []
    for top, module_level in sorted(third_party_imports().items()):
        dists = {canonicalize_name(d) for d in providers.get(top, [])}
        if not dists:
            missing.append(f"{top} (no installed distribution provides it)")
        elif not dists & (core if module_level else any_extra):
            missing.append(f"{top} (from {', '.join(sorted(dists))})")
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built offline (no build isolation: the test environment's setuptools) from a
    copy of the files the build reads, so the checkout gets no build/ or egg-info."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).exists():
            shutil.copy2(REPO / name, source / name)
    skip = shutil.ignore_patterns("__pycache__")
    for folder in PACKAGE_DIR.values():
        shutil.copytree(REPO / folder, source / folder, ignore=skip)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = run([*pip, "--quiet", "--wheel-dir", str(root / "dist"), str(source)], cwd=root)
    # a data folder that is no declared package: setuptools warns at every install (issue 47)
    assert "absent from" not in done.stdout + done.stderr, done.stderr[-2000:]
    (built,) = (root / "dist").glob("starfed-*.whl")
    return built


def test_wheel_holds_every_file_of_the_package_folders(wheel: Path):
    """Modules, generated stubs and data (the bundled images, the grids, the .proto files)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(set(package_files()) - names)
    assert not missing, f"{len(missing)} files missing from the wheel, first: {missing[:5]}"


@pytest.mark.e2e
def test_installed_wheel_imports_simulates_and_checks_a_site(wheel: Path, tmp_path: Path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    python = venv_with(wheel, venv)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= FLOWER_ENV | {"FLWR_HOME": str(tmp_path / "flwr-home")}

    # every module imported in one process, while the commands run (CI has 2 cores)
    importing = subprocess.Popen(
        [python, "-c", IMPORT_EVERY_MODULE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=work,
        env=env,
    )
    try:
        simulate_and_check(str(venv / "bin" / "starfed"), work, env)
        out, err = importing.communicate(timeout=300)
    finally:
        importing.kill()  # only if a command failed first: it has ended otherwise
        importing.wait()
    assert importing.returncode == 0, err[-3000:]
    imported = json.loads(out)
    modules = [p for p in package_files() if p.endswith(".py") and not p.endswith("__main__.py")]
    assert imported["modules"] == len(modules)
    assert imported["outside"] == [], "modules imported from outside the clean environment"

    # the declared requirements are met by installed versions (pip reads the clean environment)
    pip_check = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "check"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
    )
    assert [line for line in pip_check.stdout.splitlines() if line.startswith("starfed ")] == []


def simulate_and_check(starfed: str, work: Path, env: dict[str, str]) -> None:
    """The quick start's scenario, made small (2 classes, 1 epoch: the command is what is
    tested), then ``site check`` on one of its sites against its codebook."""
    simulate = [starfed, "simulate", "--runtime", "local", "--tasks", "1", "--sites", "2"]
    simulate += ["--classes-per-task", "2", "--epochs", "1", "--run-config", "batch-size=16"]
    done = run([*simulate, "--results-dir", "results", "--run-name", "wheel"], cwd=work, env=env)
    assert "completed · 1 step" in done.stdout
    site = work / "results" / "wheel" / "sites" / "site-0"
    check = [starfed, "site", "check", "--data", str(site / "data"), "--state", "new-state"]
    check += ["--codebook", str(work / "results" / "wheel" / "codebook.bin"), "--json"]
    report = json.loads(run(check, cwd=work, env=env).stdout)
    assert report["ready"], report["findings"]
    assert report["fingerprint"] == report["federation_fingerprint"]


def venv_with(wheel: Path, venv: Path) -> str:
    """A virtual environment holding only the wheel; this environment's site-packages follow
    its own on sys.path (a ``.pth`` line: its .pth files, the editable install's finder
    among them, are not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index"]
    run([*pip, "--quiet", str(wheel)], cwd=venv)
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    ours = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    (Path(purelib.stdout.strip()) / "test-dependencies.pth").write_text("\n".join(ours) + "\n")
    return python


IMPORT_EVERY_MODULE = """
import importlib, json, sys
from importlib.metadata import files
prefix = sys.prefix
names = sorted(
    str(f.with_suffix("")).replace("/", ".")
    for f in files("starfed")
    if f.suffix == ".py" and f.name != "__main__.py"
)
outside = []
for name in names:
    module = importlib.import_module(name.removesuffix(".__init__"))
    if not module.__file__.startswith(prefix):
        outside.append(f"{name}: {module.__file__}")
outside += [p for p in importlib.import_module("starfed").__path__ if not p.startswith(prefix)]
print(json.dumps({"modules": len(names), "outside": outside}))
"""


def run(command: list[str], cwd: Path | None = None, env: dict | None = None):
    """Run to completion; a failure shows the command's own output."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert done.returncode == 0, f"{command[:3]} exit {done.returncode}:\n{done.stderr[-3000:]}"
    return done
