"""A manager that does not answer (sdexec.systemd.unanswered): calls get no
timeout (a start systemd took goes on whether anyone waits for it), so a
wedged manager is told instead: a warning once a call has waited
SILENT_AFTER_S, a line when answers come again, and what waits. A Clock
drives it; the client's own use is in test_manager_absent.py."""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from sdexec.notify import describe_server
from sdexec.systemd.unanswered import SILENT_AFTER_S, Silence, UnansweredCalls


def messages(events) -> list[str]:
    return [formatEvent(event) for event in events]


def test_a_call_answered_in_time_says_nothing():
    clock = Clock()
    calls = UnansweredCalls(clock)
    with capturedLogs() as events:
        token = calls.sent("StartTransientUnit")
        clock.advance(SILENT_AFTER_S - 1)
        assert calls.silence() is None
        calls.answered(token)
        # Its timer stays (not one armed and cancelled per call), finds
        # nothing, and is not armed again.
        clock.advance(1)
    assert events == [] and clock.getDelayedCalls() == []
    assert calls.oldest() is None and len(calls) == 0


def test_calls_one_after_another_arm_one_timer():
    clock = Clock()
    calls = UnansweredCalls(clock)
    for _ in range(100):
        calls.answered(calls.sent("StopUnit"))
    assert len(clock.getDelayedCalls()) == 1


def test_a_silent_manager_is_told_once_and_its_return_too():
    clock = Clock()
    calls = UnansweredCalls(clock)
    with capturedLogs() as events:
        first = calls.sent("StartTransientUnit")
        clock.advance(1)
        second = calls.sent("KillUnit")
        clock.advance(SILENT_AFTER_S - 1)
        assert messages(events) == [
            "systemd has not answered StartTransientUnit for 25 s (2 calls"
            " waiting): the manager may be wedged (`systemctl status`, its"
            " journal); starts, kills and stops wait for it"
        ]
        clock.advance(100)
        assert len(events) == 1  # once per silence
        assert calls.silence() == Silence("StartTransientUnit", 125.0, 2)
        calls.answered(first)  # the next has waited as long: still silent
        assert len(events) == 1
        assert calls.silence() == Silence("KillUnit", 124.0, 1)
        calls.answered(second)
    assert messages(events)[1] == "systemd answers again (KillUnit after 124 s)"
    assert calls.silence() is None


def test_each_call_is_timed_from_its_own_sending():
    # The timer armed for the first call fires after it was answered: the
    # next is judged by its own age, and told when that reaches the mark.
    clock = Clock()
    calls = UnansweredCalls(clock)
    with capturedLogs() as events:
        first = calls.sent("StopUnit")
        clock.advance(10)
        calls.sent("GetAll")
        calls.answered(first)
        clock.advance(SILENT_AFTER_S - 10)
        assert events == [] and calls.silence() is None
        clock.advance(10)
    assert messages(events)[0].startswith("systemd has not answered GetAll for 25 s:")


def test_after_a_silence_the_next_call_is_watched_again():
    clock = Clock()
    calls = UnansweredCalls(clock)
    with capturedLogs() as events:
        first = calls.sent("StopUnit")
        clock.advance(SILENT_AFTER_S)
        calls.sent("StopUnit")
        calls.answered(first)  # answers again; the second is young
        clock.advance(SILENT_AFTER_S)
    assert [m.split(" for ")[0] for m in messages(events)] == [
        "systemd has not answered StopUnit",
        "systemd answers again (StopUnit after 25 s)",
        "systemd has not answered StopUnit",
    ]


def test_the_status_line_tells_a_silence():
    silence = Silence("StartTransientUnit", 42.4, 3)
    assert describe_server(None, 2, silence) == (
        "serving 2 processes; systemd has not answered StartTransientUnit"
        " for 42 s (3 calls waiting)"
    )
    assert describe_server("fence failed", 0, Silence("StopUnit", 30, 1)) == (
        "drained: fence failed; systemd has not answered StopUnit for 30 s"
    )


def test_one_timer_at_most_is_left_to_stop():
    # After a silence, a young call still waiting had a second timer armed
    # beside its own, which stop() left behind (review session 32 S1).
    clock = Clock()
    calls = UnansweredCalls(clock)
    first = calls.sent("StopUnit")
    clock.advance(SILENT_AFTER_S)  # silent; no timer now
    calls.sent("KillUnit")  # arms one for itself
    clock.advance(5)
    calls.answered(first)  # answers again: the young call is watched
    assert len(clock.getDelayedCalls()) == 1
    calls.stop()
    assert clock.getDelayedCalls() == []
