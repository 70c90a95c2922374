"""scripts/enforcing-node-check's job probe (``PROBE``), on each cgroup
layout: what a job sees of its fence, read from its own cgroup.

The script's checks run on a cgroup v2 node; ``LOCAL=1`` runs them as a
dry run on whatever node it is given, these cgroup v1 machines too. The
probe is run here as root in a mount namespace of its own, whose
``/proc/self/cgroup`` and ``/sys/fs/cgroup`` are a layout's, so that each
layout is read whatever this machine's own is.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "enforcing-node-check"

#: Where each layout puts the unified hierarchy, and a job's lines in
#: /proc/self/cgroup there: v2 alone, hybrid (v1 controllers, v2 mounted at
#: unified with none), v1 alone (no v2 line at all).
LAYOUTS = {
    "v2": ("", "0::/job.service\n"),
    "hybrid": (
        "unified/",
        "9:name=systemd:/job.service\n3:cpuset:/\n0::/job.service\n",
    ),
    "v1": (None, "9:name=systemd:/job.service\n3:cpuset:/\n4:memory:/\n"),
}


def probe_source() -> str:
    """The probe's Python, as the script gives it to ``python3 -c``."""
    [source] = re.findall(r"^PROBE='(.*?)'$", SCRIPT.read_text(), re.M | re.S)
    return source


def probed(tmp_path: Path, layout: str) -> dict:
    """What the probe prints, run where ``layout``'s job runs: its
    ``/proc/self/cgroup`` lines, and the job's cgroup files (a cpuset of
    CPU 3 and a 1 MiB cap) in its unified hierarchy, if it has one."""
    unified, lines = LAYOUTS[layout]
    tree = tmp_path / "cgroup"
    if unified is not None:
        job = tree / unified / "job.service"
        job.mkdir(parents=True)
        # (Stand-ins: a hybrid node's unified hierarchy has no controllers,
        # and the files the probe reads are where it looks for them.)
        controllers = "" if unified else "cpuset memory\n"
        (tree / unified / "cgroup.controllers").write_text(controllers)
        (job / "cpuset.cpus.effective").write_text("3\n")
        (job / "memory.max").write_text("1048576\n")
    else:
        tree.mkdir()
    own = tmp_path / "proc-cgroup"
    own.write_text(lines)
    # $$ is the shell's pid, which the exec keeps: /proc/self is then it.
    shell = (
        'mount --bind "$1" /proc/$$/cgroup && mount --bind "$2" /sys/fs/cgroup'
        ' && exec "$3" -c "$4"'
    )
    ran = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh",
         str(own), str(tree), sys.executable, probe_source()],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    [line] = [line for line in ran.stdout.splitlines() if line.startswith("PROBE ")]
    return json.loads(line[len("PROBE ") :])


@pytest.mark.parametrize("layout", ["v2", "hybrid"])
def test_the_probe_reads_the_job_s_cgroup_where_its_unified_hierarchy_is(
    tmp_path, layout
):
    seen = probed(tmp_path, layout)
    unified = LAYOUTS[layout][0]
    assert seen["cgroup"] == f"/sys/fs/cgroup/{unified}job.service"
    assert (seen["cpuset"], seen["memory_max"]) == ("3", "1048576")


def test_the_probe_says_a_v1_job_has_no_v2_cgroup(tmp_path):
    # It took the first v2 line for granted: on a v1 node, the dry run's
    # every job probe died of an IndexError, and its checks failed.
    seen = probed(tmp_path, "v1")
    assert seen["cgroup"] is None
    no_cgroup = "error: no cgroup v2 line in /proc/self/cgroup"
    assert (seen["cpuset"], seen["memory_max"]) == (no_cgroup, no_cgroup)


def limit_files(cgroup: Path) -> list[str]:
    """What the script's ``limit_files`` gives for ``cgroup``, its
    function run alone in bash."""
    [function] = re.findall(
        r"^limit_files\(\) \{\n.*?^\}$", SCRIPT.read_text(), re.M | re.S
    )
    done = subprocess.run(
        ["bash", "-c", f'{function}\nlimit_files "$1"', "bash", str(cgroup)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return done.stdout.split()


@pytest.mark.parametrize(
    ("controllers", "files"),
    [
        (
            "cpuset cpu io memory pids",
            ["cpuset.cpus", "cpuset.mems", "memory.max", "memory.high", "pids.max"],
        ),
        ("cpu io memory", ["memory.max", "memory.high"]),
        ("", []),
    ],
    ids=["all", "no-pids-nor-cpuset", "none"],
)
def test_the_reload_check_compares_only_the_job_s_controllers_files(
    tmp_path, controllers, files
):
    # A10 read pids.max whatever the job had: under a manager not given the
    # pids controller, "No such file" failed it before any reload.
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    assert limit_files(tmp_path) == files


def script_function(name: str) -> str:
    """The script's function ``name``, as written there."""
    [function] = re.findall(
        rf"^{name}\(\) \{{\n.*?^\}}$", SCRIPT.read_text(), re.M | re.S
    )
    return function


def fences_devices(runtime: Path, v2: bool) -> bool:
    """What the script's ``manager_fences_devices`` says of the manager
    whose runtime directory is ``runtime``, on a cgroup v2 node or not."""
    done = subprocess.run(
        ["bash", "-c", f"{script_function('manager_fences_devices')}\n"
         "manager_fences_devices"],
        env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(runtime),
             "V2": "1" if v2 else ""},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    return done.returncode == 0


@pytest.mark.parametrize(
    ("uid", "v2", "fenced"),
    [(0, True, True), (1000, True, False), (0, False, False)],
    ids=["root-v2", "uid-1000-v2", "root-not-v2"],
)
def test_device_checks_are_expected_where_the_manager_can_load_a_filter(
    tmp_path, uid, v2, fenced
):
    # A0, A1's and A2's GPU nodes and A3n were expected wherever cpuset and
    # memory were delegated: what decides DevicePolicy is a device filter
    # the manager can load (BPF on v2, root's alone), as sdexec's canary
    # finds it. A uid-1000 manager given both failed them all.
    (tmp_path / "systemd").mkdir()
    private = tmp_path / "systemd" / "private"
    with socket.socket(socket.AF_UNIX) as manager:
        manager.bind(str(private))
        os.chown(private, uid, uid)
        assert fences_devices(tmp_path, v2) is fenced


def test_no_manager_socket_is_no_device_fence(tmp_path):
    assert fences_devices(tmp_path, True) is False


@pytest.mark.parametrize(
    "check", ["A0.device-fence", "A1.gpu-nodes", "A2.gpu-nodes", "A3n.cuda"]
)
def test_each_device_check_is_made_by_that_rule(check):
    # Made where the manager fences devices (the guard on its line, or the
    # `if` above it), not where it has cpuset and memory.
    lines = SCRIPT.read_text().splitlines()
    [at] = [n for n, line in enumerate(lines) if f"expect {check} " in line]
    guard = next(
        line for line in reversed(lines[: at + 1]) if re.match(r"\s*(if|\[) ", line)
    )
    assert '"$DEVICES"' in guard, guard


def kit_fits(kit: Path, carry_mib: int) -> subprocess.CompletedProcess:
    """The script's ``kit_fits`` on ``kit`` (this checkout's tracked files
    counted with it), for a carry of ``carry_mib``."""
    return subprocess.run(
        ["bash", "-c", f'{script_function("kit_fits")}\nkit_fits "$1"', "bash",
         str(kit)],
        env={"PATH": os.environ["PATH"], "ROOT": str(SCRIPT.parent.parent),
             "CARRY_MIB": str(carry_mib)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def a_kit(tmp_path: Path, wheels: list[str], mib: int = 0) -> Path:
    """A kit of ``wheels`` (empty files) and ``mib`` MiB more, as a sparse
    file: the carry counts what it copies, a file's length."""
    kit = tmp_path / "kit"
    (kit / "whl312").mkdir(parents=True)
    for wheel in wheels:
        (kit / "whl312" / wheel).touch()
    with open(kit / "big", "wb") as big:
        big.truncate(mib << 20)
    return kit


def test_a_kit_that_fits_the_carry_is_taken(tmp_path):
    kit = a_kit(tmp_path, ["twisted-26.10.0-py3-none-any.whl"], mib=30)
    fits = kit_fits(kit, 64)
    assert fits.returncode == 0, fits.stderr
    assert "the carry takes 64 MiB" in fits.stdout


def test_a_kit_larger_than_the_carry_is_refused_saying_so(tmp_path):
    # Over the device run's carry, the kit would not reach the node, and
    # its run would end at setup, its one try spent.
    fits = kit_fits(a_kit(tmp_path, [], mib=70), 64)
    assert fits.returncode == 1
    assert "exceed the device run's carry (64 MiB)" in fits.stderr


def test_two_versions_of_a_wheel_are_refused_naming_it(tmp_path):
    # build-kit.sh downloads dbus-fast unpinned, the script this project's
    # pinned <6: two versions, and the node's `pip install whl312/*.whl`
    # refuses them all.
    wheels = ["dbus_fast-5.2.0-cp312-cp312-manylinux2014_x86_64.whl",
              "dbus_fast-6.0.0-cp312-cp312-manylinux2014_x86_64.whl",
              "twisted-26.10.0-py3-none-any.whl"]  # fmt: skip
    fits = kit_fits(a_kit(tmp_path, wheels), 64)
    assert fits.returncode == 1
    assert "two versions of: dbus_fast" in fits.stderr


def git(*args: str, cwd: Path) -> None:
    """Run git in ``cwd``, as a throwaway identity."""
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd, check=True, capture_output=True, timeout=60,
    )  # fmt: skip


def test_the_kit_is_prepared_from_a_worktree_beside_no_shared_folder(tmp_path):
    # It looked for ../shared/device-kit beside the checkout only: from a
    # git worktree elsewhere, bash said "No such file" and nothing was built.
    main, kit_src = tmp_path / "main", tmp_path / "shared" / "device-kit"
    (main / "scripts").mkdir(parents=True)
    (main / "scripts" / "enforcing-node-check").write_text(SCRIPT.read_text())
    kit_src.mkdir(parents=True)
    # a stand-in for the kit's build: it says where it was asked to build
    (kit_src / "build-kit.sh").write_text(
        'echo "$1" >"$(dirname "$0")/asked"; exit 7\n'
    )
    git("init", "-q", cwd=main)
    git("add", ".", cwd=main)
    git("commit", "-qm", "x", cwd=main)
    worktree = tmp_path / "elsewhere" / "wt"
    git("worktree", "add", "-q", str(worktree), cwd=main)
    done = subprocess.run(
        ["bash", str(worktree / "scripts" / "enforcing-node-check"), "--prepare-kit"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 7, done.stderr
    assert (kit_src / "asked").read_text() == f"{worktree}/.devkit\n"


def run_check(tmp_path: Path, shell: str = "", **env: str) -> tuple[int, str]:
    """The script run with ``env`` after ``shell`` (in a mount namespace of
    its own), output under ``tmp_path``: its status and $OUT/check.log."""
    out = tmp_path / "out"
    ran = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c",
         f'{shell}\nexec bash "$0"', str(SCRIPT)],
        env={**os.environ, "OUT": str(out), **env},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return ran.returncode, (out / "check.log").read_text()


def test_a_node_that_is_not_cgroup_v2_is_named_so_in_the_log(tmp_path):
    # Whatever this machine's cgroups, the script is shown a tmpfs there.
    rc, said = run_check(tmp_path, "mount -t tmpfs tmpfs /sys/fs/cgroup")
    assert rc == 2
    assert "/sys/fs/cgroup is not cgroup v2: nothing here would be enforced" in said


def test_a_step_with_no_time_left_is_not_begun_and_says_so(tmp_path):
    # A run past BUDGET is cut off by the device's 600 s: a step not begun
    # must say it was for want of time, in the log that comes back.
    rc, said = run_check(tmp_path, LOCAL="1", BUDGET="0", STEPS="check_hardened")
    assert rc == 1
    assert "FAIL check_hardened: time to run (30s; " in said
    assert "F: lstopo" not in said


def one_liner(name: str) -> str:
    """The script's one-line function ``name``."""
    [function] = re.findall(rf"^{name}\(\) \{{.*\}}$", SCRIPT.read_text(), re.M)
    return function


@pytest.mark.parametrize(
    "reason",
    [
        "AllowedCPUs not enforced: expected 15 got",
        "MemoryMax not enforced: the unit's cgroup has no memory limit",
    ],
)
def test_an_unfenced_step_finds_its_reason_in_the_refusal_and_the_drain(
    tmp_path, reason
):
    # check_no_cpuset's and check_no_memory's verdicts, on what a job and
    # /stats said (the memory reason has a quote in it, which an
    # expression built around it would break on).
    (tmp_path / "G1.out").write_text(f"sdexec: {reason} (is the ...)\n")
    drain = {"drain": {"drained": True, "reason": f"{reason} (is the ...)"}}
    (tmp_path / "sdm.stats.json").write_text(json.dumps(drain))
    functions = "\n".join(
        [one_liner("said"), script_function("fact"), one_liner("refused_for"),
         one_liner("drained_for")]
    )  # fmt: skip
    verdicts = 'RC=1; refused_for G1 "$1" && drained_for sdm.stats "$1" && echo both'
    done = subprocess.run(
        ["bash", "-c", f"{functions}\n{verdicts}", "bash", reason],
        env={"PATH": os.environ["PATH"], "OUT": str(tmp_path)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.stdout == "both\n", done.stderr


#: How a test asks the node what it enforces, or has: a file that does is
#: one whose verdict the node decides.
NODE_DECISIONS = (
    "node_kills_at_memory_max",
    "units_get_memory_max",
    "node_enforces_device_policy",
    "manager_makes_mounts",
    "_gpus_hwloc_sees",
)


def test_the_node_s_tests_hold_every_file_that_asks_the_node():
    # The enforcing branches of those files run on no machine but such a
    # node, whose device runs are short: the default run must reach them
    # (a 1-byte cap's OOM kill at start had never run there).
    [listed] = re.findall(r'^NODE_FILES="(.*?)"$', SCRIPT.read_text(), re.M | re.S)
    files = listed.split()
    repo = SCRIPT.parent.parent
    assert [f for f in files if not (repo / f).is_file()] == []
    asking = {
        f"test/{path.name}"
        for path in (repo / "test").glob("test_*.py")
        if path.name != Path(__file__).name  # these names, not asked
        and any(name in path.read_text() for name in NODE_DECISIONS)
    }
    assert asking - set(files) == set()
    [default] = re.findall(r"\$\{STEPS:-([^}]*)\}", SCRIPT.read_text())
    assert "run_node_suite" in default.split()
