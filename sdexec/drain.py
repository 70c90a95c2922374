"""Why the node is drained: each cause in force, not one string.

Several things drain the node. Some only an admin may clear (`sdexec
undrain`): a fence found not enforced, an unkillable job, an abandoned
unit. Others lift themselves once they no longer hold: systemd unreachable
past ``reconnect-timeout`` (sdexec/outage.py), a manager too old for
sdexec's units (sdexec/managerversion.py), leftovers still being stopped
(sdexec/leftovers.py), a site's property the manager does not take.
Kept as one string, a second drain replaced the first: a cause still
present was forgotten, lifted by a self-lift that found "its" reason
gone, or cleared by an undrain meant for another. Here
each cause is kept under its own key, a self-lifting cause lifts only its
own, and an admin's undrain clears only what an admin must.
"""

from __future__ import annotations

from enum import Enum

from sdexec.refusal import first_named

__all__ = ["ADMIN", "CAUSES", "KINDS", "AdminCause", "Cause", "Drains", "SelfLifting"]


class SelfLifting(Enum):
    """The causes that lift themselves, each while it holds."""

    OUTAGE = "outage"
    VERSION = "version"
    LEFTOVERS = "leftovers"
    #: A property the site sets that the manager does not take: judged
    #: afresh by the next start after a reload or a manager of another
    #: version.
    SITE_PROPERTY = "site-property"


class AdminCause(Enum):
    """What drained the node, for the causes only an admin's undrain
    clears: each caller names its own, so that a resource manager tells
    them apart without reading the reason's text."""

    #: A job outlived its termination sequence (sdexec/jobs.py).
    UNKILLABLE = "unkillable"
    #: A unit (a job's, or a leftover's) outlived its stop timer
    #: (sdexec/unitstop.py).
    ABANDONED_UNIT = "abandoned-unit"
    #: A unit found outside its CPU or memory fence, or its memory cap, or
    #: that could not be verified (sdexec/containment.py).
    FENCE = "fence"
    #: The device canary found the device fence not enforced
    #: (sdexec/devicefence.py).
    DEVICE_FENCE = "device-fence"
    #: Processes a lost unit left that may not be signalled
    #: (sdexec/orphans.py).
    LOST_UNIT = "lost-unit"


#: What drained the node: a self-lifting cause is its own kind.
Cause = SelfLifting | AdminCause

#: Every cause: a fixed set (docs/protocol.md, ``drain.causes``).
CAUSES = (*(kind.value for kind in SelfLifting), *(c.value for c in AdminCause))

#: The self-lifting causes that end without anyone's help, soon: systemd
#: back, the leftovers stopped.
_TRANSIENT = frozenset({SelfLifting.OUTAGE, SelfLifting.LEFTOVERS})

#: The kind of a cause only an admin's undrain clears.
ADMIN = "admin"
#: Every kind of cause: a fixed set (the metrics' labels).
KINDS = (*(kind.value for kind in SelfLifting), ADMIN)


class Drains:
    """The drain causes in force, in the order they came."""

    def __init__(self) -> None:
        #: An admin's cause is keyed by its reason; a self-lifting one by
        #: its kind (its reason may change: a leftover count said afresh).
        #: Each holds its reason and what drained it (:data:`CAUSES`).
        self._causes: dict[str | SelfLifting, tuple[str, Cause]] = {}

    def __bool__(self) -> bool:
        return bool(self._causes)

    @property
    def reason(self) -> str | None:
        """Every cause in force, in the order they came; ``None`` if none."""
        return "; ".join(reason for reason, _ in self._causes.values()) or None

    def reason_shown(self, more: str) -> str | None:
        """:attr:`reason` for one line: the first causes, then how many
        ``more`` (:func:`~sdexec.refusal.first_named`)."""
        reasons = [reason for reason, _ in self._causes.values()]
        return first_named(reasons, "; ", more) or None

    @property
    def causes(self) -> list[dict[str, str | bool]]:
        """Each cause in force, in the order they came: ``reason``, ``kind``
        (:data:`KINDS`), ``lifts-itself`` (false: only an undrain clears
        it) and ``cause`` (:data:`CAUSES`: what drained it). A reason may
        hold "; ", so the joined :attr:`reason` cannot be split back."""
        return [
            {
                "reason": reason,
                "kind": key.value if isinstance(key, SelfLifting) else ADMIN,
                "lifts-itself": isinstance(key, SelfLifting),
                "cause": cause.value,
            }
            for key, (reason, cause) in self._causes.items()
        ]

    @property
    def only_self_lifting(self) -> bool:
        """Whether every cause in force lifts itself (none is the admin's)."""
        return bool(self._causes) and all(
            isinstance(key, SelfLifting) for key in self._causes
        )

    @property
    def outlasts_waiting(self) -> bool:
        """Whether a cause in force is one that waiting will not cure: an
        admin's, or a manager or site property someone must change
        (``version``, ``site-property``). An exec refused for such a cause
        is EIO, not EBUSY: Flux's job-exec drains its rank on EIO (naming
        sdexec's reason) but fails only the job on any other errno, so the
        scheduler would go on placing jobs on the node, each refused.
        ``outage`` and ``leftovers`` end by themselves, soon."""
        return any(key not in _TRANSIENT for key in self._causes)

    def holds(self, kind: SelfLifting) -> bool:
        """Whether the self-lifting cause ``kind`` is in force."""
        return kind in self._causes

    @property
    def who_clears(self) -> str:
        """How the drain goes, for a refused client: by an undrain, by
        itself (once it is over, or once an admin mends it otherwise: the
        refusal of such a cause is EIO, and Flux copies its text into the
        rank's drain reason, which must not promise it passes), or partly
        each."""
        if self.only_self_lifting:
            if self.outlasts_waiting:
                return "lifted once that is mended, not by waiting"
            return "lifted once that is over"
        if any(isinstance(key, SelfLifting) for key in self._causes):
            return "sdexec undrain clears what does not lift itself"
        return "sdexec undrain clears it"

    def add(self, reason: str, cause: Cause) -> str | None:
        """Drain for ``reason``, which ``cause`` names (a :class:`SelfLifting`
        one lifts itself): ``"new"`` for a cause not in force,
        ``"restated"`` for one in force whose reason changed (a leftover
        count), ``None`` if nothing changed."""
        key: str | SelfLifting = cause if isinstance(cause, SelfLifting) else reason
        before = self._causes.get(key)
        self._causes[key] = (reason, cause)
        if before is None:
            return "new"
        return "restated" if before[0] != reason else None

    def lift(self, kind: SelfLifting) -> str | None:
        """A self-lifting cause is over: its reason, if it was in force."""
        held = self._causes.pop(kind, None)
        return held[0] if held else None

    def clear_admins(self) -> list[str]:
        """An admin's undrain: the causes only an admin clears go; the
        reasons they had, in the order they came."""
        cleared = [key for key in self._causes if not isinstance(key, SelfLifting)]
        return [self._causes.pop(key)[0] for key in cleared]
