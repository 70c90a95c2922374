"""The shapes of the service's one-response answers (docs/protocol.md), as
both clients check them before a caller sees one.

One table, :data:`ANSWERS`, by topic: each answer's fields, the ones it
always has and those it may have, and what each must be. A caller's
``proc["pid"]`` of a ``list`` answer is then an integer, not a
``KeyError`` or a string that compares unequal to every pid. What a field
is said as names its place: ``procs[3].pid: expected an integer, got
"7"``. No Twisted: :mod:`sdexec.rpc` loads it for the command line too,
once an answer is to be checked (``run`` checks none), and raises the
error; this module only says what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from sdexec.protocolbase import Topics
from sdexec.refusal import MISSING, expected, member

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "ADD_CREDIT",
    "ANSWERS",
    "ATTACHED_COMMAND",
    "DROPPED",
    "Check",
    "Shape",
    "answer_fault",
]


def _at(where: str, name: str) -> str:
    """The place of the field ``name`` (one of this module's, ``kill-attempts``
    too) in the object at ``where`` (``""``: the answer itself)."""
    return f"{where}.{name}" if where else name


def _expected(where: str, said: str, value: object) -> str:
    return expected(where, said, value, 40)


class Check:
    """What a field must be: :meth:`fault` says what is wrong with a value
    (``said``: what it expected, ``an integer``)."""

    said = "a value"

    def fault(self, value: object, where: str) -> str | None:
        """What is wrong with ``value``, at ``where``; ``None`` if nothing."""
        raise NotImplementedError


class Kind(Check):
    """A value of one JSON type (``said``: ``an integer``) that ``test``
    takes. JSON's true is no integer: a bool is an int to Python."""

    def __init__(self, said: str, test: Callable[[object], bool]) -> None:
        self.said = said
        self._test = test

    def fault(self, value: object, where: str) -> str | None:
        """What is wrong with ``value``, at ``where``; ``None`` if nothing."""
        return None if self._test(value) else _expected(where, self.said, value)


class Nullable(Check):
    """``null``, or what ``inner`` takes."""

    def __init__(self, inner: Check) -> None:
        self.said = f"{inner.said} or null"
        self._inner = inner

    def fault(self, value: object, where: str) -> str | None:
        """What is wrong with ``value``, at ``where``; ``None`` if nothing."""
        fault = None if value is None else self._inner.fault(value, where)
        if fault == _expected(where, self._inner.said, value):
            return _expected(where, self.said, value)  # (null would do too)
        return fault  # None, or a field deeper in it


class ListOf(Check):
    """A list, each item what ``item`` takes (``procs[3]``)."""

    said = "a list"

    def __init__(self, item: Check) -> None:
        self._item = item

    def fault(self, value: object, where: str) -> str | None:
        """What is wrong with ``value``, at ``where``: the first item that
        is wrong; ``None`` if nothing."""
        if not isinstance(value, list):
            return _expected(where, self.said, value)
        for index, item in enumerate(value):
            fault = self._item.fault(item, f"{where}[{index}]")
            if fault is not None:
                return fault
        return None


class ObjectOf(Check):
    """An object of any keys (uids, job ids), each value what ``value``
    takes."""

    said = "an object"

    def __init__(self, value: Check) -> None:
        self._value = value

    def fault(self, value: object, where: str) -> str | None:
        """What is wrong with ``value``, at ``where``: the first member
        that is wrong; ``None`` if nothing."""
        if not isinstance(value, dict):
            return _expected(where, self.said, value)
        for key, item in value.items():
            # The service's keys (uids, job ids) quoted where no C name:
            # one holding a line break stays one line.
            fault = self._value.fault(item, member(where, key))
            if fault is not None:
                return fault
        return None


class Shape(Check):
    """An object with the fields ``required`` (each what its check takes)
    and, when present, those of ``optional``; others are let through (a
    newer service may add some)."""

    said = "an object"

    def __init__(
        self,
        required: Mapping[str, Check],
        optional: Mapping[str, Check] | None = None,
    ) -> None:
        self._required = required
        self._optional = optional or {}

    def fault(self, value: object, where: str = "") -> str | None:
        """What is wrong with ``value``, at ``where`` (``""``: an answer):
        the first field missing or wrong; ``None`` if nothing."""
        if not isinstance(value, dict):
            return _expected(where, self.said, value)
        for name, check in self._required.items():
            if name not in value:
                return _expected(_at(where, name), check.said, MISSING)
            fault = check.fault(value[name], _at(where, name))
            if fault is not None:
                return fault
        for name, check in self._optional.items():
            if name in value:
                fault = check.fault(value[name], _at(where, name))
                if fault is not None:
                    return fault
        return None


INTEGER = Kind("an integer", lambda value: type(value) is int)
NUMBER = Kind("a number", lambda value: type(value) in (int, float))
TEXT = Kind("a string", lambda value: isinstance(value, str))
BOOLEAN = Kind("a boolean", lambda value: isinstance(value, bool))
OBJECT = Kind("an object", lambda value: isinstance(value, dict))
TEXTS = ListOf(TEXT)
BYTE_COUNT = Kind("a byte count", lambda value: type(value) is int and value >= 0)

#: An ``sdexec.list`` entry: upstream's four fields (what flux-core's Python
#: client makes its dataclass of), then what ``detail`` and a job add.
PROC = Shape(
    {"pid": INTEGER, "cmd": TEXT, "label": TEXT, "state": TEXT},
    {
        "cmdline": TEXTS,
        "unit": TEXT,
        "mode": TEXT,
        "jobid": TEXT,
        "step": Nullable(TEXT),
    },
)

#: A job's entry of ``stats``' ``job-exec.jobs``, and a ``terminate``'s
#: answer.
JOB = Shape(
    {
        "id": TEXT,
        "pid": INTEGER,
        "unit": Nullable(TEXT),
        "state": Nullable(TEXT),
        "step": Nullable(TEXT),
        "kill-attempts": INTEGER,
        "time-limit": Nullable(NUMBER),
        "expiration": Nullable(NUMBER),
        "termination": OBJECT,
        "stop-timer": Nullable(OBJECT),
    }
)

#: A ``stats`` process: a list entry, and for the service's own processes
#: (not leftovers) its unit's state and stop timer.
STATS_PROC = Shape(
    {"pid": INTEGER, "cmd": TEXT, "label": TEXT, "state": TEXT},
    {"unit-state": TEXT, "stop-timer": OBJECT},
)

DRAIN_CAUSE = Shape(
    {"reason": TEXT, "kind": TEXT, "lifts-itself": BOOLEAN, "cause": TEXT}
)

STATS = Shape(
    {
        "requests": ObjectOf(INTEGER),
        "procs": ListOf(STATS_PROC),
        "job-exec": Shape({"jobs": ObjectOf(JOB)}),
        "config": OBJECT,
        "mapper": OBJECT,
        "users": Shape(
            {"owner": INTEGER, "users": ObjectOf(OBJECT), "not-shown": INTEGER}
        ),
        "drain": Shape(
            {
                "drained": BOOLEAN,
                "reason": Nullable(TEXT),
                "causes": ListOf(DRAIN_CAUSE),
            }
        ),
        "device-fence": Nullable(
            Shape({"enforced": BOOLEAN, "problem": Nullable(TEXT)})
        ),
        "systemd": Shape(
            {"connected": BOOLEAN, "version": Nullable(TEXT), "calls": OBJECT}
        ),
    }
)

#: Each topic's answer (docs/protocol.md). An undrain's lists are optional:
#: a service from before them sends ``reason`` and ``still`` alone, which
#: ``sdexec undrain`` reads. A kill's answer is ``{}``: nothing to check.
ANSWERS: dict[str, Shape] = {
    Topics.LIST: Shape({"rank": INTEGER, "procs": ListOf(PROC)}),
    Topics.TERMINATE: JOB,
    Topics.STATS: STATS,
    Topics.UNDRAIN: Shape(
        {"reason": Nullable(TEXT)},
        {"cleared": TEXTS, "still": Nullable(TEXT), "remaining": TEXTS},
    ),
    Topics.RELOAD: Shape({"config": TEXT}, {"warnings": TEXTS, "needs-restart": TEXTS}),
    Topics.KILL: Shape({}),
}

#: An ``attached`` response's ``cmd``: the command object the process was
#: started with (RFC 42's, as the service makes it).
ATTACHED_COMMAND = Shape(
    {
        "cmd": Shape(
            {"cmdline": TEXTS, "env": ObjectOf(TEXT), "opts": ObjectOf(TEXT)},
            {"cwd": TEXT, "label": TEXT, "channels": ListOf(TEXT)},
        )
    }
)

#: An ``add-credit`` response: its ``channels``, each stream's credit an
#: integer (RFC 42; JSON's true is none), as Flux's libsubprocess refuses
#: others (client.c).
ADD_CREDIT = Shape({"channels": ObjectOf(INTEGER)})

#: A ``wait``'s answer or an ``attached`` response: its ``dropped``, the
#: bytes of each output stream dropped before its output, when it has one.
DROPPED = Shape({}, {"dropped": ObjectOf(BYTE_COUNT)})


def answer_fault(topic: str, answer: dict[str, Any]) -> str | None:
    """What is wrong with ``answer``, the answer to a request of ``topic``
    (:data:`ANSWERS`), naming the field; ``None`` if nothing, or if the
    topic's answer has no shape here."""
    shape = ANSWERS.get(topic)
    return None if shape is None else shape.fault(answer)
