"""The service's client connections closed at its stop, written out first.

The reactor's shutdown closes every connection still open (its
``disconnectAll``) and drops what Twisted still buffers for them: a client
reading slowly, or not at the moment, lost the ``ECANCELED`` answers the
stop had sent (docs/protocol.md) and output written before them, or read a
frame cut short. The stop closes them itself instead, once its answers are
queued: each connection is closed as Twisted closes one, after all it was
sent is written out (one with nothing left closes at once), within a bound
(:data:`EXIT_FLUSH_SECONDS`); a client that has not read it all by then has
its connection aborted, so that none holds the stop (docs/operating.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from sdexec.logs import named_in_log

__all__ = ["EXIT_FLUSH_SECONDS", "OpenConnections"]

log = Logger()

#: How long the stop lets its connections write out what they hold (its
#: answers) before it aborts those whose clients have not read it.
EXIT_FLUSH_SECONDS = 5.0


class _Connection(Protocol):
    """A protocol on a connected transport (:class:`ClientProtocol`)."""

    transport: Any
    connection_id: int


class OpenConnections:
    """The client connections still open (from ``connectionMade`` to
    ``connectionLost``), for the stop to close once written out."""

    def __init__(self) -> None:
        self._open: dict[_Connection, None] = {}  # in the order they came
        self._all_closed: list[defer.Deferred[None]] = []

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[_Connection]:
        return iter(list(self._open))

    @property
    def closing(self) -> bool:
        """Whether a stop waits for them to be written out and closed."""
        return bool(self._all_closed)

    def add(self, connection: _Connection) -> None:
        """``connection`` is open."""
        self._open[connection] = None

    def discard(self, connection: _Connection) -> None:
        """``connection`` is closed: the stop's wait ends with the last."""
        self._open.pop(connection, None)
        if not self._open:
            waiting, self._all_closed = self._all_closed, []
            for waiter in waiting:
                waiter.callback(None)

    def close_all(self, clock: IReactorTime, bound: float) -> defer.Deferred[None]:
        """Close every connection once what it holds is written out, and
        fire once all are closed, or after ``bound`` seconds on ``clock``,
        when those left are aborted (what their clients did not read is
        lost: named in the log)."""
        for connection in list(self._open):
            # Twisted closes it once its buffer is empty: at once if it is.
            connection.transport.loseConnection()
        if not self._open:
            return defer.succeed(None)
        waiter: defer.Deferred[None] = defer.Deferred()
        self._all_closed.append(waiter)
        timer = clock.callLater(bound, self._abort_unread, waiter, bound)
        return waiter.addBoth(lambda result: timer.cancel() if timer.active() else None)

    def _abort_unread(self, waiter: defer.Deferred[None], bound: float) -> None:
        """The bound passed: abort the connections still writing out (their
        ``connectionLost`` comes a reactor turn later, which the stop does
        not wait for)."""
        left = list(self._open)
        log.warn(
            "the stop aborted connection(s) {ids}: their clients did not read"
            " what they were sent within {bound}s, and what they did not read"
            " is lost",
            bound=bound,
            ids=named_in_log(
                log,
                [str(connection.connection_id) for connection in left],
                "connections the stop aborted",
            ),
        )
        for connection in left:
            connection.transport.abortConnection()
        self._open.clear()
        self._all_closed.remove(waiter)
        waiter.callback(None)
