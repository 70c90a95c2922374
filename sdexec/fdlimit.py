"""The service's limit on open files (``RLIMIT_NOFILE``).

The service holds a descriptor per client connection and, per process
whose output it relays, three more (its ends of the stdio socketpairs).
systemd starts every service with a soft limit of 1024 and, since v240, a
hard limit of 524288, and expects a program that needs more to raise its
own soft limit (systemd.exec(5), ``LimitNOFILE=``): at 1024 a node ran out
after about 330 relayed processes (``EMFILE``). The service polls with
epoll, never ``select(2)``, so descriptors above 1023 are safe to use.
"""

from __future__ import annotations

import os
import resource

__all__ = ["FDS_PER_PROCESS", "no_room_for_a_process", "raise_open_file_limit"]

#: Descriptors the service holds per process whose output it relays: its
#: ends of the three stdio socketpairs (and, until systemd has taken them,
#: the unit's three).
FDS_PER_PROCESS = 3
#: Descriptors kept free beyond a start's: for connections to accept, the
#: stats sites', a reconnection to systemd.
RESERVE = 64


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one; ``(old, new)`` if
    it rose, ``None`` if it was there already (or cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        # Unlimited: Linux caps it at fs.nr_open anyway, and an infinite
        # soft limit is refused; leave it.
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return None
    return soft, hard


def no_room_for_a_process(
    processes: int, connections: int, passed: int = 0
) -> str | None:
    """Why a process cannot be started now, if the open-file limit has no
    room for its descriptors and :data:`RESERVE` besides: at ``EMFILE`` an
    exec would fail halfway, and so would accepting connections and
    reconnecting to systemd. The descriptors are counted each time where
    the kernel tells their number at no cost; elsewhere (``/proc/self/fd``
    listed) only once the ``processes`` and ``connections`` held come near
    the limit. The ``passed`` streams of the ``processes`` (stdio
    passthrough: the client's own descriptors) hold none, and count one
    each as if they did: the limit bounds every streaming process alike,
    however many of its streams it passed (they hold memory, and units)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    in_use = _descriptors_counted()
    if in_use is None:
        if FDS_PER_PROCESS * processes + connections + RESERVE < soft // 2:
            return None  # far from it: no listing
        in_use = _descriptors_listed(soft)
    counted = in_use + passed
    if counted + 2 * FDS_PER_PROCESS + RESERVE <= soft:
        return None
    passthrough = (
        f", and {passed} streams passed through (stdio) counted as one each"
        if passed
        else ""
    )
    return (
        f"too many processes: {processes} held, and {in_use} of the"
        f" {soft} descriptors the service's open-file limit allows in use"
        f"{passthrough} (raise LimitNOFILE)"
    )


def _descriptors_counted() -> int | None:
    """The open descriptors, as the size of ``/proc/self/fd`` (Linux 6.2
    and later: their number, kept by the kernel, and no descriptor needed to
    read it); ``None`` where it says nothing (0)."""
    try:
        return os.stat("/proc/self/fd").st_size or None
    except OSError:
        return None


def _descriptors_listed(soft: int) -> int:
    """The open descriptors, listed (it costs one per descriptor, and one
    descriptor of its own: none left means the table is full)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return soft
