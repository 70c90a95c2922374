"""The RPC server: requests in, processes made, responses out.

:class:`SdexecServer` holds what outlives a connection (the systemd client,
the configuration, the process table, counters, the drain state) and
handles each topic's requests; :mod:`sdexec.connection` is one client's
connection, which frames the requests and sends the responses.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from twisted.internet import defer
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

from sdexec.admission import ConnectionCount
from sdexec.background import NOT_FOUND, Tracked, TrackedProcesses, parse_target
from sdexec.closing import OpenConnections
from sdexec.config import Config
from sdexec.containment import Containment, Fences, judge_fences
from sdexec.devicefence import CanaryContext, CanaryResponder, DeviceCanary
from sdexec.drain import AdminCause, Cause, Drains, SelfLifting
from sdexec.fdlimit import no_room_for_a_process
from sdexec.hangup import HangupWatcher
from sdexec.idset import IDset
from sdexec.ioencode import decode_io
from sdexec.jobs import Jobs, terminate_keys
from sdexec.leftovers import (
    NAME_TAKEN,
    START_TIMED_OUT,
    STARTED_AGAIN,
    Leftover,
    Leftovers,
    LeftoversContext,
    marked,
)
from sdexec.limits import is_integer
from sdexec.lograte import LogRate
from sdexec.logs import named_in_log
from sdexec.lookup import InlineLookups, Lookups
from sdexec.managerversion import manager_named, version_problem
from sdexec.orphans import LostUnitKill
from sdexec.passthrough import (
    NO_STDIO,
    PassedStdio,
)
from sdexec.plan import (
    ExecPlan,
    LookedUp,
    NamedPath,
    RequestError,
    checked_request,
    manager_working_directory,
    plan_exec,
)
from sdexec.process import OutputTap, OutputValve, Process, ProcessContext, Responder
from sdexec.property import typed_property
from sdexec.protocol import (
    KILL_WHO,
    ended_and_kept,
    is_signal_number,
    signum_refused,
    target_named,
    terminate_not_found,
)
from sdexec.receipt import reads_unit_cgroups
from sdexec.refusal import MISSING, SHOWN, expected, json_quoted, quoted
from sdexec.shares import STATS_USERS, ProcessOwners, Share
from sdexec.signals import signal_name
from sdexec.systemd import Manager
from sdexec.systemd.errors import (
    NO_SUCH_PROCESS,
    SystemdError,
    failure_value,
    is_unit_gone,
)
from sdexec.systemd.window import SERVICE_LANE

if TYPE_CHECKING:
    from sdexec.metrics import Metrics

__all__ = ["AwaitingStart", "RequestError", "SdexecServer", "revoked"]

log = Logger()


#: The signals the units a shutdown cannot stop get, one per grace without
#: progress (their stop-timer signal, then SIGKILL), before it gives up;
#: with systemd away it gives up at once.
_STRAGGLER_STEPS = 2

#: What every stream still open at a shutdown is told, with ECANCELED
#: (docs/protocol.md): its process's, and an attach's to one that ended.
_STOPPING = "the service is stopping: the process's unit is being stopped"
#: The same with systemd away: the unit is stopped only if it comes back
#: within the stop's wait, else by the next start (leftovers).
_STOPPING_AWAY = (
    "the service is stopping with systemd unreachable: the process's unit is"
    " stopped if systemd comes back meanwhile, else by the service's next start"
)
#: The same under ``leftover-units = "keep"``, where the next start does not
#: stop it: a client told otherwise would take its job for ended.
_STOPPING_AWAY_KEPT = (
    "the service is stopping with systemd unreachable: the process's unit is"
    " stopped if systemd comes back meanwhile, else it runs on, kept by the"
    " service's next start (leftover-units = keep)"
)

#: A write's io with neither (docs/protocol.md, as Flux's iodecode()).
_NEITHER_DATA_NOR_EOF = (
    "io: expected data or eof (an io object with neither writes nothing)"
)


def _log_straggler_kill_failure(failure: Failure, unit: str, signum: int) -> None:
    if is_unit_gone(failure_value(failure)):
        return  # it went meanwhile
    log.warn(
        "shutdown: {signal} to {unit} failed: {error}",
        signal=signal_name(signum),
        unit=unit,
        error=failure.getErrorMessage(),
    )


def _may_run_unfollowed(process: Process) -> str | None:
    """How the log names the unit of a start refused that may run all the
    same, which only a look for it would find: ``None`` if none may.

    - A retry of a start whose answer was lost may take its name while the
      return's scan is still queued, which then passes over the first one
      as followed: refused as its name is taken, it would run on unfollowed.
    - A start systemd answered with a timeout of its own bus may have run:
      no reconnection, and so no scan, follows (the bus stalled, but
      stayed).
    """
    if process.name_taken:
        return NAME_TAKEN
    if process.start_timed_out:
        return START_TIMED_OUT
    return None


class SdexecServer:
    """The service's state and its request handlers (one per topic)."""

    def __init__(
        self,
        systemd: Manager,
        config: Config,
        reactor: Any,
        containment: Containment | None = None,
        clock: Any = None,
        lookups: Lookups | None = None,
        marks: tuple[str, ...] = (),
        hold_leftover_stops: bool = False,
    ) -> None:
        """``marks``: the service's owner marks (sdexec/leftovers.py): the
        first ends every unit's ``Description``, and units marked with any
        are its leftovers (none: no mark, no leftovers followed);
        ``hold_leftover_stops``: leftovers are adopted but not stopped
        until :meth:`Leftovers.release_stops` (the service's start)."""
        self.systemd = systemd
        systemd.on_reloading = self.manager_reloading
        systemd.lane_of = self.lane_of
        self.config = config
        self.reactor = reactor
        self.clock = clock or reactor
        #: Sees clients close connections that are not read meanwhile.
        self.hangups = HangupWatcher(reactor)
        self.containment = containment or Containment(config, None)
        #: How requests' commands are looked up: the service's in threads
        #: (sdexec/lookup.py), at once by default.
        self.lookups = lookups or InlineLookups()
        #: The service's own uid; :attr:`allowed_uids` adds ``allow-users``.
        self.owner_uid = os.getuid()
        self._init_processes()
        #: Appended to every unit's Description: how the service knows its
        #: own units after a restart (sdexec/leftovers.py).
        self.unit_mark = marks[0] if marks else ""
        #: Units of an earlier run, and this run's that nobody follows.
        self.leftovers = self._leftovers(marks, hold_leftover_stops)
        self._init_health()
        #: Metrics hook (sdexec/metrics.py): ``watch_exec(responder)`` wraps
        #: each exec stream's responder, ``watch_output(responder)`` an
        #: attach's or a wait's, ``error_sent(topic, errnum)`` sees errors.
        self.observer: Metrics | None = None
        #: The service's reload (``sdexec.reload``): fires with its answer
        #: (the file now in force, the settings that need a restart), or
        #: fails with why not. ``None``: a server with no
        #: service to reload (the topic is unknown, ENOSYS).
        self.reloader: Callable[[], defer.Deferred[dict]] | None = None
        self._next_connection_id = 0
        #: The processes that run jobs: time limits, termination, ``jobs``.
        self.jobs = Jobs(self.drain, self.count)
        #: Open connections per peer uid, against the configured caps.
        self.connections = ConnectionCount()
        #: The connections open, for the stop to close once written out.
        self.open_connections = OpenConnections()
        #: Lost units' kills whose SIGKILL is still to come (sdexec/orphans.py).
        self.lost_unit_kills: set[LostUnitKill] = set()
        #: Warnings a client can cause in a loop, at a bounded rate.
        self.log_rate = LogRate(log, self.clock)
        #: Whether a unit must outlive its receipt's GetAll: cgroup v2 (tests
        #: set it).
        self.receipt_reads_cgroup = reads_unit_cgroups()

    def _init_processes(self) -> None:
        """The tables its processes are found in (none yet), and what its
        shutdown, which ends them, waits for."""
        self._all_reaped: list[defer.Deferred[None]] = []
        #: Answers to the shutdown's own signals: not progress of the stop.
        self._straggler_answers = 0
        #: :meth:`shutdown` has begun: no more processes are started.
        self.stopping = False
        self.processes: dict[tuple[int, int], Process] = {}
        #: The same, by connection id then matchtag: a connection's
        #: back-pressure pauses and resumes its own processes, and it would
        #: otherwise walk the whole table each time (with 900 others running,
        #: one process's framed output ran at 0.78x).
        self._by_connection: dict[int, dict[int, Process]] = {}
        #: Processes whose ended stream's matchtag was used again, by the
        #: key they are tabled under since (:meth:`_retire_key`).
        self._retired_keys: dict[Process, tuple[int, int]] = {}
        #: The streams of tabled processes that are the client's own (stdio
        #: passthrough): we hold no descriptor for them, and count one each
        #: as if we did (sdexec/fdlimit.py).
        self._passed_streams = 0
        self._retired_serials = itertools.count(1)
        #: Background and waitable processes: by pid or label, ended ones kept.
        self.tracked = TrackedProcesses()
        #: Each unit name has one owner: the process that runs it.
        self.units: dict[str, Process] = {}
        #: The uid of each process a user of allow-users started: its share
        #: of the caps (sdexec/shares.py).
        self.process_owners = ProcessOwners()

    def _leftovers(self, marks: tuple[str, ...], hold_stops: bool) -> Leftovers | None:
        """What follows units that carry one of ``marks`` (an earlier run's,
        and this run's that nobody follows); none without marks."""
        if not marks:
            return None
        return Leftovers(
            self.systemd, self._leftovers_context(), marks, hold_stops=hold_stops
        )

    def _init_health(self) -> None:
        """Its statistics, and what judges whether it may take work: the
        causes that drain it, the device fence's canary."""
        self.counters: Counter[str] = Counter()
        #: Why the node is drained: each cause in force (sdexec/drain.py).
        self.drains = Drains()
        #: The manager version that refused a site's property (drained).
        self._refused_site_property_on: str | None = None
        #: The manager's version last said in the log (each reload and each
        #: return of systemd judge it again; a SIGHUP storm said it each time).
        self._version_said: str | None = None
        #: Is device policy enforced? Its canary says (sdexec/devicefence.py).
        self.device_canary = DeviceCanary(self._canary_context())

    def new_connection_id(self) -> int:
        """A number for a new connection, never given before (in logs, and
        the key of its processes)."""
        self._next_connection_id += 1
        return self._next_connection_id

    @property
    def rank(self) -> str:
        """This broker's rank (``[sdexec] rank``), as a string: the form output
        responses' ``io`` objects carry it in (live and retained alike)."""
        return str(self.config.sdexec.rank)

    @property
    def allowed_uids(self) -> frozenset[int]:
        """Whose requests are served: the service's own uid and
        ``[sdexec] allow-users`` (trusted: they run as the service does)."""
        return frozenset({self.owner_uid, *self.config.sdexec.allow_users})

    def reconfigure(self, config: Config, containment: Containment) -> None:
        """Use a new configuration from the next request on (running
        processes keep the plan they were started with; a user it takes
        out of ``allow-users`` has its waits and attaches ended now);
        leftovers follow a changed ``leftover-units``
        (:meth:`Leftovers.reconfigured`)."""
        allowed_before = self.allowed_uids
        self.config = config
        self.containment = containment
        self._revoke_users(allowed_before)
        self.lift(SelfLifting.SITE_PROPERTY)  # the next start judges the new one
        self.systemd.debug = config.systemd.sdbus_debug
        self.systemd.max_inflight = config.systemd.max_inflight
        if self.leftovers is not None:  # leftover-units may have changed
            self.leftovers.reconfigured()

    def _revoke_users(self, allowed_before: frozenset[int]) -> None:
        """End the waits and attaches that the connections of users this
        reload takes out of the configuration (``allowed_before`` it) hold
        (EPERM), and log those users: their requests are refused from now
        on (sdexec/connection.py), and an admin revoking one should know
        that what they started runs on. A wait or an attach left open would
        go on taking the output, and the end, of processes that are not
        theirs (review session 41 K-1). A user revoked by an earlier reload
        holds none, and is not said again at every reload after it."""
        allowed = self.allowed_uids
        revoked_now = allowed_before - allowed
        ended: Counter[int] = Counter()
        for connection_id, uid in self.connections.uids().items():
            if uid in revoked_now:
                ended[uid] += self.tracked.end_waits_and_attaches(
                    connection_id, errno.EPERM, revoked(uid)
                )
        withdrawn = self._withdraw_starts(revoked_now)
        open_by_uid = self.connections.open_by_uid()
        for uid in sorted(revoked_now & {*open_by_uid, *withdrawn}):
            log.warn(
                "uid {uid} is no longer in [sdexec] allow-users: each request"
                " on its {count} open connection(s) is refused from now on,"
                " and the {ended} wait(s) and attach(es) they held are ended;"
                " what they started runs on until it ends or is killed (the"
                " {withdrawn} exec(s) still queued for systemd are refused:"
                " never started)",
                uid=uid,
                count=open_by_uid.get(uid, 0),
                ended=ended[uid],
                withdrawn=withdrawn[uid],
            )

    def _withdraw_starts(self, uids: frozenset[int]) -> Counter[int]:
        """Refuse the execs of ``uids`` (a reload took them out of
        ``allow-users``) whose start still waits in the window of calls
        (``[systemd] max-inflight``): the user may no longer start
        anything, and these have not started; how many, per uid. A start
        already sent runs on, as what they started before does. Their
        signals held for the start of another's process are refused too,
        that other's uid revoked as well or not: the user may no longer
        signal it (those of its own go out: nothing is left running that it
        can no longer stop). A start an earlier reload withdrew goes ahead
        after all if this one puts its user back before its turn came."""
        withdrawn: Counter[int] = Counter()
        allowed = self.allowed_uids
        for process in list(self.units.values()):
            uid = self.process_owners.uid_of(process)
            if uid in allowed:
                process.keep_start()
            elif uid in uids and process.withdraw_start(_never_started(uid)):
                withdrawn[uid] += 1
            if uids:
                process.refuse_held_kills(uids - {uid}, _signal_not_sent)
        return withdrawn

    # -- exec --------------------------------------------------------------

    def look_up_command(
        self, payload: dict, streaming: bool, connection_id: int | None = None
    ) -> defer.Deferred[LookedUp]:
        """The first half of an ``sdexec.exec`` request (on
        ``connection_id``): the checks that need no file system (raising the
        refusal of a request they fail), then its command looked up by
        :attr:`lookups`, for :meth:`exec`."""
        share = self.share_of(connection_id)
        self._refuse_if_unavailable(share)
        request = checked_request(payload, streaming)
        where = manager_working_directory(self.config)
        uid = share.uid if share.per_user else None
        lookup = self.lookups.find(request.command, where, uid)
        return lookup.addCallback(lambda found: LookedUp(request, found))

    def exec(
        self,
        connection_id: int,
        matchtag: int,
        payload: dict,
        responder: Responder,
        streaming: bool = True,
        stdio: PassedStdio = NO_STDIO,
        valve: OutputValve | None = None,
        request_frame: int | None = None,
        looked_up: LookedUp | None = None,
        requested_at: float | None = None,
    ) -> defer.Deferred[None]:
        """Start a process for an ``sdexec.exec`` request (``streaming``
        false: in the background, sdexec/background.py), with the
        descriptors it brought (``stdio``; the caller closes them if this
        raises); its output held back by ``valve``, its connection's; the
        payload as :meth:`look_up_command` ``looked_up`` (else checked and
        looked up here); ``requested_at``: ``time.monotonic()`` when the
        request was handled (its start latency counts from there, its
        lookup included). Fires once systemd has answered its start."""
        share = self.share_of(connection_id)
        plan, tracked = self._checked_plan(
            payload,
            streaming,
            responder,
            connection_id,
            share,
            stdio,
            request_frame,
            looked_up,
        )
        key = (connection_id, matchtag) if streaming else self.tracked.new_key()
        self._check_unique(key, plan.unit_name)
        # Every check of the request is passed: the process is tabled next
        # (its job's admission may still refuse, before anything is).
        process = self._table(
            key,
            plan,
            tracked if tracked is not None else responder,
            tracked,
            stdio,
            share,
            requested_at,
            valve if streaming else None,
        )
        answered = self._start(key, process)
        if not streaming:
            process.write(b"", eof=True)  # a background process reads EOF
        return answered

    def _checked_plan(
        self,
        payload: dict,
        streaming: bool,
        responder: Responder,
        connection_id: int,
        share: Share,
        stdio: PassedStdio,
        request_frame: int | None,
        looked_up: LookedUp | None,
    ) -> tuple[ExecPlan, Tracked | None]:
        """The plan of an exec the service may take now, marked as its own,
        and its :class:`Tracked` if it runs in the background or is
        waitable; ``RequestError`` for the first check it fails. ``share``:
        the caps of the user of ``connection_id``."""
        self._refuse_if_unavailable(share)
        plan = self._own(
            plan_exec(
                payload,
                self.config,
                self.containment,
                request_frame,
                looked_up,
                streaming,
            )
        )
        if plan.mapped:
            self.count("mapper")  # the mapper ran, whatever is refused next
        self._check_label_free(plan.command.label)
        stdio.assign(plan.stdio)
        return self.tracked.prepare(
            plan,
            streaming,
            responder,
            connection_id,
            self.config.sdexec.retained_output,
            self.rank,
            self.config.sdexec,
            share,
        )

    def share_of(self, connection_id: int | None) -> Share:
        """Whose share of the caps a request on ``connection_id`` takes
        (sdexec/shares.py): its peer's, the owner's for a connection not
        counted (the service's own requests)."""
        uid = self.connections.uid_of(connection_id)
        return self._share(self.owner_uid if uid is None else uid)

    def lane_of(self, unit: str) -> Hashable:
        """The lane of the window of calls (sdexec/systemd/window.py) a call
        for ``unit`` waits in: the uid of the process's user (the owner's
        for the service's own), taking turns with the other users' lanes;
        the service's for a unit no process holds (a leftover)."""
        process = self.units.get(unit)
        if process is None:
            return SERVICE_LANE
        uid = self.process_owners.uid_of(process)
        return self.owner_uid if uid is None else uid

    def _share(self, uid: int) -> Share:
        """The caps that bound ``uid``'s processes."""
        return Share(uid, per_user=uid != self.owner_uid)

    def _table(
        self,
        key: tuple[int, int],
        plan: ExecPlan,
        responder: Responder,
        tracked: Tracked | None,
        stdio: PassedStdio,
        share: Share,
        requested_at: float | None,
        valve: OutputValve | None,
    ) -> Process:
        """The process of a checked plan, in every table: its responses
        observed for the metrics and by its job (admitted here), its output
        held back by ``valve``, its connection's, its user's ``share``."""
        if self.observer is not None:
            responder = self.observer.watch_exec(responder, requested_at)
        job = self.jobs.admit(
            plan.command,
            plan.unit_name,
            self.config.exec,
            systemd=self.systemd,
            clock=self.clock,
            resources=plan.resources,
            holder=self.holder,
        )
        if job is not None:
            responder = job.watch(responder)
        process = self._new_process(
            key,
            plan,
            responder,
            verify=self._fence_verifier(
                plan.unit_name, plan.fence, plan.fence_mems, plan.memory_capped
            ),
            tap=tracked.tap if tracked is not None else None,
            stdio=stdio,
        )
        if valve is not None:
            process.join_valve(valve)
        if tracked is not None:
            self.tracked.add(process, tracked)
        if share.per_user:
            self.process_owners.add(process, share.uid)
        self.units[plan.unit_name] = process
        self.jobs.add(job, process)
        return process

    def _refuse_if_unavailable(self, share: Share) -> None:
        """Refuse an exec of ``share``'s that the service cannot take now,
        before any work."""
        if self.stopping:
            # Its unit would outlive the shutdown, which stops only the
            # processes there when it began.
            raise RequestError(errno.EAGAIN, "the service is stopping")
        if self.drains:
            # EIO has Flux's job-exec drain the rank too (sdexec/drain.py).
            errnum = errno.EIO if self.drains.outlasts_waiting else errno.EBUSY
            how = self.drains.who_clears
            # Not every cause of hundreds: the errstr, cut at 4096, lost
            # the end that says how the drain goes.
            why = self.drains.reason_shown("more causes (sdexec stats)")
            raise RequestError(errnum, f"node is drained: {why} ({how})")
        if not self.systemd.connected:
            raise RequestError(errno.EAGAIN, "reconnecting to systemd")
        self._check_process_room(share)
        self._check_descriptor_room()

    def _check_process_room(self, share: Share) -> None:
        """EAGAIN at ``[sdexec] max-processes`` (``max-processes-per-user``
        for a user of allow-users): each process holds memory in the service
        (its command, partial lines, stdin held for it), outside the slice
        that caps the jobs."""
        held = self._processes_of(share)
        allows = share.at_cap(self.config.sdexec, "max-processes", held)
        if allows is not None:
            raise RequestError(
                errno.EAGAIN,
                f"too many processes{share.whose()}: {held} tabled, {allows}",
            )

    def _processes_of(self, share: Share) -> int:
        """The processes tabled that count against ``share``: the owner's
        are all but the other users' (the service's own among them)."""
        if share.per_user:
            return self.process_owners.count(share.uid)
        return len(self.processes) - self.process_owners.total

    def _check_descriptor_room(self) -> None:
        """EAGAIN while the open-file limit has no room for another process
        (sdexec/fdlimit.py)."""
        why = no_room_for_a_process(
            len(self.processes), self.connections.total, self._passed_streams
        )
        if why is not None:
            raise RequestError(errno.EAGAIN, why)

    def _check_unique(self, key: tuple[int, int], unit_name: str) -> None:
        """EEXIST for a key (connection, matchtag) or a unit already in use:
        refused before anything is made, so that a second watch or a failed
        start never touches the running unit's stream."""
        tabled = self.processes.get(key)
        if tabled is not None and tabled.stream_ended:
            self._retire_key(key)  # the request is over: its matchtag is free
        elif tabled is not None:
            raise RequestError(errno.EEXIST, f"matchtag {key[1]} is already in use")
        holder = self.units.get(unit_name)
        if holder is not None and holder.stream_ended:
            # Its request is over (an unkillable one abandoned, a failed
            # start whose unit outlived FAILED_UNIT_WAIT): not "running".
            raise RequestError(
                errno.EEXIST,
                f"unit {unit_name} is still held by this service: its request"
                " has ended, but the unit is not gone yet (retry once it is)",
            )
        leftover = (
            self.leftovers.units.get(unit_name) if self.leftovers is not None else None
        )
        if holder is not None or leftover is not None:
            raise RequestError(errno.EEXIST, _unit_name_held(unit_name, leftover))

    def _retire_key(self, key: tuple[int, int]) -> None:
        """Table the process of ``key``, whose stream has ended while its
        unit lingers, under a key no request can name (a negative
        matchtag, on the same connection: its leaving still stops it), so
        that the client may use the matchtag again, as RFC 6 lets it."""
        process = self.processes.pop(key)
        connection_id, matchtag = key
        retired = (connection_id, -next(self._retired_serials))
        self.processes[retired] = process
        of_connection = self._by_connection[connection_id]
        del of_connection[matchtag]
        of_connection[retired[1]] = process
        self._retired_keys[process] = retired

    def _start(self, key: tuple[int, int], process: Process) -> defer.Deferred[None]:
        """Start a tabled process; a start that fails untables it (never a
        phantom in the table). Fires once systemd has answered the start."""
        try:
            return process.start()
        except OSError as error:  # no fds left for its channels (EMFILE)
            self._untable(key)
            # strerror: str(error) is Python's "[Errno 24] Too many open files".
            raise RequestError(
                error.errno or errno.EIO,
                f"cannot start the process: {error.strerror or error}",
            ) from None
        except Exception:
            self._untable(key)
            raise

    def _check_label_free(self, label: str | None) -> None:
        """RFC 42: a label names one process (running, or ended and kept for
        a wait), so that kill, wait and attach by label agree on which."""
        if label is None:
            return
        holder = self.find(label=label)
        if holder is None and self.tracked.holds_label(label):
            holder = self.tracked.newest(None, label)
        if holder is not None:
            raise RequestError(
                errno.EEXIST,
                f"label {quoted(label, SHOWN)} is already in use by"
                f" {self.holder(holder)}",
            )

    def holder(self, process: Process) -> str:
        """How a refusal names ``process``, which holds a label or a job id
        the request asked for: its pid, whose it is, and whether it is an
        end kept for a wait (every user served may list every process, and
        an admin needs to know whose it is to free it)."""
        pid = (
            "a process not started yet" if process.pid is None else f"pid {process.pid}"
        )
        uid = self.tracked.uid_of(process)
        if uid is None:
            uid = self.process_owners.uid_of(process)
        if uid is None:  # a streaming process of the owner's
            uid = self.owner_uid
        whose = "the service's owner, uid" if uid == self.owner_uid else "uid"
        running = self.units.get(process.unit_name) is process
        ended = "" if running else ", ended and kept for a wait"
        return f"{pid} of {whose} {uid}{ended}"

    def _own(self, plan: ExecPlan) -> ExecPlan:
        """``plan`` with this service's mark: a restarted service finds the
        unit among its leftovers (sdexec/leftovers.py), the device canary's
        too (every unit remains after its process exits, until stopped)."""
        return marked(plan, self.unit_mark) if self.unit_mark else plan

    def _new_process(
        self,
        key: tuple[int, int],
        plan: ExecPlan,
        responder: Responder,
        *,
        verify: Callable[[str | None, int], str | None] | None = None,
        tap: OutputTap | None = None,
        stdio: PassedStdio = NO_STDIO,
        findable: bool = True,
    ) -> Process:
        """A :class:`Process` for ``plan``, in :attr:`processes` under ``key``
        until it is reaped; ``findable``: by its pid and label, for a
        client's kill, wait, attach (not the service's own)."""
        process = Process(
            self.systemd,
            plan,
            responder,
            self._process_context(findable),
            on_reaped=lambda process: self._reaped(
                self._retired_keys.pop(process, key)
            ),
            verify=verify,
            tap=tap,
            stdio=stdio,
        )
        self.processes[key] = process
        self._passed_streams += len(plan.stdio)
        if findable:
            self.tracked.findable(process)
        connection_id, matchtag = key
        self._by_connection.setdefault(connection_id, {})[matchtag] = process
        return process

    def _process_context(self, findable: bool) -> ProcessContext:
        return ProcessContext(
            reactor=self.reactor,
            clock=self.clock,
            rank=self.rank,
            count=self.count,
            debug=self._debugging,
            drain=self.drain,
            property_not_taken=self.property_not_taken,
            client_warning=self.log_rate.warn,
            log_rate=self.log_rate,
            start_timeout=self.config.systemd.start_timeout,
            receipt_wait=self.config.systemd.reconnect_timeout,
            receipt_reads_cgroup=self.receipt_reads_cgroup,
            end_lost_unit=self.end_what_lost_unit_left,
            pid_known=self.tracked.pid_known if findable else _unindexed,
            first_missing=self._first_missing,
        )

    def _first_missing(
        self, paths: list[NamedPath]
    ) -> defer.Deferred[NamedPath | None]:
        """A failed unit's sandbox paths looked at as commands are looked up
        (:attr:`lookups`, read at the failure)."""
        return self.lookups.first_missing(paths)

    def _debugging(self) -> bool:
        """``[systemd] sdexec-debug`` as configured now."""
        return self.config.systemd.sdexec_debug

    def _fence_verifier(
        self,
        unit: str,
        cpus: IDset | None,
        mems: IDset | None,
        memory_capped: bool,
    ) -> Callable[[str | None, int], str | None] | None:
        """The check run when ``unit`` starts (given its cgroup, if known,
        and its main process), if the mapper fenced CPUs or memory nodes (a
        custom mapper may set either alone): those, and a memory cap if the
        unit has one."""
        fences = Fences(cpus, mems, memory_capped)
        if not fences:
            return None
        return lambda cgroup, pid: self._verify_fence(fences, cgroup, pid, unit)

    def _verify_fence(
        self, fences: Fences, cgroup: str | None, pid: int, unit: str
    ) -> str | None:
        """Judge the fences (sdexec/containment.py): under ``drain`` the
        first that does not hold is the problem; under ``warn`` all that do
        not are logged, in one line."""
        verdict = judge_fences(
            fences,
            cgroup,
            pid,
            first_only=self.containment.check != "warn",
            bus=self.config.systemd.bus,
        )
        if verdict.unchecked is not None:
            self.log_rate.warn(
                "fence unchecked",
                "{unit}: pid {pid} exited before {what} could be checked",
                unit=unit,
                pid=pid,
                what=verdict.unchecked,
            )
        if not verdict.problems:
            return None
        return self._fence_broken(
            verdict.problems, "fence-failures", AdminCause.FENCE, f"{unit} (pid {pid})"
        )

    def _fence_broken(
        self,
        problems: Sequence[str],
        counter: str,
        cause: AdminCause,
        where: str | None = None,
    ) -> str | None:
        """Count a unit (``where``: its name and pid, if a job's) whose
        fences do not hold and apply ``containment-check``: drain (for
        ``cause``) and return the first problem, or (``warn``) log them, in
        one line, and return None."""
        self.counters[counter] += 1
        if self.containment.check == "warn":
            # At a bounded rate: on a node that cannot enforce a fence,
            # every job's line would be the same.
            self.log_rate.warn(
                f"{counter} under warn",
                "{where}{problems} (containment-check = warn: going on)",
                where=f"{where}: " if where else "",
                problems="; ".join(problems),
            )
            return None
        self.drain(problems[0], cause)
        return problems[0]

    def check_manager_version(self) -> None:
        """Say which systemd serves, and drain the node while it is too old
        for the units sdexec asks of it (sdexec/managerversion.py): every
        start would fail, naming a property rather than the version."""
        version = self.systemd.version
        if version is None:
            # Not read (a failed Get): what was judged of the manager stands.
            log.info("systemd manager: its Version could not be read")
            return
        if version != self._version_said:
            self._version_said = version
            log.info("systemd manager {version}", version=version)
        if version != self._refused_site_property_on:
            self.lift(SelfLifting.SITE_PROPERTY)  # it may take it: the next start says
        problem = version_problem(version, self.containment.enabled)
        if problem is not None:
            self.drain(problem, SelfLifting.VERSION)
        elif self.lift(SelfLifting.VERSION):
            self.device_canary.run_owed()  # not run while the manager was too old

    def manager_reloading(self) -> None:
        """The manager begins a ``daemon-reload``: a start it has queued
        may be dropped (sdexec.process.Process.manager_reloading)."""
        for process in list(self.processes.values()):
            process.manager_reloading()

    def systemd_restored(self) -> None:
        """systemd is back after a loss: every process re-reads its unit."""
        # Counted first: a canary the manager's version lets run now runs
        # after this return, and is judged.
        self.device_canary.systemd_back()
        self.check_manager_version()
        for process in list(self.processes.values()):
            process.resync()
        self.jobs.systemd_restored()
        if self.leftovers is not None:
            self.leftovers.systemd_restored().addErrback(self._log_scan_failure)
        self.device_canary.run_owed()

    @staticmethod
    def _log_scan_failure(failure: Failure) -> None:
        log.warn(
            "listing leftover units failed: {error}", error=failure.getErrorMessage()
        )

    def verify_devices(self) -> defer.Deferred[str | None]:
        """Run the device canary (sdexec/devicefence.py), with containment
        on: fires with the problem it finds, or None; never fails."""
        return self.device_canary.verify()

    def _leftovers_context(self) -> LeftoversContext:
        return LeftoversContext(
            config=lambda: self.config,
            clock=lambda: self.clock,
            count=self.count,
            drain=self.drain,
            lift=self.lift,
            unit_follower=self.unit_follower,
            end_what_lost_unit_left=self.end_what_lost_unit_left,
        )

    def _canary_context(self) -> CanaryContext:
        return CanaryContext(
            config=lambda: self.config,
            containment_enabled=lambda: self.containment.enabled,
            systemd_connected=lambda: self.systemd.connected,
            units_refused=self._units_refused,
            clock=lambda: self.clock,
            start_process=self._start_canary,
            abandon=self._abandon_own,
            fence_broken=self._fence_broken,
        )

    def _units_refused(self) -> str | None:
        """Why the manager refuses every unit now, or ``None``."""
        if self.drains.holds(SelfLifting.VERSION):
            return "the manager is too old to run its unit"
        if self.drains.holds(SelfLifting.SITE_PROPERTY):
            return "the manager does not take a property the site sets"
        return None

    def _start_canary(
        self, plan: ExecPlan, responder: CanaryResponder
    ) -> tuple[int, int]:
        """The device canary's process, started; its key. Nothing is left
        tabled when it cannot be (OSError: no fds left for its channels)."""
        plan = self._own(plan)
        # The service's own process: keyed as background ones are, by no
        # connection, so that no client's disconnect or key can touch it.
        key = self.tracked.new_key()
        try:
            # Not findable: a client's kill of it by pid drained the node.
            canary = self._new_process(key, plan, responder, findable=False)
            # Its unit carries the service's mark: a leftover scan while it
            # runs must know it for the service's own.
            self.units[plan.unit_name] = canary
            canary.start()
        except OSError:
            self._untable(key)
            raise
        return key

    def _abandon_own(self, key: tuple[int, int]) -> None:
        """Abandon the service's own process under ``key``, if still tabled."""
        process = self.processes.get(key)
        if process is not None:
            process.abandon()

    def count(self, event: str) -> None:
        """One more ``event`` in the statistics' counters."""
        self.counters[event] += 1

    def _reaped(self, key: tuple[int, int]) -> None:
        process = self.processes.get(key)
        self._untable(key)
        self.counters["reaped"] += 1
        if process is not None and process.started_again and self.leftovers is not None:
            # Its unit runs on, a new invocation with the mark: followed
            # (and stopped) as a leftover now, not at the next reconnection.
            scan = self.leftovers.scan({process.unit_name: STARTED_AGAIN})
            scan.addErrback(self._log_scan_failure)
        elif process is not None and self.leftovers is not None:
            origin = _may_run_unfollowed(process)
            if origin is not None:
                self.leftovers.look_for(process.unit_name, origin)
        self._answer_if_all_ended()

    def _answer_if_all_ended(self) -> None:
        """Answer the shutdown's waiters once nothing it waits for is left:
        no process, nor a leftover being stopped (cheap: called at each
        reap, of thousands in a burst)."""
        leftovers = self.leftovers.units if self.leftovers is not None else {}
        if self._all_reaped and not self.processes and not leftovers:
            waiting, self._all_reaped = self._all_reaped, []
            for waiter in waiting:
                waiter.callback(None)

    def _stragglers(self) -> list[tuple[str, int]]:
        """The unit and stop-timer signal of each process, and of each
        leftover a shutdown follows on (:meth:`Leftovers.close`)."""
        units = [(p.unit_name, p.stop_timer.signum) for p in self.processes.values()]
        if self.leftovers is not None:
            units += [
                (unit.name, unit.stop_timer.signum)
                for unit in self.leftovers.units.values()
            ]
        return units

    def _untable(self, key: tuple[int, int]) -> None:
        """Forget a process everywhere it is tabled."""
        process = self.processes.pop(key, None)
        connection_id, matchtag = key
        of_connection = self._by_connection.get(connection_id, {})
        of_connection.pop(matchtag, None)
        if not of_connection:
            self._by_connection.pop(connection_id, None)
        if process is not None:
            self.units.pop(process.unit_name, None)
            self.process_owners.remove(process)
            # An ended job kept for a wait is still listed as the job: its
            # id is what its user knows it by until the wait collects it.
            self.tracked.reaped(process, self.jobs.describe(process))
            self._passed_streams -= len(process.plan.stdio)
        self.jobs.forget(process)

    def shutdown(self, grace: float) -> defer.Deferred:
        """Abandon every process (their units are stopped) and wait until all
        of them are reaped, for as long as there is progress at least every
        ``grace`` seconds: one more reaped, or one more call answered by
        systemd. Stopping thousands of units takes longer than any fixed
        grace (and the first reaps wait for the receipts queued behind every
        stop in the call window), while a unit that never stops, or a
        manager that answers nothing, must not hold the exit. The first
        grace without progress sends each unit left its stop-timer signal
        (their SIGTERM did not end them: left running, they would keep the
        next run drained), the second SIGKILL, the third gives up (and a
        stall with systemd away, at once). Leftovers being stopped are
        waited for and escalated alike (one that ignored SIGTERM would be
        left deactivating); kept ones are no longer followed (the next run
        finds what is left)."""
        self.stopping = True
        self._finish_lost_unit_kills()
        self.device_canary.cancel_all()  # its process is abandoned below
        if self.leftovers is not None:
            self.leftovers.close(on_gone=self._answer_if_all_ended)
        stopping = self._stopping_said()
        for process in list(self.processes.values()):
            # Said to its client, rather than a connection that just closes.
            process.cancel(stopping)
        # And to an attach still sent what a process that ended wrote.
        self.tracked.cancel_feeds(errno.ECANCELED, stopping)
        if not self._stragglers():
            return defer.succeed(None)
        waiter: defer.Deferred = defer.Deferred()
        self._all_reaped.append(waiter)
        self._check_shutdown_progress(waiter, grace, self._shutdown_mark())
        # Also those begun meanwhile (a unit found lost once systemd is back).
        waiter.addBoth(self._finish_lost_unit_kills)
        return waiter.addBoth(self._forget_leftovers)

    def _stopping_said(self) -> str:
        """What the streams open at the stop are ended with: with systemd
        away their units outlive it, for the next start to stop or keep
        (``leftover-units``)."""
        if self.systemd.connected:
            return _STOPPING
        if self.config.sdexec.leftover_units == "keep":
            return _STOPPING_AWAY_KEPT
        return _STOPPING_AWAY

    def _forget_leftovers(self, result: object) -> object:
        """The shutdown ends: the leftovers still there are named, and
        followed no more (the next run finds them)."""
        if self.leftovers is not None:
            self.leftovers.forget_all()
        return result

    def end_what_lost_unit_left(
        self, unit: str, cgroup: str, signum: int, lost_by: object = None
    ) -> None:
        """Its manager lost ``unit`` (followed by ``lost_by``, a process or a
        leftover, if anyone), and what it ran may live on outside any unit
        in ``cgroup``: ``signum``, then SIGKILL (sdexec/orphans.py), unless
        a unit of that name runs there again by then, someone else's."""

        def in_use(name: str) -> bool:
            return self.unit_follower(name) not in (None, lost_by)

        LostUnitKill(
            unit,
            cgroup,
            signum,
            self.clock,
            self.drain,
            self.lost_unit_kills,
            in_use=in_use,
        ).start()

    def unit_follower(self, unit: str) -> object:
        """The process or the leftover of the service's that has that unit
        (``None``: nobody's)."""
        leftovers = self.leftovers
        follower = self.units.get(unit)
        if follower is None and leftovers is not None:
            return leftovers.units.get(unit)
        return follower

    def _finish_lost_unit_kills(self, result: object = None) -> object:
        """SIGKILL now what lost units left: the service stops, and their
        timers would never fire."""
        for kill in list(self.lost_unit_kills):
            kill.finish()
        return result

    def _shutdown_mark(self) -> tuple[int, int]:
        """What grows while a shutdown progresses (systemd's answers to the
        shutdown's own signals aside: they say nothing of the units)."""
        answered = self.systemd.calls_answered - self._straggler_answers
        gone = 0 if self.leftovers is None else self.leftovers.gone_count
        return self.counters["reaped"] + gone, answered

    def _check_shutdown_progress(
        self,
        waiter: defer.Deferred,
        grace: float,
        before: tuple[int, int],
        signalled: int = 0,
    ) -> None:
        timer = self.clock.callLater(
            grace, self._shutdown_progress, waiter, grace, before, signalled
        )
        waiter.addBoth(lambda result: timer.cancel() if timer.active() else None)

    def _shutdown_progress(
        self,
        waiter: defer.Deferred,
        grace: float,
        before: tuple[int, int],
        signalled: int,
    ) -> None:
        """``signalled``: how many of the stragglers' signals went out."""
        now = self._shutdown_mark()
        if now != before:
            self._check_shutdown_progress(waiter, grace, now, signalled)
            return
        names = named_in_log(
            log, [unit for unit, _ in self._stragglers()], "units left by the stop"
        )
        may_signal = self.systemd.connected and signalled < _STRAGGLER_STEPS
        # (None left to send, either, once every stop-timer signal was SIGKILL.)
        if may_signal and self._signal_stragglers(signalled == 0, grace, names):
            self._check_shutdown_progress(waiter, grace, now, signalled + 1)
            return
        # Away, nothing was answered because nothing could be asked: said,
        # lest an admin look for a wedged manager.
        away = "" if self.systemd.connected else " (systemd unreachable)"
        log.error(
            "units still not reaped, and no unit reaped nor call answered for"
            " {grace}s{away}: {names}: left running, for the service's next"
            " start to find as leftovers ([sdexec] leftover-units)",
            grace=grace,
            away=away,
            names=names,
        )
        self._all_reaped.remove(waiter)
        waiter.callback(None)

    def _signal_stragglers(self, first: bool, grace: float, names: str) -> bool:
        """To all the processes of every unit left: ``first``, its stop-timer
        signal (``sdexec-stop-timer-signal``, which a request may only
        repeat: the IMP's proxy for SIGKILL where a guest's processes are out
        of the manager's reach); then SIGKILL, to those whose stop-timer
        signal was another. Whether any was sent."""
        sends = [
            (unit, signum if first else signal.SIGKILL)
            for unit, signum in self._stragglers()
            if first or signum != signal.SIGKILL
        ]
        if not sends:
            return False
        log.warn(
            "units not stopped, nothing reaped nor answered for {grace}s:"
            " {which} to all their processes: {names}",
            grace=grace,
            which="their stop-timer signal" if first else "SIGKILL",
            names=names,
        )
        for unit, signum in sends:
            sent = self.systemd.kill_unit(unit, "all", signum)
            sent.addBoth(self._straggler_answered)
            sent.addErrback(_log_straggler_kill_failure, unit, signum)
        return True

    def _straggler_answered(self, result: Any) -> Any:
        self._straggler_answers += 1
        return result

    # -- write, kill, list, stats ------------------------------------------------

    def write(self, connection_id: int, payload: dict) -> Process | None:
        """Client data for a process's stdin; unknown targets are dropped.
        The process written to, if any."""
        matchtag = payload.get("matchtag", MISSING)
        if not isinstance(matchtag, int) or isinstance(matchtag, bool):
            raise RequestError(
                errno.EINVAL, expected("matchtag", "an integer", matchtag)
            )
        io: Any = payload.get("io", MISSING)  # an object, once decode_io took it
        try:
            stream, data, eof = decode_io(io)
        except ValueError as error:
            raise RequestError(errno.EINVAL, str(error)) from None
        if "data" not in io and "eof" not in io:
            # Flux's iodecode() refuses it: a write of nothing is a broken
            # client, which is better told than ignored. EINVAL as for any
            # missing field (docs/protocol.md: no Flux client is answered a
            # write, so none sees iodecode's EPROTO).
            raise RequestError(errno.EINVAL, _NEITHER_DATA_NOR_EOF)
        if stream != "stdin":
            raise RequestError(
                errno.EINVAL, f"io.stream: {json_quoted(stream, 40)} is not stdin"
            )
        process = self.processes.get((connection_id, matchtag))
        if process is None or process.stream_ended:
            return None  # (an ended request's is no one's)
        process.write(data, eof)
        return process

    def close_stdin(self, connection_id: int, matchtag: object) -> None:
        """EOF on the stdin of the connection's exec on ``matchtag`` (after
        what it was written before), if that names one whose stream runs: a
        write to it was refused (:meth:`write`, docs/protocol.md)."""
        if not is_integer(matchtag):
            return  # it names no process
        process = self.processes.get((connection_id, matchtag))
        if process is not None and not process.stream_ended:
            process.stdin.close()  # (a no-op for a stdin the client passed)

    def connection_processes(self, connection_id: int) -> Iterator[Process]:
        """The processes one connection started."""
        return iter(list(self._by_connection.get(connection_id, {}).values()))

    def find(self, pid: int | None = None, label: str | None = None) -> Process | None:
        """The process with ``label`` when one is given (its ``pid`` is then
        ignored, as RFC 42 says), else the newest with ``pid``, as wait and
        attach find it; none if that one has ended (kept for a wait)."""
        if pid is None and label is None:
            return None
        newest = self.tracked.newest(pid, label)
        if newest is None or self.units.get(newest.unit_name) is not newest:
            return None  # ended: no unit of the service's runs it now
        return newest

    def kill(
        self, payload: dict, uid: int | None = None
    ) -> defer.Deferred[dict] | AwaitingStart:
        """Signal a process by ``pid`` or ``label`` for a request of
        ``uid`` (``None``: the owner's): a Deferred, or an
        :class:`AwaitingStart` around one while the process has not started."""
        signum = payload.get("signum")
        if not is_signal_number(signum):
            raise RequestError(errno.EINVAL, signum_refused(signum))
        # RFC 42 signals "a remote process", and Flux's sdexec its unit's
        # main one: a job shell forwards signals to its tasks itself.
        who = payload.get("who", "main")
        if who not in KILL_WHO:
            raise RequestError(errno.EINVAL, expected("who", '"all" or "main"', who))
        pid, label = parse_target(payload, "kill")
        key, value = ("label", label) if label is not None else ("pid", pid)
        target = target_named(key, value)  # one line, whatever the label holds
        process: Process | Leftover | None = self.find(pid=pid, label=label)
        if process is None and self.leftovers is not None and label is None:
            process = self.leftovers.find(pid)  # leftovers have no labels
        if process is None:
            raise RequestError(errno.ESRCH, self._nothing_to_kill(target, pid, label))
        killed = (
            process.kill(signum, who, uid)
            if isinstance(process, Process)
            else process.kill(signum, who)
        )
        answer: defer.Deferred[dict] = killed.addCallbacks(
            lambda _: {}, _main_process_gone, errbackArgs=(target,)
        )
        if isinstance(process, Process) and process.signals_wait_for_start:
            return AwaitingStart(answer, process.signals_go_out())
        return answer

    def _nothing_to_kill(self, target: str, pid: int | None, label: str | None) -> str:
        """Why a kill of ``target`` signals nothing: ``ps`` still lists a
        process ended and kept for a wait, which "not found" denied."""
        if self.tracked.ended_and_kept(pid, label):
            return ended_and_kept("kill", target)
        said = f"kill {target} not found"
        return self._with_labels_lost(said, label) or said

    def list(self, detail: bool = True) -> dict:
        """``sdexec.list``: every process, its own and its leftovers; without
        ``detail``, each as upstream's servers list it (:data:`LIST_FIELDS`:
        flux-core's Python client builds a dataclass of exactly those keys,
        and failed on any other)."""
        procs = self._entries()
        if not detail:
            procs = [{key: proc[key] for key in LIST_FIELDS} for proc in procs]
        return {"rank": self.config.sdexec.rank, "procs": procs}

    @property
    def listed_count(self) -> int:
        """How many entries :meth:`list` has, without making them."""
        leftovers = len(self.leftovers.units) if self.leftovers is not None else 0
        return len(self.processes) + self.tracked.ended_count + leftovers

    def _entries(
        self, describe: Callable[[Process], dict] = Process.describe
    ) -> Sequence[dict]:
        """One entry per process, by ``describe`` (``list``'s or
        ``stats``'), with its mode and job."""
        return (
            [
                {
                    **describe(process),
                    "mode": self.tracked.mode(process),
                    **self.jobs.describe(process),
                }
                for process in self.processes.values()
            ]
            + self.tracked.describe_ended(describe)
            + (self.leftovers.describe() if self.leftovers is not None else [])
        )

    def wait(self, connection_id: int, payload: dict, responder: Responder) -> None:
        """``sdexec.wait``: answered once the process has ended."""
        with self._leftover_named(payload):
            self.tracked.wait(
                payload,
                connection_id,
                self._watched_output(responder),
                self.connections.uid_of(connection_id),
            )

    def attach(
        self,
        connection_id: int,
        payload: dict,
        responder: Responder,
        valve: OutputValve | None = None,
    ) -> None:
        """``sdexec.attach``: the process's stream goes to ``responder``,
        held back by ``valve``, its connection's."""
        if self.stopping:
            # The shutdown ended every attach (ECANCELED); one made now would
            # be fed until the exit cut it short, with no end.
            raise RequestError(
                errno.ECANCELED, "the service is stopping: no attach is made"
            )
        responder = self._watched_output(responder)
        with self._leftover_named(payload):
            self.tracked.attach(
                payload,
                connection_id,
                responder,
                valve,
                self.connections.uid_of(connection_id),
            )

    @contextmanager
    def _leftover_named(self, payload: dict) -> Iterator[None]:
        """A ``wait`` or ``attach`` that finds no process by a ``pid`` that
        is a leftover's main one (``sdexec ps`` lists it, state ``O``: an
        earlier run's background process, say) is told so, not only "no
        such process": nothing of its output or end is kept, and only a
        kill reaches it. One by a label, while an earlier run's leftovers
        run, is told that labels did not outlive that run."""
        try:
            yield
        except RequestError as error:
            if error.errnum not in (errno.ESRCH, errno.ENOENT):
                raise
            label = payload.get("label")
            pid = payload.get("pid") if label is None else None
            leftovers = self.leftovers if isinstance(pid, int) else None
            leftover = leftovers.find(pid) if leftovers is not None else None
            if leftover is not None:
                raise RequestError(
                    error.errnum,
                    f"{error.errstr}: it is the main process of leftover unit"
                    f" {leftover.name} (state O), which no request of this run"
                    " follows: its output and end are not kept; only a kill"
                    " reaches it",
                ) from None
            if error.errstr.endswith(NOT_FOUND):
                lost = self._with_labels_lost(error.errstr, label)
                if lost is not None:
                    raise RequestError(error.errnum, lost) from None
            raise

    def _with_labels_lost(self, said: str, label: object) -> str | None:
        """``said``, the "not found" of a request (kill, wait, attach,
        terminate) by ``label`` (``None``: not by a label), and, while
        leftovers of an earlier run are listed, that the process it started
        may be one of them, running on, its label gone with the run (only
        its memory held it). ``None``: nothing to add."""
        if label is None or self.leftovers is None:
            return None
        count = self.leftovers.of_earlier_runs()
        if not count:
            return None
        units, are = ("unit", "is") if count == 1 else ("units", "are")
        return (
            f"{said}; labels do not outlive a run of the service: {count}"
            f" leftover {units} of an earlier run (state O in sdexec ps) {are}"
            " reached only by a kill of a pid"
        )

    def _watched_output(self, responder: Responder) -> Responder:
        """``responder``, its output counted by the metrics (an attach's
        replay and live output, a wait's answer) as an exec stream's is."""
        if self.observer is None:
            return responder
        return self.observer.watch_output(responder)

    def stats(self, detail: bool = True) -> dict:
        """What ``sdexec.stats-get`` and ``GET /stats`` report. Without
        ``detail`` (``GET /stats`` unless ``[sdexec] stats-detail``), leave
        out what may be secret: command lines (``--password=…``), labels and
        the configuration file's path."""
        procs = self._entries(Process.stats)
        source = {"source": self.config.source}
        if not detail:
            procs = [_without(proc, _DETAIL_FIELDS) for proc in procs]
            source = {}
        return {
            "requests": dict(self.counters),
            "procs": procs,
            "job-exec": {**self.config.introspect(), "jobs": self.jobs.stats()},
            "config": {
                **source,
                **self.config.effective(),
            },
            "mapper": self.containment.stats(self.counters["mapper"]),
            "users": self._users_stats(),
            "drain": {
                "drained": self.drain_reason is not None,
                "reason": self.drain_reason,
                "causes": self.drains.causes,
            },
            "device-fence": self.device_canary.verdict,
            "systemd": {
                "connected": self.systemd.connected,
                "version": self.systemd.version,
                "calls": self.systemd.calls_waiting(),
            },
        }

    def _users_stats(self) -> dict:
        """What each user holds of its share of the caps: the owner's, then
        the other users' that hold the most processes (at most
        ``STATS_USERS`` in all: allow-users may be long)."""
        held = Counter(self.process_owners.counts())
        connections = self.connections.open_by_uid()
        for uid in [*self.tracked.uids(), *connections]:
            held[uid] += 0  # holds ended waitable processes, or connections, only
        held.pop(self.owner_uid, None)
        shown = [uid for uid, _ in held.most_common(STATS_USERS - 1)]
        users = {
            str(uid): {
                "processes": self._processes_of(self._share(uid)),
                "background": self.tracked.background_held(uid),
                "waitable": self.tracked.waitable_held(uid),
                # Whose calls wait in the window (whose burst holds whom).
                "calls-queued": self.systemd.calls_queued_in(uid),
                # Who holds max-connections(-per-user): the reserve apart.
                "connections": connections.get(uid, 0),
            }
            for uid in [self.owner_uid, *shown]
        }
        return {
            "owner": self.owner_uid,
            "users": users,
            "not-shown": len(held) - len(shown),
        }

    def terminate(self, payload: dict) -> dict:
        """``sdexec.terminate``: begin a job's termination sequence."""
        try:
            return self.jobs.terminate(payload, self.find, self.tracked.kept)
        except RequestError as error:
            said = self._leftovers_said(payload, error)
            if said is None:
                raise
            raise RequestError(error.errnum, said) from None

    def _leftovers_said(self, payload: dict, error: RequestError) -> str | None:
        """What a ``terminate`` that found nothing is told instead of "not
        found", which denied what ``sdexec ps`` lists: a pid or a job id
        that is a leftover's (a kill by pid reaches it; ``sdexec cancel``
        says so itself) names it; a label, while an earlier run's leftovers
        run, is told that labels did not outlive that run, as ``kill``'s
        is. ``None``: nothing to add."""
        key = next(iter(terminate_keys(payload)), None)
        if (
            self.leftovers is None
            or key is None
            or (error.errnum, error.errstr)
            != (errno.ESRCH, terminate_not_found(key, payload[key]))
        ):
            return None
        value = payload[key]
        if key == "label":
            return self._with_labels_lost(error.errstr, value)
        find = self.leftovers.find if key == "pid" else self.leftovers.find_job
        leftover = find(value)
        return None if leftover is None else _leftover_runs_no_job(key, value, leftover)

    @property
    def drain_reason(self) -> str | None:
        """Why the node is drained (every cause in force), or ``None``."""
        return self.drains.reason

    def drain(self, reason: str, cause: Cause) -> None:
        """Refuse new work, for ``reason`` (logged once while it stands);
        ``cause``: what drained it, a :class:`SelfLifting` one lifts itself
        (:meth:`lift`), an :class:`AdminCause` only an admin's undrain
        clears (sdexec/drain.py)."""
        change = self.drains.add(reason, cause)
        if change == "new":
            # At a bounded rate for each kind: hundreds of units abandoned
            # at once are each a cause (the reason in force names them all).
            self.log_rate.emit(
                LogLevel.error,
                f"drain {cause.value}",
                "draining: {reason}",
                reason=reason,
            )
        elif change == "restated":  # a cause in force, said afresh
            # At a bounded rate: a leftover count is said afresh as each
            # of hundreds goes.
            self.log_rate.emit(
                LogLevel.info,
                f"drain restated {cause.value}",
                "still drained: {reason}",
                reason=reason,
            )

    def stop_log_rates(self) -> None:
        """The service stops: what its bounded logs held back is said now,
        and nothing is held back from now on (no timer would fire)."""
        self.log_rate.stop()
        if self.leftovers is not None:
            self.leftovers.log_rate.stop()

    def property_not_taken(self, name: str) -> None:
        """A start failed for property ``name`` (its D-Bus name), which the
        manager does not take. If the site sets it in the configuration in
        force (a request may have set it too, or a start planned before a
        reload be answered after it), every start would fail: the node
        drains until a reload or a manager of another version, whose next
        start judges it afresh."""
        key = self._site_property_keys().get(name)
        if key is None:
            return
        self._refused_site_property_on = version = self.systemd.version
        manager = manager_named(version, "the manager")
        sent = f" (sent as {name})" if name != key else ""
        self.drain(
            f"exec.sdexec-properties sets {key}{sent}, which {manager} does not"
            " take: every job would fail (remove it and reload, or upgrade"
            " systemd)",
            SelfLifting.SITE_PROPERTY,
        )

    def _site_property_keys(self) -> dict[str, str]:
        """The site's properties' keys, by the D-Bus names they are sent
        as (``MemoryZSwapMax = "10%"`` goes as ``MemoryZSwapMaxScale``)."""
        return {
            typed_property(key, value, source="config").name: key
            for key, value in self.config.exec.sdexec_properties.items()
        }

    def lift(self, kind: SelfLifting) -> bool:
        """A self-lifting cause is over: its drain goes, and no other;
        whether it was in force."""
        reason = self.drains.lift(kind)
        if reason is not None and not self.drains:
            log.info("drain lifted (was: {reason})", reason=reason)
        elif reason is not None:
            # Not "drain lifted": the node refuses work still. Each cause
            # in force is in the stats (drain.causes).
            log.info(
                "drain cause over: {reason}; still drained: {still}",
                reason=reason,
                still=self.drains.reason_shown("more causes (sdexec stats)"),
            )
        return reason is not None

    def undrain(self) -> dict:
        """An admin's undrain: ``{"reason": what it cleared, "cleared": its
        causes}``, and ``"still"``, ``"remaining"``: the causes that lift
        themselves, in force until then (joined, and each)."""
        cleared = self.drains.clear_admins()
        previous = "; ".join(cleared) or None
        if previous is not None:
            was = named_in_log(log, cleared, "undrained causes", sep="; ")
            log.info("undrained (was: {reason})", reason=was)
        reply: dict[str, Any] = {"reason": previous, "cleared": cleared}
        if self.drains:
            reply["still"] = self.drain_reason
            reply["remaining"] = [cause["reason"] for cause in self.drains.causes]
        return reply


def revoked(uid: int) -> str:
    """Why a request (or a wait, an attach) of ``uid`` is refused (or
    ended) once a reload has taken it out of ``allow-users``."""
    return f"uid {uid} is no longer in [sdexec] allow-users (a reload took it out)"


def _never_started(uid: int) -> str:
    """Why an exec of ``uid`` still queued for systemd at the reload that
    took ``uid`` out of ``allow-users`` is refused."""
    return f"{revoked(uid)}: its exec was still queued for systemd, and never started"


def _signal_not_sent(uid: int, signum: int) -> str:
    """Why a kill of ``uid``, held for the start of a process not its own,
    is refused at the reload that took ``uid`` out of ``allow-users``."""
    return (
        f"{revoked(uid)}: its signal {signum}, held until the process"
        " started, is not sent"
    )


def _unit_name_held(unit_name: str, leftover: Leftover | None) -> str:
    """Why an exec may not have ``unit_name``: a process of this run runs
    it, or ``leftover`` (whose name is free only once it is gone: a
    client that knew it by a label or a job id needs to be told what
    holds it now, and that only a kill by pid reaches it)."""
    held = f"unit {unit_name} is already run by this service"
    if leftover is None:
        return held
    return (
        f"{held}: it is {leftover.what()}; retry once it is gone (a kill by"
        " its pid ends it)"
    )


def _leftover_runs_no_job(key: str, value: object, leftover: Leftover) -> str:
    """Why a ``terminate`` of ``key=value`` (a ``pid`` or a ``jobid``)
    reaches no job in ``leftover``: its time limit and termination
    sequence were the gone run's."""
    return (
        f"terminate {target_named(key, value)}: its unit {leftover.name} is"
        f" {leftover.what()}: it runs no job of this run (its time limit and"
        " termination sequence went with the run that started it); sdexec kill"
        " of its pid signals it"
    )


def _unindexed(_process: Process) -> None:
    """``pid_known`` of a process no client may find (the device canary)."""


def _main_process_gone(failure: Failure, target: str) -> Failure:
    """A kill (of ``target``, ``pid=N``) of a main process that has exited
    while others of its unit linger: ESRCH that says so, and how to reach
    the rest (systemd says only "No main process to kill"). Or of a process
    whose unit systemd unloaded before the service reaped it (it ended):
    refused as one that has exited, counted as such, and said so (systemd
    says only "Unit NAME not loaded.", naming no process)."""
    error = failure_value(failure)
    if is_unit_gone(error):
        raise RequestError(errno.ESRCH, f"kill {target}: it has ended ({error})")
    if not isinstance(error, SystemdError) or error.name != NO_SUCH_PROCESS:
        return failure
    raise RequestError(
        errno.ESRCH,
        f'kill {target}: its main process has exited; "who": "all" (sdexec kill'
        " --all) signals the processes its unit still has",
    )


#: What ``stats(detail=False)`` leaves out of each process.
_DETAIL_FIELDS = frozenset({"cmd", "cmdline", "label"})

#: What upstream's subprocess servers give for each process of a ``list``.
LIST_FIELDS = ("pid", "cmd", "label", "state")


def _without(mapping: dict, keys: frozenset[str]) -> dict:
    return {key: value for key, value in mapping.items() if key not in keys}


class AwaitingStart(NamedTuple):
    """An answer that waits for a process to start before it waits for systemd: it
    places no call meanwhile (a process holds at most ``MAX_EARLY_KILLS``
    such signals), so it counts against
    :data:`~sdexec.connection.MAX_UNANSWERED` only once its call is
    ``sent``. Counted from the request, 64 kills of processes slow to start
    stopped the reading of their connection for as long as
    ``start-timeout``: on a connection that carries every job of a node,
    the kill of a running job too. Never counted, each starting process let
    64 more calls into the window."""

    answer: defer.Deferred
    sent: defer.Deferred
