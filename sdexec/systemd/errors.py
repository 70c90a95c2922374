"""systemd's refusals as errnos and messages a client can act on.

A D-Bus error has a name (``org.freedesktop.DBus.Error.InvalidArgs``) and a
text; RFC 42 clients want an errno. The table and the reading of systemd's
error text live here, next to the bus client that raises them.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from sdexec.managerversion import manager_named, version_number
from sdexec.property import JUDGED_LISTS, UnitProperty, shown_value

if TYPE_CHECKING:
    from twisted.python.failure import Failure

__all__ = [
    "BUS_TIMEOUT",
    "CONNECTION_LOST",
    "DBUS_ERRNO",
    "MANAGER_AWAY",
    "NO_BUS_ADDRESS",
    "NO_SUCH_UNIT",
    "RECONNECTING",
    "UNIT_EXISTS",
    "SystemdError",
    "connection_lost",
    "errno_for",
    "explain_start_refusal",
    "failure_value",
    "is_connection_lost",
    "is_process_gone",
    "is_unit_gone",
    "manager_away",
    "never_sent",
    "not_taken_property",
    "reconnecting",
    "start_lost",
    "start_lost_in_flight",
    "start_may_have_run",
    "start_timed_out",
]

#: A call that was sent, or queued, when the bus or the manager went away:
#: its outcome is unknown. Retrying after the reconnection may succeed.
CONNECTION_LOST = "sdexec.ConnectionLost"
#: A call made while the service reconnects: not sent at all.
RECONNECTING = "sdexec.Reconnecting"
#: A call the bus answered for a manager not on it (``NameHasNoOwner``, or
#: ``ServiceUnknown`` where it may activate it): the manager left, or has
#: not come back yet. Retrying once it is back may succeed.
MANAGER_AWAY = "sdexec.ManagerAway"
#: No bus address to try, or one that is not an address: every start of the
#: service fails the same way until its environment changes.
NO_BUS_ADDRESS = "sdexec.NoBusAddress"
#: A start of a unit whose name a loaded unit has.
UNIT_EXISTS = "org.freedesktop.systemd1.UnitExists"
#: A call on a unit systemd no longer has loaded ("Unit X not loaded."): it
#: ended and was unloaded meanwhile.
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
#: A signal for a unit's main process when it has none (it exited).
NO_SUCH_PROCESS = "org.freedesktop.systemd1.NoSuchProcess"
#: sd-bus's name for ETIMEDOUT: systemd's answer to a call it served with a
#: call of its own to the bus that timed out (sd-bus's 25 s), on a bus
#: stalled or flooded meanwhile.
BUS_TIMEOUT = "org.freedesktop.DBus.Error.Timeout"

#: The errno of a systemd call that failed for a reason :data:`DBUS_ERRNO`
#: has no errno for: the remote end (systemd) failed it. Not EIO, which
#: Flux's job-exec reads from sdexec as a failed containment check (it
#: drains the node): a start refused so is an ordinary exec failure.
UNNAMED_ERRNO = errno.EREMOTEIO

#: The errno a client sees for a D-Bus error name; anything else is
#: :data:`UNNAMED_ERRNO`.
DBUS_ERRNO = {
    "org.freedesktop.DBus.Error.InvalidArgs": errno.EINVAL,
    # An unknown property: "Cannot set property NoSuch, or unknown property."
    "org.freedesktop.DBus.Error.PropertyReadOnly": errno.EINVAL,
    "org.freedesktop.DBus.Error.UnknownProperty": errno.EINVAL,
    UNIT_EXISTS: errno.EEXIST,
    "org.freedesktop.DBus.Error.AccessDenied": errno.EPERM,
    # A signal for a process whose unit is gone: as kill(2) says of a pid.
    NO_SUCH_UNIT: errno.ESRCH,
    # KillUnit "main" of a unit whose main process has exited, its
    # children lingering: "No main process to kill".
    NO_SUCH_PROCESS: errno.ESRCH,
    CONNECTION_LOST: errno.EAGAIN,
    RECONNECTING: errno.EAGAIN,
    MANAGER_AWAY: errno.EAGAIN,
}


class SystemdError(Exception):
    """A D-Bus call failed; ``name`` is the D-Bus error name, ``errno`` what
    a client is told (from :data:`DBUS_ERRNO`, else :data:`UNNAMED_ERRNO`)."""

    def __init__(self, name: str, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.name = name
        self.message = message
        #: What the bus said, where ``message`` is sdexec's words around it.
        self.detail = detail
        self.errno = DBUS_ERRNO.get(name, UNNAMED_ERRNO)


def connection_lost(detail: str = "") -> SystemdError:
    """The error of a call lost with the connection (EAGAIN)."""
    suffix = f": {detail}" if detail else ""
    return SystemdError(CONNECTION_LOST, f"systemd connection lost{suffix}")


def manager_away(detail: str) -> SystemdError:
    """The error of a call the bus answered for a manager not on it
    (EAGAIN)."""
    return SystemdError(
        MANAGER_AWAY,
        f"systemd connection lost: the manager is not on the bus ({detail})",
        detail,
    )


def reconnecting() -> SystemdError:
    """The error of a call made while reconnecting (EAGAIN)."""
    return SystemdError(RECONNECTING, "reconnecting to systemd")


def never_sent(reason: str) -> SystemdError:
    """The error of a call still queued in the call window when the
    connection was lost (EAGAIN): it never reached systemd, so nothing it
    asked for was done (a start: nothing was started), and a retry is
    safe; unlike a call lost in flight (:func:`connection_lost`)."""
    return SystemdError(
        RECONNECTING,
        f"systemd connection lost before the call was sent ({reason}):"
        " it was never made, retry",
    )


def failure_value(failure: Failure) -> BaseException:
    """The exception ``failure`` carries: a Failure is never made without
    one, though Twisted's untyped ``__init__`` leaves it ``None`` to mypy
    at first."""
    error = failure.value
    assert error is not None, "a Failure always carries its exception"
    return error


def is_connection_lost(error: BaseException) -> bool:
    """Whether a call failed only because systemd was away: it may be made
    again once the connection is back."""
    return isinstance(error, SystemdError) and error.name in (
        CONNECTION_LOST,
        RECONNECTING,
        MANAGER_AWAY,
    )


def is_unit_gone(error: BaseException) -> bool:
    """Whether a call failed because its unit is no longer loaded: nothing
    is left to signal or stop."""
    return isinstance(error, SystemdError) and error.name == NO_SUCH_UNIT


def is_process_gone(error: BaseException) -> bool:
    """Whether a kill failed because no process it names is left (the main
    one exited, or every one)."""
    return isinstance(error, SystemdError) and error.name == NO_SUCH_PROCESS


def errno_for(error: BaseException) -> int:
    """The errno for any failure of a systemd call (:data:`UNNAMED_ERRNO`
    unless systemd named one)."""
    return error.errno if isinstance(error, SystemdError) else UNNAMED_ERRNO


def start_refusal_errno(error: BaseException) -> int:
    """The errno for systemd's refusal of a ``StartTransientUnit``: as
    :func:`errno_for`, but a unit it does not know is one the new unit
    names (a dependency: the new one does not exist yet), and nothing was
    started: ``ENOENT``, as sd-bus maps NoSuchUnit and so upstream's sdexec
    reads it, where a signal for a unit gone is ``ESRCH``; and ``EAGAIN``
    for a start that :func:`start_may_have_run`, as for one lost with the
    connection."""
    if isinstance(error, SystemdError) and error.name == NO_SUCH_UNIT:
        return errno.ENOENT
    if start_may_have_run(error):
        return errno.EAGAIN
    return errno_for(error)


def start_may_have_run(error: BaseException) -> bool:
    """Whether systemd's error answer to a ``StartTransientUnit`` leaves
    unknown whether it started the unit: a :data:`BUS_TIMEOUT`. systemd
    serves a start with calls of its own to the bus, for the caller's
    credentials before it makes the unit and to track the job's caller
    once it has queued the job: the unit runs if the later one timed out
    (seen on the sandbox manager under a burst, its dbus-daemon stopped
    for 32 s: the unit was found as a leftover). Not a refusal, then, but
    a start whose answer was lost."""
    return isinstance(error, SystemdError) and error.name == BUS_TIMEOUT


def start_timed_out(detail: str) -> str:
    """What a client is told of a start that :func:`start_may_have_run`;
    ``detail``: systemd's words ("Connection timed out")."""
    return (
        "systemd's own call to the bus timed out while it started the unit"
        f" ({detail}: the bus may be stalled or flooded); the unit may have"
        " been started, and is then found and stopped as a leftover: retry"
    )


def start_lost_in_flight(error: BaseException) -> bool:
    """Whether a ``StartTransientUnit`` failed as the connection was lost
    with it in flight: sent, and its answer lost, so systemd may have run
    it (seen in a soak: a passthrough command wrote all its output while
    its client was told only "systemd connection lost"). Not one refused
    before it was sent (:func:`reconnecting`, :func:`never_sent`), nor one
    the bus answered for a manager not on it (:func:`manager_away`)."""
    return isinstance(error, SystemdError) and error.name == CONNECTION_LOST


def start_lost(message: str) -> str:
    """What a client is told of a start :func:`start_lost_in_flight`:
    ``message`` ("systemd connection lost: …") and that it may have run,
    so that a resource manager does not take it for a start refused."""
    return (
        f"{message}; the start was sent and its answer lost: the unit may"
        " have been started, and is then found as a leftover once systemd"
        " is back ([sdexec] leftover-units)"
    )


#: Properties sdexec itself sends as strings, from checked sources.
_OWN_STRING_PROPERTIES = frozenset({"Description", "WorkingDirectory", "Slice"})


def explain_start_refusal(
    message: str, properties: Iterable[UnitProperty], manager_version: str | None
) -> str:
    """systemd's refusal of a ``StartTransientUnit``, with what it leaves
    unnamed named: the string-valued property it calls an "Invalid
    argument", who set a property it does not take (and its version), the
    environment variable it calls an "Invalid environment
    block" (on a manager of ``manager_version`` that refuses control
    characters there, or one whose version is not known)."""
    properties = list(properties)
    message = _name_string_properties(message, properties)
    message = _name_who_set_it(message, properties, manager_version)
    number = version_number(manager_version)
    if number is None or number < _CONTROL_CHARACTERS_TAKEN:
        message = _name_control_characters(message, properties)
    return message


#: systemd's refusal of a property it does not take on a transient service:
#: one newer than the manager, or not a service's (bus_unit_set_properties).
_NOT_TAKEN = re.compile(r"Cannot set property (\S+), or unknown property")

#: Who set a property, as a refusal names it (the plan's sources).
_SET_BY = {
    "config": "exec.sdexec-properties sets it",
    "request": "the request sets it",
    "containment": "containment (the mapper) sets it",
}


def not_taken_property(
    message: str, properties: Iterable[UnitProperty]
) -> UnitProperty | None:
    """The property sent that systemd's refusal ``message`` names as one it
    does not take, if any."""
    named = _NOT_TAKEN.search(message)
    if named is None:
        return None
    return next((prop for prop in properties if prop.name == named.group(1)), None)


def _name_who_set_it(
    message: str, properties: list[UnitProperty], manager_version: str | None
) -> str:
    """A property the manager does not take, with who set it and which
    systemd refused it (the refusal names neither)."""
    refused = not_taken_property(message, properties)
    if refused is None or refused.source not in _SET_BY:
        return message
    manager = manager_named(manager_version, "this systemd")
    return f"{message} ({_SET_BY[refused.source]}; {manager} does not take it)"


#: The first systemd that takes control characters in environment values.
_CONTROL_CHARACTERS_TAKEN = 248


def _name_control_characters(message: str, properties: list[UnitProperty]) -> str:
    """systemd before 248 refuses a whole unit whose environment has a
    value with a control character but tab and newline (the ESC a dotfile's
    ``LESS_TERMCAP_md`` or ``PS1`` holds) as an "Invalid environment block":
    name the first such variable."""
    if "Invalid environment block" not in message:
        return message
    for prop in properties:
        if prop.name != "Environment":
            continue
        for entry in prop.value:
            name, _, value = str(entry).partition("=")
            if any(_is_refused_control(character) for character in value):
                return (
                    f"{message} ({name} has a control character in its value,"
                    " which systemd before 248 refuses)"
                )
    return message


def _is_refused_control(character: str) -> bool:
    return (character < " " and character not in "\t\n") or character == "\x7f"


def _name_string_properties(message: str, properties: list[UnitProperty]) -> str:
    """systemd refuses a bad string-typed property (``DevicePolicy=bogus``),
    or a bad word of a list it judges alone (:data:`JUDGED_LISTS`), with a
    bare "Invalid argument", and a property it types otherwise that
    came as a string (one sdexec does not know the type of) with
    "Unexpected message contents", for every unit: name the candidates, so
    the error names the property as every other property error does."""
    # Not sdexec's own.
    given = [prop for prop in properties if prop.source in ("config", "request")]
    suspects = [
        f"{prop.name}={prop.value}"
        for prop in given
        if prop.signature == "s" and prop.name not in _OWN_STRING_PROPERTIES
    ]
    # Lists of words systemd judges alone refuse so too.
    judged = [f"{p.name}={shown_value(p)}" for p in given if p.name in JUDGED_LISTS]
    if any(s.split("=", 1)[0] in message for s in suspects + judged):
        return message
    if "Invalid argument" in message and (suspects or judged):
        kind = "these properties" if judged else "the string-valued properties"
        return f"{message} (one of {kind}: {', '.join(suspects + judged)})"
    if "Unexpected message contents" in message and suspects:
        return (
            f"{message} (systemd types one of these otherwise, and sdexec sent it"
            f" as a string: {', '.join(suspects)}; share/doc/sdexec/configuration.md"
            " lists the properties sdexec types)"
        )
    return message
