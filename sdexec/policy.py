"""What a request may ask of its unit: properties, and the environment.

**Properties.** A request sets unit properties with ``SDEXEC_PROP_<Name>``
options. Only the names in ``[sdexec] request-properties``
(:data:`CONFIG_KEY`) are accepted; the default, :data:`DEFAULT_ALLOWED`, is
a set that can only *tighten* the unit. For the properties whose values are
ordered (:data:`TIGHTENING`), a request's value is accepted only if it is at
most as permissive as the value the unit would get without it: the
*baseline*, i.e. what ``[exec.sdexec-properties]`` and the mapper set, else
systemd's default. ``MemoryMax=infinity`` or ``CPUWeight=10000`` over a
baseline of ``8G`` or ``100`` is refused. Some names can never be allowed,
not even by the admin (:data:`NEVER_ALLOWED`): identity, lifecycle, the
device and CPU fences, and the properties sdexec sets itself; a request
may only repeat the value sdexec gives every unit (:data:`SDEXEC_FIXED`,
``TimeoutStopUSec=infinity``), which changes nothing. Refusals are
``EPERM`` naming the property and the key; a value that does not parse is
``EINVAL``, as is a name systemd does not know (``CPUQuota``,
``MemoryMaxx``): no admin could allow it. Containment still wins: the
mapper's properties are merged after the request's, as before.

The environment a request passes on is cleaned by :mod:`sdexec.environment`.
"""

from __future__ import annotations

import errno
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from sdexec import nodememory
from sdexec.command import OWN_PROPERTIES
from sdexec.limits import check_text
from sdexec.property import (
    CONTAINMENT_PROPERTIES,
    FD_PROPERTIES,
    LEVELS,
    RANGES,
    RLIMIT_SIZES,
    RLIMITS,
    STOP_PROPERTIES,
    UINT64_MAX,
    PropertyError,
    is_property_word,
    level_of,
    parse_bool,
    rlimit_pair,
    split_rlimit_pairs,
    string_typed_problem,
    typed_property,
    unknown_property_reason,
)
from sdexec.propertyvalues import parse_io_device_limits
from sdexec.refusal import SHOWN, RequestRefused, json_quoted, printable, quoted
from sdexec.sizes import MEMORY_LIMIT_FORMS, MemoryLimit, SizeNotTaken, scaled_memory
from sdexec.unitstop import lifecycle_properties

__all__ = [
    "ALWAYS_ALLOWED",
    "CONFIG_KEY",
    "DEFAULTS_TOKEN",
    "DEFAULT_ALLOWED",
    "MAX_DESCRIPTION",
    "NEVER_ALLOWED",
    "SDEXEC_FIXED",
    "TIGHTENING",
    "Ordering",
    "RequestPolicy",
    "RequestPropertiesEntryError",
    "Setting",
    "never_allowed_reason",
    "parse_request_properties",
]

#: The configuration key that lists what a request may set.
CONFIG_KEY: Final = "[sdexec] request-properties"
#: Where the admin sets the properties every unit gets.
SITE_PROPERTIES_KEY: Final = "[exec.sdexec-properties]"
#: An entry of :data:`CONFIG_KEY` that stands for :data:`DEFAULT_ALLOWED`, so
#: a site can widen the default without restating it:
#: ``request-properties = ["@default", "Nice"]``.
DEFAULTS_TOKEN: Final = "@default"
#: The longest ``Description`` a request may set, in bytes. Older managers
#: formatted status lines with a long description into fixed buffers and
#: aborted (systemd issue #8211); sdexec's own is cut at 200 characters.
MAX_DESCRIPTION: Final = 1024

_LIFECYCLE = "lifecycle: sdexec stops, kills and reaps the unit itself"
_IDENTITY = "identity: every job runs as the service's own user"
_PRIVILEGE = "privilege: it grants the job capabilities its user lacks"
_FENCE = "a resource fence: containment sets it"
_CONTROLLERS = "it switches off the controllers that fence and cap the unit"
_SDEXEC = "sdexec sets it itself"

#: Properties no request may set, with the reason; :func:`parse_request_properties`
#: refuses them in the configuration too.
NEVER_ALLOWED: Final[Mapping[str, str]] = {
    # What sdexec sets, containment sets and the stop timer relies on (the
    # configuration's reserved list); a request may describe its unit.
    **dict.fromkeys((OWN_PROPERTIES | set(FD_PROPERTIES)) - {"Description"}, _SDEXEC),
    **dict.fromkeys(CONTAINMENT_PROPERTIES, _FENCE),
    **dict.fromkeys(STOP_PROPERTIES, _LIFECYCLE),
    **dict.fromkeys(
        ("User", "Group", "DynamicUser", "SupplementaryGroups", "PAMName"), _IDENTITY
    ),
    "AmbientCapabilities": _PRIVILEGE,
    **dict.fromkeys(
        (
            "Type",
            "KillMode",
            "KillSignal",
            "FinalKillSignal",
            "SendSIGKILL",
            "SendSIGHUP",
            "TimeoutStopUSec",
            "TimeoutStopFailureMode",
            "RemainAfterExit",
            "Restart",
            "RestartUSec",
            "CollectMode",
            "ExitType",
            "Slice",
            "Delegate",
            "DelegateControllers",  # delegates, as Delegate=yes
            "DelegateSubgroup",
            # A unit systemd stops on its own, or refuses to start or to
            # stop (sdexec stops every unit: RemainAfterExit), breaks the
            # lifecycle: every job stopped at once, or never released.
            "StopWhenUnneeded",
            "RefuseManualStart",
            "RefuseManualStop",
        ),
        _LIFECYCLE,
    ),
    **dict.fromkeys(
        (
            "AllowedCPUs",
            "StartupAllowedCPUs",
            "AllowedMemoryNodes",
            "StartupAllowedMemoryNodes",
            "CPUAffinity",
            "NUMAPolicy",
            "NUMAMask",
            "DeviceAllow",
            "DevicePolicy",
        ),
        _FENCE,
    ),
    "DisableControllers": _CONTROLLERS,
    **dict.fromkeys(
        ("Environment", "EnvironmentFiles", "PassEnvironment", "UnsetEnvironment"),
        "the environment is the command's env, cleaned by sdexec",
    ),
}
#: The :data:`NEVER_ALLOWED` properties every unit has at one value, whatever
#: the site, the mapper or the request: the lifecycle ones, applied after
#: every other source (:func:`sdexec.unitstop.lifecycle_properties`; the
#: configuration reserves them), and the type and ``RemainAfterExit`` that
#: :func:`sdexec.command.unit_properties` sets (reserved too). A request
#: asking for exactly that value, as systemd takes it, changes nothing and is
#: accepted, then dropped: Flux's job-exec sends ``TimeoutStopUSec=infinity``
#: with every multiuser job (its exec_cmd.c). Any other value is refused,
#: naming both.
SDEXEC_FIXED: Final[Mapping[str, str]] = {
    **lifecycle_properties(),
    "Type": "exec",
    "RemainAfterExit": "yes",
}
#: What a port of upstream job-exec's multiuser request (``KillMode=process``,
#: ``Type=notify``: the IMP as the unit's main process, signaled alone) must
#: know: sdexec's lifecycle has no IMP in it.
_UPSTREAM_MULTIUSER: Final = (
    "Flux's job-exec asks KillMode=process and Type=notify of a multiuser"
    " job so that only its IMP is signaled; sdexec's units are Type=exec and"
    " KillMode=control-group and its stop timer signals every process of the"
    " unit, so send neither (only SDEXEC_STOP_TIMER_SEC and"
    ' SDEXEC_STOP_TIMER_SIGNAL; docs/design.md, "How a unit ends: the stop'
    ' timer")'
)
#: Name prefixes never allowed: the commands (``ExecStart``, ``ExecStopPost``…)
#: and the standard streams are sdexec's; ``…Scale`` is the percentage form of
#: a limit that must be written ``MemoryMax=50%`` so it can be compared.
_NEVER_PREFIXES: Final = (("Exec", _SDEXEC), ("Standard", _SDEXEC))
_NEVER_SUFFIXES: Final = (("Scale", "write the limit as a percentage instead"),)
#: ``Exec…`` names that are no command: what a unit may execute from
#: (``ExecPaths``, hardening a site sets) and where a command's name is
#: looked up (sdexec's are absolute already).
_NOT_COMMANDS: Final = frozenset({"ExecPaths", "ExecSearchPath"})


@dataclass(frozen=True)
class Setting:
    """What systemd makes of several properties together (the I/O class
    and priority): how loose it is, the loosest the highest ``rank``, in
    words (``level``), and what makes it so (``source``)."""

    rank: float
    level: str
    source: str


@dataclass(frozen=True)
class Ordering:
    """How to compare one property's values.

    ``rank(value, memory)`` maps a value to a number that grows as
    the value loosens the unit (``memory()``: the node's bytes, asked for
    only to rank a percentage) (``ValueError`` if it does not parse);
    ``default`` is systemd's value when nothing sets it (``None``: not known
    here, so only an accounting switch turned on is accepted without a
    baseline); ``describe`` says what a valid value is, for ``EINVAL``."""

    rank: Callable[[str, Callable[[], int]], float]
    default: str | None
    describe: str
    #: ``infinity`` unsets it (a weight), so systemd's ``default`` applies.
    unset_by_infinity: bool = False
    #: The limit this one lengthens (a jitter added to it): where the
    #: baseline sets that limit (finite) or this one, the baseline's value,
    #: else ``default``, is the baseline; else nothing is lengthened, and
    #: any value is accepted.
    lengthens: str | None = None
    #: A list of device weights (``PATH WEIGHT``), each of which replaces
    #: these weights for its device: each is compared with their baselines.
    overrides: tuple[str, ...] = ()
    #: Where systemd makes one setting of this property and others, that
    #: setting given the unit's properties: the request's values are judged
    #: together, by what they make of the baseline's.
    setting: Callable[[Mapping[str, str]], Setting] | None = None


def _memory_rank(text: str, memory: Callable[[], int]) -> float:
    limit = MemoryLimit.parse(text)
    if limit.infinite:
        return float("inf")
    if limit.scale is not None:
        return float(scaled_memory(limit.scale, memory()))
    assert limit.bytes is not None
    return float(limit.bytes)


def _integer_rank(
    low: int, high: int, sign: int = 1, names: Mapping[str, int] | None = None
) -> Callable[[str, Callable[[], int]], float]:
    """Integers from ``low`` to ``high``, or the ``names`` of some
    (``idle`` for a CPU weight of 0); ``sign`` -1 where higher is tighter."""

    def rank(text: str, _memory: Callable[[], int]) -> float:
        if names and text.strip() in names:
            return sign * names[text.strip()]
        # int() alone would also take "1_000" and non-ASCII digits.
        is_integer = re.fullmatch(r"[-+]?[0-9]+", text.strip()) is not None
        if not is_integer or not low <= int(text) <= high:
            raise ValueError(
                f"{quoted(text, SHOWN)} is not an integer from {low} to {high}"
            )
        return sign * int(text)

    return rank


def _usec_rank(text: str, _memory: Callable[[], int]) -> float:
    if text.strip() == "infinity":
        return float("inf")
    return _integer_rank(0, 2**64 - 2)(text, _memory)


def _switch_rank(text: str, _memory: Callable[[], int]) -> float:
    # On is tighter: turning accounting off would hide the job from the
    # admin's monitoring.
    return 0.0 if parse_bool(text) else 1.0


_MEMORY = Ordering(_memory_rank, "infinity", MEMORY_LIMIT_FORMS)


def _weight(name: str) -> Ordering:
    """A weight, within the range systemd takes for ``name`` (for the CPU
    weights 0 is idle, the tightest: only idle tightens an idle baseline)."""
    low, high, takes = RANGES[name]
    return Ordering(
        _integer_rank(low, high, names={"idle": 0} if low == 0 else None),
        "100",
        f"a weight from {takes}",
        unset_by_infinity=True,
    )


#: Every spelling :func:`parse_bool` takes, as systemd's parse_boolean().
_BOOLEAN = "a boolean (yes/no, true/false, on/off, 1/0)"
_SWITCH = Ordering(_switch_rank, None, _BOOLEAN)
#: A hardening switch: on is tighter, and off is systemd's default.
_HARDENING = Ordering(_switch_rank, "no", _BOOLEAN)


def _level_rank(name: str) -> Callable[[str, Callable[[], int]], float]:
    """The rank of one of ``name``'s :data:`~sdexec.property.LEVELS`, the
    loosest the highest."""
    levels = LEVELS[name]

    def rank(text: str, _memory: Callable[[], int]) -> float:
        return float(len(levels) - 1 - levels.index(level_of(name, text)))

    return rank


def _levels(name: str) -> Ordering:
    return Ordering(_level_rank(name), "no", f"one of {', '.join(LEVELS[name])}")


def _value(name: str, text: str) -> Any:
    """``name``'s ``text`` as systemd takes it (typed as the site's
    values are); ``ValueError`` if it does not parse."""
    return typed_property(name, text, source="config").value


def _rlimit_rank(name: str) -> Callable[[str, Callable[[], int]], float]:
    """A resource limit's rank: its value as systemd takes it (a size for
    the byte-valued ones), ``infinity`` the loosest."""

    def rank(text: str, _memory: Callable[[], int]) -> float:
        value = _value(name, text)
        return float("inf") if value == UINT64_MAX else float(value)

    return rank


def _rlimits() -> dict[str, Ordering]:
    """Every hard ``Limit<RESOURCE>``: lower is tighter; the manager's
    defaults are not known here, so a request sets one only where the site
    does. (``LimitNICE`` is the rlimit itself: higher allows a higher
    priority. A soft limit restricts nothing: a process may raise its own up
    to the hard one.)"""
    orderings: dict[str, Ordering] = {}
    for resource in RLIMITS:
        takes = "a size" if resource in RLIMIT_SIZES else "a number"
        name = f"Limit{resource}"
        orderings[name] = Ordering(_rlimit_rank(name), None, f"{takes} or infinity")
    return orderings


def _typed_rank(
    name: str, ranks: Mapping[int, int] | None = None
) -> Callable[[str, Callable[[], int]], float]:
    """``name``'s number as systemd takes it, by name or number (``fifo``
    or 1), as its rank, or its rank in ``ranks`` where the numbers are no
    order."""

    def rank(text: str, _memory: Callable[[], int]) -> float:
        value = _value(name, text)
        return float(value if ranks is None else ranks[value])

    return rank


#: CPU scheduling policies by systemd's number, ranked: idle (5) below batch
#: (3) below other (0, the default), below fifo (1) and rr (2): a realtime
#: process outranks every other, whatever its Nice.
_CPU_POLICY_RANKS: Final = {5: 0, 3: 1, 0: 2, 1: 3, 2: 3}


def _device_weight_rank(text: str, _memory: Callable[[], int]) -> float:
    """The heaviest weight of an ``IODeviceWeight`` list (each entry is
    compared on its own: :attr:`Ordering.overrides`)."""
    return float(
        max(weight for _path, weight in parse_io_device_limits(text, "weight"))
    )


#: The I/O classes by ``IOSchedulingClass``'s numbers, and their rank: idle
#: takes no priority; within the others 0 is the loosest priority, 7 the
#: tightest. A class of none is best-effort at 4, systemd's default.
_IO_CLASSES: Final = {3: ("idle", 0), 2: ("best-effort", 1), 1: ("realtime", 2)}
_IO_NONE, _IO_BEST_EFFORT, _IO_DEFAULT_LEVEL = 0, 2, 4
#: Each class's rank alone; none ranks as the best-effort it resets to.
_IO_CLASS_RANKS: Final = {
    **{klass: rank for klass, (_name, rank) in _IO_CLASSES.items()},
    _IO_NONE: _IO_CLASSES[_IO_BEST_EFFORT][1],
}
_IO_NAMES: Final = ("IOSchedulingClass", "IOSchedulingPriority")
#: The kernel's I/O class for a CPU policy where none is set: idle (3) for
#: idle (5), realtime (1) for fifo (1) and rr (2), else best-effort.
_IO_CLASS_OF_CPU_POLICY: Final = {5: 3, 1: 1, 2: 1}


def _io_setting(klass: int, level: int, source: str) -> Setting:
    name, rank = _IO_CLASSES[klass]
    if rank == 0:
        return Setting(0.0, "I/O class idle", source)
    # A class outranks every priority of those below it.
    return Setting(
        rank * 8.0 + 7 - level, f"I/O class {name}, priority {level}", source
    )


def _io_priority(properties: Mapping[str, str]) -> Setting:
    """The I/O class and priority (ioprio_set(2)) of a unit of
    ``properties``, as systemd sets them one after the other in the order
    they are sent (a class of none resets the priority: best-effort 4);
    where neither is set, the kernel's."""
    klass, level, said = _IO_BEST_EFFORT, _IO_DEFAULT_LEVEL, []
    for name, text in properties.items():
        if name not in _IO_NAMES:
            continue
        value = _value(name, text)
        if name == "IOSchedulingPriority":
            level = value
        elif value == _IO_NONE:
            klass, level = _IO_BEST_EFFORT, _IO_DEFAULT_LEVEL
        else:
            klass = value
        said.append(f"{name}={text}")
    if not said:
        return _kernel_io_priority(properties)
    return _io_setting(klass, level, ", ".join(said))


def _kernel_io_priority(properties: Mapping[str, str]) -> Setting:
    """What the kernel gives a process that sets no I/O priority
    (ioprio_get(2)): the class of its CPU policy (idle for idle, realtime
    for fifo and rr, else best-effort), at (nice + 20) / 5."""
    policy = _value(
        "CPUSchedulingPolicy", properties.get("CPUSchedulingPolicy", "other")
    )
    klass = _IO_CLASS_OF_CPU_POLICY.get(policy, _IO_BEST_EFFORT)
    nice = _value("Nice", properties.get("Nice", "0"))
    shown = [
        f"{n}={properties[n]}"
        for n in ("CPUSchedulingPolicy", "Nice")
        if n in properties
    ]
    source = (
        f"the kernel's, from {', '.join(shown) or 'the default Nice=0'}: no"
        " IOSchedulingClass or IOSchedulingPriority is set"
    )
    return _io_setting(klass, (nice + 20) // 5, source)


def _scheduling() -> dict[str, Ordering]:
    """The CPU and I/O scheduling: a request may choose a policy, class or
    priority no looser than the baseline's; the I/O class and priority are
    judged together (:func:`_io_priority`)."""
    return {
        "CPUSchedulingPolicy": Ordering(
            _typed_rank("CPUSchedulingPolicy", _CPU_POLICY_RANKS),
            "other",
            "one of idle, batch, other, fifo, rr (or 5, 3, 0, 1, 2)",
        ),
        # Only fifo and rr take one (1 to 99): higher runs first.
        "CPUSchedulingPriority": Ordering(
            _typed_rank("CPUSchedulingPriority"), "0", "a priority from 0 to 99"
        ),
        # On, a child of the job starts as an ordinary process, not realtime.
        "CPUSchedulingResetOnFork": _HARDENING,
        "IOSchedulingClass": Ordering(
            _typed_rank("IOSchedulingClass", _IO_CLASS_RANKS),
            "best-effort",
            "one of none, realtime, best-effort, idle (or 0 to 3)",
            setting=_io_priority,
        ),
        "IOSchedulingPriority": Ordering(
            _typed_rank("IOSchedulingPriority", {p: 7 - p for p in range(8)}),
            "4",
            "a priority from 0 to 7",
            setting=_io_priority,
        ),
    }


#: The hardening switches of systemd.exec(5), each off by default: a
#: request may turn one on, and off only where the site leaves it off.
HARDENING_SWITCHES: Final = frozenset(
    {
        "NoNewPrivileges", "PrivateTmp", "PrivateDevices", "PrivateNetwork",
        "PrivateUsers", "PrivateMounts", "PrivateIPC", "ProtectKernelTunables",
        "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
        "ProtectClock", "ProtectHostname", "LockPersonality",
        "MemoryDenyWriteExecute", "RestrictRealtime", "RestrictSUIDSGID",
        "RemoveIPC", "PrivatePIDs",
    }
)  # fmt: skip

#: The properties a request may only tighten, and how their values compare.
#: Lower is tighter except for ``Nice`` and ``OOMScoreAdjust`` (higher is
#: tighter) and the accounting switches (on is tighter). ``MemoryLow`` and
#: ``MemoryMin`` are protections: raising them takes memory from others.
#: Each ``IODeviceWeight`` entry compares with ``IOWeight`` (and
#: ``StartupIOWeight``), which it replaces for its device; the scheduling
#: policies and classes rank as :func:`_scheduling` says.
TIGHTENING: Final[Mapping[str, Ordering]] = {
    **dict.fromkeys(
        (
            "MemoryMax",
            "MemoryHigh",
            "MemorySwapMax",
            "MemoryZSwapMax",
            "StartupMemoryMax",
            "StartupMemoryHigh",
            "StartupMemorySwapMax",
            "StartupMemoryZSwapMax",
        ),
        _MEMORY,
    ),
    **dict.fromkeys(
        (
            "MemoryLow",
            "MemoryMin",
            "StartupMemoryLow",
            "DefaultMemoryLow",
            "DefaultMemoryMin",
        ),
        Ordering(_memory_rank, "0", MEMORY_LIMIT_FORMS),
    ),
    **_rlimits(),
    **{
        name: _weight(name)
        for name in ("CPUWeight", "StartupCPUWeight", "IOWeight", "StartupIOWeight")
    },
    # A device's weight replaces the unit's for that device, then as while
    # the manager starts or stops.
    "IODeviceWeight": Ordering(
        _device_weight_rank,
        None,
        "a list of 'PATH WEIGHT' (1 to 10000), separated by commas",
        overrides=("IOWeight", "StartupIOWeight"),
    ),
    **_scheduling(),
    **dict.fromkeys(
        ("CPUQuotaPerSecUSec", "RuntimeMaxUSec"),
        Ordering(_usec_rank, "infinity", "microseconds or infinity"),
    ),
    # systemd lengthens RuntimeMaxUSec by a random time up to this one.
    "RuntimeRandomizedExtraUSec": Ordering(
        _usec_rank, "0", "microseconds or infinity", lengthens="RuntimeMaxUSec"
    ),
    # The manager's DefaultTasksMax and the service's own OOM score are not
    # known here: the integrator passes them as baselines.
    "TasksMax": Ordering(_usec_rank, None, "a number of tasks or infinity"),
    "Nice": Ordering(_integer_rank(-20, 19, -1), "0", "a nice level from -20 to 19"),
    "OOMScoreAdjust": Ordering(
        _integer_rank(-1000, 1000, -1), None, "an integer from -1000 to 1000"
    ),
    **dict.fromkeys(
        (
            "CPUAccounting",
            "MemoryAccounting",
            "IOAccounting",
            "TasksAccounting",
            "IPAccounting",
            "BlockIOAccounting",
        ),
        _SWITCH,
    ),
    **dict.fromkeys(HARDENING_SWITCHES, _HARDENING),
    **{name: _levels(name) for name in LEVELS},
}

#: The ``Startup…`` properties and what systemd applies while the manager
#: starts or stops when a unit leaves one unset: the steady one.
STARTUP_TWINS: Final[Mapping[str, str]] = {
    f"Startup{steady}": steady
    for steady in (
        "MemoryMax", "MemoryHigh", "MemorySwapMax", "MemoryZSwapMax",
        "MemoryLow", "CPUWeight", "IOWeight",
    )
}  # fmt: skip

#: What a request may set whatever ``request-properties`` says, unless
#: ``[exec.sdexec-properties]`` sets it (the admin's value then stands).
#: Whether the process starts with SIGPIPE ignored (systemd's default) is
#: its own business: it may change that itself at any time. ``sdexec run``
#: sets it on every streaming run (a closed pipe ends the command as it
#: would a local one), so a site that narrowed the list refused every run.
ALWAYS_ALLOWED: Final = frozenset({"IgnoreSIGPIPE"})

#: What a request may set unless the admin says otherwise: limits that only
#: tighten, the description, the accounting switches, and the above.
DEFAULT_ALLOWED: Final = ALWAYS_ALLOWED | frozenset(
    {
        "MemoryMax",
        "MemoryHigh",
        "MemorySwapMax",
        "CPUWeight",
        "CPUQuotaPerSecUSec",
        "Description",
        "CPUAccounting",
        "MemoryAccounting",
        "IOAccounting",
        "TasksAccounting",
    }
)


def never_allowed_reason(name: str) -> str | None:
    """Why ``name`` can never be set by a request, or ``None`` if it may be
    (when the admin allows it)."""
    if name in NEVER_ALLOWED:
        return NEVER_ALLOWED[name]
    for prefix, reason in _NEVER_PREFIXES:
        if name.startswith(prefix) and name not in _NOT_COMMANDS:
            return reason
    for suffix, reason in _NEVER_SUFFIXES:
        if name.endswith(suffix):
            return reason
    return None


def _can_never_be_set(name: str) -> bool:
    # What a did-you-mean must not offer as settable (TimeoutSec's
    # TimeoutStopUSec).
    return never_allowed_reason(name) is not None


def unit_handling_reason(name: str) -> str | None:
    """Why no site may set ``name`` either, or ``None``: the unit's
    lifecycle (``Restart`` would run a failed job again behind sdexec's
    back), its commands and its standard streams are sdexec's. (Identity,
    the environment and the fences are the site's to set, or the
    configuration's reserved list.)"""
    reason = never_allowed_reason(name)
    return reason if reason in (_LIFECYCLE, _SDEXEC) else None


class RequestPropertiesEntryError(ValueError):
    """A bad entry of :data:`CONFIG_KEY`: its ``index`` extends the key path
    (``sdexec.request-properties[2]``), as a property's name extends
    ``exec.sdexec-properties``'s."""

    def __init__(self, index: int, reason: str) -> None:
        self.index = index
        super().__init__(reason)


def parse_request_properties(value: object) -> frozenset[str]:
    """The checked value of :data:`CONFIG_KEY`: an array of property names,
    where :data:`DEFAULTS_TOKEN` stands for :data:`DEFAULT_ALLOWED`. ``[]``
    lets requests set nothing but :data:`ALWAYS_ALLOWED`.

    ``ValueError`` for a non-array; :class:`RequestPropertiesEntryError`
    for a non-name, a name that can never be allowed, or one systemd does
    not know (a request setting it would be refused whatever the list).
    The caller names the key.
    """
    if not isinstance(value, list):
        raise ValueError(
            f"expected an array of property names, got {json_quoted(value)}"
        )
    allowed: set[str] = set()
    for index, entry in enumerate(value):
        if entry == DEFAULTS_TOKEN:
            allowed |= DEFAULT_ALLOWED
            continue
        allowed.add(_allowable(index, entry))
    return frozenset(allowed)


def _allowable(index: int, entry: object) -> str:
    """``entry``, the name at ``index`` of :data:`CONFIG_KEY`, if a
    request may be allowed to set it."""
    if not is_property_word(entry):
        raise RequestPropertiesEntryError(
            index,
            f"expected a property name such as MemoryMax or {DEFAULTS_TOKEN!r},"
            f" got {json_quoted(entry)}",
        )
    reason = never_allowed_reason(entry)
    if reason is not None:
        raise RequestPropertiesEntryError(
            index, f"{entry} can never be set by a request: {reason}"
        )
    unknown = unknown_property_reason(entry, _can_never_be_set)
    if unknown is None:
        unknown = string_typed_problem(entry)  # refused whatever its value
    if unknown is not None:
        raise RequestPropertiesEntryError(index, f"{entry}: {unknown}")
    return entry


@dataclass(frozen=True)
class RequestPolicy:
    """The policy one node applies to its requests' properties.

    ``allowed``: from :func:`parse_request_properties` (default
    :data:`DEFAULT_ALLOWED`). ``baseline``: the values the unit gets without
    the request (``[exec.sdexec-properties]`` merged with the mapper's, plus
    any manager defaults the integrator knows, such as ``TasksMax``).
    ``physical_memory``: bytes, to compare ``50%`` with ``8G`` as systemd
    would resolve them; ``None``: this node's as systemd counts it
    (sdexec/nodememory.py: the smaller of its RAM and a container's limit),
    read only when a percentage is compared.
    """

    allowed: frozenset[str] = DEFAULT_ALLOWED
    baseline: Mapping[str, str] = field(default_factory=dict)
    physical_memory: int | None = None

    def accept(self, requested: Mapping[str, str]) -> dict[str, str]:
        """``requested`` (``Name → value``, from ``SDEXEC_PROP_<Name>``) if
        every property is allowed and no value loosens its baseline.

        ``RequestRefused``: ``EPERM`` naming the property and
        :data:`CONFIG_KEY` for a property not allowed or a looser value,
        ``EINVAL`` for a value that does not parse or is not text, or a
        name systemd does not know (with the name likely meant). An
        allowed property outside :data:`TIGHTENING` (one the admin added,
        such as ``KeyringMode``) is accepted with any value: widening
        the list is the admin's deliberate choice.
        """
        for name, value in requested.items():
            self._check(name, value)
        try:  # a soft:hard limit, allowed by its name, as its two properties
            requested = split_rlimit_pairs(requested)
        except PropertyError as error:
            raise RequestRefused(errno.EINVAL, str(error)) from None
        self._check_settings(requested)
        # What only repeats sdexec's own value is left to sdexec's.
        return {n: v for n, v in requested.items() if not _repeats_sdexec(n, v)}

    def _check(self, name: str, value: str) -> None:
        if not name:  # dropped, the job ran without the limit it asked for
            raise RequestRefused(
                errno.EINVAL,
                "SDEXEC_PROP_: names no property (SDEXEC_PROP_<Name>, as in"
                " SDEXEC_PROP_MemoryMax)",
            )
        option = f"SDEXEC_PROP_{printable(name, SHOWN)}"
        reason = never_allowed_reason(name)
        if reason is not None and not _repeats_sdexec(name, value):
            raise RequestRefused(
                errno.EPERM,
                f"{option}: a request can never set {name}: {reason}"
                f"{_fixed_value(name, value)}",
            )
        if reason is not None:
            return  # sdexec's own value, as systemd takes it: a no-op
        unknown = unknown_property_reason(name, _can_never_be_set)
        if unknown is not None:
            raise RequestRefused(errno.EINVAL, f"{option}: {unknown}")
        if name not in self.allowed and not self._always_allowed(name, value):
            raise RequestRefused(
                errno.EPERM,
                f"{option}: requests may not set {printable(name, SHOWN)}"
                f"{self._set_by_site(name)}; an admin may allow it in {CONFIG_KEY}",
            )
        check_text(option, value)
        if name == "Description" and len(value.encode()) > MAX_DESCRIPTION:
            # Its size, as a label's or a job id's too long is said.
            raise RequestRefused(
                errno.EINVAL,
                f"{option}: {len(value.encode())} bytes; at most {MAX_DESCRIPTION}",
            )
        order = TIGHTENING.get(name)
        pair = rlimit_pair(name, value)
        if order is not None:
            # Of a soft:hard pair only the hard limit restricts: a process
            # may raise its soft one up to it.
            hard = value if pair is None else pair[1]
            self._check_tightens(option, name, hard, order)

    def _always_allowed(self, name: str, value: str) -> bool:
        """Allowed where the site does not set it, or asked as the site has
        it (``sdexec run``'s ``IgnoreSIGPIPE=no`` where the site says no)."""
        if name not in ALWAYS_ALLOWED:
            return False
        if name not in self.baseline:
            return True
        try:
            return parse_bool(value) == parse_bool(self.baseline[name])
        except ValueError:
            return False  # refused below as not allowed (the value is moot)

    def _set_by_site(self, name: str) -> str:
        if name in ALWAYS_ALLOWED and name in self.baseline:
            # `sdexec run` asks IgnoreSIGPIPE=no of every run, unasked by
            # its user: say how to run with the site's value instead.
            site = self.baseline[name]
            return (
                f" (set to {site} by {SITE_PROPERTIES_KEY}: a request may only"
                " repeat it; `sdexec run`, which asks for no, runs with it given"
                f" `--setopt SDEXEC_PROP_{name}={site}`)"
            )
        return ""

    def _check_tightens(
        self, option: str, name: str, value: str, order: Ordering
    ) -> None:
        rank = self._rank(option, value, order)
        if order.setting is not None:
            return  # judged with the rest of its setting: _check_settings
        if order.overrides:
            self._check_device_weights(option, value, order.overrides)
        else:
            self._check_rank(option, name, printable(value), rank, order)

    def _rank(self, option: str, value: str, order: Ordering) -> float:
        """A request's ``value`` ranked by ``order``; ``EINVAL`` if it is
        none of its values."""
        try:
            return order.rank(_unset_as_default(value, order), self._memory)
        except SizeNotTaken as error:  # a size, only not one sdexec takes
            raise RequestRefused(errno.EINVAL, f"{option}: {error}") from None
        except ValueError:
            raise RequestRefused(
                errno.EINVAL,
                f"{option}: {quoted(printable(value), SHOWN)} is not {order.describe}",
            ) from None

    def _check_device_weights(
        self, option: str, value: str, overrides: tuple[str, ...]
    ) -> None:
        """Each entry of a device weight list, as the weights it replaces
        for its device (``IODeviceWeight``: ``IOWeight``, and
        ``StartupIOWeight`` while the manager starts or stops)."""
        for path, weight in parse_io_device_limits(value, "weight"):
            for name in overrides:
                order = TIGHTENING[name]
                rank = order.rank(str(weight), self._memory)
                self._check_rank(
                    option, name, f"{printable(path)} {weight}", rank, order
                )

    def _check_rank(
        self, option: str, name: str, shown: str, rank: float, order: Ordering
    ) -> None:
        """``EPERM`` if ``rank``, a request's value (``shown``), is looser
        than the baseline's ``name``."""
        compared, baseline = self._baseline_of(name, order)
        if order is _SWITCH and rank == 0:
            return  # on: the tightest value, whatever the baseline
        if self._lengthens_nothing(name, order):
            return
        baseline_rank = self._baseline_rank(baseline, order)
        if baseline_rank is None:
            raise RequestRefused(
                errno.EPERM,
                f"{option}: no baseline {name} is known to compare with; the admin"
                " sets one in [exec.sdexec-properties]",
            )
        if rank > baseline_rank:
            raise RequestRefused(
                errno.EPERM,
                f"{option}: {quoted(shown, SHOWN)} is looser than this node's"
                f" {compared}={baseline}{self._lengthened(order)}; a request may"
                f" only tighten it ({CONFIG_KEY})",
            )

    def _check_settings(self, requested: Mapping[str, str]) -> None:
        """The settings systemd makes of several properties (the I/O class
        and priority) that ``requested`` sets any of: each as loose at most
        as the baseline's, with the request's values sent after the
        baseline's, as the plan sends them."""
        for setting, values in _by_setting(requested).items():
            ours, theirs = setting({**self.baseline, **values}), setting(self.baseline)
            if ours.rank > theirs.rank:
                shown = ", ".join(
                    f"{n}={printable(v, SHOWN)}" for n, v in values.items()
                )
                raise RequestRefused(
                    errno.EPERM,
                    f"SDEXEC_PROP_{next(iter(values))}: {shown} ({ours.level}) is"
                    f" looser than this node's {theirs.level} ({theirs.source}); a"
                    f" request may only tighten it ({CONFIG_KEY})",
                )

    def _lengthens_nothing(self, name: str, order: Ordering) -> bool:
        """Whether ``name`` lengthens a limit that the baseline leaves
        infinite, and does not set ``name`` itself: then it loosens
        nothing."""
        return (
            order.lengthens is not None
            and self._finite_limit(order.lengthens) is None
            and name not in self.baseline
        )

    def _lengthened(self, order: Ordering) -> str:
        """What a refused value would have lengthened, as words to add."""
        if order.lengthens is None:
            return ""
        limit = self._finite_limit(order.lengthens)
        if limit is None:
            return ""
        return f", which lengthens its {order.lengthens}={limit}"

    def _finite_limit(self, name: str) -> str | None:
        """The baseline's ``name``, unless it leaves it infinite (unset, or
        ``infinity``: a jitter added to that lengthens nothing)."""
        limit = self.baseline.get(name)
        if limit is None or self._baseline_rank(limit, TIGHTENING[name]) == math.inf:
            return None
        return limit

    def _baseline_of(self, name: str, order: Ordering) -> tuple[str, str | None]:
        """The property a request's ``name`` compares with, and its value:
        the site's (or the mapper's) ``name``; for a startup twin the site
        does not set, what systemd applies in its stead while the manager
        starts or stops (``MemoryMax`` for ``StartupMemoryMax``); else
        systemd's default."""
        steady = STARTUP_TWINS.get(name, name)
        if name not in self.baseline and steady in self.baseline:
            return steady, self.baseline[steady]
        return name, self.baseline.get(name, order.default)

    def _memory(self) -> int:
        if self.physical_memory is not None:
            return self.physical_memory
        return nodememory.physical_memory()

    def _baseline_rank(self, baseline: str | None, order: Ordering) -> float | None:
        if baseline is None:
            return None
        try:
            return order.rank(_unset_as_default(baseline, order), self._memory)
        except ValueError:
            return None  # e.g. TasksMax=15%: not comparable here, so unknown


def _repeats_sdexec(name: str, value: object) -> bool:
    """Whether ``value`` is exactly :data:`SDEXEC_FIXED`'s ``name``, as
    systemd would take both (``SendSIGKILL=0`` is ``no``)."""
    fixed = SDEXEC_FIXED.get(name)
    if fixed is None or not isinstance(value, str):
        return False
    try:
        asked = typed_property(name, value, source="request")
    except PropertyError:
        return False  # no value systemd takes: refused as never allowed
    ours = typed_property(name, fixed, source="sdexec")
    return (asked.signature, asked.value) == (ours.signature, ours.value)


def _fixed_value(name: str, value: str) -> str:
    """For a refused property of :data:`SDEXEC_FIXED`, the value every unit
    has beside the one asked, and what a port of Flux's job-exec does
    instead; else nothing."""
    fixed = SDEXEC_FIXED.get(name)
    if fixed is None:
        return ""
    asked = printable(value, SHOWN)
    words = (
        f"; every unit has {name}={fixed}, which a request may only repeat,"
        f" not {name}={asked}"
    )
    if name in ("KillMode", "Type"):
        words += f"; {_UPSTREAM_MULTIUSER}"
    return words


def _by_setting(
    requested: Mapping[str, str],
) -> dict[Callable[[Mapping[str, str]], Setting], dict[str, str]]:
    """The properties of ``requested`` that are part of a setting
    (:attr:`Ordering.setting`), by setting."""
    members: dict[Callable[[Mapping[str, str]], Setting], dict[str, str]] = {}
    for name, value in requested.items():
        setting = TIGHTENING[name].setting if name in TIGHTENING else None
        if setting is not None:
            members.setdefault(setting, {})[name] = value
    return members


def _unset_as_default(text: str, order: Ordering) -> str:
    """``text``, or systemd's default where ``infinity`` unsets the property
    (a weight): the request's, as the site's, is then ranked as the value
    systemd applies. (``CPUWeight=infinity``, which the configuration takes,
    was EINVAL "not a weight" from a request.)"""
    if order.unset_by_infinity and text.strip() == "infinity":
        return order.default or text
    return text
