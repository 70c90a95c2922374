"""A Twisted client for the sdexec service (docs/protocol.md).

::

    client = yield connect(reactor, resolve_socket_path())
    handle = client.exec({"cmdline": ["hostname"], ...}, STDOUT | STDERR, print)
    yield handle.done  # None once the stream ends with ENODATA
    yield client.close()

Every error this module raises or errbacks with is a :class:`SdexecError`
whose ``str()`` is one line that can be shown to a user as it is.
"""

from __future__ import annotations

import errno
import math
import operator
import os
import signal
import socket
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, SupportsIndex, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import (
    IConsumer,
    IDelayedCall,
    IPushProducer,
    IReactorSocket,
    IReactorTime,
    ISystemHandle,
    IUNIXTransport,
)
from twisted.internet.protocol import ServerFactory, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from sdexec.framing import JSONLineProtocol, encode_message
from sdexec.ioencode import DecodedIO, encode_io
from sdexec.protocol import (
    DEFAULT_STDIN_BUFSIZE,
    KILL_WHO,
    SOCKET_ENV,
    STATUS_AND_ERROR,
    WRITE_PIECE,
    ExecFlag,
    Topic,
    is_signal_number,
    signum_refused,
)
from sdexec.protocolbase import MAX_SOCKET_PATH
from sdexec.receipt import Receipt
from sdexec.refusal import json_quoted, lone_surrogate, member, quoted
from sdexec.rpc import (
    BAD_DESCRIPTOR,
    ConnectionFailed,
    Pending,
    Requests,
    RPCError,
    SdexecError,
    StdinCredit,
    StdinRefusals,
    StreamCheck,
    background_pid,
    bad_stdio,
    cannot_connect,
    check_stdio,
    checked_answer,
    default_socket_path,
    dropped_counts,
    finished_receipt,
    finished_status,
    is_end_of_stream,
    output_io,
    process_target,
    resolve_socket_path,
    socket_path_unusable,
    wait_outcome,
    with_errno_name,
)

__all__ = [
    "DEFAULT_STDIN_BUFSIZE",
    "MAX_SOCKET_PATH",
    "SOCKET_ENV",
    "STDERR",
    "STDOUT",
    "WAITABLE",
    "WRITE_CREDIT",
    "WRITE_PIECE",
    "AttachHandle",
    "ConnectionFailed",
    "ExecHandle",
    "Payload",
    "RPCError",
    "Receipt",
    "SdexecClient",
    "SdexecError",
    "connect",
    "default_socket_path",
    "resolve_socket_path",
]

#: ``sdexec.exec`` flags (RFC 42), kept under their old names.
STDOUT = ExecFlag.STDOUT
STDERR = ExecFlag.STDERR
WRITE_CREDIT = ExecFlag.WRITE_CREDIT
WAITABLE = ExecFlag.WAITABLE

_log = Logger()

#: A request's or response's payload: a JSON object, as decoded.
Payload = dict[str, Any]


#: How long :meth:`SdexecClient.close` lets what was written go out before
#: it drops it: stdin the service takes no more of (it does not read a
#: connection while a process without write credit is behind) would hold
#: the close, and the processes it stops, for ever.
CLOSE_GRACE_S = 5.0


def connect(
    reactor: IReactorSocket | IReactorTime, path: str
) -> Deferred[SdexecClient]:
    """Connect to the service listening on the UNIX socket ``path`` (with
    any POSIX reactor: it must provide both ``IReactorSocket`` and
    ``IReactorTime``). A Deferred fired already: a UNIX connect is done,
    or fails, at once.

    Typed to take ``twisted.internet.reactor`` as Twisted types it (its
    common interfaces, ``IReactorSocket`` not among them): a program passing
    it failed ``mypy --strict``. One that is no socket reactor is a
    ``TypeError`` here.

    Errbacks with :class:`ConnectionFailed` naming the path if there is no
    socket there, nothing listens on it, it does not accept connections
    now (its listen backlog is full), or it can name no socket: empty, with
    a NUL byte in it, or longer than :data:`MAX_SOCKET_PATH`.
    """
    unusable = socket_path_unusable(path)
    if unusable is not None:
        # Said at once: Twisted logged a TypeError for it and reported a
        # timeout 30 s later.
        return fail(cannot_connect(path, None, unusable))
    sockets = IReactorSocket(reactor, None)
    if sockets is None:
        kind = type(reactor).__name__
        raise TypeError(f"connect: reactor: expected a POSIX reactor, got {kind}")
    client = SdexecClient(path, cast(IReactorTime, reactor))
    # Connected here, not by Twisted's connector: to a full backlog (EAGAIN)
    # it failed with a Failure's repr, "Connection was closed cleanly"
    # (epoll), or after 30 s, "User timeout caused connection failure"
    # (asyncio).
    try:
        with _connected_socket(path) as connected:
            sockets.adoptStreamConnection(
                connected.fileno(), socket.AF_UNIX, _Given(client)
            )
    except OSError as error:
        return fail(_cannot_connect(path, error))
    return succeed(client)


def _connected_socket(path: str) -> socket.socket:
    """A non-blocking socket connected to ``path``; ``OSError`` if it is not."""
    connected = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connected.setblocking(False)
    code = connected.connect_ex(path)
    if code != 0:
        connected.close()
        raise OSError(code, os.strerror(code))
    return connected


def _cannot_connect(path: str, error: OSError) -> ConnectionFailed:
    if error.errno == errno.EAGAIN:  # what a UNIX connect says of a full backlog
        return ConnectionFailed(
            f"cannot connect to {path}: the service is not accepting connections"
            " now: its listen backlog is full (EAGAIN); try again"
        )
    return cannot_connect(path, error.errno, str(error))


def _why_lost(reason: Failure) -> str | None:
    """What ended a connection, for its :class:`ConnectionFailed`: nothing
    more for the service closing it in order. Twisted's ``ConnectionLost``
    keeps no errno (a reset, a failed write: the service's end closed with
    requests unread), so it is said as what it is; anything else (an
    exception that Twisted closed the connection for) by its type and text."""
    if reason.check(ConnectionDone):
        return None
    if reason.check(ConnectionLost):
        return (
            "not cleanly (a read or write on it failed, as when the service's"
            " end resets it)"
        )
    return f"{type(reason.value).__name__}: {reason.getErrorMessage()}"


class _Given(ServerFactory):
    """The factory of a connection whose protocol is made already."""

    def __init__(self, client: SdexecClient) -> None:
        self._client = client

    def buildProtocol(self, addr: object) -> SdexecClient:
        return self._client


class _Call:
    """A request answered by one response.

    Cancelling its Deferred (``addTimeout``, ``defer.race``) cancels nothing
    at the service, which answers all the same: that answer, which the
    cancelled Deferred would drop without a word, is logged
    (:meth:`answered_late`).
    """

    streaming = False

    def __init__(self, client: SdexecClient, topic: str, payload: Payload) -> None:
        self._client = client
        self.topic = topic
        self.payload = payload
        #: The caller cancelled its Deferred: it is waiting no more.
        self.abandoned = False
        self.deferred: Deferred[Payload] = Deferred(self._cancelled)

    def respond(self, payload: Payload) -> None:
        if self.abandoned:
            self.answered_late(payload)
        else:
            self.deferred.callback(payload)

    def end(self, error: SdexecError) -> None:
        if not self.abandoned:
            self.deferred.errback(error)
        elif error is not self._client.lost:  # (a loss answers nothing)
            self.answered_late(error)

    def answered_late(self, answer: Payload | SdexecError) -> None:
        """The service answered after the caller had cancelled."""
        shown = (
            json_quoted(answer, 200)
            if isinstance(answer, dict)
            else with_errno_name(answer)
        )
        _cancelled_but(
            f"{self.topic} {json_quoted(self.payload, 80)}", f"was answered: {shown}"
        )

    def _cancelled(self, deferred: Deferred[Payload]) -> None:
        self.abandoned = True


class _Wait(_Call):
    """An ``sdexec.wait``. Once cancelled, it is kept for the client's
    next :meth:`SdexecClient.wait` of the same process: while the service
    has not answered it, that wait takes it over (:meth:`take_over`)
    rather than send a second one, which the service would refuse (one
    waiter at a time). Once answered, the next wait asks afresh, carrying
    the kept answer (:attr:`kept`), which it gets only where the service
    no longer knows the process: a label or pid used again since names
    another process, whose status this is not."""

    def __init__(
        self,
        client: SdexecClient,
        payload: Payload,
        kept: Payload | SdexecError | None = None,
    ) -> None:
        super().__init__(client, Topic.WAIT, payload)
        #: What the service answered after the cancel, kept for the next wait.
        self.late: Payload | SdexecError | None = None
        #: The answer kept from a cancelled wait of the same target, which
        #: this one gets where the service finds no such process (ESRCH:
        #: that answer consumed it). Carried by the wait, not its Deferred:
        #: cancelled in turn, or taken over, it still has it to give.
        self.kept = kept

    @property
    def target(self) -> str:
        """Which process it waits for: ``pid 42``, ``label 'job7'``."""
        return _named(self.payload)

    @property
    def key(self) -> tuple[str, object]:
        """Its target, whole (:attr:`target` is cut short for a log)."""
        return _target_key(self.payload)

    @property
    def pending(self) -> bool:
        """Not answered yet: the service still holds it as the waiter."""
        return self.late is None

    def take_over(self) -> Deferred[Payload]:
        """A Deferred of the next caller's for this (pending) wait's answer."""
        self.abandoned = False
        self.deferred = Deferred(self._cancelled)
        return self.deferred

    def respond(self, payload: Payload) -> None:
        self._drop_kept(payload)
        super().respond(payload)

    def end(self, error: SdexecError) -> None:
        kept = self.kept
        if kept is not None and _no_such_process(error):
            self.kept = None  # (given now: the service answered nothing else)
            if isinstance(kept, dict):
                self.respond(kept)
            else:
                self.end(kept)
            return
        if error is self._client.lost:
            self.kept = None  # (a loss answers nothing: not said as dropped)
            if self.abandoned:
                self.late = error  # (not an answer: the next wait fails alike)
        self._drop_kept(error)
        super().end(error)

    def answered_late(self, answer: Payload | SdexecError) -> None:
        self.late = answer
        _cancelled_but(
            f"the wait for {self.target}",
            f"was answered ({_answer_said(answer)}): kept for this client's"
            f" next wait() of {self.target}",
        )
        self._client._abandoned_waits.keep_answered(self)

    def _drop_kept(self, answer: Payload | SdexecError) -> None:
        """The service answered this wait itself (the target names another
        process by now): the answer it carried, which no caller saw, is
        dropped, and said so."""
        kept, self.kept = self.kept, None
        if kept is None:
            return
        _log.warn(
            "sdexec: the answer kept for the wait for {target} ({kept}),"
            " cancelled here, is dropped: the service answered a later wait"
            " of {target} with {answer}",
            target=self.target,
            kept=_answer_said(kept),
            answer=_answer_said(answer),
        )

    def _cancelled(self, deferred: Deferred[Payload]) -> None:
        super()._cancelled(deferred)
        self._client._abandoned_waits.add(self)


def _no_such_process(error: SdexecError) -> bool:
    """Whether a wait's ``error`` says the service knows no such process."""
    return isinstance(error, RPCError) and error.errnum == errno.ESRCH


def _answer_said(answer: Payload | SdexecError) -> str:
    """A wait's answer as a log says it: ``status 256``, ``error: …``."""
    if isinstance(answer, dict):
        return f"status {json_quoted(answer.get('status'), 40)}"
    return f"error: {with_errno_name(answer)}"


class _AbandonedWaits:
    """A client's cancelled waits, by target (:class:`_Wait`). Those the
    service has answered are bounded: a caller that gives up on a wait and
    never asks again would otherwise keep every answer, output and all,
    for the connection's life. Past :data:`MAX_KEPT_WAIT_ANSWERS`, the
    oldest is dropped, and said so."""

    def __init__(self) -> None:
        self._waits: dict[tuple[str, object], _Wait] = {}
        #: The answered ones, oldest first (a dict as an ordered set).
        self._answered: dict[tuple[str, object], None] = {}

    def add(self, wait: _Wait) -> None:
        """Keep a wait its caller has just cancelled."""
        self._answered.pop(wait.key, None)  # a pending one replaces it
        self._waits[wait.key] = wait

    def keep_answered(self, wait: _Wait) -> None:
        """``wait`` was answered after its cancel: keep its answer, and
        drop the oldest kept past the bound."""
        if self._waits.get(wait.key) is not wait:
            return  # taken over, or replaced by a newer cancelled wait
        self._answered[wait.key] = None
        while len(self._answered) > MAX_KEPT_WAIT_ANSWERS:
            oldest = next(iter(self._answered))
            self._drop(self._waits[oldest])

    def take(self, target: dict[str, Any]) -> _Wait | None:
        """The cancelled wait for ``target``, no longer kept; None if none."""
        key = _target_key(target)
        self._answered.pop(key, None)
        return self._waits.pop(key, None)

    def _drop(self, wait: _Wait) -> None:
        self.take(wait.payload)
        _log.warn(
            "sdexec: the answer to the wait for {target}, cancelled here and"
            " not asked for since, is dropped: this client keeps the last"
            " {kept} such answers",
            target=wait.target,
            kept=MAX_KEPT_WAIT_ANSWERS,
        )


#: How many answers to cancelled waits a client keeps (:class:`_AbandonedWaits`).
MAX_KEPT_WAIT_ANSWERS = 1024


def _named(target: dict[str, Any]) -> str:
    """The process a ``pid`` or ``label`` target names (a wait's request
    may carry more), as said in a log."""
    kind, value = _target_key(target)
    return f"{kind} {quoted(value, 80)}"


def _target_key(target: dict[str, Any]) -> tuple[str, object]:
    """The process a ``pid`` or ``label`` target names, whole."""
    kind = "label" if "label" in target else "pid"
    return kind, target[kind]


def _cancelled_but(what: str, outcome: str) -> None:
    """Log what the service did with a request whose Deferred the caller
    had cancelled: dropped unsaid, it was lost for good (a wait's status)."""
    _log.warn(
        "sdexec: {what}, whose Deferred was cancelled here, {outcome}"
        " (cancelling a Deferred of sdexec.client cancels nothing at the"
        " service)",
        what=what,
        outcome=outcome,
    )


@implementer(IPushProducer)
class SdexecClient(JSONLineProtocol):
    """One connection to the service. Obtain it with :func:`connect`.

    :attr:`disconnected` fires ``None`` once the connection is gone,
    whatever the reason; requests still in flight then errback with
    :class:`RPCError` if the service said why it closed (e.g. ``EPERM``),
    else with :class:`ConnectionFailed`.

    It is its transport's producer: while what it has written waits to go
    out, the stdin producers registered with its handles are paused (the
    service slows a client without write credit by not reading it).
    """

    def __init__(self, path: str, clock: IReactorTime | None = None) -> None:
        super().__init__()
        if clock is None:
            from twisted.internet import reactor

            clock = cast(IReactorTime, reactor)
        self._clock = clock
        # The service's answers are not a stranger's requests: a list of
        # thousands of processes may hold more values than any request may.
        # The frame size bounds what they cost.
        self.max_values = None
        self.path = path
        #: The connection is gone (connectionLost has run): the client's own
        #: state, not a Deferred's, which a caller may have cancelled.
        self._gone = False
        #: The Deferreds :attr:`disconnected` and :meth:`close` handed out.
        self._gone_waiters: list[Deferred[None]] = []
        self._requests = Requests(path)
        #: Waits whose caller cancelled: the next wait takes one over.
        self._abandoned_waits = _AbandonedWaits()
        #: Whether a request has been written: stdio passthrough must come
        #: first (:meth:`exec`).
        self._sent = False
        #: The transport holds more than it wants: stdin producers wait.
        self.transport_full = False
        #: Handles whose stdin producer is registered (paused and resumed
        #: with the transport).
        self._producing: set[ExecHandle] = set()
        self._closing: IDelayedCall | None = None

    def connectionMade(self) -> None:
        """Register as the transport's producer; close at once a connection
        closed before it was made."""
        super().connectionMade()
        assert self.transport is not None
        IConsumer(self.transport).registerProducer(self, True)
        if self._requests.lost is not None:  # closed before it was made
            self._close_transport()

    # -- requests ---------------------------------------------------------

    def rpc(self, topic: str, payload: dict[str, Any]) -> Deferred[Payload]:
        """Send a request; its one response's payload, or :class:`RPCError`:
        ``EPROTO`` naming the field for an answer not of the shape
        docs/protocol.md gives the topic's (:func:`~sdexec.rpc.checked_answer`).
        ``ValueError`` naming the field, unsent, for what JSON text would
        not carry as it is (:func:`_check_request`)."""
        answered = self._call(_Call(self, topic, payload))
        return answered.addCallback(lambda answer: checked_answer(topic, answer))

    def _call(self, call: _Call) -> Deferred[Payload]:
        """Send ``call``'s request (checked: :func:`_check_request`); its
        Deferred."""
        _check_request(call.topic, call.payload)
        self._track(self._requests.new(call.topic, call.payload), call)
        return call.deferred

    def exec(
        self,
        cmd: dict[str, Any],
        flags: int,
        on_response: Callable[[Payload], None] = lambda payload: None,
        *,
        background: bool = False,
        waitable: bool = False,
        stdio: Mapping[str, int] | None = None,
    ) -> ExecHandle:
        """Start ``cmd`` (an RFC 42 command object) with ``sdexec.exec``.

        ``on_response`` gets every response payload (``add-credit``,
        ``started``, ``output``, ``finished``) in order, after the handle has
        taken note of it (so ``handle.credit`` and ``handle.pid`` are current),
        but an ``output`` no caller can decode or an ``add-credit`` of no
        integer credits: ``handle.done`` then fails with ``EPROTO`` naming
        it, and the process is killed (:meth:`~sdexec.rpc.StreamCheck.take`,
        :meth:`~sdexec.rpc.StreamCheck.kill_due`). An ``output``'s ``io`` is
        decoded already: :func:`~sdexec.ioencode.decode_io` gives it at no
        cost. The stream's end fires ``handle.done``.

        ``background``: the process runs on without this client (stdin at
        EOF, output kept for :meth:`wait` and :meth:`attach`); the one
        response is ``started``, and ``handle.done`` fires once it has come
        (``handle.pid`` set). ``waitable``: its end is kept for :meth:`wait`.

        ``stdio`` gives the process some of our own descriptors for its
        streams (``{"stdout": 1, "stderr": 2}``; stdio passthrough,
        docs/protocol.md): it uses them directly, and nothing of those
        streams comes back as ``output``. Twisted sends descriptors with the
        first bytes queued on the transport, so a passthrough exec must be
        the first request of its connection (else ``ValueError``): open one
        with :func:`connect` for it, and keep it open while the process runs
        (a closed connection stops its processes). The descriptors are
        duplicated here, so the caller may close its own at once.
        """
        if not isinstance(cmd, dict):
            # (Before any descriptor is duplicated: a refusal leaks none.)
            raise ValueError(f"exec: cmd: expected a command object, got {cmd!r:.80}")
        if waitable:
            flags |= ExecFlag.WAITABLE
        payload: dict[str, Any] = {"cmd": cmd, "flags": int(flags)}
        if stdio:
            if self._sent:
                raise ValueError(
                    "exec: stdio passthrough must be the first request on its"
                    " connection (Twisted sends descriptors with the first bytes"
                    " it has queued): open a connection for it with connect()"
                )
            payload["stdio"] = list(stdio)
        _check_request(Topic.EXEC, payload)  # (before any descriptor is duplicated)
        passed = _duplicates(stdio, self._connection_fd()) if stdio else []
        request = self._requests.new(
            Topic.EXEC, payload, streaming=False if background else None
        )
        handle = ExecHandle(
            self,
            request["matchtag"],
            cmd,
            flags,
            on_response,
            passed=passed,
            stdin_passed=stdio is not None and "stdin" in stdio,
        )
        handle.streaming = not background
        try:
            self._track(request, handle, passed)
        except BaseException:
            handle._close_passed()  # not sent: our copies are ours to close
            raise
        return handle

    def wait(
        self,
        pid: int | None = None,
        label: str | None = None,
        status_and_error: bool = False,
    ) -> Deferred[Payload]:
        """``sdexec.wait`` for a waitable process (give exactly one of
        ``pid`` and ``label``): once it has ended, ``{"status", "output",
        "dropped"}`` and the keys of its receipt (docs/protocol.md; read
        them with :meth:`sdexec.receipt.Receipt.from_finished`);
        ``RPCError`` ``EPROTO`` if the answer carries no wait status, or an
        ``output`` item that is no io object of stdout or stderr
        (:func:`~sdexec.ioencode.decode_io` takes each: none raises in the
        caller's hands), naming the item and field. Where
        the stream ended with an error after the command finished (the stop
        timer gave up on what it left: ``EDEADLK``), that ``RPCError``
        alone, as upstream answers;
        with ``status_and_error``, the answer and the error beside it, as
        ``"error"`` (where it ended so before the command finished, a job
        declared unkillable, ``{"output", "dropped", "error"}``, no
        ``"status"``). A wait of this client's for the same target that was
        cancelled is taken over while the service has not answered it (as
        that one asked), and its later answer kept for where the service no
        longer knows the process (:class:`_Wait`)."""
        target = process_target(pid, label)
        _check_request(Topic.WAIT, target)
        cancelled = self._abandoned_waits.take(target)
        if cancelled is not None and cancelled.pending:
            return cancelled.take_over().addCallback(_with_wait_status)
        payload = {**target, STATUS_AND_ERROR: True} if status_and_error else target
        kept = None if cancelled is None else cancelled.late
        return self._call(_Wait(self, payload, kept)).addCallback(_with_wait_status)

    def attach(
        self,
        pid: int | None = None,
        label: str | None = None,
        flags: int = STDOUT | STDERR,
        on_response: Callable[[Payload], None] = lambda payload: None,
    ) -> AttachHandle:
        """``sdexec.attach`` to a background process (exactly one of ``pid``
        and ``label``): ``on_response`` gets ``attached``, the retained and
        live ``output`` of the streams in ``flags``, and ``finished``;
        ``handle.done`` fires at the end (``EPROTO`` naming an ``output``
        or ``attached`` it was not given, malformed:
        :meth:`~sdexec.rpc.StreamCheck.take`).
        Closing the connection detaches."""
        payload = {**process_target(pid, label), "flags": int(flags)}
        _check_request(Topic.ATTACH, payload)
        request = self._requests.new(Topic.ATTACH, payload)
        handle = AttachHandle(self, on_response)
        self._track(request, handle)
        return handle

    def kill(
        self,
        pid: int | None = None,
        label: str | None = None,
        signum: int = 15,
        who: str = "main",
    ) -> Deferred[Payload]:
        """Signal the process with this ``pid`` or ``label`` (give exactly
        one): its unit's main process, as RFC 42 and Flux's sdexec do, or
        with ``who="all"`` every process of its unit. ``signum`` is an
        integer (``signal.SIGTERM`` too)."""
        target = {**process_target(pid, label), "signum": _signal_number(signum)}
        # "who" always: a service older than the main-process default would
        # take its absence for every process.
        return self.rpc(Topic.KILL, {**target, "who": who})

    def terminate(
        self,
        *,
        pid: int | None = None,
        label: str | None = None,
        jobid: str | None = None,
        reason: str = "cancel",
    ) -> Deferred[Payload]:
        """Begin the termination of a job (``sdexec.terminate``), named by
        exactly one of ``pid``, ``label`` or ``jobid``; ``reason`` is
        ``"cancel"`` or ``"timeout"``. Fires with the job's state (``id``,
        ``step``, ...) once the sequence has begun; the job's own exec stream
        says how it ends."""
        given = {
            key: value
            for key, value in (("pid", pid), ("label", label), ("jobid", jobid))
            if value is not None
        }
        if len(given) != 1:
            raise ValueError("terminate: give exactly one of pid, label and jobid")
        return self.rpc(Topic.TERMINATE, {**given, "reason": reason})

    def list(self, detail: bool = True) -> Deferred[Payload]:
        """``{"rank": R, "procs": [{"pid", "cmd", "cmdline", "label",
        "unit", "state", "mode"}, ...]}``: the service's tracked processes
        (a job's also ``"jobid"`` and ``"step"``); without ``detail``, only
        upstream's ``pid``, ``cmd``, ``label`` and ``state``; ``RPCError``
        ``EPROTO`` naming the field of an answer not of that shape."""
        return self.rpc(Topic.LIST, {"detail": detail})

    def stats(self) -> Deferred[Payload]:
        """The service's statistics (``sdexec.stats-get``)."""
        return self.rpc(Topic.STATS, {})

    def undrain(self) -> Deferred[Payload]:
        """Clear the drain causes only an admin clears: ``{"reason":
        CLEARED, "cleared": [...]}``, and ``"still"``, ``"remaining"``: the
        causes that lift themselves, in force until they are over
        (docs/protocol.md)."""
        return self.rpc(Topic.UNDRAIN, {})

    def reload(self) -> Deferred[Payload]:
        """Have the service read its configuration file again, as a
        ``SIGHUP`` does (``sdexec.reload``, the owner's only): ``{"config":
        PATH}``, the file now in force, with ``"warnings": [WARNING, ...]``
        when the file has any (as ``python3 -m sdexec.config`` prints them)
        and ``"needs-restart": [WARNING, ...]`` when it changed settings
        read only at start (their values in force kept); ``RPCError``
        ``EINVAL`` with the
        refusal, naming the key, when the old configuration stays."""
        return self.rpc(Topic.RELOAD, {})

    def close(self) -> Deferred[None]:
        """Close the connection (which stops its streaming processes); a
        Deferred of its own that fires ``None`` once it is closed. Requests
        made from now on fail at once with :class:`ConnectionFailed`, unsent.
        What was written and is not out after :data:`CLOSE_GRACE_S` (stdin
        the service takes no more of) is dropped."""
        if self._requests.lost is None:
            self._requests.lost = ConnectionFailed(
                f"{self.path}: closed by this client"
            )
            if self.transport is not None:
                self._close_transport()
        return self._gone_waiter()

    @property
    def disconnected(self) -> Deferred[None]:
        """A Deferred of the caller's own that fires ``None`` once the
        connection is gone (at once if it is), whatever the reason. Each
        read gives a new one, kept until then: a caller may cancel its own
        (``defer.race``, ``addTimeout``) or chain onto it without touching
        anyone else's, or :meth:`close`. Read it to wait, not to poll."""
        return self._gone_waiter()

    def _gone_waiter(self) -> Deferred[None]:
        if self._gone:
            return succeed(None)
        # Cancelled, it is forgotten: a race run in a loop leaks none.
        waiter: Deferred[None] = Deferred(self._gone_waiters.remove)
        self._gone_waiters.append(waiter)
        return waiter

    def _close_transport(self) -> None:
        assert self.transport is not None
        # Not its producer any more: Twisted resumes a producer it paused
        # once its buffer drains, instead of closing (the close waited out
        # its grace, and the handles' producers were resumed).
        IConsumer(self.transport).unregisterProducer()
        self.transport.loseConnection()
        self._closing = self._clock.callLater(CLOSE_GRACE_S, self._abort)

    @property
    def lost(self) -> SdexecError | None:
        """Why no request goes out any more (the connection was closed, or
        lost), or ``None`` while it serves."""
        return self._requests.lost

    def _abort(self) -> None:
        self._closing = None
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    # IPushProducer: the transport's buffer is full, or empty again.
    def pauseProducing(self) -> None:
        """The transport's buffer is full: each exec's stdin producer is paced."""
        self.transport_full = True
        for handle in list(self._producing):
            handle.pace_producer()

    def resumeProducing(self) -> None:
        """The transport's buffer has room again: each stdin producer resumes."""
        self.transport_full = False
        for handle in list(self._producing):
            handle.pace_producer()

    def stopProducing(self) -> None:
        """Nothing to do: the connection is going, and
        :meth:`connectionLost` ends every handle."""

    def producing(self, handle: ExecHandle, registered: bool) -> None:
        """``handle`` has a stdin producer now (or no more)."""
        if registered:
            self._producing.add(handle)
        else:
            self._producing.discard(handle)

    def send_write(self, handle: ExecHandle, io: Payload) -> None:
        """Send ``io`` to ``handle``'s stdin (``sdexec.write``); dropped if
        the connection is gone. A refusal of it goes to
        :meth:`ExecHandle.stdin_refused` (:class:`~sdexec.rpc.StdinRefusals`)."""
        if self._requests.lost is not None:
            return
        payload = {"matchtag": handle.matchtag, "io": io}
        # The exec's first write takes a matchtag of its own; the rest share it.
        write = self._requests.new(Topic.WRITE, payload, matchtag=handle.write_matchtag)
        if handle.write_matchtag is not None:
            self._send(write)
            return
        self._track(write, StdinRefusals(handle))
        handle.write_matchtag = write["matchtag"]

    def forget_writes(self, handle: ExecHandle) -> None:
        """``handle`` has ended: a refusal of its writes answers nothing now."""
        if handle.write_matchtag is not None:
            self._requests.forget(handle.write_matchtag)

    def _track(
        self, request: dict[str, Any], pending: Pending, fds: Sequence[int] = ()
    ) -> None:
        """Send ``request``, with ``fds`` (one with each of its first
        bytes); its responses go to ``pending``. A request that cannot be
        encoded (``TypeError``, ``ValueError``) is neither tracked nor sent,
        and no descriptor is queued for it."""
        line = encode_message(request)
        if self._requests.track(request, pending):
            for fd in fds:
                IUNIXTransport(self.transport).sendFileDescriptor(fd)
            self._write(line)

    def _send(self, request: dict[str, Any]) -> None:
        self._write(encode_message(request))

    def _connection_fd(self) -> int:
        """Our end of the connection's descriptor; -1 where there is none
        (closed, or a transport with no system handle)."""
        handle = ISystemHandle(self.transport, None)
        if handle is None:
            return -1
        return cast(socket.socket, handle.getHandle()).fileno()

    def _write(self, line: bytes) -> None:
        assert self.transport is not None, "a request before connectionMade"
        self._sent = True
        self.transport.write(line)

    # -- responses --------------------------------------------------------

    def messageReceived(self, message: dict[str, Any]) -> None:
        """A response: given to its request (a stray one is logged)."""
        warning = self._requests.dispatch(message)
        if warning is not None:
            _log.warn("{warning}", warning=warning)

    def framingError(self, reason: str) -> None:
        """The service sent what is no message: every request fails, and the
        connection is dropped."""
        self._requests.framing_error(reason, self.foreign)
        assert self.transport is not None  # framing errors come from its data
        self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Every request in flight ends with the loss; what :meth:`close` and
        :meth:`disconnected` returned fires."""
        if self._closing is not None and self._closing.active():
            self._closing.cancel()
        self._closing = None
        try:
            self._requests.lose(_why_lost(reason), self.unfinished, self.foreign)
        finally:  # whatever a request's end did: close() waits for this
            self._gone = True
            waiters, self._gone_waiters = self._gone_waiters, []
            for waiter in waiters:
                waiter.callback(None)


@implementer(IConsumer)
class ExecHandle:
    """A running ``sdexec.exec`` request: its stdin, signals and end.

    Flow control (RFC 42, :class:`sdexec.rpc.StdinCredit`): ``credit`` is
    how many more stdin bytes the service's buffer can take, ``None``
    without the write-credit flag (no flow control). With it, what is
    written beyond the credit is held here and sent as credit comes (the
    service refuses a client that overruns it, ENOSPC). A push producer
    registered with :meth:`registerProducer` is paused while credit is
    exhausted and resumed when it grows, so stdin can be streamed without
    holding much.

    A write the service refuses (:meth:`stdin_refused`) ends stdin there:
    ``stdin_error`` says why, and ``done`` fails with it once the stream
    has ended well.
    """

    streaming = True

    def __init__(
        self,
        client: SdexecClient,
        matchtag: int,
        cmd: dict[str, Any],
        flags: int,
        on_response: Callable[[Payload], None],
        passed: Sequence[int] = (),
        stdin_passed: bool = False,
    ) -> None:
        self.matchtag = matchtag
        #: The process id, once ``started`` has arrived.
        self.pid: int | None = None
        #: Once ``finished`` has arrived: its wait status, systemd's result,
        #: OOM kills and resource usage (:class:`sdexec.receipt.Receipt`).
        self.receipt: Receipt | None = None
        #: Fires ``None`` when the stream ends with ENODATA; errbacks with
        #: :class:`RPCError` for any other error (``EPROTO`` for a stream
        #: whose ``started`` had no pid, whose ``finished`` had no wait
        #: status or came twice, or that sent an ``output`` no caller can
        #: decode or an ``add-credit`` of no integer credits, the process
        #: then killed: :class:`~sdexec.rpc.StreamCheck`),
        #: :class:`ConnectionFailed` if the connection goes first.
        #: Cancelling it stops nothing (:meth:`_said_after_cancel`).
        self.done: Deferred[None] = Deferred(self._done_cancelled)
        self._done_abandoned = False
        self._check = StreamCheck()
        self._client = client
        self._on_response = on_response
        self._credit = StdinCredit(cmd) if flags & WRITE_CREDIT else None
        self._ended = False
        #: ``started`` has come (with no pid, where :attr:`pid` is None).
        self._start_came = False
        #: Ended with ENODATA: the process finished, its unit is gone.
        self._ended_well = False
        self._end_error: SdexecError | None = None
        #: close_stdin() was called, or a write refused: later writes are
        #: dropped, whatever the credit held back meanwhile.
        self._stdin_closed = False
        #: The process's stdin is a descriptor passed with ``stdio``: the
        #: service refuses writes to it.
        self._stdin_passed = stdin_passed
        #: The matchtag every write of this exec carries (that of the first).
        self.write_matchtag: int | None = None
        #: The service's refusal of a write (:class:`RPCError`: ``ENOSPC``
        #: for an overrun of the credit, ``EINVAL``), once one has come.
        self.stdin_error: SdexecError | None = None
        self._producer: IPushProducer | None = None
        self._paused = False
        self._early_kills: list[tuple[int, str, Deferred[Payload]]] = []
        #: Stdin written beyond the credit, and whether EOF follows it.
        self._held: deque[memoryview] = deque()
        self._eof_held = False
        #: Our duplicates of the descriptors passed with the request (stdio
        #: passthrough): closed once the service has them, which its first
        #: response shows, or once the request has ended without one.
        self._passed = list(passed)

    @property
    def credit(self) -> int | None:
        """Stdin bytes that may be sent now (negative if overdrawn)."""
        return None if self._credit is None else self._credit.available

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` (bytes, or a buffer, copied: the caller may reuse
        it at once) to the process's stdin, as far as the credit goes
        (the rest is sent as credit comes), in writes of at most
        :data:`~sdexec.protocol.WRITE_PIECE` bytes. After :meth:`close_stdin`, a refused
        write, or once the stream has ended, it is dropped, as the service
        would drop it. ``ValueError`` if the process's stdin was passed
        with ``stdio``."""
        self._check_stdin_is_ours("write")
        if not data or self._ended or self._stdin_closed:
            return
        # Bytes, as encode_io takes them; a copy of a mutable buffer, as a
        # caller that reads into it again (a readinto loop) would change
        # what is held.
        view = memoryview(data if type(data) is bytes else bytes(data))
        if self._credit is None:
            for start in range(0, len(view), WRITE_PIECE):
                piece = view[start : start + WRITE_PIECE]
                self._client.send_write(self, encode_io("stdin", "0", bytes(piece)))
            return
        self._held.append(view)
        self._send_held()
        self.pace_producer()

    def close_stdin(self) -> None:
        """Close the process's stdin (a write with ``eof``), after what is
        held for credit. ``ValueError`` if it was passed with ``stdio``."""
        self._check_stdin_is_ours("close_stdin")
        if self._ended or self._stdin_closed:
            return
        self._stdin_closed = True
        if self._held:
            self._eof_held = True
            return
        self._client.send_write(self, encode_io("stdin", "0", eof=True))

    def kill(self, signum: int, who: str = "main") -> Deferred[Payload]:
        """Signal the process (``who``: as :meth:`SdexecClient.kill`).
        Before ``started`` the signal is held and sent once the pid is
        known; if the process never starts, errbacks with ESRCH, as it does
        once the stream has ended well (the process and its unit are gone:
        its pid may be another's by now). ``ValueError`` at the call for a
        ``signum`` or ``who`` the request would refuse."""
        signum = _signal_number(signum)  # at once, not when started comes
        _check_signum(signum)
        _check_who(who)
        if self._ended_well and self.streaming:
            return fail(RPCError(errno.ESRCH, f"kill: pid {self.pid} has ended"))
        if self.pid is not None:
            return self._client.kill(pid=self.pid, signum=signum, who=who)
        if self._ended or self._start_came:
            # (A started without a pid: held, the kill waited for the end.
            # Not any violation: a malformed output is no start.)
            return fail(self._unstarted_kill_error(self._end_error))
        waiting: Deferred[Payload] = Deferred()
        self._early_kills.append((signum, who, waiting))
        return waiting

    # Narrower than IConsumer's IProducer on purpose: pull producers are refused.
    def registerProducer(  # type: ignore[override]
        self, producer: IPushProducer, streaming: bool
    ) -> None:
        """Let this handle pause and resume ``producer`` (by credit, and while
        the connection's transport is full); only push producers
        (``streaming=True``) are supported."""
        if not streaming:
            raise ValueError("ExecHandle: only push producers are supported")
        self._producer, self._paused = producer, False
        if self._ended or self.stdin_error is not None:
            self._stop_producer()
        else:
            self._client.producing(self, True)
            self.pace_producer()

    def unregisterProducer(self) -> None:
        """Forget the stdin producer (it is neither paused, resumed nor
        stopped from now on); stdin stays open: :meth:`close_stdin` it."""
        self._producer = None
        self._client.producing(self, False)

    def pace_producer(self) -> None:
        """Pause the stdin producer while there is no credit for it, or the
        connection's transport is full (without credit, the service slows a
        client that writes ahead of its process by not reading it: what is
        written meanwhile waits here, unbounded, unless the producer waits
        too); resume it once neither holds."""
        if self._producer is None:
            return
        exhausted = self._credit is not None and self._credit.available <= 0
        wait = exhausted or self._client.transport_full
        if wait != self._paused:
            self._paused = wait
            producer = self._producer
            _tell_producer(
                producer.pauseProducing if wait else producer.resumeProducing
            )

    # -- called by SdexecClient -------------------------------------------

    def respond(self, payload: Payload) -> None:
        """One response of the stream (called by :class:`SdexecClient`):
        noted, then given to ``on_response``."""
        self._close_passed()
        kind = payload.get("type")
        handed = self._check.take(payload)  # (a bad one: EPROTO, at the end)
        if kind == "add-credit" and handed:
            self._add_credit(payload["channels"])
        elif kind == "started":  # a pid that is none: EPROTO, at the end
            self._start_came = True
            self.pid = self._check.pid
        elif kind == "finished" and self.receipt is None:
            self.receipt = finished_receipt(payload)
        if handed:
            try:
                self._on_response(payload)
            except Exception:
                _log.failure("sdexec: exec response callback failed")
        if kind == "started":
            self._send_early_kills()
        _kill_if_due(self._client, self._check, f"exec {self.matchtag}")
        if not self.streaming:  # a background exec's one response
            self.end(_background_end(payload))

    def end(self, error: SdexecError) -> None:
        """The stream ended with ``error`` (ENODATA: well), or the
        connection went (called by :class:`SdexecClient`): fires ``done``."""
        error = self._check.ending(error)
        self._close_passed()
        self._ended = True
        self._end_error = error
        self._ended_well = is_end_of_stream(error)
        self._held, self._eof_held = deque(), False  # as the service would drop it
        self._stop_producer()
        self._client.forget_writes(self)
        self._send_early_kills(error)
        if self._done_abandoned:  # (firing it now raises AlreadyCalledError)
            if error is not self._client.lost:
                self._said_after_cancel(error)
            return
        failed = self.stdin_error if self._ended_well else error
        if failed is None:
            self.done.callback(None)
        else:
            self.done.errback(failed)

    def stdin_refused(self, error: SdexecError) -> None:
        """The service refused a write of this exec (or the connection went,
        which :meth:`end` reports): its data and all written after it are
        dropped, as the service drops them. The producer is stopped, and
        the refusal is logged, kept in ``stdin_error``, and what ``done``
        fails with once the stream has ended (the process runs on: the
        service closes its stdin at the refused write, docs/protocol.md)."""
        if error is self._client.lost:
            return
        self.stdin_error = error
        self._stdin_closed = True
        self._held, self._eof_held = deque(), False
        self._stop_producer()
        _log.warn(
            "sdexec: stdin of exec {matchtag} (pid {pid}) refused, the rest"
            " dropped: {error}",
            matchtag=self.matchtag,
            pid=self.pid,
            error=with_errno_name(error),
        )

    # -- internals --------------------------------------------------------

    def _done_cancelled(self, done: Deferred[None]) -> None:
        self._done_abandoned = True

    def _said_after_cancel(self, error: SdexecError) -> None:
        """Log how the exec ended, which its cancelled ``done`` would drop
        unsaid: above all a background process's pid, which is running with
        nothing here tracking it."""
        if self._ended_well and not self.streaming:
            what = f"background exec {self.matchtag}"
            outcome = (
                f"started as pid {self.pid}: it runs on, and nothing here tracks it"
            )
        else:
            what = f"exec {self.matchtag} (pid {self.pid})"
            outcome = (
                "ended well" if self._ended_well else f"ended: {with_errno_name(error)}"
            )
        _cancelled_but(what, outcome)

    def _close_passed(self) -> None:
        # Called on every response: nothing to allocate once they are closed.
        while self._passed:
            os.close(self._passed.pop())

    def _check_stdin_is_ours(self, call: str) -> None:
        """``ValueError`` if stdin was passed with ``stdio``: the service
        refuses writes to it, which the caller would learn only late."""
        if self._stdin_passed:
            raise ValueError(
                f"{call}: the process's stdin is the descriptor passed with"
                " stdio: write to or close that descriptor instead"
            )

    def _send_held(self) -> None:
        """Send held stdin while there is credit for it, then a held EOF."""
        assert self._credit is not None  # only held with flow control
        while self._held and self._credit.available > 0:
            view = self._held[0]
            now = view[: min(self._credit.available, WRITE_PIECE)]
            self._client.send_write(self, encode_io("stdin", "0", bytes(now)))
            self._credit.spend(len(now))
            if len(now) == len(view):
                self._held.popleft()  # (a list's pop(0) made draining quadratic)
            else:
                self._held[0] = view[len(now) :]
        if self._eof_held and not self._held:
            self._eof_held = False
            self._client.send_write(self, encode_io("stdin", "0", eof=True))

    def _add_credit(self, channels: Any) -> None:
        if self._credit is None or not self._credit.add(channels):
            return
        self._send_held()
        self.pace_producer()

    def _stop_producer(self) -> None:
        producer, self._producer = self._producer, None
        self._client.producing(self, False)
        if producer is not None:
            _tell_producer(producer.stopProducing)

    def _send_early_kills(self, ended: SdexecError | None = None) -> None:
        """The kills held for ``started``: sent now that it has come; else
        (the stream ``ended`` first) ESRCH, or the connection's loss (the
        process may well have started)."""
        kills, self._early_kills = self._early_kills, []
        for signum, who, waiting in kills:
            if self.pid is not None:
                sent = self._client.kill(pid=self.pid, signum=signum, who=who)
                if waiting.called:  # cancelled while held
                    # Sent all the same (a cancel stops nothing at the
                    # service); its answer, no one's now, is logged (_Call).
                    sent.cancel()
                    sent.addErrback(lambda failure: None)
                    continue
            else:
                sent = fail(self._unstarted_kill_error(ended))
            sent.chainDeferred(waiting)

    def _unstarted_kill_error(self, ended: SdexecError | None) -> SdexecError:
        """Why a kill of a process not known to have started is not sent:
        ESRCH if its request was refused; the connection's end if that is
        what ended it (the process may well have started)."""
        lost = self._client.lost
        if lost is not None and (ended is lost or not isinstance(ended, RPCError)):
            return lost
        return self._check.violation or _never_started()


def _background_end(answer: Payload) -> SdexecError:
    """How a background exec's one answer ends its handle: well if it is
    ``started`` with a pid, else with the EPROTO that says what came."""
    try:
        background_pid(answer)
    except RPCError as error:
        return error
    return RPCError(errno.ENODATA, "")


class AttachHandle:
    """A running ``sdexec.attach`` request."""

    streaming = True

    def __init__(
        self, client: SdexecClient, on_response: Callable[[Payload], None]
    ) -> None:
        #: The process id, from ``attached``.
        self.pid: int | None = None
        #: The wait status, once ``finished`` has come.
        self.status: int | None = None
        #: Fires ``None`` when the stream ends with ENODATA; errbacks with
        #: :class:`RPCError` (ENOENT, EBUSY...; EPROTO as an exec's ``done``)
        #: or :class:`ConnectionFailed`. Cancelling it does not detach (RFC
        #: 42 has no detach but the connection's close): the service sends
        #: on, ``on_response`` is called no more and nothing is kept, and
        #: the stream's end is logged.
        self.done: Deferred[None] = Deferred(self._done_cancelled)
        self._done_abandoned = False
        self._check = StreamCheck()
        self._client = client
        self._on_response = on_response

    def respond(self, payload: Payload) -> None:
        """One response of the stream (called by :class:`SdexecClient`):
        noted, then given to ``on_response``."""
        kind = payload.get("type")
        handed = self._check.take(payload)  # (a bad one: EPROTO, at the end)
        if kind == "attached":
            self.pid = self._check.pid
        elif kind == "finished" and self.status is None:
            self.status = finished_status(payload)
        _kill_if_due(self._client, self._check, "the attach")
        if not handed or self._done_abandoned:
            # Given up by its caller, who can detach only by closing the
            # connection: what comes until then is dropped, not kept.
            return
        try:
            self._on_response(payload)
        except Exception:
            _log.failure("sdexec: attach response callback failed")

    def end(self, error: SdexecError) -> None:
        """The stream ended with ``error`` (ENODATA: well), or the
        connection went (called by :class:`SdexecClient`): fires ``done``."""
        error = self._check.ending(error)
        if self._done_abandoned:  # (firing it now raises AlreadyCalledError)
            if error is not self._client.lost:  # (a loss answers nothing)
                _cancelled_but(f"the attach to pid {self.pid}", self._outcome(error))
        elif is_end_of_stream(error):
            self.done.callback(None)
        else:
            self.done.errback(error)

    def _outcome(self, error: SdexecError) -> str:
        """How the stream ended, said in the log of one given up: its
        ``finished``, which ``on_response`` no longer got, with it."""
        well = is_end_of_stream(error)
        ended = "ended well" if well else f"ended: {with_errno_name(error)}"
        return ended if self.status is None else f"{ended} (status {self.status})"

    def _done_cancelled(self, done: Deferred[None]) -> None:
        self._done_abandoned = True


def _kill_if_due(client: SdexecClient, check: StreamCheck, what: str) -> None:
    """Send ``SIGKILL`` to the process of a stream that broke the protocol
    while it may still run (:meth:`~sdexec.rpc.StreamCheck.kill_due`), as
    Flux's libsubprocess does, logged; and a failure of that kill, but
    ``ESRCH`` (it had ended meanwhile)."""
    pid = check.kill_due()
    if pid is None:
        return
    _log.warn(
        "sdexec: {what} (pid {pid}): {violation}: killing the process"
        " (SIGKILL): its stream broke the protocol",
        what=what,
        pid=pid,
        violation=check.killed_for,
    )
    killed = client.kill(pid=pid, signum=signal.SIGKILL)
    killed.addErrback(_kill_failed, what, pid)


def _kill_failed(failure: Failure, what: str, pid: int) -> None:
    error = failure.value
    if isinstance(error, RPCError) and error.errnum == errno.ESRCH:
        return
    _log.warn(
        "sdexec: {what} (pid {pid}): the SIGKILL for the broken protocol"
        " failed: {error}",
        what=what,
        pid=pid,
        error=with_errno_name(error),
    )


def _tell_producer(call: Callable[[], object]) -> None:
    """Call the caller's stdin producer, as its response callback is called:
    a failure is logged, and ends neither this stream (``done`` still
    fires) nor the connection and the others' requests."""
    try:
        call()
    except Exception:
        _log.failure("sdexec: the stdin producer failed")


def _duplicates(stdio: Mapping[str, int], connection: int) -> list[int]:
    """Our own copies of the descriptors of ``stdio``, in its order;
    ``ValueError`` naming the stream whose descriptor is not open, or is
    our ``connection`` (:func:`~sdexec.rpc.check_stdio`)."""
    check_stdio(stdio, connection)
    copies: list[int] = []
    for stream, fd in stdio.items():
        try:
            copies.append(os.dup(fd))
        except BAD_DESCRIPTOR as error:
            for copy in copies:
                os.close(copy)
            raise bad_stdio(stream, fd, error) from None
    return copies


def _signal_number(signum: SupportsIndex) -> int:
    """``signum`` as the integer a request carries (``signal.SIGTERM`` is an
    enum, which the encoder refuses); ``TypeError`` naming it for a
    non-integer, at the call, not when a held kill goes out. A bool is
    none: ``True``, an integer to ``operator.index``, was sent as 1,
    SIGHUP, where the service refuses ``true``."""
    if not isinstance(signum, bool):
        try:
            return int(operator.index(signum))
        except TypeError:
            pass
    raise TypeError(f"kill: signum: expected an integer, got {quoted(signum, 40)}")


def _check_signum(signum: int) -> None:
    """``ValueError`` at the call for a signal number the kill's request
    would refuse, in the service's words (:func:`signum_refused`): held
    for ``started``, ``kill(0)`` was refused only once the process had
    started, which ran on meanwhile."""
    if not is_signal_number(signum):
        raise ValueError(f"kill: {signum_refused(signum)}")


def _check_who(who: str) -> None:
    """``ValueError`` or ``TypeError`` at the call for a ``who`` that the
    kill's request would refuse: a kill held for ``started`` raised it as
    that came, dropping the connection with every request on it, and its
    own Deferred never fired. A ``who`` of another value too: held, it was
    refused only once the process had started, which ran on meanwhile."""
    _check_request(Topic.KILL, {"who": who})
    encode_message({"who": who})
    if who not in KILL_WHO:
        raise ValueError(f'kill: who: expected "all" or "main", got {quoted(who, 40)}')


def _check_request(topic: str, payload: dict[str, Any]) -> None:
    """``ValueError`` naming the field (``exec: cmd.env.PATH: …``) for what
    a request built from the caller's values would not carry as meant.
    ``bytes`` (msgspec sends them as base64 text: another command, variable
    or label), text that is not UTF-8 (a surrogate escape, as ``os.environ``
    holds bytes it could not decode: the encoder's error named nothing), a
    float JSON has no number for (msgspec writes ``null``). Only what the
    caller gives is walked: stdin, which :func:`encode_io` makes text, is
    not. ``TypeError`` for a payload that is not a ``dict``: a request's
    payload is a JSON object, and walking one raised an ``AttributeError``
    that named nothing."""
    name = topic.removeprefix("sdexec.")
    if not isinstance(payload, dict):
        kind = type(payload).__name__
        raise TypeError(f"{name}: payload: expected an object (dict), got {kind}")
    _check_members(payload, name)


def _check_members(members: Payload, call: str, table: str = "") -> None:
    """:func:`_check_text` for each name and value of ``members``, the
    object at ``table`` (``cmd.env``; ``""``: the payload) of ``call``'s
    request."""
    for key, value in members.items():
        if type(key) is type(value) is str and key.isascii() and value.isascii():
            continue  # most are: 100 variables took 27 us, now 7
        field = _field(table, key)
        _check_text(key, call, field)
        _check_text(value, call, field)


def _field(table: str, key: object) -> str:
    """The field of ``key`` in the object at ``table``, named as the
    service names one (:func:`~sdexec.refusal.member`): ``cmd.env.PATH``,
    but ``cmd.env['A.B']`` for a key that is no C name (``cmd.env.A.B``
    read as a path), ``cmd.env[b'PATH']`` for one that is not text."""
    named = member(table, key) if isinstance(key, str) else f"{table}[{quoted(key)}]"
    return named.removeprefix(".")  # (a payload's own key: no table before it)


def _check_text(value: object, call: str, field: str) -> None:
    """``ValueError`` ``CALL: FIELD: why`` if ``value``, or anything in
    it, is refused by :func:`_check_request`."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            why = lone_surrogate(value, error)
            raise ValueError(f"{call}: {field}: {why}") from None
    elif isinstance(value, bytes | bytearray | memoryview):
        kind = type(value).__name__
        raise ValueError(f"{call}: {field}: expected text (str), got {kind}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{call}: {field}: {value!r} is not a number JSON can carry")
    elif isinstance(value, dict):
        _check_members(value, call, field)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_text(item, call, f"{field}[{index}]")


def _with_wait_status(answer: Payload) -> Payload:
    """The answer, its wait status, error, output and dropped counts
    checked (:func:`wait_outcome`: no status where it ended with an error
    before the command finished)."""
    wait_outcome(answer)
    _check_wait_output(answer.get("output", []))
    dropped_counts(answer, "wait")  # ("x" was read as "x bytes of stdout")
    return answer


def _check_wait_output(output: list[Any]) -> None:
    """:class:`RPCError` ``EPROTO`` naming the item and field of a wait's
    ``output`` that is no output a caller can decode
    (:func:`~sdexec.rpc.output_io`); each item decoded once, here
    (:class:`~sdexec.ioencode.DecodedIO`)."""
    for index, io in enumerate(output):
        output[index] = DecodedIO(io, output_io(io, f"wait: output[{index}]"))


def _never_started() -> RPCError:
    return RPCError(errno.ESRCH, "kill: the process never started")
