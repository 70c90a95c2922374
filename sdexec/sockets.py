"""The UNIX sockets the service creates: private from the start.

Twisted's ``unix:`` endpoint makes its socket with the default mode 0666
and ``bind`` s it before it ``chmod`` s it; a ``--listen unix:PATH`` socket
was world-connectable (issue 16). Every UNIX socket the service creates is
therefore:

- given ``[sdexec] socket-mode`` (default 0600) unless its endpoint names a
  ``mode=`` itself (:func:`private_endpoint`);
- in a directory owned by the service's user that no one else may write to
  (:func:`check_directory`: others could otherwise replace or remove the
  socket), created if missing, below directories of that user's or root's
  that no one else may change either (a sticky one, ``/tmp``, if the entry
  on the way is theirs);
- bound under a umask that leaves only the owner's bits
  (:func:`private_umask`), so the socket is never connectable by others,
  not even between ``bind`` and ``chmod``.

Other endpoints (``tcp:``, ``systemd:``) are returned unchanged: systemd
creates socket-activated sockets with the unit's ``SocketMode=`` (which
Twisted's adoption would make 0666 as it begins to listen:
sdexec/activation.py gives its port the path's own mode to set instead).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import re
import socket
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

__all__ = [
    "KeptOut",
    "check_directory",
    "clear_stale_socket",
    "directory_mode",
    "endpoint_mode",
    "kept_out",
    "listening_path",
    "private_endpoint",
    "private_umask",
    "socket_mode_of",
    "unix_endpoint",
    "unix_path",
]

_UNESCAPED_COLON = re.compile(r"(?<!\\):")


def _fields(description: str) -> list[str]:
    return _UNESCAPED_COLON.split(description)


def unix_endpoint(path: str) -> str:
    """The ``unix:`` endpoint description for a socket path."""
    return "unix:" + path.replace(":", "\\:")  # descriptions split on ':'


def unix_path(description: str) -> str | None:
    """The socket path of a ``unix:`` endpoint description
    (``unix:PATH[:k=v…]`` or ``unix:address=PATH``), else ``None``."""
    kind, *arguments = _fields(description)
    if kind != "unix":
        return None
    for argument in arguments:
        key, equals, value = argument.partition("=")
        if not equals:
            return argument.replace("\\:", ":")
        if key == "address":
            return value.replace("\\:", ":")
    return None


def private_endpoint(description: str, mode: int, uid: int) -> str:
    """``description`` with ``mode=`` added for a ``unix:`` endpoint that
    has none, after :func:`check_directory` of its socket's directory
    (for the socket's own ``mode=`` where it names one, else ``mode``).
    ``ValueError`` naming the directory if it is not the service's."""
    path = unix_path(description)
    if path is None:
        return description
    directory = os.path.dirname(os.path.abspath(path))
    check_directory(directory, socket_mode_of(description, mode), uid)
    if any(field.startswith("mode=") for field in _fields(description)[1:]):
        return description
    return f"{description}:mode={mode:o}"


def socket_mode_of(description: str, socket_mode: int) -> int:
    """The mode the socket of ``description`` gets: its endpoint's own
    ``mode=``, which wins, else ``socket_mode``. Its directory is made for
    it (a directory made for socket-mode's 0600 kept out the users of
    allow-users whom ``mode=666`` let connect)."""
    own = endpoint_mode(description)
    return socket_mode if own is None else own


def endpoint_mode(description: str) -> int | None:
    """The ``mode=`` a ``unix:`` endpoint names itself, octal as Twisted
    reads it; ``None`` if it names none, or one that is not octal (which
    Twisted then refuses), or is no ``unix:`` endpoint."""
    kind, *arguments = _fields(description)
    if kind != "unix":
        return None
    for argument in arguments:
        key, equals, value = argument.partition("=")
        if equals and key == "mode":
            with contextlib.suppress(ValueError):
                return int(value, 8)
    return None


def check_directory(directory: str, mode: int, uid: int) -> None:
    """Create ``directory`` (mode 0700, plus search permission for those
    ``mode`` lets connect) if missing; ``ValueError`` unless it is owned by
    ``uid`` and writable by no one else, below directories no other user
    may change (:func:`_unsafe_ancestor`), ``OSError`` if it cannot be made
    or is no directory."""
    if not os.path.isdir(directory):
        _make_directories(directory, directory_mode(mode))
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        # A file there: said of it, not of a lock or socket path below it.
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory)
    if info.st_uid != uid:
        raise ValueError(
            f"{directory}: a socket's directory must belong to the service's user"
            f" (uid {uid}), not uid {info.st_uid}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"{directory}: a socket's directory must not be writable by group or"
            f" others (mode {stat.S_IMODE(info.st_mode):04o}): they could replace"
            " the socket"
        )
    unsafe = _unsafe_ancestor(directory, uid)
    if unsafe is not None:
        raise ValueError(
            f"{directory}: every directory above a socket's must belong to the"
            f" service's user (uid {uid}) or root, and let no one else replace"
            f" what is in it: {unsafe}; they could replace the socket's directory"
            " and the socket"
        )


def _unsafe_ancestor(directory: str, uid: int) -> str | None:
    """The first directory above ``directory`` whose owner is another user,
    or that another user may write to unless it is sticky and its entry on
    the way is the service user's or root's (``/tmp``), said so; ``None`` if
    none. Both the path as given (a symbolic link on it is an entry its
    owner may replace) and the path it resolves to are judged."""
    absolute = os.path.abspath(directory)
    for path in dict.fromkeys((absolute, os.path.realpath(absolute))):
        entry = path
        while (parent := os.path.dirname(entry)) != entry:
            unsafe = _unsafe_parent(parent, entry, uid)
            if unsafe is not None:
                return unsafe
            entry = parent
    return None


def _unsafe_parent(parent: str, entry: str, uid: int) -> str | None:
    """What lets another user replace ``entry`` in ``parent``, if anything."""
    trusted = (uid, 0)
    info = os.stat(parent)
    if info.st_uid not in trusted:
        return f"{parent} belongs to uid {info.st_uid}"
    if not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    owner = os.lstat(entry).st_uid
    if info.st_mode & stat.S_ISVTX and owner in trusted:
        return None
    mode = f"mode {stat.S_IMODE(info.st_mode):04o}"
    if info.st_mode & stat.S_ISVTX:
        return f"{parent} is sticky ({mode}) but {entry} belongs to uid {owner}"
    return f"{parent} is writable by group or others ({mode})"


def _make_directories(directory: str, mode: int) -> None:
    """``directory`` and those missing above it, each of ``mode`` whatever
    the umask (a unit's ``UMask=0077`` masked mkdir's, and stripped the
    search bit the group needs to reach a socket below)."""
    parent = os.path.dirname(directory)
    if parent != directory and not os.path.isdir(parent):
        _make_directories(parent, mode)
    try:
        os.mkdir(directory, mode)
    except FileExistsError:
        return  # made meanwhile; check_directory judges it as it is
    os.chmod(directory, mode)


def listening_path(port: Any) -> str | None:
    """The path of the UNIX socket a listening ``port`` serves on; ``None``
    for TCP or an abstract name."""
    path = getattr(port.getHost(), "name", None)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str) or not path.startswith("/"):
        return None
    return path


class KeptOut(NamedTuple):
    """What keeps a user from a socket (:func:`kept_out`)."""

    #: The socket, or a directory above it.
    path: str
    #: The user kept out.
    uid: int
    #: ``path``'s status.
    info: os.stat_result
    #: The one class of ``path``'s permission bits the kernel judged
    #: ``uid`` by: ``"owner"``, ``"group"`` or ``"others"``.
    judged_as: str
    #: What those bits lack: ``"write"`` (the socket) or ``"search"``.
    needed: str

    def __str__(self) -> str:
        """``PATH (mode 0700, owner uid 0, group 0)``."""
        return (
            f"{self.path} (mode {stat.S_IMODE(self.info.st_mode):04o}, owner uid"
            f" {self.info.st_uid}, group {self.info.st_gid})"
        )

    @property
    def reason(self) -> str:
        """Why the kernel refuses ``uid``, true of any mode: the class of
        bits it reads for that user, which lack the permission. A member of
        the group is judged by the group's bits alone (mode 0602 lets others
        connect, and keeps its group out)."""
        lacking = f"give no {self.needed} permission"
        if self.judged_as == "owner":
            return f"uid {self.uid} owns it, and the owner's bits {lacking}"
        if self.judged_as == "group":
            return (
                f"uid {self.uid} is in its group {self.info.st_gid}, whose bits"
                f" {lacking} (the kernel judges a member of the group by the"
                " group's bits alone, whatever others' give)"
            )
        return (
            f"uid {self.uid} is neither its owner nor in its group, and others'"
            f" bits {lacking}"
        )


def kept_out(path: str, uids: Iterable[int]) -> KeptOut | None:
    """The first of the socket at ``path`` and the directories above it (its
    own, then each up to ``/``) that keeps one of ``uids`` out: connecting
    takes write permission on the socket and search permission on each
    directory, judged as the kernel does, by the owner's bits for its owner,
    else the group's for a member of its group (primary or supplementary,
    as the user database says), else others' (ACLs are not read); root,
    which needs no permission, never. ``None`` if none does, or one cannot
    be read."""
    # Root needs no permission bits: CAP_DAC_OVERRIDE passes both.
    users = [(uid, _groups_of(uid)) for uid in uids if uid != 0]
    entry, needed = path, "write"
    while True:
        try:
            info = os.stat(entry)
        except OSError:
            return None
        for uid, groups in users:
            judged_as = _judged_as(info, uid, groups)
            if not info.st_mode & _BITS[needed] << _SHIFT[judged_as]:
                return KeptOut(entry, uid, info, judged_as, needed)
        parent = os.path.dirname(entry)
        if parent == entry:
            return None
        entry, needed = parent, "search"


#: The "other" bit of each permission, and how far each class's is shifted.
_BITS = {"write": 0o2, "search": 0o1}
_SHIFT = {"owner": 6, "group": 3, "others": 0}


def _judged_as(info: os.stat_result, uid: int, groups: frozenset[int]) -> str:
    """The one class of bits the kernel reads for ``uid``: the owner's for
    the owner, else the group's for a member, else others' (never more than
    one: a member is not let in by others' bits)."""
    if info.st_uid == uid:
        return "owner"
    if info.st_gid in groups:
        return "group"
    return "others"


def _groups_of(uid: int) -> frozenset[int]:
    """The groups of ``uid``: none for a uid the user database lacks."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return frozenset()
    return frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))


def directory_mode(socket_mode: int) -> int:
    """0700, with search permission for the group or others if
    ``socket_mode`` lets them connect."""
    return 0o700 | (socket_mode & 0o060 and 0o010) | (socket_mode & 0o006 and 0o001)


@contextmanager
def private_umask() -> Iterator[None]:
    """A umask of 0177 while sockets are bound: they are created 0600 and
    only then set to their mode."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


def clear_stale_socket(listen: str) -> None:
    """Remove an earlier run's socket and Twisted's pid link at a ``unix:``
    endpoint: only a socket nothing listens on (never another program's
    live socket). The service calls it for each of its UNIX sockets as it
    listens, holding its owner lock (sdexec/ownerlock.py). Twisted keeps a
    pid link (``PATH.lock``, ``lockfile=1``) beside every one and judges it
    by whether its pid lives: the killed service still a zombie, or its pid
    reused, refused a restart as "another sdexec is serving on it"; and a
    link whose pid is dead had Twisted remove whatever socket is at the
    path, another program's live one too: a start refused with EADDRINUSE
    leaves its link, and the unit's restart took the path of the socket it
    had been refused. So beside a socket something serves, a link whose
    pid is dead goes, and bind(2) refuses again.

    ``ValueError`` naming the path if anything but a socket is there (a
    file at a mistyped path, a copy left behind): it is never removed, and
    bind(2) would meet it on every start until an admin acts."""
    path = unix_path(listen)
    if path is None:
        return
    link = f"{path}.lock"
    if not _is_served(path):
        stale = [path, link]
    elif _names_a_dead_pid(link):
        stale = [link]
    else:
        return
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _names_a_dead_pid(link: str) -> bool:
    """Whether Twisted's pid link ``link`` names a process that is gone (as
    Twisted judges it: ``kill(pid, 0)``)."""
    try:
        pid = int(os.readlink(link))
    except (OSError, ValueError):
        return False  # none, or not Twisted's: its own lock judges it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: another user's, alive
        pass
    return False


def _is_served(path: str) -> bool:
    """Whether the socket at ``path`` is served; ``False`` if there is
    none (a pid link alone is stale as well), ``ValueError`` if what is
    there is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise ValueError(
            f"not a socket: {path} (sdexec removes only a socket nothing"
            " serves: fix the path, or move what is there)"
        )
    with socket.socket(socket.AF_UNIX) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:  # EAGAIN: served, its backlog full; or not ours
            return True
    return True
