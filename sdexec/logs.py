"""Logs that fit where they go: the journal, or a log shipper.

twistd logs each event as a timestamped line to standard output (``-n``).
Under systemd that is the journal, which stamps every line itself and reads
a ``<N>`` syslog priority prefix (``SyslogLevelPrefix=yes``, the default),
so that ``journalctl -p warning`` finds the warnings. :func:`log_observer`
picks, once at start:

- ``[sdexec] log-format = "json"``: Twisted's JSON log observer (one
  record-separated JSON object per event), for log shippers;
- else, when standard output *is* the journal (``$JOURNAL_STREAM`` names its
  device and inode, systemd.exec(5)): one ``<N>``-prefixed line per event
  line, no timestamp;
- else ``None``: twistd's own text lines.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import IO, Any

from twisted.application.service import IServiceCollection, MultiService
from twisted.logger import (
    FileLogObserver,
    ILogObserver,
    Logger,
    LogLevel,
    formatEvent,
    jsonFileLogObserver,
)

from sdexec.refusal import NAMED, first_named

__all__ = [
    "journal_observer",
    "log_observer",
    "named_in_log",
    "stream_is_journal",
    "with_observer",
]

#: syslog(3) priorities, as journald reads them from a ``<N>`` prefix.
PRIORITY = {
    LogLevel.critical: 2,
    LogLevel.error: 3,
    LogLevel.warn: 4,
    LogLevel.info: 6,
    LogLevel.debug: 7,
}


def stream_is_journal(stream: IO[Any], environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is the journal stream systemd connected
    (``JOURNAL_STREAM=DEVICE:INODE``)."""
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        status = os.fstat(stream.fileno())
    except (OSError, ValueError):  # closed, or not a file at all
        return False
    return (status.st_dev, status.st_ino) == (int(device), int(inode))


def named_in_log(log: Logger, names: Sequence[str], what: str, sep: str = ", ") -> str:
    """``names`` as a log line names them (:func:`~sdexec.refusal.first_named`:
    the first few, and how many more); where some are left out, every one
    is said on ``log`` in a debug line of its own, ``WHAT (all N): NAMES``,
    for the admin who needs each (``journalctl -p debug``)."""
    if len(names) > NAMED:
        log.debug(
            "{what} (all {count}): {names}",
            what=what,
            count=len(names),
            names=sep.join(names),
        )
    return first_named(names, sep)


def _journal_lines(event: dict) -> str | None:
    text = formatEvent(event)
    failure = event.get("log_failure")
    if failure is not None:
        text = f"{text}\n{failure.getTraceback()}"
    priority = PRIORITY.get(event.get("log_level", LogLevel.info), 6)
    source = event.get("log_namespace", "-")
    # journald makes one entry per line: each carries the priority.
    return "".join(f"<{priority}>[{source}] {line}\n" for line in text.splitlines())


def journal_observer(stream: IO[Any]) -> FileLogObserver:
    """Events as ``<N>[namespace] message`` lines, for the journal."""
    return FileLogObserver(stream, _journal_lines)


def log_observer(
    log_format: str, stream: IO[Any], environ: Mapping[str, str]
) -> FileLogObserver | None:
    """The observer for ``log_format`` on ``stream``; ``None`` for
    twistd's own."""
    if log_format == "json":
        return jsonFileLogObserver(stream)
    if stream_is_journal(stream, environ):
        return journal_observer(stream)
    return None


def with_observer(service: Any, observer: FileLogObserver | None) -> Any:
    """``service``, set up so that twistd logs to ``observer``: twistd takes
    the ``ILogObserver`` component of its application, which the plugin only
    meets when the service is added to it."""
    if observer is None:
        return service
    wrapper = _LoggingService(observer)
    service.setServiceParent(wrapper)
    return wrapper


class _LoggingService(MultiService):
    """Sets its log observer on the application it joins."""

    def __init__(self, observer: FileLogObserver) -> None:
        super().__init__()
        self.observer = observer

    def setServiceParent(self, parent: IServiceCollection) -> None:
        parent.setComponent(ILogObserver, self.observer)  # type: ignore[attr-defined]
        super().setServiceParent(parent)
