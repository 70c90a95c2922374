"""``sdexec run --bg``, ``wait``, ``attach`` and ``ps``'s MODE column
against the real service and user manager (the command in a subprocess, the
service in the test's process, as in test_cli.py)."""

from __future__ import annotations

import re
import select
import signal
import subprocess
import sys

import pytest
from pytest_twisted import ensureDeferred
from support import until
from test_background_service import FLOOD, FLOODED, ON_SIGNAL, armed
from test_cli import _environment, _sdexec_argv, cli
from twisted.internet.threads import deferToThread

pytestmark = pytest.mark.systemd


def modes(service) -> list[str]:
    return [proc["mode"] for proc in service.server.list()["procs"]]


@ensureDeferred
async def test_run_bg_prints_the_pid_and_label_and_ps_shows_the_mode(sdexec):
    done = await cli(sdexec, "run", "--bg", "--label", "nap", "sleep", "300")
    assert (done.returncode, done.stderr) == (0, b"")
    pid, label = done.stdout.decode().split()
    assert label == "nap"
    (proc,) = sdexec.server.list()["procs"]
    assert (proc["pid"], proc["mode"]) == (int(pid), "background")
    ps = await cli(sdexec, "ps")
    header, row = ps.stdout.decode().splitlines()
    assert header.split()[:3] == ["PID", "STATE", "MODE"]
    assert row.split()[:3] == [pid, "R", "background"]
    killed = await cli(sdexec, "kill", "KILL", "nap")
    assert killed.returncode == 0
    await until(lambda: not sdexec.server.list()["procs"], "reaped")


@ensureDeferred
async def test_wait_prints_the_output_and_exits_with_the_code(sdexec):
    script = "echo out; echo err >&2; printf '\\377\\n'; exit 3"
    started = await cli(sdexec, "run", "--bg", "--waitable", "sh", "-c", script)
    pid = started.stdout.decode().strip()
    waited = await cli(sdexec, "wait", pid)
    assert waited.returncode == 3
    assert waited.stdout == b"out\n\xff\n"
    assert waited.stderr == b"err\n"
    again = await cli(sdexec, "wait", pid)
    assert again.returncode == 1
    assert again.stderr == f"sdexec: pid {pid}: not found (no such process)\n".encode()


@ensureDeferred
async def test_wait_for_a_process_not_waitable_says_how_to_start_one(sdexec):
    # The service's words alone named the protocol's flag: "process is not
    # waitable (not started with flag 16)", which nobody types.
    started = await cli(sdexec, "run", "--bg", "--label", "plain", "sleep", "300")
    pid = started.stdout.decode().split()[0]
    try:
        for target, named in ((pid, f"pid {pid}"), ("plain", "label 'plain'")):
            waited = await cli(sdexec, "wait", target)
            assert (waited.returncode, waited.stderr.decode()) == (
                1,
                f"sdexec: {named}: process is not waitable (not started with"
                " flag 16): only a process started with sdexec run --bg"
                " --waitable can be waited for\n",
            )
    finally:
        await cli(sdexec, "kill", "KILL", pid)
        await until(lambda: not sdexec.server.list()["procs"], "reaped")


@ensureDeferred
async def test_cancel_of_an_ended_waitable_process_says_to_wait_for_it(sdexec):
    # It said "terminate jobid=w not found; terminate label=w not found"
    # of a process ps listed (review session 46 cli-2).
    started = await cli(sdexec, "run", "--bg", "--waitable", "--label", "w", "true")
    pid = started.stdout.decode().split()[0]
    await until(lambda: sdexec.server.list()["procs"][0]["state"] == "Z", "ended")
    cancelled = await cli(sdexec, "cancel", "w")
    assert (cancelled.returncode, cancelled.stderr.decode()) == (
        1,
        f"sdexec: cancel w: pid {pid} has ended, nothing is left to terminate;"
        " sdexec wait w collects its exit status if it was started waitable\n",
    )
    assert (await cli(sdexec, "wait", "w")).returncode == 0


@ensureDeferred
async def test_ps_and_cancel_of_an_ended_waitable_job_name_the_job(sdexec):
    # Reaped, its job was forgotten: ps showed JOBID -, and cancel j1 said
    # "terminate jobid=j1 not found" (review session 46).
    argv = ["run", "--bg", "--waitable", "--jobid", "j1", "--label", "w", "true"]
    pid = (await cli(sdexec, *argv)).stdout.decode().split()[0]
    await until(lambda: sdexec.server.list()["procs"][0]["state"] == "Z", "ended")
    await until(lambda: not sdexec.server.processes, "reaped")
    header, row = (await cli(sdexec, "ps")).stdout.decode().splitlines()
    assert header.split()[5] == "JOBID"
    assert row.split()[:2] + row.split()[4:7] == [pid, "Z", "w", "j1", "-"]
    cancelled = await cli(sdexec, "cancel", "j1")
    assert (cancelled.returncode, cancelled.stderr.decode()) == (
        1,
        f"sdexec: terminate jobid=j1: the job has ended; its process (pid {pid})"
        " is kept for a wait\n",
    )
    assert (await cli(sdexec, "wait", "w")).returncode == 0


@ensureDeferred
async def test_wait_maps_a_signal_and_names_dropped_output(start_service):
    service = await start_service(sdexec='retained-output = "1K"')
    script = "head -c 3072 /dev/zero | tr '\\0' x; echo; kill -TERM $$"
    await cli(service, "run", "--bg", "--waitable", "--label", "t", "sh", "-c", script)
    waited = await cli(service, "wait", "t")
    assert waited.returncode == 128 + signal.SIGTERM
    assert waited.stdout == b"x" * 1023 + b"\n"
    assert waited.stderr == (
        b"sdexec: 2049 bytes of stdout, 0 bytes of stderr dropped before this"
        b" (the service's retained-output)\n"
    )


@ensureDeferred
async def test_run_bg_errors(sdexec):
    missing = await cli(sdexec, "run", "--bg", "no-such-command-anywhere")
    assert missing.returncode == 127
    assert missing.stderr == b"sdexec: no-such-command-anywhere: command not found\n"
    directory = await cli(sdexec, "run", "--bg", "/")  # as the foreground run
    assert (directory.returncode, directory.stderr) == (
        126,
        b"sdexec: /: is a directory\n",
    )
    nowhere = await cli(sdexec, "attach", "no-such-label")
    assert nowhere.returncode == 1
    assert (
        nowhere.stderr
        == b"sdexec: label 'no-such-label': not found (no such process)\n"
    )


def _attach(service, target: str) -> subprocess.Popen:
    return subprocess.Popen(
        _sdexec_argv("attach", target),
        env=_environment(service),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def _ended_by_usr1(sdexec, client: subprocess.Popen, target: str) -> None:
    """``client`` (a wait or an attach of ON_SIGNAL's process ``target``)
    exits 0 with all the output once the process is told to end."""
    try:
        await armed(sdexec)
        await cli(sdexec, "kill", "USR1", target)
        out, err = await deferToThread(client.communicate, timeout=60)
    finally:
        client.kill()
        client.wait()
    assert (client.returncode, out, err) == (0, b"before\nafter\n", b"")
    await until(lambda: not sdexec.server.list()["procs"], "reaped")


@ensureDeferred
async def test_attach_streams_to_the_end_and_exits_with_the_code(sdexec):
    await cli(sdexec, "run", "--bg", "--label", "a", *ON_SIGNAL)
    attached = _attach(sdexec, "a")
    await until(lambda: modes(sdexec) == ["attached"], "attached")
    await _ended_by_usr1(sdexec, attached, "a")


async def _stopped_attach_of_a_flood(
    service, label: str, let_go
) -> tuple[subprocess.Popen, bytes, bytes]:
    """``sdexec attach LABEL`` (of a FLOOD process, armed) stopped by
    SIGSTOP (Ctrl-Z) before the flood; continued once ``let_go()``: it,
    and what it wrote to its stdout and stderr."""
    attached = _attach(service, label)
    try:
        await until(lambda: modes(service) == ["attached"], "attached")
        attached.send_signal(signal.SIGSTOP)
        await cli(service, "kill", "USR1", label)
        await until(let_go, "let go", cap_s=60)
        attached.send_signal(signal.SIGCONT)
        out, err = await deferToThread(attached.communicate, timeout=60)
    finally:
        attached.kill()
        attached.wait()
    return attached, out, err


@ensureDeferred
async def test_a_stopped_attach_lets_its_process_run_on_and_then_writes_it_all(
    start_service,
):
    """Review session 45 (attach catch-up): a stopped `sdexec attach` was
    ended after 10 s (review session 44 had it let its process run on),
    though the retained output held all it had missed: continued, it said
    so and exited 1. Now it writes all of it, and the process's end."""
    service = await start_service(sdexec='retained-output = "8M"')  # > FLOODED
    await cli(service, "run", "--bg", "--label", "f", *FLOOD)
    await armed(service)
    attached, out, err = await _stopped_attach_of_a_flood(
        service,
        "f",
        lambda: modes(service) == [],  # ended, read to its end
    )
    assert (attached.returncode, out, err) == (0, FLOODED, b"")


@ensureDeferred
async def test_a_stopped_attach_that_falls_too_far_behind_says_what_it_lost(
    start_service,
):
    service = await start_service(sdexec='retained-output = "64K"')
    started = await cli(service, "run", "--bg", "--waitable", "--label", "f", *FLOOD)
    pid = started.stdout.decode().split()[0]
    await armed(service)
    attached, out, err = await _stopped_attach_of_a_flood(
        service, "f", lambda: modes(service) == ["background"]
    )
    assert attached.returncode == 1
    assert out and FLOODED.startswith(out)
    said = re.fullmatch(
        f"sdexec: pid {pid}: the client fell behind by more than the retained"
        r" output \(65536 bytes, \[sdexec\] retained-output\): (\d+) bytes of"
        " stdout it had not yet been sent were dropped: this attach is ended, and"
        f" pid {pid} runs on in the background, its output kept: attach again to"
        " read on\n",
        err.decode(),
    )
    assert said, err
    # Ended (a reader as slow as this one would fall behind its flood too).
    await until(lambda: service.server.tracked.ended_count == 1, "ended")
    again = await cli(service, "attach", "f")  # the rest, and its end
    assert again.returncode == 0
    assert again.stdout.endswith(b"done\n") and FLOODED.endswith(again.stdout)
    dropped = len(FLOODED) - len(again.stdout)
    assert (
        again.stderr
        == (
            f"sdexec: {dropped} bytes of stdout, 0 bytes of stderr dropped before"
            " this (the service's retained-output)\n"
        ).encode()
    )


def _first_line(client: subprocess.Popen, timeout: float) -> bytes:
    """The client's first line of output, or b"" if none came in time."""
    ready, _, _ = select.select([client.stdout], [], [], timeout)
    return client.stdout.readline() if ready else b""


@ensureDeferred
async def test_ctrl_c_detaches_attach_and_the_process_runs_on(sdexec):
    started = await cli(sdexec, "run", "--bg", *ON_SIGNAL)
    pid = started.stdout.decode().strip()
    attached = _attach(sdexec, pid)
    try:
        await until(lambda: modes(sdexec) == ["attached"], "attached")
        # The process may not have printed yet when the attach is taken: the
        # ^C comes once the client has passed its first line on.
        first = await deferToThread(_first_line, attached, 60)
        attached.send_signal(signal.SIGINT)
        rest, err = await deferToThread(attached.communicate, timeout=60)
    finally:
        attached.kill()
        attached.wait()
    # Died of, as a local command's ^C: a script's loop of attaches stops.
    assert attached.returncode == -signal.SIGINT
    assert first + rest == b"before\n"
    assert err == f"sdexec: detached from pid {pid}; it runs on\n".encode()
    await until(lambda: modes(sdexec) == ["background"], "back in the background")
    await cli(sdexec, "kill", "KILL", pid)
    await until(lambda: not sdexec.server.list()["procs"], "reaped")


@pytest.mark.parametrize("command", [("run", "--bg", "true"), ("wait", "nothing")])
@ensureDeferred
async def test_background_commands_load_no_twisted(sdexec, command):
    done = await deferToThread(
        subprocess.run,
        [sys.executable, "-X", "importtime", "-m", "sdexec.cli", *command],
        capture_output=True,
        env=_environment(sdexec),
        timeout=120,
    )
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in done.stderr.decode().splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "sdexec" in imported
    assert imported.isdisjoint({"twisted", "OpenSSL", "cryptography", "_ssl"})
    await until(lambda: not sdexec.server.processes, "reaped")


def _ignoring_sighup() -> None:
    """As nohup leaves the command it runs."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _nohup(service, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        _sdexec_argv(*args),
        env=_environment(service),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_ignoring_sighup,
    )


#: Says which signals reached it, once it catches them. (Not a shell loop:
#: a child it forks gets the unit's signals too, its trap still set for a
#: moment, and may say so as well.)
TRAPS = [
    sys.executable,
    "-c",
    "import signal, sys, time\n"
    "def say(name, code=None):\n"
    "    print(name, flush=True)\n"
    "    code is None or sys.exit(code)\n"
    "signal.signal(signal.SIGHUP, lambda *_: say('HUP'))\n"
    "signal.signal(signal.SIGTERM, lambda *_: say('TERM', 0))\n"
    "print('armed', flush=True)\n"
    "time.sleep(300)\n",
]


@ensureDeferred
async def test_nohup_run_does_not_hang_the_process_up(sdexec):
    # The client caught every signal it forwards, ignored or not: the job
    # of `nohup sdexec run JOB` got SIGHUP at logout.
    counters = sdexec.server.counters  # the service's since it started
    kills = counters["sdexec.kill"]
    # Framed, its output comes after its `started`: "armed" read, the
    # client has it too. Passed through, it could be read while the client
    # still started up, the TERM then ending the command (docs/client.md).
    client = _nohup(sdexec, "run", "--no-passthrough", "-n", *TRAPS)
    try:
        assert await deferToThread(client.stdout.readline) == b"armed\n"
        client.send_signal(signal.SIGHUP)
        client.send_signal(signal.SIGTERM)  # forwarded, and ends it
        out, err = await deferToThread(client.communicate, timeout=60)
    finally:
        client.kill()
        client.wait()
    assert (client.returncode, out, err) == (0, b"TERM\n", b"")
    assert counters["sdexec.kill"] == kills + 1  # not the SIGHUP


@pytest.mark.parametrize("command", ["wait", "attach"])
@ensureDeferred
async def test_nohup_wait_and_attach_keep_on_through_a_hangup(sdexec, command):
    # `nohup sdexec wait 7 > log &`, then logging out: wait died of the
    # SIGHUP it was given back, attach detached: the log got nothing.
    await cli(sdexec, "run", "--bg", "--waitable", "--label", "w", *ON_SIGNAL)
    counters, topic = sdexec.server.counters, f"sdexec.{command}"
    asked = counters[topic]  # the service's since it started
    client = _nohup(sdexec, command, "w")
    await until(lambda: counters[topic] > asked, "asked")
    client.send_signal(signal.SIGHUP)
    await _ended_by_usr1(sdexec, client, "w")
