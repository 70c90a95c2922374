"""The processes a lost unit left: found through the main process's cgroup,
and only those still in it signalled (sdexec/orphans.py). Real processes,
and a stand-in for /proc and /sys/fs/cgroup that says where they are."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from sdexec.orphans import kill_lost_unit
from sdexec.procfs import start_time

UNIT = "sdexec-lost.service"
CGROUP = f"/user.slice/user@0.service/app.slice/{UNIT}"


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "300"])


#: When the stand-in /proc says each process started.
STARTED = 4711


def place(root: Path, pid: int, line: str, started: int = STARTED) -> None:
    """Say, in the stand-in /proc, that ``pid``'s cgroup is ``line``, and
    that it started at ``started`` (the 22nd field of its stat)."""
    (root / f"proc/{pid}").mkdir(parents=True, exist_ok=True)
    (root / f"proc/{pid}/cgroup").write_text(f"{line}\n")
    fields = ["S", *["0"] * 18, str(started), *["0"] * 30]
    (root / f"proc/{pid}/stat").write_text(f"{pid} (sleep) {' '.join(fields)}\n")


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
    assert kill_lost_unit(UNIT, main.pid, STARTED, root=str(tmp_path)) == 2
    assert main.wait(timeout=30) == child.wait(timeout=30) == -9
    assert moved.poll() is None


def test_a_main_pid_that_is_another_process_now_kills_nothing(tmp_path, processes):
    # The main process exited while systemd was away, and the kernel gave
    # its pid to another program: the cgroup it is read from is not the
    # unit's, whatever it is named.
    reused = processes()
    place(tmp_path, reused.pid, f"0::{CGROUP}", started=STARTED + 1)
    members(tmp_path, "sys/fs/cgroup", [reused.pid])
    assert kill_lost_unit(UNIT, reused.pid, STARTED, root=str(tmp_path)) == 0
    assert reused.poll() is None


def test_the_start_time_is_the_kernel_s(processes):
    process = processes()
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    assert start_time(process.pid) == int(stat.rsplit(")", 1)[1].split()[19])
    assert start_time(2**22 + 1) is None


def test_only_the_unit_s_own_cgroup_counts(tmp_path, processes):
    # A request may name its unit user@1000.service: a reused pid in a
    # cgroup below one of that name is not the unit's.
    other = processes()
    place(tmp_path, other.pid, f"0::{CGROUP}/app.slice/pipewire.service")
    members(tmp_path, "sys/fs/cgroup", [other.pid])
    assert kill_lost_unit(UNIT, other.pid, STARTED, root=str(tmp_path)) == 0
    assert other.poll() is None


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
    assert kill_lost_unit(UNIT, main.pid, STARTED, root=str(tmp_path)) == 1
    assert child.wait(timeout=30) == -9


def test_a_main_process_not_in_the_unit_s_cgroup_kills_nothing(tmp_path, processes):
    # Its pid given to another program, or one of another pid namespace.
    other = processes()
    place(tmp_path, other.pid, "0::/user.slice/somebody-else.service")
    members(tmp_path, "sys/fs/cgroup", [other.pid])
    assert kill_lost_unit(UNIT, other.pid, STARTED, root=str(tmp_path)) == 0
    assert other.poll() is None


def test_a_main_process_gone_kills_nothing(tmp_path):
    assert (
        kill_lost_unit(UNIT, 2**22 + 1, STARTED, root=str(tmp_path)) == 0
    )  # no such pid
