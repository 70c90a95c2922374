"""Values of unit properties in systemd's own syntaxes, as ``systemd-run -p``
reads them (src/shared/bus-unit-util.c), for the properties whose D-Bus
type is more than a number, a boolean or a list of words: I/O device
limits, bind mounts, temporary file systems, IP address prefixes, masks of
namespaces and core-dump segments, signals, facilities, exit statuses.

Each parser takes the text a site or a request gives and returns the plain
Python value :mod:`sdexec.property` sends with the property's signature, or
raises ``ValueError`` saying what is wrong with the text. Where systemd-run
reads C escapes (``\\n``, ``\\x41``) or ``\\:`` in a path, these parsers
refuse a backslash rather than read it otherwise: sdexec does not re-create
systemd's escape rules, and a value that meant something else must not
reach the unit.
"""

from __future__ import annotations

import errno
import ipaddress
import re

from sdexec.exitstatus import exit_status_number
from sdexec.refusal import SHOWN, quoted
from sdexec.signals import parse_signal
from sdexec.sizes import UINT32_MAX, UINT64_MAX, parse_size

__all__ = [
    "ALL_NAMESPACES",
    "BPF_ATTACH_TYPES",
    "ERRNO_KILL",
    "NAMESPACES",
    "UINT32_MAX",
    "literal_words",
    "parse_absolute_paths",
    "parse_action_exit_status",
    "parse_bind_paths",
    "parse_bool",
    "parse_bpf_program",
    "parse_coredump_filter",
    "parse_directory_names",
    "parse_environment",
    "parse_errno_or_kill",
    "parse_exit_statuses",
    "parse_io_device_limits",
    "parse_ip_prefixes",
    "parse_log_extra_field",
    "parse_log_filter",
    "parse_mount_propagation",
    "parse_namespaces",
    "parse_one_path",
    "parse_one_word",
    "parse_optional_path",
    "parse_pair",
    "parse_protect_hostname",
    "parse_search_path",
    "parse_secure_bits",
    "parse_syslog_facility",
    "parse_temporary_file_systems",
    "parse_uint32",
    "parse_with_ignore",
    "quoted_words",
    "shell_words",
    "time_span_problem",
]

#: Linux's namespace flags (``CLONE_NEW…``) by systemd's names for them.
NAMESPACES = {
    "cgroup": 0x02000000,
    "ipc": 0x08000000,
    "net": 0x40000000,
    "mnt": 0x00020000,
    "pid": 0x20000000,
    "user": 0x10000000,
    "uts": 0x04000000,
    "time": 0x00000080,
}
ALL_NAMESPACES = sum(NAMESPACES.values())
#: A mount's ``MS_REC``: a bind mount's submounts are bound too.
_MS_REC = 16384
#: What systemd's seccomp filter takes for ``SystemCallErrorNumber=kill``.
ERRNO_KILL = 2**31 - 2
#: The segments of ``/proc/PID/coredump_filter`` (core(5)), bit by bit.
_COREDUMP_SEGMENTS = (
    "private-anonymous", "shared-anonymous", "private-file-backed",
    "shared-file-backed", "elf-headers", "private-huge", "shared-huge",
    "private-dax", "shared-dax",
)  # fmt: skip
#: The kernel's default filter, which systemd's ``default`` names.
_COREDUMP_DEFAULT = 0x33
#: ``SecureBits=`` names (linux/securebits.h), bit by bit.
_SECURE_BITS = (
    "noroot", "noroot-locked", "no-setuid-fixup", "no-setuid-fixup-locked",
    "keep-caps", "keep-caps-locked",
)  # fmt: skip
#: syslog(3)'s facilities, unshifted, as systemd names them.
_FACILITIES = {
    "kern": 0, "user": 1, "mail": 2, "daemon": 3, "auth": 4, "syslog": 5,
    "lpr": 6, "news": 7, "uucp": 8, "cron": 9, "authpriv": 10, "ftp": 11,
    **{f"local{n}": 16 + n for n in range(8)},
}  # fmt: skip
#: The words ``IPAddressAllow``/``IPAddressDeny`` take for a whole value.
_IP_KEYWORDS = {
    "any": ("0.0.0.0/0", "::/0"),
    "localhost": ("127.0.0.0/8", "::1/128"),
    "link-local": ("169.254.0.0/16", "fe80::/64"),
    "multicast": ("224.0.0.0/4", "ff00::/8"),
}
_AF_INET, _AF_INET6 = 2, 10
_DIGITS = re.compile(r"[0-9]{1,20}")
_ERRNO_NAME = re.compile(r"E[A-Z0-9]+")
_ENVIRONMENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: A journal field a unit may add (systemd's journal_field_valid, its
#: protected ``_`` fields aside).
_JOURNAL_FIELD = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
#: The cgroup BPF attach types systemd names (``BPFProgram=TYPE:PATH``).
BPF_ATTACH_TYPES = (
    "ingress", "egress", "sock_create", "sock_ops", "device", "bind4", "bind6",
    "connect4", "connect6", "post_bind4", "post_bind6", "sendmsg4", "sendmsg6",
    "sysctl", "recvmsg4", "recvmsg6", "getsockopt", "setsockopt",
)  # fmt: skip
#: The first time span (in microseconds) systemd cannot read back from a
#: unit's file. It writes one there in words (``584542y 2w 2d 20h…``), and
#: its parser refuses a count of a unit of time at or above what 64 bits
#: hold of that unit: the setting is then dropped at a daemon-reload
#: (measured on systemd 252: ``584541y …`` reads back, ``584542y`` does not).
TIMESPAN_UNREADABLE = 584_542 * 31_557_600 * 1_000_000
#: mount(2)'s propagation flags, as ``MountFlags`` names them.
_PROPAGATION = {"shared": 1 << 20, "slave": 1 << 19, "private": 1 << 18}


def shell_words(text: str, what: str = "nothing named") -> list[str]:
    """``text``'s words, quoted as a shell would (``"/a '/b c'"``), which
    systemd's unquoting reads alike; ``ValueError(what)`` if there are none,
    and for a backslash (see the module's docstring) or an unclosed quote."""
    if "\\" in text:
        raise ValueError(
            f"{quoted(text, SHOWN)}: sdexec does not read systemd's backslash"
            " escapes here;"
            " quote the word instead"
        )
    return quoted_words(text, f"{what}: the value is empty")


def literal_words(text: str, none: str = "nothing named") -> list[str]:
    """``text``'s words, quoted as a shell would (``"'a b' c"``), each
    backslash kept as written: an escaped unit name
    (``mnt-scratch\\x2d1.mount``) or a domain's group (``EXAMPLE\\hpc``)
    as the manager names it, where systemd-run would drop the backslash.
    ``ValueError(none)`` if there are none, and for an unclosed quote."""
    return _split(text, none, escape="")


def quoted_words(text: str, none: str) -> list[str]:
    """``text``'s words, quoted as a shell would; ``ValueError(none)`` if
    there are none, and for an unclosed quote."""
    return _split(text, none, escape="\\")


def _split(text: str, none: str, escape: str) -> list[str]:
    """``text``'s words as :func:`shlex.split` reads them, but with
    ``escape`` its escape characters (``""``: a backslash is a character).
    By pieces matched at once, not shlex's character at a time: shlex
    grows each word by ``+=`` on an attribute, which copies it, so a
    request's value of 900 kB (ReadOnlyPaths of one long path) held the
    reactor for 9 s."""
    words: list[str] = []
    word: list[str] | None = None  # None: between words
    for piece in (_PIECES if escape else _LITERAL_PIECES).finditer(text):
        kind = piece.lastgroup
        if kind == "space":
            if word is not None:
                words.append("".join(word))
            word = None
            continue
        if kind in ("open", "lone"):
            raise ValueError(f"{quoted(text, SHOWN)}: {_unended(piece, escape)}")
        word = [] if word is None else word
        word.append(_unquoted(kind, piece[0]))
    if word is not None:
        words.append("".join(word))
    if not words:
        raise ValueError(none)
    return words


def _unended(piece: re.Match[str], escape: str) -> str:
    """shlex's words for a quote not closed, or a backslash at the end
    (also within double quotes: ``"a\\``)."""
    if piece.lastgroup == "open":
        inside = _DOUBLE_TO_THE_END if piece[0] == '"' and escape else None
        if inside is None or not inside.fullmatch(piece.string, piece.end()):
            return "No closing quotation"
    return "No escaped character"


def _unquoted(kind: str | None, piece: str) -> str:
    """A piece of a word (:data:`_PIECES`) as shlex (posix) reads it."""
    if kind == "single":
        return piece[1:-1]
    if kind == "double":  # a backslash escapes only " and itself here
        return _ESCAPED_IN_DOUBLE.sub(r"\1", piece[1:-1])
    if kind == "escaped":
        return piece[1:]
    return piece


#: shlex's whitespace (posix, ``whitespace_split``).
_SPACE = r"(?P<space>[ \t\r\n]+)"
#: A word's pieces, with a backslash as escape: plain characters, a
#: quoted string, an escaped character; else an unclosed quote, or a
#: backslash that ends the text.
_PIECES = re.compile(
    _SPACE
    + r"""|(?P<plain>[^ \t\r\n'"\\]+)|(?P<single>'[^']*')"""
    + r"""|(?P<double>"(?:[^"\\]++|\\.)*+")|(?P<escaped>\\.)"""
    + r"""|(?P<open>['"])|(?P<lone>\\)""",
    re.DOTALL,
)
#: The same, where a backslash is a character (in double quotes too).
_LITERAL_PIECES = re.compile(
    _SPACE
    + r"""|(?P<plain>[^ \t\r\n'"]+)|(?P<single>'[^']*'|"[^"]*")"""
    + r"""|(?P<open>['"])""",
)
#: The rest of a text after an unclosed double quote, ending with a backslash.
_DOUBLE_TO_THE_END = re.compile(r'(?:[^"\\]++|\\.)*+\\', re.DOTALL)
_ESCAPED_IN_DOUBLE = re.compile(r'\\(["\\])')


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"{quoted(path, SHOWN)} is not an absolute path")
    return _normalized(path)


def _normalized(path: str) -> str:
    """``path`` if systemd takes it as normalized (its path_is_normalized:
    no ``//``, no ``.`` or ``..`` component), else ``ValueError``."""
    if "//" in path or {".", ".."} & set(path.split("/")):
        raise ValueError(
            f"{quoted(path, SHOWN)} is not normalized (no //, . or .. in it)"
        )
    return path


def _entries(text: str) -> list[str]:
    """Comma-separated entries, each stripped (the form of ``DeviceAllow``
    here: systemd-run takes one entry per assignment, a site's table one
    value per property)."""
    entries = [entry.strip() for entry in text.split(",")]
    if not all(entries):
        raise ValueError(
            f"{quoted(text, SHOWN)}: an empty entry (entries are separated by ',')"
        )
    return entries


def parse_io_device_limits(text: str, value: str) -> list[tuple[str, int]]:
    """``"/dev/nvme0n1 100M, /dev/sda 5M"``: each entry a device (or a file
    on it) and its value, ``a(st)``. ``value`` says which: ``"size"``
    (bandwidths and IOPS: base 1000, as systemd reads them, or
    ``infinity``), ``"weight"`` (1 to 10000) or ``"usec"`` (microseconds,
    or ``infinity``)."""
    limits = []
    for entry in _entries(text):
        path, _, amount = entry.partition(" ")
        amount = amount.strip()
        if not amount:
            raise ValueError(f"{quoted(entry, SHOWN)} is not 'PATH VALUE'")
        limits.append((_absolute(path), _io_amount(amount, value)))
    return limits


def _io_amount(text: str, kind: str) -> int:
    if kind == "weight":
        if _DIGITS.fullmatch(text) is None or not 1 <= int(text) <= 10000:
            raise ValueError(f"{quoted(text, SHOWN)} is not a weight from 1 to 10000")
        return int(text)
    if text == "infinity":
        return UINT64_MAX
    if kind == "usec":
        if _DIGITS.fullmatch(text) is None or int(text) >= UINT64_MAX:
            raise ValueError(
                f"{quoted(text, SHOWN)} is not microseconds (a number) or infinity"
            )
        problem = time_span_problem(int(text), milliseconds=False)
        if problem is not None:
            raise ValueError(f"{quoted(text, SHOWN)} {problem}")
        return int(text)
    amount = parse_size(text, base=1000)
    if amount == 0:
        # systemd takes a 0 over D-Bus, but its unit-file parser does not:
        # at a daemon-reload the entry was gone from the unit.
        raise ValueError(
            f"{quoted(text, SHOWN)} is out of range: a daemon-reload reads back no"
            " limit of 0"
            " (give 1 or more, or infinity)"
        )
    return amount


def time_span_problem(value: int, milliseconds: bool) -> str | None:
    """Why systemd would read a time span of ``value`` microseconds (not
    infinity) back otherwise from the unit's file, where it writes it to
    the microsecond, or to the millisecond where ``milliseconds``; ``None``
    if it would not. Phrased to follow the value as given."""
    if value >= TIMESPAN_UNREADABLE:
        return (
            "is too long a time span for the unit's file: systemd writes it"
            " there in years, and a daemon-reload reads back none of 584542"
            " years or more (give infinity)"
        )
    if milliseconds and value > 1000 and value % 1000:
        return (
            "has a part of a millisecond: systemd writes it into the unit's"
            " file in whole milliseconds, and a daemon-reload would make it"
            f" {value - value % 1000}"
        )
    return None


def parse_bind_paths(text: str) -> list[tuple[str, str, bool, int]]:
    """``BindPaths``/``BindReadOnlyPaths``: entries separated by spaces,
    each ``[-]SRC[:DST[:rbind|norbind]]`` (``-``: a missing source is no
    error; the destination defaults to the source; submounts are bound
    unless ``norbind``), ``a(ssbt)``."""
    if _quotes_a_colon(text):
        raise ValueError(
            f"{quoted(text, SHOWN)}: a ':' in quotes is part of a path to systemd,"
            " which sdexec"
            " does not take here"
        )
    mounts = []
    for word in shell_words(text, "no path given"):
        optional = word.startswith("-")
        source, _, rest = word.removeprefix("-").partition(":")
        destination, _, options = rest.partition(":")
        if options not in ("", "rbind", "norbind"):
            raise ValueError(
                f"{quoted(word, SHOWN)}: {quoted(options, SHOWN)} is not rbind or"
                " norbind"
            )
        flags = 0 if options == "norbind" else _MS_REC
        target = _absolute(destination) if destination else source
        mounts.append((_absolute(source), target, optional, flags))
    return mounts


def _quotes_a_colon(text: str) -> bool:
    """Whether a ``:`` of ``text`` is inside quotes."""
    quote = ""
    for character in text:
        if quote and character == quote:
            quote = ""
        elif not quote and character in "'\"":
            quote = character
        elif quote and character == ":":
            return True
    return False


def parse_temporary_file_systems(text: str) -> list[tuple[str, str]]:
    """``TemporaryFileSystem``: entries separated by spaces, each
    ``PATH[:OPTIONS]`` (mount options, ``ro,size=1G``), ``a(ss)``."""
    mounts = []
    for word in shell_words(text, "no path given"):
        path, _, options = word.partition(":")
        if "%" in options:
            # systemd doubles it in the unit's file, and reads it back so.
            raise ValueError(
                f"{quoted(word, SHOWN)}: systemd writes a '%' of the options into"
                " the unit's"
                " file as '%%', which a daemon-reload reads back so"
            )
        mounts.append((_absolute(path), options))
    return mounts


def parse_ip_prefixes(text: str) -> list[tuple[int, bytes, int]]:
    """``IPAddressAllow``/``IPAddressDeny``: addresses with an optional
    prefix length, separated by spaces (``"10.0.0.0/8 fd00::/8"``), or one
    of ``any``, ``localhost``, ``link-local``, ``multicast`` alone,
    ``a(iayu)``: family, address bytes, prefix length."""
    words = _IP_KEYWORDS.get(text.strip()) or shell_words(text, "no address given")
    prefixes = []
    for word in words:
        try:
            interface = _ip_prefix(word)
        except ValueError:
            raise ValueError(
                f"{quoted(word, SHOWN)} is not an IP address or prefix (10.0.0.0/8,"
                " fd00::/8),"
                f" nor alone one of {', '.join(_IP_KEYWORDS)}"
            ) from None
        family = _AF_INET if interface.version == 4 else _AF_INET6
        length = interface.network.prefixlen
        prefixes.append((family, interface.ip.packed, length))
    return prefixes


def _ip_prefix(word: str) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    """``word`` as an address and prefix length, in the forms systemd reads:
    no zone (``%eth0``), a length not a netmask."""
    address, slash, length = word.partition("/")
    if "%" in address or (slash and not length.isdigit()):
        raise ValueError(word)
    return ipaddress.ip_interface(word)


def parse_namespaces(text: str, delegated: bool = False) -> int:
    """``RestrictNamespaces``: the namespaces a unit may create, as systemd's
    mask of ``CLONE_NEW…`` flags: names separated by spaces (``"net mnt"``),
    led by ``~`` for all but those; ``yes`` none, ``no`` all.
    ``DelegateNamespaces`` (``delegated``): the namespaces delegated to the
    unit's own user namespace, where all is every one but the user one
    (``~``, ``yes``), and ``no`` is none."""
    every = ALL_NAMESPACES & ~NAMESPACES["user"] if delegated else ALL_NAMESPACES
    boolean = _boolean(text)
    if boolean is not None:
        return every if boolean == delegated else 0
    inverted = text.startswith("~")
    mask = 0
    for word in shell_words(text[1:] if inverted else text, "no namespace named"):
        if word not in NAMESPACES:
            raise ValueError(
                f"{quoted(word, SHOWN)} is no namespace ({', '.join(NAMESPACES)}),"
                " nor a boolean"
            )
        mask |= NAMESPACES[word]
    return every & ~mask if inverted else mask


#: systemd's parse_boolean(), as systemd-run reads every boolean.
_TRUE = frozenset({"1", "yes", "y", "true", "t", "on"})
_FALSE = frozenset({"0", "no", "n", "false", "f", "off"})


def parse_bool(text: str) -> bool:
    """systemd's booleans: 1|yes|y|true|t|on, 0|no|n|false|f|off, any case."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(
        f"{quoted(text, SHOWN)} is not a boolean (yes/no, true/false, on/off, 1/0)"
    )


def _boolean(text: str) -> bool | None:
    try:
        return parse_bool(text)
    except ValueError:
        return None


def parse_coredump_filter(text: str) -> int:
    """``CoredumpFilter``: segment names separated by spaces
    (``"private-anonymous shared-anonymous"``), ``default``, ``all``, or the
    hexadecimal mask itself, as ``/proc/PID/coredump_filter`` takes it."""
    mask = 0
    for word in shell_words(text, "no segment named"):
        if word == "all":
            mask = UINT32_MAX  # systemd's: the kernel refuses more (ERANGE)
        elif word == "default":
            mask |= _COREDUMP_DEFAULT
        elif word in _COREDUMP_SEGMENTS:
            mask |= 1 << _COREDUMP_SEGMENTS.index(word)
        else:
            mask |= _hex_mask(word)
    return mask


def _hex_mask(word: str) -> int:
    # The kernel reads the filter as 32 bits (ERANGE past them, which
    # systemd would meet at every start).
    digits = word.lower().removeprefix("0x")
    if re.fullmatch(r"[0-9a-f]{1,8}", digits) is None:
        raise ValueError(
            f"{quoted(word, SHOWN)} is no core-dump segment"
            f" ({', '.join(_COREDUMP_SEGMENTS)},"
            " default, all) nor a hexadecimal mask of 32 bits"
        )
    return int(digits, 16)


def parse_secure_bits(text: str) -> int:
    """``SecureBits``: names separated by spaces (``"noroot keep-caps"``)."""
    bits = 0
    for word in shell_words(text, "no secure bit named"):
        if word not in _SECURE_BITS:
            raise ValueError(
                f"{quoted(word, SHOWN)} is no secure bit ({', '.join(_SECURE_BITS)})"
            )
        bits |= 1 << _SECURE_BITS.index(word)
    return bits


def parse_syslog_facility(text: str) -> int:
    """``SyslogFacility``: ``daemon``, ``local0``…, or its number."""
    word = text.strip()
    if word in _FACILITIES:
        return _FACILITIES[word]
    if _DIGITS.fullmatch(word) and int(word) in _FACILITIES.values():
        return int(word)
    raise ValueError(
        f"{quoted(word, SHOWN)} is no syslog facility ({', '.join(_FACILITIES)})"
    )


def parse_errno_or_kill(text: str) -> int:
    """``SystemCallErrorNumber``: an errno by name (``EPERM``) or number,
    or ``kill`` (the call kills the process instead)."""
    word = text.strip()
    if word == "kill":
        return ERRNO_KILL
    if _DIGITS.fullmatch(word):
        number = int(word)
    elif _ERRNO_NAME.fullmatch(word) and isinstance(getattr(errno, word, None), int):
        number = getattr(errno, word)
    else:
        raise ValueError(
            f"{quoted(word, SHOWN)} is no errno (EPERM, EACCES…, a number), nor kill"
        )
    if not 1 <= number <= 4095:
        raise ValueError(
            f"{quoted(word, SHOWN)} is out of range: errno numbers are 1 to 4095"
        )
    return number


def parse_exit_statuses(text: str) -> tuple[list[int], list[int]]:
    """``SuccessExitStatus`` and the two ``Restart…ExitStatus``: exit
    statuses (0 to 255, or by systemd's names: ``TEMPFAIL``) and signal
    names (``SIGTERM``) separated by spaces, ``(aiai)``: the statuses, then
    the signals. A number is always a status, as for systemd."""
    statuses: list[int] = []
    signals: list[int] = []
    for word in shell_words(text, "no exit status named"):
        status = _exit_status(word)
        if status is None:
            signals.append(_exit_signal(word))
        else:
            statuses.append(status)
    return statuses, signals


def _exit_status(word: str) -> int | None:
    """The exit status ``word`` is (a number, or systemd's name for one),
    or ``None`` if it is neither."""
    if _DIGITS.fullmatch(word):
        if int(word) > 255:
            raise ValueError(
                f"{quoted(word, SHOWN)} is out of range: exit statuses are 0 to 255"
            )
        return int(word)
    return exit_status_number(word)


def _exit_signal(word: str) -> int:
    try:
        return parse_signal(word)
    except ValueError:
        raise ValueError(
            f"{quoted(word, SHOWN)} is neither an exit status (0 to 255, or"
            " systemd's name for"
            " one: TEMPFAIL) nor a signal (SIGTERM)"
        ) from None


def parse_uint32(text: str) -> int:
    """An unsigned 32-bit number (``StartLimitBurst``, ``TTYRows``…)."""
    word = text.strip()
    if _DIGITS.fullmatch(word) is None or int(word) > UINT32_MAX:
        raise ValueError(
            f"{quoted(text, SHOWN)} is not a number from 0 to {UINT32_MAX}"
        )
    return int(word)


def parse_action_exit_status(text: str) -> int:
    """``SuccessActionExitStatus``/``FailureActionExitStatus``: 0 to 255,
    or ``""`` for none (systemd's -1)."""
    word = text.strip()
    if not word:
        return -1
    if _DIGITS.fullmatch(word) is None or int(word) > 255:
        raise ValueError(
            f"{quoted(text, SHOWN)} is not an exit status from 0 to 255 (or empty)"
        )
    return int(word)


def parse_mount_propagation(text: str) -> int:
    """``MountFlags``: ``shared``, ``slave`` or ``private``, as mount(2)'s
    flag for it."""
    word = text.strip()
    if word not in _PROPAGATION:
        raise ValueError(
            f"{quoted(text, SHOWN)} is not one of {', '.join(_PROPAGATION)}"
        )
    return _PROPAGATION[word]


def parse_environment(text: str, assignments: bool = True) -> list[str]:
    """``UnsetEnvironment``: names or ``NAME=VALUE`` words, quoted as a
    shell would; ``PassEnvironment`` (not ``assignments``): names alone."""
    words = shell_words(text, "no variable named")
    seen: set[str] = set()
    for word in words:
        name, equals, _ = word.partition("=")
        if _ENVIRONMENT_NAME.fullmatch(name) is None:
            raise ValueError(
                f"{quoted(word, SHOWN)}: {quoted(name, SHOWN)} is not a variable's name"
            )
        if equals and not assignments:
            raise ValueError(f"{quoted(word, SHOWN)} is not a variable's name alone")
        # systemd refuses every unit with the same word twice ("Invalid
        # PassEnvironment= block."), and of two assignments keeps the last
        # alone, where a daemon-reload reads back both.
        key = name + equals
        if key in seen:
            raise ValueError(
                f"{quoted(word, SHOWN)}: {name} is given twice (systemd refuses the"
                " same word"
                " twice, and of two assignments keeps the last alone until a"
                " daemon-reload reads back both)"
            )
        seen.add(key)
    return words


def parse_absolute_paths(text: str) -> list[str]:
    """Absolute paths separated by spaces (``RequiresMountsFor``)."""
    return [_absolute(path) for path in shell_words(text, "no path given")]


def parse_search_path(text: str) -> list[str]:
    """``ExecSearchPath``: absolute directories separated by ``:`` or
    spaces."""
    paths = [path for path in re.split(r"[:\s]+", text) if path]
    if not paths:
        raise ValueError("no path given")
    return [_absolute(path) for path in paths]


def parse_directory_names(text: str) -> list[str]:
    """``StateDirectory`` and its kin: names below the manager's directory
    for them, separated by spaces. systemd-run's ``NAME:LINK[:ro]`` goes in
    a property of its own (``StateDirectorySymlink``), which sdexec does not
    convert."""
    names = shell_words(text, "no directory named")
    for name in names:
        if ":" in name:
            raise ValueError(
                f"{quoted(name, SHOWN)}: sdexec takes directory names only (a NAME:LINK"
                " symlink goes in the …DirectorySymlink property, which it"
                " does not convert)"
            )
        if name.startswith("/"):
            raise ValueError(
                f"{quoted(name, SHOWN)} is not relative to the manager's directory"
            )
        if name.split("/")[0] == "private":
            raise ValueError(
                f"{quoted(name, SHOWN)}: systemd keeps private/ for DynamicUser"
            )
        _normalized(name)
    return names


def parse_one_path(text: str) -> list[str]:
    """One absolute path, the whole value (``IPIngressFilterPath``)."""
    return [_absolute(text.strip())]


def parse_optional_path(text: str) -> list[tuple[str, bool]]:
    """``EnvironmentFiles``: one absolute path, the whole value, led by
    ``-`` if a missing file is no error: ``a(sb)``."""
    optional = text.startswith("-")
    return [(_absolute(text.removeprefix("-").strip()), optional)]


def parse_with_ignore(text: str) -> tuple[bool, str]:
    """``AppArmorProfile``/``SmackProcessLabel``: ``[-]VALUE``, ``(bs)``:
    whether a failure to apply it is ignored, and the value."""
    return text.startswith("-"), text.removeprefix("-")


def parse_log_filter(text: str) -> list[tuple[bool, str]]:
    """``LogFilterPatterns``: one pattern, led by ``~`` for the messages to
    drop (else to keep), ``a(bs)``."""
    keeps = not text.startswith("~")
    pattern = text if keeps else text[1:]
    if not pattern:
        raise ValueError("no pattern given")
    return [(keeps, pattern)]


def parse_pair(text: str, what: str, alone: bool = False) -> list[tuple[str, str]]:
    """One ``FIRST:SECOND`` entry split at the first ``:``, ``a(ss)``
    (``LoadCredential``: ``ID:PATH``, or with ``alone`` the id alone, which
    systemd reads as ``ID:ID``)."""
    first, colon, second = text.strip().partition(":")
    if not first or (not colon and not alone) or (colon and not second):
        raise ValueError(f"{quoted(text, SHOWN)} is not {what}")
    return [(first, second or first)]


def parse_bpf_program(text: str) -> list[tuple[str, str]]:
    """``BPFProgram``: one ``TYPE:PATH`` (a pinned program), ``a(ss)``."""
    ((kind, path),) = parse_pair(text, "TYPE:PATH")
    if kind not in BPF_ATTACH_TYPES:
        raise ValueError(
            f"{quoted(kind, SHOWN)} is no BPF attach type"
            f" ({', '.join(BPF_ATTACH_TYPES)})"
        )
    return [(kind, _absolute(path))]


def parse_one_word(text: str) -> list[str]:
    """``ImportCredential``: a glob of credential names, the whole value, as
    the one entry of a list (a ``:`` renaming one goes in
    ``ImportCredentialEx``, not converted here)."""
    word = text.strip()
    if not word or ":" in word:
        raise ValueError(f"{quoted(text, SHOWN)} is not one path or name (without ':')")
    return [word]


def parse_log_extra_field(text: str) -> list[bytes]:
    """``LogExtraFields``: one ``FIELD=VALUE``, ``aay``."""
    field, equals, value = text.partition("=")
    if re.search(r"\s", value):
        # Written unquoted into the unit's file, it came back cut there.
        raise ValueError(
            f"{quoted(text, SHOWN)}: systemd writes the field into the unit's file"
            " unquoted,"
            " where a daemon-reload reads a space as the end of it"
        )
    if not equals or _JOURNAL_FIELD.fullmatch(field) is None:
        raise ValueError(
            f"{quoted(text, SHOWN)} is not FIELD=VALUE (FIELD capitals, digits and"
            " _, led by a"
            " capital, at most 64)"
        )
    return [text.encode()]


def parse_protect_hostname(text: str) -> tuple[str, str]:
    """``ProtectHostnameEx`` (systemd 258): ``MODE[:HOSTNAME]``, ``(ss)``."""
    mode, colon, hostname = text.strip().partition(":")
    if mode not in ("yes", "no", "private") or (colon and not hostname):
        raise ValueError(
            f"{quoted(text, SHOWN)} is not yes, no or private, then :HOSTNAME"
        )
    return mode, hostname
