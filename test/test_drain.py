"""The node's drain: each cause kept apart (sdexec/drain.py). A cause that
lifts itself (systemd away, a manager too old, leftovers stopping) lifts
only its own drain; an admin's undrain clears only what an admin must, and
says what still holds. Kept as one string, a second cause replaced the
first, and a cause still present was lost. Offline: FakeManager, a Clock."""

from __future__ import annotations

import errno

import pytest
from offline import Connection, error_of
from pytest_twisted import ensureDeferred
from test_devicefence import contained_config, offline_server
from test_leftovers import (
    leftover,
    logged_during,
    make_server,
    server_of,
    server_with_an_abandoned_leftover,
)
from test_server import FLAGS, TRUE
from twisted.logger import LogLevel, capturedLogs, formatEvent

from sdexec.config import parse_config
from sdexec.containment import Containment
from sdexec.drain import AdminCause, Drains, SelfLifting
from sdexec.managerversion import version_problem
from sdexec.outage import SystemdOutage
from sdexec.systemd import SystemdError
from sdexec.testing import INACTIVE, FakeManager

UNKILLABLE = "unkillable user processes for job f42"
#: What systemd 239 answers a unit of Type=exec.
UNKNOWN_TYPE_EXEC = SystemdError(
    "org.freedesktop.DBus.Error.InvalidArgs", "Invalid Type setting: exec"
)


def test_causes_are_kept_apart_and_cleared_by_whom_they_belong_to():
    drains = Drains()
    assert (drains.reason, bool(drains)) == (None, False)
    drains.add("systemd unreachable for 60 s", SelfLifting.OUTAGE)
    assert drains.only_self_lifting
    drains.add(UNKILLABLE, AdminCause.UNKILLABLE)
    assert drains.reason == f"systemd unreachable for 60 s; {UNKILLABLE}"
    assert not drains.only_self_lifting
    assert drains.causes == [
        {
            "reason": "systemd unreachable for 60 s",
            "kind": "outage",
            "lifts-itself": True,
            "cause": "outage",
        },
        {
            "reason": UNKILLABLE,
            "kind": "admin",
            "lifts-itself": False,
            "cause": "unkillable",
        },
    ]
    assert drains.clear_admins() == [UNKILLABLE]
    assert drains.reason == "systemd unreachable for 60 s"
    assert drains.lift(SelfLifting.VERSION) is None  # not in force: nothing
    assert drains.lift(SelfLifting.OUTAGE) == "systemd unreachable for 60 s"
    assert not drains


def test_a_self_lifting_cause_is_said_afresh_not_twice():
    drains = Drains()
    assert drains.add("2 leftover units", SelfLifting.LEFTOVERS)
    assert drains.add("1 leftover unit", SelfLifting.LEFTOVERS)
    assert not drains.add("1 leftover unit", SelfLifting.LEFTOVERS)
    assert drains.reason == "1 leftover unit"


def causes_of(server) -> list[str]:
    """What drained the server, each cause in force (its ``/stats``)."""
    return [cause["cause"] for cause in server.stats()["drain"]["causes"]]


def reload_with_containment(server, on: bool) -> None:
    """What a reload does to the server (service.reload)."""
    config = parse_config({"exec": {"sdexec-constrain-resources": on}})
    server.reconfigure(config, Containment(config, None))
    server.check_manager_version()
    server.verify_devices()


@ensureDeferred
async def test_a_manager_too_old_is_named_and_no_canary_blames_the_fence():
    server, systemd, _ = offline_server()
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    systemd.version = "239 (239-78.el8)"
    systemd.refuse_start = UNKNOWN_TYPE_EXEC
    server.check_manager_version()  # the start: this, then the canary
    await server.verify_devices()
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (
        errno.EIO,
        f"node is drained: {version_problem('239', fenced=True)}"
        " (lifted once that is mended, not by waiting)",
    )
    connection.close()
    assert [call for call in systemd.calls if call[0] == "start"] == []
    systemd.lose()  # upgraded, the manager restarted
    systemd.version, systemd.refuse_start = "252", None
    systemd.restore()
    assert server.drain_reason is None
    assert [call[0] for call in systemd.calls].count("start") == 1  # the canary


def test_a_version_problem_found_while_drained_outlives_the_admins_undrain(
    systemd, server
):
    systemd.version = "243"  # runs units; fences need 244
    server.drain(UNKILLABLE, AdminCause.UNKILLABLE)
    reload_with_containment(server, on=True)
    problem = version_problem("243", fenced=True)
    assert causes_of(server) == ["unkillable", "version"]
    assert server.undrain() == {
        "reason": UNKILLABLE,
        "cleared": [UNKILLABLE],
        "still": problem,
        "remaining": [problem],
    }
    assert server.drain_reason == problem
    reload_with_containment(server, on=False)
    assert server.drain_reason is None


def test_leftovers_still_stopping_outlive_the_undrain_of_another_cause(systemd):
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd)
    server.leftovers.scan()
    server.drain(UNKILLABLE, AdminCause.UNKILLABLE)
    assert causes_of(server) == ["leftovers", "unkillable"]
    still = "1 leftover unit from a previous run"
    assert server.undrain() == {
        "reason": UNKILLABLE,
        "cleared": [UNKILLABLE],
        "still": still,
        "remaining": [still],
    }
    systemd.change("sdexec-a.service", INACTIVE)
    assert server.drain_reason is None


def test_an_outage_past_its_timeout_drains_though_drained_already(systemd, server):
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    server.drain(UNKILLABLE, AdminCause.UNKILLABLE)
    systemd.lose("the manager left the bus")
    server.clock.advance(60)
    assert causes_of(server) == ["unkillable", "outage"]
    server.undrain()
    assert server.stats()["drain"]["drained"]  # systemd is still away
    systemd.restore()
    assert server.drain_reason is None


def test_the_leftover_drain_lifts_though_an_abandoned_leftover_remains(systemd):
    server = server_with_an_abandoned_leftover(systemd)
    server.undrain()  # the admin accepts its unkillable processes
    assert server.drain_reason is None
    leftover(systemd, "sdexec-b.service")  # a unit restarted by hand, say
    server.leftovers.scan()
    assert server.drain_reason == "1 leftover unit"
    systemd.change("sdexec-b.service", INACTIVE)
    assert server.drain_reason is None


def test_a_refusal_says_who_clears_the_drain():
    drains = Drains()
    drains.add("1 leftover unit", SelfLifting.LEFTOVERS)
    assert drains.who_clears == "lifted once that is over"
    # Flux copies the refusal (EIO) into the rank's drain reason: one that
    # waiting does not cure must not say it passes (review session 42 A3).
    drains.add("systemd 239 is too old", SelfLifting.VERSION)
    assert drains.who_clears == "lifted once that is mended, not by waiting"
    drains.lift(SelfLifting.VERSION)
    drains.add(UNKILLABLE, AdminCause.UNKILLABLE)
    assert drains.who_clears == "sdexec undrain clears what does not lift itself"
    drains.lift(SelfLifting.LEFTOVERS)
    assert drains.who_clears == "sdexec undrain clears it"


@pytest.mark.parametrize(
    ("kind", "errnum"),
    [
        (SelfLifting.OUTAGE, errno.EBUSY),
        (SelfLifting.LEFTOVERS, errno.EBUSY),
        (SelfLifting.VERSION, errno.EIO),
        (SelfLifting.SITE_PROPERTY, errno.EIO),
        (AdminCause.FENCE, errno.EIO),  # an admin's
    ],
)
def test_a_drain_waiting_will_not_cure_refuses_with_eio(server, kind, errnum):
    # Flux's job-exec drains its rank on EIO only: on EBUSY it failed
    # each job the scheduler went on placing on a node drained here.
    server.drain("the cause", kind)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last())[0] == errnum
    connection.close()


def test_an_outage_alone_is_ebusy_and_with_an_admins_cause_eio(server):
    outage = "systemd unreachable for 60 s"
    server.drain(outage, SelfLifting.OUTAGE)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (
        errno.EBUSY,
        f"node is drained: {outage} (lifted once that is over)",
    )
    server.drain(UNKILLABLE, AdminCause.UNKILLABLE)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (
        errno.EIO,
        f"node is drained: {outage}; {UNKILLABLE}"
        " (sdexec undrain clears what does not lift itself)",
    )
    server.undrain()  # say, after Flux's own undrain: both are needed
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last())[0] == errno.EBUSY
    connection.close()


def test_a_restated_cause_is_not_logged_as_a_new_drain(systemd):
    leftover(systemd, "sdexec-a.service", pid=71)
    leftover(systemd, "sdexec-b.service", pid=72)
    server = make_server(systemd)
    logged = logged_during(server.leftovers.scan)
    logged_after = logged_during(lambda: systemd.change("sdexec-a.service", INACTIVE))
    assert [line for line in logged if "draining" in line] == [
        "draining: 2 leftover units from a previous run"
    ]
    assert [line for line in logged_after if "drain" in line] == [
        "still drained: 1 leftover unit from a previous run"
    ]


def test_a_reload_to_keep_leftovers_lifts_their_drain(systemd):
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd)
    server.leftovers.scan()
    assert server.drain_reason == "1 leftover unit from a previous run"
    config = parse_config({"sdexec": {"leftover-units": "keep"}})
    server.reconfigure(config, Containment(config, None))
    assert server.drain_reason is None


def test_a_reload_to_stop_leftovers_stops_those_kept_and_drains(systemd):
    # Drained for units nothing stopped: the drain, which no undrain
    # clears, would have lasted till the next scan.
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd, policy="keep")
    server.leftovers.scan()
    assert server.drain_reason is None
    config = parse_config({"sdexec": {"leftover-units": "stop"}})
    server.reconfigure(config, Containment(config, None))
    assert ("stop", "sdexec-a.service") in systemd.calls
    assert server.drain_reason == "1 leftover unit from a previous run"
    systemd.change("sdexec-a.service", INACTIVE)
    assert server.drain_reason is None


def not_taken(name: str) -> SystemdError:
    """What a manager answers a start with a property it does not take."""
    return SystemdError(
        "org.freedesktop.DBus.Error.PropertyReadOnly",
        f"Cannot set property {name}, or unknown property.",
    )


#: What systemd 252 (a Debian 12 or RHEL 9 node) answers a site's
#: PrivatePIDs (systemd 257), and sdexec adds to it.
PRIVATE_PIDS_REFUSED = (
    "Cannot set property PrivatePIDs, or unknown property."
    " (exec.sdexec-properties sets it; systemd 252 does not take it)"
)


PRIVATE_PIDS_DRAIN = (
    "exec.sdexec-properties sets PrivatePIDs, which systemd 252 does not take:"
    " every job would fail (remove it and reload, or upgrade systemd)"
)


def server_with_site_property(systemd):
    config = parse_config({"exec": {"sdexec-properties": {"PrivatePIDs": "yes"}}})
    systemd.version = "252.38-1~deb12u1"
    systemd.refuse_start = not_taken("PrivatePIDs")
    return server_of(systemd, config)


def test_a_site_property_the_manager_does_not_take_drains_the_node(systemd):
    # Every job failed, each naming a property, on a node that looked
    # healthy: the job manager went on sending it jobs.
    server = server_with_site_property(systemd)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (errno.EINVAL, PRIVATE_PIDS_REFUSED)
    assert server.drain_reason == PRIVATE_PIDS_DRAIN
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (
        errno.EIO,
        f"node is drained: {PRIVATE_PIDS_DRAIN}"
        " (lifted once that is mended, not by waiting)",
    )
    assert [call[0] for call in systemd.calls].count("start") == 1
    connection.close()


def test_the_site_property_drain_lifts_for_another_manager_or_a_reload(systemd):
    server = server_with_site_property(systemd)
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.lose()  # the same manager, back: it would refuse every job again
    systemd.restore()
    assert server.drain_reason is not None
    systemd.lose()  # upgraded
    systemd.version, systemd.refuse_start = "257.9", None
    systemd.restore()
    assert server.drain_reason is None
    server.property_not_taken("PrivatePIDs")
    assert server.drain_reason == PRIVATE_PIDS_DRAIN.replace("252", "257")
    config = parse_config({})  # the admin took it out
    server.reconfigure(config, Containment(config, None))
    assert server.drain_reason is None
    connection.close()


def test_a_request_property_the_manager_does_not_take_fails_that_request_alone(
    systemd,
):
    server = server_of(
        systemd, parse_config({"sdexec": {"request-properties": ["PrivatePIDs"]}})
    )
    systemd.version, systemd.refuse_start = "252", not_taken("PrivatePIDs")
    connection = Connection(server)
    command = {**TRUE, "opts": {**TRUE["opts"], "SDEXEC_PROP_PrivatePIDs": "yes"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": command})
    assert error_of(connection.last()) == (
        errno.EINVAL,
        "Cannot set property PrivatePIDs, or unknown property."
        " (the request sets it; systemd 252 does not take it)",
    )
    assert server.drain_reason is None
    connection.close()


def test_a_site_property_sent_under_another_name_is_named_as_the_site_wrote_it(
    systemd,
):
    # "sets MemoryZSwapMaxScale", a key the admin's file does not have
    # (review 38 R2-1).
    site = {"MemoryZSwapMax": "10%"}
    server = server_of(systemd, parse_config({"exec": {"sdexec-properties": site}}))
    systemd.version = "252"
    server.property_not_taken("MemoryZSwapMaxScale")
    assert server.drain_reason == (
        "exec.sdexec-properties sets MemoryZSwapMax (sent as MemoryZSwapMaxScale),"
        " which systemd 252 does not take: every job would fail (remove it and"
        " reload, or upgrade systemd)"
    )


def test_a_start_planned_before_the_reload_that_fixed_it_does_not_drain_again(
    systemd,
):
    # Answered after the reload that took the property out, its refusal
    # drained the node for a configuration no longer in force (review 38 R-2).
    server = server_with_site_property(systemd)
    config = parse_config({})
    server.reconfigure(config, Containment(config, None))
    server.property_not_taken("PrivatePIDs")
    assert server.drain_reason is None


def test_a_site_property_a_request_also_sets_drains_the_node(systemd):
    # The request's tighter value went in its stead, so the refusal was the
    # request's alone and the node stayed open to jobs that would all fail
    # (review 38 R-3).
    site = {"MemoryZSwapMax": "1G"}
    table = {
        "exec": {"sdexec-properties": site},
        "sdexec": {"request-properties": ["MemoryZSwapMax"]},
    }
    server = server_of(systemd, parse_config(table))
    systemd.version, systemd.refuse_start = "252", not_taken("MemoryZSwapMax")
    connection = Connection(server)
    command = {**TRUE, "opts": {**TRUE["opts"], "SDEXEC_PROP_MemoryZSwapMax": "512M"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": command})
    assert error_of(connection.last())[0] == errno.EINVAL
    assert server.drain_reason == (
        "exec.sdexec-properties sets MemoryZSwapMax, which systemd 252 does not"
        " take: every job would fail (remove it and reload, or upgrade systemd)"
    )
    connection.close()


@ensureDeferred
async def test_a_site_property_refusing_the_canary_does_not_blame_the_fence():
    # The canary's unit carries the site's properties: its refusal read as
    # "DevicePolicy could not be verified", a drain only an undrain clears,
    # which outlived the reload that took the property out.
    table = contained_config()
    table["exec"]["sdexec-properties"] = {"PrivatePIDs": "yes"}
    config = parse_config(table)
    systemd = FakeManager()
    systemd.version, systemd.refuse_start = "252", not_taken("PrivatePIDs")
    server = server_of(systemd, config)
    assert await server.verify_devices() is None
    assert [cause["kind"] for cause in server.drains.causes] == ["site-property"]
    assert [cause["cause"] for cause in server.drains.causes] == ["site-property"]
    assert server.device_canary.verdict is None
    systemd.refuse_start = None
    config = parse_config(contained_config())  # the admin took it out
    server.reconfigure(config, Containment(config, None))
    server.verify_devices()
    assert [call[0] for call in systemd.calls].count("start") == 2  # run again
    assert server.drain_reason is None


def _abandoned(count: int) -> list[str]:
    return [f"unit sdexec-{n}.service abandoned" for n in range(count)]


def test_an_undrain_of_hundreds_of_causes_names_ten_in_its_line(server):
    # Each abandoned unit is a cause: "undrained (was: …)" named all 300,
    # a line of tens of kilobytes. Now the first ten, and every one in a
    # debug line of its own (the undrain's reply has them all, too).
    causes = _abandoned(300)
    for cause in causes:
        server.drain(cause, AdminCause.ABANDONED_UNIT)
    with capturedLogs() as events:
        assert server.undrain()["cleared"] == causes
    said = {
        event["log_level"]: formatEvent(event)
        for event in events
        if "undrained" in formatEvent(event)
    }
    assert said == {
        LogLevel.info: f"undrained (was: {'; '.join(causes[:10])} and 290 more)",
        LogLevel.debug: f"undrained causes (all 300): {'; '.join(causes)}",
    }


def test_an_exec_refused_for_hundreds_of_causes_names_ten_and_says_how(
    server, connection
):
    # Cut at 4096 characters, the errstr lost its end: how the drain goes.
    causes = _abandoned(300)
    for cause in causes:
        server.drain(cause, AdminCause.ABANDONED_UNIT)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (
        errno.EIO,
        f"node is drained: {'; '.join(causes[:10])} and 290 more causes"
        " (sdexec stats) (sdexec undrain clears it)",
    )
    assert [cause["reason"] for cause in server.stats()["drain"]["causes"]] == causes


def test_a_drain_of_ten_causes_names_them_all(server):
    causes = _abandoned(10)
    for cause in causes:
        server.drain(cause, AdminCause.ABANDONED_UNIT)
    with capturedLogs() as events:
        server.undrain()
    assert [formatEvent(event) for event in events] == [
        f"undrained (was: {'; '.join(causes)})"
    ]
