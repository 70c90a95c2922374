"""The client's "manager absent" check offline (sdexec.systemd.bus): on a bus
that stays up without the manager, the client drops the bus after
``MANAGER_ABSENT_S`` so that its backoff reconnects to the bus address,
where a new manager may listen with a new bus (test_manager_killed.py runs
that against real managers). A fake bus and a Clock drive it here."""

from __future__ import annotations

import asyncio

from dbus_fast import Message, MessageType
from pytest_twisted import ensureDeferred
from support import until
from twisted.internet.task import Clock

from sdexec.systemd.bus import MANAGER_ABSENT_S, SystemdClient

DBUS = "org.freedesktop.DBus"
SYSTEMD = "org.freedesktop.systemd1"


class FakeBus:
    """What SystemdClient uses of a connected dbus-fast MessageBus; every
    method call (the Subscribe to a returned manager, the Get of its
    cgroup) succeeds."""

    def __init__(self) -> None:
        self.handlers: list = []
        self.calls: list[str] = []
        self._closed = asyncio.get_running_loop().create_future()

    @property
    def _disconnected(self) -> bool:  # read by SystemdClient._call
        return self.disconnected

    async def call(self, message: Message) -> Message:
        self.calls.append(message.member)
        return Message(message_type=MessageType.METHOD_RETURN, reply_serial=1)

    @property
    def disconnected(self) -> bool:
        return self._closed.done()

    def add_message_handler(self, handler) -> None:
        self.handlers.append(handler)

    async def wait_for_disconnect(self) -> None:
        await self._closed

    def disconnect(self) -> None:
        if not self._closed.done():
            self._closed.set_result(None)

    def owner_changed(self, old: str, new: str) -> None:
        signal = Message(
            message_type=MessageType.SIGNAL, sender=DBUS, path="/org/freedesktop/DBus",
            interface=DBUS, member="NameOwnerChanged", signature="sss",
            body=[SYSTEMD, old, new],
        )  # fmt: skip
        for handler in self.handlers:
            handler(signal)


def connected_client(bus: FakeBus, clock: Clock) -> SystemdClient:
    async def never_reopened():
        raise AssertionError("not reconnected in this test")

    client = SystemdClient(bus, never_reopened, clock)  # type: ignore[arg-type]
    client.connected = True  # as SystemdClient.connect leaves it
    return client


@ensureDeferred
async def test_a_manager_gone_from_a_live_bus_drops_the_bus_after_the_delay():
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    lost: list[str] = []
    client.on_lost = lost.append
    bus.owner_changed(":1.5", "")
    assert (client.connected, lost) == (False, ["the systemd manager left the bus"])
    clock.advance(MANAGER_ABSENT_S - 0.1)
    assert not bus.disconnected
    clock.advance(0.1)
    assert bus.disconnected  # the backoff now reconnects to the address
    client.disconnect()
    assert clock.getDelayedCalls() == []


@ensureDeferred
async def test_the_check_ends_with_the_client():
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    bus.owner_changed(":1.5", "")
    assert len(clock.getDelayedCalls()) == 1
    client.disconnect()
    assert clock.getDelayedCalls() == []
    assert bus.disconnected


@ensureDeferred
async def test_a_manager_back_in_time_keeps_the_bus():
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    restored: list[bool] = []
    client.on_restored = lambda: restored.append(True)
    bus.owner_changed(":1.5", "")
    clock.advance(MANAGER_ABSENT_S / 2)
    bus.owner_changed("", ":1.9")
    await until(lambda: restored, "the Subscribe's reply")
    # Subscribed again, and its cgroup read (where a lost unit's is).
    assert bus.calls == ["Subscribe", "Get"]
    assert (restored, client.connected) == ([True], True)
    assert clock.getDelayedCalls() == []
    clock.advance(MANAGER_ABSENT_S)
    assert not bus.disconnected
    client.disconnect()
