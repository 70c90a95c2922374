"""Stdio passthrough: a local client's own stdin/stdout/stderr for its
process, passed as file descriptors with the exec request (docs/protocol.md,
"Stdio passthrough").

What ``systemd-run --pipe`` does: the client sends its descriptors over the
unix socket (``SCM_RIGHTS``) and the service hands them to systemd in
``StartTransientUnit`` in place of its own socketpairs, so the process's
output never passes through the service.

Matching descriptors with their request. Linux returns the descriptors of
one ``sendmsg`` with a read that ends inside the bytes sent with them, and
Twisted calls ``fileDescriptorReceived`` for them before the
``dataReceived`` of that read. So descriptors belong to the request whose
frame holds the **last byte of the read they arrived with**: the last frame
of that read, or the frame still incomplete at its end. A client sends them
with bytes of the exec request's own frame (any of them: the command line
sends all with the first, Twisted one with each of the first bytes).

:class:`StdioReceivingProtocol` does that matching for the service's
connections and refuses what does not match; :class:`PassedStdio` holds one
request's descriptors until systemd has its copies, and closes them once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from twisted.internet.interfaces import IFileDescriptorReceiver
from zope.interface import implementer

from sdexec.framing import JSONLineProtocol
from sdexec.plan import STDIO_STREAMS, RequestError
from sdexec.protocol import Topic

__all__ = [
    "MAX_PASSED_FDS",
    "NO_STDIO",
    "PassedStdio",
    "StdioReceivingProtocol",
    "close_fds",
    "takes_stdio",
]

#: The most descriptors one request may bring: one per stream.
MAX_PASSED_FDS = len(STDIO_STREAMS)


def close_fds(fds: Iterable[int]) -> None:
    """Close each of ``fds`` (one already gone is no error)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def takes_stdio(message: dict[str, Any]) -> bool:
    """Whether ``message`` is a request that may bring descriptors: an
    ``sdexec.exec`` whose payload has ``stdio``. (A background one is
    refused by its checks, ``EINVAL`` naming ``stdio``, as it is without
    them: refused here, its client was told to send them, then not to.)"""
    payload = message.get("payload")
    return (
        message.get("topic") == Topic.EXEC
        and isinstance(payload, dict)
        and "stdio" in payload
    )


class PassedStdio:
    """The descriptors one exec request brought, by stream once
    :meth:`assign`\\ ed; owned until :meth:`close` (which closes each once,
    so a number the kernel has since reused is never closed by mistake)."""

    def __init__(self, fds: Sequence[int], service_address: object = None) -> None:
        self._fds = list(fds)
        self._by_stream: dict[str, int] = {}
        #: The address the client connected to (its socket's path), by
        #: which a descriptor that is a connection to the service is known.
        self._service_address = service_address

    def assign(self, streams: Sequence[str]) -> None:
        """Give the descriptors to ``streams`` in order; ``EPROTO`` if their
        number differs, ``EINVAL`` naming the stream of one that is a
        directory or ``O_PATH`` (:func:`_check_kind`), or a connection to
        this service."""
        if len(streams) != len(self._fds):
            raise RequestError(
                errno.EPROTO,
                f"stdio: the request names {len(streams)} stream(s) but"
                f" {len(self._fds)} file descriptor(s) came with it",
            )
        for stream, fd in zip(streams, self._fds, strict=True):
            mode = os.fstat(fd).st_mode
            _check_kind(stream, fd, mode)
            if stat.S_ISSOCK(mode):
                self._check_not_a_connection(stream, fd)
        if streams:  # (NO_STDIO, shared, is never changed)
            self._by_stream = dict(zip(streams, self._fds, strict=True))

    def _check_not_a_connection(self, stream: str, fd: int) -> None:
        """``EINVAL`` naming ``stream`` if ``fd`` is a client's end of a
        connection to this service (its peer is the service's address):
        the process would hold it open, and the service would never see
        that client leave, nor stop its units. (Both clients refuse their
        own before sending; another client may not.)"""
        if not self._service_address or _peer_address(fd) != self._service_address:
            return
        raise RequestError(
            errno.EINVAL,
            f"stdio: {stream}: the file descriptor passed is a connection to this"
            " service: the process would hold it open, and the service would"
            " never see its client leave (nor stop its processes)",
        )

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams given descriptors (none before :meth:`assign`)."""
        return tuple(self._by_stream)

    def __contains__(self, stream: object) -> bool:
        return stream in self._by_stream

    def fd(self, stream: str) -> int:
        """The descriptor passed for ``stream`` (one of :meth:`assign`'s)."""
        return self._by_stream[stream]

    def close(self) -> None:
        """Close every descriptor (systemd has its copies, or never will)."""
        if self._fds:
            fds, self._fds = self._fds, []
            close_fds(fds)

    @contextlib.contextmanager
    def closed_if_refused(self) -> Iterator[None]:
        """Close the descriptors if the block raises: a request refused
        there hands them to no process, and nobody else would close them."""
        try:
            yield
        except BaseException:
            self.close()
            raise


def _peer_address(fd: int) -> object:
    """The address the peer of socket ``fd`` is bound to, if it is a
    connected unix stream socket; else ``None``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # a socket whose kind Python cannot read
        return None
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            return None
        return sock.getpeername()
    except OSError:  # not connected (a listening socket), or its peer gone
        return None
    finally:
        sock.detach()  # the descriptor stays the request's


def _check_kind(stream: str, fd: int, mode: int) -> None:
    """``EINVAL`` naming ``stream`` if ``fd`` (of file mode ``mode``) is no
    stream a process could read or write: an ``O_PATH`` descriptor or a
    directory. Either would
    also take the process past the file-system sandboxing the site set for
    its unit (``ProtectHome``, ``InaccessiblePaths``, ``ReadOnlyPaths``,
    ``TemporaryFileSystem``): ``openat`` from it, or a reopen through
    ``/proc/self/fd``, resolves paths in the client's mount namespace, not
    the unit's (what a leaked directory descriptor lets a container do)."""
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH:
        kind = "was opened with O_PATH (it can be neither read nor written)"
    elif stat.S_ISDIR(mode):
        kind = "is a directory"
    else:
        return
    raise RequestError(
        errno.EINVAL,
        f"stdio: {stream}: the file descriptor passed {kind}: a process's"
        " stdio must be a file, pipe, socket or device, and this one would let"
        " it resolve paths past its unit's file-system sandboxing",
    )


#: An empty set, for processes whose stdio is all the service's own.
NO_STDIO = PassedStdio(())


class _HeldRead:
    """What came with a read held for a paused connection: its descriptors,
    and whether more were closed at once (its frame is then refused)."""

    __slots__ = ("dropped", "fds")

    def __init__(self, fds: list[int], dropped: bool) -> None:
        self.fds = fds
        self.dropped = dropped


@implementer(IFileDescriptorReceiver)
class StdioReceivingProtocol(JSONLineProtocol):
    """A :class:`~sdexec.framing.JSONLineProtocol` that receives
    descriptors and gives each request the ones its frame brought.

    While :meth:`messageReceived` runs, :attr:`request_fds` holds the
    request's descriptors; a handler that keeps them takes them with
    :meth:`take_request_fds`, the rest are closed when it returns. A request
    that may not bring any (:func:`takes_stdio`) but did is not handled:
    :meth:`descriptorsRefused` is called instead. No more than
    :data:`MAX_PASSED_FDS` are held for one frame; any beyond are closed at
    once and the frame is refused.
    """

    def __init__(self) -> None:
        super().__init__()
        self.request_fds: list[int] = []
        self._arrived: list[int] = []  # with the read about to be delivered
        #: Descriptors of that read closed at once: more than any frame takes.
        self._dropped = False
        self._frame_fds: list[int] = []  # for the next frame to complete
        self._too_many = False

    def fileDescriptorReceived(self, descriptor: int) -> None:
        """A descriptor passed with the read about to be delivered: kept for
        the frame it ends in, or closed if one read brings more than a frame
        takes."""
        os.set_inheritable(descriptor, False)  # recvmsg leaves them inheritable
        if len(self._arrived) >= MAX_PASSED_FDS:
            # More than one frame takes, with one read: closed now, and not
            # kept for a paused connection (whose reads stop) until it reads
            # again (253 a sendmsg). Not counted with an earlier frame's:
            # the read may end it first (its tail, then the next exec).
            close_fds([descriptor])
            self._dropped = True
            return
        self._arrived.append(descriptor)

    def _held_reads(self) -> list[_HeldRead]:
        return [extra for _, extra in self._undecoded or () if extra is not None]

    def dataReceived(self, data: bytes) -> None:
        """Split the read as :class:`JSONLineProtocol` does, giving each frame the
        descriptors that came with it."""
        arrived, self._arrived = self._arrived, []
        dropped, self._dropped = self._dropped, False
        if not arrived and not dropped:
            super().dataReceived(data)
            return
        if self._undecoded is not None:  # held: kept with its descriptors
            self._keep_undecoded(data, _HeldRead(arrived, dropped))
            return
        # The frames before the one that holds the read's last byte came
        # without these descriptors: deliver them first. (Blank lines after
        # it are no frame: a line end alone would take them.)
        owner_starts = data.rfind(b"\n", 0, max(len(data.rstrip()) - 1, 0)) + 1
        if owner_starts:
            super().dataReceived(data[:owner_starts])
        if self._undecoded is not None:  # held by one of those frames
            self._keep_undecoded(data[owner_starts:], _HeldRead(arrived, dropped))
            return
        self._hold_for_frame(arrived, dropped)
        super().dataReceived(data[owner_starts:])

    def _receive_again(self, data: bytes, extra: Any) -> None:
        if extra is not None:
            self._arrived, self._dropped = list(extra.fds), extra.dropped
        self.dataReceived(data)

    def _hold_for_frame(self, fds: list[int], dropped: bool = False) -> None:
        room = MAX_PASSED_FDS - len(self._frame_fds)
        if dropped or len(fds) > room:
            self._too_many = True
            close_fds(fds[max(room, 0) :])
            fds = fds[: max(room, 0)]
        self._frame_fds.extend(fds)

    def _deliver(self, message: dict[str, Any]) -> None:
        fds, self._frame_fds = self._frame_fds, []
        too_many, self._too_many = self._too_many, False
        if too_many or (fds and not takes_stdio(message)):
            close_fds(fds)
            self.descriptorsRefused(message, _refusal(too_many, len(fds)))
            return
        self.request_fds = fds
        try:
            self.messageReceived(message)
        finally:
            close_fds(self.take_request_fds())

    def drop_read(self) -> None:
        """Drop the read being delivered, unread (its peer has left): close
        the descriptors that came with it."""
        arrived, self._arrived = self._arrived, []
        self._dropped = False
        close_fds(arrived)

    def take_request_fds(self) -> list[int]:
        """The current request's descriptors, now the caller's to close."""
        fds, self.request_fds = self.request_fds, []
        return fds

    def connectionLost(self, reason: object = None) -> None:
        """Close descriptors that never reached a complete request."""
        undecoded = [fd for held in self._held_reads() for fd in held.fds]
        held = self._arrived + self._frame_fds + self.request_fds + undecoded
        self._arrived, self._frame_fds, self.request_fds = [], [], []
        self._undecoded = None
        close_fds(held)

    def descriptorsRefused(self, message: dict[str, Any], reason: str) -> None:
        """``message`` brought descriptors it may not: answer it with
        ``EPROTO`` ``reason`` (its descriptors are already closed)."""
        raise NotImplementedError


def _refusal(too_many: bool, count: int) -> str:
    if too_many:
        return (
            f"stdio: more than {MAX_PASSED_FDS} file descriptors came with one request"
        )
    return (
        f"stdio: {count} file descriptor(s) came with a request that takes none"
        " (only a streaming sdexec.exec with stdio does)"
    )
