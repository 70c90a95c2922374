"""Back-pressure on requests: a client that sends requests and does not read
the responses pauses the reading of its own requests, so the service's
buffers stay bounded whatever it sends (it used to buffer every response:
100,000 ``sdexec.stats-get`` unread grew the service by 220 MB). So does
one with too many requests awaiting systemd's answer, which send nothing
until then (100,000 kills queued as many calls to systemd: 224 MB).

Offline: the pause and resume logic on the in-memory connection (requests
read while paused wait, in order, with the descriptors they brought).
Against the real manager: an in-process service and a raw, non-blocking
client on its real socket; the test drives the reactor itself between
sends and reads, so no assertion is about time.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import socket
import tracemalloc

import pytest
import pytest_twisted
from offline import Connection, error_of
from pytest_twisted import ensureDeferred
from support import command, run, sleep, until, wait_until_reaped
from twisted.internet import defer, reactor

from sdexec.connection import (
    CLIENT_BUFFER_SIZE,
    MAX_UNANSWERED,
    ClientProtocol,
    SdexecServerFactory,
)
from sdexec.ioencode import encode_io
from sdexec.protocol import ExecFlag

STATS = "sdexec.stats-get"
#: A response larger than this would show in the bound; a stats-get answer
#: with a few processes is about 1 KiB.
LARGEST_RESPONSE = 64 * 1024


def request(topic: str, payload: dict, matchtag: int, **envelope) -> bytes:
    message = {"type": "request", "topic": topic, "matchtag": matchtag}
    return json.dumps({**message, "payload": payload, **envelope}).encode() + b"\n"


def stats_requests(first: int, count: int) -> bytes:
    return b"".join(request(STATS, {}, tag) for tag in range(first, first + count))


def tags(connection: Connection) -> list[int]:
    return [response["matchtag"] for response in connection.responses()]


def pause_after_writes(connection: Connection, count: int) -> None:
    """The transport pauses the connection after ``count`` more writes, as
    a full buffer does."""
    transport, write = connection.transport, connection.transport.write
    left = [count]

    def counted(data: bytes) -> None:
        write(data)
        left[0] -= 1
        if left[0] == 0:
            connection.protocol.pauseProducing()

    transport.write = counted  # type: ignore[method-assign]


# -- offline: the pause and resume logic -----------------------------------------


def test_requests_read_while_paused_wait_and_are_answered_in_order(connection):
    connection.protocol.pauseProducing()
    assert connection.transport.producerState == "paused"  # no more reads
    connection.send("sdexec.list", {}, matchtag=1)
    connection.send(STATS, {}, matchtag=2)
    assert connection.responses() == []
    connection.protocol.resumeProducing()
    assert tags(connection) == [1, 2]
    assert connection.transport.producerState == "producing"
    connection.send("sdexec.list", {}, matchtag=3)  # read and answered at once
    assert tags(connection) == [1, 2, 3]


def test_a_pause_while_answering_held_requests_holds_the_rest(connection):
    connection.protocol.pauseProducing()
    connection.protocol.dataReceived(stats_requests(1, 5))
    pause_after_writes(connection, 2)
    connection.protocol.resumeProducing()
    assert tags(connection) == [1, 2]
    assert connection.transport.producerState == "paused"  # still not reading
    connection.protocol.resumeProducing()
    assert tags(connection) == [1, 2, 3, 4, 5]
    assert connection.transport.producerState == "producing"


@pytest.mark.parametrize(
    "bad", [b"not json\n", request("sdexec.list", {}, 2).replace(b"request", b"event")]
)
def test_a_framing_error_behind_held_requests_comes_after_their_answers(
    connection, bad
):
    connection.protocol.pauseProducing()
    connection.protocol.dataReceived(stats_requests(1, 1) + bad + stats_requests(3, 1))
    assert connection.responses() == []
    connection.protocol.resumeProducing()
    first, refusal = connection.responses()  # nothing after the framing error
    assert first["matchtag"] == 1 and "payload" in first
    assert refusal["matchtag"] == 0 and refusal["errnum"] == errno.EPROTO
    assert connection.transport.disconnecting


def test_a_held_request_that_fails_past_its_handling_closes_the_connection(
    connection, logged_failures
):
    """As Twisted closes one whose request raised when read at once: the
    failure is logged, nothing escapes into whoever resumed the connection
    (an answer from systemd, a Deferred), and nothing is left held on a
    connection that would read nothing more."""
    send = connection.protocol._send

    def failing(topic: str, matchtag: int, payload: dict) -> None:
        if matchtag == 2:
            raise RuntimeError("cannot send it")
        send(topic, matchtag, payload)

    connection.protocol._send = failing
    connection.protocol.pauseProducing()
    connection.protocol.dataReceived(stats_requests(1, 3))
    connection.protocol.resumeProducing()
    assert tags(connection) == [1]
    assert connection.transport.disconnecting
    (failure,) = logged_failures.flush()
    assert failure.getErrorMessage() == "cannot send it"


def test_a_closing_connection_is_not_left_paused_open(connection):
    """Twisted resumes a producer paused while its connection closes instead
    of closing it: the connection gives up its producer, which closes it."""
    connection.protocol.pauseProducing()
    connection.protocol.dataReceived(b"not json\n")
    connection.protocol.resumeProducing()  # the framing error closes it
    connection.protocol.pauseProducing()  # its EPROTO filled the buffer
    connection.protocol.resumeProducing()  # the client read it
    assert connection.transport.producer is None


# -- offline: descriptors (stdio passthrough) of held requests -------------------

UNIT = "sdexec-t.service"
TRUE = {"cmdline": ["/bin/true"], "opts": {"SDEXEC_NAME": "sdexec-t"}}
FLAGS = int(ExecFlag.STDOUT | ExecFlag.STDERR | ExecFlag.WRITE_CREDIT)
ALL = ["stdin", "stdout", "stderr"]


@pytest.fixture
def ends():
    """Pipes: the ends to pass (the service gets dups), the ends kept."""
    passed, kept = [], []
    for _ in ALL:
        read_end, write_end = os.pipe()
        passed.append(write_end)
        kept.append(read_end)
    yield passed, kept
    for fd in passed + kept:
        os.close(fd)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def deliver(connection: Connection, data: bytes, fds=()) -> None:
    """One read, as Twisted delivers it: its descriptors, then its data."""
    for fd in fds:
        connection.protocol.fileDescriptorReceived(os.dup(fd))
    connection.protocol.dataReceived(data)


def same_file(fd_a: int, fd_b: int) -> bool:
    a, b = os.fstat(fd_a), os.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def exec_with_stdio(matchtag: int) -> bytes:
    payload = {"flags": FLAGS, "cmd": TRUE, "stdio": ALL}
    return request("sdexec.exec", payload, matchtag)


def test_a_held_exec_keeps_its_descriptors_until_it_is_handled(
    server, systemd, connection, ends
):
    connection.protocol.pauseProducing()
    deliver(connection, stats_requests(1, 1) + exec_with_stdio(2), ends[0])
    assert server.processes == {}  # nothing started while paused
    connection.protocol.resumeProducing()
    assert tags(connection) == [1]
    for stream, fd in zip(ALL, ends[0], strict=True):
        assert same_file(systemd.process_fd(UNIT, stream), fd)


def test_descriptors_stay_with_their_frame_when_the_hold_begins_mid_read(
    server, systemd, connection, ends
):
    # The first frame's answer fills the buffer: the rest of the read waits
    # undecoded, the descriptors with the frame that holds its last byte.
    pause_after_writes(connection, 1)
    deliver(connection, stats_requests(1, 1) + exec_with_stdio(2), ends[0])
    assert tags(connection) == [1] and server.processes == {}
    connection.protocol.resumeProducing()
    for stream, fd in zip(ALL, ends[0], strict=True):
        assert same_file(systemd.process_fd(UNIT, stream), fd)


def test_a_paused_connection_keeps_the_rest_of_a_read_as_bytes(connection):
    # Decoded, 256 KiB of "{}" lines held 34 MB (a hundred times the read)
    # until the client read its answers: 17 GB at the default connection cap.
    pause_after_writes(connection, 1)
    tiny = b"{}\n" * ((CLIENT_BUFFER_SIZE - 200) // 3)
    gc.collect()
    tracemalloc.start()
    try:
        connection.protocol.dataReceived(stats_requests(1, 1) + tiny)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert grown < 4 * CLIENT_BUFFER_SIZE  # the read, and its rest kept
    connection.protocol.resumeProducing()  # then decoded, in order
    assert error_of(connection.last())[0] == errno.EPROTO  # "{}" is no request


def test_descriptors_refused_while_paused_are_answered_in_order(connection, ends):
    connection.protocol.pauseProducing()
    deliver(connection, stats_requests(1, 1))
    deliver(connection, stats_requests(2, 1), ends[0][:1])  # stats takes none
    assert connection.responses() == []
    connection.protocol.resumeProducing()
    first, refused = connection.responses()
    assert first["matchtag"] == 1 and "payload" in first
    assert refused["matchtag"] == 2
    assert error_of(refused)[0] == errno.EPROTO


def test_a_disconnect_while_paused_closes_the_held_descriptors(server, ends):
    before = open_fds()
    connection = Connection(server)
    connection.protocol.pauseProducing()
    deliver(connection, exec_with_stdio(1), ends[0])
    assert len(open_fds() - before) > len(ALL)  # the dups, held
    connection.close()
    assert open_fds() <= before
    assert server.processes == {}


# -- offline: requests awaiting systemd's answer ---------------------------------

KILL = "sdexec.kill"


@pytest.fixture
def kills_held(systemd, monkeypatch) -> list[defer.Deferred]:
    """systemd's answers to ``KillUnit``, not given until a test fires them."""
    held: list[defer.Deferred] = []

    def kill_unit(name: str, who: str, signal: int) -> defer.Deferred:
        systemd.calls.append(("kill", who, signal))
        held.append(defer.Deferred())
        return held[-1]

    monkeypatch.setattr(systemd, "kill_unit", kill_unit)
    return held


@pytest.fixture
def starts_held(systemd, monkeypatch) -> list[defer.Deferred]:
    """systemd's answers to ``StartTransientUnit``, not given until a test
    fires them (each with what the fake manager answered)."""
    held: list[defer.Deferred] = []
    start = systemd.start_transient_unit

    def start_held(*args, **kwargs) -> defer.Deferred:
        answered: list = []
        start(*args, **kwargs).addBoth(answered.append)
        held.append(defer.Deferred())
        held[-1].addCallback(lambda _: answered[0])
        return held[-1]

    monkeypatch.setattr(systemd, "start_transient_unit", start_held)
    return held


def test_execs_awaiting_their_start_stop_the_reading_at_the_cap(
    server, connection, starts_held
):
    # Each exec sent nothing until its start was answered: one connection
    # queued any number of starts (each holding its command, up to 2.5 MiB)
    # ahead of every other client's (review session 31 C F1).
    true = {"cmdline": ["/bin/true"]}  # each its own unit
    execs = b"".join(
        request("sdexec.exec", {"flags": FLAGS, "cmd": true}, tag)
        for tag in range(100, 100 + MAX_UNANSWERED + 5)
    )
    deliver(connection, execs + request("sdexec.list", {}, 2))
    assert len(starts_held) == MAX_UNANSWERED  # the rest not handled: held
    assert connection.transport.producerState == "paused"  # no more reads
    another = Connection(server)
    another.send("sdexec.exec", {"flags": FLAGS, "cmd": true}, matchtag=1)
    assert len(starts_held) == MAX_UNANSWERED + 1  # not queued behind them
    starts_held[0].callback(None)  # one answered: the next held exec goes
    assert len(starts_held) == MAX_UNANSWERED + 2
    for answer in starts_held[1:6]:
        answer.callback(None)
    assert len(starts_held) == MAX_UNANSWERED + 6  # every exec handled
    assert tags(connection)[-1] == 2  # then the list, and reading on
    assert connection.transport.producerState == "producing"
    for answer in starts_held[6:]:
        answer.callback(None)
    another.close()


def running(systemd, connection: Connection) -> None:
    """A process of ``connection`` that runs (pid 77): kills go to systemd."""
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=1)
    systemd.run(UNIT, pid=77)


def kills(first: int, count: int) -> bytes:
    payload = {"signum": 10, "pid": 77}
    return b"".join(request(KILL, payload, tag) for tag in range(first, first + count))


def kill_tags(connection: Connection) -> list[int]:
    return [r["matchtag"] for r in connection.responses() if r["topic"] == KILL]


def test_kills_awaiting_systemd_stop_the_reading_at_the_cap(
    systemd, connection, kills_held
):
    # Each kill sent nothing until systemd answered, so nothing paused a
    # client sending them: 100,000 were queued in the call window.
    running(systemd, connection)
    first = 100
    for tag in range(first, first + MAX_UNANSWERED + 10):
        deliver(connection, kills(tag, 1))
    deliver(connection, request("sdexec.list", {}, 2))
    assert len(kills_held) == MAX_UNANSWERED  # the rest not handled: held
    assert connection.transport.producerState == "paused"  # no more reads
    assert kill_tags(connection) == [] and 2 not in tags(connection)
    kills_held[0].callback(None)  # one answered: the next held one is handled
    assert kill_tags(connection) == [first]
    assert len(kills_held) == MAX_UNANSWERED + 1
    assert connection.transport.producerState == "paused"  # at the cap again
    for answer in kills_held[1:10]:  # until every held kill went to systemd
        answer.callback(None)
    assert 2 not in tags(connection)
    kills_held[10].callback(None)  # below the cap: the list, then reading on
    assert tags(connection)[-1] == 2
    assert connection.transport.producerState == "producing"
    for answer in kills_held[11:]:
        answer.callback(None)
    assert kill_tags(connection) == list(range(first, first + MAX_UNANSWERED + 10))


def test_kills_answered_at_once_are_not_counted(systemd, connection):
    running(systemd, connection)
    deliver(connection, kills(100, 2 * MAX_UNANSWERED))
    assert len(kill_tags(connection)) == 2 * MAX_UNANSWERED
    assert connection.transport.producerState == "producing"


def test_kills_awaiting_a_start_do_not_count(systemd, connection):
    # Before started, a kill by label waits for the start (answered then),
    # placing no call meanwhile. Counted, 64 of them stopped the reading of
    # the connection for as long as the start took (up to start-timeout),
    # and with it the kill of a running job, stdin writes, new execs.
    cmd = {**TRUE, "label": "job"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=1)
    early = {"signum": 10, "label": "job"}
    early_kills = b"".join(request(KILL, early, 100 + n) for n in range(MAX_UNANSWERED))
    deliver(connection, early_kills + request("sdexec.list", {}, 2))
    assert connection.transport.producerState == "producing"
    assert 2 in tags(connection)
    systemd.run(UNIT, pid=77)  # started: every held kill is sent, and answered
    assert len(kill_tags(connection)) == MAX_UNANSWERED


def test_kills_held_for_a_start_count_once_they_go_out(systemd, connection, kills_held):
    # Never counted, each starting process let its 64 held kills into the
    # call window at once, the flood the cap is for.
    cmd = {**TRUE, "label": "job"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=1)
    early = {"signum": 10, "label": "job"}
    early_kills = b"".join(request(KILL, early, 100 + n) for n in range(MAX_UNANSWERED))
    deliver(connection, early_kills)
    assert connection.transport.producerState == "producing"
    systemd.run(UNIT, pid=77)  # started: they go to systemd, unanswered
    assert len(kills_held) == MAX_UNANSWERED
    assert connection.transport.producerState == "paused"
    for answer in kills_held:
        answer.callback(None)
    assert connection.transport.producerState == "producing"
    assert len(kill_tags(connection)) == MAX_UNANSWERED


def test_reading_resumes_only_once_both_the_reader_and_the_answers_allow(
    systemd, connection, kills_held
):
    running(systemd, connection)
    deliver(connection, kills(100, MAX_UNANSWERED) + request("sdexec.list", {}, 2))
    connection.protocol.pauseProducing()  # and the client stopped reading
    connection.protocol.resumeProducing()  # it read everything
    assert connection.transport.producerState == "paused"  # the cap still holds
    connection.protocol.pauseProducing()  # it stopped reading again
    for answer in kills_held:
        answer.callback(None)
    assert len(kill_tags(connection)) == MAX_UNANSWERED  # answers are written
    assert 2 not in tags(connection)  # but the client does not read them
    assert connection.transport.producerState == "paused"
    connection.protocol.resumeProducing()
    assert tags(connection)[-1] == 2
    assert connection.transport.producerState == "producing"


def test_answers_after_the_client_left_are_harmless(systemd, server, kills_held):
    connection = Connection(server)
    running(systemd, connection)
    deliver(connection, kills(100, MAX_UNANSWERED + 1))
    connection.close()
    for answer in list(kills_held):
        answer.callback(None)
    assert systemd.kills().count(10) == MAX_UNANSWERED  # the held one: dropped


@ensureDeferred
async def test_a_half_close_waits_for_the_answers_still_due(
    systemd, connection, kills_held
):
    # Its EOF closed the connection at once: kills systemd had not answered
    # yet were never answered (a script sending kills, then EOF, lost them).
    running(systemd, connection)
    deliver(connection, kills(100, 3))
    connection.protocol.readConnectionLost()
    assert not connection.transport.disconnecting
    for answer in kills_held:
        answer.callback(None)
    assert kill_tags(connection) == [100, 101, 102]
    assert not connection.transport.disconnecting  # its stream runs on
    assert 9 not in systemd.kills()  # (tests/test_half_close.py)
    systemd.stop_to_inactive = True
    systemd.exit(UNIT)
    await until(lambda: connection.transport.disconnecting, "closed at its end")
    assert error_of(connection.last())[0] == errno.ENODATA


def test_a_half_close_waits_for_a_background_execs_response(
    systemd, connection, starts_held
):
    # A background exec's one response (started) came after its client's
    # EOF, which had dropped it.
    background = {"flags": 0, "cmd": TRUE}
    deliver(connection, request("sdexec.exec", background, 5, streaming=False))
    connection.protocol.readConnectionLost()
    starts_held[0].callback(None)
    systemd.run(UNIT, pid=77)
    assert [(r["matchtag"], r["payload"]["type"]) for r in connection.responses()] == [
        (5, "started")
    ]
    assert connection.transport.disconnecting


# -- a client that closes a connection not read meanwhile --------------------


NO_CREDIT = int(ExecFlag.STDOUT | ExecFlag.STDERR)


async def send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await sleep(0.01)


@ensureDeferred
async def test_a_client_that_closes_a_connection_held_for_stdin_is_seen_gone(
    systemd, server, tmp_path
):
    # Not read while its process's stdin is backlogged (no credit asked),
    # with nothing to write to it, the socket was polled for nothing: the
    # close went unseen, the process ran on, the connection's slot was held.
    from twisted.internet.endpoints import UNIXServerEndpoint

    from sdexec.ioencode import encode_io

    path = str(tmp_path / "sdexec.sock")
    port = await UNIXServerEndpoint(reactor, path).listen(SdexecServerFactory(server))
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    client.setblocking(False)
    try:
        cmd = {"cmdline": ["/bin/true"], "opts": {"SDEXEC_NAME": "sdexec-t"}}
        await send_all(
            client, request("sdexec.exec", {"flags": NO_CREDIT, "cmd": cmd}, 1)
        )
        await until(lambda: server.processes, "the exec handled")
        systemd.run("sdexec-t.service", pid=4242)  # runs, never reads stdin
        (process,) = server.processes.values()
        io = encode_io("stdin", "0", b"x" * (4 << 20), eof=False)
        await send_all(client, request("sdexec.write", {"matchtag": 1, "io": io}, 0))
        await until(lambda: process.stdin.backlogged, "stdin backlogged")
        assert server.connections.total == 1
        client.close()
        await until(lambda: server.connections.total == 0, "the connection released")
        assert ("stop", "sdexec-t.service") in systemd.calls
        assert server.hangups.fileno() == -1  # nothing left watched
    finally:
        client.close()
        await port.stopListening()


# -- against the real manager, over the real socket ------------------------------


@pytest.fixture
def protocols(monkeypatch) -> list[ClientProtocol]:
    """The service's side of every connection made from here on."""
    made: list[ClientProtocol] = []
    build = SdexecServerFactory.buildProtocol

    def recording(factory: SdexecServerFactory, addr) -> ClientProtocol:
        made.append(build(factory, addr))
        return made[-1]

    monkeypatch.setattr(SdexecServerFactory, "buildProtocol", recording)
    return made


class Flooder:
    """A raw client on the service's socket that sends without reading; the
    test lets the reactor run between its sends (it is in this process)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self.received = b""
        self.eof = False

    def send_some(self, data: bytes, start: int = 0) -> int:
        """How much of ``data[start:]`` the socket took now (0 when full)."""
        if start == len(data):
            return 0
        try:
            return self.sock.send(memoryview(data)[start:])
        except BlockingIOError:
            return 0

    def read_some(self) -> list[dict]:
        """The whole responses readable now (:attr:`eof` once closed)."""
        try:
            chunk = self.sock.recv(1024 * 1024)
        except BlockingIOError:
            return []
        self.eof = not chunk
        *lines, self.received = (self.received + chunk).split(b"\n")
        return [json.loads(line) for line in lines]

    def send_fds(self, frame: bytes, fds: list[int]) -> bool:
        """Whether ``frame`` and ``fds`` were sent (not: the socket is full)."""
        try:
            sent = socket.send_fds(self.sock, [frame], fds)
        except BlockingIOError:
            return False
        assert sent == len(frame)
        return True

    def close(self) -> None:
        self.sock.close()


@pytest_twisted.async_yield_fixture
async def flood(sdexec, protocols):
    """A :class:`Flooder` on ``sdexec`` and the service's side of it."""
    flooder = Flooder(sdexec.socket_path)
    await until(lambda: protocols, "the service accepted the flooder")
    yield flooder, protocols[0]
    flooder.close()  # (again: a failed test leaves no fd open)


def buffered(protocol: ClientProtocol) -> int:
    """The bytes the service holds for its client (Twisted's write buffer)."""
    transport = protocol.transport
    return len(transport.dataBuffer) - transport.offset + transport._tempDataLen


def reading(protocol: ClientProtocol) -> bool:
    return protocol.transport in reactor.getReaders()


async def flood_until_unread(flooder: Flooder, data: bytes, protocol) -> int:
    """Send ``data`` until the service stops reading it (or all of it); how
    much was sent. The reactor runs whenever the socket is full."""
    sent = 0
    for _ in range(3000):
        while took := flooder.send_some(data, sent):
            sent += took
        if sent == len(data) or not reading(protocol):
            return sent
        await sleep(0.005)
    raise AssertionError("the service neither read nor paused")


def assert_bounded(protocol: ClientProtocol, request_size: int) -> None:
    # Paused at the first write beyond the buffer size, and no request is
    # handled from then on: one response more at most. What waits unhandled
    # is at most one read's frames (a read is at most bufferSize bytes).
    assert not reading(protocol)
    assert buffered(protocol) <= CLIENT_BUFFER_SIZE + LARGEST_RESPONSE
    assert len(protocol._held) <= CLIENT_BUFFER_SIZE // request_size
    undecoded = sum(len(data) for data, _ in protocol._undecoded or ())
    assert undecoded <= CLIENT_BUFFER_SIZE  # the rest of a read, as bytes


async def read_all(
    flooder: Flooder, data: bytes, sent: int, done, passed=None
) -> list[dict]:
    """Read responses until ``done(responses)``, sending the rest of
    ``data`` meanwhile, then ``passed``: a frame and the descriptors it
    brings, in one ``sendmsg``."""
    answered: list[dict] = []
    for _ in range(20000):
        sent += flooder.send_some(data, sent)
        if sent == len(data) and passed is not None and flooder.send_fds(*passed):
            passed = None
        answered += flooder.read_some()
        if done(answered) or flooder.eof:
            return answered
        await sleep(0)
    raise AssertionError(f"only {len(answered)} responses came")


def assert_stats_in_order(responses: list[dict], count: int) -> None:
    assert [(r["matchtag"], r["topic"]) for r in responses[:count]] == [
        (tag, STATS) for tag in range(1, count + 1)
    ]
    assert all("procs" in r["payload"] for r in responses[:count])


def counted(count: int):
    return lambda responses: len(responses) >= count


@pytest.mark.systemd
@ensureDeferred
async def test_a_client_flooding_requests_unread_leaves_the_service_bounded(
    sdexec, flood
):
    flooder, protocol = flood
    count = 20_000
    data = stats_requests(1, count)
    sent = await flood_until_unread(flooder, data, protocol)
    assert sent < len(data)  # the service stopped reading its requests
    request_size = len(request(STATS, {}, count))
    assert_bounded(protocol, request_size)
    # Other clients are served meanwhile, a command run to its end too...
    other = await sdexec.connect()
    assert (await other.stats())["procs"] == []
    result = await run(other, ["true"])
    assert (result.error, result.status) == (None, 0)
    # ... and the flooder's buffers have not grown in the meantime.
    assert flooder.send_some(data, sent) == 0
    assert_bounded(protocol, request_size)
    responses = await read_all(flooder, data, sent, counted(count))
    assert len(responses) == count
    assert_stats_in_order(responses, count)
    assert not protocol._held
    assert reading(protocol)


@pytest.mark.systemd
@ensureDeferred
async def test_a_flooder_leaving_while_paused_leaves_nothing_behind(sdexec, flood):
    """Its unit is stopped and reaped, the held requests dropped, and the
    fixture finds no fd left open."""
    flooder, protocol = flood
    unit = "sdexec-backpressure-sleep"
    cmd = command(["sleep", "600"], opts={"SDEXEC_NAME": unit})
    assert flooder.send_some(request("sdexec.exec", {"cmd": cmd, "flags": 3}, 1))
    await until(lambda: sdexec.server.processes, "the sleep was asked for")
    data = stats_requests(2, 20_000)
    assert await flood_until_unread(flooder, data, protocol) < len(data)
    assert protocol._undecoded  # the rest of the read that paused it
    flooder.close()
    await until(lambda: protocol.transport.disconnected, "the connection closed")
    assert not protocol._held and protocol._undecoded is None
    await wait_until_reaped(sdexec, f"{unit}.service")


@pytest.mark.systemd
@ensureDeferred
async def test_a_framing_error_behind_a_flood_ends_with_eproto_then_eof(
    flood,
):
    """The framing error waits behind the flood; after it the connection is
    closed, though the connection was paused when it was closed."""
    flooder, protocol = flood
    count = 20_000
    data = stats_requests(1, count) + b"not json\n"
    sent = await flood_until_unread(flooder, data, protocol)
    assert sent < len(data)
    responses = await read_all(flooder, data, sent, lambda _: False)
    assert flooder.eof  # (read_all returns at EOF)
    assert_stats_in_order(responses, count)
    assert [(r["matchtag"], r["errnum"]) for r in responses[count:]] == [
        (0, errno.EPROTO)
    ]


@pytest.mark.systemd
@ensureDeferred
async def test_a_passthrough_exec_behind_a_flood_gets_its_descriptors(flood):
    """Its descriptors come with the read that ends with its frame, whether
    that frame is handled at once or held."""
    flooder, protocol = flood
    count = 20_000
    data = stats_requests(1, count)
    sent = await flood_until_unread(flooder, data, protocol)
    assert sent < len(data)
    read_end, write_end = os.pipe()
    cmd = command(["echo", "hi"], opts={"SDEXEC_NAME": "sdexec-backpressure-echo"})
    payload = {"cmd": cmd, "flags": 0, "stdio": ["stdout"]}
    passed = (request("sdexec.exec", payload, count + 1), [write_end])
    try:
        responses = await read_all(flooder, data, sent, ended(count + 1), passed)
        os.close(write_end)
        write_end = -1
        assert os.read(read_end, 100) == b"hi\n"
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    assert_stats_in_order(responses, count)
    assert [r.get("payload", {}).get("type") for r in responses[count:]] == [
        "started",
        "finished",
        None,
    ]
    assert responses[-1]["errnum"] == errno.ENODATA


def ended(matchtag: int):
    """Whether an exec stream has ended (its error response came)."""
    return lambda responses: (
        responses[-1]["matchtag"] == matchtag and "errnum" in responses[-1]
        if responses
        else False
    )


async def fill_until_buffered(flooder: Flooder, protocol: ClientProtocol) -> int:
    """Send requests, unread, until the client's socket is full and the
    service holds responses itself: far below the pause (a few KiB more
    than the socket takes), so the connection still reads. How many (their
    matchtags from :data:`FILL_FROM`)."""
    tag = FILL_FROM
    while not buffered(protocol):
        assert flooder.send_some(request(STATS, {}, tag))
        tag += 1
        await sleep(0)  # the service reads and answers it
    assert reading(protocol)
    return tag - FILL_FROM


#: The first matchtag of :func:`fill_until_buffered`'s requests.
FILL_FROM = 1000


@pytest.mark.systemd
@ensureDeferred
async def test_a_framing_error_kills_at_once_what_a_client_not_reading_started(
    sdexec, flood
):
    """Its EPROTO waits unwritten behind answers the client has not read,
    and the connection closes only once it is written (the client reads,
    or closes): what the client started is killed now all the same, as the
    service's log line says, not when the client next reads or closes."""
    flooder, protocol = flood
    unit = "sdexec-backpressure-wedged"
    cmd = command(["sleep", "600"], opts={"SDEXEC_NAME": unit})
    assert flooder.send_some(request("sdexec.exec", {"cmd": cmd, "flags": 3}, 1))
    await until(lambda: sdexec.server.processes, "the sleep was asked for")
    await fill_until_buffered(flooder, protocol)
    assert flooder.send_some(b"not json\n")
    await wait_until_reaped(sdexec, f"{unit}.service")
    assert buffered(protocol)  # unread all along: the connection still open
    assert not protocol.transport.disconnected


@pytest.mark.systemd
@ensureDeferred
async def test_a_client_that_shuts_down_its_writing_gets_what_it_was_answered(
    sdexec, flood
):
    """``shutdown(SHUT_WR)`` after its last request, as socat and nc do at
    the end of their input: the answers to what it sent are written before
    the connection closes (Twisted dropped them, and such a client got EOF
    alone), and its process, whose stdin reads EOF then, runs to its end."""
    flooder, protocol = flood
    unit = "sdexec-backpressure-halfclosed"
    cmd = command(["cat"], opts={"SDEXEC_NAME": unit})
    assert flooder.send_some(request("sdexec.exec", {"cmd": cmd, "flags": 3}, 1))
    started = await read_all(flooder, b"", 0, counted(1))
    assert started[0]["payload"]["type"] == "started"
    last = request("sdexec.list", {"detail": True}, 2) + request(STATS, {}, 3)
    assert flooder.send_some(last) == len(last)
    flooder.sock.shutdown(socket.SHUT_WR)
    responses = await read_all(flooder, b"", 0, lambda _: False)
    assert flooder.eof  # (read_all returns at EOF)
    answers = [r for r in responses if r["matchtag"] in (2, 3)]
    assert [(r["matchtag"], r["topic"]) for r in answers] == [
        (2, "sdexec.list"),
        (3, STATS),
    ]
    assert [p["unit"] for p in answers[0]["payload"]["procs"]] == [f"{unit}.service"]
    ended = [r for r in responses if r["matchtag"] == 1]
    assert "finished" in [r["payload"]["type"] for r in ended if "payload" in r]
    assert error_of(ended[-1])[0] == errno.ENODATA
    await wait_until_reaped(sdexec, f"{unit}.service")
    await until(lambda: protocol.transport.disconnected, "the connection closed")
    assert sdexec.server.connections.total == 0


async def half_close_unread(sdexec, flood, unit: str) -> int:
    """A process without write credit (that never reads its stdin), answers
    unread by the client and held by the service, then stdin the process
    does not take: the service stops reading the connection (the rest of
    what was sent waits in the socket) and watches it for a hang-up. Then
    ``shutdown(SHUT_WR)``, as socat and nc do at the end of their input.
    How many answers were held (:func:`fill_until_buffered`)."""
    flooder, protocol = flood
    cmd = command(["sleep", "600"], opts={"SDEXEC_NAME": unit})
    exec_request = request("sdexec.exec", {"cmd": cmd, "flags": NO_CREDIT}, 1)
    assert flooder.send_some(exec_request) == len(exec_request)
    started = await read_all(flooder, b"", 0, counted(1))
    assert started[0]["payload"]["type"] == "started"
    filled = await fill_until_buffered(flooder, protocol)
    io = encode_io("stdin", "0", b"x" * (4 << 20), eof=False)
    write = request("sdexec.write", {"matchtag": 1, "io": io}, 0)
    data = write + request("sdexec.list", {}, 2) + write
    assert await flood_until_unread(flooder, data, protocol) < len(data)
    assert protocol._stdin_backlogged and buffered(protocol)
    assert sdexec.server.hangups.fileno() != -1  # the hang-up watched for
    flooder.sock.shutdown(socket.SHUT_WR)
    return filled


@pytest.mark.systemd
@ensureDeferred
async def test_a_half_close_of_a_connection_not_read_drops_nothing_it_sent(
    sdexec, flood
):
    """Its client is served as one that stays: it reads every answer made
    before, what it sent that was not read waits in the socket (the list,
    behind stdin its process has not taken) and is handled once the
    process is gone, then EOF. The shutdown was taken for its departure:
    its process was killed and the list dropped."""
    flooder, protocol = flood
    unit = "sdexec-backpressure-halfclosed-unread"
    filled = await half_close_unread(sdexec, flood, unit)
    responses = await read_all(flooder, b"", 0, counted(filled))
    assert [(r["matchtag"], r["topic"]) for r in responses] == [
        (tag, STATS) for tag in range(FILL_FROM, FILL_FROM + filled)
    ]
    await until(lambda: protocol._half_closed, "the shutdown seen")
    assert not flooder.eof and protocol._stdin_backlogged  # still not read
    process = next(iter(sdexec.server.processes.values()))
    other = await sdexec.connect()
    await other.kill(pid=process.pid, signum=9)  # (not its client's)
    responses = await read_all(flooder, b"", 0, lambda _: False)
    assert flooder.eof  # (read_all returns at EOF; a reset raises)
    assert [r["matchtag"] for r in responses if r["topic"] == "sdexec.list"] == [2]
    await wait_until_reaped(sdexec, f"{unit}.service")
    await until(lambda: protocol.transport.disconnected, "the connection closed")
    assert sdexec.server.connections.total == 1  # the other client's
    assert sdexec.server.hangups.fileno() == -1


@pytest.mark.systemd
@ensureDeferred
async def test_a_half_closed_client_not_reading_holds_its_answers_until_it_closes(
    sdexec, flood
):
    """The bound of a client that half-closes and reads nothing more:
    nothing more of what it sent is read (what waits is what waited), and
    its close, watched for, ends the connection, kills its process and
    frees its slot."""
    flooder, protocol = flood
    unit = "sdexec-backpressure-halfclosed-mute"
    await half_close_unread(sdexec, flood, unit)
    held = buffered(protocol)
    await until(lambda: protocol._half_closed, "the shutdown seen")
    assert buffered(protocol) == held
    assert not protocol.transport.disconnected  # the client may still read
    assert sdexec.server.connections.total == 1
    flooder.close()
    await until(lambda: protocol.transport.disconnected, "the connection closed")
    await wait_until_reaped(sdexec, f"{unit}.service")
    assert sdexec.server.connections.total == 0
    assert sdexec.server.hangups.fileno() == -1


def hold_kills(systemd, monkeypatch, signum: int) -> list[defer.Deferred]:
    """The real manager's ``KillUnit`` calls of ``signum``, held in the
    service until a test lets them go (:func:`let_go`): systemd is slow to
    answer them. Other signals' go at once (a client's SIGKILL at its
    leaving among them)."""
    held: list[defer.Deferred] = []
    kill_unit = systemd.kill_unit

    def holding(name: str, who: str, signal: int) -> defer.Deferred:
        if signal != signum:
            return kill_unit(name, who, signal)
        answer: defer.Deferred = defer.Deferred()
        answer.addCallback(lambda _: kill_unit(name, who, signal))
        held.append(answer)
        return answer

    monkeypatch.setattr(systemd, "kill_unit", holding)
    return held


def let_go(held: list[defer.Deferred]) -> None:
    for answer in held:
        answer.addErrback(lambda _: None)  # (its unit may be gone by now)
        answer.callback(None)


@pytest.mark.systemd
@ensureDeferred
async def test_a_client_that_leaves_a_connection_held_for_its_kills_is_seen_gone(
    sdexec, flood, monkeypatch
):
    """At the cap of requests awaiting systemd (64 kills unanswered) the
    connection is not read, so its client's close went unseen until systemd
    answered: its process ran on and its slot was held meanwhile."""
    flooder, protocol = flood
    held = hold_kills(sdexec.server.systemd, monkeypatch, 10)
    unit = "sdexec-backpressure-killcap"
    cmd = command(["sleep", "600"], opts={"SDEXEC_NAME": unit}, label="job")
    assert flooder.send_some(request("sdexec.exec", {"cmd": cmd, "flags": 3}, 1))
    started = await read_all(flooder, b"", 0, counted(1))
    assert started[0]["payload"]["type"] == "started"
    kill = {"signum": 10, "label": "job"}
    data = b"".join(request(KILL, kill, tag) for tag in range(2, MAX_UNANSWERED + 4))
    assert flooder.send_some(data) == len(data)
    await until(lambda: len(held) == MAX_UNANSWERED, "the kills at the cap")
    assert not reading(protocol)
    try:
        flooder.close()
        await until(lambda: sdexec.server.connections.total == 0, "the client gone")
        await wait_until_reaped(sdexec, f"{unit}.service")
        assert len(held) == MAX_UNANSWERED  # systemd has answered none yet
        assert sdexec.server.hangups.fileno() == -1  # nothing left watched
    finally:
        let_go(held)


#: A signal a ``sleep`` ignores: the kills leave it running.
SIGWINCH = 28


@pytest.mark.systemd
@ensureDeferred
async def test_a_half_close_past_the_cap_of_kills_gets_every_answer_then_eof(
    sdexec, flood, monkeypatch
):
    """A script sends 200 kills, then shuts down its writing (socat, nc):
    past the 64 awaiting systemd the rest waited unread in the socket, and
    the shutdown dropped them (it got the answers of the first 64 at most).
    Each is answered now, in order, as systemd answers; its process runs
    on, streamed to it, and once that has ended too the client reads EOF."""
    flooder, protocol = flood
    held = hold_kills(sdexec.server.systemd, monkeypatch, SIGWINCH)
    unit = "sdexec-backpressure-halfclose-kills"
    cmd = command(["sleep", "600"], opts={"SDEXEC_NAME": unit}, label="job")
    assert flooder.send_some(request("sdexec.exec", {"cmd": cmd, "flags": 3}, 1))
    started = await read_all(flooder, b"", 0, counted(1))
    assert started[0]["payload"]["type"] == "started"
    kill = {"signum": SIGWINCH, "label": "job"}
    data = b"".join(request(KILL, kill, tag) for tag in range(2, 202))
    assert flooder.send_some(data) == len(data)
    await until(lambda: len(held) == MAX_UNANSWERED, "the kills at the cap")
    assert not reading(protocol)  # the rest unread, in the socket
    flooder.sock.shutdown(socket.SHUT_WR)
    answers: list[dict] = []
    let_go_from = 0
    for _ in range(20000):
        let_go(held[let_go_from:])  # systemd answers, as they come
        let_go_from = len(held)
        answers += flooder.read_some()
        if flooder.eof or len(answers) == 200:
            break
        await sleep(0.001)  # (systemd answers the kills let go meanwhile)
    assert [r["matchtag"] for r in answers] == list(range(2, 202))
    assert all(r["topic"] == KILL and "errnum" not in r for r in answers)
    await until(lambda: protocol._eof_read, "its EOF read")
    assert not (flooder.eof or protocol.transport.disconnecting)  # still streamed
    other = await sdexec.connect()
    await other.kill(label="job", signum=15)
    ended = await read_all(flooder, b"", 0, lambda _: False)
    assert flooder.eof  # EOF, not a reset
    payloads = [r["payload"] for r in ended if "payload" in r]
    (finished,) = [payload for payload in payloads if payload["type"] == "finished"]
    assert finished["status"] == 15  # (SIGTERM)
    assert error_of(ended[-1])[0] == errno.ENODATA
    await wait_until_reaped(sdexec, f"{unit}.service")
    await until(lambda: sdexec.server.connections.total == 1, "the client gone")
    assert sdexec.server.hangups.fileno() == -1  # nothing left watched
