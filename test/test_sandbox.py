"""scripts/systemd-user-sandbox: the manager it starts answers on its own bus
even when the caller's environment names another one; stopping one that was
killed ends what it left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SANDBOX
from support import running

#: A session bus that nothing listens on, as a logged-out desktop leaves behind.
DEAD_BUS = "unix:path=/nonexistent/sdexec-dead-session/bus"


@pytest.fixture
def sandbox_started_with_a_stale_bus(tmp_path):
    """A second sandbox manager, started by a caller whose
    ``DBUS_SESSION_BUS_ADDRESS`` points at a dead bus; stopped at the end."""
    runtime_dir = tmp_path / "runtime"
    env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": DEAD_BUS}
    started = subprocess.run(
        [str(SANDBOX), "start", str(runtime_dir)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        yield runtime_dir
    finally:
        subprocess.run([str(SANDBOX), "stop", str(runtime_dir)], check=False)


def manager_property(runtime_dir: Path, name: str) -> str:
    """A manager property read with ``busctl --user`` through the sandbox's
    bus (not its private socket, which works either way): the path sdexec's
    D-Bus client takes. The manager joins that bus once its dbus.socket is
    up, so a failure is retried a few times; none answering fails the test."""
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime_dir),
        "DBUS_SESSION_BUS_ADDRESS": f"unix:path={runtime_dir}/bus",
    }
    command = [
        "busctl", "--user", "--timeout=3", "get-property",
        "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager", name,
    ]  # fmt: skip
    deadline = time.monotonic() + 60  # a safety bound: a loaded machine
    while time.monotonic() < deadline:
        try:
            shown = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=5
            )
        except subprocess.TimeoutExpired:
            continue  # busctl can hang before its own timeout starts
        if shown.returncode == 0:
            return shown.stdout
        time.sleep(0.1)  # refused at once: not on the bus yet
    pytest.fail(f"the manager did not answer {name} on {runtime_dir}/bus")


@pytest.mark.systemd
def test_the_manager_ignores_the_callers_bus_address(sandbox_started_with_a_stale_bus):
    # With the caller's address inherited, the manager tried the dead bus and
    # never answered on its own: each call here timed out.
    shown = manager_property(sandbox_started_with_a_stale_bus, "Environment")
    assert DEAD_BUS not in shown


#: Where the sandbox makes each manager's cgroup: v1's name=systemd, the
#: hybrid unified hierarchy, or the v2 root.
HIERARCHIES = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def start_left_behind(env: dict) -> int:
    """A ``sleep`` in a transient unit of the manager ``env`` reaches; its
    pid. The manager may refuse a connection for a moment after its
    sockets appear, so the start is retried (for up to a minute: a loaded
    machine)."""
    command = ["systemd-run", "--user", "--quiet", "--unit=left-behind", "sleep", "300"]
    deadline = time.monotonic() + 60
    while subprocess.run(command, env=env, capture_output=True, timeout=30).returncode:
        assert time.monotonic() < deadline, "the manager never started the unit"
        time.sleep(0.1)
    shown = subprocess.run(
        ["systemctl", "--user", "show", "-P", "MainPID", "left-behind.service"],
        env=env, capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return int(shown.stdout)


@pytest.mark.systemd
def test_stopping_a_killed_manager_ends_what_it_left(tmp_path):
    # A SIGKILLed manager stops none of its units: their processes ran on
    # in its cgroups, which the stop then could not remove, and it said
    # nothing of either.
    runtime_dir = tmp_path / "runtime"
    subprocess.run(
        [str(SANDBOX), "start", str(runtime_dir)], check=True, capture_output=True
    )
    manager = int((runtime_dir / "manager.pid").read_text())
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime_dir),
        "DBUS_SESSION_BUS_ADDRESS": f"unix:path={runtime_dir}/bus",
    }
    try:
        left_behind = start_left_behind(env)
        assert running(left_behind)
        os.kill(manager, signal.SIGKILL)
        deadline = time.monotonic() + 30  # gone, not merely signalled
        while running(manager):
            assert time.monotonic() < deadline, "the killed manager lived on"
            time.sleep(0.05)
        stopped = subprocess.run(
            [str(SANDBOX), "stop", str(runtime_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (stopped.returncode, stopped.stderr) == (0, "")
        assert not running(left_behind)
        assert [
            h for h in HIERARCHIES if Path(h, f"sdexec-sandbox-{manager}").exists()
        ] == []
    finally:
        subprocess.run(
            [str(SANDBOX), "clean", str(manager)], check=False
        )  # after a failure
