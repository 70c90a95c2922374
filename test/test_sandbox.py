"""scripts/systemd-user-sandbox: the manager it starts answers on its own bus
even when the caller's environment names another one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import SANDBOX

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
    for _ in range(5):
        try:
            shown = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=5
            )
        except subprocess.TimeoutExpired:
            continue  # busctl can hang before its own timeout starts
        if shown.returncode == 0:
            return shown.stdout
    pytest.fail(f"the manager did not answer {name} on {runtime_dir}/bus")


@pytest.mark.systemd
def test_the_manager_ignores_the_callers_bus_address(sandbox_started_with_a_stale_bus):
    # With the caller's address inherited, the manager tried the dead bus and
    # never answered on its own: each call here timed out.
    shown = manager_property(sandbox_started_with_a_stale_bus, "Environment")
    assert DEAD_BUS not in shown
