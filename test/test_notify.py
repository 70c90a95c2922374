"""sd_notify: what the service tells systemd, caught on a datagram socket."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from pytest_twisted import ensureDeferred
from support import ConfigText, RunningService, sleep
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs, formatEvent

from sdexec.drain import AdminCause
from sdexec.notify import Readiness, SystemdNotifier, describe_server


class NotifySocket:
    """The systemd side: a bound datagram socket, read without blocking."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(str(path))
        self.socket.setblocking(False)

    def messages(self) -> list[dict[str, str]]:
        """Every datagram received so far, as its KEY=VALUE fields."""
        received = []
        while True:
            try:
                data = self.socket.recv(4096)
            except BlockingIOError:
                return received
            received.append(dict(line.split("=", 1)
                                 for line in data.decode().splitlines()))  # fmt: skip

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def notify_socket(tmp_path):
    listener = NotifySocket(tmp_path / "notify")
    yield listener
    listener.close()


def test_unset_notify_socket_sends_nothing():
    notifier = SystemdNotifier(environ={})
    notifier.notify(READY=1)
    assert not notifier.enabled
    assert notifier._socket is None


def test_abstract_and_path_addresses():
    assert SystemdNotifier({"NOTIFY_SOCKET": "@sd/notify"}).address == "\0sd/notify"
    assert SystemdNotifier({"NOTIFY_SOCKET": "/run/x"}).address == "/run/x"
    assert not SystemdNotifier({"NOTIFY_SOCKET": "vsock:2:1"}).enabled


def test_a_missing_listener_is_logged_not_raised(tmp_path):
    address = str(tmp_path / "nobody")
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    with capturedLogs() as events:
        notifier.notify(READY=1)  # ENOENT: logged
    assert notifier.enabled
    assert [(event["log_level"], formatEvent(event)) for event in events] == [
        (
            LogLevel.warn,
            # As NOTIFY_SOCKET says it, in the system's words: not Python's
            # repr of the address and "[Errno 2] No such file or directory".
            f"sd_notify to {address} failed: No such file or directory",
        )
    ]


def test_status_is_sent_only_when_it_changes(notify_socket):
    clock = Clock()
    status = ["serving 0 processes"]
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(notify_socket.path)})
    readiness = Readiness(clock, lambda: status[0], notifier)
    readiness.ready()
    clock.advance(1)
    clock.advance(1)
    status[0] = "drained: fence"
    clock.advance(1)
    clock.advance(1)
    readiness.stopping()
    clock.advance(5)
    assert notify_socket.messages() == [
        {"READY": "1", "STATUS": "serving 0 processes"},
        {"STATUS": "drained: fence"},
        {"STOPPING": "1", "STATUS": "stopping"},
    ]
    assert clock.getDelayedCalls() == []


def test_a_status_quoting_a_line_break_stays_one_assignment(notify_socket):
    # A drain reason names a job id a request gave: its line break would
    # have been an assignment of its own (STOPPING=1, READY=1…).
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(notify_socket.path)})
    notifier.notify(STATUS="drained: unkillable job f1\nSTOPPING=1")
    assert notify_socket.messages() == [
        {"STATUS": "drained: unkillable job f1\\nSTOPPING=1"}
    ]


def test_a_status_quoting_an_escape_is_sent_escaped(notify_socket):
    # Only line breaks were escaped: a terminal's escape or a U+2028 went
    # to `systemctl status` as it was, and a lone surrogate could not be
    # sent at all. One rule with an errstr's (sdexec.refusal.one_line).
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(notify_socket.path)})
    notifier.notify(STATUS="drained: \x1b[31mred\u2028\x85 \ud800 a\rb")
    assert notify_socket.messages() == [
        {"STATUS": "drained: \\x1b[31mred\\u2028\\x85 \\ud800 a\\rb"}
    ]


def test_a_reason_of_control_characters_still_fits_a_notify_message():
    # Each is written as 4 bytes (\x01) once escaped: cut after, not before.
    status = describe_server("\x01" * 4000, 0)
    assert status.startswith("drained: \\x01\\x01")
    assert status.endswith("… (the rest in /stats)")
    assert len(f"STATUS={status}\nREADY=1".encode()) < 4096


def test_describe_server():
    assert describe_server(None, 1) == "serving 1 process"
    assert describe_server(None, 2) == "serving 2 processes"
    assert describe_server("fence failed", 2) == "drained: fence failed"


def test_the_status_counts_what_the_list_shows(server, connection):
    # Polled every second, it built the whole stats (30 ms with 2000
    # processes) to count them (review session 31 B).
    connection.send("sdexec.exec", {"flags": 0, "cmd": {"cmdline": ["/bin/true"]}})
    assert server.listed_count == len(server.list()["procs"]) == 1


def test_a_drain_of_many_causes_still_fits_a_notify_message():
    # A reason joins every cause in force: 100 unkillable jobs made 4.7 KB,
    # and systemd drops a notify message of 4096 bytes or more, whole.
    reason = "; ".join(f"unkillable user processes for job f{n:04}" for n in range(100))
    status = describe_server(reason, 0)
    assert status.startswith(f"drained: {reason[:100]}")
    assert status.endswith("… (the rest in /stats)")
    assert len(f"STATUS={status}\nREADY=1".encode()) < 4096
    wide = describe_server("\U0001f600" * 1000, 0)
    assert len(f"STATUS={wide}\nREADY=1".encode()) < 4096


async def _next_messages(listener: NotifySocket, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        received = listener.messages()
        if received:
            return received
        await sleep(0.05)
    raise AssertionError("no sd_notify message")


@pytest.mark.systemd
@ensureDeferred
async def test_the_service_notifies_ready_status_reload_and_stop(
    user_manager, tmp_path, notify_socket, monkeypatch
):
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify_socket.path))
    running = RunningService(tmp_path, ConfigText())
    await running.start()
    try:
        assert await _next_messages(notify_socket) == [
            {"READY": "1", "STATUS": "serving 0 processes"}
        ]
        running.server.drain("fence check failed on sdexec-x.service", AdminCause.FENCE)
        assert await _next_messages(notify_socket) == [
            {"STATUS": "drained: fence check failed on sdexec-x.service"}
        ]
        running.server.undrain()
        assert await _next_messages(notify_socket) == [
            {"STATUS": "serving 0 processes"}
        ]
        assert await running.reload()
        reloading, ready = await _next_messages(notify_socket)
        assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
        assert ready == {"READY": "1", "STATUS": "serving 0 processes"}
    finally:
        await running.stop()
    assert notify_socket.messages() == [{"STOPPING": "1", "STATUS": "stopping"}]
