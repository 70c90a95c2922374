"""Log lines a client can cause come at a bounded rate (sdexec/lograte.py)."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock
from twisted.logger import Logger, LogLevel, formatEvent

from sdexec.lograte import BURST, MAX_QUOTED, WINDOW_S, LogRate


@pytest.fixture
def logged():
    """The lines logged, and a LogRate logging them on a Clock."""
    lines: list[tuple[LogLevel, str]] = []
    log = Logger(observer=lambda e: lines.append((e["log_level"], formatEvent(e))))
    clock = Clock()
    return lines, LogRate(log, clock), clock


def test_a_burst_is_logged_and_the_rest_summed_up_once_the_window_closes(logged):
    lines, rate, clock = logged
    for n in range(BURST + 500):
        rate.warn("refused", "refusing connection {n}", n=n)
    assert [text for _, text in lines] == [
        f"refusing connection {n}" for n in range(BURST)
    ]
    clock.advance(WINDOW_S)
    assert lines[-1] == (
        LogLevel.warn,
        f"500 more like it in {WINDOW_S:g} s not logged;"
        f" the last: refusing connection {BURST + 499}",
    )
    rate.warn("refused", "refusing connection {n}", n="again")
    assert lines[-1][1] == "refusing connection again"  # a new window


def test_each_kind_has_its_own_share(logged):
    lines, rate, _ = logged
    for _ in range(BURST):
        rate.warn("a", "a")
    rate.emit(LogLevel.info, "b", "b")
    assert len(lines) == BURST + 1


def test_a_window_with_nothing_suppressed_closes_silently(logged):
    lines, rate, clock = logged
    rate.warn("a", "a")
    # No timer: one for each line logged would outlive what it was about.
    assert clock.getDelayedCalls() == []
    clock.advance(WINDOW_S)
    assert lines == [(LogLevel.warn, "a")]
    for _ in range(BURST):
        rate.warn("a", "again")  # a new window, a burst of its own
    assert len(lines) == BURST + 1


def test_the_summary_comes_when_the_window_closes_not_later(logged):
    # The timer is armed at the first line held back, for what is left of
    # the window that began with the first line logged.
    lines, rate, clock = logged
    rate.warn("a", "a")
    clock.advance(WINDOW_S - 1)
    for _ in range(BURST):
        rate.warn("a", "a")
    clock.advance(1)
    assert lines[-1] == (
        LogLevel.warn,
        f"1 more like it in {WINDOW_S:g} s not logged; the last: a",
    )
    assert clock.getDelayedCalls() == []


def test_stop_says_what_was_suppressed_and_holds_nothing_back_after(logged):
    lines, rate, clock = logged
    for _ in range(BURST + 1):
        rate.emit(LogLevel.error, "a", "a")
    clock.advance(5)
    rate.stop()
    assert lines[-1] == (
        LogLevel.error,
        "1 more like it in 5 s not logged; the last: a",
    )
    for _ in range(BURST + 1):
        rate.warn("a", "after")
    assert lines[-1] == (LogLevel.warn, "after") and len(lines) == 2 * BURST + 2
    assert clock.getDelayedCalls() == []


def test_the_summary_quotes_the_last_line_cut_short(logged):
    lines, rate, clock = logged
    for _ in range(BURST + 1):
        rate.warn("a", "{what}", what="x" * 10**6)
    clock.advance(WINDOW_S)
    assert lines[-1][1].endswith("x" * MAX_QUOTED + "…")
    assert len(lines[-1][1]) < MAX_QUOTED + 100
