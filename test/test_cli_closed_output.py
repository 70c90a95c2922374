"""`sdexec run` whose output goes nowhere, against the real service and
user manager: a stdout closed when it started (``>&-``), and a reader gone
from under a process that ignores SIGPIPE. The command runs as a subprocess,
driven from a thread (the service runs in the test's process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pytest_twisted import ensureDeferred
from twisted.internet.threads import deferToThread

pytestmark = pytest.mark.systemd

#: Locally, `yes >&-` exits 1 at once ("yes: standard output: Bad file
#: descriptor"), and `echo` fails.
COMMANDS = [["yes"], ["sh", "-c", "echo out"]]


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
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@ensureDeferred
async def test_a_closed_stdout_fails_the_process_as_in_a_shell(sdexec, mode, command):
    # It was /dev/null for the process: `sdexec run yes >&-` ran until
    # killed, and `sh -c 'echo out'` succeeded (review session 34 B, 6).
    argv = [sys.executable, "-m", "sdexec.cli", "run", "-n", *mode, *command]
    env = {**os.environ, "SDEXEC_SOCKET": sdexec.socket_path}
    code = await deferToThread(_closed_stdout_run, argv, env)
    assert code != 0
    if not mode:  # the process's own write fails, with its own status
        assert code == _closed_stdout_run(command)


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
