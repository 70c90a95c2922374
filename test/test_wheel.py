"""The built wheel is the whole product: installed into a fresh virtual
environment, with the checkout nowhere on ``sys.path``, it brings its own
twistd plugin, console script and example files, and the service it starts
runs a process.

The wheel and its dependencies are built once per test session into a
wheelhouse (pip's own cache makes a second session cheap), then installed
offline from it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from support import unit_names
from test_twistd import CONFIG, _wait_for, reaped, terminate

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parent.parent
#: Build outputs and caches a checkout may hold, left out of the build.
NOT_SOURCE = ("build", "dist", "*.egg-info", ".git", "__pycache__", "dropin.cache",
              ".tox", ".hypothesis", ".mypy_cache", ".ruff_cache",
              ".pytest_cache")  # fmt: skip
#: Long enough for a cold pip cache on a slow network, short of hanging CI.
PIP_TIMEOUT = 300


def _clean_environment() -> dict[str, str]:
    """The caller's environment without anything that would put the
    checkout (or any other tree) on ``sys.path``."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    }


def _pip(*args: str, python: str = sys.executable, cwd: Path) -> None:
    subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        check=True, timeout=PIP_TIMEOUT, cwd=cwd, env=_clean_environment(),
    )  # fmt: skip


class Installed:
    """A virtual environment holding the sdexec wheel and nothing of the
    checkout."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.home = prefix.parent  # the working directory for its commands

    def bin(self, name: str) -> str:
        return str(self.prefix / "bin" / name)

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(command), capture_output=True, text=True, timeout=timeout,
            cwd=self.home, env=_clean_environment(),
        )  # fmt: skip


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Installed:
    """The wheel built from the checkout, installed into a fresh venv (no
    ``--system-site-packages``: the dev machine's editable install must not
    leak in)."""
    root = tmp_path_factory.mktemp("wheel")
    # Built from a clean copy: setuptools builds in the source tree and would
    # ship whatever a stale build/lib of the checkout still holds.
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    wheelhouse = root / "wheelhouse"
    _pip("wheel", "-w", str(wheelhouse), str(source), cwd=root)
    prefix = root / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", str(prefix)],
        check=True, timeout=PIP_TIMEOUT, env=_clean_environment(),
    )  # fmt: skip
    _pip("install", "--no-index", "--find-links", str(wheelhouse), "sdexec",
         python=str(prefix / "bin" / "python"), cwd=root)  # fmt: skip
    return Installed(prefix)


def test_the_installed_package_comes_from_the_venv(installed):
    where = installed.run(
        installed.bin("python"), "-c",
        "import sdexec, twisted.plugins.sdexec_plugin as plugin, sys;"
        "print(sdexec.__file__); print(plugin.__file__);"
        "print(any(p.startswith(sys.argv[1]) for p in sys.path))",
        str(REPO),
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    package, plugin, checkout_on_path = where.stdout.split()
    assert Path(package).is_relative_to(installed.prefix)
    assert Path(plugin).is_relative_to(installed.prefix)
    assert checkout_on_path == "False"


def test_twisted_namespace_is_intact(installed):
    # The wheel adds a file to twisted/plugins/; Twisted's own plugins and
    # its package __init__ must be untouched.
    checked = installed.run(
        installed.bin("python"), "-c",
        "from twisted.plugin import getPlugins; from twisted.application.service"
        " import IServiceMaker; import twisted;"
        "print(twisted.__version__);"
        "print(sorted(p.tapname for p in getPlugins(IServiceMaker)))",
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    tapnames = checked.stdout.splitlines()[1]
    assert "'sdexec'" in tapnames and "'web'" in tapnames


def test_example_files_man_pages_and_completions_are_installed(installed):
    examples = installed.prefix / "share" / "sdexec" / "examples"
    shipped = ("sdexec.toml", "sdexec.yaml", "sdexec.service",
               "sdexec-system.service", "sdexec.socket")  # fmt: skip
    for name in shipped:
        assert (examples / name).read_bytes() == (REPO / "etc" / name).read_bytes()
    for path in ("share/man/man1/sdexec.1", "share/man/man5/sdexec.toml.5",
                 "share/bash-completion/completions/sdexec",
                 "share/zsh/site-functions/_sdexec"):  # fmt: skip
        assert (installed.prefix / path).read_bytes() == (REPO / path).read_bytes()


def test_the_installed_documents_plugin_cache_command_writes_the_cache(installed):
    # The wheel ships no twisted/plugins/dropin.cache: the system unit
    # (ProtectSystem=strict) cannot write it, and logged so at every start.
    # The step that writes it was in README.md alone, which is not installed.
    operating = installed.prefix / "share" / "doc" / "sdexec" / "operating.md"
    (command,) = re.findall(r"^python3 -c '(from twisted\.plugin [^']*)'$",
                            operating.read_text(), re.MULTILINE)  # fmt: skip
    (plugins,) = installed.prefix.glob("lib/python*/site-packages/twisted/plugins")
    cache = plugins / "dropin.cache"
    cache.unlink(missing_ok=True)
    written = installed.run(installed.bin("python3"), "-c", command)
    assert written.returncode == 0, written.stderr
    assert b"sdexec_plugin" in cache.read_bytes()
    assert cache.stat().st_mtime >= (plugins / "sdexec_plugin.py").stat().st_mtime


#: A Twisted program's use of the library, one line of it wrong on purpose.
TYPED_USER = """\
from twisted.internet.defer import Deferred
from sdexec.client import ExecHandle, SdexecClient, connect

def start(reactor: object, client: SdexecClient) -> ExecHandle:
    return client.exec({"cmdline": ["true"]}, 0)

wrong: int = connect
"""


def test_a_program_type_checking_its_use_of_the_library_sees_its_types(
    installed, tmp_path
):
    # PEP 561's py.typed: without it, mypy refused the import ("missing
    # library stubs or py.typed marker") and read the whole library as Any.
    program = tmp_path / "user.py"
    program.write_text(TYPED_USER)
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--python-executable",
         installed.bin("python"), "--config-file", os.devnull, str(program)],
        capture_output=True, text=True, timeout=PIP_TIMEOUT, cwd=tmp_path,
        env=_clean_environment(),
    )  # fmt: skip
    errors = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, checked.stdout
    assert "user.py:7: error: Incompatible types in assignment" in errors[0]


def test_twistd_sdexec_help_and_version(installed):
    helped = installed.run(installed.bin("twistd"), "sdexec", "--help")
    assert helped.returncode == 0, helped.stdout + helped.stderr
    assert "--config=" in helped.stdout
    shown = installed.run(installed.bin("sdexec"), "--version")
    assert shown.stdout == f"sdexec {version('sdexec')}\n", shown.stderr
    # twistd sdexec's own says which sdexec the unit's twistd would run, not
    # Twisted's version alone.
    shown = installed.run(installed.bin("twistd"), "sdexec", "--version")
    assert shown.stdout.startswith(f"sdexec {version('sdexec')} (Twisted "), shown


def test_the_installed_service_runs_a_process(installed, user_manager):
    socket, config, log = (installed.home / name for name in
                           ("sdexec.sock", "sdexec.toml", "twistd.log"))  # fmt: skip
    config.write_text(CONFIG.format(socket=socket, kill_timeout="5s"))
    service = subprocess.Popen(
        [installed.bin("twistd"), "--nodaemon", "--pidfile=", "sdexec",
         "--config", str(config)],
        cwd=installed.home, env=_clean_environment(),
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    with reaped(service):
        _wait_for(socket.exists, "the installed service's socket")
        ran = installed.run(installed.bin("sdexec"), "--socket", str(socket),
                            "run", "true")  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert terminate(service) == -signal.SIGTERM, log.read_text()
    assert b"Server Shut Down." in log.read_bytes()
    # The start names the sdexec it runs: after an upgrade, the journal says
    # which version came up.
    assert f"sdexec_plugin#info] sdexec {version('sdexec')}\n" in log.read_text()
    assert unit_names() == []
