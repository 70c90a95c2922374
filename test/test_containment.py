"""Containment end to end (issue 6): R in, mapped properties on the unit,
the CPU and memory node fences verified, the node drained when one is not
enforced.

The integration tests run against the real user manager with the fixed
``small`` topology: one NUMA node, two cores of two PUs each, numbered as
Linux does, so core 0 is PUs 0 and 2 and core 1 is PUs 1 and 3. Whether
the fence holds depends on the node (cgroup v1 machines store
``AllowedCPUs`` and ``AllowedMemoryNodes`` without enforcing them; a cgroup
v2 node with cpuset delegated enforces them), so tests that need the unit to
keep running set ``containment-check = "warn"``, the drain tests ask for
a CPU, or a NUMA node, no node has, so that the fence fails everywhere, and
the memory cap's tests fence to every CPU and NUMA node the node has, so
that the cpuset fences hold everywhere.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import treq
from offline import NOT_DRAINED, Connection, drained_by, error_of
from pytest_twisted import ensureDeferred
from support import (
    FLAGS,
    command,
    manager_property,
    node_kills_at_memory_max,
    run,
    unit_names,
    unit_properties,
    until,
)
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher

import sdexec.config
import sdexec.containment
import sdexec.map.topology
import sdexec.orphans
import sdexec.plan
import sdexec.procfs
import sdexec.server
from sdexec.client import RPCError
from sdexec.command import Command
from sdexec.config import Config, ConfigError, parse_config
from sdexec.containment import (
    MEMORY_NOT_ENFORCED,
    R_OPTION,
    Containment,
    Fences,
    FenceVerdict,
    MapperError,
    check_cpu_fence,
    check_memory_node_fence,
    enforced_cpus,
    enforced_mems,
    judge_fences,
    memory_cap_in_force,
)
from sdexec.idset import IDset
from sdexec.lograte import BURST, WINDOW_S
from sdexec.map.mapper import UnfenceableRequest
from sdexec.map.topology import Topology
from sdexec.nodememory import physical_memory
from sdexec.plan import RequestError, _check_together, plan_exec
from sdexec.process import FAILED_UNIT_WAIT
from sdexec.procfs import process_exists
from sdexec.protocol import ExecFlag
from sdexec.refusal import RequestRefused
from sdexec.rset import ResourceSet
from sdexec.server import SdexecServer
from sdexec.sizes import scale_from_permyriad, scaled_memory
from sdexec.testing import FakeManager

SMALL_TOPOLOGY = Path(__file__).resolve().parent / "data" / "small.xml"
#: The OS CPUs of each logical core of the small topology, as idsets.
CORE_CPUS = {"0": "0,2", "1": "1,3"}
FENCE_PROPERTIES = ("AllowedCPUs", "AllowedMemoryNodes", "DevicePolicy")
DEFAULT_MAPPER_STATS = {
    "mapper_class": "sdexec.map.HwlocMapper",
    "mapper_searchpath": "",
}

ACCOUNTING_MAPPER = '''
from sdexec.map import HwlocMapper


class AccountingMapper(HwlocMapper):
    """The spec's example: resource accounting for every job."""

    def finalize_properties(self, properties, R, extra_properties=None):
        properties.update({"CPUAccounting": "true"})
        return super().finalize_properties(
            properties, R, extra_properties=extra_properties
        )
'''

FLAKY_MAPPER = '''
from sdexec.map import HwlocMapper


class FlakyMapper(HwlocMapper):
    """Fails for core 1 only."""

    def map_cores(self, cores):
        if cores == "1":
            raise RuntimeError("core 1 is cursed")
        return super().map_cores(cores)
'''


# -- helpers -------------------------------------------------------------------


def r_local(cores: str, gpus: str | None = None) -> str:
    """This rank's R (rank 0 only), holding ``cores`` (and ``gpus``), as JSON."""
    children = {"core": cores} if gpus is None else {"core": cores, "gpu": gpus}
    return json.dumps(
        {
            "version": 1,
            "execution": {
                "R_lite": [{"rank": "0", "children": children}],
                "nodelist": ["localhost"],
                "starttime": 0,
                "expiration": 0,
            },
        }
    )


def contained(
    check: str | None = "warn",
    sdexec: str = "",
    extra: str = "",
    topology: Path = SMALL_TOPOLOGY,
) -> dict:
    """``start_service``/``reload`` arguments for containment on with the
    small topology; ``check`` is ``containment-check`` (None: the default)."""
    lines = [f'topology = "{topology}"', sdexec]
    if check is not None:
        lines.append(f'containment-check = "{check}"')
    return {
        "exec": "sdexec-constrain-resources = true",
        "sdexec": "\n".join(lines),
        "extra": extra,
    }


def custom_mapper(directory: Path, source: str, class_name: str) -> str:
    """``[sdexec]`` lines loading ``sitemappers.custom.<class_name>``, written
    to ``directory`` (the mapper-searchpath)."""
    package = directory / "sitemappers"
    package.mkdir(exist_ok=True)
    (package / "custom.py").write_text(source)
    return (
        f'mapper = "sitemappers.custom.{class_name}"\nmapper-searchpath = "{directory}"'
    )


def shown_cpus(text: str) -> IDset:
    """An idset from ``systemctl show`` (it lists CPUs space-separated)."""
    return IDset(",".join(text.split()))


class RunningUnit:
    """A ``sleep`` in a named unit, started and then waited on."""

    def __init__(self, client, opts: dict) -> None:
        self.name = f"sdexec-contain-{uuid.uuid4().hex}"
        self.unit = f"{self.name}.service"
        self.handle = client.exec(
            command(["sleep", "300"], opts={**opts, "SDEXEC_NAME": self.name}),
            FLAGS,
            lambda response: None,
        )

    async def started(self) -> RunningUnit:
        """Wait for ``started``; an error ending the stream first is raised."""
        await until(
            lambda: self.handle.pid is not None or self.handle.done.called,
            "started or the end of the stream",
        )
        if self.handle.pid is None:
            await self.handle.done  # raises the stream's error
            raise AssertionError(f"{self.unit} ended without starting")
        return self

    def show(self, *names: str) -> dict[str, str]:
        return unit_properties(self.unit, *names)

    async def stop(self) -> None:
        await self.handle.kill(signal.SIGTERM)
        await self.handle.done


async def shown_while_running(client, opts: dict, *names: str) -> dict[str, str]:
    """Properties of a unit started with ``opts``, read while it runs."""
    unit = await RunningUnit(client, opts).started()
    shown = unit.show(*names)
    await unit.stop()
    return shown


async def http_stats(service) -> dict:
    response = await treq.get(service.stats_url, persistent=False)
    return json.loads(await treq.text_content(response))


# -- integration: the real user manager ----------------------------------------


@pytest.mark.systemd
@ensureDeferred
async def test_one_core_fences_the_unit(start_service):
    service = await start_service(**contained())
    client = await service.connect()
    shown = await shown_while_running(
        client, {R_OPTION: r_local("1")}, *FENCE_PROPERTIES
    )
    assert shown_cpus(shown["AllowedCPUs"]) == IDset(CORE_CPUS["1"])
    assert shown["AllowedMemoryNodes"] == "0"
    assert shown["DevicePolicy"] == "closed"


@pytest.mark.systemd
@ensureDeferred
async def test_a_units_fence_reads_the_same_before_its_controlgroup_is_known(
    start_service,
):
    # The fence check may run before ControlGroup is known (the unit's
    # signals can come before the GetAll that brings it): what it reads
    # then must be what it reads with it, on whatever cgroup layout the node
    # has (on an enforcing v2 node it was every online CPU).
    service = await start_service(**contained())
    client = await service.connect()
    unit = await RunningUnit(client, {R_OPTION: r_local("1")}).started()
    control_group = unit.show("ControlGroup")["ControlGroup"]
    for reader in (enforced_cpus, enforced_mems):
        with_it = reader(control_group, unit.handle.pid)
        assert with_it is not None
        assert reader(None, unit.handle.pid) == with_it, reader.__name__
    await unit.stop()


@pytest.mark.systemd
@pytest.mark.parametrize("configured", ["1G", "1g"])  # either case, as upstream
@ensureDeferred
async def test_memory_cap_scaled_and_request_cannot_loosen(start_service, configured):
    service = await start_service(
        **contained(extra=f'[exec.sdexec-properties]\nMemoryMax = "{configured}"\n')
    )
    client = await service.connect()
    opts = {R_OPTION: r_local("0")}
    for name, value in (("AllowedCPUs", "0-1"), ("MemoryMax", "2G")):
        loosening = {**opts, f"SDEXEC_PROP_{name}": value}
        refused = await run(client, ["true"], opts=loosening)
        assert refused.error.errnum == errno.EPERM, name
    shown = await shown_while_running(client, opts, "AllowedCPUs", "MemoryMax")
    # 1 core = 2 of the topology's 4 PUs: half the configured gibibyte.
    assert shown["MemoryMax"] == str(512 * 1024 * 1024)
    assert shown_cpus(shown["AllowedCPUs"]) == IDset(CORE_CPUS["0"])
    tighter = {**opts, "SDEXEC_PROP_MemoryMax": "256M"}
    shown = await shown_while_running(client, tighter, "AllowedCPUs", "MemoryMax")
    assert shown["MemoryMax"] == str(256 * 1024 * 1024)  # tighter: the request's
    assert shown_cpus(shown["AllowedCPUs"]) == IDset(CORE_CPUS["0"])


@pytest.mark.systemd
@ensureDeferred
async def test_a_percentage_cap_is_scaled_to_the_hundredth_systemd_keeps(
    start_service,
):
    # 95% for 2 of the topology's 4 PUs is 47.5%: a whole percent made it
    # 48%, and two such jobs held 96% of the node's 95%.
    service = await start_service(
        **contained(extra='[exec.sdexec-properties]\nMemoryMax = "95%"\n')
    )
    client = await service.connect()
    opts = {R_OPTION: r_local("0")}
    shown = await shown_while_running(client, opts, "MemoryMax")
    # Read back from the manager: the bytes it made of the scale it was sent.
    held = scaled_memory(scale_from_permyriad(4750), physical_memory())
    assert shown["MemoryMax"] == str(held)
    looser = await run(client, ["true"], opts={**opts, "SDEXEC_PROP_MemoryMax": "48%"})
    assert looser.error.errnum == errno.EPERM


@pytest.mark.systemd
@ensureDeferred
async def test_a_cap_whose_share_rounds_to_nothing_fails_the_job_naming_it(
    start_service,
):
    # Half of a 1-byte budget is 0 bytes, which systemd refuses for
    # MemoryMax: a floor of 1 byte let two such jobs hold 2 bytes of 1.
    enforced = node_kills_at_memory_max()
    service = await start_service(
        **contained(extra='[exec.sdexec-properties]\nMemoryMax = "1"\n')
    )
    client = await service.connect()
    refused = await run(client, ["true"], opts={R_OPTION: r_local("0")})
    assert refused.error.errnum == errno.EINVAL
    assert refused.error.errstr == (
        "mapper sdexec.map.HwlocMapper failed: ValueError: extra_properties:"
        " MemoryMax: '1' scaled to a job of 2 PUs of the node's 4 rounds down"
        " to 0 bytes (systemd takes MemoryMax from 1 byte): set it to at least 2"
    )
    # The whole node's job is given the whole byte.
    whole = {R_OPTION: r_local("0-1")}
    if enforced:
        # A byte is less than a page: a node that enforces MemoryMax holds
        # the job to no memory, and its OOM killer ends it as it starts (a
        # sleep meant to be read while it ran never ran). Its receipt names
        # the cap the manager held it to.
        ended = await run(client, ["true"], opts=whole)
        assert ended.error is None, ended.error
        (finished,) = [r for r in ended.responses if r["type"] == "finished"]
        assert (finished["status"], finished["result"], finished["memory_max"]) == (
            signal.SIGKILL,
            "oom-kill",
            1,
        )
    else:
        shown = await shown_while_running(client, whole, "MemoryMax")
        assert shown["MemoryMax"] == "1"


@pytest.mark.systemd
@ensureDeferred
async def test_custom_mapper_from_searchpath_then_reverted(start_service, tmp_path):
    lines = custom_mapper(tmp_path, ACCOUNTING_MAPPER, "AccountingMapper")
    service = await start_service(**contained(sdexec=lines))
    client = await service.connect()
    opts = {R_OPTION: r_local("0")}
    custom = await shown_while_running(client, opts, "CPUAccounting", "DevicePolicy")
    assert custom == {"CPUAccounting": "yes", "DevicePolicy": "closed"}
    assert (await client.stats())["mapper"]["config"] == {
        "mapper_class": "sitemappers.custom.AccountingMapper",
        "mapper_searchpath": str(tmp_path),
    }

    assert await service.reload(**contained())
    default = await shown_while_running(client, opts, "CPUAccounting", "DevicePolicy")
    # The manager's default, not "no": cgroup v2 managers default to yes.
    manager_default = manager_property("DefaultCPUAccounting")
    assert manager_default in ("yes", "no")
    assert default == {"CPUAccounting": manager_default, "DevicePolicy": "closed"}
    assert (await client.stats())["mapper"]["config"] == DEFAULT_MAPPER_STATS


@pytest.mark.systemd
@ensureDeferred
async def test_mapper_that_raises_fails_only_that_request(start_service, tmp_path):
    lines = custom_mapper(tmp_path, FLAKY_MAPPER, "FlakyMapper")
    service = await start_service(**contained(sdexec=lines))
    client = await service.connect()
    failed = await run(client, ["true"], opts={R_OPTION: r_local("1")})
    assert failed.error.errnum == errno.EINVAL
    assert failed.error.errstr == (
        "mapper sitemappers.custom.FlakyMapper failed: RuntimeError: core 1 is cursed"
    )
    assert failed.types == []
    missing = await run(client, ["true"], opts={R_OPTION: r_local("7")})
    assert missing.error.errnum == errno.ENODEV  # the mapper's OSError's errno
    assert missing.error.errstr == (
        "mapper sitemappers.custom.FlakyMapper failed:"
        " core 7 is beyond the topology's 2 cores"
    )
    served = await run(client, ["echo", "fine"], opts={R_OPTION: r_local("0")})
    assert (served.error, served.status, served.stdout) == (None, 0, b"fine\n")
    assert service.server.drain_reason is None


@pytest.mark.systemd
@ensureDeferred
async def test_containment_off_ignores_r(sdexec):
    client = await sdexec.connect()
    shown = await shown_while_running(
        client, {R_OPTION: r_local("1")}, *FENCE_PROPERTIES
    )
    assert shown == {
        "AllowedCPUs": "",
        "AllowedMemoryNodes": "",
        "DevicePolicy": "auto",
    }
    assert (await client.stats())["mapper"] == {
        "config": DEFAULT_MAPPER_STATS,
        "requests": 0,
    }


# The CPU no node has: hwloc-calc maps core 1 of this topology to it.
ABSENT_CPU = 4095


def topology_with_an_absent_cpu(directory: Path) -> Path:
    """A topology whose core 1 is the single PU ``ABSENT_CPU``.

    A unit given ``AllowedCPUs=4095`` cannot be fenced to it on any node: a
    cgroup v2 kernel refuses the cpuset (or, with no overlap, gives the unit
    its parent's CPUs) and cgroup v1 never applies it. Either way the unit
    may use CPUs outside its AllowedCPUs, so the post-start check sees an
    unenforced fence here and on an enforcing node alike: the drain path is
    tested through the real manager and the real check, with no stand-in.
    """
    xml = subprocess.run(
        ["lstopo-no-graphics", "--of", "xml", "-",
         "--input", f"numa:1 core:2 pu:1(indexes=0,{ABSENT_CPU})"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = directory / "absent-cpu.xml"
    path.write_text(xml)
    return path


#: Where the kernel lists what it has, by the fence to it.
ONLINE_LISTS = {"AllowedCPUs": "cpu", "AllowedMemoryNodes": "node"}

#: The kernel's lists of what the node has, online or not, by the fence to
#: them, the first that is there counting.
NODE_LISTS = {
    "AllowedCPUs": ("present", "possible"),
    "AllowedMemoryNodes": ("possible",),
}

#: The cpuset each fence is.
KINDS = {"AllowedCPUs": "cpus", "AllowedMemoryNodes": "mems"}

#: What each cpuset lists, in its reasons.
MEMBERS = {"cpus": "CPUs", "mems": "NUMA nodes"}


def on_node(name: str) -> IDset:
    """What this node has, online or not, of the CPUs, or NUMA nodes,
    fence ``name`` is to (its online ones where the kernel lists neither;
    a kernel without NUMA has node 0 alone)."""
    for listing in (*NODE_LISTS[name], "online"):
        listed = Path(f"/sys/devices/system/{ONLINE_LISTS[name]}/{listing}")
        if listed.exists():
            return IDset(listed.read_text().strip())
    return IDset("0")


def unenforced_reason(refused, name: str, absent: int) -> str:
    """The reason a job fenced (``name``) to ``absent``, which no node has,
    was refused: EIO, naming what the unit could really use (never
    ``absent``) and that ``absent`` is not on this node, in the same words
    on cgroup v1 and v2 (neither the slice nor the controller's delegation
    is to blame), and before it was said to have started."""
    assert refused.error.errnum == errno.EIO
    reason = refused.error.errstr
    prefix = f"{name} not enforced: expected {absent} got "
    suffix = (
        f" ({absent} is not on this node, which has {MEMBERS[KINDS[name]]}"
        f" {on_node(name)}: the kernel refuses the whole set)"
    )
    assert reason.startswith(prefix) and reason.endswith(suffix)
    usable = IDset(reason[len(prefix) : -len(suffix)])
    assert usable and absent not in usable
    assert "started" not in refused.types
    return reason


async def undrained_of_the_canary(service, client) -> None:
    """The device canary judged the node at start (test_devicefence.py):
    one whose device policy is not enforced was drained then. Clear that to
    reach the CPU fence; a node that enforces it was not drained."""
    device_problem = service.server.stats()["device-fence"]["problem"]
    if device_problem is not None:
        assert (await client.undrain())["cleared"] == [device_problem]
    assert service.server.drain_reason is None


@pytest.mark.systemd
@ensureDeferred
async def test_unenforced_fence_fails_the_job_and_drains(start_service, tmp_path):
    topology = topology_with_an_absent_cpu(tmp_path)
    service = await start_service(**contained(check=None, topology=topology))
    client = await service.connect()
    await undrained_of_the_canary(service, client)
    name = f"sdexec-contain-{uuid.uuid4().hex}"
    refused = await run(
        client, ["sleep", "300"], opts={R_OPTION: r_local("1"), "SDEXEC_NAME": name}
    )
    reason = unenforced_reason(refused, "AllowedCPUs", ABSENT_CPU)
    await until(lambda: not service.server.processes, "the refused unit reaped")
    assert unit_names(f"{name}*") == []

    drain = drained_by(reason, "fence")
    stats = await client.stats()
    assert stats["drain"] == drain
    assert stats["requests"]["fence-failures"] == 1
    assert (await http_stats(service))["drain"] == drain

    drained = await run(client, ["true"])
    assert drained.error.errnum == errno.EIO
    assert reason in drained.error.errstr and "undrain" in drained.error.errstr

    assert await client.undrain() == {"reason": reason, "cleared": [reason]}
    assert (await client.stats())["drain"] == NOT_DRAINED
    served = await run(client, ["true"])
    assert (served.error, served.status) == (None, 0)


#: Rounds of a fence refusal, an undrain and a retry at once: the retry was
#: EEXIST ("still held") in 5 rounds of 5, and in 1 run of 3 of a single
#: round, on the sandbox manager (review session 50).
FENCE_RETRY_ROUNDS = 5


@pytest.mark.systemd
@ensureDeferred
async def test_a_retry_right_after_a_fence_refusal_and_undrain_runs(
    start_service, tmp_path
):
    # The EIO went out as the refused unit was being killed and stopped: a
    # retry with its SDEXEC_NAME right after the undrain was EEXIST ("still
    # held"). Flux's sdexec answers its post-start check's EIO once the unit
    # is reaped; so does this.
    topology = topology_with_an_absent_cpu(tmp_path)
    service = await start_service(**contained(check=None, topology=topology))
    client = await service.connect()
    await undrained_of_the_canary(service, client)
    opts = {"SDEXEC_NAME": f"sdexec-contain-{uuid.uuid4().hex}"}
    fenced = {R_OPTION: r_local("1"), **opts}
    for _ in range(FENCE_RETRY_ROUNDS):
        refused = await run(client, ["sleep", "300"], opts=fenced)
        reason = unenforced_reason(refused, "AllowedCPUs", ABSENT_CPU)
        assert (await client.undrain())["cleared"] == [reason]
        retried = await run(client, ["true"], opts=opts)
        assert (retried.error, retried.status) == (None, 0)


def own_cpu_mask() -> IDset:
    """This process's ``Cpus_allowed_list``, as the kernel shows it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return IDset(line.split(":", 1)[1].strip())
    raise AssertionError("no Cpus_allowed_list in /proc/self/status")


def every_cpu() -> IDset:
    """Every CPU this node has: online, or in this process's affinity mask
    (a VM's mask may list possible CPUs that are not online). Where cpuset
    does not apply, a unit may use any CPU of its manager's affinity mask,
    which the suite's sandbox manager took from this process."""
    online = IDset(Path("/sys/devices/system/cpu/online").read_text().strip())
    return online | own_cpu_mask()


def online_memory_nodes() -> IDset:
    """The NUMA nodes this node has online (node 0 alone on a kernel
    without NUMA, which lists none)."""
    listed = Path("/sys/devices/system/node/online")
    return IDset(listed.read_text().strip()) if listed.exists() else IDset("0")


def topology_of_every_cpu(
    directory: Path, memory_nodes: IDset, name: str
) -> tuple[Path, int]:
    """A topology of ``every_cpu()``, one core each, with ``memory_nodes``
    as its NUMA nodes, each holding every core; written to ``directory``
    as ``name``: (its path, its number of cores).

    R holding all its cores fences a unit to every CPU there is, which
    holds on any node, enforced or not; and to all of ``memory_nodes``.
    (hwloc's synthetic syntax gives NUMA nodes one CPU count each, which a
    node's real ones need not share: attached to the machine, they do.)
    """
    cpus = every_cpu()
    indexes = ",".join(map(str, cpus))
    nodes = ",".join(map(str, memory_nodes))
    numa = f"[numa(indexes={nodes})]" + " [numa]" * (len(memory_nodes) - 1)
    xml = subprocess.run(
        ["lstopo-no-graphics", "--of", "xml", "-", "--input",
         f"{numa} core:{len(cpus)} pu:1(indexes={indexes})"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = directory / name
    path.write_text(xml)
    return path, len(cpus)


def topology_whose_fences_hold(directory: Path) -> tuple[Path, int]:
    """A topology whose cpuset fences hold on any node, for R holding all
    its cores: every CPU the node has, in the NUMA nodes it has online, so
    that they hold whether the node enforces cpusets or not (a manager
    without cpuset delegated, as user@.service is by default, leaves its
    units every CPU and node of the root cgroup); (its path, its number of
    cores). A test of anything else the node may or may not enforce uses
    it, so that a fence that does not hold is never what it judges."""
    return topology_of_every_cpu(directory, online_memory_nodes(), "every-cpu.xml")


#: A NUMA node no machine has (Linux has at most 1024): a fence to it never
#: holds, whatever the node enforces.
ABSENT_NODE = 4095


def topology_with_an_absent_node(directory: Path) -> tuple[Path, int]:
    """``topology_of_every_cpu`` in the single NUMA node ``ABSENT_NODE``.

    Its cores fence a unit to every CPU there is, which holds on any node;
    its memory node cannot hold on any: a cgroup v2 kernel refuses the
    cpuset (the unit keeps its parent's nodes) and cgroup v1 never applies
    it. So the memory node check is the one that fails, here and on an
    enforcing node alike.
    """
    return topology_of_every_cpu(directory, IDset([ABSENT_NODE]), "absent-node.xml")


@pytest.mark.systemd
@ensureDeferred
async def test_unenforced_memory_nodes_fail_the_job_and_drain(start_service, tmp_path):
    topology, cores = topology_with_an_absent_node(tmp_path)
    service = await start_service(**contained(check=None, topology=topology))
    client = await service.connect()
    if service.server.drain_reason is not None:  # the device canary's
        await client.undrain()
    opts = {R_OPTION: r_local(f"0-{cores - 1}")}
    refused = await run(client, ["sleep", "300"], opts=opts)
    reason = unenforced_reason(refused, "AllowedMemoryNodes", ABSENT_NODE)
    assert service.server.drain_reason == reason
    assert (await client.stats())["requests"]["fence-failures"] == 1


@pytest.mark.systemd
@ensureDeferred
async def test_a_memory_cap_the_node_does_not_enforce_fails_and_drains(
    start_service, tmp_path
):
    """R holds every CPU of the node and every NUMA node it has online, so
    the cpuset fences hold on any node, whether it enforces them or not,
    and the memory cap is the one fence judged. Whether the node enforces
    it is measured apart from the service (a v2 node with the memory
    controller delegated: yes; cgroup v1, or v2 without it: no), and the
    service must agree."""
    enforced = node_kills_at_memory_max()
    topology, cores = topology_whose_fences_hold(tmp_path)
    memory = '[exec.sdexec-properties]\nMemoryMax = "50%"\n'
    service = await start_service(
        **contained(check=None, extra=memory, topology=topology)
    )
    client = await service.connect()
    if service.server.drain_reason is not None:  # the device canary's
        await client.undrain()
    # A process that lives until it is checked (sleep, as the CPU test's).
    unit = RunningUnit(client, {R_OPTION: r_local(f"0-{cores - 1}")})
    if enforced:
        await (await unit.started()).stop()
        assert service.server.drain_reason is None
    else:
        with pytest.raises(RPCError) as refused:
            await unit.started()
        assert (refused.value.errnum, refused.value.errstr) == (
            errno.EIO,
            MEMORY_NOT_ENFORCED["user"],
        )
        assert service.server.drain_reason == MEMORY_NOT_ENFORCED["user"]
        assert (await client.stats())["requests"]["fence-failures"] == 1


@pytest.mark.systemd
@ensureDeferred
async def test_a_requests_own_memory_cap_is_not_the_fence(start_service, tmp_path):
    """Requests may set MemoryMax; one the node cannot hold is the
    request's business, not a reason for any client to drain the node (on
    a topology whose cpuset fences hold on any node, so that they are not
    what drains it)."""
    topology, cores = topology_whose_fences_hold(tmp_path)
    service = await start_service(**contained(check=None, topology=topology))
    client = await service.connect()
    if service.server.drain_reason is not None:  # the device canary's
        await client.undrain()
    opts = {R_OPTION: r_local(f"0-{cores - 1}"), "SDEXEC_PROP_MemoryMax": "1G"}
    await (await RunningUnit(client, opts).started()).stop()
    assert service.server.drain_reason is None


@pytest.mark.systemd
@ensureDeferred
async def test_mapper_stats_count_mapped_requests(start_service):
    service = await start_service(**contained())
    client = await service.connect()
    for cores in ("0", "1"):
        mapped = await run(client, ["true"], opts={R_OPTION: r_local(cores)})
        assert mapped.status == 0
    unmapped = await run(client, ["true"])
    assert unmapped.status == 0
    expected = {"config": DEFAULT_MAPPER_STATS, "requests": 2}
    assert (await client.stats())["mapper"] == expected
    assert (await http_stats(service))["mapper"] == expected


@pytest.mark.systemd
@ensureDeferred
async def test_bad_reload_keeps_mapper_and_running_unit(start_service, tmp_path):
    lines = custom_mapper(tmp_path, ACCOUNTING_MAPPER, "AccountingMapper")
    service = await start_service(**contained(sdexec=lines))
    client = await service.connect()
    opts = {R_OPTION: r_local("0")}
    running = await RunningUnit(client, opts).started()

    assert not await service.reload(
        **contained(sdexec='mapper = "nosuch.module.Mapper"')
    )
    assert (await client.stats())["mapper"]["config"]["mapper_class"] == (
        "sitemappers.custom.AccountingMapper"
    )
    assert not running.handle.done.called
    assert running.show("ActiveState", "CPUAccounting") == {
        "ActiveState": "active",
        "CPUAccounting": "yes",
    }
    after = await shown_while_running(client, opts, "CPUAccounting")
    assert after == {"CPUAccounting": "yes"}
    await running.stop()


# -- unit tests: the pure logic, no systemd ---------------------------------------


@pytest.mark.parametrize(
    ("expected", "actual"),
    [("0-3", "0-3"), ("0-3", "1,2"), ("1,3", "3"), ("5", "5")],
)
@pytest.mark.parametrize("check", [check_cpu_fence, check_memory_node_fence])
def test_fence_holds_when_usable_ids_are_within(check, expected, actual):
    assert check(IDset(expected), IDset(actual)) is None


@pytest.mark.parametrize(
    ("expected", "actual"),
    [("0-1", "0-3"), ("1,3", "0-1"), ("2", "3"), ("0-3", "0-4")],
)
@pytest.mark.parametrize(
    ("check", "name"),
    [(check_cpu_fence, "AllowedCPUs"), (check_memory_node_fence, "AllowedMemoryNodes")],
)
def test_fence_broken_when_any_id_is_outside(check, name, expected, actual):
    assert check(IDset(expected), IDset(actual)) == (
        f"{name} not enforced: expected {expected} got {actual}"
        " (is the cpuset controller delegated to the user instance?)"
    )


@pytest.mark.parametrize("nodes", ["0", "0,2", str(ABSENT_NODE)])
def test_a_topology_of_every_cpu_maps_its_cores_to_them_and_its_nodes(tmp_path, nodes):
    path, cores = topology_of_every_cpu(tmp_path, IDset(nodes), "every-cpu.xml")
    every_core = IDset(range(cores))
    mapped = Topology(path.read_text()).cpus_and_memory_nodes(every_core)
    assert mapped == (every_cpu(), IDset(nodes))


def test_the_topology_whose_fences_hold_holds_where_cpuset_is_not_delegated(
    tmp_path,
):
    # A unit of a manager without the cpuset controller (user@.service's
    # default) may use every CPU and NUMA node of the root cgroup: on a node
    # of more CPUs than the small topology's four, its fences broke, and the
    # memory cap's tests drained the node before the cap was judged.
    path, cores = topology_whose_fences_hold(tmp_path)
    every_core = IDset(range(cores))
    cpus, mems = Topology(path.read_text()).cpus_and_memory_nodes(every_core)
    assert check_cpu_fence(cpus, every_cpu()) is None
    assert check_memory_node_fence(mems, online_memory_nodes()) is None


CGROUP = "/user.slice/app.slice/job.service"


def _fake_file(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake_v2_unit(root: Path) -> None:
    """The unit's v2 cgroup, with process 42 in it (whether it has cpuset
    files or not)."""
    _fake_file(root, f"sys/fs/cgroup{CGROUP}/cgroup.procs", "42\n")


#: The cpuset readers, by what they read: ``cpuset.cpus`` or ``cpuset.mems``.
READERS = {"cpus": enforced_cpus, "mems": enforced_mems}


def _fake_tree(
    root: Path, kind: str, v2=None, v1=None, status=None, v2_parent=None, v1_root=None
) -> None:
    """A cgroup v2 cpuset of ``kind`` for the unit (or for its parent
    only), a v1 one for the unit's cgroup (or for the root cpuset cgroup
    only) with process 42 in it, and a /proc/42/status, each if given (the
    status has the same ``(list, mask)`` for CPUs and nodes)."""
    if v2 is not None or v2_parent is not None:
        _fake_v2_unit(root)
    if v2 is not None:
        _fake_file(root, f"sys/fs/cgroup{CGROUP}/cpuset.{kind}.effective", v2)
    if v2_parent is not None:
        parent = CGROUP.rsplit("/", 1)[0]
        _fake_file(root, f"sys/fs/cgroup{parent}/cpuset.{kind}.effective", v2_parent)
    if v1 is not None:
        _fake_file(root, f"sys/fs/cgroup/cpuset{CGROUP}/cpuset.{kind}", v1)
        _fake_file(root, "proc/42/cgroup", f"7:cpuset:{CGROUP}\n1:name=systemd:/\n")
    if v1_root is not None:
        _fake_file(root, f"sys/fs/cgroup/cpuset/cpuset.{kind}", v1_root)
        _fake_file(root, "proc/42/cgroup", f"7:cpuset:/\n1:name=systemd:{CGROUP}\n")
    if status is not None:
        listed, mask = status
        _fake_file(root, "sys/devices/system/cpu/online", "0-15\n")
        _fake_file(
            root,
            "proc/42/status",
            f"Name:\tsleep\nCpus_allowed:\t{mask}\nCpus_allowed_list:\t{listed}\n"
            f"Mems_allowed:\t{mask}\nMems_allowed_list:\t{listed}\n"
            "Voluntary_ctxt_switches:\t1\n",
        )


@pytest.mark.parametrize("kind", READERS)
@pytest.mark.parametrize(
    ("tree", "control_group", "expected"),
    [
        ({"v2": "0-1\n", "v1": "2\n", "status": ("3", "8")}, CGROUP, "0-1"),
        ({"v1": "2,4\n", "status": ("3", "8")}, CGROUP, "2,4"),
        ({"v2": "garbage\n", "v1": "2\n"}, CGROUP, "2"),
        # No cpuset seen: nothing holds the CPUs (the affinity is the
        # process's own); the nodes are what its cpuset gave it.
        ({"status": ("0-3", "f")}, CGROUP, ("0-15", "0-3")),
        ({"v2": "0-1\n", "status": ("5", "20")}, None, ("0-15", "5")),
        ({"v2": "0-1\n", "status": ("5", "20")}, "", ("0-15", "5")),
        # The process's own affinity proves no fence: it may have narrowed
        # it itself, as a Flux job shell binds itself to its cores.
        ({"v2_parent": "0-15\n", "status": ("4-5", "30")}, CGROUP, "0-15"),
        ({"v1_root": "0-15\n", "status": ("4-5", "30")}, CGROUP, "0-15"),
        # A container the cpuset controller is not delegated to: no file.
        ({"status": ("4-5", "30")}, CGROUP, ("0-15", "4-5")),
    ],
    ids=[
        "v2-first",
        "v1-next",
        "unparsable-skipped",
        "proc-last",
        "no-cg",
        "empty-cg",
        "v2-ancestor-not-affinity",
        "v1-process-cpuset-not-affinity",
        "no-cpuset-seen-not-affinity",
    ],
)
def test_enforced_cpuset_reads_in_order(tmp_path, kind, tree, control_group, expected):
    _fake_tree(tmp_path, kind, **tree)
    if isinstance(expected, tuple):  # (cpus, mems)
        expected = expected[list(READERS).index(kind)]
    assert READERS[kind](control_group, 42, root=str(tmp_path)) == IDset(expected)


def test_each_reader_reads_its_own_cpuset(tmp_path):
    _fake_v2_unit(tmp_path)
    _fake_file(tmp_path, f"sys/fs/cgroup{CGROUP}/cpuset.cpus.effective", "0-7")
    _fake_file(tmp_path, f"sys/fs/cgroup{CGROUP}/cpuset.mems.effective", "1")
    _fake_file(tmp_path, "proc/42/status", "Cpus_allowed_list:\t0-15\n")
    assert enforced_cpus(CGROUP, 42, root=str(tmp_path)) == IDset("0-7")
    assert enforced_mems(CGROUP, 42, root=str(tmp_path)) == IDset("1")
    # The status's CPUs are not its nodes: with none listed (a kernel
    # without cpusets), every node the kernel has may be used.
    _fake_file(tmp_path, "sys/devices/system/node/online", "0-3\n")
    assert enforced_mems(None, 42, root=str(tmp_path)) == IDset("0-3")


@pytest.mark.parametrize("kind", ["cpus", "mems"])
def test_a_v2_cpuset_is_read_from_the_process_cgroup_without_controlgroup(
    tmp_path, kind
):
    # Seen on an enforcing v2 node: the fence check ran on the unit's
    # signals before GetAll brought ControlGroup, and the CPUs read as every
    # online one ("AllowedCPUs not enforced: expected 0-3 got 0-15"), which
    # drained the node on its first job. The main process's own v2 cgroup
    # is the unit's.
    _fake_v2_unit(tmp_path)
    _fake_file(tmp_path, "proc/42/cgroup", f"0::{CGROUP}\n")
    _fake_file(tmp_path, "proc/42/status", "Name:\tx\nMems_allowed_list:\t0-1\n")
    _fake_file(tmp_path, f"sys/fs/cgroup{CGROUP}/cpuset.{kind}.effective", "1\n")
    _fake_file(tmp_path, f"sys/fs/cgroup/cpuset.{kind}.effective", "0-15\n")
    _fake_file(tmp_path, f"sys/devices/system/{kind[:-1]}/online", "0-15\n")
    assert READERS[kind](None, 42, root=str(tmp_path)) == IDset("1")
    fences = Fences(IDset("1"), None) if kind == "cpus" else Fences(None, IDset("1"))
    assert judge_fences(fences, None, 42, root=str(tmp_path)).problems == []


def test_a_cgroup_that_is_not_there_is_passed_over_not_its_ancestors_read(tmp_path):
    # A unit cgroup path that is not there (pruned, or not the unit's: a
    # manager of another layout): its ancestors say nothing of the unit;
    # the main process's own cgroup does.
    own = "/elsewhere.slice/job.service"
    _fake_file(tmp_path, "proc/42/cgroup", f"0::{own}\n")
    _fake_file(tmp_path, f"sys/fs/cgroup{own}/cgroup.procs", "42\n")
    _fake_file(tmp_path, f"sys/fs/cgroup{own}/cpuset.cpus.effective", "2-3\n")
    slice_cgroup = CGROUP.rsplit("/", 1)[0]
    _fake_file(tmp_path, f"sys/fs/cgroup{slice_cgroup}/cpuset.cpus.effective", "0-15\n")
    assert enforced_cpus(CGROUP, 42, root=str(tmp_path)) == IDset("2-3")


def test_a_fence_read_after_the_job_exited_is_unchecked_not_broken(tmp_path):
    # A job that exits at once: systemd prunes the unit's emptied cgroup as
    # it leaves running (RemainAfterExit=yes), so the read finds the
    # slice's cpuset, every CPU of the node. That was a broken fence, and a
    # drained node; the job is gone, and its fence went unchecked.
    slice_cgroup = CGROUP.rsplit("/", 1)[0]
    _fake_file(tmp_path, f"sys/fs/cgroup{slice_cgroup}/cpuset.cpus.effective", "0-15\n")
    _fake_file(tmp_path, "sys/devices/system/cpu/online", "0-15\n")
    verdict = judge_fences(Fences(IDset("0-3")), CGROUP, 42, root=str(tmp_path))
    assert (verdict.problems, verdict.unchecked) == ([], "its CPU fence")


def test_a_zombie_main_process_is_gone_for_the_fence_check(tmp_path):
    # systemd removes an exited unit's cgroup before it reaps the main
    # process: read then, the slice's cpuset is every CPU, and the zombie
    # still has a /proc entry.
    slice_cgroup = CGROUP.rsplit("/", 1)[0]
    _fake_file(tmp_path, f"sys/fs/cgroup{slice_cgroup}/cpuset.cpus.effective", "0-15\n")
    _fake_file(tmp_path, "proc/42/cgroup", f"0::{CGROUP}\n")
    _fake_file(tmp_path, "proc/42/stat", "42 (a) job) Z 1 42 42 0 -1\n")
    _fake_file(tmp_path, "proc/42/status", "Name:\tjob\nState:\tZ (zombie)\n")
    verdict = judge_fences(Fences(IDset("0-3")), CGROUP, 42, root=str(tmp_path))
    assert (verdict.problems, verdict.unchecked) == ([], "its CPU fence")


V1_UNLIMITED = "9223372036854771712"
V2_UNIT = "sys/fs/cgroup" + CGROUP


@pytest.mark.parametrize(
    ("files", "in_force"),
    [
        # cgroup v1: the main process's memory cgroup, whatever the unit's
        ({"proc": f"9:memory:{CGROUP}\n0::{CGROUP}",
          f"sys/fs/cgroup/memory{CGROUP}/memory.limit_in_bytes": "536870912"},
         True),
        ({"proc": f"9:memory:{CGROUP}\n0::{CGROUP}",
          f"sys/fs/cgroup/memory{CGROUP}/memory.limit_in_bytes": V1_UNLIMITED},
         False),
        # a memory cgroup not the unit's: a container's limit is not its own
        ({"proc": "9:memory:/user.slice\n0::" + CGROUP,
          "sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes": "536870912"},
         False),
        ({"proc": f"4:cpu,memory:{CGROUP}\n"}, False),  # no limit file to read
        # cgroup v2: the unit's memory.max
        ({"proc": "0::" + CGROUP, f"{V2_UNIT}/memory.max": "536870912"}, True),
        ({"proc": "0::" + CGROUP, f"{V2_UNIT}/memory.max": "max"}, False),
        ({"proc": "0::" + CGROUP, f"{V2_UNIT}/cgroup.procs": "42"}, False),
        ({"proc": "0::" + CGROUP}, False),  # no memory controller anywhere
        ({}, None),  # the process and its cgroup are gone
    ],
    ids=["v1-limit", "v1-unlimited", "v1-not-the-units", "v1-unreadable",
         "v2-limit", "v2-max", "v2-no-controller", "no-memory-controller", "gone"],
)  # fmt: skip
def test_memory_cap_in_force_reads_the_nodes_cgroups(tmp_path, files, in_force):
    for relative, text in files.items():
        _fake_file(tmp_path, "proc/42/cgroup" if relative == "proc" else relative, text)
    assert memory_cap_in_force(CGROUP, 42, root=str(tmp_path)) is in_force


@pytest.mark.parametrize("kind", READERS)
def test_enforced_cpuset_none_when_nothing_readable(tmp_path, kind):
    assert READERS[kind](CGROUP, 42, root=str(tmp_path)) is None


@pytest.mark.parametrize("way", ["pidfd", "pidfd, /proc hidden", "/proc, no pidfd"])
def test_a_process_exists_until_it_exits_not_until_it_is_reaped(monkeypatch, way):
    # A zombie is gone: systemd removes an exited unit's cgroup before it
    # reaps the main process. hidepid=2 hides another user's process (a job
    # shell an IMP started) from /proc: a signal 0 or /proc/PID took its
    # zombie for alive there (review AT F6); a pidfd tells. A node with no
    # pidfds (a kernel before 5.3) has only the documented fallback, which
    # takes a hidden zombie for alive: decided from the node, not skipped.
    pidfds = sdexec.procfs._exited_by_pidfd(os.getpid()) is not None
    hidden = way == "pidfd, /proc hidden"
    if hidden:
        monkeypatch.setattr(sdexec.procfs, "_process_state", lambda *_: None)
    if way == "/proc, no pidfd":  # a kernel before 5.3
        monkeypatch.delattr(os, "pidfd_open")
    process = subprocess.Popen(["sleep", "300"])
    assert process_exists(os.getpid()) and process_exists(process.pid)
    process.kill()
    deadline = time.monotonic() + 30  # a zombie, unreaped, once the kill lands
    while _stat_state(process.pid) != "Z":
        assert time.monotonic() < deadline, "the killed process never exited"
        time.sleep(0.01)
    assert process_exists(process.pid) is (hidden and not pidfds)
    assert os.path.exists(f"/proc/{process.pid}")  # not reaped yet
    process.wait()
    assert not process_exists(process.pid)


def test_a_process_whose_main_thread_exited_lives_while_another_thread_runs():
    # Its /proc/PID/stat says Z, but systemd counts it running (the kernel
    # reports a thread group's exit once the last thread ends): the fence
    # check was skipped as for a process gone (review session 31 A F3).
    leader_exits = (
        "import ctypes, threading, time;"
        "threading.Thread(target=time.sleep, args=(300,)).start();"
        "ctypes.CDLL(None).pthread_exit(None)"
    )
    process = subprocess.Popen([sys.executable, "-c", leader_exits])
    try:
        deadline = time.monotonic() + 30  # an interpreter's start, loaded
        while time.monotonic() < deadline:  # until the main thread has exited
            if _stat_state(process.pid) == "Z":
                break
            time.sleep(0.01)
        assert _stat_state(process.pid) == "Z"
        assert process_exists(process.pid)
    finally:
        process.kill()
        process.wait()


def _stat_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rpartition(")")[2].split()[0]


def test_without_cpusets_every_node_may_be_used(tmp_path):
    _fake_file(tmp_path, "proc/42/status", "Name:\tsleep\nCpus_allowed_list:\t0\n")
    # No node/online: a kernel without NUMA has node 0 alone.
    assert enforced_mems(CGROUP, 42, root=str(tmp_path)) == IDset("0")
    _fake_file(tmp_path, "sys/devices/system/node/online", "0-1\n")
    assert enforced_mems(CGROUP, 42, root=str(tmp_path)) == IDset("0-1")
    # A status without even its CPUs says nothing of them.
    _fake_file(tmp_path, "proc/42/status", "Name:\tsleep\n")
    assert enforced_cpus(CGROUP, 42, root=str(tmp_path)) is None


class FakeMapper:
    """Returns (or raises) what it is given, and remembers its calls."""

    rank = 0  # the broker rank it maps, as a ResourceMapper's

    def __init__(self, result) -> None:
        self.result = result
        self.calls: list[tuple] = []

    def map(self, R, extra_properties=None):
        self.calls.append((R, extra_properties))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _site_config(site: dict[str, str], constrain: bool = True) -> Config:
    """Containment by ``site.mappers.Fake``, ``site`` its sdexec-properties."""
    return parse_config(
        {
            "exec": {
                "sdexec-constrain-resources": constrain,
                "sdexec-properties": site,
            },
            "sdexec": {"mapper": "site.mappers.Fake"},
        }
    )


def _containment(
    result, constrain: bool = True, site: dict[str, str] | None = None
) -> tuple[Containment, FakeMapper]:
    config = _site_config({"MemoryMax": "1G"} if site is None else site, constrain)
    mapper = FakeMapper(result)
    return Containment(config, mapper), mapper


def _request(with_r: bool = True) -> Command:
    opts = {R_OPTION: r_local("0")} if with_r else {}
    return Command.from_json(command(["true"], opts=opts))


def test_properties_empty_when_containment_off_or_no_r():
    off, off_mapper = _containment({"AllowedCPUs": "0"}, constrain=False)
    assert off.properties(_request()) == {}
    on, on_mapper = _containment({"AllowedCPUs": "0"})
    assert on.properties(_request(with_r=False)) == {}
    assert off_mapper.calls == on_mapper.calls == []


def test_properties_pass_r_and_sdexec_properties_and_stringify():
    containment, mapper = _containment(
        {"AllowedCPUs": "0,2", "MemoryMax": 536870912, "CPUAccounting": True}
    )
    assert containment.properties(_request()) == {
        "AllowedCPUs": "0,2",
        "MemoryMax": "536870912",
        "CPUAccounting": "True",
    }
    assert mapper.calls == [(r_local("0"), {"MemoryMax": "1G"})]


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (
            RuntimeError("boom"),
            "mapper site.mappers.Fake failed: RuntimeError: boom",
        ),
        (
            ["AllowedCPUs=0"],
            "mapper site.mappers.Fake returned list, not a dict of properties",
        ),
        (None, "mapper site.mappers.Fake returned NoneType, not a dict of properties"),
        (
            # The spec's map_gpus example returns a list: str() of it was
            # "['/dev/nvidia0 rw']", shown by the CLI as mapped.
            {"DeviceAllow": ["/dev/nvidia0 rw"]},
            "mapper site.mappers.Fake returned DeviceAllow as list, not a string"
            ' (a list of devices is one string: "PATH rw,PATH rw")',
        ),
        (
            {"AllowedCPUs": "0", "MemoryMax": None},
            "mapper site.mappers.Fake returned MemoryMax as NoneType, not a string",
        ),
        (
            # Typed only on the unit: "AllowedCPUs: error setting property:
            # ...", naming no mapper, for every job; the CLI showed it mapped.
            {"AllowedCPUs": "zero"},
            "mapper site.mappers.Fake returned AllowedCPUs: invalid idset"
            " 'zero': 'zero' is not an id",
        ),
        (
            {"AllowedCPUs": "0", "ExtensionImages": "/img.raw"},
            "mapper site.mappers.Fake returned ExtensionImages: systemd takes it"
            " as D-Bus a(sba(ss)), which sdexec does not convert to (sent as a"
            " string, it would fail every job)",
        ),
        # Review session 47: the site's own rule for its properties, but for
        # the fences and the slice. ExecStart was refused only as untyped;
        # Restart=always was sent (a failed job run again behind sdexec's
        # back); a misspelt name failed every job in systemd, naming no
        # mapper.
        (
            {"AllowedCPUs": "0", "ExecStart": "/bin/sh"},
            "mapper site.mappers.Fake returned ExecStart: reserved: sdexec sets"
            " ExecStart itself",
        ),
        (
            {"AllowedCPUs": "0", "Restart": "always"},
            "mapper site.mappers.Fake returned Restart: reserved: lifecycle:"
            " sdexec stops, kills and reaps the unit itself",
        ),
        (
            {"AllowedCPUs": "0", "MemroyMax": "1G"},
            "mapper site.mappers.Fake returned MemroyMax: unknown property:"
            " systemd would refuse every unit with it (did you mean MemoryMax?)",
        ),
    ],
    ids=[
        "raises",
        "list",
        "none",
        "list-value",
        "none-value",
        "no-cpus",
        "untyped",
        "reserved",
        "lifecycle",
        "unknown",
    ],
)
def test_mapper_failures_name_the_class(result, message):
    containment, _ = _containment(result)
    with pytest.raises(MapperError) as raised:
        containment.properties(_request())
    assert str(raised.value) == message


def test_an_r_the_mapper_cannot_fence_is_the_request_s_fault():
    # "mapper sdexec.map.HwlocMapper failed: ValueError: R gives rank 0 no
    # cores and no GPUs to fence", sending the admin to the mapper.
    said = "R gives rank 0 no cores and no GPUs to fence (its children: none)"
    containment, _ = _containment(UnfenceableRequest(said))
    with pytest.raises(MapperError) as raised:
        containment.properties(_request())
    assert str(raised.value) == f"{R_OPTION}: {said}"


def test_a_mapper_s_os_error_reads_as_its_words_its_errno_apart():
    # It was "failed: OSError: [Errno 19] core 9 is beyond ...": the errno
    # told twice, the second time in Python's words (review 35 M4).
    containment, _ = _containment(OSError(errno.ENODEV, "core 9 is beyond it"))
    with pytest.raises(MapperError) as raised:
        containment.properties(_request())
    assert str(raised.value) == "mapper site.mappers.Fake failed: core 9 is beyond it"
    assert raised.value.__cause__.errno == errno.ENODEV


def test_a_mapper_s_os_error_keeps_the_file_it_names():
    # A site mapper's missing file was named by nothing but "No such file
    # or directory" (review 35 R1): a refused request leaves no traceback.
    missing = FileNotFoundError(
        errno.ENOENT, "No such file or directory", "/etc/site/gpu-map.json"
    )
    containment, _ = _containment(missing)
    with pytest.raises(MapperError) as raised:
        containment.properties(_request())
    assert str(raised.value) == (
        "mapper site.mappers.Fake failed: No such file or directory:"
        " '/etc/site/gpu-map.json'"
    )


# --- A soft:hard limit, as the mapper sees and gives it ----------------------

#: The site's nofile limit as an admin writes it (systemd.exec(5)'s pair),
#: which a job's unit gets as LimitNOFILESoft=1024 and LimitNOFILE=4096.
PAIR_SITE = {"LimitNOFILE": "1024:4096"}


class HalvingMapper(FakeMapper):
    """A site's mapper that gives a job half the site's hard nofile limit,
    read from ``extra_properties`` as a number."""

    def map(self, R, extra_properties=None):
        self.calls.append((R, extra_properties))
        return {
            "AllowedCPUs": "0",
            "LimitNOFILE": int(extra_properties["LimitNOFILE"]) // 2,
        }


def _unit_limits(containment: Containment, config: Config) -> dict[str, tuple]:
    """The nofile limits the unit of a job on core 0 gets, and their sources."""
    payload = {
        "flags": STREAMS,
        "cmd": command(["true"], opts={R_OPTION: r_local("0")}),
    }
    plan = plan_exec(payload, config, containment)
    return {
        p.name: (p.value, p.source)
        for p in plan.properties
        if p.name.startswith("LimitNOFILE")
    }


def test_the_mapper_sees_a_site_s_soft_hard_limit_as_the_unit_gets_it():
    # It was given "1024:4096", the admin's words, while the unit got the
    # pair as two limits: a mapper reading the hard limit as a number
    # failed every job (int("1024:4096")).
    config = _site_config(PAIR_SITE)
    mapper = HalvingMapper(None)
    limits = _unit_limits(Containment(config, mapper), config)
    assert mapper.calls[0][1] == {"LimitNOFILESoft": "1024", "LimitNOFILE": "4096"}
    assert limits == {
        "LimitNOFILESoft": (1024, "config"),
        "LimitNOFILE": (2048, "containment"),
    }


def test_a_mapper_s_soft_hard_pair_reaches_the_unit_as_its_two_limits():
    # A mapper giving back the site's words, a pair, failed every job:
    # "LimitNOFILE: error setting property: '1024:4096': one value, or in
    # LimitNOFILE one soft:hard pair", naming no mapper; the CLI showed it
    # as mapped.
    config = _site_config(PAIR_SITE)
    mapper = FakeMapper({"AllowedCPUs": "0", "LimitNOFILE": "100:200"})
    containment = Containment(config, mapper)
    assert containment.properties(_request()) == {
        "AllowedCPUs": "0",
        "LimitNOFILESoft": "100",
        "LimitNOFILE": "200",
    }
    assert _unit_limits(containment, config) == {
        "LimitNOFILESoft": (100, "containment"),
        "LimitNOFILE": (200, "containment"),
    }


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (
            # Told as "LimitNOFILESoft of [exec.sdexec-properties]: ..., with
            # the request's", when no request had set any.
            {"LimitNOFILE": "512"},
            "returned LimitNOFILE: LimitNOFILESoft=1024 above LimitNOFILE=512,"
            " which setrlimit refuses at every start (LimitNOFILESoft from"
            " [exec.sdexec-properties])",
        ),
        (
            {"LimitNOFILESoft": "8192"},
            "returned LimitNOFILESoft: LimitNOFILESoft=8192 above"
            " LimitNOFILE=4096, which setrlimit refuses at every start"
            " (LimitNOFILE from [exec.sdexec-properties])",
        ),
        (
            {"LimitNOFILE": "200:100"},
            "returned LimitNOFILE: '200:100': the soft limit is above the hard"
            " one, which systemd refuses (and setrlimit at every start)",
        ),
        (
            {"LimitNOFILE": "lots:100"},
            "returned LimitNOFILE: 'lots' is not a decimal integer",
        ),
    ],
    ids=["hard-below-site-soft", "soft-above-site-hard", "pair-reversed", "no-limit"],
)
def test_a_mapper_s_limit_systemd_refuses_names_the_mapper(limits, message):
    containment, _ = _containment({"AllowedCPUs": "0", **limits}, site=PAIR_SITE)
    with pytest.raises(MapperError) as raised:
        containment.properties(_request())
    assert str(raised.value).startswith(f"mapper site.mappers.Fake {message}")
    assert raised.value.reason.startswith(message)


def sent_job(
    R: str, constrain: bool, **opts: str
) -> tuple[Connection, FakeManager, FakeMapper]:
    """A job request with ``R`` (and ``opts``) sent to a server on the fake
    manager whose mapper is a :class:`FakeMapper`, containment on or off."""
    config = parse_config({"exec": {"sdexec-constrain-resources": constrain}})
    mapper = FakeMapper({"AllowedCPUs": "0"})
    systemd = FakeManager()
    server = SdexecServer(
        systemd, config, reactor, Containment(config, mapper), clock=Clock()
    )
    connection = Connection(server)
    opts = {R_OPTION: R, "SDEXEC_JOBID": "f1", **opts}
    connection.send(
        "sdexec.exec", {"flags": STREAMS, "cmd": command(["true"], opts=opts)}
    )
    return connection, systemd, mapper


def job_refusal(R: str, constrain: bool) -> tuple[tuple[int, str], list]:
    """The answer to a job request with ``R``, containment on or off, and
    the calls its mapper had."""
    connection, systemd, mapper = sent_job(R, constrain)
    (response,) = connection.responses()
    connection.close()
    systemd.close()
    return error_of(response), mapper.calls


@pytest.mark.parametrize(
    ("R", "said"),
    [
        ("{", "R: not valid JSON: Expecting property name enclosed in double"
              " quotes: line 1 column 2 (char 1)"),
        ("[]", "R: expected a JSON object, got an array"),
        (json.dumps({"version": 1, "execution": {"R_lite": [
            {"rank": "0", "children": {"core": "x"}}]}}),
         "R: execution.R_lite[0].children.core: invalid idset 'x': 'x' is not an id"),
        (json.dumps({"version": 1, "execution": {"expiration": -5, "R_lite": [
            {"rank": "0", "children": {"core": "0"}}]}}),
         "R: execution.expiration: negative (-5)"),
    ],
    ids=["json", "array", "idset", "expiration"],
)  # fmt: skip
@pytest.mark.parametrize("constrain", [True, False], ids=["contained", "not"])
def test_a_malformed_r_is_the_request_s_fault_contained_or_not(R, said, constrain):
    # With containment on, it was "mapper sdexec.map.HwlocMapper failed:
    # ValueError: R: ...", pointing the admin at the mapper; the expiration
    # lacked the option's name either way (review 35 M4).
    refusal, calls = job_refusal(R, constrain)
    assert refusal == (errno.EINVAL, f"{R_OPTION}: {said}")
    if "expiration" not in said:
        assert calls == []  # the mapper never saw it


def test_an_r_with_nothing_for_this_rank_is_the_request_s_fault():
    # The mapper's own refusal read "mapper ... failed: ValueError: R has no
    # resources for rank 0", sending the admin to the mapper.
    R = json.dumps({"version": 1, "execution": {"R_lite": [
        {"rank": "1", "children": {"core": "0"}}]}})  # fmt: skip
    refusal, calls = job_refusal(R, constrain=True)
    assert refusal == (
        errno.EINVAL,
        f"{R_OPTION}: R has no resources for rank 0 (its ranks are 1)",
    )
    assert calls == []  # the mapper never saw it


def test_a_contained_job_s_r_is_parsed_once(monkeypatch):
    # The check before the mapper, the mapper and the job's time limit each
    # parsed it: a large R (the command cap allows megabytes) held the
    # reactor's thread three times over (review 35 R5).
    parsed = []
    parse = ResourceSet.__init__

    def counted(self, R):
        parsed.append(R)
        parse(self, R)

    monkeypatch.setattr(ResourceSet, "__init__", counted)
    R = r_local("0")
    connection, systemd, mapper = sent_job(R, constrain=True, SDEXEC_NAME=UNIT)
    assert UNIT in systemd.units  # planned, admitted as a job, started
    assert parsed == [R]
    ((given, _),) = mapper.calls
    assert isinstance(given, ResourceSet)  # what a mapper's map() takes
    connection.close()
    systemd.close()


@pytest.mark.parametrize("kind", READERS)
def test_an_empty_cpuset_file_is_not_a_fence(tmp_path, kind):
    # cgroup v1 shows an empty cpuset.cpus (and .mems) for a cgroup nobody
    # configured.
    _fake_tree(tmp_path, kind, v1="\n", status=("0-3", "f"))
    expected = "0-15" if kind == "cpus" else "0-3"  # as with no cpuset at all
    assert READERS[kind](CGROUP, 42, root=str(tmp_path)) == IDset(expected)


# -- the fence check in the service, offline ------------------------------------

UNIT = "sdexec-fenced.service"
#: Output streamed, no write credit: the responses are the job's life only.
STREAMS = int(ExecFlag.STDOUT | ExecFlag.STDERR)


@pytest.fixture
def main_process():
    """A real process to stand for the unit's main one: the fence check
    reads its /proc/PID/status (the fake manager gives no ControlGroup)."""
    process = subprocess.Popen(["sleep", "300"])
    yield process.pid
    process.kill()
    process.wait()


def fenced_exec(
    mapped: dict, pid: int, check: str = "drain", bus: str = "user", units: int = 1
):
    """``units`` execs (one by default) whose mapper sets ``mapped``, on a
    server with the fake manager of ``bus``; each unit starts with ``pid``
    as its main process. (server, the connection's responses)."""
    config = parse_config(
        {
            "exec": {"sdexec-constrain-resources": True},
            "sdexec": {"containment-check": check},
            "systemd": {"bus": bus},
        }
    )
    systemd = FakeManager()
    server = SdexecServer(
        systemd, config, reactor, Containment(config, FakeMapper(mapped)), clock=Clock()
    )
    connection = Connection(server)
    for n in range(units):
        unit = UNIT if n == 0 else f"sdexec-fenced-{n}.service"
        opts = {R_OPTION: r_local("0"), "SDEXEC_NAME": unit}
        request = {"flags": STREAMS, "cmd": command(["true"], opts=opts)}
        connection.send("sdexec.exec", request, matchtag=1 + n)
        systemd.run(unit, pid=pid)
    if check == "drain":
        # A refused unit's EIO waits for it to go, which this manager never
        # says (under warn no unit is refused, and no time need pass).
        server.clock.advance(FAILED_UNIT_WAIT)
    responses = connection.responses()
    connection.close()
    systemd.close()
    return server, responses


@pytest.fixture
def node_without_cpuset(tmp_path, main_process, monkeypatch) -> dict[str, str]:
    """The node the fence check of ``fenced_exec``'s unit reads, under
    ``tmp_path``, not the machine's (whose cgroups differ from node to
    node): CPUs 0-15 and NUMA nodes 0-1 online, the cpuset controller at
    the root cgroup only, not reaching the unit's (a manager it is not
    delegated to), so the unit may use all of them. The fences that hold
    there."""
    pid = main_process
    # Where the fake manager makes the unit (the real process is elsewhere).
    unit = f"{FakeManager().control_group}/sdexec.slice/{UNIT}"
    cpus, nodes = "0-15", "0-1"
    files = {
        f"proc/{pid}/stat": f"{pid} (sleep) S 1 {pid} {pid} 0 -1\n",
        f"proc/{pid}/status": "Name:\tsleep\n",
        f"proc/{pid}/cgroup": f"0::{unit}\n",
        f"sys/fs/cgroup{unit}/cgroup.procs": f"{pid}\n",
        "sys/fs/cgroup/cpuset.cpus.effective": cpus,
        "sys/fs/cgroup/cpuset.mems.effective": nodes,
        "sys/devices/system/cpu/online": cpus,
        "sys/devices/system/node/online": nodes,
    }
    for relative, text in files.items():
        _fake_file(tmp_path, relative, text)
    monkeypatch.setattr(
        sdexec.server,
        "judge_fences",
        functools.partial(judge_fences, root=str(tmp_path)),
    )
    return {"AllowedCPUs": cpus, "AllowedMemoryNodes": nodes}


def own_fences(pid: int) -> dict[str, str]:
    """A mapper's fence that holds for ``pid``: the CPUs and nodes it has."""
    cpus, mems = enforced_cpus(None, pid), enforced_mems(None, pid)
    assert cpus is not None and mems is not None
    return {"AllowedCPUs": str(cpus), "AllowedMemoryNodes": str(mems)}


@pytest.mark.parametrize(
    ("broken", "named"),
    [(["AllowedMemoryNodes"], "AllowedMemoryNodes"),
     (["AllowedCPUs"], "AllowedCPUs"),
     (["AllowedCPUs", "AllowedMemoryNodes"], "AllowedCPUs")],
    ids=["nodes", "cpus", "both-cpus-first"],
)  # fmt: skip
def test_a_fence_the_node_does_not_hold_fails_the_job_and_drains(
    main_process, node_without_cpuset, broken, named
):
    held = node_without_cpuset
    fences = {**held, **dict.fromkeys(broken, "1")}
    server, responses = fenced_exec(fences, main_process)
    reason = (
        f"{named} not enforced: expected 1 got {held[named]}"
        " (is the cpuset controller delegated to the user instance?)"
    )
    assert [error_of(response) for response in responses] == [(errno.EIO, reason)]
    assert server.stats()["drain"] == drained_by(reason, "fence")
    assert server.counters["fence-failures"] == 1


def test_the_service_words_a_fence_s_hint_for_the_system_manager(
    main_process, node_without_cpuset
):
    fences = {**node_without_cpuset, "AllowedCPUs": "1"}
    _, responses = fenced_exec(fences, main_process, bus="system")
    assert [error_of(response) for response in responses] == [
        (
            errno.EIO,
            "AllowedCPUs not enforced: expected 1 got 0-15 (does the system"
            " manager have the cpuset controller? a container must be"
            " delegated it)",
        )
    ]


def test_a_mapper_fencing_memory_nodes_alone_has_them_checked(main_process):
    # A custom mapper may set AllowedMemoryNodes without AllowedCPUs.
    server, responses = fenced_exec(
        {"AllowedMemoryNodes": str(ABSENT_NODE)}, main_process
    )
    assert [error_of(response)[0] for response in responses] == [errno.EIO]
    assert server.drain_reason.startswith("AllowedMemoryNodes not enforced")
    assert server.counters["fence-failures"] == 1


def test_memory_nodes_not_held_under_warn_are_counted_and_the_job_runs(
    main_process,
):
    fences = {**own_fences(main_process), "AllowedMemoryNodes": str(ABSENT_NODE)}
    server, responses = fenced_exec(fences, main_process, check="warn")
    assert [r["payload"] for r in responses] == [
        {"type": "started", "pid": main_process}
    ]
    assert server.drain_reason is None
    assert server.counters["fence-failures"] == 1


@pytest.mark.parametrize("nodes", [True, False], ids=["nodes", "no-nodes"])
def test_fences_that_hold_let_the_job_start(main_process, nodes):
    fences = own_fences(main_process)
    if not nodes:  # a custom mapper may fence CPUs only
        del fences["AllowedMemoryNodes"]
    server, responses = fenced_exec(fences, main_process)
    assert [r["payload"] for r in responses] == [
        {"type": "started", "pid": main_process}
    ]
    assert server.drain_reason is None
    assert server.counters["fence-failures"] == 0


def test_fences_written_as_systemd_takes_them_are_checked_as_such(
    main_process, node_without_cpuset
):
    # A site's mapper may write a CPU list with spaces, as systemd takes it:
    # the unit took "0-7 8-15", and the fence check read it as an RFC 22
    # idset: "sdexec: internal error: ValueError: invalid idset '0-7 8-15'",
    # a traceback logged for every job.
    fences = {"AllowedCPUs": "0-7 8-15", "AllowedMemoryNodes": "0, 1"}
    server, responses = fenced_exec(fences, main_process)
    assert [r["payload"] for r in responses] == [
        {"type": "started", "pid": main_process}
    ]
    assert server.drain_reason is None


def test_a_fence_written_with_spaces_that_does_not_hold_drains(
    main_process, node_without_cpuset
):
    fences = {**node_without_cpuset, "AllowedCPUs": "1 3"}
    server, responses = fenced_exec(fences, main_process)
    reason = (
        "AllowedCPUs not enforced: expected 1,3 got 0-15"
        " (is the cpuset controller delegated to the user instance?)"
    )
    assert [error_of(response) for response in responses] == [(errno.EIO, reason)]
    assert server.drain_reason == reason


def logged_during(action) -> list[str]:
    """The log lines written while ``action()`` runs, and its result."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        result = action()
    finally:
        globalLogPublisher.removeObserver(events.append)
    return [formatEvent(event) for event in events], result


def test_a_fence_unreadable_while_the_process_lives_does_not_hold(
    main_process, monkeypatch
):
    # A status hidden (hidepid) and no cpuset in the unit's cgroup: the
    # fence cannot be verified, which is no fence, as the device canary's.
    # The fence the mapper would set is read before /proc is hidden.
    fences = own_fences(main_process)
    monkeypatch.setattr(sdexec.containment, "enforced_mems", lambda *_: None)
    monkeypatch.setattr(sdexec.containment, "process_status", lambda *_: None)
    server, responses = fenced_exec(fences, main_process)
    (error,) = [error_of(response) for response in responses]
    assert error == (errno.EIO, server.drain_reason)
    assert server.drain_reason == (
        "AllowedMemoryNodes could not be verified: no cpuset of the unit's"
        f" cgroup says which it may use, and /proc/{main_process}/status"
        " cannot be read (is /proc mounted hidepid?)"
    )
    assert server.counters["fence-failures"] == 1


def test_a_hidden_main_process_is_fenced_where_the_manager_makes_its_cgroup(
    main_process, monkeypatch
):
    # /proc hidden (hidepid, a job of another user) and ControlGroup not yet
    # known: the unit's cgroup is where its manager makes it, not unknown
    # (unknown, the check read nothing and drained the node).
    monkeypatch.setattr(sdexec.orphans, "process_cgroups", lambda *_: None)
    judged = []
    real_judge = sdexec.server.judge_fences
    monkeypatch.setattr(
        sdexec.server,
        "judge_fences",
        lambda fences, cgroup, pid, **kw: (
            judged.append(cgroup) or real_judge(fences, cgroup, pid, **kw)
        ),
    )
    fenced_exec(own_fences(main_process), main_process)
    manager = FakeManager().control_group
    assert judged == [f"{manager}/sdexec.slice/{UNIT}"]


def test_a_process_gone_before_its_fence_is_read_is_logged_not_a_failure(
    main_process, monkeypatch
):
    monkeypatch.setattr(sdexec.containment, "enforced_cpus", lambda *_: None)
    monkeypatch.setattr(sdexec.containment, "process_exists", lambda *_: False)
    logged, (server, responses) = logged_during(
        lambda: fenced_exec(own_fences(main_process), main_process)
    )
    assert [r["payload"]["type"] for r in responses] == ["started"]
    assert server.counters["fence-failures"] == 0
    # Its unit named too: an admin ties it to a job by the unit.
    gone = f"{UNIT}: pid {main_process} exited before its CPU fence could be checked"
    assert [line for line in logged if "could" in line] == [gone]


@pytest.fixture
def oddly_named_process(tmp_path):
    """A live process whose name is not ASCII: the kernel shows it as is
    in the Name line of /proc/PID/status."""
    program = tmp_path / "größe"
    shutil.copy("/bin/sleep", program)
    process = subprocess.Popen([str(program), "300"])
    yield process.pid
    process.kill()
    process.wait()


def test_a_process_not_named_in_ascii_has_its_fence_checked(oddly_named_process):
    pid = oddly_named_process
    deadline = time.monotonic() + 30  # an exec, on a loaded machine
    while "größe".encode() not in Path(f"/proc/{pid}/status").read_bytes():
        # the name is the program's once it has exec'd
        assert time.monotonic() < deadline, "the oddly named program never ran"
        time.sleep(0.01)
    held = own_fences(pid)
    server, responses = fenced_exec({**held, "AllowedCPUs": str(ABSENT_NODE)}, pid)
    assert [error_of(response)[0] for response in responses] == [errno.EIO]
    assert server.drain_reason.startswith("AllowedCPUs not enforced")


def test_under_warn_every_fence_that_does_not_hold_is_logged(main_process):
    broken = dict.fromkeys(("AllowedCPUs", "AllowedMemoryNodes"), str(ABSENT_NODE))
    logged, (server, responses) = logged_during(
        lambda: fenced_exec(broken, main_process, check="warn")
    )
    assert [r["payload"]["type"] for r in responses] == ["started"]
    assert server.counters["fence-failures"] == 1  # a unit, counted once
    (warned,) = [line for line in logged if "warn:" in line]
    assert warned.startswith(f"{UNIT} (pid {main_process}): AllowedCPUs not enforced")
    assert "; AllowedMemoryNodes not enforced" in warned


def test_under_warn_a_node_that_cannot_fence_logs_a_bounded_number_of_lines(
    main_process,
):
    # Every job of a node whose cgroups cannot enforce the fence logged the
    # same line, naming no unit: 10,000 jobs, 10,000 lines.
    broken = {"AllowedCPUs": str(ABSENT_NODE)}
    logged, (server, responses) = logged_during(
        lambda: fenced_exec(broken, main_process, check="warn", units=3 * BURST)
    )
    assert [r["payload"]["type"] for r in responses] == ["started"] * 3 * BURST
    assert server.counters["fence-failures"] == 3 * BURST
    warned = [line for line in logged if "warn:" in line]
    assert len(warned) == BURST
    assert warned[-1].startswith(f"sdexec-fenced-{BURST - 1}.service (pid ")
    (summary,) = logged_during(lambda: server.clock.advance(WINDOW_S))[0]
    assert summary.startswith(f"{2 * BURST} more like it in 60 s not logged")


def test_an_unreadable_list_of_online_cpus_is_named_as_what_failed(tmp_path):
    # The reason blamed /proc/PID/status and hidepid, read fine, for a
    # /sys/devices/system/cpu/online a container had masked.
    _fake_file(tmp_path, "proc/42/status", "Name:\tx\nCpus_allowed_list:\t0-1\n")
    _fake_file(tmp_path, "proc/42/cgroup", "0::" + CGROUP)
    verdict = judge_fences(Fences(IDset("0-1")), CGROUP, 42, root=str(tmp_path))
    assert verdict.problems == [
        "AllowedCPUs could not be verified: no cpuset of the unit's cgroup says"
        " which it may use, and /sys/devices/system/cpu/online cannot be read"
    ]


def test_judging_goes_on_to_the_memory_cap_on_a_kernel_without_cpusets(tmp_path):
    # /proc/42/status without Mems_allowed_list: every node may be used,
    # which a fence to all of them (node 0 here) allows; a cgroup v2 unit
    # with no memory limit.
    _fake_file(tmp_path, "proc/42/status", "Name:\tx\nCpus_allowed_list:\t0-1\n")
    _fake_file(tmp_path, "sys/devices/system/cpu/online", "0-1\n")
    _fake_file(tmp_path, "proc/42/cgroup", "0::" + CGROUP)
    fences = Fences(IDset("0-1"), IDset("0"), memory_capped=True)
    verdict = judge_fences(fences, CGROUP, 42, root=str(tmp_path))
    assert verdict == FenceVerdict(problems=[MEMORY_NOT_ENFORCED["user"]])


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (OSError(errno.ETIMEDOUT, "lstopo-no-graphics: no answer in 30s"), True),
        (OSError(errno.ENOMEM, "fork: no memory"), True),
        (OSError(errno.ENOSPC, "writing the topology: no space"), True),
        (OSError(errno.EDQUOT, "writing the topology: over quota"), True),
        (OSError(errno.ENOENT, "hwloc-calc not found on PATH"), False),
        (OSError(errno.EIO, "hwloc-calc: XML component discovery failed"), False),
        (ValueError("mapper 'x.Y': constructing it failed"), False),
    ],
)
def test_a_mapper_the_machine_failed_to_build_is_a_transient_config_error(
    monkeypatch, error, transient
):
    """The service exits 1 (restarted) for those, 78 (not) for the rest."""

    def fails(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(sdexec.containment, "create_mapper", fails)
    config = parse_config({"exec": {"sdexec-constrain-resources": True}})
    with pytest.raises(ConfigError) as refused:
        Containment.from_config(config)
    assert refused.value.transient is transient
    assert refused.value.key == "sdexec.mapper"


def test_a_full_temporary_directory_under_the_topology_may_pass(monkeypatch, tmp_path):
    # /run full as sdexec starts: the topology's copy for hwloc-calc could
    # not be written, and the service exited 78, never restarted once /run
    # had room again (review session 34 N, N3).
    topology = Path(__file__).parent / "data" / "small.xml"

    def full(**_kwargs):
        path = tmp_path / "sdexec-topology-x.xml"
        path.write_text("")
        return os.open("/dev/full", os.O_WRONLY), str(path)

    monkeypatch.setattr(sdexec.map.topology.tempfile, "mkstemp", full)
    config = parse_config(
        {
            "exec": {"sdexec-constrain-resources": True},
            "sdexec": {"topology": str(topology)},
        }
    )
    with pytest.raises(ConfigError) as refused:
        Containment.from_config(config)
    assert refused.value.transient
    assert (
        "writing the topology for hwloc-calc in"
        f" {sdexec.map.topology.tempfile.gettempdir()}: No space left on device"
    ) in str(refused.value)


def _topology_refusal(topology: str) -> str:
    config = parse_config(
        {
            "exec": {"sdexec-constrain-resources": True},
            "sdexec": {"topology": topology},
        }
    )
    with pytest.raises(ConfigError) as refused:
        Containment.from_config(config)
    assert refused.value.key == "sdexec.topology"
    return str(refused.value)


def test_a_topology_that_is_a_fifo_or_a_device_is_refused_not_read(tmp_path):
    # Opened and read as it was, a FIFO blocked the start, the checker and
    # every reload (systemd left "reloading", each later SIGHUP queued
    # behind it); /dev/zero read until memory ran out.
    fifo = tmp_path / "topology.xml"
    os.mkfifo(fifo)
    assert _topology_refusal(str(fifo)).endswith(f"{fifo}: not a regular file")
    assert _topology_refusal("/dev/zero").endswith("/dev/zero: not a regular file")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("root:x:0:0::/root:/bin/sh\n",
         "topology XML: not well-formed (invalid token): line 1, column 12"),
        ("", "topology XML: no element found: line 1, column 0"),
        ("<foo/>", "topology XML: the root element is <foo>, not hwloc's <topology>"),
        ("<topology/>", "topology XML: it has no PU objects"),
    ],
)  # fmt: skip
def test_a_topology_that_is_not_hwloc_xml_is_blamed_on_the_topology_key(
    tmp_path, text, said
):
    # It was "sdexec.mapper: [Errno 22] mapper 'sdexec.map.HwlocMapper':
    # topology XML: not well-formed: not well-formed (invalid token)…", while
    # a file that could not be read was sdexec.topology's (review 35 M3).
    topology = tmp_path / "topology.xml"
    topology.write_text(text)
    assert _topology_refusal(str(topology)) == (
        f"<config>: sdexec.topology: {topology}: {said}"
    )


def test_a_mapper_that_cannot_be_built_is_told_without_python_s_errno(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    config = parse_config({"exec": {"sdexec-constrain-resources": True}})
    with pytest.raises(ConfigError) as refused:
        Containment.from_config(config)
    assert refused.value.key == "sdexec.mapper"
    assert "Errno" not in str(refused.value)
    assert str(refused.value) == (
        "<config>: sdexec.mapper:"
        " lstopo-no-graphics not found on PATH (it comes with hwloc)"
    )


def test_a_topology_larger_than_any_node_s_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sdexec.config, "MAX_FILE_BYTES", 1024)
    big = tmp_path / "topology.xml"
    big.write_text("<topology>" + " " * 2000 + "</topology>")
    assert _topology_refusal(str(big)).endswith(f"{big}: larger than 1024 bytes")


@pytest.mark.parametrize(
    ("configured", "capped"),
    [(None, False), ("1G", True), ("50%", True), (" infinity", False),
     ("infinity", False), (str(2**64 - 1), False)],
)  # fmt: skip
def test_the_fence_check_looks_for_the_sites_real_memory_cap(configured, capped):
    table = (
        {} if configured is None else {"sdexec-properties": {"MemoryMax": configured}}
    )
    assert Containment(parse_config({"exec": table}), None).caps_memory is capped


@pytest.mark.parametrize(
    ("mapped", "checked"),
    [("536870912", True), ("infinity", False)],
    ids=["scaled", "lifted"],
)
def test_the_cap_checked_is_the_one_the_unit_was_given(mapped, checked):
    # A site mapper may lift the site's MemoryMax for some jobs (its values
    # win, the spec says); the kernel then holds the unit to no limit, as
    # asked, and the check that looked for the site's cap drained the node
    # (review session 32 L F3).
    config = parse_config(
        {
            "exec": {
                "sdexec-constrain-resources": True,
                "sdexec-properties": {"MemoryMax": "90%"},
            }
        }
    )
    mapper = FakeMapper({"AllowedCPUs": "0", "MemoryMax": mapped})
    opts = {R_OPTION: r_local("0")}
    payload = {"flags": STREAMS, "cmd": command(["true"], opts=opts)}
    plan = plan_exec(payload, config, Containment(config, mapper))
    assert plan.memory_capped is checked
    # A request's own, tighter cap is its business: one the node cannot
    # hold must not drain it (review session 32 S5).
    opts["SDEXEC_PROP_MemoryMax"] = "256M"
    payload = {"flags": STREAMS, "cmd": command(["true"], opts=opts)}
    plan = plan_exec(payload, config, Containment(config, mapper))
    assert plan.memory_capped is checked


def _job_exec_payload(site: dict[str, str], **more: str) -> dict:
    """An exec as Flux's job-exec sends it to a node with ``site`` as its
    ``[exec.sdexec-properties]``: each of them again as ``SDEXEC_PROP_``
    (its exec_cmd.c), with the shell's R (core 0 of the node's two)."""
    opts = {f"SDEXEC_PROP_{name}": value for name, value in site.items()}
    opts |= {R_OPTION: r_local("0"), **more}
    return {"flags": STREAMS, "cmd": command(["true"], opts=opts)}


def test_job_exec_s_restatement_of_the_site_s_properties_is_the_site_s():
    # Judged as the request's own, the scaled cap of a job on half the node
    # made its restated 90% "looser" and a name requests may not set was
    # refused: every job of such a site failed (review session 40 P F1, F2).
    site = {"MemoryMax": "90%", "TasksMax": "4096"}
    config = parse_config(
        {
            "exec": {"sdexec-constrain-resources": True, "sdexec-properties": site},
            "sdexec": {"topology": str(SMALL_TOPOLOGY)},
        }
    )
    containment = Containment.from_config(config)
    plan = plan_exec(_job_exec_payload(site), config, containment)
    given = {p.name: (p.value, p.source) for p in plan.properties}
    # 90% of the node scaled to the job's half of it (a percentage travels
    # as MemoryMaxScale, in parts of 2^32)
    assert given["MemoryMaxScale"] == (int(0.45 * 2**32), "containment")
    assert given["TasksMax"] == (4096, "config")
    # A value of the request's own is still judged: looser, or not its to set.
    for name, value, why in (
        ("MemoryMax", "95%", "is looser than this node's MemoryMax="),
        ("TasksMax", "8192", "requests may not set TasksMax"),
    ):
        payload = _job_exec_payload(site, **{f"SDEXEC_PROP_{name}": value})
        with pytest.raises(RequestRefused, match=why) as refused:
            plan_exec(payload, config, containment)
        assert refused.value.errnum == errno.EPERM


# --- Reasons worded for the manager and the slice (review 32 L, F2) ----------

SYSTEM_CGROUP = "/sdexec.slice/job.service"


def _fake_system_unit(root: Path, cpus: str, mems: str, memory_max: str) -> None:
    """Process 42 in a system manager's unit under sdexec.slice, with the
    unit's own cpuset effective sets and memory.max."""
    unit = f"sys/fs/cgroup{SYSTEM_CGROUP}"
    _fake_file(root, "proc/42/stat", "42 (flux-shell) S 1 42 42 0 -1\n")
    _fake_file(root, "proc/42/status", "Name:\tflux-shell\nMems_allowed_list:\t0\n")
    _fake_file(root, "proc/42/cgroup", f"0::{SYSTEM_CGROUP}\n")
    _fake_file(root, f"{unit}/cgroup.procs", "42\n")
    _fake_file(root, f"{unit}/cpuset.cpus.effective", cpus)
    _fake_file(root, f"{unit}/cpuset.mems.effective", mems)
    _fake_file(root, f"{unit}/memory.max", memory_max)


@pytest.mark.parametrize(
    ("fences", "kind", "held", "reason"),
    [
        (Fences(IDset("0-1"), IDset("0")), "cpus", "2-15",
         "AllowedCPUs not enforced: expected 0-1 got 2-15 (the slice's own"
         " cpuset is the cause: /sdexec.slice has cpuset.cpus.effective 2-15,"
         " none of the job's 0-1)"),
        (Fences(IDset("0-3"), IDset("0")), "mems", "1",
         "AllowedMemoryNodes not enforced: expected 0 got 1 (the slice's own"
         " cpuset is the cause: /sdexec.slice has cpuset.mems.effective 1,"
         " none of the job's 0)"),
    ],
    ids=["cpus", "mems"],
)  # fmt: skip
@pytest.mark.parametrize("bus", ["user", "system"])
def test_a_slice_cpuset_excluding_the_job_is_named_as_the_cause(
    tmp_path, fences, kind, held, reason, bus
):
    # sdexec.slice keeps housekeeping CPUs (or a NUMA node) from jobs while
    # R still lists them: the unit's set has nothing in common with its
    # slice's, so the kernel gives it the slice's. The reason blamed the
    # cpuset controller's delegation to the user instance, even under the
    # system manager, with cpuset enabled on the unit.
    _fake_system_unit(tmp_path, "0-3\n", "0\n", "max\n")
    _fake_file(tmp_path, f"sys/fs/cgroup{SYSTEM_CGROUP}/cpuset.{kind}.effective", held)
    _fake_file(tmp_path, f"sys/fs/cgroup/sdexec.slice/cpuset.{kind}.effective", held)
    verdict = judge_fences(fences, SYSTEM_CGROUP, 42, root=str(tmp_path), bus=bus)
    assert verdict.problems == [reason]


#: The sandbox's layout on a cgroup v2 node: its slices under the root.
SANDBOX_CGROUP = "/sdexec-sandbox-7/app.slice/job.service"
#: What the fake node of a fence to what it does not have has online.
NODE_ONLINE = {"cpus": "0-15", "mems": "0-1"}


def _fake_node_holding_all(
    root: Path, kind: str, layout: str, held: str | None = None
) -> None:
    """Process 42 in ``SANDBOX_CGROUP`` on a node with ``NODE_ONLINE``,
    every one of which its cpuset ``kind`` gives the unit: on ``v2`` the
    controller reaches the unit's own cgroup, whose set is its slice's (as
    the kernel leaves it when it refuses the unit's own), on ``v1`` the
    process is in the root cpuset cgroup. ``held``: what the cpuset gives
    instead of all of it."""
    held = f"{held or NODE_ONLINE[kind]}\n"
    _fake_file(root, "sys/devices/system/cpu/online", f"{NODE_ONLINE['cpus']}\n")
    _fake_file(root, "sys/devices/system/node/online", f"{NODE_ONLINE['mems']}\n")
    _fake_file(root, "proc/42/stat", "42 (sleep) S 1 42 42 0 -1\n")
    _fake_file(root, "proc/42/status", f"Name:\tsleep\nMems_allowed_list:\t{held}")
    if layout == "v1":
        _fake_file(
            root, "proc/42/cgroup", f"7:cpuset:/\n1:name=systemd:{SANDBOX_CGROUP}\n"
        )
        _fake_file(root, f"sys/fs/cgroup/cpuset/cpuset.{kind}", held)
        return
    _fake_file(root, "proc/42/cgroup", f"0::{SANDBOX_CGROUP}\n")
    _fake_file(root, f"sys/fs/cgroup{SANDBOX_CGROUP}/cgroup.procs", "42\n")
    parts = SANDBOX_CGROUP.split("/")
    for end in range(len(parts), 0, -1):  # the unit, its slices, the root
        cgroup = "/".join(parts[:end])
        _fake_file(root, f"sys/fs/cgroup{cgroup}/cpuset.{kind}.effective", held)


@pytest.mark.parametrize("layout", ["v1", "v2"])
@pytest.mark.parametrize(
    ("kind", "name"), [("cpus", "AllowedCPUs"), ("mems", "AllowedMemoryNodes")]
)
@pytest.mark.parametrize("bus", ["user", "system"])
def test_a_fence_to_what_the_node_does_not_have_says_so(
    tmp_path, layout, kind, name, bus
):
    # R, or a [sdexec] topology copied from another node type, names CPU
    # (or NUMA node) 4095, which this node does not have: no cgroup can
    # hold a unit to it. The reason blamed the slice on v2, whose set holds
    # every CPU, and the controller's delegation on v1 (review session 34
    # D, F1).
    _fake_node_holding_all(tmp_path, kind, layout)
    absent = IDset("4095")
    fences = Fences(cpus=absent) if kind == "cpus" else Fences(mems=absent)
    verdict = judge_fences(fences, SANDBOX_CGROUP, 42, root=str(tmp_path), bus=bus)
    held = NODE_ONLINE[kind]
    assert verdict.problems == [
        f"{name} not enforced: expected 4095 got {held}"
        f" (4095 is not on this node, which has {MEMBERS[kind]} {held}:"
        " the kernel refuses the whole set)"
    ]


@pytest.mark.parametrize("layout", ["v1", "v2"])
@pytest.mark.parametrize(
    ("kind", "name", "fence"),
    [("cpus", "AllowedCPUs", "0,16"), ("mems", "AllowedMemoryNodes", "1-2")],
)
def test_a_fence_with_some_of_what_the_node_lacks_says_so(
    tmp_path, layout, kind, name, fence
):
    # A topology copied from a 32-PU node onto this 16-PU one: core 0 is
    # PUs 0,16 there. The kernel refuses the whole set for the one it
    # lacks, and the unit keeps its slice's; the reason blamed the
    # delegation, as the node has CPU 0 online (review session 34 N, N1).
    _fake_node_holding_all(tmp_path, kind, layout)
    fences = Fences(cpus=IDset(fence)) if kind == "cpus" else Fences(mems=IDset(fence))
    verdict = judge_fences(fences, SANDBOX_CGROUP, 42, root=str(tmp_path))
    held = NODE_ONLINE[kind]
    assert verdict.problems == [
        f"{name} not enforced: expected {fence} got {held}"
        f" ({IDset(fence) - IDset(held)} is not on this node, which has"
        f" {MEMBERS[kind]} {held}: the kernel refuses the whole set)"
    ]


@pytest.mark.parametrize(
    ("kind", "name"), [("cpus", "AllowedCPUs"), ("mems", "AllowedMemoryNodes")]
)
@pytest.mark.parametrize("bus", ["user", "system"])
def test_a_fence_on_a_v1_cpuset_names_v1_not_the_delegation(tmp_path, kind, name, bus):
    # A v1 or hybrid node (RHEL 8's default): the cpuset controller is on
    # v1, where systemd never applies a cpuset property. The hint asked
    # whether the controller was delegated, which sends the admin the wrong
    # way: no delegation makes it hold (review session 32 S, S4).
    _fake_node_holding_all(tmp_path, kind, "v1")
    fences = Fences(cpus=IDset("1")) if kind == "cpus" else Fences(mems=IDset("1"))
    verdict = judge_fences(fences, SANDBOX_CGROUP, 42, root=str(tmp_path), bus=bus)
    assert verdict.problems == [
        f"{name} not enforced: expected 1 got {NODE_ONLINE[kind]} (systemd applies"
        f" {name} only on the unified cgroup v2 hierarchy, and this node's cpuset"
        " controller is on cgroup v1)"
    ]


@pytest.mark.parametrize("layout", ["v1", "v2"])
@pytest.mark.parametrize("present", ["0-31", None], ids=["present", "no-present"])
@pytest.mark.parametrize(
    ("fence", "why"),
    [
        ("16-17", "16-17 is offline: online CPUs 0-15"),
        ("15-16", "16 is offline: online CPUs 0-15"),
        (
            "32-35",
            "32-35 is not on this node, which has CPUs 0-31: the kernel"
            " refuses the whole set",
        ),
        (
            "0,32",
            "32 is not on this node, which has CPUs 0-31: the kernel refuses"
            " the whole set",
        ),
    ],
    ids=["offline", "partly-offline", "absent", "partly-absent"],
)
def test_cpus_the_node_has_offline_are_told_from_those_it_lacks(
    tmp_path, layout, present, fence, why
):
    # CPUs 16-31 are the node's, offline: not "not on this node", which
    # sent the admin to fix R for what chcpu brings back; one offline
    # member is enough (v1 refuses the whole set). CPUs 32-63 are possible
    # but not present (empty sockets, a VM's hotplug slots): no chcpu
    # brings them online, so they are not on this node either, where the
    # kernel lists the present ones (review session 34 R, R4).
    _fake_node_holding_all(tmp_path, "cpus", layout)
    possible = "0-31" if present is None else "0-63"
    _fake_file(tmp_path, "sys/devices/system/cpu/possible", f"{possible}\n")
    if present is not None:
        _fake_file(tmp_path, "sys/devices/system/cpu/present", f"{present}\n")
    verdict = judge_fences(Fences(IDset(fence)), SANDBOX_CGROUP, 42, root=str(tmp_path))
    assert verdict.problems == [
        f"AllowedCPUs not enforced: expected {fence} got 0-15 ({why})"
    ]


def test_a_node_without_numa_has_node_0_alone(tmp_path):
    _fake_node_holding_all(tmp_path, "mems", "v2", held="0")
    (tmp_path / "sys/devices/system/node/online").unlink()
    verdict = judge_fences(
        Fences(mems=IDset("1")), SANDBOX_CGROUP, 42, root=str(tmp_path)
    )
    assert verdict.problems == [
        "AllowedMemoryNodes not enforced: expected 1 got 0 (1 is not on this"
        " node, which has NUMA nodes 0: the kernel refuses the whole set)"
    ]


@pytest.mark.parametrize(
    ("job", "unit_and_slice"),
    [("0-1", "0-15"), ("0-3", "2-15")],
    ids=["slice-holds-the-job", "slice-shares-some"],
)
def test_a_slice_with_some_of_the_job_s_cpus_is_not_blamed(
    tmp_path, job, unit_and_slice
):
    # The controller reaches the unit, and the slice has some or all of the
    # job's CPUs: a fence written would give the unit those, within it; a
    # unit holding the slice's whole set never had its own written (review
    # session 32 S3 for the second).
    _fake_system_unit(tmp_path, f"{unit_and_slice}\n", "0\n", "max\n")
    slice_cpus = "sys/fs/cgroup/sdexec.slice/cpuset.cpus.effective"
    _fake_file(tmp_path, slice_cpus, f"{unit_and_slice}\n")
    verdict = judge_fences(
        Fences(IDset(job)), SYSTEM_CGROUP, 42, root=str(tmp_path), bus="system"
    )
    assert verdict.problems == [
        f"AllowedCPUs not enforced: expected {job} got {unit_and_slice} (does the"
        " system manager have the cpuset controller? a container must be"
        " delegated it)"
    ]


@pytest.mark.parametrize("bus", ["user", "system"])
def test_an_undelegated_controller_is_hinted_for_the_manager_that_runs_the_unit(
    tmp_path, bus
):
    # No cpuset in the unit's cgroup (the controller does not reach it): its
    # slice's set, which excludes the job, is read, and the controller is
    # the cause, not the slice. Under the system manager no user instance is
    # involved.
    _fake_system_unit(tmp_path, "0-3\n", "0\n", "max\n")
    for kind in ("cpus", "mems"):
        (tmp_path / f"sys/fs/cgroup{SYSTEM_CGROUP}/cpuset.{kind}.effective").unlink()
    _fake_file(tmp_path, "sys/fs/cgroup/sdexec.slice/cpuset.cpus.effective", "2-15\n")
    _fake_file(tmp_path, "sys/fs/cgroup/sdexec.slice/cpuset.mems.effective", "0\n")
    fences = Fences(IDset("0-1"), IDset("0"), memory_capped=True)
    verdict = judge_fences(
        fences, SYSTEM_CGROUP, 42, first_only=False, root=str(tmp_path), bus=bus
    )
    hint = {
        "user": "is the {} controller delegated to the user instance?",
        "system": "does the system manager have the {} controller? a container"
        " must be delegated it",
    }[bus]
    assert verdict.problems == [
        f"AllowedCPUs not enforced: expected 0-1 got 2-15 ({hint.format('cpuset')})",
        "MemoryMax not enforced: the unit's cgroup has no memory limit"
        f" ({hint.format('memory')})",
    ]
    assert verdict.problems[1] == MEMORY_NOT_ENFORCED[bus]


def test_a_list_the_mapper_sets_is_named_as_the_mapper_s_in_a_refusal():
    # (review 37 R3) "the site sets IODeviceWeight" sent the admin to a
    # configuration that sets none.
    config = parse_config(
        {
            "exec": {"sdexec-constrain-resources": True},
            "sdexec": {"request-properties": ["@default", "IODeviceWeight"]},
        }
    )
    containment = Containment(
        config, FakeMapper({"IODeviceWeight": "/dev/nvme0n1 500"})
    )
    opts = {R_OPTION: r_local("0"), "SDEXEC_PROP_IODeviceWeight": "/dev/sda 100"}
    payload = {"flags": 0, "cmd": {"cmdline": ["/bin/true"], "opts": opts}}
    with pytest.raises(sdexec.plan.RequestError) as refused:
        sdexec.plan.plan_exec(payload, config, containment)
    assert refused.value.errnum == errno.EPERM
    assert refused.value.errstr.startswith(
        "SDEXEC_PROP_IODeviceWeight: containment (the mapper) sets IODeviceWeight;"
    )


def test_properties_refused_together_not_the_request_s_name_where_they_came_from():
    """Review session 47: where no property at fault was the request's (the
    site's and the mapper's are checked as they come, so only a path
    missed there gets here), the refusal said "of [exec.sdexec-properties]
    ..., with the request's", blaming a request and naming the mapper's
    value as the site's."""
    merged = {"NUMAPolicy": "bind"}
    with pytest.raises(RequestError) as raised:
        _check_together(merged, {"NUMAPolicy": "containment"})
    assert raised.value.errnum == errno.EINVAL
    text = str(raised.value)
    assert "request" not in text
    assert "NUMAPolicy bind needs NUMAMask" in text
    assert text.endswith("(NUMAPolicy from the mapper, NUMAMask unset)")
