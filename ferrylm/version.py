"""The installed package's version, as /version answers it (serve and gateway)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("ferrylm")
    except PackageNotFoundError:  # run from a source tree without an install
        return "0.0.0+unknown"
