"""The channels and the output gate over in-memory transports (no systemd)."""

from __future__ import annotations

import pytest
from support import bytes_held_by
from twisted.internet.testing import StringTransport

from sdexec.protocol import DEFAULT_OUTPUT_BUFSIZE, DEFAULT_STDIN_BUFSIZE
from sdexec.systemd.channel import (
    STDIN_OVERRUN_FACTOR,
    InputChannel,
    OutputChannel,
    OutputGate,
    StdinOverrun,
    socketpair_for_systemd,
)


class HalfCloseTransport(StringTransport):
    """A socket transport in memory: it can close its write side."""

    write_closed = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True


def connected_input(channel: InputChannel) -> HalfCloseTransport:
    transport = HalfCloseTransport()
    channel.makeConnection(transport)
    return transport


def test_data_written_then_closed_before_adoption_reaches_stdin():
    credit: list[int] = []
    channel = InputChannel(credit.append, DEFAULT_STDIN_BUFSIZE)
    channel.write(b"early ")
    channel.write(b"bird")
    channel.close()
    transport = connected_input(channel)
    assert transport.value() == b"early bird"
    assert transport.write_closed  # and EOF after it
    assert credit == [len(b"early bird")]  # in one add-credit


def test_credit_is_withheld_while_the_transport_is_full():
    credit: list[int] = []
    channel = InputChannel(credit.append, DEFAULT_STDIN_BUFSIZE)
    connected_input(channel)
    channel.pauseProducing()
    channel.write(b"abc")
    assert credit == []
    channel.resumeProducing()
    assert credit == [3]


def test_a_client_within_its_credit_is_never_refused():
    credit: list[int] = []
    channel = InputChannel(credit.append, bufsize=16)
    connected_input(channel)
    channel.pauseProducing()  # the process reads nothing yet
    channel.write(b"x" * 16)  # the whole first credit
    assert credit == []  # withheld while the transport is full
    channel.resumeProducing()  # the process read it
    assert credit == [16]
    channel.pauseProducing()
    channel.write(b"y" * 16)  # the credit returned: taken too
    assert credit == [16]


@pytest.mark.parametrize("adopted", [True, False])
def test_a_client_that_overruns_is_refused_and_nothing_is_taken(adopted):
    channel = InputChannel(lambda n: None, bufsize=16)
    transport = connected_input(channel) if adopted else None
    if transport is not None:
        channel.pauseProducing()
    limit = STDIN_OVERRUN_FACTOR * 16
    channel.write(b"x" * limit)  # ignoring credit, but within what is held
    with pytest.raises(StdinOverrun, match=f"holds at most {limit}"):
        channel.write(b"y")
    if transport is not None:
        channel.resumeProducing()  # held while the transport was full
        assert transport.value() == b"x" * limit


def test_writes_after_close_are_dropped():
    channel = InputChannel(lambda n: None, DEFAULT_STDIN_BUFSIZE)
    transport = connected_input(channel)
    channel.close()
    channel.write(b"late")
    assert transport.value() == b""


def test_output_is_line_buffered_up_to_bufsize():
    chunks: list[bytes] = []
    eofs: list[bool] = []
    channel = OutputChannel(
        "stdout", chunks.append, lambda: eofs.append(True), bufsize=8
    )
    channel.dataReceived(b"one\ntw")
    channel.dataReceived(b"o\nthr")
    channel.dataReceived(b"eeeeeeee")  # the buffer fills: sent without newline
    channel.dataReceived(b"tail")
    channel.connectionLost(None)
    # Never more than bufsize at once (as Flux's channels): of the 11 bytes
    # held, a buffer goes, the rest waits for its newline (or EOF).
    assert chunks == [b"one\n", b"two\n", b"threeeee", b"eeetail"]
    assert eofs == [True] and channel.eof


def test_a_line_that_fits_the_buffer_is_never_cut():
    # The lines of a read were cut every bufsize bytes, wherever that fell:
    # a Flux client sized by stdout_BUFSIZE, taking whole lines out of its
    # buffer, was overrun by the next message (its subprocess failed), and
    # a cut inside a character sent valid text as base64.
    chunks: list[bytes] = []
    channel = OutputChannel("stdout", chunks.append, lambda: None, bufsize=16)
    lines = [b"\xc3\xa9" * 4 + b"\n", b"0123456789\n", b"x" * 20 + b"\n", b"ok\n"]
    channel.dataReceived(b"".join(lines))
    assert chunks == [lines[0], lines[1], b"x" * 16, b"xxxx\nok\n"]
    assert all(len(chunk) <= 16 for chunk in chunks)


def test_unbuffered_output_is_sent_as_read():
    chunks: list[bytes] = []
    channel = OutputChannel(
        "stderr",
        chunks.append,
        lambda: None,
        line_buffered=False,
        bufsize=DEFAULT_OUTPUT_BUFSIZE,
    )
    channel.dataReceived(b"no newline")
    assert chunks == [b"no newline"]


def test_no_chunk_is_larger_than_the_buffer():
    # A client may size its buffer by <stream>_BUFSIZE (Flux's remote
    # subprocess client takes a larger message as fatal).
    for line_buffered in (True, False):
        chunks: list[bytes] = []
        channel = OutputChannel(
            "stdout", chunks.append, lambda: None, line_buffered, bufsize=4
        )
        channel.dataReceived(b"0123456789\nab\n")
        channel.connectionLost(None)
        assert max(map(len, chunks)) <= 4
        assert b"".join(chunks) == b"0123456789\nab\n"


def test_the_gate_holds_output_until_open_and_while_the_client_is_slow():
    channel = OutputChannel(
        "stdout", lambda data: None, lambda: None, bufsize=DEFAULT_OUTPUT_BUFSIZE
    )
    transport = StringTransport()
    channel.makeConnection(transport)
    gate = OutputGate({"stdout": channel})
    channel.pause()
    gate.resume()  # the client is fast, but the process has not started
    assert transport.producerState == "paused"
    gate.open()
    assert transport.producerState == "producing"
    gate.pause()
    assert transport.producerState == "paused"
    gate.drain()  # the client left: read everything to EOF
    assert transport.producerState == "producing"
    gate.close()
    assert transport.disconnecting


def test_a_partial_line_written_in_tiny_pieces_holds_about_its_own_size():
    # A job printing progress dots, flushed one by one: each read's bytes
    # object was kept, 21 times the buffer size for two-byte reads.
    channel = OutputChannel("stdout", lambda data: None, lambda: None, bufsize=1 << 20)
    held = bytes_held_by(channel.dataReceived, 100_000, 2)
    assert held < 1.5


def test_tiny_writes_to_a_full_transport_are_held_at_about_their_size():
    # Handed on write by write, each was a bytes object of its own in the
    # transport's list: 2-byte writes held 12 times their size (a client
    # without credit may write 4 x stdin_BUFSIZE, up to 42 MiB, that way).
    credit: list[int] = []
    channel = InputChannel(credit.append, bufsize=1 << 20)
    transport = WriteListTransport()
    channel.makeConnection(transport)
    channel.pauseProducing()  # the process reads nothing
    held = bytes_held_by(lambda data: channel.write(data, credited=False), 100_000, 2)
    assert held < 1.5
    channel.resumeProducing()  # it reads: all of it, in order, then credit
    assert b"".join(transport.writes) == b"x" * 200_000
    assert credit == [200_000]


class WriteListTransport(HalfCloseTransport):
    """Keeps each write as it came, as Twisted's socket transport does
    until it can write them (``_tempDataBuffer``)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


def test_tiny_writes_to_a_real_socket_are_held_at_about_their_size():
    # Twisted paused the channel only past its own 64 KiB buffer, keeping
    # each write below that as an object of its own: 1.4 MB a process for
    # 64 KiB of two-byte writes, which a client within its credit makes.
    from twisted.internet import reactor

    ours, theirs = socketpair_for_systemd()
    channel = InputChannel(lambda n: None, bufsize=1 << 20)
    channel.adopt(reactor, ours)
    try:
        held = bytes_held_by(
            lambda data: channel.write(data, credited=False), 100_000, 2
        )
        assert held < 1.5
    finally:
        channel.transport.abortConnection()
        theirs.close()
