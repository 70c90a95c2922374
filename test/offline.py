"""Helpers for the offline tests of the server and its processes (systemd is
a :class:`~sdexec.testing.FakeManager`): an in-memory client connection, a
responder that records, and reading a pipe to EOF through the reactor. The
``systemd``, ``server`` and ``connection`` fixtures in conftest.py build on
them; a test module that needs other ones defines its own."""

from __future__ import annotations

import json
import os
import socket

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport

from sdexec.connection import SdexecServerFactory
from sdexec.server import SdexecServer


class PeerTransport(StringTransport):
    """An in-memory transport whose handle is a real UNIX socket, so the
    server's SO_PEERCRED check reads this process's uid."""

    def __init__(self) -> None:
        super().__init__()
        self.handle, self.peer = socket.socketpair()

    def getHandle(self) -> socket.socket:
        return self.handle

    def close(self) -> None:
        self.handle.close()
        self.peer.close()


class BufferingTransport(PeerTransport):
    """A :class:`PeerTransport` whose buffer fills as a socket transport's
    does: once more than ``bufferSize`` bytes wait unread, its streaming
    producer (the connection) is paused; :meth:`read` takes everything and
    resumes it, as Twisted does once its buffer is empty."""

    bufferSize = 64 * 1024

    def __init__(self) -> None:
        super().__init__()
        #: Bytes written that the client has not read.
        self.unread = 0
        self._producer_paused = False

    def write(self, data: bytes) -> None:
        super().write(data)
        self.unread += len(data)
        if (
            self.unread > self.bufferSize
            and self.streaming
            and not self._producer_paused
        ):
            self._producer_paused = True
            self.producer.pauseProducing()

    def read(self) -> None:
        """The client reads all that waits."""
        self.unread = 0
        if self._producer_paused:
            self._producer_paused = False
            self.producer.resumeProducing()


class Connection:
    """One client connection to ``server``, in memory (on ``transport``,
    else a :class:`PeerTransport`, which never fills)."""

    def __init__(
        self, server: SdexecServer, transport: PeerTransport | None = None
    ) -> None:
        self.transport = transport or PeerTransport()
        self.protocol = SdexecServerFactory(server).buildProtocol(None)
        self.protocol.makeConnection(self.transport)

    def send(self, topic: str, payload: dict, matchtag: int = 1) -> None:
        self.raw(
            {
                "type": "request",
                "topic": topic,
                "matchtag": matchtag,
                "payload": payload,
            }
        )

    def raw(self, message: object) -> None:
        self.protocol.dataReceived(json.dumps(message).encode() + b"\n")

    def responses(self) -> list[dict]:
        lines = self.transport.value().splitlines()
        return [json.loads(line) for line in lines if line]

    def last(self) -> dict:
        return self.responses()[-1]

    def close(self) -> None:
        self.protocol.connectionLost(None)
        self.transport.close()


def error_of(response: dict) -> tuple[int, str]:
    return response["errnum"], response["errstr"]


async def read_to_eof(fd: int) -> bytes:
    """What the reactor writes to ``fd`` until EOF (up to a minute: a bound
    for a loaded 2-core CI machine, not a speed)."""
    os.set_blocking(fd, False)
    data = b""
    for _ in range(6000):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            await deferLater(reactor, 0.01)
            continue
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"no EOF after {data!r}")


class Recorder:
    """A responder (sdexec.process.Responder) that keeps what it is given."""

    def __init__(self) -> None:
        self.responses: list = []

    def respond(self, payload):
        self.responses.append(payload)

    def error(self, errnum, errstr):
        self.responses.append((errnum, errstr))

    def types(self) -> list:
        return [r["type"] if isinstance(r, dict) else r[0] for r in self.responses]


#: The stats' ``drain`` object of a service that is not drained.
NOT_DRAINED = {"drained": False, "reason": None, "causes": []}


def drained_by(reason: str, cause: str) -> dict:
    """The stats' ``drain`` object of a service drained for one ``cause``
    (sdexec.drain.CAUSES), which only an admin's undrain clears."""
    held = {"reason": reason, "kind": "admin", "lifts-itself": False, "cause": cause}
    return {"drained": True, "reason": reason, "causes": [held]}


def sigkill_for_stop_timer(server: SdexecServer) -> None:
    """Make SIGKILL the site's stop-timer signal (a request may only repeat
    it), the rest of ``server``'s configuration kept."""
    import dataclasses
    import signal

    from sdexec.containment import Containment

    config = server.config
    exec_config = dataclasses.replace(
        config.exec, sdexec_stop_timer_signal=signal.SIGKILL
    )
    config = dataclasses.replace(config, exec=exec_config)
    server.reconfigure(config, Containment(config, None))
