"""One process run as a transient unit: Flux's ``sdproc``.

:class:`Process` owns the three channels, the unit's property watch and the
stop timer, and turns unit state changes into RFC 42 responses, in order:
``add-credit`` (with write-credit), ``started``, ``output``…, ``finished``,
then — once the unit is inactive and stdout and stderr have reached EOF —
the ``ENODATA`` error that ends the stream. Data flows one way: the request
made it, systemd's events drive it, responses leave through its
:class:`Responder`.
"""

from __future__ import annotations

import enum
import errno
import functools
import itertools
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sdexec.config import DEFAULT_RECONNECT_TIMEOUT, DEFAULT_START_TIMEOUT
from sdexec.drain import AdminCause, Cause
from sdexec.ioencode import encode_io
from sdexec.limits import listed_cmdline, listed_name
from sdexec.lograte import LogRate
from sdexec.managerversion import version_number
from sdexec.orphans import expected_unit_cgroup, unit_cgroup
from sdexec.passthrough import NO_STDIO, PassedStdio
from sdexec.plan import ExecPlan, NamedPath, RequestError
from sdexec.protocol import ExecFlag
from sdexec.receipt import OOM_KILL, finished_extensions, unit_cgroup_exists
from sdexec.refusal import errno_name
from sdexec.systemd import (
    Manager,
    UnitStatus,
    Watch,
    explain_start_refusal,
    not_taken_property,
    queued_job,
)
from sdexec.systemd.channel import (
    InputChannel,
    OutputChannel,
    OutputGate,
    StdinOverrun,
    socketpair_for_systemd,
)
from sdexec.systemd.errors import (
    UNIT_EXISTS,
    failure_value,
    is_connection_lost,
    start_lost,
    start_lost_in_flight,
    start_may_have_run,
    start_refusal_errno,
    start_timed_out,
)
from sdexec.systemd.retry import CallBackoff, CallFailure, classify_call_failure
from sdexec.systemd.unit import (
    EXIT_NAMESPACE,
    NOT_STARTED_ERRNO,
    checks_failed,
    never_invoked,
    start_job_ended_unstarted,
    why_unstarted,
)
from sdexec.systemd.window import CallWithdrawn
from sdexec.unitstop import StopTimer

__all__ = [
    "OutputTap",
    "OutputValve",
    "Process",
    "ProcessContext",
    "Responder",
    "Sent",
    "UnitCall",
]

log = Logger()

STREAMS = ("stdin", "stdout", "stderr")
#: Signals a process that has not started yet holds for its start; more
#: are EAGAIN (each is a request's answer, waiting).
MAX_EARLY_KILLS = 64


#: Each Process's place in the order they were made (:attr:`Process.serial`).
_MADE = itertools.count()


#: How much output (in bytes read) the processes of a paused connection
#: may still hand it, each before it is held back, until every one of them
#: is held back at once: what waits stays within this and one read more
#: (Twisted reads 64 KiB) of where the connection paused, however many
#: processes write to it. One read: a single busy process beside idle ones
#: never makes a pause walk them all.
LAZY_OUTPUT = 64 * 1024

#: Seconds a service stop waits for a receipt whose ``GetAll`` is in flight
#: before ``finished`` goes without it (:meth:`Process.cancel`). Asked before
#: the stop, it is ahead of the stop's ``StopUnit`` calls in the call window
#: and answered in milliseconds; a manager silent this long will not answer
#: the stops either, and the stop's 10 s progress grace must not be spent.
STOP_RECEIPT_WAIT = 2.0

#: Seconds the error of a start that failed waits for its unit to be gone
#: (:meth:`Process._fail_once_gone`): one systemd could not run (its unit
#: *failed* with one of systemd's own exit codes: 200/CHDIR, 203/EXEC...),
#: reset; one whose fence does not hold (EIO), killed and stopped; one past
#: ``start-timeout`` (ETIMEDOUT), stopped. Flux's sdexec answers the first
#: two once the unit is inactive, so that a client retrying at once with the
#: same unit name (``SDEXEC_NAME``, a job's) finds the name free; the reset,
#: or the stop of a unit killed or whose processes heed its SIGTERM, takes
#: milliseconds. A manager that has not done it in this long (stalled,
#: away), or a stop that lasts (processes that ignore SIGTERM, or hang in
#: the kernel: up to twice the stop timer, 1280 s by default), must not hold
#: the answer: it goes out, and the name stays held (EEXIST, "still held")
#: until the unit is gone.
FAILED_UNIT_WAIT = 5.0


class ValveMember(Protocol):
    """What an :class:`OutputValve` holds back and resumes: a process, or
    an attach's feed (sdexec/attachfeed.py)."""

    def pause_output(self) -> None:
        """The connection is full: send it nothing more for now."""

    def resume_output(self) -> None:
        """The connection has written everything out: send on."""


class OutputValve:
    """One connection's back-pressure on the output of the processes that
    write to it (those that :meth:`join` it: :attr:`Process.valve`), and
    on the attaches fed to it (held as they find it paused).

    Paused lazily: a process is held back when it writes while the
    connection is paused (that read joins the responses waiting), and only
    those are resumed. Pausing every process of the connection at each
    pause cost a cycle O(processes): with 1000 idle ones beside it, one
    process's output ran 15 times slower, each cycle holding the reactor
    27-80 ms. Once :data:`LAZY_OUTPUT` has come in so during one pause
    (many processes writing at once, each adding a read), all of them
    are held back: the wait stays bounded."""

    def __init__(self) -> None:
        self.paused = False
        self._members: dict[ValveMember, None] = {}
        self._held: dict[ValveMember, None] = {}  # in the order they were paused
        #: Those held not yet resumed while :meth:`resume` runs.
        self._resuming: dict[ValveMember, None] = {}
        self._lazy_left = LAZY_OUTPUT

    def join(self, process: Process) -> None:
        """``process`` writes to this connection from now on (held back at
        once if every member is)."""
        self._members[process] = None
        if self._lazy_left < 0:  # (joined while every member is held back)
            self._hold(process)

    def release(self, member: ValveMember) -> None:
        """``member`` writes to this connection no more: this valve no
        longer holds or resumes it (another connection may by then)."""
        self._members.pop(member, None)
        self._held.pop(member, None)
        self._resuming.pop(member, None)

    def pause(self) -> None:
        """The connection's buffer is full: each member is held back as it
        next writes."""
        self.paused = True
        self._lazy_left = LAZY_OUTPUT

    def resume(self) -> None:
        """The connection has written everything out: every member held
        back reads its output again, in the order they were held, until one
        fills the connection again (an attach's feed sends what it missed
        at once). Those not resumed yet then stay held, ahead of it: resumed
        first each time, one feed with more to send than the connection
        holds kept the others of its connection from it for good."""
        self.paused = False
        self._lazy_left = LAZY_OUTPUT
        self._resuming, self._held = self._held, {}
        while self._resuming and not self.paused:
            member = next(iter(self._resuming))
            del self._resuming[member]
            member.resume_output()
        left, self._resuming = self._resuming, {}
        self._held = {**left, **self._held}  # ahead of the one that filled it

    def wrote(self, process: Process, size: int) -> None:
        """``process`` wrote ``size`` bytes to the connection: held back if
        it is paused (every member, once too much came so)."""
        if not self.paused:
            return
        self._hold(process)
        if self._lazy_left >= 0:
            self._lazy_left -= size
            if self._lazy_left < 0:
                for member in list(self._members):
                    self._hold(member)

    def hold_if_paused(self, member: ValveMember) -> None:
        """Hold ``member`` back while the connection is paused, to be
        resumed with the rest (a process that joined a paused connection,
        an attach's feed that found it paused)."""
        if self.paused:
            self._hold(member)

    def _hold(self, member: ValveMember) -> None:
        if member not in self._held:
            self._held[member] = None
            member.pause_output()


class Responder(Protocol):
    """Where a process's responses go (a client's request, or nowhere once
    the client has gone)."""

    def respond(self, payload: dict[str, Any]) -> None:
        """One response of the stream (``started``, output, ``finished``,
        a credit)."""

    def error(self, errnum: int, errstr: str) -> None:
        """The stream's last response: an error (ENODATA for a stream that
        ended well). Nothing is sent after it."""


#: Sees every piece of output as read, forwarded or not: ``(stream, data,
#: eof)`` (sdexec.background keeps it for ``wait`` and ``attach``).
OutputTap = Callable[[str, bytes, bool], None]


class Sent(enum.Enum):
    """Responses sent at most once."""

    STARTED = "started"
    FINISHED = "finished"


class UnitCall(enum.Enum):
    """systemd calls made at most once per unit."""

    START = "StartTransientUnit"
    STOP = "StopUnit"
    RESET = "ResetFailedUnit"
    CONFIRM_FAILURE = "GetAll"
    CONFIRM_UNSTARTED = "GetAll for a start job that ended without a start"
    RECEIPT = "GetAll(Service) for the receipt"
    KILL_MAIN = "KillUnit(main, SIGKILL) for a client that left"
    KILL_UNSEEN = "KillUnit(all, SIGKILL) for a client that left before started"


#: How a unit the manager lost is reported.
_LOST = "is gone (lost while systemd was away)"
#: How a unit started again by hand (``systemctl restart``) is reported.
_STARTED_AGAIN = "was started again outside sdexec"
#: How a start is reported that systemd accepted and then dropped unrun
#: across its manager's reload or departure (:meth:`Process.manager_left`,
#: :meth:`Process.manager_reloading`).
_START_DROPPED = (
    "was never started: systemd reloaded, re-executed or restarted before"
    " running its start job, and dropped it; nothing ran, retry"
)

# The errnos a request ends with when its unit did not run its course. None
# is EIO: Flux's job-exec reads EIO from sdexec as a failed containment check
# and drains the node (bulkexec.c error_cb), which sdexec says only for that
# (Process._refuse); these are ordinary exec failures ("job shell exec
# error"), each named for what became of the process.

#: No ``started`` within ``start-timeout``.
START_TIMEOUT_ERRNO = errno.ETIMEDOUT
#: The unit is no longer the one started (lost while systemd was away, or
#: started again by hand): as kill(2) says of a pid that is gone, and as
#: sdexec answers a call on a unit systemd no longer has (``NoSuchUnit``).
UNIT_GONE_ERRNO = errno.ESRCH
#: A process that started and whose unit ended without an exit status: as
#: wait(2) says when there is no status to collect.
NO_EXIT_STATUS_ERRNO = errno.ECHILD
#: A start systemd accepted and dropped unrun when its manager reloaded,
#: re-executed or restarted: nothing ran, so a retry is safe, as for a
#: start an outage caught in flight (docs/protocol.md: EAGAIN, retry later).
START_DROPPED_ERRNO = errno.EAGAIN

#: Calls with nothing left to do once the unit is unloaded: their failure
#: then is no news (a client gone in a burst logged one per unit).
_MOOT_ONCE_GONE = frozenset(
    {UnitCall.STOP, UnitCall.RESET, UnitCall.KILL_MAIN, UnitCall.KILL_UNSEEN}
)
#: Calls made again when refused while the unit still needs them (nothing
#: else would: the unit lingers, its process tabled, its name taken).
_RETRIED = frozenset({UnitCall.STOP, UnitCall.RESET})


@dataclass(frozen=True)
class ProcessContext:
    """What a process needs from the service around it."""

    reactor: Any  # IReactorSocket: the channels' sockets are adopted there
    clock: IReactorTime
    rank: str
    count: Callable[[str], None] = lambda event: None  # the statistics
    #: Whether to log every unit state change (``[systemd] sdexec-debug``):
    #: asked at each change, so that a reload turning it on shows the
    #: unit already stuck, which is when it is wanted.
    debug: Callable[[], bool] = lambda: False
    #: ``drain(reason, cause)``: refuse new work, why (sdexec/drain.py).
    drain: Callable[[str, Cause], None] = lambda reason, cause: None
    #: A start was refused for a property the manager does not take (its
    #: D-Bus name): if the site sets it, every start would be.
    property_not_taken: Callable[[str], None] = lambda name: None
    #: ``(kind, text, **fields)``: a warning a client can cause in a loop,
    #: logged at a bounded rate (the server's sdexec.lograte.LogRate).
    client_warning: Callable[..., None] = lambda kind, text, **fields: log.warn(
        text, **fields
    )
    #: What bounds the lines logged once per unit where hundreds may come
    #: at once (the stop timer's): the server's; ``None``: none.
    log_rate: LogRate | None = None
    #: Seconds from the start job to ``started`` before the request is ended
    #: (``[systemd] start-timeout``): a unit whose states the model does not
    #: expect (``Type=forking``, no ``ExecMainPID``, …) must not hang it.
    start_timeout: float = DEFAULT_START_TIMEOUT
    #: Seconds a receipt whose read was lost with systemd waits for its
    #: return before ``finished`` goes out without it (``[systemd]
    #: reconnect-timeout``: systemd away longer drains the service anyway).
    receipt_wait: float = DEFAULT_RECONNECT_TIMEOUT
    #: ``end_lost_unit(unit, cgroup, signum, process)``: its manager lost the
    #: process's unit, and what it ran lives on in ``cgroup`` (the server's
    #: ``end_what_lost_unit_left``, sdexec/orphans.py).
    end_lost_unit: Callable[[str, str, int, Process], None] = (
        lambda unit, cgroup, signum, process: None
    )
    #: Receipts read the unit's cgroup files (cgroup v2): the unit is not
    #: stopped until its receipt has been read (sdexec.receipt).
    receipt_reads_cgroup: bool = True
    #: The process's main pid has become known (the server finds processes
    #: by pid through an index of them).
    pid_known: Callable[[Process], None] = lambda process: None
    #: ``first_missing(paths)``: the first of ``(property, path)`` that does
    #: not exist, or ``None`` where that is not known (the server's
    #: :meth:`sdexec.lookup.Lookups.first_missing`: off the reactor's
    #: thread, as a path may be on a file system that does not answer).
    first_missing: Callable[[list[NamedPath]], defer.Deferred[NamedPath | None]] = (
        lambda paths: defer.succeed(None)
    )


class Process:
    """A request's process: from ``StartTransientUnit`` to the end of the
    stream. Build it from an :class:`~sdexec.plan.ExecPlan`, then
    :meth:`start` it."""

    def __init__(
        self,
        systemd: Manager,
        plan: ExecPlan,
        responder: Responder,
        context: ProcessContext,
        *,
        on_reaped: Callable[[Process], None] = lambda process: None,
        verify: Callable[[str | None, int], str | None] | None = None,
        tap: OutputTap | None = None,
        stdio: PassedStdio = NO_STDIO,
    ) -> None:
        self.plan = plan
        self.unit_name = plan.unit_name
        self.pid: int | None = None
        self.status = UnitStatus()
        #: The order it was made in: the newest of processes sharing a pid
        #: (one reused while an older unit lingers) has the highest.
        self.serial = next(_MADE)
        #: Its command ran, inside its fence if it has one: ``started`` was
        #: sent, or would have been to a client that has gone.
        self.ran = False
        #: The wait status of the main process's exit, as first seen (what
        #: ``finished`` says), kept whatever the unit's later states say
        #: (a reset may clear ExecMain*); ``None`` until it has exited.
        self.exit_status: int | None = None
        self._systemd = systemd
        self._responder = responder
        self._context = context
        self._on_reaped = on_reaped
        self._verify = verify
        self._tap = tap
        #: The client's own descriptors for some streams: no channel for them.
        self._passed = stdio
        self._init_tracking()
        self._init_receipt_wait()
        self._init_stopping(context, plan)
        self._init_channels(plan, stdio)

    def _init_tracking(self) -> None:
        """What it has sent, asked of systemd and seen of its unit and of the
        unit's manager: nothing yet."""
        self._watch: Watch | None = None
        self._sent: set[Sent] = set()
        self._called: set[UnitCall] = set()
        self._ended = False  # the stream's last response is sent
        self._declared_unkillable = False
        self._reaped = False
        self._failure_confirmed = False  # by a GetAll after failed/no status
        #: systemd could not run the command, and the paths its sandboxing
        #: named are being looked at to say why: the stream ends after.
        self._explaining = False
        #: The start failed (systemd could not run the command, its fence
        #: does not hold, it timed out): the error that ends the stream once
        #: its unit is gone, and the timer that bounds the wait
        #: (:meth:`_fail_once_gone`).
        self._failure_held: tuple[int, str] | None = None
        self._failure_wait: IDelayedCall | None = None
        #: The state that showed the start job ended without starting the
        #: unit, and asked for a GetAll to confirm it.
        self._unstarted_seen: dict[str, Any] | None = None
        #: Its unit was started again outside sdexec: a new invocation,
        #: carrying the mark, that only a leftover scan can follow.
        self.started_again = False
        #: Its start was refused as a unit of its name exists: one of this
        #: service's, maybe, whose start's answer was lost with systemd and
        #: which nobody follows (looked for once this one is reaped).
        self.name_taken = False
        #: systemd answered its start with a timeout of its own bus, maybe
        #: after it had started the unit (looked for once this is reaped).
        self.start_timed_out = False
        #: The unit's InvocationID, first seen once it started.
        self._invocation: bytes | None = None
        #: The unit's cgroup, noted while it runs (sdexec.orphans), and the
        #: cgroup of the manager asked to start it.
        self._cgroup: str | None = None
        self._start_manager_cgroup: str | None = None
        self._orphans_ended = False
        #: Its manager left the bus since the start was sent (re-executed,
        #: restarted or killed): a start it had not run may be dropped.
        self._manager_left = False
        #: A daemon-reload began since the start was sent, before it ran.
        self._manager_reloaded = False
        #: Its start left the window of calls for the bus.
        self._start_was_sent = False
        #: Why its start, still in that window, must never leave it
        #: (:meth:`withdraw_start`).
        self._start_withdrawn: str | None = None
        #: Its OOM end is in the service's ``oom-kills`` (once per unit).
        self._oom_counted = False

    def _init_receipt_wait(self) -> None:
        """The receipt's read, and what waits for it: nothing yet."""
        #: Output streams that reached EOF while the receipt was being read.
        self._eofs_after_finished: list[str] = []
        #: The receipt's read was lost with systemd (:meth:`_wait_for_receipt`):
        #: what the signals had said then, the timer that gives up on it, and
        #: whether it is still to be asked for again once the unit is reread.
        self._receipt_fallback: dict[str, Any] = {}
        self._receipt_deadline: IDelayedCall | None = None
        self._receipt_unasked = False
        self._receipt_lost_with_systemd = False
        #: Why the stream ends once ``finished`` is out (:meth:`cancel`).
        self._cancel_after_finished: str | None = None
        #: A stop the loss failed, made again only behind the receipt's read.
        self._stop_after_receipt = False

    def _init_stopping(self, context: ProcessContext, plan: ExecPlan) -> None:
        """Its timers (the start's deadline, the stop timer) and the calls
        that stop or kill its unit, made again where refused."""
        self._start_deadline = _StartDeadline(
            context.clock,
            context.start_timeout,
            awaited=lambda: Sent.STARTED not in self._sent and not self._outcome_known,
            may_judge=lambda: self.knows_its_unit,
            overdue=self._start_overdue,
        )
        self._reread = _Reread(self._read_again, self._start_deadline.judge_held)
        #: sdexec decided to stop the unit (a lost StopUnit is made again).
        self._stop_wanted = False
        #: Calls systemd refused and that were made again (their backoff).
        self._backoff = CallBackoff()
        self._retry_timers: dict[UnitCall, IDelayedCall] = {}
        #: The client left: SIGKILL the main process (when it runs).
        self._kill_main_wanted = False
        self._early_kills = _EarlyKills(self.kill)
        self.stop_timer = StopTimer(
            context.clock,
            plan.stop_timer.seconds,
            plan.stop_timer.signal,
            plan.unit_name,
            _UnitStop(self),
            lambda: self.knows_its_unit,
            context.log_rate,
        )

    def _init_channels(self, plan: ExecPlan, stdio: PassedStdio) -> None:
        """Its stdin, and a channel for each output stream the client did
        not pass its own descriptor for."""
        self.stdin = InputChannel(self._add_credit, plan.stdin_bufsize)
        #: The back-pressure of the connection its output goes to, if any.
        self.valve: OutputValve | None = None
        self.output = OutputGate(
            {
                name: OutputChannel(
                    name,
                    on_data=functools.partial(self._output, name),
                    on_eof=functools.partial(self._output_eof, name),
                    line_buffered=options.line_buffered,
                    bufsize=options.bufsize,
                )
                for name, options in plan.output.items()
                if name not in stdio
            }
        )

    @property
    def stream_ended(self) -> bool:
        """Its request's stream has had its last response (the unit may
        linger: abandoned, or refused, until it is gone)."""
        return self._ended

    @property
    def cmdline(self) -> list[str]:
        """The command line its request asked for (for ``list``)."""
        return self.plan.cmdline

    @property
    def label(self) -> str | None:
        """Its request's label, if any: what ``wait`` and ``attach`` may
        name it by."""
        return self.plan.label

    # -- state for list/stats ---------------------------------------------

    @property
    def state(self) -> str:
        """``R`` while running, ``Z`` once finished but not yet reaped (a
        stream ended as unkillable is ``R`` until its main process exits)."""
        if self._declared_unkillable and self.exit_status is None:
            return "R"
        return "Z" if self._outcome_known else "R"

    def describe(self) -> dict[str, Any]:
        """The process's ``sdexec.list`` entry."""
        return {
            "pid": self.pid if self.pid is not None else -1,
            "cmd": listed_name(self.cmdline),
            "cmdline": listed_cmdline(self.cmdline),
            # "" for none, as upstream's servers list it (its C clients
            # unpack the label as a string; null would fail them).
            "label": self.label or "",
            "unit": self.unit_name,
            "state": self.state,
        }

    def stats(self) -> dict[str, Any]:
        """Its ``stats`` entry: the list's, with the unit's state as systemd
        last reported it (``ActiveState.SubState``, as Flux's sdexec shows
        it) and its stop timer, to tell a unit stuck *deactivating*."""
        seen = self.status
        return {
            **self.describe(),
            "unit-state": f"{seen.active_state or '-'}.{seen.sub_state or '-'}",
            "stop-timer": self.stop_timer.stats(),
        }

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> defer.Deferred[None]:
        """Make the channels, watch the unit, ask systemd to start it. If
        that fails (EMFILE), nothing of it is left: no socket, no watch.
        Fires ``None`` once systemd has answered, either way."""
        passed = self._passed
        self._start_manager_cgroup = self._systemd.control_group
        pairs: dict[str, tuple[socket.socket, socket.socket]] = {}
        try:
            for name in STREAMS:
                if name not in passed:
                    pairs[name] = socketpair_for_systemd()
            self._watch = self._systemd.watch_unit(self.unit_name, self._unit_changed)
            self._adopt_channels(pairs)
        except BaseException:
            self._undo_start(pairs)
            raise
        if self.credits_stdin and "stdin" not in passed:
            self._send(
                {"type": "add-credit", "channels": {"stdin": self.stdin.bufsize}}
            )
        theirs = [pair[1] for pair in pairs.values()]
        stdin, stdout, stderr = (
            passed.fd(name) if name in passed else pairs[name][1].fileno()
            for name in STREAMS
        )
        started = self._systemd.start_transient_unit(
            self.unit_name,
            list(self.plan.properties),
            stdin,
            stdout,
            stderr,
            on_sent=self._start_sent,
        )
        # systemd has its copies once it answers (or will never use them).
        started.addBoth(self._close_after_start, theirs, passed)
        answered: defer.Deferred[None] = defer.Deferred()
        started.addBoth(_passing_on, answered)
        started.addCallbacks(self._start_accepted, self._start_refused)
        return answered

    def _adopt_channels(
        self, pairs: dict[str, tuple[socket.socket, socket.socket]]
    ) -> None:
        reactor = self._context.reactor
        if "stdin" in pairs:
            self.stdin.adopt(reactor, pairs["stdin"][0])
        for name in ("stdout", "stderr"):
            if name in pairs and name not in self.output.channels:
                pairs[name][0].close()  # nobody would read it
        self.output.adopt(reactor, {name: pair[0] for name, pair in pairs.items()})

    def _undo_start(
        self, pairs: dict[str, tuple[socket.socket, socket.socket]]
    ) -> None:
        """A start that failed part way: close what it made. (A watch left
        behind would refuse the next unit of this name for good.) The
        caller answers the request: the channels closed here say nothing
        more, not even their EOFs."""
        self._responder, self._tap, self._ended = _Nowhere(), None, True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self.stdin.close()
        self.output.close()
        for pair in pairs.values():
            for sock in pair:
                sock.close()  # a no-op for one a channel has closed

    def write(self, data: bytes, eof: bool) -> None:
        """Client data for stdin (``eof`` closes it); ``EINVAL`` if the
        client passed its own stdin. A client that overran its credit: stdin
        is closed after what it had sent before, and ``RequestError``
        (ENOSPC) answers the write."""
        if "stdin" in self._passed:
            raise RequestError(
                errno.EINVAL, "io: this process's stdin is the client's own (stdio)"
            )
        if data:
            try:
                self.stdin.write(data, credited=self.credits_stdin)
            except StdinOverrun as overrun:
                self.stdin.close()
                raise RequestError(errno.ENOSPC, str(overrun)) from None
            self._drop_backlog_once_exited()
        if eof:
            self.stdin.close()

    def _drop_backlog_once_exited(self) -> None:
        """Once ``finished`` is sent its main process reads nothing more: a
        stdin backlog would hold its client's connection until the unit is
        gone (a lingering child, the whole stop timer), so it is dropped and
        stdin closed."""
        if Sent.FINISHED in self._sent and self.stdin.backlogged:
            self.stdin.discard()

    @property
    def credits_stdin(self) -> bool:
        """Its client asked for write credit (RFC 42's flag 8): a write
        beyond it is refused. Without, writes are taken and the client's
        connection waits while stdin is :attr:`InputChannel.backlogged`."""
        return bool(self.plan.flags & ExecFlag.WRITE_CREDIT)

    @property
    def signals_wait_for_start(self) -> bool:
        """Whether a :meth:`kill` now waits for the process to start (no
        call to systemd until then)."""
        return Sent.STARTED not in self._sent and not (self._over or self._reaped)

    def kill(self, signum: int, who: str = "all", uid: int | None = None) -> Any:
        """Signal every process of the unit (``who`` ``"main"``: its main
        process only, as Flux's sdexec does); a Deferred. ``uid``: whose
        request it is (``None``: the service's own).

        Before ``started`` the unit has no process yet: systemd would signal
        nothing and answer success, and the signal would be lost. It waits
        for the start instead (answered then), and is ESRCH if the process
        never starts."""
        if Sent.STARTED in self._sent:
            return self._systemd.kill_unit(self.unit_name, who, signum)
        if self._over or self._reaped:
            return defer.fail(_never_started())
        return self._early_kills.hold(signum, who, uid)

    def refuse_held_kills(
        self, uids: frozenset[int], why: Callable[[int, int], str]
    ) -> int:
        """Never send the signals held for its start that ``uids`` asked
        for (a reload took them out of ``allow-users``): each answered
        ``EPERM``, ``why(uid, signum)``; how many."""
        return self._early_kills.refuse_of(uids, why)

    def signals_go_out(self) -> defer.Deferred[None]:
        """Fires once the signals held for the start have been sent (their
        calls to systemd made); never if the process never starts."""
        return self._early_kills.when_sent()

    def unkillable(self, reason: str) -> None:
        """The unit would not die: end the stream with EDEADLK (``reason``
        says why), after ``finished`` if the exit status is known (its
        receipt may still be on its way: it goes without). The process
        stays tracked until the unit is gone."""
        if self._awaiting_receipt:
            self._give_up_receipt("its unit would not stop")
        self._declared_unkillable = True
        # Over a start's failure held for its unit's end (a fence refusal, a
        # start timeout): as Flux's sdexec, whose stop timer's verdict comes
        # first; the name stays held and the node drained, which it says.
        self._failure_held = None
        self._fail(errno.EDEADLK, reason)

    def cancel(self, reason: str) -> None:
        """The service stops: end the stream with ECANCELED (``reason``
        says why), then stop the unit and reap it, as :meth:`abandon`. A
        process whose exit was seen gets its ``finished`` first: its exit
        status is known, and the client must not read it as never ended.
        A receipt whose read is in flight is waited for up to
        :data:`STOP_RECEIPT_WAIT` (the stop stays bounded); one waiting for
        systemd's return goes without at once."""
        if self._awaiting_receipt and not self._receipt_unasked:
            self._cancel_after_finished = reason
            self._cancel_receipt_deadline()  # a reconnect-timeout's: shorter now
            self._receipt_deadline = self._context.clock.callLater(
                STOP_RECEIPT_WAIT,
                self._receipt_overdue,
                f"the service is stopping (waited {STOP_RECEIPT_WAIT:g} s)",
            )
            return
        if self._receipt_deadline is not None:
            self._give_up_receipt("the service is stopping")
        self._end_cancelled(reason)

    def _end_cancelled(self, reason: str) -> None:
        self._cancel_after_finished = None
        self._fail(errno.ECANCELED, reason)
        self.abandon()

    def client_gone(self) -> None:
        """The client's connection closed: its process must not outlive it
        whatever it does with SIGTERM (the stop's signal), so, as Flux's
        sdexec does, SIGKILL goes to the main process first (before
        ``started``, to every process of the unit: :meth:`_stop_abandoned`);
        then as :meth:`abandon`."""
        self._kill_main_wanted = True
        self._kill_main_if_wanted()  # else once started: it may be starting
        self.abandon()

    def _kill_main_if_wanted(self) -> None:
        """SIGKILL the main process of a client that left, once it is known
        to run (made again if the connection to systemd loses it)."""
        started = Sent.STARTED in self._sent
        # Not once it has exited (its status seen, or the outcome known);
        # a stream ended as unkillable has its main process still running.
        outcome_says_exited = self._outcome_known and not self._declared_unkillable
        exited = outcome_says_exited or self.status.has_finished
        if self._kill_main_wanted and started and not exited:
            self._call(
                UnitCall.KILL_MAIN,
                lambda unit: self._systemd.kill_unit(unit, "main", signal.SIGKILL),
            )

    def abandon(self) -> None:
        """The client has gone: stop the unit and reap it, silently."""
        self._responder = _Nowhere()
        if self._receipt_deadline is not None:
            self._give_up_receipt("its client left")  # nobody waits for it
        self.detach_valve()  # a paused connection must not hold the drain
        self.output.drain()  # nobody reads: drain to EOF so it can be reaped
        # A failed unit is being reset instead; anything else is stopped.
        if UnitCall.START in self._called and UnitCall.RESET not in self._called:
            self._stop_abandoned()
        # No EOF may come to say the unit is over (stdio passthrough), nor a
        # deadline (the stream's end cancelled it): an inactive unit that
        # never ran ends now.
        self._maybe_end()

    def manager_left(self) -> None:
        """systemd's manager left the bus (``daemon-reexec``, a restart, a
        kill): a start it accepted and had not run may be dropped with it.
        With the bus up, every signal the manager sent before it left was
        seen, and a unit that ran stays loaded (``RemainAfterExit``) until
        sdexec stops it: a start never seen run whose unit is then unloaded
        ran nothing (:meth:`_unit_changed`)."""
        if self._start_sent_unrun:
            self._manager_left = True

    def manager_reloading(self) -> None:
        """systemd's manager begins a ``daemon-reload``: a start it has
        queued may be dropped (:meth:`_start_dropped`)."""
        if self._start_sent_unrun:
            self._manager_reloaded = True

    @property
    def _start_sent_unrun(self) -> bool:
        """Its start was sent, and it has not been seen run. Sent, not
        answered: the manager's signal is handled as it is read, and an
        answer that came before it a few turns of the loop later. Not one
        still in the window of calls (behind 64 others): systemd has not
        seen it, will make it on the reloaded manager, and its job ending
        unstarted is then its own (a dependency), not the reload's."""
        return self._start_was_sent and Sent.STARTED not in self._sent

    def withdraw_start(self, reason: str) -> bool:
        """Its start, if it has not left the window of calls yet, never
        will: its request is refused (``EPERM``, ``reason``) as its turn
        comes, and nothing of it runs. Whether it was still there."""
        if self._start_was_sent or self._reaped:
            return False
        self._start_withdrawn = reason
        return True

    def keep_start(self) -> None:
        """Undo :meth:`withdraw_start`: a later reload put its user back
        before the start's turn came."""
        self._start_withdrawn = None

    def _start_sent(self) -> None:
        if self._start_withdrawn is not None:
            raise CallWithdrawn(self._start_withdrawn)
        self._start_was_sent = True

    def resync(self) -> None:
        """systemd is back after a loss: read the unit's state afresh (the
        signals in between were lost) and redo the calls the loss failed.
        A unit that vanished meanwhile ends the request with an error."""
        if self._reaped or self._watch is None or UnitCall.START not in self._called:
            return  # a start lost with the connection ended its request
        self._called.discard(UnitCall.CONFIRM_FAILURE)  # this refresh confirms
        self._forget_unstarted()  # what was seen before the loss is no proof
        reread = self._reread.start()
        # After the state read: a unit that stopped meanwhile has no timer.
        back_at = self._context.clock.seconds()
        reread.addCallback(lambda _: self.stop_timer.systemd_restored(back_at))
        if self._receipt_unasked:
            # Once the unit is known again (a unit gone meanwhile gave up
            # on its receipt as the reread showed it: _unit_changed).
            self.when_reread().addCallback(self._ask_receipt_again)
        if isinstance(self._responder, _Nowhere):
            # A client that left while systemd was away, or whose SIGKILL
            # ahead of the stop the loss failed: both are made again.
            self._stop_abandoned()
        elif self._stop_wanted and self._receipt_unasked:
            self._stop_after_receipt = True  # the receipt's read first
        elif self._stop_wanted:
            self._stop()  # a stop the loss failed (a deadline's, a fence's)
        self._kill_main_if_wanted()  # one the loss failed is made again

    def pause_output(self) -> None:
        """The client reads slowly: stop reading the process's output."""
        self.output.pause()

    def resume_output(self) -> None:
        """The client reads again: read the process's output again."""
        self.output.resume()

    def join_valve(self, valve: OutputValve) -> None:
        """Its output goes to ``valve``'s connection from now on, held back
        by it for as long as the connection stays paused (a pipe's
        back-pressure)."""
        self.detach_valve()
        self.valve = valve
        valve.join(self)

    def detach_valve(self) -> None:
        """Its output goes to no connection any more: none holds it back."""
        if self.valve is not None:
            self.valve.release(self)
            self.valve = None

    # -- systemd's answers and events ----------------------------------------

    @staticmethod
    def _close_after_start(result: Any, sockets: list, passed: PassedStdio) -> Any:
        for sock in sockets:
            sock.close()
        passed.close()
        return result

    def _start_accepted(self, job: str) -> None:
        self._called.add(UnitCall.START)
        assert self._watch is not None  # made before the start was asked for
        # Not when the unit's signals came first (dbus-fast delivers them as
        # it reads them, the answer a few turns later): the process has
        # started, and nothing would cancel the deadline.
        self._start_deadline.arm()
        if isinstance(self._responder, _Nowhere):
            self._stop_abandoned()  # the client left while systemd was starting it
        elif self._verify is not None:
            # ControlGroup, which no signal carries, for the fence check and
            # the receipt; a check that runs first, on the signals, is given
            # the cgroup noted from the main process (_unit_cgroup).
            self._watch.refresh().addErrback(self._log_failure, "GetAll")
            return
        if self._watch.state:
            # Signals carry every state the lifecycle needs (the watch was
            # registered before the start); some may have come before this
            # answer, and the stream may only end now that it has. So may
            # a process whose client left: a unit already gone sends no
            # more signals, and it would stay tabled.
            self._unit_changed(self._watch.state)

    def _start_refused(self, failure: Failure) -> None:
        error = failure_value(failure)
        if isinstance(error, CallWithdrawn):  # never sent: nothing to explain
            self._fail(errno.EPERM, str(error))
            self._reap()
            return
        message = explain_start_refusal(
            getattr(error, "message", str(error)),
            self.plan.properties,
            self._systemd.version,
        )
        self.start_timed_out = start_may_have_run(error)
        if self.start_timed_out:
            message = start_timed_out(message)
        elif start_lost_in_flight(error):
            message = start_lost(message)
        self._context.client_warning(
            "start refused",
            "{unit}: StartTransientUnit failed: {message}",
            unit=self.unit_name,
            message=message,
        )
        self.name_taken = getattr(error, "name", None) == UNIT_EXISTS
        refused = not_taken_property(str(error), self.plan.properties)
        if refused is not None:
            self._context.property_not_taken(refused.name)
        self._fail(start_refusal_errno(error), message)
        self._reap()

    def _is_gone(self, properties: dict[str, Any]) -> str | None:
        """How the unit is no longer the one started, or ``None``: unloaded
        (``not-found``), or another invocation under its name. A manager
        killed and started again makes one from the unit file the dead one
        left (inactive, never started: no ``InvocationID``, its process
        outside it, its exit status never to come), while one re-executed
        keeps ours running (the same ``InvocationID``); one started again by
        hand has a new one."""
        if properties.get("LoadState") == "not-found":
            return _LOST
        invocation = properties.get("InvocationID")
        if invocation is None or Sent.STARTED not in self._sent:
            return None
        if self._invocation is None:
            self._note_invocation(properties)  # ours: first seen since
            return None
        if bytes(invocation) == self._invocation:
            return None
        self.started_again = bool(invocation)
        return _STARTED_AGAIN if invocation else _LOST

    def _note_invocation(self, properties: dict[str, Any]) -> None:
        self._invocation = bytes(properties.get("InvocationID") or b"") or None

    def _unit_changed(self, properties: dict[str, Any]) -> None:
        """The unit's properties as they are now (its watch's callback, or
        a reread): follow them, or end the stream where the unit is no
        longer the one started."""
        if UnitCall.START not in self._called:
            # Until systemd has accepted the start, a unit of this name may
            # be another program's (an SDEXEC_NAME systemd will refuse with
            # UnitExists): its states are kept in the watch, and acted on
            # once the start is ours (_start_accepted reads them then).
            return
        gone = self._is_gone(properties)
        if gone is not None and self._unit_went(gone, properties):
            return
        self._follow_states(properties)

    def _unit_went(self, gone: str, properties: dict[str, Any]) -> bool:
        """The unit is no longer the one started (``gone`` says how): end
        what it left, and the stream if its outcome is not known yet.
        Whether that was all (no states of the request's process follow)."""
        if self._receipt_deadline is not None:
            # Its exit status was seen before the outage: that is its
            # outcome, not an error; the receipt will never come.
            self._give_up_receipt(self._receipt_gone(gone, properties))
        if gone == _LOST and properties.get("LoadState") != "not-found":
            # A unit its manager knows and never started (no invocation): a
            # new manager's, made from the file a killed one left. Also once
            # its outcome is known: what ignored the stop runs on.
            self._end_what_it_left(properties)
        if not self._outcome_known:
            self._went_before_its_outcome(gone)
            return True
        if gone == _STARTED_AGAIN and not self._reaped:
            # Its outcome known all the same: a restart's stop killed the
            # first run, whose exit (the Service's signal) can come before
            # the new InvocationID (the Unit's), and `finished` went out for
            # it. What runs now is not this request's process: it must not
            # be followed as it (its output, its end), but as a leftover. The
            # error follows `finished`, as an EDEADLK does (if the stream
            # has not ended). Nothing unread goes out: systemd starts the
            # new run only once the restart's stop has ended every process
            # of the first, whose output was read as it came (unless its
            # client was reading slowly), so what the sockets hold now is
            # the new run's. (A unit lost after `finished` needs none of
            # this: what it left is ended above, and nothing runs on in it.)
            self._vanished(gone, forward_unread=False)
            return True
        return False

    def _receipt_gone(self, gone: str, properties: dict[str, Any]) -> str:
        """Why a receipt lost with systemd will never come, its unit gone
        (``gone`` says how). A unit unloaded after sdexec's own stop went
        through (sent right behind the receipt's ``GetAll``, which the
        outage lost) was not lost while systemd was away: it ended as it
        was told."""
        if (
            gone == _LOST
            and properties.get("LoadState") == "not-found"
            and UnitCall.STOP in self._called
        ):
            return (
                "the unit is gone: sdexec stopped it after its process exited,"
                " before its receipt could be read again"
            )
        return f"the unit {gone}"

    def _went_before_its_outcome(self, gone: str) -> None:
        """The unit went before its process's outcome was known: the stream
        ends with why."""
        if gone == _LOST and Sent.STARTED not in self._sent:
            if self._unstarted_seen is not None:
                # Unloaded once its start job ended without a start
                # (systemd's GC runs before its signals go out): the
                # state that asked for a read is its last word, not a
                # unit lost while systemd was away.
                self._fail_unstarted(self._unstarted_seen)
                self._maybe_end()
                return
            if self._manager_left:
                # A start job kept over a daemon-reexec met a unit's
                # transient file that does not parse back (it reloads
                # bad-setting), failed, and the unit was unloaded; a
                # manager restarted cleanly cancelled it: never run.
                self._vanished(_START_DROPPED, START_DROPPED_ERRNO)
                return
        self._vanished(gone)

    def _follow_states(self, properties: dict[str, Any]) -> None:
        """The unit's states, of the request's own process: send what they
        say (``started``, ``finished``), and stop or reset the unit once its
        exit status is kept."""
        seen = self.status
        status = self.status = UnitStatus.from_properties(
            properties, command_ran=self._command_ran
        )
        if self._context.debug() and status.said() != seen.said():
            # One line a change: the Unit and Service interfaces signal
            # apart, a GetAll reads the unit again, and most signals change
            # properties not said here (timestamps, CPU usage).
            log.debug("{unit}: {state}", unit=self.unit_name, state=status.said())
        if status.pid > 0 and self.pid is None:
            self.pid = status.pid
            self._context.pid_known(self)
        if status.has_started and Sent.STARTED not in self._sent:
            self._started(properties, status.pid)
        if status.result == OOM_KILL and Sent.STARTED in self._sent:
            # Also where it comes after the receipt (a process that outlived
            # the main one, killed before or during the stop) or without one:
            # the signals carry Result, at no call's cost.
            self._count_oom_end()
        if status.has_finished:
            self._finish(status)
        if self._awaiting_receipt and not self._may_release_before_receipt(status):
            return
        self._check_failure(status)
        self._check_unstarted(properties)
        # Stop or reset only once the exit status is kept: a reset clears
        # ExecMain*, and the Unit's signal may come before the Service's
        # (active/exited, no status yet): a stop then would overtake the
        # receipt, which a cgroup v2 receipt reads from the unit's cgroup.
        if status.needs_stop and self._exit_status_kept:
            self._stop()
        if status.needs_reset and self._exit_status_kept:
            self._call(UnitCall.RESET, self._systemd.reset_failed_unit)
        self.stop_timer.follow(status.is_deactivating)
        self._maybe_end()

    @property
    def _command_ran(self) -> bool:
        """Whether the command was executed for sure: ``started`` went out
        (a ``Type=exec`` unit, every unit's: no one else may set it, is
        *running* only once the exec succeeded), or it wrote output, which
        systemd never does for a unit it failed to start. Its exit of
        200-243 is then its own (``exit 203`` in a script, ``return
        -EINVAL`` from a C ``main``: 234), not systemd failing to run it; a
        command that exits that fast is seldom seen *running*, and its output
        would be thrown away with the failure."""
        return Sent.STARTED in self._sent or self.output.holds_unread()

    def _started(self, properties: dict[str, Any], pid: int) -> None:
        self._start_deadline.cancel()
        self._note_invocation(properties)
        self._note_cgroup(properties, pid)
        problem = self._verify(self._unit_cgroup(), pid) if self._verify else None
        if problem is None:
            self.ran = True
            self._once(Sent.STARTED, {"type": "started", "pid": pid})
        else:
            self._sent.add(Sent.STARTED)  # never: the job is refused instead
        self._early_kills.send()  # it did start, refused or not
        if problem is not None:
            self._refuse(problem)
        self.output.open()
        self._kill_main_if_wanted()

    def _finish(self, status: UnitStatus) -> None:
        """Read the receipt (sdexec/receipt.py) with one ``GetAll``, then
        send ``finished`` with it."""
        if UnitCall.RECEIPT not in self._called:
            self._called.add(UnitCall.RECEIPT)
            self.exit_status = status.wait_status
            self._read_receipt()

    def _read_receipt(self) -> None:
        read = self._systemd.get_service_properties(self.unit_name)
        read.addBoth(self._receipt_read)

    @property
    def _awaiting_receipt(self) -> bool:
        return UnitCall.RECEIPT in self._called and Sent.FINISHED not in self._sent

    def _may_release_before_receipt(self, status: UnitStatus) -> bool:
        """Whether the stop or reset may follow the receipt's ``GetAll``
        before its answer: systemd answers a connection's calls in order, so
        the answer still describes the unit before them, and the round trip
        is saved (docs/performance.md). Not while the unit's cgroup is there
        for the receipt to read (cgroup v2), which a stop removes: systemd
        has removed an emptied unit's already, as it left running (only
        processes that outlive the main one keep it), and a failed one's.
        Nor while a ``GetAll`` lost with systemd is still to be made again:
        the stop follows it, as the first did."""
        if self._receipt_unasked:
            return False  # lost with systemd: to be sent again first
        if status.needs_reset or not self._context.receipt_reads_cgroup:
            return True
        cgroup = self._unit_cgroup(self._watch.state if self._watch else None)
        return cgroup is not None and not unit_cgroup_exists(cgroup)

    @property
    def _exit_status_kept(self) -> bool:
        """``finished`` is sent, or its wait status taken and its receipt
        asked for."""
        return self._outcome_known or UnitCall.RECEIPT in self._called

    def _receipt_read(self, answer: dict[str, Any] | Failure) -> None:
        if not self._awaiting_receipt:
            # Given up before its answer: finished went without it (and
            # counted no OOM kill twice); what it held back may follow.
            if not self._reaped:
                self._after_receipt()
            return
        assert self._watch is not None  # every state comes through it
        state = dict(self._watch.state)
        lost = None
        if isinstance(answer, Failure):
            if self._wait_for_receipt(answer, state):
                return
            self._log_failure(answer, UnitCall.RECEIPT.value)
            state = self._receipt_fallback or state  # not a reread's
            lost = f"its read failed: {answer.getErrorMessage()}"
        elif self.pid and not answer.get("ExecMainPID"):
            # Unloaded before the read (a stop by someone else: systemd's
            # GC runs before its signals go out): the answer is a new stub's
            # of the name, whose zeros would hide what the signals said.
            pass
        else:
            state.update(answer)
            self._note_cgroup(answer)  # its main process may have gone early
        self._finish_with(state, lost)
        self._after_receipt()

    def _after_receipt(self) -> None:
        """What ``finished`` held: a stop the loss of systemd failed
        (:meth:`resync` leaves it to the receipt), then the unit's state
        acted on (the stop or reset, the end)."""
        if self._stop_after_receipt:
            self._stop_after_receipt = False
            self._stop()
        assert self._watch is not None  # a receipt is asked for a watched unit
        self._unit_changed(self._watch.state)

    def _finish_with(self, state: dict[str, Any], lost: str | None = None) -> None:
        """``finished`` with the receipt ``state`` makes; ``lost``: why it
        is only what the signals carried (its ``receipt_lost`` key)."""
        # The wait status is the one first seen (exit_status): a unit gone
        # meanwhile (the client left, it was stopped) reads back with none.
        receipt = finished_extensions(state)
        if lost is not None:
            receipt["receipt_lost"] = lost
        if receipt.get("result") == OOM_KILL or receipt.get("oom_kills"):
            self._count_oom_end()
        self._send_finished(receipt)

    def _count_oom_end(self) -> None:
        """One more ``oom-kills``, once per unit: its receipt and its later
        signals may each say it."""
        if not self._oom_counted:
            self._oom_counted = True
            self._context.count("oom-kills")

    def _wait_for_receipt(self, failure: Failure, state: dict[str, Any]) -> bool:
        """Whether a receipt whose read failed waits to be asked for again:
        one lost with systemd, for a client still there. The unit's stop
        and its EOFs stay held meanwhile; once systemd is back and the unit
        read again, it is asked for again (:meth:`resync`), and after
        ``receipt_wait`` (reconnect-timeout) ``finished`` goes without it."""
        if not is_connection_lost(failure_value(failure)):
            return False
        if self._over or isinstance(self._responder, _Nowhere):
            # Nobody to tell (as ever, from the signals), or no `finished`
            # to go out: the request's error waits for the unit to go.
            return False
        if self._cancel_after_finished is not None:
            return False  # the service stops: systemd is not waited for
        self._receipt_unasked = True
        self._receipt_lost_with_systemd = True
        if self._receipt_deadline is None:
            self._receipt_fallback = state
            wait = self._context.receipt_wait
            self._receipt_deadline = self._context.clock.callLater(
                wait, self._receipt_overdue, f"systemd was not back within {wait:g} s"
            )
            log.info(
                "{unit}: the receipt's GetAll was lost with systemd ({error}):"
                " asked again once it is back, for up to {wait:g} s",
                unit=self.unit_name,
                error=failure.getErrorMessage(),
                wait=wait,
            )
        return True

    def _ask_receipt_again(self, _: object) -> None:
        """The unit is read again after systemd's return: ask for its
        receipt again (once, whatever number of returns waited for it)."""
        if self._receipt_unasked and self._awaiting_receipt and not self._reaped:
            self._receipt_unasked = False
            self._read_receipt()
            assert self._watch is not None  # a receipt is asked for a watched unit
            self._unit_changed(self._watch.state)  # a stop it releases follows it

    def _receipt_overdue(self, why: str) -> None:
        """The receipt's deadline (a stop's, or systemd's return's) passed:
        ``finished`` goes without it, ``why`` said."""
        self._receipt_deadline = None  # it has fired
        self._give_up_receipt(why)
        self._after_receipt()

    def _give_up_receipt(self, why: str) -> None:
        """``finished`` goes out without the receipt: with what the signals
        had carried when its read was lost with systemd, else (unanswered)
        with what they carry now."""
        if self._receipt_lost_with_systemd:
            lost, state = f"lost with systemd: {why}", self._receipt_fallback
        else:
            assert self._watch is not None  # a receipt is asked for a watched unit
            lost, state = f"unanswered: {why}", dict(self._watch.state)
        log.warn(
            "{unit}: finished goes out without its receipt (resource usage,"
            " oom_kills): {why}",
            unit=self.unit_name,
            why=lost,
        )
        self._finish_with(state, lost)

    def _cancel_receipt_deadline(self) -> None:
        self._receipt_unasked = False
        if self._receipt_deadline is not None:
            if self._receipt_deadline.active():
                self._receipt_deadline.cancel()
            self._receipt_deadline = None

    def _send_finished(self, receipt: dict[str, Any]) -> None:
        """``finished`` with the wait status first seen, once, and the EOFs
        held back for it."""
        self._cancel_receipt_deadline()
        finished = {"type": "finished", "status": self.exit_status, **receipt}
        self._once(Sent.FINISHED, finished)
        self._drop_backlog_once_exited()
        for stream in self._eofs_after_finished:
            self._forward_eof(stream)
        self._eofs_after_finished.clear()
        if self._cancel_after_finished is not None:
            self._end_cancelled(self._cancel_after_finished)  # the stop's

    @property
    def _outcome_known(self) -> bool:
        return self._over or self._explaining or Sent.FINISHED in self._sent

    @property
    def _over(self) -> bool:
        """The stream's end is decided: its last response is sent, or the
        error of a start that failed waits for its unit to go."""
        return self._ended or self._failure_held is not None

    def _check_failure(self, status: UnitStatus) -> None:
        if self._outcome_known:
            return  # e.g. a reset after `finished` shows failed/ExecMainCode=0
        if status.has_failed or (
            status.failed_without_status and self._failure_confirmed
        ):
            self._fail_for(status)
        elif (
            status.failed_without_status
            and UnitCall.CONFIRM_FAILURE not in self._called
            and self._watch
        ):
            # Perhaps half a change: decide on the whole state, as the
            # refresh's own answer has it (not on signals in between).
            self._called.add(UnitCall.CONFIRM_FAILURE)
            self._watch.refresh().addCallbacks(
                self._failure_refreshed, self._log_failure, errbackArgs=("GetAll",)
            )

    def _fail_for(self, status: UnitStatus) -> None:
        """End the request of a unit systemd could not run the command of,
        saying why: for 226/NAMESPACE, once the paths its sandboxing needs
        have been looked at (off the reactor's thread)."""
        required = self.plan.required_paths
        if not (status.has_failed and status.status == EXIT_NAMESPACE and required):
            self._fail_once_gone(*self._failure(status))
            return
        self._explaining = True
        self._start_deadline.cancel()
        self._context.first_missing(required).addCallback(self._explained, status)

    def _explained(self, missing: NamedPath | None, status: UnitStatus) -> None:
        self._explaining = False
        if self._reaped:
            return  # vanished meanwhile: that ended the request
        self._fail_once_gone(*self._failure(status, missing))
        self._maybe_end()

    def _failure(
        self, status: UnitStatus, missing: NamedPath | None = None
    ) -> tuple[int, str]:
        plan = self.plan
        return status.failure(
            plan.executable, plan.command.cwd, plan.soft_file_limit, missing
        )

    def _failure_refreshed(self, properties: dict[str, Any]) -> None:
        self._failure_confirmed = True
        self._unit_changed(properties)

    def _check_unstarted(self, state: dict[str, Any]) -> None:
        """End the request of a unit whose start job ended without starting
        it (its condition false, say): nothing else would until
        ``start-timeout``, and then without saying why."""
        if (
            self._outcome_known
            or Sent.STARTED in self._sent
            or not self.knows_its_unit  # read again after systemd's return:
            # _lost_before_started judges that read
            or not start_job_ended_unstarted(state)
        ):
            return
        if UnitCall.CONFIRM_UNSTARTED not in self._called and self._watch:
            # A stale snapshot (an older unit of its name) is no proof:
            # decide on the whole state as it is now.
            self._called.add(UnitCall.CONFIRM_UNSTARTED)
            self._unstarted_seen = dict(state)
            self._watch.refresh().addCallbacks(
                self._unstarted_refreshed, self._log_failure, errbackArgs=("GetAll",)
            )

    def _unstarted_refreshed(self, properties: dict[str, Any]) -> None:
        if self._outcome_known:
            return  # unloaded meanwhile: _unit_changed has ended it
        if not start_job_ended_unstarted(properties):
            self._forget_unstarted()  # a stale snapshot: it may yet start
            return
        # (The watch has delivered this answer already: the state is in.)
        self._fail_unstarted(properties)
        self._maybe_end()

    def _forget_unstarted(self) -> None:
        """Nothing seen proves the start job ended unstarted: a later state
        that shows it is confirmed afresh."""
        self._unstarted_seen = None
        self._called.discard(UnitCall.CONFIRM_UNSTARTED)

    def _fail_unstarted(self, state: dict[str, Any]) -> None:
        if self._start_dropped(state):
            message = f"unit {self.unit_name} {_START_DROPPED}"
            self._fail(START_DROPPED_ERRNO, message)
            return
        # Never started, as for systemd's own exit codes (unit.py).
        self._fail(NOT_STARTED_ERRNO, f"unit {self.unit_name}: {why_unstarted(state)}")

    def _start_dropped(self, state: dict[str, Any]) -> bool:
        """Whether a start job that ended unstarted was dropped by its
        manager's reload: still queued at a daemon-reload (or kept over a
        daemon-reexec), it met the unit as reloaded from its transient file,
        and a file that does not parse back is ``bad-setting``, no command,
        nothing ran. sdexec's own units parse back (sdexec/execstart.py;
        until 2026-11-28 they did not: systemd 252 writes ``ExecStartEx=``
        under a key its reader does not know), so this is a manager's doing.
        The load state is not signalled, and the unit is often unloaded
        before a read could show it: a reload meanwhile, and no condition or
        assertion that failed, say it."""
        return (
            (self._manager_left or self._manager_reloaded)
            and state.get("LoadState", "bad-setting") == "bad-setting"
            and not checks_failed(state)
        )

    def _output(self, stream: str, data: bytes) -> None:
        if self._tap is not None:
            self._tap(stream, data, False)
        if self.plan.forwards(stream):
            self._send(self._io(stream, data=data))
        if self.valve is not None:
            self.valve.wrote(self, len(data))

    def _output_eof(self, stream: str) -> None:
        if self._awaiting_receipt and UnitCall.STOP in self._called:
            # The stop that closed it went out right behind the receipt's
            # GetAll (_may_release_before_receipt): its EOF still follows
            # `finished`, as where the stop waits for the answer. (A failed
            # unit's outputs close as it fails, before either: as ever.)
            self._eofs_after_finished.append(stream)
            return
        self._forward_eof(stream)
        self._maybe_end()

    def _forward_eof(self, stream: str) -> None:
        if self._tap is not None:
            self._tap(stream, b"", True)
        if self.plan.forwards(stream):
            self._send(self._io(stream, eof=True))

    def _io(self, stream: str, data: bytes = b"", eof: bool = False) -> dict:
        return {
            "type": "output",
            "pid": self.pid if self.pid is not None else -1,
            "io": encode_io(stream, self._context.rank, data, eof, raw=True),
        }

    def _add_credit(self, nbytes: int) -> None:
        if self.credits_stdin:
            self._send({"type": "add-credit", "channels": {"stdin": nbytes}})

    # -- the end -------------------------------------------------------------

    def _maybe_end(self) -> None:
        if self._awaiting_receipt or self._explaining:
            return  # `finished` or the error comes first; each calls this again
        started = UnitCall.START in self._called
        if self.status.is_inactive and self.output.eof and started and self._left:
            if not self._ended:
                self._ended = True
                self._responder.error(*self._end_of_stream())
            self._reap()

    def _end_of_stream(self) -> tuple[int, str]:
        """ENODATA after ``finished``; :data:`NO_EXIT_STATUS_ERRNO` for a
        process that started and whose exit status never came (RFC 42 has
        ``finished`` before the end: a stream must not end as a success
        without one)."""
        if self._failure_held is not None:
            return self._failure_held  # its unit is gone: the name is free
        if Sent.STARTED in self._sent and Sent.FINISHED not in self._sent:
            message = f"unit {self.unit_name} ended without an exit status"
            return NO_EXIT_STATUS_ERRNO, message
        return errno.ENODATA, ""

    @property
    def _left(self) -> bool:
        """Whether an inactive unit is one that has been and gone, not one
        yet to start. An output channel's EOF says so (systemd keeps its
        ends until then); without channels (stdio passthrough) the outcome
        must be known, or the unit stopped. Either way, not while the state
        shows a job queued for it, nor a main process never seen running
        whose exit has not come either: the EOF comes by its own socket, and
        may be read before the bus has brought the run's states (a burst of
        starts), the inactive seen being the one before the start; the unit,
        reaped on it and so no longer followed, was left failed for good."""
        if self._watch is not None and queued_job(self._watch.state):
            # (The stop's, or a start it replaced, may be read from before
            # the stop: the start's answer reads the signals that came
            # ahead of it.)
            return False
        if self._before_its_run_seen:
            return False
        if not self._passed.streams:
            return True
        return self._outcome_known or UnitCall.STOP in self._called

    @property
    def _before_its_run_seen(self) -> bool:
        """The state shows a main process (the ``Service`` interface's
        signal) but neither its run (``started`` not sent) nor its exit, nor
        is its outcome known: an inactive beside it is the ``Unit``
        interface's state from before the start, its later signals still
        on their way. (Once seen running, an inactive without an exit
        status is a unit systemd lost: :meth:`_end_of_stream`.)"""
        return (
            Sent.STARTED not in self._sent
            and not self._outcome_known
            and self.status.runs_unseen_end
        )

    def _refuse(self, problem: str) -> None:
        """The unit runs outside its fence: fail the request, kill it now.
        EIO, which Flux's job-exec reads as a failed containment check (it
        drains the node), and which sdexec sends for nothing else; sent once
        the unit is gone, as Flux's sdexec sends its post-start check's."""
        log.error("{unit}: {problem}", unit=self.unit_name, problem=problem)
        self._fail_once_gone(errno.EIO, problem)
        self._kill_unit("all", signal.SIGKILL)
        self._stop()

    def _start_overdue(self) -> None:
        """No ``started`` within the start timeout: the unit's states are
        not the model's. Stop the unit, and end the request saying what was
        seen once it is gone (inactive, its outputs closed), and reap it."""
        seen = self.status
        message = (
            f"unit {self.unit_name} did not start a process sdexec can follow"
            f" within {self._context.start_timeout:g} s: last seen"
            f" {seen.active_state or 'no state'}/{seen.sub_state or '-'},"
            f" ExecMainPID {seen.pid}, ExecMainCode {seen.code},"
            f" Result {seen.result or '-'}{_unit_type(self.plan.properties)}"
        )
        log.warn("{message}", message=message)
        self._fail_once_gone(START_TIMEOUT_ERRNO, message)
        self._stop()
        self._maybe_end()

    def _lost_before_started(self, state: dict[str, Any]) -> None:
        """Read again after an outage, a unit whose start systemd accepted
        and that sdexec never saw start has no start job, no invocation and
        runs nothing: its manager was killed before the start was followed
        (the new one loaded the unit from the dead one's file), and will
        never start it. The request would wait out ``start-timeout``, and
        its process, if it ran, runs on outside any unit."""
        if Sent.STARTED in self._sent or self._ended or self._reaped:
            return
        if state.get("LoadState") == "not-found":
            return  # unloaded is no proof its manager lost it: _unit_changed
        if never_invoked(state):
            self._end_what_it_left(state)
            self._vanished(_LOST)

    @property
    def knows_its_unit(self) -> bool:
        """Whether what was seen of the unit may be judged: systemd is
        there, and the unit has been read again since it came back (the
        signals of the outage were lost). A verdict due meanwhile (the
        start timeout, the stop timer's, a job's) waits for that read."""
        return self._systemd.connected and not self._reread.pending

    def when_reread(self) -> defer.Deferred[None]:
        """Fires once the unit has been read again after systemd's return
        (at once if no such read is pending)."""
        return self._reread.when_done()

    def _read_again(self) -> defer.Deferred[object]:
        """The unit's state, read afresh after systemd's return and judged;
        :data:`_LOST_AGAIN` if systemd went away again first."""
        assert self._watch is not None  # resync reads only a watched unit
        refreshed = self._watch.refresh()
        return refreshed.addCallbacks(self._lost_before_started, self._resync_failed)

    def _resync_failed(self, failure: Failure) -> object:
        if is_connection_lost(failure_value(failure)):
            return _LOST_AGAIN  # the next restore resyncs
        self._vanished(
            f"cannot be read: {failure.getErrorMessage()} (lost while systemd was away)"
        )
        return None

    def _note_cgroup(self, state: dict[str, Any], pid: int = 0) -> None:
        """Where its processes are: should its manager lose the unit, what
        it left is found there, even once the main process has exited. The
        unit's ``ControlGroup`` where a ``GetAll`` read it, else its main
        process's (sdexec/orphans.py)."""
        if self._cgroup is None:
            control_group = state.get("ControlGroup")
            if isinstance(control_group, str) and control_group:
                self._cgroup = control_group
            elif pid > 0:
                manager = self._start_manager_cgroup  # the one that ran it
                self._cgroup = unit_cgroup(self.unit_name, pid, manager)

    def _unit_cgroup(self, state: Mapping[str, Any] | None = None) -> str | None:
        """The unit's cgroup: as noted (``ControlGroup``, or its main
        process's, checked to be where the manager makes it), else where
        the manager makes it, from its own cgroup (noted when the start was
        asked for) and the unit's slice (its ``Slice`` in ``state``, else the
        one asked for): a ``/proc`` hidden from the service (hidepid) or a
        main process already gone need not leave it unknown."""
        slice_name = (state or {}).get("Slice") or self.plan.slice
        return self._cgroup or expected_unit_cgroup(
            self._start_manager_cgroup,
            slice_name,
            self.unit_name,
            version_number(self._systemd.version),
        )

    def _end_what_it_left(self, state: Mapping[str, Any]) -> None:
        """Its manager lost the unit, and its processes run on outside any
        unit, followed by no one: end them (sdexec/orphans.py). Where no
        cgroup was noted (its main process gone before it could be read),
        where the manager made it: in its own cgroup, noted when the start
        was asked for, and the unit's slice (the new manager loads the
        same, from the same file)."""
        cgroup = self._unit_cgroup(state)
        if cgroup is None or self._orphans_ended:
            return
        self._orphans_ended = True
        signum = self.stop_timer.signum
        self._context.end_lost_unit(self.unit_name, cgroup, signum, self)

    def _vanished(
        self, what: str, errnum: int = UNIT_GONE_ERRNO, forward_unread: bool = True
    ) -> None:
        """The unit is no longer the one started (its manager restarted, it
        was unloaded while the connection was down, or started again by
        hand): nothing more will come of ours. ``errnum``: what the request
        ends with (:data:`START_DROPPED_ERRNO` for a start never run).
        ``forward_unread``: what the output sockets hold unread now is the
        process's, and goes out before the error."""
        message = f"unit {self.unit_name} {what}"
        log.warn("{message}", message=message)
        if forward_unread:
            # No EOF will come (systemd's ends may never close): what the
            # process wrote and the service has not read yet is not lost.
            self.output.read_queued()
        self._fail(errnum, message)
        self._reap()

    def _fail(self, errnum: int, errstr: str) -> None:
        """End the stream with an error (no more responses follow); what
        output is left is read to EOF and discarded. A failure held for its
        unit's end (:meth:`_fail_once_gone`) is the error sent: the first
        verdict stands."""
        self._start_deadline.cancel()
        self._cancel_failure_wait()
        if not self._ended:
            self._ended = True
            self._responder.error(*(self._failure_held or (errnum, errstr)))
        self._wind_down()

    def _wind_down(self) -> None:
        """What the stream's end decided ends at once: signals held for a
        start that will never come, stdin, and output unread (read to EOF
        and discarded)."""
        self._early_kills.drop()  # if it never started, they never will be
        self.stdin.discard()  # a backlog would hold its client's connection
        self.output.open()

    def _fail_once_gone(self, errnum: int, errstr: str) -> None:
        """End the stream of a start that failed (systemd could not run the
        command, its fence does not hold, it timed out) with this error once
        its unit, reset or stopped, is gone (:meth:`_maybe_end`,
        :meth:`_end_of_stream`), as Flux's sdexec does, not before: a
        client that retries at once with the same unit name must find it
        free, not EEXIST for the milliseconds of the reset or stop. Nothing
        else is sent meanwhile; after :data:`FAILED_UNIT_WAIT` it goes out
        all the same (:meth:`_failure_overdue`)."""
        if self._over:
            return
        self._failure_held = (errnum, errstr)
        self._start_deadline.cancel()
        self._wind_down()
        self._failure_wait = self._context.clock.callLater(
            FAILED_UNIT_WAIT, self._failure_overdue
        )

    def _failure_overdue(self) -> None:
        """The failed start's unit is not gone within
        :data:`FAILED_UNIT_WAIT`: its error goes out now, its name held
        until it is."""
        self._failure_wait = None  # it has fired
        assert self._failure_held is not None  # what the timer waited for
        # Bounded: a stalled manager leaves every failed start's unit so.
        self._context.client_warning(
            "failed unit not gone",
            "{unit}: not gone {wait:g} s after its start failed ({error}):"
            " the request's error goes out, and the unit's name stays held"
            " until it is gone",
            unit=self.unit_name,
            wait=FAILED_UNIT_WAIT,
            error=errno_name(self._failure_held[0]),
        )
        self._fail(*self._failure_held)

    def _cancel_failure_wait(self) -> None:
        """The failure is answered, or the unit gone: no timer waits."""
        if self._failure_wait is not None:
            self._failure_wait.cancel()
            self._failure_wait = None

    def _reap(self) -> None:
        if self._reaped:
            return
        self._reaped = True
        self.detach_valve()
        self._early_kills.drop()
        self._cancel_receipt_deadline()
        self._cancel_failure_wait()
        self.stop_timer.stopped()
        self._start_deadline.cancel()
        for timer in self._retry_timers.values():
            if timer.active():
                timer.cancel()
        if self._watch is not None:
            self._watch.cancel()
        self.stdin.abort()  # as the output: a process may outlive its unit
        self.output.close()  # if systemd still holds its ends (EDEADLK)
        self._on_reaped(self)

    def _stop_abandoned(self) -> None:
        """Stop the unit of a process whose client left. Before ``started``
        its processes may run all the same, unseen, and the SIGKILL a client
        that left is owed (:meth:`client_gone`) would only follow the stop's
        SIGTERM, whose handlers would run: every process of the unit gets
        SIGKILL first. All of them, not its main process alone: that may
        not be known to systemd yet (its start job still queued, which the
        stop then cancels), where ``main`` fails and ``all`` signals what
        there is; and no client is left to read what they would write."""
        if self._kill_main_wanted and Sent.STARTED not in self._sent:
            self._call(
                UnitCall.KILL_UNSEEN,
                lambda unit: self._systemd.kill_unit(unit, "all", signal.SIGKILL),
            )
        self._stop()

    def _stop(self) -> None:
        self._stop_wanted = True  # made again if the connection loses it
        # "replace": with "fail", systemd refuses to stop a unit whose start
        # job is still queued, and the unit would be left running.
        self._call(UnitCall.STOP, lambda unit: self._systemd.stop_unit(unit, "replace"))

    def _call(self, call: UnitCall, method: Callable[[str], Any]) -> None:
        if call not in self._called:
            self._called.add(call)
            method(self.unit_name).addErrback(self._call_failed, call)

    def _call_failed(self, failure: Failure, call: UnitCall) -> None:
        outcome = classify_call_failure(
            failure,
            retried=call in _RETRIED and not self._reaped,
            moot_once_gone=call in _MOOT_ONCE_GONE,
        )
        if outcome is CallFailure.MOOT:
            return  # it ended and was unloaded first: the watch sees it go
        if outcome is CallFailure.AGAIN_ON_RECONNECT:
            # Made again after the reconnection: no failure to say (the
            # outage is said once, not once for each call of each unit).
            self._called.discard(call)
            return
        if outcome is CallFailure.RETRY_LATER:
            self._retry_later(call)
        self._log_failure(failure, call.value)

    def _retry_later(self, call: UnitCall) -> None:
        clock = self._context.clock
        delay = self._backoff.next_delay()
        self._retry_timers[call] = clock.callLater(delay, self._retry, call)

    def _retry(self, call: UnitCall) -> None:
        """Make ``call`` again, if the unit still needs it."""
        self._called.discard(call)
        if call is UnitCall.STOP and self._stop_wanted:
            self._stop()
        elif self._watch is not None:
            self._unit_changed(self._watch.state)

    def _once(self, kind: Sent, payload: dict[str, Any]) -> None:
        if kind not in self._sent:
            self._sent.add(kind)
            self._send(payload)

    def _send(self, payload: dict[str, Any]) -> None:
        if not self._over:
            self._responder.respond(payload)

    def _log_failure(self, failure: Failure, what: str) -> None:
        log.warn(
            "{unit}: {what} failed: {error}",
            unit=self.unit_name,
            what=what,
            error=failure.getErrorMessage(),
        )

    # -- the stop timer's actions -----------------------------------------------

    def _signal_lingering(self, signum: int) -> None:
        self._context.count("stop-timer-signal")
        # Straight to systemd, not through kill(): a unit never seen started
        # (its client left, its start overdue) has processes to signal too.
        self._kill_unit("all", signum)

    def _kill_unit(self, who: str, signum: int) -> None:
        """``KillUnit`` now, open loop (a failure is logged)."""
        self._systemd.kill_unit(self.unit_name, who, signum).addErrback(
            self._log_failure, f"KillUnit({who}, {signum})"
        )

    def _abandon_unit(self, reason: str) -> None:
        """The unit outlived the stop timer: end the stream with EDEADLK
        (after ``finished``, if the main process exited: its status stands)
        and drain. The process stays tracked until the unit leaves
        deactivating; then it is reset if failed, and reaped, as usual."""
        self._context.count("stop-timer-abandoned")
        # The drain keeps the short reason; the client is told what was tried.
        self.unkillable(f"{reason}: {self.stop_timer.account()}; the node is drained")
        self._context.drain(reason, AdminCause.ABANDONED_UNIT)


class _UnitStop:
    """The :class:`~sdexec.unitstop.StopTimerTarget` of a process's unit."""

    # Slots, in these parts of every process: RSS per process is a target
    # (docs/performance.md), and an instance's __dict__ is most of its size.
    __slots__ = ("_process",)

    def __init__(self, process: Process) -> None:
        self._process = process

    def signal_all(self, signum: int) -> None:
        self._process._signal_lingering(signum)

    def abandon(self, reason: str) -> None:
        self._process._abandon_unit(reason)


class _StartDeadline:
    """The start timeout: from the start job to ``started``, or the request
    is ended (:meth:`Process._start_overdue`, ``overdue``). A unit whose
    states the model does not expect must not hang it.

    ``awaited()`` says whether the start is still awaited (nothing counts
    once it has started or the request's outcome is known); ``may_judge()``
    whether the unit may be judged (:attr:`Process.knows_its_unit`). Not
    while systemd is away, nor before the unit is read again after its
    return: what the unit did meanwhile is not known (its signals were
    lost), and a timeout that ran out then counts again, whole, from that
    read (:meth:`judge_held`)."""

    __slots__ = (
        "_awaited", "_clock", "_held", "_may_judge", "_overdue", "_seconds", "_timer"
    )  # fmt: skip

    def __init__(
        self,
        clock: IReactorTime,
        seconds: float,
        *,
        awaited: Callable[[], bool],
        may_judge: Callable[[], bool],
        overdue: Callable[[], None],
    ) -> None:
        self._clock = clock
        self._seconds = seconds
        self._awaited = awaited
        self._may_judge = may_judge
        self._overdue = overdue
        self._timer: IDelayedCall | None = None
        #: It ran out while the unit could not be judged: counts again
        #: once it can.
        self._held = False

    def arm(self) -> None:
        """Count the timeout from now, if the start is still awaited."""
        if self._awaited():
            self._timer = self._clock.callLater(self._seconds, self._ran_out)

    def cancel(self) -> None:
        """The process started, or its request ended: no verdict."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def judge_held(self) -> None:
        """The unit has been read again: a timeout that ran out before
        counts again from now, unless the start came meanwhile."""
        held, self._held = self._held, False
        if held:
            self.arm()

    def _ran_out(self) -> None:
        self._timer = None
        if not self._awaited():
            return
        if not self._may_judge():
            self._held = True
            return
        self._overdue()


class _Reread:
    """The unit's read after systemd's return (``read()``: its answer judged,
    :data:`_LOST_AGAIN` if systemd went away again first). Until it has
    answered, no verdict is given on what was seen before (``pending``:
    :attr:`Process.knows_its_unit`); ``done()`` is called once it has."""

    __slots__ = ("_asked", "_done", "_read", "_waiters", "pending")

    def __init__(
        self, read: Callable[[], defer.Deferred[object]], done: Callable[[], None]
    ) -> None:
        self._read = read
        self._done = done
        #: systemd is back and the latest re-read has not answered yet.
        self.pending = False
        self._waiters: list[defer.Deferred[None]] = []
        #: Re-reads asked for so far: only the latest one's answer ends the
        #: re-reading (an earlier one's failure may come after it was asked).
        self._asked = 0

    def start(self) -> defer.Deferred[None]:
        """Read the unit again; fires once its answer has been handled."""
        self.pending = True  # already while the read delivers its state
        self._asked += 1
        return self._read().addCallback(self._answered, self._asked)

    def when_done(self) -> defer.Deferred[None]:
        """Fires once no re-read is pending (at once if none is)."""
        if not self.pending:
            return defer.succeed(None)
        waiter: defer.Deferred[None] = defer.Deferred()
        self._waiters.append(waiter)
        return waiter

    def _answered(self, outcome: object, asked: int) -> None:
        """Not a read lost with systemd again (the next return reads it),
        nor one a later re-read has replaced."""
        if outcome is _LOST_AGAIN or asked != self._asked:
            return
        self.pending = False
        self._done()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(None)


class _EarlyKills:
    """Signals asked for before ``started``, held for the start: the unit
    has no process before it (systemd would signal nothing and answer
    success). ``kill(signum, who)`` signals the unit once it has started
    (:meth:`Process.kill`)."""

    __slots__ = ("_held", "_kill", "_sent")

    def __init__(self, kill: Callable[[int, str], defer.Deferred[Any]]) -> None:
        self._kill = kill
        #: (signal, who, the uid that asked) with its answer, in the order
        #: asked.
        self._held: list[tuple[int, str, int | None, defer.Deferred[None]]] = []
        #: Fired once those signals have gone out (:meth:`when_sent`).
        self._sent: list[defer.Deferred[None]] = []

    def hold(self, signum: int, who: str, uid: int | None) -> defer.Deferred[None]:
        """Hold the signal (asked by ``uid``) for the start: answered once
        sent; EAGAIN past :data:`MAX_EARLY_KILLS` (each is a request's
        answer, waiting)."""
        if len(self._held) >= MAX_EARLY_KILLS:
            raise RequestError(
                errno.EAGAIN,
                f"{MAX_EARLY_KILLS} signals already wait for this process to start",
            )
        held: defer.Deferred[None] = defer.Deferred()
        self._held.append((signum, who, uid, held))
        return held

    def refuse_of(self, uids: frozenset[int], why: Callable[[int, int], str]) -> int:
        """Never send the signals ``uids`` asked for: each is answered
        ``EPERM``, ``why(uid, signum)``; how many."""
        refused = [each for each in self._held if each[2] in uids]
        self._held = [each for each in self._held if each[2] not in uids]
        for signum, _who, uid, held in refused:
            assert uid is not None  # in uids
            held.errback(RequestError(errno.EPERM, why(uid, signum)))
        return len(refused)

    def when_sent(self) -> defer.Deferred[None]:
        """Fires once the signals held have been sent; never if the process
        never starts."""
        sent: defer.Deferred[None] = defer.Deferred()
        self._sent.append(sent)
        return sent

    def send(self) -> None:
        """It started: send every signal held."""
        kills, self._held = self._held, []
        sent, self._sent = self._sent, []
        for signum, who, _uid, held in kills:
            self._kill(signum, who).chainDeferred(held)
        for each in sent:
            each.callback(None)

    def drop(self) -> None:
        """It will never start: each signal held is ESRCH."""
        kills, self._held = self._held, []
        self._sent = []  # they never go out
        for *_, held in kills:
            held.errback(_never_started())


def _unit_type(properties: Any) -> str:
    """``, Type=X``: the unit's type as sent (``exec``, unless a request set
    it, which only a test's policy allows: the deadline must hold for any)."""
    for prop in properties:
        if prop.name == "Type":
            return f", Type={prop.value}"
    return ""


class _Nowhere:
    """The responder of a process whose client has gone."""

    def respond(self, payload: dict[str, Any]) -> None:
        pass

    def error(self, errnum: int, errstr: str) -> None:
        pass


def _never_started() -> RequestError:
    return RequestError(errno.ESRCH, "the process never started")


#: What a re-read lost with systemd again hands on: no read was made.
_LOST_AGAIN = object()


def _passing_on(result: object, answered: defer.Deferred[None]) -> object:
    """Fire ``answered`` on the way, and hand ``result`` on unchanged."""
    answered.callback(None)
    return result
