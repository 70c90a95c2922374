"""An in-memory systemd manager for offline tests, shared by site code and
sdexec's own tests.

:class:`FakeManager` implements :class:`sdexec.systemd.Manager`. It keeps
each unit's properties as systemd would report them and follows them with
the real :class:`~sdexec.systemd.watch.UnitWatch` (so the merge rules under
test are production's), records every call, and answers at once. A test
drives a unit's life by :meth:`FakeManager.change`, or with the shortcuts
:meth:`~FakeManager.run`, :meth:`~FakeManager.exit` and
:meth:`~FakeManager.deactivate`. The fds a start passes are duplicated and
kept as the "process's" ends (:meth:`FakeManager.process_fd`) until the unit
is stopped, as systemd keeps its copies.

Nothing here talks to D-Bus; for the real manager see
``test/conftest.py``'s fixtures.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet import defer

from sdexec.config import Config, default_config
from sdexec.containment import Containment
from sdexec.plan import ExecPlan, plan_exec
from sdexec.property import UnitProperty
from sdexec.protocol import ExecFlag
from sdexec.systemd.bus import unit_object_path
from sdexec.systemd.errors import SystemdError, connection_lost, reconnecting
from sdexec.systemd.unanswered import Silence, calls_waiting
from sdexec.systemd.watch import UnitWatch, WatchRegistry
from sdexec.systemd.window import DEFAULT_MAX_INFLIGHT

__all__ = [
    "DEACTIVATING",
    "EXITED",
    "INACTIVE",
    "RUNNING",
    "FakeManager",
    "exec_plan",
]

State = dict[str, Any]

#: Property snapshots of a ``Type=exec`` unit's life, as systemd reports them.
RUNNING: State = {"ActiveState": "active", "SubState": "running", "ExecMainPID": 4242}
EXITED: State = {
    **RUNNING,
    "SubState": "exited",
    "ExecMainCode": 1,
    "ExecMainStatus": 0,
}
DEACTIVATING: State = {
    **EXITED,
    "ActiveState": "deactivating",
    "SubState": "stop-sigterm",
}
INACTIVE: State = {**EXITED, "ActiveState": "inactive", "SubState": "dead"}


class FakeManager:
    """A systemd manager in memory (see the module's docstring).

    ``refuse_start``: a :class:`SystemdError` every start fails with.
    ``hold_refresh``: ``GetAll`` answers wait until :meth:`answer_refreshes`.
    ``stop_to_inactive``: a ``StopUnit`` makes the unit inactive (and
    releases its fds) at once, as it does for a unit with no processes left.
    """

    def __init__(self) -> None:
        self.debug = False
        self.max_inflight = DEFAULT_MAX_INFLIGHT  # answers at once: never full
        self.connected = True
        #: As a user manager's would read; no real process is below it.
        self.control_group: str | None = "/user.slice/user-0.slice/fake@0.service"
        self.version: str | None = "252.38-1~deb12u1"
        self.on_lost: Callable[[str], None] | None = None
        self.on_restored: Callable[[], None] | None = None
        self.on_reloading: Callable[[], None] | None = None
        self.disconnected: defer.Deferred[None] = defer.Deferred()
        self.calls: list[tuple[Any, ...]] = []
        #: ``(unit, signal)`` of every ``KillUnit``, in order.
        self.signalled: list[tuple[str, int]] = []
        self.units: dict[str, State] = {}
        self.properties: dict[str, list[UnitProperty]] = {}
        self.refuse_start: SystemdError | None = None
        self.hold_refresh = False
        self.stop_to_inactive = False
        #: What :meth:`silence` says: a test's silent manager.
        self.silent: Silence | None = None
        self._held: list[tuple[str, defer.Deferred[State]]] = []
        self._fds: dict[str, list[int]] = {}
        self._watches = WatchRegistry()

    # -- the Manager protocol -------------------------------------------------

    @property
    def calls_answered(self) -> int:
        """Every call is answered at once (GetAll when held: once let go)."""
        return len(self.calls) - len(self._held)

    def silence(self) -> Silence | None:
        return self.silent

    def calls_waiting(self) -> dict[str, Any]:
        """Only held ``GetAll`` answers wait (the silence is :attr:`silent`)."""
        return calls_waiting(len(self._held), 0, self.silent)

    def watch_unit(self, name: str, callback: Callable[[State], None]) -> UnitWatch:
        path = unit_object_path(name)
        watch = UnitWatch(
            self._watches, name, path, callback, lambda: self._get_all(name)
        )
        self._watches.register(watch)
        return watch

    def start_transient_unit(
        self,
        name: str,
        properties: list[UnitProperty],
        stdin_fd: int,
        stdout_fd: int,
        stderr_fd: int,
        mode: str = "fail",
        on_sent: Callable[[], None] | None = None,
    ) -> defer.Deferred[str]:
        self.calls.append(("start", name))
        if not self.connected:
            return defer.fail(reconnecting())
        if on_sent is not None:
            on_sent()  # no window here: sent at once
        if self.refuse_start is not None:
            return defer.fail(self.refuse_start)
        self.properties[name] = list(properties)
        self._fds[name] = [os.dup(fd) for fd in (stdin_fd, stdout_fd, stderr_fd)]
        self.units.setdefault(name, {})
        return defer.succeed(f"/org/freedesktop/systemd1/job/{len(self.calls)}")

    def stop_unit(self, name: str, mode: str = "replace") -> defer.Deferred[str]:
        self.calls.append(("stop", name))
        if not self.connected:
            return defer.fail(reconnecting())
        if self.stop_to_inactive:
            self.release(name)
            self.change(name, {"ActiveState": "inactive", "SubState": "dead"})
        return defer.succeed("/org/freedesktop/systemd1/job/stop")

    def kill_unit(self, name: str, who: str, signal: int) -> defer.Deferred[None]:
        self.calls.append(("kill", who, signal))
        self.signalled.append((name, signal))
        if not self.connected:
            return defer.fail(reconnecting())
        return defer.succeed(None)

    def reset_failed_unit(self, name: str) -> defer.Deferred[None]:
        self.calls.append(("reset", name))
        if not self.connected:
            return defer.fail(reconnecting())
        return defer.succeed(None)

    def list_units_by_patterns(
        self, states: list[str], patterns: list[str]
    ) -> defer.Deferred[list[tuple]]:
        """Every unit (``patterns`` are not matched: a test's units are all
        services), in systemd's 10-field form."""
        self.calls.append(("list", tuple(patterns)))
        if not self.connected:
            return defer.fail(reconnecting())
        return defer.succeed([self._listed(name) for name in self.units])

    def _listed(self, name: str) -> tuple:
        state = self.units[name]
        description = next(
            (p.value for p in self.properties.get(name, []) if p.name == "Description"),
            "",
        )
        job_id, job_path = state.get("Job", (0, "/"))  # the Unit's Job property
        return (
            name, description, state.get("LoadState", "loaded"),
            state.get("ActiveState", ""), state.get("SubState", ""), "",
            unit_object_path(name), job_id, "start" if job_id else "", job_path,
        )  # fmt: skip

    def get_service_properties(self, name: str) -> defer.Deferred[State]:
        """The unit's state (a ``GetAll``: held too with ``hold_refresh``)."""
        return self._get_all(name)

    def disconnect(self) -> None:
        self.calls.append(("disconnect",))
        if not self.disconnected.called:
            self.disconnected.callback(None)

    # -- losing the manager ---------------------------------------------------

    def lose(self, reason: str = "the D-Bus connection closed") -> None:
        """systemd goes away: calls fail with EAGAIN until :meth:`restore`,
        held ``GetAll`` answers with the connection, as calls in flight do."""
        self.connected = False
        held, self._held = self._held, []
        for _name, answer in held:
            answer.errback(connection_lost(reason))
        if self.on_lost is not None:
            self.on_lost(reason)

    def restore(self) -> None:
        """systemd is back (units keep the state :meth:`change` gave them)."""
        self.connected = True
        if self.on_restored is not None:
            self.on_restored()

    # -- driving a unit -------------------------------------------------------

    def change(
        self, name: str, changed: State, invalidated: Sequence[str] = ()
    ) -> None:
        """A ``PropertiesChanged`` of the unit: its state is updated and the
        watch told."""
        state = self.units.setdefault(name, {})
        for key in invalidated:
            state.pop(key, None)
        state.update(changed)
        self._watches.changed(unit_object_path(name), dict(changed), list(invalidated))

    def run(self, name: str, pid: int = 4242) -> None:
        """The command runs."""
        self.change(name, {**RUNNING, "ExecMainPID": pid})

    def exit(self, name: str, status: int = 0) -> None:
        """The command exits with ``status``; the unit stays active (exited)."""
        self.change(name, {**EXITED, "ExecMainStatus": status})

    def deactivate(self, name: str) -> None:
        """The unit is stopping, with processes left."""
        self.change(name, {"ActiveState": "deactivating", "SubState": "stop-sigterm"})

    def reload(self) -> None:
        """A ``daemon-reload`` begins (the ``Reloading`` signal)."""
        if self.on_reloading is not None:
            self.on_reloading()

    def release(self, name: str) -> None:
        """Close the process's ends of its fds (the unit's processes are gone)."""
        for fd in self._fds.pop(name, []):
            os.close(fd)

    def process_fd(self, name: str, stream: str) -> int:
        """The process's end of ``stdin``, ``stdout`` or ``stderr``."""
        return self._fds[name][("stdin", "stdout", "stderr").index(stream)]

    def answer_refreshes(self) -> None:
        """Answer the held ``GetAll`` calls with the units' current state."""
        held, self._held = self._held, []
        for name, answer in held:
            answer.callback(dict(self.units.get(name, {})))

    def kills(self) -> list[int]:
        """The signals sent so far, in order."""
        return [call[2] for call in self.calls if call[0] == "kill"]

    def close(self) -> None:
        """Release every unit's fds (end of a test)."""
        for name in list(self._fds):
            self.release(name)

    def _get_all(self, name: str) -> defer.Deferred[State]:
        self.calls.append(("get-all", name))
        if not self.connected:
            return defer.fail(reconnecting())
        if self.hold_refresh:
            answer: defer.Deferred[State] = defer.Deferred()
            self._held.append((name, answer))
            return answer
        return defer.succeed(dict(self.units.get(name, {})))


def exec_plan(
    cmdline: Sequence[str] = ("/bin/true",),
    flags: int = ExecFlag.STDOUT | ExecFlag.STDERR,
    config: Config | None = None,
    **opts: str,
) -> ExecPlan:
    """The plan the service makes for a request (through the real
    :func:`~sdexec.plan.plan_exec`), with the default configuration unless
    one is given. The unit is named ``sdexec-test.service`` unless
    ``SDEXEC_NAME`` says otherwise."""
    config = config or default_config()
    payload = {
        "flags": int(flags),
        "cmd": {
            "cmdline": list(cmdline),
            "opts": {"SDEXEC_NAME": "sdexec-test", **opts},
        },
    }
    return plan_exec(payload, config, Containment(config, None))
