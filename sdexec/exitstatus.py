"""Exit statuses by the names systemd gives them (systemd.exec(5), "Process
exit codes"): its own, which say which step of a unit's start failed, and
the LSB's and BSD's that ``SuccessExitStatus=`` and its kin take by name.
"""

from __future__ import annotations

__all__ = ["SYSTEMD_EXIT_NAMES", "exit_status_number"]

#: systemd's names for its own exit codes (systemd.exec(5), "Process exit
#: codes").
SYSTEMD_EXIT_NAMES = {
    200: "CHDIR",
    201: "NICE",
    202: "FDS",
    203: "EXEC",
    204: "MEMORY",
    205: "LIMITS",
    206: "OOM_ADJUST",
    207: "SIGNAL_MASK",
    208: "STDIN",
    209: "STDOUT",
    210: "CHROOT",
    211: "IOPRIO",
    212: "TIMERSLACK",
    213: "SECUREBITS",
    214: "SETSCHEDULER",
    215: "CPUAFFINITY",
    216: "GROUP",
    217: "USER",
    218: "CAPABILITIES",
    219: "CGROUP",
    220: "SETSID",
    221: "CONFIRM",
    222: "STDERR",
    224: "PAM",
    225: "NETWORK",
    226: "NAMESPACE",
    227: "NO_NEW_PRIVILEGES",
    228: "SECCOMP",
    229: "SELINUX_CONTEXT",
    230: "PERSONALITY",
    231: "APPARMOR_PROFILE",
    232: "ADDRESS_FAMILIES",
    233: "RUNTIME_DIRECTORY",
    235: "CHOWN",
    236: "SMACK_PROCESS_LABEL",
    237: "KEYRING",
    238: "STATE_DIRECTORY",
    239: "CACHE_DIRECTORY",
    240: "LOGS_DIRECTORY",
    241: "CONFIGURATION_DIRECTORY",
    242: "NUMA_POLICY",
    243: "CREDENTIALS",
}
#: Codes systemd 252 also names, which sdexec reads as the command's own
#: exits all the same (docs/design.md: a C program's ``return -ENOMEM``
#: gives 244, and 255 is a common exit): named for ``SuccessExitStatus=``
#: and its kin alone, kept out of :data:`SYSTEMD_EXIT_NAMES`, the range a
#: unit's failure to run its command is read from.
_LATER_SYSTEMD_NAMES = {244: "BPF", 255: "EXCEPTION"}
#: The exit statuses of the LSB's init scripts and of BSD's sysexits.h, by
#: systemd's names for them.
_OTHER_EXIT_NAMES = {
    "SUCCESS": 0, "FAILURE": 1, "INVALIDARGUMENT": 2, "NOTIMPLEMENTED": 3,
    "NOPERMISSION": 4, "NOTINSTALLED": 5, "NOTCONFIGURED": 6, "NOTRUNNING": 7,
    "USAGE": 64, "DATAERR": 65, "NOINPUT": 66, "NOUSER": 67, "NOHOST": 68,
    "UNAVAILABLE": 69, "SOFTWARE": 70, "OSERR": 71, "OSFILE": 72,
    "CANTCREAT": 73, "IOERR": 74, "TEMPFAIL": 75, "PROTOCOL": 76, "NOPERM": 77,
    "CONFIG": 78,
}  # fmt: skip
_BY_NAME = {
    **_OTHER_EXIT_NAMES,
    **{
        name: number
        for number, name in (SYSTEMD_EXIT_NAMES | _LATER_SYSTEMD_NAMES).items()
    },
}


def exit_status_number(name: str) -> int | None:
    """The exit status systemd names ``name`` (``TEMPFAIL``: 75), or ``None``."""
    return _BY_NAME.get(name)
