"""One service per endpoint: a lock taken before any unit is touched.

Every unit the service starts carries a mark made from its ``listen``
endpoint (:mod:`sdexec.leftovers`), and at start the service stops, as
leftovers of an earlier run, the marked units nobody tracks. A second
service started with the same ``listen`` (an admin trying a configuration
by hand while the unit runs) would take the first one's running jobs for
leftovers and stop them, and only then fail to listen. So the first thing a
service does is take a lock named after its mark: a second one refuses to
start, naming the first, with nothing touched. The lock is a symbolic link
holding the pid (Twisted's :class:`~twisted.python.lockfile.FilesystemLock`),
so one left by a service that died is taken over.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from twisted.python.lockfile import FilesystemLock

from sdexec.sockets import check_directory, unix_path

__all__ = ["AlreadyServed", "OwnerLock"]


class AlreadyServed(Exception):
    """Another service holds the endpoint's lock (one line, naming it)."""


class OwnerLock:
    """The lock of the service whose units carry ``mark``: beside a
    ``unix:`` endpoint's socket, else in the runtime directory."""

    def __init__(self, listen: str, mark: str, socket_mode: int) -> None:
        self.listen = listen
        name = f"sdexec-{mark.strip(' []').removeprefix('sdexec:')}.lock"
        self.path = os.path.join(_lock_directory(listen, socket_mode), name)
        self._lock = FilesystemLock(self.path)

    def take(self) -> None:
        """Hold the lock, or :class:`AlreadyServed` if another sdexec does.

        A lock whose pid is gone is taken over (Twisted's lock does that);
        so is one whose pid now names another program: a pid of another
        user (sdexec runs as this one), this process's own when it holds no
        such lock (a container restarted with the same pids), or one whose
        command line does not mention sdexec.
        """
        if _stale(self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if not self._lock.lock():
            holder = _holder(self.path)
            raise AlreadyServed(
                f"[sdexec] listen: another sdexec ({holder}) serves"
                f" {self.listen}: it holds {self.path}; not starting, and none"
                " of its units touched"
            )
        _HELD.add(self.path)

    def release(self) -> None:
        """Let the lock go (idempotent)."""
        if self._lock.locked:
            self._lock.unlock()
            _HELD.discard(self.path)


#: The locks this process holds (two services in one process: tests).
_HELD: set[str] = set()


def _stale(path: str) -> bool:
    """Whether the lock at ``path`` names a process that is no sdexec."""
    try:
        pid = int(os.readlink(path))
    except (OSError, ValueError):
        return False  # none, or not a pid: Twisted's lock decides
    if pid == os.getpid():
        return path not in _HELD
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's process
    except ProcessLookupError:
        return False  # gone: Twisted's lock takes it over
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return b"sdexec" not in file.read()
    except OSError:
        return False


def _lock_directory(listen: str, socket_mode: int) -> str:
    path = unix_path(listen)
    if path is not None:
        # The socket's own directory, made and checked as listening will.
        directory = os.path.dirname(os.path.abspath(path))
        check_directory(directory, socket_mode, os.getuid())
        return directory
    # systemd's RuntimeDirectory= (the system unit's /run/sdexec), else the
    # user's runtime directory, else a directory of the user's own in /tmp
    # (a name there anyone could take first).
    systemds = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    runtime = systemds or os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return runtime
    private = os.path.join(tempfile.gettempdir(), f"sdexec-{os.getuid()}")
    check_directory(private, 0o600, os.getuid())
    return private


def _holder(path: str) -> str:
    try:
        return f"pid {os.readlink(path)}"
    except OSError:
        return "pid unknown"
