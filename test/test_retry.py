"""The reconnection's backoff, on a Clock: retried until it succeeds, each
wait twice the last up to the cap, nothing left armed after a stop."""

from __future__ import annotations

import itertools

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from sdexec.systemd.retry import REMIND_FIRST_S, REMIND_MAX_S, Backoff, Reminders


class Attempts:
    """Fails the first ``failures`` attempts, then succeeds."""

    def __init__(self, clock: Clock, failures: int) -> None:
        self.clock = clock
        self.failures = failures
        self.times: list[float] = []

    def __call__(self) -> Deferred[None]:
        self.times.append(self.clock.seconds())
        if len(self.times) <= self.failures:
            return fail(ConnectionRefusedError("no bus"))
        return succeed(None)


def test_retries_with_doubling_delays_up_to_the_cap():
    clock = Clock()
    attempts = Attempts(clock, failures=5)
    backoff = Backoff(clock, attempts, "test", first_delay=1, max_delay=4)
    backoff.start()
    clock.pump([1] * 20)
    assert attempts.times == [0, 1, 3, 7, 11, 15]
    assert not backoff.running
    assert backoff.failures == 5
    assert clock.getDelayedCalls() == []


def test_a_start_while_running_does_not_start_twice():
    clock = Clock()
    attempts = Attempts(clock, failures=1)
    backoff = Backoff(clock, attempts, "test", first_delay=1)
    backoff.start()
    backoff.start()
    assert attempts.times == [0]
    clock.advance(1)
    assert attempts.times == [0, 1]


def test_stop_cancels_the_next_attempt():
    clock = Clock()
    attempts = Attempts(clock, failures=10)
    backoff = Backoff(clock, attempts, "test", first_delay=1)
    backoff.start()
    backoff.stop()
    assert clock.getDelayedCalls() == []
    clock.advance(10)
    assert attempts.times == [0]


def test_a_new_start_tries_at_once_then_waits_the_first_delay_again():
    clock = Clock()
    attempts = Attempts(clock, failures=10)
    backoff = Backoff(clock, attempts, "test", first_delay=1, max_delay=8)
    backoff.start()
    clock.pump([1] * 3)  # attempts at 0, 1 and 3; the next would be at 7
    backoff.stop()
    backoff.start()
    clock.advance(1)
    assert attempts.times == [0, 1, 3, 3, 4]


def test_a_lasting_failure_is_logged_once_then_at_growing_gaps():
    # An unreachable bus logged each attempt, every 5 s for as long as it
    # lasted (review session 45).
    clock = Clock()
    attempts = Attempts(clock, failures=1000)
    backoff = Backoff(clock, attempts, "test", first_delay=1, max_delay=5)
    with capturedLogs() as events:
        backoff.start()
        clock.pump([1] * 600)
    logged = [(event["n"], clock_time(attempts, event)) for event in events]
    # Attempts at 0, 1, 3, 7, then every 5 s: the first failure, then the
    # first at least 60 s after it, 120 s after that, 240 s after that.
    assert logged == [(1, 0), (15, 62), (39, 182), (87, 422)]
    assert "failing for 62 s; next in 5 s" in formatEvent(events[1])


def clock_time(attempts: Attempts, event: dict) -> float:
    """When the attempt a log event tells of was made."""
    return attempts.times[event["n"] - 1]


def test_a_new_start_logs_its_first_failure_again():
    clock = Clock()
    attempts = Attempts(clock, failures=1000)
    backoff = Backoff(clock, attempts, "test", first_delay=1, max_delay=5)
    with capturedLogs() as events:
        backoff.start()
        clock.pump([1] * 30)
        backoff.stop()
        backoff.start()
    assert [event["n"] for event in events] == [1, 1]


def test_reminders_come_at_doubling_gaps_up_to_the_cap():
    clock = Clock()
    reminders = Reminders(clock)
    assert not reminders.due()  # nothing lasts yet
    reminders.begin()
    due = []
    for _ in range(int(5 * REMIND_MAX_S)):
        clock.advance(1)
        if reminders.due():
            due.append(clock.seconds())
    gaps = [later - earlier for earlier, later in itertools.pairwise([0.0, *due])]
    assert gaps[:3] == [REMIND_FIRST_S, 2 * REMIND_FIRST_S, 4 * REMIND_FIRST_S]
    assert max(gaps) == REMIND_MAX_S and gaps[-2:] == [REMIND_MAX_S] * 2
    assert reminders.end() == 5 * REMIND_MAX_S
    assert reminders.end() is None and not reminders.due()
