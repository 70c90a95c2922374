"""``GET /stats``: the service's counters and configuration as JSON.

The site is open to every local user (by default TCP on 127.0.0.1), so it
asks nothing of the service a stranger could abuse: it serves a bounded
number of connections (a new one takes the place of the one that has waited
longest for a complete request), drops idle ones without a word, refuses any
request body before reading it, and writes no access log.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, cast
from urllib.parse import urlsplit

import msgspec
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import (
    IAddress,
    IConsumer,
    IDelayedCall,
    IHalfCloseableProtocol,
    IReactorTime,
    ITCPTransport,
)
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.http import NOT_ALLOWED, NOT_FOUND, HTTPChannel, Request
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request as SiteRequest
from twisted.web.server import Site
from zope.interface import implementer

if TYPE_CHECKING:
    # What Twisted's Site.buildProtocol returns (ours: a _StatsChannel,
    # which that typing cannot say).
    from twisted.web.http import _GenericHTTPChannelProtocol

__all__ = [
    "MAX_REUSE_S",
    "MAX_STATS_CONNECTIONS",
    "STATS_SHARE",
    "STATS_TIMEOUT",
    "RecentByKey",
    "recent",
    "stats_site",
]

#: Connections the site serves at once. Each holds a descriptor, and the
#: service's processes need theirs: 400 idle ones once left an exec no
#: descriptor for its channels. One more closes the connection that has
#: gone longest without completing a request: refusing the newcomer instead
#: let 64 connections trickling a byte each 9 s (under the idle timeout)
#: keep every scrape out.
MAX_STATS_CONNECTIONS = 64

#: Seconds a connection may be idle before it is closed (Twisted's default,
#: 60 s, let a byte a minute hold one for ever).
STATS_TIMEOUT = 10

#: A connection waits for a request, or is being served (``channels``).
_WAITING, _SERVING = False, True

#: How much of a refused header field an answer quotes.
_QUOTED = 80

#: The longest request line or header field read, its line end apart
#: (Twisted's LineReceiver's).
_LINE_LIMIT = 16384


def _shown_field(field: bytes) -> str:
    """A refused header field (or value) as a refusal quotes it: its first
    :data:`_QUOTED` bytes, escaped as a bytes literal's."""
    return repr(field[:_QUOTED])[2:-1]


def _refusal(status: bytes, why: str) -> bytes:
    """A whole answer refusing a request the channel could not or would not
    read: ``status`` (code and reason) and ``why``, a line of text."""
    body = why.encode() + b"\n"
    return (
        b"HTTP/1.1 %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body)
    )


_TOO_LARGE = _refusal(
    b"413 Content Too Large",
    "a request body is not accepted: only GET and HEAD are served",
)


#: The most of the service's time each answer of the site may take: one
#: that took T to make is given again for T / STATS_SHARE before it is made
#: anew. Any local user may ask back to back, and with 2000 jobs one /stats
#: answer held the reactor 85 ms (50 ms with msgspec's JSON); a small
#: table's is fresh within ms.
STATS_SHARE = 0.1
#: The longest an answer is given again.
MAX_REUSE_S = 1.0

_K = TypeVar("_K", bound=Hashable)
_T = TypeVar("_T")


class _Kept(Generic[_K, _T]):
    """Answers by key, each given again for ``1 / STATS_SHARE`` times what
    it cost to make, at most :data:`MAX_REUSE_S` (``clock`` says when); the
    newest ``capacity`` kept (a key may be a client's choice)."""

    def __init__(self, clock: IReactorTime, capacity: int = 1) -> None:
        self._clock = clock
        self._capacity = capacity
        self._answers: dict[_K, tuple[float, float, _T]] = {}  # (when, until, what)

    def get(self, key: _K) -> _T | None:
        """The answer kept for ``key`` while it may be given again, else
        ``None`` (an answer is never ``None``)."""
        kept = self._answers.get(key)
        if kept is None:
            return None
        when, until, value = kept
        if when <= self._clock.seconds() < until:
            return value
        del self._answers[key]
        return None

    def keep(self, key: _K, value: _T, cost: float) -> None:
        """Keep ``value``, made now at ``cost`` seconds of the service's time."""
        now = self._clock.seconds()
        self._answers.pop(key, None)  # the newest last
        self._answers[key] = (now, now + _reuse_seconds(cost), value)
        while len(self._answers) > self._capacity:
            del self._answers[next(iter(self._answers))]


def _reuse_seconds(cost: float) -> float:
    """How long an answer that cost ``cost`` seconds to make is given again
    (and the next new one waits): ``1 / STATS_SHARE`` times its cost, at
    most a second: a stall while it was made (a paused VM, a long
    collection) is not its cost to make again."""
    return min(cost / STATS_SHARE, MAX_REUSE_S)


def recent(
    produce: Callable[[], _T],
    clock: IReactorTime,
    timer: Callable[[], float] = time.perf_counter,
    depends_on: Callable[[], Hashable] = lambda: None,
) -> Callable[[], _T]:
    """``produce``, given again instead of made anew for ``1 / STATS_SHARE``
    times as long as it took to make (by ``timer``; ``clock`` says when), at
    most :data:`MAX_REUSE_S`; never once ``depends_on()`` (what else the
    answer shows, a setting) has changed."""
    kept: _Kept[Hashable, _T] = _Kept(clock)

    def fresh_enough() -> _T:
        key = depends_on()
        value = kept.get(key)
        if value is None:
            began = timer()
            value = produce()
            kept.keep(key, value, timer() - began)
        return value

    return fresh_enough


class RecentByKey(Generic[_K, _T]):
    """Answers made in the background by key, given again as :func:`recent`
    gives its own: ``produce(key)`` fires with an answer and the seconds of
    the service's time it cost (a render in a thread still holds the GIL
    that the service's thread needs). A request for a key whose answer is
    being made, or waits its turn, waits for that one. The answers of the
    newest ``capacity`` keys are kept.

    New answers are made one at a time, whatever their key, each after the
    last one's rest (``1 / STATS_SHARE`` times what it cost, at most
    :data:`MAX_REUSE_S`): the key is the client's choice (a format, a
    selection), and one new in every request had every answer made anew,
    each taking its full cost of the service's time. A request cancelled
    (its client left) is dropped, and a key no one waits for is not made."""

    def __init__(
        self,
        produce: Callable[[_K], Deferred[tuple[_T, float]]],
        clock: IReactorTime,
        capacity: int,
    ) -> None:
        self._produce = produce
        self._clock = clock
        self._kept: _Kept[_K, _T] = _Kept(clock, capacity)
        #: Keys whose answer is being made or waits its turn, and who
        #: waits for it.
        self._waiting: dict[_K, list[Deferred[_T]]] = {}
        #: Keys waiting for their turn, oldest first (a set in order).
        self._queued: dict[_K, None] = {}
        #: Whether an answer is being made.
        self._making = False
        #: When the next answer may be made (the last one's rest).
        self._rest_until = 0.0
        #: The call that makes the next answer once the rest is over.
        self._turn: IDelayedCall | None = None
        self._stopped = False

    def get(self, key: _K) -> Deferred[_T]:
        """The answer for ``key``: the one kept, the one being made or
        waiting its turn, or a new one; cancel it to give it up."""
        kept = self._kept.get(key)
        if kept is not None:
            return succeed(kept)
        answer: Deferred[_T] = Deferred(lambda given_up: self._give_up(key, given_up))
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting.append(answer)
            return answer
        self._waiting[key] = [answer]
        self._queued[key] = None
        self._next()
        return answer

    def stop(self) -> None:
        """Make no more answers (the service stops): those waiting their
        turn are dropped, and no timer is left."""
        self._stopped = True
        if self._turn is not None and self._turn.active():
            self._turn.cancel()
        self._turn = None
        for key in self._queued:
            del self._waiting[key]
        self._queued.clear()

    def _give_up(self, key: _K, answer: Deferred[_T]) -> None:
        waiting = self._waiting.get(key)
        if waiting is None or answer not in waiting:
            return
        waiting.remove(answer)
        if not waiting and key in self._queued:  # not made for no one
            del self._queued[key]
            del self._waiting[key]

    def _next(self) -> None:
        """Make the next answer waiting its turn, now or after the rest."""
        if self._making or self._turn is not None or not self._queued:
            return
        if self._stopped:
            return
        rest = self._rest_until - self._clock.seconds()
        if rest > 0:
            self._turn = self._clock.callLater(rest, self._make_next)
        else:
            self._make_next()

    def _make_next(self) -> None:
        self._turn = None
        key = next(iter(self._queued))
        del self._queued[key]
        self._making = True
        maybeDeferred(self._produce, key).addCallbacks(
            self._made, self._failed, callbackArgs=(key,), errbackArgs=(key,)
        )

    def _made(self, made: tuple[_T, float], key: _K) -> None:
        value, cost = made
        self._kept.keep(key, value, cost)
        for answer in self._waiting.pop(key):
            answer.callback(value)
        self._rest(cost)

    def _failed(self, failure: Failure, key: _K) -> None:
        # Kept for no one after: the next request tries again.
        for answer in self._waiting.pop(key):
            answer.errback(failure)
        self._rest(0.0)

    def _rest(self, cost: float) -> None:
        """The answer made cost ``cost``: the next waits as long as it
        would be given again (:class:`_Kept`)."""
        self._making = False
        self._rest_until = self._clock.seconds() + _reuse_seconds(cost)
        self._next()


def _rendered(stats: dict) -> bytes:
    """``stats`` as indented JSON: msgspec's, which the service loads anyway
    (the json module's took 42 ms of the reactor for 2000 jobs, this 3 ms;
    the same JSON, non-ASCII written as UTF-8 rather than escaped)."""
    return msgspec.json.format(msgspec.json.encode(stats), indent=2) + b"\n"


def _headers_only(request: Request, body: bytes) -> bytes:
    """A HEAD's answer: a GET's headers and length, and no body. Twisted
    drops a body rendered for HEAD, but logs a line for each, quoting the
    path and query as the client sent them (as many as any local user
    cares to send, kilobytes each)."""
    request.setHeader(b"content-length", b"%d" % len(body))
    return b""


class _JSONResource(Resource):
    isLeaf = True

    def __init__(
        self,
        produce: Callable[[], dict],
        clock: IReactorTime,
        depends_on: Callable[[], Hashable],
    ) -> None:
        super().__init__()
        self._body = recent(lambda: _rendered(produce()), clock, depends_on=depends_on)

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return self._body()

    def render_HEAD(self, request: Request) -> bytes:
        return _headers_only(request, self.render_GET(request))


_NOT_FOUND_PAGE = b"Not found\n"


class _NotFound(Resource):
    """Any other path, whatever the method: a 404 (Twisted's own page
    answers HEAD with its body, and so logs it)."""

    isLeaf = True

    def render(self, request: Request) -> bytes:
        request.setResponseCode(NOT_FOUND)
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        if request.method == b"HEAD":
            return _headers_only(request, _NOT_FOUND_PAGE)
        return _NOT_FOUND_PAGE


class _Root(Resource):
    """``/``: its pages, and :class:`_NotFound` for any other path."""

    def getChildWithDefault(self, path: bytes, request: Request) -> Resource:
        # The pages are leaves, which would answer any path below them
        # (/stats/x); a trailing slash is still the page.
        # (Set by twisted.web.server.Request.process; not in its annotations.)
        if getattr(request, "postpath", []) not in ([], [b""]):
            return _NotFound()
        return super().getChildWithDefault(path, request)

    def getChild(self, path: bytes, request: Request) -> Resource:
        return _NotFound()


@implementer(IHalfCloseableProtocol)
class _StatsChannel(HTTPChannel):
    """One connection: counted by its site, and refusing request bodies;
    one whose client shut its sending side (``shutdown(SHUT_WR)``, ``nc
    -N``) is answered what it asked, then closed."""

    site: _StatsSite

    def connectionMade(self) -> None:
        super().connectionMade()
        self.site.channels[self] = _WAITING

    #: Closed to make room, and not gone yet (its descriptor is still open).
    evicted = False
    #: Its transport holds more unwritten than it takes at once (it paused
    #: this producer): the client is not reading its answers.
    answers_unread = False
    #: Closing, the request being read refused or the requests it sent
    #: ahead unanswered (allHeadersReceived), none to be served.
    refused = False
    #: The header field being read (headerReceived), quoted when refused.
    _field = b""
    #: The client shut its sending side: nothing more to read.
    read_closed = False

    # Lines end in LF, the CR before it dropped (lineReceived): RFC 9112
    # (2.2) lets a server take a bare LF for a line's end, and a request
    # typed with printf and sent by nc waited for the idle timeout. A CRLF
    # line's CR is still in the line LineReceiver measures.
    delimiter = b"\n"
    MAX_LENGTH = _LINE_LIMIT + 1

    def lineReceived(self, line: bytes) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if len(line) > _LINE_LIMIT:  # LineReceiver let a bare LF's one more
            self.lineLengthExceeded(line)
            return
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        self._field = line
        return super().headerReceived(line)

    def lineLengthExceeded(self, line: bytes) -> None:
        # Twisted closed the connection without a word: a scraper whose
        # name[] selection made the request line too long saw an empty reply.
        if self._reading_request_line():
            why = f"request line longer than {_LINE_LIMIT} bytes"
            self._refuse(b"414 URI Too Long", why)
        else:
            why = f"header field longer than {_LINE_LIMIT} bytes"
            self._refuse(b"431 Request Header Fields Too Large", why)

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's answers "400 Bad Request" and nothing else, whatever
        # was wrong: the limits it keeps and the part it could not parse
        # are named instead.
        if self._receivedHeaderSize > self.totalHeadersSize:
            limit = self.totalHeadersSize
            why = f"request line and header fields longer than {limit} bytes"
            self._refuse(b"431 Request Header Fields Too Large", why)
        elif self._receivedHeaderCount > self.maxHeaders:
            why = f"more than {self.maxHeaders} header fields"
            self._refuse(b"431 Request Header Fields Too Large", why)
        elif self._reading_request_line():
            why = "malformed request line: not METHOD TARGET HTTP/1.1 (or HTTP/1.0)"
            self._refuse(b"400 Bad Request", why)
        else:
            shown = _shown_field(self._field)
            self._refuse(b"400 Bad Request", f"malformed header field: {shown}")

    def _reading_request_line(self) -> bool:
        """Whether no request line of the request being read was parsed
        (Twisted keeps a parsed one's method until the request is read)."""
        return not hasattr(self, "_command")

    def _refuse(self, status: bytes, why: str) -> None:
        assert self.transport is not None  # it is reading from it
        self.refused = True
        self.transport.write(_refusal(status, why))
        self.loseConnection()

    def pauseProducing(self) -> None:
        self.answers_unread = True
        super().pauseProducing()

    def resumeProducing(self) -> None:
        self.answers_unread = False
        super().resumeProducing()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.site.channels.pop(self, None)
        if self.evicted:
            self.site.closing -= 1
        super().connectionLost(reason)

    def checkPersistence(self, request: Request, version: bytes) -> bool:
        """Whether the connection stays open after this request's answer:
        not if any ``Connection`` field names ``close`` in its list.
        Twisted's splits only the first field, and at spaces alone:
        ``keep-alive,close``, or a second field, kept it open, and a client
        reading the answer to its end waited for the idle timeout."""
        persistent = bool(super().checkPersistence(request, version))
        fields = request.requestHeaders.getRawHeaders(b"connection", [])
        if persistent and _names_close(fields):
            request.responseHeaders.setRawHeaders(b"connection", [b"close"])
            return False
        return persistent

    def requestDone(self, request: Request) -> None:
        # Served: it now waits for its next request, the newest to wait.
        channels = self.site.channels
        if self in channels:  # not already closed to make room
            del channels[self]
            channels[self] = _WAITING
        super().requestDone(request)
        self._close_once_answered()

    def readConnectionLost(self) -> None:
        """The client shut its sending side: what it asked is answered
        before the connection is closed. Twisted took it for a close and
        dropped an answer not yet written (an HTTP/1.1 one, or a /metrics
        one being rendered): the client got nothing. One that leaves after
        it is not seen to leave (nothing more is read) until its answer is
        written, as one that stops reading."""
        self.read_closed = True
        self._close_once_answered()

    def writeConnectionLost(self) -> None:
        """Only after a half-close of this side, which the site never makes."""
        self.loseConnection()

    def _close_once_answered(self) -> None:
        """Close, what is written written first, once the client has shut
        its side and no request it sent is being answered: what is left
        unread is no whole request (requestDone reads those sent ahead)."""
        if self.read_closed and not self._handlingRequest:
            self.loseConnection()

    def allHeadersReceived(self) -> None:
        # Only GET is served, and Twisted would keep a body however large
        # (in a temporary file from 100 kB on): refused unread, and closed.
        assert self.transport is not None  # headers came through it
        if self.length != 0:  # a Content-Length, or None: chunked
            self.transport.write(_TOO_LARGE)
            self.transport.loseConnection()
            return
        if self.answers_unread:
            # Requests sent ahead (pipelined) while the answers go unread:
            # Twisted would answer every one it has read into the write
            # buffer, a copy of the whole table each (a 64 KiB write of
            # requests held 2800). The answers made are still written, the
            # rest unanswered: a client that reads asks again; one that
            # does not is closed by the idle timeout.
            self.refused = True
            self.clearLineBuffer()
            # A paused producer would be resumed once all is written,
            # instead of the connection closed.
            cast(IConsumer, self.transport).unregisterProducer()
            cast(ITCPTransport, self.transport).loseConnection()
            return
        hosts = self.requests[-1].requestHeaders.getRawHeaders(b"host", [])
        why = _host_refusal(self._version, hosts)
        if why is not None:
            # Twisted served these; RFC 9112 (3.2) says they must be a 400.
            self._refuse(b"400 Bad Request", why)
            return
        if self in self.site.channels:
            # Being served (/metrics renders in a thread): not to be closed
            # for a newcomer until its answer is written.
            self.site.channels[self] = _SERVING
        super().allHeadersReceived()

    def allContentReceived(self) -> None:
        # Twisted calls it for a GET whatever allHeadersReceived did.
        if not self.refused:
            super().allContentReceived()

    def timeoutConnection(self) -> None:
        """Close an idle connection at once, and silently. Twisted's logs
        "Timing out client" for each (any local user could put 64 lines in
        the journal every :data:`STATS_TIMEOUT` seconds, for ever), then
        waits for what is unwritten and logs again if the client does not
        read it: nothing a client that left it idle still wants."""
        assert self.transport is not None  # the timer starts once connected
        cast(ITCPTransport, self.transport).abortConnection()


def _names_close(fields: Sequence[bytes]) -> bool:
    """Whether these ``Connection`` fields name the ``close`` option
    (RFC 9110, 7.6.1: a list, its options separated by commas)."""
    return any(
        option.strip(b" \t").lower() == b"close"
        for field in fields
        for option in field.split(b",")
    )


#: A Host field's value: RFC 3986's host (a name, or an IP literal in
#: brackets), then a port, either empty (RFC 9112, 3.2: a request whose
#: target has no authority sends an empty one).
_HOST = re.compile(
    rb"(\[[0-9A-Za-z.:_~!$&'()*+,;=-]*\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(:[0-9]*)?"
)


def _host_refusal(version: bytes, hosts: list[bytes]) -> str | None:
    """Why a request of ``version`` with these ``Host`` fields is a 400
    (RFC 9112, 3.2: none in an HTTP/1.1 request, more than one, or one that
    is no host), else ``None``: an HTTP/1.0 request may have none."""
    if not hosts:
        if version == b"HTTP/1.1":
            return "no Host header field: an HTTP/1.1 request must have one"
        return None
    if len(hosts) > 1:
        return "more than one Host header field"
    if _HOST.fullmatch(hosts[0]) is None:
        return f"malformed Host header field: {_shown_field(hosts[0])}"
    return None


class _StatsRequest(SiteRequest):
    """A request whose target may be absolute-form, as RFC 9112 (3.2.2)
    says a server must accept: ``GET http://host/stats``. Twisted took the
    whole URL for the path, a 404."""

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        super().requestReceived(command, _origin_form(path), version)

    def render(self, resrc: IResource) -> None:
        # Twisted answered any other method with an HTML page: a 405 for
        # POST, "501 Huh?" for OPTIONS, PUT, DELETE, TRACE and the rest.
        if self.method in _SERVED_METHODS:
            super().render(resrc)
            return
        body = b"method not allowed: only GET and HEAD are served\n"
        self.setResponseCode(NOT_ALLOWED)
        self.setHeader(b"allow", b"GET, HEAD")
        self.setHeader(b"content-type", b"text/plain; charset=utf-8")
        self.setHeader(b"content-length", b"%d" % len(body))
        self.write(body)
        self.finish()


_SERVED_METHODS = (b"GET", b"HEAD")


def _origin_form(target: bytes) -> bytes:
    """``target``, a request's, as its path and query: ``/stats?x`` for
    ``http://host/stats?x``, ``/`` for ``http://host``; any other as it is."""
    if not target.lower().startswith((b"http://", b"https://")):
        return target
    try:
        parts = urlsplit(target)
    except ValueError:  # not ASCII, an unclosed [IPv6: a 404 as before
        return target
    path = parts.path or b"/"
    return path + b"?" + parts.query if parts.query else path


class _StatsSite(Site):
    # Plain HTTP/1.1 channels: the default's wrapper exists to offer HTTP/2
    # over TLS, which this site never speaks.
    protocol = _StatsChannel  # type: ignore[assignment]
    requestFactory = _StatsRequest
    #: No "Starting factory <..._StatsSite object at 0x...>" line (as the
    #: service's own factory).
    noisy = False

    def __init__(self, resource: IResource) -> None:
        super().__init__(resource, timeout=STATS_TIMEOUT)
        #: The open connections, in the order they began to wait for a
        #: request (when they connected, or were last served), each with
        #: whether it is being served now.
        self.channels: dict[_StatsChannel, bool] = {}
        #: Connections closed to make room whose descriptors close a reactor
        #: pass later: a burst of connects accepted in one pass must not
        #: hold more than twice the cap.
        self.closing = 0

    def buildProtocol(
        self, addr: IAddress | None
    ) -> _GenericHTTPChannelProtocol | None:
        if len(self.channels) >= MAX_STATS_CONNECTIONS:
            longest = next(
                (c for c, serving in self.channels.items() if not serving), None
            )
            if longest is None or self.closing >= MAX_STATS_CONNECTIONS:
                return None  # Twisted closes this one at once
            del self.channels[longest]
            longest.evicted = True
            self.closing += 1
            # TCP's, or a UNIX socket's (stats-socket), which has it too.
            cast(ITCPTransport, longest.transport).abortConnection()
        return super().buildProtocol(addr)

    def log(self, request: Request) -> None:
        """No access log: each request's path and headers would reach the
        service's journal, as much as any local user cares to send (and a
        scraper's every 15 s)."""


def stats_site(
    produce: Callable[[], dict],
    metrics: IResource | None = None,
    clock: IReactorTime | None = None,
    depends_on: Callable[[], Hashable] = lambda: None,
) -> Site:
    """A site serving ``produce()`` at ``/stats`` (given again while
    :func:`recent` by ``clock``, the reactor by default, and ``depends_on()``
    is the same), ``metrics`` (see sdexec/metrics.py) at ``/metrics``, and a
    404 elsewhere."""
    if clock is None:
        from twisted.internet import reactor

        clock = cast(IReactorTime, reactor)
    root = _Root()
    root.putChild(b"stats", _JSONResource(produce, clock, depends_on))
    if metrics is not None:
        root.putChild(b"metrics", metrics)
    return _StatsSite(root)
