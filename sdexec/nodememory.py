"""The node's memory as systemd counts it: what a percentage such as
``MemoryMax=50%`` is a share of.

systemd resolves a percentage against ``physical_memory()`` (its
``limits-util.c``): the RAM ``sysconf`` reports, or the memory limit of its
root cgroup where that is smaller. Its root cgroup is PID 1's, less
``/init.scope``: in a container limited to 16 GiB on a 64 GiB host, 50% is
8 GiB, not the 32 GiB ``sysconf`` alone gives. The request policy compares
a request's size with the site's percentage in those terms.

``root`` stands for ``/`` (tests give a stand-in tree).
"""

from __future__ import annotations

import os

from sdexec.procfs import cgroup_value, process_cgroups

__all__ = ["physical_memory"]

#: What systemd strips from PID 1's cgroup to find its root: the scope a
#: systemd PID 1 runs in, and the names older versions used.
_PID1_SUFFIXES = ("/init.scope", "/system.slice", "/system")


def physical_memory(root: str = "/") -> int:
    """Bytes of memory systemd takes a percentage of on this node."""
    page = os.sysconf("SC_PAGE_SIZE")
    memory = os.sysconf("SC_PHYS_PAGES") * page
    limit = _root_cgroup_limit(root)
    if limit is None:
        return memory
    return min(memory, limit // page * page)


def _root_cgroup_limit(root: str) -> int | None:
    """The memory limit of systemd's root cgroup; ``None`` if it has none
    or it cannot be read (systemd then ignores it too)."""
    unified = os.path.exists(os.path.join(root, "sys/fs/cgroup/cgroup.controllers"))
    path = _root_cgroup(root, unified)
    if path is None:
        return None
    if unified:
        limit = cgroup_value(root, "sys/fs/cgroup", path, "memory.max")
    else:  # v1, or hybrid: the memory controller's own hierarchy
        limit = cgroup_value(
            root, "sys/fs/cgroup/memory", path, "memory.limit_in_bytes"
        )
    if limit is None or not limit.isdigit():
        return None  # "max", or no such file (a root without the controller)
    return int(limit)


def _root_cgroup(root: str, unified: bool) -> str | None:
    """PID 1's cgroup as systemd tracks it (the v2 line where a v2
    hierarchy is mounted, else ``name=systemd``'s), its own scope stripped."""
    entries = process_cgroups(1, root)
    if entries is None:
        return None
    # A v2 hierarchy mounted there, as systemd checks (not the bare
    # directory a container's template may hold).
    hybrid = os.path.exists(
        os.path.join(root, "sys/fs/cgroup/unified/cgroup.controllers")
    )
    wanted = "" if unified or hybrid else "name=systemd"
    path = next((path for controllers, path in entries if controllers == wanted), None)
    if path is None:
        return None
    for suffix in _PID1_SUFFIXES:
        if path.endswith(suffix):
            return path[: -len(suffix)] or "/"
    return path
