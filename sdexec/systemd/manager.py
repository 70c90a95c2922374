"""The surface of the systemd manager the service uses, as a Protocol.

:class:`~sdexec.systemd.bus.SystemdClient` implements it over D-Bus;
:class:`sdexec.testing.FakeManager` implements it in memory. Code above the
systemd layer types its manager as :class:`Manager`, never as the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.defer import Deferred

from sdexec.property import UnitProperty

__all__ = ["Manager", "Watch"]


class Watch(Protocol):
    """A unit's followed state (see :class:`~sdexec.systemd.watch.UnitWatch`)."""

    state: dict[str, Any]

    def refresh(self) -> Deferred[dict[str, Any]]: ...

    def cancel(self) -> None: ...


class Manager(Protocol):
    """What the server and its processes ask of systemd."""

    debug: bool
    #: Method calls awaiting a reply at once (``[systemd] max-inflight``).
    max_inflight: int
    #: Method calls answered so far (replies and errors): progress while
    #: a burst of calls waits its turn.
    calls_answered: int
    disconnected: Deferred[None]
    #: The manager is reachable; while not, calls fail at once with EAGAIN.
    connected: bool
    #: ``on_lost(reason)`` when systemd goes away; ``on_restored()`` when it
    #: is back (re-subscribed: every tracked unit's state should be re-read).
    on_lost: Callable[[str], None] | None
    on_restored: Callable[[], None] | None

    def watch_unit(
        self, name: str, callback: Callable[[dict[str, Any]], None]
    ) -> Watch: ...

    def start_transient_unit(
        self,
        name: str,
        properties: list[UnitProperty],
        stdin_fd: int,
        stdout_fd: int,
        stderr_fd: int,
        mode: str = "fail",
    ) -> Deferred[str]: ...

    def stop_unit(self, name: str, mode: str = "fail") -> Deferred[str]: ...

    def kill_unit(self, name: str, who: str, signal: int) -> Deferred[None]: ...

    def reset_failed_unit(self, name: str) -> Deferred[None]: ...

    def list_units_by_patterns(
        self, states: list[str], patterns: list[str]
    ) -> Deferred[list[tuple]]: ...
    def get_service_properties(self, name: str) -> Deferred[dict[str, Any]]: ...

    def disconnect(self) -> None: ...
