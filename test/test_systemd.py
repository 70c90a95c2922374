"""The systemd client against a real systemd user manager.

Every test here starts real transient units (through the ``user_manager``
fixture of ``conftest.py``) with three real socketpairs, follows them with
:meth:`SystemdClient.watch_unit` and reads their state through
:class:`UnitStatus`. The ``units`` fixture stops, resets and unloads every
unit a test started, even when the test fails; the module's
``nothing_left_behind`` fixture then checks that no unit, process or file
descriptor of these tests survives.

Unit names carry :data:`RUN_ID` and a uuid: other sandboxes on the same
machine (or a developer's own manager) must never see a clash.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor, task
from twisted.internet.defer import Deferred

from sdexec.clocks import timers_clock
from sdexec.command import Command, command_line, unit_properties
from sdexec.idset import IDset
from sdexec.managerversion import version_number, version_problem
from sdexec.nodememory import physical_memory
from sdexec.orphans import expected_unit_cgroup, unit_cgroup
from sdexec.property import UINT32_MAX, UINT64_MAX, PropertyError
from sdexec.sizes import scale_from_permyriad
from sdexec.systemd import SystemdClient, SystemdError, unit_object_path
from sdexec.systemd.unit import UnitStatus
from sdexec.unitstop import lifecycle_properties

pytestmark = pytest.mark.systemd

SERVICE = "org.freedesktop.systemd1.Service"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
#: Generous: a unit start costs ~170 ms here. Only reached when a test fails.
WAIT_S = 30.0
POLL_S = 0.02
RUN_ID = uuid.uuid4().hex[:12]
STREAMS = ("stdin", "stdout", "stderr")
SYSTEMCTL_LIST = (
    "systemctl",
    "--user",
    "list-units",
    "--all",
    "--plain",
    "--no-legend",
)


def unit_name(prefix: str = "") -> str:
    """A machine-wide unique unit name of this test run."""
    return f"{prefix}sdexec-test-{RUN_ID}-{uuid.uuid4().hex}.service"


def sleep(seconds: float) -> Deferred[None]:
    return task.deferLater(reactor, seconds, lambda: None)


async def poll(condition: Callable[[], Awaitable[Any]], what: str) -> Any:
    """Await ``condition()`` until it is truthy; fail the test with ``what``
    after :data:`WAIT_S`."""
    for _ in range(int(WAIT_S / POLL_S)):
        result = await condition()
        if result:
            return result
        await sleep(POLL_S)
    raise AssertionError(f"{what} after {WAIT_S}s")


# -- the unit under test ---------------------------------------------------


@dataclass
class Run:
    """One started unit: its watch, our ends of its three socketpairs, and
    the states the watch delivered."""

    client: SystemdClient
    name: str
    ours: dict[str, socket.socket]
    states: list[dict[str, Any]] = field(default_factory=list)
    _waiters: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.watch = self.client.watch_unit(self.name, self._on_state)

    @property
    def status(self) -> UnitStatus:
        return UnitStatus.from_properties(self.watch.state)

    def _on_state(self, state: dict[str, Any]) -> None:
        self.states.append(dict(state))
        for waiter in list(self._waiters):
            waiter(state)

    def until(self, condition: Callable[[UnitStatus], bool], what: str) -> Deferred:
        """Fire with the first :class:`UnitStatus` that meets ``condition``
        (now or on a later change); fail with the last state after
        :data:`WAIT_S`."""
        done: Deferred[UnitStatus] = Deferred()

        def check(state: dict[str, Any]) -> None:
            status = UnitStatus.from_properties(state)
            if not done.called and condition(status):
                done.callback(status)

        def timed_out(_result: object, _timeout: float) -> None:
            raise AssertionError(
                f"{self.name} not {what} after {WAIT_S}s; last {self.status}"
            )

        self._waiters.append(check)
        check(self.watch.state)
        done.addTimeout(WAIT_S, reactor, onTimeoutCancel=timed_out)
        return done.addBoth(self._forget(check))

    def _forget(self, check: Callable) -> Callable:
        def forget(result: object) -> object:
            self._waiters.remove(check)
            return result

        return forget

    def send(self, data: bytes) -> None:
        """Write ``data`` to the process's stdin, then close it (EOF)."""
        self.ours["stdin"].sendall(data)
        self.ours["stdin"].shutdown(socket.SHUT_WR)

    async def read(self, stream: str) -> bytes:
        """Everything the process wrote on ``stream``, to EOF. Never blocks
        the reactor: systemd holds its end until the unit is stopped."""
        sock = self.ours[stream]
        sock.setblocking(False)
        chunks: list[bytes] = []

        async def drained() -> bool:
            return _read_available(sock, chunks)

        await poll(drained, f"no EOF on {self.name} {stream}")
        return b"".join(chunks)

    async def finish(self) -> None:
        """Stop the unit (``StopUnit``), reset it if it failed, and wait
        until systemd has unloaded it."""
        # "replace": a start job still queued is cancelled, not an error.
        await _ignore_no_such_unit(self.client.stop_unit(self.name, "replace"))
        await poll(self._unloaded, f"{self.name} still loaded")

    async def _unloaded(self) -> bool:
        listed = await self.client.list_units_by_patterns([], [self.name])
        if listed and listed[0][3] == "failed":
            await _ignore_no_such_unit(self.client.reset_failed_unit(self.name))
        return not listed

    async def close(self) -> None:
        """Unload the unit whatever its state, then drop the watch and fds."""
        try:
            await self.finish()
        finally:
            self.watch.cancel()
            for sock in self.ours.values():
                sock.close()


def _read_available(sock: socket.socket, chunks: list[bytes]) -> bool:
    """Append what can be read now; True at EOF."""
    while True:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        chunks.append(chunk)


async def written(run: Run, stream: str, text: bytes) -> None:
    """Wait until the unit's processes have written ``text`` on ``stream``;
    fail at its EOF without it, or after :data:`WAIT_S`."""
    sock = run.ours[stream]
    sock.setblocking(False)
    chunks: list[bytes] = []

    async def seen() -> bool:
        ended = _read_available(sock, chunks)
        assert text in b"".join(chunks) or not ended, f"EOF after {chunks}"
        return text in b"".join(chunks)

    await poll(seen, f"{text!r} not written on {run.name} {stream}")


async def _ignore_no_such_unit(call: Deferred) -> None:
    try:
        await call
    except SystemdError as error:
        if error.name != NO_SUCH_UNIT:
            raise


class Launcher:
    """Starts units the way sdexec does and remembers them for cleanup."""

    def __init__(self, client: SystemdClient) -> None:
        self.client = client
        self.runs: list[Run] = []
        self.pids: set[int] = set()

    async def start(
        self,
        cmdline: list[str],
        properties: dict[str, str] | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        name: str | None = None,
    ) -> Run:
        """Start ``cmdline`` as a transient unit with three socketpairs;
        systemd's ends are closed once it replied."""
        command = Command(cmdline, env=env or {}, cwd=cwd)
        executable = command.find_executable().executable or cmdline[0]
        start = command_line(command, executable, properties or {})
        unit = unit_properties(command, start, properties or {})
        pairs = {stream: socket.socketpair() for stream in STREAMS}
        run = Run(self.client, name or unit_name(), {s: p[0] for s, p in pairs.items()})
        self.runs.append(run)
        try:
            await self.client.start_transient_unit(
                run.name, unit, *(pairs[s][1].fileno() for s in STREAMS)
            )
        finally:
            for _ours, theirs in pairs.values():
                theirs.close()
        return run

    async def close(self) -> None:
        """Unload every unit, even when one of them fails to; the first
        failure is raised afterwards."""
        errors = []
        for run in self.runs:
            try:
                await run.close()
            except Exception as error:
                errors.append(error)
            self.pids.update(state.get("ExecMainPID", 0) for state in run.states)
        if errors:
            raise errors[0]


# -- fixtures ----------------------------------------------------------------


def _open_fds() -> dict[str, str]:
    """This process's fds and what they are (the listing's own fd, closed
    by the time it is read, is left out)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return fds


def _listed_units() -> str:
    return subprocess.run(
        [*SYSTEMCTL_LIST, f"*sdexec-test-{RUN_ID}-*"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture(scope="module")
def started_pids() -> set[int]:
    """Main pids of every unit of this module (filled by ``units``)."""
    return set()


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind(user_manager, started_pids):
    """After the module: no unit of this run is loaded and none of its
    processes lives."""
    yield
    assert _listed_units() == ""
    alive = [pid for pid in started_pids if pid > 0 and os.path.exists(f"/proc/{pid}")]
    assert alive == []


@pytest_twisted.async_yield_fixture(scope="module")
async def client(user_manager, nothing_left_behind):
    """One connection to the user manager for the whole module; no test may
    leave an fd open (compared after connecting: the first connection sets
    up a pipe that asyncio keeps for the life of the process)."""
    connected = await SystemdClient.connect(user_manager.bus_address)
    fds_connected = _open_fds()
    yield connected
    leaked = set(_open_fds().items()) - set(fds_connected.items())
    connected.disconnect()
    assert leaked == set()
    await connected.disconnected


@pytest_twisted.async_yield_fixture
async def units(client, started_pids):
    """A :class:`Launcher`; every unit it started is unloaded afterwards."""
    launcher = Launcher(client)
    yield launcher
    await launcher.close()
    started_pids.update(launcher.pids)


async def service_properties(run: Run) -> dict[str, Any]:
    """``GetAll`` of the unit's ``Service`` interface (cgroup settings too)."""
    return await run.client.get_all(run.watch.path, SERVICE)


# -- I/O -----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_stdin_round_trips_to_stdout(units):
    run = await units.start(["cat"])
    run.send(b"hello\nworld\n")
    status = await run.until(lambda s: s.has_finished, "finished")
    await run.finish()
    assert status.wait_status == 0
    assert await run.read("stdout") == b"hello\nworld\n"
    assert await run.read("stderr") == b""


@pytest_twisted.ensureDeferred
async def test_stderr_is_a_separate_stream(units):
    run = await units.start(["sh", "-c", "echo out; echo err >&2"])
    await run.until(lambda s: s.has_finished, "finished")
    await run.finish()
    assert await run.read("stdout") == b"out\n"
    assert await run.read("stderr") == b"err\n"


# -- exit, failure, signals ------------------------------------------------------


def settled(status: UnitStatus) -> bool:
    """systemd is done with the unit's main process: active/exited or failed.

    Needed before asserting on the unit's state: ``PropertiesChanged`` comes
    per interface, so the merged state can read activating/start or
    active/running with the exit status already set."""
    return status.sub_state == "exited" or status.active_state == "failed"


@pytest.mark.parametrize("code", [0, 1, 127, 255])
@pytest_twisted.ensureDeferred
async def test_exit_code_gives_the_wait_status(units, code):
    run = await units.start(["sh", "-c", f"exit {code}"])
    status = await run.until(settled, "exited or failed")
    assert status.has_started
    assert not status.has_failed
    assert os.WIFEXITED(status.wait_status)
    assert os.WEXITSTATUS(status.wait_status) == code
    # RemainAfterExit: exit 0 stays active/exited, any other code is failed.
    assert status.needs_stop == (code == 0)
    assert status.needs_reset == (code != 0)


@pytest_twisted.ensureDeferred
async def test_missing_binary_fails_and_is_reset(units):
    missing = f"/nonexistent-{uuid.uuid4().hex}/program"
    run = await units.start([missing])
    status = await run.until(settled, "failed")
    assert (status.active_state, status.code, status.status) == ("failed", 1, 203)
    assert status.has_failed
    assert not status.has_finished
    errnum, message = status.failure(missing, None)
    assert errnum == errno.ENOENT
    assert f"203/EXEC (result: exit-code): cannot execute {missing} (" in message
    await run.client.reset_failed_unit(run.name)
    assert await run.client.list_units_by_patterns([], [run.name]) == []


@pytest_twisted.ensureDeferred
async def test_kill_unit_sigterm_gives_the_signal_status(units):
    run = await units.start(["sleep", "300"])
    started = await run.until(lambda s: s.has_started, "started")
    assert (started.active_state, started.sub_state) == ("active", "running")
    assert os.path.exists(f"/proc/{started.pid}")
    await run.client.kill_unit(run.name, "main", signal.SIGTERM)
    status = await run.until(lambda s: s.has_finished, "finished")
    assert status.pid == started.pid
    assert status.wait_status == signal.SIGTERM
    assert os.WIFSIGNALED(status.wait_status)


# -- the watch ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_watch_merges_unit_and_service_and_refresh_fetches_all(units):
    run = await units.start(["true"])
    await run.until(lambda s: s.has_finished, "finished")
    assert {"ActiveState", "ExecMainStatus"} <= run.watch.state.keys()
    refreshed = await run.watch.refresh()
    assert refreshed["Id"] == run.name
    assert (
        refreshed["ExecStart"][0][0] == Command(["true"]).find_executable().executable
    )
    # The watch keeps what it follows: some 400 properties were 53 KB a unit.
    assert run.states[-1].items() <= refreshed.items()
    assert "ControlGroup" in run.states[-1] and "ExecStart" not in run.states[-1]


@pytest_twisted.ensureDeferred
async def test_a_unit_watched_anew_after_a_cancel_is_followed(units):
    run = await units.start(["sleep", "300"])
    await run.until(lambda s: s.has_started, "started")
    stale = run.watch
    with pytest.raises(ValueError, match="already watched"):
        run.client.watch_unit(run.name, run._on_state)
    stale.cancel()
    run.watch = run.client.watch_unit(run.name, run._on_state)
    await run.client.kill_unit(run.name, "main", signal.SIGKILL)
    status = await run.until(lambda s: s.has_finished, "finished")
    assert status.wait_status == signal.SIGKILL
    assert not UnitStatus.from_properties(stale.state).has_finished


# -- names and listing --------------------------------------------------------------


def test_the_manager_s_version_is_read_as_systemctl_shows_it(units):
    # What the service checks against the oldest systemd it serves.
    shown = subprocess.run(
        ["systemctl", "--user", "show", "-p", "Version", "--value"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert units.client.version == shown.stdout.strip()
    assert version_problem(units.client.version, fenced=True) is None


@pytest_twisted.ensureDeferred
async def test_the_manager_s_own_cgroup_is_read_and_holds_its_units(units):
    # Where a lost unit's cgroup is trusted (sdexec/orphans.py).
    shown = subprocess.run(
        ["systemctl", "--user", "show", "-p", "ControlGroup", "--value"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert units.client.control_group == shown.stdout.strip()
    run = await units.start(["sleep", "30"])
    status = await run.until(lambda s: s.pid > 0, "running")
    service = await service_properties(run)
    path = service["ControlGroup"]
    assert path.startswith(f"{units.client.control_group.rstrip('/')}/")
    assert unit_cgroup(run.name, status.pid, units.client.control_group) == path
    manager = units.client.control_group
    assert expected_unit_cgroup(manager, service["Slice"], run.name) == path
    await run.finish()


@pytest_twisted.ensureDeferred
async def test_a_unit_named_like_a_controller_s_file_is_found_where_made(units):
    # systemd 254 escapes every name that begins with "cpu." (review AR F5:
    # 252 does not escape this one, and a lost unit's cgroup was missed).
    name = f"cpu.job-{uuid.uuid4().hex}.service"
    run = await units.start(["sleep", "30"], name=name)
    await run.until(lambda s: s.pid > 0, "running")
    service = await service_properties(run)
    version = version_number(units.client.version)
    manager = units.client.control_group
    expected = expected_unit_cgroup(manager, service["Slice"], name, version)
    assert expected == service["ControlGroup"]
    await run.finish()


@pytest_twisted.ensureDeferred
async def test_list_units_finds_the_unit_at_its_escaped_path(units):
    """A leading digit, ``-`` and ``.`` are all escaped in the object path."""
    name = unit_name(prefix="7.x-")
    run = await units.start(["sleep", "300"], name=name)
    await run.until(lambda s: s.has_started, "started")
    listed = await run.client.list_units_by_patterns(["active"], [name])
    assert [(unit[0], unit[6]) for unit in listed] == [(name, unit_object_path(name))]
    assert unit_object_path(name).startswith(
        "/org/freedesktop/systemd1/unit/_37_2ex_2d"
    )


# -- environment and working directory -----------------------------------------


@pytest_twisted.ensureDeferred
async def test_cwd_and_environment_reach_the_process(units, tmp_path):
    env = {"GOOD": "value with spaces", "BASH_FUNC_ml()": "() {  echo ml; }"}
    script = 'pwd; printf "%s\\n" "$GOOD"; env | grep -c BASH_FUNC || true'
    run = await units.start(["sh", "-c", script], env=env, cwd=str(tmp_path))
    await run.until(lambda s: s.has_finished, "finished")
    environment = (await service_properties(run))["Environment"]
    await run.finish()
    assert await run.read("stdout") == f"{tmp_path}\nvalue with spaces\n0\n".encode()
    assert environment == ["GOOD=value with spaces"]


@pytest_twisted.ensureDeferred
async def test_one_mib_environment_starts(units):
    env = {f"SDEXEC_BIG_{i:04d}": f"{i:04d}" + "x" * 1020 for i in range(1024)}
    run = await units.start(["printenv", "SDEXEC_BIG_0777"], env=env)
    status = await run.until(lambda s: s.has_finished, "finished")
    await run.finish()
    assert status.wait_status == 0
    assert await run.read("stdout") == env["SDEXEC_BIG_0777"].encode() + b"\n"


# -- typed properties ---------------------------------------------------------------


SIZED = {
    "MemoryHigh": "1G",
    "MemoryMax": "1.5G",
    "MemoryMin": "4096",
    "MemoryLow": "512K",
    "MemorySwapMax": "2M",
    "AllowedCPUs": "0-2,9",
    "AllowedMemoryNodes": "[0]",
    "DeviceAllow": "/dev/null rw,/dev/zero r",
    "SendSIGKILL": "no",
    "TimeoutStopUSec": "5000000",
    "OOMScoreAdjust": "5",
    "CPUAccounting": "Yes",
    "DevicePolicy": "closed",
}
UNLIMITED = {
    "MemoryMax": "30%",
    "MemoryHigh": "infinity",
    "MemorySwapMax": "infinity",
    "AllowedCPUs": "",
    "AllowedMemoryNodes": "",
    "SendSIGKILL": "TRUE",
    "TimeoutStopUSec": "infinity",
    "OOMScoreAdjust": "-7",
}


def physical_memory_scale(scale: int) -> int:
    """What systemd reads back for ``<Name>Scale``: its
    ``physical_memory_scale`` (whole pages of its physical memory, which is
    its root cgroup's limit where that is less than the RAM: a container)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return physical_memory() // page * scale // UINT32_MAX * page


@pytest_twisted.ensureDeferred
async def test_sizes_idsets_devices_and_scalars_round_trip(units):
    run = await units.start(["true"], SIZED)
    props = await service_properties(run)
    assert [props[name] for name in ("MemoryHigh", "MemoryMax", "MemoryMin")] == [
        2**30,
        3 * 2**29,
        4096,
    ]
    assert (props["MemoryLow"], props["MemorySwapMax"]) == (512 * 1024, 2 * 2**20)
    assert IDset.from_bitmask(props["AllowedCPUs"]) == IDset("0-2,9")
    assert IDset.from_bitmask(props["AllowedMemoryNodes"]) == IDset("0")
    assert sorted(props["DeviceAllow"]) == [("/dev/null", "rw"), ("/dev/zero", "r")]
    assert props["SendSIGKILL"] is False
    assert props["TimeoutStopUSec"] == 5_000_000
    assert props["OOMScoreAdjust"] == 5
    assert props["CPUAccounting"] is True
    assert props["DevicePolicy"] == "closed"


@pytest_twisted.ensureDeferred
async def test_percent_infinity_and_empty_masks_round_trip(units):
    run = await units.start(["true"], UNLIMITED)
    props = await service_properties(run)
    assert props["MemoryMax"] == physical_memory_scale(scale_from_permyriad(3000))
    assert props["MemoryHigh"] == props["MemorySwapMax"] == UINT64_MAX
    assert props["AllowedCPUs"] == props["AllowedMemoryNodes"] == b""
    assert props["SendSIGKILL"] is True
    assert props["TimeoutStopUSec"] == UINT64_MAX
    assert props["OOMScoreAdjust"] == -7
    shown = subprocess.run(
        ["systemctl", "--user", "show", "-p", "MemoryMax,AllowedCPUs", run.name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert shown == ["AllowedCPUs=", f"MemoryMax={props['MemoryMax']}"]


@pytest_twisted.ensureDeferred
async def test_bad_value_fails_naming_the_property_before_sending(units):
    name = unit_name()
    with pytest.raises(PropertyError, match=r"^SDEXEC_PROP_SendSIGKILL: error setting"):
        await units.start(["true"], {"SendSIGKILL": "maybe"}, name=name)
    assert units.runs == []
    assert await units.client.list_units_by_patterns([], [name]) == []


@pytest_twisted.ensureDeferred
async def test_unknown_property_surfaces_systemds_error_naming_it(units):
    with pytest.raises(SystemdError, match="NoSuchSdexecProperty") as refused:
        await units.start(["true"], {"NoSuchSdexecProperty": "1"})
    assert refused.value.name == "org.freedesktop.DBus.Error.PropertyReadOnly"
    assert await units.client.list_units_by_patterns([], [units.runs[0].name]) == []


@pytest_twisted.ensureDeferred
async def test_bad_string_value_is_refused_by_systemd_without_its_name(units):
    """systemd 252 answers a bad value of a string-typed property with a bare
    "Invalid argument": the caller must say which properties it sent."""
    with pytest.raises(SystemdError) as refused:
        await units.start(["true"], {"DevicePolicy": "bogus"})
    assert refused.value.name == "org.freedesktop.DBus.Error.InvalidArgs"
    assert await units.client.list_units_by_patterns([], [units.runs[0].name]) == []


# -- how a unit ends: the lifecycle properties of sdexec.unitstop -----------------


@pytest_twisted.ensureDeferred
async def test_when_a_unit_began_deactivating_is_on_the_timers_clock(units):
    """A leftover's stop timer counts from ``StateChangeTimestampMonotonic``
    on the service's timers' clock (sdexec/leftovers.py): the watch keeps
    it (also from a refresh alone: a leftover is found deactivating, and
    no signal comes), it is that clock's, and a stop made again (each start
    of the service stops its leftovers) leaves it as it was."""
    clock = timers_clock(reactor)
    lingering = "trap '' TERM; sleep 60 & exit 0"
    run = await units.start(["sh", "-c", lingering], lifecycle_properties())
    try:
        await run.until(lambda s: s.has_finished, "main process exited")
        before = clock.seconds()
        await run.client.stop_unit(run.name, "replace")
        await run.until(lambda s: s.active_state == "deactivating", "deactivating")
        began = run.watch.state["StateChangeTimestampMonotonic"]
        assert before <= began / 1e6 <= clock.seconds()
        await run.client.stop_unit(run.name, "replace")
        run.watch.cancel()  # as a new run of the service finds it
        run.watch = run.client.watch_unit(run.name, run._on_state)
        refreshed = await run.watch.refresh()
        assert refreshed["ActiveState"] == "deactivating"
        assert run.watch.state["StateChangeTimestampMonotonic"] == began
    finally:
        await run.client.kill_unit(run.name, "all", signal.SIGKILL)
    await run.until(lambda s: s.active_state != "deactivating", "stopped")


@pytest_twisted.ensureDeferred
async def test_lifecycle_properties_leave_lingering_processes_to_sdexec(units):
    """With :func:`lifecycle_properties`, a unit whose main process exited
    but whose child ignores SIGTERM stays deactivating after ``StopUnit``
    with no systemd stop timeout or SIGKILL pending: the state the stop
    timer measures. Only sdexec's own KillUnit ends it."""
    # A child that outlives its parent and survives SIGTERM, saying it got
    # it, once it is ready to (bounded: even a failed test leaves nothing
    # behind for long; the SIGTERM ends a sleep of its loop, not the loop).
    lingering = (
        "(trap 'echo TERM' TERM; echo ready; n=0; while [ $n -lt 60 ]; do"
        " sleep 1; n=$((n + 1)); done) & exit 0"
    )
    run = await units.start(["sh", "-c", lingering], lifecycle_properties())
    try:
        status = await run.until(lambda s: s.has_finished, "main process exited")
        assert status.wait_status == 0
        props = await service_properties(run)
        assert props["TimeoutStopUSec"] == UINT64_MAX
        assert props["SendSIGKILL"] is False
        assert props["KillMode"] == "control-group"
        await written(run, "stdout", b"ready\n")  # its trap set
        await run.client.stop_unit(run.name, "replace")
        await run.until(lambda s: s.active_state == "deactivating", "deactivating")
        # The stop's SIGTERM has reached the child and changed nothing:
        # systemd, with no timeout to wait out, has nothing left to do.
        await written(run, "stdout", b"TERM\n")
        assert (await run.watch.refresh())["ActiveState"] == "deactivating"
    finally:
        # What the stop timer does: KillUnit on every process of the unit.
        await run.client.kill_unit(run.name, "all", signal.SIGKILL)
    await run.until(lambda s: s.active_state != "deactivating", "stopped")
