"""RFC 23 Flux Standard Duration: ``"5s"``, ``"30m"``, ``"0.5"``, ``"100ms"``.

A duration is a non-negative number with an optional unit suffix: ``ms``,
``s``, ``m``, ``h`` or ``d``; no suffix means seconds. Configuration files may
also hold a bare number (TOML ``kill-timeout = 5``), taken as seconds.

Infinity and NaN are refused: every duration in this project is a timeout
that must eventually fire. Flux's ``fsd_parse_duration`` reads the number
with ``strtod``, so it takes ``"inf"`` and ``"infinity"`` (and an overflow,
``"1e400"``) as an infinite duration, and hexadecimal (``"0x10"``); sdexec
refuses both, saying why (:class:`InfiniteDurationError` for the first).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from sdexec.refusal import json_quoted

__all__ = ["InfiniteDurationError", "format_fsd", "parse_fsd"]

# Seconds per unit. Formatting tries them in this order, so on a tie in length
# the plainer unit wins ("0s", not "0d").
_UNITS: dict[str, Decimal] = {
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
    "ms": Decimal("0.001"),
}

# ASCII digits only, as Flux's fsd_parse_duration reads them; a leading "+",
# which its strtod takes too.
_FSD = re.compile(
    r"(?P<number>\+?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(?P<unit>ms|s|m|h|d)?",
    re.ASCII,
)

_EXPECTED = "a non-negative number with an optional suffix ms, s, m, h or d"

# What strtod reads as infinity (any case), and the start of what it reads as
# hexadecimal: Flux takes both, sdexec neither.
_INFINITY = re.compile(r"\+?inf(?:inity)?", re.ASCII | re.IGNORECASE)
_HEXADECIMAL = re.compile(r"[+-]?0x", re.ASCII | re.IGNORECASE)

_NOT_INFINITE = "infinite, a timeout that never fires, which sdexec does not take"
_FLUX_INFINITE = (
    "Flux reads it as infinite (strtod), a timeout that never fires, which"
    " sdexec does not take"
)
_NOT_HEXADECIMAL = (
    'sdexec takes no hexadecimal (Flux\'s strtod reads it: "0x1d" is 29 s'
    " there, not a day)"
)


class InfiniteDurationError(ValueError):
    """A duration Flux reads as infinite (``"inf"``, ``"infinity"``, one
    too large for a float), which sdexec refuses."""


def parse_fsd(value: str | float) -> float:
    """Seconds in a Flux Standard Duration, or in a bare number of seconds.

    ``ValueError`` quoting the value if it is not a finite, non-negative
    duration: :class:`InfiniteDurationError` for an infinite one.
    """
    if isinstance(value, str):
        seconds = _parse_text(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # a YAML integer can be too large for a float
            seconds = math.inf
    else:
        seconds = math.nan
    if math.isfinite(seconds) and seconds >= 0:
        return float(seconds)
    raise _refusal(value, seconds)


def _refusal(value: object, seconds: float) -> ValueError:
    """Why ``value`` (``seconds``: infinite, negative or NaN) is refused,
    naming what Flux reads where it takes the value."""
    refusal = f"{json_quoted(value)} is not a valid duration: "
    if seconds == math.inf or _is_infinity_text(value):
        why = _FLUX_INFINITE if isinstance(value, str) else _NOT_INFINITE
        return InfiniteDurationError(f"{refusal}{why}; expected {_EXPECTED}")
    if isinstance(value, str) and _HEXADECIMAL.match(value.strip()):
        refusal += f"{_NOT_HEXADECIMAL}: "
    return ValueError(f"{refusal}expected {_EXPECTED}")


def _is_infinity_text(value: object) -> bool:
    return isinstance(value, str) and bool(_INFINITY.fullmatch(value.strip()))


def format_fsd(seconds: float) -> str:
    """The shortest duration text that parses back to exactly ``seconds``.

    ``1800`` gives ``"30m"``, ``0.001`` gives ``"1ms"``, ``90`` gives ``"90s"``.
    """
    parse_fsd(seconds)  # same domain as parsing: finite and non-negative
    candidates = (
        _number_text(seconds / float(per_unit)) + unit
        for unit, per_unit in _UNITS.items()
    )
    # The "s" candidate is the float's own repr, so at least one always fits.
    return min((c for c in candidates if _round_trips(c, seconds)), key=len)


def _parse_text(text: str) -> float:
    """Seconds in ``text``; NaN if it is not a duration at all."""
    match = _FSD.fullmatch(text.strip())
    if match is None:
        return math.nan
    # Decimal arithmetic so that "0.1m" is exactly 6 seconds, not 6.000000000000001.
    try:
        number = Decimal(match["number"]) * _UNITS[match["unit"] or "s"]
    except ArithmeticError:  # an exponent too large even for Decimal
        return math.inf
    return float(number)


def _number_text(number: float) -> str:
    """The float's shortest exact text, without a redundant ``.0``."""
    text = repr(number)
    return text.removesuffix(".0")


def _round_trips(text: str, seconds: float) -> bool:
    try:
        return parse_fsd(text) == seconds
    except ValueError:  # overflowed to infinity in a large unit
        return False
