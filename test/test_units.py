"""The shipped unit files, run by the test user manager itself: the socket
unit activates the service on the first connection, ``Type=notify`` waits
for its READY=1, the status line reaches systemd, reload and stop work.

The units are installed under ``$XDG_RUNTIME_DIR/systemd/user/`` (the
manager's runtime unit directory) with a name of their own; a drop-in
replaces only ``ExecStart`` (this checkout's twistd, a test configuration).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_containment import r_local
from test_twistd import REPO, _wait_for, bound_stats_port, stats_page

from sdexec.map.topology import Topology, live_topology_xml

pytestmark = pytest.mark.systemd

NAME = f"sdexectest-{os.getpid()}"
CONFIG = """
[systemd]
enable = true
[exec]
service = "sdexec"
[sdexec]
stats = "tcp:0:interface=127.0.0.1"
"""
ACTIVATED = CONFIG + 'listen = "systemd:domain=UNIX:name=sdexec"\n'


def _systemctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", "--user", *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def _show(unit: str, *properties: str) -> dict[str, str]:
    shown = _systemctl("show", unit, *(f"-p{name}" for name in properties))
    return dict(line.split("=", 1) for line in shown.stdout.splitlines())


class Units:
    """Shipped unit files installed as ``NAME.service``/``NAME.socket`` in
    the manager's runtime unit directory, with a test drop-in."""

    def __init__(self, runtime_dir: str, directory: Path) -> None:
        self.socket = Path(runtime_dir) / "sdexec" / "sdexec.sock"  # %t/sdexec/…
        self.units = Path(runtime_dir) / "systemd" / "user"
        self.dropins = self.units / f"{NAME}.service.d"
        self.directory = directory
        self.log = directory / "service.log"  # the journal may not be there

    def install(self, service: str, socket: str | None, config: str, dropin: str):
        """``etc/SERVICE`` (and ``etc/SOCKET``) with ``config`` as the
        configuration; the drop-in runs this checkout's twistd and adds
        ``dropin`` lines to ``[Service]``."""
        self.dropins.mkdir(parents=True, exist_ok=True)
        self._copy(service, f"{NAME}.service")
        if socket is not None:
            self._copy(socket, f"{NAME}.socket")
        path = self.directory / "sdexec.toml"
        path.write_text(config)
        twistd = (f"{sys.executable} -c 'from twisted.scripts.twistd import run;"
                  f" run()' {_shipped_arguments(service, path)}")  # fmt: skip
        reload = f"{sys.executable} -m sdexec.cli {_shipped_reload(service)}"
        (self.dropins / "test.conf").write_text(
            f"[Service]\nExecStart=\nExecStart={twistd}\n"
            f"ExecReload=\nExecReload={reload}\n"
            f"Environment=PYTHONPATH={REPO}\nWorkingDirectory={self.directory}\n"
            f"StandardOutput=append:{self.log}\nStandardError=inherit\n" + dropin
        )
        assert _systemctl("daemon-reload").returncode == 0

    def _copy(self, shipped: str, name: str) -> None:
        (self.units / name).write_bytes((REPO / "etc" / shipped).read_bytes())

    def remove(self) -> None:
        _systemctl("stop", f"{NAME}.socket", f"{NAME}.service")
        for path in (self.dropins / "test.conf", self.units / f"{NAME}.service",
                     self.units / f"{NAME}.socket"):  # fmt: skip
            path.unlink(missing_ok=True)
        self.dropins.rmdir()
        _systemctl("daemon-reload")


def _shipped_arguments(service: str, config: Path) -> str:
    """twistd's arguments in ``etc/SERVICE``'s ExecStart, with ``config``
    for its ``--config``."""
    text = (REPO / "etc" / service).read_text()
    [command] = re.findall(r"^ExecStart=\S+ twistd (.*)$", text, re.MULTILINE)
    return re.sub(r"--config \S+", f"--config {config}", command)


def _shipped_reload(service: str) -> str:
    """The ``sdexec`` command's arguments in ``etc/SERVICE``'s ExecReload."""
    text = (REPO / "etc" / service).read_text()
    [arguments] = re.findall(
        r"^ExecReload=/usr/bin/env sdexec (.*)$", text, re.MULTILINE
    )
    return arguments


@pytest.mark.parametrize("service", ["sdexec.service", "sdexec-system.service"])
def test_the_units_reload_with_sdexec_reload(service):
    # Not kill -HUP: systemctl reload succeeded whatever the service made
    # of its file; `sdexec reload` fails with the reason it was refused.
    assert [
        line
        for line in (REPO / "etc" / service).read_text().splitlines()
        if line.startswith("ExecReload")
    ] == ["ExecReload=/usr/bin/env sdexec reload"]


@pytest.fixture
def units(user_manager, tmp_path):
    installed = Units(user_manager.runtime_dir, tmp_path)
    yield installed
    installed.remove()


def _sdexec(socket: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdexec.cli", "--socket", str(socket), *args],
        capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def test_the_shipped_units_activate_notify_reload_and_stop(units):
    units.install("sdexec.service", "sdexec.socket", ACTIVATED, dropin="")
    service = f"{NAME}.service"
    started = _systemctl("start", f"{NAME}.socket")
    assert started.returncode == 0, started.stderr
    assert _show(service, "Type", "NotifyAccess", "ActiveState") == {
        "Type": "notify", "NotifyAccess": "main", "ActiveState": "inactive",
    }  # fmt: skip
    ran = _sdexec(units.socket, "run", "-n", "echo", "activated")
    assert (ran.returncode, ran.stdout) == (0, b"activated\n"), ran.stderr
    assert _show(service, "ActiveState")["ActiveState"] == "active"
    port = bound_stats_port(units.log)
    _wait_for(lambda: _show(service, "StatusText")["StatusText"]
              == "serving 0 processes", "the status line")  # fmt: skip

    # `sdexec reload`: the service sends RELOADING=1, reloads (the mapper
    # built in a thread: systemd shows "reloading" meanwhile), READY=1,
    # answers; ExecReload exits with the outcome. The unit stays active.
    reloaded = _systemctl("reload", service)
    assert reloaded.returncode == 0, reloaded.stderr
    assert (
        'sdexec_config_reloads_total{outcome="ok"} 1.0'
        in stats_page(port, "metrics").decode()
    )
    _wait_for(lambda: _show(service, "ActiveState")["ActiveState"] == "active",
              "the reload's READY=1")  # fmt: skip
    # A file the service refuses fails the reload with its reason (kill -HUP
    # succeeded: only the service's log said), the old configuration kept.
    config = units.directory / "sdexec.toml"
    config.write_text(ACTIVATED + "max-frame-sise = 5\n")
    refused = _systemctl("reload", service)
    assert refused.returncode != 0
    said = (f"sdexec: reload refused, old configuration kept: {config}:"
            " sdexec.max-frame-sise: unknown key in [sdexec] (did you mean"
            " max-frame-size?)")  # fmt: skip
    assert said in units.log.read_text().splitlines()  # ExecReload's stderr
    assert (
        'sdexec_config_reloads_total{outcome="refused"} 1.0'
        in stats_page(port, "metrics").decode()
    )
    _wait_for(lambda: _show(service, "ActiveState")["ActiveState"] == "active",
              "active after the refused reload")  # fmt: skip

    stopped = _systemctl("stop", service, f"{NAME}.socket")
    assert stopped.returncode == 0, stopped.stderr
    assert _show(service, "ActiveState", "Result") == {
        "ActiveState": "inactive", "Result": "success",
    }  # fmt: skip


def _comment_above(unit: str, setting: str) -> str:
    """The comment lines just above ``setting=`` in ``etc/UNIT``, joined."""
    lines = (REPO / "etc" / unit).read_text().splitlines()
    (at,) = (n for n, line in enumerate(lines) if line.startswith(f"{setting}="))
    comment: list[str] = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        comment.insert(0, line.lstrip("# "))
    return " ".join(comment)


def test_a_start_past_its_timeout_is_restarted_as_the_units_say(units, tmp_path):
    # A bus that takes the connection and never answers holds the start
    # before READY=1. Past TimeoutStartSec systemd ends it with SIGTERM,
    # which twistd re-raises, and Restart=on-failure starts it again: the
    # units' comments said "exit 0, which is not restarted".
    silent = tmp_path / "silent-bus"
    with socket.socket(socket.AF_UNIX) as bus:
        bus.bind(str(silent))
        bus.listen(8)
        units.install("sdexec.service", None, CONFIG, dropin=(
            f"Environment=DBUS_SESSION_BUS_ADDRESS=unix:path={silent}\n"
            "TimeoutStartSec=2\n"
        ))  # fmt: skip
        service = f"{NAME}.service"
        assert _systemctl("start", "--no-block", service).returncode == 0
        _wait_for(lambda: int(_show(service, "NRestarts")["NRestarts"]) >= 1,
                  "the restart after the start timed out", log=units.log)  # fmt: skip
    for unit in ("sdexec.service", "sdexec-system.service"):
        said = _comment_above(unit, "TimeoutStartSec")
        assert "restarts it" in said and "not restarted" not in said, (unit, said)


#: The system unit's settings that need a mount, UTS or other namespace for
#: the unit, which a manager inside some containers cannot make.
NAMESPACED = ("ProtectSystem", "ProtectHome", "ProtectKernelTunables",
              "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
              "ProtectHostname")  # fmt: skip
EXIT_NAMESPACE = "226"  # systemd.exec(5): setting up the unit's namespace failed


#: Containment on, as a GPU node has it: the mapper runs lstopo (which
#: binds itself to each CPU on x86) under the unit's system call filter.
#: "warn": this manager is not a system manager, and cannot fence devices.
CONTAINED = (
    CONFIG.replace(
        'service = "sdexec"\n',
        'service = "sdexec"\nsdexec-constrain-resources = true\n',
    )
    + 'containment-check = "warn"\n'
)


def _start_system_unit(
    units: Units, bus_address: str, namespaced: bool, config: str
) -> bool:
    # One line differs from the shipped unit: the "system" bus is the test
    # manager's (there is no system manager here; the service connects with
    # its system-bus code, to this address). The configuration leaves
    # [systemd] bus at "user", as the example file does: the unit's --bus
    # must choose, and a session bus is not there to be found instead.
    dropin = (
        f"Environment=DBUS_SYSTEM_BUS_ADDRESS={bus_address}\n"
        "Environment=DBUS_SESSION_BUS_ADDRESS=unix:path=/nonexistent\n"
    )
    if not namespaced:
        dropin += "".join(f"{setting}=no\n" for setting in NAMESPACED)
    units.install("sdexec-system.service", None, config, dropin=dropin)
    return _systemctl("start", f"{NAME}.service").returncode == 0


@pytest.mark.parametrize("config", [CONFIG, CONTAINED], ids=["plain", "contained"])
def test_the_hardened_system_unit_runs_a_process(units, user_manager, config):
    # The system unit under this root-run test manager: its sandbox is
    # applied as the system manager would apply it. Where this manager
    # cannot make the unit's namespaces (226/NAMESPACE: containers), the
    # rest (no capabilities, the system call filter, MemoryDenyWriteExecute,
    # address families, NoNewPrivileges) is still applied and tested.
    service = f"{NAME}.service"
    bus = user_manager.bus_address
    started = _start_system_unit(units, bus, namespaced=True, config=config)
    if not started:
        status = _show(service, "ExecMainStatus")["ExecMainStatus"]
        assert status == EXIT_NAMESPACE, _systemctl("status", service).stdout
        _systemctl("stop", service)
        started = _start_system_unit(units, bus, namespaced=False, config=config)
    assert started, _systemctl("status", service).stdout
    pid = _show(service, "MainPID")["MainPID"]
    status = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines())  # fmt: skip
    assert (status["Seccomp"], status["NoNewPrivs"]) == ("2", "1")  # filtered
    # CapabilityBoundingSet=CAP_DAC_READ_SEARCH (2): reading 0700 homes, no more
    assert int(status["CapBnd"], 16) == 1 << 2
    assert _show(service, "Type")["Type"] == "notify"
    # Contained, the device canary may still be the one process served.
    _wait_for(lambda: _show(service, "StatusText")["StatusText"]
              == "serving 0 processes", "the status line")  # fmt: skip
    ran = _sdexec(units.socket, "run", "-n", "echo", "hardened")
    assert (ran.returncode, ran.stdout) == (0, b"hardened\n"), ran.stderr
    # ExecReload's `sdexec reload`, in the unit's sandbox too, finds the
    # socket at its default path (XDG_RUNTIME_DIR=%t) and is answered.
    reloaded = _systemctl("reload", service)
    assert reloaded.returncode == 0, _systemctl("status", service).stdout
    if config is CONTAINED and _gpus_hwloc_sees():
        # A GPU node: hwloc, run by the service under the unit's system call
        # filter and MemoryDenyWriteExecute (where it may start the GPU's
        # OpenCL driver), still finds GPU 0, so a job holding it runs.
        r_gpu = r_local("0", gpus="0")
        gpu_job = _sdexec(units.socket, "run", "-n", "--setopt",
                          f"SDEXEC_R_LOCAL={r_gpu}", "true")  # fmt: skip
        assert gpu_job.returncode == 0, gpu_job.stderr
    stopped = _systemctl("stop", service)
    assert stopped.returncode == 0, stopped.stderr
    assert _show(service, "Result")["Result"] == "success"


def _gpus_hwloc_sees() -> int:
    """How many GPUs hwloc finds on this node, outside any sandbox."""
    return len(Topology(live_topology_xml()).gpus)


def _settings(unit: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_the_system_unit_leaves_sdexec_a_writable_temporary_directory():
    # ProtectSystem=strict makes /tmp read-only without PrivateTmp, and the
    # mapper writes its topology with mkstemp: the service must not start
    # where namespaces work and fail only there (this test's manager
    # cannot make them, so the unit runs here without its sandbox).
    settings = _settings(REPO / "etc" / "sdexec-system.service")
    assert settings["ProtectSystem"] == ["strict"]
    assert "PrivateTmp" not in settings
    [runtime] = settings["RuntimeDirectory"]
    assert f"TMPDIR=%t/{runtime}" in settings["Environment"]


#: What every system service and socket requires (their default
#: dependencies): ``verify --system`` fails where it cannot load it.
SYSINIT = "sysinit.target"


def _system_unit_paths() -> list[Path]:
    """Where a system manager of this node would look for its units."""
    listed = subprocess.run(
        ["systemd-analyze", "--system", "unit-paths"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [Path(line) for line in listed.stdout.splitlines()]


def _sysinit_where_the_node_has_none(directory: Path) -> None:
    """An empty ``sysinit.target`` in ``directory`` (verify searches the
    directory of the unit it verifies) where the node's system unit paths
    hold none: a node without a system manager, as a GPU node whose carried
    systemd runs user managers alone. The unit is then verified on its own,
    not against a system the node does not have; a node that has one
    verifies it against its own."""
    if not any((path / SYSINIT).exists() for path in _system_unit_paths()):
        (directory / SYSINIT).write_text("[Unit]\nDescription=no system here\n")


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
    if manager == "--system":
        _sysinit_where_the_node_has_none(tmp_path)
    verified = subprocess.run(
        ["systemd-analyze", manager, "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (verified.returncode, verified.stderr) == (0, "")
