"""The RFC 42 command object, checked, and the unit properties it implies."""

from __future__ import annotations

import contextlib
import enum
import os
import re
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sdexec.environment import clean_environment
from sdexec.execstart import ExecLine, exec_line
from sdexec.limits import NAME_MAX, search_directories
from sdexec.property import UnitProperty, parse_bool, typed_property
from sdexec.refusal import MISSING, expected, member

__all__ = [
    "OWN_PROPERTIES",
    "PROPERTY_PREFIX",
    "Command",
    "CommandError",
    "Found",
    "command_line",
    "unit_environment",
    "unit_properties",
]

PROPERTY_PREFIX = "SDEXEC_PROP_"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class CommandError(ValueError):
    """A command object field is missing or mistyped; the message names it."""


def _string_map(value: Any, field_name: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise CommandError(expected(field_name, "an object of strings", value))
    for key, item in value.items():
        if not isinstance(item, str):
            raise CommandError(expected(member(field_name, key), "a string", item))
    return value


class Found(NamedTuple):
    """What looking a command up found (:meth:`Command.find_executable`)."""

    #: The absolute path execvp(3) would run, or ``None``.
    executable: str | None
    #: Why the first file looked at that exists cannot be executed (execvp's
    #: EACCES), as a shell says it: ``"is a directory"`` or ``"permission
    #: denied"``; ``None`` if every file was absent (or one was found).
    unexecutable: str | None


@dataclass(frozen=True)
class Command:
    """What to run: RFC 42's ``cmdline``, ``cwd``, ``env``, ``opts``,
    ``channels``, and an optional ``label`` to find it by."""

    cmdline: list[str]
    env: dict[str, str] = field(default_factory=dict)
    opts: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    channels: list[str] = field(default_factory=list)
    label: str | None = None

    @classmethod
    def from_json(cls, cmd: Any) -> Command:
        """Check a decoded ``cmd`` object; ``CommandError`` names the field."""
        if not isinstance(cmd, dict):
            raise CommandError(expected("cmd", "an object", cmd))
        cmdline = cmd.get("cmdline", MISSING)
        if not isinstance(cmdline, list) or not cmdline:
            raise CommandError(
                expected("cmd.cmdline", "a non-empty array of strings", cmdline)
            )
        for index, arg in enumerate(cmdline):
            if not isinstance(arg, str):  # named, as a string's NUL is
                raise CommandError(expected(f"cmd.cmdline[{index}]", "a string", arg))
        cwd = cmd.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise CommandError(expected("cmd.cwd", "a string", cwd))
        label = cmd.get("label")
        if label is not None and (not isinstance(label, str) or not label):
            raise CommandError(expected("cmd.label", "a non-empty string", label))
        channels = cmd.get("channels", [])
        if not isinstance(channels, list) or not all(
            isinstance(name, str) for name in channels
        ):
            raise CommandError(
                expected("cmd.channels", "an array of strings", channels)
            )
        _check_no_message_channels(cmd)
        return cls(
            cmdline=cmdline,
            env=_string_map(cmd.get("env", {}), "cmd.env"),
            opts=_string_map(cmd.get("opts", {}), "cmd.opts"),
            cwd=cwd,
            channels=channels,
            label=label,
        )

    def option(self, name: str, default: str | None = None) -> str | None:
        """The request option ``name`` (``cmd.opts``), else ``default``."""
        return self.opts.get(name, default)

    def requested_properties(self) -> dict[str, str]:
        """The ``SDEXEC_PROP_<Name>`` options, by ``Name``."""
        return {
            key[len(PROPERTY_PREFIX) :]: value
            for key, value in self.opts.items()
            if key.startswith(PROPERTY_PREFIX)  # "" too: the policy refuses it
        }

    def find_executable(self, default_cwd: str = "/") -> Found:
        """``cmdline[0]`` as execvp(3) would find it with this command's
        ``PATH`` and ``cwd`` (else ``default_cwd``: where the manager runs a
        unit that names none), or ``None``; and whether a file it looked at
        exists but cannot be executed (execvp's EACCES).

        systemd searches only its own fixed path for a bare name, not the
        client's ``PATH``; resolving here keeps ``sdexec run myscript`` working
        as it would in the client's shell, and turns a missing command into an
        immediate ENOENT rather than a failed unit. One pass, each candidate
        looked up from the working directory opened once (a relative PATH
        entry under a deep ``cwd`` walked all of it again for each).
        """
        cwd = self.cwd or default_cwd
        candidates = self._candidates()
        unexecutable = None
        with _working_directory(cwd, candidates) as cwd_fd:
            for candidate in candidates:
                found = _lookup(candidate, cwd_fd)
                if found is _Found.EXECUTABLE:
                    return Found(_path_found(cwd, candidate, cwd_fd), None)
                if found is not _Found.ABSENT:
                    unexecutable = unexecutable or found.value
        return Found(None, unexecutable)

    def _candidates(self) -> list[str]:
        """The paths execvp(3) would try for ``cmdline[0]``, in order,
        relative to the directory the process will run in."""
        name = self.cmdline[0]
        if not name:
            # execvp("") is ENOENT at once: joined to PATH's directories, ""
            # named each of them, and a directory is EACCES's.
            return []
        if "/" in name:
            return [name]
        if len(name.encode()) > NAME_MAX:
            return []  # no file has such a name: no need to look
        path = self.env.get("PATH", os.defpath)
        return [os.path.join(directory, name) for directory in search_directories(path)]


#: RFC 42's message channels, by its name and by flux-core's (its
#: ``cmd_tojson`` always sends ``msgchan``, empty unless its caller made one).
_MESSAGE_CHANNELS = ("msgchans", "msgchan")


def _check_no_message_channels(cmd: Mapping[str, Any]) -> None:
    """Refuse a command that asks for a message channel: RFC 42 has the
    server give the process a URI in the variable each names, which sdexec
    cannot; run without it, the process found none, and nothing said why."""
    for key in _MESSAGE_CHANNELS:
        channels = cmd.get(key, [])
        if not isinstance(channels, list):
            raise CommandError(expected(f"cmd.{key}", "an array of objects", channels))
        if channels:
            raise CommandError(f"cmd.{key}: message channels are not supported")


class _Found(enum.Enum):
    """What one path is to execvp(3); an unexecutable one's value is what a
    shell says of it."""

    ABSENT = "absent"
    EXECUTABLE = "executable"
    DIRECTORY = "is a directory"
    UNEXECUTABLE = "permission denied"  # no x permission, or not a file


def _lookup(path: str, cwd_fd: int | None) -> _Found:
    """What ``path`` (relative to ``cwd_fd``; ``None``: a working directory
    that is not there) is, as execvp(3) would take it."""
    if cwd_fd is None and not os.path.isabs(path):
        return _Found.ABSENT
    try:
        mode = os.stat(path, dir_fd=cwd_fd).st_mode
    except (OSError, ValueError):  # ValueError: a NUL (refused before, anyway)
        return _Found.ABSENT
    if stat.S_ISREG(mode) and _may_execute(path, mode, cwd_fd):
        return _Found.EXECUTABLE
    if stat.S_ISDIR(mode):
        return _Found.DIRECTORY
    return _Found.UNEXECUTABLE


def _may_execute(path: str, mode: int, cwd_fd: int | None) -> bool:
    """Whether the unit could execute the regular file ``path``. A root
    service in the hardened system unit has no ``CAP_DAC_OVERRIDE`` (it
    reads and searches: ``CAP_DAC_READ_SEARCH``), but the root jobs it
    starts do, and they may execute a file with any execute bit (a 0700
    script of another user), unless its file system is mounted noexec."""
    if os.access(path, os.X_OK, dir_fd=cwd_fd):
        return True
    if os.geteuid() != 0 or not mode & 0o111:
        return False
    try:
        flags = os.statvfs(_dir_fd_path(path, cwd_fd)).f_flag
    except OSError:
        return False
    return not flags & os.ST_NOEXEC


def _dir_fd_path(path: str, cwd_fd: int | None) -> str:
    """``path`` as statvfs(2) takes it (it has no ``dir_fd``): through the
    working directory's descriptor where it is relative."""
    if cwd_fd is None or os.path.isabs(path):
        return path
    return f"/proc/self/fd/{cwd_fd}/{path}"


def _path_found(cwd: str, candidate: str, cwd_fd: int | None) -> str:
    """The absolute path of the file ``candidate`` names from ``cwd``, as
    the lookup found it. Normalised as written, unless it goes up a
    directory: ``..`` after a symlink is the link target's parent (for
    execvp as for the lookup), where a lexical ``normpath`` drops both;
    that directory is then the one the kernel resolves, and the name is
    kept as given (a symlinked command keeps its name)."""
    joined = os.path.join(cwd, candidate)
    if ".." not in joined.split("/"):
        return os.path.normpath(joined)
    directory, name = os.path.split(candidate)
    with _opened_directory(directory or ".", cwd_fd) as fd:
        if fd is not None:
            with contextlib.suppress(OSError):  # no /proc
                return os.path.join(os.readlink(f"/proc/self/fd/{fd}"), name)
    return os.path.normpath(joined)


#: A directory opened to look names up from, not to read.
_DIRECTORY_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


@contextlib.contextmanager
def _opened_directory(path: str, dir_fd: int | None = None) -> Iterator[int | None]:
    """``path`` (relative to ``dir_fd``) opened as a directory to look names
    up from, or ``None``."""
    try:
        fd = os.open(path, _DIRECTORY_FLAGS, dir_fd=dir_fd)
    except (OSError, ValueError):
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _working_directory(
    cwd: str, candidates: Sequence[str]
) -> contextlib.AbstractContextManager[int | None]:
    """``cwd`` opened (:func:`_opened_directory`) where a candidate is
    relative to it, else ``None``: a job's working directory is often on a
    network file system, which may not answer, and an absolute command
    (a job shell's) needs nothing from it."""
    if all(os.path.isabs(candidate) for candidate in candidates):
        return contextlib.nullcontext(None)
    return _opened_directory(cwd)


def unit_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment the unit gets: ``env`` cleaned of the caller's
    systemd variables (:mod:`sdexec.environment`) and of names systemd
    refuses."""
    # systemd refuses the whole unit for a name such as BASH_FUNC_ml(%%):
    # drop those, as Flux does.
    return {
        name: value
        for name, value in clean_environment(env).items()
        if _ENV_NAME.fullmatch(name)
    }


def _environment(env: Mapping[str, str]) -> list[str]:
    return [f"{name}={value}" for name, value in unit_environment(env).items()]


#: How :func:`describe` writes the characters a unit's file cannot hold as
#: they are, C-style as systemd-run does (``\\n``), and the backslash that
#: would then be ambiguous.
_DESCRIPTION_ESCAPES = {
    **{code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F)},
    ord("\t"): "\\t",
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\\"): "\\\\",
}
#: The most characters of the command line a unit's Description shows.
DESCRIPTION_LENGTH = 200


def describe(cmdline: Sequence[str]) -> str:
    """The ``Description`` of a unit running ``cmdline``: the command line,
    its control characters and backslashes escaped, cut at
    :data:`DESCRIPTION_LENGTH` characters. A multi-line ``sh -c`` script
    would otherwise break the unit's file
    (:func:`sdexec.unitfile.unit_file_problem`); a cut that leaves a
    backslash at the end drops it (it would join the next setting to this
    one). The cut falls between escapes, never inside one: a bare
    ``rstrip`` of the backslashes dropped an escaped backslash whole and
    left half of a ``\\x1b``."""
    text = " ".join(cmdline)
    escaped = text.translate(_DESCRIPTION_ESCAPES)
    if len(escaped) <= DESCRIPTION_LENGTH:
        return escaped
    return _cut_between_escapes(text[:DESCRIPTION_LENGTH])


def _cut_between_escapes(text: str) -> str:
    """``text`` escaped, as many whole characters of it as fit in
    :data:`DESCRIPTION_LENGTH` (each escaped as it is, whole or not at all)."""
    kept, length = [], 0
    for char in text:
        piece = _DESCRIPTION_ESCAPES.get(ord(char), char)
        length += len(piece)
        if length > DESCRIPTION_LENGTH:
            break
        kept.append(piece)
    return "".join(kept)


def unit_properties(
    command: Command,
    start: ExecLine,
    properties: Mapping[str, str] = {},
    sources: Mapping[str, str] = {},
) -> list[UnitProperty]:
    """The ``StartTransientUnit`` properties for ``command`` (all but the three
    fds, which :meth:`sdexec.systemd.SystemdClient.start_transient_unit`
    adds), run as ``start`` says (:func:`command_line`: plain ``ExecStart``,
    the command verbatim or through a trampoline, the form systemd reads back
    from the unit's file).

    ``properties`` are extra ``Name → string`` unit properties, already merged
    by precedence, ``sources`` says where each came from (``request`` unless
    named); each is typed by :func:`sdexec.property.typed_property`
    (``PropertyError`` names a bad one). ``Type`` defaults to ``exec``, so the
    unit becomes active only once the command was really executed.
    """
    unit = [
        UnitProperty("Description", "s", describe(command.cmdline)),
        UnitProperty("ExecStart", "a(sasb)", [[start.path, start.argv, False]]),
        UnitProperty("RemainAfterExit", "b", True),
        UnitProperty("Environment", "as", _environment(command.env)),
    ]
    if command.cwd is not None:
        unit.append(UnitProperty("WorkingDirectory", "s", command.cwd))
    if "Type" not in properties:
        unit.append(UnitProperty("Type", "s", "exec"))
    # systemd before 252 checks a priority against the policy it has so
    # far: one sent before its policy was refused for every job.
    ordered = sorted(
        properties.items(), key=lambda item: item[0] != "CPUSchedulingPolicy"
    )
    unit.extend(
        typed_property(name, value, sources.get(name, "request"))
        for name, value in ordered
    )
    return unit


def command_line(
    command: Command, executable: str, properties: Mapping[str, str]
) -> ExecLine:
    """What ``ExecStart`` is given for ``command`` (``executable`` its
    ``cmdline[0]`` resolved) in a unit of ``properties``: the trampoline, if
    it is needed, keeps SIGPIPE as the unit's ``IgnoreSIGPIPE`` says."""
    ignore_sigpipe = properties.get("IgnoreSIGPIPE", "yes")
    try:
        ignored = parse_bool(ignore_sigpipe)
    except ValueError:
        ignored = True  # refused anyway, as its property is typed
    return exec_line(executable, command.cmdline, ignored)


#: The properties :func:`unit_properties` sets itself, whatever the command,
#: and ``ExecStartEx``: the flags form of ``ExecStart`` would add a second
#: command to the unit.
OWN_PROPERTIES = frozenset(
    {"ExecStartEx"}
    | {
        prop.name
        for prop in unit_properties(Command(["/"], cwd="/"), exec_line("/", ["/"]))
    }
)
