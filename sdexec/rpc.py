"""A client's side of the protocol, without Twisted (docs/client.md).

What the Twisted library (``sdexec.client``) and the command line's
synchronous client (``sdexec.syncclient``) share, so that both answer the
service alike: the errors they raise, where the socket is, the request
envelope, how responses find their request, RFC 42 stdin credit, and where
the service's refusal of a write to stdin goes.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Mapping

from sdexec import protocolbase
from sdexec.ioencode import DecodedIO, decode_io
from sdexec.protocolbase import (
    DEFAULT_STDIN_BUFSIZE,
    MAX_MATCHTAG,
    MAX_SOCKET_PATH,
    SOCKET_ENV,
    SYSTEM_SOCKET,
    chosen_socket_path,
)
from sdexec.receipt import Receipt
from sdexec.refusal import (
    MISSING,
    errno_name,
    errstr_line,
    expected,
    json_quoted,
    one_line,
)

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any, Protocol
else:
    Protocol = object  # Pending is for type checkers; at run time a plain base

__all__ = [
    "BAD_DESCRIPTOR",
    "ConnectionFailed",
    "Pending",
    "RPCError",
    "RefusableStdin",
    "Requests",
    "SdexecError",
    "StdinCredit",
    "StdinRefusals",
    "StreamCheck",
    "background_pid",
    "bad_stdio",
    "cannot_connect",
    "check_stdio",
    "checked_answer",
    "credit_channels",
    "default_socket_path",
    "dropped_counts",
    "errno_name",
    "finished_receipt",
    "finished_status",
    "output_io",
    "process_target",
    "resolve_socket_path",
    "socket_path_unusable",
    "with_errno_name",
]


class SdexecError(Exception):
    """Any failure of a client; ``str()`` is a one-line message."""


class ConnectionFailed(SdexecError):
    """The service could not be reached, or the connection to it broke."""


class RPCError(SdexecError):
    """An error response: ``errnum`` is a Linux errno, ``errstr`` says why."""

    def __init__(self, errnum: int, errstr: str) -> None:
        self.errnum = errnum
        self.errstr = errstr or os.strerror(errnum)
        super().__init__(self.errstr)

    def __str__(self) -> str:
        return self.errstr


def with_errno_name(error: object) -> str:
    """``error`` as a log line says it: an :class:`RPCError`'s ``errstr``
    with its errno's name (``job f1 has already exited (ESRCH)``), which the
    words alone do not name, as the library's connect says ``(EAGAIN)``;
    anything else as ``str()`` says it."""
    if not isinstance(error, RPCError):
        return str(error)
    return f"{error.errstr} ({errno_name(error.errnum)})"


def default_socket_path(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR/sdexec/sdexec.sock``, where the service listens by
    default. :class:`SdexecError` if ``XDG_RUNTIME_DIR`` is unset."""
    path = protocolbase.default_socket_path(environ)
    if path is None:
        hint = ""
        if os.path.exists(SYSTEM_SOCKET):  # as under sudo, on a system unit's node
            hint = f" (the system unit's socket is {SYSTEM_SOCKET})"
        raise SdexecError(
            "XDG_RUNTIME_DIR is not set: name the socket with --socket or"
            f" {SOCKET_ENV}{hint}"
        )
    return path


def resolve_socket_path(
    option: str | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """The socket to use: ``option`` (``--socket``), else ``$SDEXEC_SOCKET``,
    else :func:`default_socket_path`."""
    chosen = chosen_socket_path(option, environ)
    return default_socket_path(environ) if chosen is None else chosen


def socket_path_unusable(path: str) -> str | None:
    """Why no UNIX socket can have ``path`` (empty, a NUL byte in it,
    longer than one holds), or ``None``: said before a connect, whose own
    words give no sizes (nor the path: a ``ValueError`` for a NUL)."""
    if not path:
        return "an empty path names no socket"
    if "\0" in path:
        return "a NUL byte in the path (a socket path is a C string)"
    size = len(os.fsencode(path))
    if size <= MAX_SOCKET_PATH:
        return None
    return f"AF_UNIX path too long ({size} bytes, at most {MAX_SOCKET_PATH})"


def cannot_connect(path: str, code: int | None, why: str = "") -> ConnectionFailed:
    """The error for a connection to ``path`` that failed with errno
    ``code`` (or for the reason ``why`` when there is no errno); the path
    as one line (:func:`one_line`): a NUL, a line break in it, and a byte
    that is not UTF-8 as that byte (``\\xff``), not its surrogate escape."""
    shown = one_line(os.fsencode(path).decode("utf-8", "backslashreplace"))
    reason = os.strerror(code) if code is not None else why
    there = _not_a_socket(path) if code == errno.ECONNREFUSED else None
    if there is not None:
        reason += f" ({shown} is {there}, not a socket)"
    elif code in (errno.ENOENT, errno.ECONNREFUSED):
        reason += " (is the sdexec service running?"
        if path != SYSTEM_SOCKET and os.path.exists(SYSTEM_SOCKET):
            reason += (
                f" the system unit's socket is {SYSTEM_SOCKET}:"
                f" give --socket or ${SOCKET_ENV}"
            )
        reason += ")"
    elif code == errno.EACCES:
        reason += (
            " (another user's service: each serves its owner and its"
            " [sdexec] allow-users)"
        )
    return ConnectionFailed(f"cannot connect to {shown}: {reason}")


#: What a path that is no socket is, by its file type: ``--socket
#: /dev/null`` said "a file" of a character device.
_FILE_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
)


def _not_a_socket(path: str) -> str | None:
    """What is at ``path`` if it is something other than a socket (a
    directory, a file, a device, a FIFO), else ``None``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return next((what for is_type, what in _FILE_TYPES if is_type(mode)), "a file")


class Pending(Protocol):
    """A request waiting for its responses."""

    #: Whether more than one response may come (``sdexec.exec``).
    streaming: bool

    def respond(self, payload: dict) -> None:
        """A response's payload."""

    def end(self, error: SdexecError) -> None:
        """The last response was an error (ENODATA ends a stream well), or
        the connection went first."""


class RefusableStdin(Protocol):
    """An exec whose stdin the service may refuse."""

    def stdin_refused(self, error: SdexecError) -> None:
        """The service refused a write of it, or the connection went (the
        error is then the connection's :attr:`Requests.lost`)."""


class StdinRefusals:
    """Where the service's refusal of an exec's stdin goes: the request
    tracked for the matchtag that all of the exec's writes share.

    The service answers a write only to refuse it, on the write's matchtag
    (docs/protocol.md, ``sdexec.write``). A matchtag per write would be
    tracked for ever (a write taken is never answered); RFC 6 lets requests
    whose responses go to the same place share one.
    """

    streaming = True  # as many writes as the process reads, none answered

    def __init__(self, stream: RefusableStdin) -> None:
        self._stream = stream

    def respond(self, payload: dict) -> None:
        """Nothing to do: a write taken is not answered, and one refused is
        answered with an error only (:meth:`end`)."""

    def end(self, error: SdexecError) -> None:
        """The service refused a write (or the connection went): the exec's
        stdin is told."""
        self._stream.stdin_refused(error)


class Requests:
    """The requests of one connection in flight, by matchtag.

    :meth:`new` makes a request's envelope; :meth:`dispatch` gives each
    response to its request; :meth:`lose` ends them all.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        #: Why the connection is unusable, once it is.
        self.lost: SdexecError | None = None
        self._next_matchtag = 1  # 0 is what the service uses when it has none
        self._in_flight: dict[int, Pending] = {}
        self._closing_error: RPCError | None = None

    def new(
        self,
        topic: str,
        payload: dict[str, Any],
        streaming: bool | None = None,
        matchtag: int | None = None,
    ) -> dict[str, Any]:
        """A request with the next matchtag, or ``matchtag`` (an earlier
        request's: the Twisted client's writes of one exec share one), and
        the envelope's ``streaming`` when given (false runs an exec in the
        background)."""
        if matchtag is None:
            matchtag = self._allocate()
        request = {
            "type": "request",
            "topic": topic,
            "matchtag": matchtag,
            "payload": payload,
        }
        if streaming is not None:
            request["streaming"] = streaming
        return request

    def _allocate(self) -> int:
        """The next matchtag not in flight, from 1 again after
        :data:`MAX_MATCHTAG` (RFC 6's matchtag is 32 bits: the service
        refuses a larger one, and closes the connection)."""
        while True:
            matchtag = self._next_matchtag
            self._next_matchtag = matchtag % MAX_MATCHTAG + 1
            if matchtag not in self._in_flight:
                return matchtag

    def track(self, request: dict[str, Any], pending: Pending) -> bool:
        """Route ``request``'s responses to ``pending``; ``False`` (and
        ``pending`` ended) if the connection is already lost."""
        if self.lost is not None:
            pending.end(self.lost)
            return False
        self._in_flight[request["matchtag"]] = pending
        return True

    def adopt(self, matchtag: int, pending: Pending) -> None:
        """Route the responses of a request sent before this table was made
        (on a socket taken over) to ``pending``; later requests are
        numbered after it."""
        self._in_flight[matchtag] = pending
        self._next_matchtag = max(self._next_matchtag, matchtag % MAX_MATCHTAG + 1)

    def forget(self, matchtag: int) -> None:
        """Route nothing more to the request of ``matchtag``, if it is still
        tracked (one answered only when it fails, such as writes)."""
        self._in_flight.pop(matchtag, None)

    def dispatch(self, message: dict[str, Any]) -> str | None:
        """Give ``message`` to its request; a warning to log if it answers
        none or is malformed."""
        matchtag = message.get("matchtag")
        # A bool is an int to Python: true would answer request 1.
        if isinstance(matchtag, bool) or not isinstance(matchtag, int):
            return self._unexpected(message)
        if message.get("type") != "response":
            return self._unexpected(message)
        pending = self._in_flight.get(matchtag)
        if pending is None:
            return self._unexpected(message)
        if "errnum" in message:
            error = rpc_error(message)  # made first: it may not strand the request
            del self._in_flight[matchtag]
            pending.end(error)
            return None
        # RFC 6: a response may carry no payload (RFC 42's kill answer has
        # none); it reads as an empty one.
        payload = message.get("payload", {})
        if not isinstance(payload, dict):
            # Ended, not left waiting for an answer that has come.
            del self._in_flight[matchtag]
            pending.end(RPCError(errno.EPROTO, "response payload is not an object"))
            shown = json_quoted(message, 200)
            return f"sdexec: response payload is not an object: {shown}"
        if not pending.streaming:
            del self._in_flight[matchtag]
        pending.respond(payload)
        return None

    def framing_error(self, reason: str, foreign: bool = False) -> None:
        """The service sent something that is not a message. ``foreign``:
        its stream began with no JSON object (an HTTP server's ``HTTP/1.1
        400``), which asks whether the path is an sdexec socket at all."""
        hint = f" ({self._question()})" if foreign else ""
        self.lost = ConnectionFailed(
            f"{self.path}: bad message from sdexec: {reason}{hint}"
        )

    def lose(
        self, why: str | None = None, cut_off: int = 0, foreign: bool = False
    ) -> None:
        """The connection is gone (``why``, if the client knows): end every
        request in flight. ``cut_off``: the bytes of a message that had
        come without its end (the newline), said: the rest is lost
        (``foreign``: as :meth:`framing_error`'s)."""
        if self.lost is None:
            self.lost = self._closing_error or ConnectionFailed(
                self._lost_words(cut_off, foreign) + (f": {why}" if why else "")
            )
        pending, self._in_flight = self._in_flight, {}
        for request in pending.values():
            request.end(self.lost)

    def _lost_words(self, cut_off: int, foreign: bool) -> str:
        if not cut_off:
            return f"connection to {self.path} lost"
        hint = f"; {self._question()}" if foreign else ""
        return (
            f"connection to {self.path} lost in the middle of a message"
            f" ({cut_off} bytes of it came{hint})"
        )

    def _question(self) -> str:
        """What a peer whose stream began with no JSON object asks."""
        return f"is {self.path} an sdexec socket?"

    def _unexpected(self, message: dict[str, Any]) -> str:
        # An error with matchtag 0 answers no request: the service is about to
        # close the connection (EPERM, EPROTO) and this is why. Not ignored:
        # every request then fails with it (logged as "ignoring" a message,
        # it read as if the error had been dropped).
        if message.get("matchtag") == 0 and "errnum" in message:
            self._closing_error = rpc_error(message)
            closing = with_errno_name(self._closing_error)
            return f"sdexec: the service is closing the connection: {closing}"
        # Quoted short: a confused or hostile peer's message may be megabytes.
        shown = json_quoted(message, 200)
        return f"sdexec: ignoring a message that answers no request: {shown}"


#: What an ``os.dup``/``os.fstat`` of a caller's stdio descriptor may
#: raise when it is not an open descriptor (closed, not a C int, not an int).
BAD_DESCRIPTOR = (OSError, TypeError, OverflowError)


def bad_stdio(stream: str, fd: object, error: Exception) -> ValueError:
    """The error, for the caller, of a stdio descriptor (stdio passthrough)
    that is not open: both clients say it the same way, before sending."""
    reason = error.strerror if isinstance(error, OSError) else error
    return ValueError(f"exec: stdio: {stream}: {fd!r}: {reason}")


def check_stdio(stdio: Mapping[str, int], connection: int) -> None:
    """``ValueError`` naming the first stream of ``stdio`` (stdio
    passthrough) whose descriptor is not open, or is the client's own
    ``connection`` to the service (under any number). Both clients check
    so before sending. Sent, a closed one would fail the write, and with it
    the connection and every request on it; the connection itself, its
    process would hold open once the client left, so that the service
    never saw it leave and never stopped the process (``sdexec run`` opens
    fds 0-2 before it connects for this: cliio.open_closed_standard_fds)."""
    try:
        own = _file_identity(connection)
    except OSError:
        own = None  # gone: the request fails as on any closed connection
    for stream, fd in stdio.items():
        try:
            identity = _file_identity(fd)
        except BAD_DESCRIPTOR as error:
            raise bad_stdio(stream, fd, error) from None
        if identity == own:
            raise bad_stdio(stream, fd, ValueError(_OWN_CONNECTION))


#: Why a client's own connection is no stdio descriptor (:func:`check_stdio`).
_OWN_CONNECTION = (
    "this client's own connection to the service: its process would keep it"
    " open and run on after the client left (open fds 0-2 before connecting)"
)


def _file_identity(fd: int) -> tuple[int, int]:
    """What the file open on ``fd`` is, whatever number it is under."""
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


#: Linux's errnos are below it (a larger number, or one no C int holds, is
#: no errno: ``os.strerror`` raised for those).
MAX_ERRNO = 4096


def rpc_error(message: dict[str, Any]) -> RPCError:
    """The :class:`RPCError` of an error response (``EPROTO``, naming it, if
    its ``errnum`` is no errno)."""
    errnum = message.get("errnum")
    errstr = message.get("errstr")
    errstr = errstr_line(errstr) if isinstance(errstr, str) else ""
    if type(errnum) is int and 0 < errnum < MAX_ERRNO:
        return RPCError(errnum, errstr)
    said = f"errnum {json_quoted(errnum, 40)} is no errno"
    return RPCError(errno.EPROTO, f"{said}: {errstr}" if errstr else said)


def is_end_of_stream(error: SdexecError) -> bool:
    """Whether ``error`` is the ``ENODATA`` that ends a stream well."""
    return isinstance(error, RPCError) and error.errnum == errno.ENODATA


def background_pid(answer: dict[str, Any]) -> int:
    """The pid in the answer to a background ``exec`` (its ``started``);
    :class:`RPCError` ``EPROTO`` naming what came instead, so that a broken
    service is reported as one and not as a missing key later."""
    pid = answer.get("pid")
    if answer.get("type") == "started" and type(pid) is int and pid > 0:
        return pid
    raise RPCError(
        errno.EPROTO, expected("background exec", "a started pid", answer, 200)
    )


def checked_answer(topic: str, answer: dict[str, Any]) -> dict[str, Any]:
    """``answer``, the one response to a request of ``topic``, once it has
    the shape docs/protocol.md gives it (:data:`sdexec.answers.ANSWERS`):
    both clients check every answer so, once, before a caller sees it.
    :class:`RPCError` ``EPROTO`` naming the answer and the field otherwise
    (``the service's list answer: procs[3].pid: expected an integer, got
    "7"``): handed on, a caller's ``proc["pid"]`` raised ``KeyError``, or
    a pid of ``"7"`` matched no process."""
    # Here: `run`, which asks for no such answer, need not load the table.
    from sdexec.answers import answer_fault

    fault = answer_fault(topic, answer)
    if fault is None:
        return answer
    # (Only the table's topics have a fault: each a plain name, ``list``.)
    name = topic.removeprefix("sdexec.")
    raise RPCError(errno.EPROTO, f"the service's {name} answer: {fault}")


def finished_status(payload: dict[str, Any]) -> int | None:
    """``payload``'s ``status`` (a ``finished`` response's, a wait's
    answer's) if it is a wait status, a 16-bit one as ``waitpid`` gives
    (JSON's true is no status: a bool is an int); else ``None``."""
    status = payload.get("status")
    return status if type(status) is int and 0 <= status <= 0xFFFF else None


def wait_status(answer: dict[str, Any]) -> int:
    """The wait status in the answer to a ``wait``: a 16-bit one, as
    ``waitpid`` gives; :class:`RPCError` ``EPROTO`` naming what came
    instead (a broken service, not a ``KeyError`` later)."""
    status = finished_status(answer)
    if status is not None:
        return status
    said = expected("wait", "a wait status", answer.get("status"), 200)
    raise RPCError(errno.EPROTO, said)


def wait_error(answer: dict[str, Any]) -> RPCError | None:
    """The error a ``status_and_error`` wait's answer carries beside its
    output (what ended the process's stream: after ``finished``, beside its
    status, or before it, a job declared unkillable, with no status);
    ``None`` if none. :class:`RPCError` ``EPROTO`` for a malformed one."""
    error = answer.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        errnum, errstr = error.get("errnum"), error.get("errstr")
        if type(errnum) is int and isinstance(errstr, str):
            return RPCError(errnum, errstr_line(errstr))
    raise RPCError(errno.EPROTO, expected("wait", "an error object", error, 200))


def dropped_counts(answer: dict[str, Any], what: str) -> dict[str, int]:
    """The bytes of each output stream a ``wait``'s answer or an
    ``attached`` (``what``) says were dropped before its output (its
    ``dropped``; none: ``{}``). :class:`RPCError` ``EPROTO`` naming the
    field otherwise (``wait: dropped.stdout: expected a byte count, got
    "x"``): ``"x"`` was said as "x bytes of stdout"."""
    _check_shape("DROPPED", answer, what)
    return answer.get("dropped", {})


def _check_shape(shape: str, payload: dict[str, Any], what: str) -> None:
    """:class:`RPCError` ``EPROTO`` unless ``payload`` has the shape
    :mod:`sdexec.answers` names ``shape``, the message led by ``what``
    (the response) and naming the field."""
    # Here, as checked_answer loads it: a `run` that meets no malformed
    # response loads no table.
    from sdexec import answers

    fault = getattr(answers, shape).fault(payload)
    if fault is not None:
        raise RPCError(errno.EPROTO, f"{what}: {fault}")


#: The streams whose output a service sends (RFC 42's: sdexec makes no
#: auxiliary channels, docs/protocol.md).
OUTPUT_STREAMS = ("stdout", "stderr")

#: Where an ``output`` response's io object is, as :func:`output_io` names it.
OUTPUT_RESPONSE_IO = "the service's output response: io"


def output_io(io: Any, where: str) -> tuple[str, bytes, bool]:
    """``(stream, data, eof)`` of an io object of output the service sent
    (an ``output`` response's ``io``, a wait's ``output`` item): one of
    stdout or stderr that :func:`~sdexec.ioencode.decode_io` takes.
    :class:`RPCError` ``EPROTO`` naming it by ``where`` and the field
    (``wait: output[1].data: invalid base64``), for both clients alike:
    handed on, it raised in a caller's decode, or was dropped as another
    stream's."""
    try:
        stream, data, eof = decode_io(io)
    except ValueError as error:
        said = str(error).removeprefix("io")  # decode_io's own name for it
        raise RPCError(errno.EPROTO, f"{where}{said}") from None
    if stream not in OUTPUT_STREAMS:
        said = expected(f"{where}.stream", '"stdout" or "stderr"', stream, 40)
        raise RPCError(errno.EPROTO, said)
    return stream, data, eof


def wait_outcome(answer: dict[str, Any]) -> tuple[int | None, RPCError | None]:
    """``(status, error)`` of a wait's answer (:class:`RPCError` ``EPROTO``
    if its ``output`` is not a list): its wait status
    (:func:`wait_status`), ``None`` where the stream ended with an error
    before the command finished (a job declared unkillable: a
    ``status_and_error`` wait gets that error beside the output alone), and
    the error beside it, if any (:func:`wait_error`)."""
    output = answer.get("output", [])
    if not isinstance(output, list):
        # Not iterated: a number was "unexpected error: TypeError", a
        # string one "bad output" line per character.
        said = expected("wait", "a list of output", output, 200)
        raise RPCError(errno.EPROTO, said)
    error = wait_error(answer)
    if error is not None and "status" not in answer:
        return None, error
    return wait_status(answer), error


def finished_receipt(finished: dict[str, Any]) -> Receipt | None:
    """The receipt of a ``finished`` response that carries a wait status;
    ``None`` for one that does not (its stream then ends with ``EPROTO``
    naming it, :class:`StreamCheck`): a status made up would become a
    command's exit status."""
    if finished_status(finished) is None:
        return None
    return Receipt.from_finished(finished)


#: The types of an exec or attach stream's responses (RFC 42's, and the
#: attach's ``attached``): as Flux's libsubprocess takes them (client.c).
STREAM_RESPONSES = (
    "add-credit",
    "attached",
    "finished",
    "output",
    "started",
    "stopped",
)


class StreamCheck:
    """The responses of one exec or attach stream, checked
    (:meth:`take`): a ``started`` (``attached``) with a pid; one
    ``finished``, with a wait status (:func:`finished_status`; a receipt is
    made of the first good one only); ``output`` a caller can decode
    (:func:`output_io`, decoded here once: :class:`DecodedIO`); an
    ``attached``'s command object and byte counts; an ``add-credit``'s
    integer credits. A stream that broke this ends with :attr:`violation`
    (an ``EPROTO`` naming what came, the first thing wrong) in place of its
    ``ENODATA``:
    a status of 1.5 read as a stream ended without ``finished``, a negative
    one as exit 255, ``true`` as 129, and one past 32 bits as an
    ``OverflowError`` (review session 47). While its process may still run,
    the client kills it for that (:meth:`kill_due`), as Flux's
    libsubprocess does; the rest of the stream is handed on to its end."""

    def __init__(self) -> None:
        #: What was wrong with the stream, if anything (the first thing).
        self.violation: RPCError | None = None
        #: The process's pid, once a start has carried one.
        self.pid: int | None = None
        #: The violation the process was killed for (:meth:`kill_due`).
        self.killed_for: RPCError | None = None
        self._seen = False

    def take(self, payload: dict[str, Any]) -> bool:
        """Check one response's payload; whether it goes to the caller: not
        an ``output`` no caller can decode, an ``attached`` whose ``cmd``
        is no command object (:func:`attached_command`) or whose
        ``dropped`` is not byte counts, nor an ``add-credit`` whose
        credits are not integers (its decode, sum or addition raised in the
        caller's callback, and the output was lost unsaid): those are
        withheld, the first named by :attr:`violation`, and so is one of no
        stream response type (:data:`STREAM_RESPONSES`). A good ``output``'s
        ``io`` becomes a :class:`~sdexec.ioencode.DecodedIO`, which
        :func:`~sdexec.ioencode.decode_io` does not decode again."""
        kind = payload.get("type")
        if kind not in STREAM_RESPONSES:
            # Handed on, a caller's payload["type"] raised, or it went
            # unseen; Flux's libsubprocess refuses it (client.c).
            got = json_quoted(kind, 40) if "type" in payload else "none"
            known = ", ".join(STREAM_RESPONSES)
            self._violated(
                f"the service's response: type: expected one of {known}; got {got}"
            )
            return False
        if kind == "output":
            return self._take_output(payload)
        if kind == "add-credit":
            return self._checked(credit_channels, payload)
        if kind == "finished":
            self.see(payload)
        elif kind in ("started", "attached"):
            # A second start without a pid leaves the first's: to kill.
            self.pid = self.see_start(payload) or self.pid
            if kind == "attached":
                return self._checked(attached_command, payload) and self._checked(
                    dropped_counts, payload, "attached"
                )
        return True

    def see_start(self, payload: dict[str, Any]) -> int | None:
        """The pid of a ``started`` (or ``attached``) response's payload;
        ``None``, and the stream's :attr:`violation`, if it carries none
        (a string, a bool, a number below 1): no signal could be sent to
        it, and those held for it waited on unsaid."""
        pid = payload.get("pid")
        if type(pid) is int and pid > 0:
            return pid
        kind = payload.get("type")
        pid = payload.get("pid", MISSING)
        self._violated(expected(f"the service's {kind} response", "a pid", pid, 200))
        return None

    def see(self, payload: dict[str, Any]) -> None:
        """Note a ``finished`` response's payload."""
        if self._seen:
            self._violated("the service sent a second finished response")
        elif finished_status(payload) is None:
            status = payload.get("status", MISSING)
            self._violated(
                expected(
                    "the service's finished response", "a wait status", status, 200
                )
            )
        self._seen = True

    def kill_due(self) -> int | None:
        """The pid to send ``SIGKILL`` now, once: the stream has broken the
        protocol (:attr:`violation`) while its process may still run (a
        start with a pid has come, no ``finished``). Flux's libsubprocess
        kills so on any response it cannot take (remote.c,
        ``rexec_continuation``): output it cannot decode is output lost, and
        a process whose output can no longer be delivered must not run on
        unseen. ``None`` if there is nothing to kill (no pid: the clients
        close the connection instead, or it has finished)."""
        if self.violation is None or self.pid is None or self._seen:
            return None
        if self.killed_for is not None:
            return None
        self.killed_for = self.violation
        return self.pid

    def _take_output(self, payload: dict[str, Any]) -> bool:
        try:
            decoded = output_io(payload.get("io"), OUTPUT_RESPONSE_IO)
        except RPCError as error:
            self._note(error)
            return False
        # Decoded once, for the caller too (output_io took it: an object).
        payload["io"] = DecodedIO(payload["io"], decoded)
        return True

    def _checked(self, check: Callable[..., object], *args: Any) -> bool:
        """Whether ``check(*args)`` passes; its ``EPROTO``, if not, is
        the stream's :attr:`violation` (the first one's only)."""
        try:
            check(*args)
        except RPCError as error:
            self._note(error)
            return False
        return True

    def _violated(self, why: str) -> None:
        self._note(RPCError(errno.EPROTO, why))

    def _note(self, error: RPCError) -> None:
        if self.violation is None:
            self.violation = error

    def ending(self, error: SdexecError) -> SdexecError:
        """What the stream ends with, for the ``error`` it ended with: the
        violation, if there was one, in place of a good end."""
        if self.violation is not None and is_end_of_stream(error):
            return self.violation
        return error


def attached_command(payload: dict[str, Any]) -> dict[str, Any]:
    """An ``attached`` response's ``cmd``: the command object the process
    was started with (:data:`~sdexec.answers.ATTACHED_COMMAND`).
    :class:`RPCError` ``EPROTO`` naming the field otherwise: handed on, a
    caller's ``cmd["cmdline"]`` raised in its callback."""
    _check_shape("ATTACHED_COMMAND", payload, "the service's attached response")
    return payload["cmd"]


def credit_channels(payload: dict[str, Any]) -> dict[str, int]:
    """An ``add-credit`` response's ``channels``: an object of integer
    credits (RFC 42; JSON's true is none). :class:`RPCError` ``EPROTO``
    naming the field otherwise, as Flux's libsubprocess refuses it
    (client.c): ignored, a credit of ``"4096"`` left stdin held for ever."""
    channels = payload.get("channels")
    # What a service sends, {"stdin": N}, is taken without loading the
    # table (a `run` relaying stdin gets one a write); the table judges
    # anything else.
    if (
        isinstance(channels, dict)
        and channels.keys() == {"stdin"}
        and type(channels["stdin"]) is int
    ):
        return channels
    _check_shape("ADD_CREDIT", payload, "the service's add-credit response")
    return payload["channels"]


def process_target(pid: int | None, label: str | None) -> dict[str, Any]:
    """The ``{"pid"}`` or ``{"label"}`` of a kill, wait or attach;
    ``ValueError`` unless exactly one is given."""
    if (pid is None) == (label is None):
        raise ValueError("give exactly one of pid and label")
    return {"pid": pid} if label is None else {"label": label}


class StdinCredit:
    """RFC 42 flow control of one process's stdin: how many more bytes the
    service's buffer can take.

    It starts at the buffer size, which may be borrowed before the first
    ``add-credit``; that first ``add-credit`` carries the whole buffer size,
    so it replaces the borrowed allowance instead of adding to it.
    """

    def __init__(self, cmd: dict[str, Any]) -> None:
        self._bufsize = _stdin_bufsize(cmd)
        #: Bytes that may be sent now (negative if overdrawn).
        self.available = self._bufsize
        self._borrowing = True

    def spend(self, nbytes: int) -> None:
        """``nbytes`` of stdin were sent: that much less may be until the
        server grants more."""
        self.available -= nbytes

    def add(self, channels: Any) -> bool:
        """Take an ``add-credit``'s ``channels``; whether it carried any."""
        amount = channels.get("stdin") if isinstance(channels, dict) else None
        if type(amount) is not int:  # JSON's true is no amount (a bool is an int)
            return False
        if self._borrowing:
            self._borrowing = False
            amount -= self._bufsize
        self.available += amount
        return True


def _stdin_bufsize(cmd: dict[str, Any]) -> int:
    """The stdin buffer the service will use: the command's ``stdin_BUFSIZE``,
    else the RFC 42 default (a bad value is the service's to refuse)."""
    opts = cmd.get("opts")
    value = opts.get("stdin_BUFSIZE") if isinstance(opts, dict) else None
    if not isinstance(value, str):
        return DEFAULT_STDIN_BUFSIZE
    # Only now: sdexec.sizes loads decimal, which the command line's
    # start-up need not pay for.
    from sdexec.sizes import parse_flux_size

    try:
        return parse_flux_size(value)
    except ValueError:
        return DEFAULT_STDIN_BUFSIZE
