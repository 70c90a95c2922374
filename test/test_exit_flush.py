"""What a client that reads slowly, or not at all, receives when the service
stops (sdexec/closing.py): a real service, a real unit, a real socket."""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from pytest_twisted import ensureDeferred
from support import command, until
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread

from sdexec.closing import EXIT_FLUSH_SECONDS

pytestmark = pytest.mark.systemd

STOPPING = "the service is stopping: the process's unit is being stopped"


@contextmanager
def unread_writer(path: str) -> Iterator[socket.socket]:
    """A raw connection that has ``yes`` run, streaming its output, and
    reads none of it (yet)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        request = {
            "type": "request",
            "topic": "sdexec.exec",
            "matchtag": 1,
            "payload": {"flags": 1, "cmd": command(["yes", "hello"])},
        }
        sock.sendall(json.dumps(request).encode() + b"\n")
        yield sock


def read_to_eof(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(1 << 20):
        received += chunk
    return received


async def stop_with_buffers_full(service):
    """Stop the service once its connection's buffers are full (its
    client does not read), and wait until the stop has stopped the unit
    and closes the connection: the stop, not fired."""
    connections = service.server.open_connections
    await until(
        lambda: [c.transport.producerPaused for c in connections] == [True],
        "the connection's buffers filled",
        60,
    )
    stopping = service.service.stopService()
    await until(lambda: connections.closing, "the stop closing its connection", 60)
    assert not stopping.called  # what it holds is not read yet
    return stopping


@ensureDeferred
async def test_a_slow_reader_gets_every_answer_then_eof(start_service):
    clock = Clock()  # never advanced: the client reads within the bound
    service = await start_service(clock=clock)
    with unread_writer(service.socket_path) as sock:
        stopping = await stop_with_buffers_full(service)
        received = await deferToThread(read_to_eof, sock)
    await stopping
    started, *output, last = [json.loads(line) for line in received.splitlines()]
    assert received.endswith(b"\n")  # no frame cut short
    assert started["payload"]["type"] == "started"
    assert output
    assert {m["payload"]["type"] for m in output} == {"output"}
    assert (last["matchtag"], last["errnum"], last["errstr"]) == (
        1,
        errno.ECANCELED,
        STOPPING,
    )


@ensureDeferred
async def test_a_client_that_never_reads_holds_the_stop_no_longer_than_the_bound(
    start_service,
):
    clock = Clock()
    service = await start_service(clock=clock)
    with unread_writer(service.socket_path):
        stopping = await stop_with_buffers_full(service)
        clock.advance(EXIT_FLUSH_SECONDS)
        await stopping
        assert not service.server.open_connections.closing


@ensureDeferred
async def test_an_idle_connection_closes_at_once(start_service):
    service = await start_service(clock=Clock())  # never advanced
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(service.socket_path)
        await until(lambda: len(service.server.open_connections) == 1, "connected")
        await service.service.stopService()
        assert await deferToThread(read_to_eof, sock) == b""
