"""The forms of value Flux's job-exec takes for the ``[exec]`` keys it reads
too, where sdexec takes more.

A site's TOML file may serve both. Flux reads its keys strictly (flux-core
``src/modules/job-exec/job-exec.c`` and ``exec_config.c``, through
``flux_conf_unpack``, whose types are exact): the durations and signals of
termination as strings only, the stop-timer signal as an integer only,
signal names only as its own table has them. A value of another form makes
job-exec refuse the whole file ("Error reading [exec] table: Expected
string, got integer"): at broker start the module does not load, at
``flux config reload`` the change does not take. sdexec keeps taking the
wider forms, and warns about each (:func:`flux_refusals`), naming the key
and the form to write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from sdexec.fsd import format_fsd, parse_fsd
from sdexec.refusal import json_quoted
from sdexec.signals import parse_signal, signal_name

__all__ = ["STRTOL_DECIMAL", "flux_refusals"]

#: sigutil_signum's table (flux-core ``src/common/libutil/sigutil.c``),
#: which it matches exactly (case and all), with or without ``SIG``: no
#: real-time names, no aliases such as ``SIGIOT``.
FLUX_SIGNAL_NAMES = frozenset(
    {
        "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS",
        "SIGFPE", "SIGKILL", "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM",
        "SIGTERM", "SIGSTKFLT", "SIGCHLD", "SIGCONT", "SIGSTOP", "SIGTSTP",
        "SIGTTIN", "SIGTTOU", "SIGURG", "SIGXCPU", "SIGXFSZ", "SIGVTALRM",
        "SIGPROF", "SIGWINCH", "SIGIO", "SIGPWR", "SIGSYS",
    }
)  # fmt: skip

#: A number as ``strtol`` in base 10 reads it, to the end, as Flux does where
#: it reads one so (sigutil_signum; sdexec.c's get_dict_int, for the
#: ``SDEXEC_STOP_TIMER_*`` options): C's leading white space (ASCII only),
#: an optional sign, ASCII digits, and nothing after them.
STRTOL_DECIMAL = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def _advice(why: str, written: object) -> str:
    return (
        f"Flux's job-exec would refuse the file: {why};"
        f" write {written} if Flux reads this file too"
    )


def _string_advice(value: Any, why_not_this_string: str, written: str) -> str:
    """The advice for a key Flux reads as a string only: ``value`` is no
    string, or ``why_not_this_string`` says why Flux refuses this one."""
    why = (
        why_not_this_string
        if isinstance(value, str)
        else "it reads this key as a string only"
    )
    return _advice(why, written)


#: A duration as fsd_parse_duration reads it (flux-core
#: ``src/common/libutil/fsd.c``): ``strtod``, which skips leading white
#: space (C's, ASCII only), then nothing or a unit, exactly, to the end. Of
#: what sdexec takes, it refuses white space after the number or unit, and
#: before it any but C's (a no-break space).
_FLUX_DURATION = re.compile(
    r"[ \t\n\v\f\r]*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"(?:ms|s|m|h|d)?"
)


def _duration_string(value: Any) -> str | None:
    if isinstance(value, str) and _FLUX_DURATION.fullmatch(value):
        return None
    written = json.dumps(format_fsd(parse_fsd(value)))
    return _string_advice(
        value,
        "it reads a duration as a number and a unit only"
        " (ASCII white space before them at most)",
        written,
    )


def _duration_string_or_none(value: Any) -> str | None:
    # Flux's job-exec takes "none" exactly for this key, as sdexec does.
    return None if value == "none" else _duration_string(value)


def _signal_string(value: Any) -> str | None:
    if isinstance(value, str) and _flux_signal_name_or_number(value):
        return None
    number = parse_signal(value)
    name = signal_name(number)
    written = json.dumps(name if name in FLUX_SIGNAL_NAMES else str(number))
    return _string_advice(
        value,
        "it knows a signal only by a name of its own table, in upper case"
        " (no real-time or alias names), or by its number",
        written,
    )


def _flux_signal_name_or_number(text: str) -> bool:
    if STRTOL_DECIMAL.fullmatch(text):
        return int(text) > 0
    return text in FLUX_SIGNAL_NAMES or f"SIG{text}" in FLUX_SIGNAL_NAMES


def _signal_integer(value: Any) -> str | None:
    if isinstance(value, int):
        return None
    number = parse_signal(value)
    return _advice("it reads this key as an integer only", number)


#: How Flux's job-exec reads each key of ``[exec]`` where sdexec takes more:
#: the advice for a value of another form, else ``None``.
_FLUX_FORMS: dict[str, Callable[[Any], str | None]] = {
    "kill-timeout": _duration_string,
    "max-kill-timeout": _duration_string,
    "barrier-timeout": _duration_string,
    "shell-exit-timeout": _duration_string_or_none,
    "term-signal": _signal_string,
    "kill-signal": _signal_string,
    "sdexec-stop-timer-signal": _signal_integer,
}


def flux_refusals(exec_table: Mapping[object, object], source: str) -> tuple[str, ...]:
    """One warning for each value of the ``[exec]`` table ``exec_table``,
    already checked, that Flux's job-exec would refuse:
    ``/etc/flux/system/conf.d/exec.toml: exec.kill-timeout: 5: Flux's
    job-exec would refuse the file: ...; write "5s" if Flux reads this file
    too``."""
    warnings = []
    for key, value in exec_table.items():
        advice = _FLUX_FORMS[key](value) if key in _FLUX_FORMS else None
        if advice is not None:
            warnings.append(f"{source}: exec.{key}: {json_quoted(value)}: {advice}")
    return tuple(warnings)
