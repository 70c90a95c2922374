"""A systemd manager too old for sdexec's units drains the node, saying
which version it is and which it needs, rather than letting every start
fail on a property name; a newer one (a restart into an upgrade) lifts
that drain. FakeManager and a Clock."""

from __future__ import annotations

import errno

import pytest
from offline import error_of
from test_server import FLAGS, TRUE
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from sdexec.config import parse_config
from sdexec.drain import AdminCause
from sdexec.managerversion import version_number, version_problem
from sdexec.outage import SystemdOutage
from sdexec.server import SdexecServer

TOO_OLD = (
    "systemd 239 is older than 240, the oldest that runs sdexec's units"
    " (Type=exec): upgrade systemd"
)


@pytest.mark.parametrize(
    ("version", "number"),
    [
        ("252.38-1~deb12u1", 252),  # Debian 12
        ("239 (239-78.el8)", 239),  # RHEL 8
        ("255.4-1ubuntu8", 255),
        ("v256.7", 256),
        ("", None),
        (None, None),
        ("unknown", None),
    ],
)
def test_the_major_version_is_read_from_what_distributions_ship(version, number):
    assert version_number(version) == number


@pytest.mark.parametrize(
    ("version", "fenced", "refused"),
    [
        ("239", False, True),
        ("240", False, False),  # Type=exec
        ("243", True, True),  # AllowedCPUs and AllowedMemoryNodes: 244
        ("244", True, False),
        (None, True, False),  # a manager that does not say is not refused
    ],
)
def test_the_oldest_versions_served(version, fenced, refused):
    assert (version_problem(version, fenced) is not None) is refused


def test_containment_names_what_the_fences_need():
    assert version_problem("243", fenced=True) == (
        "systemd 243 is older than 244, the oldest that applies AllowedCPUs"
        " and AllowedMemoryNodes (sdexec-constrain-resources): upgrade systemd"
    )


@pytest.fixture
def server(systemd):
    config = parse_config({})
    server = SdexecServer(systemd, config, reactor, clock=Clock())
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    return server


def test_a_manager_too_old_drains_the_node_naming_its_version(
    systemd, server, connection
):
    systemd.version = "239 (239-78.el8)"
    server.check_manager_version()
    assert server.drain_reason == TOO_OLD
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    errnum, message = error_of(connection.last())
    assert TOO_OLD in message
    assert not [call for call in systemd.calls if call[0] == "start"]
    assert errnum != errno.EINVAL  # not the request's fault


def test_an_upgraded_manager_lifts_that_drain_and_no_other(systemd, server):
    systemd.version = "239"
    server.check_manager_version()
    systemd.lose()
    systemd.version = "252"
    systemd.restore()
    assert server.drain_reason is None
    server.drain("unkillable processes", AdminCause.UNKILLABLE)  # an admin's to clear
    systemd.version = "239"
    server.check_manager_version()
    assert server.drain_reason == f"unkillable processes; {TOO_OLD}"
    systemd.version = "252"
    server.check_manager_version()
    assert server.drain_reason == "unkillable processes"


def test_a_manager_new_enough_or_silent_is_served(systemd, server):
    for version in ("252.38-1~deb12u1", None):
        systemd.version = version
        server.check_manager_version()
        assert server.drain_reason is None


def test_a_version_not_read_leaves_the_judgement_standing(systemd, server):
    # A Get of Version that failed (NoReply) says nothing of the manager.
    systemd.version = "239"
    server.check_manager_version()
    systemd.version = None
    server.check_manager_version()
    assert server.drain_reason == TOO_OLD


def test_the_manager_s_version_is_said_once_until_it_changes(systemd, server):
    # Each reload judges it again: a storm of 300 SIGHUPs said it 300 times
    # (review session 50). A manager re-executed into another version is
    # said again.
    with capturedLogs() as events:
        for version in ("252.38-1~deb12u1", "252.38-1~deb12u1", "253.1", "253.1"):
            systemd.version = version
            server.check_manager_version()
    said = [formatEvent(e) for e in events if "systemd manager " in formatEvent(e)]
    assert said == ["systemd manager 252.38-1~deb12u1", "systemd manager 253.1"]
