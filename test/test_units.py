"""The shipped unit files, run by the test user manager itself: the socket
unit activates the service on the first connection, ``Type=notify`` waits
for its READY=1, the status line reaches systemd, reload and stop work.

The units are installed under ``$XDG_RUNTIME_DIR/systemd/user/`` (the
manager's runtime unit directory) with a name of their own; a drop-in
replaces only ``ExecStart`` (this checkout's twistd, a test configuration).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_twistd import REPO, _free_port, _wait_for

pytestmark = pytest.mark.systemd

NAME = f"sdexectest-{os.getpid()}"
CONFIG = """
[systemd]
enable = true
[exec]
service = "sdexec"
[sdexec]
listen = "systemd:domain=UNIX:name=sdexec"
stats = "tcp:{port}:interface=127.0.0.1"
"""


def _systemctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", "--user", *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def _show(unit: str, *properties: str) -> dict[str, str]:
    shown = _systemctl("show", unit, *(f"-p{name}" for name in properties))
    return dict(line.split("=", 1) for line in shown.stdout.splitlines())


@pytest.fixture
def installed_units(user_manager, tmp_path):
    units = Path(user_manager.runtime_dir) / "systemd" / "user"
    dropins = units / f"{NAME}.service.d"
    dropins.mkdir(parents=True, exist_ok=True)
    (units / f"{NAME}.service").write_bytes((REPO / "etc/sdexec.service").read_bytes())
    (units / f"{NAME}.socket").write_bytes((REPO / "etc/sdexec.socket").read_bytes())
    config = tmp_path / "sdexec.toml"
    config.write_text(CONFIG.format(port=_free_port()))
    twistd = (f"{sys.executable} -c 'from twisted.scripts.twistd import run; run()'"
              f" --nodaemon --pidfile= sdexec --config {config}")  # fmt: skip
    (dropins / "test.conf").write_text(
        f"[Service]\nExecStart=\nExecStart={twistd}\n"
        f"Environment=PYTHONPATH={REPO}\nWorkingDirectory={tmp_path}\n"
    )
    assert _systemctl("daemon-reload").returncode == 0
    yield Path(user_manager.runtime_dir) / "sdexec" / "sdexec.sock"
    _systemctl("stop", f"{NAME}.socket", f"{NAME}.service")
    for path in (dropins / "test.conf", units / f"{NAME}.service",
                 units / f"{NAME}.socket"):  # fmt: skip
        path.unlink()
    dropins.rmdir()
    _systemctl("daemon-reload")


def _sdexec(socket: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdexec.cli", "--socket", str(socket), *args],
        capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def test_the_shipped_units_activate_notify_reload_and_stop(installed_units):
    service = f"{NAME}.service"
    started = _systemctl("start", f"{NAME}.socket")
    assert started.returncode == 0, started.stderr
    assert _show(service, "Type", "NotifyAccess", "ActiveState") == {
        "Type": "notify", "NotifyAccess": "main", "ActiveState": "inactive",
    }  # fmt: skip
    ran = _sdexec(installed_units, "run", "-n", "echo", "activated")
    assert (ran.returncode, ran.stdout) == (0, b"activated\n"), ran.stderr
    assert _show(service, "ActiveState")["ActiveState"] == "active"
    _wait_for(lambda: _show(service, "StatusText")["StatusText"]
              == "serving 0 processes", "the status line")  # fmt: skip

    # SIGHUP: the service sends RELOADING=1, reloads, READY=1, stays active.
    reloaded = _systemctl("reload", service)
    assert reloaded.returncode == 0, reloaded.stderr
    assert _show(service, "ActiveState")["ActiveState"] == "active"

    stopped = _systemctl("stop", service, f"{NAME}.socket")
    assert stopped.returncode == 0, stopped.stderr
    assert _show(service, "ActiveState", "Result") == {
        "ActiveState": "inactive", "Result": "success",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("manager", "shipped", "installed_as"),
    [
        ("--user", "sdexec.service", "sdexec.service"),
        ("--user", "sdexec.socket", "sdexec.socket"),
        ("--system", "sdexec-system.service", "sdexec.service"),
        ("--system", "sdexec.socket", "sdexec.socket"),
    ],
)
def test_systemd_analyze_verify_finds_nothing(
    user_manager, tmp_path, manager, shipped, installed_as
):
    # verify prints unknown keys and bad values as warnings and exits 0
    # anyway: the test is that it prints nothing.
    unit = tmp_path / installed_as
    unit.write_bytes((REPO / "etc" / shipped).read_bytes())
    if installed_as.endswith(".socket"):  # verify wants the service it activates
        (tmp_path / "sdexec.service").write_bytes(
            (REPO / "etc" / "sdexec.service").read_bytes()
        )
    verified = subprocess.run(
        ["systemd-analyze", manager, "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (verified.returncode, verified.stderr) == (0, "")
