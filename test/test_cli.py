"""The ``sdexec`` command against the real service and user manager.

The command runs as a subprocess (it owns its reactor); the service runs in
the test's process, so the subprocess is driven from a thread.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from pytest_twisted import ensureDeferred
from support import read_to_end, sleep, until, until_pipe_full, wait_until_reaped
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

import sdexec as sdexec_module
from sdexec.procfs import process_status

pytestmark = pytest.mark.systemd


def _sdexec_argv(*args: str) -> list[str]:
    """The ``sdexec`` command as its console script runs it (a plain run's
    exec sent early: sdexec.earlyexec)."""
    return [sys.executable, "-m", "sdexec", *args]


def _environment(service) -> dict[str, str]:
    return {**os.environ, "SDEXEC_SOCKET": service.socket_path}


def cli(service, *args: str, stdin: bytes = b"") -> Deferred:
    """Run ``sdexec ARGS`` to completion; a Deferred CompletedProcess."""
    return deferToThread(
        subprocess.run,
        _sdexec_argv(*args),
        input=stdin,
        capture_output=True,
        env=_environment(service),
        timeout=120,
    )


def _in_background(service, *args: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """``sdexec ARGS`` left running; the caller waits for or kills it."""
    return subprocess.Popen(
        _sdexec_argv(*args),
        env=_environment(service),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt)."""
    status = process_status(pid)
    assert status is not None, f"process {pid} is gone"
    return bool(int(status[b"SigCgt"], 16) >> (signum - 1) & 1)


async def _wait_for_a_process(service):
    for _ in range(600):  # 30 s: a CLI's start and a unit's, on a loaded node
        procs = service.server.list()["procs"]
        if procs and procs[0]["pid"] > 0:
            return procs[0]
        await sleep(0.05)
    raise AssertionError("the command never started")


@ensureDeferred
async def test_run_streams_stdin_and_output(sdexec):
    data = b"".join(b"line %d\n" % i for i in range(2000))
    done = await cli(sdexec, "run", "sh", "-c", "cat; echo done >&2", stdin=data)
    assert (done.returncode, done.stdout, done.stderr) == (0, data, b"done\n")


@pytest.mark.parametrize("code", [0, 1, 127, 199, 244, 255])
@ensureDeferred
async def test_exit_codes(sdexec, code):
    done = await cli(sdexec, "run", "-n", "sh", "-c", f"exit {code}")
    assert done.returncode == code


@ensureDeferred
async def test_missing_command_exits_127_with_one_line(sdexec):
    done = await cli(sdexec, "run", "-n", "no-such-command-xyz")
    assert done.returncode == 127
    assert done.stderr.decode().count("\n") == 1
    assert "no-such-command-xyz" in done.stderr.decode()


@pytest.mark.parametrize(
    ("fd", "args", "code"),
    [(1, ["sh", "-c", "exit 5"], 5), (2, ["no-such-command-xyz"], 127)],
    ids=["stdout", "stderr"],
)
@ensureDeferred
async def test_a_closed_standard_stream_changes_no_exit_status(sdexec, fd, args, code):
    # Python starts with sys.stdout (or stderr) None for a closed fd: the
    # final flush, or the one-line error, was a traceback and status 1.
    def closed_and_run() -> int:
        return subprocess.run(
            _sdexec_argv("run", "-n", *args),
            env=_environment(sdexec),
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: os.close(fd),
            timeout=120,
        ).returncode

    assert await deferToThread(closed_and_run) == code


@ensureDeferred
async def test_a_command_that_cannot_be_executed_exits_126_as_in_a_shell(
    sdexec, tmp_path
):
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    done = await cli(sdexec, "run", "-n", str(script))
    assert done.returncode == 126
    assert done.stderr.decode() == f"sdexec: {script}: permission denied\n"


@ensureDeferred
async def test_what_systemd_could_not_execute_is_named(sdexec, tmp_path):
    # Executable, so the service's own check passes; not a format Linux
    # runs, and no #!: systemd's exec fails (203/EXEC).
    program = tmp_path / "not-a-program"
    program.write_bytes(b"\x7fELF" + bytes(60))
    program.chmod(0o755)
    done = await cli(sdexec, "run", "-n", str(program))
    assert done.returncode == 127
    assert f": cannot execute {program} (the manager's log" in done.stderr.decode()


@pytest.mark.parametrize("below", ["", "/../.."])
@ensureDeferred
async def test_a_working_directory_systemd_could_not_enter_is_named(
    sdexec, tmp_path, below
):
    # With "/../..", the missing directory's parent's parent, lexically,
    # that the process ran in: `cd` fails there (review session 47).
    missing = tmp_path / "gone"
    done = await cli(sdexec, "run", "-n", "--dir", f"{missing}{below}", "/bin/true")
    assert done.returncode == 127
    assert done.stderr.decode() == (
        "sdexec: systemd could not run the command: exit status 200/CHDIR"
        f" (result: exit-code): cannot enter {missing} (or the command itself"
        " exited 200 at once: systemd tells the two apart in no way)\n"
    )


@ensureDeferred
async def test_property_error_names_the_property(sdexec):
    done = await cli(
        sdexec, "run", "-n", "--setopt", "SDEXEC_PROP_CPUAccounting=maybe", "true"
    )
    assert done.returncode == 1
    assert done.stderr.decode().startswith("sdexec: SDEXEC_PROP_CPUAccounting")


@ensureDeferred
async def test_an_sdexec_option_misspelt_is_refused_naming_the_one_meant(sdexec):
    # Ignored, it left the site's stop timer signal in force unseen.
    done = await cli(
        sdexec, "run", "-n", "--setopt", "SDEXEC_STOP_TIMER_SIGNALL=10", "true"
    )
    assert (done.returncode, done.stderr.decode()) == (
        1,
        "sdexec: SDEXEC_STOP_TIMER_SIGNALL: not an sdexec option"
        " (did you mean SDEXEC_STOP_TIMER_SIGNAL?)\n",
    )


@ensureDeferred
async def test_flux_test_option_and_other_servers_options_are_ignored(sdexec):
    # Flux's job-exec sends SDEXEC_TEST_EXPECTED_CPUS (a hook of upstream's
    # test suite); an option not sdexec's is another server's business.
    done = await cli(
        sdexec,
        "run", "-n",
        "--setopt", "SDEXEC_TEST_EXPECTED_CPUS=0",
        "--setopt", "OTHER_SERVER_OPTION=1",
        "echo", "ran",
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, b"ran\n", b"")


@ensureDeferred
async def test_dir_and_environment_travel(sdexec, tmp_path):
    done = await cli(
        sdexec, "run", "-n", "--dir", str(tmp_path), "sh", "-c", "pwd; echo $MARK"
    )
    assert done.stdout.decode().splitlines() == [str(tmp_path), ""]


@ensureDeferred
async def test_sigterm_to_the_client_exits_143(sdexec):
    client = _in_background(sdexec, "run", "-n", "sleep", "300", stderr=subprocess.PIPE)
    try:
        await _wait_for_a_process(sdexec)
        # Caught from its early exec on, microseconds after the send: the
        # process known, the client has its handlers but for a slow node.
        await until(lambda: _catches(client.pid, signal.SIGTERM), "TERM caught")
        client.send_signal(signal.SIGTERM)
        returncode = await deferToThread(client.wait, 60)
    finally:
        client.kill()
        client.wait()
        client.stderr.close()
    assert returncode == 143


@ensureDeferred
async def test_a_signal_reaches_the_process_while_the_client_waits_for_a_reader(
    sdexec,
):
    """``--no-passthrough`` output to a pipe nobody reads: the service stops
    reading the client's connection (its answers wait), so the client sends
    the kill on one of its own, and the process dies of it at once."""
    r, w = os.pipe2(os.O_CLOEXEC)
    client = subprocess.Popen(
        _sdexec_argv("run", "--no-passthrough", "-n", "yes"),
        env=_environment(sdexec),
        stdout=w,
        stderr=subprocess.PIPE,
    )
    os.close(w)
    try:
        await _wait_for_a_process(sdexec)
        await until_pipe_full(r)
        client.send_signal(signal.SIGTERM)
        await until(
            lambda: [p["state"] for p in sdexec.server.list()["procs"]] == ["Z"],
            "the process died of the forwarded SIGTERM, its output unread",
        )
        out = await deferToThread(read_to_end, r)
        returncode = await deferToThread(client.wait, 60)
    finally:
        client.kill()
        client.wait()
        stderr = client.stderr.read()
        client.stderr.close()
    assert (returncode, stderr) == (143, b"")
    assert out and set(out.splitlines()) == {b"y"}


#: Says "ready" once it traps SIGWINCH, then "resized" and exits 0 when it
#: gets one (dies of SIGALRM should none ever come: the test then fails).
_TRAPS_WINCH = (
    "import signal, sys\n"
    "signal.signal(signal.SIGWINCH, lambda *_: sys.exit(print('resized')))\n"
    "signal.alarm(120)\n"
    "print('ready', flush=True)\n"
    "while True: signal.pause()\n"
)


@pytest.mark.parametrize("args", [(), ("--no-passthrough",)], ids=["passed", "relayed"])
@ensureDeferred
async def test_a_resize_reaches_the_process_and_leaves_the_client_s_status(
    sdexec, args
):
    # SIGWINCH was not forwarded: a full-screen program never redrew. A
    # burst is sent, and more after the process ended: each served or
    # ignored, none ends the client or changes its exit status.
    client = subprocess.Popen(
        _sdexec_argv("run", "-n", *args, sys.executable, "-c", _TRAPS_WINCH),
        env=_environment(sdexec),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert await deferToThread(client.stdout.readline) == b"ready\n"
        await until(lambda: _catches(client.pid, signal.SIGWINCH), "WINCH caught")
        for _ in range(20):
            client.send_signal(signal.SIGWINCH)
        out = await deferToThread(client.stdout.read)
        for _ in range(20):
            client.send_signal(signal.SIGWINCH)  # a zombie's, or ignored
        returncode = await deferToThread(client.wait, 60)
    finally:
        client.kill()
        client.wait()
        stderr = client.stderr.read()
        client.stdout.close()
        client.stderr.close()
    assert (out, returncode, stderr) == (b"resized\n", 0, b"")


@ensureDeferred
async def test_killed_client_takes_its_unit_with_it(sdexec):
    client = _in_background(sdexec, "run", "-n", "sleep", "300")
    unit = (await _wait_for_a_process(sdexec))["unit"]
    client.kill()
    await deferToThread(client.wait, 60)
    await wait_until_reaped(sdexec, unit)


@ensureDeferred
async def test_ps_kill_and_stats(sdexec):
    client = _in_background(sdexec, "run", "-n", "--label", "napper", "sleep", "300")
    try:
        proc = await _wait_for_a_process(sdexec)
        ps = await cli(sdexec, "ps")
        assert proc["unit"] in ps.stdout.decode()
        assert "napper" in ps.stdout.decode()
        stats = json.loads((await cli(sdexec, "stats")).stdout)
        assert [p["unit"] for p in stats["procs"]] == [proc["unit"]]
        over_http = json.loads(
            (await cli(sdexec, "stats", "--url", sdexec.stats_url)).stdout
        )
        assert [p["unit"] for p in over_http["procs"]] == [proc["unit"]]
        killed = await cli(sdexec, "kill", "TERM", "napper")
        assert killed.returncode == 0
        assert await deferToThread(client.wait, 60) == 143
    finally:
        client.kill()
        client.wait()


@ensureDeferred
async def test_kill_of_an_unknown_pid_is_one_line(sdexec):
    done = await cli(sdexec, "kill", "15", "999999999")
    assert done.returncode == 1
    assert done.stderr == b"sdexec: kill pid=999999999 not found\n"


def test_missing_socket_is_one_line(tmp_path):
    done = subprocess.run(
        _sdexec_argv("--socket", str(tmp_path / "nothing.sock"), "ps"),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.decode().count("\n") == 1
    assert "nothing.sock" in done.stderr.decode()


@ensureDeferred
async def test_stats_from_an_unreachable_url_is_one_line(sdexec):
    done = await cli(sdexec, "stats", "--url", "http://127.0.0.1:1/stats")
    assert done.returncode == 1
    assert done.stderr.decode().startswith("sdexec: cannot read http://127.0.0.1:1/")
    assert done.stderr.decode().count("\n") == 1


#: What the command line must start without (docs/performance.md): Twisted
#: and the TLS stack it pulls in, msgspec (only bulky output needs it),
#: modules argparse or a dataclass would drag in, typing, and the socket
#: module (selectors, its enums: the client uses _socket). Not contextlib,
#: which the command line does without but ``python -m`` (runpy) imports.
SLOW_IMPORTS = {
    "twisted", "OpenSSL", "cryptography", "_ssl", "msgspec", "dataclasses", "shutil",
    "typing", "socket", "selectors", "shlex",
}  # fmt: skip


@pytest.mark.parametrize(
    ("args", "returncode"),
    [(["run", "-n", "true"], 0), (["cancel", "no-such-job"], 1)],
    ids=["run", "cancel"],
)
@ensureDeferred
async def test_run_starts_on_the_standard_library_alone(sdexec, args, returncode):
    # -S: no site-packages, only the package's own directory, so anything
    # else it imported would fail; -X importtime names every module it
    # imports, on stderr.
    package_root = os.path.dirname(os.path.dirname(sdexec_module.__file__))
    done = await deferToThread(
        subprocess.run,
        [sys.executable, "-S", "-X", "importtime", "-m", "sdexec", *args],
        capture_output=True,
        env={**_environment(sdexec), "PYTHONPATH": package_root},
        timeout=120,
    )
    assert done.returncode == returncode, done.stderr.decode()[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in done.stderr.decode().splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "sdexec" in imported
    assert imported.isdisjoint(SLOW_IMPORTS)
    if args[0] == "run":
        # Nor, for run, the Python halves of the modules whose C cores it
        # uses: enum (which each of the others loads) and re alone were
        # 4 ms of its start (docs/performance.md, twenty-ninth pass).
        assert imported.isdisjoint({"enum", "re", "json", "signal"})


#: python3 -X importtime -m sdexec: each module it loads said on stderr.
_IMPORTTIME = ("-X", "importtime", "-m", "sdexec")


@ensureDeferred
async def test_a_run_relaying_stdin_loads_no_answer_table(sdexec):
    # Each add-credit (one a write relayed) is checked; answers.py, which
    # says what is wrong with a malformed one, is loaded only for that.
    done = await deferToThread(
        subprocess.run,
        [sys.executable, *_IMPORTTIME, "run", "--no-passthrough", "cat"],
        input=b"hi\n",
        capture_output=True,
        env=_environment(sdexec),
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (0, b"hi\n"), done.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.decode().splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "sdexec.rpc" in imported
    assert "sdexec.answers" not in imported


@ensureDeferred
async def test_binary_output_and_stdin_round_trip(sdexec, tmp_path):
    data = os.urandom(3 * 1024 * 1024)
    (tmp_path / "data").write_bytes(data)
    done = await cli(sdexec, "run", "-n", "cat", str(tmp_path / "data"))
    assert (done.returncode, done.stdout == data) == (0, True)
    # Stdin well beyond the 4096 bytes of credit, base64 on the way in.
    echoed = await cli(sdexec, "run", "cat", stdin=data)
    assert (echoed.returncode, echoed.stdout == data) == (0, True)


@ensureDeferred
async def test_a_lingering_child_does_not_change_the_exit_code(sdexec):
    # The command exits 3; its child ignores the stop-timer signal, so the
    # service abandons the unit (EDEADLK after `finished`): one line on
    # stderr, and the command's own exit code. Relayed output: a passed
    # stdout would stay open in the child, and the harness reads to EOF.
    done = await cli(
        sdexec, "run", "-n", "--no-passthrough",
        "--setopt", "SDEXEC_STOP_TIMER_SEC=1",
        "sh", "-c", "trap '' TERM USR1; sleep 300 & exit 3",
    )  # fmt: skip
    assert done.returncode == 3
    unit = sdexec.server.list()["procs"][0]["unit"]
    # One line: the service's reason, then what it tried (its times only
    # from below: the real reactor may run late).
    said = re.fullmatch(
        "sdexec: after the command finished: unkillable user processes in"
        f" unit {re.escape(unit)}: still deactivating [0-9.]+s after its stop"
        " signalled every process left in it; tried since: SIGUSR1 once to"
        " them, [0-9.]+s ago; the node is drained\n",
        done.stderr.decode(),
    )
    assert said is not None, done.stderr
    await sdexec.server.systemd.kill_unit(unit, "all", signal.SIGKILL)
    await wait_until_reaped(sdexec, unit)
    sdexec.server.undrain()


@ensureDeferred
async def test_run_reads_no_more_stdin_once_its_process_has_ended(sdexec, tmp_path):
    # The process ended, its unit lingered (a child that ignores the stop's
    # SIGTERM, for the stop timer's minutes), and run read on: what was
    # typed meanwhile went to a process that was gone, lost to its user.
    # As flux exec, which stops reading at its subprocesses' exit, run
    # lets its stdin go at `finished`.
    reader, writer = os.pipe()
    may_end = tmp_path / "may-end"
    script = (
        "trap '' TERM; sleep 300 >/dev/null 2>&1 &"
        f" while [ ! -e {may_end} ]; do sleep 0.05; done; exit 0"
    )
    argv = ["run", "--no-passthrough", "--setopt", "SDEXEC_STOP_TIMER_SEC=300"]
    client = subprocess.Popen(
        _sdexec_argv(*argv, "sh", "-c", script),
        env=_environment(sdexec),
        stdin=reader,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        pipe = f"pipe:[{os.fstat(reader).st_ino}]"
        # Its stdin, and the descriptor it reads it through once it runs.
        await until(lambda: _held(client.pid, pipe) == 2, "run reads stdin", 60)
        may_end.touch()
        await until(lambda: _held(client.pid, pipe) == 1, "stdin let go", 60)
        os.write(writer, b"typed ahead\n")
        unit = sdexec.server.list()["procs"][0]["unit"]
        await sdexec.server.systemd.kill_unit(unit, "all", signal.SIGKILL)
        _, said = await deferToThread(client.communicate, None, 60)
        assert (client.returncode, said) == (0, b"")
        os.set_blocking(reader, False)
        assert os.read(reader, 64) == b"typed ahead\n"  # still its user's
    finally:
        client.kill()
        client.communicate()
        os.close(reader)
        os.close(writer)
    await wait_until_reaped(sdexec, unit)


def _held(pid: int, target: str) -> int:
    """How many descriptors of process ``pid`` are open on ``target`` (as
    /proc/PID/fd's links name it: ``pipe:[INODE]``)."""
    fds = f"/proc/{pid}/fd"
    try:
        return sum(os.readlink(f"{fds}/{fd}") == target for fd in os.listdir(fds))
    except FileNotFoundError:  # gone (or a descriptor closed meanwhile)
        return -1


#: The smallest pipe (one page), which a listing soon fills.
_PAGE = 4096


def _nonblocking_page_pipe() -> tuple[int, int]:
    """A pipe of one page whose write end is non-blocking, as a stdout whose
    file description a program of the pipeline set ``O_NONBLOCK`` on."""
    reader, writer = os.pipe()
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, _PAGE)
    os.set_blocking(writer, False)
    return reader, writer


@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["unbuffered", "buffered"])
@ensureDeferred
async def test_ps_writes_its_whole_listing_to_a_nonblocking_stdout(sdexec, unbuffered):
    # A listing past what the pipe held was cut there: print() wrote what
    # it took, then failed ("write could not complete without blocking"),
    # or, unbuffered (PYTHONUNBUFFERED), dropped the rest and exited 0.
    # A label and a job id of 1024 bytes: a row and the header of 2 KiB.
    label, jobid = "l" * 1024, "j" * 1024
    argv = ["run", "--bg", "--label", label, "--jobid", jobid, "sleep", "300"]
    started = await cli(sdexec, *argv)
    assert started.returncode == 0, started.stderr
    unit = (await _wait_for_a_process(sdexec))["unit"]
    reader, writer = _nonblocking_page_pipe()
    try:
        ps = subprocess.Popen(
            _sdexec_argv("ps"),
            env={**_environment(sdexec), "PYTHONUNBUFFERED": unbuffered},
            stdout=writer,
            stderr=subprocess.PIPE,
        )
        os.close(writer)
        await until_pipe_full(reader, short=0)  # ps now waits for its reader
        listing = await deferToThread(read_to_end, reader)
        _, stderr = await deferToThread(ps.communicate, None, 60)
        assert (ps.returncode, stderr) == (0, b"")
        assert len(listing) > _PAGE
        assert listing.endswith(f"{label}  {jobid}  -     sleep 300\n".encode())
    finally:
        await cli(sdexec, "kill", "KILL", started.stdout.decode().split()[0])
        await wait_until_reaped(sdexec, unit)


@ensureDeferred
async def test_run_as_a_job_ps_and_cancel(sdexec):
    client = _in_background(sdexec, "run", "-n", "--jobid", "c1", "sleep", "300")
    try:
        proc = await _wait_for_a_process(sdexec)
        ps = (await cli(sdexec, "ps")).stdout.decode().splitlines()
        assert ps[0].split() == [
            "PID", "STATE", "MODE", "UNIT", "LABEL", "JOBID", "STEP", "CMDLINE"
        ]  # fmt: skip
        assert ps[1].split() == [
            str(proc["pid"]), "R", "streaming", proc["unit"], "-", "c1", "-",
            "sleep", "300",
        ]  # fmt: skip
        done = await cli(sdexec, "cancel", "c1")
        assert done.stdout == b"job c1: terminating (step term)\n"
        assert await deferToThread(client.wait, 60) == 128 + signal.SIGTERM
    finally:
        client.kill()
        client.wait()


@ensureDeferred
async def test_run_with_a_time_limit(sdexec):
    # The limit counts from the request's arrival, in real time (the
    # command is a process of its own, which cannot say when its trap is
    # set): a start that takes over 1 s lets SIGALRM kill the shell before
    # it traps it. Either way the limit sent SIGALRM, not SIGTERM, and the
    # command exits as the job did.
    script = "trap 'exit 3' ALRM; while :; do sleep 0.1; done"
    done = await cli(sdexec, "run", "-n", "--time-limit", "1s", "sh", "-c", script)
    # The shell's own exit, from its ALRM trap; or killed by SIGALRM.
    assert done.returncode in (3, 128 + signal.SIGALRM)
    # Which alone did not say that the time limit ended it.
    assert done.stderr.endswith(b"sdexec: job terminated: its time limit was reached\n")


@ensureDeferred
async def test_cancel_of_no_such_job_is_one_line(sdexec):
    done = await cli(sdexec, "cancel", "nojob")
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: terminate jobid=nojob not found; terminate label=nojob not found\n",
    )


def _controlling_terminal() -> None:
    """In the child: a session of its own, its stdin its terminal."""
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@ensureDeferred
async def test_a_terminal_left_raw_by_a_process_killed_by_a_signal_is_set_back(
    sdexec,
):
    # Passed our terminal, `vim` killed by a SIGTERM left it raw, and the
    # client's exit 143 made the shell keep those modes (it sets a
    # terminal back only after a job that died of a signal).
    import termios

    terminal, tty = os.openpty()
    try:
        before = termios.tcgetattr(tty)
        done = await deferToThread(
            subprocess.run,
            _sdexec_argv("run", "sh", "-c", "stty raw -echo; kill -TERM $$"),
            stdin=tty,
            stdout=tty,
            stderr=subprocess.PIPE,
            env=_environment(sdexec),
            preexec_fn=_controlling_terminal,
            timeout=120,
        )
        after = termios.tcgetattr(tty)
    finally:
        os.close(tty)
        os.close(terminal)
    assert (done.returncode, done.stderr) == (143, b"")
    assert after == before
