"""The window of calls to the manager, offline: bounded, in order, every
call answered, a full window never a failure."""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from sdexec.systemd.window import CallWindow, CallWithdrawn


class Calls:
    """Calls whose answers the test gives, in the order they were started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.pending: dict[str, Deferred[str]] = {}

    def start(self, name: str):
        def call() -> Deferred[str]:
            self.started.append(name)
            self.pending[name] = Deferred()
            return self.pending[name]

        return call

    def answer(self, name: str) -> None:
        self.pending.pop(name).callback(f"{name} done")


def test_no_more_than_the_limit_in_flight_and_the_rest_in_order():
    window, calls = CallWindow(2), Calls()
    results = [window.submit(calls.start(str(n))) for n in range(5)]
    assert calls.started == ["0", "1"]
    assert (window.in_flight, window.queued) == (2, 3)
    calls.answer("1")
    assert calls.started == ["0", "1", "2"]
    assert results[1].result == "1 done"
    for name in ("0", "2", "3", "4"):
        calls.answer(name)
    assert calls.started == ["0", "1", "2", "3", "4"]
    assert [r.result for r in results] == [f"{n} done" for n in range(5)]
    assert (window.in_flight, window.queued) == (0, 0)


def test_a_failed_call_frees_its_slot_and_fails_only_its_caller():
    window, calls = CallWindow(1), Calls()
    failing = window.submit(lambda: fail(ValueError("refused")))
    after = window.submit(calls.start("next"))
    errors: list[Failure] = []
    failing.addErrback(errors.append)
    assert errors[0].check(ValueError)
    assert calls.started == ["next"]
    calls.answer("next")
    assert after.result == "next done"


def test_a_call_that_raises_is_a_failure_not_a_stuck_slot():
    window = CallWindow(1)

    def broken() -> Deferred[str]:
        raise RuntimeError("no bus")

    errors: list[Failure] = []
    window.submit(broken).addErrback(errors.append)
    assert errors[0].check(RuntimeError)
    assert window.submit(lambda: succeed("ok")).result == "ok"
    assert window.in_flight == 0


def test_a_call_withdrawn_as_its_turn_comes_takes_no_slot_and_is_no_answer():
    # A start whose user a reload revoked while it waited: never made, it
    # must neither hold a slot nor pass for a sign of the manager's life.
    window, calls = CallWindow(1), Calls()
    window.submit(calls.start("first"))

    def withdrawn() -> Deferred[str]:
        raise CallWithdrawn("no longer wanted")

    errors: list[Failure] = []
    window.submit(withdrawn).addErrback(errors.append)
    after = window.submit(calls.start("after"))
    calls.answer("first")
    assert [str(error.value) for error in errors] == ["no longer wanted"]
    assert calls.started == ["first", "after"]
    assert (window.in_flight, window.completed) == (1, 1)
    calls.answer("after")
    assert after.result == "after done"


def test_a_call_whose_start_fails_is_no_answer_and_the_next_goes():
    # A call that failed before it was sent is no sign of the manager's
    # life: counted as answered, it passed for a shutdown's progress.
    window, calls = CallWindow(1), Calls()

    def broken() -> Deferred[str]:
        raise ValueError("not sendable")

    errors: list[Failure] = []
    window.submit(broken).addErrback(errors.append)
    after = window.submit(calls.start("after"))
    assert [str(error.value) for error in errors] == ["not sendable"]
    assert calls.started == ["after"]
    assert (window.in_flight, window.completed) == (1, 0)
    calls.answer("after")
    assert (after.result, window.completed) == ("after done", 1)


def test_calls_answered_at_once_run_in_order_without_recursion():
    window = CallWindow(1)
    order: list[int] = []
    blocker: Deferred[None] = Deferred()
    window.submit(lambda: blocker)
    for n in range(5000):  # deeper than Python's recursion limit
        window.submit(lambda n=n: succeed(n)).addCallback(order.append)
    blocker.callback(None)
    assert order == list(range(5000))


def test_a_caller_submitting_from_its_callback_queues_behind_the_others():
    window, calls = CallWindow(1), Calls()
    first = window.submit(calls.start("first"))
    window.submit(calls.start("second"))
    first.addCallback(lambda _: window.submit(calls.start("third")))
    calls.answer("first")
    calls.answer("second")
    assert calls.started == ["first", "second", "third"]


def test_fail_queued_fails_what_has_not_started():
    window, calls = CallWindow(1), Calls()
    running = window.submit(calls.start("running"))
    queued = window.submit(calls.start("queued"))
    errors: list[Failure] = []
    queued.addErrback(errors.append)
    window.fail_queued(Failure(ConnectionError("bus lost")))
    assert errors[0].check(ConnectionError)
    assert calls.started == ["running"]
    calls.answer("running")
    assert running.result == "running done"


def test_a_raised_limit_starts_what_it_makes_room_for_at_once():
    # A reload raising [systemd] max-inflight used to wait for the next
    # call asked for or answered.
    window, calls = CallWindow(1), Calls()
    for n in range(4):
        window.submit(calls.start(str(n)))
    window.limit = 3
    assert calls.started == ["0", "1", "2"]
    window.limit = 1  # lowered: nothing in flight is touched
    calls.answer("0")
    assert calls.started == ["0", "1", "2"]


# -- lanes: one user's burst does not hold another's calls ---------------------


def test_lanes_take_turns_and_each_keeps_its_order():
    # One queue for everyone held the owner's start behind a listed user's
    # 496 queued starts; lanes in turn hold it behind one of them.
    window, calls = CallWindow(1), Calls()
    blocker = window.submit(calls.start("blocker"), "user")
    for n in range(4):
        window.submit(calls.start(f"user {n}"), "user")
    window.submit(calls.start("owner 0"), "owner")
    window.submit(calls.start("owner 1"), "owner")
    window.submit(calls.start("service 0"))
    assert (window.queued, window.queued_in("user"), window.queued_in("owner")) == (
        7,
        4,
        2,
    )
    for name in ["blocker", "user 0", "owner 0", "service 0", "user 1", "owner 1"]:
        calls.answer(name)
    assert calls.started == [
        "blocker",
        "user 0",
        "owner 0",
        "service 0",
        "user 1",
        "owner 1",
        "user 2",
    ]
    assert blocker.result == "blocker done"


def test_a_lane_with_nothing_waiting_is_forgotten():
    # A lane per uid: one kept for every uid that ever called would grow
    # with the uids, as the counts per uid once did (shares.count_off).
    window, calls = CallWindow(1), Calls()
    window.submit(calls.start("first"), 1001)
    window.submit(calls.start("second"), 1001)
    window.submit(calls.start("third"), 1002)
    for name in ("first", "second", "third"):
        calls.answer(name)
    assert (window.queued, window.queued_in(1001), window.queued_in(1002)) == (0, 0, 0)
    assert window._lanes == {} and window._units == {}


def test_a_unit_s_calls_stay_in_order_whatever_lane_a_later_one_names():
    # A unit's start queued in its user's lane, then its stop asked for in
    # the service's lane (its process untabled meanwhile): were the stop
    # served in its own lane's turn, it could reach systemd before the
    # start, which would then run a unit nobody stops.
    window, calls = CallWindow(1), Calls()
    window.submit(calls.start("blocker"), "user")
    window.submit(calls.start("user burst"), "user")
    window.submit(calls.start("start u"), "user", unit="u")
    window.submit(calls.start("stop u"), "service", unit="u")
    window.submit(calls.start("service other"), "service", unit="v")
    assert window.queued_in("user") == 3
    for name in ["blocker", "user burst", "service other", "start u"]:
        calls.answer(name)
    assert calls.started == [
        "blocker",
        "user burst",
        "service other",  # the service's lane's turn: not u's stop
        "start u",
        "stop u",
    ]


def test_a_unit_s_next_call_takes_the_lane_named_once_none_waits():
    window, calls = CallWindow(1), Calls()
    window.submit(calls.start("blocker"))
    window.submit(calls.start("start u"), "user", unit="u")
    calls.answer("blocker")  # the start leaves: nothing of u waits
    window.submit(calls.start("stop u"), "service", unit="u")
    assert (window.queued_in("service"), window.queued_in("user")) == (1, 0)


def test_fail_queued_fails_every_lane_s_calls_and_forgets_their_units():
    window, calls = CallWindow(1), Calls()
    window.submit(calls.start("running"), "user")
    queued = [
        window.submit(calls.start("a"), "user", unit="u"),
        window.submit(calls.start("b"), "owner", unit="v"),
    ]
    errors: list[Failure] = []
    for result in queued:
        result.addErrback(errors.append)
    window.fail_queued(Failure(ConnectionError("bus lost")))
    assert len(errors) == 2 and window.queued == 0
    window.submit(calls.start("stop u"), "service", unit="u")
    assert window.queued_in("service") == 1  # u's old lane is forgotten
