"""RFC 22 idsets: sets of non-negative integers written as ``"0-3,7"``.

Input may be wrapped in brackets (``"[0-3]"``), may list ids out of order or
overlapping; output is always canonical: ascending, ranges for runs of two or
more consecutive ids (``"0-1"`` rather than ``"0,1"``, which the encoding
Flux writes by default also uses), no brackets.

A set is kept as its runs of consecutive ids, never id by id: what a client
sends (a rank set in R, say ``"0-4294967293"``) costs memory and time by the
length of its text, not by the number of ids it names.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise

from sdexec.refusal import quoted

__all__ = ["MAX_ID", "IDset"]

#: The largest id, as in Flux (its ``IDSET_INVALID_ID`` is ``UINT_MAX - 1``).
MAX_ID = 2**32 - 3

#: Runs of consecutive ids as inclusive ``(first, last)`` pairs: ascending,
#: disjoint and never adjacent (``(0, 1), (2, 3)`` is ``(0, 3)``).
Runs = tuple[tuple[int, int], ...]


class IDset:
    """An immutable, ordered set of ids (integers from 0 to :data:`MAX_ID`)."""

    __slots__ = ("_runs",)

    def __init__(self, ids: Iterable[int] | str = ()) -> None:
        if isinstance(ids, str):
            self._runs: Runs = _parse(ids)
        elif isinstance(ids, range) and ids.step == 1:
            self._runs = _runs_of_range(ids)
        else:
            self._runs = _runs_of_members(ids)

    @classmethod
    def decode(cls, text: str) -> IDset:
        """Parse an RFC 22 idset string; ``ValueError`` names what is wrong."""
        return cls(text)

    @classmethod
    def union(cls, *sets: IDset) -> IDset:
        """Every id of any of ``sets``, merged in one pass (``a | b | c``
        would merge once per operator)."""
        return cls._of(_merged([run for idset in sets for run in idset._runs]))

    @classmethod
    def _of(cls, runs: Runs) -> IDset:
        idset = cls.__new__(cls)
        idset._runs = runs
        return idset

    def encode(self) -> str:
        """The canonical ranged form, ``""`` for the empty set."""
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self._runs)

    def abbreviated(self, max_runs: int = 8) -> str:
        """:meth:`encode` cut after ``max_runs`` runs, saying how many ids
        there are in all: for a message quoting a client's set, which may
        hold hundreds of thousands of runs (``"0,2,4,..."``)."""
        if len(self._runs) <= max_runs:
            return self.encode()
        shown = IDset._of(self._runs[:max_runs]).encode()
        return f"{shown},... ({len(self)} in all)"

    def at_least(self, first: int) -> IDset:
        """The ids from ``first`` on, in one pass over the runs (a set
        difference sorts every bound of both sets)."""
        runs = tuple((max(lo, first), hi) for lo, hi in self._runs if hi >= first)
        return IDset._of(runs)

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Maximal runs of consecutive ids as inclusive ``(first, last)`` pairs."""
        return iter(self._runs)

    def bitmask(self) -> bytes:
        """The set as systemd's CPU/NUMA mask (D-Bus ``ay``): bit ``i % 8`` of
        byte ``i // 8`` is id ``i``. The empty set is the empty array. The
        mask is as long as the last id says: check it against its bound
        first."""
        if not self._runs:
            return b""
        mask = bytearray(self.last() // 8 + 1)
        for i in self:
            mask[i // 8] |= 1 << (i % 8)
        return bytes(mask)

    @classmethod
    def from_bitmask(cls, mask: bytes) -> IDset:
        """Inverse of :meth:`bitmask`."""
        return cls(
            byte_index * 8 + bit
            for byte_index, byte in enumerate(mask)
            for bit in range(8)
            if byte & (1 << bit)
        )

    def last(self) -> int:
        """The largest id; ``ValueError`` on the empty set."""
        if not self._runs:
            raise ValueError("empty idset has no last id")
        return self._runs[-1][1]

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self._runs:
            yield from range(lo, hi + 1)

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self._runs)

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, int):
            return False
        # The last run starting at or before item is the only one that may
        # hold it.
        index = bisect.bisect_right(self._runs, (item, MAX_ID + 1)) - 1
        return index >= 0 and self._runs[index][1] >= item

    def __bool__(self) -> bool:
        return bool(self._runs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IDset):
            return self._runs == other._runs
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._runs)

    def __or__(self, other: IDset) -> IDset:
        return self._combine(other, lambda mine, theirs: mine or theirs)

    def __and__(self, other: IDset) -> IDset:
        return self._combine(other, lambda mine, theirs: mine and theirs)

    def __sub__(self, other: IDset) -> IDset:
        return self._combine(other, lambda mine, theirs: mine and not theirs)

    def __xor__(self, other: IDset) -> IDset:
        return self._combine(other, lambda mine, theirs: mine != theirs)

    def issubset(self, other: IDset) -> bool:
        """Whether every id of this set is in ``other``."""
        return not self - other

    def __str__(self) -> str:
        return self.encode()

    def __repr__(self) -> str:
        return f"IDset({self.encode()!r})"

    def _combine(self, other: IDset, keep: Callable[[bool, bool], bool]) -> IDset:
        """The ids for which ``keep(in self, in other)`` holds, run by run:
        between two consecutive run boundaries of either set, membership in
        each is the same for every id."""
        mine, theirs = self._runs, other._runs
        bounds = sorted({b for lo, hi in (*mine, *theirs) for b in (lo, hi + 1)})
        kept: list[tuple[int, int]] = []
        i = j = 0
        for start, end in pairwise(bounds):
            while i < len(mine) and mine[i][1] < start:
                i += 1
            while j < len(theirs) and theirs[j][1] < start:
                j += 1
            in_mine = i < len(mine) and mine[i][0] <= start
            in_theirs = j < len(theirs) and theirs[j][0] <= start
            if not keep(in_mine, in_theirs):
                continue
            if kept and kept[-1][1] == start - 1:
                kept[-1] = (kept[-1][0], end - 1)
            else:
                kept.append((start, end - 1))
        return IDset._of(tuple(kept))


def _merged(runs: list[tuple[int, int]]) -> Runs:
    """``runs`` (inclusive pairs, any order, overlapping or not) as
    :data:`Runs`."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if merged and lo <= merged[-1][1] + 1:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _runs_of_range(ids: range) -> Runs:
    if not ids:
        return ()
    _check_member(ids.start)
    _check_member(ids.stop - 1)
    return ((ids.start, ids.stop - 1),)


def _runs_of_members(ids: Iterable[int]) -> Runs:
    members = frozenset(ids)
    for i in members:
        _check_member(i)
    return _merged([(i, i) for i in members])


def _check_member(i: object) -> None:
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= MAX_ID:
        # Quoted cut: a member of thousands of digits has no repr at all.
        raise ValueError(
            f"idset member {quoted(i)} is not an integer from 0 to {MAX_ID}"
        )


def _parse(text: str) -> Runs:
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    if not body:
        return ()
    runs: list[tuple[int, int]] = []
    for part in body.split(","):
        first, sep, last = part.strip().partition("-")
        lo = _parse_id(first, text)
        hi = _parse_id(last, text) if sep else lo
        if hi < lo:
            raise ValueError(
                f"invalid idset {quoted(text)}: range {quoted(part)} is descending"
            )
        runs.append((lo, hi))
    return _merged(runs)


#: Digits in :data:`MAX_ID`: a longer token is refused before it is converted.
_MAX_DIGITS = len(str(MAX_ID))


def _parse_id(token: str, text: str) -> int:
    if not token.isdigit() or not token.isascii():
        raise ValueError(f"invalid idset {quoted(text)}: {quoted(token)} is not an id")
    # Without its leading zeros: Python refuses to convert more than 4300
    # digits, zeros included, in words no request should see.
    digits = token.lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS or int(digits) > MAX_ID:
        raise ValueError(
            f"invalid idset {quoted(text)}: {quoted(token)} is larger than"
            f" the largest id, {MAX_ID}"
        )
    return int(digits)
