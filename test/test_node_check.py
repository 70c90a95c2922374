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
