"""What systemd can keep in a transient unit's file.

systemd writes a transient unit's settings into its file in
``/run/…/transient/`` and reads that file again at every ``daemon-reload``
(and ``daemon-reexec``): a value it cannot read back as it was written
changes the unit, or loses it every setting. This module says which values
those are (a line break, a trailing backslash, a line too long) and how long
the lines of a command and an environment are as systemd 252 escapes them.
A leaf: it knows neither requests nor the bus.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "ESCAPED_AS_COMMAND",
    "ESCAPED_AS_ENVIRONMENT",
    "LONG_LINE_MAX",
    "MAX_UNIT_LINE",
    "UnitFileEscapes",
    "UnitFileLine",
    "line_too_long",
    "unit_file_problem",
    "value_line_problem",
]

#: What ends a line of a unit's file for systemd's reader.
_LINE_BREAK = re.compile(r"[\n\r]")

#: systemd's ``LONG_LINE_MAX`` (1 MiB, ``src/basic/fileio.h``). Its
#: unit-file reader (``config_parse``, ``read_line``) fails on a line of
#: this many bytes or more, its key and ``=`` counted, its newline not
#: (measured on systemd 252: a line of 1048575 bytes loads, one of 1048576
#: does not). A transient unit's file is read again at every
#: ``daemon-reload``: a unit with such a line then fails to load
#: (``LoadState=error``, "No buffer space available") and keeps none of its
#: settings, the site's limits, its slice and the stop timeouts the stop
#: timer relies on among them.
LONG_LINE_MAX = 1024 * 1024

#: The longest line of a transient unit's file sdexec has systemd write:
#: :data:`LONG_LINE_MAX` less 4 KiB. The count of a command's and an
#: environment's lines (:func:`sdexec.limits.check_unit_file_lines`) is
#: exact for systemd 252 (measured); the margin is for what it cannot know
#: of another version, whose line for the same command may begin otherwise
#: (``ExecStart=``, other flag characters) or escape a few more of an
#: ordinary command's characters, and for a property's name, which
#: :func:`sdexec.property.typed_property` does not count.
MAX_UNIT_LINE = LONG_LINE_MAX - 4096


class UnitFileEscapes(NamedTuple):
    """How systemd escapes a setting's text in a unit's file: the bytes it
    writes as two (``\\n``, ``%%``) and those it writes as four
    (``\\001``, octal); every other byte as it is."""

    twice: bytes
    octal: bytes

    def length(self, text: str) -> int:
        """The bytes of ``text`` once escaped."""
        data = text.encode()
        twice = len(data) - len(data.translate(None, self.twice))
        octal = len(data) - len(data.translate(None, self.octal))
        return len(data) + twice + 3 * octal


#: Bytes systemd writes as two: ``%`` doubled (it would be read as a
#: specifier), and C's named escapes.
_TWICE = b"%\\\"'\a\b\f\n\r\t\v"
#: The other control bytes, written in octal (NUL is in no value: a D-Bus
#: string cannot hold one).
_CONTROL = bytes(byte for byte in (*range(1, 0x20), 0x7F) if byte not in _TWICE)
#: The environment, as systemd 252's ``cescape`` writes it: each byte of a
#: non-ASCII character in octal too (``é`` is ``\\303\\251``).
ESCAPED_AS_ENVIRONMENT = UnitFileEscapes(_TWICE, _CONTROL + bytes(range(0x80, 0x100)))
#: A command, as systemd 252's ``shell_escape`` writes it: ``$`` and ``;``
#: escaped too (its own syntax there), a non-ASCII character as it is.
ESCAPED_AS_COMMAND = UnitFileEscapes(_TWICE + b"$;", _CONTROL)


def _utf8_length(text: str) -> int:
    # An ASCII str knows it is one (no scan): its bytes are its characters.
    return len(text) if text.isascii() else len(text.encode())


class UnitFileLine(NamedTuple):
    """A line of a transient unit's file: ``fixed`` bytes systemd adds (the
    key, quotes, spaces, ``=``) and ``texts`` escaped by ``escapes``."""

    fixed: int
    texts: Sequence[str]
    escapes: UnitFileEscapes

    def certainly_fits(self) -> bool:
        """Whether the line fits :data:`MAX_UNIT_LINE` however its texts
        escape: no byte escapes to more than four. An ordinary command is so
        measured, not escaped (this runs for every exec)."""
        return self.fixed + 4 * sum(map(_utf8_length, self.texts)) <= MAX_UNIT_LINE

    def length(self) -> int:
        """The line's bytes, its newline not counted."""
        return self.fixed + sum(map(self.escapes.length, self.texts))

    def overlong(self) -> int | None:
        """The line's bytes if more than :data:`MAX_UNIT_LINE`, else
        ``None``; escaped only where :meth:`certainly_fits` cannot say."""
        if self.certainly_fits():
            return None
        length = self.length()
        return length if length > MAX_UNIT_LINE else None


def line_too_long(length: int, estimate: str = "") -> str:
    """Why a line of ``length`` bytes (``estimate``: ``"up to "`` for a
    count from above) cannot be in a unit's file."""
    return (
        f"{estimate}{length} bytes as systemd writes it into the unit's file,"
        f" more than the {MAX_UNIT_LINE} sdexec allows: systemd reads back no"
        f" line of {LONG_LINE_MAX} bytes or more (LONG_LINE_MAX), and the unit"
        " would lose every property at the next daemon-reload"
    )


def value_line_problem(value: str) -> str | None:
    """Why ``value`` would make too long a line (:data:`MAX_UNIT_LINE`), or
    ``None``. How systemd writes a value depends on the property; this
    counts it from above, as it writes the environment, its most escaped
    setting: C-escaped, each space-separated word in double quotes."""
    line = UnitFileLine(2 * (value.count(" ") + 1), [value], ESCAPED_AS_ENVIRONMENT)
    length = line.overlong()
    return None if length is None else line_too_long(length, estimate="up to ")


def unit_file_problem(value: str) -> str | None:
    """Why systemd could not keep ``value`` as one setting of a unit's
    file, or ``None``.

    systemd writes a transient unit's settings into its file in
    ``/run/…/transient/`` as they came (escaping ``%`` alone, but for the
    command and the environment), and reads that file again at every
    ``daemon-reload``. A line break in a value starts a new setting or
    section there, and a backslash at its end joins the next setting to it
    (systemd issue #30187: the running command then vanishes from the
    unit)."""
    line_break = _LINE_BREAK.search(value)
    if line_break is not None:
        return (
            f"line break {line_break.group()!r} at {line_break.start()}: systemd"
            " writes the value unescaped into the unit's file, where the rest"
            " would be a setting of its own"
        )
    # systemd's reader joins the next line to one that ends in an escape:
    # an odd run of backslashes.
    if (len(value) - len(value.rstrip("\\"))) % 2:
        return (
            "ends with a backslash: systemd writes the value unescaped into the"
            " unit's file, where it would join the next setting to this one"
        )
    return None
