"""The window of calls shared between users, against the real manager: a
user of ``allow-users`` with hundreds of starts queued does not hold the
owner's start behind all of them (sdexec/systemd/window.py, lanes)."""

from __future__ import annotations

import errno
import os
import signal

import pytest
from pytest_twisted import ensureDeferred
from support import FLAGS, command, until
from twisted.internet.defer import gatherResults
from twisted.python.failure import Failure

import sdexec.connection
from sdexec.systemd import SystemdClient
from sdexec.systemd.window import SERVICE_LANE, CallWindow

pytestmark = pytest.mark.systemd

#: A user of ``allow-users`` (not the service's owner, this test's uid).
USER = os.getuid() + 1
#: The user's burst: connections, and execs on each (under the 64 a
#: connection may have unanswered, connection.MAX_UNANSWERED).
CONNECTIONS, EXECS = 4, 50
#: A unit no test starts.
UNIT = "sdexec-window-lanes-none.service"


async def connect_as(service, monkeypatch, uid: int, count: int) -> list:
    """``count`` connections to ``service`` whose peer is ``uid``, each
    counted by the server (the uid is read as a connection is made)."""
    monkeypatch.setattr(sdexec.connection, "peer_uid", lambda sock: uid)
    clients = [await service.connect() for _ in range(count)]
    counted = service.server.connections.open_by_uid
    await until(lambda: counted().get(uid) == count, f"{count} of uid {uid}")
    return clients


def record_starts(systemd) -> list[str]:
    """The units whose ``StartTransientUnit`` leaves the window, in order."""
    sent: list[str] = []
    start = systemd.start_transient_unit

    def recording(name, *args, on_sent=None, **kw):
        def noted() -> None:
            if on_sent is not None:
                on_sent()  # raises for a start withdrawn: never sent
            sent.append(name)

        return start(name, *args, on_sent=noted, **kw)

    systemd.start_transient_unit = recording
    return sent


def exec_true(client, label: str, done: list) -> None:
    handle = client.exec(command(["true"], label=label), FLAGS, lambda r: None)
    handle.close_stdin()
    handle.done.addBoth(done.append)


@ensureDeferred
async def test_the_owner_s_start_is_not_behind_a_user_s_burst(
    start_service, monkeypatch
):
    service = await start_service(sdexec=f"allow-users = [{USER}]")
    window = service.server.systemd.window
    sent = record_starts(service.server.systemd)
    users = await connect_as(service, monkeypatch, USER, CONNECTIONS)
    [owner] = await connect_as(service, monkeypatch, os.getuid(), 1)
    done: list = []
    # The window held shut while the calls queue: the order they then
    # leave it in is the window's alone, whatever the manager's pace.
    burst, limit = CONNECTIONS * EXECS, service.server.systemd.max_inflight
    service.server.systemd.max_inflight = 0
    try:
        for number, client in enumerate(users):
            for n in range(EXECS):
                exec_true(client, f"user-{number}-{n}", done)
        await until(lambda: window.queued_in(USER) == burst, f"{burst} queued")
        exec_true(owner, "owner", done)
        await until(lambda: window.queued_in(os.getuid()) == 1, "the owner's queued")
        # The stats say whose calls wait: the admin's view of the above.
        shares = service.server.stats()["users"]["users"]
        queued = {uid: shares[str(uid)]["calls-queued"] for uid in (USER, os.getuid())}
        assert queued == {USER: burst, os.getuid(): 1}
        owner_unit = service.server.find(label="owner").unit_name
    finally:  # opened whatever happens: the service's stop needs its calls
        service.server.systemd.max_inflight = limit
    await until(lambda: len(done) == burst + 1, "every exec ended", 300)
    # Measured with one queue for everyone: the owner's start left after
    # all 496 starts of a user's burst (8 connections of 62). In turns, it
    # waits for one call of each other lane with calls waiting: the user's.
    assert sent.index(owner_unit) <= 1
    assert len(sent) == burst + 1
    assert [outcome for outcome in done if isinstance(outcome, Failure)] == []


@ensureDeferred
async def test_every_call_for_a_unit_waits_in_the_unit_s_lane(user_manager):
    """On the bus client: each call for one unit (a listing of that unit
    alone included) is queued in the lane ``lane_of`` gives the unit, so
    that none overtakes another; a listing by a glob is the service's."""
    client = await SystemdClient.connect(user_manager.bus_address)
    client.lane_of = lambda unit: "user" if unit == UNIT else "other"
    client.max_inflight = 0  # held: every call stays queued
    try:
        calls = [
            client.stop_unit(UNIT),
            client.kill_unit(UNIT, "all", signal.SIGTERM),
            client.reset_failed_unit(UNIT),
            client.get_service_properties(UNIT),
            client.list_units_by_patterns([], [UNIT]),
            client.list_units_by_patterns([], ["sdexec-no-such-*"]),
        ]
        lanes = [client.window.queued_in(lane) for lane in ("user", SERVICE_LANE)]
        assert lanes == [5, 1]
        client.max_inflight = 64
        outcomes = await gatherResults(
            [call.addErrback(lambda failure: failure.type) for call in calls]
        )
        assert outcomes[-2:] == [[], []]  # answered: the lanes were served
    finally:
        client.disconnect()
        await client.disconnected


@ensureDeferred
async def test_a_start_still_queued_at_a_reload_that_revokes_its_user_is_refused(
    start_service, monkeypatch
):
    # The start had not left the window when the reload took its user out
    # of allow-users: it went out after, and the user's command ran.
    service = await start_service(sdexec=f"allow-users = [{USER}]")
    window = service.server.systemd.window
    sent = record_starts(service.server.systemd)
    [user] = await connect_as(service, monkeypatch, USER, 1)
    [owner] = await connect_as(service, monkeypatch, os.getuid(), 1)
    done: list = []
    service.server.systemd.max_inflight = 0  # held shut: both starts queue
    exec_true(user, "user", done)
    exec_true(owner, "owner", done)
    await until(lambda: window.queued == 2, "both starts queued")
    owner_unit = service.server.find(label="owner").unit_name
    # Reloaded without the user: the window opens again with the reload's
    # max-inflight, the owner's start goes, the user's never does.
    assert await service.reload()
    await until(lambda: len(done) == 2, "both execs answered")
    assert sent == [owner_unit]
    [refused] = [outcome for outcome in done if isinstance(outcome, Failure)]
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EPERM,
        f"uid {USER} is no longer in [sdexec] allow-users (a reload took it"
        " out): its exec was still queued for systemd, and never started",
    )
    assert window.queued == window.in_flight == 0
    assert service.server.find(label="user") is None


@ensureDeferred
async def test_a_start_withdrawn_goes_ahead_if_a_reload_puts_its_user_back_first(
    start_service, monkeypatch
):
    # Withdrawn by one reload, the start was refused at its turn though a
    # second reload had put its user back, "no longer in allow-users".
    service = await start_service(sdexec=f"allow-users = [{USER}]")
    window = service.server.systemd.window
    sent = record_starts(service.server.systemd)
    [user] = await connect_as(service, monkeypatch, USER, 1)
    done: list = []
    with monkeypatch.context() as held:
        # Shut through both reloads, which set the window's limit anew.
        held.setattr(CallWindow, "limit", property(lambda _: 0, lambda *_: None))
        exec_true(user, "user", done)
        await until(lambda: window.queued == 1, "the user's start queued")
        assert await service.reload()  # without the user
        assert await service.reload(sdexec=f"allow-users = [{USER}]")
    unit = service.server.find(label="user").unit_name
    window.limit = 64
    await until(lambda: len(done) == 1, "the exec answered")
    assert not isinstance(done[0], Failure), done[0]
    assert sent == [unit]


@ensureDeferred
async def test_a_kill_held_for_a_start_is_not_sent_once_a_reload_revokes_its_user(
    start_service, monkeypatch
):
    # A kill of the owner's process, held until it started: it went out
    # after the reload that took its user out of allow-users.
    service = await start_service(sdexec=f"allow-users = [{USER}]")
    window = service.server.systemd.window
    [user] = await connect_as(service, monkeypatch, USER, 1)
    [owner] = await connect_as(service, monkeypatch, os.getuid(), 1)
    service.server.systemd.max_inflight = 0  # held shut: the start queues
    responses: list = []
    job = owner.exec(command(["sleep", "300"], label="owner"), FLAGS, responses.append)
    await until(lambda: window.queued == 1, "the owner's start queued")
    killed: list = []
    user.kill(label="owner", signum=signal.SIGTERM).addBoth(killed.append)
    await until(lambda: service.server.counters["sdexec.kill"] == 1, "the kill")
    assert await service.reload()
    await until(lambda: killed, "the user's kill answered")
    [refused] = killed
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EPERM,
        f"uid {USER} is no longer in [sdexec] allow-users (a reload took it"
        " out): its signal 15, held until the process started, is not sent",
    )
    await until(lambda: any(r.get("type") == "started" for r in responses), "start")
    assert service.server.find(label="owner") is not None  # it runs on
    await owner.kill(label="owner", signum=signal.SIGKILL)
    await job.done
    assert job.receipt is not None
    assert job.receipt.status == signal.SIGKILL  # the owner's, not the user's
