"""Newline-delimited JSON messages over a stream (see docs/protocol.md).

Both ends of the protocol use :class:`JSONLineProtocol`. Unlike Twisted's
``LineOnlyReceiver`` it never re-joins its whole buffer when a chunk
arrives, so a 16 MiB message arriving in 64 KiB reads costs linear time.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.protocol import Protocol

__all__ = ["FramingError", "JSONLineProtocol", "encode_message"]

DEFAULT_MAX_FRAME = 64 * 1024 * 1024


class FramingError(ValueError):
    """The peer sent something that is not a message; the stream is unusable."""


def encode_message(message: dict[str, Any]) -> bytes:
    """One message as a line: compact JSON, UTF-8, ``\\n``-terminated."""
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    return text.encode() + b"\n"


class JSONLineProtocol(Protocol):
    """Splits the stream into lines and decodes each as a JSON object.

    Subclasses implement :meth:`messageReceived` and :meth:`framingError`
    (called once; nothing more is delivered afterwards).
    """

    max_frame: int = DEFAULT_MAX_FRAME

    def __init__(self) -> None:
        self._frame_chunks: list[bytes] = []
        self._frame_bytes = 0
        self._frame_broken = False

    def dataReceived(self, data: bytes) -> None:
        start = 0
        while not self._frame_broken:
            end = data.find(b"\n", start)
            if end < 0:
                self._hold(data[start:])
                return
            self._frame_chunks.append(data[start:end])
            line, self._frame_chunks, self._frame_bytes = (
                b"".join(self._frame_chunks),
                [],
                0,
            )
            start = end + 1
            if len(line) > self.max_frame:
                self._fail(f"message of {len(line)} bytes exceeds {self.max_frame}")
            elif line.strip():
                self._decode(line)

    def sendMessage(self, message: dict[str, Any]) -> None:
        self.transport.write(encode_message(message))

    def messageReceived(self, message: dict[str, Any]) -> None:
        raise NotImplementedError

    def framingError(self, reason: str) -> None:
        raise NotImplementedError

    def _hold(self, rest: bytes) -> None:
        if not rest:
            return
        self._frame_chunks.append(rest)
        self._frame_bytes += len(rest)
        if self._frame_bytes > self.max_frame:
            self._fail(f"message exceeds {self.max_frame} bytes")

    def _decode(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            self._fail(f"message is not valid JSON: {error}")
            return
        if not isinstance(message, dict):
            self._fail("message is not a JSON object")
            return
        self.messageReceived(message)

    def _fail(self, reason: str) -> None:
        self._frame_broken = True
        self._frame_chunks, self._frame_bytes = [], 0
        self.framingError(reason)
