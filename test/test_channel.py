"""The channels and the output gate over in-memory transports (no systemd)."""

from __future__ import annotations

from twisted.internet.testing import StringTransport

from sdexec.systemd.channel import InputChannel, OutputChannel, OutputGate


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
    channel = InputChannel(credit.append)
    channel.write(b"early ")
    channel.write(b"bird")
    channel.close()
    transport = connected_input(channel)
    assert transport.value() == b"early bird"
    assert transport.write_closed  # and EOF after it
    assert credit == [len(b"early "), len(b"bird")]


def test_credit_is_withheld_while_the_transport_is_full():
    credit: list[int] = []
    channel = InputChannel(credit.append)
    connected_input(channel)
    channel.pauseProducing()
    channel.write(b"abc")
    assert credit == []
    channel.resumeProducing()
    assert credit == [3]


def test_writes_after_close_are_dropped():
    channel = InputChannel(lambda n: None)
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
    assert chunks == [b"one\n", b"two\n", b"threeeeeeee", b"tail"]
    assert eofs == [True] and channel.eof


def test_unbuffered_output_is_sent_as_read():
    chunks: list[bytes] = []
    channel = OutputChannel("stderr", chunks.append, lambda: None, line_buffered=False)
    channel.dataReceived(b"no newline")
    assert chunks == [b"no newline"]


def test_the_gate_holds_output_until_open_and_while_the_client_is_slow():
    channel = OutputChannel("stdout", lambda data: None, lambda: None)
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
