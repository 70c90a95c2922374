"""The processes of a unit its manager lost: ended, not left running.

A systemd manager killed with SIGKILL leaves its units' processes running,
outside any unit a new manager knows (sdexec/process.py reports the stream
as lost). Nothing else will ever stop them, and nobody follows them. They
still sit in the dead manager's cgroup of the unit, which the kernel keeps
while they live; its ``cgroup.procs``, and those of any groups below it
(which a unit given ``Delegate`` may make), list them all.

That cgroup is noted while the unit runs: from ``ControlGroup`` where a
``GetAll`` read it (the fence check, the receipt), else from the main
process's ``/proc/PID/cgroup`` when the unit starts (:func:`unit_cgroup`).
There it is trusted only at the place systemd gives the unit's cgroup: in
the manager's own cgroup, below nothing but slices. A user may name a
cgroup of theirs like the unit, but only the manager makes one there; and
the main process may have been in a group below it (``DelegateSubgroup``).
Where neither was read (the main process was gone first), it is where the
manager makes it (:func:`expected_unit_cgroup`): the manager's cgroup when
the start was asked for, the unit's ``Slice`` and its name, escaped as
systemd does.

The processes found there first get the unit's stop-timer signal (for a
job under Flux's IMP, its proxy for SIGKILL: the IMP ends what its user
owns, which the service may not signal), then, after :data:`GRACE_S` (at
once if that signal is SIGKILL), SIGKILL, pass after pass (at most 16)
until a pass finds no process it has not seen (one may fork while the
group is read). Each is signalled through a pidfd
opened before its cgroup is checked, so a pid the kernel gave to another
program since is signalled only if it sits in that very cgroup. What may
not be signalled (another user's, without an IMP) is told: the node
drains, as for a unit the stop timer abandons.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from sdexec.drain import AdminCause, Cause
from sdexec.procfs import open_pidfd, process_cgroups
from sdexec.signals import signal_name

__all__ = [
    "GRACE_S",
    "LostUnitKill",
    "expected_unit_cgroup",
    "lost_unit_reason",
    "signal_cgroup",
    "unit_cgroup",
]

log = Logger()

#: Seconds between the stop-timer signal and SIGKILL: long enough for an
#: IMP to act on its signal, which it does at once.
GRACE_S = 2.0
#: SIGKILL passes at most: each finds what forked during the one before.
_PASSES = 16

#: Where each hierarchy that names a unit's cgroup may be mounted: cgroup
#: v2's unified tree (alone, or beside v1 on a hybrid node), and v1's
#: name=systemd one. systemd makes the unit's cgroup at one path in each.
_HIERARCHIES = {
    "": ("sys/fs/cgroup", "sys/fs/cgroup/unified"),
    "name=systemd": ("sys/fs/cgroup/systemd",),
}


def unit_cgroup(
    unit: str, main_pid: int, manager_cgroup: str | None, root: str = "/"
) -> str | None:
    """The cgroup of ``unit``, from the cgroup of its main process
    ``main_pid`` (the unit's, or a group below it) when the unit starts;
    ``None`` if the process is gone, or is not in the unit's cgroup where
    the manager (its own cgroup ``manager_cgroup``) would have made it."""
    if manager_cgroup is None:
        return None
    for controllers, path in process_cgroups(main_pid, root) or ():
        if controllers in _HIERARCHIES:
            found = _unit_path(path, unit, manager_cgroup.rstrip("/"))
            if found is not None:
                return found
    return None


def _unit_path(path: str, unit: str, manager: str) -> str | None:
    """``path`` cut after the unit's own group, which must follow the
    manager's cgroup and nothing but slices; else ``None``."""
    if not path.startswith(f"{manager}/"):
        return None
    parts = path[len(manager) + 1 :].split("/")
    for index, part in enumerate(parts):
        # systemd escapes a cgroup name the kernel would take for its own
        # (``cpu.service``) with a leading underscore.
        if part in (unit, f"_{unit}"):
            return "/".join([manager, *parts[: index + 1]])
        if not part.endswith(".slice"):
            return None
    return None


def expected_unit_cgroup(
    manager_cgroup: str | None,
    slice_name: object,
    unit: str,
    manager_version: int | None = None,
    root: str = "/",
) -> str | None:
    """Where the manager whose cgroup is ``manager_cgroup`` makes the cgroup
    of ``unit`` in ``slice_name`` (``a-b.slice`` is ``/a.slice/a-b.slice``,
    ``-.slice`` the manager's own), its names escaped as systemd
    ``manager_version`` does (the current one's if not known); ``None``
    without both. Where that is not there but another spelling of it is,
    that one: the manager that made it may have been another systemd (the
    package upgraded before the manager was lost), whose rule or list of
    controllers (``cpuset`` from 244, ``cpuacct`` gone in 258) differs."""
    if manager_cgroup is None or not isinstance(slice_name, str) or not slice_name:
        return None
    by_prefix = manager_version is None or manager_version >= ESCAPES_BY_PREFIX
    slices = [
        _slice_path(manager_cgroup, slice_name, rule)
        for rule in (by_prefix, not by_prefix)
    ]
    if unit.startswith("_"):  # escaped by every systemd: "__x.service"
        names = [f"_{unit}"]
    else:  # "_X" is only ever X escaped: either spelling is X's
        names = [_cg_escape(unit, by_prefix), unit, f"_{unit}"]
    spellings = dict.fromkeys(f"{path}/{name}" for path in slices for name in names)
    expected = next(iter(spellings))
    return next((cgroup for cgroup in spellings if _is_there(cgroup, root)), expected)


def _slice_path(manager_cgroup: str, slice_name: str, by_prefix: bool) -> str:
    """The cgroup of ``slice_name`` in the manager's, escaped by the rule
    ``by_prefix`` picks (:func:`_cg_escape`)."""
    path = manager_cgroup.rstrip("/")
    if slice_name != "-.slice":
        parts = slice_name.removesuffix(".slice").split("-")
        for n in range(len(parts)):
            name = "-".join(parts[: n + 1]) + ".slice"
            path += f"/{_cg_escape(name, by_prefix)}"
    return path


def _is_there(cgroup: str, root: str) -> bool:
    """Whether ``cgroup`` is a directory of any hierarchy systemd tracks
    processes in."""
    return any(_directories(cgroup, root))


#: The first systemd whose ``cg_escape`` escapes every name that begins with
#: a controller's name and a dot (``cpu.job.service``; systemd PR 27356).
#: Before it only a name whose part before its last dot is a controller's.
ESCAPES_BY_PREFIX = 254

#: The controllers whose names systemd will not let a cgroup's name begin
#: with (``cpu.service`` is made ``_cpu.service``: cg_escape).
_CONTROLLERS = frozenset(
    [
        "cpu",
        "cpuacct",
        "cpuset",
        "io",
        "blkio",
        "memory",
        "devices",
        "pids",
        "bpf-firewall",
        "bpf-devices",
        "bpf-foreign",
        "bpf-socket-bind",
        "bpf-restrict-network-interfaces",
    ]
)


def _cg_escape(name: str, by_prefix: bool) -> str:
    """systemd's ``cg_escape``: a leading ``_`` where the kernel could take
    the name for one of its own files. ``by_prefix``: as systemd 254 and
    later (:data:`ESCAPES_BY_PREFIX`), which escape any name that begins
    with a controller's name and a dot; else only where that is all before
    the last dot."""
    special = name[:1] in ("", "_", ".") or name.startswith("cgroup.")
    special = special or name in ("notify_on_release", "release_agent", "tasks")
    if by_prefix:
        controller, dot, _ = name.partition(".")
    else:
        controller, dot, _ = name.rpartition(".")
    if special or (dot and controller in _CONTROLLERS):
        return f"_{name}"
    return name


@dataclass
class Signalled:
    """What one :func:`signal_cgroup` did."""

    sent: set[int] = field(default_factory=set)
    #: Processes of the cgroup it may not signal (EPERM).
    refused: set[int] = field(default_factory=set)


def signal_cgroup(cgroup: str, signum: int, root: str = "/") -> Signalled:
    """Send ``signum`` to every process in ``cgroup`` or below it; with
    SIGKILL, again to what a pass finds new, until none is."""
    done = Signalled()
    seen: set[int] = set()
    for _ in range(_PASSES if signum == signal.SIGKILL else 1):
        new = [pid for pid in _members(cgroup, root) if pid not in seen]
        if not new:
            break
        seen.update(new)
        for pid in new:
            outcome = _signal_if_in(pid, cgroup, signum, root)
            if outcome == 0:
                done.sent.add(pid)
            elif outcome == errno.EPERM:
                done.refused.add(pid)
    return done


def _members(cgroup: str, root: str) -> Iterator[int]:
    """The pids listed in ``cgroup`` and every group below it, in each
    hierarchy that has it (a hybrid node lists a process in two)."""
    for top in _directories(cgroup, root):
        for directory in _groups(top):
            yield from _listed(os.path.join(directory, "cgroup.procs"))


def _directories(cgroup: str, root: str) -> Iterator[str]:
    """``cgroup``'s directory in each hierarchy that has it (the first of
    its mounts that does)."""
    for mounts in _HIERARCHIES.values():
        for base in mounts:
            top = os.path.join(root, base, cgroup.lstrip("/"))
            if os.path.isdir(top):
                yield top
                break


def _groups(top: str) -> Iterator[str]:
    """``top`` and every directory below it, without recursion (a delegated
    tree may be deeper than Python's stack), not following links."""
    pending = [top]
    while pending:
        directory = pending.pop()
        yield directory
        try:
            with os.scandir(directory) as entries:
                below = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue  # removed meanwhile
        pending.extend(below)


def _listed(procs: str) -> list[int]:
    """The pids a ``cgroup.procs`` lists; none if it is gone meanwhile."""
    try:
        with open(procs, encoding="ascii") as file:
            return [int(line) for line in file if line.strip()]
    except (OSError, ValueError):
        return []


def _signal_if_in(pid: int, cgroup: str, signum: int, root: str) -> int | None:
    """Send ``signum`` to ``pid`` if it is (still) in ``cgroup`` or below:
    checked after its pidfd is open, so the check and the signal are of one
    process. 0 if sent, the errno if refused, ``None`` if not ours or gone."""
    try:
        pidfd = open_pidfd(pid)  # None: signalled by pid, just checked
    except ProcessLookupError:
        return None  # gone already
    try:
        paths = (path for _, path in process_cgroups(pid, root) or ())
        if not any(path == cgroup or path.startswith(f"{cgroup}/") for path in paths):
            return None
        _send(pid, pidfd, signum)
        return 0
    except OSError as error:  # gone meanwhile, or not ours to signal
        return error.errno if error.errno == errno.EPERM else None
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _send(pid: int, pidfd: int | None, signum: int) -> None:
    """``signum`` to the process, through its pidfd where one is open and
    the kernel (or a seccomp filter) lets it be used, else by pid."""
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signum)
            return
        except OSError as error:
            if error.errno not in (errno.ENOSYS, errno.EINVAL):
                raise  # gone meanwhile, or not ours to signal
    os.kill(pid, signum)


def lost_unit_reason(unit: str) -> str:
    """The drain reason for processes of a lost unit that may not be
    signalled."""
    return f"unkillable user processes left by lost unit {unit}"


class LostUnitKill:
    """Ends what a lost unit left in ``cgroup``: ``stop_signal`` at once,
    SIGKILL :data:`GRACE_S` later (at once if ``stop_signal`` is SIGKILL);
    ``drain(reason, cause)`` if some may not be signalled. While its SIGKILL is
    still to come it is in ``pending``, the service's: one that stops first
    sends it then (:meth:`finish`). No SIGKILL once ``in_use(unit)``: a unit
    of that name started (or adopted) meanwhile has the same cgroup, and
    what runs there now is its own."""

    def __init__(
        self,
        unit: str,
        cgroup: str,
        stop_signal: int,
        clock: IReactorTime,
        drain: Callable[[str, Cause], None],
        pending: set[LostUnitKill],
        root: str = "/",
        in_use: Callable[[str], bool] = lambda unit: False,
    ) -> None:
        self.unit = unit
        self.cgroup = cgroup
        self._stop_signal = stop_signal
        self._clock = clock
        self._drain = drain
        self._pending = pending
        self._root = root
        self._in_use = in_use
        self._sigkill: IDelayedCall | None = None

    @property
    def pending(self) -> bool:
        """Whether SIGKILL is still to come."""
        return self._sigkill is not None and self._sigkill.active()

    def start(self) -> None:
        """Send the stop signal (SIGKILL at once if that is it), and SIGKILL
        after :data:`GRACE_S` if one was sent or refused."""
        if self._stop_signal == signal.SIGKILL:
            self._kill()
            return
        found = self._signal(self._stop_signal)
        if found.sent or found.refused:
            self._sigkill = self._clock.callLater(GRACE_S, self._kill)
            self._pending.add(self)

    def finish(self) -> None:
        """SIGKILL now, if it is still to come (the service stops: its
        timer would never fire)."""
        if self.pending:
            assert self._sigkill is not None
            self._sigkill.cancel()
            self._kill()

    def _kill(self) -> None:
        self._pending.discard(self)
        if self._in_use(self.unit):
            log.info(
                "{unit} runs again: what its lost run left there is its own now",
                unit=self.unit,
            )
            return
        done = self._signal(signal.SIGKILL)
        if done.refused:
            reason = lost_unit_reason(self.unit)
            log.error(
                "{unit}: {processes} left outside any unit may not be"
                " signalled: {reason}",
                unit=self.unit,
                processes=_processes(len(done.refused)),
                reason=reason,
            )
            self._drain(reason, AdminCause.LOST_UNIT)

    def _signal(self, signum: int) -> Signalled:
        try:
            done = signal_cgroup(self.cgroup, signum, self._root)
        except Exception:  # what is left must still be tried, and told
            log.failure("{unit}: signalling what it left failed", unit=self.unit)
            return Signalled()
        if done.sent:
            log.warn(
                "{unit}: {processes} left outside any unit: {signal} sent",
                unit=self.unit,
                processes=_processes(len(done.sent)),
                signal=signal_name(signum),
            )
        return done


def _processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"
