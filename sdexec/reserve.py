"""A connection's place in the owner's reserve, from its side.

sdexec/admission.py counts the owner's connections admitted beyond
``[sdexec] max-connections``, the reserve kept for an admin's requests. A
connection admitted there (sdexec/connection.py) holds a
:class:`ReservePlace` while it is on the reserve, and tells it when it
reads a request, sends an answer, closes and is lost. The place refuses a
request that is not an admin's, closes the connection once idle, counts
it among the owner's own once there is room (the connection then drops
it), and aborts it once closed if its client has not read all it was
sent: the place is freed only once the connection is lost. It asks the
connection, a :class:`ReserveHolder`, to close or abort.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from sdexec.admission import (
    RESERVE_IDLE_SECONDS,
    RESERVE_TOPICS,
    ConnectionCount,
    idle_on_reserve,
    on_reserve,
)
from sdexec.limits import is_text
from sdexec.refusal import SHOWN, quoted

__all__ = ["ReserveHolder", "ReservePlace"]


class ReserveHolder(Protocol):
    """The connection holding a :class:`ReservePlace`, as the place asks it."""

    @property
    def answering(self) -> bool:
        """Whether a request it read has not had all its answer yet."""
        ...

    def close_reserved(self, refusal: str, message: dict | None) -> None:
        """Say ``refusal`` (in the log too) in answer to ``message`` (on
        matchtag 0 if ``None``), close the connection once that is written
        (telling the place, :meth:`ReservePlace.closing`), and take its
        client as gone."""
        ...

    def abort(self) -> None:
        """Drop the connection, and what it has not written out."""
        ...

    def left_reserve(self) -> None:
        """The connection is counted among the owner's own: it may carry
        anything, and drops its place, which calls nothing more."""
        ...


class ReservePlace:
    """A connection's place in the owner's reserve: one timer, counting
    its idleness (from its last request or answer), or, once it is
    closing, the time its client has to read what it was sent."""

    def __init__(
        self,
        holder: ReserveHolder,
        connections: ConnectionCount,
        connection_id: int,
        limit: Callable[[], int],
        clock: IReactorTime,
    ) -> None:
        """The place of ``holder`` (admitted to the reserve of
        ``connections`` as ``connection_id``), whose owner's
        ``max-connections`` is ``limit()`` (a reload may change it)."""
        self._holder = holder
        self._connections = connections
        self._connection_id = connection_id
        self._limit = limit
        self._clock = clock
        #: :attr:`_timer` counts the connection's idleness (else it aborts
        #: the connection, closing, or the connection is lost).
        self._timing_idle = True
        self._timer: IDelayedCall = self._idle_timer()

    def request_read(self, message: dict) -> bool:
        """The connection read ``message``: idle from now. Refused, and
        the connection closed (True), unless an admin's request
        (:data:`RESERVE_TOPICS`) or the connection may leave the reserve:
        the reserve starts nothing, and a client that came there for work
        must not keep a place the next admin needs."""
        self._restart_idle()
        topic = message.get("topic")
        if isinstance(topic, str) and topic in RESERVE_TOPICS:
            return False
        if self._left():
            return False
        what = (
            quoted(topic, SHOWN)
            if is_text(topic)
            else "a request whose topic is not text"
        )
        self._holder.close_reserved(on_reserve(what, self._limit()), message)
        return True

    def answer_sent(self) -> None:
        """The connection sent an answer: idle from now."""
        self._restart_idle()

    def closing(self) -> None:
        """The connection is closing, once all it was sent is written out:
        aborted if still not gone after :data:`RESERVE_IDLE_SECONDS`, its
        last words then left unread. Its place is freed once it is lost,
        and one whose client asked for answers it never reads (a flood of
        ``list``, a stopped ``sdexec ps``) held it for ever, closed or not,
        whatever closed it (its idleness, a request not an admin's, a
        protocol error, its EOF)."""
        if not self._timing_idle:
            return  # closing already
        self._timing_idle = False
        self._cancel()
        self._timer = self._clock.callLater(RESERVE_IDLE_SECONDS, self._holder.abort)

    def lost(self) -> None:
        """The connection is lost (or aborted): nothing more to time."""
        self._timing_idle = False
        self._cancel()

    def _idle_timer(self) -> IDelayedCall:
        return self._clock.callLater(RESERVE_IDLE_SECONDS, self._idle)

    def _restart_idle(self) -> None:
        """Count the connection idle from now: from its last request or
        answer, not from a look every 10 s, which left one that asked at
        1 s idle until 20 s, and closed one whose reload was answered at
        15 s at 20."""
        if not self._timing_idle:
            return  # closing: its abort is timed instead
        self._cancel()
        self._timer = self._idle_timer()

    def _idle(self) -> None:
        """Close the connection once it has read no request and sent no
        answer for :data:`RESERVE_IDLE_SECONDS`, with nothing unanswered:
        an admin's requests come at once, and a client that leaked its
        connections must not hold the reserve too."""
        if self._left():
            return
        if self._holder.answering:  # its answer, once sent, restarts the count
            self._timer = self._idle_timer()
            return
        self._holder.close_reserved(idle_on_reserve(), None)

    def _left(self) -> bool:
        """Whether the connection has just been counted among the owner's
        own (:meth:`ConnectionCount.promote`): a reload raised
        ``max-connections`` above those open, or some closed. Its request
        is then served, and its idleness no longer watched: the refusal's
        "beyond the N max-connections allows" would be false."""
        if not self._connections.promote(self._connection_id, self._limit()):
            return False
        self.lost()  # for the place: the connection drops it
        self._holder.left_reserve()
        return True

    def _cancel(self) -> None:
        if self._timer.active():
            self._timer.cancel()
