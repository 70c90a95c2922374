"""The command line's output, offline, against a fake service: what `run`
does with a process whose output cannot be written (a reader gone, a full
disk, a stdout closed when it started), the one checked writer of every
command's own output, the signals `run` passes on, and a Ctrl-C while the
command loads. The command runs in a subprocess, as a user runs it."""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli_scripted import ScriptedService, failure, response, sdexec

from sdexec.ioencode import encode_io
from sdexec.wire import FrameSplitter, encode_message

REPOSITORY = Path(__file__).resolve().parent.parent


class Printing(ScriptedService):
    """A service whose every exec starts (pid 42) and prints a line on
    stdout every few milliseconds, as ``yes`` would, until the client closes
    its connection. Kills are kept in ``kills`` and answered; one other than
    SIGPIPE ends the process with that signal (the fake's process ignores
    SIGPIPE, as every Python program does)."""

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
        if request["topic"] == "sdexec.exec":
            streams.append(request)
            send(connection, response(request, {"type": "started", "pid": 42}))
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
        "sdexec.list": {"procs": []},
        "sdexec.stats-get": {"running": 0},
        "sdexec.terminate": {"id": "j1", "step": "term"},
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


@pytest.mark.parametrize(
    ("stdout", "said"),
    [("/dev/full", "No space left on device"), (None, "Bad file descriptor")],
    ids=["full-disk", "closed"],
)
def test_output_that_cannot_be_written_ends_the_process_and_exits_1(
    printing, stdout, said
):
    # A full disk sent the process SIGPIPE and exited 141, the status
    # scripts take for a reader's choice (finding 2); a stdout closed when
    # it started (`>&-`) was /dev/null, written to for ever (finding 6).
    service, path = printing
    args = ["run", "--no-passthrough", "-n", "yes"]
    if stdout is None:
        done = sdexec(path, *args, stdout=None, preexec_fn=lambda: os.close(1))
    else:
        with open(stdout, "wb") as sink:
            done = sdexec(path, *args, stdout=sink)
    assert done.returncode == 1
    assert done.stderr == f"sdexec: cannot write stdout: {said}\n".encode()
    assert service.kills == []  # no reader went: no SIGPIPE
    assert service.closed.wait(10), "the process was left writing to nowhere"


def test_ctrl_backslash_is_passed_on_to_the_process(printing):
    # SIGQUIT killed the client (a core dump of it), and the unit was
    # stopped with SIGTERM: the process never saw its Ctrl-\.
    service, path = printing
    env = {key: value for key, value in os.environ.items() if key != "SDEXEC_SOCKET"}
    client = subprocess.Popen(
        [sys.executable, "-m", "sdexec.cli", "--socket", path, "run", "-n", "py"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert client.stdout is not None
        client.stdout.readline()  # started, and its signals caught
        client.send_signal(signal.SIGQUIT)
        _, stderr = client.communicate(timeout=30)
    finally:
        client.kill()
        client.wait()
    assert (client.returncode, stderr) == (128 + signal.SIGQUIT, b"")
    assert service.kills == [{"pid": 42, "signum": signal.SIGQUIT, "who": "all"}]


# -- the commands' own output ----------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["ps"], ["stats"], ["cancel", "j1"], ["undrain"], ["run", "--bg", "true"]],
    ids=lambda args: " ".join(args),
)
def test_a_full_stdout_is_said_in_words(scripted, monkeypatch, args):
    # An unbuffered stdout (PYTHONUNBUFFERED, common in containers) made
    # print() itself fail: "unexpected error: OSError: [Errno 28] …", a bug's
    # words, for `run --bg` the line that the pid was lost (finding 3).
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    with open("/dev/full", "wb") as full:
        done = sdexec(scripted, *args, stdout=full)
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: No space left on device\n",
    )


@pytest.mark.parametrize("args", [["ps"], ["run", "--bg", "true"]], ids=" ".join)
def test_a_stdout_closed_at_the_start_cannot_be_written(scripted, args):
    # As a shell's `ls >&-` fails ("write error: Bad file descriptor"): the
    # listing, or the pid of a process that runs on, went to /dev/null and
    # the command exited 0 (finding 6).
    done = sdexec(scripted, *args, stdout=None, preexec_fn=lambda: os.close(1))
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: Bad file descriptor\n",
    )


def test_a_full_stdout_fails_attach_but_leaves_the_process(tmp_path):
    # The line said, then "detached" and exit 0: output lost, which the
    # exit status must say, as for `run` and `wait`. The process is left
    # running, as for a reader gone: a background one is not attach's.
    def attached(request: dict) -> list[dict]:
        io = encode_io("stdout", "0", b"lost\n")
        return [
            response(request, {"type": "attached", "pid": 42}),
            response(request, {"type": "output", "pid": 42, "io": io}),
        ]

    path = str(tmp_path / "attach.sock")
    service = ScriptedService(path, attached)
    try:
        with open("/dev/full", "wb") as full:
            done = sdexec(path, "attach", "42", stdout=full)
    finally:
        service.close()
    assert (done.returncode, done.stderr) == (
        1,
        b"sdexec: cannot write stdout: No space left on device\n"
        b"sdexec: detached from pid 42; it runs on\n",
    )


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
