"""SdexecService without systemd: start, reload, losing systemd, stop, with
sdexec.testing's FakeManager (the real-manager paths are test_service.py)."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import twisted.python.lockfile
from dbus_fast import Message, MessageType
from pytest_twisted import ensureDeferred
from support import until
from test_devicefence import run_canary
from test_leftovers import leftover
from twisted.internet import defer, reactor
from twisted.internet.endpoints import _SystemdParser
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.python.systemd import ListenFDs

from sdexec.client import connect
from sdexec.config import ConfigError, load_config, parse_config
from sdexec.containment import Containment
from sdexec.leftovers import owner_marks
from sdexec.ownerlock import AlreadyServed, OwnerLock
from sdexec.service import (
    EX_CONFIG,
    ListenError,
    ReloadRefused,
    SdexecService,
    StoppedWhileStarting,
    _fails_again,
    default_listen_endpoint,
)
from sdexec.sockets import clear_stale_socket
from sdexec.systemd import SystemdError
from sdexec.systemd.unanswered import Silence
from sdexec.testing import EXITED, INACTIVE, FakeManager


def test_no_xdg_runtime_dir_is_a_one_line_config_error(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with pytest.raises(ConfigError) as error:
        default_listen_endpoint()
    assert "XDG_RUNTIME_DIR" in str(error.value)
    assert "\n" not in str(error.value)


def test_an_unusable_runtime_directory_is_a_one_line_config_error(
    monkeypatch, tmp_path
):
    # A file where its directory goes: a traceback and exit 1 had the unit
    # restart it every 5 s.
    (tmp_path / "sdexec").write_text("")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as error:
        default_listen_endpoint()
    assert str(error.value) == (
        f"<environment>: XDG_RUNTIME_DIR: {tmp_path}/sdexec: File exists: give"
        " --listen or [sdexec] listen"
    )


def test_the_default_endpoint_is_a_private_socket(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    endpoint = default_listen_endpoint()
    # The very string of old versions, which marked units with its hash:
    # their leftovers are still recognised (sdexec.leftovers.owner_marks).
    assert endpoint == f"unix:{tmp_path}/sdexec/sdexec.sock:mode=600:lockfile=1"
    assert (tmp_path / "sdexec").stat().st_mode & 0o777 == 0o700
    # socket-mode applies to this one too: users of allow-users need it,
    # and search on its directory.
    assert default_listen_endpoint(0o660).endswith(":mode=660:lockfile=1")
    assert (tmp_path / "sdexec").stat().st_mode & 0o777 == 0o710


@ensureDeferred
async def test_a_second_service_on_the_same_endpoint_touches_nothing(tmp_path):
    """It would take the first one's running units for leftovers of an
    earlier run and stop them: it stops before it reaches systemd."""
    first = await started_service(tmp_path, FakeManager())
    reached = []
    second = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/s.sock:mode=600",  # the first one's socket
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: reached.append("systemd") or defer.succeed(FakeManager()),
    )
    second.startService()
    with pytest.raises(AlreadyServed) as error:
        await second.ready
    assert reached == []
    lock = first.owner_lock.path
    assert os.path.dirname(lock) == str(tmp_path)
    assert str(error.value) == (
        f"--listen: another sdexec (pid {os.getpid()}) serves"
        f" unix:{tmp_path}/s.sock:mode=600: it holds {lock}; not starting,"
        " and none of its units touched"
    )
    await second.stopService()
    with pytest.raises(AlreadyServed):  # the first one's still
        OwnerLock(first.listen, first.server.unit_mark, 0o600).take()
    await first.stopService()
    await (await started_service(tmp_path, FakeManager())).stopService()


@ensureDeferred
async def test_a_socket_s_directory_lets_in_whom_its_own_mode_does(tmp_path):
    """listen's mode=666 wins over socket-mode for the socket: the owner
    lock, first of all, made its directory for socket-mode's 0600 (0700),
    which kept out the users of allow-users the socket let connect."""
    service = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/d/s.sock:mode=666",
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: defer.succeed(FakeManager()),
    )
    service.startService()
    await service.ready
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o711
    assert stat.S_IMODE((tmp_path / "d" / "s.sock").stat().st_mode) == 0o666
    await service.stopService()


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"%d" % os.getpid())
print("held", flush=True)
time.sleep(60)
"""


def test_a_lock_is_held_while_its_process_lives_and_no_longer(tmp_path):
    """flock: the kernel lets it go when the holder dies, however it dies,
    and a pid the kernel gave to another program is never trusted."""
    lock = OwnerLock(f"unix:{tmp_path}/s.sock", " [sdexec:0123456789ab]", 0o600)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, lock.path], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        with pytest.raises(
            AlreadyServed, match=f"another sdexec \\(pid {holder.pid}\\)"
        ):
            lock.take()
    finally:
        holder.kill()
        holder.wait()
    lock.take()  # a SIGKILL left the file, and no lock
    assert Path(lock.path).read_text() == f"{os.getpid()}\n"
    lock.release()


def test_a_service_holding_the_lock_of_an_earlier_spelling_refuses_this_one(
    tmp_path,
):
    # Before the socket path was taken in one spelling, a service listening
    # on "..././s.sock" locked a file of that spelling's name: a new one on
    # it, locking another name, would stop the running one's units.
    spelled = f"unix:{tmp_path}/./s.sock"
    current, *earlier = owner_marks(spelled)
    old = OwnerLock(spelled, earlier[0], 0o600)
    old.take()
    new = OwnerLock(spelled, current, 0o600, tuple(earlier))
    try:
        with pytest.raises(AlreadyServed, match=f"holds {old.path}"):
            new.take()
    finally:
        old.release()
    new.take()  # once it is gone
    # Held for the service's life: the earlier version started later is
    # refused in turn, told who holds it.
    with pytest.raises(AlreadyServed, match=f"\\(pid {os.getpid()}\\)"):
        OwnerLock(spelled, earlier[0], 0o600).take()
    new.release()
    # Something else at that name (not a file) is no service's: no refusal,
    # and no descriptor held.
    os.unlink(old.path)
    os.mkdir(old.path)
    new.take()
    new.release()


def test_a_lock_whose_pid_cannot_be_written_is_let_go(tmp_path, monkeypatch):
    # A full /run: the descriptor holding the lock leaked, and a retake in
    # the same process was refused by it.
    lock = OwnerLock(f"unix:{tmp_path}/s.sock", " [sdexec:0123456789ab]", 0o600)

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        lock.take()
    monkeypatch.undo()
    lock.take()
    lock.release()


def test_a_lock_of_the_first_version_a_pid_link_is_replaced(tmp_path):
    lock = OwnerLock(f"unix:{tmp_path}/s.sock", " [sdexec:0123456789ab]", 0o600)
    os.symlink("1", lock.path)  # never followed: no file named 1 is made
    lock.take()
    assert not os.path.islink(lock.path) and not (tmp_path / "1").exists()
    lock.release()


@ensureDeferred
async def test_a_socket_and_pid_link_an_earlier_run_left_do_not_refuse_a_start(
    tmp_path,
):
    # Twisted's lockfile=1 judged its pid link by whether the pid lived: the
    # killed service still a zombie, or its pid reused (here: 1), refused
    # the restart after it had begun stopping the leftovers it found.
    for name in ("s.sock", "stats.sock"):  # stats-socket has a link too
        left = socket.socket(socket.AF_UNIX)
        left.bind(str(tmp_path / name))  # bound, no longer served
        left.close()
        os.symlink("1", tmp_path / f"{name}.lock")
    typo = tmp_path / "not-a-socket"
    typo.write_text("kept")
    service = service_on(
        FakeManager(),
        f"unix:{tmp_path}/s.sock:lockfile=1",
        {"sdexec": {"stats-socket": f"{tmp_path}/stats.sock"}},
    )
    service.startService()
    await service.ready
    client = await connect(reactor, f"{tmp_path}/s.sock")
    assert (await client.list())["procs"] == []
    assert os.readlink(tmp_path / "s.sock.lock") == str(os.getpid())
    # Each stats endpoint has a site, and a connection cap, of its own:
    # strangers on TCP cannot close the private socket's connections.
    assert service.ports["stats"].factory is not service.ports["stats-socket"].factory
    await client.close()
    await service.stopService()
    # Only a socket is ever removed, never a file at a mistyped path.
    with pytest.raises(ValueError, match="not a socket"):
        clear_stale_socket(f"unix:{typo}")
    assert typo.read_text() == "kept"


def _dead_pid() -> str:
    child = subprocess.Popen(["true"])
    child.wait()
    return str(child.pid)


@pytest.mark.parametrize("link", [False, True], ids=["no-link", "dead-pid-link"])
@ensureDeferred
async def test_a_socket_another_program_serves_is_never_taken_over(tmp_path, link):
    # A start refused with "Address already in use" left Twisted's pid link
    # (lockfile=1) behind; the unit restarted it 5 s later, Twisted judged
    # the link stale (its pid dead) and removed the served socket, and
    # sdexec took its path: sdexec.socket's, enabled without listen =
    # "systemd:...", whose clients then hung in its backlog.
    path = tmp_path / "s.sock"
    served = socket.socket(socket.AF_UNIX)
    served.bind(str(path))
    served.listen()
    inode = os.stat(path).st_ino
    if link:
        os.symlink(_dead_pid(), f"{path}.lock")
    service = service_on(FakeManager(), f"unix:{path}:lockfile=1")
    try:
        service.startService()
        with pytest.raises(ListenError, match="Address already in use"):
            await service.ready
        await service.stopService()
        assert os.stat(path).st_ino == inode
    finally:
        served.close()


def service_on(
    manager: FakeManager,
    listen: str,
    config: dict | None = None,
    stats: str = "tcp:0:interface=127.0.0.1",
) -> SdexecService:
    """A service on ``manager``, not started."""
    return SdexecService(
        parse_config(config or {}),
        reactor,
        listen=listen,
        stats=stats,
        connect=lambda: defer.succeed(manager),
    )


def with_a_leftover(listen: str) -> FakeManager:
    """A manager running ``sdexec-left.service``, of an earlier run of the
    service on ``listen``."""
    manager = FakeManager()
    leftover(manager, "sdexec-left.service", mark=owner_marks(listen)[0])
    return manager


@ensureDeferred
async def test_a_start_that_listens_stops_the_leftovers_it_held(tmp_path):
    listen = f"unix:{tmp_path}/v.sock"
    manager = with_a_leftover(listen)
    service = service_on(manager, listen)
    service.startService()
    await service.ready
    assert ("stop", "sdexec-left.service") in manager.calls
    await service.stopService()


@ensureDeferred
async def test_the_start_s_line_says_which_port_tcp_0_was_given(tmp_path):
    # The kernel picks it: the admin (and a scraper's config) must read it
    # somewhere, and the stats endpoint's own description says only "0".
    from twisted.logger import capturedLogs, formatEvent

    service = service_on(FakeManager(), f"unix:{tmp_path}/p.sock")
    with capturedLogs() as events:
        service.startService()
        await service.ready
    port = service.ports["stats"].getHost().port
    lines = [formatEvent(event) for event in events]
    said = f"stats on tcp:0:interface=127.0.0.1 (127.0.0.1:{port})"
    assert port != 0 and any(line.endswith(said) for line in lines), lines
    await service.stopService()


@ensureDeferred
async def test_a_start_that_fails_to_listen_stops_no_leftover(tmp_path):
    # It adopted them, stopped them, then failed: they ran on unfollowed,
    # or stopped, until some later start.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    listen = f"unix:{tmp_path}/v.sock"
    manager = with_a_leftover(listen)
    service = service_on(
        manager, listen, stats=f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1"
    )
    try:
        service.startService()
        with pytest.raises(ListenError):
            await service.ready
        assert ("stop", "sdexec-left.service") not in manager.calls
        await service.stopService()
    finally:
        taken.close()


def service_with_file(tmp_path, manager: FakeManager, text: str = "") -> SdexecService:
    """A service on ``manager`` with a configuration file of ``text``."""
    path = tmp_path / "sdexec.toml"
    path.write_text(text)
    return SdexecService(
        load_config(path),
        reactor,
        listen=f"unix:{tmp_path}/s.sock",
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: defer.succeed(manager),
    )


async def started_service(tmp_path, manager: FakeManager) -> SdexecService:
    """A service on ``manager`` with an empty configuration file, started."""
    service = service_with_file(tmp_path, manager)
    service.startService()
    await service.ready
    return service


@ensureDeferred
async def test_the_status_line_tells_a_manager_that_does_not_answer(tmp_path):
    manager = FakeManager()
    service = await started_service(tmp_path, manager)
    notes = service.readiness.notifier = RecordedNotes()
    manager.silent = Silence("StartTransientUnit", 40, 3)
    service.readiness.reloaded()  # sends the status line as it is now
    assert notes.sent[-1]["STATUS"] == (
        "serving 0 processes; systemd has not answered StartTransientUnit"
        " for 40 s (3 calls waiting)"
    )
    await service.stopService()


@ensureDeferred
async def test_start_serve_reload_and_stop(tmp_path):
    manager = FakeManager()
    service = await started_service(tmp_path, manager)
    client = await connect(reactor, f"{tmp_path}/s.sock")
    assert (await client.list())["procs"] == []
    (tmp_path / "sdexec.toml").write_text("[systemd]\nsdbus-debug = true\n")
    assert await service.reload()
    assert manager.debug is True
    (tmp_path / "sdexec.toml").write_text(
        '[exec]\nsdexec-properties = {CPUWeight = "abc"}\n'
    )
    assert not await service.reload()  # refused: the old configuration stays
    assert service.server.config is service.config
    await client.close()
    await service.stopService()
    assert ("disconnect",) in manager.calls


def gated_lstopo(tmp_path: Path, monkeypatch) -> Path:
    """An lstopo on PATH that touches GATE.running, then waits until the
    test makes GATE (the gate's path, returned) to print a topology."""
    gate = tmp_path / "gate"
    xml = Path(__file__).parent / "data" / "small.xml"
    fake = tmp_path / "bin" / "lstopo-no-graphics"
    fake.parent.mkdir()
    fake.write_text(
        f"#!/bin/sh\ntouch '{gate}.running'\n"
        f"for i in $(seq 300); do [ -e '{gate}' ] && exec cat '{xml}'\n"
        "sleep 0.1; done\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    return gate


async def reloading_into_containment(
    tmp_path: Path, monkeypatch
) -> tuple[Path, FakeManager, SdexecService]:
    """A started service whose file now turns containment on, with
    :func:`gated_lstopo`'s lstopo: the gate, the manager, the service."""
    gate = gated_lstopo(tmp_path, monkeypatch)
    manager = FakeManager()
    service = await started_service(tmp_path, manager)
    (tmp_path / "sdexec.toml").write_text("[exec]\nsdexec-constrain-resources = true\n")
    return gate, manager, service


@ensureDeferred
async def test_reloads_the_stop_overtakes_are_dropped_and_say_nothing(
    tmp_path, monkeypatch
):
    # One in its thread and one waiting for it when the stop came: the
    # second ran after the stop (a canary started on a stopped service),
    # and both told systemd READY=1 after STOPPING=1.
    gate, manager, service = await reloading_into_containment(tmp_path, monkeypatch)
    notes = service.readiness.notifier = RecordedNotes()
    first, second = service.reload(), service.reload()
    await until(lambda: Path(f"{gate}.running").exists(), "lstopo runs")
    stopping = service.stopService()
    gate.touch()
    assert (await first, await second) == (False, False)
    await stopping
    assert notes.names() == ["RELOADING", "STOPPING"]
    assert started_units(manager) == []


@ensureDeferred
async def test_a_site_mapper_that_exits_as_it_loads_refuses_the_reload(
    tmp_path, logged_failures
):
    # SystemExit is no Exception: the reload's answer was EREMOTEIO "3",
    # nothing logged, the refusal not counted, the module not named.
    service = await started_service(tmp_path, FakeManager())
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "bad.py").write_text("raise SystemExit(3)\n")
    topology = Path(__file__).resolve().parent / "data" / "small.xml"
    (tmp_path / "sdexec.toml").write_text(
        "[exec]\nsdexec-constrain-resources = true\n[sdexec]\n"
        f'mapper = "site.bad.Mapper"\nmapper-searchpath = "{tmp_path}"\n'
        f'topology = "{topology}"\n'
    )
    with pytest.raises(ReloadRefused) as refused:
        await service.reload_or_refuse()
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EINVAL,
        "reload refused, old configuration kept:"
        f" {tmp_path}/sdexec.toml: SystemExit: 3",
    )
    # Logged with its traceback, as any fault of a site's mapper module.
    [logged] = logged_failures.flush(SystemExit)
    assert logged.value.code == 3
    assert not service.config.exec.sdexec_constrain_resources
    await service.stopService()


@ensureDeferred
async def test_a_fault_in_a_signal_s_reload_is_logged_as_it_happens(
    tmp_path, monkeypatch, logged_failures
):
    # Nobody waits for a SIGHUP's reload: its failure was an "Unhandled
    # error in Deferred" when the Deferred was collected, naming nothing.
    from twisted.logger import capturedLogs

    service = await started_service(tmp_path, FakeManager())

    def broken(config):
        raise RuntimeError("a fault of ours")

    monkeypatch.setattr(Containment, "from_config", staticmethod(broken))
    with capturedLogs() as events:
        service._sighup()
        await until(lambda: any("log_failure" in e for e in events), "logged")
    [logged] = [e for e in events if "log_failure" in e]
    assert logged["log_format"] == "reload of {path} failed"
    assert logged["log_failure"].getErrorMessage() == "a fault of ours"
    # And an sdexec.reload is told it, refused as a bad file is, the old
    # configuration in force (its words were Python's, and not logged:
    # review session 46).
    with pytest.raises(ReloadRefused) as refused:
        await service.reload_or_refuse()
    assert refused.value.errnum == errno.EINVAL
    assert refused.value.errstr == (
        "reload refused, old configuration kept:"
        f" {service.config.source}: RuntimeError: a fault of ours"
    )
    # Each a fault of ours, with its traceback: the SIGHUP's and this one's.
    faults = [f.getErrorMessage() for f in logged_failures.flush()]
    assert faults == ["a fault of ours"] * 2
    await service.stopService()


@ensureDeferred
async def test_a_reload_builds_the_mapper_while_the_service_serves_on(
    tmp_path, monkeypatch
):
    # lstopo takes seconds on a GPU node: run in the reactor, every stream
    # and timer waited for it. Here it waits until the test lets it go,
    # which the test can do only while the reactor runs.
    gate, manager, service = await reloading_into_containment(tmp_path, monkeypatch)
    reloaded = service.reload()
    await until(lambda: Path(f"{gate}.running").exists(), "lstopo runs")
    # The reactor is free while it runs; the old configuration in force.
    assert not service.config.exec.sdexec_constrain_resources
    gate.touch()
    assert await reloaded is True
    assert service.server.containment.mapper is not None
    run_canary(manager, 1)  # the reload's device canary: the fence holds
    await until(lambda: not service.server.processes, "the canary reaped")
    await service.stopService()


async def reload_saying(service: SdexecService, path: Path, text: str) -> list[str]:
    """Write ``text`` to ``path`` and reload, which must be taken: the lines
    logged meanwhile."""
    from twisted.logger import formatEvent, globalLogPublisher

    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        path.write_text(text)
        assert await service.reload()
    finally:
        globalLogPublisher.removeObserver(observer)
    return lines


@ensureDeferred
async def test_a_reload_keeps_start_only_settings_in_force_and_says_so(tmp_path):
    service = await started_service(tmp_path, FakeManager())
    lines = await reload_saying(
        service,
        tmp_path / "sdexec.toml",
        '[sdexec]\nsocket-mode = "0660"\nmax-connections = 7\n'
        # --listen gave it: the file's value is never the one in force
        'listen = "unix:/run/elsewhere.sock"\n',
    )
    assert service.config.sdexec.socket_mode == 0o600  # what its sockets have
    assert service.config.sdexec.max_connections == 7  # applied
    [warning] = [line for line in lines if "read only at start" in line]
    assert warning == (
        f"{tmp_path}/sdexec.toml: sdexec.socket-mode: read only at start:"
        ' "0660" takes effect at the next restart, "0600" stays in force'
    )
    await service.stopService()


@ensureDeferred
async def test_the_endpoints_the_command_line_gave_are_the_ones_reported(tmp_path):
    # sdexec stats and GET /stats showed the file's listen and stats where
    # twistd's --listen and --stats were in force (review 38 A2-1).
    (tmp_path / "sdexec.toml").write_text(
        '[sdexec]\nlisten = "unix:/run/file.sock"\nstats = "tcp:9999"\n'
    )
    service = await started_service(tmp_path, FakeManager())
    given = (f"unix:{tmp_path}/s.sock", "tcp:0:interface=127.0.0.1")
    reported = service.server.stats()["config"]["sdexec"]
    assert (reported["listen"], reported["stats"]) == given
    await reload_saying(
        service, tmp_path / "sdexec.toml", '[sdexec]\nlisten = "unix:/x"\n'
    )
    assert (service.config.sdexec.listen, service.config.sdexec.stats) == given
    await service.stopService()


@ensureDeferred
async def test_a_reload_judges_allow_users_by_the_socket_mode_in_force(tmp_path):
    # The docs' way: socket-mode "0660" and allow-users, reloaded. The mode
    # stays 0600 until a restart, so those users get EACCES; the warning for
    # that was judged against the file's 0660 and never said (review
    # session 32 U2).
    service = await started_service(tmp_path, FakeManager())
    lines = await reload_saying(
        service,
        tmp_path / "sdexec.toml",
        '[sdexec]\nsocket-mode = "0660"\nallow-users = ["nobody"]\n',
    )
    [warning] = [line for line in lines if "cannot connect" in line]
    assert warning.startswith(
        f"{tmp_path}/sdexec.toml: sdexec.allow-users: the users listed cannot"
        " connect: socket-mode 0600 lets only the owner connect"
    )
    await service.stopService()


def in_reactor_thread(monkeypatch, module, name: str) -> list[bool]:
    """For each later call of ``module.name``: whether it ran in the
    reactor's thread."""
    from twisted.python.threadable import isInIOThread

    threads: list[bool] = []
    original = getattr(module, name)

    def recorded(*args):
        threads.append(isInIOThread())
        return original(*args)

    monkeypatch.setattr(module, name, recorded)
    return threads


@ensureDeferred
async def test_a_reload_parses_the_file_off_the_reactor_thread(tmp_path, monkeypatch):
    # A 16 MiB YAML file held every stream, timer and request for 15 s
    # (review session 32 U3), and so could allow-users' lookups through
    # LDAP (W4): the whole check runs in the pool.
    import sdexec.service

    service = await started_service(tmp_path, FakeManager())
    threads = in_reactor_thread(monkeypatch, sdexec.service, "load_config_quietly")
    (tmp_path / "sdexec.toml").write_text("[sdexec]\nmax-connections = 7\n")
    assert await service.reload()
    assert threads == [False] and service.config.sdexec.max_connections == 7
    await service.stopService()


@ensureDeferred
async def test_a_reload_judges_who_the_socket_keeps_out_off_the_reactor_thread(
    tmp_path, monkeypatch
):
    # Each listed user's groups come from the user database (LDAP, sssd):
    # looked up in the reactor's thread at every reload, every stream and
    # timer waited for them, where the file's own check runs in the pool.
    import sdexec.sockets

    service = await started_service(tmp_path, FakeManager())
    threads = in_reactor_thread(monkeypatch, sdexec.sockets, "_groups_of")
    lines = await reload_saying(
        service,
        tmp_path / "sdexec.toml",
        '[sdexec]\nsocket-mode = "0666"\nallow-users = [65534]\n',
    )
    assert threads == [False]
    # tmp_path is 0700: still said, before the reload is said to be done.
    [said] = [n for n, line in enumerate(lines) if "cannot connect" in line]
    [done] = [n for n, line in enumerate(lines) if "configuration reloaded" in line]
    assert said < done
    await service.stopService()


@ensureDeferred
async def test_a_reload_names_the_endpoint_in_force(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = tmp_path / "sdexec.toml"
    path.write_text("")
    service = SdexecService(load_config(path), reactor)  # listen: the default
    lines = await reload_saying(
        service, path, '[sdexec]\nlisten = "unix:/run/elsewhere.sock"\n'
    )
    [warning] = [line for line in lines if "read only at start" in line]
    assert warning.endswith(
        f' takes effect at the next restart, "unix:{tmp_path}/sdexec/sdexec.sock:'
        'mode=600:lockfile=1" stays in force'
    )


@ensureDeferred
async def test_losing_systemd_drains_only_after_the_reconnect_timeout(tmp_path):
    manager = FakeManager()
    service = await started_service(tmp_path, manager)
    clock = service.server.clock = Clock()
    manager.lose("the D-Bus connection closed")
    assert service.server.drain_reason is None
    clock.advance(60)
    assert service.server.drain_reason == (
        "systemd unreachable for 60 s: the D-Bus connection closed"
    )
    manager.restore()
    assert service.server.drain_reason is None
    manager.lose()
    await service.stopService()  # no drain armed past the stop
    assert clock.getDelayedCalls() == []


def dbus_calls(service: SdexecService) -> dict[str, float]:
    """``sdexec_dbus_call_duration_seconds`` counts, by method (``ok`` ones)."""
    return {
        sample.labels["method"]: sample.value
        for family in service.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "sdexec_dbus_call_duration_seconds_count"
        and sample.labels["outcome"] == "ok"
    }


class CountedManager(FakeManager):
    """A FakeManager that tells ``on_call`` of its leftover scans, as
    SystemdClient does of every call."""

    on_call = None

    def list_units_by_patterns(self, states, patterns):
        if self.on_call is not None:
            self.on_call("ListUnitsByPatterns", 0.001, True)
        return super().list_units_by_patterns(states, patterns)


@ensureDeferred
async def test_the_start_s_leftover_scan_is_counted(tmp_path):
    # on_call was set after the scan: on a restart among thousands of
    # units, the slowest calls the manager got were not counted (review
    # session 40 M M4).
    service = await started_service(tmp_path, CountedManager())
    assert dbus_calls(service) == {"ListUnitsByPatterns": 1}
    await service.stopService()


@ensureDeferred
async def test_the_start_s_calls_on_the_bus_are_counted(tmp_path, monkeypatch):
    # The service's own connection: its Subscribe and Version read too.
    from test_manager_absent import FakeBus

    from sdexec.systemd import bus as bus_module

    def listed(message):
        return Message(
            message_type=MessageType.METHOD_RETURN, reply_serial=1,
            signature="a(ssssssouso)", body=[[]],
        )  # fmt: skip

    async def open_bus(address, system):
        return FakeBus({"ListUnitsByPatterns": listed})

    monkeypatch.setattr(bus_module, "_open_bus", open_bus)
    service = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/s.sock",
        stats="tcp:0:interface=127.0.0.1",
    )
    service.startService()
    await service.ready
    assert dbus_calls(service) == {
        "AddMatch": 3, "Subscribe": 1, "GetNameOwner": 1, "Get": 2,
        "ListUnitsByPatterns": 1,
    }  # fmt: skip
    await service.stopService()


@ensureDeferred
async def test_a_start_that_cannot_reach_systemd_fails_ready(tmp_path):
    service = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/s.sock",
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: defer.fail(SystemdError("sdexec.NoBus", "no user bus")),
    )
    service.startService()
    with pytest.raises(SystemdError, match="no user bus"):
        await service.ready
    await service.stopService()


@ensureDeferred
async def test_a_port_already_taken_is_one_line_naming_the_setting(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    first = await started_service(tmp_path, FakeManager())
    second = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/u.sock",
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: defer.succeed(FakeManager()),
    )
    # Served by a program of some other kind, whose pid link names a live
    # process (this one: pid 1 is another user's where the suite does not
    # run as root): left alone, and Twisted's own lock refuses.
    served = socket.socket(socket.AF_UNIX)
    served.bind(str(tmp_path / "u.sock"))
    served.listen()
    (tmp_path / "u.sock.lock").symlink_to(str(os.getpid()))
    third = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/t.sock",
        stats=f"tcp:{port}:interface=127.0.0.1",
        connect=lambda: defer.succeed(FakeManager()),
    )
    try:
        for service, message in (
            (
                second,
                f"--listen: cannot listen on unix:{tmp_path}/u.sock:"
                " Cannot acquire lock (another sdexec is serving on it)",
            ),
            (
                third,
                f"--stats: cannot listen on tcp:{port}:interface=127.0.0.1:"
                " Address already in use (another program, or sdexec, is serving"
                " on it)",
            ),
        ):
            service.startService()
            with pytest.raises(ListenError) as error:
                await service.ready
            assert str(error.value) == message
            await service.stopService()
    finally:
        taken.close()
        served.close()
        await first.stopService()


@ensureDeferred
async def test_a_pid_link_naming_another_users_process_is_one_line(
    tmp_path, monkeypatch
):
    # Twisted's check of the link (kill(pid, 0)) is EPERM for a process of
    # another user, and it raises that: the start ended in a traceback.
    def not_permitted(pid, signum):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(twisted.python.lockfile, "kill", not_permitted)
    served = socket.socket(socket.AF_UNIX)
    served.bind(str(tmp_path / "u.sock"))
    served.listen()
    (tmp_path / "u.sock.lock").symlink_to("1")
    service = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/u.sock",
        connect=lambda: defer.succeed(FakeManager()),
    )
    try:
        service.startService()
        with pytest.raises(ListenError) as error:
            await service.ready
        assert str(error.value) == (
            f"--listen: cannot listen on unix:{tmp_path}/u.sock:"
            " [Errno 1] Operation not permitted"
        )
        await service.stopService()
    finally:
        served.close()


@ensureDeferred
async def test_a_sighup_while_starting_reloads_once_listening(tmp_path):
    # SIGHUP's default action would end the service: the handler is there
    # from the start, and the reload waits until the service listens.
    path = tmp_path / "sdexec.toml"
    path.write_text("")
    manager, connected = FakeManager(), defer.Deferred()
    service = SdexecService(
        load_config(path),
        reactor,
        listen=f"unix:{tmp_path}/s.sock",
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: connected,
    )
    previous = signal.getsignal(signal.SIGHUP)
    try:
        service.startService()
        handler = signal.getsignal(signal.SIGHUP)
        assert callable(handler) and handler is not previous
        path.write_text("[systemd]\nsdbus-debug = true\n")
        handler(signal.SIGHUP, None)
        await until(lambda: service.reload_when_started, "the SIGHUP is handled")
        assert manager.debug is not True
        connected.callback(manager)
        await service.ready
        await until(lambda: manager.debug is True, "the reload, once listening")
        await service.stopService()
    finally:
        signal.signal(signal.SIGHUP, previous)


@ensureDeferred
async def test_a_stop_leaves_the_inherited_socket_listening_at_its_path(
    tmp_path, monkeypatch
):
    # The socket is the .socket unit's, there for the next start: a stop
    # shut it down and unlinked its path (no client could connect, and
    # activation could never start the service again).
    path = tmp_path / "sdexec.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # systemd's
    listener.bind(str(path))
    os.chmod(path, 0o600)  # the unit's SocketMode=
    listener.listen(16)
    inherited = os.dup(listener.fileno())
    monkeypatch.setattr(_SystemdParser, "_sddaemon", ListenFDs([inherited], ["sdexec"]))
    service = SdexecService(
        parse_config({}),
        reactor,
        listen="systemd:domain=UNIX:name=sdexec",
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: defer.succeed(FakeManager()),
    )
    try:
        service.startService()
        await service.ready
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # Twisted's 0666
        await service.stopService()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))  # refused, or no such file, before
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        listener.close()


# -- the start, a stop and a SIGHUP out of turn (notes/review-session26-F.md) --


class RecordedNotes:
    """A SystemdNotifier that keeps what it would send."""

    enabled = True

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def notify(self, **fields) -> None:
        self.sent.append(fields)

    def close(self) -> None:
        pass

    def names(self) -> list[str]:
        return [next(iter(fields)) for fields in self.sent]


def contained_service(tmp_path, manager: FakeManager) -> SdexecService:
    """A service with containment on (its start waits for the device
    canary), recording its sd_notify messages."""
    topology = Path(__file__).resolve().parent / "data" / "small.xml"
    service = service_with_file(
        tmp_path,
        manager,
        "[exec]\nsdexec-constrain-resources = true\n"
        f'[sdexec]\ntopology = "{topology}"\ncontainment-check = "warn"\n',
    )
    service.readiness.notifier = RecordedNotes()
    return service


def started_units(manager: FakeManager) -> list[str]:
    return [call[1] for call in manager.calls if call[0] == "start"]


@ensureDeferred
async def test_a_stop_during_the_start_leaves_nothing_listening(tmp_path):
    manager = FakeManager()
    manager.stop_to_inactive = True
    service = contained_service(tmp_path, manager)
    service.startService()
    [canary] = started_units(manager)  # the start waits for its verdict
    manager.run(canary)
    await service.stopService()  # SIGTERM while activating
    with pytest.raises(StoppedWhileStarting):
        await service.ready
    assert service.ports == {}
    assert not os.path.exists(f"{tmp_path}/s.sock")
    assert service.readiness.notifier.names() == ["STOPPING"]


@ensureDeferred
async def test_a_sighup_during_the_stop_starts_no_canary_and_says_nothing(tmp_path):
    manager = FakeManager()
    service = contained_service(tmp_path, manager)
    service.startService()
    [canary] = started_units(manager)
    manager.run(canary)
    manager.change(canary, {**EXITED, "ExecMainStatus": 1})
    manager.release(canary)
    manager.change(canary, INACTIVE)
    await service.ready
    stopping = service.stopService()
    service._sighup()  # what the handler schedules (logrotate, kill -HUP)
    await stopping
    assert started_units(manager) == [canary]
    assert service.readiness.notifier.names()[-1] == "STOPPING"


@ensureDeferred
async def test_a_sighup_after_a_failed_start_says_nothing(tmp_path):
    manager = FakeManager()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    service = SdexecService(
        parse_config({}),
        reactor,
        listen=f"unix:{tmp_path}/s.sock",
        stats=f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1",
        connect=lambda: defer.succeed(manager),
    )
    notes = service.readiness.notifier = RecordedNotes()
    try:
        service.startService()
        with pytest.raises(ListenError):
            await service.ready
        service._sighup()
        await service.stopService()
    finally:
        taken.close()
    assert "READY" not in notes.names()


# --- the twistd plugin's options ---------------------------------------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--confg", "/etc/sdexec.toml"], "option --confg not recognized"),
        ([], "--config FILE is required"),
    ],
)
def test_a_usage_error_of_the_plugin_is_one_line_and_ex_config(argv, said, capsys):
    # twistd printed its usage and exited 1, which the units restarted every
    # 5 s for ever (review session 34 A2).
    from twisted.plugins.sdexec_plugin import Options

    with pytest.raises(SystemExit) as exited:
        Options().parseOptions(argv)
    assert exited.value.code == EX_CONFIG
    assert capsys.readouterr().err == f"sdexec: {said}\n"


def test_the_plugin_s_config_help_names_every_format_read():
    # It said "TOML, or YAML" once .json files were read too.
    from sdexec.config import _PARSERS
    from twisted.plugins.sdexec_plugin import Options

    [said] = [help for name, _, _, help in Options.optParameters if name == "config"]
    formats = {suffix[1:].upper().replace("YML", "YAML") for suffix in _PARSERS}
    assert formats == {"TOML", "JSON", "YAML"}
    assert [name for name in sorted(formats) if name not in said] == []


def unresolved_names(monkeypatch) -> None:
    """Make every user name lookup fail, as at boot before sssd answers."""

    def unanswered(name: str) -> None:
        raise KeyError(f"getpwnam(): name not found: {name!r}")

    monkeypatch.setattr("pwd.getpwnam", unanswered)


def test_a_start_refused_for_a_name_not_resolved_yet_is_restarted(
    tmp_path, monkeypatch, capsys
):
    # It exited 78, which the units never restart: a node whose sdexec
    # started before sssd stayed without it (review session 40 G2).
    from twisted.plugins.sdexec_plugin import Options, SdexecServiceMaker

    config = tmp_path / "sdexec.toml"
    config.write_text('[sdexec]\nallow-users = ["slurm"]\n')
    unresolved_names(monkeypatch)
    options = Options()
    options.parseOptions(["--config", str(config)])
    with pytest.raises(SystemExit) as exited:
        SdexecServiceMaker().makeService(options)
    assert exited.value.code == 1  # restarted, within the start limit
    assert capsys.readouterr().err == (
        f'sdexec: {config}: sdexec.allow-users: no such user: "slurm" (or the'
        " name service cannot answer yet)\n"
    )


@ensureDeferred
async def test_a_reload_with_a_name_not_resolved_keeps_the_configuration(
    tmp_path, monkeypatch
):
    from twisted.logger import formatEvent, globalLogPublisher

    service = await started_service(tmp_path, FakeManager())
    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        config = tmp_path / "sdexec.toml"
        config.write_text('[sdexec]\nallow-users = ["slurm"]\n')
        unresolved_names(monkeypatch)
        assert await service.reload() is False
    finally:
        globalLogPublisher.removeObserver(observer)
    assert service.config.sdexec.allow_users == ()
    assert (
        f"reload refused, old configuration kept: {config}: sdexec.allow-users:"
        ' no such user: "slurm" (or the name service cannot answer yet)'
    ) in lines
    await service.stopService()


#: The shipped service units.
UNITS = ("sdexec.service", "sdexec-system.service")


def test_the_system_unit_starts_once_user_names_resolve():
    # allow-users names are looked up at start (review session 40 G2). A
    # passive target: ordered after, never pulled in (systemd.special(7)).
    text = (Path(__file__).parent.parent / "etc" / "sdexec-system.service").read_text()
    after = " ".join(re.findall(r"^After=(.*)$", text, re.MULTILINE)).split()
    assert "nss-user-lookup.target" in after
    assert "Wants=nss-user-lookup.target" not in text


def unit_settings(unit: str) -> dict[str, dict[str, str]]:
    """Each section of shipped unit ``unit``: its settings (the last of a
    name that is given more than once)."""
    sections: dict[str, dict[str, str]] = {}
    section: dict[str, str] = {}
    text = (Path(__file__).parent.parent / "etc" / unit).read_text()
    for line in text.splitlines():
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
        elif "=" in line and not line.startswith("#"):
            name, value = line.split("=", 1)
            section[name] = value
    return sections


def seconds(span: str) -> float:
    """A systemd time span of one unit (``5s``, ``2min``) in seconds."""
    match = re.fullmatch(r"(\d+)\s*(s|sec|min|m|)", span)
    assert match, f"not a span of one unit: {span}"
    number, unit = match.groups()
    return int(number) * (60 if unit in ("min", "m") else 1)


@pytest.mark.parametrize("unit", UNITS)
def test_the_units_do_not_restart_a_start_refused_for_its_configuration(unit):
    prevented = unit_settings(unit)["Service"]["RestartPreventExitStatus"]
    assert str(EX_CONFIG) in prevented.split(), unit


@pytest.mark.parametrize("unit", UNITS)
def test_the_units_stop_restarting_what_fails_at_once_within_two_minutes(unit):
    # twistd's own option errors and "Unknown command: sdexec" exit 1,
    # which the units restarted every 5 s for ever: sdexec never sees them
    # (review session 34 N, N4). systemd's start limit (read from [Unit]
    # only) must trip at that pace, and not on one restart.
    settings = unit_settings(unit)
    interval = seconds(settings["Unit"]["StartLimitIntervalSec"])
    burst = int(settings["Unit"]["StartLimitBurst"])
    restart = seconds(settings["Service"]["RestartSec"])
    assert burst >= 3  # a failure that passes is restarted, and then some
    # Starts that fail at once come every RestartSec: more than ``burst`` of
    # them in ``interval`` trips it, with room for each to take as long.
    assert burst * restart * 2 <= interval <= 2 * 60
    assert not {"StartLimitIntervalSec", "StartLimitBurst"} & settings["Service"].keys()


# --- a socket that cannot be made where it is configured ---------------------


@ensureDeferred
async def test_a_listen_under_a_file_is_one_line_naming_the_setting(tmp_path):
    # It said "[Errno 20] Not a directory: '.../afile/sdexec-….lock'", a
    # lock the admin never configured, and exited 1: restarted every 5 s
    # (review session 34 A4).
    (tmp_path / "afile").write_text("")
    listen = f"unix:{tmp_path}/afile/s.sock"
    service = service_on(FakeManager(), listen)
    service.startService()
    with pytest.raises(ListenError) as error:
        await service.ready
    assert str(error.value) == (
        f"--listen: cannot listen on {listen}: Not a directory: {tmp_path}/afile"
    )
    assert _fails_again(Failure(error.value))  # EX_CONFIG: not restarted
    await service.stopService()


def service_given(tmp_path, given: str, listen: str, stats: str) -> SdexecService:
    """A service whose ``listen`` and ``stats`` twistd's options give (the
    file's own elsewhere, not in force), or the file does."""
    if given == "file":
        config = {"sdexec": {"listen": listen, "stats": stats}}
        return SdexecService(
            parse_config(config, f"{tmp_path}/sdexec.toml"),
            reactor,
            connect=lambda: defer.succeed(FakeManager()),
        )
    config = {"sdexec": {"listen": f"unix:{tmp_path}/file.sock", "stats": "tcp:0"}}
    return SdexecService(
        parse_config(config, f"{tmp_path}/sdexec.toml"),
        reactor,
        listen=listen,
        stats=stats,
        connect=lambda: defer.succeed(FakeManager()),
    )


@pytest.mark.parametrize(
    ("given", "listen_named", "stats_named"),
    [
        ("option", "--listen", "--stats"),
        ("file", "[sdexec] listen", "[sdexec] stats"),
    ],
)
@ensureDeferred
async def test_an_endpoint_error_names_the_option_or_the_key_that_gave_it(
    tmp_path, monkeypatch, given, listen_named, stats_named
):
    # With --listen or --stats in the unit's ExecStart=, the error still
    # named "[sdexec] listen": the admin looked in the file for a key that
    # was not there, or was not the value in force.
    monkeypatch.setattr(_SystemdParser, "_sddaemon", ListenFDs([], []))  # none
    (tmp_path / "afile").write_text("")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    under_a_file = f"unix:{tmp_path}/afile/s.sock"
    not_passed = "systemd:domain=UNIX:name=sdexec"
    taken_port = f"tcp:{port}:interface=127.0.0.1"
    try:
        for listen, stats, said in (
            (
                under_a_file,
                "tcp:0:interface=127.0.0.1",
                f"{listen_named}: cannot listen on {under_a_file}: Not a"
                f" directory: {tmp_path}/afile",
            ),
            (
                not_passed,
                "tcp:0:interface=127.0.0.1",
                f"{listen_named}: {not_passed}: no such inherited socket",
            ),
            (
                f"unix:{tmp_path}/s.sock",
                taken_port,
                f"{stats_named}: cannot listen on {taken_port}: Address already in use",
            ),
        ):
            service = service_given(tmp_path, given, listen, stats)
            service.startService()
            with pytest.raises(ListenError) as error:
                await service.ready
            assert str(error.value).startswith(said)
            await service.stopService()
    finally:
        taken.close()


@pytest.mark.parametrize("thing", ["file", "directory"])
@ensureDeferred
async def test_a_listen_on_what_is_not_a_socket_names_it_and_keeps_it(tmp_path, thing):
    # It said "Address already in use (another program, or sdexec, is
    # serving on it)" and exited 1: restarted every 5 s for ever, for a
    # mistyped path or a copy left there (review session 34 N, N2).
    in_the_way = tmp_path / "s.sock"
    if thing == "file":
        in_the_way.write_text("kept")
    else:
        in_the_way.mkdir()
    listen = f"unix:{in_the_way}"
    service = service_on(FakeManager(), listen)
    service.startService()
    with pytest.raises(ListenError) as error:
        await service.ready
    assert str(error.value) == (
        f"--listen: cannot listen on {listen}: not a socket: {in_the_way}"
        " (sdexec removes only a socket nothing serves: fix the path, or move"
        " what is there)"
    )
    assert _fails_again(Failure(error.value))  # EX_CONFIG: not restarted
    assert in_the_way.exists()
    await service.stopService()


@ensureDeferred
async def test_a_socket_another_program_serves_may_be_had_on_a_restart(tmp_path):
    served = socket.socket(socket.AF_UNIX)
    served.bind(str(tmp_path / "s.sock"))
    served.listen()
    service = service_on(FakeManager(), f"unix:{tmp_path}/s.sock")
    try:
        service.startService()
        with pytest.raises(ListenError, match="Address already in use") as error:
            await service.ready
        assert not _fails_again(Failure(error.value))  # exit 1: restarted
        await service.stopService()
    finally:
        served.close()


def _read_only_below(monkeypatch, call: str, directory) -> None:
    """``os.<call>`` on a path under ``directory`` fails as on a file
    system mounted read-only (ProtectSystem=strict)."""
    real = getattr(os, call)

    def refused(path, *args, **kwargs):
        if str(path).startswith(str(directory)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, refused)


async def _stats_socket_refused(tmp_path, stats_socket: str) -> ListenError:
    """Why a service with ``stats_socket`` did not start (it may not
    restart for it: EX_CONFIG)."""
    service = service_on(
        FakeManager(),
        f"unix:{tmp_path}/s.sock",
        {"sdexec": {"stats-socket": stats_socket}},
    )
    service.startService()
    with pytest.raises(ListenError) as error:
        await service.ready
    assert _fails_again(Failure(error.value))
    await service.stopService()
    return error.value


@pytest.mark.parametrize(
    ("call", "below", "refused", "advice"),
    [
        # ProtectSystem=strict: "[Errno 30] Read-only file system: '…'".
        ("unlink", "", "stats.sock", ""),
        # The advice named the parent the directory was to be made in: a
        # ReadWritePaths=/var/lib drop-in, for /var/lib/x/stats.sock.
        ("mkdir", "/x", "x", "/x, once made: it does not exist"),
    ],
)
@ensureDeferred
async def test_a_stats_socket_on_a_read_only_file_system_says_what_to_give(
    tmp_path, monkeypatch, call, below, refused, advice
):
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o700)
    _read_only_below(monkeypatch, call, read_only)
    error = await _stats_socket_refused(tmp_path, f"{read_only}{below}/stats.sock")
    assert str(error) == (
        f"[sdexec] stats-socket: cannot listen on unix:{read_only}{below}/stats.sock:"
        f" Read-only file system: {read_only}/{refused} (under"
        " ProtectSystem=strict, give its directory a ReadWritePaths= drop-in:"
        f" {read_only}{advice})"
    )


@ensureDeferred
async def test_a_full_file_system_under_the_socket_may_pass(tmp_path, monkeypatch):
    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    service = service_on(FakeManager(), f"unix:{tmp_path}/s.sock")
    monkeypatch.setattr(os, "ftruncate", no_space)  # the owner lock's pid
    service.startService()
    with pytest.raises(ListenError) as error:
        await service.ready
    assert str(error.value).startswith("--listen: cannot listen on unix:")
    assert not _fails_again(Failure(error.value))  # exit 1: restarted
    await service.stopService()


@ensureDeferred
async def test_a_port_another_program_holds_may_be_had_on_a_restart(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    service = service_on(
        FakeManager(),
        f"unix:{tmp_path}/s.sock",
        stats=f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1",
    )
    try:
        service.startService()
        with pytest.raises(ListenError) as error:
            await service.ready
        assert not _fails_again(Failure(error.value))  # exit 1: restarted
        await service.stopService()
    finally:
        taken.close()


@ensureDeferred
async def test_sighups_while_one_s_reload_waits_are_that_reload(tmp_path):
    # A storm of SIGHUPs ran a whole reload for each (review session 50):
    # those that come while one waits for its turn are that one; one after
    # it has begun (the file read) reloads again, after it.
    service = await started_service(tmp_path, FakeManager())
    loaded: list[str] = []
    reload_once = service._reload_once

    async def counted(path):
        loaded.append("reload")
        return await reload_once(path)

    service._reload_once = counted
    held = service._reloads.acquire()  # another reload runs
    await held
    for _ in range(50):
        service._sighup()
    service._reloads.release()
    await until(lambda: not service._reloads.locked, "the reload ran")
    assert loaded == ["reload"]
    service._sighup()
    await until(lambda: not service._reloads.locked and len(loaded) == 2, "again")
    assert loaded == ["reload", "reload"]
    await service.stopService()
