"""Jobs: exec requests that say they run a job, and what the service does
for them beyond running a process — their time limit, their termination
(``sdexec.terminate``, JOB TERMINATION of flux-config-exec(5)) and their
entry in the ``jobs`` object of ``stats``.

A request is a job when it sets ``SDEXEC_JOBID`` (the job's id, as the
client names it) or ``SDEXEC_TIME_LIMIT``; without an id, a job is named by
its unit. Its time limit comes from R (``SDEXEC_R_LOCAL``:
``execution.expiration``, extended by the start delay, see
:mod:`sdexec.joblimit`) and/or ``SDEXEC_TIME_LIMIT``. At the limit the job
is terminated with reason ``timeout``.

The deciding is :mod:`sdexec.termination`'s; a :class:`Job` is its
:class:`~sdexec.termination.TerminationTarget` and learns about its process
by watching the process's responses (``started``, ``finished``, the end of
the stream), so :class:`~sdexec.process.Process` needs to know nothing of
jobs beyond :meth:`~sdexec.process.Process.unkillable`.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sdexec.clocks import wall_seconds
from sdexec.command import Command
from sdexec.config import ExecConfig
from sdexec.containment import request_resources
from sdexec.drain import AdminCause, Cause
from sdexec.joblimit import TIME_LIMIT_OPTION, TimeLimit, job_expiration
from sdexec.limits import check_text
from sdexec.plan import RequestError
from sdexec.protocol import (
    ended_and_kept,
    target_named,
    terminate_not_found,
    terminate_runs_no_job,
)
from sdexec.refusal import expected
from sdexec.rset import ResourceSet
from sdexec.signals import signal_name
from sdexec.systemd import Manager
from sdexec.systemd.errors import failure_value, is_connection_lost
from sdexec.termination import (
    TerminationPolicy,
    TerminationReason,
    TerminationSequence,
    TerminationStep,
    parse_reason,
)

if TYPE_CHECKING:
    from sdexec.process import Process, Responder

__all__ = ["JOBID_OPTION", "Job", "Jobs", "terminate_keys"]

log = Logger()

#: The exec option that names the job a request runs.
JOBID_OPTION = "SDEXEC_JOBID"


class Job:
    """One running job: its process, its time limit, its termination.

    Built before its process (it wraps the process's responder, see
    :meth:`watch`), then :meth:`attach`-ed to it.
    """

    def __init__(
        self,
        jobid: str,
        *,
        received_at: float,
        expiration: float | None,
        policy: TerminationPolicy,
        clock: IReactorTime,
        systemd: Manager,
        drain: Callable[[str, Cause], None],
        count: Callable[[str], None],
    ) -> None:
        self.jobid = jobid
        self.received_at = received_at
        self.expiration = expiration
        self.process: Process | None = None
        self.termination = TerminationSequence(clock, policy, self, jobid)
        self._clock = clock
        self._systemd = systemd
        self._drain = drain
        self._count = count
        self._time_limit: TimeLimit | None = None
        self._started = False
        #: The main process exited, or the stream ended (not as unkillable).
        self._over = False
        #: A terminate that came before the process started.
        self._pending: TerminationReason | None = None
        #: The sequence ran out while systemd was away (its kill-signals
        #: may all have been lost): judged once it is back.
        self._held_verdict: str | None = None
        #: The node was drained for it: the verdict given, not held.
        self._verdict_given = False
        self._verdict_timer: IDelayedCall | None = None
        #: The reason of the verdict that timer gives, and whether a return
        #: of systemd has put it off already.
        self._pending_verdict: str | None = None
        self._verdict_rearmed = False
        #: Step 1's signal (term-signal, SIGALRM) failed for lack of
        #: systemd: no later step repeats it, so it is sent again once
        #: systemd is back; once per job, so that a systemd leaving and
        #: returning does not put the sequence off for ever.
        self._first_lost = False
        self._first_resent_at: float | None = None
        #: A held verdict waiting for the re-sent step 1's interval.
        self._graceful_timer: IDelayedCall | None = None

    # -- the process's life, as its responses tell it ------------------------

    def watch(self, responder: Responder) -> Responder:
        """The responder the job's process is given: ``responder``, with
        the job told of ``started``, ``finished`` and the stream's end."""
        return _JobResponder(self, responder)

    def attach(self, process: Process) -> None:
        """The job's process, once made: what its time limit and
        termination signal."""
        self.process = process

    def started(self) -> None:
        """The job's process runs: its time limit is armed (at the absolute
        expiration admitted with the request; at once if that has passed),
        and a terminate that came early begins."""
        self._started = True
        if self.expiration is not None:
            self._time_limit = TimeLimit(self._clock, self.expiration, self._timeout)
        if self._pending is not None:
            self.termination.begin(self._pending)

    def over(self) -> None:
        """The main process exited (or the stream ended without it): no
        time limit and no termination step applies any more."""
        self._over = True
        self.termination.job_exited()
        self.cancel()

    def cancel(self) -> None:
        """Stop every timer of the job (it is forgotten, or has ended), and
        drop a verdict held for systemd: nothing is left to judge."""
        self._held_verdict = None
        if self._time_limit is not None:
            self._time_limit.cancel()
        self._first_lost = False
        for timer in (self._verdict_timer, self._graceful_timer):
            if timer is not None and timer.active():
                timer.cancel()
        if self.termination.active:
            self.termination.job_exited()

    # -- termination -----------------------------------------------------------

    def _ended(self) -> bool:
        """Whether the main process exited; also when its ``finished``
        never reached the job (the client left, and the stream with it):
        then the job ends here. What the unit still holds is the stop
        timer's business, not a job's to be declared unkillable."""
        process = self.process
        if not self._over and process is not None and process.exit_status is not None:
            self.over()
        return self._over

    def in_use(
        self, option: str, holder: Callable[[Process], str] | None = None
    ) -> str:
        """Why a new job may not take this one's id yet: it runs, or it has
        exited and what its unit still holds is being stopped; its process
        named by ``holder``, if given."""
        if self._ended():
            return (
                f"{option}: job {self.jobid} has exited, and its unit is still"
                " being stopped: its id is free once the unit is gone"
            )
        process = self.process
        named = "" if holder is None or process is None else f" ({holder(process)})"
        return f"{option}: job {self.jobid} is running{named}"

    def terminate(self, reason: TerminationReason) -> dict[str, Any]:
        """Begin termination (once: a later request does not restart it,
        but sends step 1's signal again, ``TerminationSequence.again``);
        the job's termination state."""
        if self._ended():
            raise RequestError(errno.ESRCH, f"job {self.jobid} has already exited")
        if not self._started:
            self._pending = self._pending or reason
        elif not self.termination.begin(reason):
            self.termination.again(reason)
        return self.describe()

    def _timeout(self) -> None:
        if self._ended():
            return
        if self.termination.begin(TerminationReason.TIMEOUT):
            log.info("job {job}: time limit reached", job=self.jobid)
            self._count("job-timeouts")
        elif self.termination.again(TerminationReason.TIMEOUT):
            # A cancel is terminating it already: not a timeout, but the
            # job hears SIGALRM all the same, as upstream's timelimit_cb
            # sends it whatever is in progress.
            log.info("job {job}: time limit reached while cancelled", job=self.jobid)

    # TerminationTarget: open loop, a failure is logged.

    def signal_tasks(self, signum: int) -> None:
        """``signum`` to every process of the job's unit."""
        if not self._ended():
            self._kill("all", signum, graceful=self._is_graceful(signum))

    def _is_graceful(self, signum: int) -> bool:
        """Whether ``signum`` is step 1's: one no later step repeats."""
        reason = self.termination.reason
        policy = self.termination.policy
        return (
            reason is not None
            and signum == policy.first_signal(reason)
            and signum != policy.kill_signal
        )

    def signal_main(self, signum: int) -> None:
        """``signum`` to the job shell: the unit's main process."""
        if not self._ended():
            self._kill("main", signum)

    def unkillable(self, reason: str) -> None:
        """The main process outlived the sequence (it has not exited, so the
        unit has processes): drain, and fail the request with EDEADLK."""
        if self._ended():
            return
        if not self._knows_its_unit():
            log.warn(
                "job {job}: its termination ran out while systemd is away (or"
                " before its unit was read again): judged once it is",
                job=self.jobid,
            )
            self._held_verdict = reason
            if self._systemd.connected:  # back: after this unit's read
                self._after_reread()
            return
        self._verdict_given = True
        self._count("jobs-unkillable")
        # The drain reason stays upstream's words (job-exec's own drain, and
        # what `sdexec undrain` gives back); the request's error says too
        # what began the termination and what it tried: no `finished`
        # (its `terminated`) will come to say it.
        self._drain(reason, AdminCause.UNKILLABLE)
        if self.process is not None:
            self.process.unkillable(
                f"{reason}: {self.termination.account()}; the node is drained"
            )

    def _knows_its_unit(self) -> bool:
        process = self.process
        if process is None:
            return self._systemd.connected
        return process.knows_its_unit

    def systemd_lost(self) -> None:
        """systemd went away: a verdict due after a kill-signal that may be
        lost with it is held for its return, once (a systemd that keeps
        leaving and coming back faster than kill-timeout would put the
        verdict off for ever)."""
        timer = self._verdict_timer
        if timer is not None and timer.active() and not self._verdict_rearmed:
            self._verdict_rearmed = True
            timer.cancel()
            self._held_verdict = self._pending_verdict

    def systemd_restored(self) -> None:
        """systemd is back: a verdict held for it comes after one more
        kill-signal to the job shell and kill-timeout, counted from when
        its unit has been read again, unless the job has exited by then.
        Step 1's signal, if it was lost, goes first, at once (a signal needs
        no re-read, and no later step may come before it)."""
        if self._first_lost:
            self._resend_first()
        if self._held_verdict is not None:
            self._after_reread()

    def _resend_first(self) -> None:
        self._first_lost = False
        if self._first_resent_at is not None or self._verdict_given or self._ended():
            return
        self._first_resent_at = self._clock.seconds()
        log.info(
            "job {job}: systemd is back: step 1's signal, lost while it was"
            " away, sent again",
            job=self.jobid,
        )
        self.termination.resend_first()

    def _graceful_wait(self) -> float:
        """How long a re-sent step 1's signal still has to work before the
        job shell's kill-signal may follow it."""
        if self._first_resent_at is None:
            return 0.0
        due = self._first_resent_at + self.termination.policy.kill_timeout
        return max(0.0, due - self._clock.seconds())

    def _after_reread(self) -> None:
        if self.process is None:
            self._give_held_verdict()
        else:
            self.process.when_reread().addCallback(lambda _: self._give_held_verdict())

    def _give_held_verdict(self) -> None:
        if not self._knows_its_unit():
            # systemd left again before the unit's read came (which then
            # fired its waiters all the same): its kill-signal would go
            # nowhere; the next return takes the verdict up again.
            return
        if self._held_verdict is None or self._ended():
            return
        wait = self._graceful_wait()
        if wait > 0:
            if self._graceful_timer is not None and self._graceful_timer.active():
                self._graceful_timer.cancel()
            self._graceful_timer = self._clock.callLater(wait, self._give_held_verdict)
            return
        reason, self._held_verdict = self._held_verdict, None
        policy = self.termination.policy
        self.termination.signal_shell_again()
        self._pending_verdict = reason
        self._verdict_timer = self._clock.callLater(
            policy.kill_timeout, self.unkillable, reason
        )

    def _kill(self, who: str, signum: int, *, graceful: bool = False) -> None:
        if self.process is None:
            return
        unit = self.process.unit_name
        self._systemd.kill_unit(unit, who, signum).addErrback(
            self._kill_failed, who, signum, graceful
        )

    def _kill_failed(
        self, failure: Failure, who: str, signum: int, graceful: bool
    ) -> None:
        log.warn(
            "job {job}: KillUnit({who}, {signal}) failed: {error}",
            job=self.jobid,
            who=who,
            signal=signal_name(signum),
            error=failure.getErrorMessage(),
        )
        if graceful and is_connection_lost(failure_value(failure)):
            self._first_lost = True
            if self._systemd.connected:  # its failure came after the return
                self._resend_first()

    def finished_receipt(self, finished: dict[str, Any]) -> dict[str, Any]:
        """``finished``, with ``terminated`` (the reason: ``timeout`` or
        ``cancel``) where the job's termination had begun: its exit status
        alone (0 for a job that traps SIGALRM and exits, 137 for one that
        ignored it) cannot tell its time limit from any other end, where
        Flux raises a ``timeout`` exception ("resource allocation
        expired")."""
        reason = self.termination.reason
        if reason is None:
            return finished
        return {**finished, "terminated": reason.value}

    # -- what stats and ps show -------------------------------------------------

    @property
    def step(self) -> str | None:
        """The termination step, ``None`` unless terminating."""
        step = self.termination.step
        if step is None and self._pending is not None:
            return "pending"
        if step is TerminationStep.UNKILLABLE and not self._verdict_given:
            # Held for systemd: the job shell gets kill-signal once more.
            step = TerminationStep.EXITED if self._over else TerminationStep.KILL_SHELL
        return None if step in (None, TerminationStep.EXITED) else step.value

    def describe(self) -> dict[str, Any]:
        """The job's entry in ``jobs`` (and the ``terminate`` reply)."""
        process = self.process
        return {
            "id": self.jobid,
            "pid": -1 if process is None or process.pid is None else process.pid,
            "unit": None if process is None else process.unit_name,
            "state": None if process is None else process.state,
            "step": self.step,
            "kill-attempts": self.termination.kill_attempts,
            "time-limit": (
                None if self.expiration is None else self.expiration - self.received_at
            ),
            "expiration": self.expiration,
            "termination": self.termination.stats(),
            "stop-timer": None if process is None else process.stop_timer.stats(),
        }


class _JobResponder:
    """A job process's responder: passes everything on, and tells the job."""

    def __init__(self, job: Job, responder: Responder) -> None:
        self._job = job
        self._responder = responder

    def respond(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        if kind == "started":
            self._job.started()
        elif kind == "finished":
            payload = self._job.finished_receipt(payload)
            self._job.over()
        self._responder.respond(payload)

    def error(self, errnum: int, errstr: str) -> None:
        if errnum != errno.EDEADLK:
            # Not its own verdict (or the stop timer's): the main process
            # has not exited, and the job goes on being one, for terminate
            # and ps, until it does.
            self._job.over()
        self._responder.error(errnum, errstr)


class Jobs:
    """The service's running jobs, by id."""

    def __init__(
        self, drain: Callable[[str, Cause], None], count: Callable[[str], None]
    ) -> None:
        self._drain = drain
        self._count = count
        self.jobs: dict[str, Job] = {}
        self._by_process: dict[Process, Job] = {}

    def admit(
        self,
        command: Command,
        unit: str,
        config: ExecConfig,
        *,
        systemd: Manager,
        clock: IReactorTime,
        resources: ResourceSet | None = None,
        holder: Callable[[Process], str] | None = None,
    ) -> Job | None:
        """The job an exec request runs, ``None`` if it runs none;
        :class:`RequestError` (EINVAL) naming a bad option or R field, or
        EEXIST for a job id already running here (naming its process as
        ``holder`` does). ``systemd`` and ``clock`` are the ones its process
        is given; ``resources``: its R, where the plan parsed it already
        (else it is parsed here)."""
        jobid = command.option(JOBID_OPTION)
        time_limit = command.option(TIME_LIMIT_OPTION)
        if not jobid and time_limit is None:
            return None
        jobid = jobid or unit
        if jobid in self.jobs:
            raise RequestError(
                errno.EEXIST, self.jobs[jobid].in_use(JOBID_OPTION, holder)
            )
        received_at = wall_seconds(clock)  # R's times are the epoch
        try:
            rset = resources if resources is not None else request_resources(command)
            expiration = job_expiration(
                received_at, config.max_start_delay_percent, rset, time_limit
            )
        except ValueError as error:
            raise RequestError(errno.EINVAL, str(error)) from None
        return Job(
            jobid,
            received_at=received_at,
            expiration=expiration,
            policy=TerminationPolicy.from_config(config),
            clock=clock,
            systemd=systemd,
            drain=self._drain,
            count=self._count,
        )

    def add(self, job: Job | None, process: Process) -> None:
        """Track ``job`` (from :meth:`admit`) as ``process``'s."""
        if job is not None:
            job.attach(process)
            self.jobs[job.jobid] = job
            self._by_process[process] = job

    def forget(self, process: Process | None) -> None:
        """``process`` was reaped: its job (if any) is gone."""
        job = self._by_process.pop(process, None) if process is not None else None
        if job is not None:
            job.cancel()
            del self.jobs[job.jobid]

    def systemd_lost(self) -> None:
        """systemd went away: verdicts that may rest on a lost kill-signal
        wait for its return."""
        for job in list(self.jobs.values()):
            job.systemd_lost()

    def systemd_restored(self) -> None:
        """systemd is back: verdicts held while it was away are judged."""
        for job in list(self.jobs.values()):
            job.systemd_restored()

    def of(self, process: Process | None) -> Job | None:
        """The job ``process`` runs, if any."""
        return None if process is None else self._by_process.get(process)

    def describe(self, process: Process) -> dict[str, Any]:
        """What ``sdexec.list`` adds to a process's entry: its job id and
        termination step (nothing for a process that runs no job)."""
        job = self.of(process)
        return {} if job is None else {"jobid": job.jobid, "step": job.step}

    def stats(self) -> dict[str, Any]:
        """The ``jobs`` object of ``stats``: one entry per job, by id."""
        return {jobid: job.describe() for jobid, job in self.jobs.items()}

    def terminate(
        self,
        payload: Mapping[str, Any],
        find: Callable[..., Process | None],
        kept: Callable[[str, Any], Process | None] = lambda key, value: None,
    ) -> dict[str, Any]:
        """``sdexec.terminate``: begin the termination of the job named by
        ``pid``, ``label`` or ``jobid`` (exactly one), for ``reason``.
        ``find`` finds a running process by pid or label, ``kept`` (by the
        key and value) an ended one kept for a wait, which is said."""
        try:
            reason = parse_reason(payload.get("reason"))
        except ValueError as error:
            raise RequestError(errno.EINVAL, str(error)) from None
        return self._target(payload, find, kept).terminate(reason)

    def _target(
        self,
        payload: Mapping[str, Any],
        find: Callable[..., Process | None],
        kept: Callable[[str, Any], Process | None],
    ) -> Job:
        keys = terminate_keys(payload)
        if len(keys) != 1:
            raise RequestError(
                errno.EINVAL, "terminate needs exactly one of pid, label or jobid"
            )
        key, value = keys[0], payload[keys[0]]
        if key == "pid" and (not isinstance(value, int) or isinstance(value, bool)):
            raise RequestError(errno.EINVAL, expected("pid", "an integer", value))
        if key != "pid" and not isinstance(value, str):
            raise RequestError(errno.EINVAL, expected(key, "a string", value))
        if key != "pid":
            check_text(key, value)
        job = self.jobs.get(value) if key == "jobid" else self._job_of(key, value, find)
        if job is None:
            # ESRCH both, as kill's: nothing runs to be terminated.
            raise RequestError(errno.ESRCH, _none_named(key, value, kept(key, value)))
        return job

    def _job_of(
        self, key: str, value: object, find: Callable[..., Process | None]
    ) -> Job | None:
        """The job of the running process ``key=value`` names; ``None`` if
        none runs; EINVAL if it runs no job."""
        process = find(**{key: value})
        if process is None:
            return None
        job = self.of(process)
        if job is None:
            raise RequestError(errno.EINVAL, terminate_runs_no_job(key, value))
        return job


def terminate_keys(payload: Mapping[str, Any]) -> list[str]:
    """The keys of ``pid``, ``label`` and ``jobid`` a ``terminate``'s
    ``payload`` names its job by (exactly one, if well formed). A null one
    is absent, as ``kill``, ``wait`` and ``attach`` take a null label beside
    a pid: a client that fills every key it knows sends one."""
    return [key for key in ("pid", "label", "jobid") if payload.get(key) is not None]


def _none_named(key: str, value: object, ended: Process | None) -> str:
    """Why a terminate of ``key=value`` finds no job: nothing by that name,
    or ``ended``, the process it names, has ended and is kept for a wait
    (``sdexec ps`` lists it, state ``Z``; "not found" denied it)."""
    target = target_named(key, value)
    if ended is None:
        return terminate_not_found(key, value)
    if key == "jobid":
        pid = -1 if ended.pid is None else ended.pid
        return (
            f"terminate {target}: the job has ended; its process (pid {pid})"
            " is kept for a wait"
        )
    return ended_and_kept("terminate", target)
