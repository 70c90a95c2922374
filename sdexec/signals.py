"""Signals as configuration and command lines write them: ``SIGTERM``,
``term``, ``15``.
"""

from __future__ import annotations

import re
import signal

from sdexec.refusal import json_quoted

__all__ = ["parse_signal", "signal_name"]

_EXPECTED = (
    f"a signal name such as SIGTERM or TERM, or a number from 1 to {signal.NSIG - 1}"
)
_REALTIME = re.compile(r"SIGRT(?P<base>MIN|MAX)(?P<offset>[+-][0-9]{1,3})")
#: Digits a signal number may have: more name no signal.
_MAX_DIGITS = 3


def parse_signal(value: str | int) -> int:
    """The signal number for a name (``SIGKILL``, ``kill``) or a number
    (``9``, ``"9"``).

    ``ValueError`` quoting the value if it names no signal of this system.
    """
    number = _lookup(value)
    if number is None or not 1 <= number < signal.NSIG:
        raise ValueError(f"{json_quoted(value)} is not a signal: expected {_EXPECTED}")
    return number


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15; a real-time signal as ``SIGRTMIN+n``; the bare
    number for a signal this system has no name for."""
    try:
        return signal.Signals(number).name
    except ValueError:
        pass
    if signal.SIGRTMIN < number < signal.SIGRTMAX:
        return f"SIGRTMIN+{number - signal.SIGRTMIN}"
    return str(number)


def _lookup(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip().upper()
    # ASCII digits only ("²" is a digit to str.isdigit), and few of them:
    # int() refuses thousands in words about Python's own settings.
    if text.isascii() and text.isdigit():
        return int(text) if len(text.lstrip("0")) <= _MAX_DIGITS else None
    name = text if text.startswith("SIG") else f"SIG{text}"
    if name in signal.Signals.__members__:
        return signal.Signals[name].value
    realtime = _REALTIME.fullmatch(name)
    if realtime is None:
        return None
    base = signal.SIGRTMIN if realtime["base"] == "MIN" else signal.SIGRTMAX
    return base + int(realtime["offset"])
