"""The processes a lost unit left: found through the main process's cgroup,
and only those still in it signalled (sdexec/orphans.py). Real processes,
and a stand-in for /proc and /sys/fs/cgroup that says where they are."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sdexec.orphans import kill_lost_unit

UNIT = "sdexec-lost.service"
CGROUP = f"/user.slice/user@0.service/app.slice/{UNIT}"


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "300"])


def place(root: Path, pid: int, line: str) -> None:
    """Say, in the stand-in /proc, that ``pid``'s cgroup is ``line``."""
    (root / f"proc/{pid}").mkdir(parents=True, exist_ok=True)
    (root / f"proc/{pid}/cgroup").write_text(f"{line}\n")


def members(root: Path, base: str, pids: list[int]) -> None:
    procs = root / base / CGROUP.lstrip("/") / "cgroup.procs"
    procs.parent.mkdir(parents=True, exist_ok=True)
    procs.write_text("".join(f"{pid}\n" for pid in pids))


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield lambda: started.append(sleeper()) or started[-1]
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
    # Listed, but in another cgroup by the time it is checked: untouched.
    place(tmp_path, moved.pid, "0::/user.slice/other.service")
    members(tmp_path, base, [main.pid, child.pid, moved.pid])
    assert kill_lost_unit(UNIT, main.pid, root=str(tmp_path)) == 2
    assert main.wait(timeout=30) == child.wait(timeout=30) == -9
    assert moved.poll() is None


def test_a_main_process_not_in_the_unit_s_cgroup_kills_nothing(tmp_path, processes):
    # Its pid given to another program, or one of another pid namespace.
    other = processes()
    place(tmp_path, other.pid, "0::/user.slice/somebody-else.service")
    members(tmp_path, "sys/fs/cgroup", [other.pid])
    assert kill_lost_unit(UNIT, other.pid, root=str(tmp_path)) == 0
    assert other.poll() is None


def test_a_main_process_gone_kills_nothing(tmp_path):
    assert kill_lost_unit(UNIT, 2**22 + 1, root=str(tmp_path)) == 0  # no such pid
