"""Background mode, waitable, wait and attach offline (sdexec.background):
the server over in-memory connections with sdexec.testing's fake manager.
The process's output is real: bytes written to the fake unit's stdout and
stderr fds are read by the reactor's channels. The same paths run against a
real manager in test_background_service.py."""

from __future__ import annotations

import errno
import os
import re
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from offline import BufferingTransport, Connection, error_of, read_to_eof
from pytest_twisted import ensureDeferred
from strategies import malformed_target_payloads
from support import until
from test_server import FLAGS, TRUE, UNIT
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

import sdexec.connection
from sdexec.config import parse_config
from sdexec.containment import Containment
from sdexec.ioencode import decode_io, encode_io
from sdexec.process import FAILED_UNIT_WAIT
from sdexec.protocol import ExecFlag
from sdexec.server import SdexecServer, revoked
from sdexec.testing import EXITED, FakeManager

WAITABLE = int(ExecFlag.WAITABLE)


@pytest.fixture
def systemd():
    manager = FakeManager()
    manager.stop_to_inactive = True  # StopUnit releases the fds: EOF, reaped
    yield manager
    manager.close()


#: A streaming /bin/true of its own unit.
STREAMED = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-s"}}


def make_server(systemd, **sdexec) -> SdexecServer:
    return SdexecServer(
        systemd, parse_config({"sdexec": sdexec}), reactor, clock=Clock()
    )


@pytest.fixture
def server(systemd):
    return make_server(systemd)


class Client(Connection):
    """A connection with the requests of this module."""

    def bg(
        self, flags: int = 0, matchtag: int = 1, label: str | None = None, **opts
    ) -> None:
        """A background exec of /bin/true (its unit ``UNIT`` unless
        ``SDEXEC_NAME`` says otherwise)."""
        cmd = {**TRUE, "opts": {**TRUE["opts"], **opts}}
        if label is not None:
            cmd["label"] = label
        payload = {"flags": flags, "cmd": cmd}
        self.raw(
            {
                "type": "request",
                "topic": "sdexec.exec",
                "matchtag": matchtag,
                "payload": payload,
                "streaming": False,
            }
        )

    def streaming_waitable(self, label: str) -> None:
        """A streaming, waitable exec of /bin/true labelled ``label``."""
        cmd = {**TRUE, "label": label}
        self.send("sdexec.exec", {"flags": FLAGS | WAITABLE, "cmd": cmd})

    def of(self, matchtag: int) -> list[dict]:
        return [r for r in self.responses() if r["matchtag"] == matchtag]

    def close(self) -> None:
        super().close()
        self.transport.disconnected = True


@pytest.fixture
def client(server):
    opened = Client(server)
    yield opened
    if not getattr(opened.transport, "disconnected", False):
        opened.close()


def payloads(responses: list[dict]) -> list:
    """Payloads, and errors as (errnum, errstr)."""
    return [r["payload"] if "payload" in r else error_of(r) for r in responses]


def output_of(responses: list[dict]) -> list[tuple[str, bytes, bool]]:
    return [
        decode_io(r["payload"]["io"])
        for r in responses
        if r.get("payload", {}).get("type") == "output"
    ]


def produce(systemd: FakeManager, stream: str, data: bytes, unit: str = UNIT) -> None:
    """The process writes ``data`` to ``stream`` (all of it)."""
    with os.fdopen(os.dup(systemd.process_fd(unit, stream)), "wb") as fd:
        fd.write(data)


def tracked_of(server: SdexecServer):
    """The one tracked process that has a unit."""
    (tracked,) = server.tracked._tracked.values()
    return tracked


# -- background mode ---------------------------------------------------------


@ensureDeferred
async def test_background_exec_answers_started_once_and_outlives_its_client(
    systemd, server, client
):
    client.bg(flags=FLAGS, label="bg")
    assert ("start", UNIT) in systemd.calls
    # Its stdin is at EOF at once.
    assert await read_to_eof(systemd.process_fd(UNIT, "stdin")) == b""
    systemd.run(UNIT, pid=99)
    client.close()
    assert ("stop", UNIT) not in systemd.calls
    produce(systemd, "stdout", b"nobody reads this\n")
    assert payloads(client.responses()) == [{"type": "started", "pid": 99}]
    other = Client(server)
    other.send("sdexec.list", {"detail": True})
    (proc,) = other.last()["payload"]["procs"]
    assert (proc["pid"], proc["label"], proc["mode"], proc["state"]) == (
        99,
        "bg",
        "background",
        "R",
    )
    other.send("sdexec.kill", {"label": "bg", "signum": 15}, matchtag=2)
    assert other.last()["payload"] == {}
    assert systemd.kills() == [15]
    systemd.exit(UNIT, status=0)
    await until(lambda: not server.processes, "reaped")
    assert payloads(client.responses()) == [{"type": "started", "pid": 99}]
    other.close()


def test_a_background_start_refused_is_its_one_response(systemd, server, client):
    from sdexec.systemd import SystemdError

    systemd.refuse_start = SystemdError("org.freedesktop.DBus.Error.Failed", "no")
    client.bg()
    # Not EIO, which job-exec reads as a failed containment check.
    assert payloads(client.responses()) == [(errno.EREMOTEIO, "no")]
    assert server.processes == {}
    client.send("sdexec.wait", {"label": "x"}, matchtag=2)
    assert error_of(client.last())[0] == errno.ESRCH


@pytest.mark.parametrize(
    ("message", "text"),
    [
        ({"streaming": "no", "payload": {"flags": 0, "cmd": TRUE}},
         'streaming: expected a boolean, got "no"'),
        ({"streaming": False, "payload": {"flags": 8, "cmd": TRUE}},
         "flags: write-credit (8) needs a streaming request: a background"
         " process's stdin is at EOF"),
        # RFC 42: an error, which ran all the same.
        ({"streaming": False, "payload": {"flags": 0, "cmd": TRUE, "local_flags": 1}},
         "local_flags: stdio-fallthrough (1) is not allowed in background mode"),
    ],
)  # fmt: skip
def test_a_bad_background_request_is_einval(systemd, client, message, text):
    client.raw({"type": "request", "topic": "sdexec.exec", "matchtag": 1, **message})
    assert error_of(client.last()) == (errno.EINVAL, text)
    assert systemd.calls == []


def test_a_streaming_process_is_still_stopped_with_its_client(systemd, server):
    client = Client(server)
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    client.send("sdexec.list", {"detail": True}, matchtag=2)
    assert client.last()["payload"]["procs"][0]["mode"] == "streaming"
    client.close()
    assert ("stop", UNIT) in systemd.calls


@ensureDeferred
async def test_shutdown_stops_background_processes(systemd, server, client):
    client.bg()
    systemd.run(UNIT)
    client.close()
    done = server.shutdown(10)
    assert ("stop", UNIT) in systemd.calls
    await until(lambda: done.called, "every process reaped")
    assert server.processes == {}


# -- wait ------------------------------------------------------------------------


async def finish(systemd, server, status: int = 0) -> None:
    """The process exits; its unit is stopped and reaped."""
    systemd.exit(UNIT, status=status)
    await until(lambda: not server.processes, "reaped")


async def an_ended_waitable(systemd, server, client, label, pid, status) -> None:
    """A waitable background process (unit ``UNIT``) that ran and ended,
    kept for a wait."""
    client.bg(flags=WAITABLE, label=label)
    systemd.run(UNIT, pid=pid)
    await finish(systemd, server, status=status)


@ensureDeferred
async def test_wait_returns_status_and_output_in_production_order(
    systemd, server, client
):
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    # One stream at a time reaches the service before the next is written,
    # so the interleaving is the order of production.
    pieces = [("stdout", b"out 1\n"), ("stderr", b"\xff\xfe err\n"), ("stdout", b"2\n")]
    retained = tracked_of(server).retained
    for count, (stream, data) in enumerate(pieces, start=1):
        produce(systemd, stream, data)
        await until(
            lambda count=count: len(retained.io_objects("0")) == count,
            f"{count} pieces retained",
        )
    await finish(systemd, server, status=3)
    client.send("sdexec.list", {"detail": True}, matchtag=2)
    (proc,) = client.last()["payload"]["procs"]
    assert (proc["pid"], proc["state"], proc["mode"]) == (7, "Z", "background")
    client.send("sdexec.wait", {"pid": 7}, matchtag=3)
    (answer,) = payloads(client.of(3))
    assert answer["status"] == 3 << 8
    assert answer["dropped"] == {"stdout": 0, "stderr": 0}
    assert [decode_io(io)[:2] for io in answer["output"]] == pieces
    client.send("sdexec.wait", {"pid": 7}, matchtag=4)
    assert payloads(client.of(4)) == [
        (errno.ESRCH, "pid 7: not found (no such process)")
    ]
    client.send("sdexec.attach", {"label": "w"}, matchtag=5)
    assert payloads(client.of(5)) == [
        (errno.ENOENT, "label 'w': not found (no such process)")
    ]


@ensureDeferred
async def test_a_pending_wait_is_answered_when_the_process_ends(
    systemd, server, client
):
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    client.send("sdexec.wait", {"label": "w", "pid": 12345}, matchtag=2)  # label wins
    assert client.of(2) == []
    await finish(systemd, server, status=0)
    (answer,) = payloads(client.of(2))
    assert (answer["status"], answer["output"]) == (0, [])
    assert server.tracked.describe_ended() == []  # reaped by the wait


@ensureDeferred
async def test_a_wait_answers_the_receipt_that_says_an_oom_kill(
    systemd, server, client
):
    # Its status alone says 137, as any SIGKILL: the receipt `finished`
    # carried says whose it was, for wait as for run (docs/client.md).
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    oom = {"Result": "oom-kill", "MemoryMax": 16 << 20}
    systemd.change(UNIT, {**EXITED, **oom, "ExecMainCode": 2, "ExecMainStatus": 9})
    await until(lambda: not server.processes, "reaped")
    client.send("sdexec.wait", {"label": "w"}, matchtag=2)
    (answer,) = payloads(client.of(2))
    assert (answer["status"], answer["result"], answer["memory_max"]) == (
        signal.SIGKILL,
        "oom-kill",
        16 << 20,
    )


@ensureDeferred
async def test_an_ended_process_kept_for_a_wait_holds_its_label(
    systemd, server, client
):
    await an_ended_waitable(systemd, server, client, "w", 7, 0)
    client.bg(matchtag=2, label="w", SDEXEC_NAME="sdexec-u")
    assert payloads(client.of(2)) == [
        (
            errno.EEXIST,
            "label 'w' is already in use by pid 7 of the service's owner, uid"
            f" {os.getuid()}, ended and kept for a wait",
        )
    ]
    client.send("sdexec.wait", {"label": "w"}, matchtag=3)
    client.bg(matchtag=4, label="w", SDEXEC_NAME="sdexec-u")  # waited: free again
    assert ("start", "sdexec-u.service") in systemd.calls


@ensureDeferred
async def test_a_kill_of_an_ended_process_kept_for_a_wait_says_so(
    systemd, server, client
):
    # It said "kill label=w not found" while sdexec ps listed it, state Z.
    await an_ended_waitable(systemd, server, client, "w", 7, 0)
    client.send("sdexec.kill", {"signum": 15, "label": "w"}, matchtag=2)
    client.send("sdexec.kill", {"signum": 15, "pid": 7}, matchtag=3)
    client.send("sdexec.kill", {"signum": 15, "pid": 8}, matchtag=4)
    ended = "the process has ended and is kept for a wait"
    assert [payloads(client.of(tag)) for tag in range(2, 5)] == [
        [(errno.ESRCH, f"kill label=w: {ended}")],
        [(errno.ESRCH, f"kill pid=7: {ended}")],
        [(errno.ESRCH, "kill pid=8 not found")],
    ]
    client.send("sdexec.wait", {"label": "w"}, matchtag=5)  # waited: forgotten
    client.send("sdexec.kill", {"signum": 15, "label": "w"}, matchtag=6)
    assert payloads(client.of(6)) == [(errno.ESRCH, "kill label=w not found")]
    assert [call for call in systemd.calls if call[0] == "kill"] == []


@ensureDeferred
async def test_a_terminate_of_an_ended_job_kept_for_a_wait_says_so(
    systemd, server, client
):
    # It said "terminate label=w not found" (and jobid=j1) while sdexec ps
    # listed it, state Z, and kill said it had ended (review session 46).
    client.bg(flags=WAITABLE, label="w", SDEXEC_JOBID="j1")
    systemd.run(UNIT, pid=7)
    await finish(systemd, server)
    (entry,) = server.list()["procs"]
    assert (entry["state"], entry["jobid"], entry["step"]) == ("Z", "j1", None)
    targets = [{"label": "w"}, {"pid": 7}, {"jobid": "j1"}, {"jobid": "j2"}]
    for matchtag, target in enumerate(targets, start=2):
        client.send("sdexec.terminate", {**target, "reason": "cancel"}, matchtag)
    ended = "the process has ended and is kept for a wait"
    assert [payloads(client.of(tag)) for tag in range(2, 6)] == [
        [(errno.ESRCH, f"terminate label=w: {ended}")],
        [(errno.ESRCH, f"terminate pid=7: {ended}")],
        [
            (
                errno.ESRCH,
                "terminate jobid=j1: the job has ended; its process"
                " (pid 7) is kept for a wait",
            )
        ],
        [(errno.ESRCH, "terminate jobid=j2 not found")],
    ]
    client.send("sdexec.wait", {"label": "w"}, matchtag=6)  # waited: forgotten
    client.send("sdexec.terminate", {"jobid": "j1", "reason": "cancel"}, 7)
    assert payloads(client.of(7)) == [(errno.ESRCH, "terminate jobid=j1 not found")]
    assert server.list()["procs"] == []


@ensureDeferred
async def test_a_job_that_runs_takes_a_terminate_of_its_id_from_one_kept(
    systemd, server, client
):
    # The id of an ended job kept for a wait is free again: a terminate of
    # it finds the job that runs with it now.
    client.bg(flags=WAITABLE, label="w", SDEXEC_JOBID="j1")
    systemd.run(UNIT, pid=7)
    await finish(systemd, server)
    client.bg(matchtag=2, SDEXEC_JOBID="j1", SDEXEC_NAME="sdexec-u")
    assert [proc["jobid"] for proc in server.list()["procs"]] == ["j1", "j1"]
    client.send("sdexec.terminate", {"jobid": "j1", "reason": "cancel"}, 3)
    (reply,) = payloads(client.of(3))
    assert (reply["id"], reply["unit"]) == ("j1", "sdexec-u.service")


@ensureDeferred
async def test_wait_errors(systemd, server, client):
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "s"}})
    client.bg(matchtag=2, label="plain", SDEXEC_NAME="sdexec-u")
    assert ("start", "sdexec-u.service") in systemd.calls
    client.send("sdexec.wait", {"label": "s"}, matchtag=3)
    client.send("sdexec.wait", {"label": "plain"}, matchtag=4)
    client.send("sdexec.wait", {"label": "nope"}, matchtag=5)
    client.send("sdexec.wait", {}, matchtag=6)
    client.send("sdexec.wait", {"pid": "7"}, matchtag=7)
    assert [payloads(client.of(tag)) for tag in range(3, 8)] == [
        [
            (
                errno.EINVAL,
                "label 's': process is not waitable (not started with flag 16)",
            )
        ],
        [
            (
                errno.EINVAL,
                "label 'plain': process is not waitable (not started with flag 16)",
            )
        ],
        [(errno.ESRCH, "label 'nope': not found (no such process)")],
        [(errno.EINVAL, "wait needs a pid or a label")],
        [(errno.EINVAL, 'pid: expected an integer, got "7"')],
    ]


@ensureDeferred
async def test_one_waiter_at_a_time_and_a_waiter_that_leaves_leaves_the_status(
    systemd, server, client
):
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    first = Client(server)
    first.send("sdexec.wait", {"label": "w"})
    client.send("sdexec.wait", {"label": "w"}, matchtag=2)
    # As upstream's subprocess server (flux-core t2421 looks for the words).
    assert payloads(client.of(2)) == [
        (
            errno.EINVAL,
            "label 'w': process is already being waited on (a wait on another"
            f" connection, of uid {os.getuid()})",
        )
    ]
    first.close()
    await finish(systemd, server, status=1)
    assert payloads(first.responses()) == []
    client.send("sdexec.wait", {"label": "w"}, matchtag=3)
    (answer,) = payloads(client.of(3))
    assert answer["status"] == 1 << 8


def test_a_refused_wait_or_attach_names_the_process_as_the_request_did(
    systemd, server, client
):
    # `sdexec wait JOB` said "pid 7: process is already being waited on":
    # its user typed a label and may never have seen the pid.
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    client.send("sdexec.wait", {"label": "w"})
    other = Client(server)
    other.send("sdexec.wait", {"label": "w"}, matchtag=1)
    other.send("sdexec.wait", {"pid": 7}, matchtag=2)
    other.send("sdexec.attach", {"label": "w"}, matchtag=3)
    other.send("sdexec.attach", {"pid": 7}, matchtag=4)
    held = f"another connection, of uid {os.getuid()}"
    assert [payloads(other.of(tag)) for tag in range(1, 5)] == [
        [
            (
                errno.EINVAL,
                f"label 'w': process is already being waited on (a wait on {held})",
            )
        ],
        [
            (
                errno.EINVAL,
                f"pid 7: process is already being waited on (a wait on {held})",
            )
        ],
        [(errno.EBUSY, f"label 'w': a wait is pending on {held}")],
        [(errno.EBUSY, f"pid 7: a wait is pending on {held}")],
    ]
    # Its holder asking again is told the wait is its own connection's.
    client.send("sdexec.wait", {"label": "w"}, matchtag=9)
    assert payloads(client.of(9)) == [
        (
            errno.EINVAL,
            "label 'w': process is already being waited on (a wait on this connection)",
        )
    ]


@ensureDeferred
async def test_waitable_processes_held_are_capped_until_one_is_waited_for(systemd):
    """An ended waitable process keeps its status and output until waited
    for: max-waitable bounds how many are held, running or ended."""
    server = make_server(systemd, **{"max-waitable": 2})
    client = Client(server)
    await an_ended_waitable(systemd, server, client, "ended", 7, 0)
    client.bg(flags=WAITABLE, label="running", matchtag=2, SDEXEC_NAME="sdexec-r")
    client.bg(flags=WAITABLE, matchtag=3, SDEXEC_NAME="sdexec-x")
    client.bg(matchtag=4, SDEXEC_NAME="sdexec-p")  # not waitable: no limit
    too_many = (
        errno.EAGAIN,
        "flags: too many waitable processes: 2 running or not yet waited for,"
        " the most [sdexec] max-waitable allows (sdexec wait reaps one)",
    )
    assert payloads(client.of(3)) == [too_many]
    assert ("start", "sdexec-x.service") not in systemd.calls
    assert ("start", "sdexec-p.service") in systemd.calls
    client.send("sdexec.wait", {"label": "ended"}, matchtag=5)
    assert payloads(client.of(5))[0]["status"] == 0
    client.bg(flags=WAITABLE, matchtag=6, SDEXEC_NAME="sdexec-y")
    assert ("start", "sdexec-y.service") in systemd.calls
    assert server.tracked.waitable_held() == 2
    client.close()


#: A line that is 6 times its size as JSON (``\u0001`` a byte): an answer
#: carrying it fills a connection's 256 KiB buffer.
CONTROL_BYTES = b"\x01" * (64 * 1024 - 1) + b"\n"


def unreading_client(server: SdexecServer) -> Client:
    """A client that reads nothing until its test says so
    (``transport.read()``): its connection pauses once its buffer is full."""
    return Client(server, BufferingTransport())


def attached_unread(
    systemd, server, client: Client, label: str = "a", waitable: bool = False
) -> Client:
    """A background process labelled ``label`` (of ``client``, running
    as pid 8) and an :func:`unreading_client` attached to its stdout on
    matchtag 1."""
    client.bg(flags=WAITABLE if waitable else 0, label=label)
    systemd.run(UNIT, pid=8)
    viewer = unreading_client(server)
    viewer.send("sdexec.attach", {"label": label, "flags": 1}, matchtag=1)
    return viewer


async def ended_with_output(systemd, server, client, units: list[str]) -> list[str]:
    """Waitable background processes of ``units`` (labelled by unit), each
    of which wrote :data:`CONTROL_BYTES` and ended, kept for a wait: those
    whose exec was not refused."""
    for matchtag, unit in enumerate(units, start=100):
        client.bg(flags=WAITABLE, matchtag=matchtag, label=unit, SDEXEC_NAME=unit)
    started = [unit for unit in units if ("start", f"{unit}.service") in systemd.calls]
    for pid, unit in enumerate(started, start=10):
        systemd.run(f"{unit}.service", pid=pid)
        produce(systemd, "stdout", CONTROL_BYTES, unit=f"{unit}.service")
    retained = [tracked.retained for tracked in server.tracked._tracked.values()]
    await until(
        lambda: all(kept.held == len(CONTROL_BYTES) for kept in retained), "kept"
    )
    for unit in started:
        systemd.exit(f"{unit}.service", status=0)
    await until(lambda: not server.processes, "reaped")
    return started


@ensureDeferred
async def test_wait_answers_not_yet_read_keep_their_waitable_slots(systemd):
    """Audit (bounds) finding 2: an answered wait freed its slot though its
    answer, 6 times the output as JSON, still sat unread in the buffer of a
    client that never reads: the next waitable processes could be waited
    for by another such client, and so on (72 MiB held against the 4 MiB
    that max-waitable x retained-output promised)."""
    server = make_server(systemd, **{"max-waitable": 2, "retained-output": "64K"})
    client, sleeper = Client(server), unreading_client(server)
    await ended_with_output(systemd, server, client, ["sdexec-w1", "sdexec-w2"])
    sleeper.send("sdexec.wait", {"label": "sdexec-w1"}, matchtag=1)
    sleeper.send("sdexec.wait", {"label": "sdexec-w2"}, matchtag=2)  # held: paused
    assert sleeper.transport.unread > 6 * len(CONTROL_BYTES)
    client.bg(flags=WAITABLE, matchtag=3, SDEXEC_NAME="sdexec-x")
    assert payloads(client.of(3)) == [
        (
            errno.EAGAIN,
            "flags: too many waitable processes: 2 running or not yet waited for"
            " (1 of them answered, not yet read by the client), the most"
            " [sdexec] max-waitable allows (sdexec wait reaps one)",
        )
    ]
    sleeper.transport.read()  # the first answer read; the second is sent
    assert sleeper.transport.unread > 6 * len(CONTROL_BYTES)
    assert server.tracked.waitable_held() == 1
    sleeper.transport.read()
    assert server.tracked.waitable_held() == 0
    client.bg(flags=WAITABLE, matchtag=4, SDEXEC_NAME="sdexec-y")
    assert ("start", "sdexec-y.service") in systemd.calls
    assert [r["payload"]["status"] for r in sleeper.responses()] == [0, 0]
    sleeper.close()
    client.close()


@ensureDeferred
async def test_the_memory_of_unread_wait_answers_stays_within_max_waitable(systemd):
    """The audit's reproduction: round after round of waits answered to
    clients that never read. Only the first round's processes can be held."""
    server = make_server(systemd, **{"max-waitable": 2, "retained-output": "64K"})
    client = Client(server)
    sleepers = []
    for turn in range(3):
        units = [f"sdexec-r{turn}-{index}" for index in range(2)]
        started = await ended_with_output(systemd, server, client, units)
        sleeper = unreading_client(server)
        for matchtag, unit in enumerate(started, start=1):
            sleeper.send("sdexec.wait", {"label": unit}, matchtag=matchtag)
        sleepers.append(sleeper)
    unread = sum(sleeper.transport.unread for sleeper in sleepers)
    # Each answer is at most 8 times the retained output as JSON.
    assert 6 * len(CONTROL_BYTES) < unread <= 2 * 8 * len(CONTROL_BYTES)
    assert len([call for call in systemd.calls if call[0] == "start"]) == 2
    for sleeper in sleepers:
        sleeper.close()
    client.close()


@ensureDeferred
async def test_an_attach_replay_not_yet_read_keeps_the_slot_of_the_end_it_took(
    systemd,
):
    server = make_server(systemd, **{"max-waitable": 1, "retained-output": "64K"})
    client, viewer = Client(server), unreading_client(server)
    await ended_with_output(systemd, server, client, ["sdexec-w"])
    viewer.send("sdexec.attach", {"label": "sdexec-w"}, matchtag=1)
    assert payloads(viewer.of(1))[-1] == (errno.ENODATA, "")  # it took the end
    client.bg(flags=WAITABLE, matchtag=2, SDEXEC_NAME="sdexec-x")
    assert error_of(client.last())[0] == errno.EAGAIN
    viewer.close()  # what it had not read is gone with it
    client.bg(flags=WAITABLE, matchtag=3, SDEXEC_NAME="sdexec-y")
    assert ("start", "sdexec-y.service") in systemd.calls
    client.close()


@ensureDeferred
async def test_a_background_process_whose_replay_is_unread_counts_after_it_ends(
    systemd,
):
    server = make_server(systemd, **{"max-background": 1, "retained-output": "64K"})
    client, viewer = Client(server), unreading_client(server)
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    produce(systemd, "stdout", CONTROL_BYTES)
    systemd.release(UNIT)  # both streams at EOF: nothing left to pause
    retained = tracked_of(server).retained
    await until(lambda: retained.at_eof("stdout") and retained.at_eof("stderr"), "EOF")
    viewer.send("sdexec.attach", {"label": "a"}, matchtag=1)
    await finish(systemd, server)
    client.bg(matchtag=2, SDEXEC_NAME="sdexec-b")
    assert payloads(client.of(2)) == [
        (
            errno.EAGAIN,
            "too many background processes: 1 running (1 of them ended, not yet"
            " read by the client), the most [sdexec] max-background allows",
        )
    ]
    viewer.transport.read()
    client.bg(matchtag=3, SDEXEC_NAME="sdexec-c")
    assert ("start", "sdexec-c.service") in systemd.calls
    viewer.close()
    client.close()


@ensureDeferred
async def test_background_processes_running_are_capped(systemd):
    # Each holds up to retained-output bytes while it runs: their number
    # was the one thing the memory they take had no bound on.
    server = make_server(systemd, **{"max-background": 2})
    client = Client(server)
    client.bg(matchtag=1)
    systemd.run(UNIT, pid=7)
    client.bg(matchtag=2, SDEXEC_NAME="sdexec-b")
    client.bg(matchtag=3, SDEXEC_NAME="sdexec-c")
    assert payloads(client.of(3)) == [
        (
            errno.EAGAIN,
            "too many background processes: 2 running, the most [sdexec]"
            " max-background allows",
        )
    ]
    assert ("start", "sdexec-c.service") not in systemd.calls
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": STREAMED}, matchtag=4)
    assert ("start", "sdexec-s.service") in systemd.calls  # streaming: no limit
    systemd.exit(UNIT, status=0)
    await until(lambda: UNIT not in server.units, "the first one reaped")
    client.bg(matchtag=5, SDEXEC_NAME="sdexec-d")
    assert ("start", "sdexec-d.service") in systemd.calls
    client.close()


@ensureDeferred
async def test_a_streaming_waitable_process_keeps_its_status(systemd, server, client):
    flags = FLAGS | WAITABLE
    client.send("sdexec.exec", {"flags": flags, "cmd": {**TRUE, "label": "s"}})
    systemd.run(UNIT, pid=5)
    produce(systemd, "stdout", b"streamed\n")
    await finish(systemd, server, status=0)
    stream = payloads(client.of(1))
    assert stream[-1] == (errno.ENODATA, "")
    assert ("stdout", b"streamed\n", False) in output_of(client.of(1))
    client.send("sdexec.wait", {"label": "s"}, matchtag=2)
    (answer,) = payloads(client.of(2))
    assert answer["status"] == 0
    assert [decode_io(io)[:2] for io in answer["output"]] == [("stdout", b"streamed\n")]


async def gone_then_waited(systemd, server, label: str) -> dict:
    """The unit gone (its outputs closed, inactive), reaped: what a wait by
    ``label`` from another client answers."""
    systemd.release(UNIT)
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    await until(lambda: not server.processes, "reaped")
    other = Client(server)
    other.send("sdexec.wait", {"label": label})
    (answer,) = payloads(other.responses())
    other.close()
    return answer


@ensureDeferred
async def test_a_streaming_waitable_process_whose_client_left_keeps_its_status(
    systemd, server
):
    systemd.stop_to_inactive = False
    client = Client(server)
    client.streaming_waitable("s")
    systemd.run(UNIT, pid=5)
    client.close()
    assert ("stop", UNIT) in systemd.calls  # a streaming process ends with its client
    systemd.change(UNIT, {**EXITED, "ExecMainCode": 2, "ExecMainStatus": 15})
    assert (await gone_then_waited(systemd, server, "s"))["status"] == signal.SIGTERM


@ensureDeferred
async def test_a_waitable_process_whose_client_left_keeps_the_status_a_reset_clears(
    systemd, server
):
    # Its client gone, its main process is SIGKILLed: the unit fails and is
    # reset. Should the reset clear ExecMain* (the model the service keeps),
    # the wait still answers the status first seen.
    client = Client(server)
    client.streaming_waitable("s")
    systemd.run(UNIT, pid=5)
    client.close()
    failed = {**EXITED, "ActiveState": "failed", "SubState": "failed"}
    systemd.change(UNIT, {**failed, "ExecMainCode": 2, "ExecMainStatus": 9})
    assert ("reset", UNIT) in systemd.calls
    systemd.change(UNIT, {**failed, "ExecMainCode": 0, "ExecMainStatus": 0})
    assert (await gone_then_waited(systemd, server, "s"))["status"] == signal.SIGKILL


@ensureDeferred
async def test_100k_of_output_through_16k_reports_the_dropped_bytes(systemd):
    server = make_server(systemd, **{"retained-output": "16K"})
    client = Client(server)
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    retained = tracked_of(server).retained
    # 60 KiB of stdout, read before 40 KiB of stderr is written, in lines.
    for stream, size, read in (("stdout", 60, 60), ("stderr", 40, 100)):
        produce(systemd, stream, (b"x" * 1023 + b"\n") * size)
        await until(
            lambda read=read: (
                retained.held + sum(retained.dropped.values()) == read * 1024
            ),
            f"{read} KiB read",
        )
    await finish(systemd, server)
    client.send("sdexec.wait", {"label": "w"}, matchtag=2)
    (answer,) = payloads(client.of(2))
    assert answer["dropped"] == {"stdout": 60 * 1024, "stderr": 24 * 1024}
    assert [decode_io(io)[:2] for io in answer["output"]] == [
        ("stderr", (b"x" * 1023 + b"\n") * 16)
    ]
    client.close()


# -- attach -----------------------------------------------------------------------


@ensureDeferred
async def test_attach_gets_retained_then_live_output_eofs_finished_enodata(
    systemd, server, client
):
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    produce(systemd, "stdout", b"before\n")
    await until(lambda: tracked_of(server).retained.held == 7, "retained")
    client.send("sdexec.attach", {"label": "a", "flags": FLAGS}, matchtag=2)
    first = payloads(client.of(2))[0]
    assert (first["type"], first["pid"], first["cmd"]["cmdline"]) == (
        "attached",
        8,
        ["/bin/true"],
    )
    assert first["dropped"] == {"stdout": 0, "stderr": 0}
    client.send("sdexec.list", {"detail": True}, matchtag=3)
    assert client.last()["payload"]["procs"][0]["mode"] == "attached"
    second = Client(server)
    second.send("sdexec.attach", {"pid": 8})
    assert payloads(second.responses()) == [
        (
            errno.EBUSY,
            "pid 8: already has a client attached (an attach on another"
            f" connection, of uid {os.getuid()})",
        )
    ]
    second.send("sdexec.wait", {"pid": 8}, matchtag=2)
    assert error_of(second.last())[0] == errno.EINVAL  # not waitable
    produce(systemd, "stderr", b"after\n")
    await until(lambda: len(output_of(client.of(2))) == 2, "live output")
    await finish(systemd, server, status=0)
    stream = client.of(2)
    outputs = output_of(stream)
    assert outputs[:2] == [
        ("stdout", b"before\n", False),
        ("stderr", b"after\n", False),
    ]
    assert sorted(outputs[2:]) == [("stderr", b"", True), ("stdout", b"", True)]
    kinds = [p["type"] if isinstance(p, dict) else p for p in payloads(stream)]
    assert kinds[0] == "attached" and kinds[-1] == (errno.ENODATA, "")
    assert kinds.count("finished") == 1
    second.close()


@ensureDeferred
async def test_an_attach_replays_retained_output_split_at_the_streams_bufsize(
    systemd, server, client
):
    """As live output is: no ``output`` carries more than ``stdout_BUFSIZE``."""
    client.bg(label="a", stdout_BUFSIZE="4096", stdout_LINE_BUFFER="false")
    systemd.run(UNIT, pid=8)
    produce(systemd, "stdout", b"a" * 10_000)
    await until(lambda: tracked_of(server).retained.held == 10_000, "retained")
    client.send("sdexec.attach", {"label": "a", "flags": FLAGS}, matchtag=2)
    replayed = output_of(client.of(2))
    assert [len(data) for _, data, _ in replayed] == [4096, 4096, 1808]
    assert b"".join(data for _, data, _ in replayed) == b"a" * 10_000


@ensureDeferred
async def test_attach_disconnect_attach_again(systemd, server, client):
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    first = Client(server)
    first.send("sdexec.attach", {"label": "a", "flags": 1})
    produce(systemd, "stdout", b"one\n")
    await until(lambda: output_of(first.responses()), "live output")
    first.close()  # back to the background: nothing stopped
    assert ("stop", UNIT) not in systemd.calls
    client.send("sdexec.list", {"detail": True}, matchtag=2)
    assert client.last()["payload"]["procs"][0]["mode"] == "background"
    produce(systemd, "stdout", b"two\n")
    await until(lambda: tracked_of(server).retained.held == 8, "retained")
    client.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=3)
    assert output_of(client.of(3)) == [("stdout", b"one\ntwo\n", False)]
    await finish(systemd, server)
    assert payloads(client.of(3))[-1] == (errno.ENODATA, "")
    assert output_of(client.of(3))[-1] == ("stdout", b"", True)


@ensureDeferred
async def test_an_abandoned_process_whose_attached_client_was_paused_is_reaped(
    systemd, server, client
):
    # The stop timer gives up on the unit (EDEADLK to the attached client)
    # while that client's connection is paused: back in the background, its
    # output must read on, or its EOF never comes and it is never reaped.
    client.bg(label="a", SDEXEC_STOP_TIMER_SEC="1")
    systemd.run(UNIT, pid=8)
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "a"}, matchtag=2)
    viewer.protocol.pauseProducing()
    systemd.exit(UNIT, 0)
    systemd.deactivate(UNIT)  # a child lingers: deactivating, then abandoned
    server.clock.advance(1)
    server.clock.advance(1)
    assert payloads(viewer.of(2))[-1][0] == errno.EDEADLK
    viewer.protocol.resumeProducing()
    systemd.release(UNIT)  # the lingering child is gone at last
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    await until(lambda: not server.processes, "the process reaped")
    assert server.units == {}
    viewer.close()


# -- an attach whose client stops reading ------------------------------------------


def lines(first: int, last: int) -> bytes:
    """Numbered lines of 1 KiB, ``first`` to ``last`` (excluded)."""
    return b"".join(b"%07d" % n + b"." * 1016 + b"\n" for n in range(first, last))


async def written(
    systemd, server, data: bytes, unit: str = UNIT, stream: str = "stdout"
) -> None:
    """The process of ``unit`` writes ``data`` (whole lines), 64 KiB at a
    time, each kept before the next (no socket buffer is outrun)."""
    retained = server.tracked._tracked[server.units[unit]].retained
    for start in range(0, len(data), 64 * 1024):
        chunk = data[start : start + 64 * 1024]
        produce(systemd, stream, chunk, unit=unit)
        head = retained.head + len(chunk)
        await until(lambda head=head: retained.head == head, "kept")


def read_everything(viewer: Client) -> None:
    """The client reads until nothing more comes (its connection resumed
    each time its buffer is read out, as Twisted resumes it)."""
    for _ in range(10_000):
        viewer.transport.read()
        if not viewer.transport.unread:
            return
    raise AssertionError("it never stopped coming")


def sent_data(responses: list[dict]) -> bytes:
    return b"".join(data for _, data, _ in output_of(responses))


def ends_of(responses: list[dict]) -> list:
    """What a stream sent after its output: EOFs, `finished`, its end."""
    after = []
    for payload in payloads(responses):
        if isinstance(payload, dict) and payload["type"] == "output":
            stream, _data, eof = decode_io(payload["io"])
            assert eof or not after, "output after the stream's end"
            if eof:
                after.append(("eof", stream))
        elif isinstance(payload, dict):
            if payload["type"] != "attached":
                after.append(payload["type"])
        else:
            after.append(payload)
    return after


@ensureDeferred
async def test_an_attach_that_stops_reading_holds_back_neither_its_process_nor_another(
    systemd, server, client
):
    """Review session 45 (attach catch-up): two attaches at different
    speeds, each of a background process. The one that reads nothing
    holds its process back no more than the one that keeps up; once it
    reads, it gets everything, once, in order."""
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    client.bg(label="b", matchtag=2, SDEXEC_NAME="sdexec-u2")
    systemd.run("sdexec-u2.service", pid=9)
    fast, slow = unreading_client(server), unreading_client(server)
    fast.send("sdexec.attach", {"label": "a", "flags": 1})
    slow.send("sdexec.attach", {"label": "b", "flags": 1})
    a, b = (server.units[unit] for unit in (UNIT, "sdexec-u2.service"))
    data = lines(0, 320)  # more than either connection's buffer
    for start in range(0, len(data), 64 * 1024):
        chunk = data[start : start + 64 * 1024]
        await written(systemd, server, chunk)
        await written(systemd, server, chunk, unit="sdexec-u2.service")
        fast.transport.read()
    assert slow.protocol._paused and not fast.protocol._paused
    # Neither was held back, nor is tied to its client's connection.
    assert not a.output._client_paused and not b.output._client_paused
    assert a.valve is None and b.valve is None
    read_everything(slow)
    assert sent_data(fast.of(1)) == sent_data(slow.of(1)) == data
    fast.close()
    slow.close()


@ensureDeferred
async def test_one_attach_with_much_to_send_keeps_no_other_of_its_connection_waiting(
    systemd, server, client
):
    # Two attaches on one connection that reads slowly: the feed resumed
    # first filled the connection again each time (it had more to send
    # than it holds), and the other, resumed after it, found it full:
    # one line of b never went, however often the client read.
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    client.bg(label="b", matchtag=2, SDEXEC_NAME="sdexec-u2")
    systemd.run("sdexec-u2.service", pid=9)
    viewer = unreading_client(server)
    viewer.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=1)
    viewer.send("sdexec.attach", {"label": "b", "flags": 1}, matchtag=2)
    await written(systemd, server, lines(0, 900))  # more than 3 buffers
    await written(systemd, server, b"from b\n", unit="sdexec-u2.service")
    for first in (900, 1156):  # a writes a buffer's worth per read
        viewer.transport.read()
        await written(systemd, server, lines(first, first + 256))
    assert sent_data(viewer.of(2)) == b"from b\n"
    read_everything(viewer)
    assert sent_data(viewer.of(1)) == lines(0, 1412)
    viewer.close()


@ensureDeferred
async def test_an_attach_that_stopped_reading_gets_what_it_missed_then_live_output(
    systemd, server, client
):
    # The replay, what came while it read nothing, and live output: each
    # byte once, in order, in whole lines; its end after all of it.
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    before = lines(0, 300)  # more than the connection's 256 KiB
    await written(systemd, server, before)
    viewer = unreading_client(server)
    viewer.send("sdexec.attach", {"label": "a", "flags": FLAGS}, matchtag=1)
    assert viewer.protocol._paused  # by the replay
    missed = lines(300, 700)
    await written(systemd, server, missed)
    await written(systemd, server, b"on stderr\n", stream="stderr")
    process = server.units[UNIT]
    assert not process.output._client_paused
    read_everything(viewer)
    live = lines(700, 710)
    await written(systemd, server, live)
    await finish(systemd, server, status=3)
    stream = viewer.of(1)
    assert payloads(stream)[0]["type"] == "attached"
    assert sent_data(stream) == before + missed + b"on stderr\n" + live
    outputs = output_of(stream)
    assert all(data.endswith(b"\n") for _, data, eof in outputs if not eof)
    ended = ends_of(stream)  # in the order they came, as live
    assert ended[0] == "finished" and ended[3:] == [(errno.ENODATA, "")]
    assert sorted(ended[1:3]) == [("eof", "stderr"), ("eof", "stdout")]
    viewer.close()


@ensureDeferred
async def test_an_attach_that_falls_behind_the_retained_output_is_told_what_it_lost(
    systemd,
):
    # Only once the ring drops what the client was not sent is it ended:
    # after what it was sent, saying how much it lost; the process runs on.
    server = make_server(systemd, **{"retained-output": "64K"})
    client = Client(server)
    viewer = attached_unread(systemd, server, client)
    await written(systemd, server, CONTROL_BYTES)  # sent live: 6 times as JSON
    assert viewer.protocol._paused
    await written(systemd, server, lines(0, 64))  # the ring drops what was sent
    assert "errnum" not in viewer.responses()[-1]
    with capturedLogs() as events:
        await written(systemd, server, lines(64, 65))
    lost = (
        "pid 8: the client fell behind by more than the retained output (65536"
        " bytes, [sdexec] retained-output): 1024 bytes of stdout it had not yet"
        " been sent were dropped: this attach is ended, and pid 8 runs on in the"
        " background, its output kept until it ends (it is not waitable): attach"
        " again before then to read on"
    )
    assert [formatEvent(event) for event in events] == [
        f"connection {viewer.protocol.connection_id}: attach to pid 8 ended: its"
        " client fell behind, and lost 1024 bytes of stdout"
    ]
    client.send("sdexec.list", {"detail": True}, matchtag=2)
    assert client.last()["payload"]["procs"][0]["mode"] == "background"
    read_everything(viewer)
    stream = viewer.of(1)
    assert sent_data(stream) == CONTROL_BYTES
    assert payloads(stream)[-1] == (errno.ENOBUFS, lost)
    again = Client(server)
    again.send("sdexec.attach", {"label": "a", "flags": 1})
    assert payloads(again.responses())[0]["dropped"] == {
        "stdout": len(CONTROL_BYTES) + 1024,
        "stderr": 0,
    }
    assert sent_data(again.responses()) == lines(1, 65)
    await finish(systemd, server)
    assert payloads(again.responses())[-1] == (errno.ENODATA, "")
    assert viewer.of(1) == stream
    again.close()
    viewer.close()
    client.close()


@pytest.mark.parametrize("retained", ["0", "4K"])
@ensureDeferred
async def test_a_piece_the_ring_cannot_hold_goes_live_to_a_client_that_keeps_up(
    systemd, retained
):
    # Its loss was looked at before it was sent live: with retained-output
    # = 0 every attach ended (ENOBUFS) at its first byte, and with a ring
    # smaller than a piece (a long line comes whole, up to its 1 MiB
    # buffer) at that piece, however fast its client read.
    server = make_server(systemd, **{"retained-output": retained})
    client = Client(server)
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=1)
    data = b"x" * 10_000 + b"\n" + lines(0, 3)
    await written(systemd, server, data)
    await finish(systemd, server)
    stream = viewer.of(1)
    assert sent_data(stream) == data
    assert ends_of(stream) == ["finished", ("eof", "stdout"), (errno.ENODATA, "")]
    viewer.close()
    client.close()


@ensureDeferred
async def test_with_no_retained_output_what_comes_while_the_client_is_full_ends_it(
    systemd,
):
    server = make_server(systemd, **{"retained-output": "0"})
    client = Client(server)
    viewer = attached_unread(systemd, server, client)
    await written(systemd, server, CONTROL_BYTES)  # sent live: it fills
    assert viewer.protocol._paused
    await written(systemd, server, b"lost\n")
    read_everything(viewer)
    stream = viewer.of(1)
    assert sent_data(stream) == CONTROL_BYTES
    assert payloads(stream)[-1][0] == errno.ENOBUFS
    assert (
        "(0 bytes, [sdexec] retained-output): 5 bytes of stdout"
        in (payloads(stream)[-1][1])
    )
    await finish(systemd, server)
    viewer.close()
    client.close()


@ensureDeferred
async def test_output_of_a_stream_the_attach_does_not_take_is_no_loss_to_it(
    systemd,
):
    server = make_server(systemd, **{"retained-output": "64K"})
    client = Client(server)
    viewer = attached_unread(systemd, server, client)  # stdout
    await written(systemd, server, CONTROL_BYTES)
    assert viewer.protocol._paused
    await written(systemd, server, lines(0, 128), stream="stderr")  # twice the ring
    await written(systemd, server, b"out\n")
    read_everything(viewer)
    assert sent_data(viewer.of(1)) == CONTROL_BYTES + b"out\n"
    await finish(systemd, server)
    assert ends_of(viewer.of(1)) == ["finished", ("eof", "stdout"), (errno.ENODATA, "")]
    viewer.close()
    client.close()


@ensureDeferred
async def test_an_ended_process_still_fed_to_its_attach_keeps_its_slot(systemd):
    # Its retained output is held until its attach is sent all of it (or
    # its client goes): max-background bounds that memory still.
    server = make_server(systemd, **{"max-background": 1})
    client = Client(server)
    viewer = attached_unread(systemd, server, client)
    data = lines(0, 300)
    await written(systemd, server, data)
    await finish(systemd, server, status=3)  # its output was never held back
    client.bg(matchtag=2, SDEXEC_NAME="sdexec-b")
    assert payloads(client.of(2)) == [
        (
            errno.EAGAIN,
            "too many background processes: 1 running (1 of them ended, not yet"
            " read by the client), the most [sdexec] max-background allows",
        )
    ]
    read_everything(viewer)
    stream = viewer.of(1)
    assert sent_data(stream) == data
    assert ends_of(stream) == ["finished", ("eof", "stdout"), (errno.ENODATA, "")]
    assert payloads(stream)[-3]["status"] == 3 << 8
    client.bg(matchtag=3, SDEXEC_NAME="sdexec-c")
    assert ("start", "sdexec-c.service") in systemd.calls
    viewer.close()
    client.close()


@ensureDeferred
async def test_a_still_fed_attach_whose_client_goes_frees_the_slot(systemd):
    server = make_server(systemd, **{"max-background": 1})
    client = Client(server)
    viewer = attached_unread(systemd, server, client)
    await written(systemd, server, lines(0, 300))
    await finish(systemd, server)
    viewer.close()
    client.bg(matchtag=2, SDEXEC_NAME="sdexec-b")
    assert ("start", "sdexec-b.service") in systemd.calls
    client.close()


async def attached_to_an_end(systemd, server, client, when: str) -> Client:
    """An :func:`unreading_client` attached (matchtag 1) to a waitable
    background process ``w`` that wrote 300 KiB and exited 3, attached
    ``when`` (``"running"`` or ``"ended"``): its replay filled the
    connection before its ``finished`` was sent."""
    if when == "running":
        viewer = attached_unread(systemd, server, client, label="w", waitable=True)
    else:
        client.bg(flags=WAITABLE, label="w")
        systemd.run(UNIT, pid=8)
    await written(systemd, server, lines(0, 300))
    await finish(systemd, server, status=3)
    if when == "ended":
        viewer = unreading_client(server)
        viewer.send("sdexec.attach", {"label": "w", "flags": 1}, matchtag=1)
    assert "finished" not in ends_of(viewer.of(1))
    return viewer


@pytest.mark.parametrize("when", ["running", "ended"])
@ensureDeferred
async def test_an_end_an_attach_was_never_sent_is_kept_for_a_wait(systemd, when):
    # The attach took the end once its `finished` was queued: its client
    # gone before it was sent that, a wait got ESRCH and the status was lost.
    server = make_server(systemd, **{"max-waitable": 1})
    client = Client(server)
    viewer = await attached_to_an_end(systemd, server, client, when)
    client.send("sdexec.wait", {"label": "w"}, matchtag=2)
    assert payloads(client.of(2)) == [
        (errno.EBUSY, "label 'w': has ended, and its end is being sent to an"
                      " attached client")
    ]  # fmt: skip
    assert server.tracked.waitable_held() == 1
    viewer.close()
    assert server.tracked.waitable_held() == 1  # as if it had never attached
    client.bg(flags=WAITABLE, matchtag=3, SDEXEC_NAME="sdexec-x")
    assert error_of(client.last())[0] == errno.EAGAIN
    client.send("sdexec.wait", {"label": "w"}, matchtag=4)
    assert payloads(client.of(4))[0]["status"] == 3 << 8
    assert server.tracked.waitable_held() == 0
    client.close()


@pytest.mark.parametrize("when", ["running", "ended"])
@ensureDeferred
async def test_an_end_an_attach_was_sent_at_its_pace_is_delivered_once(systemd, when):
    server = make_server(systemd, **{"max-waitable": 1})
    client = Client(server)
    viewer = await attached_to_an_end(systemd, server, client, when)
    read_everything(viewer)
    stream = viewer.of(1)
    assert sent_data(stream) == lines(0, 300)
    assert "finished" in ends_of(stream)
    assert payloads(stream)[-1] == (errno.ENODATA, "")
    assert server.tracked.waitable_held() == 0
    client.send("sdexec.wait", {"label": "w"}, matchtag=2)
    assert payloads(client.of(2)) == [
        (errno.ESRCH, "label 'w': not found (no such process)")
    ]
    viewer.close()
    client.close()


@ensureDeferred
async def test_an_attach_behind_is_told_at_once_that_the_service_stops(
    systemd, server, client
):
    # The service will not live to send it what it has not read: its
    # ECANCELED comes next, not behind that.
    viewer = attached_unread(systemd, server, client)
    await written(systemd, server, lines(0, 300))
    done = server.shutdown(10)
    assert payloads(viewer.of(1))[-1] == (
        errno.ECANCELED,
        "the service is stopping: the process's unit is being stopped",
    )
    assert len(sent_data(viewer.of(1))) < 300 * 1024
    await until(lambda: done.called, "every process reaped")
    viewer.close()


@pytest.mark.parametrize("when", ["running", "ended"])
@ensureDeferred
async def test_an_attach_fed_an_ended_process_is_told_the_service_stops(systemd, when):
    # A process reaped before the shutdown is no longer among those it
    # cancels: its attach, still sent the output the client had not read,
    # got no ECANCELED, and the client read EOF after part of the output.
    server = make_server(systemd, **{"max-waitable": 1})
    client = Client(server)
    viewer = await attached_to_an_end(systemd, server, client, when)
    assert server.processes == {}  # reaped: only its feed is left
    done = server.shutdown(10)
    assert payloads(viewer.of(1))[-1] == (
        errno.ECANCELED,
        "the service is stopping: the process's unit is being stopped",
    )
    assert done.called
    viewer.close()
    client.close()


@ensureDeferred
async def test_an_attach_during_a_shutdown_is_told_the_service_stops(systemd):
    # Made after the shutdown ended every stream, it was fed as any, and
    # its client read part of the output, then EOF at the service's exit.
    server = make_server(systemd, **{"max-waitable": 1})
    client = Client(server)
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=8)
    await written(systemd, server, lines(0, 300))
    await finish(systemd, server, status=3)
    done = server.shutdown(10)
    viewer = unreading_client(server)
    viewer.send("sdexec.attach", {"label": "w", "flags": 1}, matchtag=1)
    assert payloads(viewer.of(1)) == [
        (errno.ECANCELED, "the service is stopping: no attach is made")
    ]
    assert done.called
    viewer.close()
    client.close()


@ensureDeferred
async def test_an_end_that_waited_behind_lost_output_is_kept_for_a_wait(systemd):
    # Its `finished` came while the client was behind, and the output
    # before it was dropped: not sent, the end is still the next wait's.
    systemd.stop_to_inactive = False  # a child keeps the unit, writing on
    server = make_server(systemd, **{"retained-output": "64K"})
    client = Client(server)
    viewer = attached_unread(systemd, server, client, label="w", waitable=True)
    await written(systemd, server, CONTROL_BYTES)
    await written(systemd, server, lines(0, 8))
    systemd.exit(UNIT, 3)
    tracked = tracked_of(server)
    await until(lambda: tracked.finished is not None, "finished")
    await written(systemd, server, lines(8, 65))
    read_everything(viewer)
    stream = payloads(viewer.of(1))
    assert "finished" not in [p["type"] for p in stream if isinstance(p, dict)]
    assert stream[-1][0] == errno.ENOBUFS
    assert stream[-1][1].endswith(
        "this attach is ended, and pid 8 has ended, its output and end kept:"
        " attach again to read on"
    )
    client.send("sdexec.wait", {"label": "w"}, matchtag=2)
    await reaped_at_last(systemd, server)
    assert payloads(client.of(2))[0]["status"] == 3 << 8
    viewer.close()
    client.close()


@ensureDeferred
async def test_an_attach_behind_a_process_not_waitable_that_ended_says_it_goes(
    systemd,
):
    # Its `finished` waited behind the output lost, but a process that is
    # not waitable is forgotten at its reap: "runs on … attach again" was
    # false, the next attach ENOENT.
    systemd.stop_to_inactive = False  # a child keeps the unit, writing on
    server = make_server(systemd, **{"retained-output": "64K"})
    client = Client(server)
    viewer = attached_unread(systemd, server, client, label="a")
    await written(systemd, server, CONTROL_BYTES)
    await written(systemd, server, lines(0, 8))
    systemd.exit(UNIT, 3)
    tracked = tracked_of(server)
    await until(lambda: tracked.finished is not None, "finished")
    await written(systemd, server, lines(8, 65))
    read_everything(viewer)
    assert payloads(viewer.of(1))[-1][1].endswith(
        "this attach is ended, and pid 8 has ended and it is not waitable: it is"
        " forgotten once its unit is gone, its output with it"
    )
    await reaped_at_last(systemd, server)
    client.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=2)
    assert payloads(client.of(2)) == [
        (errno.ENOENT, "label 'a': not found (no such process)")
    ]
    viewer.close()
    client.close()


@ensureDeferred
async def test_what_a_lingering_unit_writes_past_its_end_may_end_the_attach_behind(
    systemd,
):
    # Its stream ended (EDEADLK: unkillable) while the client was behind,
    # and its children wrote on into the ring, past what the client had
    # not yet been sent: the feed read a dropped offset when the client
    # read again (ValueError out of resumeProducing, the connection lost).
    systemd.stop_to_inactive = False
    server = make_server(systemd, **{"retained-output": "64K"})
    client = Client(server)
    viewer = attached_unread(systemd, server, client, waitable=True)
    await written(systemd, server, CONTROL_BYTES)
    await written(systemd, server, lines(0, 8))
    assert viewer.protocol._paused
    server.units[UNIT].unkillable("unkillable user processes for job f1")
    await written(systemd, server, lines(8, 100))
    read_everything(viewer)
    stream = payloads(viewer.of(1))
    assert sent_data(viewer.of(1)) == CONTROL_BYTES
    assert stream[-1][0] == errno.ENOBUFS
    lost = re.search(r": (\d+) bytes of stdout it had not yet been sent", stream[-1][1])
    assert lost is not None and 0 < int(lost[1]) <= 8192  # (as the reads cut it)
    # Never sent, the end is the next wait's.
    client.send("sdexec.wait", {"label": "a"}, matchtag=2)
    assert payloads(client.of(2)) == [
        (errno.EDEADLK, "unkillable user processes for job f1")
    ]
    await reaped_at_last(systemd, server)
    viewer.close()
    client.close()


@ensureDeferred
async def test_a_revoked_user_s_attach_still_fed_is_ended_at_once(systemd, monkeypatch):
    # Its process's stream had ended, and its client had not read the end
    # yet: ended then, not after what it had not read.
    server = allowing_user(systemd)
    owner = Client(server)
    user = user_client(server, monkeypatch, BufferingTransport())
    owner.bg(label="a")
    systemd.run(UNIT, pid=8)
    user.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=2)
    await written(systemd, server, lines(0, 300))
    await finish(systemd, server)
    revoke_user(server)
    read_everything(user)
    stream = user.of(2)
    assert len(sent_data(stream)) < 300 * 1024
    assert payloads(stream)[-1] == ended_by_revocation("attach is ended")
    assert "finished" not in [
        p["type"] for p in payloads(stream) if isinstance(p, dict)
    ]
    user.close()
    owner.close()


@ensureDeferred
async def test_a_streaming_exec_s_output_waits_for_its_client_however_long(
    systemd, server
):
    # A foreground process's output is its client's: a pipe's back-pressure.
    viewer = unreading_client(server)
    viewer.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=8)
    process = server.units[UNIT]
    produce(systemd, "stdout", CONTROL_BYTES)
    await until(lambda: process.output._client_paused, "held back")
    server.clock.advance(3600)
    assert process.output._client_paused
    assert process.valve is viewer.protocol.valve
    viewer.transport.read()
    assert not process.output._client_paused
    viewer.close()


def test_an_attach_that_is_not_streaming_is_eproto(systemd, server, client):
    client.bg(label="b")
    client.raw(
        {
            "type": "request",
            "topic": "sdexec.attach",
            "matchtag": 2,
            "payload": {"label": "b"},
            "streaming": False,
        }
    )
    assert payloads(client.of(2)) == [(errno.EPROTO, "attach request is not streaming")]


@ensureDeferred
async def test_an_attach_sent_with_its_background_exec_waits_for_the_start(
    systemd, server, client
):
    # RFC 42 refuses an attach only for a process that does not exist, is
    # not in the background or has a client attached: one sent at once
    # behind its exec, by label, was EBUSY "not started yet" every time.
    client.bg(flags=WAITABLE, label="a")
    client.send("sdexec.attach", {"label": "a", "flags": FLAGS}, matchtag=2)
    assert client.of(2) == []
    other = Client(server)
    other.send("sdexec.attach", {"label": "a"})
    other.send("sdexec.wait", {"label": "a"}, matchtag=2)
    held = f"another connection, of uid {os.getuid()}"
    assert payloads(other.responses()) == [
        (
            errno.EBUSY,
            f"label 'a': already has a client attached (an attach on {held})",
        ),
        (errno.EBUSY, f"label 'a': has a client attached (an attach on {held})"),
    ]
    systemd.run(UNIT, pid=8)
    assert payloads(client.of(1)) == [{"type": "started", "pid": 8}]
    assert [p["type"] for p in payloads(client.of(2))] == ["attached"]
    produce(systemd, "stdout", b"live\n")
    await until(lambda: output_of(client.of(2)), "live output")
    await finish(systemd, server, status=0)
    stream = client.of(2)
    assert output_of(stream)[0] == ("stdout", b"live\n", False)
    assert payloads(stream)[-1] == (errno.ENODATA, "")
    other.close()


def test_an_attach_waiting_for_a_start_that_fails_gets_the_exec_s_error(
    systemd, server, client
):
    client.bg(label="a")
    client.send("sdexec.attach", {"label": "a"}, matchtag=2)
    failed_to_exec = {"ActiveState": "failed", "ExecMainCode": 1, "ExecMainStatus": 203}
    systemd.change(UNIT, {**failed_to_exec, "Result": "exit-code"})
    # Answered once its unit is gone, or (here) FAILED_UNIT_WAIT later.
    server.clock.advance(FAILED_UNIT_WAIT)
    (refused,) = payloads(client.of(1))
    assert refused[0] == errno.ENOENT
    assert payloads(client.of(2)) == [refused]
    # Not yet reaped: a later attach is told it never started.
    client.send("sdexec.attach", {"label": "a"}, matchtag=3)
    (later,) = payloads(client.of(3))
    assert later == (errno.ENOENT, f"label 'a': never started: {refused[1]}")


@ensureDeferred
async def test_an_attach_waiting_for_the_start_ends_with_its_connection(
    systemd, server, client
):
    client.bg(label="a")
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "a"})
    viewer.close()
    systemd.run(UNIT, pid=8)
    client.send("sdexec.list", {"detail": True}, matchtag=2)
    assert client.last()["payload"]["procs"][0]["mode"] == "background"
    produce(systemd, "stdout", b"kept\n")
    await until(lambda: tracked_of(server).retained.held == 5, "retained")
    client.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=3)
    assert output_of(client.of(3)) == [("stdout", b"kept\n", False)]


@ensureDeferred
async def test_attach_errors(systemd, server, client):
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "s"}})
    systemd.run(UNIT, pid=3)
    client.send("sdexec.attach", {"pid": 3}, matchtag=2)
    client.send("sdexec.attach", {"pid": 4}, matchtag=3)
    client.send("sdexec.attach", {"pid": 3, "flags": 8}, matchtag=4)
    assert [payloads(client.of(tag)) for tag in (2, 3, 4)] == [
        [(errno.EBUSY, "pid 3: not in background mode")],
        [(errno.ENOENT, "pid 4: not found (no such process)")],
        [(errno.EINVAL, "flags: expected an integer of 1|2|4, got 8")],
    ]


@ensureDeferred
async def test_the_channel_flag_is_ignored_where_rfc_42_lets_a_client_send_it(
    systemd, server, client
):
    # flux-core's attach sets it whenever its caller takes channel output,
    # and RFC 42 ignores it on a background exec; both were EINVAL (review
    # session 40 P F4). There are no channels: nothing more comes of it.
    client.bg(flags=FLAGS | 4, label="c")
    systemd.run(UNIT, pid=3)
    assert payloads(client.of(1)) == [{"type": "started", "pid": 3}]
    client.send("sdexec.attach", {"pid": 3, "flags": 7}, matchtag=2)
    assert [answer["type"] for answer in payloads(client.of(2))] == ["attached"]


@ensureDeferred
async def test_attach_to_an_ended_waitable_process_then_it_is_reaped(
    systemd, server, client
):
    await an_ended_waitable(systemd, server, client, "z", 9, 2)
    client.send("sdexec.attach", {"label": "z", "flags": FLAGS}, matchtag=2)
    stream = payloads(client.of(2))
    assert stream[0]["type"] == "attached"
    assert stream[1:] == [
        {"type": "output", "pid": 9, "io": {"stream": "stdout", "rank": "0",
                                             "eof": True}},
        {"type": "output", "pid": 9, "io": {"stream": "stderr", "rank": "0",
                                             "eof": True}},
        {"type": "finished", "status": 2 << 8},
        (errno.ENODATA, ""),
    ]  # fmt: skip
    client.send("sdexec.wait", {"label": "z"}, matchtag=3)
    assert payloads(client.of(3)) == [
        (errno.ESRCH, "label 'z': not found (no such process)")
    ]


@settings(derandomize=True, max_examples=200, deadline=None)
@given(topic=st.sampled_from(["sdexec.wait", "sdexec.attach"]),
       payload=malformed_target_payloads)  # fmt: skip
def test_any_wait_or_attach_payload_gets_one_clear_error(topic, payload):
    manager = FakeManager()
    client = Client(make_server(manager))
    client.send(topic, payload)
    (response,) = client.responses()
    errnum, errstr = error_of(response)
    if errnum == errno.EPROTO:  # text JSON cannot carry (lone surrogates)
        return
    assert errnum in (errno.EINVAL, errno.ENOENT, errno.ESRCH)
    assert errstr.startswith(("pid", "label", "flags", "wait needs", "attach needs"))
    client.close()
    manager.close()


@ensureDeferred
async def test_a_connection_paused_for_other_reasons_keeps_no_slot(systemd):
    # Only a wait answer or an attach replay is written whatever the client
    # reads: a background exec's `started` is a few bytes. Its connection,
    # paused by answers it has not read, kept the slots of the background
    # processes it had started once they ended, for as long as it did not
    # read: another client was refused.
    server = make_server(systemd, **{"max-background": 2})
    slow, other = unreading_client(server), Client(server)
    slow.bg(matchtag=1, SDEXEC_NAME="sdexec-a")
    slow.bg(matchtag=2, SDEXEC_NAME="sdexec-b")
    systemd.run("sdexec-a.service", pid=10)
    systemd.run("sdexec-b.service", pid=11)
    for matchtag in range(101, 10_000):  # answers it does not read
        if slow.protocol._paused:
            break
        slow.send("sdexec.stats-get", {}, matchtag=matchtag)
    else:
        raise AssertionError("the connection never paused")
    for unit in ("sdexec-a.service", "sdexec-b.service"):
        systemd.exit(unit, status=0)
    await until(lambda: not server.processes, "reaped")
    other.bg(matchtag=3, SDEXEC_NAME="sdexec-c")
    assert ("start", "sdexec-c.service") in systemd.calls
    slow.close()
    other.close()


@ensureDeferred
async def test_an_unread_wait_answer_takes_no_background_slot(systemd):
    # Kept for a wait, the ended process held a waitable slot only; its
    # answer unread, it took a background slot as well.
    server = make_server(
        systemd, **{"max-background": 1, "max-waitable": 4, "retained-output": "64K"}
    )
    client, sleeper = Client(server), unreading_client(server)
    await ended_with_output(systemd, server, client, ["sdexec-w1"])
    sleeper.send("sdexec.wait", {"label": "sdexec-w1"}, matchtag=1)
    assert server.tracked.waitable_held() == 1  # the answer, unread
    client.bg(matchtag=3, SDEXEC_NAME="sdexec-x")
    assert ("start", "sdexec-x.service") in systemd.calls
    sleeper.close()
    client.close()


# -- found by a review (notes/review-session26-B.md) ------------------------


def waitable_job_running(systemd, client) -> None:
    """A waitable background job ``f1`` (label ``j``), its unit running as
    pid 8; a stop makes it inactive."""
    systemd.stop_to_inactive = True
    client.bg(flags=WAITABLE, label="j", SDEXEC_JOBID="f1")
    systemd.run(UNIT, pid=8)


async def reaped_at_last(systemd, server) -> None:
    """What lingered in the unit is gone at last: it is reaped, and nothing
    is listed."""
    systemd.release(UNIT)
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    await until(lambda: not server.processes, "reaped")
    assert server.list()["procs"] == []


def abandoned(systemd, server, client, flags: int, label: str) -> None:
    """A background process whose unit the stop timer gave up on: its
    stream ended (EDEADLK, nobody attached), its unit still there."""
    systemd.stop_to_inactive = True
    client.bg(flags=flags, label=label, SDEXEC_STOP_TIMER_SEC="1")
    systemd.run(UNIT, pid=8)
    systemd.exit(UNIT, 0)
    systemd.deactivate(UNIT)  # a child lingers
    server.clock.advance(1)
    server.clock.advance(1)
    assert server.drain_reason is not None


@pytest.mark.parametrize("flags", [0, WAITABLE], ids=["background", "waitable"])
@ensureDeferred
async def test_an_attach_after_the_stream_ended_gets_its_end_at_once(
    systemd, server, client, flags
):
    # The Process sends its end once: an attach after it, its unit still
    # lingering, got the replay and then nothing, ever (a waitable one
    # stayed attached, its wait EBUSY).
    abandoned(systemd, server, client, flags, "a")
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "a", "flags": 3}, matchtag=1)
    stream = payloads(viewer.of(1))
    # (No EOFs: the lingering child holds the outputs open.)
    assert [p["type"] for p in stream[:-1]] == ["attached", "finished"]
    assert stream[-1][0] == errno.EDEADLK
    systemd.release(UNIT)
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    await until(lambda: not server.processes, "reaped")
    client.send("sdexec.wait", {"label": "a"}, matchtag=2)
    assert payloads(client.of(2))[0][0] == errno.ESRCH  # the attach had its end
    assert server.list()["procs"] == []
    viewer.close()


@ensureDeferred
async def test_an_attach_to_an_unkillable_job_gets_its_edeadlk(systemd, server, client):
    waitable_job_running(systemd, client)
    server.units[UNIT].unkillable("unkillable user processes for job f1")
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "j"}, matchtag=1)
    assert payloads(viewer.of(1))[-1] == (
        errno.EDEADLK,
        "unkillable user processes for job f1",
    )
    await reaped_at_last(systemd, server)
    viewer.close()


@pytest.mark.parametrize("with_status", [False, True], ids=["upstream", "extension"])
@ensureDeferred
async def test_a_wait_made_while_the_unit_lingers_is_answered_at_once(
    systemd, server, client, with_status
):
    # The stop timer gave up on a child (the main process exited 0): the
    # wait was answered only at reap, so never while the child lived, and
    # every attach meanwhile was EBUSY "a wait is pending".
    abandoned(systemd, server, client, WAITABLE, "a")
    waiter = Client(server)
    target = {"label": "a", **({"status_and_error": True} if with_status else {})}
    waiter.send("sdexec.wait", target, matchtag=1)
    (answer,) = payloads(waiter.of(1))
    unkillable = (
        errno.EDEADLK,
        f"unkillable user processes in unit {UNIT}: still deactivating 2s after"
        " its stop signalled every process left in it; tried since: SIGUSR1 once"
        " to them, 1s ago; the node is drained",
    )
    if with_status:
        # The status, with what an attach gets as its EDEADLK beside it
        # (review 38 T4-2), where the waiter asked for both.
        assert answer["status"] == 0
        assert answer["error"] == {"errnum": unkillable[0], "errstr": unkillable[1]}
    else:
        # That error alone, as upstream's sdexec answers it: Flux's bgexec
        # drains the rank on it, and read a status of 0 as a clean exit
        # (review session 40 P F3).
        assert answer == unkillable
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "a"}, matchtag=1)
    assert payloads(viewer.of(1)) == [
        (errno.ENOENT, "label 'a': has ended, and its end went to a wait")
    ]
    waiter.send("sdexec.wait", {"label": "a"}, matchtag=2)
    assert payloads(waiter.of(2)) == [
        (errno.ESRCH, "label 'a': has ended, and its end went to a wait")
    ]
    await reaped_at_last(systemd, server)


@pytest.mark.parametrize("with_status", [False, True], ids=["upstream", "extension"])
@ensureDeferred
async def test_a_pending_wait_gets_an_unkillable_job_s_edeadlk(
    systemd, server, client, with_status
):
    # docs/protocol.md names this EDEADLK as what a wait answers; it waited
    # for a reap that the job's unkillable processes never let come.
    waitable_job_running(systemd, client)
    produce(systemd, "stdout", b"ignoring TERM\n")
    retained = tracked_of(server).retained
    await until(lambda: retained.io_objects("0"), "output retained")
    waiter = Client(server)
    target = {"label": "j", **({"status_and_error": True} if with_status else {})}
    waiter.send("sdexec.wait", target, matchtag=1)
    assert payloads(waiter.of(1)) == []  # running: the wait waits
    server.units[UNIT].unkillable("unkillable user processes for job f1")
    (answer,) = payloads(waiter.of(1))
    unkillable = (errno.EDEADLK, "unkillable user processes for job f1")
    if with_status:
        # Its output, which an attach replays too, and the error beside it;
        # no status: the job's end is the error (review 42 T2).
        assert answer == {
            "output": retained.io_objects("0"),
            "dropped": {"stdout": 0, "stderr": 0},
            "error": {"errnum": unkillable[0], "errstr": unkillable[1]},
        }
        assert [decode_io(io)[:2] for io in answer["output"]] == [
            ("stdout", b"ignoring TERM\n")
        ]
    else:
        assert answer == unkillable  # upstream's answer: the error alone
    await reaped_at_last(systemd, server)


def test_kill_wait_and_attach_by_a_reused_pid_name_the_newest(systemd, server, client):
    client.bg(label="old", matchtag=1)
    systemd.run(UNIT, pid=100)
    systemd.exit(UNIT, 0)
    systemd.deactivate(UNIT)  # a child lingers: the unit stays, its pid free
    client.bg(label="new", matchtag=2, SDEXEC_NAME="sdexec-new")
    systemd.run("sdexec-new.service", pid=100)  # the pid, reused
    viewer = Client(server)
    viewer.send("sdexec.attach", {"pid": 100, "flags": 0}, matchtag=1)
    assert payloads(viewer.of(1))[0]["cmd"]["label"] == "new"
    client.send("sdexec.kill", {"pid": 100, "signum": 10}, matchtag=4)
    assert systemd.signalled[-1] == ("sdexec-new.service", 10)
    viewer.close()


@ensureDeferred
async def test_a_reused_pid_names_the_newest_also_once_it_has_ended(
    systemd, server, client
):
    # The newest with pid 100 ended (kept for a wait): wait and attach name
    # it, and a kill must not signal the older unit lingering with that pid.
    client.bg(label="old", matchtag=1)
    systemd.run(UNIT, pid=100)
    systemd.exit(UNIT, 0)
    systemd.deactivate(UNIT)  # a child lingers: the unit stays, its pid free
    client.bg(flags=WAITABLE, label="new", matchtag=2, SDEXEC_NAME="sdexec-new")
    systemd.run("sdexec-new.service", pid=100)
    systemd.exit("sdexec-new.service", 3)
    await until(lambda: len(server.processes) == 1, "the new one reaped")
    client.send("sdexec.kill", {"pid": 100, "signum": 10}, matchtag=3)
    assert payloads(client.of(3))[0][0] == errno.ESRCH
    assert systemd.signalled == []
    client.send("sdexec.wait", {"pid": 100}, matchtag=4)
    assert payloads(client.of(4))[0]["status"] == 3 << 8


@ensureDeferred
async def test_a_process_is_findable_until_reaped_or_its_end_is_consumed(
    systemd, server, client
):
    # Found through an index by pid and label (a walk of every process per
    # kill held the reactor a second for a read of kills at 2000): each
    # leaves it when nothing can name it any more.
    client.bg(flags=WAITABLE, label="kept", matchtag=1)
    systemd.run(UNIT, pid=100)
    client.bg(label="plain", matchtag=2, SDEXEC_NAME="sdexec-plain")
    systemd.run("sdexec-plain.service", pid=200)
    assert server.find(pid=200).label == "plain"
    for unit in (UNIT, "sdexec-plain.service"):
        systemd.exit(unit, 0)
    await until(lambda: not server.processes, "both reaped")
    assert server.tracked.newest(200, None) is None  # reaped, not kept
    client.send("sdexec.wait", {"label": "kept"}, matchtag=3)  # consumes it
    assert payloads(client.of(3))[0]["status"] == 0
    assert server.tracked.newest(100, None) is None
    assert (server.tracked._by_pid, server.tracked._by_label) == ({}, {})


@ensureDeferred
async def test_a_waitable_process_whose_client_left_before_started_keeps_its_end(
    systemd, server
):
    client = Client(server)
    client.streaming_waitable("s")
    client.close()  # before started: SIGKILLed once it runs
    systemd.run(UNIT, pid=5)  # it did run
    systemd.change(UNIT, {**EXITED, "ExecMainCode": 2, "ExecMainStatus": 9})
    assert (await gone_then_waited(systemd, server, "s"))["status"] == signal.SIGKILL


@ensureDeferred
async def test_an_attach_whose_replay_fills_its_connection_holds_nothing_back(
    systemd, server, client
):
    # The process reads on, as with nobody attached: what the client has
    # not read waits in the retained output.
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    tracked = tracked_of(server)
    line = b"y" * 1023 + b"\n"
    for count in range(1, 6):  # 300 KiB: more than the connection's 256 KiB
        produce(systemd, "stdout", line * 60)
        await until(
            lambda count=count: tracked.retained.held == count * 60 * 1024, "retained"
        )
    viewer = unreading_client(server)
    viewer.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=1)
    assert viewer.protocol._paused
    assert not server.units[UNIT].output._client_paused
    viewer.close()


def test_an_attach_replay_stays_within_11_times_retained_output(systemd):
    # A message per run: output alternating streams in 32-byte runs of
    # control characters is the costliest replay (docs/protocol.md).
    size = 64 * 1024
    server = make_server(systemd, **{"retained-output": str(size)})
    client = Client(server)
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    run = b"\x01" * 31 + b"\n"
    for index in range(size // len(run) * 2):
        tracked_of(server).retained.append(("stdout", "stderr")[index % 2], run)
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "a"}, matchtag=1)
    assert 8 * size < len(viewer.transport.value()) <= 11 * size
    viewer.close()
    client.close()


# -- found by a review (notes/review-session29-AB.md) ------------------------


def lingering_waitable(systemd, client, label: str) -> None:
    """A waitable background process that exited 3, a child keeping its
    unit (deactivating, tabled)."""
    systemd.stop_to_inactive = True
    client.bg(flags=WAITABLE, label=label)
    systemd.run(UNIT, pid=8)
    systemd.exit(UNIT, 3)
    systemd.deactivate(UNIT)


def attached_once(server, label: str) -> list:
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": label}, matchtag=1)
    stream = payloads(viewer.of(1))
    viewer.close()
    return stream


@ensureDeferred
async def test_an_end_an_attach_consumed_is_not_waited_for_while_the_unit_lingers(
    systemd, server, client
):
    # RFC 42: a waitable process whose `finished` reached an attached client
    # "SHALL NOT be waited on or attached to again"; a wait still got it.
    lingering_waitable(systemd, client, "w")
    assert {"type": "finished", "status": 3 << 8}.items() <= attached_once(server, "w")[
        1
    ].items()
    client.send("sdexec.wait", {"label": "w"}, matchtag=2)
    assert payloads(client.of(2)) == [
        (errno.ESRCH, "label 'w': has ended, and its end went to an attached client")
    ]
    again = attached_once(server, "w")
    assert again == [
        (errno.ENOENT, "label 'w': has ended, and its end went to an attached client")
    ]
    await reaped_at_last(systemd, server)


@pytest.mark.parametrize("flags", [0, WAITABLE], ids=["background", "waitable"])
def test_one_attach_has_the_replay_of_an_ended_stream_whose_unit_lingers(
    systemd, server, client, flags
):
    # Each attach got the whole replay and detached at once: any number of
    # connections could hold one unread, past max-background's bound.
    abandoned(systemd, server, client, flags, "a")
    first = attached_once(server, "a")
    assert first[0]["type"] == "attached" and first[-1][0] == errno.EDEADLK
    assert attached_once(server, "a") == [
        (errno.ENOENT, "label 'a': has ended, and its end went to an attached client")
    ]


@ensureDeferred
async def test_an_error_end_an_attached_client_saw_is_not_kept(systemd, server, client):
    # Only `finished` counted as delivered: an EDEADLK seen live kept the
    # process, and its max-waitable slot, for a wait to get it again.
    waitable_job_running(systemd, client)
    viewer = Client(server)
    viewer.send("sdexec.attach", {"label": "j"}, matchtag=1)
    server.units[UNIT].unkillable("unkillable user processes for job f1")
    assert payloads(viewer.of(1))[-1][0] == errno.EDEADLK
    await reaped_at_last(systemd, server)
    viewer.close()


IN_USE = (errno.EEXIST, "matchtag 7 is already in use")


def test_no_attach_or_background_exec_takes_a_running_stream_s_matchtag(
    systemd, server, client
):
    # Only a second streaming exec was refused: an attach or a background
    # exec on the matchtag of a running stream was taken, and the two
    # streams' responses, two ENODATA among them, interleaved on it
    # (review 38 H2-1).
    client.bg(label="b", SDEXEC_NAME="sdexec-b")
    systemd.run("sdexec-b.service", pid=8)
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": STREAMED}, matchtag=7)
    systemd.run("sdexec-s.service", pid=9)
    client.send("sdexec.attach", {"label": "b", "flags": FLAGS}, matchtag=7)
    client.bg(matchtag=7, SDEXEC_NAME="sdexec-c")
    client.send("sdexec.wait", {"label": "b"}, matchtag=7)
    assert payloads(client.of(7))[1:] == [IN_USE, IN_USE, IN_USE]
    assert ("start", "sdexec-c.service") not in systemd.calls
    (b,) = [t for t in server.tracked._tracked.values() if t.label == "b"]
    assert not b.attached


def test_no_exec_takes_an_attached_stream_s_matchtag(systemd, server, client):
    client.bg(label="b")
    systemd.run(UNIT, pid=8)
    client.send("sdexec.attach", {"label": "b", "flags": FLAGS}, matchtag=7)
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": STREAMED}, matchtag=7)
    assert payloads(client.of(7))[-1] == IN_USE
    assert ("start", "sdexec-s.service") not in systemd.calls


def test_a_background_exec_holds_its_matchtag_until_its_one_response(
    systemd, server, client
):
    client.bg(matchtag=7, SDEXEC_NAME="sdexec-a")
    client.bg(matchtag=7, SDEXEC_NAME="sdexec-b")  # before a's started
    assert payloads(client.of(7)) == [IN_USE]
    systemd.run("sdexec-a.service", pid=8)
    client.bg(matchtag=7, SDEXEC_NAME="sdexec-b")  # answered: free again
    assert ("start", "sdexec-b.service") in systemd.calls


def test_a_refused_request_leaves_its_matchtag_free(systemd, server, client):
    client.send("sdexec.attach", {"label": "nobody", "flags": FLAGS}, matchtag=7)
    assert error_of(client.last())[0] == errno.ENOENT
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": STREAMED}, matchtag=7)
    assert ("start", "sdexec-s.service") in systemd.calls


@pytest.mark.parametrize("topic", ["sdexec.wait", "sdexec.attach"])
@ensureDeferred
async def test_a_job_ended_unkillable_is_answered_so_after_its_reap_too(
    systemd, server, client, topic
):
    # Its main process exited after the verdict, its status noted at the
    # reap: a later wait got that status with the EDEADLK "after the
    # command finished", and a later attach a finished before it, where the
    # stream (and a wait made before the reap) ended with the EDEADLK alone
    # (review 38 R3-1).
    waitable_job_running(systemd, client)
    server.units[UNIT].unkillable("unkillable user processes for job f1")
    systemd.exit(UNIT, 0)
    systemd.release(UNIT)
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    await until(lambda: not server.processes, "reaped")
    viewer = Client(server)
    viewer.send(topic, {"label": "j", "flags": FLAGS}, matchtag=1)
    answers = payloads(viewer.of(1))
    assert answers[-1] == (errno.EDEADLK, "unkillable user processes for job f1")
    assert not any(isinstance(p, dict) and p.get("type") == "finished" for p in answers)
    assert not any(isinstance(p, dict) and "status" in p for p in answers)
    viewer.close()


# -- a reload taking the user out of allow-users -----------------------------------

#: A user of ``allow-users`` (not the service's owner, this test's uid).
USER = os.getuid() + 1


def allowing_user(systemd) -> SdexecServer:
    return make_server(systemd, **{"allow-users": [USER]})


def user_client(
    server: SdexecServer, monkeypatch, transport: BufferingTransport | None = None
) -> Client:
    """A connection from :data:`USER` (on ``transport``, if given)."""
    with monkeypatch.context() as patch:
        patch.setattr(sdexec.connection, "peer_uid", lambda sock: USER)
        return Client(server, transport)


def revoke_user(server: SdexecServer) -> list[str]:
    """A reload takes :data:`USER` out of ``allow-users``: what it logged."""
    config = parse_config({})
    with capturedLogs() as events:
        server.reconfigure(config, Containment(config, None))
    return [formatEvent(event) for event in events]


def ended_by_revocation(request: str) -> tuple[int, str]:
    return (
        errno.EPERM,
        f"uid {USER} is no longer in [sdexec] allow-users (a reload took it"
        f" out): this {request}",
    )


@ensureDeferred
async def test_a_revoked_user_s_wait_ends_and_the_owner_s_wait_has_the_status(
    systemd, monkeypatch
):
    # Left pending, it kept the one waiter slot (the owner's wait was EINVAL)
    # and, answered, took the owner's status and output for good (review
    # session 41 K-1).
    server = allowing_user(systemd)
    owner, user = Client(server), user_client(server, monkeypatch)
    owner.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    user.send("sdexec.wait", {"label": "w"}, matchtag=2)
    logged = revoke_user(server)
    assert payloads(user.of(2)) == [
        ended_by_revocation("wait is ended, and pid 7's end is kept for the next wait")
    ]
    said = (
        f"uid {USER} is no longer in [sdexec] allow-users: each request on its"
        " 1 open connection(s) is refused from now on, and the 1 wait(s) and"
        " attach(es) they held are ended; what they started runs on"
    )
    assert [line for line in logged if line.startswith(said)], logged
    owner.send("sdexec.wait", {"label": "w"}, matchtag=2)
    assert owner.of(2) == []  # pending: the slot is free
    produce(systemd, "stdout", b"the owner's\n")
    await until(lambda: tracked_of(server).retained.held == 12, "retained")
    await finish(systemd, server, status=5)
    (answer,) = payloads(owner.of(2))
    assert answer["status"] == 5 << 8
    assert [decode_io(io)[:2] for io in answer["output"]] == [
        ("stdout", b"the owner's\n")
    ]
    assert len(user.responses()) == 1  # nothing more went to the user
    user.close()
    owner.close()


@ensureDeferred
async def test_a_revoked_user_s_write_is_eperm_and_its_exec_reads_eof(
    systemd, monkeypatch
):
    # Every write of a revoked user is refused, its EOF too: its exec's
    # stdin stayed open, and a process reading it (cat) waited for ever.
    server = allowing_user(systemd)
    user = user_client(server, monkeypatch)
    user.send("sdexec.exec", {"flags": FLAGS, "cmd": STREAMED})
    systemd.run("sdexec-s.service", pid=9)
    io = encode_io("stdin", "0", b"before\n")
    user.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=2)
    revoke_user(server)
    io = encode_io("stdin", "0", b"after\n", eof=True)
    user.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=2)
    assert payloads(user.of(2)) == [
        (errno.EPERM, f"{revoked(USER)}: this connection may make no more requests")
    ]
    stdin = systemd.process_fd("sdexec-s.service", "stdin")
    assert await read_to_eof(stdin) == b"before\n"
    produce(systemd, "stdout", b"still streamed\n", unit="sdexec-s.service")
    await until(lambda: output_of(user.of(1)), "the exec's output")
    user.close()


@ensureDeferred
async def test_a_revoked_user_s_attach_ends_and_the_process_runs_on_in_background(
    systemd, monkeypatch
):
    server = allowing_user(systemd)
    owner, user = Client(server), user_client(server, monkeypatch)
    owner.bg(label="a")
    systemd.run(UNIT, pid=8)
    # The user's own exec, streaming (and waitable: tracked, as a waitable
    # process is, whatever its stream): it runs on, its stream open.
    mine = {**STREAMED, "label": "mine"}
    user.send("sdexec.exec", {"flags": FLAGS | WAITABLE, "cmd": mine})
    systemd.run("sdexec-s.service", pid=9)
    user.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=2)
    produce(systemd, "stdout", b"one\n")
    await until(lambda: output_of(user.of(2)), "live output")
    logged = revoke_user(server)
    assert payloads(user.of(2))[-1] == ended_by_revocation(
        "attach is ended, and pid 8 runs on in the background"
    )
    assert "\n".join(logged).count("the 1 wait(s) and attach(es)") == 1
    assert output_of(user.of(2)) == [("stdout", b"one\n", False)]
    owner.send("sdexec.list", {"detail": True}, matchtag=2)
    modes = {p["pid"]: p["mode"] for p in owner.last()["payload"]["procs"]}
    assert modes == {8: "background", 9: "streaming"}
    produce(systemd, "stdout", b"two\n")
    owner.send("sdexec.attach", {"label": "a", "flags": 1}, matchtag=3)
    await until(
        lambda: (
            b"".join(data for _, data, _ in output_of(owner.of(3))) == b"one\ntwo\n"
        ),
        "the owner's attach",
    )
    assert ("stop", UNIT) not in systemd.calls
    assert output_of(user.of(2)) == [("stdout", b"one\n", False)]
    produce(systemd, "stdout", b"mine\n", unit="sdexec-s.service")
    await until(lambda: output_of(user.of(1)), "the user's own exec's output")
    assert output_of(user.of(1)) == [("stdout", b"mine\n", False)]
    user.close()
    owner.close()
