"""The RPC server offline: the wire protocol, framing errors, the uid check
and each handler, over an in-memory transport with sdexec.testing's fake
manager (no systemd). The same paths run against a real manager in
test_service.py; here every branch is reachable, including those a real
manager rarely takes."""

from __future__ import annotations

import errno
import os
import signal

import pytest
from offline import (
    BufferingTransport,
    Connection,
    PeerTransport,
    drained_by,
    error_of,
    read_to_eof,
    sigkill_for_stop_timer,
)
from pytest_twisted import ensureDeferred
from support import until
from test_matchtag import HeldLookups
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs, formatEvent

import sdexec.connection
import sdexec.process
from sdexec.command import Found
from sdexec.config import parse_config
from sdexec.connection import CLIENT_BUFFER_SIZE, ClientProtocol
from sdexec.containment import Containment
from sdexec.drain import AdminCause
from sdexec.ioencode import decode_io, encode_io
from sdexec.lograte import BURST, MAX_QUOTED, WINDOW_S
from sdexec.plan import plan_exec
from sdexec.process import LAZY_OUTPUT
from sdexec.protocol import ExecFlag
from sdexec.server import SdexecServer
from sdexec.systemd import SystemdError
from sdexec.systemd.unanswered import Silence
from sdexec.testing import INACTIVE, FakeManager

UNIT = "sdexec-t.service"
TRUE = {"cmdline": ["/bin/true"], "opts": {"SDEXEC_NAME": "sdexec-t"}}
FLAGS = int(ExecFlag.STDOUT | ExecFlag.STDERR)
ALL = ("stdin", "stdout", "stderr")


# -- framing and the request envelope -------------------------------------------


def test_invalid_json_is_eproto_and_the_connection_is_closed(server, connection):
    connection.protocol.dataReceived(b"{not json\n")
    assert connection.last()["errnum"] == errno.EPROTO
    assert "not valid JSON" in connection.last()["errstr"]
    assert connection.transport.disconnecting
    assert server.counters["errors"] == 1


def test_a_frame_over_the_limit_is_refused():
    config = parse_config({"sdexec": {"max-frame-size": "1M"}})
    connection = Connection(SdexecServer(FakeManager(), config, reactor))
    connection.protocol.dataReceived(b"x" * (2 << 20))
    assert connection.last()["errnum"] == errno.EPROTO
    # The key named, for the client to know what to ask an admin
    # (review session 42 H).
    assert connection.last()["errstr"].endswith(
        f"exceeds {1 << 20} bytes ([sdexec] max-frame-size)"
    )
    connection.close()


def test_a_connection_closed_for_a_protocol_error_is_logged(systemd, connection):
    # Its processes are killed as for a client that left; the service said
    # nothing, and an admin who saw jobs end so had nothing to go on
    # (review session 41 B, side note).
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    with capturedLogs() as events:
        connection.protocol.dataReceived(b"{not json\n")
    [line] = [formatEvent(e) for e in events if e["log_level"] >= LogLevel.warn]
    assert line.startswith(
        f"closing connection {connection.protocol.connection_id} of uid"
        f" {os.getuid()} for a protocol error:"
        " message is not valid JSON: "
    )
    assert line.endswith("; its 1 process(es) are killed, as for a client that left")


@pytest.mark.parametrize(
    ("message", "errnum", "text"),
    [  # (a bad matchtag ends the connection: test_matchtag.py)
        ({"type": "request", "topic": 7, "matchtag": 1}, errno.EINVAL,
         "topic: expected a string, got 7"),
        ({"type": "request", "topic": "sdexec.list", "matchtag": 1, "payload": []},
         errno.EINVAL, "payload: expected an object, got []"),
        ({"type": "request", "topic": "sdexec.nope", "matchtag": 1}, errno.ENOSYS,
         "unknown topic 'sdexec.nope'"),
        # A server with no service to reload (the service's own has one).
        ({"type": "request", "topic": "sdexec.reload", "matchtag": 1}, errno.ENOSYS,
         "unknown topic 'sdexec.reload'"),
    ],
)  # fmt: skip
def test_a_bad_envelope_is_answered_with_an_error(connection, message, errnum, text):
    connection.raw(message)
    assert error_of(connection.last()) == (errnum, text)
    assert not connection.transport.disconnecting  # the connection stays usable
    connection.send("sdexec.list", {})
    assert connection.last()["payload"]["procs"] == []


def test_another_uid_is_refused(server):
    server.owner_uid = os.getuid() + 1
    connection = Connection(server)
    connection.send("sdexec.list", {})
    assert error_of(connection.last()) == (
        errno.EPERM,
        "only the service's owner may use it (and the users of its"
        f" [sdexec] allow-users), not uid {os.getuid()}",
    )
    connection.close()


def test_a_peer_whose_uid_cannot_be_read_is_refused_saying_so(server, monkeypatch):
    def unreadable(sock):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(sdexec.connection, "peer_uid", unreadable)
    connection = Connection(server)
    assert error_of(connection.last()) == (
        errno.EPERM,
        "only the service's owner may use it (and the users of its"
        " [sdexec] allow-users), its uid could not be read",
    )
    connection.close()


def _allowing(server: SdexecServer, users: list[int]) -> None:
    """``server`` reconfigured with ``[sdexec] allow-users = users``."""
    config = parse_config({"sdexec": {"allow-users": users}})
    server.reconfigure(config, Containment(config, None))


def test_a_user_a_reload_disallows_may_ask_for_nothing_more(systemd, server):
    # Checked as it connected only, a user taken out of allow-users kept
    # running anything on the connection it held (review session 40 G1).
    server.owner_uid = os.getuid() + 1
    _allowing(server, [os.getuid()])
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    systemd.run(UNIT, pid=77)
    with capturedLogs() as events:
        _allowing(server, [])
    said = f"uid {os.getuid()} is no longer in [sdexec] allow-users: each request"
    assert [formatEvent(e) for e in events if said in formatEvent(e)]
    refusal = (
        errno.EPERM,
        f"uid {os.getuid()} is no longer in [sdexec] allow-users (a reload took"
        " it out): this connection may make no more requests",
    )
    for matchtag, (topic, payload) in enumerate(
        [("sdexec.list", {}), ("sdexec.kill", {"signum": 15, "label": "j"}),
         ("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})], start=2,
    ):  # fmt: skip
        connection.send(topic, payload, matchtag=matchtag)
        assert error_of(connection.last()) == refusal, topic
    with capturedLogs() as events:  # said once, by the reload that took it out
        _allowing(server, [])
    assert not [formatEvent(e) for e in events if said in formatEvent(e)]
    assert systemd.kills() == [] and len(server.processes) == 1  # it runs on
    _allowing(server, [os.getuid()])  # allowed again: served again
    connection.send("sdexec.kill", {"signum": 15, "label": "j"}, matchtag=5)
    assert connection.last()["payload"] == {} and systemd.kills() == [15]
    connection.close()


def test_an_exec_looked_up_across_the_reload_that_disallows_its_user_is_refused(
    systemd,
):
    # Its lookup (a file system that is slow to answer) outlasted the reload
    # that took its user out of allow-users, and the exec then started a
    # process for a user the site no longer lets run anything.
    lookups = HeldLookups()
    server = SdexecServer(
        systemd, parse_config({}), reactor, clock=Clock(), lookups=lookups
    )
    server.owner_uid = os.getuid() + 1
    _allowing(server, [os.getuid()])
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    [looking_up] = lookups.waiting
    _allowing(server, [])
    looking_up.callback(Found("/bin/true", None))
    assert systemd.units == {} and server.processes == {}
    assert error_of(connection.last()) == (
        errno.EPERM,
        f"uid {os.getuid()} is no longer in [sdexec] allow-users (a reload took"
        " it out): this connection may make no more requests",
    )
    connection.close()


def test_a_kill_held_for_a_process_whose_user_is_revoked_too_is_not_sent(
    systemd, server, monkeypatch
):
    # One reload took out both the user whose process was starting and the
    # one whose kill waited for that start: the process's own user was not
    # the other's, and the kill went out once the process started.
    starter, killer = os.getuid(), os.getuid() + 2
    server.owner_uid = os.getuid() + 1
    _allowing(server, [starter, killer])
    monkeypatch.setattr(sdexec.connection, "peer_uid", lambda sock: starter)
    starting = Connection(server)
    starting.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    monkeypatch.setattr(sdexec.connection, "peer_uid", lambda sock: killer)
    killing = Connection(server)
    killing.send("sdexec.kill", {"signum": 15, "label": "j"})
    assert killing.responses() == []  # held for the start, sent already
    _allowing(server, [])
    assert error_of(killing.last()) == (
        errno.EPERM,
        f"uid {killer} is no longer in [sdexec] allow-users (a reload took it"
        " out): its signal 15, held until the process started, is not sent",
    )
    systemd.run(UNIT, pid=77)
    assert systemd.kills() == []
    starting.close()
    killing.close()


def test_only_the_owner_may_undrain(server):
    # A user of allow-users whose job left unkillable processes, or ran
    # outside its fence, could undrain the node and run the next one there.
    server.owner_uid = os.getuid() + 1
    _allowing(server, [os.getuid()])
    server.drain("fence broken", AdminCause.FENCE)
    connection = Connection(server)
    connection.send("sdexec.undrain", {})
    assert error_of(connection.last()) == (
        errno.EPERM,
        f"sdexec.undrain: only the service's owner (uid {os.getuid() + 1}) may"
        f" undrain it, not uid {os.getuid()}",
    )
    connection.send("sdexec.stats-get", {}, matchtag=2)
    assert connection.last()["payload"]["drain"] == drained_by("fence broken", "fence")
    connection.close()
    server.owner_uid = os.getuid()  # the owner's undrain clears it
    connection = Connection(server)
    connection.send("sdexec.undrain", {})
    assert connection.last()["payload"]["cleared"] == ["fence broken"]
    connection.close()


def test_debug_turned_on_by_a_reload_shows_the_units_already_running(
    systemd, server, connection
):
    # The unit stuck now is why an admin turns it on: it was read once, as
    # each process started (review session 40 G5; Flux's sdexec reads it
    # at each log).
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    config = parse_config({"systemd": {"sdexec-debug": True}})
    server.reconfigure(config, Containment(config, None))
    with capturedLogs() as events:
        systemd.run(UNIT, pid=77)
    lines = [formatEvent(event) for event in events]
    assert f"{UNIT}: active.running pid 77" in lines, lines


def test_debug_logs_one_readable_line_a_unit_state_change(systemd, server, connection):
    # Each signal logged a line, UnitStatus(active_state='active', ...), at
    # info: the same state three times over as the Unit and Service
    # interfaces signalled apart, or a timestamp changed.
    config = parse_config({"systemd": {"sdexec-debug": True}})
    server.reconfigure(config, Containment(config, None))
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    with capturedLogs() as events:
        systemd.run(UNIT)
        systemd.run(UNIT)
        systemd.change(UNIT, {"ExecMainStartTimestamp": 1})
        systemd.exit(UNIT, status=3)
        systemd.exit(UNIT, status=3)
    said = [event for event in events if event["log_namespace"] == "sdexec.process"]
    assert [formatEvent(event) for event in said] == [
        f"{UNIT}: active.running pid 4242",
        f"{UNIT}: active.exited pid 4242 exited 3",
    ]
    assert {event["log_level"] for event in said} == {LogLevel.debug}


def test_unreadable_credentials_are_refused(server):
    connection = Connection.__new__(Connection)
    connection.transport = PeerTransport()
    connection.transport.handle.close()  # SO_PEERCRED fails: EBADF
    connection.protocol = ClientProtocol(server)
    connection.protocol.makeConnection(connection.transport)
    connection.send("sdexec.list", {})
    assert connection.last()["errnum"] == errno.EPERM
    connection.close()


# -- list, stats, undrain --------------------------------------------------------


def test_list_stats_and_undrain(server, connection):
    connection.send("sdexec.list", {})
    assert connection.last()["payload"] == {"rank": 0, "procs": []}
    server.drain("fence broken", AdminCause.FENCE)
    connection.send("sdexec.stats-get", {}, matchtag=2)
    stats = connection.last()["payload"]
    assert stats["drain"] == drained_by("fence broken", "fence")
    assert stats["requests"] == {"sdexec.list": 1, "sdexec.stats-get": 1}
    connection.send("sdexec.undrain", {}, matchtag=3)
    assert connection.last()["payload"] == {
        "reason": "fence broken",
        "cleared": ["fence broken"],
    }
    assert server.drain_reason is None


def test_stats_tell_the_manager_s_calls_unanswered(systemd, server, connection):
    # A wedged manager answers nothing and is not lost: the stats say
    # what waits for it, and since when.
    connection.send("sdexec.stats-get", {})
    assert connection.last()["payload"]["systemd"] == {
        "connected": True,
        "version": systemd.version,
        "calls": {"unanswered": 0, "queued": 0, "oldest": None},
    }
    systemd.silent = Silence("StartTransientUnit", 31.5, 2)
    connection.send("sdexec.stats-get", {}, matchtag=2)
    calls = connection.last()["payload"]["systemd"]["calls"]
    assert calls["oldest"] == {"call": "StartTransientUnit", "seconds": 31.5}


def test_a_list_entry_has_upstream_s_fields_alone_unless_detail_is_asked(
    systemd, server, connection
):
    # Flux's subprocess servers list {pid, cmd, label, state}, and its
    # Python client makes a dataclass of exactly those keys: sdexec's own
    # beside them (cmdline, unit, mode) made it fail with a TypeError.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=99)
    connection.send("sdexec.list", {}, matchtag=2)
    (listed,) = connection.last()["payload"]["procs"]
    assert listed == {"pid": 99, "cmd": "/bin/true", "label": "", "state": "R"}
    connection.send("sdexec.list", {"detail": True}, matchtag=3)
    (listed,) = connection.last()["payload"]["procs"]
    assert listed["cmdline"] == ["/bin/true"] and listed["mode"] == "streaming"
    connection.send("sdexec.list", {"detail": 1}, matchtag=4)
    assert error_of(connection.last()) == (
        errno.EINVAL,
        "detail: expected true or false, got 1",
    )


def test_stats_tell_a_unit_stuck_deactivating(systemd, server, connection):
    # list stays RFC 42's; stats add systemd's state and the stop timer, as
    # Flux's sdexec stats show a unit's ActiveState.SubState.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=99)
    systemd.deactivate(UNIT)
    connection.send("sdexec.stats-get", {}, matchtag=2)
    (proc,) = connection.last()["payload"]["procs"]
    assert proc["unit-state"] == "deactivating.stop-sigterm"
    assert proc["stop-timer"]["state"] == "armed"
    connection.send("sdexec.list", {}, matchtag=3)
    (listed,) = connection.last()["payload"]["procs"]
    assert "unit-state" not in listed and "stop-timer" not in listed


# -- exec --------------------------------------------------------------------------


def test_exec_streams_started_finished_then_enodata(systemd, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert ("start", UNIT) in systemd.calls
    systemd.run(UNIT, pid=99)
    systemd.exit(UNIT, status=3)
    payloads = [r.get("payload") for r in connection.responses()]
    assert payloads == [
        {"type": "started", "pid": 99},
        {"type": "finished", "status": 3 << 8},
    ]
    assert ("stop", UNIT) in systemd.calls
    connection.send("sdexec.list", {"detail": True}, matchtag=2)
    (proc,) = connection.last()["payload"]["procs"]
    assert (proc["pid"], proc["unit"], proc["state"]) == (99, UNIT, "Z")


@pytest.mark.parametrize(
    ("payload", "errnum", "text"),
    [
        ({"flags": 64, "cmd": TRUE}, errno.EINVAL, "flags: expected an integer"),
        ({"flags": True, "cmd": TRUE}, errno.EINVAL, "flags: expected an integer"),
        ({"flags": FLAGS, "cmd": {}}, errno.EINVAL, "cmd.cmdline"),
        # Each names the field that asked: the same words for both told the
        # client neither which to drop.
        ({"flags": FLAGS | 4, "cmd": TRUE},
         errno.EINVAL, "flags: channel (4): auxiliary channels are not supported"),
        ({"flags": FLAGS, "cmd": {**TRUE, "channels": ["AUX"]}},
         errno.EINVAL, "cmd.channels: auxiliary channels are not supported"),
        ({"flags": FLAGS, "cmd": {"cmdline": ["no-such-cmd-here"], "env": {}}},
         errno.ENOENT, "no-such-cmd-here: command not found"),
        # An empty name named nothing, as EACCES (each PATH directory
        # joined to "" is a directory): execvp("") is ENOENT, bash's 127.
        ({"flags": FLAGS, "cmd": {"cmdline": [""], "env": {}}},
         errno.ENOENT, '"": command not found'),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SEC": "x"}}},
         errno.EINVAL, "SDEXEC_STOP_TIMER_SEC: 'x' is not a decimal integer"),
        # int() took these as 1 and 10; a unit property's integer never did.
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SEC": "\uff11"}}},
         errno.EINVAL, "SDEXEC_STOP_TIMER_SEC: '\uff11' is not a decimal integer"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SEC": "1_0"}}},
         errno.EINVAL, "SDEXEC_STOP_TIMER_SEC: '1_0' is not a decimal integer"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SEC": "-1"}}},
         errno.EPERM, "SDEXEC_STOP_TIMER_SEC: a request may set from 1 to 640"
         " seconds (exec.sdexec-stop-timer-sec), not -1"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SEC": "641"}}},
         errno.EPERM, "SDEXEC_STOP_TIMER_SEC: a request may set from 1 to 640"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SEC": "0"}}},
         errno.EINVAL, "SDEXEC_STOP_TIMER_SEC: a request may set from 1 to 640"),
        ({"flags": FLAGS,
          "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SIGNAL": "SIGNOPE"}}},
         errno.EINVAL, "SDEXEC_STOP_TIMER_SIGNAL: "),
        # SIGCONT for the site's signal: what lingers ran on, and the node
        # drained for everyone (review session 31 B F2, C F3).
        ({"flags": FLAGS,
          "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SIGNAL": "SIGCONT"}}},
         errno.EPERM, "SDEXEC_STOP_TIMER_SIGNAL: a request may only repeat the"
         " configured SIGUSR1 (exec.sdexec-stop-timer-signal), not SIGCONT"),
        ({"flags": FLAGS,
          "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SIGNAL": "KILL"}}},
         errno.EPERM, "SDEXEC_STOP_TIMER_SIGNAL: a request may only repeat"),
        # An SDEXEC_ option sdexec does not read was ignored, as upstream
        # ignores it: a typo left the site's stop timer in force unseen.
        ({"flags": FLAGS,
          "cmd": {**TRUE, "opts": {"SDEXEC_STOP_TIMER_SIGNALL": "10"}}},
         errno.EINVAL, "SDEXEC_STOP_TIMER_SIGNALL: not an sdexec option"
         " (did you mean SDEXEC_STOP_TIMER_SIGNAL?)"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_SIGNAL": "99"}}},
         errno.EINVAL, "SDEXEC_SIGNAL: not an sdexec option"
         " (did you mean SDEXEC_STOP_TIMER_SIGNAL?)"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"sdexec_name": "a"}}},
         errno.EINVAL, "sdexec_name: not an sdexec option"
         " (did you mean SDEXEC_NAME?)"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_prop_Nice": "5"}}},
         errno.EINVAL, "SDEXEC_prop_Nice: not an sdexec option"
         " (did you mean SDEXEC_PROP_Nice?)"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"SDEXEC_": "x"}}},
         errno.EINVAL, "SDEXEC_: not an sdexec option (sdexec's are"
         " SDEXEC_PROP_<Name>, SDEXEC_NAME, SDEXEC_JOBID, SDEXEC_TIME_LIMIT,"
         " SDEXEC_STOP_TIMER_SEC, SDEXEC_STOP_TIMER_SIGNAL, SDEXEC_R_LOCAL,"
         " SDEXEC_TEST_EXPECTED_CPUS)"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stdout_BUFSIZE": "4095"}}},
         errno.EINVAL,
         "stdout_BUFSIZE: '4095' is 4095 bytes; must be from 4096 bytes to "),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stdin_BUFSIZE": "0"}}},
         errno.EINVAL, "stdin_BUFSIZE: '0' is 0 bytes; must be from 1 byte to "),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stdin_BUFSIZE": "lots"}}},
         errno.EINVAL, "stdin_BUFSIZE: "),
        # Flux's parse_size takes "k" alone in lower case ("m" is milli).
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stdout_BUFSIZE": "1m"}}},
         errno.EINVAL, "stdout_BUFSIZE: '1m' is not a size (a number (decimal,"
         " 0x hex, 0 octal or floating point), alone or with k, K, M, G, T, P or E)"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stderr_BUFSIZE": "17E"}}},
         errno.EINVAL, "stderr_BUFSIZE: '17E' is too large (16E or more)"),
        # a hex float past a double: float.fromhex's OverflowError escaped
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stdout_BUFSIZE": "0x1p1024"}}},
         errno.EINVAL, "stdout_BUFSIZE: '0x1p1024' is too large (16E or more)"),
        # 16 MiB of NULs is a 96 MiB line: the client dropped the connection.
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stdout_BUFSIZE": "16M"}}},
         errno.EINVAL, "stdout_BUFSIZE: '16M' is 16777216 bytes; must be from 4096"
         " bytes to 11173888 bytes:"
         " one response a client reads, at most 67108864 bytes, holds that much"
         " as JSON"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stdin_BUFSIZE": "16M"}}},
         errno.EINVAL, "stdin_BUFSIZE: '16M' is 16777216 bytes; must be from 1 byte to"
         " 11173888 bytes:"
         " one request ([sdexec] max-frame-size), at most 67108864 bytes"),
        ({"flags": FLAGS, "cmd": {**TRUE, "opts": {"stderr_LINE_BUFFER": "maybe"}}},
         errno.EINVAL, "stderr_LINE_BUFFER: 'maybe' is not a boolean"),
        ({"flags": FLAGS,
          "cmd": {**TRUE, "opts": {"SDEXEC_PROP_CPUWeight": "heavy"}}},
         errno.EINVAL, "SDEXEC_PROP_CPUWeight: 'heavy' is not a weight"),
        # RFC 42's local_flags went unread: a string passed.
        ({"flags": FLAGS, "cmd": TRUE, "local_flags": "x"},
         errno.EINVAL, 'local_flags: expected an integer >= 0, got "x"'),
        # A signed request ran from its unsigned fields, the signature
        # unread: RFC 42 has a server without flux-security say EPERM.
        ({"flags": FLAGS, "cmd": TRUE, "signature": "not.a.signature"},
         errno.EPERM, "signature: signed requests are not supported"),
        ({"signature": "only.this"},
         errno.EPERM, "signature: signed requests are not supported"),
    ],
)  # fmt: skip
def test_a_bad_exec_request_names_what_is_wrong(
    systemd, connection, payload, errnum, text
):
    connection.send("sdexec.exec", payload)
    response = connection.last()
    assert response["errnum"] == errnum
    assert text in response["errstr"]
    assert systemd.calls == []  # nothing reached systemd


@pytest.mark.parametrize(
    ("text", "size"),
    [("0x1000", 4096), ("1e4", 10_000), ("010K", 8192), (" 4.5k", 4608)],
)
def test_a_bufsize_is_read_as_flux_reads_it(text, size):
    # Flux's parse_size takes hex, octal and floating point: sdexec refused
    # "0x1000" and "1e3", which Flux's own sdexec and subprocess server take.
    config = parse_config({})
    opts = {**TRUE["opts"], **{f"{s}_BUFSIZE": text for s in ALL}}
    payload = {"flags": FLAGS, "cmd": {**TRUE, "opts": opts}}
    plan = plan_exec(payload, config, Containment(config, None))
    assert plan.stdin_bufsize == size
    assert [plan.output[s].bufsize for s in ("stdout", "stderr")] == [size, size]


def test_exec_is_refused_while_drained(server, connection):
    server.drain("fence broken", AdminCause.FENCE)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (
        errno.EIO,
        "node is drained: fence broken (sdexec undrain clears it)",
    )


def test_processes_past_max_processes_are_refused(systemd):
    # Only the open-file limit bounded them (about 174,000 at 524,288),
    # each holding its command, partial lines and stdin in the service.
    config = parse_config({"sdexec": {"max-processes": 2}})
    server = SdexecServer(systemd, config, reactor, clock=Clock())
    connection = Connection(server)
    for matchtag in (1, 2, 3):
        cmd = {"cmdline": ["/bin/true"], "opts": {"SDEXEC_NAME": f"p{matchtag}"}}
        connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag)
    assert error_of(connection.last()) == (
        errno.EAGAIN,
        "too many processes: 2 tabled, the most [sdexec] max-processes allows",
    )
    assert [call for call in systemd.calls if call[0] == "start"] == [
        ("start", "p1.service"),
        ("start", "p2.service"),
    ]
    connection.close()


def test_a_matchtag_in_use_is_eexist(connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (errno.EEXIST, "matchtag 1 is already in use")


def test_systemds_refusal_becomes_the_streams_error(systemd):
    systemd.refuse_start = SystemdError(
        "org.freedesktop.DBus.Error.InvalidArgs", "Invalid argument"
    )
    config = parse_config({"sdexec": {"request-properties": ["KeyringMode"]}})
    server = SdexecServer(systemd, config, reactor, clock=Clock())
    connection = Connection(server)
    opts = {**TRUE["opts"], "SDEXEC_PROP_KeyringMode": "bogus"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "opts": opts}})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL
    assert "KeyringMode=bogus" in errstr
    assert server.processes == {}
    connection.close()


@pytest.mark.parametrize(
    ("version", "named"),
    [("245.4-4ubuntu3", True), (None, True), ("248", False), ("252", False)],
)
def test_an_environment_an_old_systemd_refuses_names_the_variable(
    systemd, version, named
):
    # systemd before 248 refuses a whole unit for one control character in
    # one value (ESC, as a dotfile's LESS_TERMCAP_md holds), naming nothing;
    # a newer one takes them, and its refusal has another cause.
    systemd.version = version
    systemd.refuse_start = SystemdError(
        "org.freedesktop.DBus.Error.InvalidArgs", "Invalid environment block."
    )
    server = SdexecServer(systemd, parse_config({}), reactor, clock=Clock())
    connection = Connection(server)
    env = {"PATH": "/usr/bin:/bin", "LESS_TERMCAP_md": "\x1b[01;31m", "TAB": "a\tb"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "env": env}})
    why = (
        " (LESS_TERMCAP_md has a control character in its value, which systemd"
        " before 248 refuses)"
    )
    assert error_of(connection.last()) == (
        errno.EINVAL,
        "Invalid environment block." + (why if named else ""),
    )
    connection.close()


def test_the_write_credit_flag_grants_the_stdin_buffer_first(connection):
    flags = FLAGS | ExecFlag.WRITE_CREDIT
    opts = {**TRUE["opts"], "stdin_BUFSIZE": "1024"}
    connection.send("sdexec.exec", {"flags": int(flags), "cmd": {**TRUE, "opts": opts}})
    assert connection.last()["payload"] == {
        "type": "add-credit",
        "channels": {"stdin": 1024},
    }


# -- write, kill ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        ({"matchtag": "1", "io": {}}, 'matchtag: expected an integer, got "1"'),
        ({"matchtag": 1, "io": []}, "io: expected an object, got []"),
        ({"matchtag": 1, "io": encode_io("stdout", "0", b"x")},
         'io.stream: "stdout" is not stdin'),
        # Python's codec message named no field, and counted code points.
        ({"matchtag": 1, "io": {"stream": "stdin", "rank": "0", "data": "ab\ud800"}},
         "io.data: not valid Unicode text: lone surrogate U+D800 at 2"),
    ],
)  # fmt: skip
def test_a_bad_write_is_einval(connection, payload, text):
    connection.send("sdexec.write", payload, matchtag=9)
    assert error_of(connection.last()) == (errno.EINVAL, text)


def test_a_write_to_no_process_is_dropped_silently(connection):
    io = encode_io("stdin", "0", b"lost", eof=True)
    connection.send("sdexec.write", {"matchtag": 5, "io": io}, matchtag=9)
    assert connection.responses() == []


@ensureDeferred
async def test_a_write_reaches_the_process_stdin(systemd, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    io = encode_io("stdin", "0", b"hello\n", eof=True)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=9)
    stdin = systemd.process_fd(UNIT, "stdin")
    assert await read_to_eof(stdin) == b"hello\n"


def _write(io: object, matchtag: int = 9, **payload: object) -> dict:
    """An ``sdexec.write`` request to exec 1's stdin."""
    return {
        "type": "request",
        "topic": "sdexec.write",
        "matchtag": matchtag,
        "payload": {"matchtag": 1, "io": io, **payload},
    }


BAD_BASE64 = {"stream": "stdin", "rank": "0", "data": "!!!", "encoding": "base64"}


def _refuse_for_descriptors(connection, message: dict) -> None:
    connection.protocol.descriptorsRefused(message, "unexpected descriptors")


@pytest.mark.parametrize(
    ("message", "errnum", "deliver"),
    [
        (_write(BAD_BASE64), errno.EINVAL, None),
        (_write(BAD_BASE64, matchtag=0), None, None),  # refused silently
        (_write(encode_io("stdout", "0", b"x")), errno.EINVAL, None),
        (_write([]), errno.EINVAL, None),
        (_write({"stream": "stdin", "rank": "0"}), errno.EINVAL, None),
        (_write(encode_io("stdin", "0", b"x"), signature="s"), errno.EPERM, None),
        (_write(encode_io("stdin", "0", b"x")), errno.EPROTO, _refuse_for_descriptors),
    ],
)  # fmt: skip
@ensureDeferred
async def test_a_refused_write_closes_stdin_after_what_came_before(
    systemd, server, connection, message, errnum, deliver
):
    # The clients send nothing more to a stdin once a write to it is
    # refused, its EOF neither (the write's data and all after it are
    # dropped): only an overrun closed stdin, and a process reading it
    # (cat) waited for ever.
    flags = int(FLAGS | ExecFlag.WRITE_CREDIT)
    connection.send("sdexec.exec", {"flags": flags, "cmd": TRUE})
    systemd.run(UNIT, pid=42)
    connection.raw(_write(encode_io("stdin", "0", b"before\n")))
    (deliver or Connection.raw)(connection, message)
    connection.raw(_write(encode_io("stdin", "0", b"after\n")))  # dropped
    refusals = [error_of(r)[0] for r in connection.responses() if "errnum" in r]
    assert refusals == ([] if errnum is None else [errnum])
    assert await read_to_eof(systemd.process_fd(UNIT, "stdin")) == b"before\n"
    assert [p.unit_name for p in server.processes.values()] == [UNIT]  # runs on


@ensureDeferred
async def test_the_matchtag_of_a_stream_ended_while_its_unit_lingers_is_free(
    systemd, server, connection
):
    # EDEADLK (abandoned) ends the request, its unit lingering: a new exec
    # on that matchtag got EEXIST, and a write on it went to the old
    # unit's stdin.
    old = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-t", "SDEXEC_STOP_TIMER_SEC": "1"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": old})
    systemd.run(UNIT)
    systemd.exit(UNIT)
    systemd.deactivate(UNIT)  # a child ignores the stop's SIGTERM
    server.clock.advance(1)
    server.clock.advance(1)
    assert error_of(connection.last())[0] == errno.EDEADLK
    server.undrain()
    answered = len(connection.responses())
    new = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-u"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": new})
    io = encode_io("stdin", "0", b"for the new one\n", eof=True)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    assert len(connection.responses()) == answered  # no EEXIST
    assert await read_to_eof(systemd.process_fd("sdexec-u.service", "stdin")) == (
        b"for the new one\n"
    )
    # Nothing reached the old one: its stdin ended with its request.
    assert await read_to_eof(systemd.process_fd(UNIT, "stdin")) == b""
    systemd.release(UNIT)  # the lingering child is gone at last
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    await until(lambda: len(server.processes) == 1, "the old one reaped")
    assert list(server.processes) == [(connection.protocol.connection_id, 1)]


def test_stdin_credit_is_bounded_by_the_connection_s_own_frame(connection):
    # A connection keeps the max-frame-size it was made with: one made under
    # 1M was granted 2 MiB of credit after a reload to 64M, and a write
    # within it was a framing error that ended the connection.
    connection.protocol.max_frame = 1024 * 1024
    cmd = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-t", "stdin_BUFSIZE": "2M"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL
    assert errstr.startswith(
        "stdin_BUFSIZE: '2M' is 2097152 bytes; must be from 1 byte to 163840 bytes"
    )


@ensureDeferred
async def test_a_client_without_credit_is_slowed_not_refused(systemd, connection):
    # RFC 42 makes credit optional (upstream sdexec takes no flag 8): a
    # write of over 16 KiB was refused with ENOSPC, stdin closed, and sent
    # as Flux sends it (matchtag 0) the loss was silent.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    data = bytes(range(256)) * 4096  # 1 MiB
    io = encode_io("stdin", "0", data, eof=True)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    protocol = connection.protocol
    assert protocol._holding  # nothing more is read meanwhile
    connection.send("sdexec.list", {}, matchtag=5)
    assert connection.responses() == []
    assert await read_to_eof(systemd.process_fd(UNIT, "stdin")) == data
    await until(lambda: connection.responses(), "the list answered once drained")
    assert connection.last()["matchtag"] == 5 and not protocol._holding


@ensureDeferred
async def test_a_stream_that_ends_drops_its_stdin_backlog(systemd, server, connection):
    # Declared unkillable (the unit lingers, its stdin never read), the
    # backlog kept the connection from reading any request for ever.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=4242)
    io = encode_io("stdin", "0", b"x" * (1024 * 1024), eof=False)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    assert connection.protocol._holding
    (process,) = server.processes.values()
    process.unkillable("unit would not die")
    connection.send("sdexec.list", {}, matchtag=5)
    await until(lambda: connection.last().get("matchtag") == 5, "the list answered")


def _output_ended(connection) -> bool:
    """Both output streams have sent their EOF."""
    payloads = [r["payload"] for r in connection.responses() if "payload" in r]
    eofs = [decode_io(p["io"]) for p in payloads if p.get("type") == "output"]
    return sum(eof for _, _, eof in eofs) == 2


def _finished(connection) -> bool:
    return any(
        r.get("payload", {}).get("type") == "finished" for r in connection.responses()
    )


@ensureDeferred
async def test_a_process_that_exited_drops_its_stdin_backlog(
    systemd, server, connection
):
    # Its main process gone without reading, a child lingering on its unit:
    # the backlog held the connection's every request for the stop timer.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=4242)
    io = encode_io("stdin", "0", b"x" * (1024 * 1024), eof=True)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    assert connection.protocol._holding
    systemd.exit(UNIT)
    await until(lambda: _finished(connection), "finished sent")
    systemd.deactivate(UNIT)  # lingers
    connection.send("sdexec.list", {}, matchtag=5)
    await until(lambda: connection.last().get("matchtag") == 5, "the list answered")


@ensureDeferred
async def test_a_write_after_finished_does_not_backlog(systemd, server, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=4242)
    systemd.exit(UNIT)
    await until(lambda: _finished(connection), "finished sent")
    systemd.deactivate(UNIT)
    io = encode_io("stdin", "0", b"x" * (1024 * 1024), eof=False)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    assert not connection.protocol._holding
    connection.send("sdexec.list", {}, matchtag=5)
    assert connection.last().get("matchtag") == 5


@ensureDeferred
async def test_a_write_after_finished_reaches_a_process_left_in_its_unit(
    systemd, connection
):
    # Until the stream's end, as Flux's sdexec writes to a unit's stdin
    # until the unit is gone; protocol.md said writes to a process that
    # had exited were dropped (review session 51).
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=4242)
    systemd.exit(UNIT)
    await until(lambda: _finished(connection), "finished sent")
    systemd.deactivate(UNIT)  # a child lingers, reading its stdin
    io = encode_io("stdin", "0", b"late\n", eof=True)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    assert await read_to_eof(systemd.process_fd(UNIT, "stdin")) == b"late\n"


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        (
            {"signum": 0, "pid": 1},
            f"signum: expected a signal number from 1 to {signal.NSIG - 1}, got 0",
        ),
        (
            {"signum": "15", "pid": 1},
            f'signum: expected a signal number from 1 to {signal.NSIG - 1}, got "15"',
        ),
        ({"signum": 15, "pid": "1"}, 'pid: expected an integer, got "1"'),
        ({"signum": 15, "label": 3}, "label: expected a string, got 3"),
        ({"signum": 15}, "kill needs a pid or a label"),
    ],
)
def test_a_bad_kill_is_einval(connection, payload, text):
    connection.send("sdexec.kill", payload)
    assert error_of(connection.last()) == (errno.EINVAL, text)


def test_kill_by_pid_or_label(systemd, connection):
    cmd = {**TRUE, "label": "job"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd})
    systemd.run(UNIT, pid=77)
    connection.send("sdexec.kill", {"signum": 10, "pid": 77}, matchtag=2)
    connection.send("sdexec.kill", {"signum": 12, "label": "job"}, matchtag=3)
    assert systemd.kills() == [10, 12]
    assert connection.responses()[-2:] == [
        {"type": "response", "topic": "sdexec.kill", "matchtag": 2, "payload": {}},
        {"type": "response", "topic": "sdexec.kill", "matchtag": 3, "payload": {}},
    ]
    connection.send("sdexec.kill", {"signum": 15, "pid": 5}, matchtag=4)
    assert error_of(connection.last()) == (errno.ESRCH, "kill pid=5 not found")


def test_a_kill_signals_the_main_process_unless_all_are_asked_for(systemd, connection):
    # RFC 42 signals "a remote process", and Flux's sdexec its unit's main
    # one: a job shell forwards to its tasks itself, which got each signal
    # twice when every process of the unit was signalled by default
    # (review session 32 P F1).
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    connection.send("sdexec.kill", {"signum": 2, "label": "j"}, 2)
    systemd.run(UNIT)  # held for the start, with its target
    connection.send("sdexec.kill", {"signum": 15, "label": "j", "who": "all"}, 3)
    connection.send("sdexec.kill", {"signum": 1, "label": "j", "who": "main"}, 4)
    kills = [call for call in systemd.calls if call[0] == "kill"]
    assert kills == [("kill", "main", 2), ("kill", "all", 15), ("kill", "main", 1)]
    connection.send("sdexec.kill", {"signum": 15, "label": "j", "who": "x"}, 4)
    assert error_of(connection.last()) == (
        errno.EINVAL,
        'who: expected "all" or "main", got "x"',
    )


def test_a_kill_naming_a_label_ignores_its_pid(systemd, connection):
    # RFC 42: with a label, the pid SHALL be ignored (Flux's client sends
    # pid -1 with it; another pid must not pick another process).
    first, second = "sdexec-first.service", "sdexec-second.service"
    for matchtag, name in enumerate((first, second), start=1):
        opts = {"SDEXEC_NAME": name}
        cmd = {**TRUE, "label": name.split(".")[0], "opts": opts}
        connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag)
    systemd.run(first, pid=71)
    systemd.run(second, pid=72)
    kill = {"signum": 15, "pid": 71, "label": "sdexec-second"}
    connection.send("sdexec.kill", kill, matchtag=3)
    assert systemd.signalled == [(second, 15)]
    connection.send("sdexec.kill", {**kill, "label": "nosuch"}, matchtag=4)
    assert error_of(connection.last()) == (errno.ESRCH, "kill label=nosuch not found")
    assert systemd.signalled == [(second, 15)]


def test_a_label_names_one_process(systemd, connection):
    cmd = {**TRUE, "label": "job"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd})
    other = {**cmd, "opts": {"SDEXEC_NAME": "sdexec-other.service"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": other}, matchtag=2)
    in_use = (
        errno.EEXIST,
        "label 'job' is already in use by a process not started yet of the"
        f" service's owner, uid {os.getuid()}",
    )
    assert error_of(connection.last()) == in_use
    assert ("start", "sdexec-other.service") not in systemd.calls


def test_an_empty_label_is_refused(connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": ""}})
    assert error_of(connection.last()) == (
        errno.EINVAL,
        'cmd.label: expected a non-empty string, got ""',
    )


def test_a_kill_before_the_start_is_answered_once_the_signal_is_sent(
    systemd, connection
):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    connection.send("sdexec.kill", {"signum": 9, "label": "j"}, matchtag=2)
    assert systemd.kills() == []
    assert [r for r in connection.responses() if r["matchtag"] == 2] == []
    systemd.run(UNIT)
    assert systemd.kills() == [9]
    assert connection.last() == {
        "type": "response", "topic": "sdexec.kill", "matchtag": 2, "payload": {}
    }  # fmt: skip


def test_a_kill_of_a_process_that_never_starts_is_esrch(systemd, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    connection.send("sdexec.kill", {"signum": 9, "label": "j"}, matchtag=2)
    failed_to_exec = {"ActiveState": "failed", "ExecMainCode": 1, "ExecMainStatus": 203}
    systemd.change(UNIT, {**failed_to_exec, "Result": "exit-code"})
    [answer] = [r for r in connection.responses() if r["matchtag"] == 2]
    assert error_of(answer) == (errno.ESRCH, "the process never started")
    assert systemd.kills() == []


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("status", [203, 200, 243])
@ensureDeferred
async def test_a_fast_exit_of_systemd_s_codes_after_output_is_the_command_s(
    systemd, connection, stream, status
):
    # `echo "mytool: bad option" >&2; exit 243` (a C main's -EACCES) seldom
    # shows *running*: taken for systemd failing to run it, its output was
    # discarded and it ended ENOENT (review session 41 B1). systemd writes
    # nothing to a unit it failed to start, so output proves it ran.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    os.write(systemd.process_fd(UNIT, stream), b"mytool: bad option\n")
    exited = {"ActiveState": "failed", "SubState": "failed", "ExecMainPID": 4242}
    systemd.change(
        UNIT,
        {**exited, "ExecMainCode": 1, "ExecMainStatus": status, "Result": "exit-code"},
    )
    systemd.release(UNIT)
    await until(lambda: _output_ended(connection), "both EOFs sent")
    systemd.change(UNIT, INACTIVE)
    payloads = [r["payload"] for r in connection.responses() if "payload" in r]
    kinds = [p["type"] for p in payloads]
    assert kinds[0] == "started" and "finished" in kinds
    [finished] = [p for p in payloads if p["type"] == "finished"]
    assert finished["status"] == status << 8
    written = [decode_io(p["io"]) for p in payloads if p["type"] == "output"]
    assert b"".join(data for name, data, _ in written if name == stream) == (
        b"mytool: bad option\n"
    )
    assert error_of(connection.last())[0] == errno.ENODATA


def test_a_refused_write_without_a_matchtag_gets_no_response(systemd, connection):
    # Matchtag 0: Flux's "no response"; an error there would read as the
    # service closing the connection.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    before = len(connection.responses())
    io = encode_io("stdout", "0", b"x")
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=-1)
    connection.raw({"type": "request", "topic": "sdexec.write", "matchtag": "x"})
    assert len(connection.responses()) == before
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=7)
    assert error_of(connection.last()) == (
        errno.EINVAL,
        'io.stream: "stdout" is not stdin',
    )


@pytest.mark.parametrize("field", ["stream", "encoding"])
def test_a_refused_write_quotes_a_huge_value_briefly(connection, field):
    # The value was quoted whole: cut at 4096 when answered, which lost
    # what was wrong with it, and whole (megabytes) in the log line of a
    # refusal without a matchtag.
    io = {"stream": "stdin", "rank": "0", "data": "", field: "x" * 5_000_000}
    connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=7)
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EINVAL
    assert errstr.startswith(f'io.{field}: "xxx')
    assert errstr.endswith(
        "… (5000000 chars) is not "
        + ("stdin" if field == "stream" else "UTF-8 or base64")
    )
    with capturedLogs() as events:
        connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    (line,) = [formatEvent(event) for event in events]
    assert line.endswith(errstr)


def test_a_refused_write_without_a_matchtag_logs_its_errstr_cut(connection):
    protocol = connection.protocol
    write = {"topic": "sdexec.write", "matchtag": 0, "payload": {}}
    with capturedLogs() as events:
        protocol._log_silent_write_refusal(write, "y" * 100_000)
    (line,) = [formatEvent(event) for event in events]
    assert line.endswith("y" * MAX_QUOTED + "…")
    assert len(line) < MAX_QUOTED + 200


def test_a_refused_write_on_matchtag_0_names_the_process_it_was_for(
    systemd, connection
):
    # The line named only the connection ("sdexec.write without a matchtag
    # refused"), not whose stdin was closed; Flux sends every write on 0.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=4242)
    io = encode_io("stdout", "0", b"x")
    with capturedLogs() as events:
        connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
        connection.send("sdexec.write", {"matchtag": 1, "io": io}, matchtag=0)
    (line,) = [formatEvent(event) for event in events]
    assert line == (
        f"connection {connection.protocol.connection_id}: sdexec.write on"
        " matchtag 0, to the exec on matchtag 1 (pid 4242), refused (later ones"
        ' of this connection are not logged): io.stream: "stdout" is not stdin'
    )


@pytest.mark.parametrize(
    ("write", "said"),
    [
        (
            {"payload": {"matchtag": 9}},
            "without a matchtag, to the exec on matchtag 9,",
        ),
        ({"matchtag": "x", "payload": []}, 'on matchtag "x", naming no exec,'),
    ],
)
def test_a_refused_write_names_what_it_gave(connection, write, said):
    with capturedLogs() as events:
        connection.raw({"type": "request", "topic": "sdexec.write", **write})
    (line,) = [formatEvent(event) for event in events]
    assert f"sdexec.write {said} refused" in line


def test_a_kill_writes_an_unprintable_label_on_one_line(systemd, connection):
    # It was "kill label=a", a line break, "b not found".
    kill = {"signum": 15, "label": "a\nb\x1b[2J"}
    connection.send("sdexec.kill", kill, matchtag=3)
    assert error_of(connection.last()) == (
        errno.ESRCH,
        "kill label='a\\nb\\x1b[2J' not found",
    )
    connection.send("sdexec.kill", {"signum": 15, "label": ""}, matchtag=4)
    assert error_of(connection.last()) == (errno.ESRCH, "kill label='' not found")


def test_a_kill_of_a_main_process_that_has_exited_is_esrch(systemd, connection):
    # Its unit lingers on a child: systemd has no main process to signal.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    systemd.run(UNIT)
    none = SystemdError(
        "org.freedesktop.systemd1.NoSuchProcess", "No main process to kill"
    )
    systemd.kill_unit = lambda *args: defer.fail(none)
    connection.send("sdexec.kill", {"signum": 15, "label": "j"}, matchtag=2)
    assert error_of(connection.last()) == (
        errno.ESRCH,
        'kill label=j: its main process has exited; "who": "all" (sdexec kill'
        " --all) signals the processes its unit still has",
    )


@pytest.mark.parametrize(
    ("checked", "said"),
    [
        ({"ConditionResult": False, "ConditionTimestampMonotonic": 5},
         "a condition of the unit was false (ConditionResult=no)"),
        ({"AssertResult": False, "AssertTimestampMonotonic": 5},
         "an assertion of the unit failed (AssertResult=no)"),
        # Never checked (a failed Requires=): a false ConditionResult says
        # nothing then.
        ({"ConditionResult": False, "ConditionTimestampMonotonic": 0},
         "its start job ended without starting it (a dependency that failed,"
         " or a job canceled)"),
    ],
    ids=["condition", "assertion", "dependency"],
)  # fmt: skip
@pytest.mark.parametrize("unloaded", [False, True], ids=["read", "unloaded-first"])
@ensureDeferred
async def test_a_start_job_that_ends_without_a_start_ends_the_request(
    server, systemd, connection, checked, said, unloaded
):
    # A slice's assertion, false: the request waited the whole
    # start-timeout, then EIO that never said why (review session 32 V1).
    # systemd unloads the unit before its last signal goes out, so the
    # confirming read may meet a not-found stub of its name: that is no
    # unit "gone while systemd was away" (W2).
    systemd.hold_refresh = unloaded
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    dead = {"ActiveState": "inactive", "SubState": "dead", "LoadState": "loaded"}
    systemd.change(UNIT, {**dead, "Job": (5, "/org/freedesktop/systemd1/job/5")})
    assert connection.responses() == []  # queued: it may yet start
    systemd.change(UNIT, {"Job": (0, "/"), **checked})
    systemd.release(UNIT)  # unloaded: its descriptors closed
    if unloaded:
        systemd.units[UNIT] = {**dead, "LoadState": "not-found"}
        systemd.answer_refreshes()
    # ENOENT, never started; not EIO, which job-exec drains the node for.
    assert error_of(connection.last()) == (errno.ENOENT, f"unit {UNIT}: {said}")
    await until(lambda: not server.processes, "reaped")


#: An inactive unit, as systemd reports one that has not run.
DEAD = {"ActiveState": "inactive", "SubState": "dead", "LoadState": "loaded"}


def stale_snapshot_then_queued(systemd, connection) -> None:
    """An exec whose unit shows an older unit's state (inactive, no job)
    as its start is accepted; the confirming read finds its start queued."""
    systemd.hold_refresh = True
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.change(UNIT, {**DEAD, "Job": (0, "/")})
    systemd.units[UNIT] = {**DEAD, "Job": (5, "/org/freedesktop/systemd1/job/5")}
    systemd.answer_refreshes()
    systemd.hold_refresh = False
    assert connection.responses() == []


def test_a_stale_snapshot_of_an_unstarted_unit_waits_for_the_start(systemd, connection):
    # The unit starts as any does.
    stale_snapshot_then_queued(systemd, connection)
    systemd.run(UNIT, pid=77)
    assert connection.last()["payload"] == {"type": "started", "pid": 77}


def test_after_a_stale_snapshot_an_unstarted_end_is_still_caught(systemd, connection):
    # The confirming read found the start queued; when that job then ended
    # without a start, nothing asked again (review session 32 X1).
    stale_snapshot_then_queued(systemd, connection)
    systemd.change(UNIT, {"Job": (0, "/")})
    assert error_of(connection.last())[1] == (
        f"unit {UNIT}: its start job ended without starting it (a dependency"
        " that failed, or a job canceled)"
    )


def test_what_was_seen_before_an_outage_does_not_say_why_a_unit_is_gone(
    server, systemd, connection
):
    # Its confirming read lost with systemd, the unit ran and went
    # meanwhile: "lost while systemd was away", not the snapshot's
    # unstarted end (review session 32 X2).
    systemd.hold_refresh = True
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    dead = {"ActiveState": "inactive", "SubState": "dead", "LoadState": "loaded"}
    systemd.change(UNIT, {**dead, "Job": (0, "/")})
    systemd.lose("the D-Bus connection closed")  # the read fails with it
    systemd.release(UNIT)
    systemd.units[UNIT] = {**dead, "LoadState": "not-found"}
    systemd.hold_refresh = False
    systemd.restore()
    server.systemd_restored()  # as the service's on_restored does
    assert error_of(connection.last()) == (
        errno.ESRCH,
        f"unit {UNIT} is gone (lost while systemd was away)",
    )


def test_a_receipt_lost_with_systemd_waits_for_it_up_to_reconnect_timeout(
    systemd, monkeypatch
):
    # The unit's processes outlived the main one: its stop waits too.
    monkeypatch.setattr(sdexec.process, "unit_cgroup_exists", lambda *_: True)
    config = parse_config({"systemd": {"reconnect-timeout": "5s"}})
    server = SdexecServer(systemd, config, reactor, clock=Clock())
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.hold_refresh = True
    systemd.run(UNIT)
    systemd.exit(UNIT)
    with capturedLogs() as events:
        systemd.lose("the D-Bus connection closed")  # the receipt's GetAll too
        server.clock.advance(4.9)
        assert [r["payload"]["type"] for r in connection.responses()] == ["started"]
        server.clock.advance(0.1)
    finished = connection.last()["payload"]
    lost = "lost with systemd: systemd was not back within 5 s"
    assert (finished["type"], finished["receipt_lost"]) == ("finished", lost)
    logged = [formatEvent(event) for event in events]
    assert f"{UNIT}: finished goes out without its receipt (resource usage," in (
        "".join(logged)
    )
    connection.close()


def test_a_stop_during_a_receipt_s_wait_still_says_how_the_process_exited(
    systemd, monkeypatch
):
    # Its exit status was known before the stop: the client gets it (the
    # receipt given up), then ECANCELED, not ECANCELED alone as if it never
    # ended; and no log says its client left.
    monkeypatch.setattr(sdexec.process, "unit_cgroup_exists", lambda *_: True)
    server = SdexecServer(systemd, parse_config({}), reactor, clock=Clock())
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.hold_refresh = True
    systemd.run(UNIT)
    systemd.exit(UNIT, status=3)
    systemd.lose("the D-Bus connection closed")  # the receipt's GetAll too
    with capturedLogs() as events:
        server.shutdown(10)
    finished, ended = connection.responses()[-2:]
    lost = "lost with systemd: the service is stopping"
    assert (finished["payload"]["type"], finished["payload"]["status"]) == (
        "finished",
        3 << 8,
    )
    assert finished["payload"]["receipt_lost"] == lost
    assert ended["errnum"] == errno.ECANCELED
    assert "its client left" not in "".join(formatEvent(e) for e in events)
    connection.close()


def _exited_with_its_receipt_in_flight(systemd, monkeypatch):
    """A server on a Clock whose process exited with status 3 (its unit
    says ``Result`` exit-code), the receipt's ``GetAll`` unanswered; the
    unit's processes outlived the main one (on cgroup v2 its stop waits for
    the read)."""
    monkeypatch.setattr(sdexec.process, "unit_cgroup_exists", lambda *_: True)
    server = SdexecServer(systemd, parse_config({}), reactor, clock=Clock())
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.hold_refresh = True
    systemd.run(UNIT)
    systemd.change(UNIT, {"Result": "exit-code"})
    systemd.exit(UNIT, status=3)
    return server, connection


def test_a_stop_with_a_receipt_in_flight_sends_finished_with_it_first(
    systemd, monkeypatch
):
    # Its GetAll queued behind a full call window: the exit status (and
    # the receipt, answered meanwhile) reach the client before ECANCELED,
    # not ECANCELED alone as if the process had never ended.
    server, connection = _exited_with_its_receipt_in_flight(systemd, monkeypatch)
    systemd.units[UNIT]["CPUUsageNSec"] = 5_000_000  # only the read says it
    server.shutdown(10)
    assert [r["payload"]["type"] for r in connection.responses()] == ["started"]
    systemd.answer_refreshes()
    finished, ended = connection.responses()[-2:]
    assert finished["payload"]["type"] == "finished"
    assert finished["payload"]["status"] == 3 << 8
    assert finished["payload"]["usage"]["cpu_usage_nsec"] == 5_000_000
    assert "receipt_lost" not in finished["payload"]
    assert ended["errnum"] == errno.ECANCELED
    assert ("stop", UNIT) in systemd.calls
    connection.close()


def test_a_stop_sends_finished_without_a_receipt_systemd_does_not_answer(
    systemd, monkeypatch
):
    # The stop stays bounded: a read systemd has not answered within
    # STOP_RECEIPT_WAIT is given up, finished carrying what the signals
    # did and saying why, then ECANCELED, and the unit is stopped.
    server, connection = _exited_with_its_receipt_in_flight(systemd, monkeypatch)
    with capturedLogs() as events:
        server.shutdown(10)
        server.clock.advance(sdexec.process.STOP_RECEIPT_WAIT)
    finished, ended = connection.responses()[-2:]
    wait = f"{sdexec.process.STOP_RECEIPT_WAIT:g}"
    assert finished["payload"] == {
        "type": "finished",
        "status": 3 << 8,
        "result": "exit-code",
        "receipt_lost": f"unanswered: the service is stopping (waited {wait} s)",
    }
    assert ended["errnum"] == errno.ECANCELED
    assert ("stop", UNIT) in systemd.calls
    assert f"{UNIT}: finished goes out without its receipt" in "".join(
        formatEvent(event) for event in events
    )
    systemd.answer_refreshes()  # late: nothing more is sent
    assert connection.responses()[-1] == ended
    connection.close()


def test_a_receipt_lost_with_systemd_during_a_stop_s_wait_is_not_waited_for(
    systemd, monkeypatch
):
    # The stop does not wait reconnect-timeout for systemd's return.
    server, connection = _exited_with_its_receipt_in_flight(systemd, monkeypatch)
    server.shutdown(10)
    systemd.lose("the D-Bus connection closed")
    finished, ended = connection.responses()[-2:]
    assert finished["payload"]["status"] == 3 << 8
    assert finished["payload"]["receipt_lost"] == (
        "its read failed: systemd connection lost: the D-Bus connection closed"
    )
    assert ended["errnum"] == errno.ECANCELED
    connection.close()


def test_an_unkillable_unit_s_lost_receipt_says_so_and_what_the_signals_said(
    systemd, monkeypatch
):
    server, connection = _exited_with_its_receipt_in_flight(systemd, monkeypatch)
    systemd.lose("the D-Bus connection closed")  # the receipt's GetAll too
    server.units[UNIT].unkillable("unkillable user processes for job f1")
    finished, ended = connection.responses()[-2:]
    assert finished["payload"] == {
        "type": "finished",
        "status": 3 << 8,
        "result": "exit-code",
        "receipt_lost": "lost with systemd: its unit would not stop",
    }
    assert ended["errnum"] == errno.EDEADLK
    connection.close()


def test_a_kill_failed_for_a_reason_systemd_names_no_errno_is_eremoteio(
    systemd, connection
):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "label": "j"}})
    systemd.run(UNIT)
    systemd.kill_unit = lambda *args: defer.fail(SystemdError("x.Failed", "no"))
    connection.send("sdexec.kill", {"signum": 15, "label": "j"}, matchtag=2)
    assert error_of(connection.last()) == (errno.EREMOTEIO, "no")


# -- the connection's processes ---------------------------------------------------


def test_a_closed_connection_abandons_its_processes(systemd, server):
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    connection.close()
    # As Flux's sdexec: SIGKILL to the main process (SIGTERM, the stop's
    # signal, may be ignored), then the stop for whatever is left.
    assert systemd.calls[-2:] == [("kill", "main", 9), ("stop", UNIT)]


def test_a_closed_connection_s_process_not_yet_started_is_killed_then_stopped(
    systemd, server
):
    # It may run unseen: SIGKILL first, to all of its unit (its main process
    # may not be known yet), or the stop's SIGTERM reached it first and its
    # handler ran (review session 35 P2).
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    connection.close()
    assert systemd.calls[-2:] == [("kill", "all", 9), ("stop", UNIT)]


def test_a_connection_pauses_its_own_processes_only(server):
    # Found through an index by connection, not a walk of the whole table.
    mine, other = Connection(server), Connection(server)
    mine.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    cmd = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-other"}}
    other.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=2)
    theirs = server.processes[(other.protocol.connection_id, 2)]
    (process,) = server.connection_processes(mine.protocol.connection_id)
    assert process is server.processes[(mine.protocol.connection_id, 1)]
    server._reaped((mine.protocol.connection_id, 1))
    assert list(server.connection_processes(mine.protocol.connection_id)) == []
    assert list(server.connection_processes(other.protocol.connection_id)) == [theirs]
    mine.close()
    other.close()


def test_back_pressure_holds_back_each_process_as_it_writes_and_resumes_it(
    server,
):
    # Every process of the connection was paused and resumed at each pause,
    # writing or not: with 1000 idle ones, one process's output ran 15
    # times slower, each cycle holding the reactor 27-80 ms.
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    other = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-u"}}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": other}, matchtag=2)
    writer, idle = server.processes.values()
    readers = {}
    for process in (writer, idle):
        process.output.open()  # as `started` does
        readers[process] = process.output.channels["stdout"].transport
        assert readers[process] in reactor.getReaders()  # not paused once started
    connection.protocol.pauseProducing()
    assert readers[writer] in reactor.getReaders()  # until it writes
    writer.output.channels["stdout"].dataReceived(b"one read\n")
    assert readers[writer] not in reactor.getReaders()
    assert readers[idle] in reactor.getReaders()  # never touched
    connection.protocol.resumeProducing()
    assert readers[writer] in reactor.getReaders()
    connection.close()


def reading(process) -> bool:
    """Whether the reactor reads the process's stdout now."""
    return process.output.channels["stdout"].transport in reactor.getReaders()


@ensureDeferred
async def test_a_paused_connection_takes_a_bounded_rest_however_many_write(
    systemd, server
):
    # Held back lazily, each of 100 writing processes added one read to the
    # responses waiting for a client that reads nothing: 6.8 MB, where
    # pausing them all at once left about the 256 KiB threshold.
    transport = BufferingTransport()
    transport.bufferSize = CLIENT_BUFFER_SIZE
    connection = Connection(server, transport)
    names = [f"sdexec-w{index}" for index in range(100)]
    for matchtag, name in enumerate(names, 1):
        cmd = {**TRUE, "opts": {"SDEXEC_NAME": name}}
        connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag=matchtag)
        systemd.run(f"{name}.service", pid=1000 + matchtag)
    transport.read()
    lines = b"x" * 1023 + b"\n"
    for _ in range(3):
        for name in names:
            os.write(systemd.process_fd(f"{name}.service", "stdout"), lines * 64)
        await until(lambda: transport._producer_paused, "the connection paused")
        # Nothing more comes in once every writer is held back (a fixed
        # sleep here let a slow node pass by reading less meanwhile).
        await until(lambda: not any(map(reading, server.processes.values())), "held")
    # The threshold, LAZY_OUTPUT, one read more, and their JSON framing.
    assert transport.unread < CLIENT_BUFFER_SIZE + LAZY_OUTPUT + 96 * 1024
    connection.close()


def test_shutdown_tells_each_stream_its_process_is_stopped(systemd, server):
    # Rather than a connection that just closes: the client can say why.
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    server.shutdown(grace=10)
    assert error_of(connection.last()) == (
        errno.ECANCELED,
        "the service is stopping: the process's unit is being stopped",
    )
    assert ("stop", UNIT) in systemd.calls
    connection.close()


def waitable_in_background(connection: Connection, label: str) -> None:
    payload = {"flags": int(ExecFlag.WAITABLE), "cmd": {**TRUE, "label": label}}
    connection.raw(
        {"type": "request", "topic": "sdexec.exec", "matchtag": 1,
         "payload": payload, "streaming": False}
    )  # fmt: skip


@ensureDeferred
async def test_a_wait_on_a_z_process_waits_for_what_holds_its_output(systemd, server):
    # Answered once the process has completed, not at its main process's
    # exit, which list shows as Z (docs/protocol.md; review session 35 P3).
    connection = Connection(server)
    waitable_in_background(connection, "w")
    systemd.run(UNIT)
    systemd.exit(UNIT, status=3)  # a child holds its stdout and stderr still
    connection.send("sdexec.list", {}, matchtag=2)
    assert [p["state"] for p in connection.last()["payload"]["procs"]] == ["Z"]
    connection.send("sdexec.wait", {"label": "w"}, matchtag=3)
    # A connection's requests are handled in order: once a request sent
    # after the wait is answered, the wait has been handled, unanswered.
    connection.send("sdexec.list", {}, matchtag=4)
    assert [r["matchtag"] for r in connection.responses()[-1:]] == [4]
    assert [r for r in connection.responses() if r["matchtag"] == 3] == []
    systemd.release(UNIT)  # the child is gone: its output at EOF,
    systemd.change(UNIT, INACTIVE)  # and the stop done
    await until(lambda: connection.last()["matchtag"] == 3, "the wait's answer")
    assert connection.last()["payload"]["status"] == 3 << 8
    connection.close()


def test_shutdown_tells_a_pending_wait_its_process_is_stopped(systemd, server):
    # As a stream is told: docs/protocol.md lists it under sdexec.wait
    # (review session 35 P4).
    starter, waiter = Connection(server), Connection(server)
    waitable_in_background(starter, "w")
    systemd.run(UNIT)
    waiter.send("sdexec.wait", {"label": "w"}, matchtag=5)
    assert waiter.responses() == []
    server.shutdown(grace=10)
    assert waiter.responses() == [
        {
            "type": "response",
            "topic": "sdexec.wait",
            "matchtag": 5,
            "errnum": errno.ECANCELED,
            "errstr": "the service is stopping: the process's unit is being stopped",
        }
    ]
    starter.close()
    waiter.close()


def test_an_exec_during_shutdown_is_eagain_and_starts_nothing(systemd, server):
    # An open connection's exec once started a unit the shutdown, already
    # under way, never stopped: it outlived the service.
    early, late = Connection(server), Connection(server)
    early.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    server.shutdown(grace=10)
    other = {**TRUE, "opts": {"SDEXEC_NAME": "sdexec-late"}}
    late.send("sdexec.exec", {"flags": FLAGS, "cmd": other})
    assert error_of(late.last()) == (errno.EAGAIN, "the service is stopping")
    assert ("start", "sdexec-late.service") not in systemd.calls
    early.close()
    late.close()


def test_a_fault_of_ours_answers_its_request_and_keeps_the_connection(
    server, connection, monkeypatch, logged_failures
):
    def broken(detail: bool) -> dict:
        raise RuntimeError("boom")

    monkeypatch.setattr(server, "list", broken)
    connection.send("sdexec.list", {})
    assert error_of(connection.last()) == (
        errno.ENOTRECOVERABLE,
        "internal error: RuntimeError: boom",
    )
    (failure,) = logged_failures.flush(RuntimeError)  # a fault: its traceback
    assert failure.getErrorMessage() == "boom"
    assert not connection.transport.disconnecting
    monkeypatch.undo()
    connection.send("sdexec.list", {}, matchtag=2)
    assert connection.last()["payload"]["procs"] == []


def test_shutdown_waits_for_every_process_to_be_reaped(systemd, server, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    done = server.shutdown(10)
    assert ("stop", UNIT) in systemd.calls
    assert not done.called
    # A unit that SIGTERM did not stop (left running, it kept the next run
    # drained for ever): its stop-timer signal, the IMP's proxy for SIGKILL
    # (SIGUSR1 by default); a grace later SIGKILL: sent together, the
    # SIGKILL could end the IMP before it acted on the other.
    server.clock.advance(10)
    assert systemd.kills()[-1:] == [signal.SIGUSR1]
    server.clock.advance(10)
    assert systemd.kills()[-2:] == [signal.SIGUSR1, signal.SIGKILL]
    assert not done.called
    server.clock.advance(10)  # still there: given up on, logged
    assert done.called
    assert [p.unit_name for p in server.processes.values()] == [UNIT]


def test_the_answers_to_the_shutdown_s_own_signals_are_not_progress(
    systemd, server, connection, monkeypatch
):
    # Answered after the mark was taken (a real bus answers later), they
    # put the SIGKILL a grace later than said, and the end two.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    done = server.shutdown(10)
    answers: list[defer.Deferred] = []

    def kill_unit(name, who, signum):
        systemd.signalled.append((name, signum))
        answer: defer.Deferred = defer.Deferred()
        # systemd.calls_answered counts it when it is answered.
        answer.addCallback(lambda _: systemd.calls.append(("kill", who, signum)))
        answers.append(answer)
        return answer

    monkeypatch.setattr(systemd, "kill_unit", kill_unit)
    server.clock.advance(10)  # the stop-timer signal
    server.clock.advance(5)
    answers[0].callback(None)
    server.clock.advance(5)  # a grace with nothing else: SIGKILL
    assert [signum for _, signum in systemd.signalled] == [
        signal.SIGUSR1, signal.SIGKILL
    ]  # fmt: skip
    answers[1].callback(None)
    server.clock.advance(10)
    assert done.called


def test_shutdown_with_systemd_away_under_keep_says_the_unit_runs_on(
    systemd, server, connection
):
    # "else by the service's next start", which keeps it under "keep": the
    # client took its job for one that would be stopped.
    config = parse_config({"sdexec": {"leftover-units": "keep"}})
    server.reconfigure(config, Containment(config, None))
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.lose()
    server.shutdown(10)
    assert error_of(connection.last()) == (
        errno.ECANCELED,
        "the service is stopping with systemd unreachable: the process's unit"
        " is stopped if systemd comes back meanwhile, else it runs on, kept by"
        " the service's next start (leftover-units = keep)",
    )
    server.clock.advance(10)


def test_shutdown_sends_no_second_sigkill(systemd, server, connection):
    # The stop-timer signal was SIGKILL: the second step has nothing to send
    # and the wait ends at once, not a grace later.
    sigkill_for_stop_timer(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    done = server.shutdown(10)
    server.clock.advance(10)
    server.clock.advance(10)
    assert systemd.kills() == [signal.SIGKILL]
    assert done.called


def test_shutdown_with_systemd_away_sends_nothing_more(systemd, server, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.lose()
    done = server.shutdown(10)
    # Its client is told the unit may outlive the stop (review session 46).
    assert error_of(connection.last()) == (
        errno.ECANCELED,
        "the service is stopping with systemd unreachable: the process's unit"
        " is stopped if systemd comes back meanwhile, else by the service's"
        " next start",
    )
    with capturedLogs() as events:
        server.clock.advance(10)  # no progress, nothing can be sent: given up
    assert done.called
    assert systemd.kills() == []
    # It said which units it leaves running, and what becomes of them
    # (review session 41 O2).
    (said,) = [formatEvent(e) for e in events if "not reaped" in formatEvent(e)]
    assert said.endswith(
        f"{UNIT}: left running, for the service's next start to find as"
        " leftovers ([sdexec] leftover-units)"
    )
    # And why nothing was answered: nothing could be asked, no manager is
    # wedged.
    assert "answered for 10s (systemd unreachable): " in said


def test_a_shutdown_that_leaves_hundreds_names_ten_in_its_lines(
    systemd, server, connection
):
    # "units not stopped …: NAMES" and "units still not reaped …: NAMES"
    # named every unit: with hundreds, lines of tens of kilobytes. Now the
    # first ten, and every one in a debug line of its own.
    units = [f"sdexec-{n}.service" for n in range(12)]
    for matchtag, unit in enumerate(units, start=1):
        cmd = {**TRUE, "opts": {"SDEXEC_NAME": unit.removesuffix(".service")}}
        connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag)
        systemd.run(unit)
    done = server.shutdown(10)
    with capturedLogs() as events:
        server.clock.advance(10)  # the stop-timer signal
        systemd.lose()
        server.clock.advance(10)  # away: nothing more can be sent
    assert done.called
    shown = f"{', '.join(units[:10])} and 2 more"
    said = [(e["log_level"], formatEvent(e)) for e in events]
    assert [text for level, text in said if level != LogLevel.debug] == [
        "units not stopped, nothing reaped nor answered for 10s: their"
        f" stop-timer signal to all their processes: {shown}",
        "units still not reaped, and no unit reaped nor call answered for"
        f" 10s (systemd unreachable): {shown}: left running, for the"
        " service's next start to find as leftovers ([sdexec] leftover-units)",
    ]
    every = f"units left by the stop (all 12): {', '.join(units)}"
    assert [text for level, text in said if level == LogLevel.debug] == [every] * 2


def test_shutdown_waits_on_while_systemd_answers_calls(systemd, server, connection):
    """Before the first reap of a big shutdown, the receipts wait behind
    every stop in the call window: systemd answering calls is progress."""
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    done = server.shutdown(10)
    server.clock.advance(9)
    systemd.stop_unit("sdexec-other.service")  # one more call answered
    server.clock.advance(1)  # 10 s in: progress in the first grace
    server.clock.advance(9)
    assert not done.called
    server.clock.advance(1)  # 20 s in: a whole grace with neither: signals
    assert not done.called
    server.clock.advance(10)
    server.clock.advance(10)  # two graces more
    assert done.called
    assert [p.unit_name for p in server.processes.values()] == [UNIT]


@ensureDeferred
async def test_shutdown_waits_on_while_units_are_being_reaped(systemd, server):
    """A burst takes longer than the grace; it is waited for while it makes
    progress, and given up on once a grace passes with none."""
    connection = Connection(server)
    for matchtag, name in enumerate(("sdexec-a", "sdexec-b"), start=1):
        cmd = {"cmdline": ["/bin/true"], "opts": {"SDEXEC_NAME": name}}
        connection.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag)
        systemd.run(f"{name}.service")
    done = server.shutdown(10)
    server.clock.advance(9)
    systemd.release("sdexec-a.service")
    systemd.change("sdexec-a.service", {"ActiveState": "inactive"})
    # the outputs' EOF comes through the real reactor
    await until(lambda: len(server.processes) == 1, "sdexec-a reaped")
    server.clock.advance(9)  # 18 s in: one was reaped within the grace
    assert not done.called
    server.clock.advance(10)  # then none for a whole grace: signals
    assert not done.called
    server.clock.advance(10)
    server.clock.advance(10)  # and none for two more
    assert done.called
    assert [p.unit_name for p in server.processes.values()] == ["sdexec-b.service"]
    assert server.clock.getDelayedCalls() == []
    connection.close()


@ensureDeferred
async def test_eofs_follow_finished_when_the_stop_does_not_wait(systemd, server):
    # cgroup v1: the stop goes out right behind the receipt's GetAll, and
    # closes the outputs before that is answered; still the EOFs come after
    # `finished`, as on cgroup v2, and ENODATA last.
    server.receipt_reads_cgroup = False
    systemd.hold_refresh = True
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    (process,) = server.processes.values()
    systemd.run(UNIT)
    systemd.exit(UNIT)
    assert systemd.calls[-2:] == [("get-all", UNIT), ("stop", UNIT)]
    systemd.release(UNIT)  # the stop closes systemd's ends
    # the outputs' EOF comes through the real reactor
    await until(lambda: process.output.eof, "the outputs' EOF")
    assert [r["payload"]["type"] for r in connection.responses()] == ["started"]
    systemd.answer_refreshes()
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    kinds = [r["payload"]["type"] if "payload" in r else r["errnum"]
             for r in connection.responses()]  # fmt: skip
    assert kinds == ["started", "finished", "output", "output", errno.ENODATA]
    connection.close()


@ensureDeferred
async def test_a_stream_never_ends_as_a_success_without_finished(systemd, server):
    # RFC 42 has `finished` before ENODATA. A unit seen started that ends
    # with no exit status (systemd lost it) once ended its stream with
    # ENODATA alone: a client took it for success, its status unknown.
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    (process,) = server.processes.values()
    systemd.run(UNIT)
    systemd.release(UNIT)
    # the outputs' EOF comes through the real reactor
    await until(lambda: process.output.eof, "the outputs' EOF")
    systemd.change(
        UNIT,
        {"ActiveState": "inactive", "SubState": "dead", "Result": "success",
         "ExecMainCode": 0, "ExecMainStatus": 0},
    )  # fmt: skip
    # ECHILD, as wait(2) finding no status; not EIO, which job-exec drains
    # the node for.
    assert error_of(connection.last()) == (
        errno.ECHILD,
        f"unit {UNIT} ended without an exit status",
    )
    assert "finished" not in [
        r["payload"]["type"] for r in connection.responses() if "payload" in r
    ]
    connection.close()


def test_shutdown_with_nothing_running_is_immediate(server):
    assert server.shutdown(10).called


def _fail_to_enter_cwd(systemd: FakeManager) -> None:
    """systemd could not run the command (200/CHDIR): its unit fails, its
    fds released."""
    systemd.release(UNIT)
    failed = {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
    systemd.change(UNIT, {**failed, "ExecMainCode": 1, "ExecMainStatus": 200})


async def _answered_once_gone_then_free(systemd, server, connection, errnum) -> None:
    """The request's error held while its unit's outputs reach EOF, sent
    once the unit is gone; then a retry with the same name starts it."""
    await until(lambda: server.units[UNIT].output.eof, "the outputs' EOF")
    assert connection.responses() == []
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    assert error_of(connection.last())[0] == errnum
    assert UNIT not in server.units
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=2)
    assert [c for c in systemd.calls if c == ("start", UNIT)] == [("start", UNIT)] * 2


@ensureDeferred
async def test_a_name_whose_start_failed_is_free_once_its_error_is_answered(
    systemd, server, connection
):
    # The error went out at once, while the failed unit still waited for its
    # reset: a retry with the same SDEXEC_NAME right after it was EEXIST
    # ("still held"), one in four with a missing cwd on the sandbox manager,
    # nine in ten for a command systemd cannot execute (review session 50).
    # It is answered once the unit is gone, as Flux's sdexec does.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    _fail_to_enter_cwd(systemd)
    assert ("reset", UNIT) in systemd.calls
    await _answered_once_gone_then_free(systemd, server, connection, errno.ENOENT)


@ensureDeferred
async def test_a_name_whose_failed_unit_outlives_the_wait_is_refused_as_still_held(
    systemd, server, connection
):
    # The failed unit not gone FAILED_UNIT_WAIT after it failed: the error
    # goes out all the same, and a retry with the same SDEXEC_NAME meanwhile
    # is refused saying so, not as a request still running; once the unit is
    # gone it runs.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    _fail_to_enter_cwd(systemd)
    server.clock.advance(sdexec.process.FAILED_UNIT_WAIT)
    assert error_of(connection.last())[0] == errno.ENOENT
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=2)
    assert error_of(connection.last()) == (
        errno.EEXIST,
        f"unit {UNIT} is still held by this service: its request has ended, but"
        " the unit is not gone yet (retry once it is)",
    )
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    await until(lambda: UNIT not in server.units, "the failed unit reaped")
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=3)
    assert [c for c in systemd.calls if c == ("start", UNIT)] == [("start", UNIT)] * 2


@ensureDeferred
async def test_a_name_whose_start_timed_out_is_free_once_its_error_is_answered(
    systemd, server, connection
):
    # ETIMEDOUT went out as the unit's stop was asked for: a retry with the
    # same SDEXEC_NAME right after it was EEXIST ("still held"), five in five
    # on the sandbox manager (review session 50). It is answered once the
    # stopped unit is gone, as a start systemd could not run is.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.change(UNIT, {"ActiveState": "activating", "SubState": "start"})
    server.clock.advance(server.config.systemd.start_timeout)
    assert ("stop", UNIT) in systemd.calls
    systemd.release(UNIT)  # the stop ended what it ran
    await _answered_once_gone_then_free(systemd, server, connection, errno.ETIMEDOUT)


def test_a_switch_that_is_no_boolean_names_every_spelling_systemd_takes(connection):
    # A request's switch is read as systemd's parse_boolean() reads it
    # (true/false, on/off, 1/0 as well as yes/no): the refusal says so.
    opts = {**TRUE["opts"], "SDEXEC_PROP_CPUAccounting": "maybe"}
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": {**TRUE, "opts": opts}})
    assert error_of(connection.last()) == (
        errno.EINVAL,
        "SDEXEC_PROP_CPUAccounting: 'maybe' is not a boolean"
        " (yes/no, true/false, on/off, 1/0)",
    )


def test_units_abandoned_together_log_a_bounded_number_of_lines(
    systemd, server, connection
):
    # Hundreds of jobs hung on one dead file system: each unit's stop-timer
    # signal, abandonment and drain logged a line (the drain at err, which
    # alert rules key on): three lines a unit. Each kind is now bounded,
    # then summed up; the drain's reason names every unit.
    units = 3 * BURST
    for n in range(units):
        opts = {"SDEXEC_NAME": f"sdexec-hung{n}", "SDEXEC_STOP_TIMER_SEC": "1"}
        connection.send(
            "sdexec.exec",
            {"flags": FLAGS, "cmd": {**TRUE, "opts": opts}},
            matchtag=1 + n,
        )
        systemd.run(f"sdexec-hung{n}.service", pid=100 + n)
        systemd.exit(f"sdexec-hung{n}.service")
        systemd.deactivate(f"sdexec-hung{n}.service")  # a child ignores SIGTERM
    with capturedLogs() as events:
        server.clock.advance(1)  # the stop-timer signal
        server.clock.advance(1)  # abandoned
    lines = [formatEvent(event) for event in events]
    assert len(server.drains.causes) == units
    for said in ("sending SIGUSR1", ": abandoned", "draining: unkillable"):
        assert len([line for line in lines if said in line]) == BURST, said
    with capturedLogs() as events:
        server.clock.advance(WINDOW_S)
    summaries = sorted(formatEvent(event).split(" in ")[0] for event in events)
    assert summaries == [f"{units - BURST} more like it"] * 3
    for n in range(units):
        systemd.release(f"sdexec-hung{n}.service")
