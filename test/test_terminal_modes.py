"""``sdexec run`` sets back the modes of a terminal its process, killed by
a signal, left changed (:class:`sdexec.runrequest.TerminalModes`): here
the setting back itself, on a pseudo-terminal, with ``tcsetattr`` cut
short as a signal cuts it."""

from __future__ import annotations

import errno
import os
import signal
import termios
from collections.abc import Iterator

import pytest

from sdexec.runrequest import TerminalModes


@pytest.fixture
def terminal() -> Iterator[int]:
    """The follower side of a pseudo-terminal, in cooked mode, this
    process's group its foreground group."""
    leader, follower = os.openpty()
    try:
        yield follower
    finally:
        os.close(follower)
        os.close(leader)


def _raw(fd: int) -> None:
    modes = termios.tcgetattr(fd)
    modes[3] &= ~(termios.ECHO | termios.ICANON)
    termios.tcsetattr(fd, termios.TCSANOW, modes)


def _interrupted_drains(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``tcsetattr`` failing EINTR whenever it would wait for the output
    to drain, as a ^C during the wait of a terminal stopped by Ctrl-S
    makes it (no test can stop a pseudo-terminal's output: its drain does
    not wait); the ``when`` of every call, in order."""
    real = termios.tcsetattr
    calls: list[int] = []

    def tcsetattr(fd: int, when: int, modes: list) -> None:
        calls.append(when)
        if when == termios.TCSADRAIN:
            raise termios.error(errno.EINTR, os.strerror(errno.EINTR))
        real(fd, when, modes)

    monkeypatch.setattr(termios, "tcsetattr", tcsetattr)
    return calls


def test_modes_are_set_back_at_once_when_a_signal_cuts_the_drain_short(
    terminal, monkeypatch
):
    before = termios.tcgetattr(terminal)
    modes = TerminalModes({"stdin": terminal})
    _raw(terminal)
    calls = _interrupted_drains(monkeypatch)
    monkeypatch.setattr(os, "tcgetpgrp", lambda fd: os.getpgrp())
    modes.restore_after(signal.SIGTERM)  # a wait status: killed by SIGTERM
    assert calls == [termios.TCSADRAIN, termios.TCSANOW]
    assert termios.tcgetattr(terminal) == before


def test_modes_are_kept_after_an_exit(terminal, monkeypatch):
    # A shell keeps the modes after a job that exited (`stty` set them).
    modes = TerminalModes({"stdin": terminal})
    _raw(terminal)
    raw = termios.tcgetattr(terminal)
    calls = _interrupted_drains(monkeypatch)
    modes.restore_after(0)
    assert (calls, termios.tcgetattr(terminal)) == ([], raw)
