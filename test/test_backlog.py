"""The listen backlog: the kernel's ``somaxconn`` unless ``[sdexec]
listen-backlog`` says otherwise; a burst of connects is queued, not
refused (Twisted's default of 50 refused the 51st with EAGAIN)."""

from __future__ import annotations

import errno
import json
import socket

import pytest
from pytest_twisted import ensureDeferred
from twisted.internet.threads import deferToThread

from sdexec.activation import kernel_somaxconn, with_backlog

pytestmark = pytest.mark.systemd

LIST = json.dumps({"type": "request", "topic": "sdexec.list", "matchtag": 1}) + "\n"


@pytest.mark.parametrize(
    ("description", "expected"),
    [
        ("unix:/run/sdexec.sock:mode=600", "unix:/run/sdexec.sock:mode=600:backlog=9"),
        (r"unix:/a\:backlog=b", r"unix:/a\:backlog=b:backlog=9"),
        ("tcp:8490:backlog=5", "tcp:8490:backlog=5"),
        ("systemd:domain=UNIX:name=sdexec", "systemd:domain=UNIX:name=sdexec"),
    ],
)
def test_the_backlog_is_added_unless_the_endpoint_has_its_own(description, expected):
    assert with_backlog(description, 9) == expected


def test_somaxconn_is_read_from_the_kernel_or_pythons(tmp_path):
    sysctl = tmp_path / "somaxconn"
    sysctl.write_text("4096\n")
    assert kernel_somaxconn(str(sysctl)) == 4096
    assert kernel_somaxconn(str(tmp_path / "missing")) == socket.SOMAXCONN


def connect_all(path: str, count: int) -> list[socket.socket | int]:
    """``count`` non-blocking connects at once, before the service can
    accept any: a socket each, or the errno of the connect."""
    made: list[socket.socket | int] = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        failed = sock.connect_ex(path)
        if failed:
            sock.close()
        made.append(failed or sock)
    return made


def ask_each(sockets: list[socket.socket]) -> list[dict]:
    """One ``sdexec.list`` on every connection, answered (in a thread: the
    service answers on the reactor)."""
    answers = []
    for sock in sockets:
        sock.setblocking(True)
        sock.settimeout(60)
        sock.sendall(LIST.encode())
        with sock.makefile("rb") as lines:
            answers.append(json.loads(lines.readline()))
    return answers


@ensureDeferred
async def test_200_simultaneous_connects_are_all_served(sdexec):
    made = connect_all(sdexec.socket_path, 200)
    sockets = [sock for sock in made if isinstance(sock, socket.socket)]
    try:
        refused = [errno.errorcode[e] for e in made if isinstance(e, int)]
        assert refused == []
        answers = await deferToThread(ask_each, sockets)
        assert [answer["payload"]["procs"] for answer in answers] == [[]] * 200
    finally:
        for sock in sockets:
            sock.close()


@ensureDeferred
async def test_a_configured_backlog_is_the_one_listened_with(start_service):
    service = await start_service(sdexec="listen-backlog = 5")
    made = connect_all(service.socket_path, 50)
    try:
        refused = [e for e in made if isinstance(e, int)]
        assert refused and set(refused) == {errno.EAGAIN}
    finally:
        for sock in made:
            if isinstance(sock, socket.socket):
                sock.close()
