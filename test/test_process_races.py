"""Orderings of a process's life that a real node can produce, forced offline.

Each test drives a :class:`~sdexec.testing.FakeManager` unit and a ``Clock``
through one ordering of systemd's answers and signals, the client's leaving
and the service's timers, and checks the outcome: the client gets one
terminal answer, in RFC 42's order, with the right status; the process is
reaped; no timer is left.
"""

from __future__ import annotations

import errno
import signal
from typing import Any

import pytest
from offline import Recorder
from pytest_twisted import ensureDeferred
from support import until
from test_jobs import START, TimedManager, job_payload
from test_jobs import UNIT as JOB_UNIT
from test_process import UNIT, lifecycle_plan
from twisted.internet import defer, reactor
from twisted.internet.task import Clock

from sdexec.config import parse_config
from sdexec.process import Process, ProcessContext
from sdexec.server import SdexecServer
from sdexec.testing import DEACTIVATING, INACTIVE, RUNNING, FakeManager

#: A start job that ended without starting the unit (canceled, or a
#: dependency failed): inactive, no job, never invoked.
UNSTARTED = {
    "ActiveState": "inactive",
    "SubState": "dead",
    "Job": (0, "/"),
    "InvocationID": b"",
}


class Run:
    """One process and what it is driven by."""

    def __init__(self, start_timeout: float = 60, hold_start: bool = False) -> None:
        self.systemd, self.responder, self.clock = FakeManager(), Recorder(), Clock()
        self.reaped: list[Process] = []
        self.answer: defer.Deferred[str] | None = None
        if hold_start:
            start, held = self.systemd.start_transient_unit, defer.Deferred()
            self.answer = held

            def start_held(*args: Any, **kwargs: Any) -> defer.Deferred[str]:
                start(*args, **kwargs)
                return held

            self.systemd.start_transient_unit = start_held  # type: ignore
        context = ProcessContext(
            reactor=reactor,
            clock=self.clock,
            rank="0",
            start_timeout=start_timeout,
        )
        self.process = Process(
            self.systemd,
            lifecycle_plan(),
            self.responder,
            context,
            on_reaped=self.reaped.append,
        )
        self.process.start()

    def change(self, state: dict[str, Any]) -> None:
        self.systemd.change(UNIT, state)

    def calls(self, *kinds: str) -> list[tuple]:
        return [call for call in self.systemd.calls if call[0] in kinds]

    def assert_over(self, *types: Any) -> None:
        """The client got exactly ``types``, the process is reaped, and no
        timer is left."""
        assert self.responder.types() == list(types)
        assert self.reaped == [self.process]
        assert self.clock.getDelayedCalls() == []
        self.systemd.close()


def outcome(deferred: defer.Deferred) -> Any:
    box: list[Any] = []
    deferred.addBoth(box.append)
    assert box, "not fired"
    return box[0]


# -- a kill between the start's answer and the unit's first signal ------------


def test_a_kill_before_the_first_signal_is_sent_once_the_unit_runs():
    run = Run()
    killed = run.process.kill(signal.SIGTERM)
    assert run.calls("kill") == []
    run.change(RUNNING)
    assert run.calls("kill") == [("kill", "all", signal.SIGTERM)]
    assert outcome(killed) is None
    run.systemd.end(UNIT, signal=signal.SIGTERM)
    assert run.responder.responses[1]["status"] == signal.SIGTERM
    run.assert_over("started", "finished", errno.ENODATA)


def test_a_kill_held_when_the_start_times_out_is_esrch():
    run = Run(start_timeout=5)
    run.change({"ActiveState": "activating", "SubState": "start"})
    killed = run.process.kill(signal.SIGUSR1)
    run.clock.advance(5)
    assert outcome(killed).value.errnum == errno.ESRCH
    run.change(INACTIVE | {"ExecMainCode": 0, "ExecMainPID": 0})  # the stop's
    run.assert_over(errno.ETIMEDOUT)
    assert run.calls("kill") == []


# -- the client leaving at each step -----------------------------------------


def test_a_client_gone_before_the_start_s_answer_leaves_nothing():
    run = Run(hold_start=True)
    run.process.client_gone()
    assert run.answer is not None
    run.answer.callback("/org/freedesktop/systemd1/job/1")
    run.change(UNSTARTED)  # the stop canceled the queued start job
    run.assert_over()


def test_a_client_gone_between_start_and_started_leaves_nothing():
    run = Run()
    run.process.client_gone()
    run.change(RUNNING)  # it ran all the same, and is SIGKILLed
    run.systemd.end(UNIT, signal=signal.SIGKILL)
    assert run.calls("kill", "stop") == [
        ("kill", "all", signal.SIGKILL),
        ("stop", UNIT),
        ("kill", "main", signal.SIGKILL),
    ]
    run.assert_over()


def test_a_client_gone_while_the_unit_stops_leaves_no_stop_timer():
    run = Run()
    run.change(RUNNING)
    run.systemd.exit(UNIT, 0)
    run.change(DEACTIVATING)  # the stop, a child lingering
    assert run.clock.getDelayedCalls() != []  # the stop timer
    run.process.client_gone()
    assert run.calls("kill") == []  # the main process has exited
    run.systemd.release(UNIT)
    run.change(INACTIVE)
    run.assert_over("started", "finished")


def test_a_client_gone_after_the_exit_before_finished_leaves_nothing():
    run = Run()
    run.systemd.hold_refresh = True  # the receipt's GetAll
    run.change(RUNNING)
    run.systemd.exit(UNIT, 7)
    run.process.client_gone()
    run.systemd.hold_refresh = False
    run.systemd.answer_refreshes()
    run.systemd.release(UNIT)
    run.change(INACTIVE)
    assert run.calls("stop") == [("stop", UNIT)]
    run.assert_over("started")  # nothing more goes to a client gone


def test_a_client_gone_while_a_failure_is_confirmed_leaves_nothing():
    run = Run()
    run.systemd.hold_refresh = True  # the failure's confirming GetAll
    run.change({"ActiveState": "failed", "SubState": "failed", "Result": "resources"})
    run.process.client_gone()
    run.systemd.hold_refresh = False
    run.systemd.answer_refreshes()
    run.change(INACTIVE | {"ExecMainCode": 0, "ExecMainPID": 0})  # the reset's
    assert run.calls("reset") == [("reset", UNIT)]
    run.assert_over()


#: The unit's state as signalled before its start job ran: inactive.
BEFORE_ITS_RUN = {"ActiveState": "inactive", "SubState": "dead"}


@pytest.mark.parametrize(
    "seen",
    [
        # The Service interface's signal of its run came, the Unit's not:
        pytest.param({**BEFORE_ITS_RUN, "ExecMainPID": 4242}, id="its-pid-seen"),
        # Neither came yet; the Unit's last showed its start queued:
        pytest.param({**BEFORE_ITS_RUN, "Job": (1, "/job/1")}, id="its-start-queued"),
    ],
)
@ensureDeferred
async def test_an_eof_read_ahead_of_the_unit_s_signals_waits_for_its_end(seen):
    # A soak (review session 48): under a burst of starts, a client gone
    # before `started`, its command quick to exit (`exit 3`); the output's
    # EOF, which comes by its own socket, was read while the last state
    # the bus had brought was the one before the start, inactive. The
    # process was reaped then, and the unit, which failed next, was left
    # failed for good, no longer followed (`systemctl list-units` showed
    # it until a reset-failed by hand).
    run = Run()
    run.process.client_gone()
    run.change(seen)
    run.systemd.release(UNIT)  # it ran and ended: its fds are closed
    await until(lambda: run.process.output.eof, "the output's EOF")
    assert run.reaped == []  # its end is still to come
    failed = {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
    run.change({**failed, "Job": (0, "/"), "ExecMainPID": 4242, "ExecMainCode": 1,
                "ExecMainStatus": 3})  # fmt: skip
    assert run.calls("reset") == [("reset", UNIT)]
    run.change({"ActiveState": "inactive", "SubState": "dead"})  # the reset's
    run.assert_over()


# -- the start timeout while the unit is still starting -------------------------


def test_a_start_that_times_out_and_then_runs_is_stopped_and_reaped():
    run = Run(start_timeout=5)
    run.change({"ActiveState": "activating", "SubState": "start"})
    run.clock.advance(5)
    assert run.calls("stop") == [("stop", UNIT)]
    run.change(RUNNING)  # systemd ran it before the stop reached it
    run.systemd.exit(UNIT, signal=signal.SIGTERM)  # the stop's signal
    run.change(DEACTIVATING)
    run.systemd.release(UNIT)
    run.change(INACTIVE)
    run.assert_over(errno.ETIMEDOUT)


# -- the main process exiting while a stop is in flight -------------------------


def test_an_exit_during_the_service_s_stop_ends_the_stream_once():
    run = Run()
    run.change(RUNNING)
    run.process.cancel("the service is stopping")
    run.change(DEACTIVATING | {"ExecMainCode": 0})
    run.systemd.exit(UNIT, signal=signal.SIGTERM)
    run.systemd.release(UNIT)
    run.change(INACTIVE)
    run.assert_over("started", errno.ECANCELED)
    assert run.calls("stop") == [("stop", UNIT)]


def test_an_exit_racing_the_stop_timer_s_signal_ends_normally():
    run = Run()
    run.change(RUNNING)
    run.systemd.exit(UNIT, 0)
    run.change(DEACTIVATING)
    run.clock.advance(10)  # the stop timer signals what lingers
    assert run.systemd.kills() == [signal.SIGKILL]
    run.systemd.release(UNIT)
    run.change(INACTIVE)
    run.assert_over("started", "finished", errno.ENODATA)


# -- systemd's job failing ----------------------------------------------------


def test_a_stop_job_that_times_out_leaves_the_unit_failed_and_reset():
    # TimeoutStopSec: systemd SIGKILLs what is left and fails the unit
    # (Result=timeout) after the exit was reported: finished stands.
    run = Run()
    run.change(RUNNING)
    run.systemd.exit(UNIT, 3)
    run.change(DEACTIVATING)
    run.change({"ActiveState": "failed", "SubState": "failed", "Result": "timeout"})
    assert run.calls("reset") == [("reset", UNIT)]
    run.systemd.release(UNIT)
    run.change(INACTIVE)
    run.assert_over("started", "finished", errno.ENODATA)
    assert run.responder.responses[1]["status"] == 3 << 8


def test_a_stop_job_canceled_by_a_start_by_hand_ends_the_stream():
    # `systemctl start` on the unit while it stops: a new invocation.
    run = Run()
    run.change(RUNNING | {"InvocationID": b"\x01" * 16})
    run.systemd.exit(UNIT, 0)
    run.change(DEACTIVATING)
    run.change(RUNNING | {"InvocationID": b"\x02" * 16, "ExecMainPID": 99})
    assert run.responder.types()[:2] == ["started", "finished"]
    assert run.responder.types()[2] == errno.ESRCH
    run.assert_over("started", "finished", errno.ESRCH)


# -- signals out of order or coalesced ---------------------------------------


def test_an_exit_and_the_end_in_one_signal_still_sends_finished():
    run = Run()
    run.change(RUNNING)
    run.systemd.release(UNIT)
    run.change(INACTIVE | {"ExecMainStatus": 4})
    run.assert_over("started", "finished", errno.ENODATA)
    assert run.responder.responses[1]["status"] == 4 << 8


def test_a_start_run_and_end_coalesced_into_one_signal_sends_both():
    run = Run()
    run.systemd.release(UNIT)
    run.change(INACTIVE | {"ExecMainCode": 2, "ExecMainStatus": signal.SIGKILL})
    run.assert_over("started", "finished", errno.ENODATA)
    assert run.responder.responses[1]["status"] == signal.SIGKILL


def test_a_restart_by_hand_after_finished_ends_the_stream_once():
    run = Run()
    run.change(RUNNING | {"InvocationID": b"\x01" * 16})
    run.systemd.exit(UNIT, 0)
    run.change(INACTIVE)  # the restart's stop
    run.change(RUNNING | {"InvocationID": b"\x02" * 16, "ExecMainPID": 77})
    run.assert_over("started", "finished", errno.ENODATA)


# -- a manager reload while it runs -------------------------------------------


def test_a_manager_reload_while_it_runs_changes_nothing():
    run = Run()
    run.change(RUNNING)
    run.process.manager_reloading()
    run.systemd.end(UNIT, 0)
    run.assert_over("started", "finished", errno.ENODATA)


def test_a_manager_reload_between_start_and_started_changes_nothing():
    run = Run()
    run.process.manager_reloading()
    run.change(RUNNING)
    run.systemd.end(UNIT, 0)
    run.assert_over("started", "finished", errno.ENODATA)


# -- a job's time limit while its unit is still starting ---------------------


@pytest.fixture
def job_server():
    """A server on a Clock at test_jobs' START, over its TimedManager."""
    clock = Clock()
    clock.advance(START)
    systemd = TimedManager(clock)
    yield SdexecServer(systemd, parse_config({}), reactor, clock=clock), systemd, clock
    systemd.close()


def test_a_time_limit_passed_during_the_start_terminates_the_job_as_it_starts(
    job_server,
):
    server, systemd, clock = job_server
    responder = Recorder()
    server.exec(1, 1, job_payload(SDEXEC_TIME_LIMIT="1m"), responder)
    clock.advance(90)  # its start job waits (a slow mount, say)
    assert systemd.kills_at == []  # no process to signal yet
    systemd.run(JOB_UNIT, pid=77)
    clock.advance(0)  # the limit, passed, fires at once
    assert systemd.kills_at == [(90, "all", signal.SIGALRM)]
    systemd.exit(JOB_UNIT, signal=signal.SIGALRM)
    assert responder.responses[1] == {
        "type": "finished",
        "status": signal.SIGALRM,
        "terminated": "timeout",
    }


@ensureDeferred
async def test_a_time_limit_passed_during_a_start_that_never_comes_leaves_no_timer(
    job_server,
):
    server, systemd, clock = job_server
    responder = Recorder()
    server.exec(1, 1, job_payload(SDEXEC_TIME_LIMIT="1m"), responder)
    clock.advance(120)  # the start timeout
    assert systemd.kills_at == []
    systemd.release(JOB_UNIT)  # the stop cancelled its start job
    systemd.change(JOB_UNIT, INACTIVE | {"ExecMainCode": 0, "ExecMainPID": 0})
    await until(lambda: not server.processes, "reaped")
    assert responder.types() == [errno.ETIMEDOUT]  # once its unit is gone
    assert server.jobs.stats() == {}
    assert clock.getDelayedCalls() == []
