"""``GET /metrics``: scraped from a running service and parsed with
prometheus-client's own parsers, in both formats it negotiates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import treq
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from pytest_twisted import ensureDeferred
from support import run, wait_until_reaped

from sdexec.drain import KINDS, AdminCause

pytestmark = pytest.mark.systemd

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
OPERATING = Path(__file__).resolve().parent.parent / "docs" / "operating.md"
#: A row of operating.md's metric tables: its name, type and labels.
METRIC_ROW = re.compile(
    r"^\| `((?:sdexec|process)_\w+)` \| (\w+) \|([^|]*)\|", re.MULTILINE
)


async def _get(url: str, accept: str | None = None) -> tuple[str, str]:
    headers = {"Accept": [accept]} if accept else None
    response = await treq.get(url, headers=headers, persistent=False)
    assert response.code == 200
    content_type = response.headers.getRawHeaders("content-type")[0]
    return content_type, await treq.text_content(response)


def _samples(families) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of every sample."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


@ensureDeferred
async def test_metrics_agree_with_stats_and_observe_latency(sdexec, tmp_path):
    client = await sdexec.connect()
    # Bytes, however they travel: not UTF-8 (base64), text beyond ASCII.
    printed = await run(client, ["sh", "-c", r"printf '12\377\303\251'; printf é >&2"])
    assert printed.status == 0
    missing = await run(client, ["/nonexistent/command"])  # refused: no unit
    assert missing.error is not None
    garbage = tmp_path / "not-a-program"
    garbage.write_bytes(b"\x00\x01garbage")
    garbage.chmod(0o755)
    failed = await run(client, [str(garbage)])  # its unit fails: 203/EXEC
    assert failed.error is not None
    await wait_until_reaped(sdexec, "sdexec-*")
    sdexec.server.drain("fence check failed for sdexec-x.service", AdminCause.FENCE)
    assert await sdexec.service.reload()

    base = sdexec.stats_url.removesuffix("/stats")
    stats = json.loads((await _get(sdexec.stats_url))[1])
    content_type, text = await _get(base + "/metrics")
    assert content_type.startswith("text/plain; version=")
    samples = _samples(parse_text(text))

    assert (
        samples[("sdexec_requests_total", (("topic", "sdexec.exec"),))]
        == (stats["requests"]["sdexec.exec"])
    )
    assert samples[("sdexec_request_errors_total", (("topic", "sdexec.exec"),))] == 2
    assert samples[("sdexec_processes_reaped_total", ())] == stats["requests"]["reaped"]
    assert samples[("sdexec_fence_failures_total", ())] == 0
    assert samples[("sdexec_job_timeouts_total", ())] == 0
    assert samples[("sdexec_jobs_unkillable_total", ())] == 0
    assert samples[("sdexec_drained", ())] == 1
    causes = {
        kind: samples[("sdexec_drain_causes", (("kind", kind),))] for kind in KINDS
    }
    assert causes == {
        "outage": 0,
        "version": 0,
        "leftovers": 0,
        "site-property": 0,
        "admin": 1,
    }
    assert samples[("sdexec_units_started_total", ())] == 1
    assert samples[("sdexec_units_failed_total", ())] == 1
    assert samples[("sdexec_output_bytes_total", (("stream", "stdout"),))] == 5
    assert samples[("sdexec_output_bytes_total", (("stream", "stderr"),))] == 2
    assert samples[("sdexec_config_reloads_total", (("outcome", "ok"),))] == 1
    assert samples[("sdexec_exec_start_duration_seconds_count", ())] == 1
    assert samples[("sdexec_exec_start_duration_seconds_sum", ())] > 0
    start_calls = (("method", "StartTransientUnit"), ("outcome", "ok"))
    assert samples[("sdexec_dbus_call_duration_seconds_count", start_calls)] == 2
    assert samples[("sdexec_dbus_call_duration_seconds_sum", start_calls)] > 0
    assert samples[("sdexec_systemd_connected", ())] == 1
    waiting = ("sdexec_systemd_calls_waiting", (("state", "queued"),))
    assert samples[waiting] == stats["systemd"]["calls"]["queued"] == 0
    assert samples[("sdexec_systemd_oldest_call_seconds", ())] >= 0


@ensureDeferred
async def test_openmetrics_is_negotiated(sdexec):
    base = sdexec.stats_url.removesuffix("/stats")
    content_type, text = await _get(base + "/metrics", accept=OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    families = {family.name: family for family in parse_openmetrics(text)}
    assert families["sdexec_requests"].type == "counter"
    assert families["sdexec_drained"].type == "gauge"
    assert _samples([families["sdexec_drained"]]) == {("sdexec_drained", ()): 0}
    assert families["sdexec_dbus_call_duration_seconds"].type == "histogram"


@ensureDeferred
async def test_client_topics_do_not_become_labels(sdexec):
    client = await sdexec.connect()
    with pytest.raises(Exception, match="unknown topic"):
        await client.rpc("made.up.topic", {})
    base = sdexec.stats_url.removesuffix("/stats")
    samples = _samples(parse_text((await _get(base + "/metrics"))[1]))
    assert samples[("sdexec_request_errors_total", (("topic", "other"),))] == 1
    assert not any("made.up" in str(labels) for _, labels in samples)


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """operating.md's "Prometheus metrics" tables: ``{name: (type, labels)}``,
    each counter named as its samples are (``_total``)."""
    text = OPERATING.read_text()
    section = text.split("## Prometheus metrics", 1)[1].split("\n## ", 1)[0]
    return {
        name: (kind, frozenset(re.findall(r"`(\w+)`", labels)))
        for name, kind, labels in METRIC_ROW.findall(section)
    }


def served_metrics(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """A text-format scrape's families: ``{name: (type, labels)}``, labels
    read from their samples (``le`` is a histogram's own)."""
    served = {}
    for family in parse_text(text):
        assert family.documentation.strip(), f"{family.name}: no HELP text"
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {key for sample in family.samples for key in sample.labels}
        served[name] = (family.type, frozenset(labels - {"le"}))
    return served


@ensureDeferred
async def test_operating_md_lists_every_metric_served_with_its_labels(sdexec):
    # The tables were kept by hand: a metric added without its row (or a
    # row left for one renamed) went unseen by the admins building alerts.
    client = await sdexec.connect()
    assert (await run(client, ["sh", "-c", "echo out"])).status == 0
    with pytest.raises(Exception, match="unknown topic"):
        await client.rpc("made.up.topic", {})
    assert await sdexec.service.reload()
    # A lingering unit's stop-timer signal, as sdexec/process.py counts it:
    # its family's label is only seen on a sample.
    sdexec.server.count("stop-timer-signal")
    await wait_until_reaped(sdexec, "sdexec-*")
    base = sdexec.stats_url.removesuffix("/stats")
    served = served_metrics((await _get(base + "/metrics"))[1])
    assert served == documented_metrics()


@ensureDeferred
async def test_operating_md_names_every_d_bus_method_a_start_calls(sdexec):
    # An admin reading method="AddMatch" found no word of it: the row named
    # only calls to systemd, and the bus daemon's (AddMatch, GetNameOwner)
    # and the manager's property reads (Get) are counted too.
    client = await sdexec.connect()
    assert (await run(client, ["true"])).status == 0
    await wait_until_reaped(sdexec, "sdexec-*")
    base = sdexec.stats_url.removesuffix("/stats")
    text = (await _get(base + "/metrics"))[1]
    methods = {
        sample.labels["method"]
        for family in parse_text(text)
        if family.name == "sdexec_dbus_call_duration_seconds"
        for sample in family.samples
    }
    section = OPERATING.read_text().split("## Prometheus metrics", 1)[1]
    row = next(
        line
        for line in section.splitlines()
        if line.startswith("| `sdexec_dbus_call_duration_seconds`")
    )
    assert {"StartTransientUnit", "AddMatch", "Subscribe"} <= methods
    assert {method for method in methods if f"`{method}`" not in row} == set()
