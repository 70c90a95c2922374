"""I/O channels: the service's ends of the process's stdin/stdout/stderr.

Each channel is a ``socketpair(2)``: systemd gets one end (passed as an fd
in ``StartTransientUnit``), the service keeps the other and hands it to the
reactor (``adoptStreamConnection``), so reads and writes are non-blocking
and flow-controlled like any Twisted connection.

systemd holds its ends until the unit is stopped, so an output channel sees
EOF only after ``StopUnit`` (or when a failed unit is reset).
"""

from __future__ import annotations

import array
import fcntl
import socket
import termios
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer, IReactorSocket
from twisted.internet.protocol import Protocol, ServerFactory
from zope.interface import implementer

from sdexec.ioencode import line_chunks

__all__ = [
    "STDIN_OVERRUN_FACTOR",
    "InputChannel",
    "OutputChannel",
    "OutputGate",
    "StdinOverrun",
    "socketpair_for_systemd",
]

#: The most stdin an :class:`InputChannel` holds for its process, in
#: multiples of its advertised buffer: a client that honours its credit
#: never makes it hold more than once the buffer.
STDIN_OVERRUN_FACTOR = 4


class StdinOverrun(Exception):
    """The client sent more stdin than its credit allows, beyond what the
    service holds; the data was not taken."""


def socketpair_for_systemd() -> tuple[socket.socket, socket.socket]:
    """``(ours, systemd's)``: a stream socketpair; ours is non-blocking."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    return ours, theirs


def _adopt(reactor: IReactorSocket, sock: socket.socket, protocol: Protocol) -> None:
    # adoptStreamConnection duplicates the fd; the original is ours to close.
    factory: Any = ServerFactory.forProtocol(lambda: protocol)  # one fixed protocol
    reactor.adoptStreamConnection(sock.fileno(), socket.AF_UNIX, factory)
    sock.close()


class OutputChannel(Protocol):
    """Reads one output stream of the process and hands it on in chunks.

    ``on_data(data)`` gets whole lines when line-buffered (the default) —
    the complete lines of a read packed in chunks of up to ``bufsize``
    bytes, a partial line held until its newline, EOF, or ``bufsize`` bytes
    of it (a line longer than the buffer is sent a buffer at a time) — or
    each read as it comes otherwise; never more than ``bufsize`` bytes at
    once.
    ``on_eof()`` is called once, after the last data.
    """

    #: A UNIX socket transport once connected. Twisted types it as
    #: ``ITransport | None``, which lacks the producer and half-close methods
    #: the socket transport has; Any keeps those calls unchecked, not wrong.
    transport: Any

    def __init__(
        self,
        name: str,
        on_data: Callable[[bytes], None],
        on_eof: Callable[[], None],
        line_buffered: bool = True,
        *,
        bufsize: int,
    ) -> None:
        self.name = name
        self.eof = False
        self._on_data = on_data
        self._on_eof = on_eof
        self._line_buffered = line_buffered
        self._bufsize = bufsize
        #: A line not ended yet, in one buffer: kept as the reads that
        #: brought it, a writer of a byte or two at a time made each byte
        #: cost 21 to 42 (a bytes object and its list slot), and the buffer
        #: size as many times what it says.
        self._partial = bytearray()

    def adopt(self, reactor: IReactorSocket, sock: socket.socket) -> None:
        """Start reading ``sock`` (our end of the socketpair)."""
        _adopt(reactor, sock, self)

    def dataReceived(self, data: bytes) -> None:
        """Output read: handed on, in whole lines where the stream is
        line-buffered (a partial line waits for its newline, or until it
        fills whole buffers)."""
        if not self._line_buffered:
            self._hand_on(data)
            return
        last_newline = data.rfind(b"\n")
        if last_newline < 0:
            self._hold(data)
            return
        lines = data[: last_newline + 1]
        if self._partial:  # else passed on as read, not copied (output's bulk)
            self._partial += lines
            lines = self._taken_partial()
        self._send_lines(lines)
        self._hold(data[last_newline + 1 :])

    def connectionLost(self, reason: object = None) -> None:
        """EOF: what is held is handed on, then the end."""
        self._flush()
        self.eof = True
        self._on_eof()

    def close(self) -> None:
        """Stop reading for good, whatever is left unread."""
        if self.transport is not None and not self.eof:
            self.transport.abortConnection()

    def read_queued(self) -> None:
        """Hand on what the socket holds now, without waiting for more.

        For a unit that is gone with no EOF to come (its processes may even
        live on, outside any unit): only the bytes queued at this moment are
        read, so a writer that keeps writing cannot hold the reactor, and the
        amount is bounded by the kernel's socket buffers.
        """
        if self.transport is None or self.eof:
            return
        sock = self.transport.getHandle()
        left = _queued_bytes(sock)
        while left > 0:
            try:
                data = sock.recv(min(left, self._bufsize))
            except OSError:
                break  # nothing more to read now, or the socket failed
            if not data:
                break
            left -= len(data)
            self.dataReceived(data)
        self._flush()

    def holds_unread(self) -> bool:
        """The socket holds bytes the channel has not read yet."""
        if self.transport is None or self.eof:
            return False
        return _queued_bytes(self.transport.getHandle()) > 0

    def pause(self) -> None:
        """Stop reading (the client cannot keep up)."""
        if self.transport is not None and not self.eof:
            self.transport.pauseProducing()

    def resume(self) -> None:
        """Read again (the client caught up)."""
        if self.transport is not None and not self.eof:
            self.transport.resumeProducing()

    def _hold(self, data: bytes) -> None:
        if data:
            self._partial += data
            if len(self._partial) >= self._bufsize:
                self._flush_full_buffers()

    def _flush_full_buffers(self) -> None:
        """A partial line of a buffer or more: whole buffers of it go, the
        rest waits for its newline (as Flux's channels hold it)."""
        data = self._taken_partial()
        kept = len(data) % self._bufsize
        if kept:
            self._partial += memoryview(data)[-kept:]
        self._hand_on(data[: len(data) - kept])

    def _flush(self) -> None:
        if self._partial:
            self._send_lines(self._taken_partial())

    def _send_lines(self, data: bytes) -> None:
        for chunk in line_chunks(data, self._bufsize):
            self._on_data(chunk)

    def _taken_partial(self) -> bytes:
        """What is held, as bytes (the clients' type), no longer held."""
        data, self._partial = bytes(self._partial), bytearray()
        return data

    def _hand_on(self, data: bytes) -> None:
        """``data`` in chunks of at most the buffer size, as Flux's channels
        send it: a client may size its buffer by ``<stream>_BUFSIZE``."""
        size = self._bufsize
        if len(data) <= size:
            self._on_data(data)
            return
        view = memoryview(data)
        for start in range(0, len(data), size):
            self._on_data(bytes(view[start : start + size]))


def _queued_bytes(sock: socket.socket) -> int:
    """How many bytes wait in ``sock``'s receive queue (``FIONREAD``)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


class OutputGate:
    """When a process's output channels may be read.

    RFC 42 wants ``started`` before any output: the channels stay paused from
    adoption until :meth:`open` (the data waits in the socket buffer; the
    process blocks if it fills). A client that reads slowly pauses them too
    (:meth:`pause`/:meth:`resume`); both must allow reading.
    """

    def __init__(self, channels: Mapping[str, OutputChannel]) -> None:
        self.channels = dict(channels)
        self._open = False
        self._client_paused = False

    def adopt(
        self, reactor: IReactorSocket, sockets: Mapping[str, socket.socket]
    ) -> None:
        """Hand each channel its socket, paused until :meth:`open`."""
        for name, channel in self.channels.items():
            channel.adopt(reactor, sockets[name])
            channel.pause()

    @property
    def eof(self) -> bool:
        """Every channel has reached EOF."""
        return all(channel.eof for channel in self.channels.values())

    def holds_unread(self) -> bool:
        """Some channel's socket holds bytes not read yet. Before
        :meth:`open` that proves the command ran: systemd writes nothing to
        a unit's output when it fails to start it (it logs to its own
        targets), so the bytes are the command's."""
        return any(channel.holds_unread() for channel in self.channels.values())

    def open(self) -> None:
        """Output may flow (the process started, or failed)."""
        self._open = True
        self._resume_if_allowed()

    def drain(self) -> None:
        """Nobody reads any more: read everything to EOF (and drop it)."""
        self._open, self._client_paused = True, False
        self._resume_if_allowed()

    def pause(self) -> None:
        """The client reads slowly: stop reading the process's output."""
        self._client_paused = True
        for channel in self.channels.values():
            channel.pause()

    def resume(self) -> None:
        """The client reads again: reading resumes unless the process is not
        yet allowed to be read."""
        self._client_paused = False
        self._resume_if_allowed()

    def read_queued(self) -> None:
        """Hand on what each channel holds now (see
        :meth:`OutputChannel.read_queued`), if output may flow at all."""
        if self._open:
            for channel in self.channels.values():
                channel.read_queued()

    def close(self) -> None:
        """Stop reading every channel for good."""
        for channel in self.channels.values():
            channel.close()

    def _resume_if_allowed(self) -> None:
        if self._open and not self._client_paused:
            for channel in self.channels.values():
                channel.resume()


@implementer(IPushProducer)
class InputChannel(Protocol):
    """Writes the client's data to the process's stdin, with RFC 42 credit.

    Data written before the socket is adopted (systemd has not answered yet)
    is queued, never lost. Credit for written data is returned through
    ``on_credit(nbytes)`` as soon as the transport accepts it, and withheld
    while the transport's buffer is full (it pauses us as a producer). Data
    not yet credited back is bounded: beyond :attr:`limit`
    (:data:`STDIN_OVERRUN_FACTOR` times ``bufsize``) :meth:`write` raises
    :class:`StdinOverrun` and takes nothing, so a client that ignores its
    credit cannot make the service buffer without bound. A client that
    asked for no credit (RFC 42 makes it optional) is not refused: its
    write is taken, and the channel is :attr:`backlogged` until the
    process has read it down (:meth:`when_drained`), while its connection
    reads no more requests.
    """

    #: A UNIX socket transport once connected. Twisted types it as
    #: ``ITransport | None``, which lacks the producer and half-close methods
    #: the socket transport has; Any keeps those calls unchecked, not wrong.
    transport: Any

    def __init__(self, on_credit: Callable[[int], None], bufsize: int) -> None:
        self.bufsize = bufsize
        self._on_credit = on_credit
        #: What waits to be handed to the transport: written before the
        #: socket was adopted, or while the transport is full. In one
        #: buffer: handed on write by write, each held as a bytes object of
        #: its own in the transport's list, two-byte writes took 21 times
        #: their size.
        self._waiting = bytearray()
        self._eof_requested = False
        self._paused = False
        #: Bytes taken (queued or written) and not yet credited back.
        self._owed = 0
        self._closed = False
        self._drained: list[Deferred[None]] = []

    @property
    def limit(self) -> int:
        """The most bytes held for the process before a write is refused."""
        return STDIN_OVERRUN_FACTOR * self.bufsize

    def adopt(self, reactor: IReactorSocket, sock: socket.socket) -> None:
        """Start writing to ``sock`` and flush what was queued."""
        _adopt(reactor, sock, self)

    def connectionMade(self) -> None:
        """Start writing: what was queued first, then credit for more."""
        # Paused by any write the socket has not taken yet: the rest wait in
        # one buffer (Twisted keeps up to its bufferSize, 64 KiB, as an
        # object per write: 1.4 MB of two-byte writes), and credit comes
        # back once the kernel has the data, as docs/protocol.md says.
        self.transport.bufferSize = 0
        self.transport.registerProducer(self, True)
        self._hand_waiting_on()  # written before a close: still owed
        if not self._paused:
            self._grant()
        if self._eof_requested:
            self.close()

    @property
    def backlogged(self) -> bool:
        """More than :attr:`limit` is held for the process (a client
        without credit wrote ahead of it)."""
        return self._owed > self.limit and not self._closed

    def when_drained(self) -> Deferred[None]:
        """Fires once no longer :attr:`backlogged` (at once if it is not)."""
        if not self.backlogged:
            return succeed(None)
        drained: Deferred[None] = Deferred()
        self._drained.append(drained)
        return drained

    def write(self, data: bytes, credited: bool = True) -> None:
        """Write (or queue) ``data``; dropped once the channel is closed.
        :class:`StdinOverrun` if that would hold more than :attr:`limit`,
        for a client that was given ``credited`` writes (else taken, and
        :attr:`backlogged`)."""
        if self._closed or self._eof_requested:
            return
        if credited and self._owed + len(data) > self.limit:
            raise StdinOverrun(
                f"stdin: the client overran its credit: {self._owed} bytes held"
                f" for the process and {len(data)} more sent; the service holds at"
                f" most {self.limit} ({STDIN_OVERRUN_FACTOR} x stdin_BUFSIZE)"
            )
        self._owed += len(data)
        if self.transport is None or self._paused:
            self._waiting += data
            return
        self.transport.write(data)
        if not self._paused:
            self._grant()

    def close(self) -> None:
        """EOF on the process's stdin, after the queued data (once the
        process has read a backlog down: its client waits until then)."""
        self._eof_requested = True
        if self.backlogged:
            return  # closed by _grant, as the transport drains
        if self.transport is not None and not self._closed:
            self._hand_waiting_on()  # then EOF, once the transport has written it
            self.transport.unregisterProducer()
            self.transport.loseWriteConnection()
            self._closed = True
            self._fire_drained()  # what is held is written: nothing more comes

    def discard(self) -> None:
        """Nobody waits for the process to read what is held any more (its
        request is over): drop it, and close stdin, at once."""
        if self.backlogged and self.transport is not None:
            self.transport.abortConnection()
        self._owed = 0
        self._waiting = bytearray()
        self.close()

    def abort(self) -> None:
        """Let go of the socket for good (the process's unit is gone, or
        abandoned): what is held is dropped and our end closed whole. Only
        shut down for writing (:meth:`close`), it stayed open, read, for as
        long as a process that outlived its unit held its stdin."""
        self.discard()
        if self.transport is not None:
            self.transport.abortConnection()  # (a no-op once it is lost)

    def connectionLost(self, reason: object = None) -> None:
        """The process's stdin is gone: nothing more is written, and whoever
        waits for a drain is told."""
        self._closed = True
        self._waiting = bytearray()
        self._fire_drained()

    # IPushProducer: the transport tells us when its write buffer is full.
    def pauseProducing(self) -> None:
        """The transport's buffer is full: hold writes, and credit."""
        self._paused = True

    def resumeProducing(self) -> None:
        """The transport has room: hand on what waits, and grant credit."""
        self._paused = False
        self._hand_waiting_on()  # which may fill the transport again
        if not self._paused:
            self._grant()

    def _hand_waiting_on(self) -> None:
        if self._waiting:
            data, self._waiting = bytes(self._waiting), bytearray()
            self.transport.write(data)

    def stopProducing(self) -> None:
        """The transport is going: nothing more is written."""
        self._closed = True
        self._fire_drained()

    def _grant(self) -> None:
        if self._owed:
            owed, self._owed = self._owed, 0
            self._on_credit(owed)
            self._fire_drained()
            if self._eof_requested:
                self.close()

    def _fire_drained(self) -> None:
        drained, self._drained = self._drained, []
        for each in drained:
            each.callback(None)
