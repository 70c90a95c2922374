"""The service's open-file limit (sdexec.fdlimit), in a child process whose
limits the test sets: the test runner's own stay as they are."""

from __future__ import annotations

import resource
import subprocess
import sys

RAISE_AND_REPORT = (
    "import resource; from sdexec.fdlimit import raise_open_file_limit;"
    " print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))"
)


def _run_with_open_files(soft: int, hard: int) -> str:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    ran = subprocess.run(
        [sys.executable, "-c", RAISE_AND_REPORT],
        preexec_fn=limit, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return ran.stdout.strip()


def test_the_soft_limit_rises_to_the_hard_one():
    assert _run_with_open_files(100, 2000) == "(100, 2000) (2000, 2000)"


def test_at_the_hard_limit_already_nothing_changes():
    assert _run_with_open_files(2000, 2000) == "None (2000, 2000)"
