"""Newline-delimited JSON framing: encoding, splitting, limits."""

from __future__ import annotations

import base64
import json
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import bytes_held_by
from twisted.internet.testing import StringTransport

from sdexec.framing import JSONLineProtocol
from sdexec.ioencode import decode_io, encode_io
from sdexec.limits import MAX_COMMAND, check_command_size
from sdexec.wire import (
    MAX_NESTING,
    MAX_VALUES,
    SMALL_LINE,
    FrameSplitter,
    FramingError,
    count_values,
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


def json_module_reading(line: bytes) -> object:
    """What the json module makes of a short line, as the wire's rules
    ask it (no NaN, no number past a double): the message, or the
    refusal's text."""

    def refuse(text: str) -> float:
        raise ValueError(f"{text} is not JSON")

    def finite(text: str) -> float:
        if abs(float(text)) == float("inf"):
            raise ValueError(f"Number out of range: {text[:40]}")
        return float(text)

    decoder = json.JSONDecoder(parse_constant=refuse, parse_float=finite)
    try:
        return decoder.decode(line.decode())
    except ValueError as error:
        return f"message is not valid JSON: {error}"


# JSON's whitespace, and some that is not.
json_whitespace = st.text(" \t\r\x0b\x0c\xa0", max_size=3)
json_numbers = st.floats(allow_nan=False, allow_infinity=False) | st.integers()


@settings(max_examples=300)
@given(
    st.dictionaries(st.text(max_size=8), json_values | json_numbers, max_size=4),
    json_whitespace,
    json_whitespace,
    st.sampled_from(["", "x", "}", "1", ",", "NaN", "\\"]),
    st.integers(0, 40),
)
def test_short_lines_are_read_as_the_json_module_reads_them(
    message, before, after, noise, cut
):
    # The json module's C scanner, driven without the module (whose import
    # is 4 ms of the command line's start): the same messages, the same
    # refusals, whitespace and trailing data included.
    encoded = json.dumps(message, ensure_ascii=False, allow_nan=False)
    for text in (before + encoded + after, encoded[:cut] + noise + encoded[cut:]):
        line = text.encode()
        if len(line) > SMALL_LINE or "\n" in text:
            continue
        expected = json_module_reading(line)
        try:
            got: object = decode_message(line)
        except FramingError as error:
            got = str(error)
        if isinstance(expected, dict) or got != "message is not a JSON object":
            assert got == expected


@given(st.dictionaries(st.text(max_size=8), json_values | json_numbers, max_size=4))
def test_the_command_line_encodes_as_the_json_module_does(message):
    expected = json.dumps(
        message, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    )
    assert encode_small_message(message) == expected.encode() + b"\n"


# 1e309: JSON, but past a double; the json module made it inf, msgspec
# refused it: a request's outcome hung on its length.
@pytest.mark.parametrize(
    "constant", [b"NaN", b"Infinity", b"-Infinity", b"1e309", b"-1e309"]
)
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


@pytest.mark.parametrize(("data", "decoded"), [("aGVsbG9=", b"hello"), ("YR==", b"a")])
def test_base64_s_unused_last_bits_are_ignored_as_flux_ignores_them(data, decoded):
    # Not canonical (the last character's unused bits are not 0): Flux's
    # iodecode (ccan's base64_decode) reads it so, and a write is taken
    # as Flux's subprocess server takes it. No encoder sends it.
    io = {"stream": "stdin", "rank": "0", "data": data, "encoding": "base64"}
    assert decode_io(io) == ("stdin", decoded, False)


def test_raw_bytes_that_claim_to_be_text_are_refused():
    with pytest.raises(ValueError, match=r"io\.data: expected a string"):
        decode_io({"stream": "stdout", "rank": "0", "data": b"x"})


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


def test_nesting_too_deep_is_said_before_an_integer_too_large_in_it():
    # An integer past Python's 4300 digits sends the line to a second
    # decoding that names its field; that one recurses up to about 990
    # levels, and in between it said "an integer too large" instead.
    for levels in (MAX_NESTING, MAX_NESTING + 1, 2 * MAX_NESTING - 50):
        arrays = levels - 1
        line = b'{"a":' + b"[" * arrays + b"9" * 5000 + b"]" * arrays + b"}"
        with pytest.raises(FramingError) as refused:
            decode_message(line)
        too_deep = "nested too deeply" in str(refused.value)
        assert too_deep == (levels > MAX_NESTING), (levels, str(refused.value))


@settings(max_examples=100)
@given(st.integers(1, 2 * MAX_NESTING), st.integers(0, 2 * MAX_NESTING))
def test_nesting_is_judged_the_same_however_long_the_line(levels, padding):
    line = nested_objects(levels, padding)
    if levels > MAX_NESTING:
        with pytest.raises(FramingError, match="nested too deeply"):
            decode_message(line)
    else:
        assert decode_message(line)


# -- the values a line holds -----------------------------------------------------


def reference_count(value) -> int:
    """What :func:`count_values` counts, from the decoded value: every value
    and key, and each empty array or object once more."""
    if isinstance(value, dict):
        inner = sum(1 + reference_count(member) for member in value.values())
        return 1 + inner + (not value)
    if isinstance(value, list):
        return 1 + sum(map(reference_count, value)) + (not value)
    return 1


#: Text made mostly of what a counter could take for JSON's own syntax (no
#: lone surrogates: no UTF-8 line can carry one unescaped).
syntax_text = st.text(
    alphabet=st.sampled_from('",:[]{}\\/ \n\tu')
    | st.characters(exclude_categories=["Cs"])
)
counted_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
counted_values = st.recursive(
    counted_scalars | syntax_text,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(syntax_text, children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300)
@given(counted_values, st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_values_are_counted_outside_strings_exactly(value, separators, ascii_only):
    message = {"v": value}
    expected = reference_count(message)
    lines = [
        json.dumps(message, separators=separators, ensure_ascii=ascii_only).encode(),
        encode_message(message),
    ]
    for line in lines:
        assert count_values(line, len(line)) == expected
        with patch("sdexec.wire._STRINGS_A_ROUND", 3):
            assert count_values(line, len(line)) == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (rb'{"a":"\\"}', 3),  # an escaped backslash ends before the quote
        (rb'{"a":"\",[{:"}', 3),  # an escaped quote does not end the string
        (rb'{"a":"\\\",:"}', 3),
        (rb'{"a":"\\","b":[]}', 6),
        (rb'{"a":[[],{}],"b":"\u005c"}', 9),
        (rb'{ "a" : [ 1 , 2 ] }', 5),
        (rb'{"a":"\ud800[","b":0}', 5),  # a lone surrogate, escaped
    ],
)
def test_escapes_are_read_as_json_reads_them(line, expected):
    assert count_values(line, len(line)) == expected
    assert reference_count(json.loads(line)) == expected


def test_a_string_left_open_is_counted_to_the_line_s_end_once():
    # Tried from each of its quotes again, a string that never ends made
    # the count quadratic: a 1 MB line of them would not finish.
    line = b'{"a":[],"b":"' + b'\\",' * 250_000
    assert count_values(line, len(line)) == 6


@pytest.mark.parametrize("string", ["x", "\\"], ids=["plain", "escape-at-end"])
def test_past_most_strings_none_is_counted(string):
    # Plain strings are too many by their quotes alone; those ending in an
    # escaped backslash (\\") only once found.
    line = json.dumps({"a": [string] * 10}).encode()
    assert count_values(line, 11) == 13
    assert count_values(line, 10) is None


def strings_in(value) -> int:
    """The strings of a decoded value, keys included."""
    if isinstance(value, dict):
        return len(value) + sum(map(strings_in, value.values()))
    if isinstance(value, list):
        return sum(map(strings_in, value))
    return isinstance(value, str)


def test_strings_are_taken_out_a_round_at_a_time(monkeypatch):
    monkeypatch.setattr("sdexec.wire._STRINGS_A_ROUND", 2)
    for value in (["a", "b"], ["a", "b", "c"], {"k": ["\\", '"', ",:[{"], "l": {}}):
        message = {"v": value}
        line, strings = json.dumps(message).encode(), strings_in(message)
        assert count_values(line, strings) == reference_count(message)
        assert count_values(line, strings - 1) is None


def hostile(item: bytes, count: int) -> bytes:
    """``{"a":[item,item,...]}``: ``count`` items."""
    return b'{"a":[' + b",".join([item] * count) + b"]}"


def test_a_line_of_empty_arrays_past_the_limit_is_refused_naming_both():
    line = hostile(b"[]", MAX_VALUES // 2 + 1)
    values = 2 * (MAX_VALUES // 2 + 1) + 3  # the object, its key, its array
    assert count_values(line, len(line)) == values
    message = (
        f"message holds too many JSON values: {values}, keys included"
        f" (at most {MAX_VALUES})"
    )
    with pytest.raises(FramingError) as refusal:
        decode_message(line)
    assert str(refusal.value) == message
    # One value under the limit, it decodes.
    assert decode_message(hostile(b"[]", MAX_VALUES // 2 - 2))


def test_a_line_of_more_strings_than_values_allowed_is_refused_unread():
    with pytest.raises(FramingError) as refusal:
        decode_message(hostile(b'"ab"', 1001), max_values=1000)
    assert str(refusal.value) == (
        "message holds too many JSON values: more than 1000 strings alone"
        " (at most 1000)"
    )


@pytest.mark.parametrize("item", [b"0", b"{}", b'{"k":[]}', b"[[],[[]]]"])
def test_the_limit_is_the_same_for_every_shape(item):
    line = hostile(item, 300)
    values = count_values(line, len(line))
    assert values == reference_count(json.loads(line))
    assert decode_message(line, max_values=values)
    with pytest.raises(FramingError, match=f"{values}, keys included"):
        decode_message(line, max_values=values - 1)


def test_the_splitter_refuses_past_its_own_limit_and_none_means_any():
    line = hostile(b"[]", 100) + b"\n"
    with pytest.raises(FramingError, match="too many JSON values"):
        list(FrameSplitter(max_values=100).feed(line))
    assert list(FrameSplitter(max_values=None).feed(line)) == [json.loads(line)]
    received = Collector()
    received.max_values = 100
    assert received.max_values == 100
    feed(received, line)
    assert received.errors == [
        "message holds too many JSON values: 203, keys included (at most 100)"
    ]


def csv_write(rows: int) -> dict:
    """A stdin write of CSV full of JSON's syntax, escapes included: far
    more commas and brackets in its data than values allowed."""
    row = '1,"two",[3],{"4":5},\\,\\\\"\n'
    io = {"stream": "stdin", "rank": "0", "data": row * rows}
    return {"type": "request", "topic": "sdexec.write", "matchtag": 0,
            "payload": {"matchtag": 1, "io": io}}  # fmt: skip


@pytest.mark.parametrize("encode", [encode_message, encode_small_message])
def test_a_long_write_full_of_syntax_is_decoded(encode):
    message = csv_write(MAX_VALUES // 6)
    line = encode(message)
    syntax = sum(map(line.count, (b",", b":", b"[", b"{")))
    assert syntax > MAX_VALUES  # the upper bound says no...
    assert decode_message(line) == message  # ...the exact count says yes


def test_a_command_at_its_budget_holds_far_fewer_values_than_allowed():
    # Empty arguments: the most values a byte of the budget can buy (each
    # string counted with 8 bytes of framing).
    args = [""] * ((MAX_COMMAND - len("/bin/true") - 8) // 8)
    assert check_command_size(["/bin/true", *args], {}, {}) <= MAX_COMMAND
    cmd = {"cmdline": ["/bin/true", *args], "env": {}, "opts": {}}
    line = encode_message({"type": "request", "payload": {"cmd": cmd}})
    assert decode_message(line)["payload"]["cmd"] == cmd
    assert count_values(line, len(line)) < MAX_VALUES / 6


def _never(*args: object) -> None:
    raise AssertionError("a line shorter than the limit was counted")


@pytest.mark.parametrize(
    "data", [b"[{,:" * 16384, base64.b64encode(bytes(range(256)) * 192)],
    ids=["syntax", "base64"],
)  # fmt: skip
def test_output_frames_are_never_counted(data, monkeypatch):
    # Shorter than the limit: what they hold costs no count, and no answer
    # of the service's output can be refused for it.
    monkeypatch.setattr("sdexec.wire._check_values", _never)
    message = {"type": "response", "payload": {"io": encode_io("stdout", "0", data)}}
    assert decode_message(encode_message(message)) == message


def test_a_line_that_comes_in_tiny_reads_holds_about_its_own_size():
    # Kept as the reads that brought it, a client sending the start of a
    # request two bytes a read made max-frame-size 21 times what it says
    # (a bytes object and a list slot a read): 2.7 GB a connection at 64 MiB.
    splitter = FrameSplitter(max_frame=1 << 20)
    held = bytes_held_by(lambda data: list(splitter.feed(data)), 100_000, 2)
    assert held < 1.5
