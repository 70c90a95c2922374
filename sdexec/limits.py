"""What a request's strings must be before they go near D-Bus, systemd or exec.

Three kinds of check, all made before anything is started or tabled
(issue 16), each refusing with :class:`~sdexec.refusal.RequestRefused`
naming the field:

- **Text** (:func:`check_text`; for a command object,
  ``check_texts(command_text(...))``): every string
  that reaches systemd, the process table or a response must encode as UTF-8
  (no lone surrogates: a JSON ``"\\ud800"`` decodes to one) and must not
  contain NUL (a D-Bus string cannot; a bus may drop the connection that
  sends one). ``EINVAL``.
- **exec limits** (:func:`check_exec_size`): Linux refuses, with ``E2BIG``,
  any single argument or environment string of ``MAX_ARG_STRLEN`` bytes or
  more (NUL included), and an argv + envp larger than its argument space.
  systemd would only find out after forking (status 203/EXEC); sdexec says
  ``E2BIG`` at once, naming the string or the totals.
- **Message size** (:func:`check_start_message`): the whole
  ``StartTransientUnit`` call must stay under :data:`MAX_START_MESSAGE`, so
  that the manager is never sent a message that can abort it.
- **Unit-file lines** (:func:`check_unit_file_lines`): systemd writes the
  command and the environment each as one line of the transient unit's
  file, and reads no line of ``LONG_LINE_MAX`` bytes back: each must stay
  within :data:`~sdexec.unitfile.MAX_UNIT_LINE` as systemd escapes it.
  ``E2BIG``. (A property's value: :func:`sdexec.property.typed_property`.)
- **Command size** (:func:`check_command_size`): every string of the command
  object, what systemd is sent and what it is not (options, environment
  names it refuses), counted against :data:`MAX_COMMAND`: the process keeps
  its command for its life. ``E2BIG``.
- **Counts** (:func:`check_counts`): systemd's time for a unit's
  arguments and environment grows with the square of their number, and
  its manager serves no one meanwhile: at most :data:`MAX_ARGUMENTS`
  arguments and :data:`MAX_ENVIRONMENT` variables. ``E2BIG``.
- **The command search** (:func:`search_directories`): a bare command
  name is looked for in at most :data:`MAX_SEARCH_DIRECTORIES` of PATH's
  directories, each one stat on the reactor every client shares. ``E2BIG``.
- **Lengths** (:func:`check_lengths`): ``cwd`` is a path (under
  :data:`PATH_MAX`), and what every ``list`` and stats answer repeats (the
  label, the job id) is a name, not a payload (:data:`MAX_NAME`).

Everything here is pure: no I/O beyond ``sysconf``.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Final, TypeGuard

from sdexec.execstart import ExecLine, encoded_arguments
from sdexec.refusal import (
    SHOWN,
    RequestRefused,
    json_quoted,
    lone_surrogate,
    member,
    printable,
    quoted,
)
from sdexec.unitfile import (
    ESCAPED_AS_COMMAND,
    ESCAPED_AS_ENVIRONMENT,
    UnitFileLine,
    line_too_long,
)

__all__ = [
    "KERNEL_ARG_CEILING",
    "MAX_ARGUMENTS",
    "MAX_ARG_STRLEN",
    "MAX_COMMAND",
    "MAX_ENVIRONMENT",
    "MAX_LISTED_CMDLINE",
    "MAX_LISTED_NAME",
    "MAX_NAME",
    "MAX_START_MESSAGE",
    "NAME_MAX",
    "PATH_MAX",
    "SYSTEMD_ENV_RESERVE",
    "arg_max",
    "check_command_size",
    "check_counts",
    "check_exec_size",
    "check_lengths",
    "check_start_message",
    "check_text",
    "check_texts",
    "check_trampoline_exec",
    "check_unit_file_lines",
    "command_line_length",
    "command_text",
    "environment_line_length",
    "is_integer",
    "is_text",
    "job_id_problem",
    "listed_cmdline",
    "listed_name",
]

#: Linux's ``MAX_ARG_STRLEN`` (``32 * PAGE_SIZE``: 131072 with 4 KiB pages):
#: the most bytes, terminating NUL included, of one argument or environment
#: string. A string of 131071 bytes can be exec'd; one byte more cannot.
MAX_ARG_STRLEN: Final = 32 * os.sysconf("SC_PAGE_SIZE")

#: The kernel's ceiling on argv + envp whatever the stack limit: ``fs/exec.c``
#: allows at most ``_STK_LIM / 4 * 3`` (6 MiB), even with an unlimited stack,
#: where ``sysconf(_SC_ARG_MAX)`` answers far more.
KERNEL_ARG_CEILING: Final = 8 * 1024 * 1024 // 4 * 3

#: Linux's ``PATH_MAX``: no system call takes a path of this many bytes or
#: more (its NUL included), and systemd refuses such a ``WorkingDirectory``.
PATH_MAX: Final = 4096

#: Linux's ``NAME_MAX``: the most bytes of one path component; no file has a
#: longer name, so a bare command name longer than this is found nowhere.
NAME_MAX: Final = 255

#: The most bytes of a label or a job id. Both are repeated in every
#: ``sdexec.list`` answer and every stats report, to every client: a 30 MiB
#: one made each ``list`` 63 MB and each ``stats-get`` 126 MB, past the
#: clients' own frame limit. (Flux's job ids are at most 30-odd bytes.)
MAX_NAME: Final = 1024

#: Characters of a command line that ``sdexec.list`` and the stats show:
#: each entry is repeated to every client in every answer, and one exec may
#: take megabytes of arguments (seven such made each ``list`` 77 MB, past
#: the clients' frame limit).
MAX_LISTED_CMDLINE: Final = 1024

#: Linux's ``ARG_MAX`` floor: 32 pages' worth (128 KiB) is always allowed.
_ARG_FLOOR: Final = 128 * 1024

#: Bytes of argument space left for the variables systemd adds to every
#: process it spawns (``INVOCATION_ID``, ``SYSTEMD_EXEC_PID``,
#: ``MANAGERPID``, ``JOURNAL_STREAM``, ``HOME``, ``USER``, ``LOGNAME``,
#: ``SHELL``, ``PATH``, ``LANG``, ``XDG_RUNTIME_DIR``,
#: ``MEMORY_PRESSURE_*``...: under 2 KiB together, pointers included), so a
#: command accepted here is not then refused by exec.
SYSTEMD_ENV_RESERVE: Final = 4096

#: The largest ``StartTransientUnit`` call sdexec sends, by the estimate of
#: :func:`check_start_message` (an upper bound): 2.5 MiB.
#:
#: Why this number: the limits of the bus are far above it (the D-Bus
#: protocol's maximum message is 128 MiB, ``DBUS_MAXIMUM_MESSAGE_LENGTH``;
#: dbus-daemon's default ``max_message_size`` is 32 MiB, raised to ~1 GB by
#: the stock session.conf; sd-bus accepts up to 128 MiB,
#: ``BUS_MESSAGE_SIZE_MAX``), but the systemd manager itself is not: a
#: single 5 MB argument, and 100 arguments of 60 kB, aborted the user
#: manager (SIGABRT) in issue 16's reproduction, taking every unit with it.
#: Measured on systemd 252 (a private ``systemd --user``): an ``ExecStart``
#: whose arguments total 4,194,304 bytes (4 MiB) aborts it, in one argument
#: or across 100; 4,190,000 bytes and a 4 MiB ``Environment`` do not. The cap
#: stays well under that (0.6x), and still admits every command a job can
#: exec with the usual 8 MiB stack limit (its argument space is 2 MiB) plus
#: the unit's own properties.
MAX_START_MESSAGE: Final = 2 * 1024 * 1024 + 512 * 1024

#: The D-Bus header of a ``StartTransientUnit`` call (path, interface,
#: member, destination, signature, serial, fd count) is under 300 bytes;
#: this also covers the unit name's and mode's framing.
_MESSAGE_BASE: Final = 1024
#: A marshalled string: a 4-byte length, the bytes, a NUL, up to 3 bytes of
#: padding to the next 4-byte boundary.
_STRING_FRAMING: Final = 8
#: One ``(sv)`` property beyond its name and string value: struct alignment,
#: variant signature, and room for a typed value (a CPU bitmask, a device
#: list) being larger than its string form.
_PROPERTY_FRAMING: Final = 512

_POINTER: Final = struct.calcsize("P")

#: The most bytes the strings of one command object may take, as
#: :func:`check_command_size` counts them: every argument, every environment
#: name and value (those sdexec drops included), every option name and value,
#: ``cwd`` and ``label`` (channels are refused), each framed as a marshalled
#: string. The process keeps its command for its life (``attached`` echoes
#: it), so this bounds what each one holds of its request. Without it,
#: options and the environment names systemd refuses were counted by no
#: check: a 31.7 MB request was accepted, and each such background process
#: held 45 MB. The same 2.5 MiB as :data:`MAX_START_MESSAGE`: what a command
#: sends systemd is capped there already, and what it does not send (a few
#: options, the odd exported shell function) is small.
MAX_COMMAND: Final = MAX_START_MESSAGE
#: The longest environment variable or option name an ``E2BIG`` of
#: :func:`check_command_size` quotes whole.
_QUOTED_NAME: Final = 64


#: The most variables a unit's environment may hold. systemd 252 merges
#: them one by one into a list it searches each time (the manager when it
#: takes the unit, again when it spawns it): its time grows with the square
#: of their number, and the manager serves no one meanwhile. Measured on a
#: private ``systemd --user``: 10,000 variables held it 0.7 s, 40,000 10 s
#: (6 s of its CPU), 100,000 over a minute, four of those at once over two
#: minutes, until the bus dropped it and every start in flight failed;
#: 4096 take 0.2 s. Nothing in the kernel bounds the count below the
#: argument space (a 2 MiB one holds 190,000 empty variables), and a job's
#: environment holds hundreds.
MAX_ENVIRONMENT: Final = 4096


#: The most arguments a command may have. systemd 252's time for them grows
#: with their square too, if more slowly: 32,768 held the manager 0.35 s,
#: 65,536 1.3 s, 200,000 (one-byte arguments within a 2 MiB argument
#: space) 10.8 s, 10 s of its CPU. ``xargs`` fills 128 KiB at most, a few
#: thousand paths.
MAX_ARGUMENTS: Final = 32768


def check_counts(cmdline: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse with ``E2BIG``, naming ``cmd.cmdline`` or ``cmd.env``, a
    command of more than :data:`MAX_ARGUMENTS` arguments or a unit's
    environment ``env`` of more than :data:`MAX_ENVIRONMENT` variables."""
    counts = (
        ("cmd.cmdline", len(cmdline), MAX_ARGUMENTS, "arguments"),
        ("cmd.env", len(env), MAX_ENVIRONMENT, "variables"),
    )
    for field, count, most, what in counts:
        if count > most:
            raise RequestRefused(
                errno.E2BIG,
                f"{field}: {count} {what}, more than the {most} sdexec passes"
                f" to systemd, whose time for a unit's {what} grows with the"
                " square of their number, serving no one meanwhile",
            )


#: The most distinct PATH directories a bare command name is looked for in
#: (:func:`search_directories`). A PATH under ``MAX_ARG_STRLEN`` holds
#: 30,000 short ones; looking in each held the reactor for tens of
#: milliseconds a request. Module systems and conda stack tens.
MAX_SEARCH_DIRECTORIES: Final = 1024


def search_directories(path: str) -> list[str]:
    """PATH's directories in order, each once (``""`` is the working
    directory: ``"."``); ``E2BIG`` naming ``cmd.env.PATH`` past
    :data:`MAX_SEARCH_DIRECTORIES`."""
    directories = list(dict.fromkeys(entry or "." for entry in path.split(":")))
    if len(directories) > MAX_SEARCH_DIRECTORIES:
        raise RequestRefused(
            errno.E2BIG,
            f"cmd.env.PATH: {len(directories)} directories; a command name is"
            f" looked for in at most {MAX_SEARCH_DIRECTORIES} (give the"
            " command's path instead)",
        )
    return directories


def _refuse_text(field: str, why: str) -> RequestRefused:
    return RequestRefused(errno.EINVAL, f"{printable(field, SHOWN)}: {why}")


def check_text(field: str, value: str) -> None:
    """Refuse ``value`` (``EINVAL``, naming ``field``) unless it encodes as
    UTF-8 and contains no NUL."""
    if "\0" in value:
        raise _refuse_text(field, f"contains a NUL character at {value.index(chr(0))}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _refuse_text(field, lone_surrogate(value, error)) from None


def is_integer(value: object) -> TypeGuard[int]:
    """Whether a request's ``value`` is a JSON integer (a bool, which
    Python counts as one, is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_text(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a string that can be echoed back in a
    response (:func:`check_text` passes it)."""
    if not isinstance(value, str):
        return False
    try:
        check_text("", value)
    except RequestRefused:
        return False
    return True


def check_texts(fields: Iterable[tuple[str, str]]) -> None:
    """:func:`check_text` for each ``(field, value)``, in order; the first
    bad one is refused."""
    for field, value in fields:
        check_text(field, value)


def command_text(
    cmdline: Sequence[str],
    env: Mapping[str, str],
    opts: Mapping[str, str],
    cwd: str | None = None,
    label: str | None = None,
) -> Iterator[tuple[str, str]]:
    """Every string of an RFC 42 command object with its field name:
    ``cmd.cmdline[2]``, ``cmd.env`` (a key), ``cmd.env.FOO`` (its value),
    ``cmd.opts``, ``cmd.opts.SDEXEC_NAME``, ``cmd.cwd``, ``cmd.label``."""
    for index, arg in enumerate(cmdline):
        yield f"cmd.cmdline[{index}]", arg
    for table, mapping in (("cmd.env", env), ("cmd.opts", opts)):
        for key, value in mapping.items():
            # The key is checked as a string of its own first, so that the
            # value's field name below is known to be printable.
            yield f"{table} (key {quoted(key, SHOWN)})", key
            yield member(table, key), value
    if cwd is not None:
        yield "cmd.cwd", cwd
    if label is not None:
        yield "cmd.label", label


def arg_max(sysconf_value: int | None = None) -> int:
    """The argument space of an exec, in bytes, as the kernel computes it:
    ``sysconf(_SC_ARG_MAX)`` (a quarter of the stack limit) held between
    Linux's 128 KiB floor and its 6 MiB ceiling (:data:`KERNEL_ARG_CEILING`).

    ``sysconf_value`` replaces this process's ``sysconf`` answer (the job's
    stack limit may differ from the service's)."""
    value = os.sysconf("SC_ARG_MAX") if sysconf_value is None else sysconf_value
    return min(max(value, _ARG_FLOOR), KERNEL_ARG_CEILING)


def _environment_strings(env: Mapping[str, str]) -> Iterator[tuple[str, int]]:
    for name, value in env.items():
        # "NAME=VALUE": the form the kernel copies.
        yield (
            member("cmd.env", name),
            len(name.encode()) + 1 + len(value.encode()),
        )


def _exec_strings(
    executable: str, cmdline: Sequence[str], env: Mapping[str, str]
) -> Iterator[tuple[str, int]]:
    # The arguments first: the executable is cmd.cmdline[0] as sent (or the
    # trampoline's own short path), and a name too long for exec was
    # refused as "executable", which no request has.
    for index, arg in enumerate(cmdline):
        yield f"cmd.cmdline[{index}]", len(arg.encode())
    yield "the executable's path", len(executable.encode())
    yield from _environment_strings(env)


def check_exec_size(
    executable: str,
    cmdline: Sequence[str],
    env: Mapping[str, str],
    limit: int | None = None,
) -> None:
    """Refuse with ``E2BIG`` what ``execve(executable, cmdline, env)`` would.

    ``env`` is the environment the unit will get (after
    :func:`sdexec.policy.clean_environment` and dropping names systemd
    refuses). ``limit`` is the argument space (default :func:`arg_max`).
    The text must already have passed :func:`check_texts`.

    Counted as ``fs/exec.c`` counts: each string's bytes plus its NUL (the
    executable's path is copied too), plus one pointer per argument and
    environment string, plus :data:`SYSTEMD_ENV_RESERVE` for systemd's own
    variables. A single string of ``MAX_ARG_STRLEN`` bytes or more (NUL
    included) is refused first, naming it.
    """
    limit = arg_max() if limit is None else limit
    total = _exec_total(executable, cmdline, env)
    if total > limit:
        raise RequestRefused(
            errno.E2BIG,
            f"cmd.cmdline and cmd.env: {len(cmdline)} arguments and {len(env)}"
            f" environment variables take {total} bytes; exec allows {limit}"
            " (ARG_MAX)",
        )


def _exec_total(executable: str, cmdline: Sequence[str], env: Mapping[str, str]) -> int:
    """The argument space ``execve(executable, cmdline, env)`` takes;
    ``E2BIG`` naming a string over ``MAX_ARG_STRLEN``."""
    total = SYSTEMD_ENV_RESERVE + (max(len(cmdline), 1) + len(env)) * _POINTER
    for field, size in _exec_strings(executable, cmdline, env):
        _check_string_size(field, size)
        total += size + 1
    return total


def _check_string_size(field: str, size: int, why: str = "") -> None:
    if size + 1 > MAX_ARG_STRLEN:
        raise RequestRefused(
            errno.E2BIG,
            f"{field}: {size} bytes{why}; Linux execs no single argument or"
            f" environment string over {MAX_ARG_STRLEN - 1} bytes"
            " (MAX_ARG_STRLEN)",
        )


def check_trampoline_exec(
    cmdline: Sequence[str], line: ExecLine, env: Mapping[str, str]
) -> None:
    """Refuse with ``E2BIG`` a command the trampoline that runs it
    (:func:`sdexec.execstart.exec_line`) could not be executed with: its
    arguments percent-encoded (a ``$``, ``;`` or ``%`` is three bytes),
    after the trampoline's own. What :func:`check_exec_size` passed may not
    pass here; a command systemd is given as it is has nothing more to
    check."""
    if not line.trampolined:
        return
    why = " once its $, ; and % are encoded for the trampoline, three bytes each"
    for index, arg in enumerate(encoded_arguments(line, cmdline)):
        _check_string_size(f"cmd.cmdline[{index}]", len(arg.encode()), why)
    total, limit = _exec_total(line.path, line.argv, env), arg_max()
    if total > limit:
        raise RequestRefused(
            errno.E2BIG,
            f"cmd.cmdline and cmd.env: {total} bytes with the trampoline that"
            " runs the command (its $, ; and % encoded, three bytes each);"
            f" exec allows {limit} (ARG_MAX)",
        )


def check_lengths(cwd: str | None, names: Mapping[str, str | None]) -> None:
    """Refuse a ``cwd`` of :data:`PATH_MAX` bytes or more
    (``ENAMETOOLONG``), and any of ``names`` (field name → value: the label,
    the job id) longer than :data:`MAX_NAME` bytes (``EINVAL``)."""
    if cwd is not None and len(cwd.encode()) >= PATH_MAX:
        raise RequestRefused(
            errno.ENAMETOOLONG,
            f"cmd.cwd: {len(cwd.encode())} bytes; a path is shorter than"
            f" {PATH_MAX} (PATH_MAX)",
        )
    for field, value in names.items():
        if value is not None and len(value.encode()) > MAX_NAME:
            raise RequestRefused(
                errno.EINVAL,
                f"{field}: {len(value.encode())} bytes; at most {MAX_NAME}",
            )


#: The longest ``flux SUBCOMMAND`` ``cmd`` of a ``list`` entry, as
#: upstream's subprocess server cuts it (a 64-byte buffer).
MAX_LISTED_NAME: Final = 63


def listed_name(cmdline: Sequence[str]) -> str:
    """The ``cmd`` of a ``list`` entry, as upstream's subprocess server
    gives it: the program, and for ``flux`` (every Flux command begins so)
    its subcommand too (``flux module-exec``), that pair cut at
    :data:`MAX_LISTED_NAME` characters. Upstream cuts nothing else: a long
    path is listed whole (its last part names the program), up to the
    bound of :func:`listed_cmdline`."""
    if not cmdline:
        return ""
    if cmdline[0] == "flux" and len(cmdline) > 1:
        return f"flux {cmdline[1]}"[:MAX_LISTED_NAME]
    return listed_cmdline(cmdline[:1])[0]


def listed_cmdline(cmdline: Sequence[str]) -> list[str]:
    """``cmdline`` as ``list`` and the stats show it: whole up to
    :data:`MAX_LISTED_CMDLINE` characters in all, each argument counting as
    one at least; a longer one cut there, its last argument shown ending in
    ``…``."""
    listed: list[str] = []
    left = MAX_LISTED_CMDLINE
    for arg in cmdline:
        # An empty argument counts too: 200 000 of them (ARG_MAX allows it)
        # were all listed, 700 KB in every client's every list.
        cost = max(len(arg), 1)
        if cost > left:
            listed.append(arg[:left] + "…")
            break
        listed.append(arg)
        left -= cost
    return listed


def _framed(text: str) -> int:
    return len(text.encode()) + _STRING_FRAMING


def job_id_problem(jobid: str) -> str | None:
    """Why ``jobid`` cannot name a job, or ``None``: it names the job in
    drain reasons, the log and every refusal a drained node gives, where a
    terminal would act on its escapes."""
    if jobid.isprintable():
        return None
    return f"{json_quoted(jobid)}: a job id is printable text"


def check_start_message(
    unit_name: str,
    executable: str,
    cmdline: Sequence[str],
    env: Mapping[str, str],
    properties: Mapping[str, str],
    cwd: str | None = None,
) -> int:
    """The bytes of the ``StartTransientUnit`` call for a command, as an
    upper bound; ``E2BIG`` if that exceeds :data:`MAX_START_MESSAGE`.

    Counted: the unit name, ``ExecStart`` (the path systemd executes and
    its arguments: :func:`sdexec.execstart.exec_line`),
    ``Environment``, ``WorkingDirectory`` (``cwd``), and every other
    property (``Name → string value``: the request's, the configuration's
    and the mapper's, merged), each string with its D-Bus framing, plus the
    message header.
    """
    size = _MESSAGE_BASE + _framed(unit_name) + _framed(executable)
    if cwd is not None:
        size += _framed("WorkingDirectory") + _framed(cwd) + _PROPERTY_FRAMING
    size += sum(_framed(arg) for arg in cmdline)
    size += sum(length + _STRING_FRAMING for _, length in _environment_strings(env))
    size += sum(
        _framed(name) + _framed(value) + _PROPERTY_FRAMING
        for name, value in properties.items()
    )
    if size > MAX_START_MESSAGE:
        raise RequestRefused(
            errno.E2BIG,
            f"cmd: the unit would take a {size}-byte StartTransientUnit message;"
            f" sdexec sends systemd at most {MAX_START_MESSAGE} bytes",
        )
    return size


#: How the command's line begins (sdexec/execstart.py: plain ``ExecStart``).
_COMMAND_KEY: Final = "ExecStart="
_ENVIRONMENT_KEY: Final = "Environment="


def _command_line(executable: str, cmdline: Sequence[str]) -> UnitFileLine:
    # Each argument in quotes, a space between two. The executable comes
    # first, after "@" and before a space, unless it is the first argument:
    # systemd then writes it once.
    if cmdline and cmdline[0] == executable:
        return UnitFileLine(
            len(_COMMAND_KEY) + 3 * len(cmdline) - 1, cmdline, ESCAPED_AS_COMMAND
        )
    return UnitFileLine(
        len(_COMMAND_KEY) + 1 + 3 * len(cmdline),
        [executable, *cmdline],
        ESCAPED_AS_COMMAND,
    )


def _environment_line(env: Mapping[str, str]) -> UnitFileLine:
    # Two quotes and "=" for each variable, a space between two.
    return UnitFileLine(
        len(_ENVIRONMENT_KEY) + max(4 * len(env) - 1, 0),
        [*env, *env.values()],
        ESCAPED_AS_ENVIRONMENT,
    )


def command_line_length(executable: str, cmdline: Sequence[str]) -> int:
    """The bytes of the ``ExecStart=`` line systemd 252 writes into a
    transient unit's file for ``executable`` run as ``cmdline``: the path
    after ``@`` (unless it is the first argument), then each argument in
    double quotes, separated by spaces, escaped as its ``shell_escape`` does
    (``$ ; " ' \\`` and control characters, ``%`` doubled)."""
    return _command_line(executable, cmdline).length()


def environment_line_length(env: Mapping[str, str]) -> int:
    """The bytes of the ``Environment=`` line systemd 252 writes into a
    transient unit's file for ``env``: each ``NAME=value`` in double quotes,
    separated by spaces, C-escaped as its ``cescape`` does (each byte of a
    non-ASCII character too), ``%`` doubled."""
    return _environment_line(env).length()


def check_unit_file_lines(
    executable: str, cmdline: Sequence[str], env: Mapping[str, str]
) -> None:
    """Refuse with ``E2BIG``, naming ``cmd.cmdline`` or ``cmd.env``, a
    command whose ``ExecStart=`` line (:func:`command_line_length`: give it
    :func:`sdexec.execstart.exec_line`'s path and arguments) or
    ``Environment=`` line (:func:`environment_line_length`, ``env`` being
    the unit's environment) would be longer than
    :data:`~sdexec.unitfile.MAX_UNIT_LINE`.

    Escaping is what makes a line long: 300 KB of control characters in
    ``env`` make a 1.2 MB one."""
    lines = (
        ("cmd.cmdline", _command_line(executable, cmdline)),
        ("cmd.env", _environment_line(env)),
    )
    for field, line in lines:
        length = line.overlong()
        if length is not None:
            raise RequestRefused(errno.E2BIG, f"{field}: {line_too_long(length)}")


def check_command_size(
    cmdline: Sequence[str],
    env: Mapping[str, str],
    opts: Mapping[str, str],
    cwd: str | None = None,
    label: str | None = None,
) -> int:
    """The bytes of a command object's strings, each with a marshalled
    string's framing; ``E2BIG`` if that exceeds :data:`MAX_COMMAND`, naming
    the part (``cmd.env``, ``cmd.opts``...) that takes the most and its
    largest entry.

    Every string counts, whether systemd is sent it or not: ``env`` is the
    request's whole environment, before the names systemd refuses and the
    caller's systemd variables are dropped. The text must already have
    passed :func:`check_texts`.
    """
    parts: dict[str, _Part] = {}
    for part, entry, size in _command_entries(cmdline, env, opts, cwd, label):
        parts.setdefault(part, _Part()).add(entry, size)
    total = sum(part.size for part in parts.values())
    if total > MAX_COMMAND:
        name, most = max(parts.items(), key=lambda item: item[1].size)
        raise RequestRefused(
            errno.E2BIG,
            f"cmd: its strings take {total} bytes, more than the {MAX_COMMAND}"
            f" a command may take (each string counted with {_STRING_FRAMING} bytes"
            f" of framing); the most of them in {name}: {most.size} bytes in"
            f" {most.count} {'entry' if most.count == 1 else 'entries'}, the"
            f" largest {_entry_name(name, most.largest)} ({most.largest_size} bytes)",
        )
    return total


class _Part:
    """One part of a command object (``cmd.env``, ``cmd.opts``...) as
    :func:`check_command_size` counts it."""

    def __init__(self) -> None:
        self.size = 0
        self.count = 0
        self.largest: str | int | None = None
        self.largest_size = -1

    def add(self, entry: str | int | None, size: int) -> None:
        self.size += size
        self.count += 1
        if size > self.largest_size:
            self.largest, self.largest_size = entry, size


def _command_entries(
    cmdline: Sequence[str],
    env: Mapping[str, str],
    opts: Mapping[str, str],
    cwd: str | None,
    label: str | None,
) -> Iterator[tuple[str, str | int | None, int]]:
    """``(part, entry, bytes)`` of every entry of a command object: an
    argument by its index, a variable or an option by its name (name and
    value counted together), ``cwd`` and ``label`` as a whole (channels are
    refused before)."""
    for index, arg in enumerate(cmdline):
        yield "cmd.cmdline", index, _framed(arg)
    for part, mapping in (("cmd.env", env), ("cmd.opts", opts)):
        for name, value in mapping.items():
            yield part, name, _framed(name) + _framed(value)
    for part, text in (("cmd.cwd", cwd), ("cmd.label", label)):
        if text is not None:
            yield part, None, _framed(text)


def _entry_name(part: str, entry: str | int | None) -> str:
    """``cmd.cmdline[2]``, ``cmd.env.FOO``, ``cmd.cwd``: a long name cut, so
    that the message stays short whatever the request named."""
    if entry is None:
        return part
    if isinstance(entry, int):
        return f"{part}[{entry}]"
    return member(part, entry, _QUOTED_NAME)
