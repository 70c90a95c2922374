"""The service's UNIX sockets and its stats endpoints, on real sockets with
sdexec.testing's FakeManager (issue 16): private sockets in the service's
own directories, another user kept out, the stats site without secrets
unless asked, and on a UNIX socket too."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pytest_twisted import ensureDeferred
from support import ended_by_close
from twisted.internet import defer, reactor, threads
from twisted.logger import formatEvent, globalLogPublisher

import sdexec.cli
import sdexec.cliargs  # imported here: the child running as nobody may not read it
from sdexec.client import connect
from sdexec.config import parse_config
from sdexec.service import SdexecService, _made_socket_keeps_out
from sdexec.sockets import kept_out, private_endpoint, unix_endpoint, unix_path
from sdexec.testing import FakeManager

NOBODY = 65534


async def sdexec_as_nobody(socket: str, *argv: str) -> tuple[int, bytes]:
    """``sdexec ARGV`` in a child running as uid 65534 (forked: the
    interpreter's own files may be out of that user's reach); its exit
    status and what it wrote."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no reactor, no pytest; only this, then _exit
        status = 99
        try:
            os.dup2(writer, 1)
            os.dup2(writer, 2)
            # pytest's own capture: not the descriptors
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            os.chdir("/")  # a cwd this user may enter, for run's default --dir
            os.setuid(NOBODY)
            status = sdexec.cli.main(["--socket", socket, *argv])
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)
    os.close(writer)
    _, status = await threads.deferToThread(os.waitpid, pid, 0)
    with os.fdopen(reader, "rb") as said:
        return os.waitstatus_to_exitcode(status), said.read()


async def started(listen: str, manager: FakeManager, **sdexec: object):
    service = SdexecService(
        parse_config({"sdexec": sdexec}),
        reactor,
        listen=listen,
        stats="tcp:0:interface=127.0.0.1",
        connect=lambda: defer.succeed(manager),
    )
    service.startService()
    await service.ready
    return service


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("description", "expected"),
    [
        ("unix:/run/s.sock", "/run/s.sock"),
        ("unix:/run/s.sock:mode=660:lockfile=1", "/run/s.sock"),
        ("unix:address=/run/a\\:b.sock:backlog=5", "/run/a:b.sock"),
        ("tcp:8490", None),
        ("systemd:domain=UNIX:name=sdexec", None),
    ],
)
def test_unix_path(description, expected):
    assert unix_path(description) == expected


def test_an_endpoint_gets_the_configured_mode_unless_it_names_one(tmp_path):
    uid = os.getuid()
    plain = unix_endpoint(f"{tmp_path}/a:b.sock")
    assert private_endpoint(plain, 0o600, uid) == f"{plain}:mode=600"
    explicit = f"unix:{tmp_path}/s.sock:mode=660"
    assert private_endpoint(explicit, 0o600, uid) == explicit
    assert private_endpoint("tcp:0", 0o600, uid) == "tcp:0"


def test_a_missing_directory_is_created_private(tmp_path):
    private_endpoint(f"unix:{tmp_path}/new/s.sock", 0o600, os.getuid())
    assert mode_of(tmp_path / "new") == 0o700
    private_endpoint(f"unix:{tmp_path}/shared/s.sock", 0o666, os.getuid())
    assert mode_of(tmp_path / "shared") == 0o711  # others may reach the socket


def test_a_missing_directory_lets_in_whom_the_endpoint_s_own_mode_does(tmp_path):
    # mode=666 wins over socket-mode for the socket: its directory, made
    # 0700 for socket-mode's 0600, kept out the allow-users it let connect.
    private_endpoint(f"unix:{tmp_path}/own/s.sock:mode=666", 0o600, os.getuid())
    assert mode_of(tmp_path / "own") == 0o711
    private_endpoint(f"unix:{tmp_path}/tight/s.sock:mode=600", 0o666, os.getuid())
    assert mode_of(tmp_path / "tight") == 0o700


def test_a_missing_directory_gets_its_search_bits_whatever_the_umask(tmp_path):
    # The system unit's UMask=0077 masked mkdir's mode: a new socket
    # directory (and those above it) stayed 0700, closed to the group that
    # socket-mode 0660 lets connect.
    previous = os.umask(0o077)
    try:
        private_endpoint(f"unix:{tmp_path}/a/b/s.sock", 0o660, os.getuid())
    finally:
        os.umask(previous)
    assert (mode_of(tmp_path / "a"), mode_of(tmp_path / "a" / "b")) == (0o710, 0o710)


def test_a_directory_of_another_user_or_writable_by_others_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=r"theirs: .* \(uid 0\), not uid 65534"):
        private_endpoint(f"unix:{theirs}/s.sock", 0o600, 0)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o1777)
    with pytest.raises(ValueError, match=r"open: .* writable by group or others"):
        private_endpoint(f"unix:{open_dir}/s.sock", 0o600, 0)


def test_a_directory_below_one_another_user_may_change_is_refused(tmp_path):
    # Only the socket's own directory was judged: below a directory of
    # another user's (or one all may write to), that user could move the
    # service's directory away and put one with a socket of their own in its
    # place, for the clients to send their requests to.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=re.escape(f"{theirs} belongs to uid 65534;")):
        private_endpoint(f"unix:{theirs}/d/s.sock", 0o600, 0)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ValueError, match=r"open is writable by group or others"):
        private_endpoint(f"unix:{open_dir}/d/s.sock", 0o600, 0)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # as /tmp: what is ours in it stays ours
    ours = f"unix:{sticky}/d/s.sock"
    assert private_endpoint(ours, 0o600, 0) == f"{ours}:mode=600"
    link = sticky / "link"  # theirs, to our directory: they may change it
    link.symlink_to(sticky / "d")
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(
        ValueError, match=re.escape(f"but {link} belongs to uid 65534;")
    ):
        private_endpoint(f"unix:{link}/s.sock", 0o600, 0)


@ensureDeferred
async def test_a_listen_socket_is_0600_and_another_user_cannot_connect(shared_dir):
    manager = FakeManager()
    umask = os.umask(0o022)
    service = await started(f"unix:{shared_dir}/s.sock", manager)
    assert os.umask(umask) == 0o022  # restored after the bind
    assert mode_of(shared_dir / "s.sock") == 0o600
    assert await as_nobody(shared_dir / "s.sock") == "connect: EACCES"
    await service.stopService()


@ensureDeferred
async def test_a_listen_socket_is_0600_from_its_bind_not_only_after_chmod(
    shared_dir, monkeypatch
):
    # Twisted binds, then chmods the socket to its mode: bound under the
    # usual umask 022 it was 0755 in between, and another user could
    # connect then (docs/protocol.md, "Connections"). Its mode is read as
    # it is chmodded, which ends that window.
    path = shared_dir / "s.sock"
    modes_before_chmod = []
    real_chmod = os.chmod

    def chmod(target, mode, *args, **kwargs):
        if os.fsdecode(target) == str(path):  # Twisted gives bytes
            modes_before_chmod.append(mode_of(path))
        real_chmod(target, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", chmod)
    umask = os.umask(0o022)
    try:
        service = await started(f"unix:{path}", FakeManager())
    finally:
        os.umask(umask)
    await service.stopService()
    assert modes_before_chmod == [0o600]


@ensureDeferred
async def test_another_user_on_a_shared_socket_is_answered_eperm_then_closed(
    shared_dir,
):
    manager = FakeManager()
    service = await started(
        f"unix:{shared_dir}/s.sock", manager, **{"socket-mode": "0666"}
    )
    assert mode_of(shared_dir / "s.sock") == 0o666
    reply = json.loads(await as_nobody(shared_dir / "s.sock"))
    assert (reply["errnum"], reply["closed"]) == (1, True)
    assert service.server.connections.total == 0
    await service.stopService()


@pytest.mark.parametrize("directory_mode", [0o700, 0o711, 0o750])
@ensureDeferred
async def test_allowed_users_a_directory_keeps_out_are_warned_of(
    shared_dir, directory_mode
):
    # The system unit's /run/sdexec (RuntimeDirectoryMode=0700), or a user
    # manager's /run/user/UID above the default socket: socket-mode "0666"
    # let allow-users' users at the socket, the directory kept them out
    # with EACCES, and nothing said why.
    directory = shared_dir / "run"
    directory.mkdir(mode=directory_mode)
    os.chmod(directory, directory_mode)
    path = directory / "s.sock"
    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        service = await started(
            f"unix:{path}", FakeManager(),
            **{"socket-mode": "0666", "allow-users": [NOBODY]},
        )  # fmt: skip
    finally:
        globalLogPublisher.removeObserver(observer)
    try:
        refused = await as_nobody(path) if directory_mode != 0o711 else None
    finally:
        await service.stopService()
    said = [line for line in lines if "cannot connect" in line]
    # 0750: its group (root's) may search it, not a group of theirs.
    if directory_mode != 0o711:
        assert refused == "connect: EACCES"
        assert said == [
            f"sdexec.allow-users: the users listed cannot connect: {path} is below"
            f" {directory} (mode {directory_mode:04o}, owner uid 0, group 0),"
            " which uid 65534 may not search: give it"
            " search permission (0711; the system unit's RuntimeDirectoryMode=),"
            " or --listen a socket outside it"
        ]
    else:
        assert said == []


def listening_socket(directory: Path, mode: int, gid: int) -> Path:
    """A socket listening in ``directory`` (made 0711), of ``mode`` and
    group ``gid``, owned by root (the test's), held open until exit."""
    directory.mkdir(mode=0o711)
    os.chmod(directory, 0o711)
    path = directory / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.listen()
    os.chmod(path, mode)
    os.chown(path, 0, gid)
    _held.append(sock)
    return path


_held: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_held():
    yield
    while _held:
        _held.pop().close()


def nobody_connects(path: Path) -> str:
    """What connect(2) as uid 65534, with its groups from the user
    database (nogroup, 65534), gets at ``path``: "ok" or the errno's name."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only this, then _exit
        said = "ok"
        try:
            os.setgroups(os.getgrouplist("nobody", NOBODY))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            socket.socket(socket.AF_UNIX).connect(str(path))
        except OSError as error:
            said = errno.errorcode[error.errno]
        finally:
            os.write(writer, said.encode())
            os._exit(0)
    os.close(writer)
    os.waitpid(pid, 0)
    with os.fdopen(reader) as answer:
        return answer.read()


@pytest.mark.parametrize(
    "mode", [0o602, 0o606, 0o620, 0o660, 0o666, 0o600], ids=lambda mode: f"{mode:04o}"
)
@pytest.mark.parametrize("member", [True, False], ids=["member", "other"])
def test_a_socket_keeps_out_whom_the_kernel_keeps_out_and_says_why(
    shared_dir, mode, member
):
    # The kernel reads one class of bits for a user: a member of the
    # socket's group is judged by the group's alone, so 0602 lets others in
    # and keeps its group out. The service said of 0602 that it "lets its
    # group connect, which uid 65534 is not in": false twice.
    path = listening_socket(shared_dir / "run", mode, NOBODY if member else 0)
    kept = kept_out(str(path), [NOBODY])
    connected = nobody_connects(path)
    assert connected in ("ok", "EACCES")
    assert (kept is None) == (connected == "ok")
    if kept is None:
        return
    assert (kept.path, kept.judged_as, kept.needed) == (
        str(path),
        "group" if member else "others",
        "write",
    )
    if member:
        assert kept.reason == (
            f"uid {NOBODY} is in its group {NOBODY}, whose bits give no write"
            " permission (the kernel judges a member of the group by the group's"
            " bits alone, whatever others' give)"
        )
    else:
        assert kept.reason == (
            f"uid {NOBODY} is neither its owner nor in its group, and others' bits"
            " give no write permission"
        )


def test_root_is_kept_out_of_nothing(shared_dir):
    # CAP_DAC_OVERRIDE: root connects to a socket of mode 0000 of another
    # user's, in a directory of 0700 of theirs; it was judged by others' bits.
    path = listening_socket(shared_dir / "run", 0o000, NOBODY)
    os.chown(path, NOBODY, NOBODY)
    os.chown(path.parent, NOBODY, NOBODY)
    os.chmod(path.parent, 0o700)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
    assert kept_out(str(path), [0]) is None
    # Its owner, though, is judged by the owner's bits.
    assert kept_out(str(path), [0, NOBODY]) == (
        str(path),
        NOBODY,
        os.stat(path),
        "owner",
        "write",
    )


@pytest.mark.parametrize(
    ("mode", "gid", "socket_mode", "advice"),
    [
        (0o602, NOBODY, 0o602, 'set socket-mode to "0660" or "0666" (its group'),
        (0o620, 0, 0o620, 'set socket-mode to "0666", or to "0660" with the'),
        # The socket's own mode= (listen's), not socket-mode: the file's
        # check judged socket-mode, and this one said nothing.
        (0o600, 0, 0o666, 'set the mode= of --listen to "0666", or to "0660"'),
    ],
    ids=["0602-member", "0620-other", "listen-mode-0600"],
)
def test_the_service_says_what_keeps_a_user_out_of_its_socket(
    shared_dir, mode, gid, socket_mode, advice
):
    path = listening_socket(shared_dir / "run", mode, gid)
    said = _made_socket_keeps_out(str(path), [NOBODY], "--listen", socket_mode)
    assert nobody_connects(path) == "EACCES"
    kept = kept_out(str(path), [NOBODY])
    assert kept is not None
    assert said is not None and said.startswith(f"{kept}: {kept.reason}: {advice}")


@ensureDeferred
async def test_a_listen_mode_that_keeps_allowed_users_out_is_warned_of(shared_dir):
    # socket-mode "0666" passed the file's check; listen's own mode=600
    # made the socket, nobody got EACCES, and nothing was said.
    path = shared_dir / "s.sock"
    lines: list[str] = []
    observer = lambda event: lines.append(formatEvent(event))  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        service = await started(
            f"unix:{path}:mode=600", FakeManager(),
            **{"socket-mode": "0666", "allow-users": [NOBODY]},
        )  # fmt: skip
    finally:
        globalLogPublisher.removeObserver(observer)
    try:
        refused = await as_nobody(path)
    finally:
        await service.stopService()
    assert refused == "connect: EACCES"
    said = [line for line in lines if "cannot connect" in line]
    assert said == [
        f"sdexec.allow-users: the users listed cannot connect: {path} (mode 0600,"
        f" owner uid 0, group 0): uid {NOBODY} is neither its owner nor in its"
        " group, and others' bits give no write permission: set the mode= of"
        ' --listen to "0666", or to "0660" with the service run under a group'
        " they share"
    ]


def nobody_client(path: Path) -> str:
    """In a child process as uid 65534: connect, send two requests, read to
    EOF; what it got. The service refuses it as it connects, unread: a send
    may find the connection closed, and once the refusal is read the
    connection reads as reset (what was sent was never read)."""
    try:
        # Its groups too: root's group 0 and supplementary groups, kept,
        # would pass a directory's group bits nobody has.
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(path))
    except OSError as error:
        return f"connect: {errno.errorcode[error.errno]}"
    request = {"type": "request", "topic": "sdexec.list", "payload": {}}
    with contextlib.suppress(BrokenPipeError):
        for matchtag in (1, 2):
            message = {**request, "matchtag": matchtag}
            sock.sendall(json.dumps(message).encode() + b"\n")
    sock.settimeout(60)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    lines = received.splitlines()
    return json.dumps({**json.loads(lines[0]), "closed": len(lines) == 1})


async def as_nobody(path: Path) -> str:
    """What a client running as uid 65534 gets from the socket at ``path``
    (forked: the interpreter's own files may be out of that user's reach)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no reactor, no pytest; only this, then _exit
        status = 1
        try:
            os.write(writer, nobody_client(path).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(writer)
    _, status = await threads.deferToThread(os.waitpid, pid, 0)
    with os.fdopen(reader) as answer:
        assert status == 0
        return answer.read()


# -- the stats endpoints ------------------------------------------------------------


async def curl(*args: str) -> dict:
    done = await threads.deferToThread(
        subprocess.run,
        ["curl", "-sf", "--max-time", "60", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("detail", [False, True])
@ensureDeferred
async def test_http_stats_leave_out_command_lines_unless_configured(tmp_path, detail):
    manager = FakeManager()
    manager.stop_to_inactive = True  # the unit goes once the client has gone
    stats_socket = tmp_path / "stats" / "stats.sock"
    service = await started(
        f"unix:{tmp_path}/s.sock",
        manager,
        **{"stats-detail": detail, "stats-socket": str(stats_socket)},
    )
    client = await connect(reactor, f"{tmp_path}/s.sock")
    handle = client.exec(
        {"cmdline": ["/bin/true", "--password=hunter2"], "env": {}, "opts": {},
         "label": "secret-label"},
        flags=0,
        on_response=lambda payload: None,
    )  # fmt: skip
    rpc = await client.stats()
    assert rpc["procs"][0]["cmdline"] == ["/bin/true", "--password=hunter2"]
    port = service.ports["stats"].getHost().port
    over_tcp = await curl(f"http://127.0.0.1:{port}/stats")
    over_unix = await curl("--unix-socket", str(stats_socket), "http://sdexec/stats")
    assert mode_of(stats_socket) == 0o600
    for answer in (over_tcp, over_unix):
        (proc,) = answer["procs"]
        assert ("cmdline" in proc, "label" in proc) == (detail, detail)
        assert ("source" in answer["config"]) == detail
        assert "hunter2" not in json.dumps(answer) or detail
        assert proc["unit"] == rpc["procs"][0]["unit"]
    await ended_by_close(client, handle.done)
    await service.stopService()
    manager.close()
