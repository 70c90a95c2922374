"""The configuration: every key, the derived values, files and the CLI."""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.endpoints import serverFromString
from twisted.logger import capturedLogs

from sdexec.config import (
    _KEY_NAMED_UP_TO,
    _NOT_READ,
    _TOO_DEEP,
    MAX_KILL_COUNT,
    MAX_STOP_TIMER_SEC,
    RESERVED_PROPERTIES,
    Config,
    ConfigError,
    MiB,
    check_command_line_option,
    default_config,
    final_kill_attempt,
    load_config,
    load_config_quietly,
    main,
    parse_config,
)
from sdexec.policy import DEFAULT_ALLOWED

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [ROOT / "etc" / "sdexec.toml", ROOT / "etc" / "sdexec.yaml"]

DURATION = "expected a non-negative number with an optional suffix ms, s, m, h or d"
FLUX_INFINITE = (
    "is not a valid duration: Flux reads it as infinite (strtod), a timeout that"
    " never fires, which sdexec does not take"
)
BOOLEAN = "Expected true or false"
STOP_TIMER_RANGE = "expected an integer from 1 to 2147483647"
KILL_COUNT_RANGE = f"expected an integer from 1 to {MAX_KILL_COUNT}"
SIGNAL = (
    "is not a signal: expected a signal name such as SIGTERM or TERM,"
    f" or a number from 1 to {signal.NSIG - 1}"
)


def nested(path: str, value: Any) -> dict:
    """``{"exec": {"testexec": {"allow-guests": value}}}`` from a dotted path."""
    *tables, key = path.split(".")
    data: dict = {key: value}
    for table in reversed(tables):
        data = {table: data}
    return data


def configure(path: str, value: Any) -> Config:
    """A config with one key set (and systemd enabled, which sdexec needs)."""
    data = nested(path, value)
    data.setdefault("systemd", {}).setdefault("enable", True)
    return parse_config(data)


def attribute(config: Config, dotted: str) -> Any:
    for name in dotted.split("."):
        config = getattr(config, name)
    return config


class Key(NamedTuple):
    path: str  # as written in the file
    attribute: str  # where the Config keeps it
    default: Any
    good: Any  # a value as written
    parsed: Any  # what it becomes
    bad: Any
    message: str  # the error for the bad value, after "<config>: PATH: "


KEYS = [
    Key("exec.imp", "exec.imp", None, "/usr/libexec/flux/flux-imp",
        "/usr/libexec/flux/flux-imp", 5, "expected a non-empty string, got 5"),
    Key("exec.service", "exec.service", "rexec", "sdexec", "sdexec", "",
        'expected "rexec" or "sdexec", got ""'),
    Key("exec.service-override", "exec.service_override", False, True, True, "yes",
        f'{BOOLEAN}, got "yes"'),
    Key("exec.method", "exec.method", "bulk-exec", "bgexec", "bgexec", "bulkexec",
        'expected "bulk-exec" or "bgexec", got "bulkexec"'),
    Key("exec.job-shell", "exec.job_shell", None, "/opt/flux-shell", "/opt/flux-shell",
        ["/opt/flux-shell"], 'expected a non-empty string, got ["/opt/flux-shell"]'),
    Key("exec.shell-exit-timeout", "exec.shell_exit_timeout", 30.0, "2m", 120.0,
        "never", f'"never" is not a valid duration: {DURATION}, or "none"'),
    Key("exec.kill-timeout", "exec.kill_timeout", 5.0, "1m", 60.0, "5x",
        f'"5x" is not a valid duration: {DURATION}'),
    Key("exec.max-kill-count", "exec.max_kill_count", 8, 4, 4, 0,
        f"{KILL_COUNT_RANGE}, got 0"),
    Key("exec.max-kill-timeout", "exec.max_kill_timeout", None, "30m", 1800.0, "-5m",
        f'"-5m" is not a valid duration: {DURATION}'),
    Key("exec.term-signal", "exec.term_signal", 15, "SIGUSR2", 12, "SIGFOO",
        f'"SIGFOO" {SIGNAL}'),
    Key("exec.kill-signal", "exec.kill_signal", 9, "term", 15, 99,
        f"99 {SIGNAL}"),
    Key("exec.barrier-timeout", "exec.barrier_timeout", 1800.0, "0", 0.0, "1y",
        f'"1y" is not a valid duration: {DURATION}'),
    Key("exec.max-start-delay-percent", "exec.max_start_delay_percent", 25.0, 50.5,
        50.5, "25%", 'expected a finite number, got "25%"'),
    Key("exec.testexec.allow-guests", "exec.testexec_allow_guests", False, True, True,
        "true", f'{BOOLEAN}, got "true"'),
    Key("exec.sdexec-constrain-resources", "exec.sdexec_constrain_resources", False,
        True, True, 1, f"{BOOLEAN}, got 1"),
    Key("exec.sdexec-properties", "exec.sdexec_properties", {},
        {"MemoryMax": "95%", "CPUWeight": "100"},
        {"MemoryMax": "95%", "CPUWeight": "100"},
        "MemoryMax=95%",
        'expected a table of systemd unit properties, got "MemoryMax=95%"'),
    Key("exec.sdexec-stop-timer-sec", "exec.sdexec_stop_timer_sec", 640, 1800, 1800,
        30.5, f"{STOP_TIMER_RANGE}, got 30.5"),
    Key("exec.sdexec-stop-timer-signal", "exec.sdexec_stop_timer_signal", 10,
        "SIGKILL", 9, "USR9",
        f'"USR9" {SIGNAL}'),
    Key("sdexec.mapper", "sdexec.mapper", "sdexec.map.HwlocMapper",
        "site.mappers.AccountingMapper", "site.mappers.AccountingMapper", "HwlocMapper",
        "expected a fully-qualified class name such as pkg.module.Class,"
        ' got "HwlocMapper"'),
    Key("sdexec.mapper-searchpath", "sdexec.mapper_searchpath", "",
        "/etc/flux/mappers:/opt/mappers", "/etc/flux/mappers:/opt/mappers", ["/a"],
        'expected a string of colon-separated directories, got ["/a"]'),
    Key("sdexec.listen", "sdexec.listen", None, "unix:/tmp/sdexec.sock",
        "unix:/tmp/sdexec.sock", "tpc:8490",
        # Not "or tcp:PORT", which listen refuses (review 38 A2-3).
        '"tpc:8490" is not a Twisted server endpoint such as unix:/path'
        " (Unknown endpoint type: 'tpc')"),
    Key("sdexec.listen-backlog", "sdexec.listen_backlog", None, 1024, 1024, 2**31,
        "expected an integer from 1 to 2147483647, got 2147483648"),
    Key("sdexec.stats", "sdexec.stats", None, "tcp:9000:interface=127.0.0.1",
        "tcp:9000:interface=127.0.0.1", "tcp:http",
        '"tcp:http" is not a Twisted server endpoint such as unix:/path or tcp:PORT'
        " (invalid literal for int() with base 10: 'http')"),
    Key("sdexec.rank", "sdexec.rank", 0, 3, 3, 2**32,
        "expected an integer from 0 to 4294967293, got 4294967296"),
    Key("sdexec.topology", "sdexec.topology", None, "/etc/sdexec/topology.xml",
        "/etc/sdexec/topology.xml", "topology.xml",
        'expected an absolute path, got "topology.xml"'),
    Key("sdexec.max-frame-size", "sdexec.max_frame_size", 64 * MiB, "16M", 16 * MiB,
        "512K",
        "expected a size of at least 1M (bytes, or with B, K, M, G, T, P or E),"
        ' got "512K"'),
    Key("sdexec.containment-check", "sdexec.containment_check", "drain", "warn",
        "warn", "off", 'expected "drain" or "warn", got "off"'),
    Key("sdexec.log-format", "sdexec.log_format", "text", "json", "json", "xml",
        'expected "text" or "json", got "xml"'),
    Key("sdexec.retained-output", "sdexec.retained_output", MiB, "16K", 16 * 1024,
        "lots",
        "expected a size ≥ 0 (bytes, or with B, K, M, G, T, P or E; 0 keeps none),"
        ' got "lots"'),
    Key("sdexec.leftover-units", "sdexec.leftover_units", "stop", "keep", "keep",
        "kill", 'expected "stop" or "keep", got "kill"'),
    Key("sdexec.slice", "sdexec.slice", "sdexec.slice", "flux-jobs.slice",
        "flux-jobs.slice", "jobs/a.slice",
        "expected a slice unit name such as sdexec.slice (letters, digits, : _ . -;"
        ' a dash only between two names, as in jobs-gpu.slice), got "jobs/a.slice"'),
    Key("sdexec.allow-users", "sdexec.allow_users", (), ["root", 4242], (0, 4242),
        "root", 'expected a list of user names or uids, got "root"'),
    Key("sdexec.request-properties", "sdexec.request_properties", DEFAULT_ALLOWED,
        ["@default", "Nice"], DEFAULT_ALLOWED | {"Nice"}, "MemoryMax",
        'expected an array of property names, got "MemoryMax"'),
    Key("sdexec.stats-detail", "sdexec.stats_detail", False, True, True, "yes",
        f'{BOOLEAN}, got "yes"'),
    Key("sdexec.stats-socket", "sdexec.stats_socket", None, "/run/sdexec/stats.sock",
        "/run/sdexec/stats.sock", "stats.sock",
        'expected an absolute path, got "stats.sock"'),
    Key("sdexec.socket-mode", "sdexec.socket_mode", 0o600, "0660", 0o660, 600,
        'expected permissions in octal, as a string such as "0600", got 600'),
    Key("sdexec.max-connections", "sdexec.max_connections", 512, 16, 16, 0,
        "expected an integer of at least 1, got 0"),
    Key("sdexec.max-connections-per-user", "sdexec.max_connections_per_user", 16,
        4, 4, True, "expected an integer of at least 1, got true"),
    Key("sdexec.max-waitable", "sdexec.max_waitable", 1024, 10, 10, -1,
        "expected an integer of at least 1, got -1"),
    Key("sdexec.max-background", "sdexec.max_background", 1024, 10, 10, 0,
        "expected an integer of at least 1, got 0"),
    Key("sdexec.max-processes", "sdexec.max_processes", 4096, 100, 100, 0,
        "expected an integer of at least 1, got 0"),
    Key("sdexec.max-waitable-per-user", "sdexec.max_waitable_per_user", 1024, 8, 8,
        0, "expected an integer of at least 1, got 0"),
    Key("sdexec.max-background-per-user", "sdexec.max_background_per_user", 1024, 8,
        8, "8", 'expected an integer of at least 1, got "8"'),
    Key("sdexec.max-processes-per-user", "sdexec.max_processes_per_user", 4096, 32,
        32, -1, "expected an integer of at least 1, got -1"),
    Key("systemd.enable", "systemd.enable", False, True, True, "yes",
        f'{BOOLEAN}, got "yes"'),
    Key("systemd.sdexec-debug", "systemd.sdexec_debug", False, True, True, 1,
        f"{BOOLEAN}, got 1"),
    Key("systemd.sdbus-debug", "systemd.sdbus_debug", False, True, True, "false",
        f'{BOOLEAN}, got "false"'),
    Key("systemd.max-inflight", "systemd.max_inflight", 64, 16, 16, 0,
        "expected an integer of at least 1, got 0"),
    Key("systemd.start-timeout", "systemd.start_timeout", 120.0, "5m", 300.0, 0,
        "expected a duration greater than 0, got 0"),
    Key("systemd.reconnect-timeout", "systemd.reconnect_timeout", 60.0, "10s", 10.0,
        "0s", 'expected a duration greater than 0, got "0s"'),
    Key("systemd.bus", "systemd.bus", "user", "system", "system", "session",
        'expected "user" or "system", got "session"'),
]  # fmt: skip


@pytest.mark.parametrize("key", KEYS, ids=lambda key: key.path)
def test_default(key):
    assert attribute(default_config(), key.attribute) == key.default


@pytest.mark.parametrize("key", KEYS, ids=lambda key: key.path)
def test_good_value(key):
    assert attribute(configure(key.path, key.good), key.attribute) == key.parsed


@pytest.mark.parametrize("key", KEYS, ids=lambda key: key.path)
def test_bad_value_names_key_and_expectation(key):
    with pytest.raises(ConfigError) as error:
        configure(key.path, key.bad)
    assert str(error.value) == f"<config>: {key.path}: {key.message}"
    assert error.value.key == key.path


def test_every_key_is_tested():
    written = {key.path for key in KEYS}
    assert written == set(
        _flatten(default_config().effective(), skip_introspection=True)
    )


#: 10**400 as a message quotes it (sdexec.refusal.SHOWN).
HUGE_INT = f"1{'0' * 199}… (401 chars)"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("exec.kill-timeout", "0s", 'expected a duration greater than 0, got "0s"'),
        ("exec.max-kill-timeout", 0, "expected a duration greater than 0, got 0"),
        # Rounded to 0 by the schedule: the whole sequence at once (review
        # session 31 F F3).
        ("exec.kill-timeout", "1e-320",
         'expected a duration of at least 1ms, got "1e-320"'),
        ("exec.max-kill-count", 2.5, f"{KILL_COUNT_RANGE}, got 2.5"),
        ("exec.max-kill-count", True, f"{KILL_COUNT_RANGE}, got true"),
        # Its last attempt's time overflowed a float: a traceback. Quoted
        # to 200 characters, with its length, as any value.
        ("exec.max-kill-count", 10**400, f"{KILL_COUNT_RANGE}, got {HUGE_INT}"),
        # Flux's sdexec would signal and abandon every lingering unit at once.
        ("exec.sdexec-stop-timer-sec", 0,
         "0 would signal a unit's remaining processes as it enters deactivating"
         " and abandon it at once, draining the node (Flux's sdexec does so):"
         " write a positive number of seconds, or leave it out (or write a"
         " negative value, as Flux's job-exec reads it) for the default"),
        ("exec.sdexec-stop-timer-sec", "30s", f'{STOP_TIMER_RANGE}, got "30s"'),
        # Flux's job-exec reads a C int: 2**31 wraps to a negative (derived),
        # 2**32 + 640 to 640.
        ("exec.sdexec-stop-timer-sec", 2**31,
         "expected at most 2147483647 (Flux's job-exec reads this key as a C"
         " int, where a larger value wraps), got 2147483648"),
        ("exec.sdexec-stop-timer-sec", 2**32 + 640,
         "expected at most 2147483647 (Flux's job-exec reads this key as a C"
         f" int, where a larger value wraps), got {2**32 + 640}"),
        ("exec.kill-timeout", 10**400, f"{HUGE_INT} is not a valid duration:"
         " infinite, a timeout that never fires, which sdexec does not take;"
         f" {DURATION}"),
        # Flux's strtod reads these as infinite: a timeout that never fires,
        # which for a key sdexec only reports Flux makes no timeout at all.
        ("exec.kill-timeout", "infinity", f'"infinity" {FLUX_INFINITE}; {DURATION}'),
        ("systemd.start-timeout", "inf", f'"inf" {FLUX_INFINITE}; {DURATION}'),
        ("exec.barrier-timeout", "infinity", f'"infinity" {FLUX_INFINITE}; {DURATION};'
         ' for no timeout, which is what Flux\'s job-exec makes of it, write "0"'),
        ("exec.shell-exit-timeout", "INF", f'"INF" {FLUX_INFINITE}; {DURATION};'
         ' for no timeout, which is what Flux\'s job-exec makes of it, write "none"'),
        ("exec.max-start-delay-percent", 10**400,
         f"expected a finite number, got {HUGE_INT}"),
        ("sdexec.mapper", "site..Mapper",
         "expected a fully-qualified class name such as pkg.module.Class,"
         ' got "site..Mapper"'),
        ("sdexec.max-frame-size", 1024, "expected a size of at least 1M (bytes, or"
         " with B, K, M, G, T, P or E), got 1024"),
        ("sdexec.listen", "", 'expected a non-empty string, got ""'),
        # Flux's job-exec refuses them ("unsupported exec.service value"):
        # they loaded here, and every job there failed (review 40 G6).
        *(("exec.service", name, f'expected "rexec" or "sdexec", got "{name}"')
          for name in ("sdexex", "SDEXEC", "ssh")),
        # As Flux's job-exec: "none" alone, in that case (streq).
        ("exec.shell-exit-timeout", "None",
         f'"None" is not a valid duration: {DURATION}, or "none"'),
        ("exec.method", "testexec", 'expected "bulk-exec" or "bgexec", got "testexec"'),
        ("systemd.enable", None, f"{BOOLEAN}, got null"),
        ("sdexec.allow-users", ["no-such-user"], 'no such user: "no-such-user"'
         " (or the name service cannot answer yet)"),
        ("sdexec.allow-users", [-1], "expected a user name or a uid (an integer of at"
         " least 0), got -1"),
        ("sdexec.allow-users", [True], "expected a user name or a uid (an integer of"
         " at least 0), got true"),
        *(("sdexec.slice", name, "expected a slice unit name such as sdexec.slice"
           " (letters, digits, : _ . -; a dash only between two names, as in"
           f' jobs-gpu.slice), got "{name}"')
          # systemd refuses them: the slice, and every unit in it, fails.
          for name in ("sdexec", "a--b.slice", "-jobs.slice", "jobs-.slice")),
    ],
)  # fmt: skip
def test_more_bad_values(path, value, message):
    with pytest.raises(ConfigError) as error:
        configure(path, value)
    assert str(error.value) == f"<config>: {path}: {message}"


@pytest.mark.parametrize(
    ("path", "value", "parsed"),
    [
        ("exec.kill-timeout", 5, 5.0),  # a bare number is seconds
        ("exec.kill-timeout", 0.5, 0.5),
        ("exec.kill-timeout", "100ms", 0.1),
        ("exec.term-signal", 10, 10),
        ("exec.term-signal", "15", 15),
        ("exec.max-start-delay-percent", 0, 0.0),
        # Flux's job-exec takes it ("F"): any delay is beyond it.
        ("exec.max-start-delay-percent", -1, -1.0),
        # Flux's job-exec takes "none" as 0: disabled (review session 40 G3).
        ("exec.shell-exit-timeout", "none", 0.0),
        ("exec.shell-exit-timeout", "0", 0.0),
        ("sdexec.max-frame-size", 2**24, 16 * MiB),
        ("sdexec.max-frame-size", "1M", MiB),
    ],
)
def test_more_good_values(path, value, parsed):
    key = next(key for key in KEYS if key.path == path)
    assert attribute(configure(path, value), key.attribute) == parsed


# --- sdexec.allow-users ------------------------------------------------------


def test_a_name_not_resolved_may_pass_later(monkeypatch):
    # At boot sssd or LDAP may not answer yet: the start failed with exit 78,
    # which the units never restart (review session 40 G2). Python's pwd
    # raises KeyError for that and for an unknown name alike.
    def unanswered(name: str) -> None:
        raise KeyError(f"getpwnam(): name not found: {name!r}")

    monkeypatch.setattr("pwd.getpwnam", unanswered)
    with pytest.raises(ConfigError) as error:
        configure("sdexec.allow-users", [0, "slurm"])
    assert error.value.transient
    assert str(error.value) == (
        '<config>: sdexec.allow-users: no such user: "slurm" (or the name'
        " service cannot answer yet)"
    )


def test_a_uid_is_never_looked_up(monkeypatch):
    def no_lookup(name: str) -> None:
        raise AssertionError(f"{name} looked up")

    monkeypatch.setattr("pwd.getpwnam", no_lookup)
    assert configure("sdexec.allow-users", [0, 4242]).sdexec.allow_users == (0, 4242)


@pytest.mark.parametrize("entry", [-1, "", 1.5])
def test_an_entry_that_is_no_user_fails_for_good(entry):
    with pytest.raises(ConfigError) as error:
        configure("sdexec.allow-users", [entry])
    assert not error.value.transient


# --- exec.sdexec-properties ------------------------------------------------

MEMORY = ["MemoryMax", "MemoryHigh", "MemoryMin", "MemoryLow", "MemorySwapMax"]


def properties(**settings: Any) -> Config:
    return configure("exec.sdexec-properties", settings)


@pytest.mark.parametrize("name", MEMORY)
@pytest.mark.parametrize(
    "value", ["512M", "1.5G", "4096", "95%", "1", "infinity", "4g", "1P", "2e"]
)
def test_memory_property_good(name, value):
    assert properties(**{name: value}).exec.sdexec_properties == {name: value}


@pytest.mark.parametrize("name", ["MemoryMin", "MemoryLow", "MemorySwapMax"])
@pytest.mark.parametrize("value", ["0", "0%"])
def test_a_memory_protection_or_swap_may_be_none(name, value):
    assert properties(**{name: value}).exec.sdexec_properties == {name: value}


@pytest.mark.parametrize(
    ("name", "value", "takes"),
    [
        ("MemoryMax", "0", "MemoryMax from 1 byte (infinity for none)"),
        ("MemoryHigh", "0%", "MemoryHigh from 1 byte (infinity for none)"),
        ("TasksMax", "0", "1 or more, or infinity"),
        (
            "CPUQuotaPerSecUSec",
            "0",
            "10000 (1%) to 214748360000, or infinity (it writes whole percents"
            " into the unit's file: a daemon-reload drops a quota below 1% or"
            " above 21474836%)",
        ),
        ("CPUWeight", "20000", "1 to 10000, or 0 (idle)"),
        ("IOWeight", "0", "1 to 10000"),
    ],
)
def test_a_value_systemd_refuses_for_every_unit_is_refused_here(name, value, takes):
    # Else every exec would fail, and the device canary drain the node.
    with pytest.raises(ConfigError) as error:
        properties(**{name: value})
    assert str(error.value) == (
        f"<config>: exec.sdexec-properties.{name}: {value!r} is out of range:"
        f" systemd takes {takes}"
    )


@pytest.mark.parametrize(
    ("table", "said"),
    [
        # Before 252 systemd checks a priority against the policy so far;
        # since, sched_setscheduler refuses it at every start (214).
        ({"CPUSchedulingPriority": "50"},
         "CPUSchedulingPriority: 50 needs CPUSchedulingPolicy fifo or rr"),
        ({"CPUSchedulingPolicy": "rr", "CPUSchedulingPriority": "0"},
         "CPUSchedulingPriority: 0 is no priority of the fifo and rr policies"),
        # setrlimit refuses a soft limit above the hard one at every start.
        ({"LimitNOFILE": "1000", "LimitNOFILESoft": "2000"},
         "LimitNOFILESoft: LimitNOFILESoft=2000 above LimitNOFILE=1000"),
        # systemd.exec(5)'s pair, its soft part above its hard one.
        ({"LimitNOFILE": "2000:1000"},
         "LimitNOFILE: '2000:1000': the soft limit is above the hard one"),
        ({"LimitNOFILE": "1000:2000", "LimitNOFILESoft": "500"},
         "LimitNOFILE: '1000:2000' sets the soft limit, and so does"),
        # Alone it sets the hard limit too: raising the soft one lowered it.
        ({"LimitNOFILESoft": "4096"}, "LimitNOFILESoft: give LimitNOFILE too"),
        # numa_policy_is_valid refuses them at every start (242; review 36 T2).
        ({"NUMAPolicy": "interleave"},
         "NUMAPolicy: NUMAPolicy interleave needs NUMAMask"),
        ({"NUMAPolicy": "preferred", "NUMAMask": "0-1"},
         "NUMAPolicy: NUMAPolicy preferred takes one node in NUMAMask"),
    ],
)  # fmt: skip
def test_properties_systemd_refuses_together_are_refused_here(table, said):
    # Each valid alone, they failed every job (review session 31 D F1-F3).
    with pytest.raises(ConfigError) as error:
        properties(**table)
    assert str(error.value).startswith(f"<config>: exec.sdexec-properties.{said}")


def test_a_priority_with_its_policy_and_limits_in_order_are_taken():
    table = {
        "CPUSchedulingPriority": "50",
        "CPUSchedulingPolicy": "fifo",
        "LimitNOFILESoft": "1024",
        "LimitNOFILE": "4096",
    }
    assert properties(**table).exec.sdexec_properties == table


def test_a_soft_hard_limit_is_taken_as_written():
    # systemd.exec(5)'s SOFT:HARD (review session 46); kept as written, so
    # that Flux's job-exec restating it word for word is the site's.
    table = {"LimitNOFILE": "1024:4096", "LimitFSIZE": "1M:infinity"}
    assert properties(**table).exec.sdexec_properties == table


@pytest.mark.parametrize(
    ("name", "value"),
    [("CPUWeight", "0"), ("CPUWeight", "10000"), ("TasksMax", "infinity"),
     ("IOWeight", "1"), ("CPUQuotaPerSecUSec", "10000")],
)  # fmt: skip
def test_the_ends_of_systemd_s_ranges_are_taken(name, value):
    assert properties(**{name: value}).exec.sdexec_properties == {name: value}


@pytest.mark.parametrize("name", MEMORY)
@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("150%", "'150%' is more than 100%"),
        ("3.125%", "'3.125%' has more than two decimals:"
                   " systemd keeps a percentage to 0.01%"),
        ("1G 512M", "'1G 512M': sdexec does not take a sum of sizes;"
                    " write it as one (1.5G, not 1G 512M)"),
    ],
)  # fmt: skip
def test_memory_property_written_as_one_says_why_it_is_not_taken(name, value, why):
    # Review session 43 T5: the site file's refusal said "not a memory
    # limit" of a percentage with three decimals, which is one.
    with pytest.raises(ConfigError) as error:
        properties(**{name: value})
    assert str(error.value) == f"<config>: exec.sdexec-properties.{name}: {why}"


@pytest.mark.parametrize("name", MEMORY)
@pytest.mark.parametrize("value", ["lots", "5X", "-1G", "", "4gb"])
def test_memory_property_bad(name, value):
    with pytest.raises(ConfigError) as error:
        properties(**{name: value})
    assert str(error.value) == (
        f"<config>: exec.sdexec-properties.{name}: {json.dumps(value)} is not a"
        " memory limit: expected a size (a number (decimal, 0x hex, 0 octal or"
        " floating point), alone or with k, K, M, G, T, P or E), a percentage up"
        " to 100% (two decimals at most) or 'infinity'"
    )


@pytest.mark.parametrize("value", ["-1000", "0", "1000", "+5"])
def test_oom_score_adjust_good(value):
    assert properties(OOMScoreAdjust=value).exec.sdexec_properties["OOMScoreAdjust"]


@pytest.mark.parametrize("value", ["1001", "-1001", "1.5", "low", ""])
def test_oom_score_adjust_bad(value):
    with pytest.raises(ConfigError) as error:
        properties(OOMScoreAdjust=value)
    assert str(error.value) == (
        "<config>: exec.sdexec-properties.OOMScoreAdjust: expected an integer from"
        f" -1000 to 1000, got {json.dumps(value)}"
    )


def test_reserved_are_what_sdexec_sets_itself():
    # The unit's command, its fds, containment, what the stop timer needs.
    assert {
        "ExecStartEx",
        "ExecStart",
        "StandardInputFileDescriptor",
        "AllowedCPUs",
        "DevicePolicy",
        "KillMode",
        "Type",
    } <= RESERVED_PROPERTIES
    assert len(RESERVED_PROPERTIES) == 18


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("CPUWeight", "abc", "'abc' is not a decimal integer"),
        ("CPUAccounting", "maybe", "'maybe' is not a boolean"),
        ("AllowedMemoryNodes", "x", ""),
        ("ProtectSystem", "strict\n[Service]", "line break '\\n' at 6"),
    ],
)
def test_property_typed_as_requests_are(name, value, why):
    with pytest.raises(ConfigError) as error:
        properties(**{name: value})
    assert str(error.value).startswith(f"<config>: exec.sdexec-properties.{name}: ")
    assert why in str(error.value)


def test_a_property_too_long_for_the_units_file_is_refused_at_load():
    # Written into every unit's file, a line systemd could not read back:
    # each unit would then lose every property at a daemon-reload.
    with pytest.raises(ConfigError) as error:
        properties(SyslogIdentifier="\x01" * 300_000)
    assert str(error.value).startswith(
        "<config>: exec.sdexec-properties.SyslogIdentifier: up to 1200002 bytes as"
        " systemd writes it into the unit's file, more than the 1044480 sdexec"
        " allows: systemd reads back no line of 1048576 bytes or more"
    )
    properties(SyslogIdentifier="x" * 300_000)


@pytest.mark.parametrize("name", sorted(RESERVED_PROPERTIES - {"Slice"}))
def test_reserved_property_refused(name):
    with pytest.raises(ConfigError) as error:
        properties(**{name: "x"})
    assert str(error.value) == (
        f"<config>: exec.sdexec-properties.{name}: reserved: sdexec sets {name} itself"
    )


def test_a_reserved_slice_names_the_key_to_set():
    # "sdexec sets Slice itself" left the admin to find [sdexec] slice.
    with pytest.raises(ConfigError) as error:
        properties(Slice="jobs.slice")
    assert str(error.value) == (
        "<config>: exec.sdexec-properties.Slice: reserved: sdexec sets Slice"
        " itself: set [sdexec] slice instead"
    )


@pytest.mark.parametrize(
    "name",
    [
        "Restart",
        "KillSignal",
        "CollectMode",
        "ExitType",
        "ExecStartPre",
        "StandardOutput",
        # (typed as booleans, they would reach the unit: every job stopped
        # at once, or its start or its release refused; review 36 T2)
        "StopWhenUnneeded",
        "RefuseManualStart",
        "RefuseManualStop",
    ],
)
def test_what_drives_the_unit_is_reserved_for_sdexec_too(name):
    # Accepted, they reached every unit: Restart beside RemainAfterExit ran
    # a failed job again; KillSignal and Exec… went out as strings systemd
    # refuses, failing every job (and the device canary: the node drained).
    with pytest.raises(ConfigError) as error:
        properties(**{name: "x"})
    assert str(error.value).startswith(
        f"<config>: exec.sdexec-properties.{name}: reserved: "
    )
    assert "sdexec" in str(error.value)


def test_property_values_must_be_strings():
    with pytest.raises(ConfigError) as error:
        properties(CPUWeight=100)
    assert str(error.value) == (
        "<config>: exec.sdexec-properties.CPUWeight: expected a string"
        " (all property values are), got 100"
    )


@pytest.mark.parametrize("name", ["memory max", "MemoryMax=", "9Nice", ""])
def test_property_names_must_look_like_systemd_names(name):
    with pytest.raises(ConfigError, match="expected a systemd property name"):
        properties(**{name: "1"})


def test_properties_cannot_be_changed_through_the_config():
    written = {"CPUWeight": "100"}
    config = configure("exec.sdexec-properties", written)
    written["CPUWeight"] = "1"
    assert config.exec.sdexec_properties == {"CPUWeight": "100"}
    with pytest.raises(TypeError):
        config.exec.sdexec_properties["CPUWeight"] = "1"  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "close"),
    [
        ("MemoryMaxx", "MemoryMax"),
        ("MemoryMAX", "MemoryMax"),
        # Led by a small letter: "expected a systemd property name such as
        # MemoryMax", and not which (review 44 cfg).
        ("memorymax", "MemoryMax"),
        ("cpuWeight", "CPUWeight"),
        ("RuntimeMaxSec", "RuntimeMaxUSec"),  # a unit file's spelling
        ("CPUQuota", "CPUQuotaPerSecUSec"),
        ("ConditionPathExsts", "ConditionPathExists"),
    ],
)
def test_a_property_systemd_does_not_know_is_refused_with_the_closest(name, close):
    # Accepted, it failed every job ("Cannot set property MemoryMaxx, or
    # unknown property"), and drained the node at the device canary
    # (review session 34 A1).
    with pytest.raises(ConfigError) as error:
        properties(**{name: "95%"})
    assert str(error.value) == (
        f"<config>: exec.sdexec-properties.{name}: unknown property: systemd"
        f" would refuse every unit with it (did you mean {close}?)"
    )


@pytest.mark.parametrize(
    ("name", "close"),
    [
        ("MemoryMaxx", "MemoryMax"),
        ("CPUQuota", "CPUQuotaPerSecUSec"),
        ("nice", "Nice"),
    ],
)
def test_request_properties_refuses_a_name_systemd_does_not_know(name, close):
    # It loaded, as the refusal of such a request advised ("an admin may
    # allow it"), and every request setting it then failed at systemd
    # (review session 35 M1).
    with pytest.raises(ConfigError) as error:
        configure("sdexec.request-properties", ["@default", name])
    assert str(error.value) == (
        f"<config>: sdexec.request-properties[1]: {name}: unknown property: systemd"
        f" would refuse every unit with it (did you mean {close}?)"
    )


@pytest.mark.parametrize(
    ("entries", "where", "message"),
    [
        ([5], 0, "expected a property name such as MemoryMax or '@default', got 5"),
        (["@default", "User"], 1, "User can never be set by a request: identity:"
         " every job runs as the service's own user"),
        (["KillMode"], 0, "KillMode can never be set by a request: lifecycle:"
         " sdexec stops, kills and reaps the unit itself"),
    ],
)  # fmt: skip
def test_a_bad_request_properties_entry_extends_the_key_path(entries, where, message):
    # It read "sdexec.request-properties: request-properties[0]: …", the
    # key twice, unlike every other key (review session 35 M5).
    with pytest.raises(ConfigError) as error:
        configure("sdexec.request-properties", entries)
    assert str(error.value) == (
        f"<config>: sdexec.request-properties[{where}]: {message}"
    )
    assert error.value.key == f"sdexec.request-properties[{where}]"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("sdexec.max-frame-size", "99999999999999999999999999999999999"),
        ("sdexec.max-frame-size", "17E"),
        ("sdexec.retained-output", "99999999999999999999999999999999999"),
        ("sdexec.retained-output", "16E"),
        ("exec.sdexec-properties", {"MemoryMax": "99999999999999999999G"}),
        ("exec.sdexec-properties", {"MemorySwapMax": "16E"}),
        # As integers they loaded, while the same sizes as strings did not
        # (review session 40 G4).
        ("sdexec.max-frame-size", 2**64),
        ("sdexec.max-frame-size", 99999999999999999999),
        ("sdexec.retained-output", 2**64),
        ("sdexec.retained-output", 10**30),
    ],
)
def test_a_size_too_large_is_refused_as_too_large(path, value):
    # "expected a size of at least 1M", "≥ 0", "not a memory limit": each
    # said what the value already was (review session 35 M5).
    with pytest.raises(ConfigError) as error:
        configure(path, value)
    (size,) = value.values() if isinstance(value, dict) else (value,)
    assert str(error.value).endswith(
        f": too large: expected a size under 16E, got {json.dumps(size)}"
    )


@pytest.mark.parametrize("key", ["max-frame-size", "retained-output"])
def test_the_largest_integer_size_is_taken(key):
    config = parse_config({"sdexec": {key: 2**64 - 1}})
    assert getattr(config.sdexec, key.replace("-", "_")) == 2**64 - 1


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("f.toml", "[sdexec]\nmax-frame-size = 99999999999999999999\n"),
        ("f.yaml", "sdexec:\n  retained-output: 99999999999999999999\n"),
    ],
)
def test_an_integer_size_too_large_is_refused_in_either_format(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).endswith(
        ": too large: expected a size under 16E, got 99999999999999999999"
    )


@pytest.mark.parametrize(
    "name",
    # JobTimeoutUSec: systemd (252, and still) refuses it for a transient
    # unit; a unit file's TimeoutSec was offered it (review session 34 N, N5).
    ["Frobnicate", "JobTimeoutUSec", "JobTimeoutSec", "Memory"],
)
def test_a_property_like_none_systemd_knows_is_refused_without_a_guess(name):
    with pytest.raises(ConfigError) as error:
        properties(**{name: "1"})
    assert str(error.value).endswith(
        f"exec.sdexec-properties.{name}: unknown property: systemd would"
        " refuse every unit with it"
    )


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        (
            "TimeoutSec",
            "did you mean TimeoutStartUSec? a unit file's TimeoutSec is"
            " TimeoutStartUSec and TimeoutStopUSec over D-Bus, and TimeoutStopUSec"
            " is reserved",
        ),
        (
            "TimeoutStopSec",
            "a unit file's TimeoutStopSec is TimeoutStopUSec over D-Bus, and"
            " TimeoutStopUSec is reserved",
        ),
        ("TimeoutStartSec", "did you mean TimeoutStartUSec?"),
    ],
)
def test_a_unit_file_s_spelling_is_named_by_what_systemd_calls_it(name, hint):
    # TimeoutSec was answered "did you mean JobTimeoutUSec?", the start
    # job's timeout, which systemd refuses for a transient unit anyway
    # (review session 34 N, N5).
    with pytest.raises(ConfigError) as error:
        properties(**{name: "10s"})
    assert str(error.value) == (
        f"<config>: exec.sdexec-properties.{name}: unknown property: systemd"
        f" would refuse every unit with it ({hint})"
    )


@pytest.mark.parametrize("listed", ["Conditions", "Asserts"])
def test_the_lists_of_conditions_are_refused_for_what_they_are(listed):
    # "unknown property … (did you mean Conditions?)": the same name, and
    # not unknown. As a string, systemd refuses it (it takes a(sbbs)).
    gate = listed.removesuffix("s")
    with pytest.raises(ConfigError) as error:
        properties(**{listed: "/run/ok"})
    assert str(error.value) == (
        f"<config>: exec.sdexec-properties.{listed}: the list systemd builds of"
        f' each {gate}… property: give each as its own ({gate}PathExists = "/run/ok")'
    )


@pytest.mark.parametrize(
    "name",
    ["ProtectHome", "StartLimitBurst", "LimitCORE", "Wants",
     "CPUAffinity", "ConditionVirtualization", "AssertKernelModuleLoaded"],
)  # fmt: skip
def test_properties_systemd_knows_are_taken(name):
    assert properties(**{name: "1"}).exec.sdexec_properties == {name: "1"}


# --- rules across keys -----------------------------------------------------


def test_sdexec_service_requires_systemd():
    with pytest.raises(ConfigError) as error:
        parse_config({"exec": {"service": "sdexec"}}, source="/etc/sdexec.toml")
    assert str(error.value) == (
        '/etc/sdexec.toml: exec.service: "sdexec" requires systemd.enable = true'
    )


def test_sdexec_service_with_systemd():
    config = parse_config({"exec": {"service": "sdexec"}, "systemd": {"enable": True}})
    assert config.exec.service == "sdexec"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"exec": {"kill-timeot": "5s"}},
         "exec.kill-timeot: unknown key in [exec] (did you mean kill-timeout?)"),
        ({"exec": {"testexec": {"allow-guest": True}}},
         "exec.testexec.allow-guest: unknown key in [exec.testexec]"
         " (did you mean allow-guests?)"),
        ({"systemd": {"enabled": True}},
         "systemd.enabled: unknown key in [systemd] (did you mean enable?)"),
        ({"sdexec": {"frobnicate": 1}}, "sdexec.frobnicate: unknown key in [sdexec]"),
        ({"exec": 5}, "exec: expected a table, got 5"),
        ({"exec": {"testexec": True}}, "exec.testexec: expected a table, got true"),
    ],
)  # fmt: skip
def test_structure_errors(data, message):
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert str(error.value) == f"<config>: {message}"


def test_unknown_table_warns_and_is_ignored():
    with capturedLogs() as events:
        config = parse_config({"resource": {"noverify": True}, "exec": {}}, "f.toml")
    assert config.warnings == ("f.toml: ignoring unknown table [resource]",)
    assert [event["warning"] for event in events] == list(config.warnings)
    assert dataclasses.replace(config, source="<default>", warnings=()) == (
        default_config()
    )


@pytest.mark.parametrize(
    ("table", "meant"),
    [("sytemd", "systemd"), ("Systemd", "systemd"), ("sdexe", "sdexec"),
     ("SDEXEC", "sdexec"), ("exce", "exec")],
)  # fmt: skip
def test_a_misspelled_table_is_an_error_naming_the_one_meant(table, meant):
    # Ignored with a warning, its keys were left out: [sdexe]'s listen and
    # stats unused, [sytemd]'s enable taken for false (review session 34 A3).
    with pytest.raises(ConfigError) as error:
        parse_config({table: {}}, "f.toml")
    assert str(error.value) == (
        f"f.toml: [{table}]: unknown table (did you mean [{meant}]?)"
    )


#: The tables of a Flux system configuration (flux-config(5)): ignored, as
#: Flux's modules ignore each other's, never taken for a misspelling.
FLUX_TABLES = [
    "access", "bootstrap", "tbon", "resource", "ingest", "job-manager",
    "policy", "queues", "kvs", "archive", "job-archive", "heartbeat",
    "content-sqlite", "content-files", "cron", "sched-fluxion-qmanager",
    "sched-fluxion-resource", "sched-simple",
]  # fmt: skip


@pytest.mark.parametrize("table", FLUX_TABLES)
def test_a_flux_system_table_is_ignored_with_a_warning(table):
    config = parse_config({table: {}}, "f.toml")
    assert config.warnings == (f"f.toml: ignoring unknown table [{table}]",)


def test_a_rule_across_tables_names_the_tables_ignored():
    # The enable = true the rule misses may be in a table taken for another.
    with pytest.raises(ConfigError) as error:
        parse_config({"exec": {"service": "sdexec"}, "sd-manager": {}}, "f.toml")
    assert str(error.value) == (
        'f.toml: exec.service: "sdexec" requires systemd.enable = true'
        " (ignored as unknown: [sd-manager])"
    )


def test_retained_output_that_may_not_fit_a_wait_answer_warns():
    # 6 bytes of JSON per control character, an io object per run: a wait
    # answer for a process that wrote that much would pass the 64 MiB a
    # client reads in one answer.
    with capturedLogs() as events:
        config = parse_config({"sdexec": {"retained-output": "9M"}}, "f.toml")
    (warning,) = config.warnings
    assert warning.startswith(
        "f.toml: sdexec.retained-output: 9437184 bytes may take 8 times as many"
        " in one wait answer, more than the 67108864 bytes a client reads in"
        " one answer"
    )
    assert warning.endswith("lower it to at most 8388608")
    assert [event["warning"] for event in events] == [warning]
    assert parse_config({"sdexec": {"retained-output": "8M"}}).warnings == ()
    assert default_config().warnings == ()


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("kill-signal", "SIGSTOP", "SIGSTOP stops a process without ending it"),
        ("term-signal", "CONT", "SIGCONT is ignored by a process that does not"),
        ("sdexec-stop-timer-signal", 28, "SIGWINCH is ignored by a process"),
    ],
)
def test_a_termination_signal_that_ends_nothing_warns(key, value, said):
    # Flux's job-exec takes these: a warning, so that the file loads in both.
    with capturedLogs() as events:
        config = parse_config({"exec": {key: value}}, "f.toml")
    (warning,) = config.warnings
    assert warning.startswith(f"f.toml: exec.{key}: {said}")
    assert [event["warning"] for event in events] == [warning]


@pytest.mark.parametrize(
    ("key", "value"),
    [("kill-signal", "SIGTERM"), ("term-signal", "SIGUSR2"), ("kill-signal", "HUP")],
)
def test_a_termination_signal_that_ends_a_process_does_not_warn(key, value):
    assert parse_config({"exec": {key: value}}).warnings == ()


def test_max_frame_size_bounds_requests_not_the_wait_answer():
    # The service's read limit says nothing of what clients read: a small
    # one with the default retained output is no reason to warn, and a
    # large one does not let a larger retained output fit the clients.
    small = {"max-frame-size": "1M"}
    assert parse_config({"sdexec": small}).warnings == ()
    large = {"max-frame-size": "256M", "retained-output": "32M"}
    (warning,) = parse_config({"sdexec": large}).warnings
    assert "more than the 67108864 bytes a client reads" in warning


@pytest.mark.parametrize(
    ("mode", "warned"),
    [
        (None, True),
        ("0600", True),
        ("0640", True),
        ("0644", True),
        ("0660", False),
        ("0606", False),
    ],
)
def test_allowed_users_the_socket_mode_keeps_out_are_warned_of(mode, warned):
    table = {"allow-users": [0, 1234], **({"socket-mode": mode} if mode else {})}
    warnings = parse_config({"sdexec": table}, "f.toml").warnings
    assert bool(warnings) == warned
    # Root connects whatever the mode: listed alone, it is no one kept out.
    root_only = {**table, "allow-users": [0]}
    assert parse_config({"sdexec": root_only}).warnings == ()
    if warned:
        assert warnings[0].startswith(
            "f.toml: sdexec.allow-users: the users listed cannot connect:"
            f" socket-mode {mode or '0600'} lets only the owner connect"
        )
    assert parse_config({"sdexec": {"socket-mode": "0600"}}).warnings == ()


@pytest.mark.parametrize(
    ("listen", "warned"),
    [
        ("unix:/run/s/s.sock:mode=666", False),
        ("unix:/run/s/s.sock:mode=660", False),
        ("unix:/run/s/s.sock:mode=600", True),
        ("unix:/run/s/s.sock", True),
    ],
)
def test_allowed_users_listen_s_own_mode_lets_in_are_not_warned_of(listen, warned):
    # The warning said "unless listen names its own mode=", and came all
    # the same when listen did, letting them in.
    table = {"allow-users": [1234], "listen": listen}
    assert bool(parse_config({"sdexec": table}).warnings) == warned


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.yaml", "sdexec:\n  socket-mode: 0600\n"),
        ("c.toml", "[sdexec]\nsocket-mode = 0o600\n"),
    ],
)
def test_an_unquoted_octal_socket_mode_is_named_as_written(tmp_path, name, text):
    # Both read it as the number 384, which the admin never wrote.
    path, refused = refusal(tmp_path, name, text)
    assert refused == (
        f"{path}: sdexec.socket-mode: expected permissions in octal, as a string"
        ' such as "0600", got 384 (the number 0600 in octal: quote it)'
    )


SELF_ALIAS = "[[[[[[[[…]]]]]]]]"
#: A few hundred bytes of YAML that alias to a billion items: ``*i``.
LAUGHS = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"{c}: &{c} [{','.join([f'*{p}'] * 10)}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # A few hundred bytes that alias to a billion items: the message
        # writes only what it shows.
        (LAUGHS + "exec: {imp: *i}\n",
         "exec.imp: expected a non-empty string, got [[[[[[[[…"),
        # The checkers of other modules' values quote as briefly (they
        # wrote a 72 MB line, or ran out of memory, for the same file).
        (LAUGHS + "exec: {kill-timeout: *i}\n",
         "exec.kill-timeout: [[[[[[[[…"),
        (LAUGHS + "exec: {term-signal: *i}\n", "exec.term-signal: [[[[[[[[…"),
        (LAUGHS + "sdexec: {request-properties: [*i]}\n",
         "sdexec.request-properties[0]: expected a property"
         " name such as MemoryMax or '@default', got [[[[[[[[…"),
        (LAUGHS + "sdexec: {retained-output: *i}\n",
         "sdexec.retained-output: expected a size"),
        ("exec: {imp: &s [*s]}\n",
         f"exec.imp: expected a non-empty string, got {SELF_ALIAS}"),
        ("exec: &s [*s]\n", f"exec: expected a table, got {SELF_ALIAS}"),
        ("exec: {max-kill-count: " + "9" * 5000 + "}\n",
         ": a number too long to read (more than 4300 digits)"),
    ],
    ids=[
        "billion-laughs",
        "duration",
        "signal",
        "request-properties",
        "retained-output",
        "self-alias",
        "self-alias-table",
        "5000-digits",
    ],
)  # fmt: skip
def test_yaml_that_cannot_be_written_back_is_named_briefly(tmp_path, text, message):
    _, refused = refusal(tmp_path, "sdexec.yaml", text)
    assert message in refused
    assert len(refused) < 1200


def test_toml_integer_of_thousands_of_digits_is_named(tmp_path):
    path = tmp_path / "sdexec.toml"
    path.write_text("[exec]\nmax-kill-count = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == (
        f"{path}: a number too long to read (more than 4300 digits)"
    )


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n"),
        ("c.yaml", "a: " + "[" * 5000),
    ],
)
def test_a_file_nested_past_what_its_parser_follows_is_named(tmp_path, name, text):
    # The parsers recurse per level: a RecursionError was a traceback at
    # start and an unhandled error at a reload.
    path, refused = refusal(tmp_path, name, text)
    assert refused == (
        f"{path}: nested too deeply to read (arrays or tables within each other)"
    )


@pytest.mark.parametrize("stop_timer", [{}, {"sdexec-stop-timer-sec": 60}])
def test_a_kill_timeout_past_any_float_is_refused_not_a_traceback(stop_timer):
    # Even with its own stop timer: the effective max-kill-timeout would be
    # infinite, and /stats and the checker would print `Infinity` (not JSON).
    with pytest.raises(ConfigError) as error:
        parse_config({"exec": {"kill-timeout": 1e308, **stop_timer}})
    assert str(error.value) == (
        "<config>: exec.kill-timeout: 1e+308 s, with max-kill-count 8, puts the"
        " last kill attempt past any time: lower it, or set max-kill-timeout"
    )


@pytest.mark.parametrize(
    "settings", [{"max-kill-timeout": "0.004"}, {"kill-timeout": "0.001"}]
)
def test_a_derived_stop_timer_is_at_least_a_second(settings):
    # As upstream's ceil(): 0 would abandon every lingering unit at once.
    assert parse_config({"exec": settings}).exec.sdexec_stop_timer_sec == 1


def test_an_ssl_endpoint_without_its_key_is_named(tmp_path):
    with pytest.raises(ConfigError) as error:
        parse_config({"sdexec": {"listen": f"ssl:443:privateKey={tmp_path}/none"}})
    assert error.value.key == "sdexec.listen"
    assert "is not a Twisted server endpoint" in str(error.value)


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("tcp:-5", "port -5 is not from 0 to 65535"),
        ("tcp:65536:interface=127.0.0.1", "port 65536 is not from 0 to 65535"),
        ("unix:", "no socket path"),
        ("unix:/" + "s" * 107, "a socket path is at most 107 bytes, this one has 108"),
    ],
)
def test_an_endpoint_a_listen_would_refuse_is_named_at_load(endpoint, problem):
    for key in ("listen", "stats"):
        with pytest.raises(ConfigError) as error:
            parse_config({"sdexec": {key: endpoint}})
        assert error.value.key == f"sdexec.{key}"
        assert str(error.value).endswith(f"({problem})")


@pytest.mark.parametrize("key", ["listen", "stats"])
def test_a_relative_socket_path_is_refused(key):
    # Made in the working directory, / under the units, where no client
    # looked; stats-socket and topology already wanted one (review 38 A2-2).
    with pytest.raises(ConfigError) as error:
        parse_config({"sdexec": {key: "unix:rel/s.sock"}})
    assert str(error.value) == (
        f'<config>: sdexec.{key}: "unix:rel/s.sock": expected an absolute'
        " socket path (unix:/path)"
    )


def test_a_stats_socket_path_too_long_to_bind_is_named():
    with pytest.raises(ConfigError) as error:
        parse_config({"sdexec": {"stats-socket": "/" + "s" * 107}})
    assert error.value.key == "sdexec.stats-socket"
    assert str(error.value).endswith(
        "a socket path is at most 107 bytes, this one has 108"
    )


def test_the_longest_socket_path_and_port_zero_load():
    sdexec = parse_config(
        {"sdexec": {"listen": "unix:/" + "s" * 106, "stats": "tcp:0"}}
    ).sdexec
    assert (sdexec.listen, sdexec.stats) == ("unix:/" + "s" * 106, "tcp:0")


@pytest.mark.parametrize(
    "endpoint", ["tcp:9000", "tcp6:9000", "systemd:domain=INET:index=0"]
)
def test_requests_are_served_on_a_unix_socket_only(endpoint):
    # Clients are known by their uid (SO_PEERCRED), which TCP does not carry:
    # such a service started, said it listened, and refused its own owner.
    with pytest.raises(ConfigError) as error:
        parse_config({"sdexec": {"listen": endpoint}})
    assert str(error.value) == (
        f'<config>: sdexec.listen: "{endpoint}": requests are served on a UNIX'
        " socket only (the service knows its clients by their uid, which a TCP"
        " connection does not carry): give unix:PATH, or"
        " systemd:domain=UNIX:name=NAME"
    )
    with pytest.raises(ConfigError, match=r"^<command line>: --listen: "):
        check_command_line_option("--listen", endpoint)
    assert check_command_line_option("--stats", "tcp:9000") == "tcp:9000"
    systemd = "systemd:domain=UNIX:name=sdexec"
    assert parse_config({"sdexec": {"listen": systemd}}).sdexec.listen == systemd


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("topology", "/etc/sdexec/top\0ology.xml"),
        ("stats-socket", "/run/sdexec/st\0ats.sock"),
        ("listen", "unix:/run/sdexec/sd\0exec.sock"),
    ],
)
def test_a_nul_in_a_path_is_refused_naming_the_key(key, value):
    # Passed on, it failed later as a bare "embedded null byte" (for
    # listen, a start that exited 1 and was restarted every 5 s).
    with pytest.raises(ConfigError) as error:
        parse_config({"sdexec": {key: value}})
    assert str(error.value).startswith(f"<config>: sdexec.{key}: ")
    assert "a path cannot hold a NUL character" in str(error.value)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("/etc/flux/mappers:mappers", '"mappers" is not an absolute directory'),
        ("/etc/fl\0ux", "a path cannot hold a NUL character"),
    ],
)
def test_a_mapper_searchpath_of_relative_directories_is_refused(value, why):
    # Read again at each reload, after twistd -d changed the directory.
    with pytest.raises(ConfigError) as error:
        parse_config({"sdexec": {"mapper-searchpath": value}})
    assert str(error.value).startswith("<config>: sdexec.mapper-searchpath: ")
    assert why in str(error.value)


def test_a_relative_file_from_a_deleted_directory_is_one_line(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ConfigError) as error:
        load_config("sdexec.toml")
    assert str(error.value) == "sdexec.toml: cannot read: No such file or directory"


def test_a_relative_file_is_kept_as_an_absolute_path(tmp_path, monkeypatch):
    # twistd -d changes the directory after the file is read: each reload
    # read "sdexec.toml" from there, and was refused.
    (tmp_path / "sdexec.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    assert load_config("sdexec.toml").source == str(tmp_path / "sdexec.toml")


def test_a_fifo_is_not_read(tmp_path):
    # It would block the reader for ever: at a reload, the whole service.
    path = tmp_path / "sdexec.toml"
    os.mkfifo(path)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: cannot read: not a regular file"


def test_document_must_be_tables():
    with pytest.raises(ConfigError, match=r"^<config>: expected a document of tables$"):
        parse_config([1, 2])  # type: ignore[arg-type]


# --- derived values: the worked examples of flux-config-exec(5) -------------


def kill_attempt_times(kill_timeout: float, max_kill_count: int) -> list[float]:
    return [final_kill_attempt(kill_timeout, n) for n in range(1, max_kill_count + 1)]


def test_default_kill_sequence():
    # "(5 * 5) + 5 + 10 + 20 + 40 + 80 + 160 + 300 = 640s"
    assert kill_attempt_times(5.0, 8) == [25, 30, 40, 60, 100, 180, 340, 640]
    assert default_config().exec.effective_max_kill_timeout == 640.0
    assert default_config().exec.sdexec_stop_timer_sec == 640


def test_max_kill_count_4_kill_timeout_1s():
    # "kill attempts occur at 5s, 6s, 8s, and 12s"
    assert kill_attempt_times(1.0, 4) == [5, 6, 8, 12]
    config = parse_config({"exec": {"max-kill-count": 4, "kill-timeout": "1s"}})
    assert config.exec.effective_max_kill_timeout == 12.0


def test_max_kill_timeout_30m():
    config = parse_config({"exec": {"max-kill-timeout": "30m"}})
    assert config.exec.effective_max_kill_timeout == 1800.0
    assert config.exec.sdexec_stop_timer_sec == 1800


def test_stop_timer_rounds_up_1220_5():
    config = parse_config({"exec": {"max-kill-timeout": "1220.5s"}})
    assert config.exec.sdexec_stop_timer_sec == 1221


def test_stop_timer_rounds_half_second_up_to_1():
    config = parse_config({"exec": {"max-kill-timeout": "0.5"}})
    assert config.exec.sdexec_stop_timer_sec == 1


def test_fractional_effective_timeout_rounds_up():
    # (5 * 0.3) + 0.3 + 0.6 + 1.2 = 3.6
    config = parse_config({"exec": {"kill-timeout": "0.3s", "max-kill-count": 4}})
    assert config.exec.effective_max_kill_timeout == pytest.approx(3.6)
    assert config.exec.sdexec_stop_timer_sec == 4


def test_float_noise_does_not_add_a_second():
    # The sum is 27.000000000000004 in binary floating point.
    config = parse_config({"exec": {"kill-timeout": "1.35s", "max-kill-count": 5}})
    assert config.exec.sdexec_stop_timer_sec == 27


def test_small_max_kill_count():
    # (5 * 0.1) + 0.1 + 0.2 = 0.8
    config = parse_config({"exec": {"kill-timeout": "0.1s", "max-kill-count": 3}})
    assert config.exec.effective_max_kill_timeout == pytest.approx(0.8)


def test_interval_capped_at_300s():
    times = kill_attempt_times(5.0, 10)
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert gaps == [5, 10, 20, 40, 80, 160, 300, 300, 300]


def test_kill_timeout_above_the_cap():
    # The first interval is kill-timeout itself; doubling is what is capped.
    assert kill_attempt_times(600.0, 4) == [3000, 3600, 3900, 4200]


def test_huge_max_kill_count_is_computed_at_once():
    assert final_kill_attempt(5.0, 10**12) == 640 + (10**12 - 8) * 300


def test_max_kill_timeout_takes_precedence_over_count():
    config = parse_config({"exec": {"max-kill-count": 2, "max-kill-timeout": "15m"}})
    assert config.exec.effective_max_kill_timeout == 900.0


def test_explicit_stop_timer_overrides_default():
    # "max-kill-timeout = 15m; sdexec-stop-timer-sec = 1800 # 30 minutes"
    config = parse_config(
        {"exec": {"max-kill-timeout": "15m", "sdexec-stop-timer-sec": 1800}}
    )
    assert config.exec.sdexec_stop_timer_sec == 1800
    assert config.exec.effective_max_kill_timeout == 900.0


def test_largest_stop_timer_is_a_c_int():
    # What Flux's job-exec holds the key in (exec_config.c, "i").
    assert MAX_STOP_TIMER_SEC == 2147483647
    config = configure("exec.sdexec-stop-timer-sec", MAX_STOP_TIMER_SEC)
    assert config.exec.sdexec_stop_timer_sec == MAX_STOP_TIMER_SEC


@pytest.mark.parametrize(
    ("settings", "seconds"),
    [
        ({"max-kill-timeout": "1e300s"}, "1e+300"),
        ({"kill-timeout": "1e14s"}, "6e+14"),
        # Flux's ceil() into an int overflows here.
        ({"max-kill-timeout": "3e9s"}, "3e+09"),
    ],
)
def test_derived_stop_timer_beyond_a_c_int(settings, seconds):
    with pytest.raises(ConfigError) as error:
        parse_config({"exec": settings})
    assert str(error.value) == (
        "<config>: exec.sdexec-stop-timer-sec: the default, the effective"
        f" max-kill-timeout ({seconds} s) rounded up, is more than the 2147483647 s"
        " Flux's job-exec can hold (a C int): lower max-kill-timeout, kill-timeout"
        " or max-kill-count, or set sdexec-stop-timer-sec"
    )


def test_explicit_stop_timer_lifts_the_derived_limit():
    config = parse_config(
        {"exec": {"max-kill-timeout": "1e300s", "sdexec-stop-timer-sec": 3600}}
    )
    assert config.exec.sdexec_stop_timer_sec == 3600


@pytest.mark.parametrize("value", [-1, -3600])
def test_negative_stop_timer_is_derived_as_flux_derives_it(value):
    # exec_config.c derive_sdexec_stop_timer_sec: negative means unset.
    config = parse_config(
        {"exec": {"max-kill-timeout": "30s", "sdexec-stop-timer-sec": value}}
    )
    assert config.exec.sdexec_stop_timer_sec == 30
    assert config.effective()["exec"]["sdexec-stop-timer-sec"] == 30


def test_derived_values_follow_replace():
    changed = dataclasses.replace(
        default_config().exec, kill_timeout=1.0, max_kill_count=4
    )
    assert changed.sdexec_stop_timer_sec == 12


# --- introspection ---------------------------------------------------------


def spec_stats(**changes: Any) -> dict:
    """The `flux module stats job-exec` example of flux-config-exec(5), less
    the runtime "jobs" entry and with this project's job shell."""
    stats = {
        "kill-timeout": 5.0,
        "term-signal": "SIGTERM",
        "kill-signal": "SIGKILL",
        "max-kill-count": 8,
        "max-kill-timeout": -1.0,
        "effective-max-kill-timeout": 640.0,
        "bulk-exec": {
            "config": {
                "default_cwd": "/tmp",
                "default_job_shell": "/usr/libexec/flux/flux-shell",
                "exec_service": "rexec",
                "exec_service_override": 0,
                "default_barrier_timeout": 1800.0,
                "sdexec_stop_timer_sec": 640,
                "sdexec_stop_timer_signal": 10,
            }
        },
    }
    stats.update(changes)
    return stats


#: The `config` of flux-core 0.88's `flux module stats job-exec` with the
#: defaults (job-exec's exec_config.c): the spec's bulk-exec.config less
#: exec_service_override, the key 0.88 dropped, plus the ones added since.
CURRENT_FLUX_CONFIG = {
    "default_cwd": "/tmp",
    "default_job_shell": "/usr/libexec/flux/flux-shell",
    "exec_service": "rexec",
    "default_barrier_timeout": 1800.0,
    "shell_exit_timeout": 30.0,
    "sdexec_stop_timer_sec": 640,
    "sdexec_stop_timer_signal": 10,
    "sdexec_constrain_resources": 0,
}


def as_json_within(whole: Any, part: Any) -> str:
    """``whole`` as JSON, cut to the keys of ``part`` (and theirs, down):
    equal to ``json.dumps(part)`` when ``whole`` holds all of ``part``,
    values and types (``5.0``, ``0``) alike."""

    def cut(whole: Any, part: Any) -> Any:
        if not isinstance(part, dict) or not isinstance(whole, dict):
            return whole
        return {key: cut(whole.get(key), value) for key, value in part.items()}

    return json.dumps(cut(whole, part))


def test_introspect_default_holds_the_spec_example():
    stats = default_config().introspect()
    assert as_json_within(stats, spec_stats()) == json.dumps(spec_stats())


def test_introspect_with_max_kill_timeout_holds_the_spec_example():
    stats = parse_config({"exec": {"max-kill-timeout": "30m"}}).introspect()
    expected = spec_stats(**{"max-kill-timeout": 1800.0})
    expected["effective-max-kill-timeout"] = 1800.0
    expected["bulk-exec"]["config"]["sdexec_stop_timer_sec"] = 1800
    assert as_json_within(stats, expected) == json.dumps(expected)


def test_introspect_shows_method_and_config_as_current_flux_does():
    # flux-core 0.88 reports the shared configuration as "config", beside
    # "method", no longer as "bulk-exec.config": a consumer written for it
    # (`.config.sdexec_stop_timer_sec`, as flux-config-exec(5) now says)
    # found nothing.
    stats = default_config().introspect()
    assert stats["method"] == "bulk-exec"
    assert json.dumps(stats["config"]) == json.dumps(CURRENT_FLUX_CONFIG)
    # Flux up to 0.87 reported the keys it added beside the spec's.
    legacy = stats["bulk-exec"]["config"]
    assert (legacy["shell_exit_timeout"], legacy["sdexec_constrain_resources"]) == (
        30.0,
        0,
    )


def test_introspect_reports_configured_values():
    config = parse_config(
        {
            "exec": {
                "service": "sdexec",
                "service-override": True,
                "method": "bgexec",
                "job-shell": "/opt/shell",
                "shell-exit-timeout": "none",
                "term-signal": "USR2",
                "barrier-timeout": "0",
                "sdexec-constrain-resources": True,
            },
            "systemd": {"enable": True},
        }
    )
    stats = config.introspect()
    assert (stats["term-signal"], stats["method"]) == ("SIGUSR2", "bgexec")
    assert stats["config"] == {
        "default_cwd": "/tmp",
        "default_job_shell": "/opt/shell",
        "exec_service": "sdexec",
        "default_barrier_timeout": 0.0,
        "shell_exit_timeout": 0.0,
        "sdexec_stop_timer_sec": 640,
        "sdexec_stop_timer_signal": 10,
        "sdexec_constrain_resources": 1,
    }
    assert stats["bulk-exec"]["config"] == stats["config"] | {
        "exec_service_override": 1
    }


def test_effective_is_introspection_plus_every_table():
    effective = default_config().effective()
    introspection = default_config().introspect()
    assert {k: effective[k] for k in introspection} == introspection
    assert set(effective) - set(introspection) == {"exec", "sdexec", "systemd"}
    assert effective["exec"]["sdexec-stop-timer-sec"] == 640
    assert effective["exec"]["max-kill-timeout"] is None
    assert effective["exec"]["term-signal"] == "SIGTERM"
    assert effective["systemd"] == {
        "enable": False,
        "sdexec-debug": False,
        "sdbus-debug": False,
        "max-inflight": 64,
        "start-timeout": 120.0,
        "reconnect-timeout": 60.0,
        "bus": "user",
    }
    assert effective["sdexec"]["allow-users"] == []
    json.dumps(effective)  # every value is JSON


def _flatten(tables: dict, skip_introspection: bool = False, prefix: str = "") -> list:
    """Dotted key paths of the [exec]/[sdexec]/[systemd] part of effective()
    (or of a parsed file), sdexec-properties counted as one key."""
    paths = []
    for key, value in tables.items():
        if skip_introspection and key not in ("exec", "sdexec", "systemd"):
            continue
        path = f"{prefix}{key}"
        if isinstance(value, dict) and key != "sdexec-properties":
            paths += _flatten(value, prefix=f"{path}.")
        else:
            paths.append(path)
    return paths


# --- files -----------------------------------------------------------------

SAME_CONTENT = {
    "toml": """
[exec]
service = "sdexec"
kill-timeout = "2s"
max-kill-count = 4
term-signal = "SIGUSR2"
barrier-timeout = "0"
sdexec-constrain-resources = true

[exec.sdexec-properties]
MemoryMax = "95%"
OOMScoreAdjust = "-100"

[exec.testexec]
allow-guests = true

[sdexec]
mapper = "site.mappers.AccountingMapper"
mapper-searchpath = "/etc/flux/mappers"
max-frame-size = "32M"

[systemd]
enable = true
sdbus-debug = true
""",
    "yaml": """
exec:
  service: sdexec
  kill-timeout: 2s
  max-kill-count: 4
  term-signal: SIGUSR2
  barrier-timeout: 0
  sdexec-constrain-resources: true
  sdexec-properties:
    MemoryMax: "95%"
    OOMScoreAdjust: "-100"
  testexec:
    allow-guests: true
sdexec:
  mapper: site.mappers.AccountingMapper
  mapper-searchpath: /etc/flux/mappers
  max-frame-size: 32M
systemd:
  enable: true
  sdbus-debug: true
""",
}


def refusal(tmp_path: Path, name: str, text: str) -> tuple[Path, str]:
    """The file ``name`` of ``text``, and why loading it is refused."""
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    return path, str(error.value)


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def without_source(config: Config) -> Config:
    return dataclasses.replace(config, source="")


@pytest.mark.parametrize("yaml_suffix", [".yaml", ".yml"])
def test_toml_and_yaml_give_the_same_config(tmp_path, yaml_suffix):
    toml = load_config(write(tmp_path, "c.toml", SAME_CONTENT["toml"]))
    yml = load_config(write(tmp_path, f"c{yaml_suffix}", SAME_CONTENT["yaml"]))
    assert without_source(toml) == without_source(yml)
    assert toml.exec.kill_timeout == 2.0
    assert toml.sdexec.max_frame_size == 32 * MiB
    assert toml.source == str(tmp_path / "c.toml")


def test_load_accepts_str_and_path(tmp_path):
    path = write(tmp_path, "c.toml", "")
    assert load_config(str(path)) == load_config(path)


def test_empty_files_are_defaults(tmp_path):
    for name in ("empty.toml", "empty.yaml"):
        config = load_config(write(tmp_path, name, "# nothing\n"))
        assert without_source(config) == without_source(default_config())


def test_quoted_yes_is_not_a_boolean(tmp_path):
    path = write(tmp_path, "c.yaml", 'systemd:\n  enable: "yes"\n')
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f'{path}: systemd.enable: {BOOLEAN}, got "yes"'


def test_error_names_the_file(tmp_path):
    path = write(tmp_path, "sdexec.toml", '[exec]\nkill-timeout = "5x"\n')
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == (
        f'{path}: exec.kill-timeout: "5x" is not a valid duration: {DURATION}'
    )
    assert error.value.source == str(path)


def test_missing_file(tmp_path):
    path = tmp_path / "missing.toml"
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: cannot read: No such file or directory"
    assert error.value.key is None


def test_a_toml_in_a_directory_that_is_a_directory_is_named(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.toml: cannot read: Is a directory$"):
        load_config(tmp_path)


def test_a_flux_conf_d_directory_loads_merged_as_flux_merges_it(tmp_path):
    # Flux's system instance reads a directory (flux-broker --config-path
    # /etc/flux/system/conf.d): every *.toml in it, by name, merged. It was
    # refused ("expected a .toml, .yaml or .yml file"), and no one file of
    # it loads alone: [systemd] enable is in another (review session 46).
    write(tmp_path, "exec.toml", '[exec]\nservice = "sdexec"\nkill-timeout = "2s"\n')
    write(tmp_path, "resource.toml", "[resource]\nnoverify = true\n")
    write(tmp_path, "systemd.toml", "[systemd]\nenable = true\n")
    write(tmp_path, "zz-site.toml", '[exec]\nkill-timeout = "3s"\n')
    write(tmp_path, "ignored.yaml", "exec:\n  kill-timeout: 1d\n")  # Flux: *.toml
    config = load_config(tmp_path)
    assert (config.exec.service, config.systemd.enable) == ("sdexec", True)
    assert config.exec.kill_timeout == 3.0  # the later file's, as in Flux
    assert config.source == str(tmp_path)
    assert config.warnings == (
        f"{tmp_path}/zz-site.toml: exec.kill-timeout: also set in"
        f" {tmp_path}/exec.toml; this file's value is used, as Flux uses it"
        " (the later file by name)",
        f"{tmp_path}/ignored.yaml: {_NOT_READ}",
        f"{tmp_path}/resource.toml: ignoring unknown table [resource]",
    )


def test_a_conf_d_file_of_a_format_read_only_alone_is_named_not_read(tmp_path):
    # An admin's sdexec.yaml moved into the directory (its caps, its
    # request-properties) loaded as the defaults without a word: each file
    # of a format sdexec reads alone (YAML, JSON, a .TOML) is named now.
    write(tmp_path, "sdexec.yaml", "sdexec:\n  request-properties: []\n")
    write(tmp_path, "20-site.yml", "exec:\n  kill-timeout: 1d\n")
    write(tmp_path, "30-caps.json", '{"exec": {"kill-timeout": "1d"}}')
    write(tmp_path, "40-exec.TOML", '[exec]\nkill-timeout = "1d"\n')
    write(tmp_path, ".hidden.yaml", "exec: {}\n")  # a dot file: never read
    write(tmp_path, "README", "not a configuration file\n")
    with capturedLogs() as events:
        config = load_config(tmp_path)
    assert (config.exec, config.sdexec) == (
        default_config().exec,
        default_config().sdexec,
    )
    assert config.warnings == tuple(
        f"{tmp_path}/{name}: {_NOT_READ}"
        for name in ("20-site.yml", "30-caps.json", "40-exec.TOML", "sdexec.yaml")
    )
    assert [event["warning"] for event in events] == list(config.warnings)
    assert _NOT_READ == (
        "not read: only the *.toml files of a directory are, as Flux reads its"
        " conf.d: write its settings in TOML, in a file named *.toml"
    )


def test_a_key_set_in_many_conf_d_files_is_one_warning_naming_first_and_last(
    tmp_path,
):
    # 500 files each setting the same key logged 499 warnings (thousands
    # for a larger conf.d, on the reactor; Twisted's start-up buffer kept
    # the last 200): one per key now, with the count, the file whose value
    # is used and the first and last of the others.
    for number in range(1, 501):
        write(tmp_path, f"{number:03}.toml", f'[exec]\nkill-timeout = "{number}s"\n')
    write(tmp_path, "a.toml", "[systemd]\nenable = true\n")
    write(tmp_path, "b.toml", "[systemd]\nenable = false\n")
    write(tmp_path, "c.toml", "[systemd]\nenable = true\n")
    with capturedLogs() as events:
        config = load_config(tmp_path)
    assert config.exec.kill_timeout == 500.0
    assert config.warnings == (
        f"{tmp_path}/500.toml: exec.kill-timeout: also set in 499 earlier files"
        f" (the first {tmp_path}/001.toml, the last {tmp_path}/499.toml); this"
        " file's value is used, as Flux uses it (the later file by name)",
        f"{tmp_path}/c.toml: systemd.enable: also set in {tmp_path}/a.toml and"
        f" {tmp_path}/b.toml; this file's value is used, as Flux uses it (the"
        " later file by name)",
    )
    assert [event["warning"] for event in events] == list(config.warnings)


def test_an_error_in_a_conf_d_directory_names_its_file(tmp_path):
    write(tmp_path, "exec.toml", '[exec]\nservice = "rexec"\n')
    write(tmp_path, "term.toml", '[exec]\nkill-timeout = "5x"\n')
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path)
    assert str(error.value) == (
        f'{tmp_path}/term.toml: exec.kill-timeout: "5x" is not a valid duration:'
        f" {DURATION}"
    )
    write(tmp_path, "term.toml", "[exec\n")
    with pytest.raises(ConfigError, match=r"/term\.toml: TOML syntax error: "):
        load_config(tmp_path)
    for text, key in (
        ("[sytemd]\nenable = true\n", "[sytemd]"),
        ('"exec.kill-timeout" = "5s"\n', '"exec.kill-timeout"'),
    ):
        write(tmp_path, "term.toml", text)
        with pytest.raises(ConfigError) as error:
            load_config(tmp_path)
        assert (error.value.source, error.value.key) == (
            str(tmp_path / "term.toml"),
            key,
        )


def test_a_rule_across_conf_d_files_names_the_other_key_s_file(tmp_path):
    # The error named the file of exec.service alone, the one that was
    # right: not the later file whose systemd.enable = false was in force.
    write(tmp_path, "10-exec.toml", '[exec]\nservice = "sdexec"\n')
    write(tmp_path, "20-systemd.toml", "[systemd]\nenable = true\n")
    write(tmp_path, "90-debug.toml", "[systemd]\nenable = false\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path)
    assert str(error.value) == (
        f'{tmp_path}/10-exec.toml: exec.service: "sdexec" requires systemd.enable'
        f" = true (systemd.enable is set in {tmp_path}/90-debug.toml)"
    )
    # Not where both are in one file, nor where enable is not set at all.
    write(tmp_path, "90-debug.toml", '[exec]\nservice = "sdexec"\n')
    write(tmp_path, "20-systemd.toml", "[systemd]\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path)
    assert str(error.value) == (
        f'{tmp_path}/90-debug.toml: exec.service: "sdexec" requires systemd.enable'
        " = true"
    )


def test_an_empty_conf_d_directory_is_the_defaults(tmp_path):
    assert without_source(load_config(tmp_path)) == without_source(default_config())


def test_a_conf_d_table_nested_past_the_merge_s_depth_is_named(tmp_path):
    # [a.a.a...] nests without recursing in tomllib, but the merge of a
    # directory's files recursed per level: a RecursionError's traceback
    # at start, an internal error at a reload.
    deep = "[" + ".".join(["a"] * 3000) + "]\nx = 1\n"
    write(tmp_path, "10-deep.toml", deep)
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path)
    assert str(error.value) == f"{tmp_path}/10-deep.toml: {_TOO_DEEP}"


def test_not_utf8(tmp_path):
    path = write(tmp_path, "c.toml", b"[exec]\nimp = '\xff'\n")
    with pytest.raises(ConfigError, match=r"c\.toml: cannot read: not UTF-8 text"):
        load_config(path)


def test_unknown_suffix(tmp_path):
    path = write(tmp_path, "c.conf", "{}")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: expected a .toml, .json, .yaml or .yml file"


def test_a_relative_path_is_named_absolute_whatever_the_error(tmp_path, monkeypatch):
    # "m.conf: expected …" as given, where a missing or malformed file is
    # named by its absolute path: a reload, after twistd's -d, names it so.
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "c.conf", "{}")
    for name, why in (("c.conf", "expected a .toml"), ("gone.toml", "cannot read")):
        with pytest.raises(ConfigError) as error:
            load_config(name)
        assert str(error.value).startswith(f"{tmp_path}/{name}: {why}")


@pytest.mark.parametrize("name", ["c.json", "c.JSON"])
def test_a_json_file_loads_as_flux_reads_it(tmp_path, name):
    # Flux's flux_conf_parse reads a file ending .json as JSON (libflux
    # conf.c); sdexec refused it (review session 46).
    document = {
        "exec": {"kill-timeout": "2s", "sdexec-stop-timer-signal": "SIGKILL"},
        "systemd": {"enable": True},
        "resource": {"noverify": True},
    }
    config = load_config_quietly(write(tmp_path, name, json.dumps(document)))
    assert (config.exec.kill_timeout, config.systemd.enable) == (2.0, True)
    # Flux reads this file too: its forms are warned about, as in TOML.
    assert any(
        "exec.sdexec-stop-timer-signal" in warning and "write 9" in warning
        for warning in config.warnings
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[]", "expected a document of tables"),
        ('{"exec": {"kill-timeout": "2s",}}',
         "JSON syntax error: Expecting property name enclosed in double quotes"
         " (at line 1, column 32)"),
        ('{"exec": {"max-start-delay-percent": NaN}}',
         "JSON syntax error: NaN is not a JSON number"),
        ('{"exec": {"imp": "/a"}, "exec": {"imp": "/b"}}',
         'JSON syntax error: duplicate key "exec"'),
        ("", "JSON syntax error: Expecting value (at line 1, column 1)"),
        # One key with dots in its name, as in Flux: not [exec]'s.
        ('{"exec.kill-timeout": "2s"}',
         '"exec.kill-timeout": a dotted key is not nested in JSON: write'
         ' {"exec": {"kill-timeout": …}}'),
    ],
)  # fmt: skip
def test_a_bad_json_file_is_named(tmp_path, text, reason):
    path = write(tmp_path, "c.json", text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: {reason}"


def test_toml_syntax_error_is_one_line(tmp_path):
    path = write(tmp_path, "c.toml", "[exec\nimp = 1\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: TOML syntax error: ")
    assert "(at line 1, column 6)" in str(error.value)
    assert "\n" not in str(error.value)


def test_yaml_syntax_error_is_one_line(tmp_path):
    path = write(tmp_path, "c.yaml", "exec:\n  kill-timeout: [5s\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: YAML syntax error: ")
    assert "(at line 3, column 1)" in str(error.value)
    assert "\n" not in str(error.value)


def test_a_character_yaml_does_not_take_is_said_where(tmp_path):
    # "unacceptable character #x001b: special characters are not allowed"
    # alone: where was on the line the message was cut to one.
    path = write(tmp_path, "c.yaml", 'exec:\n  imp: "/a\x1b"\n')
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == (
        f"{path}: YAML syntax error: unacceptable character #x001b: special"
        " characters are not allowed (at line 2, column 11)"
    )


def test_yaml_duplicate_key_is_an_error_as_in_toml(tmp_path):
    path = write(tmp_path, "c.yaml", "exec:\n  imp: /a\n  kill-timeout: 5\n  imp: /b\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == (
        f"{path}: YAML syntax error: duplicate key imp (at line 4, column 3)"
    )


def test_yaml_unhashable_key(tmp_path):
    path = write(tmp_path, "c.yaml", "? [1]\n: 2\n")
    with pytest.raises(ConfigError, match="YAML syntax error: found unhashable key"):
        load_config(path)


def test_yaml_document_must_be_tables(tmp_path):
    path = write(tmp_path, "c.yaml", "- exec\n")
    with pytest.raises(ConfigError, match="expected a document of tables"):
        load_config(path)


def test_toml_duplicate_key_is_a_syntax_error(tmp_path):
    path = write(tmp_path, "c.toml", "[exec]\nimp = 'a'\nimp = 'b'\n")
    with pytest.raises(ConfigError, match="TOML syntax error"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[sdexec]\n[sdexec]\n", "Cannot declare [sdexec] twice (at line 2, column"),
        (
            "[exec.sdexec-properties]\n[exec.sdexec-properties]\n",
            "Cannot declare [exec.sdexec-properties] twice",
        ),
        ("a = {b = 1}\na.c = 2\n", "Cannot mutate immutable namespace [a]"),
        ('["it\'s\\u001b".x]\n["it\'s\\u001b".x]\n', '["it\'s\\u001b".x] twice'),
    ],
)
def test_a_toml_syntax_error_names_a_table_as_its_header(tmp_path, text, said):
    # tomllib writes key paths as Python tuples: "Cannot declare
    # ('sdexec',) twice" is nothing an admin wrote or can search the file for.
    path = write(tmp_path, "c.toml", text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert said in str(error.value)
    assert "(" not in str(error.value).split("TOML syntax error: ")[1].split(" (at")[0]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[exec]\nimp = 'a'\nimp = 'b'\n", "key exec.imp (at line 3, column"),
        # A value given over several lines: tomllib names the last one.
        ("[sdexec]\nx = 1\n\nx = [\n  1,\n]\n", "key sdexec.x (at line 6, column"),
        ('[exec]\n"k=v" = 1\n"k=v" = 2', 'key exec."k=v" (at end of document)'),
        ("a.b = 1\n[a.b]\n", "table [a.b] (at line 2, column"),
        ("[[t]]\nx = 1\nx = 2\n", "key t.x (at line 3, column"),
    ],
)
def test_a_toml_value_given_twice_names_its_key(tmp_path, text, said):
    # tomllib says "Cannot overwrite a value (at line 3, column 10)" alone.
    path = write(tmp_path, "c.toml", text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert f"TOML syntax error: Cannot overwrite a value: {said}" in str(error.value)


@pytest.mark.parametrize(
    "text",
    [
        # A multi-line string of table headers before the key: each was
        # tried as the key's table, the file up to it read again.
        '[sdexec]\nx = """\n' + "[a]\n" * 4000 + '"""\ny = 1\ny = 2\n',
        # A quoted key full of "=": the line up to each was read again.
        '[sdexec]\n"' + "=" * 8000 + '" = 1\n"' + "=" * 8000 + '" = 2\n',
    ],
    ids=["headers-in-a-string", "equals-in-a-key"],
)
def test_a_key_given_twice_is_looked_for_within_a_bound(tmp_path, monkeypatch, text):
    # Quadratic: a 64 KB file took 40 s to refuse, the reactor held through
    # the reload. What tomllib reads is counted, not timed.
    read: list[int] = []
    loads = tomllib.loads
    monkeypatch.setattr(
        tomllib, "loads", lambda text: read.append(len(text)) or loads(text)
    )
    path = write(tmp_path, "c.toml", text)
    with pytest.raises(ConfigError, match="Cannot overwrite a value"):
        load_config(path)
    assert sum(read) <= len(text) + _KEY_NAMED_UP_TO


# --- the shipped examples ---------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_loads_clean(path):
    config = load_config(path)
    assert config.warnings == ()
    assert config.exec.service == "sdexec"
    assert config.systemd.enable is True
    # Left commented so a real run uses the service's defaults.
    assert config.sdexec.topology is None
    assert config.sdexec.listen is None


def test_examples_are_equal():
    toml, yml = (without_source(load_config(path)) for path in EXAMPLES)
    assert toml == yml


# A commented key line: "# kill-timeout = ..." or "  #   MemoryMax: ...".
COMMENTED_KEY = re.compile(r"^(\s*)# (\s*[A-Za-z-]+ ?[=:](?: |$))", re.MULTILINE)


def test_examples_show_every_key_and_uncommented_still_load(tmp_path):
    uncommented = {}
    for path in EXAMPLES:
        text = COMMENTED_KEY.sub(r"\1\2", path.read_text())
        uncommented[path.suffix] = load_config(write(tmp_path, path.name, text))
        raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
        shown = set(_flatten(raw))
        assert shown == {key.path for key in KEYS}, path.name
    assert without_source(uncommented[".toml"]) == without_source(uncommented[".yaml"])


def test_an_ipv6_interface_with_its_colons_unescaped_is_refused_saying_so():
    # operating.md has a scraper elsewhere reach the node's address; an IPv6
    # one written as is was refused with Twisted's "_parseTCP() got multiple
    # values for argument 'interface'" alone (review session 45).
    with pytest.raises(ConfigError) as error:
        configure("sdexec.stats", "tcp:8490:interface=fd00::5")
    assert str(error.value).endswith(
        "(_parseTCP() got multiple values for argument 'interface';"
        " an IPv6 address's colons are escaped with a backslash:"
        " interface=fd00\\:\\:5 (in TOML a 'literal string' keeps it as written))"
    )


def test_an_ipv6_interface_as_configuration_md_writes_it_loads(tmp_path):
    text = "[sdexec]\nstats = 'tcp:8490:interface=fd00\\:\\:5'\n"
    config = load_config(write(tmp_path, "ipv6.toml", text))
    endpoint = serverFromString(None, config.sdexec.stats)
    assert (endpoint._interface, endpoint._port) == ("fd00::5", 8490)


SPEC_EXAMPLES = [
    '[exec]\nimp = "/usr/libexec/flux/flux-imp"\n'
    'job-shell = "/usr/libexec/flux/flux-shell-special"\n',
    '[exec]\nservice = "sdexec"\nsdexec-constrain-resources = true\n'
    '[exec.sdexec-properties]\nMemoryMax = "90%"\n',
    '[exec]\nservice = "sdexec"\nsdexec-constrain-resources = true\n'
    '[sdexec]\nmapper = "site.mappers.AccountingMapper"\n'
    'mapper-searchpath = "/etc/flux/mappers"\n',
    '[exec]\nmax-kill-timeout = "30m"\nservice = "sdexec"\n',
    '[exec]\nservice = "sdexec"\nmax-kill-timeout = "15m"\n'
    "sdexec-stop-timer-sec = 1800 # 30 minutes instead of 15\n",
    "[exec.testexec]\nallow-guests = true\n",
]


def test_a_current_flux_exec_table_loads(tmp_path):
    # Keys of flux-config-exec(5) newer than the spec were "unknown key"
    # errors: a current Flux system file did not load (review session 40 G3).
    text = (
        '[exec]\nservice = "sdexec"\nmethod = "bgexec"\n'
        'shell-exit-timeout = "none"\n[systemd]\nenable = true\n'
    )
    config = load_config(write(tmp_path, "system.toml", text))
    assert (config.exec.method, config.exec.shell_exit_timeout) == ("bgexec", 0.0)
    assert config.warnings == ()
    shown = config.effective()["exec"]
    assert (shown["method"], shown["shell-exit-timeout"]) == ("bgexec", 0.0)
    # Reported in the stats too, as Flux's job-exec reports them.
    stats = config.introspect()
    assert (stats["method"], stats["config"]["shell_exit_timeout"]) == ("bgexec", 0.0)


@pytest.mark.parametrize("text", SPEC_EXAMPLES)
def test_spec_examples_load(tmp_path, text):
    # The man page's snippets assume [systemd] is configured elsewhere.
    path = write(tmp_path, "c.toml", text + "[systemd]\nenable = true\n")
    assert load_config(path).warnings == ()


# --- python -m sdexec.config -------------------------------------------------


def test_main_prints_effective_config(capsys):
    assert main([str(EXAMPLES[0])]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == load_config(EXAMPLES[0]).effective()
    assert out.startswith("{\n  ")  # indented
    assert err == ""


def test_main_reports_error_in_one_line(tmp_path, capsys):
    path = write(tmp_path, "bad.toml", '[exec]\nkill-timeout = "5x"\n')
    assert main([str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    # Led by the program's name, as python3 -m sdexec.map's lines are.
    assert err == (
        f"python3 -m sdexec.config: {path}: exec.kill-timeout:"
        f' "5x" is not a valid duration: {DURATION}\n'
    )


def test_main_missing_file(tmp_path, capsys):
    assert main([str(tmp_path / "none.yaml")]) == 1
    out, err = capsys.readouterr()
    assert err.endswith("none.yaml: cannot read: No such file or directory\n")
    assert "Traceback" not in out + err


def test_main_prints_warnings_and_succeeds(tmp_path, capsys):
    path = write(tmp_path, "c.toml", "[resource]\nnoverify = true\n")
    assert main([str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"python3 -m sdexec.config: warning: {path}: ignoring unknown table"
        " [resource]\n"
    )
    assert json.loads(out)["exec"]["service"] == "rexec"


def run_checker(path) -> subprocess.CompletedProcess:
    """``python -m sdexec.config PATH``, as an admin runs it."""
    return subprocess.run(
        [sys.executable, "-m", "sdexec.config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_module_runs_as_a_program(tmp_path):
    bad = write(tmp_path, "bad.yaml", "exec: [")
    for path, status in ((EXAMPLES[1], 0), (bad, 1)):
        run = run_checker(path)
        assert run.returncode == status, run.stderr
        assert "Traceback" not in run.stderr


def test_the_checker_builds_the_mapper_as_the_service_does(tmp_path):
    # A mapper the service cannot load must not pass the check.
    bad = write(
        tmp_path,
        "mapper.toml",
        "[exec]\nsdexec-constrain-resources = true\n"
        '[sdexec]\nmapper = "nosuch.module.Mapper"\n'
        f'mapper-searchpath = "{tmp_path}"\n',
    )
    run = run_checker(bad)
    assert run.returncode == 1
    assert run.stderr == (
        f"python3 -m sdexec.config: {bad}: sdexec.mapper:"
        " mapper module 'nosuch.module' is neither in"
        f" mapper-searchpath ({tmp_path}) nor on the Python path\n"
    )


def test_a_reader_that_left_ends_the_checker_quietly():
    # `python -m sdexec.config FILE | head` printed a traceback.
    script = (
        f"{sys.executable} -m sdexec.config {EXAMPLES[0]} | (exec 0<&-; sleep 0.5)"
        '; echo "$' + '{PIPESTATUS[0]}"'
    )
    run = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert (run.stdout, run.stderr) == ("141\n", "")


def test_the_checker_writes_its_whole_json_to_a_nonblocking_stdout():
    # Written with print's write(): under PYTHONUNBUFFERED the JSON past
    # what a non-blocking pipe took was dropped, and the checker exited 0.
    reader, writer = os.pipe()
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)  # one page: the JSON is 2.6 KiB
    os.write(writer, b"x" * 3072)  # room for a third of it
    os.set_blocking(writer, False)
    with subprocess.Popen(
        [sys.executable, "-m", "sdexec.config", str(EXAMPLES[0])],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=writer,
        stderr=subprocess.PIPE,
    ) as checker:
        os.close(writer)
        time.sleep(0.5)  # it has written what fits and waits, or has exited
        with open(reader, "rb") as pipe:
            written = pipe.read()
        assert (checker.wait(60), checker.stderr.read()) == (0, b"")
    assert json.loads(written[3072:])["exec"]["service"]


def test_checking_endpoints_installs_no_reactor():
    # The service installs the asyncio reactor after reading its config; an
    # import or an endpoint check that installed the default one would stop it.
    probe = (
        "import sys; from sdexec.config import parse_config;"
        " parse_config({'sdexec': {'listen': 'unix:/tmp/s', 'stats': 'tcp:8490'}});"
        " sys.exit('twisted.internet.reactor' in sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, check=False
    )
    assert run.returncode == 0, run.stderr


ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(st.lists(st.tuples(st.sampled_from([key.path for key in KEYS]), ANY_VALUE)))
def test_any_value_is_accepted_or_refused_with_config_error(settings):
    data: dict = {}
    for path, value in settings:
        *tables, key = path.split(".")
        table = data
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = value
    try:
        parse_config(data)
    except ConfigError as error:
        assert "\n" not in str(error)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"exec": {"sdexec-properties": {"\n": None}}},
         'exec.sdexec-properties."\\n": expected a systemd property name'),
        ({"exec": {"a\nb": 1}}, 'exec."a\\nb": unknown key in [exec]'),
    ],
)  # fmt: skip
def test_a_key_that_would_break_the_line_is_quoted(settings, message):
    # The hypothesis test of any value found it now and then: the suite
    # was flaky, and the error two lines.
    with pytest.raises(ConfigError) as error:
        parse_config(settings)
    assert str(error.value).startswith(f"<config>: {message}")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("name", "value"), [("ProtectSystem", "ful"), ("ProtectHome", "ro")]
)
def test_a_level_systemd_does_not_have_is_refused_at_load(name, value):
    # (review 37 V2) It loaded, and systemd refused every job with it.
    with pytest.raises(ConfigError) as error:
        properties(**{name: value})
    assert f"exec.sdexec-properties.{name}: {value!r} is not one of" in str(error.value)


@pytest.mark.parametrize("name", MEMORY)
@pytest.mark.parametrize(
    "value", ["0x40000000", "1.5e9", "0.5G", "5e1%", "0x32%", "50.000%", "09M", "007"]
)
def test_memory_property_as_flux_reads_it(name, value):
    # Flux's sdexec reads a site's limits with its parse_size and
    # sdexec_parse_percent: hex, floating point, exponents.
    assert properties(**{name: value}).exec.sdexec_properties == {name: value}


@pytest.mark.parametrize(
    "name", [*MEMORY, "MemoryZSwapMax", "StartupMemoryMax", "DefaultMemoryLow"]
)
@pytest.mark.parametrize("value", ["0100M", "077", " 010 g"])
def test_a_site_s_octal_memory_size_is_refused(name, value):
    # Flux reads 0100M as octal (64M); sdexec read it as 100M: a site's cap
    # must not change under it unsaid.
    with pytest.raises(ConfigError) as error:
        properties(**{name: value})
    assert str(error.value) == (
        f"<config>: exec.sdexec-properties.{name}: {json.dumps(value)}: a leading"
        " zero makes it octal, as Flux reads it (sdexec before read it as"
        " decimal): write it without the zero, or in hex (0x...)"
    )
