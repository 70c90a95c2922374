"""Is the systemd manager new enough for the units sdexec asks it for?

Every unit is started with ``Type=exec`` (systemd 240); a fence needs
``AllowedCPUs`` and ``AllowedMemoryNodes`` (244). An older manager refuses
each start naming only the property (``Invalid Type setting: exec``), neither
the version nor the way out, while the node looks healthy. So the
service reads the manager's ``Version`` whenever it connects, says it, and
drains the node with a reason that does (docs/configuration.md, "The
systemd it needs").
"""

from __future__ import annotations

import re

__all__ = [
    "MINIMUM",
    "MINIMUM_FENCED",
    "manager_named",
    "version_number",
    "version_problem",
]

#: The oldest systemd that runs sdexec's units.
MINIMUM = 240
#: The oldest that applies the mapper's fences.
MINIMUM_FENCED = 244

_LEADING_NUMBER = re.compile(r"\D*(\d+)")


def version_number(version: str | None) -> int | None:
    """systemd's major version from its ``Version`` property (``252.38-1~deb12u1``,
    ``239 (239-78.el8)``, ``v256.7``); ``None`` if it has none."""
    found = _LEADING_NUMBER.match(version or "")
    return int(found.group(1)) if found else None


def manager_named(version: str | None, unknown: str) -> str:
    """The manager of ``version`` in a message (``systemd 252``), or
    ``unknown`` where its version is not known."""
    number = version_number(version)
    return f"systemd {number}" if number is not None else unknown


def version_problem(version: str | None, fenced: bool) -> str | None:
    """Why the manager of ``version`` cannot serve (``fenced``: with the
    mapper's fences), or ``None`` if it can or its version is not known (a
    manager that does not say is not refused on a guess)."""
    number = version_number(version)
    if number is None:
        return None
    if number < MINIMUM:
        return (
            f"systemd {number} is older than {MINIMUM}, the oldest that runs"
            " sdexec's units (Type=exec):"
            " upgrade systemd"
        )
    if fenced and number < MINIMUM_FENCED:
        return (
            f"systemd {number} is older than {MINIMUM_FENCED}, the oldest that"
            " applies AllowedCPUs and AllowedMemoryNodes"
            " (sdexec-constrain-resources): upgrade systemd"
        )
    return None
