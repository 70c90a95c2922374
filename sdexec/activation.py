"""Socket activation: listening on a socket systemd opened for us.

Twisted's ``systemd:`` server endpoint (``systemd:domain=UNIX:name=sdexec``
or ``…:index=0``) adopts a socket passed with ``LISTEN_FDS``/``LISTEN_PID``
(and ``LISTEN_FDNAMES``). Twisted reads those when the endpoint is parsed
and answers a missing descriptor with a bare ``IndexError``/``KeyError``
(``LISTEN_FDNAMES`` is required: systemd ≥ 227 always sets it);
this module turns that into an error that names the endpoint and says what
was inherited, and checks a ``systemd:`` description's syntax without
needing the descriptors (so a configuration can be checked outside the
unit).
"""

from __future__ import annotations

import functools
import os
import re
import socket
import stat
from collections.abc import Iterable
from typing import Any

from twisted.internet import defer, fdesc, tcp, unix
from twisted.internet.endpoints import _SystemdParser, serverFromString
from twisted.internet.interfaces import IStreamServerEndpoint
from zope.interface import implementer

from sdexec.sockets import kept_out

__all__ = [
    "check_systemd_endpoint",
    "inherited_address",
    "inherited_socket_keeps_out",
    "is_systemd_endpoint",
    "kernel_somaxconn",
    "server_endpoint",
    "systemd_endpoint_domain",
    "with_backlog",
]

PREFIX = "systemd:"
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"
#: An endpoint argument ``backlog=`` (arguments are split on colons that
#: are not escaped with a backslash).
_BACKLOG_ARGUMENT = re.compile(r"(?<!\\):backlog=")


def is_systemd_endpoint(description: str) -> bool:
    """Whether ``description`` is a ``systemd:`` endpoint (a socket systemd
    passes), which this module adopts, rather than one Twisted opens."""
    return description.startswith(PREFIX)


def _arguments(description: str) -> dict[str, str]:
    fields = description[len(PREFIX) :].split(":")
    arguments = {}
    for field in fields:
        key, equals, value = field.partition("=")
        if not equals:
            raise ValueError(f"{field!r} is not KEY=VALUE")
        arguments[key] = value
    return arguments


def check_systemd_endpoint(description: str) -> None:
    """Raise ValueError unless ``description`` is ``systemd:domain=D`` with
    exactly one of ``index=N`` and ``name=NAME``."""
    arguments = _arguments(description)
    unknown = set(arguments) - {"domain", "index", "name"}
    if unknown:
        raise ValueError(f"unknown argument {sorted(unknown)[0]!r}")
    if not hasattr(socket, "AF_" + arguments.get("domain", "")):
        raise ValueError("domain= must be an address family such as UNIX or INET6")
    if ("index" in arguments) == ("name" in arguments):
        raise ValueError("give exactly one of index= and name=")
    if "index" in arguments and not arguments["index"].isdigit():
        raise ValueError(f"index={arguments['index']!r} is not a number")


def systemd_endpoint_domain(description: str) -> str | None:
    """The address family a ``systemd:`` endpoint names (``UNIX``...)."""
    return _arguments(description).get("domain")


#: Twisted reads (and then unsets) LISTEN_PID and LISTEN_FDS when it is
#: imported, so the error can only say what it needs.
_WHAT_IS_NEEDED = (
    "Twisted adopts sockets passed with LISTEN_PID (this process),"
    " LISTEN_FDS and LISTEN_FDNAMES (one name per socket: the .socket unit's"
    " FileDescriptorName=), as systemd passes them to a socket-activated unit"
)


def kernel_somaxconn(path: str = SOMAXCONN_PATH) -> int:
    """The kernel's cap on a listen backlog (``net.core.somaxconn``), or
    Python's ``socket.SOMAXCONN`` where it cannot be read."""
    try:
        with open(path) as sysctl:
            return int(sysctl.read())
    except (OSError, ValueError):
        return socket.SOMAXCONN


def with_backlog(description: str, backlog: int) -> str:
    """``description`` listening with ``backlog``, unless it names its own
    ``backlog=`` or is a ``systemd:`` socket (which takes no ``backlog=``:
    :func:`server_endpoint` gives it its backlog)."""
    if is_systemd_endpoint(description) or _BACKLOG_ARGUMENT.search(description):
        return description
    return f"{description}:backlog={backlog}"


def server_endpoint(
    reactor: Any, description: str, backlog: int | None = None
) -> IStreamServerEndpoint:
    """``serverFromString``, with a clear ValueError when a ``systemd:``
    endpoint names a socket this process did not inherit; an inherited
    socket's path is left in place when it stops listening, and it listens
    with ``backlog`` if given."""
    try:
        endpoint = serverFromString(reactor, description)
    except (IndexError, KeyError):
        if not is_systemd_endpoint(description):
            raise
        raise ValueError(
            f"{description}: no such inherited socket ({_inherited()})."
            f" {_WHAT_IS_NEEDED}"
        ) from None
    if not is_systemd_endpoint(description):
        return endpoint
    _check_socket(description, endpoint.fileno)
    return _Inherited(endpoint, backlog)


def _inherited() -> str:
    """What this process inherited, as Twisted read it: a ``name=`` that is
    not the ``.socket`` unit's ``FileDescriptorName=`` (by default the
    unit's own name, ``sdexec-site.socket``) is told which names it has."""
    inherited = _SystemdParser._sddaemon
    count = len(inherited.inheritedDescriptors())
    if not count:
        return "none was inherited"
    names = ", ".join(repr(name) for name in inherited.inheritedNamedDescriptors())
    return f"{count} inherited, named {names}"


def _check_socket(description: str, fd: int) -> None:
    """ValueError unless the inherited ``fd`` is a stream socket of the
    address family ``description`` names. Twisted adopts any descriptor:
    given a TCP socket as ``domain=UNIX`` (a TCP peer has no uid) or a
    SOCK_SEQPACKET one, the service said it listened and refused every
    client; a datagram socket or a FIFO failed the start naming nothing."""
    try:
        is_socket = stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError as error:
        raise ValueError(  # strerror: not Python's "[Errno 9] Bad file descriptor"
            f"{description}: the descriptor passed: {error.strerror or error}"
        ) from None
    if not is_socket:
        raise ValueError(
            f"{description}: the descriptor passed is not a socket"
            " (the .socket unit's ListenStream= makes one)"
        )
    wanted = (
        socket.AddressFamily[f"AF_{systemd_endpoint_domain(description)}"],
        socket.SOCK_STREAM,
    )
    with socket.socket(fileno=os.dup(fd)) as sock:
        passed = (sock.family, sock.type)
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    differ = [
        (have, want) for have, want in zip(passed, wanted, strict=True) if have != want
    ]
    if differ:
        raise ValueError(
            f"{description}: the socket passed is"
            f" {' '.join(have.name for have, _ in differ)}, not"
            f" {' '.join(want.name for _, want in differ)}"
            " (the .socket unit's ListenStream=)"
        )
    if not listening:
        # A .socket unit of Accept=yes passes each connection: Twisted
        # made its path 0666 (the unit's listening socket's), then failed
        # with a bare EINVAL.
        raise ValueError(
            f"{description}: the socket passed is not listening: a"
            " connection, as a .socket unit of Accept=yes passes (give"
            " Accept=no)"
        )


@implementer(IStreamServerEndpoint)
class _Inherited:
    """A ``systemd:`` endpoint whose socket goes on listening, at its path
    and with its mode, once the service stops listening: it is the
    ``.socket`` unit's, there for the next start (a stopped service shut it
    down and unlinked its path: nobody could connect, nor start the
    service again). Listening with ``backlog``, if given."""

    def __init__(self, endpoint: IStreamServerEndpoint, backlog: int | None) -> None:
        self._endpoint = endpoint
        self._backlog = backlog

    def listen(self, factory: Any) -> Any:
        endpoint = self._endpoint
        permissions = _path_permissions(getattr(endpoint, "fileno", None))
        if permissions is None:  # TCP, or an abstract name: no mode to keep
            listening = endpoint.listen(factory)
        else:
            listening = defer.execute(
                _adopt_keeping_mode, endpoint, factory, permissions
            )
        listening.addCallback(_keep_socket, permissions is not None)
        return listening.addCallback(_relisten, self._backlog)


def _adopt_keeping_mode(endpoint: Any, factory: Any, permissions: int) -> Any:
    """The adoption of Twisted's ``AdoptedStreamServerEndpoint.listen``, of
    a UNIX socket at a path, its port given the path's ``permissions`` (the
    unit's ``SocketMode=``) to set as it begins to listen: with Twisted's
    default, 0666, the path was anyone's to connect to until the service
    put the mode back (each such peer of ``listen`` refused by its uid,
    but a ``systemd:`` ``stats`` endpoint checks none)."""
    fdesc.setNonBlocking(endpoint.fileno)
    port = unix.Port._fromListeningDescriptor(
        endpoint.reactor, endpoint.fileno, factory
    )
    port.mode = permissions
    port.startListening()
    os.close(endpoint.fileno)  # the port listens on a copy, as Twisted's does
    return port


def _relisten(port: Any, backlog: int | None) -> Any:
    """Twisted's adoption calls listen(2) on the inherited socket with its
    own default, 50, which sets the backlog of the socket itself (systemd's
    too, whatever the unit's ``Backlog=``): a burst of more than 50
    connects got EAGAIN. It listens again with ``backlog``."""
    if backlog is not None:
        port.socket.listen(backlog)
    return port


def inherited_address(endpoint: IStreamServerEndpoint) -> str | None:
    """What the UNIX socket of an inherited (``systemd:``) ``endpoint`` is
    bound to: its path, or ``@NAME`` for an abstract name; ``None`` for
    any other endpoint or socket."""
    if not isinstance(endpoint, _Inherited):
        return None
    return _bound_address(getattr(endpoint._endpoint, "fileno", None))


def _bound_address(fd: int | None) -> str | None:
    """The path (``@NAME`` if abstract) a UNIX socket ``fd`` is bound to."""
    if fd is None:
        return None
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            name = sock.getsockname() if sock.family == socket.AF_UNIX else None
    except OSError:
        return None
    if isinstance(name, bytes) and name.startswith(b"\0"):
        return "@" + os.fsdecode(name[1:])  # an abstract name, as systemd writes it
    return name if isinstance(name, str) and name else None


def _path_permissions(fd: int | None) -> int | None:
    """The permissions of the path a UNIX socket ``fd`` is bound to."""
    path = _bound_address(fd)
    if path is None or not path.startswith("/"):
        return None  # TCP, or an abstract name
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None


def _keep_socket(port: Any, at_a_path: bool) -> Any:
    # A Twisted port that stops listening shuts its socket down, which
    # stops it listening for every holder of it, systemd's copy too.
    port._shouldShutdown = False
    if at_a_path:
        # Twisted's UNIX port would unlink its path as it stops
        # (unix.Port.connectionLost): the path stays, for the next start;
        # what else it does on a close is its TCP base's
        # (tcp.Port.connectionLost).
        port.connectionLost = functools.partial(tcp.Port.connectionLost, port)
    return port


def inherited_socket_keeps_out(path: str | None, uids: Iterable[int]) -> str | None:
    """How the UNIX socket at ``path`` (a listening port's, ``None`` for TCP
    or an abstract name) keeps one of ``uids`` out,
    if it does (:func:`sdexec.sockets.kept_out`), and what to change: no
    write permission on it for that user, or no search permission on its
    directory (``/run/x/s.sock is mode 0600 in a directory of mode 0700,
    …``), or on one above it (a user manager's ``%t``: ``/run/user/UID`` is
    0700, whatever the unit's ``DirectoryMode=``); else ``None``. For a
    socket systemd made, whose modes are the ``.socket`` unit's
    (``SocketMode=``, ``SocketGroup=``, ``DirectoryMode=``), not ``[sdexec]
    socket-mode``."""
    if path is None:
        return None  # TCP, or an abstract name
    kept = kept_out(path, uids)
    if kept is None:
        return None
    directory = os.path.dirname(path)
    if kept.path not in (path, directory):
        return (
            f"{path} is below {kept}, which uid {kept.uid} may not search: give"
            " the .socket unit a ListenStream= outside it (a user manager's %t,"
            " its XDG_RUNTIME_DIR, is such a directory)"
        )
    try:
        modes = [stat.S_IMODE(os.stat(each).st_mode) for each in (path, directory)]
    except OSError:
        return None
    return (
        f"{path} is mode {modes[0]:04o} in a directory of mode {modes[1]:04o},"
        " made by the .socket unit, whose SocketMode= and DirectoryMode="
        " decide who may connect, not socket-mode (give SocketMode=0660"
        " with a SocketGroup= they share, or 0666, and DirectoryMode=0711)"
    )
