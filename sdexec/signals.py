"""Signals as configuration and command lines write them: ``SIGTERM``,
``term``, ``15``.

Read from the signal module's C core, as :class:`signal.Signals` is made
of it, without that enum: ``sdexec run`` names a signal that ended its
process, and loads no ``enum`` (docs/performance.md).
"""

from __future__ import annotations

from sdexec.refusal import json_quoted

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import signal
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms

__all__ = ["parse_signal", "signal_name", "signals_said"]

_EXPECTED = (
    f"a signal name such as SIGTERM or TERM, or a number from 1 to {signal.NSIG - 1}"
)
#: Digits a signal number may have: more name no signal.
_MAX_DIGITS = 3
#: Digits a real-time signal's offset may have (``SIGRTMIN+3``), leading
#: zeros included.
_OFFSET_DIGITS = 3


def _signal_names() -> tuple[dict[str, int], dict[int, str]]:
    """Every signal name of this system (``SIGIOT`` too) to its number,
    and each number to its name: of those that share a number, the first
    in order (``SIGABRT``, not ``SIGIOT``), as :class:`signal.Signals`
    chooses its members from their aliases."""
    numbers = {
        name: value
        for name, value in vars(signal).items()
        if name.startswith("SIG") and not name.startswith("SIG_") and name.isupper()
    }
    names: dict[int, str] = {}
    for name, number in sorted(numbers.items()):
        names.setdefault(number, name)
    return numbers, names


_NUMBERS, _NAMES = _signal_names()


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
    name = _NAMES.get(number)
    if name is not None:
        return name
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
    # A leading "+" as Flux's strtol takes it (term-signal = "+15").
    digits = text[1:] if text.startswith("+") else text
    # ASCII digits only ("²" is a digit to str.isdigit), and few of them:
    # int() refuses thousands in words about Python's own settings.
    if digits.isascii() and digits.isdigit():
        return int(digits) if len(digits.lstrip("0")) <= _MAX_DIGITS else None
    name = text if text.startswith("SIG") else f"SIG{text}"
    return _NUMBERS.get(name, _realtime(name))


def _realtime(name: str) -> int | None:
    """``SIGRTMIN+n`` or ``SIGRTMAX-n`` (either sign), counted from its
    base; ``None`` for any other name."""
    base = {"SIGRTMIN": signal.SIGRTMIN, "SIGRTMAX": signal.SIGRTMAX}.get(name[:8])
    offset = name[9:]
    if base is None or name[8:9] not in ("+", "-"):
        return None
    if not (offset.isascii() and offset.isdigit() and len(offset) <= _OFFSET_DIGITS):
        return None
    return base + int(name[8:])


def signals_said(signum: int, count: int) -> str:
    """``SIGKILL once``, ``SIGKILL twice``, ``SIGKILL 4 times``: how often a
    signal was tried, as the words of an unkillable verdict say it."""
    times = {1: "once", 2: "twice"}.get(count, f"{count} times")
    return f"{signal_name(signum)} {times}"
