"""Sizes and memory limits: ``512M``, ``95%``, ``infinity``.

A memory limit (:class:`MemoryLimit`) is read as Flux's sdexec reads
``MemoryMax`` (flux-core src/common/libsdexec/start.c, ``prop_add``): a
percentage as its sdexec_parse_percent, else a size as its parse_size
(:func:`parse_flux_size`: ``0x40000000``, ``077`` octal, ``1.5e9``), else
``infinity``; a few spellings Flux refuses keep the meaning sdexec gave them
(:func:`memory_size`). That one reading serves the configuration checks,
the request policy, the D-Bus property typing and the mapper's memory
scaling, so they cannot disagree about what a limit means.

The configuration's own sizes (:func:`parse_size`) are systemd's. Suffixes
are base 1024 (``K``, ``M``, ``G``, ``T``, ``P``, ``E``, in either
case, as Flux's mapper takes them; ``1.5G`` is allowed), a bare number (or
one with ``B``, as systemd takes it) is bytes. A size must fit systemd's 64
bits. A percentage has two decimals at most: systemd keeps ten-thousandths
(its parse_permyriad), and writes no finer one into a unit's file.

A request's ``<stream>_BUFSIZE`` is Flux's, not systemd's: Flux reads it with
its own parse_size (flux-core src/common/libutil/parse_size.c), which
:func:`parse_flux_size` follows, so that a size a Flux client sends is read
as Flux's own server reads it (``0x1000``, ``1e3``; not ``1m`` or ``1B``).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from sdexec.refusal import SHOWN, quoted

__all__ = [
    "MEMORY_LIMIT_FORMS",
    "SUFFIXES",
    "UINT32_MAX",
    "UINT64_MAX",
    "MemoryLimit",
    "SizeNotTaken",
    "SizeTooLarge",
    "bounded_size",
    "memory_size",
    "octal_differs",
    "parse_flux_percent",
    "parse_flux_size",
    "parse_permyriad",
    "parse_size",
    "scale_from_permyriad",
    "scaled_memory",
]

_SUFFIX = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
#: The suffixes a size may have, as error messages name them.
SUFFIXES = "B, K, M, G, T, P or E"
# ASCII digits only, as systemd's parse_size and sdexec's integers read them.
_SIZE = re.compile(
    r"(?P<number>\d+(?:\.\d+)?)\s*(?P<suffix>[KMGTPEB]?)", re.IGNORECASE | re.ASCII
)
# systemd keeps sizes in 64 bits, and a percentage as a share of UINT32_MAX.
UINT64_MAX = 2**64 - 1
UINT32_MAX = 2**32 - 1
_PERCENT = re.compile(r"(?P<whole>\d+)(?:\.(?P<decimals>\d+))?%", re.ASCII)
#: The decimals of a percentage systemd keeps (ten-thousandths).
_PERCENT_DECIMALS = 2
#: Digits a size's number may have before and after its point. Every size
#: below 16E has at most 20 before it; refusing longer numbers first keeps a
#: request of a million digits from costing seconds of arithmetic.
_MAX_DIGITS = 20


class SizeNotTaken(ValueError):
    """A size or percentage written as one, which sdexec does not take: its
    message says why, for a caller to pass on rather than say what a size
    is (``3.125%``: more than two decimals)."""


class SizeTooLarge(SizeNotTaken):
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
        if _is_a_sum(text):
            raise _sum_refused(text)
        raise ValueError(
            f"{quoted(text, SHOWN)} is not a size (a number, alone or with {SUFFIXES})"
        )
    whole, _point, fraction = match["number"].partition(".")
    if len(whole.lstrip("0")) > _MAX_DIGITS:
        raise _too_large_for_systemd(text)
    if len(fraction) > _MAX_DIGITS:
        raise ValueError(f"{quoted(text, SHOWN)} has more than {_MAX_DIGITS} decimals")
    # Decimal, not float: a float has 53 bits, so "9007199254740993" (or a
    # large fractional "T") would come back off by a few bytes.
    power = _SUFFIX[match["suffix"].upper()]
    return bounded_size(round(Decimal(match["number"]) * base**power), text)


# Flux's parse_size: strtoull(s, 0), then strtold, each followed by exactly
# one of its suffixes (only "k" in lower case: "m" could be milli). The
# possessive quantifiers take digits as greedily as strtoull and strtold do,
# so that "0x1E" is 30, never 1 with an "E" suffix.
_FLUX_SCALE = {"": 0, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
_C_SPACE = r"[ \t\n\v\f\r]*+"
_FLUX_SUFFIX = r"(?P<suffix>[kKMGTPE]?)"
_FLUX_INTEGER = re.compile(
    _C_SPACE
    + r"\+?(?:0[xX](?P<hex>[0-9a-fA-F]++)|(?P<octal>0[0-7]*+)"
    + r"|(?P<decimal>[1-9][0-9]*+))"
    + _FLUX_SUFFIX
)
# What strtold (and strtod) read as a finite number, sign and all.
_C_REAL = (
    _C_SPACE
    + r"(?P<sign>[+-]?)(?:"
    + r"(?P<hexfloat>0[xX](?:[0-9a-fA-F]++(?:\.[0-9a-fA-F]*+)?|\.[0-9a-fA-F]++)"
    + r"(?:[pP][+-]?[0-9]++)?+)"
    + r"|(?P<float>(?:[0-9]++(?:\.[0-9]*+)?|\.[0-9]++)(?:[eE][+-]?[0-9]++)?+))"
)
_FLUX_FLOAT = re.compile(_C_REAL + _FLUX_SUFFIX)
# sdexec_parse_percent (flux-core src/common/libsdexec/parse.c): strtod,
# then "%" alone.
_FLUX_PERCENT = re.compile(_C_REAL + "%")
#: Digits beyond which strtoull overflows, in each base (leading zeros
#: aside): checked before int(), which a million digits would keep busy.
_FLUX_DIGITS = {16: 16, 8: 22, 10: 20}
#: What a size a request gives for Flux may be, as error messages say it.
FLUX_SIZE = (
    "a number (decimal, 0x hex, 0 octal or floating point), alone or with"
    " k, K, M, G, T, P or E"
)


def parse_flux_size(text: str) -> int:
    """Bytes in a size as Flux's parse_size reads it: an integer (``4096``,
    ``0x1000``, ``010`` octal) or a floating point number (``1e3``,
    ``0.5k``, rounded down), after any white space, with one suffix of
    ``k``/``K``, ``M``, ``G``, ``T``, ``P`` or ``E`` (powers of 1024).

    ``ValueError`` if it is not such a size (also negative ones, ``nan``
    and ``inf``, as Flux refuses them); :class:`SizeTooLarge` if it is 16E
    or more. Flux lets a product past 64 bits wrap (``17E``) and casts
    2**64 itself; both are refused here.
    """
    integer = _FLUX_INTEGER.fullmatch(text)
    if integer is not None and "-" not in text:
        return _flux_integer(integer, text)
    number = _FLUX_FLOAT.fullmatch(text)
    if number is None:
        raise ValueError(f"{quoted(text, SHOWN)} is not a size ({FLUX_SIZE})")
    return _flux_float(number, text)


def _flux_integer(match: re.Match[str], text: str) -> int:
    """strtoull's integer times its suffix; past 64 bits, strtoull would
    have failed and Flux tried it as floating point, which overflows too."""
    base, digits = next(
        (base, match[group])
        for base, group in ((16, "hex"), (8, "octal"), (10, "decimal"))
        if match[group] is not None
    )
    if len(digits.lstrip("0")) > _FLUX_DIGITS[base]:
        raise _too_large(text)
    size = int(digits, base) * 1024 ** _FLUX_SCALE[match["suffix"]]
    if size > UINT64_MAX:
        raise _too_large(text)
    return size


def _flux_float(match: re.Match[str], text: str) -> int:
    """floor(d x scale) in doubles, as Flux computes it, d being what
    strtold read (converted to a double)."""
    written = match["float"] or match["hexfloat"]
    try:
        magnitude = float(written) if match["float"] else float.fromhex(written)
    except OverflowError:  # fromhex's; float() gives inf, as strtold would
        raise _too_large(text) from None
    if match["sign"] == "-" and magnitude != 0:
        raise ValueError(f"{quoted(text, SHOWN)} is not a size: a size is not negative")
    product = magnitude * 2.0 ** (10 * _FLUX_SCALE[match["suffix"]])
    # A product of 2**64 or more (inf too) is past what 64 bits hold.
    if product >= 2.0**64:
        raise _too_large(text)
    return math.floor(product)


def parse_flux_percent(text: str) -> int:
    """The ten-thousandths in a percentage as Flux's sdexec_parse_percent
    reads it (strtod, then ``%``): ``50%``, ``12.5%``, ``5e1%``, ``0x32%``,
    after any white space, from 0% to 100%. ``ValueError`` if it is no
    percentage (a negative one, ``nan%``); :class:`SizeNotTaken` for one
    past 100%, or finer than 0.01% (``3.125%``, which Flux takes): systemd
    keeps ten-thousandths and writes the rounded one into the unit's file,
    where a ``daemon-reload`` read it back so (below 0.005%: no limit)."""
    match = _FLUX_PERCENT.fullmatch(text)
    if match is None:
        raise ValueError(f"{quoted(text, SHOWN)} is not a percentage (50%, 12.5%)")
    value = _exact_real(match, text)
    if value.is_signed() and value != 0:
        raise ValueError(
            f"{quoted(text, SHOWN)} is not a percentage: a percentage is not negative"
        )
    if value > 100:  # exact: no context rounds a comparison
        raise SizeNotTaken(f"{quoted(text, SHOWN)} is more than 100%")
    _sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # finite, as the pattern is
    significant = "".join(map(str, digits)).rstrip("0")
    exponent += len(digits) - len(significant) + _PERCENT_DECIMALS
    if significant and exponent < 0:
        raise SizeNotTaken(
            f"{quoted(text, SHOWN)} has more than two decimals: systemd keeps a"
            " percentage to 0.01%"
        )
    # At most 100% here, so the exponent is small.
    return int(significant) * 10**exponent if significant else 0


def _exact_real(match: re.Match[str], text: str) -> Decimal:
    """The number strtod read, exactly: a decimal one as written (no float
    could say whether ``50.005`` has a third decimal), a hexadecimal one as
    the double it is."""
    if match["float"]:
        try:
            value = Decimal(match["float"])
        except InvalidOperation:  # an exponent past the 18 digits Decimal holds
            value = _stand_in(match["float"])
    else:
        try:
            value = Decimal(float.fromhex(match["hexfloat"]))
        except OverflowError:
            raise SizeNotTaken(f"{quoted(text, SHOWN)} is more than 100%") from None
    # copy_negate: exact, where - rounds in the context (Overflow past 1e999999)
    return value.copy_negate() if match["sign"] == "-" else value


def _stand_in(written: str) -> Decimal:
    """For a decimal number whose exponent Decimal cannot hold (``1e-``
    and 19 digits or more): 0 if its digits are, else a number as far past
    100% (a positive exponent) or below 0.01% (a negative one), which
    judges it alike."""
    digits, _e, exponent = written.lower().partition("e")
    if not digits.strip("0."):
        return Decimal(0)
    return Decimal("1e-1000" if exponent.startswith("-") else "1e1000")


#: Sizes of memory limits that sdexec took before it read them as Flux does,
#: and Flux refuses: a lower-case suffix (``4g``), a ``B`` (``512B``), a
#: space before the suffix (``64 M``). Each keeps the meaning it had.
_KEPT_SPELLING = re.compile(
    r"(?P<number>[0-9]+(?:\.[0-9]+)?)[ \t]*(?:(?P<suffix>[KMGTPEkmgtpe])|[Bb])?"
)
#: What a memory limit may be, as error messages say it.
MEMORY_LIMIT_FORMS = (
    f"a size ({FLUX_SIZE}), a percentage up to 100% (two decimals at most)"
    " or 'infinity'"
)


def memory_size(text: str) -> int:
    """Bytes in a memory limit's size, as Flux's sdexec reads it (its
    parse_size, :func:`parse_flux_size`: ``0x40000000``, ``0100M`` octal,
    ``1.5e9``); else one of :data:`_KEPT_SPELLING`, read with it too.
    ``ValueError`` otherwise (:class:`SizeNotTaken` for a sum, or 16E or
    more)."""
    try:
        return parse_flux_size(text)
    except SizeNotTaken:
        raise
    except ValueError:
        kept = _KEPT_SPELLING.fullmatch(text)
        if kept is None:
            if _is_a_sum(text):
                raise _sum_refused(text) from None
            raise
        return parse_flux_size(kept["number"] + (kept["suffix"] or "").upper())


def octal_differs(text: str) -> bool:
    """Whether ``text`` is a size whose number Flux reads as octal and
    sdexec, before it read them as Flux does, read as decimal (``0100M``:
    64M for Flux, 100M before): a site's limit whose meaning would change
    under it."""
    spelled = _KEPT_SPELLING.fullmatch(text.strip())
    number = "" if spelled is None else spelled["number"]
    return (
        number.startswith("0")
        and number.isdigit()
        and not set(number) & {"8", "9"}
        and int(number, 8) != int(number, 10)
    )


def _sum_refused(text: str) -> SizeNotTaken:
    """The refusal of sizes added up, which systemd's parse_size takes."""
    return SizeNotTaken(
        f"{quoted(text, SHOWN)}: sdexec does not take a sum of sizes; write it as"
        " one (1.5G, not 1G 512M)"
    )


def _too_large(text: str) -> SizeTooLarge:
    """The refusal of a Flux size past 64 bits (:func:`parse_flux_size`)."""
    return SizeTooLarge(f"{quoted(text, SHOWN)} is too large (16E or more)")


def _is_a_sum(text: str) -> bool:
    """Whether ``text`` is sizes separated by spaces, which systemd's
    parse_size adds up (``1G 512M``)."""
    words = text.split()
    return len(words) > 1 and all(_SIZE.fullmatch(word) for word in words)


def parse_permyriad(text: str) -> int:
    """The ten-thousandths in a percentage from ``0%`` to ``100%``
    (``"12.5%"`` is 1250), two decimals at most, as systemd's
    parse_permyriad reads it. ``ValueError`` if the text is no percentage;
    :class:`SizeNotTaken` for one past 100% or with more decimals (systemd
    would keep it rounded, and write the rounded one into the unit's file:
    below 0.005%, none at all)."""
    match = _PERCENT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{quoted(text, SHOWN)} is not a percentage (50%, 12.5%)")
    decimals = match["decimals"] or ""
    if len(decimals) > _PERCENT_DECIMALS:
        raise SizeNotTaken(
            f"{quoted(text, SHOWN)} has more than two decimals: systemd keeps a"
            " percentage to 0.01%"
        )
    whole = match["whole"].lstrip("0")
    # Past three digits it is more than 100% (and int() of a million costs).
    permyriad = int(whole[:4] or "0") * 100 + int(decimals.ljust(2, "0"))
    if len(whole) > 3 or permyriad > 10_000:
        raise SizeNotTaken(f"{quoted(text, SHOWN)} is more than 100%")
    return permyriad


def scale_from_permyriad(permyriad: int) -> int:
    """``permyriad`` as systemd's ``<Name>Scale``: a fraction of UINT32_MAX,
    rounded half up, exactly as its UINT32_SCALE_FROM_PERMYRIAD."""
    return (permyriad * UINT32_MAX + 5000) // 10_000


def scaled_memory(scale: int, memory: int) -> int:
    """The bytes systemd holds for a ``<Name>Scale`` of ``memory`` (its
    physical_memory_scale): that share of its whole pages, rounded down to
    a page."""
    page = os.sysconf("SC_PAGE_SIZE")
    return memory // page * scale // UINT32_MAX * page


def bounded_size(size: int, written: object) -> int:
    """``size`` if 64 bits hold it; :class:`SizeTooLarge`, quoting it as
    ``written``, if it is 16E or more. Also for a size given as an integer
    (a TOML or YAML one has no bound of its own), so that both spellings
    of one size are judged alike."""
    if size > UINT64_MAX:
        raise _too_large_for_systemd(written)
    return size


def _too_large_for_systemd(written: object) -> SizeTooLarge:
    """The refusal of a systemd size past 64 bits (:func:`parse_size`,
    :func:`bounded_size`), quoting it as ``written``."""
    return SizeTooLarge(
        f"{quoted(written, SHOWN)} is not a size systemd can hold (16E or more)"
    )


@dataclass(frozen=True)
class MemoryLimit:
    """A memory limit: exactly one of bytes, a percentage of physical memory
    (in ten-thousandths, as systemd keeps it), or infinity (both fields
    ``None``)."""

    bytes: int | None = None
    permyriad: int | None = None

    @classmethod
    def parse(cls, text: str) -> MemoryLimit:
        """Parse a limit as Flux's sdexec reads ``MemoryMax`` and the other
        memory limits: a percentage (:func:`parse_flux_percent`), else a
        size (:func:`memory_size`), else ``infinity``; white space around
        it aside. ``ValueError`` otherwise, naming the forms
        (:class:`SizeNotTaken`, saying why, for a size of 16E or more, a
        percentage past 100% or with more than two decimals, a sum)."""
        stripped = text.strip()
        if stripped == "infinity":
            return cls()
        try:
            if stripped.endswith("%"):
                return cls(permyriad=parse_flux_percent(stripped))
            return cls(bytes=memory_size(stripped))
        except SizeNotTaken:
            raise
        except ValueError:
            raise ValueError(
                f"{quoted(text, SHOWN)} is not {MEMORY_LIMIT_FORMS}"
            ) from None

    @property
    def percent(self) -> float | None:
        """The percentage, ``None`` if the limit is none."""
        return None if self.permyriad is None else self.permyriad / 100

    @property
    def scale(self) -> int | None:
        """The percentage as systemd's ``<Name>Scale`` takes it (a fraction
        of UINT32_MAX), ``None`` if the limit is none."""
        return None if self.permyriad is None else scale_from_permyriad(self.permyriad)

    @property
    def infinite(self) -> bool:
        """Whether the limit is none (``infinity``)."""
        return self.bytes is None and self.permyriad is None

    def __str__(self) -> str:
        if self.bytes is not None:
            return str(self.bytes)
        if self.percent is not None:
            return f"{self.percent:g}%"
        return "infinity"
