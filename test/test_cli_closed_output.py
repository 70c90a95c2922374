"""`sdexec run` whose output goes nowhere, against the real service and
user manager: a stdout closed when it started (``>&-``, /dev/null for the
process), and a reader gone from under a process that ignores SIGPIPE. The
command runs as a subprocess, driven from a thread (the service runs in the
test's process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pytest_twisted import ensureDeferred
from twisted.internet.threads import deferToThread

pytestmark = pytest.mark.systemd

#: A program that writes to its stdout: what it writes goes to /dev/null.
COMMANDS = [["sh", "-c", "echo out"], [sys.executable, "-c", "print('out')"]]


def _closed_stdout_run(argv: list[str], env: dict[str, str] | None = None) -> int:
    return subprocess.run(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.close(1),
        timeout=60,
    ).returncode


@pytest.mark.parametrize(
    "mode", [[], ["--no-passthrough"]], ids=["passthrough", "framed"]
)
@pytest.mark.parametrize("command", COMMANDS, ids=["sh", "python"])
@ensureDeferred
async def test_a_closed_stdout_is_dev_null_for_the_process(sdexec, mode, command):
    # Read-only, it failed every write: a Python program's flush at exit was
    # an EBADF traceback and exit 1, where locally it exits 0 (review
    # session 34 R, finding 3).
    argv = [sys.executable, "-m", "sdexec.cli", "run", "-n", *mode, *command]
    env = {**os.environ, "SDEXEC_SOCKET": sdexec.socket_path}
    assert await deferToThread(_closed_stdout_run, argv, env) == 0


@ensureDeferred
async def test_a_python_process_whose_reader_went_is_ended(sdexec):
    # Python ignores SIGPIPE: `run --no-passthrough python3 -c 'while True:
    # print(…)' | head -1` ran for ever, the client dropping its output.
    argv = [
        sys.executable, "-m", "sdexec.cli", "run", "-n", "--no-passthrough",
        sys.executable, "-c", "while True: print('y' * 100)",
    ]  # fmt: skip

    def run_into_a_closed_pipe() -> int:
        reader, writer = os.pipe()
        os.close(reader)
        try:
            env = {**os.environ, "SDEXEC_SOCKET": sdexec.socket_path}
            return subprocess.run(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=writer, timeout=60
            ).returncode
        finally:
            os.close(writer)

    assert await deferToThread(run_into_a_closed_pipe) == 141
