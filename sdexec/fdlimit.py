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

import resource

__all__ = ["raise_open_file_limit"]


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
