"""The systemd manager killed (SIGKILL) under a running service, and a new
one started at the same ``XDG_RUNTIME_DIR``: requests fail fast with EAGAIN
(not after the bus's 120 s activation timeout), the service drains after
``[systemd] reconnect-timeout``, and undrains itself once it reaches the new
manager.

It runs against a private sandbox manager of its own: killing the session's
shared one would break every other test. The killed manager's dbus-daemon
lives on as an orphan, still listening on the old (unlinked) socket; the new
manager listens with a new dbus-daemon at the same path. The client, on the
orphan bus, sees the manager leave and never come back, and must reconnect
to the address to reach the new one (``MANAGER_ABSENT_S`` in
sdexec/systemd/bus.py). At the end every process of both sandboxes is gone.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
from pytest_twisted import ensureDeferred
from support import (
    ConfigText,
    RunningService,
    run,
    running,
    start_manager,
    until,
)
from twisted.internet.defer import Deferred

pytestmark = pytest.mark.systemd


def kill_manager(runtime_dir: str, killed: list[int]) -> None:
    pid = int(Path(runtime_dir, "manager.pid").read_text())
    killed.append(pid)
    os.kill(pid, signal.SIGKILL)


@ensureDeferred
async def test_manager_killed_fails_fast_drains_and_recovers(private_manager, tmp_path):
    runtime_dir, killed = private_manager
    service = RunningService(tmp_path, ConfigText(systemd='reconnect-timeout = "1s"'))
    await service.start()
    try:
        client = await service.connect()
        before = await run(client, ["echo", "before"])
        assert (before.error, before.stdout) == (None, b"before\n")
        # Running when the manager dies: its exit status will never come.
        lost = Deferred.fromCoroutine(run(client, ["sh", "-c", "sleep 300; exit 7"]))
        # Its shell exits while the manager is away (once told to: a fixed
        # sleep could end first on a loaded machine), leaving a child behind
        # in the unit's cgroup.
        child_pid, go = tmp_path / "child.pid", tmp_path / "go"
        until_go = f"while [ ! -e {go} ]; do sleep 0.05; done"
        left = Deferred.fromCoroutine(
            run(client, ["sh", "-c", f"sleep 300 & echo $! >{child_pid}; {until_go}"])
        )
        await until(
            lambda: len([p for p in service.server.processes.values() if p.pid]) == 2,
            "both long ones started",
        )
        await until(child_pid.exists, "the child's pid written")

        kill_manager(runtime_dir, killed)
        go.touch()
        systemd = service.server.systemd
        await until(lambda: not systemd.connected, "the service sees systemd lost")
        refused = await run(client, ["true"])
        # Refused by the service itself, not after the bus's 120 s timeout.
        assert refused.error is not None and refused.error.errnum == errno.EAGAIN
        assert refused.error.errstr == "reconnecting to systemd"

        await until(
            lambda: service.server.drain_reason is not None, "drained after 1 s"
        )
        assert "systemd unreachable for 1 s" in service.server.drain_reason

        shell = next(
            p.pid
            for p in service.server.processes.values()
            if p.pid and f"{child_pid}" in " ".join(p.cmdline)
        )
        await until(lambda: not running(shell), "the shell that left a child exited")
        start_manager(runtime_dir)
        await until(lambda: systemd.connected, "reconnected to the new manager")
        await until(lambda: service.server.drain_reason is None, "undrained")
        after = await run(client, ["echo", "after"])
        assert (after.error, after.stdout) == (None, b"after\n")
        # The new manager made a unit of its name from the file the dead one
        # left (bad-setting, inactive): not ours. It once ended as a
        # success, ENODATA and no finished, the exit 7 lost.
        outcome = await lost
        assert outcome.error is not None
        assert outcome.error.errnum == errno.ESRCH, outcome.error.errstr
        assert outcome.error.errstr.endswith(" is gone (lost while systemd was away)")
        assert "finished" not in outcome.types
        # Its process ran on outside any unit, followed by no one: killed.
        await until(lambda: not running(outcome.pid), "the lost unit's shell killed")
        # And what a lost unit's exited shell left, found in the cgroup the
        # unit started in.
        assert (await left).error.errnum == errno.ESRCH
        child = int(child_pid.read_text())
        await until(lambda: not running(child), "the exited shell's child killed")
    finally:
        await service.stop()
    assert service.server is None or not service.server.processes
