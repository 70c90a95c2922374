"""The protocol's names and shapes that need nothing beyond ``os``.

Re-exported by :mod:`sdexec.protocol`, which every other module imports
them from. They live apart because ``sdexec run`` sends its exec before it
loads the rest of the command line (:mod:`sdexec.earlyexec`), and
:mod:`sdexec.protocol`'s enums would cost that head start 3 ms of its
10 (the ``enum`` module's import).
"""

from __future__ import annotations

import _socket
import os
import sys

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

__all__ = [
    "DEFAULT_SOCKET_SUBPATH",
    "MAX_SOCKET_PATH",
    "SOCKET_ENV",
    "SYSTEM_SOCKET",
    "chosen_socket_path",
    "command_object",
    "default_socket_path",
    "passed_fds",
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
