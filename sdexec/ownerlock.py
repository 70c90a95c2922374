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

Held, it makes what an earlier run left at a ``unix:`` endpoint stale by
definition, and :meth:`OwnerLock.take` clears it: the socket file, and the
pid link Twisted's ``lockfile=1`` keeps beside it (``PATH.lock``). Twisted
judges that link by whether its pid lives: the killed service still a
zombie, or its pid reused, refused a restart as "another sdexec is serving
on it", after it had begun stopping the leftovers it had found.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import tempfile

from sdexec.sockets import check_directory, unix_path

__all__ = ["AlreadyServed", "OwnerLock", "clear_stale_socket"]


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
    ) -> None:
        """``earlier_marks``: the service's other marks (as an earlier
        version named its units, and its lock: the socket path as written,
        before it was taken in one spelling). A service still running under
        one of them must refuse this one too."""
        self.listen = listen
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
        fd = _locked(self.path, self.listen)
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
        clear_stale_socket(self.listen)

    def _take_earlier(self) -> None:
        """The locks of the earlier marks, held too for the service's life:
        an earlier version started later on this endpoint is refused as
        well. One that cannot be opened (not a file; another user's) is no
        service's of ours."""
        try:
            for earlier in self._earlier:
                if os.path.isfile(earlier):
                    with contextlib.suppress(PermissionError):
                        self._earlier_fds.append(_locked(earlier, self.listen))
        except BaseException:
            self.release()
            raise

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


def _locked(path: str, listen: str) -> int:
    """A descriptor of ``path`` holding its lock; :class:`AlreadyServed`
    naming the holder if another process holds it."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise AlreadyServed(
            f"[sdexec] listen: another sdexec ({holder}) serves {listen}: it"
            f" holds {path}; not starting, and none of its units touched"
        ) from None
    return fd


def clear_stale_socket(listen: str) -> None:
    """Remove an earlier run's socket and Twisted's pid link at a ``unix:``
    endpoint: only a socket nothing listens on (never a file someone
    mistyped the path of, nor another program's live socket). The service
    calls it for each of its UNIX sockets (``stats-socket`` too: Twisted
    keeps a pid link beside every one)."""
    path = unix_path(listen)
    if path is None or _is_live_or_not_a_socket(path):
        return
    for name in (path, f"{path}.lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _is_live_or_not_a_socket(path: str) -> bool:
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return True
    except FileNotFoundError:
        return False  # no socket: a pid link alone is stale as well
    with socket.socket(socket.AF_UNIX) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:  # EAGAIN: served, its backlog full; or not ours
            return True
    return True


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
