"""Newline-delimited JSON framing: encoding, splitting, limits."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.testing import StringTransport

from sdexec.framing import JSONLineProtocol
from sdexec.ioencode import decode_io, encode_io
from sdexec.wire import (
    MAX_NESTING,
    SMALL_LINE,
    FrameSplitter,
    FramingError,
    decode_message,
    encode_message,
    encode_small_message,
)

# Output-sized text: a short random text repeated (64 KiB of random text is
# too slow for hypothesis to generate).
long_text = st.text(min_size=1, max_size=64).map(
    lambda piece: piece * (64 * 1024 // len(piece) + 1)
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text() | long_text,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)


def nested_objects(levels: int, padding: int = 0) -> bytes:
    """A message ``levels`` deep, objects and arrays by turns, with a
    sibling at every level (the walk must look past the first member)."""
    text = "0"
    for level in range(levels - 1, 0, -1):
        text = f'{{"s":1,"k":{text}}}' if level % 2 else f"[1,{text}]"
    return f'{{"pad":"{"p" * padding}","k":{text}}}\n'.encode()


@pytest.mark.parametrize("padding", [0, SMALL_LINE], ids=["json", "msgspec"])
def test_nesting_is_limited_the_same_by_both_decoders(padding):
    assert decode_message(nested_objects(MAX_NESTING, padding))
    with pytest.raises(FramingError, match=f"more than {MAX_NESTING} levels"):
        decode_message(nested_objects(MAX_NESTING + 1, padding))


@settings(max_examples=200)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_encode_message_round_trips(message):
    line = encode_message(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == message
    assert decode_message(line) == message


def padded(line: bytes) -> bytes:
    """``line`` made long with JSON whitespace: decoded by msgspec."""
    return line.rstrip(b"\n") + b" " * SMALL_LINE + b"\n"


@settings(max_examples=200)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_both_codecs_agree(message):
    # The command line encodes with the json module, the service with
    # msgspec; short lines decode with the one, long ones with the other.
    for line in (encode_message(message), encode_small_message(message)):
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert decode_message(line) == message
        assert decode_message(padded(line)) == message


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
@pytest.mark.parametrize("size", ["short", "long"])
def test_numbers_that_are_not_json_are_refused_by_both(constant, size):
    line = b'{"a":' + constant + b"}"
    with pytest.raises(FramingError, match="not valid JSON"):
        decode_message(padded(line) if size == "long" else line)


def test_a_float_that_is_not_a_number_is_not_sent_by_the_command_line():
    with pytest.raises(ValueError, match="not JSON compliant"):
        encode_small_message({"a": float("nan")})


@pytest.mark.parametrize("data", [b"\xff" * 100_000, b"text \xc3\xa9", b"\xc3"])
def test_raw_io_is_the_same_line_and_reads_back(data):
    # The service leaves non-UTF-8 output as bytes for msgspec to base64.
    raw = encode_io("stdout", "0", data, raw=True)
    encoded = encode_io("stdout", "0", data)
    assert encode_message({"io": raw}) == encode_message({"io": encoded})
    assert decode_io(raw) == decode_io(encoded) == ("stdout", data, False)


def test_raw_bytes_that_claim_to_be_text_are_refused():
    with pytest.raises(ValueError, match=r"io\.data: expected a string"):
        decode_io({"stream": "stdout", "data": b"x"})


def test_long_text_with_every_escape_round_trips():
    text = 'quote " backslash \\ tab \t newline \n del \x7f é €\u2028 ' * 200
    message = {"payload": {"io": {"data": text}}, "matchtag": 7}
    assert json.loads(encode_message(message)) == message


def test_long_text_with_other_control_characters_round_trips():
    text = "bell \x07 nul \x00 escape \x1b\n" * 400
    assert json.loads(encode_message({"data": text})) == {"data": text}


class Collector(JSONLineProtocol):
    def __init__(self, max_frame: int = 1024) -> None:
        super().__init__()
        self.max_frame = max_frame
        self.messages: list[dict] = []
        self.errors: list[str] = []

    def messageReceived(self, message):
        self.messages.append(message)

    def framingError(self, reason):
        self.errors.append(reason)


def feed(protocol: Collector, *chunks: bytes) -> Collector:
    protocol.makeConnection(StringTransport())
    for chunk in chunks:
        protocol.dataReceived(chunk)
    return protocol


def test_messages_split_across_and_within_reads():
    received = feed(Collector(), b'{"a":1}\n{"b"', b':2}\n\n{"c":', b"3}\n")
    assert received.messages == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert received.errors == []


def test_not_json_then_nothing_more():
    received = feed(Collector(), b'nope\n{"a":1}\n')
    assert received.messages == []
    assert len(received.errors) == 1 and "not valid JSON" in received.errors[0]


def test_not_an_object():
    assert "not a JSON object" in feed(Collector(), b"[1]\n").errors[0]


def test_a_frame_over_the_limit_is_refused_before_its_end():
    received = feed(Collector(max_frame=100), b'{"a":"' + b"x" * 200)
    assert received.errors == ["message exceeds 100 bytes"]


def test_the_splitter_needs_no_twisted():
    splitter = FrameSplitter(max_frame=100)
    assert list(splitter.feed(b'{"a":1}\n{"b"')) == [{"a": 1}]
    assert list(splitter.feed(b':"\xc3\xa9"}\n')) == [{"b": "\u00e9"}]
    with pytest.raises(FramingError, match="exceeds 100 bytes"):
        list(splitter.feed(b"x" * 101))


def test_invalid_utf8_is_a_framing_error():
    with pytest.raises(FramingError, match="not valid JSON"):
        decode_message(b'{"a":"\xff"}')


def test_a_buffer_read_into_again_keeps_what_it_held():
    """The command line reads into one buffer over and over: a line split
    across reads must survive the buffer being overwritten, and what lies
    past the length read (here, whole messages) is never looked at."""
    buffer = bytearray(b'{"x":0}\n' * 8)
    splitter = FrameSplitter()

    def read(data: bytes) -> list[dict]:
        buffer[: len(data)] = data
        return list(splitter.feed(buffer, len(data)))

    assert read(b'{"a":1}\n{"b":"xy') == [{"a": 1}]
    assert read(b'z"}\n{"c":[1,') == [{"b": "xyz"}]
    assert read(b"2]}\n") == [{"c": [1, 2]}]


def test_blank_lines_are_skipped_however_long():
    long_blank = b" \t\r" * SMALL_LINE + b"\n"
    received = feed(Collector(1 << 20), b"\n  \n" + long_blank + b'{"a":1}\n')
    assert received.messages == [{"a": 1}]
    assert received.errors == []


def test_a_short_line_nested_too_deeply_is_refused_by_its_brackets():
    # Short lines count their brackets instead of walking the message: the
    # same limit, a bracket short of it or one past.
    for levels in (MAX_NESTING, MAX_NESTING + 1):
        line = b'{"a":' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"
        assert 2 * MAX_NESTING < len(line) <= SMALL_LINE
        if levels > MAX_NESTING:
            with pytest.raises(FramingError, match="nested too deeply"):
                decode_message(line)
        else:
            assert decode_message(line)


def test_brackets_in_strings_only_make_a_short_line_walked():
    line = b'{"a":"' + b"[{" * MAX_NESTING + b'","b":[[1]]}'
    assert len(line) <= SMALL_LINE
    assert decode_message(line)["b"] == [[1]]


@settings(max_examples=100)
@given(st.integers(1, 2 * MAX_NESTING), st.integers(0, 2 * MAX_NESTING))
def test_nesting_is_judged_the_same_however_long_the_line(levels, padding):
    line = nested_objects(levels, padding)
    if levels > MAX_NESTING:
        with pytest.raises(FramingError, match="nested too deeply"):
            decode_message(line)
    else:
        assert decode_message(line)
