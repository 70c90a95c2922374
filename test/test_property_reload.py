"""Unit properties as systemd keeps them across a daemon-reload, from the
site's configuration and from a request alike (review 43 T5): systemd
writes each into the unit's file, and a reload reads that back."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import pytest

from sdexec.config import ConfigError, parse_config
from sdexec.containment import Containment
from sdexec.plan import RequestError, plan_exec
from sdexec.property import UnitProperty, typed_property
from sdexec.refusal import RequestRefused

TRUE = ["/bin/true"]


def site(allowing: Sequence[str] = (), **properties: str) -> Any:
    """A configuration whose ``[exec.sdexec-properties]`` are ``properties``,
    and whose ``request-properties`` are ``allowing``, if any."""
    data: dict[str, Any] = {
        "exec": {"sdexec-properties": properties},
        "systemd": {"enable": True},
    }
    if allowing:
        data["sdexec"] = {"request-properties": list(allowing)}
    return parse_config(data)


def site_refusal(**properties: str) -> str:
    with pytest.raises(ConfigError) as error:
        site(**properties)
    return str(error.value)


def request_refusal(config: Any, **requested: str) -> RequestRefused | RequestError:
    """The refusal of a request setting ``requested`` under ``config``."""
    opts = {"SDEXEC_NAME": "sdexec-t"}
    opts.update({f"SDEXEC_PROP_{name}": value for name, value in requested.items()})
    payload = {"flags": 0, "cmd": {"cmdline": TRUE, "opts": opts}}
    with pytest.raises((RequestRefused, RequestError)) as error:
        plan_exec(payload, config, Containment(config, None))
    return error.value


def sent(config: Any, **requested: str) -> dict[str, UnitProperty]:
    """The properties a request's plan sends, by name."""
    opts = {"SDEXEC_NAME": "sdexec-t"}
    opts.update({f"SDEXEC_PROP_{name}": value for name, value in requested.items()})
    payload = {"flags": 0, "cmd": {"cmdline": TRUE, "opts": opts}}
    plan = plan_exec(payload, config, Containment(config, None))
    return {prop.name: prop for prop in plan.properties}


# --- 1: a percentage systemd keeps to two decimals ------------------------


@pytest.mark.parametrize("name", ["MemoryMax", "MemoryHigh", "MemorySwapMax"])
@pytest.mark.parametrize("value", ["0.004%", "3.125%", "0.00000001%"])
def test_a_request_s_finer_percentage_is_einval_naming_it(name, value):
    # 0.004% was "tighter" than the site's 8G, and came back from the unit's
    # file as 0.00%, no limit at all, at a daemon-reload.
    config = site(MemoryMax="8G", MemoryHigh="6G", MemorySwapMax="1G")
    error = request_refusal(config, **{name: value})
    assert error.errnum == errno.EINVAL
    assert error.errstr == (
        f"SDEXEC_PROP_{name}: {value!r} has more than two decimals: systemd"
        " keeps a percentage to 0.01%"
    )


@pytest.mark.parametrize("name", ["MemoryZSwapMax", "DefaultMemoryMin"])
def test_a_site_s_finer_percentage_is_refused_naming_it(name):
    assert site_refusal(**{name: "3.125%"}) == (
        f"<config>: exec.sdexec-properties.{name}: '3.125%' has more than two"
        " decimals: systemd keeps a percentage to 0.01%"
    )


@pytest.mark.parametrize("name", ["MemoryMax", "MemoryHigh"])
def test_a_site_s_finer_memory_cap_is_refused(name):
    with pytest.raises(
        ConfigError,
        match=f"{name}: '0.00000001%' has more than two decimals",
    ):
        site(**{name: "0.00000001%"})


@pytest.mark.parametrize("name", ["MemoryMax", "MemoryHigh"])
def test_a_zero_percentage_cap_is_refused_naming_the_property(name):
    # Not the manager's "Value specified in MemoryMaxScale is out of range".
    config = site()
    error = request_refusal(config, **{name: "0.00%"})
    assert error.errnum == errno.EINVAL
    assert error.errstr == (
        f"SDEXEC_PROP_{name}: error setting property: '0.00%' is out of range:"
        f" systemd takes {name} from 1 byte (infinity for none)"
    )


@pytest.mark.parametrize(
    ("percent", "permyriad"), [("3.13%", 313), ("0.01%", 1), ("50%", 5000)]
)
def test_the_scale_sent_is_the_one_systemd_writes_back(percent, permyriad):
    # As systemd-run sends it: UINT32_SCALE_FROM_PERMYRIAD, rounded half up
    # (0.01% and 50% tell it from rounding down).
    properties = sent(site(), MemoryMax=percent)
    scale = (permyriad * (2**32 - 1) + 5000) // 10_000
    assert properties["MemoryMaxScale"].value == scale


# --- 2: a CPU quota below 1% ----------------------------------------------


@pytest.mark.parametrize("value", ["1", "9999"])
def test_a_cpu_quota_below_one_percent_is_refused_for_a_request(value):
    # systemd writes it as CPUQuota=0%, which a daemon-reload ignores: the
    # site's quota was gone for that job.
    config = site(CPUQuotaPerSecUSec="2000000")
    error = request_refusal(config, CPUQuotaPerSecUSec=value)
    assert error.errnum == errno.EINVAL
    assert error.errstr.startswith(
        f"SDEXEC_PROP_CPUQuotaPerSecUSec: error setting property: {value!r} is out"
        " of range: systemd takes 10000 (1%) to 214748360000"
    )
    assert "a daemon-reload drops a quota below 1% or above" in error.errstr


def test_a_cpu_quota_below_one_percent_is_refused_for_the_site():
    message = site_refusal(CPUQuotaPerSecUSec="9999")
    assert message.startswith(
        "<config>: exec.sdexec-properties.CPUQuotaPerSecUSec: '9999' is out of"
        " range: systemd takes 10000 (1%) to 214748360000, or infinity"
    )


def test_a_cpu_quota_of_one_percent_is_taken():
    assert site(CPUQuotaPerSecUSec="10000").exec.sdexec_properties
    assert sent(site(), CPUQuotaPerSecUSec="10000")["CPUQuotaPerSecUSec"].value == 10000


# --- 3: a jitter that lengthens the site's runtime limit ------------------


def test_a_request_s_jitter_cannot_lengthen_the_site_s_runtime_limit():
    config = site(
        ["RuntimeMaxUSec", "RuntimeRandomizedExtraUSec"], RuntimeMaxUSec="2000000"
    )
    error = request_refusal(config, RuntimeRandomizedExtraUSec="600000000")
    assert error.errnum == errno.EPERM
    assert error.errstr.startswith(
        "SDEXEC_PROP_RuntimeRandomizedExtraUSec: '600000000' is looser than this"
        " node's RuntimeRandomizedExtraUSec=0, which lengthens its"
        " RuntimeMaxUSec=2000000"
    )


# --- 4: the …Scale names, and a percentage of tasks -----------------------


def test_a_site_s_scale_is_refused_naming_the_percentage_form():
    # Sent as a string, every job failed with "Unexpected message contents".
    assert site_refusal(MemoryMaxScale="100") == (
        "<config>: exec.sdexec-properties.MemoryMaxScale: the D-Bus form of a"
        " percentage MemoryMax, which systemd takes as a fraction of 2^32-1:"
        ' write MemoryMax = "50%" instead, which sdexec sends so'
    )
    assert site_refusal(TasksMaxScale="100") == (
        "<config>: exec.sdexec-properties.TasksMaxScale: the D-Bus form of a"
        " percentage TasksMax: give TasksMax a number"
    )


@pytest.mark.parametrize("value", ["50%", "0%", "12.345%"])
def test_a_tasks_percentage_is_refused_saying_what_a_reload_would_do(value):
    # systemd-run takes TasksMax=50% (as TasksMaxScale), and systemd writes
    # it into the unit's file as 5.0% (its issue #41009): a daemon-reload
    # cut the limit tenfold.
    assert site_refusal(TasksMax=value) == (
        f"<config>: exec.sdexec-properties.TasksMax: {value!r}: a percentage is"
        " not taken here: systemd writes it into the unit's file as about a"
        " tenth of itself (systemd issue #41009), which a daemon-reload then"
        " applies; give a number of tasks"
    )


# --- 5: address families --------------------------------------------------


@pytest.mark.parametrize(
    ("value", "word"),
    [("AF_UNIX AF_INTE", "AF_INTE"), ("~AF_PACKETS", "AF_PACKETS"),
     ("AF_UNSPEC", "AF_UNSPEC"), ("af_unix", "af_unix")],
)  # fmt: skip
def test_a_misspelt_address_family_is_refused_naming_it(value, word):
    # It loaded, and every job failed with a bare "Invalid argument".
    assert site_refusal(RestrictAddressFamilies=value).startswith(
        f"<config>: exec.sdexec-properties.RestrictAddressFamilies: {word!r} is no"
        " address family systemd knows"
    )
    error = request_refusal(
        site(["RestrictAddressFamilies"]), RestrictAddressFamilies=value
    )
    assert error.errnum == errno.EINVAL
    assert f"{word!r} is no address family systemd knows" in error.errstr


@pytest.mark.parametrize("value", ["AF_DECnet", "AF_LOCAL AF_FILE", "~AF_MCTP AF_XDP"])
def test_every_family_systemd_knows_is_taken(value):
    assert site(RestrictAddressFamilies=value).exec.sdexec_properties


# --- 6: what systemd-run takes --------------------------------------------


@pytest.mark.parametrize("name", ["CPUWeight", "StartupCPUWeight"])
def test_an_idle_cpu_weight_is_zero(name):
    assert site(**{name: "idle"}).exec.sdexec_properties == {name: "idle"}
    assert typed_property(name, "idle") == UnitProperty(name, "t", 0)
    # Over a site's idle, a request's idle is as tight, and 1 looser.
    config = site([name], **{name: "idle"})
    assert sent(config, **{name: "idle"})[name].value == 0
    assert request_refusal(config, **{name: "1"}).errnum == errno.EPERM


def test_a_size_may_say_b_and_a_sum_is_refused_saying_so():
    assert site(MemoryMax="512B", LimitCORE="512B").exec.sdexec_properties
    assert typed_property("MemoryMax", "512B") == UnitProperty("MemoryMax", "t", 512)
    error = request_refusal(site(), MemoryMax="1G 512M")
    assert error.errnum == errno.EINVAL
    assert error.errstr == (
        "SDEXEC_PROP_MemoryMax: '1G 512M': sdexec does not take a sum of sizes;"
        " write it as one (1.5G, not 1G 512M)"
    )


# --- 7: time spans, as systemd writes them into the unit's file -----------

#: The first time span systemd 252 writes as 584542 years, which its
#: unit-file parser refuses: the setting was dropped at a daemon-reload.
YEARS_584542 = 584_542 * 31_557_600 * 1_000_000


@pytest.mark.parametrize(
    "name", ["RuntimeMaxUSec", "TimeoutStartUSec", "StartLimitIntervalUSec"]
)
def test_a_time_span_of_584542_years_is_refused_naming_infinity(name):
    # RuntimeMaxUSec read back as infinity, TimeoutStartUSec as 90 s (the
    # default), StartLimitIntervalUSec as 10 s.
    for value in (YEARS_584542, 2**64 - 2):
        assert site_refusal(**{name: str(value)}) == (
            f"<config>: exec.sdexec-properties.{name}: '{value}' is too long a"
            " time span for the unit's file: systemd writes it there in years,"
            " and a daemon-reload reads back none of 584542 years or more (give"
            " infinity)"
        )
    largest = YEARS_584542 - 1000
    assert typed_property(name, str(largest)).value == largest


@pytest.mark.parametrize("value", ["1001", "1500", "1000001", "59999999"])
def test_a_part_of_a_millisecond_is_refused_saying_what_a_reload_makes(value):
    # systemd writes "1min 1.000s" for 61000500: it read back as 61000000.
    error = request_refusal(site(["RuntimeMaxUSec"]), RuntimeMaxUSec=value)
    assert error.errnum == errno.EINVAL
    assert error.errstr == (
        f"SDEXEC_PROP_RuntimeMaxUSec: error setting property: {value!r} has a"
        " part of a millisecond: systemd writes it into the unit's file in"
        " whole milliseconds, and a daemon-reload would make it"
        f" {int(value) // 1000 * 1000}"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [("RuntimeMaxUSec", "999"), ("TimeoutAbortUSec", "1"), ("WatchdogUSec", "0"),
     ("RuntimeMaxUSec", "61000000"), ("CPUQuotaPeriodUSec", "1500")],
)  # fmt: skip
def test_a_time_span_systemd_writes_back_exactly_is_taken(name, value):
    # Below a millisecond it writes microseconds ("999us"), and the CPU
    # quota's period to the microsecond ("1.500ms").
    assert typed_property(name, value).value == int(value)


def test_a_start_timeout_of_0_is_refused_naming_infinity():
    # Over D-Bus a timeout of 0 failed every start at once (Result=timeout);
    # the unit's file then read back TimeoutStartSec=0 as infinity.
    assert site_refusal(TimeoutStartUSec="0") == (
        "<config>: exec.sdexec-properties.TimeoutStartUSec: '0' times every"
        " start out at once (systemd 252: a unit file's 0 is no timeout, and a"
        " daemon-reload reads it back so): give infinity for none"
    )


def test_a_timer_slack_past_a_signed_64_bit_number_is_refused():
    # systemd writes it as a number, which it read back as the default.
    assert typed_property("TimerSlackNSec", str(2**63 - 1)).value == 2**63 - 1
    assert site_refusal(TimerSlackNSec=str(2**63)) == (
        f"<config>: exec.sdexec-properties.TimerSlackNSec: '{2**63}' is out of"
        " range: a daemon-reload reads back no TimerSlackNSec above"
        f" {2**63 - 1}"
    )


def test_an_io_latency_target_of_584542_years_is_refused():
    # Its entry was gone from the unit at a daemon-reload.
    assert typed_property(
        "IODeviceLatencyTargetUSec", f"/tmp {YEARS_584542 - 1}"
    ).value == [("/tmp", YEARS_584542 - 1)]
    assert "is too long a time span for the unit's file" in site_refusal(
        IODeviceLatencyTargetUSec=f"/tmp {YEARS_584542}"
    )


# --- 8: resource limits systemd reads back --------------------------------


@pytest.mark.parametrize(
    ("name", "value", "most"),
    [("LimitNICE", "41", 40), ("LimitNICESoft", "1023", 40),
     ("LimitCPU", "18446744073709", 18446744073708),
     ("LimitRTTIME", str(2**63), 2**63 - 1)],
)  # fmt: skip
def test_a_limit_systemd_reads_back_otherwise_is_refused(name, value, most):
    # LimitNICE=41 read back as 0, LimitCPU and LimitRTTIME past these as
    # infinity.
    resource = name.removeprefix("Limit").removesuffix("Soft")
    assert site_refusal(**{name: value}).startswith(
        f"<config>: exec.sdexec-properties.{name}: {value!r} is out of range: a"
        f" daemon-reload reads back no Limit{resource} above {most}"
    )
    assert typed_property(name, str(most)).value == most


def test_an_infinite_nice_limit_is_refused_naming_40():
    # systemd writes LimitNICE=infinity, which its unit-file parser refuses.
    assert site_refusal(LimitNICE="infinity") == (
        "<config>: exec.sdexec-properties.LimitNICE: 'infinity' is not taken: a"
        " daemon-reload reads LimitNICE back from 0 to 40 alone (40 allows every"
        " nice level)"
    )
    assert typed_property("LimitCPU", "infinity").value == 2**64 - 1


# --- 9: a CPU quota, which systemd writes in whole percents --------------


@pytest.mark.parametrize(
    ("value", "kept"),
    [("15000", 10000), ("1505000", 1500000), ("123456789", 123450000)],
)
def test_a_cpu_quota_of_part_of_a_percent_is_refused_saying_what_a_reload_makes(
    value, kept
):
    # systemd wrote 1505000 as CPUQuota=150%: a reload cut the quota so.
    error = request_refusal(
        site(CPUQuotaPerSecUSec="200000000"), CPUQuotaPerSecUSec=value
    )
    assert error.errnum == errno.EINVAL
    assert error.errstr == (
        f"SDEXEC_PROP_CPUQuotaPerSecUSec: error setting property: {value!r} is"
        " not a whole percent (10000 µs a second): systemd writes the quota into"
        " the unit's file in whole percents, and a daemon-reload would make it"
        f" {kept} ({kept // 10000}%)"
    )


def test_a_cpu_quota_above_21474836_percent_is_refused():
    # Written as CPUQuota=21474837%, it read back as no quota at all.
    assert typed_property("CPUQuotaPerSecUSec", "214748360000").value == 214748360000
    assert site_refusal(CPUQuotaPerSecUSec="214748370000").startswith(
        "<config>: exec.sdexec-properties.CPUQuotaPerSecUSec: '214748370000' is"
        " out of range: systemd takes 10000 (1%) to 214748360000, or infinity"
    )


# --- 10: I/O limits --------------------------------------------------------


@pytest.mark.parametrize("name", ["IOReadBandwidthMax", "IOWriteIOPSMax"])
def test_an_io_limit_of_0_is_refused(name):
    # systemd took "/tmp 0" over D-Bus, and dropped it at a daemon-reload.
    assert site_refusal(**{name: "/tmp 0"}) == (
        f"<config>: exec.sdexec-properties.{name}: '0' is out of range: a"
        " daemon-reload reads back no limit of 0 (give 1 or more, or infinity)"
    )
    assert typed_property(name, "/tmp 1").value == [("/tmp", 1)]


# --- 11: characters systemd writes into the unit's file as they are -------

SPECIFIER = "a specifier (%h: the home directory)"


@pytest.mark.parametrize(
    ("name", "value", "word", "found", "read_as"),
    [("ReadOnlyPaths", """'/tmp/a"b'""", '/tmp/a"b', '"', "a quote"),
     ("RuntimeDirectory", """'a"b'""", 'a"b', '"', "a quote"),
     ("BindReadOnlyPaths", "'/tmp/a b'", "/tmp/a b", " ", "a space between entries"),
     ("BindPaths", """'/tmp/a'"'"'b'""", "/tmp/a'b", "'", "a quote"),
     ("TemporaryFileSystem", "'/tmp/a b'", "/tmp/a b", " ", "a space between entries"),
     ("RequiresMountsFor", "/tmp/%h", "/tmp/%h", "%", SPECIFIER),
     ("Documentation", "'man:a b'", "man:a b", " ", "a space between entries"),
     ("SupplementaryGroups", "'a b'", "a b", " ", "a space between entries"),
     ("IPIngressFilterPath", "/sys/fs/bpf/%h", "/sys/fs/bpf/%h", "%", SPECIFIER)],
)  # fmt: skip
def test_a_character_systemd_reads_back_otherwise_is_refused_naming_it(
    name, value, word, found, read_as
):
    # Each came back from a daemon-reload otherwise: the entry gone, split
    # in two, or /tmp/%h as /tmp/root.
    assert site_refusal(**{name: value}) == (
        f"<config>: exec.sdexec-properties.{name}: {word!r}: systemd writes"
        f" {found!r} into the unit's file as it is, where a daemon-reload reads"
        f" it as {read_as}"
    )


def test_a_device_of_a_specifier_is_refused():
    # The mapper's alone (reserved to it): /dev/%h read back as /dev/root.
    with pytest.raises(ValueError, match="reads it as a specifier"):
        typed_property("DeviceAllow", "/dev/%h rw", source="containment")


@pytest.mark.parametrize(
    ("name", "value", "sent"),
    [("ReadOnlyPaths", "'/tmp/a b' \"/tmp/a'b\" /tmp/%h",
      ["/tmp/a b", "/tmp/a'b", "/tmp/%h"]),
     ("RuntimeDirectory", "'a b'", ["a b"]),
     ("BindReadOnlyPaths", "/tmp/%h", [("/tmp/%h", "/tmp/%h", False, 16384)]),
     ("TemporaryFileSystem", "/tmp/%h:ro", [("/tmp/%h", "ro")])],
)  # fmt: skip
def test_what_systemd_writes_back_as_it_was_is_taken(name, value, sent):
    # Quoted, or with the '%' doubled, these read back as sent.
    assert typed_property(name, value).value == sent


def test_a_backslash_or_dot_dot_in_a_path_list_is_refused():
    # systemd wrote /tmp/a\b as it is, and read back /tmp/ab; /a/../b it
    # took over D-Bus, and the reload dropped the whole list.
    assert site_refusal(ReadOnlyPaths="'/tmp/a\\b'").startswith(
        "<config>: exec.sdexec-properties.ReadOnlyPaths: \"'/tmp/a\\\\b'\": sdexec"
        " does not read systemd's backslash escapes here"
    )
    assert site_refusal(ReadWritePaths="/scratch -/a/../b") == (
        "<config>: exec.sdexec-properties.ReadWritePaths: '-/a/../b': a '..' in"
        " it, which systemd takes over D-Bus but not from the unit's file: a"
        " daemon-reload would drop the list"
    )


def test_a_percent_in_temporary_file_system_options_is_refused():
    # Written as size=1%%, it read back so.
    assert site_refusal(TemporaryFileSystem="/mnt:size=10%") == (
        "<config>: exec.sdexec-properties.TemporaryFileSystem: '/mnt:size=10%':"
        " systemd writes a '%' of the options into the unit's file as '%%',"
        " which a daemon-reload reads back so"
    )


def test_a_space_in_a_log_field_is_refused():
    # LogExtraFields=A=a b read back as A=a.
    assert site_refusal(LogExtraFields="A=a b") == (
        "<config>: exec.sdexec-properties.LogExtraFields: 'A=a b': systemd"
        " writes the field into the unit's file unquoted, where a daemon-reload"
        " reads a space as the end of it"
    )
    assert typed_property("LogExtraFields", 'A="x"').value == [b'A="x"']


# --- 12: a variable named twice --------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "word", "variable"),
    [("PassEnvironment", "HOME PATH HOME", "HOME", "HOME"),
     ("UnsetEnvironment", "A=1 A=1", "A=1", "A"),
     ("UnsetEnvironment", "A=1 B A=2", "A=2", "A")],
)  # fmt: skip
def test_a_variable_given_twice_is_refused_naming_it(name, value, word, variable):
    # The site's table loaded, and every job failed with "Invalid
    # PassEnvironment= block." (A=1 A=2 ran with A=2, and read back both.)
    assert site_refusal(**{name: value}) == (
        f"<config>: exec.sdexec-properties.{name}: {word!r}: {variable} is given"
        " twice (systemd refuses the same word twice, and of two assignments"
        " keeps the last alone until a daemon-reload reads back both)"
    )
    assert typed_property("UnsetEnvironment", "A A=1").value == ["A", "A=1"]


# --- 13: a string with a space at an end -----------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [("SyslogIdentifier", " job "), ("PIDFile", "/run/x.pid "), ("PAMName", " "),
     ("UtmpIdentifier", "\tx")],
)  # fmt: skip
def test_a_string_with_a_space_at_an_end_is_refused(name, value):
    # systemd's unit-file parser strips a value: SyslogIdentifier " job "
    # came back from a daemon-reload as "job", PAMName " " as none.
    assert site_refusal(**{name: value}) == (
        f"<config>: exec.sdexec-properties.{name}: {value!r}: a space at its"
        " start or end, which systemd writes into the unit's file and a"
        " daemon-reload drops"
    )
    assert typed_property(name, "a b").value == "a b"
