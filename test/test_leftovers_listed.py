"""A leftover unit as every client lists it, against the real manager: before
its unit is read (pid -1, no command line), once read (its main pid and its
ExecStart's argv), and not at all once unloaded before it could be read.
Offline, with the reads held: test_leftovers.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import uuid

import pytest
from pytest_twisted import ensureDeferred
from support import unit_names, until
from twisted.internet.defer import succeed
from twisted.internet.utils import getProcessOutputAndValue

from sdexec.cli import format_procs

pytestmark = pytest.mark.systemd


#: What the leftover runs (a path: systemd-run resolves a bare name).
SLEEPER = ["/bin/sleep", "300"]


def marked_sleeper(mark: str) -> str:
    """A :data:`SLEEPER` unit whose Description ends with ``mark``, as a
    killed run of the service leaves one (the command line, then the
    mark); its name."""
    name = f"sdexec-leftlist-{uuid.uuid4().hex[:12]}.service"
    subprocess.run(
        ["systemd-run", "--user", "--quiet", f"--unit={name}",
         f"--description={' '.join(SLEEPER)}{mark}", *SLEEPER],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return name


def stop(name: str) -> None:
    subprocess.run(["systemctl", "--user", "stop", name],
                   check=False, capture_output=True, timeout=60)  # fmt: skip


async def lean_ps(socket_path: str) -> list[str]:
    """The rows of ``sdexec ps`` (the command line's own client)."""
    out, err, code = await getProcessOutputAndValue(
        sys.executable,
        ["-m", "sdexec.cli", "--socket", socket_path, "ps"],
        env=dict(os.environ),
    )
    assert code == 0, err
    return out.decode().splitlines()[1:]


@ensureDeferred
async def test_a_leftover_lists_no_command_line_until_read_then_its_argv(
    start_service,
):
    # Right after a (socket-activated) start, sdexec ps showed a leftover
    # as -1 O ... '/bin/sleep 300': its Description, quoted as one word.
    service = await start_service(sdexec='leftover-units = "keep"')
    server = service.server
    name = marked_sleeper(server.unit_mark)
    try:
        # The scan's answer adopts it and asks for its properties; nothing
        # is read before this callback, which the same turn runs.
        unread = await server.leftovers.scan().addCallback(lambda _: server.list())
        [entry] = unread["procs"]
        assert (entry["unit"], entry["state"]) == (name, "O")
        assert (entry["pid"], entry["cmd"], entry["cmdline"]) == (-1, "", [])
        row = format_procs([entry]).splitlines()[1].split()
        assert (row[0], row[1], row[-1]) == ("-1", "O", "?")
        await until(lambda: server.list()["procs"][0]["pid"] > 0, "leftover read")
        client = await service.connect()
        [read] = (await client.list())["procs"]
        assert (read["cmd"], read["cmdline"]) == (SLEEPER[0], SLEEPER)
        [row_read] = await lean_ps(service.socket_path)
        assert row_read.split()[:2] == [str(read["pid"]), "O"]
        assert row_read.endswith(f"  {shlex.join(SLEEPER)}")
    finally:
        stop(name)
    await until(lambda: not server.list()["procs"], "stopped and forgotten")


@ensureDeferred
async def test_a_leftover_unloaded_before_it_is_read_is_listed_no_more(
    start_service, monkeypatch
):
    # The race of a scan: listed running, unloaded before its GetAll. The
    # manager's own listing is replayed after the unload, for the read to
    # find it gone, every time.
    service = await start_service(sdexec='leftover-units = "keep"')
    server = service.server
    name = marked_sleeper(server.unit_mark)
    try:
        listing = await server.systemd.list_units_by_patterns([], [name])
    finally:
        stop(name)
    await until(lambda: name not in unit_names(), "unloaded")
    monkeypatch.setattr(
        server.systemd, "list_units_by_patterns", lambda *_: succeed(listing)
    )
    unread = await server.leftovers.scan().addCallback(lambda _: server.list())
    assert [p["unit"] for p in unread["procs"]] == [name]  # adopted, as listed
    monkeypatch.undo()
    await until(lambda: not server.list()["procs"], "gone once read")
    assert server.leftovers.units == {}
