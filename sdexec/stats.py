"""``GET /stats``: the service's counters and configuration as JSON.

The site is open to every local user (by default TCP on 127.0.0.1), so it
asks nothing of the service a stranger could abuse: it serves a bounded
number of connections, drops idle ones, refuses any request body before
reading it, and writes no access log.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel, Request
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site

__all__ = ["MAX_STATS_CONNECTIONS", "STATS_TIMEOUT", "stats_site"]

#: Connections the site serves at once; more are closed as they come. Each
#: holds a descriptor, and the service's processes need theirs: 400 idle
#: ones once left an exec no descriptor for its channels.
MAX_STATS_CONNECTIONS = 64

#: Seconds a connection may be idle before it is closed (Twisted's default,
#: 60 s, let a byte a minute hold one for ever).
STATS_TIMEOUT = 10

_TOO_LARGE = (
    b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)


class _JSONResource(Resource):
    isLeaf = True

    def __init__(self, produce: Callable[[], dict]) -> None:
        super().__init__()
        self._produce = produce

    def render_GET(self, request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(self._produce(), indent=2).encode() + b"\n"


class _StatsChannel(HTTPChannel):
    """One connection: counted by its site, and refusing request bodies."""

    site: _StatsSite

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.channels.add(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.channels.discard(self)
        super().connectionLost(reason)

    def allHeadersReceived(self) -> None:
        # Only GET is served, and Twisted would keep a body however large
        # (in a temporary file from 100 kB on): refused unread, and closed.
        if self.length != 0:  # a Content-Length, or None: chunked
            assert self.transport is not None  # headers came through it
            self.transport.write(_TOO_LARGE)
            self.transport.loseConnection()
            return
        super().allHeadersReceived()


class _StatsSite(Site):
    # Plain HTTP/1.1 channels: the default's wrapper exists to offer HTTP/2
    # over TLS, which this site never speaks.
    protocol = _StatsChannel  # type: ignore[assignment]

    def __init__(self, resource: IResource) -> None:
        super().__init__(resource, timeout=STATS_TIMEOUT)
        self.channels: set[_StatsChannel] = set()

    def buildProtocol(self, addr):
        if len(self.channels) >= MAX_STATS_CONNECTIONS:
            return None  # Twisted closes the connection at once
        return super().buildProtocol(addr)

    def log(self, request: Request) -> None:
        """No access log: each request's path and headers would reach the
        service's journal, as much as any local user cares to send (and a
        scraper's every 15 s)."""


def stats_site(produce: Callable[[], dict], metrics: IResource | None = None) -> Site:
    """A site serving ``produce()`` at ``/stats``, ``metrics`` (see
    sdexec/metrics.py) at ``/metrics``, and a 404 elsewhere."""
    root = Resource()
    root.putChild(b"stats", _JSONResource(produce))
    if metrics is not None:
        root.putChild(b"metrics", metrics)
    return _StatsSite(root)
