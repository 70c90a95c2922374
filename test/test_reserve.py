"""A connection's place in the owner's reserve (sdexec/reserve.py), on a
Clock, held by a recording :class:`~sdexec.reserve.ReserveHolder` (the
connections themselves: test_hostile.py, test_reload_request.py)."""

from __future__ import annotations

from twisted.internet.task import Clock

from sdexec.admission import RESERVE_IDLE_SECONDS, ConnectionCount
from sdexec.reserve import ReservePlace

OWNER = 1000


class Holder:
    """A connection holding a place, recording what the place asks."""

    def __init__(self) -> None:
        self.answering = False
        self.asked: list[tuple] = []
        self.place: ReservePlace | None = None

    def close_reserved(self, refusal: str, message: dict | None) -> None:
        self.asked.append(("close", message))
        assert self.place is not None
        self.place.closing()  # as the connection's close tells it

    def abort(self) -> None:
        self.asked.append(("abort",))

    def left_reserve(self) -> None:
        self.asked.append(("left",))
        self.place = None


def _placed(clock: Clock, limit: list[int]) -> tuple[Holder, ConnectionCount]:
    """A holder of the reserve's place beyond ``limit[0]`` connections held
    (``limit`` changes as a reload would)."""
    count, holder = ConnectionCount(), Holder()
    for held in range(limit[0]):
        assert count.admit(held, OWNER, limit[0], owner=True) is None
    assert count.admit(99, OWNER, limit[0], owner=True) is None
    assert count.reserved(99)
    holder.place = ReservePlace(holder, count, 99, lambda: limit[0], clock)
    return holder, count


def test_a_place_idle_with_an_answer_due_waits_for_it_then_closes_and_aborts():
    clock, limit = Clock(), [1]
    holder, _ = _placed(clock, limit)
    holder.answering = True  # a reload awaiting systemd
    clock.advance(RESERVE_IDLE_SECONDS)
    assert holder.asked == []
    holder.answering = False
    assert holder.place is not None
    holder.place.answer_sent()
    clock.advance(RESERVE_IDLE_SECONDS - 1)
    assert holder.asked == []  # idle from its answer
    clock.advance(1)
    holder.place.answer_sent()  # closing: restarts nothing
    clock.advance(RESERVE_IDLE_SECONDS)
    assert holder.asked == [("close", None), ("abort",)]
    holder.place.lost()
    assert clock.getDelayedCalls() == []


def test_a_place_refuses_work_unless_there_is_room_then_leaves_the_reserve():
    clock, limit = Clock(), [1]
    holder, count = _placed(clock, limit)
    assert holder.place is not None
    place = holder.place
    assert not place.request_read({"topic": "sdexec.reload"})
    limit[0] = 2  # a reload raised max-connections
    assert not place.request_read({"topic": "sdexec.exec"})  # served
    assert holder.asked == [("left",)] and holder.place is None
    assert not count.reserved(99) and clock.getDelayedCalls() == []


def test_a_lost_place_leaves_no_timer():
    clock, limit = Clock(), [1]
    holder, _ = _placed(clock, limit)
    assert holder.place is not None
    refused = {"topic": "sdexec.kill", "matchtag": 3}
    assert holder.place.request_read(refused)
    assert holder.asked == [("close", refused)]
    holder.place.lost()
    assert clock.getDelayedCalls() == []
