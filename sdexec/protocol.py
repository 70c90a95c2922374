"""The wire protocol's names and defaults, written once (docs/protocol.md).

Everything both ends of a connection must agree on lives here: the
``sdexec.exec`` flags, the topics, the default stdin credit, the frame size
limit, the default socket path. The service (``sdexec.server``), the Twisted
client library (``sdexec.client``), the command line and the tests import
these names; none of them writes the values again. This module imports
nothing but the standard library, so a lean client can use it without
loading Twisted.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DEFAULT_OUTPUT_BUFSIZE",
    "DEFAULT_SOCKET_SUBPATH",
    "DEFAULT_STDIN_BUFSIZE",
    "SOCKET_ENV",
    "ExecFlag",
    "Topic",
    "command_object",
    "default_socket_path",
]


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


#: What a client may send before the first ``add-credit`` unless the
#: command's ``stdin_BUFSIZE`` option says otherwise.
DEFAULT_STDIN_BUFSIZE = 4096
#: The most output one message carries unless the command's
#: ``stdout_BUFSIZE`` or ``stderr_BUFSIZE`` option says otherwise.
DEFAULT_OUTPUT_BUFSIZE = 1024 * 1024
#: The largest message either end accepts unless configured otherwise.
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
#: Where the service listens by default, under ``$XDG_RUNTIME_DIR``.
DEFAULT_SOCKET_SUBPATH = os.path.join("sdexec", "sdexec.sock")
#: The environment variable naming the service's socket (clients).
SOCKET_ENV = "SDEXEC_SOCKET"
#: Where the system unit (etc/sdexec-system.service) serves: its
#: ``XDG_RUNTIME_DIR`` is ``/run``.
SYSTEM_SOCKET = os.path.join("/run", DEFAULT_SOCKET_SUBPATH)


def default_socket_path(environ: Mapping[str, str] | None = None) -> str | None:
    """``$XDG_RUNTIME_DIR/sdexec/sdexec.sock``, or ``None`` when
    ``XDG_RUNTIME_DIR`` is unset (each caller says what that means for it)."""
    runtime_dir = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    if not runtime_dir:
        return None
    return os.path.join(runtime_dir, DEFAULT_SOCKET_SUBPATH)


def command_object(
    cmdline: Sequence[str],
    env: Mapping[str, str],
    opts: Mapping[str, str] | None = None,
    cwd: str | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """RFC 42's command object (``cmd`` of an ``sdexec.exec`` request);
    ``cwd`` and ``label`` only when given."""
    command: dict[str, Any] = {
        "cmdline": list(cmdline),
        "env": dict(env),
        "opts": dict(opts or {}),
        "channels": [],
    }
    if cwd is not None:
        command["cwd"] = cwd
    if label is not None:
        command["label"] = label
    return command


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
