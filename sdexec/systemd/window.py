"""A bounded window of calls to the manager: at most ``limit`` in flight,
the rest queued, each in its lane.

A burst (a client with 2000 processes leaves, the service stops, a mass
kill) would otherwise put thousands of calls on the bus at once: the
socket's send buffer fills, and the dbus-daemon of a system bus refuses a
connection more than ``max_replies_per_connection`` (128) pending replies.
Through the window every call still happens; only its start waits.

The queue is one per lane (the server's: one per uid whose units the
calls are for, and one for the service's own calls), served round robin:
a free slot goes to the next lane in turn, and in a lane the calls go in
the order they were asked for. One lane was one queue for every user, and
a user of ``allow-users`` with 496 starts queued held the owner's (the
resource manager's) next start behind all 496; now behind at most one call
of each other lane with calls waiting. A unit's calls stay in the lane its
first queued call took while any of them waits, whatever lane the caller
names later: a stop never overtakes its unit's start. Pure Twisted, no
bus: tested offline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

__all__ = ["DEFAULT_MAX_INFLIGHT", "SERVICE_LANE", "CallWindow", "CallWithdrawn"]

#: D-Bus calls to the manager in flight at once (``[systemd] max-inflight``):
#: well below the 128 pending replies a system bus allows a connection.
DEFAULT_MAX_INFLIGHT = 64

#: The lane of calls made for no user's unit: leftovers, listings, and
#: every call where the caller names no lane.
SERVICE_LANE = "service"


class CallWithdrawn(Exception):
    """Raised by a call's start as its turn comes: its caller no longer
    wants it made (a reload took its user out of ``allow-users`` while it
    waited). It is never made: its Deferred fails with this, and it takes
    no slot, nor counts as answered (no sign of the manager's life)."""


Start = Callable[[], "Deferred[Any]"]
#: A call waiting: how to start it, its caller's Deferred, its unit if any.
_Queued = tuple[Start, "Deferred[Any]", "str | None"]


class CallWindow:
    """Admission of calls, lanes in turn: :meth:`submit` returns at once
    with a Deferred for the call's result; the call itself starts when
    fewer than :attr:`limit` others are in flight and its lane's turn has
    come."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.in_flight = 0
        #: Calls answered (or failed) so far: a sign of life of the manager.
        self.completed = 0
        self._admitting = False  # calls that answer at once must not recurse
        #: The lanes with calls waiting, the next to be served first.
        self._lanes: dict[Hashable, deque[_Queued]] = {}
        #: The lane, and how many of its calls wait, of each unit with any.
        self._units: dict[str, tuple[Hashable, int]] = {}

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
        return sum(map(len, self._lanes.values()))  # lanes: the uids waiting

    def queued_in(self, lane: Hashable) -> int:
        """Calls of ``lane`` waiting for a slot."""
        return len(self._lanes.get(lane, ()))

    def submit(
        self,
        start: Start,
        lane: Hashable = SERVICE_LANE,
        unit: str | None = None,
    ) -> Deferred[Any]:
        """Run ``start()`` (which returns the call's Deferred) as soon as a
        slot is free and ``lane``'s turn has come; the returned Deferred
        fires with its outcome. ``unit``: the unit the call is for, whose
        calls must start in the order they were asked for: while one of
        them waits, the others queue behind it in its lane."""
        result: Deferred[Any] = Deferred()
        if unit is not None:
            lane = self._unit_lane(unit, lane)
        self._lanes.setdefault(lane, deque()).append((start, result, unit))
        self._admit()
        return result

    def fail_queued(self, failure: Failure) -> None:
        """Fail every call not started yet (the connection is gone: they
        could only go to a new one, which the callers did not ask for)."""
        lanes, self._lanes = self._lanes, {}
        self._units.clear()
        for queue in lanes.values():
            for _start, result, _unit in queue:
                result.errback(failure)

    def _unit_lane(self, unit: str, lane: Hashable) -> Hashable:
        """The lane of ``unit``'s calls: that of those waiting, if any."""
        lane, waiting = self._units.get(unit, (lane, 0))
        self._units[unit] = (lane, waiting + 1)
        return lane

    def _admit(self) -> None:
        if self._admitting:
            return  # the loop below, further up the stack, goes on
        self._admitting = True
        try:
            while self._lanes and self.in_flight < self.limit:
                start, result, _unit = self._next()
                call = self._start(start)
                if isinstance(call, Failure):
                    result.errback(call)  # withdrawn or failed: the next one goes
                    continue
                self.in_flight += 1
                call.addBoth(self._finished, result)
        finally:
            self._admitting = False

    def _next(self) -> _Queued:
        """The first call of the lane whose turn it is; the lane, if it has
        more, goes to the back of the turns."""
        lane, queue = next(iter(self._lanes.items()))
        call = queue.popleft()
        del self._lanes[lane]
        if queue:
            self._lanes[lane] = queue
        unit = call[2]
        if unit is not None:
            self._unit_started(unit)
        return call

    def _unit_started(self, unit: str) -> None:
        lane, waiting = self._units[unit]
        if waiting > 1:
            self._units[unit] = (lane, waiting - 1)
        else:
            del self._units[unit]

    @staticmethod
    def _start(start: Start) -> Deferred[Any] | Failure:
        """The call made, or why it was not: its start withdrew it
        (:class:`CallWithdrawn`) or failed. Either way it never reached
        the bus: it takes no slot, nor counts as answered (a shutdown
        waits on as long as answers come, docs/operating.md)."""
        try:
            return start()
        except Exception:
            return Failure()

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
