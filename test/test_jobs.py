"""Jobs in the service, offline: the termination sequence as the server runs
it (``sdexec.terminate``, time limits), on a ``Clock`` with the fake
manager; every KillUnit is recorded with the time it was asked for. The
schedule's own arithmetic is tested in test_termination.py, the limits in
test_joblimit.py; the same paths run against a real manager in
test_service.py."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
from hypothesis import given, settings
from offline import Connection, Recorder
from pytest_twisted import ensureDeferred
from strategies import malformed_terminate_payloads
from support import until
from twisted.internet import defer, reactor
from twisted.internet.task import Clock

from sdexec import cli
from sdexec.config import parse_config
from sdexec.outage import SystemdOutage
from sdexec.protocol import ExecFlag, Topic
from sdexec.rpc import RPCError
from sdexec.server import RequestError, SdexecServer
from sdexec.systemd.errors import reconnecting
from sdexec.termination import TerminationStep
from sdexec.testing import DEACTIVATING, EXITED, INACTIVE, FakeManager

UNIT = "sdexec-job.service"
FLAGS = int(ExecFlag.STDOUT | ExecFlag.STDERR)
START = 1_700_000_000.0  # the clock's epoch time when a request arrives
#: The ``finished`` of a cancelled job that exited 0 (it trapped SIGTERM).
CANCELLED_0 = {"type": "finished", "status": 0, "terminated": "cancel"}


class TimedManager(FakeManager):
    """A fake manager that also notes when each KillUnit was asked for."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.kills_at: list[tuple[float, str, int]] = []

    def kill_unit(self, name: str, who: str, signal: int) -> defer.Deferred[None]:
        offset = self.clock.seconds() - START
        self.kills_at.append((offset, who, signal))
        return super().kill_unit(name, who, signal)


@pytest.fixture
def make_server():
    """``make_server(**exec_table)``: a server on a Clock at :data:`START`
    over a :class:`TimedManager`, closed after the test."""
    managers: list[TimedManager] = []

    def make(**exec_table):
        clock = Clock()
        clock.advance(START)
        systemd = TimedManager(clock)
        managers.append(systemd)
        config = parse_config({"exec": exec_table})
        return SdexecServer(systemd, config, reactor, clock=clock), systemd, clock

    yield make
    for manager in managers:
        manager.close()


def job_payload(matchtag: int = 1, **opts: str) -> dict:
    return {
        "flags": FLAGS,
        "cmd": {
            "cmdline": ["/bin/true"],
            "opts": {"SDEXEC_NAME": "sdexec-job", "SDEXEC_JOBID": "f1", **opts},
        },
    }


def start_job(server, systemd, **opts: str) -> Recorder:
    responder = Recorder()
    server.exec(1, 1, job_payload(**opts), responder)
    systemd.run(UNIT, pid=77)
    return responder


def run_until_quiet(clock: Clock, limit: float = 4000) -> None:
    """Advance second by second while anything is scheduled."""
    while clock.getDelayedCalls() and clock.seconds() - START < limit:
        clock.advance(1)


def kill_times(systemd: TimedManager, who: str) -> list[float]:
    return [at for at, whom, _ in systemd.kills_at if whom == who]


# -- the whole schedule, through the service ------------------------------------


def test_a_job_id_that_is_not_printable_is_einval(make_server):
    # It became the drain reason every later refusal, `sdexec undrain` and
    # the journal print: its escapes acted on terminals, its newline split
    # the journal's entry.
    server, _, _ = make_server()
    with pytest.raises(RequestError) as refused:
        server.exec(1, 1, job_payload(SDEXEC_JOBID="f1\x1b[2J\n"), Recorder())
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EINVAL,
        'SDEXEC_JOBID: "f1\\u001b[2J\\n": a job id is printable text',
    )


@pytest.mark.parametrize(
    ("exec_table", "task_kills", "attempts", "drained_at", "ago"),
    [
        ({}, [5, 10, 15, 20], [25, 30, 40, 60, 100, 180, 340, 640], 640, "640s"),
        (
            {"kill-timeout": "1s", "max-kill-count": 4},
            [1, 2, 3, 4],
            [5, 6, 8, 12],
            12,
            "12s",
        ),
        (
            {"max-kill-timeout": "30m"},
            [5, 10, 15, 20],
            [25, 30, 40, 60, 100, 180, 340, 640, 940, 1240, 1540],
            1800,
            "30m",
        ),
    ],
    ids=["defaults", "four-attempts-one-second", "max-kill-timeout-30m"],
)
def test_an_unkillable_job_is_drained_on_schedule(
    make_server, exec_table, task_kills, attempts, drained_at, ago
):
    server, systemd, clock = make_server(**exec_table)
    responder = start_job(server, systemd)
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([1] * (drained_at - 1))
    assert server.drain_reason is None
    clock.advance(1)
    assert server.drain_reason == "unkillable user processes for job f1"
    # Named apart from the other causes an admin clears, for a resource
    # manager that automates undrains (sdexec/drain.py).
    assert [cause["cause"] for cause in server.drains.causes] == ["unkillable"]
    assert clock.getDelayedCalls() == []
    assert kill_times(systemd, "all") == [0, *task_kills]
    assert kill_times(systemd, "main") == attempts
    # What began it, and what was tried: no `finished` comes to say it.
    assert responder.responses[-1] == (
        errno.EDEADLK,
        "unkillable user processes for job f1: a cancel (sdexec.terminate) began"
        f" its termination {ago} ago; tried since: SIGTERM once to every process"
        f" of its unit, SIGKILL {len(task_kills)} times to every process of its"
        f" unit, SIGKILL {len(attempts)} times to its job shell (its main"
        " process); the node is drained",
    )
    assert server.jobs.jobs["f1"].describe()["step"] == "unkillable"


def test_an_unkillable_job_says_its_time_limit_began_its_termination(make_server):
    # Its EDEADLK is all its client gets (no `finished`, so no
    # `terminated`): it says the time limit began the end, and what was
    # sent, where it said only "unkillable user processes for job f1".
    table = {"kill-timeout": "1s", "max-kill-count": 2, "kill-signal": "SIGUSR2"}
    server, systemd, clock = make_server(**table)
    responder = start_job(server, systemd, SDEXEC_TIME_LIMIT="10s")
    run_until_quiet(clock)
    assert server.drain_reason == "unkillable user processes for job f1"
    assert responder.responses[-1] == (
        errno.EDEADLK,
        "unkillable user processes for job f1: its time limit began its"
        " termination 6s ago; tried since: SIGALRM once to every process of its"
        " unit, SIGUSR2 4 times to every process of its unit, SIGUSR2 twice to"
        " its job shell (its main process); the node is drained",
    )


def declared_unkillable(make_server):
    """A server whose job f1 (one kill attempt, a second apart) would not
    die: its stream ended with EDEADLK, the node drained; and its manager."""
    server, systemd, clock = make_server(**{"kill-timeout": "1s", "max-kill-count": 1})
    start_job(server, systemd)
    server.terminate({"jobid": "f1", "reason": "cancel"})
    run_until_quiet(clock)
    assert server.drain_reason == "unkillable user processes for job f1"
    return server, systemd


def test_unkillable_drains_with_the_exact_reason_and_undrain_restores(make_server):
    server, _ = declared_unkillable(make_server)
    # f1's unit still runs (unkillable): its name stays taken.
    second = {"SDEXEC_JOBID": "f2", "SDEXEC_NAME": "sdexec-job2"}
    with pytest.raises(RequestError) as refused:
        server.exec(1, 2, job_payload(**second), Recorder())
    assert refused.value.errnum == errno.EIO
    server.undrain()
    server.exec(1, 2, job_payload(**second), Recorder())
    assert (1, 2) in server.processes


# -- signals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exec_table", "reason", "first", "then"),
    [
        ({}, "cancel", signal.SIGTERM, signal.SIGKILL),
        ({}, "timeout", signal.SIGALRM, signal.SIGKILL),
        ({"term-signal": "SIGUSR2", "kill-signal": "SIGUSR1"}, "cancel",
         signal.SIGUSR2, signal.SIGUSR1),
        ({"term-signal": "SIGUSR2", "kill-signal": "SIGUSR1"}, "timeout",
         signal.SIGALRM, signal.SIGUSR1),
    ],
)  # fmt: skip
def test_signal_choice(make_server, exec_table, reason, first, then):
    server, systemd, clock = make_server(**exec_table)
    start_job(server, systemd)
    server.terminate({"pid": 77, "reason": reason})
    clock.pump([0.5] * int(10 * server.config.exec.kill_timeout))
    signals = [(who, signum) for _, who, signum in systemd.kills_at]
    assert signals[0] == ("all", first)
    assert set(signals[1:]) == {("all", then), ("main", then)}


# -- the job ends the sequence ---------------------------------------------------------


@pytest.mark.parametrize("exit_at", [0.5, 3, 27])
def test_a_job_that_exits_ends_the_sequence_with_its_status(make_server, exit_at):
    server, systemd, clock = make_server()
    responder = start_job(server, systemd)
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.advance(exit_at)
    sent = len(systemd.kills_at)
    systemd.change(
        UNIT, {"SubState": "exited", "ExecMainCode": 2, "ExecMainStatus": 15}
    )
    run_until_quiet(clock)
    assert len(systemd.kills_at) == sent
    finished = {"type": "finished", "status": signal.SIGTERM, "terminated": "cancel"}
    assert finished in responder.responses
    assert server.drain_reason is None
    assert clock.getDelayedCalls() == []
    with pytest.raises(RequestError) as late:
        server.terminate({"jobid": "f1", "reason": "cancel"})
    assert (late.value.errnum, late.value.errstr) == (
        errno.ESRCH,
        "job f1 has already exited",
    )


def kills_of(systemd: TimedManager, signum: int) -> list[float]:
    return [
        at for at, whom, sent in systemd.kills_at if (whom, sent) == ("all", signum)
    ]


@pytest.mark.parametrize(
    ("second", "signum"),
    [("cancel", signal.SIGTERM), ("timeout", signal.SIGALRM)],
)
def test_a_second_terminate_sends_step_1_again_without_restarting(
    make_server, second, signum
):
    # Upstream's job-exec sends term-signal on each new exception while one
    # is in progress (and SIGALRM when the time limit comes): a job that
    # ignored the first heard nothing more of a second cancel.
    server, systemd, clock = make_server(**{"kill-timeout": "1s", "max-kill-count": 4})
    start_job(server, systemd)
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([0.5] * 5)
    reply = server.terminate({"jobid": "f1", "reason": second})
    assert reply["step"] == "kill-tasks"
    assert reply["termination"]["reason"] == "cancel"
    clock.pump([0.5] * 20)
    # the schedule of a single cancel, the re-send beside it
    assert kill_times(systemd, "all") == [0, 1, 2, 2.5, 3, 4]
    assert systemd.kills_at[3] == (2.5, "all", signum)
    assert kill_times(systemd, "main") == [5, 6, 8, 12]
    assert server.drain_reason == "unkillable user processes for job f1"
    server.terminate({"jobid": "f1", "reason": "cancel"})  # after the verdict
    assert clock.getDelayedCalls() == [] and len(systemd.kills_at) == 10


def test_a_terminate_loop_is_coalesced_to_one_resend_a_second(make_server):
    server, systemd, clock = make_server(**{"term-signal": "SIGUSR2"})
    start_job(server, systemd)
    for _ in range(41):  # one every 0.25 s for 10 s
        server.terminate({"jobid": "f1", "reason": "cancel"})
        clock.advance(0.25)
    assert kills_of(systemd, signal.SIGUSR2) == list(range(11))
    assert kill_times(systemd, "all") == sorted([*range(11), 5, 10])


def test_cancel_after_a_time_limit_sends_term_signal_and_stays_a_timeout(
    make_server,
):
    server, systemd, clock = make_server()
    responder = start_job(server, systemd, SDEXEC_TIME_LIMIT="1m")
    clock.pump([1] * 63)
    server.terminate({"jobid": "f1", "reason": "cancel"})
    assert systemd.kills_at == [
        (60, "all", signal.SIGALRM),
        (63, "all", signal.SIGTERM),
    ]
    systemd.change(UNIT, EXITED)
    finished = [r for r in responder.responses if r.get("type") == "finished"]
    assert finished == [{"type": "finished", "status": 0, "terminated": "timeout"}]
    assert clock.getDelayedCalls() == []


def test_terminate_before_the_job_started_waits_for_it(make_server):
    server, systemd, _ = make_server()
    server.exec(1, 1, job_payload(), Recorder())
    reply = server.terminate({"jobid": "f1", "reason": "cancel"})
    assert reply["step"] == "pending" and systemd.kills_at == []
    systemd.run(UNIT, pid=77)
    assert systemd.kills_at == [(0, "all", signal.SIGTERM)]


# -- time limits -----------------------------------------------------------------------


def test_time_limit_terminates_with_sigalrm(make_server):
    server, systemd, clock = make_server()
    start_job(server, systemd, SDEXEC_TIME_LIMIT="1m")
    clock.advance(59)
    assert systemd.kills_at == []
    clock.advance(1)
    assert systemd.kills_at == [(60, "all", signal.SIGALRM)]
    assert server.counters["job-timeouts"] == 1
    entry = server.stats()["job-exec"]["jobs"]["f1"]
    assert entry["termination"]["reason"] == "timeout"


@pytest.mark.parametrize(
    ("limit", "exit_at", "terminated"),
    [("1m", 61, {"terminated": "timeout"}), ("1m", 59, {}), ("0", 61, {})],
)
def test_finished_says_a_time_limit_ended_the_job(
    make_server, limit, exit_at, terminated
):
    # A job that traps SIGALRM and exits 0, or ignores it and dies of the
    # kill-signal, said nothing of its time limit: a bare 0 or 137.
    server, systemd, clock = make_server()
    responder = start_job(server, systemd, SDEXEC_TIME_LIMIT=limit)
    clock.advance(exit_at)
    systemd.change(UNIT, EXITED)
    finished = [r for r in responder.responses if r.get("type") == "finished"]
    assert finished == [{"type": "finished", "status": 0, **terminated}]


def test_a_time_limit_reached_while_cancelled_is_not_a_timeout(make_server):
    server, systemd, clock = make_server()
    responder = start_job(server, systemd, SDEXEC_TIME_LIMIT="1m")
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.advance(60)
    assert server.counters.get("job-timeouts", 0) == 0
    entry = server.stats()["job-exec"]["jobs"]["f1"]
    assert entry["termination"]["reason"] == "cancel"
    # it hears SIGALRM all the same, as upstream's timelimit_cb sends it
    assert kills_of(systemd, signal.SIGALRM) == [60]
    systemd.change(UNIT, EXITED)
    finished = [r for r in responder.responses if r.get("type") == "finished"]
    assert finished == [{"type": "finished", "status": 0, "terminated": "cancel"}]


def r_local(starttime: float, expiration: float) -> str:
    execution = {
        "R_lite": [{"rank": "0", "children": {"core": "0"}}],
        "starttime": starttime,
        "expiration": expiration,
    }
    return json.dumps({"version": 1, "execution": execution})


@pytest.mark.parametrize(
    ("late_by", "expires_after"),
    [
        (10, 90),  # 10 s late on a 100 s job: within 25 %, not extended
        (30, 100),  # 30 s late: beyond 25 %, the whole delay is added back
    ],
)
def test_time_limit_from_r_with_the_start_delay_extension(
    make_server, late_by, expires_after
):
    server, systemd, clock = make_server()
    R = r_local(START - late_by, START - late_by + 100)
    start_job(server, systemd, SDEXEC_R_LOCAL=R)
    entry = server.stats()["job-exec"]["jobs"]["f1"]
    assert entry["expiration"] == START + expires_after
    assert entry["time-limit"] == expires_after
    clock.advance(expires_after - 1)
    assert systemd.kills_at == []
    clock.advance(1)
    assert systemd.kills_at == [(expires_after, "all", signal.SIGALRM)]


def test_the_earlier_of_r_and_the_option_wins(make_server):
    server, systemd, _ = make_server()
    start_job(server, systemd, SDEXEC_R_LOCAL=r_local(START, START + 100),
              SDEXEC_TIME_LIMIT="30s")  # fmt: skip
    assert server.stats()["job-exec"]["jobs"]["f1"]["expiration"] == START + 30


# -- what stats and list show ---------------------------------------------------------


def test_jobs_in_stats_and_list(make_server):
    server, systemd, clock = make_server()
    start_job(server, systemd, SDEXEC_TIME_LIMIT="1h")
    proc = server.list()["procs"][0]
    assert (proc["pid"], proc["jobid"], proc["step"]) == (77, "f1", None)
    assert proc["label"] == ""  # none: a string, as upstream's C clients unpack it
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([0.5] * 52)
    entry = server.stats()["job-exec"]["jobs"]["f1"]
    assert {key: entry[key] for key in (
        "id", "pid", "unit", "state", "step", "kill-attempts", "time-limit",
        "expiration")} == {
        "id": "f1", "pid": 77, "unit": UNIT, "state": "R", "step": "kill-shell",
        "kill-attempts": 1, "time-limit": 3600.0, "expiration": START + 3600,
    }  # fmt: skip
    assert entry["termination"]["next"] == START + 30
    assert entry["stop-timer"]["state"] == "idle"
    assert server.list()["procs"][0]["step"] == "kill-shell"


@ensureDeferred
async def test_a_reaped_job_is_forgotten_with_its_timers(make_server):
    server, systemd, clock = make_server()
    start_job(server, systemd, SDEXEC_TIME_LIMIT="1h")
    server.terminate({"jobid": "f1", "reason": "cancel"})
    systemd.change(UNIT, {"SubState": "exited", "ExecMainCode": 1, "ExecMainStatus": 0})
    systemd.release(UNIT)  # the output reaches EOF on the reactor
    systemd.change(UNIT, INACTIVE)
    await until(lambda: not server.processes, "the job reaped")  # real reactor
    assert server.jobs.stats() == {}
    assert clock.getDelayedCalls() == []


def test_a_process_without_a_job_is_not_one(make_server):
    server, systemd, _ = make_server()
    payload = job_payload()
    del payload["cmd"]["opts"]["SDEXEC_JOBID"]
    server.exec(1, 1, payload, Recorder())
    systemd.run(UNIT, pid=77)
    assert server.stats()["job-exec"]["jobs"] == {}
    assert "jobid" not in server.list()["procs"][0]
    with pytest.raises(RequestError) as refused:
        server.terminate({"pid": 77, "reason": "cancel"})
    assert refused.value.errnum == errno.EINVAL
    assert "pid=77 runs no job (exec it with SDEXEC_JOBID)" in refused.value.errstr


def test_sdexec_cancel_reads_each_answer_for_no_job_as_naming_nothing(make_server):
    # `sdexec cancel N` tries its second target only where the service's
    # answer says the first names no job, which only its words tell (ESRCH
    # is also a job found ended, and an RFC 6 error carries nothing else):
    # words that drifted from the phrases both sides share
    # (sdexec.protocolbase) would quietly stop the retry.
    server, systemd, _ = make_server()
    payload = job_payload()
    del payload["cmd"]["opts"]["SDEXEC_JOBID"]
    server.exec(1, 1, payload, Recorder())
    systemd.run(UNIT, pid=77)  # a process that runs no job
    for target in ({"pid": 77}, {"pid": 78}, {"label": "none"}, {"jobid": "77"}):
        with pytest.raises(RequestError) as refused:
            server.terminate({**target, "reason": "cancel"})
        answer = RPCError(refused.value.errnum, refused.value.errstr)
        assert cli._names_nothing(answer, target), answer


def test_a_time_limit_alone_makes_a_job_named_by_its_unit(make_server):
    server, _, _ = make_server()
    payload = job_payload(SDEXEC_TIME_LIMIT="10s")
    del payload["cmd"]["opts"]["SDEXEC_JOBID"]
    server.exec(1, 1, payload, Recorder())
    assert list(server.stats()["job-exec"]["jobs"]) == [UNIT]


# -- bad requests ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "errnum", "text"),
    [
        ({"SDEXEC_TIME_LIMIT": "soon"}, errno.EINVAL, "SDEXEC_TIME_LIMIT: "),
        ({"SDEXEC_R_LOCAL": "{"}, errno.EINVAL, "SDEXEC_R_LOCAL: "),
        ({"SDEXEC_R_LOCAL": r_local(START, START - 5)}, errno.EINVAL,
         "SDEXEC_R_LOCAL: R: execution.expiration: "),
    ],
)  # fmt: skip
def test_a_bad_job_request_names_the_option(make_server, opts, errnum, text):
    server, _, _ = make_server()
    with pytest.raises(RequestError) as refused:
        server.exec(1, 1, job_payload(**opts), Recorder())
    assert refused.value.errnum == errnum
    assert refused.value.errstr.startswith(text)
    assert server.processes == {} and server.jobs.stats() == {}


def test_a_job_id_already_running_is_eexist(make_server):
    server, systemd, _ = make_server()
    start_job(server, systemd)
    with pytest.raises(RequestError) as refused:
        server.exec(1, 2, job_payload(SDEXEC_NAME="other"), Recorder())
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EEXIST,
        f"SDEXEC_JOBID: job f1 is running (pid 77 of the service's owner, uid"
        f" {os.getuid()})",
    )
    # Exited, its unit lingering: it said "is running" (review session 31
    # F F4).
    systemd.change(UNIT, {"SubState": "exited", "ExecMainCode": 1, "ExecMainStatus": 0})
    systemd.change(UNIT, DEACTIVATING)
    with pytest.raises(RequestError) as refused:
        server.exec(1, 3, job_payload(SDEXEC_NAME="other"), Recorder())
    assert refused.value.errstr == (
        "SDEXEC_JOBID: job f1 has exited, and its unit is still being stopped:"
        " its id is free once the unit is gone"
    )


@pytest.mark.parametrize(
    ("payload", "errnum", "text"),
    [
        ({"jobid": "f1"}, errno.EINVAL,
         'reason: expected "cancel" or "timeout", got null'),
        ({"jobid": "f1", "reason": "bored"}, errno.EINVAL,
         'reason: expected "cancel" or "timeout", got "bored"'),
        ({"reason": "cancel"}, errno.EINVAL,
         "terminate needs exactly one of pid, label or jobid"),
        ({"pid": 77, "jobid": "f1", "reason": "cancel"}, errno.EINVAL,
         "terminate needs exactly one of pid, label or jobid"),
        ({"pid": "77", "reason": "cancel"}, errno.EINVAL,
         'pid: expected an integer, got "77"'),
        ({"jobid": 7, "reason": "cancel"}, errno.EINVAL,
         "jobid: expected a string, got 7"),
        ({"jobid": "nope", "reason": "cancel"}, errno.ESRCH,
         "terminate jobid=nope not found"),
        ({"label": "nope", "reason": "cancel"}, errno.ESRCH,
         "terminate label=nope not found"),
        # A line break made it two lines; an escape code reached the client.
        ({"label": "a\nb", "reason": "cancel"}, errno.ESRCH,
         "terminate label='a\\nb' not found"),
        ({"jobid": "f\x1b[2J", "reason": "cancel"}, errno.ESRCH,
         "terminate jobid='f\\x1b[2J' not found"),
    ],
)  # fmt: skip
def test_a_bad_terminate_is_answered_over_the_wire(make_server, payload, errnum, text):
    server, systemd, _ = make_server()
    start_job(server, systemd)
    connection = Connection(server)
    try:
        connection.send(Topic.TERMINATE, payload, matchtag=9)
        assert connection.last() == {
            "type": "response", "topic": Topic.TERMINATE, "matchtag": 9,
            "errnum": errnum, "errstr": text,
        }  # fmt: skip
    finally:
        connection.close()


@pytest.mark.parametrize(
    "target",
    [
        {"pid": 77},
        # A null beside the one named is absent, as in kill, wait and
        # attach: it was "terminate needs exactly one of pid, label or jobid".
        {"pid": 77, "label": None},
        {"jobid": "f1", "pid": None, "label": None},
    ],
)
def test_terminate_over_the_wire_replies_with_the_jobs_state(make_server, target):
    server, systemd, _ = make_server()
    start_job(server, systemd)
    connection = Connection(server)
    try:
        connection.send(Topic.TERMINATE, {**target, "reason": "cancel"}, matchtag=9)
        reply = connection.last()["payload"]
        assert (reply["id"], reply["step"]) == ("f1", "term")
    finally:
        connection.close()


@settings(derandomize=True, max_examples=300, deadline=None)
@given(malformed_terminate_payloads)
def test_any_malformed_terminate_is_a_request_error(payload):
    clock = Clock()
    server = SdexecServer(FakeManager(), parse_config({}), reactor, clock=clock)
    with pytest.raises(RequestError) as refused:
        server.terminate(payload)
    assert refused.value.errnum in (errno.EINVAL, errno.ESRCH)


def test_the_stop_timer_takes_over_once_the_job_shell_died(make_server):
    # SDEXEC AND JOB TERMINATION INTERACTION: kill-signal ended the main
    # process, a task lingers in the unit; the sequence stops there and the
    # unit's stop timer (sdexec-stop-timer-sec, default 640 s) acts.
    server, systemd, clock = make_server()
    responder = start_job(server, systemd)
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([1] * 25)
    systemd.change(UNIT, {"SubState": "exited", "ExecMainCode": 2, "ExecMainStatus": 9})
    systemd.change(UNIT, DEACTIVATING)
    assert responder.responses[-1] == {
        "type": "finished",
        "status": signal.SIGKILL,
        "terminated": "cancel",
    }
    before = list(systemd.kills_at)
    clock.pump([1] * 639)
    assert systemd.kills_at == before  # the sequence ended with the shell
    clock.advance(1)
    assert systemd.kills_at[-1] == (25 + 640, "all", 10)
    entry = server.stats()["job-exec"]["jobs"]["f1"]
    assert (entry["step"], entry["stop-timer"]["state"]) == (None, "signaled")


def test_a_job_whose_client_left_is_not_declared_unkillable(make_server):
    # The client goes; its stream (and the job's view of `finished`) with it.
    # The main process exits; a task lingers. The next step finds the exit
    # and ends the sequence: no "unkillable job" drain, the stop timer's turn.
    server, systemd, clock = make_server(**{"kill-timeout": "1s"})
    connection = Connection(server)
    connection.send(Topic.EXEC, job_payload())
    systemd.run(UNIT, pid=77)
    server.terminate({"jobid": "f1", "reason": "cancel"})
    connection.close()
    systemd.change(UNIT, {"SubState": "exited", "ExecMainCode": 2, "ExecMainStatus": 9})
    systemd.change(UNIT, DEACTIVATING)
    clock.pump([1] * 12)
    assert kill_times(systemd, "all") == [0]
    assert server.drain_reason is None
    assert server.jobs.jobs["f1"].termination.step is TerminationStep.EXITED
    assert server.jobs.jobs["f1"].termination.next_at is None


def test_a_job_whose_exit_a_reset_cleared_has_still_exited(make_server):
    # Its client gone (so its `finished` reaches nobody), its unit failed
    # and was reset; should the reset clear ExecMain* (the model the
    # service keeps), the job has exited all the same: no termination
    # sequence for it, while a child still holds its outputs.
    server, systemd, _ = make_server()
    start_job(server, systemd)
    server.units[UNIT].client_gone()
    systemd.kills_at.clear()  # the main process's SIGKILL
    failed = {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
    systemd.change(UNIT, {**failed, "ExecMainCode": 1, "ExecMainStatus": 1})
    assert ("reset", UNIT) in systemd.calls
    systemd.change(UNIT, {**failed, "ExecMainCode": 0, "ExecMainStatus": 0})
    systemd.change(UNIT, {"ActiveState": "inactive", "SubState": "dead"})
    assert server.processes  # its outputs still open
    with pytest.raises(RequestError) as late:
        server.terminate({"jobid": "f1", "reason": "cancel"})
    assert (late.value.errnum, late.value.errstr) == (
        errno.ESRCH,
        "job f1 has already exited",
    )
    assert systemd.kills_at == []


# -- a termination that runs out while systemd is away ---------------------


def outage_server(make_server):
    """A server whose systemd may be lost and restored, its outage handled
    as the service handles it."""
    server, systemd, clock = make_server(**{"kill-timeout": "1s", "max-kill-count": 4})
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    return server, systemd, clock


@pytest.mark.parametrize("ran_out", ["while away", "before the re-read"])
def test_a_job_s_verdict_waits_for_its_unit_s_re_read(make_server, ran_out):
    # Given once systemd was connected again, but before the unit was read
    # (thousands of re-reads queue in the call window): a job that exited
    # during the outage drained the node, EDEADLK for its stream.
    server, systemd, clock = outage_server(make_server)  # the verdict at 12 s
    responder = start_job(server, systemd)
    systemd.lose()
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([0.5] * (26 if ran_out == "while away" else 23))
    systemd.units[UNIT].update({**EXITED, "ExecMainStatus": 0})  # meanwhile
    systemd.hold_refresh = True
    systemd.restore()
    clock.pump([0.5] * 4)  # past the verdict and a kill-timeout
    assert server.drain_reason is None
    systemd.answer_refreshes()  # the re-read
    systemd.answer_refreshes()  # the receipt it asks for
    clock.pump([0.5] * 4)
    assert server.drain_reason is None
    assert CANCELLED_0 in responder.responses


def held_verdict(make_server, term_lost: bool = False):
    """A job cancelled (kill-timeout 1 s) as systemd goes away, whose
    sequence ran out while away: its verdict held for systemd's return.
    Its SIGTERM went out before the loss, unless ``term_lost``."""
    server, systemd, clock = outage_server(make_server)
    start_job(server, systemd)
    if term_lost:
        systemd.lose()
    server.terminate({"jobid": "f1", "reason": "cancel"})
    if not term_lost:
        systemd.lose()
    clock.pump([0.5] * 26)
    return server, systemd, clock


def signalled_once_then_drained(server, systemd, clock, sent: int) -> None:
    """One kill-signal to the job shell since ``sent``, then, kill-timeout
    later, the verdict."""
    clock.pump([0.1] * 5)
    assert server.drain_reason is None
    assert [who for _, who, _ in systemd.kills_at[sent:]] == ["main"]
    clock.pump([0.1] * 10)
    assert server.drain_reason == "unkillable user processes for job f1"


def test_a_held_verdict_waits_again_when_systemd_leaves_during_the_re_read(
    make_server,
):
    # The failed re-read fired its waiters as if read: the "once more"
    # kill-signal went nowhere, and the node drained after the next return
    # with no signal sent since (review session 31 F F2).
    server, systemd, clock = held_verdict(make_server)
    systemd.hold_refresh = True
    systemd.restore()  # back: the unit's re-read is asked for...
    systemd.lose()  # ...and lost with the connection before it answers
    held, systemd._held = systemd._held, []
    for _, answer in held:
        answer.errback(reconnecting())
    clock.advance(0.3)
    systemd.hold_refresh = False
    sent = len(systemd.kills_at)
    systemd.restore()  # back again: read at once
    signalled_once_then_drained(server, systemd, clock, sent)


def test_a_verdict_due_after_a_new_loss_waits_for_the_return(make_server):
    # Its last kill-signal went out before systemd left again, and may have
    # been lost with it: the verdict came all the same once back.
    server, systemd, clock = held_verdict(make_server)
    systemd.restore()
    clock.pump([0.1] * 2)  # the once-more signal sent, the verdict armed
    sent = len(systemd.kills_at)
    systemd.lose()
    systemd.restore()
    signalled_once_then_drained(server, systemd, clock, sent)


def test_a_re_read_lost_late_does_not_stand_for_the_one_after_it(make_server):
    # The first re-read's failure came after systemd's second return: it
    # ended the re-reading, and the verdict drained the node for a job that
    # had exited meanwhile (review session 31 J F2).
    server, systemd, clock = held_verdict(make_server)
    systemd.hold_refresh = True
    systemd.restore()  # the first re-read, held
    systemd.lose()
    first, systemd._held = systemd._held, []
    systemd.restore()  # the second, held
    systemd.units[UNIT].update({**EXITED, "ExecMainStatus": 0})  # meanwhile
    for _, answer in first:
        answer.errback(reconnecting())  # the first one's failure, late
    clock.pump([0.1] * 15)
    assert server.drain_reason is None
    systemd.answer_refreshes()  # the second re-read: it has exited
    systemd.answer_refreshes()  # the receipt it asks for
    clock.pump([0.1] * 15)
    assert server.drain_reason is None


def test_a_systemd_that_keeps_coming_back_puts_a_verdict_off_once(make_server):
    # Each return put the verdict off by a whole kill-timeout: a manager
    # leaving and returning faster than that never let it come, and an
    # unkillable job never drained the node (review session 31 J F1).
    server, systemd, clock = held_verdict(make_server)
    systemd.restore()  # the once-more signal, the verdict 1 s later
    clock.pump([0.25] * 2)
    for _ in range(10):  # away and back every 0.5 s
        systemd.lose()
        systemd.restore()
        clock.pump([0.25] * 2)
    assert server.drain_reason == "unkillable user processes for job f1"


@ensureDeferred
async def test_a_held_verdict_dies_with_its_job(make_server):
    # Reaped (its client left) before its re-read answered: the verdict
    # held for systemd still came, and drained the node for a job gone.
    server, systemd, clock = outage_server(make_server)
    connection = Connection(server)
    connection.send(Topic.EXEC, job_payload())
    systemd.run(UNIT, pid=77)
    systemd.lose()
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([0.5] * 26)  # held
    connection.close()
    systemd.hold_refresh = True
    systemd.stop_to_inactive = True
    systemd.restore()
    await until(lambda: not server.processes, "reaped")
    systemd.answer_refreshes()
    clock.pump([0.5] * 10)
    assert server.drain_reason is None


def test_the_stop_timer_waits_for_the_unit_s_re_read(make_server):
    # Its second period ended after the return, before the re-read: a unit
    # whose lingering child died during the outage was abandoned.
    server, systemd, clock = make_server(**{"sdexec-stop-timer-sec": 10})
    outage = SystemdOutage(server)
    systemd.on_lost, systemd.on_restored = outage.lost, outage.restored
    start_job(server, systemd)
    systemd.change(UNIT, {**EXITED, "ExecMainStatus": 0})
    systemd.change(UNIT, DEACTIVATING)  # a child lingers
    clock.pump([1] * 10)  # the stop-timer signal
    systemd.lose()
    clock.pump([1] * 9)
    systemd.units[UNIT].update(INACTIVE)  # the child died meanwhile
    systemd.hold_refresh = True
    systemd.restore()
    clock.pump([0.5] * 2)  # the second period's end
    assert server.drain_reason is None
    systemd.answer_refreshes()
    assert server.drain_reason is None
    assert server.units == {} or server.units[UNIT].stop_timer.state.value == "stopped"


def test_a_job_declared_unkillable_is_still_running_for_terminate_and_ps(
    make_server,
):
    # It was taken for exited: terminate said "has already exited", ps "Z".
    server, _ = declared_unkillable(make_server)
    (listed,) = server.list()["procs"]
    assert (listed["state"], listed["step"]) == ("R", "unkillable")
    assert server.terminate({"jobid": "f1", "reason": "cancel"})["step"] == (
        "unkillable"
    )


def test_a_job_declared_unkillable_whose_client_leaves_gets_its_sigkill(make_server):
    # Its stream ended with EDEADLK, it was taken for exited: the client's
    # close only stopped the unit (SIGTERM), and a job shell that survived
    # a non-default kill-signal ran on (review 38 T4-1).
    server, systemd = declared_unkillable(make_server)
    before = len(systemd.kills_at)
    for process in server.connection_processes(1):
        process.client_gone()
    assert [(who, signum) for _, who, signum in systemd.kills_at[before:]] == [
        ("main", signal.SIGKILL)
    ]


def test_a_verdict_held_for_systemd_is_no_unkillable_step(make_server):
    # Held (systemd away), ps said "unkillable", and still so once the job
    # exited after systemd's return: the node was never drained.
    server, systemd, clock = outage_server(make_server)
    start_job(server, systemd)
    systemd.lose()
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([0.5] * 26)
    assert server.list()["procs"][0]["step"] == "kill-shell"
    systemd.restore()
    systemd.change(UNIT, {**EXITED, "ExecMainStatus": 9})
    assert server.drain_reason is None
    assert server.list()["procs"][0].get("step") is None


@pytest.mark.parametrize("exits_meanwhile", [False, True], ids=["runs", "exited"])
def test_a_termination_run_out_while_systemd_is_away_is_judged_once_back(
    make_server, exits_meanwhile
):
    # Every KillUnit failed with systemd: the job was declared unkillable
    # and the node drained for good, whether it had been signalled at all
    # or had exited meanwhile.
    server, systemd, clock = outage_server(make_server)
    responder = start_job(server, systemd)
    systemd.lose()
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.pump([0.5] * 26)  # the 12 s of the sequence, and a second
    assert server.drain_reason is None and len(responder.responses) == 1
    if exits_meanwhile:
        systemd.units[UNIT].update({**EXITED, "ExecMainStatus": 0})
    systemd.restore()  # its unit re-read
    clock.pump([0.5] * 4)
    if exits_meanwhile:
        assert server.drain_reason is None
        assert CANCELLED_0 in responder.responses
    else:
        assert systemd.kills_at[-1][1:] == ("main", signal.SIGKILL)  # once more
        assert server.drain_reason == "unkillable user processes for job f1"


# -- step 1's signal, lost while systemd is away --------------------------------


def test_a_term_signal_lost_with_systemd_is_sent_again_before_the_next_step(
    make_server,
):
    # Its KillUnit failed (systemd away): the job never got SIGTERM (its
    # trap saves a checkpoint), and the first signal it got once systemd
    # was back was SIGKILL.
    server, systemd, clock = outage_server(make_server)  # kill-timeout 1 s
    start_job(server, systemd)
    systemd.lose()
    server.terminate({"jobid": "f1", "reason": "cancel"})
    clock.advance(0.5)
    systemd.restore()
    clock.pump([0.5] * 5)
    assert systemd.kills_at[1:3] == [
        (0.5, "all", signal.SIGTERM),
        (1.5, "all", signal.SIGKILL),  # a kill-timeout after it, not at 1 s
    ]


def test_a_lost_term_signal_comes_before_a_held_verdict_s_kill_signal(make_server):
    # The sequence ran out while away: once back, the job shell got
    # SIGKILL at once, and never SIGTERM.
    server, systemd, clock = held_verdict(make_server, term_lost=True)
    sent = len(systemd.kills_at)
    systemd.restore()
    clock.pump([0.1] * 5)
    assert systemd.kills_at[sent:] == [(13.0, "all", signal.SIGTERM)]
    assert server.drain_reason is None
    clock.pump([0.1] * 10)
    assert [k[1:] for k in systemd.kills_at[sent:]] == [
        ("all", signal.SIGTERM),
        ("main", signal.SIGKILL),
    ]
    clock.pump([0.1] * 11)
    assert server.drain_reason == "unkillable user processes for job f1"


def test_a_lost_term_signal_is_sent_again_once(make_server):
    # A systemd that keeps leaving and returning would otherwise put each
    # step off by a kill-timeout, for ever.
    server, systemd, clock = outage_server(make_server)
    start_job(server, systemd)
    systemd.lose()
    server.terminate({"jobid": "f1", "reason": "cancel"})
    for _ in range(40):  # away and back every 0.5 s, for 20 s
        clock.pump([0.25] * 2)
        systemd.restore()
        systemd.lose()
    systemd.restore()
    clock.pump([0.5] * 10)
    terms = [k for k in systemd.kills_at if k[2] == signal.SIGTERM]
    assert len(terms) == 2  # the first, and its one re-send
    assert server.drain_reason == "unkillable user processes for job f1"
