"""Bursts against the real manager: hundreds of units stopped at once, when
their client leaves and when the service stops. Every call goes through
the window of ``[systemd] max-inflight`` calls; none may fail for a full
transport, and no unit may be left behind."""

from __future__ import annotations

import socket

import pytest
from pytest_twisted import ensureDeferred
from support import FLAGS, command, run, unit_names, until
from twisted.internet.defer import gatherResults

from sdexec.systemd import SystemdClient

pytestmark = pytest.mark.systemd

#: How long a burst may take to settle before the test gives up. A unit
#: cycle costs ~8 ms on the 2-core test machines; this is a cap, not an
#: expectation.
SETTLE_SECONDS = 120.0


async def start_sleepers(service, count: int):
    """``count`` ``sleep 300`` on one new connection, all started."""
    client = await service.connect()
    started: list[int] = []
    errors: list[object] = []

    def on_response(response: dict) -> None:
        if response["type"] == "started":
            started.append(response["pid"])

    for _ in range(count):
        handle = client.exec(command(["sleep", "300"]), FLAGS, on_response)
        handle.done.addErrback(errors.append)
    await until(
        lambda: len(started) + len(errors) == count, f"{count} started", SETTLE_SECONDS
    )
    assert errors == []
    assert len(service.server.processes) == count
    return client


@pytest.mark.parametrize("count", [500, 1000, 2000])
@ensureDeferred
async def test_client_gone_stops_every_unit_and_the_service_serves_on(
    start_service, count
):
    service = await start_service()
    client = await start_sleepers(service, count)
    await client.close()
    await until(
        lambda: not service.server.processes and not unit_names(),
        f"{count} units stopped and reaped",
        SETTLE_SECONDS,
    )
    assert service.server.drain_reason is None
    result = await run(await service.connect(), ["echo", "still here"])
    assert (result.error, result.stdout) == (None, b"still here\n")


@pytest.mark.parametrize("count", [1000, 2000])
@ensureDeferred
async def test_stopping_the_service_stops_every_unit_first(start_service, count):
    service = await start_service()
    await start_sleepers(service, count)
    await service.stop()
    assert service.server.processes == {}
    assert unit_names() == []


@ensureDeferred
async def test_a_full_send_buffer_is_waited_out_not_a_lost_connection(user_manager):
    """3 MB of calls at once through a 4 KB send buffer (the window opened
    wide, so nothing but the transport holds them back): the writer waits
    for the socket, every call is answered, the connection stays."""
    client = await SystemdClient.connect(user_manager.bus_address)
    client._bus._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client.max_inflight = 1000
    patterns = [f"sdexec-no-such-unit-{n:04}-{'x' * 180}.service" for n in range(50)]
    try:
        answers = await gatherResults(
            [client.list_units_by_patterns([], patterns) for _ in range(300)],
            consumeErrors=True,
        )
        assert answers == [[]] * 300
        assert not client.disconnected.called
    finally:
        client.disconnect()
        await client.disconnected
