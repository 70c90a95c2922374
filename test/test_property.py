"""Unit properties from strings to typed D-Bus values (no systemd needed)."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import given
from hypothesis import strategies as st

import sdexec.property
from sdexec import propertyvalues
from sdexec.idset import IDset
from sdexec.property import (
    BOOLEAN_PROPERTIES,
    INTEGER_PROPERTIES,
    MEMORY_PROPERTIES,
    MODE_PROPERTIES,
    UINT32_MAX,
    UINT64_MAX,
    UINT64_PROPERTIES,
    PropertyError,
    UnitProperty,
    parse_bool,
    split_rlimit_pairs,
    typed_property,
    unknown_property_reason,
)
from sdexec.propertyvalues import _split
from sdexec.refusal import SHOWN, quoted
from sdexec.sizes import scale_from_permyriad
from sdexec.unitfile import LONG_LINE_MAX, MAX_UNIT_LINE, unit_file_problem

#: What ends a line of a unit's file.
LINE_BREAKS = "\n\r"

# systemd's parse_boolean(), as systemd-run reads every boolean.
TRUE_SPELLINGS = ["1", "yes", "y", "t", "true", "on", "YES", "True", "oN", " yes "]
FALSE_SPELLINGS = ["0", "no", "n", "f", "false", "off", "NO", "False", "OFF"]


def refused(name: str, value: str) -> str:
    """The message of the PropertyError for ``name=value``."""
    with pytest.raises(PropertyError) as error:
        typed_property(name, value)
    return str(error.value)


@pytest.mark.parametrize("text", TRUE_SPELLINGS)
def test_parse_bool_true(text):
    assert parse_bool(text) is True


@pytest.mark.parametrize("text", FALSE_SPELLINGS)
def test_parse_bool_false(text):
    assert parse_bool(text) is False


@pytest.mark.parametrize("text", ["maybe", "", "2", "ye", "nah", "yess"])
def test_parse_bool_refuses(text):
    with pytest.raises(ValueError, match="not a boolean"):
        parse_bool(text)


@pytest.mark.parametrize("name", sorted(BOOLEAN_PROPERTIES))
def test_boolean_properties_are_b(name):
    assert typed_property(name, "on") == UnitProperty(name, "b", True)
    assert typed_property(name, "0") == UnitProperty(name, "b", False)


def test_every_boolean_systemd_run_sends_is_typed():
    # Sent as strings, each failed every job ("Unexpected message
    # contents"): the hardening a site sets, ProtectClock, LockPersonality…
    hardening = {"ProtectClock", "LockPersonality", "RestrictSUIDSGID",
                 "ProtectKernelModules", "PrivateMounts"}  # fmt: skip
    assert hardening <= BOOLEAN_PROPERTIES


@pytest.mark.parametrize("name", sorted(MODE_PROPERTIES))
def test_file_modes_are_u(name):
    assert typed_property(name, "0077") == UnitProperty(name, "u", 0o77)
    assert typed_property(name, "755") == UnitProperty(name, "u", 0o755)


@pytest.mark.parametrize(
    "text", ["0999", "8", "", "-1", "010000", "0x1f", " 077", "\u0667"]
)
def test_a_file_mode_that_is_not_one_is_refused_naming_it(text):
    assert refused("UMask", text).startswith(
        f"SDEXEC_PROP_UMask: error setting property: {text!r}"
    )


def test_the_booleans_of_systemd_run_s_service_tables_are_typed_too():
    # (review 36 T1: these went as strings, and failed every job)
    service_and_newer = {
        "GuessMainPID",
        "PermissionsStartOnly",
        "SurviveFinalKillSignal",
        "MemoryZSwapWriteback",
        "StateDirectoryAccounting",
    }
    assert service_and_newer <= BOOLEAN_PROPERTIES


def test_a_boolean_with_a_string_twin_names_it_for_its_other_values():
    said = refused("PrivateUsers", "self")
    assert said.endswith("; its other values go in PrivateUsersEx (systemd 257+)")


@pytest.mark.parametrize(
    ("name", "text", "typed"),
    [
        ("NUMAPolicy", "interleave", ("i", 3)),
        ("NUMAPolicy", "local", ("i", 4)),
        ("NUMAMask", "0-1", ("ay", b"\x03")),
        ("CPUAffinity", "0,2", ("ay", b"\x05")),
        ("SupplementaryGroups", "video render", ("as", ["video", "render"])),
        ("LogLevelMax", "warning", ("i", 4)),
        (
            "SystemCallFilter",
            "~@mount @clock",
            ("(bas)", (False, ["@mount", "@clock"])),
        ),
        ("RestrictAddressFamilies", "AF_UNIX", ("(bas)", (True, ["AF_UNIX"]))),
        (
            "CapabilityBoundingSet",
            "CAP_NET_RAW cap_sys_admin",
            ("t", 1 << 13 | 1 << 21),
        ),
        ("AmbientCapabilities", "~CAP_NET_RAW", ("t", UINT64_MAX ^ 1 << 13)),
        # (review 36 T2-5: what systemd-run takes too)
        ("CapabilityBoundingSet", "", ("t", 0)),
        ("CapabilityBoundingSet", "13 21", ("t", 1 << 13 | 1 << 21)),
        ("CPUAffinity", "0 2 4", ("ay", b"\x15")),
        ("SyslogLevel", "7", ("i", 7)),
    ],
)
def test_numa_affinity_groups_and_log_levels_are_typed(name, text, typed):
    # Sent as strings, each failed every job (review 36 T's table).
    assert typed_property(name, text) == UnitProperty(name, *typed)


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("NUMAPolicy", "spread", "is none of default, preferred, bind"),
        ("LogLevelMax", "9", "is out of range: systemd takes emerg, alert"),
        ("SupplementaryGroups", " ", "nothing named"),
        ("SystemCallFilter", "~", "nothing named"),
        ("CapabilityBoundingSet", "CAP_FLY", "'CAP_FLY' is no capability"),
        # The manager refused the unit in words naming nothing (T2-4).
        ("RestrictAddressFamilies", "none", "'none' is no address family"),
        ("RestrictAddressFamilies", "~AF_INET inet6", "'inet6' is no address"),
        ("NUMAMask", "x", "invalid idset 'x'"),
    ],
)
def test_a_bad_numa_affinity_group_or_log_level_is_refused_naming_it(name, text, said):
    assert said in refused(name, text)
    assert refused(name, text).startswith(f"SDEXEC_PROP_{name}: ")


@pytest.mark.parametrize(
    ("name", "text", "typed"),
    [
        ("SupplementaryGroups", "'video' \"render\"", ["video", "render"]),
        ("SystemCallArchitectures", "'native' x86-64", ["native", "x86-64"]),
        ("Documentation", "'man:sdexec(1)'", ["man:sdexec(1)"]),
        ("Markers", '"needs-restart"', ["needs-restart"]),
        ("DisableControllers", "'io'", ["io"]),
        ("Wants", "'a.service' b.service", ["a.service", "b.service"]),
    ],
)
def test_a_word_list_is_unquoted_as_systemd_run_unquotes_it(name, text, typed):
    # Split on spaces alone, each quoted word went to the manager with its
    # quotes, which it refused (a group, an architecture or a URL named so).
    assert typed_property(name, text).value == typed


def test_quoted_filters_and_capabilities_are_unquoted():
    assert typed_property("SystemCallFilter", "~'@mount'").value == (False, ["@mount"])
    assert typed_property("CapabilityBoundingSet", "'CAP_NET_RAW'").value == 1 << 13


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("SupplementaryGroups", "'video", "No closing quotation"),
        ("CapabilityBoundingSet", '"CAP_NET_RAW', "No closing quotation"),
    ],
)
def test_an_unclosed_quote_in_a_word_list_is_refused(name, text, said):
    assert said in refused(name, text)


@pytest.mark.parametrize(
    ("name", "text", "typed"),
    [
        ("After", "mnt-scratch\\x2d1.mount", ["mnt-scratch\\x2d1.mount"]),
        ("After", "'mnt-scratch\\x2d1.mount' a", ["mnt-scratch\\x2d1.mount", "a"]),
        ("SupplementaryGroups", "EXAMPLE\\hpc", ["EXAMPLE\\hpc"]),
    ],
)
def test_a_backslash_in_a_word_list_is_kept(name, text, typed):
    # An escaped unit name, as the manager names it: refused outright by
    # the quoting that came first (review 38 R-1), and loaded before it.
    assert typed_property(name, text).value == typed


def test_bad_boolean_names_the_property():
    assert refused("SendSIGKILL", "maybe").startswith(
        "SDEXEC_PROP_SendSIGKILL: error setting property: 'maybe'"
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("1K", 1024), ("512M", 512 * 2**20), ("1.5G", 3 * 2**29),
     ("2T", 2 * 2**40), ("infinity", UINT64_MAX)],
)  # fmt: skip
@pytest.mark.parametrize("name", sorted(MEMORY_PROPERTIES))
def test_memory_sizes_are_t(name, text, size):
    assert typed_property(name, text) == UnitProperty(name, "t", size)


@pytest.mark.parametrize("name", sorted(MEMORY_PROPERTIES))
def test_memory_percent_becomes_scale(name):
    assert typed_property(name, "50%") == UnitProperty(f"{name}Scale", "u", 2**31)
    assert typed_property(name, "100%") == UnitProperty(f"{name}Scale", "u", UINT32_MAX)
    if name not in {"MemoryMax", "MemoryHigh"}:  # from 1 byte
        assert typed_property(name, "0%") == UnitProperty(f"{name}Scale", "u", 0)


@pytest.mark.parametrize(
    "text", ["101%", "-1%", "12Q", "1.5.5G", "", "1KB", "16E", "inf"]
)
def test_bad_memory_value_names_the_property(text):
    assert refused("MemoryHigh", text).startswith(
        "SDEXEC_PROP_MemoryHigh: error setting property:"
    )


@pytest.mark.parametrize("name", ["AllowedCPUs", "AllowedMemoryNodes"])
@pytest.mark.parametrize(
    ("text", "mask"),
    [("", b""), ("[]", b""), ("0", b"\x01"), ("0-2,9", b"\x07\x02"),
     ("8", b"\x00\x01"), ("0,57-99,127", IDset("0,57-99,127").bitmask())],
)  # fmt: skip
def test_idsets_are_ay_bitmasks(name, text, mask):
    assert typed_property(name, text) == UnitProperty(name, "ay", mask)


@given(st.frozensets(st.integers(min_value=0, max_value=1023), max_size=64))
def test_bitmask_round_trips_any_idset(ids):
    typed = typed_property("AllowedCPUs", IDset(ids).encode())
    assert IDset.from_bitmask(typed.value) == IDset(ids)


@pytest.mark.parametrize("name", ["AllowedCPUs", "AllowedMemoryNodes"])
@pytest.mark.parametrize("text", ["8192", "0-8192", "0-4294967293"])
def test_ids_systemd_cannot_mask_are_refused_naming_the_property(name, text):
    # systemd's CPU_SET_MAX_NCPU: it answers ERANGE for these; the mask for
    # the last would also take 512 MiB to build.
    assert refused(name, text) == (
        f"SDEXEC_PROP_{name}: error setting property: {IDset(text).last()} is"
        " beyond systemd's limit: ids must be below 8192"
    )


def test_the_largest_id_systemd_masks_is_accepted():
    assert typed_property("AllowedCPUs", "8191").value == bytes(1023) + b"\x80"


@pytest.mark.parametrize("text", ["a", "3-1", "1 - 2", "-1"])
def test_bad_idset_names_the_property(text):
    assert refused("AllowedCPUs", text).startswith("SDEXEC_PROP_AllowedCPUs:")


@pytest.mark.parametrize("text", ["0 2", "0, 2", "0,,2", " 0\t2 ,"])
def test_a_cpu_list_is_separated_as_systemd_separates_it(text):
    # Commas, white space or runs of both (systemd's parse_cpu_set, and
    # systemd-run -p AllowedCPUs="0,,2" takes it).
    assert typed_property("AllowedCPUs", text).value == IDset("0,2").bitmask()


@pytest.mark.parametrize(
    ("text", "entries"),
    [
        ("/dev/null rw", [["/dev/null", "rw"]]),
        ("/dev/null rw,/dev/zero r", [["/dev/null", "rw"], ["/dev/zero", "r"]]),
        (
            " /dev/nvidia0 rwm , char-pts  w",
            [["/dev/nvidia0", "rwm"], ["char-pts", "w"]],
        ),
    ],
)
def test_device_allow_is_a_ss(text, entries):
    assert typed_property("DeviceAllow", text) == UnitProperty(
        "DeviceAllow", "a(ss)", entries
    )


@pytest.mark.parametrize(
    "text", ["/dev/null", "/dev/null rx", "/dev/null rw,", "", " rw", "/dev/null r w"]
)
def test_bad_device_allow_names_the_property_and_entry(text):
    message = refused("DeviceAllow", text)
    assert message.startswith("SDEXEC_PROP_DeviceAllow: error setting property:")
    assert "is not 'PATH PERMS'" in message


@pytest.mark.parametrize("name", sorted(UINT64_PROPERTIES))
def test_uint64_properties_are_t(name):
    # (the managed OOM's duration takes a second at least, a CPU quota 1%)
    value = {"ManagedOOMMemoryPressureDurationUSec": 1_000_000}.get(name, 5000)
    value = {"CPUQuotaPerSecUSec": 10_000}.get(name, value)
    assert typed_property(name, str(value)) == UnitProperty(name, "t", value)
    assert typed_property(name, "infinity") == UnitProperty(name, "t", UINT64_MAX)


@pytest.mark.parametrize(
    "text", ["-1", "+5", "1_000", "٣", "1.5", "5s", "", str(UINT64_MAX), "Infinity"]
)
def test_bad_uint64_names_the_property(text):
    assert refused("TimeoutStopUSec", text).startswith(
        "SDEXEC_PROP_TimeoutStopUSec: error setting property:"
    )


@pytest.mark.parametrize(
    ("name", "digits"),
    [("TimeoutStopUSec", "9" * 41), ("TimeoutStopUSec", "9" * 5000),
     ("OOMScoreAdjust", "9" * 5000), ("OOMScoreAdjust", "-" + "9" * 5000)],
    ids=["uint64-41", "uint64-5000", "int32-5000", "int32-negative-5000"],
)  # fmt: skip
def test_an_integer_of_thousands_of_digits_is_out_of_range(name, digits):
    # Not int()'s complaint, which speaks of Python's settings.
    assert refused(name, digits) == (
        f"SDEXEC_PROP_{name}: error setting property: {quoted(digits, SHOWN)} is"
        " out of range"
    )


def test_leading_zeros_are_no_digits_too_many():
    assert typed_property("TasksMax", "0" * 100 + "7").value == 7


@given(st.data())
def test_integer_properties_are_i_within_systemd_s_range(data):
    name = data.draw(st.sampled_from(sorted(INTEGER_PROPERTIES)))
    names, numbers = INTEGER_PROPERTIES[name]
    value = data.draw(st.sampled_from([*numbers, *names.values()]))
    assert typed_property(name, str(value)) == UnitProperty(name, "i", value)


@pytest.mark.parametrize(
    ("name", "text", "typed"),
    [
        ("CPUSchedulingPolicy", "batch", ("i", 3)),
        ("IOSchedulingClass", "best-effort", ("i", 2)),
        ("LimitMEMLOCK", "infinity", ("t", 2**64 - 1)),
        ("LimitMEMLOCK", "64K", ("t", 65536)),
        ("LimitNOFILE", "1024", ("t", 1024)),
        ("LimitNOFILESoft", "512", ("t", 512)),
        ("LimitCORE", "0", ("t", 0)),
        ("ReadOnlyPaths", "/a '/b c' -/d", ("as", ["/a", "/b c", "-/d"])),
    ],
)
def test_properties_systemd_types_are_sent_with_their_type(name, text, typed):
    # As strings, systemd refused each for every job: "Failed to set unit
    # properties: Unexpected message contents", naming none.
    assert typed_property(name, text) == UnitProperty(name, *typed)


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("OOMScoreAdjust", "1001", "'1001' is out of range: systemd takes -1000 to"),
        ("Nice", "20", "'20' is out of range: systemd takes -20 to 19"),
        ("CPUSchedulingPolicy", "4", "'4' is out of range: systemd takes other,"),
        ("IOSchedulingPriority", "8", "'8' is out of range: systemd takes 0 to 7"),
        ("OOMScoreAdjust", "1_0", "'1_0' is not a decimal integer"),
        ("Nice", "x", "'x' is not a decimal integer"),
        ("Nice", "", "'' is not a decimal integer"),
        ("LimitNOFILE", "1024:4096:8192", "'1024:4096:8192': one value, or in"),
        ("LimitNOFILE", "64K", "'64K' is not a decimal integer"),
        ("LimitMEMLOCK", "lots", "'lots' is not a size"),
        ("ReadOnlyPaths", "'/a", "No closing quotation"),
        ("ReadOnlyPaths", " ", "no path given"),
        ("ReadOnlyPaths", "/a relative", "'relative' is not an absolute path"),
        ("LimitCPU", "1h", "seconds, a number (a unit file's 1h is 3600 here)"),
        ("ReadOnlyPaths", "+-/a", "'+-/a' is not an absolute path"),
        ("CPUSchedulingPolicy", "fifoo", "is none of other, fifo, rr, batch, idle"),
    ],
)
def test_a_value_systemd_would_refuse_names_the_property(name, text, said):
    # systemd refused a string-typed one with "Unexpected message contents"
    # for every job, or a Nice of 20 with "Invalid Nice value" (review
    # session 31 B F1).
    assert said in refused(name, text)
    assert refused(name, text).startswith(
        f"SDEXEC_PROP_{name}: error setting property:"
    )


#: Text a unit's file holds as one setting: no line break, no backslash at
#: the end, no space at either (its parser strips them).
ONE_LINE = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters=LINE_BREAKS),
    max_size=40,
).filter(lambda text: not text.endswith("\\") and text == text.strip(" \t"))


@given(ONE_LINE)
def test_other_properties_go_as_strings_unchecked(value):
    assert typed_property("DevicePolicy", value) == UnitProperty(
        "DevicePolicy", "s", value
    )


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("job\n[Service]\nDelegate=yes", "line break '\\n' at 3:"),
        ("a\rb", "line break '\\r' at 1:"),
        ("C:\\\\\\", "ends with a backslash:"),
        ("C:\\", "ends with a backslash:"),
    ],
)
def test_a_value_a_unit_file_cannot_hold_is_refused_naming_why(value, why):
    # systemd writes it unescaped into the transient unit's file (issue
    # #30187): a line break there would be a setting of the request's own.
    assert refused("Description", value).startswith(
        f"SDEXEC_PROP_Description: error setting property: {why}"
    )
    # One line all the same: a tab, an escape, a backslash escaped.
    for kept in ("tab\there", "\x1b[32mok\x1b[0m", "/data/x\\\\"):
        assert unit_file_problem(kept) is None


def test_a_value_too_long_for_a_line_of_the_unit_file_is_refused():
    # Counted as systemd writes its most escaped settings: a control
    # character as four bytes (\\001), each word in quotes. A line of
    # LONG_LINE_MAX bytes the unit's file cannot be read back with.
    assert refused("Description", "\x01" * 300_000) == (
        "SDEXEC_PROP_Description: error setting property: up to 1200002 bytes as"
        " systemd writes it into the unit's file, more than the"
        f" {MAX_UNIT_LINE} sdexec allows: systemd reads back no line of"
        f" {LONG_LINE_MAX} bytes or more (LONG_LINE_MAX), and the unit would lose"
        " every property at the next daemon-reload"
    )
    assert refused("Description", "x " * (MAX_UNIT_LINE // 4)).startswith(
        f"SDEXEC_PROP_Description: error setting property: up to {MAX_UNIT_LINE + 2}"
    )
    for kept in ("x" * 300_000, "x" * (MAX_UNIT_LINE - 2)):
        assert typed_property("Description", kept).value == kept


@pytest.mark.parametrize(
    ("name", "value", "listed", "entry"),
    [
        ("ConditionPathExists", "/run/ok", "Conditions", [False, False, "/run/ok"]),
        ("ConditionPathExists", "|!/run/ok", "Conditions", [True, True, "/run/ok"]),
        ("AssertPathExists", "!/run/ok", "Asserts", [False, True, "/run/ok"]),
    ],
)
def test_conditions_and_assertions_go_as_the_units_lists(name, value, listed, entry):
    # Sent as strings under their own names, systemd refused them: "Cannot
    # set property ConditionPathExists, or unknown property" (review
    # session 32 V1); now as systemd-run -p sends them.
    typed = typed_property(name, value)
    assert (typed.name, typed.signature, typed.value) == (
        listed,
        "a(sbbs)",
        [[name, *entry]],
    )


@pytest.mark.parametrize("listed", ["Conditions", "Asserts"])
def test_a_request_s_whole_list_of_conditions_is_refused_here(listed):
    # Typed as one condition of type "s", systemd refused every such unit;
    # the entries go one by one (ConditionPathExists), review session 34 N5.
    with pytest.raises(PropertyError, match=f"SDEXEC_PROP_{listed}: .*give each"):
        typed_property(listed, "/run/ok")


def test_dependencies_go_as_lists_of_units():
    # Sent as strings, systemd refused every job: "Unexpected message
    # contents".
    typed = typed_property("After", "a.service  b.target")
    assert (typed.signature, typed.value) == ("as", ["a.service", "b.target"])
    with pytest.raises(
        PropertyError, match="Requires: error setting property: no unit"
    ):
        typed_property("Requires", " ", source="config")


def test_a_long_unknown_name_is_answered_at_once(monkeypatch):
    # The did-you-mean compared all of it with every known name: 20 KB took
    # half a minute, and a request's SDEXEC_PROP_ name may be megabytes, on
    # the reactor every client shares (review session 35 M1 made requests
    # ask it). Names far longer than any known are not compared at all.
    compared = []
    edits = sdexec.property._edits
    monkeypatch.setattr(
        sdexec.property, "_edits", lambda a, b: compared.append(b) or edits(a, b)
    )
    reason = unknown_property_reason("M" * 20_000)
    assert reason == "unknown property: systemd would refuse every unit with it"
    assert compared == []


@pytest.mark.parametrize(
    ("name", "text", "typed"),
    [
        ("TimerSlackNSec", "50000", ("t", 50000)),
        ("CPUQuotaPeriodUSec", "infinity", ("t", UINT64_MAX)),
        ("StartLimitBurst", "10", ("u", 10)),
        ("TTYRows", "24", ("u", 24)),
        ("ManagedOOMMemoryPressureLimit", "50%", ("u", scale_from_permyriad(5000))),
        ("WatchdogSignal", "SIGABRT", ("i", 6)),
        ("SyslogFacility", "local3", ("i", 19)),
        ("SyslogFacility", "3", ("i", 3)),
        ("SecureBits", "noroot keep-caps", ("i", 1 | 16)),
        ("SystemCallErrorNumber", "EPERM", ("i", 1)),
        ("SystemCallErrorNumber", "kill", ("i", 2**31 - 2)),
        ("FailureActionExitStatus", "", ("i", -1)),
        ("SuccessActionExitStatus", "7", ("i", 7)),
        ("CoredumpFilter", "private-anonymous shared-anonymous", ("t", 3)),
        ("CoredumpFilter", "default elf-headers", ("t", 0x33)),
        ("CoredumpFilter", "0x7f", ("t", 0x7F)),
        ("CoredumpFilter", "all", ("t", UINT32_MAX)),  # the kernel's 32 bits
        ("MountFlags", "slave", ("t", 1 << 19)),
        ("RestrictNamespaces", "yes", ("t", 0)),
        ("RestrictNamespaces", "no", ("t", 0x7E020080)),
        ("RestrictNamespaces", "net mnt", ("t", 0x40000000 | 0x20000)),
        ("RestrictNamespaces", "~user", ("t", 0x7E020080 & ~0x10000000)),
        ("DelegateNamespaces", "yes", ("t", 0x7E020080 & ~0x10000000)),
        ("DelegateNamespaces", "no", ("t", 0)),  # (review 37 T3-2: it was all)
        ("DelegateNamespaces", "~net", ("t", 0x7E020080 & ~0x10000000 & ~0x40000000)),
        ("PassEnvironment", "HOME 'LANG'", ("as", ["HOME", "LANG"])),
        ("UnsetEnvironment", "A B=1", ("as", ["A", "B=1"])),
        ("InaccessibleDirectories", "/a -/b", ("as", ["/a", "-/b"])),
        ("StateDirectory", "app 'app 2'", ("as", ["app", "app 2"])),
        ("SystemCallArchitectures", "native", ("as", ["native"])),
        ("RequiresMountsFor", "/scratch /home", ("as", ["/scratch", "/home"])),
        (
            "ExecSearchPath",
            "/usr/bin:/bin /sbin",
            ("as", ["/usr/bin", "/bin", "/sbin"]),
        ),
        ("IPEgressFilterPath", "/sys/fs/bpf/x", ("as", ["/sys/fs/bpf/x"])),
        ("ImportCredential", "site.*", ("as", ["site.*"])),
        (
            "IOReadBandwidthMax",
            "/dev/sda 10M, /dev/sdb infinity",
            ("a(st)", [("/dev/sda", 10_000_000), ("/dev/sdb", UINT64_MAX)]),
        ),
        ("IOWriteIOPSMax", "/dev/sda 1.5K", ("a(st)", [("/dev/sda", 1500)])),
        ("IODeviceWeight", "/dev/sda 200", ("a(st)", [("/dev/sda", 200)])),
        (
            "IODeviceLatencyTargetUSec",
            "/dev/sda 25000",
            ("a(st)", [("/dev/sda", 25000)]),
        ),
        (
            "BindPaths",
            "/a -/b:/c '/d':/f:norbind",
            (
                "a(ssbt)",
                [
                    ("/a", "/a", False, 16384),
                    ("/b", "/c", True, 16384),
                    ("/d", "/f", False, 0),
                ],
            ),
        ),
        (
            "TemporaryFileSystem",
            "/mnt:ro,size=1G /x",
            ("a(ss)", [("/mnt", "ro,size=1G"), ("/x", "")]),
        ),
        (
            "IPAddressAllow",
            "10.0.0.0/8 fd00::1",
            (
                "a(iayu)",
                [(2, bytes([10, 0, 0, 0]), 8), (10, bytes([0xFD, *[0] * 14, 1]), 128)],
            ),
        ),
        (
            "IPAddressDeny",
            "localhost",
            (
                "a(iayu)",
                [(2, bytes([127, 0, 0, 0]), 8), (10, bytes([*[0] * 15, 1]), 128)],
            ),
        ),
        ("EnvironmentFiles", "-/etc/site.env", ("a(sb)", [("/etc/site.env", True)])),
        ("AppArmorProfile", "-site", ("(bs)", (True, "site"))),
        ("LogFilterPatterns", "~debug", ("a(bs)", [(False, "debug")])),
        ("SuccessExitStatus", "3 SIGUSR1", ("(aiai)", ([3], [10]))),
        # systemd.service(5)'s own example (review 37 T3-3)
        ("SuccessExitStatus", "TEMPFAIL 250 SIGKILL", ("(aiai)", ([75, 250], [9]))),
        ("RestartPreventExitStatus", "CHDIR", ("(aiai)", ([200], []))),
        # names systemd 252 takes, for codes sdexec reads as the command's
        # own exits (244 and 255 stay so: test_unit.py)
        ("SuccessExitStatus", "BPF EXCEPTION", ("(aiai)", ([244, 255], []))),
        ("LoadCredential", "token:/etc/token", ("a(ss)", [("token", "/etc/token")])),
        ("LoadCredential", "token", ("a(ss)", [("token", "token")])),
        (
            "BPFProgram",
            "egress:/sys/fs/bpf/x",
            ("a(ss)", [("egress", "/sys/fs/bpf/x")]),
        ),
        ("LogExtraFields", "SITE=a", ("aay", [b"SITE=a"])),
        ("ProtectHostnameEx", "private:node1", ("(ss)", ("private", "node1"))),
        ("StartupAllowedCPUs", "0-1", ("ay", b"\x03")),
        ("StartupMemoryMax", "1G", ("t", 2**30)),
        ("AddRef", "no", ("b", False)),
    ],
)
def test_systemd_run_s_other_typed_properties_are_sent_typed(name, text, typed):
    # Sent as strings, each failed every job ("Unexpected message contents");
    # the values are what systemd-run -p sends for the same text.
    assert typed_property(name, text) == UnitProperty(name, *typed)


def test_a_zswap_or_default_memory_percentage_goes_as_its_scale():
    assert typed_property("MemoryZSwapMax", "10%") == UnitProperty(
        "MemoryZSwapMaxScale", "u", scale_from_permyriad(1000)
    )
    assert typed_property("DefaultMemoryLow", "1G").signature == "t"


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("StartLimitBurst", "-1", "'-1' is not a number from 0 to 4294967295"),
        ("ManagedOOMMemoryPressureLimit", "60", "'60' is not a percentage"),
        ("ManagedOOMMemoryPressureDurationUSec", "5000", "systemd takes 1000000"),
        ("WatchdogSignal", "SIGNOPE", '"SIGNOPE" is not a signal'),
        ("SyslogFacility", "local8", "'local8' is no syslog facility"),
        ("SecureBits", "keep", "'keep' is no secure bit"),
        ("SystemCallErrorNumber", "errorcode", "'errorcode' is no errno"),
        ("SystemCallErrorNumber", "0", "errno numbers are 1 to 4095"),
        ("FailureActionExitStatus", "256", "not an exit status from 0 to 255"),
        ("CoredumpFilter", "private", "'private' is no core-dump segment"),
        ("MountFlags", "rshared", "'rshared' is not one of shared, slave, private"),
        ("RestrictNamespaces", "~network", "'network' is no namespace"),
        ("PassEnvironment", "A=1", "'A=1' is not a variable's name alone"),
        ("UnsetEnvironment", "1A", "'1A' is not a variable's name"),
        ("UnsetEnvironment", "A\\tB", "does not read systemd's backslash escapes"),
        ("StateDirectory", "app:link", "sdexec takes directory names only"),
        ("StateDirectory", "/var/lib/app", "is not relative to the manager's"),
        ("RequiresMountsFor", "scratch", "'scratch' is not an absolute path"),
        ("ExecSearchPath", "bin", "'bin' is not an absolute path"),
        ("ImportCredential", "a:b", "is not one path or name"),
        ("IOReadBandwidthMax", "/dev/sda", "'/dev/sda' is not 'PATH VALUE'"),
        ("IOReadBandwidthMax", "/dev/sda 1X", "'1X' is not a size"),
        ("IOReadBandwidthMax", "/dev/sda 1M,", "an empty entry"),
        ("IODeviceWeight", "/dev/sda 0", "'0' is not a weight from 1 to 10000"),
        ("IODeviceLatencyTargetUSec", "/dev/sda 5ms", "is not microseconds"),
        ("BindPaths", "/a:/b:rec", "'rec' is not rbind or norbind"),
        ("BindPaths", "/a:b", "'b' is not an absolute path"),
        ("TemporaryFileSystem", "mnt", "'mnt' is not an absolute path"),
        ("IPAddressDeny", "10.0.0.0/255.0.0.0", "is not an IP address or prefix"),
        ("IPAddressDeny", "fe80::1%eth0", "is not an IP address or prefix"),
        ("IPAddressDeny", "any localhost", "'any' is not an IP address"),
        ("EnvironmentFiles", "site.env", "'site.env' is not an absolute path"),
        ("LogFilterPatterns", "~", "no pattern given"),
        ("SuccessExitStatus", "256", "exit statuses are 0 to 255"),
        ("SuccessExitStatus", "OOPS", "neither an exit status (0 to 255, or"),
        ("BPFProgram", "egress", "'egress' is not TYPE:PATH"),
        ("BPFProgram", "egres:/sys/fs/bpf/x", "'egres' is no BPF attach type"),
        ("CoredumpFilter", "1ffffffff", "nor a hexadecimal mask of 32 bits"),
        ("BindPaths", "'/a:/b'", "a ':' in quotes is part of a path"),
        ("LogExtraFields", "1SITE=x", "is not FIELD=VALUE"),
        ("LogExtraFields", f"{'X' * 65}=1", "is not FIELD=VALUE"),
        ("IOReadBandwidthMax", "/dev//sda 1M", "'/dev//sda' is not normalized"),
        ("ExecSearchPath", "/usr/./bin", "'/usr/./bin' is not normalized"),
        ("StateDirectory", "a/../b", "'a/../b' is not normalized"),
        ("StateDirectory", "private/x", "systemd keeps private/ for DynamicUser"),
        ("LogExtraFields", "site=1", "is not FIELD=VALUE"),
        ("ProtectHostnameEx", "private:", "is not yes, no or private"),
        ("StartupMemoryMax", "10%", "in bytes, not as a percentage"),
        ("StartupMemoryHigh", "0", "from 1 byte"),
    ],
)
def test_a_bad_value_of_systemd_run_s_other_types_names_the_property(name, text, said):
    message = refused(name, text)
    assert message.startswith(f"SDEXEC_PROP_{name}: error setting property:")
    assert said in message


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("SetCredential", "systemd takes it as D-Bus a(say), which sdexec does not"),
        ("SocketBindDeny", "systemd takes it as D-Bus a(iiqq)"),
        ("MemoryLimit", "a cgroup v1 setting, which systemd 256 dropped"),
        ("BlockIOReadBandwidth", "set IOReadBandwidthMax instead"),
    ],
)
def test_a_name_systemd_types_otherwise_and_sdexec_does_not_is_refused(name, said):
    # Sent as strings they failed every job: now the site's load says why.
    assert said in refused(name, "anything")


def _shlex_words(text: str, escape: str) -> list[str] | str:
    """What shlex (posix, split at white space) reads: the words, or its
    error."""
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    lexer.escape = escape
    try:
        return list(lexer)
    except ValueError as error:
        return str(error)


@given(st.text(alphabet=" \t\n\r\v'\"\\a#", max_size=12), st.sampled_from(["\\", ""]))
def test_a_value_s_words_are_shlex_s(text, escape):
    # The split was shlex's own; it is by pieces now (below), read alike.
    expected = _shlex_words(text, escape)
    try:
        words: list[str] | str = _split(text, "none", escape)
    except ValueError as error:
        words = str(error).rpartition(": ")[2]
    assert words == (expected or "none")


def test_a_long_value_is_split_without_shlex(monkeypatch):
    # shlex grows a word by += on an attribute, a copy per character: one
    # request's ReadOnlyPaths and BindPaths of a 900 kB path held the
    # reactor 18 s, every other client waiting (review session 46).
    monkeypatch.setattr(propertyvalues, "shlex", None, raising=False)
    long = "/" + "a" * 900_000
    prop = typed_property("ReadOnlyPaths", f"{long} '/b c'", source="request")
    assert prop.value == [long, "/b c"]


@pytest.mark.parametrize(
    ("name", "text", "soft", "hard"),
    [
        ("LimitNOFILE", "5:10", "5", "10"),
        ("LimitCPU", "60:infinity", "60", "infinity"),
        ("LimitFSIZE", "1K:2M", "1K", "2M"),
        ("LimitNICE", "20:40", "20", "40"),
        ("LimitCORE", "0:0", "0", "0"),
    ],
)
def test_a_soft_hard_limit_becomes_the_two_properties_d_bus_takes(
    name, text, soft, hard
):
    # systemd.exec(5) takes SOFT:HARD in a unit's file and systemd-run -p;
    # a transient unit takes Limit<X>Soft and Limit<X> apart, and sdexec
    # refused the pair (review session 46).
    split = split_rlimit_pairs({name: text, "Nice": "5"})
    assert split == {f"{name}Soft": soft, name: hard, "Nice": "5"}


@pytest.mark.parametrize(
    ("table", "said"),
    [
        # systemd's rlimit_parse refuses soft above hard (EILSEQ).
        ({"LimitNOFILE": "10:5"}, "'10:5': the soft limit is above the hard one"),
        ({"LimitFSIZE": "2M:1K"}, "'2M:1K': the soft limit is above the hard one"),
        ({"LimitCPU": "infinity:60"}, "the soft limit is above the hard one"),
        ({"LimitNOFILE": "x:10"}, "'x' is not a decimal integer"),
        ({"LimitNOFILE": "5:"}, "'' is not a decimal integer"),
        ({"LimitNOFILE": "1:2:3"}, "'2:3': one value, or in LimitNOFILE one"),
        ({"LimitNOFILE": "5:10", "LimitNOFILESoft": "7"},
         "'5:10' sets the soft limit, and so does LimitNOFILESoft"),
    ],
)  # fmt: skip
def test_a_soft_hard_limit_systemd_would_refuse_names_the_property(table, said):
    with pytest.raises(PropertyError) as error:
        split_rlimit_pairs(table)
    assert str(error.value).startswith(
        f"SDEXEC_PROP_{next(iter(table))}: error setting property: "
    )
    assert said in error.value.reason


def test_a_soft_limit_is_no_pair():
    # Only Limit<X> takes the pair; its Soft twin takes one value.
    assert "one value, or in LimitNOFILE one soft:hard pair" in refused(
        "LimitNOFILESoft", "5:10"
    )
