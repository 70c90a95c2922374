"""Hypothesis strategies for the whole request schema (docs/protocol.md).

For property tests of the pure checks now, and for a fuzzing suite over the
real server later: every topic's payload, valid and malformed, and whole
request envelopes. Malformed means: wrong JSON types, strings that are not
text (lone surrogates) or that systemd cannot take (NUL), deep nesting,
huge strings, unknown keys.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from sdexec.protocol import ExecFlag, Topic

#: Any JSON scalar, including the awkward ones.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
#: Arbitrary JSON values, nested a few levels.
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

#: Text that is fine for systemd and exec.
clean_text = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\0"),
    max_size=40,
)
#: Text with at least one lone surrogate or NUL somewhere.
bad_text = st.builds(
    lambda head, bad, tail: head + bad + tail,
    clean_text,
    st.sampled_from(["\0", "\ud800", "\udfff", "\udc80"]),
    clean_text,
)
#: Any text: clean or bad.
any_text = clean_text | bad_text
env_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)


def deeply_nested(depth: int) -> Any:
    """A JSON value nested ``depth`` levels (arrays inside arrays)."""
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


nested = st.integers(min_value=1, max_value=2000).map(deeply_nested)


#: Executables that exist on every test node, and names that do not.
executables = st.sampled_from(["/bin/true", "true", "sh", "/bin/sh"])
#: Option names sdexec reads, and property names of every policy class
#: (allowed by default, ordered, never allowed, unknown to systemd).
_PROPERTY_NAMES = (
    "MemoryMax", "MemoryHigh", "CPUWeight", "CPUQuotaPerSecUSec", "Description",
    "MemoryAccounting", "Nice", "TasksMax", "User", "KillMode", "SendSIGKILL",
    "DeviceAllow", "AllowedCPUs", "Slice", "Type", "ExecStartPre", "MemoryMaxScale",
    "NoSuchProperty",
)  # fmt: skip
option_names = st.sampled_from(
    [
        "SDEXEC_NAME",
        "SDEXEC_JOBID",
        "SDEXEC_STOP_TIMER_SEC",
        "SDEXEC_STOP_TIMER_SIGNAL",
        "stdin_BUFSIZE",
        "stdout_BUFSIZE",
        "stderr_LINE_BUFFER",
        *(f"SDEXEC_PROP_{name}" for name in _PROPERTY_NAMES),
    ]
)
#: Values for those: sizes, numbers, booleans, signals, and any text.
option_values = st.sampled_from(
    ["512M", "50%", "infinity", "0", "-1", "100", "10000", "yes", "no", "SIGKILL",
     "99999999999999999999999", "1K", ""]
)  # fmt: skip
#: The caller's systemd variables, which must never reach a unit.
systemd_variables = st.sampled_from(
    ["NOTIFY_SOCKET", "INVOCATION_ID", "LISTEN_FDS", "JOURNAL_STREAM", "MANAGERPID"]
)


def commands(text: st.SearchStrategy[str] = clean_text) -> st.SearchStrategy[dict]:
    """RFC 42 command objects whose strings come from ``text``: runnable or
    not, with options and properties sdexec reads and others."""
    return st.fixed_dictionaries(
        {
            "cmdline": st.builds(
                lambda first, rest: [first, *rest],
                executables | text,
                st.lists(text, max_size=4),
            ),
            "env": st.dictionaries(
                env_names | systemd_variables | text, text, max_size=5
            ),
            "opts": st.dictionaries(
                option_names | text, option_values | text, max_size=4
            ),
            "channels": st.just([]),
        },
        optional={"cwd": text, "label": text},
    )


valid_commands = commands()
#: Commands with wrong types, bad text or missing fields.
malformed_commands = st.one_of(
    commands(any_text),
    json_values,
    st.fixed_dictionaries({"cmdline": json_values}),
    st.fixed_dictionaries({"cmdline": st.just(["true"]), "env": json_values}),
    st.fixed_dictionaries({"cmdline": st.just(["true"]), "opts": json_values}),
    st.fixed_dictionaries({"cmdline": st.just([]), "label": json_values}),
)
flags = st.sampled_from([int(f) for f in ExecFlag]) | st.integers(0, 31)

exec_payloads = st.fixed_dictionaries({"cmd": valid_commands, "flags": flags})
io_objects = st.fixed_dictionaries(
    {"stream": st.just("stdin"), "rank": st.just("0"), "data": clean_text},
    optional={"eof": st.booleans()},
)
write_payloads = st.fixed_dictionaries(
    {"matchtag": st.integers(0, 2**31), "io": io_objects}
)
kill_payloads = st.fixed_dictionaries(
    {"signum": st.integers(1, 64)},
    optional={"pid": st.integers(1, 2**22), "label": clean_text},
)
reasons = st.sampled_from(["cancel", "timeout"])
terminate_payloads = st.one_of(
    st.fixed_dictionaries({"pid": st.integers(1, 2**22), "reason": reasons}),
    st.fixed_dictionaries({"label": clean_text, "reason": reasons}),
    st.fixed_dictionaries({"jobid": clean_text, "reason": reasons}),
)
empty_payloads: st.SearchStrategy[dict[str, Any]] = st.just({})
#: wait and attach name a process as kill does (the label wins).
target_payloads = st.fixed_dictionaries(
    {}, optional={"pid": st.integers(1, 2**22), "label": clean_text}
).filter(bool)
attach_payloads = target_payloads.flatmap(
    lambda target: st.fixed_dictionaries(
        {key: st.just(value) for key, value in target.items()},
        optional={"flags": st.integers(0, 3)},
    )
)

#: Malformed payloads for each topic: wrong types in every field.
malformed_exec_payloads = st.fixed_dictionaries(
    {"cmd": malformed_commands, "flags": json_values}
)
malformed_write_payloads = st.fixed_dictionaries(
    {
        "matchtag": json_values,
        "io": json_values
        | st.fixed_dictionaries(
            {
                "stream": json_values,
                "rank": json_values,
                "data": json_values,
                "encoding": json_values,
            }
        ),
    }
)
malformed_kill_payloads = st.fixed_dictionaries(
    {},
    optional={
        "signum": json_values,
        "pid": json_values,
        "label": json_values | bad_text,
    },
)

malformed_target_payloads = st.fixed_dictionaries(
    {},
    optional={
        "pid": json_values,
        "label": json_values | bad_text,
        "flags": json_values,
    },
)
malformed_terminate_payloads = st.fixed_dictionaries(
    {},
    optional={
        "reason": json_values | bad_text,
        "pid": json_values,
        "label": json_values | bad_text,
        "jobid": json_values | bad_text,
    },
)

PAYLOADS = {
    Topic.EXEC: (exec_payloads, malformed_exec_payloads),
    Topic.WRITE: (write_payloads, malformed_write_payloads),
    Topic.KILL: (kill_payloads, malformed_kill_payloads),
    Topic.LIST: (empty_payloads, json_values),
    Topic.STATS: (empty_payloads, json_values),
    Topic.UNDRAIN: (empty_payloads, json_values),
    Topic.WAIT: (target_payloads, malformed_target_payloads),
    Topic.ATTACH: (attach_payloads, malformed_target_payloads),
    Topic.TERMINATE: (terminate_payloads, malformed_terminate_payloads),
    Topic.RELOAD: (empty_payloads, json_values),
}

valid_requests = st.sampled_from(sorted(PAYLOADS)).flatmap(
    lambda topic: st.fixed_dictionaries(
        {
            "type": st.just("request"),
            "topic": st.just(str(topic)),
            "matchtag": st.integers(1, 2**31),  # 0 is the service's own
            "payload": PAYLOADS[topic][0],
        }
    )
)
#: Envelopes with something wrong: a bad type, topic, matchtag or payload,
#: or a deeply nested payload.
malformed_requests = st.one_of(
    st.sampled_from(sorted(PAYLOADS)).flatmap(
        lambda topic: st.fixed_dictionaries(
            {
                "type": st.just("request"),
                "topic": st.just(str(topic)),
                "matchtag": st.integers(0, 2**31),
                "payload": PAYLOADS[topic][1] | nested,
            }
        )
    ),
    st.fixed_dictionaries(
        {
            "type": json_values,
            "topic": json_values | bad_text,
            "matchtag": json_values,
            "payload": json_values,
        }
    ),
    json_values,
)
#: Any request, valid or not.
requests = valid_requests | malformed_requests


def json_line(value: Any) -> bytes:
    """``value`` as one protocol line (JSON and ``\\n``), however deeply
    nested: ``json.dumps`` recurses and fails past ~1000 levels, which is
    exactly what a fuzzer must be able to send. Lone surrogates are written
    as ``\\udXXX`` escapes, as a hostile client would."""
    parts: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Raw):
            parts.append(item.text)
        elif isinstance(item, list):
            stack.append(_Raw("]"))
            for index, element in reversed(list(enumerate(item))):
                stack.append(element)
                if index:
                    stack.append(_Raw(","))
            parts.append("[")
        elif isinstance(item, dict):
            stack.append(_Raw("}"))
            for index, (key, element) in reversed(list(enumerate(item.items()))):
                stack.append(element)
                stack.append(_Raw(json.dumps(key) + ":"))
                if index:
                    stack.append(_Raw(","))
            parts.append("{")
        else:
            parts.append(json.dumps(item))
    return ("".join(parts) + "\n").encode("ascii")


class _Raw:
    """Text :func:`json_line` emits as it is."""

    def __init__(self, text: str) -> None:
        self.text = text
