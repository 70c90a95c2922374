"""Log lines a client can cause, at a bounded rate.

Some warnings follow from what a client does: a connection over a cap, a
start systemd refuses, a process that exits before its fence is checked.
Each is worth a line, but a client that does it in a loop must not flood
the journal (harm to the node, and it buries everything else). A
:class:`LogRate` lets through :data:`BURST` lines of one kind (a key: the
call site, not the client's words) per :data:`WINDOW_S` seconds; the rest
are counted, and once the window closes one line says how many were
suppressed and quotes the last (cut at :data:`MAX_QUOTED` characters).

Timing is by the clock it is given (``reactor.callLater``), so tests drive
it with a ``Clock``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel, formatEvent

__all__ = ["BURST", "MAX_QUOTED", "WINDOW_S", "LogRate", "shortened"]

#: Lines of one kind let through per window.
BURST = 10
#: Seconds a window lasts, from the first line of a kind.
WINDOW_S = 60.0
#: Characters of a client's words a line quotes (the last suppressed line
#: a summary quotes, a refusal's ``errstr``): a request's value may be
#: megabytes, which journald would split into thousands of entries.
MAX_QUOTED = 1024


def shortened(text: str) -> str:
    """``text`` cut at :data:`MAX_QUOTED` characters, for a log line."""
    return text if len(text) <= MAX_QUOTED else f"{text[:MAX_QUOTED]}…"


@dataclass
class _Window:
    """One kind's lines in the current window."""

    level: LogLevel
    opened: float
    logged: int = 0
    suppressed: int = 0
    #: The last suppressed line's format and fields, formatted only if the
    #: summary quotes it.
    last: tuple[str, dict[str, Any]] = ("", {})
    closing: IDelayedCall | None = field(default=None, repr=False)


class LogRate:
    """Logs through ``log`` at most :data:`BURST` lines per key per
    :data:`WINDOW_S`, then one summary per window."""

    def __init__(self, log: Logger, clock: IReactorTime) -> None:
        self._log = log
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._stopped = False

    def warn(self, key: str, text: str, **fields: Any) -> None:
        """``log.warn(text, **fields)``, unless ``key`` has had its share."""
        self.emit(LogLevel.warn, key, text, **fields)

    def emit(self, level: LogLevel, key: str, text: str, **fields: Any) -> None:
        """``log.emit(level, text, **fields)``, unless ``key`` has had its
        share of the window. Once stopped, every line is logged."""
        if self._stopped:
            self._log.emit(level, text, **fields)
            return
        now = self._clock.seconds()
        window = self._windows.get(key)
        over = window is not None and now - window.opened >= WINDOW_S
        if window is None or (over and window.closing is None):
            # (One past its end with a timer still to fire is summed up by
            # it, this line too.)
            window = self._windows[key] = _Window(level, now)
        if window.logged < BURST:
            window.logged += 1
            self._log.emit(level, text, **fields)
            return
        window.suppressed += 1
        window.last = (text, fields)
        if window.closing is None:
            # Armed at the first line held back, not at the first line: a
            # timer for every line logged (a drain, a leftover gone) would
            # outlive what it was about, for nothing to say.
            window.closing = self._clock.callLater(
                window.opened + WINDOW_S - now, self._close, key
            )

    def _close(self, key: str) -> None:
        window = self._windows.pop(key)
        window.closing = None
        if not window.suppressed:
            return
        text, fields = window.last
        last = shortened(formatEvent({"log_format": text, **fields}))
        self._log.emit(
            window.level,
            "{suppressed} more like it in {seconds:.0f} s not logged; the last: {last}",
            suppressed=window.suppressed,
            seconds=self._clock.seconds() - window.opened,
            last=last,
        )

    def stop(self) -> None:
        """Say what is suppressed now, and hold nothing back from now on
        (the service stops: no timer would fire)."""
        self._stopped = True
        for key, window in list(self._windows.items()):
            if window.closing is not None and window.closing.active():
                window.closing.cancel()
            self._close(key)
