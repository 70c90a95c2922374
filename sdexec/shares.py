"""Each user's share of the service's process caps.

``[sdexec] max-processes``, ``max-background`` and ``max-waitable`` bound
what the service's owner (the resource manager) holds; each user of
``allow-users`` is bounded apart, by ``max-processes-per-user``,
``max-background-per-user`` and ``max-waitable-per-user``, and counts
against nothing of the owner's: one of them that fills its share (a fuzz
filled 944 waitable slots and 1.1 GB of retained output as one) leaves the
owner's jobs all the room the site gave them, and the other users theirs.
What the service holds in all is bounded by the owner's caps plus each
listed user's (docs/design.md, "Per-user caps").

:class:`Share` names the caps that apply to one request's user;
:class:`ProcessOwners` counts the processes each uid has tabled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Any, NamedTuple, TypeVar

__all__ = ["STATS_USERS", "ProcessOwners", "Share", "count_off", "most_allowed"]

_Key = TypeVar("_Key", bound=Hashable)


def count_off(counts: Counter[_Key], key: _Key) -> None:
    """One less of ``key`` in ``counts``, forgotten at none: a count kept
    per uid (connections, processes, stuck lookups) must not keep every uid
    it has ever seen."""
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


def most_allowed(held: int, limit: int, key: str) -> str:
    """How a refusal at a cap names it: "the most [sdexec] KEY allows" for
    ``held`` at ``limit``; past it (a reload lowered the cap below what
    was held), "more than the LIMIT [sdexec] KEY allows", for "3 open, the
    most ... allows" would call 3 the cap where the file says 2."""
    if held > limit:
        return f"more than the {limit} [sdexec] {key} allows"
    return f"the most [sdexec] {key} allows"


#: The most users ``/stats`` lists under ``users`` (those holding the most
#: processes): the list of ``allow-users`` is the admin's, of any length.
STATS_USERS = 32


class Share(NamedTuple):
    """Whose request it is, and which caps bound it."""

    uid: int
    #: Not the service's owner: the ``-per-user`` keys apply.
    per_user: bool

    def key(self, cap: str) -> str:
        """The ``[sdexec]`` key that bounds this user's ``cap``
        (``"max-waitable"``, say), as a refusal names it."""
        return f"{cap}-per-user" if self.per_user else cap

    def limit(self, limits: Any, cap: str) -> int:
        """The value of :meth:`key` in ``limits`` (the ``[sdexec]`` table)."""
        return int(getattr(limits, self.key(cap).replace("-", "_")))

    def at_cap(self, limits: Any, cap: str, held: int) -> str | None:
        """Whether ``held`` has reached this user's ``cap`` in ``limits``:
        if so, how the refusal names the cap (:func:`most_allowed`), else
        ``None``."""
        limit = self.limit(limits, cap)
        return most_allowed(held, limit, self.key(cap)) if held >= limit else None

    def whose(self) -> str:
        """Words for a refusal's count: whose processes it counts."""
        return f" of uid {self.uid}" if self.per_user else ""


class ProcessOwners:
    """The uid that started each tabled process, and how many each holds."""

    def __init__(self) -> None:
        self._uids: dict[object, int] = {}
        self._counts: Counter[int] = Counter()

    def add(self, process: object, uid: int) -> None:
        """``process`` was tabled for a request of ``uid``."""
        self._uids[process] = uid
        self._counts[uid] += 1

    def remove(self, process: object) -> None:
        """``process`` left the table (a process never added is ignored)."""
        uid = self._uids.pop(process, None)
        if uid is None:
            return
        count_off(self._counts, uid)

    @property
    def total(self) -> int:
        """The processes every uid added holds."""
        return self._counts.total()

    def uid_of(self, process: object) -> int | None:
        """The uid that added ``process`` (``None``: not added)."""
        return self._uids.get(process)

    def count(self, uid: int) -> int:
        """The processes ``uid`` holds tabled."""
        return self._counts[uid]

    def counts(self) -> dict[int, int]:
        """The processes of each uid that holds any."""
        return dict(self._counts)
