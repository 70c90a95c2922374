"""The synchronous client's (and so ``sdexec run --no-passthrough``'s) writes
to a process's stdin, against a scripted service: a refusal of one is told,
not dropped as a message that answers no request."""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import LISTED_NOTHING
from test_cli_scripted import ScriptedService, failure, response

from sdexec.ioencode import decode_io
from sdexec.protocol import DEFAULT_STDIN_BUFSIZE, WRITE_PIECE, ExecFlag
from sdexec.rpc import RPCError, SdexecError
from sdexec.syncclient import Connection, Exec, Loop
from sdexec.wire import encode_message

OVERRUN = "stdin: the client overran its credit"
FLAGS = ExecFlag.STDOUT | ExecFlag.WRITE_CREDIT


class Service:
    """A scripted service that starts each exec as pid 42, ends it as if
    its process exited 0 when it is sent a signal, and keeps every request
    it reads; what it answers to a write is the test's."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.requests: list[dict] = []
        self.exec_request: dict | None = None
        #: The messages for a write: called with it and the exec's request.
        self.on_write = lambda write, exec_request: []
        self._scripted: ScriptedService | None = ScriptedService(path, self._answer)

    def writes(self) -> list[dict]:
        return [r for r in self.requests if r["topic"] == "sdexec.write"]

    def close(self) -> None:
        """Stop (once), after every connection has closed: what was sent
        has then been read."""
        if self._scripted is not None:
            self._scripted.close()
            self._scripted = None

    def _answer(self, request: dict) -> list[dict]:
        self.requests.append(request)
        if request["topic"] == "sdexec.exec":
            self.exec_request = request
            return [response(request, {"type": "started", "pid": 42})]
        assert self.exec_request is not None
        if request["topic"] == "sdexec.write":
            return self.on_write(request, self.exec_request)
        if request["topic"] == "sdexec.kill":
            return [response(request, {}), *ends_well(self.exec_request)]
        if request["topic"] == "sdexec.list":
            return [response(request, LISTED_NOTHING)]
        return [response(request, {})]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    scripted = Service(str(tmp_path / "sdexec.sock"))
    yield scripted
    scripted.close()


def ends_well(exec_request: dict) -> list[dict]:
    """The messages that end an exec whose process exited 0."""
    return [
        response(exec_request, {"type": "finished", "status": 0}),
        failure(exec_request, errno.ENODATA),
    ]


def test_an_exec_s_writes_share_one_matchtag_of_their_own(service):
    # Each write took a fresh matchtag nothing tracked: a refusal of any
    # of them was dropped unseen.
    def on_write(write: dict, exec_request: dict) -> list[dict]:
        return ends_well(exec_request) if write["payload"]["io"].get("eof") else []

    service.on_write = on_write
    with Loop() as loop, Connection(loop, service.path) as connection:
        stream = connection.exec({"cmdline": ["cat"]}, FLAGS, lambda _: None)
        for data in (b"one", b"two", b""):
            connection.write_stdin(stream, data)
        loop.run_until(lambda: stream.ended)
    service.close()
    matchtags = {write["matchtag"] for write in service.writes()}
    assert len(service.writes()) == 3
    assert matchtags == {stream.write_matchtag}
    assert stream.write_matchtag != stream.matchtag
    assert {write["payload"]["matchtag"] for write in service.writes()} == {
        stream.matchtag
    }


def test_a_large_write_goes_in_pieces_the_service_takes(service):
    # Sent as one message, 12 MB of zero bytes (6 bytes each in JSON)
    # passed the service's frame cap: it dropped the connection, and every
    # process on it (review session 41 B2).
    def on_write(write: dict, exec_request: dict) -> list[dict]:
        return ends_well(exec_request) if write["payload"]["io"].get("eof") else []

    service.on_write = on_write
    data = bytes(2 * WRITE_PIECE + 1)
    with Loop() as loop, Connection(loop, service.path) as connection:
        stream = connection.exec({"cmdline": ["cat"]}, ExecFlag.STDOUT, lambda _: None)
        connection.write_stdin(stream, data)
        connection.write_stdin(stream, b"")
        loop.run_until(lambda: stream.ended)
    service.close()
    pieces = [decode_io(write["payload"]["io"])[1] for write in service.writes()]
    assert [len(piece) for piece in pieces] == [WRITE_PIECE, WRITE_PIECE, 1, 0]
    assert b"".join(pieces) == data


def _cat(connection: Connection, refusals: list[SdexecError]) -> Exec:
    """``cat`` started, its stdin's refusals to ``refusals``."""
    return connection.exec(
        {"cmdline": ["cat"]}, FLAGS, lambda _: None, None, refusals.append
    )


def test_a_refused_write_is_told_and_ends_the_stream_s_stdin(service):
    def on_write(write: dict, exec_request: dict) -> list[dict]:
        return [failure(write, errno.ENOSPC, OVERRUN)]

    service.on_write = on_write
    refusals: list[SdexecError] = []
    with Loop() as loop, Connection(loop, service.path) as connection:
        stream = _cat(connection, refusals)
        connection.write_stdin(stream, b"one")
        loop.run_until(lambda: bool(refusals))
        connection.write_stdin(stream, b"two")  # dropped, as the service would
        connection.write_stdin(stream, b"")
    service.close()
    (refused,) = refusals
    assert isinstance(refused, RPCError)
    assert (refused.errnum, str(refused)) == (errno.ENOSPC, OVERRUN)
    assert stream.stdin_error is refused
    assert len(service.writes()) == 1


def _refuse_after_the_end(write: dict, exec_request: dict) -> list[dict]:
    """The exec's end, then a refusal of the write: one read, in that order."""
    return [*ends_well(exec_request), failure(write, errno.EINVAL, "late")]


def test_a_refusal_after_the_exec_ended_is_ignored(service):
    service.on_write = _refuse_after_the_end
    refusals: list[SdexecError] = []
    with Loop() as loop, Connection(loop, service.path) as connection:
        stream = _cat(connection, refusals)
        connection.write_stdin(stream, b"one")
        loop.run_until(lambda: stream.ended)
        assert stream.write_matchtag not in connection._requests._in_flight
        # A call after it: the late refusal has been read by the time it is
        # answered.
        assert connection.call("sdexec.list", {}) == LISTED_NOTHING
    assert (refusals, stream.stdin_error, stream.error) == ([], None, None)


def test_a_lost_connection_is_no_refusal_of_stdin(service):
    # The connection's loss ends every request, the writes' matchtag too:
    # the stream reports it, as its own error.
    def on_write(write: dict, exec_request: dict) -> list[dict]:
        # Ends the scripted service's serving of the connection (as a
        # client's reset does), which closes it.
        raise ConnectionResetError

    service.on_write = on_write
    refusals: list[SdexecError] = []
    with Loop() as loop, Connection(loop, service.path) as connection:
        stream = _cat(connection, refusals)
        connection.write_stdin(stream, b"one")
        loop.run_until(lambda: stream.ended)
    assert (refusals, stream.stdin_error) == ([], None)
    assert "lost" in str(stream.error)


def _first_line(fd: int, cap_s: float) -> bytes:
    """What ``fd`` gives up to its first newline (and any more read with
    it); fails if none comes within ``cap_s`` seconds (a bound for a loaded
    machine: the line comes at once)."""
    said = b""
    deadline = time.monotonic() + cap_s
    while b"\n" not in said:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"only {said!r}"
        piece = os.read(fd, 4096)
        assert piece, f"EOF after {said!r}"
        said += piece
    return said


def test_run_says_a_refusal_of_its_stdin_and_sends_no_more(service, tmp_path):
    # The refusal was dropped as a message that answers no request: `run`
    # went on sending stdin the service dropped, said nothing, and exited 0
    # as if the process had had all of it.
    def on_write(write: dict, exec_request: dict) -> list[dict]:
        if len(service.writes()) > 1:
            return []
        # Credit for all the rest: only the refusal keeps it back. Both in
        # one send, read at once: the client has taken the credit when it
        # says the refusal.
        credit = {"type": "add-credit", "channels": {"stdin": 1 << 20}}
        refusal = failure(write, errno.ENOSPC, OVERRUN)
        return [
            encode_message(refusal) + encode_message(response(exec_request, credit))
        ]

    service.on_write = on_write
    stdin = tmp_path / "stdin"
    stdin.write_bytes(b"x" * (64 << 10))  # more than the first allowance
    cli = [sys.executable, "-m", "sdexec.cli", "--socket", service.path]
    with stdin.open("rb") as data:
        client = subprocess.Popen(
            [*cli, "run", "--no-passthrough", "cat"], stdin=data, stderr=subprocess.PIPE
        )
        try:
            said = _first_line(client.stderr.fileno(), cap_s=30)
            # Served in a round of its loop after the one that took the
            # credit: a client that read on (its stdin, a file, always
            # readable) has read and sent more by then, before the kill's
            # answer ends it.
            client.send_signal(signal.SIGUSR1)  # forwarded: its kill ends it
            _, rest = client.communicate(timeout=30)
        finally:
            client.kill()
            client.wait()
        # Nor read: the rest of a terminal's input is its user's.
        assert data.tell() == DEFAULT_STDIN_BUFSIZE
    service.close()  # (once it has read all the client sent)
    assert said + rest == f"sdexec: stdin refused: {OVERRUN}\n".encode()
    assert len(service.writes()) == 1
    # Its process exited 0 on part of its stdin: the command fails.
    assert client.returncode == 1
