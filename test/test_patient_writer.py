"""The dbus-fast internals the patient writer (sdexec/systemd/bus.py) relies
on: it replaces dbus-fast's private ``_MessageWriter``, so a dbus-fast
release that renames what it uses must fail here, loudly, not bring back
the EAGAIN that closed the bus under a burst of calls."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import inspect

from dbus_fast import Message
from pytest_twisted import ensureDeferred
from support import private_bus
from twisted.internet.defer import Deferred

from sdexec.systemd.bus import MessageBus, _open_bus, _PatientWriter

WRITER_STATE = (
    "messages", "buf", "offset", "unix_fds", "fut", "negotiate_unix_fd",
    "sock", "fd", "loop", "bus",
)  # fmt: skip
BUS_INTERNALS = ("_writer", "_user_disconnect", "_finalize")


@ensureDeferred
async def test_the_writer_and_the_bus_still_have_what_it_uses():
    async def inspect_them() -> tuple[list[str], list[str], inspect.Signature]:
        bus = MessageBus(bus_address="unix:path=/nonexistent")  # not connected
        writer = _PatientWriter(bus)
        missing_state = [name for name in WRITER_STATE if not hasattr(writer, name)]
        missing_bus = [name for name in BUS_INTERNALS if not hasattr(bus, name)]
        replaced = inspect.signature(_PatientWriter.__mro__[1].write_callback)
        return missing_state, missing_bus, replaced

    # An asyncio task, as the bus client runs it: dbus-fast wants its loop.
    inspected = asyncio.ensure_future(inspect_them())
    missing_state, missing_bus, replaced = await Deferred.fromFuture(inspected)
    assert (missing_state, missing_bus) == ([], [])
    assert list(replaced.parameters) == ["self", "remove_writer"]


@ensureDeferred
async def test_a_write_the_bus_refuses_fails_its_call_and_logs_nothing(tmp_path):
    # A dbus-daemon killed before the reader saw its end: the send gets
    # EPIPE. The call raised EBADF (the closed socket watched again), and
    # asyncio logged two futures whose EPIPE nobody retrieved, with their
    # tracebacks, in the service's log (review session 34 Q).
    async with private_bus(tmp_path) as address:
        failed, unretrieved = await Deferred.fromFuture(
            asyncio.ensure_future(_call_over_a_broken_pipe(address))
        )
    assert isinstance(failed, BrokenPipeError)
    assert unretrieved == []


async def _call_over_a_broken_pipe(address: str) -> tuple[BaseException, list]:
    """A call whose send fails with EPIPE: what it raised, and what asyncio
    reported as never retrieved meanwhile."""
    loop = asyncio.get_running_loop()
    unretrieved: list = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        bus = await _open_bus(address, False)
        disconnected = asyncio.ensure_future(bus.wait_for_disconnect())

        def broken(_sock: object, _data: object) -> int:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        bus._writer._send = broken
        get_id = Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            member="GetId",
        )
        try:
            await bus.call(get_id)
        except Exception as error:
            failed: BaseException = error
        with contextlib.suppress(BrokenPipeError):
            await disconnected
        gc.collect()  # an unretrieved exception is reported as it is freed
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    return failed, unretrieved
