"""The wire protocol's names and defaults, written once (docs/protocol.md).

Everything both ends of a connection must agree on: the ``sdexec.exec``
flags, the topics, the default stdin credit, the frame size limit, the
default socket path. The service (``sdexec.server``), the Twisted client
library (``sdexec.client``) and the tests import these names from here;
none of them writes the values again. The values are written in
:mod:`sdexec.protocolbase`, which the command line imports alone (it must
not load ``enum``); this module makes the flags and topics enums and
exports the rest as it is.
"""

from __future__ import annotations

import enum

from sdexec.protocolbase import (
    DEFAULT_MAX_FRAME,
    DEFAULT_OUTPUT_BUFSIZE,
    DEFAULT_SOCKET_SUBPATH,
    DEFAULT_STDIN_BUFSIZE,
    KILL_WHO,
    SOCKET_ENV,
    STATUS_AND_ERROR,
    SYSTEM_SOCKET,
    UNIT_NAME_PREFIX,
    WRITE_PIECE,
    ExecFlags,
    Topics,
    command_object,
    default_socket_path,
    ended_and_kept,
    is_signal_number,
    job_of_unit_name,
    signum_refused,
    target_named,
    terminate_not_found,
    terminate_runs_no_job,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DEFAULT_OUTPUT_BUFSIZE",
    "DEFAULT_SOCKET_SUBPATH",
    "DEFAULT_STDIN_BUFSIZE",
    "KILL_WHO",
    "SOCKET_ENV",
    "STATUS_AND_ERROR",
    "SYSTEM_SOCKET",
    "UNIT_NAME_PREFIX",
    "WRITE_PIECE",
    "ExecFlag",
    "Topic",
    "command_object",
    "default_socket_path",
    "ended_and_kept",
    "is_signal_number",
    "job_of_unit_name",
    "signum_refused",
    "target_named",
    "terminate_not_found",
    "terminate_runs_no_job",
]


class ExecFlag(enum.IntFlag):
    """The ``flags`` of an ``sdexec.exec`` request (RFC 42)."""

    STDOUT = ExecFlags.STDOUT
    STDERR = ExecFlags.STDERR
    CHANNEL = ExecFlags.CHANNEL
    WRITE_CREDIT = ExecFlags.WRITE_CREDIT
    WAITABLE = ExecFlags.WAITABLE


class Topic(enum.StrEnum):
    """Request topics the service answers."""

    EXEC = Topics.EXEC
    WRITE = Topics.WRITE
    KILL = Topics.KILL
    LIST = Topics.LIST
    STATS = Topics.STATS
    UNDRAIN = Topics.UNDRAIN
    WAIT = Topics.WAIT
    ATTACH = Topics.ATTACH
    TERMINATE = Topics.TERMINATE
    RELOAD = Topics.RELOAD
