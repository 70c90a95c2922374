"""What a lost unit left: its cgroup, trusted only where its manager makes
the unit's, and every process in it or below it given the stop-timer
signal, then SIGKILL (sdexec/orphans.py). Real processes, and a stand-in
for /proc and /sys/fs/cgroup that says where they are."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from twisted.internet.task import Clock

from sdexec import orphans
from sdexec.drain import AdminCause
from sdexec.orphans import (
    GRACE_S,
    LostUnitKill,
    expected_unit_cgroup,
    lost_unit_reason,
    signal_cgroup,
    unit_cgroup,
)
from sdexec.procfs import process_cgroups

UNIT = "sdexec-lost.service"
MANAGER = "/user.slice/user-0.slice/user@0.service"
CGROUP = f"{MANAGER}/app.slice/{UNIT}"
HYBRID = f"1:name=systemd:{CGROUP}\n0::{CGROUP}"
#: A program that ignores SIGUSR1, and says so once it does.
DEAF = "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN);"
DEAF += " print(flush=True); time.sleep(300)"


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

    def start(deaf: bool = False) -> subprocess.Popen:
        if deaf:
            process = subprocess.Popen(
                [sys.executable, "-c", DEAF], stdout=subprocess.PIPE
            )
            assert process.stdout is not None
            process.stdout.readline()  # SIGUSR1 ignored from here on
        else:
            process = subprocess.Popen(["sleep", "300"])
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


# -- where the unit's cgroup is ------------------------------------------------


@pytest.mark.parametrize(
    "lines",
    [f"0::{CGROUP}", HYBRID, f"3:memory:/user.slice\n1:name=systemd:{CGROUP}"],
    ids=["v2", "hybrid", "v1"],
)
def test_the_main_process_s_cgroup_is_the_unit_s(tmp_path, processes, lines):
    main = processes()
    place(tmp_path, main.pid, lines)
    assert unit_cgroup(UNIT, main.pid, MANAGER, root=str(tmp_path)) == CGROUP


@pytest.mark.parametrize(
    ("path", "found"),
    [
        # DelegateSubgroup, or a delegated job that moved its main process:
        # the unit's own group is found above it.
        (f"{CGROUP}/supervisor", CGROUP),
        # Nested slices, as systemd names their directories.
        (f"{MANAGER}/a.slice/a-b.slice/{UNIT}", f"{MANAGER}/a.slice/a-b.slice/{UNIT}"),
        # A name the kernel would take for its own, escaped by systemd.
        (f"{MANAGER}/app.slice/_{UNIT}", f"{MANAGER}/app.slice/_{UNIT}"),
        # A cgroup named like the unit below another unit (a user's own, in
        # their delegated tree): not where the manager makes the unit's.
        (f"{MANAGER}/app.slice/other.service/{UNIT}", None),
        (f"/user.slice/user-1000.slice/user@1000.service/app.slice/{UNIT}", None),
        # Another manager's (whose cgroup merely begins like this one's).
        (f"{MANAGER}x/app.slice/{UNIT}", None),
        (f"{MANAGER}/app.slice/{UNIT}x", None),
    ],
    ids=["subgroup", "nested", "escaped", "below-a-unit", "elsewhere", "prefix",
         "longer-name"],
)  # fmt: skip
def test_the_unit_s_cgroup_is_trusted_only_where_its_manager_makes_it(
    tmp_path, processes, path, found
):
    main = processes()
    place(tmp_path, main.pid, f"0::{path}")
    assert unit_cgroup(UNIT, main.pid, MANAGER, root=str(tmp_path)) == found


def test_a_system_manager_s_units_are_found_below_the_root(tmp_path, processes):
    main = processes()
    place(tmp_path, main.pid, f"0::/system.slice/{UNIT}")
    assert (
        unit_cgroup(UNIT, main.pid, "/", root=str(tmp_path)) == f"/system.slice/{UNIT}"
    )
    assert (
        unit_cgroup(UNIT, main.pid, "", root=str(tmp_path)) == f"/system.slice/{UNIT}"
    )


def test_no_cgroup_without_the_manager_s_or_the_process(tmp_path, processes):
    main = processes()
    place(tmp_path, main.pid, f"0::{CGROUP}")
    assert unit_cgroup(UNIT, main.pid, None, root=str(tmp_path)) is None
    assert unit_cgroup(UNIT, 2**22 + 1, MANAGER, root=str(tmp_path)) is None
    # Its own /proc, read for real: this test's process is in no such unit.
    assert unit_cgroup(UNIT, main.pid, MANAGER) is None


def test_a_cgroup_name_cannot_forge_a_line(tmp_path, processes):
    # A user's cgroup may be named with any bytes but "/" and newline: not
    # UTF-8, or holding a form feed that str.splitlines would split on.
    main = processes()
    path = tmp_path / f"proc/{main.pid}/cgroup"
    path.parent.mkdir(parents=True)
    path.write_bytes(f"0::/user.slice/\xff/x\x0c0::{CGROUP}\n".encode("latin-1"))
    assert unit_cgroup(UNIT, main.pid, MANAGER, root=str(tmp_path)) is None
    [(_, read)] = process_cgroups(main.pid, str(tmp_path))
    assert read.endswith(CGROUP) and read != CGROUP


# -- signalling what is there --------------------------------------------------


@pytest.mark.parametrize(
    "bases",
    [["sys/fs/cgroup"], ["sys/fs/cgroup/unified", "sys/fs/cgroup/systemd"],
     ["sys/fs/cgroup/systemd"]],
    ids=["v2", "hybrid", "v1"],
)  # fmt: skip
def test_every_process_in_the_cgroup_or_below_is_killed(tmp_path, processes, bases):
    main, child, below, moved = processes(), processes(), processes(), processes()
    for process in (main, child):
        place(tmp_path, process.pid, HYBRID)
    place(tmp_path, below.pid, f"0::{CGROUP}/task-0")
    # Listed, but in another cgroup by the time it is checked: untouched.
    place(tmp_path, moved.pid, "0::/user.slice/other.service")
    for base in bases:
        members(tmp_path, base, [main.pid, child.pid, moved.pid])
        members(tmp_path, base, [below.pid], f"{CGROUP}/task-0")
    done = signal_cgroup(CGROUP, signal.SIGKILL, root=str(tmp_path))
    assert done.sent == {main.pid, child.pid, below.pid}
    assert main.wait(timeout=30) == child.wait(timeout=30) == below.wait(30) == -9
    assert moved.poll() is None


def test_without_pidfds_what_is_in_the_cgroup_is_killed_by_pid(
    tmp_path, processes, monkeypatch
):
    # A kernel before 5.3, or no descriptor left: was taken for "gone" and
    # left running.
    def no_pidfds(pid):
        raise OSError(errno.ENOSYS, "no pidfd_open")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    main, moved = processes(), processes()
    place(tmp_path, main.pid, f"0::{CGROUP}")
    place(tmp_path, moved.pid, "0::/user.slice/other.service")
    members(tmp_path, "sys/fs/cgroup", [main.pid, moved.pid])
    done = signal_cgroup(CGROUP, signal.SIGKILL, root=str(tmp_path))
    assert done.sent == {main.pid}
    assert main.wait(timeout=30) == -9
    assert moved.poll() is None


def test_a_pidfd_the_kernel_will_not_signal_through_falls_back_to_the_pid(
    tmp_path, processes, monkeypatch
):
    # A seccomp filter that allows pidfd_open and not pidfd_send_signal: the
    # process was taken for gone and left running (review session 31 D F10).
    def refused(pidfd, signum):
        raise OSError(errno.ENOSYS, "no pidfd_send_signal")

    monkeypatch.setattr(signal, "pidfd_send_signal", refused)
    main = processes()
    place(tmp_path, main.pid, f"0::{CGROUP}")
    members(tmp_path, "sys/fs/cgroup", [main.pid])
    done = signal_cgroup(CGROUP, signal.SIGKILL, root=str(tmp_path))
    assert done.sent == {main.pid}
    assert main.wait(timeout=30) == -9


def test_what_forks_while_the_group_is_read_is_killed_too(
    tmp_path, processes, monkeypatch
):
    first, forked = processes(), processes()
    for process in (first, forked):
        place(tmp_path, process.pid, f"0::{CGROUP}")
    members(tmp_path, "sys/fs/cgroup", [first.pid])
    send = signal.pidfd_send_signal

    def forks_as_it_dies(pidfd, signum):
        send(pidfd, signum)
        members(tmp_path, "sys/fs/cgroup", [first.pid, forked.pid])

    monkeypatch.setattr(signal, "pidfd_send_signal", forks_as_it_dies)
    done = signal_cgroup(CGROUP, signal.SIGKILL, root=str(tmp_path))
    assert done.sent == {first.pid, forked.pid}


def test_one_that_may_not_be_signalled_is_told_and_spares_no_other(
    tmp_path, processes, monkeypatch
):
    guest, child = processes(), processes()
    for process in (guest, child):
        place(tmp_path, process.pid, f"0::{CGROUP}")
    members(tmp_path, "sys/fs/cgroup", [guest.pid, child.pid])
    send = signal.pidfd_send_signal
    refused: list[int] = []

    def once_refused(pidfd, signum):
        if not refused:
            refused.append(pidfd)
            raise PermissionError(errno.EPERM, "Operation not permitted")
        send(pidfd, signum)

    monkeypatch.setattr(signal, "pidfd_send_signal", once_refused)
    done = signal_cgroup(CGROUP, signal.SIGKILL, root=str(tmp_path))
    assert done.refused == {guest.pid} and done.sent == {child.pid}
    assert child.wait(timeout=30) == -9


def test_a_deep_delegated_tree_is_walked_without_recursion(tmp_path, processes):
    deep = processes()
    path = CGROUP + "/d" * 1100  # deeper than Python's recursion limit
    place(tmp_path, deep.pid, f"0::{path}")
    # pathlib, os.makedirs and shutil.rmtree recurse: one level at a time.
    top = str(tmp_path / "sys/fs/cgroup")
    made = [top]
    os.makedirs(top)
    for part in path.split("/")[1:]:
        made.append(os.path.join(made[-1], part))
        os.mkdir(made[-1])
    procs = os.path.join(made[-1], "cgroup.procs")
    Path(procs).write_text(f"{deep.pid}\n")
    try:
        done = signal_cgroup(CGROUP, signal.SIGKILL, root=str(tmp_path))
        assert done.sent == {deep.pid}
    finally:
        os.unlink(procs)
        for directory in reversed(made):
            os.rmdir(directory)


def test_a_cgroup_gone_meanwhile_signals_nothing(tmp_path):
    assert signal_cgroup(CGROUP, signal.SIGKILL, root=str(tmp_path)).sent == set()


# -- the sequence --------------------------------------------------------------


def test_the_stop_timer_signal_comes_first_then_sigkill(
    tmp_path, processes, monkeypatch
):
    # Under Flux's IMP the stop-timer signal is its proxy for SIGKILL: it
    # ends what its user owns, which the service may not signal; SIGKILL
    # at once would end the IMP first.
    deaf = processes(deaf=True)
    place(tmp_path, deaf.pid, f"0::{CGROUP}")
    members(tmp_path, "sys/fs/cgroup", [deaf.pid])
    sent: list[int] = []
    send = signal.pidfd_send_signal

    def recorded(pidfd, signum):
        sent.append(signum)
        send(pidfd, signum)

    monkeypatch.setattr(signal, "pidfd_send_signal", recorded)
    clock, drains = Clock(), []
    kill = LostUnitKill(
        UNIT, CGROUP, signal.SIGUSR1, clock, lambda *drain: drains.append(drain), set()
    )
    kill_root(kill, tmp_path).start()
    assert sent == [signal.SIGUSR1]
    assert deaf.poll() is None  # it ignores it
    clock.advance(GRACE_S)
    assert sent == [signal.SIGUSR1, signal.SIGKILL]
    assert deaf.wait(timeout=30) == -9
    assert drains == []


def test_what_may_not_be_signalled_drains_the_node(tmp_path, processes, monkeypatch):
    guest = processes()
    place(tmp_path, guest.pid, f"0::{CGROUP}")
    members(tmp_path, "sys/fs/cgroup", [guest.pid])

    def refused(pidfd, signum):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(signal, "pidfd_send_signal", refused)
    clock, drains = Clock(), []
    kill = LostUnitKill(
        UNIT, CGROUP, signal.SIGUSR1, clock, lambda *drain: drains.append(drain), set()
    )
    kill_root(kill, tmp_path).start()
    clock.advance(GRACE_S)
    assert drains == [(lost_unit_reason(UNIT), AdminCause.LOST_UNIT)]
    assert lost_unit_reason(UNIT) == (
        f"unkillable user processes left by lost unit {UNIT}"
    )


def test_nothing_there_arms_nothing(tmp_path):
    clock = Clock()
    kill_root(LostUnitKill(UNIT, CGROUP, signal.SIGUSR1, clock, print, set()),
              tmp_path).start()  # fmt: skip
    assert clock.getDelayedCalls() == []


def kill_root(kill: LostUnitKill, root: Path) -> LostUnitKill:
    """``kill`` reading the stand-in tree at ``root``."""
    kill._root = str(root)
    return kill


def test_the_module_names_what_it_offers():
    assert set(orphans.__all__) >= {"unit_cgroup", "signal_cgroup", "LostUnitKill"}


@pytest.mark.parametrize(
    ("manager", "slice_name", "unit", "path"),
    [
        (MANAGER, "app.slice", UNIT, CGROUP),
        ("/", "system.slice", UNIT, f"/system.slice/{UNIT}"),
        ("", "a-b-c.slice", UNIT, f"/a.slice/a-b.slice/a-b-c.slice/{UNIT}"),
        (MANAGER, "-.slice", UNIT, f"{MANAGER}/{UNIT}"),
        (MANAGER, "app.slice", "cpu.service", f"{MANAGER}/app.slice/_cpu.service"),
        (MANAGER, "app.slice", "_x.service", f"{MANAGER}/app.slice/__x.service"),
        (
            MANAGER,
            "app.slice",
            "cpu.job.service",
            f"{MANAGER}/app.slice/_cpu.job.service",
        ),
        (MANAGER, "app.slice", "cpus.service", f"{MANAGER}/app.slice/cpus.service"),
        (MANAGER, "cpu-x.slice", UNIT, f"{MANAGER}/_cpu.slice/cpu-x.slice/{UNIT}"),
        (None, "app.slice", UNIT, None),
        (MANAGER, "", UNIT, None),
        (MANAGER, None, UNIT, None),
    ],
)
def test_where_a_manager_makes_a_unit_s_cgroup(manager, slice_name, unit, path):
    # For a unit whose main process was gone before its cgroup was read:
    # the new manager loads the unit's slice from the same file.
    assert expected_unit_cgroup(manager, slice_name, unit) == path


@pytest.mark.parametrize(
    ("unit", "escaped"),
    [
        ("cpu.service", "_cpu.service"),
        ("cpu.job.service", "cpu.job.service"),
        ("memory.x.y.service", "memory.x.y.service"),
        ("_x.service", "__x.service"),
    ],
)
def test_a_manager_before_254_escapes_only_a_controller_before_the_last_dot(
    unit, escaped
):
    # As systemd 252 names them (test_systemd.py checks the manager at hand).
    path = expected_unit_cgroup(MANAGER, "app.slice", unit, 253)
    assert path == f"{MANAGER}/app.slice/{escaped}"


@pytest.mark.parametrize(
    ("made", "version"),
    [
        ("cpu.job.service", 254),  # by 252, before an upgrade to 254
        ("_cpu.job.service", 252),  # by 254, and the package downgraded
        ("_cpuset.service", 243),  # 243 had no cpuset controller to escape
        ("cpu.x.slice/job.service", 254),  # a slice of an admin's, by 252
    ],
)
def test_a_lost_unit_s_cgroup_is_found_as_the_manager_that_made_it_spelt_it(
    tmp_path, made, version
):
    # The manager now is not the one that made it (review session 31 A F1).
    if "/" not in made:
        made = f"app.slice/{made}"
    slice_name, unit = made.split("/")
    cgroup = f"{MANAGER}/{made}"
    os.makedirs(tmp_path / "sys/fs/cgroup" / cgroup.lstrip("/"))
    name = unit.removeprefix("_")
    root = str(tmp_path)
    assert expected_unit_cgroup(MANAGER, slice_name, name, version, root) == cgroup


def test_a_service_that_stops_sends_the_sigkill_still_to_come(tmp_path, processes):
    # Its timer would never fire: what ignored the stop-timer signal ran on.
    deaf = processes(deaf=True)
    place(tmp_path, deaf.pid, f"0::{CGROUP}")
    members(tmp_path, "sys/fs/cgroup", [deaf.pid])
    clock, pending = Clock(), set()
    kill = LostUnitKill(UNIT, CGROUP, signal.SIGUSR1, clock, print, pending)
    kill_root(kill, tmp_path).start()
    assert kill.pending and pending == {kill}  # the service's to finish
    kill.finish()
    assert deaf.wait(timeout=30) == -9
    assert not kill.pending and clock.getDelayedCalls() == []
    assert pending == set()
    kill.finish()  # done: nothing more
