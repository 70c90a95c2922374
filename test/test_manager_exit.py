"""The systemd manager exiting cleanly under a running service
(``systemctl --user exit``, a user's last session ending without linger).
It stops its units, killing a running job's processes; systemd 252 drops
its bus connection before their end is announced, so the service sees the
manager leave with the job still running. It drains after ``[systemd]
reconnect-timeout``, and once a new manager is there it undrains, finds the
job's unit gone and ends its request with ESRCH. Nothing is left running.
Against a private sandbox manager of its own."""

from __future__ import annotations

import errno
import os
import signal

import pytest
from pytest_twisted import ensureDeferred
from support import (
    SANDBOX,
    ConfigText,
    RunningService,
    run,
    running,
    start_manager,
    until,
)
from twisted.internet.defer import Deferred
from twisted.internet.utils import getProcessValue

pytestmark = pytest.mark.systemd


@ensureDeferred
async def test_a_manager_that_exits_takes_its_jobs_and_the_service_waits(
    private_manager, tmp_path
):
    runtime_dir, _ = private_manager
    service = RunningService(tmp_path, ConfigText(systemd='reconnect-timeout = "1s"'))
    await service.start()
    try:
        client = await service.connect()
        child_pid = tmp_path / "child.pid"
        job = Deferred.fromCoroutine(
            run(client, ["sh", "-c", f"sleep 300 & echo $! >{child_pid}; wait"])
        )
        await until(child_pid.exists, "the job's child started")
        child = int(child_pid.read_text())
        # The sandbox's stop: SIGTERM to the manager, which stops its units
        # and its dbus-daemon, then exits; the service serving meanwhile.
        stopped = getProcessValue(str(SANDBOX), ["stop", runtime_dir], env=os.environ)
        await until(lambda: stopped.called, "the manager stopped", 60)
        assert await stopped == 0
        await until(lambda: not running(child), "the job's child killed")
        await until(
            lambda: service.server.drain_reason is not None, "drained after 1 s"
        )
        assert service.server.drain_reason.startswith("systemd unreachable for 1 s")
        # systemd 252 drops its bus before the job's end is announced, so
        # the request waits for a manager to ask; one that announced it
        # first ends the stream as any stop does.
        announced = job.called

        start_manager(runtime_dir)
        await until(lambda: service.server.drain_reason is None, "undrained")
        await until(lambda: job.called, "the job's request ended", 60)
        outcome = await job
        if announced:
            assert (outcome.error, outcome.status) == (None, signal.SIGTERM)
        else:
            assert outcome.error is not None and outcome.error.errnum == errno.ESRCH
            gone = " is gone (lost while systemd was away)"
            assert outcome.error.errstr.endswith(gone)
            assert "finished" not in outcome.types
        after = await run(client, ["echo", "after"])
        assert (after.error, after.stdout) == (None, b"after\n")
    finally:
        await service.stop()
    assert service.server is None or not service.server.processes
