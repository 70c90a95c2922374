"""A bounded window of calls to the manager: at most ``limit`` in flight,
the rest queued in order.

A burst (a client with 2000 processes leaves, the service stops, a mass
kill) would otherwise put thousands of calls on the bus at once: the
socket's send buffer fills, and the dbus-daemon of a system bus refuses a
connection more than ``max_replies_per_connection`` (128) pending replies.
Through the window every call still happens, in the order it was asked
for; only its start waits. Pure Twisted, no bus: tested offline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

__all__ = ["DEFAULT_MAX_INFLIGHT", "CallWindow"]

#: D-Bus calls to the manager in flight at once (``[systemd] max-inflight``):
#: well below the 128 pending replies a system bus allows a connection.
DEFAULT_MAX_INFLIGHT = 64

Start = Callable[[], "Deferred[Any]"]


class CallWindow:
    """FIFO admission of calls: :meth:`submit` returns at once with a
    Deferred for the call's result; the call itself starts when fewer than
    :attr:`limit` others are in flight."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.in_flight = 0
        #: Calls answered (or failed) so far: a sign of life of the manager.
        self.completed = 0
        self._admitting = False  # calls that answer at once must not recurse
        self._queue: deque[tuple[Start, Deferred[Any]]] = deque()

    @property
    def limit(self) -> int:
        """Calls in flight at most."""
        return self._limit

    @limit.setter
    def limit(self, limit: int) -> None:
        """A new limit (a reload): raised, the calls it makes room for
        start now, not when the next call is asked for or answered."""
        self._limit = limit
        self._admit()

    @property
    def queued(self) -> int:
        """Calls waiting for a slot."""
        return len(self._queue)

    def submit(self, start: Start) -> Deferred[Any]:
        """Run ``start()`` (which returns the call's Deferred) as soon as a
        slot is free; the returned Deferred fires with its outcome."""
        result: Deferred[Any] = Deferred()
        self._queue.append((start, result))
        self._admit()
        return result

    def fail_queued(self, failure: Failure) -> None:
        """Fail every call not started yet (the connection is gone: they
        could only go to a new one, which the callers did not ask for)."""
        queued, self._queue = self._queue, deque()
        for _start, result in queued:
            result.errback(failure)

    def _admit(self) -> None:
        if self._admitting:
            return  # the loop below, further up the stack, goes on
        self._admitting = True
        try:
            while self._queue and self.in_flight < self.limit:
                start, result = self._queue.popleft()
                self.in_flight += 1
                self._start(start).addBoth(self._finished, result)
        finally:
            self._admitting = False

    @staticmethod
    def _start(start: Start) -> Deferred[Any]:
        try:
            return start()
        except Exception:
            call: Deferred[Any] = Deferred()
            call.errback(Failure())
            return call

    def _finished(self, outcome: Any, result: Deferred[Any]) -> None:
        self.in_flight -= 1
        self.completed += 1
        # Admit the next call before the caller's callbacks run: they may
        # submit more, and must queue behind those already waiting.
        self._admit()
        if isinstance(outcome, Failure):
            result.errback(outcome)
        else:
            result.callback(outcome)
