"""The Twisted client's stdin writes, against a transport that records them.

What goes on the wire for ``ExecHandle.write`` and ``close_stdin``: its size
(every write fits the smallest frame a service may read), a stdin passed
with ``stdio`` (not ours to write), and the service's refusal of a write
(told to the handle, not logged as a stray answer).
"""

from __future__ import annotations

import errno
import json
import os

import pytest
from twisted.internet.interfaces import IPushProducer, IUNIXTransport
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from zope.interface import implementer

from sdexec.client import STDOUT, WRITE_CREDIT, RPCError, SdexecClient
from sdexec.ioencode import decode_io

#: The smallest ``max-frame-size`` a service may be configured with.
SMALLEST_FRAME = 1 << 20


@implementer(IUNIXTransport)
class _Transport(StringTransport):
    """A transport that keeps what is written, and the descriptors sent."""

    def __init__(self) -> None:
        super().__init__()
        self.descriptors: list[int] = []

    def sendFileDescriptor(self, descriptor: int) -> None:
        self.descriptors.append(descriptor)


def _connected() -> tuple[SdexecClient, _Transport]:
    client = SdexecClient("/run/sdexec.sock", Clock())
    transport = _Transport()
    client.makeConnection(transport)
    return client, transport


def _sent(transport: _Transport) -> list[bytes]:
    """The lines written since the last call."""
    lines = transport.value().splitlines()
    transport.clear()
    return lines


def _exec(client: SdexecClient, flags: int = STDOUT, opts=None, **kwargs):
    cmd = {"cmdline": ["cat"], "env": {}, "opts": opts or {}, "channels": []}
    return client.exec(cmd, flags, **kwargs)


def _answer(client: SdexecClient, matchtag: int, **fields) -> None:
    client.messageReceived({"type": "response", "matchtag": matchtag, **fields})


def _refuse(client: SdexecClient, write: dict, errnum: int, errstr: str) -> None:
    _answer(client, write["matchtag"], errnum=errnum, errstr=errstr)


@pytest.mark.parametrize(
    ("flags", "opts"),
    [(STDOUT, None), (STDOUT | WRITE_CREDIT, {"stdin_BUFSIZE": "16M"})],
    ids=["uncredited", "credited"],
)
@pytest.mark.parametrize(
    "data",
    [b"\0" * (3 << 20), os.urandom(3 << 20) + b"\0"],
    ids=["control characters", "binary"],
)
def test_a_large_write_goes_in_pieces_the_smallest_frame_takes(flags, opts, data):
    # 3 MiB of NULs went as one 18 MiB line (11 MiB made one over the
    # default 64 MiB): the service dropped the connection, and every
    # process on it. With credit, a large stdin_BUFSIZE let as much go at
    # once before the service refused it.
    client, transport = _connected()
    handle = _exec(client, flags, opts)
    _sent(transport)
    handle.write(data)
    lines = _sent(transport)
    assert max(len(line) + 1 for line in lines) <= SMALLEST_FRAME
    writes = [json.loads(line) for line in lines]
    written = b"".join(decode_io(write["payload"]["io"])[1] for write in writes)
    assert written == data  # (within the credit, too)


def _passthrough(client: SdexecClient):
    with open(os.devnull, "rb") as stdin:
        return _exec(client, stdio={"stdin": stdin.fileno()})


@pytest.mark.parametrize("call", ["write", "close_stdin"])
def test_a_stdin_passed_with_stdio_is_not_written_to(call):
    # Sent, the service refused it (EINVAL) on a matchtag the client did
    # not track: logged as a stray answer, and the caller never knew.
    client, transport = _connected()
    handle = _passthrough(client)
    _sent(transport)
    arguments = (b"data",) if call == "write" else ()
    with pytest.raises(ValueError, match=rf"^{call}: the process's stdin is the descr"):
        getattr(handle, call)(*arguments)
    assert _sent(transport) == []
    _answer(client, handle.matchtag, errnum=errno.ENODATA, errstr="")


@implementer(IPushProducer)
class _Producer:
    stopped = False

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        self.stopped = True


def _ended_well(client: SdexecClient, handle) -> None:
    finished = {"type": "finished", "status": 0}
    _answer(client, handle.matchtag, payload=finished)
    _answer(client, handle.matchtag, errnum=errno.ENODATA, errstr="")


@pytest.mark.parametrize("flags", [STDOUT, STDOUT | WRITE_CREDIT])
def test_a_refused_write_ends_stdin_and_fails_done_at_the_end(flags):
    # The refusal answers the write's matchtag, which no request held: it
    # was logged as "a message that answers no request", the producer went
    # on, and done fired None as if all of stdin had reached the process.
    client, transport = _connected()
    handle = _exec(client, flags)
    producer = _Producer()
    handle.registerProducer(producer, True)
    handle.write(b"first")
    handle.write(b"second")
    first, second = (json.loads(line) for line in _sent(transport)[1:])
    # One matchtag for all of an exec's writes, not the exec's own.
    assert first["matchtag"] == second["matchtag"] != handle.matchtag
    with capturedLogs() as events:
        _refuse(client, first, errno.ENOSPC, "stdin: the client overran its credit")
    (logged,) = [formatEvent(event) for event in events]
    assert "refused" in logged and "overran its credit (ENOSPC)" in logged
    assert isinstance(handle.stdin_error, RPCError)
    assert handle.stdin_error.errnum == errno.ENOSPC
    assert producer.stopped
    handle.write(b"dropped")
    handle.close_stdin()
    assert _sent(transport) == []
    _ended_well(client, handle)
    failure = handle.done.result
    handle.done.addErrback(lambda _: None)
    assert failure.value is handle.stdin_error
    assert handle.receipt is not None  # the stream itself went on


def test_an_exec_s_write_matchtag_answers_nothing_once_it_has_ended():
    client, transport = _connected()
    handle = _exec(client)
    handle.write(b"data")
    write = json.loads(_sent(transport)[-1])
    _ended_well(client, handle)
    assert handle.done.result is None
    with capturedLogs() as events:
        _refuse(client, write, errno.EINVAL, "late")
    (logged,) = [formatEvent(event) for event in events]
    assert "answers no request" in logged
    assert handle.stdin_error is None


def test_a_lost_connection_is_no_refusal_of_stdin():
    client, _ = _connected()
    handle = _exec(client)
    handle.write(b"data")
    with capturedLogs() as events:
        client.connectionLost()
    assert [formatEvent(event) for event in events] == []
    assert handle.stdin_error is None
    handle.done.addErrback(lambda _: None)
