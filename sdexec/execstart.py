"""A unit's command, as ``ExecStart`` that systemd reads back as it was sent.

systemd writes a transient unit's settings into its file in
``/run/…/transient/`` and reads that file again at every ``daemon-reload``
(package installs run one). Measured on systemd 252:

- ``ExecStartEx=``, the form that carries ``no-env-expand``, is written
  under a key its unit-file reader does not know. The unit reads back
  ``bad-setting``, and systemd gives a unit that is not loaded no cgroup
  controllers of its own: a running job kept running, but its cgroup lost
  ``cpuset``, ``memory`` and ``pids``, and with them its CPU fence, its
  memory cap and its task limit (seen on a cgroup v2 node).
- ``ExecStart=`` reads back, every character as it was sent but two: an
  argument's ``$`` and ``;`` come back with a backslash before them.
- In ``ExecStart``, systemd itself expands ``$VAR`` and ``${VAR}`` before
  the command sees them.

So a command with neither ``$`` nor ``;`` in its path or arguments is sent
as plain ``ExecStart``: there is nothing to expand, and every other
character reads back as sent. A command with either runs through a
trampoline, the service's own Python with :data:`TRAMPOLINE`, given the
path and the arguments with ``$``, ``;`` and ``%`` percent-encoded: it
decodes them and executes the command verbatim, in the environment the
unit gave it. Its exec failing is exit status 203, as systemd's own
(``EXIT_EXEC``), with a line on stderr saying why.

A leaf: it knows neither requests nor the bus.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["TRAMPOLINE", "ExecLine", "exec_line", "read_back_intact"]

#: The characters systemd 252 does not read back from an ``ExecStart=``
#: line as it wrote them, and ``$`` what it expands there too.
_NOT_READ_BACK = ("$", ";")

#: Run as ``python -I -S -c TRAMPOLINE PATH ARGV…`` with each of PATH and
#: ARGV percent-encoded (:func:`_encoded`). Itself free of ``$`` and ``;``
#: (``chr``), so that its own line reads back. It executes with the
#: environment the process began with (``/proc/self/environ``): Python in
#: the C locale adds ``LC_CTYPE=C.UTF-8`` to its own.
TRAMPOLINE = """\
import os, sys
codes = {"24": chr(36), "25": "%", "3B": chr(59)}
def decoded(arg):
    head, *rest = arg.split("%")
    return head + "".join(codes[part[:2]] + part[2:] for part in rest)
path, *argv = map(decoded, sys.argv[1:])
try:
    with open("/proc/self/environ", "rb") as environ:
        entries = environ.read().split(bytes(1))
    env = dict(entry.partition(b"=")[::2] for entry in entries if entry)
except OSError:
    env = os.environb
try:
    os.execve(path, argv, env)
except OSError as error:
    sys.stderr.write(f"sdexec: cannot execute {path}: {error.strerror}\\n")
    sys.exit(203)
"""

#: The interpreter that runs :data:`TRAMPOLINE`: the service's own.
_PYTHON = sys.executable or "/usr/bin/python3"


class ExecLine(NamedTuple):
    """What ``ExecStart`` is given: the ``path`` systemd executes and its
    ``argv``."""

    path: str
    argv: list[str]


def read_back_intact(executable: str, cmdline: Sequence[str]) -> bool:
    """Whether systemd reads ``executable`` run as ``cmdline`` back from a
    plain ``ExecStart=`` line as it was sent (and has nothing to expand)."""
    return not any(
        char in text for text in (executable, *cmdline) for char in _NOT_READ_BACK
    )


def exec_line(executable: str, cmdline: Sequence[str]) -> ExecLine:
    """The ``ExecStart`` that runs ``executable`` as ``cmdline`` verbatim and
    reads back from the unit's file as it was sent: the command itself, or
    the trampoline given it encoded."""
    if read_back_intact(executable, cmdline):
        return ExecLine(executable, list(cmdline))
    encoded = [_encoded(text) for text in (executable, *cmdline)]
    return ExecLine(_PYTHON, [_PYTHON, "-I", "-S", "-c", TRAMPOLINE, *encoded])


def _encoded(text: str) -> str:
    return text.replace("%", "%25").replace("$", "%24").replace(";", "%3B")
