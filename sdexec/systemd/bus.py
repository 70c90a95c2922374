"""The systemd client: the Manager and Unit D-Bus API as Deferreds.

This is the one module that sees asyncio and dbus-fast (a test checks).
dbus-fast is asyncio-based; Twisted runs on its asyncio reactor, so every
call here is started as an asyncio task and handed back as a
:class:`~twisted.internet.defer.Deferred` (``Deferred.fromFuture``).
``docs/design.md`` says why dbus-fast and not txdbus.

Unit property changes are followed with *one* match rule, added at connect
time, for ``PropertiesChanged`` on every object below
``/org/freedesktop/systemd1/unit``; signals are dispatched locally to the
:class:`UnitWatch` registered for their path. A watch is registered before
its unit is started, so no change is missed.
"""

from __future__ import annotations

import asyncio
import os
import string
import time
from collections.abc import Callable, Coroutine
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from sdexec.property import FD_PROPERTIES, UnitProperty
from sdexec.systemd.errors import SystemdError
from sdexec.systemd.watch import UnitWatch, WatchRegistry

__all__ = [
    "SystemdClient",
    "UnitWatch",
    "session_bus_address",
    "to_variants",
    "unit_object_path",
]

log = Logger()

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT_PATH_PREFIX = "/org/freedesktop/systemd1/unit/"

_PROPERTIES_CHANGED_RULE = (
    "type='signal',sender='org.freedesktop.systemd1',"
    "interface='org.freedesktop.DBus.Properties',member='PropertiesChanged',"
    "path_namespace='/org/freedesktop/systemd1/unit'"
)
_PATH_SAFE = frozenset(string.ascii_letters + string.digits)


def unit_object_path(unit_name: str) -> str:
    """The D-Bus object path of a unit, escaped as systemd's
    ``bus_path_escape`` does: every byte that is not an ASCII letter or digit
    (and a leading digit) becomes ``_`` and two lowercase hex digits."""
    escaped = []
    for position, byte in enumerate(unit_name.encode()):
        char = chr(byte)
        if char in _PATH_SAFE and not (position == 0 and char.isdigit()):
            escaped.append(char)
        else:
            escaped.append(f"_{byte:02x}")
    return UNIT_PATH_PREFIX + ("".join(escaped) or "_")


def to_variants(properties: list[UnitProperty]) -> list[tuple[str, Variant]]:
    """Typed properties as the ``a(sv)`` dbus-fast sends."""
    return [(prop.name, Variant(prop.signature, prop.value)) for prop in properties]


def _unwrap(properties: dict[str, Variant]) -> dict[str, Any]:
    return {name: variant.value for name, variant in properties.items()}


def session_bus_address() -> str | None:
    """``DBUS_SESSION_BUS_ADDRESS``, else the user bus under
    ``XDG_RUNTIME_DIR``, else ``None``."""
    address = os.environ.get("DBUS_SESSION_BUS_ADDRESS")
    if address:
        return address
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return f"unix:path={runtime_dir}/bus"
    return None


class SystemdClient:
    """A connection to a systemd manager (user or system) over D-Bus.

    Build one with :meth:`connect`. Every method returns a Deferred; failures
    are :class:`SystemdError`.
    """

    def __init__(self, bus: MessageBus) -> None:
        self._bus = bus
        self._watches = WatchRegistry()
        #: Log every method call and its outcome (``[systemd] sdbus-debug``).
        self.debug = False
        #: Metrics hook: ``on_call(member, seconds, ok)`` after every method
        #: call (sdexec/metrics.py).
        self.on_call: Callable[[str, float, bool], None] | None = None
        self.disconnected: Deferred[None] = Deferred()
        bus.add_message_handler(self._on_message)
        self._defer(bus.wait_for_disconnect()).addBoth(self._on_disconnect)

    @classmethod
    def connect(
        cls, address: str | None = None, *, system: bool = False
    ) -> Deferred[SystemdClient]:
        """Connect to ``address``, or to the user bus (see
        :func:`session_bus_address`), or with ``system=True`` the system bus;
        negotiate fd passing, ``Subscribe`` to the manager's signals and add
        the match rule for unit property changes."""
        return Deferred.fromFuture(
            asyncio.ensure_future(cls._connect(address, system))
        ).addErrback(_translate_failure)

    @classmethod
    async def _connect(cls, address: str | None, system: bool) -> SystemdClient:
        if system:
            bus = MessageBus(bus_type=BusType.SYSTEM, negotiate_unix_fd=True)
        else:
            address = address or session_bus_address()
            if address is None:
                raise SystemdError(
                    "sdexec.NoBus",
                    "no user bus: set DBUS_SESSION_BUS_ADDRESS or XDG_RUNTIME_DIR",
                )
            bus = MessageBus(bus_address=address, negotiate_unix_fd=True)
        try:
            await bus.connect()
        except OSError as error:
            where = "the system bus" if system else f"D-Bus at {address}"
            raise SystemdError(
                "sdexec.NoBus", f"cannot connect to {where}: {error}"
            ) from error
        client = cls(bus)
        try:
            await client._call(
                "org.freedesktop.DBus",
                "/org/freedesktop/DBus",
                "org.freedesktop.DBus",
                "AddMatch",
                "s",
                [_PROPERTIES_CHANGED_RULE],
            )
            await client._manager("Subscribe")
        except BaseException:
            bus.disconnect()  # not a usable client: do not leak its socket
            raise
        return client

    def disconnect(self) -> None:
        """Close the connection; :attr:`disconnected` fires."""
        self._bus.disconnect()

    # -- Manager methods -------------------------------------------------

    def start_transient_unit(
        self,
        name: str,
        properties: list[UnitProperty],
        stdin_fd: int,
        stdout_fd: int,
        stderr_fd: int,
        mode: str = "fail",
    ) -> Deferred[str]:
        """``StartTransientUnit`` with the process's three fds as ``h``
        properties. Fires with the job's object path once systemd has queued
        the start (the caller may close its copies of the fds then)."""
        fds = [stdin_fd, stdout_fd, stderr_fd]
        # Each fd property is an index into the message's fds.
        fd_properties = [
            UnitProperty(fd_name, "h", index)
            for index, fd_name in enumerate(FD_PROPERTIES)
        ]
        return self._defer(
            self._manager(
                "StartTransientUnit",
                "ssa(sv)a(sa(sv))",
                [name, mode, to_variants([*properties, *fd_properties]), []],
                unix_fds=fds,
            )
        ).addCallback(lambda body: body[0])

    def stop_unit(self, name: str, mode: str = "fail") -> Deferred[str]:
        """``StopUnit``; fires with the job path."""
        return self._defer(self._manager("StopUnit", "ss", [name, mode])).addCallback(
            lambda body: body[0]
        )

    def kill_unit(self, name: str, who: str, signal: int) -> Deferred[None]:
        """``KillUnit``: send ``signal`` to ``who`` (``main``, ``control`` or
        ``all``) of the unit."""
        return self._defer(
            self._manager("KillUnit", "ssi", [name, who, signal])
        ).addCallback(lambda _: None)

    def reset_failed_unit(self, name: str) -> Deferred[None]:
        """``ResetFailedUnit``: forget a failed unit so it can be unloaded."""
        return self._defer(self._manager("ResetFailedUnit", "s", [name])).addCallback(
            lambda _: None
        )

    def list_units_by_patterns(
        self, states: list[str], patterns: list[str]
    ) -> Deferred[list[tuple]]:
        """``ListUnitsByPatterns``: the 10-field unit tuples systemd returns."""
        return self._defer(
            self._manager("ListUnitsByPatterns", "asas", [states, patterns])
        ).addCallback(lambda body: [tuple(unit) for unit in body[0]])

    def get_all(self, path: str, interface: str) -> Deferred[dict[str, Any]]:
        """``Properties.GetAll`` on an object, values unwrapped."""
        return self._defer(self._get_all(path, interface))

    def watch_unit(
        self, name: str, callback: Callable[[dict[str, Any]], None]
    ) -> UnitWatch:
        """Follow a unit's properties; register *before* starting the unit."""
        path = unit_object_path(name)
        watch = UnitWatch(
            self._watches, name, path, callback, lambda: self.get_unit_state(path)
        )
        self._watches.register(watch)
        return watch

    def get_service_properties(self, name: str) -> Deferred[dict[str, Any]]:
        """``GetAll`` of a unit's ``Service`` interface alone: its exit,
        ``Result``, ``ControlGroup`` and resource counters, in one call."""
        return self.get_all(unit_object_path(name), SERVICE)

    def get_unit_state(self, path: str) -> Deferred[dict[str, Any]]:
        """``GetAll`` of the ``Unit`` and ``Service`` interfaces, merged."""
        return self._defer(self._get_unit_state(path))

    # -- plumbing --------------------------------------------------------

    def _defer(self, coroutine: Coroutine[Any, Any, Any]) -> Deferred[Any]:
        return Deferred.fromFuture(asyncio.ensure_future(coroutine)).addErrback(
            _translate_failure
        )

    async def _get_unit_state(self, path: str) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for interface in (UNIT, SERVICE):
            state.update(await self._get_all(path, interface))
        return state

    async def _get_all(self, path: str, interface: str) -> dict[str, Any]:
        body = await self._call(SYSTEMD, path, PROPERTIES, "GetAll", "s", [interface])
        return _unwrap(body[0])

    def _manager(self, member: str, signature: str = "", body=(), unix_fds=()):
        return self._call(
            SYSTEMD, MANAGER_PATH, MANAGER, member, signature, list(body), unix_fds
        )

    async def _call(
        self, destination, path, interface, member, signature, body, unix_fds=()
    ) -> list[Any]:
        started = time.monotonic()
        reply = await self._bus.call(
            Message(
                destination=destination,
                path=path,
                interface=interface,
                member=member,
                signature=signature,
                body=body,
                unix_fds=list(unix_fds),
            )
        )
        if self.on_call is not None:
            failed = reply is None or reply.message_type == MessageType.ERROR
            self.on_call(member, time.monotonic() - started, not failed)
        if reply is None:  # only for NO_REPLY_EXPECTED calls, which we never make
            raise SystemdError("sdexec.NoReply", f"{member}: no reply")
        if reply.message_type == MessageType.ERROR:
            text = reply.body[0] if reply.body else reply.error_name
            if self.debug:
                log.info(
                    "sdbus: {member} {path} → {error}: {text}",
                    member=member,
                    path=path,
                    error=reply.error_name,
                    text=text,
                )
            raise SystemdError(reply.error_name or "", text or "")
        if self.debug:
            log.info(
                "sdbus: {member} {path} {args} → ok",
                member=member,
                path=path,
                args=_brief(body),
            )
        return reply.body

    def _on_message(self, message: Message) -> None:
        if (
            message.message_type != MessageType.SIGNAL
            or message.member != "PropertiesChanged"
            or message.interface != PROPERTIES
        ):
            return
        _interface, changed, invalidated = message.body
        self._watches.changed(message.path or "", _unwrap(changed), invalidated)

    def _on_disconnect(self, result: object) -> None:
        log.info("D-Bus connection to systemd closed")
        self.disconnected.callback(None)


def _brief(body: list[Any], limit: int = 200) -> str:
    """Call arguments for a debug line: long ones (environments) cut short."""
    text = repr(body)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


def _translate_failure(failure):
    error = failure.value
    if isinstance(error, DBusError):
        raise SystemdError(error.type, error.text) from error
    return failure
