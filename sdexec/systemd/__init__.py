"""The systemd layer: everything that talks to systemd, or hands it what
it needs, below the rest of the service (it imports none of it: a test
checks).

- :mod:`sdexec.systemd.bus`: the bus client (:class:`SystemdClient`); the
  only module that imports dbus-fast or asyncio.
- :mod:`sdexec.systemd.watch`: a unit's property watch (:class:`UnitWatch`)
  and the registry that dispatches each signal to it.
- :mod:`sdexec.systemd.window`: :class:`CallWindow`, the bound on method
  calls awaiting their reply (``max-inflight``), the others queued in
  lanes served in turn.
- :mod:`sdexec.systemd.unanswered`: the calls awaiting the manager's answer
  (:class:`UnansweredCalls`), a warning when the manager has left one
  unanswered too long, and the oldest one (:class:`Silence`) for the stats.
- :mod:`sdexec.systemd.retry`: the backoff of the reconnection to a bus or
  manager that went away, and of unit calls systemd refused
  (:class:`CallBackoff`), with the one reading of why a call failed
  (:func:`classify_call_failure`).
- :mod:`sdexec.systemd.errors`: :class:`SystemdError` with its errno, and the
  reading of systemd's refusals.
- :mod:`sdexec.systemd.unit`: unit properties read as a process's life
  (:class:`UnitStatus`).
- :mod:`sdexec.systemd.channel`: the socketpairs whose ends systemd gets as
  the process's stdin, stdout and stderr. Plain sockets and Twisted
  protocols, no D-Bus: here because those ends are what
  ``StartTransientUnit`` is handed, and what systemd holds until the unit
  stops (the channel sees EOF only then).
- :mod:`sdexec.systemd.manager`: :class:`Manager`, the surface of the client
  the service uses (what :mod:`sdexec.testing` fakes).

Property *typing* (strings to D-Bus signatures) is :mod:`sdexec.property`;
only :func:`~sdexec.systemd.bus.to_variants` here turns it into dbus-fast
values.
"""

from sdexec.systemd.bus import (
    MANAGER_LEFT,
    SystemdClient,
    UnitWatch,
    session_bus_address,
    unit_object_path,
)
from sdexec.systemd.errors import (
    SystemdError,
    errno_for,
    explain_start_refusal,
    not_taken_property,
)
from sdexec.systemd.manager import Manager, Watch
from sdexec.systemd.unit import UnitStatus, queued_job, wait_status

__all__ = [
    "MANAGER_LEFT",
    "Manager",
    "SystemdClient",
    "SystemdError",
    "UnitStatus",
    "UnitWatch",
    "Watch",
    "errno_for",
    "explain_start_refusal",
    "not_taken_property",
    "queued_job",
    "session_bus_address",
    "unit_object_path",
    "wait_status",
]
