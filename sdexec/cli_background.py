"""``sdexec run --bg``, ``sdexec wait`` and ``sdexec attach``: background
processes from the command line (docs/client.md).

Like the rest of the command line this runs on :mod:`sdexec.syncclient`,
never Twisted; :mod:`sdexec.cli` loads it only for these commands. What
the two share (stderr lines, output writes, the connection) is
:mod:`sdexec.cliio`.
"""

from __future__ import annotations

import argparse
import errno
import signal

from sdexec.cliio import (
    EXEC_FAILURES,
    INTERRUPTING_SIGNALS,
    LOST,
    MALFORMED,
    READER_GONE,
    UNFINISHED,
    Output,
    close_outputs,
    connect,
    end_on_signals,
    exit_code,
    fail,
    own_fd,
    print_out_unless_signalled,
    request,
    say,
    say_end,
    say_killed,
    signalled_status,
    warn,
    warn_after_finished,
    write_output,
)
from sdexec.protocolbase import NOT_WAITABLE, STATUS_AND_ERROR, ExecFlags, Topics
from sdexec.receipt import Receipt
from sdexec.refusal import one_line
from sdexec.rpc import (
    RPCError,
    SdexecError,
    background_pid,
    dropped_counts,
    finished_receipt,
    wait_outcome,
)
from sdexec.signals import signal_name
from sdexec.syncclient import ON_ITS_WAY_S, Call, Connection, Exec, Loop

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any

__all__ = ["attach", "run_background", "wait"]

#: Signals that detach ``sdexec attach`` (the process runs on).
DETACHING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_BOTH = ExecFlags.STDOUT | ExecFlags.STDERR


def run_background(options: argparse.Namespace, command: dict[str, Any]) -> int:
    """``sdexec run --bg``: start ``command`` in the background and print
    its pid (and label); as a shell, 127 if the command cannot be found,
    126 if it cannot be executed. Interrupted while it starts, it waits for
    the answer (:class:`_Starting`)."""
    flags = ExecFlags.WAITABLE if options.waitable else 0
    payload = {"cmd": command, "flags": flags}
    with Loop() as loop:
        starting = _Starting()
        loop.catch_signals(INTERRUPTING_SIGNALS, starting.interrupt)
        failed: SdexecError | None = None
        try:
            with connect(loop, options) as connection:
                connection.send(Topics.EXEC, payload, starting.call, streaming=False)
                loop.run_until(starting.over)
        except SdexecError as error:
            failed = error
        # A signal that cut a waiting connect short (a wedged service's full
        # backlog) left the socket unconnected, and the loss of the first
        # write was seen before it: it is what to report, as a foreground
        # run's (review session 40 R2-1).
        loop.serve_caught_signals()
        if failed is not None and starting.signum is None:
            raise failed
    end_on_signals()  # a signal from now on ends a wait for our stdout, stderr
    interrupted = starting.signum
    if interrupted is not None and not _answered_by_the_service(starting.call):
        code = fail(
            f"interrupted by {signal_name(interrupted)} before the answer: the"
            " process may start in the background all the same (sdexec ps)"
        )
    else:  # (with no answer, the connection's close failed the call)
        code = _started(starting.call, command.get("label"), interrupted)
    return code if interrupted is None else signalled_status(interrupted)


def _answered_by_the_service(call: Call) -> bool:
    """Whether the service answered ``call``: a lost connection fails it
    with no word of the service's."""
    return call.answered and (call.error is None or isinstance(call.error, RPCError))


class _Starting:
    """A background exec's answer awaited, and the signals that interrupt
    it meanwhile. The service starts the process whatever becomes of us
    (a closed connection stops only a streaming one), so a Ctrl-C that
    killed us left it running with its pid unsaid: the first such signal
    is held until the answer, to say the pid of a process that started; a
    second gives up at once."""

    def __init__(self) -> None:
        self.call = Call()
        #: The first interrupting signal, and how many came.
        self.signum: int | None = None
        self._count = 0

    def interrupt(self, signum: int) -> None:
        self._count += 1
        if self.signum is None:
            self.signum = signum
            say(
                f"sdexec: {signal_name(signum)}: waiting for the service's answer,"
                " to say the pid of a process that starts (again to give up)"
            )

    def over(self) -> bool:
        return self.call.answered or self._count > 1


def _started(call: Call, label: str | None, interrupted: int | None) -> int:
    """Print the pid (and label) of a background exec that ``call`` says
    started, and, if ``interrupted`` came meanwhile, that it runs on; the
    exit status (127, 126 as a shell's for a command it could not run)."""
    try:
        if call.error is not None:
            raise call.error
        assert call.payload is not None
        pid = background_pid(call.payload)
    except SdexecError as failure:
        errnum = failure.errnum if isinstance(failure, RPCError) else 0
        if errnum not in EXEC_FAILURES and interrupted is None:
            raise
        fail(str(failure))
        return EXEC_FAILURES.get(errnum, 1)  # as the foreground run's
    unsaid_by = _say_pid(pid, label)
    if interrupted is not None:
        say(
            f"sdexec: interrupted by {signal_name(interrupted)} while starting:"
            f" pid {pid} runs on in the background (sdexec kill TERM {pid})"
        )
    return 0 if unsaid_by is None else signalled_status(unsaid_by)


def _say_pid(pid: int, label: str | None) -> int | None:
    """The started process's pid (and label) on stdout, flushed; a stdout
    that cannot take it (a full disk, ``>&-``) fails the command naming
    the pid on stderr: "cannot write stdout" alone, exit 1, read as a
    start that failed, and the process ran on with its pid said nowhere
    (a script's retry started it twice). A stdout nobody reads (``| less``,
    less stopped) is waited for only until a signal ends the command
    (docs/client.md, Signals), the pid then said on stderr: that signal,
    else ``None``."""
    try:
        # The label as ps shows it, on one line: a line break or an escape
        # code in it broke the "PID LABEL" line a script reads, and the
        # terminal it was printed to.
        signum = print_out_unless_signalled(
            str(pid) if label is None else f"{pid} {one_line(label)}"
        )
    except SdexecError as failure:
        raise SdexecError(f"{failure}: {_runs_on(pid)}") from None
    if signum is not None:
        warn(
            f"interrupted by {signal_name(signum)} while the pid waited for"
            f" stdout's reader: {_runs_on(pid)}"
        )
    return signum


def _runs_on(pid: int) -> str:
    """What the command says of a process it started whose pid its
    stdout did not take."""
    return (
        f"pid {pid} started all the same, and runs on in the background"
        f" (sdexec kill TERM {pid})"
    )


def wait(options: argparse.Namespace) -> int:
    """``sdexec wait PID|LABEL``: the retained output to our stdout and
    stderr, in the order it was produced; the process's exit code (1, after
    the error, where the stream ended with one before it finished)."""
    # The status and output even where the stop timer gave up on what the
    # command left: said after them, as run says it.
    answer = _wait_answer(options)
    # No status beside an error: the stream ended with it before `finished`
    # (a job declared unkillable). Its output is written all the same, then
    # the error said, as attach does.
    status, after = wait_outcome(answer)
    _say_dropped(dropped_counts(answer, "wait"))
    outputs = {"stdout": Output(own_fd(1)), "stderr": Output(own_fd(2))}
    lost = False
    for index, io in enumerate(answer.get("output", [])):
        # Waited for once, the output cannot be had again: its loss is
        # said, and fails the command (a reader gone is not a loss).
        outcome = write_output(outputs, io, f"wait: output[{index}]")
        lost = outcome in (LOST, MALFORMED) or lost
    if status is None:
        return fail(str(after))
    say_end(Receipt.from_finished({**answer, "status": status}), after)
    code = exit_code(status)
    return (code or 1) if lost else code


def _wait_answer(options: argparse.Namespace) -> dict[str, Any]:
    """The service's answer to ``wait``'s request; its refusal of a process
    not started waitable says how to start one that is: the service's
    words ("not started with flag 16") name the protocol's flag, which
    nobody types."""
    payload = {**options.target, STATUS_AND_ERROR: True}
    try:
        return request(options, Topics.WAIT, payload)
    except RPCError as error:
        if error.errnum != errno.EINVAL or not error.errstr.endswith(NOT_WAITABLE):
            raise
        raise SdexecError(
            f"{error}: only a process started with sdexec run --bg --waitable"
            " can be waited for"
        ) from None


def _say_dropped(dropped: dict[str, int]) -> None:
    """One line on stderr, before the output, if its oldest part was lost."""
    if not any(dropped.values()):
        return
    counts = ", ".join(
        f"{dropped.get(s, 0)} bytes of {s}" for s in ("stdout", "stderr")
    )
    say(f"sdexec: {counts} dropped before this (the service's retained-output)")


def attach(options: argparse.Namespace) -> int:
    """``sdexec attach PID|LABEL``: the process's output from its retained
    part on, to our stdout and stderr; its exit code if it ends. Ctrl-C
    (SIGINT, SIGTERM, SIGHUP) detaches: the process runs on."""
    with Loop() as loop:
        session = _Attached(loop)
        loop.catch_signals(DETACHING_SIGNALS, session.detach)
        try:
            with connect(loop, options) as connection:
                stream = connection.attach(options.target, _BOTH, session.respond)
                loop.run_until(
                    lambda: stream.ended or session.detached or _killed(stream)
                )
                if session.detached and not stream.ended:
                    _read_on_for_the_end(connection, stream)
            if stream.pid is None:
                # A signal that cut a waiting connect short (a wedged
                # service's full backlog) left the socket unconnected, and
                # the loss of the first write ended the stream before the
                # loop served it: it is what to report, as run's.
                loop.serve_caught_signals()
        finally:
            close_outputs(session.outputs)
        end_on_signals()  # a second ^C from now on ends a wait for our stderr
    if stream.killed_for is not None:
        return say_killed(stream)
    # Closing the connection is what detaches, on the service's side.
    if session.detached and stream.pid is None:
        # Nothing was attached: a service slow to answer, a target that
        # may not exist. "Detached from pid ?; it runs on" said otherwise.
        name = signal_name(session.detached_by)
        warn(f"interrupted by {name} before the service answered the attach")
        return signalled_status(session.detached_by)
    if session.detached:
        _say_detached(stream, session.status)
        # Output lost (a full disk) is an error, said above; a reader gone
        # or a Ctrl-C is the user's choice. A Ctrl-C is still died of, so
        # that a script's loop of attaches stops, as it does for `run`.
        if session.output_lost:
            return 1
        ctrl_c = session.detached_by == signal.SIGINT
        return signalled_status(signal.SIGINT) if ctrl_c else 0
    # `finished` brings the status and the receipt together (_Attached).
    if stream.error is not None and session.receipt is None:
        return fail(str(stream.error))
    if session.receipt is None:
        return fail(UNFINISHED)
    say_end(session.receipt, stream.error)
    code = exit_code(session.receipt.status)
    return (code or 1) if session.output_lost else code  # said as it was


def _killed(stream: Exec) -> bool:
    """Whether the attached process was killed for a broken protocol
    (:func:`~sdexec.cliio.say_killed`): ``attach`` ends there."""
    return stream.killed_for is not None


#: How long a detached ``attach`` reads on for the process's end, at most.
#: An ended process's replay comes with its end, sent as fast as it is read
#: (sdexec/attachfeed.py): a retained-output of megabytes comes in
#: milliseconds. Output that keeps coming, of a process that runs on, is
#: left unread past it.
_END_WITHIN_S = ON_ITS_WAY_S
#: How long a gap in what comes says that no end follows: a process that
#: runs on has printed what it had; the replay comes as fast as it is read.
_END_QUIET_S = 0.2


def _read_on_for_the_end(connection: Connection, stream: Exec) -> None:
    """Detached, read what the service has sent, its output dropped (our
    stdout is what stopped us), for the process's end: an ended process's
    replay comes with it, and a read takes at most 256 KiB of it, so its
    ``finished`` often waits unread behind the output that blocked us
    (review session 42 R1). Bounded: a process that runs on sends none."""
    connection.receive_until(lambda: stream.ended, _END_QUIET_S, _END_WITHIN_S)


def _say_detached(stream: Exec, status: int | None) -> None:
    """The line ``attach`` says when it detaches: a process whose end came
    with the replay (it had ended) does not run on, and its end is gone;
    an end without a status is said in the service's words."""
    # The service's error, not the loss our own close of the connection
    # gave a stream that had not ended.
    ended_with = stream.error if isinstance(stream.error, RPCError) else None
    if status is not None:
        say(
            f"sdexec: detached from pid {stream.pid}, which had ended (exit code"
            f" {exit_code(status)}): its end went to this attach"
        )
        if ended_with is not None:
            warn_after_finished(ended_with)
    elif ended_with is not None:
        # ECHILD, "unit U ended without an exit status", as an attach that
        # was not detached would say it.
        warn(f"detached from pid {stream.pid}, whose stream had ended: {ended_with}")
    else:
        say(f"sdexec: detached from pid {stream.pid}; it runs on")


class _Attached:
    """What ``sdexec attach`` does with the stream's responses."""

    def __init__(self, loop: Loop) -> None:
        # A detach ends a write that waits for a reader.
        self.outputs = {
            "stdout": Output(own_fd(1), loop, self._gave_up),
            "stderr": Output(own_fd(2), loop, self._gave_up),
        }
        self.status: int | None = None
        #: What ``finished`` said of the end beside the status.
        self.receipt: Receipt | None = None
        self.detached = False
        #: The signal that detached us; 0 for none (our output went).
        self.detached_by = 0
        #: Whether output was lost: to a write that failed (not a reader
        #: gone), or as malformed (:data:`~sdexec.cliio.MALFORMED`).
        self.output_lost = False

    def respond(self, payload: dict) -> None:
        kind = payload.get("type")
        if kind == "finished" and self.receipt is None:
            self.receipt = finished_receipt(payload)
            self.status = None if self.receipt is None else self.receipt.status
        elif kind == "attached":
            _say_dropped(dropped_counts(payload, "attached"))
        elif kind == "output":
            self._output(payload.get("io"))

    def detach(self, signum: int = 0) -> None:
        self.detached = True
        self.detached_by = self.detached_by or signum

    def _gave_up(self) -> bool:
        return self.detached

    def _output(self, io: Any) -> None:
        # Our output cannot be written any more: leave the process be (it
        # is not the reader's to end, as `run`'s is).
        outcome = write_output(self.outputs, io)
        if outcome in (READER_GONE, LOST):
            self.output_lost = outcome == LOST
            self.detach()
        elif outcome == MALFORMED:  # (the rest is written: attached on)
            self.output_lost = True
