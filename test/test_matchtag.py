"""Matchtag 0 is the service's own (RFC 6's FLUX_MATCHTAG_NONE): an error on
it is always the connection's last words (docs/protocol.md, "Requests"). A
request that could not be answered on a matchtag of its own is a protocol
error, as a framing error is; a write with matchtag 0 (Flux's "no response
wanted") is carried out and never answered. Offline, with the fake manager
(review session 35 P1)."""

from __future__ import annotations

import errno
import json
import os

import pytest
from offline import Connection, read_to_eof
from pytest_twisted import ensureDeferred
from twisted.internet import defer, reactor
from twisted.internet.task import Clock

from sdexec.command import Command, Found
from sdexec.config import parse_config
from sdexec.ioencode import encode_io
from sdexec.protocol import ExecFlag
from sdexec.protocolbase import MAX_MATCHTAG
from sdexec.rpc import Requests
from sdexec.server import SdexecServer

UNIT = "sdexec-t.service"
TRUE = {"cmdline": ["/bin/true"], "opts": {"SDEXEC_NAME": "sdexec-t"}}
FLAGS = int(ExecFlag.STDOUT | ExecFlag.STDERR)
PAST = "is past 4294967295, the largest (RFC 6: a 32-bit integer)"
ZERO = (
    "matchtag: 0 is the service's own (its connection errors); number requests from 1"
)

#: A request of each kind of answer: a stream, one answer, ENOSYS, and
#: refusals of its payload (ESRCH for the kill, EINVAL for the wait).
REQUESTS = {
    "exec": ("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}),
    "kill": ("sdexec.kill", {"signum": 15, "pid": 999999}),
    "list": ("sdexec.list", {}),
    "wait": ("sdexec.wait", {}),
    "unknown-topic": ("sdexec.nope", {}),
}

#: Envelope matchtags no answer could carry, and what the error says.
BAD_MATCHTAGS = {
    "zero": ({"matchtag": 0}, ZERO),
    "missing": ({}, "matchtag: missing: expected an integer >= 1"),
    "negative": ({"matchtag": -1}, "matchtag: expected an integer >= 1, got -1"),
    "bool": ({"matchtag": True}, "matchtag: expected an integer >= 1, got true"),
    "float": ({"matchtag": 1.0}, "matchtag: expected an integer >= 1, got 1.0"),
    "string": ({"matchtag": "7"}, 'matchtag: expected an integer >= 1, got "7"'),
    # RFC 6's matchtag is 32 bits: these were answered on them.
    "2**32": ({"matchtag": 2**32}, f"matchtag: 4294967296 {PAST}"),
    "2**64": ({"matchtag": 2**64}, f"matchtag: 18446744073709551616 {PAST}"),
}


def request_line(topic: str, payload: dict, **matchtag) -> bytes:
    message = {"type": "request", "topic": topic, **matchtag, "payload": payload}
    return json.dumps(message).encode() + b"\n"


def protocol_error(errstr: str) -> dict:
    return {
        "type": "response",
        "topic": "",
        "matchtag": 0,
        "errnum": errno.EPROTO,
        "errstr": errstr,
    }


@pytest.mark.parametrize("envelope,errstr", BAD_MATCHTAGS.values(), ids=BAD_MATCHTAGS)
@pytest.mark.parametrize("topic,payload", REQUESTS.values(), ids=REQUESTS)
def test_a_request_that_cannot_be_answered_on_its_own_matchtag_ends_the_connection(
    server, systemd, connection, topic, payload, envelope, errstr
):
    # A list behind it, in the same read: nothing after a protocol error is
    # handled.
    after = request_line("sdexec.list", {}, matchtag=2)
    connection.protocol.dataReceived(request_line(topic, payload, **envelope) + after)
    assert connection.responses() == [protocol_error(errstr)]
    assert connection.transport.disconnecting
    assert ("start", UNIT) not in systemd.calls
    assert server.counters["errors"] == 1


def test_a_bad_matchtag_is_quoted_cut_short(connection):
    connection.raw({"type": "request", "topic": "sdexec.list", "matchtag": "x" * 5000})
    [answer] = connection.responses()
    assert answer["errnum"] == errno.EPROTO
    assert answer["errstr"].startswith('matchtag: expected an integer >= 1, got "xxx')
    assert len(answer["errstr"]) < 1100


def test_a_request_numbered_from_1_is_answered_on_its_matchtag(connection):
    connection.send("sdexec.kill", {"signum": 15, "pid": 999999}, matchtag=1)
    assert connection.last()["matchtag"] == 1
    assert connection.last()["errnum"] == errno.ESRCH
    assert not connection.transport.disconnecting


@ensureDeferred
async def test_a_write_with_matchtag_0_is_carried_out_unanswered(systemd, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=1)
    systemd.run(UNIT)
    before = connection.responses()
    io = encode_io("stdin", "0", b"data\n", eof=True)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    assert connection.responses() == before
    assert not connection.transport.disconnecting
    assert await read_to_eof(systemd.process_fd(UNIT, "stdin")) == b"data\n"


@ensureDeferred
async def test_a_write_past_32_bits_is_refused_unanswered(systemd, connection):
    # As a write with a matchtag of -1: no response could carry it (it was
    # answered on 2**64), so it is refused silently, and its stdin closed.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=1)
    systemd.run(UNIT)
    before = connection.responses()
    io = encode_io("stdin", "0", b"data\n", eof=True)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=2**32)
    assert connection.responses() == before
    assert not connection.transport.disconnecting
    assert await read_to_eof(systemd.process_fd(UNIT, "stdin")) == b""


class _Waiting:
    """A request in flight (sdexec.rpc.Pending) that nothing answers."""

    streaming = False

    def respond(self, payload: dict) -> None:
        raise AssertionError(payload)

    def end(self, error: Exception) -> None:
        raise AssertionError(error)


def test_a_client_numbers_requests_from_1_again_past_32_bits():
    # The clients counted on for ever: request 2**32 closed the connection.
    requests = Requests("/nowhere")
    first = requests.new("sdexec.exec", {})
    requests.track(first, _Waiting())
    requests.adopt(MAX_MATCHTAG - 1, _Waiting())
    numbered = [requests.new("sdexec.list", {})["matchtag"] for _ in range(2)]
    # The last one, then 1 again, which is in flight: 2.
    assert numbered == [MAX_MATCHTAG, 2]


def test_a_fault_of_ours_in_a_silent_write_sends_nothing(
    server, connection, logged_failures
):
    # An error on matchtag 0 would read as the connection's end.
    def broken(connection_id, payload):
        raise RuntimeError("broken")

    server.write = broken
    io = encode_io("stdin", "0", b"x")
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    assert connection.responses() == []
    assert not connection.transport.disconnecting
    (failure,) = logged_failures.flush(RuntimeError)  # a fault: its traceback
    assert failure.getErrorMessage() == "broken"


def test_descriptors_with_a_request_of_matchtag_0_end_the_connection(connection):
    # Refused for its descriptors, it would have been answered on matchtag 0.
    read_end, write_end = os.pipe()
    try:
        connection.protocol.fileDescriptorReceived(os.dup(write_end))
        connection.protocol.dataReceived(request_line("sdexec.list", {}, matchtag=0))
    finally:
        os.close(read_end)
        os.close(write_end)
    assert connection.responses() == [protocol_error(ZERO)]
    assert connection.transport.disconnecting


class HeldLookups:
    """Lookups answered only when the test says: an exec stays pending."""

    def __init__(self) -> None:
        self.waiting: list[defer.Deferred[Found]] = []

    def find(
        self, command: Command, default_cwd: str, uid: int | None = None
    ) -> defer.Deferred[Found]:
        self.waiting.append(defer.Deferred())
        return self.waiting[-1]


def test_behind_a_pending_exec_a_bad_matchtag_ends_the_connection_at_once(systemd):
    # A kill naming the pending exec's label would wait for it, and the kill
    # read after it would be answered first: the error must come at once.
    server = SdexecServer(
        systemd, parse_config({}), reactor, clock=Clock(), lookups=HeldLookups()
    )
    connection = Connection(server)
    cmd = {**TRUE, "label": "job"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=1)
    connection.send("sdexec.kill", {"signum": 10, "label": "job"}, matchtag=0)
    connection.send("sdexec.kill", {"signum": 15, "pid": 999999}, matchtag=3)
    assert connection.responses() == [protocol_error(ZERO)]
    assert connection.transport.disconnecting
    connection.close()
