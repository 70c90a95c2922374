"""Losing systemd and getting it back, against a sandbox manager of each
test's own (Flux's t2408 "bus recovery" tests the same): the manager's dbus-daemon
killed mid-stream, the manager re-executed mid-run. Streams of units that
survive go on; requests meanwhile get EAGAIN; the service neither exits
nor drains (it is back well within ``reconnect-timeout``)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import uuid

import pytest
import pytest_twisted
from pytest_twisted import ensureDeferred
from support import (
    FLAGS,
    ConfigText,
    Result,
    RunningService,
    command,
    memory_max_in_kernel,
    run,
    unit_properties,
    units_get_memory_max,
    until,
)
from twisted.internet.defer import Deferred
from twisted.internet.utils import getProcessOutput, getProcessValue

from sdexec.plan import RequestError

pytestmark = pytest.mark.systemd


class Echoes:
    """``count`` ``cat`` processes on one connection: each echoes what it
    is sent, and ends when its stdin is closed."""

    def __init__(self, client, count: int) -> None:
        self.outputs = [b""] * count
        self.finished: list[int | None] = [None] * count
        self.handles = [
            client.exec(command(["cat"]), FLAGS, lambda r, n=n: self._response(n, r))
            for n in range(count)
        ]

    def _response(self, n: int, response: dict) -> None:
        if response["type"] == "output" and response["io"].get("data"):
            self.outputs[n] += response["io"]["data"].encode()
        elif response["type"] == "finished":
            self.finished[n] = response["status"]

    async def echo(self, text: bytes) -> None:
        for handle in self.handles:
            handle.write(text)
        await until(
            lambda: all(out.endswith(text) for out in self.outputs), f"{text!r} echoed"
        )

    async def end(self) -> None:
        for handle in self.handles:
            handle.close_stdin()
        for handle in self.handles:
            await handle.done  # ENODATA: a successful end
        assert self.finished == [0] * len(self.handles)


class LossWatcher:
    """Wraps the client's ``on_lost``/``on_restored`` to see the outage, and
    asks for an exec the moment systemd is lost (the outage may be shorter
    than any poll)."""

    def __init__(self, service) -> None:
        self.server = service.server
        self.systemd = service.server.systemd
        self.lost: list[str] = []
        self.refused: list[RequestError] = []
        self.restored = 0
        lost, restored = self.systemd.on_lost, self.systemd.on_restored

        def on_lost(reason: str) -> None:
            self.lost.append(reason)
            lost(reason)
            self._exec_now()

        def on_restored() -> None:
            self.restored += 1
            restored()

        self.systemd.on_lost, self.systemd.on_restored = on_lost, on_restored

    def _exec_now(self) -> None:
        payload = {"cmd": command(["true"]), "flags": FLAGS}
        try:
            self.server.exec(0, 1, payload, None)
        except RequestError as error:
            self.refused.append(error)

    async def back(self) -> None:
        await until(lambda: self.lost and self.systemd.connected, "lost and back")
        assert [(e.errnum, e.errstr) for e in self.refused] == [
            (errno.EAGAIN, "reconnecting to systemd")
        ] * len(self.lost)
        assert self.restored >= 1
        assert self.server.drain_reason is None


def dbus_daemon_pid() -> int:
    shown = subprocess.run(
        ["systemctl", "--user", "show", "-p", "MainPID", "--value", "dbus.service"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(shown.stdout)


@pytest_twisted.async_yield_fixture
async def own_service(private_manager, tmp_path):
    """A service on a sandbox manager of the test's own: these tests kill
    its dbus-daemon and re-execute it, which a manager the session reused
    (a developer's own) must never suffer."""
    service = RunningService(tmp_path, ConfigText())
    await service.start()
    yield service
    await service.stop()


@ensureDeferred
async def test_the_bus_killed_mid_stream_streams_go_on(own_service):
    sdexec = own_service
    client = await sdexec.connect()
    echoes = Echoes(client, 3)
    await echoes.echo(b"before\n")
    watcher = LossWatcher(sdexec)
    pid = dbus_daemon_pid()
    assert pid > 0
    os.kill(pid, signal.SIGKILL)
    await watcher.back()
    assert "the D-Bus connection closed" in watcher.lost
    await echoes.echo(b"after\n")  # the fds never went through the bus
    await echoes.end()  # finished and ENODATA come over the new connection
    result = await run(client, ["echo", "new"])
    assert (result.error, result.stdout) == (None, b"new\n")


@ensureDeferred
async def test_a_receipt_lost_with_the_bus_is_read_once_it_is_back(own_service):
    sdexec = own_service
    client = await sdexec.connect()
    watcher = LossWatcher(sdexec)
    systemd = sdexec.server.systemd
    read_receipt, reads = systemd.get_service_properties, []

    def bus_dies_with_the_first_read(name: str) -> Deferred:
        # The bus goes just as the unit has exited: the read is lost with it.
        if not reads:
            os.kill(dbus_daemon_pid(), signal.SIGKILL)
        reads.append(name)
        return read_receipt(name)

    systemd.get_service_properties = bus_dies_with_the_first_read
    result = Result()
    seen_back: list[int] = []

    def collect(response: dict) -> None:
        if response["type"] == "finished":
            seen_back.append(watcher.restored)
        result.collect(response)

    handle = client.exec(command(["true"]), FLAGS, collect)
    handle.close_stdin()
    await handle.done  # ENODATA: a successful end
    finished = next(r for r in result.responses if r["type"] == "finished")
    assert finished["status"] == 0
    assert "receipt_lost" not in finished, finished
    assert len(reads) == 2  # lost, then asked again
    assert seen_back == [1]  # finished waited for systemd's return
    assert finished["result"] == "success"


@ensureDeferred
async def test_the_manager_reexecuted_mid_run_streams_go_on(own_service):
    sdexec = own_service
    client = await sdexec.connect()
    echoes = Echoes(client, 3)
    await echoes.echo(b"before\n")
    watcher = LossWatcher(sdexec)
    subprocess.run(["systemctl", "--user", "daemon-reexec"], check=True, timeout=60)
    await watcher.back()
    assert watcher.lost == ["the systemd manager left the bus"]
    await echoes.echo(b"after\n")
    await echoes.end()
    result = await run(client, ["echo", "new"])
    assert (result.error, result.stdout) == (None, b"new\n")


@ensureDeferred
async def test_a_daemon_reload_mid_run_is_no_loss(own_service):
    """``systemctl daemon-reload`` (an admin's unit file edit) keeps the
    manager on the bus and its transient units: nothing is lost, nothing
    resynchronised, no leftover found. A unit told to end as the reload
    is asked for (its exit lands before, during or after the manager's
    reload, as timing has it) reports its own status, and the streams of
    units running through it go on."""
    sdexec = own_service
    client = await sdexec.connect()
    echoes = Echoes(client, 3)
    await echoes.echo(b"before\n")
    watcher = LossWatcher(sdexec)
    ending = Result()
    read_then_exit = command(["sh", "-c", "read line; exit 7"])
    handle = client.exec(read_then_exit, FLAGS, ending.collect)
    await until(lambda: "started" in ending.types, "the unit started")
    # Not subprocess.run: the service goes on serving while it reloads.
    reloaded = getProcessValue("systemctl", ["--user", "daemon-reload"], env=os.environ)
    handle.close_stdin()
    await until(lambda: reloaded.called, "daemon-reload done")
    assert await reloaded == 0
    await handle.done
    assert ending.status == 7 << 8
    await echoes.echo(b"after\n")
    await echoes.end()
    assert (watcher.lost, watcher.restored) == ([], 0)
    assert sdexec.server.drain_reason is None
    assert (await client.list())["procs"] == []


#: A command systemd runs as it is (plain ``ExecStart``), and one with the
#: ``$`` and ``;`` it would expand or not read back from the unit's file,
#: which runs through the trampoline (sdexec/execstart.py), with the output
#: each must print.
VERBATIM = {
    "plain": (["printf", "%s|", "a b", "100%", "\\", "é"], b"a b|100%|\\|\xc3\xa9|"),
    "dollar-semicolon": (
        ["printf", "%s|", "$HOME", "${X}", "a;b", ";", "$$", "%24"],
        b"$HOME|${X}|a;b|;|$$|%24|",
    ),
}


@pytest.mark.parametrize("kind", VERBATIM)
@ensureDeferred
async def test_a_start_queued_across_a_daemon_reload_runs_verbatim(
    private_manager, tmp_path, kind
):
    """A start still queued at a ``daemon-reload`` (a package's install runs
    one) meets its unit read again from its transient file. With
    ``ExecStartEx`` (systemd 252 cannot read that key back) it ended unrun:
    29 of a burst of 150 (review session 42); with plain ``ExecStart`` and
    ``$`` or ``;`` it would run what the file reads back (``\\$``,
    ``\\;``). Here the start waits behind a oneshot (``After=``) across the
    reload, as it would behind a busy manager; the oneshot ends once the
    reload is done (no clock decides)."""
    cmdline, printed = VERBATIM[kind]
    blocker = f"reload-blocker-{uuid.uuid4().hex[:8]}.service"
    release = tmp_path / "release"
    wait_for_release = f"while [ ! -e {release} ]; do sleep 0.05; done"
    subprocess.run(
        ["systemd-run", "--user", "--quiet", "--no-block", f"--unit={blocker}",
         "-p", "Type=oneshot", "sh", "-c", wait_for_release],
        check=True, timeout=60,
    )  # fmt: skip
    site = f'[exec.sdexec-properties]\nAfter = "{blocker}"\n'
    service = await RunningService(tmp_path, ConfigText(extra=site)).start()
    try:
        client = await service.connect()
        ran = Deferred.fromCoroutine(run(client, cmdline))
        await until(lambda: _queued_jobs() >= 2, "the start queued behind it")
        subprocess.run(["systemctl", "--user", "daemon-reload"], check=True, timeout=60)
        release.touch()
        result = await ran
        assert (result.error, result.status, result.stdout) == (None, 0, printed)
    finally:
        release.touch()
        await service.stop()


@pytest.mark.parametrize("kind", [*VERBATIM, "quoted-path"])
@ensureDeferred
async def test_a_running_unit_keeps_its_settings_across_a_daemon_reload(
    own_service, tmp_path, kind
):
    """A ``daemon-reload`` reads every unit again from its transient file.
    One systemd 252 could not read back (``ExecStartEx=``) was
    ``bad-setting`` after it, and a unit that is not loaded has no cgroup
    controllers of its own: on a cgroup v2 node a running job kept running
    with its ``cpuset``, ``memory`` and ``pids`` gone, its CPU fence and
    memory cap with them (seen 2026-11-28, docs/containment.md): where the
    node holds units to a ``memory.max``, the unit's must be there after
    the reload. A path with a quote read back so too (review session 43
    E2)."""
    in_kernel = units_get_memory_max()
    client = await own_service.connect()
    ending = Result()
    shell = "sh"
    if kind == "quoted-path":
        (tmp_path / "it's").mkdir()
        shell = str(tmp_path / "it's" / "sh")
        os.symlink("/bin/sh", shell)
    args = VERBATIM.get(kind, VERBATIM["plain"])[0]
    cmdline = [shell, "-c", "read line || exit 0", *args]
    handle = client.exec(
        command(cmdline, opts={"SDEXEC_PROP_MemoryMax": "77M"}), FLAGS, ending.collect
    )
    await until(lambda: "started" in ending.types, "the unit started")
    [unit] = [proc["unit"] for proc in (await client.list())["procs"]]
    shown = await _shown_after_a_reload(unit, "LoadState,SubState,MemoryMax")
    assert shown == [
        "LoadState=loaded",
        f"MemoryMax={77 << 20}",
        "SubState=running",
    ]
    cgroup = unit_properties(unit, "ControlGroup")["ControlGroup"]
    assert memory_max_in_kernel(cgroup) == (str(77 << 20) if in_kernel else None)
    handle.close_stdin()
    await handle.done
    assert ending.status == 0


async def _shown_after_a_reload(unit: str, properties: str) -> list[str]:
    """``systemctl show``'s ``NAME=value`` lines of ``properties`` for
    ``unit`` after a ``daemon-reload``, sorted."""
    reloaded = getProcessValue("systemctl", ["--user", "daemon-reload"], env=os.environ)
    await until(lambda: reloaded.called, "daemon-reload done")
    assert await reloaded == 0
    shown = await getProcessOutput(
        "systemctl", ["--user", "show", f"--property={properties}", unit],
        env=os.environ,
    )  # fmt: skip
    return sorted(shown.decode().splitlines())


def _queued_jobs() -> int:
    """The test manager's jobs, queued or running."""
    listed = subprocess.run(
        ["systemctl", "--user", "list-jobs", "--no-legend", "--plain"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return len(listed.stdout.splitlines())


@ensureDeferred
async def test_a_multi_line_script_adds_no_setting_at_a_daemon_reload(own_service):
    """systemd writes the unit's Description into its transient file
    unescaped and reads the file again at ``daemon-reload`` (systemd issue
    #30187). A script's lines that read as settings must stay the
    command's: escaped in the Description, they set nothing, and the unit
    runs on to its own status."""
    client = await own_service.connect()
    ending = Result()
    script = "read line\n[Service]\nCPUWeight=7\nexit 7"
    handle = client.exec(command(["sh", "-c", script]), FLAGS, ending.collect)
    await until(lambda: "started" in ending.types, "the unit started")
    [unit] = [proc["unit"] for proc in (await client.list())["procs"]]
    shown = await _shown_after_a_reload(unit, "Description,CPUWeight")
    assert shown == [
        "CPUWeight=[not set]",
        f"Description=sh -c read line\\n[Service]\\nCPUWeight=7\\nexit 7"
        f"{own_service.server.unit_mark}",
    ]
    handle.close_stdin()
    await handle.done
    assert ending.status == 7 << 8
