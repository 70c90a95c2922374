"""The RFC 42 command object, executable lookup, the unit properties it
implies, and unit object path escaping (no systemd needed)."""

from __future__ import annotations

import errno
import os
import re
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

import sdexec.command
import sdexec.plan
from sdexec.command import (
    DESCRIPTION_LENGTH,
    Command,
    CommandError,
    command_line,
    describe,
    unit_properties,
)
from sdexec.config import default_config, parse_config
from sdexec.limits import MAX_COMMAND, MAX_SEARCH_DIRECTORIES
from sdexec.property import PropertyError
from sdexec.refusal import RequestRefused
from sdexec.systemd import unit_object_path
from sdexec.testing import exec_plan
from sdexec.unitfile import unit_file_problem


class Typed(NamedTuple):
    signature: str
    value: object


def make_executable(path, mode=0o755):
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


# -- Command.from_json ---------------------------------------------------------


def test_from_json_reads_every_field():
    command = Command.from_json(
        {
            "cmdline": ["hostname", "-s"],
            "cwd": "/tmp",
            "env": {"A": "1"},
            "opts": {"SDEXEC_PROP_MemoryMax": "1G"},
            "channels": ["PMI_FD"],
        }
    )
    assert command == Command(
        cmdline=["hostname", "-s"],
        env={"A": "1"},
        opts={"SDEXEC_PROP_MemoryMax": "1G"},
        cwd="/tmp",
        channels=["PMI_FD"],
    )


def test_from_json_defaults():
    assert Command.from_json({"cmdline": ["true"]}) == Command(["true"])


@pytest.mark.parametrize(
    ("cmd", "field"),
    [
        ([], "cmd"),
        ({}, "cmd.cmdline"),
        ({"cmdline": []}, "cmd.cmdline"),
        ({"cmdline": "true"}, "cmd.cmdline"),
        ({"cmdline": ["true", 1]}, "cmd.cmdline[1]"),
        ({"cmdline": [None]}, "cmd.cmdline[0]"),
        ({"cmdline": ["true"], "cwd": 7}, "cmd.cwd"),
        ({"cmdline": ["true"], "env": []}, "cmd.env"),
        ({"cmdline": ["true"], "env": {"A": 1}}, "cmd.env.A"),
        ({"cmdline": ["true"], "opts": {"X": None}}, "cmd.opts.X"),
        # A key that is no C name is quoted: "cmd.env..", "cmd.env.A.B" read
        # as paths of their own.
        ({"cmdline": ["true"], "env": {"": 1}}, "cmd.env['']"),
        ({"cmdline": ["true"], "env": {"A.B": 1}}, "cmd.env['A.B']"),
        ({"cmdline": ["true"], "opts": {"A B": 1}}, "cmd.opts['A B']"),
        ({"cmdline": ["true"], "opts": {"1A": 1}}, "cmd.opts['1A']"),
        ({"cmdline": ["true"], "env": {"_A1": 1}}, "cmd.env._A1"),
        ({"cmdline": ["true"], "channels": "PMI_FD"}, "cmd.channels"),
        ({"cmdline": ["true"], "channels": [3]}, "cmd.channels"),
    ],
)
def test_from_json_errors_name_the_field(cmd, field):
    with pytest.raises(CommandError, match=f"^{re.escape(field)}: expected"):
        Command.from_json(cmd)


@pytest.mark.parametrize(
    ("opts", "said"),
    [
        ({"A.B": "x\0"}, "cmd.opts['A.B']: contains a NUL character at 1"),
        ({"": "x" * (MAX_COMMAND + 1)}, "the largest cmd.opts[''] ("),
    ],
    ids=["NUL", "E2BIG"],
)
def test_the_limits_name_a_key_that_is_no_c_name_quoted(opts, said):
    with pytest.raises(RequestRefused) as refused:
        exec_plan(**opts)
    assert said in refused.value.errstr


@pytest.mark.parametrize("key", ["msgchans", "msgchan"])
def test_from_json_refuses_a_message_channel(key):
    # Ignored, the process ran without the variable RFC 42 has the server
    # set (its channel's URI), and nothing said why; empty, as flux-core's
    # cmd_tojson always sends "msgchan", there is nothing to refuse.
    channel = {"name": "FLUX_MODULE_URI", "uri": "interthread://m"}
    with pytest.raises(CommandError, match=f"^cmd.{key}: message channels are not"):
        Command.from_json({"cmdline": ["true"], key: [channel]})
    with pytest.raises(CommandError, match=f"^cmd.{key}: expected an array"):
        Command.from_json({"cmdline": ["true"], key: {}})
    assert Command.from_json({"cmdline": ["true"], key: []}) == Command(["true"])


def test_requested_properties_strip_the_prefix():
    command = Command(
        ["true"],
        opts={
            "SDEXEC_PROP_MemoryMax": "1G",
            "SDEXEC_PROP_": "kept, for the policy to refuse: no name",
            "SDEXEC_NAME": "not a property",
            "sdexec_prop_Lower": "prefix is case-sensitive",
        },
    )
    assert command.requested_properties() == {
        "MemoryMax": "1G",
        "": "kept, for the policy to refuse: no name",
    }
    assert command.option("SDEXEC_NAME") == "not a property"
    assert command.option("missing", "default") == "default"


# -- find_executable ---------------------------------------------------------------


def test_resolve_searches_the_commands_path(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    make_executable(second / "prog")
    make_executable(first / "prog", mode=0o644)  # not executable: skipped
    command = Command(["prog"], env={"PATH": f"{first}:{second}"})
    assert command.find_executable().executable == str(second / "prog")


def test_resolve_relative_path_entries_against_cwd(tmp_path):
    (tmp_path / "bin").mkdir()
    make_executable(tmp_path / "bin" / "prog")
    command = Command(["prog"], env={"PATH": "bin:/nonexistent"}, cwd=str(tmp_path))
    assert command.find_executable().executable == str(tmp_path / "bin" / "prog")


def test_resolve_empty_path_entry_is_cwd(tmp_path):
    make_executable(tmp_path / "prog")
    command = Command(["prog"], env={"PATH": ":/nonexistent"}, cwd=str(tmp_path))
    assert command.find_executable().executable == str(tmp_path / "prog")


def test_resolve_without_path_uses_the_default():
    assert Command(["sh"]).find_executable().executable == os.path.join(
        os.defpath.split(":")[0], "sh"
    )


def test_without_cwd_a_relative_command_is_found_where_the_unit_runs(tmp_path):
    """The manager's working directory (the user's home under a user
    manager), as execvp would run in it: not ``/``."""
    (tmp_path / "bin").mkdir()
    make_executable(tmp_path / "bin" / "prog")
    command = Command(["bin/prog"])
    assert command.find_executable(default_cwd=str(tmp_path)).executable == str(
        tmp_path / "bin" / "prog"
    )
    in_path = Command(["prog"], env={"PATH": "bin"})
    assert in_path.find_executable(default_cwd=str(tmp_path)).executable == str(
        tmp_path / "bin" / "prog"
    )
    assert (
        Command(["bin/prog"], cwd="/").find_executable(str(tmp_path)).executable is None
    )


def test_the_default_working_directory_is_the_managers(monkeypatch, tmp_path):
    monkeypatch.setattr(sdexec.plan, "_home_directory", lambda: str(tmp_path))
    make_executable(tmp_path / "prog")
    plan = exec_plan(["./prog"])
    assert plan.executable == str(tmp_path / "prog")
    exec_start = {prop.name: prop.value for prop in plan.properties}["ExecStart"]
    assert exec_start[0][0] == str(tmp_path / "prog")
    system = parse_config({"systemd": {"bus": "system"}})
    assert sdexec.plan.manager_working_directory(system) == "/"
    assert sdexec.plan.manager_working_directory(default_config()) == str(tmp_path)


def test_resolve_name_with_slash_is_relative_to_cwd(tmp_path):
    make_executable(tmp_path / "prog")
    command = Command(["./prog"], cwd=str(tmp_path))
    assert os.path.samefile(command.find_executable().executable, tmp_path / "prog")
    assert Command([str(tmp_path / "prog")]).find_executable().executable == str(
        tmp_path / "prog"
    )


def looked_up(monkeypatch) -> list[tuple[str, bool]]:
    """Each lookup the search makes: its path, and whether it was made from
    the working directory opened."""
    looked: list[tuple[str, bool]] = []

    def lookup(path: str, cwd_fd: int | None):
        looked.append((path, cwd_fd is not None))
        return sdexec.command._Found.ABSENT

    monkeypatch.setattr("sdexec.command._lookup", lookup)
    return looked


def test_each_path_directory_is_looked_in_once(monkeypatch):
    # ":" * 100000 is one directory (cwd), not a hundred thousand lookups,
    # each joining cwd: that cost minutes of a reactor with a long cwd.
    looked = looked_up(monkeypatch)
    path = ":" * 100_000 + "/a:/b:/a:."
    assert Command(["prog"], env={"PATH": path}).find_executable().executable is None
    assert looked == [("./prog", True), ("/a/prog", True), ("/b/prog", True)]


def test_a_relative_path_entry_is_looked_up_from_the_opened_cwd(monkeypatch):
    # Joined to cwd, each walked all of it again: a cwd of 2000 "/."
    # components and 20,000 relative entries held the reactor 3 s.
    looked = looked_up(monkeypatch)
    cwd = "/." * 2000
    Command(["prog"], env={"PATH": "bin:/usr/bin"}, cwd=cwd).find_executable()
    assert looked == [("bin/prog", True), ("/usr/bin/prog", True)]


def test_a_path_of_too_many_directories_is_e2big_naming_it():
    path = ":".join(f"/d{index}" for index in range(MAX_SEARCH_DIRECTORIES + 1))
    with pytest.raises(RequestRefused) as refused:
        Command(["prog"], env={"PATH": path}).find_executable()
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.E2BIG,
        f"cmd.env.PATH: {MAX_SEARCH_DIRECTORIES + 1} directories; a command name"
        f" is looked for in at most {MAX_SEARCH_DIRECTORIES} (give the command's"
        " path instead)",
    )
    at_most = ":".join(f"/d{index}" for index in range(MAX_SEARCH_DIRECTORIES))
    assert Command(["prog"], env={"PATH": at_most}).find_executable().executable is None


def test_a_file_that_cannot_be_executed_is_found_unexecutable(tmp_path):
    make_executable(tmp_path / "prog", mode=0o644)
    (tmp_path / "dir").mkdir()
    # Said as a shell says it (bash: "/tmp: Is a directory", status 126).
    for name, why in [
        ("prog", "permission denied"),
        ("./prog", "permission denied"),
        ("dir", "is a directory"),
        ("./dir", "is a directory"),
    ]:
        command = Command([name], env={"PATH": str(tmp_path)}, cwd=str(tmp_path))
        assert command.find_executable() == (None, why)
    missing = Command(["absent"], env={"PATH": str(tmp_path)})
    assert missing.find_executable() == (None, None)


class _NoExecFlags(NamedTuple):
    f_flag: int


def test_an_empty_name_is_not_found_not_unexecutable(tmp_path):
    # Joined to each PATH directory, "" named the directory: EACCES, where
    # execvp("") says ENOENT.
    assert Command([""], env={"PATH": str(tmp_path)}).find_executable() == (None, None)


@pytest.mark.parametrize("relative", [False, True])
def test_root_without_dac_override_finds_what_its_root_jobs_may_execute(
    tmp_path, monkeypatch, relative
):
    # The hardened system unit's root has CAP_DAC_READ_SEARCH, not
    # CAP_DAC_OVERRIDE: access(X_OK) refused another user's 0700 script
    # ("permission denied") that the root job would run.
    monkeypatch.setattr(sdexec.command.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sdexec.command.os, "access", lambda *_a, **_k: False)
    make_executable(tmp_path / "script", mode=0o700)
    make_executable(tmp_path / "data", mode=0o600)
    name = "./script" if relative else str(tmp_path / "script")
    found = Command([name], cwd=str(tmp_path)).find_executable()
    assert found == (str(tmp_path / "script"), None)
    assert Command(["./data"], cwd=str(tmp_path)).find_executable() == (
        None,
        "permission denied",
    )
    # ... unless its file system is mounted noexec
    noexec = _NoExecFlags(os.ST_NOEXEC)
    monkeypatch.setattr(sdexec.command.os, "statvfs", lambda _path: noexec)
    assert Command([name], cwd=str(tmp_path)).find_executable() == (
        None,
        "permission denied",
    )


@pytest.mark.parametrize("name", ["link/../prog", "../prog"])
def test_a_path_up_through_a_symlink_is_the_file_the_lookup_found(tmp_path, name):
    # The lookup resolves "link/.." as the kernel does (the link target's
    # parent), but systemd was given the lexical normpath: another file,
    # or none.
    (tmp_path / "cwd").mkdir()
    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "cwd" / "link").symlink_to(tmp_path / "other" / "sub")
    (tmp_path / "linked").symlink_to(tmp_path / "other" / "sub")
    make_executable(tmp_path / "other" / "prog")
    cwd = tmp_path / ("cwd" if name.startswith("link") else "linked")
    found = Command([name], cwd=str(cwd)).find_executable().executable
    assert found == str(tmp_path / "other" / "prog")


def test_a_missing_cwd_finds_only_what_absolute_paths_name(tmp_path):
    make_executable(tmp_path / "prog")
    path = f"bin:{tmp_path}"
    command = Command(["prog"], env={"PATH": path}, cwd=str(tmp_path / "gone"))
    assert command.find_executable().executable == str(tmp_path / "prog")
    gone = Command(["./prog"], cwd=str(tmp_path / "gone"))
    assert gone.find_executable() == (None, None)


def test_a_bare_name_no_file_can_have_is_not_looked_for(monkeypatch):
    looked = looked_up(monkeypatch)
    assert (
        Command(["x" * 256], env={"PATH": "/a:/b"}).find_executable().executable is None
    )
    assert looked == []


@pytest.mark.parametrize("name", ["no-such-program-sdexec", "/nonexistent/prog", "."])
def test_resolve_missing_is_none(name):
    assert (
        Command([name], env={"PATH": "/bin:/usr/bin"}).find_executable().executable
        is None
    )


def test_resolve_skips_directories(tmp_path):
    (tmp_path / "prog").mkdir()
    command = Command(["prog"], env={"PATH": str(tmp_path)})
    assert command.find_executable().executable is None


# -- unit_properties ---------------------------------------------------------------


def properties_of(command: Command, extra=None) -> dict[str, Typed]:
    start = command_line(command, "/bin/prog", extra or {})
    listed = unit_properties(command, start, extra or {})
    names = [prop.name for prop in listed]
    assert len(names) == len(set(names)), f"duplicate properties: {names}"
    return {prop.name: Typed(prop.signature, prop.value) for prop in listed}


def test_unit_properties_types():
    props = properties_of(Command(["prog", "a b"], env={"A": "1"}, cwd="/tmp"))
    assert props == {
        "Description": Typed("s", "prog a b"),
        "ExecStart": Typed("a(sasb)", [["/bin/prog", ["prog", "a b"], False]]),
        "RemainAfterExit": Typed("b", True),
        "Environment": Typed("as", ["A=1"]),
        "WorkingDirectory": Typed("s", "/tmp"),
        "Type": Typed("s", "exec"),
    }


def test_no_cwd_no_working_directory():
    assert "WorkingDirectory" not in properties_of(Command(["prog"]))


def test_type_from_the_request_replaces_exec():
    props = properties_of(Command(["prog"]), {"Type": "simple"})
    assert props["Type"] == Typed("s", "simple")


def test_requested_properties_are_typed():
    props = properties_of(Command(["prog"]), {"MemoryMax": "50%", "SendSIGKILL": "no"})
    assert props["MemoryMaxScale"] == Typed("u", 2**31)
    assert props["SendSIGKILL"] == Typed("b", False)


def test_bad_requested_property_names_it():
    with pytest.raises(PropertyError, match=r"^SDEXEC_PROP_OOMScoreAdjust: "):
        command = Command(["prog"])
        start = command_line(command, "/bin/prog", {})
        unit_properties(command, start, {"OOMScoreAdjust": "high"})


def test_description_is_bounded():
    props = properties_of(Command(["prog", "x" * 500]))
    assert len(props["Description"].value) == 200


@pytest.mark.parametrize(
    ("cmdline", "description"),
    [
        (["sh", "-c", "set -e\n[ -f x ]\r\tok"], "sh -c set -e\\n[ -f x ]\\r\\tok"),
        (["printf", "%s\\n", "\x1b[2J\x7f"], "printf %s\\\\n \\x1b[2J\\x7f"),
        (["echo", "x" * 194 + "\\"], "echo " + "x" * 194),
    ],
)
def test_description_holds_one_line_of_a_unit_file(cmdline, description):
    # systemd writes it unescaped into the transient unit's file: a
    # multi-line script would add settings of its own there (systemd issue
    # #30187), a backslash at the cut would join the next setting to it.
    value = properties_of(Command(cmdline))["Description"].value
    assert value == description
    assert unit_file_problem(value) is None


def test_environment_drops_names_systemd_refuses():
    env = {
        "GOOD_1": "kept",
        "_x": "kept",
        "BASH_FUNC_ml()": "() { :; }",
        "BASH_FUNC_ml%%": "() { :; }",
        "1ABC": "leading digit",
        "A-B": "dash",
        "A.B": "dot",
        "": "empty",
        "ÄB": "not ASCII",
    }
    props = properties_of(Command(["prog"], env=env))
    assert props["Environment"] == Typed("as", ["GOOD_1=kept", "_x=kept"])


ENV_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]*", fullmatch=True)


@given(st.dictionaries(ENV_NAMES, st.text(max_size=20), max_size=10))
def test_environment_keeps_every_valid_name_and_value(env):
    environment = properties_of(Command(["prog"], env=env))["Environment"].value
    assert environment == [f"{name}={value}" for name, value in env.items()]


# -- unit_object_path --------------------------------------------------------------


def systemd_escape(name: str) -> str:
    """systemd's ``bus_label_escape``, restated: ASCII letters kept, digits
    kept except first, every other byte ``_`` + two lowercase hex digits."""
    out = []
    for index, byte in enumerate(name.encode()):
        letter = 0x41 <= byte <= 0x5A or 0x61 <= byte <= 0x7A
        digit = 0x30 <= byte <= 0x39
        out.append(chr(byte) if letter or (digit and index) else f"_{byte:02x}")
    return "/org/freedesktop/systemd1/unit/" + ("".join(out) or "_")


@pytest.mark.parametrize(
    ("name", "escaped"),
    [
        ("a.service", "a_2eservice"),
        ("sdexec-1.service", "sdexec_2d1_2eservice"),
        ("9x", "_39x"),
        ("x9", "x9"),
        ("a_b", "a_5fb"),
        ("a@b\\x2d.service", "a_40b_5cx2d_2eservice"),
        ("é", "_c3_a9"),
        ("", "_"),
    ],
)
def test_unit_object_path_examples(name, escaped):
    assert unit_object_path(name) == "/org/freedesktop/systemd1/unit/" + escaped


@given(st.text(max_size=40))
def test_unit_object_path_matches_systemds_algorithm(name):
    path = unit_object_path(name)
    assert path == systemd_escape(name)
    assert re.fullmatch(r"/org/freedesktop/systemd1/unit/[A-Za-z0-9_]+", path)


def test_a_scheduling_policy_goes_before_its_priority():
    # Before 252 systemd checks a priority against the policy it has so far:
    # in the file's order, every job was refused (review session 31 D F1).
    site = {"CPUSchedulingPriority": "50", "CPUSchedulingPolicy": "fifo"}
    config = parse_config({"exec": {"sdexec-properties": site}})
    names = [prop.name for prop in exec_plan(config=config).properties]
    assert names.index("CPUSchedulingPolicy") < names.index("CPUSchedulingPriority")


def request_refused(site: dict, allowed: list[str], **opts: str):
    """The refusal of a request of ``opts`` where the site sets ``site`` and
    lets requests set ``allowed`` (by the property policy, or the plan)."""
    table = {
        "exec": {"sdexec-properties": site},
        "sdexec": {"request-properties": allowed},
    }
    with pytest.raises(RequestRefused) as refused:
        exec_plan(config=parse_config(table), **opts)
    return refused.value


def test_a_request_soft_limit_above_the_site_s_hard_one_is_einval():
    refused = request_refused(
        {"LimitNOFILE": "1000"},
        ["LimitNOFILESoft"],
        SDEXEC_PROP_LimitNOFILESoft="2000",
    )
    assert (refused.errnum, refused.errstr) == (
        errno.EINVAL,
        "SDEXEC_PROP_LimitNOFILESoft: LimitNOFILESoft=2000 above LimitNOFILE=1000,"
        " which setrlimit refuses at every start (LimitNOFILE from"
        " [exec.sdexec-properties])",
    )


def test_a_request_hard_limit_below_the_site_s_soft_one_is_named():
    # The request's lower LimitNOFILE is at fault, not the site's soft one.
    refused = request_refused(
        {"LimitNOFILE": "4096", "LimitNOFILESoft": "2048"},
        ["LimitNOFILE"],
        SDEXEC_PROP_LimitNOFILE="1024",
    )
    assert refused.errstr == (
        "SDEXEC_PROP_LimitNOFILE: LimitNOFILESoft=2048 above LimitNOFILE=1024,"
        " which setrlimit refuses at every start (LimitNOFILESoft from"
        " [exec.sdexec-properties])"
    )


def test_a_request_soft_limit_alone_is_not_told_to_give_the_hard_one():
    # "give LimitMEMLOCK too" led to a second refusal: a request's hard
    # limit needs the site's to compare with (review 37 V).
    refused = request_refused(
        {},
        ["LimitMEMLOCKSoft", "LimitMEMLOCK"],
        SDEXEC_PROP_LimitMEMLOCKSoft="infinity",
    )
    assert refused.errstr == (
        "SDEXEC_PROP_LimitMEMLOCKSoft: over D-Bus a soft limit alone sets the"
        " hard limit to the same value, and a request may set LimitMEMLOCK only"
        " within the site's, which exec.sdexec-properties does not set"
    )


def test_a_request_s_bad_policy_is_named_not_the_site_s_priority():
    refused = request_refused(
        {"CPUSchedulingPolicy": "fifo", "CPUSchedulingPriority": "50"},
        ["CPUSchedulingPolicy"],
        SDEXEC_PROP_CPUSchedulingPolicy="fifoo",
    )
    assert refused.errstr.startswith("SDEXEC_PROP_CPUSchedulingPolicy: 'fifoo'")


_GATED = {
    "exec": {"sdexec-properties": {"ConditionPathExists": "/run/node-ok"}},
    "sdexec": {
        "request-properties": ["ConditionPathExists", "ConditionPathIsDirectory"]
    },
}


@pytest.mark.parametrize(
    ("opts", "said"),
    [
        ({"SDEXEC_PROP_ConditionPathExists": "/"},
         "SDEXEC_PROP_ConditionPathExists: the site sets ConditionPathExists; a"
         " request may add conditions, never replace the site's"),
        ({"SDEXEC_PROP_ConditionPathIsDirectory": "|/"},
         "SDEXEC_PROP_ConditionPathIsDirectory: a triggering condition (a leading"
         " |) would let the site's triggering conditions pass"),
    ],
    ids=["replacing", "triggering"],
)  # fmt: skip
def test_a_request_never_loosens_the_site_s_gate(opts, said):
    # Where an admin lets requests set conditions: one of the same name
    # replaced the site's health gate, and a triggering one opened its
    # triggering ones (review session 32 Y2).
    with pytest.raises(sdexec.plan.RequestError) as refused:
        exec_plan(config=parse_config(_GATED), **opts)
    assert (refused.value.errnum, refused.value.errstr) == (errno.EPERM, said)


def refused_over_site(site: dict, name: str, requested: str) -> str:
    """The EPERM message for a request's ``name=requested`` where the site
    sets ``site`` and lets requests set ``name``."""
    table = {
        "exec": {"sdexec-properties": site},
        "sdexec": {"request-properties": ["@default", name]},
    }
    with pytest.raises(sdexec.plan.RequestError) as refused:
        exec_plan(config=parse_config(table), **{f"SDEXEC_PROP_{name}": requested})
    assert refused.value.errnum == errno.EPERM
    return refused.value.errstr


@pytest.mark.parametrize(
    ("name", "site", "requested"),
    [
        ("SystemCallFilter", "~@mount", "~@debug"),
        ("CapabilityBoundingSet", "~13", "~14"),
        ("InaccessiblePaths", "/scratch", "/home"),
        ("IPAddressDeny", "any", "10.0.0.0/8"),
        ("IOReadBandwidthMax", "/dev/sda 10M", "/dev/sdb 10M"),
        ("After", "nvidia-persistenced.service", "local-fs.target"),
    ],
)
def test_a_request_never_replaces_a_list_the_site_sets(name, site, requested):
    # Merged by name, an allowed request's "~@debug" replaced the site's
    # "~@mount @privileged" (review 36 T2-1), its IPAddressDeny a site's
    # "any", its InaccessiblePaths the site's: systemd adds such lists up.
    assert refused_over_site({name: site}, name, requested) == (
        f"SDEXEC_PROP_{name}: the site sets {name}; a request may not replace it"
        " (systemd adds such lists up; sdexec sets one)"
    )


def test_a_request_may_add_a_condition_of_its_own():
    plan = exec_plan(
        config=parse_config(_GATED), SDEXEC_PROP_ConditionPathIsDirectory="/scratch"
    )
    gates = [prop.value[0] for prop in plan.properties if prop.name == "Conditions"]
    assert gates == [
        ["ConditionPathExists", False, False, "/run/node-ok"],
        ["ConditionPathIsDirectory", False, False, "/scratch"],
    ]


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("ConditionPathExists", "", "no parameter"),
        ("ConditionPathExists", "|", "no parameter"),
        ("AssertPathExists", "!", "no parameter"),
        ("ConditionPathExists", "|!", "no parameter"),
        ("ConditionPathExists", "run/ok", "'run/ok' is not an absolute path"),
        ("AssertFileNotEmpty", "!x", "'x' is not an absolute path"),
    ],
)
def test_a_gate_systemd_refuses_for_every_job_is_refused_at_load(name, value, why):
    # systemd refused it for every job (review session 32 Y3).
    table = {"exec": {"sdexec-properties": {name: value}}}
    with pytest.raises(ValueError, match=rf"{name}: .*{why}"):
        parse_config(table)


def test_a_gate_of_another_kind_takes_what_is_not_a_path():
    table = {"exec": {"sdexec-properties": {"ConditionVirtualization": "!container"}}}
    plan = exec_plan(config=parse_config(table))  # systemd judges its values
    gates = [prop.value for prop in plan.properties if prop.name == "Conditions"]
    assert gates == [[["ConditionVirtualization", False, True, "container"]]]


@pytest.mark.parametrize(
    ("site", "name", "requested"),
    [
        ({"IPAddressDeny": "any"}, "IPAddressAllow", "any"),
        ({"NoExecPaths": "/scratch"}, "ExecPaths", "/scratch"),
        ({"ReadOnlyPaths": "/"}, "ReadWritePaths", "/usr"),
        ({"ProtectSystem": "strict"}, "ReadWritePaths", "/usr"),
        ({"InaccessiblePaths": "/secret"}, "BindReadOnlyPaths", "/secret:/tmp/x"),
        ({"InaccessiblePaths": "/secret"}, "ReadOnlyPaths", "/secret"),
        # (review 44 cfg) The host's /tmp, or a device node, behind the
        # private one the site gives every unit.
        ({"PrivateTmp": "yes"}, "BindPaths", "/tmp"),
        ({"PrivateTmpEx": "disconnected"}, "BindReadOnlyPaths", "/var/tmp"),
        ({"PrivateDevices": "yes"}, "BindReadOnlyPaths", "/dev/fuse"),
        # A namespace joined: systemd then makes no private one (the job
        # ran on the host's network under PrivateNetwork=yes).
        ({"PrivateNetwork": "yes"}, "NetworkNamespacePath", "/proc/1/ns/net"),
        ({"PrivateIPC": "yes"}, "IPCNamespacePath", "/proc/1/ns/ipc"),
        ({"PrivateUsers": "yes"}, "UserNamespacePath", "/proc/1/ns/user"),
        # A directory systemd makes writable for the unit, an existing one
        # too: ~/.config/app was writable under ProtectHome=read-only.
        ({"ProtectHome": "read-only"}, "ConfigurationDirectory", "app"),
        ({"ProtectSystem": "strict"}, "StateDirectory", "dpkg"),
        ({"ReadOnlyPaths": "/var"}, "LogsDirectory", "app"),
    ],
)
def test_a_request_never_opens_what_the_site_restricts(site, name, requested):
    # (review 37 R5) Another name, so the merge kept both: systemd allows an
    # address in IPAddressAllow whatever IPAddressDeny says, makes a path in
    # ReadWritePaths writable under ReadOnlyPaths…
    (restricting,) = site
    assert refused_over_site(site, name, requested) == (
        f"SDEXEC_PROP_{name}: the site sets {restricting}, which {name} would"
        " open; a request may not set it"
    )


def test_a_request_may_open_what_the_site_leaves_open():
    table = {
        "exec": {"sdexec-properties": {"IPAddressDeny": "any"}},
        "sdexec": {"request-properties": ["@default", "ReadWritePaths"]},
    }
    plan = exec_plan(config=parse_config(table), SDEXEC_PROP_ReadWritePaths="/scratch")
    assert ("ReadWritePaths", ["/scratch"]) in [
        (prop.name, prop.value) for prop in plan.properties
    ]


@pytest.mark.parametrize(
    ("site", "name", "requested"),
    [
        ({"PrivateTmp": "yes"}, "PrivateTmpEx", "no"),
        ({"PrivateUsersEx": "self"}, "PrivateUsers", "no"),
    ],
)
def test_a_request_never_sets_the_twin_of_what_the_site_sets(site, name, requested):
    # PrivateTmpEx=no sent after the site's PrivateTmp=yes undid it.
    (twin,) = site
    assert refused_over_site(site, name, requested) == (
        f"SDEXEC_PROP_{name}: the site sets {twin}, the same setting (the one"
        " systemd reads last wins); a request may not set it"
    )


@pytest.mark.parametrize(
    ("name", "site", "looser", "narrower"),
    [
        ("RestrictNamespaces", "~user", "no", "net mnt"),
        ("RestrictNamespaces", "net", "net mnt", "yes"),
        (
            "SecureBits",
            "noroot noroot-locked",
            "noroot",
            "noroot noroot-locked keep-caps",
        ),
    ],
)
def test_a_request_only_narrows_a_mask_the_site_sets(name, site, looser, narrower):
    # RestrictNamespaces=no replaced the site's ~user: every namespace.
    assert refused_over_site({name: site}, name, looser) == (
        f"SDEXEC_PROP_{name}: {looser!r} allows what the site's {name}={site} does"
        " not; a request may only narrow it"
    )
    table = {
        "exec": {"sdexec-properties": {name: site}},
        "sdexec": {"request-properties": ["@default", name]},
    }
    plan = exec_plan(config=parse_config(table), **{f"SDEXEC_PROP_{name}": narrower})
    assert name in [prop.name for prop in plan.properties]


def test_a_request_s_braces_are_quoted_in_a_refusal_not_read():
    # The refusal's text carries the request's value: read as a format, a
    # brace in it would have been an internal error.
    table = {
        "exec": {"sdexec-properties": {"RestrictNamespaces": "net"}},
        "sdexec": {"request-properties": ["@default", "RestrictNamespaces"]},
    }
    with pytest.raises(sdexec.plan.RequestError) as refused:
        exec_plan(config=parse_config(table), SDEXEC_PROP_RestrictNamespaces="{x}")
    assert refused.value.errnum == errno.EINVAL
    assert "'{x}' is no namespace" in refused.value.errstr


@pytest.mark.parametrize(
    ("name", "site", "requested"),
    [
        ("PrivateTmpEx", "disconnected", "no"),
        ("PrivateUsersEx", "self", "identity"),
        ("ProtectControlGroupsEx", "strict", "private"),
        ("ProtectProc", "invisible", "default"),
    ],
)
def test_a_request_keeps_an_unordered_hardening_the_site_sets(site, name, requested):
    # (review 37 V1) PrivateTmpEx=no replaced the site's disconnected, as
    # NoNewPrivileges=no had the site's yes before it was ordered.
    assert refused_over_site({name: site}, name, requested) == (
        f"SDEXEC_PROP_{name}: the site sets {name}={site}; a request may not"
        " change it (sdexec cannot tell which of its values is tighter)"
    )
    table = {
        "exec": {"sdexec-properties": {name: site}},
        "sdexec": {"request-properties": ["@default", name]},
    }
    exec_plan(config=parse_config(table), **{f"SDEXEC_PROP_{name}": site})


@pytest.mark.parametrize(
    ("cmdline", "described"),
    [
        # An escape that does not fit is left out whole: "\x" was left of
        # "\x1b", and every trailing backslash stripped, "\\" pairs too (a
        # command line of backslashes was described as nothing).
        (["a" * 198 + "\x1b"], "a" * 198),
        (["\\" * 300], "\\\\" * 100),
        (["a" * 199 + "\\x"], "a" * 199),
        (["a" * 197 + "\n" + "b"], "a" * 197 + "\\n" + "b"),
    ],
    ids=["escape", "backslashes", "backslash", "fits"],
)
def test_a_description_is_cut_between_escapes(cmdline, described):
    # Review session 47.
    assert describe(cmdline) == described
    assert len(described) <= DESCRIPTION_LENGTH
