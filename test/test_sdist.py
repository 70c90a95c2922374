"""The sdist is the source tree: a packager building from it, and running
the tests as Debian's pybuild does, has every file the suite needs. Left
to setuptools' own choice it carried ``test/test*.py`` alone, without the
``conftest.py``, the helpers, the topologies under ``test/data`` and the
scripts the tests run, so that not one test file could be imported from
it (review session 50).

Offline: the sdist is built by the setuptools already installed, and its
tests run with the packages already installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_wheel import NOT_SOURCE, REPO, _clean_environment

#: The repository's own files, for its CI and for git: no build or test of
#: the package reads them.
REPOSITORY_ONLY = (".ci/", ".gitignore")


def source_files() -> set[str]:
    """The files of the source tree: those git tracks in a checkout, every
    file in an unpacked sdist (which has no ``.git``)."""
    if (REPO / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True,
            timeout=60,
        )  # fmt: skip
        names = listed.stdout.decode().split("\0")
        return {name for name in names if name and (REPO / name).exists()}
    ignored = shutil.ignore_patterns(*NOT_SOURCE)
    found: set[str] = set()
    for directory, subdirectories, files in os.walk(REPO):
        subdirectories[:] = sorted(
            set(subdirectories) - ignored(directory, subdirectories)
        )
        for name in set(files) - ignored(directory, files):
            found.add(os.path.relpath(os.path.join(directory, name), REPO))
    return found


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> Path:
    """The sdist built from a clean copy of the tree, unpacked."""
    root = tmp_path_factory.mktemp("sdist")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    built = subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools import build_meta;"
         " print(build_meta.build_sdist(sys.argv[1]))", str(root)],
        cwd=source, capture_output=True, text=True, timeout=300,
        env=_clean_environment(),
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    name = built.stdout.split()[-1]
    with tarfile.open(root / name) as sdist:
        # The "data" filter where this Python has it (3.11.4 on; Debian 12's
        # 3.11.2 has not): the archive is our own, the filter only quiets 3.12+.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        sdist.extractall(root / "unpacked", **safe)
    (tree,) = (root / "unpacked").iterdir()
    return tree


def test_the_sdist_holds_every_file_of_the_source_tree(unpacked):
    shipped = {
        str(path.relative_to(unpacked))
        for path in unpacked.rglob("*")
        if path.is_file()
    }
    wanted = {name for name in source_files() if not name.startswith(REPOSITORY_ONLY)}
    assert sorted(wanted - shipped) == []
    assert not any(name.endswith((".pyc", "dropin.cache")) for name in shipped)


def test_the_tests_run_from_the_unpacked_sdist(unpacked):
    # Offline ones: their conftest, helpers and scripts/install come with them.
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "test/test_install.py", "test/test_packaging.py"],
        cwd=unpacked, capture_output=True, text=True, timeout=300,
        env={**_clean_environment(), "PYTHONPATH": str(unpacked)},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert " passed" in ran.stdout
