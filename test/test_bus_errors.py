"""What a client is told when a call is lost with the bus connection."""

from __future__ import annotations

import pytest

from sdexec.systemd.bus import _why_lost


@pytest.mark.parametrize(
    ("error", "told"),
    [
        # dbus-fast's when the bus closes under a call: clients read
        # "systemd connection lost: EOFError".
        (EOFError(), "the D-Bus connection closed"),
        (BrokenPipeError(), "the D-Bus connection closed"),
        (
            OSError(104, "Connection reset by peer"),
            "[Errno 104] Connection reset by peer",
        ),
        (RuntimeError(), "the D-Bus connection failed (RuntimeError)"),
    ],
)
def test_a_lost_call_says_why_in_words(error, told):
    assert _why_lost(error) == told
