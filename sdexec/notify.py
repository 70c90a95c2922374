"""Telling systemd how the service is: the ``sd_notify`` protocol.

Under ``Type=notify`` systemd sets ``$NOTIFY_SOCKET`` to a datagram socket
and waits for ``READY=1`` before it calls the service started (and before
units ordered after it start). :class:`Readiness` sends ``READY=1`` once the
service listens and is connected to systemd, ``STATUS=`` whenever the
one-line status changes (``systemctl status`` shows it), ``RELOADING=1``
around a configuration reload and ``STOPPING=1`` on shutdown. With no
``$NOTIFY_SOCKET`` (run by hand, by tests, by another supervisor) every
message is dropped: the protocol is optional by design.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from sdexec.refusal import one_line
from sdexec.systemd.unanswered import Silence

__all__ = ["Readiness", "SystemdNotifier", "describe_server"]

log = Logger()

#: How often the status line is recomputed; it is sent only when it changed.
STATUS_INTERVAL_SECONDS = 1.0


def _socket_address(value: str) -> str | None:
    """``$NOTIFY_SOCKET`` as an ``AF_UNIX`` address: a path, or ``@name`` for
    the abstract namespace. Other kinds (``vsock:``) are not for a local
    daemon: None."""
    if value.startswith("/"):
        return value
    if value.startswith("@"):
        return "\0" + value[1:]
    return None


class SystemdNotifier:
    """Sends ``KEY=VALUE`` lines to ``$NOTIFY_SOCKET``; does nothing when it
    is unset."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        setting = environ.get("NOTIFY_SOCKET", "")
        self.address = _socket_address(setting) if setting else None
        if setting and self.address is None:
            log.warn(
                "NOTIFY_SOCKET={setting!r} is not a unix socket: not notifying",
                setting=setting,
            )
        self._socket: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """Whether ``NOTIFY_SOCKET`` names a socket to notify."""
        return self.address is not None

    def notify(self, **fields: object) -> None:
        """One datagram of ``KEY=VALUE`` lines (a key's underscores are
        sent as they are: ``MONOTONIC_USEC``). A failure is logged, never
        raised: systemd not listening must not stop the service."""
        if self.address is None:
            return
        message = "\n".join(
            f"{key}={one_line(str(value))}" for key, value in fields.items()
        )
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto(message.encode(), self.address)
        except OSError as error:
            # The address as the admin set NOTIFY_SOCKET ("@" for an abstract
            # one), and strerror: not Python's repr and "[Errno 111] ...".
            log.warn(
                "sd_notify to {address} failed: {error}",
                address=one_line(self.address.replace("\0", "@", 1)),
                error=error.strerror or error,
            )

    def close(self) -> None:
        """Close the notification socket; later notifications go nowhere."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


#: The most bytes of a drain's reason the status line carries, once
#: escaped for one line (well under 4096): systemd drops a notify message
#: of 4096 bytes or more whole (STATUS= and READY=1 with it), and a reason
#: joins every cause in force (/stats has it all).
STATUS_REASON_MAX = 1024


def describe_server(
    drain_reason: str | None, count: int, silence: Silence | None = None
) -> str:
    """The one-line status: ``serving N processes`` (``count``, as listed),
    or ``drained: REASON`` when the node is drained (a long reason cut,
    saying so), and what systemd has left unanswered for long (``silence``).
    Polled every second: from these, not from ``stats()``, which describes
    every process (30 ms with 2000 of them)."""
    if drain_reason is not None:
        # Escaped before it is cut: an escape is up to 6 bytes of one.
        reason = one_line(drain_reason)
        cut = reason.encode()[:STATUS_REASON_MAX].decode(errors="ignore")
        if cut != reason:  # bytes counted: 4-byte characters are 4
            reason = cut + "… (the rest in /stats)"
        status = f"drained: {reason}"
    else:
        status = f"serving {count} process{'' if count == 1 else 'es'}"
    if silence is not None:
        status += f"; {silence.describe()}"
    return status


class Readiness:
    """The service's side of ``Type=notify``.

    ``describe`` gives the current status line; it is polled every
    :data:`STATUS_INTERVAL_SECONDS` (a reactor timer, so tests drive it with
    a ``Clock``) and sent only when it changed.
    """

    def __init__(
        self,
        reactor: Any,
        describe: Callable[[], str],
        notifier: SystemdNotifier | None = None,
    ) -> None:
        self.notifier = notifier or SystemdNotifier()
        self._describe = describe
        self._status: str | None = None
        self._poll = LoopingCall(self._send_status_if_changed)
        self._poll.clock = reactor

    def ready(self) -> None:
        """Listening and connected: ``READY=1`` with the first status."""
        self._status = self._describe()
        self.notifier.notify(READY=1, STATUS=self._status)
        if self.notifier.enabled and not self._poll.running:
            self._poll.start(STATUS_INTERVAL_SECONDS, now=False)

    def reloading(self) -> None:
        """A reload begins; systemd wants the monotonic time with it."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notifier.notify(RELOADING=1, MONOTONIC_USEC=usec)

    def reloaded(self) -> None:
        """A reload ended, taken or refused: ready again."""
        self._status = self._describe()
        self.notifier.notify(READY=1, STATUS=self._status)

    def stopping(self) -> None:
        """Tell systemd the service is stopping, and send nothing more."""
        if self._poll.running:
            self._poll.stop()
        self.notifier.notify(STOPPING=1, STATUS="stopping")
        self.notifier.close()

    def _send_status_if_changed(self) -> None:
        status = self._describe()
        if status != self._status:
            self._status = status
            self.notifier.notify(STATUS=status)
