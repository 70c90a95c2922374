"""How many client connections the service keeps open at once.

Every connection holds a file descriptor (and a protocol object) until it
closes. Without a cap, one local user holding thousands of idle connections
exhausted the service's fds, and the owner's next ``sdexec run`` failed
(issue 16). :class:`ConnectionCount` counts open connections per peer uid;
a connection over its user's cap is refused (the server answers ``EAGAIN``
naming the key and closes it): ``[sdexec] max-connections`` for the
service's owner, ``max-connections-per-user`` for each user of
``allow-users``, apart, as the process caps are (sdexec/shares.py): the
owner is the resource manager, and the users it lets in, however many
connections they hold, must never shut it out. A peer that may not use
the service at all is refused before it is counted.

Beyond ``max-connections`` the owner has :data:`RESERVED_CONNECTIONS` more
(PostgreSQL's ``superuser_reserved_connections``): a resource manager that
holds every connection it may have shut out the admin's ``sdexec
reload``, which is what ``systemctl reload`` runs (the units'
``ExecReload=``), and ``sdexec stats``. A connection admitted there may
carry only :data:`RESERVE_TOPICS`; anything else is refused with the same
``EAGAIN`` naming the key, and the connection closed
(sdexec/reserve.py, the connection's side): the reserve runs nothing,
and a client that came there for work leaves it to the next admin. A
connection of the reserve that has asked nothing, or has had every
answer, for :data:`RESERVE_IDLE_SECONDS` is closed: the owner's client
that leaked connections (the case the reserve is for) must not hold these
too. No one else has a reserve.
"""

from __future__ import annotations

from collections import Counter

from sdexec.protocol import Topic
from sdexec.shares import count_off, most_allowed

__all__ = [
    "RESERVED_CONNECTIONS",
    "RESERVE_IDLE_SECONDS",
    "RESERVE_TOPICS",
    "ConnectionCount",
    "idle_on_reserve",
    "on_reserve",
]

#: Connections the service's owner may hold beyond ``max-connections``, for
#: :data:`RESERVE_TOPICS` alone. Fixed, not a key: a few are enough for an
#: admin (``systemctl reload`` and a look at what holds the rest), and a
#: flood of the owner's connections gets no more than these, which run
#: nothing.
RESERVED_CONNECTIONS = 3

#: What a connection of the reserve may ask: the admin's requests, each
#: answered once, none starting or streaming anything.
RESERVE_TOPICS = frozenset({Topic.RELOAD, Topic.STATS, Topic.LIST, Topic.UNDRAIN})

#: The reserve, as the messages name it.
_RESERVE = "the {} kept beyond it for {}, {}, {} and {}".format(
    RESERVED_CONNECTIONS, *sorted(RESERVE_TOPICS)
)


#: How long a connection of the reserve may wait with nothing asked and
#: nothing unanswered: ``sdexec reload`` and ``ps`` ask at once.
RESERVE_IDLE_SECONDS = 10.0


def idle_on_reserve() -> str:
    """What a connection of the reserve idle for
    :data:`RESERVE_IDLE_SECONDS` is told as it is closed."""
    return (
        f"closing an idle connection: one of the {RESERVED_CONNECTIONS} kept"
        " beyond [sdexec] max-connections for an admin's requests, it asked"
        f" nothing for {RESERVE_IDLE_SECONDS:g} s"
    )


def on_reserve(what: str, limit: int) -> str:
    """What a request on a connection of the reserve that is not one of
    :data:`RESERVE_TOPICS` (``what``: its topic, quoted) is told, the
    owner's ``limit`` (``max-connections``) named."""
    return (
        f"too many connections: this one is beyond the {limit} [sdexec]"
        f" max-connections allows, one of {_RESERVE}: {what} is refused"
        " there, and the connection closed"
    )


class ConnectionCount:
    """The open connections, per peer uid."""

    def __init__(self) -> None:
        self._open: Counter[int] = Counter()
        #: The peer uid of each connection admitted, by connection id.
        self._uids: dict[int, int] = {}
        #: The owner's connections admitted beyond its limit (counted in
        #: :attr:`total` and :meth:`uids`, not in :meth:`open_by_uid`).
        self._reserved: set[int] = set()

    @property
    def total(self) -> int:
        """The connections open now, every peer's, the reserve's too."""
        return self._open.total() + len(self._reserved)

    def admit(
        self, connection_id: int, uid: int, limit: int, owner: bool
    ) -> str | None:
        """Count a new connection from ``uid``; or, if ``uid`` has
        ``limit`` open already, count nothing and say so (a message for the
        client, naming the key: ``owner``'s, the service's owner's, is
        ``max-connections``, any other's ``max-connections-per-user``).
        The ``owner``'s, at its ``limit``, goes to the reserve while that
        has room (:meth:`reserved`)."""
        count = self._open[uid]
        if count < limit:
            self._open[uid] += 1
        elif owner and len(self._reserved) < RESERVED_CONNECTIONS:
            self._reserved.add(connection_id)
        else:
            whose, key = ("", "") if owner else (f" from uid {uid}", "-per-user")
            also = f", and {_RESERVE} are open too" if owner else ""
            allows = most_allowed(count, limit, f"max-connections{key}")
            return f"too many connections{whose}: {count} open, {allows}{also}"
        self._uids[connection_id] = uid
        return None

    def reserved(self, connection_id: int) -> bool:
        """Whether the connection was admitted to the reserve: it may carry
        :data:`RESERVE_TOPICS` alone."""
        return connection_id in self._reserved

    def promote(self, connection_id: int, limit: int) -> bool:
        """Move a connection of the reserve into its owner's count, if that
        is now under ``limit`` (a reload raised ``max-connections``, or
        others closed): it may then carry anything. True if moved."""
        if connection_id not in self._reserved:
            return False
        uid = self._uids[connection_id]
        if self._open[uid] >= limit:
            return False
        self._reserved.discard(connection_id)
        self._open[uid] += 1
        return True

    def open_by_uid(self) -> dict[int, int]:
        """The open connections of each uid that has any, under its cap
        (the reserve's apart)."""
        return dict(self._open)

    def uid_of(self, connection_id: int | None) -> int | None:
        """The peer uid of an admitted connection (``None``: not one)."""
        return self._uids.get(connection_id) if connection_id is not None else None

    def uids(self) -> dict[int, int]:
        """The peer uid of each open connection, by connection id."""
        return dict(self._uids)

    def release(self, connection_id: int) -> None:
        """A connection :meth:`admit` counted has closed."""
        uid = self._uids.pop(connection_id)
        if connection_id in self._reserved:
            self._reserved.discard(connection_id)
        else:
            count_off(self._open, uid)
