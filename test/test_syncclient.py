"""The command line's synchronous client against a scripted peer on a real
unix socket: what it makes of a service that refuses or misbehaves (the
real service is in test_cli.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sdexec import rpc
from sdexec.rpc import ConnectionFailed, RPCError, cannot_connect
from sdexec.syncclient import READABLE, Connection, Exec, Loop
from sdexec.wire import MAX_VALUES, FrameSplitter, encode_message


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[str, list[bytes], list[dict]]]:
    """A listening socket that reads one request, answers with the lines
    the test puts in ``replies``, then closes; ``received`` gets what it
    read."""
    path = str(tmp_path / "peer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    replies: list[bytes] = []
    received: list[dict] = []

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            splitter = FrameSplitter()
            while not received:
                received.extend(splitter.feed(connection.recv(65536)))
            connection.sendall(b"".join(replies))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, replies, received
    thread.join(10)
    server.close()


def test_a_call_gets_its_response(peer):
    path, replies, received = peer
    replies.append(b'{"type":"response","topic":"sdexec.list","matchtag":1,')
    replies.append(b'"payload":{"rank":0,"procs":[]}}\n')
    with Loop() as loop, Connection(loop, path) as connection:
        assert connection.call("sdexec.list", {}) == {"rank": 0, "procs": []}
    assert received[0]["topic"] == "sdexec.list"
    assert received[0]["matchtag"] == 1


def test_the_reason_for_closing_is_the_error(peer):
    path, replies, _ = peer
    refusal = {"type": "response", "matchtag": 0, "errnum": errno.EPERM}
    replies.append(encode_message({**refusal, "errstr": "not yours"}))
    with (
        Loop() as loop,
        Connection(loop, path) as connection,
        pytest.raises(RPCError) as raised,
    ):
        connection.call("sdexec.list", {})
    assert (raised.value.errnum, str(raised.value)) == (errno.EPERM, "not yours")


def test_an_answer_of_more_values_than_a_request_may_hold_is_read(peer):
    # A list of thousands of processes may: the service bounds requests,
    # the frame size bounds what the client reads.
    path, replies, _ = peer
    proc = {"pid": 7, "cmd": "", "label": "", "state": "R"}  # 5 values
    listed = {"rank": 0, "procs": [proc] * (MAX_VALUES // 4)}
    answer = {"type": "response", "topic": "sdexec.list", "matchtag": 1}
    replies.append(encode_message({**answer, "payload": listed}))
    with Loop() as loop, Connection(loop, path) as connection:
        assert connection.call("sdexec.list", {}) == listed


def test_a_refusal_before_the_first_write_is_still_the_reason(tmp_path):
    # The service refuses a user it does not serve as it connects: answer
    # and close before the client writes. The write then fails (EPIPE),
    # and the client reported "Broken pipe", the EPERM unread.
    path = str(tmp_path / "refusing.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(1)
    with Loop() as loop, Connection(loop, path) as connection:
        accepted, _ = listening.accept()
        refusal = {"type": "response", "matchtag": 0, "errnum": errno.EPERM}
        accepted.sendall(encode_message({**refusal, "errstr": "not yours"}))
        accepted.close()
        with pytest.raises(RPCError) as raised:
            connection.call("sdexec.list", {})
    listening.close()
    assert (raised.value.errnum, str(raised.value)) == (errno.EPERM, "not yours")


def test_a_bad_message_breaks_the_connection_with_one_line(peer):
    path, replies, _ = peer
    replies.append(b"this is not json\n")
    with (
        Loop() as loop,
        Connection(loop, path) as connection,
        pytest.raises(ConnectionFailed, match="bad message from sdexec"),
    ):
        connection.call("sdexec.list", {})


def test_nothing_listening_names_the_path(tmp_path):
    path = str(tmp_path / "nothing.sock")
    with Loop() as loop, pytest.raises(ConnectionFailed, match=r"nothing\.sock"):
        Connection(loop, path)


def test_passed_descriptors_go_with_the_first_bytes_of_a_large_frame(tmp_path):
    # A frame larger than the socket takes at once: the descriptors travel
    # with its first part only (docs/protocol.md, stdio passthrough).
    path = str(tmp_path / "peer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    reads: list[tuple[int, int]] = []  # (offset of the read, descriptors)
    frame = bytearray()

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            while not frame.endswith(b"\n"):
                data, fds, _flags, _ = socket.recv_fds(connection, 65536, 8)
                reads.append((len(frame), len(fds)))
                frame.extend(data)
                for fd in fds:
                    os.close(fd)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    read_end, write_end = os.pipe()
    cmd = {"cmdline": ["true"], "env": {"BIG": "x" * (4 << 20)}}
    with Loop() as loop, Connection(loop, path) as connection:
        stdio = {"stdout": write_end, "stderr": 2}
        stream = connection.exec(cmd, 0, lambda _: None, stdio)
        loop.run_until(lambda: stream.ended)  # the peer closes once it has all
    thread.join(30)
    server.close()
    os.close(read_end)
    os.close(write_end)
    assert [count for _, count in reads if count] == [2]
    assert reads[0] == (0, 2)
    assert len(reads) > 1  # the frame did span reads
    request = FrameSplitter(8 << 20).feed(bytes(frame))
    assert next(request)["payload"]["stdio"] == ["stdout", "stderr"]


def test_a_write_to_a_peer_that_left_is_connection_failed(tmp_path):
    # The failed write closed the socket, then watching it again raised
    # ValueError (fd -1) past every caller's SdexecError handling.
    path = str(tmp_path / "peer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def read_a_little_and_leave() -> None:
        peer, _ = server.accept()
        peer.recv(10)
        peer.close()  # unread data: the client's next write fails

    leaver = threading.Thread(target=read_a_little_and_leave)
    leaver.start()
    with (
        Loop() as loop,
        Connection(loop, path) as connection,
        pytest.raises(ConnectionFailed),
    ):
        connection.call("sdexec.list", {"big": "x" * (8 << 20)})
    leaver.join()
    server.close()


def test_a_request_a_callback_sends_to_a_peer_gone_loses_nothing_received(tmp_path):
    # `sdexec run` forwards a Ctrl-C held for the start from the `started`
    # callback. The service had sent the whole stream and closed: the
    # kill's failed write read the rest at once, inside the dispatch of
    # `started`, and lost every later message of that read (the output,
    # `finished`): run printed nothing and exited 1.
    path = str(tmp_path / "peer.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def response(**fields) -> bytes:
        return encode_message(
            {"type": "response", "topic": "sdexec.exec", "matchtag": 1, **fields}
        )

    output = {"stream": "stdout", "rank": "0", "data": "hello\n"}
    stream_then_close = b"".join([
        response(payload={"type": "started", "pid": 42}),
        response(payload={"type": "output", "pid": 42, "io": output}),
        response(payload={"type": "finished", "status": 0}),
        response(errnum=errno.ENODATA, errstr=""),
    ])  # fmt: skip
    seen: list[str] = []
    with Loop() as loop, Connection(loop, path) as connection:

        def on_response(payload: dict) -> None:
            seen.append(payload["type"])
            if payload["type"] == "started":
                connection.kill_unit(15, 42, _Ignored())

        stream = connection.exec({"cmdline": ["true"]}, 3, on_response)
        accepted, _ = server.accept()
        accepted.recv(65536)  # the exec
        accepted.sendall(stream_then_close)
        accepted.close()  # before the client reads any of it
        loop.run_until(lambda: stream.ended)
    server.close()
    assert seen == ["started", "output", "finished"]
    assert stream.error is None


@pytest.mark.parametrize("fd", ["closed", 2**40, "1"])
def test_a_stdio_descriptor_not_open_is_refused_before_anything_is_sent(peer, fd):
    # As the Twisted client refuses it. Sent, a closed one failed the write
    # and with it the connection; one past a C int stayed at the head of
    # the queue and failed every later request.
    path, replies, received = peer
    replies.append(
        encode_message(
            {"type": "response", "matchtag": 1, "payload": {"rank": 0, "procs": []}}
        )
    )
    with Loop() as loop, Connection(loop, path) as connection:
        if fd == "closed":
            fd = _a_closed_descriptor()
        with pytest.raises(ValueError, match=rf"^exec: stdio: stdout: {fd!r}: "):
            connection.exec({"cmdline": ["true"]}, 3, print, {"stdout": fd})
        assert connection.call("sdexec.list", {}) == {"rank": 0, "procs": []}
    assert [message["topic"] for message in received] == ["sdexec.list"]


def _a_closed_descriptor() -> int:
    """A descriptor number not open, and not soon to be: the highest the
    process may have. (A pipe's, closed, was taken again by the peer's
    thread as it accepted, under load.)"""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd = soft - 1
    with pytest.raises(OSError):
        os.fstat(fd)
    return fd


@pytest.mark.parametrize("number", ["its own", "a copy"])
def test_a_stdio_descriptor_that_is_the_connection_is_refused(peer, number):
    # A daemon started with fd 0 closed had its connection there, and
    # passed it as stdin: the process held the connection open once the
    # client left, and the service never stopped it (review session 43 Z2).
    path, replies, received = peer
    replies.append(
        encode_message(
            {"type": "response", "matchtag": 1, "payload": {"rank": 0, "procs": []}}
        )
    )
    with Loop() as loop, Connection(loop, path) as connection:
        own = connection._sock.fileno()
        fd = own if number == "its own" else os.dup(own)
        with pytest.raises(ValueError) as failure:
            connection.exec({"cmdline": ["cat"]}, 3, print, {"stdin": fd})
        assert str(failure.value) == (
            f"exec: stdio: stdin: {fd}: this client's own connection to the"
            " service: its process would keep it open and run on after the client"
            " left (open fds 0-2 before connecting)"
        )
        assert connection.call("sdexec.list", {}) == {"rank": 0, "procs": []}
        if fd != own:
            os.close(fd)
    assert [message["topic"] for message in received] == ["sdexec.list"]


class _Ignored:
    streaming = False

    def respond(self, payload: dict) -> None:
        pass

    def end(self, error: Exception) -> None:
        pass


def test_a_request_that_is_not_json_is_not_tracked(peer):
    path, replies, received = peer
    reply = {"type": "response", "topic": "sdexec.list", "matchtag": 2}
    replies.append(encode_message({**reply, "payload": {"rank": 0, "procs": []}}))
    with Loop() as loop, Connection(loop, path) as connection:
        with pytest.raises(ValueError):
            connection.send("sdexec.list", {"x": float("nan")}, _Ignored())
        assert connection._requests._in_flight == {}  # nothing left waiting
        assert connection.call("sdexec.list", {}) == {"rank": 0, "procs": []}
    assert [request["matchtag"] for request in received] == [2]


def test_cannot_connect_says_what_to_do(tmp_path, monkeypatch):
    path = str(tmp_path / "sdexec.sock")
    monkeypatch.setattr(rpc, "SYSTEM_SOCKET", str(tmp_path / "none.sock"))
    assert str(cannot_connect(path, errno.ENOENT)) == (
        f"cannot connect to {path}: No such file or directory"
        " (is the sdexec service running?)"
    )
    system = tmp_path / "system.sock"
    system.touch()  # the system unit serves, elsewhere than asked
    monkeypatch.setattr(rpc, "SYSTEM_SOCKET", str(system))
    assert str(cannot_connect(path, errno.ECONNREFUSED)) == (
        f"cannot connect to {path}: Connection refused (is the sdexec service"
        f" running? the system unit's socket is {system}: give --socket or"
        " $SDEXEC_SOCKET)"
    )
    assert str(cannot_connect(path, errno.EACCES)).endswith(
        "Permission denied (another user's service: each serves its owner and"
        " its [sdexec] allow-users)"
    )


def test_a_socket_path_that_is_not_utf8_is_named_by_its_bytes(tmp_path):
    # `sdexec --socket $'/tmp/s\xff.sock' ps` said "/tmp/s\udcff.sock", a
    # character the path does not hold, for its byte 0xff.
    path = os.fsdecode(os.fsencode(tmp_path) + b"/s\xff.sock")
    with Loop() as loop, pytest.raises(ConnectionFailed) as failure:
        Connection(loop, path)
    assert str(failure.value).startswith(
        f"cannot connect to {tmp_path}/s\\xff.sock: No such file or directory"
    )


def test_a_socket_path_that_is_no_socket_or_too_long_is_named(tmp_path):
    # Said "Connection refused (is the sdexec service running?)" and
    # "AF_UNIX path too long" without sizes (review 38 A2).
    with Loop() as loop, pytest.raises(ConnectionFailed) as directory:
        Connection(loop, str(tmp_path))
    assert str(directory.value) == (
        f"cannot connect to {tmp_path}: Connection refused ({tmp_path} is a"
        " directory, not a socket)"
    )
    long = "/" + "s" * 107
    with Loop() as loop, pytest.raises(ConnectionFailed) as too_long:
        Connection(loop, long)
    assert str(too_long.value) == (
        f"cannot connect to {long}: AF_UNIX path too long (108 bytes, at most 107)"
    )


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda path: os.symlink("/dev/null", path), "a character device"),
        (os.mkfifo, "a FIFO"),
        (lambda path: open(path, "w").close(), "a file"),
    ],
)
def test_a_socket_path_names_what_it_is(tmp_path, make, what):
    # `--socket /dev/null` said "/dev/null is a file, not a socket".
    path = str(tmp_path / "sdexec.sock")
    make(path)
    with Loop() as loop, pytest.raises(ConnectionFailed) as failure:
        Connection(loop, path)
    assert str(failure.value) == (
        f"cannot connect to {path}: Connection refused ({path} is {what}, not a socket)"
    )


def test_true_is_no_pid():
    # JSON's true decodes to a bool, which Python takes for the int 1: a
    # broken service's `started` pid true was kept, as sdexec.client's was
    # (review session 45).
    stream = Exec({"cmdline": ["true"]}, 0, lambda payload: None, rpc.Requests("/s"))
    stream.respond({"type": "started", "pid": True})
    assert stream.pid is None
    stream.respond({"type": "started", "pid": 42})
    assert stream.pid == 42


@pytest.fixture
def usr_signals() -> Iterator[None]:
    """SIGUSR1 and SIGUSR2 handled as they were before the test."""
    saved = {signum: signal.getsignal(signum) for signum in _USR}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


_USR = (signal.SIGUSR1, signal.SIGUSR2)


@pytest.mark.usefixtures("usr_signals")
def test_a_signal_after_a_flood_unserved_past_the_wakeup_pipe_is_served():
    # The loop read signals from its wakeup pipe, whose bytes past 64 KiB
    # unread are dropped: a SIGTERM that `run` got after a flood of SIGUSR1
    # was never forwarded. Each is now served once per turn, the flood as
    # one, and the signal after it kept (a signal sent to ourselves is
    # delivered before kill() returns: these all come before the turn).
    pipe_bytes = 64 * 1024  # a pipe's default capacity (16 pages)
    served: list[int] = []
    with Loop() as loop:
        loop.catch_signals(_USR, served.append)
        for _ in range(2 * pipe_bytes):
            os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        loop.serve_caught_signals()
        assert served == [signal.SIGUSR1, signal.SIGUSR2]
        # Nothing is left to serve: the loop sleeps until the next.
        loop.serve_caught_signals()
        assert served == [signal.SIGUSR1, signal.SIGUSR2]


@pytest.mark.usefixtures("usr_signals")
def test_a_loop_puts_back_the_wakeup_fd_it_found():
    # Reset to none at close: an asyncio loop in the same process (this
    # test's own Twisted reactor) slept through its signals, a spawned
    # child's SIGCHLD among them, and the next test to wait for one hung.
    readable, writable = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    before = signal.set_wakeup_fd(writable)
    try:
        with Loop() as loop:
            loop.catch_signals(_USR, lambda signum: None)
    finally:
        found = signal.set_wakeup_fd(before)
        os.close(readable)
        os.close(writable)
    assert found == writable


def _full_pipe() -> tuple[int, int]:
    """A pipe whose write end, non-blocking, takes nothing more."""
    readable, writable = os.pipe()
    os.set_blocking(writable, False)
    try:
        while True:
            os.write(writable, b"x" * 65536)
    except BlockingIOError:
        return readable, writable


def test_an_output_wait_serves_what_is_watched_while_waiting_and_nothing_else():
    # A kill's own connection is read while run's output write waits (its
    # answer lets the next kill of that signal go); the connection whose
    # response that write is for must not be, nor stdin.
    full_r, full_w = _full_pipe()
    aside_r, aside_w = os.pipe()
    other_r, other_w = os.pipe()
    for fd in (aside_w, other_w):
        os.write(fd, b".")
    served: list[str] = []

    def aside(_events: int) -> None:
        served.append("aside")
        loop.unwatch(aside_r)
        os.set_blocking(full_r, False)
        with contextlib.suppress(BlockingIOError):  # emptied: the wait ends
            while True:
                os.read(full_r, 65536)

    with Loop() as loop:
        loop.watch(other_r, READABLE, lambda _events: served.append("other"))
        loop.watch(aside_r, READABLE, aside, while_waiting=True)
        loop.wait_writable(full_w, lambda: False)
    assert served == ["aside"]
    for fd in (full_r, full_w, aside_r, aside_w, other_r, other_w):
        os.close(fd)
