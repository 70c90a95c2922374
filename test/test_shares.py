"""Each user's share of the process caps (sdexec/shares.py): a user of
``allow-users`` is bounded by the ``-per-user`` keys, and takes nothing of
the owner's ``max-waitable``, ``max-background``, ``max-processes``
(offline, with a FakeManager; the accounting is the service's own)."""

from __future__ import annotations

import errno
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text
from pytest_twisted import ensureDeferred
from test_background import (
    USER,
    WAITABLE,
    Client,
    finish,
    make_server,
    payloads,
    user_client,
)
from test_server import FLAGS
from twisted.internet import reactor

import sdexec.connection
from sdexec.config import parse_config
from sdexec.containment import Containment
from sdexec.metrics import Metrics, Scrape
from sdexec.shares import STATS_USERS
from sdexec.systemd.window import SERVICE_LANE
from sdexec.testing import FakeManager

#: Caps small enough to fill: the owner's, then each other user's.
CAPS = {
    "allow-users": [USER],
    "max-waitable": 2,
    "max-waitable-per-user": 1,
    "max-background": 2,
    "max-background-per-user": 1,
    "max-processes": 8,
    "max-processes-per-user": 4,
}


@pytest.fixture
def systemd():
    manager = FakeManager()
    manager.stop_to_inactive = True  # a stop reaps: a wait's end is kept
    yield manager
    manager.close()


def _unit(name: str) -> dict:
    return {"SDEXEC_NAME": f"sdexec-{name}"}


def _streaming(client: Client, name: str, matchtag: int) -> None:
    cmd = {"cmdline": ["/bin/true"], "opts": _unit(name)}
    client.send("sdexec.exec", {"flags": FLAGS, "cmd": cmd}, matchtag)


def _started(systemd: FakeManager, name: str) -> bool:
    """Whether the unit of ``_unit(name)`` was started (not refused)."""
    return ("start", f"sdexec-{name}.service") in systemd.calls


def _refusal(what: str, count: str, key: str, uid: int | None = None) -> tuple:
    whose = f" of uid {uid}" if uid is not None else ""
    return (errno.EAGAIN, f"{what}{whose}: {count}, the most [sdexec] {key} allows")


@pytest.mark.parametrize(
    ("flags", "what", "count", "key", "reaps"),
    [
        (
            WAITABLE,
            "flags: too many waitable processes",
            "{} running or not yet waited for",
            "max-waitable",
            " (sdexec wait reaps one)",
        ),
        (0, "too many background processes", "{} running", "max-background", ""),
    ],
)
def test_a_user_fills_its_own_share_and_leaves_the_owner_s_whole(
    systemd, monkeypatch, flags, what, count, key, reaps
):
    # A fuzz's one allow-users user held 944 waitable slots and 1.1 GB of
    # retained output, and the owner (the resource manager) got EAGAIN.
    server = make_server(systemd, **CAPS)
    owner, user = Client(server), user_client(server, monkeypatch)
    user.bg(flags=flags, matchtag=1, **_unit("u1"))
    user.bg(flags=flags, matchtag=2, **_unit("u2"))
    errnum, errstr = _refusal(what, count.format(1), f"{key}-per-user", USER)
    assert payloads(user.of(2)) == [(errnum, errstr + reaps)]
    for matchtag in (1, 2):  # the owner has all of its own
        owner.bg(flags=flags, matchtag=matchtag, **_unit(f"o{matchtag}"))
        assert _started(systemd, f"o{matchtag}")
    owner.bg(flags=flags, matchtag=3, **_unit("o3"))
    errnum, errstr = _refusal(what, count.format(2), key)
    assert payloads(owner.of(3)) == [(errnum, errstr + reaps)]
    assert not _started(systemd, "u2") and not _started(systemd, "o3")


def test_a_user_s_processes_take_none_of_the_owner_s_max_processes(
    systemd, monkeypatch
):
    caps = {"max-processes": 2, "max-processes-per-user": 1}
    server = make_server(systemd, **{**CAPS, **caps})
    owner, user = Client(server), user_client(server, monkeypatch)
    _streaming(user, "u1", 1)
    _streaming(user, "u2", 2)
    assert payloads(user.of(2)) == [
        _refusal("too many processes", "1 tabled", "max-processes-per-user", USER)
    ]
    _streaming(owner, "o1", 1)
    _streaming(owner, "o2", 2)
    _streaming(owner, "o3", 3)
    assert payloads(owner.of(3)) == [
        _refusal("too many processes", "2 tabled", "max-processes")
    ]
    assert [name for call, name in systemd.calls if call == "start"] == [
        "sdexec-u1.service",
        "sdexec-o1.service",
        "sdexec-o2.service",
    ]


@ensureDeferred
async def test_a_user_s_ended_waitable_process_holds_its_slot_until_waited_for(
    systemd, monkeypatch
):
    server = make_server(systemd, **CAPS)
    user = user_client(server, monkeypatch)
    user.bg(flags=WAITABLE, label="w", matchtag=1, **_unit("t"))
    systemd.run("sdexec-t.service", pid=7)
    await finish(systemd, server, status=0)
    user.bg(flags=WAITABLE, matchtag=2, **_unit("u2"))
    assert payloads(user.of(2))[0][0] == errno.EAGAIN
    assert not _started(systemd, "u2")
    assert server.stats()["users"]["users"][str(USER)]["waitable"] == 1
    user.send("sdexec.wait", {"label": "w"}, matchtag=3)
    assert payloads(user.of(3))[0]["status"] == 0
    user.bg(flags=WAITABLE, matchtag=4, **_unit("u4"))
    assert _started(systemd, "u4")


def test_a_reload_changes_a_user_s_share_from_the_next_request(systemd, monkeypatch):
    server = make_server(systemd, **CAPS)
    user = user_client(server, monkeypatch)
    user.bg(matchtag=1, **_unit("u1"))
    config = parse_config({"sdexec": {**CAPS, "max-background-per-user": 2}})
    server.reconfigure(config, Containment(config, None))
    user.bg(matchtag=2, **_unit("u2"))
    assert _started(systemd, "u2")
    user.bg(matchtag=3, **_unit("u3"))
    assert payloads(user.of(3)) == [
        _refusal("too many background processes", "2 running",
                 "max-background-per-user", USER)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "cap", "said"),
    [
        (0, "max-background", "too many background processes of uid {}: 2 running"),
        (
            WAITABLE,
            "max-waitable",
            "flags: too many waitable processes of uid {}: 2 running or not yet"
            " waited for",
        ),
        (0, "max-processes", "too many processes of uid {}: 2 tabled"),
    ],
)
def test_a_reload_below_what_a_user_holds_is_said_as_the_cap_it_set(
    systemd, monkeypatch, flags, cap, said
):
    # A reload lowered the cap to 1 while the user held 2: "2 running, the
    # most [sdexec] max-background-per-user allows" called 2 the cap.
    roomy = {f"{one}-per-user": 4 for one in ("max-background", "max-waitable")}
    server = make_server(systemd, **{**CAPS, **roomy, f"{cap}-per-user": 2})
    user = user_client(server, monkeypatch)
    for matchtag in (1, 2):
        user.bg(flags=flags, matchtag=matchtag, **_unit(f"u{matchtag}"))
        assert _started(systemd, f"u{matchtag}")
    config = parse_config({"sdexec": {**CAPS, **roomy, f"{cap}-per-user": 1}})
    server.reconfigure(config, Containment(config, None))
    user.bg(flags=flags, matchtag=3, **_unit("u3"))
    ((errnum, errstr),) = payloads(user.of(3))
    assert (errnum, errstr.removesuffix(" (sdexec wait reaps one)")) == (
        errno.EAGAIN,
        f"{said.format(USER)}, more than the 1 [sdexec] {cap}-per-user allows",
    )


def test_stats_show_each_user_s_share_bounded(systemd, monkeypatch):
    # allow-users is the admin's list, of any length: /stats lists the
    # owner and the users holding the most, at most STATS_USERS in all.
    users = [USER + n for n in range(STATS_USERS + 3)]
    server = make_server(systemd, **{**CAPS, "allow-users": users})
    owner = Client(server)
    owner.bg(flags=WAITABLE, matchtag=1, **_unit("o1"))
    clients = []
    uids = iter(users)
    monkeypatch.setattr(sdexec.connection, "peer_uid", lambda sock: next(uids))
    first = Client(server)
    first.bg(matchtag=1, **_unit("f1"))
    _streaming(first, "f2", 2)
    for n, _ in enumerate(users[1:]):
        clients.append(Client(server))
        _streaming(clients[-1], f"c{n}", 1)
    shown = server.stats()["users"]
    assert shown["owner"] == os.getuid()
    assert len(shown["users"]) == STATS_USERS
    assert shown["not-shown"] == len(users) - (STATS_USERS - 1)
    assert shown["users"][str(os.getuid())] == {
        "processes": 1,
        "background": 1,
        "waitable": 1,
        "calls-queued": 0,
        "connections": 1,
    }
    assert shown["users"][str(users[0])] == {
        "processes": 2,
        "background": 1,
        "waitable": 0,
        "calls-queued": 0,
        "connections": 1,
    }


def test_stats_and_metrics_show_who_holds_the_connections(systemd, monkeypatch):
    # Nothing said whose connections filled max-connections-per-user (or
    # the owner's max-connections): a user holding them and no process
    # was not listed at all.
    server = make_server(systemd, **CAPS)
    metrics = Metrics(reactor, server.stats)
    owners = [Client(server) for _ in range(2)]
    users = [user_client(server, monkeypatch) for _ in range(3)]
    shown = server.stats()["users"]["users"]
    held = {uid: entry["connections"] for uid, entry in shown.items()}
    assert held == {str(os.getuid()): 2, str(USER): 3}
    assert connection_series(metrics) == {str(os.getuid()): 2, str(USER): 3}
    for client in users:
        client.close()
    # The owner's series stays (0 once it holds none); a user that holds
    # nothing is no longer listed, nor a series.
    assert connection_series(metrics) == {str(os.getuid()): 2}
    for client in owners:
        client.close()
    assert connection_series(metrics) == {str(os.getuid()): 0}


def connection_series(metrics: Metrics) -> dict[str, float]:
    """``sdexec_connections`` as a scrape reads it, by its ``uid`` label."""
    text, _ = metrics.render(metrics.snapshot(), Scrape.asked("", "", []))
    return {
        sample.labels["uid"]: sample.value
        for family in parse_text(text.decode())
        if family.name == "sdexec_connections"
        for sample in family.samples
    }


def test_calls_for_a_user_s_units_wait_in_that_user_s_lane(systemd, monkeypatch):
    # One queue of calls for everyone held the owner's start behind a
    # listed user's burst (sdexec/systemd/window.py): each uid's calls
    # take turns, the service's own (leftovers) apart.
    server = make_server(systemd, **CAPS)
    owner, user = Client(server), user_client(server, monkeypatch)
    _streaming(user, "u1", 1)
    _streaming(owner, "o1", 1)
    assert [
        systemd.lane_of(f"sdexec-{name}.service") for name in ("u1", "o1", "none")
    ] == [USER, os.getuid(), SERVICE_LANE]
