"""The command line against a scripted service (a thread on a UNIX socket
that answers as the test says): what the real service rarely does on cue,
such as output that arrives with the process's end, or a kill it never
answers. The command runs in a subprocess, as a user runs it."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import ATTACHED_CMD, LISTED_NOTHING

from sdexec.ioencode import encode_io
from sdexec.refusal import MAX_ERRSTR
from sdexec.wire import FrameSplitter, encode_message

#: What a script does with one request: the messages it sends back (bytes:
#: sent as they are, for what no sdexec service would send; HANG_UP: the
#: service closes the connection there).
Script = Callable[[dict], list[dict] | list[dict | bytes]]
HANG_UP = b""


def response(request: dict, payload: dict) -> dict:
    return {
        "type": "response",
        "topic": request["topic"],
        "matchtag": request["matchtag"],
        "payload": payload,
    }


def failure(request: dict, errnum: int, errstr: str = "") -> dict:
    return {
        "type": "response",
        "topic": request["topic"],
        "matchtag": request["matchtag"],
        "errnum": errnum,
        "errstr": errstr,
    }


class ScriptedService:
    """Answers every request on every connection with ``script(request)``
    (a kill nobody answers: ``[]``)."""

    def __init__(self, path: str, script: Script) -> None:
        self._script = script
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(8)
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # shut down
            serving = threading.Thread(target=self._serve, args=(connection,))
            self._threads.append(serving)
            serving.start()

    def _serve(self, connection: socket.socket) -> None:
        splitter = FrameSplitter()
        with connection, contextlib.suppress(ConnectionResetError, BrokenPipeError):
            # (Reset: a client the test killed, its requests unread; a
            # broken pipe: one that ended before the script's last lines.)
            while data := connection.recv(65536):
                for request in splitter.feed(data):
                    for message in self._script(request):
                        if message == HANG_UP:
                            return
                        raw = isinstance(message, bytes)
                        connection.sendall(message if raw else encode_message(message))

    def close(self) -> None:
        """Stop, and wait for every thread: one left running would open and
        close descriptors under a later test that counts them."""
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        for thread in self._threads:
            thread.join(10)
        self._listener.close()


class ScriptedServices:
    """Scripted services on sockets in ``directory``, closed together."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._services: list[ScriptedService] = []

    def start(self, script: Script) -> str:
        """Start a scripted service; its socket's path."""
        path = str(self._directory / f"s{len(self._services)}.sock")
        self._services.append(ScriptedService(path, script))
        return path

    def close(self) -> None:
        for service in self._services:
            service.close()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Script], str]]:
    """Start a scripted service; its socket's path."""
    services = ScriptedServices(tmp_path)
    yield services.start
    services.close()


def sdexec(path: str, *args: str, **popen) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "SDEXEC_SOCKET"}
    return subprocess.run(
        [sys.executable, "-m", "sdexec.cli", "--socket", path, *args],
        env=env,
        timeout=60,
        **{
            "stdin": subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            **popen,
        },
    )


def ran(text: bytes, status: int = 0, usage: bool = False) -> Script:
    """An exec that printed ``text`` and ended with wait status ``status``,
    all in one read; kills never answered."""

    def script(request: dict) -> list[dict]:
        if request["topic"] != "sdexec.exec":
            return []
        finished = {"type": "finished", "status": status}
        if usage:
            finished["usage"] = {"wall_time_usec": 1_000_000}
        io = encode_io("stdout", "0", text)
        return [
            response(request, {"type": "started", "pid": 42}),
            response(request, {"type": "output", "pid": 42, "io": io}),
            response(request, finished),
            failure(request, errno.ENODATA),
        ]

    return script


def test_output_lost_to_a_full_disk_fails_the_run(serve):
    # Written after the process had finished, its loss changed nothing:
    # `run --no-passthrough echo hello > /dev/full` exited 0.
    path = serve(ran(b"hello\n"))
    with open("/dev/full", "wb") as full:
        done = sdexec(
            path, "run", "--no-passthrough", "-n", "echo", "hello", stdout=full
        )
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: No space left on device\n",
    )


def test_a_reader_gone_after_the_process_ended_is_quiet(serve):
    # The SIGPIPE sent for it was still unanswered when the stream ended:
    # "sdexec: kill SIGPIPE: connection to ... lost".
    path = serve(ran(b"1\n2\n3\n"))
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = sdexec(path, "run", "--no-passthrough", "-n", "seq", "3", stdout=writer)
    finally:
        os.close(writer)
    assert (done.returncode, done.stderr) == (0, b"")


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "oom-line"])
def test_a_stderr_that_cannot_be_written_leaves_the_exit_status(serve, usage):
    # Its receipt lines (or the OOM one) printed unguarded: 1 or 141, not 3.
    script = ran(b"", status=3 << 8, usage=usage)
    if not usage:
        oom = script

        def script(request: dict) -> list[dict]:
            messages = oom(request)
            for message in messages:
                if message.get("payload", {}).get("type") == "finished":
                    message["payload"].update(result="oom-kill", oom_kills=1)
            return messages

    path = serve(script)
    args = ["run", "-n", *(["--usage"] if usage else []), "job"]
    with open("/dev/full", "wb") as full:
        done = sdexec(path, *args, stderr=full)
    assert done.returncode == 3


def test_wait_writes_its_output_though_stderr_is_full(serve):
    # The dropped-bytes notice failed first: the once-only output was lost.
    def script(request: dict) -> list[dict]:
        io = encode_io("stdout", "0", b"precious\n")
        dropped = {"stdout": 10, "stderr": 0}
        return [response(request, {"status": 0, "output": [io], "dropped": dropped})]

    path = serve(script)
    with open("/dev/full", "wb") as full:
        done = sdexec(path, "wait", "7", stderr=full)
    assert (done.returncode, done.stdout) == (0, b"precious\n")


#: What a stream ends with when the stop timer gave up on what its command
#: left (the command exited 0).
LEFT_BEHIND = (errno.EDEADLK, "unkillable user processes in unit sdexec-x.service")
#: What sdexec run says of it, and so wait and attach (review 38 T4-2).
SAID_AFTER = b"sdexec: after the command finished: " + LEFT_BEHIND[1].encode()


def test_wait_says_what_ended_the_stream_after_the_command_and_keeps_its_code(serve):
    def script(request: dict) -> list[dict]:
        # Which it asks for: by default the service answers the error
        # alone, as upstream's does (review session 40 P F3).
        assert request["payload"] == {"pid": 7, "status_and_error": True}
        io = encode_io("stdout", "0", b"out\n")
        error = {"errnum": LEFT_BEHIND[0], "errstr": LEFT_BEHIND[1]}
        answer = {"status": 0, "output": [io], "dropped": {}, "error": error}
        return [response(request, answer)]

    done = sdexec(serve(script), "wait", "7")
    assert (done.returncode, done.stdout) == (0, b"out\n")
    assert done.stderr == SAID_AFTER + b"\n"


def test_wait_writes_the_output_of_a_job_that_ended_unkillable_then_its_error(
    serve,
):
    # No status: the job's end is the error (review 42 T2). Its output was
    # answered alone before, and lost: the end is had once.
    unkillable = "unkillable user processes for job jw"

    def script(request: dict) -> list[dict]:
        io = encode_io("stdout", "0", b"begin\n")
        error = {"errnum": errno.EDEADLK, "errstr": unkillable}
        return [response(request, {"output": [io], "dropped": {}, "error": error})]

    done = sdexec(serve(script), "wait", "7")
    assert (done.returncode, done.stdout) == (1, b"begin\n")
    assert done.stderr == f"sdexec: {unkillable}\n".encode()


def test_run_of_a_job_declared_unkillable_says_so_and_exits_1(serve):
    # docs/client.md, Exit codes: 1, as Flux's tools give it; no status of
    # its own, which a process's exit could be too. The line says the drain.
    unkillable = (
        "unkillable user processes for job jw: a cancel (sdexec.terminate)"
        " began its termination 1.2s ago; tried since: SIGKILL twice to its job"
        " shell (its main process); the node is drained"
    )

    def script(request: dict) -> list[dict]:
        if request["topic"] != "sdexec.exec":
            return []
        return [
            response(request, {"type": "started", "pid": 42}),
            failure(request, errno.EDEADLK, unkillable),
        ]

    done = sdexec(serve(script), "run", "-n", "--jobid", "jw", "job")
    assert (done.returncode, done.stderr) == (1, f"sdexec: {unkillable}\n".encode())


def test_attach_says_what_ended_the_stream_after_the_command_and_keeps_its_code(
    serve,
):
    # It exited 1, where the process exited 0 and run exits 0.
    def script(request: dict) -> list[dict]:
        attached = {"type": "attached", "pid": 7, "cmd": ATTACHED_CMD, "dropped": {}}
        return [
            response(request, attached),
            response(request, {"type": "finished", "status": 0}),
            failure(request, *LEFT_BEHIND),
        ]

    done = sdexec(serve(script), "attach", "7")
    assert done.returncode == 0
    assert done.stderr == SAID_AFTER + b"\n"


#: A receipt that says the OOM killer ended the command, and its line.
OOM_KILLED = {"status": signal.SIGKILL, "result": "oom-kill", "memory_max": 16 << 20}
SAID_OOM = b"sdexec: killed by the OOM killer (MemoryMax=16.0M)\n"


def test_wait_says_an_oom_kill_as_run_does(serve):
    # Not a bare 137: a background job's wait is where it is looked for.
    answer = {**OOM_KILLED, "output": [], "dropped": {}}
    done = sdexec(serve(lambda request: [response(request, answer)]), "wait", "7")
    assert (done.returncode, done.stderr) == (128 + signal.SIGKILL, SAID_OOM)


def test_attach_says_an_oom_kill_as_run_does(serve):
    def script(request: dict) -> list[dict]:
        attached = {"type": "attached", "pid": 7, "cmd": ATTACHED_CMD, "dropped": {}}
        return [
            response(request, attached),
            response(request, {"type": "finished", **OOM_KILLED}),
            failure(request, errno.ENODATA),
        ]

    done = sdexec(serve(script), "attach", "7")
    assert (done.returncode, done.stderr) == (128 + signal.SIGKILL, SAID_OOM)


def test_an_absolute_dir_needs_no_current_directory(serve, tmp_path):
    # Asked for first, a deleted one failed `run --bg --dir /tmp true`.
    def script(request: dict) -> list[dict]:
        assert request["payload"]["cmd"]["cwd"] == "/tmp"
        return [response(request, {"type": "started", "pid": 42})]

    path = serve(script)
    gone = tmp_path / "gone"
    gone.mkdir()
    argv = [sys.executable, "-m", "sdexec.cli", "--socket", path]
    shell = f'cd "{gone}" && rmdir "{gone}" && exec "$@"'
    done = subprocess.run(
        ["sh", "-c", shell, "sh", *argv, "run", "--bg", "--dir", "/tmp", "true"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, b"42\n", b"")


def answering(payload: dict) -> Script:
    return lambda request: [response(request, payload)]


@pytest.mark.parametrize(
    ("args", "payload", "said"),
    [
        (["wait", "7"], {"output": []}, b"wait: expected a wait status, got null"),
        (["wait", "7"], {"status": "0"}, b'wait: expected a wait status, got "0"'),
        (
            ["wait", "7"],
            {"status": 2**70},
            b"wait: expected a wait status, got 1180591",
        ),
        (
            ["ps"],
            {"rank": 0, "procs": "x"},
            b'the service\'s list answer: procs: expected a list, got "x"',
        ),
        (
            ["ps"],
            {"rank": 0, "procs": [1]},
            b"the service's list answer: procs[0]: expected an object, got 1",
        ),
        # A pid of "7" was listed as 7; a cancel compared it with 7.
        (
            ["ps"],
            {"rank": 0, "procs": [{"pid": "7", "cmd": "", "label": "", "state": "R"}]},
            b'the service\'s list answer: procs[0].pid: expected an integer, got "7"',
        ),
        (
            ["cancel", "j1"],
            {"procs": []},
            b"the service's list answer: rank: expected an integer, got none",
        ),
        # "configuration reloaded from None", then a warning per character.
        (
            ["reload"],
            {"warnings": "w"},
            b"the service's reload answer: config: expected a string, got none",
        ),
        (
            ["reload"],
            {"config": "/c.toml", "warnings": "w"},
            b'the service\'s reload answer: warnings: expected a list, got "w"',
        ),
        (
            ["stats"],
            {"procs": []},
            b"the service's stats-get answer: requests: expected an object, got none",
        ),
        # "undrained; the drain reason was: 5".
        (
            ["undrain"],
            {"reason": 5},
            b"the service's undrain answer: reason: expected a string or null, got 5",
        ),
        # TypeError; a string's every character was a "bad output" line.
        (
            ["wait", "7"],
            {"status": 0, "output": 5},
            b"wait: expected a list of output, got 5",
        ),
        (
            ["wait", "7"],
            {"status": 0, "output": "abc"},
            b'wait: expected a list of output, got "abc"',
        ),
        # "x bytes of stdout dropped before this", and a list ignored.
        (
            ["wait", "7"],
            {"status": 0, "dropped": {"stdout": "x"}},
            b'wait: dropped.stdout: expected a byte count, got "x"',
        ),
        (
            ["wait", "7"],
            {"status": 0, "dropped": [5]},
            b"wait: dropped: expected an object, got [5]",
        ),
    ],
)
def test_a_malformed_answer_is_one_line_naming_what_came(serve, args, payload, said):
    # Was "unexpected error: KeyError: 'status'" (TypeError, OverflowError),
    # after the once-only wait was spent.
    done = sdexec(serve(answering(payload)), *args)
    assert done.returncode == 1
    assert done.stderr.startswith(b"sdexec: " + said)
    assert done.stderr.count(b"\n") == 1


def test_a_cancel_answered_with_no_job_entry_says_so(serve):
    # Was "job None: terminating (step None)", exit 0.
    answers = {"sdexec.list": LISTED_NOTHING, "sdexec.terminate": {"ok": True}}
    done = sdexec(
        serve(lambda request: [response(request, answers[request["topic"]])]),
        "cancel",
        "j1",
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        b"",
        b"sdexec: the service's terminate answer: id: expected a string, got none\n",
    )


def test_an_undrain_says_what_still_holds_and_exits_3(serve):
    # An admin's undrain clears only what an admin must; a cause that lifts
    # itself (systemd away, a manager too old, leftovers) stands till then,
    # and `sdexec undrain && …` in a script must not go on (was exit 0).
    reply = {
        "reason": "unkillable user processes for job f1",
        "still": "1 leftover unit",
    }
    done = sdexec(serve(answering(reply)), "undrain")
    assert (done.returncode, done.stdout) == (
        3,
        b"undrained; the drain reason was: unkillable user processes for job f1\n"
        b"still drained, no undrain clears it: 1 leftover unit\n",
    )


def test_an_undrain_prints_each_cause_though_a_reason_holds_the_separator(serve):
    # Joined with "; ", these two read as three; the lists keep them apart.
    reply = {
        "reason": "fence: a; b; unkillable user processes for job f1",
        "cleared": ["fence: a; b", "unkillable user processes for job f1"],
        "still": "1 leftover unit; systemd unreachable for 60 s",
        "remaining": ["1 leftover unit", "systemd unreachable for 60 s"],
    }
    done = sdexec(serve(answering(reply)), "undrain")
    assert (done.returncode, done.stdout) == (
        3,
        b"undrained; the drain reasons were:\n"
        b"  fence: a; b\n"
        b"  unkillable user processes for job f1\n"
        b"still drained, no undrain clears it: 1 leftover unit\n"
        b"still drained, no undrain clears it: systemd unreachable for 60 s\n",
    )


def _unknown_topic(request: dict) -> list[dict]:
    return [failure(request, errno.ENOSYS, f"unknown topic {request['topic']!r}")]


def test_a_reload_a_service_lacks_says_to_send_sighup(serve):
    # A service without sdexec.reload (an older sdexec): ENOSYS, and what
    # reloads it still, where ExecReload would otherwise only fail.
    done = sdexec(serve(_unknown_topic), "reload")
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        b"",
        b"sdexec: unknown topic 'sdexec.reload': this service has no reload request"
        b" (an sdexec older than this command, or not sdexec): send it SIGHUP\n",
    )


def test_a_refused_reload_prints_the_services_reason_and_exits_1(serve):
    said = "reload refused, old configuration kept: /c.toml: sdexec.x: unknown key"
    refused = lambda request: [failure(request, errno.EINVAL, said)]  # noqa: E731
    done = sdexec(serve(refused), "reload")
    assert (done.returncode, done.stdout, done.stderr) == (
        1, b"", f"sdexec: {said}\n".encode()
    )  # fmt: skip


def test_an_undrain_of_a_node_not_drained_exits_0(serve):
    done = sdexec(serve(answering({"reason": None, "cleared": []})), "undrain")
    assert (done.returncode, done.stdout) == (0, b"not drained\n")


def ended_by(signum: int) -> int:
    """The returncode of a command line that signal ``signum``, sent to it,
    ended: it dies of a ^C (or Ctrl-\\), and exits 128 + N for the rest."""
    keyboard = signum in (signal.SIGINT, signal.SIGQUIT)
    return -signum if keyboard else 128 + signum


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
)
def test_a_signal_before_the_start_ends_the_command(serve, signum):
    # Held until `started`, which may take minutes (start-timeout, a
    # manager away): ^C did nothing however often pressed, and a resource
    # manager's SIGTERM nothing until its SIGKILL (review session 32 N F1).
    asked = threading.Event()

    def never_started(request: dict) -> list[dict]:
        asked.set()
        return []

    path = serve(never_started)
    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", path, "run", "-n", "true"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert asked.wait(30), "the exec was never sent"
    client.send_signal(signum)
    _, stderr = client.communicate(timeout=30)
    assert client.returncode == ended_by(signum)
    name = signal.Signals(signum).name
    assert (
        stderr == f"sdexec: interrupted by {name} before the process started\n".encode()
    )


#: The console's entry point, which sends the run's exec early and then
#: signals itself with $SIGNAL before the command line has loaded.
_SIGNALLED_AFTER_THE_EARLY_EXEC = """
import os
import sdexec.earlyexec as early
sent = early.send
def send(argv):
    exec_ = sent(argv)
    assert exec_ is not None, "not sent early"
    os.kill(os.getpid(), int(os.environ["SIGNAL"]))
    return exec_
early.send = send
from sdexec.console import main
main()
"""


def _signalled_after_the_early_exec(path: str, signum: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SIGNALLED_AFTER_THE_EARLY_EXEC, "--socket", path,
         "run", "true"],
        env={**os.environ, "SIGNAL": str(signum)},
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_a_signal_while_the_command_line_loads_after_its_exec_is_forwarded(serve):
    # The process may start before the command line has loaded: SIGUSR1's
    # default action ended the client, and the service stopped a process
    # that had started well.
    kills: list[dict] = []

    def script(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.exec":
            return [response(request, {"type": "started", "pid": 42})]
        kills.append(request["payload"])
        return [response(request, {})]

    client = _signalled_after_the_early_exec(serve(script), signal.SIGUSR1)
    try:
        for _ in range(600):
            if kills or client.poll() is not None:
                break
            time.sleep(0.05)
        assert client.poll() is None, client.stderr.read()
        assert kills == [{"pid": 42, "signum": signal.SIGUSR1, "who": "all"}]
    finally:
        client.kill()
        client.wait()


def test_a_term_while_the_command_line_loads_before_the_start_is_an_interruption(
    serve,
):
    # One line and 143, as after the command line has loaded; it died of
    # the signal, silently.
    client = _signalled_after_the_early_exec(serve(lambda _: []), signal.SIGTERM)
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 128 + signal.SIGTERM
    assert stderr == b"sdexec: interrupted by SIGTERM before the process started\n"


def waiting_in_connect(pid: int) -> None:
    """Wait until ``pid`` waits in connect(2) for room in a full backlog."""
    for _ in range(600):
        if Path(f"/proc/{pid}/wchan").read_text() == "unix_wait_for_peer":
            return
        time.sleep(0.05)
    raise AssertionError("the command never waited in connect(2)")


#: What run says of a ^C while it connects, run --bg (which cannot know
#: whether its exec reached the service: review session 40 R2-1), and
#: attach, which attached nothing.
_CUT_SHORT = {
    ("run", "true"): b"sdexec: interrupted by SIGINT before the process started\n",
    ("run", "--bg", "true"): (
        b"sdexec: SIGINT: waiting for the service's answer, to say the pid of a"
        b" process that starts (again to give up)\n"
        b"sdexec: interrupted by SIGINT before the answer: the process may start"
        b" in the background all the same (sdexec ps)\n"
    ),
    ("attach", "x"): (
        b"sdexec: interrupted by SIGINT before the service answered the attach\n"
    ),
}


@pytest.mark.parametrize("way", list(_CUT_SHORT), ids=["run", "bg", "attach"])
def test_a_signal_during_a_connect_that_waits_is_an_interruption(tmp_path, way):
    # The service's backlog full (a wedged service): connect() waits, and a
    # ^C returned it unconnected; the first write then said "connection
    # lost: cannot write: Transport endpoint is not connected", exit 1
    # (attach too: review session 44).
    path = str(tmp_path / "full.sock")
    with (
        socket.socket(socket.AF_UNIX) as listener,
        socket.socket(socket.AF_UNIX) as first,
    ):
        listener.bind(path)
        listener.listen(0)
        first.setblocking(False)
        first.connect(path)  # fills the backlog
        client = subprocess.Popen(
            [*_cli_against(path), *way],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        waiting_in_connect(client.pid)
        client.send_signal(signal.SIGINT)
        _, stderr = client.communicate(timeout=30)
    assert client.returncode == -signal.SIGINT
    assert stderr == _CUT_SHORT[way]


@pytest.mark.parametrize(
    ("args", "who"), [((), "main"), (("--all",), "all")], ids=["main", "all"]
)
def test_kill_signals_the_main_process_unless_all_are_asked_for(serve, args, who):
    asked: list[dict] = []

    def answer(request: dict) -> list[dict]:
        asked.append(request["payload"])
        return [response(request, {})]

    done = sdexec(serve(answer), "kill", *args, "TERM", "42")
    assert done.returncode == 0, done.stderr
    # "who" always: a service older than the main-process default would
    # take its absence for every process.
    assert asked == [{"pid": 42, "signum": 15, "who": who}]


def test_run_forwards_its_signals_to_every_process_of_the_unit(serve):
    # As a terminal signals a foreground job's process group.
    kills: list[dict] = []
    started = threading.Event()

    def script(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.exec":
            started.set()
            return [response(request, {"type": "started", "pid": 42})]
        kills.append(request["payload"])
        return [response(request, {})]

    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", serve(script), "run", "true"],
        stdin=subprocess.DEVNULL,
    )
    try:
        assert started.wait(30)
        for _ in range(600):
            client.send_signal(signal.SIGUSR1)  # held until the loop has started
            if kills:
                break
            time.sleep(0.05)
        assert kills[0] == {"pid": 42, "signum": signal.SIGUSR1, "who": "all"}
    finally:
        client.kill()
        client.wait()


def _served(pid: int) -> None:
    """Wait until ``pid`` has been delivered its pending signals and is
    asleep in poll(2) again: its loop has read them (it sleeps there only
    with nothing to read, its signals' wakeup pipe included)."""
    status = Path(f"/proc/{pid}/status")
    for _ in range(6000):
        pending = [
            line.split()[1]
            for line in status.read_text().splitlines()
            if line.startswith(("SigPnd:", "ShdPnd:"))
        ]
        asleep = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        if set("".join(pending)) == {"0"} and asleep == "S" and "poll" in wchan:
            return
        time.sleep(0.005)
    raise AssertionError("the signals were never served")


def test_run_holds_a_flood_of_one_signal_before_the_start_as_one(serve):
    # Each held was a kill once the process had started: 200 SIGUSR1s
    # during a long start grew the list for as long, and were 200 kills
    # (which the process could not tell from one: standard signals do
    # not queue). Each is served on its own here, then a SIGUSR2 after
    # them is kept, and in its place.
    kills: list[int] = []
    asked, go = threading.Event(), threading.Event()
    starting = starting_when(go, asked)

    def script(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.exec":
            return starting(request)
        kills.append(request["payload"]["signum"])
        return [response(request, {})]

    client = subprocess.Popen(
        [*_cli_against(serve(script)), "run", "-n", "true"], stdin=subprocess.DEVNULL
    )
    try:
        assert asked.wait(30), "the exec was never sent"
        for signum in [signal.SIGUSR1] * 200 + [signal.SIGUSR2]:
            client.send_signal(signum)
            _served(client.pid)
        go.set()
        _until(lambda: signal.SIGUSR2 in kills)
        assert kills == [signal.SIGUSR1, signal.SIGUSR2]
    finally:
        client.kill()
        client.wait()


#: An ``output`` response past any pipe's room: the command's write of it
#: waits for a reader that never comes.
_PAST_A_PIPE = encode_io("stdout", "0", b"x" * (1 << 20))


def _blocked_run(kills: list[int], answer: bool) -> Script:
    """A script for a ``run --no-passthrough -n`` whose process writes
    :data:`_PAST_A_PIPE` at once: each kill's signal noted in ``kills``,
    and answered if ``answer``."""

    def blocked(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.exec":
            started = response(request, {"type": "started", "pid": 42})
            return [started, response(request, {"type": "output", "io": _PAST_A_PIPE})]
        if request["topic"] != "sdexec.kill":
            return []  # -n's EOF
        kills.append(request["payload"]["signum"])
        return [response(request, {})] if answer else []

    return blocked


@contextlib.contextmanager
def _run_writing_to_no_reader(path: str) -> Iterator[subprocess.Popen]:
    """``sdexec run --no-passthrough -n job`` against ``path``, its stdout a
    pipe nobody reads, once its write waits there; killed after."""
    unread, stdout = os.pipe()
    client = subprocess.Popen(
        [*_cli_against(path), "run", "--no-passthrough", "-n", "job"],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
    )
    os.close(stdout)
    try:
        _until(lambda: _writing(client.pid))
        yield client
    finally:
        client.kill()
        client.wait()
        os.close(unread)


def test_run_sends_a_flood_of_one_signal_as_one_kill_in_flight(serve):
    # While an output write waits for our reader, each kill goes on a
    # connection of its own: a flood of SIGUSR1, each served in a turn of
    # its own, was a connection each (thousands, every one the service
    # allows) and the SIGTERM after it was refused. One kill in flight for
    # a signal, as for a resize: the rest wait for its answer (here never
    # sent), the SIGTERM goes at once.
    kills: list[int] = []
    with _run_writing_to_no_reader(serve(_blocked_run(kills, answer=False))) as client:
        for _ in range(20):
            client.send_signal(signal.SIGUSR1)
            _served(client.pid)
        client.send_signal(signal.SIGTERM)
        _until(lambda: signal.SIGTERM in kills)
    assert kills == [signal.SIGUSR1, signal.SIGTERM]


def test_a_second_signal_reaches_the_process_while_output_waits(serve):
    # The user's second ^C (or `kill -TERM` of the client) waited for the
    # answer to the first one's kill, which was read only once the write
    # was done: a stopped reader (`| less`, then Ctrl-Z) kept it from the
    # process for as long. The answers to kills are read while it waits.
    kills: list[int] = []
    with _run_writing_to_no_reader(serve(_blocked_run(kills, answer=True))) as client:
        client.send_signal(signal.SIGTERM)
        _until(lambda: kills == [signal.SIGTERM])
        client.send_signal(signal.SIGTERM)
        _until(lambda: len(kills) == 2)
        assert _writing(client.pid)  # still waiting: nothing was read past it
    assert kills == [signal.SIGTERM, signal.SIGTERM]


def _writing(pid: int) -> bool:
    """Whether ``pid`` has a descriptor of its own for its stdout (opened
    to write it without blocking): its output is on its way, and waits."""
    stdout = os.readlink(f"/proc/{pid}/fd/1")
    fds = os.listdir(f"/proc/{pid}/fd")
    return any(_fd_target(pid, fd) == stdout for fd in fds if fd != "1")


def _fd_target(pid: int, fd: str) -> str | None:
    """What ``pid``'s ``fd`` is open on; None if it was closed since it
    was listed (the command opens and closes files while it starts)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:
        return None


def _until(done: Callable[[], bool], send: Callable[[], None] = lambda: None) -> None:
    """Wait (30 s at most: a loaded node) until ``done()``, calling
    ``send()`` before each look."""
    for _ in range(600):
        send()
        if done():
            return
        time.sleep(0.05)
    raise AssertionError("never came")


def test_run_forwards_a_burst_of_resizes_with_one_kill_in_flight(serve):
    # A window dragged sends dozens of SIGWINCH a second: one kill in
    # flight, one more once it is answered, whatever came meanwhile. The
    # first is answered only with the SIGUSR1's (a signal served after the
    # burst: nothing of it was held back for that long).
    payloads: list[dict] = []
    held: list[dict] = []
    started = threading.Event()

    def script(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.exec":
            started.set()
            return [response(request, {"type": "started", "pid": 42})]
        payloads.append(request["payload"])
        if request["payload"]["signum"] == signal.SIGWINCH and not held:
            held.append(request)
            return []
        return [response(request, {}), *(response(r, {}) for r in held)]

    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", serve(script), "run", "true"],
        stdin=subprocess.DEVNULL,
    )
    try:
        assert started.wait(30)

        def winch() -> None:
            client.send_signal(signal.SIGWINCH)

        def kills() -> list[int]:
            return [payload["signum"] for payload in payloads]

        _until(lambda: bool(payloads), winch)  # held until the loop has started
        for _ in range(50):
            winch()
        client.send_signal(signal.SIGUSR1)
        _until(lambda: len(payloads) >= 3)  # the SIGUSR1, then the one resize
        client.send_signal(signal.SIGUSR2)
        _until(lambda: signal.SIGUSR2 in kills())
        assert kills() == [
            signal.SIGWINCH,
            signal.SIGUSR1,
            signal.SIGWINCH,
            signal.SIGUSR2,
        ]
        # As a terminal tells its foreground job (every process of it).
        assert {payload["who"] for payload in payloads} == {"all"}
    finally:
        client.kill()
        client.wait()


def _stats_url(listener: socket.socket) -> str:
    return f"http://127.0.0.1:{listener.getsockname()[1]}/stats"


def test_stats_from_an_endpoint_that_closes_says_so_in_words():
    # It printed treq's list of Failure reprs (review session 32 N F3).
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def close_unanswered() -> None:
            connection, _ = listener.accept()
            connection.close()

        threading.Thread(target=close_unanswered, daemon=True).start()
        url = _stats_url(listener)
        done = sdexec("/nonexistent", "stats", "--url", url)
    assert done.returncode == 1
    assert done.stderr.decode() == (
        f"sdexec: cannot read {url}: the server closed the connection without"
        " answering\n"
    )


def test_stats_over_tls_from_a_plain_http_endpoint_says_so_in_words():
    # pyOpenSSL's error was shown as its list's repr: "[('SSL routines',
    # '', 'wrong version number')]".
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def answer_in_plain_http() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(4096)  # the TLS client hello
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer_in_plain_http, daemon=True).start()
        url = _stats_url(listener).replace("http:", "https:")
        done = sdexec("/nonexistent", "stats", "--url", url)
    said = done.stderr.decode()
    assert done.returncode == 1
    assert said.startswith(f"sdexec: cannot read {url}: TLS failed: "), said
    assert said.endswith(" (is the endpoint served over TLS, as https:// asks?)\n"), (
        said
    )
    assert "[(" not in said and said.count("\n") == 1


def test_stats_from_an_endpoint_that_never_answers_dies_of_sigterm():
    # Twisted's react() caught SIGTERM: exit 1 and a lost connection's repr.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sdexec.cli",
                "stats",
                "--url",
                _stats_url(listener),
            ],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        connection, _ = listener.accept()  # the request is on its way
        with connection:
            client.send_signal(signal.SIGTERM)
            _, stderr = client.communicate(timeout=30)
    assert client.returncode == -signal.SIGTERM, stderr


def test_stats_from_a_url_treq_refuses_at_once_is_one_line():
    # Failed before the reactor ran: its stop was lost, and the command
    # hung for ever, saying nothing (review session 32 T1).
    done = sdexec("/nonexistent", "stats", "--url", "localhost:8490/stats")
    assert done.returncode == 1
    assert done.stderr.decode().startswith("sdexec: cannot read localhost:8490/stats: ")
    assert done.stderr.decode().count("\n") == 1


@pytest.mark.parametrize("url", ["127.0.0.1:8490/stats", "ftp://127.0.0.1/stats"])
def test_stats_from_a_url_of_no_http_scheme_says_what_to_give(url):
    # Said in the Agent's words, "Unsupported scheme: b''", for the
    # scheme-less address an admin types first (review session 47).
    done = sdexec("/nonexistent", "stats", "--url", url)
    assert (done.returncode, done.stderr.decode()) == (
        1,
        f"sdexec: cannot read {url}: not an http:// URL, such as"
        " http://127.0.0.1:8490/stats\n",
    )


def test_a_stats_request_that_timed_out_says_so():
    # A timeout cancels the request: its reason had no words, and the line
    # ended at the colon (review session 32 T2).
    from twisted.internet.defer import Deferred
    from twisted.internet.task import Clock

    from sdexec.cli import _HTTP_TIMEOUT_S, _http_failure, _within_timeout

    clock, failed = Clock(), []
    _within_timeout(Deferred(), clock).addErrback(failed.append)
    clock.advance(_HTTP_TIMEOUT_S)
    assert _http_failure(failed[0].value) == "no answer within 30 s"


_STATS_JSON = b'{"procs": []}'


def _serve_stats_once(
    listener: socket.socket, asked: list[bytes], body: bytes = _STATS_JSON
) -> None:
    """Answer one request on ``listener`` with ``body``; what was asked
    goes to ``asked``."""
    connection, _ = listener.accept()
    with connection:
        request = b""
        while b"\r\n\r\n" not in request:
            request += connection.recv(4096)
        asked.append(request)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            b'{"procs": ["\xff"]}',
            "the answer is not UTF-8 text, so not JSON: byte 0xff at offset 12",
        ),
        (b"<html>", "the answer is not JSON: Expecting value: line 1 column 1"),
        (b"", "the answer is not JSON: empty"),
    ],
)
def test_stats_from_an_answer_that_is_not_json_text_says_so(body, why):
    # It said only the codec's words, "'utf-8' codec can't decode byte
    # 0xff in position 12: invalid start byte" (review session 46 cli-1).
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        threading.Thread(
            target=_serve_stats_once, args=(listener, [], body), daemon=True
        ).start()
        url = _stats_url(listener)
        done = sdexec("/nonexistent", "stats", "--url", url)
    assert done.returncode == 1
    assert done.stdout == b""
    assert done.stderr.decode().startswith(f"sdexec: cannot read {url}: {why}")
    assert done.stderr.decode().count("\n") == 1


def _ipv6_loopback() -> socket.socket | None:
    """A listening socket on ``::1``, or ``None`` where it cannot be bound."""
    listener = socket.socket(socket.AF_INET6)
    try:
        listener.bind(("::1", 0))
    except OSError:
        listener.close()
        return None
    listener.listen(1)
    return listener


def test_stats_from_an_ipv6_literal_url():
    # treq's hyperlink refused the host before connecting: "Codepoint U+003A
    # at position 1 of '::1' not allowed", though the service writes its
    # endpoint's address so (review session 43 M5-3).
    listener = _ipv6_loopback()
    if listener is None:
        # No IPv6 loopback here: the URL must still get as far as a
        # connection (refused, or no route), not be refused as a URL.
        done = sdexec("/nonexistent", "stats", "--url", "http://[::1]:1/stats")
        assert done.returncode == 1
        assert done.stderr.startswith(b"sdexec: cannot read http://[::1]:1/stats: ")
        assert b"Codepoint" not in done.stderr
        return
    with listener:
        port = listener.getsockname()[1]
        asked: list[bytes] = []
        threading.Thread(
            target=_serve_stats_once, args=(listener, asked), daemon=True
        ).start()
        done = sdexec("/nonexistent", "stats", "--url", f"http://[::1]:{port}/stats")
    assert (done.returncode, done.stderr) == (0, b"")
    assert done.stdout == b'{\n  "procs": []\n}\n'
    assert asked[0].startswith(b"GET /stats HTTP/1.1\r\n")
    assert f"\r\nHost: [::1]:{port}\r\n".encode() in asked[0]


def test_wait_says_its_output_is_lost_to_a_closed_stdout(serve):
    # The closed stdout became /dev/null for processes (as a shell's >&-
    # is for a local one's writes, which Python programs ignore): wait's
    # once-only output went there too, and it exited 0 in silence.
    def script(request: dict) -> list[dict]:
        io = encode_io("stdout", "0", b"precious\n")
        return [response(request, {"status": 0, "output": [io]})]

    path = serve(script)
    done = sdexec(path, "wait", "7", stdout=None, preexec_fn=lambda: os.close(1))
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: Bad file descriptor\n",
    )


def test_wait_whose_output_is_lost_keeps_a_failing_status(serve):
    # sdexec(1), EXIT STATUS: 1 only where the process's own would be 0.
    def script(request: dict) -> list[dict]:
        io = encode_io("stdout", "0", b"precious\n")
        return [response(request, {"status": 3 << 8, "output": [io]})]

    path = serve(script)
    done = sdexec(path, "wait", "7", stdout=None, preexec_fn=lambda: os.close(1))
    assert (done.returncode, done.stderr) == (
        3,
        b"sdexec: cannot write stdout: Bad file descriptor\n",
    )


def ending_at_stdin_eof(status: int = 0) -> Script:
    """An exec that starts, and ends with wait status ``status`` once its
    stdin's EOF has come (so the client reads its stdin first)."""
    execs: list[dict] = []

    def script(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.exec":
            execs.append(request)
            return [response(execs[0], {"type": "started", "pid": 42})]
        if request["topic"] != "sdexec.write" or not request["payload"]["io"]["eof"]:
            return []
        return [
            response(execs[0], {"type": "finished", "status": status}),
            failure(execs[0], errno.ENODATA),
        ]

    return script


@pytest.mark.parametrize("kind", ["devnull", "pipe"])
def test_a_stdin_not_open_for_reading_is_an_empty_one(serve, kind):
    # nohup's write-only /dev/null: "cannot read stdin: Bad file
    # descriptor" on every run, whether the process read stdin or not
    # (review session 40 L2). A pipe's write end (`0>&1 | cat`) is never
    # readable to the loop: the run waited for its EOF for ever (R2-2).
    path = serve(ending_at_stdin_eof())
    read_end, write_end = os.pipe()
    with open(os.devnull, "wb") as devnull, open(read_end, "rb"), open(write_end):
        write_only = devnull.fileno() if kind == "devnull" else write_end
        done = sdexec(path, "run", "--no-passthrough", "true", stdin=write_only)
    assert (done.returncode, done.stderr) == (0, b"")


def test_a_stdin_that_fails_to_read_fails_the_run(serve):
    # The process got an early EOF, and run exited 0 as if it had all of
    # its input; a refused stdin write already turns 0 into 1.
    path = serve(ending_at_stdin_eof())
    ours, stdin = socket.socketpair()
    with ours, stdin:
        stdin.send(b"unread")  # closed unread: the reads of stdin fail
        ours.close()
        done = sdexec(path, "run", "--no-passthrough", "true", stdin=stdin)
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot read stdin: Connection reset by peer\n",
    )


def dying_of_the_kill() -> Script:
    """An exec that starts, says ``ready`` on stdout, and dies of the first
    signal it is sent (a kill on the connection it came on)."""
    execs: list[dict] = []

    def script(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.exec":
            execs.append(request)
            io = encode_io("stdout", "0", b"ready\n")
            return [
                response(request, {"type": "started", "pid": 42}),
                response(request, {"type": "output", "pid": 42, "io": io}),
            ]
        if request["topic"] != "sdexec.kill":
            return []  # stdin's EOF
        status = request["payload"]["signum"]
        return [
            response(request, {}),
            response(execs[-1], {"type": "finished", "status": status}),
            failure(execs[-1], errno.ENODATA),
        ]

    return script


def _cli_against(path: str) -> list[str]:
    """The command line's argv up to its command, against the service on
    ``path``."""
    return [sys.executable, "-m", "sdexec.cli", "--socket", path]


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP]
)
def test_a_process_that_dies_of_a_forwarded_signal_ends_the_client_alike(serve, signum):
    # It exited 130 for a ^C: bash takes a child that exits as having
    # handled the ^C, and a script's `for` loop of runs went on to the
    # next (review session 40 L1). SIGTERM and SIGHUP stay exits (143).
    command = _cli_against(serve(dying_of_the_kill()))
    client = subprocess.Popen(
        [*command, "run", "--no-passthrough", "-n", "job"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert client.stdout is not None
    assert client.stdout.readline() == b"ready\n"  # started, signals caught
    client.send_signal(signum)
    _, stderr = client.communicate(timeout=30)
    assert (client.returncode, stderr) == (ended_by(signum), b"")


def test_a_process_that_dies_of_a_sigint_sent_by_another_exits_130(serve):
    # Not the client's ^C: a shell must not stop for it (as for a local
    # command a `kill -INT` of its own killed).
    def killed_by_another(request: dict) -> list[dict]:
        return [
            response(request, {"type": "started", "pid": 42}),
            response(request, {"type": "finished", "status": signal.SIGINT}),
            failure(request, errno.ENODATA),
        ]

    done = sdexec(serve(killed_by_another), "run", "-n", "job")
    assert (done.returncode, done.stderr) == (130, b"")


#: A script's loop of runs: a ^C in its first should stop it, as it stops a
#: loop of local commands.
_LOOP = """
for n in 1 2 3; do
    "$@" run --no-passthrough -n job
    echo "next $n"
done
echo loop-finished
"""


def test_a_ctrl_c_stops_a_script_s_loop_of_runs(serve):
    import pty

    command = _cli_against(serve(dying_of_the_kill()))
    pid, terminal = pty.fork()
    if pid == 0:  # the script on a terminal of its own, in the foreground
        os.execvp("bash", ["bash", "-c", _LOOP, "bash", *command])
    try:
        seen = _read_terminal(terminal, until=b"ready", seconds=30)
        assert b"ready" in seen, seen
        os.write(terminal, b"\x03")  # ^C, to bash and the client alike
        seen += _read_terminal(terminal, until=b"next 1", seconds=10)
        assert b"next" not in seen and b"loop-finished" not in seen, seen
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(terminal)


def _read_terminal(terminal: int, until: bytes, seconds: float) -> bytes:
    """What the terminal shows until ``until``, its end (EIO once nobody
    holds it open), or ``seconds``."""
    import select as select_

    seen = b""
    deadline = time.monotonic() + seconds
    while until not in seen and time.monotonic() < deadline:
        if not select_.select([terminal], [], [], deadline - time.monotonic())[0]:
            break
        try:
            data = os.read(terminal, 4096)
        except OSError:  # EIO: every holder of the terminal gone
            break
        if not data:
            break
        seen += data
    return seen


def starting_when(go: threading.Event, asked: threading.Event) -> Script:
    """A background exec answered ``started`` (pid 42) once ``go`` is set
    (a manager slow to start its unit); ``asked`` is set when it comes."""

    def script(request: dict) -> list[dict]:
        asked.set()
        go.wait(30)
        return [response(request, {"type": "started", "pid": 42})]

    return script


#: What run --bg says at once of an interruption while it starts.
_WAITING = (
    ": waiting for the service's answer, to say the pid of a process that"
    " starts (again to give up)\n"
)


def _run_bg_job(path: str) -> subprocess.Popen:
    """``sdexec run --bg job`` against the service on ``path``, its output
    piped."""
    return subprocess.Popen(
        [*_cli_against(path), "run", "--bg", "job"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_run_bg_interrupted_while_starting_says_the_pid_that_runs_on(serve, signum):
    # The client died of the ^C, and the process started anyway in the
    # background, its pid never printed (review session 40 L3).
    go, asked = threading.Event(), threading.Event()
    path = serve(starting_when(go, asked))
    client = _run_bg_job(path)
    try:
        assert asked.wait(30), "the exec was never sent"
        client.send_signal(signum)
        assert client.stderr is not None
        name = signal.Signals(signum).name
        assert client.stderr.readline().decode() == f"sdexec: {name}{_WAITING}"
    finally:
        go.set()
    stdout, stderr = client.communicate(timeout=30)
    assert (client.returncode, stdout) == (ended_by(signum), b"42\n")
    assert stderr.decode() == (
        f"sdexec: interrupted by {name} while starting: pid 42 runs on in the"
        " background (sdexec kill TERM 42)\n"
    )


def test_run_bg_interrupted_twice_while_starting_gives_up(serve):
    go, asked = threading.Event(), threading.Event()
    path = serve(starting_when(go, asked))
    client = _run_bg_job(path)
    try:
        assert asked.wait(30), "the exec was never sent"
        client.send_signal(signal.SIGINT)
        assert client.stderr is not None
        assert client.stderr.readline() == f"sdexec: SIGINT{_WAITING}".encode()
        client.send_signal(signal.SIGINT)
        stdout, stderr = client.communicate(timeout=30)
    finally:
        go.set()
    assert (client.returncode, stdout) == (-signal.SIGINT, b"")
    assert stderr == (
        b"sdexec: interrupted by SIGINT before the answer: the process may start"
        b" in the background all the same (sdexec ps)\n"
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_attach_interrupted_before_the_answer_says_nothing_was_attached(
    serve, signum
):
    # It said "detached from pid ?; it runs on", of a target that may not
    # exist (review session 43 L2-4).
    asked = threading.Event()

    def never_answered(request: dict) -> list[dict]:
        asked.set()
        return []

    client = subprocess.Popen(
        [*_cli_against(serve(never_answered)), "attach", "99"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert asked.wait(30), "the attach was never sent"
    client.send_signal(signum)
    stdout, stderr = client.communicate(timeout=30)
    said = f"interrupted by {signal.Signals(signum).name} before the service"
    assert (client.returncode, stdout, stderr) == (
        ended_by(signum),
        b"",
        f"sdexec: {said} answered the attach\n".encode(),
    )


@pytest.mark.parametrize("command", [["ps"], ["run", "-n", "job"]])
def test_a_line_from_the_service_that_is_not_json_says_what_is_wrong(serve, command):
    # The json module's C scanner raises its error from json.decoder, which
    # the command line had not imported: "unexpected error: SystemError:
    # <_json.Scanner object ...> returned NULL without setting an exception".
    path = serve(lambda request: [b'{"type": "resp\n'])
    done = sdexec(path, *command)
    assert (done.returncode, done.stderr) == (
        1,
        f"sdexec: {path}: bad message from sdexec: message is not valid JSON:"
        " Unterminated string starting at: line 1 column 10 (char 9)\n".encode(),
    )


def finishing(*finished: dict) -> Script:
    """An exec or attach stream that starts, sends a ``finished`` of each
    of ``finished``'s fields, then ends well."""

    def script(request: dict) -> list[dict]:
        first = stream_start(request)
        if first is None:
            return []
        ends = [response(request, {"type": "finished", **f}) for f in finished]
        return [response(request, first), *ends, failure(request, errno.ENODATA)]

    return script


def stream_start(request: dict) -> dict | None:
    """The first response of an exec or attach stream (pid 7); ``None``
    for another request."""
    if request["topic"] == "sdexec.exec":
        return {"type": "started", "pid": 7}
    if request["topic"] == "sdexec.attach":
        return {"type": "attached", "pid": 7, "cmd": ATTACHED_CMD, "dropped": {}}
    return None


STREAMS = pytest.mark.parametrize(
    "command", [["run", "-n", "job"], ["attach", "7"]], ids=["run", "attach"]
)


@STREAMS
@pytest.mark.parametrize(
    ("finished", "shown"),
    [
        ({"status": 1.5}, "1.5"),
        ({"status": -1}, "-1"),
        ({"status": 1 << 40}, str(1 << 40)),
        ({"status": True}, "true"),
        ({"status": "0"}, '"0"'),
        ({}, "none"),
    ],
    ids=["float", "negative", "past-32-bits", "true", "text", "none"],
)
def test_a_finished_without_a_wait_status_is_said_naming_what_came(
    serve, command, finished, shown
):
    # 1.5 read as "the service ended the stream without a finished
    # response"; -1 exited 255 and true 129, silently; 1 << 40 was
    # "unexpected error: OverflowError: Python int too large to convert to
    # C int".
    done = sdexec(serve(finishing(finished)), *command)
    said = f"the service's finished response: expected a wait status, got {shown}"
    assert (done.returncode, done.stderr) == (1, f"sdexec: {said}\n".encode())


@STREAMS
def test_a_second_finished_is_said_and_the_first_kept(serve, command):
    # The second replaced the first: exit 1, silently, for a command that
    # exited 0.
    done = sdexec(serve(finishing({"status": 0}, {"status": 1 << 8})), *command)
    assert (done.returncode, done.stderr) == (
        0,
        b"sdexec: after the command finished: the service sent a second"
        b" finished response\n",
    )


def test_a_service_s_huge_errstr_is_shown_cut(serve):
    # Review session 47: a service (another version, a buggy one) answering
    # with a 100 kB errstr had it printed whole, escaped but never cut, where
    # the service itself sends no errstr over MAX_ERRSTR characters.
    huge = "\x1b[31m" + "x" * 100_000
    done = sdexec(serve(lambda request: [failure(request, errno.EIO, huge)]), "ps")
    assert done.returncode == 1
    line = done.stderr.decode().removesuffix("\n")
    assert "\n" not in line and "\x1b" not in line
    assert line.endswith("…") and len(line) < MAX_ERRSTR + 100


def started_then(
    *messages: dict | bytes, pid: object = 7, ends: bool = False
) -> Script:
    """An exec that starts (``started`` with ``pid``), then sends each of
    ``messages`` (a dict: a response's payload); ``ends``: then finishes
    with status 0 and ends well."""

    def script(request: dict) -> list[dict | bytes]:
        if request["topic"] != "sdexec.exec":
            return []
        sent = [{"type": "started", "pid": pid}, *messages]
        if ends:
            sent.append({"type": "finished", "status": 0})
        framed = [response(request, m) if isinstance(m, dict) else m for m in sent]
        return framed + ([failure(request, errno.ENODATA)] if ends else [])

    return script


def output(stream: str, data: bytes) -> dict:
    return {"type": "output", "pid": 7, "io": encode_io(stream, "0", data)}


class KillsSeen:
    """A script's kills, recorded as the service reads them (after the
    command may have exited: :meth:`wait` for them)."""

    def __init__(self, script: Script) -> None:
        self._script = script
        self.kills: list[dict] = []
        self._seen = threading.Event()

    def __call__(self, request: dict) -> list[dict | bytes]:
        if request["topic"] == "sdexec.kill":
            self.kills.append(request["payload"])
            self._seen.set()
        return self._script(request)

    def wait(self) -> list[dict]:
        """The kills, once one has come (or after 10 s, none)."""
        self._seen.wait(10)
        return self.kills


#: The kill a client sends the process of a stream that broke the protocol.
PROTOCOL_KILL = {"pid": 7, "signum": signal.SIGKILL, "who": "main"}


def test_output_for_a_stream_not_ours_kills_the_process_and_fails_the_command(
    serve,
):
    # Dropped without a word (review session 47); then said in words of its
    # own, and the command exited 0 with that output lost, the process run
    # on unseen.
    script = KillsSeen(
        started_then(output("stdout", b"out\n"), output("stdlog", b"a\n"))
    )
    done = sdexec(serve(script), "run", "-n", "job")
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        b"out\n",
        b'sdexec: the service\'s output response: io.stream: expected "stdout" or'
        b' "stderr", got "stdlog": pid 7 killed (SIGKILL): its stream broke'
        b" the protocol\n",
    )
    assert script.wait() == [PROTOCOL_KILL]


#: Output no client can decode: bad base64, then no io object at all.
_BAD_BASE64 = {"stream": "stdout", "rank": "0", "data": "#!", "encoding": "base64"}


def streaming(*payloads: dict) -> Script:
    """An exec or attach stream that starts, sends each of ``payloads``,
    finishes with status 0 and ends well; a wait answered with the io of
    each as its output."""

    def script(request: dict) -> list[dict]:
        if request["topic"] == "sdexec.wait":
            output = [payload["io"] for payload in payloads]
            return [response(request, {"status": 0, "output": output})]
        first = stream_start(request)
        if first is None:
            return []
        sent = [first, *payloads, {"type": "finished", "status": 0}]
        return [response(request, m) for m in sent] + [failure(request, errno.ENODATA)]

    return script


@STREAMS
def test_output_no_client_can_decode_kills_the_process_naming_it(serve, command):
    # "bad output from the service: io.data: invalid base64", in words of
    # its own, and the command exited 0 with that output lost; then dropped
    # and said, and the process ran on, its output unseen (Flux's
    # libsubprocess kills it).
    script = KillsSeen(
        streaming(
            output("stdout", b"out\n"),
            {"type": "output", "pid": 7, "io": _BAD_BASE64},
        )
    )
    done = sdexec(serve(script), *command)
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        b"out\n",
        b'sdexec: the service\'s output response: io.data: invalid base64: "#"'
        b" at offset 0 is not a base64 character: pid 7 killed (SIGKILL): its"
        b" stream broke the protocol\n",
    )
    assert script.wait() == [PROTOCOL_KILL]


def test_a_wait_s_output_no_client_can_decode_is_named_as_the_library_names_it(
    serve,
):
    # "bad output from the service: io.data: invalid base64", in words of its
    # own, and the command exited 0 with that output lost. (Nothing to kill:
    # a process waited for has ended.)
    script = KillsSeen(
        streaming(
            {"type": "output", "pid": 7, "io": _BAD_BASE64},
            output("stdout", b"out\n"),
            {"type": "output", "pid": 7, "io": "abc"},
        )
    )
    done = sdexec(serve(script), "wait", "7")
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        b"out\n",
        b'sdexec: wait: output[0].data: invalid base64: "#" at offset 0 is not'
        b" a base64 character: dropped, and any more malformed output unsaid\n",
    )
    assert script.kills == []


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        (
            {"type": "add-credit", "channels": {"stdin": "4096"}},
            'add-credit response: channels.stdin: expected an integer, got "4096"',
        ),
        (
            {"type": "add-credit", "channels": {"stdin": True}},
            "add-credit response: channels.stdin: expected an integer, got true",
        ),
        (
            {"type": "add-credit", "channels": {"a b": 1.5}},
            "add-credit response: channels['a b']: expected an integer, got 1.5",
        ),
        (
            {"type": "add-credit", "channels": [4096]},
            "add-credit response: channels: expected an object, got [4096]",
        ),
        (
            {"type": "bogus"},
            "response: type: expected one of add-credit, attached, finished,"
            ' output, started, stopped; got "bogus"',
        ),
    ],
)
def test_a_response_that_breaks_the_stream_kills_the_process_naming_it(
    serve, payload, said
):
    # An add-credit of text was ignored, and stdin held for credit that
    # never came; a response of no known type was ignored.
    script = KillsSeen(started_then(payload))
    done = sdexec(serve(script), "run", "--no-passthrough", "job")
    assert (done.returncode, done.stderr) == (
        1,
        f"sdexec: the service's {said}: pid 7 killed (SIGKILL): its stream"
        " broke the protocol\n".encode(),
    )
    assert script.wait() == [PROTOCOL_KILL]


@pytest.mark.parametrize(
    ("pid", "shown"),
    [("7", '"7"'), (-1, "-1"), (0, "0"), (True, "true"), (None, "null")],
)
def test_a_start_without_a_pid_ends_run_naming_what_came(serve, pid, shown):
    # Ignored: the signals forwarded waited for a pid until a ^C, said then
    # as "interrupted before the process started".
    script = started_then(output("stdout", b"never\n"), pid=pid)
    done = sdexec(serve(script), "run", "-n", "job")
    said = (
        f"sdexec: the service's started response: expected a pid, got {shown}:"
        " ending, as no signal could be forwarded to it\n"
    )
    assert (done.returncode, done.stderr) == (1, said.encode())


def test_a_start_with_no_pid_at_all_ends_run(serve):
    def script(request: dict) -> list[dict]:
        return [response(request, {"type": "started"})]

    done = sdexec(serve(script), "run", "-n", "job")
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: the service's started response: expected a pid, got none:"
        b" ending, as no signal could be forwarded to it\n",
    )


def test_a_connection_lost_in_the_middle_of_a_message_says_so(serve):
    # "connection to P lost", as if the service had closed between messages.
    path = serve(started_then(b'{"type": "response", "pa', HANG_UP))
    done = sdexec(path, "run", "-n", "job")
    assert (done.returncode, done.stderr) == (
        1,
        f"sdexec: connection to {path} lost in the middle of a message (24 bytes"
        " of it came)\n".encode(),
    )


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        (
            [b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", HANG_UP],
            "{path}: bad message from sdexec: message is not valid JSON: Expecting"
            " value: line 1 column 1 (char 0) (is {path} an sdexec socket?)",
        ),
        (
            [b"[1]\n"],
            "{path}: bad message from sdexec: message is not a JSON object (is"
            " {path} an sdexec socket?)",
        ),
        (
            [b"SSH-2.0-OpenSSH", HANG_UP],
            "connection to {path} lost in the middle of a message (15 bytes of it"
            " came; is {path} an sdexec socket?)",
        ),
    ],
    ids=["http", "json-not-an-object", "cut-off"],
)
def test_a_peer_whose_first_bytes_are_no_message_is_asked_about(serve, sent, said):
    # Only "message is not valid JSON" for an HTTP server's answer.
    path = serve(lambda request: sent)
    done = sdexec(path, "ps")
    expected = f"sdexec: {said.format(path=path)}\n"
    assert (done.returncode, done.stderr) == (1, expected.encode())


def test_an_attached_whose_dropped_is_no_counts_is_said(serve):
    # "x bytes of stdout dropped before this".
    def script(request: dict) -> list[dict]:
        attached = {
            "type": "attached",
            "pid": 7,
            "cmd": ATTACHED_CMD,
            "dropped": {"stdout": "x"},
        }
        return [response(request, attached)]

    script = KillsSeen(script)
    done = sdexec(serve(script), "attach", "7")
    assert (done.returncode, done.stderr) == (
        1,
        b'sdexec: attached: dropped.stdout: expected a byte count, got "x":'
        b" pid 7 killed (SIGKILL): its stream broke the protocol\n",
    )
    assert script.wait() == [PROTOCOL_KILL]
