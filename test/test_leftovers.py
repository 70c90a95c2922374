"""Leftover units offline (FakeManager): found by their mark, reported,
stopped or kept, unloaded once ended; other units never touched. The real
SIGKILL-and-restart is in test_twistd_leftovers.py."""

from __future__ import annotations

import errno
import hashlib
import os
import shlex
import signal
import sys

import pytest
from offline import Connection, error_of
from pytest_twisted import ensureDeferred
from test_server import FLAGS, TRUE, UNIT
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import formatEvent, globalLogPublisher

import sdexec.orphans
from sdexec.cli import format_procs
from sdexec.client import connect
from sdexec.command import Command, describe
from sdexec.config import Config, parse_config
from sdexec.connection import SdexecServerFactory
from sdexec.containment import Containment
from sdexec.execstart import exec_line
from sdexec.leftovers import marked, owner_marks
from sdexec.lograte import BURST, WINDOW_S
from sdexec.outage import SystemdOutage
from sdexec.plan import RequestError, is_job_unit_name, unit_name_for
from sdexec.property import UnitProperty
from sdexec.protocol import job_of_unit_name
from sdexec.server import SdexecServer
from sdexec.systemd import SystemdError
from sdexec.systemd.errors import (
    BUS_TIMEOUT,
    NO_SUCH_UNIT,
    UNIT_EXISTS,
    connection_lost,
)
from sdexec.testing import EXITED, INACTIVE, RUNNING, FakeManager, exec_plan

MARKS = owner_marks("unix:/run/user/1000/sdexec/sdexec.sock")
[MARK] = MARKS


def leftover(systemd: FakeManager, name: str, mark: str = MARK, pid: int = 77):
    """A unit of an earlier run, as the manager lists it."""
    systemd.units[name] = {**RUNNING, "ExecMainPID": pid}
    systemd.properties[name] = [UnitProperty("Description", "s", f"sleep 300{mark}")]


def make_server(
    systemd: FakeManager,
    policy: str = "stop",
    stop_signal: str = "SIGUSR1",
    hold_stops: bool = False,
) -> SdexecServer:
    config = parse_config(
        {
            "sdexec": {"leftover-units": policy},
            "exec": {"sdexec-stop-timer-signal": stop_signal},
        }
    )
    return server_of(systemd, config, hold_stops)


def server_of(
    systemd: FakeManager, config: Config, hold_stops: bool = False
) -> SdexecServer:
    """A server of ``config`` on ``systemd``, on a Clock, marking units as
    this file's service does."""
    return SdexecServer(
        systemd,
        config,
        reactor,
        clock=Clock(),
        marks=MARKS,
        hold_leftover_stops=hold_stops,
    )


@pytest.fixture
def systemd():
    manager = FakeManager()
    yield manager
    manager.close()


def test_the_mark_is_stable_per_endpoint_and_differs_between_services():
    assert owner_marks("unix:/run/user/1000/sdexec/sdexec.sock") == (MARK,)
    assert owner_marks("unix:/tmp/other.sock")[0] != MARK
    assert MARK.startswith(" [sdexec:") and len(MARK) == len(" [sdexec:]") + 12


def test_a_unix_socket_s_options_are_not_part_of_its_mark():
    listen = "unix:/run/user/1000/sdexec/sdexec.sock:mode=660:lockfile=1"
    current, earlier = owner_marks(listen)
    assert current == MARK  # the same service, whatever its socket's options
    # and an earlier version's mark, of the whole string, is still its own
    assert earlier == f" [sdexec:{hashlib.sha256(listen.encode()).hexdigest()[:12]}]"
    assert owner_marks("systemd:domain=UNIX:name=sdexec")[0] != MARK


def test_a_systemd_endpoint_is_marked_by_the_socket_passed(tmp_path):
    # Two instances of one socket-activated unit share the endpoint.
    listen = "systemd:domain=UNIX:name=sdexec"
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    [first] = owner_marks(listen, f"{tmp_path}/real/a.sock")
    [second] = owner_marks(listen, f"{tmp_path}/real/b.sock")
    assert first != second
    assert owner_marks(listen, f"{tmp_path}/link/a.sock") == (first,)
    assert first not in owner_marks(listen)  # the endpoint's own: not its
    assert first not in owner_marks(f"unix:{tmp_path}/real/a.sock")
    assert owner_marks(listen, "@sdexec") != owner_marks(listen, "@other")


def test_one_socket_spelled_two_ways_is_one_service(tmp_path):
    # A restart with `//` in listen once found none of the units it had run.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    [mark] = owner_marks(f"unix:{tmp_path}/real/s.sock")
    for spelling in (f"{tmp_path}//real/s.sock", f"{tmp_path}/./real/s.sock",
                     f"{tmp_path}/link/s.sock"):  # fmt: skip
        marks = owner_marks(f"unix:{spelling}")
        assert marks[0] == mark
        # and the mark an earlier version gave that spelling is still its own
        legacy = hashlib.sha256(f"unix:{spelling}".encode()).hexdigest()[:12]
        assert f" [sdexec:{legacy}]" in marks


def test_units_marked_by_an_earlier_version_are_still_leftovers(systemd):
    # Until now the mark hashed the endpoint string, options and all.
    listen = "unix:/run/user/1000/sdexec/sdexec.sock:mode=660"
    marks = owner_marks(listen)
    leftover(systemd, "sdexec-old.service", mark=marks[1])
    server = SdexecServer(
        systemd, parse_config({}), reactor, clock=Clock(), marks=marks
    )
    server.leftovers.scan()
    assert [unit.description for unit in server.leftovers.units.values()] == [
        "sleep 300"
    ]


def test_a_lone_string_is_not_taken_for_a_set_of_marks(systemd):
    with pytest.raises(ValueError):
        SdexecServer(systemd, parse_config({}), reactor, marks=MARK)  # type: ignore[arg-type]


def test_every_unit_started_carries_the_mark(systemd):
    plan = marked(exec_plan(["sleep", "1"]), MARK)
    [description] = [p.value for p in plan.properties if p.name == "Description"]
    assert description == f"sleep 1{MARK}"
    server = make_server(systemd)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    [sent] = [p.value for p in systemd.properties[UNIT] if p.name == "Description"]
    assert sent.endswith(MARK)
    connection.close()


def test_stop_leftovers_drain_until_they_are_gone(systemd):
    leftover(systemd, "sdexec-a.service", pid=71)
    leftover(systemd, "sdexec-b.service", pid=72)
    leftover(systemd, "other.service", mark="")  # not ours
    leftover(systemd, "sdexec-c.service", mark=owner_marks("unix:/other")[0])
    server = make_server(systemd)
    server.leftovers.scan()
    assert server.drain_reason == "2 leftover units from a previous run"
    stops = [call for call in systemd.calls if call[0] == "stop"]
    assert stops == [("stop", "sdexec-a.service"), ("stop", "sdexec-b.service")]
    assert [
        (p["unit"], p["pid"], p["state"], p["label"]) for p in server.list()["procs"]
    ] == [
        ("sdexec-a.service", 71, "O", ""),
        ("sdexec-b.service", 72, "O", ""),
    ]
    systemd.change("sdexec-a.service", INACTIVE)
    assert server.drain_reason == "1 leftover unit from a previous run"  # afresh
    systemd.change("sdexec-b.service", INACTIVE)
    assert server.drain_reason is None
    assert server.list()["procs"] == []


@pytest.mark.parametrize(
    ("cmdline", "description"),
    [
        (["sh", "-c", 'trap "" TERM; sleep 300'], None),  # through the trampoline
        (["sleep", "300"], "nightly backup"),  # a request's own Description
    ],
)
def test_a_leftover_lists_the_command_its_exec_start_runs(
    systemd, cmdline, description
):
    # Its Description split at spaces was listed as its argv: sdexec ps
    # showed sh -c trap "" TERM; sleep 300 where a process it tracks shows
    # sh -c 'trap "" TERM; sleep 300', and "nightly backup" for a command.
    line = exec_line(f"/bin/{cmdline[0]}", cmdline)
    leftover(systemd, "sdexec-a.service", pid=71)
    systemd.units["sdexec-a.service"]["ExecStart"] = [
        (line.path, line.argv, False, 0, 0, 0, 0, 71, 0, 0)
    ]
    described = description or describe(cmdline)
    systemd.properties["sdexec-a.service"] = [
        UnitProperty("Description", "s", f"{described}{MARK}")
    ]
    systemd.hold_refresh = True
    server = make_server(systemd, policy="keep")
    server.leftovers.scan()
    # Until its unit is read, no command line: its Description is none
    # (listed as one string, sdexec ps showed 'sleep 300').
    [unread] = server.list()["procs"]
    assert (unread["pid"], unread["cmd"], unread["cmdline"]) == (-1, "", [])
    assert format_procs([unread]).splitlines()[1].split() == [
        "-1",
        "O",
        "-",
        "sdexec-a.service",
        "-",
        "-",
        "-",
        "?",
    ]
    systemd.answer_refreshes()
    [entry] = server.list()["procs"]
    assert (entry["cmd"], entry["cmdline"]) == (cmdline[0], cmdline)
    assert format_procs([entry]).endswith(f"  {shlex.join(cmdline)}")


DEACTIVATING = {"ActiveState": "deactivating", "SubState": "stop-sigterm"}


def make_server_with_stop_timer(
    systemd: FakeManager, seconds: int, hold_stops: bool = False
) -> SdexecServer:
    config = parse_config({"exec": {"sdexec-stop-timer-sec": seconds}})
    return server_of(systemd, config, hold_stops)


def test_a_leftover_that_will_not_stop_gets_the_stop_timer(systemd):
    # It ignored the stop's SIGTERM: with SendSIGKILL=no and no stop timeout
    # systemd waits for ever, and the node stayed drained for ever.
    leftover(systemd, "sdexec-a.service")
    server = make_server_with_stop_timer(systemd, 30)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)
    server.clock.advance(29)
    assert systemd.signalled == []
    server.clock.advance(1)
    assert systemd.signalled == [("sdexec-a.service", signal.SIGUSR1)]
    assert server.counters["stop-timer-signal"] == 1
    server.clock.advance(30)
    assert server.drain_reason == "unkillable user processes in unit sdexec-a.service"
    assert [cause["cause"] for cause in server.drains.causes] == ["abandoned-unit"]
    assert server.counters["stop-timer-abandoned"] == 1
    systemd.change("sdexec-a.service", INACTIVE)  # gone at last: still drained
    assert server.leftovers.units == {}
    assert server.drain_reason == "unkillable user processes in unit sdexec-a.service"
    assert server.clock.getDelayedCalls() == []


def deactivating_while_systemd_is_away(systemd: FakeManager) -> SdexecServer:
    """A leftover deactivating (a 30 s stop timer) while systemd is away,
    both periods run out meanwhile."""
    leftover(systemd, "sdexec-a.service")
    server = make_server_with_stop_timer(systemd, 30)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)
    systemd.lose()
    server.clock.advance(90)
    return server


def test_a_leftover_s_stop_timer_waits_for_systemd_to_be_back(systemd):
    # As a process's: its signal failed while systemd was away and was
    # never sent again, and it was abandoned, the node drained, all the same.
    server = deactivating_while_systemd_is_away(systemd)
    assert systemd.signalled == []
    assert server.drain_reason == "1 leftover unit from a previous run"
    systemd.restore()
    server.systemd_restored()
    assert systemd.signalled == [("sdexec-a.service", signal.SIGUSR1)]
    server.clock.advance(29)
    assert server.drain_reason == "1 leftover unit from a previous run"
    server.clock.advance(1)
    assert server.drain_reason == "unkillable user processes in unit sdexec-a.service"


def server_with_an_abandoned_leftover(systemd):
    """A server whose leftover ``sdexec-a.service`` would not stop: its
    stop timer (30 s) signalled it, then abandoned it and drained."""
    leftover(systemd, "sdexec-a.service")
    server = make_server_with_stop_timer(systemd, 30)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)
    server.clock.advance(30)  # its signal
    server.clock.advance(30)  # and its abandon
    assert server.leftovers.units["sdexec-a.service"].abandoned
    return server


def test_an_undrain_of_an_abandoned_leftover_holds_at_the_next_scan(systemd):
    # The admin's undrain was undone at each reconnection: the scan drained
    # again for a leftover the stop timer had given up ("1 leftover unit").
    server = server_with_an_abandoned_leftover(systemd)
    server.undrain()
    server.leftovers.scan()
    assert server.drain_reason is None
    leftover(systemd, "sdexec-b.service")  # a new one drains as before
    server.leftovers.scan()
    assert server.drain_reason == "1 leftover unit"  # (found later: this run's)


#: What a leftover goes through when an admin runs `systemctl restart`:
#: the restart's job is queued all along; the new run has a new invocation.
RESTARTING = {"Job": (7, "/org/freedesktop/systemd1/job/7")}


def restart_by_hand(systemd: FakeManager, name: str) -> None:
    systemd.change(name, {**DEACTIVATING, **RESTARTING})
    systemd.change(name, {**INACTIVE, **RESTARTING})
    systemd.change(name, {"ActiveState": "activating", "SubState": "start"})
    new_run = {**RUNNING, "ExecMainPID": 88, "InvocationID": b"\x02" * 16}
    systemd.change(name, {**new_run, "Job": (0, "/")})


def test_a_leftover_s_stop_timer_waits_for_its_re_read_after_systemd_s_return(
    systemd, monkeypatch
):
    # Its second period ended after the return, before the scan's read: a
    # leftover whose processes ended during the outage was abandoned.
    leftover(systemd, "sdexec-a.service")
    server = make_server_with_stop_timer(systemd, 30)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)
    server.clock.advance(30)  # the stop-timer signal
    systemd.lose()
    server.clock.advance(29)
    systemd.units["sdexec-a.service"].update(INACTIVE)  # ended meanwhile
    systemd.hold_refresh = True
    systemd.restore()
    server.systemd_restored()
    server.clock.advance(1)  # the second period's end
    assert server.drain_reason == "1 leftover unit from a previous run"
    systemd.answer_refreshes()
    assert server.drain_reason is None


def test_a_leftover_s_timer_resumes_after_systemd_s_return_if_its_scan_fails(
    systemd, monkeypatch
):
    # The re-read rode on the scan's listing alone: one that failed (a
    # manager busy after its re-exec) left the timer held for ever.
    server = deactivating_while_systemd_is_away(systemd)
    systemd.restore()
    failed = defer.fail(SystemdError("org.freedesktop.DBus.Error.NoMemory", "No"))
    monkeypatch.setattr(systemd, "list_units_by_patterns", lambda *_: failed)
    server.leftovers.systemd_restored().addErrback(lambda _: None)
    assert systemd.signalled == [("sdexec-a.service", signal.SIGUSR1)]


@pytest.mark.parametrize("policy", ["keep", "stop"])
def test_a_leftover_restarted_by_hand_is_followed_through_its_new_run(systemd, policy):
    # It passed through inactive and was forgotten: its new run, with the
    # mark, was listed by no one, not stopped or unloaded once ended, and
    # under "stop" the node undrained while it ran.
    leftover(systemd, "sdexec-a.service", pid=71)
    server = make_server(systemd, policy)
    server.leftovers.scan()
    restart_by_hand(systemd, "sdexec-a.service")
    assert [(p["unit"], p["pid"]) for p in server.list()["procs"]] == [
        ("sdexec-a.service", 88)
    ]
    if policy == "stop":
        assert server.drain_reason == "1 leftover unit from a previous run"
    stops = systemd.calls.count(("stop", "sdexec-a.service"))
    systemd.change("sdexec-a.service", EXITED)  # ended: unloaded
    assert systemd.calls.count(("stop", "sdexec-a.service")) == stops + (
        policy == "keep"  # (under "stop", its stop was asked for already)
    )
    systemd.change("sdexec-a.service", INACTIVE)
    assert server.list()["procs"] == [] and server.drain_reason is None


@pytest.mark.parametrize("policy", ["keep", "stop"])
def test_a_restarted_leftover_s_new_run_has_a_stop_and_stop_timer_of_its_own(
    systemd, policy
):
    # The first run's were kept: its stop timer, spent as that run left
    # deactivating, never armed for the new run, and under "stop" the new
    # run was never stopped, the node drained while it ran.
    leftover(systemd, "sdexec-a.service", pid=71)
    server = make_server(systemd, policy)
    server.leftovers.scan()
    stops = systemd.calls.count(("stop", "sdexec-a.service"))
    restart_by_hand(systemd, "sdexec-a.service")
    assert systemd.calls.count(("stop", "sdexec-a.service")) == stops + (
        policy == "stop"
    )
    systemd.change("sdexec-a.service", DEACTIVATING)  # it ignores SIGTERM
    server.clock.advance(server.config.exec.sdexec_stop_timer_sec)
    assert systemd.signalled == [("sdexec-a.service", signal.SIGUSR1)]
    server.clock.advance(server.config.exec.sdexec_stop_timer_sec)
    assert server.drain_reason == "unkillable user processes in unit sdexec-a.service"


def test_a_leftover_adopted_before_its_first_start_is_not_started_again(systemd):
    # Its own start job still queued (a start whose answer was lost): when
    # it ran, the log said "started again outside sdexec", and it was
    # stopped a second time.
    systemd.units["sdexec-a.service"] = {**INACTIVE, **RESTARTING}
    systemd.properties["sdexec-a.service"] = [
        UnitProperty("Description", "s", f"sleep 300{MARK}")
    ]
    server = make_server(systemd, "stop")
    server.leftovers.scan()
    stops = systemd.calls.count(("stop", "sdexec-a.service"))
    logged = logged_during(
        lambda: systemd.change("sdexec-a.service", {**RUNNING, "Job": (0, "/")})
    )
    assert not any("started again" in line for line in logged)
    assert systemd.calls.count(("stop", "sdexec-a.service")) == stops


def test_the_new_run_of_a_restart_whose_job_was_not_seen_is_looked_for(
    systemd, monkeypatch
):
    leftover(systemd, "sdexec-a.service", pid=71)
    server = make_server(systemd, "keep")
    server.leftovers.scan()
    listed = systemd.list_units_by_patterns

    def restarted_meanwhile(states: list[str], patterns: list[str]):
        systemd.units["sdexec-a.service"].update(ActiveState="activating")
        return listed(states, patterns)

    monkeypatch.setattr(systemd, "list_units_by_patterns", restarted_meanwhile)
    systemd.change("sdexec-a.service", INACTIVE)  # no job seen: gone, looked for
    assert ("list", ("sdexec-a.service",)) in systemd.calls
    systemd.change("sdexec-a.service", {**RUNNING, "ExecMainPID": 88})
    assert [p["pid"] for p in server.list()["procs"]] == [88]


def test_a_leftover_that_stops_in_time_is_not_signalled(systemd):
    leftover(systemd, "sdexec-a.service")
    server = make_server_with_stop_timer(systemd, 30)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)
    server.clock.advance(10)
    systemd.change("sdexec-a.service", INACTIVE)
    server.clock.advance(60)
    assert systemd.signalled == []
    assert server.drain_reason is None
    assert server.clock.getDelayedCalls() == []


#: A leftover systemd failed for an OOM kill (one of its processes killed
#: while it ran, or during its stop).
OOM_FAILED = {"ActiveState": "failed", "SubState": "failed", "Result": "oom-kill"}


def test_a_leftover_s_oom_kill_is_counted_once_as_it_comes(systemd):
    leftover(systemd, "sdexec-a.service")
    leftover(systemd, "sdexec-b.service")
    systemd.units["sdexec-a.service"]["Result"] = "success"
    systemd.units["sdexec-b.service"].update(OOM_FAILED)  # before this run
    server = make_server(systemd)
    server.leftovers.scan()
    assert server.counters["oom-kills"] == 0  # not this run's to count
    systemd.change("sdexec-a.service", {**DEACTIVATING, "Result": "success"})
    systemd.change("sdexec-a.service", {**DEACTIVATING, "Result": "oom-kill"})
    systemd.change("sdexec-a.service", OOM_FAILED)
    assert server.counters["oom-kills"] == 1
    assert ("reset", "sdexec-a.service") in systemd.calls
    systemd.change("sdexec-a.service", INACTIVE)
    systemd.change("sdexec-b.service", INACTIVE)
    assert server.leftovers.units == {}
    assert server.counters["oom-kills"] == 1


def test_stops_held_until_the_service_listens(systemd):
    # A start that failed after the scan (its stats port taken) had stopped
    # the leftovers it then left unfollowed.
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd, hold_stops=True)
    server.leftovers.scan()
    assert server.drain_reason == "1 leftover unit from a previous run"
    assert not [call for call in systemd.calls if call[0] == "stop"]
    server.leftovers.release_stops()
    assert ("stop", "sdexec-a.service") in systemd.calls
    leftover(systemd, "sdexec-b.service")  # found later: stopped at once
    server.leftovers.scan()
    assert ("stop", "sdexec-b.service") in systemd.calls


def test_a_stopping_service_escalates_the_leftovers_it_is_stopping(systemd):
    # One that ignored SIGTERM was left deactivating by a clean stop, which
    # escalates its own units: its stop-timer signal, then SIGKILL, as
    # theirs; its own stop timer (minutes) is replaced by them.
    leftover(systemd, "sdexec-a.service")
    server = make_server_with_stop_timer(systemd, 300)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)  # its stop timer runs
    done = server.shutdown(10)
    server.clock.advance(10)
    assert systemd.signalled == [("sdexec-a.service", signal.SIGUSR1)]
    server.clock.advance(10)
    assert systemd.signalled[1:] == [("sdexec-a.service", signal.SIGKILL)]
    assert not done.called
    systemd.change("sdexec-a.service", INACTIVE)  # the SIGKILL ended it
    assert done.called
    server.systemd_restored()  # a reconnection while it stops: adopts none
    assert server.leftovers.units == {}
    assert server.clock.getDelayedCalls() == []


def test_a_stopping_service_leaves_kept_leftovers_running(systemd):
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd, policy="keep")
    server.leftovers.scan()
    assert server.shutdown(10).called
    assert server.leftovers.units == {}
    assert systemd.signalled == []
    assert server.clock.getDelayedCalls() == []


def test_a_stopping_service_names_ten_of_hundreds_of_kept_leftovers(systemd):
    # "… not gone, left running …: NAMES" named every one of them.
    units = [f"sdexec-{n:03}.service" for n in range(300)]
    for unit in units:
        leftover(systemd, unit)
    server = make_server(systemd, policy="keep")
    server.leftovers.scan()
    said = logged_during(lambda: server.shutdown(10))
    assert (
        "the service stops with 300 leftover units not gone, left running"
        " (kept: leftover-units = keep), for its next start to find:"
        f" {', '.join(units[:10])} and 290 more"
    ) in said
    assert f"leftover units left (all 300): {', '.join(units)}" in said


def test_a_stopping_service_forgets_a_leftover_that_outlives_its_sigkill(systemd):
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)
    done = server.shutdown(10)
    for _ in range(3):  # its signal, SIGKILL, and a grace with nothing
        server.clock.advance(10)
    assert done.called
    assert server.leftovers.units == {}
    assert server.clock.getDelayedCalls() == []


def test_a_leftover_s_stop_timer_counts_from_when_systemd_says_it_began_stopping(
    systemd,
):
    # Begun afresh at each start, a timer never fired for a leftover that
    # ignores SIGTERM while the service restarted more often than its
    # period: found 20 s into its stop, it is signalled 10 s later.
    leftover(systemd, "sdexec-a.service")
    began = {"StateChangeTimestampMonotonic": 80_000_000}  # at 80 s
    systemd.units["sdexec-a.service"].update(DEACTIVATING, **began)
    server = make_server_with_stop_timer(systemd, 30)
    server.clock.advance(100)
    server.leftovers.scan()
    server.clock.advance(9)
    assert systemd.signalled == []
    server.clock.advance(1)
    assert systemd.signalled == [("sdexec-a.service", signal.SIGUSR1)]
    server.clock.advance(30)  # the second period is a whole one
    assert server.drain_reason == "unkillable user processes in unit sdexec-a.service"


def test_a_reload_s_stop_timer_is_the_leftovers_own(systemd):
    # No request timed a leftover: one that ignored SIGTERM kept the node
    # drained for the period it was found under (640 s by default), and one
    # found before the reload stopped later on it too, whatever the reload.
    leftover(systemd, "sdexec-a.service")
    leftover(systemd, "sdexec-b.service", pid=78)
    server = make_server_with_stop_timer(systemd, 640)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", DEACTIVATING)
    server.clock.advance(20)
    exec_keys = {"sdexec-stop-timer-sec": 30, "sdexec-stop-timer-signal": 9}
    config = parse_config({"exec": exec_keys})
    server.reconfigure(config, Containment(config, None))
    server.clock.advance(10)  # 30 s since it began deactivating
    assert systemd.signalled == [("sdexec-a.service", signal.SIGKILL)]
    systemd.change("sdexec-b.service", DEACTIVATING)
    server.clock.advance(30)
    assert systemd.signalled[1:] == [("sdexec-b.service", signal.SIGKILL)]


def test_no_stop_timer_for_a_leftover_while_stops_are_held(systemd):
    # Found already stopping while the start may still fail: nothing is
    # sent to it until the service listens; then its timer starts.
    leftover(systemd, "sdexec-a.service")
    systemd.units["sdexec-a.service"].update(DEACTIVATING)
    server = make_server_with_stop_timer(systemd, 30, hold_stops=True)
    server.leftovers.scan()
    server.clock.advance(60)
    assert systemd.signalled == []
    server.leftovers.release_stops()
    server.clock.advance(30)
    assert systemd.signalled == [("sdexec-a.service", signal.SIGUSR1)]


def test_a_leftover_unloaded_before_its_stop_is_no_warning(systemd, monkeypatch):
    leftover(systemd, "sdexec-a.service")
    gone = SystemdError(NO_SUCH_UNIT, "Unit sdexec-a.service not loaded.")
    monkeypatch.setattr(systemd, "stop_unit", lambda *_: defer.fail(gone))
    warnings: list[dict] = []
    globalLogPublisher.addObserver(warnings.append)
    try:
        make_server(systemd).leftovers.scan()
    finally:
        globalLogPublisher.removeObserver(warnings.append)
    assert not [e for e in warnings if "failed" in e.get("log_format", "")]


def logged_during(action) -> list[str]:
    """The log lines ``action()`` writes."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        action()
    finally:
        globalLogPublisher.removeObserver(events.append)
    return [formatEvent(event) for event in events]


def test_units_of_another_mark_are_named_at_start_and_left_alone(systemd):
    # A change of listen changes the mark: the units of a run killed before
    # it were never found again, and nothing said so.
    other = owner_marks("unix:/before/sdexec.sock")[0]
    leftover(systemd, "sdexec-b.service", mark=other)
    leftover(systemd, "sdexec-c.service", mark=other)
    leftover(systemd, "stranger.service", mark="")
    server = make_server(systemd)
    [line] = [
        line
        for line in logged_during(server.leftovers.scan)
        if "another sdexec" in line
    ]
    assert line == (
        "2 units of the manager carry the mark of another sdexec service, not"
        f" this one's ({MARK.strip()}, which follows the socket it listens on), and are"
        " left alone: sdexec-b.service, sdexec-c.service. If no other sdexec"
        " serves this manager, they are this service's from a run under"
        " another listen: stop them by hand"
    )
    assert server.leftovers.units == {}
    assert not [call for call in systemd.calls if call[0] == "stop"]
    again = logged_during(server.leftovers.scan)  # said once, at start
    assert not [line for line in again if "another sdexec" in line]


def test_a_lost_start_found_after_a_reconnection_is_not_called_a_previous_run_s(
    systemd,
):
    # A start whose answer was lost with systemd: this run's own unit,
    # found by the scan after the reconnection. It was logged (and the node
    # drained) as a leftover "from a previous run".
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd)
    assert "draining: 1 leftover unit from a previous run" in logged_during(
        server.leftovers.scan
    )
    leftover(systemd, "sdexec-b.service")
    lines = logged_during(server.leftovers.scan)
    assert (
        "leftover unit sdexec-b.service of this run, no longer followed (a start"
        " whose answer was lost with systemd, or a unit given up) (sleep 300):"
        " stopping it"
    ) in lines
    assert server.drain_reason == "2 leftover units"
    systemd.change("sdexec-b.service", INACTIVE)
    systemd.change("sdexec-a.service", INACTIVE)
    assert server.drain_reason is None


def test_a_unit_of_this_run_left_failed_is_reset_not_adopted(systemd):
    # A process's ResetFailedUnit lost with a daemon-reexec (its request had
    # ended): the scan after the reconnection adopted the failed unit as a
    # leftover of this run, and drained the node, jobs refused EBUSY, for a
    # unit in which nothing runs (review session 43 Q4-1).
    server = make_server(systemd)
    server.leftovers.scan()
    leftover(systemd, "sdexec-f.service")
    systemd.units["sdexec-f.service"].update(ActiveState="failed", SubState="failed")
    lines = logged_during(server.leftovers.scan)
    assert "unit sdexec-f.service of this run ended failed: resetting it" in lines
    assert not [line for line in lines if "leftover" in line or "draining" in line]
    assert server.drain_reason is None
    assert ("reset", "sdexec-f.service") in systemd.calls
    assert "sdexec-f.service" not in server.leftovers.units


def test_a_scan_that_finds_nothing_new_does_not_drain_again(systemd):
    # A reconnection during the start-up scan logged "draining" twice.
    leftover(systemd, "sdexec-a.service")
    server = make_server(systemd)
    server.leftovers.scan()
    lines = logged_during(server.leftovers.scan)
    assert not [line for line in lines if line.startswith("draining")]
    assert server.drain_reason == "1 leftover unit from a previous run"


def test_a_unit_started_again_by_hand_is_followed_as_a_leftover_at_once(systemd):
    # `systemctl restart` of a running unit: the stream ends (ESRCH), and the
    # new invocation, carrying the mark, ran on unfollowed until the next
    # reconnection's scan.
    server = make_server(systemd)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, {"InvocationID": b"\x01" * 16})
    lines = logged_during(lambda: systemd.change(UNIT, {"InvocationID": b"\x02" * 16}))
    assert server.processes == {}
    assert list(server.leftovers.units) == [UNIT]
    assert f"leftover unit {UNIT} of this run, started again outside sdexec" in (
        " ".join(lines)
    )
    assert ("stop", UNIT) in systemd.calls
    assert server.drain_reason == "1 leftover unit"
    connection.close()


def test_a_unit_restarted_by_hand_after_its_finished_is_followed_as_a_leftover(
    systemd,
):
    # The restart's stop killed the first run, whose exit (the Service's
    # signal) came before the new InvocationID (the Unit's): `finished` went
    # out for it, and the new run was followed as it, output and all.
    server = make_server(systemd)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    systemd.change(UNIT, {"InvocationID": b"\x01" * 16})
    systemd.change(UNIT, {"ExecMainCode": 2, "ExecMainStatus": 15})  # SIGTERM
    assert connection.last()["payload"]["type"] == "finished"
    systemd.change(UNIT, {**RUNNING, "ExecMainPID": 4343, "ExecMainCode": 0})
    os.write(systemd.process_fd(UNIT, "stdout"), b"run 4343\n")  # unread yet
    lines = logged_during(lambda: systemd.change(UNIT, {"InvocationID": b"\x02" * 16}))
    payloads = [r.get("payload", {}) for r in connection.responses()]
    types = [p.get("type") for p in payloads]
    assert types[types.index("finished") + 1 :] == [None]  # no output after it
    assert payloads[types.index("finished")]["status"] == 15
    assert error_of(connection.last()) == (
        errno.ESRCH,
        f"unit {UNIT} was started again outside sdexec",
    )
    assert server.processes == {}
    assert list(server.leftovers.units) == [UNIT]
    assert f"leftover unit {UNIT} of this run, started again outside sdexec" in (
        " ".join(lines)
    )
    assert server.drain_reason == "1 leftover unit"
    connection.close()


def test_kept_leftovers_run_on_listed_killable_and_unloaded_once_ended(systemd):
    leftover(systemd, "sdexec-a.service", pid=71)
    server = make_server(systemd, "keep")
    server.leftovers.scan()
    assert server.drain_reason is None
    assert not [call for call in systemd.calls if call[0] == "stop"]
    assert [p["state"] for p in server.stats()["procs"]] == ["O"]
    server.kill({"pid": 71, "signum": 15})
    assert systemd.kills() == [15]
    systemd.change("sdexec-a.service", EXITED)  # ended: not left active/exited
    assert ("stop", "sdexec-a.service") in systemd.calls
    systemd.change("sdexec-a.service", {"ActiveState": "failed"})
    assert ("reset", "sdexec-a.service") in systemd.calls


def test_a_leftovers_name_is_not_given_to_a_request(systemd):
    leftover(systemd, "sdexec-t.service")
    server = make_server(systemd, "keep")
    server.leftovers.scan()
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert connection.last()["errnum"] == errno.EEXIST
    connection.close()


def test_units_tracked_by_this_run_are_not_leftovers(systemd):
    server = make_server(systemd)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT)
    server.leftovers.scan()
    assert server.leftovers.units == {}
    assert server.drain_reason is None
    connection.close()


def test_a_start_lost_with_the_connection_is_found_after_it(systemd):
    server = make_server(systemd)
    leftover(systemd, "sdexec-lost.service")  # started, but its reply was lost
    systemd.lose()
    systemd.restore()  # no SystemdOutage here: the server is told directly
    server.systemd_restored()
    assert list(server.leftovers.units) == ["sdexec-lost.service"]
    assert ("stop", "sdexec-lost.service") in systemd.calls


@pytest.fixture
def listings(systemd, monkeypatch) -> list[defer.Deferred]:
    """The manager's listings of its services, each answered (with what it
    lists then) only once the test fires it, or failed with what it fails."""
    held: list[defer.Deferred] = []
    listed = systemd.list_units_by_patterns

    def held_listing(states, patterns):
        held.append(defer.Deferred())
        return held[-1].addCallback(lambda _: listed(states, patterns))

    monkeypatch.setattr(systemd, "list_units_by_patterns", held_listing)
    return held


def test_scans_asked_while_one_is_in_flight_are_made_once_after_it(systemd, listings):
    # Units restarted by hand one after another each asked for a list of
    # every service of the manager.
    server = make_server(systemd)
    first = server.leftovers.scan()
    leftover(systemd, "sdexec-a.service")
    later = [
        server.leftovers.scan({"sdexec-a.service": "of this run"}) for _ in range(3)
    ]
    assert len(listings) == 1
    listings[0].callback(None)
    assert first.called and not any(scan.called for scan in later)
    assert len(listings) == 2  # one more, for all three
    listings[1].callback(None)
    assert all(scan.called for scan in later)
    assert list(server.leftovers.units) == ["sdexec-a.service"]


def test_a_failed_scan_fails_its_callers_and_the_next_goes_on(systemd, listings):
    server = make_server(systemd)
    first, second = server.leftovers.scan(), server.leftovers.scan()
    failures: list = []
    first.addErrback(failures.append)
    listings[0].errback(SystemdError(NO_SUCH_UNIT, "gone"))
    assert len(failures) == 1 and len(listings) == 2
    listings[1].callback([])
    assert second.called


def test_no_scan_is_listed_after_close(systemd, listings):
    server = make_server(systemd)
    first, queued = server.leftovers.scan(), server.leftovers.scan()
    server.leftovers.close()
    listings[0].callback([])
    assert first.called and queued.called and len(listings) == 1


def test_callers_scanning_again_from_their_callbacks_make_one_scan_at_a_time(
    systemd, listings
):
    server = make_server(systemd)
    server.leftovers.scan()
    again: list[defer.Deferred] = []
    for _ in range(2):  # both wait for the next scan, answered together
        server.leftovers.scan().addCallback(
            lambda _: again.append(server.leftovers.scan())
        )
    listings[0].callback([])
    listings[1].callback([])  # answers both: each asks again
    while in_flight := [listing for listing in listings if not listing.called]:
        assert len(in_flight) == 1  # two were listed at once
        in_flight[0].callback([])
    assert len(again) == 2 and all(scan.called for scan in again)


# -- found by a review (notes/review-session29-AC.md) ------------------------


@pytest.mark.parametrize("stop_signal", ["SIGUSR1", "SIGKILL"])
def test_a_leftover_lost_with_its_manager_has_what_it_left_ended(
    systemd, orphans_signalled, stop_signal
):
    # Deactivating (a process ignoring the stop's SIGTERM), its manager is
    # killed and started again: the new one's copy (from the dead one's
    # file, never started) read as "gone", the node was undrained, and the
    # process ran on in the dead manager's cgroup, signalled by no one.
    cgroup = "/user.slice/user-0.slice/user@0.service/app.slice/sdexec-a.service"
    leftover(systemd, "sdexec-a.service")
    systemd.units["sdexec-a.service"].update(
        InvocationID=b"\x01" * 16, ControlGroup=cgroup
    )
    server = make_server(systemd, stop_signal=stop_signal)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", {"ActiveState": "deactivating"})
    systemd.lose("the systemd manager left the bus")
    reloaded = {**INACTIVE, "LoadState": "bad-setting", "InvocationID": b""}
    systemd.units["sdexec-a.service"] = reloaded
    systemd.restore()
    server.leftovers.scan()  # as the return does
    server.clock.advance(2)
    # (Not spared as "in use" by the very leftover that lost it.)
    first = [(cgroup, signal.SIGUSR1)] if stop_signal == "SIGUSR1" else []
    assert orphans_signalled == [*first, (cgroup, signal.SIGKILL)]
    assert list(server.leftovers.units) == []


def test_a_leftover_that_stops_keeps_its_invocation_and_is_simply_gone(
    systemd, monkeypatch
):
    monkeypatch.setattr(sdexec.orphans, "signal_cgroup", pytest.fail)
    leftover(systemd, "sdexec-a.service")
    systemd.units["sdexec-a.service"]["InvocationID"] = b"\x01" * 16
    server = make_server(systemd)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", {**INACTIVE, "InvocationID": b"\x01" * 16})
    assert list(server.leftovers.units) == []


def test_a_start_lost_with_its_killed_manager_has_what_it_forked_ended(
    systemd, monkeypatch, orphans_signalled
):
    # The manager forked the command, and was killed before its answer
    # left: the request ended with EAGAIN and the process was reaped, and
    # the new manager's copy (inactive, never started) was no leftover:
    # the command ran on in the dead manager's cgroup, followed by no one.
    sent = orphans_signalled
    server = make_server(systemd)
    start = systemd.start_transient_unit

    def forked_then_killed(name, *args, **kwargs):
        start(name, *args, **kwargs)
        systemd.run(name)
        return defer.fail(connection_lost("Message recipient disconnected"))

    monkeypatch.setattr(systemd, "start_transient_unit", forked_then_killed)
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    assert error_of(connection.last())[0] == errno.EAGAIN
    assert server.units == {}
    systemd.lose("the systemd manager left the bus")
    systemd.units[UNIT] = {**INACTIVE, "LoadState": "bad-setting", "Slice": "app.slice"}
    systemd.restore()
    server.leftovers.scan()  # as the return does
    cgroup = f"{systemd.control_group}/app.slice/{UNIT}"
    assert sent == [(cgroup, signal.SIGUSR1)]
    server.clock.advance(2)
    assert sent[-1] == (cgroup, signal.SIGKILL)
    assert server.leftovers.units == {}


def never_started(systemd: FakeManager, name: str = UNIT) -> None:
    """The new manager's copy of a marked unit whose start was lost."""
    systemd.units[name] = {**INACTIVE, "Slice": "app.slice"}
    systemd.properties[name] = [UnitProperty("Description", "s", f"true{MARK}")]


def test_a_unit_started_again_under_the_name_gets_no_sigkill(
    systemd, orphans_signalled
):
    # The SIGKILL 2 s after the stop signal went to whatever was in the
    # cgroup then: a retry under the same SDEXEC_NAME runs in that path.
    never_started(systemd)
    server = make_server(systemd)
    server.leftovers.scan()
    cgroup = f"{systemd.control_group}/app.slice/{UNIT}"
    assert orphans_signalled == [(cgroup, signal.SIGUSR1)]
    del systemd.units[UNIT]  # collected; the client tries again
    connection = Connection(server)
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE})
    systemd.run(UNIT, pid=5151)
    server.clock.advance(2)
    assert orphans_signalled == [(cgroup, signal.SIGUSR1)]
    assert server.lost_unit_kills == set()
    connection.close()


def test_a_scan_answered_after_the_stop_ends_nothing(
    systemd, orphans_signalled, monkeypatch
):
    never_started(systemd)
    server = make_server(systemd)
    held: list[defer.Deferred] = []

    def read_later(name: str) -> defer.Deferred:
        held.append(defer.Deferred())
        return held[-1]

    monkeypatch.setattr(systemd, "get_service_properties", read_later)
    server.leftovers.scan()
    assert server.shutdown(10).called  # nothing tracked: over at once
    held[0].callback({"Slice": "app.slice"})
    assert orphans_signalled == []
    assert server.clock.getDelayedCalls() == []


def refused_once(systemd: FakeManager, method: str, kind: str) -> None:
    """``method`` of ``systemd`` refused the first time (LimitsExceeded of a
    busy bus), as asked afterwards."""
    real = getattr(systemd, method)
    refusals = [SystemdError("org.freedesktop.DBus.Error.LimitsExceeded", "busy")]

    def once_refused(name, *args):
        if refusals:
            systemd.calls.append((kind, name))
            return defer.fail(refusals.pop())
        return real(name, *args)

    setattr(systemd, method, once_refused)


@pytest.mark.parametrize("failed", [False, True], ids=["running", "failed"])
def test_a_stop_or_reset_systemd_refused_is_made_again(systemd, failed):
    # Made once, it was never made again: the unit ran on (or stayed
    # failed) and the node stayed drained for it (review session 31 G F2).
    leftover(systemd, "sdexec-a.service")
    if failed:
        systemd.units["sdexec-a.service"].update(
            {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
        )
    method, kind = ("reset_failed_unit", "reset") if failed else ("stop_unit", "stop")
    refused_once(systemd, method, kind)
    server = make_server(systemd)
    server.leftovers.scan()
    assert server.drain_reason == "1 leftover unit from a previous run"
    assert [c for c in systemd.calls if c[0] == kind] == [(kind, "sdexec-a.service")]
    server.clock.advance(1.0)  # the first retry's delay (CALL_RETRY_S)
    assert len([c for c in systemd.calls if c[0] == kind]) == 2
    systemd.change("sdexec-a.service", INACTIVE)
    assert server.drain_reason is None
    assert server.clock.getDelayedCalls() == []


def test_a_lost_start_retried_by_name_while_the_scan_is_queued_is_found(systemd):
    # The retry took the name while the return's scan was queued, the scan
    # passed over the first unit as followed, and the retry was refused:
    # the first ran on, followed by nobody (review session 31 G F1).
    server = make_server(systemd)
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    connection = Connection(server)
    start, listing = systemd.start_transient_unit, systemd.list_units_by_patterns

    def started_then_lost(name, properties, *fds, **kwargs):
        start(name, properties, *fds, **kwargs)  # systemd ran it...
        systemd.units[name].update(RUNNING)
        systemd.lose()  # ...and its answer was lost
        return defer.fail(connection_lost("the D-Bus connection closed"))

    systemd.start_transient_unit = started_then_lost
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=1)
    assert error_of(connection.last())[0] == errno.EAGAIN
    held_list: list[defer.Deferred] = []

    def list_held(*args):
        held_list.append(defer.Deferred().addCallback(lambda _: listing(*args)))
        return held_list[-1]

    systemd.list_units_by_patterns = list_held
    systemd.restore()  # the return's scan, queued
    held_start = defer.Deferred()
    systemd.start_transient_unit = lambda *args, **kwargs: held_start
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=2)
    held_list.pop().callback(None)  # the scan's list: the retry follows it
    systemd.list_units_by_patterns = listing
    held_start.errback(SystemdError(UNIT_EXISTS, f"Unit {UNIT} already exists."))
    assert error_of(connection.last())[0] == errno.EEXIST
    assert UNIT in server.leftovers.units  # found, and stopped
    assert ("stop", UNIT) in systemd.calls
    connection.close()


def test_a_start_answered_with_a_bus_timeout_after_it_ran_is_found(systemd):
    # systemd queues the start's job, then its own call to a stalled bus
    # (tracking the caller) times out: it answers Timeout, and the unit
    # runs. The client was told EREMOTEIO, a refusal, and with no
    # reconnection no scan ever found the unit (review session 48).
    server = make_server(systemd)
    connection = Connection(server)
    start = systemd.start_transient_unit

    def started_then_timed_out(name, properties, *fds, **kwargs):
        start(name, properties, *fds, **kwargs)  # systemd queued its job...
        systemd.units[name].update(RUNNING)
        # ...then its call to track the caller timed out.
        return defer.fail(SystemdError(BUS_TIMEOUT, "Connection timed out"))

    systemd.start_transient_unit = started_then_timed_out
    connection.send("sdexec.exec", {"flags": FLAGS, "cmd": TRUE}, matchtag=1)
    errnum, errstr = error_of(connection.last())
    assert errnum == errno.EAGAIN
    assert "(Connection timed out: the bus may be stalled or flooded)" in errstr
    assert errstr.endswith("is then found and stopped as a leftover: retry")
    assert UNIT in server.leftovers.units  # found, and stopped
    assert ("stop", UNIT) in systemd.calls
    connection.close()


def test_a_refused_stop_is_not_made_again_for_a_unit_gone_since(systemd):
    # The refusal came after the unit had gone: made again by name, the
    # stop could end a job started since under that name (review session
    # 31 H F1).
    leftover(systemd, "sdexec-a.service")
    answer: defer.Deferred = defer.Deferred()
    systemd.stop_unit = lambda name, mode="replace": answer
    server = make_server(systemd)
    server.leftovers.scan()
    systemd.change("sdexec-a.service", INACTIVE)  # it ended: gone
    assert "sdexec-a.service" not in server.leftovers.units
    answer.errback(SystemdError("org.freedesktop.DBus.Error.LimitsExceeded", "busy"))
    assert server.clock.getDelayedCalls() == []


def test_a_stop_made_again_reads_nothing_first(systemd):
    # A GetAll first, on the busy bus that refused the stop, could be refused
    # too, and then nothing was made again (review session 31 H F2).
    leftover(systemd, "sdexec-a.service")
    refused_once(systemd, "stop_unit", "stop")
    server = make_server(systemd)
    server.leftovers.scan()
    reads = len([c for c in systemd.calls if c[0] == "get-all"])
    server.clock.advance(1.0)
    assert len([c for c in systemd.calls if c[0] == "stop"]) == 2
    assert len([c for c in systemd.calls if c[0] == "get-all"]) == reads


def test_one_unit_of_another_mark_is_told_in_the_singular(systemd):
    # Review session 47: "1 unit of the manager carry the mark ...".
    leftover(systemd, "sdexec-b.service", mark=owner_marks("unix:/b/sdexec.sock")[0])
    server = make_server(systemd)
    [line] = [
        line
        for line in logged_during(server.leftovers.scan)
        if "another sdexec" in line
    ]
    assert line.startswith("1 unit of the manager carries the mark of another sdexec")


def lean_ps(path: str) -> defer.Deferred:
    """``sdexec ps`` (the command line's synchronous client) on ``path``:
    its rows, each split at its columns' spaces."""
    argv = ["-m", "sdexec.cli", "--socket", path, "ps"]
    ran = getProcessOutputAndValue(sys.executable, argv, env=dict(os.environ))

    def rows(outcome: tuple[bytes, bytes, int]) -> list[list[str]]:
        out, err, code = outcome
        assert code == 0, err
        return [row.split() for row in out.decode().splitlines()[1:]]

    return ran.addCallback(rows)


@ensureDeferred
async def test_a_leftover_not_read_yet_lists_no_command_line_to_every_client(
    systemd, tmp_path
):
    # Right after a start, before its unit was read, sdexec ps showed a
    # leftover's Description as its command line, one word: 'sleep 300'.
    cmdline = ["sh", "-c", 'echo "$0"; exec sleep 300']  # through the trampoline
    line = exec_line("/bin/sh", cmdline)
    leftover(systemd, "sdexec-a.service", pid=71)
    systemd.units["sdexec-a.service"]["ExecStart"] = [(line.path, line.argv, False)]
    systemd.properties["sdexec-a.service"] = [
        UnitProperty("Description", "s", f"{describe(cmdline)}{MARK}")
    ]
    systemd.hold_refresh = True
    server = make_server(systemd, policy="keep")
    await server.leftovers.scan()
    path = str(tmp_path / "s.sock")
    port = reactor.listenUNIX(path, SdexecServerFactory(server))
    client = await connect(reactor, path)
    try:
        [unread] = (await client.list())["procs"]
        assert (unread["pid"], unread["cmd"], unread["cmdline"]) == (-1, "", [])
        assert [row[:2] + row[7:] for row in await lean_ps(path)] == [["-1", "O", "?"]]
        systemd.answer_refreshes()
        [read] = (await client.list())["procs"]
        assert (read["pid"], read["cmd"], read["cmdline"]) == (71, "sh", cmdline)
        [row] = await lean_ps(path)
        assert row[:2] == ["71", "O"]
        assert shlex.split(" ".join(row[7:])) == cmdline
    finally:
        await client.close()
        await port.stopListening()


def test_a_leftover_unloaded_before_it_is_read_leaves_the_listing(systemd):
    # Gone between the list and its GetAll: systemd answers that read as
    # for any name it has no unit of, not-found, and it is listed no more
    # (the fake answered {}, and it was listed for good, pid -1).
    leftover(systemd, "sdexec-a.service")
    systemd.hold_refresh = True
    server = make_server(systemd, policy="keep")
    server.leftovers.scan()
    assert [p["unit"] for p in server.list()["procs"]] == ["sdexec-a.service"]
    del systemd.units["sdexec-a.service"]  # stopped and collected meanwhile
    systemd.answer_refreshes()
    assert server.list()["procs"] == []
    assert server.leftovers.units == {}


def test_hundreds_of_leftovers_log_a_bounded_number_of_lines(systemd):
    # A restart after a SIGKILL found 200 leftovers and logged three lines
    # for each (found, gone, "still drained: N" said afresh): ~900 lines in
    # a minute. Each kind is now bounded, then summed up once its window
    # closes; the drain's reason holds the count meanwhile.
    names = [f"sdexec-{n:03}.service" for n in range(3 * BURST)]
    for n, name in enumerate(names):
        leftover(systemd, name, pid=1000 + n)
    server = make_server(systemd)
    found = logged_during(server.leftovers.scan)
    assert "draining: 30 leftover units from a previous run" in found
    assert len([line for line in found if line.startswith("leftover unit")]) == BURST

    def all_go() -> None:
        for name in names:
            systemd.change(name, INACTIVE)

    going = logged_during(all_go)
    assert server.drain_reason is None
    assert len([line for line in going if line.endswith(" is gone")]) == BURST
    assert len([line for line in going if line.startswith("still drained")]) == BURST
    summaries = logged_during(lambda: server.clock.advance(WINDOW_S))
    assert sorted(line.split(" in ")[0] for line in summaries) == [
        # 29 counts said afresh (the 30th went with the drain), 10 logged
        f"{2 * BURST - 1} more like it",
        f"{2 * BURST} more like it",  # found
        f"{2 * BURST} more like it",  # gone
    ]


def test_hundreds_of_leftovers_that_will_not_stop_log_a_bounded_number_of_lines(
    systemd,
):
    # Each one's stop-timer signal and abandonment were a line of their own.
    names = [f"sdexec-{n:03}.service" for n in range(3 * BURST)]
    for n, name in enumerate(names):
        leftover(systemd, name, pid=1000 + n)
    server = make_server_with_stop_timer(systemd, 30)
    server.leftovers.scan()

    def stop_timers_run_out() -> None:
        for name in names:
            systemd.change(name, DEACTIVATING)
        server.clock.advance(30)
        server.clock.advance(30)

    lines = logged_during(stop_timers_run_out)
    assert server.counters["stop-timer-abandoned"] == 3 * BURST
    for said in ("sending SIGUSR1", ": abandoned", "draining: unkillable"):
        assert len([line for line in lines if said in line]) == BURST, said


def test_a_terminate_by_a_leftover_s_pid_or_by_a_lost_label_says_why(systemd):
    # sdexec.terminate of a leftover's pid said "terminate pid=71 not found"
    # where sdexec ps lists pid 71 (state O), as its job id's said before;
    # one by a label said nothing of the labels the killed run took with
    # it, as a kill by label says (review session 51).
    leftover(systemd, "sdexec-a.service", pid=71)
    server = make_server(systemd, "keep")
    server.leftovers.scan()
    assert terminate_refused(server, pid=71) == (
        errno.ESRCH,
        "terminate pid=71: its unit sdexec-a.service is a leftover (state O, pid"
        " 71; an earlier run's), which no request of this run follows: it runs"
        " no job of this run (its time limit and termination sequence went with"
        " the run that started it); sdexec kill of its pid signals it",
    )
    assert terminate_refused(server, label="gone") == (
        errno.ESRCH,
        "terminate label=gone not found; labels do not outlive a run of the"
        " service: 1 leftover unit of an earlier run (state O in sdexec ps) is"
        " reached only by a kill of a pid",
    )
    assert terminate_refused(server, pid=72) == (
        errno.ESRCH,
        "terminate pid=72 not found",
    )


def terminate_refused(server: SdexecServer, **target: object) -> tuple[int, str]:
    """The error of an ``sdexec.terminate`` of ``target`` (a cancel)."""
    with pytest.raises(RequestError) as refused:
        server.terminate({**target, "reason": "cancel"})
    return refused.value.errnum, refused.value.errstr


def test_a_unit_name_carries_the_job_id_the_service_named_it_for():
    # sdexec ps shows a leftover's job id from its unit's name, and sdexec
    # cancel of that id finds the leftover, even where the name carries the
    # id changed (characters systemd refuses, a cut).
    for jobid in ("f1", "a-b", "ƒ2tNf7Ws", "x" * 300, "a b/c"):
        unit = unit_name_for(Command(["true"], opts={"SDEXEC_JOBID": jobid}))
        carried = job_of_unit_name(unit)
        assert carried is not None and is_job_unit_name(unit, carried)
        assert is_job_unit_name(unit, jobid)
    assert job_of_unit_name(unit_name_for(Command(["true"]))) is None
    for unit in ("sdexec-f1-short.service", f"sdexec-f1-{'A' * 32}.service",
                 f"other-f1-{'a' * 32}.service", f"sdexec-f1-{'a' * 32}",
                 f"sdexec--{'a' * 32}.service"):  # fmt: skip
        assert job_of_unit_name(unit) is None, unit
