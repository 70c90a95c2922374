"""Hostile and mistaken requests against the server, offline (issue 16):
each gets an error naming what was wrong, the connection behaves as
docs/protocol.md says, and nothing is started or tabled."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal

import pytest
from offline import Connection, error_of, read_to_eof
from pytest_twisted import ensureDeferred
from strategies import deeply_nested, json_line
from support import until
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher

import sdexec.connection
import sdexec.fdlimit
import sdexec.process
import sdexec.server
from sdexec.admission import RESERVE_IDLE_SECONDS, RESERVED_CONNECTIONS
from sdexec.config import parse_config
from sdexec.containment import Containment
from sdexec.fdlimit import FDS_PER_PROCESS, RESERVE
from sdexec.idset import MAX_ID
from sdexec.ioencode import encode_io
from sdexec.limits import (
    MAX_ARG_STRLEN,
    MAX_ARGUMENTS,
    MAX_ENVIRONMENT,
    MAX_LISTED_CMDLINE,
)
from sdexec.lograte import BURST, WINDOW_S
from sdexec.plan import checked_request
from sdexec.refusal import MAX_ERRSTR, SHOWN, errstr_line
from sdexec.server import SdexecServer
from sdexec.testing import FakeManager
from sdexec.wire import MAX_NESTING, MAX_VALUES, SMALL_LINE

EVERY_ID = f"0-{MAX_ID}"
ENVELOPE = {"type": "request", "topic": "sdexec.list", "matchtag": 4}


def still_serves(server: SdexecServer) -> None:
    """list and stats-get work, for a new client too."""
    other = Connection(server)
    other.send("sdexec.list", {})
    assert "payload" in other.last()
    other.send("sdexec.stats-get", {}, matchtag=2)
    assert "payload" in other.last()
    other.close()


TOO_DEEP = (
    errno.EPROTO,
    f"message is nested too deeply (more than {MAX_NESTING} levels)",
)


# The envelope, its payload and "x" hold deeply_nested(depth)'s depth + 1
# arrays: depth + 3 levels in all. The limit is the same for a short line
# (the json module) and a long one (msgspec), on every interpreter.
@pytest.mark.parametrize("padding", [0, SMALL_LINE], ids=["short", "long"])
@pytest.mark.parametrize(
    "depth", [100, MAX_NESTING - 3, MAX_NESTING - 2, 975, 1000, 5000, 100_000]
)
def test_deep_nesting_is_answered_never_a_traceback(server, connection, depth, padding):
    payload = {"x": deeply_nested(depth), "pad": "p" * padding}
    connection.protocol.dataReceived(json_line({**ENVELOPE, "payload": payload}))
    (response,) = connection.responses()
    if depth + 3 <= MAX_NESTING:  # decoded: list ignores what it is given
        assert "payload" in response
        assert not connection.transport.disconnecting
    else:
        assert error_of(response) == TOO_DEEP
        assert connection.transport.disconnecting
    still_serves(server)


def test_deep_nesting_beside_a_lone_surrogate_is_still_named_as_such(connection):
    """msgspec refuses the surrogate, the json module then recurses."""
    payload = {"s": "\ud800", "x": deeply_nested(100_000)}
    connection.protocol.dataReceived(json_line({**ENVELOPE, "payload": payload}))
    assert error_of(connection.last()) == TOO_DEEP


def test_a_line_of_more_values_than_allowed_is_refused_before_decoding(
    server, connection
):
    # Within the frame, but 3 bytes of "[]," decode to ~64: a 64 MiB line
    # of them took 1.7 GB.
    arrays = ",".join(["[]"] * (MAX_VALUES // 2))
    line = f'{{"type":"request","topic":"sdexec.list","matchtag":4,"x":[{arrays}]}}\n'
    connection.protocol.dataReceived(line.encode())
    values = MAX_VALUES + 9  # the envelope's 4 keys and values, "x"'s array
    assert error_of(connection.last()) == (
        errno.EPROTO,
        f"message holds too many JSON values: {values}, keys included"
        f" (at most {MAX_VALUES})",
    )
    assert connection.last()["matchtag"] == 0
    assert connection.transport.disconnecting
    still_serves(server)


def test_a_long_write_full_of_json_s_syntax_is_taken(server, connection):
    # More commas and brackets than values allowed, all in its data: counted
    # again outside strings, the write is handled (to no process: dropped).
    data = '{"a":[1,2],"b":"\\"x\\\\"},' * (MAX_VALUES // 5)
    io = {"stream": "stdin", "rank": "0", "data": data}
    connection.send("sdexec.write", {"matchtag": 99, "io": io}, matchtag=5)
    assert connection.responses() == []
    assert not connection.transport.disconnecting
    still_serves(server)


@pytest.mark.parametrize(
    ("kind", "got"),
    [
        ("event", ', got "event"'),
        ("Request", ', got "Request"'),
        (None, ", got null"),
        (5, ", got 5"),
        ("\x1b" + "r" * 5000, ', got "\\u001b' + "r" * 193 + "… (5001 chars)"),
    ],
    ids=["event", "Request", "null", "5", "escape-long"],
)
def test_a_message_that_is_not_a_request_is_a_framing_error(connection, kind, got):
    # Each says what its type was, as a bad matchtag's does: 'expected
    # "request"' alone left a client that sent "Request" guessing.
    connection.raw({**ENVELOPE, "type": kind})
    expected = f'type: expected "request"{got}'
    assert error_of(connection.last()) == (errno.EPROTO, expected)
    assert connection.last()["matchtag"] == 0
    assert connection.transport.disconnecting
    connection.send("sdexec.list", {}, matchtag=5)  # nothing more is read
    assert len(connection.responses()) == 1


def test_a_message_without_a_type_is_said_to_lack_one(connection):
    connection.raw({key: ENVELOPE[key] for key in ("topic", "matchtag")})
    assert error_of(connection.last()) == (
        errno.EPROTO,
        'type: missing: expected "request"',
    )
    assert connection.transport.disconnecting


@pytest.mark.parametrize(
    ("encoding", "got"),
    [(None, "null"), (5, "5"), ([], "[]"), ({}, "{}"), (True, "true")],
)
def test_a_non_string_io_encoding_is_einval(connection, encoding, got):
    io = {"stream": "stdin", "rank": "0", "data": "x", "encoding": encoding}
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=3)
    assert error_of(connection.last()) == (
        errno.EINVAL,
        f'io.encoding: expected "UTF-8" or "base64", got {got}',
    )
    assert not connection.transport.disconnecting


@pytest.mark.parametrize(
    ("rank", "got"),
    [("absent", "none"), (None, "null"), (0, "0"), ([], "[]"), ({}, "{}"),
     (True, "true")],
)  # fmt: skip
def test_a_write_s_io_rank_must_be_a_string(connection, rank, got):
    # RFC 42 and Flux's iodecode() require it: a string (an idset), never
    # used by the write; sdexec's clients all send one (encode_io).
    io = {"stream": "stdin", "data": "x"} | ({} if rank == "absent" else {"rank": rank})
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=3)
    said = f"io.rank: expected a string, got {got}"  # (what came: a null is no absence)
    assert error_of(connection.last()) == (errno.EINVAL, said)
    assert not connection.transport.disconnecting


#: A good write's payload (to an exec that does not run: dropped).
_WRITE = {"matchtag": 1, "io": {"stream": "stdin", "rank": "0", "data": "x"}}
_ABSENT = object()
#: Each field of a write, missing or mistyped, and the refusal's words:
#: EINVAL for every one. An io with neither data nor eof was EPROTO (as
#: iodecode's errno), a missing stream or rank EINVAL; upstream answers
#: no write, and Flux's clients want none (docs/protocol.md).
_BAD_WRITE_FIELDS = {
    "matchtag-missing": (
        (), "matchtag", _ABSENT, "matchtag: expected an integer, got none",
    ),
    "matchtag-string": ((), "matchtag", "1", 'matchtag: expected an integer, got "1"'),
    "matchtag-bool": ((), "matchtag", True, "matchtag: expected an integer, got true"),
    "io-missing": ((), "io", _ABSENT, "io: expected an object, got none"),
    "io-list": ((), "io", [], "io: expected an object, got []"),
    "stream-missing": (
        ("io",), "stream", _ABSENT, "io.stream: expected a string, got none",
    ),
    "stream-number": (("io",), "stream", 0, "io.stream: expected a string, got 0"),
    "stream-stdout": (("io",), "stream", "stdout", 'io.stream: "stdout" is not stdin'),
    "rank-missing": (("io",), "rank", _ABSENT, "io.rank: expected a string, got none"),
    "rank-number": (("io",), "rank", 0, "io.rank: expected a string, got 0"),
    "data-number": (("io",), "data", 5, "io.data: expected a string, got 5"),
    "data-null": (("io",), "data", None, "io.data: expected a string, got null"),
    "data-base64": (
        ("io",), "encoding", "base64",
        "io.data: invalid base64: its length 1 is not a multiple of 4",
    ),
    "eof-string": (("io",), "eof", "yes", 'io.eof: expected a boolean, got "yes"'),
    "encoding-number": (
        ("io",), "encoding", 5, 'io.encoding: expected "UTF-8" or "base64", got 5',
    ),
    "neither-data-nor-eof": (
        ("io",), "data", _ABSENT,
        "io: expected data or eof (an io object with neither writes nothing)",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("within", "field", "value", "said"),
    _BAD_WRITE_FIELDS.values(),
    ids=_BAD_WRITE_FIELDS,
)
def test_each_field_of_a_write_missing_or_mistyped_is_einval_naming_it(
    connection, within, field, value, said
):
    payload = {**_WRITE, "io": dict(_WRITE["io"])}
    target = payload["io"] if within else payload
    if value is _ABSENT:
        del target[field]
    else:
        target[field] = value
    connection.send("sdexec.write", payload, matchtag=3)
    assert error_of(connection.last()) == (errno.EINVAL, said)
    assert connection.last()["matchtag"] == 3
    assert not connection.transport.disconnecting


@pytest.mark.parametrize("field", [{"data": ""}, {"eof": False}])
def test_a_write_s_io_with_empty_data_or_a_false_eof_is_taken(connection, field):
    # Either field present is enough, as for iodecode(): no refusal (the
    # write names no exec, so it is dropped unanswered).
    io = {"stream": "stdin", "rank": "0", **field}
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=3)
    assert connection.responses() == []


@pytest.mark.parametrize("encoding", ["base64", "UTF-8"])
def test_a_lone_surrogate_in_a_write_s_data_is_einval_naming_it(connection, encoding):
    # Base64 too: its decoder encodes the text first, and its
    # UnicodeEncodeError's words ("'utf-8' codec can't encode…") named no
    # field.
    io = {"stream": "stdin", "rank": "0", "data": "YQ\ud800", "encoding": encoding}
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=3)
    assert error_of(connection.last()) == (
        errno.EINVAL,
        "io.data: not valid Unicode text: lone surrogate U+D800 at 2",
    )
    assert not connection.transport.disconnecting


#: Base64 no write's data can be, with where the refusal says it is wrong:
#: "io.data: invalid base64" alone left the bad byte of a megabyte of stdin
#: to be found by hand.
_BAD_BASE64 = {
    "space": ("aGVs bG8=", '" " at offset 4 is not a base64 character'),
    "line-break": ("aGVsbG8=\n", '"\\n" at offset 8 is not a base64 character'),
    "padding-inside": ("aG=sbG8=", '"=" at offset 2 is padding before the end'),
    "three-padding": ("a===", '3 "=" of padding from offset 1 (at most 2)'),
    "length": ("aGVsbG8", "its length 7 is not a multiple of 4"),
}


@pytest.mark.parametrize(("data", "said"), _BAD_BASE64.values(), ids=_BAD_BASE64)
def test_a_write_s_bad_base64_is_einval_saying_where(connection, data, said):
    io = {"stream": "stdin", "rank": "0", "data": data, "encoding": "base64"}
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=3)
    assert error_of(connection.last()) == (
        errno.EINVAL,
        f"io.data: invalid base64: {said}",
    )
    assert not connection.transport.disconnecting


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\udc80x"])
@pytest.mark.parametrize("padding", [0, SMALL_LINE], ids=["short", "long"])
def test_a_lone_surrogate_escape_is_einval_naming_its_field(
    server, connection, escape, padding
):
    # Valid JSON that no UTF-8 can carry: the json module decodes it (a long
    # line after msgspec has refused it), and the request's checks name the
    # field.
    line = '{"type":"request","topic":"sdexec.kill","matchtag":1,' + " " * padding
    payload = f'"payload":{{"signum":15,"label":"x{escape}"}}}}\n'
    connection.protocol.dataReceived((line + payload).encode())
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL
    assert errstr.startswith("label: ") and "lone surrogate" in errstr
    assert not connection.transport.disconnecting
    still_serves(server)


def test_a_lone_surrogate_in_a_line_that_is_not_json_is_a_framing_error(connection):
    # A short line: the json module names the real fault (the comma).
    line = b'{"type":"request","topic":"sdexec.list","matchtag":1,"x":"\\ud800",}\n'
    connection.protocol.dataReceived(line)
    assert connection.last()["errnum"] == errno.EPROTO
    errstr = connection.last()["errstr"]
    assert errstr.startswith("message is not valid JSON")
    comma = line.index(b",}")
    # Python 3.13 points at the trailing comma, earlier ones at the brace.
    assert any(f"(char {at})" in errstr for at in (comma, comma + 1))
    assert "surrogate" not in errstr
    assert connection.transport.disconnecting


def test_a_lone_surrogate_in_a_long_line_that_is_not_json_is_named(connection):
    # A long line goes to msgspec first, which refuses the surrogate before
    # the fault: the message says both.
    line = b'{"type":"request","topic":"sdexec.list","matchtag":1,"x":"\\ud800",'
    line += b" " * SMALL_LINE + b"}\n"
    connection.protocol.dataReceived(line)
    assert connection.last()["errnum"] == errno.EPROTO
    errstr = connection.last()["errstr"]
    assert errstr.startswith("message is not valid JSON")
    at = line.index(b"\\ud800")
    assert f"a lone UTF-16 surrogate escape at byte {at}" in errstr
    assert connection.transport.disconnecting


def test_an_integer_too_large_to_read_is_named_by_its_field(connection):
    # Valid JSON, past the 4300 digits Python reads: it was msgspec's words,
    # "Integer value out of range - at `$[...]`", naming no field.
    digits = b"9" * 5000
    line = b'{"type":"request","topic":"sdexec.list","matchtag":1,'
    line += b'"payload":{"x":[0,-' + digits + b"]}}\n"
    assert len(line) > SMALL_LINE
    connection.protocol.dataReceived(line)
    assert connection.last()["errnum"] == errno.EPROTO
    assert connection.last()["errstr"] == (
        "message: payload.x[1]: an integer too large (5000 digits)"
    )
    assert connection.transport.disconnecting


def test_the_field_of_an_integer_too_large_is_cut(connection):
    # Each key cut alone, 500 nested keys of 300 characters made a field
    # of 100 KB: said to the client, and logged with the closed connection.
    key = b'"' + b"k" * 300 + b'":'
    line = b'{"type":"request","topic":"sdexec.list","matchtag":1,"payload":'
    line += (b"{" + key) * 500 + b"9" * 5000 + b"}" * 501 + b"\n"
    connection.protocol.dataReceived(line)
    errstr = connection.last()["errstr"]
    assert errstr.startswith("message: payload.kkk")
    assert errstr.endswith(" chars): an integer too large (5000 digits)")
    assert len(errstr) < 2 * SHOWN
    assert connection.transport.disconnecting


@pytest.mark.parametrize("topic", ["sdexec.list\ud800", "\udfff", "sdexec.li\0st"])
def test_a_topic_that_is_not_text_is_einval(connection, topic):
    # Delivered decoded: the checks hold whatever the JSON decoder lets by.
    connection.protocol.messageReceived({**ENVELOPE, "topic": topic})
    response = connection.last()
    assert response["topic"] == ""  # it could not be echoed back
    assert response["errnum"] == errno.EINVAL
    assert response["errstr"].startswith("topic: ")
    assert not connection.transport.disconnecting


@pytest.mark.parametrize(
    "signum", [0, -1, signal.NSIG, 2**31, 2**40, -(2**63), True, "15"]
)
def test_an_out_of_range_signal_is_einval_before_systemd(systemd, connection, signum):
    connection.send("sdexec.kill", {"pid": 4242, "signum": signum})
    assert error_of(connection.last()) == (
        errno.EINVAL,
        f"signum: expected a signal number from 1 to {signal.NSIG - 1},"
        f" got {json.dumps(signum)}",
    )
    assert systemd.kills() == []


@pytest.mark.parametrize("label", ["\ud800", "a\0b"])
@pytest.mark.parametrize(
    ("topic", "payload", "field"),
    [
        ("sdexec.kill", {"signum": 15}, "label"),
        ("sdexec.wait", {}, "label"),
        ("sdexec.attach", {}, "label"),
        ("sdexec.terminate", {"reason": "cancel"}, "label"),
        ("sdexec.terminate", {"reason": "cancel"}, "jobid"),
    ],
)
def test_a_target_that_is_not_text_is_einval_naming_it(
    connection, label, topic, payload, field
):
    """On every topic, as in exec: not an ENOENT or ESRCH for a name that
    can never be found."""
    connection.protocol.messageReceived(
        {**ENVELOPE, "topic": topic, "payload": {**payload, field: label}}
    )
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL and errstr.startswith(f"{field}: ")


def test_a_non_owner_is_answered_eperm_then_closed(server):
    server.owner_uid = os.getuid() + 1
    intruder = Connection(server)
    intruder.send("sdexec.list", {}, matchtag=8)  # too late: not served
    assert intruder.responses() == [
        {
            "type": "response",
            "topic": "",
            "matchtag": 0,
            "errnum": errno.EPERM,
            "errstr": "only the service's owner may use it (and the users of its"
            f" [sdexec] allow-users), not uid {os.getuid()}",
        }
    ]
    assert intruder.transport.disconnecting
    intruder.close()


@pytest.mark.parametrize(
    "malformed",
    [
        {"type": "request", "matchtag": 1, "payload": {}},
        {"type": "request", "topic": "sdexec.list", "matchtag": -5},
        {"type": "request", "topic": "sdexec.list", "matchtag": 2, "payload": []},
        {"type": "request", "topic": "sdexec.nope", "matchtag": 3},
    ],
    ids=["no-topic", "bad-matchtag", "bad-payload", "unknown-topic"],
)
def test_a_non_owners_malformed_request_is_eperm_and_closes_too(server, malformed):
    """A stranger gets EPERM to whatever it sends first, and no more: not
    EINVAL on a connection it could keep open with bad requests."""
    server.owner_uid = os.getuid() + 1
    intruder = Connection(server)
    intruder.raw(malformed)
    [answer] = intruder.responses()
    assert answer["errnum"] == errno.EPERM
    assert intruder.transport.disconnecting
    intruder.close()


# -- exec: every string, the exec limits, the property policy ----------------------

TRUE = {"cmdline": ["/bin/true"], "env": {"PATH": "/bin"}, "opts": {}}
FLAGS = 3


def exec_refused(server, connection, cmd: dict, decoded: bool = False):
    """Send an exec of ``cmd``; its error, after checking that nothing was
    started or tabled and that list and stats still work for everyone."""
    message = {**ENVELOPE, "topic": "sdexec.exec",
               "payload": {"cmd": cmd, "flags": FLAGS}}  # fmt: skip
    if decoded:  # surrogates: past what msgspec would decode
        connection.protocol.messageReceived(message)
    else:
        connection.protocol.dataReceived(json_line(message))
    assert server.processes == {}
    assert server.systemd.calls == []
    still_serves(server)
    return error_of(connection.last())


BAD_STRINGS = [
    ({"cmdline": ["/bin/true", "a\0b"]}, "cmd.cmdline[1]"),
    ({"env": {"PATH": "/bin", "X": "\0"}}, "cmd.env.X"),
    ({"env": {"PATH": "/bin", "X\0": "1"}}, "cmd.env (key 'X\\x00')"),
    ({"opts": {"SDEXEC_NAME": "u\0"}}, "cmd.opts.SDEXEC_NAME"),
    ({"opts": {"SDEXEC_PROP_Description": "\0"}}, "cmd.opts.SDEXEC_PROP_Description"),
    ({"cwd": "/tmp\0"}, "cmd.cwd"),
    ({"label": "l\0"}, "cmd.label"),
]


@pytest.mark.parametrize(("change", "field"), BAD_STRINGS)
def test_a_nul_in_any_string_is_einval_naming_it(server, connection, change, field):
    errnum, errstr = exec_refused(server, connection, {**TRUE, **change})
    assert errnum == errno.EINVAL
    assert errstr.startswith(f"{field}: contains a NUL character")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"opts": {"SDEXEC_PROP_Description": "j\n[Service]\nDelegate=yes"}},
         "SDEXEC_PROP_Description: error setting property"),
        ({"cwd": "-/nonexistent\n[Service]\nDelegate=yes"}, "cmd.cwd"),
    ],
)  # fmt: skip
def test_a_line_break_for_the_unit_s_file_is_einval_naming_it(
    server, connection, change, field
):
    # systemd writes these unescaped into the transient unit's file, where
    # the request would add settings of its own (read at daemon-reload).
    errnum, errstr = exec_refused(server, connection, {**TRUE, **change})
    assert errnum == errno.EINVAL
    assert errstr.startswith(f"{field}: line break '\\n' at ")


@pytest.mark.parametrize(
    ("cwd", "why"),
    [
        ("tmp", "not an absolute path"),
        ("~", "not an absolute path"),  # systemd's: the home directory
        ("-/nonexistent", "not an absolute path"),  # systemd's: missing is fine
        ("/tmp/..", "a '..' in it, which systemd refuses"),
        ("/tmp/../x/", "a '..' in it, which systemd refuses"),
    ],
)
def test_a_cwd_systemd_would_refuse_or_read_otherwise_is_einval_naming_it(
    server, connection, cwd, why
):
    # "/tmp/.." failed the unit's load in words that named nothing; "~"
    # and a leading "-" are unit-file syntax, not a directory.
    errnum, errstr = exec_refused(server, connection, {**TRUE, "cwd": cwd})
    assert errnum == errno.EINVAL
    assert errstr.startswith(f'cmd.cwd: "{cwd}": {why}')


def test_a_long_cwd_is_quoted_as_far_as_any_value_with_its_length(server, connection):
    # A JSON-quoted value was cut at 1000 characters, without its length,
    # where the same request's opts were cut at 200, with theirs.
    cwd = "/tmp/../" + "x" * 1000
    errnum, errstr = exec_refused(server, connection, {**TRUE, "cwd": cwd})
    assert errnum == errno.EINVAL
    assert errstr.startswith(f"cmd.cwd: \"{cwd[:199]}… (1008 chars): a '..' in it")


@pytest.mark.parametrize("cwd", ["//tmp", "/tmp//x/./y/", "/"])
def test_a_cwd_systemd_simplifies_passes(cwd):
    # A client's $PWD may hold them (`cd //tmp`; --dir=$SCRATCH/job with a
    # SCRATCH ending in "/"): flux exec sends it, upstream passes it, and
    # systemd simplifies it.
    payload = {"cmd": {**TRUE, "cwd": cwd}, "flags": 0}
    assert checked_request(payload, streaming=True).command.cwd == cwd


@pytest.mark.parametrize(("change", "field"), BAD_STRINGS)
def test_a_surrogate_in_any_string_is_einval_naming_it(
    server, connection, change, field
):
    surrogate = {
        key: (
            [v.replace("\0", "\ud800") for v in value] if isinstance(value, list)
            else {k.replace("\0", "\ud800"): v.replace("\0", "\ud800")
                  for k, v in value.items()} if isinstance(value, dict)
            else value.replace("\0", "\ud800")
        )
        for key, value in change.items()
    }  # fmt: skip
    errnum, errstr = exec_refused(server, connection, {**TRUE, **surrogate})
    assert errnum == errno.EINVAL
    assert errstr.startswith(field.replace("\\x00", "\\ud800"))
    assert "lone surrogate U+D800" in errstr


@pytest.mark.parametrize(
    ("cmdline", "env", "names"),
    [
        (["/bin/true", "x" * 10_000_000], {}, "cmd.cmdline[1]: 10000000 bytes"),
        (["/bin/true", "x" * 131_072], {}, "MAX_ARG_STRLEN"),
        (["/bin/true"] + ["x" * 60_000] * 100, {}, "ARG_MAX"),
        (["/bin/true"] + ["x" * 10_000] * 1000, {}, "ARG_MAX"),
        (["/bin/true"], {"BIG": "x" * 200_000}, "cmd.env.BIG: 200004 bytes"),
    ],
)
def test_what_exec_cannot_take_is_e2big_and_never_reaches_systemd(
    server, connection, cmdline, env, names
):
    cmd = {**TRUE, "cmdline": cmdline, "env": {"PATH": "/bin", **env}}
    errnum, errstr = exec_refused(server, connection, cmd)
    assert errnum == errno.E2BIG
    assert names in errstr


@pytest.mark.parametrize(
    ("cmdline", "env", "field"),
    [
        (["/bin/true"], {f"E{k:02d}": "e" * 120_000 for k in range(12)}, "cmd.env"),
        (["/bin/true", *["a" * 120_000] * 12], {}, "cmd.cmdline"),
        (["/bin/true"], {f"N{k}": "n" * 120_000 for k in range(9)}, "cmd.env"),
        (["/bin/true"], {f"C{k}": "\x01" * 100_000 for k in range(3)}, "cmd.env"),
    ],
    ids=["1.44MB-env", "1.44MB-cmdline", "1.08MB-env", "300KB-controls-env"],
)
def test_a_line_too_long_for_the_units_file_is_e2big_and_never_reaches_systemd(
    server, connection, cmdline, env, field
):
    # Review 42 H-1: each was started, and its unit failed to load at the
    # next daemon-reload, losing the site's limits, its slice and the stop
    # timeouts.
    cmd = {**TRUE, "cmdline": cmdline, "env": {"PATH": "/bin", **env}}
    errnum, errstr = exec_refused(server, connection, cmd)
    assert errnum == errno.E2BIG
    assert errstr.startswith(f"{field}: ")
    assert errstr.endswith(
        "systemd reads back no line of 1048576 bytes or more (LONG_LINE_MAX), and"
        " the unit would lose every property at the next daemon-reload"
    )


def test_a_large_plain_environment_reaches_systemd(systemd, connection):
    env = {f"VAR{k:04d}": "v" * 900 for k in range(1000)}  # 908 KB
    cmd = {**TRUE, "env": {"PATH": "/bin", **env}, "opts": {"SDEXEC_NAME": "big"}}
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    assert systemd.calls[0] == ("start", "big.service")


def test_an_environment_of_too_many_variables_is_e2big_and_never_reaches_systemd(
    server, connection
):
    """systemd's time for a unit's environment grows with the square of its
    variables: 100,000 empty ones, within every byte limit, held the
    manager for over a minute."""
    env = {f"V{k}": "" for k in range(MAX_ENVIRONMENT)}  # with PATH, one more
    errnum, errstr = exec_refused(
        server, connection, {**TRUE, "env": {"PATH": "/bin", **env}}
    )
    assert errnum == errno.E2BIG
    assert errstr.startswith(
        f"cmd.env: {MAX_ENVIRONMENT + 1} variables, more than the"
        f" {MAX_ENVIRONMENT} sdexec passes to systemd"
    )


def test_as_many_variables_as_allowed_reach_systemd_beside_those_dropped(
    systemd, connection
):
    """The count is of what systemd is sent: names it would refuse, and the
    caller's systemd variables, are dropped first."""
    env = {f"V{k}": "" for k in range(MAX_ENVIRONMENT - 1)}
    dropped = {f"0bad{k}": "" for k in range(100)} | {"NOTIFY_SOCKET": "/x"}
    cmd = {**TRUE, "env": {"PATH": "/bin", **env, **dropped}}
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    assert systemd.calls[0][0] == "start"
    assert len(environment_of(systemd, systemd.calls[0][1])) == MAX_ENVIRONMENT


def test_a_command_of_too_many_arguments_is_e2big_and_never_reaches_systemd(
    server, connection
):
    """Within every byte limit, 200,000 one-byte arguments held the
    manager 10 s."""
    cmdline = ["/bin/true", *["a"] * MAX_ARGUMENTS]
    errnum, errstr = exec_refused(server, connection, {**TRUE, "cmdline": cmdline})
    assert errnum == errno.E2BIG
    assert errstr.startswith(
        f"cmd.cmdline: {MAX_ARGUMENTS + 1} arguments, more than the"
        f" {MAX_ARGUMENTS} sdexec passes to systemd"
    )


def test_as_many_arguments_as_allowed_reach_systemd(systemd, connection):
    cmd = {**TRUE, "cmdline": ["/bin/true", *["a"] * (MAX_ARGUMENTS - 1)]}
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    assert systemd.calls[0][0] == "start"


#: Larger than the command budget (docs/protocol.md, 2.5 MiB), in strings
#: that systemd is never sent: each used to be accepted, and kept whole by
#: its process for its life.
OVER_BUDGET = 3 * 1024 * 1024


@pytest.mark.parametrize(
    ("change", "names"),
    [
        # An option sdexec does not read.
        ({"opts": {"x": "y" * OVER_BUDGET}}, "cmd.opts: 3145745 bytes in 1 entry"),
        # Names systemd refuses: dropped from the unit's environment.
        (
            {"env": {f"0bad{k}": "z" * 100 for k in range(30_000)}},
            "cmd.env: 3738890 bytes in 30000 entries",
        ),
        # The caller's systemd variables: dropped too.
        ({"env": {"NOTIFY_SOCKET": "n" * OVER_BUDGET}}, "cmd.env.NOTIFY_SOCKET ("),
    ],
)
def test_what_systemd_is_not_sent_still_counts_against_the_command_budget(
    server, connection, change, names
):
    errnum, errstr = exec_refused(server, connection, {**TRUE, **change})
    assert errnum == errno.E2BIG
    assert errstr.startswith("cmd: its strings take ")
    assert names in errstr


def test_a_large_ordinary_command_is_within_the_budget(systemd, connection):
    """A 100 KiB environment, exported shell functions (dropped), many
    options, a long command line: well within the budget."""
    env = {f"VAR_{k}": "v" * 1000 for k in range(100)}
    env["BASH_FUNC_module%%"] = "() { eval $($LMOD_CMD bash $*); }" * 100
    opts = {f"opt{k}": "o" * 100 for k in range(500)}
    cmd = {"cmdline": ["/bin/true", *["arg"] * 10_000], "env": env,
           "opts": {**opts, "SDEXEC_NAME": "sdexec-big"}}  # fmt: skip
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    assert systemd.calls[0] == ("start", "sdexec-big.service")


def test_the_largest_single_argument_exec_takes_is_accepted(systemd, connection):
    from sdexec.limits import MAX_ARG_STRLEN

    cmd = {**TRUE, "cmdline": ["/bin/true", "x" * (MAX_ARG_STRLEN - 1)]}
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    assert systemd.calls[0][0] == "start"


def environment_of(systemd: FakeManager, unit: str) -> list[str]:
    (environment,) = [
        prop.value for prop in systemd.properties[unit] if prop.name == "Environment"
    ]
    return environment


def test_the_callers_systemd_variables_never_reach_the_unit(systemd, connection):
    caller = {
        name: "from-the-caller"
        for name in ("NOTIFY_SOCKET", "INVOCATION_ID", "LISTEN_FDS", "LISTEN_PID",
                     "LISTEN_FDNAMES", "JOURNAL_STREAM", "MANAGERPID",
                     "SYSTEMD_EXEC_PID")
    }  # fmt: skip
    cmd = {**TRUE, "env": {"PATH": "/bin", **caller, "HOME": "/h"},
           "opts": {"SDEXEC_NAME": "sdexec-env"}}  # fmt: skip
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    assert environment_of(systemd, "sdexec-env.service") == ["PATH=/bin", "HOME=/h"]


@pytest.mark.parametrize(
    ("name", "value", "text"),
    [
        ("User", "root", "a request can never set User: identity"),
        ("KillMode", "none", "a request can never set KillMode: lifecycle"),
        ("SendSIGKILL", "yes", "a request can never set SendSIGKILL"),
        ("DeviceAllow", "/dev/mem rwm", "a request can never set DeviceAllow"),
        ("AllowedCPUs", "0-3", "a request can never set AllowedCPUs"),
        ("Slice", "x.slice", "a request can never set Slice"),
        ("Nice", "-20", "requests may not set Nice; an admin may allow it in"
         " [sdexec] request-properties"),
        ("MemoryMax", "infinity", "looser than this node's MemoryMax=8G"),
    ],
)  # fmt: skip
def test_a_property_outside_the_policy_is_eperm_naming_it(systemd, name, value, text):
    config = parse_config({"exec": {"sdexec-properties": {"MemoryMax": "8G"}}})
    server = SdexecServer(systemd, config, reactor, clock=Clock())
    connection = Connection(server)
    cmd = {**TRUE, "opts": {f"SDEXEC_PROP_{name}": value}}
    errnum, errstr = exec_refused(server, connection, cmd)
    assert errnum == errno.EPERM
    assert errstr.startswith(f"SDEXEC_PROP_{name}: ") and text in errstr
    connection.close()


def test_tightening_within_the_policy_reaches_systemd(systemd):
    config = parse_config({"exec": {"sdexec-properties": {"MemoryMax": "8G"}}})
    connection = Connection(SdexecServer(systemd, config, reactor, clock=Clock()))
    opts = {"SDEXEC_NAME": "sdexec-tight", "SDEXEC_PROP_MemoryMax": "1G",
            "SDEXEC_PROP_CPUWeight": "10"}  # fmt: skip
    connection.send("sdexec.exec", {"cmd": {**TRUE, "opts": opts}, "flags": FLAGS})
    sent = systemd.properties["sdexec-tight.service"]
    requested = {(p.name, p.value) for p in sent if p.source == "request"}
    assert requested == {("MemoryMax", 1 << 30), ("CPUWeight", 10)}
    connection.close()


def test_an_unknown_property_systemd_refuses_is_einval_naming_it(systemd):
    from sdexec.systemd import SystemdError

    systemd.refuse_start = SystemdError(
        "org.freedesktop.DBus.Error.PropertyReadOnly",
        "Cannot set property MemoryZSwapWriteback, or unknown property.",
    )
    # Known to sdexec (systemd 256), not to an older node's systemd.
    allowed = {"request-properties": ["MemoryZSwapWriteback"]}
    config = parse_config({"sdexec": allowed})
    connection = Connection(SdexecServer(systemd, config, reactor, clock=Clock()))
    opts = {"SDEXEC_PROP_MemoryZSwapWriteback": "no"}
    connection.send("sdexec.exec", {"cmd": {**TRUE, "opts": opts}, "flags": FLAGS})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL and "MemoryZSwapWriteback" in errstr
    connection.close()


# -- connections ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "owner", "key", "reserve"),
    [
        ({"max-connections-per-user": 3}, False, "max-connections-per-user", 0),
        ({"max-connections": 3}, True, "max-connections", RESERVED_CONNECTIONS),
    ],
)
def test_connections_over_a_cap_are_refused_eagain_and_closed(
    systemd, limits, owner, key, reserve
):
    # The owner has the reserve beyond its cap (an admin's), no one else.
    allowed = {"allow-users": [os.getuid()]}  # another user, let in
    server = SdexecServer(systemd, parse_config({"sdexec": limits | allowed}), reactor)
    if not owner:
        server.owner_uid = os.getuid() + 1  # this process is another user
    admitted = [Connection(server) for _ in range(3 + reserve)]
    assert all(connection.responses() == [] for connection in admitted)
    refused = Connection(server)
    (response,) = refused.responses()
    assert (response["matchtag"], response["errnum"]) == (0, errno.EAGAIN)
    assert f"[sdexec] {key} allows" in response["errstr"]
    assert refused.transport.disconnecting
    refused.send("sdexec.list", {})
    assert len(refused.responses()) == 1  # nothing more is served
    refused.close()
    admitted.pop().close()  # a slot is free again
    again = Connection(server)
    assert again.responses() == []  # admitted
    for connection in [*admitted, again]:
        connection.close()
    assert server.connections.total == 0


def test_the_owner_is_bounded_by_the_total_only(systemd):
    limits = {"max-connections-per-user": 1, "max-connections": 5}
    server = SdexecServer(systemd, parse_config({"sdexec": limits}), reactor)
    connections = [Connection(server) for _ in range(5)]
    for connection in connections:
        connection.send("sdexec.list", {})
        assert "payload" in connection.last()
        connection.close()


def test_another_user_s_connections_never_shut_the_owner_out(systemd, monkeypatch):
    # max-connections was everyone's: 512 / 16 users of allow-users, each
    # at its max-connections-per-user, refused the resource manager's next
    # connection. Each user's cap is now apart from the owner's.
    other = os.getuid() + 1
    limits = {"max-connections": 2, "max-connections-per-user": 3}
    config = parse_config({"sdexec": limits | {"allow-users": [other]}})
    server = SdexecServer(systemd, config, reactor)
    with monkeypatch.context() as patch:
        patch.setattr(sdexec.connection, "peer_uid", lambda sock: other)
        theirs = [Connection(server) for _ in range(4)]
    assert [len(c.responses()) for c in theirs] == [0, 0, 0, 1]  # 3 of theirs
    assert "[sdexec] max-connections-per-user allows" in theirs[3].last()["errstr"]
    owners = [Connection(server) for _ in range(2 + RESERVED_CONNECTIONS + 1)]
    for connection in owners[:-1]:
        connection.send("sdexec.list", {})
        assert "payload" in connection.last()  # served, beside their 3
    assert owners[-1].last()["errstr"] == (
        "too many connections: 2 open, the most [sdexec] max-connections allows,"
        " and the 3 kept beyond it for sdexec.list, sdexec.reload,"
        " sdexec.stats-get and sdexec.undrain are open too"
    )
    for connection in [*theirs, *owners]:
        connection.close()
    assert server.connections.total == 0


def _reserve_of(server: SdexecServer) -> list[Connection]:
    """Connections of ``server``'s owner up to its ``max-connections``,
    held, then one of the reserve beyond them (the last)."""
    held = [Connection(server) for _ in range(server.config.sdexec.max_connections)]
    reserve = Connection(server)
    assert server.connections.reserved(reserve.protocol.connection_id)
    return [*held, reserve]


def test_the_owner_s_reserve_serves_an_admin_s_requests(systemd):
    # A resource manager holding every connection shut out `sdexec stats`,
    # `ps`, `undrain` and `reload` (the units' ExecReload=): the reserve
    # serves them, on one connection as on several.
    server = SdexecServer(
        systemd, parse_config({"sdexec": {"max-connections": 2}}), reactor
    )
    *held, reserve = _reserve_of(server)
    for matchtag, topic in enumerate(["sdexec.list", "sdexec.stats-get"], 1):
        reserve.send(topic, {}, matchtag)
    reserve.send("sdexec.undrain", {}, 3)
    assert [r["matchtag"] for r in reserve.responses() if "payload" in r] == [1, 2, 3]
    assert not reserve.transport.disconnecting
    for connection in [*held, reserve]:
        connection.close()
    assert server.connections.total == 0


@pytest.mark.parametrize(
    ("message", "named"),
    [
        (
            {"topic": "sdexec.exec", "payload": {"cmd": TRUE, "flags": FLAGS}},
            "'sdexec.exec'",
        ),
        ({"topic": "sdexec.kill", "payload": {"pid": 1, "signum": 0}}, "'sdexec.kill'"),
        ({"topic": "sdexec.write", "payload": {"matchtag": 1}}, "'sdexec.write'"),
        (
            {"topic": ["sdexec.list"], "payload": {}},
            "a request whose topic is not text",
        ),
    ],
)
def test_anything_else_on_the_reserve_is_eagain_naming_the_key_and_closes_it(
    systemd, message, named
):
    server = SdexecServer(
        systemd, parse_config({"sdexec": {"max-connections": 2}}), reactor
    )
    *held, reserve = _reserve_of(server)
    reserve.raw({"type": "request", "matchtag": 7, **message})
    reserve.send("sdexec.list", {}, 8)  # after it: not read
    (refusal,) = reserve.responses()
    assert (refusal["matchtag"], refusal["errnum"]) == (7, errno.EAGAIN)
    assert refusal["errstr"] == (
        "too many connections: this one is beyond the 2 [sdexec] max-connections"
        " allows, one of the 3 kept beyond it for sdexec.list, sdexec.reload,"
        f" sdexec.stats-get and sdexec.undrain: {named} is refused there, and the"
        " connection closed"
    )
    assert reserve.transport.disconnecting
    assert server.processes == {} and server.counters["errors"] == 1
    reserve.close()  # what the reactor does once the refusal is written
    again = Connection(server)  # its place in the reserve is free again
    assert server.connections.reserved(again.protocol.connection_id)
    for connection in [*held, again]:
        connection.close()
    assert server.connections.total == 0


def test_a_reload_that_raises_the_cap_frees_the_reserve_s_connections(systemd):
    # Admitted to the reserve, a connection stayed restricted after a reload
    # raised max-connections above those open: its exec was refused as
    # "beyond the 2 [sdexec] max-connections allows", and its idleness
    # closed it.
    clock = Clock()
    config = parse_config({"sdexec": {"max-connections": 1}})
    server = SdexecServer(systemd, config, reactor, clock=clock)
    *held, listing, running = [*_reserve_of(server), Connection(server)]
    raised = parse_config({"sdexec": {"max-connections": 2}})
    server.reconfigure(raised, Containment(raised, None))
    running.send("sdexec.kill", {"pid": 2**22 + 1, "signum": 15}, 1)  # not an admin's
    assert running.last()["errstr"] == f"kill pid={2**22 + 1} not found"
    listing.send("sdexec.list", {}, 1)  # an admin's: it stays in the reserve
    clock.advance(RESERVE_IDLE_SECONDS)
    assert listing.transport.disconnecting and not running.transport.disconnecting
    assert server.connections.open_by_uid() == {os.getuid(): 2}
    for connection in [*held, listing, running]:
        connection.close()
    assert server.connections.total == 0 and clock.getDelayedCalls() == []


def test_an_idle_connection_of_the_reserve_is_closed(systemd):
    # A resource manager that leaked its connections (what the reserve is
    # for) held the reserve too with three more that never asked anything.
    clock = Clock()
    config = parse_config({"sdexec": {"max-connections": 1}})
    server = SdexecServer(systemd, config, reactor, clock=clock)
    *held, asking, idle = [*_reserve_of(server), Connection(server)]
    clock.advance(RESERVE_IDLE_SECONDS - 1)
    asking.send("sdexec.list", {}, 1)  # an admin's ps: served, kept
    clock.advance(1)
    assert idle.transport.disconnecting and not asking.transport.disconnecting
    (closing,) = idle.responses()
    assert (closing["matchtag"], closing["errnum"]) == (0, errno.EAGAIN)
    assert closing["errstr"] == (
        "closing an idle connection: one of the 3 kept beyond [sdexec]"
        " max-connections for an admin's requests, it asked nothing for 10 s"
    )
    clock.advance(RESERVE_IDLE_SECONDS)  # asked nothing since its ps
    assert asking.transport.disconnecting
    assert not held[0].transport.disconnecting  # under the cap: never
    for connection in [*held, asking, idle]:
        connection.close()
    assert server.connections.total == 0 and clock.getDelayedCalls() == []


def test_the_reserve_s_idle_time_counts_from_its_last_request(systemd):
    # Looked at every 10 s for a request since the last look, a connection
    # that asked at 1 s was closed at 20 s: 19 s idle, where docs say 10.
    clock = Clock()
    config = parse_config({"sdexec": {"max-connections": 1}})
    server = SdexecServer(systemd, config, reactor, clock=clock)
    held, asking = _reserve_of(server)
    clock.advance(1)
    asking.send("sdexec.list", {}, 1)
    clock.advance(RESERVE_IDLE_SECONDS - 0.5)
    assert not asking.transport.disconnecting  # 9.5 s idle
    clock.advance(0.5)
    assert asking.transport.disconnecting
    assert "closing an idle connection" in asking.last()["errstr"]
    for connection in [held, asking]:
        connection.close()
    assert server.connections.total == 0 and clock.getDelayedCalls() == []


def test_a_closed_connection_of_the_reserve_that_reads_nothing_is_aborted(systemd):
    # Closed, idle or refused, a connection whose client read none of what
    # it was sent (answers to a flood of requests) waited to write it out,
    # its place in the reserve held for ever. (This transport, as such a
    # socket, never drains: only an abort ends it.)
    clock = Clock()
    config = parse_config({"sdexec": {"max-connections": 1}})
    server = SdexecServer(systemd, config, reactor, clock=clock)
    held, idle = _reserve_of(server)
    refused = Connection(server)
    refused.send("sdexec.exec", {"cmd": TRUE, "flags": FLAGS}, 1)
    transports = [idle.transport, refused.transport]
    assert [(t.disconnecting, t.disconnected) for t in transports] == [
        (False, False),
        (True, False),  # its refusal has 10 s to be read
    ]
    clock.advance(RESERVE_IDLE_SECONDS)
    assert [(t.disconnecting, t.disconnected) for t in transports] == [
        (True, False),  # closed for being idle, and as long to read why
        (True, True),
    ]
    clock.advance(RESERVE_IDLE_SECONDS)
    assert idle.transport.disconnected
    for connection in [held, idle, refused]:
        connection.close()
    assert server.connections.total == 0 and clock.getDelayedCalls() == []


@pytest.mark.parametrize(
    ("close", "words"),
    [
        (lambda idle: idle.raw({"type": "response"}), [errno.EPROTO]),  # not a request
        (lambda idle: idle.protocol.readConnectionLost(), []),  # its EOF
    ],
)
def test_a_connection_of_the_reserve_closed_otherwise_is_aborted_unread_too(
    systemd, close, words
):
    # Closed for a protocol error, a connection of the reserve whose client
    # read nothing was never aborted (its idle timer found it gone), its
    # place held for ever; closed at its EOF, it was told it was idle, and
    # aborted only 10 s after that.
    clock = Clock()
    config = parse_config({"sdexec": {"max-connections": 1}})
    server = SdexecServer(systemd, config, reactor, clock=clock)
    held, idle = _reserve_of(server)
    clock.advance(1)
    close(idle)
    assert (idle.transport.disconnecting, idle.transport.disconnected) == (True, False)
    clock.advance(RESERVE_IDLE_SECONDS)
    assert idle.transport.disconnected
    assert [response["errnum"] for response in idle.responses()] == words
    for connection in [held, idle]:
        connection.close()
    assert server.connections.total == 0 and clock.getDelayedCalls() == []


def test_a_write_with_no_answer_on_the_reserve_closes_it_unanswered(systemd):
    server = SdexecServer(
        systemd, parse_config({"sdexec": {"max-connections": 1}}), reactor
    )
    *held, reserve = _reserve_of(server)
    reserve.raw({"type": "request", "topic": "sdexec.write", "payload": {}})
    assert reserve.responses() == [] and reserve.transport.disconnecting
    for connection in [*held, reserve]:
        connection.close()
    assert server.connections.total == 0


def test_a_reload_below_a_user_s_connections_is_said_as_the_cap_it_set(
    systemd, monkeypatch
):
    # A reload lowered max-connections-per-user to 2 while the user held 3:
    # "3 open, the most [sdexec] max-connections-per-user allows" called 3
    # the cap.
    other = os.getuid() + 1
    config = parse_config({"sdexec": {"allow-users": [other]}})
    server = SdexecServer(systemd, config, reactor)
    with monkeypatch.context() as patch:
        patch.setattr(sdexec.connection, "peer_uid", lambda sock: other)
        held = [Connection(server) for _ in range(3)]
        limits = {"allow-users": [other], "max-connections-per-user": 2}
        config = parse_config({"sdexec": limits})
        server.reconfigure(config, Containment(config, None))
        refused = Connection(server)
    assert refused.last()["errstr"] == (
        f"too many connections from uid {other}: 3 open, more than the 2"
        " [sdexec] max-connections-per-user allows"
    )
    for connection in [*held, refused]:
        connection.close()
    assert server.connections.total == 0


def test_refused_non_owners_do_not_hold_connections(systemd):
    server = SdexecServer(systemd, parse_config({}), reactor)
    server.owner_uid = os.getuid() + 1
    for _ in range(1000):
        intruder = Connection(server)
        intruder.send("sdexec.list", {})
        assert intruder.transport.disconnecting
        intruder.close()  # what the reactor does once the EPERM is written
    assert server.connections.total == 0


def test_a_stranger_that_sends_nothing_is_refused_at_once_and_not_counted(systemd):
    # A stranger's idle connections held an fd and a cap slot each, for
    # ever: ceil(max-connections / 16) users locked the owner out.
    limits = {"max-connections": 4, "max-connections-per-user": 2}
    server = SdexecServer(systemd, parse_config({"sdexec": limits}), reactor)
    server.owner_uid = os.getuid() + 1  # this process is a stranger
    strangers = [Connection(server) for _ in range(10)]
    for stranger in strangers:
        (refusal,) = stranger.responses()  # before it sent anything
        assert (refusal["matchtag"], refusal["errnum"]) == (0, errno.EPERM)
        assert stranger.transport.disconnecting
    assert server.connections.total == 0
    assert server.counters["errors"] == 10
    server.owner_uid = os.getuid()  # the owner's next connection is served
    owner = Connection(server)
    owner.send("sdexec.list", {})
    assert owner.last()["payload"]["procs"] == []
    for connection in [*strangers, owner]:
        connection.close()
    assert server.connections.total == 0


def test_a_strangers_refusals_are_logged_at_a_bounded_rate(systemd):
    clock, logged = Clock(), []
    server = SdexecServer(systemd, parse_config({}), reactor, clock=clock)
    server.owner_uid = os.getuid() + 1
    globalLogPublisher.addObserver(logged.append)
    try:
        for _ in range(3):
            for _ in range(100):
                Connection(server).close()
            clock.advance(WINDOW_S)
    finally:
        globalLogPublisher.removeObserver(logged.append)
    line = (
        f"refusing connections from uid {os.getuid()}: neither the service's"
        " owner nor in [sdexec] allow-users"
    )
    summary = (
        f"{100 - BURST} more like it in {WINDOW_S:g} s not logged; the last: {line}"
    )
    assert [formatEvent(event) for event in logged] == ([line] * BURST + [summary]) * 3
    assert server.counters["errors"] == 300


def test_one_stranger_s_refusals_do_not_hide_another_s(systemd, monkeypatch):
    server = SdexecServer(systemd, parse_config({}), reactor, clock=Clock())
    server.owner_uid = 0
    uids = iter([4242] * 100 + [4343])
    monkeypatch.setattr(sdexec.connection, "peer_uid", lambda sock: next(uids))
    logged: list[dict] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        for _ in range(101):
            Connection(server).close()
    finally:
        globalLogPublisher.removeObserver(logged.append)
    refused = [formatEvent(e) for e in logged if "refusing" in e.get("log_format", "")]
    assert len(refused) == BURST + 1
    assert refused[-1].startswith("refusing connections from uid 4343:")


def test_unreadable_peer_credentials_are_logged_in_the_system_s_words(
    systemd, monkeypatch
):
    # It logged "cannot read peer credentials: [Errno 107] Transport endpoint
    # is not connected": Python's words for an OSError.
    def unreadable(sock):
        raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN))

    server = SdexecServer(systemd, parse_config({}), reactor, clock=Clock())
    monkeypatch.setattr(sdexec.connection, "peer_uid", unreadable)
    logged: list[dict] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        Connection(server).close()
    finally:
        globalLogPublisher.removeObserver(logged.append)
    lines = [formatEvent(e) for e in logged if "credentials" in e.get("log_format", "")]
    assert lines == [f"cannot read peer credentials: {os.strerror(errno.ENOTCONN)}"]


def test_an_error_quoting_a_huge_value_is_bounded(connection):
    # 2 MB: within the command's budget (larger is E2BIG before it is read).
    opts = {"SDEXEC_STOP_TIMER_SEC": "x" * 2_000_000}
    connection.send("sdexec.exec", {"cmd": {**TRUE, "opts": opts}, "flags": FLAGS})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL
    assert errstr.startswith("SDEXEC_STOP_TIMER_SEC: 'xxx")
    assert errstr.endswith("… (2000000 chars) is not a decimal integer")


def test_an_errstr_is_bounded_whatever_it_quotes():
    # The last guard, for a message that quoted a request's value whole.
    errstr = errstr_line("x" * 2 * MAX_ERRSTR)
    assert len(errstr) == MAX_ERRSTR and errstr.endswith("…")


@pytest.mark.parametrize("topic", ["sdexec.wait", "sdexec.attach", "sdexec.kill"])
@pytest.mark.parametrize(
    "label", ["L" * 1_048_576, "\x1b" * 5000], ids=["long", "escapes"]
)
def test_a_cut_label_is_said_its_own_length(connection, topic, label):
    # Counted quoted, a label of 1048576 characters was "(1048578 chars)"
    # to wait and attach (and 1048576 to kill, which shows it bare), and
    # one of 5000 escape codes "(20002 chars)".
    connection.send(topic, {"label": label, "signum": 15})
    errnum, errstr = error_of(connection.last())
    assert errnum in (errno.ENOENT, errno.ESRCH)
    assert f"… ({len(label)} chars)" in errstr


#: A hostile value: 1 MB (100 kB in a command, whose strings are E2BIG past
#: 128 KiB before any is read).
HUGE, LARGE = "x" * 1_000_000, "x" * 100_000
#: The most an error quoting such a value says: the value cut, its length.
QUOTING_BOUND = 2048


def _exec(**opts: str) -> dict:
    return {"cmd": {**TRUE, "opts": opts}, "flags": FLAGS}


#: topic, payload, the field the error names (at its start).
HOSTILE = {
    "topic": ("sdexec." + HUGE, {}, "unknown topic 'sdexec.xxx"),
    "terminate.label": (
        "sdexec.terminate",
        {"label": HUGE, "reason": "cancel"},
        "terminate label=xxx",
    ),
    "terminate.reason": (
        "sdexec.terminate",
        {"label": "a", "reason": HUGE},
        "reason: expected",
    ),
    "kill.label": ("sdexec.kill", {"label": HUGE, "signum": 15}, "kill label=xxx"),
    "wait.label": ("sdexec.wait", {"label": HUGE}, "label 'xxx"),
    "attach.label": ("sdexec.attach", {"label": HUGE}, "label 'xxx"),
    "list.detail": ("sdexec.list", {"detail": HUGE}, "detail: expected"),
    "write.io.stream": (
        "sdexec.write",
        {"matchtag": 1, "io": {"stream": HUGE, "rank": "0", "data": ""}},
        'io.stream: "xxx',
    ),
    "write.io.encoding": (
        "sdexec.write",
        {"matchtag": 1, "io": {"stream": "stdin", "rank": "0", "encoding": HUGE}},
        'io.encoding: "xxx',
    ),
    "exec.local_flags": (
        "sdexec.exec",
        {**_exec(), "local_flags": HUGE},
        "local_flags: expected",
    ),
    "cmd.cmdline": (
        "sdexec.exec",
        {"cmd": {**TRUE, "cmdline": [LARGE]}, "flags": FLAGS},
        "xxx",
    ),
    "cmd.cwd": (
        "sdexec.exec",
        {"cmd": {**TRUE, "cwd": LARGE}, "flags": FLAGS},
        "cmd.cwd:",
    ),
    "cmd.env key": (
        "sdexec.exec",
        {"cmd": {**TRUE, "env": {LARGE + "\n": 5}}, "flags": FLAGS},
        "cmd.env['xxx",
    ),
    "cmd.opts key": (
        "sdexec.exec",
        {"cmd": {**TRUE, "opts": {LARGE: 5}}, "flags": FLAGS},
        "cmd.opts.xxx",
    ),
    "property name": (
        "sdexec.exec",
        _exec(**{"SDEXEC_PROP_" + LARGE: "1"}),
        "SDEXEC_PROP_xxx",
    ),
    **{
        option: ("sdexec.exec", _exec(**{option: LARGE}), f"{option}: ")
        for option in [
            "stdin_BUFSIZE",
            "stdout_BUFSIZE",
            "stderr_BUFSIZE",
            "stdout_LINE_BUFFER",
            "stderr_LINE_BUFFER",
            "SDEXEC_NAME",
            "SDEXEC_STOP_TIMER_SEC",
            "SDEXEC_STOP_TIMER_SIGNAL",
            "SDEXEC_PROP_MemoryMax",
            "SDEXEC_PROP_MemoryHigh",
            "SDEXEC_PROP_CPUWeight",
            "SDEXEC_PROP_TimeoutStopUSec",
            "SDEXEC_PROP_KillMode",
        ]
    },
}


@pytest.mark.parametrize("field", list(HOSTILE))
def test_an_error_quoting_a_hostile_value_cuts_it_and_names_the_field(
    connection, field
):
    topic, payload, named = HOSTILE[field]
    connection.send(topic, payload)
    _errnum, errstr = error_of(connection.last())
    assert errstr.startswith(named)
    assert len(errstr) < QUOTING_BOUND


@pytest.mark.parametrize(
    "key", ["A\nB", "A\rB\x00", "A\u2028B", "A\x85B", "A\u202eB", "A\u200bB"]
)
def test_an_error_naming_a_field_by_a_hostile_key_is_one_line(connection, key):
    connection.send("sdexec.exec", {"cmd": {**TRUE, "env": {key: 5}}, "flags": FLAGS})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL
    assert errstr.splitlines() == [errstr]
    assert errstr == f"cmd.env[{key!r}]: expected a string, got 5"


# -- stdin ------------------------------------------------------------------------


@ensureDeferred
async def test_a_client_that_ignores_its_credit_gets_enospc_and_stdin_eof(
    systemd, server, connection
):
    opts = {"SDEXEC_NAME": "sdexec-flood", "stdin_BUFSIZE": "1024"}
    connection.send("sdexec.exec", {"cmd": {**TRUE, "opts": opts}, "flags": 8})
    chunk = b"x" * 4096
    for matchtag in range(100, 200):  # 400 KiB at once; the process reads none
        io = encode_io("stdin", "0", chunk)
        connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=matchtag)
    errors = [r for r in connection.responses() if "errnum" in r]
    (overrun,) = errors  # once; later writes are dropped
    assert (overrun["topic"], overrun["errnum"]) == ("sdexec.write", errno.ENOSPC)
    assert overrun["errstr"].startswith("stdin: the client overran its credit")
    refused_at = overrun["matchtag"] - 100
    stdin = systemd.process_fd("sdexec-flood.service", "stdin")
    assert await read_to_eof(stdin) == chunk * refused_at  # then EOF
    assert "sdexec-flood.service" in [p.unit_name for p in server.processes.values()]


def test_no_fds_for_the_channels_is_an_error_and_nothing_is_tabled(
    server, connection, monkeypatch
):
    def exhausted():
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("sdexec.process.socketpair_for_systemd", exhausted)
    connection.send("sdexec.exec", {"cmd": TRUE, "flags": FLAGS})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EMFILE
    # Not Python's "[Errno 24] Too many open files".
    assert errstr == "cannot start the process: Too many open files"
    assert server.processes == {}
    still_serves(server)


@pytest.mark.parametrize(
    ("opts", "option"),
    [
        ({"SDEXEC_NAME": "a b"}, "SDEXEC_NAME"),
        ({"SDEXEC_NAME": "a/b"}, "SDEXEC_NAME"),
        ({"SDEXEC_NAME": "é"}, "SDEXEC_NAME"),
        ({"SDEXEC_NAME": "x" * 248}, "SDEXEC_NAME"),  # 256 with .service
        ({"SDEXEC_NAME": "a@"}, "SDEXEC_NAME"),  # a template: no instance
        ({"SDEXEC_NAME": "@x"}, "SDEXEC_NAME"),  # no name before the @
        ({"SDEXEC_NAME": ".service"}, "SDEXEC_NAME"),
    ],
)
def test_a_unit_name_systemd_cannot_take_is_einval_before_systemd(
    server, connection, opts, option
):
    errnum, errstr = exec_refused(server, connection, {**TRUE, "opts": opts})
    assert errnum == errno.EINVAL
    assert errstr.startswith(f"{option}: ") and "is not a unit name" in errstr


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("a b", "SDEXEC_NAME: 'a b' is not a unit name systemd takes"),
        ("x" * 250, "… (250 chars) (258 characters with .service) is not a unit"),
        ("x" * 250 + ".service", "… (258 chars) is not a unit name"),
    ],
    ids=["space", "long", "long.service"],
)
def test_a_refused_unit_name_is_quoted_as_sent(server, connection, name, said):
    # Quoted with the .service the service adds, a name of 250 characters
    # read "'xxx….service' is not a unit name systemd takes: at most 255
    # characters": neither what was sent nor why it was too long.
    cmd = {**TRUE, "opts": {"SDEXEC_NAME": name}}
    errnum, errstr = exec_refused(server, connection, cmd)
    assert errnum == errno.EINVAL
    assert said in errstr and "255 characters, .service included" in errstr


def test_a_command_name_too_long_for_exec_is_named_as_the_request_field(
    server, connection
):
    # It was "executable: 1048576 bytes; ...": no field of the request.
    cmd = {**TRUE, "cmdline": ["x" * 200_000]}
    errnum, errstr = exec_refused(server, connection, cmd)
    assert errnum == errno.E2BIG
    assert errstr.startswith("cmd.cmdline[0]: 200000 bytes; Linux execs no single")


def test_the_longest_unit_name_systemd_takes_is_accepted(systemd, connection):
    name = "x" * 247  # 255 with .service
    cmd = {**TRUE, "opts": {"SDEXEC_NAME": name}}
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    assert systemd.calls[0] == ("start", f"{name}.service")


@pytest.mark.parametrize(
    "cmd",
    [
        {**TRUE, "opts": {"SDEXEC_JOBID": "f" * 1024}},  # as long as allowed
        {**TRUE, "env": {**TRUE["env"], "FLUX_JOB_ID": "f" * 300}},
    ],
)
def test_a_long_job_id_is_cut_short_in_the_unit_name(systemd, connection, cmd):
    # The uuid keeps the name unique; the id in it only informs.
    connection.send("sdexec.exec", {"cmd": cmd, "flags": FLAGS})
    (call, name) = systemd.calls[0]
    assert call == "start" and len(name) == 255
    assert name.startswith("sdexec-" + "f" * 207 + "-")


def _r_local(ranks: str, cores: str) -> str:
    R_lite = [{"rank": ranks, "children": {"core": cores}}]
    return json.dumps({"version": 1, "execution": {"R_lite": R_lite}})


def test_a_job_whose_R_names_every_id_is_started_and_others_still_served(
    server, connection, systemd
):
    # R is kept by its idsets' runs: "0-4294967293" once exhausted the
    # service's memory (one int per rank), and with it every client's jobs.
    opts = {"SDEXEC_JOBID": "f1", "SDEXEC_R_LOCAL": _r_local(EVERY_ID, EVERY_ID)}
    connection.send("sdexec.exec", {"cmd": {**TRUE, "opts": opts}, "flags": FLAGS})
    (call,) = systemd.calls
    assert call[0] == "start" and call[1].startswith("sdexec-f1-")
    still_serves(server)


def test_an_R_repeating_a_rank_is_einval_naming_both_entries(server, connection):
    R = json.loads(_r_local("0-5", "0"))
    R["execution"]["R_lite"].append({"rank": "3", "children": {}})
    errnum, errstr = exec_refused(
        server,
        connection,
        {**TRUE, "opts": {"SDEXEC_JOBID": "f2", "SDEXEC_R_LOCAL": json.dumps(R)}},
    )
    assert errnum == errno.EINVAL
    assert errstr == (
        "SDEXEC_R_LOCAL: R: execution.R_lite[1].rank: rank 3 is already in"
        " execution.R_lite[0]"
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [("SDEXEC_PROP_MemoryMax", "9" * 999_000), ("stdin_BUFSIZE", "9" * 999_990 + "K")],
)
def test_a_size_of_a_million_digits_is_einval_at_once(
    server, connection, option, value
):
    # It cost ~22 s of arithmetic on the reactor; a little longer, and a
    # decimal.Overflow dropped the connection with the requests behind it.
    errnum, errstr = exec_refused(server, connection, {**TRUE, "opts": {option: value}})
    assert errnum == errno.EINVAL and errstr.startswith(option)
    assert not connection.transport.disconnecting


@pytest.mark.parametrize(
    "R",
    [
        '{"version": 1, "execution": {"R_lite": [], "expiration": 1e999}}',
        json.dumps({"version": 1, "execution": {"R_lite": [], "expiration": 10**400}}),
        "[" * 100_000,
    ],
    ids=["infinite", "400-digit", "nested"],
)
def test_an_R_the_service_cannot_compute_with_is_einval(server, connection, R):
    # These escaped as tracebacks, or (the infinite expiration) were accepted
    # and then failed every stats request, from every client, while the job
    # ran.
    opts = {"SDEXEC_JOBID": "f3", "SDEXEC_R_LOCAL": R}
    errnum, errstr = exec_refused(server, connection, {**TRUE, "opts": opts})
    assert errnum == errno.EINVAL
    assert errstr.startswith("SDEXEC_R_LOCAL: R: ")


@pytest.mark.parametrize(
    ("cmd", "errnum", "field"),
    [
        ({"cwd": "/" + "a" * 2**20}, errno.ENAMETOOLONG, "cmd.cwd"),
        # Counted nowhere before: a 20 MiB cwd reached StartTransientUnit.
        ({"cwd": "/" + "a" * 2**20, "cmdline": ["/bin/true"]}, errno.ENAMETOOLONG,
         "cmd.cwd"),
        ({"label": "l" * 2**20}, errno.EINVAL, "cmd.label"),
        ({"opts": {"SDEXEC_NAME": "n", "SDEXEC_JOBID": "j" * 2**20}}, errno.EINVAL,
         "SDEXEC_JOBID"),
    ],
    ids=["cwd", "cwd-absolute-command", "label", "jobid"],
)  # fmt: skip
def test_what_every_list_would_repeat_or_a_path_search_join_is_bounded(
    server, connection, cmd, errnum, field
):
    # A megabyte label or job id is repeated to every client in each list
    # and stats answer; a megabyte cwd was joined to each PATH directory.
    command = {**TRUE, "env": {"PATH": ":" * 1000}, "cmdline": ["true"], **cmd}
    got_errnum, errstr = exec_refused(server, connection, command)
    assert (got_errnum, errstr.split(":")[0]) == (errnum, field)


def test_a_listed_command_line_is_cut_however_long_it_ran(server, connection):
    # Seven execs of 14 arguments of 128 KiB each made every list (and
    # stats-get) 77 MB, past the clients' own frame limit. Seven are the
    # most a unit's file holds on its one ExecStart= line.
    args = ["x" * (MAX_ARG_STRLEN - 1)] * 7
    connection.send("sdexec.exec", {"cmd": {**TRUE, "cmdline": ["/bin/true", *args]},
                                    "flags": FLAGS})  # fmt: skip
    connection.send("sdexec.list", {"detail": True}, matchtag=2)
    (entry,) = connection.last()["payload"]["procs"]
    assert len("".join(entry["cmdline"])) <= MAX_LISTED_CMDLINE + 1
    assert entry["cmdline"][-1].endswith("…")


def _fail_nth(real, nth: int):
    """``real``, except that its ``nth`` call runs out of descriptors."""
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == nth:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*args, **kwargs)

    return failing


@pytest.mark.parametrize(
    ("where", "nth"),
    [("socketpair_for_systemd", 2), ("adoptStreamConnection", 2),
     ("adoptStreamConnection", 3)],
)  # fmt: skip
@ensureDeferred
async def test_a_start_out_of_descriptors_part_way_leaves_nothing_behind(
    server, connection, systemd, monkeypatch, where, nth
):
    # Its unit's watch stayed registered: the next exec of that name was an
    # unhandled "already watched", a phantom in every list, fds leaked.
    fds_before = set(os.listdir("/proc/self/fd"))
    if where == "socketpair_for_systemd":
        real = sdexec.process.socketpair_for_systemd
        monkeypatch.setattr(
            "sdexec.process.socketpair_for_systemd", _fail_nth(real, nth)
        )
    else:
        failing = _fail_nth(reactor.adoptStreamConnection, nth)
        monkeypatch.setattr(reactor, where, failing)
    named = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-q"}}
    connection.send("sdexec.exec", {"cmd": named, "flags": FLAGS})
    assert error_of(connection.last())[0] == errno.EMFILE
    monkeypatch.undo()
    assert server.processes == {}
    await until(  # an adopted channel closes as the reactor turns
        lambda: set(os.listdir("/proc/self/fd")) <= fds_before, "its fds closed"
    )
    # Its error was its last word: no EOF of a channel closed after it.
    assert [payloads["errnum"] for payloads in connection.responses()] == [errno.EMFILE]
    connection.send("sdexec.exec", {"cmd": named, "flags": FLAGS}, matchtag=2)
    assert systemd.calls[-1] == ("start", "sdexec-q.service")
    still_serves(server)


def test_past_the_open_file_limit_s_room_an_exec_is_refused_up_front(
    systemd, server, connection, monkeypatch
):
    # At EMFILE an exec failed halfway, and accepting connections and
    # reaching systemd failed with it: refused before, naming the limit.
    in_use = len(os.listdir("/proc/self/fd"))
    # Room for two processes' descriptors (each start's six, then three).
    soft = in_use + 2 * FDS_PER_PROCESS + RESERVE + 2 * FDS_PER_PROCESS
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, soft))
    for n in range(3):
        opts = {"SDEXEC_NAME": f"sdexec-room-{n}"}
        payload = {"cmd": {**TRUE, "opts": opts}, "flags": FLAGS}
        connection.send("sdexec.exec", payload, matchtag=n + 1)
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EAGAIN
    assert errstr.startswith("too many processes: 2 held, and ")
    assert errstr.endswith(
        f" of the {soft} descriptors the service's open-file limit allows in use"
        " (raise LimitNOFILE)"
    )
    assert len(server.processes) == 2


@pytest.fixture
def no_count_from_the_kernel(monkeypatch):
    """A kernel older than 6.2: /proc/self/fd has no size, it is listed."""
    monkeypatch.setattr(sdexec.fdlimit, "_descriptors_counted", lambda: None)


def test_far_from_the_open_file_limit_nothing_is_listed(
    systemd, server, connection, monkeypatch, no_count_from_the_kernel
):
    monkeypatch.setattr(os, "listdir", None)  # would raise if called
    connection.send("sdexec.exec", {"cmd": TRUE, "flags": FLAGS})
    assert len(server.processes) == 1


def test_a_table_too_full_to_list_is_full(
    systemd, server, connection, monkeypatch, no_count_from_the_kernel
):
    # Listing /proc/self/fd takes a descriptor of its own: with none left
    # it failed, and every exec got EIO "internal error" and a traceback.
    def full(path):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "listdir", full)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (120, 120))
    connection.send("sdexec.exec", {"cmd": TRUE, "flags": FLAGS})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EAGAIN
    assert errstr.startswith("too many processes: 0 held, and 120 of the 120")
    assert server.processes == {}


def test_the_kernel_s_count_of_descriptors_is_read():
    # Linux 6.2 and later keep the number; older kernels say 0, and the
    # table is listed instead.
    counted = sdexec.fdlimit._descriptors_counted()
    release = tuple(int(n) for n in os.uname().release.split(".")[:2])
    if release >= (6, 2):
        # The listing holds a descriptor of its own while it lists.
        assert counted == len(os.listdir("/proc/self/fd")) - 1
    else:
        assert counted is None
