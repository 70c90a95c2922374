"""The dbus-fast internals the patient writer (sdexec/systemd/bus.py) relies
on: it replaces dbus-fast's private ``_MessageWriter``, so a dbus-fast
release that renames what it uses must fail here, loudly, not bring back
the EAGAIN that closed the bus under a burst of calls."""

from __future__ import annotations

import asyncio
import inspect

from pytest_twisted import ensureDeferred
from twisted.internet.defer import Deferred

from sdexec.systemd.bus import MessageBus, _PatientWriter

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
