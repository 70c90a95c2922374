"""What the ``sdexec`` commands share: lines on our stderr, their own
output to our stdout (one checked writer), a process's output to our stdout
and stderr, a connection to the service, and the exit status a process's
end gives the command.

:mod:`sdexec.cli` (the command line and ``sdexec run``) and
:mod:`sdexec.cli_background` (``run --bg``, ``wait``, ``attach``) both
build on it. Like them it runs on :mod:`sdexec.syncclient`, never Twisted,
and it imports nothing the command's start-up could do without.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import sys

from sdexec.refusal import one_line
from sdexec.rpc import (
    OUTPUT_RESPONSE_IO,
    RPCError,
    SdexecError,
    output_io,
    resolve_socket_path,
)
from sdexec.syncclient import Connection, Exec, Loop

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import argparse
    import signal
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any, TextIO

    from sdexec.receipt import Receipt
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms

__all__ = [
    "DIE_OF",
    "DISCARDED",
    "EXEC_FAILURES",
    "INTERRUPTING_SIGNALS",
    "LOST",
    "MALFORMED",
    "MAX_HELD_LINES",
    "MAX_PID",
    "NOT_EXECUTABLE",
    "NOT_FOUND",
    "READER_GONE",
    "UNFINISHED",
    "WRITTEN",
    "DeathBySignal",
    "Output",
    "close_outputs",
    "connect",
    "end_on_signals",
    "exit_code",
    "fail",
    "flush_out",
    "is_number",
    "open_closed_standard_fds",
    "own_fd",
    "pid_of",
    "print_out",
    "print_out_unless_signalled",
    "receipt_lines",
    "request",
    "say",
    "say_end",
    "say_held",
    "say_killed",
    "signalled_status",
    "warn",
    "warn_after_finished",
    "write_output",
    "write_stdout_whole",
]

#: What ``run`` and ``attach`` fail with when a stream ended without its
#: process's end (and without an error to say instead).
UNFINISHED = "the service ended the stream without a finished response"
#: The exit status of a command that could not be found, as a shell's.
NOT_FOUND = 127
#: A shell's exit status for a command it cannot execute.
NOT_EXECUTABLE = 126
#: The exit status for a command the service could not start, by errno.
EXEC_FAILURES = {errno.ENOENT: NOT_FOUND, errno.EACCES: NOT_EXECUTABLE}


#: Our own read-only /dev/null for each of fds 1 and 2 that was closed
#: when we started (:func:`open_closed_standard_fds`).
_unwritable: dict[int, int] = {}


def is_number(text: str) -> bool:
    """Whether ``text`` is ASCII digits only, as a pid is written:
    str.isdigit alone takes "١٢" (a label, read as pid 12) and "²" (which
    int() refuses)."""
    return text.isascii() and text.isdigit()


#: The largest pid there can be: a ``pid_t`` is a C int (the kernel's own
#: PID_MAX_LIMIT, 4194304, is far below).
MAX_PID = 2**31 - 1


def pid_of(text: str) -> int | None:
    """The pid ``text`` names, written as one (:func:`is_number`) and no
    larger than :data:`MAX_PID`, else ``None``. Its length first: int()
    refuses over 4300 digits, in words of its own (``cancel`` of such a
    number said "unexpected error: ValueError: Exceeds the limit …")."""
    if not is_number(text) or len(text.lstrip("0")) > len(str(MAX_PID)):
        return None
    pid = int(text)
    return pid if pid <= MAX_PID else None


def open_closed_standard_fds() -> None:
    """Put /dev/null on any of fds 0-2 that is closed: else the service's
    socket could become fd 0 and be read as our stdin. A closed stdin reads
    as empty.

    A closed stdout or stderr is /dev/null opened for writing: the process
    gets it with passthrough, or ``--no-passthrough`` writes its output
    there, and that output is discarded. Read-only, it broke Python
    programs, which make a ``sys.stdout`` of an open fd 1 and then fail to
    flush it (``EBADF``, exit 1, where with the fd closed they exit 0). Our
    own stdout still cannot be written, as the shell's ``>&-`` makes it:
    ``sys.stdout`` is a read-only /dev/null ("cannot write stdout: Bad
    file descriptor"), so no listing or pid is lost in silence, and so is
    :func:`own_fd` of a closed fd 1 or 2, where ``wait`` and ``attach``
    write the output they are the only ones to deliver."""
    for fd, access in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            # The lowest free fd is this one, as the ones below it are open.
            os.open(os.devnull, access)
    # Python made None of the streams whose fd was closed when it started.
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (lives as long as we do)
    if sys.stdout is None:
        _unwritable[1] = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        sys.stdout = open(_unwritable[1], "w", closefd=False)  # noqa: SIM115
    if sys.stderr is None:
        _unwritable[2] = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def own_fd(fd: int) -> int:
    """Where the command itself writes what ``fd`` (1 or 2) would take:
    ``fd``, or, if it was closed when we started, a descriptor that cannot
    be written (a process's is /dev/null; output that ``wait`` or ``attach``
    alone can deliver is lost aloud, not in silence)."""
    return _unwritable.get(fd, fd)


def exit_code(status: int) -> int:
    """The client's exit status for the process's wait status: its exit
    code, or 128+N if signal N killed it."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


#: The signals that end a command that has not started yet (a local one
#: would die of them before its exec), instead of being held for it
#: (``run``; ``run --bg`` waits for the answer, to say the pid).
INTERRUPTING_SIGNALS = frozenset(
    {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
)
#: The signals a command the user sent one of dies of, where it would exit
#: 128 + N: the keyboard's (Ctrl-C, Ctrl-\), to which bash applies its
#: wait-and-cooperative-exit rule (a child that *exits*, even with 130, is
#: taken to have handled the ^C, and a script's loop goes on). Not SIGTERM
#: or SIGHUP: no shell acts on how a child ended of them, ``$?`` is 143 or
#: 129 either way, and docs/client.md promises that ``run`` exits 143.
DIE_OF = frozenset({signal.SIGINT, signal.SIGQUIT})


class DeathBySignal(int):
    """An exit status, 128 + N, that the command line's entry point
    (:func:`sdexec.cli.run_and_exit`) turns into a death by signal N: an
    ``int`` still, which :func:`sdexec.cli.main` returns as it is."""

    @property
    def signum(self) -> int:
        return int(self) - 128


def signalled_status(signum: int) -> int:
    """The status of a command that ``signum``, sent to it, ended (itself,
    or the process it forwarded it to): 128 + N, to die of for one of
    :data:`DIE_OF`."""
    code = 128 + signum
    return DeathBySignal(code) if signum in DIE_OF else code


# -- lines on stderr -----------------------------------------------------------


def fail(message: str) -> int:
    """Say what went wrong in one line on stderr; the exit status 1."""
    warn(message)
    return 1


def receipt_lines(receipt: Receipt, usage: bool = False) -> list[str]:
    """What ``run``, ``wait`` and ``attach`` print on stderr once the process
    has ended: the receipt with ``run --usage``, then, after an OOM kill,
    ``sdexec: killed by the OOM killer (MemoryMax=…)``, or after a timeout
    ``sdexec: stopped by systemd for a timeout (RuntimeMaxUSec=…)`` (the exit
    status alone would say only 137, or 143); and for a job its termination
    ended, ``sdexec: job terminated: its time limit was reached``."""
    lines = receipt.usage_lines() if usage else []
    if receipt.oom_killed:
        lines.append(f"sdexec: {receipt.oom_message()}")
    elif receipt.timed_out:
        lines.append(f"sdexec: {receipt.timeout_message()}")
    terminated = receipt.termination_message()
    if terminated is not None:
        lines.append(f"sdexec: {terminated}")
    return lines


def say_end(receipt: Receipt, after: object = None, usage: bool = False) -> None:
    """What ``run``, ``wait`` and ``attach`` say on stderr once the process
    has ended: what ended its stream after it, if anything
    (:func:`warn_after_finished`), then its receipt (:func:`receipt_lines`)."""
    if after is not None:
        warn_after_finished(after)
    for line in receipt_lines(receipt, usage):
        say(line)


def say_killed(stream: Exec) -> int:
    """Say that the client sent ``SIGKILL`` to the process of ``stream``
    for the protocol it broke (:attr:`~sdexec.syncclient.Exec.killed_for`:
    malformed output, credit that is no integer), and end the command
    there, as Flux's libsubprocess fails its subprocess: the status 1."""
    return fail(
        f"{stream.killed_for}: pid {stream.pid} killed (SIGKILL): its stream"
        " broke the protocol"
    )


def warn_after_finished(failure: object) -> None:
    """Say what ended a stream after its command finished (processes it
    left behind, say): the service's business, not the command's, whose
    exit code stands (``run``, ``wait``, ``attach`` alike)."""
    warn(f"after the command finished: {failure}")


def warn(message: str) -> None:
    """One line on stderr (what the service said may quote what a client
    chose: escaped, it cannot act on the terminal)."""
    say(f"sdexec: {one_line(message)}")


def say(line: str) -> None:
    """``line`` on stderr, if it can be written: a stderr gone (a closed
    pipe, a full disk) must not change the exit status or end the command
    before its output. While an output write waits for its reader, and
    once the command has served its last signal (:func:`end_on_signals`),
    only as far as stderr takes it at once, the rest held
    (:class:`_HeldLines`)."""
    if _held.waits or _held.closing:
        _held.hold(line)
        return
    _held.write_all()  # first: in the order said
    try:  # noqa: SIM105 (contextlib is not imported: start-up time)
        # Whole, though stderr is non-blocking (a file description another
        # program of the pipeline set O_NONBLOCK on): print() dropped the
        # line in silence where the pipe had no room for it.
        _write_whole(sys.stderr, f"{line}\n")
    except OSError:
        pass  # a stderr that went away: nothing more can be said to it


def say_held() -> int | None:
    """Write the lines :func:`say` held, waiting for stderr to take them:
    at the command's end, when nothing is left to serve; after
    :func:`end_on_signals`, only until one of its signals comes. The exit
    status of a signal that so ended it with lines unsaid (128 + N, died of
    for a ^C: :func:`signalled_status`), else ``None``."""
    _held.write_all()
    ended_by = _held.ended_by
    _held.close()
    return None if ended_by is None else signalled_status(ended_by)


def end_on_signals() -> None:
    """The command has served its last signal and has only its last lines
    to say (its process's end, or why it failed): from now on they are
    written as far as stderr takes them at once, the rest held, and
    :func:`say_held` waits for stderr to take them only until one of
    :data:`INTERRUPTING_SIGNALS` comes that the command caught (not one it
    left at its default, nor one ignored). Else, with ``2>&1 | less`` and
    less stopped, a last line blocked on that full pipe, and a Ctrl-C or
    SIGTERM, caught by a loop that served signals no more, could not end
    the command until the pipe drained."""
    _held.end_on(
        signum for signum in INTERRUPTING_SIGNALS if callable(signal.getsignal(signum))
    )


#: How many lines said while an output write waits are held for a stderr
#: that cannot take them (:class:`_HeldLines`); those past it are counted.
MAX_HELD_LINES = 32


class _HeldLines:
    """What :func:`say` says while an output write waits for its reader
    (``waits``): written only as far as stderr takes it at once, never
    waiting for it, and the rest held, the first :data:`MAX_HELD_LINES`
    lines and a count of the others, until it takes them: after each output
    write, at the next line said once no write waits, at the command's end.
    Waiting for stderr there, the client served no signal: with ``sdexec
    run --no-passthrough ... 2>&1 | less``, less stopped, the line of a kill
    that failed while the output waited blocked it on that same full pipe,
    and the SIGTERM sent next never reached the process."""

    def __init__(self) -> None:
        #: How many output writes wait for their reader now.
        self.waits = 0
        #: The command says only its last lines now (:func:`end_on_signals`):
        #: each is held as while an output write waits, and the wait for
        #: stderr at the end ends at a signal.
        self.closing = False
        #: The signal that ended that wait with lines unsaid, if one did.
        self.ended_by: int | None = None
        #: The first such signal that came, and the pipe that wakes the wait
        #: for it (with the handlers it replaced, put back at the end).
        self._signalled: int | None = None
        self._wakeup: tuple[int, int] | None = None
        self._replaced: dict[int, Any] = {}
        self._lines: list[bytes] = []
        self._dropped = 0
        #: Where stderr is written without waiting (-1: nowhere), once known,
        #: and stderr's own descriptor (the writer, or not ours to close).
        self._writer: int | None = None
        self._stderr_fd = -1

    def end_on(self, signums: Iterable[int]) -> None:
        """From now on hold what is said, and end the wait for stderr at
        the end (:meth:`write_all`) once one of ``signums`` comes."""
        self.closing = True
        self._wakeup = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for signum in signums:
            self._replaced[signum] = signal.signal(signum, self._note_signal)

    def _note_signal(self, signum: int, _frame: Any) -> None:
        """The handler of :meth:`end_on`'s signals: the first noted, and
        the wait for stderr woken (it is about to poll, or polls now)."""
        if self._signalled is None:
            self._signalled = signum
        if self._wakeup is not None:
            try:  # noqa: SIM105 (contextlib is not imported: start-up time)
                os.write(self._wakeup[1], b"\0")
            except BlockingIOError:
                pass  # a byte waits there already

    def hold(self, line: str) -> None:
        """``line`` said while an output write waits."""
        if len(self._lines) < MAX_HELD_LINES:
            self._lines.append(_stderr_bytes(line))
        else:
            self._dropped += 1
        self.write_now()

    def write_now(self) -> None:
        """Write as much of the lines held as stderr takes at once."""
        while self._lines:
            writer = self._nonblocking_writer()
            if writer < 0:
                return  # held for a stderr that may be waited for
            try:
                written = os.write(writer, self._lines[0])
            except BlockingIOError:
                return
            except OSError:  # a stderr gone: nothing more can be said to it
                self._lines, self._dropped = [], 0
                return
            rest = self._lines[0][written:]
            if rest:
                self._lines[0] = rest
            else:
                del self._lines[0]
                if not self._lines:
                    self._lines = self._dropped_note()

    def write_all(self) -> None:
        """Write every line held, waiting for stderr to take them; while
        :attr:`closing`, only until a signal of :meth:`end_on` comes, and
        then what stderr takes at once (:attr:`ended_by` says it came
        first: lines are left unsaid)."""
        if not self._lines:
            return
        self._lines += self._dropped_note()
        wakeup = self._wakeup
        writer = -1 if wakeup is None else self._nonblocking_writer()
        if wakeup is None or writer < 0:
            self._write_waiting()
            return
        self.write_now()
        while self._lines and self._signalled is None:
            self._wait_for(writer, wakeup[0])
            self.write_now()
        if self._lines:
            self.ended_by = self._signalled
            self._lines = []

    def _write_waiting(self) -> None:
        """Write every line held through stderr itself, which may wait (no
        descriptor writes it without waiting, or nothing ends the wait)."""
        lines, self._lines = self._lines, []
        try:  # noqa: SIM105 (contextlib is not imported: start-up time)
            _write_whole(sys.stderr, b"".join(lines))
        except OSError:
            pass  # a stderr that went away: nothing more can be said to it

    def wait_writable(self, writer: int) -> int | None:
        """Wait until ``writer`` can be written (or fails), only until a
        signal of :meth:`end_on` comes: that signal, else ``None``."""
        assert self._wakeup is not None, "end_on_signals() first"
        if self._signalled is None:
            self._wait_for(writer, self._wakeup[0])
        return self._signalled

    @staticmethod
    def _wait_for(writer: int, wakeup: int) -> None:
        """Wait until ``writer`` can be written (or fails) or a signal wakes
        ``wakeup`` (drained: the caller looks at what came)."""
        poll = select.poll()
        poll.register(writer, select.POLLOUT)
        poll.register(wakeup, select.POLLIN)
        poll.poll()  # (a handler's EINTR is retried: its byte then wakes it)
        try:
            while os.read(wakeup, 64):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close the descriptor opened to write without waiting, if one was,
        and end :meth:`end_on`: its handlers are put back."""
        writer = self._writer
        if writer is not None and writer >= 0 and writer != self._stderr_fd:
            os.close(writer)
        self._writer = None
        for signum, handler in self._replaced.items():
            signal.signal(signum, handler)
        self._replaced = {}
        wakeup, self._wakeup = self._wakeup, None
        for fd in wakeup or ():
            os.close(fd)
        self.closing, self.ended_by, self._signalled = False, None, None

    def _dropped_note(self) -> list[bytes]:
        """The line that says how many more lines were not held, if any
        were not (said after those held)."""
        dropped, self._dropped = self._dropped, 0
        if not dropped:
            return []
        note = (
            f"sdexec: {dropped} more lines not said: stderr took none while"
            f" the output waited for its reader (the first {MAX_HELD_LINES}"
            " were held)"
        )
        return [_stderr_bytes(note)]

    def _nonblocking_writer(self) -> int:
        """A descriptor that writes to stderr without waiting for it, -1 if
        none can be had: one that :func:`_nonblocking_twin` gives, or stderr
        itself where a write to it never waits (a file, /dev/null)."""
        if self._writer is None:
            try:
                fd = sys.stderr.fileno()
            except (OSError, ValueError):  # not a descriptor (a test's capture)
                fd = -1
            self._stderr_fd = fd
            self._writer = -1 if fd < 0 else _nonblocking_twin(fd)
            if self._writer == fd and _may_wait(fd):
                self._writer = -1  # a socket, a pipe of another user
        return self._writer


_held = _HeldLines()


def _stderr_bytes(line: str) -> bytes:
    """``line`` and its newline as ``print`` would write them to stderr."""
    return f"{line}\n".encode(sys.stderr.encoding or "utf-8", "backslashreplace")


# -- the commands' own output on stdout ----------------------------------------


def print_out(*values: object, sep: str = " ") -> None:
    """``values`` on our stdout, as ``print`` writes them: every command's
    own output (a listing, a pid) goes through here or :func:`flush_out`.

    A stdout that cannot take it (a full disk; one closed when we started:
    ``EBADF``) is :class:`~sdexec.rpc.SdexecError` ``cannot write stdout:
    …``, one line and status 1 (not "unexpected error": with
    ``PYTHONUNBUFFERED`` or a listing past the buffer, ``print`` itself
    fails); a reader gone stays ``BrokenPipeError``, the caller's quiet 141.
    Written whole though stdout is non-blocking (a file description it
    shares with a program that set ``O_NONBLOCK``): ``print`` wrote what
    the pipe took, then failed ("write could not complete without
    blocking"), or, unbuffered (``PYTHONUNBUFFERED``), dropped the rest of
    a listing longer than the pipe held, and exited 0.
    """
    text = sep.join(map(str, values)) + "\n"
    _checked_stdout(lambda: write_stdout_whole(text))


def write_stdout_whole(text: str) -> None:
    """``text`` on stdout, as ``print`` encodes it, all of it: a
    non-blocking stdout is waited for (:class:`Output`), and its error
    raised as it came."""
    _write_whole(sys.stdout, text)


def _write_whole(stream: TextIO, text: str | bytes) -> None:
    """``text`` on ``stream`` (our stdout or stderr), after what its buffer
    holds, all of it: as ``print`` encodes it, or as bytes already so
    encoded. A non-blocking descriptor is waited for (:class:`Output`),
    and its error raised as it came."""
    stream.flush()  # first: in the order written
    encoding = stream.encoding or "utf-8"
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a descriptor (a test's capture)
        stream.write(
            text if isinstance(text, str) else text.decode(encoding, "replace")
        )
        return
    if isinstance(text, str):
        text = text.encode(encoding, stream.errors or "strict")
    problem = Output(fd).write(text)
    if problem is not None:
        raise problem


def flush_out() -> None:
    """Write out what :func:`print_out` left in stdout's buffer, checked as
    it checks: a `run --bg` pid lost to a full disk is not exit 0."""
    _checked_stdout(sys.stdout.flush)


def print_out_unless_signalled(line: str) -> int | None:
    """``line`` on our stdout, flushed, as :func:`print_out` writes and
    checks it, but once :func:`end_on_signals` has been called: a stdout
    that waits for a reader who takes nothing (``| less``, less stopped; a
    full pipe nobody reads) is waited for only until one of its signals
    comes. That signal (the line then not written, or only its start),
    else ``None``. Through :func:`print_out`, the write blocked in the
    kernel and a ^C or SIGTERM could not end ``run --bg``."""
    flush_out()  # first: in the order written
    data = f"{line}\n".encode(
        sys.stdout.encoding or "utf-8", sys.stdout.errors or "strict"
    )
    fd = own_fd(1)
    writer = _nonblocking_twin(fd)
    try:
        return _write_unless_signalled(writer, memoryview(data))
    finally:
        if writer != fd:
            os.close(writer)


def _write_unless_signalled(writer: int, data: memoryview) -> int | None:
    """:func:`print_out_unless_signalled`'s writes of ``data``."""
    while data:
        try:
            data = data[os.write(writer, data) :]
        except BlockingIOError:
            signum = _held.wait_writable(writer)
            if signum is not None:
                return signum
        except BrokenPipeError:
            raise  # a reader gone: the caller's quiet 141, as print_out's
        except OSError as error:
            raise SdexecError(f"cannot write stdout: {error.strerror}") from None
    return None


def _checked_stdout(write: Callable[[], None]) -> None:
    try:
        write()
    except BrokenPipeError:
        raise
    except OSError as error:
        raise SdexecError(f"cannot write stdout: {error.strerror}") from None


# -- the service ---------------------------------------------------------------


def connect(
    loop: Loop, options: argparse.Namespace, while_waiting: bool = False
) -> Connection:
    """A connection on ``loop`` to the service's socket: ``--socket``,
    else the default (:func:`sdexec.rpc.resolve_socket_path`); served
    ``while_waiting`` as :class:`~sdexec.syncclient.Connection` says."""
    path = resolve_socket_path(options.socket)
    return Connection(loop, path, while_waiting=while_waiting)


def request(options: argparse.Namespace, topic: str, payload: dict) -> dict:
    """One request on a connection of its own; its response's payload."""
    with Loop() as loop, connect(loop, options) as connection:
        return connection.call(topic, payload)


# -- the process's output ------------------------------------------------------


def _never() -> bool:
    return False


class Output:
    """One of our output fds, written whole even if it is non-blocking.

    Given the ``loop`` (commands that catch signals: ``run``, ``attach``),
    a pipe or terminal is written through a non-blocking descriptor of its
    own, so that a write waiting for a slow reader (or a terminal paused
    with Ctrl-S) serves the signals that come meanwhile: ``run`` forwards
    them, ``attach`` detaches. ``gave_up()`` true: the rest of the data is
    not wanted (detached)."""

    def __init__(
        self, fd: int, loop: Loop | None = None, gave_up: Callable[[], bool] = _never
    ) -> None:
        self.fd = fd
        self.broken = False
        self._loop = loop
        self._gave_up = gave_up
        #: The descriptor written to, chosen at the first write.
        self._writer: int | None = None
        #: Whether a write waits for a reader now.
        self.waiting = False

    def write(self, data: bytes) -> OSError | None:
        """Write all of ``data``; the error if the fd cannot take it (after
        which this output is broken and writes nothing)."""
        writer = self._writer_fd()
        view = memoryview(data)
        while view and not self._gave_up():
            try:
                view = view[os.write(writer, view) :]
            except BlockingIOError:
                # Waiting, rather than losing output, is the back-pressure:
                # nothing more is read from the service meanwhile.
                self._wait(writer)
            except OSError as failure:
                self.broken = True
                return failure
        _held.write_now()  # what was said meanwhile, if stderr takes it now
        return None

    def close(self) -> None:
        """Close the descriptor opened for the writes, if one was."""
        if self._writer is not None and self._writer != self.fd:
            os.close(self._writer)
        self._writer = None

    def _wait(self, writer: int) -> None:
        if self._loop is None:
            select.select([], [writer], [])
            return
        self.waiting = True
        _held.waits += 1  # what is said meanwhile must not wait for stderr
        try:
            self._loop.wait_writable(writer, self._gave_up)
        finally:
            self.waiting = False
            _held.waits -= 1

    def _writer_fd(self) -> int:
        if self._writer is None:
            self._writer = self.fd if self._loop is None else _nonblocking_twin(self.fd)
        return self._writer


#: A pty master's device (``/dev/ptmx``): opening it again makes a new
#: pty, whose output nobody reads.
_PTMX = os.makedev(5, 2)


def _may_wait(fd: int) -> bool:
    """Whether a write to ``fd`` may wait for a reader: a blocking pipe,
    socket or terminal."""
    try:
        mode = os.fstat(fd).st_mode
        waits = stat.S_ISSOCK(mode) or _waits_for_peer(fd, mode)
        return waits and os.get_blocking(fd)
    except OSError:
        return True


def _waits_for_peer(fd: int, mode: int) -> bool:
    """Whether ``fd`` (of file mode ``mode``) is a pipe or a terminal, whose
    reads and writes wait for the other end, unlike a file's."""
    return stat.S_ISFIFO(mode) or (stat.S_ISCHR(mode) and os.isatty(fd))


def _nonblocking_twin(fd: int, access: int = os.O_WRONLY) -> int:
    """A non-blocking descriptor of the pipe or terminal ``fd`` writes to
    (``access``: or reads from, ``O_RDONLY``), opened anew: ``O_NONBLOCK``
    on ``fd`` itself would be set on a file description we share with the
    shell and the rest of the pipeline. ``fd`` itself where a write or read
    cannot wait long (a file, whose offset a new description would not
    share either), where it is non-blocking already, or where it cannot be
    opened again (a socket, a pipe of another user, a pty master): there a
    write or read may block the loop, as before."""
    try:
        status = os.fstat(fd)
        mode = status.st_mode
        waits = _waits_for_peer(fd, mode)
        if not waits or not os.get_blocking(fd) or status.st_rdev == _PTMX:
            return fd
        flags = access | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        return os.open(f"/proc/self/fd/{fd}", flags)
    except OSError:
        return fd


def nonblocking_reader(fd: int) -> int:
    """A non-blocking descriptor to read the pipe or terminal ``fd`` from,
    opened anew (``fd`` itself where none can be, as
    :func:`_nonblocking_twin` says). Readable to ``poll()``, a blocking
    ``fd`` may have nothing left when it is read: another reader of the same
    terminal (a pager in the pipeline) took the line, and ``read()`` then
    waited for the next one, deaf to signals (review session 43 R2-1)."""
    return _nonblocking_twin(fd, os.O_RDONLY)


#: What :func:`write_output` did with an ``output`` response: wrote its
#: data (or had nothing to write) ...
WRITTEN = "written"
#: ... found that nobody reads the stream any more (``EPIPE``: a pipe whose
#: reader has gone); the stream writes nothing more ...
READER_GONE = "reader gone"
#: ... could not write it for another reason (a full disk, ``EIO``), said
#: on stderr; the stream writes nothing more ...
LOST = "lost"
#: ... dropped it as no output a client can decode (a stream other than
#: stdout and stderr, bad base64: :func:`~sdexec.rpc.output_io`), said on
#: stderr the first time; the streams write on ...
MALFORMED = "malformed"
#: ... or dropped it, its stream having failed before.
DISCARDED = "discarded"


def write_output(
    outputs: Mapping[str, Output], io: Any, where: str = OUTPUT_RESPONSE_IO
) -> str:
    """An ``output`` response's data (``io``; a wait's output item, named
    by ``where``) to our stdout or stderr; what came of it:
    :data:`WRITTEN`, :data:`READER_GONE`, :data:`LOST`, :data:`MALFORMED`
    or :data:`DISCARDED`. Only ``EPIPE`` is a reader gone: a full disk is
    output lost, which a command must not pass off as a reader's choice."""
    try:
        stream, data, _ = output_io(io, where)
    except RPCError as error:
        _say_malformed(error)
        return MALFORMED
    if not data:
        return WRITTEN
    output = outputs[stream]
    if output.broken:
        return DISCARDED
    problem = output.write(data)
    if problem is None:
        return WRITTEN
    if problem.errno == errno.EPIPE:
        return READER_GONE
    fail(f"cannot write {stream}: {problem.strerror}")
    return LOST


#: Whether malformed output was said (once: a command is a process of its
#: own, and a broken service may send every line malformed).
_malformed_said = False


def _say_malformed(error: RPCError) -> None:
    """Output no client can decode (a service's bug): dropped, said the
    first time only, in the words the library's ``EPROTO`` has for it
    (``the service's output response: io.data: invalid base64``), as it
    was once dropped unsaid, then said in words of its own."""
    global _malformed_said
    if not _malformed_said:
        _malformed_said = True
        warn(f"{error}: dropped, and any more malformed output unsaid")


def close_outputs(outputs: Mapping[str, Output]) -> None:
    """Close what each of ``outputs`` opened for its writes, once the
    command has nothing more to write."""
    for output in outputs.values():
        output.close()
