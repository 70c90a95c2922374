"""The installed package's version, for every command's ``--version``."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

__all__ = ["add_version_option", "package_version"]


def package_version() -> str:
    """The version in the installed distribution's metadata (which
    pyproject.toml sets); a checkout that was never installed says so
    rather than guessing."""
    try:
        return version("sdexec")
    except PackageNotFoundError:
        return "unknown (sdexec is not installed: pip install .)"


def add_version_option(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``PROG VERSION`` and exit 0."""
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {package_version()}"
    )
