"""The node's memory as systemd counts it (sdexec/nodememory.py), on
stand-in trees of ``/proc`` and ``/sys/fs/cgroup``."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from sdexec import nodememory
from sdexec.nodememory import physical_memory
from sdexec.policy import RequestPolicy
from sdexec.refusal import RequestRefused

GIB = 1024**3
PAGE = os.sysconf("SC_PAGE_SIZE")
RAM = os.sysconf("SC_PHYS_PAGES") * PAGE
#: A container's limit below any RAM this suite runs on, not a whole page.
LIMIT = 512 * 1024**2 + 123


def tree(tmp_path: Path, pid1: str, files: dict[str, str], dirs=()) -> str:
    """A stand-in root: PID 1's ``/proc/1/cgroup`` and cgroup files."""
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/cgroup").write_text(pid1)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for name in dirs:
        (tmp_path / "sys/fs/cgroup" / name).mkdir(parents=True, exist_ok=True)
    return str(tmp_path)


def test_a_v2_container_s_limit_is_its_memory(tmp_path):
    # systemd's root cgroup is PID 1's less init.scope: the container's.
    root = tree(
        tmp_path,
        "0::/init.scope\n",
        {"cgroup.controllers": "cpu memory", "memory.max": f"{LIMIT}\n"},
    )
    assert physical_memory(root) == LIMIT // PAGE * PAGE


@pytest.mark.parametrize("limit", ["max", None])
def test_without_a_v2_limit_it_is_the_ram(tmp_path, limit):
    files = {"cgroup.controllers": "cpu"}
    if limit is not None:
        files["memory.max"] = limit
    assert physical_memory(tree(tmp_path, "0::/\n", files)) == RAM


def test_a_v1_limit_is_read_where_name_systemd_puts_pid1(tmp_path):
    pid1 = "5:memory:/elsewhere\n1:name=systemd:/lxc/c1/init.scope\n0::/\n"
    root = tree(tmp_path, pid1, {"memory/lxc/c1/memory.limit_in_bytes": f"{LIMIT}"})
    assert physical_memory(root) == LIMIT // PAGE * PAGE


def test_a_hybrid_node_finds_pid1_on_its_v2_line(tmp_path):
    pid1 = "1:name=systemd:/other\n0::/lxc/c2/init.scope\n"
    files = {
        "memory/lxc/c2/memory.limit_in_bytes": f"{LIMIT}",
        "unified/cgroup.controllers": "",
    }
    assert physical_memory(tree(tmp_path, pid1, files)) == LIMIT // PAGE * PAGE


def test_a_bare_unified_directory_is_not_a_hybrid_node(tmp_path):
    # No v2 hierarchy mounted there: systemd takes name=systemd's path.
    pid1 = "1:name=systemd:/lxc/c3\n0::/elsewhere\n"
    files = {"memory/lxc/c3/memory.limit_in_bytes": f"{LIMIT}"}
    root = tree(tmp_path, pid1, files, dirs=["unified"])
    assert physical_memory(root) == LIMIT // PAGE * PAGE


def test_v1_s_no_limit_and_an_unreadable_pid1_are_the_ram(tmp_path):
    unlimited = tree(
        tmp_path / "v1",
        "1:name=systemd:/\n",
        {"memory/memory.limit_in_bytes": "9223372036854771712"},
    )
    assert physical_memory(unlimited) == RAM
    (tmp_path / "hidden").mkdir()
    assert physical_memory(str(tmp_path / "hidden")) == RAM


def test_a_request_is_compared_with_a_site_percentage_of_the_container(monkeypatch):
    # A 16 GiB container on a bigger host: the site's 50% is 8 GiB there.
    monkeypatch.setattr(nodememory, "physical_memory", lambda: 16 * GIB)
    policy = RequestPolicy(baseline={"MemoryMax": "50%"})
    assert policy.accept({"MemoryMax": "8G"})
    with pytest.raises(RequestRefused) as refused:
        policy.accept({"MemoryMax": "9G"})
    assert refused.value.errnum == errno.EPERM


def test_the_node_is_asked_only_to_compare_a_percentage(monkeypatch):
    def unasked() -> int:
        raise AssertionError("the node's memory was read")

    monkeypatch.setattr(nodememory, "physical_memory", unasked)
    assert RequestPolicy(baseline={"MemoryMax": "8G"}).accept({"MemoryMax": "4G"})
