"""A job's time limit from R or an FSD, the start-delay extension, and the
timer, on a Clock."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from sdexec.joblimit import (
    TimeLimit,
    effective_expiration,
    job_expiration,
    parse_time_limit,
)
from sdexec.rset import ResourceSet

PERCENT = 25.0  # the default max-start-delay-percent


def rset(starttime: float | None, expiration: float | None) -> ResourceSet:
    execution: dict = {"R_lite": [{"rank": "0", "children": {"core": "0"}}]}
    if starttime is not None:
        execution["starttime"] = starttime
    if expiration is not None:
        execution["expiration"] = expiration
    return ResourceSet({"version": 1, "execution": execution})


@pytest.mark.parametrize(
    ("received_at", "expected"),
    [
        (1000.0, 1100.0),  # no delay
        (1025.0, 1100.0),  # 25 s late on a 100 s job: exactly the allowance
        (1025.5, 1125.5),  # beyond it: extended by the whole delay
        (1090.0, 1190.0),
        (990.0, 1100.0),  # received "before" the start (clock skew)
    ],
)
def test_start_delay_extension(received_at, expected):
    assert effective_expiration(rset(1000.0, 1100.0), received_at, PERCENT) == expected


def test_long_job_is_not_extended_by_a_small_delay():
    # A 10 h job received 5 min late: under 25 %, the allocation stands.
    assert effective_expiration(rset(0.5, 36000.5), 300.5, PERCENT) == 36000.5


def test_zero_percent_extends_any_delay():
    assert effective_expiration(rset(1000.0, 1100.0), 1001.0, 0.0) == 1101.0


@pytest.mark.parametrize(
    ("received_at", "expected"),
    [
        (1001.0, 1101.0),  # any delay is beyond a negative percent
        (1000.0, 1100.0),
        # Flux's job-exec would move it to 1090 (-10 % > -50 %): a request
        # received "before" the start never shortens the job here.
        (990.0, 1100.0),
    ],
)
def test_negative_percent_extends_any_delay_never_shortens(received_at, expected):
    assert effective_expiration(rset(1000.0, 1100.0), received_at, -50.0) == expected


@pytest.mark.parametrize(("start", "expiration"), [(1000.0, 0), (None, None), (0, 0)])
def test_no_expiration_is_unlimited(start, expiration):
    assert effective_expiration(rset(start, expiration), 5000.0, PERCENT) is None


def test_no_starttime_means_no_extension():
    assert effective_expiration(rset(None, 1100.0), 5000.0, PERCENT) == 1100.0


@pytest.mark.parametrize(
    ("start", "expiration", "message"),
    [
        (1000.0, -5.0, "R: execution.expiration: negative"),
        (1000.0, 900.0, "R: execution.expiration: 900.0 is before"),
    ],
)
def test_impossible_times_name_the_field(start, expiration, message):
    with pytest.raises(ValueError, match=message):
        effective_expiration(rset(start, expiration), 1000.0, PERCENT)


def test_fsd_limit():
    assert parse_time_limit("30m") == 1800.0
    assert parse_time_limit("0") is None
    assert job_expiration(100.0, PERCENT, time_limit="1h") == 3700.0


@pytest.mark.parametrize("bad", ["5x", "-1s", "inf", ""])
def test_bad_fsd_names_the_option(bad):
    with pytest.raises(ValueError, match=r"^SDEXEC_TIME_LIMIT: "):
        parse_time_limit(bad)


def test_earlier_of_r_and_fsd_wins():
    r = rset(1000.0, 1100.0)
    assert job_expiration(1000.0, PERCENT, r, "10s") == 1010.0
    assert job_expiration(1000.0, PERCENT, r, "1h") == 1100.0
    assert job_expiration(1000.0, PERCENT, r, "0") == 1100.0
    assert job_expiration(1000.0, PERCENT) is None


def test_timer_fires_once_at_expiration():
    clock, fired = Clock(), []
    clock.advance(1000)
    limit = TimeLimit(clock, 1100.0, lambda: fired.append(clock.seconds()))
    clock.advance(60)
    assert limit.active
    clock.advance(40)
    assert fired == [1100.0] and not limit.active
    clock.advance(1000)
    assert fired == [1100.0]


def test_timer_past_expiration_fires_at_once():
    clock, fired = Clock(), []
    clock.advance(2000)
    TimeLimit(clock, 1100.0, lambda: fired.append(clock.seconds()))
    clock.advance(0)
    assert fired == [2000.0]


def test_cancelled_timer_never_fires():
    clock, fired = Clock(), []
    limit = TimeLimit(clock, 10.0, lambda: fired.append(True))
    limit.cancel()
    limit.cancel()
    clock.advance(100)
    assert fired == [] and clock.getDelayedCalls() == []
