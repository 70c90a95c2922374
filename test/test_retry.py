"""The reconnection's backoff, on a Clock: retried until it succeeds, each
wait twice the last up to the cap, nothing left armed after a stop."""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from sdexec.systemd.retry import Backoff


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
