"""The environment a job gets: the client's, minus what describes the
*caller's* place in systemd.

systemd sets variables in every process it spawns that point at that
process's own unit, manager, sockets and directories (systemd.exec(5),
"Environment Variables in Spawned Processes"). A client started by systemd
has them, and would pass them on in ``cmd.env``: a job holding another
unit's ``NOTIFY_SOCKET`` could send notifications as that unit (Flux's
sdexec drops ``NOTIFY_SOCKET`` and ``INVOCATION_ID`` for this reason).
sdexec drops them all (:data:`DROPPED_ENVIRONMENT`); systemd sets the job's
own where they apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = [
    "DROPPED_ENVIRONMENT",
    "DROPPED_ENVIRONMENT_PREFIXES",
    "clean_environment",
]

#: Variables systemd sets in the processes it spawns that describe the
#: caller's own unit, manager, sockets or directories (systemd.exec(5),
#: "Environment Variables in Spawned Processes"). Passed on from a client
#: they would point the job at someone else's notification socket, fds,
#: journal stream, watchdog or credentials; systemd sets the job's own where
#: they apply.
DROPPED_ENVIRONMENT: Final = frozenset(
    {
        "NOTIFY_SOCKET",
        "INVOCATION_ID",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "JOURNAL_STREAM",
        "MANAGERPID",
        "SYSTEMD_EXEC_PID",
        "MAINPID",
        "WATCHDOG_PID",
        "WATCHDOG_USEC",
        "FDSTORE",
        "PIDFILE",
        "MEMORY_PRESSURE_WATCH",
        "MEMORY_PRESSURE_WRITE",
        "CREDENTIALS_DIRECTORY",
        "RUNTIME_DIRECTORY",
        "STATE_DIRECTORY",
        "CACHE_DIRECTORY",
        "LOGS_DIRECTORY",
        "CONFIGURATION_DIRECTORY",
        "SERVICE_RESULT",
        "EXIT_CODE",
        "EXIT_STATUS",
        "REMOTE_ADDR",
        "REMOTE_PORT",
        "TRIGGER_UNIT",
        "TRIGGER_PATH",
        "LOG_NAMESPACE",
    }
)
#: Prefixes of the families of such variables (``MONITOR_SERVICE_RESULT``,
#: ``TRIGGER_TIMER_REALTIME_USEC``…).
DROPPED_ENVIRONMENT_PREFIXES: Final = ("MONITOR_", "TRIGGER_TIMER_")


def clean_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without :data:`DROPPED_ENVIRONMENT` and the
    :data:`DROPPED_ENVIRONMENT_PREFIXES` families; order kept."""
    return {name: value for name, value in env.items() if not _dropped(name)}


def _dropped(name: str) -> bool:
    return name in DROPPED_ENVIRONMENT or name.startswith(DROPPED_ENVIRONMENT_PREFIXES)
