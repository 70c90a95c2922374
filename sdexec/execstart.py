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
- ``ExecStart=`` reads back, an argument's every character as it was sent
  but two: ``$`` and ``;`` come back with a backslash before them. The path
  is written unquoted where it is not the first argument, and no path with
  whitespace, a quote or a backslash reads back as it was sent (review
  session 43 E2: some read back ``bad-setting``, some as another command).
- In ``ExecStart``, systemd itself expands ``$VAR`` and ``${VAR}`` before
  the command sees them.

So a command with neither ``$`` nor ``;`` in its arguments, and a plain
path, is sent as plain ``ExecStart``: there is nothing to expand, and it
reads back as sent. Any other runs through a trampoline, the service's own
Python with :data:`TRAMPOLINE`, given the path and the arguments with
``$``, ``;`` and ``%`` percent-encoded: it decodes them and executes the
command verbatim, in the environment and with the signal dispositions the
unit gave it. Its exec failing is exit status 203, as systemd's own
(``EXIT_EXEC``), with a line on stderr saying why.

A leaf: it knows neither requests nor the bus.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "TRAMPOLINE",
    "ExecLine",
    "encoded_arguments",
    "exec_line",
    "read_back_intact",
    "started_command",
]

#: The characters systemd 252 does not read back from an argument of an
#: ``ExecStart=`` line as it wrote them, and ``$`` what it expands there too.
_NOT_READ_BACK = ("$", ";")

#: A path systemd 252 reads back from an ``ExecStart=`` line, quoted or not:
#: absolute, and none of those, no whitespace, quote, backslash or control
#: character.
_PLAIN_PATH = re.compile(r"/[^\s\"'\\$;\x00-\x1f\x7f]*")

#: Run as ``python -I -S -c TRAMPOLINE SIGPIPE PATH ARGV…`` with each of
#: PATH and ARGV percent-encoded (:func:`_encoded`), SIGPIPE ``ignore`` or
#: ``default`` as the unit's ``IgnoreSIGPIPE`` says. Itself free of ``$``
#: and ``;`` (``chr``), so that its own line reads back. It executes with
#: the environment the process began with (``/proc/self/environ``: Python in
#: the C locale adds ``LC_CTYPE=C.UTF-8`` to its own), and gives back the
#: signals Python ignores at its start, which an exec keeps ignored:
#: ``SIGXFSZ`` (systemd leaves every signal at its default) and ``SIGPIPE``.
#: SIGINT, which Python catches from its start, is its default again first
#: thing, and one caught before dies of it still, as the command would
#: have (review session 43 Q4-2: a traceback, exit 1, or lost). Its modules
#: are the builtin ``_signal`` and ``posix``: ``signal`` and ``os`` cost
#: imports.
TRAMPOLINE = """\
try:
    import _signal, posix, sys
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    codes = {"24": chr(36), "25": "%", "3B": chr(59)}
    def decoded(arg):
        head, *rest = arg.split("%")
        return head + "".join(codes[part[:2]] + part[2:] for part in rest)
    pipe, path, *argv = [sys.argv[1], *map(decoded, sys.argv[2:])]
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)
    sigpipe = _signal.SIG_IGN if pipe == "ignore" else _signal.SIG_DFL
    _signal.signal(_signal.SIGPIPE, sigpipe)
    try:
        with open("/proc/self/environ", "rb") as environ:
            entries = environ.read().split(bytes(1))
        env = dict(entry.partition(b"=")[::2] for entry in entries if entry)
    except OSError:
        env = posix.environ
    posix.execve(path, argv, env)
except KeyboardInterrupt:
    import _signal, posix
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    posix.kill(posix.getpid(), _signal.SIGINT)
except OSError as error:
    sys.stderr.write(f"sdexec: cannot execute {path}: {error.strerror}\\n")
    sys.exit(203)
"""

#: The interpreter that runs :data:`TRAMPOLINE`: the service's own, unless
#: systemd could not read its path back either.
_PYTHON = (
    sys.executable
    if _PLAIN_PATH.fullmatch(sys.executable or "") is not None
    else "/usr/bin/python3"
)


class ExecLine(NamedTuple):
    """What ``ExecStart`` is given: the ``path`` systemd executes and its
    ``argv``; ``trampolined`` if that is the trampoline."""

    path: str
    argv: list[str]
    trampolined: bool = False


def read_back_intact(executable: str, cmdline: Sequence[str]) -> bool:
    """Whether systemd reads ``executable`` run as ``cmdline`` back from a
    plain ``ExecStart=`` line as it was sent (and has nothing to expand)."""
    return _PLAIN_PATH.fullmatch(executable) is not None and not any(
        char in arg for arg in cmdline for char in _NOT_READ_BACK
    )


def exec_line(
    executable: str, cmdline: Sequence[str], ignore_sigpipe: bool = True
) -> ExecLine:
    """The ``ExecStart`` that runs ``executable`` as ``cmdline`` verbatim and
    reads back from the unit's file as it was sent: the command itself, or
    the trampoline given it encoded (``ignore_sigpipe``: the unit's
    ``IgnoreSIGPIPE``, systemd's default yes, for the trampoline to keep)."""
    if read_back_intact(executable, cmdline):
        return ExecLine(executable, list(cmdline))
    pipe = "ignore" if ignore_sigpipe else "default"
    encoded = [_encoded(text) for text in (executable, *cmdline)]
    return ExecLine(
        _PYTHON, [_PYTHON, "-I", "-S", "-c", TRAMPOLINE, pipe, *encoded], True
    )


def encoded_arguments(line: ExecLine, cmdline: Sequence[str]) -> Sequence[str]:
    """``cmdline``'s arguments as ``line`` gives them: encoded where it is
    the trampoline's (its last ones), else as they are."""
    return line.argv[len(line.argv) - len(cmdline) :]


def started_command(exec_start: object) -> list[str] | None:
    """The command line a unit's ``ExecStart``, as ``GetAll`` reads it
    (``[(path, argv, …)]``), runs: :func:`exec_line`'s undone, the
    trampoline's arguments decoded, any other's ``argv`` as it is; ``None``
    where it holds no one command of strings (a unit not found has none)."""
    if not isinstance(exec_start, list | tuple) or len(exec_start) != 1:
        return None
    entry = exec_start[0]
    argv = entry[1] if isinstance(entry, list | tuple) and len(entry) > 1 else None
    if not isinstance(argv, list | tuple) or not all(isinstance(a, str) for a in argv):
        return None
    # [python, -I, -S, -c, TRAMPOLINE, SIGPIPE, PATH, ARGV…]
    if len(argv) > 7 and list(argv[1:5]) == ["-I", "-S", "-c", TRAMPOLINE]:
        return [_decoded(arg) for arg in argv[7:]]
    return list(argv)


def _encoded(text: str) -> str:
    return text.replace("%", "%25").replace("$", "%24").replace(";", "%3B")


#: What the trampoline decodes, by the two hex digits after a ``%``.
_CODES = {"24": "$", "25": "%", "3B": ";"}


def _decoded(text: str) -> str:
    """:func:`_encoded` undone, as the trampoline does it."""
    head, *rest = text.split("%")
    return head + "".join(
        _CODES.get(part[:2], "%" + part[:2]) + part[2:] for part in rest
    )
