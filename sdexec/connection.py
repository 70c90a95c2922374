"""One client's connection to the service.

:class:`ClientProtocol` checks who the peer is, frames and checks its
requests, dispatches them to the :class:`~sdexec.server.SdexecServer`'s
handlers, and routes responses back by matchtag, holding what it reads in
order while the client reads too slowly or systemd has too many of its
requests to answer, and a request that names an exec whose command is
being looked up until that exec is handled. See ``docs/protocol.md``
for the wire format.
"""

from __future__ import annotations

import errno
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

from twisted.internet import defer
from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from sdexec.framing import FramingError
from sdexec.hangup import peer_gone
from sdexec.jobs import JOBID_OPTION
from sdexec.limits import check_text, is_integer, is_text
from sdexec.lograte import shortened
from sdexec.lookup import LookupTimedOut
from sdexec.passthrough import (
    NO_STDIO,
    PassedStdio,
    StdioReceivingProtocol,
    close_fds,
)
from sdexec.plan import (
    LookedUp,
    RequestError,
    service_named,
)
from sdexec.process import OutputValve, Process
from sdexec.protocol import DEFAULT_STDIN_BUFSIZE, Topic
from sdexec.protocolbase import MAX_MATCHTAG
from sdexec.refusal import (
    SHOWN,
    RequestRefused,
    errstr_line,
    expected,
    json_quoted,
    quoted,
)
from sdexec.reserve import ReservePlace
from sdexec.server import AwaitingStart, SdexecServer, revoked
from sdexec.systemd import errno_for
from sdexec.systemd.channel import STDIN_OVERRUN_FACTOR
from sdexec.systemd.errors import failure_value

__all__ = ["ClientProtocol", "SdexecServerFactory", "peer_uid"]

log = Logger()

#: What a request that met a fault of the service's own ("internal error:
#: ...") is told: the same request would meet it again. Not EIO, which Flux's
#: job-exec reads from sdexec as a failed containment check (it drains the
#: node, blaming the node's fences).
INTERNAL_ERROR_ERRNO = errno.ENOTRECOVERABLE


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a UNIX socket."""
    creds = sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
    )
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


@implementer(IPushProducer, IHalfCloseableProtocol)
class ClientProtocol(StdioReceivingProtocol):
    """One client connection."""

    #: A UNIX socket transport once connected. Twisted types it as
    #: ``ITransport | None``, which lacks the producer and half-close methods
    #: the socket transport has; Any keeps those calls unchecked, not wrong.
    transport: Any

    def __init__(self, server: SdexecServer) -> None:
        super().__init__()
        self.server = server
        self.max_frame = server.config.sdexec.max_frame_size
        self.name_max_frame("[sdexec] max-frame-size")
        self.connection_id = server.new_connection_id()
        #: The peer's uid once its connection was admitted (counted).
        self._admitted_uid: int | None = None
        #: Its place in the owner's reserve while it is there
        #: (sdexec/reserve.py): told of its requests, answers and close.
        self._reserve: ReservePlace | None = None
        #: A write refused on matchtag 0 (or none) has been logged (once only:
        #: the journal is not the client's to fill).
        self._silent_write_refused = False
        self._handlers = self._topic_handlers()
        #: Whether the transport has paused us: its buffer of responses is full.
        self._paused = False
        #: Holds back the output of the processes writing to it meanwhile.
        self.valve = OutputValve()
        #: Processes whose stdin holds more than its limit of this client's
        #: writes (no credit asked): its requests wait until they drain.
        self._stdin_backlogged: set[Process] = set()
        #: The socket watched for the client's close meanwhile (it is not
        #: read, so Twisted would not see it).
        self._hangup_fd: int | None = None
        #: That watch is for its close alone (it has shut down its writing).
        self._hangup_gone_only = False
        #: The client has shut down its writing (seen by the watch, or read):
        #: what it sent before is still read and handled, in order.
        self._half_closed = False
        #: Its EOF was read: everything it sent has been read.
        self._eof_read = False
        #: Answers still to be sent (kills awaiting systemd): a half-closed
        #: connection closes after them, and after its streams' ends.
        self._due = 0
        #: Its streaming processes' stdin was closed at its EOF.
        self._stdins_ended = False
        #: Requests whose answer is a Deferred not fired yet (kills).
        self._unanswered = 0
        #: What was read but not yet handled, oldest first (while paused, or
        #: at the cap of requests awaiting their answer).
        self._held: deque[_Held] = deque()
        #: Execs received and not yet handled (their command being looked
        #: up, sdexec/lookup.py, or waiting themselves): a request naming
        #: one waits for it.
        self._pending_execs: list[_PendingExec] = []
        #: The exec being handled now, for its lookup to take.
        self._handling_exec: _PendingExec | None = None
        #: Requests that wait for a pending exec, oldest first.
        self._waiting: list[_Waiting] = []
        #: The connection is gone: a lookup that ends now runs nothing.
        self._lost = False
        #: Its client has left (:meth:`_client_left`): its processes are
        #: killed, its waits and attaches ended.
        self._left = False
        #: Reading was paused for too many requests behind lookups.
        self._paused_for_lookups = False
        #: The matchtags of the streams not yet ended (execs, waits,
        #: attaches): a request that would open another on one is EEXIST,
        #: as the responses of both would interleave on it.
        self._open_streams: set[int] = set()

    def _topic_handlers(self) -> dict[str, Callable[[int, dict], Any]]:
        """The handler of each topic this connection serves, called with a
        request's matchtag and payload."""
        handlers: dict[str, Callable[[int, dict], Any]] = {
            Topic.EXEC: self._exec,
            Topic.WRITE: self._write,
            Topic.KILL: lambda matchtag, payload: self.server.kill(
                payload, self._admitted_uid
            ),
            Topic.LIST: lambda matchtag, payload: self.server.list(_detail(payload)),
            Topic.STATS: lambda matchtag, payload: self.server.stats(),
            Topic.UNDRAIN: self._undrain,
            Topic.WAIT: self._wait,
            Topic.ATTACH: self._attach,
            Topic.TERMINATE: lambda matchtag, payload: self.server.terminate(payload),
        }
        if self.server.reloader is not None:  # else unknown, as to other servers
            handlers[Topic.RELOAD] = self._reload
        return handlers

    def connectionMade(self) -> None:
        self.server.open_connections.add(self)
        try:
            uid = peer_uid(self.transport.getHandle())
        except OSError as error:
            self.server.log_rate.warn(
                "peer credentials",
                "cannot read peer credentials: {error}",
                error=error.strerror or error,  # not Python's "[Errno N] ..."
            )
            uid = -1
        if uid not in self.server.allowed_uids:
            self._refuse_stranger(uid)
            return
        self.transport.registerProducer(self, True)
        self.transport.bufferSize = CLIENT_BUFFER_SIZE
        self._admit(uid)

    def _refuse_stranger(self, uid: int) -> None:
        """EPERM (matchtag 0, the connection's only message) for a peer that
        may not use the service, and close, before it is counted against
        the caps: a connection that can do nothing must not hold one of our
        fds, nor a slot, waiting for a request it may never send."""
        self.server.count("errors")
        self.server.log_rate.warn(
            f"stranger {uid}",  # each user's own share: one cannot hide another
            "refusing connections from uid {uid}: neither the service's owner"
            " nor in [sdexec] allow-users",
            uid=uid,
        )
        # Its own uid named: one a reload took out of allow-users, or a
        # client run as the wrong user (sudo), sees which uid was refused.
        who = "its uid could not be read" if uid == -1 else f"not uid {uid}"
        self._send_error(
            "",
            0,
            errno.EPERM,
            "only the service's owner may use it (and the users of its"
            f" [sdexec] allow-users), {who}",
        )
        self.transport.loseConnection()

    def _admit(self, uid: int) -> None:
        """Count the connection against the caps, or refuse it (EAGAIN, the
        connection's only message) and close it."""
        limits = self.server.config.sdexec
        owner = uid == self.server.owner_uid
        limit = limits.max_connections if owner else limits.max_connections_per_user
        refusal = self.server.connections.admit(self.connection_id, uid, limit, owner)
        if refusal is None:
            self._admitted_uid = uid
            if self.server.connections.reserved(self.connection_id):
                self._reserve = ReservePlace(
                    self,
                    self.server.connections,
                    self.connection_id,
                    lambda: self.server.config.sdexec.max_connections,
                    self.server.clock,
                )
            return
        self.server.log_rate.warn(
            f"connection cap {uid}",  # each user's own share of lines
            "refusing a connection from uid {uid}: {refusal}",
            uid=uid,
            refusal=refusal,
        )
        self.server.count("errors")
        self._send_error("", 0, errno.EAGAIN, refusal)
        self.transport.loseConnection()

    # -- the owner's reserve (sdexec/reserve.py: ReserveHolder) ----------------

    def close_reserved(self, refusal: str, message: dict | None) -> None:
        """Say ``refusal`` (``EAGAIN``, and in the log, as for a refused
        connect) in answer to ``message``, or on matchtag 0, and close
        the connection, its client taken as gone: its place in the
        reserve is for an admin's requests."""
        self.server.log_rate.warn(
            f"connection cap {self._admitted_uid}",  # as a refused connect
            "closing connection {id} of uid {uid}: {refusal}",
            id=self.connection_id,
            uid=self._admitted_uid,
            refusal=refusal,
        )
        if message is None:
            self._send_error("", 0, errno.EAGAIN, refusal)
        else:
            self._refuse_message(message, errno.EAGAIN, refusal)
        self._close()
        self._client_left()

    def abort(self) -> None:
        """Drop the connection, and what it has not written out."""
        self.transport.abortConnection()

    def left_reserve(self) -> None:
        """Counted among the owner's own connections now: no more of the
        reserve's rules."""
        self._reserve = None

    def _drop_reserve(self) -> None:
        """The connection is lost: its place in the reserve, if any, times
        nothing more (it is freed as the connection is released)."""
        if self._reserve is not None:
            self._reserve.lost()
            self._reserve = None

    def _close(self) -> None:
        """Close the connection once all it was sent is written; one of the
        reserve is aborted if its client has not read that in time
        (:meth:`ReservePlace.closing`)."""
        if self.transport.disconnecting:
            return  # closing already
        if self._reserve is not None:
            self._reserve.closing()
        self.transport.loseConnection()

    def connectionLost(self, reason: object = None) -> None:
        self._drop_reserve()
        self._drop_held()
        self._client_left()
        super().connectionLost(reason)
        if self._admitted_uid is not None:
            self.server.connections.release(self.connection_id)
            self._admitted_uid = None
        self.server.open_connections.discard(self)  # last: a stop may go on

    def readConnectionLost(self) -> None:
        """The read reached EOF: the client closed the connection, or shut
        down its writing (``shutdown(SHUT_WR)``, as socat and nc do at the
        end of their input). Both read the same EOF; told apart here, a
        close ends the connection at once, as any close. A shutdown was its
        last request, not its departure: everything it sent before has
        been read, and it is served until everything is answered and every
        stream has ended (:meth:`_leave_once_answered`; Twisted closed it
        at once, and dropped the answers: such a client had EOF alone, even
        for a ``list``), its close watched for meanwhile (the hang-up
        watch). Reading stops for good: resumed, it would read the EOF
        again."""
        if peer_gone(self.transport.getHandle().fileno()):
            self._gone()
            return
        self._eof_read = self._half_closed = True
        self._settle_hangup_watch()
        self._leave_once_answered()

    def _leave_once_answered(self) -> None:
        """Once its EOF is read and every request before it handled
        (:attr:`_unhandled`), a half-closed client's streaming processes
        read EOF on their stdin, after what it wrote them: no write can
        come any more, as if it had sent an EOF to each. Once also every
        answer is sent and every stream (exec, wait, attach) has ended
        (:attr:`answering`), the connection closes once all it was sent
        is written: the client reads its answers and its processes' output
        to their ends, then EOF (it was taken as gone at its EOF: its
        streaming processes were killed unanswered, its waits and attaches
        ended, though it still read)."""
        if not self._eof_read or self._lost or self._unhandled:
            return
        self._end_stdins()
        if not self.answering:
            self._close()

    def _end_stdins(self) -> None:
        """EOF on the stdin of each of the connection's streaming processes
        (once), after what was written to it (a stdin the client passed is
        its own to close)."""
        if self._stdins_ended:
            return
        self._stdins_ended = True
        for process in self.server.connection_processes(self.connection_id):
            if not process.stream_ended:
                process.stdin.close()

    @property
    def _unhandled(self) -> bool:
        """Whether a request read is not yet handled (held, waiting for an
        exec, or an exec itself not yet handled)."""
        return bool(self._held or self._waiting or self._pending_execs)

    @property
    def answering(self) -> bool:
        """Whether a request read is not yet handled, an answer to one not
        yet sent (:attr:`_due`), or a stream not yet ended."""
        return bool(self._unhandled or self._due or self._open_streams)

    def writeConnectionLost(self) -> None:
        """Never called: the service does not shut down its writing alone."""

    def dataReceived(self, data: bytes) -> None:
        if self._left:
            # Read after a protocol error answered (the connection closes):
            # dropped.
            self.drop_read()
            return
        super().dataReceived(data)

    def _client_left(self) -> None:
        """The client has left, or is taken as gone while its connection
        still writes out what it was sent (a protocol error; not a shutdown
        of its writing, :meth:`readConnectionLost`): nothing more of it is
        handled, what waits for its pending execs is dropped (a
        background exec still runs), its streaming processes are killed and
        stopped, and its waits and attaches end: at once, not when a client
        that does not read has read its last words. Called again once the
        connection is lost, which kills nothing twice."""
        self._lost = True
        self._unwatch_hangup()
        self._handle_ready_waiting()  # (drops all but background execs)
        if not self._left:
            self._left = True
            for process in self.server.connection_processes(self.connection_id):
                process.client_gone()
        self.server.tracked.connection_lost(self.connection_id)

    def framingError(self, reason: str) -> None:
        self._in_order(partial(self._framing_error, reason))

    def _framing_error(self, reason: str) -> None:
        self.server.count("errors")
        self._log_framing_error(reason)
        self._send_error("", 0, errno.EPROTO, reason)
        self._close()
        self._client_left()

    def _log_framing_error(self, reason: str) -> None:
        """Say why a client's connection is closed: its processes are
        killed as for a client that left, and an admin who sees jobs end so
        has only this line to go on (the client alone is told)."""
        uid = self._admitted_uid
        if uid is None:
            return  # refused already, and said so
        units = len(list(self.server.connection_processes(self.connection_id)))
        self.server.log_rate.warn(
            f"protocol error {uid}",  # each user's own share of lines
            "closing connection {id} of uid {uid} for a protocol error: {reason};"
            " its {units} process(es) are killed, as for a client that left",
            id=self.connection_id,  # as the service's other lines name it
            uid=uid,
            reason=reason,
            units=units,
        )

    def messageReceived(self, message: dict) -> None:
        if self.transport.disconnecting:
            return  # closing (a refused peer): the rest of its data is ignored
        # Its frame's size, for what waits behind lookups (read now: the
        # splitter moves on to the next frame before a held one is handled).
        frame = self.frame_bytes
        if self._holding:
            self._hold(partial(self._order, message, frame), self.take_request_fds())
        else:
            self._order(message, frame)

    def _order(self, message: dict, frame: int) -> None:
        """Handle a request (read from ``frame`` bytes) now, or once the
        pending execs it names have been (sdexec/lookup.py: a lookup may
        take seconds, and only what depends on its exec need wait for it)."""
        # A protocol error (FramingError: answered by the caller, which
        # closes the connection) comes before anything of the message is
        # tabled or waits: nothing read after it is handled.
        _check_envelope(message)
        if self._reserve is not None and self._reserve.request_read(message):
            return  # refused, and the connection closed
        pending = _PendingExec.of(message, frame)
        depends_on = self._pending_named_by(message)
        if pending is not None:
            self._pending_execs.append(pending)
        if depends_on:
            self._wait_for(depends_on, message, pending, frame)
        else:
            self._handle_request(message, pending)

    def _handle_request(self, message: dict, pending: _PendingExec | None) -> None:
        """Handle ``message``; an exec (``pending``) is done once handled,
        unless its lookup took it (then once the lookup has ended)."""
        self._handling_exec = pending
        try:
            self._request(message)
        except BaseException:
            # A fault of ours that escaped its handling (sending its answer;
            # the caller closes the connection): what waits for it is
            # handled by whoever handles next, once it is known whether
            # that may be.
            self._handling_exec = None
            if pending is not None and not pending.looking_up:
                self._forget(pending)
            raise
        self._handling_exec = None
        if pending is not None and not pending.looking_up:
            self._exec_handled(pending)

    def _request(self, message: dict) -> None:
        """Answer a request whose envelope passed :func:`_check_envelope`:
        on its own matchtag, or not at all (a write without one)."""
        topic = message.get("topic")
        matchtag = message.get("matchtag")
        silent = _unanswerable_write(topic, matchtag)
        self._answer(
            topic if is_text(topic) else "",
            0 if silent else message["matchtag"],  # (silent: never sent)
            partial(self._dispatch, message, topic, matchtag),
            silent_write=message if silent else None,
        )

    def _answer(
        self,
        reply_topic: str,
        reply_matchtag: int,
        handle: Callable[[], Any],
        silent_write: dict | None = None,
    ) -> None:
        """Answer a request with what ``handle()`` returns: a payload, a
        Deferred of one, ``None`` (it answers for itself) or a refusal,
        logged instead of sent where the request is a ``silent_write`` (a
        write that can be given no answer)."""
        try:
            result = handle()
        except RequestRefused as error:
            self.server.count("errors")
            if silent_write is not None:
                # An error on matchtag 0 would read as the connection's
                # last words: logged instead, once.
                self._log_silent_write_refusal(silent_write, error.errstr)
                return
            self._send_error(reply_topic, reply_matchtag, error.errnum, error.errstr)
            return
        except Exception as error:
            # A fault of ours: the request is answered (unless silent: the
            # log says it) and logged, and the connection (and its other
            # requests) carries on.
            log.failure("{topic}: unexpected error", topic=reply_topic)
            self.server.count("errors")
            if silent_write is not None:
                return
            self._send_error(
                reply_topic,
                reply_matchtag,
                INTERNAL_ERROR_ERRNO,
                f"internal error: {type(error).__name__}: {error}",
            )
            return
        if result is None:
            return
        if isinstance(result, AwaitingStart):
            self._answer_later(result.answer, reply_topic, reply_matchtag, result.sent)
        elif isinstance(result, defer.Deferred):
            self._answer_later(result, reply_topic, reply_matchtag)
        else:
            self._send(reply_topic, reply_matchtag, result)

    def _answer_later(
        self,
        answer: defer.Deferred,
        topic: str,
        matchtag: int,
        sent: defer.Deferred | None = None,
    ) -> None:
        """Send ``answer``'s outcome once it comes. While it waits for
        systemd (from when its call is ``sent``, if that comes later) it
        counts against :data:`MAX_UNANSWERED`, and at the cap no more of
        the connection's requests are read."""
        answer.addCallbacks(
            lambda payload: self._send(topic, matchtag, payload),
            lambda failure: self._send_later_error(topic, matchtag, failure),
        )
        self._due += 1
        answer.addBoth(self._answer_sent)
        if sent is None:
            self._count_unanswered(answer)
        else:
            sent.addCallback(lambda _: self._count_unanswered(answer))

    def _send_later_error(self, topic: str, matchtag: int, failure: Failure) -> None:
        if failure.check(RequestRefused):
            # Refused by its handler once systemd had answered (a kill of a
            # main process that has exited): an error as one refused at once.
            self.server.count("errors")
        self._send_error(
            topic,
            matchtag,
            _errno_of(failure_value(failure)),
            failure.getErrorMessage(),
        )

    def _count_unanswered(self, answer: defer.Deferred) -> None:
        if answer.called:
            return  # answered at once
        self._unanswered += 1
        answer.addBoth(self._answered)
        if self._too_many_unanswered:
            self._pause_reading()
            self._settle_hangup_watch()

    def _answer_sent(self, result: object = None) -> object:
        """An answer :attr:`_due` has been sent (or never will be)."""
        self._due -= 1
        if self._reserve is not None:
            self._reserve.answer_sent()
        self._leave_once_answered()
        return result  # a failure to send the answer is still reported

    def _answered(self, result: object) -> object:
        was_full = self._too_many_unanswered
        self._unanswered -= 1
        if was_full:
            self._unblocked()  # (at the cap again at once, mostly: still watched)
            self._settle_hangup_watch()
        return result  # a failure to send the answer is still reported

    def _unblocked(self) -> None:
        """What kept requests from being handled has gone: those held
        first, in order, then reading again (unless blocked anew)."""
        self._handle_held()
        self._resume_reading()

    def _log_silent_write_refusal(self, message: dict, errstr: str) -> None:
        """Log, once per connection, the refusal of a write that can be given
        no answer (``message``), naming the process whose stdin it was for
        (that stdin is closed, :meth:`_write_refused`)."""
        if not self._silent_write_refused:
            self._silent_write_refused = True
            self.server.log_rate.warn(
                "write refused",
                "connection {id}: sdexec.write {on}, {target}, refused"
                " (later ones of this connection are not logged): {errstr}",
                id=self.connection_id,
                on=_on_matchtag(message),
                target=self._write_target(message),
                errstr=shortened(errstr),  # it may quote the request
            )

    def _write_target(self, message: dict) -> str:
        """The exec a write names (its payload's ``matchtag``), with the
        pid of the process this connection runs there, if any."""
        payload = message.get("payload")
        target = payload.get("matchtag") if isinstance(payload, dict) else None
        if not is_integer(target):
            return "naming no exec"
        process = self.server.processes.get((self.connection_id, target))
        pid = process.pid if process is not None else None
        return f"to the exec on matchtag {target}" + (f" (pid {pid})" if pid else "")

    def _dispatch(self, message: dict, topic: object, matchtag: object) -> Any:
        """The request's handler's answer (``topic`` and ``matchtag`` as the
        request gave them: checked here)."""
        try:
            return self._handle(message, topic, matchtag)
        except Exception:
            if topic == Topic.WRITE:
                self._write_refused(message)
            raise

    def _write_refused(self, message: dict) -> None:
        """A write was refused (malformed, its user revoked, a fault of
        ours…): the process it names reads EOF after what came before, as
        at an overrun. The clients send nothing more to a stdin once a write
        to it is refused, the EOF neither (its data and all after it are
        dropped), and a revoked user's EOF would be refused too: left open,
        a process reading its stdin would wait for ever."""
        payload = message.get("payload")
        if isinstance(payload, dict):
            self.server.close_stdin(self.connection_id, payload.get("matchtag"))

    def _handle(self, message: dict, topic: object, matchtag: object) -> Any:
        """:meth:`_dispatch`, the write's refusal aside."""
        self._refuse_if_revoked()
        if not isinstance(topic, str):
            raise RequestError(errno.EINVAL, expected("topic", "a string", topic))
        check_text("topic", topic)
        if not is_integer(matchtag) or matchtag < 0:
            # A write's (refused silently, logged): every other request's
            # matchtag was checked with its envelope (_check_envelope).
            raise RequestError(
                errno.EINVAL, expected("matchtag", "an integer >= 0", matchtag)
            )
        if matchtag > MAX_MATCHTAG:
            raise RequestError(errno.EINVAL, _PAST_MAX_MATCHTAG.format(matchtag))
        payload = message.get("payload", {})
        if not isinstance(payload, dict):
            raise RequestError(errno.EINVAL, expected("payload", "an object", payload))
        if "signature" in payload:
            # RFC 42: the signature is the authoritative payload, and a
            # server that cannot check it refuses the request with EPERM.
            raise RequestError(
                errno.EPERM,
                "signature: signed requests are not supported (sdexec has no"
                " flux-security to verify them)",
            )
        handler = self._handlers.get(topic)
        streaming = _streaming(message)
        if not streaming and topic == Topic.EXEC:
            handler = partial(self._exec, streaming=False)
        elif not streaming and topic == Topic.ATTACH:
            # RFC 6: one answer for a request that is not streaming, and an
            # attach is nothing but a stream (upstream refuses it too).
            raise RequestError(errno.EPROTO, "attach request is not streaming")
        if handler is None:
            raise RequestError(errno.ENOSYS, f"unknown topic {quoted(topic, SHOWN)}")
        self.server.count(topic)
        if self.server.config.systemd.sdexec_debug:
            log.debug(
                "request {topic} matchtag={matchtag} from connection {id}",
                topic=topic,
                matchtag=matchtag,
                id=self.connection_id,
            )
        return handler(matchtag, payload)

    def _refuse_if_revoked(self) -> None:
        """EPERM for a request of a user whom a reload took out of
        ``[sdexec] allow-users`` after this connection was admitted (a
        revocation must not wait for the client to reconnect; the reload
        ended its waits and attaches): what it started runs on, and the
        owner may kill it."""
        uid = self._admitted_uid
        if uid == self.server.owner_uid:
            return  # the owner's, always served: no set built per request
        if uid is not None and uid not in self.server.allowed_uids:
            raise RequestError(
                errno.EPERM,
                f"{revoked(uid)}: this connection may make no more requests",
            )

    def _reload(self, matchtag: int, payload: dict) -> defer.Deferred[dict]:
        """``sdexec.reload`` (an extension, ``sdexec reload``): reload the
        configuration file, answered with the file now in force or with
        why the old configuration stays. The owner's alone, as a SIGHUP
        is: ``allow-users`` may run commands, not change what the site
        lets them do."""
        reloader = self.server.reloader
        assert reloader is not None, "the topic is served only with a reloader"
        self._owner_only(Topic.RELOAD, "reload its configuration")
        return reloader()

    def _undrain(self, matchtag: int, payload: dict) -> dict:
        """``sdexec.undrain``: the owner's alone, as a reload is. What it
        clears an admin alone may judge cured (a fence found not enforced,
        unkillable processes): a user of ``allow-users`` whose job drained
        the node must not run the next one there."""
        self._owner_only(Topic.UNDRAIN, "undrain it")
        return self.server.undrain()

    def _owner_only(self, topic: Topic, action: str) -> None:
        """Refuse (``EPERM``) ``topic`` from anyone but the service's owner,
        saying that only the owner may do ``action``."""
        uid, owner = self._admitted_uid, self.server.owner_uid
        if uid != owner:
            raise RequestError(
                errno.EPERM,
                f"{topic.value}: only the service's owner (uid {owner}) may"
                f" {action}, not uid {uid}",
            )

    def _own_address(self) -> object:
        """The address clients connect to (this connection's own end), by
        which a passed descriptor that is a connection to the service is
        known; ``None`` where the transport has no socket."""
        try:
            return self.transport.getHandle().getsockname()
        except (AttributeError, OSError):
            return None

    def _exec(self, matchtag: int, payload: dict, streaming: bool = True) -> None:
        """An ``sdexec.exec`` (``streaming`` false: in the background), once
        its command is looked up."""
        requested_at = time.monotonic()
        # A background exec takes no descriptors: its stdio is refused by
        # the lookup's checks (EINVAL), and _deliver closes what it brought.
        stdio = (
            PassedStdio(self.take_request_fds(), self._own_address())
            if streaming
            else NO_STDIO
        )
        with stdio.closed_if_refused():
            lookup = self.server.look_up_command(payload, streaming, self.connection_id)
        found = partial(
            self._exec_found, matchtag, payload, streaming, stdio, requested_at
        )
        self._after_lookup(
            lookup, matchtag, stdio, found, outlives_client=not streaming
        )

    def _exec_found(
        self,
        matchtag: int,
        payload: dict,
        streaming: bool,
        stdio: PassedStdio,
        requested_at: float,
        looked_up: LookedUp,
    ) -> None:
        """Start the looked-up exec; a refusal raised here closes ``stdio``
        (:meth:`_found_or_refused`)."""
        stream = self._open_stream(matchtag, Topic.EXEC, single=not streaming)
        try:
            answered = self.server.exec(
                self.connection_id,
                matchtag,
                payload,
                stream,
                streaming,
                stdio=stdio,
                valve=self.valve,  # (a background process joins none)
                # A background process reads EOF: no write of it to fit.
                request_frame=self.max_frame if streaming else None,
                looked_up=looked_up,
                requested_at=requested_at,
            )
        except BaseException:
            stream.close()  # refused: nothing was sent on it
            raise
        self._count_unanswered(answered)

    def _after_lookup(
        self,
        lookup: defer.Deferred[LookedUp],
        matchtag: int,
        stdio: PassedStdio,
        exec_found: Callable[[LookedUp], None],
        outlives_client: bool,
    ) -> None:
        """``exec_found(looked_up)`` once the exec's command is looked up (the
        lookup's refusal answered instead; ``stdio`` closed on either's
        refusal): at once
        if it is already, else later, the requests naming this exec waiting
        meanwhile (a write may be for this process), and the others
        handled. A connection lost meanwhile drops it, unless it
        ``outlives_client`` (a background exec, which a client may send and
        close at once)."""
        pending, self._handling_exec = self._handling_exec, None
        assert pending is not None, "an exec is handled by _handle_request"
        if not lookup.called:
            pending.looking_up = True
            self._check_lookups_cap()
        lookup.addBoth(
            self._looked_up, matchtag, stdio, exec_found, pending, outlives_client
        )

    def _looked_up(
        self,
        outcome: LookedUp | Failure,
        matchtag: int,
        stdio: PassedStdio,
        exec_found: Callable[[LookedUp], None],
        pending: _PendingExec,
        outlives_client: bool,
    ) -> None:
        pending.looking_up = False
        if self._lost and not outlives_client:
            stdio.close()  # nobody to run it for
        else:
            found = partial(self._found_or_refused, outcome, stdio, exec_found)
            self._answer(Topic.EXEC, matchtag, found)
        self._exec_handled(pending)

    def _found_or_refused(
        self,
        outcome: LookedUp | Failure,
        stdio: PassedStdio,
        exec_found: Callable[[LookedUp], None],
    ) -> None:
        """``exec_found(outcome)``, or the lookup's refusal raised; either
        refusal closes ``stdio``, whichever check makes it (the stream's
        EEXIST once left them open for good: review session 43 Z2)."""
        with stdio.closed_if_refused():
            if isinstance(outcome, Failure):
                self._log_lookup_timeout(failure_value(outcome))
                outcome.raiseException()
            # A reload that took the user out of allow-users while its
            # command was looked up: nothing more may start for it.
            self._refuse_if_revoked()
            exec_found(outcome)

    # -- requests that wait for a pending exec ----------------------------------

    def _pending_named_by(self, message: dict) -> set[_PendingExec]:
        """The pending execs ``message`` depends on, by what it names of
        them (:func:`_names`): a streaming one's matchtag, a label, a job
        id, or any exec (a later exec, a list)."""
        names = _names(message)
        return {pending for pending in self._pending_execs if pending.names & names}

    def _wait_for(
        self,
        depends_on: set[_PendingExec],
        message: dict,
        pending: _PendingExec | None,
        frame: int,
    ) -> None:
        """Handle ``message`` (with the descriptors it brought, read from
        ``frame`` bytes) once the execs it ``depends_on`` have been
        handled."""
        self._waiting.append(
            _Waiting(
                _Held(
                    partial(self._handle_request, message, pending),
                    tuple(self.take_request_fds()),
                ),
                depends_on,
                pending,
                background=pending is not None and not _streaming_or_default(message),
                frame=frame,
            )
        )
        self._check_lookups_cap()

    def _exec_handled(self, pending: _PendingExec) -> None:
        """An exec is handled: the requests waiting only for it are handled
        now, in the order received."""
        if pending.handled:
            return  # (its lookup answered at once, in its handling)
        self._forget(pending)
        self._handle_ready_waiting()
        self._check_lookups_cap()
        self._leave_once_answered()

    def _handle_ready_waiting(self) -> None:
        """Handle the waiting requests that depend on no pending exec any
        more, oldest first (each may start a lookup or wait anew), unless
        the client reads too slowly or has too many awaiting systemd."""
        if self._lost:
            self._drop_waiting()
        while self._may_handle_waiting:
            ready = next((w for w in self._waiting if not w.depends_on), None)
            if ready is None:
                return
            self._waiting.remove(ready)
            self._handle_one(ready.request)

    @property
    def _may_handle_waiting(self) -> bool:
        """Whether what waited for an exec may be handled now: not while
        the client reads too slowly or has too many awaiting systemd, nor
        while the connection closes (a protocol error answered: nothing is
        handled after it); once it is lost, what outlives it runs."""
        if self._lost:
            return True
        return not (self._held_back or self.transport.disconnecting)

    def _check_lookups_cap(self) -> None:
        """At :data:`MAX_BEHIND_LOOKUPS` requests behind lookups, or
        :data:`MAX_FRAMES_BEHIND_LOOKUPS` bytes of their frames, read no
        more requests (and watch for the client's close, which no read
        will show) until below both again."""
        if self._lost:
            return
        if self._too_many_behind_lookups:
            if not self._paused_for_lookups:
                self._paused_for_lookups = True
                self._pause_reading()
                self._settle_hangup_watch()
        elif self._lift_lookups_pause() and not self.transport.disconnecting:
            self._unblocked()

    def _lift_lookups_pause(self) -> bool:
        """End the pause for lookups (:meth:`_check_lookups_cap`) if what
        is behind them is below both caps now; whether it ended (the caller
        handles what was held, and reads again)."""
        if not self._paused_for_lookups or self._lost or self._too_many_behind_lookups:
            return False
        self._paused_for_lookups = False
        self._settle_hangup_watch()
        return True

    def _forget(self, pending: _PendingExec) -> None:
        """Nothing waits for ``pending`` any more."""
        pending.handled = True
        self._pending_execs.remove(pending)
        for waiting in self._waiting:
            waiting.depends_on.discard(pending)

    @property
    def _too_many_behind_lookups(self) -> bool:
        """Whether the execs being looked up and the requests waiting for
        pending execs are :data:`MAX_BEHIND_LOOKUPS`, or their frames
        :data:`MAX_FRAMES_BEHIND_LOOKUPS` bytes. (A waiting exec is in
        both lists, counted once, as waiting.)"""
        looking_up = [pending for pending in self._pending_execs if pending.looking_up]
        if len(looking_up) + len(self._waiting) >= MAX_BEHIND_LOOKUPS:
            return True
        frames = sum(pending.frame for pending in looking_up)
        frames += sum(waiting.frame for waiting in self._waiting)
        return frames >= MAX_FRAMES_BEHIND_LOOKUPS

    def _drop_waiting(self) -> None:
        """The client is gone: what waits for a pending exec is dropped (its
        descriptors closed), but for a background exec, which still runs."""
        dropped = [waiting for waiting in self._waiting if not waiting.background]
        self._waiting = [waiting for waiting in self._waiting if waiting.background]
        close_fds(fd for waiting in dropped for fd in waiting.request.fds)
        for waiting in dropped:
            if waiting.pending is not None:  # a streaming exec: never handled
                self._forget(waiting.pending)

    def descriptorsRefused(self, message: dict, reason: str) -> None:
        self._in_order(partial(self._refuse_descriptors, message, reason))

    def _refuse_descriptors(self, message: dict, reason: str) -> None:
        if self.transport.disconnecting:
            return  # closing (a refused peer): as in messageReceived
        try:
            _check_envelope(message)  # fds or not, as in _order
        except FramingError as error:
            self._framing_error(str(error))
            return
        self._refuse_message(message, errno.EPROTO, reason)

    def _refuse_message(self, message: dict, errnum: int, reason: str) -> None:
        """Refuse a request whose envelope passed :func:`_check_envelope`,
        unhandled: answered ``errnum`` and ``reason`` on its matchtag, or,
        a write that can be given no answer, logged; a write's process
        reads EOF (:meth:`_write_refused`)."""
        topic, matchtag = message.get("topic"), message.get("matchtag")
        self.server.count("errors")
        if topic == Topic.WRITE:
            self._write_refused(message)
        if _unanswerable_write(topic, matchtag):  # as in _request
            self._log_silent_write_refusal(message, reason)
            return
        self._send_error(
            topic if is_text(topic) else "",  # as _request: it is echoed
            message["matchtag"],  # from 1 to MAX_MATCHTAG (_check_envelope)
            errnum,
            reason,
        )

    def _log_lookup_timeout(self, error: BaseException) -> None:
        if isinstance(error, LookupTimedOut):
            self.server.log_rate.warn(
                "lookup timed out",  # one a connection at a time
                "connection {id}: exec refused: {reason}",
                id=self.connection_id,
                reason=shortened(error.errstr),
            )

    def _wait(self, matchtag: int, payload: dict) -> None:
        stream = self._open_stream(matchtag, Topic.WAIT, single=True)
        try:
            self.server.wait(self.connection_id, payload, stream)
        except BaseException:
            stream.close()
            raise

    def _attach(self, matchtag: int, payload: dict) -> None:
        stream = self._open_stream(matchtag, Topic.ATTACH)
        try:
            self.server.attach(self.connection_id, payload, stream, self.valve)
        except BaseException:
            stream.close()
            raise

    def _open_stream(self, matchtag: int, topic: str, single: bool = False) -> _Stream:
        """The responder of a request on ``matchtag`` (``single``: it is
        answered once); EEXIST while a stream of this connection is open on
        it (the client could not tell their responses apart). A
        half-closed connection stays open until it has ended."""
        if matchtag in self._open_streams:
            raise RequestError(errno.EEXIST, f"matchtag {matchtag} is already in use")
        self._open_streams.add(matchtag)
        return _Stream(self, matchtag, topic, single, self._closed)

    def _closed(self, matchtag: int) -> None:
        """A stream has sent its last response, or will send none."""
        self._open_streams.discard(matchtag)
        self._leave_once_answered()

    def _write(self, matchtag: int, payload: dict) -> None:
        process = self.server.write(self.connection_id, payload)
        if process is not None and process.stdin.backlogged:
            # A client without credit wrote ahead of the process: nothing
            # more is read from it until the process has read that down.
            self._stdin_backlogged.add(process)
            self._pause_reading()
            self._settle_hangup_watch()
            process.stdin.when_drained().addCallback(
                lambda _: self._stdin_drained(process)
            )

    def _stdin_drained(self, process: Process) -> None:
        self._stdin_backlogged.discard(process)
        if not self._stdin_backlogged:
            self._settle_hangup_watch()
            if not (self.transport.disconnecting or self._lost):
                self._unblocked()

    def _settle_hangup_watch(self) -> None:
        """Watch for the client's close while its connection is not read
        for what waits (:attr:`_unread_for`), or after it has shut down its
        writing (its close alone: the shutdown would be reported again at
        once, and no read sees a close after it); else not, nor once it
        has left."""
        gone_only = self._half_closed
        if self._lost or not (gone_only or self._unread_for is not None):
            self._unwatch_hangup()
            return
        if self._hangup_gone_only != gone_only:
            self._unwatch_hangup()
        self._watch_hangup(gone_only)

    @property
    def _unread_for(self) -> str | None:
        """What the connection is not read for, where only the hang-up
        watch would see its client leave: a process to read its stdin,
        commands' lookups (too many requests behind them), or systemd's
        answers (too many requests awaiting them: their answers may take
        as long as systemd does). Not a client that reads too slowly: its
        close is seen as the service writes to it."""
        if self._stdin_backlogged:
            return "a process to read its stdin"
        if self._paused_for_lookups:
            return "commands' lookups"
        if self._too_many_unanswered:
            return "systemd to answer its requests"
        return None

    def _watch_hangup(self, gone_only: bool) -> None:
        if self._hangup_fd is None:
            self._hangup_fd = self.transport.getHandle().fileno()
            self._hangup_gone_only = gone_only
            self.server.hangups.watch(self._hangup_fd, self._hung_up, gone_only)

    def _unwatch_hangup(self) -> None:
        if self._hangup_fd is not None:
            self.server.hangups.unwatch(self._hangup_fd)
            self._hangup_fd = None

    def _hung_up(self, gone: bool) -> None:
        """The client closed the connection (``gone``), or shut down its
        writing, while its requests waited (:attr:`_unread_for`), or after
        it had shut down its writing."""
        self._hangup_fd = None
        log.info(
            "connection {id}: the client {did} while it waited for {what}",
            id=self.connection_id,
            did="closed it" if gone else "shut down its writing",
            what=self._unread_for or "its answers and streams to end",
        )
        if gone:
            self._gone()
        else:
            self._half_closed_unread()

    def _gone(self) -> None:
        """The client closed the connection: nothing more can reach it."""
        # Lost now: Twisted calls connectionLost a loop pass after the
        # abort, and nothing held is to run meanwhile, nor any stdin closed.
        self._lost = True
        self._drop_reserve()
        self.abort()

    def _half_closed_unread(self) -> None:
        """The client shut down its writing (socat, nc) while what it sent
        was not read: that stays in the socket (its buffer is the bound: no
        more of it is read into the service than at any other time), and is
        read, handled and answered in order as the caps allow, as for a
        client that stays, up to its EOF (:meth:`readConnectionLost`) and
        beyond. Meanwhile only its close is watched for."""
        self._half_closed = True
        self._settle_hangup_watch()

    def _drop_held(self) -> None:
        """Drop what was read and held, with the descriptors it brought."""
        held, self._held = self._held, deque()
        close_fds(fd for request in held for fd in request.fds)

    def _send(self, topic: str, matchtag: int, payload: dict) -> None:
        self.sendMessage(
            {
                "type": "response",
                "topic": topic,
                "matchtag": matchtag,
                "payload": payload,
            }
        )

    def _send_error(self, topic: str, matchtag: int, errnum: int, errstr: str) -> None:
        if self.server.observer is not None:
            self.server.observer.error_sent(topic, errnum)
        self.sendMessage(
            {
                "type": "response",
                "topic": topic,
                "matchtag": matchtag,
                "errnum": errnum,
                "errstr": errstr_line(errstr),
            }
        )

    # -- held requests: what was read while paused waits, in order -------------

    @property
    def _holding(self) -> bool:
        """Whether what is read now must wait: the connection is paused, or
        has too many requests awaiting their answer, or what was read
        before still waits (responses keep the requests' order). Never once
        its client has left: what is read then is dropped."""
        return not self._left and (self._blocked or bool(self._held))

    @property
    def _blocked(self) -> bool:
        """Whether no request may be handled now: :attr:`_held_back`, or
        too many requests behind commands' lookups."""
        return self._held_back or self._paused_for_lookups

    @property
    def _held_back(self) -> bool:
        """The client reads too slowly, has too many requests awaiting
        systemd, or wrote too far ahead of a process's stdin."""
        return self._paused or self._too_many_unanswered or bool(self._stdin_backlogged)

    @property
    def _too_many_unanswered(self) -> bool:
        return self._unanswered >= MAX_UNANSWERED

    def _resume_reading(self) -> None:
        """Read requests again (what was read and not decoded first),
        unless something still holds them."""
        if not self._holding:
            try:
                self.decodeHeldInput()
            except Exception:
                self._held_request_failed()
        if not (self._holding or self.transport.disconnecting or self._eof_read):
            self.transport.resumeProducing()

    def _pause_reading(self) -> None:
        """Read no more requests (until :meth:`_resume_reading`)."""
        self.transport.pauseProducing()

    def _held_request_failed(self) -> None:
        """A fault of ours that escaped a held request's own handling
        (sending its answer, say): what Twisted does with one raised by a
        request read at once, also where no transport call is below us (an
        answer from systemd let it run), rather than leaving the rest held
        on a connection that reads nothing more."""
        log.failure("connection {id}: a held request failed", id=self.connection_id)
        self._close()

    def inputHeld(self) -> bool:
        """Whether requests read now must wait behind others (see
        :attr:`_holding`), so that their answers keep the requests' order."""
        return self._holding

    def _hold(self, handle: Callable[[], object], fds: Sequence[int] = ()) -> None:
        self._held.append(_Held(handle, tuple(fds)))

    def _in_order(self, handle: Callable[[], object]) -> None:
        """``handle()`` now, or after what is held."""
        if self._holding:
            self._hold(handle)
        else:
            handle()

    def _handle_held(self) -> None:
        """Handle what was held, oldest first (what waited for an exec now
        handled first), until paused again (or at the cap of requests
        awaiting their answer)."""
        self._handle_ready_waiting()
        # What waited for an exec is not always handled with it (not while
        # the client reads too slowly): handled only now, it may leave what
        # is behind lookups below the caps, and the pause would stay for
        # ever, nothing read again (review session 51).
        self._lift_lookups_pause()
        while self._held and not (
            self._blocked or self.transport.disconnecting or self._lost
        ):
            self._handle_one(self._held.popleft())
        self._leave_once_answered()

    def _handle_one(self, request: _Held) -> None:
        """Handle a request that was held or waited, as when it was read."""
        self.request_fds = list(request.fds)  # as when its frame was read
        try:
            request.handle()
        except FramingError as error:  # not a request: as when it was read
            self._framing_error(str(error))
        except Exception:
            self._held_request_failed()
        finally:
            close_fds(self.take_request_fds())

    # IPushProducer: the transport's buffer of responses is full (the client
    # reads slowly, or not at all). Reading more requests would only fill it
    # further, without bound, so both the processes' output and the
    # connection's requests stop until the client has read everything.
    def pauseProducing(self) -> None:
        self._paused = True
        self.server.tracked.connection_paused(self.connection_id)
        if not self.transport.disconnecting:  # (a closing one reads nothing)
            self._pause_reading()
        self.valve.pause()  # each process as it writes

    def resumeProducing(self) -> None:
        # Everything sent is written out (Twisted resumes a producer only
        # once its buffer is empty).
        self.server.tracked.connection_resumed(self.connection_id)
        if self.transport.disconnecting:
            self._let_close()
            return
        self._paused = False
        self._handle_held()  # before anything newer: in order
        if self._paused or self.transport.disconnecting:
            return  # the held requests filled the buffer again, or ended it
        self.valve.resume()
        self._resume_reading()

    def _let_close(self) -> None:
        """Twisted resumes a producer that was paused when its connection was
        closed, instead of closing the connection, and nothing would ever
        close it: without a producer, it closes once all is written."""
        if self.transport.producer is self:
            self.transport.unregisterProducer()

    def stopProducing(self) -> None:
        # The transport stops its producer only as the connection is lost:
        # connectionLost does the cleanup, and there is nothing more to stop.
        pass


def _not_a_request(message: dict) -> str:
    """Why a message that is not a request ends its connection, with what
    its ``type`` was, as a bad matchtag's is said (a client that sent
    ``"Request"`` or a response of its own learned nothing from
    'expected "request"')."""
    if "type" not in message:
        return 'type: missing: expected "request"'
    return f'type: expected "request", got {json_quoted(message["type"])}'


def _check_envelope(message: dict) -> None:
    """Refuse what is not a request of this protocol (:class:`FramingError`:
    EPROTO on matchtag 0, and the connection closed): a message whose
    ``type`` is not ``"request"``, or a request that could not be answered
    on a matchtag of its own. Matchtag 0 is the service's (RFC 6's
    FLUX_MATCHTAG_NONE): an error on it is always the connection's last
    words, so no request may take it, but for a write, which wants no
    response: without a matchtag of its own it is never answered
    (:func:`_unanswerable_write`)."""
    if message.get("type") != "request":
        raise FramingError(_not_a_request(message))
    matchtag = message.get("matchtag")
    if _unanswerable_write(message.get("topic"), matchtag):
        return
    if "matchtag" not in message:
        raise FramingError("matchtag: missing: expected an integer >= 1")
    if is_integer(matchtag) and matchtag == 0:
        raise FramingError(
            "matchtag: 0 is the service's own (its connection errors);"
            " number requests from 1"
        )
    if not (is_integer(matchtag) and matchtag >= 1):
        raise FramingError(
            f"matchtag: expected an integer >= 1, got {json_quoted(matchtag)}"
        )
    if matchtag > MAX_MATCHTAG:
        raise FramingError(_PAST_MAX_MATCHTAG.format(matchtag))


#: A matchtag a response of Flux's could not carry (RFC 6: 32 bits).
_PAST_MAX_MATCHTAG = (
    f"matchtag: {{}} is past {MAX_MATCHTAG}, the largest (RFC 6: a 32-bit integer)"
)


def _on_matchtag(message: dict) -> str:
    """Where a request came, for a log line: ``on matchtag 0`` (Flux's "no
    response wanted"), ``without a matchtag``, ``on matchtag "x"``."""
    if "matchtag" not in message:
        return "without a matchtag"
    return f"on matchtag {json_quoted(message['matchtag'])}"


def _unanswerable_write(topic: object, matchtag: object) -> bool:
    """A write sent as Flux does (no matchtag: no response wanted), or with
    one no response could carry (not 1 to :data:`MAX_MATCHTAG`): a refusal
    of it is not answered."""
    return topic == Topic.WRITE and not (
        is_integer(matchtag) and 0 < matchtag <= MAX_MATCHTAG
    )


def _errno_of(error: BaseException) -> int:
    """What a client is told for a handler's failed Deferred: a refusal's
    own errno, EAGAIN while systemd is away, or systemd's."""
    if isinstance(error, RequestRefused):
        return error.errnum
    return errno_for(error)


def _streaming(message: dict) -> bool:
    """The envelope's ``streaming`` (default true); EINVAL if not a boolean."""
    streaming = message.get("streaming", True)
    if not isinstance(streaming, bool):
        raise RequestError(errno.EINVAL, expected("streaming", "a boolean", streaming))
    return streaming


#: How many bytes may wait to be written to a client before its processes'
#: output is paused (Twisted's ``bufferSize``, 64 KiB by default, which is
#: also the size of its reads, here of small requests). At 64 KiB every output
#: message (up to 64 KiB of data, more as JSON) paused and resumed every
#: output channel of the connection, though the socket took the message at
#: the next loop pass: 28 % of the service's CPU for text output
#: (docs/performance.md).
CLIENT_BUFFER_SIZE = 256 * 1024


#: Requests of one connection that may await their answer at once: kills
#: of a started process (or a leftover), answered once systemd has; a kill
#: held for a start (:class:`AwaitingStart`) counts once it has gone out;
#: an exec until systemd has answered its start (each holds its command,
#: up to 2.5 MiB, meanwhile).
#: Such a request sends nothing until then, so the response back-pressure
#: never stopped a client sending them: one connection queued
#: 100,000 ``KillUnit`` calls (224 MB) in the call window every client
#: shares, ahead of every other client's ``StartTransientUnit``. At the cap
#: its requests are no longer read until one is answered: nothing is lost,
#: the client is slowed. 64 lets one connection fill the call window at
#: its default size (``[systemd] max-inflight``) and no more; it is its own
#: figure, and does not follow that key.
MAX_UNANSWERED = 64


#: Requests of one connection behind commands' lookups at once: execs whose
#: command is being looked up, and requests waiting for a pending exec they
#: name. A lookup on a file system that does not answer takes up to 10 s,
#: and each holds a thread and its exec's command meanwhile; at the cap
#: no more of the connection's requests are read until one is done.
MAX_BEHIND_LOOKUPS = 64
#: The bytes of the frames behind lookups (those execs' own and their
#: waiting requests', of every kind) at which no more of a connection's
#: requests are read. They wait decoded, and counted by number alone 63
#: execs of the largest frame held 4 GiB (RSS grew by 1 GiB at 16 MiB each),
#: where ``max-frame-size`` bounds a connection by one frame: so a
#: connection holds at most one frame past these 16 KiB (the one that
#: reached them, or the one being read). 16 KiB is also what a process's
#: stdin holds at the default ``stdin_BUFSIZE`` before its client is
#: slowed: a client writing ahead of a command still looked up is held to
#: one write past it, as once the process runs.
MAX_FRAMES_BEHIND_LOOKUPS = STDIN_OVERRUN_FACTOR * DEFAULT_STDIN_BUFSIZE


def _detail(payload: dict) -> bool:
    """``sdexec.list``'s ``detail``: sdexec's own fields too."""
    detail = payload.get("detail", False)
    if not isinstance(detail, bool):
        raise RequestError(
            errno.EINVAL, f"detail: expected true or false, got {json_quoted(detail)}"
        )
    return detail


class _Held(NamedTuple):
    """Something read while the connection was paused: how to handle it, and
    the descriptors its frame brought (the connection's until handled)."""

    handle: Callable[[], object]
    fds: tuple[int, ...]


class _PendingExec:
    """An exec received and not yet handled, by what a later request may
    name it: its matchtag if streaming, and its label."""

    def __init__(self, names: frozenset[_Name], frame: int) -> None:
        self.names = names
        #: The bytes of the frame it was read from (its command is held
        #: meanwhile).
        self.frame = frame
        #: Its command is being looked up.
        self.looking_up = False
        #: Handled: nothing waits for it any more.
        self.handled = False

    @classmethod
    def of(cls, message: dict, frame: int) -> _PendingExec | None:
        """The pending exec that ``message`` (read from ``frame`` bytes)
        is, if an exec."""
        if message.get("topic") != Topic.EXEC:
            return None
        names = _names(message)
        if not _streaming_or_default(message):
            # Nothing finds a background process by its request's matchtag.
            names.discard(("matchtag", message.get("matchtag")))
        return cls(frozenset(names), frame)


class _Waiting(NamedTuple):
    """A request that waits for the pending execs it ``depends_on``; an
    exec is ``pending`` itself (a ``background`` one outlives its client)."""

    request: _Held
    depends_on: set[_PendingExec]
    pending: _PendingExec | None
    background: bool
    #: The bytes of the frame it was read from.
    frame: int


#: Requests whose answer lists the processes: they show an exec sent before
#: them, so they wait for every pending one.
_LISTING = (Topic.LIST, Topic.STATS)

#: Requests that name a process by label (a pending exec's among them).
_BY_LABEL = frozenset({Topic.KILL, Topic.WAIT, Topic.ATTACH, Topic.TERMINATE})

#: Requests other than an exec whose answer is a stream of its own
#: matchtag's (EEXIST while another holds it).
_STREAMS = frozenset({Topic.WAIT, Topic.ATTACH})


#: How a request names an exec: ``("matchtag", n)``, ``("label", text)``,
#: ``("job", id)``, or, for another exec, :data:`_EVERY_EXEC`.
_Name = tuple[str, object]

#: What every exec names: each waits for the execs before it.
_EVERY_EXEC: _Name = ("exec", None)


def _names(message: dict) -> set[_Name]:
    """The matchtag, label and job by which ``message`` names an exec: a
    write its process's matchtag, an exec its own matchtag, label and job
    (reusing either of the first two is refused, as before), a kill, wait
    or attach its label, a terminate its job, a wait or attach the stream
    of its own matchtag; malformed fields name nothing (their refusal
    comes as before). Only peeked at, to order requests:
    :func:`sdexec.plan.plan_exec` reads the request."""
    topic = message.get("topic")
    payload = message.get("payload")
    if topic == Topic.EXEC:
        # Execs keep their order among themselves (_EVERY_EXEC): which of two
        # gets a unit name, a job id or the last of a limit stays the first's.
        return (
            {_EVERY_EXEC}
            | _matchtag_named(message.get("matchtag"))
            | _stream_named(message.get("matchtag"))
            | _label_named(_exec_option(message, "label"))
            | _jobs_named(message)
        )
    if topic in _LISTING:
        return {_EVERY_EXEC}
    # A wait or an attach on the matchtag of an exec being looked up waits
    # for it, to be refused (EEXIST) as behind an exec handled: handled at
    # once, it took the matchtag, and the exec was refused, or shared it.
    streams = isinstance(topic, str) and topic in _STREAMS  # (a list: unhashable)
    named = _stream_named(message.get("matchtag")) if streams else set()
    if not isinstance(payload, dict):
        return named
    if topic == Topic.WRITE:
        return _matchtag_named(payload.get("matchtag"))
    if topic == Topic.TERMINATE and isinstance(payload.get("jobid"), str):
        return {("job", payload["jobid"])}
    if isinstance(topic, str) and topic in _BY_LABEL:  # (a list is unhashable)
        return named | _label_named(payload.get("label"))
    return named


def _matchtag_named(matchtag: object) -> set[_Name]:
    return {("matchtag", matchtag)} if is_integer(matchtag) else set()


def _stream_named(matchtag: object) -> set[_Name]:
    """The stream on ``matchtag`` that an exec (background too, until its
    one response), a wait or an attach holds: one at a time on it."""
    return {("stream", matchtag)} if is_integer(matchtag) else set()


def _label_named(label: object) -> set[_Name]:
    return {("label", label)} if isinstance(label, str) else set()


def _jobs_named(message: dict) -> set[_Name]:
    """The job ids an exec's job may be terminated by: its ``SDEXEC_JOBID``,
    else its unit's name, known beforehand only from ``SDEXEC_NAME``."""
    opts = _exec_option(message, "opts")
    if not isinstance(opts, dict):
        return set()
    jobid, name = opts.get(JOBID_OPTION), opts.get("SDEXEC_NAME")
    if isinstance(jobid, str) and jobid:
        return {("job", jobid)}
    if isinstance(name, str) and name:
        return {("job", service_named(name))}
    return set()


def _exec_option(message: dict, field: str) -> object:
    """A field of an exec's command object (``label``, ``opts``), if any."""
    payload = message.get("payload")
    cmd = payload.get("cmd") if isinstance(payload, dict) else None
    return cmd.get(field) if isinstance(cmd, dict) else None


def _streaming_or_default(message: dict) -> bool:
    """The envelope's ``streaming``, true unless false (a malformed one is
    refused when the request is handled)."""
    return message.get("streaming", True) is not False


class _Stream:
    """The responder for one exec (wait, attach) request on one connection:
    open until its last response (an error, ENODATA among them; the one
    answer of a ``single`` request), when ``closed(matchtag)`` is called."""

    def __init__(
        self,
        protocol: ClientProtocol,
        matchtag: int,
        topic: str,
        single: bool,
        closed: Callable[[int], None],
    ) -> None:
        self._protocol = protocol
        self._matchtag = matchtag
        self._topic = topic
        self._single = single
        self._closed: Callable[[int], None] | None = closed

    def respond(self, payload: dict) -> None:
        self._protocol._send(self._topic, self._matchtag, payload)
        if self._single:
            self.close()

    def error(self, errnum: int, errstr: str) -> None:
        self._protocol._send_error(self._topic, self._matchtag, errnum, errstr)
        self.close()

    def close(self) -> None:
        """Its last response is sent, or none will be: its matchtag is free
        (once: by then a new stream may hold it)."""
        if self._closed is not None:
            self._closed(self._matchtag)
            self._closed = None


class SdexecServerFactory(Factory):
    """The listening side: makes a :class:`ClientProtocol` per connection."""

    #: No "Starting factory <...SdexecServerFactory object at 0x...>" line:
    #: it names a Python object, and "sdexec listening on" says it all.
    noisy = False

    def __init__(self, server: SdexecServer) -> None:
        self.server = server

    def buildProtocol(self, addr: object) -> ClientProtocol:
        protocol = ClientProtocol(self.server)
        protocol.factory = self
        return protocol
