"""The receipt on ``finished`` (issue 10, items 3 and 4): systemd's result,
OOM kills and resource usage, made from a unit's state and cgroup, read back
by clients, printed by ``sdexec run``.

Pure logic on a fake ``/sys`` tree and the fake manager; then the real
manager, where what is reported must be what the node measures: these
cgroup v1 machines account no CPU for a user manager's units and enforce no
``MemoryMax``, a cgroup v2 node does both, and the tests ask the node first.
"""

from __future__ import annotations

import dataclasses
import errno
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from offline import Recorder
from pytest_twisted import ensureDeferred
from support import HOG, manager_property, node_kills_at_memory_max, run
from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread

import sdexec.process
from sdexec.cliio import receipt_lines
from sdexec.process import FAILED_UNIT_WAIT, Process, ProcessContext
from sdexec.receipt import (
    UNSET,
    Receipt,
    finished_extensions,
    format_bytes,
    format_usec,
    reads_unit_cgroups,
)
from sdexec.systemd import SystemdError
from sdexec.systemd.errors import connection_lost
from sdexec.testing import EXITED, RUNNING, FakeManager, exec_plan

UNIT = "sdexec-test.service"
CGROUP = "/sdexec.slice/sdexec-test.service"
MiB = 1024**2


def cgroup_tree(root: Path, **files: str) -> None:
    """A unit's cgroup v2 directory under ``root``, with ``files`` in it
    (``memory_events`` for ``memory.events``, and so on)."""
    directory = root / "sys/fs/cgroup" / CGROUP.lstrip("/")
    directory.mkdir(parents=True)
    (directory / "cgroup.procs").write_text("")
    for name, text in files.items():
        (directory / name.replace("_", ".")).write_text(text)


STATE = {
    "Result": "success",
    "ControlGroup": CGROUP,
    "CPUUsageNSec": 12_345_678,
    "MemoryPeak": UNSET,  # systemd < 255, or not accounted
    "IOReadBytes": UNSET,
    "IOWriteBytes": 4096,
    "MemoryMax": UNSET,
    "ExecMainStartTimestampMonotonic": 1_000_000,
    "ExecMainExitTimestampMonotonic": 3_500_000,
}


# -- making the keys -----------------------------------------------------------------


def test_measured_values_only_and_memory_peak_from_the_cgroup(tmp_path):
    cgroup_tree(tmp_path, memory_events="low 0\noom 0\noom_kill 0\n",
                memory_peak=f"{5 * MiB}\n")  # fmt: skip
    assert finished_extensions(STATE, root=str(tmp_path)) == {
        "result": "success",
        "oom_kills": 0,
        "usage": {
            "cpu_usage_nsec": 12_345_678,
            "memory_peak_bytes": 5 * MiB,
            "io_write_bytes": 4096,
            "wall_time_usec": 2_500_000,
        },
    }


def test_systemds_memory_peak_wins_over_the_file(tmp_path):
    cgroup_tree(tmp_path, memory_peak="1\n")
    usage = finished_extensions({**STATE, "MemoryPeak": 7 * MiB}, str(tmp_path))
    assert usage["usage"]["memory_peak_bytes"] == 7 * MiB


def test_an_oom_kill_reports_the_count_and_the_limit(tmp_path):
    cgroup_tree(tmp_path, memory_events="oom 1\noom_kill 1\noom_group_kill 0\n")
    state = {**STATE, "Result": "oom-kill", "MemoryMax": 256 * MiB}
    extensions = finished_extensions(state, str(tmp_path))
    assert extensions["result"] == "oom-kill"
    assert (extensions["oom_kills"], extensions["memory_max"]) == (1, 256 * MiB)


def test_a_timeout_reports_the_unit_s_runtime_limit(tmp_path):
    state = {**STATE, "Result": "timeout", "RuntimeMaxUSec": 90_000_000}
    assert finished_extensions(state, str(tmp_path))["runtime_max_usec"] == 90_000_000
    # Only with a timeout, and only a limit that was set.
    assert "runtime_max_usec" not in finished_extensions(
        {**STATE, "RuntimeMaxUSec": 90_000_000}, str(tmp_path)
    )
    unset = {**STATE, "Result": "timeout", "RuntimeMaxUSec": UNSET}
    assert "runtime_max_usec" not in finished_extensions(unset, str(tmp_path))


def test_a_gone_cgroup_or_cgroup_v1_reports_no_oom_count(tmp_path):
    # No cgroup v2 directory: the unit failed (systemd removed it) or v1.
    extensions = finished_extensions({**STATE, "Result": "oom-kill"}, str(tmp_path))
    assert "oom_kills" not in extensions
    assert "memory_max" not in extensions  # none was set (infinity)
    assert extensions["result"] == "oom-kill"


def test_receipts_read_unit_cgroups_on_cgroup_v2_only(tmp_path):
    assert not reads_unit_cgroups(str(tmp_path))  # v1: no unified root
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cgroup.controllers").write_text("cpu memory\n")
    assert reads_unit_cgroups(str(tmp_path))


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"Result": "", "CPUUsageNSec": UNSET, "ExecMainStartTimestampMonotonic": 0,
         "ExecMainExitTimestampMonotonic": 10},
        {"CPUUsageNSec": True, "IOReadBytes": -1, "MemoryPeak": "5",
         "ExecMainStartTimestampMonotonic": 10, "ExecMainExitTimestampMonotonic": 5},
    ],
)  # fmt: skip
def test_nothing_measured_is_nothing_reported(tmp_path, state):
    assert finished_extensions(state, str(tmp_path)) == {}


# -- reading them back ------------------------------------------------------------


def test_a_receipt_reads_the_keys_and_drops_malformed_ones():
    receipt = Receipt.from_finished({
        "type": "finished", "status": 9, "result": "oom-kill", "oom_kills": "2",
        "memory_max": 512 * MiB, "usage": {"wall_time_usec": 5000, "cpu": -1},
    })  # fmt: skip
    assert receipt == Receipt(9, "oom-kill", None, 512 * MiB, {"wall_time_usec": 5000})
    assert receipt.oom_killed
    assert receipt.oom_message() == "killed by the OOM killer (MemoryMax=512.0M)"
    plain = Receipt.from_finished({"type": "finished", "status": 0})
    assert plain == Receipt(0) and not plain.oom_killed


@pytest.mark.parametrize(
    ("status", "result", "said"),
    [
        (9, "oom-kill", "killed by the OOM killer (MemoryMax=1.0G)"),
        (9, "signal", "killed by the OOM killer (MemoryMax=1.0G)"),
        (0, "success", "the OOM killer ended 1 process of its unit (MemoryMax=1.0G)"),
        (
            15,
            "oom-kill",
            "the OOM killer ended 1 process of its unit, and systemd stopped the"
            " rest (OOMPolicy=stop; MemoryMax=1.0G)",
        ),
        (
            1 << 8,
            "exit-code",
            "the OOM killer ended 1 process of its unit (MemoryMax=1.0G)",
        ),
    ],
)
def test_the_oom_line_says_whether_the_command_itself_was_killed(status, result, said):
    # The cgroup counts a kill of any of the unit's processes (a child, a
    # task of a job shell): a command that exited 0 was said to be killed
    # (review session 32 N F2).
    receipt = Receipt(status, result, 1, 1024 * MiB)
    assert receipt.oom_killed and receipt.oom_message() == said


def test_a_command_stopped_for_a_child_s_oom_kill_is_not_said_killed():
    # OOMPolicy=stop: a child's kill fails the unit (oom-kill) and systemd
    # stops the rest; the shell dies of the stop's SIGTERM (143). It was
    # said "killed by the OOM killer" (review session 42 T). systemd has
    # removed the failed unit's cgroup: no count.
    receipt = Receipt(signal.SIGTERM, "oom-kill", None, 16 * MiB)
    assert receipt.oom_message() == (
        "the OOM killer ended a process of its unit, and systemd stopped the"
        " rest (OOMPolicy=stop; MemoryMax=16.0M)"
    )


def test_run_prints_usage_like_systemd_run_and_the_oom_line_last():
    receipt = Receipt(9, "oom-kill", 1, None, {
        "wall_time_usec": 2_005_000, "cpu_usage_nsec": 1_500_000,
        "memory_peak_bytes": 3 * MiB // 2, "io_read_bytes": 0,
        "io_write_bytes": 4096})  # fmt: skip
    assert receipt_lines(receipt, usage=True) == [
        "Finished with result: oom-kill",
        "Service runtime: 2.005s",
        "CPU time consumed: 1ms",
        "Memory peak: 1.5M",
        "IO bytes read 0B, written 4.0K",
        "sdexec: killed by the OOM killer (no MemoryMax set)",
    ]
    assert receipt_lines(receipt, usage=False) == [
        "sdexec: killed by the OOM killer (no MemoryMax set)"
    ]
    assert receipt_lines(Receipt(0, "success"), usage=False) == []


def test_run_usage_says_a_receipt_lost_with_systemd():
    # finished carried receipt_lost, and --usage printed only the result,
    # as if nothing had been measured (review session 46).
    receipt = Receipt.from_finished(
        {"type": "finished", "status": 0, "result": "success",
         "receipt_lost": "lost with systemd: reconnecting to systemd"}
    )  # fmt: skip
    assert receipt_lines(receipt, usage=True) == [
        "Finished with result: success",
        "Resource usage not known: lost with systemd: reconnecting to systemd",
    ]
    assert receipt_lines(receipt) == []
    assert Receipt.from_finished({"status": 0, "receipt_lost": 3}).receipt_lost is None


def test_run_says_a_timeout_as_it_says_an_oom_kill():
    # It ended with a silent 143, the stop's SIGTERM: only --usage said
    # "Finished with result: timeout" (review session 46).
    receipt = Receipt.from_finished(
        {"type": "finished", "status": 15, "result": "timeout",
         "runtime_max_usec": 5_000_000}
    )  # fmt: skip
    assert receipt_lines(receipt) == [
        "sdexec: stopped by systemd for a timeout (RuntimeMaxUSec=5000000: 5s)"
    ]
    assert receipt_lines(Receipt(15, "timeout")) == [
        "sdexec: stopped by systemd for a timeout (no RuntimeMaxUSec set)"
    ]


@pytest.mark.parametrize(
    ("terminated", "lines"),
    [("timeout", ["sdexec: job terminated: its time limit was reached"]),
     ("cancel", ["sdexec: job terminated: it was cancelled"]),
     ("other", []), (7, [])],
)  # fmt: skip
def test_run_says_a_job_s_time_limit_ended_it(terminated, lines):
    # A job that trapped SIGALRM and exited 0 ended silently with 0.
    receipt = Receipt.from_finished(
        {"type": "finished", "status": 0, "terminated": terminated}
    )
    assert receipt_lines(receipt) == lines


@pytest.mark.parametrize(
    ("usec", "text"),
    # As systemd-run --wait prints them (format_timespan, to the millisecond).
    [(0, "0"), (850, "850us"), (5_400, "5ms"), (1_000_000, "1s"),
     (1_234_567, "1.234s"), (1_210_000, "1.210s"), (5_000_400, "5.000s"),
     (59_999_999, "59.999s"), (60_000_000, "1min"), (125_010_000, "2min 5.010s"),
     (3_600_000_001, "1h"), (3_723_000_000, "1h 2min 3s"),
     (90_061_500_000, "1d 1h 1min 1.500s")],
)  # fmt: skip
def test_format_usec(usec, text):
    assert format_usec(usec) == text


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0B"), (1023, "1023B"), (1024, "1.0K"), (1536, "1.5K"),
     (4 * 1024**3, "4.0G"), (UNSET - 1, "15.9E")],
)  # fmt: skip
def test_format_bytes(size, text):
    assert format_bytes(size) == text


# -- the process: the receipt is read before the unit is stopped ---------------------


def started_process(systemd: FakeManager):
    """A process started on ``systemd``, what it answered, and what it
    counted."""
    responder, counted = Recorder(), []
    plan = dataclasses.replace(exec_plan(), output={})
    context = ProcessContext(reactor=reactor, clock=Clock(), rank="0",
                             count=counted.append)  # fmt: skip
    process = Process(systemd, plan, responder, context)
    process.start()
    return process, responder, counted


def start_process(systemd: FakeManager):
    _, responder, counted = started_process(systemd)
    return responder, counted


def test_finished_carries_the_receipt_read_before_the_stop():
    systemd = FakeManager()
    responder, counted = start_process(systemd)
    systemd.change(UNIT, {**EXITED, "Result": "success", "CPUUsageNSec": 77})
    assert responder.responses[-1] == {
        "type": "finished", "status": 0, "result": "success",
        "usage": {"cpu_usage_nsec": 77},
    }  # fmt: skip
    calls = [call[0] for call in systemd.calls]
    assert calls == ["start", "get-all", "stop"]  # one GetAll, before StopUnit
    assert counted == []


def test_nothing_stops_the_unit_while_its_receipt_is_read(monkeypatch):
    # Its processes outlived the main one: the cgroup is still there.
    monkeypatch.setattr(sdexec.process, "unit_cgroup_exists", lambda *_: True)
    systemd = FakeManager()
    systemd.hold_refresh = True
    responder, _ = start_process(systemd)
    systemd.change(UNIT, {**EXITED, "Result": "success"})
    systemd.change(UNIT, {"Result": "success"})  # another signal meanwhile
    assert [call[0] for call in systemd.calls] == ["start", "get-all"]
    assert [r["type"] for r in responder.responses] == ["started"]
    systemd.answer_refreshes()
    assert [r["type"] for r in responder.responses] == ["started", "finished"]
    assert systemd.calls[-1] == ("stop", UNIT)


def test_a_unit_whose_cgroup_is_gone_is_stopped_before_its_receipt_comes(
    monkeypatch,
):
    # systemd prunes an emptied unit's cgroup as it leaves running, before
    # its signals go out: there is nothing for a stop to take from the
    # receipt, and waiting for it only cost a round trip per unit.
    monkeypatch.setattr(sdexec.process, "unit_cgroup_exists", lambda *_: False)
    systemd = FakeManager()
    systemd.hold_refresh = True
    responder, _ = start_process(systemd)
    systemd.change(UNIT, {**EXITED, "Result": "success"})
    assert [call[0] for call in systemd.calls] == ["start", "get-all", "stop"]
    systemd.answer_refreshes()
    assert [r["type"] for r in responder.responses] == ["started", "finished"]


def test_an_oom_kill_is_counted():
    systemd = FakeManager()
    responder, counted = start_process(systemd)
    systemd.change(UNIT, {**EXITED, "ActiveState": "failed", "SubState": "failed",
                          "ExecMainCode": 2, "ExecMainStatus": 9,
                          "Result": "oom-kill"})  # fmt: skip
    assert responder.responses[-1]["status"] == 9
    assert responder.responses[-1]["result"] == "oom-kill"
    assert counted == ["oom-kills"]


#: A unit systemd failed for an OOM kill (``Result=oom-kill``) after its main
#: process had exited: one of what outlived it was killed before or during
#: the stop (service_notify_cgroup_oom_event sets the result in those states).
OOM_FAILED = {**EXITED, "ActiveState": "failed", "SubState": "failed",
              "Result": "oom-kill"}  # fmt: skip


def test_an_oom_kill_after_the_receipt_is_counted_once():
    # The receipt was read at the exit (success), and finished said so; the
    # node's count is of its units' OOM ends all the same.
    systemd = FakeManager()
    responder, counted = start_process(systemd)
    systemd.change(UNIT, {**EXITED, "Result": "success"})
    assert responder.responses[-1]["result"] == "success"
    systemd.change(UNIT, {**OOM_FAILED, "ActiveState": "deactivating",
                          "SubState": "stop-sigkill"})  # fmt: skip
    systemd.change(UNIT, OOM_FAILED)
    assert ("reset", UNIT) in systemd.calls
    assert counted == ["oom-kills"]
    assert [call[0] for call in systemd.calls].count("get-all") == 1  # no more


def test_an_oom_kill_in_the_stop_of_a_unit_whose_client_left_is_counted():
    # Its client left; the main process ended cleanly on the stop's SIGTERM
    # before the SIGKILL sent for the client came, and the receipt (read at
    # that exit) said success; then a process left in the unit was killed.
    systemd = FakeManager()
    process, _, counted = started_process(systemd)
    systemd.run(UNIT)
    process.client_gone()
    stopping = {**RUNNING, "ActiveState": "deactivating", "SubState": "stop-sigterm"}
    systemd.change(UNIT, stopping)
    systemd.change(UNIT, {**stopping, "ExecMainCode": 2, "ExecMainStatus": 15,
                          "Result": "success"})  # fmt: skip
    assert ("get-all", UNIT) in systemd.calls
    systemd.change(UNIT, {**OOM_FAILED, "ExecMainCode": 2, "ExecMainStatus": 15})
    assert counted == ["oom-kills"]


# -- a receipt whose read is lost with systemd ------------------------------------


def lose_the_receipt(monkeypatch, systemd=None, cgroup_left=True, verify=None):
    """A unit exits, and the connection drops while its receipt's GetAll is
    in flight; the read would carry what no signal did (CPUUsageNSec).
    ``cgroup_left``: its processes outlived the main one, and the stop
    waits for the receipt (cgroup v2); else it goes out beside it.
    ``verify``: the process's fence check."""
    monkeypatch.setattr(sdexec.process, "unit_cgroup_exists", lambda *_: cgroup_left)
    systemd = systemd or FakeManager()
    clock, responder = Clock(), Recorder()
    systemd.hold_refresh = True
    plan = dataclasses.replace(exec_plan(), output={})
    context = ProcessContext(reactor=reactor, clock=clock, rank="0", receipt_wait=60)
    process = Process(systemd, plan, responder, context, verify=verify)
    process.start()
    systemd.change(UNIT, {**EXITED, "Result": "success"})
    systemd.units[UNIT]["CPUUsageNSec"] = 77
    systemd.lose()
    return systemd, clock, responder, process


def come_back(systemd, process):
    """systemd returns; the unit is read again (answered), as the server
    has every process do."""
    systemd.restore()
    process.resync()
    systemd.answer_refreshes()


def test_a_receipt_lost_with_systemd_is_read_again_once_it_is_back(monkeypatch):
    systemd, _, responder, process = lose_the_receipt(monkeypatch)
    assert [r["type"] for r in responder.responses] == ["started"]
    come_back(systemd, process)
    assert [r["type"] for r in responder.responses] == ["started"]
    systemd.answer_refreshes()  # the receipt's GetAll, asked again
    assert responder.responses[-1] == {
        "type": "finished", "status": 0, "result": "success",
        "usage": {"cpu_usage_nsec": 77},
    }  # fmt: skip
    # Held until the receipt was read, and then made.
    assert [call[0] for call in systemd.calls].count("stop") == 1
    assert systemd.calls[-1] == ("stop", UNIT)


class _StopsLost(FakeManager):
    """A manager whose StopUnit calls are lost with the connection."""

    def stop_unit(self, name, mode="replace"):
        self.calls.append(("stop", name))
        return defer.fail(connection_lost())


def test_a_stop_lost_beside_the_receipt_follows_its_read_again(monkeypatch):
    systemd = _StopsLost()
    systemd, _, responder, process = lose_the_receipt(monkeypatch, systemd, False)
    assert [call[0] for call in systemd.calls] == ["start", "get-all", "stop"]
    come_back(systemd, process)
    # The reread, then the receipt's GetAll again, and only then the stop:
    # systemd answers in order, so the stop cannot change the receipt.
    assert [call[0] for call in systemd.calls[3:]] == ["get-all", "get-all", "stop"]
    systemd.answer_refreshes()
    assert responder.responses[-1]["usage"] == {"cpu_usage_nsec": 77}


def test_a_receipt_lost_with_systemd_gives_up_after_reconnect_timeout(monkeypatch):
    systemd, clock, responder, _ = lose_the_receipt(monkeypatch)
    clock.advance(59)
    assert [r["type"] for r in responder.responses] == ["started"]
    assert ("stop", UNIT) not in systemd.calls
    clock.advance(1)
    assert responder.responses[-1] == {
        "type": "finished", "status": 0, "result": "success",
        "receipt_lost": "lost with systemd: systemd was not back within 60 s",
    }  # fmt: skip
    assert systemd.calls[-1] == ("stop", UNIT)  # no longer held (made again)
    assert clock.getDelayedCalls() == []


def test_a_receipt_lost_with_a_unit_unloaded_meanwhile_is_given_up(monkeypatch):
    systemd, clock, responder, process = lose_the_receipt(monkeypatch)
    # Stopped and garbage-collected while the connection was down.
    systemd.units[UNIT] = {"LoadState": "not-found", "ActiveState": "inactive",
                           "SubState": "dead", "ExecMainPID": 0}  # fmt: skip
    come_back(systemd, process)
    *_, finished, end = responder.responses
    assert end == (errno.ENODATA, "")  # its outcome: not ESRCH for a lost unit
    assert finished["status"] == 0  # the exit seen before the outage
    assert finished["result"] == "success"  # not the stub's
    assert finished["receipt_lost"].startswith("lost with systemd: the unit is gone")
    assert "usage" not in finished
    assert clock.getDelayedCalls() == []


def test_a_receipt_lost_beside_sdexec_s_own_stop_is_not_said_lost_with_the_unit(
    monkeypatch,
):
    # The receipt's GetAll lost with the bus, the StopUnit right behind it
    # went through: the unit sdexec stopped was unloaded, and finished said
    # it was "lost while systemd was away" (review session 48 L2).
    systemd, clock, responder, process = lose_the_receipt(monkeypatch, None, False)
    assert systemd.calls[-1] == ("stop", UNIT)  # answered: it went through
    systemd.units[UNIT] = {"LoadState": "not-found", "ActiveState": "inactive",
                           "SubState": "dead", "ExecMainPID": 0}  # fmt: skip
    come_back(systemd, process)
    *_, finished, end = responder.responses
    assert end == (errno.ENODATA, "")
    assert finished["receipt_lost"] == (
        "lost with systemd: the unit is gone: sdexec stopped it after its"
        " process exited, before its receipt could be read again"
    )
    assert clock.getDelayedCalls() == []


def test_a_receipt_lost_with_systemd_is_not_waited_for_once_its_client_left(
    monkeypatch,
):
    _, clock, responder, process = lose_the_receipt(monkeypatch)
    process.client_gone()
    assert [r["type"] for r in responder.responses] == ["started"]
    assert clock.getDelayedCalls() == []  # nothing holds the unit's end


def test_a_receipt_lost_with_systemd_is_not_waited_for_once_the_fence_refused(
    monkeypatch,
):
    # The refused start's EIO waits for its unit to go (FAILED_UNIT_WAIT at
    # most): no `finished` will go out, and the receipt lost with systemd
    # must not hold the unit's end for reconnect-timeout.
    _, clock, responder, _ = lose_the_receipt(
        monkeypatch, verify=lambda cgroup, pid: "AllowedCPUs not enforced"
    )
    assert responder.responses == []
    assert [call.getTime() for call in clock.getDelayedCalls()] == [FAILED_UNIT_WAIT]
    clock.advance(FAILED_UNIT_WAIT)
    assert responder.responses == [(errno.EIO, "AllowedCPUs not enforced")]


class _GetAllFails(FakeManager):
    def get_service_properties(self, name):
        self.calls.append(("get-all", name))
        return defer.fail(SystemdError("org.freedesktop.DBus.Error.NoReply", "late"))


def test_a_failed_receipt_still_sends_finished_with_what_is_known():
    systemd = _GetAllFails()
    responder, _ = start_process(systemd)
    systemd.change(UNIT, {**EXITED, "ExecMainStatus": 4, "Result": "exit-code"})
    assert responder.responses[-1] == {
        "type": "finished",
        "status": 4 << 8,
        "result": "exit-code",
        "receipt_lost": "its read failed: late",  # so a client can tell
    }
    assert ("stop", UNIT) in systemd.calls


# -- the real manager --------------------------------------------------------------


def accounts_cpu() -> bool:
    """Whether the test manager gives units CPU accounting by default (v2
    managers do; there CPUUsageNSec is measured)."""
    return manager_property("DefaultCPUAccounting") == "yes"


@pytest.mark.systemd
@ensureDeferred
async def test_a_real_unit_reports_result_and_what_the_node_measures(sdexec):
    client = await sdexec.connect()
    done = await run(client, ["/bin/sh", "-c", "exit 3"])
    (finished,) = [r for r in done.responses if r["type"] == "finished"]
    assert (finished["status"], finished["result"]) == (3 << 8, "exit-code")
    usage = finished["usage"]
    assert usage["wall_time_usec"] > 0  # ExecMain timestamps: every manager
    assert ("cpu_usage_nsec" in usage) == accounts_cpu()
    killed = await run(client, ["/bin/sh", "-c", "kill -KILL $$"])
    assert killed.responses[-1]["result"] == "signal"
    assert sdexec.server.counters["oom-kills"] == 0


@pytest.mark.systemd
@ensureDeferred
async def test_sdexec_run_reports_an_oom_kill_as_the_node_does(sdexec):
    enforced = node_kills_at_memory_max()
    ran = await deferToThread(
        subprocess.run,
        [sys.executable, "-m", "sdexec.cli", "--socket", sdexec.socket_path, "run",
         "-n", "--usage", "--setopt", "SDEXEC_PROP_MemoryMax=16M",
         "--setopt", "SDEXEC_PROP_MemorySwapMax=0", sys.executable, "-c", HOG],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = ran.stderr.splitlines()
    if enforced:
        assert ran.returncode == 137, ran.stderr
        assert lines[0] == "Finished with result: oom-kill"
        assert lines[-1] == "sdexec: killed by the OOM killer (MemoryMax=16.0M)"
        assert sdexec.server.counters["oom-kills"] == 1
    else:
        assert ran.returncode == 0, ran.stderr
        assert lines[0] == "Finished with result: success"
        assert "OOM" not in ran.stderr
    assert any(line.startswith("Service runtime: ") for line in lines)


#: A main process that exits 0 once a child of its own waits for the unit's
#: stop: the stop's SIGTERM has the child touch 128M, after `finished` went
#: out (success), and where the node enforces MemoryMax it is OOM-killed
#: during the stop (systemd's Result becomes oom-kill then).
HOG_IN_THE_STOP = f"""
import os, signal
ready, tell = os.pipe()
if os.fork() == 0:
    def hog(*_):
        {HOG}
        os._exit(0)
    signal.signal(signal.SIGTERM, hog)
    os.write(tell, b"r")
    while True:
        signal.pause()
os.read(ready, 1)
"""


@pytest.mark.systemd
@ensureDeferred
async def test_an_oom_kill_in_the_stop_after_finished_is_counted(sdexec):
    enforced = node_kills_at_memory_max()
    ran = await deferToThread(
        subprocess.run,
        [sys.executable, "-m", "sdexec.cli", "--socket", sdexec.socket_path, "run",
         "-n", "--usage", "--setopt", "SDEXEC_PROP_MemoryMax=16M",
         "--setopt", "SDEXEC_PROP_MemorySwapMax=0", sys.executable, "-c",
         HOG_IN_THE_STOP],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # The command's own end, either way; the stream ended once the unit had.
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.splitlines()[0] == "Finished with result: success"
    assert sdexec.server.counters["oom-kills"] == (1 if enforced else 0)


@pytest.mark.systemd
@ensureDeferred
async def test_sdexec_run_says_a_site_s_runtime_limit_stopped_the_job(start_service):
    service = await start_service(
        extra='[exec.sdexec-properties]\nRuntimeMaxUSec = "1000000"\n'
    )
    ran = await deferToThread(
        subprocess.run,
        [sys.executable, "-m", "sdexec.cli", "--socket", service.socket_path, "run",
         "-n", "sleep", "60"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 128 + signal.SIGTERM, ran.stderr
    assert ran.stderr.splitlines() == [
        "sdexec: stopped by systemd for a timeout (RuntimeMaxUSec=1000000: 1s)"
    ]
