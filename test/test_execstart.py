"""The command a unit is given (sdexec/execstart.py): as it is where systemd
reads it back from the unit's file, else through the trampoline, which runs
it verbatim. The trampoline is run here as systemd would run it."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys

import pytest

from sdexec.execstart import exec_line, read_back_intact
from sdexec.limits import MAX_ARG_STRLEN, check_exec_size, check_trampoline_exec
from sdexec.refusal import RequestRefused

#: Prints its arguments and its environment as JSON.
PROBE = (
    "import json, sys\n"
    "print(json.dumps([sys.argv[1:], open('/proc/self/environ', 'rb').read()"
    ".decode()]))"
)


def run_line(line, env: dict[str, str], ignored=()) -> subprocess.CompletedProcess:
    """``line`` executed as systemd would, with ``env`` alone and
    ``ignored`` signals ignored (as ``IgnoreSIGPIPE=yes`` leaves SIGPIPE)."""

    def dispositions() -> None:
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)

    return subprocess.run(
        line.argv, executable=line.path, env=env, capture_output=True,
        preexec_fn=dispositions, check=False,
    )  # fmt: skip


def probed(line, env) -> tuple[list[str], str]:
    ran = run_line(line, env)
    assert ran.returncode == 0, ran.stderr
    args, environ = json.loads(ran.stdout)
    return args, environ


@pytest.mark.parametrize(
    "args",
    [["a b", "100%", "é", ""], ["$HOME", "${X}", "a;b", ";", "$$", "%24", "%", "%%3B"]],
    ids=["plain", "trampolined"],
)
def test_the_command_runs_verbatim_in_the_units_environment(args):
    line = exec_line(sys.executable, [sys.executable, "-c", PROBE, *args])
    assert line.trampolined == ("$HOME" in args)
    # A C locale, where Python would add LC_CTYPE=C.UTF-8 to its own.
    env = {"B": "$x;y", "LC_ALL": "", "LANG": "C"}
    got_args, environ = probed(line, env)
    assert got_args == args
    assert environ == "B=$x;y\0LC_ALL=\0LANG=C\0"


@pytest.mark.parametrize("ignore_sigpipe", [True, False])
def test_the_trampoline_leaves_the_signals_as_the_unit_gave_them(ignore_sigpipe):
    # Python ignores SIGPIPE and SIGXFSZ as it starts, and an exec keeps a
    # signal ignored: a command over LimitFSIZE= said "File too large"
    # rather than being killed (review session 43 E2).
    # Read by grep, which changes no disposition (Python would).
    show = "exec grep SigIgn /proc/self/status;"
    line = exec_line("/bin/sh", ["sh", "-c", show], ignore_sigpipe)
    assert line.trampolined
    ignored = (signal.SIGPIPE,) if ignore_sigpipe else ()
    ran = run_line(line, {"PATH": "/usr/bin:/bin"}, ignored)
    mask = int(ran.stdout.split()[1], 16)
    assert bool(mask & 1 << (signal.SIGPIPE - 1)) is ignore_sigpipe
    assert not mask & 1 << (signal.SIGXFSZ - 1)


@pytest.mark.parametrize(
    "path",
    ["/opt/my tools/run", '/opt/a"b', "/opt/a'b", "/opt/a\\b", "/opt/a\tb",
     "/opt/a\nb", "/opt/a$b", "/opt/a;b"],
)  # fmt: skip
def test_a_path_systemd_would_not_read_back_goes_through_the_trampoline(path):
    # Unquoted after "@" where argv[0] differs, a path with a space read
    # back as another command; one with a quote, a backslash, a tab or a
    # line break read back bad-setting (review session 43 E2).
    assert not read_back_intact(path, ["run"])
    assert exec_line(path, ["run"]).trampolined
    assert read_back_intact("/opt/é%/run", ["run", "a b", "'\"\\\t"])


def test_an_exec_that_fails_is_203_with_a_line_saying_why(tmp_path):
    script = tmp_path / "no-interpreter;"
    script.write_text("#!/nonexistent/sh\n")
    script.chmod(0o755)
    ran = run_line(exec_line(str(script), ["x"]), {})
    assert ran.returncode == 203
    assert ran.stderr.decode() == (
        f"sdexec: cannot execute {script}: No such file or directory\n"
    )


def test_an_argument_the_encoding_makes_too_long_is_e2big():
    # 100,000 bytes of ";" passed the request's own check, and failed as
    # 203/EXEC: three bytes each for the trampoline (review session 43 E2).
    cmdline = ["sh", "-c", ";" * 100_000]
    check_exec_size("/bin/sh", cmdline, {})
    with pytest.raises(RequestRefused) as refused:
        check_trampoline_exec(cmdline, exec_line("/bin/sh", cmdline), {})
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.E2BIG,
        "cmd.cmdline[2]: 300000 bytes once its $, ; and % are encoded for the"
        " trampoline, three bytes each; Linux execs no single argument or"
        f" environment string over {MAX_ARG_STRLEN - 1} bytes (MAX_ARG_STRLEN)",
    )
    plain = ["sh", "-c", "x" * 100_000]
    check_trampoline_exec(plain, exec_line("/bin/sh", plain), {})
