"""What a client is told when a call is lost with the bus connection, and
what the service says of a bus with no manager to be had."""

from __future__ import annotations

import pytest
from pytest_twisted import ensureDeferred
from support import private_bus
from twisted.internet.task import Clock

from sdexec.property import UnitProperty
from sdexec.systemd.bus import SystemdClient, _why_lost
from sdexec.systemd.errors import MANAGER_AWAY, SystemdError, explain_start_refusal


@pytest.mark.parametrize(
    ("error", "told"),
    [
        # dbus-fast's when the bus closes under a call: clients read
        # "systemd connection lost: EOFError".
        (EOFError(), "the D-Bus connection closed"),
        (BrokenPipeError(), "the D-Bus connection closed"),
        # The errno's words, not Python's "[Errno 32] Broken pipe" (seen
        # by clients of a burst whose dbus-daemon was killed).
        (OSError(104, "Connection reset by peer"), "Connection reset by peer"),
        (BrokenPipeError(32, "Broken pipe"), "Broken pipe"),
        (RuntimeError(), "the D-Bus connection failed (RuntimeError)"),
    ],
)
def test_a_lost_call_says_why_in_words(error, told):
    assert _why_lost(error) == told


#: The session bus's activation file for the manager's name, as systemd's
#: Debian package ships it: a user bus started without a user manager
#: (dbus-launch, dbus-run-session) "activates" it by running /bin/false.
MANAGER_ACTIVATION = """[D-BUS Service]
Name=org.freedesktop.systemd1
Exec=/bin/false
"""


@ensureDeferred
async def test_a_bus_that_cannot_start_the_manager_says_there_is_none(tmp_path):
    # The first Subscribe lets the bus start the manager; where it can only
    # fail to, the start was "sdexec could not start: Process
    # org.freedesktop.systemd1 exited with status 1", naming no manager.
    services = tmp_path / "services"
    services.mkdir()
    (services / "org.freedesktop.systemd1.service").write_text(MANAGER_ACTIVATION)
    async with private_bus(tmp_path, services) as address:
        with pytest.raises(SystemdError) as refused:
            await SystemdClient.connect(address, clock=Clock())
    assert refused.value.name == MANAGER_AWAY
    assert str(refused.value).startswith("no systemd manager on this bus: ")
    assert str(refused.value).endswith(
        " (Process org.freedesktop.systemd1 exited with status 1)"
    )


@pytest.mark.parametrize(
    ("message", "named"),
    [
        # A bad string-valued property: "Invalid argument", naming nothing.
        (
            "Failed to set unit properties: Invalid argument",
            " (one of the string-valued properties: KeyringMode=bogus)",
        ),
        # One systemd types otherwise, sent as a string.
        (
            "Unexpected message contents",
            " (systemd types one of these otherwise, and sdexec sent it as a"
            " string: KeyringMode=bogus; share/doc/sdexec/configuration.md lists"
            " the properties sdexec types)",
        ),
        # One that names its property already.
        ("Invalid value for KeyringMode", ""),
    ],
)
def test_a_refusal_that_names_no_property_names_the_string_valued_ones(message, named):
    sent = [
        UnitProperty("Type", "s", "exec"),  # sdexec's own: no suspect
        UnitProperty("KeyringMode", "s", "bogus", source="config"),
    ]
    assert explain_start_refusal(message, sent, "252") == message + named


def test_a_refusal_with_nothing_to_suspect_is_as_systemd_said():
    sent = [UnitProperty("Type", "s", "exec")]
    message = "Failed to set unit properties: Invalid argument"
    assert explain_start_refusal(message, sent, "252") == message
