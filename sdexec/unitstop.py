"""How a unit ends: the stop timer of flux-config-exec(5), and the unit
properties that leave the ending to it instead of to systemd's defaults.

The stop timer ("SDEXEC AND JOB TERMINATION INTERACTION"): when a unit
enters *deactivating* (its main process has exited and sdexec asked systemd
to stop it, but processes remain in its cgroup), wait
``sdexec-stop-timer-sec``; then send ``sdexec-stop-timer-signal`` to every
process still in the unit; after as long again, abandon the unit: the
request fails with EDEADLK and the service drains with a reason naming the
unit, as the job termination sequence does for an unkillable job.

This is the sequence the service follows, rather than the three steps
(SIGTERM, SIGKILL, EDEADLK at one period each) of the sdexec design notes
(spec 000): flux-config-exec(5) (spec 001) is the newer, user-facing
statement; systemd's own ``StopUnit`` already delivers the unit's
``KillSignal`` (SIGTERM) to every remaining process, so a separate SIGTERM
step would only repeat it.

It is not upstream flux-core's code: there the timer is off unless
job-exec asks for it, which it does for multiuser (IMP) jobs only, and it
signals the unit's ``main`` process (the IMP); other units keep systemd's
90 s ``TimeoutStopSec`` and SIGKILL. Here it applies to every unit and
signals all of its processes (no IMP stands between sdexec and them), and
:func:`lifecycle_properties` sets ``TimeoutStopUSec=infinity`` and
``SendSIGKILL=no`` on every unit so that systemd's SIGKILL never overtakes
it: a unit whose leftovers ignore the signal is abandoned and drains the
node where upstream's systemd would have killed them (docs/design.md).

:class:`StopTimer` keeps time and decides; it acts through a
:class:`StopTimerTarget` the service supplies. Its one timer at a time is a
``callLater`` on the reactor it is given, so tests drive it with a ``Clock``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel

from sdexec.clocks import as_wall
from sdexec.fsd import format_fsd
from sdexec.lograte import LogRate
from sdexec.signals import signal_name, signals_said

__all__ = [
    "StopTimer",
    "StopTimerPolicy",
    "StopTimerState",
    "StopTimerTarget",
    "abandon_reason",
    "lifecycle_properties",
]

_log = Logger()


def lifecycle_properties() -> dict[str, str]:
    """The unit properties (name → string, as ``sdexec-properties`` are
    written) that every unit sdexec starts must carry so that systemd's
    defaults cannot pre-empt the stop timer and the termination sequence.

    - ``TimeoutStopUSec=infinity``: systemd's own stop timeout
      (``DefaultTimeoutStopSec``, 90 s) would otherwise end deactivating
      long before the stop timer (by default the effective max-kill-timeout,
      640 s) fires, SIGKILLing the unit and marking it failed ("timeout");
    - ``SendSIGKILL=no``: no ``FinalKillSignal`` from systemd on any stop or
      abort path; the only escalation is sdexec's (kill-signal, then the
      stop-timer signal), with the signals the admin configured;
    - ``KillMode=control-group``: ``StopUnit`` sends ``KillSignal`` to every
      process left in the unit and systemd keeps the unit deactivating until
      the cgroup is empty, which is the state the stop timer measures (with
      ``process`` systemd would forget the leftovers once the main process is
      gone, so lingering processes would escape both timers). It is
      systemd's default, set so no drop-in can change it.

    These names are in :data:`sdexec.config.RESERVED_PROPERTIES`, so a site
    cannot set them; a request may only repeat these values, a no-op
    (:data:`sdexec.policy.SDEXEC_FIXED`; another is EPERM), and the service
    applies these last.
    """
    return {
        "TimeoutStopUSec": "infinity",
        "SendSIGKILL": "no",
        "KillMode": "control-group",
    }


@dataclass(frozen=True)
class StopTimerPolicy:
    """One request's stop timer: ``sdexec-stop-timer-sec`` (or the request's
    shorter ``SDEXEC_STOP_TIMER_SEC``; it is never disabled) and
    ``sdexec-stop-timer-signal`` (or ``SDEXEC_STOP_TIMER_SIGNAL``)."""

    seconds: float
    signal: int


def abandon_reason(unit: str) -> str:
    """The drain reason for a unit the stop timer abandoned."""
    return f"unkillable user processes in unit {unit}"


class StopTimerState(enum.Enum):
    """Where a unit's stop timer stands."""

    #: The unit is not deactivating (yet); nothing is armed.
    IDLE = "idle"
    #: Deactivating: the first period runs.
    ARMED = "armed"
    #: The stop-timer signal was sent: the second period runs.
    SIGNALED = "signaled"
    #: A period ran out while systemd was away: no signal could go out,
    #: and no verdict is given, until it is back (:meth:`StopTimer.systemd_restored`).
    HELD = "held"
    #: Given up: the target was told to abandon the unit.
    ABANDONED = "abandoned"
    #: The unit left deactivating in time: nothing more will happen.
    STOPPED = "stopped"


class StopTimerTarget(Protocol):
    """What the stop timer acts on: one unit. Calls are open loop: a call
    that fails must log and return, not raise."""

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to every process of the unit (``KillUnit``,
        who=``all``)."""

    def abandon(self, reason: str) -> None:
        """Stop waiting for the unit: fail the request with EDEADLK, drain
        the service with ``reason``, and leave a watch that resets the unit
        once it leaves deactivating (so abandoned units do not pile up as
        failed)."""


class StopTimer:
    """One unit's stop timer.

    ``seconds`` is ``sdexec-stop-timer-sec`` (or a request's shorter
    ``SDEXEC_STOP_TIMER_SEC``; never disabled), ``signum``
    ``sdexec-stop-timer-signal``. Call :meth:`deactivating` when the unit
    enters deactivating and :meth:`stopped` when it leaves it (inactive,
    failed, or gone); both are harmless when repeated or late.

    ``connected()`` says whether systemd is there. A period that runs out
    while it is not gives no verdict (the signal could not go out, and
    the unit may have stopped meanwhile): once systemd is back and the
    unit read again, :meth:`systemd_restored` sends the signal once more
    and the verdict comes one period later, as the job termination
    sequence does (docs/termination.md).
    """

    def __init__(
        self,
        reactor: IReactorTime,
        seconds: float,
        signum: int,
        unit: str,
        target: StopTimerTarget,
        connected: Callable[[], bool],
        log_rate: LogRate | None = None,
    ) -> None:
        """``log_rate``: what bounds its lines (a signal sent, a unit
        abandoned): hundreds of units hung on one dead file system must not
        log hundreds of each; ``None``: every line is logged."""
        self._reactor = reactor
        self._log_rate = log_rate
        self.seconds = seconds
        self.signum = signum
        self.unit = unit
        self._target = target
        self._connected = connected
        #: Reactor time the stop-timer signal was last sent, and how often
        #: it was (again after a loss of systemd): what :meth:`account` says.
        self._signalled_at = 0.0
        self._signals = 0
        #: Reactor time the unit began deactivating.
        self._began_at = 0.0
        #: A return of systemd has put the verdict off already: later ones
        #: do not (:meth:`systemd_restored`).
        self._put_off = False
        self.state = StopTimerState.IDLE
        #: Wall-clock time (the epoch) the unit began deactivating, as
        #: ``stats`` shows it.
        self.deactivating_since: float | None = None
        self._timer: IDelayedCall | None = None

    @property
    def next_at(self) -> float | None:
        """Reactor time of the next action, ``None`` when none is pending."""
        return None if self._timer is None else self._timer.getTime()

    def deactivating(self, since: float | None = None) -> None:
        """The unit entered deactivating: arm the first period, of what is
        left of it where ``since`` (this timer's clock's time it began
        deactivating, as systemd says) is known: a leftover's stop began in
        an earlier run of the service, and a timer begun afresh at each
        restart never fired for a service restarting more often."""
        if self.state is not StopTimerState.IDLE:
            return
        now = self._reactor.seconds()
        # Never later than now (a clock that is not systemd's, a test's).
        began = now if since is None else min(since, now)
        self.deactivating_since = as_wall(self._reactor, began)  # the epoch
        self._began_at = began
        self.state = StopTimerState.ARMED
        self._arm_first_period()

    def _arm_first_period(self) -> None:
        """The first period's timer, for what is left of it since the unit
        began deactivating (none left: at once)."""
        elapsed = self._reactor.seconds() - self._began_at
        left = max(0.0, self.seconds - elapsed)
        self._timer = self._reactor.callLater(left, self._first_expiry)

    def retime(self, seconds: float, signum: int) -> None:
        """The site's ``sdexec-stop-timer-sec`` and ``-signal`` changed (a
        reload), for a unit that no request timed (a leftover): taken while
        its signal has not gone out, a first period already running counted
        again from when the unit began deactivating. A leftover that ignored
        SIGTERM otherwise kept the node drained for the old period, 640 s
        by default, whatever the admin reloaded."""
        if self.state not in (StopTimerState.IDLE, StopTimerState.ARMED):
            return  # its signal went, with the period it was sent for
        self.seconds, self.signum = seconds, signum
        if self.state is StopTimerState.ARMED:
            self._cancel()
            self._arm_first_period()

    def follow(self, deactivating: bool, since: float | None = None) -> None:
        """Each state the unit is seen in: arm on entering deactivating
        (at ``since``, if known: :meth:`deactivating`), end on leaving it."""
        if deactivating:
            self.deactivating(since)
        elif self.deactivating_since is not None:
            self.stopped()

    def stopped(self) -> None:
        """The unit left deactivating: nothing more to do."""
        self._cancel()
        if self.state is not StopTimerState.ABANDONED:
            self.state = StopTimerState.STOPPED

    def systemd_restored(self, back_at: float) -> None:
        """systemd is back (since reactor time ``back_at``) after a loss, and
        the unit was read again: a signal the loss may have taken (sent
        before ``back_at``), or an expiry it held, is sent again, and the
        second period counts from now. Once per unit for a signal that may
        have been lost, as a job's step 1 (docs/termination.md): a systemd
        leaving and coming back faster than the period (a bus restarting in
        a loop) would otherwise put the verdict off for ever, and the node
        never drained for what lingers. An expiry held has no timer left
        and always waits for the signal, which it then never had."""
        lost = self.state is StopTimerState.SIGNALED and self._signalled_at < back_at
        held = self.state is StopTimerState.HELD
        if lost and self._put_off:
            return  # the verdict stays due when it was
        if (lost or held) and self._connected():  # (not lost again meanwhile)
            self._put_off = True
            self._cancel()
            self._signal()

    def account(self) -> str:
        """What was tried on the unit, for the words of its abandonment:
        ``still deactivating 20s after its stop signalled every process
        left in it; tried since: SIGUSR1 once to them, 10s ago``."""
        now = self._reactor.seconds()
        since = format_fsd(round(now - self._began_at, 1))
        said = f"still deactivating {since} after its stop signalled every"
        said += " process left in it"
        if not self._signals:
            return said
        sent = signals_said(self.signum, self._signals)
        ago = format_fsd(round(now - self._signalled_at, 1))
        return f"{said}; tried since: {sent} to them, {ago} ago"

    def stats(self) -> dict[str, Any]:
        """The stop-timer part of a process's ``stats`` entry."""
        return {
            "state": self.state.value,
            "deactivating-since": self.deactivating_since,
            "next": as_wall(self._reactor, self.next_at),
        }

    def _first_expiry(self) -> None:
        self._timer = None
        if self._held_for_systemd():
            return
        # How long it has been, not the period: a leftover's stop may have
        # begun periods before the run that found it.
        since = format_fsd(round(self._reactor.seconds() - self._began_at, 1))
        self._say(
            LogLevel.info,
            "stop-timer signal",
            "{unit}: still deactivating after {since}, sending {signal}",
            unit=self.unit,
            since=since,
            signal=signal_name(self.signum),
        )
        self._signal()

    def _signal(self) -> None:
        self.state = StopTimerState.SIGNALED
        self._signalled_at = self._reactor.seconds()
        self._signals += 1
        self._timer = self._reactor.callLater(self.seconds, self._second_expiry)
        try:
            self._target.signal_all(self.signum)
        except Exception:
            # The second period is armed already: the unit is still
            # abandoned in time even if this signal was lost.
            _log.failure("{unit}: stop-timer signal failed", unit=self.unit)

    def _held_for_systemd(self) -> bool:
        """Whether systemd is away: the timer then waits for it (HELD)."""
        if self._connected():
            return False
        self.state = StopTimerState.HELD
        _log.info(
            "{unit}: still deactivating, and systemd is away: {signal} and"
            " the verdict wait until it is back",
            unit=self.unit,
            signal=signal_name(self.signum),
        )
        return True

    def _second_expiry(self) -> None:
        self._timer = None
        if self._held_for_systemd():
            return
        self.state = StopTimerState.ABANDONED
        self._say(
            LogLevel.warn,
            "stop-timer abandoned",
            "{unit}: still deactivating {seconds:g} s after {signal}: abandoned",
            unit=self.unit,
            seconds=self.seconds,
            signal=signal_name(self.signum),
        )
        self._target.abandon(abandon_reason(self.unit))

    def _say(self, level: LogLevel, key: str, text: str, **fields: Any) -> None:
        """Log a line of kind ``key``, at a bounded rate if it has one."""
        if self._log_rate is None:
            _log.emit(level, text, **fields)
        else:
            self._log_rate.emit(level, key, text, **fields)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
