"""An in-memory systemd manager for offline tests, shared by site code and
sdexec's own tests.

:class:`FakeManager` implements :class:`sdexec.systemd.Manager`. It keeps
each unit's properties as systemd would report them and follows them with
the real :class:`~sdexec.systemd.watch.UnitWatch` (so the merge rules under
test are production's), records every call, and answers at once. A test
drives a unit's life by :meth:`FakeManager.change`, or with the shortcuts
:meth:`~FakeManager.run`, :meth:`~FakeManager.exit`,
:meth:`~FakeManager.end`, :meth:`~FakeManager.fail` and
:meth:`~FakeManager.deactivate`; :meth:`~FakeManager.started` gives the
units a client's requests start. The fds a start passes are duplicated and
kept as the "process's" ends (:meth:`FakeManager.process_fd`) until the unit
is stopped, as systemd keeps its copies.

docs/client.md, "Testing a program offline", is a whole test of a program
against a real server and client over it. Nothing here talks to D-Bus.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
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
from sdexec.systemd.unit import CLD_EXITED, CLD_KILLED
from sdexec.systemd.watch import UnitWatch, WatchRegistry
from sdexec.systemd.window import DEFAULT_MAX_INFLIGHT, SERVICE_LANE

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
#: What systemd's ``GetAll`` answers for a name it has no unit of (one
#: unloaded since it was listed): it loads a stub, not found, inactive.
_NOT_LOADED: State = {
    "LoadState": "not-found",
    "ActiveState": "inactive",
    "SubState": "dead",
    "InvocationID": b"",
}


class FakeManager:
    """A systemd manager in memory (see the module's docstring).

    ``refuse_start``: a :class:`SystemdError` every start fails with.
    ``hold_refresh``: ``GetAll`` answers wait until :meth:`answer_refreshes`.
    ``stop_to_inactive``: a ``StopUnit`` makes the unit inactive (and
    releases its fds) at once, as it does for a unit with no processes left.
    """

    def __init__(self, reactor: Any = None) -> None:
        #: Where :meth:`started` answers, a turn later (the global reactor
        #: unless given: a test's ``Clock`` is advanced by hand).
        self.reactor = reactor
        self.debug = False
        self.max_inflight = DEFAULT_MAX_INFLIGHT  # answers at once: never full
        self.lane_of: Callable[[str], Hashable] = lambda unit: SERVICE_LANE
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
        #: Units started that no :meth:`started` has been given yet, and the
        #: :meth:`started` calls waiting for one.
        self._unclaimed: list[str] = []
        self._claims: list[defer.Deferred[str]] = []
        self._fds: dict[str, list[int]] = {}
        self._watches = WatchRegistry()

    # -- the Manager protocol -------------------------------------------------

    @property
    def calls_answered(self) -> int:
        """Every call is answered at once (GetAll when held: once let go)."""
        return len(self.calls) - len(self._held)

    def silence(self) -> Silence | None:
        """The manager's silence: :attr:`silent`, as a test sets it."""
        return self.silent

    def calls_waiting(self) -> dict[str, Any]:
        """Only held ``GetAll`` answers wait (the silence is :attr:`silent`)."""
        return calls_waiting(len(self._held), 0, self.silent)

    def calls_queued_in(self, lane: Hashable) -> int:
        """None: no window, every call answers at once."""
        return 0

    def watch_unit(self, name: str, callback: Callable[[State], None]) -> UnitWatch:
        """Follow the unit with the real :class:`UnitWatch`: ``callback``
        sees each :meth:`change`, merged as production merges signals."""
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
        """Accept the start (or fail with :attr:`refuse_start`): keep its
        properties (:attr:`properties`) and duplicates of its fds
        (:meth:`process_fd`); the unit has no state until driven."""
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
        self._announce(name)
        return defer.succeed(f"/org/freedesktop/systemd1/job/{len(self.calls)}")

    def _announce(self, name: str) -> None:
        """Give a started unit to the oldest :meth:`started` waiting, else
        keep it for the next. Not from within this call: the service has
        not had systemd's answer yet, and a test that drove the unit at
        once would drive it before the service owns it."""
        if self._claims:
            self._reactor().callLater(0, self._give, self._claims.pop(0), name)
        else:
            self._unclaimed.append(name)

    def _give(self, claim: defer.Deferred[str], name: str) -> None:
        """``name`` to ``claim``; to the next if the test gave up on that
        one meanwhile (cancelled, it would drop the name), else kept first:
        any unit kept already was started after it."""
        if not claim.called:
            claim.callback(name)
        elif self._claims:
            self._announce(name)
        else:
            self._unclaimed.insert(0, name)

    def _withdraw(self, claim: defer.Deferred[str]) -> None:
        """A :meth:`started` the test gave up on (``addTimeout``, a race)
        is given no unit: the next start is the next call's."""
        if claim in self._claims:
            self._claims.remove(claim)

    def _reactor(self) -> Any:
        if self.reactor is None:
            from twisted.internet import reactor  # installed by now: it runs

            self.reactor = reactor
        return self.reactor

    def stop_unit(self, name: str, mode: str = "replace") -> defer.Deferred[str]:
        """Record the stop; with :attr:`stop_to_inactive` the unit ends at
        once (fds released, inactive), else it runs on until driven."""
        self.calls.append(("stop", name))
        if not self.connected:
            return defer.fail(reconnecting())
        if self.stop_to_inactive:
            self.release(name)
            self.change(name, {"ActiveState": "inactive", "SubState": "dead"})
        return defer.succeed("/org/freedesktop/systemd1/job/stop")

    def kill_unit(self, name: str, who: str, signal: int) -> defer.Deferred[None]:
        """Record the signal (:attr:`signalled`); the unit is not changed: a
        test says what the signal did (:meth:`end` with ``signal``)."""
        self.calls.append(("kill", who, signal))
        self.signalled.append((name, signal))
        if not self.connected:
            return defer.fail(reconnecting())
        return defer.succeed(None)

    def reset_failed_unit(self, name: str) -> defer.Deferred[None]:
        """Record the reset (the unit's state is left as it is)."""
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
        """Record it and fire :attr:`disconnected`."""
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

    def started(self) -> defer.Deferred[str]:
        """The name of the next unit started: a Deferred that fires once
        a ``StartTransientUnit`` comes (at once for one that came before
        and was not given to an earlier call). Each start is given once, in
        order: a client's request travels over its socket first, so a test
        waits for its unit so, not by reading :attr:`units` at once.
        Cancelled (a timeout), it is given none."""
        if self._unclaimed:
            return defer.succeed(self._unclaimed.pop(0))
        claim: defer.Deferred[str] = defer.Deferred(self._withdraw)
        self._claims.append(claim)
        return claim

    def run(self, name: str, pid: int = 4242) -> None:
        """The command runs."""
        self.change(name, {**RUNNING, "ExecMainPID": pid})

    def exit(self, name: str, status: int = 0, signal: int = 0) -> None:
        """The command exits with ``status``, or is killed by ``signal`` if
        one is given; the unit stays active (exited, as ``RemainAfterExit``
        keeps it) until it is stopped, and its fds are still held (see
        :meth:`end`)."""
        code, value = (CLD_KILLED, signal) if signal else (CLD_EXITED, status)
        self.change(name, {**EXITED, "ExecMainCode": code, "ExecMainStatus": value})

    def end(self, name: str, status: int = 0, signal: int = 0) -> None:
        """The command's whole life after it ran: it exits with ``status``
        (or is killed by ``signal``), its processes are gone (their fds
        released: the streams' EOF) and the unit is inactive. What a test
        calls after :meth:`run` (and any output written to
        :meth:`process_fd`) for the stream to end."""
        self.release(name)
        self.exit(name, status, signal)
        self.change(name, {"ActiveState": "inactive", "SubState": "dead"})

    def fail(self, name: str, status: int = 203) -> None:
        """systemd fails to run the command: the unit fails with its own
        exit code ``status`` (203/EXEC: the executable could not be run;
        200/CHDIR: the working directory could not be entered), having never
        shown it running, and its fds are released; then it is inactive,
        as systemd leaves it once the service has reset it. (A start
        systemd refuses outright is :attr:`refuse_start`.)"""
        self.release(name)
        failed = {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
        self.change(
            name, {**failed, "ExecMainCode": CLD_EXITED, "ExecMainStatus": status}
        )
        self.change(name, {"ActiveState": "inactive", "SubState": "dead"})

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
            answer.callback(self._read(name))

    def kills(self) -> list[int]:
        """The signals sent so far, in order."""
        return [call[2] for call in self.calls if call[0] == "kill"]

    def close(self) -> None:
        """Release every unit's fds, and forget the units no :meth:`started`
        was given and the calls still waiting (end of a test): a manager
        kept for the next test gives it none of this one's."""
        for name in list(self._fds):
            self.release(name)
        self._unclaimed.clear()
        self._claims.clear()

    def _get_all(self, name: str) -> defer.Deferred[State]:
        self.calls.append(("get-all", name))
        if not self.connected:
            return defer.fail(reconnecting())
        if self.hold_refresh:
            answer: defer.Deferred[State] = defer.Deferred()
            self._held.append((name, answer))
            return answer
        return defer.succeed(self._read(name))

    def _read(self, name: str) -> State:
        """A ``GetAll``'s answer: the unit's state, or systemd's for a
        name it has no unit of (a unit the test deleted from :attr:`units`
        is gone)."""
        return dict(self.units[name]) if name in self.units else dict(_NOT_LOADED)


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
