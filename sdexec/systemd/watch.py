"""A unit's merged property state, followed change by change.

Pure logic, no bus: the bus client (:class:`~sdexec.systemd.bus.SystemdClient`)
and the fake manager (:mod:`sdexec.testing`) both feed a :class:`UnitWatch`
through a :class:`WatchRegistry` with already-unwrapped values, so both run
the same merge rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

__all__ = ["UnitWatch", "WatchRegistry"]

State = dict[str, Any]

#: What sdexec reads of a unit's state (its status, the fence check, the
#: receipt, a lost unit's cgroup) besides what signals carry. A refresh's
#: ``GetAll`` of both interfaces brings some 400 properties, 53 KB of them
#: on systemd 252, that a watch held for the life of its unit: every fenced
#: job, and every unit after systemd came back. Only these of its answer
#: are kept (its caller gets the whole of it).
FOLLOWED = frozenset(
    {
        "ActiveState",
        "SubState",
        "LoadState",
        "Result",
        "Job",
        "InvocationID",
        "ConditionResult",
        "ConditionTimestampMonotonic",
        "AssertResult",
        "AssertTimestampMonotonic",
        "MainPID",
        "ExecMainPID",
        "ExecMainCode",
        "ExecMainStatus",
        "ExecMainStartTimestampMonotonic",
        "ExecMainExitTimestampMonotonic",
        "StateChangeTimestampMonotonic",
        "ControlGroup",
        "Slice",
        "MemoryMax",
        "CPUUsageNSec",
        "MemoryPeak",
        "IOReadBytes",
        "IOWriteBytes",
    }
)


class WatchRegistry:
    """The current watch of each unit object path."""

    def __init__(self) -> None:
        self._watches: dict[str, UnitWatch] = {}

    def register(self, watch: UnitWatch) -> None:
        """Follow ``watch.path`` with ``watch``; a unit has one watch at a
        time (a second one would silence the first)."""
        current = self._watches.get(watch.path)
        if current is not None and current is not watch:
            raise ValueError(f"unit {watch.unit_name} is already watched")
        self._watches[watch.path] = watch

    def unregister(self, watch: UnitWatch) -> None:
        """Stop following ``watch`` (not one that replaced it)."""
        if self._watches.get(watch.path) is watch:
            del self._watches[watch.path]

    def is_current(self, watch: UnitWatch) -> bool:
        """Whether ``watch`` is the one following its unit."""
        return self._watches.get(watch.path) is watch

    def follows(self, path: str) -> bool:
        """Whether a watch follows the unit at object path ``path``."""
        return path in self._watches

    def changed(self, path: str, changed: State, invalidated: list[str]) -> None:
        """A ``PropertiesChanged`` for ``path``, values unwrapped."""
        watch = self._watches.get(path)
        if watch is not None:
            watch.changed(changed, invalidated)


class UnitWatch:
    """The merged ``Unit`` + ``Service`` property state of one unit.

    ``callback(state)`` is called with the whole merged dict after every change
    (a ``PropertiesChanged`` signal or a :meth:`refresh`). Properties systemd
    only *invalidates* are dropped from the state, not fetched: systemd
    invalidates ``ExecStart*``, ``Conditions`` and ``Asserts`` with every
    change of a service, while the state properties (``ActiveState``,
    ``SubState``, ``ExecMain*``, ``Result``) always come with their values.
    Call :meth:`refresh` to read every property: its answer goes to its
    caller whole, and the watch keeps of it what it follows (:data:`FOLLOWED`
    and what signals carry).

    A refresh's answer never rolls back what a signal said after the refresh
    was asked for: it is two ``GetAll`` calls, and a signal that arrives
    between their answers is newer than the first (seen: a fence check's
    refresh brought back *activating* after the signal of *active/exited*,
    and nothing stopped the unit, whose state no later signal corrected).
    """

    def __init__(
        self,
        registry: WatchRegistry,
        unit_name: str,
        path: str,
        callback: Callable[[State], None],
        fetch_all: Callable[[], Deferred[State]],
    ) -> None:
        self.unit_name = unit_name
        self.path = path
        self.state: State = {}
        self._registry = registry
        self._callback = callback
        self._fetch_all = fetch_all
        #: Per refresh in flight, the properties signals have set since.
        self._signalled: list[set[str]] = []

    def refresh(self) -> Deferred[State]:
        """Fetch every property of the unit, merge what is followed and
        deliver; fires with every property (what signals said since the
        fetch was asked for outweighs its answer)."""
        signalled: set[str] = set()
        self._signalled.append(signalled)
        return self._fetch_all().addBoth(self._refreshed, signalled)

    def cancel(self) -> None:
        """Stop delivering changes; the unit may be watched anew."""
        self._registry.unregister(self)

    def changed(self, changed: State, invalidated: list[str]) -> None:
        """Merge one change: drop ``invalidated``, update with ``changed``."""
        # Fetching invalidated properties would cost two GetAll calls per
        # signal (systemd invalidates some with every change) and fail, as an
        # unhandled error, once the unit is unloaded.
        for name in invalidated:
            self.state.pop(name, None)
        self.state.update(changed)
        for signalled in self._signalled:
            signalled.update(changed)
        self._deliver()

    def _refreshed(self, properties: State | Failure, signalled: set[str]) -> Any:
        self._signalled.remove(signalled)
        if isinstance(properties, Failure):
            return properties
        fresh = {
            name: value for name, value in properties.items() if name not in signalled
        }
        self.state.update(
            {
                name: value
                for name, value in fresh.items()
                if name in FOLLOWED or name in self.state
            }
        )
        self._deliver()
        return {**fresh, **self.state}

    def _deliver(self) -> None:
        if self._registry.is_current(self):
            self._callback(self.state)
