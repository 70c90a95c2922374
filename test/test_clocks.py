"""The service's timers on a monotonic clock (sdexec/clocks.py): a wall
clock stepped moves none of them (it moved all: review session 31 F F1),
while what is reported as the epoch stays the epoch."""

from __future__ import annotations

import time

import pytest
from pytest_twisted import ensureDeferred
from support import until
from test_service_offline import service_on
from twisted.internet import defer, reactor
from twisted.internet.error import AlreadyCalled, AlreadyCancelled
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from sdexec.clocks import MonotonicClock, as_wall, timers_clock, wall_seconds
from sdexec.config import parse_config
from sdexec.joblimit import TimeLimit
from sdexec.service import SdexecService
from sdexec.systemd import SystemdClient
from sdexec.testing import FakeManager


def monotonic() -> MonotonicClock:
    clock = timers_clock(reactor)
    assert isinstance(clock, MonotonicClock)  # the service's, on asyncio
    return clock


@ensureDeferred
async def test_a_timer_fires_once_and_a_cancelled_one_never():
    clock, fired = monotonic(), []
    clock.callLater(0.01, fired.append, "a")
    cancelled = clock.callLater(0.01, fired.append, "b")
    cancelled.cancel()
    assert not cancelled.active()
    with pytest.raises(AlreadyCancelled):
        cancelled.cancel()
    # A witness armed after the cancelled one, for as long: once it has run,
    # the event loop has passed the cancelled one's time (due no later, it
    # would have run first or in the same pass).
    clock.callLater(0.01, fired.append, "witness")
    await until(lambda: "witness" in fired, "the witness")
    assert sorted(fired) == ["a", "witness"] and clock.getDelayedCalls() == []


@ensureDeferred
async def test_a_timer_moved_fires_when_moved_to():
    clock, fired = monotonic(), []
    before = clock.seconds()
    later = clock.callLater(0.01, fired.append, "later")
    later.delay(60)
    # (due 0.01 s after it was armed, then 60 s later: between two readings)
    assert before + 60 < later.getTime() < clock.seconds() + 60.02
    # A witness due when the timer was before its move: once it has run,
    # the timer's old time has passed (unmoved, it would have run too).
    clock.callLater(0.01, fired.append, "witness")
    await until(lambda: fired, "the witness")
    assert fired == ["witness"]
    fired.clear()
    later.reset(0.01)
    await until(lambda: fired, "the timer reset")
    with pytest.raises(AlreadyCalled):
        later.reset(1)


@ensureDeferred
async def test_a_wall_clock_step_moves_no_timer(monkeypatch):
    # An NTP step, an admin's date -s: an hour forward fired a cancel's
    # SIGKILL a second after its SIGTERM, and a time limit at once. The
    # reactor's own timers read its seconds(), the wall clock: stepped, its
    # call runs at once, the monotonic clock's at its time.
    # A minute ahead, so that no stall of a loaded machine fires it before
    # it is looked at; then moved to now, to see it still runs.
    clock, fired = monotonic(), []
    timer = clock.callLater(60.0, fired.append, "monotonic")
    due = timer.getTime()
    reactor.callLater(60.0, fired.append, "reactor")
    stepped = time.time() + 3600
    monkeypatch.setattr(reactor, "seconds", lambda: stepped)
    monkeypatch.setattr(time, "time", lambda: stepped)
    reactor.callLater(0, lambda: None)  # the reactor looks at its calls again
    await until(lambda: fired, "the reactor's timer, fired by the step")
    assert fired == ["reactor"] and timer.getTime() == due
    timer.reset(0.01)
    await until(lambda: len(fired) == 2, "the timer, at its own time")
    assert wall_seconds(clock) == stepped  # the epoch, stepped as it is


@ensureDeferred
async def test_an_exception_of_a_timer_is_logged_and_goes_no_further(logged_failures):
    clock = monotonic()

    def fails() -> None:
        raise RuntimeError("boom")

    def failures() -> list:
        return [event for event in events if event.get("log_failure")]

    with capturedLogs() as events:
        clock.callLater(0, fails)
        await until(failures, "the timer's failure logged")
        later: list[str] = []
        clock.callLater(0, later.append, "next")  # the clock goes on
        await until(lambda: later, "the next timer")
    (failure,) = logged_failures.flush(RuntimeError)
    assert failure.getErrorMessage() == "boom"


@ensureDeferred
async def test_the_service_s_timers_run_on_the_monotonic_clock(tmp_path):
    # What the service hands its server (time limits, termination, stop
    # timers, start deadlines, lookups): every test of those runs on a
    # Clock, so only this one sees the reactor's wall-clock timers given.
    service = service_on(FakeManager(), f"unix:{tmp_path}/s.sock")
    service.startService()
    await service.ready
    try:
        assert isinstance(service.server.clock, MonotonicClock)
    finally:
        await service.stopService()


def test_the_service_reconnects_to_systemd_on_the_monotonic_clock(monkeypatch):
    clocks = []

    def connect(**options):
        clocks.append(options["clock"])
        return defer.Deferred()

    monkeypatch.setattr(SystemdClient, "connect", connect)
    service = SdexecService(parse_config({}), reactor, listen="unix:/nowhere")
    service._connect_systemd()
    assert len(clocks) == 1 and isinstance(clocks[0], MonotonicClock)


def test_a_reactor_without_the_asyncio_loop_is_refused_not_used():
    # Its own timers move with the wall clock: taken without a word (a
    # Twisted that renamed its private _asyncioEventloop), they brought
    # the steps back.
    class RenamedLoop:
        _asyncio_loop = reactor._asyncioEventloop

    with pytest.raises(TypeError, match="RenamedLoop has none"):
        timers_clock(RenamedLoop())


def test_a_time_limit_counts_from_its_arming_whatever_the_wall_clock_does():
    class SteppedClock(Clock):
        offset = 1_000_000.0

        def wall_seconds(self) -> float:
            return self.seconds() + self.offset

    clock, expired = SteppedClock(), []
    limit = TimeLimit(clock, wall_seconds(clock) + 3600, lambda: expired.append(1))
    clock.offset += 7200  # stepped two hours forward after the arming
    clock.advance(3599)
    assert expired == [] and limit.active
    clock.advance(1)
    assert expired == [1]


def test_a_report_of_a_clock_time_is_the_epoch(monkeypatch):
    clock = monotonic()
    # Both clocks held still: a tolerance around two live readings fails
    # when a loaded machine stalls between them.
    monkeypatch.setattr(clock, "seconds", lambda: 500.0)
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    assert as_wall(clock, 510.0) == 1_700_000_010.0
    assert as_wall(clock, None) is None
    plain = Clock()  # a test's: its seconds stand for the epoch too
    plain.advance(5)
    assert (wall_seconds(plain), as_wall(plain, 7.0)) == (5.0, 7.0)
