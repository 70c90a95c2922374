"""``python3 -m sdexec.map``: show the unit properties for resource ids."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from sdexec.cliparser import CommandParser, say_led, write_stdout_or_exit
from sdexec.config import Config, default_config, load_config_quietly
from sdexec.idset import MAX_ID, IDset
from sdexec.map.loader import DEFAULT_MAPPER, create_mapper
from sdexec.map.mapper import ResourceMapper
from sdexec.map.topology import TopologyXMLError
from sdexec.rset import ResourceSet
from sdexec.version import add_version_option

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> int:
    """Print, as JSON, the properties a mapper gives the ids on the command
    line, as the service's containment would give them to a job.

    Exit status 0, or 1 with ``mapper failed: ...`` on stderr when loading,
    building or running the mapper fails, or with the file's error when
    ``--config`` or the topology file cannot be read (2 for a usage error:
    an idset ``--cores`` or ``--gpus`` cannot be, or neither of them
    given). Every line on stderr begins with the program's name, as
    argparse's usage errors do.
    """
    parser = _parser()
    options = parser.parse_args(args)
    if options.cores is None and options.gpus is None:
        # R would give the rank nothing to fence, which the mapper refuses.
        parser.error("give --cores, --gpus or both")
    try:
        config = _config(options.config)
    except ValueError as error:  # ConfigError, told as sdexec.config tells it
        say_led(parser.prog, str(error))
        return 1
    for warning in config.warnings:
        say_led(parser.prog, f"warning: {warning}")
    try:
        properties = _properties(options, config)
    except _UnreadableTopology as error:  # the mapper never ran
        say_led(parser.prog, str(error))
        return 1
    except Exception as error:
        # A site's mapper can raise anything: say what, never a traceback.
        say_led(parser.prog, f"mapper failed: {_describe(error)}")
        return 1
    write_stdout_or_exit(parser.prog, json.dumps(properties, indent=2) + "\n")
    return 0


def _config(path: str | None) -> Config:
    """The configuration ``--config`` names, else the defaults; a warning
    if it leaves containment off, when the service maps nothing."""
    if path is None:
        return default_config()
    config = load_config_quietly(path)
    if config.exec.sdexec_constrain_resources:
        return config
    off = (
        f"{config.source}: exec.sdexec-constrain-resources is false:"
        " the service maps no job's R"
    )
    return replace(config, warnings=(*config.warnings, off))


def _properties(options: argparse.Namespace, config: Config) -> dict[str, str]:
    """What the service's containment gives R: the same mapping call, with
    the site's ``[exec.sdexec-properties]`` (so its memory caps are scaled
    as a job's are), the same refusals and string values."""
    # Imported here: sdexec.containment builds on sdexec.map, this package.
    from sdexec.containment import MapperError, map_resources

    given = _given(options, config)
    mapper = _mapper(given)
    R = ResourceSet(_R(given))
    try:
        return map_resources(mapper, R, config.exec.sdexec_properties, given.mapper)
    except MapperError as error:
        # Its words without the class: the command line named it.
        raise ValueError(error.reason) from error


def _given(options: argparse.Namespace, config: Config) -> argparse.Namespace:
    """``options``, with the mapper, searchpath, rank and topology the flags
    leave out taken from ``config`` (the service's defaults without one):
    a flag wins over the file."""
    sdexec = config.sdexec
    from_file = {
        "mapper": sdexec.mapper,
        "searchpath": sdexec.mapper_searchpath,
        "rank": sdexec.rank,
        "xml": sdexec.topology,
    }
    flags = vars(options)
    # Named in errors as the user wrote it: the flag, or the file's key.
    from_flag = flags["searchpath"] is not None
    searchpath_name = "--searchpath" if from_flag else "mapper-searchpath"
    chosen = {
        name: from_file[name] if flags[name] is None else flags[name]
        for name in from_file
    }
    return argparse.Namespace(**flags | chosen, searchpath_name=searchpath_name)


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
        "--config",
        metavar="FILE",
        help="a .toml, .json, .yaml or .yml configuration file, or a directory of"
        " .toml files (Flux's conf.d), read as the service reads it: its [sdexec]"
        " mapper, mapper-searchpath, rank and topology,"
        " and its [exec.sdexec-properties] (memory caps scaled as a job's),"
        " are used; --xml, --mapper, --searchpath and --rank win over the file",
    )
    parser.add_argument(
        "--xml",
        metavar="FILE",
        help="hwloc topology XML (default: the file's topology, else this"
        " machine's, from lstopo-no-graphics)",
    )
    parser.add_argument(
        "--mapper",
        metavar="CLASS",
        help="fully-qualified mapper class (default: the file's, else"
        f" {DEFAULT_MAPPER})",
    )
    parser.add_argument(
        "--searchpath",
        metavar="DIRS",
        help="colon-separated directories searched first for the mapper's module"
        " (default: the file's mapper-searchpath)",
    )
    parser.add_argument(
        "--rank",
        metavar="N",
        type=_rank,
        help="broker rank (default: the file's, else 0)",
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
    """A rank R can name, bounded as ``[sdexec] rank`` is (a larger one
    was told as R's fault: ``mapper failed: R: execution.R_lite[0].rank``)."""
    if not text.isascii() or not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank (0, 1, 2, ...)")
    digits = text.lstrip("0") or "0"  # int() refuses thousands of digits
    if len(digits) > len(str(MAX_ID)) or int(digits) > MAX_ID:
        raise argparse.ArgumentTypeError(f"{text} is beyond the largest rank, {MAX_ID}")
    return int(digits)


def _mapper(given: argparse.Namespace) -> ResourceMapper:
    """The mapper asked for, with the topology file given: a file that is
    not hwloc's named as one that cannot be read is."""
    xml = _read_xml(given.xml) if given.xml else None
    try:
        return create_mapper(
            given.mapper,
            given.searchpath,
            given.rank,
            xml,
            searchpath_name=given.searchpath_name,
        )
    except TopologyXMLError as error:
        if given.xml is None:
            raise
        raise _UnreadableTopology(given.xml, str(error.strerror)) from None


class _UnreadableTopology(ValueError):
    """The topology file cannot be read, or is not hwloc's: no mapper ran.
    Named as what it is, path first, as the service names it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"topology file {path}: {why}")


def _read_xml(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        why = f"not an XML text file (byte {error.start})"
        raise _UnreadableTopology(path, why) from None
    except OSError as error:
        raise _UnreadableTopology(path, error.strerror or str(error)) from None


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
