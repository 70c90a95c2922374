"""The client's "manager absent" check offline (sdexec.systemd.bus): on a bus
that stays up without the manager, the client drops the bus after
``MANAGER_ABSENT_S`` so that its backoff reconnects to the bus address,
where a new manager may listen with a new bus (test_manager_killed.py runs
that against real managers). A fake bus and a Clock drive it here, and
the manager's bus name, whose signals alone the client takes."""

from __future__ import annotations

import asyncio
import errno

import pytest
from dbus_fast import Message, MessageType, Variant
from pytest_twisted import ensureDeferred
from support import sleep, until
from twisted.internet.task import Clock
from twisted.logger import capturedLogs, formatEvent

from sdexec.systemd import bus as bus_module
from sdexec.systemd.bus import (
    ALREADY_SUBSCRIBED,
    MANAGER_ABSENT_S,
    RECONNECT_ATTEMPT_S,
    SystemdClient,
    unit_object_path,
)
from sdexec.systemd.errors import SystemdError, errno_for, is_connection_lost
from sdexec.systemd.unanswered import SILENT_AFTER_S

DBUS = "org.freedesktop.DBus"
SYSTEMD = "org.freedesktop.systemd1"


class FakeBus:
    """What SystemdClient uses of a connected dbus-fast MessageBus; every
    method call (the Subscribe to a returned manager, the Gets of its
    cgroup and version) succeeds, ``GetNameOwner`` names the manager's
    :attr:`owner`, but those ``answers`` script (member → a function of the
    call, returning the reply)."""

    def __init__(self, answers: dict | None = None) -> None:
        self.owner = ":1.5"
        self.handlers: list = []
        self.calls: list[str] = []
        self.answers = dict(answers or {})
        self._closed = asyncio.get_running_loop().create_future()

    @property
    def _disconnected(self) -> bool:  # read by SystemdClient._call
        return self.disconnected

    async def call(self, message: Message) -> Message:
        self.calls.append(message.member)
        answer = self.answers.get(message.member)
        if answer is not None:
            reply = answer(message)
            return await reply if asyncio.iscoroutine(reply) else reply
        if message.member == "GetNameOwner":
            if not self.owner:
                return failed("org.freedesktop.DBus.Error.NameHasNoOwner")
            return Message(
                message_type=MessageType.METHOD_RETURN, reply_serial=1,
                signature="s", body=[self.owner],
            )  # fmt: skip
        return Message(message_type=MessageType.METHOD_RETURN, reply_serial=1)

    @property
    def disconnected(self) -> bool:
        return self._closed.done()

    def add_message_handler(self, handler) -> None:
        self.handlers.append(handler)

    async def wait_for_disconnect(self) -> None:
        await self._closed

    def disconnect(self) -> None:
        if not self._closed.done():
            self._closed.set_result(None)

    def owner_changed(self, old: str, new: str) -> None:
        self.owner = new
        signal = Message(
            message_type=MessageType.SIGNAL, sender=DBUS, path="/org/freedesktop/DBus",
            interface=DBUS, member="NameOwnerChanged", signature="sss",
            body=[SYSTEMD, old, new],
        )  # fmt: skip
        for handler in self.handlers:
            handler(signal)

    def reloading(self, active: bool, sender: str) -> None:
        signal = Message(
            message_type=MessageType.SIGNAL, sender=sender,
            path="/org/freedesktop/systemd1",
            interface="org.freedesktop.systemd1.Manager", member="Reloading",
            signature="b", body=[active],
        )  # fmt: skip
        for handler in self.handlers:
            handler(signal)

    def properties_changed(self, unit: str, changed: dict, sender: str) -> None:
        signal = Message(
            message_type=MessageType.SIGNAL, sender=sender, path=unit_object_path(unit),
            interface="org.freedesktop.DBus.Properties", member="PropertiesChanged",
            signature="sa{sv}as", body=["org.freedesktop.systemd1.Unit", changed, []],
        )  # fmt: skip
        for handler in self.handlers:
            handler(signal)


def connected_client(bus: FakeBus, clock: Clock) -> SystemdClient:
    async def never_reopened():
        raise AssertionError("not reconnected in this test")

    client = SystemdClient(bus, never_reopened, clock)  # type: ignore[arg-type]
    client.connected = True  # as SystemdClient.connect leaves it
    return client


@ensureDeferred
async def test_a_manager_gone_from_a_live_bus_drops_the_bus_after_the_delay():
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    lost: list[str] = []
    client.on_lost = lost.append
    bus.owner_changed(":1.5", "")
    assert (client.connected, lost) == (False, ["the systemd manager left the bus"])
    clock.advance(MANAGER_ABSENT_S - 0.1)
    assert not bus.disconnected
    clock.advance(0.1)
    assert bus.disconnected  # the backoff now reconnects to the address
    client.disconnect()
    assert clock.getDelayedCalls() == []


@ensureDeferred
async def test_the_check_ends_with_the_client():
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    bus.owner_changed(":1.5", "")
    assert len(clock.getDelayedCalls()) == 1
    client.disconnect()
    assert clock.getDelayedCalls() == []
    assert bus.disconnected


@ensureDeferred
async def test_a_manager_back_in_time_keeps_the_bus():
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    restored: list[bool] = []
    client.on_restored = lambda: restored.append(True)
    bus.owner_changed(":1.5", "")
    clock.advance(MANAGER_ABSENT_S / 2)
    bus.owner_changed("", ":1.9")
    await until(lambda: restored, "the Subscribe's reply")
    # Subscribed again, and its cgroup (where a lost unit's is) and version
    # read.
    assert bus.calls == ["Subscribe", "GetNameOwner", "Get", "Get"]
    assert (restored, client.connected) == ([True], True)
    clock.advance(SILENT_AFTER_S)  # past the absent check's time
    assert not bus.disconnected
    assert clock.getDelayedCalls() == []  # nor any timer left armed
    client.disconnect()


@ensureDeferred
async def test_on_call_given_to_connect_sees_the_connection_s_own_calls(monkeypatch):
    # Set once connect had returned, the service's hook missed the start's
    # Subscribe and Version read (review session 40 M M4); the client keeps
    # it, so a resubscription is seen too.
    buses: list[FakeBus] = []

    async def open_bus(address, system):
        buses.append(FakeBus())
        return buses[-1]

    monkeypatch.setattr(bus_module, "_open_bus", open_bus)
    observed: list[tuple[str, bool]] = []
    client = await SystemdClient.connect(
        clock=Clock(), on_call=lambda member, seconds, ok: observed.append((member, ok))
    )
    subscribed = [
        ("Subscribe", True),
        ("GetNameOwner", True),
        ("Get", True),
        ("Get", True),
    ]
    assert observed == [*[("AddMatch", True)] * 3, *subscribed]
    del observed[:]
    buses[0].owner_changed(":1.5", "")
    buses[0].owner_changed("", ":1.9")
    await until(lambda: client.connected, "subscribed again")
    assert observed == subscribed
    client.disconnect()


@ensureDeferred
async def test_a_re_executed_manager_s_already_subscribed_is_observed_as_ok():
    # A re-executed manager keeps its subscribers and answers the
    # resubscription AlreadySubscribed, which the client takes as success:
    # observed as an error, every daemon-reexec (each systemd upgrade)
    # paged an alert on the histogram's error outcome (review session 43
    # M5-2).
    def already(message: Message) -> Message:
        return failed(ALREADY_SUBSCRIBED, sender=":1.5")

    bus, clock = FakeBus({"Subscribe": already}), Clock()
    client = connected_client(bus, clock)
    observed: list[tuple[str, bool]] = []
    client.on_call = lambda member, seconds, ok: observed.append((member, ok))
    bus.owner_changed(":1.5", "")
    bus.owner_changed("", ":1.9")
    await until(lambda: client.connected, "subscribed again")
    assert ("Subscribe", True) in observed
    assert all(ok for _member, ok in observed)
    client.disconnect()


def failed(name: str, sender: str = DBUS, text: str | None = None) -> Message:
    """An error reply, by default the bus's own, saying ``text`` (its name
    if not given)."""
    return Message(
        message_type=MessageType.ERROR, reply_serial=1, error_name=name,
        signature="s", body=[text or name], sender=sender,
    )  # fmt: skip


@pytest.mark.parametrize("get_answered", [False, True], ids=["lost", "answered"])
@ensureDeferred
async def test_a_manager_that_leaves_while_being_subscribed_is_not_back(
    get_answered,
):
    # A crash loop: the manager answers Subscribe, then leaves before the
    # Get of its cgroup is answered (its version's then follows). Taken for
    # back, the client cancelled the absent check and never subscribed the
    # next manager.
    # Its Get lost with it, or answered, its departure read in the same
    # pass (both then in the client's hands before the subscription ends).
    def get_then_leave(message: Message) -> Message:
        del bus.answers["Get"]  # the next manager answers it
        bus.owner_changed(":1.9", "")
        if get_answered:
            return Message(
                message_type=MessageType.METHOD_RETURN, reply_serial=1,
                signature="v", body=[Variant("s", "/init.scope")],
            )  # fmt: skip
        return failed("org.freedesktop.DBus.Error.NoReply")

    bus, clock = FakeBus({"Get": get_then_leave}), Clock()
    client = connected_client(bus, clock)
    restored: list[bool] = []
    client.on_restored = lambda: restored.append(True)
    bus.owner_changed(":1.5", "")
    bus.owner_changed("", ":1.9")
    await until(
        # The version's Get follows an answered one; a lost one ends it.
        lambda: (
            bus.calls == ["Subscribe", "GetNameOwner", "Get", "Get"][: 3 + get_answered]
        ),
        "subscribed, then left",
    )
    assert not client.connected and restored == []
    assert client._absent_timer is not None and client._absent_timer.active()
    bus.owner_changed("", ":1.10")  # one comes back for good
    await until(lambda: restored, "the next manager subscribed")
    assert client.connected and bus.calls.count("Subscribe") == 2
    client.disconnect()  # its bus's wait for a disconnect ends with it


@ensureDeferred
async def test_a_re_executed_manager_whose_subscribe_fails_is_tried_again():
    # Its owner goes straight from the old to the new: no departure arms
    # the absent check, and nothing else would have retried.
    bus, clock = FakeBus({"Subscribe": lambda _: failed("org.example.Busy")}), Clock()
    client = connected_client(bus, clock)
    bus.owner_changed(":1.5", ":1.9")
    await until(lambda: bus.calls == ["Subscribe"], "the Subscribe failed")
    assert not client.connected
    clock.advance(MANAGER_ABSENT_S)
    assert bus.disconnected  # the backoff reconnects to the bus address


@ensureDeferred
async def test_a_call_on_a_bus_closed_but_not_yet_heard_of_fails_at_once():
    # dbus-fast closes the bus a loop pass or two before the client hears
    # of it: a call sent meanwhile would never be answered, its window slot
    # taken for good.
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    bus.disconnect()
    outcome = []
    client.kill_unit("x.service", "all", 15).addBoth(outcome.append)
    await until(lambda: outcome, "the call ended")
    assert "reconnecting to systemd" in str(outcome[0].value)
    assert client.window.in_flight == 0


@ensureDeferred
async def test_only_the_managers_own_signals_are_taken():
    # Any peer may send a signal to the client's unique name (the system
    # bus lets every local user): a forged "exited" finished a running job
    # with a made-up status and stopped it.
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    bus.owner_changed(":1.5", ":1.9")  # re-executed: subscribed anew
    await until(lambda: client.connected and "Get" in bus.calls, "subscribed")
    seen: list[str] = []
    client.watch_unit("job.service", lambda state: seen.append(state["SubState"]))
    for sender, state in [(":1.666", "exited"), (":1.9", "running"), (None, "dead")]:
        bus.properties_changed("job.service", {"SubState": Variant("s", state)}, sender)
    assert seen == ["running"]
    bus.owner_changed(":1.9", "")  # it died; a new one came
    bus.owner_changed("", ":1.10")
    await until(lambda: client.connected, "subscribed to the new one")
    bus.properties_changed("job.service", {"SubState": Variant("s", "failed")}, ":1.9")
    bus.properties_changed("job.service", {"SubState": Variant("s", "dead")}, ":1.10")
    assert seen == ["running", "dead"]
    client.disconnect()


@ensureDeferred
async def test_the_manager_s_reload_is_told_once_as_it_begins():
    # Its starts still queued may be dropped (sdexec.process): only the
    # manager's own signal, and only its start (true), not its end.
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    bus.owner_changed(":1.5", ":1.9")
    await until(lambda: client.connected and "Get" in bus.calls, "subscribed")
    reloads: list[None] = []
    client.on_reloading = lambda: reloads.append(None)
    bus.reloading(True, ":1.666")  # forged
    bus.reloading(True, ":1.9")
    bus.reloading(False, ":1.9")
    assert len(reloads) == 1
    client.disconnect()


#: What the client logs having handled a returned manager's Subscribe that
#: failed (after which it arms the absent check, unless disconnected).
SUBSCRIBE_FAILED = "Subscribe to the returned systemd manager failed: "


#: What the client logs back on a bus whose Subscribe said the manager is
#: not on it (after which it waits there, the absent check armed).
MANAGER_AWAITED = "D-Bus is back; waiting for the systemd manager"


def logged(events: list[dict], text: str) -> bool:
    """Whether one of the captured log ``events`` says ``text``."""
    return any(text in formatEvent(event) for event in events)


@ensureDeferred
async def test_no_absent_check_is_armed_once_disconnected():
    # A returning manager's Subscribe cut short by disconnect() failed, and
    # armed the check disconnect() had just cancelled.
    cut_short = asyncio.get_running_loop().create_future()

    async def subscribe(message):
        await cut_short
        return failed("org.freedesktop.DBus.Error.Disconnected")

    bus, clock = FakeBus({"Subscribe": subscribe}), Clock()
    client = connected_client(bus, clock)
    bus.owner_changed(":1.5", ":1.9")  # re-executed: Subscribe goes out
    await until(lambda: bus.calls == ["Subscribe"], "the Subscribe sent")
    client.disconnect()
    with capturedLogs() as events:
        cut_short.set_result(None)
        await until(lambda: client.disconnected.called, "closed")
        await until(lambda: logged(events, SUBSCRIBE_FAILED), "its failure handled")
    assert clock.getDelayedCalls() == []


#: What dbus-daemon (seen: 1.14, the manager killed) and dbus-broker answer
#: a call without auto-start to a name nobody owns.
NO_OWNER = "org.freedesktop.DBus.Error.NameHasNoOwner"


@pytest.mark.parametrize(
    "answer", [NO_OWNER, "org.freedesktop.DBus.Error.ServiceUnknown"]
)
@ensureDeferred
async def test_back_on_a_bus_without_the_manager_it_waits_there(answer):
    # Only ServiceUnknown (an auto-start's answer) was known: with the real
    # NameHasNoOwner the client dropped that bus and reconnected every
    # 0.1-5 s, hearing the manager's return up to 5 s late (review session
    # 31 G F3).
    clock, first, buses = Clock(), FakeBus(), []

    async def reopen():
        buses.append(FakeBus({"Subscribe": lambda message: failed(answer)}))
        buses[-1].owner = ""
        return buses[-1]

    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    restored: list[bool] = []
    client.on_restored = lambda: restored.append(True)
    with capturedLogs() as events:
        first.disconnect()
        # The Subscribe's failure handled: the client waits on that bus.
        await until(lambda: logged(events, MANAGER_AWAITED), "back on the bus")
    assert "Subscribe" in buses[0].calls
    del buses[0].answers["Subscribe"]
    buses[0].owner = ":1.9"
    buses[0].owner_changed("", ":1.9")
    await until(lambda: restored, "the manager's return heard on that bus")
    assert not buses[0].disconnected and len(buses) == 1
    client.disconnect()


@ensureDeferred
async def test_a_call_answered_as_the_manager_leaves_is_eagain():
    # The bus answers a call sent as the manager left, before its
    # NameOwnerChanged reached the client: it was EIO, a start refused and
    # a kill for a client that left never made again (review session 31 G F3).
    def gone(message: Message) -> Message:
        bus.owner_changed(":1.5", "")
        return failed(NO_OWNER)

    bus, clock = FakeBus({"KillUnit": gone}), Clock()
    client = connected_client(bus, clock)
    outcome: list = []
    client.kill_unit("x.service", "all", 15).addBoth(outcome.append)
    await until(lambda: outcome, "answered")
    error = outcome[0].value
    assert is_connection_lost(error) and errno_for(error) == errno.EAGAIN
    assert "the manager is not on the bus" in str(error)
    client.disconnect()


@ensureDeferred
async def test_a_call_lost_with_its_connection_is_observed_as_failed():
    # on_call came only with a reply: calls lost as systemd restarted or
    # the bus dropped showed in neither outcome of the calls' histogram.
    def lost(message: Message) -> Message:
        bus.disconnect()
        raise EOFError()

    bus, clock = FakeBus({"KillUnit": lost}), Clock()
    client = connected_client(bus, clock)
    observed: list = []
    client.on_call = lambda member, seconds, ok: observed.append((member, ok))
    outcome: list = []
    client.kill_unit("x.service", "all", 15).addBoth(outcome.append)
    await until(lambda: outcome, "answered")
    assert is_connection_lost(outcome[0].value)
    assert observed == [("KillUnit", False)]
    client.disconnect()


@ensureDeferred
async def test_the_manager_s_own_no_owner_answer_is_its_error():
    # libsystemd turns ENXIO into NameHasNoOwner: from the manager itself it
    # is that call's failure, not the manager gone (review session 31 H F4).
    def refused(message: Message) -> Message:
        return failed(NO_OWNER, sender=":1.5")

    bus, clock = FakeBus({"KillUnit": refused}), Clock()
    client = connected_client(bus, clock)
    outcome: list = []
    client.kill_unit("x.service", "all", 15).addBoth(outcome.append)
    await until(lambda: outcome, "answered")
    assert not is_connection_lost(outcome[0].value)
    client.disconnect()


@ensureDeferred
async def test_disconnect_while_reconnecting_fires_disconnected():
    # disconnect() as a reconnection's AddMatch was in flight: the call
    # failed first (dbus-fast fails a closed bus's calls in the pass that
    # ends its wait for a disconnect), the reconnection gave the bus up,
    # and its close was then ignored as "one given up on": disconnected
    # never fired, and a service stopping waited on it for ever.
    clock, first, buses = Clock(), FakeBus(), []

    async def add_match(message):
        await buses[-1]._closed  # answered only as the bus closes
        raise EOFError()

    async def reopen():
        buses.append(FakeBus({"AddMatch": add_match}))
        return buses[-1]

    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    first.disconnect()
    await until(lambda: buses and "AddMatch" in buses[0].calls, "reconnecting")
    client.disconnect()
    await until(lambda: client.disconnected.called, "disconnected fired")


@ensureDeferred
async def test_a_manager_that_does_not_answer_is_told_not_lost():
    # A wedged manager: on the bus, subscribed, answering nothing. Calls
    # have no timeout (a start it took goes on anyway); it is told.
    answer = asyncio.get_running_loop().create_future()

    async def stop_unit(message):
        return await answer

    bus, clock = FakeBus({"StopUnit": stop_unit}), Clock()
    client = connected_client(bus, clock)
    stopped = client.stop_unit("job.service")
    await until(lambda: bus.calls == ["StopUnit"], "the call sent")
    clock.advance(SILENT_AFTER_S)
    silence = client.silence()
    assert silence is not None and (silence.member, silence.waiting) == ("StopUnit", 1)
    assert client.calls_waiting() == {
        "unanswered": 1,
        "queued": 0,
        "oldest": {"call": "StopUnit", "seconds": SILENT_AFTER_S},
    }
    assert client.connected  # not lost: nothing is failed or drained
    reply = Message(
        message_type=MessageType.METHOD_RETURN, reply_serial=1,
        signature="o", body=["/org/freedesktop/systemd1/job/7"],
    )  # fmt: skip
    answer.set_result(reply)
    assert await stopped == "/org/freedesktop/systemd1/job/7"
    assert client.silence() is None and client.calls_waiting()["unanswered"] == 0
    client.disconnect()
    assert clock.getDelayedCalls() == []


@ensureDeferred
async def test_no_manager_at_the_first_connect_is_said_with_the_bus_s_words(
    monkeypatch,
):
    # A user bus with no user manager on it (the user not logged in, no
    # linger): what to do, and what the bus said, in one line.
    # (Parentheses in it: they were taken for the end of sdexec's words.)
    said = "Name 'org.freedesktop.systemd1' has no owner (not activatable)"

    async def open_bus(address, system):
        bus = FakeBus({"Subscribe": lambda message: failed(NO_OWNER, text=said)})
        bus.owner = ""
        return bus

    monkeypatch.setattr("sdexec.systemd.bus._open_bus", open_bus)
    with pytest.raises(SystemdError) as refused:
        await SystemdClient.connect("unix:path=/nonexistent", clock=Clock())
    assert str(refused.value).startswith("no systemd manager on this bus: ")
    assert str(refused.value).endswith(f" ({said})")


async def settled(condition, what: str) -> None:
    """Let the reactor run passes (no time on the Clock) until
    ``condition()``: a reconnection takes a few."""
    for _ in range(1000):
        if condition():
            return
        await sleep(0)
    raise AssertionError(f"never happened: {what}")


@ensureDeferred
async def test_a_manager_long_away_from_a_live_bus_is_logged_once_then_rarely():
    # Its bus up, the manager gone: the client reconnects to the bus address
    # every 5 s and logged two lines each time ("no systemd manager on the
    # bus for 5 s", "D-Bus is back"), for as long as it was away (review
    # session 45).
    clock, first, buses = Clock(), FakeBus(), []

    async def reopen():
        buses.append(FakeBus({"Subscribe": lambda message: failed(NO_OWNER)}))
        buses[-1].owner = ""
        return buses[-1]

    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    with capturedLogs() as events:
        first.owner_changed(":1.5", "")
        for cycle in range(1, 121):  # 10 minutes, a reconnection each 5 s
            clock.advance(MANAGER_ABSENT_S)
            await settled(
                lambda cycle=cycle: len(buses) == cycle and clock.getDelayedCalls(),
                f"reconnection {cycle} waits for the manager",
            )
        back = buses[-1]
        del back.answers["Subscribe"]
        back.owner_changed("", ":1.9")
        await until(lambda: client.connected, "the manager's return")
    assert [formatEvent(event) for event in events] == [
        "systemd connection lost: the systemd manager left the bus",
        *[
            f"systemd away for {seconds} s: reconnecting to the bus address"
            " every 5 s while no manager is on the bus (a new manager may"
            " listen there with a new bus)"
            for seconds in (60, 180, 420)
        ],
        "systemd connection restored after 600 s",
    ]
    client.disconnect()


def _stalled() -> asyncio.Future:
    """A future nothing ever sets: a bus that never answers."""
    return asyncio.get_running_loop().create_future()


@ensureDeferred
async def test_a_reconnection_the_bus_never_answers_is_abandoned_and_redialled():
    # A bus that stalled mid-reconnection (the orphan dbus-daemon of a
    # killed manager, stopped) held the reconnection for ever: no attempt
    # was ever made again, and a new bus at the address never reached
    # (review session 48 L1). Here the first redial's authentication never
    # completes, the second bus never answers its AddMatch, the third does.
    clock, first, buses = Clock(), FakeBus(), []
    dialled: list[int] = []

    async def never_answered(message):
        await _stalled()

    async def reopen():
        dialled.append(len(dialled) + 1)
        if len(dialled) == 1:
            await _stalled()  # connect or authentication stalled
        answers = {"AddMatch": never_answered} if len(dialled) == 2 else {}
        buses.append(FakeBus(answers))
        return buses[-1]

    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    with capturedLogs() as events:
        first.disconnect()
        await settled(lambda: dialled == [1], "the first redial stalls")
        clock.advance(RECONNECT_ATTEMPT_S)
        await settled(lambda: logged(events, "attempt 1 failed"), "abandoned")
        clock.advance(0.1)  # the backoff's first delay
        await settled(lambda: buses and "AddMatch" in buses[0].calls, "2nd stalls")
        clock.advance(RECONNECT_ATTEMPT_S - 0.1)
        assert not buses[0].disconnected and dialled == [1, 2]
        clock.advance(0.1)
        await settled(lambda: buses[0].disconnected, "its connection closed")
        clock.advance(0.2)  # the backoff's second delay
        await settled(lambda: client.connected, "back on the third")
    assert dialled == [1, 2, 3] and not buses[1].disconnected
    abandoned = (
        "the bus did not complete the reconnection within"
        f" {RECONNECT_ATTEMPT_S:g} s; abandoned"
    )
    assert logged(events, abandoned)
    client.disconnect()
    await settled(lambda: clock.getDelayedCalls() == [], "no timer left")


@ensureDeferred
async def test_disconnect_ends_a_stalled_reconnection_and_its_bound():
    # disconnect() as a redial's authentication stalled: the attempt is
    # cancelled at once, its bound with it.
    clock, first = Clock(), FakeBus()
    dialled: list[bool] = []

    async def reopen():
        dialled.append(True)
        await _stalled()

    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    first.disconnect()
    await settled(lambda: dialled, "the redial stalls")
    client.disconnect()
    await settled(lambda: client.disconnected.called, "disconnected fired")
    await settled(lambda: clock.getDelayedCalls() == [], "its bound cancelled")


async def _never_answered(message):
    await _stalled()


@ensureDeferred
async def test_a_returned_manager_s_subscribe_never_answered_redials():
    # A re-executed manager, its Subscribe never answered, and the bus
    # stalled as it came back (its check not answered either): nothing
    # else would try again. It is abandoned once a period passes without
    # the bus answering, and the absent check reconnects to the bus address.
    clock, first, buses = Clock(), FakeBus(), []

    async def reopen():
        buses.append(FakeBus())
        return buses[-1]

    first.answers["Subscribe"] = _never_answered
    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    with capturedLogs() as events:
        first.owner_changed(":1.5", ":1.9")
        await settled(lambda: "Subscribe" in first.calls, "the Subscribe sent")
        first.answers["GetNameOwner"] = _never_answered  # the bus stalls
        clock.advance(RECONNECT_ATTEMPT_S)
        await settled(lambda: "GetNameOwner" in first.calls, "the bus checked")
        clock.advance(RECONNECT_ATTEMPT_S - 0.1)
        await settled(lambda: clock.getDelayedCalls(), "still waiting")
        assert not logged(events, SUBSCRIBE_FAILED)
        clock.advance(0.1)
        await settled(lambda: logged(events, SUBSCRIBE_FAILED), "abandoned")
        assert logged(
            events,
            f"the bus did not answer within {RECONNECT_ATTEMPT_S:g} s while the"
            f" Subscribe waited {2 * RECONNECT_ATTEMPT_S:g} s for the systemd"
            " manager; abandoned",
        )
        clock.advance(MANAGER_ABSENT_S)
        await settled(lambda: client.connected, "back on a new connection")
    assert first.disconnected and len(buses) == 1
    client.disconnect()
    await settled(lambda: clock.getDelayedCalls() == [], "no timer left")


class _SlowManager:
    """A manager that answers each Subscribe only once :meth:`answer` is
    called (a long daemon-reexec), on a bus that answers at once."""

    def __init__(self) -> None:
        self.waiting: list[asyncio.Future] = []

    async def subscribe(self, message: Message) -> Message:
        self.waiting.append(asyncio.get_running_loop().create_future())
        await self.waiting[-1]
        return Message(message_type=MessageType.METHOD_RETURN, reply_serial=1)

    def answer(self) -> None:
        for waiting in self.waiting:
            waiting.set_result(None)


@ensureDeferred
async def test_a_reconnection_to_a_manager_slow_to_subscribe_waits_for_it():
    # A manager that took over 25 s to answer the Subscribe (a very long
    # daemon-reexec) cost a redial every ~30 s, each Subscribe queued again
    # behind the ones it had not read, until one came within 25 s (review
    # session 48). Its bus answering, the connection is kept.
    clock, first, buses, manager = Clock(), FakeBus(), [], _SlowManager()

    async def reopen():
        buses.append(FakeBus({"Subscribe": manager.subscribe}))
        return buses[-1]

    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    with capturedLogs() as events:
        first.disconnect()
        await settled(lambda: manager.waiting, "the Subscribe sent")
        for period in range(1, 5):  # 100 s
            clock.advance(RECONNECT_ATTEMPT_S)
            await settled(
                lambda period=period: buses[0].calls.count("GetNameOwner") == period,
                f"the bus checked in period {period}",
            )
        manager.answer()
        await settled(lambda: client.connected, "back")
    assert len(buses) == 1 and not buses[0].disconnected
    assert len(manager.waiting) == 1  # one Subscribe, never sent again
    waited = [
        formatEvent(event)
        for event in events
        if "the systemd manager has not" in formatEvent(event)
    ]
    assert waited == [
        "the systemd manager has not answered the reconnection within 25 s, and"
        " its bus answers: waiting for the manager (a long daemon-reexec?) while"
        " the bus answers a check every 25 s"
    ]
    client.disconnect()
    await settled(lambda: clock.getDelayedCalls() == [], "no timer left")


@ensureDeferred
async def test_a_returned_manager_slow_to_subscribe_is_waited_for_on_its_bus():
    clock, first, manager = Clock(), FakeBus(), _SlowManager()

    async def reopen():
        raise AssertionError("its bus answers: not redialled")

    first.answers["Subscribe"] = manager.subscribe
    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    with capturedLogs() as events:
        first.owner_changed(":1.5", ":1.9")
        await settled(lambda: manager.waiting, "the Subscribe sent")
        for period in range(1, 5):
            clock.advance(RECONNECT_ATTEMPT_S)
            await settled(
                lambda period=period: first.calls.count("GetNameOwner") == period,
                f"the bus checked in period {period}",
            )
        manager.answer()
        await settled(lambda: client.connected, "back")
    assert not first.disconnected and not logged(events, SUBSCRIBE_FAILED)
    client.disconnect()
    await settled(lambda: clock.getDelayedCalls() == [], "no timer left")


@ensureDeferred
async def test_a_reconnection_whose_bus_stalls_while_the_manager_is_awaited_redials():
    # AddMatch answered, then the bus stalls: neither the Subscribe nor the
    # check of the bus is answered. Abandoned a period after the last
    # answer, and dialled again.
    clock, first, buses = Clock(), FakeBus(), []

    async def reopen():
        stalled = {"Subscribe": _never_answered, "GetNameOwner": _never_answered}
        buses.append(FakeBus(stalled if not buses else {}))
        return buses[-1]

    client = SystemdClient(first, reopen, clock)  # type: ignore[arg-type]
    client.connected = True
    with capturedLogs() as events:
        first.disconnect()
        await settled(lambda: buses and "Subscribe" in buses[0].calls, "sent")
        clock.advance(RECONNECT_ATTEMPT_S)
        await settled(lambda: "GetNameOwner" in buses[0].calls, "the bus checked")
        clock.advance(RECONNECT_ATTEMPT_S - 0.1)
        assert not buses[0].disconnected
        clock.advance(0.1)
        await settled(lambda: buses[0].disconnected, "abandoned")
        clock.advance(0.1)  # the backoff's first delay
        await settled(lambda: client.connected, "back on the second")
    assert len(buses) == 2
    assert logged(
        events,
        f"the bus did not answer within {RECONNECT_ATTEMPT_S:g} s while the"
        f" reconnection waited {2 * RECONNECT_ATTEMPT_S:g} s for the systemd"
        " manager; abandoned",
    )
    client.disconnect()
    await settled(lambda: clock.getDelayedCalls() == [], "no timer left")


@ensureDeferred
async def test_a_call_queued_in_the_window_when_systemd_goes_is_never_sent():
    # A call still queued behind the window when the connection drops never
    # reached systemd, and failed as "systemd connection lost", which says
    # a start may have been made (review session 48 L3): it says it was
    # never sent, and is EAGAIN all the same.
    async def kill_unit(message):
        await bus._closed  # answered only as the bus closes
        raise EOFError()

    bus, clock = FakeBus({"KillUnit": kill_unit}), Clock()
    client = connected_client(bus, clock)
    client.max_inflight = 1
    in_flight, queued = [], []
    client.kill_unit("a.service", "all", 15).addErrback(in_flight.append)
    client.stop_unit("b.service").addErrback(queued.append)
    await until(lambda: bus.calls == ["KillUnit"], "the first sent")
    bus.disconnect()
    await until(lambda: queued and in_flight, "both failed")
    error = queued[0].value
    assert is_connection_lost(error) and errno_for(error) == errno.EAGAIN
    assert str(error) == (
        "systemd connection lost before the call was sent (the D-Bus"
        " connection closed): it was never made, retry"
    )
    assert bus.calls == ["KillUnit"]  # the queued one never went out
    assert str(in_flight[0].value).startswith("systemd connection lost: ")
    client.disconnect()


def _abandoned_first(where: str) -> str:
    return (
        f"systemd connection lost: the bus did not complete the connection to"
        f" {where} within {RECONNECT_ATTEMPT_S:g} s; abandoned"
    )


@pytest.mark.parametrize("stalls", ["authentication", "AddMatch"])
@ensureDeferred
async def test_a_first_connection_the_bus_never_completes_fails_naming_it(stalls):
    # A socket that accepts and never authenticates (or a bus that never
    # answers the match rules) held the service's start for ever without a
    # word: under the shipped units, 5 minutes, a SIGTERM and a restart into
    # the same wait (review session 50, ops F6). Bounded as a reconnection.
    clock, buses = Clock(), []

    async def reopen():
        if stalls == "authentication":
            await _stalled()
        buses.append(FakeBus({"AddMatch": _never_answered}))
        return buses[-1]

    outcome: list = []
    connecting = SystemdClient.connect_with(reopen, clock, where="D-Bus at X")
    connecting.addBoth(outcome.append)
    await settled(lambda: stalls == "authentication" or buses, "the bus opened")
    clock.advance(RECONNECT_ATTEMPT_S - 0.1)
    await settled(lambda: True, "a pass")
    assert outcome == []
    clock.advance(0.1)
    await settled(lambda: outcome, "abandoned")
    [failure] = outcome
    assert failure.check(SystemdError)
    assert str(failure.value) == _abandoned_first("D-Bus at X")
    assert all(bus.disconnected for bus in buses)  # no socket left open
    assert clock.getDelayedCalls() == []


@ensureDeferred
async def test_a_first_connection_waits_for_a_slow_manager_while_its_bus_answers():
    # The bound is the bus's, not the manager's: a first Subscribe that a
    # manager answers late (a daemon-reexec as the service starts) is
    # waited for while the bus answers a check each period.
    clock, manager, buses = Clock(), _SlowManager(), []

    async def reopen():
        buses.append(FakeBus({"Subscribe": manager.subscribe}))
        return buses[-1]

    outcome: list = []
    SystemdClient.connect_with(reopen, clock).addBoth(outcome.append)
    await settled(lambda: manager.waiting, "the Subscribe sent")
    for period in range(1, 4):
        clock.advance(RECONNECT_ATTEMPT_S)
        await settled(
            lambda period=period: buses[0].calls.count("GetNameOwner") == period,
            f"the bus checked in period {period}",
        )
    assert outcome == []
    manager.answer()
    await settled(lambda: outcome, "connected")
    [client] = outcome
    assert isinstance(client, SystemdClient) and client.connected
    assert len(buses) == 1
    client.disconnect()
    await settled(lambda: clock.getDelayedCalls() == [], "no timer left")


@ensureDeferred
async def test_a_call_on_a_bus_closed_unheard_is_no_answer_of_the_manager():
    # dbus-fast has closed the bus, and the client has not heard yet: the
    # call is never sent, and counted as answered it passed for the
    # manager's life (a shutdown's progress, docs/operating.md).
    bus, clock = FakeBus(), Clock()
    client = connected_client(bus, clock)
    bus.disconnect()
    failures: list[SystemdError] = []
    kill = client.kill_unit("x.service", "all", 15)
    kill.addErrback(lambda failure: failures.append(failure.value))
    await until(lambda: failures, "the kill failed")
    assert str(failures[0]) == "reconnecting to systemd"
    assert (bus.calls, client.calls_answered) == ([], 0)
    client.disconnect()
