"""The processes of a unit its manager lost: killed, not left running.

A systemd manager killed with SIGKILL leaves its units' processes running,
outside any unit a new manager knows (sdexec/process.py reports the stream
as lost). Nothing else will ever stop them, and nobody follows them. They
still sit in the dead manager's cgroup of the unit, which the kernel keeps
while they live, and its ``cgroup.procs`` (with those of any groups below
it, which a unit given ``Delegate`` may make) lists them all.

That cgroup is noted when the unit starts (:func:`unit_cgroups`), from the
main process's ``/proc/PID/cgroup``: then the pid is the unit's (a pid
given to another program meanwhile sits in no cgroup named like the unit),
and the main process may exit later, leaving the others behind, without
the cgroup being lost with it. Only the unit's own cgroup counts (its name
is the path's last component, not any component: a request may name its
unit ``user@1000``). Each process is signalled through a pidfd opened
before its cgroup is checked, so a pid the kernel gave to another program
since is signalled only if it sits in that very cgroup. A pid is read in
the service's pid namespace: where the manager's differs, only that check
stands between the number and another process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence

from sdexec.procfs import process_cgroups

__all__ = ["UnitCgroup", "kill_lost_unit", "unit_cgroups"]

#: A hierarchy's controllers (``""`` for v2's, ``name=systemd`` for v1's
#: own) and the unit's cgroup path in it, as ``/proc/PID/cgroup`` says.
UnitCgroup = tuple[str, str]

#: Where each hierarchy that names a unit's cgroup may be mounted: cgroup
#: v2's unified tree (alone, or beside v1 on a hybrid node), and v1's
#: name=systemd one.
_HIERARCHIES = {
    "": ("sys/fs/cgroup", "sys/fs/cgroup/unified"),
    "name=systemd": ("sys/fs/cgroup/systemd",),
}


def unit_cgroups(unit: str, main_pid: int, root: str = "/") -> tuple[UnitCgroup, ...]:
    """The cgroups of ``unit`` that its main process ``main_pid`` sits in,
    read when the unit starts; none if it has exited already (or its pid
    is another program's), or the hierarchy names no unit's cgroup."""
    return tuple(
        (controllers, path)
        for controllers, path in process_cgroups(main_pid, root) or ()
        if controllers in _HIERARCHIES and path.rsplit("/", 1)[-1] == unit
    )


def kill_lost_unit(cgroups: Sequence[UnitCgroup], root: str = "/") -> int:
    """SIGKILL every process still in the unit's ``cgroups`` (as
    :func:`unit_cgroups` noted them) or in a group below them; how many
    were signalled."""
    killed: set[int] = set()  # on a hybrid node, one process is in two
    for controllers, path in cgroups:
        for pid in _members(controllers, path, root):
            if pid not in killed and _kill_if_in(pid, controllers, path, root):
                killed.add(pid)
    return len(killed)


def _members(controllers: str, path: str, root: str) -> Iterator[int]:
    """The pids listed in ``path`` and every group below it, in the first
    mount of its hierarchy that has it."""
    for base in _HIERARCHIES[controllers]:
        top = os.path.join(root, base, path.lstrip("/"))
        if os.path.isdir(top):
            for directory, _, _ in os.walk(top):
                yield from _listed(os.path.join(directory, "cgroup.procs"))
            return


def _listed(procs: str) -> list[int]:
    """The pids a ``cgroup.procs`` lists; none if it is gone meanwhile."""
    try:
        with open(procs, encoding="ascii") as file:
            return [int(line) for line in file if line.strip()]
    except (OSError, ValueError):
        return []


def _kill_if_in(pid: int, controllers: str, cgroup: str, root: str) -> bool:
    """SIGKILL ``pid`` if it is (still) in ``cgroup`` of the hierarchy of
    ``controllers``, or below it: checked after its pidfd is open, so the
    check and the signal are of one process."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone already
    try:
        paths = (p for c, p in process_cgroups(pid, root) or () if c == controllers)
        if not any(path == cgroup or path.startswith(f"{cgroup}/") for path in paths):
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:  # gone meanwhile, or not ours to signal (EPERM)
        return False
    finally:
        os.close(pidfd)
