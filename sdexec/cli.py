"""The ``sdexec`` command: run processes through the sdexec service, list
them, signal them, show the service's statistics (docs/client.md).

Every failure is one line on stderr, ``sdexec: ...``, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import select
import shlex
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twisted.internet import error as twisted_error
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer, IReactorCore, IReadDescriptor
from twisted.internet.task import react
from twisted.python.failure import Failure
from zope.interface import implementer

from sdexec.client import (
    STDERR,
    STDOUT,
    WRITE_CREDIT,
    ExecHandle,
    RPCError,
    SdexecClient,
    SdexecError,
    connect,
    resolve_socket_path,
)
from sdexec.ioencode import decode_io
from sdexec.signals import parse_signal, signal_name
from sdexec.version import add_version_option

__all__ = [
    "build_command",
    "exit_code",
    "format_procs",
    "kill_target",
    "main",
    "parse_args",
]

#: Signals the client passes on to the process instead of dying of them.
FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
#: The exit status of a command that could not be found, as a shell's.
NOT_FOUND = 127
_RUN_FLAGS = STDOUT | STDERR | WRITE_CREDIT
_READ_SIZE = 64 * 1024


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``sdexec`` command line ``argv`` (default ``sys.argv[1:]``);
    return the exit status."""
    # Default dispositions until the reactor runs: a ^C while starting up
    # ends the client quietly (130) rather than with a KeyboardInterrupt.
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    _open_closed_standard_fds()
    try:
        options = parse_args(argv)
        react(_main, [options], _reactor=_install_reactor())
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0  # react always exits; this only satisfies the type checker


def _open_closed_standard_fds() -> None:
    """Put /dev/null on any of fds 0-2 that is closed: else the service's
    socket could become fd 0 and be read as our stdin."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            # The lowest free fd is this one, as the ones below it are open.
            os.open(os.devnull, os.O_RDWR)


def _install_reactor() -> IReactorCore:
    """The asyncio reactor, installed before anything imports the default."""
    from twisted.internet import asyncioreactor

    # Already installed where main() is called in a process that chose one.
    with contextlib.suppress(twisted_error.ReactorAlreadyInstalledError):
        asyncioreactor.install()
    from twisted.internet import reactor

    return reactor  # type: ignore[return-value]


# -- command line ------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``SystemExit(2)`` with a usage message if it
    is wrong."""
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdexec", description="Run processes as transient systemd units."
    )
    add_version_option(parser)
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="the service's socket (default: $SDEXEC_SOCKET, else"
        " $XDG_RUNTIME_DIR/sdexec/sdexec.sock)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(commands)
    commands.add_parser("ps", help="list the service's processes")
    kill = commands.add_parser("kill", help="signal a process by pid or label")
    kill.add_argument(
        "signum",
        metavar="SIGNUM",
        type=_signal_argument,
        help="a signal name (TERM, SIGTERM) or number",
    )
    kill.add_argument(
        "target",
        metavar="PID|LABEL",
        type=kill_target,
        help="a process id, or else a label",
    )
    stats = commands.add_parser("stats", help="print the service's statistics as JSON")
    stats.add_argument(
        "--url",
        help="read them from the stats endpoint instead of the socket,"
        " e.g. http://127.0.0.1:8490/stats",
    )
    commands.add_parser("undrain", help="let a drained service run processes again")
    return parser


def _add_run(commands: Any) -> None:
    run = commands.add_parser("run", help="run a command and wait for it")
    run.add_argument(
        "-n",
        "--noinput",
        action="store_true",
        help="do not send stdin to the process (it reads EOF)",
    )
    run.add_argument(
        "--setopt",
        metavar="KEY=VAL",
        action="append",
        default=[],
        type=_setopt,
        help="a subprocess option, e.g. SDEXEC_PROP_MemoryMax=512M (repeatable)",
    )
    run.add_argument("--label", metavar="L", help="a name for kill and ps")
    run.add_argument(
        "--dir", metavar="DIR", help="working directory (default: the current one)"
    )
    run.add_argument("cmd", metavar="CMD", help="the command")
    run.add_argument(
        "args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments"
    )


def _setopt(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VAL")
    return key, value


def _signal_argument(text: str) -> int:
    try:
        return parse_signal(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def kill_target(text: str) -> dict[str, Any]:
    """The ``sdexec.kill`` target for ``PID|LABEL``: all digits is a pid,
    anything else a label."""
    return {"pid": int(text)} if text.isdigit() else {"label": text}


def build_command(
    options: argparse.Namespace, environ: Mapping[str, str], cwd: str
) -> dict[str, Any]:
    """The RFC 42 command object for ``sdexec run``: the client's whole
    environment and working directory (``--dir`` relative to ``cwd``)."""
    command: dict[str, Any] = {
        "cmdline": [options.cmd, *options.args],
        "env": dict(environ),
        "opts": dict(options.setopt),
        "cwd": os.path.join(cwd, options.dir) if options.dir else cwd,
        "channels": [],
    }
    if options.label is not None:
        command["label"] = options.label
    return command


def exit_code(status: int) -> int:
    """The client's exit status for the process's wait status: its exit
    code, or 128+N if signal N killed it."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# -- running -------------------------------------------------------------------


async def _main(reactor: Any, options: argparse.Namespace) -> None:
    await _running(reactor)
    try:
        code = await _COMMANDS[options.command](reactor, options)
    except SdexecError as failure:
        code = _fail(str(failure))
    except Exception as failure:
        # A bug, or something Twisted raised that we did not foresee: still
        # one line, never a traceback.
        code = _fail(f"unexpected error: {type(failure).__name__}: {failure}")
    raise SystemExit(code)


def _running(reactor: Any) -> Deferred[None]:
    # react() calls main before reactor.run() installs its SIGTERM handler;
    # ours must come after it.
    started: Deferred[None] = Deferred()
    reactor.callWhenRunning(started.callback, None)
    return started


def _fail(message: str) -> int:
    """Say what went wrong in one line on stderr; the exit status 1."""
    print(f"sdexec: {message}", file=sys.stderr)
    return 1


async def _connected(reactor: Any, options: argparse.Namespace) -> SdexecClient:
    return await connect(reactor, resolve_socket_path(options.socket))


async def _run(reactor: Any, options: argparse.Namespace) -> int:
    try:
        command = build_command(options, os.environ, os.getcwd())
    except OSError as failure:
        why = failure.strerror
        raise SdexecError(f"cannot get the current directory: {why}") from None
    signals = _SignalForwarder(reactor)
    client = await _connected(reactor, options)
    job = _Job(signals.send)
    handle = client.exec(command, _RUN_FLAGS, job.on_response)
    signals.attach(handle)
    if options.noinput:
        handle.close_stdin()
    else:
        handle.registerProducer(_StdinReader(reactor, handle), streaming=True)
    try:
        await handle.done
    except RPCError as failure:
        _fail(str(failure))
        return NOT_FOUND if failure.errnum == errno.ENOENT else 1
    finally:
        await client.close()
    return job.exit_code()


async def _ps(reactor: Any, options: argparse.Namespace) -> int:
    listing = await _call(reactor, options, SdexecClient.list)
    print(format_procs(listing.get("procs", [])))
    return 0


async def _kill(reactor: Any, options: argparse.Namespace) -> int:
    def kill(client: SdexecClient) -> Deferred[dict]:
        return client.kill(**options.target, signum=options.signum)

    await _call(reactor, options, kill)
    return 0


async def _stats(reactor: Any, options: argparse.Namespace) -> int:
    if options.url:
        report = await _http_stats(options.url)
    else:
        report = await _call(reactor, options, SdexecClient.stats)
    print(json.dumps(report, indent=2))
    return 0


async def _http_stats(url: str) -> dict:
    """``GET url`` (the service's stats endpoint), with treq."""
    import treq  # only this command needs it

    try:
        response = await treq.get(url, persistent=False, timeout=30)
        if response.code != 200:
            raise SdexecError(f"{url}: HTTP {response.code}")
        return await response.json()
    except SdexecError:
        raise
    except Exception as error:  # refused, timed out, not JSON: one line
        raise SdexecError(f"cannot read {url}: {error}") from None


async def _undrain(reactor: Any, options: argparse.Namespace) -> int:
    reply = await _call(reactor, options, SdexecClient.undrain)
    reason = reply.get("reason")
    print(f"undrained; the drain reason was: {reason}" if reason else "not drained")
    return 0


async def _call(
    reactor: Any,
    options: argparse.Namespace,
    request: Callable[[SdexecClient], Deferred[dict]],
) -> dict:
    """One request on a connection of its own; its response's payload."""
    # No process of ours to pass signals to: die of them, as any command does.
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    client = await _connected(reactor, options)
    try:
        return await request(client)
    finally:
        await client.close()


_COMMANDS = {
    "run": _run,
    "ps": _ps,
    "kill": _kill,
    "stats": _stats,
    "undrain": _undrain,
}


def format_procs(procs: Sequence[dict[str, Any]]) -> str:
    """``sdexec.list`` processes as a table: PID, STATE, UNIT, LABEL, CMDLINE."""
    rows = [("PID", "STATE", "UNIT", "LABEL", "CMDLINE")]
    for proc in procs:
        cmdline = shlex.join(str(arg) for arg in proc.get("cmdline") or [])
        rows.append(
            (
                str(proc.get("pid", "")),
                str(proc.get("state", "")),
                str(proc.get("unit", "")),
                str(proc.get("label") or "-"),
                cmdline,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    lines = (
        "  ".join(
            [
                *(cell.ljust(width) for cell, width in zip(row, widths, strict=False)),
                row[4],
            ]
        )
        for row in rows
    )
    return "\n".join(lines)


# -- the pieces of `sdexec run` -------------------------------------------------


class _SignalForwarder:
    """Passes the forwarded signals to the process as ``kill`` requests.

    Signals that arrive before the exec request is sent are held; the handle
    itself holds those that arrive before ``started``.
    """

    def __init__(self, reactor: Any) -> None:
        self._handle: ExecHandle | None = None
        self._held: list[int] = []
        for signum in FORWARDED_SIGNALS:
            # A Python signal handler runs between bytecodes of the main
            # thread; callFromThread wakes the reactor to act on it.
            signal.signal(signum, lambda n, _: reactor.callFromThread(self.send, n))

    def attach(self, handle: ExecHandle) -> None:
        self._handle = handle
        held, self._held = self._held, []
        for signum in held:
            self.send(signum)

    def send(self, signum: int) -> None:
        if self._handle is None:
            self._held.append(signum)
        else:
            self._handle.kill(signum).addErrback(_kill_failed, signum)


def _kill_failed(failure: Failure, signum: int) -> None:
    gone = failure.check(RPCError) and failure.value.errnum == errno.ESRCH
    if not gone:  # a process that has already exited needs no signal
        _fail(f"kill {signal_name(signum)}: {failure.getErrorMessage()}")


class _Job:
    """What `sdexec run` does with the exec responses: output to our own
    stdout and stderr, the wait status kept for the exit code."""

    def __init__(self, send_signal: Callable[[int], None]) -> None:
        self._outputs = {"stdout": _Output(1), "stderr": _Output(2)}
        self._send_signal = send_signal
        self._status: int | None = None

    def on_response(self, payload: dict) -> None:
        if payload.get("type") == "output":
            self._output(payload.get("io"))
        elif payload.get("type") == "finished":
            self._status = payload.get("status")

    def exit_code(self) -> int:
        if not isinstance(self._status, int):
            return _fail("the service ended the stream without a finished response")
        return exit_code(self._status)

    def _output(self, io: Any) -> None:
        try:
            stream, data, _ = decode_io(io)
        except ValueError as failure:
            _fail(f"bad output from the service: {failure}")
            return
        output = self._outputs.get(stream)
        if output is None or not data or output.broken:
            return
        problem = output.write(data)
        if problem is not None:
            # As if the process wrote to our stdout itself: SIGPIPE.
            if problem.errno != errno.EPIPE:
                _fail(f"cannot write {stream}: {problem.strerror}")
            self._send_signal(signal.SIGPIPE)


class _Output:
    """One of our output fds, written whole even if it is non-blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.broken = False

    def write(self, data: bytes) -> OSError | None:
        """Write all of ``data``; the error if the fd cannot take it (after
        which this output is broken and writes nothing)."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                # Someone made our fd non-blocking: wait instead of losing
                # output. Blocking the reactor here is the back-pressure.
                select.select([], [self.fd], [])
            except OSError as failure:
                self.broken = True
                return failure
        return None


@implementer(IReadDescriptor, IPushProducer)
class _StdinReader:
    """Reads our stdin into the process's, no more at a time than the
    credit, paused by the handle while there is none; EOF closes the
    process's stdin.

    The fd is left blocking (it may be a terminal shared with the shell):
    it is only read when the reactor says it is readable.
    """

    def __init__(self, reactor: Any, handle: ExecHandle, fd: int = 0) -> None:
        self._reactor = reactor
        self._handle = handle
        self._fd = fd
        self._stopped = False
        reactor.addReader(self)

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "stdin"

    def doRead(self) -> Exception | None:
        credit = self._handle.credit
        size = _READ_SIZE if credit is None else max(1, min(_READ_SIZE, credit))
        try:
            data = os.read(self._fd, size)
        except BlockingIOError:
            return None
        except OSError as failure:
            return failure
        if not data:
            return twisted_error.ConnectionDone()
        self._handle.write(data)
        return None

    def connectionLost(self, reason: Failure) -> None:
        # Only the reactor calls this, at EOF or a read error: never after
        # stopProducing, so the process's stdin is still open.
        if not reason.check(twisted_error.ConnectionDone):
            _fail(f"cannot read stdin: {reason.getErrorMessage()}")
        self._stopped = True
        self._handle.close_stdin()

    def pauseProducing(self) -> None:
        self._reactor.removeReader(self)

    def resumeProducing(self) -> None:
        if not self._stopped:
            self._reactor.addReader(self)

    def stopProducing(self) -> None:
        self._stopped = True
        self._reactor.removeReader(self)


if __name__ == "__main__":
    sys.exit(main())
