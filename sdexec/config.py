"""The service's configuration: the ``[exec]``, ``[sdexec]`` and ``[systemd]``
tables of flux-config-exec(5), from TOML (``.toml``), JSON (``.json``, as
Flux reads it too) or YAML (``.yaml``, ``.yml``) of the same schema, or
from a directory of ``*.toml`` files, as Flux reads its ``conf.d``.

A file is checked whole before anything uses it: :func:`load_config` either
returns a complete, immutable :class:`Config` or raises :class:`ConfigError`
with one line naming the file, the key path and what was expected, so a bad
reload can never half-apply. Unknown keys inside these tables are errors
(a typo must not be silently ignored), and so is a top-level key that
names one of them with dots (``exec.kill-timeout`` in YAML); unknown
tables are ignored with a warning, because a Flux system configuration has
many tables that are not ours.

``python3 -m sdexec.config FILE`` checks a file the same way and prints the
effective configuration as JSON.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import errno
import json
import math
import os
import pwd
import re
import signal
import stat
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import yaml
from twisted.internet.endpoints import UNIXServerEndpoint, serverFromString
from twisted.logger import Logger

from sdexec.activation import (
    check_systemd_endpoint,
    is_systemd_endpoint,
    systemd_endpoint_domain,
)
from sdexec.cliparser import CommandParser, say_led, write_stdout_or_exit
from sdexec.command import OWN_PROPERTIES
from sdexec.fluxforms import flux_refusals
from sdexec.fsd import InfiniteDurationError, parse_fsd
from sdexec.idset import MAX_ID
from sdexec.policy import (
    DEFAULT_ALLOWED,
    RequestPropertiesEntryError,
    parse_request_properties,
    unit_handling_reason,
)
from sdexec.property import (
    CONTAINMENT_PROPERTIES,
    FD_PROPERTIES,
    MEMORY_PROPERTIES,
    SCALED_MEMORY_PROPERTIES,
    STARTUP_MEMORY_PROPERTIES,
    STOP_PROPERTIES,
    PropertyError,
    is_property_word,
    properties_together_problem,
    split_rlimit_pairs,
    typed_property,
    unknown_property_reason,
)
from sdexec.protocol import DEFAULT_MAX_FRAME
from sdexec.protocolbase import MAX_SOCKET_PATH
from sdexec.refusal import SHOWN, json_quoted, printable
from sdexec.retained import DEFAULT_RETAINED, parse_retained_size
from sdexec.signals import parse_signal, signal_name
from sdexec.sizes import (
    MEMORY_LIMIT_FORMS,
    SUFFIXES,
    MemoryLimit,
    SizeNotTaken,
    SizeTooLarge,
    bounded_size,
    octal_differs,
    parse_size,
)
from sdexec.sockets import endpoint_mode
from sdexec.systemd.window import DEFAULT_MAX_INFLIGHT
from sdexec.version import add_version_option

__all__ = [
    "DEFAULT_CWD",
    "DEFAULT_JOB_SHELL",
    "MAX_KILL_INTERVAL",
    "MAX_STOP_TIMER_SEC",
    "MEMORY_PROPERTIES",
    "RESERVED_PROPERTIES",
    "Config",
    "ConfigError",
    "ExecConfig",
    "MiB",
    "SdexecConfig",
    "SystemdConfig",
    "check_command_line_option",
    "default_config",
    "final_kill_attempt",
    "load_config",
    "main",
    "parse_config",
]

_log = Logger()

MiB = 1024**2

#: The longest wait between two direct kill attempts of the job shells.
MAX_KILL_INTERVAL = 300.0

#: ``[sdexec] socket-mode``'s default: the owner alone may connect.
DEFAULT_SOCKET_MODE = 0o600

#: The longest stop timer: Flux's job-exec reads the key (and derives its
#: default) as a C int, so a larger value wraps there, to another timer or
#: a negative one (derived, or the timer disabled); 68 years, well inside
#: systemd's 64-bit microseconds.
MAX_STOP_TIMER_SEC = 2**31 - 1

#: Reported as ``bulk-exec.config.default_cwd``: where a process runs when
#: its command names no working directory.
DEFAULT_CWD = "/tmp"

#: Reported as ``bulk-exec.config.default_job_shell`` when ``exec.job-shell``
#: is unset: where Flux packages install the job shell.
DEFAULT_JOB_SHELL = "/usr/libexec/flux/flux-shell"

#: Unit properties sdexec sets itself (the unit's command and its fds),
#: containment sets, or the stop timer relies on; a site value would break
#: unit handling or resource containment, so ``exec.sdexec-properties``
#: refuses them.
RESERVED_PROPERTIES = (
    OWN_PROPERTIES
    | frozenset(FD_PROPERTIES)
    | CONTAINMENT_PROPERTIES
    | STOP_PROPERTIES
    | frozenset({"Slice"})  # [sdexec] slice sets it
)


class ConfigError(ValueError):
    """A configuration that cannot be used, in one line:
    ``/etc/sdexec.toml: exec.kill-timeout: "5x" is not a valid duration: ...``.

    ``source`` is the file (or ``"<config>"``), ``key`` the dotted key path
    (``None`` for a problem with the file as a whole), ``reason`` the rest.
    ``transient``: the machine failed while using it (a tool that timed
    out, no memory, a name service not answering yet), so the same file
    may load on a later try. ``related``: the other keys a rule across
    keys read, whose files a directory's error names too.
    """

    def __init__(
        self,
        source: str,
        key: str | None,
        reason: str,
        transient: bool = False,
        related: tuple[str, ...] = (),
    ) -> None:
        self.source = source
        self.key = key
        self.reason = reason
        self.transient = transient
        self.related = related
        where = source if key is None else f"{source}: {key}"
        super().__init__(f"{where}: {reason}")


# --- the configuration objects -------------------------------------------


@dataclass(frozen=True)
class ExecConfig:
    """The ``[exec]`` table, with ``[exec.testexec]`` and
    ``[exec.sdexec-properties]``. Durations are in seconds, signals are
    numbers."""

    imp: str | None = None
    service: str = "rexec"
    service_override: bool = False
    #: Flux's execution implementation, ``"bulk-exec"`` or ``"bgexec"``.
    method: str = "bulk-exec"
    job_shell: str | None = None
    #: ``0`` (written ``"none"``) disables it.
    shell_exit_timeout: float = 30.0
    kill_timeout: float = 5.0
    max_kill_count: int = 8
    #: ``None`` when unset: ``max_kill_count`` then bounds termination.
    max_kill_timeout: float | None = None
    term_signal: int = signal.SIGTERM.value
    kill_signal: int = signal.SIGKILL.value
    #: ``0`` disables the start barrier timeout.
    barrier_timeout: float = 1800.0
    max_start_delay_percent: float = 25.0
    testexec_allow_guests: bool = False
    sdexec_constrain_resources: bool = False
    sdexec_properties: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({})
    )
    #: ``exec.sdexec-stop-timer-sec`` as written; ``None`` when unset.
    #: Read :attr:`sdexec_stop_timer_sec` for the value in force.
    sdexec_stop_timer_sec_configured: int | None = None
    #: 10 is SIGUSR1, the IMP's proxy for SIGKILL.
    sdexec_stop_timer_signal: int = 10

    @property
    def effective_max_kill_timeout(self) -> float:
        """Seconds from the start of termination until the nodes of an
        unkillable job are drained: ``max_kill_timeout`` when set, else the
        time of the last of ``max_kill_count`` direct kill attempts."""
        if self.max_kill_timeout is not None:
            return self.max_kill_timeout
        return final_kill_attempt(self.kill_timeout, self.max_kill_count)

    @property
    def sdexec_stop_timer_sec(self) -> int:
        """The stop timer in force: as configured, else the effective
        max-kill-timeout rounded up to whole seconds."""
        if self.sdexec_stop_timer_sec_configured is not None:
            return self.sdexec_stop_timer_sec_configured
        # Sums of binary fractions carry noise (0.1 * 3 is 0.30000000000000004);
        # it must not add a second to the timer.
        timeout = round(self.effective_max_kill_timeout, 6)
        if not math.isfinite(timeout):  # kill-timeout = 1e308, times five
            return MAX_STOP_TIMER_SEC + 1  # refused as above the limit
        # At least a second, as upstream's ceil() gives for any positive
        # timeout: 0 would abandon every lingering unit at once.
        return max(1, math.ceil(timeout))


@dataclass(frozen=True)
class SdexecConfig:
    """The ``[sdexec]`` table: the resource mapper, and the service's own
    settings (endpoints, rank, topology, frame size)."""

    mapper: str = "sdexec.map.HwlocMapper"
    #: Colon-separated directories searched for mapper modules.
    mapper_searchpath: str = ""
    #: Twisted server endpoint for requests; ``None``: the service's default,
    #: ``unix:$XDG_RUNTIME_DIR/sdexec/sdexec.sock``.
    listen: str | None = None
    #: The listen backlog of ``listen``; ``None``: the kernel's
    #: ``net.core.somaxconn``.
    listen_backlog: int | None = None
    #: Twisted server endpoint for HTTP statistics; ``None``: the service's
    #: default, ``tcp:8490:interface=127.0.0.1``.
    stats: str | None = None
    #: This broker's rank, for the mapper and for I/O objects.
    rank: int = 0
    #: An hwloc XML file the mapper reads instead of running lstopo.
    topology: str | None = None
    #: The largest request or response frame, in bytes.
    max_frame_size: int = DEFAULT_MAX_FRAME
    #: What to do when a fence (a job's CPUs, memory nodes or memory cap,
    #: the device canary's) is found not enforced: ``"drain"`` (fail the
    #: job, refuse further execs until undrained) or ``"warn"`` (log it and
    #: let the job run: for test nodes whose cgroups cannot enforce, by an
    #: admin's explicit choice).
    containment_check: str = "drain"
    #: How the service logs under twistd: ``"text"`` (Twisted's lines; with a
    #: syslog priority prefix when stdout is the journal) or ``"json"``
    #: (Twisted's JSON log observer, for log shippers). See sdexec/logs.py.
    log_format: str = "text"
    #: Bytes of output kept per background or waitable process for
    #: ``sdexec.wait`` and ``sdexec.attach`` (sdexec/retained.py); 0 keeps none.
    retained_output: int = DEFAULT_RETAINED
    #: What to do with units of an earlier run found at start or after a
    #: reconnection (sdexec/leftovers.py): ``"stop"`` or ``"keep"``.
    leftover_units: str = "stop"
    #: The slice every unit is started in (``Slice``), under either manager.
    slice: str = "sdexec.slice"
    #: Uids besides the service's own that may connect (``allow-users``,
    #: names resolved when the file is read). Under the system manager they
    #: can run anything as root: list only users trusted with that.
    allow_users: tuple[int, ...] = ()
    #: The unit properties a request may set (sdexec/policy.py).
    request_properties: frozenset[str] = DEFAULT_ALLOWED
    #: Whether ``GET /stats`` shows command lines and labels.
    stats_detail: bool = False
    #: Another endpoint for the HTTP statistics: a UNIX socket path.
    stats_socket: str | None = None
    #: The permissions of every UNIX socket the service creates.
    socket_mode: int = DEFAULT_SOCKET_MODE
    #: Open connections at once: the owner's, and each other peer uid's
    #: apart (sdexec/admission.py).
    max_connections: int = 512
    max_connections_per_user: int = 16
    #: Waitable processes held at once, running or ended and not yet waited
    #: for: each ended one keeps its status and retained output until then.
    #: The owner's; ``max_waitable_per_user`` each other user's
    #: (sdexec/shares.py): neither counts against the other. A user's
    #: defaults are the owner's: the user listed may be the resource
    #: manager's agent, under a root service.
    max_waitable: int = 1024
    max_waitable_per_user: int = 1024
    #: Background processes running at once: each holds up to
    #: retained-output bytes of its output. As above, the owner's, then
    #: each other user's.
    max_background: int = 1024
    max_background_per_user: int = 1024
    #: Processes of every kind the service runs at once: each holds its
    #: command, its output's partial lines and its stdin, in the service.
    #: As above, the owner's, then each other user's.
    max_processes: int = 4096
    max_processes_per_user: int = 4096


#: Seconds from systemd's start job to the process's ``started`` before the
#: request is ended (``[systemd] start-timeout``): longer than systemd's own
#: ``DefaultTimeoutStartSec`` (90 s), so that systemd's verdict comes first.
DEFAULT_START_TIMEOUT = 120.0

#: Seconds without systemd before the service drains
#: (``[systemd] reconnect-timeout``).
DEFAULT_RECONNECT_TIMEOUT = 60.0


@dataclass(frozen=True)
class SystemdConfig:
    """The ``[systemd]`` table (flux-config-systemd(5))."""

    enable: bool = False
    sdexec_debug: bool = False
    sdbus_debug: bool = False
    #: Method calls awaiting their reply at once; more wait, each user's
    #: in order, the users' in turn (sdexec/systemd/window.py).
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    #: How long a started unit may take to show a running process.
    start_timeout: float = DEFAULT_START_TIMEOUT
    #: How long systemd may be away before the service drains.
    reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT
    #: Which manager runs the units: ``"user"`` (the session bus of the
    #: service's user) or ``"system"`` (the system bus: the service runs as
    #: root and device policy is enforced). Chosen at start.
    bus: str = "user"


@dataclass(frozen=True)
class Config:
    """A complete, checked configuration."""

    exec: ExecConfig = field(default_factory=ExecConfig)
    sdexec: SdexecConfig = field(default_factory=SdexecConfig)
    systemd: SystemdConfig = field(default_factory=SystemdConfig)
    #: The file it came from, or ``"<config>"`` / ``"<default>"``.
    source: str = "<default>"
    #: What was ignored while reading it (unknown tables), one line each.
    warnings: tuple[str, ...] = ()

    def introspect(self) -> dict[str, Any]:
        """The configuration part of ``flux module stats job-exec`` (the
        service adds the ``jobs`` entry), in both of Flux's shapes: the
        shared configuration under ``bulk-exec.config``, as the spec's
        flux-config-exec(5) shows it and flux-core up to 0.87 reports it,
        and under ``config``, beside ``method``, as 0.88 and later do."""
        e = self.exec
        return {
            "method": e.method,
            "kill-timeout": e.kill_timeout,
            "term-signal": signal_name(e.term_signal),
            "kill-signal": signal_name(e.kill_signal),
            "max-kill-count": e.max_kill_count,
            "max-kill-timeout": (
                -1.0 if e.max_kill_timeout is None else e.max_kill_timeout
            ),
            "effective-max-kill-timeout": e.effective_max_kill_timeout,
            "config": _job_exec_config(e, leaving_out=_DROPPED_IN_0_88),
            "bulk-exec": {"config": _job_exec_config(e, leaving_out=frozenset())},
        }

    def effective(self) -> dict[str, Any]:
        """What ``python3 -m sdexec.config`` prints: :meth:`introspect` plus
        every key of ``[exec]``, ``[sdexec]`` and ``[systemd]`` with the value
        in force (defaults and derived values filled in)."""
        return self.introspect() | {
            name: _show_table(spec, getattr(self, name))
            for name, (spec, _) in _SCHEMA.items()
        }


#: The entries of Flux's job-exec configuration stats, in its order: under
#: ``bulk-exec.config`` up to flux-core 0.87 (the spec's flux-config-exec(5)
#: shows those of its day), under ``config`` from 0.88, which dropped
#: ``exec.service-override`` (:data:`_DROPPED_IN_0_88`).
_CONFIG_STATS = (
    "default_cwd",
    "default_job_shell",
    "flux_imp_path",
    "exec_service",
    "exec_service_override",
    "default_barrier_timeout",
    "shell_exit_timeout",
    "sdexec_stop_timer_sec",
    "sdexec_stop_timer_signal",
    "sdexec_constrain_resources",
    "sdexec_properties",
)
_DROPPED_IN_0_88 = frozenset({"exec_service_override"})


def _job_exec_config(e: ExecConfig, leaving_out: frozenset[str]) -> dict[str, Any]:
    """Flux's job-exec configuration stats but those ``leaving_out``; as
    there, ``flux_imp_path`` and ``sdexec_properties`` only when set."""
    values = {
        "default_cwd": DEFAULT_CWD,
        "default_job_shell": e.job_shell or DEFAULT_JOB_SHELL,
        "flux_imp_path": e.imp,
        "exec_service": e.service,
        "exec_service_override": int(e.service_override),
        "default_barrier_timeout": e.barrier_timeout,
        "shell_exit_timeout": e.shell_exit_timeout,
        "sdexec_stop_timer_sec": e.sdexec_stop_timer_sec,
        "sdexec_stop_timer_signal": e.sdexec_stop_timer_signal,
        "sdexec_constrain_resources": int(e.sdexec_constrain_resources),
        "sdexec_properties": dict(e.sdexec_properties) or None,
    }
    return {
        name: values[name]
        for name in _CONFIG_STATS
        if values[name] is not None and name not in leaving_out
    }


#: The most ``max-kill-count`` takes: past it, the time of the last attempt
#: is beyond what a float holds (a 400-digit count was a traceback).
MAX_KILL_COUNT = 2**31 - 1


def exact_seconds(seconds: float) -> float:
    """``seconds`` to the nanosecond: a sum of decimal timeouts drifts in
    binary floating point (1.1 s over four attempts is 13.200000000000001),
    past a limit written as the same decimal."""
    return round(seconds, 9)


def final_kill_attempt(kill_timeout: float, max_kill_count: int) -> float:
    """Seconds after termination starts at which the job shells get their
    last direct ``kill-signal``, per flux-config-exec(5) JOB TERMINATION.

    The first attempt comes at ``5 * kill_timeout``; the wait before the next
    starts at ``kill_timeout`` and doubles after each attempt, capped at
    :data:`MAX_KILL_INTERVAL`. ``(1.0, 4)``: attempts at 5, 6, 8 and 12 s,
    so 12.0.
    """
    at, interval, attempts = exact_seconds(5 * kill_timeout), kill_timeout, 1
    while attempts < max_kill_count:
        at = exact_seconds(at + interval)
        attempts += 1
        doubled = min(interval * 2, MAX_KILL_INTERVAL)
        if doubled == interval:
            # At the cap every further attempt adds the same: sum them at
            # once, so a huge max-kill-count cannot stall a config check.
            return exact_seconds(at + (max_kill_count - attempts) * interval)
        interval = doubled
    return at


def default_config() -> Config:
    """The configuration in force when no file is given."""
    return Config()


# --- value checks: each takes the value as written and returns the value to
# --- use, or raises ValueError saying what was expected. ------------------


def _expected(what: str, value: object) -> ValueError:
    return ValueError(f"expected {what}, got {json_quoted(value)}")


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"Expected true or false, got {json_quoted(value)}")
    return value


def _string(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise _expected("a non-empty string", value)
    return value


def _one_of(*allowed: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if value not in allowed:
            raise _expected(" or ".join(f'"{choice}"' for choice in allowed), value)
        return value

    return check


#: ``[systemd] bus``, and twistd's ``--bus``.
_BUS = _one_of("user", "system")


def _searchpath(value: object) -> str:
    """Colon-separated absolute directories (read again at each reload,
    after twistd may have changed the working directory); empty entries
    are skipped."""
    if not isinstance(value, str):
        raise _expected("a string of colon-separated directories", value)
    for directory in filter(None, value.split(":")):
        if not os.path.isabs(directory):
            raise ValueError(f"{json_quoted(directory)} is not an absolute directory")
        _check_no_nul(directory)
    return value


def _integer(minimum: int, maximum: int | None = None) -> Callable[[object], int]:
    what = (
        f"an integer of at least {minimum}"
        if maximum is None
        else f"an integer from {minimum} to {maximum}"
    )

    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _expected(what, value)
        if value < minimum or (maximum is not None and value > maximum):
            raise _expected(what, value)
        return value

    return check


def _percent(value: object) -> float:
    """``max-start-delay-percent``: any finite number. Flux's job-exec takes
    a negative one too ("F"): any delay is then beyond it."""
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # a YAML integer can be too large for a float
            number = math.inf
    if not math.isfinite(number):
        raise _expected("a finite number", value)
    return number


#: ``exec.sdexec-stop-timer-sec = 0``'s refusal: why it is not taken.
_ZERO_STOP_TIMER = (
    "0 would signal a unit's remaining processes as it enters deactivating"
    " and abandon it at once, draining the node (Flux's sdexec does so): write"
    " a positive number of seconds, or leave it out (or write a negative"
    " value, as Flux's job-exec reads it) for the default"
)


def _stop_timer_sec(value: object) -> int | None:
    """``exec.sdexec-stop-timer-sec``: seconds, or ``None`` (derived) for a
    negative value, which Flux's job-exec takes as unset
    (``derive_sdexec_stop_timer_sec``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            return None
        if value == 0:
            raise ValueError(_ZERO_STOP_TIMER)
    if isinstance(value, int) and value > MAX_STOP_TIMER_SEC:
        raise ValueError(
            f"expected at most {MAX_STOP_TIMER_SEC} (Flux's job-exec reads this"
            f" key as a C int, where a larger value wraps), got {value}"
        )
    return _integer(1, MAX_STOP_TIMER_SEC)(value)


#: The shortest timeout taken: shorter ones act as 0 (a kill-timeout of
#: 1e-320 s sent every signal of a sequence, and its verdict, at once).
MIN_TIMEOUT_S = 0.001


def _duration_or_none(value: Any) -> float:
    """A duration, or ``"none"`` for 0 (disabled), as Flux's job-exec reads
    ``exec.shell-exit-timeout``."""
    if value == "none":
        return 0.0
    try:
        return _reported_duration('"none"')(value)
    except InfiniteDurationError:
        raise
    except ValueError as error:
        raise ValueError(f'{error}, or "none"') from None


def _reported_duration(disabled: str) -> Callable[[Any], float]:
    """A duration sdexec only reports (``barrier-timeout``,
    ``shell-exit-timeout``), where an infinite one is no timeout at all to
    Flux's job-exec (its timer never fires), as ``disabled`` is: the
    refusal of an infinite one says to write that."""

    def check(value: Any) -> float:
        try:
            return parse_fsd(value)
        except InfiniteDurationError as error:
            raise InfiniteDurationError(
                f"{error}; for no timeout, which is what Flux's job-exec makes"
                f" of it, write {disabled}"
            ) from None

    return check


def _positive_duration(value: Any) -> float:
    seconds = parse_fsd(value)
    if seconds == 0:
        raise _expected("a duration greater than 0", value)
    if seconds < MIN_TIMEOUT_S:
        raise _expected("a duration of at least 1ms", value)
    return seconds


def _class_name(value: Any) -> str:
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise _expected("a fully-qualified class name such as pkg.module.Class", value)
    return value


def _endpoint(value: object) -> str:
    return _server_endpoint(value)[0]


def _server_endpoint(
    value: object, such_as: str = "unix:/path or tcp:PORT"
) -> tuple[str, object | None]:
    """An endpoint's description, checked, and what Twisted makes of it
    (``None`` for a ``systemd:`` one, whose sockets exist only in the unit);
    a refusal names what is taken (``such_as``)."""
    description = _string(value)
    if is_systemd_endpoint(description):
        _check_systemd_endpoint(value, description)
        return description, None
    try:
        # Parsing builds an endpoint without touching the reactor, so any
        # stand-in will do; this catches "tpc:8490" long before a listen.
        endpoint = serverFromString(None, description)
        _check_endpoint_address(endpoint)
    except (ValueError, TypeError, KeyError, OSError) as error:  # OSError: ssl's key
        raise ValueError(
            f"{json_quoted(value)} is not a Twisted server endpoint"
            f" such as {such_as} ({error}{_ipv6_hint(description)})"
        ) from None
    path = getattr(endpoint, "_address", None)
    if isinstance(path, str) and not os.path.isabs(path):
        # Made in the working directory, / under the units, where no client
        # looks (stats-socket and topology are refused so too).
        raise ValueError(
            f"{json_quoted(value)}: expected an absolute socket path (unix:/path)"
        )
    return description, endpoint


#: An IPv6 address given as an endpoint's ``interface=`` with its colons
#: unescaped (``interface=fd00::5``, ``interface=[::1]``): Twisted splits the
#: description at each, and says only "got multiple values for argument".
_UNESCAPED_IPV6_INTERFACE = re.compile(r"interface=(?:\[|[0-9A-Fa-f]*:)")


def _ipv6_hint(description: str) -> str:
    if not _UNESCAPED_IPV6_INTERFACE.search(description):
        return ""
    return (
        "; an IPv6 address's colons are escaped with a backslash:"
        " interface=fd00\\:\\:5 (in TOML a 'literal string' keeps it as written)"
    )


def _listen_endpoint(value: object) -> str:
    """``listen``: an endpoint on a UNIX socket. The service knows who a
    client is by its uid (``SO_PEERCRED``, docs/operating.md); over TCP
    there is none, and every connection, the owner's too, was refused."""
    description, endpoint = _server_endpoint(value, "unix:/path")
    if endpoint is None:
        unix = systemd_endpoint_domain(description) == "UNIX"
    else:
        unix = isinstance(endpoint, UNIXServerEndpoint)
    if not unix:
        raise ValueError(
            f"{json_quoted(value)}: requests are served on a UNIX socket only (the"
            " service knows its clients by their uid, which a TCP connection"
            " does not carry): give unix:PATH, or systemd:domain=UNIX:name=NAME"
        )
    return description


#: The options of twistd's command line that stand for a key of the file.
_COMMAND_LINE_CHECKS: dict[str, Callable[[object], str]] = {
    "--listen": _listen_endpoint,
    "--stats": _endpoint,
    "--bus": _BUS,
}


def check_command_line_option(option: str, value: str | None) -> str | None:
    """A ``--listen``, ``--stats`` or ``--bus`` of twistd's command line,
    checked as the file's ``listen``, ``stats`` and ``bus`` are (a
    malformed endpoint ended in a traceback at the listen):
    :class:`ConfigError` naming the option."""
    if not value:
        return value  # none given: the file's (an empty one, as before)
    try:
        return _COMMAND_LINE_CHECKS[option](value)
    except ValueError as error:
        raise ConfigError("<command line>", option, str(error)) from None


def _check_endpoint_address(endpoint: object) -> None:
    """What Twisted parses but only a listen would refuse, at start: a port
    outside 0-65535, a UNIX socket without a path or with one too long.
    (Its endpoints keep these as ``_port`` and ``_address``.)"""
    port = getattr(endpoint, "_port", None)
    if isinstance(port, int) and not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not from 0 to 65535")
    path = getattr(endpoint, "_address", None)
    if isinstance(path, str):
        if not path:
            raise ValueError("no socket path")
        _check_socket_path_length(path)


def _check_socket_path_length(path: str) -> None:
    _check_no_nul(path)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"a socket path is at most {MAX_SOCKET_PATH} bytes,"
            f" this one has {len(os.fsencode(path))}"
        )


def _check_systemd_endpoint(value: object, description: str) -> None:
    try:
        check_systemd_endpoint(description)
    except ValueError as error:
        raise ValueError(
            f"{json_quoted(value)} is not a systemd socket endpoint such as"
            f" systemd:domain=UNIX:name=sdexec ({error})"
        ) from None


# A unit name of type slice (systemd's unit_name_is_valid, slices only).
_SLICE_NAME = re.compile(r"[A-Za-z0-9:_.\-]{1,249}\.slice")


def _slice(value: object) -> str:
    if not isinstance(value, str) or not _is_slice_name(value):
        raise _expected(
            "a slice unit name such as sdexec.slice (letters, digits, : _ . -;"
            " a dash only between two names, as in jobs-gpu.slice)",
            value,
        )
    return value


def _is_slice_name(name: str) -> bool:
    """Whether systemd takes ``name`` for a slice: a dash in it nests the
    slice in its parent (``jobs-gpu.slice`` in ``jobs.slice``), so none may
    lead, trail or follow another, but ``-.slice``, the root slice."""
    if _SLICE_NAME.fullmatch(name) is None:
        return False
    stem = name.removesuffix(".slice")
    return stem == "-" or not (
        stem.startswith("-") or stem.endswith("-") or "--" in stem
    )


def _users(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _expected("a list of user names or uids", value)
    return tuple(_uid(user) for user in value)


def _uid(user: object) -> int:
    if isinstance(user, int) and not isinstance(user, bool) and user >= 0:
        return user
    if not isinstance(user, str) or not user:
        raise _expected("a user name or a uid (an integer of at least 0)", user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        # Python's pwd says KeyError for a name not found and for a name
        # service that cannot answer (sssd or LDAP not up yet at boot) alike.
        raise _LookupFailed(
            f"no such user: {json_quoted(user)} (or the name service cannot answer yet)"
        ) from None


class _LookupFailed(ValueError):
    """A name the name service did not resolve: the same file may load on a
    later try, once sssd or LDAP answers (a transient :class:`ConfigError`,
    which the units restart)."""


def _absolute_path(value: object) -> str:
    """A path that means one file whatever the working directory: the
    service reads its files again at each reload, after twistd may have
    changed it (``-d``, ``--chroot``)."""
    if not isinstance(value, str) or not os.path.isabs(value):
        raise _expected("an absolute path", value)
    _check_no_nul(value)
    return value


def _check_no_nul(path: str) -> None:
    # The system's calls end a path at its first NUL: Python refuses it
    # ("embedded null byte", naming neither the file nor the key).
    if "\0" in path:
        raise ValueError(f"a path cannot hold a NUL character: {json_quoted(path)}")


def _socket_path(value: object) -> str:
    path = _absolute_path(value)
    _check_socket_path_length(path)
    return path


def _socket_mode(value: object) -> int:
    text = value if isinstance(value, str) else ""
    if re.fullmatch(r"0?[0-7]{3}", text) is None:
        error = _expected('permissions in octal, as a string such as "0600"', value)
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and 0 <= value <= 0o777
        ):
            # YAML reads an unquoted 0600, TOML 0o600, as the number 384.
            hint = f" (the number 0{value:o} in octal: quote it)"
            raise ValueError(f"{error}{hint}")
        raise error
    return int(text, 8)


def _frame_size(value: object) -> int:
    # SizeTooLarge too: _expected_size says why.
    with contextlib.suppress(ValueError):
        size = _size(value)
        if size >= MiB:
            return size
    raise _expected_size(f"a size of at least 1M (bytes, or with {SUFFIXES})", value)


def _size(value: object) -> int:
    """Bytes in a size as the file writes it: an integer, or a string with
    an optional suffix; ``ValueError`` (:class:`SizeTooLarge` for one of
    16E or more, either way) if it is not one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return bounded_size(value, value)
    if isinstance(value, str):
        return parse_size(value)
    raise ValueError("not a size")


def _retained_size(value: object) -> int:
    try:
        return parse_retained_size(value)
    except ValueError:
        raise _expected_size(
            f"a size ≥ 0 (bytes, or with {SUFFIXES}; 0 keeps none)", value
        ) from None


def _expected_size(what: str, value: object) -> ValueError:
    """``_expected(what, value)``, unless ``value`` is a size of 16E or
    more: ``what`` ("at least 1M", "≥ 0") would not say what is wrong."""
    too_large = _too_large(value)
    return ValueError(too_large) if too_large else _expected(what, value)


def _too_large(value: object) -> str | None:
    """Why ``value`` is refused, if it is a size of 16E or more (the bound
    of every size: systemd holds them in 64 bits); else ``None``."""
    try:
        _size(value)
    except SizeTooLarge:
        return f"too large: expected a size under 16E, got {json_quoted(value)}"
    except ValueError:
        pass
    return None


#: Every memory size read as Flux reads a limit's (:class:`MemoryLimit`):
#: one a site wrote with a leading zero is refused, since Flux reads it as
#: octal where sdexec before read it as decimal (``0100M`` was 100M, now
#: 64M): the site's cap would have changed under it unsaid.
_MEMORY_SIZES = MEMORY_PROPERTIES | SCALED_MEMORY_PROPERTIES | STARTUP_MEMORY_PROPERTIES


def _check_memory_limit(name: str, value: str) -> None:
    """A site's memory limit, read as a request's is (Flux's reading)."""
    try:
        MemoryLimit.parse(value)
    except SizeNotTaken as error:
        # written as a size, but not one sdexec takes: its own reason
        raise _PropertyError(name, _too_large(value) or str(error)) from None
    except ValueError:
        raise _PropertyError(
            name,
            _too_large(value)
            or f"{json_quoted(value)} is not a memory limit: expected"
            f" {MEMORY_LIMIT_FORMS}",
        ) from None


class _PropertyError(ValueError):
    """A bad entry of ``exec.sdexec-properties``: its name extends the key
    path."""

    def __init__(self, name: object, reason: str) -> None:
        self.name = str(name)
        super().__init__(reason)


def _properties(value: object) -> Mapping[str, str]:
    value = _table_or_empty(value)
    if not isinstance(value, dict):
        raise _expected("a table of systemd unit properties", value)
    for name, setting in value.items():
        _check_property(name, setting)
    try:  # a soft:hard limit as its two properties, as a job gets it
        split = split_rlimit_pairs(value, source="config")
    except PropertyError as error:
        raise _PropertyError(error.label, error.reason) from None
    problem = properties_together_problem(split)
    if problem is not None:
        names, why = problem
        raise _PropertyError(names[0], why)
    return MappingProxyType(dict(value))


def _check_property(name: object, value: object) -> None:
    if not is_property_word(name):
        raise _PropertyError(name, "expected a systemd property name such as MemoryMax")
    reason = site_reserved_reason(name)
    if reason is not None:
        raise _PropertyError(name, f"reserved: {reason}")
    unknown = unknown_property_reason(name, _is_reserved)
    if unknown is not None:
        raise _PropertyError(name, unknown)
    if not isinstance(value, str):
        raise _PropertyError(
            name,
            f"expected a string (all property values are), got {json_quoted(value)}",
        )
    if name in MEMORY_PROPERTIES:
        _check_memory_limit(name, value)
    elif name == "OOMScoreAdjust" and not _is_oom_score_adjust(value):
        raise _PropertyError(
            name, f"expected an integer from -1000 to 1000, got {json_quoted(value)}"
        )
    if name in _MEMORY_SIZES and octal_differs(value):
        raise _PropertyError(
            name,
            f"{json_quoted(value)}: a leading zero makes it octal, as Flux reads"
            " it (sdexec before read it as decimal): write it without the zero,"
            " or in hex (0x...)",
        )
    try:  # the typing every request's properties get, a pair's each part
        for part, text in split_rlimit_pairs({name: value}, "config").items():
            typed_property(part, text, source="config")
    except PropertyError as error:
        raise _PropertyError(name, error.reason) from None


#: The key to write instead of a reserved property the configuration sets
#: otherwise: "sdexec sets Slice itself" left an admin to guess how.
_RESERVED_INSTEAD = {"Slice": "set [sdexec] slice instead"}


def site_reserved_reason(name: str) -> str | None:
    """Why the configuration (or a mapper, in the site's place) may not set
    property ``name``, or ``None``."""
    if name in RESERVED_PROPERTIES:
        instead = _RESERVED_INSTEAD.get(name)
        return f"sdexec sets {name} itself" + (f": {instead}" if instead else "")
    return unit_handling_reason(name)


def _is_reserved(name: str) -> bool:
    return site_reserved_reason(name) is not None


def _is_oom_score_adjust(text: str) -> bool:
    return re.fullmatch(r"[+-]?[0-9]+", text.strip()) is not None and (
        -1000 <= int(text) <= 1000
    )


# --- the schema: one row per key; nested dicts are sub-tables. ------------


@dataclass(frozen=True)
class _Key:
    """One key: how its value is checked and shown, and where it is kept."""

    check: Callable[[Any], Any]
    #: The JSON form for :meth:`Config.effective`.
    show: Callable[[Any], Any] = lambda value: value
    #: The dataclass field, when it is not the key's own python name (the key
    #: is then read back through a property of that name).
    field: str | None = None


_Table = dict[str, "_Key | _Table"]

_EXEC: _Table = {
    "imp": _Key(_string),
    # Flux's job-exec runs jobs through no other ("unsupported exec.service
    # value"): a typo must not pass here and fail every job there.
    "service": _Key(_one_of("rexec", "sdexec")),
    "service-override": _Key(_boolean),
    # Flux's job-exec refuses any other ("unknown exec.method").
    "method": _Key(_one_of("bulk-exec", "bgexec")),
    "job-shell": _Key(_string),
    "shell-exit-timeout": _Key(_duration_or_none),
    "kill-timeout": _Key(_positive_duration),
    "max-kill-count": _Key(_integer(1, MAX_KILL_COUNT)),
    "max-kill-timeout": _Key(_positive_duration),
    "term-signal": _Key(parse_signal, show=signal_name),
    "kill-signal": _Key(parse_signal, show=signal_name),
    "barrier-timeout": _Key(_reported_duration('"0"')),
    "max-start-delay-percent": _Key(_percent),
    "testexec": {"allow-guests": _Key(_boolean)},
    "sdexec-constrain-resources": _Key(_boolean),
    "sdexec-properties": _Key(_properties, show=dict),
    "sdexec-stop-timer-sec": _Key(
        _stop_timer_sec, field="sdexec_stop_timer_sec_configured"
    ),
    "sdexec-stop-timer-signal": _Key(parse_signal, show=signal_name),
}

_SDEXEC: _Table = {
    "mapper": _Key(_class_name),
    "mapper-searchpath": _Key(_searchpath),
    "listen": _Key(_listen_endpoint),
    "listen-backlog": _Key(_integer(1, 2**31 - 1)),  # listen(2) takes an int
    "stats": _Key(_endpoint),
    "rank": _Key(_integer(0, MAX_ID)),  # an id R can name
    "topology": _Key(_absolute_path),
    "max-frame-size": _Key(_frame_size),
    "containment-check": _Key(_one_of("drain", "warn")),
    "log-format": _Key(_one_of("text", "json")),
    "retained-output": _Key(_retained_size),
    "leftover-units": _Key(_one_of("stop", "keep")),
    "slice": _Key(_slice),
    "allow-users": _Key(_users, show=list),
    "request-properties": _Key(parse_request_properties, show=sorted),
    "stats-detail": _Key(_boolean),
    "stats-socket": _Key(_socket_path),
    "socket-mode": _Key(_socket_mode, show=lambda mode: f"{mode:04o}"),
    "max-connections": _Key(_integer(1)),
    "max-connections-per-user": _Key(_integer(1)),
    "max-waitable": _Key(_integer(1)),
    "max-waitable-per-user": _Key(_integer(1)),
    "max-background": _Key(_integer(1)),
    "max-background-per-user": _Key(_integer(1)),
    "max-processes": _Key(_integer(1)),
    "max-processes-per-user": _Key(_integer(1)),
}

_SYSTEMD: _Table = {
    "enable": _Key(_boolean),
    "sdexec-debug": _Key(_boolean),
    "sdbus-debug": _Key(_boolean),
    "max-inflight": _Key(_integer(1)),
    "start-timeout": _Key(_positive_duration),
    "reconnect-timeout": _Key(_positive_duration),
    "bus": _Key(_BUS),
}

_SCHEMA: dict[str, tuple[_Table, type]] = {
    "exec": (_EXEC, ExecConfig),
    "sdexec": (_SDEXEC, SdexecConfig),
    "systemd": (_SYSTEMD, SystemdConfig),
}


def _python_name(key: str) -> str:
    return key.replace("-", "_")


def _read_table(
    spec: _Table, data: object, path: str, source: str, prefix: str = ""
) -> dict[str, Any]:
    """Check one table of the file against its spec; the dataclass fields it
    sets, sub-tables flattened (``testexec.allow-guests`` sets
    ``testexec_allow_guests``)."""
    data = _table_or_empty(data)
    if not isinstance(data, dict):
        raise ConfigError(source, path, f"expected a table, got {json_quoted(data)}")
    fields: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{_key_text(key)}"
        entry = spec.get(key) if isinstance(key, str) else None
        if entry is None:
            raise ConfigError(source, key_path, _unknown_key(key, spec, path))
        if isinstance(entry, dict):
            fields |= _read_table(
                entry, value, key_path, source, f"{prefix}{_python_name(key)}_"
            )
            continue
        if entry.check is not _socket_mode:  # whose own refusal says "quote it"
            _refuse_yaml11_numbers(value, key_path, source)
        try:
            checked = entry.check(value)
        except _PropertyError as error:
            name = _key_text(error.name)
            raise ConfigError(source, f"{key_path}.{name}", str(error)) from None
        except RequestPropertiesEntryError as error:
            where = f"{key_path}[{error.index}]"
            raise ConfigError(source, where, str(error)) from None
        except _LookupFailed as error:
            raise ConfigError(source, key_path, str(error), transient=True) from None
        except ValueError as error:
            raise ConfigError(source, key_path, str(error)) from None
        fields[entry.field or prefix + _python_name(key)] = checked
    return fields


def _table_or_empty(data: object) -> object:
    """A table as written, or an empty one for ``None``: a YAML table whose
    every key is commented out (``exec:`` then ``# kill-timeout: 5s``)
    reads as null, where TOML's ``[exec]`` with the same comments is an
    empty table."""
    return {} if data is None else data


def _refuse_yaml11_numbers(value: object, key_path: str, source: str) -> None:
    """``ConfigError`` if ``value``, or an item of it (``allow-users``,
    ``sdexec-properties``), is a number YAML 1.1 read otherwise than
    TOML and YAML 1.2 would: ``0640`` is 416 to pyyaml, and no admin
    writing ``sdexec-stop-timer-sec: 0640`` means that."""
    # Each named as its entry: a property by its name, a list item by its
    # place; and where strings are wanted (property values, user names),
    # advised quoted.
    items: list[tuple[str, object, bool]] = [(key_path, value, False)]
    if isinstance(value, dict):
        items += [(f"{key_path}.{_key_text(k)}", v, True) for k, v in value.items()]
    elif isinstance(value, list):
        items += [(f"{key_path}[{i}]", v, True) for i, v in enumerate(value)]
    for path, item, a_string in items:
        if isinstance(item, _Yaml11Number):
            raise ConfigError(source, path, _yaml11_number_reason(item, a_string))


def _yaml11_number_reason(number: _Yaml11Number, a_string: bool = False) -> str:
    """Why ``number`` is refused, and what to write: the number as TOML would
    read it, or (``a_string``: a value that must be one) quoted."""
    # The number formats as its own type does: 90, 90.5.
    if ":" in number.text:
        why = (
            f"{number.text} is a base-60 number to YAML 1.1 ({number}),"
            " a string to YAML 1.2 and an error in TOML"
        )
        meant, quoted = f"{number}", ""
    else:
        why = (
            f"{number.text} has a leading zero, which YAML 1.1 reads as octal"
            f" ({number}), YAML 1.2 as decimal and TOML not at all"
        )
        meant = str(int(number.text.replace("_", ""), 10))
        quoted = f' ("{number.text}")'
    if a_string:
        return f'{why}: quote it ("{number.text}", or "{meant}")'
    return f"{why}: write {meant}, or quote it{quoted} where a string is meant"


def _key_text(key: object) -> str:
    """A key as a message names it: as written, or quoted (as TOML quotes
    one) where it holds what would break the line."""
    text = str(key)
    return text if text.isprintable() else json.dumps(text)


def _unknown_key(key: object, spec: _Table, path: str) -> str:
    reason = f"unknown key in [{path}]"
    close = difflib.get_close_matches(str(key), spec, n=1)
    return f"{reason} (did you mean {close[0]}?)" if close else reason


def _show_table(spec: _Table, settings: object, prefix: str = "") -> dict[str, Any]:
    """The JSON form of one table, every key present."""
    shown: dict[str, Any] = {}
    for key, entry in spec.items():
        name = prefix + _python_name(key)
        if isinstance(entry, dict):
            shown[key] = _show_table(entry, settings, f"{name}_")
            continue
        value = getattr(settings, name)
        shown[key] = None if value is None else entry.show(value)
    return shown


def parse_config(data: dict, source: str = "<config>") -> Config:
    """Check a parsed file (tables as dicts) and build its :class:`Config`.

    ``ConfigError`` names the first problem; unknown top-level tables are
    ignored, logged and listed in ``Config.warnings``.
    """
    config = build_config(data, source)
    log_warnings(config)
    return config


def log_warnings(config: Config) -> None:
    """Log what :func:`build_config` found worth a warning."""
    for warning in config.warnings:
        _log.warn("{warning}", warning=warning)


def build_config(data: Any, source: str = "<config>") -> Config:
    """:func:`parse_config` without its logging: a thread may run it (user
    names are looked up, through sssd or LDAP on a site's nodes)."""
    if not isinstance(data, dict):
        raise ConfigError(source, None, "expected a document of tables")
    unknown = _unknown_tables(data, source)
    sections = {
        name: cls(**_read_table(spec, data[name], name, source))
        for name, (spec, cls) in _SCHEMA.items()
        if name in data
    }
    config = Config(source=source, warnings=_ignoring(unknown, source), **sections)
    try:
        _check_across_tables(config)
    except ConfigError as error:
        if not unknown:
            raise
        # What the rule missed may be in a table that was ignored.
        ignored = ", ".join(f"[{name}]" for name in unknown)
        reason = f"{error.reason} (ignored as unknown: {ignored})"
        raise ConfigError(
            error.source, error.key, reason, related=error.related
        ) from None
    later = (
        _flux_would_refuse(data, source)
        + _retained_fits_a_frame(config)
        + allowed_users_cannot_connect(config)
        + _signals_that_end_nothing(config)
    )
    return replace(config, warnings=config.warnings + later)


def _flux_would_refuse(data: dict, source: str) -> tuple[str, ...]:
    """A warning for each value of ``[exec]`` that Flux's job-exec, reading
    the same file, would refuse (sdexec/fluxforms.py). Flux reads TOML and
    JSON: a YAML file is sdexec's alone."""
    if _is_yaml(source):
        return ()
    return flux_refusals(data.get("exec") or {}, source)


def _check_across_tables(config: Config) -> None:
    """The rules that involve more than one key."""
    if config.exec.service == "sdexec" and not config.systemd.enable:
        raise ConfigError(
            config.source,
            "exec.service",
            '"sdexec" requires systemd.enable = true',
            related=("systemd.enable",),
        )
    if not math.isfinite(config.exec.effective_max_kill_timeout):
        # Reported as `Infinity` (not JSON) by the checker and /stats.
        raise ConfigError(
            config.source,
            "exec.kill-timeout",
            f"{config.exec.kill_timeout:g} s, with max-kill-count"
            f" {config.exec.max_kill_count}, puts the last kill attempt past any"
            " time: lower it, or set max-kill-timeout",
        )
    if config.exec.sdexec_stop_timer_sec > MAX_STOP_TIMER_SEC:
        # Only a derived value can get here: an explicit one is range-checked.
        raise ConfigError(
            config.source,
            "exec.sdexec-stop-timer-sec",
            "the default, the effective max-kill-timeout"
            f" ({config.exec.effective_max_kill_timeout:g} s) rounded up, is more"
            f" than the {MAX_STOP_TIMER_SEC} s Flux's job-exec can hold (a C"
            " int): lower"
            " max-kill-timeout, kill-timeout or max-kill-count, or set"
            " sdexec-stop-timer-sec",
        )


#: How many times its size the retained output of one process may take as
#: one ``wait`` answer: 6 bytes of JSON per control character (``\u0001``),
#: plus up to an io object per 32 bytes on average (sdexec/retained.py).
RETAINED_JSON_FACTOR = 8


def _retained_fits_a_frame(config: Config) -> tuple[str, ...]:
    """A warning if one process's retained output may not fit one answer:
    its ``wait`` would then fail at the client, which reads answers of up
    to :data:`DEFAULT_MAX_FRAME` whatever ``max-frame-size`` says (that
    key bounds what the service reads). A warning, not an error: a larger
    ``retained-output`` alone, accepted before, must not stop the service
    from starting."""
    retained = config.sdexec.retained_output
    if retained * RETAINED_JSON_FACTOR <= DEFAULT_MAX_FRAME:
        return ()
    return (
        f"{config.source}: sdexec.retained-output: {retained} bytes may take"
        f" {RETAINED_JSON_FACTOR} times as many in one wait answer, more than"
        f" the {DEFAULT_MAX_FRAME} bytes a client reads in one answer: a wait"
        " for a process that wrote that much would fail at the client, after"
        " its status was handed out; lower it to at most"
        f" {DEFAULT_MAX_FRAME // RETAINED_JSON_FACTOR}",
    )


#: Signals whose default action neither terminates nor dumps core: a
#: process that does not handle one is stopped by it, or ignores it.
_STOPPING = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
_IGNORED = frozenset({signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH})
#: What each signal key's signal is for, and what follows if it ends nothing.
_SIGNAL_KEYS = (
    ("term-signal", "term_signal", "a cancelled job ends only at its kill-signal"),
    (
        "kill-signal",
        "kill_signal",
        "a cancelled job that does not end by itself is never killed:"
        " after max-kill-count attempts its node is drained",
    ),
    (
        "sdexec-stop-timer-signal",
        "sdexec_stop_timer_signal",
        "what lingers in a stopped unit is never killed before it is"
        " abandoned and the node drained",
    ),
)


def _signals_that_end_nothing(config: Config) -> tuple[str, ...]:
    """A warning for each termination signal that ends no process which
    does not handle it (``SIGSTOP``, ``SIGCONT``…). Flux's job-exec takes
    any signal, so this is not an error: the same file must load in both."""
    warnings = []
    for key, field_name, consequence in _SIGNAL_KEYS:
        number = getattr(config.exec, field_name)
        if number in _STOPPING:
            action = "stops a process without ending it"
        elif number in _IGNORED:
            action = "is ignored by a process that does not handle it"
        else:
            continue
        warnings.append(
            f"{config.source}: exec.{key}: {signal_name(number)} {action}:"
            f" {consequence}"
        )
    return tuple(warnings)


def users_a_mode_may_keep_out(config: Config) -> tuple[int, ...]:
    """The uids of ``allow-users`` that a socket's mode may keep out: all
    but root, which needs no permission (``CAP_DAC_OVERRIDE``)."""
    return tuple(uid for uid in config.sdexec.allow_users if uid != 0)


def allowed_users_cannot_connect(config: Config) -> tuple[str, ...]:
    """A warning if ``allow-users`` names users whom ``socket-mode`` keeps
    out of every socket the service makes: they would get EACCES, not the
    service's EPERM, and nothing would say why. (Judged again by a reload
    that keeps the ``socket-mode`` in force.)"""
    # Connecting to a UNIX socket takes write permission on it.
    if not users_a_mode_may_keep_out(config) or config.sdexec.socket_mode & 0o022:
        return ()
    if is_systemd_endpoint(config.sdexec.listen or ""):
        # A socket systemd made has its .socket unit's mode, whatever
        # socket-mode says: the service judges it once listening.
        return ()
    if (endpoint_mode(config.sdexec.listen or "") or 0) & 0o022:
        # listen's own mode= lets them connect, whatever socket-mode says
        # (the service judges its directories once listening).
        return ()
    return (
        f"{config.source}: sdexec.allow-users: the users listed cannot connect:"
        f" socket-mode {config.sdexec.socket_mode:04o} lets only the owner connect"
        ' (give "0660" with a group they share, or "0666"), unless listen'
        " names its own mode=; they also need search permission on the"
        " socket's directories",
    )


#: How close a table's name must be to one of sdexec's to be taken for a
#: misspelling of it: ``[sytemd]``, ``[sdexe]``, ``[exce]``, while no table
#: of a Flux system configuration is (test_config.py checks flux-config(5)'s).
_TABLE_TYPO_CUTOFF = 0.75


def _unknown_tables(data: dict, source: str) -> tuple[str, ...]:
    """The names of the tables sdexec does not read. Flux ignores them (each
    of its modules reads its own), and sdexec takes a Flux system file
    as it is, so they are only warned about (:func:`_ignoring`); but one
    that is a near miss of a table of sdexec's is a typo, whose keys would
    be silently left out: ``ConfigError``, with the table meant."""
    unknown = tuple(_key_text(name) for name in data if name not in _SCHEMA)
    for name in unknown:
        _refuse_dotted_key(name, source)
        meant = _table_meant(name)
        if meant is not None:
            reason = f"unknown table (did you mean [{meant}]?)"
            raise ConfigError(source, f"[{name}]", reason)
    return unknown


def _refuse_dotted_key(name: str, source: str) -> None:
    """``ConfigError`` for a top-level key that names a key of sdexec's
    tables with dots, as flux-config-exec(5) writes them
    (``exec.kill-timeout``): one key in YAML (or quoted in TOML), not
    nested, so a table ignored as unknown, and the defaults in force."""
    table, dot, rest = name.partition(".")
    if not dot or table.lower() not in _SCHEMA:
        return
    *tables, key = [table.lower(), *rest.split(".")]
    if _is_yaml(source):
        under = ", under ".join(f'"{table}:"' for table in reversed(tables))
        reason = (
            f'a dotted key is not nested in YAML: write "{key}:" indented under {under}'
        )
        raise ConfigError(source, name, reason)
    if Path(source).suffix.lower() == ".json":
        objects = "".join(f'{{"{table}": ' for table in tables)
        reason = f'a dotted key is not nested in JSON: write {objects}{{"{key}": …}}'
        raise ConfigError(source, json.dumps(name), reason + "}" * len(tables))
    reason = (
        f"a quoted dotted key is one key, not nested: write {key} in"
        f" [{'.'.join(tables)}], or the key unquoted"
    )
    raise ConfigError(source, json.dumps(name), reason)


def _table_meant(name: str) -> str | None:
    """The table of sdexec's that ``name`` misspells, if any."""
    same_but_case = [known for known in _SCHEMA if known == name.lower()]
    close = same_but_case or difflib.get_close_matches(
        name, _SCHEMA, n=1, cutoff=_TABLE_TYPO_CUTOFF
    )
    return close[0] if close else None


def _ignoring(unknown: tuple[str, ...], source: str) -> tuple[str, ...]:
    return tuple(f"{source}: ignoring unknown table [{name}]" for name in unknown)


# --- files ---------------------------------------------------------------

_YAML_SUFFIXES = (".yaml", ".yml")


def _is_yaml(source: str) -> bool:
    """Whether the file ``source`` is read as YAML (by its suffix; a
    directory's files are TOML, whatever its name)."""
    return Path(source).suffix.lower() in _YAML_SUFFIXES and not os.path.isdir(source)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read, check and build the configuration in a ``.toml``, ``.json``,
    ``.yaml`` or ``.yml`` file, or in a directory of ``*.toml`` files (as Flux reads its
    ``conf.d``); ``ConfigError`` naming the file if it cannot be read, does
    not parse or does not check."""
    config = load_config_quietly(path)
    log_warnings(config)
    return config


def load_config_quietly(path: str | os.PathLike[str]) -> Config:
    """:func:`load_config` without its logging (:func:`log_warnings`): a
    thread may run it, as a reload does (a large YAML file takes seconds to
    parse, a user name to look up)."""
    data, source = read_config_file(path)
    if not isinstance(data, _Fragments):
        return build_config(data, source)
    try:
        config = build_config(data, source)
    except ConfigError as error:
        raise data.naming_the_file(error) from None
    warnings = tuple(data.naming_the_file_in(w, source) for w in config.warnings)
    return replace(config, warnings=(*data.overridden, *data.not_read, *warnings))


def read_config_file(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """The document a ``.toml``, ``.json``, ``.yaml`` or ``.yml`` file holds, or the
    ``*.toml`` files of a directory merged, unchecked, and its absolute
    path; ``ConfigError`` naming the file if it cannot be read or does not
    parse."""
    source = os.fspath(path)
    if os.path.isdir(source):
        directory = os.path.abspath(source)
        return _read_directory(directory), directory
    suffix = Path(source).suffix.lower()
    if suffix not in _PARSERS:
        raise ConfigError(
            os.path.abspath(source), None, "expected a .toml, .json, .yaml or .yml file"
        )
    try:
        # Absolute: a reload reads it again, after twistd may have changed
        # the working directory (-d, --chroot).
        source = os.path.abspath(source)
        text = read_text_file(source)
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(source, None, _read_failure(error)) from None
    return _PARSERS[suffix](text, source), source


class _Fragments(dict):
    """The tables of a directory's ``*.toml`` files, merged as Flux merges
    its ``conf.d`` (flux-config(5); ``json_object_update_recursive``, file
    by file in name order): a table in two files holds the keys of both, a
    key in two files the later file's value. Knows which file set each key,
    so that an error names the file to edit, not the directory."""

    def __init__(self) -> None:
        super().__init__()
        #: The file that last set each key path (``"exec.kill-timeout"``).
        self.origins: dict[str, str] = {}
        #: The files that set again a key an earlier file set, by key path.
        self._setters: dict[str, _Setters] = {}
        #: A warning for each file of the directory in a format sdexec
        #: reads alone (YAML, JSON, a .TOML) that is not read there.
        self.not_read: tuple[str, ...] = ()

    @property
    def overridden(self) -> list[str]:
        """One warning for each key that more than one file set, naming
        the file whose value is used and the earlier ones: one per key, not
        per file (a conf.d of thousands of files each setting the same key
        logged thousands of lines on the reactor, and Twisted's start-up
        buffer kept only the last 200 of them)."""
        return [setters.warning(path) for path, setters in self._setters.items()]

    def merge(self, table: dict, source: str) -> None:
        """Merge the document of the file ``source`` into this one."""
        self._merge_into(self, table, source, "")

    def _merge_into(self, into: dict, table: dict, source: str, prefix: str) -> None:
        for key, value in table.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                self._merge_into(into[key], value, source, f"{path}.")
                continue
            if key in into:
                earlier = self.origins[path]
                self._setters.setdefault(path, _Setters(earlier)).add(source)
            into[key] = value
            self._set_origins(path, value, source)

    def _set_origins(self, path: str, value: object, source: str) -> None:
        self.origins[path] = source
        if isinstance(value, dict):
            for key, inner in value.items():
                self._set_origins(f"{path}.{key}", inner, source)

    def naming_the_file(self, error: ConfigError) -> ConfigError:
        """``error`` (raised naming the directory) naming the file that set
        its key instead, where one did."""
        origin = self._origin(error.key or "")
        if origin is None:
            return error
        # The file that set the other key of the rule: "10-exec.toml:
        # exec.service: "sdexec" requires systemd.enable = true" named only
        # the file that was right, not the 90-debug.toml that set false.
        elsewhere = "".join(
            f" ({key} is set in {self.origins[key]})"
            for key in error.related
            if self.origins.get(key, origin) != origin
        )
        return ConfigError(origin, error.key, error.reason + elsewhere)

    def naming_the_file_in(self, warning: str, directory: str) -> str:
        """A warning that names ``directory`` and a key (or an ignored
        table), naming the file that set it instead."""
        rest = warning.removeprefix(f"{directory}: ")
        table = _IGNORED_TABLE.fullmatch(rest)
        origin = self._origin(table[1] if table else rest.partition(": ")[0])
        return warning if origin is None else f"{origin}: {rest}"

    def _origin(self, key: str) -> str | None:
        # request-properties[1], a table as [sytemd], a key as "exec.x"
        path = re.sub(r"\[\d+\]$", "", key).strip('[]"')
        while path and path not in self.origins:
            path = path.rpartition(".")[0]
        return self.origins.get(path)


class _Setters:
    """The files of a directory that set one key, in name order: the first
    one, the count, and the last two (the later one's value is used)."""

    def __init__(self, first: str) -> None:
        self.first = first
        self.previous = first
        self.last = first
        self.count = 1

    def add(self, source: str) -> None:
        """``source``, the next file by name, set the key again."""
        self.previous, self.last = self.last, source
        self.count += 1

    def warning(self, path: str) -> str:
        """The warning for the key ``path``, naming the file to edit first."""
        if self.count == 2:
            earlier = self.first
        elif self.count == 3:
            earlier = f"{self.first} and {self.previous}"
        else:
            earlier = (
                f"{self.count - 1} earlier files (the first {self.first},"
                f" the last {self.previous})"
            )
        return (
            f"{self.last}: {path}: also set in {earlier}; this file's value is"
            " used, as Flux uses it (the later file by name)"
        )


#: The warning :func:`_ignoring` gives, and the table it names.
_IGNORED_TABLE = re.compile(r"ignoring unknown table \[(.+)\]")


#: Why a file of a configuration directory in a format sdexec reads alone
#: is not read there.
_NOT_READ = (
    "not read: only the *.toml files of a directory are, as Flux reads its"
    " conf.d: write its settings in TOML, in a file named *.toml"
)


def _read_directory(directory: str) -> _Fragments:
    """The ``*.toml`` files of ``directory`` merged (:class:`_Fragments`):
    what ``flux-broker --config-path`` reads of a directory. ``.yaml``
    files there are not read, as Flux does not read them (each is named
    in a warning); none at all is the default configuration, as for Flux."""
    try:
        listed = sorted(name for name in os.listdir(directory) if name[:1] != ".")
    except OSError as error:
        raise ConfigError(directory, None, _read_failure(error)) from None
    names = [name for name in listed if name.endswith(".toml")]
    merged = _Fragments()
    # Said, not silently left out: an admin's sdexec.yaml moved into the
    # directory left every setting of it out, its caps and request-properties
    # too, with not a word (Flux, which reads no YAML, never meets one).
    merged.not_read = tuple(
        f"{os.path.join(directory, name)}: {_NOT_READ}"
        for name in listed
        if not name.endswith(".toml") and Path(name).suffix.lower() in _PARSERS
    )
    for name in names:
        source = os.path.join(directory, name)
        try:
            text = read_text_file(source)
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(source, None, _read_failure(error)) from None
        try:
            merged.merge(_parse_toml(text, source), source)
        except RecursionError:  # the merge recurses per table ([a.a.a...])
            raise ConfigError(source, None, _TOO_DEEP) from None
    return merged


#: The most bytes read from a file the configuration is or names (the
#: topology): a large node's hwloc XML is a few MB, a device never ends.
MAX_FILE_BYTES = 64 * 1024 * 1024


def read_text_file(path: str) -> str:
    """The UTF-8 text of the regular file ``path``: ``OSError`` if it cannot
    be read, is not a regular file (a FIFO would block the reader, at a
    reload the whole service; a device may never end) or holds more than
    :data:`MAX_FILE_BYTES`; ``UnicodeDecodeError`` if it is not UTF-8."""
    # Not blocking: opening a FIFO waits for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file")
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8")


def _read_failure(error: OSError | UnicodeDecodeError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return f"cannot read: not UTF-8 text (byte {error.start})"
    return f"cannot read: {error.strerror or error}"


def _parse_toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(
            source, None, f"TOML syntax error: {_toml_words(error, text)}"
        ) from None
    except ValueError as error:  # an integer of thousands of digits
        raise ConfigError(source, None, _unreadable_number(error)) from None
    except RecursionError:  # the parser recurses per nesting level
        raise ConfigError(source, None, _TOO_DEEP) from None


#: A key path as tomllib's messages write it: a Python tuple of strings,
#: ``('sdexec',)``, ``('exec', 'sdexec-properties')``.
_TOML_KEY_TUPLE = re.compile(
    r"""\((?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
    r"""(?:, (?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"))*,?\)"""
)

#: A TOML bare key, written in a table header as it is.
_TOML_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_words(error: tomllib.TOMLDecodeError, text: str) -> str:
    """tomllib's message, each key path it names written as the file's
    table header is (``Cannot declare [sdexec] twice``): it writes them as
    Python tuples (``Cannot declare ('sdexec',) twice``), which no admin
    wrote or can search the file for. Its "Cannot overwrite a value" names
    no key: the key (or table) of the line it gives is named, where found
    in ``text``."""
    words = _TOML_KEY_TUPLE.sub(_toml_table_header, str(error))
    at = _TOML_OVERWRITE.match(words)
    # (At the end of a file with no last line break: its last line.)
    line = (at.group(1) or text.count("\n") + 1) if at else None
    named = _overwritten(text, int(line)) if line else None
    return words.replace(_OVERWRITE, f"{_OVERWRITE}: {named}", 1) if named else words


#: tomllib's words for a key given twice, or a value made a table: the line
#: it gives is the one of the statement's end.
_OVERWRITE = "Cannot overwrite a value"
_TOML_OVERWRITE = re.compile(
    re.escape(_OVERWRITE) + r" \((?:at line (\d+), column \d+|at end of document)\)"
)

#: How many lines before the one tomllib names a statement may begin (a
#: multi-line array): past them, the key is not looked for.
_STATEMENT_LINES = 64

#: The largest file whose overwritten key is looked for, and what tomllib
#: may read in all while it is: finding the statement, its key and its table
#: reads parts of the file again (tomllib is Python: about 0.1 s a MiB).
_KEY_NAMED_UP_TO = 4 << 20


class _ReadingSpent(Exception):
    """The characters :class:`_Reader` may read are spent."""


class _Reader:
    """tomllib for the search of a key given twice, reading at most
    ``budget`` characters in all: each try reads part of the file again,
    and tries over many lines (a multi-line string of ``[a]`` lines before
    the key) or many "=" (a quoted key full of them) made the search
    quadratic, 40 s for a 64 KB file, the reactor held through a reload."""

    def __init__(self, budget: int) -> None:
        self._left = budget

    def loads(self, text: str) -> dict | None:
        """``text`` as TOML, ``None`` if it does not read as TOML;
        :class:`_ReadingSpent` past the budget."""
        self._left -= len(text)
        if self._left < 0:
            raise _ReadingSpent
        try:
            return tomllib.loads(text)
        except (ValueError, RecursionError):  # TOMLDecodeError too
            return None


def _overwritten(text: str, line: int) -> str | None:
    """What the statement ending on ``line`` (1-based) of ``text`` sets:
    ``key sdexec.x`` for a key (its table's path before it), ``table
    [a.b]`` for a table header; ``None`` where it cannot be found, or not
    within :data:`_KEY_NAMED_UP_TO` characters read."""
    if len(text) > _KEY_NAMED_UP_TO:
        return None
    # Lines as tomllib counts them: a "\r" or a "\u2028" in a string ends none.
    lines = [f"{each}\n" for each in text.split("\n", line)[:line]]
    try:
        return _statement_sets(lines, _Reader(_KEY_NAMED_UP_TO))
    except _ReadingSpent:
        return None


def _statement_sets(lines: list[str], toml: _Reader) -> str | None:
    """:func:`_overwritten`'s answer for the statement ending ``lines``."""
    # The statement: the fewest lines up to the last that read alone (its
    # end alone, in a multi-line value, does not).
    line = len(lines)
    first = max(line - _STATEMENT_LINES, 0)
    start = next(
        (k for k in range(line - 1, first - 1, -1) if _reads_alone(lines, k, toml)),
        None,
    )
    if start is None:
        return None
    header = _header_path(lines[start], toml)
    if header is not None:
        return f"table [{_toml_path(header)}]"
    key = _key_path(lines[start], toml)
    if key is None:
        return None
    return f"key {_toml_path(_table_before(lines, start, toml) + key)}"


def _reads_alone(lines: list[str], k: int, toml: _Reader) -> bool:
    """Whether lines ``k`` on are one statement that reads as TOML alone."""
    code = lines[k].strip()
    return (
        bool(code)
        and not code.startswith("#")
        and toml.loads("".join(lines[k:])) is not None
    )


def _table_before(lines: list[str], start: int, toml: _Reader) -> tuple[str, ...]:
    """The key path of the table the line ``start`` is in: the last table
    header before it that is not inside a multi-line value (the lines
    before it read as TOML); ``()``, the root table, if none."""
    for k in range(start - 1, -1, -1):
        path = _header_path(lines[k], toml)
        if path is not None and toml.loads("".join(lines[:k])) is not None:
            return path
    return ()


def _header_path(line: str, toml: _Reader) -> tuple[str, ...] | None:
    """The key path of the table header ``line`` is (``[a.b]``,
    ``[[a.b]]``), as tomllib reads it; ``None`` for another line."""
    if not line.lstrip().startswith("["):
        return None
    table = toml.loads(line)
    return None if table is None else _only_path(table)


def _key_path(line: str, toml: _Reader) -> tuple[str, ...] | None:
    """The key path of the key/value statement ``line`` begins, as tomllib
    reads it: its key is what is before the first "=" that leaves a key (a
    quoted key may hold one); ``None`` if none does."""
    for at, char in enumerate(line):
        table = toml.loads(f"{line[:at]}= 0\n") if char == "=" else None
        if table is not None:
            return _only_path(table)
    return None


def _only_path(table: object) -> tuple[str, ...]:
    """The keys down a table of one key at each level (``{"a": {"b": 0}}``:
    ``("a", "b")``), an array of tables' last table followed."""
    path: list[str] = []
    while isinstance(table, dict | list) and table:
        if isinstance(table, list):
            table = table[-1]
            continue
        (key, table), *_ = table.items()
        path.append(key)
    return tuple(path)


def _toml_path(keys: tuple[str, ...]) -> str:
    """``keys`` written as a dotted TOML key (``exec.sdexec-properties``)."""
    return ".".join(_toml_header_key(key) for key in keys)


def _toml_table_header(match: re.Match[str]) -> str:
    """``[exec.sdexec-properties]`` for the tuple ``match`` found; a key
    that is not bare quoted as TOML (and JSON) quote it, cut as every
    value a message quotes."""
    return f"[{_toml_path(ast.literal_eval(match.group()))}]"


def _toml_header_key(key: str) -> str:
    if _TOML_BARE_KEY.fullmatch(key):
        return printable(key, SHOWN)
    return json_quoted(key)


#: A file of arrays or tables nested past what the parsers can follow.
_TOO_DEEP = "nested too deeply to read (arrays or tables within each other)"


#: What YAML 1.1 (pyyaml) reads as an integer, and neither TOML nor YAML
#: 1.2 reads so: a leading zero (octal to YAML 1.1, decimal to YAML 1.2, an
#: error in TOML) and base 60 (``1:30`` is 90).
_YAML11_ONLY_INTEGER = re.compile(r"[-+]?(?:0[0-7_]+|[1-9][0-9_]*(?::[0-5]?[0-9])+)")

#: What YAML 1.1 (pyyaml) reads as a float, and neither TOML nor YAML 1.2
#: reads so: base 60 (``1:30.5`` is 90.5).
_YAML11_ONLY_FLOAT = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*")

#: A float in exponent form without a dot or a sign in the exponent
#: (``1e2``), as TOML and YAML 1.2 read it; YAML 1.1 reads it as a string.
#: A digit follows a leading point, as in pyyaml's own floats: ``._e1``
#: is no number (pyyaml would fail on it, naming no key), but a string.
_EXPONENT_FLOAT = re.compile(
    # \Z: pyyaml's resolvers match at the start only.
    r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+\Z"
)


class _Yaml11Number:
    """A number YAML 1.1 read in a way TOML does not (see
    :data:`_YAML11_ONLY_INTEGER` and :data:`_YAML11_ONLY_FLOAT`), with its
    text: refused in sdexec's tables, naming the key
    (:func:`_refuse_yaml11_numbers`)."""

    text: str = ""


class _Yaml11Integer(_Yaml11Number, int):
    """An integer so read: ``0640`` (416), ``1:30`` (90)."""


class _Yaml11Float(_Yaml11Number, float):
    """A float so read: ``1:30.5`` (90.5)."""


_Kept = TypeVar("_Kept", _Yaml11Integer, _Yaml11Float)


def _keeping_text(number: _Kept, text: str) -> _Kept:
    number.text = text
    return number


class _YamlLoader(yaml.SafeLoader):
    """``yaml.safe_load``, but read as TOML reads the same file: a key given
    twice in a table is an error instead of the last one silently winning;
    ``1e2`` is a float; a number YAML 1.1 alone reads as it does
    (``0640`` as octal 416, ``1:30.5`` as 90.5) is kept as a
    :class:`_Yaml11Number`, refused where sdexec reads it."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        number = super().construct_yaml_int(node)
        if _YAML11_ONLY_INTEGER.fullmatch(node.value) is None:
            return number
        return _keeping_text(_Yaml11Integer(number), node.value)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        number = super().construct_yaml_float(node)
        if _YAML11_ONLY_FLOAT.fullmatch(node.value) is None:
            return number
        return _keeping_text(_Yaml11Float(number), node.value)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue  # an unhashable key: pyyaml refuses it itself
            if key.value in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key.value}", problem_mark=key.start_mark
                )
            seen.add(key.value)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_constructor("tag:yaml.org,2002:int", _YamlLoader.construct_yaml_int)
_YamlLoader.add_constructor("tag:yaml.org,2002:float", _YamlLoader.construct_yaml_float)
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789")
)


def _parse_yaml(text: str, source: str) -> dict:
    try:
        data = yaml.load(text, Loader=_YamlLoader)  # safe: a SafeLoader
    except yaml.YAMLError as error:
        raise ConfigError(
            source, None, f"YAML syntax error: {_yaml_problem(error, text)}"
        ) from None
    except ValueError as error:  # an integer of thousands of digits
        raise ConfigError(source, None, _unreadable_number(error)) from None
    except RecursionError:  # the composer recurses per nesting level
        raise ConfigError(source, None, _TOO_DEEP) from None
    # An empty (or all-comment) file is a configuration of defaults.
    return {} if data is None else data


def _parse_json(text: str, source: str) -> dict:
    """A ``.json`` file, as Flux's ``flux_conf_parse`` reads one (jansson):
    no ``NaN`` or ``Infinity``. A key given twice in one object is refused,
    as in TOML and YAML, where jansson would keep the last."""
    try:
        return json.loads(
            text, parse_constant=_no_json_constant, object_pairs_hook=_json_object
        )
    except json.JSONDecodeError as error:
        where = f"(at line {error.lineno}, column {error.colno})"
        raise ConfigError(
            source, None, f"JSON syntax error: {error.msg} {where}"
        ) from None
    except ValueError as error:  # a duplicate key, or thousands of digits
        raise ConfigError(source, None, _unreadable_number(error)) from None
    except RecursionError:  # the decoder recurses per nesting level
        raise ConfigError(source, None, _TOO_DEEP) from None


def _no_json_constant(name: str) -> float:
    raise ValueError(f"JSON syntax error: {name} is not a JSON number")


def _json_object(pairs: list[tuple[str, Any]]) -> dict:
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"JSON syntax error: duplicate key {json.dumps(key)}")
        data[key] = value
    return data


def _unreadable_number(error: ValueError) -> str:
    # Python's own words advise changing its settings; the admin's file is
    # what should change.
    if "integer string conversion" in str(error):
        return "a number too long to read (more than 4300 digits)"
    if str(error).startswith("JSON syntax error"):
        return str(error)
    return f"cannot read: {error}"


#: A file's reader, by its suffix (in any case). Flux's flux_conf_parse
#: reads ``.json`` as JSON and any other file as TOML; YAML is sdexec's.
_PARSERS: dict[str, Callable[[str, str], dict]] = {
    ".toml": _parse_toml,
    ".json": _parse_json,
    ".yaml": _parse_yaml,
    ".yml": _parse_yaml,
}


def _yaml_problem(error: yaml.YAMLError, text: str) -> str:
    """pyyaml's message spans several lines; keep what and where. A
    character YAML does not take (a ``ReaderError``: a control character)
    has no mark but a position in ``text``, said as the line and column of
    every other error (its message's second line, cut, said where)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is not None:
        line, column = mark.line, mark.column
    elif isinstance(position := getattr(error, "position", None), int):
        line = text.count("\n", 0, position)
        column = position - (text.rfind("\n", 0, position) + 1)
    else:
        return problem
    return f"{problem} (at line {line + 1}, column {column + 1})"


# --- python3 -m sdexec.config FILE ------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Check a configuration file the way the service will; print the
    effective configuration as JSON and return 0, or print the error and
    return 1."""
    parser = CommandParser(
        prog="python3 -m sdexec.config",
        description="Check an sdexec configuration file and print the"
        " configuration in force as JSON.",
    )
    add_version_option(parser)
    parser.add_argument(
        "file",
        help="a .toml, .json, .yaml or .yml configuration file, or a directory of"
        " *.toml files (as Flux reads its conf.d)",
    )
    args = parser.parse_args(argv)
    # Imported here: containment (and the mapper) build on this module.
    from sdexec.containment import Containment

    try:
        config = load_config(args.file)
        Containment.from_config(config)  # the mapper, as the service builds it
    except ValueError as error:  # ConfigError (run as __main__: two classes)
        say_led(parser.prog, str(error))
        return 1
    for warning in config.warnings:
        say_led(parser.prog, f"warning: {warning}")
    write_stdout_or_exit(parser.prog, json.dumps(config.effective(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
