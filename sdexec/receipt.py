"""The receipt on ``finished``: how the unit ended and what it used.

RFC 42's ``finished`` response carries a wait status. sdexec adds extension
keys, which clients that do not know them ignore (docs/protocol.md):

- ``result``: systemd's ``Result`` for the unit (``success``, ``exit-code``,
  ``signal``, ``core-dump``, ``oom-kill``, ``timeout``, …);
- ``oom_kills``: ``oom_kill`` of the unit cgroup's ``memory.events``
  (cgroup v2), when that file could still be read;
- ``memory_max``: the unit's ``MemoryMax`` in bytes, with an OOM kill only
  (what the limit was), when one was set;
- ``runtime_max_usec``: the unit's ``RuntimeMaxUSec``, with a ``timeout``
  result only (the limit systemd stops a unit at), when one was set;
- ``terminated``: for a job (``SDEXEC_JOBID``, ``SDEXEC_TIME_LIMIT``)
  whose termination had begun when it exited, why: ``timeout`` (its time
  limit) or ``cancel`` (``sdexec.terminate``);
- ``usage``: what was measured, and only that (a key is absent, never 0,
  when it was not): ``cpu_usage_nsec`` (``CPUUsageNSec``),
  ``memory_peak_bytes`` (``MemoryPeak``, else the cgroup's ``memory.peak``),
  ``io_read_bytes``/``io_write_bytes`` (``IOReadBytes``/``IOWriteBytes``,
  with IO accounting), ``wall_time_usec`` (from the main process's start to
  its exit);
- ``receipt_lost``: why the keys are only what the unit's signals carried
  (its ``GetAll`` failed, or was lost with systemd and given up on: added
  by sdexec.process, not made here).

Both ends are here: :func:`finished_extensions` makes the keys from a
unit's property state (read before the unit is stopped, where its
processes outlived the main one and kept its cgroup: stopping removes it);
:class:`Receipt` reads them back for a client and words them.
Standard library only: the command line imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import signal
    from typing import Any
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms

__all__ = [
    "OOM_KILL",
    "UNSET",
    "Receipt",
    "finished_extensions",
    "format_bytes",
    "format_usec",
    "reads_unit_cgroups",
    "unit_cgroup_exists",
]

#: systemd's "not measured" for a 64-bit counter (``[not set]``).
UNSET = 2**64 - 1
#: systemd's ``Result`` for a unit the OOM killer ended.
OOM_KILL = "oom-kill"
TIMEOUT = "timeout"
#: What ``terminated`` may say, and how a client words it.
_TERMINATIONS = {
    "timeout": "its time limit was reached",
    "cancel": "it was cancelled",
}

#: ``usage`` keys and the systemd property each is read from.
_USAGE_PROPERTIES = {
    "cpu_usage_nsec": "CPUUsageNSec",
    "memory_peak_bytes": "MemoryPeak",
    "io_read_bytes": "IOReadBytes",
    "io_write_bytes": "IOWriteBytes",
}


def _measured(value: object) -> int | None:
    """A counter systemd measured, or ``None`` (absent, not an integer, or
    its ``[not set]``)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < UNSET:
        return value
    return None


# -- the service's side ------------------------------------------------------------


def finished_extensions(state: Mapping[str, Any], root: str = "/") -> dict[str, Any]:
    """The extension keys of ``finished`` for a unit in ``state`` (its merged
    ``Unit`` + ``Service`` properties, fresh from a ``GetAll``); ``root``
    is where ``/sys`` is found (tests give a fake tree)."""
    extensions: dict[str, Any] = {}
    result = state.get("Result")
    if isinstance(result, str) and result:
        extensions["result"] = result
    cgroup = _cgroup_directory(state.get("ControlGroup"), root)
    oom_kills = _memory_events(cgroup).get("oom_kill")
    if oom_kills is not None:
        extensions["oom_kills"] = oom_kills
    memory_max = _measured(state.get("MemoryMax"))
    if (result == OOM_KILL or oom_kills) and memory_max is not None:
        extensions["memory_max"] = memory_max
    runtime_max = _measured(state.get("RuntimeMaxUSec"))
    if result == TIMEOUT and runtime_max is not None:
        extensions["runtime_max_usec"] = runtime_max
    usage = _usage(state, cgroup)
    if usage:
        extensions["usage"] = usage
    return extensions


def reads_unit_cgroups(root: str = "/") -> bool:
    """Whether receipts on this node read the unit's cgroup files (cgroup
    v2, the unified hierarchy): then the unit must not be stopped before its
    receipt's ``GetAll`` is answered, as the stop removes them. Elsewhere
    the receipt is systemd's properties alone."""
    return os.path.isfile(os.path.join(root, "sys/fs/cgroup/cgroup.controllers"))


def _usage(state: Mapping[str, Any], cgroup: str | None) -> dict[str, int]:
    usage = {key: _measured(state.get(name)) for key, name in _USAGE_PROPERTIES.items()}
    if usage["memory_peak_bytes"] is None:  # systemd < 255 has no MemoryPeak
        usage["memory_peak_bytes"] = _read_counter(cgroup, "memory.peak")
    usage["wall_time_usec"] = _wall_time(state)
    return {key: value for key, value in usage.items() if value is not None}


def _wall_time(state: Mapping[str, Any]) -> int | None:
    start = _measured(state.get("ExecMainStartTimestampMonotonic"))
    exit_ = _measured(state.get("ExecMainExitTimestampMonotonic"))
    if not start or not exit_ or exit_ < start:  # 0: never happened
        return None
    return exit_ - start


def unit_cgroup_exists(control_group: str, root: str = "/") -> bool:
    """Whether the unit's cgroup is there in the v2 hierarchy, for the
    receipt to read: systemd removes an emptied unit's as the unit leaves
    running (its processes gone with the main one), a failed one's at once."""
    return _cgroup_directory(control_group, root) is not None


def _cgroup_directory(control_group: object, root: str) -> str | None:
    """The unit's directory in the cgroup v2 hierarchy, if it is there (not
    on v1, and not once the unit has failed or stopped: systemd removes it)."""
    if not isinstance(control_group, str) or not control_group:
        return None
    directory = os.path.join(root, "sys/fs/cgroup", control_group.lstrip("/"))
    return (
        directory if os.path.isfile(os.path.join(directory, "cgroup.procs")) else None
    )


def _memory_events(cgroup: str | None) -> dict[str, int]:
    if cgroup is None:
        return {}
    try:
        with open(os.path.join(cgroup, "memory.events"), encoding="ascii") as file:
            fields = (line.split() for line in file)
            return {f[0]: int(f[1]) for f in fields if len(f) == 2 and f[1].isdigit()}
    except (OSError, UnicodeDecodeError):
        return {}  # no memory controller for this cgroup, or it is gone


def _read_counter(cgroup: str | None, name: str) -> int | None:
    if cgroup is None:
        return None
    try:
        with open(os.path.join(cgroup, name), encoding="ascii") as file:
            return _measured(int(file.read().strip()))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


# -- the client's side -------------------------------------------------------------

_NO_USAGE: Mapping[str, int] = MappingProxyType({})


class Receipt:
    """A ``finished`` response read back: the wait status and the extension
    keys the service sent (``None``/empty where it sent none, or sent
    something malformed: an older or foreign service is not an error).

    A plain class, compared by value: a ``NamedTuple`` or a dataclass
    compiles code as the class is made, and with its imports that was a
    tenth of the command line's start-up (docs/performance.md)."""

    __slots__ = (
        "memory_max",
        "oom_kills",
        "receipt_lost",
        "result",
        "runtime_max_usec",
        "status",
        "terminated",
        "usage",
    )

    def __init__(
        self,
        status: int,
        result: str | None = None,
        oom_kills: int | None = None,
        memory_max: int | None = None,
        usage: Mapping[str, int] = _NO_USAGE,
        runtime_max_usec: int | None = None,
        terminated: str | None = None,
        receipt_lost: str | None = None,
    ) -> None:
        self.status = status
        self.result = result
        self.oom_kills = oom_kills
        self.memory_max = memory_max
        self.usage = usage
        self.runtime_max_usec = runtime_max_usec
        #: ``timeout`` or ``cancel``: the job's termination had begun.
        self.terminated = terminated
        #: Why systemd's receipt (``usage``, ``oom_kills``) could not be read.
        self.receipt_lost = receipt_lost

    def _values(self) -> tuple[object, ...]:
        return (
            self.status,
            self.result,
            self.oom_kills,
            self.memory_max,
            self.usage,
            self.runtime_max_usec,
            self.terminated,
            self.receipt_lost,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Receipt):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # compared by value, mutable

    def __repr__(self) -> str:
        return (
            f"Receipt(status={self.status!r}, result={self.result!r},"
            f" oom_kills={self.oom_kills!r}, memory_max={self.memory_max!r},"
            f" usage={self.usage!r}, runtime_max_usec={self.runtime_max_usec!r},"
            f" terminated={self.terminated!r}, receipt_lost={self.receipt_lost!r})"
        )

    @classmethod
    def from_finished(cls, payload: Mapping[str, Any]) -> Receipt:
        """From a ``finished`` payload (its ``status`` must be an integer)."""
        result = payload.get("result")
        usage = payload.get("usage")
        terminated = payload.get("terminated")
        lost = payload.get("receipt_lost")
        return cls(
            status=payload["status"],
            result=result if isinstance(result, str) else None,
            oom_kills=_measured(payload.get("oom_kills")),
            memory_max=_measured(payload.get("memory_max")),
            usage={
                key: value
                for key, value in (usage.items() if isinstance(usage, dict) else ())
                if isinstance(key, str) and _measured(value) is not None
            },
            runtime_max_usec=_measured(payload.get("runtime_max_usec")),
            terminated=terminated if terminated in _TERMINATIONS else None,
            receipt_lost=lost if isinstance(lost, str) else None,
        )

    @property
    def oom_killed(self) -> bool:
        """systemd says the OOM killer ended the unit, or the cgroup counted
        a kill."""
        return self.result == OOM_KILL or bool(self.oom_kills)

    def oom_message(self) -> str:
        """``killed by the OOM killer (MemoryMax=512M)``, for the user; or,
        where the command itself was not (a kill of another of its
        processes: a child, a task of a job shell), ``the OOM killer ended
        1 process of its unit (…)``, and where systemd then stopped the
        unit for it (``Result=oom-kill`` under the default
        ``OOMPolicy=stop``: the command got the stop's SIGTERM, 143), ``…,
        and systemd stopped the rest (OOMPolicy=stop; …)``."""
        limit = (
            f"MemoryMax={format_bytes(self.memory_max)}"
            if self.memory_max is not None
            else "no MemoryMax set"
        )
        if self._killed_by_sigkill:
            return f"killed by the OOM killer ({limit})"
        if self.oom_kills is None:
            ended = "a process"  # the cgroup was gone before it was read
        else:
            ended = f"{self.oom_kills} process" + ("" if self.oom_kills == 1 else "es")
        if self.result == OOM_KILL:
            return (
                f"the OOM killer ended {ended} of its unit, and systemd stopped"
                f" the rest (OOMPolicy=stop; {limit})"
            )
        return f"the OOM killer ended {ended} of its unit ({limit})"

    @property
    def timed_out(self) -> bool:
        """systemd stopped the unit for a timeout (``Result=timeout``):
        its ``RuntimeMaxUSec``, or a stop that outlasted ``TimeoutStopUSec``."""
        return self.result == TIMEOUT

    def timeout_message(self) -> str:
        """``stopped by systemd for a timeout (RuntimeMaxUSec=3600000000: 1h)``, for the
        user: the exit status alone says only 143 (the stop's SIGTERM)."""
        usec = self.runtime_max_usec
        limit = (
            f"RuntimeMaxUSec={usec}: {format_usec(usec)}"
            if usec is not None
            else "no RuntimeMaxUSec set"
        )
        return f"stopped by systemd for a timeout ({limit})"

    def termination_message(self) -> str | None:
        """``job terminated: its time limit was reached`` (or ``it was
        cancelled``), for the user; ``None`` for a process no termination
        ended: the exit status alone (0 for a job that traps SIGALRM, 137
        for one that ignores it) does not say it."""
        why = _TERMINATIONS.get(self.terminated or "")
        return None if why is None else f"job terminated: {why}"

    @property
    def _killed_by_sigkill(self) -> bool:
        """The OOM killer's signal ended the command itself."""
        status = self.status
        return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

    def usage_lines(self) -> list[str]:
        """The receipt as ``systemd-run --wait`` words it; a line only for
        what was measured."""
        usage = self.usage
        lines = [f"Finished with result: {self.result}"] if self.result else []
        if "wall_time_usec" in usage:
            lines.append(f"Service runtime: {format_usec(usage['wall_time_usec'])}")
        if "cpu_usage_nsec" in usage:
            cpu = format_usec(usage["cpu_usage_nsec"] // 1000)
            lines.append(f"CPU time consumed: {cpu}")
        if "memory_peak_bytes" in usage:
            lines.append(f"Memory peak: {format_bytes(usage['memory_peak_bytes'])}")
        io = [
            f"{what} {format_bytes(usage[key])}"
            for what, key in (("read", "io_read_bytes"), ("written", "io_write_bytes"))
            if key in usage
        ]
        if io:
            lines.append(f"IO bytes {', '.join(io)}")
        if self.receipt_lost is not None:
            # Said, rather than a receipt that just lacks its usage lines.
            lines.append(f"Resource usage not known: {self.receipt_lost}")
        return lines


def format_bytes(size: int) -> str:
    """``512B``, ``1.5K``, ``4.0G``: base 1024, one decimal, as systemd's
    ``FORMAT_BYTES``."""
    for exponent, suffix in reversed(list(enumerate("KMGTPE", start=1))):
        factor = 1024**exponent
        if size >= factor:
            return f"{size // factor}.{size % factor * 10 // factor}{suffix}"
    return f"{size}B"


#: systemd's time units, largest first (``format_timespan``'s table).
_TIMESPAN_UNITS = (
    ("y", 31_557_600_000_000),
    ("month", 2_629_800_000_000),
    ("w", 604_800_000_000),
    ("d", 86_400_000_000),
    ("h", 3_600_000_000),
    ("min", 60_000_000),
    ("s", 1_000_000),
    ("ms", 1_000),
    ("us", 1),
)
_USEC_PER_MINUTE = 60_000_000
#: ``systemd-run --wait`` prints its times to the millisecond.
_ACCURACY_USEC = 1_000


def format_usec(usec: int) -> str:
    """``850us``, ``5ms``, ``1.210s``, ``5s``, ``2min 5.010s``, ``1h 2min``:
    as ``systemd-run --wait`` prints a time (systemd's ``format_timespan``
    to the millisecond): under a minute, a unit with a remainder is written
    with three decimals; larger spans as units down to the millisecond."""
    if usec <= 0:
        return "0"
    parts: list[str] = []
    for suffix, unit in _TIMESPAN_UNITS:
        if usec <= 0 or (usec < _ACCURACY_USEC and parts):
            break
        if usec < unit:
            continue
        whole, rest = divmod(usec, unit)
        decimals = len(str(unit)) - len(str(_ACCURACY_USEC))
        if usec < _USEC_PER_MINUTE and rest > 0 and decimals > 0:
            fraction = rest // _ACCURACY_USEC
            parts.append(f"{whole}.{fraction:0{decimals}d}{suffix}")
            break
        parts.append(f"{whole}{suffix}")
        usec = rest
    return " ".join(parts)
