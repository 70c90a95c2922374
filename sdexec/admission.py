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
"""

from __future__ import annotations

from collections import Counter

from sdexec.shares import count_off

__all__ = ["ConnectionCount"]


class ConnectionCount:
    """The open connections, per peer uid."""

    def __init__(self) -> None:
        self._open: Counter[int] = Counter()
        #: The peer uid of each connection admitted, by connection id.
        self._uids: dict[int, int] = {}

    @property
    def total(self) -> int:
        """The connections open now, every peer's."""
        return self._open.total()

    def admit(
        self, connection_id: int, uid: int, limit: int, owner: bool
    ) -> str | None:
        """Count a new connection from ``uid``; or, if ``uid`` has
        ``limit`` open already, count nothing and say so (a message for the
        client, naming the key: ``owner``'s, the service's owner's, is
        ``max-connections``, any other's ``max-connections-per-user``)."""
        count = self._open[uid]
        if count >= limit:
            whose, key = ("", "") if owner else (f" from uid {uid}", "-per-user")
            return (
                f"too many connections{whose}: {count} open, the most"
                f" [sdexec] max-connections{key} allows"
            )
        self._open[uid] += 1
        self._uids[connection_id] = uid
        return None

    def open_by_uid(self) -> dict[int, int]:
        """The open connections of each uid that has any."""
        return dict(self._open)

    def uid_of(self, connection_id: int | None) -> int | None:
        """The peer uid of an admitted connection (``None``: not one)."""
        return self._uids.get(connection_id) if connection_id is not None else None

    def uids(self) -> dict[int, int]:
        """The peer uid of each open connection, by connection id."""
        return dict(self._uids)

    def release(self, connection_id: int) -> None:
        """A connection :meth:`admit` counted has closed."""
        count_off(self._open, self._uids.pop(connection_id))
