"""Newline-delimited JSON messages over a stream (see docs/protocol.md).

Both ends of the protocol use :class:`JSONLineProtocol`. Unlike Twisted's
``LineOnlyReceiver`` it never re-joins its whole buffer when a chunk
arrives, so a 16 MiB message arriving in 64 KiB reads costs linear time.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from twisted.internet.protocol import Protocol

from sdexec.protocol import DEFAULT_MAX_FRAME

__all__ = ["JSONLineProtocol", "encode_message"]

#: Strings this long are escaped by :func:`_string_literal`, not the json
#: module: output data is most of what the service sends, and CPython's JSON
#: string escaping runs at ~180 MB/s on a small machine, the byte-level path
#: below at ~450 MB/s (docs/performance.md).
SPLICE_MIN_LENGTH = 4096
_CONTROL = bytes(byte for byte in range(32) if byte not in (9, 10))
_PLACEHOLDER = f"\0sdexec-splice-{secrets.token_hex(8)}-{{}}\0"


def encode_message(message: dict[str, Any]) -> bytes:
    """One message as a line: compact JSON, UTF-8, ``\\n``-terminated."""
    literals: list[bytes] = []
    skeleton = _set_aside_long_strings(message, literals)
    text = json.dumps(skeleton, separators=(",", ":"), ensure_ascii=False).encode()
    for index, literal in enumerate(literals):
        placeholder = json.dumps(_PLACEHOLDER.format(index)).encode()
        text = text.replace(placeholder, literal, 1)
    return text + b"\n"


def _set_aside_long_strings(value: Any, literals: list[bytes]) -> Any:
    """``value`` with each long string that :func:`_string_literal` can encode
    replaced by a placeholder, its literal appended to ``literals``."""
    if isinstance(value, str):
        literal = _string_literal(value) if len(value) >= SPLICE_MIN_LENGTH else None
        if literal is None:
            return value
        literals.append(literal)
        return _PLACEHOLDER.format(len(literals) - 1)
    if isinstance(value, dict):
        return {
            key: _set_aside_long_strings(item, literals) for key, item in value.items()
        }
    if isinstance(value, list):
        return [_set_aside_long_strings(item, literals) for item in value]
    return value


def _string_literal(text: str) -> bytes | None:
    """The JSON literal of ``text`` when its only control characters are tab
    and newline (other text is left to the json module)."""
    try:
        raw = text.encode()
    except UnicodeEncodeError:  # lone surrogates: let json report them
        return None
    if len(raw.translate(None, _CONTROL)) != len(raw):
        return None
    escaped = (
        raw.replace(b"\\", b"\\\\")
        .replace(b'"', b'\\"')
        .replace(b"\n", b"\\n")
        .replace(b"\t", b"\\t")
    )
    return b'"' + escaped + b'"'


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
