"""A synchronous client of the sdexec service, for the command line.

``sdexec run``, ``ps`` and ``kill`` spend most of their life starting up;
this client imports neither Twisted nor anything that loads OpenSSL, so the
command starts about as fast as the interpreter does (docs/performance.md).
It speaks the same protocol as the Twisted library ``sdexec.client``
through the same modules: :mod:`sdexec.wire` (the format),
:mod:`sdexec.rpc` (requests, responses, errors, stdin credit) and
:mod:`sdexec.protocolbase` (names and defaults, without enums).

A :class:`Loop` waits on file descriptors with a selector and calls back;
a :class:`Connection` is one socket to the service driven by it; the
requests in flight are :class:`Call` and :class:`Exec` objects.
"""

from __future__ import annotations

import _socket  # not socket: see Connection
import errno
import os
import select
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from sdexec.ioencode import encode_io
from sdexec.protocolbase import WRITE_PIECE, ExecFlags, Topics, passed_fds
from sdexec.rpc import (
    Pending,
    Requests,
    SdexecError,
    StdinCredit,
    StdinRefusals,
    StreamCheck,
    cannot_connect,
    check_stdio,
    checked_answer,
    is_end_of_stream,
    socket_path_unusable,
)
from sdexec.wire import FrameSplitter, FramingError, encode_small_message

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import signal
    from typing import Any
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms

__all__ = [
    "ON_ITS_WAY_S",
    "READABLE",
    "WRITABLE",
    "Call",
    "Connection",
    "Exec",
    "Loop",
]

#: How much is read from the service at a time. The service writes output
#: in messages of up to 64 KiB (88 KiB as base64); one read takes one or
#: more whole.
_RECV_SIZE = 256 * 1024

#: How long what the service has sent may take to come once it is no
#: longer wanted, at most: locally, milliseconds. ``run`` gives a process
#: this long to die of the SIGPIPE sent when its reader went, and a detached
#: ``attach`` reads on for the end of a process that had ended this long.
ON_ITS_WAY_S = 1.0

Callback = Callable[[int], None]

#: How much of the signals' wakeup pipe is read at a time (its bytes only
#: wake the loop).
_WAKEUP_READ = 4096


#: What :meth:`Loop.watch` waits for and reports (the values of
#: ``READABLE`` and ``EVENT_WRITE``).
READABLE, WRITABLE = 1, 2


class Loop:
    """Calls back when file descriptors are ready, or signals arrive.

    poll(2), not epoll: stdin may be a regular file, which epoll refuses and
    poll reports always readable. ``select.poll`` itself, not the selectors
    module, whose import (a named tuple compiled, ``math``…) the command
    line's start-up need not pay.
    """

    def __init__(self) -> None:
        self._poll = select.poll()
        #: Per watched fd: the events it is watched for, and its callback.
        self._watched: dict[int, tuple[int, Callback]] = {}
        #: The watched fds served while :meth:`wait_writable` waits too.
        self._served_while_waiting: set[int] = set()
        self._wakeup: tuple[int, int] | None = None
        #: The wakeup fd in force before ours, put back at :meth:`close`
        #: (a reactor's, in a process that runs one: asyncio's wakes it).
        self._wakeup_before = -1
        self._on_signal: Callback | None = None
        #: The signals caught and not yet served, each once, in order of
        #: first arrival (:meth:`_note`).
        self._noted: list[int] = []

    def watch(
        self, fd: int, events: int, callback: Callback, while_waiting: bool = False
    ) -> None:
        """Call ``callback(ready_events)`` while ``fd`` is ready for
        ``events`` (:data:`READABLE` and/or :data:`WRITABLE`); replaces what
        was watched on ``fd``. ``while_waiting``: also while
        :meth:`wait_writable` waits (a callback that has nothing to do with
        what that wait holds up)."""
        self._poll.register(fd, _poll_mask(events))  # registered again: modified
        self._watched[fd] = (events, callback)
        if while_waiting:
            self._served_while_waiting.add(fd)
        else:
            self._served_while_waiting.discard(fd)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``, if it was watched (its callback is not
        called again, even in the round of events being dispatched)."""
        self._served_while_waiting.discard(fd)
        if self._watched.pop(fd, None) is not None:
            self._poll.unregister(fd)

    def catch_signals(
        self,
        signums: Iterable[int],
        on_signal: Callback,
        caught_before: Sequence[int] = (),
    ) -> None:
        """Call ``on_signal(signum)`` from the loop for each of ``signums``
        that arrives, instead of acting on it; not for one ignored now: the
        caller's (``nohup sdexec run JOB`` must not hang JOB up at logout,
        nor ``sdexec run JOB &`` in a script hand it the script's ^C).
        ``caught_before``: those an earlier handler caught, served first (a
        list it may add to until this returns).

        Each signal is served once however often it came before its turn
        (standard signals do not queue: the kernel too keeps one pending),
        in the order they first came: a flood of one grows nothing, and
        cannot crowd out another. The wakeup pipe only wakes the loop: a
        signal read from it was lost once 64 KiB of a flood were unread
        there (a SIGTERM after a flood of SIGUSR1 was never forwarded)."""
        # The interpreter writes a byte to the wakeup fd for each caught
        # signal, at once (the handler runs later: poll, entered meanwhile,
        # would sleep on); the handler notes it, and wakes the loop too.
        readable, writable = self._wakeup = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wakeup_before = signal.set_wakeup_fd(writable, warn_on_full_buffer=False)
        for signum in signums:
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, self._note)
        # Once every handler is ours: any later signal is noted after them.
        # (One slice assignment: a handler cannot run in the middle of it.)
        self._noted[:0] = caught_before
        if self._noted:
            self._wake()
        self._on_signal = on_signal
        self.watch(readable, READABLE, self._serve_signals)

    def _note(self, signum: int, _frame: Any) -> None:
        """The handler of the signals the loop catches: ``signum`` noted for
        the loop to serve, unless it waits already; the loop woken. After
        :meth:`close`, ignored."""
        if self._wakeup is None:
            return
        if signum not in self._noted:
            self._noted.append(signum)
        self._wake()

    def _wake(self) -> None:
        """A byte in the wakeup pipe (if it is full, the loop wakes anyway)."""
        assert self._wakeup is not None
        try:  # noqa: SIM105 (contextlib is not imported: start-up time)
            os.write(self._wakeup[1], b"\0")
        except BlockingIOError:
            pass

    def serve_caught_signals(self) -> None:
        """Call the signal callback now for each signal caught and not yet
        served (the loop serves them only while it runs)."""
        if self._wakeup is not None:
            self._serve_signals()

    def _serve_signals(self, _events: int = READABLE) -> None:
        """Call the signal callback for each signal caught since the last."""
        assert self._wakeup is not None and self._on_signal is not None
        self._drain_wakeup()
        # Those noted by now: one noted later (after the drain, or while
        # these are served) wrote its byte after the drain, and has a turn
        # of its own. (A handler run in the middle of this swap notes its
        # signal in the list taken.)
        noted, self._noted = self._noted, []
        for signum in noted:
            self._on_signal(signum)

    def _drain_wakeup(self) -> None:
        assert self._wakeup is not None
        try:
            while os.read(self._wakeup[0], _WAKEUP_READ):
                pass
        except BlockingIOError:
            pass

    def wait_writable(self, fd: int, gave_up: Callable[[], bool]) -> None:
        """Wait until ``fd`` can be written (or fails), serving the signals
        caught meanwhile and the fds watched ``while_waiting``, and nothing
        else: the caller is in the middle of a callback (the output of a
        response being dispatched), and what it read waits for the write.
        Returns early once ``gave_up()``."""
        while not gave_up():
            polled = self._waiting_poll(fd).poll()
            if any(ready_fd == fd for ready_fd, _ in polled):
                return
            for ready_fd, events in polled:
                self._serve_while_waiting(ready_fd, events)

    def _waiting_poll(self, fd: int) -> select.poll:
        """A poll for :meth:`wait_writable`'s ``fd``, the signals' wakeup
        pipe and the fds watched ``while_waiting``: made again for each
        wait, as a callback may watch or unwatch one (a kill's connection
        closed once answered, another opened)."""
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if self._wakeup is not None:
            poll.register(self._wakeup[0], select.POLLIN)
        for served in self._served_while_waiting:
            poll.register(served, _poll_mask(self._watched[served][0]))
        return poll

    def _serve_while_waiting(self, fd: int, polled: int) -> None:
        """What :meth:`wait_writable` found ready on ``fd``, other than
        the fd it waits for."""
        if self._wakeup is not None and fd == self._wakeup[0]:
            self._serve_signals()
            return
        # An earlier callback of this round may have unwatched it.
        watched = self._watched.get(fd)
        if watched is not None and fd in self._served_while_waiting:
            events, callback = watched
            callback(_ready(polled) & events)

    def run_until(self, done: Callable[[], bool]) -> None:
        """Dispatch callbacks until ``done()``."""
        while not done():
            for fd, polled in self._poll.poll():
                # An earlier callback of this round may have unwatched it.
                watched = self._watched.get(fd)
                if watched is not None:
                    events, callback = watched
                    callback(_ready(polled) & events)

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop catching signals (their handlers stay, and ignore them); the
        wakeup fd before ours is put back: reset to none, an asyncio loop
        in the same process (Twisted's reactor) slept through its own
        signals, a child's SIGCHLD among them."""
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._wakeup_before)
            wakeup, self._wakeup = self._wakeup, None  # first: see _note
            self.unwatch(wakeup[0])
            for fd in wakeup:
                os.close(fd)
        for fd in list(self._watched):
            self.unwatch(fd)


def _connected_socket(path: str) -> _socket.socket:
    """A socket connected to ``path``; :class:`sdexec.rpc.ConnectionFailed`
    naming it if nothing listens there."""
    unusable = socket_path_unusable(path)
    if unusable is not None:
        raise cannot_connect(path, None, unusable)  # the connect's words lack sizes
    # The socket module's C core: the module itself imports selectors and
    # builds its enums, a sixth of the command line's imports, for
    # nothing used here.
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as failure:
        sock.close()
        raise cannot_connect(path, failure.errno, str(failure)) from None
    return sock


def _poll_mask(events: int) -> int:
    """poll's events for :data:`READABLE`/:data:`WRITABLE` ``events``."""
    return (select.POLLIN if events & READABLE else 0) | (
        select.POLLOUT if events & WRITABLE else 0
    )


def _ready(polled: int) -> int:
    """poll's events as :data:`READABLE`/:data:`WRITABLE`: an error or a
    hang-up wakes readers and writers alike (as the selectors module has it),
    so that each finds out by reading or writing."""
    return (READABLE if polled & ~select.POLLOUT else 0) | (
        WRITABLE if polled & ~select.POLLIN else 0
    )


class Call:
    """A request answered by one response."""

    streaming = False

    def __init__(self) -> None:
        self.payload: dict | None = None
        self.error: SdexecError | None = None

    @property
    def answered(self) -> bool:
        """Whether its response (or its error) has come."""
        return self.payload is not None or self.error is not None

    def respond(self, payload: dict) -> None:
        self.payload = payload

    def end(self, error: SdexecError) -> None:
        self.error = error


class Exec:
    """An ``sdexec.exec`` (or ``sdexec.attach``) stream: each response
    payload goes to ``on_response`` once ``pid`` and ``credit`` are current;
    the service's refusal of a write to its stdin to ``on_stdin_refused``."""

    streaming = True

    def __init__(
        self,
        cmd: dict[str, Any],
        flags: int,
        on_response: Callable[[dict], None],
        requests: Requests,
        on_stdin_refused: Callable[[SdexecError], None] | None = None,
        kill: Callable[[int], None] | None = None,
    ) -> None:
        #: Set by :meth:`Connection.exec`.
        self.matchtag = 0
        #: The matchtag all of its writes carry (the first's, tracked while
        #: the stream runs), once one is sent.
        self.write_matchtag: int | None = None
        #: The service's refusal of a write, once one has come (``EINVAL``;
        #: ``ENOSPC``, an overrun of the credit): the write's data and all
        #: written after it are dropped, and the service closes the
        #: process's stdin there (it reads EOF after what came before).
        self.stdin_error: SdexecError | None = None
        #: The process id, once ``started`` has arrived.
        self.pid: int | None = None
        #: Stdin flow control; ``None`` without the write-credit flag.
        self.credit = StdinCredit(cmd) if flags & ExecFlags.WRITE_CREDIT else None
        #: Whether the stream has ended, and with what (``None``: ENODATA).
        self.ended = False
        self.error: SdexecError | None = None
        #: Its responses, checked: a bad one ends it with EPROTO, and one
        #: while its process may run has it killed (:attr:`killed_for`).
        self.check = StreamCheck()
        self._on_response = on_response
        self._requests = requests
        self._on_stdin_refused = on_stdin_refused
        self._kill = kill

    @property
    def killed_for(self) -> SdexecError | None:
        """The violation of the protocol (:class:`~sdexec.rpc.StreamCheck`)
        for which its process was sent ``SIGKILL`` (``kill``), as Flux's
        libsubprocess kills it: its output can no longer be delivered."""
        return self.check.killed_for

    def respond(self, payload: dict) -> None:
        """A response of the stream: ``pid`` and ``credit`` are brought up to
        date with it before ``on_response`` sees it; one the check withholds
        (:meth:`~sdexec.rpc.StreamCheck.take`: malformed output, credit
        that is no integer) it does not see. A good ``output``'s ``io`` is
        decoded once, there."""
        kind = payload.get("type")
        handed = self.check.take(payload)
        if kind == "add-credit" and handed and self.credit is not None:
            self.credit.add(payload["channels"])
        elif kind in ("started", "attached"):
            self.pid = self.check.pid
        pid = self.check.kill_due()
        if pid is not None and self._kill is not None:
            self._kill(pid)
        if handed:
            self._on_response(payload)

    def end(self, error: SdexecError) -> None:
        """The stream ended: ``error`` is kept unless it is the end of
        stream (ENODATA), and a refusal of its writes is no longer awaited."""
        self.ended = True
        error = self.check.ending(error)
        self.error = None if is_end_of_stream(error) else error
        if self.write_matchtag is not None:
            # The service drops writes to an ended stream: a refusal that
            # comes now answers nothing.
            self._requests.forget(self.write_matchtag)

    def stdin_refused(self, error: SdexecError) -> None:
        """The service refused a write (:class:`sdexec.rpc.StdinRefusals`):
        kept in ``stdin_error`` and told to ``on_stdin_refused``. A lost
        connection is no refusal: :meth:`end` reports it."""
        if error is self._requests.lost:
            return
        self.stdin_error = error
        if self._on_stdin_refused is not None:
            self._on_stdin_refused(error)


class Connection:
    """One blocking-free connection to the service's unix socket ``path``.

    :class:`sdexec.rpc.ConnectionFailed` names the path if nothing listens
    there. Given ``connected``, a socket already connected to ``path``, it
    takes that over instead. Requests are written as the socket takes them;
    responses are read and given to their requests while the loop runs, and
    with ``while_waiting`` also while it waits for an output write
    (:meth:`Loop.wait_writable`: a connection of its own for a kill, whose
    answer lets the next kill go).
    """

    def __init__(
        self,
        loop: Loop,
        path: str,
        connected: _socket.socket | None = None,
        while_waiting: bool = False,
    ) -> None:
        self._loop = loop
        self._while_waiting = while_waiting
        self._requests = Requests(path)
        # Any number of values, as the Twisted client (sdexec.client).
        self._splitter = FrameSplitter(max_values=None)
        self._received = bytearray(_RECV_SIZE)
        #: What the socket has not taken yet, each with the descriptors
        #: that go with its first byte.
        self._unsent: list[tuple[bytes, Sequence[int]]] = []
        #: Whether a read's messages are being dispatched, and a write the
        #: peer's close refused meanwhile (:meth:`_peer_left`).
        self._dispatching = False
        self._write_failure: OSError | None = None
        self._sock = connected or _connected_socket(path)
        self._sock.setblocking(False)
        self._watch()

    def send(
        self,
        topic: str,
        payload: dict[str, Any],
        pending: Pending,
        streaming: bool | None = None,
        fds: Sequence[int] = (),
    ) -> int:
        """Send a request whose responses go to ``pending``, with ``fds``
        (``SCM_RIGHTS``, with the first bytes of its frame); its matchtag.
        ``streaming``: the envelope's (false runs an exec in the background)."""
        request = self._requests.new(topic, payload, streaming)
        line = encode_small_message(request)  # first: nothing tracked if not JSON
        if self._requests.track(request, pending):
            self._write(line, fds)
        return request["matchtag"]

    def _send_on(self, matchtag: int, topic: str, payload: dict[str, Any]) -> None:
        """Send a request on an earlier one's ``matchtag``: its responses
        go where that one's do (RFC 6 lets such requests share one); dropped
        if the connection is gone."""
        if self._requests.lost is None:
            request = self._requests.new(topic, payload, matchtag=matchtag)
            self._write(encode_small_message(request))

    def exec(
        self,
        cmd: dict[str, Any],
        flags: int,
        on_response: Callable[[dict], None],
        stdio: Mapping[str, int] | None = None,
        on_stdin_refused: Callable[[SdexecError], None] | None = None,
        sent_as: int | None = None,
    ) -> Exec:
        """Start ``cmd`` (an RFC 42 command object) with ``sdexec.exec``;
        or, given ``sent_as``, follow the exec already sent on the socket
        this connection took over with that matchtag (``stdio`` went with
        it: :mod:`sdexec.earlyexec`).

        ``stdio`` passes our own descriptors for some of the process's
        streams (``{"stdout": 1}``; stdio passthrough, docs/protocol.md):
        the process uses them directly and the service sends no output
        for them. The rest travel framed, as without it.
        ``on_stdin_refused`` gets the service's refusal of a write of
        :meth:`write_stdin`, if one comes while the stream runs."""
        stream = Exec(
            cmd, flags, on_response, self._requests, on_stdin_refused, self._kill_broken
        )
        if sent_as is not None:
            self._requests.adopt(sent_as, stream)
            stream.matchtag = sent_as
            return stream
        payload: dict[str, Any] = {"cmd": cmd, "flags": flags}
        if stdio:
            payload["stdio"] = list(stdio)
            check_stdio(stdio, self._sock.fileno())
        fds = list(stdio.values()) if stdio else []
        stream.matchtag = self.send(Topics.EXEC, payload, stream, fds=fds)
        return stream

    def call(
        self, topic: str, payload: dict[str, Any], streaming: bool | None = None
    ) -> dict:
        """Send a request and wait for its one response's payload;
        :class:`RPCError` for an error response, and ``EPROTO`` naming the
        field for an answer not of the shape docs/protocol.md gives the
        topic's (:func:`~sdexec.rpc.checked_answer`)."""
        call = Call()
        self.send(topic, payload, call, streaming)
        self._loop.run_until(lambda: call.answered)
        if call.error is not None:
            raise call.error
        assert call.payload is not None
        return checked_answer(topic, call.payload)

    def attach(
        self, target: dict[str, Any], flags: int, on_response: Callable[[dict], None]
    ) -> Exec:
        """``sdexec.attach`` to a background process (``target``: its pid or
        label); a stream like an exec's (``pid`` from ``attached``)."""
        stream = Exec({}, 0, on_response, self._requests, kill=self._kill_broken)
        payload = {**target, "flags": flags}
        stream.matchtag = self.send(Topics.ATTACH, payload, stream)
        return stream

    def receive_until(
        self, done: Callable[[], bool], quiet_s: float, within_s: float
    ) -> None:
        """Read and dispatch what the service sends until ``done()``, until
        nothing has come for ``quiet_s`` seconds, or for ``within_s`` at
        most. Nothing else is served meanwhile: not the loop's other
        descriptors, nor its signals (they wait in its wakeup pipe)."""
        poll = select.poll()
        poll.register(self._sock.fileno(), select.POLLIN)
        deadline = time.monotonic() + within_s
        while not done() and self._sock.fileno() >= 0:
            wait_s = min(quiet_s, deadline - time.monotonic())
            if wait_s <= 0 or not poll.poll(wait_s * 1000):
                return
            self._receive()

    def kill_unit(self, signum: int, pid: int, pending: Pending) -> None:
        """Send ``signum`` to every process of process ``pid``'s unit
        (``sdexec.kill``, ``who`` ``all``: what a terminal sends a
        foreground job's process group); the response goes to ``pending``."""
        payload = {"pid": pid, "signum": signum, "who": "all"}
        self.send(Topics.KILL, payload, pending)

    def _kill_broken(self, pid: int) -> None:
        """``SIGKILL`` to the main process of a stream that broke the
        protocol (:attr:`Exec.killed_for`), as Flux's libsubprocess sends
        it; its answer unread."""
        payload = {"pid": pid, "signum": signal.SIGKILL, "who": "main"}
        self.send(Topics.KILL, payload, Call())

    def write_stdin(self, stream: Exec, data: bytes) -> None:
        """Send ``data`` (``b""``: EOF) to the process's stdin, in writes of
        at most :data:`~sdexec.protocol.WRITE_PIECE` bytes; dropped once the
        service has refused a write of it, as the service drops it. All of
        it goes at once, whatever the credit (``stream.credit``, spent
        here): with write credit the caller sends no more than it allows,
        else the service refuses the overrun (``ENOSPC``)."""
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE):
            self._write_piece(stream, bytes(view[start : start + WRITE_PIECE]))
        if not data:
            self._write_piece(stream, b"")

    def _write_piece(self, stream: Exec, data: bytes) -> None:
        if stream.stdin_error is not None:
            return
        io = encode_io("stdin", "0", data, eof=not data)
        payload = {"matchtag": stream.matchtag, "io": io}
        # The stream's first write takes a matchtag of its own, tracked for
        # a refusal; the rest share it.
        if stream.write_matchtag is None:
            refusals = StdinRefusals(stream)
            stream.write_matchtag = self.send(Topics.WRITE, payload, refusals)
        else:
            self._send_on(stream.write_matchtag, Topics.WRITE, payload)
        if stream.credit is not None:
            stream.credit.spend(len(data))

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket and end every request still waiting, as a lost
        connection would (calling it again does nothing more)."""
        if self._sock.fileno() >= 0:
            self._loop.unwatch(self._sock.fileno())
            self._sock.close()
        self._requests.lose()

    # -- the socket ----------------------------------------------------------

    def _watch(self) -> None:
        if self._sock.fileno() < 0:
            return  # lost (a failed write closed it): nothing to watch
        events = READABLE
        if self._unsent:
            events |= WRITABLE
        self._loop.watch(self._sock.fileno(), events, self._ready, self._while_waiting)

    def _write(self, data: bytes, fds: Sequence[int] = ()) -> None:
        was_idle = not self._unsent
        self._unsent.append((data, fds))
        self._flush()
        if was_idle and self._unsent:
            self._watch()

    def _ready(self, events: int) -> None:
        if events & WRITABLE:
            self._flush()
            if self._sock.fileno() < 0:
                return  # the write found the peer gone: the loss is reported
            if not self._unsent:
                self._watch()
        if events & READABLE:
            self._receive()

    def _flush(self) -> None:
        while self._unsent:
            data, fds = self._unsent[0]
            try:
                if fds:
                    sent = self._sock.sendmsg([data], [passed_fds(fds)])
                else:
                    sent = self._sock.send(data)
            except BlockingIOError:
                return
            except OSError as failure:
                if failure.errno in (errno.EPIPE, errno.ECONNRESET):
                    self._peer_left(failure)
                else:
                    self._lose(f"cannot write: {failure.strerror}")
                return
            if sent < len(data):
                self._unsent[0] = (data[sent:], ())  # the fds went with `sent`
            else:
                del self._unsent[0]

    def _peer_left(self, failure: OSError) -> None:
        """The service closed the connection: what it wrote first (why: an
        error on matchtag 0, EPERM for a user it refuses) is read, so that
        the loss is reported with it. After the read being dispatched, if
        this runs from one of its messages' callbacks (a signal forwarded
        on ``started``): that read's later messages come first."""
        self._unsent.clear()
        if self._dispatching:
            self._write_failure = failure
            return
        while self._sock.fileno() >= 0 and self._receive():
            pass
        if self._sock.fileno() >= 0:  # not lost with a reason read
            self._lose(f"cannot write: {failure.strerror}")

    def _receive(self) -> bool:
        """Read once and dispatch what came; whether anything came."""
        try:
            # Into one buffer, read again and again: a fresh 256 KiB object per
            # read made glibc map (or grow and trim its heap) and fault pages
            # in each time, a fifth of the client's CPU for framed output.
            received = self._sock.recv_into(self._received)
        except BlockingIOError:
            return False
        except OSError as failure:
            if failure.errno != errno.ECONNRESET:
                self._lose(f"cannot read: {failure.strerror}")
                return False
            received = 0
        if not received:
            self._lose(None, self._splitter.unfinished)
            return False
        self._dispatching = True
        try:
            for message in self._splitter.feed(self._received, received):
                # A message that answers no request is dropped: the command
                # line has nowhere better to say so.
                self._requests.dispatch(message)
        except FramingError as error:
            self._requests.framing_error(str(error), self._splitter.foreign)
            self._lose(None)
            return False
        finally:
            self._dispatching = False
        refused, self._write_failure = self._write_failure, None
        if refused is not None:
            self._peer_left(refused)
        return True

    def _lose(self, why: str | None, cut_off: int = 0) -> None:
        self._requests.lose(why, cut_off, self._splitter.foreign)
        self._unsent.clear()
        self.close()
