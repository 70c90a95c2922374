"""The HTTP statistics site against what any local user may send it: a
body, many idle connections, long request lines. Real TCP sockets; each
client runs in a thread so the reactor serves meanwhile."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest
from pytest_twisted import ensureDeferred
from twisted.internet import reactor
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.internet.threads import deferToThread
from twisted.logger import globalLogPublisher
from twisted.python import log
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest

from sdexec.stats import (
    MAX_REUSE_S,
    MAX_STATS_CONNECTIONS,
    STATS_SHARE,
    STATS_TIMEOUT,
    _rendered,
    _StatsChannel,
    recent,
    stats_site,
)


@pytest.fixture
def site_port():
    """The site on 127.0.0.1 (an ephemeral port); its port number."""
    site = stats_site(lambda: {"counters": {"started": 1}})
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    yield site, port.getHost().port
    port.stopListening()


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request``, then read until the site closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        return _read_to_eof(sock)


def _read_to_eof(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


GET = b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


class Costly:
    """A ``produce`` that takes ``cost`` seconds by its own timer."""

    def __init__(self, cost: float) -> None:
        self.cost, self.now, self.made = cost, 0.0, 0

    def timer(self) -> float:
        return self.now

    def __call__(self) -> dict:
        self.made += 1
        self.now += self.cost
        return {"n": self.made}


def test_an_answer_takes_a_bounded_share_of_the_service_s_time():
    # Any local user may ask back to back; with thousands of processes
    # each answer held the reactor for 85 ms.
    clock, produce = Clock(), Costly(0.085)
    answer = recent(produce, clock, produce.timer)
    assert [answer() for _ in range(100)] == [{"n": 1}] * 100
    clock.advance(0.085 / STATS_SHARE - 0.001)
    assert answer() == {"n": 1}
    clock.advance(0.001)
    assert answer() == {"n": 2} and produce.made == 2


def test_an_answer_made_across_a_stall_is_not_kept_for_ten_times_it():
    # A 60 s stall while it was made kept /stats stale for 10 minutes.
    clock, produce = Clock(), Costly(60.0)
    answer = recent(produce, clock, produce.timer)
    answer()
    clock.advance(MAX_REUSE_S)
    assert answer() == {"n": 2}


def test_a_cheap_answer_is_made_anew_at_once():
    clock, produce = Clock(), Costly(0.0)
    answer = recent(produce, clock, produce.timer)
    assert [answer()["n"] for _ in range(3)] == [1, 2, 3]


def test_the_site_renders_stats_by_the_same_rule():
    clock, asked = Clock(), []
    site = stats_site(lambda: asked.append(1) or {"n": len(asked)}, clock=clock)
    resource = site.resource.children[b"stats"]
    request = DummyRequest([b"stats"])
    assert json.loads(resource.render_GET(request)) == {"n": 1}
    clock.advance(1)  # far longer than rendering this took, times ten
    assert json.loads(resource.render_GET(request)) == {"n": 2}


@ensureDeferred
async def test_get_stats_answers_json(site_port):
    _site, port = site_port
    answer = await deferToThread(exchange, port, GET)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert json.loads(body) == {"counters": {"started": 1}}


@pytest.mark.parametrize(
    ("target", "status"),
    [
        (b"http://127.0.0.1/stats", b"200"),
        (b"HTTP://localhost:8490/stats/", b"200"),
        (b"http://127.0.0.1", b"404"),
        (b"http://[::1/stats", b"404"),
    ],
)
@ensureDeferred
async def test_an_absolute_form_target_is_served_as_its_path(site_port, target, status):
    # RFC 9112 (3.2.2): a server must accept it. Twisted took the whole URL
    # for the path: a 404 for /stats.
    _site, port = site_port
    request = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    logged: list[dict] = []
    log.addObserver(logged.append)
    try:
        answer = await deferToThread(exchange, port, request)
    finally:
        log.removeObserver(logged.append)
    assert answer.startswith(b"HTTP/1.1 " + status)
    assert logged == []


@pytest.mark.parametrize(
    "headers",
    [b"Content-Length: 52428800\r\n", b"Transfer-Encoding: chunked\r\n"],
    ids=["content-length", "chunked"],
)
@ensureDeferred
async def test_a_request_body_is_refused_unread(site_port, headers, monkeypatch):
    # Twisted would have spooled a 50 MiB body to a temporary file (any
    # local user, any size): refused on its headers, before any of it.
    _site, port = site_port
    spooled: list[object] = []  # Twisted's spool for a large body (no name)
    spool = tempfile.TemporaryFile
    monkeypatch.setattr(
        tempfile, "TemporaryFile", lambda *a, **kw: spooled.append(1) or spool(*a, **kw)
    )
    request = b"POST /stats HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    answer = await deferToThread(exchange, port, request)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert spooled == []


def _fields(count: int, size: int) -> bytes:
    return b"".join(b"X-%d: %s\r\n" % (i, b"y" * size) for i in range(count))


@pytest.mark.parametrize(
    ("request_head", "status", "why"),
    [
        (
            b"GET /metrics?" + b"name[]=x&" * 2000 + b" HTTP/1.1\r\n",
            b"414 URI Too Long",
            b"request line longer than 16384 bytes",
        ),
        (
            b"GET /stats HTTP/1.1\r\n" + _fields(1, 17000),
            b"431 Request Header Fields Too Large",
            b"header field longer than 16384 bytes",
        ),
        (
            b"GET /stats HTTP/1.1\r\n" + _fields(20, 1000),
            b"431 Request Header Fields Too Large",
            b"request line and header fields longer than 16384 bytes",
        ),
        (
            b"GET /stats HTTP/1.1\r\n" + _fields(501, 1),
            b"431 Request Header Fields Too Large",
            b"more than 500 header fields",
        ),
        (
            b"GET /stats HTTP/2.0\r\n",
            b"400 Bad Request",
            b"malformed request line: not METHOD TARGET HTTP/1.1 (or HTTP/1.0)",
        ),
        (
            b"GET /stats HTTP/1.1\r\nHost x\r\n",
            b"400 Bad Request",
            b"malformed header field: Host x",
        ),
        (
            b"GET /stats HTTP/1.1\r\nContent-Length: \xff" + b"9" * 100 + b"\r\n",
            b"400 Bad Request",
            b"malformed header field: Content-Length: \\xff" + b"9" * 63,
        ),
        (
            b"GET /stats HTTP/1.1\r\n",
            b"400 Bad Request",
            b"no Host header field: an HTTP/1.1 request must have one",
        ),
        (
            b"GET /stats HTTP/1.1\r\nHost: a\r\nHost: b\r\n",
            b"400 Bad Request",
            b"more than one Host header field",
        ),
        (
            b"GET /stats HTTP/1.0\r\nHost: a b/c\r\n",
            b"400 Bad Request",
            b"malformed Host header field: a b/c",
        ),
    ],
    ids=[
        "long-request-line",
        "long-field",
        "large-head",
        "many-fields",
        "version",
        "no-colon",
        "bad-length",
        "no-host",
        "two-hosts",
        "bad-host",
    ],
)
@ensureDeferred
async def test_a_request_not_read_is_refused_saying_why(
    site_port, request_head, status, why
):
    # Twisted closed a request line or a field over 16 KiB without a word
    # (a long name[] selection: an empty reply), and answered the rest with
    # "400 Bad Request" alone, whatever was wrong.
    _site, port = site_port
    answer = await deferToThread(exchange, port, request_head + b"\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status + b"\r\n")
    assert body == why + b"\n"
    assert b"Content-Length: %d\r\n" % len(body) in head + b"\r\n"


@pytest.mark.parametrize(
    "request_lines",
    [
        b"GET /stats HTTP/1.0\n\n",
        b"GET /stats HTTP/1.1\nHost: x\nConnection: close\n\n",
        b"GET /stats HTTP/1.1\r\nHost: x\nConnection: close\r\n\n",
    ],
    ids=["lf", "lf-fields", "mixed"],
)
@ensureDeferred
async def test_lines_ending_in_lf_alone_are_read(site_port, request_lines):
    # RFC 9112 (2.2) lets a server take a bare LF for a line's end: a
    # request typed with printf and sent by nc waited for the idle timeout,
    # then the connection was closed without an answer.
    _site, port = site_port
    answer = await deferToThread(exchange, port, request_lines)
    assert answer.split(b" ", 2)[1] == b"200"


@pytest.mark.parametrize("end", [b"\r\n", b"\n"], ids=["crlf", "lf"])
@pytest.mark.parametrize(("size", "status"), [(16384, b"200"), (16385, b"414")])
@ensureDeferred
async def test_a_line_s_length_leaves_out_its_end(site_port, end, size, status):
    _site, port = site_port
    line = b"GET /stats?" + b"x" * (size - len(b"GET /stats? HTTP/1.0")) + b" HTTP/1.0"
    assert len(line) == size
    answer = await deferToThread(exchange, port, line + end + end)
    assert answer.split(b" ", 2)[1] == status


@pytest.mark.parametrize(
    ("version", "host"),
    [
        (b"HTTP/1.0", b""),  # HTTP/1.0 may leave it out
        (b"HTTP/1.1", b"Host: [fd00::5]:8490\r\n"),
        (b"HTTP/1.1", b"Host:\r\n"),  # empty: a target without authority
        (b"HTTP/1.1", b"Host: %2Frun%2Fsdexec%2Fstats.sock\r\n"),
    ],
)
@ensureDeferred
async def test_a_request_with_its_host_or_one_not_needing_it_is_served(
    site_port, version, host
):
    _site, port = site_port
    request = b"GET /stats " + version + b"\r\n" + host + b"Connection: close\r\n\r\n"
    answer = await deferToThread(exchange, port, request)
    assert answer.startswith(version + b" 200 ")


@pytest.mark.parametrize(
    "connection",
    [
        b"Connection: keep-alive,close\r\n",
        b"Connection: keep-alive\r\nConnection: close\r\n",
        b"Connection: Close\r\n",
    ],
    ids=["list", "second-field", "case"],
)
@ensureDeferred
async def test_a_request_that_names_close_is_answered_then_closed(
    site_port, connection
):
    # Twisted read the first Connection field alone, split at spaces: the
    # connection stayed open, and a client reading to its end waited for
    # the idle timeout.
    site, port = site_port
    request = b"GET /stats HTTP/1.1\r\nHost: x\r\n" + connection + b"\r\n"
    answer = await deferToThread(exchange, port, request)
    head, _, _body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"\r\nConnection: close\r\n" in head + b"\r\n"
    assert site.channels == {}


@pytest.mark.parametrize("method", [b"POST", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"])
@pytest.mark.parametrize("path", [b"/stats", b"/metrics", b"/nowhere"])
@ensureDeferred
async def test_a_method_other_than_get_or_head_is_not_allowed(
    metrics_port, method, path
):
    # Twisted answered with an HTML page: 405 for POST, "501 Huh?" else.
    request = method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    answer = await deferToThread(exchange, metrics_port, request + b"\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405 ")
    assert b"\r\nAllow: GET, HEAD\r\n" in head + b"\r\n"
    assert body == b"method not allowed: only GET and HEAD are served\n"


def hold_connections(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def closed_by_the_site(sock: socket.socket) -> bool:
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def hold_trickling_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` connections, each with a request begun and not finished,
    as a client trickling a byte now and then under the idle timeout."""
    held = hold_connections(port, count)
    for sock in held:
        sock.sendall(b"GET /stats HTTP/1.1\r\n")
    return held


def finish_keeping_alive(sock: socket.socket) -> bytes:
    """Finish the request begun by hold_trickling_connections, keeping the
    connection open (HTTP/1.1's default); the answer's head."""
    sock.sendall(b"Host: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head


def client_ports(site) -> set[int]:
    """The client-side ports of the connections the site holds open."""
    return {channel.transport.getPeer().port for channel in site.channels}


def port_of(sock: socket.socket) -> int:
    return sock.getsockname()[1]


@ensureDeferred
async def test_a_new_connection_takes_the_place_of_the_longest_waiting(site_port):
    # Refusing newcomers once full let 64 trickling connections keep every
    # scrape out for as long as they cared to.
    site, port = site_port
    held = await deferToThread(hold_trickling_connections, port, MAX_STATS_CONNECTIONS)
    try:
        # The second one is served, and waits anew as the newest.
        head = await deferToThread(finish_keeping_alive, held[1])
        assert head.startswith(b"HTTP/1.1 200")
        answer = await deferToThread(exchange, port, GET)
        assert answer.startswith(b"HTTP/1.1 200")
        assert port_of(held[0]) not in client_ports(site)
        assert await deferToThread(closed_by_the_site, held[0])
        assert site.closing == 0  # its descriptor is closed: none pending
        # Full again (accepted in order, before the newcomer); the next
        # newcomer passes held[1] over for held[2].
        held += await deferToThread(hold_trickling_connections, port, 1)
        answer = await deferToThread(exchange, port, GET)
        assert answer.startswith(b"HTTP/1.1 200")
        assert port_of(held[2]) not in client_ports(site)
        assert {port_of(sock) for sock in [held[1], *held[3:]]} == client_ports(site)
        assert await deferToThread(closed_by_the_site, held[2])
        # The others are still served.
        held[3].sendall(b"Host: x\r\nConnection: close\r\n\r\n")
        answer = await deferToThread(_read_to_eof, held[3])
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()


class _Held(Resource):
    """A resource answered later, as /metrics is (rendered in a thread)."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests: list = []

    def render_GET(self, request):
        self.requests.append(request)
        return NOT_DONE_YET


@ensureDeferred
async def test_a_connection_being_served_is_not_closed_for_a_newcomer():
    held = _Held()
    site = stats_site(lambda: {}, metrics=held)
    listening = reactor.listenTCP(0, site, interface="127.0.0.1")
    port = listening.getHost().port
    scraper = await deferToThread(hold_connections, port, 1)
    others: list[socket.socket] = []
    try:
        scraper[0].sendall(GET.replace(b"/stats", b"/metrics"))
        for _ in range(3000):  # at most 30 s
            if held.requests:  # complete, and now being answered
                break
            await deferLater(reactor, 0.01)
        else:
            raise AssertionError("the scrape never came")
        others = await deferToThread(
            hold_trickling_connections, port, MAX_STATS_CONNECTIONS - 1
        )
        answer = await deferToThread(exchange, port, GET)
        assert answer.startswith(b"HTTP/1.1 200")
        assert port_of(others[0]) not in client_ports(site)  # not the scraper
        assert port_of(scraper[0]) in client_ports(site)
        held.requests[0].write(b"metrics\n")
        held.requests[0].finish()
        assert b"metrics" in await deferToThread(_read_to_eof, scraper[0])
    finally:
        for sock in scraper + others:
            sock.close()
        await listening.stopListening()


def test_connections_closed_to_make_room_count_until_they_are_gone():
    # Their descriptors close a reactor pass later: a burst accepted in one
    # pass must not hold more than twice the cap.
    site = stats_site(lambda: {})
    held = []
    for _ in range(2 * MAX_STATS_CONNECTIONS):
        channel = site.buildProtocol(None)
        channel.makeConnection(StringTransport())
        held.append(channel)
    assert site.closing == MAX_STATS_CONNECTIONS
    assert site.buildProtocol(None) is None  # refused: too many closing
    for channel in held[:MAX_STATS_CONNECTIONS]:
        assert channel.transport.disconnecting  # aborted
        channel.connectionLost(Failure(ConnectionDone()))
    assert site.closing == 0
    assert len(site.channels) == MAX_STATS_CONNECTIONS
    assert site.buildProtocol(None) is not None


def test_idle_connections_are_closed_sooner_than_twisteds_minute(site_port):
    site, _port = site_port
    assert site.timeOut == STATS_TIMEOUT < 60


def test_idle_connections_are_closed_without_a_log_line():
    # Twisted's "Timing out client" for each: any local user could put 64
    # lines in the journal every STATS_TIMEOUT seconds, for ever.
    clock, logged = Clock(), []
    site = stats_site(lambda: {})
    idle = [site.buildProtocol(None) for _ in range(3)]
    globalLogPublisher.addObserver(logged.append)
    try:
        for channel in idle:
            channel.callLater = clock.callLater  # as the site gives it its reactor's
            channel.makeConnection(StringTransport())
        clock.advance(STATS_TIMEOUT)
    finally:
        globalLogPublisher.removeObserver(logged.append)
    assert all(channel.transport.disconnecting for channel in idle)
    assert logged == []
    assert clock.getDelayedCalls() == []  # no later abort (nor its log line)
    for channel in idle:
        channel.connectionLost(Failure(ConnectionDone()))
    assert site.channels == {}


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/stats", 200),
        ("/metrics", 200),
        ("/stats/", 200),
        ("/elsewhere", 404),
        ("/stats/x", 404),  # a page is a leaf: it answered any path below it
        ("/metrics/x/y", 404),
    ],
)
@ensureDeferred
async def test_no_access_log_line_repeats_what_a_request_sent(
    metrics_port, method, path, status
):
    # HEAD too: Twisted logged each HEAD answered with a body (/stats', its
    # 404 page's), quoting the path and query (review session 40 M M1).
    logged: list[dict] = []
    log.addObserver(logged.append)
    try:
        request = (
            f"{method} {path}?{'A' * 7000} HTTP/1.1\r\nHost: x\r\n"
            f"User-Agent: {'B' * 7000}\r\nConnection: close\r\n\r\n"
        ).encode()
        answer = await deferToThread(exchange, metrics_port, request)
    finally:
        log.removeObserver(logged.append)
    assert answer.startswith(b"HTTP/1.1 %d" % status)
    assert logged == []


@pytest.mark.parametrize(
    "path", ["/stats", "/elsewhere", "/metrics", "/metrics?name[]=sdexec_drained"]
)
@ensureDeferred
async def test_head_answers_the_get_s_headers_without_its_body(metrics_port, path):
    # /metrics' HEAD had no Content-Length, and its GET was chunked.
    got, head = [
        await deferToThread(exchange, metrics_port, GET.replace(b"GET /stats", request))
        for request in (b"GET " + path.encode(), b"HEAD " + path.encode())
    ]
    got_head, _, body = got.partition(b"\r\n\r\n")
    assert head.endswith(b"\r\n\r\n") and head.count(b"\r\n\r\n") == 1  # no body
    assert head.split(b"\r\n")[0] == got_head.split(b"\r\n")[0]  # its status
    assert _header(head, b"Content-Length") == b"%d" % len(body)
    assert _header(head, b"Content-Type") == _header(got_head, b"Content-Type")


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` in ``head``, if it has one."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b": ")
        if key.lower() == name.lower():
            return value
    return None


def test_stats_are_rendered_as_indented_json():
    stats = {"procs": [{"pid": 7, "cmdline": "é ☃ \x01", "cpu": 0.25, "job": None}]}
    body = _rendered(stats)
    assert json.loads(body) == stats
    assert body.startswith(b'{\n  "procs": [\n    {\n      "pid": 7,')
    assert body.endswith(b"\n}\n")


@ensureDeferred
async def test_requests_sent_ahead_of_unread_answers_are_not_answered(monkeypatch):
    # A 64 KiB write of pipelined requests, never read: Twisted answered
    # each into the write buffer, a copy of the table per request (283 MB
    # within half a second).
    answered, failures = [], []
    done = _StatsChannel.requestDone
    monkeypatch.setattr(
        _StatsChannel,
        "requestDone",
        lambda self, r: answered.append(r) or done(self, r),
    )
    site = stats_site(lambda: {"table": "x" * 100_000})
    built: list = []
    build = site.buildProtocol
    site.buildProtocol = lambda addr: built.append(addr) or build(addr)
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    client = socket.socket()
    globalLogPublisher.addObserver(failures.append)
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port.getHost().port))
        request = b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n"
        client.sendall(request * (65536 // len(request)))
        for _ in range(3000):  # at most 30 s: a loaded machine's reactor
            await deferLater(reactor, 0.01)
            if built and not site.channels:
                break
        # Closed once the one answer made is written (to the kernel's
        # buffers, here), the 2849 requests behind it unanswered.
        assert built and site.channels == {}
        assert len(answered) == 1
    finally:
        globalLogPublisher.removeObserver(failures.append)
        client.close()
        await port.stopListening()
    assert [e for e in failures if "log_failure" in e] == []


@ensureDeferred
async def test_pipelined_requests_whose_answers_are_read_are_all_answered(site_port):
    _site, port = site_port
    ahead = b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n" * 3 + GET
    answer = await deferToThread(exchange, port, ahead)
    assert answer.count(b"HTTP/1.1 200") == 4


@ensureDeferred
async def test_a_reader_sending_ahead_gets_the_answers_made_then_the_close():
    # An answer larger than the transport takes at once pauses the channel
    # before any byte is sent: the request behind it is not answered, but
    # the answer made is still written (not dropped by an abort).
    site = stats_site(lambda: {"table": "x" * 100_000})
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    try:
        ahead = b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n" * 2
        answer = await deferToThread(exchange, port.getHost().port, ahead)
    finally:
        await port.stopListening()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"x" * 100_000 in body
    assert answer.count(b"HTTP/1.1 200") == 1


def exchange_half_closed(address, request: bytes) -> bytes:
    """Send ``request`` and shut the sending side (``nc -N``), then read
    until the site closes the connection; ``address`` a TCP port on
    127.0.0.1 or a UNIX socket's path."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    target = address if isinstance(address, str) else ("127.0.0.1", address)
    with socket.socket(family) as sock:
        sock.settimeout(30)
        sock.connect(target)
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        return _read_to_eof(sock)


@pytest.mark.parametrize("family", ["tcp", "unix"])
@ensureDeferred
async def test_a_client_that_shuts_its_side_gets_its_answers(family, tmp_path):
    # Twisted took the end of the client's sending for a close and dropped
    # the answer not yet written: an HTTP/1.1 request's got nothing.
    site = stats_site(lambda: {"counters": {"started": 1}})
    if family == "unix":
        address = str(tmp_path / "stats.sock")
        port = reactor.listenUNIX(address, site)
    else:
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        address = port.getHost().port
    try:
        request = b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n"
        answer = await deferToThread(exchange_half_closed, address, request * 2)
    finally:
        await port.stopListening()
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2
    assert answer.endswith(b'"started": 1\n  }\n}\n')
    assert site.channels == {}


@ensureDeferred
async def test_a_client_that_shuts_its_side_mid_request_is_closed(site_port):
    site, port = site_port
    unfinished = b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\nGET /stats HTTP/1.1\r\n"
    answer = await deferToThread(exchange_half_closed, port, unfinished)
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 1
    assert site.channels == {}


# -- GET /metrics, offline: the registry over stand-in counters -----------------


@pytest.fixture
def metrics_page():
    """``/metrics`` of a registry whose ``/stats`` has 3 execs, 2 refused
    requests, a drained node, one running process and a manager that has
    not answered a start for 40 s: its Metrics, and the site's port."""
    from sdexec.metrics import Metrics

    stats = {
        "requests": {"sdexec.exec": 3, "errors": 2, "oom-kills": 1},
        "procs": [{"state": "R"}],
        "users": {"users": {"0": {"connections": 2}, "1001": {"connections": 1}}},
        "drain": {
            "drained": True,
            "reason": "maintenance",
            "causes": [
                {"reason": "maintenance", "kind": "admin", "lifts-itself": False}
            ],
        },
        "systemd": {
            "connected": True,
            "version": "252",
            "calls": {
                "unanswered": 3,
                "queued": 1,
                "oldest": {"call": "StartTransientUnit", "seconds": 40.5},
            },
        },
    }
    metrics = Metrics(reactor, lambda: stats)
    site = stats_site(lambda: stats, metrics.resource())
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    yield metrics, port.getHost().port
    port.stopListening()


@pytest.fixture
def metrics_port(metrics_page):
    """The port of :func:`metrics_page`."""
    return metrics_page[1]


def _metrics_request(method: str, query: str = "") -> bytes:
    return (
        f"{method} /metrics{query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    ).encode()


async def _selected(port: int, names) -> bytes:
    """The answer to a scrape of the families ``names`` (``?name[]=``),
    checked to be a 200."""
    query = "?" + "&".join(f"name[]={name}" for name in names)
    answer = await deferToThread(exchange, port, _metrics_request("GET", query))
    assert answer.startswith(b"HTTP/1.1 200 ")
    return answer


@ensureDeferred
async def test_metrics_named_in_the_query_include_those_of_stats(metrics_port):
    # prometheus-client never asked the collector of the /stats numbers for
    # a filtered scrape (it described no family): a slimmed scrape of
    # sdexec_drained and sdexec_oom_kills_total got nothing, its alerts never fired.
    names = "sdexec_drained", "sdexec_oom_kills_total", "sdexec_requests_total"
    answer = await _selected(metrics_port, names)
    assert b"sdexec_drained 1.0" in answer
    assert b"sdexec_oom_kills_total 1.0" in answer
    assert b'sdexec_requests_total{topic="sdexec.exec"} 3.0' in answer
    assert b"sdexec_processes" not in answer


@ensureDeferred
async def test_metrics_rendered_for_a_client_that_shut_its_side_are_written(
    metrics_port,
):
    # The answer is rendered in the reactor's thread pool: the client's
    # end of sending was taken for its leaving, and the answer dropped.
    request = _metrics_request("GET", "?name[]=sdexec_drained")
    answer = await deferToThread(exchange_half_closed, metrics_port, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"\nsdexec_drained 1.0\n" in body


@ensureDeferred
async def test_metrics_named_as_their_type_line_names_them_are_selected(
    metrics_port,
):
    # prometheus-client selects by sample name: a histogram named by its
    # family (# TYPE sdexec_exec_start_duration_seconds histogram), or a
    # counter as OpenMetrics names it, got nothing.
    names = "sdexec_exec_start_duration_seconds", "sdexec_requests"
    answer = await _selected(metrics_port, names)
    assert b'sdexec_exec_start_duration_seconds_bucket{le="+Inf"} 0.0' in answer
    assert b"sdexec_exec_start_duration_seconds_count 0.0" in answer
    assert b'sdexec_requests_total{topic="sdexec.exec"} 3.0' in answer
    assert b"sdexec_drained" not in answer


@ensureDeferred
async def test_the_process_families_are_selected_by_name(metrics_port):
    # prometheus-client's ProcessCollector describes no family, and a
    # registry selects by what its collectors describe: ?name[]= for any
    # of the families docs/operating.md lists under "The service's own
    # process" (process_open_fds, the descriptor alert) got nothing.
    names = "process_open_fds", "process_max_fds", "process_cpu_seconds_total"
    answer = await _selected(metrics_port, names)
    body = answer.partition(b"\r\n\r\n")[2]
    served = {line.split()[0] for line in body.splitlines() if line[:1] != b"#"}
    assert served == {name.encode() for name in names}


@ensureDeferred
async def test_an_absolute_form_target_keeps_its_query(metrics_port):
    request = _metrics_request("GET", "?name[]=sdexec_drained").replace(
        b"GET /metrics", b"GET http://127.0.0.1:8490/metrics"
    )
    answer = await deferToThread(exchange, metrics_port, request)
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert b"sdexec_drained 1.0" in answer
    assert b"sdexec_processes" not in answer


@ensureDeferred
async def test_metrics_are_gzipped_for_a_scraper_that_takes_it(metrics_port):
    request = b"GET /metrics HTTP/1.0\r\nAccept-Encoding: deflate, GZIP;q=1\r\n\r\n"
    answer = await deferToThread(exchange, metrics_port, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Content-Encoding: gzip" in head
    assert b"sdexec_systemd_connected 1.0" in gzip.decompress(body)


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@ensureDeferred
async def test_metrics_answers_say_what_they_vary_by(metrics_port, method):
    # The format and the coding are negotiated: without Vary (RFC 9110,
    # 12.5.5) a cache in front gave one scraper's gzipped or OpenMetrics
    # answer to the next, which asked for neither.
    request = _metrics_request(method).replace(
        b"Host: x\r\n", b"Host: x\r\nAccept-Encoding: gzip\r\n"
    )
    answer = await deferToThread(exchange, metrics_port, request)
    head = answer.partition(b"\r\n\r\n")[0]
    assert b"\r\nVary: Accept, Accept-Encoding\r\n" in head


@pytest.mark.parametrize(
    "accept_encoding",
    [b"gzip;q=0", b"identity;q=1, GZIP; q=0.000", b"gzip;q=x", b"x-gzip, br"],
)
@ensureDeferred
async def test_metrics_are_not_gzipped_for_a_scraper_that_refuses_it(
    metrics_port, accept_encoding
):
    # RFC 9110 (12.5.3): q=0 is "not acceptable"; prometheus-client's
    # gzip_accepted looked at the name alone.
    request = b"GET /metrics HTTP/1.0\r\nAccept-Encoding: " + accept_encoding
    answer = await deferToThread(exchange, metrics_port, request + b"\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 ")
    assert b"Content-Encoding" not in head
    assert b"sdexec_systemd_connected 1.0" in body


@ensureDeferred
async def test_metrics_tell_a_manager_that_does_not_answer(metrics_port):
    answer = await deferToThread(exchange, metrics_port, _metrics_request("GET"))
    assert b"sdexec_systemd_connected 1.0" in answer
    assert b'sdexec_systemd_calls_waiting{state="unanswered"} 3.0' in answer
    assert b'sdexec_systemd_calls_waiting{state="queued"} 1.0' in answer
    assert b"sdexec_systemd_oldest_call_seconds 40.5" in answer


@ensureDeferred
async def test_metrics_answer_head_as_stats_does(metrics_port):
    answer = await deferToThread(exchange, metrics_port, _metrics_request("HEAD"))
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.endswith(b"\r\n\r\n") and b"sdexec_" not in answer  # no body


@ensureDeferred
async def test_refused_requests_are_not_called_protocol_errors(metrics_port):
    # "Messages refused before dispatch" counted a kill of an exited pid and
    # every exec of a drained node: an alert on protocol errors paged then.
    answer = await deferToThread(exchange, metrics_port, _metrics_request("GET"))
    assert b"sdexec_requests_refused_total 2.0" in answer
    assert b"protocol_errors" not in answer


@pytest.mark.parametrize(
    "accept",
    [
        "text/plain; version=x",
        "application/openmetrics-text; version=zz",
        "application/openmetrics-text; version=2.x",
        "text/plain; version=1.a, */*",
    ],
)
@ensureDeferred
async def test_a_malformed_accept_version_gets_the_text_format(metrics_port, accept):
    # prometheus-client raises TypeError for a version not all numbers: a
    # 500 and a 16-line critical traceback per request (review session 40 M M2).
    await _text_format_answered(metrics_port, f"Accept: {accept}".encode())


@pytest.mark.parametrize(
    ("asked", "written"),
    [("1.0.0", "1.0.0"), ("1.5", "1.0.0"), ("2.0.0", "2.0.0"), ("9", "2.0.0")],
)
@ensureDeferred
async def test_openmetrics_names_the_version_written(metrics_port, asked, written):
    # prometheus-client writes 1.0.0 or 2.0.0, and its Content-Type echoed
    # whatever version was asked (version=9).
    request = _metrics_request("GET").replace(
        b"\r\n\r\n",
        f"\r\nAccept: application/openmetrics-text; version={asked}\r\n\r\n".encode(),
    )
    answer = await deferToThread(exchange, metrics_port, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    content_type = f"application/openmetrics-text; version={written}; charset=utf-8"
    assert f"Content-Type: {content_type}".encode() in head
    assert body.endswith(b"# EOF\n")


@pytest.mark.parametrize("header", [b"Accept", b"Accept-Encoding"])
@ensureDeferred
async def test_a_header_that_is_not_utf8_gets_the_text_format(metrics_port, header):
    # Twisted's getHeader("accept") decodes UTF-8 and raised on \xff: a 500
    # and a critical traceback per request, which no rate bounded.
    head = await _text_format_answered(
        metrics_port, header + b": text/plain; version=\xff"
    )
    assert b"Content-Encoding" not in head


async def _text_format_answered(metrics_port, header_line: bytes) -> bytes:
    """The head of the answer to a scrape sent with ``header_line``, which
    must be the text format's, uncompressed, and logged nothing."""
    request = _metrics_request("GET").replace(
        b"\r\n\r\n", b"\r\n" + header_line + b"\r\n\r\n"
    )
    logged: list[dict] = []
    log.addObserver(logged.append)
    try:
        answer = await deferToThread(exchange, metrics_port, request)
    finally:
        log.removeObserver(logged.append)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in head
    assert b"sdexec_drained 1.0" in body
    assert logged == []
    return head


class _Broken:
    """A collector that fails every scrape."""

    def collect(self):
        raise RuntimeError("broken collector")


@ensureDeferred
async def test_failed_scrapes_log_at_a_bounded_rate(metrics_page, logged_failures):
    # Whatever fault a request provokes, a scraper in a loop must not write
    # a traceback per request.
    from sdexec.lograte import BURST, WINDOW_S, LogRate
    from sdexec.metrics import log as metrics_log

    metrics, port = metrics_page
    clock = Clock()
    metrics.log_rate = LogRate(metrics_log, clock)
    metrics.registry.register(_Broken())
    logged: list[dict] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        for _ in range(BURST + 5):
            answer = await deferToThread(exchange, port, _metrics_request("GET"))
            assert answer.startswith(b"HTTP/1.1 500 ")
        clock.advance(WINDOW_S)
    finally:
        globalLogPublisher.removeObserver(logged.append)
    said = [event.get("log_format") for event in logged]
    assert said[:BURST] == ["rendering /metrics"] * BURST
    assert all("broken collector" in str(e["log_failure"]) for e in logged[:BURST])
    assert len(said) == BURST + 1 and said[-1].startswith("{suppressed} more like it")
    assert logged[-1]["suppressed"] == 5
    assert logged_failures.flush() == [e["log_failure"] for e in logged[:BURST]]


class _TurnsByAClock(Clock):
    """A reactor for Metrics: the real one's thread pool (a rendering is
    real, and served over TCP), a Clock's time (when a rendering's turn
    comes is the test's to say)."""

    def getThreadPool(self):
        return reactor.getThreadPool()

    def callFromThread(self, f, *args):
        reactor.callFromThread(f, *args)


def _openmetrics_request(version: str) -> bytes:
    return (
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Accept: application/openmetrics-text; version={version}\r\n\r\n"
    ).encode()


@ensureDeferred
async def test_a_new_format_in_every_scrape_is_rendered_in_its_turn():
    # Review session 46: Accept's version is the client's choice (and
    # name[]), and a new one in every scrape rendered every answer anew,
    # past what an answer given again costs the service: a loop of them
    # made every list 50 times slower.
    from sdexec.metrics import Metrics

    clock, ticks = _TurnsByAClock(), iter(range(10**6))
    stats = {"requests": {}, "procs": [], "users": {"users": {}}, "drain": {
             "drained": False, "reason": None, "causes": []}, "systemd": {
             "connected": True, "calls": {
             "unanswered": 0, "queued": 0, "oldest": None}}}  # fmt: skip
    metrics = Metrics(clock, lambda: stats, cost_timer=lambda: next(ticks) / 100)
    port = reactor.listenTCP(0, stats_site(lambda: stats, metrics.resource()))
    try:
        address = port.getHost().port
        first = await deferToThread(exchange, address, _openmetrics_request("1.0.0"))
        assert first.startswith(b"HTTP/1.1 200 ")
        second = deferToThread(exchange, address, _openmetrics_request("2.0.0"))
        while not clock.getDelayedCalls() and not second.called:
            await deferLater(reactor, 0.01, lambda: None)
        assert not second.called  # it waits for the first one's rest
        clock.advance(MAX_REUSE_S)
        answer = await second
        assert answer.startswith(b"HTTP/1.1 200 ") and b"version=2.0.0;" in answer
    finally:
        metrics.stop()
        await port.stopListening()


#: A service whose /metrics is being rendered (slowly: a collector that
#: sleeps) when the reactor stops, as systemctl stop makes it.
_STOP_DURING_A_SCRAPE = """
import os, socket, sys, threading, time
from twisted.internet import asyncioreactor
asyncioreactor.install()
from twisted.internet import defer, reactor
from prometheus_client.registry import Collector
from sdexec.config import load_config
from sdexec.service import SdexecService
from sdexec.testing import FakeManager

class Slow(Collector):
    def collect(self):
        time.sleep(0.5)
        return []

directory = sys.argv[1]
path = os.path.join(directory, "sdexec.toml")
open(path, "w").close()
manager = FakeManager()
service = SdexecService(
    load_config(path), reactor, listen=f"unix:{directory}/s.sock",
    stats="tcp:0:interface=127.0.0.1", connect=lambda: defer.succeed(manager),
)
service.metrics.registry.register(Slow())
reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
held = []

def scrape(port):
    held.append(socket.create_connection(("127.0.0.1", port)))
    held[0].sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")

def started(_):
    scrape(service.ports["stats"].getHost().port)
    reactor.callLater(0.2, reactor.stop)

service.ready.addCallback(started)
service.startService()
reactor.run()
print("stopped")
"""


def test_a_scrape_in_progress_does_not_hold_the_service_s_stop(tmp_path):
    # prometheus-client's WSGI resource wrote its answer from the pool by
    # waiting on the reactor, which waits for its pool as it stops: the
    # stop hung for ever, and systemctl restart until TimeoutStopSec
    # (review session 32 U1).
    done = subprocess.run(
        [sys.executable, "-c", _STOP_DURING_A_SCRAPE, str(tmp_path)],
        capture_output=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.stdout == b"stopped\n", done.stderr


def test_an_answer_is_not_given_again_once_what_it_depends_on_changed():
    # A reload that set stats-detail false kept serving command lines for
    # up to a second.
    clock, produce, detail = Clock(), Costly(0.085), [True]
    answer = recent(produce, clock, produce.timer, depends_on=lambda: detail[0])
    assert answer() == answer() == {"n": 1}
    detail[0] = False
    assert answer() == answer() == {"n": 2}
