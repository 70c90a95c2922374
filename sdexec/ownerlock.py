"""One service per endpoint: a lock taken before any unit is touched.

Every unit the service starts carries a mark made from its ``listen``
endpoint (:mod:`sdexec.leftovers`), and at start the service stops, as
leftovers of an earlier run, the marked units nobody tracks. A second
service started with the same ``listen`` (an admin trying a configuration
by hand while the unit runs) would take the first one's running jobs for
leftovers and stop them, and only then fail to listen. So the first thing a
service does is take a lock named after its mark: a second one refuses to
start, naming the first, with nothing touched. The lock is ``flock(2)`` on
a file beside the socket, held by an open descriptor for the service's
life: the kernel lets it go when the process ends, however it ends, so a
lock is never stale, and no pid (which the kernel may give to another
program) is trusted. The file holds the holder's pid, for the message only.
Held, it makes what an earlier run left at the service's ``unix:``
endpoints stale: :func:`sdexec.sockets.clear_stale_socket` clears it as each
is listened on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile

from sdexec.sockets import check_directory, socket_mode_of, unix_path

__all__ = ["AlreadyServed", "OwnerLock"]


class AlreadyServed(Exception):
    """Another service holds the endpoint's lock (one line, naming it)."""


class OwnerLock:
    """The lock of the service whose units carry ``mark``: beside a
    ``unix:`` endpoint's socket, else in the runtime directory."""

    def __init__(
        self,
        listen: str,
        mark: str,
        socket_mode: int,
        earlier_marks: tuple[str, ...] = (),
        setting: str = "[sdexec] listen",
    ) -> None:
        """``earlier_marks``: the service's other marks (as an earlier
        version named its units, and its lock: the socket path as written,
        before it was taken in one spelling). A service still running under
        one of them must refuse this one too. ``setting``: what gave
        ``listen`` (twistd's ``--listen``, or the file's key), for the
        refusal's message."""
        self.listen = listen
        self.setting = setting
        directory = _lock_directory(listen, socket_mode)
        self.path = os.path.join(directory, _lock_name(mark))
        self._earlier = [
            os.path.join(directory, _lock_name(earlier))
            for earlier in earlier_marks
            if _lock_name(earlier) != _lock_name(mark)
        ]
        self._fd: int | None = None
        self._earlier_fds: list[int] = []

    def take(self) -> None:
        """Hold the lock, or :class:`AlreadyServed` if another process does
        (another service in this process too: each take opens the file)."""
        if self._fd is not None:
            return
        fd = _locked(self.path, self.listen, self.setting)
        try:
            self._take_earlier()
            for held in (fd, *self._earlier_fds):
                # Who holds it, for the refusal's message (a full /run fails
                # here: the lock is let go, never leaked).
                os.ftruncate(held, 0)
                os.pwrite(held, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            self.release()
            os.close(fd)
            raise
        self._fd = fd

    def _take_earlier(self) -> None:
        """The locks of the earlier marks, held too for the service's life:
        an earlier version started later on this endpoint is refused as
        well. One that cannot be opened (not a file; another user's) is no
        service's of ours."""
        for earlier in self._earlier:  # on failure, take() lets all go
            if os.path.isfile(earlier):
                with contextlib.suppress(PermissionError):
                    self._earlier_fds.append(
                        _locked(earlier, self.listen, self.setting)
                    )

    def release(self) -> None:
        """Let the lock go (idempotent). The file stays: removing it could
        let two services lock two files of one name."""
        for fd in self._earlier_fds:
            os.close(fd)
        self._earlier_fds = []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lock_name(mark: str) -> str:
    return f"sdexec-{mark.strip(' []').removeprefix('sdexec:')}.lock"


def _locked(path: str, listen: str, setting: str) -> int:
    """A descriptor of ``path`` holding its lock; :class:`AlreadyServed`
    naming ``setting`` and the holder if another process holds it."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise AlreadyServed(
            f"{setting}: another sdexec ({holder}) serves {listen}: it"
            f" holds {path}; not starting, and none of its units touched"
        ) from None
    return fd


def _open(path: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
    # A symbolic link: the pid link of the first version of this lock
    # (never released by a version that made one). Not followed.
    os.unlink(path)
    return os.open(path, flags, 0o600)


def _holder(fd: int) -> str:
    pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return f"pid {pid}" if pid.isdigit() else "pid unknown"


def _lock_directory(listen: str, socket_mode: int) -> str:
    path = unix_path(listen)
    if path is not None:
        # The socket's own directory, made and checked as listening will.
        directory = os.path.dirname(os.path.abspath(path))
        check_directory(directory, socket_mode_of(listen, socket_mode), os.getuid())
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
