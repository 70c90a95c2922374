"""The client library and the ``sdexec`` command against a scripted peer.

``Peer`` plays the service's side of docs/protocol.md by hand: a test reads
the requests the client sent and answers them. The end-to-end tests against
the real service live elsewhere; these pin the client's own logic.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_twisted
from support import (
    ATTACHED_CMD,
    LISTED_NOTHING,
    STATS_ANSWER,
    TERMINATING,
    ended_by_close,
    read_to_end,
    sleep,
    until,
    until_pipe_full,
)
from twisted.internet import defer, protocol, reactor
from twisted.internet.defer import DeferredQueue
from twisted.internet.endpoints import UNIXServerEndpoint
from twisted.internet.interfaces import IPushProducer
from twisted.internet.threads import deferToThread
from twisted.logger import capturedLogs
from zope.interface import implementer

import sdexec.client
from sdexec import cli, cliio, rpc
from sdexec.cli import build_command, cancel_targets, format_procs
from sdexec.cliargs import kill_target, parse_args
from sdexec.client import (
    MAX_SOCKET_PATH,
    STDOUT,
    WRITE_CREDIT,
    ConnectionFailed,
    RPCError,
    SdexecError,
    connect,
    default_socket_path,
    resolve_socket_path,
)
from sdexec.cliio import exit_code
from sdexec.framing import JSONLineProtocol
from sdexec.ioencode import decode_io, encode_io
from sdexec.protocol import Topic, terminate_not_found, terminate_runs_no_job
from sdexec.runrequest import is_utf8
from sdexec.wire import MAX_VALUES

REPO = Path(__file__).resolve().parent.parent
ENODATA = 61


class Peer(JSONLineProtocol):
    """The service's end of one connection, driven by the test."""

    def connectionMade(self) -> None:
        self.requests: DeferredQueue = DeferredQueue()
        #: Fires once the client has closed the connection (or it is lost).
        self.closed: defer.Deferred[None] = defer.Deferred()
        self.factory.peers.put(self)

    def connectionLost(self, reason: object = None) -> None:
        super().connectionLost(reason)
        self.closed.callback(None)

    def messageReceived(self, message: dict) -> None:
        self.requests.put(message)

    def framingError(self, reason: str) -> None:
        raise AssertionError(f"the client sent a bad frame: {reason}")

    def respond(self, request: dict, payload: dict) -> None:
        self.sendMessage(_response(request, payload=payload))

    def fail(self, request: dict, errnum: int, errstr: str = "") -> None:
        self.sendMessage(_response(request, errnum=errnum, errstr=errstr))


def _response(request: dict, **fields) -> dict:
    return {
        "type": "response",
        "topic": request["topic"],
        "matchtag": request["matchtag"],
        **fields,
    }


@pytest_twisted.async_yield_fixture
async def served(tmp_path):
    """``(peer, client)``: a client connected to a peer on a socket in
    ``tmp_path``; ``peer.factory.peers`` yields later connections' peers."""
    factory = protocol.Factory.forProtocol(Peer)
    factory.peers = DeferredQueue()
    path = str(tmp_path / "sdexec.sock")
    port = await UNIXServerEndpoint(reactor, path).listen(factory)
    client = await connect(reactor, path)
    peer = await factory.peers.get()
    yield peer, client
    await client.close()
    await port.stopListening()


# -- socket path -----------------------------------------------------------


def test_socket_option_wins_over_environment():
    environ = {"SDEXEC_SOCKET": "/env.sock", "XDG_RUNTIME_DIR": "/run/user/1"}
    assert resolve_socket_path("/opt.sock", environ) == "/opt.sock"
    assert resolve_socket_path(None, environ) == "/env.sock"
    del environ["SDEXEC_SOCKET"]
    assert resolve_socket_path(None, environ) == "/run/user/1/sdexec/sdexec.sock"


def test_default_socket_needs_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(rpc, "SYSTEM_SOCKET", str(tmp_path / "none.sock"))
    with pytest.raises(SdexecError) as failure:
        default_socket_path({})
    assert str(failure.value) == (
        "XDG_RUNTIME_DIR is not set: name the socket with --socket or SDEXEC_SOCKET"
    )
    # Under sudo on a node whose system unit serves: where it is.
    system = tmp_path / "system.sock"
    system.touch()
    monkeypatch.setattr(rpc, "SYSTEM_SOCKET", str(system))
    with pytest.raises(SdexecError) as failure:
        default_socket_path({})
    assert str(failure.value).endswith(f" (the system unit's socket is {system})")


@pytest_twisted.inlineCallbacks
def test_missing_socket_names_the_path(tmp_path):
    path = str(tmp_path / "absent.sock")
    with pytest.raises(ConnectionFailed, match=f"cannot connect to {path}: No such"):
        yield connect(reactor, path)


@pytest.mark.parametrize("size", [MAX_SOCKET_PATH, MAX_SOCKET_PATH + 1])
@pytest_twisted.inlineCallbacks
def test_a_socket_path_too_long_fails_at_once_naming_the_limit(tmp_path, size):
    # Twisted logged a TypeError for it and reported a timeout 30 s later.
    base = f"{tmp_path}/"
    path = base + "x" * (size - len(base))
    connecting = connect(reactor, path)
    if size == 107:  # as long as a socket path may be: none there
        with pytest.raises(ConnectionFailed, match=f"{path}: No such file"):
            yield connecting
        return
    assert connecting.called
    with pytest.raises(ConnectionFailed) as failure:
        yield connecting
    assert str(failure.value) == (
        f"cannot connect to {path}: AF_UNIX path too long (108 bytes, at most 107)"
    )


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("", "cannot connect to : an empty path names no socket"),
        (
            "/run/sdexec\0.sock",
            "cannot connect to /run/sdexec\\x00.sock: a NUL byte in the path"
            " (a socket path is a C string)",
        ),
    ],
)
@pytest_twisted.inlineCallbacks
def test_a_path_that_names_no_socket_fails_at_once_saying_why(path, said):
    # An empty one said only "Invalid argument"; a NUL raised a bare
    # ValueError naming no path, not the documented ConnectionFailed.
    connecting = connect(reactor, path)
    assert connecting.called
    with pytest.raises(ConnectionFailed) as failure:
        yield connecting
    assert str(failure.value) == said


@pytest_twisted.inlineCallbacks
def test_refused_socket_names_the_path(tmp_path):
    path = str(tmp_path / "dead.sock")
    with socket.socket(socket.AF_UNIX) as bound_not_listening:
        bound_not_listening.bind(path)
        with pytest.raises(ConnectionFailed, match=f"{path}: Connection refused"):
            yield connect(reactor, path)


# -- requests and responses -------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_rpc_matchtags_count_up_and_route_responses(served):
    peer, client = served
    listing, stats = client.list(), client.stats()
    first, second = (yield peer.requests.get()), (yield peer.requests.get())
    assert first == {
        "type": "request",
        "topic": "sdexec.list",
        "matchtag": 1,
        "payload": {"detail": True},
    }
    assert (second["topic"], second["matchtag"]) == ("sdexec.stats-get", 2)
    peer.respond(second, STATS_ANSWER)
    peer.respond(first, LISTED_NOTHING)
    assert (yield listing) == LISTED_NOTHING
    assert (yield stats) == STATS_ANSWER


@pytest_twisted.inlineCallbacks
def test_an_answer_of_more_values_than_a_request_may_hold_is_read(served):
    # A list of thousands of processes may: the service bounds requests,
    # the frame size bounds what the client reads.
    peer, client = served
    listing = client.list()
    proc = {"pid": 7, "cmd": "", "label": "", "state": "R"}  # 5 values
    procs = [proc] * (MAX_VALUES // 4)
    peer.respond((yield peer.requests.get()), {"rank": 0, "procs": procs})
    assert (yield listing) == {"rank": 0, "procs": procs}


@pytest_twisted.inlineCallbacks
def test_a_request_that_is_not_json_is_neither_tracked_nor_sent(served):
    # It was tracked (its Deferred never fired), its passed descriptor's
    # copy leaked, and that copy went out with the next request.
    peer, client = served
    read_end, write_end = os.pipe()
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(TypeError):
        client.exec({"cmdline": ["true"], "env": {"X": object()}}, 1,
                    stdio={"stdout": write_end})  # fmt: skip
    assert set(os.listdir("/proc/self/fd")) == fds_before
    assert client._requests._in_flight == {}
    listing = client.list()
    request = yield peer.requests.get()
    assert (request["topic"], request["matchtag"]) == ("sdexec.list", 2)
    peer.respond(request, LISTED_NOTHING)
    assert (yield listing) == LISTED_NOTHING
    os.close(read_end)
    os.close(write_end)


@pytest_twisted.inlineCallbacks
def test_rpc_error_response_is_rpc_error(served):
    peer, client = served
    killed = client.kill(pid=99, signum=9)
    request = yield peer.requests.get()
    assert request["payload"] == {"pid": 99, "signum": 9, "who": "main"}
    peer.fail(request, errno.ESRCH, "kill pid=99 not found")
    with pytest.raises(RPCError) as caught:
        yield killed
    assert (caught.value.errnum, str(caught.value)) == (3, "kill pid=99 not found")


@pytest_twisted.inlineCallbacks
def test_an_errstr_of_several_lines_or_escapes_is_one_line_shown(served):
    # SdexecError's str() is one line to show a user as it is: a service's
    # errstr with a newline or a terminal's escape was passed on verbatim.
    peer, client = served
    listed = client.list()
    waited = client.wait(pid=7, status_and_error=True)
    said = "line one\nline two \x1b[31mred\x9b \u2028 \u202eder"
    request = yield peer.requests.get()
    peer.fail(request, errno.EPERM, said)
    request = yield peer.requests.get()
    error = {"errnum": errno.EDEADLK, "errstr": said}
    peer.respond(request, {"output": [], "dropped": {"stdout": 0}, "error": error})
    # As the service writes it (sdexec.refusal.one_line): U+2028 is a line
    # break to str.splitlines, U+202E turns the rest of the line around.
    shown = "line one\\nline two \\x1b[31mred\\x9b \\u2028 \\u202eder"
    with pytest.raises(RPCError, match=re.escape(shown) + "$"):
        yield listed
    answer = yield waited
    assert str(rpc.wait_error(answer)) == shown


@pytest.mark.parametrize("errnum", [2**31, -(2**40), 0, True, "2"])
@pytest_twisted.inlineCallbacks
def test_an_error_whose_errnum_is_no_errno_still_ends_its_request(served, errnum):
    # os.strerror raised for one no C int holds, after the request was
    # untabled: its Deferred never fired, and the connection dropped.
    peer, client = served
    listed = client.list()
    peer.fail((yield peer.requests.get()), errnum)
    with pytest.raises(RPCError) as caught:
        yield listed
    assert caught.value.errnum == errno.EPROTO
    assert str(caught.value).startswith("errnum ")
    assert str(caught.value).endswith(" is no errno")
    assert client._requests.lost is None  # the connection carries on


@pytest_twisted.inlineCallbacks
def test_kill_by_label_and_bad_targets(served):
    peer, client = served
    main = client.kill(label="job", signum=2)  # its main process; said, for any service
    assert (yield peer.requests.get())["payload"] == {
        "label": "job",
        "signum": 2,
        "who": "main",
    }
    every = client.kill(label="job", signum=2, who="all")  # every process of its unit
    assert (yield peer.requests.get())["payload"] == {
        "label": "job",
        "signum": 2,
        "who": "all",
    }
    for bad in ({}, {"pid": 1, "label": "job"}):
        with pytest.raises(ValueError, match="exactly one"):
            client.kill(**bad)
    yield ended_by_close(client, main, every)


@pytest_twisted.inlineCallbacks
def test_unknown_matchtag_is_ignored(served):
    peer, client = served
    listing = client.list()
    request = yield peer.requests.get()
    peer.respond({**request, "matchtag": 99}, {"stray": True})
    peer.respond(request, LISTED_NOTHING)
    assert (yield listing) == LISTED_NOTHING


def test_a_stray_message_is_logged_short():
    # A confused or hostile peer's message may be megabytes.
    requests = rpc.Requests("/run/sdexec.sock")
    warning = requests.dispatch({"type": "response", "matchtag": 7, "x": "y" * 10**6})
    assert warning is not None and len(warning) < 400
    assert warning.endswith("y…")  # cut as json_quoted cuts an object


@pytest_twisted.inlineCallbacks
def test_a_response_without_a_payload_reads_as_an_empty_one(served):
    # RFC 6 allows it, and RFC 42's kill answer has none.
    peer, client = served
    killed = client.kill(pid=42)
    request = yield peer.requests.get()
    peer.sendMessage(_response(request))
    assert (yield killed) == {}


def test_a_matchtag_of_true_answers_no_request():
    # true == 1 to Python; the service never sends it, a confused peer may.
    requests = rpc.Requests("/run/sdexec.sock")
    answered: list[dict] = []
    pending = SimpleNamespace(streaming=False, end=None, respond=answered.append)
    request = requests.new("sdexec.list", {})
    assert request["matchtag"] == 1
    requests.track(request, pending)
    warning = requests.dispatch({"type": "response", "matchtag": True, "payload": {}})
    assert warning is not None and "answers no request" in warning
    assert answered == []


def test_a_closing_error_is_said_as_what_ends_the_connection():
    # The service's last words on matchtag 0 (EPERM, EPROTO) end every
    # request; the log said them as a message it was "ignoring".
    requests = rpc.Requests("/run/sdexec.sock")
    closing = {"type": "response", "matchtag": 0, "errnum": 1, "errstr": "no"}
    warning = requests.dispatch(closing)
    assert warning == "sdexec: the service is closing the connection: no (EPERM)"


def test_a_payload_that_is_not_an_object_ends_its_request():
    requests = rpc.Requests("/run/sdexec.sock")
    ended: list[Exception] = []
    pending = SimpleNamespace(streaming=False, end=ended.append, respond=None)
    request = requests.new("sdexec.list", {})
    requests.track(request, pending)
    warning = requests.dispatch(
        {"type": "response", "matchtag": request["matchtag"], "payload": [1] * 10**5}
    )
    assert warning is not None and len(warning) < 400
    (error,) = ended
    assert (error.errnum, error.errstr) == (
        errno.EPROTO,
        "response payload is not an object",
    )
    assert requests.dispatch({"type": "response", "matchtag": request["matchtag"]})


# -- exec streams -----------------------------------------------------------


def _exec(client, flags=STDOUT, opts=None):
    responses = []
    cmd = {"cmdline": ["true"], "env": {}, "opts": opts or {}, "channels": []}
    return client.exec(cmd, flags, responses.append), responses


@pytest_twisted.inlineCallbacks
def test_exec_stream_in_order_until_enodata(served):
    peer, client = served
    handle, responses = _exec(client)
    request = yield peer.requests.get()
    assert request["payload"]["flags"] == STDOUT
    assert request["payload"]["cmd"]["cmdline"] == ["true"]
    stream = [
        {"type": "started", "pid": 42},
        {"type": "output", "pid": 42, "io": encode_io("stdout", "0", b"hi\n")},
        {"type": "finished", "status": 0},
        {"type": "output", "pid": 42, "io": encode_io("stdout", "0", eof=True)},
    ]
    for payload in stream:
        peer.respond(request, payload)
    peer.fail(request, ENODATA)
    assert (yield handle.done) is None
    assert responses == stream
    assert (handle.matchtag, handle.pid) == (request["matchtag"], 42)


@pytest_twisted.inlineCallbacks
def test_exec_error_ends_the_stream(served):
    peer, client = served
    handle, _ = _exec(client)
    peer.fail((yield peer.requests.get()), errno.ENOENT, "nosuch: not found")
    with pytest.raises(RPCError, match="nosuch: not found") as caught:
        yield handle.done
    assert caught.value.errnum == errno.ENOENT


@pytest_twisted.inlineCallbacks
def test_a_background_exec_ends_with_its_started_pid(served):
    peer, client = served
    handle = client.exec({"cmdline": ["true"]}, 0, background=True)
    peer.respond((yield peer.requests.get()), {"type": "started", "pid": 42})
    assert (yield handle.done) is None
    assert handle.pid == 42


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"type": "started"},
        {"type": "started", "pid": "42"},
        {"type": "output", "pid": 42},
    ],
)
@pytest_twisted.inlineCallbacks
def test_a_background_exec_answered_without_a_pid_is_eproto(served, answer):
    # Only a broken service answers so; said as such, not a pid of None.
    peer, client = served
    handle = client.exec({"cmdline": ["true"]}, 0, background=True)
    peer.respond((yield peer.requests.get()), answer)
    with pytest.raises(RPCError, match="expected a started pid") as caught:
        yield handle.done
    assert caught.value.errnum == errno.EPROTO


@pytest_twisted.inlineCallbacks
def test_connection_lost_fails_requests_in_flight(served):
    peer, client = served
    handle, _ = _exec(client)
    listing = client.list()
    request = yield peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 42})
    yield peer.requests.get()
    peer.transport.loseConnection()
    yield client.disconnected
    for pending in (handle.done, listing):
        with pytest.raises(ConnectionFailed, match=f"connection to {client.path} lost"):
            yield pending
    with pytest.raises(ConnectionFailed):
        yield client.stats()


@pytest_twisted.ensureDeferred
async def test_a_connection_reset_says_so(served):
    # The service's end closed with the client's request unread: the kernel
    # resets the connection (ECONNRESET). It was said as a plain "lost",
    # as if the service had closed it in order.
    peer, client = served
    peer.transport.stopReading()
    listing = client.list()
    fd = peer.transport.fileno()
    await until(lambda: select.select([fd], [], [], 0)[0], "the request came")
    peer.transport.abortConnection()
    with pytest.raises(ConnectionFailed) as failure:
        await listing
    assert str(failure.value) == (
        f"connection to {client.path} lost: not cleanly (a read or write on it"
        " failed, as when the service's end resets it)"
    )


@pytest_twisted.inlineCallbacks
def test_a_connection_closed_in_order_says_no_more(served):
    peer, client = served
    listing = client.list()
    yield peer.requests.get()
    peer.transport.loseConnection()
    with pytest.raises(ConnectionFailed) as failure:
        yield listing
    assert str(failure.value) == f"connection to {client.path} lost"


def test_a_connection_closed_for_an_exception_names_it():
    # Twisted closes a connection whose protocol raised, with that exception
    # as connectionLost's reason.
    from twisted.python.failure import Failure

    client = _offline_client()
    failures = []
    client.list().addErrback(failures.append)
    client.connectionLost(Failure(RuntimeError("boom")))
    [failure] = failures
    assert failure.check(ConnectionFailed)
    assert failure.getErrorMessage() == (
        "connection to /run/sdexec.sock lost: RuntimeError: boom"
    )


@pytest_twisted.inlineCallbacks
def test_closing_error_explains_the_loss(served):
    peer, client = served
    listing = client.list()
    yield peer.requests.get()
    peer.fail({"topic": "sdexec", "matchtag": 0}, errno.EPERM, "not the owner")
    peer.transport.loseConnection()
    with pytest.raises(RPCError, match="not the owner"):
        yield listing


# -- stdin and credit -------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_writes_and_credit(served):
    peer, client = served
    handle, _ = _exec(client, flags=STDOUT | WRITE_CREDIT)
    request = yield peer.requests.get()
    assert handle.credit == 4096  # may be borrowed before the first add-credit
    handle.write(b"\xff" * 1000)
    write = yield peer.requests.get()
    assert write["topic"] == "sdexec.write"
    assert write["payload"]["matchtag"] == request["matchtag"]
    assert decode_io(write["payload"]["io"]) == ("stdin", b"\xff" * 1000, False)
    assert handle.credit == 3096
    # The first add-credit is the whole buffer: it replaces the borrowing.
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 4096}})
    yield _round_trip(peer, client)
    assert handle.credit == 3096
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 1000}})
    yield _round_trip(peer, client)
    assert handle.credit == 4096
    handle.close_stdin()
    eof = yield peer.requests.get()
    assert decode_io(eof["payload"]["io"]) == ("stdin", b"", True)
    yield ended_by_close(client, handle.done)


@pytest_twisted.inlineCallbacks
def test_credit_follows_stdin_bufsize_and_flag(served):
    _, client = served
    sized, _ = _exec(client, WRITE_CREDIT, opts={"stdin_BUFSIZE": "64K"})
    unflagged, _ = _exec(client, STDOUT)
    assert (sized.credit, unflagged.credit) == (65536, None)
    yield ended_by_close(client, sized.done, unflagged.done)


@pytest_twisted.inlineCallbacks
def test_true_is_no_pid_status_or_credit(served):
    # JSON's true decodes to a bool, which Python takes for the int 1: a
    # broken service's started pid true was kept, and a kill sent for it.
    peer, client = served
    handle, _ = _exec(client, STDOUT | WRITE_CREDIT)
    attached = client.attach(pid=5)
    request = yield peer.requests.get()
    attach = yield peer.requests.get()
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": True}})
    peer.respond(request, {"type": "started", "pid": True})
    peer.respond(request, {"type": "finished", "status": True})
    peer.respond(attach, {"type": "attached", "pid": True, "cmd": ATTACHED_CMD})
    peer.respond(attach, {"type": "finished", "status": True})
    for ended in (request, attach):
        peer.sendMessage(_response(ended, errnum=ENODATA))
    with pytest.raises(RPCError) as caught:  # the first thing wrong
        yield handle.done
    assert str(caught.value) == (
        "the service's add-credit response: channels.stdin: expected an"
        " integer, got true"
    )
    with pytest.raises(RPCError, match=r"response: expected a pid, got true$"):
        yield attached.done
    bufsize = sdexec.client.DEFAULT_STDIN_BUFSIZE  # no add-credit taken
    assert (handle.pid, handle.receipt, handle.credit) == (None, None, bufsize)
    assert (attached.pid, attached.status) == (None, None)


@pytest.mark.parametrize(
    ("finished", "said"),
    [
        ([{"status": -1}], "the service's finished response: expected a wait"
         " status, got -1"),
        ([{"status": 1 << 40}], "the service's finished response: expected a"
         f" wait status, got {1 << 40}"),
        ([{}], "the service's finished response: expected a wait status, got none"),
        ([{"status": 0}, {"status": 256}], "the service sent a second finished"
         " response"),
    ],
    ids=["negative", "past-16-bits", "none", "twice"],
)  # fmt: skip
@pytest_twisted.inlineCallbacks
def test_a_stream_whose_finished_is_no_wait_status_or_twice_ends_eproto(
    served, finished, said
):
    # Such a status was taken for the receipt's (exit_code() of one past 32
    # bits raised OverflowError), a second finished replaced the first, and
    # done fired as for a stream that ended well.
    peer, client = served
    handle, _ = _exec(client)
    attached = client.attach(pid=5)
    request = yield peer.requests.get()
    attach = yield peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 5})
    peer.respond(attach, {"type": "attached", "pid": 5, "cmd": ATTACHED_CMD})
    for stream in (request, attach):
        for fields in finished:
            peer.respond(stream, {"type": "finished", **fields})
        peer.sendMessage(_response(stream, errnum=ENODATA))
    for done in (handle.done, attached.done):
        with pytest.raises(RPCError, match=re.escape(said) + "$") as caught:
            yield done
        assert caught.value.errnum == errno.EPROTO
    kept = 0 if len(finished) > 1 else None  # the first good one
    assert (handle.receipt and handle.receipt.status, attached.status) == (kept, kept)


@pytest.mark.parametrize(
    ("pid", "shown"), [("5", '"5"'), (-1, "-1"), (0, "0"), (None, "null")]
)
@pytest_twisted.inlineCallbacks
def test_a_start_without_a_pid_fails_the_kills_and_ends_eproto(served, pid, shown):
    # Ignored: a kill held for the start failed with "never started", and
    # one asked for later waited for the stream's end; done fired as for a
    # stream that ended well.
    peer, client = served
    handle, _ = _exec(client)
    attached = client.attach(pid=5)
    request = yield peer.requests.get()
    attach = yield peer.requests.get()
    held = handle.kill(signal.SIGTERM)
    peer.respond(request, {"type": "started", "pid": pid})
    peer.respond(attach, {"type": "attached", "pid": pid, "cmd": ATTACHED_CMD})
    said = f"response: expected a pid, got {re.escape(shown)}$"
    with pytest.raises(RPCError, match="started " + said):
        yield held  # failed once the start came
    with pytest.raises(RPCError, match="started " + said):
        yield handle.kill(signal.SIGINT)
    for stream in (request, attach):
        peer.respond(stream, {"type": "finished", "status": 0})
        peer.sendMessage(_response(stream, errnum=ENODATA))
    for done, kind in ((handle.done, "started"), (attached.done, "attached")):
        with pytest.raises(RPCError, match=f"{kind} {said}") as caught:
            yield done
        assert caught.value.errnum == errno.EPROTO


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        (
            b"HTTP/1.1 400 Bad Request\r\n\r\n",
            "{path}: bad message from sdexec: message is not valid JSON: Expecting"
            " value: line 1 column 1 (char 0) (is {path} an sdexec socket?)",
        ),
        (
            b"SSH-2.0",
            "connection to {path} lost in the middle of a message (7 bytes of it"
            " came; is {path} an sdexec socket?)",
        ),
        (
            b'{"type": "response", "pa',
            "connection to {path} lost in the middle of a message (24 bytes of it"
            " came)",
        ),
    ],
    ids=["http", "foreign-cut-off", "cut-off"],
)
@pytest_twisted.inlineCallbacks
def test_a_connection_that_ends_with_no_message_says_what_came(served, sent, said):
    # "not valid JSON" alone for an HTTP server; "connection lost" for one
    # cut off in the middle of a message.
    peer, client = served
    listing = client.list()
    yield peer.requests.get()
    peer.transport.write(sent)
    peer.transport.loseConnection()
    with pytest.raises(ConnectionFailed) as caught:
        yield listing
    assert str(caught.value) == said.format(path=client.path)


@implementer(IPushProducer)
class Producer:
    def __init__(self):
        self.calls = []

    def pauseProducing(self):
        self.calls.append("pause")

    def resumeProducing(self):
        self.calls.append("resume")

    def stopProducing(self):
        self.calls.append("stop")


class FailingProducer(Producer):
    """A producer that fails each call, as one stopped after it finished
    might (an assertion, a closed file)."""

    def pauseProducing(self):
        super().pauseProducing()
        raise RuntimeError("pause")

    def resumeProducing(self):
        super().resumeProducing()
        raise RuntimeError("resume")

    def stopProducing(self):
        super().stopProducing()
        raise RuntimeError("stop")


@pytest.mark.parametrize("kind", [Producer, FailingProducer])
@pytest_twisted.inlineCallbacks
def test_producer_paused_without_credit(served, kind, logged_failures):
    # One that fails is logged, as a failing response callback is: the
    # stream still ends (its done used to never fire), and the connection
    # and its other requests go on.
    peer, client = served
    handle, _ = _exec(client, flags=WRITE_CREDIT)
    producer = kind()
    handle.registerProducer(producer, streaming=True)
    request = yield peer.requests.get()
    handle.write(b"x" * 4096)
    assert producer.calls == ["pause"]
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 4096}})
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 10}})
    peer.fail(request, ENODATA)
    yield handle.done
    assert producer.calls == ["pause", "resume", "stop"]
    failures = [failure.getErrorMessage() for failure in logged_failures.flush()]
    assert failures == ([] if kind is Producer else ["pause", "resume", "stop"])
    assert not client.disconnected.called


@pytest_twisted.inlineCallbacks
def test_stdin_held_for_credit_is_what_was_written_when_written(served):
    # A caller reading into one bytearray again and again: what waits for
    # credit was a view of it, and went out as the buffer's later contents.
    peer, client = served
    handle, _ = _exec(client, flags=WRITE_CREDIT)
    request = yield peer.requests.get()
    buffer = bytearray(b"A" * 8192)
    handle.write(buffer)  # 4096 go at once, 4096 wait for credit
    buffer[:] = b"B" * 8192
    buffer.extend(b"resized")  # the held part no longer pins it
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 4096}})
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 4096}})
    first, second = (yield peer.requests.get()), (yield peer.requests.get())
    sent = decode_io(first["payload"]["io"])[1] + decode_io(second["payload"]["io"])[1]
    assert sent == b"A" * 8192
    peer.fail(request, ENODATA)
    yield handle.done


@pytest_twisted.inlineCallbacks
def test_a_failing_producer_at_a_lost_connection_ends_every_request(
    served, logged_failures
):
    peer, client = served
    handle, _ = _exec(client, flags=WRITE_CREDIT)
    handle.registerProducer(FailingProducer(), streaming=True)
    yield peer.requests.get()
    other, _ = _exec(client)
    listing = client.list()
    yield peer.requests.get()
    yield peer.requests.get()
    peer.transport.loseConnection()
    yield client.disconnected
    for request in (handle.done, other.done, listing):
        with pytest.raises(rpc.ConnectionFailed):
            yield request
    (stopped,) = logged_failures.flush(RuntimeError)
    assert stopped.getErrorMessage() == "stop"


@pytest.mark.parametrize("signum", [15, signal.SIGTERM])
@pytest_twisted.inlineCallbacks
def test_kill_before_started_waits_for_the_pid(served, signum):
    # signal.SIGTERM (an enum) was held as it came: the encoder refused it
    # as started arrived, and dropped the connection and the other kills.
    peer, client = served
    handle, _ = _exec(client)
    killed = handle.kill(signum)
    with pytest.raises(TypeError):
        handle.kill("15")  # not a number: at the call, not when started comes
    request = yield peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 42})
    kill = yield peer.requests.get()
    assert kill["payload"] == {"pid": 42, "signum": 15, "who": "main"}
    peer.respond(kill, {})
    assert (yield killed) == {}
    yield ended_by_close(client, handle.done)


@pytest_twisted.inlineCallbacks
def test_kill_of_a_process_that_never_started(served):
    peer, client = served
    handle, _ = _exec(client)
    killed = handle.kill(15)
    peer.fail((yield peer.requests.get()), errno.ENOENT, "not found")
    with pytest.raises(RPCError, match="never started"):
        yield killed
    with pytest.raises(RPCError):
        yield handle.done


@pytest.mark.parametrize("who", [b"all", "all\udce9", object(), "everyone"])
@pytest_twisted.inlineCallbacks
def test_a_held_kill_refuses_a_bad_who_at_the_call(served, who):
    # Held for started, it raised as that came: the connection dropped with
    # every request on it, and the kill's own Deferred never fired.
    peer, client = served
    handle, _ = _exec(client)
    with pytest.raises((TypeError, ValueError)):
        handle.kill(15, who=who)
    request = yield peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 42})
    peer.respond(request, {"type": "finished", "status": 0})
    peer.fail(request, ENODATA)
    assert (yield handle.done) is None
    assert client.lost is None


@pytest.mark.parametrize(("signum", "shown"), [(True, "True"), (15.0, "15.0")])
@pytest_twisted.inlineCallbacks
def test_a_kill_of_a_signal_number_that_is_no_integer_is_refused_named(
    served, signum, shown
):
    # True, an integer to operator.index, went out as 1: a SIGHUP, where
    # the service refuses a signum of true.
    _peer, client = served
    handle, _ = _exec(client)
    for kill in (handle.kill, lambda signum: client.kill(pid=42, signum=signum)):
        with pytest.raises(TypeError) as caught:
            kill(signum)
        assert str(caught.value) == f"kill: signum: expected an integer, got {shown}"
    yield ended_by_close(client, handle.done)


@pytest.mark.parametrize("signum", [0, -1, signal.NSIG])
@pytest_twisted.inlineCallbacks
def test_a_held_kill_refuses_a_bad_signal_number_at_the_call(served, signum):
    # Held for started, kill(0) was refused by the service only once the
    # process had started and run on meanwhile; nothing is sent for it now.
    peer, client = served
    handle, _ = _exec(client)
    with pytest.raises(ValueError) as caught:
        handle.kill(signum)
    # The service's words for it (test_server), with the call's name.
    assert str(caught.value) == (
        f"kill: signum: expected a signal number from 1 to {signal.NSIG - 1},"
        f" got {signum}"
    )
    request = yield peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 42})
    listing = client.list()
    after = yield peer.requests.get()  # a held kill would have come first
    assert after["topic"] == "sdexec.list"
    peer.respond(after, LISTED_NOTHING)
    yield listing
    peer.respond(request, {"type": "finished", "status": 0})
    peer.fail(request, ENODATA)
    assert (yield handle.done) is None


@defer.inlineCallbacks
def _round_trip(peer, client):
    """Fires once the client has handled everything the peer sent before."""
    listing = client.list()
    peer.respond((yield peer.requests.get()), LISTED_NOTHING)
    yield listing


# -- the command line: pure parts -------------------------------------------


@pytest.mark.parametrize(
    ("status", "code"),
    [(0, 0), (1 << 8, 1), (255 << 8, 255), (15, 143), (0x80 | 11, 139)],
)
def test_exit_code_from_wait_status(status, code):
    assert exit_code(status) == code


def test_setopt_splits_on_the_first_equals():
    options = parse_args(["run", "--setopt", "A=b=c", "--setopt", "E=", "ls", "-l"])
    assert options.setopt == [("A", "b=c"), ("E", "")]
    assert options.cmdline == ["ls", "-l"]


@pytest.mark.parametrize("bad", ["novalue", "=value"])
def test_bad_setopt_is_a_usage_error_naming_it(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["run", "--setopt", bad, "true"])
    assert exit_.value.code == 2
    assert f"{bad!r} is not KEY=VAL" in capsys.readouterr().err


def test_kill_arguments():
    options = parse_args(["kill", "SIGTERM", "1234"])
    assert (options.signum, options.target) == (15, {"pid": 1234})
    assert parse_args(["kill", "9", "job-7"]).target == {"label": "job-7"}
    assert kill_target("12a") == {"label": "12a"}
    # Digits of other scripts are a label: "١٢" was pid 12, "²" a traceback.
    assert kill_target("١٢") == {"label": "١٢"}
    assert cancel_targets("²") == ({"jobid": "²"}, {"label": "²"})


def test_ps_table():
    procs = [
        {
            "pid": 42,
            "state": "R",
            "unit": "u.service",
            "label": "",
            "cmdline": ["sh", "-c", "sleep 1"],
        }
    ]
    assert format_procs(procs).splitlines() == [
        "PID  STATE  MODE  UNIT       LABEL  JOBID  STEP  CMDLINE",
        "42   R      -     u.service  -      -      -     sh -c 'sleep 1'",
    ]
    procs[0]["mode"] = "background"
    assert format_procs(procs).splitlines()[1] == (
        "42   R      background  u.service  -      -      -     sh -c 'sleep 1'"
    )


def test_ps_table_escapes_what_a_terminal_would_obey():
    # Whoever started a process chose its label and arguments: no newline
    # or escape sequence of theirs reaches the owner's terminal as such.
    procs = [{"pid": 7, "state": "R", "unit": "u.service",
              "label": "x\ny\x1b[31mRED",
              "cmdline": ["printf", "\x1b]0;t\x07"]}]  # fmt: skip
    (_header, row) = format_procs(procs).splitlines()
    assert "x\\ny\\x1b[31mRED" in row
    assert row.endswith("printf '\\x1b]0;t\\x07'")
    assert row.isprintable()


def test_ps_table_quotes_a_leftover_s_command_line_as_a_process_s():
    # It showed sh -c trap "" TERM; sleep 9, unquoted, for a leftover.
    argv = ["sh", "-c", 'trap "" TERM; sleep 9']
    procs = [{"pid": 7, "state": state, "unit": "u.service", "cmdline": argv}
             for state in ("R", "O")]  # fmt: skip
    rows = format_procs(procs).splitlines()[1:]
    assert [row.endswith("  sh -c 'trap \"\" TERM; sleep 9'") for row in rows] == [
        True,
        True,
    ]


def test_ps_table_quotes_a_command_line_that_is_no_list():
    # A broken service's number was "unexpected error: TypeError: 'int'
    # object is not iterable".
    procs = [{"pid": 7, "cmdline": cmdline} for cmdline in (5, "ls -l", None, [])]
    rows = format_procs(procs).splitlines()[1:]
    assert [row.rsplit("  ", 1)[1] for row in rows] == ["5", '"ls -l"', "?", "?"]


def test_ps_table_shows_the_job_and_its_termination_step():
    procs = [
        {"pid": 42, "state": "R", "unit": "u.service", "label": "x",
         "jobid": "f1", "step": "kill-tasks", "cmdline": ["job-shell"]},
    ]  # fmt: skip
    assert format_procs(procs).splitlines() == [
        "PID  STATE  MODE  UNIT       LABEL  JOBID  STEP        CMDLINE",
        "42   R      -     u.service  x      f1     kill-tasks  job-shell",
    ]


def test_ps_table_s_jobid_is_the_job_id_its_unit_or_name_carries():
    # A job of a time limit alone (its id its unit's name) filled JOBID with
    # the whole unit name again; a leftover of a job showed "-" where its
    # unit's name carries the id sdexec cancel knows it by (review session 51).
    unit = f"sdexec-{'0' * 32}.service"
    job_unit = f"sdexec-f1-{'a' * 32}.service"
    procs = [
        {"pid": 1, "state": "R", "unit": unit, "jobid": unit},
        {"pid": 2, "state": "O", "unit": job_unit},
        {"pid": 3, "state": "O", "unit": "named.service"},
        {"pid": 4, "state": "O", "unit": unit},
        {"pid": 5, "state": "R", "unit": job_unit},  # a plain run: no job here
    ]
    rows = format_procs(procs).splitlines()[1:]
    assert [row.split()[5] for row in rows] == ["(unit)", "f1", "-", "-", "-"]


def test_a_variable_that_is_not_utf8_is_left_out_and_named(capsys):
    # One such variable of a shell (an OLDPWD) failed every run with an
    # "unexpected error" about a position in a JSON line.
    latin1 = os.fsdecode(b"caf\xe9")
    env = {"PATH": "/bin", "OLDPWD": latin1, latin1: "x"}
    command = build_command(parse_args(["run", "true"]), env, "/")
    assert command["env"] == {"PATH": "/bin"}
    # By its name when that is text: "b'OLDPWD'" blamed the name's bytes.
    assert capsys.readouterr().err == (
        "sdexec: not passing OLDPWD: its value is not UTF-8 text\n"
        "sdexec: not passing b'caf\\xe9': its name is not UTF-8 text\n"
    )


def test_dir_is_the_process_s_pwd_too(tmp_path):
    # The client's own PWD went with its environment: a program that takes
    # $PWD at its word saw the wrong directory.
    (tmp_path / "a" / "job").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a" / "job")
    options = parse_args(["run", "--dir", "link/..", "true"])
    command = build_command(options, {"PWD": "/home/u", "PATH": "/bin"}, str(tmp_path))
    # (sent as it was, "link/.." was a path systemd would not take)
    assert command["cwd"] == os.path.realpath(tmp_path / "a")
    assert command["env"] == {"PWD": command["cwd"], "PATH": "/bin"}


@pytest.mark.parametrize(
    ("given", "unreached"),
    [("gone/../a", "gone"), ("gone/x/../../a", "gone"), ("a/gone/..", "a/gone")],
)
def test_dir_through_a_missing_directory_is_where_cd_would_fail(
    tmp_path, given, unreached
):
    # "gone/../a" was resolved lexically past the missing "gone", and the
    # process ran in "a", where `cd gone/../a` (chdir(2)) fails: sent as
    # the directory the kernel's walk stops at, systemd fails to enter it
    # and says so (review session 47).
    (tmp_path / "a").mkdir()
    options = parse_args(["run", "--dir", given, "true"])
    command = build_command(options, {"PATH": "/bin"}, str(tmp_path))
    assert command["cwd"] == os.path.realpath(tmp_path / unreached)


@pytest.mark.parametrize(
    ("argv", "cwd", "named"),
    [
        (["run", "cat", os.fsdecode(b"caf\xe9")], "/", "argument 1"),
        (["run", "true"], os.fsdecode(b"/tmp/caf\xe9"), "the working directory"),
        (["run", "--jobid", os.fsdecode(b"caf\xe9"), "true"], "/", "--jobid"),
        (
            ["run", "--time-limit=" + os.fsdecode(b"caf\xe9"), "true"],
            "/",
            "--time-limit",
        ),
        (
            ["run", "--setopt", "A=" + os.fsdecode(b"caf\xe9"), "true"],
            "/",
            "--setopt A",
        ),
        # A key that is not text is shown as bytes only: it was written into
        # the words, a lone surrogate that stderr showed as "\\udce9".
        (["run", "--setopt", os.fsdecode(b"caf\xe9=1"), "true"], "/", "--setopt"),
    ],
)
def test_an_argument_or_directory_that_is_not_utf8_is_refused_named(argv, cwd, named):
    with pytest.raises(SdexecError) as error:
        build_command(parse_args(argv), {}, cwd)
    assert str(error.value).startswith(f"{named} is not UTF-8 text")
    assert "\\xe9" in str(error.value)
    assert str(error.value).isprintable() and is_utf8(str(error.value))


def test_run_job_options_and_cancel_targets():
    options = parse_args(
        [
            "run",
            "--no-passthrough",
            "--jobid",
            "f1",
            "--time-limit",
            "5m",
            "--setopt",
            "A=b",
            "true",
        ]
    )
    opts = build_command(options, {}, "/")["opts"]
    # A closed pipe must end a framed run too (the client forwards SIGPIPE),
    # and its output is not line-buffered: a prompt shows before its answer.
    relayed = {
        "SDEXEC_PROP_IgnoreSIGPIPE": "no",
        "stdout_LINE_BUFFER": "false",
        "stderr_LINE_BUFFER": "false",
    }
    assert opts == {
        **relayed,
        "A": "b",
        "SDEXEC_JOBID": "f1",
        "SDEXEC_TIME_LIMIT": "5m",
    }
    assert build_command(parse_args(["run", "true"]), {}, "/")["opts"] == {
        "SDEXEC_PROP_IgnoreSIGPIPE": "no"  # nothing relayed: no buffering to set
    }
    buffered = ["run", "--no-passthrough", "--setopt", "stdout_LINE_BUFFER=1", "true"]
    opts = build_command(parse_args(buffered), {}, "/")["opts"]
    assert opts["stdout_LINE_BUFFER"] == "1"  # the user's own choice wins
    assert build_command(parse_args(["run", "--bg", "true"]), {}, "/")["opts"] == {}
    assert cancel_targets("1234") == ({"pid": 1234}, {"jobid": "1234"})
    assert cancel_targets("fA3x") == ({"jobid": "fA3x"}, {"label": "fA3x"})


def _cancel_against(monkeypatch, answers: dict, procs: list | None = None) -> list:
    """Make ``sdexec cancel`` meet a service listing ``procs`` (none by
    default) and answering ``answers`` (``(key, value)`` → a reply dict or
    an RPCError); the targets tried."""
    tried: list[tuple] = []

    def listed(_options, topic, payload):
        assert (topic, payload) == (Topic.LIST, {"detail": True})
        return {"rank": 0, "procs": procs or []}

    def terminate(_options, target):
        ((key, value),) = target.items()
        tried.append((key, value))
        answer = answers.get(
            (key, value), RPCError(errno.ESRCH, terminate_not_found(key, value))
        )
        if isinstance(answer, RPCError):
            raise answer
        return answer

    monkeypatch.setattr(cli, "request", listed)
    monkeypatch.setattr(cli, "_terminate", terminate)
    return tried


def test_cancel_of_a_pid_whose_job_has_ended_says_so(monkeypatch, capsys):
    # It used to try the job id next and say "terminate jobid=4242 not found".
    ended = RPCError(errno.ESRCH, "job j1 has already exited")
    tried = _cancel_against(monkeypatch, {("pid", 4242): ended})
    assert cli.main(["cancel", "4242"]) == 1
    assert capsys.readouterr().err == "sdexec: job j1 has already exited\n"
    assert tried == [("pid", 4242)]


def test_cancel_tries_the_second_target_when_the_first_names_nothing(
    monkeypatch, capsys
):
    ended = RPCError(errno.ESRCH, "job 4242 has already exited")
    tried = _cancel_against(monkeypatch, {("jobid", "4242"): ended})
    assert cli.main(["cancel", "4242"]) == 1
    assert capsys.readouterr().err == "sdexec: job 4242 has already exited\n"
    assert tried == [("pid", 4242), ("jobid", "4242")]
    _cancel_against(monkeypatch, {("label", "n"): {"id": "f1", "step": "term"}})
    assert cli.main(["cancel", "n"]) == 0
    assert capsys.readouterr().out == "job f1: terminating (step term)\n"


def test_cancel_of_a_number_tries_the_job_when_that_pid_runs_none(monkeypatch, capsys):
    # Pid 4242 a plain run's, job 4242 another's: the job was never tried.
    plain = RPCError(errno.EINVAL, terminate_runs_no_job("pid", 4242))
    tried = _cancel_against(
        monkeypatch,
        {("pid", 4242): plain, ("jobid", "4242"): {"id": "4242", "step": "term"}},
    )
    assert cli.main(["cancel", "4242"]) == 0
    assert tried == [("pid", 4242), ("jobid", "4242")]
    assert capsys.readouterr().out == "job 4242: terminating (step term)\n"


def test_cancel_of_nothing_names_both_targets(monkeypatch, capsys):
    _cancel_against(monkeypatch, {})
    assert cli.main(["cancel", "4242"]) == 1
    assert capsys.readouterr().err == (
        "sdexec: terminate pid=4242 not found; terminate jobid=4242 not found\n"
    )


@pytest.mark.parametrize(
    ("target", "proc", "said"),
    [
        ("w1", {"pid": 77, "label": "w1", "state": "Z"},
         "cancel w1: pid 77 has ended, nothing is left to terminate;"
         " sdexec wait w1 collects its exit status if it was started"
         " waitable"),
        ("77", {"pid": 77, "label": "", "state": "Z"},
         "cancel 77: pid 77 has ended, nothing is left to terminate;"
         " sdexec wait 77 collects its exit status if it was started"
         " waitable"),
        ("my job", {"pid": 79, "label": "my job", "state": "Z"},
         "cancel my job: pid 79 has ended, nothing is left to terminate;"
         " sdexec wait 'my job' collects its exit status if it was started"
         " waitable"),
        # A streaming one's status went to its run: sdexec wait said "not
        # started waitable" of one finished, its unit still stopping.
        ("s1", {"pid": 80, "label": "s1", "state": "Z", "mode": "streaming"},
         "cancel s1: pid 80 has ended, nothing is left to terminate (its"
         " exit status goes to the run that started it)"),
        ("p1", {"pid": 78, "label": "p1", "state": "R"},
         "cancel p1: pid 78 runs no job (it was run without --jobid):"
         " sdexec kill signals it"),
        # A leftover of job 42 (its unit named so) was said "run without
        # --jobid".
        ("81", {"pid": 81, "label": "", "state": "O",
                "unit": "sdexec-42-a956abf1afa7.service"},
         "cancel 81: pid 81 is the main process of leftover unit"
         " sdexec-42-a956abf1afa7.service (state O), which no request of"
         " this run follows: it runs no job here; sdexec kill signals it"),
    ],
)  # fmt: skip
def test_cancel_of_a_listed_process_that_runs_no_job_says_why(
    monkeypatch, capsys, target, proc, said
):
    # An ended waitable process (state Z) was "terminate jobid=w1 not
    # found; terminate label=w1 not found", which ps belied (review
    # session 46 cli-2); no terminate is sent for what the list answers.
    tried = _cancel_against(monkeypatch, {}, [proc])
    assert cli.main(["cancel", target]) == 1
    assert capsys.readouterr().err == f"sdexec: {said}\n"
    assert tried == []


def _job(pid: int, jobid: str, label: str = "") -> dict:
    """A job's ``sdexec.list`` entry (with detail)."""
    return {"pid": pid, "label": label, "state": "R", "jobid": jobid, "step": None}


@pytest.mark.parametrize(
    ("target", "procs", "sent"),
    [
        # Job 9 of pid 1234: pid 9 was tried first (ESRCH).
        ("9", [_job(1234, "9")], ("jobid", "9")),
        # A plain run's pid 9, job 9 elsewhere: pid 9 was tried (EINVAL).
        ("9", [{"pid": 9, "label": "", "state": "R"}, _job(77, "9")],
         ("jobid", "9")),
        ("1234", [_job(1234, "9")], ("pid", 1234)),
        # Job nightly labelled n: job id n was tried first.
        ("n", [_job(1234, "nightly", "n")], ("label", "n")),
        ("nightly", [_job(1234, "nightly", "n")], ("jobid", "nightly")),
    ],
)  # fmt: skip
def test_cancel_sends_one_terminate_to_the_job_listed(
    monkeypatch, capsys, target, procs, sent
):
    # Each ordinary cancel first sent a terminate that named nothing: a
    # refused request and a terminate error in /metrics for every one
    # (review session 43 M5-4).
    tried = _cancel_against(monkeypatch, {sent: {"id": "j", "step": "term"}}, procs)
    assert cli.main(["cancel", target]) == 0
    assert tried == [sent]
    assert capsys.readouterr().out == "job j: terminating (step term)\n"


# -- the command line against the peer --------------------------------------


class _Collect(protocol.ProcessProtocol):
    def __init__(self, stdin: bytes):
        self.stdin = stdin
        self.out, self.err = bytearray(), bytearray()
        self.ended = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.stdin)
        self.transport.closeStdin()

    def outReceived(self, data):
        self.out += data

    def errReceived(self, data):
        self.err += data

    def processEnded(self, reason):
        # As subprocess says it: -N for a death by signal N.
        ended = reason.value
        self.ended.callback(-ended.signal if ended.exitCode is None else ended.exitCode)


def _spawn_cli(
    path: str,
    args: list[str],
    stdin: bytes = b"",
    stdout: int | None = None,
    stderr: int | None = None,
) -> _Collect:
    """The command line as a user runs it (no PYTHONUNBUFFERED: a shell has
    none), its stdout and stderr collected, or on the descriptors ``stdout``
    and ``stderr``."""
    collected = _Collect(stdin)
    argv = [sys.executable, "-m", "sdexec.cli", "--socket", path, *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONUNBUFFERED", None)
    fds = {
        0: "w",
        1: "r" if stdout is None else stdout,
        2: "r" if stderr is None else stderr,
    }
    reactor.spawnProcess(
        collected, sys.executable, argv, env=env, path=str(REPO), childFDs=fds
    )
    return collected


@pytest_twisted.inlineCallbacks
def test_cli_run_streams_and_exits_with_the_status(tmp_path, served):
    peer, client = served
    factory_peers = peer.factory.peers
    framed = ["run", "--no-passthrough", "--setopt", "K=V", "cat"]
    cli = _spawn_cli(client.path, framed, b"x" * 5000)
    peer = yield factory_peers.get()
    request = yield peer.requests.get()
    cmd = request["payload"]["cmd"]
    assert (cmd["cmdline"], cmd["cwd"]) == (["cat"], str(REPO))
    assert cmd["opts"] == {
        "SDEXEC_PROP_IgnoreSIGPIPE": "no",
        "stdout_LINE_BUFFER": "false",
        "stderr_LINE_BUFFER": "false",
        "K": "V",
    }
    assert cmd["env"]["PYTHONPATH"] == str(REPO)
    assert request["payload"]["flags"] == 11
    first = yield peer.requests.get()  # the borrowed credit, no more
    assert len(decode_io(first["payload"]["io"])[1]) == 4096
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 4096}})
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 4096}})
    rest, eof = (yield peer.requests.get()), (yield peer.requests.get())
    assert decode_io(rest["payload"]["io"]) == ("stdin", b"x" * 904, False)
    assert decode_io(eof["payload"]["io"])[2] is True
    binary = bytes(range(256)) * 4
    for payload in (
        {"type": "started", "pid": 42},
        {"type": "output", "pid": 42, "io": encode_io("stdout", "0", binary)},
        {"type": "output", "pid": 42, "io": encode_io("stderr", "0", b"e\n")},
        {"type": "finished", "status": 7 << 8},
    ):
        peer.respond(request, payload)
    peer.fail(request, ENODATA)
    assert (yield cli.ended) == 7
    assert (bytes(cli.out), bytes(cli.err)) == (binary, b"e\n")


@pytest_twisted.inlineCallbacks
def test_cli_missing_command_exits_127(served):
    peer, client = served
    cli = _spawn_cli(client.path, ["run", "--no-passthrough", "-n", "nosuch"])
    peer = yield peer.factory.peers.get()
    request = yield peer.requests.get()
    eof = yield peer.requests.get()  # -n: EOF at once
    assert decode_io(eof["payload"]["io"]) == ("stdin", b"", True)
    peer.fail(request, errno.ENOENT, "nosuch: No such file or directory")
    assert (yield cli.ended) == 127
    assert bytes(cli.err) == b"sdexec: nosuch: No such file or directory\n"


@pytest_twisted.inlineCallbacks
def test_cli_forwards_a_signal_held_before_the_start_as_kill(served):
    # (SIGINT, SIGTERM and SIGHUP before the start end the command instead:
    # test_cli_scripted.py.)
    peer, client = served
    cli = _spawn_cli(client.path, ["run", "--no-passthrough", "-n", "sleep", "100"])
    peer = yield peer.factory.peers.get()
    request = yield peer.requests.get()
    yield peer.requests.get()  # stdin EOF
    cli.transport.signalProcess(signal.SIGUSR1)  # before started: held till then
    peer.respond(request, {"type": "started", "pid": 42})
    kill = yield peer.requests.get()
    assert (kill["topic"], kill["payload"]) == (
        "sdexec.kill",
        {"pid": 42, "signum": signal.SIGUSR1, "who": "all"},
    )
    peer.respond(kill, {})
    peer.respond(request, {"type": "finished", "status": signal.SIGUSR1})
    peer.fail(request, ENODATA)
    assert (yield cli.ended) == 128 + signal.SIGUSR1
    assert bytes(cli.err) == b""


#: Output that fills a pipe many times over, each line numbered: what
#: reaches the reader shows whether anything was lost or reordered.
_FLOOD = [
    b"".join(b"%07d\n" % line for line in range(start, start + 8192))
    for start in range(0, 16 * 8192, 8192)
]


def _flood(peer: Peer, request: dict) -> None:
    for data in _FLOOD:
        io = encode_io("stdout", "0", data)
        peer.respond(request, {"type": "output", "pid": 42, "io": io})


@pytest_twisted.inlineCallbacks
def test_cli_forwards_sigterm_while_its_stdout_waits_for_a_reader(served):
    # A write that waits for a reader used to hold the signal with it: the
    # process ran on until somebody read. The kill goes on a connection of
    # its own: the service reads no requests from one whose answers wait.
    peer, client = served
    peers = peer.factory.peers
    r, w = os.pipe2(os.O_CLOEXEC)  # its stdout, nobody reading yet
    argv = ["run", "--no-passthrough", "-n", "yes"]
    cli = _spawn_cli(client.path, argv, stdout=w)
    os.close(w)
    peer = yield peers.get()
    request = yield peer.requests.get()
    yield peer.requests.get()  # stdin EOF
    peer.respond(request, {"type": "started", "pid": 42})
    _flood(peer, request)
    yield defer.ensureDeferred(until_pipe_full(r))
    cli.transport.signalProcess("TERM")
    aside = yield peers.get().addTimeout(30, reactor)
    kill = yield aside.requests.get()
    assert (kill["topic"], kill["payload"]) == (
        "sdexec.kill",
        {"pid": 42, "signum": 15, "who": "all"},
    )
    aside.respond(kill, {})
    peer.respond(request, {"type": "finished", "status": signal.SIGTERM})
    peer.fail(request, ENODATA)
    out = yield deferToThread(read_to_end, r)
    assert out == b"".join(_FLOOD)  # all of it, in order, once
    assert (yield cli.ended) == 143
    assert bytes(cli.err) == b""  # the kill's answer came, on its connection


@pytest_twisted.inlineCallbacks
def test_cli_serves_signals_while_a_line_waits_for_its_stalled_stderr(served):
    # `sdexec run --no-passthrough ... 2>&1 | less`, less stopped: a kill
    # that failed while the output waited was said on that full pipe, and
    # the client blocked in the write, so that the SIGTERM after it never
    # reached the process. The line is held, and said once the pipe drains.
    peer, client = served
    peers = peer.factory.peers
    r, w = os.pipe2(os.O_CLOEXEC)  # its stdout and stderr, nobody reading yet
    argv = ["run", "--no-passthrough", "-n", "yes"]
    cli = _spawn_cli(client.path, argv, stdout=w, stderr=w)
    os.close(w)
    reading = False
    try:
        peer = yield peers.get()
        request = yield peer.requests.get()
        yield peer.requests.get()  # stdin EOF
        peer.respond(request, {"type": "started", "pid": 42})
        _flood(peer, request)
        yield defer.ensureDeferred(until_pipe_full(r))
        _top_up(r)  # not a byte more fits: the line waits as the output does
        cli.transport.signalProcess(signal.SIGUSR1)
        aside = yield peers.get().addTimeout(30, reactor)
        aside.fail((yield aside.requests.get()), errno.EPERM, "not yours")
        # Closed once the failure was said: it blocked in the write instead.
        yield aside.closed.addTimeout(30, reactor)
        cli.transport.signalProcess("TERM")
        aside = yield peers.get().addTimeout(30, reactor)
        kill = yield aside.requests.get()
        assert kill["payload"] == {"pid": 42, "signum": 15, "who": "all"}
        aside.respond(kill, {})
        peer.respond(request, {"type": "finished", "status": signal.SIGTERM})
        peer.fail(request, ENODATA)
        reading = True  # read_to_end closes r
        out = yield deferToThread(read_to_end, r)
    finally:
        if not reading:  # a failure: the client may wait on the pipe for ever
            cli.transport.signalProcess("KILL")
            os.close(r)
    said = b"sdexec: kill SIGUSR1: not yours\n"
    assert out.count(said) == 1  # said, once, where the pipe had room
    assert out.replace(said, b"").replace(_FILLER, b"") == b"".join(_FLOOD)
    assert (yield cli.ended) == 143


#: What :func:`_top_up` fills a pipe with (no line of :data:`_FLOOD` has it).
_FILLER = b"~"


def _top_up(r: int) -> None:
    """Fill the pipe whose read end is ``r`` to the last byte, through a
    writer of our own: a writer that waits may have left room in its last
    page, which a short write takes at once."""
    writer = os.open(f"/proc/self/fd/{r}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        for size in (4096, 512, 64, 8, 1):
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(writer, _FILLER * size)
    finally:
        os.close(writer)


def test_lines_said_while_output_waits_are_held_for_stderr_within_a_bound(
    monkeypatch,
):
    # Each said as far as a full stderr takes it at once (none of it): held,
    # the first MAX_HELD_LINES, the rest counted, and all said at the end.
    r, w = os.pipe2(os.O_CLOEXEC)
    monkeypatch.setattr(sys, "stderr", open(w, "w", encoding="utf-8"))  # noqa: SIM115
    monkeypatch.setattr(cliio, "_held", cliio._HeldLines())
    _top_up(r)
    cliio._held.waits = 1  # as Output's wait has it
    for line in range(cliio.MAX_HELD_LINES + 8):
        cliio.warn(f"line {line}")
    cliio._held.waits = 0
    os.set_blocking(r, False)
    with contextlib.suppress(BlockingIOError):
        while os.read(r, 1 << 16):  # the filler: nothing said got in
            pass
    cliio.say_held()
    sys.stderr.close()
    said = [f"sdexec: line {line}" for line in range(cliio.MAX_HELD_LINES)]
    said.append(
        "sdexec: 8 more lines not said: stderr took none while the output"
        f" waited for its reader (the first {cliio.MAX_HELD_LINES} were held)"
    )
    os.set_blocking(r, True)
    assert read_to_end(r).decode().splitlines() == said


def test_a_terminal_is_written_through_a_non_blocking_descriptor_of_its_own():
    # O_NONBLOCK on the shell's own file description of its terminal would
    # surprise the shell and every other process writing to it.
    controller, terminal = os.openpty()
    twin = cliio._nonblocking_twin(terminal)
    try:
        assert twin != terminal
        assert not os.get_blocking(twin) and os.get_blocking(terminal)
        os.write(twin, b"through the twin")
        assert os.read(controller, 64) == b"through the twin"
    finally:
        for fd in {controller, terminal, twin}:
            os.close(fd)


def test_a_terminal_is_read_through_a_non_blocking_descriptor_of_its_own(tmp_path):
    # Woken by poll(), a blocking read of the shell's terminal waited for
    # the next line when another reader (a pager in the pipeline) took this
    # one, deaf to Ctrl-C and SIGTERM, and took the user's next command
    # (review session 43 R2-1).
    controller, terminal = os.openpty()
    reader = cliio.nonblocking_reader(terminal)
    try:
        assert reader != terminal
        assert not os.get_blocking(reader) and os.get_blocking(terminal)
        with pytest.raises(BlockingIOError):
            os.read(reader, 64)  # nothing typed: at once, not a wait
        os.write(controller, b"typed\n")
        assert os.read(reader, 64) == b"typed\n"
    finally:
        for fd in {controller, terminal, reader}:
            os.close(fd)
    # A file is read where its offset is, as a new description would not.
    with open(tmp_path / "in", "wb+") as file:
        assert cliio.nonblocking_reader(file.fileno()) == file.fileno()


def test_a_file_a_socket_or_a_pty_master_is_written_through_its_own_descriptor(
    tmp_path,
):
    # A pty master opened again is a new pty: what went to it, nobody read.
    with open(tmp_path / "out", "wb") as file:
        assert cliio._nonblocking_twin(file.fileno()) == file.fileno()
    left, right = socket.socketpair()
    with left, right:
        assert cliio._nonblocking_twin(left.fileno()) == left.fileno()
    controller, terminal = os.openpty()
    try:
        assert cliio._nonblocking_twin(controller) == controller
    finally:
        os.close(controller)
        os.close(terminal)


@pytest.mark.parametrize(
    ("signum", "status"),
    # A Ctrl-C is died of, so that a script's loop stops (see _die_of).
    [("INT", -signal.SIGINT), ("TERM", 0), ("HUP", 0)],
)
@pytest_twisted.inlineCallbacks
def test_cli_attach_detaches_while_its_stdout_waits_for_a_reader(
    served, signum, status
):
    peer, client = served
    r, w = os.pipe2(os.O_CLOEXEC)  # its stdout, nobody reading yet
    cli = _spawn_cli(client.path, ["attach", "42"], stdout=w)
    os.close(w)
    try:
        peer = yield peer.factory.peers.get()
        request = yield peer.requests.get()
        peer.respond(request, {"type": "attached", "pid": 42, "cmd": ATTACHED_CMD})
        _flood(peer, request)
        yield defer.ensureDeferred(until_pipe_full(r))
        cli.transport.signalProcess(signum)
        assert (yield cli.ended.addTimeout(30, reactor)) == status
    finally:
        os.close(r)
    assert bytes(cli.err) == b"sdexec: detached from pid 42; it runs on\n"


@pytest.mark.parametrize(
    ("answer", "printed"),
    [({"type": "started", "pid": 42}, b"42\n"), ({"type": "started"}, b"")],
)
@pytest_twisted.inlineCallbacks
def test_cli_background_run_prints_the_pid_or_says_none_came(served, answer, printed):
    peer, client = served
    cli = _spawn_cli(client.path, ["run", "--bg", "sleep", "100"])
    peer = yield peer.factory.peers.get()
    request = yield peer.requests.get()
    assert request["streaming"] is False
    peer.respond(request, answer)
    assert (yield cli.ended) == (0 if printed else 1)
    assert bytes(cli.out) == printed
    if not printed:
        assert bytes(cli.err) == (
            b"sdexec: background exec: expected a started pid,"
            b' got {"type": "started"}\n'
        )


@pytest_twisted.inlineCallbacks
def test_cli_background_run_prints_a_label_on_one_line(served):
    # Printed raw, a label's line break and escape code broke the "PID
    # LABEL" line and the terminal; ps shows it so already.
    peer, client = served
    label = "a\x1b[2Jb\nc"
    cli = _spawn_cli(client.path, ["run", "--bg", "--label", label, "sleep", "100"])
    peer = yield peer.factory.peers.get()
    request = yield peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 42})
    assert (yield cli.ended) == 0
    assert bytes(cli.out) == b"42 a\\x1b[2Jb\\nc\n"


@pytest.mark.parametrize(
    ("args", "answer", "said"),
    [
        (["run", "--bg", "sleep", "100"], {"type": "started", "pid": 42},
         b": pid 42 started all the same, and runs on in the background"
         b" (sdexec kill TERM 42)"),
        (["wait", "w"], {"status": 0, "output": [encode_io("stdout", "0", b"x\n")]},
         b""),
    ],
    ids=["run --bg", "wait"],
)  # fmt: skip
@pytest_twisted.inlineCallbacks
def test_output_a_full_disk_refuses_is_a_failure_said(served, args, answer, said):
    # The pid of `run --bg > pidfile`, the output of a process waited for
    # once: lost with exit 0 and not a word. (The pid, of a process that
    # runs on, is then said on stderr.)
    peer, client = served
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        cli = _spawn_cli(client.path, args, stdout=full)
    finally:
        os.close(full)
    peer = yield peer.factory.peers.get()
    peer.respond((yield peer.requests.get()), answer)
    assert (yield cli.ended) == 1
    assert bytes(cli.err) == (
        b"sdexec: cannot write stdout: No space left on device" + said + b"\n"
    )


@pytest_twisted.inlineCallbacks
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["kill", "15"], b"kill PID|LABEL"),
        (["wait"], b"wait PID|LABEL"),
        (["attach"], b"attach PID|LABEL"),
        (["cancel"], b"cancel PID|LABEL|JOBID"),
    ],
)
def test_cli_a_target_that_is_not_utf8_is_named(served, argv, named):
    # It was "an argument is not UTF-8 text ...: b'\\xe9'": the one byte,
    # and no word of which argument held it.
    _, client = served
    cli = _spawn_cli(client.path, [*argv, os.fsdecode(b"f\xe9")])
    assert (yield cli.ended) == 1
    assert bytes(cli.err) == (
        b"sdexec: " + named + b" is not UTF-8 text, which the service takes only:"
        b" b'f\\xe9'\n"
    )


@pytest_twisted.inlineCallbacks
def test_cli_missing_socket_is_one_line(tmp_path):
    cli = _spawn_cli(str(tmp_path / "absent.sock"), ["ps"])
    assert (yield cli.ended) == 1
    assert bytes(cli.err).count(b"\n") == 1
    assert bytes(cli.err).startswith(b"sdexec: cannot connect to ")


@pytest_twisted.inlineCallbacks
def test_stdin_beyond_the_credit_is_held_and_sent_as_credit_comes(served):
    peer, client = served
    handle, _ = _exec(client, flags=WRITE_CREDIT, opts={"stdin_BUFSIZE": "1K"})
    request = yield peer.requests.get()
    handle.write(b"a" * 1500)
    handle.close_stdin()  # EOF only after the held data
    sent = [(yield peer.requests.get())]  # the borrowed credit, no more
    assert handle.credit == 0
    # The first add-credit replaces the borrowing: nothing more yet.
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 1024}})
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 300}})
    peer.respond(request, {"type": "add-credit", "channels": {"stdin": 1024}})
    for _ in range(3):
        sent.append((yield peer.requests.get()))
    assert [decode_io(write["payload"]["io"]) for write in sent] == [
        ("stdin", b"a" * 1024, False),
        ("stdin", b"a" * 300, False),
        ("stdin", b"a" * 176, False),
        ("stdin", b"", True),
    ]
    assert handle.credit == 1024 - 176
    yield ended_by_close(client, handle.done)


# -- closing, and a transport the service reads no more of (review 29-AM) -----


@pytest_twisted.async_yield_fixture
async def served_on_a_clock(tmp_path):
    """``(peer, client, clock)``: as ``served``, the client's timers on a
    Clock."""
    from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
    from twisted.internet.task import Clock

    from sdexec.client import SdexecClient

    factory = protocol.Factory.forProtocol(Peer)
    factory.peers = DeferredQueue()
    path = str(tmp_path / "sdexec.sock")
    port = await UNIXServerEndpoint(reactor, path).listen(factory)
    clock = Clock()
    client = SdexecClient(path, clock)
    await connectProtocol(UNIXClientEndpoint(reactor, path), client)
    peer = await factory.peers.get()
    yield peer, client, clock
    client.transport.abortConnection()
    await client.disconnected
    await port.stopListening()


async def _writing_to_a_service_that_stopped_reading(peer, client):
    """``(handle, producer)``: an exec without credit whose stdin producer
    the client paused: the service reads nothing more, and 2 MiB of stdin
    fill the transport."""
    handle, _ = _exec(client)
    await peer.requests.get()
    producer = Producer()
    handle.registerProducer(producer, streaming=True)
    peer.transport.pauseProducing()
    handle.write(b"x" * (2 << 20))
    assert producer.calls == ["pause"]
    return handle, producer


@pytest_twisted.ensureDeferred
async def test_a_close_the_service_reads_nothing_of_ends_after_its_grace(
    served_on_a_clock,
):
    # Stdin written without credit to a process that reads none: the
    # service reads nothing more of the connection, the transport never
    # drained, and close() (done, disconnected) never fired.
    from sdexec.client import CLOSE_GRACE_S

    peer, client, clock = served_on_a_clock
    handle, _ = _exec(client)
    await peer.requests.get()
    peer.transport.pauseProducing()
    handle.write(b"x" * (8 << 20))
    closed = client.close()
    # Nothing else can end it: the peer reads nothing, so the transport
    # never drains, and an abort is reported at the reactor's next turn (a
    # callLater(0)), due before this sleep ends however loaded the machine.
    await sleep(0.1)
    assert not closed.called
    clock.advance(CLOSE_GRACE_S)
    await closed
    with pytest.raises(ConnectionFailed):
        await handle.done


@pytest_twisted.ensureDeferred
async def test_a_request_after_close_fails_at_once_unsent(served_on_a_clock):
    # Sent all the same and carried out, it was reported failed: a retried
    # background exec ran twice.
    peer, client, _ = served_on_a_clock
    closed = client.close()
    killed = client.kill(pid=7, signum=15)
    with pytest.raises(ConnectionFailed, match="closed by this client"):
        await killed
    await closed
    assert peer.requests.pending == []


@pytest_twisted.ensureDeferred
async def test_each_close_gets_its_own_deferred(served_on_a_clock):
    _, client, _ = served_on_a_clock
    first, second = client.close(), client.close()
    first.addCallback(lambda _: 1 / 0).addErrback(lambda _: None)
    assert first is not second and first is not client.disconnected
    assert await second is None
    assert await client.close() is None  # (also once closed)


@pytest_twisted.ensureDeferred
async def test_a_producer_without_credit_waits_while_the_transport_is_full(
    served_on_a_clock,
):
    # Never paused without credit: while the service read nothing, 64 MiB
    # piled up in the client's transport, and nothing bounded it.
    peer, client, _ = served_on_a_clock
    handle, producer = await _writing_to_a_service_that_stopped_reading(peer, client)
    peer.transport.resumeProducing()
    await until(lambda: producer.calls == ["pause", "resume"], "resumed once drained")
    await ended_by_close(client, handle.done)


@pytest_twisted.inlineCallbacks
def test_a_held_kill_fails_with_the_connection_s_loss(served):
    # It said ESRCH "never started" while the process may well have: its
    # started could be on the way.
    peer, client = served
    handle, _ = _exec(client)
    killed = handle.kill(15)
    yield peer.requests.get()
    peer.transport.loseConnection()
    with pytest.raises(ConnectionFailed):
        yield killed
    with pytest.raises(ConnectionFailed):  # the exec's own end, and said so
        yield handle.done


@pytest_twisted.inlineCallbacks
def test_a_kill_after_the_process_ended_is_not_sent(served):
    # Sent by the old pid, which may be another unit's by now.
    peer, client = served
    handle, _ = _exec(client)
    request = yield peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 42})
    peer.fail(request, ENODATA)
    yield handle.done
    with pytest.raises(RPCError) as caught:
        yield handle.kill(9)
    assert (caught.value.errnum, str(caught.value)) == (
        errno.ESRCH,
        "kill: pid 42 has ended",
    )
    yield _round_trip(peer, client)  # (the next request is the list's)


@pytest_twisted.inlineCallbacks
def test_stdin_written_after_close_stdin_is_dropped(served):
    # It reached the process only if earlier stdin still waited for credit.
    peer, client = served
    handle, _ = _exec(client, flags=WRITE_CREDIT)
    request = yield peer.requests.get()
    handle.write(b"x" * 5000)  # 4096 go, the rest waits for credit
    handle.close_stdin()
    handle.write(b"AFTER")
    for _ in range(2):  # the first replaces what was borrowed; then room
        peer.respond(request, {"type": "add-credit", "channels": {"stdin": 4096}})
    writes = []
    for _ in range(3):
        writes.append((yield peer.requests.get()))
    data = b"".join(decode_io(w["payload"]["io"])[1] for w in writes)
    assert data == b"x" * 5000
    assert writes[-1]["payload"]["io"]["eof"] is True
    yield ended_by_close(client, handle.done)


@pytest.mark.parametrize(
    ("asked", "answer"),
    [
        ("wait", {}),
        ("wait", {"status": "0"}),
        ("wait", {"status": -1}),
        ("wait", {"output": [], "error": "unkillable"}),
        ("wait", {"output": [], "error": {"errnum": "35", "errstr": "x"}}),
        ("wait", {"status": 0, "output": "abc"}),
        ("wait", {"status": 0, "output": [], "dropped": {"stdout": "x"}}),
        ("wait", {"status": 0, "output": [], "dropped": [3]}),
        ("list", {}),
        ("list", {"procs": "x"}),
        ("list", {"procs": [1]}),
    ],
)
@pytest_twisted.inlineCallbacks
def test_a_wait_or_list_answer_not_of_its_shape_is_eproto(served, asked, answer):
    # Handed on unchecked, the caller met a KeyError later.
    peer, client = served
    pending = client.wait(pid=7) if asked == "wait" else client.list()
    peer.respond((yield peer.requests.get()), answer)
    with pytest.raises(RPCError) as caught:
        yield pending
    assert caught.value.errnum == errno.EPROTO


_PROC = {"pid": 7, "cmd": "sleep", "label": "", "state": "R"}
_DRAIN = STATS_ANSWER["drain"]

#: Answers not of their topic's shape (docs/protocol.md), with what the
#: client's error says: the answer, then the field, then what came.
_MALFORMED_ANSWERS = [
    (
        "list",
        {"rank": 0, "procs": [_PROC] * 3 + [{**_PROC, "pid": "7"}]},
        'procs[3].pid: expected an integer, got "7"',
    ),
    ("list", {"procs": []}, "rank: expected an integer, got none"),
    (
        "list",
        {"rank": 0, "procs": [{**_PROC, "cmdline": "sleep 9"}]},
        'procs[0].cmdline: expected a list, got "sleep 9"',
    ),
    (
        "list",
        {"rank": 0, "procs": [{"pid": 7}]},
        "procs[0].cmd: expected a string, got none",
    ),
    (
        "terminate",
        {**TERMINATING, "step": 3},
        "step: expected a string or null, got 3",
    ),
    ("terminate", {"id": "j1", "step": "term"}, "pid: expected an integer, got none"),
    ("reload", {}, "config: expected a string, got none"),
    (
        "reload",
        {"config": "/c.toml", "warnings": "w"},
        'warnings: expected a list, got "w"',
    ),
    (
        "reload",
        {"config": "/c.toml", "needs-restart": [None]},
        "needs-restart[0]: expected a string, got null",
    ),
    (
        "stats-get",
        {**STATS_ANSWER, "drain": {**_DRAIN, "drained": "no"}},
        'drain.drained: expected a boolean, got "no"',
    ),
    (
        "stats-get",
        {**STATS_ANSWER, "job-exec": {"jobs": {"j1": {**TERMINATING, "pid": None}}}},
        "job-exec.jobs.j1.pid: expected an integer, got null",
    ),
    ("stats-get", {"procs": []}, "requests: expected an object, got none"),
    ("undrain", {"reason": 5}, "reason: expected a string or null, got 5"),
    ("undrain", {"reason": None, "cleared": "x"}, 'cleared: expected a list, got "x"'),
]

#: Each answer's request, made by the client's own call for it.
_ASKED = {
    "list": lambda client: client.list(),
    "terminate": lambda client: client.terminate(jobid="j1"),
    "reload": lambda client: client.reload(),
    "stats-get": lambda client: client.stats(),
    "undrain": lambda client: client.undrain(),
}


@pytest.mark.parametrize(("asked", "answer", "said"), _MALFORMED_ANSWERS)
@pytest_twisted.ensureDeferred
async def test_an_answer_not_of_its_shape_is_eproto_naming_the_field(
    served, asked, answer, said
):
    # Handed on unchecked, a caller's proc["pid"] raised KeyError, or a pid
    # of "7" matched no process; a reload's warnings of "w" were a warning
    # per character.
    peer, client = served
    pending = _ASKED[asked](client)
    peer.respond(await peer.requests.get(), answer)
    with pytest.raises(RPCError) as caught:
        await pending
    assert caught.value.errnum == errno.EPROTO
    assert str(caught.value) == f"the service's {asked} answer: {said}"


@pytest.mark.parametrize(
    ("asked", "answer"),
    [
        ("list", {"rank": 0, "procs": [{**_PROC, "step": None, "future": 1}]}),
        ("terminate", TERMINATING),
        ("reload", {"config": "/c.toml", "warnings": [], "needs-restart": ["x"]}),
        ("stats-get", STATS_ANSWER),
        ("undrain", {"reason": "still", "still": None}),
    ],
)
@pytest_twisted.ensureDeferred
async def test_an_answer_of_its_shape_is_handed_on_as_it_came(served, asked, answer):
    # Fields a newer service adds, and those an older one lacks (an undrain
    # from before its lists), are let through.
    peer, client = served
    pending = _ASKED[asked](client)
    peer.respond(await peer.requests.get(), answer)
    assert await pending == answer


#: How output whose base64 starts "#!" is refused.
_NOT_BASE64 = 'io.data: invalid base64: "#" at offset 0 is not a base64 character'

#: io objects no caller can decode as output (sdexec.ioencode.decode_io, of
#: stdout or stderr), with how the field is named (where "io" is the
#: object's own place in the answer or response).
_MALFORMED_IO = [
    ("abc", 'io: expected an object, got "abc"'),
    ({"rank": "0", "data": "x"}, "io.stream: expected a string, got none"),
    (
        {"stream": "stdin", "rank": "0", "data": "x"},
        'io.stream: expected "stdout" or "stderr", got "stdin"',
    ),
    (
        {"stream": "stdout", "rank": "0", "data": "#!", "encoding": "base64"},
        _NOT_BASE64,
    ),
    (
        {"stream": "stdout", "rank": "0", "data": "x", "encoding": "latin-1"},
        'io.encoding: "latin-1" is not UTF-8 or base64',
    ),
    (
        {"stream": "stderr", "rank": "0", "data": "\udce9"},
        "io.data: not valid Unicode text: lone surrogate U+DCE9 at 0",
    ),
    ({"stream": "stdout", "rank": 0, "data": "x"}, "io.rank: expected a string, got 0"),
    ({"stream": "stdout", "rank": "0", "data": 7}, "io.data: expected a string, got 7"),
]


@pytest.mark.parametrize(
    ("item", "said"),
    [(item, said.replace("io", "wait: output[1]", 1)) for item, said in _MALFORMED_IO],
)
@pytest_twisted.ensureDeferred
async def test_a_wait_answer_s_output_item_a_caller_cannot_decode_is_eproto(
    served, item, said
):
    # Handed on, the item raised in the caller's own decode (a traceback in
    # its callback), or, of another stream, was dropped as not its output.
    peer, client = served
    good = encode_io("stdout", "0", b"ok\n")
    for status_and_error in (False, True):
        pending = client.wait(pid=7, status_and_error=status_and_error)
        request = await peer.requests.get()
        answer = _response(request, payload={**_STATUS, "output": [good, item]})
        # (json's escapes: a lone surrogate is one msgspec will not write.)
        peer.transport.write(json.dumps(answer).encode() + b"\n")
        with pytest.raises(RPCError) as caught:
            await pending
        assert caught.value.errnum == errno.EPROTO
        assert str(caught.value).startswith(said)


def _send_json(peer, request, payload):
    """A response written with json's escapes: a lone surrogate is one
    msgspec will not write."""
    peer.transport.write(json.dumps(_response(request, payload=payload)).encode())
    peer.transport.write(b"\n")


def _decoding(decoded):
    """An ``on_response`` that decodes each output, as a caller does."""

    def on_response(payload):
        if payload["type"] == "output":
            decoded.append(decode_io(payload["io"]))

    return on_response


def _failed_callbacks(events):
    return [e for e in events if "response callback failed" in str(e)]


@pytest.mark.parametrize(
    ("item", "said"),
    [(item, "the service's output response: " + said) for item, said in _MALFORMED_IO],
)
@pytest_twisted.ensureDeferred
async def test_an_output_response_a_caller_cannot_decode_ends_its_stream_eproto(
    served, item, said
):
    # Handed on, it raised in the caller's own decode, which the library
    # logged as "response callback failed": the output was lost, and done
    # fired as for a stream that ended well.
    peer, client = served
    decoded = []
    cmd = {"cmdline": ["true"], "env": {}, "opts": {}, "channels": []}
    handle = client.exec(cmd, STDOUT | sdexec.client.STDERR, _decoding(decoded))
    attached = client.attach(pid=5, on_response=_decoding(decoded))
    streams = [(await peer.requests.get(), "started")]
    streams.append((await peer.requests.get(), "attached"))
    good = {"type": "output", "pid": 5, "io": encode_io("stdout", "0", b"ok\n")}
    with capturedLogs() as events:
        for request, start in streams:
            for payload in (
                {"type": start, "pid": 5, "cmd": ATTACHED_CMD},
                {"type": "output", "pid": 5, "io": item},
                good,  # the rest is handed on
                {"type": "finished", "status": 0},
            ):
                _send_json(peer, request, payload)
            peer.sendMessage(_response(request, errnum=ENODATA))
        for done in (handle.done, attached.done):
            with pytest.raises(RPCError) as caught:
                await done
            assert caught.value.errnum == errno.EPROTO
            assert str(caught.value) == said
    assert decoded == [("stdout", b"ok\n", False)] * 2
    assert _failed_callbacks(events) == []
    assert (handle.pid, attached.pid, attached.status) == (5, 5, 0)


@pytest_twisted.ensureDeferred
async def test_a_kill_after_malformed_output_before_the_start_waits_for_it(served):
    # Only a start without a pid fails a kill asked for before the pid is
    # known: a malformed output is no start.
    peer, client = served
    handle, _ = _exec(client)
    request = await peer.requests.get()
    peer.respond(request, {"type": "output", "pid": 5, "io": "abc"})
    await _round_trip(peer, client)
    held = handle.kill(signal.SIGTERM)
    assert not held.called
    peer.respond(request, {"type": "started", "pid": 5})
    kill = await peer.requests.get()
    assert (kill["topic"], kill["payload"]["pid"]) == ("sdexec.kill", 5)
    peer.respond(kill, {})
    assert await held == {}
    # Then the SIGKILL for the output lost, now that its pid is known.
    assert (await peer.requests.get())["payload"] == _PROTOCOL_KILL
    await ended_by_close(client, handle.done)


#: The kill the library sends the process of a stream that broke the
#: protocol, as Flux's libsubprocess sends it (remote.c).
_PROTOCOL_KILL = {"pid": 5, "signum": signal.SIGKILL, "who": "main"}

#: Responses that break an exec or attach stream while its process runs,
#: with what the stream then ends with.
_BREAKING = [
    (
        {"type": "output", "pid": 5, "io": _MALFORMED_IO[3][0]},
        f"the service's output response: {_NOT_BASE64}",
    ),
    (
        {"type": "add-credit", "channels": {"stdin": "4096"}},
        "the service's add-credit response: channels.stdin: expected an"
        ' integer, got "4096"',
    ),
    (
        {"type": "add-credit", "channels": {"a.b": None}},
        "the service's add-credit response: channels['a.b']: expected an"
        " integer, got null",
    ),
    (
        {"type": "add-credit"},
        "the service's add-credit response: channels: expected an object, got none",
    ),
    (
        {"type": "bogus"},
        "the service's response: type: expected one of add-credit, attached,"
        ' finished, output, started, stopped; got "bogus"',
    ),
    (
        {"pid": 5},
        "the service's response: type: expected one of add-credit, attached,"
        " finished, output, started, stopped; got none",
    ),
]


@pytest.mark.parametrize("attach", [False, True], ids=["exec", "attach"])
@pytest.mark.parametrize(("breaking", "said"), _BREAKING)
@pytest_twisted.ensureDeferred
async def test_a_stream_that_breaks_the_protocol_has_its_process_killed(
    served, attach, breaking, said
):
    # The stream ended EPROTO, and the process ran on, its output unseen;
    # an add-credit of text was ignored, and stdin held for ever. Flux's
    # libsubprocess SIGKILLs it.
    peer, client = served
    seen = []
    if attach:
        handle = client.attach(pid=5, on_response=seen.append)
    else:
        handle, seen = _exec(client, STDOUT | WRITE_CREDIT)
    request = await peer.requests.get()
    start = "attached" if attach else "started"
    with capturedLogs() as events:
        peer.respond(request, {"type": start, "pid": 5, "cmd": ATTACHED_CMD})
        peer.respond(request, breaking)
        kill = await peer.requests.get()
    assert (kill["topic"], kill["payload"]) == ("sdexec.kill", _PROTOCOL_KILL)
    assert [e["log_format"] for e in events if "SIGKILL" in e["log_format"]]
    peer.respond(kill, {})
    peer.respond(request, {"type": "finished", "status": signal.SIGKILL})
    peer.fail(request, ENODATA)
    with pytest.raises(RPCError) as caught:
        await handle.done
    assert (caught.value.errnum, str(caught.value)) == (errno.EPROTO, said)
    assert [payload["type"] for payload in seen] == [start, "finished"]
    if not attach:  # no credit taken from it
        assert handle.credit == sdexec.client.DEFAULT_STDIN_BUFSIZE


@pytest_twisted.ensureDeferred
async def test_a_second_start_without_a_pid_still_kills_the_first_s(served):
    # It took the pid away: the violation found no pid to kill, and the
    # process the first start named ran on, unseen and unkillable by .pid.
    peer, client = served
    handle, _ = _exec(client)
    request = await peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 5})
    peer.respond(request, {"type": "started", "pid": "x"})
    await _round_trip(peer, client)
    listing = client.list()
    assert (await peer.requests.get())["payload"] == _PROTOCOL_KILL  # first
    assert handle.pid == 5
    assert (await peer.requests.get())["topic"] == "sdexec.list"
    peer.fail(request, ENODATA)
    with pytest.raises(RPCError, match='started response: expected a pid, got "x"'):
        await handle.done
    await ended_by_close(client, listing)


@pytest_twisted.ensureDeferred
async def test_a_stream_that_breaks_the_protocol_after_finished_kills_nothing(
    served,
):
    # The process has ended: there is nothing to kill.
    peer, client = served
    handle, _ = _exec(client)
    request = await peer.requests.get()
    peer.respond(request, {"type": "started", "pid": 5})
    peer.respond(request, {"type": "finished", "status": 0})
    peer.respond(request, {"type": "finished", "status": 0})
    peer.respond(request, {"type": "output", "pid": 5, "io": "abc"})
    peer.fail(request, ENODATA)
    with pytest.raises(RPCError, match="a second finished response"):
        await handle.done
    listing = client.list()
    assert (await peer.requests.get())["topic"] == "sdexec.list"  # no kill first
    await ended_by_close(client, listing)


@pytest_twisted.ensureDeferred
async def test_output_handed_on_is_decoded_once(served):
    # The library decoded each output to check it, and the caller's
    # decode_io did it all again (37 us a 64 KiB base64 one).
    peer, client = served
    handle, responses = _exec(client)
    request = await peer.requests.get()
    data = bytes(range(256)) * 256  # no UTF-8: base64
    io = encode_io("stdout", "0", data)
    peer.respond(request, {"type": "started", "pid": 5})
    peer.respond(request, {"type": "output", "pid": 5, "io": io})
    await _round_trip(peer, client)
    handed = responses[-1]["io"]
    assert handed == io and json.loads(json.dumps(handed)) == io
    first = decode_io(handed)
    assert first == ("stdout", data, False)
    assert decode_io(handed)[1] is first[1]  # given again, not decoded again
    handed["data"] = encode_io("stdout", "0", b"\xffchanged")["data"]
    assert decode_io(handed) == ("stdout", b"\xffchanged", False)  # afresh
    await ended_by_close(client, handle.done)


@pytest_twisted.ensureDeferred
async def test_a_wait_s_output_is_decoded_once(served):
    peer, client = served
    data = b"\xff" * 65536
    waiting = client.wait(pid=7)
    request = await peer.requests.get()
    peer.respond(request, {**_STATUS, "output": [encode_io("stderr", "0", data)]})
    (item,) = (await waiting)["output"]
    assert decode_io(item)[1] is decode_io(item)[1] == data


_DROPPED_SAID = "attached: dropped"
_CMD_SAID = "the service's attached response: cmd"

#: ``attached`` fields no caller can use (``None``: the field left out),
#: with what the stream's end says.
_BAD_ATTACHED = [
    *(
        ({"dropped": dropped}, f"{_DROPPED_SAID}{said}")
        for dropped, said in (
            ({"stdout": "x"}, '.stdout: expected a byte count, got "x"'),
            ([3], ": expected an object, got [3]"),
            (0, ": expected an object, got 0"),
            ({"stderr": -1}, ".stderr: expected a byte count, got -1"),
            ({"a b": True}, "['a b']: expected a byte count, got true"),
        )
    ),
    ({"cmd": None}, f"{_CMD_SAID}: expected an object, got none"),
    ({"cmd": "true"}, f'{_CMD_SAID}: expected an object, got "true"'),
    (
        {"cmd": {**ATTACHED_CMD, "cmdline": "true"}},
        f'{_CMD_SAID}.cmdline: expected a list, got "true"',
    ),
    (
        {"cmd": {**ATTACHED_CMD, "env": {"PATH": 5}}},
        f"{_CMD_SAID}.env.PATH: expected a string, got 5",
    ),
]


@pytest.mark.parametrize(("fields", "said"), _BAD_ATTACHED)
@pytest_twisted.ensureDeferred
async def test_an_attached_a_caller_cannot_read_ends_its_stream_eproto(
    served, fields, said
):
    # Handed on: a caller adding the counts, or showing the command line,
    # met a TypeError or KeyError in its own callback, logged, or said "x
    # bytes"; done fired as for a good end.
    peer, client = served
    seen = []

    def on_response(payload):
        seen.append(payload["type"])
        if payload["type"] == "attached":
            sum(payload.get("dropped", {}).values())
            " ".join(payload["cmd"]["cmdline"])

    attached = client.attach(pid=5, on_response=on_response)
    request = await peer.requests.get()
    start = {"type": "attached", "pid": 5, "cmd": ATTACHED_CMD, "dropped": {}}
    start = {
        key: value for key, value in {**start, **fields}.items() if value is not None
    }
    with capturedLogs() as events:
        for payload in (
            start,
            {"type": "output", "pid": 5, "io": encode_io("stdout", "0", b"ok\n")},
            {"type": "finished", "status": 0},
        ):
            peer.respond(request, payload)
        peer.sendMessage(_response(request, errnum=ENODATA))
        with pytest.raises(RPCError) as caught:
            await attached.done
    assert (caught.value.errnum, str(caught.value)) == (errno.EPROTO, said)
    assert (seen, attached.pid, _failed_callbacks(events)) == (
        ["output", "finished"],
        5,
        [],
    )


def test_a_passthrough_exec_of_no_command_object_leaks_no_descriptor(served):
    _, client = served
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="exec: cmd: expected a command object"):
        client.exec(["cat"], STDOUT | WRITE_CREDIT, stdio={"stdout": 1})
    assert set(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("number", ["its own", "a copy"])
def test_a_passthrough_exec_of_the_connection_itself_is_refused(served, number):
    # A daemon started with fd 0 closed had its connection there, and
    # passed it as stdin: the process held the connection open once the
    # client left, and the service never stopped it (review session 43 Z2).
    _, client = served
    own = client.transport.getHandle().fileno()
    fd = own if number == "its own" else os.dup(own)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError) as failure:
        client.exec({"cmdline": ["cat"]}, STDOUT, stdio={"stdout": 1, "stdin": fd})
    assert str(failure.value) == (
        f"exec: stdio: stdin: {fd}: this client's own connection to the service:"
        " its process would keep it open and run on after the client left (open"
        " fds 0-2 before connecting)"
    )
    assert set(os.listdir("/proc/self/fd")) == before  # no copy kept
    assert client._requests._in_flight == {}
    if fd != own:
        os.close(fd)


@pytest_twisted.ensureDeferred
async def test_a_close_behind_a_full_transport_ends_once_it_drains(served_on_a_clock):
    # The client, its transport's producer, was resumed when the buffer
    # drained instead of the close going on: it waited out its grace, its
    # processes ran on meanwhile, the handles' producers were resumed.
    peer, client, _ = served_on_a_clock
    handle, producer = await _writing_to_a_service_that_stopped_reading(peer, client)
    closed = client.close()
    peer.transport.resumeProducing()
    await until(lambda: closed.called, "closed once drained (the clock stands still)")
    assert "resume" not in producer.calls
    await ended_by_close(client, handle.done)


@pytest_twisted.ensureDeferred
async def test_a_kill_not_sent_for_a_lost_connection_says_so(served):
    # ESRCH "never started" while the process (a background one, say) may
    # well be running.
    peer, client = served
    handle, _ = _exec(client)
    await peer.requests.get()
    peer.transport.loseConnection()
    with pytest.raises(ConnectionFailed):
        await handle.done
    with pytest.raises(ConnectionFailed):
        await handle.kill(15)


@pytest_twisted.ensureDeferred
async def test_a_client_closed_before_it_is_connected_closes_once_it_is(tmp_path):
    from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol

    from sdexec.client import SdexecClient

    factory = protocol.Factory.forProtocol(Peer)
    factory.peers = DeferredQueue()
    path = str(tmp_path / "sdexec.sock")
    port = await UNIXServerEndpoint(reactor, path).listen(factory)
    client = SdexecClient(path)
    closed = client.close()
    with pytest.raises(ConnectionFailed, match="closed by this client"):
        await client.list()
    await connectProtocol(UNIXClientEndpoint(reactor, path), client)
    await closed
    await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_a_close_that_completes_leaves_no_timer(served_on_a_clock):
    _, client, clock = served_on_a_clock
    await client.close()
    assert clock.getDelayedCalls() == []


@pytest_twisted.ensureDeferred
async def test_a_close_after_a_race_on_disconnected_closes(served):
    # race() cancels its losers: close() then took the cancelled
    # `disconnected` for a closed connection, closed nothing, and the
    # streaming processes it was to stop ran on.
    peer, client = served
    handle, _ = _exec(client)
    await peer.requests.get()
    elsewhere = client.disconnected  # another caller's
    shutdown = defer.succeed("stop")
    assert await defer.race([shutdown, client.disconnected]) == (0, "stop")
    with pytest.raises(defer.TimeoutError):
        await client.disconnected.addTimeout(0, reactor)
    await client.close()
    with pytest.raises(ConnectionFailed, match="closed by this client"):
        await handle.done
    assert await elsewhere is None  # not cancelled with the others
    assert client._gone_waiters == []  # the cancelled ones were forgotten
    assert await client.disconnected is None


# -- what a request carries (review 40-C) -----------------------------------


def _offline_client():
    """A client on a transport that keeps what is written."""
    from twisted.internet.task import Clock
    from twisted.internet.testing import StringTransport

    from sdexec.client import SdexecClient

    client = SdexecClient("/run/sdexec.sock", Clock())
    client.makeConnection(StringTransport())
    return client


_LANGDIR = os.fsdecode(b"/opt/l\xe9")  # as os.environ holds bytes not UTF-8
_BYTES = "expected text (str), got bytes"


@pytest.mark.parametrize(
    ("cmd", "said"),
    [
        ({"cmdline": [b"/bin/echo", "hi"]}, "cmd.cmdline[0]: " + _BYTES),
        ({"env": {"PATH": b"/bin"}}, "cmd.env.PATH: " + _BYTES),
        ({"env": {b"PATH": "/bin"}}, "cmd.env[b'PATH']: " + _BYTES),
        ({"env": {"A.B": b"/bin"}}, "cmd.env['A.B']: " + _BYTES),
        ({"env": {"": b"x"}}, "cmd.env['']: " + _BYTES),
        ({"env": {"A\nB": b"x"}}, "cmd.env['A\\nB']: " + _BYTES),
        ({"cwd": bytearray(b"/tmp")}, "cmd.cwd: expected text (str), got bytearray"),
        (
            {"opts": {"SDEXEC_PROP_Nice": memoryview(b"5")}},
            "cmd.opts.SDEXEC_PROP_Nice: expected text (str), got memoryview",
        ),
        ({"label": b"job7"}, "cmd.label: " + _BYTES),
        (
            {"opts": {"SDEXEC_TIME_LIMIT": float("nan")}},
            "cmd.opts.SDEXEC_TIME_LIMIT: nan is not a number JSON can carry",
        ),
        (
            {"env": {"LANGDIR": _LANGDIR}},
            "cmd.env.LANGDIR: not valid Unicode text: lone surrogate U+DCE9 at 6",
        ),
        (
            {"cmdline": ["ls", _LANGDIR]},
            "cmd.cmdline[1]: not valid Unicode text: lone surrogate U+DCE9 at 6",
        ),
    ],
)
def test_a_command_that_json_text_would_not_carry_as_meant_is_refused_named(cmd, said):
    # Bytes went out as base64 text (another command, variable or label, run
    # all the same); a surrogate escape raised a UnicodeEncodeError that named
    # neither the field nor the variable.
    client = _offline_client()
    before = set(os.listdir("/proc/self/fd"))
    full = {"cmdline": ["true"], "env": {}, "opts": {}, "channels": [], **cmd}
    with pytest.raises(ValueError) as failure:
        client.exec(full, STDOUT, stdio={"stdout": 1})
    assert str(failure.value) == f"exec: {said}"
    assert type(failure.value) is ValueError
    assert set(os.listdir("/proc/self/fd")) == before  # no descriptor kept
    assert client.transport.value() == b""
    assert client._requests._in_flight == {}


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda c: c.kill(label=b"job7"), "kill: label: " + _BYTES),
        (lambda c: c.wait(label=b"job7"), "wait: label: " + _BYTES),
        (lambda c: c.attach(label=_LANGDIR), "attach: label: not valid Unicode text:"),
        (lambda c: c.terminate(jobid=b"f1"), "terminate: jobid: expected text (str)"),
        (lambda c: c.rpc("sdexec.kill", {b"pid": 1}), "kill: [b'pid']: expected text"),
        (lambda c: c.rpc("sdexec.kill", {"a b": b""}), "kill: ['a b']: expected text"),
    ],
)
def test_a_target_that_json_text_would_not_carry_as_meant_is_refused_named(call, said):
    client = _offline_client()
    with pytest.raises(ValueError) as failure:
        call(client)
    assert str(failure.value).startswith(said)
    assert client.transport.value() == b""


@pytest.mark.parametrize("payload", [[1], None, "pid=1", 7])
def test_a_payload_that_is_not_an_object_is_refused_named(payload):
    # Walking it for text raised an AttributeError ('list' object has no
    # attribute 'items') that named neither the call nor the payload.
    client = _offline_client()
    with pytest.raises(TypeError) as failure:
        client.rpc("sdexec.kill", payload)
    kind = type(payload).__name__
    assert str(failure.value) == f"kill: payload: expected an object (dict), got {kind}"
    assert client.transport.value() == b""
    assert client._requests._in_flight == {}


# -- cancelling a Deferred of the library (review 40-C) ---------------------

_STATUS = {"status": 256, "output": [], "dropped": {"stdout": 0, "stderr": 0}}


def _warnings(events: list[dict]) -> list[str]:
    from twisted.logger import LogLevel, formatEvent

    return [formatEvent(e) for e in events if e["log_level"] == LogLevel.warn]


@pytest_twisted.ensureDeferred
async def test_a_wait_retried_after_a_timeout_takes_the_first_one_over(served):
    # The retry was refused EINVAL (one waiter at a time), and the status,
    # answered to the timed-out wait, was dropped unsaid: lost for good.
    peer, client = served
    with pytest.raises(defer.TimeoutError):
        await client.wait(pid=4242).addTimeout(0, reactor)
    request = await peer.requests.get()
    retry = client.wait(pid=4242)
    assert not retry.called
    with capturedLogs() as events:
        peer.respond(request, _STATUS)
        assert await retry.addTimeout(5, reactor) == _STATUS
    assert _warnings(events) == []  # answered to a caller who waits
    assert peer.requests.pending == []  # no second wait was sent


@pytest_twisted.ensureDeferred
async def test_a_wait_answered_after_its_cancel_is_said_and_kept(served):
    peer, client = served
    with pytest.raises(defer.CancelledError):
        cancelled = client.wait(label="job7")
        cancelled.cancel()
        await cancelled
    request = await peer.requests.get()
    with capturedLogs() as events:
        peer.respond(request, _STATUS)
        await _round_trip(peer, client)
    (warning,) = _warnings(events)
    assert warning.startswith(
        "sdexec: the wait for label 'job7', whose Deferred was cancelled here,"
        " was answered (status 256): kept for this client's next wait() of"
        " label 'job7' (cancelling a Deferred of sdexec.client cancels nothing"
    )
    # Asked afresh (the label may name another process by now), it gets
    # the kept status where the service knows the process no more.
    retry = client.wait(label="job7")
    request = await peer.requests.get()
    assert request["payload"] == {"label": "job7"}
    peer.fail(request, errno.ESRCH, "label 'job7': has ended, and its end went")
    assert await retry.addTimeout(5, reactor) == _STATUS
    later = client.wait(label="job7")  # taken: a later wait asks the service again
    assert (await peer.requests.get())["payload"] == {"label": "job7"}
    await ended_by_close(client, later)


@pytest_twisted.ensureDeferred
async def test_labels_alike_in_their_first_80_characters_are_not_one_wait(served):
    # The cancelled wait was kept under its label cut short for a log: a
    # wait for the other label took it over, sent nothing, and got the
    # first process's status (review session 41 D2).
    peer, client = served
    first, second = "j" * 100 + "1", "j" * 100 + "2"
    cancelled = client.wait(label=first)
    cancelled.addErrback(lambda failure: failure.trap(defer.CancelledError))
    cancelled.cancel()
    await peer.requests.get()
    other = client.wait(label=second)
    assert (await peer.requests.get())["payload"] == {"label": second}
    assert not other.called
    await ended_by_close(client, other)


@pytest_twisted.ensureDeferred
async def test_answers_to_cancelled_waits_are_kept_within_a_bound(served, monkeypatch):
    # A caller that gave up on every wait and never asked again had each
    # answer, output and all, kept for the connection's life (review
    # session 41 D1): past the bound, the oldest goes, said so.
    monkeypatch.setattr(sdexec.client, "MAX_KEPT_WAIT_ANSWERS", 2)
    peer, client = served
    for label in ("a", "b", "c"):
        cancelled = client.wait(label=label)
        cancelled.addErrback(lambda failure: failure.trap(defer.CancelledError))
        cancelled.cancel()
    requests = [await peer.requests.get() for _ in range(3)]
    with capturedLogs() as events:
        for request in requests:
            peer.respond(request, _STATUS)
        await _round_trip(peer, client)
    assert _warnings(events)[-1] == (
        "sdexec: the answer to the wait for label 'a', cancelled here and not"
        " asked for since, is dropped: this client keeps the last 2 such answers"
    )
    for label, kept in (("a", False), ("b", True), ("c", True)):
        retry = client.wait(label=label)
        peer.fail(await peer.requests.get(), errno.ESRCH, "no such process")
        if kept:
            assert await retry.addTimeout(5, reactor) == _STATUS
        else:
            with pytest.raises(RPCError):
                await retry.addTimeout(5, reactor)


@pytest_twisted.ensureDeferred
async def test_a_kept_answer_is_not_another_process_s_with_that_label(served):
    # The label freed once its wait was answered, a new process took it:
    # the kept status was given for it, and its own was never waited for
    # (review session 40 R1). After close(), a wait fails as any request.
    peer, client = served
    cancelled = client.wait(label="prolog")
    cancelled.addErrback(lambda failure: failure.trap(defer.CancelledError))
    cancelled.cancel()
    peer.respond(await peer.requests.get(), _STATUS)
    await _round_trip(peer, client)
    fresh = client.wait(label="prolog")
    newer = {**_STATUS, "status": 0}
    peer.respond(await peer.requests.get(), newer)
    assert await fresh.addTimeout(5, reactor) == newer
    cancelled = client.wait(pid=77)
    cancelled.addErrback(lambda failure: failure.trap(defer.CancelledError))
    cancelled.cancel()
    peer.respond(await peer.requests.get(), _STATUS)
    await _round_trip(peer, client)
    await client.close()
    with pytest.raises(ConnectionFailed):
        await client.wait(pid=77)


async def _cancelled_wait(peer, client, label: str) -> dict:
    """A wait for ``label``, cancelled; its request."""
    cancelled = client.wait(label=label)
    cancelled.addErrback(lambda failure: failure.trap(defer.CancelledError))
    cancelled.cancel()
    return await peer.requests.get()


@pytest_twisted.ensureDeferred
async def test_a_kept_answer_outlives_a_wait_cancelled_that_carried_it(served):
    # The kept status rode on the next wait's Deferred alone: that wait
    # cancelled in turn, its ESRCH (the kept answer had consumed the
    # process) was kept instead, and the status was lost unsaid.
    peer, client = served
    peer.respond(await _cancelled_wait(peer, client, "job7"), _STATUS)
    await _round_trip(peer, client)
    peer.fail(await _cancelled_wait(peer, client, "job7"), errno.ESRCH, "not found")
    await _round_trip(peer, client)
    retry = client.wait(label="job7")
    peer.fail(await peer.requests.get(), errno.ESRCH, "not found")
    assert await retry.addTimeout(5, reactor) == _STATUS


@pytest_twisted.ensureDeferred
async def test_a_wait_taking_over_one_that_carried_a_kept_answer_gets_it(served):
    peer, client = served
    peer.respond(await _cancelled_wait(peer, client, "job7"), _STATUS)
    await _round_trip(peer, client)
    request = await _cancelled_wait(peer, client, "job7")
    retry = client.wait(label="job7")  # takes the pending one over
    peer.fail(request, errno.ESRCH, "not found")
    assert await retry.addTimeout(5, reactor) == _STATUS


@pytest.mark.parametrize("cancelled", [True, False])
@pytest_twisted.ensureDeferred
async def test_a_kept_answer_another_answer_replaces_is_said(served, cancelled):
    # The label now names another process, whose status the service gave
    # the next wait: the kept one, never seen by a caller, went unsaid.
    peer, client = served
    peer.respond(await _cancelled_wait(peer, client, "job7"), _STATUS)
    await _round_trip(peer, client)
    newer = {**_STATUS, "status": 0}
    if cancelled:
        request = await _cancelled_wait(peer, client, "job7")
    else:
        fresh = client.wait(label="job7")
        request = await peer.requests.get()
    with capturedLogs() as events:
        peer.respond(request, newer)
        await _round_trip(peer, client)
    if not cancelled:
        assert await fresh == newer
    assert _warnings(events)[0] == (
        "sdexec: the answer kept for the wait for label 'job7' (status 256),"
        " cancelled here, is dropped: the service answered a later wait of"
        " label 'job7' with status 0"
    )
    retry = client.wait(label="job7")
    peer.fail(await peer.requests.get(), errno.ESRCH, "not found")
    if cancelled:  # the newer answer is the one kept now
        assert await retry.addTimeout(5, reactor) == newer
    else:
        with pytest.raises(RPCError):
            await retry.addTimeout(5, reactor)


@pytest_twisted.ensureDeferred
async def test_a_wait_may_ask_for_the_status_beside_a_late_error(served):
    # By default the service answers that error alone, as upstream's does
    # (review session 40 P F3); the extension is the caller's to ask for.
    peer, client = served
    asked = client.wait(label="job7", status_and_error=True)
    request = await peer.requests.get()
    assert request["payload"] == {"label": "job7", "status_and_error": True}
    answer = {**_STATUS, "error": {"errnum": 35, "errstr": "unkillable"}}
    peer.respond(request, answer)
    assert await asked.addTimeout(5, reactor) == answer
    with capturedLogs() as events:  # its target is still named alone
        cancelled = client.wait(label="job8", status_and_error=True)
        cancelled.cancel()
        cancelled.addErrback(lambda failure: failure.trap(defer.CancelledError))
        peer.respond(await peer.requests.get(), _STATUS)
        await _round_trip(peer, client)
    (warning,) = _warnings(events)
    assert warning.startswith("sdexec: the wait for label 'job8', whose Deferred")


@pytest_twisted.ensureDeferred
async def test_a_wait_for_what_ended_unkillable_gets_the_output_and_no_status(
    served,
):
    # A job declared unkillable ends before `finished`: the answer with
    # status_and_error carries its output and the error, no status, which
    # was refused as EPROTO "expected a wait status" (review session 42 T).
    peer, client = served
    asked = client.wait(label="job9", status_and_error=True)
    answer = {
        "output": [{"stream": "stderr", "rank": "0", "data": "ignoring TERM\n"}],
        "dropped": {"stdout": 0, "stderr": 0},
        "error": {"errnum": errno.EDEADLK, "errstr": "unkillable user processes"},
    }
    peer.respond(await peer.requests.get(), answer)
    assert await asked.addTimeout(5, reactor) == answer


@pytest_twisted.ensureDeferred
async def test_a_background_start_after_its_cancel_names_the_pid(served):
    # Its started was dropped unsaid: a process ran with nobody tracking it.
    peer, client = served
    handle = client.exec({"cmdline": ["sleep", "1d"]}, STDOUT, background=True)
    with pytest.raises(defer.TimeoutError):
        await handle.done.addTimeout(0, reactor)
    request = await peer.requests.get()
    with capturedLogs() as events:
        peer.respond(request, {"type": "started", "pid": 4243})
        await _round_trip(peer, client)
    (warning,) = _warnings(events)
    assert warning.startswith(
        f"sdexec: background exec {handle.matchtag}, whose Deferred was cancelled"
        " here, started as pid 4243: it runs on, and nothing here tracks it"
    )


@pytest_twisted.ensureDeferred
async def test_any_answer_after_its_cancel_is_said_but_not_a_loss(served):
    peer, client = served
    killed = client.kill(pid=4244)
    listed = client.list()
    killed.cancel()
    listed.cancel()
    kill = await peer.requests.get()
    await peer.requests.get()
    with capturedLogs() as events:
        peer.fail(kill, errno.ESRCH, "no pid 4244")
        await _round_trip(peer, client)
        await client.close()  # the list's end: a loss, which answers nothing
    for cancelled in (killed, listed):
        with pytest.raises(defer.CancelledError):
            await cancelled
    (warning,) = _warnings(events)
    assert warning.startswith(
        'sdexec: sdexec.kill {"pid": 4244, "signum": 15, "who": "main"}, whose'
        " Deferred was cancelled here, was answered: no pid 4244 (ESRCH) (cancelling"
    )


@pytest_twisted.ensureDeferred
async def test_an_error_answered_after_a_cancel_is_logged_with_its_errno(served):
    # The service's words alone: an admin could not tell EDEADLK (a job
    # declared unkillable, the node drained) from any other error.
    peer, client = served
    waited = client.wait(label="job7")
    handle, _ = _exec(client)
    for cancelled in (waited, handle.done):
        cancelled.addErrback(lambda failure: failure.trap(defer.CancelledError))
        cancelled.cancel()
    wait, start = await peer.requests.get(), await peer.requests.get()
    with capturedLogs() as events:
        peer.fail(wait, errno.EDEADLK, "unkillable user processes for job f1")
        peer.respond(start, {"type": "started", "pid": 4247})
        peer.fail(start, errno.EDEADLK, "unkillable user processes for job f2")
        await _round_trip(peer, client)
    cancelled = " whose Deferred was cancelled here,"
    assert [warning.split(" (cancelling")[0] for warning in _warnings(events)] == [
        f"sdexec: the wait for label 'job7',{cancelled} was answered (error:"
        " unkillable user processes for job f1 (EDEADLK)): kept for this"
        " client's next wait() of label 'job7'",
        f"sdexec: exec {handle.matchtag} (pid 4247),{cancelled} ended:"
        " unkillable user processes for job f2 (EDEADLK)",
    ]
    assert rpc.with_errno_name(RPCError(4000, "no such errno")) == (
        "no such errno (errno 4000)"
    )
    assert rpc.errno_name(errno.EOPNOTSUPP) == "EOPNOTSUPP"  # not ENOTSUP


@pytest_twisted.ensureDeferred
async def test_a_kill_held_for_started_and_cancelled_has_its_answer_said(served):
    # Held for the pid, the kill's Deferred was the caller's alone: its
    # answer, once sent, was dropped unsaid.
    peer, client = served
    handle, _ = _exec(client)
    request = await peer.requests.get()
    killed = handle.kill(signal.SIGTERM)
    killed.cancel()
    with pytest.raises(defer.CancelledError):
        await killed
    peer.respond(request, {"type": "started", "pid": 4246})
    kill = await peer.requests.get()
    assert kill["payload"] == {"pid": 4246, "signum": 15, "who": "main"}
    with capturedLogs() as events:
        peer.fail(kill, errno.ESRCH, "no pid 4246")
        await _round_trip(peer, client)
    (warning,) = _warnings(events)
    assert warning.startswith(
        'sdexec: sdexec.kill {"pid": 4246, "signum": 15, "who": "main"}, whose'
        " Deferred was cancelled here, was answered: no pid 4246 (ESRCH) (cancelling"
    )
    peer.respond(request, {"type": "finished", "status": 0})
    peer.sendMessage(_response(request, errnum=ENODATA))
    await handle.done  # (left to the connection's end, it was an unhandled error)


@pytest_twisted.ensureDeferred
async def test_an_attach_s_end_after_its_cancel_is_said(served):
    # docs/client.md: any answer to a cancelled call is logged, not dropped
    # unsaid; an attach's end (ENOBUFS: it fell behind) was dropped. Its
    # output is the caller's no more: on_response was still called with it,
    # for as long as the process ran (RFC 42 has no detach).
    peer, client = served
    responses: list[dict] = []
    attached = client.attach(pid=4245, on_response=responses.append)
    request = await peer.requests.get()
    first = {"type": "attached", "pid": 4245, "cmd": ATTACHED_CMD}
    peer.respond(request, first)
    await _round_trip(peer, client)
    attached.done.cancel()
    with pytest.raises(defer.CancelledError):
        await attached.done
    output = {"type": "output", "io": encode_io("stdout", "0", b"late\n")}
    with capturedLogs() as events:
        peer.respond(request, output)
        peer.respond(request, {"type": "finished", "status": 0})
        peer.fail(request, errno.ENOBUFS, "fell behind by 9 bytes")
        await _round_trip(peer, client)
    assert responses == [first]
    (warning,) = _warnings(events)
    assert warning.startswith(
        "sdexec: the attach to pid 4245, whose Deferred was cancelled here,"
        " ended: fell behind by 9 bytes (ENOBUFS) (status 0) (cancelling"
    )


# -- connecting (review 40-C) ------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_service_whose_backlog_is_full_is_said_at_once_in_one_line(tmp_path):
    # Twisted's connector said "[Failure instance: ...ConnectionDone...
    # closed cleanly.\n]" (epoll), or "User timeout caused connection
    # failure." 30 s later (asyncio).
    path = str(tmp_path / "full.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(0)
        queued = []
        while True:  # fill its backlog: the next connect is EAGAIN
            waiting = socket.socket(socket.AF_UNIX)
            waiting.setblocking(False)
            queued.append(waiting)
            if waiting.connect_ex(path) == errno.EAGAIN:
                break
        connecting = connect(reactor, path)
        assert connecting.called
        with pytest.raises(ConnectionFailed) as failure:
            await connecting
        for waiting in queued:
            waiting.close()
    assert str(failure.value) == (
        f"cannot connect to {path}: the service is not accepting connections"
        " now: its listen backlog is full (EAGAIN); try again"
    )


@pytest_twisted.ensureDeferred
async def test_a_connection_sends_descriptors_with_its_first_bytes(tmp_path):
    # connect() connects the socket itself and hands it to the reactor:
    # its transport must still pass descriptors (stdio passthrough).
    path = str(tmp_path / "sdexec.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(1)
        client = await connect(reactor, path)
        served, _ = listener.accept()
    read_end, write_end = os.pipe()
    handle = client.exec({"cmdline": ["true"]}, STDOUT, stdio={"stdout": write_end})
    with served:
        served.setblocking(False)
        await until(lambda: _readable(served), "the exec sent")
        data, fds, _, _ = socket.recv_fds(served, 65536, 4)
        assert (data, len(fds)) == (b"{", 1)  # as Twisted sends them
        assert os.path.sameopenfile(fds[0], write_end)
        assert b'"stdio":["stdout"]' in served.recv(65536)
        for fd in (*fds, read_end, write_end):
            os.close(fd)
        await client.close()
    with pytest.raises(ConnectionFailed):
        await handle.done


def _readable(connection: socket.socket) -> bool:
    try:
        return bool(connection.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False


def test_the_public_api_types_payloads_as_json_objects():
    # Bare dict read as dict[Any, Any] to a user's mypy --strict: payload[1]
    # passed unseen.
    from typing import Any, get_type_hints

    from twisted.internet.defer import Deferred

    from sdexec.client import ExecHandle, SdexecClient

    answer = Deferred[dict[str, Any]]
    for method in (SdexecClient.rpc, SdexecClient.list, SdexecClient.wait):
        assert get_type_hints(method)["return"] == answer
    on_response = get_type_hints(SdexecClient.exec)["on_response"]
    assert on_response.__args__[0] == dict[str, Any]
    assert get_type_hints(ExecHandle.kill)["return"] == answer


#: What a typed program does with the library beyond docs/client.md's
#: example (which :func:`test_a_typed_program_of_the_documented_calls_checks`
#: puts before it): stdin from a reused buffer, as a ``readinto`` loop has,
#: and the constants the docs name.
TYPED_PROGRAM_TAIL = """
    buffer = bytearray(b"input")
    handle.write(buffer)
    handle.write(memoryview(buffer)[:2])
    # Output paced as the docs spell it typed (client.transport is an
    # ITransport, which has no pauseProducing, to mypy).
    from twisted.internet.interfaces import IPushProducer
    IPushProducer(client.transport).pauseProducing()
    IPushProducer(client.transport).resumeProducing()
    # Chunks sized as the library's writes, by the constant the docs name
    # beside them (imported by sdexec.client, it was not re-exported).
    from sdexec.client import WRITE_PIECE
    handle.write(bytes(WRITE_PIECE))
"""


def _library_example() -> str:
    """docs/client.md's first example of "The library", as the body of an
    ``async def`` (it awaits at its top level)."""
    text = (REPO / "docs" / "client.md").read_text()
    section = text.split("\n## The library\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    imports = [line for line in code.splitlines() if line.startswith("from ")]
    body = [line for line in code.splitlines() if line and line not in imports]
    return "\n".join([*imports, "", "", "async def main() -> None:"] + [
        "    " + line for line in body
    ])  # fmt: skip


def test_a_typed_program_of_the_documented_calls_checks(tmp_path):
    # connect() was typed to take an IReactorSocket, which Twisted's global
    # reactor is not typed as: the documented connect(reactor, path) failed
    # a user's mypy --strict, and so did write() of a bytearray, which it
    # takes (and copies).
    _assert_mypy_strict_passes(tmp_path, _library_example() + TYPED_PROGRAM_TAIL)


#: docs/client.md's offline recipe ("Testing a program offline"), typed,
#: its steps in a function rather than trial's (whose own methods are
#: untyped), and the managers as the server's code types them.
TYPED_OFFLINE_PROGRAM = """
import os

from twisted.internet import reactor
from twisted.internet.interfaces import IReactorUNIX
from twisted.internet.task import Clock

from sdexec.client import STDOUT, connect
from sdexec.config import parse_config
from sdexec.connection import SdexecServerFactory
from sdexec.server import SdexecServer
from sdexec.systemd import Manager
from sdexec.systemd.bus import SystemdClient
from sdexec.testing import FakeManager


async def offline(path: str) -> int | None:
    manager = FakeManager()
    manager.stop_to_inactive = True
    server = SdexecServer(manager, parse_config({}), reactor, clock=Clock())
    port = IReactorUNIX(reactor).listenUNIX(path, SdexecServerFactory(server))
    client = await connect(reactor, path)
    handle = client.exec({"cmdline": ["hostname"]}, STDOUT)
    unit = await manager.started()
    manager.run(unit, pid=1234)
    os.write(manager.process_fd(unit, "stdout"), b"node1\\n")
    manager.end(unit, status=3)
    await handle.done
    await client.close()
    await server.shutdown(5)
    port.stopListening()
    manager.close()
    return handle.pid


def the_service_s(systemd: SystemdClient) -> Manager:
    return systemd
"""


def test_a_typed_offline_test_of_the_documented_recipe_checks(tmp_path):
    # Manager declared calls_answered a settable member, which both
    # managers make a property: mypy refused every one of them, and a
    # typed test's SdexecServer(FakeManager(), ...), as the docs build it,
    # failed a user's mypy --strict.
    _assert_mypy_strict_passes(tmp_path, TYPED_OFFLINE_PROGRAM)


def _assert_mypy_strict_passes(tmp_path, text: str) -> None:
    """``mypy --strict`` (with the zope plugin, as a Twisted program's)
    finds nothing in the program ``text``, which imports this checkout."""
    program = tmp_path / "user.py"
    program.write_text(text)
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nplugins = mypy_zope:plugin\n")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--config-file", str(config), str(program)],
        capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert checked.returncode == 0, program.read_text() + checked.stdout


def test_connect_refuses_a_reactor_without_sockets_by_name(tmp_path):
    # Typed to take the global reactor's common interfaces, it checks the
    # socket one itself, whatever is at the path (a Clock failed only where
    # a socket listened: AttributeError, adoptStreamConnection).
    from twisted.internet.task import Clock

    with pytest.raises(
        TypeError, match="connect: reactor: expected a POSIX reactor, got Clock"
    ):
        connect(Clock(), str(tmp_path / "sock"))
