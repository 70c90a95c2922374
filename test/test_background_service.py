"""Background processes, wait and attach against the real user manager,
through the Twisted client library (``exec(background=True)``, ``wait``,
``attach``). The fixtures check at teardown that no unit, fd or tracked
process is left."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import sys

import pytest
from pytest_twisted import ensureDeferred
from support import Result, command, ended_by_close, sleep, unit_names, until

from sdexec.client import STDERR, STDOUT, RPCError
from sdexec.ioencode import decode_io

pytestmark = pytest.mark.systemd

KIB = 1024
#: Prints "before", then "after" and exits 0 once it gets SIGUSR1.
#: Says "before", and "after" once it gets SIGUSR1, then exits 0. (Not a
#: shell loop: a child it forks gets the unit's signals too, its trap still
#: set for a moment, and may say "after" as well.)
ON_SIGNAL = [
    sys.executable,
    "-c",
    "import signal, sys, time\n"
    "def after(*_):\n"
    "    print('after', flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGUSR1, after)\n"
    "print('before', flush=True)\n"
    "time.sleep(300)\n",
]


async def armed(sdexec) -> None:
    """Once ON_SIGNAL's "before" is kept, so its handler is set: a SIGUSR1
    sent earlier would end it by the signal."""

    def before_is_retained():
        return any(t.retained.held for t in sdexec.server.tracked._tracked.values())

    await until(before_is_retained, "'before' retained")


async def background(client, cmdline, *, waitable=False, label=None, **kw) -> int:
    """Start ``cmdline`` in the background; its pid."""
    responses: list[dict] = []
    handle = client.exec(
        command(cmdline, label=label, **kw),
        STDOUT | STDERR,
        responses.append,
        background=True,
        waitable=waitable,
    )
    await handle.done
    assert [r["type"] for r in responses] == ["started"]
    assert handle.pid == responses[0]["pid"] > 0
    return handle.pid


def procs_of(service) -> list[dict]:
    return service.server.list()["procs"]


def streams(output: list[dict]) -> dict[str, bytes]:
    data = {"stdout": b"", "stderr": b""}
    for io in output:
        stream, chunk, _eof = decode_io(io)
        data[stream] += chunk
    return data


async def attach(client, **target) -> tuple[Result, object]:
    result = Result()
    handle = client.attach(on_response=result.collect, **target)
    return result, handle


@ensureDeferred
async def test_background_sleep_survives_its_client_and_is_killed(sdexec):
    client = await sdexec.connect()
    pid = await background(client, ["sleep", "300"], label="nap")
    await client.close()
    await until(lambda: sdexec.server.connections.total == 0, "the client gone")
    (proc,) = procs_of(sdexec)
    assert (proc["pid"], proc["mode"], proc["state"]) == (pid, "background", "R")
    assert len(unit_names()) == 1
    other = await sdexec.connect()
    await other.kill(label="nap", signum=15)
    await until(lambda: not procs_of(sdexec), "reaped after the kill")
    assert unit_names() == []


@ensureDeferred
async def test_wait_returns_the_status_and_the_output_byte_exact(sdexec, tmp_path):
    blob = bytes(range(256)) * 64 + "é ü\n".encode()
    (tmp_path / "blob").write_bytes(blob)
    client = await sdexec.connect()
    pid = await background(
        client,
        ["sh", "-c", f"cat {tmp_path}/blob; echo text on stderr >&2; exit 7"],
        waitable=True,
    )
    answer = await client.wait(pid=pid)
    assert answer["status"] == 7 << 8
    assert streams(answer["output"]) == {
        "stdout": blob,
        "stderr": b"text on stderr\n",
    }
    assert answer["dropped"] == {"stdout": 0, "stderr": 0}
    with pytest.raises(RPCError) as again:
        await client.wait(pid=pid)
    assert again.value.errnum == errno.ESRCH


@ensureDeferred
async def test_wait_on_a_process_not_started_waitable_is_einval(sdexec):
    client = await sdexec.connect()
    await background(client, ["sleep", "300"], label="plain")
    with pytest.raises(RPCError) as refused:
        await client.wait(label="plain")
    # Named as the request named it: its user typed the label, not the pid.
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EINVAL,
        "label 'plain': process is not waitable (not started with flag 16)",
    )
    await client.kill(label="plain", signum=9)
    await until(lambda: not procs_of(sdexec), "reaped")


@ensureDeferred
async def test_attach_gets_retained_then_live_output_eofs_and_the_end(sdexec):
    client = await sdexec.connect()
    pid = await background(client, ON_SIGNAL, label="a")
    await armed(sdexec)
    watcher = await sdexec.connect()
    result, handle = await attach(watcher, label="a")
    await until(lambda: result.stdout == b"before\n", "retained output")
    assert result.types[0] == "attached"
    assert result.responses[0]["pid"] == pid
    assert result.responses[0]["cmd"]["cmdline"] == ON_SIGNAL
    second = await sdexec.connect()
    with pytest.raises(RPCError) as busy:
        await second.attach(pid=pid).done
    assert (busy.value.errnum, busy.value.errstr) == (
        errno.EBUSY,
        f"pid {pid}: already has a client attached (an attach on another"
        f" connection, of uid {os.getuid()})",
    )
    await client.kill(pid=pid, signum=10)  # SIGUSR1: "after", then exit 0
    await handle.done
    assert result.stdout == b"before\nafter\n"
    assert result.status == 0
    eofs = [
        r["io"]["stream"]
        for r in result.responses
        if r["type"] == "output" and r["io"].get("eof")
    ]
    assert sorted(eofs) == ["stderr", "stdout"]
    await until(lambda: not procs_of(sdexec), "reaped")


@ensureDeferred
async def test_attach_disconnect_attach_again(sdexec):
    client = await sdexec.connect()
    pid = await background(client, ON_SIGNAL, label="again")
    first = await sdexec.connect()
    result, detached = await attach(first, pid=pid)
    await until(lambda: result.stdout == b"before\n", "output")
    await ended_by_close(first, detached.done)  # it runs on in the background
    await until(lambda: procs_of(sdexec)[0]["mode"] == "background", "detached")
    second = await sdexec.connect()
    result, handle = await attach(second, pid=pid)
    await until(lambda: result.stdout == b"before\n", "retained again")
    await client.kill(pid=pid, signum=10)
    await handle.done
    assert result.stdout == b"before\nafter\n"
    assert result.types.count("finished") == 1
    await until(lambda: not procs_of(sdexec), "reaped")


@ensureDeferred
async def test_an_attach_sent_with_its_background_exec_follows_it(sdexec):
    # Sent at once behind the exec, by label: it waits for the start, where
    # it was refused EBUSY ("not started yet") every time.
    client = await sdexec.connect()
    started = client.exec(
        command(["sh", "-c", "echo hi; exit 3"], label="follow"),
        0,
        background=True,
    )
    result, handle = await attach(client, label="follow")
    await started.done
    await handle.done
    assert result.types[0] == "attached"
    assert result.responses[0]["pid"] == started.pid
    assert result.stdout == b"hi\n"
    assert result.status == 3 << 8
    await until(lambda: not procs_of(sdexec), "reaped")


@ensureDeferred
async def test_attach_to_an_ended_waitable_process(sdexec):
    client = await sdexec.connect()
    pid = await background(client, ["sh", "-c", "exit 4"], waitable=True, label="z")
    await until(lambda: procs_of(sdexec)[0]["state"] == "Z", "ended")
    await until(lambda: not sdexec.server.processes, "its unit reaped")
    result, handle = await attach(client, label="z")
    await handle.done
    assert result.types == ["attached", "output", "output", "finished"]
    assert [r["io"] for r in result.responses[1:3]] == [
        {"stream": "stdout", "rank": "0", "eof": True},
        {"stream": "stderr", "rank": "0", "eof": True},
    ]
    assert result.status == 4 << 8
    with pytest.raises(RPCError) as gone:
        await client.wait(pid=pid)
    assert gone.value.errnum == errno.ESRCH
    assert procs_of(sdexec) == []


@pytest.mark.parametrize(
    ("script", "dropped"),
    [
        # 100 KiB of stdout alone: exactly the oldest 84 KiB are dropped.
        ("head -c 102400 /dev/zero | tr '\\0' x", {"stdout": 84 * KIB, "stderr": 0}),
        # 60 KiB of stdout and 40 KiB of stderr: 84 KiB dropped in all, each
        # stream's share exactly what it produced less what is kept.
        ("head -c 61440 /dev/zero | tr '\\0' o; head -c 40960 /dev/zero | tr '\\0' e"
         " >&2", None),
    ],
)  # fmt: skip
@ensureDeferred
async def test_100k_through_16k_reports_exactly_what_was_dropped(
    start_service, script, dropped
):
    service = await start_service(sdexec='retained-output = "16K"')
    client = await service.connect()
    pid = await background(client, ["sh", "-c", script], waitable=True)
    answer = await client.wait(pid=pid)
    kept = streams(answer["output"])
    assert len(kept["stdout"]) + len(kept["stderr"]) == 16 * KIB
    produced = {"stdout": 100 * KIB, "stderr": 0} if dropped else {
        "stdout": 60 * KIB, "stderr": 40 * KIB}  # fmt: skip
    assert answer["dropped"] == {
        stream: produced[stream] - len(kept[stream]) for stream in produced
    }
    if dropped is not None:
        assert answer["dropped"] == dropped
        assert kept["stdout"] == b"x" * 16 * KIB


@ensureDeferred
async def test_service_shutdown_stops_background_units(start_service):
    service = await start_service()
    client = await service.connect()
    await background(client, ["sleep", "300"])
    await background(client, ["sleep", "300"], waitable=True)
    assert len(unit_names()) == 2
    await service.stop()
    assert service.server.processes == {}
    assert unit_names() == []


@ensureDeferred
async def test_a_streaming_waitable_process_keeps_its_status_when_its_client_leaves(
    sdexec,
):
    # Its client gone, its main process is killed (SIGKILL) and the unit
    # ends failed, then is reset: the status the wait answers is the one
    # systemd reported before the reset.
    client = await sdexec.connect()
    running = Result()
    handle = client.exec(
        command(["sleep", "300"], label="s"), STDOUT, running.collect, waitable=True
    )
    await until(lambda: "started" in running.types, "started")
    await ended_by_close(client, handle.done)
    await until(lambda: not sdexec.server.processes, "its unit reaped")
    other = await sdexec.connect()
    answer = await other.wait(label="s")
    assert answer["status"] == 9


#: Says "before" and, once it gets SIGUSR1, 4 MB of numbered lines (more
#: than a client's socket and the service's buffer for it take), then
#: "done", and exits 0.
FLOOD = [
    sys.executable,
    "-c",
    "import signal, sys, time\n"
    "def flood(*_):\n"
    "    sys.stdout.writelines(f'{n:07d}\\n' for n in range(500_000))\n"
    "    print('done', flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGUSR1, flood)\n"
    "print('before', flush=True)\n"
    "time.sleep(300)\n",
]
FLOODED = b"before\n" + b"".join(b"%07d\n" % n for n in range(500_000)) + b"done\n"


async def received(sock: socket.socket, ended) -> list[dict]:
    """The responses read from ``sock`` (the reactor running meanwhile, to
    write what the service holds for it) until ``ended(response)``."""
    responses: list[dict] = []
    rest = b""
    for _ in range(600):
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            await sleep(0.05)
            continue
        assert chunk, "the service closed the connection"
        *lines, rest = (rest + chunk).split(b"\n")
        responses += [json.loads(line) for line in lines]
        if responses and ended(responses[-1]):
            return responses
    raise AssertionError("the stream never ended")


def raw_attach(service, label: str) -> socket.socket:
    """A connection that attaches to ``label`` (both streams) and reads
    nothing until its test says so (non-blocking then: see received)."""
    attacher = socket.socket(socket.AF_UNIX)
    attacher.connect(service.socket_path)
    attach = {"label": label, "flags": STDOUT | STDERR}
    request = {"type": "request", "topic": "sdexec.attach", "matchtag": 1}
    attacher.sendall(json.dumps({**request, "payload": attach}).encode() + b"\n")
    attacher.setblocking(False)
    return attacher


def sent_stdout(stream: list[dict]) -> bytes:
    payloads = [response.get("payload", {}) for response in stream]
    assert payloads[0]["type"] == "attached"
    return streams([p["io"] for p in payloads if p.get("type") == "output"])["stdout"]


@ensureDeferred
async def test_an_attach_that_reads_nothing_holds_nothing_back_and_misses_nothing(
    start_service,
):
    """Review session 45 (attach catch-up): an attach that read nothing for
    a while (a stopped `sdexec attach`, a pager left on a page) was ended
    after 10 s, though the retained output still held all it had missed.
    Now its process runs on, and its client gets it all once it reads."""
    service = await start_service(sdexec='retained-output = "8M"')  # > FLOODED
    client = await service.connect()
    await background(client, FLOOD, label="flood")
    await armed(service)
    with raw_attach(service, "flood") as attacher:
        await until(lambda: procs_of(service)[0]["mode"] == "attached", "attached")
        await client.kill(label="flood", signum=signal.SIGUSR1)
        # It ran to its end, its output all read, with nothing read of it.
        await until(lambda: not procs_of(service), "reaped", cap_s=60)
        stream = await received(attacher, lambda response: "errnum" in response)
    assert sent_stdout(stream) == FLOODED  # each byte once, in order
    assert [r.get("payload", {}).get("type") for r in stream[-4:-1]].count(
        "finished"
    ) == 1
    assert (stream[-1]["errnum"], stream[-1]["errstr"]) == (errno.ENODATA, "")


@ensureDeferred
async def test_an_attach_that_falls_behind_the_retained_output_is_ended(
    start_service,
):
    # Only where the retained output dropped what it was not sent: it is
    # told how much, after what it was sent; the process runs on.
    service = await start_service(sdexec='retained-output = "64K"')
    client = await service.connect()
    pid = await background(client, FLOOD, waitable=True, label="flood")
    await armed(service)
    with raw_attach(service, "flood") as attacher:
        await until(lambda: procs_of(service)[0]["mode"] == "attached", "attached")
        await client.kill(label="flood", signum=signal.SIGUSR1)
        await until(lambda: procs_of(service)[0]["mode"] == "background", "let go")
        answer = await client.wait(label="flood")  # it ran to its end
        assert answer["status"] == 0
        assert FLOODED.endswith(streams(answer["output"])["stdout"])
        assert streams(answer["output"])["stdout"].endswith(b"done\n")
        stream = await received(attacher, lambda response: "errnum" in response)
    sent = sent_stdout(stream)
    assert 0 < len(sent) < len(FLOODED)
    assert FLOODED.startswith(sent)
    errnum, errstr = stream[-1]["errnum"], stream[-1]["errstr"]
    lost = re.fullmatch(
        f"pid {pid}: the client fell behind by more than the retained output"
        r" \(65536 bytes, \[sdexec\] retained-output\): (\d+) bytes of stdout it"
        " had not yet been sent were dropped: this attach is ended, and"
        f" pid {pid} runs on in the background, its output kept: attach again"
        " to read on",
        errstr,
    )
    assert errnum == errno.ENOBUFS and lost, errstr
    assert 0 < int(lost[1]) < len(FLOODED) - len(sent)


@ensureDeferred
async def test_two_attaches_at_different_speeds_each_get_all_of_their_output(
    start_service,
):
    # One reads as it comes, the other reads nothing until both processes
    # have ended: neither process waits on its client, nor on the other's.
    service = await start_service(sdexec='retained-output = "8M"')
    client = await service.connect()
    for label in ("fast", "slow"):
        await background(client, FLOOD, label=label)
    await armed(service)
    await until(lambda: len(retained_heads(service)) == 2, "both armed")
    fast, handle = await attach(await service.connect(), label="fast")
    with raw_attach(service, "slow") as slow:
        await until(
            lambda: {p["mode"] for p in procs_of(service)} == {"attached"}, "both"
        )
        for label in ("fast", "slow"):
            await client.kill(label=label, signum=signal.SIGUSR1)
        await handle.done
        await until(lambda: not procs_of(service), "both reaped", cap_s=60)
        stream = await received(slow, lambda response: "errnum" in response)
    assert fast.stdout == FLOODED and fast.status == 0
    assert sent_stdout(stream) == FLOODED
    assert (stream[-1]["errnum"], stream[-1]["errstr"]) == (errno.ENODATA, "")


def retained_heads(service) -> list[int]:
    """How much each running process has written, of those that wrote."""
    tracked = service.server.tracked._tracked.values()
    return [t.retained.head for t in tracked if t.retained.head]


@ensureDeferred
async def test_refusals_carry_the_words_flux_tests_grep_for(sdexec):
    # Flux's own tests of its servers grep these (t2421-sdexec-bg.t: "not
    # waitable", "not found"; t0005-exec.t: "already has a client
    # attached", "client attached"), and a site's scripts may too.
    client = await sdexec.connect()
    await background(client, ["sleep", "300"], label="plain")
    await background(client, ["sleep", "300"], label="held", waitable=True)
    watcher = await sdexec.connect()
    result, _handle = await attach(watcher, label="held")
    await until(lambda: result.types[:1] == ["attached"], "attached")
    refusals = {
        "not waitable": client.wait(label="plain"),
        "not found": client.wait(pid=2**31 - 1),
        "already has a client attached": client.attach(label="held").done,
        "client attached": client.wait(label="held"),
    }
    for words, request in refusals.items():
        with pytest.raises(RPCError) as refused:
            await request
        assert words in refused.value.errstr
    for label in ("plain", "held"):
        await client.kill(label=label, signum=9)
    await until(lambda: not procs_of(sdexec), "reaped")
