"""HangupWatcher: a socket the reactor does not read, watched for its
peer's close alone (sdexec/hangup.py), on the real reactor."""

from __future__ import annotations

import socket

import pytest
from pytest_twisted import ensureDeferred
from support import until
from twisted.internet import reactor

from sdexec.hangup import HangupWatcher, peer_gone


async def read_out(watcher: HangupWatcher) -> None:
    """Wait until ``watcher`` has read what its epoll held so far: a
    sentinel socket whose peer closes now is reported in the same read as
    anything ready before it, so what is not reported by then was not
    ready (a bound of events, where a sleep is one of time)."""
    ours, theirs = socket.socketpair()
    seen: list[bool] = []
    watcher.watch(ours.fileno(), seen.append)
    theirs.close()
    await until(lambda: seen, "the sentinel's close seen")
    ours.close()


@ensureDeferred
async def test_the_peers_close_is_seen_and_unread_data_wakes_nothing():
    watcher = HangupWatcher(reactor)
    ours, theirs = socket.socketpair()
    hung_up: list[bool] = []
    watcher.watch(ours.fileno(), hung_up.append)
    theirs.sendall(b"requests nobody reads yet")
    await read_out(watcher)
    assert hung_up == []
    theirs.close()
    await until(lambda: hung_up, "the close seen")
    assert hung_up == [True]  # gone
    assert watcher.fileno() == -1  # nothing watched: out of the reactor
    assert ours.recv(100) == b"requests nobody reads yet"  # not read by it
    ours.close()


@pytest.mark.parametrize(
    ("how", "gone"),
    [(socket.SHUT_WR, False), (socket.SHUT_RDWR, True), (socket.SHUT_RD, None)],
)
@ensureDeferred
async def test_a_shutdown_is_told_from_a_close(how, gone):
    """A peer that shuts down its writing (socat, nc) may still read what
    it was answered: told apart from one that shut down both ways, which
    can read nothing more. Its reading alone is no hang-up at all."""
    watcher = HangupWatcher(reactor)
    ours, theirs = socket.socketpair()
    hung_up: list[bool] = []
    watcher.watch(ours.fileno(), hung_up.append)
    theirs.shutdown(how)
    if gone is None:
        await read_out(watcher)
        assert hung_up == [] and watcher.fileno() != -1
        watcher.unwatch(ours.fileno())
    else:
        await until(lambda: hung_up, "the shutdown seen")
        assert hung_up == [gone]
    assert watcher.fileno() == -1
    ours.close()
    theirs.close()


@ensureDeferred
async def test_an_unwatched_socket_is_not_reported():
    watcher = HangupWatcher(reactor)
    pairs = [socket.socketpair() for _ in range(2)]
    hung_up: list[int] = []
    for index, (ours, _) in enumerate(pairs):
        watcher.watch(ours.fileno(), lambda _gone, index=index: hung_up.append(index))
    watcher.unwatch(pairs[0][0].fileno())
    for _, theirs in pairs:
        theirs.close()
    await until(lambda: hung_up, "the watched one's close seen")
    # Nothing watched, its epoll closed: no later report can come.
    assert hung_up == [1] and watcher.fileno() == -1
    for ours, _ in pairs:
        ours.close()


def test_a_socket_closed_before_it_is_unwatched_is_forgotten_quietly():
    watcher = HangupWatcher(reactor)
    ours, theirs = socket.socketpair()
    fd = ours.fileno()
    watcher.watch(fd, lambda _gone: None)
    ours.close()  # as Twisted closes a lost connection's before telling us
    watcher.unwatch(fd)
    assert watcher.fileno() == -1
    theirs.close()


@ensureDeferred
async def test_a_peer_that_shut_down_its_writing_is_watched_for_its_close():
    """``gone_only``: a peer that has shut down its writing (socat, nc) and
    may still read is reported once it is gone, not for its shutdown."""
    watcher = HangupWatcher(reactor)
    ours, theirs = socket.socketpair()
    theirs.shutdown(socket.SHUT_WR)
    hung_up: list[bool] = []
    watcher.watch(ours.fileno(), hung_up.append, gone_only=True)
    theirs.close()
    await until(lambda: hung_up, "the close seen")
    assert hung_up == [True]  # its shutdown was not reported first
    assert watcher.fileno() == -1
    ours.close()


def test_a_peer_gone_is_told_from_one_that_shut_down_its_writing():
    """:func:`peer_gone`: a read's EOF is the same for both, and only a
    close means the peer can read nothing more."""
    ours, theirs = socket.socketpair()
    assert not peer_gone(ours.fileno())
    theirs.shutdown(socket.SHUT_WR)
    assert not peer_gone(ours.fileno())  # it may still read
    theirs.close()
    assert peer_gone(ours.fileno())
    ours.close()
