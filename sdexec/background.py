"""Processes that outlive their request's stream (RFC 42, current).

- **Background mode**: an ``sdexec.exec`` request whose envelope says
  ``"streaming": false`` gets one response, ``started`` or an error. The
  process runs on, with no client, until it ends or the service stops; its
  stdin is at EOF and its output is kept (bounded, :mod:`sdexec.retained`).
- **waitable** (flag 16): the process's end is kept after it ends until it
  is consumed, by ``sdexec.wait`` or by an ``attach`` that is sent its
  ``finished`` (an attach that ends before leaves it for the next).
- **attach**: a client takes a background process's output (retained, then
  live) and its end as a stream shaped like a streaming exec's; when it
  disconnects the process goes back to the background. The process is
  never held back by its client: its output is read on into its retained
  buffer, and the client is fed from there at the pace its connection
  takes it (:mod:`sdexec.attachfeed`). A client that falls so far behind
  that the buffer drops output it was not yet sent is told how much it
  lost, and its attach is ended (ENOBUFS), saying what is left to read
  (one not waitable is forgotten when it ends); the process goes back to
  the background.

:class:`Tracked` is what the service keeps of one such process beside its
:class:`~sdexec.process.Process`: it is the process's responder and output
tap. :class:`TrackedProcesses` finds processes by pid or label whatever
their connection, answers ``wait`` and ``attach``, and keeps the ended
waitable ones. The server's process table keys a background process by
``(NO_CLIENT, serial)``: it belongs to no connection.

A ``wait`` answer is written whole, up to 8 times ``retained-output`` as
JSON, whether the client reads it or not; an ``attach`` is fed as its
client reads, but its feed holds the retained output until it has sent it
all. So that ``max-waitable`` and ``max-background`` still bound that
memory, a process forgotten while its answer waits unread in a paused
connection (paused when it was written, and not resumed since) keeps the
slot it held counted until that connection has written everything (it
resumes) or has closed, and one forgotten while its attach is still fed
keeps it until the feed is done (all sent, or its connection closed): an
ended one kept for a wait held a waitable slot only. Other responses count
nothing: a connection paused for other reasons holds no slot of the
background processes it merely started.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import itertools
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, NamedTuple

from twisted.logger import Logger

from sdexec.attachfeed import AttachFeed
from sdexec.ioencode import encode_io
from sdexec.limits import check_text
from sdexec.plan import ExecPlan, RequestError
from sdexec.process import NO_EXIT_STATUS_ERRNO, OutputValve, Process, Responder
from sdexec.protocol import STATUS_AND_ERROR, ExecFlag, command_object
from sdexec.protocolbase import NOT_WAITABLE
from sdexec.refusal import SHOWN, expected, quoted
from sdexec.retained import CONFIG_KEY, STREAMS, Cursor, RetainedOutput
from sdexec.shares import Share

log = Logger()

__all__ = [
    "NOT_FOUND",
    "NO_CLIENT",
    "Mode",
    "Tracked",
    "TrackedProcesses",
    "parse_target",
]


#: The connection id of a process with no client (real ids start at 1).
NO_CLIENT = 0
#: How a wait or attach says that nothing has the pid or label it names.
NOT_FOUND = "not found (no such process)"
_OUTPUT_FLAGS = ExecFlag.STDOUT | ExecFlag.STDERR

ProcessKey = tuple[int, int]


class _Slot(NamedTuple):
    """The caps a forgotten process still counts against while its last
    responses wait unread."""

    waitable: bool
    background: bool
    #: Whose share of the caps it counts against (sdexec/shares.py).
    uid: int


#: A field of :class:`_Slot`: ``max-waitable``'s or ``max-background``'s.
_Cap = Literal["waitable", "background"]


class Mode(enum.StrEnum):
    """Who a process's responses go to (``sdexec.list``'s ``mode``)."""

    STREAMING = "streaming"  # the exec request's own stream
    BACKGROUND = "background"  # nobody: output is retained
    ATTACHED = "attached"  # an attach request's stream


@dataclasses.dataclass
class _Client:
    """A request waiting on a tracked process, and the connection it came on."""

    connection_id: int
    responder: Responder
    #: The output streams it takes (none for a waiter).
    flags: ExecFlag
    #: An attach's connection's back-pressure on what it is sent.
    valve: OutputValve | None = None
    #: The connection's peer uid (``None``: not known), as a refusal to
    #: another request names what holds the process.
    uid: int | None = None

    def where(self, other: _Client) -> str:
        """Where this request, which holds the process, is, as a refusal of
        ``other``'s names it: on ``other``'s own connection, or on another,
        with its uid (every user served may list every process; an admin
        needs to know whose client holds it)."""
        if self.connection_id == other.connection_id:
            return "this connection"
        whose = "" if self.uid is None else f", of uid {self.uid}"
        return f"another connection{whose}"

    def forwards(self, stream: str) -> bool:
        flag = ExecFlag.STDOUT if stream == "stdout" else ExecFlag.STDERR
        return bool(self.flags & flag)


#: Refusals in upstream's words (libsubprocess's server.c, Flux's sdexec
#: module), which Flux's own tests grep for ("not waitable", "not found",
#: "already has a client attached", "client attached"): a site's scripts
#: written against Flux may too (and :data:`NOT_WAITABLE`).
_NOT_BACKGROUND = "not in background mode"

#: Who may have had a process's end (:attr:`Tracked._end_taken_by`).
_BY_ATTACH = "an attached client"
_BY_WAIT = "a wait"


class Tracked:
    """One background or waitable process: its mode, retained output, end,
    attached client and waiter. It stands between the
    :class:`~sdexec.process.Process` and whoever listens now."""

    def __init__(
        self,
        mode: Mode,
        waitable: bool,
        retained_size: int,
        rank: str,
        client: _Client,
        bufsizes: Mapping[str, int] | None = None,
        line_buffered: Collection[str] = (),
        uid: int = -1,
    ) -> None:
        self.mode = mode
        self.waitable = waitable
        #: Whose request started it: the share of the caps it counts
        #: against (sdexec/shares.py).
        self.uid = uid
        #: Started in the background (counted against max-background).
        self.background = mode is Mode.BACKGROUND
        #: The connection last sent what is written whatever its client
        #: reads (a wait answer, an attach's replay).
        self.sent_to: int | None = None
        #: That connection and its pause (see TrackedProcesses), if it was
        #: paused once that was written: it may wait there unread.
        self.unread: tuple[int, int] | None = None
        self.retained = RetainedOutput(retained_size)
        #: Each output stream's ``<stream>_BUFSIZE``: an attach's replay is
        #: split as live output is.
        self.bufsizes = dict(bufsizes or {})
        #: The output streams that are line-buffered (split at line ends).
        self.line_buffered = frozenset(line_buffered)
        self.process: Process | None = None  # set once it is made
        #: The ``finished`` response, once seen (replayed to a later attach
        #: whole, whatever keys it carries).
        self.finished: dict[str, Any] | None = None
        #: How the stream ended if not well: (errnum, errstr).
        self.failure: tuple[int, str] | None = None
        #: It ended so before ``finished`` (a job declared unkillable): a
        #: status known later (at the reap) is not its end.
        self._failed_unfinished = False
        #: The waiter asked for the status and output even where the stream
        #: ended with an error (``status_and_error``, an extension): the
        #: output alone beside an error before ``finished``.
        self._wait_with_status = False
        #: The unit is gone (the process was reaped); only the end remains.
        self.reaped = False
        #: What its ``sdexec.list`` entry adds once it is reaped and kept
        #: for a wait (its job's ``jobid``, which the job no longer gives).
        self.listed: dict[str, Any] = {}
        self._rank = rank
        #: The Process has ended its stream (it sends its end once): an
        #: attach from now on gets that end after its replay.
        self._stream_ended = False
        # Streaming: the exec stream. Background: the exec request until it
        # has its one response; then an attach stream, if any.
        self._client: _Client | None = client
        self._waiter: _Client | None = None
        #: An attach made while the start is under way: attached at
        #: ``started`` (RFC 42 refuses none for that; a client may send the
        #: exec and an attach by its label at once).
        self._attaching: _Client | None = None
        #: Who has had the process's end (an attach stream saw
        #: ``finished`` or its error, or a wait was answered): ``None``
        #: while nobody has. RFC 42: an end is delivered once. An attach
        #: has it once it is queued in its feed, but gives it back if the
        #: feed ends before sending it (:meth:`_feed_done`).
        self._end_taken_by: str | None = None
        #: Called when an attach's feed is done (its owner forgets the
        #: process then if the feed sent its end).
        self.on_feed_done: Callable[[Tracked], None] | None = None
        #: The last attach's feed: the attached client's, or one that still
        #: sends what came before the stream's end.
        self._feed: AttachFeed | None = None

    @property
    def pid(self) -> int:
        """The process id, ``-1`` until its command has one."""
        return self.process.pid if self.process and self.process.pid else -1

    @property
    def label(self) -> str | None:
        """The exec's label (``None``: none, or no process yet)."""
        return self.process.label if self.process else None

    @property
    def _started(self) -> bool:
        """Its command ran (also where the ``started`` went to nobody: a
        streaming client that left first)."""
        return self.process is not None and self.process.ran

    @property
    def attached(self) -> bool:
        """Whether an attach stream follows the process now."""
        return self.mode is Mode.ATTACHED

    @property
    def _attach_holder(self) -> _Client | None:
        """The attach that follows the process, or waits for its start."""
        if self.attached:
            return self._client
        return self._attaching

    def connected_to(self, connection_id: int) -> bool:
        """Whether a request of this connection waits on the process."""
        return self._feed_of(connection_id) is not None or any(
            client is not None and client.connection_id == connection_id
            for client in (self._client, self._waiter, self._attaching)
        )

    @property
    def feeding(self) -> bool:
        """Whether an attach is still fed its output (it holds the retained
        output meanwhile)."""
        return self._feed is not None and not self._feed.done

    @property
    def _end_pending(self) -> bool:
        """Whether an attach's feed has the process's end still to send."""
        feed = self._feed
        return (
            self._end_taken_by == _BY_ATTACH
            and feed is not None
            and not feed.done
            and not feed.sent_end
        )

    @property
    def end_consumed(self) -> bool:
        """Whether the process's end was delivered: a wait was answered, or
        an attach was sent it (not merely has it queued)."""
        return self._end_taken_by is not None and not self._end_pending

    def _feed_of(self, connection_id: int) -> AttachFeed | None:
        """The connection's attach that is still fed, if any."""
        feed = self._feed
        if feed is None or feed.done or feed.connection_id != connection_id:
            return None
        return feed

    # -- the Process's responder and tap ------------------------------------

    def respond(self, payload: dict[str, Any]) -> None:
        """One response of the process's stream (a
        :class:`~sdexec.process.Responder`'s): the streaming client's, or a
        background exec's one answer at ``started``."""
        kind = payload.get("type")
        if kind == "finished":
            self.finished = payload
            if self.attached:
                self._take_end(_BY_ATTACH)
        if self.mode is Mode.BACKGROUND and kind == "started":
            self._answer_exec(payload)
            self._attach_waiting()
        elif self._client is not None and self.mode is not Mode.BACKGROUND:
            self._client.responder.respond(payload)

    def error(self, errnum: int, errstr: str) -> None:
        """The stream's end (a :class:`~sdexec.process.Responder`'s): told to
        whoever follows the process (its client, an attach, a waiter), and
        kept for a wait or attach to come."""
        self._stream_ended = True
        if errnum != errno.ENODATA:
            self.failure = (errnum, errstr)
            self._failed_unfinished = self.finished is None
        attached = self.attached
        if attached:
            # As an attach made after it would; before the feed is given it,
            # which gives it back if it ends without sending it.
            self._take_end(_BY_ATTACH)
        client, self._client = self._client, None
        if client is not None and errnum == errno.ECANCELED and attached:
            # The service is stopping: it will not live to send what the
            # client has not read yet, and it must have this.
            assert self._feed is not None
            self._feed.abort(errnum, errstr)
        elif client is not None:
            client.responder.error(errnum, errstr)
        attaching, self._attaching = self._attaching, None
        if attaching is not None:  # it never started: as its exec was told
            attaching.responder.error(errnum, errstr)
        if attached:
            self._to_background()
        if self._waiter is not None and self._started:
            # Its unit may linger (a child the stop timer gave up on, a
            # job's unkillable processes): the end is known now.
            self._answer_waiter()

    def tap(self, stream: str, data: bytes, eof: bool) -> None:
        """Output as the process produced it: kept, and fed to an attached
        client that asked for the stream. Output also comes after a stream
        ended by an error (a unit left to linger, its children writing on):
        kept, it may drop what an attach still fed had not yet been sent
        of what came before that end, which ends the attach as ever."""
        at = self.retained.head
        if eof:
            self.retained.end(stream)
        else:
            self.retained.append(stream, data)
        client, feed = self._client, self._feed
        if feed is None or feed.done:
            return
        attached = self.attached and client is not None
        if attached and not eof and feed.send_live(stream, data, at):
            return  # (before the ring's loss is looked at: it may keep none)
        lost = feed.cursor.lost()
        if lost:
            self._fell_behind(feed, lost)
        elif client is None or not attached:
            return  # past the stream's end: none of it is the client's
        elif eof:
            if client.forwards(stream):
                client.responder.respond(self._output(stream, data, eof))
        else:
            feed.pump()  # the client is behind: it is sent this in its turn

    # -- requests ------------------------------------------------------------

    def wait(self, waiter: _Client, name: str, with_status: bool = False) -> None:
        """Answer ``waiter`` once the process has ended (now, if it has);
        ``with_status``: with its status (if ``finished`` came first) and
        output beside an error that ended the stream, rather than that
        error alone. A refusal calls the process ``name``: as the request
        named it (by label: its user may not know the pid)."""
        if not self.waitable:
            raise RequestError(errno.EINVAL, f"{name}: {NOT_WAITABLE}")
        if self._waiter is not None:
            # EINVAL and these words as upstream's subprocess server, which
            # Flux's own tests look for.
            raise RequestError(
                errno.EINVAL,
                f"{name}: process is already being waited on"
                f" (a wait on {self._waiter.where(waiter)})",
            )
        if self._attach_holder is not None:
            raise RequestError(
                errno.EBUSY,
                f"{name}: has a client attached"
                f" (an attach on {self._attach_holder.where(waiter)})",
            )
        self._check_end_not_pending(name)
        if self._end_taken_by is not None:
            raise RequestError(errno.ESRCH, self._end_gone(name))
        self._waiter = waiter
        self._wait_with_status = with_status
        if self.reaped or self._stream_ended:
            self._answer_waiter()

    def attach(self, client: _Client, name: str) -> None:
        """Make ``client`` the process's stream: ``attached``, the retained
        output, EOFs of streams that have ended, ``finished`` if known, and
        the rest as it comes; once it has started, if its start is under
        way. A refusal calls the process ``name``, as :meth:`wait`'s."""
        if self.mode is Mode.STREAMING and not self.reaped:
            raise RequestError(errno.EBUSY, f"{name}: {_NOT_BACKGROUND}")
        if self._attach_holder is not None:
            raise RequestError(
                errno.EBUSY,
                f"{name}: already has a client attached"
                f" (an attach on {self._attach_holder.where(client)})",
            )
        if self._waiter is not None:
            raise RequestError(
                errno.EBUSY,
                f"{name}: a wait is pending on {self._waiter.where(client)}",
            )
        self._check_end_not_pending(name)
        if self._end_taken_by is not None:
            # Its unit lingers on (a child, the stop timer), but RFC 42: an
            # end delivered is not delivered again.
            raise RequestError(errno.ENOENT, self._end_gone(name))
        if self._started:
            self._attach(client)
        elif self._stream_ended:
            # Refused before it ran (RFC 42: no such process); it is
            # forgotten at its reap.
            errstr = self.failure[1] if self.failure else "no exit status"
            raise RequestError(errno.ENOENT, f"{name}: never started: {errstr}")
        else:
            self._attaching = client

    def _check_end_not_pending(self, name: str) -> None:
        """EBUSY while an attach still has the end to send: it is the next
        wait's or attach's again if that attach ends first."""
        if self._end_pending:
            raise RequestError(
                errno.EBUSY,
                f"{name}: has ended, and its end is being sent to an attached client",
            )

    def _attach_waiting(self) -> None:
        """The process has started: the attach made meanwhile, if any, has
        its stream now."""
        client, self._attaching = self._attaching, None
        if client is not None:
            self._attach(client)
            # Its replay is empty (no output comes before `started`): it
            # holds no slot, whatever its connection reads.
            self.sent_to = None

    def _attach(self, client: _Client) -> None:
        """``attached``, then the retained output and what comes after it,
        fed at the client's pace: ``client``'s responder is its feed from
        now on."""
        taken = [stream for stream in STREAMS if client.forwards(stream)]
        cursor = Cursor(self.retained, self.bufsizes, self.line_buffered, taken)
        client.responder.respond(self._attached(cursor.dropped))
        feed = AttachFeed(
            client.connection_id,
            client.responder,
            cursor,
            lambda stream, data: self._output(stream, data, eof=False),
            client.valve,
            self._feed_done,
        )
        client = dataclasses.replace(client, responder=feed)
        self.mode, self._client, self._feed = Mode.ATTACHED, client, feed
        # The connection may be sent a piece of the replay beyond its
        # buffer (sent_to): the last may wait there unread.
        self.sent_to = client.connection_id
        feed.pump()  # the replay, as far as the connection takes it
        for stream in STREAMS:
            ended = self.reaped or self.retained.at_eof(stream)
            if ended and client.forwards(stream):
                client.responder.respond(self._output(stream, b"", eof=True))
        if self.finished is not None and not self._failed_unfinished:
            self._take_end(_BY_ATTACH)
            client.responder.respond(self.finished)
        if self.reaped or self._stream_ended:
            # Ended (its unit may linger, abandoned to the stop timer or a
            # job's unkillable processes): this attach has the end, and the
            # process is forgotten once reaped.
            self._take_end(_BY_ATTACH)
            self.error(*(self.failure or (errno.ENODATA, "")))

    def _feed_done(self, feed: AttachFeed) -> None:
        """``feed`` sends nothing more: an end it took and never sent (its
        client left, it fell behind, it was ended) is kept for the next
        wait or attach, as if it had never attached."""
        if self._end_taken_by == _BY_ATTACH and not feed.sent_end:
            self._end_taken_by = None
        if self.on_feed_done is not None:
            self.on_feed_done(self)

    def drop_client(self, connection_id: int) -> None:
        """The connection has gone: forget its requests. An attached process
        goes back to the background; a waiter's status stays for the next."""
        self._drop_waiter(connection_id)
        self._detach(connection_id)
        self._drop_attaching(connection_id)
        feed = self._feed_of(connection_id)
        if feed is not None:
            feed.drop()
        client = self._client
        if client is not None and client.connection_id == connection_id:
            self._client = None  # its exec's stream: nobody to answer now

    def end_wait_and_attach(self, connection_id: int, errnum: int, reason: str) -> int:
        """End the connection's wait on and attach to the process with
        ``errnum``, saying ``reason``, as if it had closed
        (:meth:`drop_client`), but for the stream of its exec, if it started
        the process: that runs on. How many requests were ended."""
        kept = f"wait is ended, and {self._name}'s end is kept for the next wait"
        back = f"attach is ended, and {self._state_now}"
        ended = [
            (self._drop_waiter(connection_id), kept),
            (self._drop_attaching(connection_id), back),
        ]
        for client, what in ended:
            if client is not None:
                client.responder.error(errnum, f"{reason}: this {what}")
        feed = self._feed_of(connection_id)
        if feed is not None:
            # Now, not after what it was not yet sent. One whose process's
            # stream had ended (it was sent what came before that end)
            # was attached no more.
            attached = self._detach(connection_id) is not None
            feed.abort(
                errnum, f"{reason}: this {back if attached else 'attach is ended'}"
            )
        return sum(client is not None for client, _ in ended) + (feed is not None)

    def cancel_feed(self, errnum: int, errstr: str) -> None:
        """The service stops: an attach still fed the output of a process
        whose stream has ended (it will not live to send the rest) ends
        now with ``errnum``, as every stream does then, not with the EOF
        of its connection at the exit."""
        feed = self._feed
        if feed is not None and not feed.done:
            feed.abort(errnum, errstr)

    def _fell_behind(self, feed: AttachFeed, lost: dict[str, int]) -> None:
        """The retained output dropped ``lost`` bytes (by stream) that the
        attach fed by ``feed`` had not been sent: end it, saying so (after
        what it was sent: nothing after the gap would be in order), and the
        process goes back to the background."""
        if not self.end_consumed:
            after = self._left_to_read()
        else:  # `finished` went to this attach, which took the end
            after = f"what {self._name} writes from now on is dropped"
        self._detach(feed.connection_id)  # before the error: nothing after it
        missed = " and ".join(f"{count} bytes of {s}" for s, count in lost.items())
        # The admin's to know too: a client ended so looks like a failure
        # of the service to whoever ran it. (One line an attach.)
        log.info(
            "connection {id}: attach to {name} ended: its client fell behind,"
            " and lost {missed}",
            id=feed.connection_id,
            name=self._name,
            missed=missed,
        )
        feed.abort(
            errno.ENOBUFS,
            f"{self._name}: the client fell behind by more than the retained"
            f" output ({self.retained.size} bytes, {CONFIG_KEY}): {missed} it had"
            f" not yet been sent were dropped: this attach is ended, and {after}",
        )

    def _drop_waiter(self, connection_id: int) -> _Client | None:
        """Forget the connection's wait (returned, if it had one): the
        status stays for the next."""
        waiter = self._waiter
        if waiter is None or waiter.connection_id != connection_id:
            return None
        self._waiter = None
        return waiter

    def _drop_attaching(self, connection_id: int) -> _Client | None:
        """Forget the connection's attach that waits for the start
        (returned, if it has one)."""
        client = self._attaching
        if client is None or client.connection_id != connection_id:
            return None
        self._attaching = None
        return client

    def _detach(self, connection_id: int) -> _Client | None:
        """Forget the connection's attach (returned, if it is attached): the
        process goes back to the background."""
        client = self._client
        if not self.attached or client is None or client.connection_id != connection_id:
            return None
        self._client = None
        self._to_background()
        return client

    def _to_background(self) -> None:
        """Attached no more: its output is only retained from now on. (Its
        feed sends on what came before, if anything waits, unless it was
        ended or dropped.)"""
        self.mode = Mode.BACKGROUND

    def process_reaped(self) -> bool:
        """The unit is gone; whether its end must be kept for a wait or an
        attach (else the process is forgotten)."""
        self.reaped = True
        process = self.process
        if (
            self.finished is None
            and process is not None
            and process.exit_status is not None
        ):
            # Finished after its client left: a streaming process's responder
            # is then nobody.
            self.finished = {"type": "finished", "status": process.exit_status}
        if self._waiter is not None:
            self._answer_waiter()
            return False
        ended_known = self.finished is not None or self.failure is not None
        return (
            self.waitable
            and self._started
            and ended_known
            and not self.end_consumed  # (an attach may have it still to send)
        )

    # -- responses -------------------------------------------------------------

    @property
    def _name(self) -> str:
        return (
            f"pid {self.pid}" if self.pid > 0 else f"label {quoted(self.label, SHOWN)}"
        )

    @property
    def _state_now(self) -> str:
        """Where the process is once its attach is ended: it may have ended
        meanwhile (its ``finished`` waiting behind output not yet sent)."""
        if self.finished is not None:
            return f"{self._name} has ended"
        if self._stream_ended or self.reaped:
            return f"{self._name}'s stream has ended"
        return f"{self._name} runs on in the background"

    def _left_to_read(self) -> str:
        """What an attach ended before it was sent the process's end leaves
        to read, said as it will be: the end, not delivered, is kept for the
        next wait or attach once this feed is ended (:meth:`_feed_done`),
        but only a waitable process is kept after it ends (the owner forgets
        one that is not at its reap, its output with it)."""
        ended = self.finished is not None or self._stream_ended or self.reaped
        if self.waitable:
            kept = "its output and end kept" if ended else "its output kept"
            return f"{self._state_now}, {kept}: attach again to read on"
        if ended:
            return (
                f"{self._state_now} and it is not waitable: it is forgotten once"
                " its unit is gone, its output with it"
            )
        return (
            f"{self._state_now}, its output kept until it ends (it is not"
            " waitable): attach again before then to read on"
        )

    def _end_gone(self, name: str) -> str:
        return f"{name}: has ended, and its end went to {self._end_taken_by}"

    def _take_end(self, by: str) -> None:
        """The end is delivered to ``by``; the first to have it keeps it."""
        if self._end_taken_by is None:
            self._end_taken_by = by

    def _answer_exec(self, started: dict[str, Any]) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.responder.respond(started)

    def _answer_waiter(self) -> None:
        waiter, self._waiter = self._waiter, None
        assert waiter is not None
        self._take_end(_BY_WAIT)
        self.sent_to = waiter.connection_id
        finished = self.finished
        if finished is None or self._answers_an_error():
            # As the stream ended: a wait made before the reap got this too.
            failure = self.failure or (NO_EXIT_STATUS_ERRNO, "no exit status")
            if self._wait_with_status:
                # No status (its end is the error, not `finished`: a job
                # declared unkillable), but the output, which says why the
                # job ignored its signals: an attach replays it too.
                waiter.responder.respond(self._wait_answer(failure))
            else:
                waiter.responder.error(*failure)  # upstream's answer
            return
        # The status with the receipt `finished` carried (an OOM kill said
        # as such, not by a bare 137), and what ended the stream after the
        # command finished (the stop timer gave up on what it left), if
        # anything.
        answer = {**_status_and_receipt(finished), **self._wait_answer(self.failure)}
        waiter.responder.respond(answer)

    def _wait_answer(self, failure: tuple[int, str] | None) -> dict[str, Any]:
        """A wait's answer without its status: the retained output, and
        ``failure`` (what ended the stream with an error) as ``"error"``."""
        answer: dict[str, Any] = {
            "output": self.retained.io_objects(self._rank),
            "dropped": self.retained.dropped,
        }
        if failure is not None:
            errnum, errstr = failure
            answer["error"] = {"errnum": errnum, "errstr": errstr}
        return answer

    def _answers_an_error(self) -> bool:
        """Whether the wait's answer (once ``finished`` is known) is the
        error that ended the stream, not the status: one before ``finished``
        always (beside the output, with ``status_and_error``); one
        after it (the stop timer gave up on what the command left) unless
        the waiter asked for the status beside it. Upstream's sdexec answers
        that error alone, and Flux's job-exec (bgexec) drains the rank and
        counts the shell lost on it: a status beside it read as a clean exit
        there (review session 40 P F3)."""
        if self._failed_unfinished:
            return True
        return self.failure is not None and not self._wait_with_status

    def _attached(self, dropped: dict[str, int]) -> dict[str, Any]:
        assert self.process is not None
        command = self.process.plan.command
        cmd = command_object(
            command.cmdline, command.env, command.opts, command.cwd, command.label
        )
        return {
            "type": "attached",
            "pid": self.pid,
            "cmd": cmd,
            "dropped": dropped,
        }

    def _output(self, stream: str, data: bytes, eof: bool) -> dict[str, Any]:
        return {
            "type": "output",
            "pid": self.pid,
            "io": encode_io(stream, self._rank, data, eof),
        }


class TrackedProcesses:
    """The service's background and waitable processes: found by pid or
    label whatever their connection, kept after they end while waitable.

    Every process the server tables is findable (:meth:`findable`, then
    :meth:`pid_known`) until it is reaped, or, kept for a wait, until its
    end is consumed: found by label or pid in an index, not a walk of every
    process (a read of kills by pid held the reactor a second at 2000).
    """

    def __init__(self) -> None:
        self._tracked: dict[Process, Tracked] = {}
        #: Ended waitable processes, oldest first, until waited for.
        self._ended: dict[Process, Tracked] = {}
        #: The findable processes by label (one each, RFC 42), and by pid
        #: (an older one lingers after its main process exited; a pid may
        #: be reused).
        self._by_label: dict[str, Process] = {}
        self._by_pid: dict[int, dict[Process, None]] = {}
        self._serials = itertools.count(1)
        #: Connections whose buffer of responses is full (paused).
        self._paused: set[int] = set()
        #: By connection, how many times it has resumed: what was written
        #: before its last resume has been read.
        self._resumes: dict[int, int] = {}
        #: By paused connection, the slots of the processes forgotten while
        #: what was last sent of them waits there unread.
        self._unread: dict[int, list[_Slot]] = {}
        #: Processes forgotten while an attach is still fed their output
        #: (it holds their retained output), and the slots they held.
        self._draining: dict[Tracked, _Slot] = {}

    def prepare(
        self,
        plan: ExecPlan,
        streaming: bool,
        responder: Responder,
        connection_id: int,
        retained_size: int,
        rank: str,
        limits: Any,
        share: Share,
    ) -> tuple[ExecPlan, Tracked | None]:
        """The plan to run and the :class:`Tracked` to use as the process's
        responder and tap, or ``None`` for a plain streaming process.

        A background request's output flags are ignored (everything is
        retained; an attach chooses), and write-credit is refused: its stdin
        is at EOF. A waitable one is refused (EAGAIN) while ``share``
        holds the ``max-waitable`` of ``limits`` (the ``[sdexec]`` table)
        already (its ``max-waitable-per-user`` for a user of allow-users), a
        background one while it runs its ``max-background``."""
        waitable = bool(plan.flags & ExecFlag.WAITABLE)
        if waitable:
            self._check_waitable_room(limits, share)
        if streaming and not waitable:
            return plan, None
        if not streaming:
            self._check_background_room(limits, share)
            if plan.flags & ExecFlag.WRITE_CREDIT:
                raise RequestError(
                    errno.EINVAL,
                    "flags: write-credit (8) needs a streaming request:"
                    " a background process's stdin is at EOF",
                )
            flags = ExecFlag(int(plan.flags) & ~int(_OUTPUT_FLAGS))
            plan = dataclasses.replace(plan, flags=flags)
        mode = Mode.STREAMING if streaming else Mode.BACKGROUND
        client = _Client(connection_id, responder, plan.flags)
        bufsizes = {name: options.bufsize for name, options in plan.output.items()}
        line_buffered = [
            name for name, options in plan.output.items() if options.line_buffered
        ]
        tracked = Tracked(
            mode,
            waitable,
            retained_size,
            rank,
            client,
            bufsizes,
            line_buffered,
            uid=share.uid,
        )
        return plan, tracked

    def waitable_held(self, uid: int | None = None) -> int:
        """Waitable processes running, ended and not yet waited for, or
        whose end was sent to a client that has not read it yet: ``uid``'s
        (``None``: everyone's)."""
        running = self._counted("waitable", self._tracked.values(), uid)
        ended = self._counted("waitable", self._ended.values(), uid)
        return running + ended + self._unread_slots("waitable", uid)

    def background_held(self, uid: int | None = None) -> int:
        """Background processes running, or ended while what was sent of
        them waits unread: ``uid``'s (``None``: everyone's)."""
        running = self._counted("background", self._tracked.values(), uid)
        return running + self._unread_slots("background", uid)

    def uids(self) -> set[int]:
        """The uids whose processes count against a cap here."""
        slots = [slot for slots in self._unread.values() for slot in slots]
        return {
            *(one.uid for one in self._tracked.values()),
            *(one.uid for one in self._ended.values()),
            *(slot.uid for slot in [*slots, *self._still_draining()]),
        }

    @staticmethod
    def _counted(cap: _Cap, tracked: Collection[Tracked], uid: int | None) -> int:
        """How many of ``tracked`` count against ``cap``, of ``uid``'s."""
        return sum(
            1
            for one in tracked
            if getattr(one, cap) and (uid is None or one.uid == uid)
        )

    def _check_waitable_room(self, limits: Any, share: Share) -> None:
        # Refused, not evicted: dropping the oldest ended one would lose a
        # status somebody may still wait for. Each ended one holds up to
        # retained-output bytes (also while an attach that consumed it is
        # still fed it), and each answer not yet read up to 8 times that as
        # JSON, so this bounds the memory they take.
        held = self.waitable_held(share.uid)
        allows = share.at_cap(limits, "max-waitable", held)
        if allows is not None:
            note = self._unread_note("waitable", "answered", share.uid)
            raise RequestError(
                errno.EAGAIN,
                f"flags: too many waitable processes{share.whose()}: {held}"
                f" running or not yet waited for{note}, {allows}"
                " (sdexec wait reaps one)",
            )

    def _check_background_room(self, limits: Any, share: Share) -> None:
        # Each holds up to retained-output bytes while it runs, and after it
        # ends while an attach is still fed it: without a bound on their
        # number, that memory had none.
        running = self.background_held(share.uid)
        allows = share.at_cap(limits, "max-background", running)
        if allows is not None:
            note = self._unread_note("background", "ended", share.uid)
            raise RequestError(
                errno.EAGAIN,
                f"too many background processes{share.whose()}: {running}"
                f" running{note}, {allows}",
            )

    def _unread_slots(self, cap: _Cap, uid: int | None = None) -> int:
        """Forgotten processes still counted against ``cap`` (a
        :class:`_Slot` field), ``uid``'s (``None``: everyone's): their last
        responses are not yet read."""
        unread = [slot for slots in self._unread.values() for slot in slots]
        return sum(
            getattr(slot, cap)
            for slot in [*unread, *self._still_draining()]
            if uid is None or slot.uid == uid
        )

    def _still_draining(self) -> list[_Slot]:
        """The slots of the forgotten processes an attach is still fed
        (those done with are forgotten here)."""
        self._draining = {
            tracked: slot for tracked, slot in self._draining.items() if tracked.feeding
        }
        return list(self._draining.values())

    def _unread_note(self, cap: _Cap, done: str, uid: int) -> str:
        """What the refusal of ``cap`` says of the slots of ``uid`` it
        counts for responses not yet read (nothing if none)."""
        unread = self._unread_slots(cap, uid)
        if not unread:
            return ""
        return f" ({unread} of them {done}, not yet read by the client)"

    def new_key(self) -> ProcessKey:
        """The process table key of a new background process."""
        return (NO_CLIENT, next(self._serials))

    def findable(self, process: Process) -> None:
        """``process`` (just tabled) may be found by its label, and by its
        pid once that is known."""
        if process.label is not None:
            self._by_label[process.label] = process

    def pid_known(self, process: Process) -> None:
        """``process`` has started: a ``wait`` or ``attach`` by its pid
        finds it from now on."""
        assert process.pid is not None
        self._by_pid.setdefault(process.pid, {})[process] = None

    def _unfindable(self, process: Process) -> None:
        if process.label is not None and self._by_label.get(process.label) is process:
            del self._by_label[process.label]
        same_pid = self._by_pid.get(process.pid or 0)
        if same_pid is not None:
            same_pid.pop(process, None)
            if not same_pid:
                del self._by_pid[process.pid or 0]

    def add(self, process: Process, tracked: Tracked) -> None:
        """Track ``process``, made from the plan :meth:`prepare` gave with
        ``tracked``."""
        tracked.process = process
        tracked.on_feed_done = self._settle
        self._tracked[process] = tracked

    def reaped(self, process: Process, listed: Mapping[str, Any] | None = None) -> None:
        """The server reaped ``process``: keep its end if it is waitable,
        listed with ``listed`` added to its entry."""
        tracked = self._tracked.pop(process, None)
        if tracked is not None:
            kept = tracked.process_reaped()  # a waiter may be answered now
            self._note_unread(tracked)
            if kept:
                tracked.listed = dict(listed or {})
                self._ended[process] = tracked
                return
            self._forget(
                tracked, _Slot(tracked.waitable, tracked.background, tracked.uid)
            )
        self._unfindable(process)

    def _note_unread(self, tracked: Tracked) -> None:
        """What was just written of ``tracked`` whatever its client reads
        went to a paused connection: it may wait there unread."""
        # Taken: a later call (a wait not answered yet) must not find an
        # old replay's connection there.
        connection_id, tracked.sent_to = tracked.sent_to, None
        if connection_id is not None and connection_id in self._paused:
            tracked.unread = (connection_id, self._resumes.get(connection_id, 0))

    def _forget(self, tracked: Tracked, slot: _Slot) -> None:
        """``tracked`` is done with; while its wait answer waits unread in a
        paused connection (paused since it was written), or an attach is
        still fed its output, the ``slot`` it held stays counted."""
        if tracked.feeding:
            self._draining[tracked] = slot  # (counted once: not as unread too)
            return
        if tracked.unread is None:
            return
        connection_id, resumes = tracked.unread
        unread = self._resumes.get(connection_id, 0) == resumes
        if unread and connection_id in self._paused:
            self._unread.setdefault(connection_id, []).append(slot)

    def connection_paused(self, connection_id: int) -> None:
        """The connection's buffer of responses is full: what is sent to it
        now waits there, unread."""
        self._paused.add(connection_id)

    def connection_resumed(self, connection_id: int) -> None:
        """The connection has written out everything it was sent: the
        processes forgotten meanwhile count no more."""
        if connection_id in self._paused:
            self._paused.discard(connection_id)
            self._resumes[connection_id] = self._resumes.get(connection_id, 0) + 1
        self._unread.pop(connection_id, None)

    def mode(self, process: Process) -> Mode:
        """How ``process`` runs: streaming to its client unless it is
        tracked as waitable or in the background."""
        tracked = self._tracked.get(process)
        return tracked.mode if tracked is not None else Mode.STREAMING

    def uid_of(self, process: Process) -> int | None:
        """The uid whose request started ``process``, if it is tracked
        (running or ended and kept)."""
        tracked = self._tracked.get(process) or self._ended.get(process)
        return None if tracked is None else tracked.uid

    def holds_label(self, label: str) -> bool:
        """Whether an ended process kept for a wait carries ``label``."""
        process = self._by_label.get(label)
        return process is not None and process in self._ended

    @property
    def ended_count(self) -> int:
        """How many ended processes are kept for a wait."""
        return len(self._ended)

    def describe_ended(
        self, describe: Callable[[Process], dict[str, Any]] = Process.describe
    ) -> list[dict[str, Any]]:
        """``sdexec.list`` entries (or others, by ``describe``) of the ended
        processes kept for a wait."""
        return [
            {**describe(process), "mode": tracked.mode, **tracked.listed}
            for process, tracked in self._ended.items()
        ]

    def connection_lost(self, connection_id: int) -> None:
        """Forget the connection's waits and attaches, and what it had not
        yet written."""
        self.connection_resumed(connection_id)
        self._resumes.pop(connection_id, None)
        for tracked in self._connected_to(connection_id):
            tracked.drop_client(connection_id)

    def end_waits_and_attaches(
        self, connection_id: int, errnum: int, reason: str
    ) -> int:
        """End the connection's waits and attaches with ``errnum``, saying
        ``reason`` (its user may use the service no more): each waiter's
        status stays for the next wait, and each attached process goes back
        to the background. What it started runs on, its exec streams too.
        How many requests were ended."""
        return sum(
            tracked.end_wait_and_attach(connection_id, errnum, reason)
            for tracked in self._connected_to(connection_id)
        )

    def cancel_feeds(self, errnum: int, errstr: str) -> None:
        """The service stops: end every attach still fed, with ``errnum``
        (:meth:`Tracked.cancel_feed`); those of the processes it cancels
        are ended by their cancel, but those of processes reaped already,
        kept for a wait or forgotten, are not among them."""
        self._still_draining()
        every = [*self._tracked.values(), *self._ended.values(), *self._draining]
        for tracked in every:
            tracked.cancel_feed(errnum, errstr)

    def _connected_to(self, connection_id: int) -> list[Tracked]:
        """The processes, running or ended, that a request of the connection
        waits on."""
        self._still_draining()
        every = [*self._tracked.values(), *self._ended.values(), *self._draining]
        return [tracked for tracked in every if tracked.connected_to(connection_id)]

    # -- wait and attach -----------------------------------------------------------

    def wait(
        self,
        payload: Any,
        connection_id: int,
        responder: Responder,
        uid: int | None = None,
    ) -> None:
        """``sdexec.wait`` on connection ``connection_id`` of ``uid``: the
        response goes to ``responder`` once the process has ended, and the
        process is then forgotten."""
        pid, label = parse_target(payload, "wait")
        with_status = payload.get(STATUS_AND_ERROR, False)
        if not isinstance(with_status, bool):
            raise RequestError(
                errno.EINVAL, expected(STATUS_AND_ERROR, "a boolean", with_status)
            )
        # ESRCH for none, as upstream's subprocess servers answer a wait.
        tracked = self._find(
            pid, label, errno.EINVAL, NOT_WAITABLE, missing=errno.ESRCH
        )
        # Refused, it is named as the request named it (`sdexec wait JOB`
        # said "pid 4242: process is not waitable …").
        client = _Client(connection_id, responder, ExecFlag(0), uid=uid)
        tracked.wait(client, _target(pid, label), with_status)
        self._settle(tracked)

    def attach(
        self,
        payload: Any,
        connection_id: int,
        responder: Responder,
        valve: OutputValve | None = None,
        uid: int | None = None,
    ) -> None:
        """``sdexec.attach`` on connection ``connection_id`` of ``uid``:
        ``responder`` gets the process's stream, its output held back by
        ``valve``, the connection's."""
        pid, label = parse_target(payload, "attach")
        flags = payload.get("flags", int(_OUTPUT_FLAGS))
        if not isinstance(flags, int) or isinstance(flags, bool) or flags & ~7:
            raise RequestError(
                errno.EINVAL, expected("flags", "an integer of 1|2|4", flags)
            )
        # RFC 42 lets an attach ask for channel output (4), which flux-core's
        # client does whenever its caller takes channel output: there is
        # none (sdexec makes no channels), so it is ignored.
        flags &= int(_OUTPUT_FLAGS)
        tracked = self._find(pid, label, errno.EBUSY, _NOT_BACKGROUND)
        client = _Client(connection_id, responder, ExecFlag(flags), valve, uid)
        tracked.attach(client, _target(pid, label))
        # (Not yet consumed if its end waits behind output the connection
        # has not taken: forgotten once its feed has sent it.)
        self._settle(tracked)

    def _settle(self, tracked: Tracked) -> None:
        """After a wait or attach on ``tracked`` or the end of an attach's
        feed: what was written may wait unread, and the process is
        forgotten if its end was delivered."""
        self._note_unread(tracked)
        self._forget_if_consumed(tracked)

    def _forget_if_consumed(self, tracked: Tracked) -> None:
        process = tracked.process
        if (
            tracked.reaped
            and tracked.end_consumed
            and process is not None
            and process in self._ended
        ):
            del self._ended[process]
            self._unfindable(process)
            # Ended, it held a waitable slot only.
            self._forget(
                tracked, _Slot(waitable=True, background=False, uid=tracked.uid)
            )

    def _find(
        self,
        pid: int | None,
        label: str | None,
        errnum: int,
        untracked: str,
        missing: int = errno.ENOENT,
    ) -> Tracked:
        """The process with ``label`` (if given) or else the newest with
        ``pid``, running or ended; ``missing`` (RFC 42's ENOENT for an
        attach) if there is none, ``errnum`` (saying ``untracked``) if it is
        a plain streaming process."""
        newest = self.newest(pid, label)
        if newest is None:
            raise RequestError(missing, f"{_target(pid, label)}: {NOT_FOUND}")
        tracked = self._tracked.get(newest) or self._ended.get(newest)
        if tracked is None:
            raise RequestError(errnum, f"{_target(pid, label)}: {untracked}")
        return tracked

    def ended_and_kept(self, pid: int | None, label: str | None) -> bool:
        """Whether the process :meth:`newest` finds by ``label`` or ``pid``
        has ended and is kept for a wait (listed, state ``Z``)."""
        return self.newest(pid, label) in self._ended

    def kept(self, key: str, value: Any) -> Process | None:
        """The ended process kept for a wait that a ``terminate``'s
        ``key=value`` names, if any: by ``pid`` or ``label`` as
        :meth:`newest` finds it, by ``jobid`` the newest whose entry lists
        that job (a job is forgotten once its process is reaped)."""
        if key == "jobid":
            named = (
                p for p, t in self._ended.items() if t.listed.get("jobid") == value
            )
            return max(named, key=lambda process: process.serial, default=None)
        newest = self.newest(value, None) if key == "pid" else self.newest(None, value)
        return newest if newest in self._ended else None

    def newest(self, pid: int | None, label: str | None) -> Process | None:
        """The newest process, running or ended and kept, with ``label`` (if
        given) or else ``pid``: an older one with the pid lingers only after
        its main process exited, and the pid may have been reused."""
        if label is not None:
            return self._by_label.get(label)
        same_pid = self._by_pid.get(pid) if pid is not None else None
        return max(same_pid or (), key=lambda process: process.serial, default=None)


def _check_target(payload: Any, topic: str) -> tuple[int | None, str | None]:
    """The ``pid`` and ``label`` a ``topic`` payload names a process by, as
    given (at least one); EINVAL names a bad or missing field."""
    pid, label = payload.get("pid"), payload.get("label")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
        raise RequestError(errno.EINVAL, expected("pid", "an integer", pid))
    if label is not None and not isinstance(label, str):
        raise RequestError(errno.EINVAL, expected("label", "a string", label))
    if label is not None:
        check_text("label", label)  # a NUL or lone surrogate: EINVAL, as exec's
    if pid is None and label is None:
        raise RequestError(errno.EINVAL, f"{topic} needs a pid or a label")
    return pid, label


def parse_target(payload: Any, topic: str) -> tuple[int | None, str | None]:
    """``(pid, label)`` of a ``kill``, ``wait`` or ``attach`` payload, the
    label winning over the pid; EINVAL names a bad or missing field."""
    pid, label = _check_target(payload, topic)
    return (None, label) if label is not None else (pid, None)


def _target(pid: int | None, label: str | None) -> str:
    return f"label {quoted(label, SHOWN)}" if label is not None else f"pid {pid}"


def _status_and_receipt(finished: dict[str, Any]) -> dict[str, Any]:
    """A ``finished`` response without its type: the wait status, and the
    receipt's keys where the service read them (docs/protocol.md, "The
    receipt on ``finished``")."""
    return {key: value for key, value in finished.items() if key != "type"}
