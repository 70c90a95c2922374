"""The unit state model: wait statuses and UnitStatus over observed states.

The state sequences below are what the merged ``Unit`` + ``Service`` state of
a watch went through with systemd 252 (``Type=exec``, ``RemainAfterExit=yes``)
in ``test_systemd.py``; ``PropertiesChanged`` comes per interface, so some
snapshots mix a new exit status with an old ``ActiveState``.
"""

from __future__ import annotations

import errno
import os
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdexec.property import UnitProperty
from sdexec.systemd.unit import (
    CLD_DUMPED,
    CLD_EXITED,
    CLD_KILLED,
    EXEC_NEEDS_FILES,
    SYSTEMD_EXIT_CODES,
    UnitStatus,
    wait_status,
)

PID = 4242

# Each snapshot: (ActiveState, SubState, ExecMainCode, ExecMainStatus, Result)
# and the flags expected of it, in FLAGS order.
FLAGS = ("has_started", "has_finished", "has_failed", "needs_stop", "needs_reset")
STARTING = (("activating", "start", 0, 0, "success"), (0, 0, 0, 0, 0))
SEQUENCES = {
    "echo: exits 0 before running is ever seen": [
        STARTING,
        (("activating", "start", CLD_EXITED, 0, "success"), (1, 1, 0, 0, 0)),
        (("active", "exited", CLD_EXITED, 0, "success"), (1, 1, 0, 1, 0)),
    ],
    "exit 3: failed with the command's status": [
        STARTING,
        (("active", "running", 0, 0, "success"), (1, 0, 0, 0, 0)),
        (("active", "running", CLD_EXITED, 3, "exit-code"), (1, 1, 0, 0, 0)),
        (("failed", "failed", CLD_EXITED, 3, "exit-code"), (1, 1, 0, 0, 1)),
    ],
    "missing binary: systemd's 203/EXEC": [
        STARTING,
        (("activating", "start", CLD_EXITED, 203, "success"), (0, 0, 1, 0, 0)),
        (("failed", "failed", CLD_EXITED, 203, "exit-code"), (0, 0, 1, 0, 1)),
    ],
    "sleep killed with SIGTERM": [
        STARTING,
        (("active", "running", 0, 0, "success"), (1, 0, 0, 0, 0)),
        (("active", "exited", CLD_KILLED, 15, "success"), (1, 1, 0, 1, 0)),
    ],
    # No exit status: not a failure to execute until a fresh GetAll confirms
    # it (see failed_without_status and sdexec.process).
    "unit failed before forking": [
        (("failed", "failed", 0, 0, "resources"), (0, 0, 0, 0, 1)),
    ],
    "stopped and gone": [
        (("inactive", "dead", CLD_EXITED, 0, "success"), (1, 1, 0, 0, 0)),
    ],
}


def status_of(active, sub, code, status, result, pid=PID) -> UnitStatus:
    return UnitStatus.from_properties(
        {
            "ActiveState": active,
            "SubState": sub,
            "ExecMainPID": pid,
            "ExecMainCode": code,
            "ExecMainStatus": status,
            "Result": result,
        }
    )


def exited(status: int) -> UnitStatus:
    return status_of("failed", "failed", CLD_EXITED, status, "exit-code")


@pytest.mark.parametrize(
    ("snapshot", "flags"),
    [step for steps in SEQUENCES.values() for step in steps],
    ids=[f"{seq}/{i}" for seq, steps in SEQUENCES.items() for i in range(len(steps))],
)
def test_observed_states_are_classified(snapshot, flags):
    unit = status_of(*snapshot)
    assert tuple(int(getattr(unit, flag)) for flag in FLAGS) == flags


def test_failed_without_status_is_told_apart():
    assert status_of("failed", "failed", 0, 0, "resources").failed_without_status
    assert not status_of("failed", "failed", 1, 3, "exit-code").failed_without_status
    assert not status_of("active", "running", 0, 0, "success").failed_without_status


def test_started_needs_a_pid():
    assert not status_of("active", "running", 0, 0, "success", pid=0).has_started


def test_empty_state_is_nothing():
    unit = UnitStatus.from_properties({})
    assert not (unit.has_started or unit.has_finished or unit.has_failed)
    assert not (unit.is_inactive or unit.needs_stop or unit.needs_reset)


def test_inactive_and_deactivating():
    assert status_of("inactive", "dead", 0, 0, "success").is_inactive
    stopping = status_of("deactivating", "stop-sigterm", 0, 0, "success")
    assert stopping.is_deactivating
    assert not stopping.is_inactive


@pytest.mark.parametrize("status", [0, 1, 127, 199, 223, 234, 244, 254, 255])
def test_statuses_outside_systemd_s_own_are_the_commands_own(status):
    # 223 and 234 too: systemd reserves them and never exits with them,
    # where a C program's `return -EINVAL` from main gives 234.
    unit = exited(status)
    assert unit.has_finished and not unit.has_failed
    assert unit.wait_status == status << 8


@pytest.mark.parametrize("status", [200, 203, 204, 222, 224, 233, 235, 242, 243])
def test_statuses_200_to_243_are_systemd_failures(status):
    unit = exited(status)
    assert unit.has_failed and not unit.has_finished and not unit.has_started


@pytest.mark.parametrize(
    ("status", "errnum", "text"),
    [
        (
            203,
            errno.ENOENT,
            "exit status 203/EXEC (result: exit-code): cannot execute /opt/x"
            " (the manager's log says why: a missing #! interpreter, a binary"
            " for another machine...; or the command itself exited 203 at once)",
        ),
        (
            200,
            errno.ENOENT,
            "exit status 200/CHDIR (result: exit-code): cannot enter /w (or the"
            " command itself exited 200 at once: systemd tells the two apart in"
            " no way)",
        ),
        (204, errno.ENOENT, "exit status 204/MEMORY (result: exit-code)"),
        (217, errno.ENOENT, "exit status 217/USER (result: exit-code)"),
        (226, errno.ENOENT, "exit status 226/NAMESPACE (result: exit-code)"),
        (243, errno.ENOENT, "exit status 243/CREDENTIALS (result: exit-code)"),
    ],
)
def test_failure_names_systemds_exit_code(status, errnum, text):
    # And, for the two a client can act on, what systemd was given. Every
    # code is ENOENT, as Flux's sdexec answers them: never EIO, which its
    # job-exec reads as a failed containment check and drains the node for.
    failure_errno, message = exited(status).failure("/opt/x", "/w")
    assert failure_errno == errnum
    assert message == f"systemd could not run the command: {text}"


@pytest.mark.parametrize(
    ("status", "files", "text"),
    [
        (
            203,
            UnitProperty("LimitNOFILE", "t", 3, "config"),
            "exit status 203/EXEC (result: exit-code): cannot execute /opt/x (the"
            " unit's limit of open files, LimitNOFILE=3 from"
            " [exec.sdexec-properties], is below the 5 that systemd needs to"
            " execute a command: the 3 standard streams and 2 of its own)",
        ),
        (
            202,
            UnitProperty("LimitNOFILESoft", "t", 4, "request"),
            "exit status 202/FDS (result: exit-code): the unit's limit of open"
            " files, SDEXEC_PROP_LimitNOFILESoft=4 from the request, is below the"
            " 5 that systemd needs to execute a command: the 3 standard streams"
            " and 2 of its own",
        ),
    ],
)
def test_failure_names_a_limit_of_open_files_too_low_to_execute(status, files, text):
    # With LimitNOFILE=3 systemd cannot open the executable (203/EXEC), and
    # the message sent the admin after a #! interpreter (review session 46).
    failure_errno, message = exited(status).failure("/opt/x", "/w", files)
    assert failure_errno == errno.ENOENT
    assert message == f"systemd could not run the command: {text}"


@pytest.mark.parametrize("status", [202, 203])
def test_a_limit_of_open_files_that_leaves_enough_is_not_blamed(status):
    enough = UnitProperty("LimitNOFILE", "t", EXEC_NEEDS_FILES, "config")
    _errno, message = exited(status).failure("/opt/x", "/w", enough)
    assert "LimitNOFILE" not in message
    assert message == exited(status).failure("/opt/x", "/w")[1]


@given(st.sampled_from(sorted(SYSTEMD_EXIT_CODES)))
def test_every_systemd_exit_code_is_enoent_as_upstream(status):
    # sdexec.c answers each "unit process could not be started" with ENOENT.
    assert exited(status).failure("/opt/x", "/w")[0] == errno.ENOENT


def test_a_chdir_failure_without_a_cwd_names_the_default():
    _, message = exited(200).failure("/opt/x", None)
    assert message.endswith(
        ": cannot enter its default working directory (or the command itself"
        " exited 200 at once: systemd tells the two apart in no way)"
    )


def test_failure_without_exit_status_gives_the_result():
    # ENOENT (not started), not EIO: job-exec would drain the node.
    assert status_of("failed", "failed", 0, 0, "resources").failure("/x", None) == (
        errno.ENOENT,
        "unit failed before running the command (result: resources)",
    )


def test_killed_is_not_a_failure_even_when_the_unit_failed():
    unit = status_of("failed", "failed", CLD_KILLED, 9, "signal")
    assert unit.has_finished and not unit.has_failed
    assert unit.wait_status == signal.SIGKILL


@given(st.integers(min_value=0, max_value=255))
def test_exited_wait_status(code):
    status = wait_status(CLD_EXITED, code)
    assert os.WIFEXITED(status)
    assert os.WEXITSTATUS(status) == code


@given(st.integers(min_value=1, max_value=64))
def test_killed_wait_status(signum):
    status = wait_status(CLD_KILLED, signum)
    assert os.WIFSIGNALED(status)
    assert os.WTERMSIG(status) == signum
    assert not os.WCOREDUMP(status)


@given(st.integers(min_value=1, max_value=64))
def test_dumped_wait_status(signum):
    status = wait_status(CLD_DUMPED, signum)
    assert os.WIFSIGNALED(status)
    assert os.WTERMSIG(status) == signum
    assert os.WCOREDUMP(status)


@pytest.mark.parametrize("code", [0, 4, -1])
def test_wait_status_refuses_other_codes(code):
    with pytest.raises(ValueError, match=f"ExecMainCode {code} is not CLD_EXITED"):
        wait_status(code, 0)


def test_a_namespace_failure_names_a_missing_path_of_the_request():
    missing = (UnitProperty("BindPaths", "a(ssbt)", [], "request"), "/scratch/x")
    _, message = exited(226).failure("/opt/x", "/w", missing=missing)
    assert message.endswith(
        ": SDEXEC_PROP_BindPaths from the request names /scratch/x, which does"
        " not exist on this node (a path named without '-' must exist; '-' lets"
        " systemd skip it)"
    )
    # Only for 226: another failure is not said to come of it.
    _, other = exited(217).failure("/opt/x", "/w", missing=missing)
    assert "/scratch/x" not in other


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (UnitStatus(), "?.?"),
        (UnitStatus("activating", "start", PID), f"activating.start pid {PID}"),
        (
            UnitStatus("active", "exited", PID, CLD_EXITED, 3, "exit-code"),
            f"active.exited pid {PID} exited 3, result exit-code",
        ),
        (
            UnitStatus("failed", "failed", PID, CLD_KILLED, 9, "signal"),
            f"failed.failed pid {PID} killed by signal 9, result signal",
        ),
        (
            UnitStatus("failed", "failed", PID, CLD_DUMPED, 11, "core-dump"),
            f"failed.failed pid {PID} dumped core on signal 11, result core-dump",
        ),
    ],
)
def test_a_snapshot_is_said_as_upstream_says_a_state(status, said):
    # [systemd] sdexec-debug logged UnitStatus(active_state='active', ...).
    assert status.said() == said
