"""``sdexec.reload`` and ``sdexec reload`` against the real service and the
test systemd manager: the reload a SIGHUP runs, answered with its outcome
(what the units' ``ExecReload=`` reports to ``systemctl reload``)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pytest_twisted import ensureDeferred
from support import ConfigText, RunningService, command, until
from test_sockets import NOBODY, sdexec_as_nobody
from twisted.internet import defer
from twisted.internet.threads import deferToThread

from sdexec.admission import RESERVED_CONNECTIONS
from sdexec.client import RPCError

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parent.parent
RELOADS = "sdexec_config_reloads_total"


def _sdexec_reload(socket: str) -> defer.Deferred[subprocess.CompletedProcess]:
    """This checkout's ``sdexec reload``, as the units' ExecReload runs it."""
    return deferToThread(
        subprocess.run,
        [sys.executable, "-m", "sdexec.cli", "--socket", socket, "reload"],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _reloads(service: RunningService, outcome: str) -> float:
    """The reloads counted with ``outcome``; 0 before the first (an
    outcome's sample is there once it has happened)."""
    counted = service.service.metrics.registry.get_sample_value(
        RELOADS, {"outcome": outcome}
    )
    return counted or 0.0


@ensureDeferred
async def test_reload_answers_success_then_a_refusal_naming_the_key(
    start_service,
):
    service = await start_service()
    client = await service.connect()
    # A job running across both reloads: untouched by either.
    running = client.exec(command(["sleep", "300"]), 3, background=True)
    await running.done
    pid = running.pid

    service.write_config(ConfigText(sdexec="max-connections-per-user = 77"))
    done = await _sdexec_reload(service.socket_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        0, f"configuration reloaded from {service.config_path}\n".encode(), b""
    )  # fmt: skip
    assert service.service.config.sdexec.max_connections_per_user == 77
    assert _reloads(service, "ok") == 1

    service.write_config(ConfigText(sdexec='max-frame-size = "big"'))
    done = await _sdexec_reload(service.socket_path)
    assert (done.returncode, done.stdout) == (1, b"")
    assert done.stderr.decode() == (
        f"sdexec: reload refused, old configuration kept: {service.config_path}:"
        " sdexec.max-frame-size: expected a size of at least 1M (bytes, or with"
        ' B, K, M, G, T, P or E), got "big"\n'
    )
    assert service.service.config.sdexec.max_connections_per_user == 77
    assert _reloads(service, "refused") == 1
    # The request's errno, for a client of the protocol.
    with pytest.raises(RPCError) as refused:
        await client.reload()
    assert refused.value.errnum == errno.EINVAL
    assert refused.value.errstr == done.stderr.decode()[len("sdexec: ") : -1]
    service.write_config(ConfigText(sdexec="max-connections-per-user = 78"))
    assert await client.reload() == {"config": str(service.config_path)}
    assert service.service.config.sdexec.max_connections_per_user == 78

    [listed] = (await client.list())["procs"]
    assert (listed["pid"], listed["state"]) == (pid, "R")
    await client.kill(pid=pid, signum=9)


@pytest.mark.parametrize(
    ("config", "key", "said", "in_force"),
    [
        # Taken, its start-only change was said only in the service's log:
        # `sdexec reload` printed "configuration reloaded" alone, and an
        # admin who changed socket-mode for allow-users learnt nothing.
        (
            ConfigText(sdexec='socket-mode = "0660"'),
            "needs-restart",
            'sdexec.socket-mode: read only at start: "0660" takes effect at the'
            ' next restart, "0600" stays in force',
            lambda config: config.sdexec.socket_mode == 0o600,
        ),
        # A kill-signal that ends no process is taken with a warning, as
        # Flux takes it: the service logged it, and `sdexec reload` (what
        # `systemctl reload` runs) said "configuration reloaded" alone.
        (
            ConfigText(exec='kill-signal = "SIGSTOP"'),
            "warnings",
            "exec.kill-signal: SIGSTOP stops a process without ending it: a"
            " cancelled job that does not end by itself is never killed: after"
            " max-kill-count attempts its node is drained",
            lambda config: config.exec.kill_signal == 19,
        ),
    ],
    ids=["needs-restart", "warnings"],
)
@ensureDeferred
async def test_a_reload_tells_its_asker_what_it_warned_of(
    start_service, config, key, said, in_force
):
    service = await start_service()
    service.write_config(config)
    done = await _sdexec_reload(service.socket_path)
    warning = f"{service.config_path}: {said}"
    assert (done.returncode, done.stdout, done.stderr.decode()) == (
        0,
        f"configuration reloaded from {service.config_path}\n".encode(),
        f"sdexec: warning: {warning}\n",
    )
    client = await service.connect()
    assert await client.reload() == {"config": str(service.config_path), key: [warning]}
    assert in_force(service.service.config)


@ensureDeferred
async def test_reloads_asked_together_run_one_after_the_other(start_service):
    # A SIGHUP's reload and requests on two connections: one at a time, each
    # answered with its own outcome once the one before it has ended.
    service = await start_service()
    first, second = await service.connect(), await service.connect()
    ended: list[str] = []
    signalled = service.service.reload().addCallback(
        lambda taken: ended.append(f"sighup {taken}")
    )
    asked = [
        client.rpc("sdexec.reload", {}).addCallback(
            lambda reply, n=n: ended.append(f"request {n} {reply}")
        )
        for n, client in enumerate((first, second))
    ]
    await defer.gatherResults([signalled, *asked])
    path = str(service.config_path)
    assert ended == [
        "sighup True",
        f"request 0 {{'config': '{path}'}}",
        f"request 1 {{'config': '{path}'}}",
    ]
    assert _reloads(service, "ok") == 3


@ensureDeferred
async def test_only_the_owner_may_reload(user_manager, shared_dir):
    # allow-users may run commands as the service's user, not change the
    # site's configuration: EPERM, and the reload never runs.
    allowed = ConfigText(sdexec=f'socket-mode = "0666"\nallow-users = [{NOBODY}]')
    service = RunningService(shared_dir, allowed)
    await service.start()
    try:
        status, said = await sdexec_as_nobody(service.socket_path, "reload")
        refusals = _reloads(service, "refused")
        taken = _reloads(service, "ok")
    finally:
        await service.stop()
    assert (status, said.decode()) == (
        1,
        f"sdexec: sdexec.reload: only the service's owner (uid {os.getuid()})"
        f" may reload its configuration, not uid {NOBODY}\n",
    )
    assert (refusals, taken) == (0, 0)


@ensureDeferred
async def test_a_reload_is_served_while_the_owner_holds_every_connection(
    start_service,
):
    # `sdexec reload` (what the units' ExecReload= runs) and `sdexec stats`
    # were refused "too many connections" while a resource manager held
    # every connection max-connections allows: the owner's reserve serves
    # them, and the reload's answer reaches the admin.
    service = await start_service(sdexec="max-connections = 2")
    held = [await service.connect() for _ in range(2)]
    for client in held:
        await client.list()  # admitted, under the cap
    service.write_config(ConfigText(sdexec='max-connections = 2\nsocket-mode = "0660"'))
    done = await _sdexec_reload(service.socket_path)
    assert (done.returncode, done.stdout.decode(), done.stderr.decode()) == (
        0,
        f"configuration reloaded from {service.config_path}\n",
        f"sdexec: warning: {service.config_path}: sdexec.socket-mode: read only"
        ' at start: "0660" takes effect at the next restart, "0600" stays in'
        " force\n",
    )
    connections = service.service.server.connections
    await until(lambda: connections.total == 2, "the reload's connection closed")

    # Work on the reserve is refused, naming the key, and the connection closed.
    reserve = await service.connect()
    assert "procs" in await reserve.stats()
    with pytest.raises(RPCError) as refused:
        await reserve.exec(command(["true"]), 3).done
    assert refused.value.errnum == errno.EAGAIN
    assert refused.value.errstr.startswith(
        "too many connections: this one is beyond the 2 [sdexec] max-connections"
        " allows, one of the 3 kept beyond it for sdexec.list, sdexec.reload,"
        " sdexec.stats-get and sdexec.undrain: 'sdexec.exec' is refused there"
    )
    await until(lambda: connections.total == 2, "the refused connection closed")
    assert service.service.server.processes == {}

    # The reserve is bounded: once it is full, a reload is refused as before.
    for _ in range(RESERVED_CONNECTIONS):
        await (await service.connect()).list()
    done = await _sdexec_reload(service.socket_path)
    assert (done.returncode, done.stdout) == (1, b"")
    assert done.stderr.decode() == (
        "sdexec: too many connections: 2 open, the most [sdexec] max-connections"
        " allows, and the 3 kept beyond it for sdexec.list, sdexec.reload,"
        " sdexec.stats-get and sdexec.undrain are open too\n"
    )
    assert connections.total == 2 + RESERVED_CONNECTIONS
