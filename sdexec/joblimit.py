"""A job's time limit: when it expires, and the timer that says so.

The limit comes from the job's R (``execution.expiration``, an absolute
time; ``starttime`` when the allocation began) or from the request's
``SDEXEC_TIME_LIMIT`` option, a Flux Standard Duration counted from the
request's arrival. An expiration of 0, or a limit of ``"0"``, means
unlimited, as in Flux. When both are given the earlier wins: a request
cannot outlast its allocation.

``max-start-delay-percent`` (flux-config-exec(5)): if the request arrives
later than ``starttime`` by more than that percentage of the job's duration
(``expiration - starttime``), the effective expiration moves later by the
whole delay, so a short job is not robbed of its run time by a busy system.

Expirations are the epoch, as R's times are (:func:`sdexec.clocks.wall_seconds`
of the clock); the timer runs on the clock's own time (monotonic for the
service's), so tests drive it on a ``Clock``.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from sdexec.clocks import wall_seconds
from sdexec.containment import R_OPTION
from sdexec.fsd import parse_fsd
from sdexec.rset import ResourceSet

__all__ = [
    "TIME_LIMIT_OPTION",
    "TimeLimit",
    "effective_expiration",
    "job_expiration",
    "parse_time_limit",
]

#: The exec option that gives a time limit as an FSD.
TIME_LIMIT_OPTION = "SDEXEC_TIME_LIMIT"


def parse_time_limit(text: str | float) -> float | None:
    """Seconds in an ``SDEXEC_TIME_LIMIT`` value; ``None`` for ``"0"``
    (unlimited). ``ValueError`` naming the option for anything else."""
    try:
        seconds = parse_fsd(text)
    except ValueError as error:
        raise ValueError(f"{TIME_LIMIT_OPTION}: {error}") from None
    return seconds or None


def effective_expiration(
    rset: ResourceSet, received_at: float, max_start_delay_percent: float
) -> float | None:
    """The absolute time at which the job of ``rset`` times out, ``None``
    when R sets no limit; extended by the start delay when that exceeds
    ``max_start_delay_percent`` of the job's duration.

    ``ValueError`` naming the R field when the times are impossible.
    """
    expiration, starttime = rset.expiration, rset.starttime
    if not expiration:
        return None
    if expiration < 0:
        raise ValueError(f"R: execution.expiration: negative ({expiration})")
    if not starttime:
        return expiration
    duration = expiration - starttime
    if duration < 0:
        raise ValueError(
            f"R: execution.expiration: {expiration} is before"
            f" execution.starttime {starttime}"
        )
    delay = received_at - starttime
    # delay > 0: a request received "before" the start (clock skew) never
    # shortens the job, which Flux's job-exec does under a negative percent.
    if delay > 0 and delay > duration * max_start_delay_percent / 100:
        return expiration + delay
    return expiration


def job_expiration(
    received_at: float,
    max_start_delay_percent: float,
    rset: ResourceSet | None = None,
    time_limit: str | float | None = None,
) -> float | None:
    """The absolute expiration of a job request: the earlier of R's
    (see :func:`effective_expiration`) and ``received_at + time_limit``;
    ``None`` when neither limits it."""
    candidates = []
    if rset is not None:
        try:
            expiration = effective_expiration(
                rset, received_at, max_start_delay_percent
            )
        except ValueError as error:
            raise ValueError(f"{R_OPTION}: {error}") from None
        candidates.append(expiration)
    if time_limit is not None:
        seconds = parse_time_limit(time_limit)
        candidates.append(None if seconds is None else received_at + seconds)
    limits = [at for at in candidates if at is not None]
    return min(limits, default=None)


class TimeLimit:
    """Calls ``on_expired()`` once, at ``expiration`` (the epoch, turned
    into a delay when armed), or at once if that has passed; :meth:`cancel`
    when the job ends first."""

    def __init__(
        self,
        reactor: IReactorTime,
        expiration: float,
        on_expired: Callable[[], object],
    ) -> None:
        self.expiration = expiration
        self._on_expired = on_expired
        # An epoch: from it, a delay on the reactor's own clock.
        delay = max(0.0, expiration - wall_seconds(reactor))
        self._timer: IDelayedCall | None = reactor.callLater(delay, self._expired)

    @property
    def active(self) -> bool:
        """Whether the limit is still ahead."""
        return self._timer is not None

    def cancel(self) -> None:
        """The job ended: the limit no longer applies. Harmless twice."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        self._on_expired()
