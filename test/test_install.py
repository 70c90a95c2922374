"""scripts/install brings every program the tests run: the README's
``./scripts/install && python3 -m pytest`` is to pass on a fresh Debian 12,
a container's included, which has Debian's Essential packages and little
more (no curl, no col). Read from the sources, offline."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Each program the tests start themselves (a literal argv[0]) and the
#: package of scripts/install's list that brings it; ``None`` for those of
#: Debian's Essential packages, which every Debian 12 has.
TEST_PROGRAMS = {
    "bash": None,
    "sh": None,
    "sleep": None,
    "true": None,
    "unshare": None,  # util-linux, Essential: test_node_check's namespace
    "col": "bsdextrautils",  # test_docs: the rendered man pages
    "curl": "curl",  # test_sockets: the stats site on its UNIX socket
    "git": "git",  # test_node_check: a kit prepared from a worktree
    "groff": "groff-base",
    "lstopo-no-graphics": "hwloc-nox",
    "hwloc-calc": "hwloc-nox",
    "systemctl": "systemd",
    "systemd-run": "systemd",
    "systemd-analyze": "systemd",
    "busctl": "systemd",
    "dbus-daemon": "dbus-user-session",
}

#: A subprocess function given an argv list whose first item is a literal
#: (directly, or through ``deferToThread``).
_STARTED = re.compile(
    r'subprocess\.(?:run|Popen|check_call|check_output)\b[\s(,]*\[\s*"([\w.-]+)"'
)


def programs_the_tests_run() -> dict[str, set[str]]:
    """Each program the tests start, and the files that start it."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "test").glob("*.py"):
        for program in _STARTED.findall(path.read_text()):
            found.setdefault(program, set()).add(path.name)
    return found


def install_packages() -> set[str]:
    """The Debian packages scripts/install installs (pip's aside)."""
    text = (REPO / "scripts" / "install").read_text()
    (listed,) = re.findall(r"^debs=\(([^)]*)\)", text, re.MULTILINE)
    return set(listed.split())


def test_the_program_scan_finds_the_tests_programs():
    assert {"curl", "col", "systemctl"} <= set(programs_the_tests_run())


def test_scripts_install_brings_every_program_the_tests_run():
    run = programs_the_tests_run()
    unknown = {program: files for program, files in run.items()
               if program not in TEST_PROGRAMS}  # fmt: skip
    assert unknown == {}, "add each to TEST_PROGRAMS, with the package that has it"
    missing = {
        program: TEST_PROGRAMS[program]
        for program in run
        if TEST_PROGRAMS[program] not in (None, *install_packages())
    }
    assert missing == {}
