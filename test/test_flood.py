"""A client that ignores its stdin credit and sends 1 GiB: the service
(``twistd -n sdexec`` on the real manager) answers ENOSPC once, closes the
process's stdin, drops the rest, and its memory stays where it was
(issue 16: it used to hold the whole GiB, and keep it)."""

from __future__ import annotations

import errno
import json
import socket
import uuid
from pathlib import Path

import pytest
from support import unit_names
from test_twistd import Twistd, reaped

pytestmark = pytest.mark.systemd

MiB = 1024 * 1024
FLOOD = 1024 * MiB
CHUNK = 256 * 1024
#: What "a few MiB" allows: a message being decoded is held two or three
#: times over (the line, the string, the bytes) for an instant.
SLACK = 8 * MiB


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of ``pid``, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


class RawClient:
    """A client that writes what it likes: no credit, no waiting."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(str(path))
        self.sock.settimeout(120)
        self.reader = self.sock.makefile("rb")

    def send(self, topic: str, matchtag: int, payload: dict) -> None:
        request = {"type": "request", "topic": topic, "matchtag": matchtag,
                   "payload": payload}  # fmt: skip
        self.sock.sendall(json.dumps(request).encode() + b"\n")

    def receive(self) -> dict:
        return json.loads(self.reader.readline())

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def test_a_gib_of_stdin_beyond_the_credit_is_refused_in_bounded_memory(
    user_manager, tmp_path
):
    service = Twistd(tmp_path)
    with reaped(service.process):
        client = RawClient(service.socket)
        unit = f"sdexec-flood-{uuid.uuid4().hex[:8]}"
        cmd = {"cmdline": ["/bin/sleep", "600"], "env": {"PATH": "/bin"},
               "opts": {"SDEXEC_NAME": unit}}  # fmt: skip
        client.send("sdexec.exec", 1, {"cmd": cmd, "flags": 8})
        assert client.receive()["payload"] == {
            "type": "add-credit",
            "channels": {"stdin": 4096},
        }
        assert client.receive()["payload"]["type"] == "started"
        before = memory(service.process.pid)
        write = {
            "matchtag": 1,
            "io": {"stream": "stdin", "rank": "0", "data": "x" * CHUNK},
        }
        for matchtag in range(2, 2 + FLOOD // CHUNK):  # sleep reads none of it
            client.send("sdexec.write", matchtag, write)
        list_matchtag = 2 + FLOOD // CHUNK  # the next after the writes
        client.send("sdexec.list", list_matchtag, {"detail": True})  # once all are read
        overrun = client.receive()
        assert (overrun["topic"], overrun["errnum"]) == ("sdexec.write", errno.ENOSPC)
        (proc,) = client.receive()["payload"]["procs"]
        assert proc["unit"] == f"{unit}.service"
        after = memory(service.process.pid)
        assert after["VmRSS"] - before["VmRSS"] < SLACK, (before, after)
        assert after["VmHWM"] - before["VmRSS"] < SLACK, (before, after)
        client.close()  # the unit is stopped and reaped
        service.stop()
    assert not [name for name in unit_names() if name.startswith(unit)]
