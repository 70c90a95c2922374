"""RFC 20 resource sets (R version 1), as much of them as the mapper needs.

R arrives as JSON, for example::

    {"version": 1,
     "execution": {"R_lite": [{"rank": "0-1",
                               "children": {"core": "0-3", "gpu": "0"}}],
                   "nodelist": ["node[0-1]"],
                   "starttime": 0, "expiration": 0}}

Each ``R_lite`` entry gives the same children to every rank in its ``rank``
idset. A :class:`ResourceSet` keeps the children per rank. Anything malformed
is a ``ValueError`` whose message starts with the path to the offending field
(``R: execution.R_lite[0].rank: ...``), so an operator can find it in the job's
R without reading this code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from sdexec.idset import IDset
from sdexec.refusal import quoted

__all__ = ["ResourceSet"]

Children = dict[str, IDset]

#: One ``R_lite`` entry: the ranks it names and the children each of them has.
Entry = tuple[IDset, Children]


class ResourceSet:
    """The execution part of an R version 1 resource set, by rank.

    Accepts R as a JSON string or an already decoded dict. The nodelist is
    not kept: mapping needs no host names, and splitting it by rank would mean
    decoding RFC 29 hostlists. Ranks are kept as the entries' idsets, never
    rank by rank, so a huge rank range costs no more than its text.
    """

    def __init__(self, R: str | Mapping[str, Any]) -> None:
        execution = _field(_decode(R), "execution", Mapping, "")
        self._entries = _entries(_field(execution, "R_lite", list, "execution"))
        self.starttime: float | None = _optional_number(execution, "starttime")
        self.expiration: float | None = _optional_number(execution, "expiration")

    @classmethod
    def _from_entries(
        cls,
        entries: list[Entry],
        starttime: float | None,
        expiration: float | None,
    ) -> ResourceSet:
        rset = cls.__new__(cls)
        rset._entries = entries
        rset.starttime = starttime
        rset.expiration = expiration
        return rset

    @property
    def ranks(self) -> IDset:
        """The broker ranks that hold resources in this set."""
        return IDset.union(*(ranks for ranks, _children in self._entries))

    def children(self, rank: int) -> Children:
        """Resource type (``"core"``, ``"gpu"``, ...) to ids on ``rank``.

        A rank outside the set has no children: the result is empty.
        """
        for ranks, children in self._entries:
            if rank in ranks:
                return dict(children)
        return {}

    def copy_ranks(self, ranks: str | IDset | int) -> ResourceSet:
        """A new set holding only ``ranks`` (an idset string, IDset or rank).

        Ranks not in this set are ignored, as in Flux's ``copy_ranks``.
        """
        wanted = IDset([ranks]) if isinstance(ranks, int) else IDset(ranks)
        kept = [
            (entry_ranks & wanted, children) for entry_ranks, children in self._entries
        ]
        return self._from_entries(
            [(entry_ranks, children) for entry_ranks, children in kept if entry_ranks],
            self.starttime,
            self.expiration,
        )

    def count(self, kind: str) -> int:
        """How many resources of type ``kind`` the set holds over all its ranks."""
        return sum(
            len(ranks) * len(children.get(kind, ()))
            for ranks, children in self._entries
        )

    @property
    def ncores(self) -> int:
        """Cores over all ranks."""
        return self.count("core")

    @property
    def ngpus(self) -> int:
        """GPUs over all ranks."""
        return self.count("gpu")

    def __contains__(self, rank: object) -> bool:
        return any(rank in ranks for ranks, _children in self._entries)

    def __repr__(self) -> str:
        return f"ResourceSet(ranks={self.ranks.encode()!r})"


def _decode(R: str | Mapping[str, Any]) -> Mapping[str, Any]:
    data: Any = R
    if isinstance(R, str):
        try:
            data = json.loads(
                R, parse_constant=_refuse_constant, parse_int=_bounded_int
            )
        except ValueError as error:  # JSONDecodeError, and the constants
            raise ValueError(f"R: not valid JSON: {error}") from None
        except RecursionError:
            raise ValueError("R: not valid JSON: nested too deeply") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"R: expected a JSON object, got {_json_type(data)}")
    version = data.get("version")
    # An integer: true and 1.0 equal 1 in Python, not in RFC 20 (Flux
    # unpacks it as an integer, refusing both).
    if type(version) is not int or version != 1:
        json_only = isinstance(version, bool | float)
        shown = json.dumps(version) if json_only else repr(version)
        raise ValueError(f"R: version: expected 1, got {shown}")
    return data


def _entries(R_lite: list[Any]) -> list[Entry]:
    entries: list[Entry] = []
    for index, entry in enumerate(R_lite):
        where = f"execution.R_lite[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"R: {where}: expected an object, got {_json_type(entry)}")
        ranks = _idset_field(entry, "rank", where)
        children = _children(_field(entry, "children", Mapping, where), where)
        entries.append((ranks, children))
    _refuse_repeated_ranks(entries)
    return entries


def _refuse_repeated_ranks(entries: list[Entry]) -> None:
    """``ValueError`` for a rank in two entries, naming both. One sweep over
    every entry's runs in order: a run that starts before the furthest end
    seen so far overlaps the run that reached it."""
    runs = sorted(
        (lo, hi, index)
        for index, (ranks, _children) in enumerate(entries)
        for lo, hi in ranks.ranges()
    )
    reach, reached_by = -1, -1
    for lo, hi, index in runs:
        if lo <= reach:
            later, earlier = max(index, reached_by), min(index, reached_by)
            raise ValueError(
                f"R: execution.R_lite[{later}].rank: rank {lo} is already in"
                f" execution.R_lite[{earlier}]"
            )
        if hi > reach:
            reach, reached_by = hi, index


def _children(children: Mapping[str, Any], where: str) -> Children:
    return {
        kind: _idset_field(children, kind, f"{where}.children") for kind in children
    }


def _idset_field(obj: Mapping[str, Any], name: str, where: str) -> IDset:
    text = _field(obj, name, str, where)
    try:
        return IDset(text)
    except ValueError as error:
        raise ValueError(f"R: {where}.{name}: {error}") from None


def _optional_number(execution: Mapping[str, Any], name: str) -> float | None:
    value = execution.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"R: execution.{name}: expected a number, got {_json_type(value)}"
        )
    try:
        number = float(value)
    except OverflowError:  # an int of hundreds of digits
        number = math.inf
    if not abs(number) < _MAX_TIME:  # NaN and infinities too
        # Times are reactor seconds: beyond a float they would fail every
        # later sum (the timer, each stats request) instead of this one.
        raise ValueError(f"R: execution.{name}: {quoted(value)} is out of range")
    return value


#: Times in R are epoch seconds; this bound keeps every sum and difference
#: of two of them (a duration, a start delay added) a finite float.
_MAX_TIME = float(2**62)


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are not JSON (Flux's jansson refuses them too).
    raise ValueError(f"{name} is not JSON")


#: Digits an integer in R may have: its times and counts need far fewer.
_MAX_DIGITS = 30


def _bounded_int(text: str) -> int:
    # Refused before int(), whose own refusal (past 4300 digits) advises
    # changing Python's settings.
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


# What _field() says it expected, by the type it checks for.
_EXPECTED: dict[type, str] = {Mapping: "an object", list: "an array", str: "a string"}


def _field(obj: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    path = f"{where}.{name}" if where else name
    if name not in obj:
        raise ValueError(f"R: {path}: missing")
    value = obj[name]
    if not isinstance(value, kind):
        raise ValueError(
            f"R: {path}: expected {_EXPECTED[kind]}, got {_json_type(value)}"
        )
    return value


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return f"a {type(value).__name__}"
