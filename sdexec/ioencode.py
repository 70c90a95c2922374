"""RFC 24 I/O objects: ``{"stream", "rank", "data", "encoding", "eof"}``.

Data that is valid UTF-8 travels as a plain string; anything else as base64
with ``"encoding": "base64"``, so arbitrary bytes round-trip exactly.
Imports no Twisted (the command line's client uses it too).
"""

from __future__ import annotations

import binascii

from sdexec.refusal import MISSING, expected, json_quoted, lone_surrogate

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any

__all__ = ["DecodedIO", "decode_io", "encode_io"]


def encode_io(
    stream: str, rank: str, data: bytes = b"", eof: bool = False, *, raw: bool = False
) -> dict:
    """An io object for ``data`` (omitted when empty) and/or ``eof``.

    ``raw``: data that is not UTF-8 stays ``bytes`` (``"encoding":
    "base64"`` all the same), for an encoder that writes bytes as base64
    itself: msgspec, the service's (sdexec.wire), does it into the message
    at twice the speed of the base64 module and the copies around it
    (docs/performance.md). The line on the wire is the same."""
    io: dict[str, Any] = {"stream": stream, "rank": rank}
    if data:
        try:
            io["data"] = data.decode("utf-8")
        except UnicodeDecodeError:
            io["data"] = data if raw else _to_base64(data)
            io["encoding"] = "base64"
    if eof:
        io["eof"] = True
    return io


class DecodedIO(dict):
    """An io object a client has decoded as it came (to check it), equal
    to the one that came: :func:`decode_io` gives that decoding again
    instead of decoding it a second time (a 64 KiB base64 one took 37 us),
    unless a value in it was changed or removed since (then afresh)."""

    __slots__ = ("_decoded", "_items")

    def __init__(self, io: dict, decoded: tuple[str, bytes, bool]) -> None:
        super().__init__(io)
        self._decoded = decoded
        #: The keys and values decoded, each value the very object it was.
        self._items = tuple(io.items())

    def decoded(self) -> tuple[str, bytes, bool] | None:
        """The decoding made as it came; ``None`` if it has changed since."""
        items = self._items
        if len(self) != len(items):
            return None
        for (key, value), (then_key, then_value) in zip(
            self.items(), items, strict=True
        ):
            if value is not then_value or key != then_key:
                return None
        return self._decoded


def decode_io(io: Any) -> tuple[str, bytes, bool]:
    """``(stream, data, eof)`` from an io object; ``ValueError`` names a bad
    field (``rank`` is checked to be a string, then ignored). A
    :class:`DecodedIO` unchanged since it came is not decoded again."""
    if type(io) is DecodedIO:
        decoded = io.decoded()
        if decoded is not None:
            return decoded
    if not isinstance(io, dict):
        raise ValueError(expected("io", "an object", io))
    stream = io.get("stream", MISSING)
    if not isinstance(stream, str):
        raise ValueError(expected("io.stream", "a string", stream))
    # Required, as RFC 42 and Flux's iodecode() require it (its value, the
    # sender's rank, is not used here: a write goes to this node's process).
    rank = io.get("rank", MISSING)
    if not isinstance(rank, str):
        raise ValueError(expected("io.rank", "a string", rank))
    text = io.get("data", "")
    if not isinstance(text, (str, bytes)):
        raise ValueError(expected("io.data", "a string", text))
    eof = io.get("eof", False)
    if not isinstance(eof, bool):
        raise ValueError(expected("io.eof", "a boolean", eof))
    encoding = io.get("encoding", "UTF-8")
    if not isinstance(encoding, str):
        raise ValueError(expected("io.encoding", '"UTF-8" or "base64"', encoding))
    if isinstance(text, bytes):  # the service's own, not yet encoded (raw)
        if encoding != "base64":
            raise ValueError("io.data: expected a string")
        return stream, text, eof
    if encoding == "base64":
        return stream, _from_base64(text), eof
    if encoding.upper() not in ("UTF-8", "UTF8"):
        raise ValueError(
            f"io.encoding: {json_quoted(encoding, 40)} is not UTF-8 or base64"
        )
    try:
        return stream, text.encode("utf-8"), eof
    except UnicodeEncodeError as error:
        raise ValueError(f"io.data: {lone_surrogate(text, error)}") from None


def _to_base64(data: bytes) -> str:
    # binascii is what the base64 module calls, without its import.
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def _from_base64(text: str) -> bytes:
    """Strict base64 (padding, no whitespace), with msgspec's decoder: about
    4 times faster than the base64 module's (docs/performance.md). Imported
    here, on first use: text output and the command line's start-up do
    without it. The last character's unused bits are not checked
    (``aGVsbG9=`` is ``hello``), as Flux's iodecode (ccan's base64)
    does not check them."""
    import msgspec

    try:
        return msgspec.convert(text, bytes)
    except msgspec.ValidationError:
        raise ValueError(f"io.data: invalid base64{_base64_fault(text)}") from None
    except UnicodeEncodeError as error:
        # msgspec encodes the text first: its own words named no field.
        raise ValueError(f"io.data: {lone_surrogate(text, error)}") from None


def _base64_fault(text: str) -> str:
    """Where strict base64 ``text`` (that msgspec refused) is wrong, as a
    suffix (``: '*' at offset 4 is not a base64 character``; ``""`` where
    none of these says it): an admin finding the bad byte in a megabyte
    of stdin needs its place. Only on that refusal: a good write pays
    nothing for it."""
    import re  # (the command line's start-up does without it)

    bad = re.search(r"[^A-Za-z0-9+/=]", text)
    if bad is not None:
        shown = json_quoted(bad.group())
        return f": {shown} at offset {bad.start()} is not a base64 character"
    pad = text.find("=")
    if pad != -1 and text[pad:].strip("="):
        return f': "=" at offset {pad} is padding before the end'
    if pad != -1 and len(text) - pad > 2:
        return f': {len(text) - pad} "=" of padding from offset {pad} (at most 2)'
    if len(text) % 4:
        return f": its length {len(text)} is not a multiple of 4"
    return ""


def line_chunks(data: bytes, size: int) -> list[bytes]:
    """``data`` in chunks of at most ``size`` bytes, each ending at a line's
    end: whole lines packed together, a line longer than ``size`` alone
    split. A line that fits is never cut between two messages (Flux's
    channels send one line a message: a client whose buffer is
    ``<stream>_BUFSIZE`` and that takes whole lines out of it is overrun by
    a message after a partial line, which ends its subprocess)."""
    if len(data) <= size:
        return [data]
    chunks = []
    start = 0
    while len(data) - start > size:
        cut = data.rfind(b"\n", start, start + size) + 1
        if cut <= start:  # a line longer than the buffer
            cut = start + size
        chunks.append(data[start:cut])
        start = cut
    chunks.append(data[start:])
    return chunks
