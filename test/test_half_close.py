"""A client that shuts down its writing (``shutdown(SHUT_WR)``, as ``socat``
and ``nc`` do at the end of their input) has sent its last request, and is
still there, reading: its streaming processes run to their end and stream
everything to it (their stdin reads EOF, as no write can come), its waits
and attaches are answered when their answers come, and only then does the
connection close. Its full close still ends everything at once.

Offline: the logic on the in-memory connection (systemd a FakeManager).
Against the real manager: an in-process service and a raw client on its
real socket, as socat is; the test lets the reactor run between reads.
"""

from __future__ import annotations

import errno
import json
import os
import socket

import pytest
from offline import Connection, error_of
from pytest_twisted import ensureDeferred
from support import command, sleep, until, wait_until_reaped
from twisted.internet import defer

from sdexec.connection import ClientProtocol
from sdexec.ioencode import decode_io, encode_io
from sdexec.protocol import ExecFlag
from sdexec.testing import INACTIVE, FakeManager

UNIT = "sdexec-t.service"
CAT = {"cmdline": ["/bin/cat"], "opts": {"SDEXEC_NAME": "sdexec-t"}}
FLAGS = int(ExecFlag.STDOUT | ExecFlag.STDERR)


def request(topic: str, payload: dict, matchtag: int, **envelope) -> bytes:
    message = {"type": "request", "topic": topic, "matchtag": matchtag}
    return json.dumps({**message, "payload": payload, **envelope}).encode() + b"\n"


def stdin_write(matchtag: int, data: bytes) -> bytes:
    """An ``sdexec.write`` of ``data`` (no EOF) to the exec on ``matchtag``."""
    io = encode_io("stdin", "0", data, eof=False)
    return request("sdexec.write", {"matchtag": matchtag, "io": io}, 0)


def kinds(responses: list[dict]) -> list[object]:
    """Each response's ``type``, or its errnum."""
    return [r["payload"]["type"] if "payload" in r else r["errnum"] for r in responses]


def stdout_of(responses: list[dict]) -> bytes:
    outputs = [r["payload"] for r in responses if "payload" in r]
    written = [decode_io(p["io"]) for p in outputs if p["type"] == "output"]
    return b"".join(data for stream, data, _ in written if stream == "stdout")


def finished_status(responses: list[dict]) -> int:
    (finished,) = [
        r["payload"]
        for r in responses
        if r.get("payload", {}).get("type") == "finished"
    ]
    return finished["status"]


# -- offline ---------------------------------------------------------------------


def stdin_read(systemd: FakeManager) -> bytes:
    """What the process's stdin holds now ("" at its EOF); BlockingIOError
    while it is open and empty."""
    fd = systemd.process_fd(UNIT, "stdin")
    os.set_blocking(fd, False)
    return os.read(fd, 65536)


def at_stdin_eof(systemd: FakeManager, read: list[bytes]) -> bool:
    """Read the process's stdin into ``read``: whether it reached EOF."""
    try:
        data = stdin_read(systemd)
    except BlockingIOError:
        return False
    read.append(data)
    return data == b""


async def ends(systemd: FakeManager, connection: Connection) -> None:
    """The process exits 0 and its unit goes: its stream ends (ENODATA)."""
    systemd.exit(UNIT)
    systemd.release(UNIT)
    await until(lambda: _outputs_ended(connection), "both EOFs sent")
    systemd.change(UNIT, INACTIVE)


def _outputs_ended(connection: Connection) -> bool:
    outputs = [r["payload"] for r in connection.responses() if "payload" in r]
    eofs = [decode_io(p["io"])[2] for p in outputs if p["type"] == "output"]
    return sum(eofs) == 2


@ensureDeferred
async def test_a_half_closed_clients_stream_runs_to_its_end_then_eof(
    systemd, connection
):
    # At its EOF the client was taken as gone: its process was killed and
    # its stream ended without a response, though it still read.
    deliver = connection.protocol.dataReceived
    deliver(request("sdexec.exec", {"flags": FLAGS, "cmd": CAT}, 1))
    systemd.run(UNIT, pid=77)
    deliver(stdin_write(1, b"last words\n"))
    connection.protocol.readConnectionLost()
    read: list[bytes] = []
    await until(lambda: at_stdin_eof(systemd, read), "its stdin at EOF")
    assert b"".join(read) == b"last words\n"  # then EOF: no more can come
    assert systemd.kills() == [] and ("stop", UNIT) not in systemd.calls
    assert not connection.transport.disconnecting  # the client still reads
    await ends(systemd, connection)
    assert kinds(connection.responses()) == [
        "started",
        "finished",
        "output",
        "output",
        errno.ENODATA,
    ]
    assert connection.transport.disconnecting  # EOF once written out


@ensureDeferred
async def test_a_half_closed_clients_wait_is_answered_then_eof(systemd, connection):
    # Its wait was ended unanswered at its EOF, once the exec's one
    # response (started) was sent.
    systemd.stop_to_inactive = True  # StopUnit releases the fds: EOF, reaped
    cmd = {**CAT, "label": "job"}
    deliver = connection.protocol.dataReceived
    exec_payload = {"flags": int(ExecFlag.WAITABLE), "cmd": cmd}
    deliver(request("sdexec.exec", exec_payload, 1, streaming=False))
    deliver(request("sdexec.wait", {"label": "job"}, 2))
    connection.protocol.readConnectionLost()
    systemd.run(UNIT, pid=77)
    assert kinds(connection.responses()) == ["started"]
    assert not connection.transport.disconnecting  # its wait is still due
    systemd.exit(UNIT, status=3)
    await until(lambda: len(connection.responses()) == 2, "the wait answered")
    assert connection.last()["matchtag"] == 2
    assert connection.last()["payload"]["status"] == 3 << 8
    assert connection.transport.disconnecting


def test_a_half_closed_client_that_closes_has_left(systemd, connection):
    """Its close, as any client's: its streaming process is killed and its
    stream ends unanswered."""
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": CAT}, matchtag=1)
    systemd.run(UNIT, pid=77)
    connection.protocol.readConnectionLost()
    assert 9 not in systemd.kills()
    connection.close()
    assert 9 in systemd.kills()  # SIGKILL to its main process, then stopped
    assert ("stop", UNIT) in systemd.calls


def test_a_close_read_as_its_eof_is_a_close(server, systemd, connection):
    """Twisted reads the same EOF for a close as for a shutdown of its
    writing: a close is told apart there, and the client has left at once,
    as ever (not left for the hang-up watch to see a pass later and log,
    its processes' stdin closed first)."""
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": CAT}, matchtag=1)
    systemd.run(UNIT, pid=77)
    (process,) = server.processes.values()
    connection.transport.peer.close()
    connection.protocol.readConnectionLost()
    assert connection.transport.disconnected  # aborted: nothing can reach it
    assert not process.stdin._eof_requested
    assert server.hangups.fileno() == -1  # nothing left to watch for
    connection.close()  # (Twisted's connectionLost, a loop pass later)
    assert 9 in systemd.kills()


@ensureDeferred
async def test_a_half_close_waits_for_an_exec_still_looked_up(
    server, systemd, monkeypatch
):
    """An exec whose command was still being looked up at the EOF starts
    once found, its stream the client's, and its stdin reads EOF then."""
    found: list[defer.Deferred] = []
    look_up = server.look_up_command

    def held(payload: dict, streaming: bool, *connection: int) -> defer.Deferred:
        answer = look_up(payload, streaming, *connection)
        found.append(defer.Deferred())
        found[-1].addCallback(lambda _: answer)
        return found[-1]

    monkeypatch.setattr(server, "look_up_command", held)
    connection = Connection(server)
    try:
        connection.protocol.dataReceived(
            request("sdexec.exec", {"flags": FLAGS, "cmd": CAT}, 1)
        )
        connection.protocol.readConnectionLost()
        assert server.processes == {}  # looked up still
        found[0].callback(None)
        systemd.run(UNIT, pid=77)
        await until(lambda: at_stdin_eof(systemd, []), "its stdin at EOF")
        assert systemd.kills() == [] and not connection.transport.disconnecting
        await ends(systemd, connection)
        assert error_of(connection.last())[0] == errno.ENODATA
        assert connection.transport.disconnecting
    finally:
        connection.close()


# -- against the real manager, over the real socket --------------------------------


class RawClient:
    """A client on the service's socket that writes its requests, shuts down
    its writing, and reads, as ``printf ... | socat - UNIX-CONNECT:sock``."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self._rest = b""
        self.eof = False

    def send_then_shut_down(self, data: bytes) -> None:
        self.sock.sendall(data)  # (small: the socket takes it whole)
        self.sock.shutdown(socket.SHUT_WR)

    def read_some(self) -> list[dict]:
        """The whole responses readable now (:attr:`eof` once at its end;
        a reset raises)."""
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            return []
        self.eof = not chunk
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        return [json.loads(line) for line in lines]

    async def read_until(self, done) -> list[dict]:
        """Responses until ``done(responses)`` or EOF, the reactor running
        meanwhile (the service is in this process)."""
        responses: list[dict] = []
        for _ in range(6000):
            responses += self.read_some()
            if self.eof or done(responses):
                return responses
            await sleep(0.005)
        raise AssertionError(f"no end after {len(responses)} responses")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(sdexec):
    client = RawClient(sdexec.socket_path)
    yield client
    client.close()


async def the_connection(sdexec) -> ClientProtocol:
    """The service's side of the one connection made."""
    await until(lambda: sdexec.server.open_connections, "the connection accepted")
    (protocol,) = sdexec.server.open_connections
    return protocol


def never(_responses: list[dict]) -> bool:
    return False


@pytest.mark.systemd
@ensureDeferred
async def test_a_half_closed_client_reads_a_streaming_exec_to_its_end(sdexec, raw):
    """``printf '%s\\n' '<exec of seq 1 1000>' | socat - UNIX-CONNECT:sock``
    read nothing: ``seq`` was killed at the EOF. Every line, ``started``,
    ``finished`` (0) and ENODATA now, then EOF."""
    unit = "sdexec-halfclose-seq"
    cmd = command(["seq", "1", "1000"], opts={"SDEXEC_NAME": unit})
    raw.send_then_shut_down(request("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, 1))
    responses = await raw.read_until(never)
    assert raw.eof
    assert all(r["matchtag"] == 1 for r in responses)
    assert stdout_of(responses) == b"".join(b"%d\n" % n for n in range(1, 1001))
    assert kinds(responses)[0] == "started"
    assert finished_status(responses) == 0
    assert error_of(responses[-1])[0] == errno.ENODATA
    await wait_until_reaped(sdexec, f"{unit}.service")
    await until(lambda: sdexec.server.connections.total == 0, "the slot freed")


@pytest.mark.systemd
@ensureDeferred
async def test_a_half_closed_clients_process_reads_its_stdin_then_eof(sdexec, raw):
    """``cat`` reads what was written, then EOF at the half-close (no more
    can come), and exits: its client reads it all."""
    unit = "sdexec-halfclose-cat"
    cmd = command(["cat"], opts={"SDEXEC_NAME": unit})
    exec_request = request("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, 1)
    raw.send_then_shut_down(exec_request + stdin_write(1, b"one\ntwo\n"))
    responses = await raw.read_until(never)
    assert raw.eof
    assert stdout_of(responses) == b"one\ntwo\n"
    assert finished_status(responses) == 0
    assert error_of(responses[-1])[0] == errno.ENODATA
    await wait_until_reaped(sdexec, f"{unit}.service")


@pytest.mark.systemd
@ensureDeferred
async def test_a_half_closed_clients_wait_on_a_background_process_is_answered(
    sdexec, raw
):
    """The wait stays open after the EOF (it was ended unanswered once the
    exec's ``started`` was sent), and is answered when the process ends,
    then EOF."""
    unit = "sdexec-halfclose-waited"
    cmd = command(["sleep", "600"], opts={"SDEXEC_NAME": unit}, label="job")
    background = {"flags": int(ExecFlag.WAITABLE), "cmd": cmd}
    raw.send_then_shut_down(
        request("sdexec.exec", background, 1, streaming=False)
        + request("sdexec.wait", {"label": "job"}, 2)
    )
    protocol = await the_connection(sdexec)
    started = await raw.read_until(lambda responses: responses)
    assert kinds(started) == ["started"] and started[0]["matchtag"] == 1
    await until(lambda: protocol._eof_read, "its EOF read")
    assert not (raw.eof or protocol.transport.disconnecting)  # the wait is due
    other = await sdexec.connect()
    await other.kill(label="job", signum=15)
    (answer,) = await raw.read_until(never)
    assert raw.eof
    assert answer["matchtag"] == 2 and answer["payload"]["status"] == 15
    await wait_until_reaped(sdexec, f"{unit}.service")


@pytest.mark.systemd
@ensureDeferred
async def test_a_half_closed_client_that_closes_ends_its_stream(sdexec, raw):
    """Its close, seen at once (nothing is read of it any more), kills
    what it streams, as for any client that leaves."""
    unit = "sdexec-halfclose-closed"
    cmd = command(["sleep", "600"], opts={"SDEXEC_NAME": unit})
    raw.send_then_shut_down(request("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, 1))
    protocol = await the_connection(sdexec)
    started = await raw.read_until(lambda responses: responses)
    assert kinds(started) == ["started"]
    await until(lambda: protocol._eof_read, "its EOF read")
    assert unit + ".service" in [p.unit_name for p in sdexec.server.processes.values()]
    raw.close()
    await until(lambda: protocol.transport.disconnected, "the connection closed")
    await wait_until_reaped(sdexec, f"{unit}.service")
    assert sdexec.server.connections.total == 0
    assert sdexec.server.hangups.fileno() == -1
