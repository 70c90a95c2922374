"""The installed package's version, for every command's ``--version``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sdexec.cliparser import write_stdout_or_exit

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["add_version_option", "package_version"]


def package_version() -> str:
    """The version in the installed distribution's metadata (which
    pyproject.toml sets); a checkout that was never installed says so
    rather than guessing."""
    # Imported here: reading the metadata scans sys.path (~10 ms), which
    # every CLI start would pay for a flag it almost never gets.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sdexec")
    except PackageNotFoundError:
        return "unknown (sdexec is not installed: pip install .)"


class _VersionAction(argparse.Action):
    """argparse's ``version`` action, with the version read only when the
    flag is given."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> NoReturn:
        write_stdout_or_exit(parser.prog, f"{parser.prog} {package_version()}\n")
        parser.exit()


def add_version_option(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``PROG VERSION`` and exit 0."""
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="show the program's version number and exit",
    )
