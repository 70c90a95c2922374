"""Issue 12's memory bound: 200 background processes writing 10 MiB each
keep at most ``[sdexec] retained-output`` each.

The service runs as ``twistd -n sdexec`` in a subprocess, so what is
measured is the service's own peak resident set (``VmHWM`` of
/proc/PID/status): everything it held at its worst moment, not an estimate
from sizes. 200 x 10 MiB is 2000 MiB of output; with 256 KiB retained the
bound is 50 MiB of output plus the service's own baseline and some slack.
Every wait must then report exactly what was dropped.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support import unit_names
from test_twistd import Twistd, reaped

from sdexec.protocol import ExecFlag, Topic, command_object
from sdexec.syncclient import Call, Connection, Loop

pytestmark = pytest.mark.systemd

MIB = 1024 * 1024
PROCESSES = 200
WRITTEN = 10 * MIB
RETAINED = 256 * 1024
#: What the service may hold beyond the retained output: the interpreter's
#: arenas, 200 processes' objects and channels, D-Bus traffic.
SLACK = 96 * MIB


def kib(status: str, key: str) -> int:
    """A ``kB`` line of /proc/PID/status, in bytes."""
    line = next(line for line in status.splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def memory(pid: int) -> tuple[int, int]:
    """(resident now, peak resident) of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return kib(status, "VmRSS"), kib(status, "VmHWM")


def start_all(connection: Connection, loop: Loop) -> list[int]:
    """200 waitable background writers of 10 MiB of lines each; their pids."""
    # yes's "Broken pipe" (systemd ignores SIGPIPE) is not what is measured.
    script = f"yes 0123456789abcdef 2>/dev/null | head -c {WRITTEN}"
    calls = []
    for number in range(PROCESSES):
        cmd = command_object(
            ["sh", "-c", script], {"PATH": "/usr/bin:/bin"}, label=f"w{number}"
        )
        call = Call()
        payload = {"cmd": cmd, "flags": int(ExecFlag.WAITABLE)}
        connection.send(Topic.EXEC, payload, call, streaming=False)
        calls.append(call)
    loop.run_until(lambda: all(call.answered for call in calls))
    assert [call.error for call in calls] == [None] * PROCESSES
    return [call.payload["pid"] for call in calls]


def wait_until_all_ended(connection: Connection) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        procs = connection.call(Topic.LIST, {})["procs"]
        ended = all(proc["state"] == "Z" for proc in procs)
        if len(procs) == PROCESSES and ended and not unit_names():
            return
        time.sleep(0.5)
    raise AssertionError("the writers did not all end within 10 minutes")


def test_200_background_writers_of_10_mib_keep_only_the_retained_size(
    user_manager, tmp_path
):
    service = Twistd(tmp_path, f'retained-output = "{RETAINED // 1024}K"\n')
    with reaped(service.process), Loop() as loop:
        with Connection(loop, str(service.socket)) as connection:
            connection.call(Topic.LIST, {})
            baseline, _ = memory(service.process.pid)
            pids = start_all(connection, loop)
            wait_until_all_ended(connection)
            for pid in pids:
                answer = connection.call(Topic.WAIT, {"pid": pid})
                assert answer["status"] == 0
                kept = sum(len(io["data"]) for io in answer["output"])
                assert kept == RETAINED
                assert answer["dropped"] == {"stdout": WRITTEN - RETAINED, "stderr": 0}
            assert connection.call(Topic.LIST, {})["procs"] == []
        _, peak = memory(service.process.pid)
        held = peak - baseline
        bound = PROCESSES * RETAINED + SLACK
        print(f"service peak RSS {peak / MIB:.0f} MiB, {held / MIB:.0f} MiB over"
              f" its idle {baseline / MIB:.0f} MiB; bound {bound / MIB:.0f} MiB;"
              f" written {PROCESSES * WRITTEN / MIB:.0f} MiB")  # fmt: skip
        assert held < bound
        service.stop()
    assert unit_names() == []
