"""``python3 -m sdexec.map``: show the unit properties for resource ids."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from sdexec.cliparser import CommandParser, write_stdout_or_exit
from sdexec.idset import IDset
from sdexec.map.loader import DEFAULT_MAPPER, create_mapper
from sdexec.map.mapper import ResourceMapper
from sdexec.map.topology import TopologyXMLError
from sdexec.version import add_version_option

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> int:
    """Print, as JSON, the properties a mapper gives the ids on the command line.

    Exit status 0, or 1 with ``mapper failed: ...`` on stderr when loading,
    building or running the mapper fails (2 for a usage error: an idset
    ``--cores`` or ``--gpus`` cannot be, or neither of them given).
    """
    parser = _parser()
    options = parser.parse_args(args)
    if options.cores is None and options.gpus is None:
        # R would give the rank nothing to fence, which the mapper refuses.
        parser.error("give --cores, --gpus or both")
    try:
        mapper = _mapper(options)
        properties = mapper.map(_R(options))
        output = json.dumps(properties, indent=2)
    except Exception as error:
        # A site's mapper can raise anything: say what, never a traceback.
        print(f"mapper failed: {_describe(error)}", file=sys.stderr)
        return 1
    write_stdout_or_exit(parser.prog, output + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python3 -m sdexec.map",
        description="Show the systemd unit properties a resource mapper gives"
        " the cores and GPUs of one rank.",
    )
    add_version_option(parser)
    parser.add_argument(
        "--cores", metavar="IDSET", type=_idset, help="logical core ids, e.g. 0-3"
    )
    parser.add_argument(
        "--gpus", metavar="IDSET", type=_idset, help="logical GPU ids, e.g. 0-1"
    )
    parser.add_argument(
        "--xml",
        metavar="FILE",
        help="hwloc topology XML (default: this machine's, from lstopo-no-graphics)",
    )
    parser.add_argument(
        "--mapper",
        metavar="CLASS",
        default=DEFAULT_MAPPER,
        help=f"fully-qualified mapper class (default: {DEFAULT_MAPPER})",
    )
    parser.add_argument(
        "--searchpath",
        metavar="DIRS",
        default="",
        help="colon-separated directories searched first for the mapper's module",
    )
    parser.add_argument(
        "--rank", metavar="N", type=_rank, default=0, help="broker rank (default: 0)"
    )
    return parser


def _idset(text: str) -> str:
    """``text``, if it is an idset R's children may hold (checked here, so
    that the error names the flag, not R's field)."""
    try:
        ids = IDset(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not ids:
        # R would give the rank none of them: what leaving it out says.
        raise argparse.ArgumentTypeError("empty: give some ids, or leave it out")
    return text


def _rank(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank (0, 1, 2, ...)")
    return int(text)


def _mapper(options: argparse.Namespace) -> ResourceMapper:
    """The mapper asked for, with ``--xml``'s topology: a file that is not
    hwloc's named as one that cannot be read is."""
    xml = _read_xml(options.xml) if options.xml else None
    try:
        return create_mapper(
            options.mapper,
            options.searchpath,
            options.rank,
            xml,
            searchpath_name="--searchpath",
        )
    except TopologyXMLError as error:
        if options.xml is None:
            raise
        raise ValueError(f"{options.xml}: {error.strerror}") from None


def _read_xml(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not an XML text file (byte {error.start})") from None


def _R(options: argparse.Namespace) -> dict:
    """R version 1 giving ``--rank`` the ``--cores`` and ``--gpus``."""
    children = {
        kind: ids
        for kind, ids in (("core", options.cores), ("gpu", options.gpus))
        if ids is not None
    }
    R_lite = [{"rank": str(options.rank), "children": children}]
    return {"version": 1, "execution": {"R_lite": R_lite}}


def _describe(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        filename = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{filename}"
    if isinstance(error, ValueError):
        return str(error)
    return f"{type(error).__name__}: {error}"
