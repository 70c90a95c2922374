"""What the metrics count, offline: the service's counters and hooks read
through the registry as a scrape reads them (sdexec/metrics.py), under the
events an admin alerts on. The fake manager stands in for systemd."""

from __future__ import annotations

import errno

import pytest
from offline import Connection, error_of
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families as parse_text
from pytest_twisted import ensureDeferred
from test_background import (
    WAITABLE,
    Client,
    finish,
    make_server,
    output_of,
    payloads,
    produce,
    tracked_of,
    until,
)
from twisted.internet import defer, reactor
from twisted.internet.task import Clock

from sdexec import connection as connection_module
from sdexec import metrics as metrics_module
from sdexec.config import parse_config
from sdexec.drain import AdminCause, SelfLifting
from sdexec.metrics import Metrics, Scrape
from sdexec.protocol import ExecFlag
from sdexec.server import SdexecServer
from sdexec.systemd import SystemdError
from sdexec.testing import FakeManager

UNIT = "sdexec-t.service"
TRUE = {"cmdline": ["/bin/true"], "opts": {"SDEXEC_NAME": "sdexec-t"}}
FLAGS = int(ExecFlag.STDOUT | ExecFlag.STDERR)


def observed(server: SdexecServer) -> Metrics:
    """``server``'s metrics, hooked in as the service hooks them."""
    metrics = Metrics(reactor, server.stats)
    server.observer = metrics
    return metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape, by name and labels."""
    text, _ = metrics.render(metrics.snapshot(), Scrape.asked("", "", []))
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in parse_text(text.decode())
        for sample in family.samples
    }


def drain_series(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    return {
        key: value
        for key, value in samples(metrics).items()
        if key[0] in ("sdexec_drained", "sdexec_drain_causes")
    }


def test_a_drain_whose_reason_changes_stays_one_series(server):
    # The reason was the label: each leftover stopped, each cause added,
    # started a new series, and an alert's for: began again with each.
    metrics = observed(server)
    server.drain("3 leftover units from a previous run", SelfLifting.LEFTOVERS)
    before = drain_series(metrics)
    server.drain("2 leftover units from a previous run", SelfLifting.LEFTOVERS)
    server.drain("fence check failed for sdexec-x.service", AdminCause.FENCE)
    after = drain_series(metrics)
    assert before.keys() == after.keys()
    assert after == {
        ("sdexec_drained", ()): 1,
        ("sdexec_drain_causes", (("kind", "outage"),)): 0,
        ("sdexec_drain_causes", (("kind", "version"),)): 0,
        ("sdexec_drain_causes", (("kind", "leftovers"),)): 1,
        ("sdexec_drain_causes", (("kind", "site-property"),)): 0,
        ("sdexec_drain_causes", (("kind", "admin"),)): 1,
    }


class SlowLookups:
    """Lookups answered when the test says (a slow file system)."""

    def __init__(self) -> None:
        self._pending: list = []

    def find(self, command, default_cwd, uid=None):
        answer: defer.Deferred = defer.Deferred()
        self._pending.append((answer, command, default_cwd))
        return answer

    def answer(self) -> None:
        for answer, command, default_cwd in self._pending:
            answer.callback(command.find_executable(default_cwd))


def test_the_start_latency_counts_the_command_s_lookup(systemd, monkeypatch):
    # Timed from when the lookup had ended: a file system that took 8 s to
    # answer showed as a 50 ms start, and latency alerts stayed quiet.
    now = [1000.0]

    class Time:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(connection_module, "time", Time)
    monkeypatch.setattr(metrics_module, "time", Time)
    lookups = SlowLookups()
    server = SdexecServer(
        systemd, parse_config({}), reactor, clock=Clock(), lookups=lookups
    )
    metrics = observed(server)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    now[0] += 8.0
    lookups.answer()
    now[0] += 0.05
    systemd.run(UNIT, pid=5)
    assert connection.last()["payload"] == {"type": "started", "pid": 5}
    latency = samples(metrics)
    assert latency[("sdexec_exec_start_duration_seconds_count", ())] == 1
    assert latency[("sdexec_exec_start_duration_seconds_sum", ())] == pytest.approx(
        8.05
    )
    connection.close()


def test_a_refusal_made_once_systemd_answered_is_counted(systemd, server):
    # Counted only when raised at once: a kill of a main process that has
    # exited (the docs' own example) went uncounted.
    metrics = observed(server)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    systemd.run(UNIT, pid=99)
    gone = SystemdError("org.freedesktop.systemd1.NoSuchProcess", "No main process")
    systemd.kill_unit = lambda *args: defer.fail(gone)
    connection.send("sdexec.kill", {"signum": 15, "label": "j"}, matchtag=2)
    assert error_of(connection.last())[0] == errno.ESRCH
    assert samples(metrics)[("sdexec_requests_refused_total", ())] == 1
    assert server.stats()["requests"]["errors"] == 1
    connection.close()


def test_the_help_says_what_refusals_and_mapper_calls_count(server):
    # Said "refused at once", of a count that has the kills of an exited pid
    # systemd answered; and "fenced", of requests refused after the plan.
    text, _ = observed(server).render(server.stats(), Scrape.asked("", "", []))
    help_of = {
        family.name: family.documentation for family in parse_text(text.decode())
    }
    assert "once systemd answered" in help_of["sdexec_requests_refused"]
    assert "refused after the plan" in help_of["sdexec_mapper_calls"]


def test_the_processes_help_says_what_each_state_is(server):
    # Said "by state" of states R, Z and O: a dashboard's reader had to find
    # operating.md to learn that O is a leftover of an earlier run.
    text, _ = observed(server).render(server.stats(), Scrape.asked("", "", []))
    family = next(f for f in parse_text(text.decode()) if f.name == "sdexec_processes")
    for state, meaning in (
        ("R", "running"),
        ("Z", "finished and not yet reaped"),
        ("O", "a leftover"),
    ):
        assert f"{state} {meaning}" in family.documentation


def output_bytes(metrics: Metrics) -> dict[tuple, float]:
    return {
        labels: value
        for (name, labels), value in samples(metrics).items()
        if name == "sdexec_output_bytes_total"
    }


@pytest.fixture
def background():
    """A manager, a server of background processes (test_background's),
    its metrics, and a client."""
    systemd = FakeManager()
    systemd.stop_to_inactive = True
    server = make_server(systemd)
    client = Client(server)
    yield systemd, server, observed(server), client
    client.close()
    systemd.close()


@ensureDeferred
async def test_a_background_process_s_output_is_counted_as_it_reaches_an_attach(
    background,
):
    # Counted only on exec streams: a site running its jobs in the
    # background, attached to, read no output at all.
    systemd, server, metrics, client = background
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    produce(systemd, "stdout", b"before\n")
    await until(lambda: tracked_of(server).retained.held == 7, "retained")
    client.send("sdexec.attach", {"label": "a", "flags": FLAGS}, matchtag=2)
    produce(systemd, "stderr", b"after\n")
    await until(lambda: len(output_of(client.of(2))) == 2, "the live output")
    assert output_bytes(metrics) == {
        (("stream", "stdout"),): 7,  # the replay
        (("stream", "stderr"),): 6,  # live
    }
    await finish(systemd, server, status=0)


@ensureDeferred
async def test_a_wait_s_answer_counts_the_output_it_carries(background):
    systemd, server, metrics, client = background
    client.bg(flags=WAITABLE, label="w")
    systemd.run(UNIT, pid=7)
    produce(systemd, "stdout", b"out 1\n")
    await until(lambda: tracked_of(server).retained.held == 6, "retained")
    await finish(systemd, server, status=0)
    client.send("sdexec.wait", {"pid": 7}, matchtag=3)
    assert payloads(client.of(3))[0]["output"]
    assert output_bytes(metrics) == {(("stream", "stdout"),): 6}


def processes(metrics: Metrics) -> dict[str, float]:
    """``sdexec_processes`` by state."""
    return {
        dict(labels)["state"]: value
        for (name, labels), value in samples(metrics).items()
        if name == "sdexec_processes"
    }


@ensureDeferred
async def test_the_processes_gauge_reads_0_on_an_idle_node(background):
    # Only the states present were emitted: once the last process was
    # reaped the series vanished (stale in Prometheus), and an alert on
    # sdexec_processes{state="R"} == 0 never fired (review session 40 M M3).
    systemd, server, metrics, client = background
    assert processes(metrics) == {"R": 0, "Z": 0, "O": 0}
    client.bg(label="a")
    systemd.run(UNIT, pid=8)
    assert processes(metrics) == {"R": 1, "Z": 0, "O": 0}
    await finish(systemd, server, status=0)
    assert processes(metrics) == {"R": 0, "Z": 0, "O": 0}


@pytest.mark.parametrize(
    "accept", ["", "application/openmetrics-text; version=1.0.0"], ids=["text", "om"]
)
@pytest.mark.parametrize("names", [[], ["sdexec_units_started_created"]])
def test_no_created_series_is_served(server, accept, names):
    # prometheus-client's default added a _created series to every counter
    # and histogram series (its start time: for a service that restarts,
    # noise the docs did not list), and the text format made each a family.
    other = CollectorRegistry()  # another user of prometheus-client
    Counter("other", "Another registry's counter.", registry=other).inc()
    others_before = generate_latest(other)
    metrics = observed(server)
    metrics.units_started.inc()
    metrics.dbus_call("StartTransientUnit", 0.001, True)
    metrics.request_errors.labels(topic="sdexec.exec").inc()
    text, _ = metrics.render(metrics.snapshot(), Scrape.asked(accept, "", names))
    assert (b"sdexec_units_started_total 1.0" in text) == (not names)
    assert b"_created" not in text
    # Left out of this registry's answers alone, not the process's.
    assert (b"other_created" in generate_latest(other)) == (
        b"other_created" in others_before
    )
