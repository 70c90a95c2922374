"""How many client connections the service keeps open at once.

Every connection holds a file descriptor (and a protocol object) until it
closes. Without a cap, one local user holding thousands of idle connections
exhausted the service's fds, and the owner's next ``sdexec run`` failed
(issue 16). :class:`ConnectionCount` counts open connections per peer uid;
a connection over ``[sdexec] max-connections`` (everyone's) or
``max-connections-per-user`` (each other user's: the owner's own
parallelism is bounded by the total only) is refused (the server answers
``EAGAIN`` naming the key and closes it). A peer that may not use the
service at all is refused before it is counted; :class:`RefusalLog` keeps
its refusals from filling the journal.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["ConnectionCount", "RefusalLog"]


class ConnectionCount:
    """The open connections, per peer uid."""

    def __init__(self) -> None:
        self._open: Counter[int] = Counter()

    @property
    def total(self) -> int:
        return self._open.total()

    def admit(
        self, uid: int, total_limit: int, per_user_limit: int | None
    ) -> str | None:
        """Count a new connection from ``uid``; or, if that would exceed a
        limit, count nothing and say which (a message for the client).
        ``per_user_limit`` ``None``: only the total applies (the owner)."""
        if self.total >= total_limit:
            return (
                f"too many connections: {self.total} open, the most"
                f" [sdexec] max-connections allows"
            )
        if per_user_limit is not None and self._open[uid] >= per_user_limit:
            return (
                f"too many connections from uid {uid}: {self._open[uid]} open, the"
                " most [sdexec] max-connections-per-user allows"
            )
        self._open[uid] += 1
        return None

    def release(self, uid: int) -> None:
        """A connection :meth:`admit` counted has closed."""
        self._open[uid] -= 1
        if self._open[uid] <= 0:
            del self._open[uid]


class RefusalLog:
    """Which refused connections to log: the first of each uid, then none
    of that uid for ``interval`` seconds. A peer may connect in a loop, each
    refusal costs it nothing, and a line for each would fill the journal.
    What it holds is bounded by the uids refused within ``interval``."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        #: uid → when its refusal was last logged, oldest first.
        self._logged: dict[int, float] = {}

    def first(self, uid: int, now: float) -> bool:
        """Whether a refusal of ``uid`` at ``now`` is to be logged (none of
        its refusals was in the ``interval`` before)."""
        self._forget_before(now - self.interval)
        if uid in self._logged:
            return False
        self._logged[uid] = now
        return True

    def _forget_before(self, moment: float) -> None:
        while self._logged:
            uid, logged_at = next(iter(self._logged.items()))
            if logged_at > moment:
                return
            del self._logged[uid]
