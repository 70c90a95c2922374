"""Newline-delimited JSON messages over a Twisted stream (docs/protocol.md).

Both Twisted ends of the protocol, the service and ``sdexec.client``, use
:class:`JSONLineProtocol`. The format itself (encoding, decoding, splitting)
is :mod:`sdexec.wire`, which the command line's synchronous client shares.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.protocol import Protocol

from sdexec.wire import FrameSplitter, FramingError, encode_message

__all__ = ["FramingError", "JSONLineProtocol", "encode_message"]


class JSONLineProtocol(Protocol):
    """Splits the stream into lines and decodes each as a JSON object.

    Subclasses implement :meth:`messageReceived` and :meth:`framingError`
    (called once; nothing more is delivered afterwards).
    """

    def __init__(self) -> None:
        self._splitter = FrameSplitter()
        self._frame_broken = False
        #: Reads not decoded yet, each with what came with it (see
        #: :meth:`inputHeld`), oldest first; ``None`` while decoding.
        self._undecoded: list[tuple[bytes, Any]] | None = None

    @property
    def max_frame(self) -> int:
        """The largest message accepted, in bytes."""
        return self._splitter.max_frame

    @max_frame.setter
    def max_frame(self, size: int) -> None:
        self._splitter.max_frame = size

    def name_max_frame(self, name: str) -> None:
        """Say ``name`` (what sets :attr:`max_frame`) in the error of a
        message that exceeds it."""
        self._splitter.max_frame_name = name

    @property
    def max_values(self) -> int | None:
        """The most JSON values a message may hold (``None``: any number)."""
        return self._splitter.max_values

    @max_values.setter
    def max_values(self, values: int | None) -> None:
        self._splitter.max_values = values

    def dataReceived(self, data: bytes) -> None:
        """Split ``data`` into messages, each handed to :meth:`messageReceived`
        (kept undecoded while :meth:`inputHeld`); a framing error is told once to
        :meth:`framingError`, and what comes after it is ignored."""
        if self._frame_broken:
            return
        if self._undecoded is not None:
            self._undecoded.append((data, None))
            return
        try:
            for message in self._splitter.feed(data):
                self._deliver(message)
                if self.inputHeld():
                    self._keep_undecoded(data[self._splitter.consumed :])
                    return
        except FramingError as error:
            self._frame_broken = True
            self.framingError(str(error))

    @property
    def frame_bytes(self) -> int:
        """The bytes of the frame of the message being delivered (while
        :meth:`messageReceived` runs), as :attr:`FrameSplitter.frame_bytes`."""
        return self._splitter.frame_bytes

    @property
    def unfinished(self) -> int:
        """The bytes of a message that has come without its end, as
        :attr:`FrameSplitter.unfinished`."""
        return self._splitter.unfinished

    @property
    def foreign(self) -> bool:
        """Whether the stream began with no JSON object, as
        :attr:`FrameSplitter.foreign`."""
        return self._splitter.foreign

    def inputHeld(self) -> bool:
        """Whether what is read now must wait: the rest of the read being
        decoded is kept as bytes (decoded, a read of small messages takes
        a hundred times its size) until :meth:`decodeHeldInput`."""
        return False

    def _keep_undecoded(self, rest: bytes, extra: Any = None) -> None:
        """Keep ``rest`` of a read (and ``extra``, what came with it) for
        :meth:`decodeHeldInput`."""
        if self._undecoded is None:
            self._undecoded = []
        if rest or extra:
            self._undecoded.append((rest, extra))

    def decodeHeldInput(self) -> None:
        """Decode what was read while input was held, oldest first, until
        it is held again."""
        while self._undecoded is not None and not self.inputHeld():
            undecoded, self._undecoded = self._undecoded, None
            for index, (data, extra) in enumerate(undecoded):
                self._receive_again(data, extra)
                if self._undecoded is not None:  # held again meanwhile
                    self._undecoded.extend(undecoded[index + 1 :])
                    break

    def _receive_again(self, data: bytes, extra: Any) -> None:
        """Receive ``data`` as it was read (``extra``: what came with it)."""
        self.dataReceived(data)

    def _deliver(self, message: dict[str, Any]) -> None:
        """Hand one message on (a subclass may look at it first)."""
        self.messageReceived(message)

    def sendMessage(self, message: dict[str, Any]) -> None:
        """Write ``message`` as one line of JSON."""
        assert self.transport is not None, "sendMessage before connectionMade"
        self.transport.write(encode_message(message))

    def messageReceived(self, message: dict[str, Any]) -> None:
        """One decoded message: for the subclass to handle."""
        raise NotImplementedError

    def framingError(self, reason: str) -> None:
        """The stream broke the framing (``reason`` says how): for the subclass
        to answer; no message is delivered after it."""
        raise NotImplementedError
