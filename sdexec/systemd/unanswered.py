"""Method calls awaiting the manager's answer, and a manager gone silent.

sdexec gives its calls no timeout, as Flux's sdbus gives none: a busy
manager (a ``daemon-reload`` on a large node, a unit's cgroup stuck in the
kernel) answers late, and a start it has taken cannot be taken back by
giving up on its answer. A manager that does not answer at all (wedged)
would then hold every start, kill and verdict without a word. This
module says so: a warning once a call has waited :data:`SILENT_AFTER_S`,
a line when answers come again, and what waits, for the stats and the
status line. Pure Twisted, no bus: tested offline.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

__all__ = ["SILENT_AFTER_S", "Silence", "UnansweredCalls", "calls_waiting"]

log = Logger()

#: How long a call may wait for its answer before the manager is said to
#: be silent: sd-bus's default method timeout, after which ``systemctl``
#: and ``systemd-run`` give up ("Connection timed out").
SILENT_AFTER_S = 25.0


@dataclass(frozen=True)
class Silence:
    """The oldest call awaiting an answer: its ``member``
    (``StartTransientUnit``), how many ``seconds`` it has waited, and how
    many calls are ``waiting`` with it (sent, not yet answered)."""

    member: str
    seconds: float
    waiting: int

    def describe(self) -> str:
        """``systemd has not answered StopUnit for 42 s (3 calls waiting)``."""
        others = "" if self.waiting == 1 else f" ({self.waiting} calls waiting)"
        return (
            f"systemd has not answered {self.member} for {self.seconds:.0f} s{others}"
        )


def calls_waiting(unanswered: int, queued: int, oldest: Silence | None) -> dict:
    """The stats' account of the calls: ``unanswered`` (sent), ``queued``
    (waiting for a slot of the window), and the ``oldest`` unanswered
    one's ``call`` and ``seconds`` (``None`` if none)."""
    return {
        "unanswered": unanswered,
        "queued": queued,
        "oldest": None
        if oldest is None
        else {"call": oldest.member, "seconds": round(oldest.seconds, 3)},
    }


class UnansweredCalls:
    """The calls sent and not answered yet, oldest first: :meth:`sent`
    when one goes out, :meth:`answered` when its reply (or its failure)
    comes."""

    def __init__(self, clock: IReactorTime, after_s: float = SILENT_AFTER_S) -> None:
        self._clock = clock
        self._after_s = after_s
        self._ids = itertools.count()
        #: id → (member, when sent); insertion order is sending order.
        self._calls: dict[int, tuple[str, float]] = {}
        self._timer: IDelayedCall | None = None
        #: A warning was logged and no answer has ended it yet.
        self._silent = False

    def __len__(self) -> int:
        return len(self._calls)

    def sent(self, member: str) -> int:
        """A call went out; the token :meth:`answered` takes."""
        token = next(self._ids)
        self._calls[token] = (member, self._clock.seconds())
        if self._timer is None:
            self._arm(self._after_s)
        return token

    def answered(self, token: int) -> None:
        """A call's reply, error or loss came."""
        member, when = self._calls.pop(token)
        # A timer armed stays (it finds nothing, or the next oldest): not
        # one armed and cancelled per call, on the path of every unit.
        if not self._silent:
            return
        oldest = self.oldest()
        if oldest is None or oldest.seconds < self._after_s:
            self._silent = False
            log.info(
                "systemd answers again ({member} after {seconds:.0f} s)",
                member=member,
                seconds=self._clock.seconds() - when,
            )
            if oldest is not None:
                self._arm(self._after_s - oldest.seconds)

    def oldest(self) -> Silence | None:
        """The oldest call waiting, or ``None`` when none is."""
        if not self._calls:
            return None
        member, when = next(iter(self._calls.values()))
        return Silence(member, self._clock.seconds() - when, len(self._calls))

    def silence(self) -> Silence | None:
        """The oldest call, once it has waited :data:`SILENT_AFTER_S`."""
        oldest = self.oldest()
        if oldest is None or oldest.seconds < self._after_s:
            return None
        return oldest

    def stop(self) -> None:
        """No timer left behind (the client is closed)."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _arm(self, delay: float) -> None:
        self.stop()  # one timer at most: the oldest call's
        self._timer = self._clock.callLater(delay, self._check)

    def _check(self) -> None:
        self._timer = None
        oldest = self.oldest()
        if oldest is None:
            return
        if oldest.seconds < self._after_s:  # the one it was armed for answered
            self._arm(self._after_s - oldest.seconds)
        elif not self._silent:
            self._silent = True
            log.warn(
                "{silence}: the manager may be wedged (`systemctl status`,"
                " its journal); starts, kills and stops wait for it",
                silence=oldest.describe(),
            )
