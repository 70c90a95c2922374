"""What ``/proc`` says of a process: its cgroups, its status, whether it is
there; and what a cgroup's file under ``/sys/fs/cgroup`` holds.

``root`` stands for ``/`` (tests give a stand-in tree).
"""

from __future__ import annotations

import os
import select

__all__ = [
    "cgroup_value",
    "open_pidfd",
    "process_cgroups",
    "process_exists",
    "process_status",
]


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


def process_status(pid: int, root: str = "/") -> dict[bytes, bytes] | None:
    """``/proc/PID/status`` as its keys and values, or ``None`` if it
    cannot be read. Bytes: the Name line is the command's name as the
    kernel keeps it, which need not be ASCII (read as ASCII, a command
    named "größe" hid every fence)."""
    try:
        with open(os.path.join(root, f"proc/{pid}/status"), "rb") as file:
            lines = file.read().split(b"\n")
    except OSError:
        return None
    fields = (line.partition(b":") for line in lines)
    return {key: value.strip() for key, _, value in fields}


def _process_state(pid: int, root: str) -> str | None:
    """The state letter of ``/proc/PID/stat`` (after the command's name,
    which may hold any character, ")" too); ``None`` if it cannot be read."""
    try:
        with open(os.path.join(root, f"proc/{pid}/stat"), "rb") as file:
            after_name = file.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return after_name[0].decode("ascii", "replace") if after_name else None


def process_exists(pid: int, root: str = "/") -> bool:
    """Whether process ``pid`` is there and has not exited: a read that
    failed (or gave an ancestor's cgroup) while it is was not the process
    exiting. Not a zombie: systemd removes an exited unit's cgroup before it
    reaps the main process. A pidfd says, which needs no permission over the
    process (``hidepid=2`` hides other users' processes, such as a job shell
    an IMP started) and, as systemd does, counts a leader that exited while
    its other threads run as alive. Where none can be had (a kernel before
    5.3, no fd left), ``/proc/PID/stat``'s state, else ``/proc/PID``, else a
    signal 0, which take a hidden zombie for alive."""
    exited = _exited_by_pidfd(pid) if root == "/" else None
    if exited is not None:
        return not exited
    state = _process_state(pid, root)
    if state is not None:
        return state not in ("Z", "X")
    if os.path.exists(os.path.join(root, f"proc/{pid}")):
        return True
    if root != "/":  # a test's tree: no real process to ask
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # there, another user's
    return True


def open_pidfd(pid: int) -> int | None:
    """A pidfd of process ``pid`` (the caller closes it); ``None`` where
    none can be had: a Python built without ``os.pidfd_open``, Linux
    before 5.3 (ENOSYS), no descriptor left, a seccomp filter.
    ``ProcessLookupError`` if there is no such process (reaped)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(pid)
    except ProcessLookupError:
        raise
    except OSError:
        return None


def _exited_by_pidfd(pid: int) -> bool | None:
    """Whether ``pid`` has exited (a zombie has), as a pidfd of it says:
    one is readable once its whole process has exited. ``None`` where
    pidfds cannot be had."""
    try:
        pidfd = open_pidfd(pid)
    except ProcessLookupError:
        return True  # reaped
    if pidfd is None:
        return None
    try:
        poller = select.poll()  # not select(): the fd may be past 1023
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(0))
    finally:
        os.close(pidfd)


def cgroup_value(root: str, base: str, cgroup: str, name: str) -> str | None:
    """The value in file ``name`` of ``cgroup`` under the hierarchy mounted
    at ``base`` (``sys/fs/cgroup``, ``sys/fs/cgroup/memory``), stripped;
    ``None`` if it cannot be read (no such cgroup, or no such file)."""
    path = os.path.join(root, base, cgroup.lstrip("/"), name)
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except (OSError, ValueError):
        return None
