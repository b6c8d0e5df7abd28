"""The installed starfed's version: recorded in model cards and shown by ``starfed --version``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("starfed")
    except PackageNotFoundError:  # running from a source tree without installing
        return "0+unknown"
