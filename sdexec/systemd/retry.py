"""Retrying with backoff: the reconnection to systemd's bus, and the unit
calls systemd refused.

:class:`Backoff` calls ``attempt()`` (which returns a Deferred) until one
succeeds, waiting longer after each failure, up to a cap. Its only timer is
a ``callLater`` on the clock it is given, so tests drive it with a
``Clock``. :class:`CallBackoff` only counts: it says how long a refused
call waits before it is made again, and its caller keeps the timer. Pure
Twisted: no bus here. :func:`classify_call_failure` says which of those
rules a failed unit call meets (a process's and a leftover's alike).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sdexec.systemd.errors import (
    failure_value,
    is_connection_lost,
    is_process_gone,
    is_unit_gone,
)

__all__ = [
    "CALL_RETRY_S",
    "REMIND_FIRST_S",
    "REMIND_MAX_S",
    "Backoff",
    "CallBackoff",
    "CallFailure",
    "Reminders",
    "classify_call_failure",
]

log = Logger()

#: The first retry's delay; each failure doubles it up to :data:`MAX_DELAY`.
FIRST_DELAY = 0.1
MAX_DELAY = 5.0

#: Seconds from the first line of a condition that lasts (systemd away) to
#: its first reminder; each gap twice the last, at most :data:`REMIND_MAX_S`.
REMIND_FIRST_S = 60.0
REMIND_MAX_S = 3600.0


class Reminders:
    """When to say again that a condition lasts: it is said as it begins
    (:meth:`begin`), again once :data:`REMIND_FIRST_S` have passed
    (:meth:`due`), then after twice the last gap, at most
    :data:`REMIND_MAX_S`. A retry every 5 s that logged each time put two
    lines in the journal every 5 s for as long as systemd was away. Read on
    ``clock``; what asks (an attempt) runs on its own timer."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._since: float | None = None
        self._next = 0.0
        self._gap = REMIND_FIRST_S

    def begin(self) -> None:
        """The condition begins, and is said now (no-op while it lasts)."""
        if self._since is not None:
            return
        self._since = self._clock.seconds()
        self._gap = REMIND_FIRST_S
        self._next = self._since + self._gap

    def lasted(self) -> float:
        """Seconds since it began (0 if it has not)."""
        return 0.0 if self._since is None else self._clock.seconds() - self._since

    def due(self) -> bool:
        """Whether a reminder is due now; if so, the next is scheduled."""
        now = self._clock.seconds()
        if self._since is None or now < self._next:
            return False
        self._gap = min(self._gap * 2, REMIND_MAX_S)
        self._next = now + self._gap
        return True

    def end(self) -> float | None:
        """The condition is over: how long it lasted (``None``: it had not
        begun)."""
        lasted = None if self._since is None else self.lasted()
        self._since = None
        return lasted


class Backoff:
    """Retry ``attempt`` with exponential backoff until it succeeds or
    :meth:`stop` is called. ``what`` names it in the log."""

    def __init__(
        self,
        clock: IReactorTime,
        attempt: Callable[[], Deferred[Any]],
        what: str,
        first_delay: float = FIRST_DELAY,
        max_delay: float = MAX_DELAY,
    ) -> None:
        self._clock = clock
        self._attempt = attempt
        self._what = what
        self._first_delay = first_delay
        self._max_delay = max_delay
        self._delay = first_delay
        self._timer: IDelayedCall | None = None
        self._running = False
        #: Failed attempts since :meth:`start`.
        self.failures = 0
        #: The first failure is logged, then a reminder now and then.
        self._reminders = Reminders(clock)

    @property
    def running(self) -> bool:
        """Between :meth:`start` and a success or :meth:`stop`."""
        return self._running

    def start(self) -> None:
        """Try now (and again after each failure); no-op while running."""
        if self._running:
            return
        self._running = True
        self._delay = self._first_delay
        self.failures = 0
        self._reminders.end()
        self._try()

    def stop(self) -> None:
        """No more attempts (one in progress is left to finish unheard)."""
        self._running = False
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _try(self) -> None:
        self._timer = None
        if not self._running:
            return
        self._attempt().addCallbacks(self._succeeded, self._failed)

    def _succeeded(self, _: object) -> None:
        self._running = False

    def _failed(self, failure: Failure) -> None:
        if not self._running:
            return
        self.failures += 1
        self._log_failure(failure)
        self._timer = self._clock.callLater(self._delay, self._try)
        self._delay = min(self._delay * 2, self._max_delay)

    def _log_failure(self, failure: Failure) -> None:
        """The first failure, then a reminder as :class:`Reminders` says
        (the attempts go on meanwhile)."""
        if self.failures == 1:
            self._reminders.begin()
            text = "{what}: attempt {n} failed ({error}); next in {delay:g} s"
        elif self._reminders.due():
            text = (
                "{what}: attempt {n} failed ({error}), failing for {lasted:.0f} s;"
                " next in {delay:g} s, retrying every {most:g} s at most"
            )
        else:
            return
        log.info(
            text,
            what=self._what,
            n=self.failures,
            error=failure.getErrorMessage(),
            delay=self._delay,
            lasted=self._reminders.lasted(),
            most=self._max_delay,
        )


#: Calls a unit needs until they are made: one systemd refused for any
#: other reason than a lost connection or a unit gone (LimitsExceeded of a
#: busy bus, say) is made again, this long after, doubling to the last
#: (nothing else would: the unit lingers, its process tabled, its name
#: taken).
CALL_RETRY_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)


class CallBackoff:
    """How long to wait before a refused call is made again: the next of
    :data:`CALL_RETRY_S` at each refusal, from the first again after
    :meth:`reset` (a call that went through)."""

    def __init__(self) -> None:
        self._refusals = 0

    def next_delay(self) -> float:
        """The wait before the call just refused is made again (counts the
        refusal)."""
        delay = CALL_RETRY_S[min(self._refusals, len(CALL_RETRY_S) - 1)]
        self._refusals += 1
        return delay

    def reset(self) -> None:
        """A call went through: the next refusal waits the shortest again."""
        self._refusals = 0


class CallFailure(enum.Enum):
    """What becomes of a unit call that failed (:func:`classify_call_failure`)."""

    #: Lost with the connection to systemd: made again once it is back.
    AGAIN_ON_RECONNECT = "again on reconnect"
    #: Its unit was unloaded first: nothing is left to do (the unit's watch
    #: sees it go).
    MOOT = "moot"
    #: Refused (a busy bus's ``LimitsExceeded``, say): made again after the
    #: next :class:`CallBackoff` delay.
    RETRY_LATER = "retry later"
    #: Refused, and not made again: only logged.
    GIVEN_UP = "given up"


def classify_call_failure(
    failure: Failure, retried: bool, moot_once_gone: bool = True
) -> CallFailure:
    """What becomes of a unit call that failed with ``failure``.
    ``retried``: the call is one made again when refused (a stop or a reset
    still needed: nothing else would make it); ``moot_once_gone``: a unit
    unloaded meanwhile leaves it nothing to do, and so do processes gone
    (a kill's ``NoSuchProcess``: a kill of all of them came first)."""
    error = failure_value(failure)
    if is_connection_lost(error):
        return CallFailure.AGAIN_ON_RECONNECT
    if moot_once_gone and (is_unit_gone(error) or is_process_gone(error)):
        return CallFailure.MOOT
    return CallFailure.RETRY_LATER if retried else CallFailure.GIVEN_UP
