"""Leftover units: units of this service that no process of this run
tracks (Flux's ``sdmon``): an earlier run's, or this run's lost starts,
units given up and units restarted by hand.

A service killed with SIGKILL, or one whose start job's reply was lost with
the connection to systemd, leaves units running that nobody follows. The
service tells its own units from anyone else's by a mark at the end of
their ``Description``: `` [sdexec:ID]``, ``ID`` the first 12 hex digits of
the SHA-256 of the service's listen endpoint (stable across restarts of one
service, different for two services on one manager; names cannot be used,
since a request may name its unit with ``SDEXEC_NAME``). A ``unix:``
endpoint counts by its socket path alone, so its options (``mode=``,
``lockfile=``, ``backlog=``) may change between runs, and by one spelling of
that path (``//``, ``./`` and symlinked directories resolved); a ``systemd:``
endpoint by the path of the socket systemd passed (``systemd:PATH``: two
instances of one socket-activated unit share their endpoint, not their
socket). Units without the
mark — other programs', other services' — are never touched. So a change
of ``listen`` makes an earlier run's units another service's: the first
scan names the running units with another sdexec mark, for the admin.

At start, after every reconnection and when a unit restarted by hand is
reaped, the service lists the manager's services (``ListUnitsByPatterns``)
and adopts every marked one it does not track: each is logged, listed by
``sdexec.list``/``sdexec ps`` with state ``O`` (and so in ``stats``), can
be signalled by ``sdexec.kill``, and is followed until it is unloaded: one
that ended is stopped (``active/exited``) or reset (``failed``) so it does
not stay loaded. With ``[sdexec] leftover-units = "stop"`` (the default)
each is stopped at once and the service stays drained, with the reason ``N
leftover units from a previous run`` (``1 leftover unit`` for one; without
"from a previous run" while one of this run's is among them), until they
are gone; ``"keep"`` leaves them running.

A leftover that stays *deactivating* (a process that ignores the stop's
SIGTERM: its units have ``SendSIGKILL=no`` and no stop timeout, so systemd
waits for ever) gets the site's stop timer, as a tracked process's unit
does (sdexec/unitstop.py): ``sdexec-stop-timer-signal`` to every process
after ``sdexec-stop-timer-sec``, and after as long again it is abandoned
and the node drained with ``unkillable user processes in unit NAME``. The
first period counts from when systemd says the unit began deactivating
(``StateChangeTimestampMonotonic``), not from the run that found it: a
service restarting more often than the period would otherwise never send
the signal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

from sdexec.config import Config
from sdexec.drain import AdminCause, Cause, SelfLifting
from sdexec.execstart import started_command
from sdexec.limits import listed_cmdline, listed_name
from sdexec.lograte import LogRate
from sdexec.logs import named_in_log
from sdexec.managerversion import version_number
from sdexec.orphans import expected_unit_cgroup
from sdexec.plan import ExecPlan, is_job_unit_name
from sdexec.receipt import OOM_KILL
from sdexec.sockets import unix_path
from sdexec.systemd import Manager, UnitStatus, queued_job
from sdexec.systemd.errors import failure_value, is_unit_gone
from sdexec.systemd.retry import CallBackoff, CallFailure, classify_call_failure
from sdexec.unitstop import StopTimer, StopTimerState

__all__ = [
    "STARTED_AGAIN",
    "START_TIMED_OUT",
    "Leftover",
    "Leftovers",
    "LeftoversContext",
    "marked",
    "owner_marks",
]

log = Logger()

#: The ``sdexec.list`` state of a leftover unit.
LEFTOVER_STATE = "O"


def owner_marks(listen: str, inherited: str | None = None) -> tuple[str, ...]:
    """The marks of the service listening on ``listen``: the first is the one
    the ``Description`` of every unit it starts ends with; any other is one
    an earlier version gave its units, still recognised as its own (the
    hash of the socket path as written, or of the whole endpoint string,
    options and all).

    ``inherited``: for a ``systemd:`` endpoint, what the socket systemd
    passed is bound to (its path, or ``@NAME``). Its ``name=`` or
    ``index=`` is the same in every instance of a templated unit
    (``sdexec@a``, ``sdexec@b``), whose sockets differ: marked by the
    endpoint alone, each instance's start took the others' running units
    for leftovers of its own and stopped them. The endpoint's own mark,
    which an earlier version gave its units, is not recognised: it may be
    another instance's."""
    path = unix_path(listen)
    if inherited is not None:
        return (_mark(f"systemd:{_canonical_address(inherited)}"),)
    identities = [listen] if path is None else [
        f"unix:{_canonical(path)}",
        f"unix:{path}",
        listen,
    ]  # fmt: skip
    return tuple(dict.fromkeys(_mark(identity) for identity in identities))


def _canonical(path: str) -> str:
    """One spelling of a socket path (``//``, ``./``, a symlinked directory:
    the same socket, the same service)."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(directory), name)


def _canonical_address(address: str) -> str:
    """A socket's path in one spelling; an abstract ``@NAME`` as it is."""
    return _canonical(address) if address.startswith("/") else address


def _mark(identity: str) -> str:
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return f" [sdexec:{digest}]"


def marked(plan: ExecPlan, mark: str) -> ExecPlan:
    """``plan`` with ``mark`` appended to its unit's ``Description``."""
    properties = tuple(
        dataclasses.replace(prop, value=f"{prop.value}{mark}")
        if prop.name == "Description"
        else prop
        for prop in plan.properties
    )
    return dataclasses.replace(plan, properties=properties)


#: How the log names a leftover found after the first scan: this run's own,
#: that it no longer follows.
UNFOLLOWED = (
    "of this run, no longer followed (a start whose answer was lost with"
    " systemd, or a unit given up)"
)
#: How it names one whose unit was started again outside sdexec.
STARTED_AGAIN = "of this run, started again outside sdexec"
#: The origin of one found when a start of its name was refused.
NAME_TAKEN = "of this run, found when a start of its name was refused"
#: The origin of one whose start systemd answered with a timeout of its bus.
START_TIMED_OUT = (
    "of this run, started though systemd answered its start with a timeout"
    " of its own call to the bus"
)


#: A mark of any sdexec service (:func:`owner_marks`).
_ANY_MARK = re.compile(r" \[sdexec:[0-9a-f]{12}\]$")


#: The calls a leftover makes again when refused: nothing else would (the
#: unit runs on, or stays failed, and the node drained for it for good).
_RETRIED = ("StopUnit", "ResetFailedUnit")


@dataclass(frozen=True)
class LeftoversContext:
    """What the leftover units need from the service around them (the
    server's); those read when needed may change meanwhile (a reload's
    configuration, a test's clock)."""

    #: The configuration in force: ``leftover-units``, the stop timer's.
    config: Callable[[], Config]
    #: The clock of the stop timers and of the calls made again.
    clock: Callable[[], IReactorTime]
    #: One more event in the service's counters.
    count: Callable[[str], None]
    #: ``drain(reason, cause)``: refuse new work for ``reason``; ``cause``,
    #: what drained it (a :class:`SelfLifting` one lifts itself).
    drain: Callable[[str, Cause], None]
    #: ``lift(kind)``: a self-lifting cause is over (its drain goes).
    lift: Callable[[SelfLifting], object]
    #: The process or leftover of the service's that has a unit name
    #: (``None``: nobody's).
    unit_follower: Callable[[str], object]
    #: ``end_what_lost_unit_left(unit, cgroup, signum, lost_by)``: its
    #: manager lost the unit (followed by ``lost_by``, if anyone), and what
    #: it ran may live on in ``cgroup`` (sdexec/orphans.py).
    end_what_lost_unit_left: Callable[[str, str, int, object], None]


def drain_reason(count: int, all_previous: bool) -> str:
    """Why the node is drained while ``count`` leftovers are being stopped;
    ``all_previous``: all were found at start (none after a reconnection)."""
    units = "unit" if count == 1 else "units"
    origin = " from a previous run" if all_previous else ""
    return f"{count} leftover {units}{origin}"


class Leftover:
    """One leftover unit, followed until systemd unloads it."""

    def __init__(
        self,
        systemd: Manager,
        context: LeftoversContext,
        name: str,
        description: str,
        leftovers: Leftovers,
        of_this_run: bool,
    ) -> None:
        self.name = name
        self.description = description
        #: This run's own unit (a lost start, one given up or restarted by
        #: hand), not a previous run's.
        self.of_this_run = of_this_run
        self.pid = -1
        #: The command line its ``ExecStart`` runs, once read (listed as
        #: none until then): no Description is one (its words joined by
        #: spaces, escaped, cut at 200 characters, or what the request set
        #: instead).
        self.cmdline: list[str] | None = None
        self._systemd = systemd
        self._context = context
        self._leftovers = leftovers
        self._stopping = False
        self._resetting = False
        #: A StopUnit or ResetFailedUnit systemd refused (LimitsExceeded of a
        #: busy bus, say) is made again on a backoff, as a process's are.
        self._backoff = CallBackoff()
        self._retry: IDelayedCall | None = None
        #: Inactive with a job queued: a restart's new run is on its way.
        self._new_run_queued = False
        #: systemd is back, and the unit not read again yet: its stop timer
        #: gives no verdict on what was seen before (its signals were lost).
        self.rereading = False
        #: Seen other than inactive: a start queued from now on is a new run
        #: (one adopted before its first start has none to replace).
        self._has_run = False
        #: Its run's ``InvocationID`` and ``ControlGroup`` as read: a
        #: manager killed and started again loads it from the dead one's
        #: file, never started (no invocation), and what it left runs on
        #: there, outside any unit, unless ended (sdexec/orphans.py).
        self._invocation: bytes | None = None
        self._cgroup: str | None = None
        #: Its ``Result`` was last seen other than ``oom-kill``: an OOM end
        #: from now on is this run's to count (one it was found with was
        #: counted, if at all, by the run that followed it then).
        self._oom_end_to_come = False
        self.stop_timer = self._new_stop_timer()
        self._watch = systemd.watch_unit(name, self._changed)

    def retime(self) -> None:
        """Take the stop timer of the configuration in force (a reload):
        no request timed a leftover, the site's values do
        (:meth:`StopTimer.retime`)."""
        config = self._context.config()
        self.stop_timer.retime(
            config.exec.sdexec_stop_timer_sec, config.exec.sdexec_stop_timer_signal
        )

    def _new_stop_timer(self) -> StopTimer:
        config = self._context.config()
        return StopTimer(
            self._context.clock(),
            config.exec.sdexec_stop_timer_sec,
            config.exec.sdexec_stop_timer_signal,
            self.name,
            _LeftoverStop(self, self._context, self._leftovers),
            lambda: self._systemd.connected and not self.rereading,
            self._leftovers.log_rate,
        )

    def follow(self, stop: bool, restored_at: float | None = None) -> None:
        """Read its state (again); stop it if asked to. ``restored_at``:
        systemd came back then, and once the state is read, the stop-timer
        signal the loss may have taken goes again
        (:meth:`StopTimer.systemd_restored`)."""
        refreshed = self._watch.refresh()
        refreshed.addCallback(self._read_command)
        if restored_at is not None:
            refreshed.addBoth(self._reread, restored_at)
        refreshed.addErrback(self._failed, "GetAll")
        if stop:
            self.stop()

    def _read_command(self, properties: dict[str, Any]) -> dict[str, Any]:
        if self.cmdline is None:
            self.cmdline = started_command(properties.get("ExecStart"))
        return properties

    def _reread(self, result: object, restored_at: float) -> object:
        self.rereading = False
        if not isinstance(result, Failure):
            self.stop_timer.systemd_restored(restored_at)
        return result

    def stop(self) -> None:
        """Stop the unit (``StopUnit`` once: a second call sends nothing)."""
        if not self._stopping:
            self._stopping = True
            self._call(self._systemd.stop_unit(self.name, "replace"), "StopUnit")

    def _call(self, answer: defer.Deferred[Any], what: str) -> None:
        """Follow a call's ``answer``: one that went through ends the
        backoff of those refused before it."""
        answer.addCallbacks(self._answered, self._failed, errbackArgs=(what,))

    def _answered(self, _: object) -> None:
        self._backoff.reset()

    def kill(self, signum: int, who: str = "all") -> defer.Deferred[None]:
        """Send ``signum`` to the unit's processes (``who``: systemd's ``all``,
        ``main``...)."""
        return self._systemd.kill_unit(self.name, who, signum)

    def describe(self) -> dict[str, Any]:
        """Its ``list`` entry: its command line once read, until then none
        (``cmd`` ``""``, ``cmdline`` ``[]``). Its Description is no argv:
        the words joined by spaces, escaped and cut, or a request's own
        text. Listed as one string, ``sdexec ps`` showed ``'sleep 60'``;
        split at spaces, ``sh -c 'a; b'`` lost its quotes."""
        cmdline = self.cmdline or []
        return {
            "pid": self.pid,
            "cmd": listed_name(cmdline),
            "cmdline": listed_cmdline(cmdline),
            "label": "",
            "unit": self.name,
            "state": LEFTOVER_STATE,
        }

    def what(self) -> str:
        """What it is, as an error that names it says: a client that meets
        its name (``SDEXEC_NAME``) or its job's id knows it by no label,
        and only a kill by pid reaches it."""
        pid = f"pid {self.pid}" if self.pid > 0 else "its pid not read yet"
        whose = "this run's" if self.of_this_run else "an earlier run's"
        return (
            f"a leftover (state O, {pid}; {whose}), which no request of this"
            " run follows"
        )

    @property
    def abandoned(self) -> bool:
        """Whether its stop timer gave it up (the node drained for it)."""
        return self.stop_timer.state is StopTimerState.ABANDONED

    def forget(self) -> None:
        """The unit is gone: stop following it, and its timers."""
        self._watch.cancel()
        self.stop_timer.stopped()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()

    def _changed(self, state: dict[str, Any]) -> None:
        if self._lost_with_its_manager(state):
            self._end_what_it_left()
            self._leftovers.gone(self)
            return
        status = UnitStatus.from_properties(state)
        self._note_result(status.result)
        if self._new_run_queued and not status.is_inactive:
            self._begin_new_run()
        self._has_run = self._has_run or not status.is_inactive
        if status.pid > 0:
            self.pid = status.pid
        # Not while stops are held: the start may yet fail.
        self.stop_timer.follow(
            status.is_deactivating and not self._leftovers.stops_held,
            _state_changed_at(state),
        )
        if state.get("LoadState") == "not-found":
            self._leftovers.gone(self)
        elif status.is_inactive:
            # With a job queued: the middle of a `systemctl restart`, whose
            # new run is followed on. Without: gone, and its new run (a
            # restart whose job was not seen) looked for.
            if queued_job(state):
                self._new_run_queued = self._has_run
            else:
                self._leftovers.gone(self, maybe_restarting=True)
        elif status.needs_stop:  # it ended: unload it
            self.stop()
        elif status.needs_reset and not self._resetting:
            self._resetting = True
            self._call(self._systemd.reset_failed_unit(self.name), "ResetFailedUnit")

    def _note_result(self, result: str) -> None:
        """Count an OOM end (``oom-kills``) as its ``Result`` turns to
        ``oom-kill``, once; the signals carry it, at no call's cost."""
        if not result:
            return  # not read yet
        ended_by_oom = result == OOM_KILL
        if ended_by_oom and self._oom_end_to_come:
            self._context.count("oom-kills")
        self._oom_end_to_come = not ended_by_oom

    def _lost_with_its_manager(self, state: dict[str, Any]) -> bool:
        """Whether the run it was is known, and the unit now one its
        manager never started (its processes lost with the manager that
        ran them); notes the run and its cgroup as they are read."""
        control_group = state.get("ControlGroup")
        if self._cgroup is None and isinstance(control_group, str) and control_group:
            self._cgroup = control_group
        invocation = state.get("InvocationID")
        if invocation is None or state.get("LoadState") == "not-found":
            return False
        if bytes(invocation):
            self._invocation = self._invocation or bytes(invocation)
            return False
        return self._invocation is not None

    def _end_what_it_left(self) -> None:
        """Its processes run on in the dead manager's cgroup: the stop-timer
        signal, then SIGKILL (the node drained if they may not be)."""
        log.warn("leftover unit {unit} was lost with its manager", unit=self.name)
        if self._cgroup is not None:
            self._context.end_what_lost_unit_left(
                self.name, self._cgroup, self.stop_timer.signum, self
            )

    def _begin_new_run(self) -> None:
        """A restart (by hand) started it again: the first run's stop timer
        (spent) and stop (done) are not the new run's."""
        self._invocation = None  # the new run's is noted as it is read
        self._new_run_queued = False
        self.stop_timer.stopped()
        self.stop_timer = self._new_stop_timer()
        self._stopping = self._resetting = False
        self._leftovers.started_again(self)

    def _failed(self, failure: Failure, what: str) -> None:
        outcome = classify_call_failure(failure, retried=what in _RETRIED)
        if outcome is CallFailure.AGAIN_ON_RECONNECT:
            # Made again when the connection is back (Leftovers.scan).
            self._stopping = self._resetting = False
            return
        if outcome is CallFailure.MOOT:
            return  # unloaded meanwhile: the watch sees it go
        retried = outcome is CallFailure.RETRY_LATER
        log.warn(
            "leftover unit {unit}: {what} failed: {error}{again}",
            unit=self.name,
            what=what,
            error=failure.getErrorMessage(),
            again="; made again later" if retried else "",
        )
        if retried and self._followed and not (self._retry and self._retry.active()):
            delay = self._backoff.next_delay()
            self._retry = self._context.clock().callLater(delay, self._try_again)

    @property
    def _followed(self) -> bool:
        """Whether this is the leftover of its name still followed (not one
        gone, nor one of a service that stopped): a call made again for
        one gone could stop a job started since under that name."""
        return self._leftovers.units.get(self.name) is self

    def _try_again(self) -> None:
        """Stop or reset the unit if it still needs it, as last seen (its
        signals keep that current: no GetAll, which the busy bus that
        refused the call may refuse too)."""
        if not self._followed:
            return
        self._stopping = self._resetting = False
        if self._leftovers.stop_now:
            self.stop()
        self._changed(self._watch.state)


def _state_changed_at(state: Mapping[str, Any]) -> float | None:
    """When the unit entered the state it is in, on the service's timers'
    clock, as systemd says (``StateChangeTimestampMonotonic``: on the
    ``CLOCK_MONOTONIC`` that :class:`~sdexec.clocks.MonotonicClock` reads,
    in microseconds); ``None`` where it does not say. A leftover's stop
    timer counts from it, not from the run that found it deactivating."""
    usec = state.get("StateChangeTimestampMonotonic")
    if isinstance(usec, int) and not isinstance(usec, bool) and usec > 0:
        return usec / 1e6
    return None


class _LeftoverStop:
    """The :class:`~sdexec.unitstop.StopTimerTarget` of a leftover unit:
    no request to fail, only the node to drain."""

    def __init__(
        self, unit: Leftover, context: LeftoversContext, leftovers: Leftovers
    ) -> None:
        self._unit = unit
        self._context = context
        self._leftovers = leftovers

    def signal_all(self, signum: int) -> None:
        self._context.count("stop-timer-signal")
        self._unit.kill(signum).addErrback(
            self._unit._failed, f"KillUnit(all, {signum})"
        )

    def abandon(self, reason: str) -> None:
        self._context.count("stop-timer-abandoned")
        self._context.drain(reason, AdminCause.ABANDONED_UNIT)
        self._leftovers.drain_while_stopping()  # it is stopping no more


class Leftovers:
    """The leftover units of one service (see the module's docstring)."""

    def __init__(
        self,
        systemd: Manager,
        context: LeftoversContext,
        marks: tuple[str, ...],
        hold_stops: bool = False,
    ) -> None:
        """``hold_stops``: adopt and drain, but stop nothing until
        :meth:`release_stops` (the service's start, once it listens: a start
        that then fails must not have stopped units it leaves unfollowed)."""
        if isinstance(marks, str) or not marks or not all(marks):
            raise ValueError("leftover units need the service's owner marks")
        self.units: dict[str, Leftover] = {}
        self._systemd = systemd
        self._context = context
        self._marks = marks
        #: A scan is in flight; the callers (and origins) of the next one.
        self._scanning = False
        self._asked: list[defer.Deferred[None]] = []
        self._origins: dict[str, str] = {}
        #: Listed once: what a later scan adopts is this run's own, a unit
        #: whose start's answer was lost with the connection to systemd.
        self._listed_once = False
        self._stops_held = hold_stops
        self._closed = False
        #: When systemd came back, until the scan that follows reads each
        #: leftover again (:meth:`systemd_restored`).
        self._restored_at: float | None = None
        #: Closed: called as each leftover still followed goes.
        self._on_gone: Callable[[], None] | None = None
        #: How many have gone (progress of a stop that waits for them).
        self.gone_count = 0
        self._log_rate: LogRate | None = None

    @property
    def log_rate(self) -> LogRate:
        """What bounds the lines said once per leftover (found, gone): a
        restart finding hundreds would log each of them (review session 49:
        ~900 lines for 200 leftovers). The drain's reason holds the count.
        Made at first use, on the clock then in force."""
        if self._log_rate is None:
            self._log_rate = LogRate(log, self._context.clock())
        return self._log_rate

    def systemd_restored(self) -> defer.Deferred[None]:
        """systemd is back after a loss: scan, and once each leftover is
        read again, its stop timer sends what the loss may have taken."""
        self._restored_at = self._context.clock().seconds()
        for unit in self.units.values():
            unit.rereading = True  # until the scan's (or its fallback's) read
        return self.scan()

    def release_stops(self) -> None:
        """Stop the leftovers held so far (``leftover-units = "stop"``), and
        any found later at once; read each again, so that one already
        deactivating gets its stop timer now."""
        self._stops_held = False
        for unit in list(self.units.values()):
            unit.follow(self._stopping)

    def reconfigured(self) -> None:
        """A reload may have changed ``leftover-units``: under ``stop`` now,
        the leftovers kept so far are stopped (a drain for units nothing
        stops would only lift at the next scan); under ``keep``, the drain
        for them lifts. Each takes the stop timer in force now, unless
        its signal has gone already."""
        for unit in self.units.values():
            unit.retime()
        if self.stop_now:
            for unit in list(self.units.values()):
                unit.stop()  # followed already; a stop sent is not sent again
        self.drain_while_stopping()

    def close(self, on_gone: Callable[[], None] | None = None) -> None:
        """The service stops: adopt nothing more (a reconnection's scan, or
        one still in flight). Those being stopped (``leftover-units =
        "stop"``, the service listening) are followed on until they are
        gone, their stop timers replaced by the service's stop, which
        escalates them with its own units (one that ignored SIGTERM was
        once left deactivating, running on after a clean stop), and
        ``on_gone`` is called as each goes. The others (kept, or the start
        ended before stopping them) are named and forgotten, for the next
        start to find."""
        self._closed = True
        self._on_gone = on_gone
        if self.stop_now:
            for unit in self.units.values():
                unit.stop_timer.stopped()  # (one abandoned stays so)
        else:
            self.forget_all()

    def forget_all(self) -> None:
        """Follow none of the leftovers any more (watches and stop timers
        go; the next run finds what is left): those there are named."""
        if self.units:
            log.warn(
                "the service stops with {count} leftover {units} not gone, left"
                " running ({why}), for its next start to find: {names}",
                count=len(self.units),
                units="unit" if len(self.units) == 1 else "units",
                why=self._why_left(),
                names=named_in_log(log, list(self.units), "leftover units left"),
            )
        for unit in self.units.values():
            unit.forget()
        self.units.clear()

    def _why_left(self) -> str:
        """Why the leftovers followed now are still there, for the log."""
        if not self._stopping:
            return "kept: leftover-units = keep"
        if self._stops_held:
            return "the start ended before stopping them"
        return "still stopping at the end of the service's stop"

    @property
    def stops_held(self) -> bool:
        """Whether stops (and stop timers) wait for the service to listen."""
        return self._stops_held

    @property
    def _stopping(self) -> bool:
        return self._context.config().sdexec.leftover_units == "stop"

    @property
    def stop_now(self) -> bool:
        """Whether a leftover found or followed now is stopped now."""
        return self._stopping and not self._stops_held

    def scan(self, origins: Mapping[str, str] | None = None) -> defer.Deferred[None]:
        """List the manager's services, adopt the marked ones nobody tracks,
        and follow (and, per ``leftover-units``, stop) every leftover.
        ``origins``: how the log names some of this run's own, by name
        (else: a previous run's at the first scan, :data:`UNFOLLOWED` after).

        Asked while a scan is in flight (units restarted by hand one after
        another, a reconnection meanwhile), it waits for one more scan
        after it, which answers every caller that asked meanwhile: a list
        of every service of the manager is not made once per caller."""
        asked: defer.Deferred[None] = defer.Deferred()
        self._asked.append(asked)
        self._origins.update(origins or {})
        if not self._scanning:
            self._scan_now()
        return asked

    def _scan_now(self) -> None:
        asked, self._asked = self._asked, []
        origins, self._origins = self._origins, {}
        self._scanning = True
        listed = self._systemd.list_units_by_patterns([], ["*.service"])
        listed.addCallback(self._listed, origins)
        listed.addBoth(self._scanned, asked)

    def _scanned(self, outcome: object, asked: list[defer.Deferred[None]]) -> None:
        self._scanning = False
        if isinstance(outcome, Failure) and not self._closed:
            # Nothing adopted, but a return's re-read is owed all the same:
            # a stop timer held while systemd was away waits for it.
            self._follow_each()
        for each in asked:
            if isinstance(outcome, Failure):
                each.errback(outcome)
            else:
                each.callback(None)
        if not self._asked or self._scanning:
            return  # none asked meanwhile, or a caller's callback scanned
        if self._closed:  # nothing more is adopted: answer them at once
            asked, self._asked = self._asked, []
            self._scanned(None, asked)
        else:  # asked meanwhile: that listing may predate it
            self._scan_now()

    def find(self, pid: int | None) -> Leftover | None:
        """The leftover with main pid ``pid`` (leftovers have no labels)."""
        if pid is None or pid <= 0:
            return None
        return next((unit for unit in self.units.values() if unit.pid == pid), None)

    def find_job(self, jobid: str) -> Leftover | None:
        """A leftover whose unit the service named for job ``jobid``
        (``SDEXEC_JOBID`` without ``SDEXEC_NAME``), or that is named
        ``jobid`` (a job of ``SDEXEC_TIME_LIMIT`` alone is known by its
        unit's name): its job was the run's that started it, and its name
        is all that is left of it."""
        named = self.units.get(jobid)
        if named is not None:
            return named
        return next(
            (
                unit
                for unit in self.units.values()
                if is_job_unit_name(unit.name, jobid)
            ),
            None,
        )

    def of_earlier_runs(self) -> int:
        """How many leftovers an earlier run of the service left (not this
        run's own lost or given-up units)."""
        return sum(not unit.of_this_run for unit in self.units.values())

    def describe(self) -> list[dict[str, Any]]:
        """Every leftover's ``list`` entry (:meth:`Leftover.describe`)."""
        return [unit.describe() for unit in self.units.values()]

    def gone(self, unit: Leftover, maybe_restarting: bool = False) -> None:
        """``unit`` was unloaded (or is inactive: ``maybe_restarting``, and
        then looked for again, a restart's new run followed as its own):
        forget it; the drain for those stopping is said afresh, or lifted."""
        if self.units.pop(unit.name, None) is None:
            return
        unit.forget()
        self.gone_count += 1
        self.log_rate.emit(
            LogLevel.info,
            "leftover gone",
            "leftover unit {unit} is gone",
            unit=unit.name,
        )
        self.drain_while_stopping()  # the count said afresh, or lifted
        if self._on_gone is not None:
            self._on_gone()
        if maybe_restarting:
            # That unit alone (a scan would read every leftover again: for
            # hundreds ending together, hundreds of times each).
            self.look_for(unit.name, STARTED_AGAIN)

    def look_for(self, name: str, origin: str) -> None:
        """Adopt the unit ``name`` if it is one of this service's that
        nobody follows (logged as ``origin``)."""
        if self._closed:
            return
        listed = self._systemd.list_units_by_patterns([], [name])
        listed.addCallback(self._adopt_listed, {name: origin})
        listed.addErrback(_log_rescan_failure, name)

    def started_again(self, unit: Leftover) -> None:
        """``unit``'s restart started a new run: kept or stopped as an
        adopted one would be."""
        log.warn(
            "leftover unit {unit} was started again outside sdexec: {action}",
            unit=unit.name,
            action=self._action(self._stopping),
        )
        self.drain_while_stopping()
        if self.stop_now:
            unit.stop()

    def _listed(self, listing: list[tuple], origins: Mapping[str, str]) -> None:
        if self._closed:
            return
        self._adopt_new(listing, origins)
        self._end_what_unstarted_units_left(listing)
        if not self._listed_once:
            self._name_units_marked_otherwise(listing)
        self._listed_once = True
        self.drain_while_stopping()
        self._follow_each()

    def _name_units_marked_otherwise(self, listing: list[tuple]) -> None:
        """At the first scan, name the running units another sdexec mark
        ends: another service's on this manager, or this one's from a run
        under another ``listen`` (the mark follows it), which nothing would
        ever find again. Which it is only the admin can tell."""
        others = [
            listed[0]
            for listed in listing  # (name, description, ..., active, ..., job)
            if _ANY_MARK.search(listed[1])
            and not self._mark_of(listed[1])
            and (listed[3] != "inactive" or listed[7] != 0)
        ]
        if not others:
            return
        log.warn(
            "{count} {units} of the manager {carry} the mark of another sdexec"
            " service, not this one's ({mark}, which follows the socket it listens on),"
            " and are left alone: {names}. If no other sdexec serves"
            " this manager, they are this service's from a run under another"
            " listen: stop them by hand",
            count=len(others),
            units="unit" if len(others) == 1 else "units",
            carry="carries" if len(others) == 1 else "carry",
            mark=self._marks[0].strip(),
            names=named_in_log(log, others, "units of another sdexec service"),
        )

    def _follow_each(self) -> None:
        """Read each leftover again (the first time: adopted), stopping it
        per ``leftover-units``, with systemd's return if one is owed."""
        restored_at, self._restored_at = self._restored_at, None
        for unit in list(self.units.values()):
            unit.follow(self.stop_now, restored_at)

    def _adopt_listed(self, listing: list[tuple], origins: Mapping[str, str]) -> None:
        """Adopt what ``listing`` holds that nobody follows, and follow it
        (not the leftovers followed already)."""
        if self._closed:
            return
        new = self._adopt_new(listing, origins)
        if new:
            self.drain_while_stopping()
        for unit in new:
            unit.follow(self.stop_now)

    def _adopt_new(
        self, listing: list[tuple], origins: Mapping[str, str]
    ) -> list[Leftover]:
        """The marked units of ``listing`` nobody follows, adopted."""
        new = []
        for listed in listing:  # ListUnits' (name, description, ..., job id, ...)
            name, description, active, job = listed[0], listed[1], listed[3], listed[7]
            mark = self._mark_of(description)
            # Not one inactive with no job: it has ended, and is unloading
            # (nothing to stop; adopted, its end would be looked for again).
            # With one, a restart's start is on its way.
            ours = mark and (active != "inactive" or job != 0)
            if not ours or self._context.unit_follower(name) is not None:
                continue
            if self._listed_once and active == "failed" and job == 0:
                self._reset_ended(name)
                continue
            # An origin asked for by a scan still waiting counts too.
            origin = origins.get(name) or self._origins.get(name)
            self._adopt(name, description[: -len(mark)], self._stopping, origin)
            new.append(self.units[name])
        return new

    def _reset_ended(self, name: str) -> None:
        """Reset a unit of this run that ended failed, with no job, which
        nobody follows: its process's reset was lost with systemd (a
        daemon-reexec between the end and the answer; the request had
        ended). Nothing runs in a failed unit: adopted, it drained the node
        while that was mended, and jobs were refused EBUSY meanwhile
        (review session 43 Q4-1)."""
        log.info("unit {unit} of this run ended failed: resetting it", unit=name)
        reset = self._systemd.reset_failed_unit(name)
        reset.addErrback(_log_reset_failure, name)

    def _end_what_unstarted_units_left(self, listing: list[tuple]) -> None:
        """A marked unit nobody follows, inactive with no job, in a full
        scan: where its manager was killed, the new one loaded it from the
        file the dead one left and never started it, while its processes
        may run on in the dead one's cgroup of it (a start whose answer was
        lost with that manager: nothing else knows of them). Whatever is
        there is ended (for a unit that simply ended, nothing is)."""
        for listed in listing:
            name, description, active, job = listed[0], listed[1], listed[3], listed[7]
            unstarted = active == "inactive" and job == 0
            followed = self._context.unit_follower(name) is not None
            if unstarted and self._mark_of(description) and not followed:
                read = self._systemd.get_service_properties(name)
                read.addCallback(self._end_what_it_left, name)
                read.addErrback(_log_unstarted_read_failure, name)

    def _end_what_it_left(self, properties: dict[str, Any], name: str) -> None:
        if self._closed or self._context.unit_follower(name) is not None:
            # The service stops (nothing more is started), or it is adopted
            # or started meanwhile: its own follower's now.
            return
        cgroup = expected_unit_cgroup(
            self._systemd.control_group,
            properties.get("Slice"),
            name,
            version_number(self._systemd.version),
        )
        if cgroup is not None:
            signum = self._context.config().exec.sdexec_stop_timer_signal
            self._context.end_what_lost_unit_left(name, cgroup, signum, None)

    def drain_while_stopping(self) -> None:
        """With ``leftover-units = "stop"``, drain while any is stopping
        (the count said afresh each time), and lift that drain, and no
        other, once none is (sdexec/drain.py)."""
        # Not for those the stop timer abandoned: drained for already, for
        # the admin to clear (as an abandoned process's unit is).
        stopping = [unit for unit in self.units.values() if not unit.abandoned]
        if self._stopping and stopping:
            previous = not any(unit.of_this_run for unit in stopping)
            reason = drain_reason(len(stopping), previous)
            self._context.drain(reason, SelfLifting.LEFTOVERS)
        else:
            self._context.lift(SelfLifting.LEFTOVERS)

    def _action(self, stop: bool) -> str:
        """What becomes of a leftover found now, for the log."""
        if not stop:
            return "kept (leftover-units = keep)"
        if self._stops_held:
            return "to be stopped once the service listens"
        return "stopping it"

    def _mark_of(self, description: str) -> str:
        """The service's mark ``description`` ends with, or ``""``."""
        return next((m for m in self._marks if description.endswith(m)), "")

    def _adopt(
        self, name: str, description: str, stop: bool, origin: str | None
    ) -> None:
        action = self._action(stop)
        of_this_run = origin is not None or self._listed_once
        self.log_rate.warn(
            "leftover found",
            "leftover unit {unit} {origin} ({description}): {action}",
            unit=name,
            origin=origin or (UNFOLLOWED if of_this_run else "from a previous run"),
            description=description,
            action=action,
        )
        self.units[name] = Leftover(
            self._systemd, self._context, name, description, self, of_this_run
        )


def _log_reset_failure(failure: Failure, unit: str) -> None:
    if not is_unit_gone(failure_value(failure)):  # unloaded meanwhile: done
        log.warn(
            "resetting failed unit {unit} failed: {error} (the next scan tries again)",
            unit=unit,
            error=failure.getErrorMessage(),
        )


def _log_unstarted_read_failure(failure: Failure, unit: str) -> None:
    if not is_unit_gone(failure_value(failure)):  # unloaded meanwhile: nothing left
        log.warn(
            "reading inactive unit {unit} failed: {error}",
            unit=unit,
            error=failure.getErrorMessage(),
        )


def _log_rescan_failure(failure: Failure, unit: str) -> None:
    log.warn(
        "looking for a new run of leftover unit {unit} failed: {error}",
        unit=unit,
        error=failure.getErrorMessage(),
    )
