"""``GET /metrics``: the service's counters for Prometheus.

Served next to ``/stats`` by prometheus-client's Twisted resource (content
negotiation included: the text format, or OpenMetrics when the scraper asks
for it). Two kinds of metric:

- those ``/stats`` already counts, read from the server's ``stats()`` at
  a scrape (:class:`_StatsCollector`; the service reuses a reading as
  sdexec/stats.py ``recent`` says), so both endpoints agree;
- those only an observer sees, fed by two optional hooks:
  ``SystemdClient.on_call`` (every D-Bus method call: its member, duration
  and whether it succeeded) and ``SdexecServer.observer`` (each exec
  stream's responses, and every error response).

A scrape takes its snapshot of ``stats()`` in the reactor thread, where the
server lives, renders the text in the reactor's thread pool (a large one
takes milliseconds), and writes it from the reactor thread again. Nothing
in the pool waits for the reactor: prometheus-client's WSGI resource wrote
its answer by waiting on the reactor from the pool, and a scrape caught by
the service's stop hung the stop for ever (the reactor waits for its pool
as it stops). The rendering is pure Python and holds the GIL, so it is the
service's time all the same: an answer is given again as ``/stats``' are
(sdexec/stats.py ``RecentByKey``), by what it depends on of the request.
"""

from __future__ import annotations

import copy
import errno
import gzip
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    choose_encoder,
    generate_latest,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import parse_version
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request

from sdexec.drain import KINDS
from sdexec.leftovers import LEFTOVER_STATE
from sdexec.lograte import LogRate
from sdexec.process import Responder
from sdexec.protocol import Topic
from sdexec.stats import RecentByKey

__all__ = ["KEPT_ANSWERS", "Metrics", "Scrape"]

log = Logger()

#: Request topics as a label: the service's own, else this one (a client's
#: misspelt topic must not become a new time series).
OTHER_TOPIC = "other"
#: D-Bus calls take around a millisecond; a loaded manager takes seconds.
DBUS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # fmt: skip
#: From an exec request to its ``started`` response: a unit's start.
START_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0, 60.0)  # fmt: skip
#: ``/stats`` counters that are events, not request topics, and the metric
#: (without ``sdexec_`` and ``_total``) each becomes.
EVENT_COUNTERS = {
    "errors": (
        "requests_refused",
        "Requests refused: malformed or unknown ones, and those their handler"
        " refused, at once or once systemd answered (a kill of a pid that has"
        " exited, an exec on a drained node).",
    ),
    "reaped": ("processes_reaped", "Processes whose unit was stopped and reaped."),
    "mapper": (
        "mapper_calls",
        "Requests planned with the resource mapper's fence (also those refused"
        " after the plan).",
    ),
    "fence-failures": (
        "fence_failures",
        "Units whose CPU or memory node fence, or memory cap, did not hold.",
    ),
    "job-timeouts": ("job_timeouts", "Jobs terminated at their time limit."),
    "jobs-unkillable": ("jobs_unkillable", "Jobs that outlived termination."),
    "oom-kills": (
        "oom_kills",
        "Units the OOM killer ended (Result=oom-kill, or memory.events counted"
        " one), each once: also those whose client had left, whose kill came"
        " after the main process exited, and leftovers killed while followed.",
    ),
    "device-fence-failures": (
        "device_fence_failures",
        "Device canaries that found DevicePolicy not enforced (or unverifiable).",
    ),
    "systemd-losses": (
        "systemd_losses",
        "Times the connection to systemd was lost (the bus or the manager went"
        " away): a loss and its reconnection between two scrapes show only here.",
    ),
}
STOP_TIMER_PREFIX = "stop-timer-"
#: The states of ``/stats``' processes: running, finished and not yet
#: reaped (sdexec/process.py), a leftover of an earlier run.
PROCESS_STATES = ("R", "Z", LEFTOVER_STATE)


#: ``/metrics`` answers kept to be given again: one per format, gzip or not
#: and ``name[]`` selection a scraper asks for (a handful; ``name[]`` is the
#: client's choice, so the oldest go).
KEPT_ANSWERS = 8

#: A rendered answer: its body and headers.
Rendered = tuple[bytes, dict[str, str]]

#: The request fields an answer's format depends on (its ``Vary``).
_NEGOTIATED_BY = "Accept, Accept-Encoding"


def _topic_label(topic: str) -> str:
    return topic if topic in Topic._value2member_map_ else OTHER_TOPIC


@dataclass(frozen=True)
class Scrape:
    """What a ``/metrics`` answer depends on of its request: the key by
    which an answer is given again."""

    #: Says which encoder (prometheus-client makes a new one at each
    #: choice, never equal to the last).
    content_type: str
    gzipped: bool
    #: The families ``name[]`` names, sorted and each once; none: all.
    names: tuple[str, ...]
    encoder: Callable[[Any], bytes] = field(compare=False)

    @classmethod
    def asked(cls, accept: str, accept_encoding: str, names: list[str]) -> Scrape:
        """The scrape a request's headers and ``name[]`` ask for."""
        encoder, content_type = _encoder(accept)
        selected = tuple(sorted(set(names)))
        return cls(content_type, _gzip_accepted(accept_encoding), selected, encoder)


def _gzip_accepted(accept_encoding: str) -> bool:
    """Whether ``accept_encoding`` takes gzip: named with a ``q`` above 0
    (RFC 9110, 12.5.3: ``gzip;q=0`` refuses it, and prometheus-client's
    ``gzip_accepted`` gzipped for it all the same). A ``q`` that is no
    number takes nothing: the plain answer is always acceptable."""
    for coding in accept_encoding.split(","):
        name, *parameters = coding.split(";")
        if name.strip().lower() == "gzip":
            return all(_weight(parameter) > 0 for parameter in parameters)
    return False


def _weight(parameter: str) -> float:
    """The ``q`` that a coding's ``parameter`` gives, 1 for any other
    parameter, 0 for a ``q`` that is no number."""
    name, _, value = parameter.strip().partition("=")
    if name.strip().lower() != "q":
        return 1.0
    try:
        return float(value.strip())
    except ValueError:
        return 0.0


class Metrics:
    """The service's Prometheus registry and the observers that feed it."""

    def __init__(
        self,
        reactor: Any,
        stats: Callable[[], dict],
        cost_timer: Callable[[], float] = time.thread_time,
    ) -> None:
        #: Where ``/metrics`` takes its snapshot, and whose pool renders.
        self.reactor = reactor
        #: What an answer cost, in the thread that made it: the CPU time of
        #: that thread (a wall clock would count a wait for the GIL).
        self._cost_timer = cost_timer
        #: The answers given again, by :class:`Scrape`.
        self._answers: RecentByKey[Scrape, Rendered] = RecentByKey(
            self._render_anew, reactor, KEPT_ANSWERS
        )
        # A collector that describes no family (the ProcessCollector below)
        # is still asked at a name[] selection, its samples picked by name:
        # else such a selection never reached it, and
        # ?name[]=process_open_fds answered nothing.
        self.registry = CollectorRegistry(support_collectors_without_names=True)
        self._stats = _StatsCollector(stats)
        self.registry.register(self._stats)
        # The service's own descriptors, memory and CPU under the names every
        # exporter gives them (process_open_fds against process_max_fds is
        # the alert for what sdexec/fdlimit.py guards), read from /proc.
        ProcessCollector(registry=self.registry)
        self.request_errors = Counter(
            "sdexec_request_errors", "Error responses, by request topic.",
            ["topic"], registry=self.registry,
        )  # fmt: skip
        self.dbus_calls = Histogram(
            "sdexec_dbus_call_duration_seconds",
            "D-Bus method calls to systemd (and to the bus daemon as it connects):"
            " duration, by method and outcome.",
            ["method", "outcome"], buckets=DBUS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.start_latency = Histogram(
            "sdexec_exec_start_duration_seconds",
            "From an exec request to its started response.",
            buckets=START_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.units_started = Counter(
            "sdexec_units_started", "Units that started (a started response).",
            registry=self.registry,
        )  # fmt: skip
        self.units_failed = Counter(
            "sdexec_units_failed",
            "Exec streams that ended in an error (start failed, unit lost,"
            " unkillable).",
            registry=self.registry,
        )  # fmt: skip
        self.output_bytes = Counter(
            "sdexec_output_bytes", "Process output forwarded to clients, by stream.",
            ["stream"], registry=self.registry,
        )  # fmt: skip
        #: Labelled children of the metrics fed per message or per D-Bus
        #: call, by metric and label values (few: streams, methods and
        #: outcomes): labels() takes a lock and checks its arguments.
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self.reloads = Counter(
            "sdexec_config_reloads", "Configuration reloads, by outcome (ok, refused).",
            ["outcome"], registry=self.registry,
        )  # fmt: skip
        #: A scrape that fails logs its traceback through it: any local user
        #: may scrape in a loop, and a fault a request provokes would log
        #: one per request (the service stops it as it stops).
        self.log_rate = LogRate(log, reactor)

    def resource(self) -> IResource:
        """``/metrics``: this registry in the text format, or OpenMetrics
        when the scraper asks for it (``Accept``), gzipped when it takes
        that, only the families ``name[]`` names if it names any; ``HEAD``
        as ``GET`` without the body, as ``/stats``."""
        return _MetricsPage(self)

    def answer(self, scrape: Scrape) -> Deferred[Rendered]:
        """The answer to ``scrape``: rendered in the reactor's thread pool
        (in its turn: one at a time, after the last one's rest), or one
        rendered lately given again; cancel it to give it up."""
        return self._answers.get(scrape)

    def stop(self) -> None:
        """The service stops: no answer is made any more, and the failed
        scrapes' log holds nothing back."""
        self._answers.stop()
        self.log_rate.stop()

    def render(self, snapshot: dict, scrape: Scrape) -> Rendered:
        """The exposition of the registry ``scrape`` asks for, the
        ``/stats`` numbers taken from ``snapshot``, and its headers; safe
        in any thread (the compression too: it is not the reactor's)."""
        registry: Any = self.registry
        if scrape.names:
            registry = registry.restricted_registry(_with_samples(scrape.names))
        with self._stats.pinned(snapshot):
            body = scrape.encoder(_WithoutCreated(registry))
        # Chosen by these two fields (RFC 9110, 12.5.5): a cache in front
        # must not give a gzipped or OpenMetrics answer to any other client.
        headers = {"Content-Type": scrape.content_type, "Vary": _NEGOTIATED_BY}
        if scrape.gzipped:
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        return body, headers

    def snapshot(self) -> dict:
        """The ``/stats`` numbers now (in the reactor thread)."""
        return self._stats.read()

    def _render_anew(self, scrape: Scrape) -> Deferred[tuple[Rendered, float]]:
        """A new answer to ``scrape``, and what it cost: its snapshot here
        (the server's thread), its rendering in the pool."""
        began = self._cost_timer()
        snapshot = self.snapshot()
        snapshot_cost = self._cost_timer() - began
        rendering: Deferred[tuple[Rendered, float]] = deferToThreadPool(
            self.reactor,
            self.reactor.getThreadPool(),
            self._timed_render,
            snapshot,
            scrape,
        )
        return rendering.addCallback(lambda made: (made[0], made[1] + snapshot_cost))

    def _timed_render(self, snapshot: dict, scrape: Scrape) -> tuple[Rendered, float]:
        """:meth:`render`, and what it cost (in the pool's thread)."""
        began = self._cost_timer()
        rendered = self.render(snapshot, scrape)
        return rendered, self._cost_timer() - began

    # -- hooks ------------------------------------------------------------

    def dbus_call(self, method: str, seconds: float, ok: bool) -> None:
        """``SystemdClient.on_call``."""
        outcome = "ok" if ok else "error"
        self._child(self.dbus_calls, method, outcome).observe(seconds)

    def error_sent(self, topic: str, errnum: int) -> None:
        """``SdexecServer.observer``: an error response went out (not the
        ENODATA that ends every exec stream)."""
        if errnum != errno.ENODATA:
            self.request_errors.labels(topic=_topic_label(topic)).inc()

    def watch_exec(
        self, responder: Responder, since: float | None = None
    ) -> _ExecWatch:
        """``SdexecServer.observer``: wrap an exec stream's responder; its
        start latency counted from ``since`` (``time.monotonic()`` when the
        request was handled, before its command's lookup), else now."""
        return _ExecWatch(self, responder, since)

    def watch_output(self, responder: Responder) -> _OutputWatch:
        """``SdexecServer.observer``: wrap an attach's or a wait's
        responder (a background process's output reaches clients there)."""
        return _OutputWatch(self, responder)

    def count_output(self, io: dict) -> None:
        """An RFC 24 io object's data went to a client."""
        size = _io_size(io)
        if size:
            self._child(self.output_bytes, io["stream"]).inc(size)

    def reloaded(self, ok: bool) -> None:
        """Count a reload, applied (``ok``) or refused."""
        self.reloads.labels(outcome="ok" if ok else "refused").inc()

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once per label values."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


class _ExecWatch:
    """A responder that notes what passes through it: the start latency,
    output bytes, and how the stream ended."""

    def __init__(
        self, metrics: Metrics, responder: Responder, since: float | None = None
    ) -> None:
        self._metrics = metrics
        self._responder = responder
        self._since: float | None = time.monotonic() if since is None else since

    def respond(self, payload: dict) -> None:
        kind = payload.get("type")
        if kind == "output":
            self._metrics.count_output(payload["io"])
        elif kind == "started" and self._since is not None:
            self._metrics.start_latency.observe(time.monotonic() - self._since)
            self._metrics.units_started.inc()
            self._since = None
        self._responder.respond(payload)

    def error(self, errnum: int, errstr: str) -> None:
        if errnum != errno.ENODATA:  # ENODATA: the stream's normal end
            self._metrics.units_failed.inc()
        self._responder.error(errnum, errstr)


class _OutputWatch:
    """A responder that counts the output passing through it: an attach's
    (its replay and live output) or a wait's answer (its retained output)."""

    def __init__(self, metrics: Metrics, responder: Responder) -> None:
        self._metrics = metrics
        self._responder = responder

    def respond(self, payload: dict) -> None:
        if payload.get("type") == "output":
            self._metrics.count_output(payload["io"])
        for io in payload.get("output", ()):  # a wait's answer
            self._metrics.count_output(io)
        self._responder.respond(payload)

    def error(self, errnum: int, errstr: str) -> None:
        self._responder.error(errnum, errstr)


def _io_size(io: dict) -> int:
    """The bytes of data an RFC 24 io object carries."""
    data = io.get("data")
    if not data:
        return 0
    if isinstance(data, bytes):  # not yet base64 (encode_io's raw)
        return len(data)
    if io.get("encoding") == "base64":
        return len(data) * 3 // 4 - data.count("=", -2)
    # isascii is free; encoding 64 KiB again to count it is not
    return len(data) if data.isascii() else len(data.encode())


class _StatsCollector(Collector):
    """The ``/stats`` numbers as metrics, read at a scrape (reused as the
    ``stats`` callable it is given says): from the snapshot a rendering
    thread has :meth:`pinned`, else (in the reactor thread) read now."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats
        self._pinned = threading.local()

    def read(self) -> dict:
        return self._stats()

    def pinned(self, snapshot: dict) -> _Pinned:
        """While in force, this thread's collects read ``snapshot``."""
        return _Pinned(self._pinned, snapshot)

    def describe(self) -> list[Metric]:
        # Its families are fixed (only their samples are not): named, so a
        # scrape that asks for some by name (?name[]=...) gets them.
        nothing: dict = {
            "requests": {},
            "procs": [],
            "users": {"users": {}},
            "drain": _NOT_DRAINED,
            "systemd": _NO_SYSTEMD,
        }
        return list(_families(nothing))

    def collect(self) -> Iterator[Metric]:
        snapshot = getattr(self._pinned, "snapshot", None)
        yield from _families(snapshot if snapshot is not None else self._stats())


class _WithoutCreated:
    """A registry's metrics without the ``_created`` samples prometheus-client
    adds to each counter and histogram series (the time it was made, as a
    series of its own in the text format): for a service that restarts,
    one more series per series that says only when it last started, and
    that the docs did not list. Left out here, not by prometheus-client's
    ``disable_created_metrics()``, which would take them from every other
    registry in the process too."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        """The registry's metrics, each without its ``_created`` samples."""
        for metric in self._registry.collect():
            created = f"{metric.name}_created"
            kept = copy.copy(metric)  # a collector's own, left as it is
            kept.samples = [s for s in metric.samples if s.name != created]
            yield kept


class _Pinned:
    """A snapshot in force for one thread (a ``with`` block)."""

    def __init__(self, local: threading.local, snapshot: dict) -> None:
        self._local = local
        self._snapshot = snapshot

    def __enter__(self) -> None:
        self._local.snapshot = self._snapshot

    def __exit__(self, *_: object) -> None:
        self._local.snapshot = None


class _MetricsPage(Resource):
    """``/metrics`` (:meth:`Metrics.resource`)."""

    isLeaf = True

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._metrics = metrics

    def render_GET(self, request: Request) -> Any:
        accept = _header(request, b"accept")
        accept_encoding = _header(request, b"accept-encoding")
        args: dict[bytes, list[bytes]] = request.args or {}
        names = [name.decode(errors="replace") for name in args.get(b"name[]", [])]
        rendering = self._metrics.answer(Scrape.asked(accept, accept_encoding, names))
        gone: list[bool] = []

        def left(_: Failure) -> None:
            gone.append(True)
            rendering.cancel()  # not made for it, if it waits its turn

        request.notifyFinish().addErrback(left)

        def answer(rendered: Rendered) -> None:
            if not gone:  # a scraper that left gets nothing written
                _answer(request, *rendered)

        def failed(failure: Failure) -> None:
            if not gone:
                _failed(request, failure, self._metrics.log_rate)

        rendering.addCallbacks(answer, failed)
        return NOT_DONE_YET

    render_HEAD = render_GET  # :func:`_answer` writes no body for HEAD


#: The names of the samples of a counter's or a histogram's family.
_SAMPLE_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _with_samples(names: tuple[str, ...]) -> list[str]:
    """``names``, and the samples each names if it is a counter's or a
    histogram's family: prometheus-client selects by sample name alone,
    so a histogram named as its ``# TYPE`` line names it
    (``sdexec_dbus_call_duration_seconds``) got nothing, nor did a counter
    named as OpenMetrics' names it (``sdexec_requests``)."""
    return [*names, *(name + suffix for name in names for suffix in _SAMPLE_SUFFIXES)]


def _header(request: Request, name: bytes) -> str:
    """A request header's value as text, ``""`` if absent. Asked by a
    ``str`` name, Twisted decodes the value as UTF-8 and raises on other
    bytes: any local user's ``Accept: \\xff`` was a 500 and a critical
    traceback in the journal per request, past the rate the failed scrapes'
    log keeps to. Latin-1 reads every byte; a value so spelt names no
    format and gets the text format, as one not understood."""
    value = request.getHeader(name)
    return value.decode("latin-1") if value else ""


def _answer(request: Request, body: bytes, headers: dict[str, str]) -> None:
    """Write ``body`` with ``headers`` and its length: a HEAD's too, which
    gets no body (it had no length, which a HEAD is to tell; a GET's was
    chunked, a body of one piece)."""
    for name, value in headers.items():
        request.setHeader(name, value)
    request.setHeader(b"content-length", b"%d" % len(body))
    if request.method != b"HEAD":
        request.write(body)
    request.finish()


def _encoder(accept: str) -> tuple[Callable[[Any], bytes], str]:
    """The format ``accept`` asks for, else the text format 0.0.4, as for
    a type prometheus-client does not know: it raises ``TypeError`` for a
    version that is not all numbers (``text/plain; version=x``), and each
    such scrape was a 500 and a traceback in the journal."""
    try:
        encoder, content_type = choose_encoder(accept)
        return encoder, _version_written(content_type)
    except (TypeError, ValueError):
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4


def _version_written(content_type: str) -> str:
    """``content_type`` naming the OpenMetrics version prometheus-client
    writes for the one asked: 1.0.0, or 2.0.0 from 2.0.0 on. It names the
    version asked (``version=9``), a format nobody wrote. ``TypeError`` for
    a version that is not all numbers past its first (``2.x``)."""
    media, *parameters = content_type.split(";")
    if media != "application/openmetrics-text":
        return content_type
    for index, parameter in enumerate(parameters):
        name, _, value = parameter.strip().partition("=")
        if name == "version":
            written = "2.0.0" if parse_version(value) >= (2, 0, 0) else "1.0.0"
            parameters[index] = f" version={written}"
    return ";".join([media, *parameters])


def _failed(request: Request, failure: Failure, log_rate: LogRate) -> None:
    log_rate.emit(
        LogLevel.critical, "render", "rendering /metrics", log_failure=failure
    )
    request.setResponseCode(500)
    request.finish()


_NOT_DRAINED: dict[str, Any] = {"drained": False, "reason": None, "causes": []}
_NO_SYSTEMD = {
    "connected": False,
    "calls": {"unanswered": 0, "queued": 0, "oldest": None},
}


def _families(stats: dict) -> Iterator[Metric]:
    """The ``/stats`` numbers' metric families."""
    counters = stats["requests"]
    yield _requests(counters)
    yield from _events(counters)
    yield _processes(stats["procs"])
    yield _connections(stats["users"])
    yield from _drained(stats["drain"])
    yield from _systemd(stats["systemd"])


def _requests(counters: dict[str, int]) -> Metric:
    family = CounterMetricFamily(
        "sdexec_requests", "Requests dispatched, by topic.", labels=["topic"]
    )
    for topic in Topic:
        family.add_metric([topic.value], counters.get(topic.value, 0))
    return family


def _events(counters: dict[str, int]) -> Iterator[Metric]:
    for key, (name, documentation) in EVENT_COUNTERS.items():
        yield CounterMetricFamily(
            f"sdexec_{name}", documentation, value=counters.get(key, 0)
        )
    stop_timer = CounterMetricFamily(
        "sdexec_stop_timer_events",
        "Stop-timer actions on units left deactivating, by event.",
        labels=["event"],
    )
    for key, count in sorted(counters.items()):
        if key.startswith(STOP_TIMER_PREFIX):
            stop_timer.add_metric([key[len(STOP_TIMER_PREFIX) :]], count)
    yield stop_timer


def _processes(procs: list[dict]) -> Metric:
    family = GaugeMetricFamily(
        "sdexec_processes",
        "Processes the service tracks, by state: R running, Z finished and"
        " not yet reaped, O a leftover unit of an earlier run.",
        labels=["state"],
    )  # fmt: skip
    # Every state always, 0 included: a series that vanished when the
    # node went idle went stale, and sum() and == 0 alerts had nothing.
    states = dict.fromkeys(PROCESS_STATES, 0)
    for proc in procs:
        states[proc["state"]] = states.get(proc["state"], 0) + 1
    for state, count in states.items():
        family.add_metric([state], count)
    return family


def _connections(users: dict) -> Metric:
    family = GaugeMetricFamily(
        "sdexec_connections",
        "Client connections open, by peer uid: the owner's against [sdexec]"
        " max-connections (not counting the 3 reserved for its admin"
        " commands), each other uid's against max-connections-per-user.",
        labels=["uid"],
    )  # fmt: skip
    # The uids /stats lists under users (at most STATS_USERS, the owner's
    # always): bounded, whatever allow-users lists or who connects.
    for uid, held in users["users"].items():
        family.add_metric([uid], held["connections"])
    return family


def _drained(drain: dict) -> Iterator[Metric]:
    # No reason as a label: it changes while the node stays drained (a
    # leftover count, a second cause), and each change would start a new
    # series, restarting an alert's for:. The text is /stats'.
    yield GaugeMetricFamily(
        "sdexec_drained",
        "1 while the node is drained (no new processes); why: /stats.",
        value=1 if drain["drained"] else 0,
    )
    family = GaugeMetricFamily(
        "sdexec_drain_causes",
        "Drain causes in force, by kind (admin: only an undrain clears it).",
        labels=["kind"],
    )
    kinds = [cause["kind"] for cause in drain["causes"]]
    for kind in KINDS:
        family.add_metric([kind], kinds.count(kind))
    yield family


def _systemd(systemd: dict) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "sdexec_systemd_connected",
        "1 while the systemd manager is reachable and subscribed.",
        value=1 if systemd["connected"] else 0,
    )
    calls = systemd["calls"]
    waiting = GaugeMetricFamily(
        "sdexec_systemd_calls_waiting",
        "D-Bus calls to the manager sent and unanswered, or queued for a slot.",
        labels=["state"],
    )
    for state in ("unanswered", "queued"):
        waiting.add_metric([state], calls[state])
    yield waiting
    oldest = calls["oldest"]
    yield GaugeMetricFamily(
        "sdexec_systemd_oldest_call_seconds",
        "How long the oldest unanswered call to the manager has waited (0: none).",
        value=0 if oldest is None else oldest["seconds"],
    )
