"""The unit properties sdexec types, against the real user manager: each
converted property's D-Bus type is the one the manager itself shows, a
site's values of them reach a job that runs, and the largest it takes read
back as sent at a daemon-reload.

Which properties the manager knows is read from the node (the manager's own
introspection of a service unit), never assumed: a name newer than the
manager is left out, as the manager would refuse it with "unknown property".
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ElementTree

import pytest
from pytest_twisted import ensureDeferred
from support import (
    FLAGS,
    Result,
    command,
    memory_max_in_kernel,
    run,
    unit_properties,
    units_get_memory_max,
    until,
    usable_cpu,
)
from twisted.internet.utils import getProcessValue

from sdexec.property import CONVERTED_SIGNATURES

pytestmark = pytest.mark.systemd

#: Where the manager shows a type of its own for what it reads as another:
#: it shows these as ``q`` and its setter reads (and systemd-run sends) ``u``.
SHOWN_OTHERWISE = {"TTYRows", "TTYColumns"}

#: A site's values of the properties converted since they failed every job
#: as strings, harmless to a job on any node this suite runs on (cgroups v1
#: or v2); the job's script below checks those it can see.
SITE_VALUES = {
    "TimerSlackNSec": "50000",
    # systemd's "all": 64 bits of it failed every start (review 37 T3-1)
    "CoredumpFilter": "all",
    "RestrictNamespaces": "~net",
    "SyslogFacility": "local3",
    "SystemCallErrorNumber": "EPERM",
    "SystemCallArchitectures": "native",
    "FailureActionExitStatus": "3",
    "FileDescriptorStoreMax": "4",
    "StartLimitBurst": "10",
    "LogRateLimitBurst": "100",
    "TTYRows": "24",
    "TTYColumns": "80",
    "ManagedOOMMemoryPressureLimit": "60%",
    "RestartKillSignal": "SIGTERM",
    "WatchdogSignal": "SIGABRT",
    "TimeoutAbortUSec": "90000000",
    "RuntimeRandomizedExtraUSec": "0",
    "WatchdogUSec": "0",
    "JobRunningTimeoutUSec": "infinity",
    "StartLimitIntervalUSec": "10000000",
    "LogRateLimitIntervalUSec": "30000000",
    "CPUQuotaPeriodUSec": "100000",
    "DefaultMemoryMin": "0",
    "DefaultMemoryLow": "10%",
    "StartupAllowedCPUs": str(usable_cpu()),  # CPU 0 may not be ours
    "StartupAllowedMemoryNodes": "0",
    "PassEnvironment": "HOME",
    "UnsetEnvironment": "SDEXEC_TEST_NOTHING",
    "RuntimeDirectory": "sdexec-test-runtime",
    "Documentation": "man:sdexec(8)",
    "RequiresMountsFor": "/",
    "ExecSearchPath": "/usr/bin:/bin",
    "IOReadBandwidthMax": "/tmp 100M",
    "IOWriteIOPSMax": "/tmp 5K",
    "IODeviceWeight": "/tmp 200",
    "IODeviceLatencyTargetUSec": "/tmp 25000",
    "IPAddressDeny": "any",
    "IPAddressAllow": "localhost",
    "EnvironmentFiles": "-/nonexistent/sdexec-test.env",
    "SuccessExitStatus": "TEMPFAIL 3 SIGUSR1",
    "RestartPreventExitStatus": "4",
    "RestartForceExitStatus": "5",
    "LogExtraFields": "SDEXEC_TEST=1",
}
#: What the job prints: the timer slack, the core-dump filter, that it may
#: not make a network namespace, its runtime directory.
SCRIPT = (
    "cat /proc/self/timerslack_ns /proc/self/coredump_filter;"
    " unshare -n true 2>/dev/null || echo no-net;"
    ' basename "$RUNTIME_DIRECTORY"'
)
#: Every segment core(5) names: what the kernel keeps of "all".
ALL_SEGMENTS = 0x1FF
#: Those that need a mount namespace for the unit, which a manager inside
#: some containers (or an unprivileged one) cannot make; and what the job
#: then shows: /etc read only, /mnt an empty file system of its own.
MOUNTING_VALUES = {
    "BindPaths": "-/nonexistent/sdexec-test",
    "BindReadOnlyPaths": "/etc",
    "TemporaryFileSystem": "/mnt:ro",
    "MountFlags": "shared",
}
MOUNTING_SCRIPT = "test -w /etc || echo etc-read-only; ls -A /mnt | wc -l"
EXIT_NAMESPACE = "226/NAMESPACE"  # systemd.exec(5): the namespace failed


def manager_property_types() -> dict[str, str]:
    """The properties the user manager shows for a service unit, with their
    types (introspecting a unit that is not loaded loads nothing lasting)."""
    shown = subprocess.run(
        ["busctl", "--user", "introspect", "--xml-interface",
         "org.freedesktop.systemd1",
         "/org/freedesktop/systemd1/unit/sdexec_2dtest_2dintrospected_2eservice"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    root = ElementTree.fromstring(shown.stdout)
    return {
        prop.attrib["name"]: prop.attrib["type"]
        for interface in root.iter("interface")
        for prop in interface.iter("property")
    }


def test_each_converted_type_is_the_manager_s_own(user_manager):
    shown = manager_property_types()
    assert {"TimerSlackNSec", "BindPaths", "IPAddressDeny"} <= set(shown)
    differing = {
        name: (signature, shown[name])
        for name, signature in CONVERTED_SIGNATURES.items()
        if name in shown and name not in SHOWN_OTHERWISE and signature != shown[name]
    }
    assert differing == {}


def site_table(values: dict[str, str], shown: dict[str, str]) -> str:
    """``[exec.sdexec-properties]`` with those of ``values`` the manager
    knows (a newer name it would refuse as unknown)."""
    lines = "".join(
        f'{name} = "{value}"\n' for name, value in values.items() if name in shown
    )
    return f"[exec.sdexec-properties]\n{lines}"


async def job_under(start_service, values: dict[str, str], script: str) -> Result:
    """``sh -c script`` run by a service whose site sets ``values``."""
    shown = manager_property_types()
    service = await start_service(extra=site_table(values, shown))
    client = await service.connect()
    return await run(client, ["sh", "-c", script])


@ensureDeferred
async def test_a_site_s_typed_properties_reach_a_job_that_runs(start_service):
    # Sent as strings, each of these failed every job: "Unexpected message
    # contents".
    result = await job_under(start_service, SITE_VALUES, SCRIPT)
    assert (result.error, result.status) == (None, 0), result.stderr
    slack, dump_filter, *rest = result.stdout.decode().split()
    assert (slack, rest) == ("50000", ["no-net", "sdexec-test-runtime"])
    assert int(dump_filter, 16) & ALL_SEGMENTS == ALL_SEGMENTS


def manager_makes_mounts(values: dict[str, str]) -> bool:
    """Whether the user manager starts a unit with those of ``values`` it
    knows, asked of the manager itself through systemd-run: root may
    unshare(2) where the manager still fails the unit's mount namespace
    (226/NAMESPACE), as in some containers."""
    shown = manager_property_types()
    properties = [f"--property={n}={v}" for n, v in values.items() if n in shown]
    probe = subprocess.run(
        ["systemd-run", "--user", "--wait", "--quiet", "--collect", *properties,
         "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.returncode in (0, 226), probe.stderr  # 226: EXIT_NAMESPACE
    return probe.returncode == 0


@ensureDeferred
async def test_a_site_s_mounts_reach_a_job_where_the_node_makes_them(start_service):
    # The manager takes the unit either way; a node that cannot make the
    # unit's mount namespace fails its start with 226/NAMESPACE, after. The
    # node decides which: where systemd-run's unit gets its mounts, sdexec's
    # must too (a start failing there is a regression, not the node).
    makes_mounts = manager_makes_mounts(MOUNTING_VALUES)
    result = await job_under(start_service, MOUNTING_VALUES, MOUNTING_SCRIPT)
    if not makes_mounts:
        # Ran, it would have run without the mounts the site set.
        assert result.error is not None, result.stdout
        assert EXIT_NAMESPACE in result.error.errstr
        return
    assert (result.error, result.status) == (None, 0), result.stderr
    assert result.stdout.decode().split() == ["etc-read-only", "0"]


#: The largest (or finest) value of each that sdexec takes, where systemd
#: writes the value into the unit's file in a form of its own: each must
#: read back as sent at a daemon-reload (one more, or one finer, did not:
#: sdexec refuses those, test_property_reload.py).
READ_BACK_VALUES = {
    "RuntimeMaxUSec": str(584_542 * 31_557_600 * 1_000_000 - 1000),  # ms
    "TimeoutAbortUSec": "999",  # written in microseconds below 1 ms
    "StartLimitIntervalUSec": "61000000",
    "CPUQuotaPeriodUSec": "1500",  # written to the microsecond
    "CPUQuotaPerSecUSec": "214748360000",  # 21474836%
    "TimerSlackNSec": str(2**63 - 1),
    "LimitCPU": "18446744073708",
    "LimitRTTIME": str(2**63 - 1),
    "LimitNICE": "40",
    "UnsetEnvironment": "SDEXEC_TEST_A SDEXEC_TEST_A=1",
}


@ensureDeferred
async def test_the_limits_sdexec_takes_read_back_as_sent(start_service):
    shown = manager_property_types()
    service = await start_service(extra=site_table(READ_BACK_VALUES, shown))
    client = await service.connect()
    unit = f"sdexec-read-back-{os.getpid()}"
    job = Result()
    opts = {"SDEXEC_NAME": unit}
    handle = client.exec(command(["sleep", "300"], opts=opts), FLAGS, job.collect)
    await until(lambda: "started" in job.types, "the job started")
    names = [name for name in READ_BACK_VALUES if name in shown]
    before = unit_properties(f"{unit}.service", "LoadState", *names)
    # Not subprocess.run: the service goes on serving while it reloads.
    reload = ["--user", "daemon-reload"]
    assert await getProcessValue("systemctl", reload, env=os.environ) == 0
    after = unit_properties(f"{unit}.service", "LoadState", *names)
    await handle.kill(15)
    await handle.done
    assert (after["LoadState"], after) == ("loaded", before)


#: A site's caps, and a request's limits under them, spelt as Flux's sdexec
#: reads them (hex, octal, floating point), with the bytes each must be.
SITE_MEMORY = {"MemoryMax": "0x80000000", "MemoryHigh": "1.5G"}
REQUESTED_MEMORY = {
    "MemoryMax": ("0x40000000", 2**30),
    "MemoryHigh": ("0100M", 64 * 2**20),  # octal, as Flux reads it
    "MemorySwapMax": ("1.5e9", 1_500_000_000),
}


@ensureDeferred
async def test_a_request_s_memory_limits_reach_the_unit_as_flux_reads_them(
    start_service,
):
    in_kernel = units_get_memory_max()
    service = await start_service(extra=site_table(SITE_MEMORY, SITE_MEMORY))
    client = await service.connect()
    unit = f"sdexec-memory-{os.getpid()}"
    opts = {f"SDEXEC_PROP_{name}": text for name, (text, _) in REQUESTED_MEMORY.items()}
    job = Result()
    handle = client.exec(
        command(["sleep", "300"], opts={"SDEXEC_NAME": unit, **opts}),
        FLAGS,
        job.collect,
    )
    await until(lambda: "started" in job.types, "the job started")
    shown = unit_properties(f"{unit}.service", "ControlGroup", *REQUESTED_MEMORY)
    kernel = memory_max_in_kernel(shown["ControlGroup"])
    await handle.kill(15)
    await handle.done
    assert {name: shown[name] for name in REQUESTED_MEMORY} == {
        name: str(size) for name, (_, size) in REQUESTED_MEMORY.items()
    }
    # Decided from the node, not either taken: where a cgroup v2 node
    # enforces MemoryMax (the memory controller delegated) the unit's
    # memory.max holds it, and a unit without one (its controllers lost, as
    # a daemon-reload once took them) must fail; elsewhere the manager
    # stores it, and the unit has no v2 memory.max.
    assert kernel == (str(2**30) if in_kernel else None)
