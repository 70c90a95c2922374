"""Socket activation: the service serves on a listening socket it inherits
as fd 3 (``LISTEN_FDS``/``LISTEN_PID``), as systemd passes it from a
``.socket`` unit, and tells systemd it is ready."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest
from pytest_twisted import ensureDeferred
from support import unit_names
from test_notify import NotifySocket
from test_twistd import (
    CONFIG,
    REPO,
    TWISTD,
    _environment,
    _wait_for,
    reaped,
    terminate,
)
from twisted.internet import defer, reactor
from twisted.internet.endpoints import _SystemdParser
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.systemd import ListenFDs

from sdexec.activation import check_systemd_endpoint, server_endpoint
from sdexec.config import ConfigError, parse_config
from sdexec.service import SdexecService
from sdexec.testing import FakeManager

pytestmark = pytest.mark.systemd

#: Makes the inherited socket fd 3 and LISTEN_PID the pid that twistd will
#: have (exec keeps the pid), as systemd does.
TRAMPOLINE = """if True:
    import os, sys
    fd = int(sys.argv[1])
    os.dup2(fd, 3)
    os.close(fd)
    os.environ["LISTEN_PID"] = str(os.getpid())
    os.execv(sys.argv[2], sys.argv[2:])
"""


def _twistd_with_inherited(listener: socket.socket, tmp_path, *extra_env):
    config = tmp_path / "sdexec.toml"
    config.write_text(CONFIG.format(socket=tmp_path / "unused.sock", kill_timeout="5s"))
    environment = {**_environment(tmp_path), "LISTEN_FDS": "1",
                   "LISTEN_FDNAMES": "sdexec", **dict(extra_env)}  # fmt: skip
    command = [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config",
               str(config), "--listen", "systemd:domain=UNIX:index=0"]  # fmt: skip
    fd = listener.fileno()
    with (tmp_path / "twistd.log").open("wb") as log:  # the child's
        return subprocess.Popen(
            [sys.executable, "-c", TRAMPOLINE, str(fd), *command],
            pass_fds=(fd,), env=environment, cwd=tmp_path,
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def test_serves_on_an_inherited_socket_and_notifies(user_manager, tmp_path):
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    notify = NotifySocket(tmp_path / "notify")
    service = _twistd_with_inherited(
        listener, tmp_path, ("NOTIFY_SOCKET", str(notify.path))
    )
    listener.close()  # the service holds it now, as systemd would
    log = tmp_path / "twistd.log"
    with reaped(service), contextlib.closing(notify):
        ready = _wait_for(notify.messages, "READY=1")
        assert ready[0]["READY"] == "1", log.read_text()
        ran = subprocess.run(
            [sys.executable, "-m", "sdexec.cli", "--socket", str(path), "run", "-n",
             "echo", "activated"],
            capture_output=True, timeout=60, env=_environment(),
        )  # fmt: skip
        assert (ran.returncode, ran.stdout) == (0, b"activated\n"), ran.stderr
        assert terminate(service) == -signal.SIGTERM
    assert unit_names() == []


def test_no_inherited_socket_is_one_clear_line(user_manager, tmp_path):
    config = tmp_path / "sdexec.toml"
    config.write_text(CONFIG.format(socket=tmp_path / "s.sock", kill_timeout="5s"))
    done = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config", str(config),
         "--listen", "systemd:domain=UNIX:name=sdexec"],
        capture_output=True, timeout=60, env=_environment(), cwd=tmp_path,
    )  # fmt: skip
    # 78: the units do not restart it, as the same start would fail again
    # until the .socket unit passes it (it was 1: restarted every 5 s).
    assert done.returncode == 78
    assert (
        b"--listen: systemd:domain=UNIX:name=sdexec: no such inherited socket"
        in done.stdout
    )
    assert b"Traceback" not in done.stdout + done.stderr


def test_a_start_by_hand_without_the_socket_leaves_the_running_ones_units(
    user_manager, tmp_path
):
    """An admin trying the socket-activated unit's configuration by hand
    while it runs: its owner lock, in its own runtime directory, did not
    keep it out, and it took the running service's units for leftovers of
    its own (adopted, the node drained) before it failed to listen."""
    path = tmp_path / "activated.sock"
    runtime = tmp_path / "run-sdexec"  # the unit's RuntimeDirectory=
    runtime.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    first = _twistd_with_inherited(
        listener, tmp_path, ("RUNTIME_DIRECTORY", str(runtime))
    )
    listener.close()  # the service holds it now, as systemd would
    with reaped(first):
        _wait_for(lambda: b"sdexec listening on" in (tmp_path / "twistd.log")
                  .read_bytes(), "the first service listening")  # fmt: skip
        started = subprocess.run(
            [sys.executable, "-m", "sdexec.cli", "--socket", str(path), "run",
             "--bg", "sleep", "300"],
            capture_output=True, timeout=60, env=_environment(),
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        units = unit_names()
        by_hand = subprocess.run(
            [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config",
             str(tmp_path / "sdexec.toml"), "--listen",
             "systemd:domain=UNIX:index=0"],
            capture_output=True, timeout=60, env=_environment(), cwd=tmp_path,
        )  # fmt: skip
        assert by_hand.returncode == 78, by_hand.stdout
        assert b"no such inherited socket" in by_hand.stdout
        assert b"leftover" not in by_hand.stdout, by_hand.stdout
        assert unit_names() == units
        assert terminate(first) == -signal.SIGTERM
    assert unit_names() == []


def test_a_tcp_socket_passed_for_a_unix_one_is_one_clear_line(user_manager, tmp_path):
    # Twisted adopted it as AF_UNIX: the service started, said it listened,
    # and refused every client (a TCP peer has no uid).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with listener:
        service = _twistd_with_inherited(listener, tmp_path)
        with reaped(service):
            assert service.wait(60) == 78
    said = (tmp_path / "twistd.log").read_bytes()
    assert (
        b"--listen: systemd:domain=UNIX:index=0: the socket passed is"
        b" AF_INET, not AF_UNIX"
        b" (the .socket unit's ListenStream=)"
    ) in said
    assert b"Traceback" not in said


ENDPOINT = "systemd:domain=UNIX:name=sdexec"


def _passed(monkeypatch, descriptor: int) -> None:
    """``descriptor`` inherited as the socket named sdexec."""
    inherited = ListenFDs([descriptor], ["sdexec"])
    monkeypatch.setattr(_SystemdParser, "_sddaemon", inherited)


def _pass_a_socket_at(monkeypatch, path, backlog: int = 128) -> None:
    """A UNIX socket bound at ``path`` and listening, inherited as the
    socket named sdexec (the service's then: it closes it)."""
    passed = socket.socket(socket.AF_UNIX)
    passed.bind(str(path))
    passed.listen(backlog)
    _passed(monkeypatch, passed.detach())


def _on_the_passed_socket(config=None) -> SdexecService:
    """A service listening on the passed socket, not started, with a fake
    manager and a stats site on a port of its own."""
    return SdexecService(
        config or parse_config({}), reactor, listen=ENDPOINT,
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: defer.succeed(FakeManager()),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        (socket.SOCK_SEQPACKET, "the socket passed is SOCK_SEQPACKET, not SOCK_STREAM"),
        (socket.SOCK_DGRAM, "the socket passed is SOCK_DGRAM, not SOCK_STREAM"),
    ],
)
def test_a_unix_socket_of_another_type_is_refused_naming_it(
    monkeypatch, tmp_path, kind, problem
):
    # SOCK_SEQPACKET was adopted, and every stream client refused with
    # EPROTOTYPE; SOCK_DGRAM failed the start with a bare EOPNOTSUPP.
    with socket.socket(socket.AF_UNIX, kind) as passed:
        passed.bind(str(tmp_path / "s.sock"))
        _passed(monkeypatch, passed.fileno())
        with pytest.raises(ValueError) as error:
            server_endpoint(reactor, ENDPOINT)
    assert str(error.value) == (
        f"{ENDPOINT}: {problem} (the .socket unit's ListenStream=)"
    )


def test_a_connection_passed_by_accept_yes_is_refused_naming_it(monkeypatch, tmp_path):
    # A .socket unit of Accept=yes passes each connection, not its listening
    # socket: Twisted made that socket's path 0666 and failed with EINVAL.
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        os.chmod(path, 0o600)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            connection, _ = listener.accept()
            with connection:
                _passed(monkeypatch, connection.fileno())
                with pytest.raises(ValueError) as error:
                    server_endpoint(reactor, ENDPOINT)
    assert str(error.value) == (
        f"{ENDPOINT}: the socket passed is not listening: a connection, as a"
        " .socket unit of Accept=yes passes (give Accept=no)"
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_descriptor_that_is_no_socket_is_refused_and_left_as_it_was(monkeypatch):
    # It failed the start with a bare ENOTSOCK, and a copy of it stayed open.
    read, write = os.pipe()
    _passed(monkeypatch, read)
    try:
        before = os.listdir("/proc/self/fd")
        with pytest.raises(ValueError) as error:
            server_endpoint(reactor, ENDPOINT)
        assert os.listdir("/proc/self/fd") == before
    finally:
        os.close(read)
        os.close(write)
    assert str(error.value) == (
        f"{ENDPOINT}: the descriptor passed is not a socket"
        " (the .socket unit's ListenStream= makes one)"
    )


def test_a_descriptor_not_open_is_refused_in_the_system_s_words(monkeypatch):
    # It read "the descriptor passed: [Errno 9] Bad file descriptor".
    closed = os.dup(0)
    os.close(closed)
    _passed(monkeypatch, closed)
    with pytest.raises(ValueError) as error:
        server_endpoint(reactor, ENDPOINT)
    assert str(error.value) == f"{ENDPOINT}: the descriptor passed: Bad file descriptor"


def test_a_socket_of_another_name_is_refused_naming_those_inherited(monkeypatch):
    # A .socket unit of another name without FileDescriptorName= passes its
    # own unit name: the refusal said only "no such inherited socket".
    with socket.socket(socket.AF_UNIX) as passed:
        inherited = ListenFDs([passed.fileno()], ["sdexec-site.socket"])
        monkeypatch.setattr(_SystemdParser, "_sddaemon", inherited)
        with pytest.raises(ValueError) as error:
            server_endpoint(reactor, ENDPOINT)
    assert str(error.value).startswith(
        f"{ENDPOINT}: no such inherited socket (1 inherited, named"
        " 'sdexec-site.socket'). "
    )


def test_a_systemd_listen_endpoint_is_checked_without_the_socket():
    config = parse_config({"sdexec": {"listen": "systemd:domain=UNIX:name=sdexec"}})
    assert config.sdexec.listen == "systemd:domain=UNIX:name=sdexec"
    with pytest.raises(ConfigError, match=r"sdexec\.listen.*exactly one of index="):
        parse_config({"sdexec": {"listen": "systemd:domain=UNIX"}})


@pytest.mark.parametrize(
    ("description", "problem"),
    [
        ("systemd:domain=UNIX:index=x", "index='x' is not a number"),
        ("systemd:domain=PIGEON:index=0", "domain= must be an address family"),
        ("systemd:domain=UNIX:index=0:mode=600", "unknown argument 'mode'"),
        ("systemd:UNIX", "'UNIX' is not KEY=VALUE"),
    ],
)
def test_bad_systemd_endpoints(description, problem):
    with pytest.raises(ValueError, match=problem):
        check_systemd_endpoint(description)


def test_the_example_socket_unit_matches_the_endpoint_it_documents():
    text = (REPO / "etc" / "sdexec.socket").read_text()
    assert "FileDescriptorName=sdexec" in text
    assert 'listen = "systemd:domain=UNIX:name=sdexec"' in text


_SOCKET_UNIT_ADVICE = (
    ", made by the .socket unit, whose SocketMode= and DirectoryMode="
    " decide who may connect, not socket-mode (give SocketMode=0660"
    " with a SocketGroup= they share, or 0666, and DirectoryMode=0711)"
)


@pytest.mark.parametrize(
    ("modes", "warned"),
    [
        (
            (0o600, 0o700, 0o711),
            "is mode 0600 in a directory of mode 0700",
        ),  # the example's
        ((0o666, 0o700, 0o711), "is mode 0666 in a directory of mode 0700"),
        ((0o666, 0o711, 0o711), None),
        # SocketGroup= a group they are in (and the directory's): its bits.
        ((0o660, 0o710, 0o711, -1, 65534), None),
        # A group they are not in: others' bits count, not the group's.
        ((0o660, 0o710, 0o711), "is mode 0660 in a directory of mode 0710"),
        # A user manager's %t, /run/user/UID: 0700 above DirectoryMode=0711.
        ((0o666, 0o711, 0o700), "is below {parent} (mode 0700"),
        # One its group may search, not a group of theirs.
        ((0o666, 0o711, 0o750), "is below {parent} (mode 0750"),
        # SocketUser= the user listed: its owner's bits are what count.
        ((0o600, 0o755, 0o711, 65534), None),
        ((0o066, 0o755, 0o711, 65534), "is mode 0066 in a directory of mode 0755"),
    ],
)
@ensureDeferred
async def test_allowed_users_an_inherited_socket_keeps_out_are_warned_of(
    monkeypatch, shared_dir, modes, warned
):
    # socket-mode "0666" and allow-users, as configuration.md says, under
    # sdexec.socket: its SocketMode=0600 stays, each listed user got EACCES
    # and nothing said why (the file's check saw only socket-mode). The
    # socket's advice followed under a user manager (SocketMode=0666,
    # DirectoryMode=0711) left them out all the same, its %t being 0700,
    # and nothing said so either.
    socket_mode, directory_mode, parent_mode, owner, group = (*modes, -1, -1)[:5]
    parent = shared_dir / "user"
    directory = parent / "sdexec"
    directory.mkdir(parents=True)
    path = directory / "sdexec.sock"
    _pass_a_socket_at(monkeypatch, path)
    os.chmod(path, socket_mode)
    os.chown(path, owner, group)  # as SocketUser= and SocketGroup= make it
    os.chown(directory, -1, group)
    os.chmod(directory, directory_mode)
    os.chmod(parent, parent_mode)
    config = parse_config(
        {"sdexec": {"allow-users": [65534], "socket-mode": "0666"}}, "f.toml"
    )
    assert config.warnings == ()
    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    service = _on_the_passed_socket(config)
    try:
        service.startService()
        await service.ready
    finally:
        globalLogPublisher.removeObserver(observer)
        await service.stopService()
    said = [line for line in lines if "cannot connect" in line]
    prefix = f"sdexec.allow-users: the users listed cannot connect: {path} "
    if warned is None:
        assert said == []
    elif "below" in warned:
        assert said == [
            prefix + warned.format(parent=parent) + ", owner uid 0, group 0),"
            " which uid 65534 may not search: give the .socket unit a"
            " ListenStream= outside it (a user manager's %t, its XDG_RUNTIME_DIR,"
            " is such a directory)"
        ]
    else:
        assert said == [prefix + warned + _SOCKET_UNIT_ADVICE]


def test_socket_mode_is_not_judged_for_a_socket_systemd_makes():
    # Its advice (give socket-mode "0660") would change nothing there.
    config = parse_config(
        {"sdexec": {"allow-users": [65534], "listen": ENDPOINT}}, "f.toml"
    )
    assert config.warnings == ()


@ensureDeferred
async def test_an_inherited_socket_keeps_a_backlog_beyond_twisteds_50(
    monkeypatch, tmp_path
):
    # Twisted's adoption called listen(2) again on the socket systemd passed,
    # with its own default, 50, which cut the .socket unit's backlog to 50:
    # a burst of 60 connects before the service accepted got EAGAIN after
    # the 51st.
    path = tmp_path / "sdexec.sock"
    _pass_a_socket_at(monkeypatch, path, backlog=4096)
    service = _on_the_passed_socket()
    service.startService()
    await service.ready
    clients: list[socket.socket] = []
    try:
        for _ in range(60):  # the reactor does not accept meanwhile
            client = socket.socket(socket.AF_UNIX)
            clients.append(client)
            client.setblocking(False)
            client.connect(str(path))
    finally:
        for client in clients:
            client.close()
        await service.stopService()
    assert len(clients) == 60


def _instance(tmp_path, name: str):
    """An instance of a socket-activated unit (``sdexec@NAME``): its own
    socket, passed as fd 3, and its own ``RuntimeDirectory=``; its twistd
    and its socket's path."""
    directory = tmp_path / name
    runtime = directory / "run"
    runtime.mkdir(parents=True, mode=0o700)
    path = directory / "activated.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(16)
        service = _twistd_with_inherited(
            listener, directory, ("RUNTIME_DIRECTORY", str(runtime))
        )
    log = directory / "twistd.log"
    _wait_for(lambda: b"sdexec listening on" in log.read_bytes(),
              f"instance {name} listening", log=log)  # fmt: skip
    return service, path


def test_two_socket_activated_instances_leave_each_others_units_alone(
    user_manager, tmp_path
):
    """Two instances of a socket-activated unit on one manager, the same
    endpoint in both (``systemd:domain=UNIX:index=0``), each with its own
    socket and runtime directory: both marked their units with the hash of
    that endpoint, so the start of one took the other's running jobs for
    leftovers of its own and stopped them."""
    first, first_path = _instance(tmp_path, "a")
    with reaped(first):
        started = subprocess.run(
            [sys.executable, "-m", "sdexec.cli", "--socket", str(first_path),
             "run", "--bg", "sleep", "300"],
            capture_output=True, timeout=60, env=_environment(),
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        units = unit_names()
        second, _ = _instance(tmp_path, "b")
        with reaped(second):
            assert unit_names() == units
            assert terminate(second) == -signal.SIGTERM
        said = (tmp_path / "b" / "twistd.log").read_bytes()
        assert b"leftover unit" not in said, said  # another's: named, untouched
        assert b"1 unit of the manager carries the mark of another sdexec" in said
        assert unit_names() == units
        assert terminate(first) == -signal.SIGTERM
    assert unit_names() == []


@ensureDeferred
async def test_an_inherited_socket_keeps_its_mode_while_it_is_adopted(
    monkeypatch, tmp_path
):
    # Twisted's adoption chmodded the path to 0666 as it began to listen,
    # and the service put the unit's SocketMode= back only then: meanwhile
    # anyone who could reach the path could connect (refused by the peer's
    # uid on listen, but a systemd: stats endpoint checks none). Each mode
    # the path is given is recorded, and what it had before.
    path = tmp_path / "sdexec.sock"
    _pass_a_socket_at(monkeypatch, path)
    os.chmod(path, 0o600)
    modes: list[int] = []
    real_chmod = os.chmod

    def chmod(target, mode, *args, **kwargs):
        if os.fsdecode(target) == str(path):  # Twisted gives bytes
            modes.append(mode)
        real_chmod(target, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", chmod)
    service = _on_the_passed_socket()
    service.startService()
    try:
        await service.ready
    finally:
        await service.stopService()
    assert set(modes) <= {0o600}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
