"""Helpers for the service's integration tests (see the fixtures in conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import SANDBOX
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread

from sdexec.client import RPCError, SdexecClient, connect
from sdexec.config import load_config
from sdexec.ioencode import decode_io
from sdexec.procfs import process_exists
from sdexec.protocol import command_object
from sdexec.receipt import reads_unit_cgroups
from sdexec.rpc import ConnectionFailed
from sdexec.service import SdexecService

FLAGS = 1 | 2 | 8  # stdout, stderr, write-credit

#: A faked service's answers of the shapes the clients check
#: (sdexec.answers): a list of nothing, and stats of a fresh service.
LISTED_NOTHING = {"rank": 0, "procs": []}
STATS_ANSWER = {
    "requests": {},
    "procs": [],
    "job-exec": {"jobs": {}},
    "config": {},
    "mapper": {},
    "users": {"owner": 0, "users": {}, "not-shown": 0},
    "drain": {"drained": False, "reason": None, "causes": []},
    "device-fence": None,
    "systemd": {"connected": True, "version": "255", "calls": {}},
}
#: A terminate's answer: job j1's entry, its sequence begun.
TERMINATING = {
    "id": "j1",
    "pid": 42,
    "unit": "sdexec-j1.service",
    "state": "R",
    "step": "term",
    "kill-attempts": 0,
    "time-limit": None,
    "expiration": None,
    "termination": {},
    "stop-timer": None,
}
#: The command object a faked ``attached`` carries.
ATTACHED_CMD = command_object(["true"], {})

BASE_CONFIG = """
[systemd]
enable = true
{systemd}
[exec]
service = "sdexec"
{exec}
[sdexec]
listen = "unix:{socket}"
stats = "tcp:0:interface=127.0.0.1"
{sdexec}
{extra}"""


@dataclass(frozen=True)
class ConfigText:
    """What a test adds to :data:`BASE_CONFIG`: lines for its ``[systemd]``,
    ``[exec]`` and ``[sdexec]`` tables, and whole tables (``extra``) appended
    at the end."""

    exec: str = ""
    sdexec: str = ""
    systemd: str = ""
    extra: str = ""

    def render(self, socket_path: str) -> str:
        return BASE_CONFIG.format(
            socket=socket_path,
            systemd=self.systemd,
            exec=self.exec,
            sdexec=self.sdexec,
            extra=self.extra,
        )


def sleep(seconds: float) -> Deferred:
    return Deferred.fromFuture(asyncio.ensure_future(asyncio.sleep(seconds)))


@inlineCallbacks
def ended_by_close(client: SdexecClient, *requests: Deferred):
    """Closes ``client``, and checks that each of ``requests`` (Deferreds a
    test left open: a handle's ``done``, a wait) fails for it: ended and
    seen, not dropped for Twisted to log as an unhandled error (which
    conftest's ``logged_failures`` fails a test for)."""
    yield client.close()
    for request in requests:
        with pytest.raises(ConnectionFailed, match="closed by this client"):
            yield request


async def until(condition, what: str, cap_s: float = 60) -> None:
    """Let the reactor run until ``condition()``; fail after ``cap_s`` (a
    safety bound, not a speed: generous, for a loaded 2-core CI machine)."""
    for _ in range(int(cap_s / 0.05)):
        if condition():
            return
        await sleep(0.05)
    raise AssertionError(f"not within {cap_s} s: {what}")


async def until_pipe_full(r: int, short: int = 4096) -> None:
    """Let the reactor run until the pipe whose read end is ``r`` is full
    (``short`` bytes short at most: a page, by default): its writer now
    waits for a reader."""
    capacity = fcntl.fcntl(r, fcntl.F_GETPIPE_SZ)
    await until(lambda: _unread(r) >= capacity - short, "the pipe filled", 60)


def _unread(r: int) -> int:
    return struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0" * 4))[0]


def read_to_end(r: int) -> bytes:
    """What is left to read on ``r`` until EOF (blocking); closes it."""
    with open(r, "rb") as reader:
        return reader.read()


@dataclass
class Result:
    """Everything one exec stream said."""

    responses: list[dict] = field(default_factory=list)
    stdout: bytes = b""
    stderr: bytes = b""
    error: RPCError | None = None

    @property
    def types(self) -> list[str]:
        return [response["type"] for response in self.responses]

    @property
    def status(self) -> int | None:
        finished = [r["status"] for r in self.responses if r["type"] == "finished"]
        return finished[0] if finished else None

    @property
    def pid(self) -> int | None:
        started = [r["pid"] for r in self.responses if r["type"] == "started"]
        return started[0] if started else None

    def collect(self, response: dict) -> None:
        self.responses.append(response)
        if response["type"] == "output":
            stream, data, _eof = decode_io(response["io"])
            if stream == "stdout":
                self.stdout += data
            else:
                self.stderr += data


def command(cmdline, *, env=None, opts=None, cwd=None, label=None) -> dict:
    """The command object the client sends, with a minimal ``PATH`` unless
    ``env`` is given."""
    env = {"PATH": "/usr/bin:/bin"} if env is None else env
    return command_object(cmdline, env, opts, cwd=cwd, label=label)


async def run(
    client: SdexecClient, cmdline, *, stdin: bytes = b"", flags: int = FLAGS, **kw
) -> Result:
    """Run to the end of the stream; stdin is sent at once, then closed."""
    result = Result()
    handle = client.exec(command(cmdline, **kw), flags, result.collect)
    if stdin:
        handle.write(stdin)
    handle.close_stdin()
    try:
        await handle.done
    except RPCError as error:
        result.error = error
    return result


def unit_names(pattern: str = "sdexec-*") -> list[str]:
    """Units of the test manager matching ``pattern``, loaded in any state."""
    listed = subprocess.run(
        ["systemctl", "--user", "list-units", "--all", "--plain", "--no-legend",
         pattern],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def stop_units_since(before: set[str]) -> list[str]:
    """Stop (and forget, if failed) the ``sdexec-*`` units not in
    ``before``; which they were. A failed test's units, left running, would
    fail every later test that counts the manager's units."""
    left = sorted(set(unit_names()) - before)
    if left:
        for verb in ("stop", "reset-failed"):
            subprocess.run(["systemctl", "--user", verb, *left], check=False,
                           capture_output=True, timeout=60)  # fmt: skip
    return left


def unit_property(unit: str, name: str) -> str:
    shown = subprocess.run(
        ["systemctl", "--user", "show", "-p", name, "--value", unit],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return shown.stdout.strip()


def manager_property(name: str) -> str:
    """A property of the test manager itself (``DefaultCPUAccounting``...)."""
    shown = subprocess.run(
        ["systemctl", "--user", "show", "-p", name, "--value"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return shown.stdout.strip()


def unit_properties(unit: str, *names: str) -> dict[str, str]:
    """Several of a unit's properties at once, as ``systemctl show`` gives
    them."""
    shown = subprocess.run(
        ["systemctl", "--user", "show", unit, *(f"--property={n}" for n in names)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(line.split("=", 1) for line in shown.stdout.splitlines() if line)


async def wait_until_reaped(service, unit: str) -> None:
    """Wait (up to 30 s: a loaded machine's manager is slow to stop a unit)
    until ``unit`` is unloaded and the service tracks no process, then check
    both."""
    for _ in range(300):
        if not unit_names(unit) and not service.server.processes:
            break
        await sleep(0.1)
    assert unit_names(unit) == []
    assert service.server.processes == {}


def open_fds() -> set[str]:
    """This process's open fds, but for /dev/null: Twisted's first listening
    port reserves one on it for the life of the process (``tcp._reservedFD``,
    so that it can still accept and close a connection at EMFILE)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != os.devnull:
                fds.add(fd)
        except OSError:
            continue  # the listing's own fd, closed already
    return fds


def describe_fds(fds: set[str]) -> list[str]:
    """``fd -> target`` for a failure message."""
    described = []
    for fd in sorted(fds, key=int):
        try:
            described.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            described.append(f"{fd} (closed since)")
    return described


class RunningService:
    """An in-process service on a private socket and an ephemeral stats port."""

    def __init__(
        self, directory: Path, config: ConfigText = ConfigText(), clock=None
    ) -> None:
        self.directory = directory
        self.socket_path = str(directory / "sdexec.sock")
        self.config_path = directory / "sdexec.toml"
        self.write_config(config)
        self.service = SdexecService(load_config(self.config_path), reactor)
        self.clock = clock
        self.clients: list[SdexecClient] = []

    def write_config(self, config: ConfigText) -> None:
        self.config_path.write_text(config.render(self.socket_path))

    async def start(self) -> RunningService:
        self.service.startService()
        await self.service.ready
        if self.clock is not None:
            self.service.server.clock = self.clock
        return self

    @property
    def server(self):
        return self.service.server

    @property
    def stats_url(self) -> str:
        return f"http://127.0.0.1:{self.service.ports['stats'].getHost().port}/stats"

    async def connect(self) -> SdexecClient:
        client = await connect(reactor, self.socket_path)
        self.clients.append(client)
        return client

    def reload(self, **config_text: str) -> Deferred[bool]:
        """Rewrite the file (``exec=``, ``sdexec=``, ``extra=`` as for
        ``start_service``) and reload it, as SIGHUP does; False if refused."""
        self.write_config(ConfigText(**config_text))
        return self.service.reload()

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        await self.service.stopService()


#: A Python program that touches 128 MiB.
HOG = "b = bytearray(128 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])"


def node_kills_at_memory_max() -> bool:
    """Measured apart from the service: does a 16M MemoryMax end a process
    that touches 128M? (A v2 node with the memory controller: yes; these
    cgroup v1 machines: no.) Told by systemd's result, ``oom-kill`` or
    ``success``: any other end of the probe (a property refused, the
    interpreter not reachable by the manager) says nothing of the node, and
    fails the test that asked."""
    probe = subprocess.run(
        ["systemd-run", "--user", "--wait", "-p", "MemoryMax=16M",
         "-p", "MemorySwapMax=0", sys.executable, "-c", HOG],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    results = re.findall(r"^Finished with result: (\S+)$", probe.stderr, re.M)
    if results not in (["oom-kill"], ["success"]):
        raise AssertionError(f"memory probe inconclusive: {probe.stderr.strip()!r}")
    return results == ["oom-kill"]


def units_get_memory_max() -> bool:
    """Whether the manager's units get a cgroup v2 ``memory.max`` that
    holds them: the node enforces MemoryMax (:func:`node_kills_at_memory_max`)
    on the unified hierarchy. (A v1 system manager enforces it too, as
    ``memory.limit_in_bytes``; these machines' user managers, and a v2
    manager without the memory controller, do not.)"""
    return node_kills_at_memory_max() and reads_unit_cgroups()


def memory_max_in_kernel(control_group: str) -> str | None:
    """The unit's cgroup v2 ``memory.max``; ``None`` where the node has none
    for it (cgroup v1, or no memory controller delegated)."""
    try:
        with open(f"/sys/fs/cgroup{control_group}/memory.max") as limit:
            return limit.read().strip()
    except FileNotFoundError:
        return None


def usable_cpu() -> int:
    """The lowest CPU this process may run on: not always CPU 0, which a
    node's or a container's cpuset (or a binding such as ``taskset``) may
    keep from it, and from the sandbox manager that inherits its own."""
    return min(os.sched_getaffinity(0))


# -- a sandbox manager of a test's own -----------------------------------------


def running(pid: int | None) -> bool:
    """Whether ``pid`` runs (exists and is no zombie), as the service's
    fence check asks it."""
    return pid is not None and process_exists(pid)


def start_manager(runtime_dir: str) -> int:
    subprocess.run(
        [str(SANDBOX), "start", runtime_dir], check=True, capture_output=True
    )
    return int(Path(runtime_dir, "manager.pid").read_text())


def remove_killed_sandbox(manager_pid: int) -> None:
    """SIGKILL what the killed manager left and remove its cgroups (the
    sandbox's ``clean``; it says what will not go, and fails)."""
    subprocess.run([str(SANDBOX), "clean", str(manager_pid)], check=True)


# -- a D-Bus daemon of a test's own ---------------------------------------------

#: A session bus anyone may use, listening at {address}; {extra}: more of its
#: configuration (its activation directory).
SESSION_BUS_CONFIG = """<busconfig>
  <type>session</type>
  <listen>{address}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
  {extra}
</busconfig>
"""


@contextlib.asynccontextmanager
async def private_bus(
    tmp_path: Path, services: Path | None = None
) -> AsyncIterator[str]:
    """A dbus-daemon of the test's own, no manager on it: its address.
    ``services``: the directory it activates services from (none if not
    given). A configuration of its own: ``--session`` reads the one
    installed under /usr/share/dbus-1, which a node with a carried
    dbus-daemon lacks."""
    path = tmp_path / "bus"
    extra = f"<servicedir>{services}</servicedir>" if services is not None else ""
    config = tmp_path / "bus.conf"
    config.write_text(
        SESSION_BUS_CONFIG.format(address=f"unix:path={path}", extra=extra)
    )
    errors = tmp_path / "dbus-daemon.err"
    with errors.open("wb") as stderr:
        daemon = subprocess.Popen(
            ["dbus-daemon", f"--config-file={config}", "--nofork", "--print-address=1"],
            stdout=subprocess.PIPE, stderr=stderr,
        )  # fmt: skip
    try:
        # Its address is printed once it listens (its socket file exists
        # a moment before).
        assert await deferToThread(daemon.stdout.readline), errors.read_text()
        yield f"unix:path={path}"
    finally:
        daemon.kill()
        daemon.wait()


def bytes_held_by(feed: Callable[[bytes], object], reads: int, size: int) -> float:
    """Memory held per byte after ``reads`` reads of ``size`` fresh bytes
    each (as ``recv`` gives them) were handed to ``feed``."""
    import tracemalloc

    chunk = bytearray(b"x" * size)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(reads):
            feed(bytes(chunk))
        return (tracemalloc.get_traced_memory()[0] - before) / (reads * size)
    finally:
        tracemalloc.stop()
