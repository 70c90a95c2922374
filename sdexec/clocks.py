"""The service's timers on a monotonic clock, and the epoch beside it.

Twisted's reactors keep every ``callLater`` at an absolute ``time.time()``
and run it once the wall clock has passed it. A wall clock stepped (an NTP
daemon's step at the end of a boot, an admin's ``date -s``) then moves
every pending timer: an hour forward, and a cancelled job's SIGKILL
followed its SIGTERM after a second where ``kill-timeout`` gave it five,
the stop timer's signal came at once, and a job with an hour's time limit
was ended at once; an hour back, and all of them waited an hour more.
Flux's own timers (libev) are relative and monotonic.

:class:`MonotonicClock` is the ``IReactorTime`` the service gives its
server: its timers are asyncio's, on the event loop's monotonic clock.
Where a time is an epoch (an R's ``expiration``, what stats report),
:func:`wall_seconds` and :func:`as_wall` give it; for a test's ``Clock``,
whose seconds stand for both, they are its seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.error import AlreadyCalled, AlreadyCancelled
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from zope.interface import implementer

__all__ = ["MonotonicClock", "as_wall", "timers_clock", "wall_seconds"]

log = Logger()


def wall_seconds(clock: IReactorTime) -> float:
    """The epoch now, as ``clock`` has it: its ``wall_seconds()`` where its
    ``seconds()`` are not the epoch (:class:`MonotonicClock`), else its
    ``seconds()`` (a reactor, a test's ``Clock``)."""
    wall = getattr(clock, "wall_seconds", None)
    return wall() if wall is not None else clock.seconds()


def as_wall(clock: IReactorTime, at: float | None) -> float | None:
    """``clock``'s time ``at`` as the epoch, for a report (``None`` kept)."""
    return None if at is None else wall_seconds(clock) + (at - clock.seconds())


def timers_clock(reactor: Any) -> IReactorTime:
    """The clock for the service's timers: a :class:`MonotonicClock` on the
    event loop of Twisted's asyncio reactor, which the service runs on.

    Twisted names that loop only privately (``_asyncioEventloop``). A
    reactor without it, another reactor or a Twisted that renamed it, is
    refused here, at the service's start: falling back to the reactor's own
    timers would bring back, without a word, the steps of the wall clock
    that move them (the module's docstring)."""
    loop = getattr(reactor, "_asyncioEventloop", None)
    if loop is None:
        raise TypeError(
            "the service's timers need the event loop of Twisted's asyncio"
            f" reactor (its _asyncioEventloop): {type(reactor).__name__} has none"
        )
    return MonotonicClock(loop)


class EventLoop(Protocol):
    """What :class:`MonotonicClock` uses of an asyncio event loop (the
    systemd layer alone imports asyncio)."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], Any]) -> Any: ...


@implementer(IReactorTime)
class MonotonicClock:
    """``IReactorTime`` on ``loop``'s monotonic clock: ``seconds()`` is that
    clock, and no step of the wall clock moves a timer."""

    def __init__(self, loop: EventLoop) -> None:
        self._loop = loop
        self._pending: dict[_Timer, None] = {}

    def seconds(self) -> float:
        return self._loop.time()

    @staticmethod
    def wall_seconds() -> float:
        """The epoch now (:func:`wall_seconds`)."""
        return time.time()

    def callLater(
        self, delay: float, callable: Callable[..., Any], *args: Any, **kw: Any
    ) -> IDelayedCall:
        return _Timer(self, self.seconds() + delay, lambda: callable(*args, **kw))

    def getDelayedCalls(self) -> list[IDelayedCall]:
        return list(self._pending)


@implementer(IDelayedCall)
class _Timer:
    """One call of a :class:`MonotonicClock`, as Twisted's ``DelayedCall``
    behaves: an exception it raises is logged, and goes no further."""

    def __init__(
        self, clock: MonotonicClock, at: float, function: Callable[[], Any]
    ) -> None:
        self._clock = clock
        self._time = at
        self._function = function
        self.called = self.cancelled = False
        self._handle = clock._loop.call_at(at, self._run)
        clock._pending[self] = None

    # IDelayedCall's names and signatures.
    def getTime(self) -> float:
        return self._time

    def active(self) -> bool:
        return not (self.called or self.cancelled)

    def cancel(self) -> None:
        self._check_active()
        self.cancelled = True
        self._handle.cancel()
        self._clock._pending.pop(self, None)

    def delay(self, secondsLater: float) -> None:
        self._move(self._time + secondsLater)

    def reset(self, secondsFromNow: float) -> None:
        self._move(self._clock.seconds() + secondsFromNow)

    def _move(self, at: float) -> None:
        self._check_active()
        self._handle.cancel()
        self._time = at
        self._handle = self._clock._loop.call_at(at, self._run)

    def _check_active(self) -> None:
        if self.cancelled:
            raise AlreadyCancelled
        if self.called:
            raise AlreadyCalled

    def _run(self) -> None:
        self.called = True
        self._clock._pending.pop(self, None)
        try:
            self._function()
        except Exception:
            log.failure("a timer's call failed")
