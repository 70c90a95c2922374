"""The stop timer of flux-config-exec(5) on a Clock, and the lifecycle
properties that keep systemd's defaults from pre-empting it (their effect on
a real unit is tested in test_systemd.py)."""

from __future__ import annotations

import errno
import signal

import pytest
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher

from sdexec.config import RESERVED_PROPERTIES
from sdexec.property import UINT64_MAX, typed_property
from sdexec.refusal import SHOWN, RequestRefused, quoted
from sdexec.testing import exec_plan
from sdexec.unitstop import (
    StopTimer,
    StopTimerState,
    abandon_reason,
    lifecycle_properties,
)

UNIT = "sdexec-0-f2eA3mVhh.service"


class RecordingTarget:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls: list[tuple[float, str, object]] = []

    def signal_all(self, signum: int) -> None:
        self.calls.append((self.clock.seconds(), "signal", signum))

    def abandon(self, reason: str) -> None:
        self.calls.append((self.clock.seconds(), "abandon", reason))


class Systemd:
    """Whether systemd is there, as the timer asks it."""

    def __init__(self) -> None:
        self.connected = True


def timer(seconds: float = 640.0, signum: int = signal.SIGUSR1, systemd=None):
    clock = Clock()
    target = RecordingTarget(clock)
    there = systemd or Systemd()
    stop = StopTimer(clock, seconds, signum, UNIT, target, lambda: there.connected)
    return clock, target, stop


def test_signal_after_one_period_abandon_after_two():
    clock, target, stop = timer()
    clock.advance(7)  # the unit ran for a while first
    stop.deactivating()
    assert stop.state is StopTimerState.ARMED and stop.next_at == 647.0
    clock.advance(640)
    assert target.calls == [(647.0, "signal", signal.SIGUSR1)]
    assert stop.state is StopTimerState.SIGNALED and stop.next_at == 1287.0
    clock.advance(640)
    assert target.calls[1:] == [
        (1287.0, "abandon", f"unkillable user processes in unit {UNIT}")
    ]
    assert stop.state is StopTimerState.ABANDONED
    assert clock.getDelayedCalls() == []


@pytest.mark.parametrize(("since", "signal_at"), [(90.0, 730.0), (-1000.0, 100.0)])
def test_a_period_counts_from_when_the_unit_began_deactivating(since, signal_at):
    clock, target, stop = timer()
    clock.advance(100)
    stop.deactivating(since)  # what is left of the period; none: at once
    clock.advance(signal_at - 100 - 0.1)
    assert target.calls == []
    clock.advance(0.1)
    assert target.calls == [(signal_at, "signal", signal.SIGUSR1)]
    assert stop.stats()["deactivating-since"] == since


@pytest.mark.parametrize(
    ("since", "signal_at", "said"), [(90.0, 730.0, "640s"), (-1000.0, 100.0, "1100s")]
)
def test_the_signal_is_logged_with_how_long_the_unit_has_deactivated(
    since, signal_at, said
):
    """A leftover found deactivating for longer than the period gets the
    signal at once: the log says how long it has been, not the period."""
    clock, _target, stop = timer()
    clock.advance(100)
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        stop.deactivating(since)
        clock.advance(signal_at - 100)  # (a Clock runs it at its new time)
    finally:
        globalLogPublisher.removeObserver(events.append)
    lines = [formatEvent(event) for event in events]
    assert f"{UNIT}: still deactivating after {said}, sending SIGUSR1" in lines


def test_a_unit_said_to_begin_deactivating_later_than_now_begins_now():
    clock, _target, stop = timer()
    clock.advance(100)
    stop.deactivating(150.0)  # a clock that is not systemd's
    assert stop.next_at == 740.0


@pytest.mark.parametrize("after", [0.0, 3.0, 639.9, 640.0, 1000.0])
def test_leaving_deactivating_ends_it(after):
    clock, target, stop = timer()
    stop.deactivating()
    clock.advance(after)
    stop.stopped()
    clock.advance(10**6)
    assert stop.state is StopTimerState.STOPPED
    assert [what for _, what, _ in target.calls] == (["signal"] if after >= 640 else [])
    assert clock.getDelayedCalls() == []


def test_a_retimed_first_period_counts_from_when_the_unit_began_deactivating():
    # A reload's shorter timer for a leftover already deactivating: its
    # signal went only at the end of the period it was found under.
    clock, target, stop = timer()
    stop.deactivating()
    clock.advance(20)
    stop.retime(30, signal.SIGKILL)
    clock.advance(9.9)
    assert target.calls == []
    clock.advance(0.1)
    assert target.calls == [(30.0, "signal", signal.SIGKILL)]
    clock.advance(30)
    assert target.calls[1:] == [(60.0, "abandon", abandon_reason(UNIT))]


def test_a_timer_retimed_before_deactivating_uses_its_new_period():
    clock, target, stop = timer()
    stop.retime(30, signal.SIGKILL)
    clock.advance(100)
    stop.deactivating()
    clock.advance(30)
    assert target.calls == [(130.0, "signal", signal.SIGKILL)]


def test_a_timer_whose_signal_went_is_not_retimed():
    clock, target, stop = timer(seconds=30)
    stop.deactivating()
    clock.advance(30)
    stop.retime(640, signal.SIGKILL)
    clock.advance(30)
    assert target.calls == [
        (30.0, "signal", signal.SIGUSR1),
        (60.0, "abandon", abandon_reason(UNIT)),
    ]


def test_deactivating_twice_does_not_rearm():
    clock, target, stop = timer(seconds=3)
    stop.deactivating()
    clock.advance(2)
    stop.deactivating()
    clock.advance(1)
    assert target.calls == [(3.0, "signal", signal.SIGUSR1)]


def test_abandoned_stays_abandoned():
    clock, _, stop = timer(seconds=1)
    stop.deactivating()
    clock.advance(1)
    clock.advance(1)
    stop.stopped()
    stop.deactivating()
    assert stop.state is StopTimerState.ABANDONED


def test_a_failing_signal_still_abandons_in_time(logged_failures):
    clock = Clock()

    class Failing(RecordingTarget):
        def signal_all(self, signum: int) -> None:
            raise OSError("bus gone")

    target = Failing(clock)
    stop = StopTimer(clock, 5, signal.SIGKILL, UNIT, target, lambda: True)
    stop.deactivating()
    clock.advance(5)
    clock.advance(5)
    assert [what for _, what, _ in target.calls] == ["abandon"]
    (failure,) = logged_failures.flush(OSError)  # the target's fault, logged
    assert failure.getErrorMessage() == "bus gone"


def test_stats():
    clock, _, stop = timer(seconds=3)
    assert stop.stats() == {"state": "idle", "deactivating-since": None, "next": None}
    clock.advance(1)
    stop.deactivating()
    assert stop.stats() == {"state": "armed", "deactivating-since": 1.0, "next": 4.0}


def test_lifecycle_properties_are_reserved_and_typed():
    properties = lifecycle_properties()
    assert set(properties) <= RESERVED_PROPERTIES
    typed = {name: typed_property(name, value) for name, value in properties.items()}
    assert typed["TimeoutStopUSec"].value == UINT64_MAX
    assert typed["SendSIGKILL"].value is False
    assert typed["KillMode"].value == "control-group"


def test_every_plan_carries_the_lifecycle_properties_last():
    plan = exec_plan()
    sent = {prop.name: prop for prop in plan.properties}
    for name, text in lifecycle_properties().items():
        expected = typed_property(name, text, "sdexec")
        assert (sent[name].value, sent[name].source) == (expected.value, "sdexec")
    assert list(sent)[-3:] == list(lifecycle_properties())


@pytest.mark.parametrize("name", sorted(lifecycle_properties()))
def test_a_request_may_not_set_them(name):
    with pytest.raises(RequestRefused) as refused:
        exec_plan(**{f"SDEXEC_PROP_{name}": "5"})
    assert refused.value.errnum == errno.EPERM
    # The request-property policy refuses them (sdexec/policy.py).
    assert refused.value.errstr.startswith(
        f"SDEXEC_PROP_{name}: a request can never set {name}: lifecycle"
    )


@pytest.mark.parametrize("spelling", ["5", "+5", " 5", "\t\n\v\f\r5", " +05"])
def test_the_request_s_timer_is_read_as_flux_reads_it(spelling):
    # Flux's sdexec reads SDEXEC_STOP_TIMER_SEC with strtol in base 10
    # (sdexec.c, get_dict_int): C's white space and a sign before the
    # digits. docs/protocol.md said ASCII digits.
    assert exec_plan(SDEXEC_STOP_TIMER_SEC=spelling).stop_timer.seconds == 5


@pytest.mark.parametrize(
    "spelling",
    ["5 ", "5\n", "\xa05", "\u20035", "", " ", "+", "1_0", "\uff15", "5s", "0x5"],
)
def test_a_request_s_timer_that_strtol_would_not_read_whole_is_refused(spelling):
    # Trailing white space, and Unicode's before the digits, were taken as
    # 5 where Flux's sdexec reads no number (and keeps its default).
    with pytest.raises(RequestRefused) as refused:
        exec_plan(SDEXEC_STOP_TIMER_SEC=spelling)
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EINVAL,
        f"SDEXEC_STOP_TIMER_SEC: {quoted(spelling, SHOWN)} is not a decimal integer",
    )


def test_a_period_that_runs_out_while_systemd_is_away_waits_for_it():
    # Its signal could not go out (KillUnit fails at once while systemd is
    # away), yet the unit was abandoned a period later: EDEADLK, and the
    # node drained for processes nothing had signalled.
    systemd = Systemd()
    clock, target, stop = timer(seconds=30, systemd=systemd)
    stop.deactivating()
    clock.advance(29)
    systemd.connected = False  # a daemon-reexec
    clock.advance(1)
    assert (stop.state, target.calls) == (StopTimerState.HELD, [])
    clock.advance(300)
    assert target.calls == []  # no verdict while it is away
    systemd.connected = True
    stop.systemd_restored(back_at=330)  # the unit read again: deactivating
    assert target.calls == [(330, "signal", signal.SIGUSR1)]
    clock.advance(30)
    assert target.calls[1:] == [(360, "abandon", abandon_reason(UNIT))]


def test_a_signal_an_outage_may_have_taken_is_sent_again_and_the_period_restarts():
    systemd = Systemd()
    clock, target, stop = timer(seconds=30, systemd=systemd)
    stop.deactivating()
    clock.advance(30)  # signalled; then systemd goes and comes back
    clock.advance(10)
    stop.systemd_restored(back_at=38)
    assert target.calls == [
        (30, "signal", signal.SIGUSR1),
        (40, "signal", signal.SIGUSR1),
    ]
    clock.advance(29)
    assert stop.state is StopTimerState.SIGNALED
    clock.advance(1)
    assert target.calls[2:] == [(70, "abandon", abandon_reason(UNIT))]


def test_returns_of_systemd_put_the_verdict_off_once():
    # A systemd that left and came back every 20 s (a manager re-executed
    # in a loop, a bus restarting) restarted the second period at each
    # return: a unit whose leftovers ignore the signal was never abandoned,
    # and the node never drained. As a job's step 1 (docs/termination.md),
    # the verdict is put off once.
    clock, target, stop = timer(seconds=30)
    stop.deactivating()
    clock.advance(30)  # signalled
    for back_at in (50, 70, 90, 110):
        clock.pump([1.0] * int(back_at - clock.seconds()))
        stop.systemd_restored(back_at=back_at - 1)
    assert target.calls == [
        (30, "signal", signal.SIGUSR1),
        (50, "signal", signal.SIGUSR1),  # may have been lost: sent again
        (80, "abandon", abandon_reason(UNIT)),  # a period after it
    ]
    assert stop.state is StopTimerState.ABANDONED


def test_a_held_verdict_puts_it_off_once_too():
    # The period ran out while systemd was away: the signal goes at its
    # return, and a later return does not put the verdict off again.
    systemd = Systemd()
    clock, target, stop = timer(seconds=30, systemd=systemd)
    stop.deactivating()
    clock.advance(30)
    systemd.connected = False
    clock.advance(30)  # held
    systemd.connected = True
    stop.systemd_restored(back_at=60)
    clock.advance(20)
    stop.systemd_restored(back_at=84)
    clock.advance(10)
    assert target.calls == [
        (30, "signal", signal.SIGUSR1),
        (60, "signal", signal.SIGUSR1),
        (90, "abandon", abandon_reason(UNIT)),
    ]


def test_a_signal_sent_since_systemd_came_back_is_not_sent_again():
    # The first period ran out between the return and the unit's re-read:
    # the signal went out then, with systemd there; it went twice.
    clock, target, stop = timer(seconds=30)
    stop.deactivating()
    clock.advance(30)
    stop.systemd_restored(back_at=29)
    assert target.calls == [(30, "signal", signal.SIGUSR1)]
    clock.advance(30)
    assert target.calls[1:] == [(60, "abandon", abandon_reason(UNIT))]


def test_a_unit_that_stopped_while_systemd_was_away_is_not_abandoned():
    systemd = Systemd()
    clock, target, stop = timer(seconds=30, systemd=systemd)
    stop.deactivating()
    systemd.connected = False
    clock.advance(120)  # both periods would have run out
    systemd.connected = True
    stop.follow(False)  # read again: it is inactive
    stop.systemd_restored(back_at=120)
    assert (stop.state, target.calls) == (StopTimerState.STOPPED, [])


def test_the_account_says_how_long_it_deactivated_and_what_was_tried():
    # The client's EDEADLK says it (the drain keeps the short reason): how
    # long since the stop, the stop-timer signal, how often (again after
    # an outage that may have taken it) and how long ago.
    systemd = Systemd()
    clock, _, stop = timer(seconds=30, systemd=systemd)
    stop.deactivating(since=-5)
    assert stop.account() == (
        "still deactivating 5s after its stop signalled every process left in it"
    )
    clock.advance(25)  # signalled; then systemd goes and comes back
    clock.advance(10)
    stop.systemd_restored(back_at=33)
    clock.advance(30)
    assert stop.state is StopTimerState.ABANDONED
    assert stop.account() == (
        "still deactivating 70s after its stop signalled every process left"
        " in it; tried since: SIGUSR1 twice to them, 30s ago"
    )


@pytest.mark.parametrize("spelling", ["10", "+10", " 10", "\t+010", "USR1", "SIGUSR1"])
def test_the_request_s_signal_is_read_as_flux_reads_a_number(spelling):
    # Flux's sdexec reads SDEXEC_STOP_TIMER_SIGNAL as it reads the timer
    # (strtol in base 10); a name is sdexec's own. "+10" was refused here.
    # (The default configuration's signal is SIGUSR1, the only one a
    # request may name.)
    plan = exec_plan(SDEXEC_STOP_TIMER_SIGNAL=spelling)
    assert plan.stop_timer.signal == signal.SIGUSR1


@pytest.mark.parametrize("spelling", ["10 ", "10\n", " USR1", "USR1\t"])
def test_a_request_s_signal_with_white_space_after_it_is_refused(spelling):
    # Flux's sdexec reads no number in "10 " (strtol stops before the
    # space); it was 10 here, and so was a name with white space around it.
    with pytest.raises(RequestRefused) as refused:
        exec_plan(SDEXEC_STOP_TIMER_SIGNAL=spelling)
    assert refused.value.errnum == errno.EINVAL
    assert refused.value.errstr.startswith(
        f"SDEXEC_STOP_TIMER_SIGNAL: {quoted(spelling, SHOWN)} is not a signal"
    )
