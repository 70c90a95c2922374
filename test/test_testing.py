"""sdexec.testing as a program's tests use it: a real client and server over
a UNIX socket, systemd a FakeManager, each flow a resource manager's tests
would take (docs/client.md, "Testing a program offline") through public
names alone."""

from __future__ import annotations

import errno
import inspect
import os
import signal

import pytest
import pytest_twisted
from pytest_twisted import ensureDeferred
from support import until
from twisted.internet import defer, reactor
from twisted.internet.task import Clock

from sdexec import testing
from sdexec.client import STDERR, STDOUT, RPCError, SdexecClient, connect
from sdexec.config import parse_config
from sdexec.connection import SdexecServerFactory
from sdexec.ioencode import decode_io
from sdexec.server import SdexecServer
from sdexec.systemd import SystemdError
from sdexec.testing import FakeManager


class Offline:
    """A server over a FakeManager on a socket, and a client of it."""

    def __init__(self, path: str) -> None:
        self.manager = FakeManager()
        self.manager.stop_to_inactive = True
        self.server = SdexecServer(
            self.manager, parse_config({}), reactor, clock=Clock()
        )
        self.port = reactor.listenUNIX(path, SdexecServerFactory(self.server))
        self.path = path
        self.client: SdexecClient
        self.responses: list[dict] = []

    def exec(self, *cmdline: str, **fields: str):
        cmd = {"cmdline": list(cmdline), "env": {}, "opts": {}, "channels": []}
        return self.client.exec(
            {**cmd, **fields}, STDOUT | STDERR, self.responses.append
        )

    def output(self, stream: str) -> bytes:
        ios = [decode_io(r["io"]) for r in self.responses if r["type"] == "output"]
        return b"".join(data for name, data, _eof in ios if name == stream)

    async def close(self) -> None:
        await self.client.close()
        await self.port.stopListening()
        await self.server.shutdown(5)
        self.manager.close()


@pytest_twisted.async_yield_fixture
async def offline(tmp_path):
    served = Offline(str(tmp_path / "s.sock"))
    served.client = await connect(reactor, served.path)
    yield served
    await served.close()


@ensureDeferred
async def test_a_command_s_output_and_exit_status(offline):
    handle = offline.exec("hostname")
    unit = await offline.manager.started()
    offline.manager.run(unit, pid=1234)
    os.write(offline.manager.process_fd(unit, "stdout"), b"node1\n")
    os.write(offline.manager.process_fd(unit, "stderr"), b"warning\n")
    offline.manager.end(unit, status=3)
    await handle.done
    assert (handle.pid, handle.receipt.status) == (1234, 3 << 8)
    assert (offline.output("stdout"), offline.output("stderr")) == (
        b"node1\n", b"warning\n"
    )  # fmt: skip


@ensureDeferred
async def test_started_gives_each_unit_once_in_order_after_the_service_has_it(
    offline,
):
    # Given from within the start, a test's drive of the unit came before
    # the service had systemd's answer: a failure then ended nothing.
    first = offline.exec("hostname")
    waiting = offline.manager.started()
    second = offline.exec("hostname")
    unit = await waiting
    assert unit == offline.manager.calls[0][1]
    offline.manager.fail(unit)
    other = await offline.manager.started()
    assert other != unit
    with pytest.raises(RPCError) as error:
        await first.done
    assert error.value.errnum == errno.ENOENT
    offline.manager.run(other)
    offline.manager.end(other)
    await second.done


def next_started(manager: FakeManager):
    """``manager.started()``, failing after a minute (a bound for a loaded
    machine: a start lost would hang the test)."""
    return manager.started().addTimeout(60, reactor)


def starts(manager: FakeManager) -> list[str]:
    """The units started so far, in order."""
    return [call[1] for call in manager.calls if call[0] == "start"]


async def run_to_its_end(offline: Offline, unit: str, handle) -> None:
    offline.manager.run(unit)
    offline.manager.end(unit)
    await handle.done


@ensureDeferred
async def test_a_started_given_up_on_takes_no_unit_from_the_next(offline):
    # A test's timeout on started() (addTimeout, a race) left its claim
    # waiting: the next start was given to it, and lost, and the next
    # started() waited for ever.
    given_up = offline.manager.started()
    given_up.cancel()
    with pytest.raises(defer.CancelledError):
        await given_up
    handle = offline.exec("hostname")
    unit = await next_started(offline.manager)
    assert starts(offline.manager) == [unit]
    await run_to_its_end(offline, unit, handle)


@ensureDeferred
async def test_a_started_given_up_on_as_its_unit_comes_passes_it_on(
    offline, monkeypatch
):
    # Cancelled in the turn between the start and its name given: the name
    # is the next started()'s, not dropped with the cancelled one.
    waiting = offline.manager.started()
    waiting.addErrback(lambda failure: failure.trap(defer.CancelledError))
    start = offline.manager.start_transient_unit

    def start_then_give_up(*args, **kwargs):
        started = start(*args, **kwargs)
        waiting.cancel()
        return started

    monkeypatch.setattr(offline.manager, "start_transient_unit", start_then_give_up)
    handle = offline.exec("hostname")
    unit = await next_started(offline.manager)
    assert starts(offline.manager) == [unit]
    await run_to_its_end(offline, unit, handle)


@ensureDeferred
async def test_a_manager_closed_gives_no_earlier_start_to_started(offline):
    # Kept from one test to the next (a module's fixture), a manager gave
    # a later test's started() a unit an earlier test started unasked.
    handle = offline.exec("hostname")
    await until(lambda: starts(offline.manager), "the start")
    (unasked,) = starts(offline.manager)
    await run_to_its_end(offline, unasked, handle)
    offline.manager.close()  # the end of the earlier test
    handle = offline.exec("hostname")
    unit = await next_started(offline.manager)
    assert starts(offline.manager) == [unasked, unit]
    await run_to_its_end(offline, unit, handle)


@ensureDeferred
async def test_a_command_systemd_cannot_run_fails_naming_why(offline):
    handle = offline.exec("hostname")
    offline.manager.fail(await offline.manager.started(), status=203)
    with pytest.raises(RPCError) as error:
        await handle.done
    assert "exit status 203/EXEC" in str(error.value)
    assert "cannot execute /" in str(error.value)
    assert [r["type"] for r in offline.responses] == []


@ensureDeferred
async def test_a_start_systemd_refuses_fails_the_request(offline):
    offline.manager.refuse_start = SystemdError(
        "org.freedesktop.DBus.Error.InvalidArgs", "Invalid argument"
    )
    with pytest.raises(RPCError) as error:
        await offline.exec("hostname").done
    assert error.value.errnum == errno.EINVAL


@ensureDeferred
async def test_a_kill_is_sent_and_its_death_is_the_status(offline):
    handle = offline.exec("sleep", "60")
    unit = await offline.manager.started()
    offline.manager.run(unit)
    await handle.kill(signal.SIGTERM)
    assert offline.manager.signalled == [(unit, signal.SIGTERM)]
    offline.manager.end(unit, signal=signal.SIGTERM)
    await handle.done
    assert os.waitstatus_to_exitcode(handle.receipt.status) == -signal.SIGTERM


@ensureDeferred
async def test_a_client_that_vanishes_has_its_unit_stopped(offline):
    handle = offline.exec("sleep", "60")
    handle.done.addErrback(lambda _failure: None)  # the connection goes
    unit = await offline.manager.started()
    offline.manager.run(unit)
    offline.client.transport.abortConnection()
    await offline.client.disconnected
    # The server sees the loss a turn or more on.
    await until(lambda: ("stop", unit) in offline.manager.calls, "the unit stopped")
    assert offline.manager.units[unit]["ActiveState"] == "inactive"


@ensureDeferred
async def test_list_shows_what_runs(offline):
    handle = offline.exec("sleep", "60", label="job")
    unit = await offline.manager.started()
    offline.manager.run(unit, pid=4321)
    [proc] = (await offline.client.list())["procs"]
    assert (proc["pid"], proc["label"], proc["cmd"]) == (4321, "job", "sleep")
    offline.manager.end(unit)
    await handle.done
    assert (await offline.client.list())["procs"] == []


@ensureDeferred
async def test_the_shutdown_ends_what_a_test_left_running(offline):
    handle = offline.exec("sleep", "60")
    offline.manager.run(await offline.manager.started())
    ended = handle.done.addErrback(lambda failure: failure.value)
    await offline.server.shutdown(5)
    assert str(await ended).startswith("the service is stopping")
    assert offline.server.processes == {}


def _public_callables():
    members = [getattr(testing, name) for name in testing.__all__]
    methods = [
        member.fget if isinstance(member, property) else member
        for name, member in vars(FakeManager).items()
        if not name.startswith("_")
    ]
    return [m for m in [*members, *methods] if callable(m)]


@pytest.mark.parametrize("member", _public_callables(), ids=lambda m: m.__name__)
def test_every_public_name_is_documented_and_typed(member):
    assert inspect.getdoc(member)
    if inspect.isclass(member):
        member = member.__init__
    hints = inspect.get_annotations(member)
    parameters = inspect.signature(member).parameters
    assert "return" in hints
    assert set(parameters) - {"self"} <= set(hints)
