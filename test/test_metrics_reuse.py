"""``/metrics`` answers given again as ``/stats``' are: a Clock says when,
a thread pool the test runs by hand says when a rendering ends, and a
timer that counts says what one cost (review session 43 M5-1: every scrape
rendered anew, 2-4 ms holding the GIL, and a local user scraping in a loop
slowed every exec start)."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.test.requesthelper import DummyRequest

from sdexec.metrics import KEPT_ANSWERS, Metrics
from sdexec.stats import MAX_REUSE_S, STATS_SHARE, RecentByKey, _Kept

STATS = {
    "requests": {"sdexec.exec": 3},
    "procs": [],
    "users": {"users": {}},
    "drain": {"drained": False, "reason": None, "causes": []},
    "systemd": {
        "connected": True,
        "calls": {"unanswered": 0, "queued": 0, "oldest": None},
    },
}
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class HeldPool(Clock):
    """A Clock as the metrics' reactor, whose thread pool holds its work
    until :meth:`finish` runs it here."""

    def __init__(self) -> None:
        super().__init__()
        self.work: list[tuple[Callable, Callable, tuple]] = []

    def getThreadPool(self) -> HeldPool:
        return self

    def callInThreadWithCallback(self, on_result, func, *args) -> None:
        self.work.append((on_result, func, args))

    def callFromThread(self, func, *args) -> None:
        func(*args)

    def finish(self) -> None:
        while self.work:
            on_result, func, args = self.work.pop(0)
            on_result(True, func(*args))


class Ticks:
    """A timer by which everything costs ``tick`` seconds."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture
def page():
    """``/metrics`` of a registry rendered in a :class:`HeldPool`, where a
    snapshot and a rendering cost 10 ms each: the page, and the pool."""
    pool = HeldPool()
    metrics = Metrics(pool, lambda: STATS, cost_timer=Ticks(0.01))
    return metrics.resource(), pool


def scrape(resource, accept: str = "", gzipped: bool = False, names=()) -> Any:
    """A GET of ``/metrics``: its DummyRequest (``written``, ``finished``)."""
    request = DummyRequest([b""])
    if accept:
        request.requestHeaders.addRawHeader(b"accept", accept.encode())
    if gzipped:
        request.requestHeaders.addRawHeader(b"accept-encoding", b"gzip")
    request.args = {b"name[]": [name.encode() for name in names]} if names else {}
    resource.render_GET(request)
    return request


def test_a_scrape_while_one_renders_waits_for_that_rendering(page):
    resource, pool = page
    first, second = scrape(resource), scrape(resource)
    assert len(pool.work) == 1  # one rendering for both
    assert (first.finished, second.finished) == (0, 0)
    pool.finish()
    assert first.finished == second.finished == 1
    assert first.written == second.written
    assert b'sdexec_requests_total{topic="sdexec.exec"} 3.0' in b"".join(first.written)


def test_a_rendered_answer_is_given_again_for_ten_times_its_cost(page):
    resource, pool = page
    scrape(resource)
    pool.finish()
    # Its snapshot and its rendering cost 10 ms each: given again for 200 ms.
    pool.advance(0.02 / STATS_SHARE - 0.001)
    again = scrape(resource)
    assert pool.work == [] and again.finished == 1
    pool.advance(0.002)
    scrape(resource)
    assert len(pool.work) == 1


def test_each_format_gzip_and_selection_has_its_own_answer(page):
    resource, pool = page
    plain = scrape(resource)
    asked = [
        scrape(resource, accept=OPENMETRICS),
        scrape(resource, gzipped=True),
        scrape(resource, names=["sdexec_drained"]),
    ]
    render_all(pool)
    plain_text = b"".join(plain.written)
    openmetrics, gzipped, selected = (b"".join(r.written) for r in asked)
    assert openmetrics.endswith(b"# EOF\n") and not plain_text.endswith(b"# EOF\n")
    # Each is a rendering of its own: the service's own process_* samples
    # (CPU seconds, memory) may move between them; every other line is the
    # one snapshot's.
    assert without_process_samples(gzip.decompress(gzipped)) == (
        without_process_samples(plain_text)
    )
    assert selected.startswith(b"# HELP sdexec_drained ")
    assert b"sdexec_requests_total" not in selected


def without_process_samples(page: bytes) -> bytes:
    """``page`` without the sample lines of the ``process_*`` families."""
    return b"".join(
        line
        for line in page.splitlines(keepends=True)
        if not line.startswith(b"process_")
    )


def render_all(pool: HeldPool) -> int:
    """Render every answer asked for, each in its turn; how many."""
    rendered = 0
    while pool.work or pool.getDelayedCalls():
        rendered += len(pool.work)
        pool.finish()
        pool.advance(MAX_REUSE_S)
    return rendered


def test_new_answers_are_made_one_at_a_time_after_the_last_one_s_rest(page):
    # Review session 46: the format and the selection are the client's
    # choice, and one new in each request (Accept: ...; version=2.N) had
    # every scrape rendered anew: 6 times the service's time of one given
    # again, and a list's answer 50 times slower under 4 such loops.
    resource, pool = page
    asked = [scrape(resource, accept=f"{OPENMETRICS[:-5]}2.{n}") for n in range(3)]
    assert len(pool.work) == 1
    pool.finish()
    assert [request.finished for request in asked] == [1, 0, 0]
    # A snapshot and a rendering of 10 ms each: the next waits 200 ms.
    pool.advance(0.02 / STATS_SHARE - 0.001)
    assert pool.work == []
    pool.advance(0.002)
    assert len(pool.work) == 1
    render_all(pool)
    assert [request.finished for request in asked] == [1, 1, 1]


def test_a_scrape_whose_client_left_is_not_rendered(page):
    resource, pool = page
    scrape(resource)
    left = scrape(resource, accept=OPENMETRICS)
    left.processingFailed(Failure(ConnectionDone()))
    assert render_all(pool) == 1  # the first; not the one that left
    assert left.written == []


def test_a_stopped_page_leaves_no_timer(page):
    resource, pool = page
    scrape(resource)
    pool.finish()
    scrape(resource, accept=OPENMETRICS)
    assert pool.getDelayedCalls()  # its turn, after the first one's rest
    resource._metrics.stop()
    assert pool.getDelayedCalls() == []
    assert pool.work == []


def test_requests_that_ask_the_same_share_an_answer(page):
    # prometheus-client makes a new encoder at each choice, never equal to
    # the last: a key holding it would never be found again.
    resource, pool = page
    scrape(resource, accept=OPENMETRICS, names=["b", "a"])
    scrape(resource, accept=OPENMETRICS + ", text/plain;q=0.5", names=["a", "b", "a"])
    assert len(pool.work) == 1


def test_a_failed_rendering_fails_its_waiters_and_is_not_kept():
    made: list[Deferred] = []

    def produce(key: str) -> Deferred:
        made.append(Deferred())
        return made[-1]

    answers: RecentByKey[str, str] = RecentByKey(produce, Clock(), capacity=2)
    outcomes: list = []
    for _ in range(2):
        answers.get("a").addBoth(outcomes.append)
    made[0].errback(RuntimeError("broken collector"))
    assert [type(outcome) for outcome in outcomes] == [Failure, Failure]
    answers.get("a")
    assert len(made) == 2  # tried again


def test_the_answers_kept_are_those_of_the_newest_keys():
    # name[] is the client's choice: a loop of new selections must not
    # keep an answer for each.
    kept: _Kept[int, str] = _Kept(Clock(), KEPT_ANSWERS)
    for key in range(KEPT_ANSWERS + 1):
        kept.keep(key, f"answer {key}", MAX_REUSE_S)
    assert kept.get(0) is None  # the oldest went
    assert [kept.get(key) for key in (1, KEPT_ANSWERS)] == [
        "answer 1",
        f"answer {KEPT_ANSWERS}",
    ]
