"""The generated man pages and shell completions: current with their
sources, rendering cleanly, and completing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _gen_docs():
    spec = importlib.util.spec_from_file_location(
        "gen_docs", REPO / "scripts" / "gen_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_current():
    assert _gen_docs().stale() == [], "run scripts/gen_docs.py"


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("man1/sdexec.1", ["sdexec [-h] [--version] [--socket PATH] COMMAND",
                           "EXIT STATUS", "sdexec.toml(5)"]),
        ("man5/sdexec.toml.5", ["kill-timeout", "containment-check", "log-format",
                                "Effective max-kill-timeout", "sdexec(1)"]),
    ],
)  # fmt: skip
def test_man_pages_render_without_warnings(page, expected):
    rendered = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", str(REPO / "share" / "man" / page)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "GROFF_NO_SGR": "1"},
    )  # fmt: skip
    assert (rendered.returncode, rendered.stderr) == (0, "")
    text = subprocess.run(["col", "-b"], input=rendered.stdout, capture_output=True,
                          text=True, timeout=60).stdout  # fmt: skip
    for phrase in expected:
        assert phrase in text


def _bash_complete(*words: str) -> list[str]:
    script = (
        f"source {REPO}/share/bash-completion/completions/sdexec\n"
        'COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; '
        "COMP_POINT=${#COMP_LINE}\n"
        '_shtab_sdexec sdexec "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(["bash", "-c", script, "bash", *words],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_bash_completes_commands_and_options():
    assert {"run", "ps", "kill", "cancel", "stats", "undrain"} <= set(
        _bash_complete("sdexec", "")
    )
    assert _bash_complete("sdexec", "un") == ["undrain"]
    assert "--noinput" in _bash_complete("sdexec", "run", "--")


def test_bash_offers_no_run_option_after_the_command_word():
    # They would go to the command: `sdexec run ls --dir` lists a "--dir".
    assert _bash_complete("sdexec", "run", "ls", "-") == []
    assert _bash_complete("sdexec", "run", "-n", "ls", "--d") == []
    assert "--label" in _bash_complete("sdexec", "run", "--dir", "/tmp", "--")


def test_zsh_completion_covers_every_command():
    text = (REPO / "share" / "zsh" / "site-functions" / "_sdexec").read_text()
    assert text.startswith("#compdef sdexec\n")
    commands = ("run", "ps", "kill", "cancel", "stats", "undrain", "wait", "attach")
    for command in commands:
        assert f"    {command}:'" in text  # the command list
        assert f"        {command}) _arguments" in text  # its options
