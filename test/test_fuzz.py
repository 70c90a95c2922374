"""The whole request schema, valid and malformed, against the server
(offline, sdexec.testing's FakeManager): 10,000 requests, each on a fresh
server, each answered by the contract of docs/protocol.md (issue 16).

For every request: nothing escapes as an exception; every response is one
JSON line naming its topic and matchtag; the connection is closed only
after an EPROTO, and an error on matchtag 0 is always its last words; a
unit is started only for an accepted exec, and then with text systemd can
take, no property the policy refuses and none of the
caller's systemd variables; and ``list`` and ``stats-get`` keep working for
everyone."""

from __future__ import annotations

import errno
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from offline import Connection
from strategies import json_line, requests
from twisted.internet.task import Clock

from sdexec.config import parse_config
from sdexec.environment import DROPPED_ENVIRONMENT
from sdexec.framing import FramingError
from sdexec.limits import check_text
from sdexec.policy import DEFAULT_ALLOWED
from sdexec.server import SdexecServer
from sdexec.testing import FakeManager

#: A site baseline, so that the policy's comparisons are exercised.
CONFIG = parse_config(
    {"exec": {"sdexec-properties": {"MemoryMax": "8G", "CPUWeight": "100"}}}
)


class NoSockets:
    """A reactor for the processes' channels that adopts nothing: the
    socketpairs are closed at once (10,000 cases must not hold fds until a
    real reactor turns)."""

    def adoptStreamConnection(self, fd: int, family: object, factory: Any) -> None:
        pass


def deliver(connection: Connection, request: Any, as_line: bool) -> None:
    """The request as the wire brings it: a JSON line, or (for what the
    decoder would refuse first, such as lone surrogates) already decoded."""
    protocol = connection.protocol
    if as_line or not isinstance(request, dict):
        protocol.dataReceived(json_line(request))
        return
    try:  # what JSONLineProtocol.dataReceived does with a decoded message
        protocol.messageReceived(request)
    except FramingError as error:
        protocol.framingError(str(error))


def check_response(response: dict) -> None:
    assert response["type"] == "response"
    assert isinstance(response["topic"], str)
    assert isinstance(response["matchtag"], int)
    if "errnum" in response:
        assert isinstance(response["errnum"], int) and response["errnum"] > 0
        assert isinstance(response["errstr"], str)
    else:
        assert isinstance(response["payload"], dict)


def check_started_units(manager: FakeManager) -> None:
    for properties in manager.properties.values():
        for prop in properties:
            if prop.source == "request":
                assert prop.name in DEFAULT_ALLOWED | {"MemoryMaxScale",
                                                       "MemoryHighScale"}  # fmt: skip
            for text in strings_of(prop.value):
                check_text(prop.name, text)
            if prop.name == "Environment":
                names = {entry.partition("=")[0] for entry in prop.value}
                assert not names & DROPPED_ENVIRONMENT


def strings_of(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [text for item in value for text in strings_of(item)]
    return []


def still_serves(server: SdexecServer) -> None:
    other = Connection(server)
    other.send("sdexec.list", {}, matchtag=1)
    other.send("sdexec.stats-get", {}, matchtag=2)
    assert [sorted(r) for r in other.responses()] == [
        ["matchtag", "payload", "topic", "type"]
    ] * 2
    other.close()


#: Requests per generated case: hypothesis draws a batch of requests far
#: faster than as many single ones (its per-case overhead dominates).
BATCH = 10
CASES = 1_000


def test_ten_thousand_requests_are_each_answered_by_the_contract():
    served: list[int] = []

    @settings(
        max_examples=CASES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(st.tuples(requests, st.booleans()), min_size=BATCH, max_size=BATCH))
    def serve(batch: list[tuple[Any, bool]]) -> None:
        manager = FakeManager()
        server = SdexecServer(manager, CONFIG, NoSockets(), clock=Clock())
        try:
            for request, as_line in batch:
                serve_one(server, request, as_line)
                served.append(1)
            started = {call[1] for call in manager.calls if call[0] == "start"}
            assert {p.unit_name for p in server.processes.values()} <= started
            check_started_units(manager)
            still_serves(server)
            json.dumps(server.stats())
        finally:
            manager.close()

    serve()
    assert len(served) >= CASES * BATCH


def serve_one(server: SdexecServer, request: Any, as_line: bool) -> None:
    """One request on a connection of its own, answered by the contract."""
    connection = Connection(server)
    try:
        deliver(connection, request, as_line)
        responses = connection.responses()  # each line is JSON
        for response in responses:
            check_response(response)
        if connection.transport.disconnecting:
            assert responses[-1]["errnum"] == errno.EPROTO
        last_words = [r for r in responses if r["matchtag"] == 0 and "errnum" in r]
        if last_words:  # never an answer to a request (review session 35 P1)
            assert last_words == responses[-1:]
            assert connection.transport.disconnecting
    finally:
        connection.close()
