"""Every command's own ``--help`` and ``--version``, and the admin tools'
output, are checked writes (sdexec/cliparser.py): argparse drops a failed
one (``sdexec --help > /dev/full`` exited 0), and the tools ended in a
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"

COMMANDS = [
    ("sdexec.cli", "sdexec"),
    ("sdexec.config", "python3 -m sdexec.config"),
    ("sdexec.map", "python3 -m sdexec.map"),
]


def _run_into_full_disk(
    args: list[str], unbuffered: bool, python_args: tuple[str, ...] = ("-m",)
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"  # the write fails, not the flush
    with open("/dev/full", "wb") as full:
        return subprocess.run(
            [sys.executable, *python_args, *args],
            stdout=full, stderr=subprocess.PIPE, text=True,
            env=env, timeout=60, cwd=REPO,
        )  # fmt: skip


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("flag", ["--help", "--version"])
@pytest.mark.parametrize(("module", "prog"), COMMANDS)
def test_a_full_disk_fails_the_command(module, prog, flag, unbuffered):
    shown = _run_into_full_disk([module, flag], unbuffered)
    assert shown.returncode == 1
    assert shown.stderr == f"{prog}: cannot write stdout: No space left on device\n"


@pytest.mark.parametrize(
    "command", ["run", "ps", "kill", "cancel", "stats", "undrain", "wait", "attach"]
)
def test_a_subcommands_help_is_checked_too(command):
    # It said "sdexec run: cannot write stdout", where every other failure
    # of the command (its own output's too) is "sdexec: ..." (docs/client.md).
    shown = _run_into_full_disk(["sdexec.cli", command, "--help"], unbuffered=False)
    assert shown.returncode == 1
    assert shown.stderr == "sdexec: cannot write stdout: No space left on device\n"


def test_a_reader_gone_is_sigpipes_status():
    # The help (several KiB) into a pipe whose reader has gone: the status a
    # shell gives a command SIGPIPE ended, and nothing on stderr.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        shown = subprocess.run(
            [sys.executable, "-m", "sdexec.cli", "--help"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (shown.returncode, shown.stderr) == (141, "")


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    ("args", "prog"),
    [
        (["sdexec.config", "CONFIG"], "python3 -m sdexec.config"),
        (["sdexec.map", "--cores", "0", "--xml", str(DATA / "small.xml")],
         "python3 -m sdexec.map"),
    ],
    ids=["config", "map"],
)  # fmt: skip
def test_an_admin_tools_output_into_a_full_disk_is_one_line(
    tmp_path, args, prog, unbuffered
):
    config = tmp_path / "sdexec.toml"
    config.write_text("[sdexec]\n")
    args = [str(config) if arg == "CONFIG" else arg for arg in args]
    shown = _run_into_full_disk(args, unbuffered)
    assert shown.returncode == 1
    assert shown.stderr == f"{prog}: cannot write stdout: No space left on device\n"


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_the_twistd_plugins_help_into_a_full_disk_is_one_line(unbuffered):
    # Twisted's own --help prints unchecked: a traceback, or exit 120.
    twistd = ("-c", "from twisted.scripts.twistd import run; run()")
    shown = _run_into_full_disk(["sdexec", "--help"], unbuffered, twistd)
    assert shown.returncode == 1
    assert (
        shown.stderr == "twistd sdexec: cannot write stdout: No space left on device\n"
    )


@pytest.mark.parametrize(
    ("args", "prog"),
    [
        (["-m", "sdexec.config", "--help"], "python3 -m sdexec.config"),
        (["-m", "sdexec.map", "--version"], "python3 -m sdexec.map"),
        (["-c", "from twisted.scripts.twistd import run; run()", "sdexec", "--help"],
         "twistd sdexec"),
    ],
    ids=["config", "map", "twistd"],
)  # fmt: skip
def test_a_stdout_closed_at_start_is_one_line(args, prog):
    # Python leaves sys.stdout None for a closed fd 1 (>&-): the write
    # ended in an AttributeError traceback (review 35 R2).
    shown = subprocess.run(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        timeout=60, cwd=REPO, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert shown.returncode == 1
    assert shown.stderr == f"{prog}: cannot write stdout: Bad file descriptor\n"
