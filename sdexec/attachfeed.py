"""An attach's feed: what its client is sent, at the pace its connection
takes it, while the process reads on into its retained buffer.

A background process runs without a client, and an attached one must not
wait on its client: its output is read as it comes and kept in its
:class:`~sdexec.retained.RetainedOutput`, as with nobody attached. Each
attach reads that ring through its own :class:`~sdexec.retained.Cursor`:
while its connection takes what it is sent, each piece goes out as it
comes (the live path); once the connection is full (paused), the cursor
stays where it is and the ring fills, and when the connection resumes the
client is sent what it missed, from the ring, then live output again.
Nothing is sent twice or out of order, and a client that takes everything
before the ring wraps past it loses nothing, however long it stopped.

The responses of the process's stream that come after output (an EOF,
``finished``, the stream's end) wait behind the output not yet sent, where
they came: a few, each small.

Where the ring drops bytes that the client was not yet sent, its cursor has
lost them (:meth:`~sdexec.retained.Cursor.lost`): its owner
(:mod:`sdexec.background`) ends the attach then (:meth:`AttachFeed.abort`).

The feed holds the cursor (a few integers) and those waiting responses;
the ring is the process's own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from sdexec.process import OutputValve, Responder
from sdexec.retained import Cursor

__all__ = ["AttachFeed"]

#: A response waiting behind output: a payload, or the stream's end
#: ``(errnum, errstr)``.
_Waiting = dict[str, Any] | tuple[int, str]


class AttachFeed:
    """What one attach's client is sent: the process's output from
    ``cursor`` on, each piece made a response by ``output``, and the
    responses given to it (it is the attach's
    :class:`~sdexec.process.Responder`), in the order they came, as fast as
    ``valve``'s connection takes them.

    Done (:attr:`done`) once the stream's end is sent, or it is
    :meth:`abort`-ed or :meth:`drop`-ped; it sends nothing after that, and
    ``on_done`` is called with it (once): :attr:`sent_end` then says
    whether the process's end went to the client.
    """

    def __init__(
        self,
        connection_id: int,
        responder: Responder,
        cursor: Cursor,
        output: Callable[[str, bytes], dict[str, Any]],
        valve: OutputValve | None = None,
        on_done: Callable[[AttachFeed], None] | None = None,
    ) -> None:
        self.connection_id = connection_id
        self.cursor = cursor
        self._responder = responder
        self._output = output
        self._valve = valve
        self._on_done = on_done
        #: Responses waiting for the output before them to be sent: with
        #: the absolute offset of the output that came before them.
        self._waiting: deque[tuple[int, _Waiting]] = deque()
        #: The stream's end has been sent, or it was ended or dropped.
        self.done = False
        #: The process's end went to the client: its ``finished``, or the
        #: error its stream ended with (not one it was ended with, abort).
        self.sent_end = False
        self._pumping = False

    # -- the process's stream ------------------------------------------------

    def respond(self, payload: dict[str, Any]) -> None:
        """A response of the stream: sent after the output before it."""
        self._wait(payload)

    def error(self, errnum: int, errstr: str) -> None:
        """The stream's end: sent after everything before it."""
        self._wait((errnum, errstr))

    def send_live(self, stream: str, data: bytes, at: int) -> bool:
        """``data`` of ``stream`` was just kept at the absolute offset
        ``at``: send it as it is, where nothing waits before it and the
        connection takes it. Whether it went so (else it goes in its turn,
        from the ring: :meth:`pump`, once its owner has seen that the ring
        still holds it). Sent, it is no loss to the client, however little
        of it the ring kept: a piece larger than the ring (a long line of a
        line-buffered stream comes whole, up to its buffer size), or any
        piece where the ring keeps nothing (``retained-output = 0``)."""
        if self.done or self._waiting or self._paused or self.cursor.offset != at:
            return False
        self.cursor.advance(stream, len(data))
        if self.cursor.takes(stream):
            self._responder.respond(self._output(stream, data))
        return True

    # -- its end -------------------------------------------------------------

    def abort(self, errnum: int, errstr: str) -> None:
        """End the stream now, with that error, whatever waits unsent."""
        if not self.done:
            self._finish()
            self._responder.error(errnum, errstr)

    def drop(self) -> None:
        """Its connection has gone: send nothing more."""
        self._finish()

    # -- the valve's member --------------------------------------------------

    def pause_output(self) -> None:
        """(Nothing to do: the feed looks at the valve before each send.)"""

    def resume_output(self) -> None:
        """The connection has written everything out: send on."""
        self.pump()

    def pump(self) -> None:
        """Send what waits, in order, until all is sent or the connection
        is full (then the valve resumes it)."""
        if self._pumping or self.done:
            return  # (called from a send: the loop running sees what it added)
        self._pumping = True
        try:
            self._pump()
        finally:
            self._pumping = False

    # -- inside ----------------------------------------------------------------

    @property
    def _paused(self) -> bool:
        return self._valve is not None and self._valve.paused

    def _wait(self, waiting: _Waiting) -> None:
        if not self.done:
            self._waiting.append((self.cursor.retained.head, waiting))
            self.pump()

    def _pump(self) -> None:
        cursor = self.cursor
        while not self.done:
            # A response goes once the output before it has (or was passed
            # over: a stream the client does not take). Small: it goes
            # even to a full connection, as it would have live.
            if self._waiting and self._waiting[0][0] <= cursor.offset:
                self._send_waiting(self._waiting.popleft()[1])
                continue
            end = self._waiting[0][0] if self._waiting else cursor.retained.head
            if cursor.offset >= end:
                return  # all sent
            if self._paused:
                assert self._valve is not None
                self._valve.hold_if_paused(self)
                return
            for stream, piece in cursor.pieces(end):
                self._responder.respond(self._output(stream, piece))
                if self.done or self._paused:
                    break

    def _send_waiting(self, waiting: _Waiting) -> None:
        if isinstance(waiting, dict):
            self.sent_end |= waiting.get("type") == "finished"
            self._responder.respond(waiting)
        else:
            self.sent_end = True
            self._finish()
            self._responder.error(*waiting)

    def _finish(self) -> None:
        if self.done:
            return  # (dropped after its end: done with already)
        self.done = True
        self._waiting.clear()
        if self._valve is not None:
            self._valve.release(self)
        if self._on_done is not None:
            self._on_done(self)
