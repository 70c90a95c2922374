"""The service as admins run it: ``twistd -n sdexec``, signals and all."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support import stop_units_since, unit_names

from sdexec.service import EX_CONFIG

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parent.parent
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
CONFIG = """
[systemd]
enable = true
[exec]
service = "sdexec"
kill-timeout = "{kill_timeout}"
[sdexec]
listen = "unix:{socket}"
stats = "tcp:0:interface=127.0.0.1"
"""


def bound_stats_port(log: Path) -> int:
    """The port the kernel gave the service's ``tcp:0`` stats endpoint, as
    its ``log`` says once it listens: no port picked before the service
    binds it, which another test could take meanwhile."""
    said = rb"stats on tcp:0\S* \(127\.0\.0\.1:(\d+)\)"
    found = _wait_for(
        lambda: re.search(said, log.read_bytes()), "the stats port", log=log
    )
    return int(found.group(1))


def _environment(directory: Path | None = None) -> dict[str, str]:
    """The checkout's own twisted/plugins/ must be the one twistd finds;
    with ``directory``, its temporary files (the mapper's topology) go
    there, since a service the test SIGKILLs cannot remove them."""
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    if directory is not None:
        environment["TMPDIR"] = str(directory)
    return environment


def _wait_for(predicate, what: str, timeout: float = 30.0, log: Path | None = None):
    """``predicate()`` once true; else fail after ``timeout`` s, with the
    end of the service's ``log`` to say why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    tail = "" if log is None else "; its log ends:\n" + log.read_text()[-4000:]
    raise AssertionError(f"timed out waiting for {what}{tail}")


def _wait_for_text(log: Path, text: bytes) -> None:
    """Wait until the service's ``log`` says ``text``."""
    _wait_for(lambda: text in log.read_bytes(), repr(text), log=log)


@contextlib.contextmanager
def reaped(process: subprocess.Popen):
    """Kill ``process``, a service, on the way out if the test did not stop
    it; then, or if the test failed, stop the units that came meanwhile: a
    killed service leaves them running, and they would fail every later
    test that counts the manager's units."""
    before = set(unit_names())
    failed = True
    try:
        yield process
        failed = False
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
            failed = True
        if failed:
            stop_units_since(before)


@contextlib.contextmanager
def units_stopped_after():
    """For a fixture, which cannot tell a failed test: stop at its teardown
    the units that came since (the test's own checks of them have run)."""
    before = set(unit_names())
    yield
    stop_units_since(before)


def terminate(process: subprocess.Popen) -> int:
    """SIGTERM, then its exit status (twistd re-raises it: -SIGTERM)."""
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=60)


def stats_page(port: int, page: str) -> bytes:
    """``GET /PAGE`` (``stats``, ``metrics``) of the stats endpoint on the
    loopback ``port``."""
    url = f"http://127.0.0.1:{port}/{page}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


class Twistd:
    """A ``twistd -n sdexec`` process on a private socket and port."""

    def __init__(
        self,
        directory: Path,
        sdexec_lines: str = "",
        open_files: tuple[int, int] | None = None,
    ) -> None:
        """``open_files``: start twistd with this (soft, hard) RLIMIT_NOFILE."""
        self.socket = directory / "sdexec.sock"
        self.sdexec_lines = sdexec_lines  # more of the [sdexec] table
        self.config = directory / "sdexec.toml"
        self.log = directory / "twistd.log"
        self.write_config(kill_timeout="5s")
        with self.log.open("wb") as log:  # the child's: ours closed after
            self.process = subprocess.Popen(
                [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config",
                 str(self.config)],
                cwd=directory, env=_environment(directory),
                stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=None if open_files is None else (
                    lambda: resource.setrlimit(resource.RLIMIT_NOFILE, open_files)
                ),
            )  # fmt: skip
        # Its last words of the start: its stats port listens a few turns
        # after its socket exists, and a test reading the stats at once
        # was refused on a loaded machine.
        _wait_for_text(self.log, b"sdexec listening on")
        self.port = bound_stats_port(self.log)

    def write_config(self, **values: str) -> None:
        text = CONFIG.format(socket=self.socket, **values)
        self.config.write_text(text + self.sdexec_lines)

    def stats(self) -> dict:
        return json.loads(stats_page(self.port, "stats"))

    def sdexec(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sdexec.cli", "--socket", str(self.socket), *args],
            capture_output=True, timeout=60, env=_environment(),
        )  # fmt: skip

    def stop(self) -> int:
        return terminate(self.process)


@pytest.fixture
def twistd(user_manager, tmp_path):
    with units_stopped_after():
        service = Twistd(tmp_path)
        with reaped(service.process):
            yield service


def test_serves_reloads_on_sighup_and_stops_cleanly(twistd):
    ran = twistd.sdexec("run", "-n", "echo", "hello")
    assert (ran.returncode, ran.stdout) == (0, b"hello\n")
    assert twistd.stats()["job-exec"]["kill-timeout"] == 5.0

    twistd.config.write_text('[exec]\nkill-timeout = "5x"\n')
    twistd.process.send_signal(signal.SIGHUP)
    _wait_for_text(twistd.log, b"reload refused")
    assert twistd.stats()["job-exec"]["kill-timeout"] == 5.0

    twistd.write_config(kill_timeout="7s")
    twistd.process.send_signal(signal.SIGHUP)
    _wait_for(lambda: twistd.stats()["job-exec"]["kill-timeout"] == 7.0, "reload")
    assert twistd.sdexec("run", "-n", "true").returncode == 0

    # twistd leaves by re-raising the SIGTERM it got, as systemd expects.
    assert twistd.stop() == -signal.SIGTERM
    assert b"Server Shut Down." in twistd.log.read_bytes()
    assert not twistd.socket.exists()
    assert unit_names() == []


@pytest.mark.parametrize("way", [[], ["--no-passthrough"]], ids=["passed", "framed"])
def test_a_client_running_a_command_is_told_when_the_service_stops(twistd, way):
    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", str(twistd.socket),
         "run", *way, "-n", "sleep", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_environment(),
    )  # fmt: skip
    _wait_for(lambda: [p["pid"] > 0 for p in twistd.stats()["procs"]] == [True],
              "the sleep started")  # fmt: skip
    assert twistd.stop() == -signal.SIGTERM
    assert client.wait(timeout=60) == 1
    assert client.stderr is not None
    assert client.stderr.read() == (
        b"sdexec: the service is stopping: the process's unit is being stopped\n"
    )
    assert unit_names() == []


def test_a_run_whose_service_was_killed_says_where_its_process_may_run_on(
    twistd, tmp_path
):
    # "connection lost" alone: the user took the process for gone, while a
    # killed service stops no unit (nor, with leftover-units = "keep", does
    # its next start). Its stderr a file: passed to the process, which runs
    # on, a pipe would never end.
    stderr = tmp_path / "stderr"
    with stderr.open("wb") as file:
        client = subprocess.Popen(
            [sys.executable, "-m", "sdexec.cli", "--socket", str(twistd.socket),
             "run", "-n", "sleep", "600"],
            stdout=subprocess.DEVNULL, stderr=file, env=_environment(),
        )  # fmt: skip
    (pid,) = _wait_for(
        lambda: [p["pid"] for p in twistd.stats()["procs"] if p["pid"] > 0],
        "the sleep started",
    )
    (unit,) = unit_names()
    twistd.process.kill()
    assert (client.wait(timeout=60), stderr.read_text()) == (
        1,
        f"sdexec: connection to {twistd.socket} lost\n"
        f"sdexec: pid {pid} may still run, as unit {unit}: a service that was"
        " killed leaves its units running (its next start stops them, unless"
        ' [sdexec] leftover-units = "keep"); systemctl --user stop'
        f" {unit} stops it now (no --user under the system manager)\n",
    )
    assert unit_names() == [unit]  # (stopped on the way out)


def test_a_second_sigterm_while_stopping_is_said_not_a_traceback(twistd, tmp_path):
    """Stopping waits for the units to be reaped (20 s and more for one that
    ignores SIGTERM): a second SIGTERM meanwhile (an admin's second Ctrl-C)
    was handed to the reactor, which answered its second stop with a
    ReactorNotRunning traceback, logged as critical."""
    trapped, flag = tmp_path / "trapped", tmp_path / "may-end"
    # It ignores the stop's SIGTERM, and the stop-timer signal, until told.
    script = (
        f'trap "" TERM USR1; touch {trapped}; while [ ! -e {flag} ]; do sleep 0.1; done'
    )
    started = twistd.sdexec("run", "--bg", "sh", "-c", script)
    assert started.returncode == 0, started.stderr
    _wait_for(trapped.exists, "the signals ignored")
    twistd.process.send_signal(signal.SIGTERM)
    # The stop has begun once it stops listening (the socket is removed).
    _wait_for(lambda: not twistd.socket.exists(), "the stop begun")
    twistd.process.send_signal(signal.SIGTERM)
    _wait_for_text(twistd.log, b"SIGTERM received: the service is already stopping")
    flag.touch()
    assert twistd.process.wait(timeout=60) == -signal.SIGTERM
    said = twistd.log.read_bytes()
    assert b"Traceback" not in said and b"ReactorNotRunning" not in said
    assert unit_names() == []


def test_raises_its_open_file_limit_so_relayed_processes_do_not_run_out(
    user_manager, tmp_path
):
    """Under systemd the soft limit is 1024 (three fds per relayed process):
    the service raises it to the hard limit. Started at a soft limit of 64,
    it relays 30 processes (90 fds) all the same."""
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    service = Twistd(tmp_path, open_files=(64, hard))
    with reaped(service.process):
        assert _open_file_limits(service.process.pid) == (hard, hard)
        raised = f"raised from 64 to {hard}".encode()
        _wait_for_text(service.log, raised)
        for _ in range(30):
            started = service.sdexec("run", "--bg", "--no-passthrough", "sleep", "60")
            assert started.returncode == 0, started.stderr
        assert len(unit_names()) == 30
        assert service.stop() == -signal.SIGTERM
    assert unit_names() == []


def _open_file_limits(pid: int) -> tuple[int, int]:
    """Max open files (soft, hard) from /proc/PID/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-file limit in /proc/{pid}/limits")


def test_refuses_a_reactor_other_than_asyncio(user_manager, tmp_path):
    config = tmp_path / "sdexec.toml"
    config.write_text("[systemd]\nenable = true\n")
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "--reactor", "poll", "sdexec",
         "--config", str(config)],
        capture_output=True, timeout=60, env=_environment(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EX_CONFIG  # as any option the units would repeat
    assert done.stderr.startswith(b"sdexec: sdexec needs the asyncio reactor")
    assert b"Traceback" not in done.stderr


def test_a_bad_configuration_is_one_line_and_ex_config(tmp_path):
    config = tmp_path / "sdexec.toml"
    config.write_text('[exec]\nkill-timeout = "5x"\n')
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config", str(config)],
        capture_output=True, timeout=60, env=_environment(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EX_CONFIG  # 78: the units do not restart it
    assert b'exec.kill-timeout: "5x" is not a valid duration' in done.stderr
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("--listen", "unix:path=/tmp/x.sock", b"is not a Twisted server endpoint"),
        ("--stats", "tcp:8490:bogus=1", b"is not a Twisted server endpoint"),
        ("--bus", "session", b'expected "user" or "system", got "session"'),
    ],
)
def test_a_bad_option_is_one_line_and_ex_config(tmp_path, option, value, reason):
    # The same value in the file was refused so; on the command line an
    # endpoint ended in a traceback at the listen.
    config = tmp_path / "sdexec.toml"
    config.write_text("")
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config", str(config),
         option, value],
        capture_output=True, timeout=60, env=_environment(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EX_CONFIG
    assert done.stderr.startswith(f"sdexec: <command line>: {option}: ".encode())
    assert reason in done.stderr
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("options", "said"),
    [(["--confg", "x.toml"], b"option --confg not recognized"),
     ([], b"--config FILE is required")],
)  # fmt: skip
def test_a_usage_error_is_one_line_and_ex_config(tmp_path, options, said):
    # twistd printed its usage (20 lines) and exited 1: the units restarted
    # it every 5 s for ever (review session 34 A2).
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", *options],
        capture_output=True, timeout=60, env=_environment(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EX_CONFIG
    assert done.stderr == b"sdexec: " + said + b"\n"
    assert done.stdout == b""


@pytest.mark.parametrize(
    ("bus", "variable"),
    [("user", "DBUS_SESSION_BUS_ADDRESS"), ("system", "DBUS_SYSTEM_BUS_ADDRESS")],
)
@pytest.mark.parametrize(
    ("address", "said"),
    [("garbage", "address did not contain a transport"),
     ("unix:foo=bar", "got unix transport with unknown path specifier")],
)  # fmt: skip
def test_a_bus_address_that_is_not_one_is_named_and_ex_config(
    tmp_path, address, said, bus, variable
):
    # dbus-fast's own words alone named neither the variable nor its value,
    # and the exit status 1 had the units retry a start that cannot work.
    config = tmp_path / "sdexec.toml"
    config.write_text(
        f'[sdexec]\nlisten = "unix:{tmp_path}/s.sock"\n'
        f'stats = "tcp:0:interface=127.0.0.1"\n[systemd]\nbus = "{bus}"\n'
    )
    tmp_path.chmod(0o700)  # a socket's directory must be the service's own
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config", str(config)],
        capture_output=True, timeout=60, cwd=tmp_path,
        env={**_environment(), variable: address},
    )  # fmt: skip
    assert done.returncode == EX_CONFIG, done.stdout
    expected = (
        f"sdexec could not start: {variable} '{address}' is not a"
        f" D-Bus address: {said}\n"
    )
    assert done.stdout.decode().endswith(expected)
    assert b"Traceback" not in done.stdout + done.stderr


def test_a_mapper_that_cannot_be_built_at_start_is_ex_config(user_manager, tmp_path):
    """Found once the service starts (the topology is read then): the same
    status, so the units do not restart it either."""
    config = tmp_path / "sdexec.toml"
    config.write_text(
        "[exec]\nsdexec-constrain-resources = true\n[sdexec]\n"
        f'listen = "unix:{tmp_path}/s.sock"\nstats = "tcp:0:interface=127.0.0.1"\n'
        f'topology = "{tmp_path}/nonexistent.xml"\n'
    )
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config", str(config)],
        capture_output=True, timeout=60, env=_environment(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EX_CONFIG, done.stdout
    assert b"sdexec.topology" in done.stdout and b"Traceback" not in done.stdout
