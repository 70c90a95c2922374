"""One ``sdexec.exec`` request → one :class:`ExecPlan`, or one
:class:`RequestError`.

Everything a request asks for is read and checked here, once: the flags, the
command, the executable, the unit's name and properties (the site's, the
request's and the mapper's, merged by precedence and typed), the output
options, the stop timer and the CPU and memory node fences to check. The
step is pure with respect to the service: it reads the configuration and
the containment it is given and the file system (to find the executable),
and changes nothing.
:class:`~sdexec.process.Process` runs a plan; nothing after this step looks
at the request's payload again.
"""

from __future__ import annotations

import difflib
import errno
import functools
import os
import pwd
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from sdexec.command import (
    PROPERTY_PREFIX,
    Command,
    CommandError,
    Found,
    command_line,
    unit_environment,
    unit_properties,
)
from sdexec.config import Config
from sdexec.containment import R_OPTION, Containment, MapperError
from sdexec.execstart import ExecLine
from sdexec.fluxforms import STRTOL_DECIMAL
from sdexec.idset import IDset
from sdexec.joblimit import TIME_LIMIT_OPTION
from sdexec.limits import (
    check_command_size,
    check_counts,
    check_exec_size,
    check_lengths,
    check_start_message,
    check_texts,
    check_trampoline_exec,
    check_unit_file_lines,
    command_text,
    job_id_problem,
)
from sdexec.policy import TIGHTENING, RequestPolicy
from sdexec.property import (
    ADDED_UP,
    DIRECTORY_PROPERTIES,
    EX_TWINS,
    PATH_LIST_PROPERTIES,
    PropertyError,
    UnitProperty,
    cpu_set,
    is_gate,
    parse_bool,
    parse_integer,
    properties_together_problem,
    split_rlimit_pairs,
    typed_property,
)
from sdexec.protocol import (
    DEFAULT_MAX_FRAME,
    DEFAULT_OUTPUT_BUFSIZE,
    DEFAULT_STDIN_BUFSIZE,
    UNIT_NAME_PREFIX,
    ExecFlag,
    job_of_unit_name,
)
from sdexec.refusal import (
    SHOWN,
    RequestRefused,
    expected,
    json_quoted,
    printable,
    quoted,
)
from sdexec.rset import ResourceSet
from sdexec.signals import parse_signal, signal_name
from sdexec.sizes import parse_flux_size
from sdexec.unitfile import unit_file_problem
from sdexec.unitstop import StopTimerPolicy, lifecycle_properties

__all__ = [
    "STDIO_STREAMS",
    "CheckedRequest",
    "ExecPlan",
    "LookedUp",
    "NamedPath",
    "OutputOptions",
    "RequestError",
    "checked_request",
    "manager_working_directory",
    "plan_exec",
    "service_named",
    "unit_name_for",
]

#: The flags a request may set. A plain
#: int: ``~`` of an IntFlag complements within the flag's own members only,
#: so ``64 & ~ALL_FLAGS`` would be 0 and an unknown bit would pass.
ALL_FLAGS = int(
    ExecFlag.STDOUT
    | ExecFlag.STDERR
    | ExecFlag.CHANNEL
    | ExecFlag.WRITE_CREDIT
    | ExecFlag.WAITABLE
)
OUTPUT_STREAMS = ("stdout", "stderr")
#: The streams a client may pass as its own descriptors (``stdio``).
STDIO_STREAMS = ("stdin", "stdout", "stderr")
_UNIT_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9:_.\-]")
#: systemd's unit names (unit-name.c): ``UNIT_NAME_MAX`` is 256 with the NUL.
_UNIT_NAME_MAX = 255
#: As systemd's unit_name_is_valid(): a prefix, then an instance after the
#: first ``@`` if there is one (a template, ``a@.service``, cannot run).
_UNIT_NAME = re.compile(
    rf"(?=.{{1,{_UNIT_NAME_MAX}}}$)[A-Za-z0-9:_.\\\-]+(@[A-Za-z0-9:_.\\@\-]+)?\.service"
)
#: The longest job id a default unit name carries (the rest of the name is
#: 48 characters): the uuid keeps the name unique, the id only informs.
_JOBID_IN_NAME_MAX = _UNIT_NAME_MAX - len("sdexec--.service") - 32
#: The largest ``stdin_BUFSIZE``, ``stdout_BUFSIZE`` and ``stderr_BUFSIZE``:
#: each is memory the service holds for the process (output is held up to
#: it; stdin up to a multiple of it, sdexec.systemd.channel).
MAX_BUFSIZE = 16 * 1024 * 1024
#: The smallest ``stdout_BUFSIZE``/``stderr_BUFSIZE``: no output message is
#: larger than it, so a tiny one would make a response of every few bytes
#: (``1``: 65536 per read, the reactor held for all of them).
MIN_OUTPUT_BUFSIZE = 4096
#: The prefix of sdexec's own options (docs/protocol.md, "Options").
_OPTION_PREFIX = "SDEXEC_"
#: The ``SDEXEC_`` options sdexec reads, ``SDEXEC_PROP_<Name>`` apart; and
#: the one it ignores by name, ``SDEXEC_TEST_EXPECTED_CPUS``, which Flux's
#: job-exec sends for a hook of upstream's test suite that sdexec has not.
#: Another ``SDEXEC_`` name is refused (:func:`_check_option_names`).
SDEXEC_OPTIONS = (
    "SDEXEC_NAME",
    "SDEXEC_JOBID",
    TIME_LIMIT_OPTION,
    "SDEXEC_STOP_TIMER_SEC",
    "SDEXEC_STOP_TIMER_SIGNAL",
    R_OPTION,
    "SDEXEC_TEST_EXPECTED_CPUS",
)


class RequestError(RequestRefused):
    """A request that cannot be served: ``errnum`` and a message naming why.

    A :class:`~sdexec.refusal.RequestRefused`, as the checks of
    :mod:`sdexec.limits` and :mod:`sdexec.policy` raise: the server answers
    both the same way."""


@dataclass(frozen=True)
class OutputOptions:
    """How one output stream is read: whole lines or as it comes, and how
    much is held before it is sent anyway."""

    line_buffered: bool = True
    bufsize: int = DEFAULT_OUTPUT_BUFSIZE


#: A path, and the unit property that names it.
NamedPath = tuple[UnitProperty, str]


@dataclass(frozen=True)
class ExecPlan:
    """Everything needed to run one request's process, checked."""

    command: Command
    unit_name: str
    #: The command's executable: ``cmdline[0]`` resolved, as execvp(3) would.
    executable: str
    #: Typed, in the order sent; each says where it came from (``source``).
    properties: tuple[UnitProperty, ...]
    flags: ExecFlag
    #: Per output stream; a stream not forwarded is still read (and dropped).
    output: Mapping[str, OutputOptions]
    stdin_bufsize: int
    stop_timer: StopTimerPolicy
    #: The CPUs the mapper fenced the unit to (checked once it starts).
    fence: IDset | None
    #: The NUMA nodes it fenced the unit's memory to (checked with the CPUs).
    fence_mems: IDset | None
    #: Whether containment mapped this request (the mapper's statistics).
    mapped: bool
    #: Whether the fence check looks for the unit's memory cap (the site's,
    #: not lifted by the mapper).
    memory_capped: bool
    #: The streams whose descriptors the client passed (stdio passthrough),
    #: in the order the descriptors came; the service makes no channel for them.
    stdio: tuple[str, ...] = ()
    #: The request's R, where containment read it (a job's time limit
    #: reads it from here rather than parse it again).
    resources: ResourceSet | None = None

    @property
    def cmdline(self) -> list[str]:
        """The request's command line."""
        return self.command.cmdline

    @property
    def label(self) -> str | None:
        """The request's label, if any."""
        return self.command.label

    @property
    def slice(self) -> str | None:
        """The slice the unit is started in (``[sdexec] slice``, or the
        request's where the site lets it choose)."""
        return next((str(p.value) for p in self.properties if p.name == "Slice"), None)

    @property
    def soft_file_limit(self) -> UnitProperty | None:
        """The property that sets the unit's soft limit of open files:
        ``LimitNOFILESoft``, else ``LimitNOFILE`` (systemd sets both limits
        from the first of them it is sent); ``None``: neither is set."""
        limits = {
            p.name: p for p in self.properties if p.name.startswith("LimitNOFILE")
        }
        return limits.get("LimitNOFILESoft", limits.get("LimitNOFILE"))

    @property
    def required_paths(self) -> list[NamedPath]:
        """The host paths the unit's sandboxing properties name without
        ``-`` (which lets systemd skip a missing one), with the property
        naming each: a missing one fails the unit's mount namespace,
        226/NAMESPACE. A ``+`` path (below ``RootDirectory``) is left out."""
        return [(prop, path) for prop in self.properties for path in _required(prop)]

    def forwards(self, stream: str) -> bool:
        """Whether the client asked for this output stream."""
        flag = ExecFlag.STDOUT if stream == "stdout" else ExecFlag.STDERR
        return bool(self.flags & flag)


#: RFC 42's ``local_flags`` bit: the client's own stdio, inherited.
STDIO_FALLTHROUGH = 1


def _check_local_flags(local_flags: object, streaming: bool) -> None:
    """RFC 42's ``local_flags``: an integer; stdio-fallthrough is an error
    in the background (RFC 42), and in a stream sdexec relays the output
    instead (its ``stdio`` field passes descriptors: docs/protocol.md)."""
    if (
        not isinstance(local_flags, int)
        or isinstance(local_flags, bool)
        or local_flags < 0
    ):
        raise RequestError(
            errno.EINVAL,
            f"local_flags: expected an integer >= 0, got {json_quoted(local_flags)}",
        )
    if local_flags & STDIO_FALLTHROUGH and not streaming:
        raise RequestError(
            errno.EINVAL,
            "local_flags: stdio-fallthrough (1) is not allowed in background mode",
        )


def plan_exec(
    payload: Mapping[str, Any],
    config: Config,
    containment: Containment,
    request_frame: int | None = None,
    looked_up: LookedUp | None = None,
    streaming: bool = True,
) -> ExecPlan:
    """The plan for an ``sdexec.exec`` payload; :class:`RequestError` (or
    the :class:`~sdexec.refusal.RequestRefused` of a limit or the property
    policy) names the first thing wrong with it. Nothing is started or
    tabled for a refused request.
    ``request_frame``: the largest message the requesting connection reads
    (a connection keeps the ``max-frame-size`` it was made with, across
    reloads): a write within the stdin credit must fit it.
    ``looked_up``: the payload already checked and its command looked up
    (sdexec/lookup.py, off the reactor's thread, with
    :func:`manager_working_directory`), else both are done here, for a
    request ``streaming`` or not."""
    if looked_up is None:
        request = checked_request(payload, streaming)
        found = request.command.find_executable(manager_working_directory(config))
    else:
        request, found = looked_up
    flags, command, environment = request
    executable = _executable(command, found)
    resources = _contained_resources(containment, command)
    mapped = _mapped_properties(containment, command, resources)
    merged, sources = _merged_properties(config, command, mapped)
    _check_together(merged, sources)
    unit_name = unit_name_for(command)
    start = command_line(command, executable, merged)
    _check_start_fits(command, unit_name, start, environment, merged)
    stop_timer = _stop_timer(config, command)
    # Before the fences are read from the mapper's values: they are then
    # ones systemd takes.
    properties = _typed_properties(command, start, merged, sources)
    return ExecPlan(
        command=command,
        unit_name=unit_name,
        executable=executable,
        properties=properties,
        flags=flags,
        output={stream: _output_options(command, stream) for stream in OUTPUT_STREAMS},
        stdin_bufsize=_stdin_bufsize(
            command, request_frame or config.sdexec.max_frame_size
        ),
        stop_timer=stop_timer,
        fence=_fence(mapped, "AllowedCPUs"),
        fence_mems=_fence(mapped, "AllowedMemoryNodes"),
        mapped=containment.applies_to(command),
        memory_capped=containment.checks_memory_cap(
            # The site's cap as the mapper left it: a request's own, tighter
            # one is its business (one the node cannot hold must not drain it).
            mapped.get("MemoryMax", config.exec.sdexec_properties.get("MemoryMax"))
        ),
        stdio=_stdio(payload.get("stdio", ())),
        resources=resources,
    )


def _executable(command: Command, found: Found) -> str:
    """The path of the command found, or the shell's refusal of it: the
    file that could not be run (EACCES), or that no file was found."""
    executable, unexecutable = found
    if executable is None and unexecutable:
        # execvp(3)'s EACCES, said as a shell says it (its status is 126).
        shown = printable(command.cmdline[0], SHOWN)
        raise RequestError(errno.EACCES, f"{shown}: {unexecutable}")
    if executable is None:
        # An empty name is shown as "": bash's ": command not found" names
        # nothing.
        name = printable(command.cmdline[0], SHOWN) or '""'
        raise RequestError(errno.ENOENT, f"{name}: command not found")
    return executable


def _check_start_fits(
    command: Command,
    unit_name: str,
    start: ExecLine,
    environment: Mapping[str, str],
    merged: Mapping[str, str],
) -> None:
    """Refuse (``E2BIG``) a start that exec, the manager's message or the
    unit file could not hold (sdexec/limits.py)."""
    check_trampoline_exec(command.cmdline, start, environment)
    check_start_message(
        unit_name, start.path, start.argv, environment, merged, command.cwd
    )
    check_unit_file_lines(start.path, start.argv, environment)


class CheckedRequest(NamedTuple):
    """An ``sdexec.exec`` payload as far as it is checked before its command
    is looked up: what needs no file system."""

    flags: ExecFlag
    command: Command
    #: The unit's environment (:func:`~sdexec.command.unit_environment`).
    environment: dict[str, str]


class LookedUp(NamedTuple):
    """An ``sdexec.exec`` payload checked, and its command looked up."""

    request: CheckedRequest
    found: Found


def checked_request(payload: Mapping[str, Any], streaming: bool) -> CheckedRequest:
    """The flags, command and environment of an ``sdexec.exec`` payload
    (``streaming`` or in the background); :class:`RequestError` names the
    first thing wrong with them, or with its ``local_flags`` or ``stdio``."""
    _check_local_flags(payload.get("local_flags", 0), streaming)
    if "stdio" in payload and not streaming:
        # Said as such: the count's EPROTO had the client send descriptors,
        # then refused them (review session 43 Z2).
        raise RequestError(
            errno.EINVAL,
            "stdio: not allowed in background mode (stdio passthrough is for"
            " streaming execs only)",
        )
    flags = _flags(payload.get("flags"))
    command = _command(payload.get("cmd"))
    if not streaming:
        # RFC 42: the output and channel flags are ignored in background
        # mode (a command's channels are not: they would be its own).
        flags &= ~ExecFlag.CHANNEL
    # Upstream's words, after the field that asked (as "cmd.msgchan: message
    # channels are not supported"): the same words for two fields told the
    # client neither which to drop.
    if command.channels:
        raise RequestError(errno.EINVAL, f"cmd.channels: {_NO_CHANNELS}")
    if flags & ExecFlag.CHANNEL:
        raise RequestError(errno.EINVAL, f"flags: channel (4): {_NO_CHANNELS}")
    environment = unit_environment(command.env)
    # Before the PATH search: a PATH of megabytes would cost as many stats.
    check_exec_size(command.cmdline[0], command.cmdline, environment)
    check_counts(command.cmdline, environment)
    # After the exec checks, which name one string exec refuses more
    # precisely: this one counts what they do not (options, the names
    # dropped from env), all of which the process keeps for its life.
    check_command_size(
        command.cmdline, command.env, command.opts, command.cwd, command.label
    )
    return CheckedRequest(flags, command, environment)


def manager_working_directory(config: Config) -> str:
    """Where systemd runs a unit without ``WorkingDirectory``: ``/`` under
    the system manager, the user's home under a user manager
    (systemd.exec(5)), so that a relative command is found where it runs."""
    if config.systemd.bus == "system":
        return "/"
    return _home_directory()


@functools.cache
def _home_directory() -> str:
    # The user manager is this service's user's (the bus lets no other in).
    # Read once: on a node whose passwd is in LDAP, a lookup per request
    # would cost a round trip.
    try:
        return pwd.getpwuid(os.getuid()).pw_dir or "/"
    except KeyError:
        return "/"


def _working_directory_problem(cwd: str) -> str | None:
    """Why systemd could not take ``cwd`` as the unit's WorkingDirectory,
    or ``None``. It takes an absolute path (systemd.exec(5)), and reads a
    leading "-" or a "~" as its own syntax (a missing directory allowed, a
    home directory); a ".." in one it refused only as it loaded the unit,
    in words that did not name it. ("//" and "." it simplifies, as upstream
    passes them: a client's $PWD may hold them.)"""
    problem = unit_file_problem(cwd)
    if problem is not None:
        return problem
    if not cwd.startswith("/"):
        return f"{json_quoted(cwd)}: not an absolute path"
    if ".." in cwd.split("/"):
        return (
            f"{json_quoted(cwd)}: a '..' in it, which systemd refuses: give the"
            " directory resolved, as realpath(1) prints it"
        )
    return None


def _command(cmd: object) -> Command:
    """The command object, its every string checked as text."""
    try:
        command = Command.from_json(cmd)
    except CommandError as error:
        raise RequestError(errno.EINVAL, str(error)) from None
    check_texts(
        command_text(
            command.cmdline, command.env, command.opts, command.cwd, command.label
        )
    )
    _check_option_names(command.opts)
    cwd_problem = _working_directory_problem(command.cwd) if command.cwd else None
    if cwd_problem is not None:  # sent as the unit's WorkingDirectory
        raise RequestError(errno.EINVAL, f"cmd.cwd: {cwd_problem}")
    # Before the PATH search, which joins cwd to every directory of PATH.
    jobid = command.option("SDEXEC_JOBID")
    check_lengths(command.cwd, {"cmd.label": command.label, "SDEXEC_JOBID": jobid})
    problem = job_id_problem(jobid) if jobid else None
    if problem is not None:
        raise RequestError(errno.EINVAL, f"SDEXEC_JOBID: {problem}")
    return command


def _check_option_names(opts: Mapping[str, str]) -> None:
    """Refuse (``EINVAL``) an ``SDEXEC_`` option that is none of sdexec's
    (any case of the prefix), naming it and the one likely meant. Upstream's
    sdexec ignores it, and so a typo (``SDEXEC_STOP_TIMER_SIGNALL``) left
    the site's default in force unseen. Another option (libsubprocess's
    ``stdout_BUFSIZE``, one meant for another server) is not sdexec's to
    refuse."""
    for key in opts:
        upper = key.upper()
        if not upper.startswith(_OPTION_PREFIX) or key in SDEXEC_OPTIONS:
            continue
        if key.startswith(PROPERTY_PREFIX):
            continue  # its name is the policy's to check (sdexec.policy)
        meant = _option_meant(key)
        hint = (
            f"did you mean {printable(meant, SHOWN)}?"
            if meant
            else f"sdexec's are {PROPERTY_PREFIX}<Name>, {', '.join(SDEXEC_OPTIONS)}"
        )
        raise RequestError(
            errno.EINVAL, f"{printable(key, SHOWN)}: not an sdexec option ({hint})"
        )


def _option_meant(key: str) -> str | None:
    """The option of sdexec's an unknown ``SDEXEC_`` ``key`` likely means:
    its ``SDEXEC_PROP_`` spelt in another case, else the name closest to it
    after the prefix (which every name shares, and which outweighed the
    rest: ``SDEXEC_SIGNAL`` was closest to ``SDEXEC_NAME``), else the one
    name that holds what it says (``SIGNAL``); ``None`` if none."""
    upper = key.upper()
    if upper.startswith(PROPERTY_PREFIX):
        return PROPERTY_PREFIX + key[len(PROPERTY_PREFIX) :]
    said = upper[len(_OPTION_PREFIX) :]
    names = {name[len(_OPTION_PREFIX) :]: name for name in SDEXEC_OPTIONS}
    close = difflib.get_close_matches(said, names, n=1)
    if close:
        return names[close[0]]
    holding = [name for rest, name in names.items() if said and said in rest]
    return holding[0] if len(holding) == 1 else None


def service_named(name: str) -> str:
    """The unit an ``SDEXEC_NAME`` names: ``.service`` added if missing."""
    return name if name.endswith(".service") else f"{name}.service"


def unit_name_for(command: Command) -> str:
    """``SDEXEC_NAME`` (``.service`` added), else ``sdexec-[JOBID-]UUID.service``
    with the job id from ``SDEXEC_JOBID`` or the environment's ``FLUX_JOB_ID``."""
    name = command.option("SDEXEC_NAME")
    if name:
        return _checked_unit_name(name, "SDEXEC_NAME")
    jobid = command.option("SDEXEC_JOBID") or command.env.get("FLUX_JOB_ID")
    prefix = job_unit_prefix(jobid) if jobid else UNIT_NAME_PREFIX
    return _checked_unit_name(f"{prefix}{uuid.uuid4().hex}.service", "SDEXEC_JOBID")


def job_unit_prefix(jobid: str) -> str:
    """How the name the service gives a unit of job ``jobid`` begins (a
    random hex part and ``.service`` follow)."""
    return f"{UNIT_NAME_PREFIX}{_job_in_name(jobid)}-"


def is_job_unit_name(unit_name: str, jobid: str) -> bool:
    """Whether the service named ``unit_name`` for a unit of job ``jobid``
    (not for one ``SDEXEC_NAME`` named): how a leftover of an earlier run,
    whose job nothing else records, is known by its job id."""
    return job_of_unit_name(unit_name) == _job_in_name(jobid)


def _job_in_name(jobid: str) -> str:
    """Job ``jobid`` as a unit's name carries it."""
    return _UNIT_NAME_UNSAFE.sub("_", jobid[:_JOBID_IN_NAME_MAX])


def _checked_unit_name(name: str, option: str) -> str:
    """The unit ``name`` names (:func:`service_named`) if systemd takes it,
    else EINVAL naming the option it came from (before systemd is asked),
    quoting ``name`` as the request wrote it: quoted with the ``.service``
    the service adds, which counts in systemd's 255 characters, a name of
    250 read "at most 255", and said neither what was sent nor why."""
    unit = service_named(name)
    if _UNIT_NAME.fullmatch(unit) is None:
        long_with_suffix = len(unit) > _UNIT_NAME_MAX and unit != name
        length = f" ({len(unit)} characters with .service)" if long_with_suffix else ""
        raise RequestError(
            errno.EINVAL,
            f"{option}: {quoted(name, SHOWN)}{length} is not a unit name systemd"
            f" takes: at most {_UNIT_NAME_MAX} characters,"
            " .service included, of A-Z a-z 0-9 : _ . \\ @ -, a name before any @"
            " and an instance after it",
        )
    return unit


#: Upstream sdexec's refusal of an auxiliary channel.
_NO_CHANNELS = "auxiliary channels are not supported"


def _flags(flags: object) -> ExecFlag:
    if not isinstance(flags, int) or isinstance(flags, bool) or flags & ~ALL_FLAGS:
        raise RequestError(
            errno.EINVAL, expected("flags", "an integer of 1|2|4|8|16", flags)
        )
    return ExecFlag(flags)


def _stdio(streams: object) -> tuple[str, ...]:
    """``stdio``: the streams whose descriptors came with the request."""
    if streams == ():
        return ()
    if (
        not isinstance(streams, list)
        or not streams
        or any(stream not in STDIO_STREAMS for stream in streams)
        or len(set(streams)) != len(streams)
    ):
        raise RequestError(
            errno.EINVAL,
            expected(
                "stdio",
                "a non-empty list of distinct stream names (stdin, stdout, stderr)",
                streams,
            ),
        )
    return tuple(streams)


def _contained_resources(
    containment: Containment, command: Command
) -> ResourceSet | None:
    """The request's R, read once where containment maps it (the mapper
    and a job's time limit take it from here): a malformed one is the
    request's fault, named as with containment off (Jobs.admit), not as
    the mapper's failure."""
    try:
        return containment.resources(command)
    except ValueError as error:
        raise RequestError(errno.EINVAL, str(error)) from None


def _fence(mapped: Mapping[str, str], name: str) -> IDset | None:
    """The CPUs (or NUMA nodes) the mapper fenced the unit to under
    ``name``, read as systemd reads them (a site's mapper may write
    ``"0 2"``, which the unit's property took); ``None`` where it set
    none, or an empty set (no fence to systemd). Called once the unit's
    properties were converted: the value is one systemd takes."""
    ids = cpu_set(mapped.get(name, ""))
    return ids or None


def _mapped_properties(
    containment: Containment, command: Command, resources: ResourceSet | None
) -> dict[str, str]:
    try:
        return containment.properties(command, resources)
    except MapperError as error:
        cause = error.__cause__
        errnum = cause.errno if isinstance(cause, OSError) and cause.errno else None
        raise RequestError(errnum or errno.EINVAL, str(error)) from None


#: What restricts the unit's view of its file systems.
_PATH_RESTRICTIONS = (
    "ReadOnlyPaths", "ReadOnlyDirectories", "InaccessiblePaths",
    "InaccessibleDirectories", "NoExecPaths", "ProtectSystem", "ProtectHome",
)  # fmt: skip
#: What hides the host's files from the unit behind a private copy: its
#: own /tmp and /var/tmp, its own /dev of pseudo devices alone.
_PRIVATE_VIEWS = ("PrivateTmp", "PrivateTmpEx", "PrivateDevices")
#: Lists that open, in systemd, what others restrict: an address in both
#: IPAddressAllow and IPAddressDeny is allowed, a path in ReadWritePaths is
#: writable under ReadOnlyPaths (or ProtectSystem=strict), one in ExecPaths
#: executable under NoExecPaths, a path in ReadOnlyPaths readable under
#: InaccessiblePaths; a bind mount or a temporary file system shows its own
#: files there, and a bind mount the host's behind a private view
#: (``BindPaths=/tmp`` under PrivateTmp=yes). A namespace path joins the
#: unit to that namespace, and systemd.exec(5) says the Private… switch
#: then has no effect (``NetworkNamespacePath=/proc/1/ns/net`` runs the job
#: on the host's network under PrivateNetwork=yes). A request may not set
#: one where the site sets what it opens (sdexec's merge is by name, and
#: cannot tell which paths meet).
OPENS: dict[str, tuple[str, ...]] = {
    "IPAddressAllow": ("IPAddressDeny",),
    "ExecPaths": ("NoExecPaths",),
    "ReadOnlyPaths": ("InaccessiblePaths", "InaccessibleDirectories"),
    "ReadOnlyDirectories": ("InaccessiblePaths", "InaccessibleDirectories"),
    **dict.fromkeys(
        (
            "ReadWritePaths", "ReadWriteDirectories", "TemporaryFileSystem",
            # The directories systemd makes (or takes) for a unit below its
            # own (/var/lib, ~/.config…) it makes writable whatever
            # ProtectSystem, ProtectHome or ReadOnlyPaths say:
            # ConfigurationDirectory=app made an existing ~/.config/app
            # writable under ProtectHome=read-only.
            *sorted(DIRECTORY_PROPERTIES),
        ),
        _PATH_RESTRICTIONS,
    ),
    **dict.fromkeys(
        ("BindPaths", "BindReadOnlyPaths"), _PATH_RESTRICTIONS + _PRIVATE_VIEWS
    ),
    "NetworkNamespacePath": ("PrivateNetwork",),
    "IPCNamespacePath": ("PrivateIPC",),
    "UserNamespacePath": ("PrivateUsers", "PrivateUsersEx"),
}  # fmt: skip


#: Two names of one setting (systemd 257's ``…Ex`` for a boolean's other
#: values, or 258's ``ProtectHostnameEx``), plain name first: a request may
#: not set one where the site sets the other, whose value it would replace.
_EX_NAMES = {**EX_TWINS, "ProtectHostname": "ProtectHostnameEx"}
TWINS = {**_EX_NAMES, **{ex: plain for plain, ex in _EX_NAMES.items()}}


def _merged_properties(
    config: Config, command: Command, mapped: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """The site's (``[sdexec] slice`` among them), then the request's, then
    the mapper's properties, then the lifecycle ones sdexec needs, and where
    each came from: a later source wins, so a request cannot loosen what
    containment set nor change how its unit is stopped. The request's pass
    the property policy first (``[sdexec] request-properties``; ordered
    values only tighten what the site and the mapper set), so an ordered
    value the mapper also set is the request's (``MemoryMax=256M`` under a
    mapped 512M): as tight or tighter."""
    # A soft:hard limit as the two properties D-Bus takes (checked at load).
    site_properties = split_rlimit_pairs(config.exec.sdexec_properties, "config")
    site = {"Slice": config.sdexec.slice, **site_properties}
    policy = RequestPolicy(config.sdexec.request_properties, {**site, **mapped})
    restated = _restating_the_site(command, config.exec.sdexec_properties)
    requested = policy.accept(restated)
    _check_request_lists(requested, site, mapped)
    tightened = {
        name: value
        for name, value in requested.items()
        if name in mapped and name in TIGHTENING
    }
    sources: dict[str, str] = {}
    merged: dict[str, str] = {}
    for source, properties in (
        ("config", site),
        ("request", requested),
        ("containment", mapped),
        ("request", tightened),
        # Last: systemd's stop defaults must not pre-empt the stop timer.
        ("sdexec", lifecycle_properties()),
    ):
        merged.update(properties)
        sources.update(dict.fromkeys(properties, source))
    return merged, sources


def _restating_the_site(command: Command, site: Mapping[str, str]) -> dict[str, str]:
    """The request's properties, but those that only restate the site's
    ``[exec.sdexec-properties]`` value, word for word. Flux's job-exec,
    which reads the same file, sends each of them again with every job
    shell (its exec_cmd.c): judged as the request's, a name requests may
    not set was refused, and a memory cap the mapper scaled for a job on
    part of the node was "looser" than the scaled one. Left to the site,
    the mapper's value wins, as upstream's sdexec lets it."""
    requested = command.requested_properties()
    return {name: value for name, value in requested.items() if site.get(name) != value}


def _check_request_lists(
    requested: Mapping[str, str], site: Mapping[str, str], mapped: Mapping[str, str]
) -> None:
    """EPERM for a request's property (where ``[sdexec]
    request-properties`` allows it) that would loosen what the site (or the
    mapper) sets beside the policy's ordered values: each of
    :data:`_LOOSENINGS` says how, or finds nothing."""
    configured = _Configured({**site, **mapped}, frozenset(mapped))
    for name, value in requested.items():
        for loosening in _LOOSENINGS:
            reason = loosening(name, value, configured)
            if reason is not None:
                raise RequestError(errno.EPERM, f"SDEXEC_PROP_{name}: {reason}")


@dataclass(frozen=True)
class _Configured:
    """What the site and the mapper set, and which the mapper did."""

    values: Mapping[str, str]
    mapped: frozenset[str]

    def setter(self, name: str) -> str:
        """Who set ``name``, for a refusal."""
        return "containment (the mapper)" if name in self.mapped else "the site"


def _replaces_a_list(name: str, _value: str, configured: _Configured) -> str | None:
    """A list systemd adds up, which the merge by name would replace
    (:data:`~sdexec.property.ADDED_UP`), or a condition of the site's."""
    if name not in configured.values:
        return None
    setter = configured.setter(name)
    if name in ADDED_UP:
        return (
            f"{setter} sets {name}; a request may not replace it (systemd adds"
            " such lists up; sdexec sets one)"
        )
    if is_gate(name):
        return (
            f"{setter} sets {name}; a request may add conditions, never replace"
            " the site's"
        )
    return None


def _opens(name: str, _value: str, configured: _Configured) -> str | None:
    """A list that opens what a configured one restricts (:data:`OPENS`)."""
    for other in OPENS.get(name, ()):
        if other in configured.values:
            return (
                f"{configured.setter(other)} sets {other}, which {name} would open;"
                " a request may not set it"
            )
    return None


def _replaces_a_twin(name: str, _value: str, configured: _Configured) -> str | None:
    """The other name of a configured setting (:data:`TWINS`)."""
    twin = TWINS.get(name)
    if twin is None or twin not in configured.values:
        return None
    return (
        f"{configured.setter(twin)} sets {twin}, the same setting (the one"
        " systemd reads last wins); a request may not set it"
    )


def _changes_an_unordered_hardening(
    name: str, value: str, configured: _Configured
) -> str | None:
    """Another value of a hardening setting the site sets whose values have
    no order sdexec could compare (:data:`KEPT_AS_SET`)."""
    if name not in KEPT_AS_SET or name not in configured.values:
        return None
    site = configured.values[name]
    if value.strip() == site.strip():
        return None
    return (
        f"{configured.setter(name)} sets {name}={printable(site, SHOWN)}; a request may"
        " not change it (sdexec cannot tell which of its values is tighter)"
    )


def _widens_a_mask(name: str, value: str, configured: _Configured) -> str | None:
    """A mask with a bit the configured one lacks (:data:`NARROWED`): a
    namespace more, a secure bit fewer."""
    if name not in NARROWED or name not in configured.values:
        return None
    site = configured.values[name]
    try:
        mask, site_mask = (typed_property(name, text).value for text in (value, site))
    except PropertyError:
        return None  # the request's is refused as such, when it is typed
    if NARROWED[name] == "more":  # the site's bits are the request's to keep
        mask, site_mask = site_mask, mask
    if mask & ~site_mask == 0:
        return None
    return (
        f"{quoted(printable(value), SHOWN)} allows what {configured.setter(name)}'s"
        f" {name}={printable(site, SHOWN)} does not; a request may only narrow it"
    )


def _triggers(name: str, value: str, _configured: _Configured) -> str | None:
    """A triggering condition (``|``), which passes every triggering
    condition of the unit when it holds."""
    if is_gate(name) and value.startswith("|"):
        return (
            "a triggering condition (a leading |) would let the site's triggering"
            " conditions pass"
        )
    return None


#: What a request's property may loosen beside the policy's ordered values.
_LOOSENINGS = (
    _replaces_a_list,
    _opens,
    _replaces_a_twin,
    _changes_an_unordered_hardening,
    _widens_a_mask,
    _triggers,
)
#: Hardening settings of more than two values that have no one order (the
#: ``…Ex`` twins' ``disconnected``, ``identity``, ``private``…; ``/proc``'s
#: protections): where the site sets one, a request may only repeat it.
KEPT_AS_SET = frozenset({*_EX_NAMES.values(), "ProtectProc", "ProcSubset"})
#: Masks a request may only narrow where the site sets them, and which way:
#: the namespaces a unit may create (or is delegated) ``fewer`` bits, the
#: secure bits ``more``.
NARROWED = {
    "RestrictNamespaces": "fewer",
    "DelegateNamespaces": "fewer",
    "SecureBits": "more",
}


def _typed_properties(
    command: Command,
    start: ExecLine,
    merged: Mapping[str, str],
    sources: Mapping[str, str],
) -> tuple[UnitProperty, ...]:
    try:
        return tuple(unit_properties(command, start, merged, sources))
    except PropertyError as error:
        raise RequestError(errno.EINVAL, str(error)) from None


#: Where a property not of the request came from, as an error tells it.
_ORIGINS = {
    "config": "from [exec.sdexec-properties]",
    "containment": "from the mapper",
    "sdexec": "sdexec's own",
}


def _check_together(merged: Mapping[str, str], sources: Mapping[str, str]) -> None:
    """EINVAL for properties systemd refuses together, named as the request
    gave them (the site's were checked together at load)."""
    problem = properties_together_problem(merged)
    if problem is None:
        return
    names, why = problem
    name = next((n for n in names if sources.get(n) == "request"), names[0])
    if sources.get(name) != "request":
        # The site's and the mapper's were checked as they came: told as
        # they are, no request had a part in it.
        told = ", ".join(
            f"{n} {_ORIGINS.get(sources.get(n, ''), 'unset')}" for n in names
        )
        raise RequestError(errno.EINVAL, f"{why} ({told})")
    if names == (name,) and name.endswith("Soft"):
        # A soft limit alone: its hard one is a request's only under the
        # site's (the policy orders hard limits), so say that, not "give it".
        hard = name.removesuffix("Soft")
        why = (
            "over D-Bus a soft limit alone sets the hard limit to the same"
            f" value, and a request may set {hard} only within the site's,"
            " which exec.sdexec-properties does not set"
        )
    site = [n for n in names if sources.get(n) == "config"]
    said = f" ({', '.join(site)} from [exec.sdexec-properties])" if site else ""
    raise RequestError(errno.EINVAL, f"SDEXEC_PROP_{name}: {why}{said}")


def _stop_timer(config: Config, command: Command) -> StopTimerPolicy:
    configured = config.exec.sdexec_stop_timer_sec
    seconds = _strtol_option(command, "SDEXEC_STOP_TIMER_SEC", configured)
    if not 0 < seconds <= configured:
        # The site's safeguard against units that will not die: a request
        # may shorten it, never lengthen or disable it (Flux's negative).
        raise RequestError(
            errno.EINVAL if seconds == 0 else errno.EPERM,
            f"SDEXEC_STOP_TIMER_SEC: a request may set from 1 to {configured}"
            f" seconds (exec.sdexec-stop-timer-sec), not {seconds}",
        )
    return StopTimerPolicy(
        seconds=seconds,
        signal=_signal_option(command, config.exec.sdexec_stop_timer_signal),
    )


def _strtol_option(command: Command, name: str, default: int) -> int:
    """The integer option ``name`` as Flux's sdexec reads it (strtol in
    base 10: ``+5`` and `` 5`` are 5, ``5 `` is not a number), else
    ``EINVAL`` where Flux's falls back to its default without a word."""
    value = command.option(name)
    if value is None:
        return default
    try:
        if STRTOL_DECIMAL.fullmatch(value) is None:
            raise ValueError(f"{quoted(value, SHOWN)} is not a decimal integer")
        return parse_integer(value)  # (its bound on the digits)
    except ValueError as error:
        raise RequestError(errno.EINVAL, f"{name}: {error}") from None


def _signal_option(command: Command, configured: int) -> int:
    value = command.option("SDEXEC_STOP_TIMER_SIGNAL")
    if value is None:
        return configured
    try:
        signum = _requested_signal(value)
    except ValueError as error:
        raise RequestError(errno.EINVAL, f"SDEXEC_STOP_TIMER_SIGNAL: {error}") from None
    if signum != configured:
        # The site's choice: another signal (SIGCONT; SIGKILL where an IMP
        # ends another user's processes) would leave what lingers running,
        # and the node drained. Flux's job-exec sends the one it is given
        # by this same key.
        raise RequestError(
            errno.EPERM,
            f"SDEXEC_STOP_TIMER_SIGNAL: a request may only repeat the configured"
            f" {signal_name(configured)} (exec.sdexec-stop-timer-signal),"
            f" not {signal_name(signum)}",
        )
    return signum


def _requested_signal(value: str) -> int:
    """A number as Flux's sdexec reads it (strtol in base 10: ``+9`` and
    `` 9`` are 9, ``9 `` is not a number), or a name (``SIGKILL``, ``KILL``:
    sdexec's own), written without white space around it."""
    if STRTOL_DECIMAL.fullmatch(value):
        return parse_signal(parse_integer(value))
    if value != value.strip():
        raise ValueError(
            f"{quoted(value, SHOWN)} is not a signal: white space around it"
        )
    return parse_signal(value)


def _size_option(
    command: Command, name: str, default: int, least: int, frame: int, whose: str
) -> int:
    """A ``<stream>_BUFSIZE``: at most :data:`MAX_BUFSIZE`, and no more than
    one message of ``frame`` bytes (``whose``) holds: the data of a write
    within credit, or of one output response, is JSON, up to 6 bytes a
    byte (a control character is ``\u0001``). 16 MiB of NULs made a 96 MiB
    line: the reader dropped the connection, and its processes with it.
    Read as Flux's servers read it (``0x1000``, ``1e3``)."""
    value = command.option(name)
    if value is None:
        return default
    try:
        size = parse_flux_size(value)
    except ValueError as error:
        raise RequestError(errno.EINVAL, f"{name}: {error}") from None
    most = min(MAX_BUFSIZE, (frame - _ENVELOPE) // _JSON_PER_BYTE)
    if not least <= size <= most:
        unit = "byte" if least == 1 else "bytes"
        held = (
            ""
            if most == MAX_BUFSIZE
            else f": one {whose}, at most {frame} bytes, holds that much as JSON"
        )
        # The value and what it came to ("16M" is 16777216): a job script's
        # options are often computed, and its author reads the log.
        raise RequestError(
            errno.EINVAL,
            f"{name}: {quoted(value, SHOWN)} is {size} byte{'' if size == 1 else 's'};"
            f" must be from {least} {unit} to {most} bytes{held}",
        )
    return size


#: Bytes of JSON one byte of a message's data may take (``\u0001``), and
#: what a message holds besides its data, at most.
_JSON_PER_BYTE = 6
_ENVELOPE = 64 * 1024


def _stdin_bufsize(command: Command, max_frame: int) -> int:
    return _size_option(
        command,
        "stdin_BUFSIZE",
        DEFAULT_STDIN_BUFSIZE,
        1,
        max_frame,
        "request ([sdexec] max-frame-size)",
    )


def _output_options(command: Command, stream: str) -> OutputOptions:
    line_buffer = command.opts.get(f"{stream}_LINE_BUFFER", "true")
    try:
        line_buffered = parse_bool(line_buffer)
    except ValueError as error:
        raise RequestError(errno.EINVAL, f"{stream}_LINE_BUFFER: {error}") from None
    bufsize = _size_option(
        command,
        f"{stream}_BUFSIZE",
        DEFAULT_OUTPUT_BUFSIZE,
        MIN_OUTPUT_BUFSIZE,
        DEFAULT_MAX_FRAME,
        "response a client reads",
    )
    return OutputOptions(line_buffered=line_buffered, bufsize=bufsize)


def _required(prop: UnitProperty) -> list[str]:
    """The host paths ``prop`` needs to exist (:attr:`ExecPlan.required_paths`)."""
    if prop.name in PATH_LIST_PROPERTIES:
        return [path for path in prop.value if not path.startswith(("-", "+"))]
    if prop.name in ("BindPaths", "BindReadOnlyPaths"):
        return [source for source, _, optional, _ in prop.value if not optional]
    return []
