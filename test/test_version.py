"""Every command's ``--version`` is the installed distribution's version."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_metadata_is_pyprojects_version():
    # The editable install's metadata is what --version reads: a stale
    # install would report an old version, so tie the two together here.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert version("sdexec") == project["version"]


@pytest.mark.parametrize(
    ("module", "prog"),
    [
        ("sdexec.cli", "sdexec"),
        ("sdexec.config", "python3 -m sdexec.config"),
        ("sdexec.map", "python3 -m sdexec.map"),
    ],
)
def test_version(module, prog):
    shown = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == f"{prog} {version('sdexec')}\n"
