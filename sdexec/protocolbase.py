"""The protocol's names, defaults and shapes, in plain values.

Re-exported by :mod:`sdexec.protocol`, which adds the enums
(:class:`~sdexec.protocol.ExecFlag`, :class:`~sdexec.protocol.Topic`) made
of :class:`ExecFlags` and :class:`Topics`. The command line imports this
module alone: its ``run`` loads no ``enum`` (2.5 ms of a start-up of
about 20, docs/performance.md), and its early exec
(:mod:`sdexec.earlyexec`) needs nothing beyond ``os`` and the socket.
"""

from __future__ import annotations

import _socket
import os
import sys

from sdexec.refusal import SHOWN, json_quoted, printable, quoted

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import signal
    from collections.abc import Mapping, Sequence
    from typing import Any, TypeGuard
else:
    import _signal as signal  # the C core: signal's enums load enum

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DEFAULT_OUTPUT_BUFSIZE",
    "DEFAULT_SOCKET_SUBPATH",
    "DEFAULT_STDIN_BUFSIZE",
    "MAX_MATCHTAG",
    "MAX_SOCKET_PATH",
    "NOT_WAITABLE",
    "SOCKET_ENV",
    "STATUS_AND_ERROR",
    "SYSTEM_SOCKET",
    "UNIT_NAME_PREFIX",
    "WRITE_PIECE",
    "ExecFlags",
    "Topics",
    "chosen_socket_path",
    "command_object",
    "default_socket_path",
    "ended_and_kept",
    "is_signal_number",
    "job_of_unit_name",
    "passed_fds",
    "signum_refused",
    "target_named",
    "terminate_not_found",
    "terminate_runs_no_job",
]

#: Where the service listens by default, under ``$XDG_RUNTIME_DIR``.
DEFAULT_SOCKET_SUBPATH = os.path.join("sdexec", "sdexec.sock")
#: The longest path a UNIX socket may have (Linux's ``sun_path`` less its NUL).
MAX_SOCKET_PATH = 107
#: The environment variable naming the service's socket (clients).
SOCKET_ENV = "SDEXEC_SOCKET"
#: Where the system unit (etc/sdexec-system.service) serves: its
#: ``XDG_RUNTIME_DIR`` is ``/run``.
SYSTEM_SOCKET = os.path.join("/run", DEFAULT_SOCKET_SUBPATH)


#: The most stdin data one ``sdexec.write`` carries: its JSON is at most 6
#: bytes a byte (``\u0001``), so 768 KiB and the envelope fit the smallest
#: ``max-frame-size`` a service may have (1M). A client sends a larger write
#: in pieces of it: one longer message made the service drop the
#: connection, and every process on it.
WRITE_PIECE = 128 * 1024


class ExecFlags:
    """The ``flags`` of an ``sdexec.exec`` request (RFC 42), as plain
    integers: the values of :class:`sdexec.protocol.ExecFlag`."""

    STDOUT = 1
    STDERR = 2
    CHANNEL = 4
    WRITE_CREDIT = 8
    WAITABLE = 16


class Topics:
    """The request topics the service answers, as plain strings: the values
    of :class:`sdexec.protocol.Topic`."""

    EXEC = "sdexec.exec"
    WRITE = "sdexec.write"
    KILL = "sdexec.kill"
    LIST = "sdexec.list"
    STATS = "sdexec.stats-get"
    UNDRAIN = "sdexec.undrain"
    WAIT = "sdexec.wait"
    ATTACH = "sdexec.attach"
    TERMINATE = "sdexec.terminate"
    #: An sdexec extension (docs/protocol.md): the owner's reload, answered
    #: with its outcome.
    RELOAD = "sdexec.reload"


#: A ``sdexec.wait`` payload's key (an extension, docs/protocol.md): true
#: asks for the status and output beside an error that ended the stream
#: after ``finished``, which is otherwise the answer alone, as upstream's.
STATUS_AND_ERROR = "status_and_error"

#: The processes an ``sdexec.kill``'s ``who`` may name (an extension,
#: docs/protocol.md): its unit's main process, or every process of it.
KILL_WHO = ("all", "main")
#: What a client may send before the first ``add-credit`` unless the
#: command's ``stdin_BUFSIZE`` option says otherwise.
DEFAULT_STDIN_BUFSIZE = 4096
#: The most output one message carries unless the command's
#: ``stdout_BUFSIZE`` or ``stderr_BUFSIZE`` option says otherwise.
DEFAULT_OUTPUT_BUFSIZE = 1024 * 1024
#: The largest matchtag: Flux's is a uint32 (RFC 6); a request numbered past
#: it could not be answered on it by Flux's broker, and sdexec refuses it.
MAX_MATCHTAG = 2**32 - 1
#: The largest message either end accepts unless configured otherwise.
DEFAULT_MAX_FRAME = 64 * 1024 * 1024


def is_signal_number(signum: object) -> TypeGuard[int]:
    """Whether a kill's ``signum`` is a signal number it may carry: an
    integer (not a bool) from 1 to ``NSIG - 1``, what systemd's
    ``KillUnit`` takes. The service refuses any other (``EINVAL``), and
    the library at the call (``ValueError``: a kill held for ``started``
    was refused only once the process ran), both in the words of
    :func:`signum_refused`."""
    if isinstance(signum, bool) or not isinstance(signum, int):
        return False
    return 0 < signum < signal.NSIG


def signum_refused(signum: object) -> str:
    """Why ``signum`` is no :func:`is_signal_number`, naming it:
    ``signum: expected a signal number from 1 to 64, got 0``."""
    return (
        f"signum: expected a signal number from 1 to {signal.NSIG - 1},"
        f" got {json_quoted(signum)}"
    )


#: How the name the service gives a unit begins (``sdexec.plan.unit_name_for``).
UNIT_NAME_PREFIX = "sdexec-"
#: The hex digits of the random part that ends it (a uuid4's 32).
_RANDOM_DIGITS = frozenset("0123456789abcdef")


def job_of_unit_name(unit: str) -> str | None:
    """The job id a unit's name carries, ``sdexec-ID-RANDOM.service`` as the
    service names a unit for job ``ID`` (``SDEXEC_JOBID``, else
    ``FLUX_JOB_ID``), as the name carries it (each character systemd
    refuses in a name written ``_``, cut at 207); ``None`` for any other
    name (``SDEXEC_NAME``'s, or one the service gave a unit of no job)."""
    stem = unit.removesuffix(".service")
    head, _, random = stem.rpartition("-")
    if (
        stem == unit
        or len(random) != 32
        or not _RANDOM_DIGITS.issuperset(random)
        or not head.startswith(UNIT_NAME_PREFIX)
    ):
        return None
    return head.removeprefix(UNIT_NAME_PREFIX) or None


def target_named(key: str, value: object) -> str:
    """A ``kill`` or ``terminate`` target as its ``errstr`` names it:
    ``pid=5``, ``label=job``. A value that is empty or holds a character
    that is not printable (a line break, an escape code) is written as
    ``repr`` writes it (``label='a\\nb'``, ``label=''``), so the message
    stays one line that shows it; any other is left bare, as ``sdexec
    cancel`` of another version compares it (:func:`terminate_not_found`)."""
    text = str(value)
    if text.isprintable() and text:
        return f"{key}={printable(text, SHOWN)}"
    return f"{key}={quoted(text, SHOWN)}"


def terminate_runs_no_job(key: str, value: object) -> str:
    """The ``errstr`` (with ``EINVAL``) of an ``sdexec.terminate`` whose
    process target runs no job: ``sdexec cancel N`` then tries job id N."""
    return f"{target_named(key, value)} runs no job (exec it with SDEXEC_JOBID)"


def terminate_not_found(key: str, value: object) -> str:
    """The ``errstr`` (with ``ESRCH``) of an ``sdexec.terminate`` whose
    target names no job. ``sdexec cancel`` tells it from a job that was
    found and has ended (``ESRCH`` too), which it must not hide."""
    return f"terminate {target_named(key, value)} not found"


#: The ``errstr`` (with ``EINVAL``, after ``pid N: `` or ``label 'L': ``)
#: of an ``sdexec.wait`` for a process not started waitable, in upstream's
#: words (libsubprocess's server.c), which Flux's own tests grep for:
#: ``sdexec wait`` adds what its user must do instead.
NOT_WAITABLE = "process is not waitable (not started with flag 16)"


def ended_and_kept(topic: str, target: str) -> str:
    """The ``errstr`` (with ``ESRCH``, as "not found") of a ``kill`` or
    ``terminate`` of ``target`` (:func:`target_named`) whose process has
    ended and is kept for a wait (listed, state ``Z``): nothing is left to
    signal, and a ``wait`` collects its exit status."""
    return f"{topic} {target}: the process has ended and is kept for a wait"


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


def chosen_socket_path(
    option: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The socket a client uses: ``option`` (``--socket``), else
    ``$SDEXEC_SOCKET``, else :func:`default_socket_path`; ``None`` when
    none is given and ``XDG_RUNTIME_DIR`` is unset."""
    if option:
        return option
    environ = os.environ if environ is None else environ
    return environ.get(SOCKET_ENV) or default_socket_path(environ)


def passed_fds(fds: Sequence[int]) -> tuple[int, int, bytes]:
    """The ancillary data that passes ``fds`` (``SCM_RIGHTS``, stdio
    passthrough: docs/protocol.md), as ``socket.send_fds`` builds it."""
    data = b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds)
    return (_socket.SOL_SOCKET, _socket.SCM_RIGHTS, data)
