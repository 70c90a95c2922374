"""A bus that stalls while the manager serves a start, against a sandbox
manager of the test's own (its dbus-daemon and the manager are stopped).

systemd serves a ``StartTransientUnit`` with calls of its own to the bus
(the caller's credentials, then the tracking of the job's caller, after it
queued the job), each with sd-bus's 25 s timeout. A bus stalled past that
has systemd answer ``org.freedesktop.DBus.Error.Timeout`` ("Connection
timed out"), and where the timed-out call was the tracking one the unit
runs all the same (seen under a burst: the unit was found as a leftover).
A client was told EREMOTEIO, "Connection timed out", a refusal."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from pathlib import Path

import pytest
from pytest_twisted import ensureDeferred
from support import RunningService, run, unit_names, until
from test_reconnect import dbus_daemon_pid
from twisted.internet.defer import Deferred

pytestmark = pytest.mark.systemd

NAME = "sdexec-stalled-start"


def _blocked_in(pid: int) -> str | None:
    """The number of the system call ``pid`` sleeps in, ``None`` while it
    runs (``/proc/PID/syscall``)."""
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    call = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    return call if state in ("S", "D") and call != "running" else None


async def _idle_wait(pid: int) -> str:
    """The system call the idle manager ``pid`` waits in: its event loop's."""
    seen: list[str] = []

    def blocked() -> bool:
        call = _blocked_in(pid)
        seen.extend([call] if call is not None else [])
        return bool(seen)

    await until(blocked, "the manager idle")
    return seen[0]


async def _bus_round_trip(systemd) -> None:
    """A call to the bus daemon itself on the service's connection: the bus
    reads a connection's messages in order, and hands each to its
    destination's socket before it reads the next, so once this is
    answered every call sent before it has reached the manager's socket."""
    bus_daemon = ("org.freedesktop.DBus", "/org/freedesktop/DBus")
    ask = systemd._call(*bus_daemon, bus_daemon[0], "GetId", "", [])
    await Deferred.fromFuture(asyncio.ensure_future(ask))


@ensureDeferred
async def test_a_start_systemd_answers_with_its_bus_timeout_may_have_run(
    private_manager, tmp_path
):
    runtime_dir, _killed = private_manager
    manager = int(Path(runtime_dir, "manager.pid").read_text())
    service = await RunningService(tmp_path).start()
    bus = dbus_daemon_pid()
    stopped: list[int] = []
    try:
        client = await service.connect()
        systemd = service.server.systemd
        idle = await _idle_wait(manager)
        os.kill(manager, signal.SIGSTOP)
        stopped.append(manager)
        ran = Deferred.fromCoroutine(
            run(client, ["sleep", "300"], opts={"SDEXEC_NAME": NAME})
        )
        await until(lambda: systemd.calls_waiting()["unanswered"] == 1, "start sent")
        await _bus_round_trip(systemd)
        os.kill(bus, signal.SIGSTOP)
        stopped.append(bus)
        os.kill(manager, signal.SIGCONT)
        stopped.remove(manager)
        # In a call of its own to the stalled bus, then back in its event
        # loop once that call has timed out (sd-bus's 25 s).
        await until(
            lambda: _blocked_in(manager) not in (None, idle), "the manager waits"
        )
        await until(lambda: _blocked_in(manager) == idle, "its call timed out")
        os.kill(bus, signal.SIGCONT)
        stopped.remove(bus)
        outcome = await ran
        assert outcome.error is not None
        assert outcome.error.errnum == errno.EAGAIN, outcome.error.errstr
        assert "may have been started" in outcome.error.errstr
        # Run or not, nothing of it is left: the service looked for it.
        leftovers = service.server.leftovers
        await until(
            lambda: not unit_names(f"{NAME}.service") and not leftovers.units,
            "no unit left",
        )
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await service.stop()


@ensureDeferred
async def test_a_start_lost_with_the_bus_in_flight_says_it_may_have_run(
    private_manager, tmp_path
):
    # The bus killed with a start sent and unanswered: the client was told
    # only "systemd connection lost: …", a refusal to read, while systemd
    # may have run it (a soak saw a passthrough command write all its
    # output so, session 52).
    runtime_dir, _killed = private_manager
    manager = int(Path(runtime_dir, "manager.pid").read_text())
    service = await RunningService(tmp_path).start()
    bus = dbus_daemon_pid()  # asked before the manager is stopped
    stopped: list[int] = []
    try:
        client = await service.connect()
        systemd = service.server.systemd
        await _idle_wait(manager)
        os.kill(manager, signal.SIGSTOP)
        stopped.append(manager)
        ran = Deferred.fromCoroutine(run(client, ["true"], opts={"SDEXEC_NAME": NAME}))
        await until(lambda: systemd.calls_waiting()["unanswered"] == 1, "start sent")
        await _bus_round_trip(systemd)  # the start is in the manager's socket
        os.kill(bus, signal.SIGKILL)
        outcome = await ran
        os.kill(manager, signal.SIGCONT)
        stopped.remove(manager)
        assert outcome.error is not None
        assert outcome.error.errnum == errno.EAGAIN, outcome.error.errstr
        assert outcome.error.errstr.startswith("systemd connection lost"), (
            outcome.error.errstr
        )
        assert "the unit may have been started" in outcome.error.errstr
        leftovers = service.server.leftovers
        await until(
            lambda: (
                systemd.connected
                and not unit_names(f"{NAME}.service")
                and not leftovers.units
            ),
            "back, and no unit left",
        )
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await service.stop()
