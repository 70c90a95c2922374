"""UnitWatch: how a PropertiesChanged signal becomes the merged unit state."""

from __future__ import annotations

import pytest
from twisted.internet import defer

from sdexec.systemd.watch import UnitWatch, WatchRegistry

PATH = "/org/freedesktop/systemd1/unit/x_2eservice"


def no_fetch() -> defer.Deferred:
    raise AssertionError("the watch made a D-Bus call")


def watch(delivered: list[dict], registry: WatchRegistry | None = None) -> UnitWatch:
    registry = registry or WatchRegistry()
    unit_watch = UnitWatch(
        registry, "x.service", PATH, lambda s: delivered.append(dict(s)), no_fetch
    )
    registry.register(unit_watch)
    return unit_watch


def test_a_change_is_merged_and_delivered():
    delivered: list[dict] = []
    registry = WatchRegistry()
    watch(delivered, registry)
    registry.changed(PATH, {"ActiveState": "activating"}, [])
    registry.changed(PATH, {"ExecMainPID": 42}, [])
    assert delivered[-1] == {"ActiveState": "activating", "ExecMainPID": 42}


def test_invalidated_properties_are_dropped_not_fetched():
    delivered: list[dict] = []
    unit_watch = watch(delivered)
    unit_watch.state["ExecStart"] = ["stale"]
    unit_watch.changed(
        {"ActiveState": "active", "SubState": "exited"},
        ["ExecStart", "ExecStartEx", "Conditions"],
    )
    assert delivered == [{"ActiveState": "active", "SubState": "exited"}]


def test_nothing_is_delivered_after_cancel():
    delivered: list[dict] = []
    unit_watch = watch(delivered)
    unit_watch.cancel()
    unit_watch.changed({"ActiveState": "inactive"}, ["Asserts"])
    assert delivered == []


def test_a_second_watch_of_a_watched_unit_is_refused_the_first_kept():
    first: list[dict] = []
    registry = WatchRegistry()
    watch(first, registry)
    with pytest.raises(ValueError, match=r"unit x\.service is already watched"):
        watch([], registry)
    registry.changed(PATH, {"ActiveState": "active"}, [])
    assert first == [{"ActiveState": "active"}]


def test_a_cancelled_watch_makes_way_for_a_new_one():
    older: list[dict] = []
    newer: list[dict] = []
    registry = WatchRegistry()
    watch(older, registry).cancel()
    watch(newer, registry)
    registry.changed(PATH, {"ActiveState": "active"}, [])
    assert (older, newer) == ([], [{"ActiveState": "active"}])


def test_refresh_merges_the_fetched_state_and_delivers_it():
    delivered: list[dict] = []
    registry = WatchRegistry()
    unit_watch = UnitWatch(
        registry,
        "x.service",
        PATH,
        delivered.append,
        lambda: defer.succeed({"ControlGroup": "/x"}),
    )
    registry.register(unit_watch)
    unit_watch.changed({"ActiveState": "active"}, [])
    fired: list[dict] = []
    unit_watch.refresh().addCallback(fired.append)
    assert fired == [{"ActiveState": "active", "ControlGroup": "/x"}]


def test_a_refresh_answer_does_not_roll_back_a_later_signal():
    delivered: list[dict] = []
    answers: list[defer.Deferred] = []

    def fetch() -> defer.Deferred:
        answers.append(defer.Deferred())
        return answers[-1]

    registry = WatchRegistry()
    unit_watch = UnitWatch(
        registry, "x.service", PATH, lambda s: delivered.append(dict(s)), fetch
    )
    registry.register(unit_watch)
    refreshed = unit_watch.refresh()
    # The Unit interface was read while activating; the unit moved on.
    registry.changed(PATH, {"ActiveState": "active", "SubState": "exited"}, [])
    answers[0].callback(
        {"ActiveState": "activating", "SubState": "start", "ControlGroup": "/x"}
    )
    settled = {"ActiveState": "active", "SubState": "exited", "ControlGroup": "/x"}
    assert delivered[-1] == settled
    assert refreshed.result == settled
    # A refresh asked for after that signal reads it all afresh.
    unit_watch.refresh()
    answers[1].callback({"ActiveState": "inactive", "SubState": "dead"})
    assert delivered[-1] == {**settled, "ActiveState": "inactive", "SubState": "dead"}


def test_a_failed_refresh_fails_and_shields_nothing_after():
    answer: defer.Deferred = defer.Deferred()
    registry = WatchRegistry()
    unit_watch = UnitWatch(registry, "x.service", PATH, lambda s: None, lambda: answer)
    registry.register(unit_watch)
    failed: list = []
    unit_watch.refresh().addErrback(failed.append)
    answer.errback(RuntimeError("no reply"))
    assert failed and failed[0].check(RuntimeError)
    assert unit_watch._signalled == []


def test_the_registry_follows_a_path_while_a_watch_is_registered_there():
    # The bus client unwraps a unit's signal only for a path followed: its
    # one match rule brings every unit's changes on the manager.
    registry = WatchRegistry()
    assert not registry.follows(PATH)
    unit_watch = watch([], registry)
    assert registry.follows(PATH)
    assert not registry.follows(PATH + "_2e")
    unit_watch.cancel()
    assert not registry.follows(PATH)


def test_a_refresh_keeps_what_is_followed_and_hands_its_caller_the_rest():
    # Every fenced job, and every unit after systemd came back, held all of
    # a GetAll's 400 properties (53 KB on systemd 252) for its life.
    answer = {"ControlGroup": "/x", "ExecStart": [["/bin/true"]], "Id": "x.service"}
    registry = WatchRegistry()
    unit_watch = UnitWatch(
        registry, "x.service", PATH, lambda s: None, lambda: defer.succeed(answer)
    )
    registry.register(unit_watch)
    unit_watch.changed({"ActiveState": "active", "StatusText": "ok"}, [])
    fired: list[dict] = []
    unit_watch.refresh().addCallback(fired.append)
    assert fired == [{**answer, "ActiveState": "active", "StatusText": "ok"}]
    assert unit_watch.state == {
        "ActiveState": "active",
        "StatusText": "ok",  # what signals carry stays
        "ControlGroup": "/x",
    }
