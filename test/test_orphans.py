"""The processes a lost unit left: found through the cgroup its main
process sat in when the unit started, and only those still in it (or below
it) signalled (sdexec/orphans.py). Real processes, and a stand-in for /proc
and /sys/fs/cgroup that says where they are."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from sdexec.orphans import kill_lost_unit, unit_cgroups

UNIT = "sdexec-lost.service"
CGROUP = f"/user.slice/user@0.service/app.slice/{UNIT}"
HYBRID = f"1:name=systemd:{CGROUP}\n0::{CGROUP}"


def place(root: Path, pid: int, lines: str) -> None:
    """Say, in the stand-in /proc, that ``pid``'s cgroups are ``lines``."""
    (root / f"proc/{pid}").mkdir(parents=True, exist_ok=True)
    (root / f"proc/{pid}/cgroup").write_text(f"{lines}\n")


def members(root: Path, base: str, pids: list[int], cgroup: str = CGROUP) -> None:
    procs = root / base / cgroup.lstrip("/") / "cgroup.procs"
    procs.parent.mkdir(parents=True, exist_ok=True)
    procs.write_text("".join(f"{pid}\n" for pid in pids))


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield lambda: started.append(subprocess.Popen(["sleep", "300"])) or started[-1]
    for process in started:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("line", "base"),
    [(f"0::{CGROUP}", "sys/fs/cgroup"),
     (f"0::{CGROUP}", "sys/fs/cgroup/unified"),
     (f"1:name=systemd:{CGROUP}", "sys/fs/cgroup/systemd")],
    ids=["v2", "hybrid", "v1"],
)  # fmt: skip
def test_every_process_left_in_the_unit_s_cgroup_is_killed(
    tmp_path, processes, line, base
):
    main, child, moved = processes(), processes(), processes()
    for process in (main, child):
        place(tmp_path, process.pid, line)
    cgroups = unit_cgroups(UNIT, main.pid, root=str(tmp_path))
    # Listed, but in another cgroup by the time it is checked: untouched.
    place(tmp_path, moved.pid, "0::/user.slice/other.service")
    members(tmp_path, base, [main.pid, child.pid, moved.pid])
    assert kill_lost_unit(cgroups, root=str(tmp_path)) == 2
    assert main.wait(timeout=30) == child.wait(timeout=30) == -9
    assert moved.poll() is None


def test_what_an_exited_main_process_left_is_killed(tmp_path, processes):
    # The job shell exited while systemd was away; its children live on
    # in the unit's cgroup, in groups of their own below it (Delegate).
    main = processes()
    place(tmp_path, main.pid, HYBRID)
    cgroups = unit_cgroups(UNIT, main.pid, root=str(tmp_path))
    main.kill()
    main.wait()
    child, grandchild = processes(), processes()
    place(tmp_path, child.pid, HYBRID)
    below = f"{CGROUP}/task-0"
    place(tmp_path, grandchild.pid, f"1:name=systemd:{below}\n0::{below}")
    for base in ("sys/fs/cgroup/unified", "sys/fs/cgroup/systemd"):
        members(tmp_path, base, [child.pid])
        members(tmp_path, base, [grandchild.pid], below)
    assert kill_lost_unit(cgroups, root=str(tmp_path)) == 2
    assert child.wait(timeout=30) == grandchild.wait(timeout=30) == -9


def test_the_cgroups_noted_are_the_unit_s_own(tmp_path, processes):
    main = processes()
    place(tmp_path, main.pid, f"12:memory:/user.slice\n{HYBRID}")
    assert unit_cgroups(UNIT, main.pid, root=str(tmp_path)) == (
        ("name=systemd", CGROUP),
        ("", CGROUP),
    )
    # Its own /proc, read for real: this test's process is in no such unit.
    assert unit_cgroups(UNIT, main.pid) == ()


@pytest.mark.parametrize(
    "line",
    # A request may name its unit user@1000.service: a process below a
    # cgroup of that name is not the unit's main process.
    [f"0::{CGROUP}/app.slice/pipewire.service",
     # The pid was another program's by the time the unit started.
     "0::/user.slice/somebody-else.service"],
    ids=["below-a-namesake", "another-unit"],
)  # fmt: skip
def test_a_main_pid_outside_the_unit_s_cgroup_notes_none(tmp_path, processes, line):
    other = processes()
    place(tmp_path, other.pid, line)
    assert unit_cgroups(UNIT, other.pid, root=str(tmp_path)) == ()
    assert kill_lost_unit((), root=str(tmp_path)) == 0


def test_a_main_process_gone_at_start_notes_none(tmp_path):
    assert unit_cgroups(UNIT, 2**22 + 1, root=str(tmp_path)) == ()


def test_a_cgroup_gone_meanwhile_kills_nothing(tmp_path):
    assert kill_lost_unit((("", CGROUP),), root=str(tmp_path)) == 0


def test_one_that_may_not_be_signalled_does_not_spare_the_rest(
    tmp_path, processes, monkeypatch
):
    main, child = processes(), processes()
    for process in (main, child):
        place(tmp_path, process.pid, f"0::{CGROUP}")
    members(tmp_path, "sys/fs/cgroup", [main.pid, child.pid])
    send = signal.pidfd_send_signal
    refused: list[int] = []

    def once_refused(pidfd, signum):
        if not refused:
            refused.append(pidfd)
            raise PermissionError(1, "Operation not permitted")
        send(pidfd, signum)

    monkeypatch.setattr(signal, "pidfd_send_signal", once_refused)
    assert kill_lost_unit((("", CGROUP),), root=str(tmp_path)) == 1
    assert child.wait(timeout=30) == -9
