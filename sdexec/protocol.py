"""The wire protocol's names and defaults, written once (docs/protocol.md).

Everything both ends of a connection must agree on lives here: the
``sdexec.exec`` flags, the topics, the default stdin credit, the frame size
limit, the default socket path. The service (``sdexec.server``), the Twisted
client library (``sdexec.client``), the command line and the tests import
these names; none of them writes the values again. This module imports
nothing but the standard library, so a lean client can use it without
loading Twisted. The names that need no enum are written in
:mod:`sdexec.protocolbase`, for the command line's early exec, and
exported from here as well.
"""

from __future__ import annotations

import enum

from sdexec.protocolbase import (
    DEFAULT_SOCKET_SUBPATH,
    SOCKET_ENV,
    SYSTEM_SOCKET,
    command_object,
    default_socket_path,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DEFAULT_OUTPUT_BUFSIZE",
    "DEFAULT_SOCKET_SUBPATH",
    "DEFAULT_STDIN_BUFSIZE",
    "SOCKET_ENV",
    "SYSTEM_SOCKET",
    "WRITE_PIECE",
    "ExecFlag",
    "Topic",
    "command_object",
    "default_socket_path",
]


#: The most stdin data one ``sdexec.write`` carries: its JSON is at most 6
#: bytes a byte (``\u0001``), so 768 KiB and the envelope fit the smallest
#: ``max-frame-size`` a service may have (1M). A client sends a larger write
#: in pieces of it: one longer message made the service drop the
#: connection, and every process on it.
WRITE_PIECE = 128 * 1024


class ExecFlag(enum.IntFlag):
    """The ``flags`` of an ``sdexec.exec`` request (RFC 42)."""

    STDOUT = 1
    STDERR = 2
    CHANNEL = 4
    WRITE_CREDIT = 8
    WAITABLE = 16


class Topic(enum.StrEnum):
    """Request topics the service answers."""

    EXEC = "sdexec.exec"
    WRITE = "sdexec.write"
    KILL = "sdexec.kill"
    LIST = "sdexec.list"
    STATS = "sdexec.stats-get"
    UNDRAIN = "sdexec.undrain"
    WAIT = "sdexec.wait"
    ATTACH = "sdexec.attach"
    TERMINATE = "sdexec.terminate"


#: A ``sdexec.wait`` payload's key (an extension, docs/protocol.md): true
#: asks for the status and output beside an error that ended the stream
#: after ``finished``, which is otherwise the answer alone, as upstream's.
STATUS_AND_ERROR = "status_and_error"

#: What a client may send before the first ``add-credit`` unless the
#: command's ``stdin_BUFSIZE`` option says otherwise.
DEFAULT_STDIN_BUFSIZE = 4096
#: The most output one message carries unless the command's
#: ``stdout_BUFSIZE`` or ``stderr_BUFSIZE`` option says otherwise.
DEFAULT_OUTPUT_BUFSIZE = 1024 * 1024
#: The largest message either end accepts unless configured otherwise.
DEFAULT_MAX_FRAME = 64 * 1024 * 1024


def target_named(key: str, value: object) -> str:
    """A ``kill`` or ``terminate`` target as its ``errstr`` names it:
    ``pid=5``, ``label=job``. A value that is empty or holds a character
    that is not printable (a line break, an escape code) is written as
    ``repr`` writes it (``label='a\\nb'``, ``label=''``), so the message
    stays one line that shows it; any other is left bare, as ``sdexec
    cancel`` of another version compares it (:func:`terminate_not_found`)."""
    text = str(value)
    return f"{key}={text if text.isprintable() and text else repr(text)}"


def terminate_runs_no_job(key: str, value: object) -> str:
    """The ``errstr`` (with ``EINVAL``) of an ``sdexec.terminate`` whose
    process target runs no job: ``sdexec cancel N`` then tries job id N."""
    return f"{target_named(key, value)} runs no job (exec it with SDEXEC_JOBID)"


def terminate_not_found(key: str, value: object) -> str:
    """The ``errstr`` (with ``ESRCH``) of an ``sdexec.terminate`` whose
    target names no job. ``sdexec cancel`` tells it from a job that was
    found and has ended (``ESRCH`` too), which it must not hide."""
    return f"terminate {target_named(key, value)} not found"
