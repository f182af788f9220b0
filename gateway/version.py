"""The gateway's version: the installed distribution's (``switchyard``), else ``VERSION`` (a
source checkout run with ``PYTHONPATH``). A test keeps ``VERSION`` equal to pyproject.toml's."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

VERSION = "0.1.0"


def version() -> str:
    try:
        return _distribution_version("switchyard")
    except PackageNotFoundError:
        return VERSION
