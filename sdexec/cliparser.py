"""The argument parser of every sdexec command (``sdexec``,
``python3 -m sdexec.config``, ``python3 -m sdexec.map``).

argparse drops a failed write of its own output (``_print_message`` ignores
``OSError``), so ``sdexec --help > /dev/full`` printed nothing and exited 0,
as if a script had its help. :class:`CommandParser` writes ``--help`` (and
:mod:`sdexec.version` ``--version``) through :func:`write_stdout_or_exit`:
a stdout that cannot take it ends the command with status 1 and one line
naming why, and a reader gone (``sdexec --help | head -1``) with the status
a shell gives a command SIGPIPE ended. The configuration check and the
mapper tool write their JSON the same way (they ended in a traceback);
``sdexec``'s other output has its own checked writer
(:func:`sdexec.cliio.print_out`).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from _typeshed import SupportsWrite

__all__ = ["CommandParser", "say_led", "write_stdout_or_exit"]


def write_stdout_or_exit(prog: str, text: str) -> None:
    """``text`` on stdout, whole (a non-blocking stdout waited for), or
    ``SystemExit`` when it cannot be written: 1, after ``PROG: cannot write
    stdout: ...`` on stderr, or SIGPIPE's status, quietly, for a reader
    gone."""
    # Imported here: the service reads its configuration through this
    # module, and needs none of the command line's output.
    from sdexec.cliio import write_stdout_whole

    try:
        if sys.stdout is None:  # fd 1 was closed when Python started (>&-)
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        # Whole, though stdout is non-blocking: written with print's
        # write(), the JSON past what the pipe took was lost (dropped in
        # silence under PYTHONUNBUFFERED, as ps's listing was).
        write_stdout_whole(text)
    except BrokenPipeError:
        _exit_quietly(128 + signal.SIGPIPE)
    except OSError as error:
        _exit_quietly(1, f"{prog}: cannot write stdout: {error.strerror}\n")


def say_led(prog: str, line: str) -> None:
    """``line`` on stderr, led by ``prog`` as argparse leads a usage
    error: in a script running several tools, every line names the one
    that said it."""
    print(f"{prog}: {line}", file=sys.stderr)


def _exit_quietly(status: int, message: str = "") -> NoReturn:
    """Exit with ``status`` after ``message`` on stderr, with what stdout's
    buffer still holds bound for /dev/null: the interpreter's exit would
    flush it again, and say so in a traceback."""
    if sys.stdout is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    if message:
        sys.stderr.write(message)
    raise SystemExit(status)


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose ``--help`` is checked as the module's
    docstring says; its subcommands' parsers are of this class too.

    ``program``: the name its failures begin with (``sdexec: cannot write
    stdout: …``), the program's as every other failure of it says, where
    a subcommand's ``prog`` (``sdexec run``) names it in its usage and its
    usage errors, as argparse's do (``prog`` unless given)."""

    def __init__(self, *args: Any, program: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.program = program or self.prog

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """argparse's, but to stdout through :func:`write_stdout_or_exit` (a
        closed stdout is a message, not a traceback)."""
        if file is not None and file is not sys.stdout:
            super().print_help(file)
            return
        write_stdout_or_exit(self.program, self.format_help())
