"""The package list, found rather than written: every folder with an ``__init__.py`` under the
top-level folders that pyproject.toml's ``package-dir`` maps into the ``starfed`` namespace,
and the data-only folders its ``package-data`` names.

setuptools' own discovery (``[tool.setuptools.packages.find]``) cannot rename folders (``cli``
→ ``starfed.cli``), and a hand-kept list once left ``starfed.shared.privacy`` out of the wheel;
``tests/test_wheel.py`` installs the built wheel and imports every module.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]

setup(
    packages=sorted(
        {
            package
            for name, folder in SETUPTOOLS["package-dir"].items()
            for package in [name, *(f"{name}.{sub}" for sub in find_packages(ROOT / folder))]
        }
        | set(SETUPTOOLS["package-data"])
    )
)
