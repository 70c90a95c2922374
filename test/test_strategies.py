"""The request strategies themselves: they cover the schema and can be sent."""

from __future__ import annotations

import json

from hypothesis import given, settings
from strategies import (
    PAYLOADS,
    deeply_nested,
    json_line,
    json_values,
    requests,
    valid_requests,
)

from sdexec.limits import check_texts, command_text
from sdexec.protocol import Topic


def test_every_topic_has_valid_and_malformed_payloads() -> None:
    assert set(PAYLOADS) == set(Topic)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(json_values)
def test_json_line_is_compact_json(value: object) -> None:
    compact = json.dumps(value, separators=(",", ":"))
    assert json_line(value) == (compact + "\n").encode()


def test_json_line_writes_nesting_json_dumps_cannot() -> None:
    line = json_line({"payload": deeply_nested(5000)})
    assert line == b'{"payload":' + b"[" * 5001 + b"]" * 5001 + b"}\n"


@settings(derandomize=True, max_examples=200, deadline=None)
@given(valid_requests)
def test_valid_requests_pass_the_text_checks(request: dict) -> None:
    cmd = request["payload"].get("cmd")
    if cmd is not None:
        fields = (cmd["cmdline"], cmd["env"], cmd["opts"], cmd.get("cwd"))
        check_texts(command_text(*fields, cmd.get("label")))
    assert json.loads(json_line(request)) == request


@settings(derandomize=True, max_examples=200, deadline=None)
@given(requests)
def test_any_request_can_be_sent_as_one_line(request: object) -> None:
    line = json_line(request)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
