"""How a file's keys and values are written: keys with dots, the forms Flux's
job-exec takes for the keys it reads too, YAML read as TOML would be, and
what the stats report (review session 43 G2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sdexec.config import ConfigError, load_config, parse_config
from sdexec.fluxforms import FLUX_SIGNAL_NAMES, flux_refusals

EX_CONFIG = os.EX_CONFIG  # 78: the units do not restart the service


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refusal(tmp_path: Path, name: str, text: str) -> str:
    """Why the file ``name`` of ``text`` is refused, without the file's path."""
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    return str(error.value).removeprefix(f"{path}: ")


# --- G2-1: a key with dots at the top level ---------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "exec.kill-timeout: 30s\n",
            "exec.kill-timeout: a dotted key is not nested in YAML: write"
            ' "kill-timeout:" indented under "exec:"',
        ),
        (
            "sdexec.allow-users: [0]\n",
            "sdexec.allow-users: a dotted key is not nested in YAML: write"
            ' "allow-users:" indented under "sdexec:"',
        ),
        (
            "Systemd.enable: true\n",
            "Systemd.enable: a dotted key is not nested in YAML: write"
            ' "enable:" indented under "systemd:"',
        ),
        (
            "exec.testexec.allow-guests: true\n",
            "exec.testexec.allow-guests: a dotted key is not nested in YAML:"
            ' write "allow-guests:" indented under "testexec:", under "exec:"',
        ),
    ],
)
def test_a_dotted_yaml_key_is_refused_with_the_nested_form(tmp_path, text, expected):
    # It was one top-level key, ignored as an unknown table with a warning:
    # the defaults stayed in force and the file was called valid.
    assert refusal(tmp_path, "c.yaml", text) == expected


def test_a_quoted_dotted_toml_key_is_refused_with_the_nested_form(tmp_path):
    text = '"exec.max-kill-timeout" = "30m"\n'
    assert refusal(tmp_path, "c.toml", text) == (
        '"exec.max-kill-timeout": a quoted dotted key is one key, not nested:'
        " write max-kill-timeout in [exec], or the key unquoted"
    )


def test_a_dotted_key_of_a_table_not_ours_is_still_ignored(tmp_path):
    path = write(tmp_path, "c.yaml", "resource.noverify: true\n")
    assert load_config(path).warnings == (
        f"{path}: ignoring unknown table [resource.noverify]",
    )


def test_the_service_refuses_to_start_on_a_dotted_key(tmp_path, capsys):
    from twisted.plugins.sdexec_plugin import Options, SdexecServiceMaker

    config = write(tmp_path, "sdexec.yaml", "exec.kill-timeout: 30s\n")
    options = Options()
    options.parseOptions(["--config", str(config)])
    with pytest.raises(SystemExit) as exited:
        SdexecServiceMaker().makeService(options)
    assert exited.value.code == EX_CONFIG
    assert "exec.kill-timeout: a dotted key is not nested" in capsys.readouterr().err


# --- G2-2: values Flux's job-exec would refuse -----------------------------

REFUSED = "Flux's job-exec would refuse the file"
IF_SHARED = "if Flux reads this file too"


@pytest.mark.parametrize(
    ("key", "value", "why", "written"),
    [
        ("kill-timeout", 5, "it reads this key as a string only", '"5s"'),
        ("max-kill-timeout", 1800, "it reads this key as a string only", '"30m"'),
        ("barrier-timeout", 0, "it reads this key as a string only", '"0s"'),
        ("shell-exit-timeout", 30, "it reads this key as a string only", '"30s"'),
        ("term-signal", 15, "it reads this key as a string only", '"SIGTERM"'),
        ("term-signal", "term", "it knows a signal only by a name", '"SIGTERM"'),
        ("kill-signal", "SIGIOT", "it knows a signal only by a name", '"SIGABRT"'),
        ("kill-signal", "SIGRTMIN+2", "it knows a signal only by a name", None),
        (
            "sdexec-stop-timer-signal",
            "SIGKILL",
            "it reads this key as an integer only",
            "9",
        ),
        (
            "sdexec-stop-timer-signal",
            "10",
            "it reads this key as an integer only",
            "10",
        ),
    ],
)
def test_a_value_flux_would_refuse_is_warned_about(key, value, why, written):
    config = parse_config({"exec": {key: value}}, "exec.toml")
    (warning,) = config.warnings
    assert warning.startswith(f"exec.toml: exec.{key}: ")
    assert f": {REFUSED}: {why}" in warning
    assert warning.endswith(f"{IF_SHARED}")
    if written is not None:
        assert f"; write {written} {IF_SHARED}" in warning
    assert "\n" not in warning


NOTHING_AFTER = (
    "it reads a duration as a number and a unit only"
    " (ASCII white space before them at most)"
)


@pytest.mark.parametrize(
    ("key", "value", "written"),
    [
        ("kill-timeout", "5s ", '"5s"'),
        ("max-kill-timeout", "30m\n", '"30m"'),
        ("barrier-timeout", "0\t", '"0s"'),
        ("shell-exit-timeout", "1.5 ", '"1.5s"'),
        # strtod skips only C's white space before the number
        ("kill-timeout", "\u00a05s", '"5s"'),
    ],
)
def test_a_duration_flux_would_not_parse_is_warned_about(key, value, written):
    # Review session 43 R-2: any string passed, where flux-core's
    # fsd_parse_duration refuses what follows the unit ("5s ").
    (warning,) = parse_config({"exec": {key: value}}, "exec.toml").warnings
    assert f": {REFUSED}: {NOTHING_AFTER}; write {written} {IF_SHARED}" in warning
    assert "\n" not in warning


def test_a_realtime_signal_is_advised_by_its_number():
    (warning,) = parse_config({"exec": {"kill-signal": "SIGRTMIN+2"}}).warnings
    number = parse_config({"exec": {"kill-signal": "SIGRTMIN+2"}}).exec.kill_signal
    assert f'write "{number}" {IF_SHARED}' in warning


@pytest.mark.parametrize(
    "table",
    [
        {"kill-timeout": "5s", "max-kill-timeout": "30m", "barrier-timeout": "0"},
        {"shell-exit-timeout": "none", "term-signal": "SIGTERM"},
        {"term-signal": "TERM", "kill-signal": "9", "sdexec-stop-timer-signal": 9},
        {"kill-signal": " 9", "max-kill-count": 4, "max-start-delay-percent": 25},
        {
            "kill-timeout": " 5s",
            "max-kill-timeout": "\t1.5e1m",
            "barrier-timeout": "5.",
        },
    ],
)
def test_the_forms_flux_takes_are_not_warned_about(table):
    assert parse_config({"exec": table}, "exec.toml").warnings == ()


def test_a_yaml_file_is_not_warned_about(tmp_path):
    # Flux reads TOML only: a YAML file is sdexec's alone.
    path = write(tmp_path, "c.yaml", "exec:\n  kill-timeout: 5\n  term-signal: 15\n")
    assert load_config(path).warnings == ()


def test_flux_signal_names_are_this_systems_signals():
    import signal

    assert FLUX_SIGNAL_NAMES.issubset(signal.Signals.__members__)


def test_flux_refusals_reads_only_the_keys_flux_reads():
    assert flux_refusals({"max-kill-count": 4, "testexec": {}}, "c.toml") == ()


# --- G2-3: YAML read as TOML reads the same file ----------------------------


@pytest.mark.parametrize(
    ("text", "key", "octal", "decimal"),
    [
        (
            "exec:\n  sdexec-stop-timer-sec: 0640\n",
            "exec.sdexec-stop-timer-sec",
            416,
            640,
        ),
        ("exec:\n  max-kill-count: 010\n", "exec.max-kill-count", 8, 10),
        ("sdexec:\n  max-connections: 0100\n", "sdexec.max-connections", 64, 100),
    ],
)
def test_a_yaml_integer_with_a_leading_zero_is_refused(
    tmp_path, text, key, octal, decimal
):
    written = text.split(": ")[-1].strip(" []\n").split(", ")[-1]
    assert refusal(tmp_path, "c.yaml", text) == (
        f"{key}: {written} has a leading zero, which YAML 1.1 reads as octal"
        f" ({octal}), YAML 1.2 as decimal and TOML not at all: write {decimal},"
        f' or quote it ("{written}") where a string is meant'
    )


def test_a_yaml_base_60_integer_is_refused(tmp_path):
    assert refusal(tmp_path, "c.yaml", "exec:\n  kill-timeout: 1:30\n") == (
        "exec.kill-timeout: 1:30 is a base-60 number to YAML 1.1 (90), a string"
        " to YAML 1.2 and an error in TOML: write 90, or quote it where a string"
        " is meant"
    )


@pytest.mark.parametrize(
    ("text", "key", "written", "value"),
    [
        ("exec:\n  kill-timeout: 1:30.5\n", "exec.kill-timeout", "1:30.5", "90.5"),
        (
            "exec:\n  max-start-delay-percent: -1:00.0\n",
            "exec.max-start-delay-percent",
            "-1:00.0",
            "-60.0",
        ),
    ],
)
def test_a_yaml_base_60_float_is_refused(tmp_path, text, key, written, value):
    # Review session 43 R-3: 1:30.5 was read silently as 90.5 seconds.
    assert refusal(tmp_path, "c.yaml", text) == (
        f"{key}: {written} is a base-60 number to YAML 1.1 ({value}), a string"
        f" to YAML 1.2 and an error in TOML: write {value}, or quote it where a"
        " string is meant"
    )


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (
            "sdexec:\n  allow-users: [0, 0100]\n",
            "sdexec.allow-users[1]: 0100 has a leading zero, which YAML 1.1 reads"
            " as octal (64), YAML 1.2 as decimal and TOML not at all: quote it"
            ' ("0100", or "100")',
        ),
        (
            "exec:\n  sdexec-properties:\n    RuntimeMaxUSec: 1:30:00\n",
            "exec.sdexec-properties.RuntimeMaxUSec: 1:30:00 is a base-60 number"
            " to YAML 1.1 (5400), a string to YAML 1.2 and an error in TOML:"
            ' quote it ("1:30:00", or "5400")',
        ),
        (
            "exec:\n  sdexec-properties:\n    CPUWeight: 1:40.\n",
            "exec.sdexec-properties.CPUWeight: 1:40. is a base-60 number to YAML"
            " 1.1 (100.0), a string to YAML 1.2 and an error in TOML: quote it"
            ' ("1:40.", or "100.0")',
        ),
    ],
)
def test_a_yaml_number_in_a_table_of_strings_is_named_and_advised_quoted(
    tmp_path, text, refused
):
    # Review session 43 R2-5: named the table, not the entry, and advised a
    # bare number, which a property value or a user name cannot be.
    assert refusal(tmp_path, "c.yaml", text) == refused


def test_a_yaml_base_60_float_in_a_table_not_ours_is_not_refused(tmp_path):
    path = write(tmp_path, "c.yaml", "resource:\n  at: 1:30.5\n")
    assert load_config(path).warnings == (f"{path}: ignoring unknown table [resource]",)


@pytest.mark.parametrize("text", ["._e1", "-._e1", "+._E5"])
def test_a_point_and_underscore_before_an_exponent_is_a_string(tmp_path, text):
    # Review session 43 R-3: resolved as a float, pyyaml failed on it
    # ("could not convert string to float: '.e1'"), naming no key.
    reason = refusal(tmp_path, "c.yaml", f"exec:\n  max-start-delay-percent: {text}\n")
    assert reason == (
        f'exec.max-start-delay-percent: expected a finite number, got "{text}"'
    )
    path = write(tmp_path, "ok.yaml", f"resource:\n  x: {text}\n")
    load_config(path)


def test_a_yaml_socket_mode_with_a_leading_zero_keeps_its_own_hint(tmp_path):
    reason = refusal(tmp_path, "c.yaml", "sdexec:\n  socket-mode: 0600\n")
    assert reason.endswith("got 384 (the number 0600 in octal: quote it)")


def test_plain_yaml_integers_are_read_as_before(tmp_path):
    text = "exec:\n  max-kill-count: 0\nsdexec:\n  max-connections: 1_000\n"
    assert "max-kill-count: expected an integer" in refusal(tmp_path, "c.yaml", text)
    path = write(tmp_path, "ok.yaml", "sdexec:\n  max-connections: 1_000\n")
    assert load_config(path).sdexec.max_connections == 1000


def test_a_leading_zero_in_a_table_not_ours_is_not_refused(tmp_path):
    path = write(tmp_path, "c.yaml", "resource:\n  mode: 0640\n")
    assert load_config(path).warnings == (f"{path}: ignoring unknown table [resource]",)


@pytest.mark.parametrize(
    ("yaml_value", "toml_value", "expected"),
    [("1e2", "1e2", 100.0), ("2.5e1", "2.5e1", 25.0), ("1E+1", "1E+1", 10.0)],
)
def test_a_yaml_float_in_exponent_form_is_read_as_toml_reads_it(
    tmp_path, yaml_value, toml_value, expected
):
    yml = write(tmp_path, "c.yaml", f"exec:\n  max-start-delay-percent: {yaml_value}\n")
    toml = write(
        tmp_path, "c.toml", f"[exec]\nmax-start-delay-percent = {toml_value}\n"
    )
    assert load_config(yml).exec.max_start_delay_percent == expected
    assert load_config(toml).exec.max_start_delay_percent == expected


def test_a_yaml_table_of_comments_only_is_an_empty_table(tmp_path):
    # Read as null, it was "exec: expected a table, got null": the start
    # was refused, where TOML's [exec] with the same comments is fine.
    text = (
        "exec:\n  # kill-timeout: 5s\n"
        "  sdexec-properties:\n    # MemoryMax: 90%\n"
        "  testexec:\n    # allow-guests: true\n"
        "sdexec:\n  # rank: 0\n"
        "systemd:\n  # enable: true\n"
    )
    config = load_config(write(tmp_path, "c.yaml", text))
    toml = load_config(write(tmp_path, "c.toml", "[exec]\n[sdexec]\n[systemd]\n"))
    assert (config.exec, config.sdexec, config.systemd) == (
        toml.exec,
        toml.sdexec,
        toml.systemd,
    )


# --- G2-4: what the stats report ------------------------------------------


def test_a_configured_imp_and_properties_are_in_bulk_exec_config():
    config = parse_config(
        {
            "exec": {
                "imp": "/usr/libexec/flux/flux-imp",
                "sdexec-properties": {"MemoryMax": "90%"},
            }
        }
    )
    stats = config.introspect()
    for shown in (stats["bulk-exec"]["config"], stats["config"]):
        assert shown["flux_imp_path"] == "/usr/libexec/flux/flux-imp"
        assert shown["sdexec_properties"] == {"MemoryMax": "90%"}


def test_unset_imp_and_properties_are_left_out_as_flux_does():
    stats = parse_config({}).introspect()
    for shown in (stats["bulk-exec"]["config"], stats["config"]):
        assert "flux_imp_path" not in shown
        assert "sdexec_properties" not in shown
