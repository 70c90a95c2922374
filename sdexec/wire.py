"""The wire format, written once: newline-delimited JSON (docs/protocol.md).

Encoding, decoding and splitting a byte stream into messages, for every end
of the protocol: the service and the Twisted client (through
:class:`sdexec.framing.JSONLineProtocol`) and the command line's synchronous
client (``sdexec.syncclient``). It imports no Twisted, so the command line
starts without it.

Two JSON codecs, each where it wins (docs/performance.md):

- msgspec for the bulk: output data is most of what crosses the socket, and
  msgspec encodes a 64 KiB string about 4 times faster than the json module
  and decodes it about 3 times faster (orjson, measured too, is in between);
- the json module's C encoder and scanner for short lines and for the
  command line's requests: the command line exchanges a handful of small
  messages, and importing msgspec (with ``typing_extensions``, ``inspect``,
  ``uuid``…) would cost it more than all of them, about 40 % of its
  start-up. msgspec is imported when first needed. The C cores are used as
  the json module uses them, without the module, which imports ``re``
  (and with it ``enum``): 4 ms of ``sdexec run``'s start. The module is
  loaded only to word a refusal.

Both refuse what is not standard JSON (``NaN``, ``Infinity``), and what one
accepts the other decodes to the same objects; a test holds them to it.
"""

from __future__ import annotations

import functools
from _json import encode_basestring, make_encoder, make_scanner
from itertools import chain, compress

from sdexec.protocolbase import DEFAULT_MAX_FRAME

#: A line of the stream: a read's view, or the buffer of one that came in
#: pieces.
Line = bytes | bytearray | memoryview

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import re
    from collections.abc import Callable, Iterable, Iterator
    from typing import Any

__all__ = [
    "MAX_VALUES",
    "FrameSplitter",
    "FramingError",
    "count_values",
    "decode_message",
    "encode_message",
    "encode_small_message",
]

#: Lines up to this size are decoded with the json module, so that a
#: command line exchanging only small messages never imports msgspec. msgspec
#: is still 4-7x faster per message (about 1 us less for a 50-150 byte
#: response): nothing next to an import, or to a unit's own cost.
SMALL_LINE = 4096

#: The deepest a message may nest (the message object is level 1; a request
#: needs five). Both decoders recurse, and where they give up depends on the
#: interpreter (about 1000 levels on Python 3.11, several times that on 3.12,
#: whose C code has its own limit) and on which decoder the line's length
#: picks: checked after decoding, this one limit holds for every message on
#: every interpreter.
MAX_NESTING = 512

_TOO_DEEP = f"message is nested too deeply (more than {MAX_NESTING} levels)"

#: The most JSON values a message may decode into, keys included, as
#: :func:`count_values` counts them before decoding. ``max-frame-size``
#: bounds a line's bytes, not what they decode into: ``[],`` is 3 bytes on
#: the wire and 64 decoded, and a 64 MiB line of them took 1.7 GB. At this
#: limit the values' objects take about 210 MB at most (the costliest shape
#: measured, objects of short keys and strings, about 100 bytes a value),
#: and strings' text up to 4 bytes a character besides (one character
#: outside the BMP makes a whole string so): a message holds at most about
#: 210 MB + 4 x its line, where it held 25 x its line. The largest command the
#: budget allows (:data:`sdexec.limits.MAX_COMMAND`: 2.5 MiB of empty
#: strings, 8 bytes each) holds 0.33 Mi values, a sixth of it; a stdin
#: write holds a dozen, however long its data.
MAX_VALUES = 2 * 1024 * 1024

#: A JSON string, its escapes included. The closing quote is optional: a
#: string a line that is not JSON leaves open ends at the line's end, so no
#: match is tried again from a later quote (which made the search quadratic).
#: Compiled when first needed: the command line never counts.
_STRING = rb'"(?:[^"\\]++|\\.)*+"?'
#: Strings :func:`count_values` takes out at a time: a substitution keeps
#: every piece until its end, about 200 bytes a string (2 Mi strings took
#: 486 MB). Each round copies the rest of the line: larger rounds, less time.
_STRINGS_A_ROUND = 1 << 18


class FramingError(ValueError):
    """The peer sent something that is not a message; the stream is unusable."""


def encode_message(message: dict[str, Any]) -> bytes:
    """One message as a line: compact JSON, UTF-8, ``\\n``-terminated
    (msgspec: for the service, and for anything bulky)."""
    return _msgspec_codec().encode(message) + b"\n"


def encode_small_message(message: dict[str, Any]) -> bytes:
    """:func:`encode_message` with the json module's C encoder, for a client
    that sends only small messages and should not import msgspec: the same
    line (a float that is not a number is refused here; msgspec writes
    ``null``)."""
    # As json.JSONEncoder(ensure_ascii=False, separators=(",", ":"),
    # allow_nan=False).encode makes its encoder: one a call, whose markers
    # (the containers it is in, against a cycle) start empty.
    encoder = make_encoder(
        {}, _not_serializable, encode_basestring, None, ":", ",", False, False, False
    )
    return "".join(encoder(message, 0)).encode("utf-8") + b"\n"


def _not_serializable(value: object) -> object:
    # json.JSONEncoder.default's refusal.
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def decode_message(line: Line, max_values: int | None = MAX_VALUES) -> dict[str, Any]:
    """The JSON object on ``line``; :class:`FramingError` if it is not one,
    if it nests deeper than :data:`MAX_NESTING` or if it holds more than
    ``max_values`` values (``None``: any number, as its bytes allow)."""
    if max_values is not None and len(line) > max_values:
        # A shorter line cannot hold more: each value but the first takes
        # a byte of its own (a comma, a colon, a bracket).
        _check_values(line, max_values)
    try:
        if len(line) <= SMALL_LINE:
            message = _decode_with_json(line)
        else:
            message = _decode_with_msgspec(line)
    except RecursionError:
        # Both decode recursively; a line of a few thousand "[" would
        # otherwise escape as a RecursionError and drop the connection.
        raise FramingError(_TOO_DEEP) from None
    if not isinstance(message, dict):
        raise FramingError("message is not a JSON object")
    if _may_nest_deeper(line) and _nests_deeper(message, MAX_NESTING):
        raise FramingError(_TOO_DEEP)
    return message


def _check_values(line: Line, limit: int) -> None:
    """Refuse ``line`` (:class:`FramingError`) if it would decode into more
    than ``limit`` values, keys included, before it is decoded.

    Its commas, colons and opening brackets counted wherever they are give
    an upper bound at C speed (about 1 GB/s for the four, as fast as msgspec
    decodes a long string). Only a line above the limit that way is counted
    exactly, its strings taken out (0.3 GB/s for a few long strings, 0.065
    for 2 Mi short ones: about 1 s for 64 MiB at worst), so that a long
    stdin write full of commas is never refused, only checked more slowly.
    """
    data = _as_bytes(line)
    if 1 + _separators(data) <= limit:
        return
    values = count_values(data, limit)
    if values is None:
        raise FramingError(
            f"message holds too many JSON values: more than {limit} strings"
            f" alone (at most {limit})"
        )
    if values > limit:
        raise FramingError(
            f"message holds too many JSON values: {values}, keys included"
            f" (at most {limit})"
        )


def count_values(line: bytes, most_strings: int) -> int | None:
    """The values ``line`` holds, keys included, each empty array or object
    counted twice: one more than its ``,`` ``:`` ``[`` and ``{`` outside
    strings (for JSON, each value or key but the first follows one of
    those). ``None`` past ``most_strings`` strings (each a value or a key),
    which are not looked past: millions of short strings took seconds.

    Exact for JSON; for a line that is not, at least as many as a decoder
    makes before it finds out (both read it alike up to where it stops).
    """
    # At least this many strings: every quote no backslash precedes opens
    # or closes one (one a backslash precedes may be escaped).
    if (line.count(b'"') - line.count(b'\\"')) // 2 > most_strings:
        return None
    outside, strings = line, 0
    while True:
        outside, found = _string_pattern().subn(b"", outside, count=_STRINGS_A_ROUND)
        strings += found
        if strings > most_strings:
            return None
        if found < _STRINGS_A_ROUND:
            return 1 + _separators(outside)


@functools.cache
def _string_pattern() -> re.Pattern[bytes]:
    import re

    return re.compile(_STRING, re.DOTALL)


def _separators(data: bytes) -> int:
    """The ``,`` ``:`` ``[`` and ``{`` bytes of ``data``, in strings too."""
    return data.count(b",") + data.count(b":") + data.count(b"[") + data.count(b"{")


def _may_nest_deeper(line: Line) -> bool:
    """Whether ``line`` has room for more than :data:`MAX_NESTING` levels,
    each of which takes an opening bracket and a closing one.

    Counting a short line's brackets (C code) costs a fraction of walking
    its message: 1.6 against 3.8 us for an ``exec`` with 60 variables. On a
    long line it costs more (31 against 1.3 us for 64 KiB of output), so a
    long line is walked whatever it holds.
    """
    if len(line) <= 2 * MAX_NESTING + 1:
        return False  # most responses and requests: not even the brackets
    if len(line) > SMALL_LINE:
        return True
    data = _as_bytes(line)
    return data.count(b"[") + data.count(b"{") > MAX_NESTING


def _as_bytes(line: Line) -> bytes:
    """``line`` itself, or a view's copy: a view has no ``count``."""
    return line if type(line) is bytes else bytes(line)


def _nests_deeper(message: dict[str, Any], limit: int) -> bool:
    """Whether ``message`` holds containers more than ``limit`` levels deep.

    Level by level, not a recursion (it must not fail where the decoders
    did not), and each level's containers are picked out by C code
    (``compress`` over the members' types): a request costs a few
    microseconds, and a hostile line of millions of members a fraction of
    a second per 32 MB, a small multiple of its decoding.
    """
    level: list[Any] = [message]
    for _ in range(limit):
        if len(level) == 1:  # the usual case: no copy of the members
            members = _members(level[0])
        else:
            members = list(chain.from_iterable(_members(c) for c in level))
        level = list(compress(members, map(_is_container, map(type, members))))
        if not level:
            return False
    return True


def _members(container: dict | list) -> Iterable[Any]:
    return container.values() if type(container) is dict else container


#: JSON decoders make exactly these (no subclasses): ``type`` is enough.
_is_container = frozenset((dict, list)).__contains__


def _decode_with_json(line: Line) -> Any:
    try:
        # Decoded first: given bytes, the json module would guess UTF-16/32.
        text = str(line, "utf-8")
    except UnicodeDecodeError as error:
        raise FramingError(f"message is not valid JSON: {error}") from None
    try:
        return _scan_whole(text)
    except (ValueError, StopIteration):  # JSONDecodeError too
        # The json module's own words for what is wrong, and where.
        return _decode_with_json_module(text)


def _scan_whole(text: str) -> Any:
    """The JSON value ``text`` holds, whitespace around it, as
    ``json.JSONDecoder.decode`` reads it (with its C scanner); a
    ``ValueError`` or ``StopIteration`` when it holds anything else."""
    start = len(text) - len(text.lstrip(_JSON_WHITESPACE))
    try:
        value, end = _scan_once(text, start)
    except SystemError:
        # The C scanner raises its JSONDecodeError from json.decoder, which
        # it finds in sys.modules only: in the command line, which has not
        # imported it, its error (an unterminated string, a missing comma)
        # was a SystemError ("returned NULL without setting an exception"),
        # and `sdexec run` said "unexpected error: SystemError" of a bad
        # line from the service. The json module's words come instead.
        raise ValueError("not valid JSON") from None
    if end != len(text) and text[end:].strip(_JSON_WHITESPACE):
        raise ValueError("Extra data")
    return value


def _decode_with_json_module(text: str) -> Any:
    """``text`` decoded by the json module itself, with the rules of the
    scanner: a :class:`FramingError` with the module's message."""
    import json

    decoder = json.JSONDecoder(
        parse_constant=_refuse_constant, parse_float=_finite_float
    )
    try:
        return decoder.decode(text)
    except ValueError as error:  # JSONDecodeError too
        raise FramingError(f"message is not valid JSON: {error}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    # Past a double's range the json module makes inf where msgspec refuses
    # the line: one message would decode two ways, by its length.
    value = float(text)
    if value in (_INFINITY, -_INFINITY):
        raise ValueError(f"Number out of range: {text[:40]}")
    return value


_INFINITY = float("inf")
#: What JSON takes for whitespace (``json.decoder.WHITESPACE``).
_JSON_WHITESPACE = " \t\n\r"


class _DecodingRules:
    """What the json module's C scanner reads of its decoder: the rules
    ``json.JSONDecoder(parse_constant=_refuse_constant,
    parse_float=_finite_float)`` gives it."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_int = int
    parse_float = staticmethod(_finite_float)
    parse_constant = staticmethod(_refuse_constant)


# The scanner's stub types its argument as a scanner: it reads the same
# attributes of any object.
_scan_once = make_scanner(_DecodingRules())  # type: ignore[arg-type]


def _decode_with_msgspec(line: Line) -> Any:
    decoder = _msgspec_codec()
    try:
        return decoder.decode(line)
    except (decoder.error, UnicodeDecodeError) as error:
        if str(error).startswith(_MSGSPEC_HUGE_INTEGER):
            raise FramingError(_huge_integer_said(line)) from None
        return _decode_lone_surrogates(line, error)


#: How msgspec refuses an integer Python will not read from its digits
#: (past ``sys.get_int_max_str_digits()``, 4300 by default), ``- at `$[...]```
#: after it: valid JSON, said so, with the field it is in.
_MSGSPEC_HUGE_INTEGER = "Integer value out of range"


class _HugeInteger:
    """Where the json module met an integer too long to read: its digits."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _huge_integer_said(line: Line) -> str:
    """Why ``line``, valid JSON, is refused for an integer of more digits
    than Python reads (``message: cmd.cmdline[1]: an integer too large
    (5000 digits)``): msgspec said "Integer value out of range - at
    `$[...][1]`", naming no field."""
    import json

    from sdexec.refusal import SHOWN, printable

    def parse_int(text: str) -> int | _HugeInteger:
        try:
            return int(text)
        except ValueError:
            return _HugeInteger(len(text.lstrip("-")))

    decoder = json.JSONDecoder(parse_int=parse_int, parse_constant=_refuse_constant)
    try:
        message = decoder.decode(str(line, "utf-8"))
    except ValueError:  # (a float past a double's range before it, say)
        message = None
    # The nesting is refused first, as on any other line (past about 990
    # levels the decoder's RecursionError already says so).
    if type(message) is dict and _nests_deeper(message, MAX_NESTING):
        return _TOO_DEEP
    found = None if message is None else _first_huge(message)
    if found is None:
        return "message holds an integer too large to read"
    field, huge = found
    # Cut as a refusal cuts what a request chose: nested keys, each cut
    # alone, made a field of 100 KB, said to the client and logged.
    where = f"{printable(field, SHOWN)}: " if field else ""
    return f"message: {where}an integer too large ({huge.digits} digits)"


def _first_huge(message: Any) -> tuple[str, _HugeInteger] | None:
    """The field (``cmd.env.X``, ``""`` for the message itself) of the
    first :class:`_HugeInteger` in ``message``, and it; ``None`` if none.
    A loop, not recursion: the line has not had its nesting checked."""
    from sdexec.refusal import member

    pending: list[tuple[str, Any]] = [("", message)]
    while pending:
        field, value = pending.pop()
        if isinstance(value, _HugeInteger):
            return field, value
        if type(value) is dict:
            named = [
                (member(field, key).removeprefix("."), v) for key, v in value.items()
            ]
        elif type(value) is list:
            named = [(f"{field}[{index}]", v) for index, v in enumerate(value)]
        else:
            continue
        pending.extend(reversed(named))  # the first one first
    return None


class _Codec:
    """msgspec's encoder and decoder, made on first use."""

    def __init__(self) -> None:
        import msgspec

        self.encode: Callable[[Any], bytes] = msgspec.json.Encoder().encode
        self.decode: Callable[[Line], Any] = msgspec.json.Decoder().decode
        self.error: type[Exception] = msgspec.DecodeError


@functools.cache
def _msgspec_codec() -> _Codec:
    return _Codec()


#: A high surrogate escape not followed by a low one, or a lone low one.
_LONE_SURROGATE = (
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<![0-9a-fA-F]{4})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


@functools.cache
def _lone_surrogate_pattern() -> re.Pattern[bytes]:
    # Compiled when first needed, as _STRING: the command line never is.
    import re

    return re.compile(_LONE_SURROGATE)


def _decode_lone_surrogates(line: Line, error: Exception) -> Any:
    """A line msgspec refused, if only for a lone surrogate escape
    (``"\\ud800"``: valid JSON, but a string no UTF-8 can carry).

    The json module decodes it, so that the request's own checks refuse the
    field holding it with EINVAL naming that field (sdexec.limits), as for a
    NUL, instead of a framing error that says nothing of the field. Any other
    refusal stays a :class:`FramingError`.
    """
    # JSON escapes are lower case: without "\u" there is no surrogate escape,
    # and a long line of garbage is told at C speed (the search took 1 s
    # for 64 MiB whatever the line held).
    data = _as_bytes(line)
    match = _lone_surrogate_pattern().search(data) if b"\\u" in data else None
    if match is None:
        raise FramingError(f"message is not valid JSON: {error}") from None
    try:
        return _scan_whole(str(line, "utf-8"))
    except (ValueError, StopIteration):  # a RecursionError is decode_message's
        raise FramingError(
            f"message is not valid JSON: {error} (a lone UTF-16 surrogate"
            f" escape at byte {match.start()})"
        ) from None


#: What ``bytes.strip()`` removes: a line of nothing else carries no message.
_WHITESPACE = b" \t\n\r\x0b\x0c"
#: How every message begins.
_OPEN_OBJECT = ord("{")


def _blank(line: Line) -> bool:
    """Whether ``line`` is empty or only whitespace (skipped, not refused);
    a line that starts with anything else is not copied to find out."""
    return not line or (line[0] in _WHITESPACE and not bytes(line).strip())


class FrameSplitter:
    """Splits a byte stream into messages.

    Unlike Twisted's ``LineOnlyReceiver`` it never re-joins its whole buffer
    when a chunk arrives, so a 16 MiB message arriving in 64 KiB reads costs
    linear time. After a :class:`FramingError` the stream is unusable.
    ``max_values`` is :func:`decode_message`'s.
    """

    def __init__(
        self, max_frame: int = DEFAULT_MAX_FRAME, max_values: int | None = MAX_VALUES
    ) -> None:
        self.max_frame = max_frame
        self.max_values = max_values
        #: What sets :attr:`max_frame`, named when a message exceeds it (a
        #: configuration key, for the peer to know what to ask an admin).
        self.max_frame_name = ""
        #: Where in the data being fed the message just yielded ended: the
        #: rest is ``data[consumed:]`` for a caller that stops there.
        self.consumed = 0
        #: The bytes of the line the message just yielded was decoded from
        #: (its line end not counted): what a caller that keeps the message
        #: holds it by.
        self.frame_bytes = 0
        #: An incomplete line, in one buffer: kept as the reads that brought
        #: it, a peer sending a byte a read made each byte cost 42 (a bytes
        #: object and its list slot), and max_frame 42 times what it says.
        self._partial = bytearray()
        #: The first byte of the stream that is not whitespace, once fed.
        self._first: int | None = None

    @property
    def foreign(self) -> bool:
        """Whether the stream began with something other than a JSON object
        (``{``): a peer that speaks another protocol (an HTTP server's
        ``HTTP/1.1 400``), not a message of ours that broke."""
        return self._first is not None and self._first != _OPEN_OBJECT

    def feed(
        self, data: bytes | bytearray, length: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """The messages ``data[:length]`` completes, in order; raises
        :class:`FramingError` at the first bad or oversized one.

        ``data`` may be a buffer the caller reads into again (the command
        line's ``recv_into``): lines are decoded through views of it, and
        only an incomplete last line is copied, so ``data`` may be reused
        once the iterator is exhausted.
        """
        end_of_data = len(data) if length is None else length
        view = memoryview(data)
        if self._first is None:
            self._note_first(view[:end_of_data])
        start = 0
        while True:
            end = data.find(b"\n", start, end_of_data)
            if end < 0:
                if start < end_of_data:
                    self._hold(view[start:end_of_data])
                return
            line = self._line(view[start:end])
            start = end + 1
            if len(line) > self.max_frame:
                self._partial = bytearray()
                raise FramingError(
                    f"message of {len(line)} bytes exceeds {self.max_frame}"
                    f"{self._named_limit()}"
                )
            if not _blank(line):
                self.consumed = start
                self.frame_bytes = len(line)
                yield decode_message(line, self.max_values)

    def _note_first(self, data: memoryview) -> None:
        # Stripped in C: a peer may send megabytes of blanks first, and a
        # loop over them in Python would hold the service's thread.
        rest = bytes(data).lstrip(_WHITESPACE)
        if rest:
            self._first = rest[0]

    @property
    def unfinished(self) -> int:
        """The bytes of a line that has come without its end (a peer that
        closes now has cut a message off), blank ones not counted."""
        return 0 if _blank(self._partial) else len(self._partial)

    def _named_limit(self) -> str:
        return f" ({self.max_frame_name})" if self.max_frame_name else ""

    def _line(self, tail: memoryview) -> bytearray | memoryview:
        if not self._partial:
            return tail
        self._partial += tail
        line, self._partial = self._partial, bytearray()
        return line

    def _hold(self, rest: memoryview) -> None:
        # Copied: the caller may read into ``data`` again.
        self._partial += rest
        if len(self._partial) > self.max_frame:
            self._partial = bytearray()
            raise FramingError(
                f"message exceeds {self.max_frame} bytes{self._named_limit()}"
            )
