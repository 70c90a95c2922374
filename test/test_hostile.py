"""Hostile and mistaken requests against the server, offline (issue 16):
each gets an error naming what was wrong, the connection behaves as
docs/protocol.md says, and nothing is started or tabled."""

from __future__ import annotations

import errno
import os
import signal
import sys

import pytest
from strategies import deeply_nested, json_line
from test_server import Connection, error_of
from twisted.internet import reactor
from twisted.internet.task import Clock

from sdexec.config import parse_config
from sdexec.server import SdexecServer
from sdexec.testing import FakeManager

ENVELOPE = {"type": "request", "topic": "sdexec.list", "matchtag": 4}


@pytest.fixture
def systemd():
    manager = FakeManager()
    yield manager
    manager.close()


@pytest.fixture
def server(systemd):
    return SdexecServer(systemd, parse_config({}), reactor, clock=Clock())


@pytest.fixture
def connection(server):
    opened = Connection(server)
    yield opened
    opened.close()


def still_serves(server: SdexecServer) -> None:
    """list and stats-get work, for a new client too."""
    other = Connection(server)
    other.send("sdexec.list", {})
    assert "payload" in other.last()
    other.send("sdexec.stats-get", {}, matchtag=2)
    assert "payload" in other.last()
    other.close()


@pytest.mark.parametrize("depth", [100, 975, 1000, 5000, 100_000])
def test_deep_nesting_is_answered_never_a_traceback(server, connection, depth):
    line = json_line({**ENVELOPE, "payload": {"x": deeply_nested(depth)}})
    connection.protocol.dataReceived(line)
    (response,) = connection.responses()
    if "payload" in response:  # decoded: list ignores what it is given
        assert depth < sys.getrecursionlimit()
        assert not connection.transport.disconnecting
    else:
        assert error_of(response) == (errno.EPROTO, "message is nested too deeply")
        assert connection.transport.disconnecting
    still_serves(server)


@pytest.mark.parametrize("kind", ["event", "response", None, 5])
def test_a_message_that_is_not_a_request_is_a_framing_error(connection, kind):
    connection.raw({**ENVELOPE, "type": kind})
    assert error_of(connection.last()) == (errno.EPROTO, 'type: expected "request"')
    assert connection.last()["matchtag"] == 0
    assert connection.transport.disconnecting
    connection.send("sdexec.list", {}, matchtag=5)  # nothing more is read
    assert len(connection.responses()) == 1


@pytest.mark.parametrize("encoding", [None, 5, [], {}, True])
def test_a_non_string_io_encoding_is_einval(connection, encoding):
    io = {"stream": "stdin", "data": "x", "encoding": encoding}
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=3)
    assert error_of(connection.last()) == (
        errno.EINVAL,
        'io.encoding: expected "UTF-8" or "base64"',
    )
    assert not connection.transport.disconnecting


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\udc80x"])
def test_a_lone_surrogate_escape_is_not_json_for_this_protocol(connection, escape):
    # msgspec refuses lone surrogates as invalid JSON: the message is a
    # framing error, so nothing of it reaches a handler.
    line = b'{"type":"request","topic":"sdexec.list","matchtag":1,"payload":{},'
    connection.protocol.dataReceived(line + f'"x":"{escape}"}}\n'.encode())
    assert connection.last()["errnum"] == errno.EPROTO
    assert connection.last()["errstr"].startswith("message is not valid JSON")
    assert connection.transport.disconnecting


@pytest.mark.parametrize("topic", ["sdexec.list\ud800", "\udfff", "sdexec.li\0st"])
def test_a_topic_that_is_not_text_is_einval(connection, topic):
    # Delivered decoded: the checks hold whatever the JSON decoder lets by.
    connection.protocol.messageReceived({**ENVELOPE, "topic": topic})
    response = connection.last()
    assert response["topic"] == ""  # it could not be echoed back
    assert response["errnum"] == errno.EINVAL
    assert response["errstr"].startswith("topic: ")
    assert not connection.transport.disconnecting


@pytest.mark.parametrize(
    "signum", [0, -1, signal.NSIG, 2**31, 2**40, -(2**63), True, "15"]
)
def test_an_out_of_range_signal_is_einval_before_systemd(
    systemd, connection, signum
):
    connection.send("sdexec.kill", {"pid": 4242, "signum": signum})
    assert error_of(connection.last()) == (
        errno.EINVAL,
        f"signum: expected a signal number from 1 to {signal.NSIG - 1}",
    )
    assert not [call for call in systemd.calls if call[0] == "KillUnit"]


@pytest.mark.parametrize("label", ["\ud800", "a\0b"])
def test_a_kill_label_that_is_not_text_is_einval(connection, label):
    connection.protocol.messageReceived(
        {**ENVELOPE, "topic": "sdexec.kill",
         "payload": {"label": label, "signum": 15}}
    )  # fmt: skip
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL and errstr.startswith("label: ")


def test_a_non_owner_is_answered_eperm_then_closed(server):
    server.owner_uid = os.getuid() + 1
    intruder = Connection(server)
    intruder.send("sdexec.list", {}, matchtag=8)
    assert intruder.responses() == [
        {
            "type": "response",
            "topic": "sdexec.list",
            "matchtag": 8,
            "errnum": errno.EPERM,
            "errstr": "only the service's owner may use it",
        }
    ]
    assert intruder.transport.disconnecting
    intruder.close()
