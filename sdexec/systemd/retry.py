"""Retrying with backoff: the reconnection to systemd's bus.

:class:`Backoff` calls ``attempt()`` (which returns a Deferred) until one
succeeds, waiting longer after each failure, up to a cap. Its only timer is
a ``callLater`` on the clock it is given, so tests drive it with a
``Clock``. Pure Twisted: no bus here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

__all__ = ["Backoff"]

log = Logger()

#: The first retry's delay; each failure doubles it up to :data:`MAX_DELAY`.
FIRST_DELAY = 0.1
MAX_DELAY = 5.0


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
        log.info(
            "{what}: attempt {n} failed ({error}); next in {delay:g} s",
            what=self._what,
            n=self.failures,
            error=failure.getErrorMessage(),
            delay=self._delay,
        )
        self._timer = self._clock.callLater(self._delay, self._try)
        self._delay = min(self._delay * 2, self._max_delay)
