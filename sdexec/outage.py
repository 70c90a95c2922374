"""What the service does while systemd is away.

The systemd client reconnects by itself (``sdexec.systemd.bus``); requests
meanwhile get EAGAIN "reconnecting to systemd". The service drains only if
systemd stays away longer than ``[systemd] reconnect-timeout``, and lifts
that drain, and no other, when systemd is back (sdexec/drain.py). Once
back, every tracked process re-reads its unit.

The one timer is a ``callLater`` on the server's clock: tested on a
``Clock`` (test/test_outage.py).
"""

from __future__ import annotations

from twisted.internet.interfaces import IDelayedCall

from sdexec.drain import SelfLifting
from sdexec.server import SdexecServer
from sdexec.systemd import MANAGER_LEFT

__all__ = ["SystemdOutage"]


class SystemdOutage:
    """Connects a systemd client's ``on_lost``/``on_restored`` to the server."""

    def __init__(self, server: SdexecServer) -> None:
        self._server = server
        self._timer: IDelayedCall | None = None
        self._stopped = False

    def lost(self, reason: str) -> None:
        """systemd went away: drain if it is not back in time (not once the
        service stops: it waits for its units meanwhile, and would drain a
        stopped server)."""
        self._server.count("systemd-losses")
        self._server.jobs.systemd_lost()
        if reason == MANAGER_LEFT:
            # A start it accepted and had not run may be dropped with it.
            for process in list(self._server.processes.values()):
                process.manager_left()
        if self._timer is not None or self._stopped:
            return
        timeout = self._server.config.systemd.reconnect_timeout
        self._timer = self._server.clock.callLater(
            timeout, self._drain, f"systemd unreachable for {timeout:g} s: {reason}"
        )

    def restored(self) -> None:
        """systemd is back: lift this drain (no other), resync processes."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._server.lift(SelfLifting.OUTAGE)
        self._server.systemd_restored()

    def stop(self) -> None:
        """The service stops: no drain later."""
        self._stopped = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _drain(self, reason: str) -> None:
        self._timer = None
        self._server.drain(reason, SelfLifting.OUTAGE)
