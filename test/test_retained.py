"""sdexec.retained: a background process's bounded output (issue 12)."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdexec.ioencode import decode_io
from sdexec.retained import (
    STREAMS,
    Cursor,
    RetainedOutput,
    parse_retained_size,
    whole_pieces,
)
from sdexec.systemd.channel import OutputChannel

KIB = 1024


def replay(buffer: RetainedOutput) -> list[tuple[str, bytes]]:
    return [decode_io(io)[:2] for io in buffer.io_objects("0")]


def replayed(
    buffer: RetainedOutput, bufsizes: dict[str, int], line_buffered
) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
    """An attach's replay: the pieces a cursor from the start reads to the
    head, and what it leaves out, by stream."""
    cursor = Cursor(buffer, bufsizes, line_buffered)
    return list(cursor.pieces(buffer.head)), cursor.dropped


def produce(buffer: RetainedOutput, writes: list[tuple[str, bytes]]) -> None:
    for stream, data in writes:
        buffer.append(stream, data)


def test_100k_through_16k_reports_exactly_what_was_dropped() -> None:
    buffer = RetainedOutput(16 * KIB)
    # 100 KiB: 60 KiB of stdout and 40 KiB of stderr, alternating in 4 KiB
    # writes except for one stdout tail of 20 KiB.
    writes = [("stdout", b"o" * 4 * KIB), ("stderr", b"e" * 4 * KIB)] * 10
    writes.append(("stdout", b"O" * 20 * KIB))
    produce(buffer, writes)
    assert buffer.held == 16 * KIB
    # The last 16 KiB are all of the final stdout write, so everything else
    # (40 KiB of stdout, 40 KiB of stderr, 4 KiB of the tail) was dropped.
    assert buffer.dropped == {"stdout": 44 * KIB, "stderr": 40 * KIB}
    assert replay(buffer) == [("stdout", b"O" * 16 * KIB)]


def test_interleaving_is_kept_in_production_order() -> None:
    buffer = RetainedOutput(10)
    produce(buffer, [("stdout", b"abc"), ("stderr", b"DEF"), ("stdout", b"ghij")])
    buffer.append("stderr", b"KL")  # drops "ab"
    assert replay(buffer) == [
        ("stdout", b"c"),
        ("stderr", b"DEF"),
        ("stdout", b"ghij"),
        ("stderr", b"KL"),
    ]
    assert buffer.dropped == {"stdout": 2, "stderr": 0}


def test_a_write_larger_than_the_buffer_keeps_its_tail() -> None:
    buffer = RetainedOutput(4)
    produce(buffer, [("stderr", b"12"), ("stdout", b"abcdefgh")])
    assert replay(buffer) == [("stdout", b"efgh")]
    assert buffer.dropped == {"stdout": 4, "stderr": 2}


def test_size_zero_keeps_nothing_but_counts() -> None:
    buffer = RetainedOutput(0)
    produce(buffer, [("stdout", b"abc"), ("stderr", b"de")])
    assert buffer.io_objects("0") == [] and buffer.held == 0
    assert buffer.dropped == {"stdout": 3, "stderr": 2}


def test_binary_and_split_utf8_round_trip_through_io_objects() -> None:
    buffer = RetainedOutput(4)
    buffer.append("stdout", "xé€".encode())  # 1 + 2 + 3 bytes: cut inside é
    ios = buffer.io_objects("3")
    assert ios[0]["encoding"] == "base64" and ios[0]["rank"] == "3"
    assert replay(buffer) == [("stdout", "é€".encode()[1:])]


def test_runs_are_split_at_each_streams_bufsize() -> None:
    buffer = RetainedOutput()
    produce(buffer, [("stdout", b"o" * 10), ("stderr", b"e" * 4), ("stdout", b"p")])
    pieces, _dropped = replayed(buffer, {"stdout": 4, "stderr": 4}, STREAMS)
    assert pieces == [
        ("stdout", b"oooo"),
        ("stdout", b"oooo"),
        ("stdout", b"oo"),
        ("stderr", b"eeee"),
        ("stdout", b"p"),
    ]
    assert replay(buffer) == [("stdout", b"o" * 10), ("stderr", b"e" * 4),
                              ("stdout", b"p")]  # fmt: skip


def test_a_replay_cuts_no_line_that_fits_the_buffer() -> None:
    # Cut every bufsize bytes, as live output was: 24 of 25 replayed
    # messages of 100-byte lines ended mid-line.
    buffer = RetainedOutput()
    produce(buffer, [("stdout", b"ab\ncdefg\nhi\n")])
    pieces, _dropped = replayed(buffer, {"stdout": 6}, STREAMS)
    assert [data for _stream, data in pieces] == [b"ab\n", b"cdefg\n", b"hi\n"]


class FluxClient:
    """A client's buffer for one stream, as Flux's: ``size`` bytes
    (``<stream>_BUFSIZE``), whole lines taken out after each message, or
    the whole buffer once full; a message that does not fit is fatal."""

    def __init__(self, size: int) -> None:
        self.size, self.buf, self.out = size, b"", b""

    def feed(self, chunk: bytes) -> None:
        assert chunk, "an empty output message"
        assert len(self.buf) + len(chunk) <= self.size, (
            f"overrun: {len(self.buf)} held + {len(chunk)} > {self.size}"
        )
        self.buf += chunk
        lines = self.buf.rfind(b"\n") + 1
        if not lines and len(self.buf) == self.size:
            lines = self.size
        self.out, self.buf = self.out + self.buf[:lines], self.buf[lines:]


def attach_replay(
    buffer: RetainedOutput, bufsizes: dict[str, int], line_buffered=STREAMS
) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
    """What an attach is sent: the replayed pieces, and the dropped counts
    (the streams line-buffered unless said)."""
    return replayed(buffer, bufsizes, line_buffered)


def test_a_trimmed_replay_of_a_stream_not_line_buffered_leaves_nothing_out() -> None:
    # Sent read by read, such a stream's client holds no piece of line:
    # there is nothing to line up with, and the kept bytes were replayed.
    buffer = RetainedOutput(6000)
    buffer.append("stdout", b"x" * 10000)
    pieces, dropped = attach_replay(buffer, {"stdout": 4096}, line_buffered=())
    assert b"".join(data for _, data in pieces) == b"x" * 6000
    assert dropped == {"stdout": 4000, "stderr": 0}


def test_a_replay_trimmed_mid_line_then_live_output_fits_the_client() -> None:
    # Live, a long line goes in whole buffers from its start; the replay of
    # its kept tail was cut from where the trim fell, so the client held a
    # piece (1904 bytes) that the next live buffer (4096) overran.
    size = 4096
    retained, client = RetainedOutput(6000), FluxClient(size)
    attached = False

    def on_data(data: bytes) -> None:
        if attached:
            client.feed(data)
        else:
            retained.append("stdout", data)

    channel = OutputChannel("stdout", on_data, lambda: None, bufsize=size)
    channel.dataReceived(b"x" * 10_000)  # 2 buffers go, 1808 bytes held
    pieces, dropped = attach_replay(retained, {"stdout": size})
    for _, data in pieces:
        client.feed(data)
    attached = True
    channel.dataReceived(b"x" * 2300 + b"\n")
    # It starts where a live buffer did: the 1904 bytes before are dropped.
    assert pieces == [("stdout", b"x" * 4096)]
    assert dropped == {"stdout": 4096, "stderr": 0}
    assert client.out == b"x" * (4096 + 1808 + 2300) + b"\n" and client.buf == b""


def test_a_trimmed_replay_starts_after_the_end_of_its_first_line() -> None:
    buffer = RetainedOutput(9)
    produce(buffer, [("stdout", b"abcdef\n"), ("stderr", b"E"), ("stdout", b"gh\n")])
    buffer.append("stdout", b"ij")  # drops "abcd": "ef\n" ends a cut line
    assert attach_replay(buffer, {"stdout": 8, "stderr": 8}) == (
        [("stderr", b"E"), ("stdout", b"gh\nij")],
        {"stdout": 7, "stderr": 0},
    )
    # A wait's answer, one message, keeps it all.
    assert replay(buffer)[0] == ("stdout", b"ef\n")
    assert buffer.dropped == {"stdout": 4, "stderr": 0}


def test_an_untrimmed_replay_is_split_as_before() -> None:
    buffer = RetainedOutput(64)
    produce(buffer, [("stdout", b"x" * 10), ("stderr", b"ab\ncd"), ("stdout", b"y\n")])
    assert attach_replay(buffer, {"stdout": 4, "stderr": 4}) == (
        [("stdout", b"xxxx"), ("stdout", b"xxxx"), ("stdout", b"xx"),
         ("stderr", b"ab\n"), ("stderr", b"cd"), ("stdout", b"y\n")],
        {"stdout": 0, "stderr": 0},
    )  # fmt: skip


#: Reads of mostly long lines: a byte is a newline one time in five.
reads = st.lists(
    st.tuples(
        st.sampled_from(STREAMS),
        st.binary(min_size=1, max_size=30).map(
            lambda b: bytes(10 if c % 5 == 0 else 120 for c in b)
        ),
    ),
    max_size=20,
)


def without_heads(
    pieces: list[tuple[str, bytes]], heads: dict[str, int]
) -> list[tuple[str, int]]:
    """``pieces`` byte by byte, less the first ``heads[stream]`` bytes of
    each stream."""
    left = dict.fromkeys(STREAMS, 0) | heads
    kept = []
    for stream, data in pieces:
        cut = min(left[stream], len(data))
        left[stream] -= cut
        kept.extend((stream, byte) for byte in data[cut:])
    return kept


@settings(derandomize=True, max_examples=1000, deadline=None)
@given(st.integers(1, 9), st.integers(0, 48), reads, reads)
def test_an_attach_replay_then_live_output_fits_a_client_of_the_bufsize(
    size: int,
    kept: int,
    before: list[tuple[str, bytes]],
    after: list[tuple[str, bytes]],
) -> None:
    buffer = RetainedOutput(kept)
    clients = {stream: FluxClient(size) for stream in STREAMS}
    sent = dict.fromkeys(STREAMS, b"")  # what the channels handed on
    attached = False

    def on_data(stream: str, data: bytes) -> None:
        if attached:
            clients[stream].feed(data)
        else:
            sent[stream] += data
            buffer.append(stream, data)

    channels = {
        stream: OutputChannel(
            stream, lambda data, s=stream: on_data(s, data), lambda: None, bufsize=size
        )
        for stream in STREAMS
    }
    for stream, data in before:
        channels[stream].dataReceived(data)
    pieces, dropped = attach_replay(buffer, dict.fromkeys(STREAMS, size))
    for stream, data in pieces:
        clients[stream].feed(data)
    attached = True
    for stream, data in after:
        channels[stream].dataReceived(data)
    for channel in channels.values():
        channel.connectionLost(None)
    # Every byte replayed or counted, in production order; what the replay
    # leaves out beyond the trim is less than a buffer, and only where a
    # stream was trimmed.
    left_out = {s: dropped[s] - buffer.dropped[s] for s in STREAMS}
    assert without_heads(pieces, {}) == without_heads(replay(buffer), left_out)
    for stream in STREAMS:
        assert 0 <= left_out[stream] < (size if buffer.dropped[stream] else 1)
        replayed = sum(len(data) for s, data in pieces if s == stream)
        assert dropped[stream] + replayed == len(sent[stream])


def test_eof_per_stream() -> None:
    buffer = RetainedOutput()
    buffer.append("stdout", b"x")
    buffer.end("stdout")
    buffer.end("stdout")
    assert buffer.at_eof("stdout") and not buffer.at_eof("stderr")
    with pytest.raises(ValueError, match="already at EOF"):
        buffer.append("stdout", b"y")
    with pytest.raises(ValueError, match="not stdout or stderr"):
        buffer.append("stdin", b"y")


def test_tiny_alternating_runs_are_bounded_too() -> None:
    buffer = RetainedOutput(64 * KIB)
    for _ in range(100_000):
        buffer.append("stdout", b"o")
        buffer.append("stderr", b"e")
    assert buffer.run_count <= 64 * KIB // 32 + 64
    held = replay(buffer)
    assert sum(len(data) for _, data in held) == buffer.held
    assert buffer.dropped["stdout"] + buffer.dropped["stderr"] + buffer.held == 200_000


def test_200_buffers_of_10_mib_each_stay_within_their_size() -> None:
    size = 64 * KIB
    chunk = b"x" * 16 * KIB  # created before tracing: the input is not counted
    tracemalloc.start()
    try:
        buffers = [RetainedOutput(size) for _ in range(200)]
        for buffer in buffers:
            for index in range(640):  # 10 MiB
                buffer.append("stderr" if index % 3 == 0 else "stdout", chunk)
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for buffer in buffers:
        assert buffer.held == size
        assert sum(buffer.dropped.values()) == 10 * 1024 * KIB - size
    # Everything allocated while writing: the data, the run tables, the
    # objects themselves; at most 2 KiB a buffer beyond its size.
    assert held <= 200 * (size + 2 * KIB), held


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    st.integers(0, 64),
    st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), st.binary(max_size=40))),
)
def test_kept_is_the_suffix_of_what_was_produced(
    size: int, writes: list[tuple[str, bytes]]
) -> None:
    buffer = RetainedOutput(size)
    produce(buffer, writes)
    produced = [(stream, bytes([b])) for stream, data in writes for b in data]
    kept = [(stream, bytes([b])) for stream, data in replay(buffer) for b in data]
    assert kept == produced[len(produced) - len(kept) :]
    assert len(kept) == buffer.held <= size
    for stream in ("stdout", "stderr"):
        written = sum(len(data) for s, data in writes if s == stream)
        held = sum(1 for s, _ in kept if s == stream)
        assert buffer.dropped[stream] == written - held
    # With runs averaging at least 32 bytes, all of size is used.
    if all(len(data) >= 32 for _, data in writes):
        assert buffer.held == min(size, len(produced))


@pytest.mark.parametrize(
    ("value", "size"), [("1M", 1024 * KIB), ("0", 0), ("16K", 16 * KIB), (512, 512)]
)
def test_config_value(value: object, size: int) -> None:
    assert parse_retained_size(value) == size


@pytest.mark.parametrize("value", ["lots", -1, True, None, 1.5])
def test_bad_config_value_names_the_key(value: object) -> None:
    with pytest.raises(ValueError, match="retained-output: "):
        parse_retained_size(value)


def test_the_run_table_stays_within_its_documented_bound():
    # Dropped runs stay until they are half the table: twice the runs kept.
    size = 1 << 20
    buffer = RetainedOutput(size)
    most = 0
    for index in range(200_000):
        buffer.append(STREAMS[index % 2], b"x")
        table = len(buffer._runs) + len(buffer._ends)
        most = max(most, table * buffer._runs.itemsize)
    assert size // 2 < most <= size + 2048


# -- cursors: an attach's place in the ring ----------------------------------


def test_every_byte_produced_has_an_offset_dropped_ones_too() -> None:
    buffer = RetainedOutput(8)
    produce(buffer, [("stdout", b"abcde"), ("stderr", b"FG"), ("stdout", b"hij")])
    assert (buffer.head, buffer.oldest, buffer.held) == (10, 2, 8)
    buffer.append("stderr", b"0123456789ab")  # larger than the ring
    assert (buffer.head, buffer.oldest) == (22, 14)
    assert buffer.read(14, 100) == [("stderr", b"456789ab", 22)]
    assert buffer.read(22, 100) == []  # the head: nothing yet
    for offset in (13, 23):
        with pytest.raises(ValueError, match=f"offset {offset} is not held"):
            buffer.read(offset, 1)


def test_a_read_gives_each_run_from_an_offset_with_where_the_run_ends() -> None:
    buffer = RetainedOutput(8)
    produce(buffer, [("stdout", b"abcde"), ("stderr", b"FG"), ("stdout", b"hij")])
    # The ring wrapped round: "cde" "FG" "hij" held from offset 2.
    assert buffer.read(3, 100) == [
        ("stdout", b"de", 5),
        ("stderr", b"FG", 7),
        ("stdout", b"hij", 10),
    ]
    assert buffer.read(6, 2) == [("stderr", b"G", 7), ("stdout", b"h", 10)]


@pytest.mark.parametrize(
    ("data", "line_buffered", "whole"),
    [
        (b"ab\ncd", True, 3),  # "cd" may be the start of a line that fits
        (b"ab\ncdefgh", True, 7),  # a buffer of the long line after it
        (b"abc", True, 0),  # nothing that a piece could end at
        (b"abcdefghi", True, 8),  # two buffers of a long line
        (b"ab\ncd", False, 5),  # read by read: any cut
    ],
)
def test_whole_pieces_ends_where_a_live_piece_could(
    data: bytes, line_buffered: bool, whole: int
) -> None:
    assert whole_pieces(data, 4, line_buffered) == whole


def test_a_batch_that_cuts_a_long_line_sends_whole_buffers_of_it() -> None:
    buffer = RetainedOutput(64)
    produce(buffer, [("stdout", b"x" * 10 + b"\n" + b"ab\n")])
    cursor = Cursor(buffer, {"stdout": 4}, STREAMS, read_batch=3)
    pieces = [piece for _, piece in cursor.pieces(buffer.head)]
    assert pieces == [b"xxxx", b"xxxx", b"xx\n", b"ab\n"]
    assert cursor.offset == buffer.head


def test_a_cursor_that_stops_taking_resumes_after_the_last_piece_it_took() -> None:
    buffer = RetainedOutput(64)
    produce(buffer, [("stdout", b"a\nb\n"), ("stderr", b"E\n"), ("stdout", b"c\n")])
    cursor = Cursor(buffer, {"stdout": 2, "stderr": 2}, STREAMS)
    first = next(cursor.pieces(buffer.head))
    assert (first, cursor.offset) == (("stdout", b"a\n"), 2)
    assert list(cursor.pieces(buffer.head)) == [
        ("stdout", b"b\n"),
        ("stderr", b"E\n"),
        ("stdout", b"c\n"),
    ]


def test_a_cursor_left_behind_says_what_it_lost_by_stream() -> None:
    buffer = RetainedOutput(8)
    produce(buffer, [("stdout", b"ab"), ("stderr", b"CD")])
    cursor = Cursor(buffer, {}, ())
    assert list(cursor.pieces(3)) == [("stdout", b"ab"), ("stderr", b"C")]
    produce(buffer, [("stdout", b"efgh"), ("stderr", b"IJ")])  # 3 dropped
    assert cursor.lost() == {}  # it had them all
    produce(buffer, [("stdout", b"klmn")])  # drops "D" and "ef", unsent
    assert cursor.lost() == {"stdout": 2, "stderr": 1}
    assert cursor.offset == 3  # it stays: its reader is told, not skipped on


def test_a_cursor_loses_nothing_of_a_stream_it_does_not_take() -> None:
    buffer = RetainedOutput(4)
    buffer.append("stdout", b"ab")
    cursor = Cursor(buffer, {}, (), streams=["stdout"])
    assert list(cursor.pieces(buffer.head)) == [("stdout", b"ab")]
    produce(buffer, [("stderr", b"CDEFGH"), ("stdout", b"i")])
    assert cursor.lost() == {}  # only stderr was dropped: moved up to it
    assert cursor.offset == buffer.oldest
    assert list(cursor.pieces(buffer.head)) == [("stdout", b"i")]


#: What an attached reader does between two reads of the process: takes at
#: most that many pieces (``None``: all there are).
takes = st.one_of(st.none(), st.integers(0, 4))


@settings(derandomize=True, max_examples=1000, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(0, 48),
    st.integers(1, 12),
    reads,
    st.lists(st.tuples(reads, takes), max_size=8),
)
def test_a_cursor_sends_each_byte_once_in_order_or_says_what_it_lost(
    size: int,
    kept: int,
    batch: int,
    before: list[tuple[str, bytes]],
    rounds: list[tuple[list[tuple[str, bytes]], int | None]],
) -> None:
    """Review session 45: an attach fed from the ring at its own pace, the
    process writing on meanwhile. Until the ring drops what it was not sent,
    its client gets every byte from the replay's start once, in production
    order (what the line-up leaves out apart), in pieces a client of the
    bufsize takes; then it is told exactly what it lost."""
    buffer = RetainedOutput(kept)
    produced: list[tuple[str, int]] = []

    def on_data(stream: str, data: bytes) -> None:
        buffer.append(stream, data)
        produced.extend((stream, byte) for byte in data)

    channels = {
        stream: OutputChannel(
            stream, lambda data, s=stream: on_data(s, data), lambda: None, bufsize=size
        )
        for stream in STREAMS
    }
    for stream, data in before:
        channels[stream].dataReceived(data)
    start, dropped_before = buffer.oldest, buffer.dropped
    cursor = Cursor(buffer, dict.fromkeys(STREAMS, size), STREAMS, read_batch=batch)
    left_out = {s: cursor.dropped[s] - dropped_before[s] for s in STREAMS}
    clients = {stream: FluxClient(size) for stream in STREAMS}
    received: list[tuple[str, bytes]] = []

    def take(count: int | None) -> None:
        for taken, (stream, piece) in enumerate(cursor.pieces(buffer.head), 1):
            clients[stream].feed(piece)
            received.append((stream, piece))
            if taken == count:
                return

    for writes, count in [([], None), *rounds]:
        for stream, data in writes:
            channels[stream].dataReceived(data)
        behind = cursor.offset
        lost = cursor.lost()
        if lost:
            gap = produced[behind : buffer.oldest]
            assert lost == {
                s: n for s in STREAMS if (n := sum(1 for t, _ in gap if t == s))
            }
            break
        take(count)
    else:
        take(None)
        assert cursor.offset == buffer.head
    expected = without_heads(
        [(s, bytes([b])) for s, b in produced[start : cursor.offset]], left_out
    )
    assert without_heads(received, {}) == expected
