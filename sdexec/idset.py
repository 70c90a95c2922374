"""RFC 22 idsets: sets of non-negative integers written as ``"0-3,7"``.

Input may be wrapped in brackets (``"[0-3]"``), may list ids out of order or
overlapping; output is always canonical: ascending, ranges for runs of two or
more consecutive ids (``"0-1"`` rather than ``"0,1"``, which the encoding
Flux writes by default also uses), no brackets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["IDset"]


class IDset:
    """An immutable, ordered set of non-negative integer ids."""

    __slots__ = ("_ids",)

    def __init__(self, ids: Iterable[int] | str = ()) -> None:
        if isinstance(ids, str):
            self._ids: frozenset[int] = _parse(ids)
            return
        ids = frozenset(ids)
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"idset member {i!r} is not a non-negative integer")
        self._ids = ids

    @classmethod
    def decode(cls, text: str) -> IDset:
        """Parse an RFC 22 idset string; ``ValueError`` names what is wrong."""
        return cls(text)

    def encode(self) -> str:
        """The canonical ranged form, ``""`` for the empty set."""
        return ",".join(
            str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges()
        )

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Maximal runs of consecutive ids as inclusive ``(first, last)`` pairs."""
        ids = sorted(self._ids)
        if not ids:
            return
        run_start = prev = ids[0]
        for i in ids[1:]:
            if i != prev + 1:
                yield run_start, prev
                run_start = i
            prev = i
        yield run_start, prev

    def bitmask(self) -> bytes:
        """The set as systemd's CPU/NUMA mask (D-Bus ``ay``): bit ``i % 8`` of
        byte ``i // 8`` is id ``i``. The empty set is the empty array."""
        if not self._ids:
            return b""
        mask = bytearray(max(self._ids) // 8 + 1)
        for i in self._ids:
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

    def first(self) -> int:
        """The smallest id; ``ValueError`` on the empty set."""
        if not self._ids:
            raise ValueError("empty idset has no first id")
        return min(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._ids))

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IDset):
            return self._ids == other._ids
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._ids)

    def __or__(self, other: IDset) -> IDset:
        return IDset(self._ids | other._ids)

    def __and__(self, other: IDset) -> IDset:
        return IDset(self._ids & other._ids)

    def __sub__(self, other: IDset) -> IDset:
        return IDset(self._ids - other._ids)

    def __xor__(self, other: IDset) -> IDset:
        return IDset(self._ids ^ other._ids)

    def issubset(self, other: IDset) -> bool:
        return self._ids <= other._ids

    def __str__(self) -> str:
        return self.encode()

    def __repr__(self) -> str:
        return f"IDset({self.encode()!r})"


def _parse(text: str) -> frozenset[int]:
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    if not body:
        return frozenset()
    ids: set[int] = set()
    for part in body.split(","):
        first, sep, last = part.strip().partition("-")
        lo = _parse_id(first, text)
        hi = _parse_id(last, text) if sep else lo
        if hi < lo:
            raise ValueError(f"invalid idset {text!r}: range {part!r} is descending")
        ids.update(range(lo, hi + 1))
    return frozenset(ids)


def _parse_id(token: str, text: str) -> int:
    if not token.isdigit() or not token.isascii():
        raise ValueError(f"invalid idset {text!r}: {token!r} is not an id")
    return int(token)
