"""JOB TERMINATION of flux-config-exec(5): how a running job is carried from
a cancel or a time limit to its exit, or to being declared unkillable.

The sequence, with times from the moment termination begins (``kt`` is
``kill-timeout``):

1. ``term-signal`` to the job's tasks (``SIGALRM`` instead when the reason is
   a time limit);
2. at ``kt``, ``2 kt``, ``3 kt`` and ``4 kt``: ``kill-signal`` to the tasks;
3. from ``5 kt`` on: ``kill-signal`` to the job shell itself (the unit's main
   process), instead of to the tasks; the wait before the next attempt
   starts at ``kt`` and doubles after each attempt, capped at
   :data:`~sdexec.config.MAX_KILL_INTERVAL` (300 s);
4. give up, and report the job unkillable, right after the
   ``max-kill-count``-th direct attempt, or, when ``max-kill-timeout`` is
   set (it then wins over ``max-kill-count``), once that long has passed
   since termination began.

With ``max-kill-count = 4, kill-timeout = 1s`` the direct attempts come at
5, 6, 8 and 12 s and the job is declared unkillable at 12 s; with the
defaults (8, 5 s) the last attempt and the verdict come at 640 s: both are
:func:`sdexec.config.final_kill_attempt`, the ``effective-max-kill-timeout``
the configuration reports.

:class:`TerminationSequence` only keeps time and decides; it acts through a
:class:`TerminationTarget` the service supplies, and it stops for good as
soon as the service says the job exited (:meth:`TerminationSequence.job_exited`).
Every timer is one ``callLater`` on the reactor it is given, so tests drive
it with :class:`twisted.internet.task.Clock`.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import Any, Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from sdexec.clocks import as_wall, wall_seconds
from sdexec.config import MAX_KILL_INTERVAL, ExecConfig, exact_seconds
from sdexec.fsd import format_fsd
from sdexec.refusal import json_quoted
from sdexec.signals import signal_name, signals_said

__all__ = [
    "TerminationPolicy",
    "TerminationReason",
    "TerminationSequence",
    "TerminationStep",
    "TerminationTarget",
    "parse_reason",
    "unkillable_reason",
]

_log = Logger()

#: Direct attempts on the job shell begin after this many kill-timeouts.
SHELL_PHASE_FACTOR = 5

#: Whom a signal goes to, as ``KillUnit`` names them: every process of the
#: job's unit (its tasks), or its main process (the job shell).
_ALL = "all"
_MAIN = "main"

#: The least time, in seconds, between two of step 1's signals sent again
#: for new terminates (:meth:`TerminationSequence.again`), counted from
#: step 1 itself: terminates within it are coalesced into one re-send at its
#: end, so a client sending terminate in a loop costs systemd at most one
#: ``KillUnit`` per signal a second.
RESEND_INTERVAL = 1.0


class TerminationReason(enum.Enum):
    """Why a job is terminated: the ``reason`` of ``sdexec.terminate``."""

    CANCEL = "cancel"
    TIMEOUT = "timeout"


def parse_reason(value: object) -> TerminationReason:
    """The ``reason`` of an ``sdexec.terminate`` request; ``ValueError``
    naming the field and the choices for anything else."""
    for reason in TerminationReason:
        if value == reason.value:
            return reason
    choices = " or ".join(f'"{reason.value}"' for reason in TerminationReason)
    raise ValueError(f"reason: expected {choices}, got {json_quoted(value)}")


#: What began a termination, as :meth:`TerminationSequence.account` says it.
_BEGUN_BY = {
    TerminationReason.CANCEL: "a cancel (sdexec.terminate)",
    TerminationReason.TIMEOUT: "its time limit",
}
#: Whom a signal went to (:data:`_ALL`, :data:`_MAIN`), as it says it.
_SENT_TO = {
    _ALL: "every process of its unit",
    _MAIN: "its job shell (its main process)",
}


class TerminationStep(enum.Enum):
    """Where a job's termination stands, as ``stats`` and ``ps`` show it."""

    #: Step 1 done: term-signal (or SIGALRM) sent, waiting kill-timeout.
    TERM = "term"
    #: Step 2: kill-signal sent to the tasks every kill-timeout.
    KILL_TASKS = "kill-tasks"
    #: Step 3: kill-signal sent to the job shell with exponential backoff.
    KILL_SHELL = "kill-shell"
    #: Step 4: given up; the target was told the job is unkillable.
    UNKILLABLE = "unkillable"
    #: The job exited while terminating: the sequence ended there.
    EXITED = "exited"


class TerminationTarget(Protocol):
    """What the sequence acts on: one job, as the service sees it.

    The calls are open loop (as in flux-core's job-exec): their results are
    not awaited, and a call that fails must log and return, not raise.
    """

    def signal_tasks(self, signum: int) -> None:
        """Send ``signum`` to every process of the job (``KillUnit`` with
        who=``all``)."""

    def signal_main(self, signum: int) -> None:
        """Send ``signum`` to the job shell only (``KillUnit`` with
        who=``main``)."""

    def unkillable(self, reason: str) -> None:
        """The job outlived the sequence: drain the service with ``reason``
        if the unit still has processes, and fail the request (EDEADLK)."""


def unkillable_reason(job: str) -> str:
    """The drain reason for a job that outlived its termination sequence."""
    return f"unkillable user processes for job {job}"


@dataclass(frozen=True)
class TerminationPolicy:
    """The ``[exec]`` keys that shape the sequence. Seconds and signal
    numbers, as :class:`~sdexec.config.ExecConfig` holds them."""

    kill_timeout: float = 5.0
    max_kill_count: int = 8
    #: ``None``: ``max_kill_count`` bounds the sequence.
    max_kill_timeout: float | None = None
    term_signal: int = signal.SIGTERM.value
    kill_signal: int = signal.SIGKILL.value

    @classmethod
    def from_config(cls, config: ExecConfig) -> TerminationPolicy:
        """The policy an ``[exec]`` table configures."""
        return cls(
            kill_timeout=config.kill_timeout,
            max_kill_count=config.max_kill_count,
            max_kill_timeout=config.max_kill_timeout,
            term_signal=config.term_signal,
            kill_signal=config.kill_signal,
        )

    def first_signal(self, reason: TerminationReason) -> int:
        """Step 1's signal: SIGALRM for a time limit, else term-signal."""
        if reason is TerminationReason.TIMEOUT:
            return signal.SIGALRM.value
        return self.term_signal

    @property
    def shell_phase_start(self) -> float:
        """Seconds from the start until the first direct attempt."""
        return exact_seconds(SHELL_PHASE_FACTOR * self.kill_timeout)


@dataclass
class _Progress:
    """The mutable part of a running sequence, in offsets (seconds since it
    began)."""

    task_kills: int = 0
    kill_attempts: int = 0
    next_attempt_at: float = 0.0
    interval: float = 0.0


class TerminationSequence:
    """One job's termination: :meth:`begin` starts it, :meth:`job_exited`
    ends it; between the two it signals ``target`` on schedule and, if the
    job outlives the schedule, calls ``target.unkillable`` once.

    ``job`` names the job in the unkillable reason (its id, as the client
    gave it).
    """

    def __init__(
        self,
        reactor: IReactorTime,
        policy: TerminationPolicy,
        target: TerminationTarget,
        job: str,
    ) -> None:
        self._reactor = reactor
        self.policy = policy
        self._target = target
        self.job = job
        #: ``None`` until :meth:`begin`.
        self.step: TerminationStep | None = None
        self.reason: TerminationReason | None = None
        #: When the sequence began (the epoch, for stats).
        self.started_at: float | None = None
        self._progress = _Progress()
        self._timer: IDelayedCall | None = None
        self._due = 0.0
        #: When the last step ran, and its offset: the next one is due its
        #: interval after it, however late it ran (a reactor stall), so
        #: that each signal has its time to work (the clock's own time).
        self._fired_at = 0.0
        self._fired_due = 0.0
        #: Step 1's signals asked for again by later terminates, not sent
        #: yet (in order, each once), the timer that sends them, and when
        #: the last one of step 1's signals went.
        self._again: dict[int, None] = {}
        self._again_timer: IDelayedCall | None = None
        self._first_sent_at = 0.0
        #: When it began (this clock's time), and every signal asked for
        #: since, by whom it went to and its number, counted in order:
        #: what the verdict says was tried (:meth:`account`).
        self._began_at = 0.0
        self._sent: dict[tuple[str, int], int] = {}

    # --- what the service calls -------------------------------------------

    def begin(self, reason: TerminationReason) -> bool:
        """Step 1, and arm the rest. ``False`` (and nothing done) when the
        sequence already began or the job already exited: a time limit
        reached during a cancel does not restart it (see :meth:`again`)."""
        if self.step is not None:
            return False
        self.step, self.reason = TerminationStep.TERM, reason
        self.started_at = wall_seconds(self._reactor)  # for stats: the epoch
        self._fired_at = self._first_sent_at = self._reactor.seconds()
        self._began_at = self._fired_at
        self._fired_due = 0.0
        self._progress = _Progress(
            next_attempt_at=self.policy.shell_phase_start,
            interval=self.policy.kill_timeout,
        )
        self._send(_ALL, self.policy.first_signal(reason))
        if not self._exited:
            self._arm()
        return True

    def again(self, reason: TerminationReason) -> bool:
        """A terminate (or the time limit) for a job whose sequence already
        runs: step 1's signal for ``reason`` (term-signal, or SIGALRM for a
        time limit) goes to the job's tasks once more, as upstream's
        job-exec sends term-signal on each new exception (and SIGALRM when
        the time limit comes during a cancel). Nothing else changes: the
        sequence's timers, its steps and its reason (the first one's) stay.
        Signals asked for within :data:`RESEND_INTERVAL` of the last one
        are coalesced, each sent once at its end. ``False`` (nothing done)
        before :meth:`begin`, once the job exited, or after the verdict."""
        if self.step in (None, TerminationStep.EXITED, TerminationStep.UNKILLABLE):
            return False
        self._again.setdefault(self.policy.first_signal(reason))
        if self._again_timer is None:
            wait = self._first_sent_at + RESEND_INTERVAL - self._reactor.seconds()
            if wait <= 0:
                self._send_again()
            else:
                self._again_timer = self._reactor.callLater(wait, self._send_again)
        return True

    def _send_again(self) -> None:
        self._again_timer = None
        signals, self._again = list(self._again), {}
        self._first_sent_at = self._reactor.seconds()
        for signum in signals:
            if self._exited or self.step is TerminationStep.UNKILLABLE:
                return
            self._send(_ALL, signum)

    def job_exited(self) -> None:
        """The job's main process exited (or its unit is gone): stop here.
        Harmless at any time, also before :meth:`begin` or twice."""
        self._cancel_timer()
        if self.step is not TerminationStep.UNKILLABLE:
            self.step = TerminationStep.EXITED

    def resend_first(self) -> None:
        """Step 1's signal once more, to every process of the job: it was
        lost (systemd was away when it was sent). The next step, if one is
        pending, then comes no sooner than kill-timeout from now, so the
        signal has its interval to work (a job trapping term-signal to save
        a checkpoint gets that time); the steps after it keep their
        intervals, counted from it, as after any step that ran late."""
        if self.step is None or self._exited:
            return
        assert self.reason is not None  # set with the step
        self._first_sent_at = self._reactor.seconds()
        self._send(_ALL, self.policy.first_signal(self.reason))
        timer = self._timer
        if timer is None or self._exited:
            return  # run out (a verdict the target holds), or it exited
        earliest = self._reactor.seconds() + self.policy.kill_timeout
        if timer.getTime() < earliest:
            timer.reset(self.policy.kill_timeout)

    def signal_shell_again(self) -> None:
        """kill-signal to the job shell once more, outside the schedule:
        a verdict held while systemd was away is given only after it
        (the job's own timer), and :meth:`account` counts it."""
        self._send(_MAIN, self.policy.kill_signal)

    def account(self) -> str:
        """What began the termination and what it tried, for the verdict's
        words: ``its time limit began its termination 12s ago; tried since:
        SIGALRM once to every process of its unit, SIGKILL 4 times to every
        process of its unit, SIGKILL 4 times to its job shell (its main
        process)``. A job declared unkillable has no ``finished`` (its
        ``terminated`` key), so nothing else tells its client, or the admin
        reading the drain, that its time limit or a cancel began it, nor how
        hard it was tried."""
        if self.reason is None:
            return "its termination has not begun"
        began = _BEGUN_BY[self.reason]
        # Rounded: a reactor's float time is no more exact than that.
        elapsed = format_fsd(round(self._reactor.seconds() - self._began_at, 1))
        sent = ", ".join(
            f"{signals_said(signum, count)} to {_SENT_TO[whom]}"
            for (whom, signum), count in self._sent.items()
        )
        return (
            f"{began} began its termination {elapsed} ago; tried since:"
            f" {sent or 'nothing'}"
        )

    @property
    def active(self) -> bool:
        """Whether timers are still pending."""
        return self._timer is not None

    @property
    def next_at(self) -> float | None:
        """Reactor time of the next action, ``None`` when none is pending."""
        if self._timer is None:
            return None
        return self._timer.getTime()

    @property
    def kill_attempts(self) -> int:
        """Direct kill-signal attempts on the job shell so far."""
        return self._progress.kill_attempts

    @property
    def task_kills(self) -> int:
        """Step 2 kill-signals to the tasks so far."""
        return self._progress.task_kills

    def stats(self) -> dict[str, Any]:
        """The termination part of a job's ``stats`` entry. A job that
        exited without being terminated shows no step: ``exited`` says the
        sequence ended with the job, and none began."""
        step = None if self.reason is None else self.step
        return {
            "step": None if step is None else step.value,
            "reason": None if self.reason is None else self.reason.value,
            "started": self.started_at,
            "task-kills": self.task_kills,
            "kill-attempts": self.kill_attempts,
            "next": as_wall(self._reactor, self.next_at),
        }

    # --- the schedule -------------------------------------------------------

    def _arm(self) -> None:
        self._due = self._next_due()
        due_at = self._fired_at + self._due - self._fired_due
        delay = max(0.0, due_at - self._reactor.seconds())
        self._timer = self._reactor.callLater(delay, self._fire)

    def _next_due(self) -> float:
        """The offset of the next action: a task kill, a direct attempt or
        the max-kill-timeout deadline, whichever comes first."""
        candidates = [self._progress.next_attempt_at]
        if self._task_phase():
            candidates.append(self._next_task_kill_at())
        if self.policy.max_kill_timeout is not None:
            candidates.append(self.policy.max_kill_timeout)
        return min(candidates)

    def _task_phase(self) -> bool:
        return self._progress.task_kills + 1 < SHELL_PHASE_FACTOR

    def _next_task_kill_at(self) -> float:
        # A multiple, not a running sum, so no rounding error accumulates;
        # rounded all the same: 3 * 0.1 is 0.30000000000000004, past a
        # max-kill-timeout of 0.3, and the kill due then was never sent.
        return exact_seconds((self._progress.task_kills + 1) * self.policy.kill_timeout)

    def _fire(self) -> None:
        self._timer = None
        due, progress = self._due, self._progress
        self._fired_at, self._fired_due = self._reactor.seconds(), due
        if self._task_phase() and self._next_task_kill_at() <= due:
            progress.task_kills += 1
            self.step = TerminationStep.KILL_TASKS
            self._send(_ALL, self.policy.kill_signal)
        if progress.next_attempt_at <= due and not self._exited:
            self._attempt_on_shell()
        if self._exited:
            return  # the target found out while signalling
        if self._exhausted(due):
            self._cancel_timer()  # a re-send still waiting: none after it
            self.step = TerminationStep.UNKILLABLE
            _log.warn(
                "job {job}: unkillable {limit}: {account}",
                job=self.job,
                limit=self._limit_reached(),
                account=self.account(),
            )
            self._target.unkillable(unkillable_reason(self.job))
            return
        self._arm()

    @property
    def _exited(self) -> bool:
        # A target may call job_exited() from inside a signal call.
        return self.step is TerminationStep.EXITED

    def _attempt_on_shell(self) -> None:
        progress = self._progress
        progress.kill_attempts += 1
        # Rounded: a running sum of 1.1 s drifted to 13.200000000000001,
        # past a max-kill-timeout of 13.2, and that attempt was never sent.
        progress.next_attempt_at = exact_seconds(
            progress.next_attempt_at + progress.interval
        )
        progress.interval = min(progress.interval * 2, MAX_KILL_INTERVAL)
        self.step = TerminationStep.KILL_SHELL
        self._send(_MAIN, self.policy.kill_signal)

    def _limit_reached(self) -> str:
        """Which limit ran out, for the verdict's log line: under
        max-kill-timeout the attempts are no limit (none at all when it
        comes before 5 x kill-timeout, "after 0 kill attempts")."""
        limit = self.policy.max_kill_timeout
        if limit is not None:
            return f"once max-kill-timeout ({format_fsd(limit)}) ran out"
        return f"after {self._progress.kill_attempts} kill attempts"

    def _exhausted(self, due: float) -> bool:
        if self.policy.max_kill_timeout is not None:
            return due >= self.policy.max_kill_timeout
        return self._progress.kill_attempts >= self.policy.max_kill_count

    def _send(self, whom: str, signum: int) -> None:
        """``signum`` to ``whom`` (:data:`_ALL` or :data:`_MAIN`), counted
        for :meth:`account`."""
        self._sent[whom, signum] = self._sent.get((whom, signum), 0) + 1
        send = self._target.signal_main if whom == _MAIN else self._target.signal_tasks
        _log.debug(
            "job {job}: {signal} ({step})",
            job=self.job,
            signal=signal_name(signum),
            step=self.step.value if self.step else None,  # as ps shows it
        )
        try:
            send(signum)
        except Exception:
            # The schedule must go on: a lost signal is retried by the next
            # step, a lost timer would leave the job hanging.
            _log.failure(
                "job {job}: sending {signal} failed",
                job=self.job,
                signal=signal_name(signum),
            )

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._again_timer is not None:
            self._again_timer.cancel()
            self._again_timer, self._again = None, {}
