"""The device fence canary (issue 10, item 2): the verdict from the canary's
exit, the service's reaction (drain or warn, counters, stats), offline on
the fake manager; then against the real manager, where the verdict must be
what the node really does.

On these cgroup v1 machines the user manager stores ``DevicePolicy`` and
enforces nothing, so the canary finds the fence not enforced; on a node
whose manager applies device filters (a system manager) it finds it
enforced. The integration tests measure the node first, with a unit of
their own, and expect the service to agree.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest
from offline import NOT_DRAINED, Connection, drained_by, error_of
from pytest_twisted import ensureDeferred
from support import run, until
from twisted.internet import reactor
from twisted.internet.task import Clock

from sdexec.config import parse_config
from sdexec.containment import Containment
from sdexec.devicefence import (
    CANARY_SCRIPT,
    CANARY_TIMEOUT_SECONDS,
    CANARY_UNLIMITED,
    PROBE,
    CanaryContext,
    DeviceCanary,
    canary_plan,
    canary_verdict,
)
from sdexec.drain import AdminCause
from sdexec.execstart import read_back_intact
from sdexec.leftovers import owner_marks
from sdexec.plan import RequestError
from sdexec.property import UnitProperty
from sdexec.server import SdexecServer
from sdexec.systemd import SystemdError
from sdexec.systemd.errors import connection_lost
from sdexec.systemd.unit import wait_status
from sdexec.testing import EXITED, INACTIVE, RUNNING, FakeManager

NOT_ENFORCED = (
    "DevicePolicy not enforced: the user manager cannot load device filters;"
    " run sdexec under the system manager"
)


def exited(code: int) -> int:
    return wait_status(1, code)


# -- the verdict -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "stderr", "bus", "verdict"),
    [
        (exited(1), "sh: 1: cannot open /dev/zero: Operation not permitted", "user",
         None),
        (exited(0), "", "user", NOT_ENFORCED),
        (exited(0), "", "system", "DevicePolicy not enforced: /dev/zero opened in a"
         " DevicePolicy=strict unit of the system manager (is the devices controller"
         " or BPF available?)"),
        (exited(10), "sh: cannot open /dev/null: Operation not permitted\n", "user",
         "DevicePolicy could not be verified: the allowed /dev/null could not be"
         " opened either: sh: cannot open /dev/null: Operation not permitted"),
        (exited(11), "", "user",
         "DevicePolicy could not be verified: this node has no /dev/zero to probe"),
        (exited(2), "", "user",
         "DevicePolicy could not be verified: the canary exited with status 2"),
        (9, "", "user",
         "DevicePolicy could not be verified: the canary was killed by SIGKILL"),
        (None, "ENOENT: no such file", "user",
         "DevicePolicy could not be verified: the canary did not run: ENOENT: no"
         " such file"),
    ],
)  # fmt: skip
def test_the_verdict_follows_the_canarys_exit(status, stderr, bus, verdict):
    assert canary_verdict(status, stderr, bus) == verdict


#: The shells a node's /bin/sh may be (those this machine has).
SHELLS = [shell for shell in ("/bin/sh", "dash", "bash") if shutil.which(shell)]


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(("device", "status"), [("/dev/null", 0), ("/nonexistent", 1)])
def test_the_probe_says_opened_or_refused_alike_in_every_shell(shell, device, status):
    # A refused redirection is status 2 in dash, 1 in bash: left to it, a
    # fence that held read as "could not be verified" where sh is dash.
    probe = subprocess.run(
        [shell, "-c", PROBE.format(device=device)], capture_output=True, check=False
    )
    assert probe.returncode == status


def test_the_canary_does_not_carry_the_site_s_gates():
    # A health file not written yet at start kept the canary from running,
    # and drained the node until an admin's undrain (review session 32 Y1).
    site = {"ConditionPathExists": "/run/node-ok", "AssertPathExists": "/run/ok"}
    config = parse_config({"exec": {"sdexec-properties": {**site, "Nice": "5"}}})
    names = {prop.name for prop in canary_plan(config).properties}
    assert "Nice" in names and not names & {"Conditions", "Asserts"}


#: A site's limits sized for jobs, too small for the canary's shell: each
#: failed or killed it on a node whose device policy held (an OOM kill at
#: MemoryMax=1M where the memory controller holds, no fd for the probe at
#: LimitNOFILE=3 anywhere), and the node was drained for "DevicePolicy
#: could not be verified".
JOB_LIMITS = {
    "MemoryMax": "1M",
    "MemoryHigh": "1M",
    "StartupMemoryMax": "1M",
    "TasksMax": "1",
    "CPUQuotaPerSecUSec": "10000",
    "RuntimeMaxUSec": "1000",
    "LimitNOFILE": "3",
    "LimitNOFILESoft": "3",
    "LimitAS": "64K",
}


def test_the_canary_does_not_take_a_job_s_limits_but_keeps_the_sandbox():
    sandbox = {"PrivateDevices": "yes", "ProtectSystem": "strict", "Nice": "5"}
    config = parse_config({"exec": {"sdexec-properties": {**JOB_LIMITS, **sandbox}}})
    plan = canary_plan(config)
    names = {prop.name for prop in plan.properties}
    assert set(JOB_LIMITS) <= CANARY_UNLIMITED
    assert not names & set(JOB_LIMITS)
    # What decides what /dev holds for a job decides it for the canary.
    assert set(sandbox) <= names
    assert not plan.memory_capped


def test_the_canary_unit_is_strict_allows_only_dev_null_and_probes_dev_zero():
    config = parse_config({"sdexec": {"slice": "jobs.slice"}})
    plan = canary_plan(config)
    properties = {prop.name: prop.value for prop in plan.properties}
    assert properties["DevicePolicy"] == "strict"
    assert properties["DeviceAllow"] == [["/dev/null", "rw"]]
    assert properties["Slice"] == "jobs.slice"  # where the jobs would run
    # As it is, no trampoline: the site's sandbox need not hold Python.
    assert read_back_intact("/bin/sh", ["/bin/sh", "-c", CANARY_SCRIPT])
    assert properties["ExecStart"] == [
        ["/bin/sh", ["/bin/sh", "-c", CANARY_SCRIPT], False]
    ]
    assert plan.unit_name.startswith("sdexec-device-canary-")
    assert plan.fence is None and not plan.mapped


# -- the service's reaction, offline ----------------------------------------------


def contained_config(check: str = "drain") -> dict:
    return {
        "exec": {"sdexec-constrain-resources": True},
        "sdexec": {"containment-check": check},
    }


def offline_server(
    check: str = "drain", constrain: bool = True, marks: tuple[str, ...] = ()
):
    table = contained_config(check)
    table["exec"]["sdexec-constrain-resources"] = constrain
    config = parse_config(table)
    systemd = FakeManager()
    systemd.stop_to_inactive = True
    clock = Clock()
    server = SdexecServer(
        systemd, config, reactor, Containment(config, None), clock=clock, marks=marks
    )
    return server, systemd, clock


def canary_unit(systemd: FakeManager) -> str:
    (name,) = [call[1] for call in systemd.calls if call[0] == "start"]
    return name


def last_canary_unit(systemd: FakeManager) -> str:
    return [call[1] for call in systemd.calls if call[0] == "start"][-1]


def run_canary(systemd: FakeManager, code: int, unit: str | None = None) -> None:
    """The canary (the only one, unless ``unit``) runs and exits with
    ``code``, as systemd would report it."""
    unit = unit or canary_unit(systemd)
    systemd.run(unit)
    state = {**EXITED, "ExecMainStatus": code}
    if code != 0:  # a non-zero exit leaves the unit failed; the reset unloads it
        state |= {"ActiveState": "failed", "SubState": "failed"}
    systemd.change(unit, state)
    systemd.release(unit)
    systemd.change(unit, INACTIVE)


def test_the_canary_needs_only_its_context_not_the_server():
    # The canary's state machine was the server's own (review session 34
    # C F2): it runs, is abandoned and judged through its context alone.
    started: list = []
    abandoned: list = []
    broken: list = []
    canary = DeviceCanary(
        CanaryContext(
            config=lambda: parse_config(contained_config()),
            containment_enabled=lambda: True,
            systemd_connected=lambda: True,
            units_refused=lambda: None,
            clock=Clock,
            start_process=lambda plan, responder: started.append(responder) or (0, 7),
            abandon=abandoned.append,
            fence_broken=lambda problems, counter, cause: broken.append(
                (counter, cause)
            ),
        )
    )
    verdicts: list = []
    canary.verify().addBoth(verdicts.append)
    (responder,) = started
    responder.respond({"type": "finished", "status": exited(0)})
    responder.error(errno.ENODATA, "end of stream")
    assert abandoned == [(0, 7)]
    assert broken == [("device-fence-failures", AdminCause.DEVICE_FENCE)]
    assert canary.verdict == {"enforced": False, "problem": NOT_ENFORCED}


async def reaped(server: SdexecServer) -> None:
    """Wait (a bounded while) for the canary's output EOF and its reaping."""
    await until(lambda: not server.processes, "the canary reaped")


@ensureDeferred
async def test_the_canary_carries_the_services_mark():
    # A service that crashed while it ran finds it among its leftovers: the
    # unit remains after its probe exits, until someone stops it.
    server, systemd, _ = offline_server(marks=(" [sdexec:0123456789ab]",))
    server.verify_devices()
    (description,) = [
        prop.value
        for prop in systemd.properties[canary_unit(systemd)]
        if prop.name == "Description"
    ]
    assert description.endswith(" [sdexec:0123456789ab]")
    systemd.run(canary_unit(systemd))
    await server.shutdown(grace=10)


def test_a_canary_out_of_descriptors_is_not_a_verified_fence(monkeypatch):
    def exhausted():
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("sdexec.process.socketpair_for_systemd", exhausted)
    server, _systemd, _ = offline_server()
    verdicts: list = []
    server.verify_devices().addBoth(verdicts.append)
    # What failed, in the system's words: not Python's "[Errno 24] ...",
    # which a drain reason, `sdexec undrain` and every refused exec repeat.
    assert verdicts == [
        "DevicePolicy could not be verified: the canary could not be started:"
        " Too many open files"
    ]
    assert server.processes == {}  # nothing for a shutdown to wait on


def test_no_canary_without_containment():
    server, systemd, _ = offline_server(constrain=False)
    seen: list = []
    server.verify_devices().addBoth(seen.append)
    assert seen == [None]
    assert systemd.calls == []
    assert server.stats()["device-fence"] is None


@ensureDeferred
async def test_an_enforced_fence_is_recorded_and_the_canary_reaped():
    server, systemd, _ = offline_server()
    verdict = server.verify_devices()
    run_canary(systemd, 1)
    assert await verdict is None
    assert server.drain_reason is None
    assert server.stats()["device-fence"] == {"enforced": True, "problem": None}
    assert ("reset", canary_unit(systemd)) in systemd.calls
    await reaped(server)


@ensureDeferred
async def test_no_client_can_kill_the_canary():
    # sdexec.list showed its pid, and a kill by it drained the node: "could
    # not be verified: the canary was killed by signal 9" (review session 31
    # C F2).
    server, systemd, _ = offline_server()
    verdict = server.verify_devices()
    unit = canary_unit(systemd)
    systemd.run(unit)
    connection = Connection(server)
    connection.send("sdexec.kill", {"pid": RUNNING["ExecMainPID"], "signum": 9})
    assert error_of(connection.last())[0] == errno.ESRCH
    assert systemd.signalled == []
    run_canary(systemd, 1, unit)  # the device refused it: enforced
    assert await verdict is None
    assert server.drain_reason is None
    connection.close()
    await reaped(server)


@ensureDeferred
async def test_an_unenforced_fence_drains_the_node_and_is_counted():
    server, systemd, _ = offline_server()
    verdict = server.verify_devices()
    run_canary(systemd, 0)
    assert await verdict == NOT_ENFORCED
    stats = server.stats()
    assert stats["drain"] == drained_by(NOT_ENFORCED, "device-fence")
    assert stats["requests"]["device-fence-failures"] == 1
    assert stats["device-fence"] == {"enforced": False, "problem": NOT_ENFORCED}
    await reaped(server)


@ensureDeferred
async def test_warn_counts_and_logs_but_does_not_drain():
    server, systemd, _ = offline_server(check="warn")
    verdict = server.verify_devices()
    run_canary(systemd, 0)
    assert await verdict is None  # nothing refused: the admin chose to carry on
    assert server.drain_reason is None
    assert server.counters["device-fence-failures"] == 1
    assert server.stats()["device-fence"]["enforced"] is False
    await reaped(server)


@ensureDeferred
async def test_a_canary_systemd_refuses_is_not_a_verified_fence():
    server, systemd, _ = offline_server()
    systemd.refuse_start = SystemdError(
        "org.freedesktop.DBus.Error.InvalidArgs",
        "Unit sdexec-device-canary.service has a bad unit file setting.",
    )
    problem = await server.verify_devices()
    assert problem == (
        "DevicePolicy could not be verified: the canary did not run:"
        " Unit sdexec-device-canary.service has a bad unit file setting."
    )
    assert server.drain_reason == problem
    assert server.processes == {}


@pytest.mark.parametrize("away", ["before the canary", "during its start"])
@ensureDeferred
async def test_a_canary_systemd_was_away_for_runs_again_once_it_is_back(away):
    # A SIGHUP during a daemon-reexec used to drain the node for a canary
    # that could not run ("DevicePolicy could not be verified"), and the
    # outage's end did not lift it: jobs were refused until an undrain.
    server, systemd, _ = offline_server()
    if away == "before the canary":
        systemd.lose()
    else:  # the connection lost while its start was on the bus
        systemd.refuse_start = connection_lost("the D-Bus connection closed")
    assert await server.verify_devices() is None
    assert (server.drain_reason, server.device_canary.verdict) == (None, None)
    systemd.refuse_start = None
    systemd.restore()
    server.systemd_restored()
    run_canary(systemd, 0, unit=last_canary_unit(systemd))
    await until(lambda: server.drain_reason is not None, "the canary's verdict")
    assert server.drain_reason == NOT_ENFORCED
    await reaped(server)


@pytest.mark.parametrize("outage_kind", ["longer than its timeout", "its unit lost"])
@ensureDeferred
async def test_a_canary_that_ran_across_an_outage_is_run_again(outage_kind):
    # Its start accepted, then systemd away: past the canary's 30 s (a slow
    # daemon-reexec), or restarted and its unit lost. Either was taken for
    # a verdict ("could not be verified"), and the node stayed drained.
    server, systemd, clock = offline_server()
    verdict = server.verify_devices()
    unit = canary_unit(systemd)
    systemd.lose()
    if outage_kind == "longer than its timeout":
        clock.advance(CANARY_TIMEOUT_SECONDS + 1)
        assert await verdict is None
        systemd.restore()
        server.systemd_restored()
    else:  # a new manager that never heard of the transient unit
        systemd.units[unit] = {"LoadState": "not-found", "ActiveState": "inactive"}
        systemd.release(unit)
        systemd.restore()
        server.systemd_restored()
        assert await verdict is None
    assert server.drain_reason is None
    again = last_canary_unit(systemd)
    assert again != unit
    run_canary(systemd, 1, unit=again)
    await until(
        lambda: server.device_canary.verdict is not None, "the new canary's verdict"
    )
    assert server.device_canary.verdict == {"enforced": True, "problem": None}
    await reaped(server)


@ensureDeferred
async def test_one_return_of_systemd_runs_one_canary_and_judges_it_once():
    # One canary owed by a reload during the outage, and one that ran
    # across it: both ran again, both were judged, the failure counted twice.
    server, systemd, _ = offline_server()
    server.verify_devices()
    across = canary_unit(systemd)
    systemd.run(across)
    systemd.lose()
    server.verify_devices()  # a reload's, owed
    systemd.restore()
    server.systemd_restored()
    run_canary(systemd, 0, unit=across)
    await until(lambda: across not in server.units, "the first canary's end")
    starts = [call[1] for call in systemd.calls if call[0] == "start"]
    assert len(starts) == 2
    run_canary(systemd, 0, unit=starts[1])
    await until(lambda: server.device_canary.verdict is not None, "the verdict")
    assert server.counters["device-fence-failures"] == 1
    await reaped(server)


def test_no_canary_starts_once_the_service_is_stopping():
    # One owed for systemd's return was started during the shutdown: a unit
    # begun after STOPPING=1, which the shutdown then waited for.
    server, systemd, _ = offline_server()
    systemd.lose()
    server.verify_devices()  # a reload's, owed
    server.shutdown(10)
    systemd.restore()
    server.systemd_restored()
    assert [call for call in systemd.calls if call[0] == "start"] == []


def test_a_canary_that_cannot_be_planned_is_not_a_verified_fence(monkeypatch):
    def no_shell(config):
        raise RequestError(errno.ENOENT, "/bin/sh: command not found")

    monkeypatch.setattr("sdexec.devicefence.canary_plan", no_shell)
    server, systemd, _ = offline_server()
    seen: list = []
    server.verify_devices().addBoth(seen.append)
    problem = "DevicePolicy could not be verified: /bin/sh: command not found"
    assert seen == [problem]
    assert server.drain_reason == problem
    assert systemd.calls == []


@ensureDeferred
async def test_a_canary_with_no_verdict_times_out_and_is_stopped():
    server, systemd, clock = offline_server()
    verdict = server.verify_devices()
    systemd.run(canary_unit(systemd))
    clock.advance(CANARY_TIMEOUT_SECONDS)
    problem = await verdict
    assert problem == (
        "DevicePolicy could not be verified: the canary gave no verdict in 30 s"
    )
    assert ("stop", canary_unit(systemd)) in systemd.calls
    assert server.drain_reason == problem
    await reaped(server)  # stopped to inactive, fds released, reaped


@ensureDeferred
async def test_a_leftover_scan_while_the_canary_runs_knows_it_for_its_own():
    # It carries the service's mark: a scan (after a reconnection, say)
    # took it for a leftover, failed on its watch, and adopted nothing.
    marks = owner_marks("unix:/run/user/1000/sdexec/sdexec.sock")
    server, systemd, _ = offline_server(marks=marks)
    server.verify_devices()
    canary = canary_unit(systemd)
    systemd.run(canary)
    systemd.units["old.service"] = {**RUNNING, "ExecMainPID": 77}
    systemd.properties["old.service"] = [
        UnitProperty("Description", "s", f"sleep 300{marks[0]}")
    ]
    outcome: list = []
    server.leftovers.scan().addBoth(outcome.append)
    assert outcome == [None]
    stopped = [call[1] for call in systemd.calls if call[0] == "stop"]
    assert stopped == ["old.service"]
    await server.shutdown(grace=10)


@ensureDeferred
async def test_a_shutdown_before_the_verdict_cancels_the_canary_and_its_timer():
    server, systemd, clock = offline_server()
    verdicts: list = []
    server.verify_devices().addBoth(verdicts.append)
    systemd.run(canary_unit(systemd))
    await server.shutdown(grace=10)  # the canary's unit stopped and reaped
    assert ("stop", canary_unit(systemd)) in systemd.calls
    assert verdicts == [None]
    assert clock.getDelayedCalls() == []  # the 30 s timer went with the canary
    clock.advance(CANARY_TIMEOUT_SECONDS)
    assert (server.drain_reason, server.device_canary.verdict) == (None, None)


# -- the real manager ----------------------------------------------------------------


def node_enforces_device_policy() -> bool:
    """Measured apart from the service: can a ``DevicePolicy=strict`` unit
    of the test manager read one byte of /dev/zero (with ``head``, not the
    canary's shell redirection)?"""
    probe = subprocess.run(
        ["systemd-run", "--user", "--wait", "--pipe", "--quiet",
         "-p", "DevicePolicy=strict", "-p", "DeviceAllow=/dev/null rw",
         "head", "-c", "1", "/dev/zero"],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    opened = probe.returncode == 0 and probe.stdout == b"\0"
    refused = probe.returncode != 0 and b"Operation not permitted" in probe.stderr
    assert opened or refused, f"the probe is inconclusive: {probe}"
    return refused


def contained(check: str = "drain") -> dict[str, str]:
    """``start_service`` arguments: containment on, the small topology."""
    topology = Path(__file__).resolve().parent / "data" / "small.xml"
    return {
        "exec": "sdexec-constrain-resources = true",
        "sdexec": f'topology = "{topology}"\ncontainment-check = "{check}"',
    }


@pytest.mark.systemd
@ensureDeferred
async def test_the_canary_agrees_with_the_node(start_service):
    enforced = node_enforces_device_policy()
    service = await start_service(**contained("drain"))
    stats = service.server.stats()
    problem = None if enforced else NOT_ENFORCED
    assert stats["device-fence"] == {"enforced": enforced, "problem": problem}
    assert stats["drain"] == (
        drained_by(problem, "device-fence") if problem else NOT_DRAINED
    )
    client = await service.connect()
    result = await run(client, ["/bin/true"])
    if enforced:
        assert result.status == 0
    else:  # drained at start: no job runs on a node whose devices are open
        assert result.error.errnum == errno.EIO
        assert NOT_ENFORCED in result.error.errstr


@pytest.mark.systemd
@ensureDeferred
async def test_a_site_s_job_limits_do_not_decide_the_canary_s_verdict(
    start_service,
):
    # Those the real manager holds here, whatever the node: the memory cap
    # where the memory controller holds it (an OOM kill), the fd limit
    # everywhere (no fd for the probe's redirection).
    enforced = node_enforces_device_policy()
    limits = 'MemoryMax = "1M"\nLimitNOFILE = "3"\nLimitNOFILESoft = "3"'
    service = await start_service(
        **contained("warn"), extra=f"[exec.sdexec-properties]\n{limits}"
    )
    problem = None if enforced else NOT_ENFORCED
    assert service.server.stats()["device-fence"] == {
        "enforced": enforced,
        "problem": problem,
    }


@pytest.mark.systemd
@ensureDeferred
async def test_a_reload_that_turns_containment_off_drops_the_verdict(start_service):
    service = await start_service(**contained("warn"))
    assert service.server.stats()["device-fence"] is not None
    assert await service.reload() is True  # no containment
    assert service.server.stats()["device-fence"] is None


@pytest.mark.systemd
@ensureDeferred
async def test_each_reload_runs_the_canary_again(start_service):
    enforced = node_enforces_device_policy()  # the node's, not the service's
    service = await start_service(**contained("warn"))
    await until(lambda: not service.server.processes, "the first canary reaped")
    reaped = service.server.counters["reaped"]
    assert await service.reload(**contained("drain")) is True
    # The reload's canary runs in the background: one more unit reaped (on
    # an enforcing node its verdict alone would not show it ran again).
    await until(
        lambda: service.server.counters["reaped"] == reaped + 1, "a second canary"
    )
    failures = service.server.counters["device-fence-failures"]
    assert service.server.stats()["device-fence"]["enforced"] is enforced
    assert failures == (0 if enforced else 2)
    assert service.server.drain_reason == (None if enforced else NOT_ENFORCED)
