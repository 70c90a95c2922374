"""A service killed with SIGKILL leaves its units running; the next run
finds them by their mark, reports them and stops them (or keeps them), and
never touches units that are not its own. Real twistd, real manager."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys

import pytest
from support import unit_names, unit_property
from test_twistd import (
    TWISTD,
    Twistd,
    _environment,
    _wait_for,
    reaped,
    units_stopped_after,
)

pytestmark = pytest.mark.systemd

COUNT = 5


def clients_with_sleepers(twistd: Twistd) -> list[subprocess.Popen]:
    """``COUNT`` ``sdexec run sleep 300``, running once this returns."""
    argv = [sys.executable, "-m", "sdexec.cli", "--socket", str(twistd.socket),
            "run", "sleep", "300"]  # fmt: skip
    clients = [
        subprocess.Popen(
            argv,
            env=_environment(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(COUNT)
    ]
    # Listed is not yet started: a process is listed (pid -1) from its
    # request on, its unit made only once StartTransientUnit is answered.
    _wait_for(
        lambda: [p["pid"] > 0 for p in twistd.stats()["procs"]] == [True] * COUNT,
        "sleepers running",
    )
    return clients


def killed_with_units_running(twistd: Twistd) -> list[str]:
    """SIGKILL the service while its sleepers run: their units remain."""
    clients = clients_with_sleepers(twistd)
    units = sorted(proc["unit"] for proc in twistd.stats()["procs"])
    twistd.process.send_signal(signal.SIGKILL)
    twistd.process.wait(timeout=60)
    for client in clients:
        client.wait(timeout=60)  # their connection is gone
    assert sorted(set(units) & set(unit_names())) == units
    return units


class Restarted(Twistd):
    """The service again, on the same socket (so with the same mark), with
    ``sdexec_lines`` added to its ``[sdexec]`` table."""

    def __init__(self, killed: Twistd, sdexec_lines: str = "") -> None:
        killed.socket.unlink(missing_ok=True)  # a SIGKILL leaves it behind
        super().__init__(killed.config.parent, sdexec_lines + "\n")


@pytest.fixture
def first_run(user_manager, tmp_path):
    """The service's first run, to be killed by the test, which ``reaped``
    cannot tell from a stop: its units, should the test fail before a
    second run stops them, are stopped at teardown."""
    with units_stopped_after():
        service = Twistd(tmp_path)
        with reaped(service.process):
            yield service


@pytest.fixture
def a_stranger(user_manager):
    """A unit of another program, with a name like sdexec's own."""
    name = "sdexec-not-ours.service"
    subprocess.run(
        ["systemd-run", "--user", "--unit", name, "--quiet", "sleep", "300"],
        check=True, timeout=60,
    )  # fmt: skip
    yield name
    subprocess.run(["systemctl", "--user", "stop", name], check=False, timeout=60)


def test_leftovers_are_found_reported_and_stopped(first_run, a_stranger):
    units = killed_with_units_running(first_run)
    second = Restarted(first_run)
    with reaped(second.process):
        _wait_for(lambda: set(unit_names()) == {a_stranger}, "leftovers stopped")
        log = second.log.read_text()
        for unit in units:
            assert f"leftover unit {unit} from a previous run" in log
        assert "draining: 5 leftover units from a previous run" in log
        _wait_for(lambda: second.stats()["drain"]["drained"] is False, "undrained")
        assert second.sdexec("run", "true").returncode == 0
        assert second.stop() == -signal.SIGTERM
    assert unit_names() == [a_stranger]


def test_kept_leftovers_are_listed_and_killable(first_run, a_stranger):
    units = killed_with_units_running(first_run)
    second = Restarted(first_run, 'leftover-units = "keep"')
    with reaped(second.process):
        # Listed at once; a leftover's pid (-1 until then) once its watch
        # has read it.
        _wait_for(
            lambda: [p["pid"] > 0 for p in second.stats()["procs"]] == [True] * COUNT,
            "leftovers listed with their pids",
        )
        procs = second.stats()["procs"]
        assert sorted(p["unit"] for p in procs) == units
        assert {p["state"] for p in procs} == {"O"}
        assert second.stats()["drain"]["drained"] is False
        listed = second.sdexec("ps").stdout.decode().splitlines()[1:]
        rows = (line.split() for line in listed)  # PID STATE MODE UNIT ...
        assert sorted((row[1], row[2], row[3]) for row in rows) == [
            ("O", "-", unit) for unit in units
        ]
        # Listed by pid, a leftover is named as one by a wait or an attach
        # of that pid (it said "no such process" alone).
        pid, unit = procs[0]["pid"], procs[0]["unit"]
        for verb in ("wait", "attach"):
            refused = second.sdexec(verb, str(pid))
            assert refused.returncode != 0
            assert (
                f"pid {pid}: not found (no such process): it is the main process of"
                f" leftover unit {unit} (state O)"
            ).encode() in refused.stderr, refused.stderr
        for proc in procs:
            killed = second.sdexec("kill", "KILL", str(proc["pid"]))
            assert killed.returncode == 0, killed.stderr
        # Both: systemctl's answer (the manager's private socket) may come
        # before the service has the unload's signal (through dbus-daemon).
        _wait_for(
            lambda: set(unit_names()) == {a_stranger} and not second.stats()["procs"],
            "killed, unloaded and forgotten",
        )
        assert second.stop() == -signal.SIGTERM
    assert unit_names() == [a_stranger]


def kept_after_a_kill(first_run: Twistd, *runs: list[str]) -> Twistd:
    """``sdexec run --bg`` each of ``runs``, SIGKILL the service, and start
    it again with ``leftover-units = "keep"``: the restarted service."""
    for argv in runs:
        started = first_run.sdexec("run", "--bg", *argv)
        assert started.returncode == 0, started.stderr
    first_run.process.send_signal(signal.SIGKILL)
    first_run.process.wait(timeout=60)
    return Restarted(first_run, 'leftover-units = "keep"')


def the_leftover_read(service: Twistd) -> dict:
    """The one leftover ``service`` lists, once its unit is read."""
    _wait_for(lambda: service.stats()["procs"][0]["pid"] > 0, "leftover read")
    [proc] = service.stats()["procs"]
    return proc


def killed_and_stopped(service: Twistd) -> None:
    """Kill every leftover of ``service`` by pid, then stop it."""
    for proc in service.stats()["procs"]:
        killed = service.sdexec("kill", "KILL", str(proc["pid"]))
        assert killed.returncode == 0, killed.stderr
    _wait_for(lambda: not service.stats()["procs"], "killed and forgotten")
    assert service.stop() == -signal.SIGTERM


def test_a_kept_leftover_s_name_is_refused_naming_it(first_run):
    # An exec with a kept leftover's SDEXEC_NAME said only "is already run
    # by this service", where only sdexec ps tells that it is a leftover,
    # which no label or job reaches now (a kill by pid does).
    name = ["--setopt", "SDEXEC_NAME=bgrestart-named"]
    second = kept_after_a_kill(first_run, [*name, "sleep", "300"])
    with reaped(second.process):
        proc = the_leftover_read(second)
        again = second.sdexec("run", *name, "true")
        assert again.returncode != 0
        said = (
            "unit bgrestart-named.service is already run by this service: it is"
            f" a leftover (state O, pid {proc['pid']}; an earlier run's), which no"
            " request of this run follows; retry once it is gone (a kill by its"
            " pid ends it)"
        )
        assert said.encode() in again.stderr, again.stderr
        killed_and_stopped(second)


def test_a_kept_leftover_s_job_is_refused_naming_it(first_run):
    # sdexec cancel of a kept leftover's job said "terminate jobid=4242 not
    # found", where sdexec ps lists its unit, sdexec-4242-...: its job and
    # time limit went with the killed run. So of a job of a time limit
    # alone, whose id is its unit's name.
    second = kept_after_a_kill(
        first_run,
        ["--jobid", "4242", "sleep", "300"],
        ["--time-limit", "1h", "sleep", "300"],
    )
    with reaped(second.process):
        _wait_for(
            lambda: [p["pid"] > 0 for p in second.stats()["procs"]] == [True] * 2,
            "leftovers read",
        )
        # ps showed JOBID "-" for both: the first one's unit's name carries
        # the id that cancel finds it by (review session 51).
        rows = second.sdexec("ps").stdout.decode().splitlines()[1:]
        assert sorted(row.split()[5] for row in rows) == ["-", "4242"]
        for proc in second.stats()["procs"]:
            jobid = "4242" if "-4242-" in proc["unit"] else proc["unit"]
            cancel = second.sdexec("cancel", jobid)
            assert cancel.returncode != 0
            said = (
                f"terminate jobid={jobid}: its unit {proc['unit']} is a leftover"
                f" (state O, pid {proc['pid']}; an earlier run's), which no"
                " request of this run follows: it runs no job of this run"
            )
            assert said.encode() in cancel.stderr, cancel.stderr
        killed_and_stopped(second)


def test_a_label_of_a_killed_run_is_said_to_be_gone_with_it(first_run):
    # wait, attach and kill of a label a killed run's process had said "not
    # found (no such process)", while that process ran on, listed as state
    # O: the label went with the run, and only its pid reaches it now.
    # cancel's terminate by label said only "not found" too (review
    # session 51), and says why after both of its targets.
    started = ["--waitable", "--label", "bgrestart-lab", "sleep", "300"]
    second = kept_after_a_kill(first_run, started)
    with reaped(second.process):
        the_leftover_read(second)
        lost = (
            b"labels do not outlive a run of the service: 1 leftover unit of an"
            b" earlier run (state O in sdexec ps) is reached only by a kill of a pid"
        )
        for verb in (["wait"], ["attach"], ["kill", "TERM"], ["cancel"]):
            refused = second.sdexec(*verb, "bgrestart-lab")
            assert refused.returncode != 0
            assert lost in refused.stderr, refused.stderr
        assert refused.stderr.startswith(
            b"sdexec: terminate jobid=bgrestart-lab not found; terminate"
            b" label=bgrestart-lab not found; labels do not outlive"
        ), refused.stderr
        killed_and_stopped(second)


def test_a_kept_leftover_s_command_line_is_quoted_as_a_process_s(first_run):
    # A leftover showed its unit's Description, unquoted: sh -c echo "$0";
    # exec sleep 300, where the process had shown as it does below.
    cmdline = ["sh", "-c", 'echo "$0"; exec sleep 300']  # $ and ;: the trampoline
    assert first_run.sdexec("run", "--bg", *cmdline).returncode == 0
    shown = f"  {shlex.join(cmdline)}"
    assert first_run.sdexec("ps").stdout.decode().splitlines()[1].endswith(shown)
    first_run.process.send_signal(signal.SIGKILL)
    first_run.process.wait(timeout=60)
    second = Restarted(first_run, 'leftover-units = "keep"')
    with reaped(second.process):
        _wait_for(lambda: second.stats()["procs"][0]["pid"] > 0, "leftover read")
        [row] = second.sdexec("ps").stdout.decode().splitlines()[1:]
        assert row.split()[1] == "O" and row.endswith(shown)
        killed = second.sdexec("kill", "KILL", row.split()[0])
        assert killed.returncode == 0, killed.stderr
        _wait_for(lambda: not second.stats()["procs"], "killed and forgotten")
        assert second.stop() == -signal.SIGTERM


def test_a_second_service_on_the_same_socket_leaves_the_first_ones_units(
    first_run,
):
    """An admin trying the configuration by hand while the service runs:
    the second twistd must not take the first one's units for leftovers."""
    clients = clients_with_sleepers(first_run)
    units = sorted(proc["unit"] for proc in first_run.stats()["procs"])
    second = subprocess.run(
        [*TWISTD, "--nodaemon", "--pidfile=", "sdexec", "--config",
         str(first_run.config)],
        cwd=first_run.config.parent, env=_environment(),
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 1
    said = f"another sdexec (pid {first_run.process.pid}) serves"
    assert said.encode() in second.stdout, second.stdout
    assert b"leftover" not in second.stdout
    assert sorted(proc["unit"] for proc in first_run.stats()["procs"]) == units
    assert set(units) <= set(unit_names())
    assert first_run.stop() == -signal.SIGTERM
    for client in clients:
        client.wait(timeout=60)


def test_a_stop_escalates_the_leftovers_it_is_stopping(first_run, tmp_path):
    """A clean stop escalates a leftover's stop as it does its own
    processes': one that ignores SIGTERM was left deactivating, running."""
    trapped = tmp_path / "trapped"
    script = f'trap "" TERM; touch {trapped}; sleep 300'
    started = first_run.sdexec("run", "--bg", "sh", "-c", script)
    assert started.returncode == 0, started.stderr
    _wait_for(trapped.exists, "SIGTERM ignored")
    [unit] = unit_names()
    first_run.process.send_signal(signal.SIGKILL)
    first_run.process.wait(timeout=60)
    second = Restarted(first_run)  # its stop timer: minutes
    try:
        with reaped(second.process):
            _wait_for(
                lambda: unit_property(unit, "ActiveState") == "deactivating",
                "the leftover stopping",
            )
            assert second.stop() == -signal.SIGTERM
        assert unit not in unit_names()
        assert (
            b"leftover unit " + unit.encode() + b" is gone" in second.log.read_bytes()
        )
    finally:  # SendSIGKILL=no: systemctl stop would wait for ever
        subprocess.run(["systemctl", "--user", "kill", "-s", "KILL", unit],
                       check=False, timeout=60)  # fmt: skip
        _wait_for(lambda: unit_property(unit, "ActiveState") != "deactivating",
                  "the leftover killed")  # fmt: skip
        subprocess.run(["systemctl", "--user", "reset-failed", unit],
                       check=False, timeout=60)  # fmt: skip
        _wait_for(lambda: unit not in unit_names(), "the leftover unloaded")


def test_a_run_under_another_listen_names_the_units_it_leaves_alone(
    first_run, tmp_path
):
    """The mark follows ``listen``: a killed run's units are another
    service's to a run on another socket, which leaves them alone, and
    said nothing of them."""
    units = killed_with_units_running(first_run)
    moved = tmp_path / "moved"
    moved.mkdir()
    second = Twistd(moved)
    with reaped(second.process):
        assert second.stop() == -signal.SIGTERM
    text = second.log.read_text()
    [line] = [line for line in text.splitlines() if "another sdexec" in line]
    assert "units of the manager carry the mark of another sdexec service" in line
    assert all(unit in line for unit in units)
    assert sorted(set(units) & set(unit_names())) == units  # left alone
