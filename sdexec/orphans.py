"""The processes of a unit its manager lost: killed, not left running.

A systemd manager killed with SIGKILL leaves its units' processes running,
outside any unit a new manager knows (sdexec/process.py reports the stream
as lost). Nothing else will ever stop them, and nobody follows them. They
still sit in the dead manager's cgroup of the unit, which the kernel keeps
while they live: the main process's ``/proc/PID/cgroup`` names it, and its
``cgroup.procs`` lists them all.

The main process is known by its pid and its start time, read when the
unit started: its pid given to another program since is not taken for it.
Only the unit's own cgroup counts (its name is the path's last component,
not any component: a request may name its unit ``user@1000``), and each
process is signalled through a pidfd opened before its cgroup is checked,
so a pid the kernel gave to another program since is signalled only if it
sits in that very cgroup. A pid is read in the service's pid namespace:
where the manager's differs, only that check stands between the number and
another process.
"""

from __future__ import annotations

import os
import signal

from sdexec.procfs import process_cgroups, start_time

__all__ = ["kill_lost_unit"]

#: Where each hierarchy that names a unit's cgroup may be mounted: cgroup
#: v2's unified tree (alone, or beside v1 on a hybrid node), and v1's
#: name=systemd one.
_HIERARCHIES = {
    "": ("sys/fs/cgroup", "sys/fs/cgroup/unified"),
    "name=systemd": ("sys/fs/cgroup/systemd",),
}


def kill_lost_unit(unit: str, main_pid: int, main_started: int, root: str = "/") -> int:
    """SIGKILL every process still in the cgroup of ``unit`` whose main
    process was ``main_pid``, started at ``main_started`` (:func:`start_time`,
    read when the unit started); how many were signalled. None when the main
    process is gone, or its pid is another process's now (the cgroup is read
    from it), or it is no longer in the unit's own cgroup."""
    try:
        pidfd = os.pidfd_open(main_pid)  # holds it while it is looked at
    except OSError:
        return 0
    try:
        if start_time(main_pid, root) != main_started:
            return 0
        found = _unit_cgroup(unit, main_pid, root)
    finally:
        os.close(pidfd)
    if found is None:
        return 0
    procs, cgroup = found
    return sum(_kill_if_in(pid, cgroup, root) for pid in procs)


def _unit_cgroup(unit: str, pid: int, root: str) -> tuple[list[int], str] | None:
    """The pids in the unit's cgroup (as ``pid``'s cgroup file names it),
    and that cgroup's path; ``None`` unless ``pid`` is in the unit's."""
    for controllers, path in process_cgroups(pid, root) or ():
        if path.rsplit("/", 1)[-1] != unit:
            continue
        for base in _HIERARCHIES.get(controllers, ()):
            procs = os.path.join(root, base, path.lstrip("/"), "cgroup.procs")
            try:
                with open(procs, encoding="ascii") as file:
                    return [int(line) for line in file if line.strip()], path
            except (OSError, ValueError):
                continue
    return None


def _kill_if_in(pid: int, cgroup: str, root: str) -> bool:
    """SIGKILL ``pid`` if it is (still) in ``cgroup``: checked after its
    pidfd is open, so the check and the signal are of one process."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone already
    try:
        if cgroup not in (path for _, path in process_cgroups(pid, root) or ()):
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:  # gone meanwhile, or not ours to signal (EPERM)
        return False
    finally:
        os.close(pidfd)
