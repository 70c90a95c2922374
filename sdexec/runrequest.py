"""What ``sdexec run`` sends (RFC 42's command object, its flags) and the
signals it forwards, with nothing beyond ``os`` and the signal module's C
core: :mod:`sdexec.cli` builds the request, and so does
:mod:`sdexec.earlyexec` before the command line has loaded.
"""

from __future__ import annotations

import os

from sdexec.protocolbase import ExecFlags, command_object
from sdexec.refusal import one_line

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, Protocol

    class RunOptions(Protocol):
        """What of ``sdexec run``'s options goes into its request."""

        cmdline: list[str]
        setopt: list[tuple[str, str]]
        label: str | None
        jobid: str | None
        time_limit: str | None
        dir: str | None
        bg: bool
        passthrough: bool

    import signal
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms


__all__ = [
    "COALESCED_SIGNALS",
    "FORWARDED_SIGNALS",
    "RELAYED_OPTS",
    "RUN_FLAGS",
    "STREAMING_OPTS",
    "NotText",
    "TerminalModes",
    "base_directory",
    "build_command",
    "hold_signal",
    "is_utf8",
]

#: ``sdexec run``'s exec flags: its output streamed, its stdin on credit.
RUN_FLAGS = ExecFlags.STDOUT | ExecFlags.STDERR | ExecFlags.WRITE_CREDIT

#: Signals the client passes on to the process instead of dying of them
#: (SIGQUIT too: a terminal's Ctrl-\\ is the process's, as Ctrl-C is; died
#: of, it stopped the unit with SIGTERM, and the core dump asked for was
#: the client's). SIGWINCH too, as a terminal tells its foreground job of
#: a resize (a full-screen program redraws), :data:`COALESCED_SIGNALS`.
#: Not SIGTSTP: Ctrl-Z stops the client only (docs/client.md, "Signals").
#: Caught from the early exec on.
FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)

#: Forwarded signals that no process ends of: a window dragged sends
#: dozens of SIGWINCH a second, and the process needs only the last (it
#: reads the size itself). Like every forwarded signal, one kill for it is
#: in flight at a time; unlike the others, it is not counted as one the
#: process may die of.
#: Before the start, every forwarded signal is held once at most
#: (:func:`hold_signal`).
COALESCED_SIGNALS = frozenset({signal.SIGWINCH})


def hold_signal(held: list[int], signum: int) -> None:
    """Add ``signum`` to ``held``, the signals waiting to be forwarded in
    order of first arrival, unless one of it waits already: standard
    signals do not queue (the process could not tell two pending from
    one), and a flood of one must neither grow the list nor become a kill
    request each, nor crowd out another signal that follows it."""
    if signum not in held:
        held.append(signum)


#: A closed pipe kills the process as it would a local command: with stdio
#: passthrough it writes to our stdout itself; framed, the client sends it
#: SIGPIPE. systemd ignores SIGPIPE by default, and then neither would end
#: it (``sdexec run --no-passthrough yes | head -1`` ran on for ever).
STREAMING_OPTS = {"SDEXEC_PROP_IgnoreSIGPIPE": "no"}

#: Relayed output (``--no-passthrough``) is written to our stdout and
#: stderr as the service reads it, as a passed descriptor would take it:
#: line-buffered (RFC 42's default), a prompt (``read -p``, ``rm -i``) or a
#: progress line waited in the service for a newline that comes only once
#: the user has answered it, or for 1 MiB of it.
RELAYED_OPTS = {"stdout_LINE_BUFFER": "false", "stderr_LINE_BUFFER": "false"}


class NotText(ValueError):
    """A field of the request is not UTF-8 text, which the service takes
    only; ``str()`` names it and shows its bytes."""


def build_command(
    options: RunOptions,
    environ: Mapping[str, str],
    cwd: str,
    left_out: Callable[[str], None],
) -> dict[str, Any]:
    """The RFC 42 command object for ``sdexec run``: the client's whole
    environment and working directory (``--dir`` relative to ``cwd``,
    resolved; and ``PWD`` then names it, not the client's). A variable of ``environ``
    that is not UTF-8 is left out, and told to ``left_out`` (its name, and
    whether its name or its value is not text); any other field that is
    not is :class:`NotText`."""
    job_options = {
        name: value
        for name, value in (
            ("SDEXEC_JOBID", options.jobid),
            ("SDEXEC_TIME_LIMIT", options.time_limit),
        )
        if value is not None
    }
    # A background run has no client, and no pipe of ours to write to.
    opts = {} if options.bg else dict(STREAMING_OPTS)
    if not (options.bg or options.passthrough):
        opts.update(RELAYED_OPTS)
    # --dir as the kernel enters it (`..` after a symbolic link is its
    # target's parent, which a normalized path is not): systemd takes only
    # a normalized path, and the process's PWD must name where it runs.
    directory = (
        _entered_directory(os.path.join(cwd, options.dir)) if options.dir else cwd
    )
    _check_utf8(
        [
            *((f"argument {i}", arg) for i, arg in enumerate(options.cmdline)),
            ("the working directory", directory),
            # (A key that is not UTF-8 is not written into the words: its
            # bytes are shown with the value's.)
            *((_setopt_named(key), f"{key}={value}") for key, value in options.setopt),
            ("--label", options.label or ""),
            ("--jobid", options.jobid or ""),
            ("--time-limit", options.time_limit or ""),
        ]
    )
    if options.dir:
        environ = {**environ, "PWD": directory}
    return command_object(
        options.cmdline,
        _utf8_environment(environ, left_out),
        {**opts, **dict(options.setopt), **job_options},
        cwd=directory,
        label=options.label,
    )


def _entered_directory(path: str) -> str:
    """The normalized path of the directory chdir(2) would enter at
    ``path``, for systemd to enter. Where the kernel's walk would fail at a
    component that does not exist, it is that component: systemd then
    fails to enter it, saying so, as ``cd`` would (a lexical ``..`` after
    it had the process run in a directory the path never reached:
    ``/scratch/typo/../job`` ran in ``/scratch/job``). One this user may
    not search is resolved as far as can be, for the service, which may,
    to judge."""
    try:
        return os.path.realpath(path, strict=True)
    except (FileNotFoundError, NotADirectoryError) as unreached:
        # realpath names the path it met, resolved up to that component.
        return os.path.realpath(unreached.filename or path)
    except OSError:  # EACCES, ELOOP
        return os.path.realpath(path)


def base_directory(options: RunOptions) -> str:
    """The directory ``--dir`` is relative to: the current one, unless
    ``--dir`` is absolute (which needs none: one deleted, say).
    ``OSError`` if the current one is needed and gone."""
    if options.dir and os.path.isabs(options.dir):
        return options.dir
    return os.getcwd()


def is_utf8(text: str) -> bool:
    """Whether ``text`` is UTF-8, as the protocol carries it: not an
    argument's bytes that are not, which ``os.fsdecode`` kept as
    surrogates (:func:`build_command` refuses those, showing them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes os.fsdecode kept as surrogates
        return False
    return True


def _setopt_named(key: str) -> str:
    return f"--setopt {key}" if is_utf8(key) else "--setopt"


def _check_utf8(fields: Sequence[tuple[str, str]]) -> None:
    """The protocol carries text: a string that is not UTF-8 is refused,
    named, with its bytes shown."""
    for field, text in fields:
        if not is_utf8(text):
            raise NotText(
                f"{field} is not UTF-8 text, which the service takes only:"
                f" {os.fsencode(text)!r}"
            )


def _utf8_environment(
    environ: Mapping[str, str], left_out: Callable[[str], None]
) -> dict[str, str]:
    """``environ`` without its variables that are not UTF-8 (the protocol
    cannot carry them), each told to ``left_out``: one such variable of a
    shell's (an OLDPWD, a module's path) must not stop every run."""
    kept = {}
    for name, value in environ.items():
        if is_utf8(name) and is_utf8(value):
            kept[name] = value
        else:
            left_out(_why_left_out(name, value))
    return kept


def _why_left_out(name: str, value: str) -> str:
    """Which variable is left out, and which of its parts is not text: a
    name that is text is said as such (``OLDPWD``, where it read
    ``b'OLDPWD'``, as if the name were the bytes at fault), one that is
    not by its bytes."""
    if is_utf8(name):
        return f"{one_line(name)}: its value is not UTF-8 text"
    return f"{os.fsencode(name)!r}: its name is not UTF-8 text"


class TerminalModes:
    """The modes of the terminal ``run`` passes its process (the first of
    ``stdio``'s descriptors that is one; none with ``--no-passthrough``),
    read before its exec is sent (the early exec's too: the process may
    set its own before the command line has loaded), to set back where
    the process died of a signal.

    A shell sets a terminal's modes back after a local job that died of a
    signal (the job could not: ``vim`` killed in raw mode), and keeps
    them after one that exited (``stty`` changed them). The process
    passed our terminal is no job of the shell's, and we exit 143 where
    it died of SIGTERM (129, 137): the shell then kept the raw modes a
    killed editor left, no echo, no line editing (docs/client.md,
    "Signals")."""

    def __init__(self, stdio: Mapping[str, int]) -> None:
        self._fd = next((fd for fd in stdio.values() if os.isatty(fd)), None)
        self._modes: list[Any] | None = None
        if self._fd is not None:
            import termios  # only for a terminal

            try:
                self._modes = termios.tcgetattr(self._fd)
            except termios.error:
                self._modes = None

    def restore_after(self, status: int | None) -> None:
        """Set the modes back if ``status`` (the process's wait status, if
        it ended) is a death by signal, and we are the terminal's
        foreground job (a background one's are the shell's to keep)."""
        if self._modes is None or status is None or not os.WIFSIGNALED(status):
            return
        import termios

        assert self._fd is not None
        try:
            if os.tcgetpgrp(self._fd) == os.getpgrp():
                self._set_back(termios)
        except (OSError, termios.error):
            pass  # a terminal gone (hung up): nothing to set back

    def _set_back(self, termios: Any) -> None:
        """Set the modes back once the output written is sent, or at once
        where a signal cut that wait short: ``tcsetattr`` is not retried
        on EINTR, and the ^C that ends a wait for a stopped terminal's
        output (Ctrl-S) would otherwise leave it raw."""
        import errno  # only for a terminal

        try:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._modes)
        except termios.error as failure:
            if failure.args[0] != errno.EINTR:
                raise
            termios.tcsetattr(self._fd, termios.TCSANOW, self._modes)
