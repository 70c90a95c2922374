"""UnitWatch: how a PropertiesChanged signal becomes the merged unit state."""

from __future__ import annotations

from dbus_fast import Variant

from sdexec.systemd import UnitWatch


class NoCallsClient:
    """The SystemdClient side a watch uses; any D-Bus call fails the test."""

    def __init__(self) -> None:
        self._watches: dict[str, UnitWatch] = {}

    def _defer(self, coroutine):
        coroutine.close()
        raise AssertionError("the watch made a D-Bus call")


def watch(delivered: list[dict]) -> UnitWatch:
    client = NoCallsClient()
    unit_watch = UnitWatch(client, "x.service", lambda s: delivered.append(dict(s)))
    client._watches[unit_watch.path] = unit_watch
    return unit_watch


def test_a_change_is_merged_and_delivered():
    delivered: list[dict] = []
    unit_watch = watch(delivered)
    unit_watch._changed({"ActiveState": Variant("s", "activating")}, [])
    unit_watch._changed({"ExecMainPID": Variant("u", 42)}, [])
    assert delivered[-1] == {"ActiveState": "activating", "ExecMainPID": 42}


def test_invalidated_properties_are_dropped_not_fetched():
    delivered: list[dict] = []
    unit_watch = watch(delivered)
    unit_watch.state["ExecStart"] = ["stale"]
    unit_watch._changed(
        {"ActiveState": Variant("s", "active"), "SubState": Variant("s", "exited")},
        ["ExecStart", "ExecStartEx", "Conditions"],
    )
    assert delivered == [{"ActiveState": "active", "SubState": "exited"}]


def test_nothing_is_delivered_after_cancel():
    delivered: list[dict] = []
    unit_watch = watch(delivered)
    unit_watch.cancel()
    unit_watch._changed({"ActiveState": Variant("s", "inactive")}, ["Asserts"])
    assert delivered == []
