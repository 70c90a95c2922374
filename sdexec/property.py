"""Unit properties from strings to typed D-Bus values.

Requests and the configuration give unit properties as strings
(``SDEXEC_PROP_MemoryMax=512M``); ``StartTransientUnit`` wants each one with
its D-Bus type. Every property ``systemd-run -p`` sends with a type other
than a string is converted (and checked) here, from the text systemd-run
takes (the value syntaxes of the involved ones are in
:mod:`sdexec.propertyvalues`); the few sdexec does not convert are refused,
naming their type (:data:`NOT_CONVERTED`), with cgroup v1's; the others
(:data:`STRING_PROPERTIES`) go as strings, for systemd to judge.

A converted property is a :class:`UnitProperty`: its name, its D-Bus type
signature and a plain Python value. Only the systemd layer
(:mod:`sdexec.systemd`) turns it into a dbus-fast ``Variant``; nothing here
knows the bus library.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeGuard

from sdexec import propertyvalues as values
from sdexec.idset import IDset
from sdexec.propertyvalues import parse_bool
from sdexec.refusal import SHOWN, quoted
from sdexec.signals import parse_signal
from sdexec.sizes import (
    UINT32_MAX,
    UINT64_MAX,
    MemoryLimit,
    parse_permyriad,
    parse_size,
    scale_from_permyriad,
)
from sdexec.unitfile import unit_file_problem, value_line_problem

__all__ = [
    "JUDGED_LISTS",
    "KNOWN_PROPERTIES",
    "UINT32_MAX",
    "PropertyError",
    "UnitProperty",
    "cpu_set",
    "is_known_property",
    "is_property_word",
    "level_of",
    "parse_bool",
    "parse_integer",
    "property_label",
    "rlimit_pair",
    "shown_value",
    "split_rlimit_pairs",
    "string_typed_problem",
    "typed_property",
    "unknown_property_reason",
]


MEMORY_PROPERTIES = frozenset(
    {"MemoryHigh", "MemoryMax", "MemoryMin", "MemoryLow", "MemorySwapMax"}
)
#: Memory sizes systemd also takes as a percentage (``…Scale``), beyond the
#: limits the configuration and the request policy compare.
SCALED_MEMORY_PROPERTIES = frozenset(
    {"MemoryZSwapMax", "DefaultMemoryMin", "DefaultMemoryLow"}
)
#: Memory sizes in bytes alone (systemd has no ``…Scale`` for them).
STARTUP_MEMORY_PROPERTIES = frozenset(
    {
        "StartupMemoryLow",
        "StartupMemoryHigh",
        "StartupMemoryMax",
        "StartupMemorySwapMax",
        "StartupMemoryZSwapMax",
    }
)
#: Boolean properties of units, services and cgroups: every name systemd-run
#: sends as a boolean for a service (src/shared/bus-unit-util.c, its
#: execute, unit, cgroup, kill and service tables). Sent as strings they
#: failed every job ("Unexpected message contents"). Where systemd 257 took
#: more than a boolean it added a property of its own (:data:`EX_TWINS`).
BOOLEAN_PROPERTIES = frozenset(
    {
        "SendSIGKILL",
        "SendSIGHUP",
        "IgnoreSIGPIPE",
        "RemainAfterExit",
        "CPUAccounting",
        "MemoryAccounting",
        "IOAccounting",
        "BlockIOAccounting",
        "TasksAccounting",
        "IPAccounting",
        "Delegate",
        "PrivateTmp",
        "PrivateDevices",
        "PrivateNetwork",
        "NoNewPrivileges",
        "ProtectKernelTunables",
        "ProtectControlGroups",
        "TTYVHangup",
        "TTYReset",
        "TTYVTDisallocate",
        "PrivateUsers",
        "PrivateMounts",
        "PrivateIPC",
        "SyslogLevelPrefix",
        "MemoryDenyWriteExecute",
        "RestrictRealtime",
        "DynamicUser",
        "RemoveIPC",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectClock",
        "MountAPIVFS",
        "CPUSchedulingResetOnFork",
        "LockPersonality",
        "ProtectHostname",
        "MemoryKSM",
        "RestrictSUIDSGID",
        "RootEphemeral",
        "SetLoginEnvironment",
        "StopWhenUnneeded",
        "RefuseManualStart",
        "RefuseManualStop",
        "AllowIsolate",
        "IgnoreOnIsolate",
        "DefaultDependencies",
        "CoredumpReceive",
        "MemoryZSwapWriteback",
        "BindLogSockets",
        "StateDirectoryAccounting",
        "CacheDirectoryAccounting",
        "LogsDirectoryAccounting",
        "PermissionsStartOnly",
        "RootDirectoryStartOnly",
        "GuessMainPID",
        "SurviveFinalKillSignal",
        "CPUAffinityFromNUMA",
        "AddRef",  # no table of systemd-run's, but the manager reads a boolean
    }
)
#: The boolean properties systemd 257 gave a string twin for its other
#: values (``PrivateUsers=self`` goes as ``PrivateUsersEx``).
EX_TWINS = {
    name: f"{name}Ex" for name in ("PrivateUsers", "PrivateTmp", "ProtectControlGroups")
}
#: Converted properties whose words sdexec passes on as given, for systemd
#: to judge: a bad one (``SystemCallFilter = "read:EPERM"``, an errno in a
#: list of what a unit may use; an architecture it does not know) it
#: refuses with a bare "Invalid argument", naming nothing, which
#: :mod:`sdexec.systemd.errors` names then (:func:`shown_value`).
JUDGED_LISTS = frozenset(
    {"SystemCallFilter", "SystemCallLog", "SystemCallArchitectures"}
)
#: Lists of what a unit may use, led by ``~`` for what it may not
#: (``SystemCallFilter = "~@mount @clock"``): ``(bas)``, as systemd-run sends
#: them.
ALLOW_OR_DENY_PROPERTIES = frozenset(
    {
        "SystemCallFilter",
        "SystemCallLog",
        "RestrictAddressFamilies",
        "RestrictFileSystems",
        "RestrictNetworkInterfaces",
    }
)
#: File modes (octal, at most 07777), sent as systemd-run sends them: ``u``.
MODE_PROPERTIES = frozenset(
    {
        "UMask",
        "RuntimeDirectoryMode",
        "StateDirectoryMode",
        "CacheDirectoryMode",
        "LogsDirectoryMode",
        "ConfigurationDirectoryMode",
    }
)
#: Unsigned 64-bit properties that also accept ``infinity``.
UINT64_PROPERTIES = frozenset(
    {
        "TimeoutStopUSec",
        "TimeoutStartUSec",
        "RuntimeMaxUSec",
        "CPUQuotaPerSecUSec",
        "CPUWeight",
        "StartupCPUWeight",
        "IOWeight",
        "StartupIOWeight",
        "TasksMax",
        "RestartMaxDelayUSec",
        "TimeoutAbortUSec",
        "RuntimeRandomizedExtraUSec",
        "WatchdogUSec",
        "JobRunningTimeoutUSec",
        "StartLimitIntervalUSec",
        "LogRateLimitIntervalUSec",
        "CPUQuotaPeriodUSec",
        "MemoryPressureThresholdUSec",
        "ManagedOOMMemoryPressureDurationUSec",
        "TimerSlackNSec",
    }
)
#: Resource limits (``setrlimit``), each typed ``t``, in bytes where the
#: resource is a size (``64K`` taken, as in a unit's file).
RLIMIT_SIZES = frozenset(
    {"FSIZE", "DATA", "STACK", "CORE", "RSS", "AS", "MEMLOCK", "MSGQUEUE"}
)
RLIMITS = RLIMIT_SIZES | {
    "CPU",
    "NOFILE",
    "NPROC",
    "LOCKS",
    "SIGPENDING",
    "NICE",
    "RTPRIO",
    "RTTIME",
}
#: What a limit takes over D-Bus where a unit file's spelling differs.
_RLIMIT_UNITS = {
    "CPU": "seconds, a number (a unit file's 1h is 3600 here)",
    "RTTIME": "microseconds, a number (a unit file's 1s is 1000000 here)",
    "NICE": "the rlimit itself, 0 to 40 (a unit file's nice level -5 is 25 here)",
}
#: Path lists, typed ``as``: whitespace-separated, quoted as a shell would.
PATH_LIST_PROPERTIES = frozenset(
    {
        "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "ExecPaths",
        "NoExecPaths", "ExtensionDirectories",
        # the older names of the first three, which systemd still takes
        "ReadOnlyDirectories", "ReadWriteDirectories", "InaccessibleDirectories",
    }
)  # fmt: skip
#: Directories the manager makes for the unit, typed ``as``: names below
#: its own directory for each, separated by spaces.
DIRECTORY_PROPERTIES = frozenset(
    {
        "ConfigurationDirectory",
        "StateDirectory",
        "RuntimeDirectory",
        "CacheDirectory",
        "LogsDirectory",
    }
)
#: Dependencies on other units, typed ``as``: unit names separated by
#: spaces (systemd.unit(5); ``systemd-run -p After=...`` sends them so).
DEPENDENCY_PROPERTIES = frozenset(
    {
        "Requires", "Requisite", "Wants", "BindsTo", "PartOf", "Upholds",
        "Conflicts", "Before", "After", "OnFailure", "OnSuccess",
        "PropagatesReloadTo", "ReloadPropagatedFrom", "PropagatesStopTo",
        "StopPropagatedFrom", "JoinsNamespaceOf",
    }
)  # fmt: skip
#: syslog's levels, as systemd's log_level_from_string reads them.
_LOG_LEVELS = {
    "emerg": 0, "alert": 1, "crit": 2, "err": 3,
    "warning": 4, "notice": 5, "info": 6, "debug": 7,
}  # fmt: skip
#: Integer properties, typed ``i``: the names a unit's file may give
#: instead of a number, and the numbers systemd takes.
INTEGER_PROPERTIES: dict[str, tuple[dict[str, int], range]] = {
    "Nice": ({}, range(-20, 20)),
    "OOMScoreAdjust": ({}, range(-1000, 1001)),
    "CPUSchedulingPolicy": (
        {"other": 0, "fifo": 1, "rr": 2, "batch": 3, "idle": 5},
        range(0, 0),  # only the policies named, by name or number
    ),
    "CPUSchedulingPriority": ({}, range(0, 100)),
    "IOSchedulingClass": (
        {"none": 0, "realtime": 1, "best-effort": 2, "idle": 3},
        range(0, 4),
    ),
    "IOSchedulingPriority": ({}, range(0, 8)),
    "NUMAPolicy": (
        {"default": 0, "preferred": 1, "bind": 2, "interleave": 3, "local": 4},
        range(0, 0),
    ),
    **dict.fromkeys(("LogLevelMax", "SyslogLevel"), (_LOG_LEVELS, range(0, 8))),
}

#: String settings with levels, loosest first (a boolean is ``no`` or
#: ``yes``): systemd refuses any other value for every job, and a request
#: may only raise one (sdexec.policy).
LEVELS = {
    "ProtectSystem": ("no", "yes", "full", "strict"),
    # tmpfs hides the homes as yes does, but lets the job write a scratch
    "ProtectHome": ("no", "read-only", "tmpfs", "yes"),
}

#: The three fds of the process, passed by the systemd layer.
FD_PROPERTIES = (
    "StandardInputFileDescriptor",
    "StandardOutputFileDescriptor",
    "StandardErrorFileDescriptor",
)
#: What resource containment sets (sdexec.map's mappers, the CPU fence).
CONTAINMENT_PROPERTIES = frozenset(
    {"AllowedCPUs", "AllowedMemoryNodes", "DeviceAllow", "DevicePolicy"}
)
#: What the stop timer relies on: systemd must not kill or time out the
#: unit's processes on its own while the timer escalates.
STOP_PROPERTIES = frozenset({"KillMode", "SendSIGKILL", "TimeoutStopUSec"})

_UNSIGNED = re.compile(r"[0-9]+")
_SIGNED = re.compile(r"[-+]?[0-9]+")


class PropertyError(ValueError):
    """A property value that cannot be converted; the message names it,
    ``label`` names it, ``reason`` is the message without the name."""

    def __init__(self, label: str, reason: str) -> None:
        super().__init__(f"{label}: error setting property: {reason}")
        self.label = label
        self.reason = reason


@dataclass(frozen=True)
class UnitProperty:
    """One ``StartTransientUnit`` property: ``name``, its D-Bus type
    ``signature`` and the ``value`` in the Python form dbus-fast takes for
    that signature. ``source`` says where it came from (``sdexec``,
    ``config``, ``request``, ``containment``) for error messages; it is not
    part of the property's identity."""

    name: str
    signature: str
    value: Any
    source: str = field(default="sdexec", compare=False)


def parse_mode(text: str) -> int:
    """A file mode as systemd reads one: octal digits, at most 07777."""
    if not text or not text.isascii() or any(c not in "01234567" for c in text):
        raise ValueError(
            f"{quoted(text, SHOWN)} is not a file mode (octal digits: 0022, 0755)"
        )
    mode = int(text[:_MAX_DIGITS], 8)
    if len(text) > _MAX_DIGITS or mode > 0o7777:
        raise ValueError(
            f"{quoted(text, SHOWN)} is beyond 07777, the largest file mode"
        )
    return mode


#: More digits than any property's integer has: refused as out of range
#: before int() refuses them in words about Python's own settings.
_MAX_DIGITS = 40


def _integer(text: str, pattern: re.Pattern[str]) -> int:
    # int() alone would also take "1_000" and non-ASCII digits.
    if pattern.fullmatch(text.strip()) is None:
        raise ValueError(f"{quoted(text, SHOWN)} is not a decimal integer")
    if len(text.strip().lstrip("+-").lstrip("0")) > _MAX_DIGITS:
        raise ValueError(f"{quoted(text, SHOWN)} is out of range")
    return int(text)


def parse_integer(text: str) -> int:
    """A signed decimal integer as a unit file writes it (``ValueError``
    otherwise): ``int()`` alone would also take ``1_000`` and fullwidth or
    other non-ASCII digits, which systemd refuses."""
    return _integer(text, _SIGNED)


def _uint64_or_infinity(text: str) -> int:
    if text.strip() == "infinity":
        return UINT64_MAX
    value = _integer(text, _UNSIGNED)
    if value >= UINT64_MAX:
        raise ValueError(f"{quoted(text, SHOWN)} is out of range")
    return value


#: The largest CPU quota systemd reads back from the unit's file (measured
#: on systemd 252): 21474836%, in microseconds a second.
_CPU_QUOTA_MAX = 214_748_360_000
#: What it writes there of a CPU quota: whole percents (10000 µs a second).
_CPU_QUOTA_STEP = 10_000


#: systemd's range for these (its D-Bus setters refuse a value outside it:
#: "Value specified in TasksMax is out of range"), ``infinity`` aside, and
#: how to say it. A CPU weight of 0 is ``idle``. The request policy ranks
#: weights within the same ranges (``sdexec.policy``).
RANGES: dict[str, tuple[int, int, str]] = {
    # systemd writes the quota into the unit's file in whole percents (its
    # unit-file parser takes no other): below 1%, as CPUQuota=0%, which a
    # daemon-reload ignores, leaving the unit without any quota; above
    # 21474836% (ten-thousandths past a signed 32-bit number), which it
    # ignores too.
    "CPUQuotaPerSecUSec": (
        10_000,
        _CPU_QUOTA_MAX,
        f"10000 (1%) to {_CPU_QUOTA_MAX}, or infinity (it writes whole percents"
        " into the unit's file: a daemon-reload drops a quota below 1% or"
        " above 21474836%)",
    ),
    "TasksMax": (1, UINT64_MAX - 1, "1 or more, or infinity"),
    **dict.fromkeys(
        ("CPUWeight", "StartupCPUWeight"), (0, 10000, "1 to 10000, or 0 (idle)")
    ),
    **dict.fromkeys(("IOWeight", "StartupIOWeight"), (1, 10000, "1 to 10000")),
    "ManagedOOMMemoryPressureDurationUSec": (
        1_000_000,
        UINT64_MAX - 1,
        "1000000 (a second) or more, or infinity",
    ),
}
#: The weights whose 0 systemd also names ``idle``.
_CPU_WEIGHTS = frozenset({"CPUWeight", "StartupCPUWeight"})
#: Memory limits systemd takes from 1 byte, where 0 would be no memory at all.
_NONZERO_MEMORY = frozenset(
    {"MemoryMax", "MemoryHigh", "StartupMemoryMax", "StartupMemoryHigh"}
)


#: The time spans systemd writes into the unit's file to the microsecond;
#: every other ``…USec`` it writes to the millisecond (its
#: bus_set_transient_usec: on systemd 252 a ``RuntimeMaxUSec`` of 1000001
#: reads back as 1000000). The CPU quota it writes as a percentage.
_MICROSECOND_SPANS = frozenset({"CPUQuotaPeriodUSec"})
#: systemd writes ``TimerSlackNSec`` as a number, and reads it back as a
#: signed 64-bit one: a larger one is dropped at a daemon-reload.
_INT64_MAX = 2**63 - 1


def _read_back_problem(name: str, value: int) -> str | None:
    """Why systemd would not keep ``name``'s finite ``value`` (a time span,
    a CPU quota) as sent across a daemon-reload, or apply it as a unit
    file's would; ``None`` if it would."""
    if name == "TimerSlackNSec" and value > _INT64_MAX:
        return (
            "is out of range: a daemon-reload reads back no TimerSlackNSec"
            f" above {_INT64_MAX}"
        )
    if name == "CPUQuotaPerSecUSec":
        return _cpu_quota_problem(value)
    if not name.endswith("USec"):
        return None
    if name == "TimeoutStartUSec" and value == 0:
        # Over D-Bus 0 is a timeout of none at all; a unit file's 0 is
        # infinity, and so is what a daemon-reload reads back.
        return (
            "times every start out at once (systemd 252: a unit file's 0 is no"
            " timeout, and a daemon-reload reads it back so): give infinity"
            " for none"
        )
    return values.time_span_problem(value, name not in _MICROSECOND_SPANS)


def _cpu_quota_problem(value: int) -> str | None:
    """Why a CPU quota (µs a second, in range) would read back otherwise."""
    if value % _CPU_QUOTA_STEP == 0:
        return None
    kept = value - value % _CPU_QUOTA_STEP
    return (
        "is not a whole percent (10000 µs a second): systemd writes the quota"
        " into the unit's file in whole percents, and a daemon-reload would"
        f" make it {kept} ({kept // _CPU_QUOTA_STEP}%)"
    )


def _uint64_in_range(name: str, text: str) -> UnitProperty:
    if name in _CPU_WEIGHTS and text.strip() == "idle":
        return UnitProperty(name, "t", 0)
    value = _uint64_or_infinity(text)
    if value == UINT64_MAX:
        return UnitProperty(name, "t", value)
    low, high, takes = RANGES.get(name, (0, UINT64_MAX, ""))
    if not low <= value <= high:
        raise ValueError(
            f"{quoted(text, SHOWN)} is out of range: systemd takes {takes}"
        )
    problem = _read_back_problem(name, value)
    if problem is not None:
        raise ValueError(f"{quoted(text, SHOWN)} {problem}")
    return UnitProperty(name, "t", value)


def _memory(name: str, text: str) -> UnitProperty:
    limit = MemoryLimit.parse(text)
    if name in _NONZERO_MEMORY and 0 in (limit.bytes, limit.permyriad):
        raise ValueError(
            f"{quoted(text, SHOWN)} is out of range: systemd takes {name} from 1 byte"
            " (infinity for none)"
        )
    if limit.scale is not None:
        return UnitProperty(f"{name}Scale", "u", limit.scale)
    return UnitProperty(name, "t", UINT64_MAX if limit.infinite else limit.bytes)


def _tasks_max(name: str, text: str) -> UnitProperty:
    """``TasksMax``: a number or ``infinity``. Not a percentage, which
    systemd-run sends as ``TasksMaxScale``: systemd writes that into the
    unit's file as about a tenth of itself (systemd issue #41009, fixed in
    2026), and a ``daemon-reload`` would cut every job's limit so."""
    if text.strip().endswith("%"):
        raise ValueError(
            f"{quoted(text, SHOWN)}: a percentage is not taken here: systemd writes"
            " it into"
            " the unit's file as about a tenth of itself (systemd issue #41009),"
            " which a daemon-reload then applies; give a number of tasks"
        )
    return _uint64_in_range(name, text)


def level_of(name: str, text: str) -> str:
    """``text`` as one of ``name``'s :data:`LEVELS` (a boolean as ``yes``
    or ``no``); ``ValueError`` naming them otherwise."""
    levels = LEVELS[name]
    word = text.strip()
    if word in levels:
        return word
    try:
        return "yes" if parse_bool(word) else "no"
    except ValueError:
        raise ValueError(
            f"{quoted(text, SHOWN)} is not one of {', '.join(levels)}"
        ) from None


def _level_text(name: str, text: str) -> str:
    level_of(name, text)  # checked, and sent as given
    return text


def _startup_memory(name: str, text: str) -> UnitProperty:
    typed = _memory(name, text)
    if typed.signature != "t":
        raise ValueError(
            f"{quoted(text, SHOWN)}: systemd takes {name} in bytes, not as a percentage"
        )
    return typed


def _device_allow(text: str) -> list[list[str]]:
    entries = []
    for entry in text.split(","):
        path, _, perms = entry.strip().partition(" ")
        perms = perms.strip()
        if not path or not perms or set(perms) - set("rwm"):
            raise ValueError(
                f"{quoted(entry.strip(), SHOWN)} is not 'PATH PERMS' (of r, w, m)"
            )
        entries.append([path, perms])
    return entries


Converter = Callable[[str, str], UnitProperty]


@dataclass(frozen=True)
class _Typed:
    """A converter of values to one D-Bus type: what ``parse`` makes of the
    text, sent with ``signature``."""

    signature: str
    parse: Callable[[str], object]

    def __call__(self, name: str, text: str) -> UnitProperty:
        return UnitProperty(name, self.signature, self.parse(text))


def _bool_or_twin(name: str) -> Callable[[str], bool]:
    """:func:`parse_bool`, whose refusal names the property that takes
    ``name``'s other values."""

    def parse(text: str) -> bool:
        try:
            return parse_bool(text)
        except ValueError as error:
            twin = EX_TWINS[name]
            why = f"{error}; its other values go in {twin} (systemd 257+)"
            raise ValueError(why) from None

    return parse


#: systemd refuses a CPU or NUMA node mask naming an id at or above this
#: (``CPU_SET_MAX_NCPU``, the largest CONFIG_NR_CPUS a kernel may have).
MASK_IDS = 8192


#: What separates the ids and ranges of a CPU or NUMA node list, to
#: systemd: commas, white space, or runs of both (``0, 2``).
_CPU_SET_SEPARATORS = re.compile(r"[\s,]+")


def cpu_set(text: str) -> IDset:
    """A CPU or NUMA node list (``AllowedCPUs``, ``AllowedMemoryNodes``) as
    systemd reads it: ids and ranges separated by commas, white space or
    both (``0-3,8``, ``0 2``, ``0, 2``); ``ValueError`` names what is
    wrong. Whatever reads a unit's fence back reads it so: systemd applies
    the set written any of those ways."""
    words = [word for word in _CPU_SET_SEPARATORS.split(text) if word]
    return IDset.decode(",".join(words))


def _bitmask(text: str) -> bytes:
    ids = cpu_set(text)
    if ids and ids.last() >= MASK_IDS:
        raise ValueError(
            f"{ids.last()} is beyond systemd's limit: ids must be below {MASK_IDS}"
        )
    return ids.bitmask()


def _rlimit(name: str, text: str) -> UnitProperty:
    """``Limit<RESOURCE>`` (the hard limit, and the soft one unless
    ``Limit<RESOURCE>Soft`` is given too) or ``Limit<RESOURCE>Soft``."""
    resource = name.removeprefix("Limit").removesuffix("Soft")
    if ":" in text:  # a pair's parts, or a Soft limit: one value each
        raise ValueError(
            f"{quoted(text, SHOWN)}: one value, or in Limit{resource} one"
            " soft:hard pair"
        )
    if text.strip() == "infinity":
        if resource == "NICE":
            raise ValueError(
                f"{quoted(text, SHOWN)} is not taken: a daemon-reload reads"
                " LimitNICE back"
                " from 0 to 40 alone (40 allows every nice level)"
            )
        return UnitProperty(name, "t", UINT64_MAX)
    if resource in RLIMIT_SIZES:
        return UnitProperty(name, "t", parse_size(text))
    hint = _RLIMIT_UNITS.get(resource)
    try:
        value = _integer(text, _UNSIGNED)
        most = _RLIMIT_MAXIMA.get(resource, UINT64_MAX - 1)
        if value > most:
            raise ValueError(
                f"{quoted(text, SHOWN)} is out of range: a daemon-reload reads back no"
                f" Limit{resource} above {most}"
            )
    except ValueError as error:
        raise ValueError(f"{error}{f': {hint}' if hint else ''}") from None
    return UnitProperty(name, "t", value)


def rlimit_pair(name: str, text: str) -> tuple[str, str] | None:
    """``(soft, hard)`` of a ``Limit<RESOURCE>=SOFT:HARD`` (systemd.exec(5)'s
    colon-separated pair, as a unit's file and ``systemd-run -p`` take it);
    ``None`` for any other property or value."""
    if name.removeprefix("Limit") not in RLIMITS or ":" not in text:
        return None
    soft, hard = text.split(":", 1)
    return soft, hard


def split_rlimit_pairs(
    properties: Mapping[str, str], source: str = "request"
) -> dict[str, str]:
    """``properties`` with each ``Limit<RESOURCE>=SOFT:HARD`` as the two
    properties D-Bus takes, ``Limit<RESOURCE>Soft=SOFT`` and
    ``Limit<RESOURCE>=HARD`` (a transient unit has no pair form).
    ``PropertyError`` naming the pair's property if a part is no limit, the
    soft one is above the hard one (systemd refuses the pair so), or
    ``Limit<RESOURCE>Soft`` is given too."""
    split: dict[str, str] = {}
    for name, text in properties.items():
        pair = rlimit_pair(name, text)
        if pair is None:
            split[name] = text
            continue
        _check_rlimit_pair(name, text, pair, source)
        if f"{name}Soft" in properties:
            raise PropertyError(
                property_label(name, source),
                f"{quoted(text, SHOWN)} sets the soft limit, and so does"
                f" {name}Soft: give one of them",
            )
        split[f"{name}Soft"], split[name] = pair
    return split


def _check_rlimit_pair(
    name: str, text: str, pair: tuple[str, str], source: str
) -> None:
    soft, hard = (typed_property(name, part, source).value for part in pair)
    if soft > hard:
        raise PropertyError(
            property_label(name, source),
            f"{quoted(text, SHOWN)}: the soft limit is above the hard one,"
            " which systemd refuses (and setrlimit at every start)",
        )


def property_label(name: str, source: str) -> str:
    """How a message names property ``name`` from ``source``
    (:attr:`UnitProperty.source`): as the request's option, or by name
    alone for the configuration's and sdexec's own."""
    return f"SDEXEC_PROP_{name}" if source == "request" else name


#: The largest finite limits systemd reads back from the unit's file, where
#: it writes each as a number; a larger one it drops at a daemon-reload
#: (measured on systemd 252). ``LimitCPU`` it reads as seconds, of which
#: 64 bits of microseconds hold no more; ``LimitRTTIME`` as a signed
#: number; ``LimitNICE`` as the rlimit, 0 to 40, and there no ``infinity``
#: (it read both back as 0).
_RLIMIT_MAXIMA = {"CPU": 18_446_744_073_708, "RTTIME": 2**63 - 1, "NICE": 40}


def _bounded_integer(name: str, text: str) -> UnitProperty:
    names, numbers = INTEGER_PROPERTIES[name]
    word = text.strip().lower()
    if word in names:
        return UnitProperty(name, "i", names[word])
    if names and not _SIGNED.fullmatch(word):
        raise ValueError(
            f"{quoted(text, SHOWN)} is none of {', '.join(names)}, or their numbers"
        )
    value = _integer(text, _SIGNED)
    if value not in numbers and value not in names.values():
        takes = ", ".join(names) if names else f"{numbers[0]} to {numbers[-1]}"
        raise ValueError(
            f"{quoted(text, SHOWN)} is out of range: systemd takes {takes}"
        )
    return UnitProperty(name, "i", value)


def _allow_or_deny(text: str) -> tuple[bool, list[str]]:
    """A list that allows what it names, or (led by ``~``) denies it, as
    systemd-run sends it: whether it allows, and the names."""
    allows = not text.startswith("~")
    return allows, _words(text if allows else text[1:])


#: Linux's capabilities by number (linux/capability.h), as systemd names
#: them.
_CAPABILITIES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill",
    "setgid", "setuid", "setpcap", "linux_immutable", "net_bind_service",
    "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
    "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct",
    "sys_admin", "sys_boot", "sys_nice", "sys_resource", "sys_time",
    "sys_tty_config", "mknod", "lease", "audit_write", "audit_control",
    "setfcap", "mac_override", "mac_admin", "syslog", "wake_alarm",
    "block_suspend", "audit_read", "perfmon", "bpf", "checkpoint_restore",
)  # fmt: skip


def _capabilities(text: str) -> int:
    """A capability set as systemd-run sends one: the bits of the names
    (``CAP_SYS_ADMIN CAP_NET_RAW``, any case, or numbers), all the others
    when led by ``~``; ``""``, none."""
    inverted = text.startswith("~")
    mask = 0
    words = text[1:] if inverted else text
    for word in values.literal_words(words) if words.strip() else []:  # the empty set
        mask |= 1 << _capability_number(word)
    return mask ^ UINT64_MAX if inverted else mask


def _capability_number(word: str) -> int:
    """A capability's number, from its name or the number itself."""
    if word.isascii() and word.isdigit() and int(word) < 64:
        return int(word)
    name = word.lower().removeprefix("cap_")
    if name not in _CAPABILITIES:
        raise ValueError(
            f"{quoted(word, SHOWN)} is no capability (CAP_SYS_ADMIN, CAP_NET_RAW…)"
        )
    return _CAPABILITIES.index(name)


def _address_families(text: str) -> tuple[bool, list[str]]:
    """:func:`_allow_or_deny` of address family names (``AF_UNIX``): the
    manager refuses a unit naming anything else, in words that name
    nothing (systemd-run's ``none`` among them)."""
    allows, families = _allow_or_deny(text)
    for family in families:
        if family not in _ADDRESS_FAMILIES:
            raise ValueError(
                f"{quoted(family, SHOWN)} is no address family systemd knows (AF_UNIX,"
                " AF_INET…, as linux/socket.h names them); to allow none, deny"
                " those a job could use (~AF_INET AF_INET6…)"
            )
    return allows, families


#: The address families systemd's af_from_name knows: the ``AF_`` names of
#: linux/socket.h (as glibc 2.36 defines them, aliases included), but
#: ``AF_UNSPEC`` and ``AF_MAX``. The manager refuses any other for every
#: job in words that name nothing ("Invalid argument").
_ADDRESS_FAMILIES = frozenset(
    {
        "AF_ALG", "AF_APPLETALK", "AF_ASH", "AF_ATMPVC", "AF_ATMSVC", "AF_AX25",
        "AF_BLUETOOTH", "AF_BRIDGE", "AF_CAIF", "AF_CAN", "AF_DECnet",
        "AF_ECONET", "AF_FILE", "AF_IB", "AF_IEEE802154", "AF_INET", "AF_INET6",
        "AF_IPX", "AF_IRDA", "AF_ISDN", "AF_IUCV", "AF_KCM", "AF_KEY", "AF_LLC",
        "AF_LOCAL", "AF_MCTP", "AF_MPLS", "AF_NETBEUI", "AF_NETLINK",
        "AF_NETROM", "AF_NFC", "AF_PACKET", "AF_PHONET", "AF_PPPOX",
        "AF_QIPCRTR", "AF_RDS", "AF_ROSE", "AF_ROUTE", "AF_RXRPC",
        "AF_SECURITY", "AF_SMC", "AF_SNA", "AF_TIPC", "AF_UNIX", "AF_VSOCK",
        "AF_WANPIPE", "AF_X25", "AF_XDP",
    }
)  # fmt: skip


def _words(text: str, none: str = "nothing named") -> list[str]:
    """The words of ``text``, unquoted as systemd-run unquotes a list's
    (``'a' "b"``), a backslash kept; ``ValueError(none)`` if it has none."""
    return values.literal_words(text, none)


_unit_list = partial(_words, none="no unit named")


def _path_list(text: str) -> list[str]:
    # A backslash is refused (values.shell_words): systemd writes the path
    # into the unit's file as it is, where its parser reads an escape.
    paths = values.shell_words(text, "no path given")
    for path in paths:
        # "-" (ignore if missing), then "+" (below RootDirectory), may lead.
        if not path.removeprefix("-").removeprefix("+").startswith("/"):
            raise ValueError(f"{quoted(path, SHOWN)} is not an absolute path")
        if ".." in path.split("/"):
            # systemd takes it over D-Bus, but not from the unit's file: at
            # a daemon-reload the unit lost the whole list.
            raise ValueError(
                f"{quoted(path, SHOWN)}: a '..' in it, which systemd takes over"
                " D-Bus but not"
                " from the unit's file: a daemon-reload would drop the list"
            )
    return paths


def _condition(name: str, text: str) -> UnitProperty:
    """``ConditionPathExists=/run/ok`` (or an ``Assert…``) as systemd takes
    a transient unit's: one ``(type, trigger, negate, parameter)`` entry of
    its ``Conditions`` (``Asserts``) list, ``|`` then ``!`` leading the
    value as in a unit file (what ``systemd-run -p`` sends). systemd
    refuses the name itself, and an unknown type, naming it."""
    trigger = text.startswith("|")
    rest = text[1:] if trigger else text
    negate = rest.startswith("!")
    parameter = rest[1:] if negate else rest
    if not parameter:
        # A unit file's empty value resets the list; over D-Bus an entry
        # without one is refused for every job.
        raise ValueError(f"{quoted(text, SHOWN)}: no parameter to check")
    prefix = next(prefix for prefix in _GATES if name.startswith(prefix))
    if name[len(prefix) :] in _PATH_GATES and not parameter.startswith("/"):
        raise ValueError(f"{quoted(parameter, SHOWN)} is not an absolute path")
    return UnitProperty(_GATES[prefix], "a(sbbs)", [[name, trigger, negate, parameter]])


#: The name's prefix of a condition or an assertion, and the unit's list
#: it goes in (:func:`_condition`).
_GATES = {"Condition": "Conditions", "Assert": "Asserts"}
#: Those lists, as a unit's properties name them.
GATE_LISTS = frozenset(_GATES.values())
#: The conditions (and assertions) that check a path, which systemd
#: refuses for every job unless it is absolute (systemd.unit(5)).
_PATH_GATES = frozenset(
    {
        "PathExists", "PathExistsGlob", "PathIsDirectory", "PathIsSymbolicLink",
        "PathIsMountPoint", "PathIsReadWrite", "PathIsEncrypted",
        "DirectoryNotEmpty", "FileNotEmpty", "FileIsExecutable", "NeedsUpdate",
    }
)  # fmt: skip


def is_gate(name: str) -> bool:
    """Whether ``name`` is a condition or an assertion (``ConditionPathExists``,
    ``AssertPathExists``): systemd adds them up, and checks them before the
    unit starts. Not the lists they go in (``Conditions``)."""
    return name.startswith(tuple(_GATES)) and name not in GATE_LISTS


def _gate_list(name: str, text: str) -> UnitProperty:
    """``Conditions`` or ``Asserts`` given whole: systemd takes a list of
    typed entries there, never a string, and refuses it for every job."""
    prefix = next(prefix for prefix, listed in _GATES.items() if listed == name)
    raise ValueError(
        f"the list systemd builds of each {prefix}… property: give each as its"
        f' own ({prefix}PathExists = "/run/ok")'
    )


_CONVERTERS: dict[str, Converter] = {
    **{name: _Typed("b", parse_bool) for name in BOOLEAN_PROPERTIES - set(EX_TWINS)},
    **{name: _Typed("b", _bool_or_twin(name)) for name in EX_TWINS},
    **{name: _Typed("u", parse_mode) for name in MODE_PROPERTIES},
    **dict.fromkeys(UINT64_PROPERTIES, _uint64_in_range),
    "TasksMax": _tasks_max,
    **dict.fromkeys(INTEGER_PROPERTIES, _bounded_integer),
    **{f"Limit{r}{soft}": _rlimit for r in RLIMITS for soft in ("", "Soft")},
    **{name: _Typed("as", _path_list) for name in PATH_LIST_PROPERTIES},
    **{name: _Typed("as", _unit_list) for name in DEPENDENCY_PROPERTIES},
    **{name: _memory for name in MEMORY_PROPERTIES | SCALED_MEMORY_PROPERTIES},
    **{name: _startup_memory for name in STARTUP_MEMORY_PROPERTIES},
    **dict.fromkeys(
        (
            "AllowedCPUs",
            "AllowedMemoryNodes",
            "CPUAffinity",
            "NUMAMask",
            "StartupAllowedCPUs",
            "StartupAllowedMemoryNodes",
        ),
        _Typed("ay", _bitmask),
    ),
    "SupplementaryGroups": _Typed("as", _words),
    **dict.fromkeys(
        ALLOW_OR_DENY_PROPERTIES - {"RestrictAddressFamilies"},
        _Typed("(bas)", _allow_or_deny),
    ),
    "RestrictAddressFamilies": _Typed("(bas)", _address_families),
    **dict.fromkeys(
        ("CapabilityBoundingSet", "AmbientCapabilities"), _Typed("t", _capabilities)
    ),
    "DeviceAllow": _Typed("a(ss)", _device_allow),
    **{name: _Typed("s", partial(_level_text, name)) for name in LEVELS},
    **dict.fromkeys(GATE_LISTS, _gate_list),
    **dict.fromkeys(
        (
            "FileDescriptorStoreMax",
            "RestartSteps",
            "StartLimitBurst",
            "LogRateLimitBurst",
            "TTYRows",
            "TTYColumns",
        ),
        _Typed("u", values.parse_uint32),
    ),
    "ManagedOOMMemoryPressureLimit": _Typed(
        "u", lambda text: scale_from_permyriad(parse_permyriad(text))
    ),
    **dict.fromkeys(
        ("RestartKillSignal", "WatchdogSignal", "ReloadSignal"),
        _Typed("i", parse_signal),
    ),
    "SyslogFacility": _Typed("i", values.parse_syslog_facility),
    "SecureBits": _Typed("i", values.parse_secure_bits),
    "SystemCallErrorNumber": _Typed("i", values.parse_errno_or_kill),
    **dict.fromkeys(
        ("SuccessActionExitStatus", "FailureActionExitStatus"),
        _Typed("i", values.parse_action_exit_status),
    ),
    "CoredumpFilter": _Typed("t", values.parse_coredump_filter),
    "MountFlags": _Typed("t", values.parse_mount_propagation),
    "RestrictNamespaces": _Typed("t", values.parse_namespaces),
    "DelegateNamespaces": _Typed("t", partial(values.parse_namespaces, delegated=True)),
    "PassEnvironment": _Typed(
        "as", partial(values.parse_environment, assignments=False)
    ),
    "UnsetEnvironment": _Typed("as", values.parse_environment),
    **dict.fromkeys(DIRECTORY_PROPERTIES, _Typed("as", values.parse_directory_names)),
    **dict.fromkeys(
        (
            "SystemCallArchitectures",
            "Documentation",
            "Markers",
            "DisableControllers",
        ),
        _Typed("as", _words),
    ),
    **dict.fromkeys(
        ("RequiresMountsFor", "WantsMountsFor"),
        _Typed("as", values.parse_absolute_paths),
    ),
    "ExecSearchPath": _Typed("as", values.parse_search_path),
    **dict.fromkeys(
        ("IPIngressFilterPath", "IPEgressFilterPath"),
        _Typed("as", values.parse_one_path),
    ),
    "ImportCredential": _Typed("as", values.parse_one_word),
    **dict.fromkeys(
        (
            "IOReadBandwidthMax",
            "IOWriteBandwidthMax",
            "IOReadIOPSMax",
            "IOWriteIOPSMax",
        ),
        _Typed("a(st)", partial(values.parse_io_device_limits, value="size")),
    ),
    "IODeviceWeight": _Typed(
        "a(st)", partial(values.parse_io_device_limits, value="weight")
    ),
    "IODeviceLatencyTargetUSec": _Typed(
        "a(st)", partial(values.parse_io_device_limits, value="usec")
    ),
    **dict.fromkeys(
        ("BindPaths", "BindReadOnlyPaths"), _Typed("a(ssbt)", values.parse_bind_paths)
    ),
    "TemporaryFileSystem": _Typed("a(ss)", values.parse_temporary_file_systems),
    **dict.fromkeys(
        ("IPAddressAllow", "IPAddressDeny"), _Typed("a(iayu)", values.parse_ip_prefixes)
    ),
    "EnvironmentFiles": _Typed("a(sb)", values.parse_optional_path),
    **dict.fromkeys(
        ("AppArmorProfile", "SmackProcessLabel"),
        _Typed("(bs)", values.parse_with_ignore),
    ),
    "LogFilterPatterns": _Typed("a(bs)", values.parse_log_filter),
    **dict.fromkeys(
        ("SuccessExitStatus", "RestartPreventExitStatus", "RestartForceExitStatus"),
        _Typed("(aiai)", values.parse_exit_statuses),
    ),
    **dict.fromkeys(
        ("LoadCredential", "LoadCredentialEncrypted"),
        _Typed(
            "a(ss)",
            partial(values.parse_pair, what="ID:PATH (or an ID alone)", alone=True),
        ),
    ),
    "BPFProgram": _Typed("a(ss)", values.parse_bpf_program),
    "LogExtraFields": _Typed("aay", values.parse_log_extra_field),
    "ProtectHostnameEx": _Typed("(ss)", values.parse_protect_hostname),
}
#: The D-Bus type of each property converted to one type alone (as
#: introspecting the manager shows it; not the memory sizes, which may go as
#: their ``…Scale``, nor the limits, weights and conditions).
CONVERTED_SIGNATURES = {
    name: convert.signature
    for name, convert in _CONVERTERS.items()
    if isinstance(convert, _Typed)
}
#: Lists a request may not replace where the site sets them (sdexec.plan):
#: systemd adds most of them up where a unit sets them more than once, and
#: the merge of a request's properties by name would replace the site's.
#: Every property sent as an array (but a bitmask, ``ay``), the
#: allow-or-deny lists, the exit statuses and the capability bounding set.
ADDED_UP = frozenset(
    name
    for name, signature in CONVERTED_SIGNATURES.items()
    if signature.startswith(("a", "(bas)", "(aiai)")) and signature != "ay"
) | {"CapabilityBoundingSet"}


#: The types of conditions and assertions systemd knows (systemd.unit(5),
#: up to v258), after ``Condition`` or ``Assert``.
_GATE_TYPES = _PATH_GATES | frozenset(
    {
        "Architecture", "Firmware", "Virtualization", "Host", "KernelCommandLine",
        "KernelVersion", "Version", "Credential", "Environment", "Security",
        "Capability", "ACPower", "FirstBoot", "User", "Group",
        "ControlGroupController", "Memory", "CPUs", "CPUFeature", "OSRelease",
        "MemoryPressure", "CPUPressure", "IOPressure", "KernelModuleLoaded",
    }
)  # fmt: skip
#: The names systemd takes as strings for a transient service over D-Bus
#: (the service-unit tables of systemd-run's ``-p``, systemd v258,
#: src/shared/bus-unit-util.c, as they go over D-Bus: a unit file's
#: ``TimeoutStopSec`` is ``TimeoutStopUSec`` there, ``CPUQuota``
#: ``CPUQuotaPerSecUSec``). sdexec sends them as given: what they take is
#: systemd's to judge.
STRING_PROPERTIES = frozenset(
    {
        # resource control (systemd.resource-control(5))
        "Slice", "ManagedOOMSwap", "ManagedOOMMemoryPressure",
        "ManagedOOMPreference", "MemoryPressureWatch", "DelegateSubgroup",
        "BindNetworkInterface",
        # execution (systemd.exec(5))
        "User", "Group", "UtmpIdentifier", "UtmpMode", "PAMName", "TTYPath",
        "WorkingDirectory", "RootDirectory", "SyslogIdentifier",
        "SELinuxContext", "RootImage",
        "RootVerity", "RuntimeDirectoryPreserve", "Personality", "KeyringMode",
        "ProtectProc", "ProcSubset", "NetworkNamespacePath",
        "UserNamespacePath", "IPCNamespacePath", "LogNamespace",
        "RootImagePolicy", "MountImagePolicy", "ExtensionImagePolicy",
        "PrivatePIDs", "PrivateBPF", "BPFDelegateCommands", "BPFDelegateMaps",
        "BPFDelegatePrograms", "BPFDelegateAttachments", "MemoryTHP",
        "RootHashPath", "RootHashSignaturePath",
        "StandardInputFile", "StandardOutputFile", "StandardOutputFileToAppend",
        "StandardOutputFileToTruncate", "StandardErrorFile",
        "StandardErrorFileToAppend", "StandardErrorFileToTruncate",
        "StandardInputFileDescriptorName", "StandardOutputFileDescriptorName",
        "StandardErrorFileDescriptorName", "StandardInput", "StandardOutput",
        "StandardError",
        # what systemd 257 added for the booleans' other values (EX_TWINS)
        "PrivateTmpEx", "ProtectControlGroupsEx", "PrivateUsersEx",
        # killing (systemd.kill(5))
        "KillMode",
        # the service (systemd.service(5))
        "PIDFile", "Type", "ExitType", "Restart", "RestartMode", "BusName",
        "NotifyAccess", "USBFunctionDescriptors", "USBFunctionStrings",
        "OOMPolicy", "TimeoutStartFailureMode", "TimeoutStopFailureMode",
        "FileDescriptorStorePreserve",
        # the unit (systemd.unit(5))
        "Description", "SourcePath", "OnFailureJobMode", "OnSuccessJobMode",
        "JobTimeoutAction", "JobTimeoutRebootArgument", "StartLimitAction",
        "FailureAction", "SuccessAction", "RebootArgument", "CollectMode",
    }
)  # fmt: skip
#: A unit's commands, after ``Exec`` (``ExecStartPre``) and before ``Ex``.
_COMMANDS = (
    "Condition", "StartPre", "Start", "StartPost", "Reload", "ReloadPost",
    "Stop", "StopPost",
)  # fmt: skip
#: Names systemd takes with a D-Bus type sdexec does not convert to: sent as
#: strings they would fail every job ("Unexpected message contents"), so
#: they are refused, naming the type. Those that sdexec itself sets (the
#: commands, the standard streams, the kill and restart signals) are
#: refused before, by the request policy and the configuration.
NOT_CONVERTED = {
    **{
        f"Exec{kind}{ex}": signature
        for kind in _COMMANDS
        for ex, signature in (("", "a(sasb)"), ("Ex", "a(sasas)"))
    },
    "StandardInputData": "ay",
    **dict.fromkeys(("KillSignal", "FinalKillSignal"), "i"),
    "RestartUSec": "t",
    "Environment": "as",
    "DelegateControllers": "as",
    **dict.fromkeys(("SetCredential", "SetCredentialEncrypted"), "a(say)"),
    "ImportCredentialEx": "a(ss)",
    **dict.fromkeys(("SocketBindAllow", "SocketBindDeny"), "a(iiqq)"),
    "NFTSet": "a(iiss)",
    "OpenFile": "a(sst)",
    **dict.fromkeys(("RootHash", "RootHashSignature"), "ay"),
    "RootImageOptions": "a(ss)",
    "MountImages": "a(ssba(ss))",
    "ExtensionImages": "a(sba(ss))",
    **{f"{kind}DirectoryQuota": "(tus)" for kind in ("State", "Cache", "Logs")},
    **{
        f"{kind}DirectorySymlink": "a(sst)"
        for kind in ("State", "Cache", "Logs", "Runtime")
    },
    "RefreshOnReload": "a(bs)",
}
#: cgroup v1's settings, which systemd-run no longer sends (systemd 256
#: dropped cgroup v1), and what cgroup v2 has for each.
CGROUP_V1_PROPERTIES = {
    "MemoryLimit": "MemoryMax",
    "CPUShares": "CPUWeight",
    "StartupCPUShares": "StartupCPUWeight",
    "BlockIOWeight": "IOWeight",
    "StartupBlockIOWeight": "StartupIOWeight",
    "BlockIODeviceWeight": "IODeviceWeight",
    "BlockIOReadBandwidth": "IOReadBandwidthMax",
    "BlockIOWriteBandwidth": "IOWriteBandwidthMax",
}
#: The percentage form of each limit that has one, by the limit's name:
#: sdexec sends it for ``MemoryMax = "50%"``, and takes it by no other name.
SCALE_PROPERTIES = {
    f"{name}Scale": name
    for name in (*MEMORY_PROPERTIES, *SCALED_MEMORY_PROPERTIES, "TasksMax")
}
#: Every property name systemd takes for a transient service over D-Bus
#: (conditions and assertions aside: :func:`is_known_property`).
KNOWN_PROPERTIES = (
    frozenset(_CONVERTERS)
    | frozenset(SCALE_PROPERTIES)
    | frozenset(FD_PROPERTIES)
    | CONTAINMENT_PROPERTIES
    | STOP_PROPERTIES
    | GATE_LISTS
    | STRING_PROPERTIES
    | frozenset(NOT_CONVERTED)
    | frozenset(CGROUP_V1_PROPERTIES)
)
#: A unit file's spelling whose D-Bus names are not its own with ``Sec``
#: as ``USec`` (:func:`_dbus_names`): ``TimeoutSec`` sets both timeouts.
_DBUS_SPELLINGS = {
    "CPUQuota": ("CPUQuotaPerSecUSec",),
    "TimeoutSec": ("TimeoutStartUSec", "TimeoutStopUSec"),
}
#: How far (in edits: a letter added, dropped, changed, or two swapped) a
#: name may be from a known one to be offered as what was meant; a name of
#: fewer than 8 letters, one edit. Farther, the closest is as likely a
#: different setting (``TimeoutSec`` is not ``JobTimeoutUSec``).
_MEANT_EDITS = 2


#: A word that may name a systemd D-Bus property: letters and digits. One
#: in the wrong case (``memorymax``) is then judged an unknown name, which
#: :func:`unknown_property_reason` answers with the name meant.
_PROPERTY_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")


def is_property_word(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a word that may name a property (known or not:
    :func:`unknown_property_reason` judges that), from the configuration
    or ``request-properties``."""
    return isinstance(name, str) and _PROPERTY_WORD.fullmatch(name) is not None


def is_known_property(name: str) -> bool:
    """Whether systemd knows ``name`` as a property of a transient service
    (or as a condition or an assertion, ``ConditionPathExists``)."""
    if is_gate(name):
        prefix = next(prefix for prefix in _GATES if name.startswith(prefix))
        return name[len(prefix) :] in _GATE_TYPES
    return name in KNOWN_PROPERTIES


def unknown_property_reason(
    name: str, reserved: Callable[[str], bool] = lambda _name: False
) -> str | None:
    """Why ``name`` is no property systemd knows, with what was likely
    meant: a unit file's spelling of it is named by its D-Bus one
    (``RuntimeMaxSec``: ``RuntimeMaxUSec``), saying which of those are
    ``reserved``; else a known name a typo away; ``None`` if it is one.
    systemd refuses a unit with such a property (``Cannot set property …,
    or unknown property``): from the configuration, every job would fail."""
    if is_known_property(name):
        return None
    hint = _spelling_hint(name, reserved)
    if hint is None:
        close = _closest_property(name)
        hint = f"did you mean {close}?" if close else None
    said = f" ({hint})" if hint else ""
    return f"unknown property: systemd would refuse every unit with it{said}"


def _dbus_names(name: str) -> tuple[str, ...]:
    """What a unit file's ``name`` is over D-Bus; ``()`` if it is none."""
    if name in _DBUS_SPELLINGS:
        return _DBUS_SPELLINGS[name]
    dbus = name.removesuffix("Sec") + "USec"
    return (dbus,) if name.endswith("Sec") and dbus in KNOWN_PROPERTIES else ()


def _spelling_hint(name: str, reserved: Callable[[str], bool]) -> str | None:
    names = _dbus_names(name)
    if not names:
        return None
    settable = " and ".join(n for n in names if not reserved(n))
    held = [n for n in names if reserved(n)]
    if not held:
        return f"did you mean {settable}?"
    said = (
        f"a unit file's {name} is {' and '.join(names)} over D-Bus, and"
        f" {' and '.join(held)} {'is' if len(held) == 1 else 'are'} reserved"
    )
    return f"did you mean {settable}? {said}" if settable else said


def _closest_property(name: str) -> str | None:
    """The known name fewest edits from ``name`` (case aside), if it is
    near enough (:data:`_MEANT_EDITS`)."""
    gates = (f"{prefix}{kind}" for prefix in _GATES for kind in _GATE_TYPES)
    most = _MEANT_EDITS if len(name) >= 8 else 1
    # Names whose lengths differ by more are farther: skipping them keeps a
    # request's megabyte-long name from costing minutes of edits.
    near = [
        (_edits(name.lower(), known.lower()), known)
        for known in (*KNOWN_PROPERTIES, *gates)
        if abs(len(known) - len(name)) <= most
    ]
    edits, close = min(near, default=(most + 1, None))
    return close if edits <= most else None


def _edits(a: str, b: str) -> int:
    """The edits between ``a`` and ``b``: letters added, dropped or
    changed, and two neighbours swapped (``MemroyMax``: one)."""
    rows = [list(range(len(b) + 1))]  # rows[i][j]: a[:i] to b[:j]
    for i, letter in enumerate(a, 1):
        above, row = rows[-1], [i]
        for j, other in enumerate(b, 1):
            edits = min(above[j] + 1, row[j - 1] + 1, above[j - 1] + (letter != other))
            if i > 1 and j > 1 and (letter, a[i - 2]) == (b[j - 2], other):
                edits = min(edits, rows[-2][j - 2] + 1)
            row.append(edits)
        rows.append(row)
    return rows[-1][-1]


#: The policies whose threads have a real-time priority (1 to 99).
_REAL_TIME_POLICIES = frozenset({1, 2})  # fifo, rr


def properties_together_problem(
    properties: Mapping[str, str],
) -> tuple[tuple[str, ...], str] | None:
    """``(names, why)`` for properties systemd refuses together, or cannot
    apply at the job's start (each valid alone), the one at fault first;
    ``None`` if there are none. A priority needs its policy, and a
    soft limit its hard one (over D-Bus, a soft limit given alone sets the
    hard limit to the same value)."""
    return (
        _priority_problem(properties)
        or _numa_problem(properties)
        or next(
            filter(None, (_rlimit_problem(properties, r) for r in _RLIMIT_ORDER)),
            None,
        )
    )


#: NUMA policies by number (``NUMAPolicy``): those that need ``NUMAMask``,
#: and the one whose mask must name a single node.
_NUMA_NEEDS_MASK = {2: "bind", 3: "interleave"}
_NUMA_PREFERRED = 1


def _numa_problem(
    properties: Mapping[str, str],
) -> tuple[tuple[str, ...], str] | None:
    """A NUMA policy systemd cannot apply at the job's start (every start
    fails with 242/NUMA_POLICY, systemd's numa_policy_is_valid)."""
    policy, mask = _value("NUMAPolicy", properties), _value("NUMAMask", properties)
    if policy in _NUMA_NEEDS_MASK and not mask:
        name = _NUMA_NEEDS_MASK[policy]
        why = f"NUMAPolicy {name} needs NUMAMask (the nodes to {name})"
    elif policy == _NUMA_PREFERRED and mask and sum(map(int.bit_count, mask)) != 1:
        why = "NUMAPolicy preferred takes one node in NUMAMask"
    else:
        return None
    return (
        "NUMAPolicy",
        "NUMAMask",
    ), f"{why}: systemd fails every start with 242/NUMA_POLICY"


#: The limits in the order their problems are told (every exec asks).
_RLIMIT_ORDER = tuple(sorted(RLIMITS))


def _value(name: str, properties: Mapping[str, str]) -> Any:
    """The typed value of ``name`` in ``properties``, or ``None`` if it is
    not there or not valid (which its own check says)."""
    if name not in properties:
        return None
    try:
        return typed_property(name, properties[name]).value
    except ValueError:
        return None


def _priority_problem(
    properties: Mapping[str, str],
) -> tuple[tuple[str, ...], str] | None:
    priority = _value("CPUSchedulingPriority", properties)
    if priority is None:
        return None
    policy = _value("CPUSchedulingPolicy", properties)
    if policy is None and "CPUSchedulingPolicy" in properties:
        return None  # a policy that is not one: its own check says so
    policy = policy or 0
    if policy in _REAL_TIME_POLICIES and priority == 0:
        why = "0 is no priority of the fifo and rr policies, which take 1 to 99"
    elif policy not in _REAL_TIME_POLICIES and priority != 0:
        why = (
            f"{priority} needs CPUSchedulingPolicy fifo or rr (other, the"
            " default, batch and idle take 0 alone)"
        )
    else:
        return None
    return ("CPUSchedulingPriority", "CPUSchedulingPolicy"), why


def _rlimit_problem(
    properties: Mapping[str, str], resource: str
) -> tuple[tuple[str, ...], str] | None:
    hard_name, soft_name = f"Limit{resource}", f"Limit{resource}Soft"
    soft = _value(soft_name, properties)
    if soft is None:
        return None
    if hard_name not in properties:
        return (soft_name,), (
            f"give {hard_name} too: over D-Bus a soft limit alone sets the hard"
            " limit to the same value"
        )
    hard = _value(hard_name, properties)
    if hard is not None and soft > hard:
        why = (
            f"{soft_name}={properties[soft_name]} above {hard_name}="
            f"{properties[hard_name]}, which setrlimit refuses at every start"
        )
        return (soft_name, hard_name), why
    return None


def string_typed_problem(name: str) -> str | None:
    """Why ``name``, which sdexec does not convert, cannot go to systemd as
    a string, whatever its value; ``None`` if it can."""
    if name in NOT_CONVERTED:
        return (
            f"systemd takes it as D-Bus {NOT_CONVERTED[name]}, which sdexec does"
            " not convert to (sent as a string, it would fail every job)"
        )
    if name in CGROUP_V1_PROPERTIES:
        return (
            "a cgroup v1 setting, which systemd 256 dropped and systemd-run no"
            f" longer sends: set {CGROUP_V1_PROPERTIES[name]} instead"
        )
    if name == "TasksMaxScale":
        return "the D-Bus form of a percentage TasksMax: give TasksMax a number"
    if name in SCALE_PROPERTIES:
        limit = SCALE_PROPERTIES[name]
        return (
            f"the D-Bus form of a percentage {limit}, which systemd takes as a"
            f' fraction of 2^32-1: write {limit} = "50%" instead, which sdexec'
            " sends so"
        )
    return None


#: What systemd's unit-file parser reads each of these characters as.
_READ_AS = {
    " ": "a space between entries",
    "\t": "a space between entries",
    '"': "a quote",
    "'": "a quote",
    "%": "a specifier (%h: the home directory)",
}
#: What ends an entry, or quotes one, where systemd writes entries unquoted.
_UNQUOTED = " \t\"'"
#: Characters systemd 252 writes into the unit's file as they are in these
#: settings, where its parser then reads them otherwise at a daemon-reload
#: (measured: an entry of ReadOnlyPaths or RuntimeDirectory with a '"' was
#: gone, a BindPaths or RequiresMountsFor path with a space became two, a
#: DeviceAllow /dev/%h became /dev/root). The path lists it writes quoted.
_UNREAD_CHARACTERS = {
    **dict.fromkeys(PATH_LIST_PROPERTIES | DIRECTORY_PROPERTIES, '"'),
    **dict.fromkeys(
        ("BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem"), _UNQUOTED
    ),
    "SupplementaryGroups": " \t",
    "DeviceAllow": "\"'%",
    "Documentation": _UNQUOTED + "%",
    **dict.fromkeys(("RequiresMountsFor", "WantsMountsFor"), _UNQUOTED + "%"),
    **dict.fromkeys(("IPIngressFilterPath", "IPEgressFilterPath"), "%"),
}


def _strings(value: Any) -> Iterator[str]:
    """The strings of a converted value, however nested in lists."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _unread_problem(typed: UnitProperty) -> str | None:
    """Why systemd would read ``typed`` back otherwise from the unit's file
    (:data:`_UNREAD_CHARACTERS`), or ``None``."""
    unread = _UNREAD_CHARACTERS.get(typed.name, "")
    for text in _strings(typed.value) if unread else ():
        found = next((char for char in text if char in unread), None)
        if found is not None:
            return (
                f"{quoted(text, SHOWN)}: systemd writes {quoted(found, SHOWN)} into"
                " the unit's file as it"
                f" is, where a daemon-reload reads it as {_READ_AS[found]}"
            )
    return None


def _edge_space_problem(value: str) -> str | None:
    """Why systemd would read the string ``value`` back otherwise from the
    unit's file, where its parser strips a value's spaces: a
    ``SyslogIdentifier`` of " x " came back as "x", a ``PIDFile`` of "x "
    as "x"."""
    if value == value.strip(" \t"):
        return None
    return (
        f"{quoted(value, SHOWN)}: a space at its start or end, which systemd writes"
        " into"
        " the unit's file and a daemon-reload drops"
    )


def shown_value(prop: UnitProperty) -> str:
    """``prop``'s value as a message shows it: a string as it is, a list's
    words separated by spaces, led by ``~`` for a list of what the unit may
    not use (``(bas)``)."""
    if prop.signature == "(bas)":
        allows, words = prop.value
        return ("" if allows else "~") + " ".join(words)
    if prop.signature == "as":
        return " ".join(prop.value)
    return str(prop.value)


def typed_property(name: str, value: str, source: str = "request") -> UnitProperty:
    """The :class:`UnitProperty` for ``StartTransientUnit``.

    The name may change: a percentage memory limit ``MemoryMax=95%`` becomes
    ``MemoryMaxScale``, as systemd itself encodes it. ``PropertyError``
    (``SDEXEC_PROP_<name>: error setting property: <why>`` for a request's
    property) if the value cannot be converted, or if systemd could not
    keep it in the unit's file: not one line
    (:func:`~sdexec.unitfile.unit_file_problem`),
    or too long a line (:data:`~sdexec.unitfile.MAX_UNIT_LINE`).
    """
    convert = _CONVERTERS.get(name)
    if convert is None and is_gate(name):
        convert = _condition
    try:
        problem = unit_file_problem(value) or value_line_problem(value)
        if problem is not None:
            raise ValueError(problem)
        if convert is None:
            problem = string_typed_problem(name) or _edge_space_problem(value)
            if problem is not None:
                raise ValueError(problem)
            typed = UnitProperty(name, "s", value)
        else:
            typed = convert(name, value)
            problem = _unread_problem(typed)
            if problem is not None:
                raise ValueError(problem)
    except ValueError as error:
        raise PropertyError(property_label(name, source), str(error)) from None
    return UnitProperty(typed.name, typed.signature, typed.value, source)
