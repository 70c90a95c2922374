"""``sdexec run``'s exec, sent before the command line has loaded.

A run's wall time is its interpreter's start, then the command line's
imports and parsing (about 10 ms), then the service and systemd starting
the unit (10-25 ms). The console script (:mod:`sdexec.console`) gives its
arguments to :func:`send` first, with nothing loaded but ``os``, the
C cores of the socket, signal and json modules and the wire format
(:mod:`sdexec.wire`, which is written on those): a run this module can read
is sent at once, and the imports and the parsing happen while the unit
starts. :func:`sdexec.cli.main` then takes the options read here for
its parser's (which it then never loads) and the connection over, follows
the exec as if it had sent it, and does everything else as always
(docs/performance.md, twenty-first pass).

It reads only what it reads exactly as ``sdexec run``'s parser does:
``[--socket PATH] run [-n|--noinput] [--usage] [--label L] [--jobid ID]
[--time-limit FSD] [--dir DIR] [--setopt KEY=VAL]... CMD [ARGS...]``, each
option spelled out, its value after ``=`` or as the next argument, with
stdio passthrough (the default). For anything else (an abbreviation, a
value that starts with ``-``, ``--``, ``--bg``, ``--no-passthrough``,
``--help``), for anything the command line would refuse or warn of (a
label of digits, an empty value, a ``--setopt`` without ``=``, text that
is not UTF-8, a ``--time-limit`` or ``--jobid`` that it checks as the
service does and that is not plainly good: see :func:`_plainly_taken`), or
when the socket cannot be reached or a standard descriptor is closed, it
sends nothing: the command line does it all, and says what is wrong, as
before. test/test_earlyexec.py holds its reading to the parser's.

The process may start before the command line has loaded, so the signals
``run`` forwards are caught from the exec on (:attr:`EarlyExec.caught`)
and the command line serves them as it serves its own: SIGUSR1's default
action, before, ended the client, and the service then stopped a process
that had started well. One the caller ignored stays ignored.
"""

from __future__ import annotations

import _socket
import os

from sdexec.protocolbase import Topics, chosen_socket_path, passed_fds
from sdexec.runrequest import (
    FORWARDED_SIGNALS,
    RUN_FLAGS,
    NotText,
    TerminalModes,
    base_directory,
    build_command,
    hold_signal,
)
from sdexec.wire import encode_small_message

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import signal
    from argparse import Namespace
    from collections.abc import Mapping, Sequence
    from typing import Any
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms

    Namespace = object  # what RunArgs stands for, to type checkers only

__all__ = [
    "MATCHTAG",
    "EarlyExec",
    "RunArgs",
    "read_run",
    "request_line",
    "send",
]

#: The exec's matchtag: the first of its connection.
MATCHTAG = 1
#: ``run``'s options read here that take no value, by their attribute.
_SWITCHES = {"-n": "noinput", "--noinput": "noinput", "--usage": "usage"}
#: ``run``'s options read here that take one, by their attribute.
_VALUED = {
    "--label": "label",
    "--jobid": "jobid",
    "--time-limit": "time_limit",
    "--dir": "dir",
}
#: The most characters of a ``--label`` or ``--jobid`` read here: four
#: bytes each at most, within what the parser takes
#: (:data:`sdexec.limits.MAX_NAME`, whose module is too slow to load here;
#: test_earlyexec.py holds the two).
_PLAIN_NAME_MAX = 256
#: The most digits of a ``--time-limit`` read here: any such FSD is finite.
_PLAIN_DURATION_DIGITS = 15
#: An FSD's units, ``ms`` before ``s`` (:mod:`sdexec.fsd`).
_FSD_UNITS = ("ms", "s", "m", "h", "d")
#: Where stdin, stdout and stderr come from: the streams passed.
_STDIO_NAMES = ("stdin", "stdout", "stderr")


class RunArgs(Namespace):
    """``sdexec run``'s options as its parser's namespace holds them, for
    the forms :func:`read_run` reads (test/test_earlyexec.py holds the two
    to each other): :mod:`sdexec.cli` takes them for the parser's."""

    def __init__(self) -> None:
        self.command = "run"
        self.socket: str | None = None
        self.noinput = False
        self.passthrough = True
        self.setopt: list[tuple[str, str]] = []
        self.label: str | None = None
        self.bg = False
        self.waitable = False
        self.jobid: str | None = None
        self.time_limit: str | None = None
        self.usage = False
        self.dir: str | None = None
        self.cmdline: list[str] = []


class EarlyExec:
    """An exec sent for ``options``: the socket it went on, connected to
    ``path``; the ``command`` object; the descriptors passed, by stream (on
    exit the /dev/null passed for stdin with ``-n`` is closed); the
    forwarded signals ``caught`` since, in order, a list that grows until
    the command line catches them itself."""

    matchtag = MATCHTAG

    def __init__(
        self,
        options: RunArgs,
        sock: _socket.socket,
        path: str,
        command: dict[str, Any],
        stdio: dict[str, int],
        caught: list[int],
        terminal: TerminalModes,
    ) -> None:
        self.options = options
        self.socket = sock
        self.path = path
        self.command = command
        self.stdio = stdio
        self.caught = caught
        #: The terminal's modes read before the exec was sent, for the
        #: command line to set back after a process killed by a signal.
        self.terminal = terminal

    def __enter__(self) -> dict[str, int]:
        return self.stdio

    def __exit__(self, *_exc_info: object) -> None:
        if self.stdio["stdin"] != 0:
            os.close(self.stdio["stdin"])
            self.stdio["stdin"] = 0


class _Declined(Exception):
    """What the command line itself must do (and say)."""


def send(
    argv: Sequence[str], environ: Mapping[str, str] = os.environ
) -> EarlyExec | None:
    """Send the exec of ``sdexec ARGV`` if :func:`read_run` reads it and it
    can be sent as the command line would send it; ``None`` if not."""
    options = read_run(argv)
    path = None if options is None else chosen_socket_path(options.socket, environ)
    if options is None or path is None or not _standard_fds_open():
        return None
    try:
        command = build_command(options, environ, base_directory(options), _decline)
    except (OSError, NotText, _Declined):
        return None
    stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) if options.noinput else 0
    stdio = dict(zip(_STDIO_NAMES, (stdin, 1, 2), strict=True))
    terminal = TerminalModes(stdio)  # before the process can change them
    sock = _sent(path, request_line(command), list(stdio.values()))
    if sock is None:
        if options.noinput:
            os.close(stdin)
        return None
    return EarlyExec(options, sock, path, command, stdio, _caught_from_now(), terminal)


def _caught_from_now() -> list[int]:
    """The forwarded signals that come from now on, each caught and noted
    once (:func:`hold_signal`) rather than acted on, but for one the
    caller ignored: a storm of one while the command line loads grows
    nothing, and does not crowd out a SIGTERM that follows it."""
    caught: list[int] = []

    def note(signum: int, _frame: object) -> None:
        hold_signal(caught, signum)

    for signum in FORWARDED_SIGNALS:
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, note)
    return caught


def read_run(argv: Sequence[str]) -> RunArgs | None:
    """``sdexec ARGV``'s options as its parser reads them, if ``argv`` is a
    ``run`` of the plain forms (the module's docstring); else ``None``."""
    if "--" in argv:
        return None  # argparse's handling of it is its own business
    options = RunArgs()
    args = iter(argv)
    for arg in args:
        if arg == "run":
            break
        if not _read_valued(arg, args, {"--socket": "socket"}, options):
            return None
    else:
        return None
    for arg in args:
        if not arg.startswith("-"):
            options.cmdline = [arg, *args]
            break
        if arg in _SWITCHES:
            setattr(options, _SWITCHES[arg], True)
        elif not _read_valued(arg, args, {**_VALUED, "--setopt": "setopt"}, options):
            return None
    if not options.cmdline or (options.label or "").isdigit():
        return None  # the parser's to refuse
    return options


def request_line(command: dict[str, Any]) -> bytes:
    """The exec request for ``command``, framed, as :mod:`sdexec.syncclient`
    writes it (stdio passthrough of all three streams)."""
    request = {
        "type": "request",
        "topic": Topics.EXEC,
        "matchtag": MATCHTAG,
        "payload": {"cmd": command, "flags": RUN_FLAGS, "stdio": list(_STDIO_NAMES)},
    }
    return encode_small_message(request)


def _read_valued(
    arg: str, args: Any, names: Mapping[str, str], options: RunArgs
) -> bool:
    """Read ``arg`` (with its value, from ``args`` if not after ``=``) if it
    is one of ``names``, an option taking a value; whether it was, with a
    value the parser plainly takes."""
    name, equals, value = arg.partition("=")
    attribute = names.get(name)
    if attribute is None:
        return False
    if not equals:
        value = next(args, "-")  # (none left: the parser's to refuse)
    if not value or value.startswith("-"):
        return False  # the parser's to refuse (an empty one too)
    if attribute == "setopt":
        key, equals, setting = value.partition("=")
        options.setopt.append((key, setting))
        return bool(key and equals)  # else the parser's to refuse
    setattr(options, attribute, value)
    return _plainly_taken(attribute, value)  # each: the parser checks each


def _plainly_taken(attribute: str, value: str) -> bool:
    """Whether the parser, which checks a run's names and time limit as
    the service does (:mod:`sdexec.cliargs`), plainly takes ``value`` for
    ``attribute``: a label or job id not too long, the job id printable,
    the time limit a few ASCII digits. Its own checks load modules (``re``,
    ``decimal``) that this one must not; what is not plain here it judges
    itself."""
    if attribute in ("label", "jobid") and len(value) > _PLAIN_NAME_MAX:
        return False
    if attribute == "jobid":
        return value.isprintable()
    return attribute != "time_limit" or _plain_duration(value)


def _plain_duration(text: str) -> bool:
    """Whether ``text`` is plainly an FSD: up to
    :data:`_PLAIN_DURATION_DIGITS` ASCII digits, a ``.`` among or before
    them or not, then a unit or not (``5m``, ``0.5``, ``100ms``)."""
    unit = next((unit for unit in _FSD_UNITS if text.endswith(unit)), "")
    digits = text.removesuffix(unit).replace(".", "", 1)
    return (
        digits.isascii() and digits.isdigit() and len(digits) <= _PLAIN_DURATION_DIGITS
    )


def _decline(_name: str) -> None:
    raise _Declined  # a variable to leave out, and say so: the command line's


def _standard_fds_open() -> bool:
    """Whether fds 0-2 are open: the command line puts /dev/null on one
    that is not, before it opens anything of its own."""
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return False
    return True


def _sent(path: str, line: bytes, fds: list[int]) -> _socket.socket | None:
    """A socket connected to ``path`` that has taken ``line`` whole, with
    ``fds``; ``None`` if it cannot be done (nothing is then half sent)."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sent = sock.sendmsg([line], [passed_fds(fds)])
        sock.sendall(line[sent:])  # a blocking socket: the rest, if any
    except OSError:
        sock.close()  # a line cut short there is discarded with it
        return None
    return sock
