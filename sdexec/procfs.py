"""What ``/proc`` says of a process: its cgroups.

``root`` stands for ``/`` (tests give a stand-in tree).
"""

from __future__ import annotations

import os

__all__ = ["process_cgroups"]


def process_cgroups(pid: int, root: str = "/") -> list[tuple[str, str]] | None:
    """``(controllers, path)`` of each line of ``/proc/PID/cgroup`` (v2's
    controllers are ``""``, v1's ``memory``, ``name=systemd``…); ``None``
    if it cannot be read (the process is gone, or hidden by ``hidepid``)."""
    try:
        # A cgroup's name is any bytes but "/" and newline: one that is not
        # UTF-8 must not make the others unreadable, nor may one holding a
        # form feed or the like read as two lines (str.splitlines would).
        path = os.path.join(root, f"proc/{pid}/cgroup")
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            lines = file.read().split("\n")
    except OSError:
        return None
    entries = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            entries.append((parts[1], parts[2]))
    return entries
