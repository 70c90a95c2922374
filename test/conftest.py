"""Shared fixtures: a real systemd user manager for the integration tests,
and the offline server (``systemd``, ``server``, ``connection``: a
FakeManager, a server on a Clock, an in-memory client; test/offline.py).

The ``user_manager`` session fixture uses a manager that is already reachable
(a developer's desktop session, or a sandbox started by hand with
``scripts/systemd-user-sandbox``); otherwise it starts the sandbox and, at the
end of the session, stops exactly the manager it started, by pid. If no
manager can be had the tests that need one *fail* with the reason: they never
skip, so a CI machine without systemd cannot pass by accident.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import pytest_twisted
from hypothesis import settings
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.python.failure import Failure
from zope.interface import implementer

SANDBOX = Path(__file__).resolve().parent.parent / "scripts" / "systemd-user-sandbox"

# No example may fail for its time: Hypothesis's default deadline (200 ms an
# example) is a timed assertion, and it failed a framing test on a machine
# loaded by other runs (264 ms, 0.1 ms when run again). Speed is the
# benchmarks' to measure.
settings.register_profile("sdexec", deadline=None)
settings.load_profile("sdexec")


# -- errors nobody handled --------------------------------------------------------


class _ErrorRecords(logging.Handler):
    """The stdlib logging records with exception info (asyncio's "exception
    was never retrieved", a library's ``logger.exception``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "never retrieved" in record.getMessage():
            self.records.append(self.format(record))


@implementer(ILogObserver)
class LoggedFailures:
    """Every traceback logged while a test runs: a Twisted log event with a
    failure (``log.failure``, ``log.err``, and "Unhandled error in Deferred",
    which Twisted logs when a failed Deferred nobody handled is collected),
    and a stdlib logging record with exception info. A test that means one
    to be logged takes it with :meth:`flush`, as trial's
    ``flushLoggedErrors``; any left fails the test, since a user would see
    it as a traceback in the service's log."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, Failure]] = []
        self.stdlib = _ErrorRecords()

    def __call__(self, event: dict) -> None:
        failure = event.get("log_failure")
        if isinstance(failure, Failure):
            self.failures.append((event.get("log_format") or "", failure))

    def flush(self, *types: type[BaseException]) -> list[Failure]:
        """The failures logged so far of one of ``types`` (all when none is
        given), taken off the list so that they fail nothing."""
        taken = [f for _, f in self.failures if not types or f.check(*types)]
        self.failures = [
            (text, f) for text, f in self.failures if not any(f is t for t in taken)
        ]
        return taken

    def describe(self) -> str:
        """What is left, each with its traceback; empty when nothing is."""
        lines = [f"{text!r}: {f.getTraceback()}" for text, f in self.failures]
        return "\n".join(lines + self.stdlib.records)


def pytest_collection_finish(session) -> None:
    """What is alive once the tests are collected (modules, their classes
    and functions) is alive to the end: frozen, each module's full
    collection (:func:`_module_s_garbage`) passes over only what came
    after."""
    gc.collect()
    gc.freeze()


@contextmanager
def _watching(collect: Callable[[], object]) -> Iterator[LoggedFailures]:
    """A :class:`LoggedFailures` watching the log while the block runs and
    while ``collect()`` (a garbage collection) runs after it; then what it
    has left fails the test."""
    watch = LoggedFailures()
    globalLogPublisher.addObserver(watch)
    logging.getLogger().addHandler(watch.stdlib)
    try:
        yield watch
        collect()
    finally:
        globalLogPublisher.removeObserver(watch)
        logging.getLogger().removeHandler(watch.stdlib)
    left = watch.describe()
    if left:
        pytest.fail(
            "tracebacks logged that the test did not take"
            f" (logged_failures.flush):\n{left}",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def logged_failures():
    """The test's :class:`LoggedFailures`; at teardown, after a collection
    of the young generations (a failed Deferred logs only when collected,
    and a Failure's traceback keeps it in a cycle), the test fails for any
    left. Not a full collection each test: late in the suite, with
    thousands of tests' survivors to pass over, that made the whole run
    half as long again (414 s to 620-660 s); what a test made and the
    collector already moved to the oldest generation is found by
    :func:`_module_s_garbage`."""
    with _watching(lambda: gc.collect(1)) as watch:
        yield watch


@pytest.fixture(scope="module", autouse=True)
def _module_s_garbage():
    """A full collection as a module's tests end: a traceback it makes
    (a failed Deferred nobody handled that had reached the oldest
    generation) fails the module's last test, naming the traceback."""
    yield
    with _watching(gc.collect):
        pass  # the log watched while the collection runs, after the tests


def pytest_collection_modifyitems(items) -> None:
    """A test that needs the real manager carries the ``systemd`` marker, so
    that ``-m "not systemd"`` runs no manager: one without it is an error at
    collection, not a sandbox started (or a failure) where none was asked."""
    unmarked = [
        item.nodeid
        for item in items
        if "user_manager" in getattr(item, "fixturenames", ())
        and item.get_closest_marker("systemd") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that use the real manager lack @pytest.mark.systemd: "
            + ", ".join(unmarked)
        )


def _manager_reachable() -> bool:
    """Whether ``systemctl --user`` can talk to a manager. (Not
    ``is-system-running``: it says "offline" also when nothing answers.)"""
    try:
        probe = subprocess.run(
            ["systemctl", "--user", "show-environment"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _bus_address(runtime_dir: str) -> str:
    return f"unix:path={runtime_dir}/bus"


class UserManager:
    """Where the manager is, and whether this test session started it."""

    def __init__(self, runtime_dir: str, pid: int | None) -> None:
        self.runtime_dir = runtime_dir
        self.pid = pid
        self.bus_address = os.environ.get(
            "DBUS_SESSION_BUS_ADDRESS", _bus_address(runtime_dir)
        )


@pytest.fixture(scope="session")
def user_manager():
    """A reachable systemd user manager; its environment is exported."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and _manager_reachable():
        os.environ.setdefault("DBUS_SESSION_BUS_ADDRESS", _bus_address(runtime_dir))
        yield UserManager(runtime_dir, pid=None)
        return
    runtime_dir = tempfile.mkdtemp(prefix="sdexec-test-manager.")
    started = subprocess.run(
        [str(SANDBOX), "start", runtime_dir], capture_output=True, text=True
    )
    if started.returncode != 0:
        pytest.fail(
            "no systemd user manager is reachable and the sandbox would not start:"
            f" {started.stderr.strip()} (see scripts/systemd-user-sandbox)",
            pytrace=False,
        )
    exported = ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")
    saved = {key: os.environ.get(key) for key in exported}
    os.environ["XDG_RUNTIME_DIR"] = runtime_dir
    os.environ["DBUS_SESSION_BUS_ADDRESS"] = _bus_address(runtime_dir)
    pid = int(Path(runtime_dir, "manager.pid").read_text())
    try:
        yield UserManager(runtime_dir, pid=pid)
    finally:
        subprocess.run([str(SANDBOX), "stop", runtime_dir], check=False)
        shutil.rmtree(runtime_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest_twisted.async_yield_fixture
async def start_service(user_manager, tmp_path):
    """``await start_service(clock=None, exec="", sdexec="", extra="")``: an
    in-process service, its configuration the base one with ``exec`` and
    ``sdexec`` lines added to those tables and ``extra`` tables appended
    (see ``support.ConfigText``); at teardown it is stopped and nothing of it
    may remain: no process tracked, no unit loaded, no fd open."""
    from support import (
        ConfigText,
        RunningService,
        describe_fds,
        open_fds,
        sleep,
        stop_units_since,
        unit_names,
    )

    fds_before = open_fds()
    started: list[RunningService] = []

    async def start(clock=None, **config_text: str) -> RunningService:
        directory = tmp_path / f"service{len(started)}"
        directory.mkdir()
        service = RunningService(directory, ConfigText(**config_text), clock)
        started.append(service)
        return await service.start()

    yield start
    failures = []
    for service in started:  # every one stopped, whichever fails
        try:
            await service.stop()
            assert service.server is None or not service.server.processes
        except Exception as failure:
            failures.append(failure)
    leftover = unit_names()
    for _ in range(300):
        if not leftover:
            break
        await sleep(0.1)
        leftover = unit_names()
    # Stopped before the test fails for them, so that it fails alone: left
    # running, they would fail every later test that counts units.
    stop_units_since(set())
    assert leftover == [], f"units left behind: {leftover}"
    if failures:
        raise failures[0]
    leaked = open_fds() - fds_before
    for _ in range(300):  # closed transports release theirs a pass or so later
        if not leaked:
            break
        await sleep(0.1)
        leaked = open_fds() - fds_before
    assert not leaked, f"fds left open: {describe_fds(leaked)}"


@pytest_twisted.async_yield_fixture
async def sdexec(start_service):
    """A service with the default configuration."""
    yield await start_service()


# -- the offline server (test/offline.py) --------------------------------------


@pytest.fixture
def systemd():
    """A :class:`~sdexec.testing.FakeManager`."""
    from sdexec.testing import FakeManager

    manager = FakeManager()
    yield manager
    manager.close()


@pytest.fixture
def server(systemd):
    """An :class:`~sdexec.server.SdexecServer` on ``systemd``, its timers on a
    ``Clock``."""
    from twisted.internet import reactor
    from twisted.internet.task import Clock

    from sdexec.config import parse_config
    from sdexec.server import SdexecServer

    return SdexecServer(systemd, parse_config({}), reactor, clock=Clock())


@pytest.fixture
def connection(server):
    """A client of ``server``, in memory (``offline.Connection``)."""
    from offline import Connection

    opened = Connection(server)
    yield opened
    opened.close()


@pytest.fixture
def orphans_signalled(monkeypatch) -> list[tuple[str, int]]:
    """``(cgroup, signal)`` of each pass of a lost unit's kill
    (sdexec/orphans.py), none of them sent."""
    import sdexec.orphans

    sent: list[tuple[str, int]] = []

    def signal_cgroup(group, signum, root="/"):
        sent.append((group, signum))
        return sdexec.orphans.Signalled(sent={4242})

    monkeypatch.setattr(sdexec.orphans, "signal_cgroup", signal_cgroup)
    return sent


@pytest.fixture
def private_manager(monkeypatch):
    """A sandbox manager of the test's own, its environment exported, for
    tests that kill or re-execute it (a manager the session reused, a
    developer's own, must never suffer that); ``(runtime_dir, killed)``:
    at the end every manager started in it is stopped and what the killed
    ones (their pids put in ``killed``) left is killed."""
    from support import remove_killed_sandbox, start_manager

    runtime_dir = tempfile.mkdtemp(prefix="sdexec-killed.")
    killed: list[int] = []
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_dir)
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={runtime_dir}/bus")
    start_manager(runtime_dir)
    try:
        yield runtime_dir, killed
    finally:
        subprocess.run([str(SANDBOX), "stop", runtime_dir], check=False)
        for pid in killed:
            remove_killed_sandbox(pid)
        shutil.rmtree(runtime_dir, ignore_errors=True)


@pytest.fixture
def shared_dir():
    """A directory of ours that other users may enter (not write), every
    directory above it too: pytest's ``tmp_path`` is below a 0700 one."""
    directory = tempfile.mkdtemp(prefix="sdexec-sock-")
    os.chmod(directory, 0o711)
    yield Path(directory)
    shutil.rmtree(directory)
