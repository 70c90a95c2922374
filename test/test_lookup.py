"""A request's command looked up off the reactor's thread (sdexec/lookup.py):
a file system that does not answer holds the request that needs it, bounded
in time, and never the service's other clients. Offline: a lookup that
blocks until the test lets it go stands for the silent file system."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import socket
import threading
from collections.abc import Callable

import pytest
from offline import BufferingTransport, Connection, error_of, read_to_eof
from pytest_twisted import ensureDeferred
from support import sleep, until
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

import sdexec.connection
from sdexec import command as command_module
from sdexec import lookup as lookup_module
from sdexec.command import Command, Found
from sdexec.config import parse_config
from sdexec.connection import (
    MAX_BEHIND_LOOKUPS,
    MAX_FRAMES_BEHIND_LOOKUPS,
    SdexecServerFactory,
)
from sdexec.ioencode import encode_io
from sdexec.lograte import MAX_QUOTED
from sdexec.lookup import LOOKUP_TIMEOUT_S, ThreadedLookups, _Workers, first_missing
from sdexec.plan import RequestError
from sdexec.property import UnitProperty
from sdexec.protocol import ExecFlag
from sdexec.server import SdexecServer
from sdexec.testing import exec_plan

FLAGS = int(ExecFlag.STDOUT | ExecFlag.STDERR)
UNIT = "sdexec-t.service"


class SilentFileSystem:
    """Stands in for ``Command.find_executable``: blocks, in whichever
    thread calls it, until :meth:`answer` (for every command, or the one
    named); records the threads and the commands looked up."""

    def __init__(self) -> None:
        self.answered = threading.Event()
        self._answered_for: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.names: list[str] = []
        self.real = Command.find_executable

    def __call__(self, command: Command, default_cwd: str = "/") -> Found:
        name = command.cmdline[0]
        self.threads.append(threading.current_thread())
        self.names.append(name)
        if not name.startswith("/local/"):  # those answer
            answered_for = self._event(name)
            while not (self.answered.wait(0.01) or answered_for.is_set()):
                pass
        return self.real(command, default_cwd)

    def answer(self, name: str | None = None) -> None:
        if name is None:
            self.answered.set()
        else:
            self._event(name).set()

    def _event(self, name: str) -> threading.Event:
        with self._lock:
            return self._answered_for.setdefault(name, threading.Event())


@pytest.fixture
def silent(monkeypatch):
    """Every lookup waits on a file system until the test answers it."""
    file_system = SilentFileSystem()
    monkeypatch.setattr(
        Command,
        "find_executable",
        lambda command, default_cwd="/": file_system(command, default_cwd),
    )
    yield file_system
    file_system.answer()  # no thread is left waiting


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def lookups(clock):
    return ThreadedLookups(reactor, clock)


@ensureDeferred
async def test_a_lookup_runs_outside_the_reactor_s_thread(silent, lookups):
    silent.answer()
    found = await lookups.find(Command(["sh"], env={"PATH": "/bin"}), "/")
    assert found == Found("/bin/sh", None)
    assert silent.threads and silent.threads[0] is not threading.main_thread()
    assert lookups.stuck == 0


@ensureDeferred
async def test_a_lookup_stuck_in_its_thread_holds_no_other(silent, lookups):
    stuck = lookups.find(Command(["prog"]), "/")
    assert await lookups.find(Command(["/local/prog"]), "/") == Found(None, None)
    assert not stuck.called
    assert silent.threads[0] is not silent.threads[1]
    silent.answer()
    assert await stuck == Found(None, None)


@ensureDeferred
async def test_an_idle_worker_takes_the_next_lookup(silent, lookups):
    for _ in range(3):
        await lookups.find(Command(["/local/prog"]), "/")
    assert len(set(silent.threads)) == 1


@ensureDeferred
async def test_a_lookup_that_does_not_finish_is_refused_in_time(silent, lookups, clock):
    answer = lookups.find(Command(["prog"], cwd="/nfs/home/u"), "/")
    failures: list = []
    answer.addErrback(failures.append)
    clock.advance(LOOKUP_TIMEOUT_S - 0.1)
    assert not answer.called
    clock.advance(0.1)
    (failure,) = failures
    error = failure.value
    assert isinstance(error, RequestError)
    assert error.errnum == errno.ETIMEDOUT
    assert "'prog': looking it up from '/nfs/home/u' did not finish within 10 s" in (
        error.errstr
    )
    # Its thread waits on for the file system, and is done when it answers.
    assert lookups.stuck == 1
    assert silent.threads[0].is_alive()
    silent.answer()
    await until(lambda: lookups.stuck == 0, "the stuck lookup's end")


def test_an_absolute_command_that_times_out_names_its_file_system(
    silent, lookups, clock
):
    answer = lookups.find(Command(["/nfs/sw/bin/prog"]), "/")
    failures: list = []
    answer.addErrback(failures.append)
    clock.advance(LOOKUP_TIMEOUT_S)
    assert failures[0].value.errstr == (
        "'/nfs/sw/bin/prog': its file system did not answer within 10 s"
    )


@ensureDeferred
async def test_past_the_stuck_lookups_cap_a_request_is_refused_at_once(silent, clock):
    lookups = ThreadedLookups(reactor, clock, limit=2)
    for name in ("one", "two"):
        lookups.find(Command([name]), "/").addErrback(lambda _: None)
    # Slow, but not stuck yet: a third is looked up.
    await lookups.find(Command(["/local/three"]), "/")
    clock.advance(LOOKUP_TIMEOUT_S)  # now both are stuck
    assert lookups.stuck == 2
    failures: list = []
    lookups.find(Command(["four"]), "/").addErrback(failures.append)
    (failure,) = failures
    assert failure.value.errnum == errno.EAGAIN
    assert failure.value.errstr == (
        "four: not looked up: 2 lookups wait on a file system that does not answer"
    )


@ensureDeferred
async def test_a_user_s_stuck_lookups_do_not_refuse_the_owner_s(silent, clock):
    # A user of allow-users whose home hangs left the 16 threads stuck, and
    # every exec of the owner (the resource manager) was refused after.
    lookups = ThreadedLookups(reactor, clock, limit=2)
    for name in ("one", "two"):
        lookups.find(Command([name]), "/", uid=1001).addErrback(lambda _: None)
    clock.advance(LOOKUP_TIMEOUT_S)
    assert lookups.stuck == 2
    failures: list = []
    lookups.find(Command(["three"]), "/", uid=1001).addErrback(failures.append)
    (failure,) = failures
    assert (failure.value.errnum, failure.value.errstr) == (
        errno.EAGAIN,
        "three: not looked up: 2 lookups of uid 1001 wait on a file system that"
        " does not answer",
    )
    # The owner's lookup, and another user's, still run.
    await lookups.find(Command(["/local/prog"]), "/")
    await lookups.find(Command(["/local/prog"]), "/", uid=1002)
    silent.answer()
    await until(lambda: lookups.stuck == 0, "the stuck lookups' end")


@ensureDeferred
async def test_a_burst_of_quick_lookups_is_never_refused(silent, lookups):
    """Lookups answered in microseconds are counted off only on the
    reactor's next turn: 17 in one turn were refused as if stuck."""
    answers = [lookups.find(Command(["/local/prog"]), "/") for _ in range(40)]
    found = await defer.gatherResults(answers)
    assert found == [Found(None, None)] * 40
    assert lookups.stuck == 0


def test_a_lookup_with_no_thread_to_run_in_is_refused_and_leaves_nothing(
    monkeypatch, lookups, clock
):
    """The node's or the user's process limit reached (a job forking
    wildly under the same uid): each such exec is refused, and none keeps
    a slot of the stuck lookups' cap for good."""

    def no_thread(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    for _ in range(20):
        failures: list = []
        lookups.find(Command(["prog"]), "/").addErrback(failures.append)
        (failure,) = failures
        assert failure.value.errnum == errno.EAGAIN
        assert failure.value.errstr == (
            "prog: not looked up: no thread to look it up in (can't start new thread)"
        )
    assert lookups.stuck == 0
    assert clock.getDelayedCalls() == []


def test_an_absolute_command_does_not_touch_the_working_directory(monkeypatch):
    """A job shell's path is absolute, its working directory the user's
    (often on a network file system): nothing needs the latter."""

    def refuse(*args, **kwargs):
        raise AssertionError("the working directory was opened")

    monkeypatch.setattr(command_module, "_opened_directory", refuse)
    found = Command(["/bin/sh"], cwd="/nfs/home/u").find_executable()
    assert found == Found("/bin/sh", None)
    with pytest.raises(AssertionError, match="working directory was opened"):
        Command(["sh"], env={"PATH": "bin"}, cwd="/nfs/home/u").find_executable()


# -- the server: one connection's exec waits, no other client does -------------


class WatchedLookups:
    """The server's lookups, counting those not answered yet: a lookup's end
    for the server (one that timed out was answered then, and its thread
    is counted in ``ThreadedLookups.stuck`` until it ends)."""

    def __init__(self, lookups: ThreadedLookups) -> None:
        self.lookups = lookups
        self.unanswered = 0

    def find(
        self, command: Command, default_cwd: str, uid: int | None = None
    ) -> defer.Deferred[Found]:
        self.unanswered += 1
        answer = self.lookups.find(command, default_cwd, uid)
        answer.addBoth(self._answered)
        return answer

    def _answered(self, outcome):
        self.unanswered -= 1
        return outcome


@pytest.fixture
def server(systemd, lookups, clock):
    return SdexecServer(
        systemd,
        parse_config({}),
        reactor,
        clock=clock,
        lookups=WatchedLookups(lookups),
    )


def _exec(connection: Connection, matchtag: int = 1) -> None:
    connection.send(
        "sdexec.exec",
        {
            "flags": FLAGS,
            "cmd": {"cmdline": ["true"], "opts": {"SDEXEC_NAME": "sdexec-t"}},
        },
        matchtag=matchtag,
    )


def _topics(connection: Connection) -> list[tuple[str, int]]:
    return [(r["topic"], r["matchtag"]) for r in connection.responses()]


@ensureDeferred
async def test_other_clients_are_served_while_a_lookup_waits(silent, systemd, server):
    waiting, other = Connection(server), Connection(server)
    _exec(waiting)
    other.send("sdexec.list", {}, matchtag=7)
    assert _topics(other) == [("sdexec.list", 7)]
    silent.answer()
    await until(lambda: ("start", UNIT) in systemd.calls, "the start")
    systemd.run(UNIT, pid=42)
    assert waiting.last()["payload"] == {"type": "started", "pid": 42}
    waiting.close()
    other.close()


@ensureDeferred
async def test_a_kill_by_pid_is_answered_while_a_lookup_is_stuck(
    silent, systemd, server
):
    # The connection's every request waited for the lookup: a resource
    # manager's one connection, its kills of running jobs included, was
    # held up to 10 s per exec behind a file system that did not answer.
    # A list still waits for the exec, which it shows.
    connection = Connection(server)
    _exec(connection)
    connection.send("sdexec.list", {}, matchtag=2)
    _kill_unknown(connection, 3)
    assert _topics(connection) == [("sdexec.kill", 3)]
    assert error_of(connection.last()) == (errno.ESRCH, "kill pid=999999 not found")
    silent.answer()
    await until(lambda: len(connection.responses()) == 2, "the list")
    assert len(connection.last()["payload"]["procs"]) == 1
    connection.close()


def _kill_unknown(connection: Connection, matchtag: int) -> None:
    """A kill of a pid nobody runs: answered (ESRCH) at once, lookups or not."""
    connection.send("sdexec.kill", {"signum": 15, "pid": 999999}, matchtag=matchtag)


def _write(connection: Connection, matchtag: int, data: bytes, eof=False) -> None:
    io = encode_io("stdin", "0", data, eof=eof)
    connection.send("sdexec.write", {"matchtag": matchtag, "io": io}, matchtag=0)


@ensureDeferred
async def test_writes_to_an_exec_being_looked_up_reach_it_in_order(
    silent, systemd, server
):
    connection = Connection(server)
    _exec(connection)
    _write(connection, 1, b"first ")
    _kill_unknown(connection, 2)  # answered meanwhile
    _write(connection, 1, b"second\n", eof=True)
    assert _topics(connection) == [("sdexec.kill", 2)]
    silent.answer()
    await until(lambda: ("start", UNIT) in systemd.calls, "the start")
    stdin = systemd.process_fd(UNIT, "stdin")
    assert await read_to_eof(stdin) == b"first second\n"
    connection.close()


@ensureDeferred
async def test_a_kill_by_the_label_of_an_exec_being_looked_up_applies_to_it(
    silent, systemd, server
):
    connection = Connection(server)
    cmd = {"cmdline": ["true"], "label": "job", "opts": {"SDEXEC_NAME": "sdexec-t"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=1)
    connection.send("sdexec.kill", {"signum": 10, "label": "job"}, matchtag=2)
    _kill_unknown(connection, 3)  # answered meanwhile
    assert _topics(connection) == [("sdexec.kill", 3)]
    silent.answer()
    await until(lambda: ("start", UNIT) in systemd.calls, "the start")
    systemd.run(UNIT, pid=42)  # the kill was held for the start, not ESRCH
    assert systemd.kills() == [10]
    assert connection.last() == {
        "type": "response",
        "topic": "sdexec.kill",
        "matchtag": 2,
        "payload": {},
    }
    connection.close()


@ensureDeferred
async def test_an_exec_reusing_a_looked_up_exec_s_matchtag_is_eexist(
    silent, systemd, server
):
    connection = Connection(server)
    _exec(connection)
    _exec(connection)  # the same matchtag
    _kill_unknown(connection, 2)  # answered meanwhile
    assert _topics(connection) == [("sdexec.kill", 2)]
    silent.answer()
    await until(lambda: len(connection.responses()) == 2, "the second's refusal")
    assert error_of(connection.last())[0] == errno.EEXIST
    assert _starts(systemd) == [UNIT]
    connection.close()


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("topic", ["sdexec.wait", "sdexec.attach"])
@ensureDeferred
async def test_a_wait_or_attach_on_a_looked_up_exec_s_matchtag_is_eexist(
    silent, systemd, server, topic, streaming
):
    # Handled at once while the exec's command was looked up, it took the
    # matchtag first: an attach's stream and the exec's shared it (their
    # responses could not be told apart), and a wait's had the exec refused
    # EEXIST, where docs/protocol.md refuses the later request.
    connection = Connection(server)
    background = {"flags": 16, "cmd": _cmd("sdexec-b", label="b")}
    connection.raw(_envelope("sdexec.exec", background, 1, streaming=False))
    silent.answer("true")
    await until(lambda: _starts(systemd) == ["sdexec-b.service"], "b's start")
    systemd.run("sdexec-b.service", pid=8)
    looked_up = {"flags": FLAGS, "cmd": {**_cmd(UNIT), "cmdline": ["sleep"]}}
    connection.raw(_envelope("sdexec.exec", looked_up, 7, streaming=streaming))
    connection.send(topic, {"label": "b", "flags": FLAGS}, matchtag=7)
    assert _topics(connection) == [("sdexec.exec", 1)]  # both wait for the lookup
    silent.answer()
    await until(lambda: len(connection.responses()) == 2, "the refusal")
    assert (connection.last()["topic"], error_of(connection.last())) == (
        topic,
        (errno.EEXIST, "matchtag 7 is already in use"),
    )
    assert _starts(systemd) == ["sdexec-b.service", UNIT]
    connection.close()


@ensureDeferred
async def test_past_the_cap_of_requests_behind_lookups_reading_pauses(
    silent, systemd, server
):
    connection = Connection(server)
    _exec(connection)
    _kill_unknown(connection, 2)  # answered: below the cap
    for _ in range(MAX_BEHIND_LOOKUPS - 1):  # with the lookup, the cap
        _write(connection, 1, b"x")
    assert connection.transport.producerState == "paused"
    assert server.hangups.fileno() != -1  # the client's close is watched for
    _kill_unknown(connection, 3)  # held, in order
    assert _topics(connection) == [("sdexec.kill", 2)]
    silent.answer()
    await until(lambda: len(connection.responses()) == 2, "the held kill")
    assert _topics(connection) == [("sdexec.kill", 2), ("sdexec.kill", 3)]
    assert connection.transport.producerState == "producing"
    assert server.hangups.fileno() == -1
    connection.close()


@ensureDeferred
async def test_stdin_written_ahead_of_a_lookup_is_held_to_one_write_past_a_buffer(
    silent, systemd, server
):
    # A client without credit, writing ahead of its command's lookup, had
    # 63 writes (4 GiB at 64 MiB a frame) decoded and held while it waited,
    # and held on until the process read them, where a running one's
    # stdin holds one write past its limit (review session 51).
    connection = Connection(server)
    _exec(connection)
    looked_up = connection.protocol.frame_bytes
    _send_sized(connection, MAX_FRAMES_BEHIND_LOOKUPS - looked_up - 1, _write_of)
    assert connection.transport.producerState == "producing"
    _write(connection, 1, b"y")  # at the bound: reading stops
    assert connection.transport.producerState == "paused"
    assert server.hangups.fileno() != -1  # the client's close is watched for
    silent.answer()
    await until(lambda: ("start", UNIT) in systemd.calls, "the start")
    systemd.run(UNIT, pid=42)
    stdin = systemd.process_fd(UNIT, "stdin")
    read = os.read(stdin, MAX_FRAMES_BEHIND_LOOKUPS)
    assert read.startswith(b"x")  # what waited, written in order
    await until(
        lambda: connection.transport.producerState == "producing", "reading again"
    )
    connection.close()


@ensureDeferred
async def test_requests_of_any_kind_behind_a_lookup_are_held_to_one_frame_past_16k(
    silent, systemd, server
):
    # Counted by number alone, 63 execs of up to max-frame-size each waited
    # decoded behind a stuck lookup (1 GiB more of the service's memory at
    # 16 MiB a frame), where docs/configuration.md bounds a connection by
    # one frame (review session 51).
    connection = Connection(server)
    _exec(connection)
    looked_up = connection.protocol.frame_bytes
    _send_sized(connection, MAX_FRAMES_BEHIND_LOOKUPS - looked_up - 1, _exec_padded)
    assert connection.transport.producerState == "producing"
    connection.send("sdexec.list", {}, matchtag=3)  # its frame reaches the bound
    assert connection.transport.producerState == "paused"
    _kill_unknown(connection, 4)  # not read: held, in order
    assert _topics(connection) == []
    silent.answer()
    await until(lambda: len(connection.responses()) == 2, "the list and the kill")
    assert set(_topics(connection)) == {("sdexec.list", 3), ("sdexec.kill", 4)}
    assert connection.transport.producerState == "producing"
    connection.close()


@ensureDeferred
async def test_an_exec_whose_own_frame_reaches_the_bound_pauses_its_lookup_s_reading(
    silent, systemd, server
):
    # Its command is held while it is looked up: with one more frame behind
    # it, two frames past the bound would wait.
    connection = Connection(server)
    _send_sized(connection, MAX_FRAMES_BEHIND_LOOKUPS, _exec_padded)
    assert connection.transport.producerState == "paused"
    _kill_unknown(connection, 3)  # not read while it is looked up
    assert _topics(connection) == []
    silent.answer()
    await until(lambda: ("sdexec.kill", 3) in _topics(connection), "the held kill")
    assert connection.transport.producerState == "producing"
    connection.close()


@ensureDeferred
async def test_reading_resumes_once_what_waited_past_the_bound_is_handled_later(
    silent, systemd, server
):
    # A lookup that ended while its client read its output too slowly left
    # what waited for it waiting; handled once the client read, it left
    # the pause for lookups on, and the connection read nothing more.
    transport = BufferingTransport()
    connection = Connection(server, transport)
    silent.answer("cat")
    cat = {"cmdline": ["cat"], "opts": {"SDEXEC_NAME": "sdexec-a"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cat}, matchtag=1)
    await until(lambda: _starts(systemd) == ["sdexec-a.service"], "a's start")
    systemd.run("sdexec-a.service", pid=41)
    _exec(connection, matchtag=2)  # its lookup stuck
    _send_sized(connection, MAX_FRAMES_BEHIND_LOOKUPS, _list_padded)
    assert transport.producerState == "paused"
    await _fill_with_output(transport, systemd.process_fd("sdexec-a.service", "stdout"))
    silent.answer()
    await until(lambda: UNIT in _starts(systemd), "the start")  # the list waits on
    transport.read()
    await until(lambda: ("sdexec.list", 3) in _topics(connection), "the list")
    assert transport.producerState == "producing"
    connection.close()


async def _fill_with_output(transport: BufferingTransport, stdout: int) -> None:
    """Write output to ``stdout`` until the connection that reads it
    has more unread than its buffer takes (it is paused)."""
    os.set_blocking(stdout, False)
    lines = b"x" * 1023 + b"\n"
    while not transport._producer_paused:
        with contextlib.suppress(BlockingIOError):
            os.write(stdout, lines * 64)
        await sleep(0.01)


def _list_padded(padding: str) -> dict:
    """A list on matchtag 3 carrying ``padding``."""
    return _envelope("sdexec.list", {"detail": False, "pad": padding}, 3)


def _send_sized(
    connection: Connection, frame: int, message_of: Callable[[str], dict]
) -> None:
    """Send ``message_of(padding)``, the padding (``x``s) making its frame
    ``frame`` bytes."""
    unpadded = len(json.dumps(message_of("")).encode())
    connection.raw(message_of("x" * (frame - unpadded)))
    assert connection.protocol.frame_bytes == frame


def _write_of(data: str) -> dict:
    """A write of ``data`` to the exec on matchtag 1, as :func:`_write`."""
    io = {"stream": "stdin", "rank": "0", "data": data}
    return _envelope("sdexec.write", {"matchtag": 1, "io": io}, 0)


def _exec_padded(padding: str) -> dict:
    """A streaming exec on matchtag 2 whose environment holds ``padding``."""
    cmd = {"cmdline": ["true"], "env": {"PATH": "/bin", "PAD": padding}}
    return _envelope("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, 2)


@ensureDeferred
async def test_a_client_that_closes_drops_what_waits_but_a_background_exec(
    silent, systemd, server
):
    # Execs behind another's lookup wait for it (execs keep their order),
    # and one of them still runs when in the background: only streaming
    # ones are for the client.
    connection = Connection(server)
    stdin_r, stdin_w = os.pipe()
    connection.send(
        "sdexec.exec", {"flags": FLAGS, "cmd": _cmd("first", label="L")}, matchtag=1
    )
    # Streaming, waiting for the first: dropped, and the background one
    # behind it (the same label) not left waiting for it for good.
    connection.send(
        "sdexec.exec", {"flags": FLAGS, "cmd": _cmd("fourth", label="L")}, 4
    )
    background = {"flags": FLAGS, "cmd": _cmd("second", label="L")}
    connection.raw(_envelope("sdexec.exec", background, 2, streaming=False))
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": _cmd("third")}, 3)
    # A write waiting for the first, with a descriptor of its own to close.
    connection.protocol.fileDescriptorReceived(os.dup(stdin_r))
    os.close(stdin_r)
    _write(connection, 1, b"lost")
    await until(lambda: len(silent.names) == 1, "the first's lookup")
    connection.close()
    silent.answer()
    await until(lambda: len(silent.names) == 2, "the background one's lookup")
    silent.answer()
    await until(lambda: server.lookups.unanswered == 0, "the lookups' end")
    await until(lambda: _starts(systemd) == ["second.service"], "the background one")
    with pytest.raises(BrokenPipeError):  # the waiting write's descriptor closed
        os.write(stdin_w, b"x")
    os.close(stdin_w)


def _cmd(name: str, **fields) -> dict:
    """``true``, in a unit of ``name``."""
    return {"cmdline": ["true"], "opts": {"SDEXEC_NAME": name}, **fields}


def _envelope(topic: str, payload: dict, matchtag: int, **envelope) -> dict:
    message = {"type": "request", "topic": topic, "matchtag": matchtag}
    return {**message, "payload": payload, **envelope}


@ensureDeferred
async def test_a_timed_out_lookup_refuses_its_exec(
    silent, systemd, server, lookups, clock
):
    # (The list waits for the exec, as it would show it, and comes after.)
    connection = Connection(server)
    _exec(connection)
    connection.send("sdexec.list", {}, matchtag=2)
    with capturedLogs() as events:
        clock.advance(LOOKUP_TIMEOUT_S)
    exec_error, listed = connection.responses()
    assert (exec_error["topic"], exec_error["matchtag"]) == ("sdexec.exec", 1)
    assert error_of(exec_error)[0] == errno.ETIMEDOUT
    assert (listed["topic"], listed["matchtag"]) == ("sdexec.list", 2)
    # The journal says it too: a file system of the node does not answer.
    assert [formatEvent(event) for event in events] == [
        f"connection {connection.protocol.connection_id}: exec refused:"
        f" {error_of(exec_error)[1]}"
    ]
    silent.answer()
    await until(lambda: lookups.stuck == 0, "the stuck lookup's end")
    assert not [call for call in systemd.calls if call[0] == "start"]
    connection.close()


@ensureDeferred
async def test_the_server_counts_a_user_s_stuck_lookups_apart(
    silent, systemd, clock, monkeypatch
):
    other = os.getuid() + 1
    config = parse_config({"sdexec": {"allow-users": [other]}})
    lookups = ThreadedLookups(reactor, clock, limit=1)
    server = SdexecServer(systemd, config, reactor, clock=clock, lookups=lookups)
    with monkeypatch.context() as patch:
        patch.setattr(sdexec.connection, "peer_uid", lambda sock: other)
        theirs = Connection(server)
    _exec(theirs)
    clock.advance(LOOKUP_TIMEOUT_S)  # their one lookup is left stuck
    _exec(theirs, matchtag=2)
    assert error_of(theirs.last())[1].endswith(
        f"1 lookups of uid {other} wait on a file system that does not answer"
    )
    owner = Connection(server)
    _exec(owner)  # looked up, not refused for theirs
    await until(lambda: len(silent.names) == 2, "the owner's lookup")
    silent.answer()
    await until(lambda: lookups.stuck == 0, "the lookups' end")
    for connection in (theirs, owner):
        connection.close()


#: A command name and a working directory a timed-out lookup's log line
#: quoted raw and whole: a line break made a journal entry of its own (a
#: forged one), an escape code reached the admin's terminal, and the size
#: was the request's.
_HOSTILE = "\n[sdexec.server#critical] FORGED\x1b[2J"


@pytest.mark.parametrize(
    ("name", "cwd", "said"),
    [
        ("/fuse/prog" + _HOSTILE + "y" * 100_000, None,
         "its file system did not answer within 10 s"),
        # A name of a PATH search (255 bytes at most), escaped at 4
        # characters a byte, from a directory nearly as long as a path can be
        # (with no line break: a cwd may not have one).
        ("prog" + _HOSTILE + "\x01" * 200, "/home/u\x1b[2J" + "\x02" * 4000,
         "looking it up from '/home/u\\x1b[2J\\x02"),
    ],
    ids=["absolute", "relative"],
)  # fmt: skip
@ensureDeferred
async def test_a_timed_out_lookup_logs_its_command_escaped_and_cut(
    silent, systemd, server, lookups, clock, name, cwd, said
):
    connection = Connection(server)
    cmd = {"cmdline": [name], "opts": {"SDEXEC_NAME": "sdexec-t"}}
    if cwd is not None:
        cmd["cwd"] = cwd
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=1)
    with capturedLogs() as events:
        clock.advance(LOOKUP_TIMEOUT_S)
    (line,) = [formatEvent(event) for event in events]
    prefix = f"connection {connection.protocol.connection_id}: exec refused: "
    assert line.startswith(prefix + repr(name)[:30])
    assert "\n" not in line and "\x1b" not in line
    assert len(line) <= len(prefix) + MAX_QUOTED + 1
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.ETIMEDOUT
    assert f" ({len(name)} chars): {said}" in errstr
    assert "\n" not in errstr and "\x1b" not in errstr
    silent.answer()
    await until(lambda: lookups.stuck == 0, "the stuck lookup's end")
    connection.close()


@ensureDeferred
async def test_a_client_that_leaves_during_its_lookup_starts_nothing(
    silent, systemd, server
):
    connection = Connection(server)
    stdin_r, stdin_w = os.pipe()
    # Passed with the request (the service's copy), as Twisted delivers it.
    connection.protocol.fileDescriptorReceived(os.dup(stdin_r))
    os.close(stdin_r)
    connection.send(
        "sdexec.exec",
        {
            "flags": FLAGS,
            "stdio": ["stdin"],
            "cmd": {"cmdline": ["true"], "opts": {"SDEXEC_NAME": "sdexec-t"}},
        },
    )
    connection.close()
    silent.answer()
    await until(lambda: server.lookups.unanswered == 0, "the lookup's end")
    assert not [call for call in systemd.calls if call[0] == "start"]
    with pytest.raises(BrokenPipeError):  # the service's copy is closed
        os.write(stdin_w, b"x")
    os.close(stdin_w)


def test_a_worker_idle_for_its_time_ends_and_the_next_call_starts_one():
    workers = _Workers(idle_s=0.05)
    ran: list[threading.Thread] = []
    for _ in range(2):
        done = threading.Event()
        workers.run(lambda: ran.append(threading.current_thread()), _set(done))
        assert done.wait(5)
        ran[-1].join(5)  # idle for 0.05 s: it ends
        assert not ran[-1].is_alive()
    assert ran[0] is not ran[1]


def _set(event: threading.Event):
    return lambda _outcome: event.set()


@ensureDeferred
async def test_a_client_that_closes_its_socket_during_its_lookup_starts_nothing(
    silent, systemd, server, tmp_path
):
    """The close of a connection whose exec's command is being looked up
    is seen (it is read meanwhile: no longer by the hang-up watch, which
    only a connection past the cap of requests behind lookups needs), and
    the exec dropped."""
    async with serving(server, tmp_path) as client:
        exec_request = {
            "type": "request",
            "topic": "sdexec.exec",
            "matchtag": 1,
            "payload": {"flags": FLAGS, "cmd": {"cmdline": ["true"]}},
        }
        client.sendall(json.dumps(exec_request).encode() + b"\n")
        await until(lambda: silent.threads, "the lookup begun")
        list_request = {**exec_request, "topic": "sdexec.list", "matchtag": 2}
        client.sendall(json.dumps({**list_request, "payload": {}}).encode() + b"\n")
        client.close()
        await until(lambda: server.connections.total == 0, "the connection released")
        silent.answer()
        await until(lambda: server.lookups.unanswered == 0, "the lookup's end")
        assert not [call for call in systemd.calls if call[0] == "start"]
        assert server.hangups.fileno() == -1  # nothing left watched


@contextlib.asynccontextmanager
async def serving(server, tmp_path):
    """``server`` on a real UNIX socket, and a client socket connected to it."""
    from twisted.internet.endpoints import UNIXServerEndpoint

    path = str(tmp_path / "sdexec.sock")
    port = await UNIXServerEndpoint(reactor, path).listen(SdexecServerFactory(server))
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    try:
        yield client
    finally:
        client.close()
        await port.stopListening()


def _request(topic: str, payload: dict, matchtag: int, **envelope) -> bytes:
    message = _envelope(topic, payload, matchtag, **envelope)
    return json.dumps(message).encode() + b"\n"


def _exec_of(name: str, matchtag: int, **envelope) -> bytes:
    """An exec of ``name`` (``true``, ``false``) in a unit of that name."""
    cmd = {"cmdline": [name], "opts": {"SDEXEC_NAME": name}}
    return _request("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag, **envelope)


def _starts(systemd) -> list[str]:
    return [call[1] for call in systemd.calls if call[0] == "start"]


@ensureDeferred
async def test_a_background_exec_sent_and_closed_at_once_still_runs(
    silent, systemd, server, tmp_path
):
    # Its client's close was read before its lookup ended, and the exec was
    # dropped with the connection: a fire-and-forget `sdexec run --bg` (or
    # a prolog's socat) never ran, and nothing said so.
    async with serving(server, tmp_path) as client:
        client.sendall(_exec_of("true", 1, streaming=False))
        client.close()
        await until(lambda: silent.names, "the lookup begun")
        await until(lambda: server.connections.total == 0, "the close seen")
        silent.answer()
        await until(lambda: _starts(systemd), "the start")
        assert _starts(systemd) == ["true.service"]


@ensureDeferred
async def test_the_close_is_seen_during_a_pipelined_exec_s_lookup(
    silent, systemd, server, tmp_path
):
    # Only the first exec's lookup watched for the close: the second, taken
    # from held input with reading paused, started its unit for a client
    # that had gone. (The second now waits for the first without holding
    # the connection, which is read meanwhile.)
    async with serving(server, tmp_path) as client:
        client.sendall(_exec_of("true", 1))
        await until(lambda: silent.names == ["true"], "the first lookup")
        client.sendall(_exec_of("false", 2))
        silent.answer("true")
        await until(lambda: _starts(systemd), "the first start")
        await until(lambda: silent.names == ["true", "false"], "the second lookup")
        client.close()
        await until(lambda: server.connections.total == 0, "the close seen")
        silent.answer("false")
        await until(lambda: server.lookups.unanswered == 0, "the lookup's end")
        assert _starts(systemd) == ["true.service"]


@ensureDeferred
async def test_a_close_seen_as_the_lookup_answers_starts_nothing(
    silent, systemd, server, tmp_path
):
    # The close came by the hangup watch in the same loop pass as the
    # lookup's answer: Twisted calls connectionLost a pass after the abort,
    # so the exec still ran for a client that had gone (then stopped).
    import time

    async with serving(server, tmp_path) as client:
        client.sendall(_exec_of("true", 1))
        await until(lambda: silent.names, "the lookup begun")

        def both_at_once() -> None:
            silent.answer()
            client.close()
            time.sleep(0.3)  # the reactor busy: both are ready at its next pass

        reactor.callLater(0, both_at_once)
        await until(lambda: server.connections.total == 0, "the close seen")
        await until(lambda: server.lookups.unanswered == 0, "the lookup's end")
        assert _starts(systemd) == []


@ensureDeferred
async def test_a_half_close_past_the_cap_of_lookups_drops_nothing_it_sent(
    silent, systemd, server, tmp_path
):
    """``shutdown(SHUT_WR)`` (socat, nc) while the connection is not read,
    past the cap of requests behind lookups: what the client sent waits in
    the socket and is handled once the lookup has ended (its exec started,
    its writes read), then, once that exec has run to its end, the client
    reads EOF. The shutdown was taken for its departure: its exec and what
    it had not read were dropped."""
    async with serving(server, tmp_path) as client:
        client.sendall(_exec_of("true", 1) + _request(*_UNKNOWN_KILL, 2))
        await until(lambda: silent.names, "the lookup begun")
        write = _request(
            "sdexec.write", {"matchtag": 1, "io": encode_io("stdin", "0", b"x")}, 0
        )
        await _send_until_unread(client, write * 20_000, server)
        client.shutdown(socket.SHUT_WR)
        (protocol,) = server.open_connections
        await until(lambda: protocol._half_closed, "the shutdown seen")
        assert server.connections.total == 1 and _starts(systemd) == []
        silent.answer()
        await until(lambda: _starts(systemd), "its exec started")  # not dropped
        systemd.stop_to_inactive = True  # (its unit goes once it has exited)
        systemd.run("true.service")
        systemd.exit("true.service")
        answers = await _read_to_eof(client)
        kills = [r for r in answers if r["topic"] == "sdexec.kill"]
        assert [(r["matchtag"], r["errnum"]) for r in kills] == [(2, errno.ESRCH)]
        assert [r.get("errnum") for r in answers if r["matchtag"] == 1][-1] == (
            errno.ENODATA
        )  # its stream's end, then EOF
        assert len(_starts(systemd)) == 1
        await until(lambda: server.connections.total == 0, "the connection released")
        assert server.hangups.fileno() == -1


#: A kill of a pid nobody runs (:func:`_kill_unknown`), for :func:`_request`.
_UNKNOWN_KILL = ("sdexec.kill", {"signum": 15, "pid": 999999})


async def _send_until_unread(client: socket.socket, data: bytes, server) -> None:
    """Send ``data`` until the service reads no more of it, past the cap of
    requests behind lookups (watching for the client's hang-up), and the
    client's socket is full."""
    client.setblocking(False)
    view = memoryview(data)
    while view:
        sent = _sent_some(client, view)
        view = view[sent:]
        if not sent and server.hangups.fileno() != -1:
            return
        await sleep(0.01)  # the service reads
    raise AssertionError("the service read it all")


def _sent_some(client: socket.socket, view: memoryview) -> int:
    try:
        return client.send(view)
    except BlockingIOError:
        return 0


async def _read_to_eof(client: socket.socket) -> list[dict]:
    """The responses ``client`` reads until EOF (a reset raises)."""
    received = b""
    for _ in range(1500):
        try:
            chunk = client.recv(65536)
        except BlockingIOError:
            await sleep(0.01)
            continue
        if not chunk:
            return [json.loads(line) for line in received.splitlines()]
        received += chunk
    raise AssertionError(f"no EOF after {len(received)} bytes")


@ensureDeferred
async def test_nothing_that_waited_is_handled_after_the_connection_s_last_error(
    silent, systemd, server
):
    # A message that is no request, waiting for the exec it names, ends the
    # connection with EPROTO once handled: the kill and the exec waiting
    # behind it were still handled after that last word (review 34 W).
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": _cmd("sdexec-t", label="L")})
    connection.raw({"type": "bogus", "topic": "sdexec.exec", "matchtag": 1})
    connection.send("sdexec.kill", {"signum": 10, "label": "L"}, matchtag=2)
    connection.send(
        "sdexec.exec", {"flags": FLAGS, "cmd": _cmd("other", label="L")}, matchtag=3
    )
    silent.answer()
    await until(lambda: server.lookups.unanswered == 0, "the lookup's end")
    systemd.run(UNIT, pid=42)
    responses = connection.responses()
    assert any(r.get("errnum") == errno.EPROTO for r in responses)
    assert systemd.kills() == []
    assert not any(r["matchtag"] in (2, 3) for r in responses)


@ensureDeferred
async def test_a_terminate_by_the_job_id_of_an_exec_being_looked_up_applies_to_it(
    silent, systemd, server
):
    # Handled at once, it found no such job (ESRCH) for a job whose exec the
    # client had sent first.
    connection = Connection(server)
    opts = {"SDEXEC_NAME": "sdexec-t", "SDEXEC_JOBID": "j1"}
    cmd = {"cmdline": ["true"], "opts": opts}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=1)
    connection.send("sdexec.terminate", {"jobid": "j1", "reason": "cancel"}, 2)
    _kill_unknown(connection, 3)  # answered meanwhile
    assert _topics(connection) == [("sdexec.kill", 3)]
    silent.answer()
    await until(lambda: len(connection.responses()) == 2, "the terminate's answer")
    assert "errnum" not in connection.last()
    connection.close()


def test_the_paths_a_unit_s_sandboxing_needs_and_the_first_missing(tmp_path):
    paths = UnitProperty("ReadOnlyPaths", "as", ["-/a", "+/b", str(tmp_path), "/c"])
    binds = UnitProperty(
        "BindPaths", "a(ssbt)", [("/d", "/e", True, 0), ("/f", "/g", False, 0)]
    )
    plan = dataclasses.replace(exec_plan(), properties=(paths, binds))
    assert [path for _, path in plan.required_paths] == [str(tmp_path), "/c", "/f"]
    # The first that does not exist; one that exists, or cannot be looked
    # at, is not named.
    assert first_missing(plan.required_paths) == (paths, "/c")
    assert first_missing([(paths, str(tmp_path))]) is None


@ensureDeferred
async def test_sandbox_paths_that_do_not_answer_in_time_are_not_known(
    monkeypatch, lookups, clock
):
    """A failed unit's paths on a file system that does not answer: not
    known after the lookups' timeout, its thread counted stuck until the
    file system answers, as a command's lookup is."""
    answered = threading.Event()

    def silent(paths):
        answered.wait()
        return paths[0]

    monkeypatch.setattr(lookup_module, "first_missing", silent)
    paths = [(UnitProperty("ReadOnlyPaths", "as", ["/nfs/x"]), "/nfs/x")]
    known = lookups.first_missing(paths)
    clock.advance(LOOKUP_TIMEOUT_S - 0.1)
    assert not known.called
    clock.advance(0.1)
    assert await known is None
    assert lookups.stuck == 1
    answered.set()
    await until(lambda: lookups.stuck == 0, "the stuck path check's end")
