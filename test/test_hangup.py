"""HangupWatcher: a socket the reactor does not read, watched for its
peer's close alone (sdexec/hangup.py), on the real reactor."""

from __future__ import annotations

import socket

from pytest_twisted import ensureDeferred
from support import sleep, until
from twisted.internet import reactor

from sdexec.hangup import HangupWatcher


@ensureDeferred
async def test_the_peers_close_is_seen_and_unread_data_wakes_nothing():
    watcher = HangupWatcher(reactor)
    ours, theirs = socket.socketpair()
    hung_up: list[str] = []
    watcher.watch(ours.fileno(), lambda: hung_up.append("ours"))
    theirs.sendall(b"requests nobody reads yet")
    await sleep(0.05)
    assert hung_up == []
    theirs.close()
    await until(lambda: hung_up, "the close seen")
    assert hung_up == ["ours"]
    assert watcher.fileno() == -1  # nothing watched: out of the reactor
    assert ours.recv(100) == b"requests nobody reads yet"  # not read by it
    ours.close()


@ensureDeferred
async def test_an_unwatched_socket_is_not_reported():
    watcher = HangupWatcher(reactor)
    pairs = [socket.socketpair() for _ in range(2)]
    hung_up: list[int] = []
    for index, (ours, _) in enumerate(pairs):
        watcher.watch(ours.fileno(), lambda index=index: hung_up.append(index))
    watcher.unwatch(pairs[0][0].fileno())
    for _, theirs in pairs:
        theirs.close()
    await until(lambda: hung_up, "the watched one's close seen")
    await sleep(0.05)
    assert hung_up == [1] and watcher.fileno() == -1
    for ours, _ in pairs:
        ours.close()


def test_a_socket_closed_before_it_is_unwatched_is_forgotten_quietly():
    watcher = HangupWatcher(reactor)
    ours, theirs = socket.socketpair()
    fd = ours.fileno()
    watcher.watch(fd, lambda: None)
    ours.close()  # as Twisted closes a lost connection's before telling us
    watcher.unwatch(fd)
    assert watcher.fileno() == -1
    theirs.close()
