"""Seeing a client close a connection the service is not reading.

A connection whose requests wait (its client wrote stdin ahead of a process
that does not read it) is not read: Twisted stops polling a socket it
neither reads nor writes, so the client's close went unseen, and its
processes ran on, its connection slot held for good. One epoll instance,
in the reactor while anything is watched, watches such sockets for the
peer's hang-up (``EPOLLRDHUP``) alone: what they hold unread does not wake
it. Whoever watches is told whether the peer is gone (closed, or reset:
``EPOLLHUP``, ``EPOLLERR``) or only shut down its writing, as socat and nc
do at the end of their input (such a peer may still read what it is sent).
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable

from twisted.internet.interfaces import IReactorFDSet, IReadDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

#: What epoll reports for a peer that closed (or reset) the connection: a
#: shutdown of its writing alone is ``EPOLLRDHUP`` without these.
_GONE = select.EPOLLHUP | select.EPOLLERR


def peer_gone(fd: int) -> bool:
    """Whether socket ``fd``'s peer has closed (or reset) the connection
    now, not only shut down its writing: a read's EOF is either."""
    poller = select.poll()
    poller.register(fd, 0)  # POLLHUP and POLLERR need no asking
    return bool(poller.poll(0))


@implementer(IReadDescriptor)
class HangupWatcher:
    """Calls back once the peer of a watched socket has closed it, or shut
    down its writing."""

    def __init__(self, reactor: IReactorFDSet) -> None:
        self._reactor = reactor
        self._epoll: select.epoll | None = None
        self._watched: dict[int, Callable[[bool], None]] = {}

    def watch(
        self, fd: int, on_hangup: Callable[[bool], None], gone_only: bool = False
    ) -> None:
        """Call ``on_hangup(gone)`` once when socket ``fd``'s peer hangs up,
        unless :meth:`unwatch` comes first: ``gone`` true when it closed
        (or reset) the connection, false when it only shut down its writing
        (it may still read). ``gone_only``: only once it is gone (a peer
        that has shut down its writing already would be reported at once,
        and again)."""
        if fd in self._watched:
            return
        if self._epoll is None:
            self._epoll = select.epoll()
            self._reactor.addReader(self)
        # EPOLLHUP and EPOLLERR need no asking: an empty mask is them alone.
        self._epoll.register(fd, 0 if gone_only else select.EPOLLRDHUP)
        self._watched[fd] = on_hangup

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (also once it is closed: epoll forgot it)."""
        if self._watched.pop(fd, None) is None or self._epoll is None:
            return
        # Closed already, epoll dropped it with its last reference.
        with contextlib.suppress(OSError):
            self._epoll.unregister(fd)
        if not self._watched:
            self._close()

    def doRead(self) -> None:
        assert self._epoll is not None  # read only while in the reactor
        for fd, events in self._epoll.poll(0):
            on_hangup = self._watched.get(fd)
            self.unwatch(fd)
            if on_hangup is not None:
                # Both directions shut (EPOLLHUP, never asked for: always
                # reported) or an error; EPOLLRDHUP alone is a half-close.
                on_hangup(bool(events & _GONE))

    def fileno(self) -> int:
        return self._epoll.fileno() if self._epoll is not None else -1

    def connectionLost(self, reason: Failure) -> None:
        self._watched.clear()
        self._close()

    def logPrefix(self) -> str:
        return "HangupWatcher"

    def _close(self) -> None:
        if self._epoll is not None:
            self._reactor.removeReader(self)
            self._epoll.close()
            self._epoll = None
