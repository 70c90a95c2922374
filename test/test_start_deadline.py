"""Every request ends: a unit whose states the model does not expect ends
its request after ``[systemd] start-timeout``, saying what was seen. Offline,
on a Clock; the real unit types are in test_faults.py."""

from __future__ import annotations

import errno

from offline import Recorder
from test_process import UNIT, lifecycle_plan, make_process
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from sdexec.config import DEFAULT_START_TIMEOUT
from sdexec.process import FAILED_UNIT_WAIT, Process, ProcessContext
from sdexec.systemd.errors import reconnecting
from sdexec.testing import EXITED, INACTIVE, RUNNING, FakeManager

#: A unit that never ran, once the start timeout's stop is done.
STOPPED = {"ActiveState": "inactive", "SubState": "dead"}


def test_a_unit_that_never_shows_a_process_ends_its_request():
    # Type=forking whose daemon left: active/exited, no pid, no exit status.
    _, systemd, responder, clock = make_process()
    systemd.change(UNIT, {"ActiveState": "activating", "SubState": "start"})
    systemd.change(UNIT, {"ActiveState": "active", "SubState": "exited"})
    clock.advance(DEFAULT_START_TIMEOUT - 1)
    assert ("stop", UNIT) not in systemd.calls
    clock.advance(1)
    assert ("stop", UNIT) in systemd.calls
    # Answered once the unit is gone: a retry with its name then runs.
    assert responder.responses == []
    systemd.change(UNIT, STOPPED)
    [(errnum, errstr)] = responder.responses
    assert errnum == errno.ETIMEDOUT
    assert errstr == (
        f"unit {UNIT} did not start a process sdexec can follow within 120 s:"
        " last seen active/exited, ExecMainPID 0, ExecMainCode 0, Result -,"
        " Type=exec"
    )
    assert clock.getDelayedCalls() == []


def test_the_unit_is_reaped_once_inactive_after_the_timeout():
    reaped = []
    _, systemd, responder, clock = make_process(on_reaped=reaped.append)
    clock.advance(DEFAULT_START_TIMEOUT)  # a manager that never says anything
    assert reaped == [] and responder.responses == []
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    assert len(reaped) == 1
    [(errnum, errstr)] = responder.responses  # no ENODATA after the error
    assert errnum == errno.ETIMEDOUT and "no state/-" in errstr


def test_a_started_process_is_not_timed_out():
    _, systemd, responder, clock = make_process()
    systemd.change(UNIT, RUNNING)
    assert clock.getDelayedCalls() == []
    clock.advance(10 * DEFAULT_START_TIMEOUT)
    systemd.change(UNIT, EXITED)
    systemd.change(UNIT, INACTIVE)
    assert responder.types() == ["started", "finished", errno.ENODATA]


def test_an_abandoned_process_leaves_no_timer_once_reaped():
    process, systemd, _, clock = make_process()
    assert clock.getDelayedCalls()  # armed by the accepted start
    process.abandon()
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    assert clock.getDelayedCalls() == []


def test_the_timeout_is_the_contexts():
    systemd, responder, clock = FakeManager(), Recorder(), Clock()
    context = ProcessContext(reactor=reactor, clock=clock, rank="0", start_timeout=5)
    Process(systemd, lifecycle_plan(), responder, context).start()
    clock.advance(5)
    clock.advance(FAILED_UNIT_WAIT)  # its unit never seen to go
    assert "within 5 s" in responder.responses[0][1]


def test_a_start_answered_after_the_units_signals_arms_no_deadline():
    # dbus-fast delivers signals as it reads them, a call's answer a few
    # turns later: the process had started, and the deadline armed by the
    # answer then ended its request mid-run (and stopped the unit).
    systemd, responder, clock = FakeManager(), Recorder(), Clock()
    answer: Deferred[str] = Deferred()
    start = systemd.start_transient_unit

    def answered_late(*args, **kwargs) -> Deferred[str]:
        start(*args, **kwargs)
        return answer

    systemd.start_transient_unit = answered_late  # type: ignore[method-assign]
    context = ProcessContext(reactor=reactor, clock=clock, rank="0")
    Process(systemd, lifecycle_plan(), responder, context).start()
    systemd.change(UNIT, RUNNING)
    answer.callback("/org/freedesktop/systemd1/job/1")
    assert clock.getDelayedCalls() == []
    clock.advance(10 * DEFAULT_START_TIMEOUT)
    systemd.change(UNIT, EXITED)
    systemd.change(UNIT, INACTIVE)
    assert responder.types() == ["started", "finished", errno.ENODATA]
    systemd.close()


def test_a_deadlines_stop_lost_with_the_connection_is_made_again(monkeypatch):
    # The stop sdexec decided on went with the connection; only an
    # abandoned process's was made again, and the unit ran on.
    process, systemd, responder, clock = make_process()
    stop = systemd.stop_unit

    def lost(name: str, mode: str = "replace"):
        systemd.calls.append(("stop", name))
        return fail(reconnecting())

    monkeypatch.setattr(systemd, "stop_unit", lost)
    clock.advance(DEFAULT_START_TIMEOUT)
    clock.advance(FAILED_UNIT_WAIT)  # its unit never seen to go
    assert responder.responses[0][0] == errno.ETIMEDOUT
    monkeypatch.setattr(systemd, "stop_unit", stop)
    process.resync()
    assert [call for call in systemd.calls if call[0] == "stop"] == [("stop", UNIT)] * 2


def test_the_start_timeout_waits_for_systemd_and_counts_again_from_its_return():
    # It gave its verdict while systemd was away: a unit that had started
    # meanwhile (its signals lost) was ended "did not start a process sdexec
    # can follow", and was stopped once systemd came back.
    process, systemd, responder, clock = make_process()
    systemd.connected = False
    clock.advance(DEFAULT_START_TIMEOUT)
    assert responder.responses == []
    systemd.connected = True
    process.resync()  # the unit is read again: not started yet
    clock.advance(DEFAULT_START_TIMEOUT - 1)
    assert ("stop", UNIT) not in systemd.calls
    clock.advance(1)
    assert ("stop", UNIT) in systemd.calls
    systemd.change(UNIT, STOPPED)
    assert responder.types() == [errno.ETIMEDOUT]


def test_a_unit_that_started_while_systemd_was_away_is_not_timed_out():
    process, systemd, responder, clock = make_process()
    systemd.connected = False
    clock.advance(DEFAULT_START_TIMEOUT)
    systemd.units[UNIT] = {**RUNNING}  # no signal: systemd was away
    systemd.connected = True
    process.resync()
    clock.advance(10 * DEFAULT_START_TIMEOUT)
    assert responder.types() == ["started"]
    assert ("stop", UNIT) not in systemd.calls


def test_the_start_timeout_waits_for_the_re_read_after_systemd_s_return():
    # Run out between the return and the unit's re-read (thousands queued
    # in the call window): judged on the state from before the outage.
    process, systemd, responder, clock = make_process()
    systemd.connected = False
    clock.advance(DEFAULT_START_TIMEOUT - 1)
    systemd.connected = True
    systemd.hold_refresh = True
    systemd.units[UNIT] = {**RUNNING}  # it started while systemd was away
    process.resync()
    clock.advance(1)  # the timeout runs out before the re-read answers
    assert responder.responses == []
    systemd.answer_refreshes()
    clock.advance(10 * DEFAULT_START_TIMEOUT)
    assert responder.types() == ["started"]
    assert ("stop", UNIT) not in systemd.calls
