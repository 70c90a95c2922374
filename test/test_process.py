"""Process lifecycle logic without systemd: response order, the stop timer.

systemd's side is a recorder that answers at once; unit state changes are
fed in as the property dicts systemd would send; time is a ``Clock``. The
same paths run against the real manager in ``test_service.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import select
import signal

import pytest
import pytest_twisted
from offline import Recorder
from support import until
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher

from sdexec.config import parse_config
from sdexec.drain import AdminCause
from sdexec.passthrough import PassedStdio
from sdexec.plan import RequestError
from sdexec.process import FAILED_UNIT_WAIT, MAX_EARLY_KILLS, Process, ProcessContext
from sdexec.systemd import SystemdError
from sdexec.systemd.errors import NO_SUCH_PROCESS, NO_SUCH_UNIT
from sdexec.systemd.retry import CALL_RETRY_S, CallBackoff
from sdexec.testing import (
    DEACTIVATING,
    EXITED,
    INACTIVE,
    RUNNING,
    FakeManager,
    exec_plan,
)
from sdexec.unitstop import StopTimerState

UNIT = "sdexec-test.service"
#: A unit whose command systemd could not execute (203/EXEC).
FAILED_TO_EXEC = {
    **{"ActiveState": "failed", "SubState": "failed", "ExecMainPID": 7},
    **{"ExecMainCode": 1, "ExecMainStatus": 203, "Result": "exit-code"},
}
#: A failed unit once reset: inactive, about to be unloaded.
RESET = {"ActiveState": "inactive", "SubState": "dead"}


def lifecycle_plan(seconds: float = 10, second_signal: int = signal.SIGKILL):
    """A plan with no output channels: the lifecycle alone, synchronously."""
    # The site's signal: a request may only repeat it.
    config = parse_config({"exec": {"sdexec-stop-timer-signal": second_signal}})
    plan = exec_plan(config=config, SDEXEC_STOP_TIMER_SEC=str(int(seconds)))
    return dataclasses.replace(plan, output={})


def make_process(seconds: float = 10, second_signal: int = signal.SIGKILL, **kwargs):
    systemd, responder, clock = FakeManager(), Recorder(), Clock()
    process = Process(
        systemd,
        lifecycle_plan(seconds, second_signal),
        responder,
        ProcessContext(reactor=reactor, clock=clock, rank="0"),
        **kwargs,
    )
    process.start()
    return process, systemd, responder, clock


def test_started_finished_then_stop_requested():
    _, systemd, responder, _ = make_process()
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, EXITED)
    assert responder.types() == ["started", "finished"]
    assert responder.responses[0]["pid"] == 4242
    assert ("stop", UNIT) in systemd.calls


def test_stream_ends_with_enodata_once_inactive():
    _, systemd, responder, _ = make_process()
    for state in (RUNNING, EXITED, INACTIVE):
        systemd.change(UNIT, state)
    assert responder.types() == ["started", "finished", errno.ENODATA]


@pytest_twisted.ensureDeferred
async def test_a_reaped_process_s_stdin_is_let_go_whoever_still_holds_it():
    # A process that outlived its unit (moved out of its cgroup, or left
    # behind by an unkillable stop) still holds its stdin. The service's
    # end, shut down only for writing, stayed open for as long as it
    # lived, where the output channels' ends are closed at the reap
    # (review session 51).
    _, systemd, responder, _ = make_process()
    for state in (RUNNING, EXITED, INACTIVE):  # its fds never released
        systemd.change(UNIT, state)
    assert responder.types() == ["started", "finished", errno.ENODATA]
    held = select.poll()
    held.register(systemd.process_fd(UNIT, "stdin"), select.POLLHUP)
    await until(lambda: held.poll(0), "the service's end of stdin closed")


def test_fast_exit_still_sends_started_before_finished():
    _, systemd, responder, _ = make_process()
    systemd.change(UNIT, {**EXITED, "ExecMainStatus": 3, "ActiveState": "failed"})
    assert responder.types() == ["started", "finished"]
    assert responder.responses[1]["status"] == 3 << 8
    assert ("reset", UNIT) in systemd.calls


def test_a_receipt_read_from_an_unloaded_unit_keeps_what_the_signals_said():
    # Stopped by someone else, the unit was unloaded before its last signal
    # went out: the receipt's GetAll read a new stub of its name, whose
    # zeros replaced the start and exit the signals had carried, and
    # `finished` lost its wall time (review session 32 V2).
    _, systemd, responder, _ = make_process()
    stub = {
        "ExecMainPID": 0,
        "ExecMainCode": 0,
        "Result": "success",
        "ExecMainStartTimestampMonotonic": 0,
        "ExecMainExitTimestampMonotonic": 0,
    }
    systemd.get_service_properties = lambda name: defer.succeed(dict(stub))
    systemd.change(UNIT, {**RUNNING, "ExecMainStartTimestampMonotonic": 1_000_000})
    systemd.change(
        UNIT,
        {**EXITED, "ExecMainCode": 2, "ExecMainStatus": 15,
         "ExecMainExitTimestampMonotonic": 6_000_000},
    )  # fmt: skip
    finished = responder.responses[1]
    assert finished["status"] == 15
    assert finished["usage"]["wall_time_usec"] == 5_000_000


def process_with_its_start_held() -> tuple[FakeManager, Recorder, defer.Deferred]:
    """A started process whose start's answer is on its way until the test
    fires it (``answer``), and its unit seen running, then exited."""
    systemd, responder, clock = FakeManager(), Recorder(), Clock()
    answer: defer.Deferred[str] = defer.Deferred()

    def start(name: str, *args: object, **kwargs: object) -> defer.Deferred[str]:
        systemd.calls.append(("start", name))
        return answer

    systemd.start_transient_unit = start  # type: ignore[method-assign]
    context = ProcessContext(reactor=reactor, clock=clock, rank="0")
    Process(systemd, lifecycle_plan(10, signal.SIGKILL), responder, context).start()
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, {**EXITED, "ExecMainStatus": 3})
    return systemd, responder, answer


def test_a_unit_of_its_name_is_not_acted_on_before_the_start_is_ours():
    # SDEXEC_NAME may name another program's unit, which systemd refuses
    # with UnitExists. Its changes while the start was on its way were the
    # request's: started and finished with its pid and status, and a
    # StopUnit sent to it.
    systemd, responder, answer = process_with_its_start_held()
    assert responder.types() == []
    exists = SystemdError("org.freedesktop.systemd1.UnitExists", f"{UNIT} exists")
    answer.errback(exists)
    assert responder.types() == [errno.EEXIST]
    assert [call for call in systemd.calls if call[1] == UNIT] == [("start", UNIT)]


def test_states_seen_before_the_start_was_answered_are_acted_on_once_it_is():
    systemd, responder, answer = process_with_its_start_held()
    answer.callback("/org/freedesktop/systemd1/job/1")
    assert responder.types() == ["started", "finished"]
    assert responder.responses[1]["status"] == 3 << 8
    assert ("stop", UNIT) in systemd.calls


def test_exec_failure_is_an_error_not_finished():
    # The error goes out once the failed unit is reset and gone, as Flux's
    # sdexec answers it: a retry with the same name then finds it free.
    _, systemd, responder, _ = make_process()
    systemd.change(UNIT, FAILED_TO_EXEC)
    assert ("reset", UNIT) in systemd.calls
    assert responder.types() == []
    systemd.change(UNIT, RESET)
    assert responder.types() == [errno.ENOENT]
    assert "203/EXEC" in responder.responses[0][1]


def test_a_command_s_own_exit_of_203_after_it_ran_is_finished():
    # Type=exec: running means executed, so `exit 203` is the script's own.
    _, systemd, responder, _ = make_process()
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, {**FAILED_TO_EXEC, "ExecMainPID": 4242})
    assert responder.types() == ["started", "finished"]
    assert responder.responses[1]["status"] == 203 << 8


def test_running_and_an_exit_of_203_in_one_snapshot_is_the_command_s():
    # The Unit interface's change has not come yet: still running beside the
    # Service interface's exit. Running says the exec succeeded.
    _, systemd, responder, _ = make_process()
    systemd.change(UNIT, {**RUNNING, "ExecMainCode": 1, "ExecMainStatus": 203})
    assert responder.types() == ["started", "finished"]
    assert responder.responses[1]["status"] == 203 << 8


def make_drained_process(seconds: float = 10, second_signal: int = signal.SIGKILL):
    """A process whose context records the drain reasons and counted events."""
    drained: list[str] = []
    counted: list[str] = []
    reaped: list[Process] = []
    systemd, responder, clock = FakeManager(), Recorder(), Clock()
    process = Process(
        systemd,
        lifecycle_plan(seconds, second_signal),
        responder,
        ProcessContext(
            reactor=reactor, clock=clock, rank="0",
            count=counted.append, drain=lambda *drain: drained.append(drain),
        ),
        on_reaped=reaped.append,
    )  # fmt: skip
    process.start()
    return process, systemd, responder, clock, drained, counted, reaped


def test_stop_timer_signals_all_then_abandons_and_drains():
    process, systemd, responder, clock, drained, counted, reaped = make_drained_process(
        seconds=10, second_signal=10
    )
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, EXITED)  # the main process exited 0, a child lingers
    systemd.change(UNIT, DEACTIVATING)
    clock.advance(9.9)
    assert systemd.kills() == []
    clock.advance(0.1)
    assert ("kill", "all", 10) in systemd.calls and systemd.kills() == [10]
    systemd.change(UNIT, DEACTIVATING)  # more changes do not re-arm early
    clock.advance(10)
    reason = f"unkillable user processes in unit {UNIT}"
    assert responder.types() == ["started", "finished", errno.EDEADLK]
    assert responder.responses[1]["status"] == 0  # the command's own status
    # The drain's reason, and for the client what was tried.
    assert responder.responses[-1] == (
        errno.EDEADLK,
        f"{reason}: still deactivating 20s after its stop signalled every"
        " process left in it; tried since: SIGUSR1 once to them, 10s ago; the"
        " node is drained",
    )
    assert drained == [(reason, AdminCause.ABANDONED_UNIT)]
    assert counted == ["stop-timer-signal", "stop-timer-abandoned"]
    assert process.stop_timer.state is StopTimerState.ABANDONED
    assert clock.getDelayedCalls() == []
    # Still tracked until the unit leaves deactivating; reset, then reaped.
    assert reaped == []
    systemd.change(UNIT, {**DEACTIVATING, "ActiveState": "failed"})
    assert ("reset", UNIT) in systemd.calls
    systemd.release(UNIT)
    systemd.change(UNIT, INACTIVE)
    assert reaped == [process]
    assert responder.types() == ["started", "finished", errno.EDEADLK]


def test_lingering_child_that_dies_of_the_stop_signal_ends_normally():
    process, systemd, responder, clock, drained, counted, reaped = make_drained_process(
        seconds=3
    )
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, {**EXITED, "ExecMainStatus": 3})
    systemd.change(UNIT, DEACTIVATING)
    clock.advance(3)
    assert systemd.kills() == [signal.SIGKILL]
    systemd.release(UNIT)
    systemd.change(UNIT, INACTIVE)
    assert responder.types() == ["started", "finished", errno.ENODATA]
    assert responder.responses[1]["status"] == 3 << 8
    assert (drained, counted, reaped) == ([], ["stop-timer-signal"], [process])
    assert clock.getDelayedCalls() == []


def test_stop_timer_disarmed_when_the_unit_stops():
    _, systemd, _, clock = make_process(seconds=5)
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, DEACTIVATING)
    clock.advance(4)
    systemd.change(UNIT, INACTIVE)
    clock.advance(100)
    assert systemd.kills() == []
    assert clock.getDelayedCalls() == []


def test_kill_signals_every_process_of_the_unit():
    process, systemd, _, _ = make_process()
    systemd.change(UNIT, RUNNING)
    process.kill(signal.SIGUSR1)
    assert ("kill", "all", signal.SIGUSR1) in systemd.calls


def outcome(deferred):
    """What a Deferred that has fired holds: its result or its Failure."""
    results: list = []
    deferred.addBoth(results.append)
    [result] = results
    return result


def test_a_signal_before_the_start_waits_for_it():
    # The unit has no process yet: systemd would signal nothing, say yes.
    process, systemd, responder, _ = make_process()
    answers = [process.kill(signal.SIGKILL), process.kill(signal.SIGTERM)]
    assert systemd.kills() == [] and not any(a.called for a in answers)
    systemd.change(UNIT, RUNNING)
    assert responder.types() == ["started"]
    assert systemd.kills() == [signal.SIGKILL, signal.SIGTERM]
    assert [outcome(answer) for answer in answers] == [None, None]


def test_a_signal_for_a_process_that_never_starts_is_esrch():
    process, systemd, _, _ = make_process()
    answer = process.kill(signal.SIGTERM)
    systemd.change(UNIT, FAILED_TO_EXEC)
    for late in (answer, process.kill(signal.SIGTERM)):
        error = outcome(late).value
        assert (type(error), error.errnum) == (RequestError, errno.ESRCH)
    assert systemd.kills() == []


def test_signals_held_for_the_start_are_bounded():
    process, _, _, _ = make_process()
    for _ in range(MAX_EARLY_KILLS):
        process.kill(signal.SIGTERM)
    with pytest.raises(RequestError) as error:
        process.kill(signal.SIGTERM)
    assert error.value.errnum == errno.EAGAIN


def test_abandoned_process_is_stopped_and_silent():
    process, systemd, responder, _ = make_process()
    systemd.change(UNIT, RUNNING)
    process.abandon()
    systemd.change(UNIT, EXITED)
    assert responder.types() == ["started"]
    assert ("stop", UNIT) in systemd.calls


def test_the_stop_timer_signals_a_unit_never_seen_started():
    # Its client left while it was starting: the stop's SIGTERM may not end
    # it, and the stop timer's signal must not wait for a `started`.
    process, systemd, _, clock = make_process(seconds=5)
    systemd.change(UNIT, {"ActiveState": "activating", "SubState": "start"})
    process.client_gone()
    systemd.change(UNIT, {"ActiveState": "deactivating", "SubState": "stop-sigterm"})
    before = len(systemd.signalled)  # the client's SIGKILL, ahead of the stop
    clock.advance(5)
    assert systemd.signalled[before:] == [(UNIT, signal.SIGKILL)]  # lifecycle_plan's


def kills_and_stops(systemd: FakeManager) -> list[tuple]:
    return [call for call in systemd.calls if call[0] in ("kill", "stop")]


def test_a_client_that_left_during_the_start_has_the_main_process_killed():
    # Its start accepted, not seen started: the process may run all the
    # same, and the stop's SIGTERM must not reach it first (its handler
    # would run, and a wait read 15 or 0: review session 35 P2).
    process, systemd, _, _ = make_process()
    process.client_gone()
    assert kills_and_stops(systemd) == [
        ("kill", "all", signal.SIGKILL),
        ("stop", UNIT),
    ]
    systemd.change(UNIT, RUNNING)  # it started all the same
    assert ("kill", "main", signal.SIGKILL) in systemd.calls


def test_a_client_that_left_before_the_start_was_answered_has_it_killed_first():
    systemd, responder, clock = FakeManager(), Recorder(), Clock()
    start, held = systemd.start_transient_unit, defer.Deferred()
    systemd.start_transient_unit = lambda *args, **kw: (start(*args, **kw), held)[1]
    context = ProcessContext(reactor=reactor, clock=clock, rank="0")
    process = Process(systemd, lifecycle_plan(), responder, context)
    process.start()
    process.client_gone()
    assert kills_and_stops(systemd) == []  # no unit to act on yet
    held.callback("/org/freedesktop/systemd1/job/1")
    assert kills_and_stops(systemd) == [
        ("kill", "all", signal.SIGKILL),
        ("stop", UNIT),
    ]
    systemd.close()


def test_a_client_that_left_while_systemd_was_away_is_killed_after_it_returns():
    # The kill ahead of the stop, lost with the connection, is made again
    # with the stop: only the stop was (review 35 R3).
    process, systemd, _, _ = make_process()
    systemd.lose()
    process.client_gone()
    lost = len(systemd.calls)
    systemd.restore()
    process.resync()
    assert [call for call in systemd.calls[lost:] if call[0] in ("kill", "stop")] == [
        ("kill", "all", signal.SIGKILL),
        ("stop", UNIT),
    ]


def test_a_client_that_left_after_started_kills_the_main_process_alone():
    process, systemd, _, _ = make_process()
    systemd.change(UNIT, RUNNING)
    process.client_gone()
    assert kills_and_stops(systemd) == [
        ("kill", "main", signal.SIGKILL),
        ("stop", UNIT),
    ]


def test_a_process_cancelled_at_shutdown_before_started_is_only_stopped():
    # The service stopping is no client gone: the stop's SIGTERM, as ever.
    process, systemd, _, _ = make_process()
    process.cancel("the service is stopping")
    assert kills_and_stops(systemd) == [("stop", UNIT)]


def test_a_start_answered_after_its_unit_ended_with_the_client_gone_is_reaped():
    # dbus-fast hands the unit's signals over as it reads them, the start's
    # answer a few turns later: with its client gone the process ended
    # before the answer, and no signal comes once it has been handled.
    systemd, clock, reaped = FakeManager(), Clock(), []
    start, held = systemd.start_transient_unit, defer.Deferred()
    systemd.start_transient_unit = lambda *args, **kw: (start(*args, **kw), held)[1]
    process = Process(
        systemd,
        lifecycle_plan(),
        Recorder(),
        ProcessContext(reactor=reactor, clock=clock, rank="0"),
        on_reaped=reaped.append,
    )
    process.start()
    process.client_gone()
    systemd.change(UNIT, FAILED_TO_EXEC)
    systemd.change(UNIT, INACTIVE)
    assert reaped == []
    held.callback("/org/freedesktop/systemd1/job/1")
    assert reaped == [process]
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize(
    ("error", "logged"),
    [
        (NO_SUCH_UNIT, False),
        (NO_SUCH_PROCESS, False),
        ("org.freedesktop.DBus.Error.AccessDenied", True),
    ],
    ids=["unit-gone", "process-gone", "refused"],
)
def test_a_kill_for_a_client_that_left_is_quiet_once_the_unit_is_gone(
    monkeypatch, error, logged
):
    # A client gone in a burst logged "KillUnit ... not loaded" per unit:
    # the unit had ended and been unloaded first, nothing was left to kill.
    # Or "No main process to kill", one line per unit of a client gone
    # during its starts (review 38 Q2: 390 of 400): the kill of all its
    # processes, ahead of the stop, had ended the main one already.
    process, systemd, _, _ = make_process()
    monkeypatch.setattr(
        systemd, "kill_unit", lambda *_: defer.fail(SystemdError(error, "no"))
    )
    warnings: list[dict] = []
    globalLogPublisher.addObserver(warnings.append)
    try:
        process.client_gone()
        systemd.change(UNIT, RUNNING)
    finally:
        globalLogPublisher.removeObserver(warnings.append)
    failed = [e for e in warnings if "failed" in e.get("log_format", "")]
    assert bool(failed) is logged


def test_no_sigkill_for_a_main_process_that_has_exited():
    # Its exit seen, its receipt still being read: no main process to kill.
    process, systemd, _, _ = make_process()
    systemd.hold_refresh = True  # the receipt's GetAll is not answered yet
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, EXITED)
    process.client_gone()
    assert systemd.kills() == []


def test_a_signal_held_for_a_start_the_fence_refuses_is_sent():
    # The process did start (and is killed): not "never started".
    process, systemd, _, _ = make_process(verify=lambda cgroup, pid: "not fenced")
    answer = process.kill(signal.SIGTERM)
    systemd.change(UNIT, RUNNING)
    assert outcome(answer) is None
    assert systemd.kills() == [signal.SIGTERM, signal.SIGKILL]


def test_unenforced_fence_refuses_before_started():
    _, systemd, responder, _ = make_process(
        verify=lambda cgroup, pid: "AllowedCPUs not enforced: expected 1 got 0-1",
    )
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, EXITED)
    assert ("kill", "all", signal.SIGKILL) in systemd.calls
    assert ("stop", UNIT) in systemd.calls
    assert responder.types() == []  # answered once the unit is gone
    systemd.change(UNIT, INACTIVE)
    assert responder.types() == [errno.EIO]


def test_reset_after_finished_is_not_a_failure():
    _, systemd, responder, _ = make_process()
    failed = {**EXITED, "ActiveState": "failed", "SubState": "failed",
              "ExecMainStatus": 244}  # fmt: skip
    systemd.change(UNIT, failed)
    # ResetFailedUnit clears ExecMain* before the unit leaves "failed"
    systemd.change(UNIT, {**failed, "ExecMainCode": 0, "ExecMainStatus": 0,
                            "Result": "success"})  # fmt: skip
    systemd.change(UNIT, {**INACTIVE, "ExecMainCode": 0})
    assert responder.types() == ["started", "finished", errno.ENODATA]
    assert responder.responses[1]["status"] == 244 << 8


def test_failed_without_status_is_confirmed_before_it_is_believed():
    _, systemd, responder, _ = make_process()
    # The Unit interface's change arrives before the Service interface's,
    # and another signal before the confirming GetAll's answer.
    systemd.hold_refresh = True
    systemd.change(UNIT, {"ActiveState": "failed", "SubState": "failed"})
    systemd.change(UNIT, {"ActiveState": "failed", "SubState": "failed"})
    assert responder.types() == []
    assert not any(call[0] == "reset" for call in systemd.calls)
    systemd.change(UNIT, {**EXITED, "ActiveState": "failed", "ExecMainStatus": 127})
    # finished waits for its receipt's GetAll (held too); the reset follows
    # that call at once (answered in order, it cannot change the answer)
    assert responder.types() == ["started"]
    assert systemd.calls[-2:] == [("get-all", UNIT), ("reset", UNIT)]
    systemd.answer_refreshes()
    assert responder.types() == ["started", "finished"]


def make_held_process(receipt_reads_cgroup: bool):
    """A process whose receipt's GetAll is held until answered."""
    systemd, responder = FakeManager(), Recorder()
    context = ProcessContext(
        reactor=reactor,
        clock=Clock(),
        rank="0",
        receipt_reads_cgroup=receipt_reads_cgroup,
    )
    Process(systemd, lifecycle_plan(), responder, context).start()
    systemd.hold_refresh = True
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, EXITED)
    return systemd, responder


def test_the_stop_follows_the_receipts_getall_where_it_reads_no_cgroup():
    # (Where it does, test_receipt.py: nothing stops the unit meanwhile.)
    systemd, responder = make_held_process(receipt_reads_cgroup=False)
    assert systemd.calls[-2:] == [("get-all", UNIT), ("stop", UNIT)]
    # However early the stop's end is seen, finished comes first.
    systemd.change(UNIT, INACTIVE)
    assert responder.types() == ["started"]
    systemd.answer_refreshes()
    assert responder.types() == ["started", "finished", errno.ENODATA]


@pytest.mark.parametrize("reads_cgroup", [True, False])
def test_a_unit_seen_exited_before_its_status_is_stopped_after_the_receipt(
    reads_cgroup,
):
    # The Unit's signal first (active/exited), the Service's (the status)
    # after: the stop went out at once, ahead of the receipt's GetAll, which
    # on cgroup v2 reads the cgroup the stop removes.
    systemd, responder = FakeManager(), Recorder()
    context = ProcessContext(
        reactor=reactor, clock=Clock(), rank="0", receipt_reads_cgroup=reads_cgroup
    )
    Process(systemd, lifecycle_plan(), responder, context).start()
    systemd.hold_refresh = True
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, {"ActiveState": "active", "SubState": "exited"})
    assert ("stop", UNIT) not in systemd.calls
    systemd.change(UNIT, EXITED)
    calls = [call for call in systemd.calls if call[0] in ("get-all", "stop")]
    assert calls[0] == ("get-all", UNIT)
    systemd.answer_refreshes()
    assert ("stop", UNIT) in systemd.calls


def test_a_unit_abandoned_while_its_receipt_is_read_gets_finished_first():
    # cgroup v1: the stop timer runs while the receipt's GetAll waits in a
    # busy window; abandoned, the stream ended with EDEADLK alone, its
    # known exit status never sent.
    systemd, responder, clock = FakeManager(), Recorder(), Clock()
    plan = lifecycle_plan(seconds=1)
    context = ProcessContext(
        reactor=reactor, clock=clock, rank="0", receipt_reads_cgroup=False
    )
    Process(systemd, plan, responder, context).start()
    systemd.hold_refresh = True
    systemd.change(UNIT, RUNNING)
    lingering = {"ActiveState": "deactivating", "SubState": "stop-sigterm"}
    systemd.change(UNIT, {**EXITED, "ExecMainStatus": 3, **lingering})
    clock.advance(1)
    clock.advance(1)
    assert responder.types() == ["started", "finished", errno.EDEADLK]
    assert responder.responses[1]["status"] == 3 << 8
    systemd.answer_refreshes()  # the receipt, too late: nothing more
    assert responder.types() == ["started", "finished", errno.EDEADLK]


def test_confirmed_failure_without_status_is_enoent_not_eio():
    # Never started, as Flux's sdexec answers any unit that could not run
    # its process: EIO would have job-exec drain the node.
    _, systemd, responder, _ = make_process()
    failed = {"ActiveState": "failed", "SubState": "failed", "Result": "resources"}
    systemd.change(UNIT, failed)
    systemd.change(UNIT, RESET)
    assert responder.types() == [errno.ENOENT]
    assert "resources" in responder.responses[0][1]


# -- found by a review (notes/review-session29-AN.md) ------------------------


def test_a_stop_systemd_refused_is_made_again_and_its_retry_ends_with_the_unit(
    monkeypatch,
):
    # Refused for any reason but a lost connection (a busy bus's
    # LimitsExceeded), it was never made again: the unit lingered with its
    # children, the process stayed tabled, its name taken.
    reaped: list[Process] = []
    process, systemd, responder, clock = make_process(on_reaped=reaped.append)
    stop = systemd.stop_unit
    busy = SystemdError("org.freedesktop.DBus.Error.LimitsExceeded", "too many")
    monkeypatch.setattr(systemd, "stop_unit", lambda *_: defer.fail(busy))
    systemd.change(UNIT, RUNNING)
    systemd.change(UNIT, EXITED)  # main exited; its children linger
    assert responder.types() == ["started", "finished"]
    monkeypatch.setattr(systemd, "stop_unit", stop)
    clock.advance(1)
    assert systemd.calls.count(("stop", UNIT)) == 1  # made again, taken
    systemd.change(UNIT, INACTIVE)
    assert reaped == [process] and clock.getDelayedCalls() == []


def test_a_passthrough_process_cancelled_before_it_ran_is_reaped():
    # Its start job replaced (a systemctl stop), the unit inactive with no
    # job: the service's stop cancelled the start deadline, no EOF could
    # come (the client's own stdio), and the shutdown waited on it for ever.
    stdio = PassedStdio([os.open("/dev/null", os.O_RDWR) for _ in range(3)])
    stdio.assign(["stdin", "stdout", "stderr"])
    systemd, responder, reaped = FakeManager(), Recorder(), []
    process = Process(
        systemd,
        exec_plan(),
        responder,
        ProcessContext(reactor=reactor, clock=Clock(), rank="0"),
        on_reaped=reaped.append,
        stdio=stdio,
    )
    process.start()
    activating = {"ActiveState": "activating", "SubState": "start"}
    # (Invoked: a start job that never started the unit ends the request.)
    systemd.change(UNIT, {**activating, "Job": (5, "/j/5"), "InvocationID": b"\x01"})
    systemd.change(
        UNIT, {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}
    )
    assert reaped == []  # the client still waits, as for any start
    process.cancel("the service is stopping")
    assert responder.types() == [errno.ECANCELED]
    assert reaped == [process]


def test_a_refused_call_waits_longer_each_time_until_one_goes_through():
    backoff = CallBackoff()
    delays = [backoff.next_delay() for _ in range(len(CALL_RETRY_S) + 2)]
    assert delays == [*CALL_RETRY_S, CALL_RETRY_S[-1], CALL_RETRY_S[-1]]
    backoff.reset()
    assert backoff.next_delay() == CALL_RETRY_S[0]


# -- a start systemd could not run, answered once its unit is gone -----------


def test_an_exec_failure_whose_unit_never_goes_is_answered_after_the_wait():
    # The reset never seen through (a stalled bus, a manager that does not
    # answer): the error goes out FAILED_UNIT_WAIT after the failure all the
    # same, and the process stays tabled (its name held) until its unit goes.
    reaped: list[Process] = []
    process, systemd, responder, clock = make_process(on_reaped=reaped.append)
    systemd.change(UNIT, FAILED_TO_EXEC)
    clock.advance(FAILED_UNIT_WAIT - 0.5)
    assert responder.types() == []
    clock.advance(0.5)
    assert responder.types() == [errno.ENOENT]
    assert "203/EXEC" in responder.responses[0][1]
    assert process.stream_ended and reaped == []
    systemd.change(UNIT, RESET)
    assert reaped == [process]
    assert responder.types() == [errno.ENOENT]  # said once


def test_an_exec_failure_answered_as_its_unit_goes_leaves_no_timer():
    reaped: list[Process] = []
    process, systemd, responder, clock = make_process(on_reaped=reaped.append)
    systemd.change(UNIT, FAILED_TO_EXEC)
    systemd.change(UNIT, RESET)
    assert responder.types() == [errno.ENOENT] and reaped == [process]
    assert clock.getDelayedCalls() == []


def test_a_unit_abandoned_while_its_start_failure_waits_is_edeadlk():
    # The stop timer's verdict over the failure held for the unit's end
    # (a fence refusal, a start timeout, stopped and not dying), as Flux's
    # sdexec checks stop.timed_out first: the client learns the name stays
    # held and the node drained, not only why the start failed.
    process, systemd, responder, clock = make_process()
    systemd.change(UNIT, FAILED_TO_EXEC)
    process.unkillable("unit would not stop")
    assert responder.types() == [errno.EDEADLK]
    assert clock.getDelayedCalls() == []  # the wait's timer with it


def test_the_service_stopping_while_an_exec_failure_waits_sends_that_failure():
    # The request's outcome is known: the stop does not replace it with
    # ECANCELED, nor stop the unit being reset.
    process, systemd, responder, clock = make_process()
    systemd.change(UNIT, FAILED_TO_EXEC)
    process.cancel("the service is stopping")
    assert responder.types() == [errno.ENOENT]
    assert "203/EXEC" in responder.responses[0][1]
    assert ("stop", UNIT) not in systemd.calls
    assert clock.getDelayedCalls() == []
