"""The stop timer: kill escalation for a unit that will not stop.

Flux's ``struct stop_timer``: once a unit starts deactivating with processes
left, each expiry of the timer takes one step — SIGTERM, then the configured
signal, then give up (the process's stream ends with EDEADLK). The state
says which step the next expiry takes; the timer is cancelled when the unit
becomes inactive and armed again (at the same step) if it deactivates again.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

__all__ = ["StopTimer", "StopTimerPolicy", "StopTimerState"]

log = Logger()


@dataclass(frozen=True)
class StopTimerPolicy:
    """The stop timer: ``seconds`` after the unit starts deactivating, send
    SIGTERM; as long again, ``signal``; as long again, give up (EDEADLK).
    Negative ``seconds`` disables it."""

    seconds: float
    signal: int

    @property
    def enabled(self) -> bool:
        return self.seconds >= 0


class StopTimerState(enum.Enum):
    """What the timer's next expiry does (or that it is done)."""

    SEND_SIGTERM = "send SIGTERM"
    SEND_SIGNAL = "send the stop signal"
    GIVE_UP = "give up"
    GAVE_UP = "gave up"


class StopTimer:
    """One unit's stop timer.

    ``kill(signum)`` signals the unit; ``give_up()`` is called after the last
    step; ``count(event)`` counts each step for the statistics.
    """

    def __init__(
        self,
        policy: StopTimerPolicy,
        clock: IReactorTime,
        unit_name: str,
        *,
        kill: Callable[[int], None],
        give_up: Callable[[], None],
        count: Callable[[str], None],
    ) -> None:
        self.policy = policy
        self.state = StopTimerState.SEND_SIGTERM
        self._clock = clock
        self._unit_name = unit_name
        self._kill = kill
        self._give_up = give_up
        self._count = count
        self._call: IDelayedCall | None = None

    @property
    def running(self) -> bool:
        return self._call is not None

    def arm(self) -> None:
        """Start counting down, unless already running, disabled or done."""
        if self.running or not self.policy.enabled:
            return
        if self.state is StopTimerState.GAVE_UP:
            return
        self._call = self._clock.callLater(self.policy.seconds, self._expired)

    def cancel(self) -> None:
        """Stop counting down; the next :meth:`arm` resumes at this step."""
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _expired(self) -> None:
        self._call = None
        if self.state is StopTimerState.SEND_SIGTERM:
            self._escalate(
                "stop-timer-sigterm", signal.SIGTERM, StopTimerState.SEND_SIGNAL
            )
        elif self.state is StopTimerState.SEND_SIGNAL:
            self._escalate(
                "stop-timer-signal", self.policy.signal, StopTimerState.GIVE_UP
            )
        else:
            self.state = StopTimerState.GAVE_UP
            self._count("stop-timer-gave-up")
            log.error(
                "{unit}: still active after signal {signum}; giving up on it",
                unit=self._unit_name,
                signum=self.policy.signal,
            )
            self._give_up()

    def _escalate(self, event: str, signum: int, then: StopTimerState) -> None:
        self.state = then
        self._count(event)
        log.info(
            "{unit}: stop timer expired, sending signal {signum}",
            unit=self._unit_name,
            signum=signum,
        )
        self._kill(signum)
        self.arm()
