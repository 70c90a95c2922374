"""systemd away and back, offline: requests get EAGAIN, the node drains
only after ``[systemd] reconnect-timeout`` and undrains on return, every
process re-reads its unit; a unit gone meanwhile ends its request with an
error naming it. FakeManager and a Clock; the real bus is in
test_reconnect.py."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

import pytest
import pytest_twisted
from offline import error_of, sigkill_for_stop_timer
from support import until
from test_server import FLAGS, TRUE, UNIT
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.logger import LogLevel, capturedLogs

import sdexec.orphans
import sdexec.process
import sdexec.server
from sdexec.config import parse_config
from sdexec.drain import AdminCause
from sdexec.ioencode import decode_io
from sdexec.outage import SystemdOutage
from sdexec.server import SdexecServer
from sdexec.systemd import MANAGER_LEFT, SystemdError
from sdexec.systemd.errors import NO_SUCH_UNIT
from sdexec.testing import DEACTIVATING, EXITED, INACTIVE, RUNNING
from sdexec.unitstop import StopTimerState


@pytest.fixture
def server(systemd):
    config = parse_config({"systemd": {"reconnect-timeout": "10s"}})
    server = SdexecServer(systemd, config, reactor, clock=Clock())
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    return server


OURS, ANOTHER = {"InvocationID": b"\x01" * 16}, {"InvocationID": b""}
#: The unit as a manager killed and started again loads it from the file
#: the dead one left: bad-setting, inactive, never started by it.
RELOADED = {**INACTIVE, "LoadState": "bad-setting", **ANOTHER}


def away_and_back(systemd, unit_state: dict) -> None:
    """systemd goes away, and is back with the unit in ``unit_state`` (no
    signal said so: the resync reads it)."""
    systemd.lose()
    systemd.units[UNIT] = dict(unit_state)
    systemd.restore()


def test_requests_meanwhile_get_eagain_and_succeed_once_back(
    systemd, server, connection
):
    systemd.lose()
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last()) == (errno.EAGAIN, "reconnecting to systemd")
    assert ("start", UNIT) not in systemd.calls
    systemd.restore()
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=2)
    assert ("start", UNIT) in systemd.calls


def test_drained_only_after_the_timeout_and_undrained_on_return(systemd, server):
    systemd.lose("the systemd manager left the bus")
    server.clock.advance(9)
    assert server.drain_reason is None
    server.clock.advance(1)
    assert server.drain_reason == (
        "systemd unreachable for 10 s: the systemd manager left the bus"
    )
    systemd.restore()
    assert server.drain_reason is None


def test_back_in_time_no_drain_at_all(systemd, server):
    systemd.lose()
    server.clock.advance(5)
    systemd.restore()
    server.clock.advance(60)
    assert server.drain_reason is None


def test_another_drain_is_not_undone_by_the_return(systemd, server):
    systemd.lose()
    server.clock.advance(10)
    server.drain(
        "unkillable user processes in unit x.service", AdminCause.ABANDONED_UNIT
    )
    systemd.restore()
    assert server.drain_reason == "unkillable user processes in unit x.service"


def test_a_return_under_another_drain_does_not_log_the_drain_lifted(systemd, server):
    # It logged "drain lifted (was: systemd unreachable …)" alone, the node
    # drained still: an admin reading the journal took it for serving.
    server.drain(
        "unkillable user processes in unit x.service", AdminCause.ABANDONED_UNIT
    )
    systemd.lose()
    server.clock.advance(10)
    with capturedLogs() as events:
        systemd.restore()
    said = [
        event["log_format"].format(**event)
        for event in events
        if "drain" in event["log_format"]
    ]
    assert said == [
        "drain cause over: systemd unreachable for 10 s: the D-Bus connection"
        " closed; still drained: unkillable user processes in unit x.service"
    ]


def test_a_drain_from_before_a_long_outage_outlives_its_return(systemd, server):
    # The outage's drain used to replace it, and the return to clear that.
    server.drain(
        "unkillable user processes in unit x.service", AdminCause.ABANDONED_UNIT
    )
    systemd.lose()
    server.clock.advance(10)
    systemd.restore()
    assert server.drain_reason == "unkillable user processes in unit x.service"


def test_a_surviving_unit_keeps_its_stream(systemd, server, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.lose()
    systemd.units[UNIT].update(EXITED)  # while away: no signal comes
    systemd.restore()  # the resync reads it
    types = [r["payload"]["type"] for r in connection.responses() if "payload" in r]
    assert types[-2:] == ["started", "finished"]
    assert ("stop", UNIT) in systemd.calls


def test_a_vanished_unit_ends_its_request_naming_it(
    systemd, server, connection, orphan_kills
):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    away_and_back(systemd, {**INACTIVE, "LoadState": "not-found", "ExecMainCode": 0})
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.ESRCH  # not EIO: job-exec would drain the node
    assert errstr == f"unit {UNIT} is gone (lost while systemd was away)"
    assert server.processes == {}
    # Unloaded is not proof that its manager lost it (a reset from outside,
    # a bus-only outage): nothing is killed.
    assert orphan_kills == []


GONE = 2**22 + 1


@pytest.fixture
def orphan_kills(monkeypatch):
    """``(unit, cgroup, signal)`` of each lost unit whose processes would be
    ended (sdexec/orphans.py): every main process said to be in
    ``MANAGER/app.slice/UNIT@PID``, but pid ``GONE``, which has exited."""
    kills: list[tuple[str, str, int]] = []

    def cgroup_of(unit, pid, manager):
        return None if pid == GONE else f"{manager}/app.slice/{unit}@{pid}"

    class Recorded:
        """A kill whose SIGKILL is to come: it waits in ``pending``."""

        def __init__(self, unit, cgroup, stop_signal, clock, drain, pending, **_):
            self.noted = (unit, cgroup, stop_signal)
            self._pending = pending

        def start(self):
            kills.append(self.noted)
            self._pending.add(self)

    monkeypatch.setattr(sdexec.process, "unit_cgroup", cgroup_of)
    monkeypatch.setattr(sdexec.server, "LostUnitKill", Recorded)
    return kills


def noted_cgroup(systemd, pid: int = RUNNING["ExecMainPID"]) -> str:
    """The cgroup ``orphan_kills`` says a unit of ``systemd`` started in."""
    return f"{systemd.control_group}/app.slice/{UNIT}@{pid}"


def test_a_unit_a_restarted_manager_reloaded_from_its_file_is_gone(
    systemd, server, connection, orphan_kills
):
    # A manager killed and started again reads the transient unit file the
    # dead one left: a unit of that name, bad-setting and inactive, never
    # started (no InvocationID), our process outside it. It used to end the
    # stream as a success (ENODATA, no finished), the exit status lost.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, OURS)
    away_and_back(systemd, RELOADED)
    assert error_of(connection.last()) == (
        errno.ESRCH,
        f"unit {UNIT} is gone (lost while systemd was away)",
    )
    assert server.processes == {}
    # What it left runs outside any unit: ended (sdexec/orphans.py), with
    # the stop-timer signal first (an IMP's proxy for SIGKILL).
    assert orphan_kills == [(UNIT, noted_cgroup(systemd), signal.SIGUSR1)]


def lost_after_its_exit(systemd, connection) -> None:
    """A process whose main process exited (finished sent), others ignoring
    the stop's SIGTERM (deactivating), then its manager killed: the new one
    reads the unit from the file the dead one left."""
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, OURS)
    systemd.exit(UNIT)
    systemd.change(UNIT, DEACTIVATING)
    away_and_back(systemd, RELOADED)


def test_a_unit_lost_after_its_exit_still_has_what_it_left_ended(
    systemd, server, connection, orphan_kills
):
    # Its main process exited (finished sent), others ignored the stop's
    # SIGTERM (deactivating), and then the manager was killed: the new one
    # reads the unit inactive, and the stop timer had nothing left to time.
    lost_after_its_exit(systemd, connection)
    assert orphan_kills == [(UNIT, noted_cgroup(systemd), signal.SIGUSR1)]


def test_the_unit_s_own_control_group_is_noted_where_read(
    systemd, server, connection, orphan_kills
):
    # The main process was gone before its cgroup could be read from
    # /proc: the receipt's GetAll names the unit's.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=GONE)
    systemd.change(UNIT, OURS)
    systemd.units[UNIT]["ControlGroup"] = "/app.slice/the-unit-s-own"
    systemd.change(UNIT, EXITED)
    systemd.change(UNIT, DEACTIVATING)
    away_and_back(systemd, RELOADED)
    assert orphan_kills == [(UNIT, "/app.slice/the-unit-s-own", signal.SIGUSR1)]


def test_with_no_cgroup_noted_it_is_found_where_the_manager_made_it(
    systemd, server, connection, orphan_kills
):
    # The main process was gone before its cgroup could be read, and no
    # GetAll read the unit's: the manager (its cgroup noted when the start
    # was asked for) made it in the unit's slice, which the new manager
    # loads from the same file.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=GONE)
    systemd.change(UNIT, OURS)
    away_and_back(systemd, {**RELOADED, "Slice": "app.slice"})
    assert orphan_kills == [
        (UNIT, f"{systemd.control_group}/app.slice/{UNIT}", signal.SIGUSR1)
    ]


NEVER_STARTED = {
    "ActiveState": "inactive",
    "SubState": "dead",
    "ExecMainPID": 0,
    "ExecMainCode": 0,
    "LoadState": "bad-setting",
    "Slice": "app.slice",
    "Job": [0, "/"],
    **ANOTHER,
}


def test_a_unit_lost_before_its_start_was_followed_is_gone_at_once(
    systemd, server, connection, orphan_kills
):
    # The manager was killed after it ran the command and before sdexec
    # saw the unit start (a burst of starts keeps it busy): the request
    # waited out start-timeout, and the process ran on.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    away_and_back(systemd, NEVER_STARTED)
    assert error_of(connection.last()) == (
        errno.ESRCH,
        f"unit {UNIT} is gone (lost while systemd was away)",
    )
    assert server.processes == {}
    assert orphan_kills == [
        (UNIT, f"{systemd.control_group}/app.slice/{UNIT}", signal.SIGUSR1)
    ]


def test_a_start_still_queued_after_an_outage_is_waited_for(
    systemd, server, connection, orphan_kills
):
    # The bus went, the manager stayed: its start job is still there.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    away_and_back(
        systemd,
        {
            **NEVER_STARTED,
            "Job": [7, "/org/freedesktop/systemd1/job/7"],
        },
    )
    assert [p.unit_name for p in server.processes.values()] == [UNIT]
    assert orphan_kills == []
    systemd.run(UNIT)
    assert connection.responses()[-1]["payload"]["type"] == "started"


NOT_FOUND = {**INACTIVE, "LoadState": "not-found", "ExecMainCode": 0}
#: A start job kept over a daemon-reexec (systemd 252): the unit, reloaded
#: from its transient file, reads bad-setting (as one started with
#: ExecStartEx did: it does not parse back); the job then fails without
#: starting it, and the unit is unloaded.
QUEUED = {**NEVER_STARTED, "Job": [7, "/org/freedesktop/systemd1/job/7"]}
DROPPED = (
    f"unit {UNIT} was never started: systemd reloaded, re-executed or restarted"
    " before running its start job, and dropped it; nothing ran, retry"
)


def reexec_drops_the_queued_start(systemd, seen_at_the_read: str) -> None:
    """The manager re-executes with the unit's start job still queued; the
    job fails after the return, the unit unloaded: found ``not-found`` at
    the read after the return, or queued then, and then its job ended
    (``job-ended``: the read that confirms it finds it still loaded;
    ``unloaded``: gone by then, as systemd's GC runs first)."""
    systemd.lose(MANAGER_LEFT)
    if seen_at_the_read == "not-found":
        systemd.units[UNIT] = dict(NOT_FOUND)
        systemd.restore()
        return
    systemd.units[UNIT] = dict(QUEUED)
    systemd.restore()
    if seen_at_the_read == "job-ended":
        systemd.change(UNIT, {"Job": [0, "/"]})
    else:
        systemd.change(UNIT, NOT_FOUND)
    systemd.release(UNIT)  # unloaded: its descriptors closed


@pytest.mark.parametrize("seen_at_the_read", ["not-found", "job-ended", "unloaded"])
@pytest_twisted.ensureDeferred
async def test_a_start_a_reexecuted_manager_dropped_unrun_is_eagain(
    systemd, server, connection, orphan_kills, seen_at_the_read
):
    # Review session 41 O1: the requests whose starts systemd had queued at
    # a daemon-reexec ended with ESRCH "is gone (lost while systemd was
    # away)", which a client does not retry; nothing had run.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    reexec_drops_the_queued_start(systemd, seen_at_the_read)
    assert error_of(connection.last()) == (errno.EAGAIN, DROPPED)
    await until(lambda: not server.processes, "reaped")
    assert orphan_kills == []  # nothing ran: nothing left to end


@pytest.mark.parametrize("unloaded", [False, True])
@pytest_twisted.ensureDeferred
async def test_a_start_a_reloaded_manager_dropped_unrun_is_eagain(
    systemd, server, connection, orphan_kills, unloaded
):
    # A daemon-reload (a package's install runs one) during a burst ended
    # 29 of 150 requests ENOENT "its start job ended without starting it":
    # their units reloaded bad-setting, systemd there all along (review
    # session 42). Nothing ran: a client may retry.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.change(UNIT, QUEUED)
    systemd.reload()
    # Signals carry no LoadState, and the unit is unloaded before a read.
    systemd.change(UNIT, {}, invalidated=["LoadState"])
    systemd.hold_refresh = unloaded  # before the read that confirms it:
    systemd.change(UNIT, {"Job": [0, "/"]})
    if unloaded:  # systemd's GC runs before its signals go out
        systemd.change(UNIT, NOT_FOUND)
    systemd.release(UNIT)
    assert error_of(connection.last()) == (errno.EAGAIN, DROPPED)
    await until(lambda: not server.processes, "reaped")
    assert orphan_kills == []


def hold_start_answers(systemd) -> list[Callable[[], None]]:
    """Each start's answer held back: the test calls what the list gets, in
    turn, to let one through."""
    releases: list[Callable[[], None]] = []
    start = systemd.start_transient_unit

    def held(*args, **kwargs):
        answered, later = start(*args, **kwargs), defer.Deferred()
        releases.append(lambda: answered.chainDeferred(later))
        return later

    systemd.start_transient_unit = held
    return releases


@pytest.mark.parametrize(
    "signalled",
    [lambda systemd: systemd.reload(), lambda systemd: systemd.lose(MANAGER_LEFT)],
    ids=["reloading", "left"],
)
@pytest_twisted.ensureDeferred
async def test_a_start_answered_only_after_its_manager_s_signal_may_be_dropped(
    systemd, server, connection, orphan_kills, signalled
):
    # The manager's signal is handled as it is read, the start's answer
    # that came before it turns later: a start not yet answered was not
    # marked, and the reload's drop of its job ended ENOENT, which a client
    # does not retry (review session 42 R2: 3 bursts of 10).
    releases = hold_start_answers(systemd)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    signalled(systemd)
    if not systemd.connected:
        systemd.units[UNIT] = dict(QUEUED)
        systemd.restore()
    [release] = releases
    release()
    systemd.change(UNIT, QUEUED)
    systemd.change(UNIT, {"Job": [0, "/"]})
    systemd.release(UNIT)
    assert error_of(connection.last()) == (errno.EAGAIN, DROPPED)
    await until(lambda: not server.processes, "reaped")


def test_a_start_the_reload_found_unsent_is_not_said_dropped(
    systemd, server, connection
):
    # Still in sdexec's window of calls (behind 64 others) at the reload,
    # it reached the reloaded manager: its job ending unstarted is its own
    # (a dependency), not the reload's drop, which a retry would not mend
    # (review session 42 R3-1).
    queued: list[Callable[[], None]] = []
    start = systemd.start_transient_unit

    def in_the_window(*args, on_sent=None, **kwargs):
        answer = defer.Deferred()
        queued.append(
            lambda: start(*args, on_sent=on_sent, **kwargs).chainDeferred(answer)
        )
        return answer

    systemd.start_transient_unit = in_the_window
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.reload()
    [send] = queued
    send()
    systemd.change(UNIT, QUEUED)
    # Signals carry no LoadState, and the unit is unloaded before a read.
    systemd.change(UNIT, {}, invalidated=["LoadState"])
    systemd.hold_refresh = True
    systemd.change(UNIT, {"Job": [0, "/"]})
    systemd.change(UNIT, NOT_FOUND)
    systemd.release(UNIT)
    assert error_of(connection.last()) == (
        errno.ENOENT,
        f"unit {UNIT}: its start job ended without starting it (a dependency"
        " that failed, or a job canceled)",
    )


@pytest.mark.parametrize("reloaded", [False, True])
def test_a_start_job_ended_by_a_false_condition_is_enoent_reload_or_not(
    systemd, server, connection, reloaded
):
    # Only a start the reload dropped is said to be one: a condition's
    # verdict stands (a retry would meet it again).
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.change(UNIT, {**QUEUED, "LoadState": "loaded"})
    if reloaded:
        systemd.reload()
    systemd.change(
        UNIT,
        {"Job": [0, "/"], "ConditionTimestampMonotonic": 5, "ConditionResult": False},
    )
    assert error_of(connection.last()) == (
        errno.ENOENT,
        f"unit {UNIT}: a condition of the unit was false (ConditionResult=no)",
    )


def test_a_reload_before_the_start_is_sent_drops_nothing(systemd, server, connection):
    systemd.reload()  # no process yet: nothing to mark
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.change(UNIT, {**QUEUED, "LoadState": "loaded"})
    systemd.change(UNIT, {"Job": [0, "/"]})
    assert error_of(connection.last())[0] == errno.ENOENT


@pytest.mark.parametrize(
    ("ran", "found", "ended"),
    [
        # Only a start never run is retried: one that ran is ESRCH, as ever.
        (True, NOT_FOUND, 0),
        # A manager killed may have run the command before sdexec saw it
        # start (the new one loads the unit bad-setting from the dead one's
        # file): not said to be safe to retry, and what it left is ended.
        (False, NEVER_STARTED, 1),
    ],
    ids=["started", "killed-manager"],
)
def test_a_unit_the_manager_lost_but_did_not_drop_unrun_is_still_gone(
    systemd, server, connection, orphan_kills, ran, found, ended
):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    if ran:
        systemd.run(UNIT)
    systemd.lose(MANAGER_LEFT)
    systemd.units[UNIT] = dict(found)
    systemd.restore()
    assert error_of(connection.last()) == (
        errno.ESRCH,
        f"unit {UNIT} is gone (lost while systemd was away)",
    )
    assert len(orphan_kills) == ended


def test_a_unit_started_again_by_hand_is_not_ours_any_more(
    systemd, server, connection, orphan_kills
):
    # systemd there all along: not "lost while systemd was away".
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, OURS)
    systemd.change(UNIT, {"InvocationID": b"\x02" * 16})
    assert error_of(connection.last()) == (
        errno.ESRCH,
        f"unit {UNIT} was started again outside sdexec",
    )
    assert server.processes == {}
    assert orphan_kills == []  # the new invocation is not ours to kill


def test_a_unit_a_reexecuted_manager_kept_goes_on(systemd, server, connection):
    # daemon-reexec: the unit reads bad-setting too (its transient file
    # cannot be parsed back), but it runs on, the same invocation.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, OURS)
    systemd.lose()
    systemd.units[UNIT]["LoadState"] = "bad-setting"
    systemd.restore()
    assert "errnum" not in connection.last()
    assert [p.unit_name for p in server.processes.values()] == [UNIT]


def test_a_vanished_unit_s_unread_output_goes_out_before_the_error(
    systemd, server, connection
):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    # Written, not yet read by the service (the reactor does not run here,
    # as when the client had paused the output): no EOF will ever follow.
    os.write(systemd.process_fd(UNIT, "stdout"), b"last words\nno newline")
    away_and_back(systemd, {**INACTIVE, "LoadState": "not-found", "ExecMainCode": 0})
    payloads = [r["payload"] for r in connection.responses() if "payload" in r]
    sent = [decode_io(p["io"])[1] for p in payloads if p.get("type") == "output"]
    assert b"".join(sent) == b"last words\nno newline"
    assert error_of(connection.last())[0] == errno.ESRCH
    assert server.processes == {}


def test_a_stop_lost_with_the_connection_is_made_again(systemd, server, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.lose()
    with capturedLogs() as events:
        connection.close()  # the client leaves while systemd is away
    assert systemd.calls.count(("stop", UNIT)) == 1  # failed: EAGAIN
    assert systemd.calls.count(("kill", "main", 9)) == 1  # failed too
    # Not said as failures: two lines a unit, for every unit of a node
    # whose clients left while systemd was away (review session 41 O3).
    assert [e for e in events if e["log_level"] >= LogLevel.warn] == []
    systemd.restore()
    assert systemd.calls.count(("stop", UNIT)) == 2
    assert systemd.calls.count(("kill", "main", 9)) == 2


def test_a_kill_of_a_process_whose_unit_was_unloaded_is_esrch(
    systemd, server, connection, monkeypatch
):
    # Its end not yet seen: systemd says "Unit ... not loaded." (was EIO).
    # A kill racing a process's end (the soak of session 48 met it once in
    # 30 kills): the answer names the target, and it counts as refused, as
    # a kill of a process that has exited does.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=99)
    gone = SystemdError(NO_SUCH_UNIT, f"Unit {UNIT} not loaded.")
    monkeypatch.setattr(systemd, "kill_unit", lambda *_: defer.fail(gone))
    refused = server.counters["errors"]
    connection.send("sdexec.kill", {"pid": 99, "signum": 15}, matchtag=2)
    assert error_of(connection.last()) == (
        errno.ESRCH,
        f"kill pid=99: it has ended (Unit {UNIT} not loaded.)",
    )
    assert server.counters["errors"] == refused + 1


def test_a_kill_while_away_is_eagain(systemd, server, connection):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=99)
    systemd.lose()
    connection.send("sdexec.kill", {"pid": 99, "signum": 15}, matchtag=2)
    assert error_of(connection.last()) == (errno.EAGAIN, "reconnecting to systemd")


def test_a_shutdown_finishes_the_lost_units_kills_still_to_come(systemd, server):
    class Pending:
        finished = 0

        def finish(self):
            self.finished += 1

    kill = Pending()
    server.lost_unit_kills.add(kill)
    server.shutdown(10)
    assert kill.finished == 1


@pytest_twisted.ensureDeferred
async def test_a_lost_unit_found_during_the_shutdown_is_sigkilled_before_it_ends(
    systemd, server, connection, lost_cgroup, orphans_signalled
):
    # The shutdown finished the kills pending when it began; one begun while
    # it waited (systemd back, the unit reloaded) had its SIGKILL on a timer
    # that died with the reactor: what ignored the first signal ran on.
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, OURS)
    done: list = []
    server.shutdown(10).addBoth(done.append)
    away_and_back(systemd, RELOADED)
    systemd.release(UNIT)  # what lingers holds no output end
    await until(lambda: done, "the shutdown's end")
    assert orphans_signalled == [
        (lost_cgroup, signal.SIGUSR1),
        (lost_cgroup, signal.SIGKILL),
    ]
    assert server.lost_unit_kills == set()


@pytest.fixture
def lost_cgroup(systemd, monkeypatch) -> str:
    """Where each unit's processes are said to be (its cgroup as noted at
    its start)."""
    monkeypatch.setattr(
        sdexec.process, "unit_cgroup", lambda unit, pid, m: f"{m}/app.slice/{unit}"
    )
    return f"{systemd.control_group}/app.slice/{UNIT}"


def test_a_sigkill_stop_signal_ends_what_a_lost_unit_left(
    systemd, server, connection, lost_cgroup, orphans_signalled
):
    # The lost unit's own process, still tabled as the kill began, read as
    # a unit of that name running again: nothing was sent at all.
    sigkill_for_stop_timer(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, OURS)
    away_and_back(systemd, RELOADED)
    assert orphans_signalled == [(lost_cgroup, signal.SIGKILL)]


def test_a_unit_lost_after_its_exit_gets_its_sigkill(
    systemd, server, connection, lost_cgroup, orphans_signalled
):
    # Its outcome known, its process stays tabled while the unit lingers:
    # read as the name's new run, it spared what ignored the stop signal.
    lost_after_its_exit(systemd, connection)
    server.clock.advance(2)
    assert orphans_signalled == [
        (lost_cgroup, signal.SIGUSR1),
        (lost_cgroup, signal.SIGKILL),
    ]


def test_systemd_lost_while_the_service_stops_drains_nothing_later(systemd, connection):
    # stopService stops the outage before the shutdown waits for the units:
    # a loss meanwhile armed a drain timer that outlived the stop, and
    # "drained" a stopped server reconnect-timeout later.
    config = parse_config({"systemd": {"reconnect-timeout": "10s"}})
    server = connection.protocol.server
    outage = SystemdOutage(server)
    systemd.on_lost = outage.lost
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    outage.stop()
    server.shutdown(5)
    systemd.lose()
    server.clock.advance(config.systemd.reconnect_timeout + 5)
    assert server.drain_reason is None
    assert [call for call in server.clock.getDelayedCalls() if call.active()] == []


def test_a_lost_unit_s_kill_still_to_come_is_the_server_s_to_finish(
    systemd, server, connection, orphan_kills
):
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, OURS)
    away_and_back(systemd, RELOADED)
    assert [kill.noted[0] for kill in server.lost_unit_kills] == [UNIT]


#: A process whose stop timer runs 30 s a period.
LINGERING = {**TRUE, "opts": {**TRUE["opts"], "SDEXEC_STOP_TIMER_SEC": "30"}}


def deactivating_with_processes_left(systemd, connection) -> None:
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": LINGERING})
    systemd.run(UNIT, pid=99)
    systemd.exit(UNIT)
    systemd.deactivate(UNIT)


def test_the_stop_timer_gives_no_verdict_while_systemd_is_away(
    systemd, server, connection
):
    # Its signal failed at once (EAGAIN) and was never sent again, and the
    # unit was abandoned a period later: EDEADLK, and the node drained
    # "unkillable" for processes nothing had signalled.
    deactivating_with_processes_left(systemd, connection)
    server.clock.advance(29)
    systemd.lose()
    server.clock.advance(1 + 30 + 5)  # both periods run out while away
    assert systemd.signalled == []
    systemd.restore()  # still deactivating: the signal goes now
    assert systemd.signalled == [(UNIT, signal.SIGUSR1)]
    assert server.drain_reason is None
    server.clock.advance(30)  # and the verdict a period later
    assert error_of(connection.last())[0] == errno.EDEADLK
    assert server.drain_reason == f"unkillable user processes in unit {UNIT}"


def test_a_unit_that_stopped_while_systemd_was_away_is_not_unkillable(
    systemd, server, connection
):
    deactivating_with_processes_left(systemd, connection)
    systemd.lose()
    server.clock.advance(120)
    systemd.release(UNIT)
    away_and_back(systemd, INACTIVE)  # it emptied and stopped meanwhile
    assert systemd.signalled == []
    assert server.drain_reason is None
    assert [r for r in connection.responses() if "errnum" in r] == []  # no EDEADLK
    (process,) = server.processes.values()
    assert process.stop_timer.state is StopTimerState.STOPPED


def test_each_loss_of_systemd_is_counted(systemd, server):
    # Review session 47: only the connected gauge said it, so a loss and its
    # reconnection between two scrapes left no trace for an alert.
    for _ in range(2):
        systemd.lose()
        systemd.restore()
    assert server.counters["systemd-losses"] == 2
