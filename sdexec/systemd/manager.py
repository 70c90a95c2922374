"""The surface of the systemd manager the service uses, as a Protocol.

:class:`~sdexec.systemd.bus.SystemdClient` implements it over D-Bus;
:class:`sdexec.testing.FakeManager` implements it in memory. Code above the
systemd layer types its manager as :class:`Manager`, never as the client.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

from twisted.internet.defer import Deferred

from sdexec.property import UnitProperty
from sdexec.systemd.unanswered import Silence

__all__ = ["Manager", "Watch"]


class Watch(Protocol):
    """A unit's followed state (see :class:`~sdexec.systemd.watch.UnitWatch`)."""

    state: dict[str, Any]

    def refresh(self) -> Deferred[dict[str, Any]]:
        """Fetch every property of the unit (after systemd was away), merge
        and deliver; fires with the merged state."""
        ...

    def cancel(self) -> None:
        """Stop following the unit."""
        ...


class Manager(Protocol):
    """What the server and its processes ask of systemd.

    Every call's Deferred fails with
    :class:`~sdexec.systemd.errors.SystemdError` (its ``errno`` set) when
    systemd refuses it, and at once with ``EAGAIN`` while the manager is
    unreachable (``connected`` false).
    """

    debug: bool
    #: Method calls awaiting a reply at once (``[systemd] max-inflight``).
    max_inflight: int
    #: ``lane_of(unit)``: whose turn a call for ``unit`` waits for in the
    #: window of calls (sdexec/systemd/window.py): the server's, one lane
    #: per uid, so that one user's burst does not hold another's calls.
    lane_of: Callable[[str], Hashable]
    disconnected: Deferred[None]
    #: The manager is reachable; while not, calls fail at once with EAGAIN.
    connected: bool
    #: ``on_lost(reason)`` when systemd goes away; ``on_restored()`` when it
    #: is back (re-subscribed: every tracked unit's state should be re-read).
    on_lost: Callable[[str], None] | None
    on_restored: Callable[[], None] | None
    #: ``on_reloading()`` when the manager begins a ``daemon-reload``: it
    #: reads every unit again from its file, and a transient one of sdexec's
    #: may not read back (sdexec.process.Process.manager_reloading).
    on_reloading: Callable[[], None] | None
    #: The manager's own cgroup (its ``ControlGroup``, as
    #: ``/proc/PID/cgroup`` writes paths), read at each (re)connection:
    #: its units' cgroups are below it. ``None`` if it could not be read.
    control_group: str | None
    #: The manager's ``Version`` (``252.38-1~deb12u1``), read at each
    #: (re)connection; ``None`` if it could not be read.
    version: str | None

    @property
    def calls_answered(self) -> int:
        """Method calls answered so far (replies and errors): progress while
        a burst of calls waits its turn. Read-only (a property of both
        managers): as a plain member, mypy refused every manager, the
        documented ``SdexecServer(FakeManager(), ...)`` of a typed test
        included."""
        ...

    def watch_unit(
        self, name: str, callback: Callable[[dict[str, Any]], None]
    ) -> Watch:
        """Follow the unit's properties: ``callback(state)`` with the merged
        state after each change. Register before starting the unit, so that
        no change is missed."""
        ...

    def start_transient_unit(
        self,
        name: str,
        properties: list[UnitProperty],
        stdin_fd: int,
        stdout_fd: int,
        stderr_fd: int,
        mode: str = "fail",
        on_sent: Callable[[], None] | None = None,
    ) -> Deferred[str]:
        """``StartTransientUnit`` with the three fds as the process's stdio;
        fires with the job path once systemd has queued the start (the
        caller may close its copies of the fds then). ``on_sent()`` when
        the call leaves the window of calls for the bus (until then
        systemd knows nothing of it)."""
        ...

    def stop_unit(self, name: str, mode: str = "replace") -> Deferred[str]:
        """``StopUnit``; fires with the job path."""
        ...

    def kill_unit(self, name: str, who: str, signal: int) -> Deferred[None]:
        """``KillUnit``: ``signal`` to ``who`` (``main``, ``control``, ``all``)."""
        ...

    def reset_failed_unit(self, name: str) -> Deferred[None]:
        """``ResetFailedUnit``: forget a failed unit so it can be unloaded."""
        ...

    def list_units_by_patterns(
        self, states: list[str], patterns: list[str]
    ) -> Deferred[list[tuple]]:
        """``ListUnitsByPatterns``: the 10-field tuples of the units matching
        ``patterns`` in ``states`` (any state if empty)."""
        ...

    def get_service_properties(self, name: str) -> Deferred[dict[str, Any]]:
        """``GetAll`` of the unit's ``Service`` interface, values unwrapped."""
        ...

    def silence(self) -> Silence | None:
        """The oldest call unanswered for ``SILENT_AFTER_S`` or more (the
        manager may be wedged), else ``None``."""
        ...

    def calls_waiting(self) -> dict[str, Any]:
        """For the stats: ``unanswered`` and ``queued`` calls, and the
        ``oldest`` unanswered one's ``call`` and ``seconds`` (or ``None``)."""
        ...

    def calls_queued_in(self, lane: Hashable) -> int:
        """For the stats: the calls of ``lane`` (:attr:`lane_of`) waiting
        for a slot of the window."""
        ...

    def disconnect(self) -> None:
        """Close the connection for good; ``disconnected`` fires."""
        ...
