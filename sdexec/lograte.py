"""Log lines a client can cause, at a bounded rate.

Some warnings follow from what a client does: a connection over a cap, a
start systemd refuses, a process that exits before its fence is checked.
Each is worth a line, but a client that does it in a loop must not flood
the journal (harm to the node, and it buries everything else). A
:class:`LogRate` lets through :data:`BURST` lines of one kind (a key: the
call site, not the client's words) per :data:`WINDOW_S` seconds; the rest
are counted, and once the window closes one line says how many were
suppressed and quotes the last.

Timing is by the clock it is given (``reactor.callLater``), so tests drive
it with a ``Clock``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel, formatEvent

__all__ = ["BURST", "WINDOW_S", "LogRate"]

#: Lines of one kind let through per window.
BURST = 10
#: Seconds a window lasts, from the first line of a kind.
WINDOW_S = 60.0


@dataclass
class _Window:
    """One kind's lines in the current window."""

    level: LogLevel
    logged: int = 0
    suppressed: int = 0
    last: str = ""
    closing: IDelayedCall | None = field(default=None, repr=False)


class LogRate:
    """Logs through ``log`` at most :data:`BURST` lines per key per
    :data:`WINDOW_S`, then one summary per window."""

    def __init__(self, log: Logger, clock: IReactorTime) -> None:
        self._log = log
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def warn(self, key: str, text: str, **fields: Any) -> None:
        """``log.warn(text, **fields)``, unless ``key`` has had its share."""
        self.emit(LogLevel.warn, key, text, **fields)

    def emit(self, level: LogLevel, key: str, text: str, **fields: Any) -> None:
        """``log.emit(level, text, **fields)``, unless ``key`` has had its
        share of the window."""
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(level)
            window.closing = self._clock.callLater(WINDOW_S, self._close, key)
        if window.logged < BURST:
            window.logged += 1
            self._log.emit(level, text, **fields)
            return
        window.suppressed += 1
        window.last = formatEvent({"log_format": text, **fields})

    def _close(self, key: str) -> None:
        window = self._windows.pop(key)
        if window.suppressed:
            self._log.emit(
                window.level,
                "{suppressed} more like it in {seconds:g} s not logged;"
                " the last: {last}",
                suppressed=window.suppressed,
                seconds=WINDOW_S,
                last=window.last,
            )

    def stop(self) -> None:
        """Say what is suppressed now, and arm nothing more (the service
        stops)."""
        for key, window in list(self._windows.items()):
            if window.closing is not None and window.closing.active():
                window.closing.cancel()
            self._close(key)
