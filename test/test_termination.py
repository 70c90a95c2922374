"""The JOB TERMINATION schedule of flux-config-exec(5), driven on a Clock.

A recording target notes every action with the clock's time, so each test
compares the whole schedule with the one the spec spells out.
"""

from __future__ import annotations

import signal

import pytest
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs, formatEvent

from sdexec.config import ExecConfig, final_kill_attempt, parse_config
from sdexec.termination import (
    TerminationPolicy,
    TerminationReason,
    TerminationSequence,
    TerminationStep,
    parse_reason,
)

TERM, KILL, ALRM = signal.SIGTERM, signal.SIGKILL, signal.SIGALRM
CANCEL, TIMEOUT = TerminationReason.CANCEL, TerminationReason.TIMEOUT


class RecordingTarget:
    """Notes ``(time, action, argument)`` for every call."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls: list[tuple[float, str, object]] = []

    def signal_tasks(self, signum: int) -> None:
        self.calls.append((self.clock.seconds(), "tasks", signum))

    def signal_main(self, signum: int) -> None:
        self.calls.append((self.clock.seconds(), "main", signum))

    def unkillable(self, reason: str) -> None:
        self.calls.append((self.clock.seconds(), "unkillable", reason))

    def times(self, action: str) -> list[float]:
        return [at for at, what, _ in self.calls if what == action]


def started(policy: TerminationPolicy, reason=CANCEL, job="f2eA3mVhh"):
    clock = Clock()
    target = RecordingTarget(clock)
    sequence = TerminationSequence(clock, policy, target, job)
    assert sequence.begin(reason)
    return clock, target, sequence


def run_out(clock: Clock, sequence: TerminationSequence, limit: float = 10**6):
    """Advance the clock one pending call at a time until none is left."""
    while sequence.next_at is not None:
        assert sequence.next_at <= limit, "the sequence never ends"
        clock.advance(sequence.next_at - clock.seconds())


def test_spec_example_four_attempts_one_second():
    clock, target, sequence = started(
        TerminationPolicy(kill_timeout=1.0, max_kill_count=4)
    )
    run_out(clock, sequence)
    assert target.calls == [
        (0.0, "tasks", TERM),
        (1.0, "tasks", KILL),
        (2.0, "tasks", KILL),
        (3.0, "tasks", KILL),
        (4.0, "tasks", KILL),
        (5.0, "main", KILL),
        (6.0, "main", KILL),
        (8.0, "main", KILL),
        (12.0, "main", KILL),
        (12.0, "unkillable", "unkillable user processes for job f2eA3mVhh"),
    ]
    assert sequence.step is TerminationStep.UNKILLABLE
    assert sequence.kill_attempts == 4
    assert not sequence.active


def test_defaults_last_attempt_at_640_seconds():
    clock, target, sequence = started(TerminationPolicy())
    run_out(clock, sequence)
    # (5 * 5) + 5 + 10 + 20 + 40 + 80 + 160 + 300: the doubling is capped.
    assert target.times("main") == [25.0, 30.0, 40.0, 60.0, 100.0, 180.0, 340.0, 640.0]
    assert target.times("tasks") == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert target.times("unkillable") == [640.0]
    assert target.times("main")[-1] == ExecConfig().effective_max_kill_timeout


@pytest.mark.parametrize(
    ("kill_timeout", "count"), [(1.0, 4), (5.0, 8), (0.1, 3), (2.5, 12), (60.0, 20)]
)
def test_verdict_is_the_reported_effective_max_kill_timeout(kill_timeout, count):
    policy = TerminationPolicy(kill_timeout=kill_timeout, max_kill_count=count)
    clock, target, sequence = started(policy)
    run_out(clock, sequence)
    assert len(target.times("main")) == count
    assert target.times("unkillable") == [
        pytest.approx(final_kill_attempt(kill_timeout, count))
    ]


def test_max_kill_timeout_thirty_minutes_wins_over_count():
    policy = TerminationPolicy(max_kill_count=2, max_kill_timeout=1800.0)
    clock, target, sequence = started(policy)
    run_out(clock, sequence)
    attempts = target.times("main")
    # The backoff reaches its 300 s cap and keeps going until 30 minutes.
    assert attempts[:8] == [25.0, 30.0, 40.0, 60.0, 100.0, 180.0, 340.0, 640.0]
    assert attempts[8:] == [940.0, 1240.0, 1540.0]
    assert target.times("unkillable") == [1800.0]
    assert sequence.kill_attempts == 11


def test_max_kill_timeout_on_an_attempt_sends_it_then_gives_up():
    policy = TerminationPolicy(kill_timeout=1.0, max_kill_timeout=8.0)
    clock, target, sequence = started(policy)
    run_out(clock, sequence)
    assert target.times("main") == [5.0, 6.0, 8.0]
    assert target.calls[-1][:2] == (8.0, "unkillable")


def test_an_attempt_on_a_decimal_max_kill_timeout_is_sent():
    # 1.1 s summed drifted to 13.200000000000001: past a max-kill-timeout of
    # 13.2, that attempt was never sent.
    policy = TerminationPolicy(kill_timeout=1.1, max_kill_timeout=13.2)
    clock, target, sequence = started(policy)
    run_out(clock, sequence)
    assert target.times("main") == [5.5, 6.6, 8.8, 13.2]
    assert final_kill_attempt(1.1, 4) == 13.2


def test_the_first_attempt_on_a_decimal_max_kill_timeout_is_sent():
    # 5 x 0.14 is 0.7000000000000001: past a max-kill-timeout of 0.7 the
    # job was unkillable after no attempt at all.
    policy = TerminationPolicy(kill_timeout=0.14, max_kill_timeout=0.7)
    clock, target, sequence = started(policy)
    run_out(clock, sequence)
    assert target.times("main") == [0.7]
    assert final_kill_attempt(0.14, 1) == 0.7


@pytest.mark.parametrize("kill_timeout", [0.1, 1.1])
def test_a_task_kill_on_a_decimal_max_kill_timeout_is_sent(kill_timeout):
    # 3 x 0.1 is 0.30000000000000004 (3 x 1.1, 3.3000000000000003): past a
    # max-kill-timeout of 0.3 the third kill of the tasks was never sent.
    deadline = round(3 * kill_timeout, 9)
    policy = TerminationPolicy(kill_timeout=kill_timeout, max_kill_timeout=deadline)
    clock, target, sequence = started(policy)
    run_out(clock, sequence)
    expected = [0.0, kill_timeout, 2 * kill_timeout, deadline]
    assert target.times("tasks") == pytest.approx(expected)


def test_max_kill_timeout_before_the_shell_phase():
    policy = TerminationPolicy(kill_timeout=10.0, max_kill_timeout=25.0)
    clock, target, sequence = started(policy)
    run_out(clock, sequence)
    assert target.times("tasks") == [0.0, 10.0, 20.0]
    assert target.times("main") == []
    assert target.times("unkillable") == [25.0]


def test_timeout_sends_sigalrm_first():
    _, target, _ = started(TerminationPolicy(), reason=TIMEOUT)
    assert target.calls == [(0.0, "tasks", ALRM)]


def test_configured_signals_are_used():
    config = parse_config(
        {
            "exec": {
                "term-signal": "SIGUSR2",
                "kill-signal": "SIGINT",
                "kill-timeout": "2s",
                "max-kill-count": 1,
            }
        }
    ).exec
    clock, target, sequence = started(TerminationPolicy.from_config(config))
    run_out(clock, sequence)
    assert target.calls[:2] == [
        (0.0, "tasks", signal.SIGUSR2),
        (2.0, "tasks", signal.SIGINT),
    ]
    assert target.calls[-2:-1] == [(10.0, "main", signal.SIGINT)]
    # SIGALRM replaces term-signal on a timeout, configured or not.
    _, target, _ = started(TerminationPolicy.from_config(config), reason=TIMEOUT)
    assert target.calls == [(0.0, "tasks", ALRM)]


@pytest.mark.parametrize(
    ("exit_at", "step", "actions"),
    [
        (0.5, TerminationStep.TERM, 1),
        (2.5, TerminationStep.KILL_TASKS, 3),
        (7.0, TerminationStep.KILL_SHELL, 7),
    ],
)
def test_job_exiting_mid_sequence_ends_it(exit_at, step, actions):
    clock, target, sequence = started(
        TerminationPolicy(kill_timeout=1.0, max_kill_count=4)
    )
    clock.pump([0.5] * int(exit_at / 0.5))  # time as it passes, step by step
    assert sequence.step is step
    sequence.job_exited()
    assert sequence.step is TerminationStep.EXITED
    assert sequence.next_at is None and clock.getDelayedCalls() == []
    clock.advance(10**6)
    assert len(target.calls) == actions


def test_a_late_timer_runs_one_step_and_gives_the_next_its_time():
    # The schedule was counted from the beginning: a wake-up 700 s late (a
    # stalled reactor, a clock step) sent every kill-signal left and gave
    # the verdict in the same instant, the job no time to die.
    clock, target, sequence = started(
        TerminationPolicy(kill_timeout=1.0, max_kill_count=4)
    )
    clock.advance(700)
    assert [call[:2] for call in target.calls] == [(0.0, "tasks"), (700.0, "tasks")]
    assert sequence.next_at == 701.0
    run_out(clock, sequence)
    # Each step in turn, as it would have gone from the start (at most a
    # task kill and a shell attempt due together).
    times = [call[0] for call in target.calls]
    assert max(times.count(at) for at in times) <= 2
    assert times[-1] - 700 >= 10


def test_begin_twice_does_not_restart():
    clock, target, sequence = started(TerminationPolicy(kill_timeout=1.0))
    clock.advance(3)
    assert not sequence.begin(TIMEOUT)
    assert sequence.reason is CANCEL
    assert [call for call in target.calls if call[2] == ALRM] == []


def test_exit_before_begin_leaves_nothing_to_start():
    clock = Clock()
    sequence = TerminationSequence(
        clock, TerminationPolicy(), RecordingTarget(clock), "j"
    )
    sequence.job_exited()
    assert not sequence.begin(CANCEL)
    assert clock.getDelayedCalls() == []


def test_stats_of_a_job_that_exited_untouched_show_no_step():
    """``exited`` is the end of a sequence that ran: a job that was never
    terminated (listed in ``jobs`` while its unit stops) shows none."""
    clock = Clock()
    sequence = TerminationSequence(
        clock, TerminationPolicy(), RecordingTarget(clock), "j"
    )
    sequence.job_exited()
    assert sequence.stats()["step"] is None
    assert sequence.stats()["reason"] is None


def test_stats_show_step_attempts_and_next_time():
    clock = Clock()
    clock.advance(100)
    policy = TerminationPolicy(kill_timeout=1.0, max_kill_count=4)
    sequence = TerminationSequence(clock, policy, RecordingTarget(clock), "j")
    assert sequence.stats()["step"] is None
    sequence.begin(CANCEL)
    assert sequence.stats() == {
        "step": "term",
        "reason": "cancel",
        "started": 100.0,
        "task-kills": 0,
        "kill-attempts": 0,
        "next": 101.0,
    }
    clock.pump([0.5] * 10)
    assert sequence.stats() | {"started": None} == {
        "step": "kill-shell",
        "reason": "cancel",
        "started": None,
        "task-kills": 4,
        "kill-attempts": 1,
        "next": 106.0,
    }


def test_a_failing_signal_does_not_stop_the_schedule(logged_failures):
    clock = Clock()

    class Failing(RecordingTarget):
        def signal_tasks(self, signum: int) -> None:
            raise OSError("unit gone")

    target = Failing(clock)
    sequence = TerminationSequence(
        clock, TerminationPolicy(kill_timeout=1.0, max_kill_count=1), target, "j"
    )
    sequence.begin(CANCEL)
    run_out(clock, sequence)
    assert target.times("main") == [5.0]
    assert target.times("unkillable") == [5.0]
    # Each lost signal is a fault of the target's: logged with its traceback.
    failed = logged_failures.flush(OSError)
    assert failed and {f.getErrorMessage() for f in failed} == {"unit gone"}


def test_reason_from_a_request():
    assert parse_reason("cancel") is CANCEL
    assert parse_reason("timeout") is TIMEOUT
    for bad in ("kill", None, 1):
        with pytest.raises(
            ValueError, match=r'^reason: expected "cancel" or "timeout"'
        ):
            parse_reason(bad)


class ExitOnSignal(RecordingTarget):
    """A target that learns, while sending its ``nth`` signal, that the job
    has exited (as the service does when the exit was not reported)."""

    def __init__(self, clock: Clock, nth: int) -> None:
        super().__init__(clock)
        self.nth = nth
        self.sequence: TerminationSequence | None = None

    def _noted(self) -> None:
        if len(self.calls) == self.nth and self.sequence is not None:
            self.sequence.job_exited()

    def signal_tasks(self, signum: int) -> None:
        super().signal_tasks(signum)
        self._noted()

    def signal_main(self, signum: int) -> None:
        super().signal_main(signum)
        self._noted()


@pytest.mark.parametrize("nth", [1, 2, 5, 6, 7])
def test_an_exit_found_while_signalling_ends_the_sequence(nth):
    # nth 5 is the task kill at 20 s, 6 the first attempt at 25 s: a task
    # kill and an attempt share no time with the defaults, so one call each.
    clock = Clock()
    target = ExitOnSignal(clock, nth)
    sequence = TerminationSequence(clock, TerminationPolicy(), target, "f1")
    target.sequence = sequence
    sequence.begin(CANCEL)
    run_out(clock, sequence)
    assert len(target.calls) == nth
    assert sequence.step is TerminationStep.EXITED
    assert clock.getDelayedCalls() == []


def test_each_signal_is_logged_with_its_step_as_ps_names_it():
    with capturedLogs() as events:
        clock, _, _ = started(TerminationPolicy(kill_timeout=1.0), job="j1")
        clock.advance(1)
    logged = [formatEvent(e) for e in events if e["log_level"] == LogLevel.debug]
    assert logged == ["job j1: SIGTERM (term)", "job j1: SIGKILL (kill-tasks)"]


def test_the_verdict_under_max_kill_timeout_names_it_not_the_attempts():
    # Under a max-kill-timeout shorter than 5 x kill-timeout no direct
    # attempt is made, and the log said "unkillable after 0 kill attempts",
    # as if max-kill-count were 0: the limit that ran out is named.
    clock, _, sequence = started(
        TerminationPolicy(kill_timeout=1.0, max_kill_timeout=3.0), job="j1"
    )
    with capturedLogs() as events:
        run_out(clock, sequence)
    warned = [formatEvent(e) for e in events if e["log_level"] is LogLevel.warn]
    assert warned == [
        f"job j1: unkillable once max-kill-timeout (3s) ran out: {sequence.account()}"
    ]


def test_the_account_names_what_began_it_and_every_signal_tried():
    # The verdict's words beyond upstream's drain reason: what began the
    # termination, how long ago, and each signal, to whom, how often; a
    # terminate's re-sent step 1 (a time limit's SIGALRM during a cancel)
    # is counted with the rest. (The step at 1 s ran late, at 1.5 s: the
    # rest came as much later.)
    clock, _, sequence = started(TerminationPolicy(kill_timeout=1.0, max_kill_count=2))
    clock.advance(1.5)
    sequence.again(TIMEOUT)
    with capturedLogs() as events:
        run_out(clock, sequence)
    account = (
        "a cancel (sdexec.terminate) began its termination 6.5s ago; tried since:"
        " SIGTERM once to every process of its unit, SIGKILL 4 times to every"
        " process of its unit, SIGALRM once to every process of its unit,"
        " SIGKILL twice to its job shell (its main process)"
    )
    assert sequence.account() == account
    warned = [formatEvent(e) for e in events if e["log_level"] is LogLevel.warn]
    assert warned == [f"job f2eA3mVhh: unkillable after 2 kill attempts: {account}"]
