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
import functools
import os
import socket
import string
import time
from array import array
from collections.abc import Callable, Coroutine, Hashable, Sequence
from typing import Any, cast

from dbus_fast import BusType, Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.aio.message_bus import _MessageWriter
from dbus_fast.errors import DBusError
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sdexec.property import FD_PROPERTIES, UnitProperty
from sdexec.refusal import quoted
from sdexec.systemd.errors import (
    MANAGER_AWAY,
    NO_BUS_ADDRESS,
    SystemdError,
    connection_lost,
    is_connection_lost,
    manager_away,
    never_sent,
    reconnecting,
)
from sdexec.systemd.retry import Backoff, Reminders
from sdexec.systemd.unanswered import (
    SILENT_AFTER_S,
    Silence,
    UnansweredCalls,
    calls_waiting,
)
from sdexec.systemd.watch import UnitWatch, WatchRegistry
from sdexec.systemd.window import DEFAULT_MAX_INFLIGHT, SERVICE_LANE, CallWindow

__all__ = [
    "MANAGER_LEFT",
    "SystemdClient",
    "UnitWatch",
    "session_bus_address",
    "to_variants",
    "unit_object_path",
]

#: Why the connection is lost when the manager leaves the bus while the
#: bus stays (re-executed, restarted or killed), not the bus closing.
MANAGER_LEFT = "the systemd manager left the bus"

log = Logger()

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT_PATH_PREFIX = "/org/freedesktop/systemd1/unit/"
DBUS = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"
#: An auto-starting call to a name nobody owns and none may activate.
SERVICE_UNKNOWN = "org.freedesktop.DBus.Error.ServiceUnknown"
#: ``GetNameOwner`` of a name nobody owns, and the answer of dbus-daemon and
#: dbus-broker to a call without auto-start to it (seen here on
#: dbus-daemon 1.14 with the manager killed).
NAME_HAS_NO_OWNER = "org.freedesktop.DBus.Error.NameHasNoOwner"
_NO_MANAGER = frozenset({SERVICE_UNKNOWN, NAME_HAS_NO_OWNER})
#: The bus's errors of a service it failed to start: the first Subscribe's
#: answer on a user bus with no manager where the manager's name has an
#: activation file (systemd's own runs /bin/false: ``Spawn.ChildExited``,
#: "Process org.freedesktop.systemd1 exited with status 1").
SPAWN_FAILED = "org.freedesktop.DBus.Error.Spawn."
#: ``Subscribe`` of a client a re-executed manager still has.
ALREADY_SUBSCRIBED = "org.freedesktop.systemd1.AlreadySubscribed"
#: The callee left the bus before replying.
NO_REPLY = "org.freedesktop.DBus.Error.NoReply"

_PROPERTIES_CHANGED_RULE = (
    "type='signal',sender='org.freedesktop.systemd1',"
    "interface='org.freedesktop.DBus.Properties',member='PropertiesChanged',"
    "path_namespace='/org/freedesktop/systemd1/unit'"
)
#: The manager's signal that a daemon-reload begins (true) or ends (false):
#: sent to its subscribers only.
_RELOADING_RULE = (
    "type='signal',sender='org.freedesktop.systemd1',"
    "interface='org.freedesktop.systemd1.Manager',member='Reloading',"
    "path='/org/freedesktop/systemd1'"
)
_OWNER_CHANGED_RULE = (
    "type='signal',sender='org.freedesktop.DBus',interface='org.freedesktop.DBus',"
    "member='NameOwnerChanged',arg0='org.freedesktop.systemd1'"
)
_PATH_SAFE = frozenset(string.ascii_letters + string.digits)
#: How long the bus may stay up without the manager on it before the client
#: reconnects to the bus address. A killed manager can leave its
#: dbus-daemon running as an orphan; a new manager then listens with a new
#: dbus-daemon at the same path, which only a new connection reaches.
MANAGER_ABSENT_S = 5.0
#: How long the bus itself may take to answer in a reconnection (connect
#: and authenticate, ``AddMatch``), and then, while the manager is waited
#: for (``Subscribe`` and the reads behind it, in a reconnection or to a
#: manager back on the bus), each check that the bus still answers (a
#: ``GetNameOwner``, sent every period), before the attempt is abandoned:
#: its connection is closed and the backoff dials again. A bus that stalls
#: mid-reconnection (a stopped or wedged dbus-daemon, the orphan of a
#: killed manager) would otherwise hold it for ever, and no new bus at the
#: address would ever be reached. A manager slow to answer on a bus that
#: answers (a long ``daemon-reexec``) is waited for, as flux-core's sdbus
#: waits for its Subscribe: abandoning its connection each period only
#: queued the Subscribe again behind the ones it had not yet read.
#: sd-bus's default method timeout, the same bound after which a call is
#: said unanswered (:data:`SILENT_AFTER_S`): under ``reconnect-timeout``
#: (60 s), so that a stalled attempt is dialled again before the service
#: drains.
RECONNECT_ATTEMPT_S = SILENT_AFTER_S


def unit_object_path(unit_name: str) -> str:
    """The D-Bus object path of a unit, escaped as systemd's
    ``bus_label_escape`` does: every byte that is not an ASCII letter or digit
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


#: Where the system bus is when ``DBUS_SYSTEM_BUS_ADDRESS`` is unset: the
#: D-Bus specification's default, which dbus-fast also uses.
DEFAULT_SYSTEM_BUS_ADDRESS = "unix:path=/var/run/dbus/system_bus_socket"


def system_bus_address() -> str:
    """``DBUS_SYSTEM_BUS_ADDRESS``, else :data:`DEFAULT_SYSTEM_BUS_ADDRESS`:
    the address the system bus is connected at, and named at."""
    return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or DEFAULT_SYSTEM_BUS_ADDRESS


def _bus_named(address: str | None, system: bool) -> str:
    """The bus a connection error names, with the address it was tried at:
    ``DBUS_SYSTEM_BUS_ADDRESS`` may point the system bus anywhere."""
    if system:
        return f"the system bus at {system_bus_address()}"
    return f"D-Bus at {address or session_bus_address()}"


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


async def _open_bus(address: str | None, system: bool) -> MessageBus:
    """A connected bus (fd passing negotiated) with the patient writer."""
    if not system:
        address = address or session_bus_address()
        if address is None:
            raise SystemdError(
                NO_BUS_ADDRESS,
                "no user bus: set DBUS_SESSION_BUS_ADDRESS or XDG_RUNTIME_DIR",
            )
    bus = _new_bus(address, system)
    try:
        await bus.connect()
    except ValueError as error:  # dbus-fast's word on an address it cannot use
        raise _not_an_address(address, system, error) from error
    except OSError as error:
        where = _bus_named(address, system)
        hint = (
            " (is dbus running?)"
            if system
            else " (is the user's manager running, with dbus-user-session?"
            ' or set [systemd] bus = "system")'
        )
        # The errno's words, not Python's "[Errno 2] …": the start's one line.
        why = error.strerror or str(error)
        raise SystemdError(
            "sdexec.NoBus", f"cannot connect to {where}: {why}{hint}"
        ) from error
    # Nothing was written through dbus-fast's own writer yet (the Hello
    # goes around it), so it can be swapped for the patient one.
    bus._writer = _PatientWriter(bus)
    return bus


def _new_bus(address: str | None, system: bool) -> MessageBus:
    """An unconnected bus: the system bus (at the address dbus-fast reads
    from the environment), else the user bus at ``address``."""
    try:
        if system:  # at the address its errors name
            return MessageBus(
                bus_address=system_bus_address(),
                bus_type=BusType.SYSTEM,
                negotiate_unix_fd=True,
            )
        return MessageBus(bus_address=address, negotiate_unix_fd=True)
    except ValueError as error:  # InvalidAddressError: not an address at all
        raise _not_an_address(address, system, error) from error


#: The variable each bus's address comes from (``system`` or not).
_ADDRESS_VARIABLES = {
    True: "DBUS_SYSTEM_BUS_ADDRESS",
    False: "DBUS_SESSION_BUS_ADDRESS",
}


def _not_an_address(
    address: str | None, system: bool, error: ValueError
) -> SystemdError:
    """The error of a bus address dbus-fast cannot use, naming where it
    came from: the same start would fail the same way."""
    variable = _ADDRESS_VARIABLES[system]
    given = os.environ.get(variable)
    if system:
        address = given  # dbus-fast's default for it is an address
    if address is not None and address == given:
        where = variable
    else:
        where = "the system bus's address" if system else "the user bus's address"
    return SystemdError(
        NO_BUS_ADDRESS,
        f"{where} {quoted(address or '')} is not a D-Bus address: {error}",
    )


class _PatientWriter(_MessageWriter):
    """dbus-fast's writer, but a full socket makes it wait for the socket to
    be writable instead of closing the connection.

    dbus-fast (5.2, as python-dbus-next, altdesktop/python-dbus-next#153)
    treats the ``BlockingIOError`` of a non-blocking ``send`` like any other
    error: a burst of calls that fills the send buffer failed every pending
    call with EAGAIN and closed the bus. This is its ``write_callback`` with
    that one case added; the window of calls (:class:`CallWindow`) keeps
    the queue short, this keeps a full transport from being fatal.
    """

    def write_callback(self, remove_writer: bool = True) -> None:
        sock, fd = self.sock, self.fd
        assert sock is not None and fd is not None  # set before any write
        try:
            while True:
                if self.buf is None:
                    if not self.messages:
                        if remove_writer:
                            self.loop.remove_writer(fd)
                        return
                    buf, self.unix_fds, self.fut = self.messages.popleft()
                    self.buf = memoryview(buf)
                    self.offset = 0
                self.offset += self._send(sock, self.buf[self.offset :])
                if self.offset < len(self.buf):
                    return  # the rest when the socket is writable again
                self.buf = None
                if self.fut is not None and not self.fut.done():
                    self.fut.set_result(None)
        except (BlockingIOError, InterruptedError):
            # Full: write again once the socket is writable.
            self.loop.add_writer(fd, self.write_callback)
        except Exception as error:
            self._fail_writes(error)
            self.bus._finalize(error)

    def _fail_writes(self, error: Exception) -> None:
        """A write failed with ``error`` (EPIPE: the bus went before its
        reader saw the end): nothing more is written, and every write's
        future says so, read here as well. dbus-fast's ``call()`` never
        awaits its write's future, and asyncio logged each as an exception
        never retrieved, with a traceback, once per bus lost mid-write.
        And with a write left in progress, the ``schedule_write`` that had
        just tried it watched the closed socket again (EBADF), so that the
        ``call()`` raised before awaiting its reply, whose failure was
        logged so too. Each call fails with the connection, as every call
        awaiting a reply does."""
        writes = [self.fut, *(fut for _, _, fut in self.messages)]
        # (The failed write's future stays, done: schedule_write watches the
        # socket again while there is one not done, or none.)
        self.buf = None
        self.messages.clear()
        for fut in writes:
            if fut is None or fut.done():
                continue
            if self.bus._user_disconnect:
                fut.set_result(None)
            else:
                fut.set_exception(error)
                fut.exception()  # retrieved

    def _send(self, sock: socket.socket, data: memoryview) -> int:
        if not (self.unix_fds and self.negotiate_unix_fd):
            return sock.send(data)
        # The fds go with the first bytes; a send that raises sent neither,
        # so they stay for the next try.
        fds = array("i", self.unix_fds)
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        self.unix_fds = None
        return sent


class SystemdClient:
    """A connection to a systemd manager (user or system) over D-Bus.

    Build one with :meth:`connect`. Every method returns a Deferred; failures
    are :class:`SystemdError`.
    """

    def __init__(
        self,
        bus: MessageBus,
        reopen: Callable[[], Coroutine[Any, Any, MessageBus]],
        clock: IReactorTime | None = None,
    ) -> None:
        """``bus`` is connected; ``reopen()`` connects anew to the same bus.
        Use :meth:`connect`."""
        clock = _clock_or_reactor(clock)
        self._bus: MessageBus | None = None
        self._reopen = reopen
        self._watches = WatchRegistry()
        #: Log every method call and its outcome (``[systemd] sdbus-debug``).
        self.debug = False
        #: Metrics hook: ``on_call(member, seconds, ok)`` after every method
        #: call (sdexec/metrics.py).
        self.on_call: Callable[[str, float, bool], None] | None = None
        #: Fires once :meth:`disconnect` has closed the connection for good.
        self.disconnected: Deferred[None] = Deferred()
        #: ``on_lost(reason)`` when the bus or the manager goes away, and
        #: ``on_restored()`` once both are back and subscribed again.
        self.on_lost: Callable[[str], None] | None = None
        self.on_restored: Callable[[], None] | None = None
        #: ``on_reloading()`` when the manager begins a ``daemon-reload``.
        self.on_reloading: Callable[[], None] | None = None
        #: The bus is up, the manager on it and subscribed: calls are sent.
        self.connected = False
        #: The manager's own cgroup, read at each (re)connection.
        self.control_group: str | None = None
        self.version: str | None = None
        self._closing = False
        #: Every method call goes through it (``[systemd] max-inflight``).
        self.window = CallWindow(DEFAULT_MAX_INFLIGHT)
        #: ``lane_of(unit)``: the window's lane of a call for ``unit`` (the
        #: server's: its user's uid); calls for no unit take the service's.
        self.lane_of: Callable[[str], Hashable] = lambda unit: SERVICE_LANE
        #: Every call sent and not answered yet (a silent manager is told).
        self._unanswered = UnansweredCalls(clock)
        self._backoff = Backoff(clock, self._reconnect, "reconnecting to systemd")
        self._clock = clock
        #: systemd away: said as it goes, then now and then while it stays
        #: away (each reconnection to the bus address, every
        #: MANAGER_ABSENT_S, was two lines), and how long once back.
        self._away = Reminders(clock)
        #: The bus was closed here to reconnect to its address (the
        #: manager absent from it): its return is no news.
        self._redialled = False
        self._absent_timer: IDelayedCall | None = None
        #: Reconnections under way (one at most): :meth:`disconnect`
        #: cancels them.
        self._redials: set[asyncio.Future[None]] = set()
        #: How many times a manager has left the bus: a subscription made
        #: while one left again is not a manager back.
        self._departures = 0
        #: The manager's unique bus name: only its ``PropertiesChanged``
        #: are taken. The match rule asks for the manager's broadcasts, but
        #: any peer may send a signal to this connection by name (the system
        #: bus lets every local user), and a forged "exited" would end a
        #: running job.
        self._manager_owner: str | None = None
        self._adopt(bus)

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        *,
        system: bool = False,
        clock: IReactorTime | None = None,
        on_call: Callable[[str, float, bool], None] | None = None,
    ) -> Deferred[SystemdClient]:
        """Connect to ``address``, or to the user bus (see
        :func:`session_bus_address`), or with ``system=True`` the system bus;
        negotiate fd passing, add the match rules for unit property changes
        and for the manager's bus name, and ``Subscribe``. Once connected,
        the client reconnects by itself when the bus or the manager goes
        away (see :attr:`on_lost`), on ``clock``'s timers (the reactor's
        if not given). ``on_call``: :attr:`on_call` from the first call on
        (the connection's own calls included).

        Bounded as a reconnection is (:data:`RECONNECT_ATTEMPT_S`): a bus
        that does not complete the connection in that time (a socket that
        accepts and never authenticates, a stopped dbus-daemon) fails it,
        where a start would wait for ever without a word; the manager's
        ``Subscribe`` is then waited for while the bus answers."""
        reopen = functools.partial(_open_bus, address, system)
        return cls.connect_with(reopen, clock, on_call, _bus_named(address, system))

    @classmethod
    def connect_with(
        cls,
        reopen: Callable[[], Coroutine[Any, Any, MessageBus]],
        clock: IReactorTime | None = None,
        on_call: Callable[[str, float, bool], None] | None = None,
        where: str = "the bus",
    ) -> Deferred[SystemdClient]:
        """:meth:`connect` through ``reopen()``, which opens the bus (and
        opens it anew on each reconnection); ``where``: the bus, as the
        error of a connection abandoned names it."""
        clock = _clock_or_reactor(clock)
        made: list[SystemdClient] = []

        async def bus_answers() -> None:  # asked once the bus has answered
            await made[0]._bus_answers()

        bound = _Bound(clock, bus_answers, f"connection to {where}")
        attempt = cls._connect(reopen, clock, on_call, bound, made)
        return bound.run(asyncio.ensure_future(attempt)).addCallback(lambda _: made[0])

    @classmethod
    async def _connect(
        cls,
        reopen: Callable[[], Coroutine[Any, Any, MessageBus]],
        clock: IReactorTime,
        on_call: Callable[[str, float, bool], None] | None,
        bound: _Bound,
        made: list[SystemdClient],
    ) -> None:
        client = cls(await reopen(), reopen, clock)
        made.append(client)
        client.on_call = on_call
        try:
            await client._add_matches()
            bound.bus_answered()  # the manager is waited for from now on
            # The first time, let the bus wait for the manager (a bus just
            # socket-activated by this connection has no manager on it yet).
            await client._subscribe(autostart=True)
        except SystemdError as error:
            client.disconnect()
            if error.name != MANAGER_AWAY:
                raise
            raise SystemdError(
                error.name,
                "no systemd manager on this bus: a user's runs while the user"
                " is logged in, or always with `loginctl enable-linger`; the"
                ' system\'s is [systemd] bus = "system"'
                f" ({error.detail})",
            ) from None
        except BaseException:
            client.disconnect()  # not a usable client: do not leak its socket
            raise
        client.connected = True

    def disconnect(self) -> None:
        """Close the connection for good; :attr:`disconnected` fires."""
        self._closing = True
        self.connected = False
        self._backoff.stop()
        self._cancel_absent_check()
        self._unanswered.stop()
        for redial in list(self._redials):
            redial.cancel()  # one stalled before its bus was adopted
        if self._bus is not None:
            self._bus.disconnect()
        elif not self.disconnected.called:
            self.disconnected.callback(None)

    # -- losing systemd and getting it back ------------------------------

    def _adopt(self, bus: MessageBus) -> None:
        self._bus = bus
        self._manager_owner = None  # a name on another bus: learnt anew
        bus.add_message_handler(self._on_message)
        Deferred.fromFuture(asyncio.ensure_future(bus.wait_for_disconnect())).addBoth(
            self._bus_closed, bus
        )

    async def _add_matches(self) -> None:
        for rule in (_PROPERTIES_CHANGED_RULE, _RELOADING_RULE, _OWNER_CHANGED_RULE):
            await self._call(DBUS, DBUS_PATH, DBUS, "AddMatch", "s", [rule])

    async def _subscribe(self, autostart: bool = False) -> None:
        try:
            await self._call(
                SYSTEMD, MANAGER_PATH, MANAGER, "Subscribe", "", [], (), autostart,
                handled=frozenset({ALREADY_SUBSCRIBED}),
            )  # fmt: skip
        except SystemdError as error:
            # A re-executed manager keeps its subscribers.
            if error.name != ALREADY_SUBSCRIBED:
                raise
        self._manager_owner = await self._name_owner(SYSTEMD)
        self.control_group = await self._manager_string("ControlGroup")
        self.version = await self._manager_string("Version")

    async def _name_owner(self, name: str) -> str:
        """The unique bus name that owns ``name`` now."""
        body = await self._call(DBUS, DBUS_PATH, DBUS, "GetNameOwner", "s", [name])
        if not body or not isinstance(body[0], str):
            raise SystemdError(NAME_HAS_NO_OWNER, f"GetNameOwner: no owner of {name}")
        return body[0]

    async def _manager_string(self, name: str) -> str | None:
        """The manager's property ``name`` (``ControlGroup``, ``Version``);
        ``None`` if it cannot be read (a manager too old to have it, a call
        that failed): without ``ControlGroup`` what a lost unit leaves is
        found only where a ``GetAll`` read the unit's own cgroup; without
        ``Version`` what was judged of the manager stands."""
        try:
            asked = [MANAGER, name]
            body = await self._call(
                SYSTEMD, MANAGER_PATH, PROPERTIES, "Get", "ss", asked
            )
        except SystemdError as error:
            if is_connection_lost(error):
                raise  # the manager itself is gone, not its property
            return None
        value = body[0].value if body and isinstance(body[0], Variant) else None
        return value if isinstance(value, str) else None

    def _bus_closed(self, _: object, bus: MessageBus) -> None:
        if self._closing:
            self._closed_for_good(bus)
            return
        if bus is not self._bus:
            return  # one given up on while reconnecting
        self._bus = None
        self._lose("the D-Bus connection closed")
        self._backoff.start()

    def _closed_for_good(self, bus: MessageBus) -> None:
        """A bus closed after :meth:`disconnect`: :attr:`disconnected`
        fires once none is left, also where a reconnection's failed call
        gave its bus up before the close was heard."""
        if bus is self._bus:
            self._bus = None
        if self._bus is None and not self.disconnected.called:
            log.info("D-Bus connection to systemd closed")
            self.disconnected.callback(None)

    def _lose(self, reason: str) -> None:
        """systemd is away: calls queued fail now (never sent: nothing they
        asked for was done), new ones at once, until it is back; those in
        flight fail as their bus or manager does (they may have been)."""
        if not self.connected:
            return
        self.connected = False
        log.warn("systemd connection lost: {reason}", reason=reason)
        self._away.begin()
        self.window.fail_queued(Failure(never_sent(reason)))
        if self.on_lost is not None:
            self.on_lost(reason)

    def _reconnect(self) -> Deferred[None]:
        bound = _Bound(self._clock, self._bus_answers, "reconnection")
        task = asyncio.ensure_future(self._reopen_and_resume(bound))
        # Cancelled by disconnect(): one stalled before its bus was
        # adopted has no bus for disconnect() to close.
        self._redials.add(task)
        task.add_done_callback(self._redials.discard)
        return bound.run(task)

    async def _bus_answers(self) -> None:
        """Ask the bus itself (not the manager) a question: any answer, an
        error too, says it lives."""
        try:
            await self._call(DBUS, DBUS_PATH, DBUS, "GetNameOwner", "s", [SYSTEMD])
        except SystemdError as error:
            if is_connection_lost(error):
                raise

    async def _reopen_and_resume(self, bound: _Bound) -> None:
        bus = await self._reopen()
        if self._closing:
            bus.disconnect()
            return
        # News if the bus had gone by itself, or could not be reached.
        news = not self._redialled or self._backoff.failures > 0
        self._redialled = False
        self._adopt(bus)
        departures = self._departures
        try:
            await self._add_matches()
            bound.bus_answered()  # the manager is waited for from now on
            await self._subscribe()
        except SystemdError as error:
            if error.name == MANAGER_AWAY:
                # The bus is back, the manager not yet: its NameOwnerChanged
                # (matched already) resumes.
                if news:
                    log.info("D-Bus is back; waiting for the systemd manager")
                self._arm_absent_check()
                return
            self._give_up(bus)
            raise
        except BaseException:
            self._give_up(bus)
            raise
        self._subscribed(departures)

    def _give_up(self, bus: MessageBus) -> None:
        if bus is self._bus:
            self._bus = None  # its close is no news: the backoff retries
        bus.disconnect()

    def _manager_appeared(self) -> None:
        if self.connected or self._bus is None:
            return
        departures = self._departures
        subscribe = asyncio.ensure_future(self._subscribe())
        # Its bus answered (the NameOwnerChanged came on it): the manager
        # is waited for while the bus still answers.
        bound = _Bound(self._clock, self._bus_answers, "Subscribe", answered=True)
        bound.run(subscribe).addCallbacks(
            lambda _: self._subscribed(departures), self._subscribe_failed
        )

    def _subscribed(self, departures: int) -> None:
        """Subscribed to a manager: back, unless a manager left the bus
        meanwhile (a crash loop); then the next one is waited for."""
        if self._departures != departures:
            self._arm_absent_check()
            return
        self._restored()

    def _subscribe_failed(self, failure: Failure) -> None:
        log.warn(
            "Subscribe to the returned systemd manager failed: {error}",
            error=failure.getErrorMessage(),
        )
        # Nothing else would try again where the owner stays (a re-executed
        # manager): the absent check reconnects to the bus address.
        self._arm_absent_check()

    def _arm_absent_check(self) -> None:
        """Reconnect to the bus address if the manager is not back on this
        bus within :data:`MANAGER_ABSENT_S` (not once :meth:`disconnect`
        closed it for good: a Subscribe that cut short fails, and armed it
        again)."""
        if self._closing:
            return
        if self._absent_timer is None or not self._absent_timer.active():
            self._absent_timer = self._clock.callLater(
                MANAGER_ABSENT_S, self._manager_still_absent
            )

    def _cancel_absent_check(self) -> None:
        if self._absent_timer is not None and self._absent_timer.active():
            self._absent_timer.cancel()
        self._absent_timer = None

    def _manager_still_absent(self) -> None:
        self._absent_timer = None
        bus = self._bus
        if self.connected or self._closing or bus is None:
            return
        if self._away.due():
            log.info(
                "systemd away for {seconds:.0f} s: reconnecting to the bus"
                " address every {every:g} s while no manager is on the bus"
                " (a new manager may listen there with a new bus)",
                seconds=self._away.lasted(),
                every=MANAGER_ABSENT_S,
            )
        self._redialled = True
        bus.disconnect()  # _bus_closed starts the backoff

    def _restored(self) -> None:
        if self.connected or self._closing:
            return
        self._cancel_absent_check()
        self.connected = True
        log.info(
            "systemd connection restored after {seconds:.0f} s",
            seconds=self._away.end() or 0.0,
        )
        if self.on_restored is not None:
            self.on_restored()

    @property
    def calls_answered(self) -> int:
        """Method calls answered so far (or failed)."""
        return self.window.completed

    @property
    def max_inflight(self) -> int:
        """How many method calls may await their reply at once; the others
        wait for a slot, in their lanes (:attr:`lane_of`), in turn."""
        return self.window.limit

    @max_inflight.setter
    def max_inflight(self, limit: int) -> None:
        self.window.limit = limit

    def silence(self) -> Silence | None:
        """The oldest call sent and unanswered for
        :data:`~sdexec.systemd.unanswered.SILENT_AFTER_S` or more, else
        ``None``."""
        return self._unanswered.silence()

    def calls_waiting(self) -> dict[str, Any]:
        """For the stats (:func:`~sdexec.systemd.unanswered.calls_waiting`)."""
        unanswered = self._unanswered
        return calls_waiting(len(unanswered), self.window.queued, unanswered.oldest())

    def calls_queued_in(self, lane: Hashable) -> int:
        """For the stats: the calls of ``lane`` waiting for a slot."""
        return self.window.queued_in(lane)

    # -- Manager methods -------------------------------------------------

    def start_transient_unit(
        self,
        name: str,
        properties: list[UnitProperty],
        stdin_fd: int,
        stdout_fd: int,
        stderr_fd: int,
        mode: str = "fail",
        on_sent: Callable[[], None] | None = None,
    ) -> Deferred[str]:
        """``StartTransientUnit`` with the process's three fds as ``h``
        properties. Fires with the job's object path once systemd has queued
        the start (the caller may close its copies of the fds then);
        ``on_sent()`` as the call leaves the window for the bus."""
        fds = [stdin_fd, stdout_fd, stderr_fd]
        # Each fd property is an index into the message's fds.
        fd_properties = [
            UnitProperty(fd_name, "h", index)
            for index, fd_name in enumerate(FD_PROPERTIES)
        ]

        def send() -> Coroutine[Any, Any, Any]:
            if on_sent is not None:
                on_sent()
            return self._manager(
                "StartTransientUnit",
                "ssa(sv)a(sa(sv))",
                [name, mode, to_variants([*properties, *fd_properties]), []],
                unix_fds=fds,
            )

        return self._defer(send, name).addCallback(lambda body: body[0])

    def stop_unit(self, name: str, mode: str = "replace") -> Deferred[str]:
        """``StopUnit``; fires with the job path. ``replace``: systemd refuses
        ``fail`` while the unit's start job is still queued."""
        return self._defer(
            lambda: self._manager("StopUnit", "ss", [name, mode]), name
        ).addCallback(lambda body: body[0])

    def kill_unit(self, name: str, who: str, signal: int) -> Deferred[None]:
        """``KillUnit``: send ``signal`` to ``who`` (``main``, ``control`` or
        ``all``) of the unit."""
        return self._defer(
            lambda: self._manager("KillUnit", "ssi", [name, who, signal]), name
        ).addCallback(lambda _: None)

    def reset_failed_unit(self, name: str) -> Deferred[None]:
        """``ResetFailedUnit``: forget a failed unit so it can be unloaded."""
        return self._defer(
            lambda: self._manager("ResetFailedUnit", "s", [name]), name
        ).addCallback(lambda _: None)

    def list_units_by_patterns(
        self, states: list[str], patterns: list[str]
    ) -> Deferred[list[tuple]]:
        """``ListUnitsByPatterns``: the 10-field unit tuples systemd returns.
        One pattern naming one unit (a leftover looked for) is a call for
        that unit: it waits behind the unit's calls queued before it."""
        return self._defer(
            lambda: self._manager("ListUnitsByPatterns", "asas", [states, patterns]),
            _one_unit(patterns),
        ).addCallback(lambda body: [tuple(unit) for unit in body[0]])

    def get_all(
        self, path: str, interface: str, unit: str | None = None
    ) -> Deferred[dict[str, Any]]:
        """``Properties.GetAll`` on an object (``unit``'s, if it is one),
        values unwrapped."""
        return self._defer(lambda: self._get_all(path, interface), unit)

    def watch_unit(
        self, name: str, callback: Callable[[dict[str, Any]], None]
    ) -> UnitWatch:
        """Follow a unit's properties; register *before* starting the unit."""
        path = unit_object_path(name)
        watch = UnitWatch(
            self._watches,
            name,
            path,
            callback,
            lambda: self.get_unit_state(path, name),
        )
        self._watches.register(watch)
        return watch

    def get_service_properties(self, name: str) -> Deferred[dict[str, Any]]:
        """``GetAll`` of a unit's ``Service`` interface alone: its exit,
        ``Result``, ``ControlGroup`` and resource counters, in one call."""
        return self.get_all(unit_object_path(name), SERVICE, name)

    def get_unit_state(
        self, path: str, unit: str | None = None
    ) -> Deferred[dict[str, Any]]:
        """``GetAll`` of the ``Unit`` and ``Service`` interfaces (of
        ``unit``'s object, if it is one), merged."""
        return self._defer(lambda: self._get_unit_state(path), unit)

    # -- plumbing --------------------------------------------------------

    def _defer(
        self, call: Callable[[], Coroutine[Any, Any, Any]], unit: str | None = None
    ) -> Deferred[Any]:
        """Run ``call()`` once the window has a slot for it, in the lane of
        ``unit`` (:attr:`lane_of`), of the service if ``None``; at once fail
        with EAGAIN while systemd is away."""
        if not self.connected:
            return fail(reconnecting())

        def start() -> Deferred[Any]:
            # A bus closed, not yet heard of (_call): refused as its turn
            # comes, it takes no slot and is no answer of the manager's.
            if self._bus is None or self._bus._disconnected:
                raise reconnecting()
            return Deferred.fromFuture(asyncio.ensure_future(call()))

        return self.window.submit(
            start, SERVICE_LANE if unit is None else self.lane_of(unit), unit
        ).addErrback(_translate_failure)

    async def _get_unit_state(self, path: str) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for interface in (UNIT, SERVICE):
            state.update(await self._get_all(path, interface))
        return state

    async def _get_all(self, path: str, interface: str) -> dict[str, Any]:
        body = await self._call(SYSTEMD, path, PROPERTIES, "GetAll", "s", [interface])
        return _unwrap(body[0])

    def _manager(
        self,
        member: str,
        signature: str = "",
        body: Sequence[Any] = (),
        unix_fds: Sequence[int] = (),
    ) -> Coroutine[Any, Any, list[Any]]:
        """A call of the manager's ``member`` with ``body``."""
        return self._call(
            SYSTEMD, MANAGER_PATH, MANAGER, member, signature, list(body), unix_fds
        )

    def _observe(
        self,
        member: str,
        started: float,
        reply: Message | None,
        handled: frozenset[str],
    ) -> None:
        """``on_call`` for every call, answered or not: one lost with its
        connection (no reply) failed, as an error reply did, but for one
        the caller takes as success (``handled``: an alert on the error
        outcome paged at every ``daemon-reexec``, which answers a
        resubscription ``AlreadySubscribed``)."""
        if self.on_call is not None:
            ok = reply is not None and (
                reply.message_type != MessageType.ERROR or reply.error_name in handled
            )
            self.on_call(member, time.monotonic() - started, ok)

    async def _call(
        self,
        destination: str,
        path: str,
        interface: str,
        member: str,
        signature: str,
        body: list[Any],
        unix_fds: Sequence[int] = (),
        autostart: bool = False,
        handled: frozenset[str] = frozenset(),
    ) -> list[Any]:
        """``member``'s reply body; ``SystemdError`` for an error reply
        (observed as ``ok`` if its name is one ``handled``)."""
        bus = self._bus
        # A bus dbus-fast has closed, before _bus_closed hears of it (a
        # loop pass or two): its reply would never come, and the call's
        # window slot would stay taken.
        if bus is None or bus._disconnected:
            raise reconnecting()
        started = time.monotonic()
        message = Message(
            destination=destination,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=body,
            unix_fds=list(unix_fds),
            # A manager that is away fails the call at once instead of the
            # bus trying to activate it (which timed out after 120 s).
            flags=MessageFlag.NONE if autostart else MessageFlag.NO_AUTOSTART,
        )
        token = self._unanswered.sent(member)
        reply = None
        try:
            reply = await bus.call(message)
        except Exception as error:
            if bus is not self._bus or bus._disconnected:
                raise connection_lost(_why_lost(error)) from error
            raise
        finally:
            self._unanswered.answered(token)
            self._observe(member, started, reply, handled)
        if reply is None:  # the bus closed before any reply came
            raise connection_lost()
        if reply.message_type == MessageType.ERROR:
            raise self._error_for(reply, destination, member, path)
        if self.debug:
            log.debug(
                "sdbus: {member} {path} {args} → ok",
                member=member,
                path=path,
                args=quoted(_unwrapped(body), 200),
            )
        return reply.body

    def _error_for(
        self, reply: Message, destination: str, member: str, path: str
    ) -> SystemdError:
        """The error an error reply to ``member`` of ``destination`` at
        ``path`` stands for: the connection lost, the manager away, or
        systemd's own refusal."""
        text = reply.body[0] if reply.body else reply.error_name
        if self.debug:
            log.debug(
                "sdbus: {member} {path} → {error}: {text}",
                member=member,
                path=path,
                error=reply.error_name,
                text=text,
            )
        if reply.error_name == NO_REPLY:  # the manager left mid-call
            return connection_lost(text or "")
        if destination == SYSTEMD and reply.sender == DBUS and _no_manager(reply):
            # The bus answers so a call sent as the manager left, before
            # its NameOwnerChanged reached us, or while it is not back; or
            # the first, which may start it, where none can be started.
            return manager_away(text or "")
        return SystemdError(reply.error_name or "", text or "")

    def _on_message(self, message: Message) -> None:
        if message.message_type != MessageType.SIGNAL:
            return
        if message.member == "PropertiesChanged" and message.interface == PROPERTIES:
            if message.sender is None or message.sender != self._manager_owner:
                return  # not the manager's (see _manager_owner)
            path = message.path or ""
            if self._watches.follows(path):  # the match rule takes every unit's
                _interface, changed, invalidated = message.body
                self._watches.changed(path, _unwrap(changed), invalidated)
        elif (
            message.member == "NameOwnerChanged"
            and message.sender == DBUS
            and message.body[0] == SYSTEMD
        ):
            self._owner_changed(message.body[1], message.body[2])
        elif (
            message.member == "Reloading"
            and message.interface == MANAGER
            and message.sender == self._manager_owner
            and message.body == [True]
            and self.on_reloading is not None
        ):
            self.on_reloading()

    def _owner_changed(self, old_owner: str, new_owner: str) -> None:
        """The manager left the bus (it died), came back, or was replaced
        (``daemon-reexec``: one owner straight to the next). A new owner
        knows nothing of our subscription or of what we missed."""
        self._manager_owner = new_owner or None
        if old_owner:
            self._departures += 1
            self._lose(MANAGER_LEFT)
        if new_owner:
            self._manager_appeared()
        else:
            self._arm_absent_check()


def _clock_or_reactor(clock: IReactorTime | None) -> IReactorTime:
    """``clock``, else the reactor (the one running by now)."""
    if clock is not None:
        return clock
    from twisted.internet import reactor

    return cast(IReactorTime, reactor)


class _Bound:
    """How long one reconnection, or the ``Subscribe`` to a manager back on
    the bus, may take (:data:`RECONNECT_ATTEMPT_S`): each period the bus
    must have answered, or the attempt is cancelled and fails with a
    connection lost that says so. Until the bus has answered in the attempt
    (:meth:`bus_answered`), that is the attempt's first period; from then
    on the manager is waited for as long as it takes, while the bus answers
    a check (``probe``) sent each period: a slow manager is no stalled bus."""

    def __init__(
        self,
        clock: IReactorTime,
        probe: Callable[[], Coroutine[Any, Any, None]],
        what: str,
        answered: bool = False,
    ) -> None:
        self._clock = clock
        self._probe = probe
        self._what = what
        #: The bus answered in this period (or before the first).
        self._answered = answered
        #: Whether the manager is waited for: the bus answered once.
        self._waiting = answered
        self._periods = 0
        self._attempt: asyncio.Future[None] | None = None
        self._timer: IDelayedCall | None = None
        #: The last check of the bus, cancelled with the attempt's end.
        self._check: Deferred[None] | None = None
        #: Why the attempt was cancelled, once it is.
        self._why: str | None = None

    def run(self, attempt: asyncio.Future[None]) -> Deferred[None]:
        """``attempt``, bounded: cancelled, the bus it opened is closed as
        it ends (:meth:`SystemdClient._reopen_and_resume` gives it up,
        dbus-fast's connect closes its socket)."""
        self._attempt = attempt
        self._timer = self._clock.callLater(RECONNECT_ATTEMPT_S, self._due)
        return (
            Deferred.fromFuture(attempt)
            .addBoth(self._ended)
            .addErrback(_translate_failure)
        )

    def bus_answered(self) -> None:
        """The bus answered (``AddMatch``, a check): it lives this period,
        and the manager is waited for."""
        self._answered = self._waiting = True

    def _due(self) -> None:
        """A period is over: the attempt is cancelled if the bus did not
        answer in it, else the bus is asked again, for the next."""
        assert self._attempt is not None
        self._periods += 1
        if not self._answered:
            self._why = self._said_why()
            self._attempt.cancel()
            return
        if self._periods == 1:
            log.info(
                "the systemd manager has not answered the {what} within"
                " {seconds:g} s, and its bus answers: waiting for the"
                " manager (a long daemon-reexec?) while the bus answers a"
                " check every {seconds:g} s",
                what=self._what,
                seconds=RECONNECT_ATTEMPT_S,
            )
        self._answered = False
        self._check = Deferred.fromFuture(asyncio.ensure_future(self._probe()))
        # A check that fails (its bus closed) leaves the period unanswered;
        # the attempt fails of that close itself.
        self._check.addCallbacks(lambda _: self.bus_answered(), lambda _: None)
        self._timer = self._clock.callLater(RECONNECT_ATTEMPT_S, self._due)

    def _said_why(self) -> str:
        """Why the attempt is abandoned, in its own words."""
        if not self._waiting:
            return (
                f"the bus did not complete the {self._what} within"
                f" {RECONNECT_ATTEMPT_S:g} s; abandoned"
            )
        waited = self._periods * RECONNECT_ATTEMPT_S
        return (
            f"the bus did not answer within {RECONNECT_ATTEMPT_S:g} s while the"
            f" {self._what} waited {waited:g} s for the systemd manager; abandoned"
        )

    def _ended(self, result: Failure | None) -> Failure | None:
        if self._check is not None:
            self._check.cancel()  # (no task left waiting on a stalled bus)
        timer = self._timer
        if timer is not None and timer.active():  # ended in time
            timer.cancel()
            return result
        if isinstance(result, Failure) and self._why is not None:
            raise connection_lost(self._why)  # cancelled by the bound
        return result


def _one_unit(patterns: list[str]) -> str | None:
    """The unit that ``patterns`` name, if one pattern names one unit
    (no glob characters, which ``ListUnitsByPatterns`` matches)."""
    if len(patterns) == 1 and not any(glob in patterns[0] for glob in "*?["):
        return patterns[0]
    return None


def _no_manager(reply: Message) -> bool:
    """Whether the bus's error ``reply`` to a call of the manager says there
    is no manager on it (nor one it can start)."""
    name = reply.error_name or ""
    return name in _NO_MANAGER or name.startswith(SPAWN_FAILED)


def _why_lost(error: Exception) -> str:
    """What a client is told of a call lost with its connection: the
    error's own words, else what its kind means (dbus-fast raises a bare
    EOFError when the bus closes), never a Python class name alone, nor
    an errno's number ("[Errno 32] Broken pipe": the errno's words)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if str(error):
        return str(error)
    if isinstance(error, (EOFError, ConnectionError)):
        return "the D-Bus connection closed"
    return f"the D-Bus connection failed ({type(error).__name__})"


def _translate_failure(failure: Failure) -> Failure:
    """A D-Bus error reply as a :class:`SystemdError`; any other failure as
    it is."""
    error = failure.value
    if isinstance(error, DBusError):
        raise SystemdError(error.type, error.text) from error
    return failure


def _unwrapped(value: object) -> object:
    """``value`` (a call's arguments) with each :class:`Variant` replaced
    by what it holds, for ``[systemd] sdbus-debug``: a property reads
    ``('Description', '/bin/true')``, not ``('Description',
    <dbus_fast.signature.Variant ('s', /bin/true)>)``."""
    if isinstance(value, Variant):
        return _unwrapped(value.value)
    if isinstance(value, list):
        return [_unwrapped(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_unwrapped(item) for item in value)
    if isinstance(value, dict):
        return {key: _unwrapped(item) for key, item in value.items()}
    return value
