"""Process lifecycle logic without systemd: response order, the stop timer.

systemd's side is a recorder that answers at once; unit state changes are
fed in as the property dicts systemd would send; time is a ``Clock``. The
same paths run against the real manager in ``test_service.py``.
"""

from __future__ import annotations

import errno
import signal

import pytest
from twisted.internet import defer, reactor
from twisted.internet.task import Clock

from sdexec.process import Process, StopTimerPolicy

RUNNING = {"ActiveState": "active", "SubState": "running", "ExecMainPID": 4242}
EXITED = {**RUNNING, "SubState": "exited", "ExecMainCode": 1, "ExecMainStatus": 0}
DEACTIVATING = {**EXITED, "ActiveState": "deactivating", "SubState": "stop-sigterm"}
INACTIVE = {**EXITED, "ActiveState": "inactive", "SubState": "dead"}


class RecordingSystemd:
    """Answers every call at once and records it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.watch_callback = None
        self.refresh_answer: dict | None = None

    def watch_unit(self, name, callback):
        self.watch_callback = callback
        systemd = self

        class Watch:
            def __init__(self):
                self.state = {}  # as UnitWatch: what signals have said so far

            def refresh(self):
                # As UnitWatch does: deliver the whole state, then fire with
                # it; with no answer set, the answer is still on its way.
                if systemd.refresh_answer is None:
                    return defer.Deferred()
                callback(systemd.refresh_answer)
                return defer.succeed(systemd.refresh_answer)

            def cancel(self):
                systemd.calls.append(("cancel",))

        return Watch()

    def start_transient_unit(self, name, properties, *fds):
        self.calls.append(("start", name))
        return defer.succeed("/job/1")

    def _record(self, *call):
        self.calls.append(call)
        return defer.succeed(None)

    def stop_unit(self, name, mode="fail"):
        return self._record("stop", name)

    def reset_failed_unit(self, name):
        return self._record("reset", name)

    def kill_unit(self, name, who, signum):
        return self._record("kill", who, signum)

    def kills(self) -> list[int]:
        return [call[2] for call in self.calls if call[0] == "kill"]


class Recorder:
    def __init__(self) -> None:
        self.responses: list = []

    def respond(self, payload):
        self.responses.append(payload)

    def error(self, errnum, errstr):
        self.responses.append((errnum, errstr))

    def types(self) -> list:
        return [r["type"] if isinstance(r, dict) else r[0] for r in self.responses]


def make_process(seconds: float = 10, second_signal: int = signal.SIGKILL):
    systemd, responder, clock = RecordingSystemd(), Recorder(), Clock()
    process = Process(
        systemd,
        "sdexec-test.service",
        [],
        responder,
        reactor=reactor,
        clock=clock,
        flags=3,
        rank="0",
        stop_timer=StopTimerPolicy(seconds=seconds, signal=second_signal),
        output={},
    )
    process.start()
    return process, systemd, responder, clock


def test_started_finished_then_stop_requested():
    _, systemd, responder, _ = make_process()
    systemd.watch_callback(RUNNING)
    systemd.watch_callback(EXITED)
    assert responder.types() == ["started", "finished"]
    assert responder.responses[0]["pid"] == 4242
    assert ("stop", "sdexec-test.service") in systemd.calls


def test_stream_ends_with_enodata_once_inactive():
    _, systemd, responder, _ = make_process()
    for state in (RUNNING, EXITED, INACTIVE):
        systemd.watch_callback(state)
    assert responder.types() == ["started", "finished", errno.ENODATA]


def test_fast_exit_still_sends_started_before_finished():
    _, systemd, responder, _ = make_process()
    systemd.watch_callback({**EXITED, "ExecMainStatus": 3, "ActiveState": "failed"})
    assert responder.types() == ["started", "finished"]
    assert responder.responses[1]["status"] == 3 << 8
    assert ("reset", "sdexec-test.service") in systemd.calls


def test_exec_failure_is_an_error_not_finished():
    _, systemd, responder, _ = make_process()
    systemd.watch_callback(
        {"ActiveState": "failed", "SubState": "failed", "ExecMainPID": 7,
         "ExecMainCode": 1, "ExecMainStatus": 203, "Result": "exit-code"}
    )  # fmt: skip
    assert responder.types() == [errno.ENOENT]
    assert "203/EXEC" in responder.responses[0][1]


def test_stop_timer_escalates_sigterm_then_signal_then_edeadlk():
    _, systemd, responder, clock = make_process(seconds=10, second_signal=10)
    systemd.watch_callback(RUNNING)
    systemd.watch_callback(DEACTIVATING)
    clock.advance(9.9)
    assert systemd.kills() == []
    clock.advance(0.1)
    assert systemd.kills() == [signal.SIGTERM]
    systemd.watch_callback(DEACTIVATING)  # more changes do not re-arm early
    clock.advance(10)
    assert systemd.kills() == [signal.SIGTERM, 10]
    clock.advance(10)
    assert responder.responses[-1] == (
        errno.EDEADLK,
        "SIGKILL timeout, unit may still be active",
    )
    assert ("cancel",) in systemd.calls
    assert clock.getDelayedCalls() == []


def test_stop_timer_disarmed_when_the_unit_stops():
    _, systemd, _, clock = make_process(seconds=5)
    systemd.watch_callback(RUNNING)
    systemd.watch_callback(DEACTIVATING)
    clock.advance(4)
    systemd.watch_callback(INACTIVE)
    clock.advance(100)
    assert systemd.kills() == []
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize("seconds", [-1, -30])
def test_negative_stop_timer_is_disabled(seconds):
    _, systemd, _, clock = make_process(seconds=seconds)
    systemd.watch_callback(RUNNING)
    systemd.watch_callback(DEACTIVATING)
    assert clock.getDelayedCalls() == []


def test_kill_signals_every_process_of_the_unit():
    process, systemd, _, _ = make_process()
    process.kill(signal.SIGUSR1)
    assert ("kill", "all", signal.SIGUSR1) in systemd.calls


def test_abandoned_process_is_stopped_and_silent():
    process, systemd, responder, _ = make_process()
    systemd.watch_callback(RUNNING)
    process.abandon()
    systemd.watch_callback(EXITED)
    assert responder.types() == ["started"]
    assert ("stop", "sdexec-test.service") in systemd.calls


def test_unenforced_fence_refuses_before_started():
    systemd, responder = RecordingSystemd(), Recorder()
    process = Process(
        systemd, "sdexec-test.service", [], responder, reactor=reactor,
        clock=Clock(), flags=3, rank="0",
        stop_timer=StopTimerPolicy(seconds=10, signal=9), output={},
        verify=lambda state, pid: "AllowedCPUs not enforced: expected 1 got 0-1",
    )  # fmt: skip
    process.start()
    systemd.watch_callback(RUNNING)
    systemd.watch_callback(EXITED)
    assert responder.types() == [errno.EIO]
    assert ("kill", "all", signal.SIGKILL) in systemd.calls
    assert ("stop", "sdexec-test.service") in systemd.calls


def test_reset_after_finished_is_not_a_failure():
    _, systemd, responder, _ = make_process()
    failed = {**EXITED, "ActiveState": "failed", "SubState": "failed",
              "ExecMainStatus": 244}  # fmt: skip
    systemd.watch_callback(failed)
    # ResetFailedUnit clears ExecMain* before the unit leaves "failed"
    systemd.watch_callback({**failed, "ExecMainCode": 0, "ExecMainStatus": 0,
                            "Result": "success"})  # fmt: skip
    systemd.watch_callback({**INACTIVE, "ExecMainCode": 0})
    assert responder.types() == ["started", "finished", errno.ENODATA]
    assert responder.responses[1]["status"] == 244 << 8


def test_failed_without_status_is_confirmed_before_it_is_believed():
    _, systemd, responder, _ = make_process()
    # The Unit interface's change arrives before the Service interface's,
    # and another signal before the confirming GetAll's answer.
    systemd.watch_callback({"ActiveState": "failed", "SubState": "failed"})
    systemd.watch_callback({"ActiveState": "failed", "SubState": "failed"})
    assert responder.types() == []
    assert not any(call[0] == "reset" for call in systemd.calls)
    systemd.watch_callback({**EXITED, "ActiveState": "failed", "ExecMainStatus": 127})
    assert responder.types() == ["started", "finished"]
    assert ("reset", "sdexec-test.service") in systemd.calls


def test_confirmed_failure_without_status_is_eio():
    _, systemd, responder, _ = make_process()
    failed = {"ActiveState": "failed", "SubState": "failed", "Result": "resources"}
    systemd.refresh_answer = failed
    systemd.watch_callback(failed)
    assert responder.types() == [errno.EIO]
    assert "resources" in responder.responses[0][1]
