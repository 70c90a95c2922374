"""sdexec.policy: what a request may set, and the environment it passes on
(issue 16)."""

from __future__ import annotations

import errno
import math
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import any_text

from sdexec.command import Command, unit_properties
from sdexec.environment import DROPPED_ENVIRONMENT, clean_environment
from sdexec.execstart import exec_line
from sdexec.policy import (
    ALWAYS_ALLOWED,
    CONFIG_KEY,
    DEFAULT_ALLOWED,
    NEVER_ALLOWED,
    SDEXEC_FIXED,
    TIGHTENING,
    Ordering,
    RequestPolicy,
    RequestPropertiesEntryError,
    never_allowed_reason,
    parse_request_properties,
)
from sdexec.property import is_known_property, typed_property
from sdexec.refusal import SHOWN, RequestRefused
from sdexec.sizes import scale_from_permyriad
from sdexec.unitstop import lifecycle_properties

GIB = 1024**3
POLICY = RequestPolicy(physical_memory=64 * GIB)


def refusal(policy: RequestPolicy, **requested: str) -> RequestRefused:
    with pytest.raises(RequestRefused) as caught:
        policy.accept(requested)
    return caught.value


def assert_looser(policy: RequestPolicy, name: str, value: str, baseline: str):
    """``name=value`` is EPERM as looser than ``baseline`` (``Name=value``)."""
    error = refusal(policy, **{name: value})
    assert error.errnum == errno.EPERM
    assert f"is looser than this node's {baseline}" in error.errstr


def test_default_set_tightens_with_no_baseline() -> None:
    requested = {
        "MemoryMax": "512M",
        "MemoryHigh": "50%",
        "MemorySwapMax": "0",
        "CPUWeight": "50",
        "CPUQuotaPerSecUSec": "500000",
        "Description": "my job",
        "MemoryAccounting": "yes",
    }
    assert POLICY.accept(requested) == requested


@pytest.mark.parametrize(
    ("name", "value", "baseline"),
    [
        ("MemoryMax", "infinity", "8G"),
        ("MemoryMax", "9G", "8G"),
        ("MemoryMax", "50%", "8G"),  # 32 GiB of 64
        ("MemoryHigh", "8G", "10%"),
        ("CPUWeight", "10000", None),
        ("CPUWeight", "200", "150"),
        ("CPUQuotaPerSecUSec", "infinity", "2000000"),
    ],
)
def test_a_looser_value_is_eperm_naming_property_and_key(
    name: str, value: str, baseline: str | None
) -> None:
    policy = RequestPolicy(
        baseline={} if baseline is None else {name: baseline},
        physical_memory=64 * GIB,
    )
    error = refusal(policy, **{name: value})
    assert error.errnum == errno.EPERM
    assert error.errstr.startswith(f"SDEXEC_PROP_{name}: ")
    assert "looser" in error.errstr and CONFIG_KEY in error.errstr


def test_equal_or_tighter_than_the_baseline_is_accepted() -> None:
    policy = RequestPolicy(
        baseline={"MemoryMax": "8G", "CPUWeight": "150"}, physical_memory=64 * GIB
    )
    assert policy.accept({"MemoryMax": "8G", "CPUWeight": "150"})
    assert policy.accept({"MemoryMax": "10%", "CPUWeight": "1"})


def test_an_idle_cpu_weight_is_the_tightest() -> None:
    # CPUWeight=0 is systemd's idle: only idle tightens it, and a baseline
    # of 0 is one the admin set, not an unknown one.
    policy = RequestPolicy(baseline={"CPUWeight": "0"})
    assert policy.accept({"CPUWeight": "0"})
    error = refusal(policy, CPUWeight="1")
    assert error.errnum == errno.EPERM
    assert "looser than this node's CPUWeight=0" in error.errstr
    assert RequestPolicy(baseline={"CPUWeight": "100"}).accept({"CPUWeight": "0"})


@pytest.mark.parametrize(
    "name",
    [
        "User",
        "Group",
        "DynamicUser",
        "KillMode",
        "SendSIGKILL",
        "TimeoutStopUSec",
        "Type",
        "RemainAfterExit",
        "Slice",
        "Delegate",
        "DeviceAllow",
        "AllowedCPUs",
        "ExecStartPre",
        "StandardOutput",
        "MemoryMaxScale",
        "Environment",
        "AmbientCapabilities",  # (review 36 T2-2: it only ever grants)
        "DelegateControllers",  # delegates, as Delegate=yes does
        "DisableControllers",  # (review 37 R2: the fences' controllers off)
    ],
)
def test_never_allowed_even_when_the_admin_lists_it(name: str) -> None:
    policy = RequestPolicy(allowed=DEFAULT_ALLOWED | {name})
    error = refusal(policy, **{name: "x"})
    assert error.errnum == errno.EPERM
    assert error.errstr.startswith(f"SDEXEC_PROP_{name}: a request can never set")
    with pytest.raises(RequestPropertiesEntryError, match=f"^{name} can never") as bad:
        parse_request_properties(["@default", name])
    assert bad.value.index == 1


@pytest.mark.parametrize("name", ["ExecPaths", "ExecSearchPath"])
def test_an_exec_name_that_is_no_command_may_be_allowed(name: str) -> None:
    # The rule for the commands (ExecStart…) took ExecPaths, hardening a
    # site could then set neither.
    assert never_allowed_reason(name) is None
    policy = RequestPolicy(allowed=DEFAULT_ALLOWED | {name})
    assert policy.accept({name: "/usr"}) == {name: "/usr"}


def test_a_property_not_allowed_names_the_key_that_would_allow_it() -> None:
    error = refusal(POLICY, Nice="5")
    assert error.errnum == errno.EPERM
    assert error.errstr == (
        "SDEXEC_PROP_Nice: requests may not set Nice; an admin may allow it in"
        " [sdexec] request-properties"
    )


UNKNOWN = "unknown property: systemd would refuse every unit with it"


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("MemoryMaxx", "MemoryMax"),
        ("memorymax", "MemoryMax"),
        ("CPUQuota", "CPUQuotaPerSecUSec"),  # systemd-run's spelling
        ("RuntimeMaxSec", "RuntimeMaxUSec"),  # a unit file's
    ],
)
def test_a_name_systemd_does_not_know_is_einval_with_the_name_meant(name, meant):
    # It was EPERM "an admin may allow it": no admin could make it work
    # (review session 35 M1), even with the name listed.
    expected = (errno.EINVAL, f"SDEXEC_PROP_{name}: {UNKNOWN} (did you mean {meant}?)")
    for policy in (POLICY, RequestPolicy(allowed=DEFAULT_ALLOWED | {name})):
        error = refusal(policy, **{name: "1"})
        assert (error.errnum, error.errstr) == expected


def test_an_empty_property_name_is_einval_not_dropped():
    # --setopt SDEXEC_PROP_=64M ran the job without the limit and without a
    # word (review 38 H2-2).
    error = refusal(POLICY, **{"": "64M"})
    assert (error.errnum, error.errstr) == (
        errno.EINVAL,
        "SDEXEC_PROP_: names no property (SDEXEC_PROP_<Name>, as in"
        " SDEXEC_PROP_MemoryMax)",
    )


def test_a_unit_file_spelling_names_what_a_request_can_never_set() -> None:
    error = refusal(POLICY, TimeoutSec="5")
    assert (error.errnum, error.errstr) == (
        errno.EINVAL,
        f"SDEXEC_PROP_TimeoutSec: {UNKNOWN} (did you mean TimeoutStartUSec? a"
        " unit file's TimeoutSec is TimeoutStartUSec and TimeoutStopUSec over"
        " D-Bus, and TimeoutStopUSec is reserved)",
    )


@pytest.mark.parametrize("name", ["ExecFoo", "StandardFoo", "FooScale"])
def test_an_unknown_name_that_can_never_be_allowed_stays_eperm(name: str) -> None:
    error = refusal(POLICY, **{name: "1"})
    assert error.errnum == errno.EPERM
    assert error.errstr.startswith(f"SDEXEC_PROP_{name}: a request can never set")


@pytest.mark.parametrize(
    ("name", "meant"), [("MemoryMaxx", "MemoryMax"), ("CPUQuota", "CPUQuotaPerSecUSec")]
)
def test_the_config_list_refuses_a_name_systemd_does_not_know(name, meant):
    # It loaded, and then let every request setting it reach systemd,
    # which refused the unit.
    with pytest.raises(RequestPropertiesEntryError) as bad:
        parse_request_properties(["@default", name])
    assert str(bad.value) == f"{name}: {UNKNOWN} (did you mean {meant}?)"


def test_every_name_the_policy_names_is_known() -> None:
    for name in (*TIGHTENING, *DEFAULT_ALLOWED, *ALWAYS_ALLOWED, *NEVER_ALLOWED):
        assert is_known_property(name), name


def test_widened_ordered_properties_still_only_tighten() -> None:
    policy = RequestPolicy(allowed=parse_request_properties(["@default", "Nice"]))
    assert policy.accept({"Nice": "5"}) == {"Nice": "5"}
    assert refusal(policy, Nice="-20").errnum == errno.EPERM


def test_a_bad_value_is_einval() -> None:
    error = refusal(POLICY, CPUWeight="lots")
    assert error.errnum == errno.EINVAL
    assert error.errstr == (
        "SDEXEC_PROP_CPUWeight: 'lots' is not a weight from 1 to 10000, or 0 (idle)"
    )
    assert refusal(POLICY, MemoryMax="12Q").errnum == errno.EINVAL


def test_a_percentage_is_compared_as_the_bytes_systemd_holds() -> None:
    # 0.01% goes as the scale UINT32_SCALE_FROM_PERMYRIAD(1), which systemd
    # resolves to whole pages, rounded down: below 0.01% of 64 GiB exactly.
    page = os.sysconf("SC_PAGE_SIZE")
    held = 64 * GIB // page * scale_from_permyriad(1) // (2**32 - 1) * page
    policy = RequestPolicy(baseline={"MemoryMax": str(held)}, physical_memory=64 * GIB)
    assert policy.accept({"MemoryMax": "0.01%"})
    tighter = RequestPolicy(
        baseline={"MemoryMax": str(held - 1)}, physical_memory=64 * GIB
    )
    assert_looser(tighter, "MemoryMax", "0.01%", f"MemoryMax={held - 1}")


@pytest.mark.parametrize(
    ("value", "looser"),
    [
        ("0x20000000", False),  # 512M
        ("0x20000001", True),
        ("01000M", False),  # octal: 512M, as Flux reads it
        ("01001M", True),
        ("0100000000000", True),  # octal 8G, not 100G
        ("0777777777", False),  # octal 128M - 1, not 777M
        ("5.12e2M", False),
        ("5.13e2M", True),
        ("0.5G", False),
        ("0x.8G", False),
        ("0x.81G", True),
        ("536870912.9", False),  # rounded down, as Flux does
        ("536870913", True),
        ("1e9", True),
        ("512m", False),  # lower case and B, kept as sdexec read them
        ("513m", True),
        ("536870913B", True),
    ],
)
def test_a_request_s_memory_limit_is_compared_as_flux_reads_it(value, looser) -> None:
    # Flux's sdexec reads 0x, octal and floating point sizes: each must be
    # compared with the site's cap by the bytes that will be sent.
    policy = RequestPolicy(baseline={"MemoryMax": "512M"})
    if looser:
        assert_looser(policy, "MemoryMax", value, "MemoryMax=512M")
    else:
        assert policy.accept({"MemoryMax": value}) == {"MemoryMax": value}


@pytest.mark.parametrize("name", ["MemoryMax", "MemoryLow"])
@pytest.mark.parametrize("value", ["0x", "nan%", "1e3m", "lots"])
def test_a_request_s_bad_memory_limit_is_told_the_forms(name, value) -> None:
    # It read "is not a memory limit (512M, 50%, infinity)": no word of
    # the hex, octal and floating point sizes Flux's sdexec reads.
    policy = RequestPolicy(allowed=DEFAULT_ALLOWED | {name})
    error = refusal(policy, **{name: value})
    assert (error.errnum, error.errstr) == (
        errno.EINVAL,
        f"SDEXEC_PROP_{name}: {value!r} is not a size (a number (decimal, 0x hex,"
        " 0 octal or floating point), alone or with k, K, M, G, T, P or E), a"
        " percentage up to 100% (two decimals at most) or 'infinity'",
    )


@pytest.mark.parametrize("value", ["3.125%", "0.004%"])
def test_a_percentage_of_more_than_two_decimals_is_einval_saying_so(value) -> None:
    # (review 43 T5-1: 0.004% was tighter than 8G, and no limit after a
    # daemon-reload)
    error = refusal(RequestPolicy(baseline={"MemoryMax": "8G"}), MemoryMax=value)
    assert (error.errnum, error.errstr) == (
        errno.EINVAL,
        f"SDEXEC_PROP_MemoryMax: {value!r} has more than two decimals: systemd"
        " keeps a percentage to 0.01%",
    )


@pytest.mark.parametrize("name", ["CPUWeight", "StartupCPUWeight"])
def test_idle_is_a_cpu_weight_of_zero(name) -> None:
    policy = RequestPolicy(allowed=frozenset({name}), baseline={name: "idle"})
    assert policy.accept({name: "idle"}) and policy.accept({name: "0"})
    assert_looser(policy, name, "1", f"{name}=idle")
    assert RequestPolicy(allowed=frozenset({name})).accept({name: "idle"})


JITTER = frozenset({"RuntimeMaxUSec", "RuntimeRandomizedExtraUSec"})


def test_a_jitter_cannot_lengthen_a_runtime_limit() -> None:
    # systemd adds up to RuntimeRandomizedExtraUSec to RuntimeMaxUSec: 10 min
    # of it let a job run past the site's 2 s (review 43 T5-3).
    policy = RequestPolicy(allowed=JITTER, baseline={"RuntimeMaxUSec": "2000000"})
    error = refusal(policy, RuntimeRandomizedExtraUSec="600000000")
    assert error.errnum == errno.EPERM
    assert (
        "looser than this node's RuntimeRandomizedExtraUSec=0, which lengthens its"
        " RuntimeMaxUSec=2000000; a request may only tighten it"
    ) in error.errstr
    assert policy.accept({"RuntimeRandomizedExtraUSec": "0"})


@pytest.mark.parametrize("infinity", ["infinity", " infinity "])
def test_a_jitter_over_an_infinite_runtime_limit_is_taken(infinity) -> None:
    # Review session 43 R-4: refused as lengthening RuntimeMaxUSec=infinity,
    # which nothing lengthens; with no RuntimeMaxUSec at all it was taken.
    policy = RequestPolicy(allowed=JITTER, baseline={"RuntimeMaxUSec": infinity})
    requested = {"RuntimeRandomizedExtraUSec": "600000000"}
    assert policy.accept(requested) == requested


def test_a_jitter_the_site_sets_over_an_infinite_limit_may_only_shrink() -> None:
    # The site's own jitter is its choice still; the refusal names no
    # limit lengthened, as there is none.
    policy = RequestPolicy(
        allowed=JITTER,
        baseline={"RuntimeMaxUSec": "infinity", "RuntimeRandomizedExtraUSec": "1000"},
    )
    error = refusal(policy, RuntimeRandomizedExtraUSec="1001")
    assert error.errnum == errno.EPERM
    assert (
        "'1001' is looser than this node's RuntimeRandomizedExtraUSec=1000;"
        " a request may only tighten it"
    ) in error.errstr


def test_a_jitter_the_site_sets_may_only_shrink() -> None:
    policy = RequestPolicy(
        allowed=JITTER,
        baseline={"RuntimeMaxUSec": "2000000", "RuntimeRandomizedExtraUSec": "1000000"},
    )
    assert policy.accept({"RuntimeRandomizedExtraUSec": "500000"})
    assert_looser(
        policy,
        "RuntimeRandomizedExtraUSec",
        "1000001",
        "RuntimeRandomizedExtraUSec=1000000",
    )


def test_a_jitter_with_no_runtime_limit_to_lengthen_is_taken() -> None:
    policy = RequestPolicy(allowed=JITTER)
    requested = {"RuntimeMaxUSec": "60000000", "RuntimeRandomizedExtraUSec": "5000000"}
    assert policy.accept(requested) == requested


def test_a_memory_limit_too_large_says_so() -> None:
    # It read "is not a memory limit (512M, 50%, infinity)".
    error = refusal(POLICY, MemoryMax="99999999999999999999G")
    assert (error.errnum, error.errstr) == (
        errno.EINVAL,
        "SDEXEC_PROP_MemoryMax: '99999999999999999999G' is too large (16E or more)",
    )


def test_no_known_baseline_refuses_a_number_but_not_accounting_on() -> None:
    policy = RequestPolicy(
        allowed=parse_request_properties(["TasksMax", "IOAccounting"])
    )
    assert "no baseline TasksMax" in refusal(policy, TasksMax="10").errstr
    assert refusal(policy, IOAccounting="no").errnum == errno.EPERM
    assert policy.accept({"IOAccounting": "yes"})
    with_baseline = RequestPolicy(policy.allowed, baseline={"TasksMax": "4915"})
    assert with_baseline.accept({"TasksMax": "100"})
    assert refusal(with_baseline, TasksMax="infinity").errnum == errno.EPERM


def test_description_is_capped() -> None:
    assert POLICY.accept({"Description": "d" * 1024})
    error = refusal(POLICY, Description="d" * 1025)
    assert error.errnum == errno.EINVAL
    # As a label's or a job id's: the size, not only the bound.
    assert error.errstr == "SDEXEC_PROP_Description: 1025 bytes; at most 1024"
    error = refusal(POLICY, Description="\ud800")
    assert error.errnum == errno.EINVAL
    assert error.errstr.startswith("SDEXEC_PROP_Description: not valid Unicode")


@pytest.mark.parametrize(
    ("value", "index", "message"),
    [
        ([5], 0, "expected a property name"),
        (["@default", "memory max"], 1, "expected a property name"),
        (["@default", "memorymax"], 1, "memorymax: unknown property"),
        (["@default", "MemoryMaxx"], 1, "MemoryMaxx: unknown property"),
    ],
)
def test_config_value_errors_give_the_entry_s_index(value, index, message) -> None:
    # The caller adds it to the key path: the message does not name the
    # key itself (it read "request-properties: request-properties[0]: …").
    with pytest.raises(RequestPropertiesEntryError, match=f"^{message}") as bad:
        parse_request_properties(value)
    assert bad.value.index == index


def test_a_config_value_not_an_array_names_no_key() -> None:
    with pytest.raises(ValueError) as bad:
        parse_request_properties("MemoryMax")
    assert str(bad.value) == 'expected an array of property names, got "MemoryMax"'


def test_config_value() -> None:
    assert parse_request_properties([]) == frozenset()
    assert parse_request_properties(["@default"]) == DEFAULT_ALLOWED
    assert parse_request_properties(["Nice"]) == {"Nice"}


@pytest.mark.parametrize("listed", [[], ["MemoryMax"]])
def test_a_narrowed_list_still_lets_sdexec_run_set_ignoresigpipe(listed) -> None:
    # `sdexec run` sets IgnoreSIGPIPE=no on every run: a site that narrowed
    # the list had every run refused, naming a property nobody had given.
    policy = RequestPolicy(allowed=parse_request_properties(listed))
    assert policy.accept({"IgnoreSIGPIPE": "no"}) == {"IgnoreSIGPIPE": "no"}
    with pytest.raises(RequestRefused) as refused:
        policy.accept({"Description": "x"})
    assert refused.value.errnum == errno.EPERM


def test_the_site_s_ignoresigpipe_stands_unless_the_admin_lets_requests_change_it():
    # Always allowed, it let a request override the admin's own value.
    site = {"IgnoreSIGPIPE": "yes"}
    narrowed = RequestPolicy(allowed=parse_request_properties([]), baseline=site)
    with pytest.raises(RequestRefused) as refused:
        narrowed.accept({"IgnoreSIGPIPE": "no"})
    assert (refused.value.errnum, refused.value.errstr) == (
        errno.EPERM,
        "SDEXEC_PROP_IgnoreSIGPIPE: requests may not set IgnoreSIGPIPE (set to"
        " yes by [exec.sdexec-properties]: a request may only repeat it;"
        " `sdexec run`, which asks for no, runs with it given `--setopt"
        " SDEXEC_PROP_IgnoreSIGPIPE=yes`); an admin may allow it in"
        " [sdexec] request-properties",
    )
    listed = RequestPolicy(allowed=DEFAULT_ALLOWED, baseline=site)
    assert listed.accept({"IgnoreSIGPIPE": "no"}) == {"IgnoreSIGPIPE": "no"}
    # Asked as the site has it (sdexec run's "no" where the site says no):
    # nothing to refuse.
    same = RequestPolicy(allowed=frozenset(), baseline={"IgnoreSIGPIPE": "false"})
    assert same.accept({"IgnoreSIGPIPE": "no"}) == {"IgnoreSIGPIPE": "no"}


@pytest.mark.parametrize("value", ["50", "100"])
def test_a_weight_the_site_unsets_with_infinity_is_tightened_from_the_default(value):
    # "infinity" is documented for the weights (unset: systemd's 100), and
    # every request CPUWeight was refused: "no baseline CPUWeight is known
    # to compare with; the admin sets one" (review session 31 B F5).
    policy = RequestPolicy(baseline={"CPUWeight": "infinity"})
    assert policy.accept({"CPUWeight": value}) == {"CPUWeight": value}
    with pytest.raises(RequestRefused) as refused:
        policy.accept({"CPUWeight": "101"})
    assert refused.value.errstr.startswith(
        "SDEXEC_PROP_CPUWeight: '101' is looser than this node's CPUWeight=infinity"
    )


@pytest.mark.parametrize(
    ("baseline", "accepted"),
    [({}, True), ({"CPUWeight": "200"}, True), ({"CPUWeight": "50"}, False)],
)
def test_a_request_weight_of_infinity_is_ranked_as_the_default(baseline, accepted):
    # "infinity" unsets a weight (systemd's 100 then), as the site may
    # write it; from a request it was EINVAL "not a weight from 1 to 10000"
    # (review 44 cfg), a site's weight of 50 or not.
    policy = RequestPolicy(baseline=baseline)
    if accepted:
        assert policy.accept({"CPUWeight": "infinity"}) == {"CPUWeight": "infinity"}
        return
    with pytest.raises(RequestRefused) as refused:
        policy.accept({"CPUWeight": "infinity"})
    assert refused.value.errnum == errno.EPERM
    assert refused.value.errstr.startswith(
        "SDEXEC_PROP_CPUWeight: 'infinity' is looser than this node's CPUWeight=50"
    )


def test_a_protection_the_site_sets_to_infinity_takes_any_request_value():
    # The weights' "infinity" is unset; a protection's is the most there is
    # (a regression of the weights' fix, review session 31 D F7).
    policy = RequestPolicy(
        allowed=frozenset({"MemoryLow"}), baseline={"MemoryLow": "infinity"}
    )
    assert policy.accept({"MemoryLow": "1G"}) == {"MemoryLow": "1G"}


def test_defaults_are_not_forbidden_and_are_ordered() -> None:
    for name in DEFAULT_ALLOWED:
        assert never_allowed_reason(name) is None
        # Description and IgnoreSIGPIPE grant nothing, whatever the value.
        assert name in TIGHTENING or name in {"Description", "IgnoreSIGPIPE"}


def test_environment_hygiene() -> None:
    env = {
        "PATH": "/bin",
        "NOTIFY_SOCKET": "/run/x",
        "HOME": "/h",
        "MONITOR_SERVICE_RESULT": "x",
        "TRIGGER_TIMER_REALTIME_USEC": "1",
        **dict.fromkeys(DROPPED_ENVIRONMENT, "v"),
        "LANG": "C",
    }
    assert clean_environment(env) == {"PATH": "/bin", "HOME": "/h", "LANG": "C"}
    assert list(clean_environment(env)) == ["PATH", "HOME", "LANG"]
    for name in ("NOTIFY_SOCKET", "INVOCATION_ID", "LISTEN_FDS", "LISTEN_PID"):
        assert name in DROPPED_ENVIRONMENT
    for name in ("LISTEN_FDNAMES", "JOURNAL_STREAM", "MANAGERPID", "SYSTEMD_EXEC_PID"):
        assert name in DROPPED_ENVIRONMENT


names = st.sampled_from(sorted({*TIGHTENING, *NEVER_ALLOWED, "Description", "Nice"}))
values = st.sampled_from(
    [
        *("0", "1", "50", "100", "512M", "8G", "50%", "infinity", "yes", "no"),
        *("-5", "x", "7", "fifo", "idle", "/dev/sda 50", "/dev/sda 200, /dev/sdb 10"),
    ]
)
WIDE = RequestPolicy(allowed=frozenset(TIGHTENING) | {"Description"})


def policy_over(baseline: dict[str, str]) -> RequestPolicy:
    return RequestPolicy(WIDE.allowed, baseline=baseline, physical_memory=64 * GIB)


def comparable(name: str, value: str) -> bool:
    try:
        TIGHTENING[name].rank(value, lambda: 64 * GIB)
    except ValueError:
        return False
    return True


ordered_names = st.sampled_from(sorted(TIGHTENING))
baselines = st.dictionaries(ordered_names, values, max_size=12).map(
    lambda found: {k: v for k, v in found.items() if comparable(k, v)}
)


#: The properties judged together as one setting (the I/O priority).
SETTING_NAMES = {name for name, order in TIGHTENING.items() if order.setting}


def ranked(order: Ordering, value: str) -> float:
    """``value``'s rank, ``infinity`` as the default where it unsets it."""
    if order.unset_by_infinity and value == "infinity":
        value = order.default or value
    return order.rank(value, lambda: 64 * GIB)


def leaves_unbounded(baseline: dict[str, str], limit: str) -> bool:
    """Whether ``baseline`` leaves ``limit`` infinite: unset, or infinity."""
    try:
        rank = TIGHTENING[limit].rank(baseline.get(limit, "infinity"), lambda: GIB)
    except ValueError:
        return False  # not known to be infinite: compared as a limit
    return rank == math.inf


@settings(derandomize=True, max_examples=1000, deadline=None)
@given(st.dictionaries(ordered_names, values, max_size=2), baselines)
def test_a_request_can_never_loosen_the_baseline(
    requested: dict[str, str], baseline: dict[str, str]
) -> None:
    try:
        accepted = policy_over(baseline).accept(requested)
    except RequestRefused as error:
        assert error.errnum in (errno.EPERM, errno.EINVAL)
        assert error.errstr.startswith("SDEXEC_PROP_")
        return
    assert accepted == requested
    for name, value in accepted.items():
        order = TIGHTENING[name]
        if order.setting is not None:
            together = {n: v for n, v in accepted.items() if n in SETTING_NAMES}
            ours = order.setting({**baseline, **together})
            assert ours.rank <= order.setting(baseline).rank
            continue
        if order.overrides:
            for weight in re.findall(r" ([0-9]+)", value):
                assert all(
                    TIGHTENING[over].rank(weight, lambda: GIB)
                    <= ranked(TIGHTENING[over], baseline.get(over, "100"))
                    for over in order.overrides
                )
            continue
        if (
            order.lengthens
            and name not in baseline
            and leaves_unbounded(baseline, order.lengthens)
        ):
            continue  # a jitter where there is no limit to lengthen
        base = baseline.get(name, order.default)
        rank = ranked(order, value)
        if base is None:  # only an accounting switch turned on, the tightest
            assert name.endswith("Accounting") and rank == 0
        else:
            assert rank <= ranked(order, base)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.dictionaries(names | any_text, values | any_text, max_size=4))
def test_any_text_is_refused_cleanly_or_accepted(requested: dict[str, str]) -> None:
    try:
        accepted = WIDE.accept(requested)
        # all but what only repeats sdexec's own value
        assert accepted.items() <= requested.items()
        assert requested.keys() - accepted.keys() <= SDEXEC_FIXED.keys()
    except RequestRefused as error:
        assert error.errnum in (errno.EPERM, errno.EINVAL)
        error.errstr.encode("utf-8")


NOTIFY_READY = """
import os, socket
address = os.environ["NOTIFY_SOCKET"]
if address.startswith("@"):
    address = "\\0" + address[1:]
socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"READY=1", address)
os.execvp("env", ["env"])
"""

# What a user manager adds to a job's environment on its own: the user's
# basics, which a client legitimately passes too, and nothing else.
USER_BASICS = {"HOME", "LANG", "PATH", "SHELL", "USER", "LOGNAME", "TERM"}
USER_BASICS |= {"XDG_RUNTIME_DIR", "PWD", "SHLVL", "_", "OLDPWD"}


@pytest.mark.systemd
def test_every_variable_the_manager_adds_is_dropped_or_a_user_basic(
    user_manager,
) -> None:
    """Runs a notify service with a watchdog (the richest environment
    systemd gives) and checks that every variable it has and its manager
    has not is either dropped or one of the user's basics."""

    def environment(*command: str) -> set[str]:
        output = subprocess.run(
            command, capture_output=True, text=True, timeout=60, check=True
        ).stdout
        return {line.partition("=")[0] for line in output.splitlines() if "=" in line}

    manager = environment("systemctl", "--user", "show-environment")
    job = environment(
        *("systemd-run", "--user", "--quiet", "--wait", "--pipe"),
        *("-p", "Type=notify", "-p", "NotifyAccess=all", "-p", "WatchdogSec=100"),
        # READY=1 from Python: a node may have systemd without systemd-notify
        # (the GPU node's carried systemd is the manager and systemd-run).
        # Sent by the main process, which then becomes `env`: a child's
        # READY=1 was lost when the child was gone before the loaded
        # manager read it (the unit then failed, "protocol").
        *(sys.executable, "-c", NOTIFY_READY),
    )
    # The manager adds DBUS_SESSION_BUS_ADDRESS to its own environment once
    # it is on its bus, which a fresh sandbox's may reach only during the
    # job: what it has after the job is its too.
    manager |= environment("systemctl", "--user", "show-environment")
    added = job - manager - USER_BASICS
    assert "INVOCATION_ID" in added and "NOTIFY_SOCKET" in added
    assert added <= DROPPED_ENVIRONMENT, added - DROPPED_ENVIRONMENT


@pytest.mark.parametrize(
    ("name", "site", "requested"),
    [
        ("LimitNOFILE", "1024", "infinity"),
        ("LimitMEMLOCK", "64K", "1M"),
        ("LimitNICE", "20", "40"),
        ("MemoryZSwapMax", "1G", "infinity"),
        ("StartupMemoryMax", "8G", "16G"),
        ("StartupMemoryLow", "1G", "2G"),  # a protection: more takes from others
        ("DefaultMemoryMin", "0", "10%"),
    ],
)
def test_a_newly_ordered_limit_only_tightens(name: str, site: str, requested: str):
    # Allowed by an admin, a request's LimitNOFILE=infinity replaced the
    # site's 1024: a hard resource limit or a memory size is ordered too.
    policy = RequestPolicy(
        allowed=frozenset({name}), baseline={name: site}, physical_memory=64 * GIB
    )
    assert_looser(policy, name, requested, f"{name}={site}")


def test_a_soft_hard_limit_tightens_by_its_hard_one_and_is_split() -> None:
    # systemd.exec(5)'s SOFT:HARD was refused as "not a number or infinity"
    # (review session 46); allowed by its name, it becomes both properties.
    policy = RequestPolicy(
        allowed=frozenset({"LimitNOFILE"}), baseline={"LimitNOFILE": "1000"}
    )
    assert policy.accept({"LimitNOFILE": "5:10"}) == {
        "LimitNOFILESoft": "5",
        "LimitNOFILE": "10",
    }
    # The hard limit may not loosen the site's, whatever the soft one.
    assert_looser(policy, "LimitNOFILE", "5:2000", "LimitNOFILE=1000")
    assert refusal(policy, LimitNOFILE="5:2000").errstr.startswith(
        "SDEXEC_PROP_LimitNOFILE: "
    )
    error = refusal(policy, LimitNOFILE="10:5")
    assert error.errnum == errno.EINVAL
    assert error.errstr.startswith("SDEXEC_PROP_LimitNOFILE: error setting property:")
    assert "'10:5': the soft limit is above the hard one" in error.errstr


def test_a_hard_resource_limit_needs_the_site_s_to_compare_with() -> None:
    policy = RequestPolicy(allowed=frozenset({"LimitNOFILE", "LimitNOFILESoft"}))
    error = refusal(policy, LimitNOFILE="1024")
    assert error.errnum == errno.EPERM
    assert "no baseline LimitNOFILE is known" in error.errstr
    # A soft limit restricts nothing (the process may raise it to the hard)
    assert policy.accept({"LimitNOFILESoft": "512"}) == {"LimitNOFILESoft": "512"}
    tighter = RequestPolicy(
        allowed=frozenset({"LimitMEMLOCK"}), baseline={"LimitMEMLOCK": "1M"}
    )
    assert tighter.accept({"LimitMEMLOCK": "64K"}) == {"LimitMEMLOCK": "64K"}


@pytest.mark.parametrize(
    ("name", "steady", "site", "requested"),
    [
        ("StartupMemoryMax", "MemoryMax", "8G", "infinity"),
        ("StartupMemorySwapMax", "MemorySwapMax", "0", "1G"),
        ("StartupMemoryLow", "MemoryLow", "1G", "2G"),
        ("StartupCPUWeight", "CPUWeight", "10", "100"),
        ("StartupIOWeight", "IOWeight", "10", "100"),
    ],
)
def test_a_startup_limit_compares_with_the_steady_one_the_site_sets(
    name: str, steady: str, site: str, requested: str
) -> None:
    # (review 37 R1) systemd applies StartupMemoryMax, where a unit sets it,
    # instead of MemoryMax while the manager starts or stops: compared with
    # its own default (infinity), a request lifted the site's cap then.
    policy = RequestPolicy(
        allowed=frozenset({name}), baseline={steady: site}, physical_memory=64 * GIB
    )
    assert_looser(policy, name, requested, f"{steady}={site}")
    both = RequestPolicy(
        allowed=frozenset({name}),
        baseline={steady: site, name: requested},
        physical_memory=64 * GIB,
    )
    assert both.accept({name: requested}) == {name: requested}


@pytest.mark.parametrize("name", ["SocketBindDeny", "OpenFile", "MemoryLimit"])
def test_request_properties_refuses_a_name_refused_whatever_its_value(name: str):
    # (review 37 R4) Loaded, it let every request with it be EINVAL.
    with pytest.raises(RequestPropertiesEntryError, match=f"^{name}: ") as bad:
        parse_request_properties(["@default", name])
    assert bad.value.index == 1


@pytest.mark.parametrize(
    ("name", "site", "looser", "tighter"),
    [
        ("NoNewPrivileges", "yes", "no", "yes"),
        ("PrivateTmp", "true", "0", "on"),
        ("ProtectSystem", "full", "yes", "strict"),
        ("ProtectSystem", "yes", "false", "full"),
        ("ProtectHome", "tmpfs", "read-only", "yes"),
    ],
)
def test_a_hardening_setting_only_tightens(
    name: str, site: str, looser: str, tighter: str
) -> None:
    # Allowed by an admin, a request's NoNewPrivileges=no replaced the
    # site's yes: the hardening switches and levels are ordered.
    policy = RequestPolicy(allowed=frozenset({name}), baseline={name: site})
    assert_looser(policy, name, looser, f"{name}={site}")
    assert policy.accept({name: tighter}) == {name: tighter}
    # Where the site sets none, systemd's default (off) is the baseline.
    unset = RequestPolicy(allowed=frozenset({name}))
    assert unset.accept({name: looser}) == {name: looser}


def test_a_hardening_level_that_is_none_is_einval() -> None:
    policy = RequestPolicy(allowed=frozenset({"ProtectSystem"}))
    error = refusal(policy, ProtectSystem="bogus")
    assert error.errnum == errno.EINVAL
    assert "is not one of no, yes, full, strict" in error.errstr


def test_private_pids_is_a_hardening_switch() -> None:
    # (review 37 V1) systemd 257's PrivatePIDs, a string of yes or no.
    policy = RequestPolicy(
        allowed=frozenset({"PrivatePIDs"}), baseline={"PrivatePIDs": "yes"}
    )
    assert_looser(policy, "PrivatePIDs", "no", "PrivatePIDs=yes")


@pytest.mark.parametrize(
    ("site", "requested", "looser"),
    [
        ({}, "/dev/sda 200", "'/dev/sda 200' is looser than this node's IOWeight=100"),
        (
            {"IOWeight": "50"},
            "/dev/sda 40, /dev/nvme0n1 60",
            "'/dev/nvme0n1 60' is looser than this node's IOWeight=50",
        ),
        # systemd applies a device's weight while the manager starts or
        # stops too, when the site's StartupIOWeight is the unit's.
        (
            {"IOWeight": "50", "StartupIOWeight": "20"},
            "/dev/sda 30",
            "'/dev/sda 30' is looser than this node's StartupIOWeight=20",
        ),
        (
            {"IOWeight": "infinity"},
            "/dev/sda 101",
            "'/dev/sda 101' is looser than this node's IOWeight=infinity",
        ),
    ],
)
def test_a_device_weight_is_no_heavier_than_the_unit_s_io_weight(
    site: dict[str, str], requested: str, looser: str
) -> None:
    # Allowed by an admin, a request's IODeviceWeight=/dev/sda 10000 gave
    # the job the whole device over the site's IOWeight=50.
    policy = RequestPolicy(allowed=frozenset({"IODeviceWeight"}), baseline=site)
    error = refusal(policy, IODeviceWeight=requested)
    assert error.errnum == errno.EPERM
    assert error.errstr.startswith(f"SDEXEC_PROP_IODeviceWeight: {looser}; ")
    assert CONFIG_KEY in error.errstr


def test_a_device_weight_as_heavy_as_the_io_weight_is_accepted() -> None:
    # The startup twin the site leaves unset is its steady IOWeight.
    policy = RequestPolicy(
        allowed=frozenset({"IODeviceWeight"}), baseline={"IOWeight": "50"}
    )
    accepted = {"IODeviceWeight": "/dev/sda 50, /dev/sdb 1"}
    assert policy.accept(accepted) == accepted
    assert RequestPolicy(allowed=frozenset({"IODeviceWeight"})).accept(
        {"IODeviceWeight": "/dev/sda 100"}
    )
    error = refusal(policy, IODeviceWeight="/dev/sda")
    assert error.errnum == errno.EINVAL
    assert "is not a list of 'PATH WEIGHT'" in error.errstr


CPU_SCHEDULING = frozenset(
    {"CPUSchedulingPolicy", "CPUSchedulingPriority", "CPUSchedulingResetOnFork"}
)


@pytest.mark.parametrize(
    ("site", "name", "looser", "tighter"),
    [
        ({}, "CPUSchedulingPolicy", "fifo", "batch"),
        ({}, "CPUSchedulingPolicy", "2", "5"),  # rr; idle
        ({"CPUSchedulingPolicy": "batch"}, "CPUSchedulingPolicy", "other", "idle"),
        ({"CPUSchedulingPolicy": "3"}, "CPUSchedulingPolicy", "0", "5"),
        ({"CPUSchedulingPolicy": "idle"}, "CPUSchedulingPolicy", "batch", "idle"),
        ({}, "CPUSchedulingPriority", "1", "0"),
        (
            {"CPUSchedulingPolicy": "fifo", "CPUSchedulingPriority": "50"},
            "CPUSchedulingPriority",
            "51",
            "10",
        ),
        ({"CPUSchedulingResetOnFork": "yes"}, "CPUSchedulingResetOnFork", "no", "1"),
    ],
)
def test_cpu_scheduling_only_tightens(
    site: dict[str, str], name: str, looser: str, tighter: str
) -> None:
    # Allowed by an admin, a request's CPUSchedulingPolicy=fifo outranked
    # every other process on the node, whatever the site's Nice.
    policy = RequestPolicy(allowed=CPU_SCHEDULING, baseline=site)
    shown = site.get(name, {"CPUSchedulingPolicy": "other"}.get(name, "0"))
    assert_looser(policy, name, looser, f"{name}={shown}")
    assert policy.accept({name: tighter}) == {name: tighter}


def test_realtime_policies_rank_alike() -> None:
    policy = RequestPolicy(
        allowed=CPU_SCHEDULING,
        baseline={"CPUSchedulingPolicy": "rr", "CPUSchedulingPriority": "50"},
    )
    requested = {"CPUSchedulingPolicy": "fifo", "CPUSchedulingPriority": "50"}
    assert policy.accept(requested) == requested
    # Where the site sets none, a child may keep its parent's policy.
    unset = RequestPolicy(allowed=CPU_SCHEDULING)
    for value in ("yes", "no"):
        assert unset.accept({"CPUSchedulingResetOnFork": value})
    error = refusal(policy, CPUSchedulingPolicy="fifoo")
    assert error.errnum == errno.EINVAL
    assert "is not one of idle, batch, other, fifo, rr" in error.errstr


IO_SCHEDULING = frozenset({"IOSchedulingClass", "IOSchedulingPriority"})


@pytest.mark.parametrize(
    ("site", "requested", "looser"),
    [
        # The kernel's, with no I/O priority set: best-effort at
        # (nice + 20) / 5.
        (
            {},
            {"IOSchedulingPriority": "3"},
            "IOSchedulingPriority=3 (I/O class best-effort, priority 3) is looser"
            " than this node's I/O class best-effort, priority 4 (the kernel's,"
            " from the default Nice=0: no IOSchedulingClass or IOSchedulingPriority"
            " is set)",
        ),
        ({}, {"IOSchedulingClass": "realtime"}, "realtime, priority 4) is looser"),
        ({}, {"IOSchedulingClass": "1"}, "realtime, priority 4) is looser"),
        # best-effort alone is systemd's priority 4, above the kernel's 7.
        (
            {"Nice": "19"},
            {"IOSchedulingClass": "best-effort"},
            "priority 7 (the kernel's, from Nice=19:",
        ),
        (
            {"CPUSchedulingPolicy": "idle"},
            {"IOSchedulingPriority": "7"},
            "than this node's I/O class idle (the kernel's, from"
            " CPUSchedulingPolicy=idle:",
        ),
        # A class of none, sent after the site's priority, resets it to 4.
        (
            {"IOSchedulingPriority": "7"},
            {"IOSchedulingClass": "none"},
            "IOSchedulingClass=none (I/O class best-effort, priority 4) is looser"
            " than this node's I/O class best-effort, priority 7"
            " (IOSchedulingPriority=7)",
        ),
        (
            {"IOSchedulingClass": "idle"},
            {"IOSchedulingClass": "2"},
            "than this node's I/O class idle (IOSchedulingClass=idle)",
        ),
        (
            {"IOSchedulingClass": "best-effort", "IOSchedulingPriority": "2"},
            {"IOSchedulingPriority": "0"},
            "best-effort, priority 0) is looser",
        ),
    ],
)
def test_the_io_priority_only_tightens(
    site: dict[str, str], requested: dict[str, str], looser: str
) -> None:
    # Allowed by an admin, a request's IOSchedulingPriority=0 put the job's
    # I/O ahead of every other job's (no privilege needed for best-effort).
    policy = RequestPolicy(allowed=IO_SCHEDULING, baseline=site)
    error = refusal(policy, **requested)
    assert error.errnum == errno.EPERM
    assert error.errstr.startswith(f"SDEXEC_PROP_{next(iter(requested))}: ")
    assert looser in error.errstr and CONFIG_KEY in error.errstr


@pytest.mark.parametrize(
    ("site", "requested"),
    [
        ({}, {"IOSchedulingPriority": "4"}),
        ({}, {"IOSchedulingClass": "none"}),
        ({}, {"IOSchedulingClass": "idle", "IOSchedulingPriority": "0"}),
        (
            {"Nice": "19"},
            {"IOSchedulingClass": "best-effort", "IOSchedulingPriority": "7"},
        ),
        ({"Nice": "19"}, {"IOSchedulingPriority": "7"}),
        ({"IOSchedulingPriority": "7"}, {"IOSchedulingClass": "best-effort"}),
        ({"IOSchedulingClass": "realtime"}, {"IOSchedulingClass": "rEaLtImE"}),
        (
            {"IOSchedulingClass": "realtime"},
            {"IOSchedulingClass": "2", "IOSchedulingPriority": "0"},
        ),
        (
            {"CPUSchedulingPolicy": "fifo", "CPUSchedulingPriority": "1"},
            {"IOSchedulingClass": "realtime"},
        ),
    ],
)
def test_an_io_priority_no_looser_is_accepted(
    site: dict[str, str], requested: dict[str, str]
) -> None:
    policy = RequestPolicy(allowed=IO_SCHEDULING, baseline=site)
    assert policy.accept(requested) == requested


def test_an_io_priority_that_is_none_is_einval() -> None:
    policy = RequestPolicy(allowed=IO_SCHEDULING)
    error = refusal(policy, IOSchedulingPriority="8", IOSchedulingClass="idle")
    assert error.errnum == errno.EINVAL
    assert (
        error.errstr
        == "SDEXEC_PROP_IOSchedulingPriority: '8' is not a priority from 0 to 7"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TimeoutStopUSec", "infinity"),
        ("SendSIGKILL", "no"),
        ("SendSIGKILL", "false"),
        ("KillMode", "control-group"),
        ("Type", "exec"),
        ("RemainAfterExit", "yes"),
    ],
)
def test_repeating_sdexecs_own_value_is_a_no_op(name: str, value: str) -> None:
    # Flux's job-exec sends TimeoutStopUSec=infinity with a multiuser job:
    # every unit has it, so it loosens nothing; it is left to sdexec's.
    requested = {name: value, "MemoryMax": "1G"}
    assert POLICY.accept(requested) == {"MemoryMax": "1G"}


@pytest.mark.parametrize(
    ("name", "value", "fixed"),
    [
        ("TimeoutStopUSec", "5s", "infinity"),
        ("TimeoutStopUSec", "0", "infinity"),
        ("SendSIGKILL", "yes", "no"),
        ("KillMode", "mixed", "control-group"),
        ("RemainAfterExit", "no", "yes"),
    ],
)
def test_another_value_of_sdexecs_own_is_refused_naming_both(
    name: str, value: str, fixed: str
) -> None:
    error = refusal(POLICY, **{name: value})
    assert error.errnum == errno.EPERM
    assert error.errstr.startswith(f"SDEXEC_PROP_{name}: a request can never set")
    assert f"every unit has {name}={fixed}" in error.errstr
    assert f"not {name}={value}" in error.errstr


def test_a_long_value_of_sdexecs_own_is_quoted_as_any_value() -> None:
    # Cut at 64 characters, without its length, where every other value a
    # refusal quotes is cut at refusal.SHOWN with it.
    value = "y" * 5000
    error = refusal(POLICY, SendSIGKILL=value)
    assert error.errstr.endswith(f"not SendSIGKILL={'y' * SHOWN}… (5000 chars)")


@pytest.mark.parametrize(
    ("name", "value"), [("KillMode", "process"), ("Type", "notify")]
)
def test_upstreams_multiuser_request_is_told_what_to_send(name: str, value: str):
    # job-exec's exec_cmd.c asks these of a multiuser (IMP) job under sdexec.
    error = refusal(POLICY, **{name: value})
    assert error.errnum == errno.EPERM
    assert "\n" not in error.errstr
    assert "sdexec's units are Type=exec and KillMode=control-group" in error.errstr
    assert "its stop timer signals every process of the unit" in error.errstr
    assert "SDEXEC_STOP_TIMER_SEC and SDEXEC_STOP_TIMER_SIGNAL" in error.errstr
    assert 'docs/design.md, "How a unit ends: the stop timer"' in error.errstr


def test_sdexecs_own_values_are_those_every_unit_gets() -> None:
    # What a repeating request is dropped for must be what the unit has.
    sent = unit_properties(Command(["/"], cwd="/"), exec_line("/", ["/"]))
    own = {p.name: (p.signature, p.value) for p in sent}
    for name, fixed in SDEXEC_FIXED.items():
        assert name in NEVER_ALLOWED
        typed = typed_property(name, fixed)
        if name in lifecycle_properties():
            assert lifecycle_properties()[name] == fixed
        else:
            assert own[name] == (typed.signature, typed.value)
