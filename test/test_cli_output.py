"""The command line's output, offline, against a fake service: what `run`
does with a process whose output cannot be written (a reader gone, a full
disk, a stdout closed when it started), the one checked writer of every
command's own output, the signals `run` passes on, and a Ctrl-C while the
command loads. The command runs in a subprocess, as a user runs it."""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from support import ATTACHED_CMD, LISTED_NOTHING, STATS_ANSWER, TERMINATING, read_to_end
from test_cli_scripted import (
    ScriptedService,
    ScriptedServices,
    failure,
    response,
    sdexec,
)

from sdexec.ioencode import encode_io
from sdexec.wire import FrameSplitter, encode_message

REPOSITORY = Path(__file__).resolve().parent.parent


class Printing(ScriptedService):
    """A service whose every exec starts (pid 42), and every attach attaches
    to it, and prints a line on stdout every few milliseconds, as ``yes``
    would, until the client closes its connection. Kills are kept in
    ``kills`` and answered; one other than SIGPIPE ends the process with
    that signal (the fake's process ignores SIGPIPE, as every Python program
    does)."""

    def __init__(self, path: str) -> None:
        self.kills: list[dict] = []
        #: Set once the client has closed the connection of the exec.
        self.closed = threading.Event()
        super().__init__(path, lambda request: [])  # (its own _serve answers)

    def _serve(self, connection: socket.socket) -> None:
        splitter = FrameSplitter()
        streams: list[dict] = []
        line = encode_io("stdout", "0", b"y" * 99 + b"\n")
        with connection:
            try:
                while True:
                    if select.select([connection], [], [], 0.005)[0]:
                        data = connection.recv(65536)
                        if not data:
                            break
                        for request in splitter.feed(data):
                            self._answer(connection, request, streams)
                    for exec_request in streams:
                        output = {"type": "output", "pid": 42, "io": line}
                        send(connection, response(exec_request, output))
            except (BrokenPipeError, ConnectionResetError):
                pass
        if streams:
            self.closed.set()

    def _answer(
        self, connection: socket.socket, request: dict, streams: list[dict]
    ) -> None:
        if request["topic"] in _STARTING:
            streams.append(request)
            send(connection, response(request, _start_of(request["topic"])))
        elif request["topic"] == "sdexec.kill":
            self.kills.append(request["payload"])
            send(connection, response(request, {}))
            signum = request["payload"]["signum"]
            if signum != signal.SIGPIPE and streams:
                ended = streams.pop()
                send(
                    connection, response(ended, {"type": "finished", "status": signum})
                )
                send(connection, failure(ended, errno.ENODATA))


#: The requests whose stream :class:`Printing` prints to: what it answers first.
_STARTING = {"sdexec.exec": "started", "sdexec.attach": "attached"}


def _start_of(topic: str) -> dict:
    """The first response to an exec or attach (``topic``) of pid 42: an
    ``attached`` carries the command object."""
    kind = _STARTING[topic]
    return {
        "type": kind,
        "pid": 42,
        **({"cmd": ATTACHED_CMD} if kind == "attached" else {}),
    }


def send(connection: socket.socket, message: dict) -> None:
    connection.sendall(encode_message(message))


@pytest.fixture
def printing(tmp_path: Path) -> Iterator[tuple[Printing, str]]:
    path = str(tmp_path / "printing.sock")
    service = Printing(path)
    yield service, path
    service.close()


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[str]:
    """A scripted service that answers each command of ours; its path."""
    path = str(tmp_path / "scripted.sock")
    service = ScriptedService(path, _answers)
    yield path
    service.close()


def _answers(request: dict) -> list[dict]:
    """What each command of ours asks, answered as a service would."""
    payloads = {
        "sdexec.list": LISTED_NOTHING,
        "sdexec.stats-get": STATS_ANSWER,
        "sdexec.terminate": TERMINATING,
        "sdexec.undrain": {"reason": None, "cleared": []},
        "sdexec.exec": {"type": "started", "pid": 42},
    }
    return [response(request, payloads[request["topic"]])]


# -- run --no-passthrough: output that cannot be written -------------------------


def test_a_process_that_ignores_sigpipe_is_ended_once_its_reader_has_gone(printing):
    # `run --no-passthrough python3 -c 'while True: print(…)' | head -1`
    # ran for ever: the SIGPIPE sent changed nothing, and the client read
    # and dropped its output at full CPU (review session 34 B, finding 1).
    service, path = printing
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = sdexec(path, "run", "--no-passthrough", "-n", "py", stdout=writer)
    finally:
        os.close(writer)
    assert (done.returncode, done.stderr) == (141, b"")
    assert service.kills == [{"pid": 42, "signum": signal.SIGPIPE, "who": "all"}]
    assert service.closed.wait(10), "the connection, and with it the unit, stayed"


@pytest.fixture
def printed(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start a scripted service whose exec's process wrote the (stream,
    data) pairs given, in turn, and exited 0, all in one read; its path."""
    services = ScriptedServices(tmp_path)

    def start(*outputs: tuple[str, bytes]) -> str:
        def script(request: dict) -> list[dict]:
            wrote = [
                {"type": "output", "pid": 42, "io": encode_io(stream, "0", data)}
                for stream, data in outputs
            ]
            return [
                response(request, payload)
                for payload in [
                    {"type": "started", "pid": 42},
                    *wrote,
                    {"type": "finished", "status": 0},
                ]
            ] + [failure(request, errno.ENODATA)]

        return services.start(script)

    yield start
    services.close()


@pytest.mark.parametrize(
    ("full", "outputs", "kept"),
    [
        ("stdout", [("stdout", b"a\n"), ("stderr", b"warn\n"), ("stdout", b"b\n")],
         b"warn\n"),
        ("stderr", [("stderr", b"warn\n"), ("stdout", b"result\n"), ("stderr", b"x\n")],
         b"result\n"),
    ],
    ids=["stdout", "stderr"],
)  # fmt: skip
def test_output_lost_to_a_full_disk_leaves_the_process_to_its_end(
    printed, full, outputs, kept
):
    # The first failed write closed the connection, and the service killed
    # the process: a job whose stderr log filled a disk was killed, when
    # locally it would only have lost its warnings (review session 34 R,
    # finding 2). Said once, the stream dropped, the rest relayed, exit 1.
    path = printed(*outputs)
    with open("/dev/full", "wb") as sink:
        done = sdexec(path, "run", "--no-passthrough", "-n", "job", **{full: sink})
    assert done.returncode == 1
    if full == "stdout":
        said = b"sdexec: cannot write stdout: No space left on device\n"
        assert done.stderr == said + kept
    else:
        assert done.stdout == kept


def test_a_closed_stdout_discards_the_output_of_a_framed_process(printed):
    # It failed the first write, and the run with it (exit 1): a closed
    # stdout is /dev/null for the process (review session 34 R, finding 3).
    path = printed(("stdout", b"dropped\n"))
    args = ["run", "--no-passthrough", "-n", "job"]
    done = sdexec(path, *args, stdout=None, preexec_fn=lambda: os.close(1))
    assert (done.returncode, done.stderr) == (0, b"")


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_can_be_written_by_the_process(closed):
    # Passed through read-only, a Python process flushed its stdout into
    # EBADF: a traceback and exit 1, where locally it exits 0 (finding 3).
    probe = (
        "import os\n"
        "from sdexec.cliio import open_closed_standard_fds\n"
        "open_closed_standard_fds()\n"
        f"written = os.write({closed}, b'discarded')\n"
        f"os.write({3 - closed}, str(written).encode())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        preexec_fn=lambda: os.close(closed),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout or done.stderr) == b"9"


def _signalled_run(
    path: str, entry: list[str], signums: list[int], **popen
) -> tuple[int, bytes]:
    """Start `run -n py` through ``entry`` (the interpreter's arguments
    that run the command line), send it ``signums`` once its process has
    printed, and wait: its exit status and stderr."""
    env = {key: value for key, value in os.environ.items() if key != "SDEXEC_SOCKET"}
    client = subprocess.Popen(
        [sys.executable, *entry, "--socket", path, "run", "-n", "py"],
        env={**env, "PYTHONPATH": str(REPOSITORY)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )
    try:
        assert client.stdout is not None
        client.stdout.readline()  # started, and its signals caught
        for signum in signums:
            client.send_signal(signum)
        _, stderr = client.communicate(timeout=30)
    finally:
        client.kill()
        client.wait()
    return client.returncode, stderr


def test_a_client_dying_of_ctrl_backslash_dumps_no_core(printing, tmp_path):
    # Its RLIMIT_CORE set to 0 did not stop a core_pattern that pipes
    # (systemd-coredump), and bash said "Quit (core dumped)".
    _service, path = printing
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", path, "run", "-n", "py"],
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        cwd=cwd,
        preexec_fn=_cores_allowed,
    )
    try:
        assert client.stdout is not None
        client.stdout.readline()  # started, and its signals caught
        client.send_signal(signal.SIGQUIT)
        client.stdout.read()
        # Still waitable after: Popen reaps it in its own wait below.
        ended = os.waitid(os.P_PID, client.pid, os.WEXITED | os.WNOWAIT)
    finally:
        client.kill()
        client.wait()
    assert (ended.si_code, ended.si_status) == (os.CLD_KILLED, signal.SIGQUIT)
    assert list(cwd.iterdir()) == []
    # That no core came is the kernel's policy (a core_pattern of a file
    # and RLIMIT_CORE 0 give none either): the fix is that the client is
    # no longer dumpable, which no core_pattern overrides (review session
    # 42 R2).
    assert _dumpable_before_and_after_dump_no_core() == b"1 0\n"


#: Prints PR_GET_DUMPABLE before and after sdexec.cli._dump_no_core.
_DUMPABLE = """
import ctypes
from sdexec.cli import _dump_no_core
pr_get_dumpable = 3  # <linux/prctl.h>
before = ctypes.CDLL(None).prctl(pr_get_dumpable, 0, 0, 0, 0)
_dump_no_core()
print(before, ctypes.CDLL(None).prctl(pr_get_dumpable, 0, 0, 0, 0))
"""


def _dumpable_before_and_after_dump_no_core() -> bytes:
    return subprocess.run(
        [sys.executable, "-c", _DUMPABLE],
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        stdout=subprocess.PIPE,
        timeout=60,
        check=True,
    ).stdout


def _cores_allowed() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def test_ctrl_backslash_is_passed_on_to_the_process(printing):
    # SIGQUIT killed the client (a core dump of it), and the unit was
    # stopped with SIGTERM: the process never saw its Ctrl-\.
    service, path = printing
    done = _signalled_run(path, ["-m", "sdexec.cli"], [signal.SIGQUIT])
    # The process died of it, and so does the client (review session 40
    # L1): it exited 131, and a script's loop went on.
    assert done == (-signal.SIGQUIT, b"")
    assert service.kills == [{"pid": 42, "signum": signal.SIGQUIT, "who": "all"}]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "entry",
    [["-c", "from sdexec.console import main\nmain()"], ["-m", "sdexec.cli"]],
    ids=["console-script", "python-m"],
)
def test_a_ctrl_c_the_caller_ignored_stays_ignored(printing, entry):
    # `sdexec run JOB &` in a script starts with SIGINT ignored: the entry
    # point set it back to its default, `run` then caught it, and the
    # script's ^C was passed on to JOB (review session 34 R, finding 1).
    service, path = printing
    signums = [signal.SIGINT, signal.SIGTERM]
    done = _signalled_run(path, entry, signums, preexec_fn=_ignore_sigint)
    assert done == (128 + signal.SIGTERM, b"")
    assert service.kills == [{"pid": 42, "signum": signal.SIGTERM, "who": "all"}]


# -- the commands' own output ----------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["ps"], ["stats"], ["cancel", "j1"], ["undrain"], ["run", "--bg", "true"]],
    ids=lambda args: " ".join(args),
)
@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["unbuffered", "buffered"])
def test_a_full_stdout_is_said_in_words(scripted, monkeypatch, args, unbuffered):
    # An unbuffered stdout (PYTHONUNBUFFERED, common in containers) made
    # print() itself fail: "unexpected error: OSError: [Errno 28] …", a bug's
    # words, for `run --bg` the line that the pid was lost (finding 3).
    monkeypatch.setenv("PYTHONUNBUFFERED", unbuffered)
    with open("/dev/full", "wb") as full:
        done = sdexec(scripted, *args, stdout=full)
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: No space left on device"
        + _PID_RUNS_ON.get(args[0], b"")
        + b"\n",
    )


#: What ``run --bg`` adds to "cannot write stdout": the process it started
#: runs on, and only stderr can say its pid (review session 46 cli-4).
_PID_RUNS_ON = {
    "run": b": pid 42 started all the same, and runs on in the background"
    b" (sdexec kill TERM 42)"
}


@pytest.mark.parametrize("args", [["ps"], ["run", "--bg", "true"]], ids=" ".join)
def test_a_stdout_closed_at_the_start_cannot_be_written(scripted, args):
    # As a shell's `ls >&-` fails ("write error: Bad file descriptor"): the
    # listing, or the pid of a process that runs on, went to /dev/null and
    # the command exited 0 (finding 6).
    done = sdexec(scripted, *args, stdout=None, preexec_fn=lambda: os.close(1))
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: Bad file descriptor"
        + _PID_RUNS_ON.get(args[0], b"")
        + b"\n",
    )


class _SeenClosed(ScriptedService):
    """A scripted service that says when a client has closed a connection."""

    def __init__(self, path: str, script: Callable[[dict], list[dict]]) -> None:
        self.closed = threading.Event()
        super().__init__(path, script)

    def _serve(self, connection: socket.socket) -> None:
        super()._serve(connection)
        self.closed.set()


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_ends_run_bg_whose_pid_waits_for_a_stalled_stdout(
    tmp_path, signum, status
):
    # `sdexec run --bg job | less`, less stopped: the pid's write blocked
    # in the kernel, the loop closed, and a ^C or SIGTERM was ignored until
    # the pipe drained. Now it ends the command as it ends `run`'s wait for
    # its last lines (128 + N, a ^C died of), the pid said on stderr.
    path = str(tmp_path / "s.sock")
    service = _SeenClosed(path, _answers)
    reader, writer = os.pipe()
    try:
        held = _room_for(writer, reader, 0)
        ended, err = _signalled_once_answered(
            [path, "run", "--bg", "job"], writer, service.closed, signum
        )
    finally:
        os.close(writer)
        said = read_to_end(reader)
        service.close()
    assert (ended, said) == (status, b"x" * held)
    name = signal.Signals(signum).name
    assert (
        f"sdexec: interrupted by {name} while the pid waited for stdout's"
        " reader: pid 42 started all the same, and runs on in the background"
        " (sdexec kill TERM 42)"
    ).encode() in err.splitlines()


def _signalled_once_answered(
    args: list[str], stdout: int, answered: threading.Event, signum: int
) -> tuple[int, bytes]:
    """``sdexec --socket ARGS`` with ``stdout``, sent ``signum`` once it has
    closed its connection (``answered``), and again until it ends (one may
    come before it waits on stdout): its returncode and stderr."""
    env = {key: value for key, value in os.environ.items() if key != "SDEXEC_SOCKET"}
    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", *args],
        env={**env, "PYTHONPATH": str(REPOSITORY)},
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
    )
    try:
        assert answered.wait(30), "the exec not answered"
        deadline = time.monotonic() + 30
        while client.poll() is None:
            assert time.monotonic() < deadline, f"{signum} did not end it"
            client.send_signal(signum)
            time.sleep(0.1)
        return client.returncode, client.stderr.read()
    finally:
        client.kill()
        client.wait()
        client.stderr.close()


def _replaying(
    chunks: list[bytes],
    end: list[dict],
    ended_with: int | None = None,
    why: str = "",
    held: threading.Event | None = None,
) -> Callable[[dict], Iterator[dict]]:
    """An attach to pid 42 answered with ``attached``, one output message
    on stdout per chunk, then the payloads ``end``, then the stream's end
    ``ended_with`` (an errnum, ``why``), if one is given (none of those:
    the process runs on). The messages are sent as they come, those of
    the end once ``held`` is set, if given."""

    def attached(request: dict) -> Iterator[dict]:
        yield response(request, {"type": "attached", "pid": 42, "cmd": ATTACHED_CMD})
        for chunk in chunks:
            io = encode_io("stdout", "0", chunk)
            yield response(request, {"type": "output", "pid": 42, "io": io})
        if held is not None:
            held.wait(30)
        yield from (response(request, payload) for payload in end)
        if ended_with is not None:
            yield failure(request, ended_with, why)

    return attached


def _attach_replaying(
    tmp_path: Path, data: bytes, stdout: object, end: list[dict] | None = None
) -> subprocess.CompletedProcess:
    """``sdexec attach 42`` (its stdout ``stdout``) to a service that
    answers with ``attached``, ``data`` on stdout, then the payloads
    ``end`` (none: the process runs on)."""
    path = str(tmp_path / "attach.sock")
    service = ScriptedService(path, _replaying([data], end or []))
    try:
        return sdexec(path, "attach", "42", stdout=stdout)
    finally:
        service.close()


def test_attach_that_detaches_after_the_end_came_does_not_say_it_runs_on(tmp_path):
    # An ended process's replay, end and all, comes at once: a reader gone
    # (or a ^C) while it was written said "it runs on", and the status,
    # taken by this attach, was lost unsaid (review session 41 K-2).
    reader, writer = os.pipe()
    os.close(reader)
    try:
        finished = {"type": "finished", "pid": 42, "status": 7 << 8}
        done = _attach_replaying(tmp_path, b"unread\n", writer, [finished])
    finally:
        os.close(writer)
    assert (done.returncode, done.stderr) == (
        0,
        b"sdexec: detached from pid 42, which had ended (exit code 7): its end"
        b" went to this attach\n",
    )


def _attach_interrupted(
    tmp_path: Path, script: Callable[[dict], Iterable[dict]], full: threading.Event
) -> tuple[int, bytes]:
    """``sdexec attach 42`` to a service that answers with ``script``, its
    stdout a pipe nobody reads, sent SIGINT once that pipe is full (the
    client waits to write the replay, and reads no more of it) and
    ``full`` is set: its exit status and stderr."""
    path = str(tmp_path / "attach.sock")
    service = ScriptedService(path, script)
    env = {key: value for key, value in os.environ.items() if key != "SDEXEC_SOCKET"}
    reader, writer = os.pipe()
    try:
        client = subprocess.Popen(
            [sys.executable, "-m", "sdexec.cli", "--socket", path, "attach", "42"],
            env={**env, "PYTHONPATH": str(REPOSITORY)},
            stdin=subprocess.DEVNULL,
            stdout=writer,
            stderr=subprocess.PIPE,
        )
        try:
            _wait_until_full(reader)
            full.set()
            client.send_signal(signal.SIGINT)
            _, stderr = client.communicate(timeout=30)
        finally:
            client.kill()
            client.wait()
    finally:
        full.set()  # (a service still holding the end lets it go)
        os.close(writer)
        os.close(reader)
        service.close()
    return client.returncode, stderr


def _wait_until_full(reader: int) -> None:
    """Wait until the pipe read by ``reader`` holds all it can."""
    size = fcntl.fcntl(reader, fcntl.F_GETPIPE_SZ)
    deadline = time.monotonic() + 30
    while _unread(reader) < size:
        assert time.monotonic() < deadline, f"{_unread(reader)} bytes of {size}"
        time.sleep(0.01)


def _unread(reader: int) -> int:
    return struct.unpack("i", fcntl.ioctl(reader, termios.FIONREAD, b"\0" * 4))[0]


#: Replays of an ended process that a read (256 KiB at most) does not take
#: whole: one message larger, and 1 MiB (the default retained-output) in
#: messages of 64 KiB, as the service sends them.
_LARGE_REPLAYS = {
    "200000-bytes": [b"x" * 200_000],
    "1MiB-in-16": [b"x" * 65536] * 16,
}


@pytest.mark.parametrize("chunks", _LARGE_REPLAYS.values(), ids=_LARGE_REPLAYS)
def test_attach_interrupted_in_a_large_replay_says_its_end_came(tmp_path, chunks):
    # The finished response behind the output being written was still
    # unread, so the line said "it runs on" of a process that had ended and
    # whose end this attach had taken (review session 42 R1). The end is
    # sent once the client waits to write: unread, as a replay's end behind
    # a read of 256 KiB is, whatever the timing.
    full = threading.Event()
    finished = {"type": "finished", "pid": 42, "status": 7 << 8}
    script = _replaying(chunks, [finished], errno.ENODATA, held=full)
    assert _attach_interrupted(tmp_path, script, full) == (
        -signal.SIGINT,
        b"sdexec: detached from pid 42, which had ended (exit code 7): its end"
        b" went to this attach\n",
    )


def test_attach_interrupted_in_a_replay_that_ended_without_status_says_so(tmp_path):
    full = threading.Event()
    why = "unit sdexec-42.service ended without an exit status"
    chunks = _LARGE_REPLAYS["200000-bytes"]
    script = _replaying(chunks, [], errno.ECHILD, why, held=full)
    assert _attach_interrupted(tmp_path, script, full) == (
        -signal.SIGINT,
        b"sdexec: detached from pid 42, whose stream had ended: unit"
        b" sdexec-42.service ended without an exit status\n",
    )


def test_attach_interrupted_in_the_replay_of_a_running_process_says_it_runs_on(
    tmp_path,
):
    # Read on for an end that never comes, until nothing more does.
    script = _replaying(_LARGE_REPLAYS["1MiB-in-16"], [])
    assert _attach_interrupted(tmp_path, script, threading.Event()) == (
        -signal.SIGINT,
        b"sdexec: detached from pid 42; it runs on\n",
    )


def test_attach_reads_on_for_the_end_for_a_bounded_time(printing):
    # A process that runs on, printing without a pause: what comes after
    # the detach (its reader gone) is read for the end for so long only.
    _service, path = printing
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = sdexec(path, "attach", "42", stdout=writer)
    finally:
        os.close(writer)
    assert (done.returncode, done.stderr) == (
        0,
        b"sdexec: detached from pid 42; it runs on\n",
    )


def test_a_full_stdout_fails_attach_but_leaves_the_process(tmp_path):
    # The line said, then "detached" and exit 0: output lost, which the
    # exit status must say, as for `run` and `wait`. The process is left
    # running, as for a reader gone: a background one is not attach's.
    with open("/dev/full", "wb") as full:
        done = _attach_replaying(tmp_path, b"lost\n", full)
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: No space left on device\n"
        b"sdexec: detached from pid 42; it runs on\n",
    )


# -- a signal while the last lines wait for stderr ------------------------------

#: What ends the stream of a process that the OOM killer killed, after
#: which the stop timer gave up on what it left: two lines on stderr, said
#: once the loop has closed (the first names the unit: its end is known).
_AFTER = (errno.EDEADLK, "unkillable user processes in unit sdexec-x.service")
_LAST_LINES = [
    b"sdexec: after the command finished: " + _AFTER[1].encode() + b"\n",
    b"sdexec: killed by the OOM killer (no MemoryMax set)\n",
]


def _ended_by_oom(request: dict) -> list[dict]:
    """An exec or attach of pid 42, which the OOM killer killed (137), its
    stream ended by :data:`_AFTER`; kills never answered."""
    if request["topic"] not in _STARTING:
        return []
    finished = {
        "type": "finished",
        "status": int(signal.SIGKILL),
        "result": "oom-kill",
        "oom_kills": 1,
    }
    return [
        response(request, _start_of(request["topic"])),
        response(request, finished),
        failure(request, *_AFTER),
    ]


def _room_for(writer: int, reader: int, room: int) -> int:
    """Fill the empty pipe to its last page, with ``room`` bytes left in
    that page (a write of no more merges into it; a longer one waits for
    its reader); how many bytes it holds."""
    size = fcntl.fcntl(reader, fcntl.F_GETPIPE_SZ)
    assert room < os.sysconf("SC_PAGE_SIZE")
    os.write(writer, b"x" * (size - room))  # every page, the last but room
    return size - room


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)],
    ids=["SIGINT", "SIGTERM"],
)
@pytest.mark.parametrize("command", [["run", "-n", "job"], ["attach", "42"]])
def test_a_signal_ends_the_wait_of_the_last_lines_for_a_stalled_stderr(
    tmp_path, command, signum, status
):
    # `sdexec run job 2>&1 | less`, less stopped: the process's end known
    # and the loop closed, a last line blocked on the full pipe, and a ^C
    # or SIGTERM, which nothing served, was ignored until the pipe drained.
    # Now what stderr can take is said, and the signal ends the command as
    # one that interrupts it (its status 128 + N, a ^C died of).
    path = str(tmp_path / "s.sock")
    service = ScriptedService(path, _ended_by_oom)
    reader, writer = os.pipe()
    try:
        held = _room_for(writer, reader, len(_LAST_LINES[0]) + 1)
        ended = _signalled_once_the_first_line_is_said(
            [path, *command], writer, reader, held, signum
        )
    finally:
        os.close(writer)
        said = read_to_end(reader)
        service.close()
    assert (ended, said) == (status, b"x" * held + _LAST_LINES[0])


def _signalled_once_the_first_line_is_said(
    args: list[str], stderr: int, reader: int, held: int, signum: int
) -> int:
    """``sdexec --socket ARGS`` with ``stderr`` (read by ``reader``, which
    holds ``held`` bytes), sent ``signum`` once :data:`_LAST_LINES`' first
    is said: its returncode."""
    env = {key: value for key, value in os.environ.items() if key != "SDEXEC_SOCKET"}
    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", *args],
        env={**env, "PYTHONPATH": str(REPOSITORY)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    try:
        # Said, the end is known and the loop has closed; the second line
        # cannot be said.
        deadline = time.monotonic() + 30
        while _unread(reader) < held + len(_LAST_LINES[0]):
            assert time.monotonic() < deadline, "the first line not said"
            time.sleep(0.01)
        client.send_signal(signum)
        return client.wait(timeout=30)
    finally:
        client.kill()
        client.wait()


def test_a_line_said_to_a_full_nonblocking_stderr_waits_for_its_reader(tmp_path):
    # A stderr whose file description another program of the pipeline set
    # O_NONBLOCK on: print() failed where the pipe had no room for the
    # line (EAGAIN), and the only line saying why the command failed was
    # dropped in silence. Now it waits for the reader, as stdout does.
    path = str(tmp_path / "nothing.sock")
    reader, writer = os.pipe()
    try:
        held = _room_for(writer, reader, 0)  # full
        os.set_blocking(writer, False)
        client = subprocess.Popen(
            [sys.executable, "-m", "sdexec.cli", "--socket", path, "ps"],
            env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=writer,
        )
    finally:
        os.close(writer)
    _wait_until_ended_or_asleep(client)  # it has written, or waits to
    said = read_to_end(reader)
    assert (client.wait(timeout=30), said[held:].decode()) == (
        1,
        f"sdexec: cannot connect to {path}: No such file or directory"
        " (is the sdexec service running?)\n",
    )


def _wait_until_ended_or_asleep(process: subprocess.Popen) -> None:
    """Wait until ``process`` has exited, or sleeps: one that has nothing
    else to wait for (no service) sleeps only to wait for its reader."""
    deadline = time.monotonic() + 30
    while process.poll() is None and _state(process.pid) != "S":
        assert time.monotonic() < deadline, "neither ended nor asleep"
        time.sleep(0.01)


def _state(pid: int) -> str:
    """The state letter of ``pid`` (``/proc/PID/stat``), ``""`` once gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return ""


# -- a Ctrl-C while the command loads --------------------------------------------

#: Sends the process SIGINT as the command's first module of its own is
#: imported: in the middle of its start-up, on cue.
_INTERRUPTING = """
import os, signal, sys

class Interrupting:
    def find_spec(self, name, path, target=None):
        if name == "sdexec.cliio":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupting())
"""


@pytest.mark.parametrize(
    "start",
    [
        "from sdexec.console import main\nmain()\n",  # the console script
        "import runpy\nrunpy.run_module('sdexec.cli', run_name='__main__')\n",
    ],
    ids=["console-script", "python-m"],
)
def test_a_ctrl_c_while_the_command_loads_ends_it_quietly(tmp_path, start):
    # It was a KeyboardInterrupt traceback through the imports (finding 5).
    script = tmp_path / "sdexec"
    script.write_text(_INTERRUPTING + start)
    done = subprocess.run(
        [sys.executable, str(script), "ps"],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (-signal.SIGINT, b"")


def test_importing_the_command_line_leaves_ctrl_c_to_the_importer():
    # Tests and scripts/gen_docs.py import it: their ^C stays theirs.
    checked = subprocess.run(
        [
            sys.executable,
            "-c",
            "import signal, sdexec.cli\n"
            "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler",
        ],
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0
