"""The wire format, written once: newline-delimited JSON (docs/protocol.md).

Encoding, decoding and splitting a byte stream into messages, for every end
of the protocol: the service and the Twisted client (through
:class:`sdexec.framing.JSONLineProtocol`) and the command line's synchronous
client (``sdexec.syncclient``). It imports no Twisted, so the command line
starts without it.

JSON is msgspec's: output data is most of what crosses the socket, and
msgspec encodes a 64 KiB string about 4 times faster than the json module and
decodes it about 3 times faster (orjson, measured too, is in between;
docs/performance.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec

from sdexec.protocol import DEFAULT_MAX_FRAME

__all__ = ["FrameSplitter", "FramingError", "decode_message", "encode_message"]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


class FramingError(ValueError):
    """The peer sent something that is not a message; the stream is unusable."""


def encode_message(message: dict[str, Any]) -> bytes:
    """One message as a line: compact JSON, UTF-8, ``\\n``-terminated."""
    return _encoder.encode(message) + b"\n"


def decode_message(line: bytes) -> dict[str, Any]:
    """The JSON object on ``line``; :class:`FramingError` if it is not one."""
    try:
        message = _decoder.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError) as error:
        message = _decode_lone_surrogates(line, error)
    except RecursionError:
        # msgspec decodes recursively; a line of a few thousand "[" would
        # otherwise escape as a RecursionError and drop the connection.
        raise FramingError("message is nested too deeply") from None
    if not isinstance(message, dict):
        raise FramingError("message is not a JSON object")
    return message


#: A high surrogate escape not followed by a low one, or a lone low one.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<![0-9a-fA-F]{4})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def _decode_lone_surrogates(line: bytes, error: Exception) -> Any:
    """A line msgspec refused, if only for a lone surrogate escape
    (``"\\ud800"``: valid JSON, but a string no UTF-8 can carry).

    The json module decodes it, so that the request's own checks refuse the
    field holding it with EINVAL naming that field (sdexec.limits), as for a
    NUL, instead of a framing error that says nothing of the field. Any other
    refusal stays a :class:`FramingError`.
    """
    match = _LONE_SURROGATE.search(line)
    if match is None:
        raise FramingError(f"message is not valid JSON: {error}") from None
    import json  # only here: the command line never needs it

    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise FramingError(
            f"message is not valid JSON: {error} (a lone UTF-16 surrogate"
            f" escape at byte {match.start()})"
        ) from None


class FrameSplitter:
    """Splits a byte stream into messages.

    Unlike Twisted's ``LineOnlyReceiver`` it never re-joins its whole buffer
    when a chunk arrives, so a 16 MiB message arriving in 64 KiB reads costs
    linear time. After a :class:`FramingError` the stream is unusable.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._chunks: list[bytes] = []
        self._held = 0

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        """The messages ``data`` completes, in order; raises
        :class:`FramingError` at the first bad or oversized one."""
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                self._hold(data[start:])
                return
            line = self._line(data[start:end])
            start = end + 1
            if len(line) > self.max_frame:
                self._chunks, self._held = [], 0
                raise FramingError(
                    f"message of {len(line)} bytes exceeds {self.max_frame}"
                )
            if line.strip():
                yield decode_message(line)

    def _line(self, tail: bytes) -> bytes:
        if not self._chunks:
            return tail
        self._chunks.append(tail)
        line = b"".join(self._chunks)
        self._chunks, self._held = [], 0
        return line

    def _hold(self, rest: bytes) -> None:
        if not rest:
            return
        self._chunks.append(rest)
        self._held += len(rest)
        if self._held > self.max_frame:
            self._chunks, self._held = [], 0
            raise FramingError(f"message exceeds {self.max_frame} bytes")
