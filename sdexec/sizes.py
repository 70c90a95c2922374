"""Memory limit values as systemd writes them: ``512M``, ``95%``, ``infinity``.

One parser serves the configuration checks, the D-Bus property typing and the
mapper's memory scaling, so they cannot disagree about what a size means.
Suffixes are base 1024 (``K``, ``M``, ``G``, ``T``, ``P``, ``E``, in either
case, as Flux's mapper takes them; ``1.5G`` is allowed), a bare number is
bytes. A size must fit systemd's 64 bits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

__all__ = [
    "SUFFIXES",
    "UINT64_MAX",
    "MemoryLimit",
    "SizeTooLarge",
    "bounded_size",
    "parse_size",
]

_SUFFIX = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
#: The suffixes a size may have, as error messages name them.
SUFFIXES = "K, M, G, T, P or E"
# ASCII digits only, as systemd's parse_size and sdexec's integers read them.
_SIZE = re.compile(
    r"(?P<number>\d+(?:\.\d+)?)\s*(?P<suffix>[KMGTPE]?)", re.IGNORECASE | re.ASCII
)
# systemd keeps sizes in 64 bits.
UINT64_MAX = 2**64 - 1
_PERCENT = re.compile(r"(?P<number>\d+(?:\.\d+)?)%", re.ASCII)
#: Digits a size's number may have before and after its point. Every size
#: below 16E has at most 20 before it; refusing longer numbers first keeps a
#: request of a million digits from costing seconds of arithmetic.
_MAX_DIGITS = 20


class SizeTooLarge(ValueError):
    """A size of 16E or more: well formed, but past what 64 bits hold, so
    that a message can say it is too large rather than not a size."""


def parse_size(text: str, base: int = 1024) -> int:
    """Bytes in a size such as ``4096``, ``512M``, ``4g`` or ``1.5G``; its
    suffixes are powers of ``base`` (systemd's I/O limits take 1000).

    ``ValueError`` if the text is not such a size; :class:`SizeTooLarge` if
    it is 16E or more.
    """
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a size (a number with {SUFFIXES})")
    whole, _point, fraction = match["number"].partition(".")
    if len(whole.lstrip("0")) > _MAX_DIGITS:
        raise SizeTooLarge(f"{text!r} is not a size systemd can hold (16E or more)")
    if len(fraction) > _MAX_DIGITS:
        raise ValueError(f"{text!r} has more than {_MAX_DIGITS} decimals")
    # Decimal, not float: a float has 53 bits, so "9007199254740993" (or a
    # large fractional "T") would come back off by a few bytes.
    power = _SUFFIX[match["suffix"].upper()]
    return bounded_size(round(Decimal(match["number"]) * base**power), text)


def bounded_size(size: int, written: object) -> int:
    """``size`` if 64 bits hold it; :class:`SizeTooLarge`, quoting it as
    ``written``, if it is 16E or more. Also for a size given as an integer
    (a TOML or YAML one has no bound of its own), so that both spellings
    of one size are judged alike."""
    if size > UINT64_MAX:
        raise SizeTooLarge(f"{written!r} is not a size systemd can hold (16E or more)")
    return size


@dataclass(frozen=True)
class MemoryLimit:
    """A memory limit: exactly one of bytes, a percentage of physical memory,
    or infinity (both fields ``None``)."""

    bytes: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> MemoryLimit:
        """Parse ``512M``, ``95%`` or ``infinity``; ``ValueError`` otherwise
        (:class:`SizeTooLarge`, saying so, for a size of 16E or more)."""
        stripped = text.strip()
        if stripped == "infinity":
            return cls()
        percent = _PERCENT.fullmatch(stripped)
        if percent is not None:
            value = float(percent["number"])
            if value > 100:
                raise ValueError(f"{text!r} is more than 100%")
            return cls(percent=value)
        try:
            return cls(bytes=parse_size(stripped))
        except SizeTooLarge:
            raise
        except ValueError:
            raise ValueError(
                f"{text!r} is not a size (a number with K, M, G, T, P or E),"
                " a percentage or 'infinity'"
            ) from None

    @property
    def infinite(self) -> bool:
        return self.bytes is None and self.percent is None

    def __str__(self) -> str:
        if self.bytes is not None:
            return str(self.bytes)
        if self.percent is not None:
            return f"{self.percent:g}%"
        return "infinity"
